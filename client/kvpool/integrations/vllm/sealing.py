"""vLLM 0.32's KV-cache blocks that outlive their engine: seal, fence, adopt (docs/restart.md).

A vLLM engine on kvpool (``KVPoolConnector``: the KV cache is the pool's memory;
``KVPoolScheduler``: the blocks are the engine core's lease's pages) **seals** every full block
vLLM caches for prefix reuse, once its KV is written, and a later engine of the same layout
**adopts** them into vLLM's own block-hash map, zero-copy: its requests' prefix lookups find
them and ``RequestOutput.num_cached_tokens`` counts them.

Seal. vLLM names a block's content itself: a full block gets its hash in
``BlockPool.cache_full_blocks`` (the only place; block_pool.py), the hash chaining the
block's tokens, its parent's hash and its extra keys (LoRA, multimodal, cache salt, prompt
embeds). :class:`BlockSealer` wraps that method of the engine's block pool (the instance; no
vLLM file changes) and records each block vLLM caches: O(new blocks). vLLM caches a block
when the step that computes it is *scheduled* (``allocate_slots``), or, under async
scheduling, when a step's output arrives while the next step may still be writing it; so a
record waits for its fence: the last step scheduled when it was made. When that step's output
is processed (``update_from_output``) the records whose request was in that step and whose
block still has the hash are sealed, in one ``Seal`` call per step (split at 8 MiB): key =
vLLM's ``BlockHash`` (32 bytes with sha256), parent = the previous block's hash (32 zero bytes
for the first), tokens = the block's token ids.

Never write a sealed block. A sealed block stays in vLLM's cache while vLLM wants it; when
vLLM evicts it to reuse it, kvpool's free-block queue first has it unsealed
(:meth:`~kvpool.integrations.vllm.block_pool.KVPoolFreeBlockQueue.popleft_n`): a block whose
Seal call has not left yet is simply not sealed; otherwise one ``Unseal`` call, for it and the
sealed blocks next in vLLM's eviction order, takes them out of the daemon's directory (the
lease keeps them) and returns before vLLM writes them. A sealed block freed without a hash (a
prefix-cache reset) goes back to the daemon, whose directory keeps it, never into the page
cache.

Fence. The daemon adopts a page only once the sealing lease has ended and every process
registered under it for the pool has exited. The blocks are the engine core's lease's, the
writes its workers'; so the engine core attaches the pool under its lease (no mapping) and
registers itself on the daemon's descriptor socket, and tells the workers its lease in the
connector's metadata (``KVPoolConnector``), each worker registering itself under it before its
first forward and reporting back; blocks are sealed only once every worker has
(``parallel_config.world_size`` reports). The daemon's attachment table stays the one record
of who can write the pages.

Adopt. At start (unless ``KVPOOL_ADOPT=0``) the engine core adopts the pool's sealed blocks
of its layout (repeating until none come) and puts each whose chain reaches a first block in
vLLM's hash map, as a free cached block at the back of vLLM's queue (children first, so they
are evicted before their parents); a block whose chain is broken goes back to the daemon.
While sealed blocks of another engine wait for its processes (a frozen engine), adoption is
tried again between steps, at most every ``ADOPT_RETRY_S``.

Layout: what must match for another engine to read a block as this one wrote it (the pool's
fingerprint already covers the geometry): vLLM's version, the model (vLLM's own
``ModelConfig.compute_hash``: model, revision, dtype, quantization, ...), the KV dtype, block
size, hash algorithm and its first-block seed, the extra keys vLLM hashes, TP and PP ranks.

Refused (one log line, nothing sealed or adopted): prefix caching off; a hash that is not the
same in another process (``xxhash``, ``xxhash_cbor``: 128-bit hashes with a per-process random
seed); a hybrid KV cache (several groups, sliding window, Mamba) or decode/prefill context
parallelism; a KV cache that is not the pool's memory (no ``KVPoolConnector``).

Environment: ``KVPOOL_SEAL=0`` seals nothing; ``KVPOOL_ADOPT=0`` adopts nothing.

Importing this module imports vLLM (the ``kvpool[vllm]`` extra).
"""

