"""KV events on the wire: vLLM 0.32's ZMQ/msgpack format, which KV-aware routers read.

The daemon publishes its sealed-page directories' changes in this format (docs/kv-events.md);
``kvpool events`` decodes it (a vLLM engine's own stream too). Everything here is what the wire
carries, written from vLLM 0.32's ``vllm.distributed.kv_events`` as the specification (its
types decode these bytes unchanged; ``tests/integration/vllm/test_kv_events_wire.py`` checks
that they encode to the same bytes):

- a message on the PUB socket is three frames: the topic (UTF-8), the sequence number (8 bytes,
  big-endian, from 0, one per batch) and a msgpack :class:`KVEventBatch`;
- a batch is an array ``[ts, events, data_parallel_rank]``; each event a map whose ``type`` is
  its class name (``BlockStored``, ``BlockRemoved``, ``AllBlocksCleared``), its fields in
  declaration order, optional fields left out when they hold their default;
- replay: a DEALER (or REQ) socket sends the first sequence number it wants (8 bytes,
  big-endian) to the ROUTER endpoint and receives ``[b"", topic, seq, payload]`` messages, then
  the end marker ``[b"", b"", (-1 as 8 signed bytes), b""]``.

No zmq here: the client's CLI imports pyzmq only when it subscribes.
"""

from __future__ import annotations

from typing import Any

import msgspec

MEDIUM_GPU = "GPU"
MEDIUM_CPU = "CPU"
# The last frame of a replay: an empty topic, sequence -1 (8 signed big-endian bytes), no payload.
END_SEQ = (-1).to_bytes(8, "big", signed=True)
SEQ_BYTES = 8

# A block hash as vLLM publishes it: the engine's hash bytes (sha256: 32 bytes), or a 64-bit int
# with VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES.
BlockHash = bytes | int


class KVCacheEvent(msgspec.Struct, omit_defaults=True, gc=False, tag=True):
    """One change of a KV cache (a map on the wire, ``type`` naming the class)."""


class BlockStored(KVCacheEvent):
    """Blocks now cached: a run of a hash chain (each block's parent is the block before it;
    the first one's is ``parent_block_hash``, None at the start of a sequence), their token ids
    (``block_size`` per block, concatenated)."""

    block_hashes: list[BlockHash]
    parent_block_hash: BlockHash | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list[tuple[Any, ...] | None] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None
    locality: str | None = None
    ownership: str | None = None
    session_id: str | None = None


class BlockRemoved(KVCacheEvent):
    """Blocks no longer cached."""

    block_hashes: list[BlockHash]
    medium: str | None
    group_idx: int | None = None
    locality: str | None = None
    ownership: str | None = None


class AllBlocksCleared(KVCacheEvent):
    """Every block of the publisher (here: of one pool) is gone."""


Event = BlockStored | BlockRemoved | AllBlocksCleared


class KVEventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """One message's events: ``ts`` (seconds since the epoch), the events in order, and the
    data-parallel rank they belong to (kvpool: the pool's rank, docs/kv-events.md)."""

    ts: float
    events: list[Event]
    data_parallel_rank: int | None = None


_decoder = msgspec.msgpack.Decoder(KVEventBatch)


def decode_batch(payload: bytes) -> KVEventBatch:
    """A message's third frame.

    Raises:
        msgspec.DecodeError / msgspec.ValidationError: not a KVEventBatch.
    """
    return _decoder.decode(payload)


def seq_to_bytes(seq: int) -> bytes:
    """A sequence number's frame (8 bytes, big-endian)."""
    return seq.to_bytes(SEQ_BYTES, "big")


def seq_from_bytes(frame: bytes) -> int:
    """A sequence number frame read back; -1 for the replay's end marker."""
    return int.from_bytes(frame, "big", signed=True)
