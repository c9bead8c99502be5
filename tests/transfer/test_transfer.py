"""Disaggregated prefill/decode: two ``kvpoold serve`` processes move KV pages with NIXL (UCX
over shared memory on this CPU machine).

The prefill side writes known bytes into its pages through its own mapping of its pool, the
decode side grants pages, the prefill daemon sends, and the decode side reads every byte back
through its mapping. Skipped where NIXL is not installed (``pip install 'kvpool[nixl]'``).
"""

from __future__ import annotations

import contextlib
import signal
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
import pytest

from kvpool import (
    Aborted,
    FailedPrecondition,
    InvalidArgument,
    KVPoolClient,
    NotFound,
    Unavailable,
)
from kvpool.contract.records import TransferState
from tests.conftest import TINY_OPTIONS, TINY_SPEC, DaemonProcess, run_daemon, temp_dir
from tests.e2e.test_metrics import metrics_url, scrape

MLA_SPEC: dict[str, Any] = {"num_layers": 2, "context_length": 256,
                            "attention": {"type": "mla", "kv_lora_rank": 32,
                                          "qk_rope_head_dim": 16}}
SWA_SPEC: dict[str, Any] = {"num_layers": 4, "context_length": 256,
                            "attention": {"type": "mha", "num_kv_heads": 2, "head_dim": 16},
                            "sliding_window": {"window": 32, "layers": [0, 2]}}
PREFILL = dict(TINY_OPTIONS)
DECODE = {**TINY_OPTIONS, "budget_bytes": 2 << 20}  # another size: another fingerprint


@dataclass
class Pair:
    prefill: DaemonProcess
    decode: DaemonProcess
    p: KVPoolClient
    d: KVPoolClient


@pytest.fixture(scope="module")
def pair() -> Iterator[Pair]:
    """A prefill and a decode daemon, each in its own process on its own socket."""
    metrics = ("--metrics-port", "0", "--log-format", "json")
    with temp_dir() as d1, temp_dir() as d2, run_daemon(d1, *metrics) as prefill, \
            run_daemon(d2, *metrics) as decode, KVPoolClient(prefill.target) as p, \
            KVPoolClient(decode.target) as d:
        yield Pair(prefill, decode, p, d)


def page_bytes(region: Any, names: list[str], page: int) -> bytes:
    """Every byte of one page over ``names``, as the pool's mapping holds them."""
    import torch

    return b"".join(region.page(n, page).contiguous().view(-1).view(torch.uint8).numpy()
                    .tobytes() for n in names)


def fill(region: Any, names: list[str], pages: np.ndarray, seed: int) -> None:
    """Random bytes into every page of ``names``."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    for n in names:
        for p in pages:
            view = region.page(n, int(p))
            raw = view.view(-1).view(torch.uint8)
            raw.copy_(torch.randint(0, 256, raw.shape, dtype=torch.uint8, generator=gen))


def kv_names(region: Any, space: str = "kv") -> list[str]:
    return [b.name for b in region.plan.buffers if b.id_space == space]


def configure(pair: Pair, name: str, spec: dict[str, Any], **over: Any) -> None:
    pair.p.configure(name, spec=spec, **{**PREFILL, **over.get("prefill", {})})
    pair.d.configure(name, spec=spec, **{**DECODE, **over.get("decode", {})})


@pytest.mark.parametrize(("family", "count"),
                         [("mha", 1), ("mha", 16), ("mha", 256), ("mla", 16)])
def test_kv_pages_arrive(pair: Pair, family: str, count: int) -> None:
    """MHA (K and V buffers per layer) and MLA (one latent buffer per layer) pages land byte
    for byte in the granted pages, and stay each lease's own."""
    pool = f"{family}-{count}"
    configure(pair, pool, TINY_SPEC if family == "mha" else MLA_SPEC)
    with pair.p.lease("prefill") as pl, pair.d.lease("decode") as dl, \
            pair.p.attach(pool, lease=pl) as src_region, \
            pair.d.attach(pool, lease=dl) as dst_region:
        src = pl.allocate(pool, "kv", count)
        dst = dl.allocate(pool, "kv", count)
        names = kv_names(src_region)
        fill(src_region, names, src, seed=count)
        grant = dl.grant_receive(pool, dst)
        assert len(grant.token) == 16 and grant.swa_pages is None

        handle = pair.p.send(pool, src, peer=pair.decode.target, token=grant.token, lease=pl)
        sent = handle.wait(30)
        got = grant.wait(30)

        per_page = sum(b.page_bytes for b in src_region.plan.buffers if b.id_space == "kv")
        assert handle.bytes == sent.bytes == got.bytes == per_page * count
        assert handle.descriptors == len(names) * count
        assert sent.state == got.state == TransferState.done
        for a, b in zip(src, dst, strict=True):
            assert page_bytes(src_region, names, int(a)) == page_bytes(dst_region, names, int(b))
        # The pages are still each lease's own; the decode side frees them when it likes.
        assert pair.d.stats(pool).leases[0].held[pool]["kv"] == count
        assert dl.free(pool, "kv", dst) == count


