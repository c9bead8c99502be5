"""Soak: a daemon under mixed load from many processes, with faults injected, for minutes.

What it does (all real: a ``kvpoold serve`` child on a temporary socket and shm directory,
worker processes running this script with ``--worker``):

1. A quiet baseline: one worker alone for ``--baseline-s``; the latency of each operation.
2. ``--workers`` processes of mixed load for ``--minutes``: page-cache allocs and frees (the
   engine's path), direct Allocate/Free batches, Stats, Attach + read a page + Detach, and
   short leases opened and closed. Each worker renews its lease with ``--ttl-s``.
3. Faults: every ``--kill-every-s`` a random worker is SIGKILLed and replaced (its lease must
   disappear within TTL + 1 s, its pages back in the pool); once, at ``--daemon-kill-at`` of
   the run, the daemon itself is SIGKILLed and restarted on the same socket (the workers ride
   it out: UNAVAILABLE, then NotFound for their old leases, then new ones).
4. Every ``--sample-s``: invariants from one Stats snapshot (per pool and id space used + free =
   capacity, and the leases' holdings sum to used) and the daemon's RSS.
5. The end: workers stop (SIGTERM: they close their leases); no lease is left, every page is
   free, the pool drops, the daemon stops cleanly, its socket and shm files are gone.

It prints the invariant checks, p50/p99 per operation under load with the ratio to the quiet
baseline measured in the same run, and the daemon's RSS over time. Exit status 1 if any
invariant failed. Bounded: it stops by itself after ``--minutes`` (plus shutdown).

Run from the repository root (not part of the default CI run; 10 minutes by default):

    PYTHONPATH=client:service python bench/soak.py [--minutes 10] [--workers 8]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from kvpool.clients.client import KVPoolClient
from kvpool.contract.errors import KVPoolError, NotFound, ResourceExhausted, Unavailable

REPO = Path(__file__).resolve().parents[1]
POOL = "soak"
# 2 layers, 2 KV heads of 16, page 16: 1 KiB per page; 4,096 pages for 8 workers.
SPEC = {"num_layers": 2, "attention": {"type": "mha", "num_kv_heads": 2, "head_dim": 16},
        "context_length": 1024}
POOL_OPTIONS = {"max_total_tokens": 4096 * 16, "page_size": 16, "max_running_requests": 64}
OPS = ("cache", "allocate_free", "stats", "attach", "lease")
WEIGHTS = (60, 25, 8, 4, 3)
RESERVOIR = 20_000  # latency samples kept per operation and worker


# -- the worker ---------------------------------------------------------------------------------

@dataclass
class WorkerState:
    client: KVPoolClient
    name: str
    ttl_s: float
    lease: Any = None
    cache_lease: Any = None  # the cache's own: a page cache is its lease's only path to kv
    cache: Any = None
    held: list[np.ndarray] = field(default_factory=list)  # direct Allocates not yet freed
    in_cache: list[np.ndarray] = field(default_factory=list)  # page-cache allocs in use

    def reset(self) -> None:
        """Forget a lease the daemon no longer has (restart, expiry): start over."""
        for closer in (self.cache, self.cache_lease, self.lease):
            if closer is not None:
                with contextlib.suppress(Exception):
                    closer.close()
        self.lease = self.cache_lease = self.cache = None
        self.held.clear()
        self.in_cache.clear()

    def ensure_lease(self) -> None:
        if self.lease is None:
            self.lease = self.client.lease(self.name, ttl_s=self.ttl_s)
            self.cache_lease = self.client.lease(f"{self.name}-cache", ttl_s=self.ttl_s)
            self.cache = self.cache_lease.page_cache(POOL, low=32, high=256, batch=64)


def one_op(state: WorkerState, op: str, rng: random.Random) -> None:
    state.ensure_lease()
    if op == "cache":
        if state.in_cache and (len(state.in_cache) > 8 or rng.random() < 0.5):
            state.cache.free(state.in_cache.pop(rng.randrange(len(state.in_cache))))
        else:
            state.in_cache.append(state.cache.alloc(rng.randint(1, 32)))
    elif op == "allocate_free":
        if state.held and (len(state.held) > 4 or rng.random() < 0.5):
            state.lease.free(POOL, "kv", state.held.pop(0))
        else:
            state.held.append(state.lease.allocate(POOL, "kv", rng.randint(1, 64)))
    elif op == "stats":
        state.client.stats(POOL)
    elif op == "attach":
        with state.client.attach(POOL, lease=state.lease) as region:
            float(region.page("k.0", rng.randint(1, 64)).sum())
    elif op == "lease":
        with state.client.lease(f"{state.name}-short", ttl_s=state.ttl_s) as short:
            short.allocate(POOL, "kv", 1)


def run_worker(target: str, name: str, seconds: float, ttl_s: float, seed: int,
               weights: tuple[int, ...] = WEIGHTS, progress_s: float = 0.0) -> dict[str, Any]:
    """Mixed load until ``seconds`` pass or SIGTERM; returns latency reservoirs and counts.
    Each operation runs once untimed first (imports, the first mapping of the pool). With
    ``progress_s``, prints its outcome counts every that many seconds (a worker SIGKILLed by
    the soak leaves its last line for the report)."""
    stop = False

    def on_term(signum: int, frame: Any) -> None:
        nonlocal stop
        stop = True

    signal.signal(signal.SIGTERM, on_term)
    rng = random.Random(seed)
    samples: dict[str, list[int]] = {op: [] for op in OPS}
    seen: Counter[str] = Counter()
    outcomes: Counter[str] = Counter()
    state = WorkerState(KVPoolClient(target, timeout_s=5.0), name, ttl_s)
    for op in OPS:
        with contextlib.suppress(KVPoolError):
            one_op(state, op, rng)
    deadline = time.monotonic() + seconds
    next_progress = time.monotonic() + progress_s
    clock = time.perf_counter_ns
    while not stop and time.monotonic() < deadline:
        if progress_s and time.monotonic() >= next_progress:
            next_progress = time.monotonic() + progress_s
            print(json.dumps({"progress": dict(outcomes)}), flush=True)
        op = rng.choices(OPS, weights)[0]
        t0 = clock()
        try:
            one_op(state, op, rng)
        except ResourceExhausted:
            outcomes["resource_exhausted"] += 1
            for ids in state.held[::2]:  # give back half, as an engine preempts
                with contextlib.suppress(KVPoolError):
                    state.lease.free(POOL, "kv", ids)
            state.held = state.held[1::2]
            continue
        except (Unavailable, NotFound) as err:  # the daemon restarts, or the lease went with it
            outcomes[type(err).__name__] += 1
            state.reset()
            time.sleep(0.2)
            continue
        except KVPoolError as err:
            outcomes[f"error:{type(err).__name__}"] += 1
            state.reset()
            continue
        seen[op] += 1
        bucket = samples[op]
        if len(bucket) < RESERVOIR:
            bucket.append(clock() - t0)
        else:  # a uniform sample of every call (reservoir sampling)
            j = rng.randrange(seen[op])
            if j < RESERVOIR:
                bucket[j] = clock() - t0
    state.reset()
    state.client.close()
    return {"name": name, "samples": samples, "counts": dict(seen), "outcomes": dict(outcomes)}


# -- the parent ---------------------------------------------------------------------------------

def child_env() -> dict[str, str]:
    return dict(os.environ, PYTHONPATH=f"{REPO / 'client'}:{REPO / 'service'}")


class Daemon:
    """``kvpoold serve`` on ``sock`` with its shm files in ``shm_dir``."""

    def __init__(self, sock: Path, shm_dir: Path, budget: str) -> None:
        self.sock, self.shm_dir, self.budget = sock, shm_dir, budget
        self.proc: subprocess.Popen[bytes] | None = None
        self.target = f"unix://{sock}"

    def start(self) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "kvpoold.main", "serve", "--listen", self.target,
             "--budget", self.budget, "--shm-dir", str(self.shm_dir), "--log-level", "warning"],
            env=child_env(), cwd=REPO)
        with KVPoolClient(self.target, timeout_s=2.0) as client:
            client.wait_serving(60.0)
            client.configure(POOL, spec=SPEC, **POOL_OPTIONS)

    def rss_mib(self) -> float:
        assert self.proc is not None
        try:
            for line in Path(f"/proc/{self.proc.pid}/status").read_text().splitlines():
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) / 1024
        except OSError:
            pass
        return float("nan")

    def kill(self) -> None:
        assert self.proc is not None
        self.proc.kill()
        self.proc.wait(30)

    def stop(self) -> int:
        assert self.proc is not None
        self.proc.terminate()
        return self.proc.wait(60)


@dataclass
class Checks:
    passed: Counter[str] = field(default_factory=Counter)
    failed: list[str] = field(default_factory=list)

    def check(self, name: str, ok: bool, detail: str = "") -> None:
        if ok:
            self.passed[name] += 1
        else:
            self.failed.append(f"{name}: {detail}")
            print(f"  INVARIANT FAILED {name}: {detail}", flush=True)


def check_snapshot(client: KVPoolClient, checks: Checks) -> int:
    """Invariants of one Stats snapshot; returns the pool's kv pages in use."""
    stats = client.stats()
    pool = stats.pool(POOL)
    for name, space in pool.spaces.items():
        checks.check("used + free = capacity", space.used + space.free == space.capacity,
                     f"{name}: {space.used} + {space.free} != {space.capacity}")
        held = sum(lease.held.get(POOL, {}).get(name, 0) for lease in stats.leases)
        checks.check("leases hold exactly what is used", held == space.used,
                     f"{name}: leases hold {held}, used {space.used}")
    return pool.spaces["kv"].used


