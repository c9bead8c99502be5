"""Run SGLang 0.5.23's own KV-pool sizing on CPU, for kvpool's differential test.

Run it with the side venv's python (``tests/sglang/setup_venv.sh`` makes the venv); it puts
``tests/sglang/stubs`` first on ``sys.path``. It reads a JSON list of cases on stdin and writes a
JSON list of results on stdout, one per case, in order. SGLang's logs and warnings go to
stderr. See ``tests/sglang/README.md`` for the case and result fields.

Nothing here computes a size. Every case goes through SGLang's own startup code, as
``sglang serve --device cpu`` runs it with SGLang's CPU engine (``SGLANG_USE_CPU_ENGINE=1``):

1. ``server_args.prepare_server_args(argv)``: the ``sglang serve`` CLI parser (choices
   are checked there) and ``ServerArgs.from_cli_args``.
2. ``runtime_context.publish(server_args, role="scheduler", ranks=SpawnRanks(...))``:
   SGLang's resolution pipeline, then the published config bags. The process is WORLD
   rank ``tp_size * pp_rank``: TP rank 0 of the case's pipeline stage.
3. ``ModelConfig.from_server_args``: dtype, context length, attention kind, the hybrid
   SWA decision and layer ids, quantization.
4. What ``ModelRunner`` reads off the loaded model, from a stand-in (``_model_stand_in``),
   then SGLang's ``resolve_layer_indices``, ``resolve_sliding_window_size``,
   ``kv_cache_dtype.configure_kv_cache_dtype``, ``resolve_spec_aux_hidden_state_config``
   and ``is_post_capture_kv_active``.
5. ``KVCacheConfigurator(...)``, built as ``ModelRunner.init_kv_cache_configurator``
   builds it, then its ``_resolve_memory_pool_config``: ``_profile_available_bytes``
   (including the Mamba state carve-out ``_handle_max_mamba_cache``) ->
   ``config_from_budget`` (``create_memory_pool_configurator(...).calculate_pool_sizes``,
   ``_apply_token_constraints``, ``calculate_pool_sizes_from_max_tokens``) ->
   ``resolve_max_num_reqs`` -> ``finalize_with_max_running_requests``.

Patched, each only while a case runs (``_stage``), because on a CPU it cannot answer:

* ``kv_cache_configurator.get_available_gpu_memory`` (the CUDA free-memory probe): it
  answers ``budget_bytes`` in GiB. With ``pre_model_load_memory=0`` SGLang's non-static
  slack is 0, so the budget is exactly the ``rest_memory`` SGLang sizes from.
* ``torch.distributed.all_reduce`` (only reached with ``pp_size > 1``: the MIN of the
  token capacity across stages): every stage runs here and the MIN is taken over them.
* ``torch.cuda.get_device_capability``: SGLang's DeepSeek-DSA resolution calls it even
  with ``--device cpu``; it answers ``cuda_capability`` (default SM90).
* ``utils.common.get_cpu_memory_capacity`` (what the device-memory probe reads for
  ``--device cpu``: host RAM per NUMA node; it picks ``chunked_prefill_size``): it
  answers ``gpu_memory_gib``, so results do not depend on the machine.
* ``arg_groups.model_overrides.qwen3_vl.is_sm90_supported`` (a CUDA probe, False on a CPU):
  it answers ``cuda_capability[0] == 9``, so Qwen3-VL on a large Hopper GPU takes SGLang's
  Hopper serving path (no multimodal embedding cache).

Stood in for, because a copied ``config.json`` comes without it: a checkpoint's own
configuration module (``configuration_*.py``, loaded with ``--trust-remote-code``). When
neither transformers nor SGLang knows the config's ``model_type`` (Baichuan, InternLM2,
MiniCPM, MiMo, DeepSeek-MoE v1, Orion, DeciLM, Phi-3-small), a plain ``PretrainedConfig``
subclass is registered for it in the case's child (``_remote_config_stand_in``): the config
is the file's own fields, nothing added (lists of dicts read by attribute, as those modules
make them).

Opt-in, ``"gpu_gates": true`` lifts four CPU-platform refusals (see ``_gpu_gates``).

Each case runs in a forked child (``--no-fork`` runs them in this process), so the
process-wide SGLang context of one case cannot leak into the next.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import io
import json
import logging
import os
import re
import shutil
import sys
import tempfile
import traceback
import types
from typing import Any
from unittest import mock

from stub_probes import hide_stubs  # beside this script

# The import-only stubs (GPU-only packages SGLang imports at module level) come first.
_STUBS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "stubs")
if _STUBS not in sys.path:
    sys.path.insert(0, _STUBS)
# SGLang's CPU engine (platform, quantization registry); no hub downloads.
os.environ.setdefault("SGLANG_USE_CPU_ENGINE", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

KV_CACHE_DTYPES = ("auto", "bfloat16", "float16", "fp8_e4m3", "fp8_e5m2")
# The GPU the probes describe, unless a case says otherwise: an H100 80GB (SM90).
DEFAULT_CUDA_CAPABILITY = (9, 0)
DEFAULT_GPU_MEMORY_GIB = 80

_CASE_KEYS = frozenset({
    "id", "config", "budget_bytes", "page_size", "kv_cache_dtype", "tp_size", "pp_size",
    "pp_rank", "context_length", "max_running_requests", "max_total_tokens", "dtype",
    "speculative_algorithm", "speculative_num_draft_layers", "speculative_num_steps",
    "speculative_num_draft_tokens", "speculative_eagle_topk", "swa_full_tokens_ratio",
    "mamba_full_memory_ratio", "mamba_radix_cache_strategy", "disable_radix_cache",
    "disable_overlap_schedule", "chunked_prefill_size", "cuda_capability",
    "gpu_memory_gib", "gpu_gates", "extra_args", "env",
})

# Case key -> `sglang serve` option taking the value.
_VALUE_OPTIONS = {
    "page_size": "--page-size",
    "kv_cache_dtype": "--kv-cache-dtype",
    "tp_size": "--tp-size",
    "pp_size": "--pp-size",
    "dtype": "--dtype",
    "context_length": "--context-length",
    "max_running_requests": "--max-running-requests",
    "max_total_tokens": "--max-total-tokens",
    "speculative_algorithm": "--speculative-algorithm",
    "speculative_num_steps": "--speculative-num-steps",
    "speculative_eagle_topk": "--speculative-eagle-topk",
    "speculative_num_draft_tokens": "--speculative-num-draft-tokens",
    "swa_full_tokens_ratio": "--swa-full-tokens-ratio",
    "mamba_full_memory_ratio": "--mamba-full-memory-ratio",
    "mamba_radix_cache_strategy": "--mamba-radix-cache-strategy",
    "chunked_prefill_size": "--chunked-prefill-size",
}
# Case key -> `sglang serve` flag set when the value is true.
_FLAG_OPTIONS = {
    "disable_radix_cache": "--disable-radix-cache",
    "disable_overlap_schedule": "--disable-overlap-schedule",
}

_LOG_LEVEL = logging.WARNING
_WARM_MODULES = (
    "sglang.srt.server_args",
    "sglang.srt.configs.model_config",
    "sglang.srt.mem_cache.kv_cache_configurator",
    "sglang.srt.model_executor.pool_configurator",
    "sglang.srt.model_loader.loader",
)


def _model_dir(config: str, workdir: str) -> str:
    """A model directory for ``--model-path``: ``config`` when it is one, else a fresh
    directory holding the given file as ``config.json``."""
    if os.path.isdir(config):
        return os.path.abspath(config)
    target = os.path.join(workdir, "model")
    os.makedirs(target)
    shutil.copyfile(config, os.path.join(target, "config.json"))
    return target


def _draft_dir(model_dir: str, num_layers: int, workdir: str) -> str:
    """A draft checkpoint directory for ``--speculative-draft-model-path``. SGLang reads
    the draft's layer count there (``spec_aux_hidden_state._resolve_eagle_aux_hidden_state``).

    It holds the target's config with ``num_nextn_predict_layers`` set to ``num_layers``
    when the target has MTP layers (DeepSeek: the draft is its NextN head); otherwise with
    ``num_hidden_layers`` set to ``num_layers``, the per-layer lists cut to that length
    and every ``layer_types`` entry ``full_attention``: EAGLE heads are full-attention
    layers, so a hybrid target's draft is not hybrid itself.
    """
    with open(os.path.join(model_dir, "config.json")) as f:
        hf = json.load(f)
    text = hf.get("text_config", hf)
    if text.get("num_nextn_predict_layers"):
        text["num_nextn_predict_layers"] = num_layers
    else:
        target_layers = text.get("num_hidden_layers")
        text["num_hidden_layers"] = num_layers
        for key, value in list(text.items()):
            if isinstance(value, list) and target_layers and len(value) == target_layers:
                text[key] = value[:num_layers]
        if "layer_types" in text:
            text["layer_types"] = ["full_attention"] * num_layers
    target = os.path.join(workdir, "draft")
    os.makedirs(target)
    with open(os.path.join(target, "config.json"), "w") as f:
        json.dump(hf, f)
    return target


class _Fields(dict):
    """A dict whose keys also read as attributes (and that still serializes as JSON)."""

    def __getattr__(self, name: str) -> Any:
        try:
            return self[name]
        except KeyError:
            raise AttributeError(name) from None


def _attribute_view(value: Any) -> Any:
    """Dicts inside a list, recursively, as attribute objects (what a checkpoint's config
    class makes of per-layer tables such as DeciLM's ``block_configs``)."""
    if isinstance(value, dict):
        return _Fields({k: _attribute_view(v) for k, v in value.items()})
    if isinstance(value, list):
        return [_attribute_view(v) for v in value]
    return value


def _remote_config_stand_in(model_dir: str) -> str | None:
    """Stand in for a checkpoint's own configuration module (``configuration_*.py``, loaded
    with ``--trust-remote-code``), which a copied ``config.json`` does not come with: when
    neither transformers nor SGLang knows the config's ``model_type``, register a plain
    ``PretrainedConfig`` subclass for it, so ``AutoConfig`` builds the config from the file's
    own fields (no defaults added, nothing computed; lists of dicts read as attribute objects,
    as those classes make them). Returns the registered model type, or None. The registration
    lives in the case's forked child only."""
    with open(os.path.join(model_dir, "config.json")) as f:
        model_type = json.load(f).get("model_type")
    if not model_type:
        return None
    from sglang.srt.utils.hf_transformers.common import _CONFIG_REGISTRY
    from transformers import AutoConfig, PretrainedConfig
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    if model_type in CONFIG_MAPPING or model_type in _CONFIG_REGISTRY:
        return None

    def __init__(self, **kwargs):
        lists = {k: _attribute_view(v) for k, v in kwargs.items()
                 if isinstance(v, list) and any(isinstance(x, dict) for x in v)}
        PretrainedConfig.__init__(self, **{k: v for k, v in kwargs.items() if k not in lists})
        for key, value in lists.items():
            setattr(self, key, value)

    stand_in = type(f"RemoteConfigStandIn_{model_type}", (PretrainedConfig,),
                    {"model_type": model_type, "__init__": __init__})
    AutoConfig.register(model_type, stand_in, exist_ok=True)
    return model_type


def _argv(case: dict, model_dir: str, workdir: str) -> list[str]:
    """The ``sglang serve`` command line of a case."""
    argv = ["--model-path", model_dir, "--device", "cpu", "--skip-tokenizer-init"]
    for key, option in _VALUE_OPTIONS.items():
        if case.get(key) is not None:
            argv += [option, str(case[key])]
    for key, flag in _FLAG_OPTIONS.items():
        if case.get(key):
            argv.append(flag)
    if case.get("speculative_algorithm") and case.get("speculative_num_draft_layers"):
        draft = _draft_dir(model_dir, int(case["speculative_num_draft_layers"]), workdir)
        argv += ["--speculative-draft-model-path", draft]
    return argv + [str(arg) for arg in case.get("extra_args") or ()]


def _prepare_server_args(argv: list[str]):
    """SGLang's ``prepare_server_args``, with argparse's exit raised as the parser's
    message, and logging sent to stderr at the harness's level."""
    from sglang.srt.server_args import prepare_server_args

    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err):
            server_args = prepare_server_args(argv)
    except SystemExit as exc:
        lines = [line for line in err.getvalue().splitlines() if line.strip()]
        message = lines[-1] if lines else f"argument parsing exited with {exc.code}"
        raise ValueError(message) from None
    # prepare_server_args points the root logger at the (redirected) stderr.
    logging.basicConfig(
        level=_LOG_LEVEL, stream=sys.stderr, force=True, format="[sglang] %(message)s"
    )
    return server_args


