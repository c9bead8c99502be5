"""SGLang's scheduler over an elastic kvpool pool: the live admission budget and the idle
conservation check that takes the place of SGLang's token identity.

SGLang's admission (``PrefillBudget``), decode capacity check and retraction read the
allocator's free size each step. Over an elastic pool the paged allocator
(``kvpool.integrations.sglang.allocator``) counts as free only the pages its lease holds
unused in its page cache (:meth:`PagedAllocator.live_available_size`): memory the daemon
granted and the engine can hand out without asking anyone, so an allocation SGLang admitted
never fails. :func:`live_prefill_budget` makes SGLang's budget over that number.

SGLang's idle check (``SchedulerInvariantChecker``, strict by default through
``SGLANG_ENABLE_STRICT_MEM_CHECK_DURING_IDLE``) asserts ``available + evictable + protected ==
max_total_num_tokens``. At idle no request holds pages: the pages in use are exactly the radix
tree's. The allocator then reports the quota less the pages in use (the number the identity
adds up; nothing is admitted while idle), and :func:`conservation_violations`, run from
``verify_byte_accounting`` right after SGLang's identity, checks the ids themselves: the pages
in use are exactly the pages the radix tree holds (nothing lost, nothing counted twice), the
cache's counts add up, and the daemon's count of what the lease holds equals cached + in use.
Any other state at idle (a page taken and never returned: more in use than the tree holds)
reports the live size, so SGLang's own identity fails too.
"""

from __future__ import annotations

import functools
import logging
from typing import Any

import numpy as np

from kvpool.integrations.sglang.grow_plan import (
    admission_growth,
    capacity_growth,
    chunk_growth,
    pages_for,
    prefill_growth,
)

log = logging.getLogger(__name__)


@functools.cache
def live_prefill_budget() -> type:
    """:class:`LivePrefillBudget`, made on first use: SGLang's ``prefill_budget`` module pulls
    in its KV pools and kernels, which the allocator's import must not (its differential test
    imports it bare)."""
    from sglang.srt.mem_cache.prefill_budget import PrefillBudget

    class LivePrefillBudget(PrefillBudget):
        """SGLang's fixed-pool prefill budget, counting the allocator's live free size (granted
        pages it holds unused) instead of ``available_size()``."""

        def _available_and_evictable(self) -> int:
            return int(self.allocator.live_available_size()) + int(self.tree_cache.evictable_size())

        def check_prefill(self, **kwargs: Any) -> tuple[bool, int | None]:
            """SGLang's check; a request that does not fit grows the allocator's cache by what it
            lacks (only ever adding pages: safe inside an admission) and is checked again."""
            ok, limit = super().check_prefill(**kwargs)
            if not ok and self._grow(admission_growth(
                    total_tokens=int(kwargs["total_tokens"]),
                    remaining_total=self.remaining_total)):
                ok, limit = super().check_prefill(**kwargs)
            if not ok:
                log.debug("kvpool: admission refused a request of %s tokens: %d remaining "
                          "(live %d)", kwargs["total_tokens"], self.remaining_total,
                          self.allocator.live_available_size())
            return ok, limit

        def can_allocate_prefill(self, *, paged_input: int, **kwargs: Any) -> bool:
            """SGLang's check; the cache first grows to cover the request's input and the
            tokens it may still decode. SGLang's admission of ``ignore_eos`` requests (without
            a radix cache) checks right after, against the live size and no hook of ours,
            that what remains covers every admitted request's decode to its end: growing
            here by this request's share keeps that check from refusing for want of pages
            the daemon would grant."""
            self._grow(prefill_growth(
                paged_input=paged_input, max_new_tokens=int(kwargs.get("max_new_tokens") or 0),
                remaining_current=self.remaining_current,
                remaining_total=self.remaining_total, page_size=self.page_size))
            ok = super().can_allocate_prefill(paged_input=paged_input, **kwargs)
            if not ok and self._grow(paged_input - min(self.remaining_current,
                                                       self.remaining_total)):
                ok = super().can_allocate_prefill(paged_input=paged_input, **kwargs)
            if not ok:
                log.debug("kvpool: admission cannot allocate %d tokens: %d / %d remaining",
                          paged_input, self.remaining_current, self.remaining_total)
            return ok

        def has_capacity(self) -> bool:
            ok = super().has_capacity()
            if not ok and self._grow(capacity_growth(
                    remaining_current=self.remaining_current,
                    remaining_total=self.remaining_total, page_size=self.page_size)):
                ok = super().has_capacity()
            if not ok:
                log.debug("kvpool: admission has no capacity: %d / %d remaining",
                          self.remaining_current, self.remaining_total)
            return ok

        def available_chunk_tokens(self, chunk_limit: int) -> int | None:
            """The next chunk of a request prefilled in chunks: SGLang's, after growing by what
            the live size lacks of a whole chunk (a small live size would cut every chunk
            short)."""
            self._grow(chunk_growth(chunk_limit, remaining_total=self.remaining_total))
            return super().available_chunk_tokens(chunk_limit)

        def reserve(self, *args: Any, **kwargs: Any) -> None:
            """SGLang admits a request: the allocator learns this admission was not in vain."""
            super().reserve(*args, **kwargs)
            self.allocator.admitted()

        def _grow(self, tokens: int) -> bool:
            """Ask the allocator for ``tokens`` more (in whole pages, once: a refusal holds
            growth off, ``grow_plan.Backoff``); whether it got any."""
            return tokens > 0 and self.allocator.grow(pages_for(tokens, self.page_size)) > 0

    return LivePrefillBudget


