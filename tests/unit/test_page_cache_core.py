"""``PageCacheCore`` (the page cache's state, no I/O) against a plain-Python model.

The core keeps its cached ids in a ring and tells an id in use from its slot alone (see
``kvpool.cache.page_cache``). A small capacity makes every program wrap the ring many times. Each
rule is what the cache does on one path: a refill or return by the worker, an ``alloc``, a
``try_alloc`` past the ring (a miss that asks the daemon and gets its ids, or does not fit:
None, the cache as it was), a ``free`` (valid, repeated, foreign, out of range, a double free),
a give-back, and ``close`` followed by frees of ids still in use. After every step the model's
FIFO queue, in-use set and counters must match the core's, and what the lease holds of the
space must be exactly what the core counts.
"""

from __future__ import annotations

from collections import deque

import numpy as np
import pytest
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from kvpool.cache import ring
from kvpool.cache.policy import GIVE_BACK, REFILL, RETURN, PageCacheCore
from kvpool.cache.ring import IdRing
from kvpool.contract.errors import (
    FailedPrecondition,
    InvalidArgument,
    KVPoolError,
    NotFound,
    ResourceExhausted,
    Unavailable,
)
from tests.conftest import stateful_settings

CAP = 11
SETTINGS = stateful_settings(examples=120, steps=60)


def i32(ids: list[int]) -> np.ndarray:
    return np.asarray(ids, dtype=np.int32)


class CoreMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        # A window of 4 slot numbers (``free`` and ``push`` refill it often, or go past it),
        # and a rebase every few dozen slots.
        self.core = PageCacheCore("p", "kv", CAP, low=2, high=6, batch=2, window=4,
                                  rebase_at=3 * CAP)
        self.queue: deque[int] = deque()  # cached, the next handed out first
        self.in_use: set[int] = set()
        self.daemon = set(range(1, CAP + 1))  # held by nobody: the daemon's to give
        self.elsewhere: set[int] = set()  # the lease's, not in the cache (reserved, returning)
        self.refused = 0  # try_allocs that did not fit
        self.waits = 0  # allocs that asked the daemon

    # -- the worker ---------------------------------------------------------------------------

    @precondition(lambda self: self.core.dead is None)
    @rule(k=st.integers(0, CAP))
    def refill(self, k: int) -> None:
        got = sorted(self.daemon)[:k]
        self.daemon -= set(got)
        self.core.job_done(REFILL, k, i32(got), 0.0)
        self.queue.extend(got)

    @precondition(lambda self: self.core.dead is None and self.core.cached > 0)
    @rule(k=st.integers(1, CAP), give_back=st.booleans())
    def worker_returns(self, k: int, give_back: bool) -> None:
        core = self.core
        if give_back:
            core.give_back = k
        else:
            # Above high: returned down to max(low, high - batch) = low.
            core.low = core.high = max(0, core.cached - k)
            core.batch = 1
        job = core.pick_job(0.0)
        assert job is not None
        kind, ids = job
        assert kind == (GIVE_BACK if give_back else RETURN)
        n = ids.shape[0]
        if give_back:  # the highest go back; the others stay cached in their order
            want = sorted(self.queue)[len(self.queue) - n:]
            assert sorted(ids.tolist()) == want
            self.queue = deque(i for i in self.queue if i not in set(want))
        else:  # the most recently cached go back, in ring order
            want = list(self.queue)[len(self.queue) - n:]
            assert ids.tolist() == want
            for _ in range(n):
                self.queue.pop()
        self.elsewhere |= set(want)  # still the lease's until the Free is answered
        self.held_is_counted()
        core.job_done(kind, ids, None, 0.0)
        self.elsewhere -= set(want)
        self.daemon |= set(want)

    # -- alloc --------------------------------------------------------------------------------

    @precondition(lambda self: self.core.dead is None)
    @rule(n=st.integers(0, CAP))
    def alloc(self, n: int) -> None:
        ids = self.core.take(n)
        if n > len(self.queue):
            assert ids is None
            return
        assert ids is not None and ids.dtype == np.int32
        want = [self.queue.popleft() for _ in range(n)]  # the longest cached first
        assert ids.tolist() == want
        self.in_use |= set(want)

    @precondition(lambda self: self.core.dead is None)
    @rule(n=st.integers(1, CAP), room=st.integers(0, CAP))
    def try_alloc(self, n: int, room: int) -> None:
        """What a shell's ``try_alloc`` does past the ring, with a daemon that grants at most
        ``room`` ids per Allocate: the ids, or None and the cache as it was."""
        core = self.core
        if n <= len(self.queue):
            return  # the ring serves it: ``alloc`` above
        reserved = core.reserve(n)
        k = len(self.queue)
        want = [self.queue.popleft() for _ in range(k)]
        assert reserved.tolist() == want
        self.elsewhere |= set(want)
        assert not core.in_use_of(reserved).any()
        self.held_is_counted()
        self.waits += 1
        room = min(room, len(self.daemon))
        calls = 0
        for count in core.miss_counts(n, reserved):
            assert count >= n - k
            calls += 1
            if count <= room:
                got = sorted(self.daemon)[:count]
                self.daemon -= set(got)
                ids = core.miss_done(reserved, i32(got), n, calls)
                assert ids.tolist() == want + got[:n - k]
                self.elsewhere -= set(want)
                self.in_use |= set(ids.tolist())
                self.queue.extend(got[n - k:])  # the surplus is cached
                return
        core.miss_failed(reserved, ResourceExhausted("full"), calls)  # does not fit: None
        self.refused += 1
        self.queue.extend(want)  # back at the tail
        self.elsewhere -= set(want)

    # -- free ---------------------------------------------------------------------------------

    @precondition(lambda self: self.in_use)
    @rule(data=st.data())
    def free(self, data: st.DataObject) -> None:
        ids = data.draw(st.lists(st.sampled_from(sorted(self.in_use)), min_size=1,
                                 unique=True))
        arr, send = self.core.free(i32(ids))
        assert arr.tolist() == ids
        self.in_use -= set(ids)
        if self.core.dead is None:
            assert not send
            self.queue.extend(ids)
        else:
            assert send  # the caller Frees them
            self.daemon |= set(ids)

    @rule(data=st.data())
    def bad_free(self, data: st.DataObject) -> None:
        """A refused free names the first bad id and changes nothing."""
        good = sorted(self.in_use)
        cached = list(self.queue)
        bad = data.draw(st.sampled_from(["repeat", "cached", "foreign", "range"]))
        if bad == "repeat" and good:
            x = data.draw(st.sampled_from(good))
            ids, cls, where = [x, x, x], InvalidArgument, "ids[1]"
        elif bad == "cached" and cached:  # held, never handed out, or already freed
            ids, cls, where = [*good[:1], cached[0]], FailedPrecondition, f"ids[{len(good[:1])}]"
        elif bad == "foreign" and self.daemon | self.elsewhere:
            x = sorted(self.daemon | self.elsewhere)[0]
            ids, cls, where = [*good[:2], x], FailedPrecondition, f"ids[{len(good[:2])}]"
        else:
            ids, cls, where = [*good[:1], CAP + 1], InvalidArgument, f"ids[{len(good[:1])}]"
        before = self.state()
        with pytest.raises(KVPoolError) as info:
            self.core.free(i32(ids))
        assert type(info.value) is cls and info.value.field == where
        assert self.state() == before

    def state(self) -> tuple[list[int], list[int], int, int]:
        """What a refused free must leave alone (a rebase may re-encode the slots)."""
        ring = self.core.ring
        return (ring.cached_ids().tolist(), ring.handed_out().tolist(), ring.head, ring.tail)

    # -- the end ------------------------------------------------------------------------------

    @precondition(lambda self: self.core.dead is None)
    @rule()
    def close(self) -> None:
        assert self.core.close()
        drained = self.core.drain()
        assert drained.tolist() == list(self.queue)
        self.daemon |= set(self.queue)
        self.queue.clear()
        with pytest.raises(FailedPrecondition):
            self.core.take(0)

    def held_is_counted(self) -> None:
        """What the lease holds of the space (every id not the daemon's) is exactly what the
        core counts: in use, cached, reserved by a miss, being returned."""
        core = self.core
        if core.dead is None:
            counted = core.in_use + core.cached + core.ring.reserved + core.returning
            assert counted == CAP - len(self.daemon)

    @invariant()
    def agrees_with_model(self) -> None:
        core = self.core
        assert core.ring.cached_ids().tolist() == list(self.queue)
        assert core.handed_out().tolist() == sorted(self.in_use)
        assert core.in_use == len(self.in_use)
        everyone = np.arange(0, CAP + 3)
        assert core.in_use_of(everyone).tolist() == [i in self.in_use for i in everyone]
        counters = core.counters()
        assert counters.cached == len(self.queue)
        assert (counters.refused, counters.waits) == (self.refused, self.waits)
        assert not self.elsewhere and core.ring.reserved == 0 and core.returning == 0
        self.held_is_counted()


