"""Prometheus metrics of one daemon: gauges read from a Stats snapshot at scrape time, RPC
counters and latency histograms recorded by the servicer's error decorator.

Nothing here keeps its own copy of the daemon's state: :class:`DaemonCollector` takes the same
snapshot ``Stats`` returns each time ``/metrics`` is scraped, so the two never disagree. Only
what no snapshot holds, RPC latency and failures by status code, is counted as it happens
(:class:`RpcMetrics`: one histogram observation and, on failure, one counter increment per call).

Every daemon gets its own :class:`prometheus_client.CollectorRegistry` (not the process-global
one), so several daemons can run in one process (tests) without clashing.

Exported (labels in braces; ``space`` is a pool's id space: ``kv``, ``swa``, ``req``, ``state``,
``c4_state``, ``c128_state``, as its plan declares; ``unit`` is what one id of that space is,
``SpaceStats.unit``: ``pages``, ``rows``, ``slots``)::

    kvpool_pool_capacity{device,pool,space,unit}       gauge      ids the pool can hand out
    kvpool_pool_used{device,pool,space,unit}           gauge      ids held by leases
    kvpool_pool_free{device,pool,space,unit}           gauge      capacity - used
    kvpool_pool_high_water{device,pool,space,unit}     gauge      most ids used at once
    kvpool_pool_pinned{device,pool,space,unit}         gauge      ids a transfer is moving
    kvpool_pool_quarantined{device,pool,space,unit}    gauge      ids whose lease ended mid-transfer
    kvpool_pool_bytes{device,pool}                    gauge      backing region bytes
    kvpool_attached_clients{device,pool}              gauge      Attach without Detach
    kvpool_allocated_ids_total{device,pool,space,unit} counter   ids handed out
    kvpool_freed_ids_total{device,pool,space,unit}    counter    ids returned (reclaim included)
    kvpool_allocation_refusals_total{device,pool,space} counter  Allocate calls refused: no room
    kvpool_device_budget_bytes{device}                gauge      the daemon's --budget
    kvpool_device_used_bytes{device}                  gauge      backing bytes of all pools
    kvpool_leases_open{device}                        gauge      open leases
    kvpool_lease_expiries_total{device}               counter    leases expired and reclaimed
    kvpool_lease_cached_ids{device,pool,space,unit}   gauge      cached in page caches (reports)
    kvpool_rpc_failures_total{device,method,code}     counter    RPCs ended with an error status
    kvpool_rpc_duration_seconds{device,method}        histogram  server time of unary RPCs
    kvpool_build_info{device,version,contract,python,torch,nixl} gauge  1: what this daemon runs

Elastic pools only (``PoolStats.elastic``, :mod:`kvpoold.elastic.metric_families`; a fixed pool
has none of these series)::

    kvpool_elastic_virtual_bytes{device,pool}         gauge      the views' whole virtual range
    kvpool_elastic_granted_bytes{device,pool}         gauge      granted groups + fixed part
    kvpool_elastic_backed_bytes{device,pool}          gauge      memory the kernel counts behind it
    kvpool_elastic_groups{device,pool,state,unit}     gauge      granted, reclaiming, failed, range
    kvpool_elastic_floor_groups{device,pool,unit}     gauge      groups the pool always keeps
    kvpool_elastic_cap_groups{device,pool,unit}       gauge      groups it is never granted past
    kvpool_elastic_weight{device,pool}                gauge      its share of a short budget
    kvpool_elastic_grants_total{device,pool,unit}     counter    groups granted
    kvpool_elastic_reclaims_total{device,pool,unit}   counter    groups taken back
    kvpool_elastic_reclaim_seconds{device,pool}       summary    asking a group back -> it is free
    kvpool_elastic_reclaim_seconds_max{device,pool}   gauge      the longest of those
    kvpool_elastic_revoked_leases_total{device,pool}  counter    leases ended for not unmapping

Pools with a sealed-page directory only (``PoolStats.sealed``, docs/restart.md; from the first
Seal on)::

    kvpool_sealed_pages{device,pool,holder}           gauge      sealed pages, by holder
    kvpool_sealed_kept_bytes{device,pool}             gauge      bytes of the directory's kept pages
    kvpool_pages_sealed_total{device,pool}            counter    pages sealed
    kvpool_adopted_pages_total{device,pool}           counter    pages adopted by a later engine
    kvpool_sealed_evicted_pages_total{device,pool}    counter    kept pages given back
    kvpool_sealed_corrupt_pages_total{device,pool}    counter    pages whose bytes changed (dropped)
    kvpool_sealed_epoch{device,pool}                  gauge      adoptions that took pages

A daemon publishing KV events only (``--kv-events-config``, docs/kv-events.md)::

    kvpool_kv_events_batches_total{device}            counter    batches handed to the publisher
    kvpool_kv_events_dropped_total{device}            counter    batches dropped: a full queue

The id-counting series carry ``unit`` as a label rather than in their names: the spaces are the
plan's table (one family per quantity whatever the architecture), ``unit`` follows from
``space`` so it adds no series, and ``sum by (unit) (kvpool_pool_used)`` adds only like ids.
The elastic series that count groups carry ``unit="groups"`` for the same reason: a
dashboard's ``sum by (unit)`` over pools and spaces never adds groups to pages.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import functools
import importlib.metadata
import inspect
import logging
import platform
import socket
import threading
from collections.abc import Awaitable, Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Histogram,
    disable_created_metrics,
    make_wsgi_app,
)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.exposition import ThreadingWSGIServer
from prometheus_client.registry import Collector

from kvpool import WIRE_CONTRACT, __version__
from kvpool.contract.errors import FailedPrecondition, Internal
from kvpoold.elastic.metric_families import ElasticFamilies

if TYPE_CHECKING:
    from kvpool.contract.records import SealedStats, Stats

log = logging.getLogger("kvpoold.metrics")

# Allocate/Free take ~100 us on a Unix socket; Configure of a large pool can take a second.
RPC_BUCKETS_S: tuple[float, ...] = (
    0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0,
)
# A scrape waits this long for the event loop to take the snapshot before it fails.
SNAPSHOT_TIMEOUT_S = 5.0


BUILD_LABELS = ("version", "contract", "python", "torch", "nixl")
# The NIXL wheels are published per CUDA major; the first one installed names the version.
NIXL_DISTRIBUTIONS = ("nixl", "nixl-cu12", "nixl-cu13")


@functools.cache
def build_info() -> dict[str, str]:
    """The ``kvpool_build_info`` labels (:data:`BUILD_LABELS`, in that order) of this process.

    ``torch`` and ``nixl`` are read from the installed distributions' metadata, without
    importing them; ``"none"`` for one that is not installed. Read once per process.
    """
    def installed(*names: str) -> str:
        for name in names:
            try:
                return importlib.metadata.version(name)
            except importlib.metadata.PackageNotFoundError:
                continue
        return "none"

    return {"version": __version__, "contract": WIRE_CONTRACT,
            "python": platform.python_version(), "torch": installed("torch"),
            "nixl": installed(*NIXL_DISTRIBUTIONS)}


class RpcMetrics:
    """RPC latency and failures of one daemon (what :func:`kvpoold.server.status.rpc_errors`
    records for every call).

    Args:
        registry: where the histogram and counter are registered.
        device: the ``device`` label of every series.
    """

    def __init__(self, registry: CollectorRegistry, device: str) -> None:
        self.device = device
        self._duration = Histogram(
            "kvpool_rpc_duration_seconds",
            "Server-side time of unary kvpool RPCs, from the servicer's entry to its reply.",
            ("device", "method"), registry=registry, buckets=RPC_BUCKETS_S,
        )
        self._failures = Counter(
            "kvpool_rpc_failures",
            "kvpool RPCs that ended with an error status, by method and gRPC status code.",
            ("device", "method", "code"), registry=registry,
        )
        # labels() builds a key and takes the metric's lock; the children are cached per method
        # so a call costs one dict lookup and one observe.
        self._timers: dict[str, Histogram] = {}

    def observe(self, method: str, seconds: float) -> None:
        """Record one unary call of ``method`` that took ``seconds``."""
        timer = self._timers.get(method)
        if timer is None:
            timer = self._timers[method] = self._duration.labels(self.device, method)
        timer.observe(seconds)

    def failed(self, method: str, code: str) -> None:
        """Count one call of ``method`` that ended with status ``code`` (``NOT_FOUND``)."""
        self._failures.labels(self.device, method, code).inc()


class DaemonCollector(Collector):
    """Pool, budget and lease metrics built from a fresh snapshot at every scrape.

    Args:
        snapshot: returns the daemon's state now (``Daemon.snapshot``, taken on its loop).
        device: the ``device`` label (the daemon's ``--device``).
    """

    def __init__(self, snapshot: Callable[[], Stats], device: str) -> None:
        self._snapshot = snapshot
        self._device = device

    def describe(self) -> Iterator[Metric]:
        # The names, for the registry's duplicate check, without taking a snapshot.
        yield from self._families()
        yield from ElasticFamilies().families()
        yield from SealedFamilies().families()

    def collect(self) -> Iterator[Metric]:
        snap = self._snapshot()
        fams = self._families()
        (capacity, used, free, high_water, pool_bytes, attached, allocs, frees, failures,
         budget, dev_used, leases_open, expiries, lease_cached, transfers, transfer_bytes,
         transfer_failures, stalls, stalled, longest_stall, pinned, quarantined, build,
         fenced_pages, kv_batches, kv_dropped) = fams
        dev = self._device
        build.add_metric([dev, *build_info().values()], 1)
        cached: dict[tuple[str, str], int] = {}
        for lease in snap.leases:
            for pool_name, spaces in lease.cached.items():
                for space, n in spaces.items():
                    cached[(pool_name, space)] = cached.get((pool_name, space), 0) + n
        elastic = ElasticFamilies()
        sealed = SealedFamilies()
        for pool in snap.pools:
            if pool.elastic is not None:
                elastic.add(dev, pool.name, pool.elastic)
            if pool.sealed is not None:
                sealed.add(dev, pool.name, pool.sealed)
            pool_bytes.add_metric([dev, pool.name], pool.backing_bytes)
            attached.add_metric([dev, pool.name], pool.attached)
            for space, k in pool.spaces.items():
                labels = [dev, pool.name, space, k.unit]
                capacity.add_metric(labels, k.capacity)
                used.add_metric(labels, k.used)
                free.add_metric(labels, k.free)
                high_water.add_metric(labels, k.high_water)
                pinned.add_metric(labels, k.pinned)
                quarantined.add_metric(labels, k.quarantined)
                allocs.add_metric(labels, k.allocs)
                frees.add_metric(labels, k.frees)
                failures.add_metric(labels[:3], k.failed_allocs)
                lease_cached.add_metric(labels, cached.get((pool.name, space), 0))
        d = snap.daemon
        budget.add_metric([dev], d.budget_bytes)
        dev_used.add_metric([dev], d.used_bytes)
        leases_open.add_metric([dev], d.num_leases)
        expiries.add_metric([dev], d.leases_expired)
        stalls.add_metric([dev], d.loop_stalls)
        stalled.add_metric([dev], d.loop_stalled_seconds)
        longest_stall.add_metric([dev], d.loop_longest_stall_seconds)
        if d.kv_events_endpoint:  # KV events published (--kv-events-config)
            kv_batches.add_metric([dev], d.kv_events_published)
            kv_dropped.add_metric([dev], d.kv_events_dropped)
        for p in snap.peers:
            for direction, done, nbytes, failed in (
                    ("sent", p.sent, p.sent_bytes, p.send_failures),
                    ("received", p.received, p.received_bytes, p.receive_failures)):
                labels = [dev, p.peer, direction]
                transfers.add_metric(labels, done)
                transfer_bytes.add_metric(labels, nbytes)
                transfer_failures.add_metric(labels, failed)
            if p.fenced_pages:
                fenced_pages.add_metric([dev, p.peer], p.fenced_pages)
        yield from fams
        yield from elastic.families()
        yield from sealed.families()

    @staticmethod
    def _families() -> tuple[Metric, ...]:
        spaces = ("device", "pool", "space", "unit")
        calls = ("device", "pool", "space")
        pools = ("device", "pool")
        device = ("device",)
        peers = ("device", "peer", "direction")
        return (
            GaugeMetricFamily("kvpool_pool_capacity",
                              "Ids of this id space the pool can hand out (padding page excluded).",
                              labels=spaces),
            GaugeMetricFamily("kvpool_pool_used", "Ids of this id space held by leases now.",
                              labels=spaces),
            GaugeMetricFamily("kvpool_pool_free", "Ids of this id space free now "
                              "(capacity - used).",
                              labels=spaces),
            GaugeMetricFamily("kvpool_pool_high_water",
                              "The most ids of this id space used at once since the pool was "
                              "built.",
                              labels=spaces),
            GaugeMetricFamily("kvpool_pool_bytes",
                              "Bytes of the pool's backing region (KV + state + aux buffers).",
                              labels=pools),
            GaugeMetricFamily("kvpool_attached_clients",
                              "Clients that mapped the pool's memory (Attach without Detach).",
                              labels=pools),
            CounterMetricFamily("kvpool_allocated_ids",
                                "Ids of this id space handed out since the pool was built.",
                                labels=spaces),
            CounterMetricFamily("kvpool_freed_ids",
                                "Ids of this id space returned since the pool was built, reclaim "
                                "of closed and expired leases included.", labels=spaces),
            CounterMetricFamily("kvpool_allocation_refusals",
                                "Allocate calls (not ids) refused for this id space because too "
                                "few ids were free.", labels=calls),
            GaugeMetricFamily("kvpool_device_budget_bytes",
                              "Device bytes all pools together may occupy (kvpoold --budget).",
                              labels=device),
            GaugeMetricFamily("kvpool_device_used_bytes",
                              "Device bytes the pools' backing regions occupy.", labels=device),
            GaugeMetricFamily("kvpool_leases_open", "Open leases.", labels=device),
            CounterMetricFamily("kvpool_lease_expiries",
                                "Leases not renewed within their TTL, expired and reclaimed.",
                                labels=device),
            GaugeMetricFamily("kvpool_lease_cached_ids",
                              "Ids of this id space held by leases' page caches unused (as "
                              "reported on KeepAlive), summed over leases.", labels=spaces),
            CounterMetricFamily("kvpool_transfers",
                                "Transfers of KV pages with this peer daemon that completed "
                                "(direction sent or received).", labels=peers),
            CounterMetricFamily("kvpool_transfer_bytes",
                                "Bytes of the completed transfers with this peer daemon.",
                                labels=peers),
            CounterMetricFamily("kvpool_transfer_failures",
                                "Transfers with this peer daemon that failed: sent ones refused "
                                "by the peer or unreachable, or whose write failed; received "
                                "ones whose write failed or never completed.",
                                labels=peers),
            CounterMetricFamily("kvpool_loop_stalls",
                                "Stalls of the daemon's event loop (a 50 ms tick answered over "
                                "50 ms late); lease deadlines stand still during them.",
                                labels=device),
            CounterMetricFamily("kvpool_loop_stalled_seconds",
                                "Seconds the daemon's event loop was stalled, summed.",
                                labels=device),
            GaugeMetricFamily("kvpool_loop_longest_stall_seconds",
                              "The longest stall of the daemon's event loop since start.",
                              labels=device),
            GaugeMetricFamily("kvpool_pool_pinned",
                              "Ids of this id space a transfer between daemons is moving now "
                              "(they cannot be freed).", labels=spaces),
            GaugeMetricFamily("kvpool_pool_quarantined",
                              "Ids of this id space whose lease ended while a transfer moved "
                              "them: held by no lease until the transfer ends (in used).",
                              labels=spaces),
            GaugeMetricFamily("kvpool_build_info",
                              "Always 1; the labels say what this daemon runs: kvpool version, "
                              "wire contract, Python, torch and NIXL versions (nixl \"none\" "
                              "when not installed).",
                              labels=("device", *BUILD_LABELS)),
            GaugeMetricFamily("kvpool_transfer_fenced_pages",
                              "Pages a write from this peer daemon may still land in after its "
                              "grant ended (deadline, cancel, lease end): quarantined until the "
                              "peer reports the write ended or its process exits.",
                              labels=("device", "peer")),
            CounterMetricFamily("kvpool_kv_events_batches",
                                "KV event batches of the sealed-page directories handed to the "
                                "publisher (--kv-events-config).", labels=device),
            CounterMetricFamily("kvpool_kv_events_dropped",
                                "KV event batches dropped because the publisher's queue was "
                                "full: each a gap routers repair by replay.", labels=device),
        )


class SealedFamilies:
    """The sealed-page directory's series (docs/restart.md), one sample per pool that has one."""

    def __init__(self) -> None:
        pools = ("device", "pool")
        self.pages = GaugeMetricFamily(
            "kvpool_sealed_pages", "Sealed pages of the pool: held by a lease (holder=\"lease\") "
            "or kept by the directory for a later engine (holder=\"directory\", evictable).",
            labels=("device", "pool", "holder"))
        self.kept_bytes = GaugeMetricFamily(
            "kvpool_sealed_kept_bytes", "Bytes of the sealed pages the directory keeps (KV "
            "buffers only): evictable cache counted against the pool.", labels=pools)
        self.sealed = CounterMetricFamily(
            "kvpool_pages_sealed", "Pages sealed since the pool was built.", labels=pools)
        self.adopted = CounterMetricFamily(
            "kvpool_adopted_pages", "Sealed pages a later engine adopted.", labels=pools)
        self.evicted = CounterMetricFamily(
            "kvpool_sealed_evicted_pages", "Kept sealed pages given back to the free set "
            "(memory pressure, kvpool sealed --evict).", labels=pools)
        self.corrupt = CounterMetricFamily(
            "kvpool_sealed_corrupt_pages", "Sealed pages whose bytes changed after sealing, "
            "found at adoption and dropped (CPU pools).", labels=pools)
        self.epoch = GaugeMetricFamily(
            "kvpool_sealed_epoch", "Adoptions of the pool's directory that took pages.",
            labels=pools)

    def add(self, device: str, pool: str, s: SealedStats) -> None:
        self.pages.add_metric([device, pool, "lease"], s.held)
        self.pages.add_metric([device, pool, "directory"], s.kept)
        self.kept_bytes.add_metric([device, pool], s.kept_bytes)
        self.sealed.add_metric([device, pool], s.sealed_total)
        self.adopted.add_metric([device, pool], s.adopted_total)
        self.evicted.add_metric([device, pool], s.evicted_total)
        self.corrupt.add_metric([device, pool], s.corrupt_total)
        self.epoch.add_metric([device, pool], s.epoch)

    def families(self) -> Iterator[Metric]:
        yield from (self.pages, self.kept_bytes, self.sealed, self.adopted, self.evicted,
                    self.corrupt, self.epoch)


def loop_snapshot(take: Callable[[], Stats | Awaitable[Stats]], loop: asyncio.AbstractEventLoop,
                  timeout_s: float = SNAPSHOT_TIMEOUT_S) -> Callable[[], Stats]:
    """Wrap ``take`` so that calling it from another thread runs it on ``loop``.

    The daemon's state belongs to its event loop (no locks); the metrics HTTP server answers in
    its own threads, so each scrape hands the snapshot to the loop and waits for it. ``take``
    may be a coroutine function (``Daemon.snapshot``, which reads the leases in slices between
    which the loop serves other calls): it then runs as a task on the loop.

    Args:
        take: the snapshot function (``Daemon.snapshot``).
        loop: the daemon's running event loop.
        timeout_s: how long a scrape waits for the loop.

    Returns:
        A function that returns the snapshot; it raises ``Internal`` when the loop does not
        answer within ``timeout_s`` (stopped, or blocked), which the scrape sees as HTTP 500,
        or when called on the loop itself with a coroutine function (it cannot wait there).
    """

    def call() -> Stats:
        try:
            on_loop = asyncio.get_running_loop() is loop
        except RuntimeError:
            on_loop = False  # no loop in this thread: the normal case, a scrape thread
        if on_loop:  # already on the loop: no hop
            got = take()
            if inspect.isawaitable(got):
                asyncio.ensure_future(got).cancel()  # never run: no "never awaited" warning
                raise Internal("a snapshot taken in slices cannot be waited for on the "
                               "daemon's own event loop; scrape from another thread")
            return got
        future: concurrent.futures.Future[Stats] = concurrent.futures.Future()

        def settle(task: asyncio.Future[Stats]) -> None:
            if task.cancelled():  # the loop is closing
                future.set_exception(Internal("the daemon's snapshot was cancelled"))
            elif (exc := task.exception()) is not None:
                future.set_exception(exc)
            else:
                future.set_result(task.result())

        def run() -> None:
            if future.set_running_or_notify_cancel():
                try:
                    got = take()
                    if not inspect.isawaitable(got):
                        future.set_result(got)
                        return
                    asyncio.ensure_future(got).add_done_callback(settle)
                except BaseException as exc:
                    future.set_exception(exc)

        try:
            loop.call_soon_threadsafe(run)
            return future.result(timeout_s)
        except (RuntimeError, concurrent.futures.TimeoutError) as exc:
            future.cancel()
            raise Internal(
                f"the daemon's event loop did not take a snapshot within {timeout_s} s "
                f"({type(exc).__name__}); it is shutting down or blocked"
            ) from exc

    return call


class DaemonMetrics:
    """The registry of one daemon: its :class:`DaemonCollector` and :class:`RpcMetrics`.

    Args:
        snapshot: the daemon's snapshot function, callable from any thread
            (see :func:`loop_snapshot`).
        device: the ``device`` label.
    """

    def __init__(self, snapshot: Callable[[], Stats], device: str) -> None:
        # No ``*_created`` series next to each counter and histogram: in the text format they
        # are extra gauges nobody queries. A process-wide switch of prometheus_client, and the
        # daemon's process exports nothing else.
        disable_created_metrics()
        self.registry = CollectorRegistry(auto_describe=False)
        self.rpc = RpcMetrics(self.registry, device)
        self.registry.register(DaemonCollector(snapshot, device))


@dataclass
class MetricsServer:
    """The ``/metrics`` HTTP server (prometheus_client's WSGI server in a daemon thread)."""

    httpd: WSGIServer
    thread: threading.Thread
    host: str

    @property
    def port(self) -> int:
        """The bound port (the real one when started with port 0)."""
        return int(self.httpd.server_port)

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}/metrics"

    def close(self) -> None:
        """Stop serving and close the socket; blocks up to the server's 0.5 s poll. Idempotent."""
        if self.thread.is_alive():
            self.httpd.shutdown()
            self.thread.join()
        self.httpd.server_close()


