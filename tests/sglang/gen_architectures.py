"""Generate ``service/kvpoold/sizing/sglang_architectures.json`` from an installed SGLang.

Run with the side venv's python (it only reads SGLang's source, imports nothing of it)::

    .venv-sglang/bin/python tests/sglang/gen_architectures.py            # print the table
    .venv-sglang/bin/python tests/sglang/gen_architectures.py --write    # rewrite the data file
    .venv-sglang/bin/python tests/sglang/gen_architectures.py --check    # exit 1 on a difference

Every architecture of SGLang's model registry (the ``EntryClass`` names of
``sglang/srt/models/*.py``, read with :mod:`ast`: importing every model module on CPU fails)
gets the attention family SGLang derives for it, read from the same places SGLang decides it:

- ``configs/model_config.py`` ``ModelConfig._derive_model_shapes``: the branches that set
  ``attention_arch`` (MLA, and the DeepSeek-V4 branch), ``PURE_SSM_ARCHITECTURES``;
  ``is_deepseek_dsa`` (MLA classes that become DSA when the config sets ``index_topk``);
  ``is_hybrid_swa_model`` (the hybrid sliding-window allowlist); ``is_generation_model``
  (embedding / reward / classifier classes).
- ``configs/hybrid_arch.py``: the config classes of the state-pool hybrids (``mamba2_config``,
  ``hybrid_gdn_config``, ``kimi_linear_config``, ``hybrid_lightning_config``) and the
  ``LinearAttnModelSpec`` registrations; a model class is matched to its config class through
  the annotation of ``config`` in its ``__init__`` (inherited through its bases).

The output is data only; kvpool's reading of it is ``kvpoold.sizing.architectures``.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import json
import sys
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
TARGET = REPO / "service" / "kvpoold" / "sizing" / "sglang_architectures.json"


@dataclass(frozen=True)
class Row:
    family: str  # the pool family SGLang builds
    kv: str  # what a full-attention layer stores: mha, mla, none
    when: str  # the config condition that changes the family, "" if none
    config_class: str  # the annotated config class of the model, "" if unknown
    generation: bool  # False: an embedding / reward / classifier class
    mm: str = ""  # "listed": in multimodal_model_archs; "disabled": multimodal off by default; ""


def sglang_root() -> Path:
    import importlib.util

    spec = importlib.util.find_spec("sglang")
    if spec is None or spec.origin is None:
        raise SystemExit("sglang is not installed in this python (use the side venv's)")
    return Path(spec.origin).parent / "srt"


def sglang_version(root: Path) -> str:
    from importlib.metadata import version

    return version("sglang")


def _parse(path: Path) -> ast.Module:
    return ast.parse(path.read_text(encoding="utf-8"), filename=str(path))


def _func(tree: ast.AST, name: str) -> ast.FunctionDef:
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef) and node.name == name:
            return node
    raise SystemExit(f"SGLang has no function {name}: the generator needs updating")


def _strings(node: ast.AST) -> list[str]:
    return [n.value for n in ast.walk(node) if isinstance(n, ast.Constant)
            and isinstance(n.value, str)]


def _set_items(node: ast.AST, constants: dict[str, list[str]]) -> list[str]:
    """The strings of a tuple / set literal, module constants it names (``*SWA_SINK_ARCHS``)
    expanded."""
    names: list[str] = []
    for part in ast.walk(node):
        if isinstance(part, ast.Constant) and isinstance(part.value, str):
            names.append(part.value)
        elif isinstance(part, ast.Name) and part.id in constants:
            names.extend(constants[part.id])
    return names


def _module_constants(tree: ast.Module) -> dict[str, list[str]]:
    """Module-level tuples / sets / frozensets of strings (``SWA_SINK_ARCHS`` ...)."""
    out: dict[str, list[str]] = {}
    for node in tree.body:
        if isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(
                node.targets[0], ast.Name):
            out[node.targets[0].id] = _set_items(node.value, out)
    return out


# ---- the registry ------------------------------------------------------------------------------


@dataclass
class ClassInfo:
    bases: list[str]
    config: str | None  # the annotation of __init__'s config argument


def _annotation_name(node: ast.expr | None) -> str | None:
    if node is None:
        return None
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        return node.attr
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return node.value.rsplit(".", 1)[-1]
    if isinstance(node, ast.Subscript):  # Optional[X]
        return _annotation_name(node.slice)
    if isinstance(node, ast.BinOp):  # X | None
        return _annotation_name(node.left)
    return None


def _class_info(node: ast.ClassDef) -> ClassInfo:
    bases = [b.id if isinstance(b, ast.Name) else b.attr if isinstance(b, ast.Attribute) else ""
             for b in node.bases]
    config = None
    for item in node.body:
        if isinstance(item, ast.FunctionDef) and item.name == "__init__":
            for arg in item.args.args + item.args.kwonlyargs:
                if arg.arg == "config":
                    config = _annotation_name(arg.annotation)
    return ClassInfo([b for b in bases if b], config)


def registry(root: Path) -> tuple[list[str], dict[str, ClassInfo]]:
    """The EntryClass names (sorted, unique) and every model-module class's info."""
    entries: set[str] = set()
    classes: dict[str, ClassInfo] = {}
    for path in sorted((root / "models").glob("*.py")):
        tree = _parse(path)
        for node in ast.walk(tree):
            if isinstance(node, ast.ClassDef):
                classes.setdefault(node.name, _class_info(node))
        for node in tree.body:
            if isinstance(node, ast.Assign) and any(
                    isinstance(t, ast.Name) and t.id == "EntryClass" for t in node.targets):
                value = node.value
                items = value.elts if isinstance(value, ast.List | ast.Tuple) else [value]
                for item in items:
                    if isinstance(item, ast.Name):
                        entries.add(item.id)
                    elif isinstance(item, ast.Attribute):
                        entries.add(item.attr)
    return sorted(entries), classes


