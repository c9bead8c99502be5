"""Wire conversion: a typed ModelSpec survives client -> proto -> daemon for every attention
kind and extra; plans and stats map field for field."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import msgspec
import numpy as np
import pytest

from kvpool.contract.errors import InvalidArgument
from kvpool.contract.spec import ModelSpec, decode_spec
from kvpool.contract.wire import configure_request, hf_config_text, ids_bytes, spec_message
from kvpoold.server.edge import configure_args, message_to_builtins
from tests.factories import deepseek_v32, llama_8b

SPECS: dict[str, dict[str, Any]] = {
    "mha with v_head_dim": {"num_layers": 2, "context_length": 64,
                            "attention": {"type": "mha", "num_kv_heads": 2, "head_dim": 16,
                                          "v_head_dim": 8}},
    "sliding window": {"num_layers": 4, "context_length": 64, "dtype": "float16",
                       "attention": {"type": "mha", "num_kv_heads": 2, "head_dim": 16},
                       "sliding_window": {"window": 32, "layers": [0, 2], "head_dim": 8}},
    "linear": {"num_layers": 4, "context_length": 64,
               "attention": {"type": "mha", "num_kv_heads": 2, "head_dim": 16},
               "linear": {"full_attention_layers": [3], "conv_kernel": 4, "num_key_heads": 2,
                          "num_value_heads": 4, "key_head_dim": 16, "value_head_dim": 8,
                          "ssm_dtype": "bfloat16"}},
    "dsv4": {"num_layers": 3, "context_length": 64,
             "attention": {"type": "mla", "kv_lora_rank": 512, "qk_rope_head_dim": 64},
             "dsv4": {"compress_ratios": [0, 4, 128], "window_size": 64}},
}


@pytest.mark.parametrize("spec", [
    *(decode_spec(s) for s in SPECS.values()), llama_8b(), deepseek_v32(),
    llama_8b(kv_cache_quant_fp8=True, num_nextn_predict_layers=1, architecture="X"),
], ids=[*SPECS, "llama", "deepseek-v3.2", "flags"])
def test_typed_spec_round_trips(spec: ModelSpec) -> None:
    msg = spec_message(spec)
    back = decode_spec(message_to_builtins(msg))
    assert back == spec
    # the mapping form (ModelSpec JSON shape) gives the same message
    assert spec_message(msgspec.to_builtins(spec)) == msg


def test_unset_options_are_left_to_the_daemon() -> None:
    req = configure_request("p", spec=SPECS["mha with v_head_dim"], budget_bytes=1 << 20,
                            page_size=None, kv_cache_dtype="fp8_e4m3", tp_size=2)
    args = configure_args(req)
    assert args.options == {"budget_bytes": 1 << 20, "kv_cache_dtype": "fp8_e4m3",
                            "tp_size": 2}
    assert args.hf_config_json is None and args.spec is not None and not args.dry_run


def test_ids_bytes() -> None:
    assert ids_bytes(np.array([1, 2], dtype=np.int64)) == b"\x01\x00\x00\x00\x02\x00\x00\x00"
    assert ids_bytes([]) == b""
    for bad in ([1.5], [[1]], [1 << 40]):
        with pytest.raises(InvalidArgument):
            ids_bytes(bad)


def test_spec_with_unknown_field_is_refused_by_the_client() -> None:
    with pytest.raises(InvalidArgument) as info:
        spec_message({**SPECS["mha with v_head_dim"], "num_heads": 3})
    assert info.value.field == "spec"


def test_an_unreadable_hf_config_path_names_the_file(tmp_path: Path) -> None:
    """A path that is not there is an InvalidArgument on ``hf_config`` (exit 2 in the CLI),
    not an OSError; a model directory stands for its config.json."""
    missing = tmp_path / "absent.json"
    with pytest.raises(InvalidArgument, match=r"absent\.json") as info:
        hf_config_text(missing)
    assert info.value.field == "hf_config"
    (tmp_path / "config.json").write_text('{"a": 1}')
    assert hf_config_text(tmp_path) == '{"a": 1}'


def test_every_plan_option_crosses_the_wire() -> None:
    """Configure carries each PlanOptions field by name; set ones arrive, unset ones don't."""
    from kvpool.contract.options import PlanOptions
    from kvpool.v1 import kvpool_pb2 as pb

    assert set(PlanOptions.__struct_fields__) <= set(pb.ConfigureRequest.DESCRIPTOR.fields_by_name)
    req = configure_request("p", spec=SPECS["linear"], budget_bytes=1 << 20,
                            allow_longer_context=True, mamba_radix_cache_strategy="extra_buffer",
                            context_length=4096)
    assert configure_args(req).options == {
        "budget_bytes": 1 << 20, "allow_longer_context": True,
        "mamba_radix_cache_strategy": "extra_buffer", "context_length": 4096}
