"""``kvpoold plan``: size a pool from a model config and print the plan; nothing is allocated."""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any, get_args

import msgspec

from kvpool.errors import InvalidArgument
from kvpool.options import KVCacheDType, SpeculativeAlgorithm
from kvpool.plan import BufferSpec
from kvpool.sizes import format_size, parse_size
from kvpoold.hf import load_model
from kvpoold.sizing import PlanOptions, PoolPlan, make_options, plan

if TYPE_CHECKING:
    from rich.console import RenderableType

# The accepted values come from the option types, so the CLI and Configure cannot drift apart.
KV_CACHE_DTYPES = tuple(d.value for d in KVCacheDType)
SPECULATIVE_ALGORITHMS = get_args(SpeculativeAlgorithm)
# a per-layer group longer than this shows its first names and a count
SHOWN_NAMES = 3

# PlanOptions field <- argparse dest, for the fields whose names differ
_OPTION_FIELDS = {"budget": "budget_bytes"}


def _finite_float(text: str) -> float:
    """argparse type: a float that is neither nan nor infinite (msgspec limits miss nan)."""
    value = float(text)
    if not math.isfinite(value):
        raise ValueError(text)
    return value


def add_parser(subparsers: argparse._SubParsersAction[Any]) -> argparse.ArgumentParser:
    """Register ``plan`` with the ``kvpoold`` subcommand parser and return its parser."""
    p = subparsers.add_parser(
        "plan",
        help="size a pool for a model and print the plan (dry run, nothing allocated)",
        description="Size the KV pool of one model for one device, the way the daemon would, "
                    "and print the sizes and buffer layout. Nothing is allocated.",
    )
    p.add_argument("--model-config", type=Path, required=True, metavar="PATH",
                   help="HF config.json (or its model directory), or a spec file (.json/.toml)")
    p.add_argument("--budget", metavar="SIZE",
                   help="bytes for KV + state: 42949672960, 40GiB, 512MiB, 1.5GB ...")
    p.add_argument("--page-size", type=int, metavar="N", help="tokens per page (default 1)")
    p.add_argument("--kv-cache-dtype", choices=KV_CACHE_DTYPES, default=None,
                   help="KV element type (default auto: the model dtype, or fp8_e4m3 when the "
                        "checkpoint quantizes its KV cache)")
    p.add_argument("--tp-size", type=int, metavar="N", help="tensor-parallel ranks (default 1)")
    p.add_argument("--pp-size", type=int, metavar="N", help="pipeline stages (default 1)")
    p.add_argument("--pp-rank", type=int, metavar="N",
                   help="this device's pipeline stage, 0-based (default 0)")
    p.add_argument("--context-length", type=int, metavar="N",
                   help="override the model's max_position_embeddings")
    p.add_argument("--max-running-requests", type=int, metavar="N",
                   help="requests served at once (default: from the token count, 2048 to 4096, "
                        "at most half the tokens)")
    p.add_argument("--max-total-tokens", type=int, metavar="N",
                   help="cap on the token count (alone: size by tokens instead of bytes)")
    p.add_argument("--swa-full-tokens-ratio", type=_finite_float, default=0.8, metavar="R",
                   help="SWA tokens per full-attention token in hybrid SWA pools (default 0.8)")
    p.add_argument("--mamba-full-memory-ratio", type=_finite_float, default=0.9, metavar="R",
                   help="mamba state memory per KV memory in hybrid linear pools (default 0.9)")
    p.add_argument("--disable-radix-cache", action="store_true",
                   help="one state slot per request instead of three (hybrid linear)")
    p.add_argument("--speculative-algorithm", choices=SPECULATIVE_ALGORITHMS, default="none",
                   help="speculative decoding whose draft layers share the pool (default none)")
    p.add_argument("--speculative-num-draft-layers", type=int, metavar="N",
                   help="draft layers sharing the pool (default: the model's MTP layers, or 1)")
    p.add_argument("--speculative-num-draft-tokens", type=int, metavar="N",
                   help="tokens verified per speculative step; hybrid linear models keep that "
                        "many intermediate conv/SSM states per running request (required there, "
                        "with --max-running-requests)")
    p.add_argument("--json", action="store_true", help="print the plan as JSON")
    p.set_defaults(func=run)
    return p


def _options(args: argparse.Namespace) -> PlanOptions:
    if args.budget is None and args.max_total_tokens is None:
        raise InvalidArgument("give --budget SIZE, --max-total-tokens N, or both",
                              field="budget")
    budget = None if args.budget is None else parse_size(args.budget, field="budget")
    fields = {
        "budget_bytes": budget,
        "page_size": args.page_size,
        "kv_cache_dtype": args.kv_cache_dtype,
        "tp_size": args.tp_size,
        "pp_size": args.pp_size,
        "pp_rank": args.pp_rank,
        "context_length": args.context_length,
        "max_running_requests": args.max_running_requests,
        "max_total_tokens": args.max_total_tokens,
        "swa_full_tokens_ratio": args.swa_full_tokens_ratio,
        "mamba_full_memory_ratio": args.mamba_full_memory_ratio,
        "disable_radix_cache": args.disable_radix_cache,
        "speculative_algorithm": args.speculative_algorithm,
        "speculative_num_draft_layers": args.speculative_num_draft_layers,
        "speculative_num_draft_tokens": args.speculative_num_draft_tokens,
    }
    try:
        return make_options(**fields)
    except InvalidArgument as exc:
        flag = _flag(exc.field)
        if flag is None:
            raise
        raise InvalidArgument(f"{exc.message} (set by {flag})", field=exc.field) from exc


def _flag(field: str | None) -> str | None:
    """The command-line flag behind a PlanOptions field (``page_size`` -> ``--page-size``)."""
    if field is None:
        return None
    dest = next((d for d, f in _OPTION_FIELDS.items() if f == field), field)
    return "--" + dest.replace("_", "-")


def run(args: argparse.Namespace) -> int:
    """Plan and print; every bad input raises :class:`InvalidArgument` (exit 2 in ``main``).

    Raises:
        InvalidArgument: a bad flag value, an unreadable config, or a plan that cannot fit.
    """
    options = _options(args)
    spec, source = load_model(args.model_config)
    result = plan(spec, options, source=source)
    if args.json:
        sys.stdout.write(msgspec.json.format(result.to_json(), indent=2).decode() + "\n")
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
        ("page size", f"{p.page_size:,} tokens"),
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
        ("in budget", _bytes(p.total_bytes)),
        ("aux (outside budget)", _bytes(p.aux_bytes)),
        ("backing region", _bytes(p.backing_bytes)),
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
    from rich.console import Console
    from rich.table import Table

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
    console = Console()
    if not console.is_terminal:
        console = Console(width=140)  # pipes and files: do not wrap at 80 columns
    items: list[RenderableType] = [summary, buffers]
    for item in items:
        console.print(item)