def test_hybrid_swa_pages_and_their_swa_pairs_arrive(pair: Pair) -> None:
    pool = "swa"
    configure(pair, pool, SWA_SPEC)
    with pair.p.lease("prefill") as pl, pair.d.lease("decode") as dl, \
            pair.p.attach(pool, lease=pl) as src_region, \
            pair.d.attach(pool, lease=dl) as dst_region:
        src, src_swa = pl.allocate_swa_pairs(pool, 16)
        dst, dst_swa = dl.allocate_swa_pairs(pool, 16)
        full, swa = kv_names(src_region, "kv"), kv_names(src_region, "swa")
        assert full and swa
        fill(src_region, full, src, seed=1)
        fill(src_region, swa, src_swa, seed=2)
        grant = dl.grant_receive(pool, dst)
        assert grant.swa_pages is not None
        np.testing.assert_array_equal(grant.swa_pages, dst_swa)
        pair.p.send(pool, src, peer=pair.decode.target, token=grant.token, lease=pl).wait(30)
        grant.wait(30)
        for a, b in zip(src, dst, strict=True):
            assert page_bytes(src_region, full, int(a)) == page_bytes(dst_region, full, int(b))
        for a, b in zip(src_swa, dst_swa, strict=True):
            assert page_bytes(src_region, swa, int(a)) == page_bytes(dst_region, swa, int(b))


def test_layout_mismatch_is_refused(pair: Pair) -> None:
    """Another head count (a TP split of the KV heads) gives other bytes per page."""
    pool = "tp"
    pair.p.configure(pool, spec=TINY_SPEC, tp_size=2, **PREFILL)
    pair.d.configure(pool, spec=TINY_SPEC, **DECODE)
    with pair.p.lease("prefill") as pl, pair.d.lease("decode") as dl:
        src, dst = pl.allocate(pool, "kv", 4), dl.allocate(pool, "kv", 4)
        grant = dl.grant_receive(pool, dst)
        with pytest.raises(FailedPrecondition) as info:
            pair.p.send(pool, src, peer=pair.decode.target, token=grant.token, lease=pl)
        text = str(info.value)
        assert "bytes per page" in text and "tp_size 2" in text and "not supported" in text
        assert grant.status().state == TransferState.pending  # a refused sender burns nothing


def test_page_size_mismatch_is_refused(pair: Pair) -> None:
    pool = "pagesize"
    pair.p.configure(pool, spec=TINY_SPEC, **{**PREFILL, "page_size": 32})
    pair.d.configure(pool, spec=TINY_SPEC, **DECODE)
    with pair.p.lease("prefill") as pl, pair.d.lease("decode") as dl:
        src, dst = pl.allocate(pool, "kv", 2), dl.allocate(pool, "kv", 2)
        grant = dl.grant_receive(pool, dst)
        with pytest.raises(FailedPrecondition, match="page_size is 32 on the sender, 16 here"):
            pair.p.send(pool, src, peer=pair.decode.target, token=grant.token, lease=pl)