def _model_stand_in(model_config, pp_rank: int, pp_size: int) -> tuple[Any, str]:
    """What ``ModelRunner`` reads off the loaded model before sizing the KV pool. No
    weights are loaded; the model class is only looked up.

    * ``start_layer``/``end_layer`` (``layer_setup._resolve_pp_layer_range``): SGLang's
      models set them from ``make_layers`` -> ``get_pp_indices(num_hidden_layers,
      pp_rank, pp_size)``, called the same way here.
    * ``quant_config`` (``configure_kv_cache_dtype`` reads ``kv_cache_quant_algo``): the
      loader's ``_get_quantization_config(model_config, LoadConfig())``.
    * ``get_attention_sliding_window_size`` (``resolve_sliding_window_size``): the
      model class's method, bound to the stand-in, when the class has one; it reads
      ``self.config``.
    """
    from sglang.srt.configs.load_config import LoadConfig
    from sglang.srt.distributed.utils import get_pp_indices
    from sglang.srt.model_loader.loader import _get_quantization_config
    from sglang.srt.model_loader.utils import get_model_architecture

    model_cls, arch = get_model_architecture(model_config)
    wanted = model_config.hf_config.architectures[0]
    if arch != wanted:
        raise RuntimeError(
            f"harness: SGLang resolved {wanted} to {arch}; its model module most likely "
            "failed to import in the side venv (see the log)"
        )
    start, end = get_pp_indices(model_config.num_hidden_layers, pp_rank, pp_size)
    stand_in = types.SimpleNamespace(
        start_layer=start,
        end_layer=end,
        config=model_config.hf_config,
        quant_config=_get_quantization_config(model_config, LoadConfig()),
    )
    method = getattr(model_cls, "get_attention_sliding_window_size", None)
    if method is not None:
        stand_in.get_attention_sliding_window_size = types.MethodType(method, stand_in)
    # Multimodal classes ask their language model (Gemma-3's ``self.language_model``): that
    # is the text causal-LM class of the same SGLang module, over the text config.
    text_cls = next((obj for name, obj in vars(sys.modules[model_cls.__module__]).items()
                     if name.endswith("ForCausalLM") and isinstance(obj, type)
                     and hasattr(obj, "get_attention_sliding_window_size")), None)
    if text_cls is not None:
        language_model = types.SimpleNamespace(config=model_config.hf_text_config)
        language_model.get_attention_sliding_window_size = types.MethodType(
            text_cls.get_attention_sliding_window_size, language_model)
        stand_in.language_model = language_model
    return stand_in, f"{model_cls.__module__}.{model_cls.__qualname__}"


