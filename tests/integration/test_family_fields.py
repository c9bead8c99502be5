"""Every architecture whose family SGLang decides from config content is derived by kvpool from
the same fields: read from SGLang's own source (the side venv's), checked by flipping each
field on a config of that class and watching the family kvpool plans move as SGLang's rule
says, and the field named in the plan's "decided by" note. Skipped without the side venv.
"""

from __future__ import annotations

import ast
import importlib.util
import sys
from collections.abc import Callable
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

from kvpool.contract.errors import InvalidArgument
from kvpool.contract.spec import MLAAttention, ModelSpec
from kvpoold.hf import read_hf
from kvpoold.sizing import architectures
from tests.integration.side_venv import SGLANG_DIR, VENV, sglang_python_or_skip

Config = dict[str, Any]


def _srt() -> Path:
    sglang_python_or_skip()
    found = sorted(VENV.glob("lib/python3*/site-packages/sglang/srt"))
    if not found:
        pytest.skip(f"no sglang package in {VENV}")
    return found[0]


def _generator() -> ModuleType:
    # the table's generator holds the AST readers of SGLang's rules; it imports no SGLang
    spec = importlib.util.spec_from_file_location("gen_architectures",
                                                  SGLANG_DIR / "gen_architectures.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def _func(path: Path, name: str) -> ast.FunctionDef:
    tree = ast.parse(path.read_text(encoding="utf-8"))
    return next(n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef) and n.name == name)


def _fields_read(node: ast.AST, holder: str) -> set[str]:
    """The attributes of ``holder`` a piece of SGLang code reads (``holder.x``,
    ``getattr(holder, "x")``, ``_hf_attr(holder, "x")``, ``holder.get("x")``)."""
    out: set[str] = set()
    for n in ast.walk(node):
        if isinstance(n, ast.Attribute) and isinstance(n.value, ast.Name) and n.value.id == holder:
            out.add(n.attr)
        if (isinstance(n, ast.Call) and isinstance(n.func, ast.Name)
                and n.func.id in ("getattr", "_hf_attr") and len(n.args) >= 2
                and isinstance(n.args[0], ast.Name) and n.args[0].id == holder
                and isinstance(n.args[1], ast.Constant)):
            out.add(n.args[1].value)
        if (isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute)
                and n.func.attr == "get" and isinstance(n.func.value, ast.Name)
                and n.func.value.id == holder and isinstance(n.args[0], ast.Constant)):
            out.add(n.args[0].value)
    return out - {"get", "get_text_config", "text_config", "architectures"}


def _family(spec: ModelSpec) -> str:
    if spec.indexer is not None:
        return "dsa"
    if spec.linear is not None:
        return "hybrid_mamba" if spec.linear.ssm_dtype is not None or spec.linear.state_layers \
            else "hybrid_gdn"
    if spec.sliding_window is not None:
        return "hybrid_swa"
    return "mla" if isinstance(spec.attention, MLAAttention) else "mha"


def _base(name: str, **extra: Any) -> Config:
    return {"architectures": [name], "num_hidden_layers": 4, "num_attention_heads": 8,
            "num_key_value_heads": 2, "hidden_size": 512, "head_dim": 64,
            "max_position_embeddings": 4096, "torch_dtype": "bfloat16", **extra}


MLA = {"kv_lora_rank": 512, "qk_rope_head_dim": 64}
SWA_TYPES = ["sliding_attention", "full_attention", "sliding_attention", "full_attention"]
GRANITE = {"hidden_size": 1536, "num_attention_heads": 12, "num_key_value_heads": 4,
           "head_dim": None, "mamba_n_heads": 48, "mamba_d_head": 64, "mamba_n_groups": 1,
           "mamba_d_state": 128, "mamba_d_conv": 4, "mamba_expand": 2}

# Each content rule: (config where SGLang's rule holds, its family), (config where it does
# not, its family). A family None means kvpool refuses, naming the family SGLang builds.
Case = tuple[tuple[Config, str | None], tuple[Config, str | None]]
RULES: dict[str, Callable[[str], Case]] = {
    "kv_lora_rank": lambda n: ((_base(n, **MLA), "mla"), (_base(n), "mha")),
    "use_mla": lambda n: ((_base(n, **MLA), "mla"), (_base(n, **MLA, use_mla=False), "mha")),
    "index_topk": lambda n: ((_base(n, **MLA, index_topk=2048, index_head_dim=128), "dsa"),
                             (_base(n, **MLA), "mla")),
    "layer_types": lambda n: (
        (_base(n, **GRANITE, layer_types=["mamba", "mamba", "mamba", "attention"]),
         "hybrid_mamba"),
        (_base(n, **GRANITE, layer_types=["attention"] * 4), "mha")),
    "mamba2_cache_params": lambda n: ((_base(n, mamba2_cache_params={"d_state": 128}), None),
                                      (_base(n), None)),
}
SWA_RULES: dict[str, Callable[[str], Case]] = {
    "layer_types": lambda n: ((_base(n, layer_types=SWA_TYPES, sliding_window=128),
                               "hybrid_swa"),
                              (_base(n, layer_types=["full_attention"] * 4, sliding_window=128),
                               "mha")),
    "sliding_window": lambda n: ((_base(n, layer_types=SWA_TYPES, sliding_window=128),
                                  "hybrid_swa"),
                                 (_base(n, layer_types=SWA_TYPES, sliding_window=0), "mha")),
}
# What SGLang's refusal-worthy family is for the Inkling rule, each way.
REFUSED_AS = {"mamba2_cache_params": ("hybrid_mamba", "hybrid_swa")}


