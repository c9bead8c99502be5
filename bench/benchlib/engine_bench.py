"""What the engine benches (``bench/sglang_engine.py``, ``bench/vllm_engine.py``) share: the
trace, the engine child (the script itself in ``engine`` mode under a side venv's Python, in
its own process group, sending events on stdout as ``BENCH {json}`` lines and taking jobs on
stdin, an empty line to shut down), a daemon to serve it, and the per-round figures.

Imported by the engine children too (side venvs): nothing here imports kvpool or numpy at
module level."""

from __future__ import annotations

import contextlib
import json
import os
import queue
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any


class EngineProcess:
    """One engine process; events from its stdout, the engine's log in ``log``.

    Args:
        name: for messages. script: the bench script (run as ``script engine``).
        python: the side venv's interpreter. job: the first line sent (as JSON).
        env: its environment. log: its stderr. cwd: its working directory.
        close_timeout_s: how long :meth:`close` waits after the empty line before it kills
            the process group.
    """

    def __init__(self, name: str, script: Path, python: Path, job: dict[str, Any],
                 env: dict[str, str], log: Path, cwd: Path, close_timeout_s: float) -> None:
        self.name = name
        self.log = log
        self.close_timeout_s = close_timeout_s
        self.events: queue.Queue[dict[str, Any] | None] = queue.Queue()
        with open(log, "wb") as err:
            self.proc = subprocess.Popen(
                [str(python), str(script.resolve()), "engine"],
                stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=err, env=env, cwd=cwd,
                text=True, start_new_session=True)
        threading.Thread(target=self._read, daemon=True).start()
        self.send(json.dumps(job))

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            if line.startswith("BENCH "):
                self.events.put(json.loads(line[len("BENCH "):]))
        self.events.put(None)

    def send(self, line: str) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(line + "\n")
        self.proc.stdin.flush()

    def wait_for(self, event: str, timeout_s: float) -> dict[str, Any]:
        """The next ``event`` (others skipped); RuntimeError with the log's tail when it does
        not come in time or the process exits first."""
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                got = self.events.get(timeout=max(0.01, deadline - time.monotonic()))
            except queue.Empty:
                raise RuntimeError(f"{self.name} engine: no {event!r} in {timeout_s:.0f} s; "
                                   f"its log:\n{self.tail()}") from None
            if got is None:
                raise RuntimeError(f"{self.name} engine exited ({self.proc.wait()}) before "
                                   f"{event!r}; its log:\n{self.tail()}")
            if got["event"] == event:
                return got

    def tail(self, lines: int = 40) -> str:
        text = self.log.read_text(errors="replace") if self.log.exists() else ""
        return "\n".join(text.splitlines()[-lines:])

    def close(self) -> None:
        """Shut the engine down (an empty line), then kill what is left of its group."""
        with contextlib.suppress(OSError, ValueError):
            self.send("")
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(timeout=self.close_timeout_s)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait()


@dataclass(frozen=True)
class RunSettings:
    """The trace and the rounds, in both engine benches (each adds its engine's settings)."""

    requests: int
    rate: float  # arrivals per second (Poisson)
    prompt: tuple[int, int]  # prompt tokens, uniform, shared prefix included
    output: tuple[int, int]  # output tokens, uniform
    shared: float  # share of requests that start with a shared prefix
    prefixes: int
    prefix_len: int
    rounds: int  # pairs of rounds (one each engine) per engine start
    starts: int  # times both engines are started afresh
    seed: int


def make_trace(s: RunSettings, vocab: tuple[int, int]) -> list[dict[str, Any]]:
    """The requests in arrival order: ``at`` (seconds from the round's start), ``input_ids``,
    ``new`` (output tokens), ``prefix`` (the shared prefix it starts with, or -1); token ids
    are drawn from ``vocab``."""
    import numpy as np

    rng = np.random.default_rng(s.seed)
    prefixes = [rng.integers(*vocab, size=s.prefix_len).tolist() for _ in range(s.prefixes)]
    at = np.cumsum(rng.exponential(1.0 / s.rate, size=s.requests))
    at -= at[0]
    out = []
    for i in range(s.requests):
        n = int(rng.integers(s.prompt[0], s.prompt[1] + 1))
        k = int(rng.integers(0, s.prefixes)) if rng.random() < s.shared else -1
        head = prefixes[k][:n] if k >= 0 else []
        ids = head + rng.integers(*vocab, size=n - len(head)).tolist()
        out.append({"at": float(at[i]), "input_ids": ids, "prefix": k,
                    "new": int(rng.integers(s.output[0], s.output[1] + 1))})
    return out