class _PPAllReduce:
    """Stand-in for the MIN all-reduce of ``_apply_token_constraints`` across PP stages:
    records this stage's value and, once the other stages' values are known, writes back
    the minimum, as the collective would."""

    def __init__(self, others: list[int] | None = None):
        self.seen: list[int] = []
        self.others = others

    def __call__(self, tensor, op=None, group=None, async_op=False):
        import torch.distributed as dist

        if op not in (None, dist.ReduceOp.MIN):
            raise RuntimeError(f"harness: unexpected all_reduce op {op}")
        self.seen.append(int(tensor.item()))
        if self.others is not None:
            tensor.fill_(min([int(tensor.item()), *self.others]))


def _gpu_gates(case: dict) -> list:
    """Opt-in (``"gpu_gates": true``): lift SGLang's CPU-platform refusals of features a
    CUDA deployment has, so their sizing can be compared. Each patch answers one
    platform question as CUDA does; no formula is touched.

    * ``mamba_hook._platform_supports_mamba_cache_extra_buffer``: the CPU platform
      cannot snapshot Mamba state, so ``extra_buffer`` (what ``auto`` picks for
      hybrid-linear models) is refused on CPU.
    * ``kv_cache_dtype.current_platform``: ``configure_kv_cache_dtype`` refuses
      ``fp8_e5m2`` when ``current_platform.is_cpu()``; that one read answers False.
    * ``speculative_hook._disable_overlap_schedule_for_cpu``: with ``--device cpu``,
      speculative decoding forces ``disable_overlap_schedule``, which changes the Mamba
      state slots per request and the SWA request cap; it does nothing instead.
    * ``serving_hook.get_platform``: Qwen3-VL's Hopper path picks
      ``--mm-feature-transport cuda_ipc``, which the serving hook refuses unless the platform
      is CUDA; its platform says ``is_cuda`` (every other attribute is the real platform's).
    """
    if not case.get("gpu_gates"):
        return []
    from sglang.srt.arg_groups import mamba_hook, serving_hook, speculative_hook
    from sglang.srt.mem_cache import kv_cache_dtype

    real_platform = serving_hook.get_platform

    class _CudaView:
        def __init__(self, platform: object) -> None:
            self._platform = platform

        def __getattr__(self, name: str) -> object:
            return True if name == "is_cuda" else getattr(self._platform, name)

    return [
        mock.patch.object(serving_hook, "get_platform", lambda: _CudaView(real_platform())),
        mock.patch.object(mamba_hook, "_platform_supports_mamba_cache_extra_buffer", lambda: True),
        mock.patch.object(
            kv_cache_dtype, "current_platform", types.SimpleNamespace(is_cpu=lambda: False)
        ),
        mock.patch.object(speculative_hook, "_disable_overlap_schedule_for_cpu", lambda sa: None),
    ]


