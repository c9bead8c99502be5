"""``kvpool stats`` text and ``--json`` of hand-built snapshots (through the real codec) by the
real printer: an elastic pool gets two lines on its groups, bytes and counters, and its
``elastic`` object in the JSON; a fixed pool prints as it always did."""

from __future__ import annotations

import json

import pytest

from kvpool.contract.codec import stats_from_pb, stats_to_pb
from kvpool.contract.records import Stats
from kvpool.tools.cli import print_stats, stats_lines
from tests.factories import elastic_stats, pool_stats, stats_of

FIXED_LINES = [
    "pool fixed: mha bf16 page 16, 1.00 MiB, attached 1, sharing shm, fingerprint f00d",
    "  kv         used         20 / 256        (  7.8%)  high 20  allocs 25  frees 5  failed 0",
    "  req        used          1 / 8          ( 12.5%)  high 1  allocs 1  frees 0  failed 0",
]


def wired(stats: Stats) -> Stats:
    out = stats_from_pb(stats_to_pb(stats))
    assert out == stats
    return out


def test_an_elastic_pool_prints_its_groups_bytes_and_counters() -> None:
    """tests.factories.elastic_stats: 12 of 64 groups of 128 MiB, 2 reclaiming; 1.50 GiB + 2 MiB
    paid of 8.00 GiB + 2 MiB (format_size: 1.50 and 8.00 GiB); 8 reclaims in 0.6 s, a mean of
    0.075 s, 0.2 s the longest. The lines come after the pool's own, before its spaces."""
    lines = stats_lines(wired(stats_of(pool_stats("chat", elastic=elastic_stats()))))
    assert lines[1].startswith("pool chat: ")
    assert lines[2:4] == [
        "  elastic    granted 12 / 64 groups of 128.00 MiB (2 reclaiming), floor 4, cap 64, "
        "weight 2",
        "             granted 1.50 GiB of 8.00 GiB virtual, backed 1.50 GiB; grants 20, "
        "reclaims 8 (mean 0.075 s, max 0.200 s), revoked leases 1",
    ]
    assert lines[4].startswith("  kv ") and lines[5].startswith("  req ")


def test_no_reclaim_yet_has_no_mean() -> None:
    lines = stats_lines(stats_of(pool_stats("chat", elastic=elastic_stats(
        reclaims=0, reclaim_seconds_sum=0.0, reclaim_seconds_max=0.0))))
    assert "reclaims 0 (mean -, max 0.000 s)" in lines[3]


def test_a_fixed_pool_prints_as_before() -> None:
    """Its three lines, the same alone or next to an elastic pool."""
    assert stats_lines(wired(stats_of(pool_stats("fixed"))))[1:] == FIXED_LINES
    both = stats_lines(wired(stats_of(pool_stats("fixed"),
                                      pool_stats("chat", elastic=elastic_stats()))))
    assert both[1:4] == FIXED_LINES and both[4].startswith("pool chat: ")


def test_json_carries_the_elastic_object(capsys: pytest.CaptureFixture[str]) -> None:
    """``kvpool stats --json``: each pool as the record, with ``elastic`` every ElasticStats
    field for an elastic pool and ``null`` for a fixed one."""
    e = elastic_stats()
    print_stats(wired(stats_of(pool_stats("fixed"), pool_stats("chat", elastic=e))),
                as_json=True)
    data = json.loads(capsys.readouterr().out)
    pools = {p["name"]: p for p in data["pools"]}
    assert pools["fixed"]["elastic"] is None
    assert pools["chat"]["elastic"] == {f: getattr(e, f) for f in e.__struct_fields__}
    assert pools["chat"]["elastic"]["granted_groups"] == 12
    assert data["leases"][0]["lease_id"] == "7"  # ids as strings, as before


def test_text_ends_with_the_leases(capsys: pytest.CaptureFixture[str]) -> None:
    print_stats(stats_of(pool_stats("chat", elastic=elastic_stats())))
    out = capsys.readouterr().out.splitlines()
    assert out[2].startswith("  elastic ")
    assert out[-2].startswith("LEASE") and out[-1].split()[:2] == ["7", "engine"]
