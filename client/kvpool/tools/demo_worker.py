"""The two worker processes of ``kvpool demo``: a writer that fills KV pages, a reader that checks.

Run as ``python -m kvpool.tools.demo_worker writer|reader`` by the demo (``kvpool.tools.demo``).
Each imports torch and the client first, says ``{"ready": ROLE}``, then waits for its go message on
stdin (target, pool, fingerprint, pages, token) and reports one JSON line per step on stdout.
The byte pattern and the checks live here so the e2e tests use the same ones.
"""

from __future__ import annotations

import json
import sys
from typing import TYPE_CHECKING, Any

from kvpool.contract.errors import KVPoolError

if TYPE_CHECKING:
    import torch

    from kvpool.mapping.regions import MappedRegion

KV_KINDS = ("kv",)  # token-major K/V rows addressed by KV page id


class DemoFailed(Exception):
    """A step of the demo went wrong; the message says which and why."""


# -- the byte pattern both workers agree on ----------------------------------------------------

def pattern(buffer_index: int, page_id: int, nbytes: int, device: Any = "cpu") -> torch.Tensor:
    """The bytes the writer puts in page ``page_id`` of buffer number ``buffer_index``.

    Never zero (``1..251``), and different for each buffer and page, so a page written to the
    wrong place or left untouched is caught.
    """
    import torch

    seed = (buffer_index * 7919 + page_id * 104729) % 251
    idx = torch.arange(nbytes, dtype=torch.int64, device=device)
    return ((idx * 31 + seed) % 251 + 1).to(torch.uint8)


def kv_buffers(region: MappedRegion) -> list[str]:
    """The K/V buffers of every layer (kind ``kv``), in plan order."""
    return [b.name for b in region.plan.buffers if str(b.kind) in KV_KINDS]


def page_bytes_of(region: MappedRegion, name: str, page_id: int) -> torch.Tensor:
    """One page of buffer ``name`` as flat bytes (a view of the shared memory)."""
    import torch

    return region.page(name, page_id).view(torch.uint8).reshape(-1)


# -- the processes ---------------------------------------------------------------------------

def check_zero_outside(region: MappedRegion, name: str, pages: list[int]) -> int:
    """Check every row of buffer ``name`` outside ``pages`` is zero; returns the bytes checked.

    Raises:
        DemoFailed: a row outside the written pages holds a non-zero byte.
    """
    import torch

    view = region[name]
    num_rows, per_page = view.shape[0], region.layout[name].rows_per_page
    rows = view.view(torch.uint8).reshape(num_rows, -1)
    if rows.shape[1] % 8 == 0 and rows.storage_offset() % 8 == 0:
        rows = rows.view(torch.int64)  # reductions over uint8 are ~8x slower on CPU
    nonzero = rows.ne(0).any(dim=1)
    written = torch.zeros(num_rows, dtype=torch.bool, device=view.device)
    for p in pages:
        written[p * per_page:(p + 1) * per_page] = True
    stray = nonzero & ~written
    if bool(stray.any()):
        row = int(torch.nonzero(stray)[0])
        raise DemoFailed(f"{name}: row {row} (page {row // per_page}) was never written but "
                         "is not zero")
    return int((~written).sum()) * (view.numel() * view.element_size() // max(num_rows, 1))


def _send(obj: object) -> None:
    print(json.dumps(obj), flush=True)


def _recv() -> Any:
    line = sys.stdin.readline()
    if not line:
        raise SystemExit(0)  # the parent went away
    return json.loads(line)


def _write(go: dict[str, Any]) -> None:
    from kvpool.clients.client import KVPoolClient

    pool, fingerprint = go["pool"], go["fingerprint"]
    with KVPoolClient(go["target"], token=go.get("token")) as client, \
            client.lease("demo-writer", ttl_s=10.0) as lease:
        pages = [int(p) for p in lease.allocate(pool, "kv", go["pages"])]
        with client.attach(pool, expected_fingerprint=fingerprint, lease=lease) as region:
            names = kv_buffers(region)
            written = 0
            for i, name in enumerate(names):
                for p in pages:
                    dst = page_bytes_of(region, name, p)
                    dst.copy_(pattern(i, p, dst.numel(), dst.device))
                    written += dst.numel()
            if region.device.type == "cuda":
                import torch

                torch.cuda.synchronize(region.device)
            _send({"pages": pages, "buffers": len(names), "bytes": written,
                   "path": region.path, "sharing": region.sharing, "lease_id": lease.lease_id})
            _recv()  # "done": the reader has checked, Stats are printed
        freed = lease.free(pool, "kv", pages)
    _send({"freed": freed})


def _read(go: dict[str, Any]) -> None:
    import torch

    from kvpool.clients.client import KVPoolClient

    pages = [int(p) for p in go["pages"]]
    with KVPoolClient(go["target"], token=go.get("token")) as client, \
            client.attach(go["pool"], expected_fingerprint=go["fingerprint"]) as region:
        names = kv_buffers(region)
        verified = zeros = 0
        for i, name in enumerate(names):
            for p in pages:
                got = page_bytes_of(region, name, p)
                want = pattern(i, p, got.numel(), got.device)
                if not torch.equal(got, want):
                    bad = int(torch.nonzero(got != want)[0])
                    raise DemoFailed(f"{name} page {p} byte {bad}: read {int(got[bad])}, the "
                                     f"writer wrote {int(want[bad])}")
                verified += got.numel()
            zeros += check_zero_outside(region, name, pages)
        _send({"verified": verified, "zeros": zeros, "buffers": len(names),
               "attach_id": region.attach_id})
        _recv()  # "done"
    _send({"detached": True})


def worker_main(role: str) -> int:
    """Entry of a worker process: warm up, say ready, wait for the go message, do the part."""
    import torch  # noqa: F401  (imported now, while the daemon starts)

    import kvpool.clients.client  # noqa: F401

    _send({"ready": role})
    go = _recv()
    try:
        (_write if role == "writer" else _read)(go)
    except (KVPoolError, DemoFailed) as exc:
        _send({"error": f"{type(exc).__name__}: {exc}"})
        return 1
    return 0


def main(argv: list[str] | None = None) -> int:
    """``python -m kvpool.tools.demo_worker writer|reader``."""
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 1 or argv[0] not in ("writer", "reader"):
        print("usage: python -m kvpool.tools.demo_worker writer|reader (run `kvpool demo` instead)",
              file=sys.stderr)
        return 2
    return worker_main(argv[0])


if __name__ == "__main__":
    sys.exit(main())
