"""Kimi delta attention (Kimi Linear) read and sized as SGLang 0.5.23 does, by hand.

Kimi-Linear-48B-A3B-Instruct (``tests/data/models/corpus/kimi-linear-48b-a3b-instruct.json``):
27 layers; ``linear_attn_config.kda_layers`` lists 20 of them 1-based, so the full-attention
(MLA) layers are 3, 7, 11, 15, 19, 23, 26; 32 KDA heads of 128, conv kernel 4.

Per KDA layer and state slot, TP 1 (SGLang's ``KimiLinearStateShape``): conv ``(k - 1, 3 * H *
D) = (3, 12,288)`` bf16 = 73,728 B; recurrent ``(H, D, D) = (32, 128, 128)`` fp32 = 2,097,152 B;
2,170,880 B a layer, ``per_req`` = 20 x 2,170,880 = 43,417,600 B. MLA cell: 576 x 7 x 2 =
8,064 B per token.

20 GiB (21,474,836,480 B), page 16, ratio 5 (the radix cache, extra_buffer under the overlap
schedule): mamba budget = 21,474,836,480 x 9 // 19 = 10,172,290,964 B; slots =
(10,172,290,964 - 43,417,600) // 43,417,600 = 233; KV budget = 21,474,836,480 - 234 x
43,417,600 = 11,315,118,080 B; pages = 11,315,118,080 // (8,064 x 16) = 87,697 -> 1,403,152
tokens; max_running_requests = min(2,048, 701,576, 233 // 5 = 46) = 46. SGLang 0.5.23 gives the
same (tests/integration/test_sglang_corpus.py runs it).
"""

from __future__ import annotations

import copy
import json
from typing import Any

import pytest
import torch

from kvpool.contract.errors import InvalidArgument
from kvpool.contract.plan import BufferKind
from kvpool.contract.spec import (
    LinearAttention,
    MLAAttention,
    ModelDType,
    ModelSpec,
    decode_spec,
)
from kvpoold.hf import read_hf
from kvpoold.pools import builder
from kvpoold.sizing import hybrid_linear, make_options, plan
from tests.conftest import REPO

MODELS = REPO / "tests" / "data" / "models"
KIMI = "corpus/kimi-linear-48b-a3b-instruct.json"
GIB = 1 << 30
FULL = (3, 7, 11, 15, 19, 23, 26)
PER_REQ = 43_417_600


def kimi() -> dict[str, Any]:
    return json.loads((MODELS / KIMI).read_text())


def kimi_k3_wrapper(**text_over: Any) -> dict[str, Any]:
    """SYNTHETIC: a Kimi-K3-style multimodal wrapper (no complete published Kimi-K3 config was
    found): the Kimi-Linear config as its ``text_config``, the wrapper's class and model type."""
    text = {k: v for k, v in kimi().items() if k not in ("architectures", "auto_map")}
    text.update(text_over)
    return {"architectures": ["KimiK3ForConditionalGeneration"], "model_type": "kimi_k3",
            "dtype": "bfloat16", "text_config": text}


def test_kimi_linear_reads_mla_kv_and_kda_state() -> None:
    model = read_hf(kimi())
    spec = model.spec
    assert spec.attention == MLAAttention(kv_lora_rank=512, qk_rope_head_dim=64)
    assert spec.linear == LinearAttention(
        full_attention_layers=FULL, conv_kernel=4, num_key_heads=32, num_value_heads=32,
        key_head_dim=128, value_head_dim=128, conv_layout="window_first")
    assert spec.linear.state_layer_ids(27) == tuple(i for i in range(27) if i not in FULL)
    assert (spec.context_length, spec.dtype) == (1_048_576, ModelDType.bfloat16)
    assert model.decided_by == ("architectures", "model_type", "linear_attn_config.kda_layers")


def test_kda_state_shapes_follow_sglang_window_first() -> None:
    linear = read_hf(kimi()).spec.linear
    assert linear is not None
    one = hybrid_linear.state_shape(linear, 1)
    assert (one.conv, one.ssm) == ((3, 12_288), (32, 128, 128))
    assert (one.conv_dtype, one.ssm_dtype) == (ModelDType.bfloat16, ModelDType.float32)
    assert one.slot_bytes == 2_170_880
    two = hybrid_linear.state_shape(linear, 2)
    assert (two.conv, two.ssm) == ((3, 6_144), (16, 128, 128))
    for tp in (3, 64):  # SGLang's divide() asserts: 32 heads (and 4,096 channels) must split
        with pytest.raises(InvalidArgument, match="32 value heads") as err:
            hybrid_linear.state_shape(linear, tp)
        assert err.value.field == "tp_size"


