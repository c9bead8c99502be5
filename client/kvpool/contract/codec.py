"""Records <-> proto messages, both directions in one place: the daemon encodes, clients decode.

Each wire concept has one record (``kvpool.contract.records``, ``kvpool.contract.plan``,
``kvpool.contract.shared_handle``) and
here its ``*_to_pb`` / ``*_from_pb`` pair, so the two sides cannot drift. Ids cross as
little-endian int32 bytes; ``ids_from_bytes`` reads them without a copy.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any, cast

import msgspec
import numpy as np

from kvpool.contract.errors import InvalidArgument
from kvpool.contract.limits import ID_DTYPE, KEY_BYTES
from kvpool.contract.plan import PoolPlan
from kvpool.contract.records import (
    Adopted,
    AttachInfo,
    CancelledGrant,
    ConfigureResult,
    DaemonStats,
    ElasticStats,
    HeldMap,
    LeaseStats,
    PeerStats,
    PoolStats,
    Released,
    SealedStats,
    SpaceStats,
    Stats,
    TransferState,
    TransferStatus,
)
from kvpool.contract.shared_handle import SHARINGS, SharedHandle, Sharing
from kvpool.v1 import kvpool_pb2 as pb

TRANSFER_STATE_TO_PB: dict[TransferState, int] = {
    TransferState.pending: pb.TRANSFER_STATE_PENDING,
    TransferState.done: pb.TRANSFER_STATE_DONE,
    TransferState.failed: pb.TRANSFER_STATE_FAILED,
}
TRANSFER_STATE_FROM_PB: dict[int, TransferState] = {
    v: k for k, v in TRANSFER_STATE_TO_PB.items()}

_HANDLE_FIELDS = tuple(f.name for f in pb.SharedHandle.DESCRIPTOR.fields if f.name != "sharing")
_SPACE_FIELDS = SpaceStats.__struct_fields__
_POOL_SCALARS = tuple(f for f in PoolStats.__struct_fields__
                      if f not in ("spaces", "elastic", "sealed"))
_LEASE_SCALARS = tuple(f for f in LeaseStats.__struct_fields__ if f not in ("held", "cached"))


# -- ids ----------------------------------------------------------------------------------------

def ids_to_bytes(ids: np.ndarray) -> bytes:
    """An int32 id array as little-endian int32 bytes."""
    return ids.astype(ID_DTYPE, copy=False).tobytes()


def ids_from_bytes(data: bytes) -> np.ndarray:
    """Little-endian int32 bytes as a read-only int32 array (no copy)."""
    return np.frombuffer(data, dtype=ID_DTYPE)


# -- plan ---------------------------------------------------------------------------------------

def plan_to_json(plan: PoolPlan) -> str:
    """The plan's one form on the wire (``plan_json`` of Configure and Attach), exactly what
    ``kvpoold plan --json`` prints: the PoolPlan record as indented JSON."""
    return msgspec.json.format(plan.to_json(), indent=2).decode() + "\n"


def plan_from_json(plan_json: str) -> PoolPlan:
    """The plan from ``plan_json`` (:func:`plan_to_json`'s text), validated field by field.

    Raises:
        msgspec.ValidationError: a field missing, or of the wrong type.
    """
    return PoolPlan.from_json(plan_json)


# -- handles, Configure, Attach -----------------------------------------------------------------

def handle_to_pb(handle: SharedHandle) -> pb.SharedHandle:
    return pb.SharedHandle(sharing=handle.sharing,
                           **{f: getattr(handle, f) for f in _HANDLE_FIELDS})


def handle_from_pb(msg: pb.SharedHandle) -> SharedHandle:
    """The proto handle as the one handle record.

    Raises:
        ValueError: ``sharing`` names no way of sharing this client knows.
    """
    if msg.sharing not in SHARINGS:
        raise ValueError(f"the daemon's handle shares by {msg.sharing!r}; this client knows "
                         f"{', '.join(SHARINGS)}")
    return SharedHandle(sharing=cast(Sharing, msg.sharing),
                        **{f: getattr(msg, f) for f in _HANDLE_FIELDS})


def configure_to_pb(result: ConfigureResult) -> pb.ConfigureResponse:
    return pb.ConfigureResponse(
        plan_json=result.plan_json, fingerprint=result.fingerprint, created=result.created,
        dry_run=result.dry_run, budget_available_bytes=result.budget_available_bytes,
    )


def configure_from_pb(msg: pb.ConfigureResponse) -> ConfigureResult:
    return ConfigureResult(plan_from_json(msg.plan_json), msg.plan_json, msg.fingerprint,
                           msg.created, msg.dry_run, msg.budget_available_bytes)


def attach_to_pb(info: AttachInfo) -> pb.AttachResponse:
    return pb.AttachResponse(
        fingerprint=info.fingerprint, plan_json=info.plan_json,
        handle=handle_to_pb(info.handle), attach_id=info.attach_id, device=info.device,
        elastic_groups=groups_to_bytes(info.elastic_groups),
    )


def attach_from_pb(msg: pb.AttachResponse) -> AttachInfo:
    return AttachInfo(msg.fingerprint, plan_from_json(msg.plan_json), msg.plan_json,
                      handle_from_pb(msg.handle), msg.attach_id, msg.device,
                      groups_from_bytes(msg.elastic_groups))


def groups_to_bytes(groups: Iterable[int]) -> bytes:
    """Group numbers of an elastic pool as little-endian uint32 bytes (Attach, Unmap)."""
    return np.asarray(list(groups), dtype="<u4").tobytes()


def groups_from_bytes(data: bytes) -> tuple[int, ...]:
    """Little-endian uint32 group numbers.

    Raises:
        InvalidArgument: a length that is not whole uint32s.
    """
    if len(data) % 4:
        raise InvalidArgument(f"group list of {len(data)} B is not whole uint32s",
                              field="groups")
    return tuple(np.frombuffer(data, dtype="<u4").tolist())


# -- transfers ----------------------------------------------------------------------------------

def transfer_status_to_pb(status: TransferStatus) -> pb.TransferStatus:
    return pb.TransferStatus(state=TRANSFER_STATE_TO_PB[status.state], message=status.message,
                             bytes=status.bytes, pages=status.pages, seconds=status.seconds,
                             peer=status.peer)


def transfer_status_from_pb(msg: pb.TransferStatus) -> TransferStatus:
    """The status record (an unset state reads as failed: a daemon that cannot say)."""
    return TransferStatus(state=TRANSFER_STATE_FROM_PB.get(msg.state, TransferState.failed),
                          message=msg.message, bytes=msg.bytes, pages=msg.pages,
                          seconds=msg.seconds, peer=msg.peer)


def cancelled_grant_from_pb(msg: pb.CancelGrantResponse) -> CancelledGrant:
    return CancelledGrant(status=transfer_status_from_pb(msg.status),
                          freed_pages=msg.freed_pages, fenced_pages=msg.fenced_pages)


# -- held ids: CloseLease, Drop, Stats ----------------------------------------------------------

def held_to_pb(held: Mapping[str, Mapping[str, int]]) -> list[pb.Held]:
    return [
        pb.Held(pool=pool, space=space, count=count)
        for pool, spaces in held.items()
        for space, count in spaces.items()
    ]


def held_from_pb(held: Iterable[pb.Held]) -> HeldMap:
    out: HeldMap = {}
    for h in held:
        out.setdefault(h.pool, {})[h.space] = h.count
    return out


def close_lease_to_pb(released: Released) -> pb.CloseLeaseResponse:
    return pb.CloseLeaseResponse(released=held_to_pb(released.held), detached=released.detached)


def drop_to_pb(released: Released) -> pb.DropResponse:
    return pb.DropResponse(reclaimed=held_to_pb(released.held), detached=released.detached,
                           released_bytes=released.released_bytes)


def released_from_pb(msg: pb.CloseLeaseResponse | pb.DropResponse) -> Released:
    if isinstance(msg, pb.CloseLeaseResponse):
        return Released(held_from_pb(msg.released), msg.detached)
    return Released(held_from_pb(msg.reclaimed), msg.detached, msg.released_bytes)


# -- Stats --------------------------------------------------------------------------------------

def stats_to_pb(stats: Stats) -> pb.StatsResponse:
    return pb.StatsResponse(
        daemon=pb.DaemonStats(**msgspec_fields(stats.daemon, DaemonStats.__struct_fields__)),
        pools=[
            pb.PoolStats(
                **msgspec_fields(p, _POOL_SCALARS),
                spaces=[
                    pb.SpaceStats(space=name, **msgspec_fields(s, _SPACE_FIELDS))
                    for name, s in p.spaces.items()
                ],
                elastic=None if p.elastic is None else pb.ElasticStats(
                    **msgspec_fields(p.elastic, ElasticStats.__struct_fields__)),
                sealed=None if p.sealed is None else sealed_to_pb(p.sealed),
            )
            for p in stats.pools
        ],
        leases=[
            pb.LeaseStats(**msgspec_fields(x, _LEASE_SCALARS), held=held_to_pb(x.held),
                          cached=held_to_pb(x.cached))
            for x in stats.leases
        ],
        peers=[pb.PeerStats(**msgspec_fields(x, PeerStats.__struct_fields__))
               for x in stats.peers],
    )


def stats_from_pb(msg: pb.StatsResponse) -> Stats:
    return Stats(
        daemon=DaemonStats(**msgspec_fields(msg.daemon, DaemonStats.__struct_fields__)),
        pools=[
            PoolStats(
                **msgspec_fields(p, _POOL_SCALARS),
                spaces={
                    s.space: SpaceStats(**msgspec_fields(s, _SPACE_FIELDS))
                    for s in p.spaces
                },
                elastic=ElasticStats(**msgspec_fields(p.elastic, ElasticStats.__struct_fields__))
                if p.HasField("elastic") else None,
                sealed=sealed_from_pb(p.sealed) if p.HasField("sealed") else None,
            )
            for p in msg.pools
        ],
        leases=[LeaseStats(**msgspec_fields(x, _LEASE_SCALARS), held=held_from_pb(x.held),
                           cached=held_from_pb(x.cached))
                for x in msg.leases],
        peers=[PeerStats(**msgspec_fields(x, PeerStats.__struct_fields__)) for x in msg.peers],
    )


def msgspec_fields(obj: Any, names: Iterable[str]) -> dict[str, Any]:
    """``{name: obj.name}`` for ``names`` (a Struct's or a message's fields)."""
    return {n: getattr(obj, n) for n in names}


# -- sealed pages -----------------------------------------------------------------------------

def _split_keys(data: bytes) -> list[bytes]:
    return [data[i:i + KEY_BYTES] for i in range(0, len(data), KEY_BYTES)]


def adopted_to_pb(a: Adopted) -> pb.AdoptResponse:
    return pb.AdoptResponse(page_ids=ids_to_bytes(a.ids), keys=b"".join(a.keys),
                            parents=b"".join(a.parents),
                            tokens=np.asarray(a.tokens, dtype=ID_DTYPE).tobytes(),
                            epoch=a.epoch, unfenced=a.unfenced, corrupt=a.corrupt,
                            other_layout=a.other_layout)


def adopted_from_pb(msg: pb.AdoptResponse) -> Adopted:
    ids = ids_from_bytes(msg.page_ids)
    tokens = np.frombuffer(msg.tokens, dtype=ID_DTYPE)
    n = ids.shape[0]
    return Adopted(ids, _split_keys(msg.keys), _split_keys(msg.parents),
                   tokens.reshape(n, -1) if n else tokens.reshape(0, 0), msg.epoch,
                   msg.unfenced, msg.corrupt, msg.other_layout)


def sealed_to_pb(s: SealedStats) -> pb.SealedResponse:
    fields = msgspec.structs.asdict(s)
    if fields["events_rank"] is None:  # proto3 optional: unset
        del fields["events_rank"]
    return pb.SealedResponse(**fields)


def sealed_from_pb(msg: pb.SealedResponse) -> SealedStats:
    return SealedStats(
        held=msg.held, kept=msg.kept, kept_bytes=msg.kept_bytes,
        oldest_seconds=msg.oldest_seconds, newest_seconds=msg.newest_seconds,
        sealed_total=msg.sealed_total, adopted_total=msg.adopted_total,
        evicted_total=msg.evicted_total, corrupt_total=msg.corrupt_total, epoch=msg.epoch,
        evicted=msg.evicted, layouts=tuple(msg.layouts),
        events_rank=msg.events_rank if msg.HasField("events_rank") else None)

