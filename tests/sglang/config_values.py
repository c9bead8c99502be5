"""Print what transformers' config classes make of config files: for each path on stdin (one
JSON list), the keys kvpool reads of the config and of each sub-config, as loaded.

Runs in a side venv (``tests/integration/test_config_classes.py`` drives it); a config whose
``model_type`` transformers does not know is reported as ``null``.
"""

from __future__ import annotations

import json
import sys
import warnings
from typing import Any

from transformers import CONFIG_MAPPING

sys.path.insert(0, str(__import__("pathlib").Path(__file__).parent))
from gen_config_classes import READ_KEYS

KEYS = (*READ_KEYS, "layer_types")


def _values(config: Any) -> dict[str, Any]:
    out = {}
    for key in KEYS:
        try:
            value = getattr(config, key, None)
        except Exception:  # a property that needs more than the file gives
            value = None
        if value is None or isinstance(value, bool | int | float | str | list):
            out[key] = value
    return out


def load(path: str) -> dict[str, Any] | None:
    with open(path) as f:
        raw = json.load(f)
    model_type = raw.get("model_type")
    if not isinstance(model_type, str) or model_type not in CONFIG_MAPPING:
        return None
    cls = CONFIG_MAPPING[model_type]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        config = cls.from_dict(raw)
    out = {"": _values(config)}
    for name in getattr(config, "sub_configs", {}) or {}:
        sub = getattr(config, name, None)
        if sub is not None and hasattr(sub, "to_dict"):
            out[name] = _values(sub)
    return out


def main() -> int:
    results = {}
    for path in json.load(sys.stdin):
        try:
            results[path] = load(path)
        except Exception as exc:  # a class that refuses the file: say so, go on
            results[path] = {"error": f"{type(exc).__name__}: {exc}"}
    json.dump(results, sys.stdout)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
