"""``kvpoold plan``: JSON and table output per model, every bad input -> exit 2, parse_size."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from kvpool.contract.errors import InvalidArgument
from kvpool.contract.sizes import format_size, parse_size
from kvpoold import main as cli
from kvpoold.hf import load_model
from kvpoold.sizing import PoolPlan, make_options, plan

ROOT = Path(__file__).resolve().parents[2]
MODELS = ROOT / "tests" / "data" / "models"
LLAMA = MODELS / "llama-3.1-8b-instruct.json"
QWEN3 = MODELS / "qwen3-8b.json"
DSV3 = MODELS / "deepseek-v3.json"
DSV32 = MODELS / "deepseek-v3.2-exp.json"
GPT_OSS = MODELS / "gpt-oss-20b.json"
QWEN3_NEXT = MODELS / "qwen3-next-80b-a3b-instruct.json"
BUDGET = 42_949_672_960  # 40 GiB


def run_plan(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str, str]:
    """In-process ``kvpoold plan ARGS``; argparse's own errors come back as exit codes too."""
    try:
        code = cli.main(["plan", *map(str, args)])
    except SystemExit as exc:
        code = int(exc.code or 0)
    out, err = capsys.readouterr()
    return code, out, err


def plan_json(capsys: pytest.CaptureFixture[str], model: Path, *args: str) -> dict[str, Any]:
    code, out, err = run_plan(capsys, "--model-config", str(model), "--json", *args)
    assert code == 0, err
    return json.loads(out)


def run_subprocess(*args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "client"),
                                                        str(ROOT / "service")])}
    return subprocess.run([sys.executable, "-m", "kvpoold.main", "plan", *args], cwd=ROOT,
                          env=env, capture_output=True, text=True, timeout=60, check=False)


# ---- numbers per model (JSON) -------------------------------------------------------------------


def test_llama_40gib_page16(capsys: pytest.CaptureFixture[str]):
    """cell = 8 KV heads * (128 + 128) * 32 layers * 2 B = 131,072 B; one page of 16 tokens =
    2,097,152 B; pages = 42,949,672,960 // 2,097,152 = 20,480 (the padding page comes on top);
    tokens = 327,680. max_running_requests = clamp(int(327,680 / 131,072 * 512) = 1,280, 2,048,
    4,096) = 2,048. Buffers k.0..31, v.0..31 of (20,481 * 16 = 327,696, 8, 128) bf16 =
    671,121,408 B each: 64 * 671,121,408 = 42,951,770,112 B, the budget plus one page."""
    p = plan_json(capsys, LLAMA, "--budget", "40GiB", "--page-size", "16")
    assert p["architecture"] == "mha"
    assert p["architecture_source"] == "hf_config"
    assert p["model_architecture"] == "LlamaForCausalLM"
    assert p["kv_cache_dtype"] == "bfloat16"
    assert p["cell_size_bytes"] == 131_072
    assert p["num_pages"] == 20_480
    assert p["max_total_num_tokens"] == 327_680
    assert p["max_running_requests"] == 2048
    assert p["budget_bytes"] == BUDGET
    assert p["total_bytes"] == 42_951_770_112 == BUDGET + 2_097_152
    k0 = next(b for b in p["buffers"] if b["name"] == "k.0")
    assert k0["shape"] == [327_696, 8, 128]
    assert k0["nbytes"] == 671_121_408


def test_qwen3_8b_40gib(capsys: pytest.CaptureFixture[str]):
    """cell = 8 * 256 * 36 * 2 = 147,456 B (= 36 * 4,096); tokens (page 1) = 42,949,672,960 //
    147,456 = 10,485,760 // 36 = 291,271; max_running_requests = int(291,271 / 40,960 * 512) =
    int(3,640.9) = 3,640; the req_to_token table has 40,960 + 4 columns."""
    p = plan_json(capsys, QWEN3, "--budget", str(BUDGET))
    assert p["architecture"] == "mha"
    assert p["cell_size_bytes"] == 147_456
    assert p["max_total_num_tokens"] == 291_271
    assert p["max_running_requests"] == 3640
    assert p["req_to_token_columns"] == 40_964


