"""The ``kvpool_elastic_*`` families of /metrics: a hand-built snapshot with an elastic pool
(through the real codec, as ``Stats`` carries it) rendered by the real collector and parsed back
with prometheus_client's parser; a fixed pool gets none of them."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from kvpool.contract.codec import stats_from_pb, stats_to_pb
from kvpool.contract.records import Stats
from kvpoold.metrics import DaemonCollector
from tests.factories import MiB, elastic_stats, pool_stats, stats_of

ELASTIC_FAMILIES = {
    "kvpool_elastic_virtual_bytes": "gauge", "kvpool_elastic_granted_bytes": "gauge",
    "kvpool_elastic_backed_bytes": "gauge", "kvpool_elastic_groups": "gauge",
    "kvpool_elastic_floor_groups": "gauge", "kvpool_elastic_cap_groups": "gauge",
    "kvpool_elastic_weight": "gauge", "kvpool_elastic_grants": "counter",
    "kvpool_elastic_reclaims": "counter", "kvpool_elastic_reclaim_seconds": "summary",
    "kvpool_elastic_reclaim_seconds_max": "gauge", "kvpool_elastic_revoked_leases": "counter",
}


def scrape(stats: Stats) -> tuple[dict[str, str], dict[tuple[str, frozenset[tuple[str, str]]],
                                                         float]]:
    """``stats`` sent through the wire codec, then exposed by a DaemonCollector (device
    ``cuda:0``) and parsed: family types by name, sample values by (name, labels)."""
    wired = stats_from_pb(stats_to_pb(stats))
    assert wired == stats
    registry = CollectorRegistry(auto_describe=True)  # the duplicate-name check, too
    registry.register(DaemonCollector(lambda: wired, "cuda:0"))
    families = list(text_string_to_metric_families(generate_latest(registry).decode()))
    types = {f.name: f.type for f in families}
    values = {(s.name, frozenset(s.labels.items())): s.value for f in families for s in f.samples}
    return types, values


def test_an_elastic_pool_renders_every_family_with_its_values() -> None:
    """Pool ``chat`` (tests.factories.elastic_stats): 64 groups of 128 MiB + 2 MiB fixed is
    8,592,031,744 B virtual; 12 granted = 1,610,612,736 B + 2 MiB = 1,612,709,888 B paid for,
    1,610,612,736 B backed; 2 reclaiming; 8 groups taken back in 0.6 s (count 8), 0.2 s the
    longest. The group counts carry unit="groups"; bytes, weight and seconds carry none."""
    types, v = scrape(stats_of(pool_stats("chat", elastic=elastic_stats())))
    assert {n: types[n] for n in ELASTIC_FAMILIES} == ELASTIC_FAMILIES
    pool = {("device", "cuda:0"), ("pool", "chat")}
    groups = pool | {("unit", "groups")}

    def get(name: str, labels: set[tuple[str, str]]) -> float:
        return v[(name, frozenset(labels))]

    assert get("kvpool_elastic_virtual_bytes", pool) == 64 * 128 * MiB + 2 * MiB \
        == 8_592_031_744
    assert get("kvpool_elastic_granted_bytes", pool) == 1_612_709_888
    assert get("kvpool_elastic_backed_bytes", pool) == 1_610_612_736
    assert {state: get("kvpool_elastic_groups", groups | {("state", state)})
            for state in ("granted", "reclaiming", "failed", "range")} == {
        "granted": 12, "reclaiming": 2, "failed": 0, "range": 64}
    assert get("kvpool_elastic_floor_groups", groups) == 4
    assert get("kvpool_elastic_cap_groups", groups) == 64
    assert get("kvpool_elastic_weight", pool) == 2.0
    assert get("kvpool_elastic_grants_total", groups) == 20
    assert get("kvpool_elastic_reclaims_total", groups) == 8
    assert get("kvpool_elastic_reclaim_seconds_count", pool) == 8
    assert get("kvpool_elastic_reclaim_seconds_sum", pool) == 0.6
    assert get("kvpool_elastic_reclaim_seconds_max", pool) == 0.2
    assert get("kvpool_elastic_revoked_leases_total", pool) == 1
    elastic = {key for key in v if key[0].startswith("kvpool_elastic_")}
    assert len(elastic) == 16  # 10 one-series families, groups x 4 states, summary sum + count
    assert all(dict(labels)["pool"] == "chat" for _, labels in elastic)


def test_a_fixed_pool_has_no_elastic_series_and_its_others_are_unchanged() -> None:
    """A daemon with a fixed pool and an elastic one: the elastic series name only the elastic
    pool; the fixed pool's per-pool and per-space series are what they are without the elastic
    pool next to it. A daemon with only fixed pools still declares the families (HELP and
    TYPE, so dashboards and the docs table see them) with no samples."""
    fixed = pool_stats("fixed")
    _, both = scrape(stats_of(fixed, pool_stats("chat", elastic=elastic_stats())))
    elastic_pools = {dict(labels)["pool"] for name, labels in both
                     if name.startswith("kvpool_elastic_")}
    assert elastic_pools == {"chat"}
    types_alone, alone = scrape(stats_of(fixed))
    fixed_series = {k: x for k, x in both.items() if ("pool", "fixed") in k[1]}
    assert fixed_series == {k: x for k, x in alone.items() if ("pool", "fixed") in k[1]}
    assert fixed_series, "the fixed pool has its usual series"
    assert {n: types_alone[n] for n in ELASTIC_FAMILIES} == ELASTIC_FAMILIES
    assert not any(name.startswith("kvpool_elastic_") for name, _ in alone)


def test_two_elastic_pools_are_kept_apart() -> None:
    """Each elastic pool has its own series: what one was granted is not added to the
    other's."""
    _, v = scrape(stats_of(pool_stats("a", elastic=elastic_stats()),
                           pool_stats("b", elastic=elastic_stats(granted_groups=4,
                                                                 reclaiming_groups=0))))
    granted = {dict(labels)["pool"]: x for (name, labels), x in v.items()
               if name == "kvpool_elastic_groups" and ("state", "granted") in labels}
    assert granted == {"a": 12, "b": 4}
