"""Hold kvpool's ``PagedAllocator`` against SGLang 0.5.23's own ``PagedTokenToKVPoolAllocator``.

Run it with the side venv's python (``tests/sglang/setup_venv.sh``), against a running kvpoold:
``KVPOOL_TARGET`` names the daemon and ``KVPOOL_POOL`` a pool with ``page_size`` 4 (the
allocators under test make their bindings from the environment, as in a worker with SGLang's
own KV pool). It writes one JSON object on stdout; SGLang's logs go to stderr.

``tests/integration/sglang/test_allocator_differential.py`` runs it and asserts on the result:

- ``differential``: per (seed, need_sort, debug) run, both allocators built with the same
  ``size``/``page_size`` and driven by the same random calls (``alloc``, ``free``, free
  groups, ``free_segment(s)``, ``free_page_ids``, ``alloc_extend``, ``alloc_decode``,
  ``clear``) on simulated requests, each allocator's requests holding its own indices.
  After every call: ``mismatches`` lists any difference in the success/None pattern or in
  ``available_size``; ``invariant_errors`` any index that is not page-aligned, shared by two
  owners, in page 0, or a page count that disagrees with ``available_size``. At checkpoints
  the daemon's Stats of the allocator's lease (``checkpoints``: held, the in-use count the
  lease reported, the allocator's pages in use).
- ``scenarios``: the other checks, each with ``ok`` and what it saw (see ``SCENARIOS``).

SGLang's platform must answer ``supports_triton=False`` so its torch fallbacks run (the
stubs' triton cannot launch): the harness resolves SGLang's platform with ``KVPOOL_POOL``
unset, so the kvpool platform plugin (``activate()``) stays inactive, and reports it.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import random
import sys
import time
import traceback
from collections.abc import Callable
from types import SimpleNamespace
from typing import Any

_STUBS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "stubs")
if _STUBS not in sys.path:
    sys.path.insert(0, _STUBS)
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import numpy as np  # noqa: E402
import torch  # noqa: E402

PS = 4
DEBUG_ENV = "SGLANG_DEBUG_MEMORY_POOL"
MAX_LEN = 40  # tokens per simulated request


def resolve_platform() -> dict[str, Any]:
    """SGLang's current platform, resolved with KVPOOL_POOL and SGLANG_PLATFORM unset."""
    saved = {k: os.environ.pop(k) for k in ("KVPOOL_POOL", "SGLANG_PLATFORM")
             if k in os.environ}
    try:
        from sglang.srt.platforms import current_platform
        info = {"platform": type(current_platform).__name__,
                "supports_triton": bool(current_platform.capabilities.supports_triton)}
    finally:
        os.environ.update(saved)
    return info


