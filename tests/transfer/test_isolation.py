"""Pages stay isolated across transfers between daemons: the ledger pins what a transfer moves,
a late write lands only in pages no lease holds, a send never ships another lease's bytes, and
only peer daemons reach the daemon-to-daemon methods (docs/security.md, docs/pd-transfer.md).

Real ``kvpoold serve`` processes; where a test needs a sender that never writes, it speaks the
daemon-to-daemon protocol itself (it is the local admin on the decode daemon's socket).
"""

from __future__ import annotations

import json
import signal
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

from kvpool import (
    Aborted,
    FailedPrecondition,
    InvalidArgument,
    KVPoolClient,
    PermissionDenied,
    ResourceExhausted,
)
from kvpool.contract.errors import KVPoolError
from kvpool.contract.records import TransferState
from kvpool.v1 import kvpool_pb2 as pb
from kvpoold.transfer.grants import MIN_WRITE_S
from kvpoold.transfer.page_layout import page_layout
from tests.conftest import REPO, TINY_OPTIONS, TINY_SPEC, run_daemon, subprocess_env, temp_dir
from tests.transfer.test_tokens import POOL, client, secret, secret_file, tokened_daemon_args
from tests.transfer.test_transfer import big_pair, fill, kv_names, page_bytes


def until(check: Callable[[], bool], timeout_s: float = 20.0, what: str = "") -> None:
    deadline = time.monotonic() + timeout_s
    while not check():
        if time.monotonic() > deadline:
            raise AssertionError(f"not within {timeout_s} s: {what}")
        time.sleep(0.02)


def kv_stats(c: KVPoolClient, pool: str) -> Any:
    return c.stats(pool).pools[0].spaces["kv"]


def take_all(c: KVPoolClient, lease: Any, pool: str) -> np.ndarray:
    """Every page a lease can allocate now."""
    free = kv_stats(c, pool).free
    return lease.allocate(pool, "kv", free) if free else np.zeros(0, dtype=np.int32)


def accept_as_sender(c: KVPoolClient, token: bytes, plan: Any, pages: int,
                     process: pb.SenderProcess | None = None) -> pb.PeerReceiveResponse:
    """Be the sender whose write never reports: accepted, then silent (naming ``process`` as
    the sending daemon's process, or none)."""
    return c.call("PeerReceive", pb.PeerReceiveRequest(
        token=token, layout=page_layout(plan), pages=pages, sender="test-sender",
        sender_process=process))


def fenced(c: KVPoolClient, peer: str = "test-sender") -> int:
    return sum(p.fenced_pages for p in c.stats().peers if p.peer == peer)


def test_a_late_write_lands_only_in_quarantined_pages(tmp_path: Any) -> None:
    """The decode lease ends while an accepted sender's write is in flight: its pages are
    quarantined, a victim lease that takes every free page gets none of them, and they stay
    so past every deadline (fenced, counted for the peer) until the sender reports that its
    write has ended (PeerDone ok=false): no clock frees them."""
    with temp_dir() as d, run_daemon(d) as decode, KVPoolClient(decode.target) as c:
        plan = c.configure(POOL, spec=TINY_SPEC, **TINY_OPTIONS).plan
        dl = c.lease("decode", ttl_s=30)
        dst = dl.allocate(POOL, "kv", 4)
        grant = dl.grant_receive(POOL, dst, ttl_s=0.3)
        reply = accept_as_sender(c, grant.token, plan, 4)
        assert reply.write_deadline_seconds == MIN_WRITE_S  # the 0.3 s TTL, raised to the floor
        time.sleep(0.5)  # past the grant's expiry: an accepted grant does not end at it
        assert grant.status().state == TransferState.pending
        with pytest.raises(FailedPrecondition, match="pinned by a transfer"):
            dl.free(POOL, "kv", dst)
        dl.close()  # the lease ends mid-write
        s = kv_stats(c, POOL)
        assert (s.pinned, s.quarantined) == (4, 4)
        assert grant.status().state == TransferState.failed
        assert fenced(c) == 4
        with c.lease("victim") as victim:
            got = take_all(c, victim, POOL)
            assert got.shape[0] == s.capacity - 4
            assert not set(got.tolist()) & set(dst.tolist())
            time.sleep(MIN_WRITE_S + 1.0)  # past the write deadline: still fenced
            with pytest.raises(ResourceExhausted):
                victim.allocate(POOL, "kv", 1)
            assert kv_stats(c, POOL).quarantined == 4 and fenced(c) == 4
            c.call("PeerDone", pb.PeerDoneRequest(token=grant.token, ok=False,
                                                  message="cancelled, nothing in flight"))
            assert kv_stats(c, POOL).quarantined == 0 and fenced(c) == 0
            assert sorted(victim.allocate(POOL, "kv", 4).tolist()) == sorted(dst.tolist())
        s = kv_stats(c, POOL)
        assert (s.pinned, s.quarantined, s.used) == (0, 0, 0)