def start_worker(args: argparse.Namespace, target: str, name: str, seconds: float,
                 seed: int) -> subprocess.Popen[str]:
    cmd = [sys.executable, str(Path(__file__).resolve()), "--worker", json.dumps(
        {"target": target, "name": name, "seconds": seconds, "ttl_s": args.ttl_s, "seed": seed})]
    return subprocess.Popen(cmd, env=child_env(), cwd=REPO, stdout=subprocess.PIPE, text=True)


def percentile_us(samples: list[int], q: float) -> float:
    return float(np.percentile(np.asarray(samples, dtype=np.float64), q)) / 1e3 if samples \
        else float("nan")


def run(args: argparse.Namespace) -> int:
    tmp = Path(tempfile.mkdtemp(prefix="kvp-soak-", dir="/tmp"))
    shm_dir = tmp / "shm"
    shm_dir.mkdir()
    daemon = Daemon(tmp / "kvpool.sock", shm_dir, args.budget)
    checks = Checks()
    rss: list[tuple[float, float]] = []
    results: list[dict[str, Any]] = []
    faults: Counter[str] = Counter()
    rng = random.Random(args.seed)
    workers: dict[str, subprocess.Popen[str]] = {}
    try:
        daemon.start()
        print(f"soak: daemon pid {daemon.proc.pid if daemon.proc else '?'}, {args.workers} "
              f"workers, {args.minutes:g} min, TTL {args.ttl_s:g} s", flush=True)
        # every operation equally often, so each has a quiet p50
        baseline = run_worker(daemon.target, "baseline", args.baseline_s, args.ttl_s, args.seed,
                              weights=(1,) * len(OPS))
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        seconds = args.minutes * 60
        t_start = time.monotonic()
        end = t_start + seconds
        for i in range(args.workers):
            workers[f"w{i}.0"] = start_worker(args, daemon.target, f"w{i}.0", seconds + 60,
                                              args.seed + i + 1)
        next_kill = t_start + args.kill_every_s
        next_sample = t_start
        daemon_kill_at = t_start + args.daemon_kill_at * seconds if args.daemon_kill_at else None
        killed: dict[str, float] = {}  # lease name -> when its worker was SIGKILLed
        killed_outcomes: Counter[str] = Counter()  # what the killed workers had recovered from
        generation = Counter[str]()
        with KVPoolClient(daemon.target, timeout_s=10.0) as client:
            while (now := time.monotonic()) < end:
                if now >= next_sample:
                    next_sample = now + args.sample_s
                    rss.append((now - t_start, daemon.rss_mib()))
                    try:
                        used = check_snapshot(client, checks)
                        names = {lease.name for lease in client.stats().leases}
                    except Unavailable:
                        used, names = -1, set()
                    for name, when in list(killed.items()):
                        if now - when > args.ttl_s + 1.0 + args.sample_s:
                            checks.check("a killed worker's lease ends within TTL + 1 s",
                                         name not in names, f"{name} still open")
                            del killed[name]
                    print(f"  t={now - t_start:6.1f}s rss {rss[-1][1]:7.1f} MiB, kv pages used "
                          f"{used}, leases {len(names)}, faults {dict(faults)}", flush=True)
                if now >= next_kill and workers:
                    next_kill = now + args.kill_every_s
                    victim = rng.choice(sorted(workers))
                    proc = workers.pop(victim)
                    proc.kill()
                    killed_outcomes.update(last_progress(proc.communicate(timeout=30)[0]))
                    killed[victim] = time.monotonic()
                    killed[f"{victim}-short"] = time.monotonic()
                    slot = victim.split(".")[0]
                    generation[slot] += 1
                    name = f"{slot}.{generation[slot]}"
                    workers[name] = start_worker(args, daemon.target, name,
                                                 max(1.0, end - now) + 60, rng.randrange(1 << 30))
                    faults["worker SIGKILL"] += 1
                if daemon_kill_at is not None and now >= daemon_kill_at:
                    daemon_kill_at = None
                    daemon.kill()
                    faults["daemon SIGKILL"] += 1
                    killed.clear()  # the restart ends every lease
                    time.sleep(0.5)
                    daemon.start()
                    left = sorted(p.name for p in shm_dir.iterdir())
                    checks.check("a restarted daemon keeps only its live pool's shm files",
                                 len(left) <= 2, f"{left}")
                time.sleep(0.2)
            for proc in workers.values():
                proc.send_signal(signal.SIGTERM)
            for name, proc in workers.items():
                out, _ = proc.communicate(timeout=60)
                try:
                    results.append(json.loads(out.strip().splitlines()[-1]))
                except (IndexError, json.JSONDecodeError):
                    checks.check("every worker reports", False, f"{name} printed {out[-200:]!r}")
            workers.clear()
            deadline = time.monotonic() + args.ttl_s + 2
            while True:  # the killed workers' leases may still be expiring
                stats = client.stats()
                if not stats.leases or time.monotonic() > deadline:
                    break
                time.sleep(0.2)
            checks.check("no lease left at the end", not stats.leases,
                         f"{[lease.name for lease in stats.leases]}")
            check_snapshot(client, checks)
            kv = stats.pool(POOL).spaces["kv"]
            checks.check("every page free at the end", kv.used == 0, f"{kv.used} used")
            client.drop(POOL)
        rss.append((time.monotonic() - t_start, daemon.rss_mib()))
        code = daemon.stop()
        checks.check("the daemon stops cleanly", code == 0, f"exit {code}")
        checks.check("its socket is removed", not daemon.sock.exists(), str(daemon.sock))
        left = sorted(p.name for p in shm_dir.iterdir())
        checks.check("no shm file left", not left, f"{left}")
    finally:
        for proc in workers.values():
            proc.kill()
        if daemon.proc is not None and daemon.proc.poll() is None:
            daemon.proc.kill()
        shutil.rmtree(tmp, ignore_errors=True)
    report(baseline, results, rss, checks, faults, killed_outcomes)
    return 1 if checks.failed else 0