def sglang_side_env(**extra: str) -> dict[str, str]:
    """The environment of a process in SGLang's side venv running tests/sglang's harness with
    kvpool's plugin (the caller's KVPOOL_POOL/KVPOOL_TARGET dropped unless given in ``extra``)."""
    repo = Path(__file__).resolve().parents[2]
    env = {**os.environ,
           "PYTHONPATH": f"{repo / 'tests' / 'sglang' / 'stubs'}:{repo / 'client'}",
           "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false",
           "SGLANG_PLATFORM": "kvpool", "OMP_NUM_THREADS": "1"}
    for name in ("VIRTUAL_ENV", "KVPOOL_POOL", "KVPOOL_TARGET"):
        env.pop(name, None)
    env.update(extra)
    return env


def emit(event: str, **fields: Any) -> None:
    print("BENCH " + json.dumps({"event": event, **fields}), flush=True)


def pct(values: list[float], q: float) -> float:
    import numpy as np

    return float(np.percentile(np.asarray(values, dtype=float), q))


def summarize(results: list[dict[str, Any]], trace: list[dict[str, Any]]) -> dict[str, Any]:
    tokens = sum(r["tokens"] for r in results)
    span = max(r["end_s"] for r in results)  # the first arrival is at 0
    ttft = [r["ttft_s"] for r in results]
    return {"tokens": tokens, "seconds": span, "tokens_per_s": tokens / span,
            "ttft_p50_ms": 1e3 * pct(ttft, 50), "ttft_p99_ms": 1e3 * pct(ttft, 99),
            "cached_tokens": sum(r["cached"] for r in results),
            "complete": all(r["tokens"] == q["new"] for r, q in zip(results, trace,
                                                                     strict=True))}


