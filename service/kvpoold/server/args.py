"""The typed requests the daemon takes (edge.py builds them from the wire)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class ConfigureArgs:
    """A Configure request: the model as HF config text or a spec mapping, plus plan options.

    ``options`` holds only the fields the caller set (keys of ``PlanOptions``). ``engine`` is
    ``sglang`` or ``vllm``; a vLLM-layout pool's knobs are ``vllm`` (the fields of
    ``VllmOptions`` the caller set) and it takes no ``options`` but ``gpu``.
    """

    pool: str
    hf_config_json: str | None = None
    spec: dict[str, Any] | None = None
    options: dict[str, Any] = field(default_factory=dict)
    dry_run: bool = False
    assume_architecture: str | None = None
    engine: str = "sglang"
    vllm: dict[str, Any] | None = None


@dataclass(frozen=True)
class LeaseRef:
    """A lease as a request names it: its id and the secret that proves it (never shown)."""

    lease_id: int
    secret: bytes = field(repr=False)