def test_deepseek_v3_mla(capsys: pytest.CaptureFixture[str]):
    """cell = (512 + 64) * 61 * 2 = 70,272 B; 70,272 * 611,191 = 42,949,613,952 <= budget <
    70,272 * 611,192, so tokens = 611,191 (page 1), plus the padding row: 611,192 rows;
    max_running_requests = clamp(int(611,191 / 163,840 * 512) = 1,909) = 2,048."""
    p = plan_json(capsys, DSV3, "--budget", "40GiB")
    assert p["architecture"] == "mla"
    assert p["cell_size_bytes"] == 70_272
    assert p["max_total_num_tokens"] == 611_191
    assert p["max_running_requests"] == 2048
    assert p["buffers"][0]["shape"] == [611_192, 1, 576]


def test_deepseek_v3_eagle_uses_the_nextn_layer(capsys: pytest.CaptureFixture[str]):
    """With --speculative-algorithm eagle the draft layers default to the config's
    num_nextn_predict_layers = 1: cell = 70,272 * 62 // 61 = 71,424 B;
    71,424 * 601,333 = 42,949,608,192 <= budget < 71,424 * 601,334, so tokens = 601,333;
    max_running_requests: SGLang's speculative default, 48;
    req_to_token columns = 163,840 + 4 + (1 + 1) = 163,846."""
    p = plan_json(capsys, DSV3, "--budget", "40GiB", "--speculative-algorithm", "eagle")
    assert p["num_draft_layers"] == 1
    assert p["cell_size_bytes"] == 71_424
    assert p["max_total_num_tokens"] == 601_333
    assert p["max_running_requests"] == 48
    assert p["req_to_token_columns"] == 163_846
    assert any(b["name"] == "draft_kv.0" for b in p["buffers"])


def test_deepseek_v32_dsa_page64(capsys: pytest.CaptureFixture[str]):
    """cell = (1,152 latent + 132 indexer) * 61 = 78,324 B; one page of 64 = 5,012,736 B;
    pages = 42,949,672,960 // 5,012,736 = 8,568 (550,912 B left); tokens = 548,352."""
    p = plan_json(capsys, DSV32, "--budget", "40GiB", "--page-size", "64")
    assert p["architecture"] == "dsa"
    assert p["cell_size_bytes"] == 78_324
    assert p["num_pages"] == 8_568
    assert p["max_total_num_tokens"] == 548_352


def test_gpt_oss_hybrid_swa_page16(capsys: pytest.CaptureFixture[str]):
    """F = S = 8 heads * (64 + 64) * 2 B = 2,048 B per layer; 12 full and 12 SWA layers, so
    Fb = Sb = 24,576 B; SGLang's float cell 24,576 + 0.8 * 24,576 = 44,236.8 (reported 44,236).
    full = int(42,949,672,960 // 44,236.8) = 970,903 -> // 16 * 16 = 970,896 (60,681 pages);
    swa = int(970,896 * 0.8) = int(776,716.8) = 776,716 -> 776,704 (48,544 pages). Both spaces
    add a padding page on top: bytes = 16 * 24,576 * (60,682 + 48,545) = 393,216 * 109,227 =
    42,949,804,032. max_running_requests = int(970,896 / 131,072 * 512) = 3,792. The loader
    gives SGLang's exclusive window: 128 - 1 = 127."""
    p = plan_json(capsys, GPT_OSS, "--budget", "40GiB", "--page-size", "16")
    assert p["architecture"] == "hybrid_swa"
    assert p["cell_size_bytes"] == 44_236
    assert p["full_max_total_num_tokens"] == 970_896
    assert p["max_total_num_tokens"] == 970_896
    assert p["swa_max_total_num_tokens"] == 776_704
    assert p["max_running_requests"] == 3792
    assert p["total_bytes"] == 42_949_804_032


