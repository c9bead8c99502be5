"""Run vLLM 0.32's own KV-cache sizing on CPU for a batch of cases; print one JSON line each.

Runs in the vLLM side venv (tests/vllm/setup_venv.sh), never in kvpool's. Reads a JSON list of
cases on stdin::

    [{"id": "llama-1g", "config": "/path/config.json", "kv_cache_memory_bytes": 1073741824,
      "block_size": 128, "max_model_len": 4096, "tp_size": 1, "pp_size": 1,
      "kv_cache_dtype": "auto", "num_gpu_blocks_override": null,
      "disable_hybrid_kv_cache_manager": false, "max_num_batched_tokens": null,
      "async_scheduling": false, "mamba_ssm_cache_dtype": "auto",
      "cpu_avx512_bf16": "auto", "entrypoint": "llm"}, ...]

``entrypoint`` ``"llm"`` (the default) builds the engine config as ``LLM(...)`` does, ``"serve"``
as ``vllm serve`` does (their usage contexts pick the default ``max_num_batched_tokens``).

vLLM always sees a CPU without AMX tiles (its reference CPU_MLA kernel, which kvpool's CPU
profile plans; a host with AMX would get an AMX MLA backend), and ``VLLM_KIMI_K3_GEMM_AR=0``
(a kernel choice whose module needs CUDA's cutlass DSL).

``cpu_avx512_bf16`` ``"yes"`` or ``"no"`` has vLLM's CPU platform see a CPU with or without
AVX-512 BF16 for that case (it answers ``torch.cpu._is_avx512_bf16_supported()`` so while the
engine config is made, which is where vLLM asks; it decides the SSM state dtype of
linear-attention layers); ``"auto"`` (the default) leaves this host's answer.

For each case it builds the engine's ``VllmConfig`` (``EngineArgs.create_engine_config``, as
``LLM(...)`` does), instantiates the model on the meta device (no weights, no memory) and asks
every attention layer for its ``KVCacheSpec`` the way the model runner's
``get_kv_cache_spec`` does (``customize_attention_spec`` included; before that, as the
executor does after loading the model, the platform's ``update_block_size_for_backend``),
resolves the KV-cache layout from the layers' backends as the engine core does, then calls
``get_kv_cache_configs`` with one spec dict per pipeline stage. vLLM inspects each model class
in a child process (to keep CUDA out of the parent); on CPU there is nothing to keep out, so
the harness inspects in-process, which saves a vLLM import per architecture. Tensor
parallelism cannot instantiate more than one rank in one process: the TP=1 layers are built
and their KV heads set to ``ModelConfig.get_num_kv_heads(parallel_config)`` (vLLM's own
per-rank rule); the pipeline stages are the layers ``get_pp_indices`` gives each rank.

Prints ``{"id", "ok": true, ...the configs...}`` or ``{"id", "ok": false, "error": ...}``.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import sys
import tempfile
import traceback
from typing import Any

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
# Kimi Linear's GEMM-AR kernels (a kernel choice, no sizing) import the CUDA-only cutlass DSL
# while the model is built; off, vLLM meets the CPU's real obstacle for that model instead
os.environ.setdefault("VLLM_KIMI_K3_GEMM_AR", "0")

import torch
from vllm.config import get_layers_from_vllm_config, set_current_vllm_config
from vllm.distributed import (
    init_distributed_environment,
    initialize_model_parallel,
)
from vllm.distributed.parallel_state import (
    destroy_model_parallel,
    model_parallel_is_initialized,
)
from vllm.distributed.utils import get_pp_indices
from vllm.engine.arg_utils import EngineArgs
from vllm.model_executor.layers.attention_layer_base import AttentionLayerBase
from vllm.model_executor.model_loader.utils import initialize_model
from vllm.model_executor.models import registry
from vllm.model_executor.models.utils import extract_layer_index
from vllm.platforms import current_platform
from vllm.usage.usage_lib import UsageContext
from vllm.utils.network_utils import get_open_port
from vllm.v1.attention.backends.utils import (
    get_supported_kv_cache_layouts,
    resolve_kv_cache_layout,
)
from vllm.v1.core.kv_cache_utils import (
    get_kv_cache_configs,
    get_max_concurrency_for_kv_cache_config,
)
from vllm.v1.kv_cache_interface import (
    AttentionSpec,
    FullAttentionSpec,
    MambaSpec,
    MLAAttentionSpec,
    SlidingWindowSpec,
    UniformTypeKVCacheSpecs,
)
from vllm.v1.worker.utils import customize_attention_spec


def _spec_type(spec: Any) -> str:
    if isinstance(spec, MambaSpec):
        return "mamba"
    if isinstance(spec, MLAAttentionSpec):
        return "mla"
    if isinstance(spec, SlidingWindowSpec):
        return "sliding_window"
    if isinstance(spec, FullAttentionSpec):
        return "full_attention"
    return type(spec).__name__


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _layer(name: str, spec: Any) -> dict[str, Any]:
    if not isinstance(spec, AttentionSpec):  # mamba / linear-attention state
        return {"name": name, "type": _spec_type(spec), "block_size": spec.block_size,
                "page_size_bytes": spec.page_size_bytes}
    return {
        "name": name, "type": _spec_type(spec), "block_size": spec.block_size,
        "num_kv_heads": spec.num_kv_heads, "head_size": spec.head_size,
        "head_size_v": spec.head_size_v, "dtype": _dtype_name(spec.dtype),
        "sliding_window": getattr(spec, "sliding_window", None),
        "page_size_padded": spec.page_size_padded, "page_size_bytes": spec.page_size_bytes,
    }


def _group(group: Any) -> dict[str, Any]:
    spec = group.kv_cache_spec
    uniform_type = isinstance(spec, UniformTypeKVCacheSpecs)
    first = spec.first_spec if uniform_type else spec
    return {
        "layer_names": list(group.layer_names), "type": _spec_type(first),
        "block_size": spec.block_size, "page_size_bytes": spec.page_size_bytes,
        "sliding_window": getattr(first, "sliding_window", None),
        "uniform_type": uniform_type,
    }


def _config(vllm_config: Any, cfg: Any) -> dict[str, Any]:
    return {
        "num_blocks": cfg.num_blocks,
        "groups": [_group(g) for g in cfg.kv_cache_groups],
        "tensors": [dataclasses.asdict(t) for t in cfg.kv_cache_tensors],
        "max_concurrency": get_max_concurrency_for_kv_cache_config(vllm_config, cfg),
    }


def _drop_weight_quantization(hf_config: dict[str, Any]) -> None:
    """Drop a checkpoint's weight quantization: the CPU build has no kernels for FP8 block or
    MXFP4 weights (DeepSeek-V3, gpt-oss), and weights do not change the KV cache. A
    quantization config that also declares a KV-cache scheme is kept."""
    for holder in (hf_config, hf_config.get("text_config") or {}):
        quant = holder.get("quantization_config")
        if isinstance(quant, dict) and not (quant.get("kv_cache_scheme")
                                            or quant.get("kv_cache_quant_algo")):
            del holder["quantization_config"]


def _engine_config(case: dict[str, Any], model_dir: str) -> Any:
    args = EngineArgs(
        model=model_dir, skip_tokenizer_init=True, enforce_eager=True, load_format="dummy",
        kv_cache_memory_bytes=case["kv_cache_memory_bytes"],
        block_size=case.get("block_size"),
        kv_cache_dtype=case.get("kv_cache_dtype", "auto"),
        max_model_len=case.get("max_model_len"),
        tensor_parallel_size=case.get("tp_size", 1),
        pipeline_parallel_size=case.get("pp_size", 1),
        num_gpu_blocks_override=case.get("num_gpu_blocks_override"),
        disable_hybrid_kv_cache_manager=case.get("disable_hybrid_kv_cache_manager", False),
        # unset: vLLM's default for the entry point (the usage context below)
        max_num_batched_tokens=case.get("max_num_batched_tokens"),
        async_scheduling=case.get("async_scheduling", False),
        enable_prefix_caching=not case.get("no_enable_prefix_caching", False),
        mamba_ssm_cache_dtype=case.get("mamba_ssm_cache_dtype", "auto"),
        distributed_executor_backend="mp" if case.get("tp_size", 1) * case.get(
            "pp_size", 1) > 1 else None,
    )
    usage = {"llm": UsageContext.LLM_CLASS, "serve": UsageContext.OPENAI_API_SERVER}[
        case.get("entrypoint", "llm")]
    if case.get("platform", "cpu") != "cpu":
        raise ValueError("the harness runs vLLM's CPU platform only")
    isa = case.get("cpu_avx512_bf16", "auto")
    if isa == "auto":
        return args.create_engine_config(usage_context=usage)
    if isa not in ("yes", "no"):
        raise ValueError(f"cpu_avx512_bf16 must be auto, yes or no, got {isa!r}")
    host = torch.cpu._is_avx512_bf16_supported
    torch.cpu._is_avx512_bf16_supported = lambda: isa == "yes"
    try:
        return args.create_engine_config(usage_context=usage)
    finally:
        torch.cpu._is_avx512_bf16_supported = host


def _layer_specs(vllm_config: Any) -> tuple[dict[str, Any], list[type]]:
    """What the model runner's get_kv_cache_spec returns, plus the layers' backends."""
    with set_current_vllm_config(vllm_config):
        # one world of one rank for every case; the parallel groups are made again for each
        # model (the expert-parallel group exists only when the model has experts)
        if model_parallel_is_initialized():
            destroy_model_parallel()
        else:
            init_distributed_environment(
                world_size=1, rank=0, local_rank=0, backend="gloo",
                distributed_init_method=f"tcp://127.0.0.1:{get_open_port()}")
        initialize_model_parallel(1, 1)
        with torch.device("meta"):
            initialize_model(vllm_config=vllm_config)
        # what the executor does after loading the model: hybrid attention + mamba models get
        # an attention block size whose page holds a mamba state (a no-op for the others)
        current_platform.update_block_size_for_backend(vllm_config)
    specs: dict[str, Any] = {}
    backends: list[type] = []
    for name, module in get_layers_from_vllm_config(vllm_config, AttentionLayerBase).items():
        if getattr(module, "kv_sharing_target_layer_name", None):
            continue
        spec = module.get_kv_cache_spec(vllm_config)
        if spec is None:
            continue
        if isinstance(spec, AttentionSpec):
            backend = module.get_attn_backend()
            spec = customize_attention_spec(backend, spec)
            if backend not in backends:
                backends.append(backend)
        specs[name] = spec
    return specs, backends


def run_case(case: dict[str, Any]) -> dict[str, Any]:
    model_dir = tempfile.mkdtemp(prefix="kvpool-vllm-")
    try:
        with open(case["config"]) as f:
            hf_config = json.load(f)
        _drop_weight_quantization(hf_config)
        with open(os.path.join(model_dir, "config.json"), "w") as f:
            json.dump(hf_config, f)
        vllm_config = _engine_config(case, model_dir)
        tp = vllm_config.parallel_config.tensor_parallel_size
        pp = vllm_config.parallel_config.pipeline_parallel_size
        # build the layers as one TP=1, PP=1 rank, then give them vLLM's per-rank heads
        parallel = vllm_config.parallel_config
        parallel.tensor_parallel_size, parallel.pipeline_parallel_size = 1, 1
        try:
            specs, backends = _layer_specs(vllm_config)
        finally:
            parallel.tensor_parallel_size, parallel.pipeline_parallel_size = tp, pp
        heads = vllm_config.model_config.get_num_kv_heads(parallel)
        if tp > 1 and any(isinstance(s, MambaSpec) for s in specs.values()):
            raise NotImplementedError("the harness cannot give mamba states a TP split")
        specs = {
            name: (dataclasses.replace(s, num_kv_heads=heads)
                   if isinstance(s, AttentionSpec) and not isinstance(s, MLAAttentionSpec)
                   else s)
            for name, s in specs.items()
        }
        layers = [_layer(name, s) for name, s in specs.items()]
        num_layers = vllm_config.model_config.get_total_num_hidden_layers()
        stages = []
        for rank in range(pp):
            start, end = get_pp_indices(num_layers, rank, pp)
            # a rank holds the modules its decoder layers build: Falcon-H1's layer i names its
            # mixer model.{num_layers + i}.mixer
            stages.append({n: s for n, s in specs.items()
                           if start <= extract_layer_index(n) % num_layers < end})
        layout_names = [layout.name for layout in get_supported_kv_cache_layouts(backends)]
        layout = resolve_kv_cache_layout(vllm_config, [layout_names], specs.values())
        mem = case["kv_cache_memory_bytes"]
        configs = get_kv_cache_configs(vllm_config, stages, [mem] * pp)
        return {
            "id": case["id"], "ok": True,
            "architecture": vllm_config.model_config.architecture,
            "block_size": vllm_config.cache_config.block_size,
            "dtype": _dtype_name(vllm_config.model_config.dtype),
            "max_model_len": vllm_config.model_config.max_model_len,
            "hybrid": not vllm_config.scheduler_config.disable_hybrid_kv_cache_manager,
            "layout": layout.name, "layers": layers,
            "stages": [_config(vllm_config, c) for c in configs],
        }
    except Exception as exc:  # a refused case is a result, not a crash
        last = traceback.extract_tb(exc.__traceback__)[-1]
        return {"id": case["id"], "ok": False, "error": f"{type(exc).__name__}: {exc}",
                "where": f"{os.path.basename(last.filename)}:{last.lineno}"}
    finally:
        shutil.rmtree(model_dir, ignore_errors=True)


def main() -> int:
    registry._run_in_subprocess = lambda fn: fn()  # CPU: no CUDA to keep out of this process
    # vLLM's CPU platform picks an MLA kernel by the host: with AMX tiles an AMX MLA backend
    # (prefix caching kept), without them the reference CPU_MLA (block 16, prefix caching off
    # for MLA). kvpool's CPU profile plans the latter: have vLLM see a CPU without AMX.
    torch.cpu._is_amx_tile_supported = lambda: False
    cases = json.load(sys.stdin)
    # vLLM prints to stdout here and there: the results get the real stdout, the rest stderr
    out = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    for case in cases:
        out.write(json.dumps(run_case(case)) + "\n")
        out.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main())
