"""The latency probe both hostile-load benches run (``bench/lease_expiry.py``,
``bench/hostile_free.py``): a child process that pairs Allocate + Free on its own lease at a steady
rate, each pair its own task, and answers the figures of the pairs started in a window it is asked
about. Run as a script by :func:`start_probe`; ``bench/`` scripts import it as ``benchlib``."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np

REPO = Path(__file__).resolve().parents[2]


def run_probe(target: str, pool: str, rate: float, pages: int) -> None:
    """Allocate(``pages``) + Free in ``pool`` every ``1/rate`` s until stdin closes; a line
    ``<t0> <t1>`` answers the figures of the Allocates started between those
    ``time.monotonic`` instants."""
    asyncio.run(_probe(target, pool, rate, pages))


async def _probe(target: str, pool: str, rate: float, pages: int) -> None:
    from kvpool.clients.aio import AsyncKVPoolClient

    loop = asyncio.get_running_loop()
    asks: asyncio.Queue[str | None] = asyncio.Queue()

    def read_stdin() -> None:
        for line in sys.stdin:
            loop.call_soon_threadsafe(asks.put_nowait, line)
        loop.call_soon_threadsafe(asks.put_nowait, None)

    samples: list[tuple[float, float]] = []  # (started, Allocate seconds)
    errors: list[tuple[float, str]] = []
    tasks: set[asyncio.Task[None]] = set()
    async with AsyncKVPoolClient(target, timeout_s=120) as client:
        lease = await client.lease("probe", ttl_s=60)

        async def pair() -> None:
            started = time.monotonic()
            try:
                ids = await lease.allocate(pool, "kv", pages)
                samples.append((started, time.monotonic() - started))
                await lease.free(pool, "kv", ids)
            except Exception as exc:  # every failure is reported, none stops the probe
                errors.append((started, repr(exc)[:200]))

        async def send() -> None:
            due = time.monotonic()
            while True:
                task = asyncio.create_task(pair())
                tasks.add(task)
                task.add_done_callback(tasks.discard)
                due += 1.0 / rate
                await asyncio.sleep(max(0.0, due - time.monotonic()))

        sender = asyncio.create_task(send())
        threading.Thread(target=read_stdin, daemon=True).start()
        print(json.dumps({"ready": True}), flush=True)
        while (line := await asks.get()) is not None:
            t0, t1 = (float(x) for x in line.split())
            if tasks:  # asked after t1: the pairs in flight include all started by then
                await asyncio.wait(set(tasks), timeout=60.0)
            window = [d for s, d in samples if t0 <= s <= t1]
            failed = [e for s, e in errors if t0 <= s <= t1]
            samples[:] = [x for x in samples if x[0] > t1]
            errors[:] = [x for x in errors if x[0] > t1]
            print(json.dumps(figures(window, failed)), flush=True)
        sender.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await lease.close()


def figures(seconds: list[float], errors: list[str]) -> dict[str, Any]:
    """Calls, p50/p99/max in ms, and the first failures."""
    arr = np.asarray(seconds or [0.0]) * 1e3
    return {"calls": len(seconds), "errors": errors[:5], "failed": len(errors),
            "p50_ms": float(np.percentile(arr, 50)), "p99_ms": float(np.percentile(arr, 99)),
            "max_ms": float(arr.max())}


def start_probe(target: str, pool: str, rate: float, pages: int) -> subprocess.Popen[str]:
    """The probe child, its lease open and its calls running."""
    proc = subprocess.Popen(
        [sys.executable, __file__, target, pool, str(rate), str(pages)],
        env={**os.environ, "PYTHONPATH": f"{REPO / 'client'}:{REPO / 'service'}"},
        cwd=REPO, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    assert json.loads(proc.stdout.readline()) == {"ready": True}
    return proc


def probe_window(probe: subprocess.Popen[str], t0: float, t1: float) -> dict[str, Any]:
    """The probe's figures for the Allocates it started between ``t0`` and ``t1``, asked once
    ``t1`` has passed."""
    time.sleep(max(0.0, t1 - time.monotonic()))
    assert probe.stdin is not None and probe.stdout is not None
    probe.stdin.write(f"{t0} {t1}\n")
    probe.stdin.flush()
    return json.loads(probe.stdout.readline())


if __name__ == "__main__":
    run_probe(sys.argv[1], sys.argv[2], float(sys.argv[3]), int(sys.argv[4]))
