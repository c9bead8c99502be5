"""The typed request the daemon takes for Configure (edge.py builds it from the wire)."""

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
