"""Sealed pages: complete KV a pool keeps after the engine that wrote it, for the next engine.

An engine **seals** a page when its KV is complete and will not change, naming its content the
way the engine itself does (its 32-byte block hash, the parent block's hash, the page's token
ids) under a **layout** string (the engine, its version, its hash algorithm, its TP rank: what
must match for another engine to read the bytes as it would have written them; the pool's own
fingerprint covers the buffers). The page stays the sealing lease's while it holds it; when the
lease frees it, or ends, the page passes to the pool's **directory** (the ledger owner
:data:`~kvpoold.ids.faults.DIRECTORY`) instead of the free set: it still counts against the
pool (as evictable cache), is given back under pressure oldest first before any live page
(:meth:`SealedDirectory.evict`), and can be **adopted** by a later lease of the same layout.

The fence (why adoption is safe): a page is adoptable only when every process that could still
write it is proven gone. The sealing lease must have ended, and each process that mapped the
pool under it registered itself on the daemon's descriptor socket (the kernel's pid,
``SO_PEERCRED``, turned into a pidfd at once): every one of those pidfds must report its
process exited. A SIGSTOPped process is alive: its pages wait. A lease under which no process
registered (a TCP client, a client that never mapped) cannot be proven and is never adopted
from. On CPU a checksum taken at seal is compared at adoption; a page whose bytes changed is
dropped from the directory (freed), never adopted. On a GPU nothing is re-read.

One directory per pool (its ``kv`` space); the :class:`~kvpoold.pools.pool.Pool` aggregate owns
it and alone calls it, on the event loop. Checksums are computed off the loop by the caller.
"""

from __future__ import annotations

import os
import select
from collections import Counter, OrderedDict
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np
import torch
import xxhash

from kvpool.contract.errors import FailedPrecondition, Internal, InvalidArgument
from kvpool.contract.limits import KEY_BYTES
from kvpool.contract.plan import BufferKind, PoolPlan
from kvpool.contract.records import Adopted
from kvpool.contract.vllm_plan import VllmPlan, VllmSpecType
from kvpoold.ids.faults import DIRECTORY, QUARANTINE
from kvpoold.ids.space import IdSpace

# Buffer kinds of a pool whose kv pages can be sealed: nothing else follows or indexes a page.
SEALABLE_KINDS = frozenset({BufferKind.kv.value, BufferKind.state.value,
                            BufferKind.req_to_token.value})
MAX_LAYOUT_CHARS = 512


@dataclass
class Entry:
    """One sealed page."""

    key: bytes
    parent: bytes
    tokens: np.ndarray  # int32, page_size
    layout: str
    sealer: int  # the lease id that sealed it
    checksum: bytes  # b"" on a GPU
    sealed_at: float


@dataclass
class Writers:
    """The processes that mapped the pool under one lease: pidfds, opened when each
    registered (so a reused pid is never mistaken for it)."""

    pidfds: dict[int, int] = field(default_factory=dict)  # pid -> pidfd
    ended: bool = False  # the lease ended

    def gone(self) -> bool:
        """Every registered process exited (and at least one registered)."""
        if not self.ended or not self.pidfds:
            return False
        return all(select.select([fd], [], [], 0)[0] for fd in self.pidfds.values())

    def close(self) -> None:
        for fd in self.pidfds.values():
            os.close(fd)
        self.pidfds.clear()


class DirectorySink(Protocol):
    """Told every change of a directory's sealed set, on the event loop, in order: the pool's
    KV events (``kvpoold.server.kv_stream`` publishes them). It keeps what it is given; the
    directory never changes those objects afterwards."""

    def stored(self, layout: str, keys: list[bytes], parents: list[bytes],
               tokens: np.ndarray) -> None:
        """Pages sealed now: their keys, parents and tokens (int32, one row a page)."""

    def removed(self, keys: list[bytes]) -> None:
        """Sealed pages left the directory (freed, or unsealed): their keys."""

    def cleared(self) -> None:
        """Every sealed page of the pool is gone (a Drop, the daemon's shutdown)."""


# Where a page's bytes lie in one buffer: ``(offset, stride, length)``: page ``u``'s bytes are
# ``length`` bytes at ``offset + u * stride`` of the backing.
Extent = tuple[int, int, int]
# vLLM KV-cache groups whose blocks hold their own tokens' KV only (no window, no state).
SEALABLE_VLLM_GROUPS = frozenset({VllmSpecType.full_attention.value, VllmSpecType.mla.value})


