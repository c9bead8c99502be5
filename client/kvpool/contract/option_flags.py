"""The plan-option flags of ``kvpoold plan`` and ``kvpool configure``, built once from
:class:`~kvpool.contract.options.PlanOptions` (and, for ``kvpoold plan --engine vllm``, from
:class:`~kvpool.contract.vllm_plan.VllmOptions`): names, types, choices, help and defaults all
come from its fields, so the commands and Configure cannot drift apart."""

from __future__ import annotations

import argparse
import enum
import math
import typing
from typing import Any

import msgspec

from kvpool.contract.errors import InvalidArgument
from kvpool.contract.options import KV_CACHE_DTYPE_ALIASES, PlanOptions
from kvpool.contract.sizes import parse_size

# PlanOptions field -> flag name, where the flag reads better than the field.
FLAG_NAMES = {"budget_bytes": "budget"}
# Field -> other spellings its flag takes (each -> an accepted value), e.g. SGLang's bf16.
FLAG_ALIASES: dict[str, dict[str, enum.Enum]] = {"kv_cache_dtype": dict(KV_CACHE_DTYPE_ALIASES)}


def flag_of(field: str) -> str:
    """The command-line flag of a PlanOptions field (``page_size`` -> ``--page-size``)."""
    return "--" + FLAG_NAMES.get(field, field).replace("_", "-")


def _size(text: str) -> int:
    try:
        return parse_size(text, field="budget")
    except InvalidArgument as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _finite_float(text: str) -> float:
    """A float that is neither nan nor infinite (msgspec's bounds let nan through)."""
    value = float(text)
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"{text!r} is not a finite number")
    return value


def _base_type(annotation: Any) -> Any:
    """The type inside ``Annotated[...]`` and ``... | None``."""
    while True:
        origin = typing.get_origin(annotation)
        if origin is typing.Annotated:
            annotation = typing.get_args(annotation)[0]
        elif origin in (typing.Union, getattr(__import__("types"), "UnionType", None)):
            annotation = next(a for a in typing.get_args(annotation) if a is not type(None))
        else:
            return annotation


def _description(annotation: Any) -> str:
    for arg in typing.get_args(annotation):
        if isinstance(arg, msgspec.Meta) and arg.description:
            return arg.description
        inner = _description(arg)
        if inner:
            return inner
    return ""


def add_option_flags(parser: argparse.ArgumentParser | argparse._ArgumentGroup,
                     options_type: type[msgspec.Struct] = PlanOptions, *,
                     skip: frozenset[str] = frozenset()) -> None:
    """Add one flag per field of ``options_type`` (PlanOptions by default) except ``skip``;
    every default is None (unset: the plan's default, which the help text shows). A field
    named ``*_bytes`` takes a size (``40GiB``)."""
    hints = typing.get_type_hints(options_type, include_extras=True)
    for field in msgspec.structs.fields(options_type):
        if field.name in skip:
            continue
        annotation = hints[field.name]
        base = _base_type(annotation)
        help_text = _description(annotation)
        default = field.default
        if default is not msgspec.NODEFAULT and default is not None and base is not bool:
            shown = default.value if isinstance(default, enum.Enum) else default
            help_text += f" (default {shown})"
        flag = flag_of(field.name)
        if base is bool:
            parser.add_argument(flag, action="store_true", default=None, help=help_text)
        elif isinstance(base, type) and issubclass(base, enum.Enum):
            aliases = {k: v.value for k, v in FLAG_ALIASES.get(field.name, {}).items()
                       if v in base.__members__.values()}
            if aliases:
                help_text += "; also " + ", ".join(f"{k} (= {v})" for k, v in aliases.items())
            parser.add_argument(flag, choices=[m.value for m in base], default=None,
                                type=lambda text, a=aliases: a.get(text, text), help=help_text)
        elif typing.get_origin(base) is typing.Literal:
            parser.add_argument(flag, choices=typing.get_args(base), default=None,
                                help=help_text)
        elif field.name.endswith("_bytes"):
            parser.add_argument(flag, type=_size, metavar="SIZE", default=None, help=help_text)
        elif base is float:
            parser.add_argument(flag, type=_finite_float, metavar="R", default=None,
                                help=help_text)
        else:
            parser.add_argument(flag, type=int, metavar="N", default=None, help=help_text)


def option_values(args: argparse.Namespace,
                  options_type: type[msgspec.Struct] = PlanOptions) -> dict[str, Any]:
    """The fields of ``options_type`` the command line set (the others keep their
    defaults)."""
    out = {}
    for field in options_type.__struct_fields__:
        value = getattr(args, FLAG_NAMES.get(field, field), None)
        if value is not None:
            out[field] = value
    return out