def test_refusals(pair: Pair) -> None:
    pool = "refuse"
    configure(pair, pool, TINY_SPEC)
    with pair.p.lease("prefill") as pl, pair.d.lease("decode") as dl, \
            pair.d.lease("other") as other:
        src, dst = pl.allocate(pool, "kv", 8), dl.allocate(pool, "kv", 8)
        theirs = other.allocate(pool, "kv", 2)
        peer = pair.decode.target

        # Granting pages the lease does not hold.
        with pytest.raises(FailedPrecondition, match="not held by lease"):
            dl.grant_receive(pool, theirs)
        # More pages than granted: the sender cannot reach pages outside the grant.
        grant = dl.grant_receive(pool, dst[:4])
        with pytest.raises(InvalidArgument, match="the grant covers 4"):
            pair.p.send(pool, src, peer=peer, token=grant.token, lease=pl)
        # Sending pages the sender's lease does not hold.
        with pytest.raises(FailedPrecondition, match="not held by lease"):
            pair.p.send(pool, np.arange(200, 204, dtype=np.int32), peer=peer,
                        token=grant.token, lease=pl)
        # A page listed twice.
        with pytest.raises(InvalidArgument, match="twice"):
            pair.p.send(pool, src[:1].repeat(4), peer=peer, token=grant.token, lease=pl)
        # A token the decode daemon never made.
        with pytest.raises(NotFound, match="no receive grant"):
            pair.p.send(pool, src[:4], peer=peer, token=b"\x00" * 16, lease=pl)
        # A grant takes one transfer.
        pair.p.send(pool, src[:4], peer=peer, token=grant.token, lease=pl).wait(30)
        with pytest.raises(FailedPrecondition, match="used"):
            pair.p.send(pool, src[:4], peer=peer, token=grant.token, lease=pl)

        # An expired grant.
        short = dl.grant_receive(pool, dst[4:], ttl_s=0.2)
        time.sleep(0.5)
        with pytest.raises(FailedPrecondition, match="expired"):
            pair.p.send(pool, src[4:], peer=peer, token=short.token, lease=pl)
        with pytest.raises(Aborted, match="expired"):
            short.wait(5)

        # A granted page cannot be freed: the grant pins it until the grant ends.
        pinned = dl.grant_receive(pool, dst[4:], ttl_s=0.3)
        with pytest.raises(FailedPrecondition, match="pinned by a transfer"):
            dl.free(pool, "kv", dst[6:])
        with pytest.raises(Aborted, match="expired"):
            pinned.wait(5)

        # An unreachable peer.
        grant2 = dl.grant_receive(pool, dst[4:6])
        with pytest.raises(Unavailable) as dead:
            pair.p.send(pool, src[4:6], peer="unix:///nonexistent/kvpool.sock",
                        token=grant2.token, lease=pl)
        # The answer names the peer, not the caller's own daemon or socket.
        assert "peer daemon unix:///nonexistent/kvpool.sock cannot be reached" in str(dead.value)
        assert pair.prefill.target not in str(dead.value)
        # Nothing changed hands: each lease holds what it allocated.
        held = {x.name: x.held.get(pool, {}).get("kv", 0) for x in pair.d.stats(pool).leases}
        assert held == {"decode": 8, "other": 2}
        assert pair.p.stats(pool).leases[0].held[pool]["kv"] == 8


def test_free_of_a_page_in_flight_is_refused_then_allowed(pair: Pair) -> None:
    """A grant a sender was accepted into is being written: its pages cannot be freed (nor
    granted again) until the transfer ends. The sender here is this test, speaking the
    daemon-to-daemon protocol (PeerReceive, then PeerDone) without writing, so the write stays
    in flight for as long as the test needs."""
    from kvpool.v1 import kvpool_pb2 as pb
    from kvpoold.transfer.page_layout import page_layout

    pool = "busy"
    configure(pair, pool, TINY_SPEC)
    plan = pair.d.configure(pool, spec=TINY_SPEC, **DECODE).plan
    with pair.d.lease("decode") as dl:
        dst = dl.allocate(pool, "kv", 4)
        grant = dl.grant_receive(pool, dst)
        with pytest.raises(FailedPrecondition, match="pinned by a transfer"):
            dl.grant_receive(pool, dst[2:])
        pair.d.call("PeerReceive", pb.PeerReceiveRequest(
            token=grant.token, layout=page_layout(plan), pages=4, sender="test-peer"))
        with pytest.raises(FailedPrecondition, match="pinned by a transfer"):
            dl.free(pool, "kv", dst[1:2])
        assert pair.d.stats(pool).leases[0].held[pool]["kv"] == 4  # nothing was freed
        pair.d.call("PeerDone", pb.PeerDoneRequest(token=grant.token, ok=False,
                                                   message="test sender gave up"))
        assert grant.status().state == TransferState.failed
        assert dl.free(pool, "kv", dst) == 4


