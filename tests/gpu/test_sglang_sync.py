"""Host-device synchronizations of kvpool's SGLang allocator against SGLang 0.5.23's own
``PagedTokenToKVPoolAllocator`` on CUDA (issue 25, item 7; needs a GPU and SGLang).

Both allocators get the same calls, shaped like a scheduler's steps (page size 16): a prefill
batch of three (``alloc_extend``), a decode step of every running request (``alloc_decode``), a
finished request's row in a free group (``free_segment``, as ``free_kv_row`` does), an eviction
outside a group (``free_segment``), page ids (``free_page_ids``), whole pages (``alloc``), a
token free (``free``, alone and in a group). Each call runs under
``torch.cuda.set_sync_debug_mode("warn")`` and the warnings it raises are counted per call
kind; kvpool's count must not pass SGLang's for any kind (SGLang synchronizes in ``free``'s
``torch.unique`` only). A second count, over the whole sequence, takes the CUDA runtime's
``cuda*Synchronize`` calls from ``torch.profiler`` (which also sees an event's wait, which the
debug mode does not flag). Then the deferred frees come back: after the stream is done and one
more allocation, the page cache's count of pages in use is the allocator's.

Skipped without CUDA, and without SGLang importable in this python (a GPU machine's own SGLang,
or ``pip install --no-deps sglang==0.5.23`` with its imports; see tests/gpu/README.md).
"""

from __future__ import annotations

import contextlib
import warnings
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from kvpool.clients.client import KVPoolClient
from tests.conftest import run_daemon, temp_dir

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

PS = 16
POOL = "sync"
QUOTA_PAGES = 4096
SPEC = {"num_layers": 1, "attention": {"type": "mha", "num_kv_heads": 1, "head_dim": 1},
        "context_length": 4096}
PROMPTS = (37, 70, 16, 5, 129, 48)  # prefill lengths, taken in turn
STEPS = 24
DEVICE = "cuda"
SYNC_CALLS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize")


def allocator_classes() -> tuple[Any, Any]:
    """(SGLang's PagedTokenToKVPoolAllocator, kvpool's PagedAllocator), or skip."""
    try:
        from sglang.srt.mem_cache.allocator.paged import PagedTokenToKVPoolAllocator

        from kvpool.integrations.sglang.allocator import PagedAllocator
    except Exception as exc:  # SGLang missing, or one of its imports
        pytest.skip(f"SGLang 0.5.23 is not importable here ({type(exc).__name__}: {exc})")
    return PagedTokenToKVPoolAllocator, PagedAllocator


class Syncs:
    """Synchronizations per call kind, as the sync debug mode reports them."""

    def __init__(self) -> None:
        self.counts: Counter[str] = Counter()

    @contextlib.contextmanager
    def call(self, kind: str) -> Iterator[None]:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")
            try:
                yield
            finally:
                torch.cuda.set_sync_debug_mode("default")
        self.counts[kind] += sum("synchroniz" in str(w.message) for w in caught)
        self.counts.setdefault(kind, 0)