from __future__ import annotations

import logging
import os
import sys
import threading
import time
from collections import OrderedDict, deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import PurePath
from typing import Any

import numpy as np
from vllm.v1.core.kv_cache_utils import (
    KVCacheBlock,
    make_block_hash_with_group_id,
    resolve_none_hash_seed,
)
from vllm.v1.kv_cache_interface import FullAttentionSpec

from kvpool.contract.errors import InvalidArgument, KVPoolError
from kvpool.contract.fd_channel import FdAsk
from kvpool.contract.limits import KEY_BYTES
from kvpool.integrations.pool_binding import number_from
from kvpool.integrations.vllm.block_pool import KVPoolFreeBlockQueue

log = logging.getLogger("kvpool.integrations.vllm.sealing")


@dataclass(frozen=True)
class Writers:
    """The engine core's lease, for its workers to register under (the fence of its sealed
    blocks): the daemon's descriptor socket, the pool, the lease (id, secret in hex) and how
    many workers must register. ``KVPoolConnector``'s metadata carries it to the workers."""

    fd_socket: str
    pool: str
    lease_id: int
    secret: str
    workers: int

    def ask(self) -> FdAsk:
        """The registration ask (the daemon learns the asking process's pid from the
        kernel)."""
        return FdAsk(pool=self.pool, lease_id=self.lease_id, secret=self.secret, register=True)

SEAL_ENV = "KVPOOL_SEAL"
ADOPT_ENV = "KVPOOL_ADOPT"
# Hash algorithms whose block hashes another process computes the same (vLLM derives the
# first block's seed from a fixed string, or PYTHONHASHSEED, for these only).
PROCESS_INDEPENDENT = frozenset({"sha256", "sha256_cbor"})
# The extra keys vLLM 0.32 hashes into a block (kv_cache_utils.generate_block_hash_extra_keys).
EXTRA_KEYS = "lora+mm+cache_salt+prompt_embeds"
ZERO_KEY = bytes(KEY_BYTES)
ADOPT_RETRY_S = 2.0
SEAL_BYTES = 8 << 20  # the daemon's limit of one Seal request
DELAY_ENV = "KVPOOL_SEAL_DELAY_S"
# A written block is sealed once it has stayed this long in vLLM's cache: one vLLM reuses or
# frees sooner is never sealed (no call for it; under heavy eviction most blocks live less),
# and an engine killed loses at most this much of its newest blocks for the restart.
DEFAULT_DELAY_S = 1.0


def flag(env: Mapping[str, str], name: str) -> bool:
    """An on/off variable: unset, ``1``/``true``/``yes``/``on`` on; ``0``/``false``/``no``/
    ``off`` off.

    Raises:
        InvalidArgument: another value (the variable is named).
    """
    value = env.get(name, "").strip().lower()
    if value in ("", "1", "true", "yes", "on"):
        return True
    if value in ("0", "false", "no", "off"):
        return False
    raise InvalidArgument(f"{name}={value!r}: use 1 (on, the default) or 0 (off)", field=name)


def hash_refusal(cache: Any) -> str | None:
    """Why vLLM's block hashes under ``cache`` (its ``CacheConfig``) cannot name blocks for
    another engine, or None."""
    if not cache.enable_prefix_caching:
        return "vLLM's prefix caching is off (--enable-prefix-caching): no block is hashed"
    algo = str(cache.prefix_caching_hash_algo)
    if algo not in PROCESS_INDEPENDENT:
        return (f"prefix_caching_hash_algo {algo!r} hashes with a per-process random seed, so "
                "another engine's block hashes never match this one's; run vLLM with "
                "--prefix-caching-hash-algo sha256 (the default) or sha256_cbor")
    return None


