"""Benchmark: per-step KV-page allocator time of an engine scheduler loop, four ways, one trace.

What it measures. A scheduler loop shaped like SGLang's, page size 16: ``--requests`` (256)
requests decode one token per step, and a request needs a new page each time its length
crosses a multiple of 16; arrivals (Poisson, at the rate that keeps about ``--requests``
running: an M/G/inf queue whose mean is ``--requests``) prefill 1-8,192 tokens and need
ceil(len / 16) pages at once; each request decodes a uniform 64-1,024 tokens and then frees
all of its pages. The run starts in the steady state (the first requests are drawn
length-biased, part-way through their decode; their pages are allocated untimed). The trace
(per step: which requests finish, then which need how many pages) is generated once from
``--seed`` and replayed ``--steps`` (2,000) times four ways:

1. floor: an in-process numpy stack of page ids; per step one put-back of the finished
   requests' pages and one take of all the pages the step's requests need (an engine
   allocates per batch, as SGLang's ``alloc_extend``/``alloc_decode`` do; the split of the
   step's ids among its requests is bookkeeping, outside the timer). A "per request" row,
   informational, makes one call per request instead.
2. sglang (its own class): SGLang 0.5.23's ``PagedTokenToKVPoolAllocator`` itself, run in a
   process of the SGLang side venv (``tests/sglang/setup_venv.sh``, or ``KVPOOL_SGLANG_VENV``)
   that replays the same trace (see :class:`RealSGLangRound`) on CPU tensors with SGLang's
   torch paths (no triton here), called as its scheduler calls it: per step one free group
   with ``free_segment(row, start_pos=0)`` per finished request (``free_kv_row``'s path), one
   ``alloc_extend`` for the prefill batch and one ``alloc_decode`` for the whole running batch
   (which computes every running request's next slot, not only the page-crossing ones: part
   of what SGLang's allocator costs a step). The worker times its own steps and sleeps the
   same forward pass, and takes its turns like the other variants (one pipe message per turn,
   outside every timed region). Labelled fallback, when there is no side venv (or with
   ``--sglang-reimplementation``): "sglang (reimplementation)", SGLang's free-list algorithm
   as docs/sglang-sizing-reference.md section 6.3 describes it, reimplemented here: a torch
   int64 free list of page ids; alloc_extend and alloc_decode each take their pages with one
   slice from the front; frees inside a free group (one ``torch.cat`` of the finished
   requests' token indices, ``unique(idx // page)``, then prepended to the free list with
   ``torch.cat``). ``need_sort`` is off in both (it is on only with PD disaggregation).
3. rpc: a real ``kvpoold serve`` process on a Unix socket, one lease, a pool of its own; per
   step ONE
   ``lease.allocate_batch(pool, [("kv", n), ...])`` with one item per request that needs pages
   (the daemon returns one id array per item, so nothing is split client-side) and ONE
   ``lease.free_batch(pool, [("kv", ids), ...])`` with one item per finished request. A step
   with nothing to allocate (or free) skips that RPC; a step with neither counts as 0.
4. page cache: the same daemon, another lease and pool (each daemon-backed variant has a pool
   of its own, sized as if it ran alone), ``lease.page_cache(pool, "kv", low=1024, high=8192,
   batch=4096, background=False)``, with ``cache.maintain()`` between steps (untimed; the
   engine's own refill point, so no refill or return lands inside a timed call; ``--background``
   uses the worker thread instead); per step one ``cache.free(ids)`` of the finished
   requests' pages and one ``cache.alloc(n)`` of the step's pages, called as the floor is
   (a "per request" row, informational, makes one call per request). Watermarks: an
   arrival takes up to 512
   pages at once and a step's decode about 16, so ``low`` = 1,024 keeps two of the largest
   prefills cached when a refill is due (an ``alloc`` that finds the cache short waits on an
   RPC: ``waits``). The pages the running set holds drift by thousands over
   a few hundred steps (a completion frees up to 576 pages, an arrival takes 0-512), so
   ``high`` = 8,192 and ``batch`` = 4,096 let the cache absorb that drift and make each refill
   or return move >= 4,096 ids: about 20 background RPCs in 2,000 steps. A step that overlaps
   one pays for it (the worker's gRPC call competes for the GIL and, on 2 cores, the daemon for
   the CPU), so fewer RPCs is what keeps the p99 down; the price is up to 8,192 pages parked in
   this lease that other leases of the pool cannot have. (low 1,024 / high 4,096 / batch 1,024
   makes ~90 RPCs and a p99 ~1.5-2x worse; try them with ``--low/--high/--batch``.)

Timing: per step, only the allocator work (that step's free and alloc calls) between two
``time.perf_counter_ns``; the bookkeeping (which ids a request holds, the checks that no id
is handed out twice, the page counts of the step's batches, which a scheduler knows before it
calls its allocator) is outside it. After every step each variant sleeps ``--forward-us`` (100)
microseconds, outside the timed region and the same for all: it stands for the forward pass,
during which a real engine releases the GIL (with ``--background`` the page cache's worker
thread runs its refills and returns then; a pure-Python loop that never released the GIL would
let it run only at the interpreter's 5 ms switch interval). Every timed call therefore starts
cold, as an engine's does after a forward pass.

Interleaving: the machine is noisy (a burst of load lasts seconds and can double every time
measured), so the variants take turns, ``--block`` (50) steps each, until each has run the
whole trace; a burst lands on all of them alike. Within its turn a variant runs alone (running
the variants strictly step by step instead would put five other variants' work between two
steps of one; ``--block 1`` shows that, ``--block 2000`` runs them one after another). Each
round replays the whole trace this way; ``--rounds`` (5) rounds, the ratios computed per round
and their median printed with the rounds' range.

Printed: per variant the median over the rounds of its p50, p99 and mean per-step allocator
time (us) (pages allocated and freed are asserted identical across variants), the target ratios
with "met"/"MISSED", and the page cache's counters. Run from the repository root (about a
minute on 2 cores):

    PYTHONPATH=client:service python bench/engine_step.py [--steps 2000] [--seed 0]
        [--requests 256] [--rounds 5] [--block 50] [--background] [--sglang-reimplementation]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from benchlib.venv_ready import SGLANG_MARKER, venv_problem
from rpc import serving_daemon

from kvpool.cache.page_cache import PageCache
from kvpool.clients.client import KVPoolClient, Lease

PAGE = 16
PROMPT = (1, 8192)  # prefill tokens, uniform
DECODE = (64, 1024)  # decode tokens, uniform
# One pool per daemon-backed variant: rpc, page cache, page cache per request.
POOLS = ("engine-rpc", "engine-cache", "engine-cache-req")
# One layer, one KV head of one element: 4 B per token, so a 160K-page pool is ~10 MiB.
SPEC = {"num_layers": 1, "attention": {"type": "mha", "num_kv_heads": 1, "head_dim": 1},
        "context_length": 16384}
LOW, HIGH, BATCH = 1024, 8192, 4096
clock = time.perf_counter_ns


# -- the trace --------------------------------------------------------------------------------

class Sizes(NamedTuple):
    """A step's batch as the scheduler knows it before calling the allocator (counted when
    the trace is made, so no variant spends its timed region adding them up)."""

    arrivals: int  # prefills among the step's allocs (the first ones)
    prefill: int  # their pages: the prefill batch (SGLang's alloc_extend)
    decode: int  # pages of the decode batch, one per request (SGLang's alloc_decode)
    total: int  # every page of the step


@dataclass
class Trace:
    """``setup``: (request, pages) allocated untimed before step 0. Per step: ``frees[s]``, the
    requests that finish (freed first), then ``allocs[s]``, (request, pages) in order: the
    step's arrivals (prefill) then the running requests that cross a page boundary."""

    setup: list[tuple[int, int]]
    frees: list[list[int]]
    allocs: list[list[tuple[int, int]]]
    arrivals: list[int]  # how many of ``allocs[s]`` are prefills (the first ones)
    tokens: dict[int, int]  # a request's final length (token indices freed, for sglang)
    start: dict[int, int]  # a request's tokens when it first allocates (setup or prefill)
    peak_pages: int
    running: list[int]
    sizes: list[Sizes]  # per step, what a scheduler knows before it calls its allocator

    @property
    def pages_allocated(self) -> int:
        return sum(n for step in self.allocs for _, n in step)

    @property
    def pages_freed(self) -> int:
        return sum(-(-self.tokens[r] // PAGE) for step in self.frees for r in step)


def make_trace(steps: int, requests: int, seed: int) -> Trace:
    rng = np.random.default_rng(seed)
    mean_decode = (DECODE[0] + DECODE[1]) / 2
    rate = requests / mean_decode  # arrivals per step: the M/G/inf mean is ``requests``
    length: dict[int, int] = {}  # request -> tokens now
    left: dict[int, int] = {}  # request -> decode tokens still to come
    final: dict[int, int] = {}
    start: dict[int, int] = {}
    setup: list[tuple[int, int]] = []
    next_id = 0
    # The steady state: decode lengths length-biased (a running request is more likely a long
    # one), each part-way through.
    lo2, hi2 = DECODE[0] ** 2, DECODE[1] ** 2
    for _ in range(requests):
        p = int(rng.integers(PROMPT[0], PROMPT[1] + 1))
        d = int(np.sqrt(lo2 + rng.random() * (hi2 - lo2)))
        k = int(rng.integers(0, d))
        length[next_id] = p + k
        left[next_id] = d - k
        final[next_id] = p + d
        start[next_id] = p + k
        setup.append((next_id, -(-(p + k) // PAGE)))
        next_id += 1
    held = sum(n for _, n in setup)
    peak = held
    frees: list[list[int]] = []
    allocs: list[list[tuple[int, int]]] = []
    arrivals: list[int] = []
    running: list[int] = []
    for _ in range(steps):
        done = [r for r, n in left.items() if n == 0]
        for r in done:
            held -= -(-length[r] // PAGE)
            del left[r], length[r]
        step: list[tuple[int, int]] = []
        for _ in range(int(rng.poisson(rate))):
            p = int(rng.integers(PROMPT[0], PROMPT[1] + 1))
            d = int(rng.integers(DECODE[0], DECODE[1] + 1))
            step.append((next_id, -(-p // PAGE)))
            length[next_id] = p
            left[next_id] = d
            final[next_id] = p + d
            start[next_id] = p
            next_id += 1
        new = {r for r, _ in step}
        arrivals.append(len(step))
        for r in list(left):
            if r in new:
                continue  # prefilled this step; decodes from the next
            if length[r] % PAGE == 0:
                step.append((r, 1))
            length[r] += 1
            left[r] -= 1
        held += sum(n for _, n in step)
        peak = max(peak, held)
        frees.append(done)
        allocs.append(step)
        running.append(len(left))
    sizes = [Sizes(a, sum(n for _, n in step[:a]), len(step) - a, sum(n for _, n in step))
             for a, step in zip(arrivals, allocs, strict=True)]
    return Trace(setup, frees, allocs, arrivals, final, start, peak, running, sizes)


# -- the variants -----------------------------------------------------------------------------

class Checker:
    """Untimed: every id handed out is in range and not already in use; frees match."""

    def __init__(self, capacity: int) -> None:
        self.in_use = np.zeros(capacity + 1, dtype=bool)
        self.allocated = 0
        self.freed = 0

    def take(self, ids: np.ndarray, n: int) -> None:
        assert ids.shape == (n,), (ids.shape, n)
        assert not self.in_use[ids].any(), "an id handed out twice"
        self.in_use[ids] = True
        self.allocated += n

    def give(self, ids: np.ndarray) -> None:
        assert self.in_use[ids].all()
        self.in_use[ids] = False
        self.freed += ids.shape[0]


@dataclass
class Result:
    name: str
    samples: list[int]
    allocated: int
    freed: int


class Batches(list):  # type: ignore[type-arg]
    """What a step returns when it allocates per batch, not per request: arrays whose
    concatenation is the step's allocs in order (``Replay`` splits it, untimed)."""


class Replay:
    """One variant's replay of the trace, a step at a time: ``step(frees, allocs, sizes)
    -> one id array per alloc`` (or a :class:`Batches`); ``frees`` holds ``free_arg(request,
    ids)`` per finished request (by default its page ids), built before the timer starts."""

    def __init__(self, name: str, trace: Trace, capacity: int,
                 setup: Callable[[list[tuple[int, int]]], list[np.ndarray]],
                 step: Callable[[list[Any], list[tuple[int, int]], Sizes], list[Any]],
                 free_arg: Callable[[int, np.ndarray], Any] | None = None,
                 between: Callable[[], Any] | None = None) -> None:
        self.name = name
        self.trace = trace
        self.step_fn = step
        self.free_arg = free_arg
        self.between = between
        self.check = Checker(capacity)
        self.held: dict[int, list[np.ndarray]] = {}
        for (r, n), ids in zip(trace.setup, setup(trace.setup), strict=True):
            ids = np.asarray(ids)
            self.check.take(ids, n)
            self.held[r] = [ids]
        self.check.allocated = 0  # count the timed steps only
        self.samples: list[int] = []

    def step(self, s: int) -> None:
        """Step ``s``: only the allocator calls are timed."""
        trace = self.trace
        freed = [np.concatenate(self.held.pop(r)) for r in trace.frees[s]]
        frees: list[Any] = freed if self.free_arg is None else [
            self.free_arg(r, ids) for r, ids in zip(trace.frees[s], freed, strict=True)]
        allocs = trace.allocs[s]
        if freed or allocs:
            t0 = clock()
            got = self.step_fn(frees, allocs, trace.sizes[s])
            self.samples.append(clock() - t0)
        else:
            got = []
            self.samples.append(0)
        if isinstance(got, Batches):
            flat = np.concatenate([np.asarray(b) for b in got]) if got else np.empty(0)
            got = np.split(flat, np.cumsum([n for _, n in allocs])[:-1]) if allocs else []
        for ids in freed:
            self.check.give(ids)
        for (r, n), ids in zip(allocs, got, strict=True):
            ids = np.array(ids)  # a copy: a view into a free list could change under it
            self.check.take(ids, n)
            self.held.setdefault(r, []).append(ids)
        if self.between is not None:
            self.between()  # the engine's own work between steps (untimed), e.g. maintain()

    def run_block(self, first: int, last: int, forward_s: float) -> None:
        """Steps ``first`` to ``last - 1``, each followed by the forward pass (a sleep)."""
        for s in range(first, last):
            self.step(s)
            time.sleep(forward_s)  # the forward pass (untimed)

    def result(self) -> Result:
        return Result(self.name, self.samples, self.check.allocated, self.check.freed)


def interleaved(replays: list[Replay | RealSGLangReplay], steps: int, forward_s: float,
                block: int) -> dict[str, Result]:
    """The variants take turns, ``block`` steps at a time (the order rotated per block), each
    step followed by the forward pass (``forward_s`` of sleep, untimed), until every variant
    has run every step. A burst of machine noise lasts longer than a turn, so it lands on
    every variant alike and the ratios stay comparable; within its turn a variant runs alone,
    as an engine's allocator would between forward passes."""
    k = len(replays)
    for t, first in enumerate(range(0, steps, block)):
        for j in range(k):
            replays[(t + j) % k].run_block(first, min(first + block, steps), forward_s)
    return {r.name: r.result() for r in replays}


class Floor:
    """A numpy stack of ids 1..capacity: take from the end, put back at the end."""

    def __init__(self, capacity: int) -> None:
        self.stack = np.arange(capacity, 0, -1, dtype=np.int32)
        self.top = capacity

    def alloc(self, n: int) -> np.ndarray:
        top = self.top
        if n > top:
            raise MemoryError(f"floor: {n} pages, {top} free")
        self.top = top - n
        return self.stack[top - n:top].copy()

    def free(self, ids: np.ndarray) -> None:
        k = ids.shape[0]
        self.stack[self.top:self.top + k] = ids
        self.top += k

    def setup(self, items: list[tuple[int, int]]) -> list[np.ndarray]:
        return [self.alloc(n) for _, n in items]

    def step(self, freed: list[np.ndarray], allocs: list[tuple[int, int]],
             sizes: Sizes) -> list[np.ndarray]:
        for ids in freed:
            self.free(ids)
        return [self.alloc(n) for _, n in allocs]

    def step_batched(self, freed: list[np.ndarray], allocs: list[tuple[int, int]],
                     sizes: Sizes) -> list[np.ndarray]:
        """Informational: one put-back and one take per step (the split is bookkeeping)."""
        if freed:
            self.free(freed[0] if len(freed) == 1 else np.concatenate(freed))
        total = sizes.total
        return Batches([self.alloc(total)] if total else [])


class SGLangPaged:
    """SGLang's PagedTokenToKVPoolAllocator free-list algorithm (reference doc section 6.3),
    on CPU tensors: page ids 1..num_pages; alloc slices from the front; free prepends
    ``unique(idx // page)``; with ``need_sort`` frees are staged and merged and sorted only when
    an alloc finds the free list short."""

    def __init__(self, num_pages: int, page_size: int = PAGE, need_sort: bool = False) -> None:
        self.page_size = page_size
        self.need_sort = need_sort
        self.free_pages = torch.arange(1, num_pages + 1, dtype=torch.int64)
        self.release_pages = torch.empty(0, dtype=torch.int64)
        self.free_group: list[torch.Tensor] | None = None

    def merge_and_sort_free(self) -> None:
        if self.release_pages.numel():
            self.free_pages = torch.cat((self.free_pages, self.release_pages))
            self.free_pages, _ = torch.sort(self.free_pages)
            self.release_pages = torch.empty(0, dtype=torch.int64)

    def alloc_pages(self, num_pages: int) -> torch.Tensor | None:
        """The page-taking core of alloc / alloc_extend / alloc_decode."""
        if self.need_sort and num_pages > self.free_pages.numel():
            self.merge_and_sort_free()
        if num_pages > self.free_pages.numel():
            return None
        out = self.free_pages[:num_pages]
        self.free_pages = self.free_pages[num_pages:]
        return out

    def free(self, free_index: torch.Tensor) -> None:
        if free_index.numel() == 0:
            return
        if self.free_group is not None:
            self.free_group.append(free_index)
            return
        free_page_ids = torch.unique(free_index // self.page_size)
        if self.need_sort:
            self.release_pages = torch.cat((free_page_ids, self.release_pages))
        else:
            self.free_pages = torch.cat((free_page_ids, self.free_pages))

    def free_group_begin(self) -> None:
        self.free_group = []

    def free_group_end(self) -> None:
        group, self.free_group = self.free_group, None
        if group:
            self.free(torch.cat(group))


class SGLangVariant:
    """The trace through :class:`SGLangPaged` the way SGLang's scheduler calls it: the
    finished requests' token indices freed in one free group, one alloc for the prefill batch
    and one for the decode batch. The token indices of a finished request (its req_to_token
    row) are built outside the timed region."""

    def __init__(self, capacity: int, trace: Trace) -> None:
        self.alloc = SGLangPaged(capacity)
        self.tokens = trace.tokens
        self.offsets = torch.arange(PAGE, dtype=torch.int64)

    def setup(self, items: list[tuple[int, int]]) -> list[np.ndarray]:
        out = []
        for _, n in items:
            pages = self.alloc.alloc_pages(n)
            assert pages is not None
            out.append(pages.clone().numpy())
        return out

    def token_indices(self, request: int, pages: np.ndarray) -> torch.Tensor:
        """A finished request's token indices (its req_to_token row), what SGLang frees."""
        p = torch.from_numpy(pages).to(torch.int64)
        return (p[:, None] * PAGE + self.offsets).reshape(-1)[:self.tokens[request]]

    def step(self, freed: list[torch.Tensor], allocs: list[tuple[int, int]],
             sizes: Sizes) -> Batches:
        a = self.alloc
        if freed:
            a.free_group_begin()
            for idx in freed:
                a.free(idx)
            a.free_group_end()
        out = Batches()
        if sizes.prefill:  # alloc_extend: the prefill batch
            out.append(self.must(sizes.prefill))
        if sizes.decode:  # alloc_decode: the decode batch
            out.append(self.must(sizes.decode))
        return out

    def must(self, n: int) -> torch.Tensor:
        pages = self.alloc.alloc_pages(n)
        if pages is None:
            raise MemoryError(f"sglang: {n} pages, {self.alloc.free_pages.numel()} free")
        return pages


# -- SGLang's own allocator class, run in the side venv ----------------------------------------

SIDE_VENV = Path(os.environ.get("KVPOOL_SGLANG_VENV",
                                Path(__file__).resolve().parent.parent / ".venv-sglang"))
REAL_NAME = "sglang (its own class)"
REIMPL_NAME = "sglang (reimplementation)"


class RealSGLangWorker:
    """SGLang 0.5.23's ``PagedTokenToKVPoolAllocator`` replaying the trace in a process of the
    side venv (this script's ``sglang-worker`` mode): started once, one ``round`` (a fresh
    allocator and the untimed setup) per round, then one ``block`` command per turn. The
    worker times its own steps (the pipe is outside every timed region) and sleeps the forward
    pass after each, as the other variants do."""

    def __init__(self, args: argparse.Namespace) -> None:
        bench = Path(__file__).resolve().parent
        stubs = bench.parent / "tests" / "sglang" / "stubs"
        env = {**os.environ, "PYTHONPATH": f"{stubs}:{bench.parent / 'client'}:{bench}",
               "HF_HUB_OFFLINE": "1"}
        for name in ("VIRTUAL_ENV", "SGLANG_PLATFORM", "KVPOOL_POOL"):
            env.pop(name, None)  # SGLang's own platform: no triton on CPU, its torch paths
        self.proc = subprocess.Popen(
            [str(SIDE_VENV / "bin" / "python"), str(Path(__file__).resolve()), "sglang-worker"],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env, text=True)
        self.ask({"cmd": "trace", "steps": args.steps, "requests": args.requests,
                  "seed": args.seed})

    def ask(self, msg: dict[str, Any]) -> dict[str, Any]:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write(json.dumps(msg) + "\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"the SGLang worker exited ({self.proc.wait()}) on {msg['cmd']}")
        got = json.loads(line)
        if "error" in got:
            raise RuntimeError(f"the SGLang worker failed on {msg['cmd']}: {got['error']}")
        return got

    def close(self) -> None:
        with contextlib.suppress(OSError, ValueError):
            assert self.proc.stdin is not None
            self.proc.stdin.close()
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


class RealSGLangReplay:
    """One round of :class:`RealSGLangWorker`, with the interface :func:`interleaved` uses."""

    name = REAL_NAME

    def __init__(self, worker: RealSGLangWorker, pages: int) -> None:
        self.worker = worker
        worker.ask({"cmd": "round", "pages": pages})

    def run_block(self, first: int, last: int, forward_s: float) -> None:
        self.worker.ask({"cmd": "block", "first": first, "last": last, "forward_s": forward_s})

    def result(self) -> Result:
        got = self.worker.ask({"cmd": "result"})
        return Result(self.name, got["samples"], got["allocated"], got["freed"])


class RealSGLangRound:
    """The worker's side: the trace through SGLang's allocator the way its 0.5.23 scheduler
    calls it. Per step, timed: the finished requests' kv rows freed in one free group, each by
    ``free_segment(row, start_pos=0)`` (``free_kv_row``'s path: its page ids, no ``unique``);
    one ``alloc_extend`` for the step's prefill batch (prefix 0, ``last_loc`` -1); one
    ``alloc_decode`` for every running request (``seq_lens``, ``last_loc`` of each), of
    which only those crossing a page boundary take a page. The tensors those calls take
    (a scheduler has them before it calls) and the checks (every new page free, the page
    counts those of the trace) are built and run outside the timed region."""

    def __init__(self, trace: Trace, pages: int) -> None:
        from sglang.srt.mem_cache.allocator.paged import PagedTokenToKVPoolAllocator

        self.trace = trace
        self.alloc = PagedTokenToKVPoolAllocator(pages * PAGE, PAGE, torch.float16, "cpu",
                                                 None, False)
        self.alloc.use_triton_kernels = False  # the CPU: SGLang's torch fallbacks
        self.in_use = np.zeros(pages + 1, dtype=bool)
        self.pages: dict[int, list[int]] = {}  # request -> its pages, in order
        self.length: dict[int, int] = {}  # request -> tokens now
        self.samples: list[int] = []
        self.allocated = 0
        self.freed = 0
        self.offsets = torch.arange(PAGE, dtype=torch.int64)
        for r, n in trace.setup:
            idx = self.alloc.alloc(n * PAGE)
            assert idx is not None
            self.take(r, idx[::PAGE].numpy() // PAGE)
            self.length[r] = trace.start[r]
        self.allocated = 0  # count the timed steps only

    def take(self, r: int, new: np.ndarray) -> None:
        assert not self.in_use[new].any(), "a page handed out twice"
        self.in_use[new] = True
        self.allocated += new.shape[0]
        self.pages.setdefault(r, []).extend(new.tolist())

    def row(self, r: int) -> torch.Tensor:
        p = torch.tensor(self.pages[r], dtype=torch.int64)
        return (p[:, None] * PAGE + self.offsets).reshape(-1)[:self.length[r]]

    def step(self, s: int) -> None:
        trace, a = self.trace, self.alloc
        rows = [self.row(r) for r in trace.frees[s]]
        for r in trace.frees[s]:
            pages = np.asarray(self.pages.pop(r))
            assert self.in_use[pages].all()
            self.in_use[pages] = False
            self.freed += pages.shape[0]
            del self.length[r]
        new = [r for r, _ in trace.allocs[s][:trace.arrivals[s]]]
        running = [r for r in self.length if r not in new]
        ext = None
        if new:
            seq = torch.tensor([trace.start[r] for r in new], dtype=torch.int64)
            zero = torch.zeros(len(new), dtype=torch.int64)
            ext = (zero, zero.clone(), seq, seq.clone(), torch.full_like(zero, -1),
                   int(seq.sum()))
        dec = None
        if running:
            lens = torch.tensor([self.length[r] for r in running], dtype=torch.int64)
            last = torch.tensor([self.pages[r][(n - 1) // PAGE] * PAGE + (n - 1) % PAGE
                                 for r, n in zip(running, lens.tolist(), strict=True)],
                                dtype=torch.int64)
            dec = (lens + 1, lens + 1, last)
        t0 = clock()
        if rows:
            a.free_group_begin()
            for row in rows:
                a.free_segment(row, start_pos=0)
            a.free_group_end()
        out_ext = a.alloc_extend(*ext) if ext is not None else None
        out_dec = a.alloc_decode(*dec) if dec is not None else None
        self.samples.append(clock() - t0 if (rows or trace.allocs[s]) else 0)
        if ext is not None:
            assert out_ext is not None, "alloc_extend: out of pages"
            lo = 0
            for r in new:
                n = trace.start[r]
                self.take(r, out_ext[lo:lo + n:PAGE].numpy() // PAGE)
                self.length[r] = n
                lo += n
        decoded = 0
        if dec is not None:
            assert out_dec is not None, "alloc_decode: out of pages"
            starts = (dec[0] - 1) % PAGE == 0
            for r, loc, first in zip(running, out_dec.tolist(), starts.tolist(), strict=True):
                if first:
                    self.take(r, np.array([loc // PAGE]))
                    decoded += 1
                self.length[r] += 1
        want = trace.sizes[s]
        prefilled = sum(len(self.pages[r]) for r in new)
        assert (prefilled, decoded) == (want.prefill, want.decode), (s, prefilled, decoded, want)


def sglang_worker() -> int:
    """The side venv's end of :class:`RealSGLangWorker`: JSON commands on stdin, one answer
    line each on stdout (SGLang logs to stderr)."""
    trace: Trace | None = None
    current: RealSGLangRound | None = None
    torch.set_num_threads(1)
    answers, sys.stdout = sys.stdout, sys.stderr  # whatever else prints goes to stderr
    for line in sys.stdin:
        msg = json.loads(line)
        try:
            if msg["cmd"] == "trace":
                trace = make_trace(msg["steps"], msg["requests"], msg["seed"])
                answer: dict[str, Any] = {"ok": True}
            elif msg["cmd"] == "round":
                assert trace is not None
                current = RealSGLangRound(trace, msg["pages"])
                answer = {"ok": True}
            elif msg["cmd"] == "block":
                assert current is not None
                for s in range(msg["first"], msg["last"]):
                    current.step(s)
                    time.sleep(msg["forward_s"])
                answer = {"ok": True}
            else:
                assert current is not None
                answer = {"samples": current.samples, "allocated": current.allocated,
                          "freed": current.freed}
        except Exception as exc:  # reported to the bench, which stops
            answer = {"error": f"{type(exc).__name__}: {exc}"}
        print(json.dumps(answer), file=answers, flush=True)
    return 0


class RPCVariant:
    def __init__(self, lease: Lease, pool: str) -> None:
        self.lease = lease
        self.pool = pool

    def setup(self, items: list[tuple[int, int]]) -> list[np.ndarray]:
        return self.lease.allocate_batch(self.pool, [("kv", n) for _, n in items])

    def step(self, freed: list[np.ndarray], allocs: list[tuple[int, int]],
             sizes: Sizes) -> list[np.ndarray]:
        if freed:
            self.lease.free_batch(self.pool, [("kv", ids) for ids in freed])
        if allocs:
            return self.lease.allocate_batch(self.pool, [("kv", n) for _, n in allocs])
        return []


class CacheVariant:
    def __init__(self, cache: PageCache) -> None:
        self.cache = cache

    def setup(self, items: list[tuple[int, int]]) -> list[np.ndarray]:
        return [self.cache.alloc(n) for _, n in items]

    def step(self, freed: list[np.ndarray], allocs: list[tuple[int, int]],
             sizes: Sizes) -> list[np.ndarray]:
        cache = self.cache
        for ids in freed:
            cache.free(ids)
        return [cache.alloc(n) for _, n in allocs]

    def step_batched(self, freed: list[np.ndarray], allocs: list[tuple[int, int]],
                     sizes: Sizes) -> list[np.ndarray]:
        """One free and one alloc per step, as the engine's batch does."""
        cache = self.cache
        if freed:
            cache.free(freed[0] if len(freed) == 1 else np.concatenate(freed))
        total = sizes.total
        return Batches([cache.alloc(total)] if total else [])


# -- the run ----------------------------------------------------------------------------------

def stats_us(samples: list[int]) -> tuple[float, float, float]:
    arr = np.asarray(samples, dtype=np.float64) / 1e3
    return (float(np.percentile(arr, 50)), float(np.percentile(arr, 99)), float(arr.mean()))


def one_round(client: KVPoolClient, trace: Trace, pages: int, capacity: int,
              args: argparse.Namespace, worker: RealSGLangWorker | None
              ) -> tuple[dict[str, Result], dict[str, int]]:
    """Every variant once, interleaved (see :func:`interleaved`), on the same trace; each
    daemon-backed variant has a pool of its own, as if it ran alone. ``worker``: SGLang's own
    allocator class in the side venv; None: the reimplementation stands in for it."""
    forward_s = args.forward_us / 1e6
    low, high, batch = args.low, args.high, args.batch
    background = args.background
    with contextlib.ExitStack() as stack:
        floor, fr = Floor(pages), Floor(pages)
        sg = SGLangVariant(pages, trace)
        rpc = RPCVariant(stack.enter_context(client.lease("engine-rpc", ttl_s=30.0)), POOLS[0])
        caches = []
        for name, pool in (("page cache", POOLS[1]), ("page cache, per request", POOLS[2])):
            lease = stack.enter_context(client.lease(f"engine-{name}", ttl_s=30.0))
            caches.append(stack.enter_context(lease.page_cache(
                pool, "kv", low=low, high=high, batch=batch, background=background)))
        cvar, cvar_req = (CacheVariant(c) for c in caches)

        def settled(cache: PageCache, setup: Callable[[list[tuple[int, int]]], list[np.ndarray]]
                    ) -> Callable[[list[tuple[int, int]]], list[np.ndarray]]:
            def run(items: list[tuple[int, int]]) -> list[np.ndarray]:
                out = setup(items)
                cache.settle(10.0)  # the steady state: the refills have caught up
                return out
            return run

        def between(cache: PageCache) -> Callable[[], Any] | None:
            return None if background else cache.maintain

        replays: list[Replay | RealSGLangReplay] = [
            Replay("floor", trace, pages, floor.setup, floor.step_batched),
            RealSGLangReplay(worker, pages) if worker is not None else
            Replay(REIMPL_NAME, trace, pages, sg.setup, sg.step, sg.token_indices),
            Replay("rpc", trace, capacity, rpc.setup, rpc.step),
            Replay("page cache", trace, capacity, settled(caches[0], cvar.setup),
                   cvar.step_batched, between=between(caches[0])),
            Replay("floor, per request", trace, pages, fr.setup, fr.step),
            Replay("page cache, per request", trace, capacity,
                   settled(caches[1], cvar_req.setup), cvar_req.step,
                   between=between(caches[1])),
        ]
        before = caches[0].counters()
        out = interleaved(replays, args.steps, forward_s, args.block)
        after = caches[0].counters()
    counters = {k: getattr(after, k) - getattr(before, k)
                for k in ("rpc_calls", "waits", "refills", "returns", "fetched", "returned")}
    counters["cached_at_end"] = after.cached
    for r in out.values():
        assert (r.allocated, r.freed) == (trace.pages_allocated, trace.pages_freed), \
            (r.name, r.allocated, r.freed)
        assert len(r.samples) == args.steps
    return out, counters


INFO = ("floor, per request", "page cache, per request")


def run(args: argparse.Namespace) -> int:
    t_start = time.perf_counter()
    torch.set_num_threads(1)
    trace = make_trace(args.steps, args.requests, args.seed)
    # The trace's peak, the page cache's cached ids (twice: its returns run late), slack.
    pages = trace.peak_pages + 2 * args.high + 4096
    run_ = trace.running
    print(f"trace: seed {args.seed}, {args.steps:,} steps, page {PAGE}; running requests "
          f"min/mean/max {min(run_)}/{np.mean(run_):.0f}/{max(run_)}; "
          f"{sum(trace.arrivals):,} arrivals, {sum(map(len, trace.frees)):,} completions; "
          f"{trace.pages_allocated:,} pages allocated, {trace.pages_freed:,} freed in the "
          f"timed steps ({sum(n for _, n in trace.setup):,} at setup, untimed); peak held "
          f"{trace.peak_pages:,}; pool {pages:,} pages")
    rounds: list[dict[str, tuple[float, float, float]]] = []
    counters: dict[str, int] = {}
    # A venv without its ready marker (an interrupted setup) counts as none.
    venv_missing = venv_problem(SIDE_VENV, SGLANG_MARKER, "tests/sglang/setup_venv.sh")
    real = venv_missing is None and not args.sglang_reimplementation
    sglang = REAL_NAME if real else REIMPL_NAME
    print(f"{sglang}: " + (
        f"SGLang's PagedTokenToKVPoolAllocator, run in the side venv {SIDE_VENV} (its torch "
        "paths on CPU tensors)" if real else
        "NOT SGLang's class: this script's reimplementation of its free-list algorithm "
        f"(--sglang-reimplementation, or {venv_missing})"))
    with contextlib.ExitStack() as stack:
        target = stack.enter_context(serving_daemon("kvp-engine-", budget="256MiB"))
        client = stack.enter_context(KVPoolClient(target))
        worker = None
        if real:
            worker = RealSGLangWorker(args)
            stack.callback(worker.close)
        for pool in POOLS:
            client.configure(pool, spec=SPEC, max_total_tokens=pages * PAGE, page_size=PAGE,
                             max_running_requests=512)
        capacity = client.stats(POOLS[0]).pool(POOLS[0]).spaces["kv"].capacity
        assert capacity >= trace.peak_pages + args.high, (capacity, trace.peak_pages)
        for k in range(args.rounds):
            results, counters = one_round(client, trace, pages, capacity, args, worker)
            rounds.append({name: stats_us(r.samples) for name, r in results.items()})
            print(f"round {k + 1}/{args.rounds}: page cache p50 "
                  f"{rounds[-1]['page cache'][0]:.2f} us, floor p50 "
                  f"{rounds[-1]['floor'][0]:.2f} us", flush=True)
        for pool in POOLS:
            client.drop(pool, force=True)

    def med(values: list[float]) -> float:
        return float(np.median(values))

    print(f"\nmedian over {args.rounds} rounds (each round runs every variant once, taking "
          f"turns of {args.block} steps; all ran the same trace, pages allocated and freed "
          "asserted equal)")
    print(f"{'variant':<32} {'p50 us':>9} {'p99 us':>9} {'mean us':>9}")
    for name in rounds[0]:
        p50, p99, mean = (med([r[name][i] for r in rounds]) for i in range(3))
        label = name + (" (info)" if name in INFO else "")
        print(f"{label:<32} {p50:9.2f} {p99:9.2f} {mean:9.2f}")

    def ratios(num: str, den: str, col: int) -> list[float]:
        return [r[num][col] / r[den][col] for r in rounds]

    print("\nratios: the median of the per-round ratios [the rounds' min .. max]")
    for label, values, target, ok in (
            ("page cache p50 / floor p50", ratios("page cache", "floor", 0), "<= 2x",
             lambda v: v <= 2),
            ("page cache p99 / floor p99", ratios("page cache", "floor", 1), "<= 5x",
             lambda v: v <= 5),
            ("rpc p50 / page cache p50", ratios("rpc", "page cache", 0), ">= 100x",
             lambda v: v >= 100)):
        v = med(values)
        print(f"{label:<30} {v:9.2f}x  [{min(values):.2f} .. {max(values):.2f}]  target "
              f"{target:<8} {'met' if ok(v) else 'MISSED'}")
    s50 = med(ratios(sglang, "floor", 0))
    s99 = med(ratios(sglang, "floor", 1))
    note = "; info: it also computes every running request's next slot" if real else ""
    print(f"{sglang + ' p50 / floor p50':<30} {s50:9.2f}x  (p99: {s99:.2f}x{note})")
    mode = "worker thread" if args.background else "maintain() between steps"
    print(f"\npage cache counters over the {args.steps:,} steps of the last round ({mode}; low "
          f"{args.low}, high {args.high}, batch {args.batch}): "
          + ", ".join(f"{k} {v:,}" for k, v in counters.items()))
    print(f"({time.perf_counter() - t_start:.1f} s)")
    return 0


def main() -> int:
    if sys.argv[1:2] == ["sglang-worker"]:  # the side venv's end of RealSGLangWorker
        return sglang_worker()
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=2000)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--requests", type=int, default=256, help="running requests (mean)")
    parser.add_argument("--low", type=int, default=LOW, help="page cache low watermark")
    parser.add_argument("--high", type=int, default=HIGH, help="page cache high watermark")
    parser.add_argument("--batch", type=int, default=BATCH, help="page cache batch")
    parser.add_argument("--background", action="store_true",
                        help="let the page cache's worker thread refill and return (default: "
                             "the engine calls cache.maintain() between steps)")
    parser.add_argument("--rounds", type=int, default=5,
                        help="rounds of every variant, one after another; medians are printed")
    parser.add_argument("--block", type=int, default=50,
                        help="steps a variant runs per turn before the next takes over")
    parser.add_argument("--forward-us", type=float, default=100.0,
                        help="untimed sleep between steps standing for the forward pass")
    parser.add_argument("--sglang-reimplementation", action="store_true",
                        help="time this script's reimplementation of SGLang's allocator even "
                             "when the side venv is there")
    return run(parser.parse_args())


if __name__ == "__main__":
    sys.exit(main())
