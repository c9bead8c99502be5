"""Builders: one backing region per pool, named typed views that never overlap."""

from __future__ import annotations

import itertools

import pytest
import torch

from kvpool.contract.errors import InvalidArgument
from kvpool.contract.plan import BufferFill
from kvpoold.pools import FILLS, build_pool, carve
from tests.factories import MiB, deepseek_v3, deepseek_v32, llama_8b, plan_for

CASES = {
    "mha": (llama_8b, {"page_size": 16}),
    "mha-fp8": (llama_8b, {"kv_cache_dtype": "fp8_e4m3"}),
    "mha-fp4": (llama_8b, {"kv_cache_dtype": "fp4_e2m1"}),
    "mla": (deepseek_v3, {"speculative_algorithm": "eagle"}),
    "dsa": (deepseek_v32, {"page_size": 64}),
}


def small(make, **opts):
    return plan_for(make(context_length=2048), budget_bytes=96 * MiB, **opts)


@pytest.mark.parametrize("case", sorted(CASES))
def test_views_are_disjoint_and_inside_the_backing(case):
    make, opts = CASES[case]
    plan = small(make, **opts)
    pool = build_pool(plan, "cpu")
    assert pool.backing.numel() == plan.backing_bytes
    base = pool.backing.data_ptr()
    spans = []
    for spec in plan.buffers:
        view = pool.views[spec.name]
        assert tuple(view.shape) == spec.shape
        assert str(view.dtype).removeprefix("torch.") == spec.dtype.value
        start = view.data_ptr() - base
        assert start == spec.offset_bytes
        assert view.numel() * view.element_size() == spec.nbytes
        spans.append((start, start + spec.nbytes, spec.name))
    spans.sort()
    for (_, end, name), (start, _, nxt) in itertools.pairwise(spans):
        assert end <= start, f"{name} overlaps {nxt}"
    assert spans[-1][1] <= plan.backing_bytes


def test_views_alias_the_backing():
    """A write through a view lands in the backing at the buffer's offset (no copies)."""
    plan = small(llama_8b, page_size=16)
    pool = build_pool(plan)
    k1 = pool.views["k.1"]
    k1[16:32] = 1.5  # page 1
    spec = plan.buffer("k.1")
    row = spec.nbytes // spec.shape[0]
    raw = pool.backing[spec.offset_bytes + 16 * row : spec.offset_bytes + 32 * row]
    assert torch.equal(raw.view(torch.bfloat16), torch.full((16 * row // 2,), 1.5,
                                                            dtype=torch.bfloat16))
    assert pool.views["v.1"].abs().sum() == 0


def test_backing_comes_from_the_allocate_function():
    plan = small(llama_8b)
    seen = []

    def allocate(nbytes, device):
        seen.append((nbytes, device))
        return torch.zeros(nbytes, dtype=torch.uint8)

    build_pool(plan, "cpu", allocate)
    assert seen == [(plan.backing_bytes, torch.device("cpu"))]


def test_carve_refuses_a_short_backing():
    plan = small(llama_8b)
    with pytest.raises(InvalidArgument, match="needs"):
        carve(plan, torch.zeros(plan.backing_bytes - 1, dtype=torch.uint8))


def test_every_fill_a_plan_may_name_has_a_writer():
    """The builder knows no architecture: every BufferFill has one writer, and the only
    buffers a plan does not leave zeroed are the DSV4 compress states (their score half)."""
    assert set(FILLS) == set(BufferFill)
    for make, opts in CASES.values():
        assert all(b.fill == BufferFill.zeros for b in small(make, **opts).buffers)