def test_qwen3_next_hybrid_linear(capsys: pytest.CaptureFixture[str]):
    """State per request slot and linear layer: conv_dim = 128 * 32 + 2 * 16 * 128 = 8,192,
    conv (8,192, 3) bf16 = 49,152 B; ssm (32, 128, 128) fp32 = 2,097,152 B; * 36 linear layers =
    77,266,944 B. mamba budget = 42,949,672,960 * 0.9 / 1.9 -> 20,344,581,928 B;
    slots = (20,344,581,928 - 77,266,944) // 77,266,944 = 262; KV gets 42,949,672,960 - 263 *
    77,266,944 = 22,628,466,688 B; cell = 2 * 512 * 12 * 2 = 24,576 B; tokens = 22,628,466,688
    // 24,576 = 920,754. max_running_requests = min(2,048, 262 // 5 = 52) = 52: 5 state slots
    per request with the radix cache (3, plus extra_buffer's 2 under the overlap schedule)."""
    p = plan_json(capsys, QWEN3_NEXT, "--budget", "40GiB")
    assert p["architecture"] == "hybrid_linear"
    assert p["cell_size_bytes"] == 24_576
    assert p["mamba_cache_size"] == 262
    assert p["max_total_num_tokens"] == 920_754
    assert p["max_running_requests"] == 52


def test_llama_fp4(capsys: pytest.CaptureFixture[str]):
    """FP4: per layer 8 * 256 / 2 data + 8 * 256 / 16 scales = 1,024 + 128 = 1,152 B; cell =
    36,864 B; page 16 = 589,824 B; pages = 42,949,672,960 // 589,824 = 72,817; tokens =
    1,165,072; max_running_requests = int(1,165,072 / 131,072 * 512) = 4,551 -> 4,096."""
    p = plan_json(capsys, LLAMA, "--budget", "40GiB", "--page-size", "16",
                  "--kv-cache-dtype", "fp4_e2m1")
    assert p["kv_cache_dtype"] == "fp4_e2m1"
    assert p["cell_size_bytes"] == 36_864
    assert p["max_total_num_tokens"] == 1_165_072
    assert p["max_running_requests"] == 4096


def test_llama_tp_pp_fp8(capsys: pytest.CaptureFixture[str]):
    """TP 2 -> 4 KV heads; PP rank 1 of 2 -> layers 16..31; fp8 -> 1 B: cell = 4 * 256 * 16 * 1
    = 16,384 B; pages (page 1) = 42,949,672,960 // 16,384 = 2,621,440 (both stages alike)."""
    p = plan_json(capsys, LLAMA, "--budget", "40GiB", "--tp-size", "2", "--pp-size", "2",
                  "--pp-rank", "1", "--kv-cache-dtype", "fp8_e4m3")
    assert (p["layer_start"], p["layer_end"]) == (16, 32)
    assert p["cell_size_bytes"] == 16_384
    assert p["max_total_num_tokens"] == 2_621_440
    assert {b["name"] for b in p["buffers"]} >= {"k.16", "v.31"}


def test_max_total_tokens_alone_and_caps(capsys: pytest.CaptureFixture[str]):
    """--max-total-tokens 100,000 alone at page 16: 6,250 pages; with --max-running-requests
    8 and --context-length 4,096 the table is 9 x 4,100."""
    p = plan_json(capsys, LLAMA, "--max-total-tokens", "100000", "--page-size", "16",
                  "--max-running-requests", "8", "--context-length", "4096")
    assert p["budget_bytes"] is None
    assert p["max_total_num_tokens"] == 100_000
    assert p["num_pages"] == 6_250
    assert p["max_running_requests"] == 8
    req = next(b for b in p["buffers"] if b["name"] == "req_to_token")
    assert req["shape"] == [9, 4_100]


def test_unknown_architecture_is_refused_then_planned_as_assumed(
        capsys: pytest.CaptureFixture[str], tmp_path: Path):
    """Llama's config relabelled LlamaForCausalLMv2: refused naming LlamaForCausalLM; with
    --assume-architecture mha the same MHA numbers, source 'assumed' and a note."""
    cfg = json.loads(LLAMA.read_text())
    cfg["architectures"] = ["LlamaForCausalLMv2"]
    path = tmp_path / "config.json"
    path.write_text(json.dumps(cfg))
    expect_error(capsys, "--budget", "40GiB", model=path,
                 needles=("--model-config: ", "LlamaForCausalLMv2",
                          "nearest known: LlamaForCausalLM", "--assume-architecture"))
    p = plan_json(capsys, path, "--budget", "40GiB", "--page-size", "16",
                  "--assume-architecture", "mha")
    assert p["architecture_source"] == "assumed"
    assert p["max_total_num_tokens"] == 327_680
    assert any("--assume-architecture" in n for n in p["notes"])


