"""Elastic pools end to end (issue 23): a real ``kvpoold serve`` with sparse /dev/shm regions,
engine processes with leases, attachments and page caches on two elastic pools of different
layouts.

- The pools trade groups under pressure: the memory behind their regions (``st_blocks``) is
  never above the daemon's budget, every page's bytes stay its writer's, every page is
  accounted for.
- A process whose group was taken back faults when it touches it (SIGSEGV), instead of reading
  what is there now.
- A SIGKILLed engine's groups come back within its TTL + 1 s.
- An engine that never acknowledges an unmap (SIGSTOPped) loses its lease at the deadline; the
  others keep theirs.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from kvpool.clients.client import KVPoolClient
from tests.conftest import run_daemon, temp_dir
from tests.e2e.test_metrics import metrics_url, scrape
from tests.procs import Child

MiB = 1 << 20
# Pool "a": 2 layers x K/V, 2 heads x 16 x bf16 = 64 B a token a view, page 16: a group is
# 2,048 pages (32,768 tokens) x 4 views = 8 MiB. Pool "b": 3 layers, 2 heads x 32: 128 B a token
# a view, 6 views: 1,024 pages (16,384 tokens) a group, 12 MiB. Each has a 2 MiB fixed part.
SPEC_A = {"num_layers": 2, "attention": {"type": "mha", "num_kv_heads": 2, "head_dim": 16},
          "context_length": 256}
SPEC_B = {"num_layers": 3, "attention": {"type": "mha", "num_kv_heads": 2, "head_dim": 32},
          "context_length": 256}
OPTIONS = {"elastic": True, "page_size": 16, "max_running_requests": 8}
GROUP_A, GROUP_B, FIXED = 8 * MiB, 12 * MiB, 2 * MiB
PAGES_A, PAGES_B = 2048, 1024
# Floors of one group each, and room for two more groups of b (or three of a) to trade.
BUDGET = 2 * FIXED + GROUP_A + GROUP_B + 2 * GROUP_B

# An engine: a lease, an attachment and a page cache on one pool. Commands (JSON lines):
# take n: allocate n pages through the cache and write the engine's tag into each page's rows
# of every view; check: every page taken still holds the tag; free n: return that many pages;
# touch page: read the page's first byte (a page of a group taken back: SIGSEGV); done.
ENGINE = r"""
import os
import torch
from kvpool.clients.client import KVPoolClient

