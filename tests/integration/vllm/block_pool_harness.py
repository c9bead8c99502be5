"""vLLM 0.32's ``BlockPool`` with kvpool's free-block queue against the same ``BlockPool`` with
its own, in the vLLM side venv.

Run by ``tests/integration/vllm/test_block_pool.py`` (never by pytest itself) with the side
venv's python, this checkout's ``client/`` on PYTHONPATH and a real kvpoold's target::

    block_pool_harness.py --target unix:///tmp/x/kvpool.sock --seeds 0 1 2 --steps 400

It configures its pools in that daemon (a tiny MHA spec, page size = block size, the ``kv``
space sized to vLLM's block count), then:

- ``differential``: per seed (and with prefix caching on, and off for seed 0), two vLLM
  ``BlockPool``s, one as vLLM builds it and one given a ``KVPoolFreeBlockQueue`` over a page
  cache of a lease from ``binding_from_env`` (``use_page_cache``), get the same random calls
  the scheduler makes on its block pool:
  admitting a request (prefix lookup with ``get_cached_block``, ``touch`` of the hits,
  ``get_new_blocks`` for the rest, ``cache_full_blocks``), growing one by a block, raw
  ``get_new_blocks`` (asking more than is free too), ``free_blocks`` (in vLLM's reverse
  order), ``evict_blocks`` of a cached block, ``reset_prefix_cache``. After every call it
  records any difference (success/failure, prefix-hit length, ``get_num_free_blocks``) and any
  broken invariant of the adapter (block 0 or an id out of range handed out, an id held by two
  requests, the lease's count off); at checkpoints the daemon's Stats of the lease (held =
  blocks in use + the queue + the page cache's spare; in use = blocks in use + the queue);
  after the binding closes, the pool's ``kv`` pages in use (0).
- ``scenarios``: a pool with a different page count (refused, both numbers named); a shared
  pool running short (a second lease takes pages); vLLM's real ``Scheduler`` built with
  ``scheduler_cls="kvpool.integrations.vllm.scheduler.KVPoolScheduler"``, serving a request
  from the pool's pages, then shut down (lease ended, pages back).

Writes one JSON report to ``--out`` (vLLM logs on stdout).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import tempfile
import traceback
from collections import Counter
from typing import Any

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

from vllm.sampling_params import SamplingParams
from vllm.utils.hashing import sha256
from vllm.v1.core.block_pool import BlockPool
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
from vllm.v1.request import Request

from kvpool.clients.client import KVPoolClient
from kvpool.contract.errors import KVPoolError
from kvpool.integrations.vllm.block_pool import use_page_cache
from kvpool.integrations.vllm.engine_core_binding import binding_from_env

SPEC: dict[str, Any] = {"num_layers": 2, "attention": {"type": "mha", "num_kv_heads": 2,
                                                        "head_dim": 16},
                        "context_length": 4096}
BS = 4  # block size of the differential runs
NUM_BLOCKS = 48  # vLLM's num_gpu_blocks (null block included): 47 pages in the pool
POOL = "vblocks"
MISMATCH_POOL = "vblocks-small"
SHARED_POOL = "vblocks-shared"

init_none_hash(sha256)
HASHER = get_request_block_hasher(BS, sha256)


def configure(client: KVPoolClient, name: str, pages: int, page_size: int) -> None:
    """A pool whose ``kv`` space has ``pages`` ids (``1..pages``) of ``page_size`` tokens."""
    client.configure(name, spec=SPEC, max_total_tokens=pages * page_size, page_size=page_size,
                     max_running_requests=4)


def error_of(err: BaseException) -> dict[str, Any]:
    return {"type": type(err).__name__, "message": str(err)}


# -- the differential run ---------------------------------------------------------------------

class Run:
    """One seeded run of both pools; see the module docstring."""

    def __init__(self, seed: int, steps: int, caching: bool, env: dict[str, str]) -> None:
        self.rng = random.Random(seed)
        self.steps = steps
        self.caching = caching
        self.binding = binding_from_env(env)
        self.lease = self.binding.lease
        self.cache = self.lease.page_cache(self.binding.pool, "kv", background=False)
        self.ref = BlockPool(NUM_BLOCKS, caching, BS)
        self.kv = BlockPool(NUM_BLOCKS, caching, BS)
        self.queue = use_page_cache(self.kv, self.cache)
        self.binding.on_close(self.queue.close)
        # live requests: name -> (Request, vLLM's blocks, kvpool's blocks)
        self.live: dict[str, tuple[Request, list[Any], list[Any]]] = {}
        self.prefixes = [[self.rng.randrange(1000) for _ in range(BS * self.rng.randint(1, 4))]
                         for _ in range(4)]
        self.hashes: list[Any] = []  # every block hash a request had, for evictions
        self.ops: Counter[str] = Counter()
        self.mismatches: list[dict[str, Any]] = []
        self.invariant_errors: list[str] = []
        self.checkpoints: list[dict[str, Any]] = []
        self.refusals = 0
        self.hits = 0
        self.evicted_by_reuse = 0
        self.resets: list[dict[str, int]] = []  # successful resets: the queue's held blocks
        self.n = 0

    def mismatch(self, op: str, **what: Any) -> None:
        if len(self.mismatches) < 20:
            self.mismatches.append({"step": self.n, "op": op, **what})

    # one call on both pools, with the outcome compared
    def both(self, op: str, call: Any) -> tuple[Any, Any] | None:
        outs = []
        for pool in (self.ref, self.kv):
            try:
                outs.append(("ok", call(pool)))
            except ValueError as err:
                outs.append(("ValueError", str(err)))
        (ref_kind, ref_out), (kv_kind, kv_out) = outs
        if ref_kind != kv_kind:
            self.mismatch(op, vllm=ref_kind, kvpool=kv_kind, detail=[ref_out, kv_out])
            return None
        if ref_kind != "ok":
            self.refusals += 1
            return None
        return ref_out, kv_out

    def request(self) -> Request:
        tokens = list(self.rng.choice(self.prefixes))
        tokens += [self.rng.randrange(1000) for _ in range(self.rng.randint(0, 3 * BS))]
        if not tokens:
            tokens = [1]
        req = Request(f"q{self.n}", tokens, SamplingParams(max_tokens=1), None,
                      block_hasher=HASHER)
        self.hashes.extend(req.block_hashes)
        return req

    @staticmethod
    def longest_hit(pool: BlockPool, req: Request) -> list[Any]:
        hit: list[Any] = []
        for h in req.block_hashes:
            got = pool.get_cached_block(h, [0])
            if got is None:
                break
            hit.append(got[0])
        return hit

    def admit(self) -> None:
        req = self.request()
        need_total = -(-req.num_tokens // BS)
        if not self.caching:
            hits: tuple[list[Any], list[Any]] = ([], [])
        else:
            hits = (self.longest_hit(self.ref, req), self.longest_hit(self.kv, req))
        if len(hits[0]) != len(hits[1]):
            self.mismatch("admit/hit", vllm=len(hits[0]), kvpool=len(hits[1]))
            return
        # what the scheduler's allocate_slots counts: the new blocks and the free hits
        evictable = [sum(1 for b in h if b.ref_cnt == 0) for h in hits]
        if evictable[0] != evictable[1]:
            self.mismatch("admit/evictable", vllm=evictable[0], kvpool=evictable[1])
            return
        new = need_total - len(hits[0])
        fits = [new + e <= p.get_num_free_blocks() for p, e in zip((self.ref, self.kv),
                                                                 evictable, strict=True)]
        if fits[0] != fits[1]:
            self.mismatch("admit/fits", vllm=fits[0], kvpool=fits[1])
            return
        if not fits[0]:
            self.refusals += 1
            return
        self.hits += len(hits[0])
        blocks: list[list[Any]] = []
        for pool, hit in zip((self.ref, self.kv), hits, strict=True):
            pool.touch(hit)
            blocks.append(hit + pool.get_new_blocks(new))
        if self.caching:
            for pool, blks in zip((self.ref, self.kv), blocks, strict=True):
                pool.cache_full_blocks(req, blks, len(hits[0]), req.num_tokens // BS, BS, 0)
        self.live[req.request_id] = (req, blocks[0], blocks[1])

    def grow(self) -> None:
        hashed = sorted(n for n in self.live if n.startswith("q"))
        if not hashed:
            return self.admit()
        name = self.rng.choice(hashed)
        req, ref_blocks, kv_blocks = self.live[name]
        got = self.both("grow", lambda p: p.get_new_blocks(1))
        if got is None:
            return None
        before = req.num_tokens // BS
        req.append_output_token_ids([self.rng.randrange(1000) for _ in range(BS)])
        self.hashes.extend(req.block_hashes[before:])
        ref_blocks += got[0]
        kv_blocks += got[1]
        if self.caching:
            for pool, blks in ((self.ref, ref_blocks), (self.kv, kv_blocks)):
                pool.cache_full_blocks(req, blks, before, min(len(blks),
                                                              req.num_tokens // BS), BS, 0)
        return None

    def raw(self) -> None:
        n = self.rng.randint(0, self.ref.get_num_free_blocks() + 3)
        got = self.both("get_new_blocks", lambda p: p.get_new_blocks(n))
        if got is not None:
            req = Request(f"raw{self.n}", [0], SamplingParams(max_tokens=1), None)
            self.live[req.request_id] = (req, got[0], got[1])

    def free(self) -> None:
        if not self.live:
            return
        name = self.rng.choice(sorted(self.live))
        _, ref_blocks, kv_blocks = self.live.pop(name)
        self.ref.free_blocks(reversed(ref_blocks))
        self.kv.free_blocks(reversed(kv_blocks))

    def evict(self) -> None:
        if not self.hashes:
            return
        h = self.rng.choice(self.hashes)
        found = [p.get_cached_block(h, [0]) for p in (self.ref, self.kv)]
        if (found[0] is None) != (found[1] is None):
            self.mismatch("evict/lookup", vllm=found[0] is not None, kvpool=found[1] is not None)
            return
        if found[0] is not None and found[1] is not None:
            self.ref.evict_blocks({found[0][0].block_id})
            self.kv.evict_blocks({found[1][0].block_id})

    def reset(self) -> None:
        held = self.queue.held_free
        a, b = self.ref.reset_prefix_cache(), self.kv.reset_prefix_cache()
        if a != b:
            self.mismatch("reset_prefix_cache", vllm=a, kvpool=b)
        elif b:
            # the blocks the reset emptied go back to the pool at the next step
            self.queue.new_step()
            self.resets.append({"held_before": held, "held_after": self.queue.held_free,
                                "in_use": int(self.cache.core.in_use)})

    def check(self, op: str) -> None:
        a, b = self.ref.get_num_free_blocks(), self.kv.get_num_free_blocks()
        if a != b:
            self.mismatch(op + "/free", vllm=a, kvpool=b)
        ids: Counter[int] = Counter()
        for _, _, blks in self.live.values():
            ids.update(b.block_id for b in blks)
        errors = self.invariant_errors
        bad = [i for i in ids if not 1 <= i < NUM_BLOCKS]
        if bad:
            errors.append(f"step {self.n} ({op}): block ids {bad[:5]} handed out (null or out "
                          "of range)")
        in_use = sum(1 for b in self.kv.blocks if b.ref_cnt > 0 and not b.is_null)
        if in_use != self.queue.blocks_in_use:
            errors.append(f"step {self.n} ({op}): {in_use} blocks referenced but the lease "
                          f"counts {self.queue.blocks_in_use} in use")
        ref_used = NUM_BLOCKS - 1 - sum(1 for b in self.ref.blocks
                                         if b.ref_cnt == 0 and not b.is_null)
        if ref_used != in_use:
            errors.append(f"step {self.n} ({op}): vLLM references {ref_used} blocks, kvpool "
                          f"{in_use}")
        del errors[20:]

    def checkpoint(self) -> None:
        self.cache.settle(10.0)
        self.lease.report_now()
        stats = self.binding.client.stats(self.binding.pool)
        mine = next(s for s in stats.leases if s.lease_id == self.lease.lease_id)
        self.checkpoints.append({
            "step": self.n,
            "held": mine.held.get(self.binding.pool, {}).get("kv", 0),
            "reported_in_use": mine.in_use(self.binding.pool),
            "blocks_in_use": self.queue.blocks_in_use,
            "queue": self.queue.held_free,
            "spare": int(self.cache.core.cached),
        })

    def run(self) -> None:
        ops = [("admit", self.admit, 5), ("grow", self.grow, 2), ("raw", self.raw, 2),
               ("free", self.free, 5), ("evict", self.evict, 1), ("reset", self.reset, 1)]
        names = [o[0] for o in ops]
        weights = [o[2] for o in ops]
        calls = {o[0]: o[1] for o in ops}
        for step in range(self.steps):
            self.n = step
            name = self.rng.choices(names, weights)[0]
            if name == "reset" and self.rng.random() < 0.7:
                # free everything first now and then, so resets succeed too
                while self.live:
                    self.free()
            calls[name]()
            self.ops[name] += 1
            self.check(name)
            self.queue.new_step()  # the scheduler's next step: the page cache's upkeep
            if self.n % 50 == 49:
                self.checkpoint()
        while self.live:
            self.free()
        self.check("drain")
        self.checkpoint()

    def close(self) -> int:
        """Close the binding; return the pool's kv pages still in use afterwards."""
        pool = self.binding.pool
        target = self.binding.client.target
        self.binding.close()
        with KVPoolClient(target) as other:
            return other.stats(pool).pool(pool).spaces["kv"].used