def config_classes(root: Path) -> dict[str, list[str]]:
    """Every class of ``sglang/srt/configs`` -> its base names."""
    out: dict[str, list[str]] = {}
    for path in sorted((root / "configs").rglob("*.py")):
        for node in ast.walk(_parse(path)):
            if isinstance(node, ast.ClassDef):
                out.setdefault(node.name, _class_info(node).bases)
    return out


def config_class(name: str, classes: dict[str, ClassInfo], configs: dict[str, list[str]]) -> str:
    """The config class of a model class: its ``__init__(config: X)`` annotation (through its
    bases); without one, SGLang's naming convention ``<Prefix>For...`` -> ``<Prefix>Config``
    when SGLang defines that config class (``Lfm2VlForConditionalGeneration`` -> ``Lfm2VlConfig``).
    """
    seen: set[str] = set()
    todo = [name]
    while todo:
        cur = todo.pop(0)
        if cur in seen or cur not in classes:
            continue
        seen.add(cur)
        info = classes[cur]
        if info.config and info.config != "PretrainedConfig":
            return info.config
        todo.extend(info.bases)
    guess = name.split("For", 1)[0] + "Config"
    return guess if "For" in name and guess in configs else ""


def config_ancestors(name: str, configs: dict[str, list[str]]) -> list[str]:
    """``name`` and its base config classes, nearest first (isinstance matches any)."""
    out: list[str] = []
    todo = [name]
    while todo:
        cur = todo.pop(0)
        if cur and cur not in out:
            out.append(cur)
            todo.extend(configs.get(cur, []))
    return out


# ---- SGLang's classification rules -------------------------------------------------------------