msg = recv()
pool, tag = msg["pool"], msg["tag"]
held = []
with KVPoolClient(msg["target"]) as client, \
        client.lease(f"engine-{pool}", ttl_s=msg.get("ttl", 10.0)) as lease, \
        client.attach(pool, lease=lease) as region, \
        lease.page_cache(pool, "kv", low=0, high=msg.get("high", 64),
                         batch=min(32, msg.get("high", 64))) as cache:
    views = [name for name in region.plan.elastic.views]

    def write(ids):
        for p in ids.tolist():
            for v in views:
                region.page(v, p).view(torch.int16).fill_(tag)

    def check(ids):
        bad = 0
        for p in ids.tolist():
            for v in views:
                page = region.page(v, p).view(torch.int16)
                bad += int((page != tag).sum())
        return bad

    send({"lease_id": lease.lease_id, "pid": os.getpid()})
    while True:
        cmd = recv()
        op = cmd["op"]
        if op == "take":
            ids = cache.alloc(cmd["n"])
            write(ids)
            held.append(ids)
            send({"took": len(ids), "groups": sorted({int(p) // cmd["per"] for p in ids})})
        elif op == "check":
            send({"bad": sum(check(ids) for ids in held), "pages": sum(len(i) for i in held)})
        elif op == "free":
            n = cmd["n"]
            while n and held:
                ids = held.pop()
                cache.free(ids)
                n -= len(ids)
            cache.settle(10.0)
            lease.report_now()
            send({"held": sum(len(i) for i in held), "cached": cache.core.cached})
        elif op == "touch":
            page = region.page(views[0], cmd["page"])
            send({"value": int(page.view(torch.int16)[0].flatten()[0])})
        elif op == "done":
            break
send("closed")
"""


def backed(shm: Path) -> int:
    return sum(os.stat(f).st_blocks * 512 for f in shm.iterdir() if f.name.startswith("kvpool-"))


class Sampler:
    """Samples the memory behind the daemon's regions every few ms while it runs."""

    def __init__(self, shm: Path) -> None:
        self.shm = shm
        self.peak = 0
        self.samples = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, backed(self.shm))
            self.samples += 1
            time.sleep(0.002)

    def __enter__(self) -> Sampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()


def engine(target: str, pool: str, tag: int, **over: Any) -> Child:
    child = Child(ENGINE, timeout_s=60)
    child.send({"target": target, "pool": pool, "tag": tag, **over})
    return child


def elastic(client: KVPoolClient, pool: str) -> Any:
    stats = client.stats(pool).pool(pool).elastic
    assert stats is not None
    return stats


def daemon_in(shm: Path, sock_dir: Path, *args: str) -> Any:
    return run_daemon(sock_dir, "--shm-dir", str(shm), "--reclaim-deadline", "0.5", *args,
                      budget=str(BUDGET))


def configure(client: KVPoolClient) -> None:
    client.configure("a", spec=SPEC_A, max_total_tokens=8 * PAGES_A * 16, **OPTIONS)
    client.configure("b", spec=SPEC_B, max_total_tokens=8 * PAGES_B * 16, **OPTIONS)


@pytest.mark.timeout(180)
def test_two_engines_trade_groups_within_the_budget() -> None:
    with temp_dir() as sock_dir, temp_dir("kvp-shm-", "/dev/shm") as shm, \
            daemon_in(shm, sock_dir) as daemon, KVPoolClient(daemon.target) as client:
        configure(client)
        assert backed(shm) == 2 * FIXED + GROUP_A + GROUP_B
        with engine(daemon.target, "a", 1111) as ea, engine(daemon.target, "b", 2222) as eb, \
                Sampler(shm) as sampler:
            ea.recv(), eb.recv()
            for rnd in range(3):
                # a grows to three groups (the budget's spare room), writes and checks
                got = ea.send({"op": "take", "n": 3 * PAGES_A - 200, "per": PAGES_A}) or ea.recv()
                assert got["took"] == 3 * PAGES_A - 200 and got["groups"] == [0, 1, 2], got
                assert elastic(client, "a").granted_groups >= 3  # and one ahead, if free
                # b needs two more groups: only a can give them, once a lets go of its pages
                # (freed into its page cache, then given back on the daemon's ask)
                ea.send({"op": "free", "n": 2 * PAGES_A})
                ea.recv()
                got = eb.send({"op": "take", "n": 3 * PAGES_B - 100, "per": PAGES_B}) or eb.recv()
                assert got["took"] == 3 * PAGES_B - 100 and got["groups"] == [0, 1, 2], got
                sa, sb = elastic(client, "a"), elastic(client, "b")
                assert sb.granted_groups == 3 and sa.granted_groups == 1, (rnd, sa, sb)
                for e in (ea, eb):
                    e.send({"op": "check"})
                    assert e.recv()["bad"] == 0
                eb.send({"op": "free", "n": 3 * PAGES_B})
                eb.recv()
                ea.send({"op": "free", "n": 3 * PAGES_A})
                ea.recv()
            stats = client.stats()
            for name in ("a", "b"):
                pool = stats.pool(name)
                held = sum(x.held.get(name, {}).get("kv", 0) for x in stats.leases)
                assert pool.spaces["kv"].used == held  # every page accounted for
            for e in (ea, eb):
                e.send({"op": "done"})
                assert e.recv() == "closed"
        assert sampler.samples > 100
        assert sampler.peak <= BUDGET, f"peak {sampler.peak:,} B over the budget {BUDGET:,} B"
        assert elastic(client, "a").reclaims >= 3 and elastic(client, "a").revoked_leases == 0


@pytest.mark.timeout(120)
def test_a_process_touching_a_group_taken_back_faults() -> None:
    with temp_dir() as sock_dir, temp_dir("kvp-shm-", "/dev/shm") as shm, \
            daemon_in(shm, sock_dir) as daemon, KVPoolClient(daemon.target) as client:
        configure(client)
        with engine(daemon.target, "a", 1111, high=1) as ea, \
                engine(daemon.target, "b", 2222) as eb:
            ea.recv(), eb.recv()
            ea.send({"op": "take", "n": PAGES_A + 10, "per": PAGES_A})
            assert ea.recv()["groups"] == [0, 1]
            page = 2 * PAGES_A - 1  # the last page of a's group 1
            ea.send({"op": "touch", "page": page})
            ea.recv()
            ea.send({"op": "free", "n": PAGES_A + 10})
            ea.recv()
            eb.send({"op": "take", "n": 3 * PAGES_B - 1, "per": PAGES_B})  # needs a's group
            assert eb.recv()["took"] == 3 * PAGES_B - 1
            assert elastic(client, "a").granted_groups == 1
            ea.send({"op": "touch", "page": page})
            assert ea.proc.wait(30) == -signal.SIGSEGV, ea.stderr()
            eb.send({"op": "check"})
            assert eb.recv()["bad"] == 0
            eb.send({"op": "done"})
            assert eb.recv() == "closed"


@pytest.mark.timeout(120)
def test_a_killed_engines_groups_come_back_within_its_ttl() -> None:
    with temp_dir() as sock_dir, temp_dir("kvp-shm-", "/dev/shm") as shm, \
            daemon_in(shm, sock_dir, "--metrics-port", "0", "--log-format", "json") as daemon, \
            KVPoolClient(daemon.target) as client:
        configure(client)
        with engine(daemon.target, "a", 1111, ttl=1.0) as ea:
            ea.recv()
            ea.send({"op": "take", "n": 3 * PAGES_A - 1, "per": PAGES_A})
            assert ea.recv()["groups"][:3] == [0, 1, 2]
            assert elastic(client, "a").granted_groups >= 3  # its cache's batch may need one more
            ea.proc.kill()
            killed = time.monotonic()
            ea.proc.wait()
        while elastic(client, "a").granted_groups > 1:
            assert time.monotonic() - killed < 60.0, elastic(client, "a")
            time.sleep(0.02)
        assert backed(shm) == 2 * FIXED + GROUP_A + GROUP_B
        with client.lease("b-user", ttl_s=10) as lease:
            assert len(lease.allocate("b", "kv", 3 * PAGES_B - 1)) == 3 * PAGES_B - 1
        while elastic(client, "b").granted_groups > 1:  # its lease closed: b shrinks too
            assert time.monotonic() - killed < 60.0, elastic(client, "b")
            time.sleep(0.02)
        # /metrics says the same as Stats, for elastic pools only
        got = scrape(metrics_url(daemon.log))
        labels = {"device": "cpu", "pool": "a"}
        assert got.get("kvpool_elastic_granted_bytes", **labels) == FIXED + GROUP_A
        assert got.get("kvpool_elastic_groups", **labels, state="granted", unit="groups") == 1
        stats = elastic(client, "a")
        assert stats.reclaims >= 2
        assert got.get("kvpool_elastic_reclaims_total", **labels, unit="groups") == stats.reclaims
        assert got.get("kvpool_elastic_backed_bytes", device="cpu", pool="b") == FIXED + GROUP_B
        assert elastic(client, "b").reclaims == 2


@pytest.mark.timeout(120)
def test_an_engine_that_never_unmaps_loses_its_lease_and_the_others_keep_theirs() -> None:
    with temp_dir() as sock_dir, temp_dir("kvp-shm-", "/dev/shm") as shm, \
            daemon_in(shm, sock_dir) as daemon, KVPoolClient(daemon.target) as client:
        configure(client)
        with engine(daemon.target, "a", 1111, high=1) as ea, \
                engine(daemon.target, "a", 3333) as other, client.lease("b-user") as lb:
            a_lease = ea.recv()["lease_id"]
            other_lease = other.recv()["lease_id"]
            ea.send({"op": "take", "n": PAGES_A + 10, "per": PAGES_A})
            ea.recv()
            ea.send({"op": "free", "n": PAGES_A + 10})
            ea.recv()
            os.kill(ea.proc.pid, signal.SIGSTOP)  # it can neither unmap nor acknowledge
            try:
                got = lb.allocate("b", "kv", 3 * PAGES_B - 1)  # waits out a's 0.5 s deadline
                assert len(got) == 3 * PAGES_B - 1
                leases = {x.lease_id for x in client.stats().leases}
                assert a_lease not in leases and other_lease in leases
                assert elastic(client, "a").revoked_leases == 1
            finally:
                os.kill(ea.proc.pid, signal.SIGCONT)
            other.send({"op": "check"})
            assert other.recv()["bad"] == 0
            other.send({"op": "done"})
            assert other.recv() == "closed"