def _stage(case: dict, argv: list[str], pp_rank: int, all_reduce: _PPAllReduce) -> dict:
    """Publish the case as PP stage ``pp_rank`` and run SGLang's pool sizing there."""
    import torch
    from sglang.srt.arg_groups.model_overrides import qwen3_vl as qwen3_vl_overrides
    from sglang.srt.mem_cache import kv_cache_configurator
    from sglang.srt.utils import common

    capability = tuple(case.get("cuda_capability") or DEFAULT_CUDA_CAPABILITY)
    gpu_memory_mib = float(case.get("gpu_memory_gib") or DEFAULT_GPU_MEMORY_GIB) * 1024
    budget_gib = int(case["budget_bytes"]) / (1 << 30)
    with contextlib.ExitStack() as stack:
        patches = [
            # The CUDA free-memory probe: the budget stands in for free memory.
            mock.patch.object(
                kv_cache_configurator, "get_available_gpu_memory", lambda *a, **k: budget_gib
            ),
            # The PP MIN all-reduce of the token capacity: no process group here.
            mock.patch.object(torch.distributed, "all_reduce", all_reduce),
            # A CUDA call DeepSeek-DSA resolution makes even with --device cpu.
            mock.patch.object(torch.cuda, "get_device_capability", lambda *a, **k: capability),
            # The device-memory probe reads host RAM for --device cpu.
            mock.patch.object(common, "get_cpu_memory_capacity", lambda: gpu_memory_mib),
            # The SM90 probe of the Qwen3-VL override (no CUDA here): answers from
            # ``cuda_capability``, so a large-Hopper case takes SGLang's Hopper path.
            mock.patch.object(qwen3_vl_overrides, "is_sm90_supported",
                              lambda: capability[0] == 9),
            *_gpu_gates(case),
        ]
        for patch in patches:
            stack.enter_context(patch)
        result = _size(case, argv, pp_rank)
    result.update(
        cuda_capability=list(capability),
        gpu_memory_mib=gpu_memory_mib,
        gpu_gates=bool(case.get("gpu_gates")),
    )
    return result


