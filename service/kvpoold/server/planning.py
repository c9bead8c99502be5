"""Configure's pure part: resolve the model (HF config text or spec) and options, then plan.

Planning is O(layers) of Python (bounded by ``kvpool.contract.limits.MAX_LAYERS``) and decoding the
config O(its characters) (bounded by ``MAX_CONFIG_CHARS``); :func:`plan_off_loop` runs both in a
worker thread, so even the largest allowed request leaves the event loop free.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

from kvpool.contract.codec import plan_to_json
from kvpool.contract.errors import InvalidArgument
from kvpool.contract.plan import PoolPlan
from kvpool.contract.spec import decode_spec
from kvpool.contract.vllm_plan import make_vllm_options
from kvpoold.server.args import ConfigureArgs
from kvpoold.sizing import make_options, plan


def plan_from_args(args: ConfigureArgs, available_bytes: int) -> PoolPlan:
    """The plan a Configure request asks for (no I/O, no torch).

    Args:
        args: the request.
        available_bytes: the daemon's budget left, quoted when no pool budget is given.

    Raises:
        InvalidArgument: a bad model or option, or an unplannable combination; names the field.
    """
    if args.engine == "vllm":
        return _plan_vllm_pool(args)
    if args.hf_config_json is not None:
        from kvpoold.hf import parse_config_json, read_hf

        # read as Hugging Face writes it (Infinity, NaN), bounded; the refusals name the field
        config = parse_config_json(args.hf_config_json, "hf_config_json",
                                   field="hf_config_json")
        model = read_hf(config, where="hf_config_json", assume=args.assume_architecture)
        spec, source, decided = model.spec, model.source, model.decided_by
    elif args.spec is not None:
        spec, source, decided = decode_spec(args.spec, source="spec"), "spec", ()
    else:
        raise InvalidArgument("give the model: hf_config_json or spec", field="model")
    opts = args.options
    if opts.get("budget_bytes") is None and opts.get("max_total_tokens") is None:
        raise InvalidArgument(
            f"give budget_bytes (bytes for this pool's KV and state; the daemon has "
            f"{available_bytes:,} B left), max_total_tokens, or both",
            field="budget_bytes",
        )
    return plan(spec, make_options(**opts), source=source, decided_by=decided)


def _plan_vllm_pool(args: ConfigureArgs) -> PoolPlan:
    """A vLLM-layout pool's plan (engine vllm): vLLM 0.32's KV cache of the HF config.

    Raises:
        InvalidArgument: a bad config or knob (the field named ``vllm.<knob>``), or a plan
            vLLM would refuse.
    """
    from kvpoold.hf import parse_config_json
    from kvpoold.sizing.vllm_pool import plan_vllm_pool

    if args.hf_config_json is None:
        raise InvalidArgument("give the model's HF config.json (hf_config_json)",
                              field="hf_config_json")
    config = parse_config_json(args.hf_config_json, "hf_config_json", field="hf_config_json")
    try:
        options = make_vllm_options(**(args.vllm or {}))
    except InvalidArgument as exc:
        field = f"vllm.{exc.field}" if exc.field else "vllm"
        raise InvalidArgument(f"{exc.message} (Configure's vllm.{exc.field or '...'})",
                              field=field) from exc
    try:
        return plan_vllm_pool(config, options, where="hf_config_json")
    except InvalidArgument as exc:
        if exc.field is None or exc.field.startswith(("vllm.", "hf_config_json", "model")):
            raise
        raise InvalidArgument(exc.message, field=f"vllm.{exc.field}") from exc


@dataclass(frozen=True)
class Planned:
    """A plan with what Configure answers about it, all computed off the loop."""

    plan: PoolPlan
    fingerprint: str
    plan_json: str


def plan_fully(args: ConfigureArgs, available_bytes: int) -> Planned:
    """:func:`plan_from_args`, its fingerprint and its JSON text (blocking: a worker thread)."""
    new_plan = plan_from_args(args, available_bytes)
    return Planned(new_plan, new_plan.fingerprint(), plan_to_json(new_plan))


async def plan_off_loop(args: ConfigureArgs, available_bytes: int,
                        slots: asyncio.Semaphore) -> Planned:
    """:func:`plan_fully` in a worker thread, at most ``slots`` at once (the rest wait their
    turn), so a slow plan never holds the event loop and a burst of Configures cannot take
    every worker thread (pool builds use the same executor).

    Reads nothing of the daemon's state: the caller checks names and budget after the await.
    """
    async with slots:
        return await asyncio.to_thread(plan_fully, args, available_bytes)