def proc_cpu_s(pid: int) -> float:
    """CPU seconds (user + system) of process ``pid`` so far, from /proc."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


@contextlib.contextmanager
def serving_daemon(prefix: str) -> Iterator[tuple[str, int]]:
    """A ``kvpoold serve`` on a Unix socket in a fresh directory: (target, pid)."""
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # bench/
    from rpc import start_daemon

    from kvpool import KVPoolClient

    with tempfile.TemporaryDirectory(prefix=prefix, dir="/tmp") as tmp:
        sock = Path(tmp) / "kvpool.sock"
        daemon = start_daemon(sock, "512MiB")
        try:
            with KVPoolClient(f"unix://{sock}") as client:
                client.wait_serving()
            yield f"unix://{sock}", daemon.pid
        finally:
            daemon.terminate()
            daemon.wait(30)


def round_order(pairs: int, variants: tuple[str, str]) -> list[str]:
    """The rounds of one engine start, as ``"round:variant"`` tags: a warm-up round of each,
    then ``pairs`` pairs, the order inside a pair alternating (a, b, b, a, ...), so drift of
    the machine lands on both alike."""
    order = [f"warmup:{v}" for v in variants]
    for k in range(pairs):
        pair = variants if k % 2 == 0 else variants[::-1]
        order += [f"{k}:{v}" for v in pair]
    return order


def measured_rounds(s: RunSettings, variants: tuple[str, str],
                    engines: Callable[[], Any], trace: list[dict[str, Any]], daemon_pid: int,
                    timeout_s: float, between_starts: Callable[[], object] | None = None,
                    ) -> Iterator[tuple[dict[str, Any], dict[str, Any]]]:
    """Every round of the run, in order: ``s.starts`` times, ``between_starts()`` (after the
    first), then both engines started by ``engines()`` (a context manager giving them by
    variant) and their rounds (:func:`round_order`, warm-ups included). Each round replays
    ``trace``; yields the engine's ``round`` event and its row: :func:`summarize`'s figures,
    ``variant``, ``round`` (a pair's index, or ``"warmup"``), ``start`` and the daemon's CPU
    seconds during it (``daemon_cpu_s``)."""
    line = json.dumps({"trace": trace})
    for start in range(s.starts):
        if start and between_starts is not None:
            between_starts()
        if s.starts > 1:
            print(f"engine start {start + 1}/{s.starts}", flush=True)
        with engines() as running:
            for tag in round_order(s.rounds, variants):
                k, variant = tag.split(":")
                before = proc_cpu_s(daemon_pid)
                running[variant].send(line)
                got = running[variant].wait_for("round", timeout_s)
                row = summarize(got["results"], trace)
                row.update(variant=variant, round=k, start=start,
                           daemon_cpu_s=proc_cpu_s(daemon_pid) - before)
                yield got, row


def print_round(row: dict[str, Any], s: RunSettings, cpu: str, cache: str) -> None:
    """One round's line (a warm-up's: its tokens/s only); ``cpu``: the engine's CPU seconds as
    the bench words them, ``cache``: where its prompt tokens came from."""
    if row["round"] == "warmup":
        print(f"warm-up {row['variant']}: {row['tokens_per_s']:,.0f} tokens/s", flush=True)
        return
    print(f"round {int(row['round']) + 1}/{s.rounds} {row['variant']:<8}: "
          f"{row['tokens_per_s']:8,.0f} tokens/s in {row['seconds']:.2f} s, "
          f"TTFT p50 {row['ttft_p50_ms']:7.1f} ms p99 {row['ttft_p99_ms']:7.1f} ms, CPU {cpu}, "
          f"{row['cached_tokens']:,} prompt tokens from the {cache}", flush=True)


def ratio_table(rounds: list[dict[str, Any]], *, subject: str, baseline: str, target: float,
                cols: dict[str, str], ratios: dict[str, tuple[str, bool, bool]], intro: str,
                ratio_intro: str) -> dict[str, Any]:
    """Print the medians per engine (``cols``: round field -> column title; the field
    ``tokens_per_s`` and ``ttft_*_ms`` print as such) and the per-pair ratios; return them.

    ``ratios``: label -> (round field, inverse, judged). Each ratio is subject / baseline per
    pair of rounds (the i-th round of each), or baseline / subject when ``inverse`` (so that
    above 1 is always a cost of the subject); judged ones are held against ``target``."""
    import statistics

    by = {v: [r for r in rounds if r["variant"] == v] for v in (subject, baseline)}
    print(intro)
    print(f"{'engine':<10}" + "".join(f" {title:>12}" for title in cols.values()))
    medians = {v: {c: statistics.median(r[c] for r in by[v]) for c in cols} for v in by}
    for v, m in medians.items():
        cells = "".join(f" {m[c]:12,.0f}" if c == "tokens_per_s" else f" {m[c]:12.2f}"
                        for c in cols)
        print(f"{v:<10}{cells}")
    pairs = list(zip(by[subject], by[baseline], strict=True))
    print(ratio_intro)
    out: dict[str, Any] = {"medians": medians, "ratios": {}}
    width = max(len(label) for label in ratios)
    for label, (field, inverse, judged) in ratios.items():
        values = [(b[field] / s[field]) if inverse else (s[field] / b[field]) for s, b in pairs]
        v = statistics.median(values)
        verdict = ("met" if v <= target else "MISSED") if judged else "(info)"
        print(f"{label:<{width}} {v:6.3f}x  [{min(values):.3f} .. {max(values):.3f}]  target "
              f"<= {target}x {verdict}")
        out["ratios"][label] = {"median": v, "min": min(values), "max": max(values),
                                "values": values}
    starts = sorted({r.get("start", 0) for r in rounds})
    if len(starts) > 1:
        # A process's speed is drawn when it starts (the same engine, started again, ran a
        # round in 1.4 or 1.9 CPU seconds here): the medians per start show that draw.
        label, (field, inverse, _) = next(iter(ratios.items()))
        per_start = []
        for start in starts:
            values = [(b[field] / s[field]) if inverse else (s[field] / b[field])
                      for s, b in pairs if s.get("start", 0) == start]
            per_start.append(statistics.median(values))
        print(f"{label}, median per engine start: "
              + ", ".join(f"{v:.3f}x" for v in per_start))
        out["per_start"] = {label: per_start}
    return out


def bench_parser(description: str, quick: dict[str, Any]) -> Any:
    """The engine benches' shared command line: the trace and the rounds (the settings a flag
    leaves unset come from ``--quick`` or the full settings: :func:`settings_from`)."""
    import argparse

    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--quick", action="store_true",
                        help=f"{quick['requests']} requests, {quick['rounds']} pairs of rounds, "
                        f"{quick['starts']} engine start")
    parser.add_argument("--rounds", type=int,
                        help="pairs of rounds (one each engine) per engine start")
    parser.add_argument("--starts", type=int,
                        help="times both engines start afresh (a process's speed is drawn at "
                        "its start)")
    parser.add_argument("--requests", type=int)
    parser.add_argument("--rate", type=float, help="arrivals per second")
    parser.add_argument("--shared", type=float, help="share of requests with a shared prefix")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", type=Path, help="write the figures there")
    return parser


def settings_from(args: Any, quick: dict[str, Any], full: dict[str, Any]) -> dict[str, Any]:
    """``--quick``'s or the full settings, with every flag given on top (the parser's dests
    that name a setting), and the seed."""
    base = dict(quick if args.quick else full)
    for name in base:
        if getattr(args, name, None) is not None:
            base[name] = getattr(args, name)
    base["seed"] = args.seed
    return base