def _size(case: dict, argv: list[str], pp_rank: int) -> dict:
    from sglang.srt.configs.hybrid_arch import mambaish_config
    from sglang.srt.configs.model_config import (
        AttentionArch,
        ModelConfig,
        is_deepseek_dsa,
        is_deepseek_v4,
    )
    from sglang.srt.mem_cache import kv_cache_dtype
    from sglang.srt.mem_cache.kv_cache_configurator import KVCacheConfigurator
    from sglang.srt.model_executor.model_runner_components.kv_pool_runtime import (
        is_post_capture_kv_active,
    )
    from sglang.srt.model_executor.model_runner_components.layer_setup import (
        resolve_layer_indices,
    )
    from sglang.srt.model_executor.model_runner_components.load_model_utils import (
        resolve_sliding_window_size,
    )
    from sglang.srt.model_executor.model_runner_components.spec_aux_hidden_state import (
        resolve_spec_aux_hidden_state_config,
    )
    from sglang.srt.model_executor.pool_configurator import create_memory_pool_configurator
    from sglang.srt.runtime_context import (
        SpawnRanks,
        get_exec,
        get_model,
        get_parallel,
        get_schedule,
        get_spec,
        publish,
        reset_context,
    )
    from sglang.srt.speculative.spec_info import SpeculativeAlgorithm

    server_args = _prepare_server_args(argv)
    tp_size = int(case.get("tp_size", 1))
    pp_size = int(case.get("pp_size", 1))
    reset_context()
    publish(server_args, role="scheduler", ranks=SpawnRanks(world_rank=tp_size * pp_rank))
    parallel = get_parallel()
    # Process-group handles, which init_distributed_environment builds on a real launch.
    # Sizing reads the PP group's width and hands the WORLD group's cpu_group to the
    # (patched) memory probe and PP all-reduce.
    pp_group = types.SimpleNamespace(
        world_size=pp_size,
        rank_in_group=pp_rank,
        is_first_rank=pp_rank == 0,
        is_last_rank=pp_rank == pp_size - 1,
    )
    parallel.override_permanently(
        world_group=types.SimpleNamespace(
            cpu_group=None, world_size=parallel.launch_world_size, rank_in_group=tp_size * pp_rank
        ),
        pp_group=pp_group,
    )

    # ModelRunner.__init__ / load_model / configure_kv_cache_dtype, in that order.
    model_config = ModelConfig.from_server_args(server_args)
    spec_algorithm = SpeculativeAlgorithm.from_string(get_spec().speculative_algorithm)
    spec_aux_config = resolve_spec_aux_hidden_state_config(
        server_args=server_args,
        model_config=model_config,
        spec_algorithm=spec_algorithm,
        is_draft_worker=False,
    )
    model, model_class = _model_stand_in(model_config, pp_rank, pp_size)
    layer_info = resolve_layer_indices(
        model=model, model_config=model_config, is_draft_worker=False
    )
    sliding_window_size = resolve_sliding_window_size(model, model_config)
    resolved_kv_str, kv_dtype = kv_cache_dtype.configure_kv_cache_dtype(
        server_args_kv_cache_dtype=get_model().kv_cache_dtype,
        model=model,
        model_dtype=model_config.dtype,
        is_draft_worker=False,
        is_dflash=spec_algorithm.is_dflash_family(),
        # model_runner.resolve_draft_attention_backend: None for a target runner.
        speculative_draft_attention_backend=None,
        speculative_draft_kv_cache_dtype=get_spec().speculative_draft_kv_cache_dtype,
    )
    kv_dtype_str = resolved_kv_str if resolved_kv_str is not None else get_model().kv_cache_dtype

    # ModelRunner.init_kv_cache_configurator, then alloc_memory_pool's sizing half.
    kvc = KVCacheConfigurator(
        device="cpu",
        gpu_id=0,
        attn_dp_size=parallel.attn_dp_size,
        pp_size=pp_group.world_size,
        pp_group=pp_group,
        model=model,
        model_config=model_config,
        server_args=server_args,
        kv_cache_dtype=kv_dtype,
        kv_cache_dtype_str=kv_dtype_str,
        model_dtype=model_config.dtype,
        page_size=get_schedule().page_size,
        sliding_window_size=sliding_window_size,
        spec_algorithm=spec_algorithm,
        is_draft_worker=False,
        post_capture_kv_active=is_post_capture_kv_active(
            server_args=server_args,
            is_draft_worker=False,
            spec_algorithm=spec_algorithm,
            token_to_kv_pool_allocator=None,
        ),
        spec_aux_config=spec_aux_config,
        draft_parallel_layout=None,
        is_hybrid_swa=model_config.is_hybrid_swa,
        is_hybrid_swa_compress=model_config.is_hybrid_swa_compress,
        use_mla_backend=model_config.attention_arch == AttentionArch.MLA,
        layer_info=layer_info,
        forward_stream=None,
        req_to_token_pool=None,
        token_to_kv_pool_allocator=None,
        memory_pool_config=None,
        draft_model_idx=None,
    )
    kv_budgets: list[int] = []
    real_config_from_budget = KVCacheConfigurator.config_from_budget

    def config_from_budget(self, budget_bytes, **kwargs):
        kv_budgets.append(int(budget_bytes))  # observed, passed on unchanged
        return real_config_from_budget(self, budget_bytes, **kwargs)

    with mock.patch.object(KVCacheConfigurator, "config_from_budget", config_from_budget):
        config = kvc._resolve_memory_pool_config(pre_model_load_memory=0)

    configurator = create_memory_pool_configurator(kvc)
    kind = type(configurator).__name__.removesuffix("PoolConfigurator")
    kind = re.sub(r"(?<=[a-z0-9])(?=[A-Z])|(?<=[A-Z])(?=[A-Z][a-z])", "_", kind).lower()
    cell_size = getattr(configurator, "_cell_size", None)
    if cell_size is None:  # DSV4PoolConfigurator
        cell_size = getattr(configurator, "bytes_per_full_token", None)
    mamba = mambaish_config(model_config)
    attn_tp_size = parallel.attn_tp_size
    # The layers holding KV on this stage, as the configurators count them.
    if mamba is not None:
        kv_layer_ids = [
            i for i in mamba.full_attention_layer_ids
            if layer_info.start_layer <= i < layer_info.end_layer
        ]
    elif layer_info.full_attention_layer_ids is not None:
        kv_layer_ids = [*layer_info.full_attention_layer_ids, *layer_info.swa_attention_layer_ids]
    else:
        kv_layer_ids = list(range(layer_info.start_layer, layer_info.end_layer))
    schedule, kernel = get_schedule(), get_exec().kernel
    result = {
        "ok": True,
        "error": None,
        "architecture_class": kind,
        "configurator": type(configurator).__name__,
        "model_class": model_class,
        "attention_arch": model_config.attention_arch.name,
        "is_hybrid_swa": bool(model_config.is_hybrid_swa),
        "is_mla": model_config.attention_arch == AttentionArch.MLA,
        "is_dsa": bool(is_deepseek_dsa(model_config.hf_config)),
        "is_dsv4": bool(is_deepseek_v4(model_config.hf_config)),
        "is_mambaish": mamba is not None,
        "model_dtype": str(model_config.dtype).removeprefix("torch."),
        "kv_cache_dtype": str(kv_dtype).removeprefix("torch."),
        "kv_cache_dtype_arg": kv_dtype_str,
        "context_length": model_config.context_len,
        "page_size": schedule.page_size,
        "max_total_num_tokens": config.max_total_num_tokens,
        "max_running_requests": config.max_running_requests,
        "full_max_total_num_tokens": config.full_max_total_num_tokens,
        "swa_max_total_num_tokens": config.swa_max_total_num_tokens,
        "mamba_cache_size": schedule.max_mamba_cache_size if mamba is not None else None,
        "cell_size": cell_size,
        "kv_budget_bytes": kv_budgets[0] if kv_budgets else None,
        "pp_rank": pp_rank,
        "start_layer": layer_info.start_layer,
        "end_layer": layer_info.end_layer,
        "num_layers": layer_info.num_effective_layers,
        "num_kv_layers": len(kv_layer_ids),
        "num_swa_layers": (
            None if layer_info.swa_attention_layer_ids is None
            else len(layer_info.swa_attention_layer_ids)
        ),
        "attn_tp_size": attn_tp_size,
        "kv_heads_per_rank": model_config.get_num_kv_heads(attn_tp_size),
        "head_dim": model_config.head_dim,
        "v_head_dim": getattr(model_config, "v_head_dim", None),
        "kv_lora_rank": getattr(model_config, "kv_lora_rank", None),
        "qk_rope_head_dim": getattr(model_config, "qk_rope_head_dim", None),
        "sliding_window_size": sliding_window_size,
        "eagle_draft_num_layers": spec_aux_config.eagle_draft_num_layers,
        "speculative_algorithm": get_spec().speculative_algorithm,
        "speculative_num_steps": get_spec().speculative_num_steps,
        "speculative_eagle_topk": get_spec().speculative_eagle_topk,
        "speculative_num_draft_tokens": get_spec().speculative_num_draft_tokens,
        "chunked_prefill_size": schedule.chunked_prefill_size,
        "disable_overlap_schedule": bool(schedule.disable_overlap_schedule),
        "attention_backend": kernel.attention_backend,
        "dsa_prefill_backend": kernel.dsa_prefill_backend,
        "dsa_decode_backend": kernel.dsa_decode_backend,
        "c4_max_total_num_tokens": config.c4_max_total_num_tokens,
        "c128_max_total_num_tokens": config.c128_max_total_num_tokens,
        "c4_state_pool_size": config.c4_state_pool_size,
        "c128_state_pool_size": config.c128_state_pool_size,
    }
    if mamba is not None:
        result.update(
            mamba_layers=len(mamba.mamba2_cache_params.layers),
            mamba_cache_per_req=mamba.mamba2_cache_params.mamba_cache_per_req,
            mamba_extra_buffer=bool(get_exec().mamba.enable_mamba_extra_buffer),
        )
    return result