class Side:
    """One allocator and the simulated state its caller keeps: requests' token indices and
    loose ``alloc`` chunks (token indices of whole pages)."""

    def __init__(self, name: str, alloc: Any) -> None:
        self.name = name
        self.a = alloc
        self.reqs: dict[int, np.ndarray] = {}
        self.chunks: list[np.ndarray] = []

    def last_loc(self, rid: int) -> int:
        idx = self.reqs.get(rid)
        return int(idx[-1]) if idx is not None and idx.size else -1

    def drop_all(self) -> None:
        self.reqs.clear()
        self.chunks.clear()

    def check(self, num_pages: int, upper: int) -> list[str]:
        """Index invariants: page-aligned, no page shared or 0, count matches the quota."""
        errs = []
        owner: dict[int, str] = {}
        for rid, idx in self.reqs.items():
            pos = np.arange(idx.size)
            if idx.size and ((idx % PS) != (pos % PS)).any():
                errs.append(f"{self.name} req {rid}: slot != position % page_size")
            pages = idx // PS
            for start in range(0, idx.size, PS):
                if (pages[start:start + PS] != pages[start]).any():
                    errs.append(f"{self.name} req {rid}: page {start // PS} spans pages")
            for p in np.unique(pages).tolist():
                if p in owner:
                    errs.append(f"{self.name}: page {p} in req {rid} and {owner[p]}")
                owner[p] = f"req {rid}"
        for i, chunk in enumerate(self.chunks):
            if ((chunk % PS) != (np.arange(chunk.size) % PS)).any():
                errs.append(f"{self.name} chunk {i}: not whole pages")
            for p in np.unique(chunk // PS).tolist():
                if p in owner:
                    errs.append(f"{self.name}: page {p} in chunk {i} and {owner[p]}")
                owner[p] = f"chunk {i}"
        if 0 in owner:
            errs.append(f"{self.name}: page 0 handed out ({owner[0]})")
        if owner and max(owner) > upper:
            errs.append(f"{self.name}: page {max(owner)} above {upper}")
        used = num_pages - self.a.available_size() // PS
        if used != len(owner):
            errs.append(f"{self.name}: {len(owner)} pages held by requests/chunks but "
                        f"available_size says {used} in use")
        return errs


def as_np(t: Any) -> np.ndarray:
    assert isinstance(t, torch.Tensor) and t.dtype == torch.int64, (type(t), t.dtype)
    return t.numpy().copy()


def differential(seed: int, need_sort: bool, debug: bool, steps: int, quota_pages: int,
                 client: Any, pool: str) -> dict[str, Any]:
    """One random run; see the module docstring."""
    from sglang.srt.mem_cache.allocator.paged import PagedTokenToKVPoolAllocator

    from kvpool.integrations.sglang.allocator import PagedAllocator

    if debug:
        os.environ[DEBUG_ENV] = "1"
    else:
        os.environ.pop(DEBUG_ENV, None)
    size = quota_pages * PS
    ref = PagedTokenToKVPoolAllocator(size, PS, torch.bfloat16, "cpu", None, need_sort)
    ref.use_triton_kernels = False  # the stub triton cannot launch (reported above)
    ours = PagedAllocator(size, PS, torch.bfloat16, "cpu", None, need_sort)
    os.environ.pop(DEBUG_ENV, None)
    sides = (Side("sglang", ref), Side("kvpool", ours))
    rng = random.Random(seed)
    out: dict[str, Any] = {"seed": seed, "need_sort": need_sort, "debug": debug,
                           "steps": steps, "mismatches": [], "invariant_errors": [],
                           "ops": {}, "nones": 0, "checkpoints": [], "error": None}
    next_rid = [0]

    def same(label: str, results: list[Any]) -> None:
        ok = [r is not None for r in results]
        if ok[0] != ok[1]:
            out["mismatches"].append(f"{label}: sglang {'ok' if ok[0] else 'None'}, "
                                     f"kvpool {'ok' if ok[1] else 'None'}")
        if not ok[0]:
            out["nones"] += 1

    def compare(label: str) -> None:
        av = [s.a.available_size() for s in sides]
        if av[0] != av[1]:
            out["mismatches"].append(f"{label}: available_size sglang {av[0]}, kvpool {av[1]}")

    # -- the operations (each does the same thing to both sides) -------------------------

    def op_alloc() -> str:
        k = rng.randint(0, 8)
        need = k * PS + (0 if debug or rng.random() < 0.8 else rng.randint(1, PS - 1))
        res = [s.a.alloc(need) for s in sides]
        same(f"alloc({need})", res)
        for s, r in zip(sides, res, strict=True):
            if r is not None and r.numel():
                s.chunks.append(as_np(r))
        return f"alloc({need})"

    def op_free_chunk() -> str:
        if not sides[0].chunks:
            return op_alloc()
        i = rng.randrange(len(sides[0].chunks))
        npages = sides[0].chunks[i].size // PS
        pick = sorted(rng.sample(range(npages), rng.randint(1, npages)))
        per_page = [rng.randint(1, PS) for _ in pick]
        for s in sides:
            chunk = s.chunks[i].reshape(-1, PS)
            toks = np.concatenate([chunk[p, :n] for p, n in zip(pick, per_page, strict=True)])
            s.a.free(torch.from_numpy(toks[::-1].copy()))
            keep = np.setdiff1d(np.arange(npages), pick)
            if keep.size:
                s.chunks[i] = chunk[keep].reshape(-1)
            else:
                s.chunks.pop(i)
        return "free(chunk pages)"

    def op_extend() -> str:
        live = [r for r in sides[0].reqs if sides[0].reqs[r].size < MAX_LEN]
        bs = rng.randint(1, 4)
        rids = []
        for _ in range(bs):
            if live and rng.random() < 0.5:
                rid = live.pop(rng.randrange(len(live)))
            else:
                rid = next_rid[0]
                next_rid[0] += 1
            rids.append(rid)
        prefix = [sides[0].reqs[r].size if r in sides[0].reqs else 0 for r in rids]
        seq = [min(MAX_LEN, p + rng.randint(1, 16)) for p in prefix]
        seq = [max(q, p + 1) for p, q in zip(prefix, seq, strict=True)]
        n = sum(q - p for p, q in zip(prefix, seq, strict=True))
        pt = torch.tensor(prefix, dtype=torch.int64)
        st = torch.tensor(seq, dtype=torch.int64)
        res = []
        for s in sides:
            last = torch.tensor([s.last_loc(r) for r in rids], dtype=torch.int64)
            res.append(s.a.alloc_extend(pt, pt.clone(), st, st.clone(), last, n))
        same(f"alloc_extend(prefix={prefix}, seq={seq})", res)
        for s, r in zip(sides, res, strict=True):
            if r is None:
                continue
            got = as_np(r)
            if got.size != n:
                out["invariant_errors"].append(f"{s.name}: alloc_extend gave {got.size} of {n}")
                continue
            at = 0
            for rid, p, q in zip(rids, prefix, seq, strict=True):
                old = s.reqs.get(rid, np.empty(0, dtype=np.int64))
                s.reqs[rid] = np.concatenate((old, got[at:at + q - p]))
                at += q - p
        return "alloc_extend"

    def op_decode() -> str:
        live = [r for r in sides[0].reqs if 0 < sides[0].reqs[r].size < MAX_LEN]
        if not live:
            return op_extend()
        rids = rng.sample(live, rng.randint(1, min(6, len(live))))
        seq = torch.tensor([sides[0].reqs[r].size + 1 for r in rids], dtype=torch.int64)
        res = []
        for s in sides:
            last = torch.tensor([s.last_loc(r) for r in rids], dtype=torch.int64)
            res.append(s.a.alloc_decode(seq, seq.clone(), last))
        same(f"alloc_decode(seq={seq.tolist()})", res)
        for s, r in zip(sides, res, strict=True):
            if r is not None:
                got = as_np(r)
                for j, rid in enumerate(rids):
                    s.reqs[rid] = np.append(s.reqs[rid], got[j])
        return "alloc_decode"

    def op_free_req() -> str:
        if not sides[0].reqs:
            return op_extend()
        rid = rng.choice(sorted(sides[0].reqs))
        size = sides[0].reqs[rid].size
        how = rng.choice(["free", "segments", "page_ids", "truncate"])
        cut = rng.randrange(0, size, PS) if how in ("segments", "truncate") else 0
        flip = rng.random() < 0.5
        for s in sides:
            idx = s.reqs[rid]
            if how == "free":
                s.a.free(torch.from_numpy((idx[::-1] if flip else idx).copy()))
            elif how == "segments":
                segs = [(torch.from_numpy(idx[:cut].copy()), 0),
                        (torch.from_numpy(idx[cut:].copy()), cut)]
                s.a.free_segments(segs)
            elif how == "page_ids":
                s.a.free_page_ids(torch.from_numpy(np.unique(idx // PS)))
            else:
                s.a.free_segment(torch.from_numpy(idx[cut:].copy()), start_pos=cut)
            if how == "truncate" and cut:
                s.reqs[rid] = idx[:cut]
            else:
                del s.reqs[rid]
        return f"free_req({how})"

    def op_group() -> str:
        for s in sides:
            s.a.free_group_begin()
        for j in range(rng.randint(0, 3)):
            rng.choice([op_free_req, op_free_req, op_free_chunk])()
            compare(f"inside free group, free {j}")
        for s in sides:
            s.a.free_group_end()
        return "free_group"

    def op_clear() -> str:
        for s in sides:
            s.a.clear()
            s.drop_all()
        return "clear"

    ops: list[tuple[Callable[[], str], float]] = [
        (op_alloc, 2), (op_free_chunk, 2), (op_extend, 4), (op_decode, 4), (op_free_req, 3),
        (op_group, 1.5), (op_clear, 0.15)]
    fns, weights = zip(*ops, strict=True)
    try:
        for step in range(steps):
            name = rng.choices(fns, weights)[0]()
            key = name.split("(")[0] if not name.startswith("free_req") else name
            out["ops"][key] = out["ops"].get(key, 0) + 1
            compare(f"step {step} {name}")
            for s, upper in ((sides[0], quota_pages), (sides[1], ours.capacity)):
                out["invariant_errors"].extend(f"step {step} {name}: {e}"
                                               for e in s.check(quota_pages, upper))
            if step % 100 == 99 or step == steps - 1:
                out["checkpoints"].append(checkpoint(ours, client, pool))
            if len(out["mismatches"]) + len(out["invariant_errors"]) > 20:
                break
    except Exception:
        out["error"] = traceback.format_exc()
    finally:
        ours.close()
    return out


def lease_stats(client: Any, pool: str, lease_id: int) -> Any:
    for lease in client.stats(pool).leases:
        if lease.lease_id == lease_id:
            return lease
    return None


def checkpoint(ours: Any, client: Any, pool: str) -> dict[str, Any]:
    """The daemon's view of the allocator's lease: held pages, and in use as reported."""
    ours.cache.settle(5.0)
    ours.lease.report_now()
    lease = lease_stats(client, pool, ours.lease.lease_id)
    held = lease.held.get(pool, {}).get("kv", 0) if lease is not None else -1
    return {"held": held, "reported_in_use": lease.in_use(pool) if lease is not None else -1,
            "pages_in_use": ours.pages_in_use}


# -- scenarios ------------------------------------------------------------------------------


def refusal_with_pool(pool: str | None) -> dict[str, Any]:
    """Build a PagedAllocator (page size PS, no KV pool binding) with ``KVPOOL_POOL`` set to
    ``pool`` (None: unset), then restore it: the error it raised, or ``ok`` False."""
    from kvpool.integrations.sglang.allocator import PagedAllocator

    saved = os.environ.pop("KVPOOL_POOL", None)
    if pool is not None:
        os.environ["KVPOOL_POOL"] = pool
    try:
        PagedAllocator(64, PS, torch.bfloat16, "cpu", None, False)
    except Exception as err:
        return {"ok": True, "type": type(err).__name__, "message": str(err)}
    finally:
        os.environ.pop("KVPOOL_POOL", None)
        if saved is not None:
            os.environ["KVPOOL_POOL"] = saved
    return {"ok": False, "message": "no error"}


def scenario_page_size(pool16: str, **_: Any) -> dict[str, Any]:
    """An allocator with page_size 4 on a pool of page size 16: refused, naming both."""
    return refusal_with_pool(pool16)


def scenario_env_missing(**_: Any) -> dict[str, Any]:
    """KVPOOL_POOL unset and a KV pool without a binding: refused, naming KVPOOL_POOL."""
    return refusal_with_pool(None)


def scenario_quota_too_big(client: Any, pool: str, **_: Any) -> dict[str, Any]:
    """A quota above the pool's kv capacity: refused, naming both."""
    from kvpool.integrations.sglang.allocator import PagedAllocator

    cap = client.stats(pool).pool(pool).spaces["kv"].capacity
    try:
        PagedAllocator((cap + 1) * PS, PS, torch.bfloat16, "cpu", None, False)
    except Exception as err:
        return {"ok": True, "capacity": cap, "type": type(err).__name__, "message": str(err)}
    return {"ok": False, "capacity": cap, "message": "no error"}


def scenario_quota(client: Any, pool: str, **_: Any) -> dict[str, Any]:
    """Quota 8 pages in a larger pool: 8 pages, then None though the pool has free pages."""
    from kvpool.integrations.sglang.allocator import PagedAllocator

    a = PagedAllocator(8 * PS + 3, PS, torch.bfloat16, "cpu", None, False)
    try:
        first = a.alloc(8 * PS)
        avail_full = a.available_size()
        more = a.alloc(PS)
        zero, one = torch.tensor([0]), torch.tensor([1])
        ext = a.alloc_extend(zero, zero, one, one, torch.tensor([-1]), 1)
        kv = client.stats(pool).pool(pool).spaces["kv"]
        a.free(first[:PS])
        again = a.alloc(PS)
        return {"ok": first is not None and more is None and ext is None and avail_full == 0
                and again is not None and kv.free > 0,
                "first": None if first is None else int(first.numel()),
                "available_when_full": avail_full, "beyond_quota": more is None,
                "extend_beyond_quota": ext is None, "pool_free_pages": kv.free,
                "after_free": None if again is None else int(again.numel())}
    finally:
        a.close()


def scenario_lease_close(client: Any, pool: str, **_: Any) -> dict[str, Any]:
    """Pages in use and cached go back to the pool when the allocator closes its lease."""
    from kvpool.integrations.sglang.allocator import PagedAllocator

    before = client.stats(pool).pool(pool).spaces["kv"].used
    a = PagedAllocator(32 * PS, PS, torch.bfloat16, "cpu", None, False)
    got = a.alloc(20 * PS)
    a.cache.settle(5.0)
    lease_id = a.lease.lease_id
    during = client.stats(pool)
    lease = lease_stats(client, pool, lease_id)
    a.close()
    after = client.stats(pool)
    gone = lease_stats(client, pool, lease_id) is None
    try:
        a.alloc(PS)
        alloc_after_close = "no error"
    except Exception as err:
        alloc_after_close = type(err).__name__
    used_during = during.pool(pool).spaces["kv"].used
    used_after = after.pool(pool).spaces["kv"].used
    held = lease.held.get(pool, {}).get("kv", 0) if lease is not None else -1
    return {"ok": got is not None and held >= 20 and used_during >= before + 20
            and used_after == before and gone and a.closed,
            "used_before": before, "used_during": used_during, "held_during": held,
            "used_after": used_after, "lease_gone": gone,
            "alloc_after_close": alloc_after_close}


def scenario_kvcache_binding(client: Any, pool: str, **_: Any) -> dict[str, Any]:
    """A KV pool carrying ``kvpool_binding``: the allocator takes that binding's lease and
    leaves it open when it closes."""
    from kvpool.integrations.sglang.allocator import PagedAllocator
    from kvpool.integrations.sglang.scheduler_binding import binding_from_env

    binding = binding_from_env()
    kvcache = SimpleNamespace(kvpool_binding=binding)
    try:
        a = PagedAllocator(16 * PS, PS, torch.bfloat16, "cpu", kvcache, False)
        same_lease = a.lease is binding.lease
        kv_ok = a.get_kvcache() is kvcache
        got = a.alloc(4 * PS)
        a.close()
        still = lease_stats(client, pool, binding.lease.lease_id)
        held = still.held.get(pool, {}).get("kv", 0) if still is not None else -1
        return {"ok": same_lease and kv_ok and not a.owns_binding and got is not None
                and still is not None and not binding.lease.closed and held >= 4,
                "same_lease": same_lease, "owns_binding": a.owns_binding,
                "lease_open_after_close": still is not None, "held_after_close": held}
    finally:
        binding.close()


def scenario_debug_double_free(**_: Any) -> dict[str, Any]:
    """SGLANG_DEBUG_MEMORY_POOL=1: a double free raises AssertionError in both allocators;
    ours changes nothing."""
    from sglang.srt.mem_cache.allocator.paged import PagedTokenToKVPoolAllocator

    from kvpool.integrations.sglang.allocator import PagedAllocator

    os.environ[DEBUG_ENV] = "1"
    try:
        ref = PagedTokenToKVPoolAllocator(16 * PS, PS, torch.bfloat16, "cpu", None, False)
        ours = PagedAllocator(16 * PS, PS, torch.bfloat16, "cpu", None, False)
    finally:
        os.environ.pop(DEBUG_ENV, None)
    result: dict[str, Any] = {}
    try:
        for name, a in (("sglang", ref), ("kvpool", ours)):
            got = a.alloc(2 * PS)
            a.free(got[:PS])
            before = a.available_size()
            raised = {}
            for how, call in (("free", lambda a=a, got=got: a.free(got[:1])),
                              ("free_page_ids",
                               lambda a=a, got=got: a.free_page_ids(got[:1] // PS)),
                              ("free_page_ids_twice",
                               lambda a=a, got=got: a.free_page_ids(
                                   torch.cat((got[PS:PS + 1], got[PS:PS + 1])) // PS))):
                try:
                    call()
                    raised[how] = "no error"
                except AssertionError:
                    raised[how] = "AssertionError"
                if name == "kvpool":
                    raised[how + "_available"] = a.available_size()
            result[name] = {"raised": raised, "available_before": before}
        k = result["kvpool"]["raised"]
        result["ok"] = (all(v == "AssertionError" for v in result["sglang"]["raised"].values())
                        and all(k[h] == "AssertionError" for h in
                                ("free", "free_page_ids", "free_page_ids_twice"))
                        and all(k[h + "_available"] == result["kvpool"]["available_before"]
                                for h in ("free", "free_page_ids", "free_page_ids_twice")))
    finally:
        ours.close()
    return result


def scenario_double_free(client: Any, pool: str, **_: Any) -> dict[str, Any]:
    """Outside debug mode a double free (and a free of page 0) is skipped: available_size
    does not grow, the whole quota can still be allocated, no page twice."""
    from kvpool.integrations.sglang.allocator import PagedAllocator

    os.environ.pop(DEBUG_ENV, None)
    a = PagedAllocator(8 * PS, PS, torch.bfloat16, "cpu", None, False)
    try:
        got = a.alloc(4 * PS)
        a.free(got[:PS])
        avail = a.available_size()
        a.free(got[:PS])  # again
        a.free(torch.tensor([0, 1, 2], dtype=torch.int64))  # page 0, never handed out
        a.free_page_ids(torch.tensor([int(got[PS]) // PS] * 2))  # listed twice: freed once
        after = a.available_size()
        rest = a.alloc(after)
        pages = np.concatenate((got[2 * PS:].numpy(), rest.numpy())) // PS
        a.clear()
        a.cache.settle(5.0)
        a.lease.report_now()
        lease = lease_stats(client, pool, a.lease.lease_id)
        return {"ok": after == avail + PS and rest is not None
                and np.unique(pages).size == 8 and 0 not in pages
                and a.available_size() == 8 * PS and lease is not None
                and lease.in_use(pool) == 0,
                "available_after_first_free": avail, "available_after_double_frees": after,
                "pages": sorted(np.unique(pages).tolist()),
                "in_use_after_clear": lease.in_use(pool) if lease else None}
    finally:
        a.close()


def scenario_pool_short(small: str, client: Any, **_: Any) -> dict[str, Any]:
    """Two allocators whose quotas together exceed a small pool: once the pool is out, the
    second's alloc returns None with quota left, and changes nothing."""
    from kvpool.integrations.sglang.allocator import PagedAllocator

    saved = os.environ["KVPOOL_POOL"]
    os.environ["KVPOOL_POOL"] = small
    cap = client.stats(small).pool(small).spaces["kv"].capacity
    a = b = None
    try:
        a = PagedAllocator(cap * PS, PS, torch.bfloat16, "cpu", None, False)
        got = a.alloc(cap * PS)
        b = PagedAllocator(cap * PS, PS, torch.bfloat16, "cpu", None, False)
        before = b.available_size()
        short = b.alloc(PS)
        dec = b.alloc_decode(torch.tensor([1]), torch.tensor([1]), torch.tensor([-1]))
        return {"ok": got is not None and short is None and dec is None
                and b.available_size() == before == cap * PS,
                "capacity": cap, "a_got_pages": None if got is None else got.numel() // PS,
                "b_alloc": None if short is None else "ok",
                "b_available": b.available_size()}
    finally:
        os.environ["KVPOOL_POOL"] = saved
        for x in (a, b):
            if x is not None:
                x.close()


def scenario_resize(client: Any, pool: str, **_: Any) -> dict[str, Any]:
    """SGLang's post-capture resize: the quota follows max_total_num_tokens, every page is
    freed; a size above the pool's capacity is refused and changes nothing. Free groups do
    not nest."""
    from kvpool.integrations.sglang.allocator import PagedAllocator

    cap = client.stats(pool).pool(pool).spaces["kv"].capacity
    a = PagedAllocator(16 * PS, PS, torch.bfloat16, "cpu", None, False)
    try:
        a.alloc(8 * PS)
        a.resize(SimpleNamespace(max_total_num_tokens=32 * PS + 1))
        after = {"size": a.size, "num_pages": a.num_pages, "available": a.available_size(),
                 "in_use": a.pages_in_use}
        try:
            a.resize(SimpleNamespace(max_total_num_tokens=(cap + 1) * PS))
            too_big = "no error"
        except Exception as err:
            too_big = type(err).__name__
        a.free_group_begin()
        try:
            a.free_group_begin()
            nested = "no error"
        except AssertionError:
            nested = "AssertionError"
        a.free_group_end()
        return {"ok": after == {"size": 32 * PS + 1, "num_pages": 32, "available": 32 * PS,
                                "in_use": 0}
                and too_big == "InvalidArgument" and a.num_pages == 32
                and nested == "AssertionError",
                "after": after, "too_big": too_big, "nested_group": nested}
    finally:
        a.close()


SCENARIOS: dict[str, Callable[..., dict[str, Any]]] = {
    "page_size_mismatch": scenario_page_size,
    "env_missing": scenario_env_missing,
    "quota_too_big": scenario_quota_too_big,
    "quota": scenario_quota,
    "lease_close": scenario_lease_close,
    "kvcache_binding": scenario_kvcache_binding,
    "debug_double_free": scenario_debug_double_free,
    "double_free": scenario_double_free,
    "pool_short": scenario_pool_short,
    "resize": scenario_resize,
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--pool16", required=True, help="a pool with page_size 16")
    parser.add_argument("--small", required=True, help="a small page_size-4 pool")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--quota-pages", type=int, default=48)
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
    t0 = time.monotonic()
    result: dict[str, Any] = resolve_platform()
    from kvpool.clients.client import KVPoolClient

    pool = os.environ["KVPOOL_POOL"]
    client = KVPoolClient(os.environ["KVPOOL_TARGET"])
    result["import_s"] = round(time.monotonic() - t0, 2)
    runs = []
    for i, seed in enumerate(args.seeds):
        for need_sort in (False, True):
            t = time.monotonic()
            run = differential(seed, need_sort, debug=(i == 0 and need_sort), steps=args.steps,
                               quota_pages=args.quota_pages, client=client, pool=pool)
            run["seconds"] = round(time.monotonic() - t, 2)
            runs.append(run)
    result["differential"] = runs
    scenarios = {}
    for name, fn in SCENARIOS.items():
        t = time.monotonic()
        try:
            scenarios[name] = fn(client=client, pool=pool, pool16=args.pool16, small=args.small)
        except Exception:
            scenarios[name] = {"ok": False, "error": traceback.format_exc()}
        scenarios[name]["seconds"] = round(time.monotonic() - t, 2)
    result["scenarios"] = scenarios
    result["total_s"] = round(time.monotonic() - t0, 2)
    client.close()
    json.dump(result, sys.stdout, indent=1, default=str)
    sys.stdout.write("\n")


if __name__ == "__main__":
    main()
