"""Proto <-> domain conversion: the only module of the daemon that imports ``kvpool_pb2``.

Requests become plain values and records (``records.py``); records become responses. Malformed
wire input (an unset kind, an id list that is not a whole number of int32) is refused here as
``InvalidArgument`` naming the field; range and state checks belong to the daemon.
"""

from __future__ import annotations

from typing import Any

import numpy as np
from google.protobuf.message import Message

from kvpool.errors import InvalidArgument
from kvpool.plan import PoolPlan
from kvpool.v1 import kvpool_pb2 as pb
from kvpoold.ids import Kind, PoolCounters
from kvpoold.server.leases import Lease
from kvpoold.server.records import (
    AttachResult,
    CloseResult,
    ConfigureArgs,
    ConfigureResult,
    DropResult,
    HeldCount,
    IdBlock,
    Snapshot,
)
from kvpoold.sharing.base import SharedHandle

KIND_FROM_PB: dict[int, Kind] = {
    pb.KIND_KV: Kind.KV,
    pb.KIND_SWA: Kind.SWA,
    pb.KIND_REQ: Kind.REQ,
    pb.KIND_STATE: Kind.STATE,
}
KIND_TO_PB: dict[Kind, int] = {kind: value for value, kind in KIND_FROM_PB.items()}
HANDLE_KIND_TO_PB = {
    "none": pb.HANDLE_KIND_NONE,
    "shm": pb.HANDLE_KIND_SHM,
    "cuda_ipc": pb.HANDLE_KIND_CUDA_IPC,
}
# ConfigureRequest fields that are PlanOptions fields of the same name.
_OPTIONAL_OPTIONS = (
    "budget_bytes", "max_total_tokens", "page_size", "tp_size", "pp_size", "pp_rank",
    "context_length", "max_running_requests", "speculative_num_draft_layers",
    "speculative_num_draft_tokens", "swa_full_tokens_ratio", "mamba_full_memory_ratio",
)
_PLAN_SCALARS = tuple(
    f.name for f in pb.Plan.DESCRIPTOR.fields if f.name not in ("notes", "buffers")
)


def _kind(value: int, field: str) -> Kind:
    kind = KIND_FROM_PB.get(value)
    if kind is None:
        raise InvalidArgument(
            f"{field} is {pb.Kind.Name(value) if value in pb.Kind.values() else value}; give "
            "KIND_KV, KIND_REQ, KIND_STATE (or KIND_SWA to free)",
            field=field,
        )
    return kind


# -- requests -----------------------------------------------------------------------------------

def message_to_builtins(msg: Message) -> dict[str, Any]:
    """The fields set in ``msg`` as a dict (nested messages as dicts), for ``msgspec.convert``.

    Unset proto3 scalars are left out so the Struct's defaults (or its "missing field" error)
    apply; a oneof of messages named by the Struct's tag (``attention``) becomes
    ``{"type": <member>, ...}``.
    """
    out: dict[str, Any] = {}
    for fd, value in msg.ListFields():
        if fd.message_type is not None:
            out[fd.name] = message_to_builtins(value)
        elif fd.is_repeated:
            out[fd.name] = list(value)
        else:
            out[fd.name] = value
    for oneof in msg.DESCRIPTOR.oneofs:
        if oneof.name in out or oneof.fields[0].message_type is None:
            continue
        member = msg.WhichOneof(oneof.name)
        if member is not None:
            out[oneof.name] = {"type": member, **out.pop(member)}
    return out


def configure_args(req: pb.ConfigureRequest) -> ConfigureArgs:
    """A ConfigureRequest as :class:`ConfigureArgs` (options: only the fields that were set)."""
    options: dict[str, Any] = {f: getattr(req, f) for f in _OPTIONAL_OPTIONS if req.HasField(f)}
    if req.kv_cache_dtype:
        options["kv_cache_dtype"] = req.kv_cache_dtype
    if req.speculative_algorithm:
        options["speculative_algorithm"] = req.speculative_algorithm
    if req.disable_radix_cache:
        options["disable_radix_cache"] = True
    model = req.WhichOneof("model")
    return ConfigureArgs(
        pool=req.pool,
        hf_config_json=req.hf_config_json if model == "hf_config_json" else None,
        spec=message_to_builtins(req.spec) if model == "spec" else None,
        options=options,
        dry_run=req.dry_run,
    )


def allocate_items(req: pb.AllocateRequest) -> list[tuple[Kind, int]]:
    """The ``(kind, count)`` items of an AllocateRequest."""
    return [(_kind(item.kind, f"items[{i}].kind"), item.count) for i, item in enumerate(req.items)]


def free_items(req: pb.FreeRequest) -> list[tuple[Kind, np.ndarray]]:
    """The ``(kind, ids)`` items of a FreeRequest; ids decoded from little-endian int32 bytes."""
    out = []
    for i, item in enumerate(req.items):
        kind = _kind(item.kind, f"items[{i}].kind")
        if len(item.ids) % 4:
            raise InvalidArgument(
                f"items[{i}].ids has {len(item.ids)} bytes, not a whole number of little-endian "
                "int32 ids (4 bytes each)",
                field=f"items[{i}].ids",
            )
        out.append((kind, np.frombuffer(item.ids, dtype="<i4")))
    return out


# -- responses ----------------------------------------------------------------------------------

