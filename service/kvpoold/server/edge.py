"""The daemon's edge: request messages -> typed values, once; replies through
``kvpool.contract.codec``.

Malformed wire input (an item naming no id space, an id list that is not a whole number of
int32) is refused here as ``InvalidArgument`` naming the field; what a value means for a pool
(its spaces, ranges, owners) is checked by the daemon and the id spaces, which take only the
typed values this module makes. Replies are the shared records encoded by
``kvpool.contract.codec``, so the client decodes exactly the shape the daemon built.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
from google.protobuf.message import Message

from kvpool.contract import codec
from kvpool.contract.errors import InvalidArgument, echo
from kvpool.contract.limits import MAX_IDS_PER_CALL, MAX_ITEMS_PER_CALL
from kvpool.contract.options import PlanOptions
from kvpool.contract.plan import ASSUMABLE_FAMILIES
from kvpool.contract.records import TransferStatus
from kvpool.v1 import kvpool_pb2 as pb
from kvpoold.ids import Grant
from kvpoold.server.args import ConfigureArgs, LeaseRef
from kvpoold.server.leases import CacheCounts, Lease
from kvpoold.transfer import Outgoing
from kvpoold.transfer.grants import (
    DEFAULT_GRANT_TTL_S,
    MAX_GRANT_PAGES,
    ReceiveGrant,
    check_token,
)
from kvpoold.transfer.liveness import MAX_BOOT_ID_CHARS, ProcessId
from kvpoold.transfer.messages import (
    Acceptance,
    GrantArgs,
    PeerDoneArgs,
    PeerReceiveArgs,
    PostArgs,
    SendArgs,
    WaitArgs,
)
from kvpoold.transfer.nixl_agent import MAX_KNOWN_GENERATIONS
from kvpoold.transfer.pages import check_pages
from kvpoold.transfer.peers import MAX_MESSAGE_CHARS, MAX_PEER_CHARS, check_peer
from kvpoold.transfer.transfers import MAX_WAIT_S

# The PlanOptions fields a ConfigureRequest carries, by the same name; unset ones are left to
# the plan's defaults (optional numbers by presence, strings when empty, bools when false).
_OPTION_FIELDS = tuple(
    pb.ConfigureRequest.DESCRIPTOR.fields_by_name[name]
    for name in PlanOptions.__struct_fields__
    if name in pb.ConfigureRequest.DESCRIPTOR.fields_by_name
)


def _space(space: str, field: str) -> str:
    """The id space an item names (its pool says which exist)."""
    if not space:
        raise InvalidArgument(f"{field} is not set; name an id space of the pool (kv, req, "
                              "state, ...: the plan's id_spaces)", field=field)
    return space


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
    options: dict[str, Any] = {}
    for fd in _OPTION_FIELDS:
        value = getattr(req, fd.name)
        if req.HasField(fd.name) if fd.has_presence else bool(value):
            options[fd.name] = value
    model = req.WhichOneof("model")
    engine = _engine(req.engine)
    vllm = None
    if engine == "vllm":
        vllm = _vllm_args(req, options, model)
    elif req.HasField("vllm"):
        raise InvalidArgument("vllm (vLLM's knobs) is set but engine is not \"vllm\"; set "
                              "engine \"vllm\" for a vLLM-layout pool", field="vllm")
    return ConfigureArgs(
        pool=req.pool,
        hf_config_json=req.hf_config_json if model == "hf_config_json" else None,
        spec=message_to_builtins(req.spec) if model == "spec" else None,
        options=options,
        dry_run=req.dry_run,
        assume_architecture=_assumed(req.assume_architecture, model),
        engine=engine,
        vllm=vllm,
    )


ENGINES = ("sglang", "vllm")


def _engine(engine: str) -> str:
    """Configure's ``engine``: "" is sglang.

    Raises:
        InvalidArgument: another name.
    """
    if engine in ("", "sglang"):
        return "sglang"
    if engine != "vllm":
        raise InvalidArgument(f"engine {echo(engine)} is not one kvpool lays pools out for "
                              f"(accepted: {', '.join(ENGINES)}; \"\" = sglang)", field="engine")
    return engine


def _vllm_args(req: pb.ConfigureRequest, options: dict[str, Any],
               model: str | None) -> dict[str, Any]:
    """A vLLM-layout pool's knobs (the VllmOptions fields set in ``req.vllm``), checked
    against what such a pool does not take.

    Raises:
        InvalidArgument: a spec model, an SGLang option (elastic among them), or neither
            kv_cache_memory_bytes nor num_gpu_blocks_override.
    """
    if model != "hf_config_json":
        raise InvalidArgument("a vLLM-layout pool (engine vllm) is planned from the model's "
                              "HF config.json: give hf_config_json, not spec", field="model")
    if options.get("elastic"):
        raise InvalidArgument(
            "elastic pools are SGLang-layout only: vLLM's KV-cache tensors are one region "
            "that vLLM's allocate_kv_cache sizes once; Configure engine vllm without elastic",
            field="elastic")
    sglang = sorted(options)
    if sglang:
        raise InvalidArgument(
            f"{sglang[0]} is an SGLang-layout option; a vLLM-layout pool (engine vllm) takes "
            "vLLM's knobs in vllm (kv_cache_memory_bytes, block_size, kv_cache_dtype, "
            "tp_size, ..., backend for the device)", field=sglang[0])
    if req.assume_architecture:
        raise InvalidArgument("assume_architecture is SGLang's registry; vLLM reads the "
                              "config itself (engine vllm)", field="assume_architecture")
    knobs = message_to_builtins(req.vllm)
    if "kv_cache_memory_bytes" not in knobs:
        if "num_gpu_blocks_override" not in knobs:
            raise InvalidArgument(
                "give vllm.kv_cache_memory_bytes (vLLM's KV budget per worker) or "
                "vllm.num_gpu_blocks_override", field="vllm.kv_cache_memory_bytes")
        knobs["kv_cache_memory_bytes"] = 0
    return knobs


def _assumed(family: str, model: str | None) -> str | None:
    """Configure's ``assume_architecture``: "" is none; else an assumable family, with a HF
    config.

    Raises:
        InvalidArgument: another family, or given with a spec.
    """
    if not family:
        return None
    if family not in ASSUMABLE_FAMILIES:
        raise InvalidArgument(f"assume_architecture {echo(family)} is not a family kvpool can "
                              f"read a config as (accepted: {', '.join(ASSUMABLE_FAMILIES)})",
                              field="assume_architecture")
    if model != "hf_config_json":
        raise InvalidArgument("assume_architecture applies to an hf_config_json model only (a "
                              "spec says its own attention)", field="assume_architecture")
    return family


def lease_ref(lease_id: int, secret: bytes, field: str = "lease_id") -> LeaseRef:
    """The lease a request names: ``lease_id`` (0 is "not set") with its ``lease_secret``.

    The secret is not checked here: a missing or wrong one is answered as an unknown lease by
    ``LeaseTable.prove``, so its answer never depends on whether the id exists.

    Raises:
        InvalidArgument: ``lease_id`` is 0.
    """
    if lease_id == 0:
        raise InvalidArgument(f"{field} is not set (0); pass the lease_id and lease_secret "
                              "OpenLease returned", field=field)
    return LeaseRef(lease_id, secret)


def optional_lease_ref(lease_id: int, secret: bytes) -> LeaseRef | None:
    """An Attach's lease: None when ``lease_id`` is 0 (an attachment tied to no lease)."""
    return LeaseRef(lease_id, secret) if lease_id else None