def _content_rules(srt: Path) -> dict[str, set[str]]:
    """Class -> the config fields SGLang's source tests to pick its family."""
    gen = _generator()
    rules = gen.rules(srt)
    out: dict[str, set[str]] = {}
    for name, cond in rules.mla.items():
        if cond:
            out.setdefault(name, set()).update(c.strip() for c in cond.split(","))
    for name in rules.dsa:
        out.setdefault(name, set()).add("index_topk")
    configs = gen.config_classes(srt)
    classes = gen.registry(srt)[1]
    for name in architectures.ROWS:
        cfg = gen.config_class(name, classes, configs)
        for ancestor in gen.config_ancestors(cfg, configs):
            _, cond = rules.state_configs.get(ancestor, ("", ""))
            if cond:
                out.setdefault(name, set()).update(
                    c.strip() for c in cond.split(",") if c.strip() != "mamba")
    return out


def _swa_rules(srt: Path) -> dict[str, set[str]]:
    """Allowlisted hybrid-SWA classes whose SWA pool SGLang makes conditional on content."""
    func = _func(srt / "configs" / "model_config.py", "is_hybrid_swa_model")
    out: dict[str, set[str]] = {}
    for node in ast.walk(func):
        if not isinstance(node, ast.If):
            continue
        names = [s.value for s in ast.walk(node.test) if isinstance(s, ast.Constant)
                 and isinstance(s.value, str) and architectures.row(s.value) is not None]
        for name in names:
            out.setdefault(name, set()).update(_fields_read(node, "hf_text_config"))
    return out


def _check(name: str, field: str, config: Config, family: str | None,
           refused_as: str | None) -> None:
    if family is None:
        with pytest.raises(InvalidArgument) as info:
            read_hf(config)
        assert refused_as is not None and refused_as in info.value.message, (
            name, field, info.value.message)
        return
    model = read_hf(config)
    assert _family(model.spec) == family, (name, field, config)
    assert field in model.decided_by, (name, field, model.decided_by)


def test_every_content_rule_of_sglang_is_kvpools() -> None:
    srt = _srt()
    rules = _content_rules(srt)
    assert rules, "no content rule found in SGLang's source: the readers need updating"
    for name, fields in sorted(rules.items()):
        unknown = fields - set(RULES)
        assert not unknown, f"SGLang decides {name} by {unknown}, which kvpool does not read"
        for field in sorted(fields):
            (on, on_family), (off, off_family) = RULES[field](name)
            on_refused, off_refused = REFUSED_AS.get(field, (None, None))
            _check(name, field, on, on_family, on_refused)
            _check(name, field, off, off_family, off_refused)


def test_every_hybrid_swa_condition_of_sglang_is_kvpools() -> None:
    srt = _srt()
    rules = _swa_rules(srt)
    assert set(rules) >= {"BeamForCausalLM", "LagunaForCausalLM"}, rules
    for name, fields in sorted(rules.items()):
        unknown = fields - set(SWA_RULES)
        assert not unknown, f"SGLang's SWA pool for {name} depends on {unknown}: teach kvpool"
        for field in sorted(fields):
            (on, on_family), (off, off_family) = SWA_RULES[field](name)
            _check(name, field, on, on_family, None)
            _check(name, field, off, off_family, None)
    # the opt-in any class may make (the rule's last line)
    opt_in = _fields_read(_func(srt / "configs" / "model_config.py", "is_hybrid_swa_model"),
                          "hf_text_config")
    assert "is_hybrid_swa" in opt_in
    model = read_hf(_base("LlamaForCausalLM", is_hybrid_swa=True, sliding_window=128,
                          hybrid_layer_pattern=[1, 0, 1, 0]))
    assert _family(model.spec) == "hybrid_swa"
    assert "is_hybrid_swa" in model.decided_by


def test_kimi_delta_attention_is_decided_by_content_for_every_class() -> None:
    srt = _srt()
    read = _fields_read(_func(srt / "configs" / "model_config.py", "uses_kda_attention"),
                        "config") | _fields_read(
        _func(srt / "configs" / "model_config.py", "uses_kda_attention"), "linear_attn_config")
    assert read == {"linear_attn_config", "kda_layers", "layer_types", "linear_num_heads",
                    "linear_head_dim"}, read
    markers = (
        ({"linear_attn_config": {"kda_layers": [1, 2]}}, "linear_attn_config.kda_layers"),
        ({"layer_types": ["linear_attention", "full_attention"] * 2, "linear_num_heads": 8,
          "linear_head_dim": 64}, "layer_types"),
    )
    for name, values in sorted(architectures.ROWS.items()):
        if values[0] == "hybrid_kda":
            continue
        for content, field in markers:
            for nested in (False, True):
                config = ({**_base(name), "text_config": {**_base(name), **content}}
                          if nested else _base(name, **content))
                with pytest.raises(InvalidArgument) as info:
                    read_hf(config)
                where = f"text_config.{field}" if nested else field
                assert where in info.value.message, (name, nested, info.value.message)
