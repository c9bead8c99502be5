"""``kvpool.integrations.hf_config`` against the real ``huggingface_hub`` (the vLLM side venv
has it; the main venv need not): a repo id's ``config.json`` comes from the local Hugging Face
cache offline, as the engines load it; a repo or a revision the cache lacks is refused naming
it, or None with ``missing_ok``.

Skipped (with the reason) without the vLLM side venv; fails instead under
``KVPOOL_REQUIRE_VLLM=1``."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

from tests.conftest import REPO
from tests.integration.vllm_venv import vllm_env, vllm_python_or_skip

COMMIT = "0123456789abcdef0123456789abcdef01234567"

CHILD = """
import json
from kvpool.contract.errors import FailedPrecondition
from kvpool.integrations.hf_config import hf_config_path

def ask(model, revision=None, missing_ok=False):
    try:
        path = hf_config_path(model, revision, field="model", missing_ok=missing_ok)
        return {"path": None if path is None else str(path),
                "text": None if path is None else path.read_text()}
    except FailedPrecondition as err:
        return {"error": err.message, "field": err.field}

print(json.dumps({
    "cached": ask("acme/tiny"),
    "cached_at_commit": ask("acme/tiny", revision=COMMIT),
    "other_revision": ask("acme/tiny", revision="v2"),
    "not_cached": ask("nobody/no-such-model"),
    "not_cached_ok": ask("nobody/no-such-model", missing_ok=True),
}))
"""


def test_a_repo_id_comes_from_the_local_cache_offline(tmp_path: Path) -> None:
    python = vllm_python_or_skip()
    repo = tmp_path / "hf" / "hub" / "models--acme--tiny"
    snapshot = repo / "snapshots" / COMMIT
    snapshot.mkdir(parents=True)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(COMMIT)
    config = {"architectures": ["LlamaForCausalLM"], "num_hidden_layers": 2}
    (snapshot / "config.json").write_text(json.dumps(config))
    out = subprocess.run([str(python), "-c", f"COMMIT = {COMMIT!r}\n{CHILD}"], cwd=REPO,
                         capture_output=True, text=True, timeout=120,
                         env=vllm_env(HF_HOME=str(tmp_path / "hf"), HF_HUB_OFFLINE="1"))
    assert out.returncode == 0, out.stderr[-3000:]
    got = json.loads(out.stdout.strip().splitlines()[-1])
    for key in ("cached", "cached_at_commit"):
        assert Path(got[key]["path"]) == snapshot / "config.json", got
        assert json.loads(got[key]["text"]) == config
    for key in ("other_revision", "not_cached"):
        assert got[key]["field"] == "model", got
    assert "acme/tiny" in got["other_revision"]["error"]
    assert "v2" in got["other_revision"]["error"]
    assert "nobody/no-such-model" in got["not_cached"]["error"]
    assert got["not_cached_ok"] == {"path": None, "text": None}
