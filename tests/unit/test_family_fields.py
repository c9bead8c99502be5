"""The config fields that decided a plan's family: read by both readers, carried in the plan's
notes, printed by ``kvpoold plan`` (the engines' own source is checked in
tests/integration/test_family_fields.py)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from kvpoold import main as cli
from kvpoold.hf import read_hf, read_model
from kvpoold.sizing import make_options, plan
from kvpoold.sizing.vllm_model import read_vllm_model

ROOT = Path(__file__).resolve().parents[2]
CORPUS = ROOT / "tests" / "data" / "models" / "corpus"
GRANITE: dict[str, Any] = {
    "architectures": ["GraniteMoeHybridForCausalLM"], "num_hidden_layers": 4,
    "hidden_size": 1536, "num_attention_heads": 12, "num_key_value_heads": 4,
    "mamba_n_heads": 48, "mamba_d_head": 64, "mamba_n_groups": 1, "mamba_d_state": 128,
    "mamba_d_conv": 4, "mamba_expand": 2, "max_position_embeddings": 131072,
    "torch_dtype": "bfloat16"}


@pytest.mark.parametrize(("name", "fields"), [
    ("llama-3.2-1b-instruct", ("architectures",)),
    ("qwen3.5-27b", ("architectures", "text_config.layer_types")),
    ("deepseek-v3.2", ("architectures", "index_topk")),
    ("deepseek-v2-lite-chat", ("architectures",)),
    ("gpt-oss-120b", ("architectures", "layer_types")),
    ("nemotron-h-56b-base-8k", ("architectures", "hybrid_override_pattern")),
    ("glm-5.1-nvfp4", ("architectures", "index_topk", "quantization_config.kv_cache_scheme")),
])
def test_sglang_reader_names_the_fields_that_decided(name: str, fields: tuple[str, ...]) -> None:
    assert read_model(CORPUS / f"{name}.json").decided_by == fields


def test_granite_without_mamba_layers_is_plain_attention_as_in_sglang() -> None:
    """SGLang's mamba2_config: a GraniteMoeHybrid config is a Mamba2 hybrid only when some
    ``layer_types`` entry is mamba; kvpool planned every such config as a hybrid."""
    hybrid = read_hf({**GRANITE, "layer_types": ["mamba", "mamba", "mamba", "attention"]})
    plain = read_hf({**GRANITE, "layer_types": ["attention"] * 4})
    assert hybrid.spec.linear is not None and plain.spec.linear is None
    assert hybrid.decided_by == plain.decided_by == ("architectures", "layer_types")


def test_dsa_class_without_index_topk_is_mla_and_says_so() -> None:
    config = json.loads((CORPUS / "deepseek-v3.2.json").read_text())
    config.pop("index_topk")
    model = read_hf(config)
    assert model.spec.indexer is None
    assert model.decided_by == ("architectures", "index_topk")


def test_assumed_family_names_no_field() -> None:
    """An unknown class read as ``--assume-architecture``: nothing in the config decided it
    (the plan's own note says the flag did)."""
    model = read_hf({"architectures": ["NoSuchForCausalLM"], "num_hidden_layers": 2,
                     "num_attention_heads": 4, "hidden_size": 256}, assume="mha")
    assert (model.source, model.decided_by) == ("assumed", ())


def test_plan_note_and_cli_print_the_fields(capsys: pytest.CaptureFixture[str]) -> None:
    model = read_model(CORPUS / "qwen3.5-27b.json")
    p = plan(model.spec, make_options(budget_bytes=16 << 30), source=model.source,
             decided_by=model.decided_by)
    assert p.notes[0] == ("family hybrid_linear decided by architectures, "
                          "text_config.layer_types (as SGLang 0.5.23 reads them)")
    assert cli.main(["plan", "--model-config", str(CORPUS / "gpt-oss-120b.json"),
                     "--budget", "16GiB", "--json"]) == 0
    notes = json.loads(capsys.readouterr().out)["notes"]
    assert notes[0].startswith("family hybrid_swa decided by architectures, layer_types")


@pytest.mark.parametrize(("name", "fields"), [
    ("llama-3.2-1b-instruct", ("architectures",)),
    ("qwen2.5-3b-instruct", ("architectures", "use_sliding_window")),
    ("gemma-2-9b-it", ("architectures", "sliding_window", "model_type")),
    ("gpt-oss-120b", ("architectures", "sliding_window", "layer_types")),
    ("deepseek-v2-lite-chat", ("architectures", "kv_lora_rank")),
])
def test_vllm_reader_names_the_fields_that_decided(name: str, fields: tuple[str, ...]) -> None:
    config = json.loads((CORPUS / f"{name}.json").read_text())
    assert read_vllm_model(config).decided_by == fields


def test_vllm_cli_prints_the_fields(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["plan", "--engine", "vllm", "--model-config",
                     str(CORPUS / "qwen2.5-3b-instruct.json"), "--budget", "4GiB",
                     "--json"]) == 0
    notes = json.loads(capsys.readouterr().out)["notes"]
    assert "layers full decided by architectures, use_sliding_window (as vLLM 0.32 reads " \
           "them)" in notes
