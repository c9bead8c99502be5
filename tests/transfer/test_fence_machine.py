"""A hypothesis machine over the real daemon's grants, sends' pins, cancels, lease ends, time and
peer deaths: no page a write may still land in (or a send may still read) is ever handed to a
second owner, and fenced pages are counted and bounded per peer (issue 39).

The daemon, its pool, ledger, grant table and pins are the real ones; NIXL is replaced by a
stand-in agent that moves no byte (NIXL is never imported in pytest's process: see conftest).
A write's facts are driven as the daemon receives them: its notification (what the
notification poller does with it), the sender's PeerDone, and the sender's process exiting (a
real child process per peer, watched through a real pidfd).
"""

from __future__ import annotations

import asyncio
import subprocess
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pytest
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from kvpool.contract.errors import FailedPrecondition, NotFound, ResourceExhausted
from kvpool.contract.records import TransferState
from kvpoold.access import DAEMON_CALLER
from kvpoold.ids.faults import QUARANTINE
from kvpoold.server.args import ConfigureArgs, LeaseRef
from kvpoold.server.daemon import Daemon
from kvpoold.sharing.shm import ShmBackingFactory
from kvpoold.transfer.liveness import ProcessId, this_process
from kvpoold.transfer.messages import GrantArgs, PeerDoneArgs, PeerReceiveArgs
from kvpoold.transfer.page_layout import page_layout
from tests.conftest import TINY_SPEC, stateful_settings, temp_dir
from tests.service.conftest import ManualClock

MiB = 1 << 20
POOL = "f"
OPTIONS = {"budget_bytes": 1 * MiB, "page_size": 16, "max_running_requests": 8}
PEERS = ("A", "B")
BOUND = 12  # fenced pages per peer before its writes are refused
STEPS: list[int] = []


class StandInAgent:
    """What the receiving side asks of its NIXL agent; moves no byte."""

    name = "kvpoold-machine"
    listening = "off"  # what the receiving side asks notifications for

    def register(self, pool: str, backing: Any) -> None:
        pass

    def deregister(self, pool: str) -> None:
        pass

    def generation(self, pool: str) -> int:
        return 1

    def pool_metadata(self, pool: str) -> bytes:
        return b"md"

    def listen(self, mode: str, on_notes: Any) -> None:
        self.listening = mode

    def close(self) -> None:
        pass


@dataclass
class Write:
    """A write accepted into a grant, as the model sees it."""

    token: bytes
    note: bytes
    pages: np.ndarray
    owner: int
    peer: str
    record_ended: bool = False


@dataclass
class Peer:
    child: subprocess.Popen[bytes]
    proc: ProcessId
    alive: bool = True
    writes: list[Write] = field(default_factory=list)


def process_of(child: subprocess.Popen[bytes]) -> ProcessId:
    with open(f"/proc/{child.pid}/stat", "rb") as f:
        stat = f.read()
    mine = this_process()
    return ProcessId(mine.boot_id, mine.pid_namespace, child.pid,
                     int(stat[stat.rindex(b")") + 2:].split()[19]))


class FenceMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.loop = asyncio.new_event_loop()
        self._tmp = temp_dir("kvp-shm-", "/dev/shm")
        shm = self._tmp.__enter__()
        self.clock = ManualClock()
        self.d = Daemon("cpu", 8 * MiB, ShmBackingFactory(shm), self.clock)
        self.d.transfers.agent = StandInAgent()  # type: ignore[assignment]
        self.d.transfers.grants.max_fenced_pages = BOUND
        self.run(self.d.configure(DAEMON_CALLER, ConfigureArgs(POOL, spec=dict(TINY_SPEC),
                                                               options=dict(OPTIONS))))
        self.layout = page_layout(self.d.pools[POOL].plan)
        self.leases: dict[int, tuple[LeaseRef, int]] = {}  # lease id -> (ref, owner)
        self.grants: dict[bytes, tuple[int, np.ndarray]] = {}  # pending, unaccepted
        self.writes: dict[bytes, Write] = {}  # writes that may still land
        self.sends: list[tuple[Any, np.ndarray]] = []  # (unpin, pages) of sends in flight
        self.peers: dict[str, Peer] = {}
        for name in PEERS:
            child = subprocess.Popen(["sleep", "600"])
            self.peers[name] = Peer(child, process_of(child))

    def run(self, coro: Any) -> Any:
        return self.loop.run_until_complete(coro)

    def call(self, fn: Any, *args: Any, **kw: Any) -> Any:
        async def on_loop() -> Any:
            result = fn(*args, **kw)
            await asyncio.sleep(0)  # callbacks the call scheduled (a pidfd already readable)
            return result
        return self.run(on_loop())

    def teardown(self) -> None:
        for peer in self.peers.values():
            peer.child.kill()
            peer.child.wait()
        self.run(asyncio.sleep(0.01))
        for unpin, _ in self.sends:
            self.call(unpin)
        self.run(self.d.transfers.close())
        self.d.close()
        self.loop.close()
        self._tmp.__exit__(None, None, None)

    @property
    def space(self) -> Any:
        return self.d.pools[POOL].ids.space("kv", "kv")

    def _forget(self, owner: int) -> None:
        for token in [t for t, (o, _) in self.grants.items() if o == owner]:
            del self.grants[token]

    def _ended(self, write: Write) -> None:
        self.writes.pop(write.token, None)
        self.peers[write.peer].writes.remove(write)

    # -- leases, Allocate, Free --------------------------------------------------------------

    @precondition(lambda self: len(self.leases) < 3)
    @rule()
    def open_lease(self) -> None:
        lease = self.call(self.d.open_lease, DAEMON_CALLER, "m", 600.0)
        self.leases[lease.lease_id] = (LeaseRef(lease.lease_id, lease.secret), lease.owner)

    @precondition(lambda self: self.leases)
    @rule(data=st.data(), count=st.sampled_from([1, 4, 16, 200]))
    def allocate(self, data: st.DataObject, count: int) -> None:
        """Any lease takes pages, as a victim would: the invariant checks none of them is a
        page a write may land in."""
        lease_id = data.draw(st.sampled_from(list(self.leases)))
        try:
            self.call(self.d.allocate, DAEMON_CALLER, POOL, self.leases[lease_id][0],
                      [("kv", count)])
        except ResourceExhausted:
            pass

    def _held(self, owner: int) -> np.ndarray:
        ids = np.arange(1, self.space.capacity + 1, dtype=np.int32)  # ids are 1..capacity
        return ids[self.space.owner_of(ids) == owner]

    def _draw_held(self, data: st.DataObject) -> tuple[LeaseRef, int, np.ndarray] | None:
        """A lease and up to 8 of the pages it holds (None when it holds none)."""
        lease_id = data.draw(st.sampled_from(list(self.leases)))
        ref, owner = self.leases[lease_id]
        held = self._held(owner)
        if not held.size:
            return None
        return ref, owner, np.array(data.draw(st.lists(
            st.sampled_from(held.tolist()), min_size=1, max_size=8, unique=True)), dtype=np.int32)

    @precondition(lambda self: self.leases)
    @rule(data=st.data())
    def free(self, data: st.DataObject) -> None:
        drawn = self._draw_held(data)
        if drawn is None:
            return
        ref, _, pages = drawn
        pinned = bool(self.space.pinned_of(pages.astype(np.intp)).any())
        try:
            self.call(self.d.free, DAEMON_CALLER, POOL, ref, [("kv", pages)])
            assert not pinned
        except FailedPrecondition:
            assert pinned

    @precondition(lambda self: self.leases)
    @rule(data=st.data())
    def close_lease(self, data: st.DataObject) -> None:
        lease_id = data.draw(st.sampled_from(list(self.leases)))
        ref, owner = self.leases.pop(lease_id)
        self.call(self.d.close_lease, DAEMON_CALLER, ref)
        self._forget(owner)
        for write in self.writes.values():
            write.record_ended |= write.owner == owner

    # -- grants, accepts, cancels ------------------------------------------------------------

    @precondition(lambda self: self.leases)
    @rule(data=st.data(), ttl=st.sampled_from([0.5, 5.0]))
    def grant(self, data: st.DataObject, ttl: float) -> None:
        drawn = self._draw_held(data)
        if drawn is None:
            return
        ref, owner, pages = drawn
        pinned = bool(self.space.pinned_of(pages.astype(np.intp)).any())
        try:
            grant = self.call(self.d.grant_receive, DAEMON_CALLER, ref,
                              GrantArgs(POOL, pages, ttl))
        except FailedPrecondition:
            assert pinned
            return
        assert not pinned
        self.grants[grant.token] = (owner, pages)

    @precondition(lambda self: self.grants)
    @rule(data=st.data(), peer=st.sampled_from(PEERS))
    def accept(self, data: st.DataObject, peer: str) -> None:
        """A peer's PeerReceive: refused while the peer is at its fenced bound."""
        token = data.draw(st.sampled_from(list(self.grants)))
        owner, pages = self.grants[token]
        at_bound = sum(w.pages.shape[0] for w in self.peers[peer].writes
                       if w.record_ended) >= BOUND
        args = PeerReceiveArgs(token=token, layout=self.layout, pages=int(pages.shape[0]),
                               swa_mask=b"", known_agent="", known_generations=frozenset(),
                               sender=peer, writer=self.peers[peer].proc)
        try:
            acc = self.call(self.d.transfers.peer_receive, args)
        except ResourceExhausted as exc:
            assert at_bound and "fenced pages" in exc.message
            return
        except FailedPrecondition:  # expired meanwhile (the sweep had not run)
            assert self.d.transfers.grants.find(token).state != TransferState.pending
            del self.grants[token]
            return
        except NotFound:  # expired and forgotten (its record ended over a minute ago)
            with pytest.raises(NotFound):
                self.d.transfers.grants.find(token)
            del self.grants[token]
            return
        assert not at_bound
        del self.grants[token]
        write = Write(token, acc.notification, pages, owner, peer)
        if self.peers[peer].alive:
            self.writes[token] = write
            self.peers[peer].writes.append(write)
        else:  # a dead writer: its pidfd says so at once
            self.run(asyncio.sleep(0.01))

    @precondition(lambda self: self.grants or self.writes)
    @rule(data=st.data())
    def cancel(self, data: st.DataObject) -> None:
        """CancelGrant by the lease that made it: an unaccepted grant's pages are unpinned at
        once; an accepted one's stay fenced."""
        tokens = ([*self.grants, *(t for t, w in self.writes.items()
                                         if w.owner in {o for _, o in self.leases.values()})])
        if not tokens:
            return
        token = data.draw(st.sampled_from(tokens))
        lease_id = next(i for i, (_, o) in self.leases.items()
                        if o == (self.grants[token][0] if token in self.grants
                                 else self.writes[token].owner))
        status, freed, fenced = self.call(self.d.transfers.cancel_grant,
                                          self.leases[lease_id][1], lease_id, token)
        assert status.state == TransferState.failed
        if token in self.grants:
            _, pages = self.grants.pop(token)
            assert (freed, fenced) == (pages.shape[0], 0)
            assert not self.space.pinned_of(pages.astype(np.intp)).any()
        else:
            write = self.writes[token]
            assert (freed, fenced) == (0, write.pages.shape[0])
            write.record_ended = True

    # -- a write's facts, and time ---------------------------------------------------------

    @precondition(lambda self: self.writes)
    @rule(data=st.data())
    def notification(self, data: st.DataObject) -> None:
        """The write's NIXL notification arrives (as the agent's progress thread posts it)."""
        write = self.writes[data.draw(st.sampled_from(list(self.writes)))]
        self.call(self.d.transfers.notified, {write.peer: [write.note]})
        self._ended(write)

    @precondition(lambda self: self.writes)
    @rule(data=st.data())
    def sender_reports_ended(self, data: st.DataObject) -> None:
        write = self.writes[data.draw(st.sampled_from(list(self.writes)))]
        self.call(self.d.transfers.peer_done, PeerDoneArgs(write.token, False,
                                                           "nothing in flight"))
        self._ended(write)

    @rule(peer=st.sampled_from(PEERS), restarts=st.booleans())
    def peer_dies(self, peer: str, restarts: bool) -> None:
        """The sending daemon's process is killed: its pidfd becomes readable, and every
        window of its writes closes. It may be restarted (a new process under the name)."""
        p = self.peers[peer]
        if p.alive:
            p.child.kill()
            p.child.wait()
            p.alive = False
            for _ in range(200):
                self.run(asyncio.sleep(0.001))
                if not any(g.window_open and g.peer == peer
                           for g in self.d.transfers.grants):
                    break
            for write in list(p.writes):
                self._ended(write)
        if restarts:
            child = subprocess.Popen(["sleep", "600"])
            self.peers[peer] = Peer(child, process_of(child))

    @rule(seconds=st.sampled_from([0.3, 2.0, 400.0]))
    def time_passes(self, seconds: float) -> None:
        """Deadlines pass: records end, pins stay while a write may land; leases past their
        TTL end."""
        self.clock.t += seconds
        self.call(self.d.expire_leases)
        self.call(self.d.transfers.expire)
        for lease_id in [i for i in self.leases if self.d.leases.find(i) is None]:
            _, owner = self.leases.pop(lease_id)
            self._forget(owner)
            for write in self.writes.values():
                write.record_ended |= write.owner == owner
        for token in [t for t in self.grants if self._record_ended(t)]:
            del self.grants[token]
        for write in self.writes.values():
            if self._record_ended(write.token):
                write.record_ended = True

    def _record_ended(self, token: bytes) -> bool:
        """Whether the grant's record ended (a record forgotten a minute after it ended is
        ended too; a fenced write's pins outlive it)."""
        try:
            return self.d.transfers.grants.find(token).state != TransferState.pending
        except NotFound:
            return True

    # -- sends' pins -------------------------------------------------------------------------

    @precondition(lambda self: self.leases)
    @rule(data=st.data())
    def send(self, data: st.DataObject) -> None:
        """A send pins pages its lease holds (the transfer wing's own pin) until its write
        has ended."""
        lease_id = data.draw(st.sampled_from(list(self.leases)))
        held = self._held(self.leases[lease_id][1])
        free_of_pins = held[~self.space.pinned_of(held.astype(np.intp))]
        if not free_of_pins.size:
            return
        pages = free_of_pins[:4].astype(np.int32)
        unpin = self.call(self.d.transfers.pins.hold, self.d.pools[POOL], pages, None)
        self.sends.append((unpin, pages))

    @precondition(lambda self: self.sends)
    @rule(data=st.data())
    def send_ends(self, data: st.DataObject) -> None:
        unpin, _ = self.sends.pop(data.draw(st.integers(0, len(self.sends) - 1)))
        self.call(unpin)

    # -- what must always hold ---------------------------------------------------------------

    @invariant()
    def no_second_owner_while_a_write_may_land(self) -> None:
        STEPS.append(1)
        owners = self.space.owner_of
        for write in self.writes.values():
            now = owners(write.pages)
            assert np.isin(now, [write.owner, QUARANTINE]).all(), (write, now)
            assert self.space.pinned_of(write.pages.astype(np.intp)).all()
        for _, pages in self.sends:
            assert self.space.pinned_of(pages.astype(np.intp)).all()
            assert (owners(pages) > 0).all()  # held by a lease or quarantined, never free
        fenced = self.d.transfers.grants.fenced()
        for name, peer in self.peers.items():
            pages = sum(int(w.pages.shape[0]) for w in peer.writes if w.record_ended)
            assert fenced.get(name, (0, 0))[1] == pages, (name, fenced)
            shown = self.d.transfers.peers.get(name)
            assert (shown.fenced_pages if shown else 0) == pages
        # The agent reads notifications often while a live window is open, rarely while only
        # fenced ones are, never without any.
        live = any(not w.record_ended for w in self.writes.values())
        expected = "live" if live else "fenced" if self.writes else "off"
        assert self.d.transfers.agent.listening == expected  # type: ignore[union-attr]


TestFenceMachine = FenceMachine.TestCase
TestFenceMachine.settings = stateful_settings(examples=100, steps=80)


def test_the_machine_ran_its_steps() -> None:
    """Runs after the machine (file order): it checked its invariant >= 5,000 times."""
    assert len(STEPS) >= 5000, len(STEPS)
