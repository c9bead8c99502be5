"""A frozen sender (SIGSTOP mid-write) past every deadline, its pages re-handed on the receiver:
the scenario ``test_fence.py`` runs once per case and ``bench/transfer_fence.py`` 5 x 3 times.

Two real daemons (UCX over this machine: CMA for the bytes). The prefill lease fills its pages
0xAA; the decode lease grants ``n`` pages with a 2 s TTL; the send runs in a thread, and the
prefill daemon is stopped as soon as the first of its bytes shows in the granted pages (read
through the decode pool's mapping): mid-write whenever the write takes longer than that look.
Past the write deadline the grant ends failed, the decode lease closes (its pages quarantined,
fenced for the sender), and a victim lease takes every free page and fills it 0x55. Then the
sender is resumed (``cont``) or killed (``kill``); the fence's release is waited for as a fact
(Stats: no fenced page left), a second victim takes the released pages and fills them 0x55,
and every victim page is read back: a byte 0xAA in one is a byte of the sender in another
lease's pages.
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np

from kvpool import Aborted, KVPoolClient
from kvpool.contract.errors import KVPoolError
from tests.conftest import DaemonProcess, run_daemon, temp_dir

SPEC: dict[str, Any] = {"num_layers": 8, "context_length": 4096,
                        "attention": {"type": "mha", "num_kv_heads": 8, "head_dim": 128}}
PAGE_BYTES = 512 << 10  # 16 tokens x 8 heads x 128 x fp16, K and V of 8 layers
POOL = "fence"
SENDER_BYTE, VICTIM_BYTE = 0xAA, 0x55


def options(pages: int) -> dict[str, Any]:
    return {"budget_bytes": pages * PAGE_BYTES + (8 << 20), "page_size": 16,
            "max_running_requests": 8}


@dataclass
class Pair:
    prefill: DaemonProcess
    decode: DaemonProcess
    p: KVPoolClient
    d: KVPoolClient


@contextlib.contextmanager
def pair(pages: int) -> Iterator[Pair]:
    """A prefill daemon whose pool holds ``pages`` pages and a decode daemon with room for
    them twice over (the grant's and a victim's)."""
    budget = f"{(3 * pages * PAGE_BYTES >> 20) + 64}MiB"
    with temp_dir() as d1, temp_dir() as d2, run_daemon(d1, budget=budget) as prefill, \
            run_daemon(d2, budget=budget) as decode, KVPoolClient(prefill.target) as p, \
            KVPoolClient(decode.target) as d:
        try:
            p.configure(POOL, spec=SPEC, **options(pages))
            d.configure(POOL, spec=SPEC, **options(2 * pages))
            yield Pair(prefill, decode, p, d)
        finally:  # a stopped daemon handles no SIGTERM
            with contextlib.suppress(ProcessLookupError):
                os.kill(prefill.proc.pid, signal.SIGCONT)


def unit_bytes(region: Any, pages: np.ndarray) -> list[Any]:
    """Per kv buffer, a uint8 [len(pages), bytes per page] view-gather of ``pages``."""
    import torch

    out = []
    idx = torch.from_numpy(pages.astype(np.int64))
    for name, view in region.views.items():
        if name not in {b.name for b in region.plan.buffers if b.id_space == "kv"}:
            continue
        units = view.shape[0] // region.page_size
        out.append((view.reshape(-1).view(torch.uint8).reshape(units, -1), idx))
    return out


def fill(region: Any, pages: np.ndarray, value: int) -> None:
    for table, idx in unit_bytes(region, pages):
        table[idx] = value


def count(region: Any, pages: np.ndarray, value: int) -> int:
    return sum(int((table[idx] == value).sum()) for table, idx in unit_bytes(region, pages))


def wait_for(what: str, fact: Callable[[], bool], timeout_s: float = 60.0) -> float:
    """Poll ``fact`` every 5 ms until it holds; the seconds it took. Raises AssertionError
    after ``timeout_s`` (a hang, not a timing claim)."""
    start = time.monotonic()
    while not fact():
        if time.monotonic() - start > timeout_s:
            raise AssertionError(f"{what}: not after {timeout_s} s")
        time.sleep(0.005)
    return time.monotonic() - start


def fenced_pages(d: KVPoolClient) -> int:
    return sum(p.fenced_pages for p in d.stats().peers)


@dataclass
class Run:
    pages: int
    end: str
    landed_at_stop: int  # sender bytes already in the granted pages when it was stopped
    fenced: int  # pages fenced while it was stopped
    sender_bytes_in_victims: int
    release_s: float  # from SIGCONT + the sender's completion (cont) or SIGKILL to no fence
    send_outcome: str


def frozen_sender(pages: int, end: str) -> Run:
    """One run (``end``: ``cont`` or ``kill``); see the module docstring."""
    assert end in ("cont", "kill")
    with pair(pages) as pr:
        pl, dl = pr.p.lease("prefill", ttl_s=600), pr.d.lease("decode", ttl_s=600)
        src = pl.allocate(POOL, "kv", pages)
        dst = dl.allocate(POOL, "kv", pages)
        with pr.p.attach(POOL) as sregion:
            fill(sregion, src, SENDER_BYTE)
        # 2 s: room for the sender's PeerReceive on a loaded 2-core machine; the write deadline
        # it gets is as long (the floor is 1 s), and the run stops it far past it.
        grant = dl.grant_receive(POOL, dst, ttl_s=2.0)
        outcome: list[str] = []

        def send() -> None:
            try:
                h = pr.p.send(POOL, src, peer=pr.decode.target, token=grant.token, lease=pl)
                outcome.append(h.wait(120).state.value)
            except (KVPoolError, Aborted) as exc:
                outcome.append(f"{type(exc).__name__}: {exc}")

        with pr.d.attach(POOL) as region:
            first = unit_bytes(region, dst[:1])[0][0][int(dst[0])]
            thread = threading.Thread(target=send)
            thread.start()
            start = time.monotonic()
            while int(first[0]) != SENDER_BYTE and thread.is_alive() \
                    and time.monotonic() - start < 60:
                pass  # no sleep: stop the sender the moment its write shows
            if int(first[0]) != SENDER_BYTE:
                raise AssertionError(f"the send never wrote: {outcome}")
            os.kill(pr.prefill.proc.pid, signal.SIGSTOP)
            landed = count(region, dst, SENDER_BYTE)
            # Past every deadline: the grant's record ends failed; its pages stay fenced.
            try:
                grant.wait(60)
            except Aborted:
                pass
            dl.close()  # the grant's pages: quarantined, fenced for the sender
            fenced = fenced_pages(pr.d)
            victim = pr.d.lease("victim", ttl_s=600)
            free = victim.allocate(POOL, "kv", pr.d.stats(POOL).pools[0].spaces["kv"].free)
            fill(region, free, VICTIM_BYTE)
            if end == "cont":
                os.kill(pr.prefill.proc.pid, signal.SIGCONT)
                thread.join(120)  # the sender completed (its Send and wait answered)
            else:
                pr.prefill.stop(signal.SIGKILL)
            release_s = wait_for("the fence released", lambda: fenced_pages(pr.d) == 0)
            late = pr.d.lease("late-victim", ttl_s=600)
            released = late.allocate(POOL, "kv", pages)
            fill(region, released, VICTIM_BYTE)
            if end == "cont":  # anything of the sender still due has had its chance
                time.sleep(0.2)
            in_victims = (count(region, free, SENDER_BYTE)
                          + count(region, released, SENDER_BYTE))
            victim.close()
            late.close()
        thread.join(120)
        with contextlib.suppress(KVPoolError):
            pl.close()
        return Run(pages, end, landed, fenced, in_victims, release_s,
                   outcome[0] if outcome else "killed")
