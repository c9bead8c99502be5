"""Sealed pages outlive their engine (issue 40, the daemon's part): a real ``kvpoold serve``, an
engine in a child process that maps the pool, writes pages and seals them, and a second lease
that adopts them.

The fence is a fact: while the engine process lives (here SIGSTOPped, its lease expired), none
of its pages is adopted; once it is killed, all are, with the bytes it wrote. A page written
after it was sealed is found at adoption (CPU checksum) and freed, never adopted; another
layout adopts nothing; the directory's pages give way to an Allocate before it is refused,
a chain from its end (what stays is a prefix the next engine can place).
"""

from __future__ import annotations

import hashlib
import signal
import time

import numpy as np
import pytest

from kvpool.clients.client import KVPoolClient
from tests.conftest import TINY_OPTIONS, TINY_PAGES, TINY_SPEC, run_daemon, temp_dir
from tests.e2e.test_daemon import kvpool_cli
from tests.e2e.test_metrics import metrics_url, scrape
from tests.procs import Child

PAGE = 16
LAYOUT = "test-engine/1.0 sha256 tp0"
TTL_S = 1.0
# The engine: lease, attach (registering this process), allocate, write a pattern per page,
# seal the pages with a hash chain over their tokens, answer, then idle until told or killed.
ENGINE = r"""
import hashlib
import numpy as np
from kvpool.clients.client import KVPoolClient

msg = recv()
client = KVPoolClient(msg["target"])
lease = client.lease("engine", ttl_s=msg["ttl_s"])
attached = client.attach("tiny", lease=lease)
region = attached.__enter__()
pages = lease.allocate("tiny", "kv", msg["n"])
keys, parents, tokens = [], [], []
parent = bytes(32)
for i, p in enumerate(pages.tolist()):
    toks = np.arange(i * 16, (i + 1) * 16, dtype=np.int32)
    for name in ("k.0", "v.0", "k.1", "v.1"):
        region.page(name, p)[:] = float(p)
    key = hashlib.sha256(parent + toks.tobytes()).digest()
    keys.append(key)
    parents.append(parent)
    tokens.append(toks)
    parent = key
sealed = lease.seal("tiny", msg["layout"], pages, keys, parents, np.concatenate(tokens))
send({"pages": pages.tolist(), "sealed": sealed, "lease_id": lease.lease_id,
      "keys": [k.hex() for k in keys]})
if recv() == "shutdown":  # a clean shutdown: detach, end the lease, then exit
    attached.__exit__(None, None, None)  # unmap and Detach
    lease.close()
    send("closed")
    recv()
"""


def adopt(client: KVPoolClient, layout: str = LAYOUT):  # type: ignore[no-untyped-def]
    with client.lease("next", ttl_s=30) as lease:
        return lease.adopt("tiny", layout)


@pytest.fixture
def daemon():  # type: ignore[no-untyped-def]
    with temp_dir() as sock_dir, temp_dir("kvp-shm-", "/dev/shm") as shm, \
            run_daemon(sock_dir, "--shm-dir", str(shm), "--metrics-port", "0",
                       "--log-format", "json") as d, KVPoolClient(d.target) as client:
        client.configure("tiny", spec=TINY_SPEC, **TINY_OPTIONS)
        yield d, client


def start_engine(target: str, n: int) -> tuple[Child, dict]:  # type: ignore[type-arg]
    engine = Child(ENGINE, timeout_s=60)
    engine.send({"target": target, "n": n, "ttl_s": TTL_S, "layout": LAYOUT})
    return engine, engine.recv()


def wait_lease_gone(client: KVPoolClient, lease_id: int) -> None:
    deadline = time.monotonic() + 60  # a ceiling for a hang only
    while any(x.lease_id == lease_id for x in client.stats().leases):
        assert time.monotonic() < deadline, "the engine's lease never expired"
        time.sleep(0.05)