def _arch_compares(test: ast.AST) -> list[str]:
    """``"X" in self.hf_config.architectures`` names inside a branch test."""
    names = []
    for node in ast.walk(test):
        if (isinstance(node, ast.Compare) and isinstance(node.left, ast.Constant)
                and isinstance(node.left.value, str)
                and any(isinstance(op, ast.In) for op in node.ops)
                and "architectures" in ast.unparse(node.comparators[0])):
            names.append(node.left.value)
    return names


def _conditions(test: ast.AST) -> dict[str, str]:
    """Names that match only together with a config condition -> that condition's keys."""
    out: dict[str, str] = {}
    for node in ast.walk(test):
        if isinstance(node, ast.BoolOp) and isinstance(node.op, ast.And):
            names = _arch_compares(node)
            keys = [s for s in _strings(node) if s not in names]
            for n in names:
                out[n] = ", ".join(keys)
    return out


def _assigned_arch(body: list[ast.stmt]) -> str | None:
    for stmt in body:
        for node in ast.walk(stmt):
            if (isinstance(node, ast.Assign) and any(
                    isinstance(t, ast.Attribute) and t.attr == "attention_arch"
                    for t in node.targets) and isinstance(node.value, ast.Attribute)):
                return node.value.attr
    return None


@dataclass
class Rules:
    mla: dict[str, str]  # name -> condition ("" unconditional)
    mha_branch: set[str]
    dsv4: set[str]
    pure_ssm: set[str]
    dsa: set[str]
    hybrid_swa: set[str]
    swa_conditional: dict[str, str]
    not_generation: set[str]
    multimodal: set[str]
    mm_disabled: set[str]
    state_configs: dict[str, tuple[str, str]]  # config class -> (family, condition)
    linear_registered: dict[str, tuple[str, str]]  # arch -> (family, config class)


def _walk_if_chain(node: ast.If) -> list[tuple[ast.expr, list[ast.stmt]]]:
    out = []
    cur: ast.stmt | None = node
    while isinstance(cur, ast.If):
        out.append((cur.test, cur.body))
        cur = cur.orelse[0] if len(cur.orelse) == 1 and isinstance(cur.orelse[0], ast.If) \
            else None
    return out


STATE_FUNCTIONS = {
    "mamba2_config": "hybrid_mamba",
    "qwen3_next_config": "hybrid_gdn",
    "hybrid_gdn_config": "hybrid_gdn",
    "kimi_linear_config": "hybrid_kda",
    "hybrid_lightning_config": "hybrid_lightning",
}


def _state_configs(root: Path) -> dict[str, tuple[str, str]]:
    tree = _parse(root / "configs" / "hybrid_arch.py")
    out: dict[str, tuple[str, str]] = {}
    for fname, family in STATE_FUNCTIONS.items():
        func = _func(tree, fname)
        for node in ast.walk(func):
            if not isinstance(node, ast.If):
                continue
            calls = [c for c in ast.walk(node.test) if isinstance(c, ast.Call)
                     and isinstance(c.func, ast.Name) and c.func.id == "isinstance"]
            if not calls or "is_draft_model" in ast.unparse(node.test):
                continue  # the draft-model exception is not the target's family
            direct = (len(node.body) == 1 and isinstance(node.body[0], ast.Return)
                      and not isinstance(node.body[0].value, ast.IfExp)
                      and not isinstance(node.test, ast.BoolOp))
            extra = [a.attr for a in ast.walk(node.test) if isinstance(a, ast.Attribute)
                     and a.attr not in ("text_config",)]
            if not direct:
                extra += [a.attr for s in node.body for a in ast.walk(s)
                          if isinstance(a, ast.Attribute) and a.attr != "text_config"]
                extra += [s for s in _strings(ast.Module(body=node.body, type_ignores=[]))]
            cond = "" if direct else ", ".join(dict.fromkeys(extra)) or "see hybrid_arch.py"
            for call in calls:
                for n in ast.walk(call.args[1]):
                    if isinstance(n, ast.Name):
                        out.setdefault(n.id, (family, cond))
    return out


