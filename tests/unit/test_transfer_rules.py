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