def test_a_granted_page_is_pinned_until_its_grant_ends(pair: Pair) -> None:
    """Two grants of one lease: the first's pages cannot be freed nor granted again while it
    lives; when it expires unused its pages come back to the lease (not freed), the second
    grant is untouched."""
    pool = "revoke"
    configure(pair, pool, TINY_SPEC)
    with pair.d.lease("decode") as dl:
        a, b = dl.allocate(pool, "kv", 3), dl.allocate(pool, "kv", 3)
        first, second = dl.grant_receive(pool, a, ttl_s=0.3), dl.grant_receive(pool, b)
        with pytest.raises(FailedPrecondition, match="pinned by a transfer"):
            dl.free(pool, "kv", a[1:2])
        assert pair.d.stats(pool).pools[0].spaces["kv"].pinned == 6
        with pytest.raises(Aborted, match="expired"):
            first.wait(5)
        assert second.status().state == TransferState.pending
        assert pair.d.stats(pool).pools[0].spaces["kv"].pinned == 3
        assert dl.free(pool, "kv", a[1:2]) == 1  # unpinned, still the lease's
        assert dl.grant_receive(pool, a[::2]).status().state == TransferState.pending


BIG_SPEC: dict[str, Any] = {"num_layers": 8, "context_length": 4096,
                            "attention": {"type": "mha", "num_kv_heads": 8, "head_dim": 128}}
BIG_OPTIONS: dict[str, Any] = {"budget_bytes": 160 << 20, "page_size": 16,
                               "max_running_requests": 8}


@contextlib.contextmanager
def big_pair() -> Iterator[Pair]:
    """Two fresh daemons with a 128 MiB pool each (512 KiB pages): a 256-page write takes
    long enough for a SIGKILL to land under it on most runs."""
    with temp_dir() as d1, temp_dir() as d2, run_daemon(d1, budget="256MiB") as prefill, \
            run_daemon(d2, budget="256MiB") as decode, KVPoolClient(prefill.target) as p, \
            KVPoolClient(decode.target) as d:
        p.configure("big", spec=BIG_SPEC, **BIG_OPTIONS)
        d.configure("big", spec=BIG_SPEC, **BIG_OPTIONS)
        yield Pair(prefill, decode, p, d)


@pytest.mark.parametrize("killed", ["sender", "receiver"])
def test_daemon_sigkilled_mid_transfer(killed: str) -> None:
    """SIGKILL one daemon right after the send is posted (the write may or may not have
    landed). The survivor's side ends (done, or failed: the sender's NIXL reports an error, the
    receiver's grant expires) and its pages stay held by their lease until it frees them; a
    new send to a dead receiver is refused."""
    with big_pair() as pair:
        pl = pair.p.lease("prefill", ttl_s=30)
        dl = pair.d.lease("decode", ttl_s=30)
        src, dst = pl.allocate("big", "kv", 256), dl.allocate("big", "kv", 256)
        grant = dl.grant_receive("big", dst, ttl_s=3 if killed == "sender" else 30)
        handle = pair.p.send("big", src, peer=pair.decode.target, token=grant.token, lease=pl)
        if killed == "sender":
            pair.prefill.stop(signal.SIGKILL)
            live, lease, pages, ended = pair.d, dl, dst, grant
            failure = "did not complete before the grant expired"
        else:
            pair.decode.stop(signal.SIGKILL)
            live, lease, pages, ended = pair.p, pl, src, handle
            failure = "NIXL reported an error"
        try:
            assert ended.wait(30).state == TransferState.done  # it had landed
        except Aborted as exc:
            assert failure in str(exc)
        assert live.stats("big").leases[0].held["big"]["kv"] == 256
        assert lease.free("big", "kv", pages) == 256
        if killed == "receiver":
            with pytest.raises(Unavailable):
                pair.p.send("big", pl.allocate("big", "kv", 1), peer=pair.decode.target,
                            token=grant.token, lease=pl)
        lease.close()
        with contextlib.suppress(Unavailable):  # its daemon is gone
            (dl if killed == "sender" else pl).close()


