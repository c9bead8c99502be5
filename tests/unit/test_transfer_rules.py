"""The pure rules of transfers between daemons: which page layouts agree, and the receive
grants' bounds, expiry and revocation (no NIXL needed)."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import pytest

from kvpool.contract.errors import FailedPrecondition, InvalidArgument, NotFound, ResourceExhausted
from kvpool.contract.records import TransferState
from kvpoold.transfer import grants as grants_mod
from kvpoold.transfer.grants import GrantTable, ReceiveGrant
from kvpoold.transfer.page_layout import layout_mismatch, page_buffers, page_layout
from tests.factories import GiB, deepseek_v3, deepseek_v32, llama_8b, plan_for
from tests.service.conftest import ManualClock


def test_pools_of_other_sizes_share_a_page_layout() -> None:
    small = plan_for(llama_8b(), budget_bytes=1 * GiB, page_size=16)
    large = plan_for(llama_8b(), budget_bytes=4 * GiB, page_size=16)
    assert small.fingerprint() != large.fingerprint()
    assert layout_mismatch(page_layout(small), page_layout(large)) is None
    assert len(page_buffers(small)) == 64  # K and V of 32 layers


def test_a_tp_split_is_refused_naming_it() -> None:
    tp1 = page_layout(plan_for(llama_8b(), budget_bytes=1 * GiB, page_size=16))
    tp2 = page_layout(plan_for(llama_8b(), budget_bytes=1 * GiB, page_size=16, tp_size=2))
    why = layout_mismatch(tp1, tp2)
    assert why is not None
    assert "buffer k.0: bytes per page is 16384 on the sender, 32768 here" in why
    assert "tp_size 2 on the sender, 1 here" in why and "not supported" in why


@pytest.mark.parametrize(("other", "words"), [
    ({"page_size": 32}, "page_size is 32 on the sender, 16 here"),
    ({"kv_cache_dtype": "fp8_e4m3"}, "kv_cache_dtype is fp8_e4m3 on the sender"),
])
def test_other_options_are_refused(other: dict[str, object], words: str) -> None:
    mine = page_layout(plan_for(llama_8b(), budget_bytes=1 * GiB, page_size=16))
    theirs = page_layout(plan_for(llama_8b(), **{"budget_bytes": 1 * GiB, "page_size": 16,
                                                  **other}))
    why = layout_mismatch(mine, theirs)
    assert why is not None and words in why


def test_other_models_and_stages_are_refused() -> None:
    mla = page_layout(plan_for(deepseek_v3(), budget_bytes=4 * GiB, page_size=64))
    dsa = page_layout(plan_for(deepseek_v32(), budget_bytes=4 * GiB, page_size=64))
    llama = page_layout(plan_for(llama_8b(), budget_bytes=1 * GiB, page_size=16))
    assert "architecture is mha on the sender, mla here" in (layout_mismatch(mla, llama) or "")
    assert layout_mismatch(dsa, mla) is not None  # the indexer's keys move with the pages
    stage0 = page_layout(plan_for(llama_8b(), budget_bytes=1 * GiB, page_size=16, pp_size=2))
    stage1 = page_layout(plan_for(llama_8b(), budget_bytes=1 * GiB, page_size=16, pp_size=2,
                                  pp_rank=1))
    assert "pp_rank" in (layout_mismatch(stage0, stage1) or "")


class Pins:
    """The pin a grant takes of its pages: counts live pins; each unpin runs once."""

    def __init__(self) -> None:
        self.live = 0

    def __call__(self) -> Callable[[], None]:
        self.live += 1

        def unpin() -> None:
            self.live -= 1

        return unpin


PINS = Pins()


def grant_table() -> tuple[GrantTable, ManualClock, list[TransferState]]:
    clock = ManualClock()
    ended: list[TransferState] = []
    return GrantTable(clock, lambda g: ended.append(g.state)), clock, ended


def add(table: GrantTable, pages: list[int], ttl_s: float = 10.0, pool: str = "p",
        lease: int = 7, owner: int = 1, pins: Pins = PINS) -> ReceiveGrant:
    return table.add(pool, lease, owner, np.array(pages, dtype=np.int32), None, ttl_s, pins)


def test_a_grant_is_found_by_its_token_accepted_once_and_ends_done() -> None:
    table, _clock, ended = grant_table()
    grant = add(table, [3, 4, 5])
    assert len(grant.token) == 16 and table.find(grant.token) is grant
    assert add(table, [3, 4, 5]).token != grant.token
    note = table.accept(grant, "peer-agent", 1234)
    assert table.by_notification(note) is grant and table.receiving == 1
    with pytest.raises(FailedPrecondition, match="already used"):
        table.accept(grant, "other", 1)
    table.close_window(grant, TransferState.done, "")
    assert ended == [TransferState.done] and table.receiving == 0
    with pytest.raises(FailedPrecondition, match="was used"):
        table.accept(grant, "other", 1)
    assert grant.status(0).bytes == 1234


def test_grants_expire_and_accepted_ones_end_at_their_deadline_fenced() -> None:
    table, clock, _ended = grant_table()
    idle = add(table, [1], ttl_s=1.0)
    busy = add(table, [2], ttl_s=2.0)
    table.accept(busy, "agent-x", 10)
    assert busy.write_s == 2.0
    clock.advance(1.5)
    table.expire()
    assert "expired before any transfer used it" in idle.message
    assert busy.state == TransferState.pending  # accepted: the write's deadline ends it
    clock.advance(busy.write_s)
    table.expire()
    assert "did not complete within its 2 s deadline" in busy.message
    # The record ended; the write window stays open (fenced) until a fact closes it.
    assert table.live == 0 and table.receiving == 1 and busy.fenced
    assert table.fenced() == {"agent-x": (1, 1)}
    table.close_window(busy, TransferState.failed, "the sender reported its write ended")
    assert table.receiving == 0 and table.fenced() == {}
    clock.advance(grants_mod.ENDED_KEEP_S + 1)
    table.expire()
    with pytest.raises(NotFound):
        table.find(idle.token)
    # An expired grant is refused at accept time too (the sweep may not have run yet).
    late = add(table, [3], ttl_s=1.0)
    clock.advance(2.0)
    with pytest.raises(FailedPrecondition, match="expired"):
        table.accept(late, "agent-x", 10)


def test_pins_go_when_no_byte_can_move_any_more() -> None:
    """A grant pins its pages from the start. Without a sender its end unpins; with one, a
    revoke (the lease ended) ends the record but the pins stay until the write's notification;
    the sender's report unpins at once; no clock ever does."""
    table, clock, _ended = grant_table()
    pins = Pins()
    unused = add(table, [1], pins=pins)
    revoked = add(table, [2], ttl_s=5.0, pins=pins)
    reported = add(table, [3], pins=pins)
    fenced = add(table, [4], ttl_s=5.0, pins=pins)
    assert pins.live == 4
    table.end(unused, TransferState.failed, "lease ended")
    assert pins.live == 3
    note = table.accept(revoked, "agent", 1)
    table.accept(reported, "agent", 1)
    table.accept(fenced, "agent", 1)
    table.end(revoked, TransferState.failed, "lease ended")
    assert revoked.state == TransferState.failed and pins.live == 3
    table.close_window(table.by_notification(note) or revoked, TransferState.done, "")
    assert revoked.state == TransferState.failed and pins.live == 2  # landed in quarantine
    table.close_window(reported, TransferState.failed, "the sender's write failed")
    assert pins.live == 1
    clock.advance(fenced.write_s + 3600.0)
    table.expire()
    assert pins.live == 1 and fenced.state == TransferState.failed and fenced.fenced
    table.close_window(fenced, TransferState.failed, "the sender's process exited")
    assert pins.live == 0 and table.receiving == 0


