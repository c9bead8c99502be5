"""``PageCacheCore`` (the page cache's state, no I/O) against a plain-Python model.

The core keeps its cached ids in a ring and tells an id in use from its slot alone (see
``kvpool.cache.page_cache``). A small capacity makes every program wrap the ring many times. Each
rule is what the cache does on one path: a refill or return by the worker, an ``alloc``, a
miss that reserves and then finishes or is refused, a ``free`` (valid, repeated, foreign, out
of range, a double free), a give-back, and ``close`` followed by frees of ids still in use.
After every step the model's FIFO queue, in-use set and counters must match the core's.
"""

from __future__ import annotations

from collections import deque

import numpy as np
import pytest
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from kvpool.cache import ring
from kvpool.cache.policy import CHECK, GIVE_BACK, REFILL, RETURN, PageCacheCore
from kvpool.contract.errors import (
    FailedPrecondition,
    InvalidArgument,
    KVPoolError,
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

    # -- the worker ---------------------------------------------------------------------------

    @precondition(lambda self: self.core.dead is None)
    @rule(k=st.integers(0, CAP))
    def refill(self, k: int) -> None:
        got = sorted(self.daemon)[:k]
        self.daemon -= set(got)
        self.core.push(i32(got))
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
        # The most recently cached go back, in ring order.
        want = list(self.queue)[len(self.queue) - n:]
        assert ids.tolist() == want
        for _ in range(n):
            self.queue.pop()
        core.job_done(kind, ids, None)
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
    @rule(n=st.integers(1, CAP), refused=st.booleans())
    def miss(self, n: int, refused: bool) -> None:
        core = self.core
        reserved = core.reserve(n)
        k = min(n, len(self.queue))
        want = [self.queue.popleft() for _ in range(k)]
        assert reserved.tolist() == want
        self.elsewhere |= set(want)
        assert not core.in_use_of(reserved).any()
        if refused or n - k > len(self.daemon):
            core.unreserve(reserved)  # back at the tail
            self.queue.extend(want)
            self.elsewhere -= set(want)
            return
        got = sorted(self.daemon)[:n - k + 1]  # one more than needed: it is cached
        self.daemon -= set(got)
        ids = core.hand_out(reserved, i32(got), n)
        assert ids.tolist() == want + got[:n - k]
        self.elsewhere -= set(want)
        self.in_use |= set(ids.tolist())
        self.queue.extend(got[n - k:])

    # -- free ---------------------------------------------------------------------------------

    @precondition(lambda self: self.in_use)
    @rule(data=st.data())
    def free(self, data: st.DataObject) -> None:
        ids = data.draw(st.lists(st.sampled_from(sorted(self.in_use)), min_size=1,
                                 unique=True))
        arr, cached = self.core.free_ids(i32(ids))
        assert arr.tolist() == ids
        self.in_use -= set(ids)
        if self.core.dead is None:
            assert cached
            self.queue.extend(ids)
        else:
            assert not cached and self.core.send_freed(arr)  # the caller Frees them
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
            self.core.free_ids(i32(ids))
        assert type(info.value) is cls and info.value.field == where
        assert self.state() == before

    def state(self) -> tuple[list[int], list[int], int, int]:
        """What a refused free must leave alone (a rebase may re-encode the slots)."""
        core = self.core
        return (core.read(core.head, core.cached).tolist(), core.handed_out().tolist(),
                core.head, core.tail)

    # -- the end ------------------------------------------------------------------------------

    @precondition(lambda self: self.core.dead is None)
    @rule()
    def close(self) -> None:
        self.core.close()
        drained = self.core.drain()
        assert drained.tolist() == list(self.queue)
        self.daemon |= set(self.queue)
        self.queue.clear()

    @invariant()
    def agrees_with_model(self) -> None:
        core = self.core
        assert core.read(core.head, core.cached).tolist() == list(self.queue)
        assert core.handed_out().tolist() == sorted(self.in_use)
        assert core.n_in_use == len(self.in_use)
        everyone = np.arange(0, CAP + 3)
        assert core.in_use_of(everyone).tolist() == [i in self.in_use for i in everyone]
        assert core.counters().cached == len(self.queue)


TestCoreMachine = CoreMachine.TestCase
TestCoreMachine.settings = SETTINGS


def test_an_id_listed_65537_times_is_refused() -> None:
    """However often an id is listed, the slot read back shows it (no counter to wrap)."""
    core = PageCacheCore("p", "kv", capacity=70_000, low=0, high=70_000, batch=1)
    core.push(np.arange(70_000, 0, -1, dtype=np.int32))
    ids = core.take(2)
    assert ids is not None
    before = core.pos.copy()
    with pytest.raises(InvalidArgument) as info:
        core.free_ids(np.full(65_537, ids[0], dtype=np.int32))
    assert info.value.field == "ids[1]"
    assert np.array_equal(core.pos, before)
    assert core.free_ids(ids)[0].tolist() == ids.tolist()  # both still in use: freed at once


@pytest.mark.parametrize("bad", ["repeat", "cached"])
def test_a_refused_free_that_crosses_a_rebase_changes_nothing(bad: str) -> None:
    """The free that would move ``base`` is refused after its checks read the slots: what it
    read must still be valid when it puts them back."""
    core = PageCacheCore("p", "kv", capacity=8, low=0, high=8, batch=1, window=2,
                         rebase_at=12)
    core.push(np.arange(1, 9, dtype=np.int32))
    ids = core.take(6)
    assert ids is not None
    core.free_ids(ids[:2])  # tail 10: a free of 3 more crosses 12
    handed, cached = core.handed_out().tolist(), core.read(core.head, core.cached).tolist()
    bad_ids = [ids[2], ids[3], ids[2]] if bad == "repeat" else [ids[2], ids[3], ids[0]]
    with pytest.raises(KVPoolError):
        core.free_ids(np.asarray(bad_ids, dtype=np.int32))
    assert core.handed_out().tolist() == handed
    assert core.read(core.head, core.cached).tolist() == cached
    assert core.free_ids(ids[2:6])[0].tolist() == ids[2:6].tolist()  # still in use, all four
    assert core.handed_out().tolist() == []


def test_a_rebase_in_chunks_keeps_every_id_where_it_was(monkeypatch: pytest.MonkeyPatch) -> None:
    """The rebase walks ``pos`` a chunk at a time (bounded temporaries); ids in use, cached and
    not here keep their meaning across chunk borders, and the queue its order."""
    monkeypatch.setattr(ring, "REBASE_CHUNK", 4)
    core = PageCacheCore("p", "kv", capacity=30, low=0, high=30, batch=1)
    core.push(np.arange(30, 5, -1, dtype=np.int32))  # ids 1..5 are not here
    ids = core.take(12)
    assert ids is not None
    core.free_ids(ids[::3])
    handed, cached = core.handed_out().tolist(), core.read(core.head, core.cached).tolist()
    core.rebase()
    assert core.base == core.head
    assert core.handed_out().tolist() == handed
    assert core.read(core.head, core.cached).tolist() == cached
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
    core.push(i32([1, 2, 3]))  # below low
    refuse_all(core, 10.0, ResourceExhausted("full"))
    assert core.refill_retry.at > 10.0 and core.pick_job(10.0) is None
    core.push(i32(list(range(4, 14))))  # 13 cached: above high
    job = core.pick_job(10.0)
    assert job is not None and job[0] == RETURN and job[1].shape == (13 - 6,)
    core.job_done(RETURN, job[1], None)
    assert core.pick_job(10.0) is None and core.cached == 6


def test_settled_waits_for_what_was_refused_before_settle_began() -> None:
    """A refusal from before ``begin_settle`` does not count as settled: ``begin_settle`` lifts
    the backoff so the worker tries again, and only a refusal from then on (or success) does."""
    core = PageCacheCore("p", "kv", capacity=32, low=4, high=8, batch=2)
    core.push(i32([1, 2, 3]))
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
    core.push(i32(list(range(4, 14))))
    refuse_all(core, 11.0, Unavailable("down"))
    assert core.cached == 13
    core.begin_settle()
    assert not core.settled()
    job = core.pick_job(11.0)
    assert job is not None and job[0] == RETURN
    core.job_done(RETURN, job[1], None)
    assert core.settled() and core.cached == 6


def test_settle_lifts_the_hold_after_a_give_back() -> None:
    """After a give-back the worker holds refills back for a while; ``settle`` waits for none
    of that: the refill is due at once."""
    core = PageCacheCore("p", "kv", capacity=32, low=4, high=8, batch=2)
    core.push(i32(list(range(1, 9))))
    core.ask_give_back(6)
    job = core.pick_job(0.0)
    assert job is not None and job[0] == GIVE_BACK
    core.job_done(GIVE_BACK, job[1], None)
    assert core.cached == 2 and core.pick_job(0.0) is None  # held back
    core.begin_settle()
    assert not core.settled() and core.pick_job(0.0) == (REFILL, 6)


def test_a_give_back_returns_the_highest_cached_ids_and_keeps_the_rest_in_order() -> None:
    """The daemon takes back an elastic pool's highest groups: a give-back returns the highest
    ids the cache holds, whatever order they were cached in, and the others stay cached in
    their order (the next allocs hand them out as before)."""
    core = PageCacheCore("p", "kv", capacity=64, low=0, high=64, batch=8)
    core.push(i32([40, 3, 57, 9, 12, 61, 5, 33]))
    core.ask_give_back(3)
    job = core.pick_job(0.0)
    assert job is not None and job[0] == GIVE_BACK
    assert sorted(job[1].tolist()) == [40, 57, 61]
    core.job_done(GIVE_BACK, job[1], None)
    assert core.cached == 5
    got = core.take(5)
    assert got is not None and got.tolist() == [3, 9, 12, 5, 33]
    core.free_ids(got)
    assert core.cached == 5


def test_a_give_back_past_the_cache_asks_the_evictor_for_at_most_what_it_offered() -> None:
    """Cached ids first; past them, up to what the owner said it can evict (not yet asked):
    those are counted for the evictor, and the report stops offering them."""
    core = PageCacheCore("p", "kv", capacity=64, low=0, high=64, batch=8)
    core.push(i32(list(range(1, 21))))
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
    core.job_done(GIVE_BACK, job[1], None)
    assert core.give_back == 10  # waits for the evictor's 10
    core.evict_wanted = 0  # maintain takes the count and runs the evictor:
    core.free_ids(held[:10])  # the evictor frees them into the cache
    job = core.pick_job(0.0)
    assert job is not None and job[0] == GIVE_BACK and job[1].shape[0] == 10
    assert core.give_back == 0


# -- ids the lease no longer holds (issue 20, item 10) ----------------------------------------

def test_a_short_count_makes_one_check_and_its_answer_drops_what_is_not_held() -> None:
    """A reply saying the lease holds fewer ids than the cache counts makes a check of every
    id it counts, first of all jobs; its answer drops the cached ones (the queue keeps its
    order) and marks the ones in use, which a later free drops (alone or among others), also
    across a rebase. Replies of RPCs that overlapped, or that hold as many, check nothing."""
    core = PageCacheCore("p", "kv", capacity=16, low=0, high=16, batch=1)
    core.push(np.arange(1, 11, dtype=np.int32))
    ids = core.take(4)  # 1..4 in use, 5..10 cached
    assert ids is not None
    first, second = core.rpc_begin(), core.rpc_begin()
    core.rpc_end(second, 3)  # another RPC ran meanwhile: no conclusion
    core.rpc_end(first, 3)
    core.rpc_end(core.rpc_begin(), 12)  # the lease holds more than the cache: no fault
    assert not core.check_due
    core.give_back = 2
    core.rpc_end(core.rpc_begin(), 7)  # 10 counted, 7 held
    assert core.check_due and not core.settled()
    job = core.pick_job(0.0)
    assert job is not None and job[0] == CHECK
    assert sorted(job[1].tolist()) == list(range(1, 11))
    core.job_done(CHECK, job[1], i32([6, 9, 2]))
    assert (core.checks, core.dropped_unheld, core.unheld_in_use) == (1, 3, 1)
    assert core.read(core.head, core.cached).tolist() == [5, 7, 8, 10]
    assert core.report() == (4, 3, 0)
    assert core.handed_out().tolist() == [1, 2, 3, 4]  # 2 stays in use until it is freed
    core.rebase()
    assert core.free_ids(i32([2]))[0].tolist() == [2]  # dropped, not cached
    assert core.read(core.head, core.cached).tolist() == [5, 7, 8, 10]
    assert core.unheld_in_use == 0 and core.n_in_use == 3
    core.rpc_end(core.rpc_begin(), 7)  # 3 in use + 4 cached: held as counted
    assert not core.check_due


def test_a_marked_id_freed_among_others_is_dropped_and_after_close_not_sent() -> None:
    core = PageCacheCore("p", "kv", capacity=16, low=0, high=16, batch=1)
    core.push(np.arange(1, 9, dtype=np.int32))
    ids = core.take(6)
    assert ids is not None
    core.drop_unheld(i32([2, 5]))  # both in use
    arr, cached = core.free_ids(i32([1, 2, 3]))
    assert arr.tolist() == [1, 2, 3] and cached
    assert core.read(core.head, core.cached).tolist() == [7, 8, 1, 3]
    core.close()
    core.drain()
    arr, cached = core.free_ids(i32([4, 5, 6]))  # after close: only the lease's go to the daemon
    assert arr.tolist() == [4, 6] and not cached and core.n_in_use == 0
    calls = core.rpc_calls
    assert core.send_freed(arr) and core.rpc_calls == calls + 1
    assert not core.send_freed(arr[:0]) and core.rpc_calls == calls + 1  # nothing to send