def test_a_frozen_engines_pages_wait_and_a_dead_ones_are_adopted_with_their_bytes(
        daemon) -> None:  # type: ignore[no-untyped-def]
    d, client = daemon
    engine, got = start_engine(d.target, 8)
    assert got["sealed"] == 8
    pages = got["pages"]
    engine.proc.send_signal(signal.SIGSTOP)  # frozen: its keep-alive stops, it still maps
    try:
        wait_lease_gone(client, got["lease_id"])
        s = client.sealed("tiny")
        assert (s.kept, s.held, s.sealed_total) == (8, 0, 8)  # kept past the lease, not freed
        assert client.stats("tiny").pool("tiny").spaces["kv"].used == 8
        none = adopt(client)
        assert none.ids.shape[0] == 0 and none.unfenced == 8  # it lives: nothing adopted
    finally:
        engine.proc.send_signal(signal.SIGKILL)
        engine.proc.wait(30)
    with client.lease("next", ttl_s=30) as lease, \
            client.attach("tiny", lease=lease) as region:
        a = lease.adopt("tiny", LAYOUT)
        assert sorted(a.ids.tolist()) == sorted(pages) and a.unfenced == 0 and a.corrupt == 0
        assert [k.hex() for k in a.keys] == got["keys"]  # parents before children: chain order
        assert a.parents[0] == bytes(32) and a.parents[1:] == a.keys[:-1]
        assert a.tokens.shape == (8, PAGE) and a.tokens[3].tolist() == list(range(48, 64))
        for p in a.ids.tolist():  # the bytes the dead engine wrote, zero-copy
            assert bool((region.page("k.1", p) == float(p)).all())
        assert a.epoch == 1
        assert client.sealed("tiny").held == 8  # the lease's now, sealed still
        assert lease.free("tiny", "kv", a.ids) == 8
    s = client.sealed("tiny")
    assert (s.kept, s.adopted_total) == (8, 8)  # freed by the adopter: kept again
    shown = client.stats("tiny").pool("tiny").sealed  # Stats: the counts, not the listing
    assert shown is not None and shown.layouts == () and shown.oldest_seconds == 0.0
    assert (shown.kept, shown.held, shown.kept_bytes, shown.sealed_total, shown.adopted_total,
            shown.epoch) == (s.kept, s.held, s.kept_bytes, 8, 8, 1)


def test_a_page_written_after_sealing_is_not_adopted_and_another_layout_adopts_nothing(
        daemon) -> None:  # type: ignore[no-untyped-def]
    d, client = daemon
    engine, got = start_engine(d.target, 4)
    engine.proc.send_signal(signal.SIGKILL)
    engine.proc.wait(30)
    wait_lease_gone(client, got["lease_id"])
    assert adopt(client, "another-engine/2.0").other_layout == 4
    bad = got["pages"][2]
    with client.lease("stray", ttl_s=30) as lease, \
            client.attach("tiny", lease=lease) as region:
        region.page("v.0", bad)[0, 0, 0] = -1.0  # a write into a page the directory keeps
    free_before = client.stats("tiny").pool("tiny").spaces["kv"].free
    a = adopt(client)
    assert a.corrupt == 1 and bad not in a.ids.tolist() and a.ids.shape[0] == 3
    assert client.stats("tiny").pool("tiny").spaces["kv"].free >= free_before + 1  # freed
    assert client.sealed("tiny").corrupt_total == 1


def test_the_directorys_pages_give_way_to_an_allocate_before_it_is_refused(daemon) -> None:  # type: ignore[no-untyped-def]
    d, client = daemon
    engine, got = start_engine(d.target, 6)
    engine.proc.send_signal(signal.SIGKILL)
    engine.proc.wait(30)
    wait_lease_gone(client, got["lease_id"])
    capacity = TINY_PAGES  # ids 1..256
    with client.lease("big", ttl_s=30) as lease:
        ids = lease.allocate("tiny", "kv", capacity - 2)  # 4 of the 6 kept pages must go
        assert ids.shape[0] == capacity - 2
        s = client.sealed("tiny")
        assert (s.kept, s.evicted_total) == (2, 4)
        # one hash chain of 6 pages: given back from its end, so what stays is its prefix
        assert set(got["pages"][2:]) <= set(ids.tolist())
        with pytest.raises(Exception, match="kv"):  # live pages are never taken
            lease.allocate("tiny", "kv", 3)
    # the engine is dead: the next one adopts the chain's first two pages, a placeable prefix
    adopted = adopt(client)
    assert adopted.ids.tolist() == got["pages"][:2]
    assert [k.hex() for k in adopted.keys] == got["keys"][:2]