def test_the_exit_of_the_senders_process_releases_its_fence() -> None:
    """The sender names its process (a child here, standing in for a sending daemon): while it
    lives, even stopped, the pages stay fenced past every deadline; its exit (SIGKILL) frees
    them, seen through a pidfd."""
    import subprocess

    from kvpoold.transfer.liveness import this_process

    with temp_dir() as d, run_daemon(d) as decode, KVPoolClient(decode.target) as c:
        plan = c.configure(POOL, spec=TINY_SPEC, **TINY_OPTIONS).plan
        child = subprocess.Popen(["sleep", "600"])
        try:
            mine = this_process()
            with open(f"/proc/{child.pid}/stat", "rb") as f:
                stat = f.read()
            start = int(stat[stat.rindex(b")") + 2:].split()[19])
            proc = pb.SenderProcess(boot_id=mine.boot_id, pid_namespace=mine.pid_namespace,
                                    pid=child.pid, start_ticks=start)
            with c.lease("decode", ttl_s=30) as dl:
                dst = dl.allocate(POOL, "kv", 4)
                grant = dl.grant_receive(POOL, dst, ttl_s=0.3)
                accept_as_sender(c, grant.token, plan, 4, proc)
                child.send_signal(signal.SIGSTOP)
                with pytest.raises(Aborted, match="pages stay fenced"):
                    grant.wait(30)  # its deadline passed
                assert fenced(c) == 4 and kv_stats(c, POOL).pinned == 4
                child.kill()
                child.wait()
                until(lambda: fenced(c) == 0, 15, "the fence after the sender's exit")
                assert kv_stats(c, POOL).pinned == 0
                assert dl.free(POOL, "kv", dst) == 4
        finally:
            child.kill()
            child.wait()


def test_a_stopped_sender_never_overwrites_a_victim() -> None:
    """The prefill daemon is SIGSTOPped right after its send is posted; the decode lease ends,
    a victim takes every page it can and fills them; long after the fence the sender is
    resumed: whatever the timing, no byte of the victim's pages is the sender's, and every
    page the grant pinned comes back."""
    import torch

    with big_pair() as pair:
        pl = pair.p.lease("prefill", ttl_s=60)
        dl = pair.d.lease("decode", ttl_s=60)
        with pair.p.attach("big", lease=pl) as src_region, \
                pair.d.attach("big") as dst_region:
            names = kv_names(src_region)
            src, dst = pl.allocate("big", "kv", 256), dl.allocate("big", "kv", 256)
            fill(src_region, names, src, seed=7)
            grant = dl.grant_receive("big", dst, ttl_s=0.3)
            pair.p.send("big", src, peer=pair.decode.target, token=grant.token, lease=pl)
            pair.prefill.proc.send_signal(signal.SIGSTOP)
            try:
                dl.close()
                with pair.d.lease("victim", ttl_s=60) as victim:
                    got = take_all(pair.d, victim, "big")
                    marker = {int(p): bytes([0x5A]) * 16 for p in got}
                    for p in got:
                        dst_region.page(names[0], int(p)).view(-1).view(torch.uint8)[:16] \
                            .fill_(0x5A)
                    time.sleep(MIN_WRITE_S + 3.0)  # past every deadline
                    pair.prefill.proc.send_signal(signal.SIGCONT)
                    time.sleep(1.0)
                    for p in got:
                        first = page_bytes(dst_region, names[:1], int(p))[:16]
                        assert first == marker[int(p)], f"page {p} was overwritten"
                until(lambda: kv_stats(pair.d, "big").quarantined == 0, 20, "the fence")
            finally:
                pair.prefill.proc.send_signal(signal.SIGCONT)
            s = kv_stats(pair.d, "big")
            assert (s.pinned, s.used) == (0, 0)
            pl.close()


