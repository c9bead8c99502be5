"""The client side's elastic decisions, as pure functions of counts: how much the allocator's
page cache grows, when growth is held off, what the allocator reports as evictable and free.

Every function here takes numbers (pages, tokens, seconds) and returns a number or a frozen
value; none reads a clock, a cache or SGLang. The allocator (``allocator.py``) and its elastic
upkeep (``elastic_upkeep.py``) read the counts, ask these for the decision and carry it out:
one ``try_alloc`` of :func:`grow_ask` pages, a :class:`Backoff` after a refusal, the count
:func:`evictable_pages` reports. The live prefill budget (``elastic_scheduler.py``) asks
:func:`prefill_growth`, :func:`admission_growth`, :func:`capacity_growth` and
:func:`chunk_growth` how many tokens a check lacks.

Growth is asked once: one Allocate of at least the cache's batch (so the page cache never
falls back to a second, smaller Allocate); a refusal holds growth off for ``wait_s`` (doubling
to ``GROW_RETRY_MAX_S``) while the daemon grants or reclaims groups on its own, and SGLang
retries at its next step, as it does with any refusal (the request waits, decode retracts).
"""

from __future__ import annotations

from dataclasses import dataclass

# After the daemon refused to grow an elastic pool's cache, growth is asked again after this
# long (doubling up to GROW_RETRY_MAX_S), so a scheduler short of memory does not ask every
# step.
GROW_RETRY_S = 0.05
GROW_RETRY_MAX_S = 1.0


@dataclass(frozen=True)
class Backoff:
    """When growth may be asked again (``at``, monotonic seconds) and how long the next
    refusal holds it off (``wait_s``)."""

    at: float = 0.0
    wait_s: float = GROW_RETRY_S

    def held_off(self, now: float) -> bool:
        """Whether growth must not be asked at ``now``."""
        return now < self.at

    def refused(self, now: float) -> Backoff:
        """The daemon refused at ``now``: held off ``wait_s``, the next wait doubled (capped)."""
        return Backoff(now + self.wait_s, min(GROW_RETRY_MAX_S, self.wait_s * 2))

    def granted(self) -> Backoff:
        """The daemon granted: the next refusal waits the shortest again."""
        return Backoff()


def pages_for(tokens: int, page_size: int) -> int:
    """Whole pages that cover ``tokens`` (0 for none or fewer)."""
    return max(0, -(-int(tokens) // page_size))


def grow_ask(pages: int, *, quota_pages: int, in_use: int, cached: int, batch: int,
             now: float, backoff: Backoff) -> int:
    """How many pages one growth asks the daemon for (0: none is asked).

    None while held off by a refusal, or when the quota has no room past what the cache holds
    (``quota_pages - in_use - cached``). Otherwise at least ``batch`` (the page cache's miss
    then makes exactly one Allocate, never a second for what is missing), ``pages`` when more,
    up to the room; the cache keeps what is past the room unused (the live size caps at the
    quota).

    Args:
        pages: what the caller lacks (may be 0 or negative: nothing).
        quota_pages: the allocator's quota.
        in_use: pages handed out and not freed.
        cached: pages the cache holds unused.
        batch: the page cache's batch.
        now: monotonic seconds.
        backoff: the current hold-off.
    """
    room = quota_pages - in_use - cached
    if pages <= 0 or room <= 0 or backoff.held_off(now):
        return 0
    return max(batch, min(room, pages))


def upkeep_growth(*, cached: int, low_pages: int) -> int:
    """Pages the upkeep between steps grows the cache by: what it lacks of ``low_pages``."""
    return max(0, low_pages - cached)


def evictable_pages(evictable_tokens: int, page_size: int, *, prefix_sharing: bool) -> int | None:
    """Pages of the radix tree the allocator reports as evictable (None: report nothing, the
    tree shares no prefixes, or there is none)."""
    if not prefix_sharing:
        return None
    return max(0, int(evictable_tokens)) // page_size


def live_tokens(*, quota_pages: int, in_use: int, cached: int, page_size: int) -> int:
    """Tokens an elastic allocator hands out without asking the daemon: the pages its cache
    holds unused, within the quota."""
    return max(0, min(cached, quota_pages - in_use)) * page_size


def available_tokens(*, quota_pages: int, in_use: int, cached: int, page_size: int,
                     elastic: bool, tree_tokens: int) -> int:
    """What ``available_size()`` reports: the quota less the pages in use (a fixed pool, and an
    elastic one at rest: the pages in use are exactly the radix tree's, the number SGLang's
    idle identity adds up), else the live size."""
    if elastic and in_use * page_size != tree_tokens:
        return live_tokens(quota_pages=quota_pages, in_use=in_use, cached=cached,
                           page_size=page_size)
    return (quota_pages - in_use) * page_size


def decode_growth(num_tokens: int, *, live: int, page_size: int) -> int:
    """Pages a decode check grows by: what the live size lacks of the step's tokens."""
    return pages_for(int(num_tokens) - live, page_size)


def prefill_growth(*, paged_input: int, max_new_tokens: int, remaining_current: int,
                   remaining_total: int, page_size: int) -> int:
    """Tokens ``can_allocate_prefill`` grows by first: the request's input and what it may
    still decode, plus a page, less what remains (SGLang's ``ignore_eos`` admission then checks
    every admitted request's decode against the live size, which no hook reaches)."""
    room = min(remaining_current, remaining_total)
    return max(0, paged_input + max_new_tokens + page_size - room)


def admission_growth(*, total_tokens: int, remaining_total: int) -> int:
    """Tokens ``check_prefill`` grows by when SGLang refused a request: what it lacks."""
    return max(0, total_tokens - remaining_total + 1)


def capacity_growth(*, remaining_current: int, remaining_total: int, page_size: int) -> int:
    """Tokens ``has_capacity`` grows by when it found none: the deficit plus a page."""
    return max(-remaining_total, -remaining_current, 0) + page_size


def chunk_growth(chunk_limit: int, *, remaining_total: int) -> int:
    """Tokens a chunked prefill grows by before its next chunk: what the live size lacks of a
    whole chunk (0 without a chunk limit)."""
    if not chunk_limit:
        return 0
    return max(0, int(chunk_limit) - int(remaining_total))


__all__ = [
    "GROW_RETRY_MAX_S", "GROW_RETRY_S", "Backoff", "admission_growth", "available_tokens",
    "capacity_growth", "chunk_growth", "decode_growth", "evictable_pages", "grow_ask",
    "live_tokens", "pages_for", "prefill_growth", "upkeep_growth",
]
