"""Sealed pages of a vLLM-layout pool (issue 40): a real ``kvpoold serve``, an engine in a child
process that maps a pool planned as vLLM 0.32's KV cache (one int8 region; block ``b`` of layer
``l`` at ``offset + l * layer_stride + b * block_stride``), writes every layer's page of its
blocks, and seals them.

The CPU checksum covers every byte of a block in every layer: after the engine is killed, its
blocks are adopted with the bytes it wrote; a byte written after sealing into the *last*
layer's page of a block (far from the block's first layer) is found at adoption and that block
freed. A hybrid vLLM pool (sliding-window groups) refuses Seal, naming why.
"""

from __future__ import annotations

import hashlib
import signal
import time

import numpy as np
import pytest

from kvpool.clients.client import KVPoolClient
from kvpool.contract.errors import FailedPrecondition
from tests.conftest import REPO, run_daemon, temp_dir
from tests.procs import Child

LAYOUT = "vllm-test sha256 tp0"
TTL_S = 1.0
BLOCK = 32
TINY_LLAMA = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 128,
    "intermediate_size": 256, "num_attention_heads": 4, "num_key_value_heads": 2,
    "num_hidden_layers": 3, "vocab_size": 256, "max_position_embeddings": 256,
    "rms_norm_eps": 1e-5, "torch_dtype": "float32",
}
VLLM = {"kv_cache_memory_bytes": 1 << 20, "block_size": BLOCK, "max_model_len": 256}

# The engine: lease, attach (registering this process), allocate blocks, write each layer's
# page of each block (value = block id + layer), seal them as a hash chain, answer, idle.
ENGINE = r"""
import hashlib
import numpy as np
from kvpool.clients.client import KVPoolClient

msg = recv()
client = KVPoolClient(msg["target"])
lease = client.lease("vllm-engine", ttl_s=msg["ttl_s"])
region = client.attach(msg["pool"], lease=lease).__enter__()
plan = region.plan
backing = region[plan.buffers[0].name].numpy()
pages = {x.name: x.page_size_padded or x.page_size_bytes for x in plan.vllm.layers}
blocks = lease.allocate(msg["pool"], "kv", msg["n"])
keys, parents, tokens = [], [], []
parent = bytes(32)
for i, b in enumerate(blocks.tolist()):
    for t in plan.vllm.tensors:
        for l, name in enumerate(t.layers):
            start = t.offset + l * t.layer_stride + b * t.block_stride
            backing[start:start + pages[name]] = (b + l) % 120
    toks = np.arange(i * plan.page_size, (i + 1) * plan.page_size, dtype=np.int32)
    key = hashlib.sha256(parent + toks.tobytes()).digest()
    keys.append(key)
    parents.append(parent)
    tokens.append(toks)
    parent = key
sealed = lease.seal(msg["pool"], msg["layout"], blocks, keys, parents, np.concatenate(tokens))
send({"blocks": blocks.tolist(), "sealed": sealed, "lease_id": lease.lease_id})
recv()
"""


@pytest.fixture
def daemon():  # type: ignore[no-untyped-def]
    with temp_dir() as sock_dir, temp_dir("kvp-shm-", "/dev/shm") as shm, \
            run_daemon(sock_dir, "--shm-dir", str(shm)) as d, KVPoolClient(d.target) as client:
        yield d, client


def wait_lease_gone(client: KVPoolClient, lease_id: int) -> None:
    deadline = time.monotonic() + 60  # a ceiling for a hang only
    while any(x.lease_id == lease_id for x in client.stats().leases):
        assert time.monotonic() < deadline, "the engine's lease never expired"
        time.sleep(0.05)


def block_bytes(region, block: int) -> list[np.ndarray]:  # type: ignore[no-untyped-def]
    """Block ``block``'s page in every layer of every KV-cache tensor."""
    plan = region.plan
    backing = region[plan.buffers[0].name].numpy()
    pages = {x.name: x.page_size_padded or x.page_size_bytes for x in plan.vllm.layers}
    return [backing[t.offset + i * t.layer_stride + block * t.block_stride:][:pages[name]]
            for t in plan.vllm.tensors for i, name in enumerate(t.layers)]


def test_a_vllm_pools_blocks_are_sealed_over_every_layer_and_adopted(daemon) -> None:  # type: ignore[no-untyped-def]
    d, client = daemon
    made = client.configure("vl", hf_config=TINY_LLAMA, vllm=VLLM)
    assert made.plan.vllm is not None and len(made.plan.vllm.groups) == 1
    engine = Child(ENGINE, timeout_s=60)
    engine.send({"target": d.target, "pool": "vl", "n": 6, "ttl_s": TTL_S, "layout": LAYOUT})
    got = engine.recv()
    assert got["sealed"] == 6
    engine.proc.send_signal(signal.SIGKILL)
    engine.proc.wait(30)
    wait_lease_gone(client, got["lease_id"])
    blocks = got["blocks"]
    bad = blocks[4]
    with client.lease("stray", ttl_s=30) as lease, client.attach("vl", lease=lease) as region:
        last = block_bytes(region, bad)[-1]  # the last layer's page of one block
        last[-1] = 121  # a write the block's first layer never sees
    with client.lease("next", ttl_s=30) as lease, client.attach("vl", lease=lease) as region:
        a = lease.adopt("vl", LAYOUT)
        assert a.corrupt == 1 and bad not in a.ids.tolist()
        assert sorted(a.ids.tolist()) == sorted(b for b in blocks if b != bad)
        for b in a.ids.tolist():  # every layer's page as the dead engine wrote it, zero-copy
            for layer, page in enumerate(block_bytes(region, b)):
                assert bool((page == (b + layer) % 120).all())
    assert client.sealed("vl").corrupt_total == 1


def test_a_hybrid_vllm_pool_refuses_seal_naming_why(daemon) -> None:  # type: ignore[no-untyped-def]
    _d, client = daemon
    gemma = REPO / "tests/data/models/gemma-3-1b-it.json"
    made = client.configure("hy", hf_config=gemma,
                            vllm={"kv_cache_memory_bytes": 48 << 20, "max_model_len": 1024})
    assert made.plan.vllm is not None and len(made.plan.vllm.groups) > 1
    with client.lease("e", ttl_s=30) as lease:
        ids = lease.allocate("hy", "kv", 1)
        page = made.plan.page_size
        with pytest.raises(FailedPrecondition, match=r"hybrid.*sliding_window.*one "
                                                     r"full-attention KV-cache group"):
            lease.seal("hy", LAYOUT, ids, [hashlib.sha256(b"x").digest()], [bytes(32)],
                       np.zeros(page, dtype=np.int32))
    assert client.sealed("hy").sealed_total == 0
    # An attention-free model's pool (one Mamba group, no KV) says that instead.
    client.drop("hy")
    mamba = REPO / "tests/integration/synthetic_configs/mamba-130m.json"
    made = client.configure("states", hf_config=mamba,
                            vllm={"kv_cache_memory_bytes": 48 << 20, "max_model_len": 1024})
    with client.lease("e", ttl_s=30) as lease:
        ids = lease.allocate("states", "kv", 1)
        with pytest.raises(FailedPrecondition, match=r"holds no full-attention KV \(1 mamba"):
            lease.seal("states", LAYOUT, ids, [hashlib.sha256(b"x").digest()], [bytes(32)],
                       np.zeros(made.plan.page_size or 1, dtype=np.int32))