async def test_asyncio_forms(pair: Pair) -> None:
    from kvpool import AsyncKVPoolClient

    pool = "aio"
    configure(pair, pool, TINY_SPEC)
    async with AsyncKVPoolClient(pair.prefill.target) as p, \
            AsyncKVPoolClient(pair.decode.target) as d, await p.lease("prefill") as pl, \
            await d.lease("decode") as dl:
        src, dst = await pl.allocate(pool, "kv", 4), await dl.allocate(pool, "kv", 4)
        grant = await dl.grant_receive(pool, dst)
        assert (await grant.status()).state == TransferState.pending
        handle = await p.send(pool, src, peer=pair.decode.target, token=grant.token, lease=pl)
        assert (await handle.wait(30)).state == TransferState.done
        done = await grant.wait(30)
        assert done.pages == 4 and done.bytes == handle.bytes
        grant = await dl.grant_receive(pool, dst)
        held = await p.send(pool, src, peer=pair.decode.target, token=grant.token, lease=pl,
                            hold=True)
        assert (await held.post(30)).state == TransferState.done
        assert (await held.wait(30)).state == TransferState.done
        assert (await grant.wait(30)).state == TransferState.done


def test_stats_and_metrics_count_transfers_per_peer(pair: Pair) -> None:
    pool = "counted"
    configure(pair, pool, TINY_SPEC)
    with pair.p.lease("prefill") as pl, pair.d.lease("decode") as dl:
        src, dst = pl.allocate(pool, "kv", 2), dl.allocate(pool, "kv", 2)
        grant = dl.grant_receive(pool, dst)
        handle = pair.p.send(pool, src, peer=pair.decode.target, token=grant.token, lease=pl)
        handle.wait(30)
        grant.wait(30)
        with pytest.raises(FailedPrecondition):  # a used grant: one failure to this peer
            pair.p.send(pool, src, peer=pair.decode.target, token=grant.token, lease=pl)
    sender, receiver = pair.p.stats(), pair.d.stats()
    assert sender.daemon.nixl_agent and receiver.daemon.nixl_agent
    sent = {x.peer: x for x in sender.peers}[pair.decode.target]
    received = {x.peer: x for x in receiver.peers}[sender.daemon.nixl_agent]
    assert sent.sent >= 1 and sent.send_failures >= 1 and sent.sent_bytes >= handle.bytes
    assert received.received >= 1 and received.received_bytes >= handle.bytes
    metrics = scrape(metrics_url(pair.prefill.log))
    labels = {"device": "cpu", "peer": pair.decode.target, "direction": "sent"}
    assert metrics.get("kvpool_transfers_total", **labels) == sent.sent
    assert metrics.get("kvpool_transfer_bytes_total", **labels) == sent.sent_bytes
    assert metrics.get("kvpool_transfer_failures_total", **labels) == sent.send_failures
    metrics = scrape(metrics_url(pair.decode.log))
    labels = {"device": "cpu", "peer": sender.daemon.nixl_agent, "direction": "received"}
    assert metrics.get("kvpool_transfers_total", **labels) == received.received


@contextlib.contextmanager
def deadline_cutting_peer(decode: str, write_deadline_s: float | None) -> Iterator[str]:
    """A peer address in front of the decode daemon: it forwards PeerReceive and PeerDone (as
    the decode daemon's local admin) and cuts the write deadline of each acceptance to
    ``write_deadline_s`` (None: leaves the field unset, as a peer that does not name one).
    Yields the address to send to."""
    from concurrent.futures import ThreadPoolExecutor

    import grpc

    from kvpool.v1 import kvpool_pb2_grpc

    class Forward(kvpool_pb2_grpc.KVPoolServicer):
        def __init__(self, client: KVPoolClient) -> None:
            self.client = client

        def PeerReceive(self, request: Any, context: Any) -> Any:
            resp = self.client.call("PeerReceive", request)
            if write_deadline_s is None:
                resp.ClearField("write_deadline_seconds")
            else:
                resp.write_deadline_seconds = write_deadline_s
            return resp

        def PeerDone(self, request: Any, context: Any) -> Any:
            return self.client.call("PeerDone", request)

    with temp_dir() as d, KVPoolClient(decode) as client:
        server = grpc.server(ThreadPoolExecutor(max_workers=2))
        kvpool_pb2_grpc.add_KVPoolServicer_to_server(Forward(client), server)
        target = f"unix://{d / 'peer.sock'}"
        server.add_insecure_port(target)
        server.start()
        try:
            yield target
        finally:
            server.stop(None)