TestCoreMachine = CoreMachine.TestCase
TestCoreMachine.settings = SETTINGS


def test_an_id_listed_65537_times_is_refused() -> None:
    """However often an id is listed, the slot read back shows it (no counter to wrap)."""
    core = IdRing("p/kv", capacity=70_000)
    core.push(np.arange(70_000, 0, -1, dtype=np.int32))
    ids = core.take(2)
    assert ids is not None
    before = core.pos.copy()
    with pytest.raises(InvalidArgument) as info:
        core.free_ids(np.full(65_537, ids[0], dtype=np.int32), True)
    assert info.value.field == "ids[1]"
    assert np.array_equal(core.pos, before)
    assert core.free_ids(ids, True).tolist() == ids.tolist()  # both still in use: freed at once


@pytest.mark.parametrize("bad", ["repeat", "cached"])
def test_a_refused_free_that_crosses_a_rebase_changes_nothing(bad: str) -> None:
    """The free that would move ``base`` is refused after its checks read the slots: what it
    read must still be valid when it puts them back."""
    core = IdRing("p/kv", capacity=8, window=2, rebase_at=12)
    core.push(np.arange(1, 9, dtype=np.int32))
    ids = core.take(6)
    assert ids is not None
    core.free_ids(ids[:2], True)  # tail 10: a free of 3 more crosses 12
    handed, cached = core.handed_out().tolist(), core.cached_ids().tolist()
    bad_ids = [ids[2], ids[3], ids[2]] if bad == "repeat" else [ids[2], ids[3], ids[0]]
    with pytest.raises(KVPoolError):
        core.free_ids(np.asarray(bad_ids, dtype=np.int32), True)
    assert core.handed_out().tolist() == handed
    assert core.cached_ids().tolist() == cached
    assert core.free_ids(ids[2:6], True).tolist() == ids[2:6].tolist()  # still in use, all four
    assert core.handed_out().tolist() == []


def test_a_rebase_in_chunks_keeps_every_id_where_it_was(monkeypatch: pytest.MonkeyPatch) -> None:
    """The rebase walks ``pos`` a chunk at a time (bounded temporaries); ids in use, cached and
    not here keep their meaning across chunk borders, and the queue its order."""
    monkeypatch.setattr(ring, "REBASE_CHUNK", 4)
    core = IdRing("p/kv", capacity=30)
    core.push(np.arange(30, 5, -1, dtype=np.int32))  # ids 1..5 are not here
    ids = core.take(12)
    assert ids is not None
    core.free_ids(ids[::3], True)
    handed, cached = core.handed_out().tolist(), core.cached_ids().tolist()
    core.rebase()
    assert core.base == core.head
    assert core.handed_out().tolist() == handed
    assert core.cached_ids().tolist() == cached
    assert not core.in_use_of(np.arange(0, 7)).any()
    assert core.take(len(cached)).tolist() == cached  # served in the same order


# -- the worker's backoffs and settle (issue 28) ----------------------------------------------

def refuse_all(core: PageCacheCore, now: float, err: KVPoolError) -> None:
    """Refuse every job the worker would make at ``now`` (a refill halves down to 1 id)."""
    while (job := core.pick_job(now)) is not None:
        core.job_failed(job[0], job[1], err, now)


def test_a_refills_backoff_does_not_defer_a_return() -> None:
    """The pool had no room for a refill, so the worker waits out a backoff; frees then take
    the cache above high. That return is due now, not when the refill may be retried."""
    core = PageCacheCore("p", "kv", capacity=32, low=4, high=8, batch=2)
    core.ring.push(i32([1, 2, 3]))  # below low
    refuse_all(core, 10.0, ResourceExhausted("full"))
    assert core.refill_retry.at > 10.0 and core.pick_job(10.0) is None
    core.ring.push(i32(list(range(4, 14))))  # 13 cached: above high
    job = core.pick_job(10.0)
    assert job is not None and job[0] == RETURN and job[1].shape == (13 - 6,)
    core.job_done(RETURN, job[1], None, 10.0)
    assert core.pick_job(10.0) is None and core.cached == 6


