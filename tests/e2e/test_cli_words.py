"""Every ``kvpool`` and ``kvpoold`` command run with bad input as a user would (child processes,
a real daemon): the error names the flags and positionals the user typed, never a wire field
name where the command has a flag for it; SGLang's ``--kv-cache-dtype`` spellings and Hub ids
already in the local Hub cache are taken."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.conftest import REPO, DaemonProcess, run_daemon, subprocess_env, temp_dir

LLAMA = REPO / "tests" / "data" / "models" / "llama-3.1-8b-instruct.json"
HUB_ID = "meta-llama/Llama-3.1-8B"
# Wire names whose flag is spelled otherwise (written out here, not taken from the code under
# test): wire field -> the destination of the flag that sets it.
RENAMED = {"budget_bytes": "budget", "hf_config_json": "hf_config", "model_config": "hf_config",
           "kv_cache_memory_bytes": "budget"}


@pytest.fixture(scope="module")
def daemon() -> Iterator[DaemonProcess]:
    with temp_dir() as path, run_daemon(path, budget="64MiB") as d:
        yield d


@pytest.fixture(scope="module")
def bad_files() -> Iterator[dict[str, Path]]:
    with temp_dir() as path:
        spec = path / "bad-spec.json"
        spec.write_text('{"num_layers": "x"}')
        hf = path / "bad-config.json"
        hf.write_text('{"architectures": ["LlamaForCausalLM"], "num_hidden_layers": "x"}')
        yield {"spec": spec, "hf": hf}


def run(prog: str, *args: str, **env: str) -> subprocess.CompletedProcess[str]:
    module = {"kvpool": "kvpool.tools.cli", "kvpoold": "kvpoold.main"}[prog]
    return subprocess.run([sys.executable, "-m", module, *args], cwd=REPO, capture_output=True,
                          text=True, env=subprocess_env(**env), timeout=120)


def subcommand_parser(prog: str, command: str) -> argparse.ArgumentParser:
    if prog == "kvpool":
        from kvpool.tools.cli import build_parser
    else:
        from kvpoold.main import build_parser
    parser = build_parser()
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return action.choices[command]  # type: ignore[no-any-return]
    raise AssertionError(command)


def wire_names_with_flags(prog: str, command: str) -> dict[str, str]:
    """Wire field name -> the flag this command has for it (names with an underscore: the
    ones that read as wire names, not words)."""
    flags = {a.dest: a.option_strings[-1] for a in subcommand_parser(prog, command)._actions
             if a.option_strings and a.dest != "help"}
    names = {dest: flag for dest, flag in flags.items() if "_" in dest}
    names |= {wire: flags[dest] for wire, dest in RENAMED.items() if dest in flags}
    return names


def assert_in_user_words(out: subprocess.CompletedProcess[str], prog: str, command: str,
                         rc: int, *expected: str) -> str:
    err = out.stderr.strip()
    assert out.returncode == rc, (out.returncode, out.stdout[-2000:], err)
    assert len(err.splitlines()) == 1, err
    for wire, flag in wire_names_with_flags(prog, command).items():
        assert wire not in err, f"{wire!r} (its flag: {flag}) in: {err}"
    for text in expected:
        assert text in err, err
    return err


def test_configure_in_user_words(daemon: DaemonProcess, bad_files: dict[str, Path]) -> None:
    t = ("--target", daemon.target)
    c = ("configure", *t)
    ok = run("kvpool", *c, "llama", "--hf-config", str(LLAMA), "--budget", "8MiB")
    assert ok.returncode == 0, ok.stderr
    cases: list[tuple[tuple[str, ...], int, tuple[str, ...]]] = [
        # No --budget typed: the text names it, no "--budget:" prefix.
        (("x", "--hf-config", str(LLAMA)), 2,
         ("kvpool configure: error: give --budget (", "--max-total-tokens, or both")),
        # The positional: the message names the pool, no --pool flag exists.
        (("llama", "--hf-config", str(LLAMA), "--budget", "16MiB"), 1,
         ("error (ALREADY_EXISTS): pool 'llama' exists with layout",)),
        (("BAD", "--hf-config", str(LLAMA), "--budget", "8MiB"), 2,
         ("error: pool name 'BAD' must match",)),
        (("x", "--spec", str(bad_files["spec"]), "--budget", "8MiB"), 2,
         (f"error: --spec: invalid model spec in {bad_files['spec']}: Expected `int`, got "
          "`str` - at `$.num_layers`",)),
        (("x", "--hf-config", str(bad_files["hf"]), "--budget", "8MiB"), 2,
         ("error: --hf-config: num_hidden_layers must be an integer, got 'x'",)),
        (("x", "--hf-config", str(bad_files["hf"]), "--budget", "8MiB", "--engine", "vllm"), 2,
         ("error: --hf-config: num_hidden_layers must be a positive integer",)),
        (("x", "--hf-config", str(LLAMA), "--max-total-tokens", "10000000"), 1,
         ("error (RESOURCE_EXHAUSTED): pool 'x' needs", "lower --budget / --max-total-tokens")),
        (("x", "--hf-config", str(LLAMA), "--budget", "8MiB", "--page-size", "0"), 2,
         ("error: --page-size: invalid plan option: Expected `int` >= 1",)),
        # --engine vllm: --budget is vLLM's kv_cache_memory_bytes, named as typed.
        (("x", "--hf-config", str(LLAMA), "--budget", "64MiB", "--engine", "vllm"), 2,
         ("error: --budget: one request of --max-model-len 131,072 tokens",
          "that --budget 67,108,864 B leaves", "raise --budget or lower --max-model-len")),
        (("x", "--hf-config", HUB_ID, "--budget", "8MiB"), 2,
         (f"error: --hf-config: no file or directory '{HUB_ID}'; it reads a local config.json",
          f"`hf download {HUB_ID} config.json`")),
    ]
    for args, rc, expected in cases:
        out = run("kvpool", *c, *args, HF_HUB_CACHE=str(bad_files["hf"].parent / "no-cache"))
        assert_in_user_words(out, "kvpool", "configure", rc, *expected)


def test_other_kvpool_commands_in_user_words(daemon: DaemonProcess) -> None:
    t = ("--target", daemon.target)
    err = assert_in_user_words(run("kvpool", "drop", *t, "nope"), "kvpool", "drop", 1,
                               "error (NOT_FOUND): no pool 'nope'")
    assert "--pool" not in err and "pool: no pool" not in err
    assert_in_user_words(run("kvpool", "stats", *t, "--pool", "nope"), "kvpool", "stats", 1,
                         "error (NOT_FOUND): --pool: no pool 'nope'")
    assert_in_user_words(run("kvpool", "demo", "--model-config", "/nonexistent/config.json"),
                         "kvpool", "demo", 2,
                         "error: --model-config: model config /nonexistent/config.json does "
                         "not exist")


def test_kvpoold_commands_in_user_words(bad_files: dict[str, Path], tmp_path: Path) -> None:
    p = ("plan", "--model-config")
    cases: list[tuple[tuple[str, ...], tuple[str, ...]]] = [
        ((str(bad_files["hf"]), "--budget", "1GiB"),
         (f"error: --model-config: {bad_files['hf']}: num_hidden_layers must be an integer",)),
        ((str(LLAMA), "--max-total-tokens", "1"),
         ("error: the pool holds 1 tokens, not enough for one running request; raise --budget",)),
        ((str(LLAMA), "--budget", "40GiB", "--context-length", "262144"),
         ("error: --context-length 262,144 is above the model's 131,072",)),
        ((str(LLAMA), "--budget", "1GiB", "--page-size", "0"),
         ("error: --page-size: invalid plan option: Expected `int` >= 1",)),
        ((HUB_ID, "--budget", "1GiB"),
         (f"error: --model-config: no file or directory '{HUB_ID}'",)),
    ]
    for args, expected in cases:
        out = run("kvpoold", *p, *args, HF_HUB_CACHE=str(tmp_path / "no-cache"))
        err = assert_in_user_words(out, "kvpoold", "plan", 2, *expected)
        assert "(set by" not in err
    out = run("kvpoold", "serve", "--listen", f"unix://{tmp_path}/k.sock",
              "--shm-dir", "/nonexistent/shm")
    assert_in_user_words(out, "kvpoold", "serve", 2,
                         "error: --shm-dir: shared-memory directory /nonexistent/shm does not "
                         "exist")


def test_kv_cache_dtype_takes_sglangs_spellings() -> None:
    """SGLang 0.5.23's --kv-cache-dtype choices bf16 / nvfp4 / fp4_mx_block16 are kvpool's
    bfloat16 / fp4_e2m1 (Llama 3.1 8B, page 1: bf16 is 32 layers x 2 x 8 heads x 128 x 2 B =
    131,072 B per token, as for bfloat16)."""
    for given, meant in (("bf16", "bfloat16"), ("nvfp4", "fp4_e2m1"),
                         ("fp4_mx_block16", "fp4_e2m1")):
        out = run("kvpoold", "plan", "--model-config", str(LLAMA), "--budget", "1GiB", "--json",
                  "--kv-cache-dtype", given)
        assert out.returncode == 0, out.stderr
        plan = json.loads(out.stdout)
        assert plan["kv_cache_dtype"] == meant
    bf16 = json.loads(run("kvpoold", "plan", "--model-config", str(LLAMA), "--budget", "1GiB",
                          "--json", "--kv-cache-dtype", "bf16").stdout)
    assert bf16["cell_size_bytes"] == 131_072
    out = run("kvpoold", "plan", "--model-config", str(LLAMA), "--budget", "1GiB",
              "--kv-cache-dtype", "bf17")
    assert out.returncode == 2 and "invalid choice: 'bf17'" in out.stderr


def test_a_hub_id_in_the_local_hub_cache_is_read(tmp_path: Path) -> None:
    """huggingface_hub's cache layout: models--<org>--<name>/refs/main names the snapshot."""
    repo = tmp_path / "hub" / "models--meta-llama--Llama-3.1-8B"
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text("abc123\n")
    (repo / "snapshots" / "abc123").mkdir(parents=True)
    (repo / "snapshots" / "abc123" / "config.json").write_text(LLAMA.read_text())
    out = run("kvpoold", "plan", "--model-config", HUB_ID, "--budget", "1GiB", "--json",
              HF_HUB_CACHE=str(tmp_path / "hub"))
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout)["model_architecture"] == "LlamaForCausalLM"