def kv_extents(plan: PoolPlan) -> list[Extent]:
    """The extents of every buffer whose pages are the ``kv`` space's ids (what a page's
    checksum covers): a token-major buffer's page ``u`` is ``page_bytes`` at ``offset + u *
    page_bytes``; a vLLM-layout pool's block ``u`` is, in every layer of every KV-cache tensor,
    the layer's page at ``offset + l * layer_stride + u * block_stride``.

    Raises:
        FailedPrecondition: the pool has no such buffer, or buffers whose ids follow or index
            its pages (hybrid SWA, DSA, compressed KV, a hybrid vLLM pool): not yet sealable.
    """
    if plan.vllm is not None:
        return vllm_extents(plan, plan.vllm)
    other = sorted({b.kind.value for b in plan.buffers} - SEALABLE_KINDS)
    if other:
        raise FailedPrecondition(
            f"this pool has {', '.join(other)} buffers whose ids follow or index its pages "
            "(hybrid SWA, DSA or compressed KV): sealing is supported for pools of plain "
            "token-major KV (and request state) and non-hybrid vLLM pools only, yet",
            field="pool")
    out = [(b.offset_bytes, b.page_bytes, b.page_bytes) for b in plan.buffers
           if b.id_space == "kv" and b.kind == BufferKind.kv and b.page_bytes]
    if not out:
        raise FailedPrecondition(
            "this pool has no token-major KV buffers addressed by its kv ids: sealing is not "
            "supported for it", field="pool")
    return out


def vllm_extents(plan: PoolPlan, v: VllmPlan) -> list[Extent]:
    """The block extents of a vLLM-layout pool (``v`` its vLLM plan; see :func:`kv_extents`):
    one per layer of each KV-cache tensor of the plan's one full-attention group.

    Raises:
        FailedPrecondition: a hybrid pool (several KV-cache groups, a sliding window, Mamba
            state): its block ids index other groups' pages too.
    """
    if len(v.groups) != 1 or v.groups[0].type.value not in SEALABLE_VLLM_GROUPS \
            or v.groups[0].sliding_window:
        kinds = Counter(g.type.value + (f" (window {g.sliding_window})" if g.sliding_window
                                        else "") for g in v.groups)
        shown = ", ".join(f"{n} {kind}" for kind, n in kinds.items()) or "none"
        what = (f"holds no full-attention KV ({shown}: an attention-free model's state only)"
                if len(v.groups) == 1 and not v.groups[0].sliding_window else
                f"is hybrid ({len(v.groups)} KV-cache group(s): {shown}): its block ids "
                "address several groups' pages (sliding window, Mamba state)")
        raise FailedPrecondition(
            f"this vLLM-layout pool {what}; sealing is supported for vLLM pools of one "
            "full-attention KV-cache group only, yet", field="pool")
    (backing,) = [b for b in plan.buffers if b.kind == BufferKind.vllm_kv]
    pages = {layer.name: layer.page_size_padded or layer.page_size_bytes for layer in v.layers}
    return [(backing.offset_bytes + t.offset + i * t.layer_stride, t.block_stride, pages[name])
            for t in v.tensors for i, name in enumerate(t.layers)]


def checksums(backing: torch.Tensor, extents: list[Extent], ids: Iterable[int]) -> list[bytes]:
    """An XXH3-128 digest of each page's bytes over every KV buffer (CPU memory; blocking:
    run it in a worker thread). XXH3 rather than a cryptographic hash: it guards against a
    page changed by a writer that broke the fence (not against a forger, who would need to
    write the pool's memory, which the fence already refuses), at about 5x BLAKE2b's speed
    per page (measured here on 8 KiB rows), which is what sealing costs the daemon's CPU."""
    flat = backing.numpy()
    out = []
    for u in ids:
        h = xxhash.xxh3_128()
        for offset, stride, length in extents:
            start = offset + int(u) * stride
            h.update(memoryview(flat[start:start + length]))
        out.append(h.digest())
    return out