def test_settled_waits_for_what_was_refused_before_settle_began() -> None:
    """A refusal from before ``begin_settle`` does not count as settled: ``begin_settle`` lifts
    the backoff so the worker tries again, and only a refusal from then on (or success) does."""
    core = PageCacheCore("p", "kv", capacity=32, low=4, high=8, batch=2)
    core.ring.push(i32([1, 2, 3]))
    refuse_all(core, 10.0, ResourceExhausted("full"))
    assert core.pick_job(10.0) is None  # waiting out the backoff
    core.begin_settle()
    assert not core.settled()  # refused before: the retry is due
    job = core.pick_job(10.0)  # at once
    assert job is not None and job[0] == REFILL
    core.job_failed(REFILL, job[1], ResourceExhausted("full"), 10.0)
    refuse_all(core, 10.0, ResourceExhausted("full"))
    assert core.settled()  # refused since settle began: it cannot now
    # a return refused (the daemon unreachable) before the next settle, then done
    core.ring.push(i32(list(range(4, 14))))
    refuse_all(core, 11.0, Unavailable("down"))
    assert core.cached == 13
    core.begin_settle()
    assert not core.settled()
    job = core.pick_job(11.0)
    assert job is not None and job[0] == RETURN
    core.job_done(RETURN, job[1], None, 10.0)
    assert core.settled() and core.cached == 6


def test_settle_lifts_the_hold_after_a_give_back() -> None:
    """After a give-back the worker holds refills back for a while; ``settle`` waits for none
    of that: the refill is due at once."""
    core = PageCacheCore("p", "kv", capacity=32, low=4, high=8, batch=2)
    core.ring.push(i32(list(range(1, 9))))
    core.ask_give_back(6)
    job = core.pick_job(0.0)
    assert job is not None and job[0] == GIVE_BACK
    core.job_done(GIVE_BACK, job[1], None, 0.0)
    assert core.cached == 2 and core.pick_job(0.0) is None  # held back
    core.begin_settle()
    assert not core.settled() and core.pick_job(0.0) == (REFILL, 6)


def test_a_give_back_returns_the_highest_cached_ids_and_keeps_the_rest_in_order() -> None:
    """The daemon takes back an elastic pool's highest groups: a give-back returns the highest
    ids the cache holds, whatever order they were cached in, and the others stay cached in
    their order (the next allocs hand them out as before)."""
    core = PageCacheCore("p", "kv", capacity=64, low=0, high=64, batch=8)
    core.ring.push(i32([40, 3, 57, 9, 12, 61, 5, 33]))
    core.ask_give_back(3)
    job = core.pick_job(0.0)
    assert job is not None and job[0] == GIVE_BACK
    assert sorted(job[1].tolist()) == [40, 57, 61]
    core.job_done(GIVE_BACK, job[1], None, 0.0)
    assert core.cached == 5
    got = core.take(5)
    assert got is not None and got.tolist() == [3, 9, 12, 5, 33]
    core.free(got)
    assert core.cached == 5


def test_a_give_back_from_an_id_returns_only_ids_at_or_above_it() -> None:
    """An elastic pool's drained groups: only cached ids >= ``min_id`` come back, never more
    than there are, and nothing is asked of the evictor for them."""
    core = PageCacheCore("p", "kv", capacity=64, low=0, high=64, batch=8)
    core.ring.push(i32([40, 3, 57, 9, 12, 61, 5, 33]))
    core.can_evict, core.evictable = True, 10
    assert core.ask_give_back(5, min_id=40) == 3 and core.evict_wanted == 0
    assert core.ask_give_back(5, min_id=40) == 0  # already asked for all three
    job = core.pick_job(0.0)
    assert job is not None and job[0] == GIVE_BACK and sorted(job[1].tolist()) == [40, 57, 61]
    core.job_done(GIVE_BACK, job[1], None, 0.0)
    assert core.cached == 5 and core.give_back == 0