def test_revocation_by_owner_and_pool() -> None:
    table, _clock, _ended = grant_table()
    a = add(table, [1])
    b = add(table, [1], pool="q")
    c = add(table, [2], lease=8, owner=2)
    assert table.revoke_owner(1, "lease ended", pool="p") == 1
    assert a.state == TransferState.failed and b.state == TransferState.pending
    assert table.revoke_pool("p", "dropped") == 1 and c.message == "dropped"
    assert table.of_owner(1) == [b]


def test_bounds() -> None:
    table, _clock, _ended = grant_table()
    with pytest.raises(InvalidArgument, match="ttl_seconds"):
        add(table, [1], ttl_s=0.01)
    with pytest.raises(InvalidArgument, match="token"):
        table.find(b"")
    with pytest.raises(InvalidArgument, match="token"):
        table.find(b"x" * 65)
    old = grants_mod.MAX_GRANTS_PER_LEASE
    grants_mod.MAX_GRANTS_PER_LEASE = 2
    try:
        for _ in range(2):
            add(table, [1])
        with pytest.raises(ResourceExhausted, match="at most 2"):
            add(table, [1])
    finally:
        grants_mod.MAX_GRANTS_PER_LEASE = old


def test_the_sweep_visits_only_due_grants_in_deadline_order() -> None:
    """Expiry pops a deadline heap: grants that ended early, or are not due, are not ended
    again or early; many early-ended grants do not pile up in the heap."""
    table, clock, ended = grant_table()
    short = add(table, [1], ttl_s=1.0)
    long = add(table, [2], ttl_s=5.0)
    done = add(table, [3], ttl_s=0.5)
    table.end(done, TransferState.done, "")
    clock.advance(2.0)
    table.expire()
    assert (short.state, long.state, done.state) == (
        TransferState.failed, TransferState.pending, TransferState.done)
    assert ended == [TransferState.done, TransferState.failed]
    clock.advance(4.0)
    table.expire()
    assert long.state == TransferState.failed and table.live == 0
    for _ in range(5000):  # made and used at once: the heap is compacted as it grows
        table.end(add(table, [4], ttl_s=3600.0), TransferState.done, "")
    assert len(table._deadlines) <= 2 * table.live + 1025