def test_a_send_never_ships_another_leases_pages() -> None:
    """The sending lease ends while its send waits on the receiving daemon (stopped): the
    send's pages are quarantined, a victim that takes every free page on the prefill side
    gets none of them and fills its own, and when the receiver resumes nothing is written into
    the granted pages; the pages come back once the send ended."""
    with big_pair() as pair:
        pl = pair.p.lease("prefill", ttl_s=60)
        with pair.d.lease("decode", ttl_s=60) as dl, \
                pair.d.attach("big", lease=dl) as dst_region:
            names = kv_names(dst_region)
            src, dst = pl.allocate("big", "kv", 8), dl.allocate("big", "kv", 8)
            grant = dl.grant_receive("big", dst, ttl_s=30)
            errors: list[BaseException] = []

            def send() -> None:
                try:
                    pair.p.send("big", src, peer=pair.decode.target, token=grant.token,
                                lease=pl)
                except BaseException as exc:  # the outcome is checked below
                    errors.append(exc)

            pair.decode.proc.send_signal(signal.SIGSTOP)
            try:
                sender = threading.Thread(target=send)
                sender.start()
                until(lambda: kv_stats(pair.p, "big").pinned == 8, 10, "the send's pins")
                pl.close()
                assert kv_stats(pair.p, "big").quarantined == 8
                with pair.p.lease("victim") as victim, \
                        pair.p.attach("big", lease=victim) as src_region:
                    got = take_all(pair.p, victim, "big")
                    assert not set(got.tolist()) & set(src.tolist())
                    fill(src_region, names, got, seed=99)
                    pair.decode.proc.send_signal(signal.SIGCONT)
                    sender.join(30)
                    assert len(errors) == 1 and isinstance(errors[0], KVPoolError)
                    assert "ended" in str(errors[0])
            finally:
                pair.decode.proc.send_signal(signal.SIGCONT)
            until(lambda: grant.status().state != TransferState.pending, 20, "the grant")
            assert grant.status().state == TransferState.failed
            zero = bytes(sum(b.page_bytes for b in dst_region.plan.buffers
                             if b.id_space == "kv"))
            for p in dst:
                assert page_bytes(dst_region, names, int(p)) == zero
            until(lambda: kv_stats(pair.p, "big").quarantined == 0, 10, "the send's end")


def test_peer_done_ok_does_not_end_a_grant_and_a_self_send_is_refused() -> None:
    """A forged PeerDone(ok=True) ends nothing (only the write's notification does); a daemon
    asked to send to itself answers FAILED_PRECONDITION before anything is posted."""
    with temp_dir() as d, run_daemon(d) as daemon, KVPoolClient(daemon.target) as c:
        plan = c.configure(POOL, spec=TINY_SPEC, **TINY_OPTIONS).plan
        with c.lease("decode") as dl, c.lease("prefill") as pl:
            dst, src = dl.allocate(POOL, "kv", 2), pl.allocate(POOL, "kv", 2)
            grant = dl.grant_receive(POOL, dst)
            with pytest.raises(FailedPrecondition, match="this daemon itself"):
                c.send(POOL, src, peer=daemon.target, token=grant.token, lease=pl)
            assert kv_stats(c, POOL).pinned == 2  # the grant's; the send's came back
            accept_as_sender(c, grant.token, plan, 2)
            c.call("PeerDone", pb.PeerDoneRequest(token=grant.token, ok=True))
            assert grant.status().state == TransferState.pending
            with pytest.raises(InvalidArgument, match="at most 1,024"):
                c.call("PeerDone", pb.PeerDoneRequest(token=grant.token, ok=False,
                                                      message="x" * 2000))
            assert grant.status().state == TransferState.pending
            c.call("PeerDone", pb.PeerDoneRequest(token=grant.token, ok=False, message="gave up"))
            assert grant.status().state == TransferState.failed
            assert kv_stats(c, POOL).pinned == 0
            assert dl.free(POOL, "kv", dst) == 2


