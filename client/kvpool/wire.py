"""Client-side wire conversion shared by the sync and asyncio clients.

Builds requests from Python values, turns responses into small typed records, and maps a gRPC
error back to the ``kvpool.errors`` class of its status code (field from ``kvpool-field``).
Ids travel as little-endian int32 bytes; ``np.frombuffer`` reads them without a copy.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import grpc
import msgspec
import numpy as np
from google.protobuf import json_format

from kvpool.errors import InvalidArgument, KVPoolError, error_from_code
from kvpool.handles import HandleKind, SharedHandle
from kvpool.limits import FIELD_METADATA_KEY, ID_DTYPE
from kvpool.v1 import kvpool_pb2 as pb

if TYPE_CHECKING:
    from kvpool.plan import BufferSpec, PoolPlan

KINDS: dict[str, int] = {"kv": pb.KIND_KV, "req": pb.KIND_REQ, "state": pb.KIND_STATE,
                         "swa": pb.KIND_SWA}
KIND_NAMES: dict[int, str] = {v: k for k, v in KINDS.items()}
HANDLE_KIND_NAMES: dict[int, HandleKind] = {pb.HANDLE_KIND_NONE: "none",
                                            pb.HANDLE_KIND_SHM: "shm",
                                            pb.HANDLE_KIND_CUDA_IPC: "cuda_ipc"}


# -- errors -------------------------------------------------------------------------------------

def error_from_rpc(exc: grpc.RpcError, target: str = "") -> KVPoolError:
    """The ``kvpool.errors`` exception for a failed call, keeping its code, message and field."""
    code = exc.code()  # type: ignore[attr-defined]
    details = exc.details() or ""  # type: ignore[attr-defined]
    field = None
    for key, value in exc.trailing_metadata() or ():  # type: ignore[attr-defined]
        if key == FIELD_METADATA_KEY:
            field = value if isinstance(value, str) else value.decode()
    if code == grpc.StatusCode.UNAVAILABLE and target:
        details = f"cannot reach kvpoold at {target} ({details}); is `kvpoold serve` running?"
    return error_from_code(code.name if code else "UNKNOWN", details, field)


# -- ids and kinds ------------------------------------------------------------------------------

def kind_value(kind: str | int, field: str = "kind") -> int:
    """``"kv"`` / ``"req"`` / ``"state"`` / ``"swa"`` (or an enum value) as the proto Kind."""
    if isinstance(kind, str):
        value = KINDS.get(kind.lower())
        if value is None:
            raise InvalidArgument(f"unknown kind {kind!r}; give kv, req, state or swa",
                                  field=field)
        return value
    return int(kind)


def ids_bytes(ids: Any, field: str = "ids") -> bytes:
    """Ids (ndarray or sequence of ints) as little-endian int32 bytes.

    Raises:
        InvalidArgument: not 1-D integers, or a value outside int32.
    """
    arr = np.asarray(ids)
    if arr.ndim != 1 or (arr.size and arr.dtype.kind not in "iu"):
        raise InvalidArgument(f"{field} must be a 1-D array of integer ids, got {arr.dtype} "
                              f"{arr.shape}", field=field)
    if arr.dtype != ID_DTYPE:
        if arr.size and (arr.min() < -(1 << 31) or arr.max() >= 1 << 31):
            raise InvalidArgument(f"{field} has an id outside int32", field=field)
        arr = arr.astype(ID_DTYPE)
    return arr.tobytes()


def ids_array(data: bytes) -> np.ndarray:
    """Little-endian int32 bytes as a read-only int32 array (no copy)."""
    return np.frombuffer(data, dtype=ID_DTYPE)


# -- Configure ----------------------------------------------------------------------------------

def spec_message(spec: Any) -> pb.ModelSpec:
    """A model spec (a mapping in kvpoold's ModelSpec JSON shape, or a ModelSpec Struct)."""
    data = msgspec.to_builtins(spec) if hasattr(spec, "__struct_fields__") else dict(spec)
    attention = data.get("attention")
    if isinstance(attention, Mapping) and "type" in attention:
        rest = {k: v for k, v in attention.items() if k != "type"}
        data = {k: v for k, v in data.items() if k != "attention"}
        data[str(attention["type"])] = rest
    data = {k: v for k, v in data.items() if v is not None}
    for key in ("sliding_window", "linear", "dsv4", "indexer"):
        if isinstance(data.get(key), Mapping):
            data[key] = {k: v for k, v in data[key].items() if v is not None}
    try:
        return json_format.ParseDict(data, pb.ModelSpec())
    except json_format.ParseError as exc:
        raise InvalidArgument(f"invalid model spec: {exc}", field="spec") from exc


def hf_config_text(hf_config: str | Path | Mapping[str, Any]) -> str:
    """A HF config.json as text: JSON text, a parsed mapping, or a path (file or model dir)."""
    if isinstance(hf_config, Mapping):
        return json.dumps(hf_config)
    if isinstance(hf_config, Path) or not hf_config.lstrip().startswith("{"):
        path = Path(hf_config)
        path = path / "config.json" if path.is_dir() else path
        try:
            return path.read_text()
        except OSError as exc:
            raise InvalidArgument(f"cannot read HF config {path}: {exc.strerror or exc}",
                                  field="hf_config") from exc
    return hf_config


def configure_request(pool: str, *, hf_config: Any = None, spec: Any = None,
                      dry_run: bool = False, **options: Any) -> pb.ConfigureRequest:
    """A ConfigureRequest; ``options`` are PlanOptions fields (None = the daemon's default).

    Raises:
        InvalidArgument: both or neither of hf_config / spec, or an unknown option.
    """
    if (hf_config is None) == (spec is None):
        raise InvalidArgument("give the model as hf_config or spec (one of them)", field="model")
    known = set(pb.ConfigureRequest.DESCRIPTOR.fields_by_name) - {"pool", "dry_run", "spec",
                                                                  "hf_config_json"}
    unknown = sorted(set(options) - known)
    if unknown:
        raise InvalidArgument(f"unknown Configure option {unknown[0]!r} (known: "
                              f"{', '.join(sorted(known))})", field=unknown[0])
    req = pb.ConfigureRequest(pool=pool, dry_run=dry_run,
                              **{k: v for k, v in options.items() if v is not None})
    if spec is not None:
        req.spec.CopyFrom(spec_message(spec))
    else:
        req.hf_config_json = hf_config_text(hf_config)
    return req


@dataclass(frozen=True)
class ConfigureResult:
    """What Configure returned: the plan (decoded from ``plan_json``), its fingerprint, and
    whether this call created the pool."""

    plan: PoolPlan
    fingerprint: str
    created: bool
    dry_run: bool
    budget_available_bytes: int
    plan_json: str

    @property
    def buffers(self) -> tuple[BufferSpec, ...]:
        return self.plan.buffers


def decode_plan(plan_json: str) -> PoolPlan:
    from kvpool.plan import PoolPlan  # lazy: the stats/leases paths never need it

    return PoolPlan.from_json(plan_json)


def configure_result(resp: pb.ConfigureResponse) -> ConfigureResult:
    return ConfigureResult(decode_plan(resp.plan_json), resp.fingerprint, resp.created,
                           resp.dry_run, resp.budget_available_bytes, resp.plan_json)


# -- Attach -------------------------------------------------------------------------------------

@dataclass(frozen=True)
class AttachInfo:
    """What Attach returned: the layout and the handle to map it; Detach with ``attach_id``."""

    fingerprint: str
    plan: PoolPlan
    plan_json: str
    handle: SharedHandle
    attach_id: int
    device: str


def shared_handle(h: pb.SharedHandle) -> SharedHandle:
    """The proto handle as the one handle type (an unset kind reads as ``none``)."""
    return SharedHandle(
        kind=HANDLE_KIND_NAMES.get(h.kind, "none"), size=h.size, path=h.path,
        device_uuid=h.device_uuid, ipc_handle=h.ipc_handle, storage_offset=h.storage_offset,
        storage_size=h.storage_size, ref_counter_handle=h.ref_counter_handle,
        ref_counter_offset=h.ref_counter_offset, event_handle=h.event_handle,
        event_sync_required=h.event_sync_required,
    )


def attach_info(resp: pb.AttachResponse) -> AttachInfo:
    handle = shared_handle(resp.handle)
    return AttachInfo(resp.fingerprint, decode_plan(resp.plan_json), resp.plan_json, handle,
                      resp.attach_id, resp.device)


# -- Allocate / Free ----------------------------------------------------------------------------

def allocate_request(pool: str, lease_id: int,
                     items: Sequence[tuple[str | int, int]]) -> pb.AllocateRequest:
    return pb.AllocateRequest(pool=pool, lease_id=lease_id, items=[
        pb.AllocateItem(kind=kind_value(kind, f"items[{i}].kind"), count=count)
        for i, (kind, count) in enumerate(items)
    ])


def free_request(pool: str, lease_id: int, items: Sequence[tuple[str | int, Any]]
                 ) -> pb.FreeRequest:
    return pb.FreeRequest(pool=pool, lease_id=lease_id, items=[
        pb.IdList(kind=kind_value(kind, f"items[{i}].kind"), ids=ids_bytes(ids, f"items[{i}].ids"))
        for i, (kind, ids) in enumerate(items)
    ])


# -- Stats / Drop / CloseLease ------------------------------------------------------------------

class KindStats(msgspec.Struct, frozen=True):
    capacity: int
    used: int
    free: int
    high_water: int
    allocs: int
    frees: int
    failed_allocs: int


class PoolStats(msgspec.Struct, frozen=True):
    name: str
    fingerprint: str
    architecture: str
    kv_cache_dtype: str
    page_size: int
    max_total_num_tokens: int
    max_running_requests: int
    backing_bytes: int
    kinds: dict[str, KindStats]
    attached: int
    age_seconds: float
    handle_kind: str


class LeaseStats(msgspec.Struct, frozen=True):
    lease_id: int
    name: str
    ttl_seconds: float
    expires_in_seconds: float
    held: dict[str, dict[str, int]]  # pool -> kind -> ids held
    attached: int


class DaemonStats(msgspec.Struct, frozen=True):
    version: str
    device: str
    budget_bytes: int
    used_bytes: int
    uptime_seconds: float
    num_pools: int
    num_leases: int
    leases_opened: int
    leases_closed: int
    leases_expired: int


class Stats(msgspec.Struct, frozen=True):
    """``kvpool stats --json`` is ``msgspec.json.encode`` of this."""

    daemon: DaemonStats
    pools: list[PoolStats]
    leases: list[LeaseStats]

    def pool(self, name: str) -> PoolStats:
        for p in self.pools:
            if p.name == name:
                return p
        raise KeyError(name)

    def to_dict(self) -> dict[str, Any]:
        return msgspec.to_builtins(self)


def _fields(msg: Any, names: Sequence[str]) -> dict[str, Any]:
    return {n: getattr(msg, n) for n in names}


def held_map(held: Sequence[pb.Held]) -> dict[str, dict[str, int]]:
    out: dict[str, dict[str, int]] = {}
    for h in held:
        out.setdefault(h.pool, {})[KIND_NAMES.get(h.kind, str(h.kind))] = h.count
    return out


def stats(resp: pb.StatsResponse) -> Stats:
    kind_fields = KindStats.__struct_fields__
    pool_fields = [f for f in PoolStats.__struct_fields__ if f != "kinds"]
    lease_fields = [f for f in LeaseStats.__struct_fields__ if f != "held"]
    return Stats(
        daemon=DaemonStats(**_fields(resp.daemon, DaemonStats.__struct_fields__)),
        pools=[
            PoolStats(**_fields(p, pool_fields), kinds={
                KIND_NAMES.get(k.kind, str(k.kind)): KindStats(**_fields(k, kind_fields))
                for k in p.kinds
            })
            for p in resp.pools
        ],
        leases=[LeaseStats(**_fields(x, lease_fields), held=held_map(x.held))
                for x in resp.leases],
    )


@dataclass(frozen=True)
class Released:
    """What CloseLease or Drop gave back: ids per pool and kind, attachments ended."""

    held: dict[str, dict[str, int]]
    detached: int
    released_bytes: int = 0

    @property
    def total(self) -> int:
        return sum(n for kinds in self.held.values() for n in kinds.values())