def test_a_write_cancelled_at_its_deadline_says_the_deadline_the_peer_gave(pair: Pair) -> None:
    """The peer gives a write deadline that has passed by the time the write is posted (its
    answer took longer than 1 ms to come): the agent cancels the write at its first look, and
    the send ends failed naming the deadline the peer gave, never a negative one counted from
    when the sender started watching (issue 39)."""
    pool = "cut"
    configure(pair, pool, TINY_SPEC)
    with deadline_cutting_peer(pair.decode.target, 0.001) as peer, \
            pair.p.lease("prefill") as pl, pair.d.lease("decode") as dl:
        src, dst = pl.allocate(pool, "kv", 4), dl.allocate(pool, "kv", 4)
        grant = dl.grant_receive(pool, dst)
        handle = pair.p.send(pool, src, peer=peer, token=grant.token, lease=pl)
        with pytest.raises(Aborted) as ended:
            handle.wait(30)
        assert ("the write did not complete within its 0.001 s deadline and was cancelled"
                in str(ended.value)), str(ended.value)
        # The pages came back to the sending lease when the cancelled write's handle went.
        assert pl.free(pool, "kv", src) == 4


def test_a_peer_answer_without_a_write_deadline_takes_the_default(pair: Pair) -> None:
    """write_deadline_seconds is optional in a peer's answer: a peer that leaves it unset gets
    its pages written (the sender takes DEFAULT_WRITE_DEADLINE_S), never an INTERNAL error."""
    from kvpoold.transfer.peers import DEFAULT_WRITE_DEADLINE_S

    pool = "nodeadline"
    configure(pair, pool, TINY_SPEC)
    with deadline_cutting_peer(pair.decode.target, None) as peer, \
            pair.p.lease("prefill") as pl, pair.d.lease("decode") as dl, \
            pair.p.attach(pool, lease=pl) as src_region, \
            pair.d.attach(pool, lease=dl) as dst_region:
        src, dst = pl.allocate(pool, "kv", 4), dl.allocate(pool, "kv", 4)
        names = kv_names(src_region)
        fill(src_region, names, src, seed=7)
        grant = dl.grant_receive(pool, dst)
        handle = pair.p.send(pool, src, peer=peer, token=grant.token, lease=pl)
        assert handle.wait(30).state == TransferState.done
        assert grant.wait(30).state == TransferState.done
        for a, b in zip(src, dst, strict=True):
            assert page_bytes(src_region, names, int(a)) == page_bytes(dst_region, names, int(b))
    assert DEFAULT_WRITE_DEADLINE_S == 60.0  # what the proto's comment promises


def test_a_held_send_is_posted_by_one_call(pair: Pair) -> None:
    """send(hold=True) does the peer's acceptance ahead (the grant is accepted, both sides'
    pages pinned, nothing written); post() posts the prepared write and answers once it
    ended; a held send posts once. send(wait_s=...) answers once the write ended."""
    pool = "held"
    configure(pair, pool, TINY_SPEC)
    with pair.p.lease("prefill") as pl, pair.d.lease("decode") as dl, \
            pair.p.attach(pool, lease=pl) as src_region, \
            pair.d.attach(pool, lease=dl) as dst_region:
        src, dst = pl.allocate(pool, "kv", 8), dl.allocate(pool, "kv", 8)
        names = kv_names(src_region)
        fill(src_region, names, src, seed=11)
        grant = dl.grant_receive(pool, dst[:4])
        handle = pair.p.send(pool, src[:4], peer=pair.decode.target, token=grant.token,
                             lease=pl, hold=True)
        assert handle.status().state == TransferState.pending
        with pytest.raises(FailedPrecondition, match="used by a transfer"):  # accepted
            pair.p.send(pool, src[4:], peer=pair.decode.target, token=grant.token, lease=pl)
        with pytest.raises(FailedPrecondition, match="pinned by a transfer"):
            pl.free(pool, "kv", src[:1])
        done = handle.post(30)
        assert done.state == TransferState.done and done.bytes == handle.bytes > 0
        assert grant.wait(30).state == TransferState.done
        with pytest.raises(FailedPrecondition, match="has ended"):
            handle.post(30)
        # One call from scratch: the answer says how the write ended.
        second = dl.grant_receive(pool, dst[4:])
        one = pair.p.send(pool, src[4:], peer=pair.decode.target, token=second.token,
                          lease=pl, wait_s=30)
        assert one.wait(30).state == TransferState.done
        assert second.wait(30).state == TransferState.done
        for a, b in zip(src, dst, strict=True):
            assert page_bytes(src_region, names, int(a)) == page_bytes(dst_region, names, int(b))
        assert pl.free(pool, "kv", src) == 8 and dl.free(pool, "kv", dst) == 8


