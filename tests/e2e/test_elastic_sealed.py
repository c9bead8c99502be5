"""Sealed pages in elastic pools (issue 40): a real ``kvpoold serve`` with two elastic pools on
one budget, real shared memory, engines in child processes.

An engine of pool ``a`` seals its pages and exits: its directory keeps them, holding groups of
``a`` the budget would give pool ``b``. When ``b`` needs those groups, the reclaim takes the
kept sealed pages first (evicted, chains from their end), never a page another lease of ``a``
uses; what the directory still keeps is adopted by the next engine of ``a``, with the bytes
the dead engine wrote.
"""

from __future__ import annotations

import hashlib
import signal
from typing import Any

import numpy as np
import pytest
import torch

from kvpool.clients.client import KVPoolClient
from tests.conftest import temp_dir
from tests.e2e.test_elastic_e2e import PAGES_A, PAGES_B, configure, daemon_in, elastic, engine
from tests.e2e.test_sealed import wait_lease_gone
from tests.procs import Child

LAYOUT = "test-engine/1.0 sha256 tp0"
PAGE = 16
# A sealer on pool "a": lease, attach (registering this process: the fence), allocate n pages,
# write each page's id (mod 2**15) into every view, seal them as one hash chain, answer, then
# idle until killed (its lease expires: the directory keeps the pages; the process is gone: they
# are adoptable).
SEALER = r"""
import hashlib
import numpy as np
import torch
from kvpool.clients.client import KVPoolClient

msg = recv()
client = KVPoolClient(msg["target"])
lease = client.lease("sealer", ttl_s=1.0)
region = client.attach("a", lease=lease).__enter__()
views = list(region.plan.elastic.views)
pages = lease.allocate("a", "kv", msg["n"])
keys, parents, tokens = [], [], []
parent = bytes(32)
for i, p in enumerate(pages.tolist()):
    for v in views:
        region.page(v, p).view(torch.int16).fill_(p % 32768)
    toks = np.arange(i * 16, (i + 1) * 16, dtype=np.int32)
    key = hashlib.sha256(parent + toks.tobytes()).digest()
    keys.append(key)
    parents.append(parent)
    tokens.append(toks)
    parent = key
sealed = lease.seal("a", msg["layout"], pages, keys, parents, np.concatenate(tokens))
send({"pages": pages.tolist(), "sealed": sealed, "lease_id": lease.lease_id,
      "keys": [k.hex() for k in keys]})
recv()
"""


def chain_keys(n: int) -> list[str]:
    out, parent = [], bytes(32)
    for i in range(n):
        parent = hashlib.sha256(parent + np.arange(i * PAGE, (i + 1) * PAGE,
                                                   dtype=np.int32).tobytes()).digest()
        out.append(parent.hex())
    return out