def _linear_registered(root: Path) -> dict[str, tuple[str, str]]:
    out: dict[str, tuple[str, str]] = {}
    for path in sorted(root.rglob("*.py")):
        text = path.read_text(encoding="utf-8")
        if "LinearAttnModelSpec(" not in text or path.name == "linear_attn_model_registry.py":
            continue
        for node in ast.walk(ast.parse(text)):
            if (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
                    and node.func.id == "LinearAttnModelSpec"):
                kw = {k.arg: k.value for k in node.keywords}
                backend = kw.get("backend_class_name")
                backend_name = backend.value if isinstance(backend, ast.Constant) else ""
                family = "hybrid_gdn" if "gdn" in str(backend_name).lower() else \
                    "hybrid_kda" if "kda" in str(backend_name).lower() else "hybrid_linear"
                cfg = _annotation_name(kw.get("config_class")) or ""
                for name in _strings(kw["arch_names"]) if "arch_names" in kw else []:
                    out[name] = (family, cfg)
    return out


def rules(root: Path) -> Rules:
    tree = _parse(root / "configs" / "model_config.py")
    constants = _module_constants(tree)
    shapes = _func(tree, "_derive_model_shapes")
    mla: dict[str, str] = {}
    mha_branch: set[str] = set()
    dsv4: set[str] = set()
    for node in shapes.body:
        if not isinstance(node, ast.If) or not _arch_compares(node.test):
            continue
        for test, body in _walk_if_chain(node):
            arch = _assigned_arch(body)
            names = _arch_compares(test)
            conds = _conditions(test)
            if arch == "MLA":
                for n in names:
                    mla.setdefault(n, conds.get(n, ""))
            elif arch == "MHA" and any("compress_ratios" in ast.unparse(s) for s in body):
                dsv4.update(names)
            elif arch == "MHA":
                mha_branch.update(names)
    swa_func = _func(tree, "is_hybrid_swa_model")
    hybrid_swa: set[str] = set()
    for node in ast.walk(swa_func):
        if isinstance(node, ast.Assign) and any(
                isinstance(t, ast.Name) and t.id == "hybrid_swa_archs" for t in node.targets):
            hybrid_swa.update(_set_items(node.value, constants))
    swa_conditional: dict[str, str] = {}
    for node in ast.walk(swa_func):
        if isinstance(node, ast.If):
            names = [s for s in _strings(node.test) if s in hybrid_swa]
            keys = [s for s in _strings(node.test) if s not in hybrid_swa]
            keys += [a.attr for a in ast.walk(node.test)
                     if isinstance(a, ast.Attribute) and a.attr != "layer_types"] \
                if not keys else []
            for n in names:
                swa_conditional[n] = ", ".join(dict.fromkeys(keys))
    dsa = set(_strings(_func(tree, "is_deepseek_dsa"))) - {"index_topk"}
    gen_func = _func(tree, "is_generation_model")
    not_generation = {s for s in _strings(gen_func) if s[:1].isupper()}
    mm_disabled: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Assign) and any(
                isinstance(t, ast.Name) and t.id == "mm_disabled_models" for t in node.targets):
            mm_disabled.update(_set_items(node.value, constants))
    return Rules(
        mla=mla, mha_branch=mha_branch, dsv4=dsv4,
        pure_ssm=set(constants.get("PURE_SSM_ARCHITECTURES", [])),
        dsa=dsa, hybrid_swa=hybrid_swa, swa_conditional=swa_conditional,
        not_generation=not_generation,
        multimodal=set(constants.get("multimodal_model_archs", [])), mm_disabled=mm_disabled,
        state_configs=_state_configs(root),
        linear_registered=_linear_registered(root),
    )


def classify(name: str, cfg: str, r: Rules, configs: dict[str, list[str]]) -> Row:
    mm = "disabled" if name in r.mm_disabled else "listed" if name in r.multimodal else ""
    return dataclasses.replace(_classify(name, cfg, r, configs), mm=mm)


