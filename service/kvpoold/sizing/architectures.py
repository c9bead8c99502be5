"""SGLang's architecture table, read: which family SGLang builds for a HF class name.

The rows are generated data (``sglang_architectures.json`` beside this module, from SGLang
0.5.23's model registry by ``tests/sglang/gen_architectures.py``); this module gives them a
type, names the families kvpool plans, and finds the nearest known names for a refusal.
``kvpoold.hf`` chooses a loader from the row (docs/sizing.md: the loader rule of each family).
"""

from __future__ import annotations

import difflib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from kvpool.contract.plan import ASSUMABLE_FAMILIES

DATA = Path(__file__).with_name("sglang_architectures.json")
_TABLE: dict[str, Any] = json.loads(DATA.read_text(encoding="utf-8"))
SGLANG_VERSION: str = _TABLE["sglang_version"]
# name -> (family, kv, when, config_class, generation, mm), as the data file's columns
ROWS: dict[str, tuple[str, str, str, str, bool, str]] = {
    name: tuple(values) for name, values in _TABLE["rows"].items()  # type: ignore[misc]
}

Family = Literal["mha", "mla", "dsa", "hybrid_swa", "hybrid_gdn", "hybrid_mamba", "hybrid_kda",
                 "hybrid_lightning", "mamba", "dsv4"]

# Families `--assume-architecture` accepts (one definition, in the contract).
ASSUMABLE: tuple[str, ...] = ASSUMABLE_FAMILIES

# Families SGLang builds that kvpool cannot read from a HF config, and what to do instead.
UNSUPPORTED: dict[str, str] = {
    "hybrid_lightning": "lightning attention state pools are not modelled by kvpool yet",
    "mamba": "a pure state-space model has no KV cache; kvpool does not plan state-only pools",
}


@dataclass(frozen=True)
class Row:
    """One architecture of SGLang's registry.

    ``family``: the pool SGLang builds (``mla`` rows may become ``dsa``: see ``when``);
    ``kv``: what a full-attention layer stores (mha, mla, none); ``when``: the config keys that
    change the family (``"dsa: index_topk"``, ``"mla: kv_lora_rank"``, a hybrid-SWA or
    state-pool condition); ``config_class``: SGLang's config class for it ("" unknown);
    ``generation``: False for embedding / reward / classifier classes; ``mm``: ``"listed"`` in
    SGLang's multimodal architectures, ``"disabled"`` where SGLang turns multimodal off unless
    ``--enable-multimodal``, else "".
    """

    name: str
    family: str
    kv: str
    when: str
    config_class: str
    generation: bool
    mm: str

    @property
    def dsa_with_index_topk(self) -> bool:
        return "dsa: index_topk" in self.when

    @property
    def mla_only_with(self) -> str | None:
        """The config key without which this MLA row is plain MHA (``kv_lora_rank``)."""
        for part in self.when.split("; "):
            if part.startswith("mla: "):
                return part.removeprefix("mla: ")
        return None


def row(name: str) -> Row | None:
    """The table row of a HF class name, or None when SGLang's registry has no such class."""
    values = ROWS.get(name)
    return None if values is None else Row(name, *values)


def nearest(name: str, count: int = 3) -> list[str]:
    """The known class names closest to ``name`` (difflib), best first."""
    close = difflib.get_close_matches(name, ROWS, n=count, cutoff=0.6)
    if close:
        return close
    lowered = {n.lower(): n for n in ROWS}
    return [lowered[n] for n in difflib.get_close_matches(name.lower(), lowered, n=count,
                                                          cutoff=0.0)]


def counts() -> dict[str, int]:
    """Rows per family (docs and the report)."""
    out: dict[str, int] = {}
    for values in ROWS.values():
        out[values[0]] = out.get(values[0], 0) + 1
    return dict(sorted(out.items()))


__all__ = ["ASSUMABLE", "DATA", "ROWS", "SGLANG_VERSION", "UNSUPPORTED", "Family", "Row",
           "counts", "nearest", "row"]