def last_progress(out: str) -> dict[str, int]:
    """The outcome counts of a killed worker's last progress line (none if it printed none)."""
    for line in reversed(out.strip().splitlines()):
        with contextlib.suppress(json.JSONDecodeError):
            data = json.loads(line)
            if "progress" in data:
                return dict(data["progress"])
    return {}


def report(baseline: dict[str, Any], results: list[dict[str, Any]],
           rss: list[tuple[float, float]], checks: Checks, faults: Counter[str],
           killed_outcomes: Counter[str]) -> None:
    print("\nlatency under load vs the quiet baseline (one worker alone), same run")
    print(f"{'operation':<16}{'calls':>10}{'p50 us':>10}{'p99 us':>11}{'quiet p50':>11}"
          f"{'p50 ratio':>11}")
    for op in OPS:
        load = [s for r in results for s in r["samples"][op]]
        calls = sum(r["counts"].get(op, 0) for r in results)
        quiet = percentile_us(baseline["samples"][op], 50)
        p50, p99 = percentile_us(load, 50), percentile_us(load, 99)
        print(f"{op:<16}{calls:>10,}{p50:>10.0f}{p99:>11.0f}{quiet:>11.0f}{p50 / quiet:>10.2f}x")
    outcomes: Counter[str] = Counter(killed_outcomes)
    for r in results:
        outcomes.update(r["outcomes"])
    print(f"\nerrors the workers recovered from (a killed worker's up to its last progress "
          f"line): {dict(outcomes)}; faults injected: {dict(faults)}")
    values = [m for _, m in rss if m == m]
    if values:
        print(f"daemon RSS MiB: start {values[0]:.1f}, min {min(values):.1f}, max "
              f"{max(values):.1f}, end {values[-1]:.1f} ({len(values)} samples)")
    print("\ninvariants:")
    for name, n in sorted(checks.passed.items()):
        print(f"  ok    {name} ({n} checks)")
    for failure in checks.failed:
        print(f"  FAIL  {failure}")
    print("PASS" if not checks.failed else f"FAIL: {len(checks.failed)} invariant(s) broken")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--minutes", type=float, default=10.0, help="length of the loaded run")
    p.add_argument("--workers", type=int, default=8, help="load processes")
    p.add_argument("--ttl-s", type=float, default=2.0, help="the workers' lease TTL")
    p.add_argument("--kill-every-s", type=float, default=20.0,
                   help="SIGKILL and replace a random worker this often")
    p.add_argument("--daemon-kill-at", type=float, default=0.5,
                   help="SIGKILL and restart the daemon at this fraction of the run (0: never)")
    p.add_argument("--sample-s", type=float, default=5.0, help="invariants and RSS this often")
    p.add_argument("--baseline-s", type=float, default=5.0, help="the quiet baseline's length")
    p.add_argument("--budget", default="256MiB", help="the daemon's budget")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--worker", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        cfg = json.loads(args.worker)
        print(json.dumps(run_worker(cfg["target"], cfg["name"], cfg["seconds"], cfg["ttl_s"],
                                    cfg["seed"], progress_s=2.0)), flush=True)
        return 0
    return run(args)


if __name__ == "__main__":
    sys.exit(main())