class SealedDirectory:
    """The sealed pages of one pool's ``kv`` space, and the processes that could write them.

    Args:
        space: the pool's ``kv`` id space (its ledger records who holds each page).
        page_size: tokens per page.
        clock: seconds, for ages.
    """

    def __init__(self, space: IdSpace, page_size: int, clock: Callable[[], float]) -> None:
        self.space = space
        self.page_size = page_size
        self._clock = clock
        self.entries: dict[int, Entry] = {}
        self._by_key: dict[tuple[str, bytes], int] = {}
        self._sealed = np.zeros(space.capacity + 2, dtype=bool)  # O(request) membership
        self.orphans: OrderedDict[int, None] = OrderedDict()  # the directory's, oldest first
        # Chains: how many entries name each (layout, key) as their parent, and the kept pages
        # no entry names (the chains' ends: evicted first, so a chain shrinks from its end and
        # what stays is still a prefix the next engine can place).
        self._children: Counter[tuple[str, bytes]] = Counter()
        self._leaves: OrderedDict[int, None] = OrderedDict()  # next to evict first
        self.writers: dict[int, Writers] = {}  # lease id -> its registered processes
        self._by_sealer: Counter[int] = Counter()  # lease id -> entries it is the sealer of
        self.epoch = 0
        self.sealed_total = 0
        self.adopted_total = 0
        self.evicted_total = 0
        self.corrupt_total = 0
        self.sink: DirectorySink | None = None  # the KV events of the pool, when published

    # -- who can write -------------------------------------------------------------------

    def lease_ended(self, lease_id: int, pidfds: dict[int, int]) -> None:
        """Lease ``lease_id`` ended; ``pidfds`` (pid -> pidfd, now the directory's to close)
        are the processes that mapped the pool under it. Its sealed pages become adoptable
        once every one of them has exited (never, when there is none)."""
        if not self._by_sealer[lease_id]:
            for fd in pidfds.values():
                os.close(fd)
            return
        w = self.writers.setdefault(lease_id, Writers())
        w.pidfds.update(pidfds)
        w.ended = True

    def _forget_writers(self) -> None:
        """Close the pidfds of ended leases no sealed page names any more (O(leases with
        writers): an eviction under pressure is an Allocate's path)."""
        for lease_id in [k for k, w in self.writers.items()
                         if w.ended and not self._by_sealer[k]]:
            self.writers.pop(lease_id).close()

    def _sealers_lose(self, counts: Counter[int]) -> None:
        """Leases stop being the sealer of ``counts`` entries each (a lease with none left
        leaves the count)."""
        for lease_id, n in counts.items():
            left = self._by_sealer[lease_id] - n
            if left:
                self._by_sealer[lease_id] = left
            else:
                del self._by_sealer[lease_id]

    # -- seal ----------------------------------------------------------------------------

    def sealed_mask(self, ids: np.ndarray) -> np.ndarray:
        """Which of ``ids`` (in range) are sealed; O(count)."""
        return self._sealed[ids]

    def seal(self, lease_id: int, layout: str, ids: np.ndarray,
             keys: list[bytes], parents: list[bytes], tokens: np.ndarray,
             sums: list[bytes]) -> int:
        """Seal ``ids`` (held by ``lease_id``, checked by the caller) with their content; a page
        already sealed, or a key already in the directory under the same layout, is skipped.

        Returns:
            Pages sealed now.
        """
        now = self._clock()
        done: list[int] = []
        for i, u in enumerate(ids.tolist()):
            slot = (layout, keys[i])
            if self._sealed[u] or slot in self._by_key:
                continue
            self.entries[u] = Entry(keys[i], parents[i], tokens[i].copy(), layout, lease_id,
                                    sums[i] if sums else b"", now)
            self._by_key[slot] = u
            self._sealed[u] = True
            self._add_child(layout, parents[i])
            done.append(i)
        if done:
            self._by_sealer[lease_id] += len(done)
        self.sealed_total += len(done)
        self._tell_stored(layout, done, keys, parents, tokens)
        return len(done)

    def unseal(self, ids: np.ndarray) -> int:
        """Unseal ``ids`` a lease holds (checked by the caller) before it writes them again:
        out of the directory, the lease's still. A page not sealed is skipped. Returns the
        pages unsealed (ids distinct, checked by the caller)."""
        sealed = ids[self._sealed[ids]]
        if sealed.shape[0]:
            self._unseal(sealed)
        return int(sealed.shape[0])

    def keep(self, owner: int, ids: np.ndarray) -> None:
        """``owner`` lets go of sealed ``ids`` (a free, or its lease's end): the directory
        holds them, newest last (checked by the caller: held, not pinned)."""
        if not ids.shape[0]:
            return
        self.space.move(owner, ids.astype(np.int32), DIRECTORY)
        children = self._children
        for u in ids.tolist():
            self.orphans[u] = None
            e = self.entries[u]
            if not children[(e.layout, e.key)]:
                self._leaves[u] = None

    # -- give back -----------------------------------------------------------------------

    def evict(self, count: int) -> np.ndarray:
        """Give back up to ``count`` of the directory's pages, chains' ends first: the oldest
        kept page no entry names as its parent, then its parent if that is now such an end,
        and so on up the chain; only when every kept page is some entry's parent (their
        children held by leases), the oldest kept page. Unsealed and freed; O(count). Returns
        the ids freed."""
        n = min(count, len(self.orphans))
        if n <= 0:
            return np.zeros(0, dtype=np.int32)
        picks: list[int] = []
        leaves, orphans = self._leaves, self.orphans
        sealers: Counter[int] = Counter()
        keys: list[bytes] = []
        for _ in range(n):
            if leaves:
                u = leaves.popitem(last=False)[0]
                del orphans[u]
            else:
                u = orphans.popitem(last=False)[0]
            picks.append(u)
            keys.append(self._drop_entry(u, sealers))
        return self._given_back(picks, keys, sealers)

    def evict_from(self, min_id: int, count: int) -> np.ndarray:
        """Give back up to ``count`` kept pages whose ids are ``>= min_id`` (an elastic
        reclaim's groups: every kept page there must go before the groups can be released),
        chains' ends first, then the oldest; ``min_id <= 1`` is :meth:`evict`. O(kept).
        Returns the ids freed."""
        if min_id <= 1:
            return self.evict(count)
        if count <= 0:
            return np.zeros(0, dtype=np.int32)
        picks = [u for u in self._leaves if u >= min_id][:count]
        if len(picks) < count:
            seen = set(picks)
            picks += [u for u in self.orphans if u >= min_id and u not in seen][
                :count - len(picks)]
        sealers: Counter[int] = Counter()
        keys: list[bytes] = []
        for u in picks:
            del self.orphans[u]  # then its parent, if kept, may become an end: popped below
            keys.append(self._drop_entry(u, sealers))
        return self._given_back(picks, keys, sealers)

    def _given_back(self, picks: list[int], keys: list[bytes],
                    sealers: Counter[int]) -> np.ndarray:
        """Kept pages ``picks``, out of the orphans and the entries already: unsealed, freed."""
        out = np.asarray(picks, dtype=np.int32)
        if not picks:
            return out
        self._unsealed(out, keys, sealers)
        self.space.commit_free(DIRECTORY, out.astype(np.intp))
        self.evicted_total += len(picks)
        self._forget_writers()
        return out

    def evict_all(self) -> int:
        """Give back every page the directory holds (``kvpool sealed --evict``)."""
        return int(self.evict(len(self.orphans)).shape[0])

    def forget(self, ids: np.ndarray) -> None:
        """Unseal ``ids`` a lease holds (pages its end quarantines for a transfer in flight:
        they are freed, never kept)."""
        if ids.shape[0]:
            self._unseal(ids)

    def _unseal(self, ids: np.ndarray) -> None:
        """Forget entries ``ids`` (out of the orphans already, or held by a lease)."""
        sealers: Counter[int] = Counter()
        keys = [self._drop_entry(u, sealers) for u in ids.tolist()]
        self._unsealed(ids, keys, sealers)

    def _drop_entry(self, u: int, sealers: Counter[int]) -> bytes:
        """Forget entry ``u`` (not an orphan any more), counting its sealer; its parent, kept
        and now named by no entry, becomes the next page to evict. Returns its key."""
        e = self.entries.pop(u)
        del self._by_key[(e.layout, e.key)]
        self._leaves.pop(u, None)
        sealers[e.sealer] += 1
        slot = (e.layout, e.parent)
        left = self._children[slot] - 1
        if left > 0:
            self._children[slot] = left
        else:
            del self._children[slot]
            parent = self._by_key.get(slot)
            if parent is not None and parent in self.orphans:
                self._leaves[parent] = None
                self._leaves.move_to_end(parent, last=False)
        return e.key

    def _unsealed(self, ids: np.ndarray, keys: list[bytes], sealers: Counter[int]) -> None:
        self._sealers_lose(sealers)
        self._sealed[ids] = False
        self._tell_removed(keys)

    def _add_child(self, layout: str, parent: bytes) -> None:
        """An entry names ``parent``: that page, if kept, is no chain's end any more."""
        slot = (layout, parent)
        self._children[slot] += 1
        u = self._by_key.get(slot)
        if u is not None:
            self._leaves.pop(u, None)

    # -- adopt ---------------------------------------------------------------------------

    def candidates(self, layout: str) -> tuple[list[int], int, int]:
        """The directory's pages of ``layout`` whose writers are all gone: ``(ids, unfenced,
        other_layout)``."""
        ok, unfenced, other = [], 0, 0
        gone: dict[int, bool] = {}
        for u in self.orphans:
            e = self.entries[u]
            if e.layout != layout:
                other += 1
                continue
            if e.sealer not in gone:
                w = self.writers.get(e.sealer)
                gone[e.sealer] = w is not None and w.gone()
            if gone[e.sealer]:
                ok.append(u)
            else:
                unfenced += 1
        return ok, unfenced, other

    def adopt(self, owner: int, lease_id: int, layout: str, ids: list[int],
              sums: list[bytes] | None, unfenced: int, other: int) -> Adopted:
        """Hand ``ids`` (from :meth:`candidates`, their checksums re-read now on CPU, or None)
        to ``owner`` (lease ``lease_id``, whose processes are their writers from now on); a
        page whose checksum changed is freed instead. Parents come before their children."""
        bad = [u for i, u in enumerate(ids)
               if sums is not None and self.entries[u].checksum != sums[i]]
        if bad:
            for u in bad:
                del self.orphans[u]
                self._leaves.pop(u, None)
            arr = np.asarray(bad, dtype=np.int32)
            self._unseal(arr)
            self.space.commit_free(DIRECTORY, arr.astype(np.intp))
            self.corrupt_total += len(bad)
        good = [u for u in ids if u not in set(bad)]
        order = self._parents_first(good)
        arr = np.asarray(order, dtype=np.int32)
        sealers: Counter[int] = Counter()
        for u in order:
            del self.orphans[u]
            self._leaves.pop(u, None)
            sealers[self.entries[u].sealer] += 1
            self.entries[u].sealer = lease_id
        self._sealers_lose(sealers)
        if order:
            self._by_sealer[lease_id] += len(order)
        self.space.move(DIRECTORY, arr, owner)
        if order:
            self.epoch += 1
        self.adopted_total += len(order)
        entries = [self.entries[u] for u in order]
        tokens = (np.stack([e.tokens for e in entries]) if entries
                  else np.zeros((0, self.page_size), dtype=np.int32))
        self._forget_writers()
        return Adopted(arr, [e.key for e in entries], [e.parent for e in entries], tokens,
                       self.epoch, unfenced, len(bad), other)

    def _parents_first(self, ids: list[int]) -> list[int]:
        """``ids`` ordered by depth in their hash chains (a parent not among them: depth 0)."""
        by_key = {(self.entries[u].layout, self.entries[u].key): u for u in ids}
        depth: dict[int, int] = {}
        for u in ids:
            path: list[int] = []
            cur = u
            while cur not in depth:
                path.append(cur)
                e = self.entries[cur]
                parent = by_key.get((e.layout, e.parent))
                if parent is None or parent in path:
                    depth[cur] = 0
                    path.pop()
                    break
                cur = parent
            d = depth[cur]
            for v in reversed(path):
                d += 1
                depth[v] = d
        return sorted(ids, key=depth.__getitem__)

    # -- whole directory -----------------------------------------------------------------

    def ages(self) -> tuple[float, float]:
        """Seconds since the oldest and the newest directory page was sealed (0, 0: none)."""
        if not self.orphans:
            return 0.0, 0.0
        now = self._clock()
        times = [self.entries[u].sealed_at for u in self.orphans]
        return now - min(times), now - max(times)

    def audit(self) -> None:
        """The directory agrees with the ledger: every sealed page is held (by a lease or the
        directory, never free), the directory holds exactly its kept pages, the indexes agree.

        Raises:
            Internal: naming the first broken one.
        """
        ids = np.fromiter(self.entries, dtype=np.int32, count=len(self.entries))
        owners = self.space.owner_of(ids) if ids.shape[0] else ids
        kept = set(ids[owners == DIRECTORY].tolist())
        checks = [
            (bool((owners != 0).all()), "a sealed page is free"),
            (bool((owners != QUARANTINE).all()), "a sealed page is quarantined"),
            (kept == set(self.orphans), "the kept pages are not the directory's"),
            (self.space.held(DIRECTORY) == len(self.orphans),
             "the directory holds pages it does not keep"),
            (int(self._sealed.sum()) == len(self.entries) == len(self._by_key),
             "the sealed indexes disagree"),
            (self._by_sealer == Counter(e.sealer for e in self.entries.values()),
             "the sealers' counts disagree"),
            (self._children == Counter((e.layout, e.parent) for e in self.entries.values()),
             "the chains' child counts disagree"),
            (set(self._leaves) == {u for u in self.orphans if not self._children[
                (self.entries[u].layout, self.entries[u].key)]},
             "the chains' ends are not the kept pages no entry names"),
        ]
        for ok, why in checks:
            if not ok:
                raise Internal(f"sealed directory of {self.space.label}: {why}")

    def close(self) -> None:
        """The pool is gone: forget every entry, close every pidfd."""
        self.drop_sink()
        for w in self.writers.values():
            w.close()
        self.writers.clear()
        self._by_sealer.clear()
        self.entries.clear()
        self._by_key.clear()
        self.orphans.clear()
        self._leaves.clear()
        self._children.clear()


    # -- the KV events of the pool (kvpoold.server.kv_stream) ------------------------------

    def attach_sink(self, sink: DirectorySink) -> None:
        """Tell ``sink`` every change from now on (the directory is new: nothing before)."""
        self.sink = sink

    def drop_sink(self) -> None:
        """The pool is dropped or closed: tell the sink every page is gone, then nothing more
        (its region may be released in a worker thread afterwards)."""
        sink, self.sink = self.sink, None
        if sink is not None:
            sink.cleared()

    def stored_entries(self) -> list[Entry]:
        """Every sealed page's entry (held or kept), oldest sealed first: what a router that
        starts now must learn. O(pages) in C: a list of references, read off the loop."""
        return list(self.entries.values())

    def _tell_stored(self, layout: str, done: list[int], keys: list[bytes],
                     parents: list[bytes], tokens: np.ndarray) -> None:
        if self.sink is None or not done:
            return
        if len(done) == len(keys):
            self.sink.stored(layout, list(keys), list(parents), tokens)
        else:
            self.sink.stored(layout, [keys[i] for i in done], [parents[i] for i in done],
                             tokens[done])

    def _tell_removed(self, keys: list[bytes]) -> None:
        if self.sink is not None and keys:
            self.sink.removed(keys)