def seal_refusal(scheduler: Any) -> str | None:
    """Why ``scheduler`` (a vLLM scheduler on a kvpool pool) can neither seal its blocks nor
    adopt sealed ones, or None when it can."""
    config = scheduler.vllm_config
    why = hash_refusal(config.cache_config)
    if why is not None:
        return why
    groups = scheduler.kv_cache_config.kv_cache_groups
    if len(groups) != 1 or not isinstance(groups[0].kv_cache_spec, FullAttentionSpec):
        kinds = ", ".join(type(g.kv_cache_spec).__name__ for g in groups) or "none"
        return (f"vLLM's KV cache has {len(groups)} KV-cache group(s) ({kinds}): kvpool seals "
                "the blocks of one full-attention group only (no hybrid, sliding-window or "
                "Mamba KV cache)")
    block_pool = scheduler.kv_cache_manager.block_pool
    if block_pool.hash_block_size != groups[0].kv_cache_spec.block_size:
        return (f"vLLM hashes blocks of {block_pool.hash_block_size} tokens but caches blocks "
                f"of {groups[0].kv_cache_spec.block_size}")
    parallel = config.parallel_config
    if parallel.decode_context_parallel_size > 1 or parallel.prefill_context_parallel_size > 1:
        return "decode/prefill context parallelism shards each block over ranks"
    if not getattr(scheduler.connector, "kvpool_memory", False):
        return ("vLLM's KV cache is not the pool's memory (no KVPoolConnector in "
                "kv_transfer_config): the blocks' bytes would not outlive the engine")
    return None


def seal_layout(config: Any, block_size: int) -> str:
    """The layout string of an engine of ``config`` (a ``VllmConfig``): see the module
    docstring."""
    import vllm
    from vllm.utils.hashing import get_hash_fn_by_name

    model = config.model_config
    cache = config.cache_config
    parallel = config.parallel_config
    algo = str(cache.prefix_caching_hash_algo)
    hash_fn = get_hash_fn_by_name(algo)
    seed = hash_fn(resolve_none_hash_seed(hash_fn)).hex()[:16]  # vLLM's first-block parent
    name = PurePath(str(model.model).rstrip("/")).name[-64:]
    return (f"vllm {vllm.__version__}; model {name} {model.compute_hash()[:16]}; "
            f"dtype {model.dtype}; kv {cache.cache_dtype}; block {block_size}; "
            f"hash {algo} {seed}; keys {EXTRA_KEYS}; tp 0/{parallel.tensor_parallel_size}; "
            f"pp 0/{parallel.pipeline_parallel_size}; "
            f"py {sys.version_info.major}.{sys.version_info.minor}")


@dataclass
class Cached:
    """A block vLLM cached, waiting for the step that writes it."""

    fence: int  # the last step scheduled when vLLM cached it
    request_id: str
    block: KVCacheBlock
    hash_key: bytes  # vLLM's BlockHashWithGroupId of it
    key: bytes
    parent: bytes
    tokens: list[int]
    ready_at: float = 0.0  # time.monotonic() when its step was processed


@dataclass
class SealerStats:
    """What a :class:`BlockSealer` did (for logs, tests and benches)."""

    sealed: int = 0  # blocks the daemon sealed
    seal_calls: int = 0
    unsealed: int = 0  # sealed blocks the daemon unsealed before vLLM reused them
    unseal_calls: int = 0
    not_sealed: int = 0  # written blocks vLLM reused before their Seal call left: not sealed
    unwritten: int = 0  # cached blocks not sealed: their step did not compute them
    adopted: int = 0  # blocks put in vLLM's hash map
    adopt_calls: int = 0
    broken: int = 0  # adopted blocks whose chain did not reach a first block (given back)
    corrupt: int = 0  # sealed blocks the daemon found written after sealing (freed by it)
    unfenced: int = 0  # at the last adoption: sealed blocks whose writers still live
    other_layout: int = 0  # at the last adoption: sealed blocks of other layouts
    layouts: tuple[str, ...] = field(default_factory=tuple)


