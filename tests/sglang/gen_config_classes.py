"""Generate ``service/kvpoold/config_classes.json``: how transformers loads each config class.

Run with a side venv's python (SGLang 0.5.23 and vLLM 0.32 both load configs through the same
transformers, 5.19)::

    .venv-sglang/bin/python tests/sglang/gen_config_classes.py            # print the table
    .venv-sglang/bin/python tests/sglang/gen_config_classes.py --write    # rewrite the data file

For every ``model_type`` of transformers' ``CONFIG_MAPPING`` and every sub-config class they
name (``Qwen2_5_VLTextConfig`` as ``qwen2_5_vl_text``), the facts kvpool's config reader
(:mod:`kvpoold.hf_view`) needs to see a ``config.json`` as the engines see it:

- ``aliases``: the class's ``attribute_map`` entries for the keys kvpool reads
  (``num_hidden_layers -> n_layer``): the canonical name reads the legacy key.
- ``defaults``: the dataclass default of each of those keys (under its canonical name) that is
  a plain value, for configs that omit it (``multi_query`` is True on Falcon and GPT-BigCode).
- ``sliding_switch``: the value ``sliding_window`` becomes when ``use_sliding_window`` is false
  (``null``, or ``0`` for Qwen2-MoE), found by instantiating the class; absent when the class
  has no such switch.
- ``sub_configs``: the model type of each sub-config class (``text_config``, ...).

The output is data only; ``tests/integration/test_config_classes.py`` regenerates it and fails
on any difference.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import warnings
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
TARGET = REPO / "service" / "kvpoold" / "config_classes.json"
# The keys kvpool reads from a (text) config, by their canonical names.
READ_KEYS = (
    "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "num_kv_heads",
    "n_head_kv", "hidden_size", "head_dim", "intermediate_size", "max_position_embeddings",
    "multi_query", "new_decoder_architecture", "sliding_window", "sliding_window_pattern",
    "use_sliding_window", "max_window_layers", "kv_lora_rank", "qk_rope_head_dim",
    "full_attention_interval",
)
PROBE_WINDOW = 4096


def _plain(value: Any) -> bool:
    return value is None or (isinstance(value, bool | int | float | str)
                             and value == value)  # NaN is not a default worth keeping


def _defaults(cls: type, aliases: dict[str, str]) -> dict[str, Any]:
    if not dataclasses.is_dataclass(cls):
        return {}
    fields = {f.name: f.default for f in dataclasses.fields(cls)
              if f.default is not dataclasses.MISSING}
    out: dict[str, Any] = {}
    for key in READ_KEYS:
        name = aliases.get(key, key)
        if name in fields and fields[name] is not None and _plain(fields[name]):
            out[key] = fields[name]
    return out


def _sliding_switch(cls: type) -> tuple[bool, Any]:
    """(has the switch, what sliding_window becomes when it is off)."""
    names = ({f.name for f in dataclasses.fields(cls)} if dataclasses.is_dataclass(cls)
             else set())
    if "use_sliding_window" not in names or "sliding_window" not in names:
        return False, None
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            config = cls(use_sliding_window=False, sliding_window=PROBE_WINDOW)
    except Exception:  # a class that cannot be built bare says nothing
        return False, None
    value = getattr(config, "sliding_window", PROBE_WINDOW)
    if value == PROBE_WINDOW:
        return False, None
    return True, value


def _row(cls: type) -> dict[str, Any]:
    raw = getattr(cls, "attribute_map", {}) or {}
    aliases = {k: v for k, v in raw.items() if k in READ_KEYS and isinstance(v, str)}
    row: dict[str, Any] = {}
    if aliases:
        row["aliases"] = dict(sorted(aliases.items()))
    defaults = _defaults(cls, aliases)
    if defaults:
        row["defaults"] = defaults
    switch, value = _sliding_switch(cls)
    if switch:
        row["sliding_switch"] = value
    subs = {name: sub.model_type for name, sub in (getattr(cls, "sub_configs", {}) or {}).items()
            if isinstance(getattr(sub, "model_type", None), str) and sub.model_type}
    if subs:
        row["sub_configs"] = dict(sorted(subs.items()))
    return row


def render() -> str:
    import transformers
    from transformers import CONFIG_MAPPING

    classes: dict[str, type] = {}
    pending = [(mt, CONFIG_MAPPING[mt]) for mt in CONFIG_MAPPING]
    while pending:
        model_type, cls = pending.pop(0)
        if model_type in classes:
            continue
        classes[model_type] = cls
        for sub in (getattr(cls, "sub_configs", {}) or {}).values():
            sub_type = getattr(sub, "model_type", None)
            if isinstance(sub_type, str) and sub_type and sub_type not in classes:
                pending.append((sub_type, sub))
    rows = {mt: _row(classes[mt]) for mt in sorted(classes)}
    table = {
        "comment": [
            "How transformers loads each config class (GENERATED: do not edit).",
            "Regenerate after a transformers upgrade: .venv-sglang/bin/python "
            "tests/sglang/gen_config_classes.py --write",
            "aliases: attribute_map entries for the keys kvpool reads (canonical -> legacy); "
            "defaults: dataclass defaults of those keys; sliding_switch: what sliding_window "
            "becomes when use_sliding_window is false; sub_configs: sub-config model types.",
        ],
        "transformers_version": transformers.__version__,
        "read_keys": list(READ_KEYS),
        "classes": rows,
    }
    return json.dumps(table, indent=1, sort_keys=False) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--write", action="store_true", help=f"rewrite {TARGET}")
    args = parser.parse_args()
    text = render()
    if args.write:
        TARGET.write_text(text, encoding="utf-8")
    else:
        sys.stdout.write(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
