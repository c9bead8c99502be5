"""The multimodal reservation SGLang 0.5.23 takes off the KV budget, and its step at 400 running
requests (``kvpoold.sizing.multimodal``), computed by hand on real corpus configs."""

from __future__ import annotations

import pytest

from kvpool.contract.devices import gpu_profile
from kvpool.contract.errors import InvalidArgument
from kvpool.contract.spec import ModelSpec
from kvpoold.hf import load_model_config
from kvpoold.sizing import make_options, plan
from kvpoold.sizing.multimodal import reservation
from tests.conftest import REPO

GiB = 1 << 30
MiB = 1 << 20
CORPUS = REPO / "tests" / "data" / "models" / "corpus"
# Qwen3-VL-8B's text model: 36 layers x 8 KV heads x 128 x (K, V) x 2 B (bfloat16).
QWEN3_VL_8B_CELL = 36 * 8 * 128 * 2 * 2


def spec(name: str) -> ModelSpec:
    return load_model_config(CORPUS / f"{name}.json")[0]


def tokens(budget: int, reserved: int, cell: int, page: int = 16) -> int:
    return (budget - reserved) // cell // page * page


@pytest.mark.parametrize(("gpu", "running", "reserved"), [
    ("h100-80g", None, 1 * GiB),   # unset: SGLang's override sees no count (it derives 2,048
    ("h100-80g", 399, 1 * GiB),    # later, and still reserves 1 GiB)
    ("h100-80g", 400, 3 * GiB),    # the step: the pool holds a full high-concurrency wave
    ("h100-80g", 1024, 3 * GiB),   # and no more beyond it
    ("h200", 400, 3 * GiB),
    ("a100-80g", 400, 100 * MiB),  # off SGLang's Hopper path: the fixed embedding cache
    ("b200", 1024, 100 * MiB),
    ("cpu", 400, 100 * MiB),
])
def test_qwen3_vl_reserves_by_gpu_and_running_requests(gpu: str, running: int | None,
                                                       reserved: int) -> None:
    """20 GiB, page 16: tokens = (20 GiB - reserved) // 147,456 at the page; 138,352 with 1 GiB,
    123,776 with 3 GiB, 144,912 with 100 MiB (SGLang 0.5.23 sizes the same: the corpus test)."""
    p = plan(spec("qwen3-vl-8b-instruct"), make_options(
        budget_bytes=20 * GiB, page_size=16, gpu=gpu, max_running_requests=running))
    assert p.cell_size_bytes == QWEN3_VL_8B_CELL
    assert p.max_total_num_tokens == tokens(20 * GiB, reserved, QWEN3_VL_8B_CELL)
    assert p.max_total_num_tokens in (138_352, 123_776, 144_912)
    assert p.budget_bytes == 20 * GiB  # the plan echoes the budget asked, the note the cut
    assert any(n.startswith(f"{reserved:,} B of the budget reserved") for n in p.notes)


def test_the_notes_say_how_the_reservation_scales() -> None:
    vl = spec("qwen3-vl-30b-a3b-instruct")  # the MoE class takes the same path
    low = plan(vl, make_options(budget_bytes=20 * GiB, page_size=16))
    high = plan(vl, make_options(budget_bytes=20 * GiB, page_size=16, max_running_requests=512))
    ampere = plan(vl, make_options(budget_bytes=20 * GiB, page_size=16, gpu="a100-80g",
                                   max_running_requests=512))
    (low_note,) = [n for n in low.notes if "reserved for" in n]
    (high_note,) = [n for n in high.notes if "reserved for" in n]
    (ampere_note,) = [n for n in ampere.notes if "reserved for" in n]
    assert "3 GiB from --max-running-requests 400, here unset" in low_note
    assert "raised from 1 GiB to 3 GiB because --max-running-requests 512" in high_note
    assert "fixed, whatever --max-running-requests" in ampere_note


@pytest.mark.parametrize(("name", "reserved"), [
    ("llava-1.5-7b-hf", 100 * MiB),
    ("ministral-3-3b-instruct-2512", 100 * MiB),
    ("gemma-4-26b-a4b", 100 * MiB),
    ("kimi-k2.5", 100 * MiB),
    ("llama-4-scout-17b-16e-instruct", None),  # SGLang serves it as text by default
])
def test_other_wrappers_do_not_scale_with_running_requests(name: str,
                                                           reserved: int | None) -> None:
    """Only Qwen3-VL's Hopper override reads --max-running-requests; every other wrapper keeps
    SGLANG_VLM_CACHE_SIZE_MB (100 MiB) at any count, on any GPU."""
    s = spec(name)
    for gpu in ("h100-80g", "a100-80g"):
        got = {reservation(s, gpu_profile(gpu), n) for n in (None, 64, 400, 4096)}
        assert {r.nbytes if r else None for r in got} == {reserved}


def test_the_step_is_at_400() -> None:
    s, hopper = spec("qwen3-vl-8b-instruct"), gpu_profile("h100-80g")
    assert [r.nbytes for n in (1, 399, 400, 401, 100_000)
            if (r := reservation(s, hopper, n))] == [GiB, GiB, 3 * GiB, 3 * GiB, 3 * GiB]


def test_a_budget_under_the_raised_reservation_is_refused() -> None:
    """2 GiB at 400 requests: 3 GiB reserved leaves nothing; SGLang refuses too ("Loaded
    weights leave no GPU memory for the KV cache"), while 399 requests leave 1 GiB."""
    vl = spec("qwen3-vl-8b-instruct")
    with pytest.raises(InvalidArgument, match="leaves nothing for the KV cache after the "
                       "3,221,225,472 B reserved") as err:
        plan(vl, make_options(budget_bytes=2 * GiB, page_size=16, max_running_requests=400))
    assert err.value.field == "budget_bytes"
    ok = plan(vl, make_options(budget_bytes=2 * GiB, page_size=16, max_running_requests=399))
    assert ok.max_total_num_tokens == tokens(2 * GiB, GiB, QWEN3_VL_8B_CELL)