class BlockSealer:
    """Seals the blocks vLLM caches once written, and adopts sealed ones (see the module
    docstring). Made by :func:`start_sealing`; the scheduler calls :meth:`scheduled` after
    each ``schedule``, :meth:`step_done` after each ``update_from_output`` and
    :meth:`between_steps` before each ``schedule``.

    Args:
        scheduler: vLLM's scheduler (its block pool is wrapped).
        lease: the engine core's lease (``kvpool.clients.client.Lease``).
        pool: the pool's name.
        layout: :func:`seal_layout`'s.
        queue: the block pool's free-block queue (kvpool's).
        seal: seal blocks (``KVPOOL_SEAL``); adoption is :meth:`adopt`'s.
        writers_ready: whether every worker registered under the lease (blocks are sealed
            only then).
        delay_s: how long a written block stays in vLLM's cache before it is sealed (a thread
            of the sealer makes the calls; 0: the scheduler's thread, at each step). One that
            vLLM reuses or frees sooner is never sealed.
    """

    def __init__(self, scheduler: Any, lease: Any, pool: str, layout: str,
                 queue: KVPoolFreeBlockQueue, *, seal: bool,
                 writers_ready: Callable[[], bool], delay_s: float = DEFAULT_DELAY_S) -> None:
        self.lease = lease
        self.pool = pool
        self.layout = layout
        self.queue = queue
        self.block_pool = scheduler.kv_cache_manager.block_pool
        self.block_size = int(scheduler.kv_cache_config.kv_cache_groups[0].kv_cache_spec
                              .block_size)
        self.sealing = seal
        self.writers_ready = writers_ready
        self.stats = SealerStats()
        self._pending: OrderedDict[int, Cached] = OrderedDict()  # block id -> record
        self._steps = 0  # schedule calls
        self._outputs: deque[tuple[Any, int]] = deque()  # (scheduler output, its step)
        self._scheduled: dict[int, Any] = {}  # step -> its requests (num_scheduled_tokens)
        self._next_adopt = 0.0
        self._per_call = max(1, (SEAL_BYTES - 4096) // (4 + 2 * KEY_BYTES + 4 * self.block_size))
        # Written blocks waiting for their Seal call (marked sealed already: one vLLM reuses
        # is sealed first, :meth:`flush`, then given back); the thread that sends them.
        self.delay_s = delay_s
        self._ready: dict[int, Cached] = {}  # block id -> record, in order
        self._sending: set[int] = set()  # block ids of the Seal call on the wire
        self._lock = threading.Lock()  # guards _ready and _sending
        self._send_lock = threading.Lock()  # one Seal call at a time, in order
        self._wake = threading.Event()
        self._stop = False
        self._thread: threading.Thread | None = None
        queue.before_release = self.let_go
        queue.unseal = self.unseal
        if seal and delay_s > 0:
            self._thread = threading.Thread(target=self._run, daemon=True,
                                            name=f"kvpool-sealer-{pool}")
            self._thread.start()
        if seal:
            original = self.block_pool.cache_full_blocks

            def cache_full_blocks(request: Any, blocks: list[KVCacheBlock],
                                  num_cached_blocks: int, num_full_blocks: int,
                                  block_size: int, kv_cache_group_id: int,
                                  block_mask: list[bool] | None = None) -> None:
                original(request, blocks, num_cached_blocks, num_full_blocks, block_size,
                         kv_cache_group_id, block_mask)
                self._record(request, blocks, num_cached_blocks, num_full_blocks,
                             kv_cache_group_id)

            # The instance's attribute: vLLM's class and module stay as they are.
            self.block_pool.cache_full_blocks = cache_full_blocks

    # -- seal ---------------------------------------------------------------------------------

    def _record(self, request: Any, blocks: list[KVCacheBlock], start: int, end: int,
                group: int) -> None:
        """Blocks ``start..end - 1`` of ``request`` were just cached: wait for their step."""
        hashes = request.block_hashes
        tokens = request.all_token_ids
        size = self.block_size
        pending = self._pending
        fence = self._steps
        rid = request.request_id
        for i in range(start, end):
            block = blocks[i]
            if block.is_null:
                continue
            key = hashes[i]
            hash_key = make_block_hash_with_group_id(key, group)
            if block.block_hash != hash_key:
                continue  # masked out, or a duplicate vLLM did not insert
            bid = block.block_id
            pending.pop(bid, None)  # cached again (reused): the newer step fences it
            pending[bid] = Cached(fence, rid, block, hash_key, key,
                                  hashes[i - 1] if i else ZERO_KEY,
                                  list(tokens[i * size:(i + 1) * size]))

    def scheduled(self, output: Any) -> None:
        """``schedule`` returned ``output`` (its step is :attr:`_steps`)."""
        self._outputs.append((output, self._steps))
        self._scheduled[self._steps] = output.num_scheduled_tokens

    def scheduling(self) -> None:
        """``schedule`` begins: a new step (blocks cached from now are written by it)."""
        self._steps += 1

    def step_done(self, output: Any) -> None:
        """``output``'s step has run and its output is processed: seal the blocks it wrote."""
        step = None
        outputs = self._outputs
        while outputs:
            out, seq = outputs.popleft()
            if out is output:
                step = seq
                break
        if step is None:
            return
        scheduled = self._scheduled
        pending = self._pending
        ready = self.sealing and bool(pending) and self.writers_ready()
        batch: list[Cached] = []
        while pending:
            bid, rec = next(iter(pending.items()))
            if rec.fence > step:
                break
            pending.popitem(last=False)
            ran = scheduled.get(rec.fence)
            if (ready and ran is not None and rec.request_id in ran
                    and rec.block.block_hash == rec.hash_key and not self.queue.sealed[bid]):
                batch.append(rec)
            else:
                self.stats.unwritten += 1
        for seq in [s for s in scheduled if s <= step]:
            del scheduled[seq]
        if not batch:
            return
        ids = np.fromiter((r.block.block_id for r in batch), dtype=np.int32, count=len(batch))
        self.queue.mark_sealed(ids)  # from now on given back, never written
        now = time.monotonic()
        with self._lock:
            ready = self._ready
            for rec in batch:
                rec.ready_at = now
                ready[rec.block.block_id] = rec
        if self._thread is None:
            self.flush()

    def _run(self) -> None:
        """The sealer's thread: every half ``delay_s``, the Seal call of the written blocks
        that have stayed cached ``delay_s``."""
        while not self._stop:
            self._wake.wait(self.delay_s / 2)
            self._wake.clear()
            if self._stop:
                return
            try:
                self.flush(time.monotonic() - self.delay_s)
            except Exception:  # never let the thread die silently
                log.exception("kvpool: sealing vLLM's blocks in pool %r failed", self.pool)

    def flush(self, written_before: float | None = None) -> None:
        """Send the Seal call of the written blocks (those ready before ``written_before``,
        ``time.monotonic()``; None: all, at shutdown and when settling)."""
        with self._send_lock:
            with self._lock:
                ready = self._ready
                if written_before is None:
                    batch = list(ready.values())
                else:  # oldest first: stop at the first one too young
                    batch = []
                    for rec in ready.values():
                        if rec.ready_at > written_before:
                            break
                        batch.append(rec)
                for rec in batch:
                    del ready[rec.block.block_id]
                self._sending = {r.block.block_id for r in batch}
            try:
                if batch and self.sealing:
                    self._seal(batch)
            finally:
                with self._lock:
                    self._sending = set()

    def _not_sealed(self, ids: np.ndarray) -> np.ndarray:
        """Of sealed blocks ``ids`` about to leave vLLM's cache, those whose Seal call has not
        left: dropped from it (never sealed; returned). For the others, once their Seal call
        is on the wire, its reply is waited for (the daemon has them sealed then)."""
        listed = ids.tolist()
        with self._lock:
            ready = self._ready
            local = [u for u in listed if ready.pop(u, None) is not None]
            wait = bool(self._sending) and not self._sending.isdisjoint(listed)
        self.stats.not_sealed += len(local)
        if wait:
            with self._send_lock:
                pass
        return np.asarray(local, dtype=ids.dtype)

    def let_go(self, ids: np.ndarray) -> np.ndarray:
        """Sealed blocks ``ids`` are freed without a prefix (a prefix-cache reset): returns
        those that were never sealed (they may go into the page cache); the others go back to
        the daemon, whose directory keeps them."""
        return self._not_sealed(ids)

    def unseal(self, ids: np.ndarray) -> None:
        """Sealed blocks ``ids`` are to be written again (vLLM reuses them): those whose Seal
        call has not left are simply not sealed; the others are unsealed by the daemon, which
        confirms before this returns.

        Raises:
            KVPoolError: the daemon refused (the blocks must then not be written).
        """
        local = self._not_sealed(ids)
        rest = ids[~np.isin(ids, local)] if local.shape[0] else ids
        if not rest.shape[0]:
            return
        self.stats.unsealed += int(self.lease.unseal(self.pool, rest))
        self.stats.unseal_calls += 1

    def settle(self, timeout_s: float = 30.0) -> bool:
        """Make the Seal call of every written block now, whatever its age (tests and
        benches). Returns False if another call was still on the wire after ``timeout_s``."""
        self.flush()
        deadline = time.monotonic() + timeout_s
        while self._send_lock.locked():
            if time.monotonic() > deadline:
                return False
            time.sleep(0.005)
        return True

    def close(self) -> None:
        """Seal what is written, stop the thread (before the lease ends). Idempotent."""
        self._stop = True
        self._wake.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=30)
        try:
            self.flush()
        except KVPoolError as err:
            log.warning("kvpool: sealing vLLM's last blocks in pool %r failed: %s", self.pool,
                        err)

    def _seal(self, batch: list[Cached]) -> None:
        """One Seal call per ``_per_call`` blocks."""
        for lo in range(0, len(batch), self._per_call):
            part = batch[lo:lo + self._per_call]
            ids = np.fromiter((r.block.block_id for r in part), dtype=np.int32,
                              count=len(part))
            tokens = np.fromiter((t for r in part for t in r.tokens), dtype=np.int32,
                                 count=len(part) * self.block_size)
            try:
                done = self.lease.seal(self.pool, self.layout, ids, [r.key for r in part],
                                       [r.parent for r in part], tokens)
            except KVPoolError as err:
                self.sealing = False
                log.warning("kvpool: sealing vLLM's blocks in pool %r stopped: the daemon "
                            "refused %d blocks (%s); blocks sealed so far stay sealed",
                            self.pool, len(part), err)
                return
            # A block the daemon skipped (its key sealed already under another block) counts
            # as sealed all the same: it goes back to the daemon, never written again.
            self.stats.sealed += int(done)
            self.stats.seal_calls += 1

    # -- adopt --------------------------------------------------------------------------------

    def adopt(self) -> int:
        """Adopt the pool's sealed blocks of this layout (every call until none come) into
        vLLM's hash map; returns how many went in."""
        ids: list[np.ndarray] = []
        keys: list[bytes] = []
        parents: list[bytes] = []
        while True:
            got = self.lease.adopt(self.pool, self.layout)
            self.stats.adopt_calls += 1
            self.stats.corrupt += got.corrupt
            if not got.ids.shape[0]:
                break
            ids.append(got.ids)
            keys += got.keys
            parents += got.parents
        self.stats.unfenced, self.stats.other_layout = got.unfenced, got.other_layout
        self._next_adopt = time.monotonic() + ADOPT_RETRY_S
        n = self._insert(np.concatenate(ids), keys, parents) if ids else 0
        self._report(n)
        return n

    def _insert(self, ids: np.ndarray, keys: list[bytes], parents: list[bytes]) -> int:
        """Put adopted blocks in vLLM's hash map (see the module docstring)."""
        queue = self.queue
        queue.cache.adopt(ids)  # the lease's now: the page cache counts them in use
        queue.mark_sealed(ids)
        depth = chain_depths(keys, parents)
        blocks = self.block_pool.blocks
        mapping = self.block_pool.cached_block_hash_to_block
        size = self.block_size
        # deepest first: vLLM evicts from the front, children before their parents
        order = sorted((i for i in range(len(keys)) if depth[i]), key=depth.__getitem__,
                       reverse=True)
        placed: list[KVCacheBlock] = []
        for i in order:
            block = blocks[int(ids[i])]
            hash_key = make_block_hash_with_group_id(keys[i], 0)
            block.set_block_hash(hash_key, num_tokens=depth[i] * size)
            mapping.insert(hash_key, block)
            placed.append(block)
        queue.append_n(placed)
        broken = np.asarray([int(ids[i]) for i in range(len(keys)) if not depth[i]],
                            dtype=np.int32)
        if broken.shape[0]:
            queue._release(broken)
            self.stats.broken += int(broken.shape[0])
        self.stats.adopted += len(placed)
        return len(placed)

    def _report(self, n: int) -> None:
        s = self.stats
        if n:
            log.info("kvpool: adopted %d sealed KV blocks into vLLM's prefix cache from pool "
                     "%r (layout %s)", n, self.pool, self.layout)
        if s.unfenced > self.queue.released:
            log.info("kvpool: %d sealed blocks in pool %r wait until the processes of the "
                     "engine that wrote them have exited (a frozen or still running engine); "
                     "adoption is tried again between steps", s.unfenced, self.pool)
        if s.other_layout and not n:
            try:
                s.layouts = self.lease.client.sealed(self.pool).layouts
            except KVPoolError:
                s.layouts = ()
            log.warning("kvpool: pool %r keeps %d sealed blocks of other layouts (another model, "
                        "dtype, hash or vLLM version): %s; this engine's is %s: none adopted",
                        self.pool, s.other_layout, " | ".join(s.layouts[:3]) or "?",
                        self.layout)

    def between_steps(self) -> None:
        """Before a step: adopt again if another engine's sealed blocks waited for its
        processes at the last try (at most every ``ADOPT_RETRY_S``)."""
        if self.stats.unfenced > self.queue.released and time.monotonic() >= self._next_adopt:
            try:
                self.adopt()
            except KVPoolError as err:
                self._next_adopt = time.monotonic() + ADOPT_RETRY_S
                log.warning("kvpool: adopting sealed blocks from pool %r failed: %s",
                            self.pool, err)


