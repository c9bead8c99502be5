"""kvpool's KV events are vLLM 0.32's bytes: what ``kvpool.contract.kv_events`` encodes, vLLM's own
``vllm.distributed.kv_events`` types decode and encode back to the same bytes; what vLLM encodes
(every optional field set), kvpool's types decode and encode back to the same bytes. Run in the
vLLM side venv (skipped without it; failed under ``KVPOOL_REQUIRE_VLLM=1``)."""

from __future__ import annotations

import subprocess
from pathlib import Path

import msgspec

from kvpool.contract.kv_events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEventBatch,
    decode_batch,
)
from tests.conftest import REPO
from tests.integration.vllm_venv import vllm_env, vllm_python_or_skip

# In the side venv: each payload of argv[1] decoded by vLLM's types and encoded again; then one
# batch of vLLM's own with every field set. Both lists written to argv[2].
VLLM_SIDE = r"""
import sys, msgspec
from vllm.distributed.kv_events import (AllBlocksCleared, BlockRemoved, BlockStored,
                                        KVEventBatch)
payloads = msgspec.msgpack.decode(open(sys.argv[1], "rb").read())
dec, enc = msgspec.msgpack.Decoder(type=KVEventBatch), msgspec.msgpack.Encoder()
again = [enc.encode(dec.decode(p)) for p in payloads]
full = KVEventBatch(ts=12.5, data_parallel_rank=3, events=[
    BlockStored(block_hashes=[b"\x01" * 32, 7], parent_block_hash=b"\x02" * 32,
                token_ids=[1, 2, 3, 4], block_size=2, lora_id=5, medium="GPU",
                lora_name="adapter", extra_keys=[("adapter", ("mm", 0)), None], group_idx=1,
                kv_cache_spec_kind="sliding_window", kv_cache_spec_sliding_window=4096,
                locality="LOCAL", ownership="tier2", session_id="s1"),
    BlockRemoved(block_hashes=[9], medium="CPU", group_idx=2, locality="REMOTE",
                 ownership="tier2"),
    AllBlocksCleared()])
open(sys.argv[2], "wb").write(msgspec.msgpack.encode([again, enc.encode(full)]))
"""


def ours() -> list[KVEventBatch]:
    stored = BlockStored(block_hashes=[bytes(range(32)), b"\xff" * 32], parent_block_hash=None,
                         token_ids=list(range(32)), block_size=16, lora_id=None, medium="CPU",
                         lora_name=None)
    chained = BlockStored(block_hashes=[b"\x07" * 32], parent_block_hash=b"\x08" * 32,
                          token_ids=[70_000 + i for i in range(16)], block_size=16, lora_id=3,
                          medium="GPU", lora_name="sql")
    return [
        KVEventBatch(ts=1_796_000_000.25, events=[stored, chained], data_parallel_rank=0),
        KVEventBatch(ts=2.0, events=[BlockRemoved(block_hashes=[b"\x07" * 32], medium="GPU")],
                     data_parallel_rank=7),
        KVEventBatch(ts=3.0, events=[AllBlocksCleared()], data_parallel_rank=1),
        KVEventBatch(ts=4.0, events=[]),
    ]


def test_vllm_decodes_kvpools_bytes_and_kvpool_decodes_vllms(tmp_path: Path) -> None:
    python = vllm_python_or_skip()
    payloads = [msgspec.msgpack.encode(b) for b in ours()]
    src, dst = tmp_path / "ours.msgpack", tmp_path / "theirs.msgpack"
    src.write_bytes(msgspec.msgpack.encode(payloads))
    proc = subprocess.run([str(python), "-c", VLLM_SIDE, str(src), str(dst)], env=vllm_env(),
                          cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    again, full = msgspec.msgpack.decode(dst.read_bytes())
    assert again == payloads  # vLLM's types read every field and write the same bytes
    batch = decode_batch(full)
    assert msgspec.msgpack.encode(batch) == full
    stored, removed, cleared = batch.events
    assert isinstance(stored, BlockStored) and stored.block_hashes == [b"\x01" * 32, 7]
    assert stored.extra_keys == [("adapter", ["mm", 0]), None] and stored.session_id == "s1"
    assert isinstance(removed, BlockRemoved) and removed.ownership == "tier2"
    assert isinstance(cleared, AllBlocksCleared) and batch.data_parallel_rank == 3
