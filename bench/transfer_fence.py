"""The fence under a frozen sender: 5 runs at 64, 256 and 512 pages (issue 39's acceptance).

Each run is ``tests/transfer/fence_scenario.py``: two real daemons, the prefill daemon
SIGSTOPped once the decode daemon accepted its send, every deadline passed, the grant's pages
re-handed to victim leases, then the sender resumed (``cont``) or SIGKILLed (``kill``). Prints
one line per run and the totals: bytes of the sender found in victims' pages (must be 0), how
much of the write had landed when the sender was stopped (mid-write runs), and how long after
the sender's completion / death the fence was released (from Stats, polled every 5 ms).

Run from the repository root (needs ``kvpool[nixl]``)::

    .venv/bin/python bench/transfer_fence.py [--runs 5] [--kill-runs 1]
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
for path in (ROOT, ROOT / "service", ROOT / "client"):  # this checkout's, not an install
    sys.path.insert(0, str(path))

from kvpoold.transfer import nixl_installed  # noqa: E402
from tests.transfer.fence_scenario import PAGE_BYTES, frozen_sender  # noqa: E402

SIZES = (64, 256, 512)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=5, help="SIGCONT runs per size")
    parser.add_argument("--kill-runs", type=int, default=1, help="SIGKILL runs per size")
    args = parser.parse_args()
    if not nixl_installed():
        print("bench/transfer_fence.py: skipped, NIXL is not installed (pip install "
              "'kvpool[nixl]')")
        return 0
    runs = []
    for end, count in (("cont", args.runs), ("kill", args.kill_runs)):
        for pages in SIZES:
            for i in range(count):
                run = frozen_sender(pages, end)
                runs.append(run)
                print(f"{end:4} {pages:3} pages run {i + 1}: landed at stop "
                      f"{run.landed_at_stop / (pages * PAGE_BYTES):6.1%}, fenced "
                      f"{run.fenced:3} pages, sender bytes in victims "
                      f"{run.sender_bytes_in_victims}, fence released "
                      f"{run.release_s * 1e3:7.1f} ms after the sender "
                      f"{'completed' if end == 'cont' else 'was killed'}; send: "
                      f"{run.send_outcome[:60]}", flush=True)
    bad = sum(r.sender_bytes_in_victims for r in runs)
    mid = sum(1 for r in runs if 0 < r.landed_at_stop < r.pages * PAGE_BYTES)
    fenced = sum(1 for r in runs if r.fenced)
    for end in ("cont", "kill"):
        times = [r.release_s for r in runs if r.end == end]
        if times:
            print(f"{end}: {len(times)} runs, fence released after median "
                  f"{statistics.median(times) * 1e3:.1f} ms, max {max(times) * 1e3:.1f} ms")
    print(f"{len(runs)} runs ({fenced} fenced while stopped, {mid} stopped mid-write): "
          f"{bad} bytes of the sender in other leases' pages")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
