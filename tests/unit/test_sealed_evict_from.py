"""A sealed directory on an elastic pool's page space gives back the kept pages of the groups a
reclaim takes (``SealedDirectory.evict_from``), keeping its chains' bookkeeping and the
ledger consistent (``SealedDirectory.audit``), and never a page a lease holds."""

from __future__ import annotations

import hashlib

import numpy as np

from kvpool.contract.plan import IdSpaceSpec
from kvpoold.ids.faults import DIRECTORY
from kvpoold.ids.grouped import GroupedSpace
from kvpoold.pools.sealed import SealedDirectory

PER, GROUPS, PAGE = 8, 4, 4
LAYOUT = "unit/1 sha256 tp0"


def chain(ids: np.ndarray) -> tuple[list[bytes], list[bytes], np.ndarray]:
    keys, parents, parent = [], [], bytes(32)
    for u in ids.tolist():
        key = hashlib.sha256(parent + int(u).to_bytes(4, "little")).digest()
        keys.append(key)
        parents.append(parent)
        parent = key
    return keys, parents, np.arange(ids.shape[0] * PAGE, dtype=np.int32).reshape(-1, PAGE)


def setup() -> tuple[GroupedSpace, SealedDirectory, np.ndarray]:
    spec = IdSpaceSpec(name="kv", capacity=GROUPS * PER - 1, unit="pages", bytes_per_unit=1,
                       knob="budget_bytes")
    space = GroupedSpace(spec, PER, pool="p")
    for g in range(GROUPS):
        space.commit(g)
        space.open_group(g)
    d = SealedDirectory(space, PAGE, lambda: 0.0)
    ids = np.sort(space.take(1, GROUPS * PER - 1)).astype(np.int32)  # 1..31, one chain
    keys, parents, tokens = chain(ids)
    assert d.seal(7, LAYOUT, ids, keys, parents, tokens, []) == ids.shape[0]
    return space, d, ids


def test_the_kept_pages_of_the_groups_taken_back_go_and_the_rest_stays_a_prefix() -> None:
    space, d, ids = setup()
    d.keep(1, ids)
    assert space.num_releasable == 0  # kept pages hold their groups
    out = d.evict_from(2 * PER, 100)
    assert sorted(out.tolist()) == list(range(2 * PER, GROUPS * PER))
    d.audit()
    assert space.num_releasable == 2 and d.evicted_total == 2 * PER
    assert sorted(d.orphans) == list(range(1, 2 * PER))
    # the chain's end is now the page before the groups taken back: evicted next
    assert d.evict(1).tolist() == [2 * PER - 1]
    d.audit()


def test_without_a_chain_end_in_range_the_oldest_go_and_held_pages_never_do() -> None:
    space, d, ids = setup()
    d.keep(1, ids[ids < 3 * PER])  # the pages of the last group stay the lease's (held)
    # every kept page is a parent of a page the lease holds (no chain end): the oldest go
    assert d.evict_from(PER, 3).tolist() == [PER, PER + 1, PER + 2]
    d.audit()
    assert sorted(d.evict_from(PER, 100).tolist()) == list(range(PER + 3, 3 * PER))
    d.audit()
    held = ids[ids >= 3 * PER]
    assert (space.owner_of(held) == 1).all() and all(int(u) in d.entries for u in held)
    assert space.held(DIRECTORY) == PER - 1  # ids 1..7 kept
    assert d.evict_from(3 * PER, 100).shape[0] == 0  # nothing kept there: nothing evicted
