"""Sealed pages under a hostile workload: a hypothesis state machine over the real
:class:`~kvpoold.server.daemon.Daemon` (its pool aggregate, ledger and sealed directory, real
/dev/shm memory, real processes for the fence), driven through the daemon's own methods.

Leases allocate, seal, free and end; each lease's writers are real processes: none registered,
one that has exited, or a shared one that lives until a rule kills it. Pages kept by the
directory are written over (a stray writer), evicted by pressure, adopted. After every step:

- every invariant of the pool and its directory holds (``Daemon.audit``);
- the directory keeps exactly the pages the model says (sealed, let go of, not evicted or
  adopted);
- an adoption takes only pages whose sealing lease ended with every registered writer gone,
  never one written after sealing (that one is freed), and every adoptable page of the layout;
- pressure takes kept pages, never a lease's;
- the pool's KV events (the numbered batches the directory's sink hands the publisher) are the
  directory: their sequence numbers have no gap, each stored block was not stored before, each
  removed one was, and stored minus removed is exactly the directory's sealed set.
"""

from __future__ import annotations

import asyncio
import hashlib
import subprocess
from typing import Any

import numpy as np
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from kvpool.contract.errors import KVPoolError
from kvpoold.access import DAEMON_CALLER
from kvpoold.pools.sealed import kv_extents
from kvpoold.server.args import ConfigureArgs, LeaseRef
from kvpoold.server.daemon import Daemon
from kvpoold.server.kv_messages import CLEARED, REMOVED, STORED, Change, split_keys
from kvpoold.server.kv_stream import KvEvents
from kvpoold.settings import KvEventsConfig
from kvpoold.sharing.shm import ShmBackingFactory
from tests.conftest import TINY_OPTIONS, TINY_SPEC, stateful_settings, temp_dir
from tests.service.conftest import ManualClock

LAYOUT = "machine/1 sha256 tp0"
PAGE = 16
KINDS = ("none", "dead", "live")


class Recorded:
    """The publisher's queue as a list (the machine reads the batches in order)."""

    endpoint = replay_endpoint = ""

    def __init__(self) -> None:
        self.items: list[Change] = []

    def offer(self, msg: Change) -> bool:
        self.items.append(msg)  # never full: no Mark
        return True

    async def deliver(self, msg: Any) -> None:
        raise AssertionError("no snapshot is asked here")


def sleeper() -> subprocess.Popen[bytes]:
    return subprocess.Popen(["sleep", "3600"])


class SealedMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.loop = asyncio.new_event_loop()
        self._tmp = temp_dir("kvp-shm-", "/dev/shm")
        self.clock = ManualClock()
        self.events = Recorded()
        self.d = Daemon("cpu", 64 << 20, ShmBackingFactory(self._tmp.__enter__()), self.clock,
                        kv_events=KvEvents(KvEventsConfig(enable_kv_cache_events=True),
                                           self.events, first_seq=0))
        self.stream: set[bytes] = set()  # the blocks the KV events say are stored
        self.applied = 0  # batches of self.events applied to it
        self.run(self.d.configure(DAEMON_CALLER, ConfigureArgs(
            "f", spec=dict(TINY_SPEC), options={**TINY_OPTIONS, "budget_bytes": 48 * 4096})))
        self.live = sleeper()  # the writer that lives until kill_live_writer
        self.live_dead = False
        self.leases: dict[int, LeaseRef] = {}
        self.kind: dict[int, str] = {}  # lease -> writers: none, dead, live
        self.held: dict[int, set[int]] = {}  # lease -> pages it holds
        self.sealer: dict[int, int] = {}  # sealed page -> the lease that sealed it
        self.kept: set[int] = set()  # pages the directory keeps
        self.ended: set[int] = set()  # leases that ended
        self.written: set[int] = set()  # kept pages written over since sealed
        self.key_of: dict[int, bytes] = {}  # sealed page -> its key
        self.n = 0

    def run(self, coro: Any) -> Any:
        return self.loop.run_until_complete(coro)

    def call(self, fn: Any, *args: Any) -> Any:
        async def on_loop() -> Any:
            return fn(*args)
        return self.run(on_loop())

    def teardown(self) -> None:
        self.live.kill()
        self.live.wait()
        self.d.close()
        self.loop.close()
        self._tmp.__exit__(None, None, None)

    @property
    def pool(self) -> Any:
        return self.d.pools["f"]

    def adoptable(self, u: int) -> bool:
        lease = self.sealer[u]
        kind = self.kind[lease]
        return lease in self.ended and (kind == "dead" or (kind == "live" and self.live_dead))

    # -- leases -------------------------------------------------------------------------

    @precondition(lambda self: len(self.leases) - len(self.ended) < 4)
    @rule(kind=st.sampled_from(KINDS))
    def open_lease(self, kind: str) -> None:
        if kind == "live" and self.live_dead:
            kind = "none"  # its process is gone already: nothing can register it
        lease = self.call(self.d.open_lease, DAEMON_CALLER, f"l{len(self.leases)}", 30.0)
        ref = LeaseRef(lease.lease_id, lease.secret)
        self.leases[lease.lease_id] = ref
        self.kind[lease.lease_id] = kind
        self.held[lease.lease_id] = set()
        if kind == "dead":
            proc = sleeper()
            self.d.attachments.add_holder("f", lease.lease_id, proc.pid)
            proc.kill()
            proc.wait()
        elif kind == "live":
            self.d.attachments.add_holder("f", lease.lease_id, self.live.pid)

    def _open(self) -> list[int]:
        return [x for x in self.leases if x not in self.ended]

    @precondition(lambda self: bool(self._open()))
    @rule(data=st.data(), n=st.integers(1, 20))
    def allocate(self, data: st.DataObject, n: int) -> None:
        lease = data.draw(st.sampled_from(self._open()))
        free = self.pool.ids.space("kv", "kv").num_free
        try:
            got = self.call(self.d.allocate, DAEMON_CALLER, "f", self.leases[lease],
                            [("kv", n)])
        except KVPoolError:
            assert n > free + len(self.kept)  # refused only when even the kept pages fall short
            return
        ids = set(got[0][1].ids.tolist())
        if n > free:  # the oldest kept pages gave way; never a lease's
            taken = self.kept & ids
            assert len(taken) == n - free
            self.kept -= taken
            self.written -= taken
            for u in taken:
                del self.sealer[u]
                del self.key_of[u]
        self.held[lease] |= ids

    @precondition(lambda self: any(self.held[x] - set(self.sealer) for x in self._open()))
    @rule(data=st.data(), chain=st.booleans())
    def seal(self, data: st.DataObject, chain: bool) -> None:
        """Pages sealed as roots, or as a chain (each page's parent the one before it, the
        first's a sealed page's key when there is one): eviction takes chains from their end."""
        lease = data.draw(st.sampled_from(
            [x for x in self._open() if self.held[x] - set(self.sealer)]))
        pages = data.draw(st.lists(st.sampled_from(sorted(self.held[lease] - set(self.sealer))),
                                   min_size=1, max_size=8, unique=True))
        keys = []
        for _ in pages:
            self.n += 1
            keys.append(hashlib.sha256(self.n.to_bytes(8, "little")).digest())
        parents = [bytes(32)] * len(pages)
        if chain:
            known = sorted(self.key_of.values())
            first = data.draw(st.sampled_from(known)) if known else bytes(32)
            parents = [first, *keys[:-1]]
        tokens = np.zeros(len(pages) * PAGE, dtype=np.int32)
        done = self.run(self.d.sealing.seal(
            DAEMON_CALLER, "f", self.leases[lease], LAYOUT, np.asarray(pages, dtype=np.int32),
            b"".join(keys), b"".join(parents), tokens))
        assert done == len(pages)
        for u, key in zip(pages, keys, strict=True):
            self.sealer[u] = lease
            self.key_of[u] = key

    @precondition(lambda self: any(self.held[x] & set(self.sealer) for x in self._open()))
    @rule(data=st.data())
    def unseal(self, data: st.DataObject) -> None:
        """A lease about to write sealed pages it holds again: they leave the directory."""
        lease = data.draw(st.sampled_from(
            [x for x in self._open() if self.held[x] & set(self.sealer)]))
        pages = data.draw(st.lists(st.sampled_from(sorted(self.held[lease])), min_size=1,
                                   max_size=8, unique=True))
        n = self.call(self.d.sealing.unseal, DAEMON_CALLER, "f", self.leases[lease],
                      np.asarray(pages, dtype=np.int32))
        assert n == sum(u in self.sealer for u in pages)
        for u in pages:
            self.sealer.pop(u, None)
            self.key_of.pop(u, None)

    @precondition(lambda self: any(self.held[x] for x in self._open()))
    @rule(data=st.data())
    def free(self, data: st.DataObject) -> None:
        lease = data.draw(st.sampled_from([x for x in self._open() if self.held[x]]))
        pages = data.draw(st.lists(st.sampled_from(sorted(self.held[lease])), min_size=1,
                                   max_size=12, unique=True))
        freed = self.call(self.d.free, DAEMON_CALLER, "f", self.leases[lease],
                          [("kv", np.asarray(pages, dtype=np.int32))])
        assert freed == len(pages)
        self.held[lease] -= set(pages)
        self.kept |= {u for u in pages if u in self.sealer}

    @precondition(lambda self: bool(self._open()))
    @rule(data=st.data())
    def end_lease(self, data: st.DataObject) -> None:
        lease = data.draw(st.sampled_from(self._open()))
        self.call(self.d.close_lease, DAEMON_CALLER, self.leases[lease])
        self.ended.add(lease)
        self.kept |= {u for u in self.held[lease] if u in self.sealer}
        self.held[lease] = set()

    # late in a program (after a few leases ended), so adoptions meet its pages alive first
    @precondition(lambda self: not self.live_dead and len(self.ended) >= 3)
    @rule()
    def kill_live_writer(self) -> None:
        self.live.kill()
        self.live.wait()
        self.live_dead = True

    @precondition(lambda self: bool(self.kept))
    @rule(data=st.data())
    def write_over_a_kept_page(self, data: st.DataObject) -> None:
        u = data.draw(st.sampled_from(sorted(self.kept)))
        offset, page, _ = kv_extents(self.pool.plan)[0]
        flat = self.pool.buffers.backing.numpy()
        flat[offset + u * page] ^= 0x5A  # a stray write (CPU: the checksum sees it)
        self.written ^= {u}  # a second flip of the same byte puts it back as sealed

    @precondition(lambda self: bool(self._open()))
    @rule(data=st.data())
    def adopt(self, data: st.DataObject) -> None:
        lease = data.draw(st.sampled_from(self._open()))
        want = {u for u in self.kept if self.adoptable(u)}
        got = self.run(self.d.sealing.adopt(DAEMON_CALLER, "f", self.leases[lease], LAYOUT))
        ids = set(got.ids.tolist())
        bad = want & self.written
        d = self.pool.sealed
        if ids != want - bad:
            raise AssertionError((ids, want, bad, {
            u: (d.entries[u].sealer, self.sealer[u], self.kind[self.sealer[u]],
                self.sealer[u] in self.ended) for u in self.kept},
            {k: (w.ended, list(w.pidfds)) for k, w in d.writers.items()}, self.live_dead))
        assert got.corrupt == len(bad)
        assert got.unfenced == len(self.kept - want)
        self.kept -= want
        for u in bad:
            del self.sealer[u]
            del self.key_of[u]
        self.written -= want
        self.held[lease] |= ids
        for u in ids:  # sealed still; the adopter's processes are its writers now
            self.sealer[u] = lease

    # -- invariants -----------------------------------------------------------------------

    @invariant()
    def agrees(self) -> None:
        self.d.audit()
        d = self.pool.sealed
        kept = set(d.orphans) if d is not None else set()
        assert kept == self.kept
        held_sealed = {u for x in self._open() for u in self.held[x] if u in self.sealer}
        assert (len(d.entries) if d is not None else 0) == len(self.kept) + len(held_sealed)


    @invariant()
    def the_stream_is_the_directory(self) -> None:
        for c in self.events.items[self.applied:]:
            assert isinstance(c, Change) and c.seq == self.applied  # numbered, no gap
            self.applied += 1
            keys = set(split_keys(c.keys))
            if c.kind == STORED:
                assert not self.stream & keys, "stored twice"
                assert len(c.keys) == len(c.parents) == 8 * len(c.tokens) // PAGE
                self.stream |= keys
            elif c.kind == REMOVED:
                assert keys <= self.stream, "removed without being stored"
                self.stream -= keys
            else:
                assert c.kind == CLEARED
                self.stream.clear()
        d = self.pool.sealed
        assert self.stream == ({e.key for e in d.entries.values()} if d is not None else set())


def test_the_sealed_directory_holds_under_a_hostile_workload() -> None:
    run = SealedMachine.TestCase
    run.settings = stateful_settings(examples=100, steps=50)
    run().runTest()