def test_spec_file_source(capsys: pytest.CaptureFixture[str], tmp_path: Path):
    path = tmp_path / "spec.toml"
    path.write_text('num_layers = 32\ncontext_length = 131072\n[attention]\ntype = "mha"\n'
                    "num_kv_heads = 8\nhead_dim = 128\n")
    p = plan_json(capsys, path, "--budget", "40GiB", "--page-size", "16")
    assert p["architecture_source"] == "spec"
    assert p["max_total_num_tokens"] == 327_680


@pytest.mark.parametrize("model", sorted(MODELS.glob("*.json")), ids=lambda p: p.stem)
def test_plan_json_round_trip(model: Path):
    """Every shared model's plan survives PoolPlan.to_json -> from_json unchanged."""
    spec, source = load_model(model)
    p = plan(spec, make_options(budget_bytes=BUDGET, page_size=64), source=source)
    assert PoolPlan.from_json(p.to_json()) == p


# ---- the table ----------------------------------------------------------------------------------


def test_table_output(capsys: pytest.CaptureFixture[str]):
    code, out, err = run_plan(capsys, "--model-config", str(LLAMA), "--budget", "40GiB",
                              "--page-size", "16")
    assert code == 0, err
    assert "mha (from hf_config)" in out
    assert "327,680" in out  # max total tokens
    assert "20,480 (+1 padding page)" in out
    assert "42,949,672,960 B (40.00 GiB)" in out  # the budget
    assert "42,951,770,112 B" in out  # the buffers: one page more
    assert "k.0, k.1, k.2, ... k.31 (32 buffers)" in out
    assert "req_to_token" in out
    # each k/v buffer: 327,696 * 8 * 128 * 2 = 671,121,408 B = 640.03 MiB; 32 of them 20.00 GiB
    assert "640.03 MiB" in out and "20.00 GiB" in out


def test_table_lists_hybrid_fields(capsys: pytest.CaptureFixture[str]):
    code, out, _ = run_plan(capsys, "--model-config", str(QWEN3_NEXT), "--budget", "40GiB")
    assert code == 0
    assert "mamba cache slots" in out and "262" in out
    assert "note" in out


# ---- bad input -> exit 2, the field named ------------------------------------------------------


def expect_error(capsys: pytest.CaptureFixture[str], *args: str, model: Path = LLAMA,
                 needles: tuple[str, ...]) -> str:
    code, out, err = run_plan(capsys, "--model-config", str(model), *args)
    assert code == 2, (out, err)
    assert out == ""
    for needle in needles:
        assert needle in err, err
    return err


def test_budget_too_small_says_what_one_page_needs(capsys: pytest.CaptureFixture[str]):
    """Page 16 of Llama = 2,097,152 B; 2 MiB - 1 does not buy it (the padding page comes on
    top, so 2 MiB would)."""
    err = expect_error(capsys, "--budget", str(2 * 2**20 - 1), "--page-size", "16",
                       needles=("budget", "one KV page of 2,097,152 B", "--budget"))
    assert len(err.strip().splitlines()) == 1


def test_context_length_above_the_model_needs_the_flag(capsys: pytest.CaptureFixture[str]):
    """Llama's 131,072 context: 262,144 is refused naming the field and the flag; with
    --allow-longer-context the table has 262,144 + 4 columns."""
    err = expect_error(capsys, "--budget", "40GiB", "--context-length", "262144",
                       needles=("--context-length", "--allow-longer-context"))
    assert len(err.strip().splitlines()) == 1
    p = plan_json(capsys, LLAMA, "--budget", "40GiB", "--context-length", "262144",
                  "--allow-longer-context")
    assert (p["context_length"], p["req_to_token_columns"]) == (262_144, 262_148)


def test_mamba_flags_reach_the_sizing(capsys: pytest.CaptureFixture[str]):
    """Qwen3-Next, 40 GiB: 262 slots; --disable-overlap-schedule leaves extra_buffer one
    tracking slot (ratio 4): 262 // 4 = 65 requests; --mamba-radix-cache-strategy no_buffer at
    page 16 is refused, naming the strategy."""
    p = plan_json(capsys, QWEN3_NEXT, "--budget", "40GiB", "--disable-overlap-schedule")
    assert (p["mamba_cache_size"], p["max_running_requests"]) == (262, 65)
    expect_error(capsys, "--budget", "40GiB", "--page-size", "16",
                 "--mamba-radix-cache-strategy", "no_buffer", model=QWEN3_NEXT,
                 needles=("--mamba-radix-cache-strategy", "--page-size 1"))


