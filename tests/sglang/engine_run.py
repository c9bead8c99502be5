"""Run SGLang 0.5.23's real ``Engine`` on CPU, with or without kvpool's plugin, for the tests in
``tests/integration/sglang/`` (side venv only: ``.venv-sglang/bin/python``, ``stubs/`` on
``PYTHONPATH``).

    engine_run.py make-model DIR [--seed 0] [--wide]  # a tiny random Llama (config.json,
        [--layers N --kv-heads N --head-dim N]    # safetensors); --wide: 8 KV heads of 128
    engine_run.py engine < job.json           # start an engine, generate, report, shut down
    engine_run.py pools < job.json            # build kvpool's pool classes directly (build_pools)
    engine_run.py serve ARGS...               # python -m sglang.launch_server ARGS...

An engine job (one line of JSON on stdin)::

    {"model": DIR, "page_size": 4, "max_total_tokens": 512, "max_new_tokens": 8,
     "batches": [[[1, 2, 3], [4, 5]], [[1, 2, 3]]],   # generate() calls, in order
     "baseline": false,     # true: SGLang's own KV pool and allocator (kvpool's hooks off)
     "sglang_allocator": false,  # true: kvpool's pools with SGLang's allocator (debugging)
     "dump": "PATH",        # the scheduler writes what its radix cache holds there
     "hold": true,          # wait for a line on stdin before shutting down
     "pause": true,         # wait for a line on stdin before each batch after the first
     "leak_check": "PATH"}  # after the dump: SGLang's idle checks around a leaked page

Progress goes to stdout as lines ``HARNESS {json}`` (events ``started``, ``batch``,
``paused``, ``generated``, ``dumped``, ``leak_checked``, ``holding``, ``shutdown``; ``pool``
for pool jobs); SGLang's log goes to stderr. Generation is greedy with ``ignore_eos``: every
request makes ``max_new_tokens``.

The scheduler runs in a process SGLang spawns; multiprocessing imports this file there as
``__mp_main__``, which installs two test-only hooks in that process (never in kvpool itself):
the scheduler RPC ``kvpool_harness_dump`` (``Engine.collective_rpc``) that writes the dump, and a
recorder of the token locations SGLang's ``set_kv_buffer`` writes. In baseline runs the same
import turns kvpool's pool and allocator hooks off, so the baseline is the same platform and
engine with SGLang's own memory.
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

from stub_probes import hide_stubs  # beside this script

BASELINE_ENV = "KVPOOL_HARNESS_BASELINE"
SGLANG_ALLOCATOR_ENV = "KVPOOL_HARNESS_SGLANG_ALLOCATOR"
# Token locations written through set_kv_buffer (first layer of the pool), in this process.
_written: list[Any] = []


def emit(event: str, **fields: Any) -> None:
    print("HARNESS " + json.dumps({"event": event, **fields}), flush=True)


# -- the tiny model ------------------------------------------------------------------------------

def make_model(directory: Path, seed: int, layers: int = 2, kv_heads: int = 2,
               head_dim: int | None = None, wide: bool = False) -> None:
    """A Llama with hidden 64, 2 layers, 4 heads, 2 KV heads, vocab 256, float32 weights;
    ``layers``, ``kv_heads`` and ``head_dim`` change its KV layout, not its compute (the heads
    are as many as the KV heads, at least 4; ``head_dim`` is set apart from the hidden size);
    ``wide``: 8 heads and 8 KV heads of 128 (4 KiB of K per token and layer, so an elastic
    pool's 2 MiB chunks hold 512 tokens), 1,024 positions."""
    hide_stubs()
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    if wide:
        kv_heads, head_dim = 8, 128
    heads = {"num_attention_heads": max(4, kv_heads), "num_key_value_heads": kv_heads,
             "max_position_embeddings": 1024 if wide else 256}
    if head_dim is not None:
        heads["head_dim"] = head_dim
    config = LlamaConfig(
        hidden_size=64, intermediate_size=128, num_hidden_layers=layers, vocab_size=256,
        tie_word_embeddings=False, bos_token_id=1, eos_token_id=2, pad_token_id=0,
        torch_dtype="float32", **heads,
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config).to(torch.float32)
    # Larger than the default init (std 0.02) so greedy picks are far from ties.
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(0.0, 0.2)
    directory.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(directory, safe_serialization=True)
    emit("model", path=str(directory), files=sorted(p.name for p in directory.iterdir()))


# -- hooks in the scheduler process ---------------------------------------------------------------

def _tensor_hash(t: Any) -> str:
    return hashlib.sha256(t.contiguous().cpu().numpy().tobytes()).hexdigest()


def _dump(scheduler: Any, path: str) -> None:
    """Write what the scheduler's radix cache holds (token locations, and a hash of their K/V
    rows per layer as the scheduler sees them), where its KV pool was written, and its
    binding to kvpool."""
    import torch

    from kvpool.integrations.sglang.daemon_pool import engine_settings

    pool = scheduler.tp_worker.model_runner.token_to_kv_pool
    allocator = scheduler.token_to_kv_pool_allocator
    tree = scheduler.tree_cache
    held = tree.all_values_flatten() if tree.total_size() else torch.empty(0, dtype=torch.int64)
    held = torch.sort(held.to(torch.int64).cpu()).values
    written = (torch.unique(torch.cat([w.to(torch.int64).cpu() for w in _written]))
               if _written else torch.empty(0, dtype=torch.int64))
    layers = []
    for i in range(pool.layer_num):
        k, v = pool.k_buffer[i], pool.v_buffer[i]
        layers.append({"layer": pool.start_layer + i, "k_sha256": _tensor_hash(k[held]),
                       "v_sha256": _tensor_hash(v[held]), "shape": list(k.shape),
                       "dtype": str(k.dtype).removeprefix("torch.")})
    binding = getattr(pool, "kvpool_binding", None)
    configured = getattr(pool, "kvpool_configured", None)
    dump = {
        "pid": os.getpid(),
        "pool_class": f"{type(pool).__module__}.{type(pool).__qualname__}",
        "allocator_class": f"{type(allocator).__module__}.{type(allocator).__qualname__}",
        "platform_class": type(_platform()).__qualname__,
        "size": int(pool.size), "page_size": int(pool.page_size),
        "available_size": int(allocator.available_size()),
        "elastic": None if not getattr(allocator, "elastic", False) else {
            "live_available_size": int(allocator.live_available_size()),
            "cached": int(allocator.cache.core.cached), "in_use": int(allocator.pages_in_use),
            "low_pages": int(allocator.elastic.low_pages),
            "pages_per_group": int(allocator.elastic.pages_per_group)},
        "held_locs": held.tolist(), "written_locs": written.tolist(), "layers": layers,
        "max_running_requests": int(scheduler.max_running_requests),
        "kvpool": None if binding is None else {
            "settings": dataclasses.asdict(engine_settings()),
            "plan_max_running_requests": configured.plan.max_running_requests,
            "plan_context_length": configured.plan.context_length,
            "pool": binding.pool, "lease_id": int(binding.lease.lease_id),
            "lease_name": binding.lease_name, "created": bool(configured.created),
            "fingerprint": configured.fingerprint,
        },
    }
    Path(path).write_text(json.dumps(dump))


def _leak_check(scheduler: Any, path: str) -> None:
    """SGLang's idle checks (its token identity, then the allocator's
    ``verify_byte_accounting``) at rest, with one page taken and never returned, and after it
    was returned; the page is returned before this returns, so the scheduler's own idle check
    finds the pool as it was."""
    allocator = scheduler.token_to_kv_pool_allocator
    checker = scheduler.invariant_checker

    def check() -> dict[str, Any]:
        leak, messages = checker._check_all_pools(
            scheduler.pool_stats_observer.get_pool_stats())
        return {"sglang_leak": bool(leak), "sglang": messages,
                "kvpool": list(allocator.verify_byte_accounting()),
                "available_size": int(allocator.available_size()),
        "elastic": None if not getattr(allocator, "elastic", False) else {
            "live_available_size": int(allocator.live_available_size()),
            "cached": int(allocator.cache.core.cached), "in_use": int(allocator.pages_in_use),
            "low_pages": int(allocator.elastic.low_pages),
            "pages_per_group": int(allocator.elastic.pages_per_group)},
                "live_available_size": int(getattr(allocator, "live_available_size",
                                                   allocator.available_size)())}

    out = {"at_rest": check()}
    loc = allocator.alloc(allocator.page_size)  # the leak
    out["leaked"] = check()
    allocator.free(loc)
    out["returned"] = check()
    Path(path).write_text(json.dumps(out))


def _platform() -> Any:
    from sglang.srt.platforms import current_platform

    return current_platform


def _install_hooks() -> None:
    """Test-only hooks in this process: the dump RPC, the write recorder, the baseline switch."""
    from sglang.srt.managers.scheduler import Scheduler
    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool, unwrap_write_loc

    def kvpool_harness_dump(self: Any, path: str) -> None:
        _dump(self, path)

    Scheduler.kvpool_harness_dump = kvpool_harness_dump

    def kvpool_harness_leak_check(self: Any, path: str) -> None:
        _leak_check(self, path)

    Scheduler.kvpool_harness_leak_check = kvpool_harness_leak_check

    original = MHATokenToKVPool.set_kv_buffer

    def set_kv_buffer(self: Any, layer: Any, loc_info: Any, *args: Any, **kwargs: Any) -> Any:
        layer_id = kwargs.get("layer_id_override")
        if (layer_id if layer_id is not None else layer.layer_id) == self.start_layer:
            _written.append(unwrap_write_loc(loc_info)[0].detach().clone())
        return original(self, layer, loc_info, *args, **kwargs)

    MHATokenToKVPool.set_kv_buffer = set_kv_buffer

    if os.environ.get(BASELINE_ENV) == "1":
        from kvpool.integrations.sglang import platform

        platform.KVPoolHooks.get_kv_pool_cls = lambda self, *, kind: None  # type: ignore
        platform.KVPoolHooks.get_paged_allocator_cls = lambda self: None  # type: ignore
    elif os.environ.get(SGLANG_ALLOCATOR_ENV) == "1":
        from kvpool.integrations.sglang import platform

        platform.KVPoolHooks.get_paged_allocator_cls = lambda self: None  # type: ignore


if __name__ == "__mp_main__":
    hide_stubs()
    _install_hooks()


# -- the engine ---------------------------------------------------------------------------------

def engine_kwargs(job: dict[str, Any]) -> dict[str, Any]:
    """The flags that run SGLang's engine on this CPU (docs: platform-notes)."""
    return {
        "model_path": job["model"], "device": "cpu", "attention_backend": "torch_native",
        "skip_tokenizer_init": True, "disable_cuda_graph": True, "dtype": "float32",
        "sampling_backend": "pytorch", "grammar_backend": "none",
        "disable_overlap_schedule": True, "page_size": job.get("page_size", 4),
        "max_total_tokens": job["max_total_tokens"], "mem_fraction_static": 0.05,
        "random_seed": 0, "log_level": job.get("log_level", "warning"),
        **job.get("extra", {}),
    }


def run_engine(job: dict[str, Any]) -> None:
    hide_stubs()
    if job.get("baseline"):
        os.environ[BASELINE_ENV] = "1"
    if job.get("sglang_allocator"):
        os.environ[SGLANG_ALLOCATOR_ENV] = "1"
    import sglang

    start = time.monotonic()
    engine = sglang.Engine(**engine_kwargs(job))
    emit("started", seconds=round(time.monotonic() - start, 1), pid=os.getpid())
    params = {"temperature": 0.0, "max_new_tokens": job.get("max_new_tokens", 8),
              "ignore_eos": True}
    try:
        outputs = []
        for i, batch in enumerate(job["batches"]):
            if i and job.get("pause"):
                emit("paused", batch=i)
                sys.stdin.readline()
            t0 = time.monotonic()
            results = engine.generate(input_ids=batch, sampling_params=params)
            for prompt, result in zip(batch, results, strict=True):
                meta = result["meta_info"]
                outputs.append({"input_ids": prompt, "output_ids": result["output_ids"],
                                "cached_tokens": meta.get("cached_tokens", 0),
                                "finish_reason": meta.get("finish_reason"),
                                "prompt_tokens": meta.get("prompt_tokens")})
            emit("batch", seconds=round(time.monotonic() - t0, 2), size=len(batch))
        emit("generated", outputs=outputs)
        if job.get("dump"):
            engine.collective_rpc("kvpool_harness_dump", path=job["dump"])
            emit("dumped", path=job["dump"])
        if job.get("leak_check"):
            engine.collective_rpc("kvpool_harness_leak_check", path=job["leak_check"])
            emit("leak_checked", path=job["leak_check"])
        if job.get("hold"):
            emit("holding")
            sys.stdin.readline()
    finally:
        t0 = time.monotonic()
        engine.shutdown()
        emit("shutdown", seconds=round(time.monotonic() - t0, 1))


# -- pool classes built directly (MLA / DSA, which the CPU engine cannot run) ---------------------

DTYPES = {"float32": "float32", "bfloat16": "bfloat16", "float16": "float16",
          "fp8_e4m3": "float8_e4m3fn", "fp8_e5m2": "float8_e5m2"}


def build_pools(job: dict[str, Any]) -> None:
    """Build kvpool's pool classes with SGLang's constructor arguments, outside an engine.

    Each case: ``kind`` (mha, mla, dsa), ``pool`` (KVPOOL_POOL), ``model`` (a directory with
    config.json), ``dtype`` (a kvpool KV dtype name), ``args`` (the class's keyword arguments
    besides ``dtype``, ``device`` and ``enable_memory_saver``), ``settings`` (EngineSettings
    fields besides the model path: what an engine would have resolved), ``env`` (environment
    variables set for this case only, e.g. ``KVPOOL_ELASTIC``). A built pool writes
    ``marker`` into row ``page_size`` (page 1) of its first layer's buffers through the tensors
    SGLang uses, then ends its binding (the pool stays in the daemon).
    """
    hide_stubs()
    import torch
    from sglang.srt.runtime_context import get_parallel

    from kvpool.integrations.sglang import daemon_pool, pools

    for case in job["cases"]:
        settings = daemon_pool.EngineSettings(model_path=case["model"], **case.get("settings", {}))
        daemon_pool.engine_settings = lambda settings=settings: settings  # type: ignore[misc]
        os.environ["KVPOOL_POOL"] = case["pool"]
        for name in ("KVPOOL_ELASTIC", "KVPOOL_ELASTIC_FLOOR_TOKENS"):
            os.environ.pop(name, None)
        os.environ.update(case.get("env", {}))
        cls = pools.pool_class(case["kind"])
        dtype = getattr(torch, DTYPES[case["dtype"]])
        try:
            # DSA reads the decode-context-parallel width, which an engine publishes.
            with get_parallel().override(attn_dcp_size=1):
                pool = cls(dtype=dtype, device="cpu", enable_memory_saver=False, **case["args"])
        except Exception as exc:
            emit("pool", id=case["id"], ok=False, error=f"{type(exc).__name__}: {exc}")
            continue
        buffers: dict[str, Any] = {}
        if case["kind"] == "mha":
            named = {"k": pool.k_buffer, "v": pool.v_buffer}
        else:
            named = {"kv": pool.kv_buffer}
            if case["kind"] == "dsa":
                named["index_k"] = pool.index_key_cache.buffer
        marker = float(case.get("marker", 7))
        for prefix, tensors in named.items():
            for i, t in enumerate(tensors):
                buffers[f"{prefix}.{pool.start_layer + i}"] = {
                    "shape": list(t.shape), "dtype": str(t.dtype).removeprefix("torch.")}
            row = tensors[0][pool.page_size] if prefix != "index_k" else tensors[0][1]
            row.fill_(int(marker) if row.dtype == torch.uint8 else marker)
        configured = pool.kvpool_configured
        emit("pool", id=case["id"], ok=True, cls=type(pool).__qualname__,
             created=configured.created, elastic=configured.plan.elastic is not None,
             fingerprint=configured.fingerprint,
             store_dtype=str(pool.store_dtype).removeprefix("torch."), buffers=buffers)
        pool.kvpool_binding.close()


# -- SGLang's HTTP server ------------------------------------------------------------------------

def serve(argv: list[str]) -> None:
    """``python -m sglang.launch_server ARGV``, after hiding the stubs from the probes.

    The module runs as ``__main__`` without replacing this one in ``sys.modules``, so SGLang's
    spawned processes import this file as ``__mp_main__`` and hide the stubs there too.
    """
    import runpy

    hide_stubs()
    sys.argv = ["sglang.launch_server", *argv]
    runpy.run_module("sglang.launch_server", run_name="__main__", alter_sys=False)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["serve"]:  # everything after it is SGLang's
        serve(argv[1:])
        return 0
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="cmd", required=True)
    model = sub.add_parser("make-model", help="write the tiny random Llama")
    model.add_argument("directory", type=Path)
    model.add_argument("--seed", type=int, default=0)
    model.add_argument("--layers", type=int, default=2)
    model.add_argument("--kv-heads", type=int, default=2)
    model.add_argument("--head-dim", type=int, default=None)
    model.add_argument("--wide", action="store_true")
    sub.add_parser("engine", help="run an engine job (JSON on stdin)")
    sub.add_parser("pools", help="build pool classes directly (JSON on stdin)")
    sub.add_parser("serve", help="python -m sglang.launch_server ARGS...")
    args = parser.parse_args(argv)
    if args.cmd == "make-model":
        make_model(args.directory, args.seed, args.layers, args.kv_heads, args.head_dim,
                   args.wide)
    elif args.cmd == "engine":
        run_engine(json.loads(sys.stdin.readline()))
    else:
        build_pools(json.loads(sys.stdin.readline()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
