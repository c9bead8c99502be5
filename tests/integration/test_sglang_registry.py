"""kvpool's architecture table against the installed SGLang's model registry.

``tests/sglang/gen_architectures.py`` runs in the SGLang side venv and renders
``service/kvpoold/sizing/sglang_architectures.json`` from SGLang's own source; any difference (a
new SGLang with new classes, or a class whose family moved) fails here with the rows that
changed, so an upgrade shows what kvpool must learn. Skipped without the side venv.
"""

from __future__ import annotations

import json
import subprocess

from kvpoold.sizing import architectures
from tests.integration.side_venv import SGLANG_DIR, sglang_env, sglang_python_or_skip

TABLE = architectures.DATA


def _rows(text: str) -> dict[str, tuple[object, ...]]:
    return {name: tuple(values) for name, values in json.loads(text)["rows"].items()}


def test_table_matches_installed_sglang() -> None:
    python = sglang_python_or_skip()
    done = subprocess.run(
        [str(python), str(SGLANG_DIR / "gen_architectures.py"), "--render"],
        capture_output=True, text=True, env=sglang_env(), timeout=300, check=False,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    fresh = _rows(done.stdout)
    stored = architectures.ROWS
    added = sorted(set(fresh) - set(stored))
    removed = sorted(set(stored) - set(fresh))
    changed = {n: (stored[n], fresh[n]) for n in sorted(set(fresh) & set(stored))
               if tuple(stored[n]) != tuple(fresh[n])}
    assert not (added or removed or changed), (
        f"SGLang's registry differs from {TABLE.name}: added {added}, removed {removed}, "
        f"changed {changed}; regenerate with "
        f"{python} tests/sglang/gen_architectures.py --write and read docs/sizing.md"
    )
    assert done.stdout == TABLE.read_text(encoding="utf-8"), "same rows, different text: --write"


def test_table_knows_the_families_sglang_builds() -> None:
    """Known rows, read from the data file (no side venv needed)."""
    rows = architectures.ROWS
    assert rows["LlamaForCausalLM"][0] == "mha"
    assert rows["DeepseekV3ForCausalLM"][:3] == ("mla", "mla", "dsa: index_topk")
    assert rows["Qwen3NextForCausalLM"][0] == "hybrid_gdn"
    assert rows["Qwen3_5ForConditionalGeneration"][0] == "hybrid_gdn"
    assert rows["NemotronHForCausalLM"][0] == "hybrid_mamba"
    assert rows["GptOssForCausalLM"][0] == "hybrid_swa"
    assert rows["DeepseekV4ForCausalLM"][0] == "dsv4"
    assert rows["BertModel"][4] is False
    assert rows["Qwen3VLForConditionalGeneration"][5] == "listed"
    assert rows["Gemma3ForConditionalGeneration"][5] == "disabled"
    assert len(rows) > 250
