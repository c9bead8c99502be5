"""Where the engines' plugins find a model's config.json (kvpool.integrations.hf_config)."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvpool.contract.errors import FailedPrecondition
from kvpool.integrations.hf_config import hf_config_path


def test_a_model_directory_gives_its_config_and_one_without_is_refused(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text("{}")
    assert hf_config_path(str(tmp_path), field="model") == tmp_path / "config.json"
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(FailedPrecondition) as info:
        hf_config_path(str(empty), field="model_path", missing_ok=True)  # a dir is never "missing"
    assert info.value.field == "model_path" and "has no config.json" in info.value.message


def test_a_repo_not_in_the_cache_is_refused_or_none(monkeypatch: pytest.MonkeyPatch,
                                                   tmp_path: Path) -> None:
    """Refused offline with huggingface_hub (the engines' venvs) and without it (the reason
    then names the missing module); the cache itself: tests/integration/test_hf_config_cache.py."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    with pytest.raises(FailedPrecondition) as info:
        hf_config_path("nobody/no-such-model", field="model")
    assert "nobody/no-such-model" in info.value.message and info.value.field == "model"
    assert hf_config_path("nobody/no-such-model", field="model", missing_ok=True) is None