def check_items(n: int, rpc: str) -> None:
    """At most MAX_ITEMS_PER_CALL items in one call (checked before any item is read).

    Raises:
        InvalidArgument: more.
    """
    if n > MAX_ITEMS_PER_CALL:
        raise InvalidArgument(
            f"{rpc} has {n:,} items, at most {MAX_ITEMS_PER_CALL:,} per call; split the batch, "
            "or merge the items of one space into one (count, or ids)", field="items")


def allocate_items(req: pb.AllocateRequest) -> list[tuple[str, int]]:
    """The ``(space, count)`` items of an AllocateRequest (counts are uint32 on the wire).

    Raises:
        InvalidArgument: more than MAX_ITEMS_PER_CALL items, or an item without a space.
    """
    check_items(len(req.items), "allocate")
    return [(_space(item.space, f"items[{i}].space"), item.count)
            for i, item in enumerate(req.items)]


def free_items(req: pb.FreeRequest) -> list[tuple[str, np.ndarray]]:
    """The ``(space, ids)`` items of a FreeRequest: ids as read-only contiguous int32 arrays
    over the message's bytes (no copy).

    Raises:
        InvalidArgument: more than MAX_ITEMS_PER_CALL items or MAX_IDS_PER_CALL ids, an item
            without a space, or ids that are not whole int32 values.
    """
    check_items(len(req.items), "free")
    # Each read of a bytes field is a copy (60 MB for 15M ids): read each item's once.
    data = [item.ids for item in req.items]
    total = sum(len(d) for d in data) // 4
    if total > MAX_IDS_PER_CALL:
        raise InvalidArgument(f"free has {total:,} ids, at most {MAX_IDS_PER_CALL:,} per call; "
                              "split it", field="items")
    out = []
    for i, (item, ids) in enumerate(zip(req.items, data, strict=True)):
        space = _space(item.space, f"items[{i}].space")
        if len(ids) % 4:
            raise InvalidArgument(
                f"items[{i}].ids has {len(ids)} bytes, not a whole number of little-endian "
                "int32 ids (4 bytes each)",
                field=f"items[{i}].ids",
            )
        out.append((space, codec.ids_from_bytes(ids)))
    return out


