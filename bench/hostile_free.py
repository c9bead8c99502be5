"""Benchmark: an innocent client's Allocate while a hostile client sends 60 MB Frees (issue 39).

A Free carries its ids as int32 bytes, so one message may be as large as the server accepts
(64 MiB). Issue 39 measured 10 refused 60 MB Frees stalling the daemon's loop 6.3 s in all (an
innocent Allocate up to 1.75 s): each was parsed and checked on the loop before its refusal.
This measures what they cost an innocent client now:

1. A ``kvpoold serve`` child on a temporary Unix socket, one pool of 1 KiB pages
   (``--pages`` kv pages).
2. The probe, a child process with its own lease: an Allocate of 4 pages every ``1/--rate`` s,
   each in its own task, then a Free of them (open loop: a stall shows in every call it holds
   up). Each Allocate is timed alone.
3. Baseline: the probe over ``--window-s`` with nothing else going on.
4. Hostile: this process opens its own lease and sends ``--frees`` Frees of ``--mb`` MB each
   (ids 1..pages over and over: in range, not held), one after the other on one channel; the
   probe's window spans them. Then as many Frees just under the daemon's gRPC receive limit
   (``MAX_REQUEST_MESSAGE_BYTES``): the largest that reach its intake. The refusals' codes,
   first words and round trips are printed.
5. Again the baseline's window.
6. Per window: the probe's Allocate p50/p99/max, their ratio to the baseline's (this run), and
   how long the daemon's loop stalled meanwhile (its own counter); then the target per hostile
   window: no innocent Allocate over 100 ms.

Runs against whichever daemon the checkout has (run it on an older commit for the figures
before a change).

Run from the repository root:

    PYTHONPATH=client:service python bench/hostile_free.py [--frees 10] [--mb 60] [--quick]
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time
from typing import Any

import grpc
import numpy as np
from benchlib.alloc_probe import probe_window, start_probe  # bench/ is the script's directory
from benchlib.probe_table import print_probe_table
from rpc import serving_daemon

from kvpool import KVPoolClient
from kvpool.contract.limits import MAX_REQUEST_MESSAGE_BYTES
from kvpool.v1 import kvpool_pb2 as pb

POOL = "hostile"
# 2 layers, 2 KV heads of 16, page 16: 1 KiB per page.
SPEC = {"num_layers": 2, "attention": {"type": "mha", "num_kv_heads": 2, "head_dim": 16},
        "context_length": 1024}
TARGET_MAX_MS = 100.0
PROBE_PAGES = 4
QUICK = {"frees": 3, "mb": 60, "window_s": 1.0}
FULL = {"frees": 10, "mb": 60, "window_s": 3.0}


# -- the hostile client (this process) ---------------------------------------------------------

def hostile_request(lease_id: int, secret: bytes, pages: int, nbytes: float) -> bytes:
    """A serialized Free of ``nbytes`` of ids 1..pages over and over (in range, not held)."""
    n = int(nbytes) // 4
    ids = (np.arange(n, dtype="<i4") % pages + 1).astype("<i4")
    return pb.FreeRequest(pool=POOL, lease_id=lease_id, lease_secret=secret,
                          items=[pb.IdList(space="kv", ids=ids.tobytes())]).SerializeToString()


def send_hostile(client: KVPoolClient, data: bytes, frees: int) -> list[tuple[str, str, float]]:
    """Send ``data`` as a Free ``frees`` times; (code, details' first words, seconds) each."""
    free = client._channel.unary_unary("/kvpool.v1.KVPool/Free", request_serializer=None,
                                       response_deserializer=None)
    out = []
    for _ in range(frees):
        started = time.monotonic()
        try:
            free(data, timeout=120)
            out.append(("OK", "", time.monotonic() - started))
        except grpc.RpcError as exc:
            out.append((exc.code().name, (exc.details() or "")[:90],
                        time.monotonic() - started))
    return out


def loop_stalled(target: str) -> float:
    with KVPoolClient(target, timeout_s=120) as client:
        return client.stats(POOL).daemon.loop_stalled_seconds


def measured(target: str, probe: subprocess.Popen[str], name: str,
             window_s: float) -> dict[str, Any]:
    stalled = loop_stalled(target)
    t0 = time.monotonic()
    figures_ = probe_window(probe, t0, t0 + window_s)
    return {"name": name, "probe": figures_, "stalled_s": loop_stalled(target) - stalled}


def hostile_window(target: str, probe: subprocess.Popen[str], client: KVPoolClient,
                   data: bytes, frees: int, name: str) -> tuple[dict[str, Any], list[Any]]:
    """The probe's figures while ``frees`` copies of ``data`` are sent as Frees, and the
    answers."""
    stalled = loop_stalled(target)
    t0 = time.monotonic()
    answers = send_hostile(client, data, frees)
    figures_ = probe_window(probe, t0, time.monotonic() + 0.2)
    return ({"name": name, "probe": figures_, "stalled_s": loop_stalled(target) - stalled},
            answers)


def run(frees: int, mb: int, pages: int, window_s: float, rate: float) -> None:
    # The largest Free that reaches the daemon's intake: just under gRPC's receive limit.
    under = (MAX_REQUEST_MESSAGE_BYTES - (1 << 10)) / 1e6
    with (serving_daemon("kvp-hf-", "512MiB", ["--sharing", "none"], log_file=True) as target,
          KVPoolClient(target, timeout_s=120) as client):
        client.configure(POOL, spec=SPEC, max_total_tokens=pages * 16, page_size=16,
                         max_running_requests=64)
        hostile = client.lease("hostile", ttl_s=600)
        sizes = {f"{frees} x {mb} MB Frees": mb * 1e6,
                 f"{frees} x {under:.1f} MB Frees": under * 1e6}
        probe = start_probe(target, POOL, rate, PROBE_PAGES)
        rows: list[dict[str, Any]] = []
        answers: dict[str, list[Any]] = {}
        try:
            time.sleep(0.5)  # the probe warms up
            rows.append(measured(target, probe, "no hostile client (baseline)", window_s))
            for name, nbytes in sizes.items():
                data = hostile_request(hostile.lease_id, hostile.secret, pages, nbytes)
                row, answers[name] = hostile_window(target, probe, client, data, frees, name)
                rows.append(row)
                del data
            rows.append(measured(target, probe, "no hostile client (again)", window_s))
        finally:
            if probe.stdin is not None:
                probe.stdin.close()
            probe.wait(60)
            hostile.close()
    print(f"pool: {pages:,} kv pages of 1 KiB; the daemon's gRPC receive limit: "
          f"{MAX_REQUEST_MESSAGE_BYTES:,} B; probe: Allocate({PROBE_PAGES}) + Free {rate:g} "
          "times a second")
    for name, got in answers.items():
        codes = sorted({code for code, _, _ in got})
        took = [t * 1e3 for _, _, t in got]
        print(f"  {name}: {', '.join(codes)}, client round trip {min(took):.0f}.."
              f"{max(took):.0f} ms (sending included): {got[0][1]}")
    print_probe_table(rows, "window", width=30)
    base = rows[0]["probe"]["max_ms"]
    for row in rows[1:-1]:
        worst = row["probe"]["max_ms"]
        verdict = "met" if worst <= TARGET_MAX_MS else "missed"
        print(f"target: no innocent Allocate over {TARGET_MAX_MS:g} ms during {row['name']}: "
              f"{verdict} (max {worst:.1f} ms = {worst / base:.1f}x the baseline's max "
              f"{base:.1f} ms)")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true",
                        help=f"small settings for a smoke run: {QUICK}")
    parser.add_argument("--frees", type=int, help=f"hostile Frees (default {FULL['frees']})")
    parser.add_argument("--mb", type=int, help=f"MB each carries (default {FULL['mb']})")
    parser.add_argument("--pages", type=int, default=16384, help="kv pages of the pool")
    parser.add_argument("--window-s", type=float,
                        help=f"baseline windows (default {FULL['window_s']} s)")
    parser.add_argument("--rate", type=float, default=200.0,
                        help="probe Allocates a second (open loop)")
    args = parser.parse_args()
    chosen = QUICK if args.quick else FULL
    run(args.frees or chosen["frees"], args.mb or chosen["mb"], args.pages,
        args.window_s or chosen["window_s"], args.rate)
    return 0


if __name__ == "__main__":
    sys.exit(main())
