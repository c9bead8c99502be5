"""Sealing and adoption in kvpool's SGLang plugin: full radix-cache pages outlive their engine
(docs/restart.md, "SGLang").

- **Seal.** Every insert into SGLang's radix tree reports the ranges of the request's pages the
  tree took (``radix_hook.py``); the plugin keys each full page (``page_keys.py``: SGLang's own
  page hash) and, once per scheduler step (an admission, a decode check, idle), marks the new
  pages sealed and hands them to one Seal call. A worker thread makes the calls (the scheduler
  never waits on them), in order with the Frees of sealed pages: SGLang freeing a sealed page
  (eviction, ``clear``) never puts it back in the page cache, it goes to the daemon, which
  keeps it in the pool's directory.
- **Adopt.** At startup, before the page cache's first fill (which could make the directory
  give pages back), the allocator adopts until the daemon has no more for its layout (or its
  quota is full), checks each chain, frees what cannot be placed, and holds the rest in use;
  the first scheduler step (SGLang's first admission, before any request is matched for
  scheduling) inserts them into the radix tree with the adopted page ids as its KV indices.
  Until then ``available_size`` counts them as free, so SGLang's idle identity holds; from
  then on they are the tree's (evictable, freed as any other sealed page).
- **Later.** Pages of an engine that still lives (SIGSTOPped, its lease expired) are
  ``unfenced``: while the last Adopt reported some, each admission adopts again, at most every
  ``KVPOOL_ADOPT_RETRY_S`` (default 5 s, doubling after each Adopt that took nothing, up to 64x;
  an Adopt that took pages resets it). The plugin's own sealed pages that SGLang evicted count
  as unfenced too (its lease lives), hence the backoff.

Off: ``KVPOOL_SEAL=0`` (nothing sealed; adoption still on), ``KVPOOL_ADOPT=0`` (nothing
adopted); not on elastic pools, hybrid pools (SWA, linear), TP/PP > 1, speculative decoding,
HiCache or without a radix cache: the reason is logged once (``seal_settings.py``, with the
layout string). The calls themselves: ``seal_worker.py``. On CUDA the ids are copied back
without waiting, and a page is sealed once the work queued on SGLang's forward stream when
it entered the tree is done (with the overlap scheduler a prefill chunk enters the tree while
its forward pass may still run).
"""

from __future__ import annotations

import logging
import time
from array import array
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from kvpool.contract.errors import KVPoolError
from kvpool.contract.limits import KEY_BYTES, MAX_ADOPT_PAGES
from kvpool.integrations.sglang.page_keys import (
    ZERO_KEY,
    InsertPlan,
    Known,
    chain_keys,
    page_key,
    plan_inserts,
    sealable_tokens,
)
from kvpool.integrations.sglang.seal_settings import (
    ADOPT_ENV,
    RETRY_GROWTH,
    SealSettings,
    forward_stream_of_caller,
)
from kvpool.integrations.sglang.seal_worker import SealWorker

log = logging.getLogger("kvpool.integrations.sglang.sealer")


@dataclass
class _Pending:
    """One insert's new tree pages, waiting for the step's Seal (nothing converted yet: the
    hook only keeps references; the step does the work)."""

    seq: int  # the insert's sequence number (pages freed since are not sealed)
    token_ids: Any  # the radix key's token ids (SGLang's array: its prefix does not change)
    end: int  # tokens up to the last page the tree took
    ranges: list[tuple[int, int]]  # token ranges the tree took (whole pages)
    value: Any  # the insert's KV indices (a tensor on SGLang's device)
    tokens: Any = None  # uint32 token ids [:end], made by the step