@pytest.mark.timeout(180)
def test_kept_sealed_pages_yield_to_an_elastic_reclaim_before_live_pages_and_the_rest_are_adopted(
        ) -> None:
    with temp_dir() as sock_dir, temp_dir("kvp-shm-", "/dev/shm") as shm, \
            daemon_in(shm, sock_dir) as daemon, KVPoolClient(daemon.target) as client:
        configure(client)
        # a live engine of a: pages in a's first group, its tag in every byte
        with engine(daemon.target, "a", 1111) as live, engine(daemon.target, "b", 2222) as eb:
            live.recv(), eb.recv()
            got = live.send({"op": "take", "n": 500, "per": PAGES_A}) or live.recv()
            assert got["took"] == 500 and got["groups"] == [0], got
            # the sealer fills a up to three groups (the budget's spare room) and exits
            n = 2 * PAGES_A + 1000
            with Child(SEALER, timeout_s=120) as sealer:
                sealer.send({"target": daemon.target, "n": n, "layout": LAYOUT})
                sealed: dict[str, Any] = sealer.recv()
                assert sealed["sealed"] == n
                assert {p // PAGES_A for p in sealed["pages"]} == {0, 1, 2}
                assert elastic(client, "a").granted_groups >= 3  # and one ahead, if free
                sealer.proc.send_signal(signal.SIGKILL)  # a crash: its lease expires
                sealer.proc.wait(30)
            wait_lease_gone(client, sealed["lease_id"])
            s = client.sealed("a")
            assert (s.kept, s.held, s.evicted_total) == (n, 0, 0)  # kept past the lease
            assert elastic(client, "a").granted_groups >= 3  # kept pages hold their groups

            # b needs two more groups: only a's, held by the kept sealed pages
            got = eb.send({"op": "take", "n": 3 * PAGES_B - 100, "per": PAGES_B}) or eb.recv()
            assert got["took"] == 3 * PAGES_B - 100 and got["groups"] == [0, 1, 2], got
            assert elastic(client, "a").granted_groups == 1
            assert elastic(client, "b").granted_groups == 3
            s = client.sealed("a")
            # every sealed page of groups 1 and 2 was evicted, the chain from its end
            in_taken = sum(1 for p in sealed["pages"] if p >= PAGES_A)
            assert s.evicted_total >= in_taken and s.kept == n - s.evicted_total > 0
            # the live engine's pages were not touched: still its, with its bytes
            live.send({"op": "check"})
            assert live.recv() == {"bad": 0, "pages": 500}
            stats = client.stats()
            held = sum(x.held.get("a", {}).get("kv", 0) for x in stats.leases)
            assert stats.pool("a").spaces["kv"].used == held + s.kept  # all accounted for

            # the next engine of a adopts what the directory still keeps: a chain's prefix,
            # with the dead sealer's bytes
            with client.lease("next", ttl_s=30) as lease, \
                    client.attach("a", lease=lease) as region:
                a = lease.adopt("a", LAYOUT)
                assert a.unfenced == 0 and a.corrupt == 0 and a.ids.shape[0] == s.kept
                assert [k.hex() for k in a.keys] == chain_keys(n)[:s.kept]
                assert a.ids.tolist() == sealed["pages"][:s.kept]
                assert all(p < PAGES_A for p in a.ids.tolist())
                view = next(iter(region.plan.elastic.views))
                for p in a.ids.tolist()[:: max(1, s.kept // 64)]:
                    assert bool((region.page(view, p).view(torch.int16) == p % 32768).all())
                assert a.epoch == 1
            for e in (live, eb):
                e.send({"op": "done"})
                assert e.recv() == "closed"
        s = client.sealed("a")
        assert s.adopted_total == a.ids.shape[0]


@pytest.mark.timeout(180)
def test_an_elastic_pool_grows_before_it_evicts_its_own_sealed_pages() -> None:
    with temp_dir() as sock_dir, temp_dir("kvp-shm-", "/dev/shm") as shm, \
            daemon_in(shm, sock_dir) as daemon, KVPoolClient(daemon.target) as client:
        configure(client)
        n = 1000
        with Child(SEALER, timeout_s=120) as sealer:
            sealer.send({"target": daemon.target, "n": n, "layout": LAYOUT})
            sealed: dict[str, Any] = sealer.recv()
            assert sealed["sealed"] == n
            sealer.proc.send_signal(signal.SIGKILL)
            sealer.proc.wait(30)
        wait_lease_gone(client, sealed["lease_id"])
        with client.lease("big", ttl_s=30) as lease:
            # free budget first: a grows (1,500 pages are more than its floor group has free
            # yet fewer than it keeps sealed), then to three groups; every sealed page kept
            lease.allocate("a", "kv", 1500)
            assert client.sealed("a").evicted_total == 0
            lease.allocate("a", "kv", 3500)
            s = client.sealed("a")
            assert (s.kept, s.evicted_total) == (n, 0)
            assert elastic(client, "a").granted_groups >= 3
            # past the budget (b sits at its floor: no group can come): a's own kept pages
            # yield, as many as it is short, from the chain's end
            capacity = 4 * PAGES_A - 1  # a's cap in this budget: the floor and three groups
            want = 2500
            lease.allocate("a", "kv", want)
            short = want - (capacity - n - 5000)
            s = client.sealed("a")
            assert (s.kept, s.evicted_total) == (n - short, short)
            assert elastic(client, "a").granted_groups == 4
        with client.lease("next", ttl_s=30) as lease:
            a = lease.adopt("a", LAYOUT)
            assert a.ids.tolist() == sealed["pages"][:n - short]