def test_kimi_linear_20gib_page16_by_hand() -> None:
    p = plan(read_hf(kimi()).spec, make_options(budget_bytes=20 * GIB, page_size=16))
    assert p.architecture == "hybrid_linear"
    assert p.cell_size_bytes == 8_064
    assert (p.mamba_cache_size, p.max_total_num_tokens, p.max_running_requests) == (
        233, 1_403_152, 46)
    assert sum(b.page_bytes for b in p.buffers if b.kind is BufferKind.state) == PER_REQ
    assert p.buffer("kv.3").shape == (1_403_168, 1, 576)
    assert p.buffer("conv.0").shape == (234, 3, 12_288)
    assert p.buffer("ssm.25").shape == (234, 32, 128, 128)
    assert {b.name for b in p.buffers if b.kind is BufferKind.kv} == {f"kv.{i}" for i in FULL}
    assert p.total_bytes == 234 * PER_REQ + 87_698 * 16 * 8_064
    assert any("mamba state: 233 slots" in n for n in p.notes)


def test_the_checkpoints_ssm_dtype_is_not_read_for_kda() -> None:
    """SGLang builds KimiLinearCacheParams with its default state dtypes (it never passes the
    config to mamba2_state_dtype): a mamba_ssm_dtype in the config changes nothing."""
    cfg = kimi()
    cfg["mamba_ssm_dtype"] = "bfloat16"
    assert read_hf(cfg).spec.linear == read_hf(kimi()).spec.linear


def test_a_kimi_k3_wrapper_is_a_kda_hybrid_through_its_text_config() -> None:
    """SGLang's KimiK3Config makes its text_config a KimiLinearConfig: its class row says MLA,
    its content a state pool. With or without the text config's own model_type."""
    for wrapper in (kimi_k3_wrapper(), kimi_k3_wrapper(model_type=None)):
        model = read_hf(wrapper)
        assert model.spec.linear == read_hf(kimi()).spec.linear
        assert model.decided_by == ("architectures", "model_type",
                                    "text_config.linear_attn_config.kda_layers")


def test_kda_content_outside_a_kimi_linear_config_is_refused_naming_the_field() -> None:
    """Kimi-K2.5's wrapper builds a DeepSeek-V3 text config: SGLang would not size a state pool
    for kda_layers there, so kvpool refuses rather than guess."""
    cfg = json.loads((MODELS / "corpus/kimi-k2.5.json").read_text())
    cfg["text_config"]["linear_attn_config"] = {"kda_layers": [1, 2], "full_attn_layers": [3]}
    with pytest.raises(InvalidArgument, match=r"text_config\.linear_attn_config\.kda_layers "
                                              r"declares .* only for a Kimi Linear config"):
        read_hf(cfg)


@pytest.mark.parametrize(("edit", "message"), [
    (lambda c: c.update(linear_attn_config=None), "linear_attn_config is None"),
    (lambda c: c["linear_attn_config"].pop("kda_layers"), "kda_layers must list"),
    (lambda c: c["linear_attn_config"].pop("full_attn_layers"), "full_attn_layers must list"),
    (lambda c: c["linear_attn_config"].update(kda_layers=[0, 28, 40]),
     "names none of the model's 27 layers"),
    (lambda c: c["linear_attn_config"].pop("short_conv_kernel_size"),
     "missing short_conv_kernel_size"),
    (lambda c: c["linear_attn_config"].update(num_heads=0), "num_heads must be an integer >= 1"),
    (lambda c: c.update(model_type="deepseek_v3"), "has model_type 'deepseek_v3'"),
])
def test_what_sglang_cannot_size_is_refused(edit: Any, message: str) -> None:
    cfg = copy.deepcopy(kimi())
    edit(cfg)
    with pytest.raises(InvalidArgument, match=message) as err:
        read_hf(cfg)
    assert err.value.field == "model_config"


def test_the_conv_layout_is_part_of_the_spec_and_builds_window_first() -> None:
    """A hand-written spec states the layout; the pool's conv views have SGLang's KDA shape."""
    raw: dict[str, Any] = {
        "num_layers": 4, "context_length": 64,
        "attention": {"type": "mla", "kv_lora_rank": 16, "qk_rope_head_dim": 8},
        "linear": {"full_attention_layers": [3], "conv_kernel": 4, "num_key_heads": 2,
                   "num_value_heads": 2, "key_head_dim": 8, "value_head_dim": 8,
                   "conv_layout": "window_first"},
    }
    spec = decode_spec(raw)
    assert isinstance(spec, ModelSpec) and spec.linear is not None
    p = plan(spec, make_options(budget_bytes=1 << 20, page_size=4))
    pool = builder.build_pool(p, "cpu")
    assert pool.views["conv.0"].shape == (p.mamba_cache_size + 1, 3, 48)
    assert pool.views["conv.0"].dtype == torch.bfloat16
    assert pool.views["ssm.2"].shape == (p.mamba_cache_size + 1, 2, 8, 8)
    raw["linear"]["conv_layout"] = "sideways"
    with pytest.raises(InvalidArgument, match="conv_layout"):
        decode_spec(raw)