class Scheduler:
    """The simulated scheduler of one allocator: requests' rows of token indices on the GPU
    and their lengths; every decision comes from the lengths (host), so both allocators get
    the same calls whatever ids they hand out."""

    def __init__(self, alloc: Any, syncs: Syncs) -> None:
        self.a = alloc
        self.syncs = syncs
        self.rows: dict[int, torch.Tensor] = {}
        self.lens: dict[int, int] = {}
        self.next = 0

    def device(self, values: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        cpu = torch.tensor(values, dtype=torch.int64)
        return cpu.to(DEVICE), cpu

    def prefill(self, prompts: list[int]) -> None:
        prefix, prefix_cpu = self.device([0] * len(prompts))
        seq, seq_cpu = self.device(prompts)
        last = torch.full((len(prompts),), -1, dtype=torch.int64, device=DEVICE)
        with self.syncs.call("alloc_extend"):
            out = self.a.alloc_extend(prefix, prefix_cpu, seq, seq_cpu, last, sum(prompts))
        assert out is not None
        lo = 0
        for n in prompts:
            self.rows[self.next] = out[lo:lo + n]
            self.lens[self.next] = n
            self.next += 1
            lo += n

    def decode(self) -> None:
        rids = list(self.rows)
        last = torch.cat([self.rows[r][-1:] for r in rids])
        seq, seq_cpu = self.device([self.lens[r] + 1 for r in rids])
        with self.syncs.call("alloc_decode"):
            out = self.a.alloc_decode(seq, seq_cpu, last)
        assert out is not None
        for i, r in enumerate(rids):
            self.rows[r] = torch.cat((self.rows[r], out[i:i + 1]))
            self.lens[r] += 1

    def finish(self) -> torch.Tensor:
        r = min(self.rows)
        del self.lens[r]
        return self.rows.pop(r)

    def step(self, k: int) -> None:
        """Step ``k``: three prefills (five at first), a decode, then 1 to 4 requests
        finish."""
        self.prefill([PROMPTS[(3 * k + i) % len(PROMPTS)] for i in range(5 if k == 0 else 3)])
        self.decode()
        row = self.finish()
        with self.syncs.call("free group of free_segment"):
            self.a.free_group_begin()
            self.a.free_segment(row, start_pos=0)
            self.a.free_group_end()
        if k % 2 == 0:
            with self.syncs.call("free_segment"):
                self.a.free_segment(self.finish(), start_pos=0)
            pages = self.finish()[::PS] // PS
            with self.syncs.call("free_page_ids"):
                self.a.free_page_ids(pages)
        if k % 3 == 0:
            with self.syncs.call("alloc"):
                whole = self.a.alloc(2 * PS)
            assert whole is not None
            with self.syncs.call("free"):
                self.a.free(whole)
            row = self.finish()
            with self.syncs.call("free group of free"):
                self.a.free_group_begin()
                self.a.free(row)
                self.a.free_group_end()


@pytest.fixture(scope="module")
def daemon_target() -> Iterator[str]:
    with temp_dir("kvp-gsync-") as d, run_daemon(d, budget="64MiB") as daemon:
        with KVPoolClient(daemon.target) as client:
            client.configure(POOL, spec=SPEC, max_total_tokens=QUOTA_PAGES * PS,
                             page_size=PS, max_running_requests=64)
        yield daemon.target


def run_sequence(alloc: Any) -> tuple[Syncs, int]:
    """A warm-up pass (uncounted: first launches, pinned blocks), then the counted pass and
    the profiler's count of synchronizing runtime calls over it."""
    warm = Scheduler(alloc, Syncs())
    for k in range(6):
        warm.step(k)
    torch.cuda.synchronize()
    syncs = Syncs()
    sched = Scheduler(alloc, syncs)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                            torch.profiler.ProfilerActivity.CUDA]) as prof:
        for k in range(STEPS):
            sched.step(k)
    runtime = sum(e.count for e in prof.key_averages() if e.key in SYNC_CALLS)
    return syncs, runtime


def test_kvpool_adds_no_synchronization_beyond_sglangs(daemon_target: str,
                                                       monkeypatch: pytest.MonkeyPatch,
                                                       tmp_path: Path) -> None:
    sglang_cls, kvpool_cls = allocator_classes()
    monkeypatch.setenv("KVPOOL_TARGET", daemon_target)
    monkeypatch.setenv("KVPOOL_POOL", POOL)
    monkeypatch.delenv("SGLANG_DEBUG_MEMORY_POOL", raising=False)
    size = QUOTA_PAGES * PS
    ref = sglang_cls(size, PS, torch.float16, "cuda", None, False)
    ours = kvpool_cls(size, PS, torch.float16, "cuda", None, False)
    try:
        ref_syncs, ref_runtime = run_sequence(ref)
        our_syncs, our_runtime = run_sequence(ours)
        kinds = sorted(set(ref_syncs.counts) | set(our_syncs.counts))
        report = [f"{'call':<28} {'sglang':>7} {'kvpool':>7}"] + [
            f"{k:<28} {ref_syncs.counts[k]:7d} {our_syncs.counts[k]:7d}" for k in kinds] + [
            f"{'runtime *Synchronize calls':<28} {ref_runtime:7d} {our_runtime:7d}"]
        print("\n" + "\n".join(report))
        (tmp_path / "syncs.txt").write_text("\n".join(report))
        worse = [k for k in kinds if our_syncs.counts[k] > ref_syncs.counts[k]]
        assert not worse, "kvpool synchronizes more than SGLang in: " + ", ".join(worse)
        assert our_runtime <= ref_runtime, (our_runtime, ref_runtime)
        assert ref.available_size() == ours.available_size()
        # The deferred frees come back once their copies are done: the next allocation
        # returns them to the page cache.
        torch.cuda.synchronize()
        extra = ours.alloc(PS)
        assert extra is not None
        assert ours.cache.in_use == ours.pages_in_use
        ours.free(extra)
    finally:
        ours.close()