def test_a_pool_dropped_mid_transfer_keeps_its_memory_until_the_fence() -> None:
    """A forced Drop under an accepted write: the pool is gone by name at once, but its memory
    and budget stay (a late write must land in the dropped pool's memory, not in a new pool's)
    past every deadline, until the sender reports its write ended; Configure of the same name
    is refused until then."""
    with temp_dir() as d, run_daemon(d) as daemon, KVPoolClient(daemon.target) as c:
        plan = c.configure(POOL, spec=TINY_SPEC, **TINY_OPTIONS).plan
        with c.lease("decode") as dl:
            grant = dl.grant_receive(POOL, dl.allocate(POOL, "kv", 2), ttl_s=0.2)
            accept_as_sender(c, grant.token, plan, 2)
            c.drop(POOL, force=True)
        used = c.stats().daemon.used_bytes
        assert used == plan.backing_bytes
        with pytest.raises(FailedPrecondition, match="transfers or elastic workers were using"):
            c.configure(POOL, spec=TINY_SPEC, **TINY_OPTIONS)
        time.sleep(MIN_WRITE_S + 1.0)  # past the write deadline: still held
        assert c.stats().daemon.used_bytes == plan.backing_bytes and fenced(c) == 2
        c.call("PeerDone", pb.PeerDoneRequest(token=grant.token, ok=False, message="ended"))
        until(lambda: c.stats().daemon.used_bytes == 0, 15, "the dropped pool's release")
        c.configure(POOL, spec=TINY_SPEC, **TINY_OPTIONS)


# -- peers are not tenants ---------------------------------------------------------------------


def peer_tokens_args(directory: Any) -> list[str]:
    """The tenants of test_tokens plus a peer = true token named ``peer``."""
    args = tokened_daemon_args(directory, "peer-secret-0123456789abcdef")
    tokens = directory / "tokens.toml"
    path = secret_file(directory, "peer", secret("peer-daemon"))
    tokens.write_text(tokens.read_text() + f'[tokens.peer]\nsecret_file = "{path}"\npeer = true\n')
    return args


def test_a_tenant_cannot_reach_peer_methods_nor_see_addresses() -> None:
    """A tenant scoped to the pool grants itself a page and calls PeerReceive with its own
    token: PERMISSION_DENIED, no metadata, no address; PeerDone likewise. A peer token may call
    them and nothing else; the admin (the daemon's own token) may too."""
    with temp_dir() as d, run_daemon(d, *peer_tokens_args(d)) as daemon, \
            client(daemon, secret("team-a")) as a, client(daemon, secret("peer-daemon")) as peer, \
            client(daemon, "peer-secret-0123456789abcdef") as admin:
        plan = admin.configure(POOL, spec=TINY_SPEC, **TINY_OPTIONS).plan
        with a.lease("a") as la:
            grant = la.grant_receive(POOL, la.allocate(POOL, "kv", 1))
            req = pb.PeerReceiveRequest(token=grant.token, layout=page_layout(plan), pages=1,
                                        sender="tenant")
            with pytest.raises(PermissionDenied, match="only peer daemons"):
                a.call("PeerReceive", req)
            with pytest.raises(PermissionDenied, match="only peer daemons"):
                a.call("PeerDone", pb.PeerDoneRequest(token=grant.token, ok=False))
            assert grant.status().state == TransferState.pending
            with pytest.raises(PermissionDenied):
                peer.stats(POOL)  # a peer token reaches no pool
            reply = peer.call("PeerReceive", req)
            assert reply.buffer_addresses and reply.agent_metadata
            with pytest.raises(FailedPrecondition, match="already used"):
                admin.call("PeerReceive", req)