class Sealer:
    """One allocator's sealing and adoption (see the module docstring).

    Args:
        lease: the scheduler's lease.
        pool: the pool's name.
        capacity: the pool's ``kv`` pages (ids ``1..capacity``).
        page_size: tokens per page.
        device: where SGLang's KV indices live.
        layout: the layout string (``sealing_layout``).
        settings: what is on.
    """

    def __init__(self, *, lease: Any, pool: str, capacity: int, page_size: int, device: Any,
                 layout: str, settings: SealSettings) -> None:
        self.lease = lease
        self.pool = pool
        self.page_size = page_size
        self.device = torch.device(device)
        self.cuda = self.device.type == "cuda"
        self.layout = layout
        self.settings = settings
        n = capacity + 2  # ids 1..capacity; 0 and capacity + 1 stay unsealed (clip targets)
        self.sealed = np.zeros(n, dtype=bool)  # sealed and in use by this allocator
        self.keys = np.zeros((n, KEY_BYTES), dtype=np.uint8)
        self.parents = np.zeros((n, KEY_BYTES), dtype=np.uint8)
        self.tokens = np.zeros((n, page_size), dtype=np.uint32)
        self.freed_seq = np.zeros(n, dtype=np.int64)
        self.by_key: dict[bytes, int] = {}
        self.seq = 0
        self.pending: list[_Pending] = []
        self.inflight: list[tuple[list[Any], torch.Tensor, list[_Pending]]] = []
        # CUDA: the stream SGLang's forward passes write the KV on (the scheduler's), found
        # at the first step; a page is sealed once the work queued there at its insert is done.
        self.forward_stream: Any = None
        self.worker = SealWorker(lease, pool, layout)
        self.cache: Any = None
        self.tree: Any = None
        self.plan: InsertPlan | None = None  # adopted pages not yet in the tree
        self.unplaced = 0
        self.adopted = 0
        self.retry_at = 0.0
        self.retry_wait = settings.retry_s
        self.unfenced = 0
        self.skipped = 0  # inserts not sealed (namespaced, bigram or wide keys)

    # -- adoption -------------------------------------------------------------------------

    def adopt_startup(self, quota_pages: int) -> np.ndarray | None:
        """Adopt until the daemon has none left for this layout or the quota is full, before
        the page cache exists. Returns the page ids to hand the cache as held (None: none)."""
        if not self.settings.adopt:
            log.info("kvpool pool %r: adoption off (%s=0)", self.pool, ADOPT_ENV)
            return None
        start = time.monotonic()
        got = self._adopt_all(quota_pages)
        if got is None:
            return None
        ids, keys, parents, tokens, replies = got
        ids, keys, parents, tokens = self._within(quota_pages, ids, keys, parents, tokens)
        plan = plan_inserts(ids, keys, parents, tokens, self.page_size)
        if plan.unplaced.shape[0]:
            self._free_direct(plan.unplaced)
        self._record(plan.placed, ids, keys, parents, tokens)
        self.plan = plan if plan.paths else None
        self.unplaced = int(plan.placed.shape[0])
        self.adopted += self.unplaced
        self._log_adoption(replies, plan, time.monotonic() - start, quota_pages)
        return plan.placed.astype(np.int32) if self.unplaced else None

    def _adopt_all(self, room: int, *, later: bool = False
                   ) -> tuple[np.ndarray, list[bytes], list[bytes], np.ndarray,
                              list[Any]] | None:
        """Adopt calls until one takes nothing or ``room`` pages are adopted (the caller frees
        what is past ``room``: the deepest pages, as each call hands parents first)."""
        replies, ids, keys, parents, tokens = [], [], [], [], []
        total = 0
        try:
            while total < room:
                a = self.lease.adopt(self.pool, self.layout)
                replies.append(a)
                n = int(a.ids.shape[0])
                if not n:
                    break
                ids.append(a.ids.astype(np.int64))
                keys += a.keys
                parents += a.parents
                tokens.append(np.asarray(a.tokens, dtype=np.int64).reshape(n, -1))
                total += n
                if n < MAX_ADOPT_PAGES:
                    break
        except KVPoolError as err:
            log.warning("kvpool pool %r: adoption failed, starting without: %s", self.pool,
                        err)
            if not ids:
                return None
        before, self.unfenced = self.unfenced, (replies[-1].unfenced if replies else 0)
        if not ids:
            if not later or self.unfenced != before:  # a later empty Adopt: only news
                self._log_nothing(replies)
            return None
        return np.concatenate(ids), keys, parents, np.concatenate(tokens), replies

    def _within(self, room: int, ids: np.ndarray, keys: list[bytes], parents: list[bytes],
                tokens: np.ndarray) -> tuple[np.ndarray, list[bytes], list[bytes], np.ndarray]:
        """The first ``room`` adopted pages; the rest are freed at once."""
        if ids.shape[0] <= room:
            return ids, keys, parents, tokens
        self._free_direct(ids[room:])
        return ids[:room], keys[:room], parents[:room], tokens[:room]

    def _free_direct(self, ids: np.ndarray) -> None:
        """Give adopted pages back before (or without) the page cache: one Free (they go back
        to the directory, this lease's now)."""
        if not ids.shape[0]:
            return
        if self.cache is not None:
            self.worker.put("free", self.cache.release(ids.astype(np.int32)))
            return
        try:
            self.lease.free_batch(self.pool, [("kv", ids.astype(np.int32))])
        except KVPoolError as err:
            log.warning("kvpool pool %r: freeing %d adopted pages failed: %s", self.pool,
                        ids.shape[0], err)

    def _record(self, placed: np.ndarray, ids: np.ndarray, keys: list[bytes],
                parents: list[bytes], tokens: np.ndarray) -> None:
        """Remember the placed adopted pages as sealed (they are, and stay, in use)."""
        where = {int(u): i for i, u in enumerate(ids.tolist())}
        for u in placed.tolist():
            i = where[int(u)]
            self._mark(int(u), keys[i], parents[i], tokens[i])

    def _mark(self, page: int, key: bytes, parent: bytes, tokens: np.ndarray) -> None:
        self.sealed[page] = True
        self.keys[page] = np.frombuffer(key, dtype=np.uint8)
        self.parents[page] = np.frombuffer(parent, dtype=np.uint8)
        self.tokens[page] = tokens
        self.by_key.setdefault(key, page)  # a duplicate adopted later is not the tree's

    def known(self, key: bytes) -> Known | None:
        """This allocator's sealed page of ``key`` (for chains adopted in later calls)."""
        page = self.by_key.get(key)
        if page is None:
            return None
        return Known(page, self.parents[page].tobytes(), self.tokens[page].astype(np.int64))

    def _log_nothing(self, replies: list[Any]) -> None:
        last = replies[-1] if replies else None
        if last is None:
            return
        why = []
        if last.unfenced:
            why.append(f"{last.unfenced} wait for their engine's processes to exit "
                       "(unfenced: an engine that still runs, or stopped)")
        if last.corrupt:
            why.append(f"{last.corrupt} changed since sealed (corrupt: freed)")
        if last.other_layout:
            why.append(f"{last.other_layout} are of another layout (another engine, "
                       "model, dtype, hash or rank)")
        log.info("kvpool pool %r: nothing adopted (layout %s): %s", self.pool, self.layout,
                 "; ".join(why) if why else "the directory holds no sealed pages")

    def _log_adoption(self, replies: list[Any], plan: InsertPlan, seconds: float,
                      quota: int) -> None:
        last = replies[-1]
        log.info(
            "kvpool pool %r: adopted %d sealed pages (%d tokens, %d prefixes) in %.2f s; not "
            "placed: %d (%d inconsistent, %d whose parent is gone), freed; left in the "
            "directory: %d unfenced, %d of other layouts; corrupt (freed): %d; room for %d",
            self.pool, plan.placed.shape[0], plan.placed.shape[0] * self.page_size,
            len(plan.paths), seconds, plan.unplaced.shape[0], plan.inconsistent,
            plan.orphans, last.unfenced, last.other_layout,
            sum(r.corrupt for r in replies), quota)

    # -- the scheduler's steps ------------------------------------------------------------

    def bind(self, cache: Any) -> None:
        """The allocator's page cache (open, holding the adopted pages in use)."""
        self.cache = cache
        self.worker.cache = cache

    def step(self, tree: Any, room: int, *, admission: bool = False) -> None:
        """Between scheduler steps: the radix tree's hook, the adopted pages into it, the
        step's Seal, and, at an ``admission``, a later Adopt when due. ``room``: pages the
        quota still has."""
        if tree is not None and tree is not self.tree:
            from kvpool.integrations.sglang.radix_hook import install

            install(tree, self)
            self.tree = tree
            if self.cuda and self.forward_stream is None:
                self.forward_stream = forward_stream_of_caller()
        tree = self.tree
        if tree is None:
            return
        if self.plan is not None:
            self._place(self.plan)
            self.plan = None
        self.flush()
        if (admission and self.settings.adopt and self.unfenced
                and time.monotonic() >= self.retry_at):
            self._adopt_later(room)

    def _place(self, plan: InsertPlan) -> None:
        """Insert adopted pages into the tree; those it does not take are freed."""
        from kvpool.integrations.sglang.radix_hook import insert_paths

        taken = insert_paths(self.tree, plan.paths, self.page_size, self.device)
        left = np.setdiff1d(plan.placed, np.fromiter(taken, dtype=np.int64, count=len(taken)))
        self.unplaced = 0
        if left.shape[0]:
            rest = self.freed(left)
            assert rest.shape[0] == 0
            log.info("kvpool pool %r: %d adopted pages duplicated the tree's, freed",
                     self.pool, left.shape[0])

    def _adopt_later(self, room: int) -> None:
        start = time.monotonic()
        got = self._adopt_all(max(0, room), later=True)
        if got is None:
            self.retry_at = time.monotonic() + self.retry_wait
            self.retry_wait = min(self.retry_wait * 2, self.settings.retry_s * RETRY_GROWTH)
            return
        ids, keys, parents, tokens, replies = got
        self.cache.adopt(ids.astype(np.int32))
        ids, keys, parents, tokens = self._within(room, ids, keys, parents, tokens)
        plan = plan_inserts(ids, keys, parents, tokens, self.page_size, self.known)
        if plan.unplaced.shape[0]:
            self._free_direct(plan.unplaced)
        self._record(plan.placed, ids, keys, parents, tokens)
        self.adopted += int(plan.placed.shape[0])
        self._log_adoption(replies, plan, time.monotonic() - start, room)
        self._place(plan)
        self.retry_wait = self.settings.retry_s
        self.retry_at = time.monotonic() + self.retry_wait

    # -- sealing --------------------------------------------------------------------------

    @property
    def active(self) -> bool:
        return self.settings.seal and self.worker.failed is None

    def inserted(self, token_ids: Any, length: int, ranges: list[tuple[int, int]],
                 value: Any) -> None:
        """The radix hook: an insert of a key of ``length`` tokens (``token_ids``) with KV
        indices ``value`` made the tree take ``ranges``; kept for the step."""
        ps = self.page_size
        length = length // ps * ps
        rs = [(int(a), min(int(b), length)) for a, b in ranges if int(a) < min(int(b), length)]
        if not rs:
            return
        if any(a % ps or b % ps for a, b in rs):
            self.skipped += 1
            return
        self.seq += 1
        self.pending.append(_Pending(self.seq, token_ids, max(b for _, b in rs), rs, value))

    def flush(self) -> None:
        """Seal what the step's inserts added (on CUDA: what an earlier step's did, once its
        ids are on the host and the forward pass that wrote them is done)."""
        if self.inflight:
            ready = []
            while self.inflight and all(ev.query() for ev in self.inflight[0][0]):
                ready.append(self.inflight.pop(0))
            for _events, host, entries in ready:
                self._seal_entries(entries, host.numpy())
        if not self.pending:
            return
        entries, self.pending = self.pending, []
        if not self.active:
            return
        ps = self.page_size
        kept = []
        for e in entries:
            ids = e.token_ids
            raw = (np.frombuffer(ids, dtype=np.int64, count=e.end)
                   if isinstance(ids, array) and ids.typecode == "q"
                   else np.asarray(ids[:e.end], dtype=np.int64))
            e.tokens = sealable_tokens(raw)  # a copy: no view of SGLang's array is kept
            if e.tokens is None:
                self.skipped += 1
            else:
                kept.append(e)
        if not kept:
            return
        if not self.cuda:
            flat = np.concatenate([e.value.numpy()[:e.end:ps] for e in kept]) // ps
            self._seal_entries(kept, flat)
            return
        ids_t = torch.cat([e.value[:e.end:ps] for e in kept]) // ps
        host = torch.empty(ids_t.shape, dtype=ids_t.dtype, pin_memory=True)
        host.copy_(ids_t, non_blocking=True)
        copied = torch.cuda.Event()
        copied.record()  # the ids' copy, on this (the scheduler's) stream
        events = [copied]
        if self.forward_stream is not None:
            # With the overlap scheduler a chunk enters the tree while its forward pass may
            # still run on the forward stream: seal after what is queued there now.
            written = torch.cuda.Event()
            written.record(self.forward_stream)
            events.append(written)
        self.inflight.append((events, host, kept))

    def _seal_entries(self, entries: list[_Pending], flat: np.ndarray) -> None:
        """Mark and queue for Seal the pages ``entries`` added (``flat``: the page id of
        each page position, entry after entry)."""
        if not self.active:
            return
        ps = self.page_size
        flat = flat.astype(np.int64, copy=False)
        out: list[tuple[np.ndarray, list[bytes], list[bytes], np.ndarray]] = []
        offset = 0
        in_use = self.cache.in_use_of
        by_key = self.by_key
        for e in entries:
            n = e.end // ps
            pages = flat[offset:offset + n]
            offset += n
            for s, end in e.ranges:
                prev = self._parent_key(e, pages, s)
                keys = chain_keys(e.tokens[s:end], ps, prev)
                new = pages[s // ps:end // ps]
                ok = (self.freed_seq[new] < e.seq) & ~self.sealed[new] & in_use(new)
                take = [j for j in np.flatnonzero(ok).tolist() if keys[j] not in by_key]
                if not take:
                    continue
                parents = [(prev or ZERO_KEY) if j == 0 else keys[j - 1] for j in take]
                picked = [keys[j] for j in take]
                sel = new[take]
                rows = e.tokens[s:end].reshape(-1, ps)[take]
                self.sealed[sel] = True
                self.keys[sel] = np.frombuffer(b"".join(picked), np.uint8).reshape(-1, KEY_BYTES)
                self.parents[sel] = np.frombuffer(b"".join(parents), np.uint8).reshape(
                    -1, KEY_BYTES)
                self.tokens[sel] = rows
                by_key.update(zip(picked, sel.tolist(), strict=True))
                out.append((sel, picked, parents, rows.reshape(-1)))
        if out:
            self.worker.put("seal", (np.concatenate([o[0] for o in out]),
                                     [k for o in out for k in o[1]],
                                     [k for o in out for k in o[2]],
                                     np.concatenate([o[3] for o in out])))

    def _parent_key(self, e: _Pending, pages: np.ndarray, start: int) -> bytes | None:
        """The key of the page before token ``start``: the tree's page there when this
        allocator sealed it (and it was not freed since, and holds those tokens), else the
        chain hashed from the key's first token. None: ``start`` is 0."""
        if start == 0:
            return None
        ps = self.page_size
        before = int(pages[start // ps - 1])
        row = e.tokens[start - ps:start]
        if (0 < before < self.sealed.shape[0] - 1 and self.sealed[before]
                and self.freed_seq[before] < e.seq and np.array_equal(self.tokens[before], row)):
            key = self.keys[before].tobytes()
            # the page's own key must be its parent's and tokens' hash (it is, when sealed here)
            if page_key(self.parents[before].tobytes(), row) == key:
                return key
        return chain_keys(e.tokens[:start], ps)[-1]

    def freed(self, pages: np.ndarray) -> np.ndarray:
        """SGLang frees ``pages`` (int64): the sealed ones go to the daemon (taken out of the
        page cache, freed by the worker after the Seals before them); returns the others,
        for the page cache."""
        self.freed_seq.put(pages, self.seq, mode="clip")
        mask = self.sealed.take(pages, mode="clip")
        if not mask.any():
            return pages
        sealed = np.unique(pages[mask])
        self.sealed[sealed] = False
        for page, key in zip(sealed.tolist(), (bytes(k) for k in self.keys[sealed]),
                             strict=True):
            if self.by_key.get(key) == page:
                del self.by_key[key]
        self.worker.put("free", self.cache.release(sealed.astype(np.int32)))
        return pages[~mask]

    def forget_adopted(self) -> None:
        """SGLang clears the allocator: adopted pages not yet in the tree are freed with the
        rest (they are sealed: to the daemon)."""
        self.plan = None
        self.unplaced = 0

    def close(self) -> None:
        self.worker.stop()


__all__ = ["Sealer"]