def test_dsa_page_size_is_forced_to_64(capsys: pytest.CaptureFixture[str]):
    """SGLang sets page size 64 for DSA whatever --page-size says; the plan does and notes it."""
    p = plan_json(capsys, DSV32, "--budget", "40GiB", "--page-size", "16")
    assert p["page_size"] == 64
    assert any(n.startswith("page size 64") for n in p["notes"])


@pytest.mark.parametrize(("flags", "field"), [
    (("--page-size", "0"), "page_size"),
    (("--page-size", "-16"), "page_size"),
    (("--tp-size", "0"), "tp_size"),
    (("--tp-size", "100000"), "tp_size"),
    (("--pp-size", "0"), "pp_size"),
    (("--pp-size", "64"), "pp_size"),  # more stages than Llama's 32 layers
    (("--pp-size", "2", "--pp-rank", "2"), "pp_rank"),
    (("--pp-rank", "1"), "pp_rank"),
    (("--context-length", "0"), "context_length"),
    (("--context-length", str(10**12)), "context_length"),
    (("--max-total-tokens", "-5"), "max_total_tokens"),
    (("--max-total-tokens", "8", "--page-size", "16"), "max_total_tokens"),
    (("--max-running-requests", "0"), "max_running_requests"),
    (("--swa-full-tokens-ratio", "1.5"), "swa_full_tokens_ratio"),
    (("--swa-full-tokens-ratio", "0"), "swa_full_tokens_ratio"),
    (("--mamba-full-memory-ratio", "-1"), "mamba_full_memory_ratio"),
    (("--speculative-num-draft-layers", "2"), "speculative_num_draft_layers"),
])
def test_bad_option_names_its_field(capsys: pytest.CaptureFixture[str], flags: tuple[str, ...],
                                    field: str):
    """Named by its flag, never by its wire name (kvpool.tools.cli_words)."""
    err = expect_error(capsys, "--budget", "40GiB", *flags,
                       needles=("--" + field.replace("_", "-"),))
    assert len(err.strip().splitlines()) == 1
    assert field not in err


@pytest.mark.parametrize("size", ["-1", "-1GiB", "40G", "forty", "1e9", "1.5", "1.5B", "",
                                  "40 GiB extra", "2000TiB", "0x10", "4_000"])
def test_bad_budget_strings(capsys: pytest.CaptureFixture[str], size: str):
    expect_error(capsys, "--budget", size, needles=("budget",))


def test_no_budget_and_no_max_total_tokens(capsys: pytest.CaptureFixture[str]):
    expect_error(capsys, needles=("budget", "--max-total-tokens"))


@pytest.mark.parametrize(("flags", "needle"), [
    (("--kv-cache-dtype", "int8"), "--kv-cache-dtype"),
    (("--kv-cache-dtype", "fp16"), "fp4_e2m1"),  # accepted values are listed
    (("--speculative-algorithm", "medusa"), "--speculative-algorithm"),
    (("--page-size", "sixteen"), "--page-size"),
    (("--swa-full-tokens-ratio", "nan"), "--swa-full-tokens-ratio"),
    (("--mamba-full-memory-ratio", "inf"), "--mamba-full-memory-ratio"),
])
def test_argparse_rejections_exit_2(capsys: pytest.CaptureFixture[str], flags: tuple[str, ...],
                                    needle: str):
    expect_error(capsys, "--budget", "40GiB", *flags, needles=(needle,))


def test_missing_model_config_flag(capsys: pytest.CaptureFixture[str]):
    code, _, err = run_plan(capsys, "--budget", "40GiB")
    assert code == 2 and "--model-config" in err


def test_unknown_architecture_without_fields(capsys: pytest.CaptureFixture[str], tmp_path: Path):
    path = tmp_path / "config.json"
    path.write_text(json.dumps({"architectures": ["FooForCausalLM"], "num_hidden_layers": 2}))
    expect_error(capsys, "--budget", "40GiB", "--assume-architecture", "mha", model=path,
                 needles=("--model-config: ", "missing num_attention_heads"))


