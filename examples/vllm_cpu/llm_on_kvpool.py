"""vLLM 0.32's offline ``LLM`` on CPU, its KV cache and block ids in a kvpool pool (run.sh runs it).

    KVPOOL_TARGET=unix:///tmp/x/kvpool.sock KVPOOL_POOL=tiny python llm_on_kvpool.py MODEL_DIR

Two settings put vLLM on kvpool, and nothing else changes (no patch to vLLM):
``kv_transfer_config`` selects ``KVPoolConnector`` (vLLM's K/V tensors become views of the
daemon's pool ``$KVPOOL_POOL``, which the connector configures from vLLM's own config and
checks against vLLM's plan) and ``scheduler_cls`` names ``KVPoolScheduler`` (vLLM's free
blocks come from the engine core's lease in that pool). Both are registered in every vLLM
process by kvpool's ``vllm.general_plugins`` entry point, which the side venv installs.

vLLM starts its engine core in a spawned process, which imports this file again as
``__mp_main__``: the ``if __name__ == "__main__":`` guard below keeps that import from
starting a second engine.

The engine generates from two prompts sharing a 40-token prefix (greedy, 8 new tokens; the
tiny model has no tokenizer, so prompts and outputs are token ids), one after the other, so
the second one finds the prefix's first block (32 tokens) in vLLM's prefix cache. It prints
one line per prompt, then ``engine running`` and keeps the engine up until a line (or end of
file) on stdin, so run.sh can show what the daemon holds; then it shuts the engine down.
"""

from __future__ import annotations

import sys

BLOCK_SIZE = 32  # tokens per block (vLLM's CPU attention takes 32)
KV_CACHE_BYTES = 1 << 20  # 32 blocks of 32 KiB for the tiny model: the pool's size
PREFIX = list(range(3, 43))  # 40 tokens: one full block, cached once computed
PROMPTS = [[*PREFIX, 50, 51, 52], [*PREFIX, 60, 61, 62, 63]]
MAX_NEW_TOKENS = 8


def main(model: str) -> int:
    """Start the engine on the pool, generate, wait for stdin, shut down.

    Args:
        model: the model directory (a config.json and safetensors weights).

    Returns:
        0.
    """
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    llm = LLM(
        model=model, skip_tokenizer_init=True, dtype="float32", enforce_eager=True,
        max_model_len=256, max_num_seqs=4, max_num_batched_tokens=256, block_size=BLOCK_SIZE,
        # A pool has a fixed size, so vLLM must be told its KV cache's, not profile for one.
        kv_cache_memory_bytes=KV_CACHE_BYTES, enable_prefix_caching=True, seed=0,
        kv_transfer_config={"kv_connector": "KVPoolConnector", "kv_role": "kv_both"},
        scheduler_cls="kvpool.integrations.vllm.scheduler.KVPoolScheduler",
    )
    params = SamplingParams(max_tokens=MAX_NEW_TOKENS, temperature=0.0, ignore_eos=True,
                            detokenize=False)
    for i, prompt in enumerate(PROMPTS, 1):
        (out,) = llm.generate([TokensPrompt(prompt_token_ids=prompt)], params, use_tqdm=False)
        print(f"prompt {i} ({len(prompt)} tokens, {out.num_cached_tokens or 0} from vLLM's "
              f"prefix cache) -> output_ids {list(out.outputs[0].token_ids)}", flush=True)
    print("engine running", flush=True)
    sys.stdin.readline()
    llm.llm_engine.engine_core.shutdown()
    print("engine stopped", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