def test_held_sends_are_posted_on_the_side_socket(pair: Pair) -> None:
    """A held send names the daemon's side socket (``post_socket``) and ``post()`` goes there
    instead of gRPC, sync and asyncio alike; the channel speaks its contract: a hello, then
    posts answered one by one (a refused post leaves the connection usable: a wrong secret,
    a new send instead of a post, bytes that are no SendRequest), and a frame over the bound
    is refused and the connection closed."""
    import asyncio
    import socket

    import msgspec

    from kvpool import AsyncKVPoolClient
    from kvpool.contract.post_channel import (
        LENGTH,
        MAX_FRAME_BYTES,
        PREAMBLE,
        PostAnswer,
        PostHello,
        frame,
    )
    from kvpool.v1 import kvpool_pb2 as pb

    pool = "postchannel"
    configure(pair, pool, TINY_SPEC)
    side = f"{pair.prefill.socket}.fd"
    with pair.p.lease("prefill") as pl, pair.d.lease("decode") as dl, \
            pair.p.attach(pool, lease=pl) as src_region, \
            pair.d.attach(pool, lease=dl) as dst_region:
        src, dst = pl.allocate(pool, "kv", 6), dl.allocate(pool, "kv", 6)
        names = kv_names(src_region)
        fill(src_region, names, src, seed=23)
        grant = dl.grant_receive(pool, dst[:2])
        handle = pair.p.send(pool, src[:2], peer=pair.decode.target, token=grant.token,
                             lease=pl, hold=True)
        posts = pair.p.post_channels.posts
        assert handle.post(30).state == TransferState.done
        assert pair.p.post_channels.posts == posts + 1  # over the channel, not gRPC
        assert grant.wait(30).state == TransferState.done

        def answer(conn: socket.socket) -> PostAnswer:
            head = conn.recv(LENGTH.size, socket.MSG_WAITALL)
            body = conn.recv(LENGTH.unpack(head)[0], socket.MSG_WAITALL)
            return msgspec.msgpack.decode(body, type=PostAnswer)

        grant = dl.grant_receive(pool, dst[2:4])
        held = pair.p.send(pool, src[2:4], peer=pair.decode.target, token=grant.token,
                           lease=pl, hold=True)
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as conn:
            conn.settimeout(30)
            conn.connect(side)
            conn.sendall(PREAMBLE + frame(msgspec.json.encode(PostHello())))
            assert answer(conn).code == "OK"
            post = pb.SendRequest(lease_id=pl.lease_id, lease_secret=pl.secret,
                                  transfer_id=held.transfer_id, wait_seconds=30)
            refusals = [
                (pb.SendRequest(lease_id=pl.lease_id, lease_secret=b"x" * len(pl.secret),
                                transfer_id=held.transfer_id).SerializeToString(), "NOT_FOUND"),
                (pb.SendRequest(lease_id=pl.lease_id, lease_secret=pl.secret, pool=pool,
                                pages=codec_bytes(src[4:]), peer=pair.decode.target,
                                token=b"t" * 16).SerializeToString(), "INVALID_ARGUMENT"),
                (b"\xff\xff\xff", "INVALID_ARGUMENT"),
            ]
            for body, code in refusals:
                conn.sendall(frame(body))
                refused = answer(conn)
                assert refused.code == code and refused.message, refused
            conn.sendall(frame(post.SerializeToString()))
            ok = answer(conn)
            assert ok.code == "OK", ok
            status = pb.SendResponse.FromString(ok.response).status
            assert status.state == pb.TRANSFER_STATE_DONE and status.bytes == held.bytes
            conn.sendall(LENGTH.pack(MAX_FRAME_BYTES + 1))
            too_long = answer(conn)
            assert too_long.code == "INVALID_ARGUMENT" and too_long.field == "frame"
            assert conn.recv(1) == b""  # closed
        assert grant.wait(30).state == TransferState.done

        async def post_async() -> int:
            async with AsyncKVPoolClient(pair.prefill.target) as client:
                lease = await client.lease("prefill-async")
                try:
                    theirs = await lease.allocate(pool, "kv", 2)
                    g = dl.grant_receive(pool, dst[4:])
                    h = await client.send(pool, theirs, peer=pair.decode.target,
                                          token=g.token, lease=lease, hold=True)
                    assert (await h.post(30)).state == TransferState.done
                    assert g.wait(30).state == TransferState.done
                    return client.post_channels.posts
                finally:
                    await lease.close()

        assert asyncio.run(post_async()) == 1
        for a, b in zip(src[:4], dst[:4], strict=True):
            assert page_bytes(src_region, names, int(a)) == page_bytes(dst_region, names, int(b))
        assert pl.free(pool, "kv", src) == 6 and dl.free(pool, "kv", dst) == 6