MAX_CACHE_REPORTS = 1024


def cache_reports(request: pb.KeepAliveRequest) -> dict[tuple[str, str], CacheCounts]:
    """A KeepAlive's page-cache report: ``(pool, space) -> CacheCounts``, summed per key.

    Raises:
        InvalidArgument: more than MAX_CACHE_REPORTS entries, or one without pool or space.
    """
    if len(request.caches) > MAX_CACHE_REPORTS:
        raise InvalidArgument(f"caches has {len(request.caches)} reports, at most "
                              f"{MAX_CACHE_REPORTS}", field="caches")
    out: dict[tuple[str, str], CacheCounts] = {}
    for i, r in enumerate(request.caches):
        if not r.pool or not r.space:
            raise InvalidArgument(f"caches[{i}] needs a pool and a space", field=f"caches[{i}]")
        c = out.get((r.pool, r.space), CacheCounts(0, 0))
        out[(r.pool, r.space)] = CacheCounts(c.cached + r.cached, c.in_use + r.in_use,
                                             c.evictable + r.evictable)
    return out


def unmapped(request: pb.KeepAliveRequest) -> list[int]:
    """The reclaims a KeepAlive says its process unmapped.

    Raises:
        InvalidArgument: more than MAX_CACHE_REPORTS of them.
    """
    if len(request.unmapped) > MAX_CACHE_REPORTS:
        raise InvalidArgument(f"unmapped has {len(request.unmapped)} reclaims, at most "
                              f"{MAX_CACHE_REPORTS}", field="unmapped")
    return list(request.unmapped)


# -- responses ----------------------------------------------------------------------------------

def open_lease_response(lease: Lease) -> pb.OpenLeaseResponse:
    return pb.OpenLeaseResponse(lease_id=lease.lease_id, ttl_seconds=lease.ttl_s,
                                lease_secret=lease.secret)


