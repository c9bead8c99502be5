"""kvpool's config reader against transformers' own config classes (the side venv's 5.19, which
both engines load configs through).

``tests/sglang/gen_config_classes.py`` regenerates ``service/kvpoold/config_classes.json``
(attribute maps, class defaults, sliding switches) and any difference fails; then every corpus
config is loaded by its transformers class (``tests/sglang/config_values.py``) and
:func:`kvpoold.hf_view.class_view` must agree on every key it states. Skipped without the side
venv.
"""

from __future__ import annotations

import json
import os
import subprocess
from typing import Any

from kvpoold import hf_view
from tests.integration.side_venv import SGLANG_DIR, sglang_python_or_skip
from tests.integration.vllm_diff import MODELS

CONFIGS = sorted([*MODELS.glob("*.json"), *MODELS.glob("corpus/*.json")])


def _env() -> dict[str, str]:
    """transformers alone: no GPU-package stubs (they break its lazy class imports), no
    network, not the main venv."""
    env = {k: v for k, v in os.environ.items() if k not in ("VIRTUAL_ENV", "PYTHONPATH")}
    return {**env, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_VERBOSITY": "error"}


def test_table_matches_installed_transformers() -> None:
    python = sglang_python_or_skip()
    done = subprocess.run([str(python), str(SGLANG_DIR / "gen_config_classes.py")],
                          capture_output=True, text=True, env=_env(), timeout=300,
                          check=False)
    assert done.returncode == 0, done.stderr[-4000:]
    fresh = json.loads(done.stdout)["classes"]
    stored = hf_view.CLASSES
    changed = sorted(k for k in set(fresh) | set(stored) if fresh.get(k) != stored.get(k))
    assert not changed, (f"transformers' config classes differ from {hf_view.DATA.name} for "
                         f"{changed[:20]}; regenerate with {python} "
                         "tests/sglang/gen_config_classes.py --write")


def _mismatches(path: str, loaded: dict[str, dict[str, Any]]) -> list[str]:
    cfg = json.loads(open(path).read())  # noqa: SIM115 - a test reading a small file
    out = []
    for name, theirs in loaded.items():
        if name:
            sub = cfg.get(name)
            if not isinstance(sub, dict):
                continue
            ours = hf_view.class_view(sub, hf_view.sub_model_type(cfg, name))
        else:
            ours = hf_view.class_view(cfg)
        for key, value in theirs.items():
            mine = ours.get(key)
            if key == "sliding_window":
                # the switch: a window transformers drops must be gone here too
                if bool(mine) != bool(value) or (mine and mine != value):
                    out.append(f"{name or '.'}.{key}: ours {mine!r}, transformers {value!r}")
            elif value is not None and mine is not None and mine != value:
                out.append(f"{name or '.'}.{key}: ours {mine!r}, transformers {value!r}")
    return out


def test_every_corpus_config_reads_as_transformers_loads_it() -> None:
    """Keys transformers leaves unset (a per-layer Gemma-4 text config, Qwen3-Next's
    ``full_attention_interval`` turned into ``layer_types``) are not compared; a value both
    state must be the same, and a sliding window present on one side must be on the other."""
    python = sglang_python_or_skip()
    done = subprocess.run([str(python), str(SGLANG_DIR / "config_values.py")],
                          input=json.dumps([str(p) for p in CONFIGS]), capture_output=True,
                          text=True, env=_env(), timeout=300, check=False)
    assert done.returncode == 0, done.stderr[-4000:]
    loaded = json.loads(done.stdout)
    errors = {p: v["error"] for p, v in loaded.items() if v and "error" in v}
    assert not errors
    known = [p for p, v in loaded.items() if v is not None]
    assert len(known) > len(CONFIGS) // 2  # most of the corpus is transformers' own classes
    bad = {p: m for p in known if (m := _mismatches(p, loaded[p]))}
    assert not bad