def test_a_lease_that_frees_a_sealed_page_hands_it_to_the_directory(daemon) -> None:  # type: ignore[no-untyped-def]
    _d, client = daemon
    with client.lease("one", ttl_s=30) as lease:
        ids = lease.allocate("tiny", "kv", 3)
        toks = np.arange(3 * PAGE, dtype=np.int32)
        keys = [hashlib.sha256(bytes([i])).digest() for i in range(3)]
        assert lease.seal("tiny", LAYOUT, ids[:2], keys[:2], [bytes(32)] * 2, toks[:2 * PAGE]) == 2
        assert lease.seal("tiny", LAYOUT, ids[:1], keys[:1], [bytes(32)], toks[:PAGE]) == 0
        used = client.stats("tiny").pool("tiny").spaces["kv"].used
        assert lease.free("tiny", "kv", ids) == 3
        s = client.sealed("tiny")
        assert (s.kept, s.held) == (2, 0)
        assert client.stats("tiny").pool("tiny").spaces["kv"].used == used - 1
        shown = kvpool_cli("stats", "--target", _d.target)
        assert "sealed     0 held by leases, 2 kept" in shown.stdout, shown.stdout
    # a lease that registered no process (this one never mapped): its pages are never adopted
    assert adopt(client).unfenced == 2
    shown = kvpool_cli("sealed", "tiny", "--target", _d.target)
    assert shown.returncode == 0, shown.stderr
    assert "tiny: 2 sealed pages kept" in shown.stdout and LAYOUT in shown.stdout
    evicted = kvpool_cli("sealed", "tiny", "--evict", "--target", _d.target)
    assert "evicted 2 pages" in evicted.stdout, evicted.stdout + evicted.stderr
    assert client.sealed("tiny").kept == 0
    m = scrape(metrics_url(_d.log))  # the same numbers on /metrics
    tiny = {"device": "cpu", "pool": "tiny"}
    assert m.get("kvpool_pages_sealed_total", **tiny) == 2
    assert m.get("kvpool_sealed_evicted_pages_total", **tiny) == 2
    assert m.get("kvpool_sealed_pages", holder="directory", **tiny) == 0
    assert m.get("kvpool_sealed_kept_bytes", **tiny) == 0



def test_unseal_takes_held_pages_out_of_the_directory_and_the_lease_keeps_them(daemon) -> None:  # type: ignore[no-untyped-def]
    """An engine about to write a sealed page again (vLLM reusing a cached block) unseals it:
    out of the directory, still the lease's; freed then, it is not kept. Another lease's page
    is refused and nothing is unsealed; a page not sealed counts 0."""
    _d, client = daemon
    with client.lease("one", ttl_s=30) as lease, client.lease("two", ttl_s=30) as other:
        ids = lease.allocate("tiny", "kv", 3)
        theirs = other.allocate("tiny", "kv", 1)
        toks = np.arange(3 * PAGE, dtype=np.int32)
        keys = [hashlib.sha256(bytes([i])).digest() for i in range(3)]
        assert lease.seal("tiny", LAYOUT, ids, keys, [bytes(32)] * 3, toks) == 3
        with pytest.raises(Exception, match="nothing was unsealed"):
            lease.unseal("tiny", np.concatenate([ids[:1], theirs]))
        assert client.sealed("tiny").held == 3
        assert lease.unseal("tiny", ids[:2]) == 2
        assert lease.unseal("tiny", ids[:2]) == 0  # not sealed any more
        s = client.sealed("tiny")
        assert (s.held, s.kept, s.sealed_total) == (1, 0, 3)
        used = client.stats("tiny").pool("tiny").spaces["kv"].used
        assert used == 4  # the lease keeps the unsealed pages
        assert lease.free("tiny", "kv", ids) == 3
        s = client.sealed("tiny")
        assert (s.held, s.kept) == (0, 1)  # only the page still sealed is kept
        # sealed again (the engine cached new content in a page it reused): a fresh entry
        again = other.seal("tiny", LAYOUT, theirs, [hashlib.sha256(b"x").digest()],
                           [bytes(32)], toks[:PAGE])
        assert again == 1 and client.sealed("tiny").held == 1


def test_a_cleanly_shut_down_engines_pages_are_adopted_once_its_process_exits(daemon) -> None:  # type: ignore[no-untyped-def]
    """The usual restart: the engine detaches and ends its lease itself, then exits. Its
    detach is its word, not a fact (a mapping outlives it): its pages wait until the process
    is gone, then are adopted as a killed engine's are."""
    d, client = daemon
    engine, got = start_engine(d.target, 4)
    engine.send("shutdown")
    assert engine.recv() == "closed"
    assert not any(x.lease_id == got["lease_id"] for x in client.stats().leases)
    try:
        waiting = adopt(client)
        assert waiting.ids.shape[0] == 0 and waiting.unfenced == 4  # it still lives
    finally:
        engine.send("exit")
        engine.proc.wait(30)
    a = adopt(client)
    assert sorted(a.ids.tolist()) == sorted(got["pages"]) and a.unfenced == 0
