"""The pure rules of transfers between daemons: which page layouts agree, and the receive
grants' bounds, expiry and revocation (no NIXL needed)."""

from __future__ import annotations

import numpy as np
import pytest

from kvpool.errors import FailedPrecondition, InvalidArgument, NotFound, ResourceExhausted
from kvpool.records import TransferState
from kvpoold.transfer import grants as grants_mod
from kvpoold.transfer.grants import GrantTable
from kvpoold.transfer.layout import layout_mismatch, page_buffers, page_layout
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


def grant_table() -> tuple[GrantTable, ManualClock, list[TransferState]]:
    clock = ManualClock()
    ended: list[TransferState] = []
    return GrantTable(clock, lambda g: ended.append(g.state)), clock, ended


def test_a_grant_is_found_by_its_token_accepted_once_and_ends_done() -> None:
    table, _clock, ended = grant_table()
    pages = np.array([3, 4, 5], dtype=np.int32)
    grant = table.add("p", 7, 1, pages, None, 10.0)
    assert len(grant.token) == 16 and table.find(grant.token) is grant
    assert table.add("p", 7, 1, pages, None, 10.0).token != grant.token
    note = table.accept(grant, "peer-agent", 1234)
    assert table.by_notification(note) is grant and table.receiving == 1
    with pytest.raises(FailedPrecondition, match="already used"):
        table.accept(grant, "other", 1)
    table.end(grant, TransferState.done, "")
    assert ended == [TransferState.done] and table.receiving == 0
    with pytest.raises(FailedPrecondition, match="was used"):
        table.accept(grant, "other", 1)
    assert grant.status(0).bytes == 1234


def test_grants_expire_and_are_forgotten_later() -> None:
    table, clock, _ended = grant_table()
    idle = table.add("p", 7, 1, np.array([1], dtype=np.int32), None, 1.0)
    busy = table.add("p", 7, 1, np.array([2], dtype=np.int32), None, 1.0)
    table.accept(busy, "agent-x", 10)
    clock.advance(1.5)
    table.expire()
    assert "expired before any transfer used it" in idle.message
    assert "did not complete before the grant expired" in busy.message
    assert table.live == 0
    clock.advance(grants_mod.ENDED_KEEP_S + 1)
    table.expire()
    with pytest.raises(NotFound):
        table.find(idle.token)
    # An expired grant is refused at accept time too (the sweep may not have run yet).
    late = table.add("p", 7, 1, np.array([3], dtype=np.int32), None, 1.0)
    clock.advance(2.0)
    with pytest.raises(FailedPrecondition, match="expired"):
        table.accept(late, "agent-x", 10)


def test_revocation_by_owner_and_pool() -> None:
    table, _clock, _ended = grant_table()
    a = table.add("p", 7, 1, np.array([1], dtype=np.int32), None, 10.0)
    b = table.add("q", 7, 1, np.array([1], dtype=np.int32), None, 10.0)
    c = table.add("p", 8, 2, np.array([2], dtype=np.int32), None, 10.0)
    assert table.revoke_owner(1, "lease ended", pool="p") == 1
    assert a.state == TransferState.failed and b.state == TransferState.pending
    assert table.revoke_pool("p", "dropped") == 1 and c.message == "dropped"
    assert table.of_owner(1) == [b]


def test_bounds() -> None:
    table, _clock, _ended = grant_table()
    with pytest.raises(InvalidArgument, match="ttl_seconds"):
        table.add("p", 7, 1, np.array([1], dtype=np.int32), None, 0.01)
    with pytest.raises(InvalidArgument, match="token"):
        table.find(b"")
    with pytest.raises(InvalidArgument, match="token"):
        table.find(b"x" * 65)
    old = grants_mod.MAX_GRANTS_PER_LEASE
    grants_mod.MAX_GRANTS_PER_LEASE = 2
    try:
        for _ in range(2):
            table.add("p", 7, 1, np.array([1], dtype=np.int32), None, 10.0)
        with pytest.raises(ResourceExhausted, match="at most 2"):
            table.add("p", 7, 1, np.array([1], dtype=np.int32), None, 10.0)
    finally:
        grants_mod.MAX_GRANTS_PER_LEASE = old


def test_the_sweep_visits_only_due_grants_in_deadline_order() -> None:
    """Expiry pops a deadline heap: grants that ended early, or are not due, are not ended
    again or early; many early-ended grants do not pile up in the heap."""
    table, clock, ended = grant_table()
    short = table.add("p", 7, 1, np.array([1], dtype=np.int32), None, 1.0)
    long = table.add("p", 7, 1, np.array([2], dtype=np.int32), None, 5.0)
    done = table.add("p", 7, 1, np.array([3], dtype=np.int32), None, 0.5)
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
        table.end(table.add("p", 7, 1, np.array([4], dtype=np.int32), None, 3600.0),
                  TransferState.done, "")
    assert len(table._deadlines) <= 2 * table.live + 1025


def test_page_marks_answer_free_in_the_size_of_the_free() -> None:
    """PageMarks: the grant covering each page, pages moved by transfers (KV and SWA), one
    grant per page, and a grant's marks gone when it ends."""
    from kvpoold.transfer.marks import PageMarks

    table, _clock, _ended = grant_table()
    marks = PageMarks("p", capacity=16, swa_capacity=8)
    a = table.add("p", 7, 1, np.array([1, 2, 3], dtype=np.int32), None, 10.0)
    marks.add_grant(a)
    with pytest.raises(FailedPrecondition, match=r"pages\[1\]=3 .* already in a live"):
        marks.check_ungranted(np.array([9, 3], dtype=np.int32), "pages")
    b = table.add("p", 7, 1, np.array([9], dtype=np.int32), None, 10.0)
    marks.add_grant(b)
    ids = np.array([0, 2, 9, 17, 9], dtype=np.int32)
    assert marks.in_range(ids).tolist() == [2, 9, 9]
    assert marks.grants_of(marks.in_range(ids)) in ([a, b], [b, a])
    assert marks.busy_of(marks.in_range(ids)).tolist() == []
    # b accepted a sender writing page 9 and SWA page 4; a send reads pages 2, 2 (twice) and 5.
    table.accept(b, "peer", 1)
    b.swa_written = np.array([4], dtype=np.int32)
    marks.moving(b.pages, b.swa_written, +1)
    send_pages = np.array([2, 2, 5], dtype=np.int32)
    marks.moving(send_pages, None, +1)
    assert marks.busy_of(np.array([1, 2, 5, 9], dtype=np.int32)).tolist() == [2, 5, 9]
    assert marks.busy_of(np.array([4, 5], dtype=np.int32), swa=True).tolist() == [4]
    marks.moving(send_pages, None, -1)
    marks.end_grant(b)  # was receiving: its pages stop being written
    table.end(b, TransferState.done, "")
    assert marks.busy_of(np.arange(1, 17, dtype=np.int32)).tolist() == []
    assert marks.busy_of(np.arange(1, 9, dtype=np.int32), swa=True).tolist() == []
    assert marks.grants_of(np.array([9], dtype=np.int32)) == []
    marks.end_grant(b)  # ending twice changes nothing
    c = table.add("p", 7, 1, np.array([9], dtype=np.int32), None, 10.0)
    marks.add_grant(c)  # the slot b had is reused
    assert c.slot == 2 and marks.grants_of(np.array([9, 1], dtype=np.int32)) in ([a, c], [c, a])