def start_metrics_server(registry: CollectorRegistry, host: str, port: int) -> MetricsServer:
    """Serve ``registry`` at ``http://host:port/metrics`` from a background thread (404 on
    other paths but ``/``, see :func:`routed_app`).

    Args:
        registry: what to expose (``DaemonMetrics.registry``).
        host: the address to bind (``127.0.0.1``; ``0.0.0.0`` for every interface).
        port: the TCP port; 0 picks a free one (read it from ``MetricsServer.port``).

    Returns:
        The running server.

    Raises:
        FailedPrecondition: the address cannot be bound (in use, not permitted, unknown host).
    """
    try:
        httpd, thread = _serve(routed_app(registry), host, port)
    except OSError as exc:
        raise FailedPrecondition(
            f"cannot serve metrics on {host}:{port}: {exc.strerror or exc} (in use, not "
            "permitted, or not an address of this host); choose another --metrics-port or "
            "--metrics-host",
            field="metrics_port",
        ) from exc
    server = MetricsServer(httpd, thread, host)
    log.info("metrics serving", extra={"fields": {
        "event": "metrics_serving", "url": server.url, "metrics_port": server.port,
    }})
    return server


INDEX = b"kvpoold: Prometheus metrics at /metrics\n"


def routed_app(registry: CollectorRegistry) -> Callable[..., Iterable[bytes]]:
    """The WSGI app: ``/metrics`` (query strings as prometheus_client reads them), a one-line
    index at ``/``, 404 for every other path (a scraper pointed at a wrong path must see it)."""
    metrics = make_wsgi_app(registry)

    def app(environ: dict[str, Any], start_response: Callable[..., Any]) -> Iterable[bytes]:
        path = environ.get("PATH_INFO") or "/"
        if path == "/metrics":
            return metrics(environ, start_response)
        if path == "/":
            start_response("200 OK", [("Content-Type", "text/plain; charset=utf-8")])
            return [INDEX]
        start_response("404 Not Found", [("Content-Type", "text/plain; charset=utf-8")])
        return [b"not found; metrics are at /metrics\n"]

    return app


class _QuietHandler(WSGIRequestHandler):
    def log_message(self, format: str, *args: Any) -> None:
        """No line per scrape."""


def _serve(app: Callable[..., Iterable[bytes]], host: str, port: int
           ) -> tuple[WSGIServer, threading.Thread]:
    """``app`` on ``host:port`` (IPv4 or IPv6 as ``host`` resolves) from a daemon thread, one
    thread per request, as prometheus_client's own server does."""
    family, _, _, _, sockaddr = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM,
                                                   flags=socket.AI_PASSIVE)[0]

    class Server(ThreadingWSGIServer):
        address_family = family

    httpd = make_server(str(sockaddr[0]), port, app, Server, handler_class=_QuietHandler)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True, name="kvpoold-metrics")
    thread.start()
    return httpd, thread