def run_case(case: dict) -> dict:
    """One case through SGLang. Raises what SGLang raises when it refuses the input."""
    unknown = sorted(set(case) - _CASE_KEYS)
    if unknown:
        raise ValueError(f"harness: unknown case keys {unknown}")
    if case.get("kv_cache_dtype", "auto") not in KV_CACHE_DTYPES:
        raise ValueError(f"harness: kv_cache_dtype must be one of {KV_CACHE_DTYPES}")
    pp_size = int(case.get("pp_size", 1))
    pp_rank = int(case.get("pp_rank", 0))
    # SGLang switches that are environment variables (SGLANG_ALLOW_OVERWRITE_LONGER_CONTEXT_LEN)
    env = {str(k): str(v) for k, v in (case.get("env") or {}).items()}
    with tempfile.TemporaryDirectory(prefix="kvpool-sglang-") as workdir, \
            mock.patch.dict(os.environ, env):
        model_dir = _model_dir(case["config"], workdir)
        stand_in = {"remote_config_stand_in": _remote_config_stand_in(model_dir)}
        argv = _argv(case, model_dir, workdir)
        if pp_size == 1:
            return {**_stage(case, argv, pp_rank, _PPAllReduce()), **stand_in}
        # Every stage sizes its own layers; SGLang then MIN-all-reduces the capacity.
        others = []
        for rank in range(pp_size):
            if rank != pp_rank:
                probe = _PPAllReduce()
                try:
                    _stage(case, argv, rank, probe)
                except Exception as exc:
                    raise RuntimeError(f"PP stage {rank}: {type(exc).__name__}: {exc}") from exc
                others.append(probe.seen[0])
        all_reduce = _PPAllReduce(others)
        result = _stage(case, argv, pp_rank, all_reduce)
        capacities = [*others[:pp_rank], *all_reduce.seen, *others[pp_rank:]]
        result["pp_stage_token_capacities"] = capacities
        return {**result, **stand_in}