def check_seal_args(layout: str, ids: np.ndarray, keys: bytes, parents: bytes,
                    tokens: np.ndarray, page_size: int) -> tuple[list[bytes], list[bytes],
                                                                 np.ndarray]:
    """A Seal's arrays checked against each other: ``(keys, parents, tokens)`` per page.

    Raises:
        InvalidArgument: an empty or over-long layout, or arrays of other lengths.
    """
    n = ids.shape[0]
    if not layout or len(layout) > MAX_LAYOUT_CHARS:
        raise InvalidArgument(f"layout must be 1..{MAX_LAYOUT_CHARS} characters (the engine, "
                              f"its version, hash and rank), got {len(layout)}", field="layout")
    if len(keys) != n * KEY_BYTES or len(parents) != n * KEY_BYTES:
        raise InvalidArgument(
            f"{n} pages need {n * KEY_BYTES} bytes of keys and of parents ({KEY_BYTES} a "
            f"page), got {len(keys)} and {len(parents)}", field="keys")
    if tokens.shape[0] != n * page_size:
        raise InvalidArgument(f"{n} pages of {page_size} tokens need {n * page_size} token "
                              f"ids, got {tokens.shape[0]}", field="tokens")
    k = [keys[i * KEY_BYTES:(i + 1) * KEY_BYTES] for i in range(n)]
    p = [parents[i * KEY_BYTES:(i + 1) * KEY_BYTES] for i in range(n)]
    return k, p, tokens.reshape(n, page_size)
