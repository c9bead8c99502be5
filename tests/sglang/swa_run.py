"""SGLang 0.5.23's hybrid sliding-window pool and allocator, built outside an engine, with or
without kvpool's hooks, for ``tests/integration/sglang/test_swa.py`` (side venv only).

    swa_run.py < job.json

A job (one line of JSON on stdin)::

    {"model": DIR,            # config.json of a hybrid SWA model (the daemon plans from it)
     "pool": "NAME",          # KVPOOL_POOL; "" with "baseline"
     "baseline": false,       # true: SGLang's own pool classes and paged allocator
     "full": 80, "swa": 64,   # SGLang's full and SWA token counts
     "page_size": 4, "head_num": 2, "head_dim": 16,
     "swa_layers": [0, 2], "full_layers": [1, 3],
     "hold": true}            # wait for a line on stdin before ending the binding

It builds ``SWAKVPool`` (kvpool's MHA class as its ``token_to_kv_pool_class`` unless baseline)
and ``SWATokenToKVPoolAllocator`` with the arguments SGLang's configurator passes, then runs
one fixed sequence of SGLang's allocator calls: a prefill of two requests (11 and 5 tokens),
six decode steps, a window slide of the first request (``free_swa`` of its first two pages),
one of the second (``free_swa_segment`` of its first page in a free group, as the scheduler
slides windows), then the second request freed. After each call it writes K/V through SGLang's own
``set_kv_buffer`` (the value of a token is ``1000 * (layer + 1) + position`` plus ``0.5`` for
V, for request 0; ``-`` that for request 1) and reports the allocator's sizes (``step``
events). Events on stdout are ``HARNESS {json}``: ``built`` (classes, the mapping's data
pointer is the daemon view's), ``step``, ``state`` (token slots of each request, the mapping,
the values SGLang reads back through its pools), ``holding``, ``closed``.
"""

from __future__ import annotations

import json
import os
import sys
from types import SimpleNamespace
from typing import Any

from stub_probes import hide_stubs  # beside this script


def emit(event: str, **fields: Any) -> None:
    print("HARNESS " + json.dumps({"event": event, **fields}), flush=True)


def value(layer: int, pos: int, req: int) -> float:
    return (1.0 if req == 0 else -1.0) * (1000 * (layer + 1) + pos)