def _classify(name: str, cfg: str, r: Rules, configs: dict[str, list[str]]) -> Row:
    generation = name not in r.not_generation
    kv = "mla" if name in r.mla else "mha"
    if name in r.dsv4:
        return Row("dsv4", "mha", "", cfg, generation)
    if name in r.pure_ssm:
        return Row("mamba", "none", "", cfg, generation)
    state = r.linear_registered.get(name)
    if state is not None:
        return Row(state[0], kv, "", state[1] or cfg, generation)
    for ancestor in config_ancestors(cfg, configs):
        if ancestor in r.state_configs:
            family, cond = r.state_configs[ancestor]
            return Row(family, kv, cond, cfg, generation)
    if name in r.mla:
        parts = [f"mla: {r.mla[name]}"] if r.mla[name] else []
        if name in r.dsa:
            parts.append("dsa: index_topk")
        return Row("mla", "mla", "; ".join(parts), cfg, generation)
    if name in r.hybrid_swa:
        return Row("hybrid_swa", "mha", r.swa_conditional.get(name, ""), cfg, generation)
    return Row("mha", "mha", "", cfg, generation)


def build(root: Path) -> dict[str, Row]:
    names, classes = registry(root)
    configs = config_classes(root)
    r = rules(root)
    return {n: classify(n, config_class(n, classes, configs), r, configs) for n in names}


COMMENT = [
    "SGLang's model registry, one row per architecture (GENERATED: do not edit).",
    "Regenerate after an SGLang upgrade: .venv-sglang/bin/python "
    "tests/sglang/gen_architectures.py --write",
    "tests/integration/test_sglang_registry.py regenerates it and fails on any difference.",
    "family: the pool SGLang builds (mha, mla, hybrid_swa, dsv4, hybrid_gdn, hybrid_mamba, "
    "hybrid_kda, hybrid_lightning, mamba); kv: what a full-attention layer stores (mha, mla, "
    "none); when: the config keys that change the family ('dsa: index_topk': DSA when the "
    "config sets index_topk; 'mla: kv_lora_rank': MLA only with that key; hybrid_swa and "
    "state-pool conditions name the keys SGLang tests); config_class: SGLang's config class; "
    "generation: false for embedding / reward / classifier classes; mm: 'listed' in SGLang's "
    "multimodal_model_archs, 'disabled' when SGLang turns multimodal off by default.",
]
COLUMNS = ["family", "kv", "when", "config_class", "generation", "mm"]


def render(table: dict[str, Row], version: str) -> str:
    """The data file: JSON, one row per line (a diff shows the classes that changed)."""
    rows = [f"    {json.dumps(name)}: " + json.dumps(
        [row.family, row.kv, row.when, row.config_class, row.generation, row.mm])
        for name, row in table.items()]
    head = json.dumps({"comment": COMMENT, "sglang_version": version, "columns": COLUMNS},
                      indent=2)[:-2]
    return head + ',\n  "rows": {\n' + ",\n".join(rows) + "\n  }\n}\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    g = p.add_mutually_exclusive_group()
    g.add_argument("--write", action="store_true", help=f"rewrite {TARGET.relative_to(REPO)}")
    g.add_argument("--check", action="store_true", help="exit 1 when the data file differs")
    g.add_argument("--render", action="store_true", help="print the data file to stdout")
    args = p.parse_args(argv)
    root = sglang_root()
    text = render(build(root), sglang_version(root))
    if args.write:
        TARGET.write_text(text, encoding="utf-8")
    elif args.check:
        if TARGET.read_text(encoding="utf-8") != text:
            print(f"{TARGET} differs from the installed SGLang; regenerate with --write")
            return 1
    elif args.render:
        sys.stdout.write(text)
    else:
        for name, row in build(root).items():
            print(f"{name:55} {row.family:17} {row.kv:4} {row.when}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
