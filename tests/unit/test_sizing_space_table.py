"""The plan's table of allocatable id spaces (kvpoold.sizing.space_table), per architecture.

Numbers worked out by hand:

- Llama-3.1-8B, bf16, page 16: a kv page is 32 layers x (K + V) x 8 heads x 128 x 2 B x 16
  tokens = 2,097,152 B; a req row is ``req_to_token_columns`` int32 = 4 x (context + 4).
- gpt-oss-20b, page 16: kv (full) and swa pages each carry the 12 layers of their kind, 12 x 2
  x 8 x 64 x 2 B x 16 = 393,216 B; the kv page also carries its int64 ``full_to_swa`` entry
  (+8 B); swa follows kv through that buffer.
- all-SWA gpt-oss: one token space, allocated as kv, 24 layers = 786,432 B per page.
- DeepSeek-V4 (the test_sizing_dsv4 spec, page 256, 40 GiB): c4_state has S x P / W = 2,462 x
  256 / 128 = 4,924 ring slots of 8 rows, c128_state one per request slot (257).
"""

from __future__ import annotations

import pytest

from kvpool.contract.errors import InvalidArgument
from kvpool.contract.plan import FULL_TO_SWA, PoolPlan
from tests.factories import GiB, llama_8b, plan_for
from tests.unit.test_sizing_dsv4 import BUDGET, v4_spec
from tests.unit.test_sizing_hybrid_swa import all_swa_spec, gpt_oss


def spaces(p: PoolPlan) -> dict[str, tuple[int, int, str | None]]:
    return {s.name: (s.capacity, s.bytes_per_unit, s.follows) for s in p.id_spaces}


def test_mha_pool_has_kv_pages_and_request_rows() -> None:
    p = plan_for(llama_8b(), budget_bytes=2 * GiB, page_size=16)
    assert spaces(p) == {
        "kv": (p.num_pages, 2_097_152, None),
        "req": (p.max_running_requests, 4 * p.req_to_token_columns, None),
    }
    assert p.req_to_token_columns == 131_072 + 4
    assert [s.unit for s in p.id_spaces] == ["pages", "rows"]


def test_hybrid_swa_pool_pairs_swa_pages_with_kv_pages() -> None:
    p = plan_for(gpt_oss(), budget_bytes=4 * GiB, page_size=16)
    assert p.swa_num_pages is not None
    assert spaces(p) == {
        "kv": (p.num_pages, 393_216 + 8, None),
        "swa": (p.swa_num_pages, 393_216, "kv"),
        "req": (p.max_running_requests, 4 * p.req_to_token_columns, None),
    }
    assert p.id_space("swa").mapping == FULL_TO_SWA
    assert p.buffer(FULL_TO_SWA).id_space == "kv"


def test_all_swa_pool_has_one_token_space_allocated_as_kv() -> None:
    p = plan_for(all_swa_spec(), budget_bytes=4 * GiB, page_size=16)
    assert p.architecture == "all_swa"
    assert spaces(p) == {
        "kv": (p.num_pages, 786_432, None),
        "req": (p.max_running_requests, 4 * p.req_to_token_columns, None),
    }
    assert all(b.id_space == "kv" for b in p.buffers if b.name != "req_to_token")


def test_hybrid_linear_pool_has_state_slots() -> None:
    from kvpoold.hf import load_model
    from tests.conftest import REPO

    spec, _ = load_model(REPO / "tests" / "data" / "models" / "qwen3-next-80b-a3b-instruct.json")
    p = plan_for(spec, budget_bytes=8 * GiB, page_size=16)
    assert p.mamba_cache_size
    state = p.id_space("state")
    assert (state.capacity, state.unit, state.follows) == (p.mamba_cache_size, "slots", None)
    # one state slot is one row of every conv and ssm buffer
    assert state.bytes_per_unit == sum(b.page_bytes for b in p.buffers if b.kind == "state")


def test_dsv4_compress_state_rings_are_allocatable() -> None:
    p = plan_for(v4_spec(), budget_bytes=BUDGET, page_size=256, max_running_requests=256,
                 swa_full_tokens_ratio=0.8)
    assert p.swa_num_pages == 2_916
    c4, c128 = p.id_space("c4_state"), p.id_space("c128_state")
    assert c4.capacity == 2_916  # one ring (8 rows) per SWA page
    assert p.c4_state_pool_size == c4.capacity * 8
    assert p.c128_state_pool_size is not None and c128.capacity == p.c128_state_pool_size // 128
    # every ring slot, sentinel block 0 excluded, lies inside its buffers
    for b in p.buffers:
        if b.id_space in ("c4_state", "c128_state"):
            ring = 8 if b.id_space == "c4_state" else 128
            assert (p.id_space(b.id_space).capacity + 1) * ring <= b.shape[0]
    assert c4.bytes_per_unit == sum(b.page_bytes for b in p.buffers if b.id_space == "c4_state")
    assert [s.name for s in p.id_spaces] == ["kv", "swa", "req", "c4_state", "c128_state"]


@pytest.mark.parametrize("budget", [1 * GiB, 8 * GiB])
def test_fingerprint_covers_the_id_spaces(budget: int) -> None:
    p = plan_for(llama_8b(), budget_bytes=budget, page_size=16)
    import msgspec

    other = msgspec.structs.replace(p, id_spaces=p.id_spaces[:1])
    assert other.fingerprint() != p.fingerprint()
    assert PoolPlan.from_json(p.to_json()) == p


def test_hybrid_swa_pool_paired_by_the_engine_has_two_spaces_of_their_own() -> None:
    """``swa_pairing="engine"`` (SGLang's SWA allocator): the same kv and swa pages, neither
    following the other; ``full_to_swa`` is one int64 per full token slot plus a trailing
    entry ((num_pages + 1) * 16 + 1), addressed by no space, so a kv page carries no 8 B."""
    p = plan_for(gpt_oss(), budget_bytes=4 * GiB, page_size=16, swa_pairing="engine")
    daemon = plan_for(gpt_oss(), budget_bytes=4 * GiB, page_size=16)
    assert p.swa_num_pages == daemon.swa_num_pages and p.num_pages == daemon.num_pages
    assert spaces(p) == {
        "kv": (p.num_pages, 393_216, None),
        "swa": (p.swa_num_pages, 393_216, None),
        "req": (p.max_running_requests, 4 * p.req_to_token_columns, None),
    }
    assert p.id_space("swa").mapping is None
    mapping = p.buffer(FULL_TO_SWA)
    assert mapping.id_space == ""
    assert mapping.shape == ((p.num_pages + 1) * 16 + 1,)
    assert p.aux_bytes - daemon.aux_bytes == 8 * ((p.num_pages + 1) * 16 + 1 - (p.num_pages + 1))


def test_engine_pairing_is_refused_for_deepseek_v4() -> None:
    with pytest.raises(InvalidArgument, match="DeepSeek-V4 pools pair") as err:
        plan_for(v4_spec(), budget_bytes=BUDGET, page_size=256, swa_pairing="engine")
    assert err.value.field == "swa_pairing"