def keep_alive_response(lease: Lease, now: float, seq: int = 0,
                        give_back: dict[tuple[str, str], tuple[int, int]] | None = None,
                        unmap: Sequence[tuple[str, tuple[int, ...], int, float]] = (),
                        ) -> pb.KeepAliveResponse:
    """A renewal's answer (``seq`` of the request), or give-backs and unmap asks sent on
    their own (0)."""
    return pb.KeepAliveResponse(
        lease_id=lease.lease_id, ttl_seconds=lease.ttl_s,
        expires_in_seconds=lease.expires_in(now), seq=seq,
        give_back=[pb.GiveBack(pool=pool, space=space, count=n, min_id=min_id)
                   for (pool, space), (n, min_id) in (give_back or {}).items()],
        unmap=[pb.Unmap(pool=pool, groups=codec.groups_to_bytes(groups), reclaim=reclaim,
                        deadline_seconds=deadline)
               for pool, groups, reclaim, deadline in unmap])


def allocate_response(items: Sequence[tuple[str, Grant]]) -> pb.AllocateResponse:
    """One IdList per request item: its space, its ids, and a following space's paired ids."""
    return pb.AllocateResponse(items=[
        pb.IdList(
            space=space,
            ids=codec.ids_to_bytes(grant.ids),
            paired_ids=b"" if grant.paired is None else codec.ids_to_bytes(grant.paired),
            paired_space=grant.paired_space or "",
        )
        for space, grant in items
    ])


def free_response(freed: int) -> pb.FreeResponse:
    return pb.FreeResponse(freed=freed)


def seal_response(sealed: int) -> pb.SealResponse:
    return pb.SealResponse(sealed=sealed)


def unseal_response(unsealed: int) -> pb.UnsealResponse:
    return pb.UnsealResponse(unsealed=unsealed)


def detach_response() -> pb.DetachResponse:
    return pb.DetachResponse()


def grant_receive_response(grant: ReceiveGrant, now: float) -> pb.GrantReceiveResponse:
    return pb.GrantReceiveResponse(
        token=grant.token, expires_in_seconds=max(0.0, grant.expires_at - now),
        pages=int(grant.pages.shape[0]),
        swa_pages=b"" if grant.swa_pages is None else codec.ids_to_bytes(grant.swa_pages))


def send_response(out: Outgoing, now: float, post_socket: str = "") -> pb.SendResponse:
    """The answer to a Send; ``post_socket`` (the post channel's socket, for callers that can
    reach it) is named for a send held and not posted yet."""
    return pb.SendResponse(transfer_id=out.transfer_id, bytes=out.nbytes,
                           descriptors=out.descriptors, peer_agent=out.peer_agent,
                           status=codec.transfer_status_to_pb(out.status(now)),
                           post_socket=post_socket if out.held is not None else "")


def peer_done_response() -> pb.PeerDoneResponse:
    return pb.PeerDoneResponse()


def cancel_grant_response(status: TransferStatus, freed: int, fenced: int
                          ) -> pb.CancelGrantResponse:
    return pb.CancelGrantResponse(status=codec.transfer_status_to_pb(status),
                                  freed_pages=freed, fenced_pages=fenced)


def _bounded(text: str, limit: int, field: str, what: str) -> str:
    """A string of a request, at most ``limit`` characters (refused, never logged, beyond)."""
    if len(text) > limit:
        raise InvalidArgument(f"{field} has {len(text):,} characters, at most {limit:,} "
                              f"({what})", field=field)
    return text


def grant_args(req: pb.GrantReceiveRequest) -> GrantArgs:
    """A GrantReceive request as typed values (its lease: :func:`lease_ref`); a TTL of 0 is
    DEFAULT_GRANT_TTL_S (its range is the grant table's to check).

    Raises:
        InvalidArgument: pages that are not 1..MAX_GRANT_PAGES whole int32 ids, each once.
    """
    return GrantArgs(pool=req.pool, pages=check_pages(req.pages, "pages"),
                     ttl_s=req.ttl_seconds or DEFAULT_GRANT_TTL_S)


