"""The typed requests the daemon takes (edge.py builds them from the wire)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class ConfigureArgs:
    """A Configure request: the model as HF config text or a spec mapping, plus plan options.

    ``options`` holds only the fields the caller set (keys of ``PlanOptions``).
    """

    pool: str
    hf_config_json: str | None = None
    spec: dict[str, Any] | None = None
    options: dict[str, Any] = field(default_factory=dict)
    dry_run: bool = False


@dataclass(frozen=True)
class LeaseRef:
    """A lease as a request names it: its id and the secret that proves it (never shown)."""

    lease_id: int
    secret: bytes = field(repr=False)
