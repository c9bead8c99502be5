"""The SGLang paged allocator's configuration by KV pool
(``kvpool.integrations.sglang.allocator_config``): it imports no SGLang, so it is tested here."""

from __future__ import annotations

import gc

from kvpool.integrations.sglang.allocator_config import (
    SPACE,
    AllocatorConfig,
    AllocatorConfigs,
)


class Pool:
    """A KV pool object as SGLang hands it to the allocator: an object with no kvpool state."""


class Anything:
    """A stand-in that answers every attribute (as the MagicMock pools of SGLang's own tests
    do): nothing it says may reach the configuration."""

    def __getattr__(self, name: str) -> str:
        return f"<{name}>"


def test_any_kvcache_not_recorded_gets_the_defaults() -> None:
    configs = AllocatorConfigs()
    for kvcache in (None, Pool(), Anything(), 7, "kv"):
        assert configs.of(kvcache) == AllocatorConfig(space=SPACE, on_clear=None), kvcache
    assert SPACE == "kv"


def test_recorded_config_is_the_pools_alone() -> None:
    configs = AllocatorConfigs()
    full, swa, other = Pool(), Pool(), Pool()
    cleared: list[object] = []
    configs.set(full, AllocatorConfig(space="kv"))
    configs.set(swa, AllocatorConfig(space="swa", on_clear=cleared.append))
    assert configs.of(full) == AllocatorConfig(space="kv")
    assert configs.of(swa).space == "swa"
    hook = configs.of(swa).on_clear
    assert hook is not None
    hook("allocator")
    assert cleared == ["allocator"]
    assert configs.of(other) == AllocatorConfig()


def test_a_dropped_pool_leaves() -> None:
    configs = AllocatorConfigs()
    pool = Pool()
    configs.set(pool, AllocatorConfig(space="swa"))
    assert len(configs) == 1
    del pool
    gc.collect()
    assert len(configs) == 0
