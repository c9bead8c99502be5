"""One table of the daemon's unary RPCs: per method, the request it sends and how its reply
reads.

Each function here builds a :class:`Call`: the method's name, the request message and the
decoder of its reply into the record callers get. The blocking and the asyncio clients are
shells over this table: ``call.decode(<send call.request to call.method>)``, the one doing it
in a thread, the other on an event loop. So the two cannot build a request, or read a reply,
differently; a new RPC is one function here and a one-line method in each shell.

No I/O here, no grpc: only messages and records.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

import numpy as np

from kvpool.contract import codec, wire
from kvpool.contract.records import (
    Adopted,
    AttachInfo,
    CancelledGrant,
    ConfigureResult,
    Released,
    SealedStats,
    Stats,
    TransferStatus,
)
from kvpool.v1 import kvpool_pb2 as pb

R = TypeVar("R")


@dataclass(frozen=True)
class Call(Generic[R]):
    """One unary RPC ready to send: ``decode(reply)`` is what the caller gets."""

    method: str
    request: Any
    decode: Callable[[Any], R]


def _reply(resp: Any) -> Any:
    return resp


def _nothing(_resp: Any) -> None:
    return None


def configure(pool: str, *, hf_config: Any = None, spec: Any = None, dry_run: bool = False,
              **options: Any) -> Call[ConfigureResult]:
    req = wire.configure_request(pool, hf_config=hf_config, spec=spec, dry_run=dry_run,
                                 **options)
    return Call("Configure", req, codec.configure_from_pb)


def open_lease(name: str, ttl_s: float) -> Call[pb.OpenLeaseResponse]:
    return Call("OpenLease", pb.OpenLeaseRequest(name=name, ttl_seconds=ttl_s), _reply)


def close_lease(lease: wire.LeaseLike) -> Call[Released]:
    lease_id, secret = wire.lease_key(lease)
    return Call("CloseLease", pb.CloseLeaseRequest(lease_id=lease_id, lease_secret=secret),
                codec.released_from_pb)


def stats(pool: str = "") -> Call[Stats]:
    return Call("Stats", pb.StatsRequest(pool=pool), codec.stats_from_pb)


def drop(pool: str, force: bool = False) -> Call[Released]:
    return Call("Drop", pb.DropRequest(pool=pool, force=force), codec.released_from_pb)


def attach(pool: str, expected_fingerprint: str = "", lease: Any = None) -> Call[AttachInfo]:
    lease_id, secret = wire.lease_key(lease)
    req = pb.AttachRequest(pool=pool, expected_fingerprint=expected_fingerprint,
                           lease_id=lease_id, lease_secret=secret)
    return Call("Attach", req, codec.attach_from_pb)


def detach(attach_id: int) -> Call[None]:
    return Call("Detach", pb.DetachRequest(attach_id=attach_id), _nothing)


def send(pool: str, lease: wire.LeaseLike, pages: Any, peer: str, token: bytes,
         hold: bool = False, wait_s: float = 0.0) -> Call[pb.SendResponse]:
    """A send (``hold``: the peer's acceptance only, posted later by :func:`post_send`),
    answered once posted or, with ``wait_s``, once ended or that long after."""
    return Call("Send", wire.send_request(pool, lease, pages, peer, token, hold, wait_s),
                _reply)


def post_send(lease: wire.LeaseLike, transfer_id: int, wait_s: float
              ) -> Call[pb.SendResponse]:
    """Post a held send of ``lease``, answered once posted or, with ``wait_s``, once ended
    or that long after."""
    return Call("Send", wire.post_send_request(lease, transfer_id, wait_s), _reply)


def grant_receive(pool: str, lease: wire.LeaseLike, pages: Any, ttl_s: float | None
                  ) -> Call[tuple[np.ndarray, pb.GrantReceiveResponse]]:
    """The reply reads as ``(granted pages, response)``: the handle keeps both."""
    req = wire.grant_receive_request(pool, lease, pages, ttl_s)
    granted = codec.ids_from_bytes(req.pages)
    return Call("GrantReceive", req, lambda resp: (granted, resp))


def allocate(pool: str, lease: wire.LeaseLike, items: Sequence[tuple[str, int]]
             ) -> Call[list[np.ndarray]]:
    """One int32 id array per item, in order."""
    return Call("Allocate", wire.allocate_request(pool, lease, items),
                lambda resp: [codec.ids_from_bytes(item.ids) for item in resp.items])


def allocate_pairs(pool: str, lease: wire.LeaseLike, count: int
                   ) -> Call[tuple[np.ndarray, np.ndarray]]:
    """``count`` kv pages of a hybrid SWA pool and the SWA page paired with each."""
    def decode(resp: pb.AllocateResponse) -> tuple[np.ndarray, np.ndarray]:
        item = resp.items[0]
        return codec.ids_from_bytes(item.ids), codec.ids_from_bytes(item.paired_ids)

    return Call("Allocate", wire.allocate_request(pool, lease, [("kv", count)]), decode)


def free(pool: str, lease: wire.LeaseLike, items: Sequence[tuple[str, Any]]) -> Call[int]:
    """The reply reads as the number of ids freed."""
    return Call("Free", wire.free_request(pool, lease, items), lambda resp: resp.freed)


def cancel_grant(lease: wire.LeaseLike, token: bytes) -> Call[CancelledGrant]:
    """End a grant the lease made: its pages unpinned at once, or fenced while a write may
    still land in them."""
    return Call("CancelGrant", wire.cancel_grant_request(lease, token),
                codec.cancelled_grant_from_pb)


def seal(pool: str, lease: wire.LeaseLike, layout: str, pages: Any, keys: Sequence[bytes],
         parents: Sequence[bytes], tokens: Any) -> Call[int]:
    """Seal pages of the lease whose KV is complete; the reply reads as the pages sealed."""
    return Call("Seal", wire.seal_request(pool, lease, layout, pages, keys, parents, tokens),
                lambda resp: resp.sealed)


def unseal(pool: str, lease: wire.LeaseLike, pages: Any) -> Call[int]:
    """Unseal pages the lease sealed and holds, before it writes them again; the reply reads
    as the pages unsealed."""
    return Call("Unseal", wire.unseal_request(pool, lease, pages), lambda resp: resp.unsealed)


def adopt(pool: str, lease: wire.LeaseLike, layout: str) -> Call[Adopted]:
    """Take the pool's sealed pages of ``layout`` whose writers are proven gone."""
    return Call("Adopt", wire.adopt_request(pool, lease, layout), codec.adopted_from_pb)


def sealed(pool: str, evict: bool = False) -> Call[SealedStats]:
    """A pool's sealed-page directory; with ``evict``, give its pages back."""
    return Call("Sealed", pb.SealedRequest(pool=pool, evict=evict), codec.sealed_from_pb)


def wait_transfer(*, transfer_id: int = 0, token: bytes = b"", timeout_s: float = 0.0
                  ) -> Call[TransferStatus]:
    """A sender's transfer (``transfer_id``) or a receiver's grant (``token``), waited on up
    to ``timeout_s`` by the daemon."""
    req = pb.WaitTransferRequest(transfer_id=transfer_id, token=token, timeout_seconds=timeout_s)
    return Call("WaitTransfer", req, codec.transfer_status_from_pb)
