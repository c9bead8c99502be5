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


@dataclass(frozen=True)
class PeerReceiveArgs:
    """A PeerReceive request, bounded: the grant's token, the sender's page layout (compared
    with the pool's as the wire message), its page count and SWA mask, the registrations of
    this daemon it already knows, and its NIXL agent name."""

    token: bytes = field(repr=False)
    layout: Any
    pages: int
    swa_mask: bytes
    known_agent: str
    known_generations: frozenset[int]
    sender: str


@dataclass(frozen=True)
class PeerDoneArgs:
    """A PeerDone request: the grant's token, whether the sender's write succeeded, why not."""

    token: bytes = field(repr=False)
    ok: bool
    message: str
