"""The vLLM profile's Mamba hybrids (Nemotron-H's Mamba-2, Jamba's Mamba-1): state sizes, the TP
split, the SSM dtype rules, the block size raised to hold a state, groups and refusals, with
numbers computed by hand (real vLLM 0.32 agrees in tests/integration/test_vllm_parity.py, at
TP 1: its harness cannot split a state over ranks).

Worked numbers (bf16 = 2 B, fp32 = 4 B, CPU block 128 unless said):

* Nemotron-H-56B, Mamba-2: 256 heads of 64 (intermediate 16,384), 8 groups, state 256,
  kernel 4. TP 1: conv (16,384 + 2 * 8 * 256) * 3 = 61,440 elements (bf16: 122,880 B), SSM
  256 * 64 * 256 = 4,194,304 elements (its config hook's float32: 16,777,216 B), 16,900,096 B
  a state. Attention: 8 KV heads of 128, 4,096 B a token; the block grows to
  128 * ceil(16,900,096 / 524,288) = 4,224 tokens, a page of 17,301,504 B. 54 Mamba, 10
  attention and 54 MLP layers: group size 10, six Mamba groups (9 layers each) and one
  attention group; 4 GiB // (10 * 17,301,504) = 24 blocks; a 4,096-token request takes
  3 blocks per Mamba group (with prefix caching its running state, the one it came from and
  a Mamba-2 prefill checkpoint) and 1 attention block: 24 / 19 requests; without prefix
  caching 1 per Mamba group: 24 / 7.
* The same at TP 4: conv (16,384 + 4,096) / 4 * 3 = 15,360 (30,720 B), SSM 64 * 64 * 256 =
  1,048,576 (4,194,304 B): 4,225,024 B; 2 KV heads, 1,024 B a token, block 128 * 33 = 4,224.
  At TP 16 the 8 groups do not split: each rank takes 16 (8 replicated), conv (16,384 +
  8,192) / 16 * 3 = 4,608 (9,216 B), SSM 16 * 64 * 256 = 262,144 (1,048,576 B): 1,057,792 B;
  1 KV head (replicated), 512 B a token, block 128 * 17 = 2,176.
* Jamba-1.5-Mini, Mamba-1: intermediate 2 * 4,096 = 8,192, state 16, kernel 4. TP 1: conv
  8,192 * 3 = 24,576 (49,152 B), SSM 8,192 * 16 = 131,072 (bf16 262,144 B, fp32 524,288 B).
  Attention 8 KV heads of 128: 4,096 B a token. bf16: 311,296 B, 128 * ceil(311,296 /
  524,288) = 128 tokens; fp32 (a CPU with AVX-512 BF16): 573,440 B, 256 tokens. At TP 2,
  bf16: conv 12,288 (24,576 B) + SSM 65,536 (131,072 B) = 155,648 B, padded to 4 heads * 2 *
  128 * 2 * 128 = 262,144 B.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from kvpool.contract.errors import InvalidArgument
from kvpool.contract.vllm_plan import VllmSpecType, make_vllm_options
from kvpoold import main as cli
from kvpoold.sizing.vllm_model import read_vllm_model
from kvpoold.sizing.vllm_profile import plan_vllm

CORPUS = Path(__file__).resolve().parents[2] / "tests" / "data" / "models" / "corpus"
GiB = 1 << 30
NEMOTRON = "nemotron-h-56b-base-8k"
JAMBA = "ai21-jamba-1.5-mini"


def _config(name: str) -> dict[str, Any]:
    return json.loads((CORPUS / f"{name}.json").read_text())


def _plan(config: dict[str, Any] | str, **options: Any):
    if isinstance(config, str):
        config = _config(config)
    base = {"kv_cache_memory_bytes": 4 * GiB, "max_model_len": 4096, "cpu_avx512_bf16": "no"}
    return plan_vllm(config, make_vllm_options(**{**base, **options}))


def _states(p) -> list:
    return [s for s in p.layers if s.type is VllmSpecType.mamba]


def test_nemotron_h_block_holds_a_float32_state() -> None:
    p = _plan(NEMOTRON, block_size=128)
    assert p.block_size == 4224
    states = _states(p)
    assert len(states) == 54 and len(p.layers) == 64  # the 54 MLP blocks cache nothing
    assert {s.page_size_bytes for s in p.layers} == {17_301_504}
    assert states[0].name == "model.layers.0.mixer"
    assert "model.layers.7.mixer.attn" in {s.name for s in p.layers}
    assert [(g.type, len(g.layer_names)) for g in p.groups] == [
        (VllmSpecType.mamba, 9)] * 6 + [(VllmSpecType.full_attention, 10)]
    assert p.num_blocks == 4 * GiB // (10 * 17_301_504) == 24
    assert p.max_concurrency == 24 / (6 * 3 + 1)
    assert _plan(NEMOTRON, block_size=128,
                 no_enable_prefix_caching=True).max_concurrency == 24 / (6 * 1 + 1)
    assert any("SSM states are float32 (vLLM's default for NemotronHForCausalLM)" in n
               for n in p.notes)
    assert any("conv 122,880 B (bfloat16) + SSM 16,777,216 B (float32) = 16,900,096 B, "
               "padded to 17,301,504 B" in n for n in p.notes)


@pytest.mark.parametrize(("tp", "state", "block"), [
    (4, 30_720 + 4_194_304, 4224),
    (8, 15_360 + 2_097_152, 4224),
])
def test_nemotron_h_tensor_parallel_split(tp: int, state: int, block: int) -> None:
    """The heads and the groups split (8 groups over TP 16 would need replicas, which vLLM's
    MambaMixer2 makes for a single group only: refused)."""
    p = _plan(NEMOTRON, tp_size=tp)
    per_token = max(1, 8 // tp) * 2 * 128 * 2
    assert p.block_size == block
    assert {s.page_size_bytes for s in _states(p)} == {block * per_token}
    assert any(f"= {state:,} B" in n for n in p.notes)


def test_mamba_dimensions_that_do_not_split_are_refused() -> None:
    config = {**_config(NEMOTRON), "num_attention_heads": 48, "num_key_value_heads": 6}
    with pytest.raises(InvalidArgument, match="Mamba-2 conv channels") as info:
        _plan(config, tp_size=3)
    assert info.value.field == "tp_size"
    with pytest.raises(InvalidArgument, match="8 Mamba-2 groups do not split over tp_size 16"):
        _plan(NEMOTRON, tp_size=16)


def test_ssm_dtype_rules() -> None:
    """Nemotron-H: ``auto`` is float32 (the config hook) on either CPU. Jamba: ``auto`` is
    the model dtype, float32 on a CPU with AVX-512 BF16. A named half dtype stays for both,
    also on such a CPU (transformers calls their mixers linear_attention)."""
    for isa in ("yes", "no"):
        assert _plan(NEMOTRON, cpu_avx512_bf16=isa).block_size == 4224
        assert _plan(NEMOTRON, cpu_avx512_bf16=isa,
                     mamba_ssm_cache_dtype="bfloat16").block_size == 2176
    own = {**_config(NEMOTRON), "mamba_ssm_cache_dtype": "bfloat16"}
    assert _plan(own).block_size == 2176  # the config's own dtype is the hook's answer
    assert _plan(JAMBA, cpu_avx512_bf16="no").block_size == 128
    assert _plan(JAMBA, cpu_avx512_bf16="yes").block_size == 256
    assert any("SSM states are float32 (vLLM's CPU platform" in n
               for n in _plan(JAMBA, cpu_avx512_bf16="yes").notes)
    named = _plan(JAMBA, cpu_avx512_bf16="yes", mamba_ssm_cache_dtype="bfloat16")
    assert named.block_size == 128


def test_jamba_mamba1_groups_and_tp2() -> None:
    p = _plan(JAMBA, max_model_len=2048)
    assert p.block_size == 128
    assert {s.page_size_bytes for s in p.layers} == {524_288}
    assert [(g.type, len(g.layer_names)) for g in p.groups] == [
        (VllmSpecType.mamba, 4)] * 7 + [(VllmSpecType.full_attention, 4)]
    assert p.groups[-1].layer_names[0] == "model.layers.4.attn"
    assert p.num_blocks == 4 * GiB // (4 * 524_288) == 2048
    assert p.max_concurrency == 2048 / (7 * 2 + 2048 // 128)  # Mamba-1: no checkpoint
    tp2 = _plan(JAMBA, max_model_len=2048, tp_size=2)
    assert tp2.block_size == 128
    assert {s.page_size_bytes for s in _states(tp2)} == {262_144}
    assert any("= 155,648 B, padded to 262,144 B" in n for n in tp2.notes)


def test_fields_that_decided() -> None:
    assert read_vllm_model(_config(NEMOTRON)).decided_by == (
        "architectures", "hybrid_override_pattern")
    assert read_vllm_model(_config(JAMBA)).decided_by == (
        "architectures", "attn_layer_period", "attn_layer_offset")


@pytest.mark.parametrize(("change", "words"), [
    ({"hybrid_override_pattern": "M*X-"}, "'X' at layer 2"),
    ({"hybrid_override_pattern": "M*"}, "num_hidden_layers (4)"),
    ({"ssm_state_size": None}, "ssm_state_size must be a positive integer"),
])
def test_bad_nemotron_h_configs_are_refused_by_field(change: dict[str, Any],
                                                     words: str) -> None:
    config = {**_config(NEMOTRON), "num_hidden_layers": 4,
              "hybrid_override_pattern": "M*M-", **change}
    with pytest.raises(InvalidArgument, match=words.replace("(", r"\(").replace(")", r"\)")):
        read_vllm_model(config)


def test_cli_prints_state_groups_beside_attention(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["plan", "--engine", "vllm", "--model-config",
                     str(CORPUS / f"{JAMBA}.json"), "--kv-cache-memory-bytes", str(4 * GiB),
                     "--max-model-len", "2048", "--cpu-avx512-bf16", "no"]) == 0
    out = capsys.readouterr().out
    assert "kv cache groups (8)" in out
    assert out.count("mamba ") >= 7 and "full_attention" in out
    assert "Mamba-1 state per request and layer" in out
