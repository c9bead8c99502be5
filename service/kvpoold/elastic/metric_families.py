"""The Prometheus families of elastic pools (``kvpool_elastic_*``), filled from each pool's
:class:`~kvpool.contract.records.ElasticStats` at every scrape by
:class:`kvpoold.metrics.DaemonCollector`; the table is in :mod:`kvpoold.metrics`."""

from __future__ import annotations

from typing import TYPE_CHECKING

from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    Metric,
    SummaryMetricFamily,
)

if TYPE_CHECKING:
    from kvpool.contract.records import ElasticStats

GROUPS_UNIT = "groups"  # the ``unit`` label of the elastic series that count groups


class ElasticFamilies:
    """The elastic pools' families of one scrape (docs/operations.md, "Elastic pools"): empty
    until :meth:`add` fills them from a pool's :class:`ElasticStats`."""

    def __init__(self) -> None:
        pools = ("device", "pool")
        groups = ("device", "pool", "unit")
        self.virtual_bytes = GaugeMetricFamily(
            "kvpool_elastic_virtual_bytes",
            "Bytes of the elastic pool's virtual range: every group of its views plus the fixed "
            "part (what it would take if granted whole).", labels=pools)
        self.granted_bytes = GaugeMetricFamily(
            "kvpool_elastic_granted_bytes",
            "Bytes the device budget pays for the elastic pool: its granted groups (reclaiming "
            "ones included) plus the fixed part.", labels=pools)
        self.backed_bytes = GaugeMetricFamily(
            "kvpool_elastic_backed_bytes",
            "Bytes of memory behind the elastic pool's region now, as the kernel counts them.",
            labels=pools)
        self.groups = GaugeMetricFamily(
            "kvpool_elastic_groups",
            "Groups of the elastic pool by state: granted (backed, reclaiming ones included), "
            "reclaiming (asked back, waiting for processes to unmap them), range (all groups "
            "of the virtual range).", labels=("device", "pool", "state", "unit"))
        self.floor_groups = GaugeMetricFamily(
            "kvpool_elastic_floor_groups",
            "Groups the elastic pool keeps whatever the pressure (its floor).", labels=groups)
        self.cap_groups = GaugeMetricFamily(
            "kvpool_elastic_cap_groups",
            "Groups the elastic pool is never granted beyond (its cap).", labels=groups)
        self.weight = GaugeMetricFamily(
            "kvpool_elastic_weight",
            "The elastic pool's weight: its share, against the other pools', of a budget too "
            "short for every pool's cap.", labels=pools)
        self.grants = CounterMetricFamily(
            "kvpool_elastic_grants", "Groups granted to the elastic pool since Configure.",
            labels=groups)
        self.reclaims = CounterMetricFamily(
            "kvpool_elastic_reclaims",
            "Groups taken back from the elastic pool since Configure.", labels=groups)
        self.reclaim_seconds = SummaryMetricFamily(
            "kvpool_elastic_reclaim_seconds",
            "Seconds from asking a group of the elastic pool back to its memory being free for "
            "the budget (count: the groups taken back).", labels=pools)
        self.reclaim_seconds_max = GaugeMetricFamily(
            "kvpool_elastic_reclaim_seconds_max",
            "The longest a group of the elastic pool took to come back since Configure.",
            labels=pools)
        self.revoked_leases = CounterMetricFamily(
            "kvpool_elastic_revoked_leases",
            "Leases ended because a process of theirs did not unmap reclaimed groups of the "
            "elastic pool by the deadline.", labels=pools)

    def add(self, device: str, pool: str, e: ElasticStats) -> None:
        """Add the series of elastic pool ``pool`` of ``device``."""
        labels = [device, pool]
        groups = [*labels, GROUPS_UNIT]
        self.virtual_bytes.add_metric(labels, e.virtual_bytes)
        self.granted_bytes.add_metric(labels, e.granted_bytes)
        self.backed_bytes.add_metric(labels, e.backed_bytes)
        for state, n in (("granted", e.granted_groups), ("reclaiming", e.reclaiming_groups),
                         ("failed", e.failed_groups), ("range", e.groups)):
            self.groups.add_metric([*labels, state, GROUPS_UNIT], n)
        self.floor_groups.add_metric(groups, e.floor_groups)
        self.cap_groups.add_metric(groups, e.cap_groups)
        self.weight.add_metric(labels, e.weight)
        self.grants.add_metric(groups, e.grants)
        self.reclaims.add_metric(groups, e.reclaims)
        self.reclaim_seconds.add_metric(labels, count_value=e.reclaims,
                                        sum_value=e.reclaim_seconds_sum)
        self.reclaim_seconds_max.add_metric(labels, e.reclaim_seconds_max)
        self.revoked_leases.add_metric(labels, e.revoked_leases)

    def families(self) -> tuple[Metric, ...]:
        """Every family, in the order docs/operations.md lists them."""
        return (self.virtual_bytes, self.granted_bytes, self.backed_bytes, self.groups,
                self.floor_groups, self.cap_groups, self.weight, self.grants, self.reclaims,
                self.reclaim_seconds, self.reclaim_seconds_max, self.revoked_leases)