def run(job: dict[str, Any]) -> None:
    hide_stubs()
    import torch
    from sglang.srt.mem_cache.allocator.swa import SWATokenToKVPoolAllocator
    from sglang.srt.mem_cache.memory_pool import KVWriteLoc, MHATokenToKVPool
    from sglang.srt.mem_cache.swa_memory_pool import SWAKVPool

    from kvpool.integrations.sglang import daemon_pool, platform, pools

    os.environ["KVPOOL_POOL"] = job.get("pool", "")
    if job.get("baseline"):
        # The same platform, SGLang's own memory: the hooks answer None.
        platform.KVPoolHooks.get_paged_allocator_cls = lambda self: None  # type: ignore
        pool_cls: type = MHATokenToKVPool
    else:
        pool_cls = pools.pool_class("mha")
    settings = daemon_pool.EngineSettings(model_path=job["model"], context_length=128)
    daemon_pool.engine_settings = lambda: settings  # type: ignore[assignment]
    from kvpool.integrations.sglang import swa

    swa.engine_settings = lambda: settings  # type: ignore[assignment]
    ps, full, size_swa = job["page_size"], job["full"], job["swa"]
    dtype = torch.float32
    try:
        pool = SWAKVPool(
            size=full, size_swa=size_swa, page_size=ps, dtype=dtype,
            head_num=job["head_num"], head_dim=job["head_dim"],
            swa_attention_layer_ids=job["swa_layers"],
            full_attention_layer_ids=job["full_layers"], device="cpu",
            enable_kv_cache_copy=False, token_to_kv_pool_class=pool_cls,
            enable_memory_saver=False)
        alloc = SWATokenToKVPoolAllocator(full, size_swa, ps, dtype, "cpu", pool, False)
    except Exception as exc:
        emit("built", ok=False, error=f"{type(exc).__name__}: {exc}")
        return
    view = getattr(pool.swa_kv_pool, "kvpool_mapping", None)
    emit("built", ok=True, pool=type(pool.full_kv_pool).__qualname__,
         inner=type(alloc.full_attn_allocator).__qualname__,
         spaces=[getattr(a, "space", None) for a in (alloc.full_attn_allocator,
                                                     alloc.swa_attn_allocator)],
         mapping_in_daemon=view is not None and view.data_ptr()
         == alloc.full_to_swa_index_mapping.data_ptr(),
         mapping_len=int(alloc.full_to_swa_index_mapping.shape[0]))
    layers = sorted(job["swa_layers"] + job["full_layers"])
    heads, dim = job["head_num"], job["head_dim"]
    slots: list[list[int]] = [[], []]

    def write(loc: torch.Tensor, owners: list[tuple[int, int]]) -> None:
        swa_loc = alloc.translate_loc_from_full_to_swa(loc)
        for layer in layers:
            k = torch.tensor([value(layer, pos, req) for req, pos in owners], dtype=dtype)
            k = k[:, None, None].expand(len(owners), heads, dim).contiguous()
            pool.set_kv_buffer(SimpleNamespace(layer_id=layer), KVWriteLoc(loc, swa_loc),
                               k, k + 0.5)

    def step(name: str, ok: bool) -> None:
        emit("step", name=name, ok=ok, available=alloc.available_size(),
             full=alloc.full_available_size(), swa=alloc.swa_available_size())

    lens = [11, 5]
    prefix = torch.zeros(2, dtype=torch.int64)
    seq = torch.tensor(lens, dtype=torch.int64)
    out = alloc.alloc_extend(prefix, prefix, seq, seq, torch.tensor([-1, -1]), sum(lens))
    step("prefill", out is not None)
    assert out is not None
    slots[0], slots[1] = out[:11].tolist(), out[11:].tolist()
    write(out, [(0, p) for p in range(11)] + [(1, p) for p in range(5)])
    for i in range(6):
        lens = [n + 1 for n in lens]
        seq = torch.tensor(lens, dtype=torch.int64)
        last = torch.tensor([slots[0][-1], slots[1][-1]], dtype=torch.int64)
        out = alloc.alloc_decode(seq, seq, last)
        step(f"decode{i}", out is not None)
        assert out is not None
        for r in range(2):
            slots[r].append(int(out[r]))
        write(out, [(0, lens[0] - 1), (1, lens[1] - 1)])
    # The window slid past request 0's first two pages: their SWA side goes back.
    alloc.free_swa(torch.tensor(slots[0][:2 * ps], dtype=torch.int64))
    step("free_swa", True)
    # The scheduler's own window slide (free_swa_out_of_window_slots): a kv-row segment of
    # request 1, its first page, inside a free group as the scheduler runs it.
    alloc.free_group_begin()
    alloc.free_swa_segment(torch.tensor(slots[1][:ps], dtype=torch.int64), start_pos=0)
    alloc.free_group_end()
    step("free_swa_segment", True)
    reads: dict[str, list[float]] = {}
    for layer in layers:
        locs = torch.tensor(slots[0] + slots[1], dtype=torch.int64)
        sub, is_swa = pool.layers_mapping[layer]
        side = pool.swa_kv_pool if is_swa else pool.full_kv_pool
        where = alloc.translate_loc_from_full_to_swa(locs) if is_swa else locs
        reads[str(layer)] = side.k_buffer[sub][where, 0, 0].tolist()
    mapping = alloc.full_to_swa_index_mapping
    emit("state", slots=slots, mapping=mapping.tolist(), reads=reads,
         swa_slots=[alloc.translate_loc_from_full_to_swa(
             torch.tensor(s, dtype=torch.int64)).tolist() for s in slots])
    if job.get("hold"):
        held = {}
        for inner in (alloc.full_attn_allocator, alloc.swa_attn_allocator):
            inner.cache.settle(10.0)  # the page cache's worker idle: its counts stay put
            held[inner.space] = {"in_use": int(inner.pages_in_use),
                                 "cached": int(inner.cache.cached)}
        emit("holding", pid=os.getpid(), lease_id=int(alloc.full_attn_allocator.lease.lease_id),
             held=held)
        sys.stdin.readline()
    alloc.free(torch.tensor(slots[1], dtype=torch.int64))
    step("free1", True)
    binding = getattr(pool.full_kv_pool, "kvpool_binding", None)
    if binding is not None:
        binding.close()
    emit("closed")


def main() -> int:
    run(json.loads(sys.stdin.readline()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