def start_sealing(scheduler: Any, binding: Any, queue: KVPoolFreeBlockQueue,
                  env: Mapping[str, str] | None = None) -> BlockSealer | None:
    """Seal and adopt for ``scheduler`` (``KVPoolScheduler``, its blocks from ``binding``'s
    lease through ``queue``), unless ``KVPOOL_SEAL=0`` and ``KVPOOL_ADOPT=0``, or refused
    (:func:`seal_refusal`: one log line). Registers the engine's processes as the writers of
    the lease's blocks (see the module docstring), then adopts (unless ``KVPOOL_ADOPT=0``).

    Raises:
        InvalidArgument: a malformed ``KVPOOL_SEAL`` / ``KVPOOL_ADOPT`` /
            ``KVPOOL_SEAL_DELAY_S`` (a refusal of the daemon is logged: the engine runs on).
    """
    env = os.environ if env is None else env
    seal, adopt = flag(env, SEAL_ENV), flag(env, ADOPT_ENV)
    if not (seal or adopt):
        return None
    why = seal_refusal(scheduler)
    if why is not None:
        log.warning("kvpool: vLLM's KV-cache blocks are not sealed and none adopted: %s", why)
        return None
    connector = scheduler.connector
    block_size = int(scheduler.kv_cache_config.kv_cache_groups[0].kv_cache_spec.block_size)
    layout = seal_layout(scheduler.vllm_config, block_size)
    lease = binding.lease
    try:
        writers = register_writers(binding, scheduler.vllm_config.parallel_config.world_size)
    except KVPoolError as err:
        log.warning("kvpool: vLLM's KV-cache blocks are not sealed and none adopted: the "
                    "daemon refused to register this engine's processes for pool %r: %s",
                    binding.pool, err)
        return None
    connector.kvpool_writers = writers
    delay = number_from(env, DELAY_ENV, float, lo=0.0, hi=60.0, example="1.0")
    sealer = BlockSealer(scheduler, lease, binding.pool, layout, queue, seal=seal,
                         writers_ready=lambda: connector.kvpool_writers_ready,
                         delay_s=DEFAULT_DELAY_S if delay is None else float(delay))
    binding.on_close(sealer.close)  # before the page cache's close and the lease's end
    if adopt:
        try:
            sealer.adopt()
        except KVPoolError as err:  # the engine runs on, with an empty prefix cache
            log.warning("kvpool: adopting sealed blocks from pool %r failed: %s",
                        binding.pool, err)
    log.info("kvpool: %s vLLM's full KV blocks in pool %r (layout %s)",
             "sealing" if seal else "not sealing (KVPOOL_SEAL=0)", binding.pool, layout)
    return sealer


