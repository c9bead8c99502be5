"""Configure's pure part: resolve the model (HF config text or spec) and options, then plan."""

from __future__ import annotations

import msgspec

from kvpool.errors import InvalidArgument
from kvpool.plan import PoolPlan
from kvpool.spec import decode_spec
from kvpoold.server.records import ConfigureArgs
from kvpoold.sizing import make_options, plan


def plan_from_args(args: ConfigureArgs, available_bytes: int) -> PoolPlan:
    """The plan a Configure request asks for (no I/O, no torch).

    Args:
        args: the request.
        available_bytes: the daemon's budget left, quoted when no pool budget is given.

    Raises:
        InvalidArgument: a bad model or option, or an unplannable combination; names the field.
    """
    if args.hf_config_json is not None:
        from kvpoold.hf import spec_from_hf

        try:
            config = msgspec.json.decode(args.hf_config_json)
        except msgspec.DecodeError as exc:
            raise InvalidArgument(f"hf_config_json is not valid JSON: {exc}",
                                  field="hf_config_json") from exc
        if not isinstance(config, dict):
            raise InvalidArgument(
                f"hf_config_json holds a JSON {type(config).__name__}, expected an object",
                field="hf_config_json",
            )
        spec, source = spec_from_hf(config, where="hf_config_json")
    elif args.spec is not None:
        spec, source = decode_spec(args.spec, source="spec"), "spec"
    else:
        raise InvalidArgument("give the model: hf_config_json or spec", field="model")
    opts = args.options
    if opts.get("budget_bytes") is None and opts.get("max_total_tokens") is None:
        raise InvalidArgument(
            f"give budget_bytes (bytes for this pool's KV and state; the daemon has "
            f"{available_bytes:,} B left), max_total_tokens, or both",
            field="budget_bytes",
        )
    return plan(spec, make_options(**opts), source=source)