def test_a_held_send_never_posted_gives_both_sides_pages_back(pair: Pair) -> None:
    """A held send is never posted: at its write deadline (cut to 0.5 s by the peer in front)
    it ends failed and the receiver is told nothing was written, so the grant's pages are
    unpinned (not fenced); a held send whose lease closes does the same at once."""
    pool = "heldgone"
    configure(pair, pool, TINY_SPEC)
    with deadline_cutting_peer(pair.decode.target, 0.5) as peer, \
            pair.p.lease("prefill") as pl, pair.d.lease("decode") as dl:
        src, dst = pl.allocate(pool, "kv", 4), dl.allocate(pool, "kv", 4)
        grant = dl.grant_receive(pool, dst[:2])
        handle = pair.p.send(pool, src[:2], peer=peer, token=grant.token, lease=pl, hold=True)
        with pytest.raises(Aborted, match="held write was never posted"):
            grant.wait(30)
        with pytest.raises(Aborted, match=r"not posted within its 0\.5 s write deadline"):
            handle.wait(30)
        assert dl.free(pool, "kv", dst[:2]) == 2 and pl.free(pool, "kv", src[:2]) == 2
        with pytest.raises(FailedPrecondition, match="has ended"):
            handle.post(30)

        other = pair.p.lease("prefill-2")
        theirs = other.allocate(pool, "kv", 2)
        grant = dl.grant_receive(pool, dst[2:])
        pair.p.send(pool, theirs, peer=pair.decode.target, token=grant.token, lease=other,
                    hold=True)
        other.close()
        with pytest.raises(Aborted, match="held write was never posted"):
            grant.wait(30)
        assert dl.free(pool, "kv", dst[2:]) == 2
        assert fenced_pages(pair.d) == 0


def fenced_pages(c: KVPoolClient) -> int:
    return sum(p.fenced_pages for p in c.stats().peers)


def test_send_field_refusals(pair: Pair) -> None:
    """The edge refuses what a Send cannot mean: a wait out of range or with hold, a post
    (transfer_id) that also names a send, a post of an unknown or another lease's send."""
    from kvpool.v1 import kvpool_pb2 as pb

    pool = "sendfields"
    configure(pair, pool, TINY_SPEC)
    with pair.p.lease("prefill") as pl, pair.p.lease("other") as other:
        page = codec_bytes(pl.allocate(pool, "kv", 1))
        base = {"lease_id": pl.lease_id, "lease_secret": pl.secret, "pool": pool,
                "pages": page, "peer": pair.decode.target, "token": b"t" * 16}
        for extra, field in [({"wait_seconds": -1.0}, "wait_seconds"),
                             ({"wait_seconds": 4000.0}, "wait_seconds"),
                             ({"hold": True, "wait_seconds": 1.0}, "wait_seconds"),
                             ({"transfer_id": 5}, "transfer_id")]:
            with pytest.raises(InvalidArgument) as info:
                pair.p.call("Send", pb.SendRequest(**base, **extra))
            assert info.value.field == field, (extra, info.value)
        with pytest.raises(NotFound, match="no send 12345 of this lease"):
            pair.p.call("Send", pb.SendRequest(lease_id=other.lease_id,
                                               lease_secret=other.secret, transfer_id=12345))


def codec_bytes(pages: np.ndarray) -> bytes:
    from kvpool.contract import codec

    return codec.ids_to_bytes(pages)