def plan_message(plan: PoolPlan) -> pb.Plan:
    """The plan as a proto message (None fields left unset)."""
    msg = pb.Plan(notes=plan.notes)
    for name in _PLAN_SCALARS:
        value = getattr(plan, name)
        if value is not None:
            setattr(msg, name, value)
    msg.buffers.extend(
        pb.Buffer(name=b.name, dtype=b.dtype.value, shape=b.shape, offset_bytes=b.offset_bytes,
                  nbytes=b.nbytes, kind=b.kind.value, page_bytes=b.page_bytes,
                  in_budget=b.in_budget)
        for b in plan.buffers
    )
    return msg


def configure_response(result: ConfigureResult) -> pb.ConfigureResponse:
    return pb.ConfigureResponse(
        plan=plan_message(result.plan),
        plan_json=result.plan_json,
        fingerprint=result.fingerprint,
        created=result.created,
        dry_run=result.dry_run,
        budget_available_bytes=result.budget_available_bytes,
    )


def open_lease_response(lease: Lease) -> pb.OpenLeaseResponse:
    return pb.OpenLeaseResponse(lease_id=lease.lease_id, ttl_seconds=lease.ttl_s)


def keep_alive_response(lease: Lease, now: float) -> pb.KeepAliveResponse:
    return pb.KeepAliveResponse(lease_id=lease.lease_id, ttl_seconds=lease.ttl_s,
                                expires_in_seconds=lease.expires_in(now))


def _held(held: tuple[HeldCount, ...]) -> list[pb.Held]:
    return [pb.Held(pool=h.pool, kind=KIND_TO_PB[h.kind], count=h.count) for h in held]


def close_lease_response(result: CloseResult) -> pb.CloseLeaseResponse:
    return pb.CloseLeaseResponse(released=_held(result.released), detached=result.detached)


def allocate_response(blocks: list[IdBlock]) -> pb.AllocateResponse:
    return pb.AllocateResponse(items=[
        pb.IdList(
            kind=KIND_TO_PB[b.kind],
            ids=b.ids.astype("<i4", copy=False).tobytes(),
            swa_ids=b"" if b.swa_ids is None else b.swa_ids.astype("<i4", copy=False).tobytes(),
        )
        for b in blocks
    ])


def free_response(freed: int) -> pb.FreeResponse:
    return pb.FreeResponse(freed=freed)


def detach_response() -> pb.DetachResponse:
    return pb.DetachResponse()


def drop_response(result: DropResult) -> pb.DropResponse:
    return pb.DropResponse(reclaimed=_held(result.reclaimed), detached=result.detached,
                           released_bytes=result.released_bytes)


def handle_message(handle: SharedHandle) -> pb.SharedHandle:
    return pb.SharedHandle(
        kind=HANDLE_KIND_TO_PB[handle.kind],
        size=handle.size,
        path=handle.path,
        device_uuid=handle.device_uuid,
        ipc_handle=handle.ipc_handle,
        storage_offset=handle.storage_offset,
        storage_size=handle.storage_size,
        ref_counter_handle=handle.ref_counter_handle,
        ref_counter_offset=handle.ref_counter_offset,
        event_handle=handle.event_handle,
        event_sync_required=handle.event_sync_required,
    )


def attach_response(result: AttachResult) -> pb.AttachResponse:
    return pb.AttachResponse(
        fingerprint=result.fingerprint,
        plan=plan_message(result.plan),
        plan_json=result.plan_json,
        handle=handle_message(result.handle),
        attach_id=result.attach_id,
        device=result.device,
    )


def _kind_stats(kind: Kind, c: PoolCounters) -> pb.KindStats:
    return pb.KindStats(kind=KIND_TO_PB[kind], capacity=c.capacity, used=c.used, free=c.free,
                        high_water=c.high_water, allocs=c.allocs, frees=c.frees,
                        failed_allocs=c.failed_allocs)


def stats_response(snap: Snapshot) -> pb.StatsResponse:
    d = snap.daemon
    return pb.StatsResponse(
        daemon=pb.DaemonStats(
            version=d.version, device=d.device, budget_bytes=d.budget_bytes,
            used_bytes=d.used_bytes, uptime_seconds=d.uptime_s, num_pools=d.num_pools,
            num_leases=d.num_leases, leases_opened=d.leases_opened,
            leases_closed=d.leases_closed, leases_expired=d.leases_expired,
        ),
        pools=[
            pb.PoolStats(
                name=p.name, fingerprint=p.fingerprint, architecture=p.plan.architecture,
                kv_cache_dtype=p.plan.kv_cache_dtype, page_size=p.plan.page_size,
                max_total_num_tokens=p.plan.max_total_num_tokens,
                max_running_requests=p.plan.max_running_requests,
                backing_bytes=p.plan.backing_bytes,
                kinds=[_kind_stats(k, c) for k, c in p.kinds.items()],
                attached=p.attached, age_seconds=p.age_s, handle_kind=p.handle_kind,
            )
            for p in snap.pools
        ],
        leases=[
            pb.LeaseStats(lease_id=x.lease_id, name=x.name, ttl_seconds=x.ttl_s,
                          expires_in_seconds=x.expires_in_s, held=_held(x.held),
                          attached=x.attached)
            for x in snap.leases
        ],
    )
