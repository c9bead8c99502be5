"""Client requests, shared by the sync and asyncio clients: Python values -> request messages.

Replies are decoded by ``kvpool.contract.codec`` into ``kvpool.contract.records``; a failed call
becomes the
``kvpool.contract.errors`` class of its status code (field from the ``kvpool-field`` metadata).
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import grpc
import msgspec
import numpy as np
from google.protobuf import json_format

from kvpool.contract.errors import InvalidArgument, KVPoolError, error_from_code
from kvpool.contract.limits import FIELD_METADATA_KEY, ID_DTYPE, KEY_BYTES, MAX_IDS_PER_CALL
from kvpool.contract.spec import decode_spec
from kvpool.v1 import kvpool_pb2 as pb

# -- errors -------------------------------------------------------------------------------------

def error_from_rpc(exc: grpc.RpcError, target: str = "") -> KVPoolError:
    """The ``kvpool.contract.errors`` exception for a failed call, keeping its code, message and
    field.

    Every status code has its class (``kvpool.contract.errors.ERRORS_BY_CODE``): a daemon that is
    not running is ``Unavailable``, a passed deadline ``DeadlineExceeded``; an error carrying no
    status at all is ``Unknown``.
    """
    # A bare grpc.RpcError (raised by an interceptor, say) has no code(), details() or metadata.
    code = exc.code() if hasattr(exc, "code") else None
    details = (exc.details() or "") if hasattr(exc, "details") else str(exc)
    field = None
    metadata = exc.trailing_metadata() if hasattr(exc, "trailing_metadata") else None
    for key, value in metadata or ():
        if key == FIELD_METADATA_KEY:
            field = value if isinstance(value, str) else value.decode()
    # The daemon's own UNAVAILABLE answers name their field (a peer it could not reach); only
    # a call that never reached a daemon is about the target.
    if code == grpc.StatusCode.UNAVAILABLE and target and field is None:
        details = f"cannot reach kvpoold at {target} ({details}); is `kvpoold serve` running?"
    return error_from_code(code.name if code is not None else "UNKNOWN", details, field)


# -- leases -------------------------------------------------------------------------------------

class LeaseLike(Protocol):
    """A lease as requests name it: ``Lease``, ``AsyncLease`` or :class:`LeaseKey`."""

    @property
    def lease_id(self) -> int: ...

    @property
    def secret(self) -> bytes: ...


@dataclass(frozen=True)
class LeaseKey:
    """A lease's id and secret (OpenLease's answer), for code that holds no ``Lease`` object:
    another process the lease was handed to, a raw-stub test. The secret is not in its repr."""

    lease_id: int
    secret: bytes = field(repr=False)


def lease_key(lease: LeaseLike | None, field: str = "lease") -> tuple[int, bytes]:
    """``(lease_id, lease_secret)`` of a lease, or ``(0, b"")`` for none.

    Raises:
        InvalidArgument: a bare lease id: a request acting on a lease needs its secret too,
            which only the ``Lease`` object (or a :class:`LeaseKey`) holds.
    """
    if lease is None:
        return 0, b""
    if isinstance(lease, int):
        raise InvalidArgument(f"{field} must be the Lease object, not its id {lease}: the "
                              "daemon needs the lease's secret too, which the Lease holds "
                              "(docs/security.md)", field=field)
    return int(lease.lease_id), bytes(lease.secret)


# -- ids and spaces -----------------------------------------------------------------------------

def space_name(space: str, field: str = "space") -> str:
    """An id space's name as sent (``"kv"``, ``"req"``, ``"state"``, ``"swa"``, ``"c4_state"``
    ...: the plan's ``id_spaces``).

    Raises:
        InvalidArgument: not a string, or empty.
    """
    if not isinstance(space, str) or not space:
        raise InvalidArgument(f"an id space is named by a non-empty string (kv, req, state, "
                              f"...: the plan's id_spaces), got {space!r}", field=field)
    return space.lower()


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


# -- Configure ----------------------------------------------------------------------------------

# Keys of a Hugging Face config.json that no model spec has: such a mapping was meant as
# ``hf_config``.
HF_CONFIG_KEYS = ("architectures", "model_type", "num_hidden_layers", "hidden_size")


def spec_message(spec: Any) -> pb.ModelSpec:
    """A model spec (a mapping in kvpoold's ModelSpec JSON shape, or a ModelSpec Struct).

    Raises:
        InvalidArgument: the mapping is a Hugging Face config (pass it as ``hf_config``) or not a
            valid spec (msgspec's path of the first bad field).
    """
    if not hasattr(spec, "__struct_fields__"):
        if not isinstance(spec, Mapping):
            raise InvalidArgument(f"a model spec is a mapping or a ModelSpec, got "
                                  f"{type(spec).__name__}", field="spec")
        hf_keys = [k for k in HF_CONFIG_KEYS if k in spec]
        if hf_keys:
            raise InvalidArgument(
                f"the spec looks like a Hugging Face config.json (it has {hf_keys[0]!r}); give "
                "it as hf_config (kvpool configure --hf-config PATH); a spec is kvpool's own "
                "model description (docs/api.md, \"Model spec\")", field="spec")
        spec = decode_spec(dict(spec), source="spec", field="spec")
    data = msgspec.to_builtins(spec)
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
            text = path.read_text()
        except OSError as exc:
            raise InvalidArgument(f"cannot read HF config {path}: {exc.strerror or exc}",
                                  field="hf_config") from exc
        except UnicodeDecodeError:
            text = ""
        if path.suffix == ".toml" or not text.lstrip().startswith("{"):
            what = "a TOML file" if path.suffix == ".toml" else "not a JSON object"
            raise InvalidArgument(
                f"HF config {path} is {what}: --hf-config (hf_config) takes a Hugging Face "
                "config.json; a hand-written kvpool model spec (.toml or .json) goes in --spec "
                "(spec)", field="hf_config")
        return text
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
    vllm = options.pop("vllm", None)
    if vllm is not None:
        options.setdefault("engine", "vllm")
    req = pb.ConfigureRequest(pool=pool, dry_run=dry_run,
                              **{k: v for k, v in options.items() if v is not None})
    if vllm is not None:
        req.vllm.CopyFrom(vllm_options_message(vllm))
    if spec is not None:
        req.spec.CopyFrom(spec_message(spec))
    else:
        req.hf_config_json = hf_config_text(hf_config)
    return req


def vllm_options_message(vllm: Any) -> pb.VllmOptions:
    """vLLM's knobs of a vLLM-layout pool (a ``VllmOptions`` record or a mapping of its
    fields; None values left unset) as the wire message.

    Raises:
        InvalidArgument: a field the message does not have.
    """
    fields = msgspec.to_builtins(vllm) if isinstance(vllm, msgspec.Struct) else dict(vllm)
    known = set(pb.VllmOptions.DESCRIPTOR.fields_by_name)
    unknown = sorted(set(fields) - known)
    if unknown:
        raise InvalidArgument(f"unknown vLLM option {unknown[0]!r} (known: "
                              f"{', '.join(sorted(known))})", field=f"vllm.{unknown[0]}")
    return pb.VllmOptions(**{k: v for k, v in fields.items() if v is not None})


# -- Allocate / Free ----------------------------------------------------------------------------

def allocate_request(pool: str, lease: LeaseLike,
                     items: Sequence[tuple[str | int, int]]) -> pb.AllocateRequest:
    return pb.AllocateRequest(pool=pool, lease_id=lease.lease_id, lease_secret=lease.secret,
                              items=[
        pb.AllocateItem(space=space_name(space, f"items[{i}].space"), count=count)
        for i, (space, count) in enumerate(items)
    ])


def free_request(pool: str, lease: LeaseLike, items: Sequence[tuple[str | int, Any]]
                 ) -> pb.FreeRequest:
    """A Free of ``items``.

    Raises:
        InvalidArgument: more than MAX_IDS_PER_CALL ids in all (the daemon would refuse the
            message by its size), or ids that are not int32.
    """
    req = pb.FreeRequest(pool=pool, lease_id=lease.lease_id, lease_secret=lease.secret, items=[
        pb.IdList(space=space_name(space, f"items[{i}].space"),
                  ids=ids_bytes(ids, f"items[{i}].ids"))
        for i, (space, ids) in enumerate(items)
    ])
    total = sum(len(item.ids) for item in req.items) // ID_DTYPE.itemsize
    if total > MAX_IDS_PER_CALL:
        raise InvalidArgument(f"free has {total:,} ids, at most {MAX_IDS_PER_CALL:,} per call "
                              "(kvpool.contract.limits.MAX_IDS_PER_CALL); split it into "
                              "several calls", field="items")
    return req


# -- sealed pages ---------------------------------------------------------------------------------

def seal_request(pool: str, lease: LeaseLike, layout: str, pages: Any, keys: Sequence[bytes],
                 parents: Sequence[bytes], tokens: Any) -> pb.SealRequest:
    """A Seal of ``pages`` (int32 ids) with one 32-byte key and parent key each, and their
    token ids (``len(pages) * page_size`` values, page after page).

    Raises:
        InvalidArgument: a key or parent key that is not 32 bytes, or ids that are not int32.
    """
    for name, values in (("keys", keys), ("parents", parents)):
        bad = [i for i, k in enumerate(values) if len(k) != KEY_BYTES]
        if bad:
            raise InvalidArgument(f"{name}[{bad[0]}] has {len(values[bad[0]])} bytes; each is "
                                  f"a {KEY_BYTES}-byte hash", field=name)
    return pb.SealRequest(pool=pool, lease_id=lease.lease_id, lease_secret=lease.secret,
                          layout=layout, page_ids=ids_bytes(pages, "pages"),
                          keys=b"".join(keys), parents=b"".join(parents),
                          tokens=ids_bytes(tokens, "tokens"))


def unseal_request(pool: str, lease: LeaseLike, pages: Any) -> pb.UnsealRequest:
    return pb.UnsealRequest(pool=pool, lease_id=lease.lease_id, lease_secret=lease.secret,
                            page_ids=ids_bytes(pages, "pages"))


def adopt_request(pool: str, lease: LeaseLike, layout: str) -> pb.AdoptRequest:
    return pb.AdoptRequest(pool=pool, lease_id=lease.lease_id, lease_secret=lease.secret,
                           layout=layout)


# -- transfers between daemons ------------------------------------------------------------------

def grant_receive_request(pool: str, lease: LeaseLike, pages: Any,
                          ttl_s: float | None = None) -> pb.GrantReceiveRequest:
    return pb.GrantReceiveRequest(pool=pool, lease_id=lease.lease_id, lease_secret=lease.secret,
                                  pages=ids_bytes(pages, "pages"), ttl_seconds=ttl_s or 0.0)


def cancel_grant_request(lease: LeaseLike, token: bytes) -> pb.CancelGrantRequest:
    if not isinstance(token, bytes | bytearray):
        raise InvalidArgument(f"token must be the bytes GrantReceive returned, got "
                              f"{type(token).__name__}", field="token")
    lease_id, secret = lease_key(lease)
    return pb.CancelGrantRequest(lease_id=lease_id, lease_secret=secret, token=bytes(token))


def send_request(pool: str, lease: LeaseLike, pages: Any, peer: str,
                 token: bytes, hold: bool = False, wait_s: float = 0.0) -> pb.SendRequest:
    if not isinstance(token, bytes | bytearray):
        raise InvalidArgument(f"token must be the bytes GrantReceive returned, got "
                              f"{type(token).__name__}", field="token")
    lease_id, secret = lease_key(lease)
    return pb.SendRequest(pool=pool, lease_id=lease_id, lease_secret=secret,
                          pages=ids_bytes(pages, "pages"), peer=peer, token=bytes(token),
                          hold=hold, wait_seconds=wait_s)


def post_send_request(lease: LeaseLike, transfer_id: int, wait_s: float) -> pb.SendRequest:
    """The Send that posts the held send ``transfer_id`` of ``lease``."""
    lease_id, secret = lease_key(lease)
    return pb.SendRequest(lease_id=lease_id, lease_secret=secret, transfer_id=transfer_id,
                          wait_seconds=wait_s)