def test_a_give_back_past_the_cache_asks_the_evictor_for_at_most_what_it_offered() -> None:
    """Cached ids first; past them, up to what the owner said it can evict (not yet asked):
    those are counted for the evictor, and the report stops offering them."""
    core = PageCacheCore("p", "kv", capacity=64, low=0, high=64, batch=8)
    core.ring.push(i32(list(range(1, 21))))
    held = core.take(16)  # 16 in use (a prefix cache), 4 cached
    assert held is not None
    core.can_evict, core.evictable = True, 10
    assert core.report() == (4, 16, 10)
    assert core.ask_give_back(9) == 9 and (core.give_back, core.evict_wanted) == (9, 5)
    assert core.report() == (4, 16, 5)
    assert core.ask_give_back(100) == 5  # the rest of what it offered, no more
    assert (core.give_back, core.evict_wanted) == (14, 10) and core.report()[2] == 0
    assert core.ask_give_back(1) == 0
    # the cached ones go at once; the evictor's run before the next job (``maintain``)
    job = core.pick_job(0.0)
    assert job is not None and job[0] == GIVE_BACK and job[1].shape[0] == 4
    core.job_done(GIVE_BACK, job[1], None, 0.0)
    assert core.give_back == 10  # waits for the evictor's 10
    assert core.evict_due() == 10  # maintain takes the count and runs the evictor:
    core.free(held[:10])  # the evictor frees them into the cache
    job = core.pick_job(0.0)
    assert job is not None and job[0] == GIVE_BACK and job[1].shape[0] == 10
    assert core.give_back == 0


def test_an_evictor_that_fails_gives_up_the_give_back_it_was_to_serve() -> None:
    """The owner's evictor raised: the give-back waiting for its ids is given up (the state
    changes, the error is kept), and the cache goes on."""
    core = PageCacheCore("p", "kv", capacity=64, low=0, high=64, batch=8)
    core.ring.push(i32(list(range(1, 11))))
    held = core.take(8)
    assert held is not None
    core.can_evict, core.evictable = True, 8
    assert core.ask_give_back(6) == 6 and core.evict_wanted == 4
    job = core.pick_job(0.0)
    assert job is not None and job[1].shape[0] == 2
    core.job_done(GIVE_BACK, job[1], None, 0.0)
    want = core.evict_due()
    assert want == 4 and core.give_back == 4
    core.evict_failed(want, RuntimeError("the tree is busy"))
    assert core.give_back == 0 and isinstance(core.last_error, FailedPrecondition)
    assert core.pick_job(0.0) is None and core.report() == (0, 8, 4)


# -- the end ----------------------------------------------------------------------------------

def test_after_close_frees_go_to_the_daemon_and_after_a_loss_nowhere() -> None:
    """Once closed, freed ids are forgotten and the shell Frees them (counted); a refused
    Free puts them back in use; once the lease is gone, nothing is sent."""
    core = PageCacheCore("p", "kv", capacity=16, low=0, high=16, batch=1)
    core.ring.push(np.arange(1, 9, dtype=np.int32))
    ids = core.take(6)
    assert ids is not None
    assert core.close() and not core.close()
    assert core.drain().tolist() == [7, 8]
    calls = core.rpc_calls
    arr, send = core.free(i32([4, 5, 6]))
    assert arr.tolist() == [4, 5, 6] and send and core.rpc_calls == calls + 1
    assert core.in_use == 3 and core.cached == 0
    core.unfree(arr)  # the daemon refused that Free
    assert core.in_use_of(arr).all() and core.in_use == 6
    assert core.free(i32([]))[1] is False  # nothing to send
    core.lose(NotFound("lease 1 expired"))
    arr, send = core.free(i32([1, 2]))
    assert not send and core.rpc_calls == calls + 1 and core.drain().shape == (0,)


def test_settle_pause_without_a_worker() -> None:
    """A cache without a worker settles by running ``maintain`` itself: the pause says done,
    timed out, or how long until a held-back job may run."""
    core = PageCacheCore("p", "kv", capacity=32, low=4, high=8, batch=2)
    core.prefill = False
    core.ring.push(i32(list(range(1, 7))))
    assert core.settle_pause(0.0, None) is True
    core.ask_give_back(4)
    job = core.pick_job(0.0)
    assert job is not None
    core.job_done(GIVE_BACK, job[1], None, 0.0)  # 2 cached: below low, held back 0.5 s
    pause = core.settle_pause(0.0, None)
    assert type(pause) is float and 0.0 < pause <= 0.5
    assert core.settle_pause(1.0, 0.5) is False  # past the deadline