def test_malformed_known_config(capsys: pytest.CaptureFixture[str], tmp_path: Path):
    cfg = json.loads(DSV3.read_text())
    cfg["kv_lora_rank"] = "512"
    path = tmp_path / "config.json"
    path.write_text(json.dumps(cfg))
    expect_error(capsys, "--budget", "40GiB", model=path,
                 needles=("--model-config: ", "kv_lora_rank must be an integer"))


@pytest.mark.parametrize(("content", "needle"), [
    ("{oops", "not valid JSON"),
    ('"just a string"', "expected an object"),
])
def test_non_json_config(capsys: pytest.CaptureFixture[str], tmp_path: Path, content: str,
                         needle: str):
    path = tmp_path / "config.json"
    path.write_text(content)
    expect_error(capsys, "--budget", "40GiB", model=path, needles=(str(path), needle))


def test_missing_config_file(capsys: pytest.CaptureFixture[str], tmp_path: Path):
    path = tmp_path / "absent.json"
    expect_error(capsys, "--budget", "40GiB", model=path, needles=("--model-config: ", str(path)))


# ---- real subprocesses --------------------------------------------------------------------------


def test_subprocess_json():
    """The real command line: Llama-3.1-8B, 40 GiB, page 16 -> 327,680 tokens (see above)."""
    proc = run_subprocess("--model-config", str(LLAMA), "--budget", "40GiB", "--page-size",
                          "16", "--json")
    assert proc.returncode == 0, proc.stderr
    p = PoolPlan.from_json(proc.stdout)
    assert p.max_total_num_tokens == 327_680
    assert p.num_pages == 20_480


def test_subprocess_table():
    proc = run_subprocess("--model-config", str(GPT_OSS), "--budget", "40GiB", "--page-size",
                          "16")
    assert proc.returncode == 0, proc.stderr
    assert "hybrid_swa (from hf_config)" in proc.stdout
    assert "970,896" in proc.stdout


def test_subprocess_error_is_one_line_exit_2():
    proc = run_subprocess("--model-config", str(LLAMA), "--budget", "40GiB", "--page-size", "0")
    assert proc.returncode == 2
    assert proc.stdout == ""
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("kvpoold plan: error: --page-size: ")
    assert "--page-size" in lines[0]


# ---- parse_size / format_size -------------------------------------------------------------------


@pytest.mark.parametrize(("text", "expected"), [
    ("0", 0),
    ("42949672960", 42_949_672_960),
    ("40GiB", 42_949_672_960),
    ("40 GiB", 42_949_672_960),
    ("512MiB", 536_870_912),
    ("1.5GB", 1_500_000_000),
    ("1.5KiB", 1536),
    ("1.1GiB", 1_181_116_006),  # 1,181,116,006.4 rounded down
    ("2TB", 2 * 10**12),
    ("3KB", 3000),
    ("7B", 7),
    ("1024TiB", 2**50),  # exactly 1 PiB is allowed
    ("40gb", 40 * 10**9),  # units in any case: gb is GB, gib is GiB
    ("5 GiB", 5 << 30),
    ("40gib", 40 << 30),
])
def test_parse_size(text: str, expected: int):
    assert parse_size(text) == expected


@pytest.mark.parametrize("text", ["-1", "-0.5GiB", "abc", "1e9", "1.5", "0.5B", "40G", "40gibs",
                                  "1PiB", "1025TiB", "", " ", "1,000", "\uff11\uff12"])
def test_parse_size_rejects(text: str):
    with pytest.raises(InvalidArgument) as err:
        parse_size(text, field="budget")
    assert err.value.field == "budget"


def test_format_size():
    assert format_size(576) == "576 B"
    assert format_size(671_088_640) == "640.00 MiB"
    assert format_size(42_949_672_960) == "40.00 GiB"