def tree_tokens(tree: Any) -> int:
    """Tokens the radix tree holds (evictable and protected), 0 without a tree."""
    if tree is None:
        return 0
    return int(tree.evictable_size()) + int(tree.protected_size())


def tree_pages(tree: Any, page_size: int) -> np.ndarray:
    """The distinct pages the radix tree's token locations lie in (int64, ascending)."""
    if tree is None or not tree_tokens(tree):
        return np.empty(0, dtype=np.int64)
    values = tree.all_values_flatten()
    return np.unique(values.detach().to("cpu").numpy().astype(np.int64) // page_size)


def conservation_violations(*, pool: str, page_size: int, in_use: np.ndarray, cached: int,
                            tree: Any, lease_held: int | None) -> list[str]:
    """What breaks the idle conservation of an elastic pool's pages, as SGLang's
    ``verify_byte_accounting`` reports it (empty: all accounted).

    Args:
        pool: the pool's name (for the messages).
        page_size: tokens per page.
        in_use: the pages the allocator handed out and SGLang did not free (ascending).
        cached: the pages the lease holds unused in the page cache.
        tree: SGLang's radix tree (None before the scheduler passed it: nothing may be in use).
        lease_held: the pages of the pool's ``kv`` space the daemon counts for the lease
            (None: not asked).
    """
    out = []
    held = tree_pages(tree, page_size)
    if tree_tokens(tree) != held.size * page_size:
        out.append(f"kvpool pool {pool!r}: the radix tree counts {tree_tokens(tree)} tokens "
                   f"but its locations lie in {held.size} pages of {page_size}")
    leaked = np.setdiff1d(in_use, held, assume_unique=True)
    if leaked.size:
        out.append(f"kvpool pool {pool!r}: {leaked.size} page(s) in use at idle that no "
                   f"request or radix node holds (taken and never returned): "
                   f"{leaked[:8].tolist()}{' ...' if leaked.size > 8 else ''}")
    stale = np.setdiff1d(held, in_use, assume_unique=True)
    if stale.size:
        out.append(f"kvpool pool {pool!r}: the radix tree holds {stale.size} page(s) the "
                   f"allocator counts as free (returned while still referenced): "
                   f"{stale[:8].tolist()}{' ...' if stale.size > 8 else ''}")
    if lease_held is not None and lease_held != cached + in_use.size:
        out.append(f"kvpool pool {pool!r}: the daemon counts {lease_held} kv pages held by "
                   f"the scheduler's lease but the allocator has {in_use.size} in use and "
                   f"{cached} cached")
    return out


__all__ = ["conservation_violations", "live_prefill_budget", "tree_pages", "tree_tokens"]
