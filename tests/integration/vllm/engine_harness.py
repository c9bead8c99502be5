"""vLLM 0.32's engine (CPU, a tiny Llama with dummy weights) with or without ``KVPoolScheduler``,
in the vLLM side venv.

Run by ``tests/integration/vllm/test_engine_scheduler.py`` (never by pytest itself)::

    engine_harness.py --scheduler kvpool --target unix:///tmp/x/kvpool.sock --out r.json

It writes the greedy output tokens of a few prompts (two share a prefix longer than a block)
and vLLM's prefix-cache hits. With ``--scheduler kvpool`` it first configures the pool (page
size = vLLM's block size, ``kv`` pages = ``--num-blocks - 1``), runs the engine in this process
(``VLLM_ENABLE_V1_MULTIPROCESSING=0``) with ``scheduler_cls`` set to the dotted name, and also
writes the block pool's class and its free-block queue's, the daemon's Stats of the engine's
lease after the prompts (the blocks held are the prefix-cached ones and the page cache's
spare; none in use by a request), and after the engine's shutdown whether the lease is gone
and the pages back.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import tempfile
from typing import Any

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"

TINY_LLAMA = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 128,
    "intermediate_size": 256, "num_attention_heads": 4, "num_key_value_heads": 2,
    "num_hidden_layers": 2, "vocab_size": 512, "max_position_embeddings": 1024,
    "rms_norm_eps": 1e-5, "torch_dtype": "float32", "tie_word_embeddings": False,
}
SPEC: dict[str, Any] = {"num_layers": 2, "attention": {"type": "mha", "num_kv_heads": 2,
                                                        "head_dim": 32},
                        "context_length": 1024}
POOL = "vengine"
SCHEDULER = "kvpool.integrations.vllm.scheduler.KVPoolScheduler"


def prompts() -> list[list[int]]:
    shared = [(7 * i + 3) % 500 + 1 for i in range(300)]
    return [[*shared, 11, 12, 13], [*shared, 21, 22], [(5 * i) % 500 + 1 for i in range(40)]]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--scheduler", choices=("vllm", "kvpool"), required=True)
    ap.add_argument("--target", default="")
    ap.add_argument("--num-blocks", type=int, default=24)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()

    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    out: dict[str, Any] = {"scheduler": args.scheduler}
    model_dir = tempfile.mkdtemp(prefix="kvpool-vllm-engine-")
    try:
        with open(os.path.join(model_dir, "config.json"), "w") as f:
            json.dump(TINY_LLAMA, f)
        extra: dict[str, Any] = {}
        client = None
        if args.scheduler == "kvpool":
            from kvpool.clients.client import KVPoolClient

            client = KVPoolClient(args.target)
            os.environ.update(KVPOOL_TARGET=args.target, KVPOOL_POOL=POOL,
                              KVPOOL_LEASE_TTL_S="30")
            extra["scheduler_cls"] = SCHEDULER
        if client is not None:
            # The pool must exist before vLLM builds its scheduler: its page size is vLLM's
            # block size, which the CPU platform picks (128); ask vLLM's config for it.
            from vllm.engine.arg_utils import EngineArgs

            probe = EngineArgs(model=model_dir, skip_tokenizer_init=True, enforce_eager=True,
                               load_format="dummy", max_model_len=512).create_engine_config()
            block_size = int(probe.cache_config.block_size)
            client.configure(POOL, spec=SPEC, max_total_tokens=(args.num_blocks - 1)
                             * block_size, page_size=block_size, max_running_requests=4)
            out["block_size"] = block_size
        llm = LLM(model=model_dir, skip_tokenizer_init=True, dtype="float32",
                  enforce_eager=True, load_format="dummy", max_model_len=512, max_num_seqs=4,
                  max_num_batched_tokens=512, num_gpu_blocks_override=args.num_blocks,
                  enable_prefix_caching=True, seed=0, **extra)
        params = SamplingParams(max_tokens=8, temperature=0.0, detokenize=False)
        tokens: list[list[int]] = []
        for p in prompts():  # one at a time: the second hits the first's cached prefix
            (result,) = llm.generate([TokensPrompt(prompt_token_ids=p)], params,
                                     use_tqdm=False)
            tokens.append(list(result.outputs[0].token_ids))
            out.setdefault("cached_tokens", []).append(result.num_cached_tokens)
        out["tokens"] = tokens
        core = llm.llm_engine.engine_core.engine_core
        sched = core.scheduler
        out["scheduler_class"] = type(sched).__name__
        block_pool = sched.kv_cache_manager.block_pool
        out["block_pool"] = type(block_pool).__name__
        out["free_queue"] = type(block_pool.free_block_queue).__name__
        if client is not None:
            bp = sched.kvpool_blocks
            binding = sched.kvpool_binding
            bp.cache.settle(10.0)
            binding.lease.report_now()
            stats = client.stats(POOL)
            mine = next(s for s in stats.leases if s.lease_id == binding.lease.lease_id)
            out["lease"] = {"name": mine.name, "held": mine.held.get(POOL, {}).get("kv", 0),
                            "in_use": mine.in_use(POOL), "queue": bp.held_free,
                            "blocks_in_use": bp.blocks_in_use, "spare": int(bp.cache.core.cached)}
            lease_id = binding.lease.lease_id
            core.shutdown()
            after = client.stats(POOL)
            out["lease_gone"] = all(s.lease_id != lease_id for s in after.leases)
            out["used_after_shutdown"] = after.pool(POOL).spaces["kv"].used
            client.close()
    finally:
        shutil.rmtree(model_dir, ignore_errors=True)
    with open(args.out, "w") as f:
        json.dump(out, f)


if __name__ == "__main__":
    main()
