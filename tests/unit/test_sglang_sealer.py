"""The SGLang plugin's sealer (``kvpool.integrations.sglang.sealer.Sealer``) without SGLang:
a real daemon, a real lease and page cache, the sealer's own calls as its radix hook and the
allocator make them. What the radix tree took is sealed at the next step with SGLang's page
keys (a chain continued from the tree's page before it), a page freed before the step is
not, a sealed page SGLang frees goes to the daemon's directory and never back into the page
cache, and the rest of a free goes to the cache."""

from __future__ import annotations

import itertools
from array import array
from collections.abc import Iterator

import numpy as np
import pytest
import torch

from kvpool import KVPoolClient
from kvpool.integrations.sglang.page_keys import ZERO_KEY, chain_keys
from kvpool.integrations.sglang.seal_settings import SealSettings
from kvpool.integrations.sglang.sealer import Sealer
from tests.conftest import TINY_OPTIONS, TINY_PAGES, TINY_SPEC, DaemonProcess, run_daemon, temp_dir

PS = TINY_OPTIONS["page_size"]
_names = itertools.count()


def insert(sealer: Sealer, tokens: np.ndarray, pages: np.ndarray,
           ranges: list[tuple[int, int]]) -> None:
    """What the radix hook hands the sealer for an insert of ``tokens`` (SGLang's int64 array)
    whose KV lies in ``pages`` (its KV indices: page * page_size + offset), the tree taking
    ``ranges``."""
    value = torch.from_numpy((pages.astype(np.int64)[:, None] * PS + np.arange(PS)).reshape(-1))
    sealer.inserted(array("q", tokens.astype(np.int64).tobytes()), len(tokens), ranges, value)


@pytest.fixture(scope="module")
def daemon() -> Iterator[DaemonProcess]:
    with temp_dir() as path, run_daemon(path) as proc:
        yield proc


@pytest.fixture
def setup(daemon: DaemonProcess) -> Iterator[tuple[KVPoolClient, str, Sealer, object]]:
    pool = f"sl{next(_names)}"
    with KVPoolClient(daemon.target) as client:
        client.configure(pool, spec=TINY_SPEC, **TINY_OPTIONS)
        with client.lease("engine") as lease, \
                lease.page_cache(pool, low=0, high=16, batch=16) as cache:
            sealer = Sealer(lease=lease, pool=pool, capacity=TINY_PAGES, page_size=PS,
                            device="cpu", layout="test layout", settings=SealSettings())
            sealer.bind(cache)
            yield client, pool, sealer, cache
            sealer.close()
        client.drop(pool, force=True)


def test_the_tree_s_pages_are_sealed_at_the_next_step_with_sglang_s_keys(setup) -> None:
    client, pool, sealer, cache = setup
    tokens = np.arange(3, 3 + 4 * PS).astype(np.uint32)
    first = cache.alloc(3)
    insert(sealer, tokens[:3 * PS], first, [(0, 3 * PS)])
    assert client.sealed(pool).held == 0  # nothing before the step
    sealer.flush()
    assert sealer.worker.flush(30)
    assert client.sealed(pool).held == 3
    keys = chain_keys(tokens, PS)
    assert [sealer.keys[p].tobytes() for p in first] == keys[:3]
    assert sealer.parents[first[0]].tobytes() == ZERO_KEY
    # A later insert of the same request: the tree holds the first 3 pages (the request's
    # pages there are the tree's), and took the 4th; its parent is the tree's 3rd page.
    fourth = cache.alloc(1)
    insert(sealer, tokens, np.concatenate([first, fourth]), [(3 * PS, 4 * PS)])
    sealer.flush()
    assert sealer.worker.flush(30)
    assert sealer.keys[fourth[0]].tobytes() == keys[3]
    assert sealer.parents[fourth[0]].tobytes() == keys[2]
    assert client.sealed(pool).held == 4


def test_a_page_freed_before_the_step_is_not_sealed(setup) -> None:
    client, pool, sealer, cache = setup
    ids = cache.alloc(2)
    insert(sealer, np.arange(2 * PS), ids, [(0, 2 * PS)])
    rest = sealer.freed(ids[1:].astype(np.int64))  # evicted in the same step
    assert rest.tolist() == ids[1:].tolist()  # not sealed: for the cache
    cache.free(rest)
    sealer.flush()
    assert sealer.worker.flush(30)
    assert client.sealed(pool).held == 1 and sealer.sealed[ids[0]]


def test_sealed_pages_freed_go_to_the_directory_never_back_to_the_cache(setup) -> None:
    client, pool, sealer, cache = setup
    ids = cache.alloc(3)
    insert(sealer, np.arange(2 * PS), ids[:2], [(0, 2 * PS)])
    sealer.flush()
    assert sealer.worker.flush(30)
    rest = sealer.freed(ids.astype(np.int64))  # two sealed, one not
    assert rest.tolist() == [int(ids[2])]
    cache.free(rest)
    assert not cache.in_use_of(ids).any()
    assert not np.isin(cache.core.ring.cached_ids(), ids[:2]).any()
    assert sealer.worker.flush(30)
    directory = client.sealed(pool)
    assert directory.held == 0 and directory.kept == 2
    assert not sealer.sealed[ids].any() and not sealer.by_key
