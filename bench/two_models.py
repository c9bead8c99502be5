"""Benchmark: two models on one device (issue 24): two real SGLang 0.5.23 engines on CPU, one
kvpool daemon whose budget is smaller than the sum of their peaks, a shifting load replayed
three ways in one run.

- ``static``: two fixed pools, half the budget's tokens each (what operators do today);
- ``greedy``: elastic pools, ``kvpoold serve --elastic-policy greedy`` (each engine takes what is
  free down to a headroom, never from the other: kvcached's policy);
- ``arbiter``: elastic pools under kvpool's arbiter (the default policy).

The models are tiny random Llamas of different layouts (A: 16 KV heads x 64; B: 8 KV heads x 128;
one layer each, float32, hidden 64 whatever the heads, so the compute stays tiny while a token's KV
is a real layer's size), so their pools have different views and groups. One layer keeps a group
(whole 2 MiB chunks of every view: 4 MiB, 512 tokens here) small against the budget, as it is
against a GPU's: what an engine must keep (its pages in use plus one group of headroom) is then a
small part of the budget, and the arbiter can give a bursting engine most of it. SGLang
runs with ``--disable-radix-cache`` unless ``--radix``: its radix cache keeps finished requests'
KV until an allocation runs short (or, on an elastic pool, until the daemon asks for it back), so
every pool fills and "KV tokens held" measures the cache, not the requests. The trace,
per mode: phase ``a``: A bursts (many concurrent requests) while B trickles; phase ``b``: the
reverse; phase ``both``: both burst. Each engine is a ``python -m sglang.launch_server`` with the
kvpool plugin (``SGLANG_PLATFORM=kvpool``; ``KVPOOL_ELASTIC=1`` in the elastic modes) on the
daemon's Unix socket; the load comes over HTTP (``/generate``, streamed for TTFT).

Printed per mode and phase: requests running at once (SGLang's ``num_running_reqs``, peak),
tokens/s, TTFT p50/p99, retractions and aborts, the KV tokens each engine held (its lease's
pages, peak), and per mode the reclaim latency and the peak memory behind the pools (never above
the budget). Then the ratios against ``static`` measured in the same run, the issue's targets,
and a PNG of KV tokens held per engine over time (``--plot``, drawn with Pillow in the SGLang
venv). Run from the repository root (the side venv from ``tests/sglang/setup_venv.sh``)::

    PYTHONPATH=client:service .venv/bin/python bench/two_models.py [--quick] [--plot out.png]
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import math
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from benchlib.venv_ready import SGLANG_MARKER, venv_problem  # bench/ is the script's directory

from kvpool import KVPoolClient

REPO = Path(__file__).resolve().parent.parent
HARNESS = REPO / "tests" / "sglang"
VENV = Path(os.environ.get("KVPOOL_SGLANG_VENV", REPO / ".venv-sglang"))
MiB = 1 << 20
PAGE = 4
# name -> (layers, kv heads, head dim): float32 K and V of every layer.
MODELS = {"a": (1, 16, 64), "b": (1, 8, 128)}
MODES = ("static", "greedy", "arbiter")
PHASES = ("a", "b", "both")


def bytes_per_token(name: str) -> int:
    layers, heads, dim = MODELS[name]
    return layers * 2 * heads * dim * 4


def group_tokens(name: str) -> int:
    """Tokens of one group of the model's elastic pool: whole 2 MiB chunks of each view."""
    _, heads, dim = MODELS[name]
    return math.lcm(PAGE, (2 * MiB) // math.gcd(2 * MiB, heads * dim * 4))


@dataclass
class Settings:
    budget: int  # the daemon's budget
    burst: int  # concurrent requests of a bursting engine
    trickle: int  # of the other one
    prompt: int  # tokens per prompt
    new: int  # tokens generated per request
    phase_s: float  # seconds a phase sends requests
    radix: bool = False  # SGLang's radix cache on


# The budget is large against a group (4 MiB, 512 tokens of either model), and a burst needs more
# KV than the whole budget holds (80 x 208 tokens of 8 KiB: 130 MiB of 128): so the static split
# is what limits a bursting engine, and an elastic one can use all the other does not.
QUICK = Settings(budget=128 * MiB, burst=80, trickle=1, prompt=160, new=48, phase_s=10.0)
FULL = Settings(budget=128 * MiB, burst=96, trickle=2, prompt=160, new=96, phase_s=30.0)


# What the table's columns are, printed under it (a reader sees the table, not this file).
LEGEND = (
    "legend, per mode, phase and engine (eng):",
    "  reqs      requests answered in the phase",
    "  tok/s     tokens generated per second of the phase",
    "  ttft p50  time to first token in seconds, median; p99 its 99th percentile. It counts the",
    "            wait in SGLang's queue: a request starts only once the engine has KV room",
    "  running   most requests SGLang ran at once (its num_running_reqs)",
    "  held tok  most KV tokens the engine's lease held in the daemon (pages x page size)",
    "  to 90%    seconds from the phase's start until the engine held 90% of that peak",
    "  aborts    requests that failed",
)
# Why a bursting engine's TTFT is far above the other's in the same phase, pool weights equal.
TTFT_NOTE = (
    "why TTFT differs within a phase: a bursting engine gets more requests at once than the "
    "whole budget has KV for, so most of them queue in SGLang until earlier ones finish; its "
    "TTFT is mostly that wait, while a trickling engine's requests find room at once (one "
    "prefill). In phase 'both' the engine that burst just before (b) starts out holding most "
    "of the memory, and the other (a) gets its half only as b's running requests finish and "
    "the daemon reclaims their groups: equal weights set the split both move toward, not who "
    "holds the memory when the phase begins, so a's requests wait longer.")


def phase_line(phase: str, s: Settings) -> str:
    """What phase ``phase`` sends, as printed when it starts."""
    burst = [n for n in MODELS if phase in (n, "both")]
    calm = [n for n in MODELS if n not in burst]
    both = len(burst) > 1
    text = (f"phase {phase} ({s.phase_s:g} s): engine{'s' if both else ''} "
            f"{' and '.join(burst)} burst{'' if both else 's'} ({s.burst} requests at once"
            f"{' each' if both else ''})")
    if calm:
        text += f", engine {' and '.join(calm)} trickles ({s.trickle} at a time)"
    return text


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def side_env(**extra: str) -> dict[str, str]:
    env = {**os.environ, "PYTHONPATH": f"{HARNESS / 'stubs'}:{REPO / 'client'}",
           "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    env.pop("VIRTUAL_ENV", None)
    env.update(extra)
    return env


def make_models(work: Path) -> dict[str, Path]:
    out = {}
    for name, (layers, heads, dim) in MODELS.items():
        path = work / f"model-{name}"
        subprocess.run([str(VENV / "bin" / "python"), str(HARNESS / "engine_run.py"),
                        "make-model", str(path), "--layers", str(layers), "--kv-heads",
                        str(heads), "--head-dim", str(dim)], env=side_env(), check=True,
                       stdout=subprocess.DEVNULL)
        out[name] = path
    return out


@contextlib.contextmanager
def daemon(work: Path, budget: int, policy: str) -> Iterator[str]:
    sock = work / "k.sock"
    log = open(work / f"kvpoold-{policy}.log", "wb")  # noqa: SIM115 (closed below)
    proc = subprocess.Popen(
        [sys.executable, "-m", "kvpoold.main", "serve", "--listen", f"unix://{sock}",
         "--budget", str(budget), "--elastic-policy", policy, "--shm-dir", str(work),
         "--log-level", os.environ.get("KVPOOL_BENCH_DAEMON_LOG", "warning")],
        env={**os.environ, "PYTHONPATH": f"{REPO / 'client'}:{REPO / 'service'}"},
        stdout=log, stderr=subprocess.STDOUT)
    target = f"unix://{sock}"
    try:
        with KVPoolClient(target) as client:
            client.wait_serving(60)
        yield target
    finally:
        proc.terminate()
        proc.wait(30)
        log.close()


@contextlib.contextmanager
def engine(work: Path, name: str, model: Path, target: str, tokens: int, elastic: bool,
           tag: str, radix: bool = False) -> Iterator[str]:
    port = free_port()
    env = side_env(SGLANG_PLATFORM="kvpool", KVPOOL_POOL=name, KVPOOL_TARGET=target)
    if elastic:
        env["KVPOOL_ELASTIC"] = "1"
    log = open(work / f"sglang-{tag}-{name}.log", "wb")  # noqa: SIM115 (closed below)
    proc = subprocess.Popen(
        [str(VENV / "bin" / "python"), str(HARNESS / "engine_run.py"), "serve",
         "--model-path", str(model), "--host", "127.0.0.1", "--port", str(port),
         "--device", "cpu", "--attention-backend", "torch_native", "--skip-tokenizer-init",
         "--disable-cuda-graph", "--dtype", "float32", "--sampling-backend", "pytorch",
         "--grammar-backend", "none", "--disable-overlap-schedule", "--page-size", str(PAGE),
         "--max-total-tokens", str(tokens), "--max-running-requests", "256",
         *([] if radix else ["--disable-radix-cache"]),
         "--mem-fraction-static", "0.05", "--random-seed", "0", "--enable-metrics",
         # the first token at once (TTFT), then every 8: streaming every token of 80
         # requests costs the 2 CPUs more than the model does
         "--stream-interval", "8",
         "--log-level", "warning"],
        env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 600
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"SGLang {name} exited: see {log.name}")
            with contextlib.suppress(OSError), \
                    urllib.request.urlopen(url + "/health", timeout=2) as r:
                if r.status == 200:
                    break
            if time.monotonic() > deadline:
                raise RuntimeError(f"SGLang {name} did not come up: see {log.name}")
            time.sleep(1)
        yield url
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        log.close()


@dataclass
class Done:
    engine: str
    phase: str
    start: float
    ttft: float
    end: float
    tokens: int
    aborted: bool


def generate(url: str, prompt: list[int], new: int) -> tuple[float, int, bool]:
    """One streamed /generate: (TTFT s, tokens generated, aborted)."""
    body = json.dumps({"input_ids": prompt, "stream": True,
                       "sampling_params": {"temperature": 0, "max_new_tokens": new,
                                           "ignore_eos": True}}).encode()
    req = urllib.request.Request(url + "/generate", body, {"Content-Type": "application/json"})
    t0 = time.monotonic()
    ttft = None
    last: dict[str, Any] = {}
    with urllib.request.urlopen(req, timeout=600) as resp:
        for raw in resp:
            line = raw.decode().strip()
            if not line.startswith("data:") or line == "data: [DONE]":
                continue
            if ttft is None:
                ttft = time.monotonic() - t0
            last = json.loads(line[5:])
    meta = last.get("meta_info", {})
    finish = meta.get("finish_reason") or {}
    aborted = isinstance(finish, dict) and finish.get("type") == "abort"
    return (ttft if ttft is not None else float("nan"), int(meta.get("completion_tokens", 0)),
            aborted)


def load(url: str, name: str, phase: str, workers: int, until: float, s: Settings,
         out: list[Done], seed: int) -> list[threading.Thread]:
    """``workers`` closed-loop clients sending requests to ``url`` until ``until``."""
    def run(w: int) -> None:
        k = 0
        while time.monotonic() < until:
            prompt = [(seed * 7919 + w * 131 + k * 17 + i) % 250 + 3 for i in range(s.prompt)]
            t0 = time.monotonic()
            try:
                ttft, tokens, aborted = generate(url, prompt, s.new)
            except OSError:
                ttft, tokens, aborted = float("nan"), 0, True
            out.append(Done(name, phase, t0, ttft, time.monotonic(), tokens, aborted))
            k += 1
    threads = [threading.Thread(target=run, args=(w,), daemon=True) for w in range(workers)]
    for t in threads:
        t.start()
    return threads


def scrape(url: str) -> dict[str, float]:
    with urllib.request.urlopen(url + "/metrics", timeout=5) as r:
        text = r.read().decode()
    out: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith("sglang:") and " " in line:
            key, _, value = line.rpartition(" ")
            out[key.split("{")[0]] = out.get(key.split("{")[0], 0.0) + float(value)
    return out


@dataclass
class Sample:
    t: float
    phase: str
    held: dict[str, int]  # KV tokens each engine's lease holds
    running: dict[str, float]
    backed: int


@dataclass
class ModeRun:
    mode: str
    done: list[Done] = field(default_factory=list)
    samples: list[Sample] = field(default_factory=list)
    retracted: dict[str, float] = field(default_factory=dict)
    reclaim_max: float = 0.0
    reclaim_mean: float = 0.0
    reclaims: int = 0


def show_top(target: str, phase: str) -> None:
    """``kvpool top --once`` of the daemon, mid-phase (the demo's view)."""
    out = subprocess.run([sys.executable, "-m", "kvpool.tools.cli", "top", "--once",
                          "--target", target], capture_output=True, text=True,
                         env={**os.environ, "PYTHONPATH": str(REPO / "client"),
                              "COLUMNS": "100", "LINES": "30"})
    print(f"--- kvpool top, phase {phase} ---\n{out.stdout.rstrip()}", flush=True)


def pool_tokens(s: Settings, elastic: bool) -> dict[str, int]:
    """Each engine's ``--max-total-tokens``: static, half the budget each, less room for the
    request table; elastic, the whole budget is each one's virtual range, in whole groups less
    the padding page (as the plugin asks of an elastic pool)."""
    share = s.budget if elastic else s.budget // 2 - 2 * MiB
    tokens = {n: share // bytes_per_token(n) // PAGE * PAGE for n in MODELS}
    if elastic:
        tokens = {n: t // group_tokens(n) * group_tokens(n) - PAGE for n, t in tokens.items()}
    return tokens


def run_mode(mode: str, work: Path, models: dict[str, Path], s: Settings,
             top: bool = False) -> ModeRun:
    elastic = mode != "static"
    tokens = pool_tokens(s, elastic)
    result = ModeRun(mode)
    with daemon(work, s.budget, "greedy" if mode == "greedy" else "arbiter") as target, \
            KVPoolClient(target) as client, \
            engine(work, "a", models["a"], target, tokens["a"], elastic, mode,
                   s.radix) as url_a, \
            engine(work, "b", models["b"], target, tokens["b"], elastic, mode,
                   s.radix) as url_b:
        urls = {"a": url_a, "b": url_b}
        before = {n: scrape(u) for n, u in urls.items()}
        stop = threading.Event()
        phase_now = ["start"]

        def sample() -> None:
            while not stop.is_set():
                stats = client.stats()
                held = {n: 0 for n in MODELS}
                for lease in stats.leases:
                    for pool, spaces in lease.held.items():
                        if pool in held:
                            held[pool] += spaces.get("kv", 0) * PAGE
                backed = sum((p.elastic.backed_bytes if p.elastic else p.backing_bytes)
                             for p in stats.pools)
                running = {}
                for n, u in urls.items():
                    with contextlib.suppress(OSError):
                        running[n] = scrape(u).get("sglang:num_running_reqs", 0.0)
                result.samples.append(Sample(time.monotonic(), phase_now[0], held, running,
                                             backed))
                time.sleep(0.25)

        sampler = threading.Thread(target=sample, daemon=True)
        sampler.start()
        for i, phase in enumerate(PHASES):
            phase_now[0] = phase
            print(f"[{mode}] {phase_line(phase, s)}", flush=True)
            until = time.monotonic() + s.phase_s
            threads = []
            for n in MODELS:
                workers = s.burst if phase in (n, "both") else s.trickle
                threads += load(urls[n], n, phase, workers, until, s, result.done, i)
            if top:
                time.sleep(s.phase_s / 2)
                show_top(target, phase)
            for t in threads:
                t.join()
        stop.set()
        sampler.join()
        for n, u in urls.items():
            after = scrape(u)
            result.retracted[n] = (after.get("sglang:num_retracted_requests_total", 0.0)
                                   - before[n].get("sglang:num_retracted_requests_total", 0.0))
        for p in client.stats().pools:
            if p.elastic is not None and p.elastic.reclaims:
                result.reclaims += p.elastic.reclaims
                result.reclaim_max = max(result.reclaim_max, p.elastic.reclaim_seconds_max)
                result.reclaim_mean = max(result.reclaim_mean, p.elastic.reclaim_seconds_sum
                                          / p.elastic.reclaims)
    return result


def show_logs(work: Path, lines: int = 30) -> None:
    """The last lines of every engine's and daemon's log (the work directory goes with the
    run): why a mode failed."""
    for log in sorted(work.glob("*.log")):
        tail = log.read_text(errors="replace").splitlines()[-lines:]
        print(f"--- {log.name} (last {len(tail)} lines) ---", *tail, sep="\n", file=sys.stderr)


def pct(xs: list[float], q: float) -> float:
    xs = sorted(x for x in xs if x == x)
    return xs[min(len(xs) - 1, int(q * len(xs)))] if xs else float("nan")


def phase_table(r: ModeRun, s: Settings) -> dict[tuple[str, str], dict[str, float]]:
    out = {}
    for phase in PHASES:
        for n in MODELS:
            done = [d for d in r.done if d.phase == phase and d.engine == n]
            samples = [x for x in r.samples if x.phase == phase]
            # a phase lasts from its first request to its last answer (requests sent before
            # its end are served to the end)
            wall = (max(d.end for d in done) - min(d.start for d in done)) if done else 1.0
            peak = max((x.held[n] for x in samples), default=0)
            # how long the engine took to hold 90% of its phase peak, from the phase's start
            grow = next((x.t - samples[0].t for x in samples if x.held[n] >= 0.9 * peak),
                        float("nan"))
            out[(phase, n)] = {
                "requests": len(done),
                "wall_s": wall,
                "tok_s": sum(d.tokens for d in done) / max(wall, 1e-9),
                "ttft50": pct([d.ttft for d in done], 0.5),
                "ttft99": pct([d.ttft for d in done], 0.99),
                "aborted": sum(d.aborted for d in done),
                "running": max((x.running.get(n, 0.0) for x in samples), default=0.0),
                "held": peak,
                "grow_s": grow,
            }
    return out


def trace_throughput(r: ModeRun) -> float:
    """Tokens generated over the whole trace per second of it (each phase from its first
    request to its last answer, both engines together)."""
    wall = 0.0
    for phase in PHASES:
        done = [d for d in r.done if d.phase == phase]
        if done:
            wall += max(d.end for d in done) - min(d.start for d in done)
    return sum(d.tokens for d in r.done) / wall if wall else 0.0


def plot(runs: list[ModeRun], path: Path) -> None:
    """KV tokens held per engine over time, one panel per mode (Pillow, in the SGLang venv)."""
    series = {r.mode: [(x.t - r.samples[0].t, x.held["a"], x.held["b"]) for x in r.samples]
              for r in runs if r.samples}
    script = r'''
import json, sys
from PIL import Image, ImageDraw
series = json.loads(sys.stdin.read())
W, H, M = 900, 260, 40
img = Image.new("RGB", (W, H * len(series)), "white")
d = ImageDraw.Draw(img)
top = max(max(a, b) for pts in series.values() for _, a, b in pts) or 1
for i, (mode, pts) in enumerate(series.items()):
    y0 = i * H
    t_max = max(t for t, _, _ in pts) or 1
    d.text((M, y0 + 5), f"{mode}: KV tokens held (red: engine a, blue: engine b)", fill="black")
    d.rectangle([M, y0 + 20, W - 10, y0 + H - M], outline="gray")
    for k, color in ((1, "red"), (2, "blue")):
        xy = [(M + (W - M - 10) * p[0] / t_max, y0 + H - M - (H - M - 20) * p[k] / top)
              for p in pts]
        if len(xy) > 1:
            d.line(xy, fill=color, width=2)
    d.text((M, y0 + H - M + 5), f"0 .. {t_max:.0f} s; top = {top:,} tokens", fill="black")
img.save(sys.argv[1])
'''
    subprocess.run([str(VENV / "bin" / "python"), "-c", script, str(path)],
                   input=json.dumps(series), text=True, check=True, env=side_env())


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="small settings (a test's run)")
    ap.add_argument("--modes", default=",".join(MODES), help="comma-separated subset")
    ap.add_argument("--plot", type=Path, help="write the KV-tokens-held PNG here")
    ap.add_argument("--json", type=Path, help="write every figure as JSON here")
    ap.add_argument("--burst", type=int, help="concurrent requests of a bursting engine")
    ap.add_argument("--phase-s", type=float, help="seconds a phase sends requests")
    ap.add_argument("--radix", action="store_true",
                    help="run SGLang with its radix cache (its default; off here otherwise)")
    ap.add_argument("--top", action="store_true",
                    help="print `kvpool top --once` halfway through every phase")
    ap.add_argument("--keep-logs", type=Path,
                    help="copy the daemon's and engines' logs into this directory "
                         "(KVPOOL_BENCH_DAEMON_LOG=info for the daemon's reclaim events)")
    args = ap.parse_args()
    problem = venv_problem(VENV, SGLANG_MARKER, "tests/sglang/setup_venv.sh")
    if problem is not None:
        print(problem, file=sys.stderr)
        return 2
    s = QUICK if args.quick else FULL
    if args.burst is not None:
        s = dataclasses.replace(s, burst=args.burst)
    if args.phase_s is not None:
        s = dataclasses.replace(s, phase_s=args.phase_s)
    if args.radix:
        s = dataclasses.replace(s, radix=True)
    modes = [m for m in args.modes.split(",") if m]
    with tempfile.TemporaryDirectory(prefix="kvp-two-", dir="/dev/shm") as tmp:
        work = Path(tmp)
        models = make_models(work)
        runs = []
        for mode in modes:
            print(f"[{mode}] two engines, {s.phase_s:g} s a phase ...", flush=True)
            try:
                runs.append(run_mode(mode, work, models, s, args.top))
            except BaseException:
                show_logs(work)
                raise
            finally:
                if args.keep_logs:
                    args.keep_logs.mkdir(parents=True, exist_ok=True)
                    for log in work.glob("*.log"):
                        shutil.copy(log, args.keep_logs / log.name)
    tables = {r.mode: phase_table(r, s) for r in runs}
    print(f"\nbudget {s.budget / MiB:.0f} MiB; per request {s.prompt} + {s.new} tokens; "
          f"burst {s.burst}, trickle {s.trickle} concurrent; radix cache "
          f"{'on' if s.radix else 'off'}")
    head = (f"{'mode':<8}{'phase':<6}{'eng':<4}{'reqs':>6}{'tok/s':>8}{'ttft p50':>10}"
            f"{'p99':>8}{'running':>8}{'held tok':>10}{'to 90%':>8}{'aborts':>7}")
    print(head)
    for r in runs:
        for (phase, n), row in tables[r.mode].items():
            print(f"{r.mode:<8}{phase:<6}{n:<4}{row['requests']:>6.0f}{row['tok_s']:>8.0f}"
                  f"{row['ttft50']:>10.3f}{row['ttft99']:>8.3f}{row['running']:>8.0f}"
                  f"{row['held']:>10,.0f}{row['grow_s']:>7.1f}s{row['aborted']:>7.0f}")
        peak = max((x.backed for x in r.samples), default=0)
        print(f"{r.mode:<8}retractions {r.retracted}, reclaims {r.reclaims} (mean "
              f"{r.reclaim_mean * 1e3:.1f} ms, max {r.reclaim_max * 1e3:.1f} ms), peak memory "
              f"{peak / MiB:.1f} of {s.budget / MiB:.0f} MiB"
              f" {'(within budget)' if peak <= s.budget else '(OVER BUDGET)'}")
    print("\n".join(LEGEND))
    print(TTFT_NOTE)
    if "static" in tables:
        base = tables["static"]
        total = {r.mode: trace_throughput(r) for r in runs}
        for m in tables:
            if m == "static":
                continue
            held = [tables[m][(n, n)]["held"] / max(1, base[(n, n)]["held"]) for n in MODELS]
            ratio = total[m] / total["static"]
            aborts = sum(row["aborted"] for row in tables[m].values())
            print(f"{m}: bursting engine holds {min(held):.2f}x / {max(held):.2f}x the KV "
                  f"tokens of static (target >= 1.8x); throughput {ratio:.2f}x static (target "
                  f">= 1.3x); aborts {aborts:.0f} (target 0)")
    if args.plot:
        plot(runs, args.plot)
        print(f"plot: {args.plot}")
    if args.json:
        args.json.write_text(json.dumps({"budget": s.budget,
                                         "static_tokens": pool_tokens(s, False), "modes": {
            r.mode: {"phases": {f"{p}/{n}": row for (p, n), row in tables[r.mode].items()},
                     "peak_backed": max((x.backed for x in r.samples), default=0),
                     "retracted": r.retracted, "reclaims": r.reclaims,
                     "reclaim_max_s": r.reclaim_max, "throughput": trace_throughput(r)}
            for r in runs}}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