def register_writers(binding: Any, workers: int) -> Any:
    """Attach the pool under the engine core's lease (no mapping) and register this process
    on the daemon's descriptor socket; returns what the workers need to register themselves
    (``KVPoolConnector``'s metadata carries it).

    Raises:
        KVPoolError: the daemon refused (the descriptor socket is off: a TCP daemon).
    """
    from kvpool.mapping.fd_client import register

    lease = binding.lease
    info = binding.client.attach_raw(binding.pool, "", lease=lease)
    fd_socket = str(getattr(info.handle, "fd_socket", "") or "")
    writers = Writers(fd_socket=fd_socket, pool=binding.pool, lease_id=int(lease.lease_id),
                      secret=bytes(lease.secret).hex(), workers=workers)
    if fd_socket:
        register(fd_socket, writers.ask())
    else:
        log.warning("kvpool: the daemon of pool %r has no descriptor socket (a TCP "
                    "listener?): the blocks this engine seals cannot be adopted later",
                    binding.pool)
    return writers



def chain_depths(keys: list[bytes], parents: list[bytes]) -> list[int]:
    """Per block (``keys[i]``, whose parent is ``parents[i]``): its place in its hash chain
    among these blocks, 1 for a first block (parent 32 zero bytes), or 0 when its chain does
    not reach a first block here (a parent missing, or a cycle). O(blocks)."""
    index = {k: i for i, k in enumerate(keys)}
    depth = [-1] * len(keys)  # -1: not known yet; -2: on the walk now
    for i in range(len(keys)):
        path: list[int] = []
        j = i
        base, first = 0, False
        while True:
            d = depth[j]
            if d != -1:
                base = max(d, 0)  # known (0: broken), or a cycle (-2): broken
                break
            depth[j] = -2
            path.append(j)
            parent = parents[j]
            if parent == ZERO_KEY:
                first = True
                break
            nxt = index.get(parent)
            if nxt is None:
                break
            j = nxt
        reaches = first or base > 0
        d = base
        for v in reversed(path):
            d = d + 1 if reaches else 0
            depth[v] = d
    return depth