def differential(seed: int, steps: int, caching: bool, env: dict[str, str]) -> dict[str, Any]:
    out: dict[str, Any] = {"seed": seed, "caching": caching, "error": None}
    run = None
    try:
        run = Run(seed, steps, caching, env)
        run.run()
    except Exception:
        out["error"] = traceback.format_exc()[-4000:]
    finally:
        if run is not None:
            try:
                out["used_after_close"] = run.close()
            except Exception:
                out["error"] = (out["error"] or "") + traceback.format_exc()[-2000:]
    if run is not None:
        out.update(ops=dict(run.ops), mismatches=run.mismatches,
                   invariant_errors=run.invariant_errors, checkpoints=run.checkpoints,
                   refusals=run.refusals, hits=run.hits, resets=run.resets)
    return out


# -- scenarios --------------------------------------------------------------------------------

def mismatch_scenario(env: dict[str, str]) -> dict[str, Any]:
    binding = binding_from_env({**env, "KVPOOL_POOL": MISMATCH_POOL})
    try:
        cache = binding.lease.page_cache(MISMATCH_POOL, "kv")
        try:
            use_page_cache(BlockPool(NUM_BLOCKS, True, BS), cache)
        except KVPoolError as err:
            return {"ok": True, **error_of(err)}
        finally:
            cache.close()
        return {"ok": False, "message": "a pool of the wrong size was accepted"}
    finally:
        binding.close()


