"""The architecture table: which sizing module plans a spec, chosen by what the spec declares.

Order matters (most specific first): DeepSeek-V4 compression, hybrid linear, DSA, sliding
window, MLA, MHA. No code outside this table branches on architecture names.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from kvpool.contract.errors import InvalidArgument
from kvpool.contract.options import KVCacheDType
from kvpool.contract.plan import BufferSpec
from kvpool.contract.spec import ModelSpec
from kvpoold.sizing import dsa, dsv4, hybrid_linear, hybrid_swa, mha, mla
from kvpoold.sizing.common import Sizing, SizingContext


@dataclass(frozen=True)
class Architecture:
    """One sizing module: when it applies, its numbers, and its buffers."""

    name: str
    matches: Callable[[ModelSpec], bool]
    size: Callable[[SizingContext], Sizing]
    layout: Callable[[SizingContext, Sizing], list[BufferSpec]]
    # architecture names this module can report (hybrid_swa also reports all_swa)
    reports: tuple[str, ...] = ()
    # the page size SGLang takes for this family given --page-size (DSA: always 64)
    page_size_for: Callable[[int], int] | None = None
    # what `--kv-cache-dtype auto` means for this family when SGLang overrides it (DSA: bf16)
    auto_kv_cache_dtype: KVCacheDType | None = None


ARCHITECTURES: tuple[Architecture, ...] = tuple(
    Architecture(
        name=m.NAME,
        matches=m.matches,
        size=m.size,
        layout=m.layout,
        reports=getattr(m, "REPORTS", (m.NAME,)),
        page_size_for=getattr(m, "page_size_for", None),
        auto_kv_cache_dtype=getattr(m, "AUTO_KV_CACHE_DTYPE", None),
    )
    for m in (dsv4, hybrid_linear, dsa, hybrid_swa, mla, mha)
)

KNOWN_ARCHITECTURES: tuple[str, ...] = tuple(n for a in ARCHITECTURES for n in a.reports)


def select_architecture(spec: ModelSpec) -> Architecture:
    """The first table entry whose ``matches`` accepts the spec.

    Raises:
        InvalidArgument: when none does, listing the known architectures.
    """
    for arch in ARCHITECTURES:
        if arch.matches(spec):
            return arch
    raise InvalidArgument(
        f"no sizing module accepts this spec (known: {', '.join(KNOWN_ARCHITECTURES)})",
        field="model",
    )


def get_architecture(name: str) -> Architecture:
    """Look a module up by name (``mha``, ``hybrid_swa``...).

    Raises:
        InvalidArgument: for an unknown name, listing the known ones.
    """
    for arch in ARCHITECTURES:
        if name in arch.reports:
            return arch
    raise InvalidArgument(
        f"unknown architecture {name!r} (known: {', '.join(KNOWN_ARCHITECTURES)})",
        field="architecture",
    )
