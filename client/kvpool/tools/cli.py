"""``kvpool``: the client command line (``configure``, ``stats``, ``leases``, ``drop``, ...).

The parser is built from :data:`SUBCOMMANDS`, one ``add_<name>(subparsers, common)`` function
per subcommand that registers its parser and sets ``func``; a new subcommand (``demo``, ``top``)
is one more function in that table. torch is never imported here: ``kvpool stats`` starts in
the time it takes to import grpc.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import msgspec

from kvpool.contract.errors import InvalidArgument
from kvpool.contract.option_flags import add_option_flags, flag_of, option_values
from kvpool.contract.options import PlanOptions
from kvpool.contract.plan import ASSUMABLE_FAMILIES
from kvpool.contract.records import ElasticStats, SealedStats, Stats
from kvpool.contract.vllm_plan import VllmOptions
from kvpool.tools.cli_common import client_from, common_options, count, load_spec_mapping
from kvpool.tools.cli_run import command_parser, run_command_line
from kvpool.tools.demo import add_demo
from kvpool.tools.events import add_events
from kvpool.tools.hf_hub_cache import local_model_config
from kvpool.tools.top import add_top

AddParser = Callable[[Any, argparse.ArgumentParser], argparse.ArgumentParser]


def _human(nbytes: int) -> str:
    from kvpool.contract.sizes import format_size

    return format_size(nbytes)


# Keys whose values are random 63-bit ids: a JSON number above 2**53 loses digits in jq and
# JavaScript, so the CLI's --json writes these as decimal strings (the Python API keeps ints).
STRING_IDS = frozenset({"lease_id"})


def ids_as_strings(value: Any) -> Any:
    """``value`` as JSON builtins, with every :data:`STRING_IDS` integer a decimal string."""
    if isinstance(value, dict):
        return {k: str(v) if k in STRING_IDS and isinstance(v, int) else ids_as_strings(v)
                for k, v in value.items()}
    if isinstance(value, list):
        return [ids_as_strings(v) for v in value]
    return value


def _print_json(value: Any) -> None:
    builtins = ids_as_strings(msgspec.to_builtins(value))
    sys.stdout.write(msgspec.json.format(msgspec.json.encode(builtins), indent=2).decode() + "\n")


def _command(sub: Any, common: argparse.ArgumentParser, name: str,
             func: Callable[[argparse.Namespace], int], help: str, description: str,
             ) -> argparse.ArgumentParser:
    """A subcommand with the common flags that runs ``func``."""
    p: argparse.ArgumentParser = sub.add_parser(name, parents=[common], help=help,
                                                description=description)
    p.set_defaults(func=func)
    return p


# -- configure ----------------------------------------------------------------------------------

def add_configure(sub: Any, common: argparse.ArgumentParser) -> argparse.ArgumentParser:
    p = _command(sub, common, "configure", run_configure, "plan and build a pool",
                 "Plan a pool for a model and build it in the daemon (or only plan it with "
                 "--dry-run). Idempotent for the same layout.")
    p.add_argument("pool", help="pool name: [a-z0-9][a-z0-9._-]{0,62}")
    model = p.add_mutually_exclusive_group(required=True)
    model.add_argument("--hf-config", type=Path, metavar="PATH",
                       help="a Hugging Face config.json (or its model directory), or a Hub id "
                            "(org/name) already in the local Hub cache; nothing is downloaded")
    model.add_argument("--spec", type=Path, metavar="PATH",
                       help="a hand-written kvpool model spec (.json or .toml)")
    add_option_flags(p)  # the same knobs as `kvpoold plan`, from PlanOptions
    p.add_argument("--engine", choices=ENGINES, default="sglang",
                   help="the pool's layout: sglang (the default) or vllm (vLLM 0.32's KV-cache "
                        "tensors and block ids, planned from --hf-config; --budget is then its "
                        "kv_cache_memory_bytes)")
    vllm = p.add_argument_group(
        "vLLM (--engine vllm)",
        "vLLM's own knobs; --kv-cache-dtype, --tp-size, --pp-size and --pp-rank apply too")
    add_option_flags(vllm, VllmOptions, skip=VLLM_SHARED)
    p.add_argument("--assume-architecture", metavar="FAMILY", choices=ASSUMABLE_FAMILIES,
                   help="with --hf-config: read a class SGLang's registry does not know as this "
                        f"family ({', '.join(ASSUMABLE_FAMILIES)}); the plan says 'assumed'")
    p.add_argument("--dry-run", action="store_true", help="plan and check; allocate nothing")
    p.add_argument("--json", action="store_true", help="print the plan and result as JSON")
    return p


# the flags both layouts read (the same meaning in each), and each one's own
VLLM_SHARED = frozenset(PlanOptions.__struct_fields__) & frozenset(VllmOptions.__struct_fields__)
SGLANG_ONLY = frozenset(PlanOptions.__struct_fields__) - VLLM_SHARED - {"budget_bytes"}
VLLM_ONLY = frozenset(VllmOptions.__struct_fields__) - VLLM_SHARED
ENGINES = ("sglang", "vllm")


def _flags_set(values: dict[str, Any], fields: frozenset[str]) -> list[str]:
    return sorted(flag_of(f) for f in fields if f in values)


def _configure_options(args: argparse.Namespace) -> dict[str, Any]:
    """Configure's options from the flags: PlanOptions fields, or for ``--engine vllm``
    ``engine`` and ``vllm`` (the VllmOptions fields set; ``--budget`` is its
    kv_cache_memory_bytes).

    Raises:
        InvalidArgument: a flag of the other layout, or a vLLM pool without a KV budget.
    """
    sglang, vllm = option_values(args), option_values(args, VllmOptions)
    if args.engine != "vllm":
        wrong = _flags_set(vllm, VLLM_ONLY)
        if wrong:
            raise InvalidArgument(f"vLLM's knob (set: {', '.join(wrong)}); add --engine vllm",
                                  field=wrong[0].removeprefix("--").replace("-", "_"))
        return sglang
    wrong = _flags_set(sglang, SGLANG_ONLY)
    if wrong:
        raise InvalidArgument(f"an SGLang-layout option (set: {', '.join(wrong)}); a pool of "
                              "--engine vllm takes vLLM's knobs (kvpool configure --help)",
                              field=wrong[0].removeprefix("--").replace("-", "_"))
    budget = sglang.get("budget_bytes")
    if budget is not None and vllm.setdefault("kv_cache_memory_bytes", budget) != budget:
        raise InvalidArgument("give --budget or --kv-cache-memory-bytes, not both",
                              field="kv_cache_memory_bytes")
    return {"engine": "vllm", "vllm": vllm}


def run_configure(args: argparse.Namespace) -> int:
    options = _configure_options(args)
    model: dict[str, Any] = (
        {"hf_config": local_model_config(args.hf_config, "hf_config")} if args.hf_config else
        {"spec": load_spec_mapping(args.spec)}
    )
    if args.assume_architecture:
        model["assume_architecture"] = args.assume_architecture
    with client_from(args) as client:
        result = client.configure(args.pool, dry_run=args.dry_run, **model, **options)
    if args.json:
        _print_json({"pool": args.pool, "created": result.created, "dry_run": result.dry_run,
                     "fingerprint": result.fingerprint,
                     "budget_available_bytes": result.budget_available_bytes,
                     "plan": msgspec.json.decode(result.plan_json)})
        return 0
    plan = result.plan
    state = "planned (dry run)" if result.dry_run else "created" if result.created else "exists"
    print(f"pool {args.pool}: {state}, fingerprint {result.fingerprint}")
    slots = ("Mamba states only" if plan.vllm is not None and plan.vllm.state_only
             else f"{plan.max_total_num_tokens:,} tokens")
    print(f"  {plan.architecture}, {plan.kv_cache_dtype}, page {plan.page_size}: "
          f"{plan.num_pages:,} pages ({slots}), {plan.max_running_requests:,} requests")
    print(f"  backing {_human(plan.backing_bytes)} (KV+state {_human(plan.total_bytes)}, aux "
          f"{_human(plan.aux_bytes)}); daemon budget left {_human(result.budget_available_bytes)}")
    e = plan.elastic
    if e is not None:
        print(f"  elastic: {e.groups:,} groups of {e.tokens_per_group:,} tokens "
              f"({_human(e.group_bytes)} each; {_human(plan.backing_bytes)} virtual), floor "
              f"{e.floor_groups:,}, cap {e.cap_groups:,}, weight {e.weight:g}; the budget pays "
              f"{_human(e.fixed_bytes)} fixed + the granted groups")
    v = plan.vllm
    if v is not None:
        print(f"  vllm: {v.num_blocks:,} blocks of {v.block_size} tokens "
              f"({_human(v.bytes_per_block)} each), {len(v.groups)} group(s), "
              f"{len(v.tensors)} KV-cache tensor(s), layout {v.layout.value}, max_model_len "
              f"{v.max_model_len:,}, max concurrency {v.max_concurrency:.2f}")
    for note in plan.notes:
        print(f"  note: {note}")
    return 0


# -- stats / leases -----------------------------------------------------------------------------

def add_stats(sub: Any, common: argparse.ArgumentParser) -> argparse.ArgumentParser:
    p = _command(sub, common, "stats", run_stats, "the daemon, its pools and leases",
                 "Print the daemon's budget, each pool's per-space counters and each lease's "
                 "holdings.")
    p.add_argument("--pool", default="", help="only this pool")
    p.add_argument("--json", action="store_true",
                   help='print {"daemon": {...}, "pools": [...], "leases": [...]}')
    return p


def run_stats(args: argparse.Namespace) -> int:
    with client_from(args) as client:
        stats = client.stats(args.pool)
    print_stats(stats, as_json=args.json)
    return 0


def print_stats(stats: Stats, *, as_json: bool = False) -> None:
    """Print ``stats`` as ``kvpool stats`` does: text (:func:`stats_lines`, then the leases), or
    with ``as_json`` the record as JSON (an elastic pool's ``elastic`` object, ``null`` for a
    fixed pool; lease ids as decimal strings)."""
    if as_json:
        _print_json(stats)
        return
    for line in stats_lines(stats):
        print(line)
    if stats.leases:
        print_leases(stats.leases)


def stats_lines(stats: Stats) -> list[str]:
    """``kvpool stats``'s text, leases aside: the daemon's line, then per pool its line, its
    elastic lines (an elastic pool only, :func:`elastic_lines`) and a line per id space."""
    d = stats.daemon
    hidden = (f" ({count(d.other_leases, 'lease')} of other identities, not shown)"
              if d.other_leases else "")
    lines = [f"kvpoold {d.version} on {d.device}: {_human(d.used_bytes)} of "
             f"{_human(d.budget_bytes)} used, {count(d.num_pools, 'pool')}, "
             f"{count(d.num_leases, 'lease')}{hidden}, up {d.uptime_seconds:.0f}s (leases opened "
             f"{d.leases_opened}, closed {d.leases_closed}, expired {d.leases_expired})"
             + (f"; event loop stalled {count(d.loop_stalls, 'time')}, longest "
                f"{d.loop_longest_stall_seconds:.2f} s" if d.loop_stalls else "")]
    if d.kv_events_endpoint:
        lines.append(f"kv events on {d.kv_events_endpoint}"
                     + (f" (replay {d.kv_events_replay_endpoint})"
                        if d.kv_events_replay_endpoint else "")
                     + f": {d.kv_events_published:,} batches, {d.kv_events_dropped:,} dropped, "
                     f"last seq {d.kv_events_last_seq}")
    for p in stats.pools:
        lines.append(f"pool {p.name}: {p.architecture} {p.kv_cache_dtype} page {p.page_size}, "
                     f"{_human(p.backing_bytes)}, attached {p.attached}, sharing {p.sharing}, "
                     f"fingerprint {p.fingerprint}")
        if p.elastic is not None:
            lines += elastic_lines(p.elastic)
        if p.sealed is not None:
            lines.append(sealed_line(p.sealed))
        for space, k in p.spaces.items():
            share = 100.0 * k.used / k.capacity if k.capacity else 0.0
            # used counts what leases hold, their page caches' unused ids included
            cached = sum(x.cached.get(p.name, {}).get(space, 0) for x in stats.leases)
            lines.append(f"  {space:<10} used {k.used:>10,} / {k.capacity:<10,} ({share:5.1f}%)  "
                         + (f"({cached:,} cached unused)  " if cached else "")
                         + f"high {k.high_water:,}  allocs {k.allocs:,}  frees {k.frees:,}  "
                         f"failed {k.failed_allocs:,}")
    return lines


def sealed_line(s: SealedStats) -> str:
    """A pool's sealed-page directory in one line (docs/restart.md; ``kvpool sealed POOL`` lists
    ages and layouts)."""
    return (f"  {'sealed':<10} {s.held:,} held by leases, {s.kept:,} kept "
            f"({_human(s.kept_bytes)}, evictable); sealed {s.sealed_total:,}, adopted "
            f"{s.adopted_total:,} (epoch {s.epoch}), evicted {s.evicted_total:,}, corrupt "
            f"{s.corrupt_total:,}")


def elastic_lines(e: ElasticStats) -> list[str]:
    """Two lines on an elastic pool: its groups (granted of all, reclaiming, floor, cap,
    weight), then its bytes (granted of virtual, backed) and counters (grants, reclaims with
    their mean and longest seconds, revoked leases)."""
    mean = f"{e.reclaim_seconds_sum / e.reclaims:.3f} s" if e.reclaims else "-"
    return [
        f"  {'elastic':<10} granted {e.granted_groups:,} / {e.groups:,} groups of "
        f"{_human(e.group_bytes)} ({e.reclaiming_groups:,} reclaiming), floor "
        f"{e.floor_groups:,}, cap {e.cap_groups:,}, weight {e.weight:g}",
        f"  {'':<10} granted {_human(e.granted_bytes)} of {_human(e.virtual_bytes)} "
        f"virtual, backed {_human(e.backed_bytes)}; grants {e.grants:,}, reclaims "
        f"{e.reclaims:,} (mean {mean}, max {e.reclaim_seconds_max:.3f} s), revoked leases "
        f"{e.revoked_leases:,}"
        + (f"; FAILED {e.failed_groups:,} groups (their memory could not be freed: retried "
           "on every sweep, see the daemon's log)" if e.failed_groups else ""),
    ]


def add_leases(sub: Any, common: argparse.ArgumentParser) -> argparse.ArgumentParser:
    p = _command(sub, common, "leases", run_leases, "who holds what",
                 "List open leases: name, time to expiry, ids held per pool and space (with how "
                 "many of them its page caches hold unused, as reported).")
    p.add_argument("--json", action="store_true", help="print the leases as a JSON list")
    return p


def print_leases(leases: Sequence[Any]) -> None:
    print(f"{'LEASE':<20} {'NAME':<24} {'EXPIRES':>8} {'ATT':>4}  HELD")
    for x in leases:
        held = x.held_text()
        print(f"{x.lease_id:<20} {x.name:<24.24} {x.expires_in_seconds:>7.1f}s {x.attached:>4}"
              f"  {held}")


def run_leases(args: argparse.Namespace) -> int:
    with client_from(args) as client:
        leases = client.stats().leases
    if args.json:
        _print_json(leases)
    elif leases:
        print_leases(leases)
    else:
        print("no open leases")
    return 0


# -- drop ---------------------------------------------------------------------------------------

def add_drop(sub: Any, common: argparse.ArgumentParser) -> argparse.ArgumentParser:
    p = _command(sub, common, "drop", run_drop, "release a pool",
                 "Release a pool's memory. Refused while a lease holds ids in it or a client is "
                 "attached, unless --force.")
    p.add_argument("pool")
    p.add_argument("--force", action="store_true",
                   help="reclaim every id and end every attachment (engines using it break)")
    return p


def run_drop(args: argparse.Namespace) -> int:
    with client_from(args) as client:
        released = client.drop(args.pool, force=args.force)
    print(f"dropped {args.pool}: released {_human(released.released_bytes)}, reclaimed "
          f"{count(released.total, 'id')}, detached {released.detached}")
    return 0


def add_sealed(sub: Any, common: argparse.ArgumentParser) -> argparse.ArgumentParser:
    p = _command(sub, common, "sealed", run_sealed, "a pool's sealed pages",
                 "A pool's sealed-page directory: KV that outlived its engine, kept for the "
                 "next engine of the same layout (docs/restart.md). With --evict, give every "
                 "page it keeps back to the pool first (admin).")
    p.add_argument("pool")
    p.add_argument("--evict", action="store_true",
                   help="free every page the directory keeps (pages leases hold stay)")
    p.add_argument("--json", action="store_true", help="print the directory as JSON")
    return p


def run_sealed(args: argparse.Namespace) -> int:
    with client_from(args) as client:
        s = client.sealed(args.pool, evict=args.evict)
    if args.json:
        _print_json(s)
        return 0
    if args.evict:
        print(f"evicted {count(s.evicted, 'page')} from {args.pool}'s directory")
    print(f"{args.pool}: {count(s.kept, 'sealed page')} kept ({_human(s.kept_bytes)}), "
          f"{s.held:,} held by leases; layouts: {', '.join(s.layouts) or '-'}")
    if s.kept:
        print(f"  sealed {s.newest_seconds:,.1f} s to {s.oldest_seconds:,.1f} s ago")
    print(f"  since the pool was built: {s.sealed_total:,} sealed, {s.adopted_total:,} "
          f"adopted (epoch {s.epoch}), {s.evicted_total:,} evicted, {s.corrupt_total:,} "
          "found changed and freed")
    if s.events_rank is not None:
        print(f"  KV events: rank {s.events_rank} (its batches' data_parallel_rank; kvpool "
              "events)")
    return 0


SUBCOMMANDS: tuple[AddParser, ...] = (add_configure, add_stats, add_leases, add_drop,
                                      add_sealed, add_events, add_top, add_demo)


def build_parser(subcommands: Sequence[AddParser] = SUBCOMMANDS) -> argparse.ArgumentParser:
    parser, sub = command_parser("kvpool", "Client of kvpoold, the KV-cache pool daemon.")
    common = common_options()
    for add in subcommands:
        add(sub, common)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run one subcommand; exit 2 for bad input, 1 for other daemon errors, 130 on Ctrl-C."""
    parser = build_parser()
    return run_command_line("kvpool", parser, argv)


if __name__ == "__main__":
    sys.exit(main())
