"""What kvpool's paged allocator is told about the KV pool SGLang builds it for: the id space
it takes pages from and what its ``clear`` also does, set by the code that built the pool.

SGLang builds a paged allocator with its own arguments only (``size``, ``page_size``, ...,
``kvcache``, ``need_sort``), and ``kvcache`` may be any object: a kvpool KV pool, SGLang's own,
a test's mock. So the allocator reads nothing from it: the code that builds a KV pool needing
more than the default (``swa.py``, for the two sides of SGLang's hybrid SWA pool) records the
allocator's configuration here, by pool object, and the allocator asks :data:`CONFIGS` for the
``kvcache`` it is given; any other ``kvcache`` gets :class:`AllocatorConfig`'s defaults (the
pool's ``kv`` space, nothing more on clear). This module imports nothing of SGLang's.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

SPACE = "kv"


@dataclass(frozen=True)
class AllocatorConfig:
    """A paged allocator's configuration.

    Attributes:
        space: the id space of the pool its pages are taken from.
        on_clear: called with the allocator at each ``clear`` (the first one runs in its
            constructor), or None.
    """

    space: str = SPACE
    on_clear: Callable[[Any], None] | None = None


class AllocatorConfigs:
    """The configurations recorded for KV pools, by pool object (held weakly: a pool SGLang
    drops leaves with its entry)."""

    def __init__(self) -> None:
        self._by_pool: weakref.WeakKeyDictionary[Any, AllocatorConfig] = (
            weakref.WeakKeyDictionary())

    def set(self, pool: Any, config: AllocatorConfig) -> None:
        """The allocator built for ``pool`` takes ``config``."""
        self._by_pool[pool] = config

    def __len__(self) -> int:
        """How many live pools have a configuration recorded."""
        return len(self._by_pool)

    def of(self, kvcache: Any) -> AllocatorConfig:
        """The configuration recorded for ``kvcache``, else the defaults (whatever
        ``kvcache`` is: None, SGLang's own pool, a mock)."""
        try:
            config = self._by_pool.get(kvcache)
        except TypeError:  # no weak reference to it (None, ...): nothing was recorded
            config = None
        return AllocatorConfig() if config is None else config


# One per process: SGLang hands the allocator nothing but the pool to find its configuration by.
CONFIGS = AllocatorConfigs()

__all__ = ["CONFIGS", "SPACE", "AllocatorConfig", "AllocatorConfigs"]
