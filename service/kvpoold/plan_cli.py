"""``kvpoold plan``: size a pool from a model config and print the plan; nothing is allocated.

``--engine sglang`` (the default) plans kvpool's pool for SGLang; ``--engine vllm`` prints vLLM
0.32's own KV cache for the model (blocks, KV-cache groups and tensors: the vLLM profile,
:mod:`kvpoold.sizing.vllm_profile`).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kvpool.contract.codec import plan_to_json
from kvpool.contract.errors import InvalidArgument
from kvpool.contract.option_flags import add_option_flags, flag_of, option_values
from kvpool.contract.plan import BufferSpec
from kvpool.contract.sizes import format_size
from kvpool.contract.vllm_plan import VllmOptions, VllmPlan, make_vllm_options, vllm_plan_to_json
from kvpool.tools.hf_hub_cache import local_model_config
from kvpoold.hf import read_config_json, read_model
from kvpoold.sizing import PlanOptions, PoolPlan, make_options, plan
from kvpoold.sizing.architectures import ASSUMABLE
from kvpoold.sizing.vllm_profile import plan_vllm

if TYPE_CHECKING:
    from rich.console import RenderableType

# a per-layer group longer than this shows its first names and a count
SHOWN_NAMES = 3
ENGINES = ("sglang", "vllm")
# the flags both engines read (the same meaning in each)
SHARED_FIELDS = frozenset(PlanOptions.__struct_fields__) & frozenset(VllmOptions.__struct_fields__)
SGLANG_ONLY = frozenset(PlanOptions.__struct_fields__) - SHARED_FIELDS - {"budget_bytes"}
VLLM_ONLY = frozenset(VllmOptions.__struct_fields__) - SHARED_FIELDS


def add_parser(subparsers: argparse._SubParsersAction[Any]) -> argparse.ArgumentParser:
    """Register ``plan`` with the ``kvpoold`` subcommand parser and return its parser."""
    p = subparsers.add_parser(
        "plan",
        help="size a pool for a model and print the plan (dry run, nothing allocated)",
        description="Size the KV pool of one model for one device, the way the daemon would, "
                    "and print the sizes and buffer layout. Nothing is allocated.",
    )
    p.add_argument("--model-config", type=Path, required=True, metavar="PATH",
                   help="HF config.json (or its model directory), a Hub id (org/name) already "
                        "in the local Hub cache, or a spec file (.json/.toml; SGLang only)")
    p.add_argument("--engine", choices=ENGINES, default="sglang",
                   help="the engine whose KV cache to plan: sglang (kvpool's pool, the "
                        "default) or vllm (vLLM 0.32's blocks, groups and KV-cache tensors; "
                        "--budget is then its kv_cache_memory_bytes)")
    p.add_argument("--assume-architecture", metavar="FAMILY", choices=ASSUMABLE,
                   help="read a config whose class SGLang's registry does not know as this "
                        f"family ({', '.join(ASSUMABLE)}); the plan says 'assumed'")
    add_option_flags(p)
    vllm = p.add_argument_group(
        "vLLM (--engine vllm)",
        "vLLM's own knobs; --kv-cache-dtype, --tp-size, --pp-size and --pp-rank apply too")
    add_option_flags(vllm, VllmOptions, skip=SHARED_FIELDS)
    p.add_argument("--json", action="store_true", help="print the plan as JSON")
    p.set_defaults(func=run)
    return p


def _options(args: argparse.Namespace) -> PlanOptions:
    fields = option_values(args)
    if "budget_bytes" not in fields and "max_total_tokens" not in fields:
        raise InvalidArgument("give --budget SIZE, --max-total-tokens N, or both",
                              field="budget")
    return make_options(**fields)  # a bad value's field becomes its flag (cli_words)


def _set_flags(args: argparse.Namespace, fields: frozenset[str],
               options_type: type[Any]) -> list[str]:
    values = option_values(args, options_type)
    return sorted(flag_of(f) for f in fields if f in values)


def _vllm_options(args: argparse.Namespace) -> VllmOptions:
    wrong = _set_flags(args, SGLANG_ONLY, PlanOptions)
    if wrong:
        raise InvalidArgument(f"{', '.join(wrong)} {'is' if len(wrong) == 1 else 'are'} "
                              "SGLang's; vLLM's knobs are in kvpoold plan --help",
                              field=wrong[0].removeprefix("--").replace("-", "_"))
    fields = option_values(args, VllmOptions)
    budget = option_values(args).get("budget_bytes")
    if budget is not None and fields.setdefault("kv_cache_memory_bytes", budget) != budget:
        raise InvalidArgument("give --budget or --kv-cache-memory-bytes, not both",
                              field="kv_cache_memory_bytes")
    if "kv_cache_memory_bytes" not in fields:
        raise InvalidArgument("give --kv-cache-memory-bytes SIZE (or --budget SIZE)",
                              field="kv_cache_memory_bytes")
    return make_vllm_options(**fields)


def _run_vllm(args: argparse.Namespace) -> int:
    options = _vllm_options(args)
    config, path = read_config_json(local_model_config(args.model_config, "model_config"))
    result = plan_vllm(config, options, where=str(path))
    if args.json:
        sys.stdout.write(vllm_plan_to_json(result))
    else:
        _print_vllm(result)
    return 0


def run(args: argparse.Namespace) -> int:
    """Plan and print; every bad input raises :class:`InvalidArgument` (exit 2 in ``main``).

    Raises:
        InvalidArgument: a bad flag value, an unreadable config, or a plan that cannot fit.
    """
    if args.engine == "vllm":
        return _run_vllm(args)
    wrong = _set_flags(args, VLLM_ONLY, VllmOptions)
    if wrong:
        raise InvalidArgument(f"{', '.join(wrong)} {'is' if len(wrong) == 1 else 'are'} "
                              "vLLM's; add --engine vllm",
                              field=wrong[0].removeprefix("--").replace("-", "_"))
    options = _options(args)
    model = read_model(local_model_config(args.model_config, "model_config"),
                       assume=args.assume_architecture)
    result = plan(model.spec, options, source=model.source, decided_by=model.decided_by)
    if args.json:
        sys.stdout.write(plan_to_json(result))
    else:
        _print_table(result)
    return 0


# ---- the readable table (rich imported only here) ---------------------------------------------


def _count(n: int | None) -> str:
    return "-" if n is None else f"{n:,}"


def _bytes(n: int) -> str:
    return f"{n:,} B ({format_size(n)})"


def _summary_rows(p: PoolPlan) -> list[tuple[str, str]]:
    rows = [
        ("architecture", f"{p.architecture} (from {p.architecture_source})"),
        ("model", p.model_architecture or "-"),
        ("kv cache dtype", p.kv_cache_dtype),
        ("page size", f"{p.page_size:,} token" + ("" if p.page_size == 1 else "s")),
        ("context length", f"{p.context_length:,}"),
        ("cell size", f"{p.cell_size_bytes:,} B per token"),
        ("max total tokens", f"{p.max_total_num_tokens:,}"),
        ("pages", f"{p.num_pages:,} (+1 padding page)"),
        ("max running requests", f"{p.max_running_requests:,}"),
    ]
    optional = (
        ("full tokens", p.full_max_total_num_tokens),
        ("swa tokens", p.swa_max_total_num_tokens),
        ("swa pages", p.swa_num_pages),
        ("mamba cache slots", p.mamba_cache_size),
        ("c4 tokens", p.c4_max_total_num_tokens),
        ("c128 tokens", p.c128_max_total_num_tokens),
        ("c4 state slots", p.c4_state_pool_size),
        ("c128 state slots", p.c128_state_pool_size),
    )
    rows += [(k, _count(v)) for k, v in optional if v is not None]
    rows += [
        ("budget", "-" if p.budget_bytes is None else _bytes(p.budget_bytes)),
        ("KV + state", _bytes(p.total_bytes)),
        ("aux (not in --budget)", _bytes(p.aux_bytes)),
        ("backing region", _bytes(p.backing_bytes) + " (the daemon's --budget pays all of it)"),
        ("gpu", p.gpu or "-"),
    ]
    e = p.elastic
    if e is not None:
        rows[-2] = ("backing region", _bytes(p.backing_bytes) + " virtual; the budget pays "
                    "the fixed part and the granted groups")
        rows += [
            ("elastic groups", f"{e.groups:,} of {e.tokens_per_group:,} tokens "
                               f"({e.pages_per_group:,} pages), {_bytes(e.group_bytes)} each"),
            ("elastic fixed part", _bytes(e.fixed_bytes) + " (aux, always backed)"),
            ("elastic floor / cap", f"{e.floor_groups:,} / {e.cap_groups:,} groups "
                                    f"({_bytes(p.charged_bytes)} at Configure)"),
            ("elastic weight", f"{e.weight:g}"),
        ]
    rows += [
        ("parallelism", f"TP {p.tp_size}, PP rank {p.pp_rank} of {p.pp_size}, "
                        f"layers {p.layer_start}..{p.layer_end - 1}"),
        ("draft layers", str(p.num_draft_layers)),
        ("req_to_token columns", f"{p.req_to_token_columns:,}"),
        ("fingerprint", p.fingerprint()),
    ]
    rows += [("note", n) for n in p.notes]
    return rows


def _stem(name: str) -> str:
    """``k.12`` -> ``k``; names without a numeric suffix are their own group."""
    head, _, tail = name.rpartition(".")
    return head if head and tail.isdigit() else name


def _groups(buffers: tuple[BufferSpec, ...]) -> list[list[BufferSpec]]:
    """Buffers of one stem, dtype, shape and kind together, in plan order."""
    groups: dict[tuple[Any, ...], list[BufferSpec]] = {}
    for b in buffers:
        key = (_stem(b.name), b.dtype, b.shape, b.kind, b.in_budget)
        groups.setdefault(key, []).append(b)
    return list(groups.values())


def _names(group: list[BufferSpec]) -> str:
    names = [b.name for b in group]
    if len(names) <= SHOWN_NAMES + 1:
        return ", ".join(names)
    return f"{', '.join(names[:SHOWN_NAMES])}, ... {names[-1]} ({len(names)} buffers)"


def _print_table(p: PoolPlan) -> None:
    from rich.table import Table

    from kvpool.tools.cli_run import console as console_for

    summary = Table(title="kvpoold plan", show_header=False, title_justify="left")
    summary.add_column("key", style="bold")
    summary.add_column("value")
    for key, value in _summary_rows(p):
        summary.add_row(key, value)

    buffers = Table(title=f"buffers ({len(p.buffers)})", title_justify="left")
    for col, justify in (("names", "left"), ("kind", "left"), ("dtype", "left"),
                         ("shape", "left"), ("each", "right"), ("total", "right")):
        buffers.add_column(col, justify=justify)  # type: ignore[arg-type]
    for group in _groups(p.buffers):
        first = group[0]
        kind = first.kind.value + ("" if first.in_budget else " (aux)")
        buffers.add_row(
            _names(group), kind, first.dtype.value, str(tuple(first.shape)),
            format_size(first.nbytes), format_size(sum(b.nbytes for b in group)),
        )
    console = console_for()
    if not console.is_terminal:
        console = console_for(width=140)  # pipes and files: do not wrap at 80 columns
    items: list[RenderableType] = [summary, buffers]
    for item in items:
        console.print(item)


def _vllm_rows(p: VllmPlan) -> list[tuple[str, str]]:
    rows = [
        ("engine", "vLLM 0.32"),
        ("model", p.model_architecture or "-"),
        ("kv cache dtype", p.cache_dtype),
        ("block size", f"{p.block_size:,} tokens"),
        ("max model len", f"{p.max_model_len:,}"),
        ("hybrid kv cache manager", "on" if p.hybrid else "off"),
        ("layout", p.layout.value),
        ("kv_cache_memory_bytes", _bytes(p.kv_cache_memory_bytes)),
        ("bytes per block", _bytes(p.bytes_per_block)),
        ("blocks", f"{p.num_blocks:,} (block 0 is vLLM's null block)"),
        ("backing region", _bytes(p.size_bytes) + " (one int8 allocation)"),
        ("max concurrency", f"{p.max_concurrency:.2f} requests of max model len"),
        ("parallelism", f"TP {p.tp_size}, PP rank {p.pp_rank} of {p.pp_size}"),
    ]
    return rows + [("note", n) for n in p.notes]


def _layer_list(names: tuple[str, ...]) -> str:
    if len(names) <= SHOWN_NAMES + 1:
        return ", ".join(names)
    return f"{', '.join(names[:SHOWN_NAMES])}, ... {names[-1]} ({len(names)} layers)"


def _print_vllm(p: VllmPlan) -> None:
    from rich.table import Table

    from kvpool.tools.cli_run import console as console_for

    summary = Table(title="kvpoold plan --engine vllm", show_header=False,
                    title_justify="left")
    summary.add_column("key", style="bold")
    summary.add_column("value")
    for key, value in _vllm_rows(p):
        summary.add_row(key, value)
    groups = Table(title=f"kv cache groups ({len(p.groups)})", title_justify="left")
    for col in ("#", "type", "block size", "page", "window", "layers"):
        groups.add_column(col)
    for i, g in enumerate(p.groups):
        kind = g.type.value + (" (uniform type)" if g.uniform_type else "")
        groups.add_row(str(i), kind, str(g.block_size), format_size(g.page_size_bytes),
                       "-" if g.sliding_window is None else str(g.sliding_window),
                       _layer_list(g.layer_names))
    tensors = Table(title=f"kv cache tensors ({len(p.tensors)}, one backing region)",
                    title_justify="left")
    for col in ("offset", "layer stride", "block stride", "layers"):
        tensors.add_column(col)
    for t in p.tensors:
        tensors.add_row(f"{t.offset:,}", f"{t.layer_stride:,}", f"{t.block_stride:,}",
                        _layer_list(t.layers))
    console = console_for()
    if not console.is_terminal:
        console = console_for(width=140)
    for item in (summary, groups, tensors):
        console.print(item)