def send_args(req: pb.SendRequest) -> SendArgs | PostArgs:
    """A Send request as typed values (its lease: :func:`lease_ref`): a new send, or the post
    of a held one (``transfer_id`` set).

    Raises:
        InvalidArgument: pages that are not 1..MAX_GRANT_PAGES whole int32 ids, each once; a
            peer that is no address; a token empty or over MAX_TOKEN_BYTES; a wait outside
            0..MAX_WAIT_S, or with hold; hold or a send's fields with transfer_id.
    """
    wait = req.wait_seconds
    if not 0 <= wait <= MAX_WAIT_S:
        raise InvalidArgument(f"wait_seconds {wait} is outside 0..{MAX_WAIT_S:g}",
                              field="wait_seconds")
    if req.transfer_id:
        if req.hold or req.pages or req.peer or req.token:
            raise InvalidArgument(
                "transfer_id posts a held send: leave hold, pages, peer and token unset (the "
                "held send has them)", field="transfer_id")
        return PostArgs(transfer_id=req.transfer_id, wait_s=wait)
    if req.hold and wait:
        raise InvalidArgument("wait_seconds with hold: a held send posts nothing to wait for; "
                              "wait when posting it (transfer_id)", field="wait_seconds")
    return SendArgs(pool=req.pool, pages=check_pages(req.pages, "pages"),
                    peer=check_peer(req.peer), token=check_token(req.token), hold=req.hold,
                    wait_s=wait)


def wait_args(req: pb.WaitTransferRequest) -> WaitArgs:
    """A WaitTransfer request as typed values.

    Raises:
        InvalidArgument: neither or both of transfer_id and token, a token over its bound,
            or a timeout outside 0..MAX_WAIT_S.
    """
    if bool(req.transfer_id) == bool(req.token):
        raise InvalidArgument("give transfer_id (a Send of this daemon) or token (a grant of "
                              "this daemon), one of them", field="transfer_id")
    timeout = req.timeout_seconds
    if not 0 <= timeout <= MAX_WAIT_S:
        raise InvalidArgument(f"timeout_seconds {timeout} is outside 0..{MAX_WAIT_S:g}",
                              field="timeout_seconds")
    return WaitArgs(transfer_id=req.transfer_id,
                    token=check_token(req.token) if req.token else b"", timeout_s=timeout)


def peer_receive_args(req: pb.PeerReceiveRequest) -> PeerReceiveArgs:
    """A PeerReceive request as typed, bounded values.

    Raises:
        InvalidArgument: a token, sender, page count, mask or known registrations over their
            bounds.
    """
    token = check_token(req.token)
    if not 1 <= req.pages <= MAX_GRANT_PAGES:
        raise InvalidArgument(f"pages is {req.pages}; a transfer moves 1..{MAX_GRANT_PAGES}",
                              field="pages")
    if len(req.swa_mask) > MAX_GRANT_PAGES:
        raise InvalidArgument(f"swa_mask has {len(req.swa_mask):,} bytes, at most "
                              f"{MAX_GRANT_PAGES:,} (one per page)", field="swa_mask")
    if len(req.known_generations) > MAX_KNOWN_GENERATIONS:
        raise InvalidArgument(f"known_generations has {len(req.known_generations)} entries, at "
                              f"most {MAX_KNOWN_GENERATIONS}", field="known_generations")
    _check_layout(req.layout)
    return PeerReceiveArgs(
        token=token, layout=req.layout, pages=req.pages,
        swa_mask=req.swa_mask,
        known_agent=_bounded(req.known_agent, MAX_PEER_CHARS, "known_agent", "a NIXL agent name"),
        known_generations=frozenset(req.known_generations),
        sender=_bounded(req.sender, MAX_PEER_CHARS, "sender", "a NIXL agent name") or "?",
        writer=_sender_process(req))