def test_plan_and_configure_take_the_same_option_flags() -> None:
    """``kvpoold plan`` and ``kvpool configure`` build their option flags from PlanOptions:
    every field is a flag in both, with the same choices, and nothing else differs."""
    import argparse

    from kvpool.contract.option_flags import flag_of
    from kvpool.contract.options import KVCacheDType, PlanOptions
    from kvpool.tools import cli as client_cli
    from kvpoold import main as daemon_cli

    def option_actions(parser: argparse.ArgumentParser, command: str) -> dict[str, object]:
        sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
        return {a.option_strings[0]: a.choices for a in sub.choices[command]._actions
                if a.option_strings and a.option_strings[0] in flags}

    flags = {flag_of(f) for f in PlanOptions.__struct_fields__}
    plan = option_actions(daemon_cli.build_parser(), "plan")
    configure = option_actions(client_cli.build_parser(), "configure")
    assert set(plan) == set(configure) == flags
    assert plan == configure
    assert plan["--kv-cache-dtype"] == [d.value for d in KVCacheDType]


def test_plan_accepts_float32_kv(capsys: pytest.CaptureFixture[str]) -> None:
    """float32 doubles Llama's bf16 cell: 8 heads * (128 + 128) * 32 layers * 4 B = 262,144 B;
    1 GiB // 262,144 = 4,096 tokens (the padding page comes on top)."""
    out = plan_json(capsys, LLAMA, "--budget", "1GiB", "--kv-cache-dtype", "float32")
    assert out["kv_cache_dtype"] == "float32"
    assert out["cell_size_bytes"] == 262_144
    assert out["max_total_num_tokens"] == 4_096


def test_a_negative_size_reaches_the_flags_own_check(capsys: pytest.CaptureFixture[str]):
    code, _, err = run_plan(capsys, "--model-config", LLAMA, "--budget", "-5GiB")
    assert code == 2
    assert "argument --budget: budget: size '-5GiB' is negative" in err
    assert "expected one argument" not in err


def test_an_unknown_flag_shows_the_subcommands_usage(capsys: pytest.CaptureFixture[str]):
    code, _, err = run_plan(capsys, "--model-config", LLAMA, "--budget", "1GiB", "--bogus")
    assert code == 2
    assert err.startswith("usage: kvpoold plan ")
    assert "kvpoold plan: error: unrecognized arguments: --bogus" in err


def test_a_reader_that_stops_early_ends_the_output_quietly():
    """``kvpoold plan --json | head -c 1``: the reader is gone before the plan is printed."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "kvpoold.main", "plan", "--model-config", str(LLAMA), "--budget",
         "1GiB", "--json"], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        env={**os.environ, "PYTHONPATH": f"{ROOT / 'client'}{os.pathsep}{ROOT / 'service'}"})
    assert proc.stdout is not None and proc.stderr is not None
    proc.stdout.close()  # the reader goes away at once
    err = proc.stderr.read().decode()
    assert proc.wait(timeout=60) == 0, err
    assert "Traceback" not in err and "BrokenPipe" not in err


@pytest.mark.parametrize(("spec_file", "hf_config"), [
    ("llama-3.1-8b.toml", LLAMA), ("deepseek-v3.json", DSV3), ("gpt-oss-20b.toml", GPT_OSS)])
def test_the_example_specs_plan_like_their_hf_configs(spec_file: str, hf_config: Path):
    """The shipped example specs (examples/specs/) describe real models: each plans the same
    layout as the model's own config.json."""
    options = make_options(budget_bytes=BUDGET, page_size=16)
    spec, source = load_model(ROOT / "examples" / "specs" / spec_file)
    assert source == "spec"
    by_spec = plan(spec, options, source=source)
    by_hf = plan(*load_model(hf_config)[:1], options)
    assert by_spec.fingerprint() == by_hf.fingerprint()
    assert by_spec.max_total_num_tokens == by_hf.max_total_num_tokens


def test_a_pool_too_small_for_one_full_context_request_says_so(
        capsys: pytest.CaptureFixture[str]):
    code, out, _ = run_plan(capsys, "--model-config", LLAMA, "--max-total-tokens", "4096",
                            "--page-size", "16", "--json")
    assert code == 0
    decided, note = json.loads(out)["notes"]
    assert decided.startswith("family mha decided by architectures")
    assert note.startswith("the pool holds 4,096 tokens, less than one request at the context "
                           "length 131,072")
    assert "--context-length" in note
    code, out, _ = run_plan(capsys, "--model-config", LLAMA, "--max-total-tokens", "4096",
                            "--page-size", "16", "--context-length", "4096", "--json")
    assert code == 0 and json.loads(out)["notes"] == [decided]
