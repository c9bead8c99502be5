"""The receiver's fence is facts, never a clock: a frozen sender's pages stay quarantined (and
counted per peer) past every deadline, and are freed by its completion or its death; a
cancelled grant frees its pages at once (two real daemons, real NIXL; issue 39)."""

from __future__ import annotations

import pytest

from kvpool import FailedPrecondition, KVPoolClient, NotFound
from kvpool.contract import rpcs
from kvpool.contract.records import TransferState
from tests.conftest import TINY_OPTIONS, TINY_SPEC, run_daemon, temp_dir
from tests.transfer.fence_scenario import frozen_sender


@pytest.mark.parametrize(("pages", "end"), [(64, "cont"), (512, "cont"), (256, "kill")])
def test_a_frozen_sender_writes_no_byte_into_another_lease(pages: int, end: str) -> None:
    """SIGSTOP the sender once the receiver accepted it, pass every deadline, close the
    receiving lease and hand every free page to victims: none of them gets a fenced page, and
    once the sender completed (SIGCONT) or died (SIGKILL) the fence is released and no byte
    of the sender is in any victim's pages."""
    run = frozen_sender(pages, end)
    assert run.sender_bytes_in_victims == 0, run
    assert run.fenced in (0, pages), run  # 0: the write had completed before the stop
    if end == "cont":  # resumed past its deadline: it completed, or cancelled its write
        assert (run.send_outcome == TransferState.done.value
                or "deadline and was cancelled" in run.send_outcome), run


def test_cancel_grant_frees_unused_pages_at_once() -> None:
    with temp_dir() as d1, run_daemon(d1) as daemon, KVPoolClient(daemon.target) as c:
        c.configure("p", spec=TINY_SPEC, **TINY_OPTIONS)
        with c.lease("decode") as lease:
            pages = lease.allocate("p", "kv", 4)
            grant = lease.grant_receive("p", pages, ttl_s=3600)
            with pytest.raises(FailedPrecondition, match="pinned"):
                lease.free("p", "kv", pages)
            assert c.stats("p").pools[0].spaces["kv"].pinned == 4
            cancelled = grant.cancel()
            assert (cancelled.freed_pages, cancelled.fenced_pages) == (4, 0)
            assert cancelled.status.state == TransferState.failed
            assert "cancelled" in cancelled.status.message
            assert c.stats("p").pools[0].spaces["kv"].pinned == 0
            assert grant.cancel().freed_pages == 0  # already ended: nothing more to free
            assert lease.free("p", "kv", pages) == 4
            with c.lease("other") as other:  # only the lease that made it may cancel it
                again = lease.grant_receive("p", lease.allocate("p", "kv", 1))
                with pytest.raises(NotFound, match="made no receive grant"):
                    c.run(rpcs.cancel_grant(other, again.token))