def shared_scenario(env: dict[str, str]) -> dict[str, Any]:
    """Two leases on one pool of NUM_BLOCKS - 1 pages: the engine's quota promises all of them;
    another lease takes some first, so the engine's get_new_blocks runs short: it refuses with
    vLLM's ValueError (naming the pool), and then counts only what it holds until new_step."""
    binding = binding_from_env({**env, "KVPOOL_POOL": SHARED_POOL})
    other = binding.client.lease("hog", ttl_s=30)
    out: dict[str, Any] = {}
    try:
        cache = binding.lease.page_cache(SHARED_POOL, "kv", high=4, low=0, batch=1,
                                         background=False)
        pool = BlockPool(NUM_BLOCKS, True, BS)
        queue = use_page_cache(pool, cache)
        binding.on_close(queue.close)
        cache.settle(10.0)
        out["free_before"] = pool.get_num_free_blocks()
        hog = other.allocate(SHARED_POOL, "kv", NUM_BLOCKS - 1 - int(cache.core.cached) - 8)
        out["hogged"] = int(hog.shape[0])
        out["free_promised"] = pool.get_num_free_blocks()
        try:
            pool.get_new_blocks(out["free_promised"])
            out["refused"] = None
        except ValueError as err:
            out["refused"] = str(err)
        out["short"] = queue.short
        out["free_while_short"] = pool.get_num_free_blocks()
        out["spare"] = int(cache.core.cached)
        got = pool.get_new_blocks(out["free_while_short"])
        out["got_while_short"] = len(got)
        out["ids_ok"] = all(1 <= b.block_id < NUM_BLOCKS for b in got)
        pool.free_blocks(got)
        other.free(SHARED_POOL, "kv", hog)
        queue.new_step()
        out["free_after_new_step"] = pool.get_num_free_blocks()
    finally:
        other.close()
        binding.close()
    return out