def _sender_process(req: pb.PeerReceiveRequest) -> ProcessId | None:
    """The sender's process as it named it (None when it did not)."""
    if not req.HasField("sender_process"):
        return None
    proc = req.sender_process
    return ProcessId(_bounded(proc.boot_id, MAX_BOOT_ID_CHARS, "sender_process.boot_id",
                              "a boot id"), proc.pid_namespace, proc.pid, proc.start_ticks)


# A page layout's bounds: its names are echoed in refusals, so each is short.
MAX_LAYOUT_BUFFERS = 4096
MAX_LAYOUT_CHARS = 128


def _check_layout(layout: pb.PageLayout) -> None:
    if len(layout.buffers) > MAX_LAYOUT_BUFFERS:
        raise InvalidArgument(f"layout has {len(layout.buffers):,} buffers, at most "
                              f"{MAX_LAYOUT_BUFFERS:,}", field="layout.buffers")
    for name in ("architecture", "kv_cache_dtype"):
        _bounded(getattr(layout, name), MAX_LAYOUT_CHARS, f"layout.{name}", "a plan's value")
    for i, b in enumerate(layout.buffers):
        for name in ("name", "dtype", "kind", "id_space"):
            _bounded(getattr(b, name), MAX_LAYOUT_CHARS, f"layout.buffers[{i}].{name}",
                     "a plan's value")


def peer_receive_response(acc: Acceptance) -> pb.PeerReceiveResponse:
    return pb.PeerReceiveResponse(
        agent=acc.agent, generation=acc.generation, agent_metadata=acc.metadata,
        buffer_addresses=acc.buffer_addresses, pages=codec.ids_to_bytes(acc.pages),
        swa_pages=codec.ids_to_bytes(acc.swa_pages), notification=acc.notification,
        memory=acc.memory, device=acc.device, write_deadline_seconds=acc.write_deadline_s)


def peer_done_args(req: pb.PeerDoneRequest) -> PeerDoneArgs:
    """A PeerDone request as typed, bounded values.

    Raises:
        InvalidArgument: a token or message over its bound.
    """
    return PeerDoneArgs(token=check_token(req.token), ok=req.ok,
                        message=_bounded(req.message, MAX_MESSAGE_CHARS, "message",
                                         "why the write failed"))


def int32_array(data: bytes, field: str, most: int = MAX_IDS_PER_CALL) -> np.ndarray:
    """Little-endian int32 bytes as a read-only array (no copy), at most ``most`` values.

    Raises:
        InvalidArgument: not a whole number of int32 values, or more than ``most``.
    """
    if len(data) % 4:
        raise InvalidArgument(f"{field} has {len(data)} bytes, not a whole number of "
                              "little-endian int32 values (4 bytes each)", field=field)
    if len(data) // 4 > most:
        raise InvalidArgument(f"{field} has {len(data) // 4:,} values, at most {most:,} per "
                              "call; split it", field=field)
    return codec.ids_from_bytes(data)


def seal_args(req: pb.SealRequest) -> tuple[LeaseRef, np.ndarray, bytes, bytes, np.ndarray]:
    """A Seal's lease, page ids, keys, parent keys and tokens (their lengths checked against
    the pool's page size by the pool).

    Raises:
        InvalidArgument: no lease, or arrays that are not int32 or too long.
    """
    ref = lease_ref(req.lease_id, req.lease_secret)
    ids = int32_array(req.page_ids, "page_ids")
    tokens = int32_array(req.tokens, "tokens")
    return ref, ids, req.keys, req.parents, tokens


def unseal_args(req: pb.UnsealRequest) -> tuple[LeaseRef, np.ndarray]:
    """An Unseal's lease and page ids.

    Raises:
        InvalidArgument: no lease, or ids that are not int32 or too many.
    """
    return lease_ref(req.lease_id, req.lease_secret), int32_array(req.page_ids, "page_ids")