# A peer daemon's view, as a child process with NIXL (never imported by pytest's process):
# it loads the metadata PeerReceive gave it for one pool, then tries to write that pool and
# another pool of the same daemon whose addresses it also learned.
PEER_SCRIPT = r"""
import json, sys, time
import numpy as np
import torch
from nixl_cu12._api import nixl_agent, nixl_agent_config
spec = json.loads(sys.stdin.readline())
agent = nixl_agent("test-peer", nixl_agent_config(backends=["UCX"], enable_prog_thread=False))
src = torch.full((spec["bytes"],), 0x77, dtype=torch.uint8)
agent.register_memory([(src.data_ptr(), spec["bytes"], 0, "src")], "DRAM")
name = agent.add_remote_agent(bytes.fromhex(spec["metadata"]))
out = {}
for label, address in spec["targets"].items():
    local = agent.get_xfer_descs(np.array([[src.data_ptr(), spec["bytes"], 0]], dtype=np.uint64),
                                 "DRAM")
    remote = agent.get_xfer_descs(np.array([[address, spec["bytes"], 0]], dtype=np.uint64),
                                  "DRAM")
    try:
        handle = agent.initialize_xfer("WRITE", local, remote, name, b"")
    except Exception as exc:
        out[label] = "refused: " + type(exc).__name__
        continue
    state = agent.transfer(handle)
    for _ in range(20000):
        state = agent.check_xfer_state(handle)
        if state != "PROC":
            break
        time.sleep(0.001)
    out[label] = state
print(json.dumps(out), flush=True)
"""


def test_a_peer_reaches_only_the_pool_a_grant_names() -> None:
    """PeerReceive answers the NIXL metadata of the granted pool's registration only: a peer
    holding it writes that pool, while a write into another pool of the same daemon (whose
    page addresses it also learned, without loading that pool's metadata) is refused by NIXL
    and changes nothing there."""
    import subprocess

    with temp_dir() as d, run_daemon(d) as daemon, KVPoolClient(daemon.target) as c:
        plans = {name: c.configure(name, spec=TINY_SPEC, **TINY_OPTIONS).plan
                 for name in ("granted", "other")}
        with c.lease("decode") as dl, c.attach("other", lease=dl) as other_region, \
                c.attach("granted", lease=dl) as granted_region:
            replies = {}
            pages = {}
            for name, plan in plans.items():
                pages[name] = dl.allocate(name, "kv", 1)
                grant = dl.grant_receive(name, pages[name])
                replies[name] = accept_as_sender(c, grant.token, plan, 1)
            names = kv_names(granted_region)
            page = {n: int(pages[n][0]) for n in plans}
            nbytes = granted_region.plan.buffers[0].page_bytes
            targets = {n: int(replies[n].buffer_addresses[0]) + page[n] * nbytes for n in plans}
            child = subprocess.run(
                [sys.executable, "-c", PEER_SCRIPT], cwd=REPO, env=subprocess_env(),
                input=json.dumps({"metadata": replies["granted"].agent_metadata.hex(),
                                  "targets": targets, "bytes": nbytes}) + "\n",
                capture_output=True, text=True, timeout=60)
            assert child.returncode == 0, child.stderr[-2000:]
            outcome = json.loads(child.stdout.strip().splitlines()[-1])
            assert outcome["granted"] == "DONE"
            assert outcome["other"].startswith("refused")
            wrote = page_bytes(granted_region, names[:1], page["granted"])
            assert wrote == b"\x77" * nbytes
            untouched = page_bytes(other_region, kv_names(other_region)[:1], page["other"])
            assert untouched == bytes(nbytes)
            assert len(replies["granted"].agent_metadata) < 4096