TINY_LLAMA = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 128,
    "intermediate_size": 256, "num_attention_heads": 4, "num_key_value_heads": 2,
    "num_hidden_layers": 2, "vocab_size": 512, "max_position_embeddings": 1024,
    "rms_norm_eps": 1e-5, "torch_dtype": "float32", "tie_word_embeddings": False,
}


def scheduler_scenario(env: dict[str, str], num_blocks: int) -> dict[str, Any]:
    """vLLM's own Scheduler class resolution and __init__ with KVPoolScheduler: the block pool
    is kvpool's, a request's blocks are pages the lease holds, shutdown ends the lease."""
    import torch
    from vllm.engine.arg_utils import EngineArgs
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
    from vllm.v1.structured_output import StructuredOutputManager

    model_dir = tempfile.mkdtemp(prefix="kvpool-vllm-")
    out: dict[str, Any] = {}
    try:
        with open(os.path.join(model_dir, "config.json"), "w") as f:
            json.dump(TINY_LLAMA, f)
        args = EngineArgs(model=model_dir, skip_tokenizer_init=True, enforce_eager=True,
                          load_format="dummy", max_model_len=512, max_num_seqs=4,
                          max_num_batched_tokens=512, num_gpu_blocks_override=num_blocks,
                          scheduler_cls="kvpool.integrations.vllm.scheduler.KVPoolScheduler",
                          async_scheduling=False)
        config = args.create_engine_config()
        config.cache_config.num_gpu_blocks = num_blocks  # what the engine core sets
        block_size = int(config.cache_config.block_size)
        out["block_size"] = block_size
        pool = f"vsched{block_size}"
        with KVPoolClient(env["KVPOOL_TARGET"]) as client:
            configure(client, pool, num_blocks - 1, block_size)
            configure(client, pool + "-wrong", num_blocks + 3, block_size)
        cls = config.scheduler_config.get_scheduler_cls()
        out["scheduler_cls"] = f"{cls.__module__}.{cls.__qualname__}"
        kv_config = KVCacheConfig(
            num_blocks=num_blocks, kv_cache_tensors=[],
            kv_cache_groups=[KVCacheGroupSpec(
                ["model.layers.0.self_attn.attn", "model.layers.1.self_attn.attn"],
                FullAttentionSpec(block_size=block_size, num_kv_heads=2, head_size=32,
                                  dtype=torch.float32))])

        def build(pool_name: str) -> Any:
            os.environ.update({**env, "KVPOOL_POOL": pool_name})
            return cls(vllm_config=config, kv_cache_config=kv_config,
                       structured_output_manager=StructuredOutputManager(config),
                       block_size=block_size)

        try:
            build(pool + "-wrong")
            out["wrong_size"] = {"ok": False}
        except KVPoolError as err:
            out["wrong_size"] = {"ok": True, **error_of(err)}
        sched = build(pool)
        bp = sched.kv_cache_manager.block_pool
        out["block_pool"] = type(bp).__name__
        out["free_queue"] = type(bp.free_block_queue).__name__
        managers = sched.kv_cache_manager.coordinator.single_type_managers
        out["managers_use_it"] = (
            sched.kvpool_blocks is bp.free_block_queue
            and sched.kv_cache_manager.coordinator.block_pool is bp
            and all(m.block_pool is bp and m._null_block is bp.null_block for m in managers))
        out["free_blocks"] = bp.get_num_free_blocks()
        binding = sched.kvpool_binding
        out["lease_name"] = binding.lease_name
        prompt = list(range(1, 3 * block_size + 2))
        req = Request("q0", prompt, SamplingParams(max_tokens=4), None,
                      block_hasher=get_request_block_hasher(block_size, sha256))
        sched.add_request(req)
        output = sched.schedule()
        new = output.scheduled_new_reqs
        ids = list(new[0].block_ids[0]) if new else []
        out["block_ids"] = ids
        out["free_after_schedule"] = bp.get_num_free_blocks()
        cache = sched.kvpool_blocks.cache
        cache.settle(10.0)
        binding.lease.report_now()
        with KVPoolClient(env["KVPOOL_TARGET"]) as client:
            stats = client.stats(pool)
            mine = next(s for s in stats.leases if s.lease_id == binding.lease.lease_id)
            out["lease_in_use"] = mine.in_use(pool)
            out["lease_holds_ids"] = bool(ids) and all(
                bool(x) for x in cache.in_use_of(ids))
            lease_id = binding.lease.lease_id
            sched.shutdown()
            after = client.stats(pool)
            out["lease_gone"] = all(s.lease_id != lease_id for s in after.leases)
            out["used_after_shutdown"] = after.pool(pool).spaces["kv"].used
        # Under async scheduling the dotted KVPoolScheduler makes the async flavour (vLLM's
        # own choice would be its AsyncScheduler).
        from kvpool.integrations.vllm.scheduler import KVPoolAsyncScheduler

        config.scheduler_config.async_scheduling = True
        follows = build(pool)
        fbp = follows.kv_cache_manager.block_pool
        out["async_follows"] = {"cls": type(follows).__name__,
                                "free_queue": type(fbp.free_block_queue).__name__,
                                # vLLM's reset through the scheduler (kvpool's step around it)
                                "reset": follows.reset_prefix_cache(reset_running_requests=True)}
        follows.shutdown()
        config.scheduler_config.async_scheduling = False
        # The class itself (not its name) as scheduler_cls, and the async flavour.

        config.scheduler_config.scheduler_cls = KVPoolAsyncScheduler
        cls = config.scheduler_config.get_scheduler_cls()
        asched = build(pool)
        abp = asched.kv_cache_manager.block_pool
        areq = Request("q1", prompt, SamplingParams(max_tokens=4), None,
                       block_hasher=get_request_block_hasher(block_size, sha256))
        asched.add_request(areq)
        anew = asched.schedule().scheduled_new_reqs
        alease = asched.kvpool_binding.lease.lease_id
        out["async"] = {"cls": cls.__name__, "free_queue": type(abp.free_block_queue).__name__,
                        "block_ids": list(anew[0].block_ids[0]) if anew else []}
        asched.shutdown()
        with KVPoolClient(env["KVPOOL_TARGET"]) as client:
            after = client.stats(pool)
            out["async"]["lease_gone"] = all(s.lease_id != alease for s in after.leases)
            out["async"]["used_after_shutdown"] = after.pool(pool).spaces["kv"].used
    except Exception:
        out["error"] = traceback.format_exc()[-4000:]
    finally:
        shutil.rmtree(model_dir, ignore_errors=True)
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--target", required=True)
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--steps", type=int, default=400)
    ap.add_argument("--scheduler-blocks", type=int, default=40)
    ap.add_argument("--out", required=True, help="where the JSON report goes (vLLM logs on "
                    "stdout)")
    args = ap.parse_args()
    env = {"KVPOOL_TARGET": args.target, "KVPOOL_POOL": POOL, "KVPOOL_LEASE_TTL_S": "30"}
    with KVPoolClient(args.target) as client:
        configure(client, POOL, NUM_BLOCKS - 1, BS)
        configure(client, MISMATCH_POOL, NUM_BLOCKS - 9, BS)
        configure(client, SHARED_POOL, NUM_BLOCKS - 1, BS)
    report: dict[str, Any] = {"differential": [], "scenarios": {}}
    for seed in args.seeds:
        report["differential"].append(differential(seed, args.steps, True, env))
    report["differential"].append(differential(args.seeds[0], args.steps, False, env))
    for name, fn in (("mismatch", lambda: mismatch_scenario(env)),
                     ("shared", lambda: shared_scenario(env)),
                     ("scheduler", lambda: scheduler_scenario(env, args.scheduler_blocks))):
        try:
            report["scenarios"][name] = fn()
        except Exception:
            report["scenarios"][name] = {"error": traceback.format_exc()[-4000:]}
    with open(args.out, "w") as f:
        json.dump(report, f)


if __name__ == "__main__":
    main()