def _error_result(exc: BaseException) -> dict:
    return {"ok": False, "error": f"{type(exc).__name__}: {exc}"}


def _run_forked(case: dict) -> dict:
    """``run_case`` in a forked child; the result comes back as JSON over a pipe."""
    read_fd, write_fd = os.pipe()
    pid = os.fork()
    if pid == 0:  # child
        os.close(read_fd)
        try:
            result = run_case(case)
        except BaseException as exc:  # reported in the result, traceback on stderr
            traceback.print_exc(file=sys.stderr)
            result = _error_result(exc)
        with os.fdopen(write_fd, "w") as out:
            json.dump(result, out, default=str)
        sys.stderr.flush()
        os._exit(0)
    os.close(write_fd)
    with os.fdopen(read_fd) as pipe:
        payload = pipe.read()
    _, status = os.waitpid(pid, 0)
    if not payload:
        return {"ok": False, "error": f"harness: the case's process died (wait status {status})"}
    return json.loads(payload)


def _run_here(case: dict) -> dict:
    try:
        return run_case(case)
    except Exception as exc:
        traceback.print_exc(file=sys.stderr)
        return _error_result(exc)


def main(argv: list[str] | None = None) -> int:
    global _LOG_LEVEL
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--no-fork", action="store_true", help="run every case in this process (debugging)"
    )
    parser.add_argument(
        "--log-level", default="warning", help="level of SGLang's log on stderr (default: warning)"
    )
    args = parser.parse_args(argv)
    _LOG_LEVEL = getattr(logging, args.log_level.upper())
    cases = json.load(sys.stdin)
    if not isinstance(cases, list):
        raise SystemExit("stdin must hold a JSON list of cases")
    # Keep stdout for the JSON: anything SGLang prints goes to stderr.
    stdout, sys.stdout = sys.stdout, sys.stderr
    try:
        hide_stubs()
        # Import once, so each forked case starts warm.
        for module in _WARM_MODULES:
            importlib.import_module(module)
        # Imports every SGLang model module (those that fail are logged and skipped).
        importlib.import_module("sglang.srt.models.registry").ModelRegistry.get_supported_archs()

        run = _run_here if args.no_fork else _run_forked
        results = [{"id": case.get("id"), **run(case)} for case in cases]
    finally:
        sys.stdout = stdout
    json.dump(results, sys.stdout, indent=1, default=str)
    sys.stdout.write("\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
