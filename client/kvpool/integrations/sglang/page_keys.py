"""The keys kvpool's SGLang plugin seals full radix-cache pages under, and how an adopter turns
sealed pages back into token sequences (pure functions: no SGLang, no daemon).

**Keys.** A page's key is SGLang 0.5.23's own page hash, the one its HiCache storage and KV
events derive (``sglang.srt.mem_cache.utils.get_hash_str``, computed by its C++ extension
``hash_binding.cpp``): SHA-256 over the previous page's 32-byte digest (none for a sequence's
first page) followed by the page's token ids as little-endian uint32. So a key names the whole
prefix up to and including its page, and ``key.hex()`` is what SGLang's ``node.hash_value``
holds for that page (``tests/integration/sglang/test_restart.py`` compares the two). The
daemon's parent of a first page is 32 zero bytes (docs/restart.md). Pages whose radix key has
a namespace (``extra_key``: LoRA; ``cache_salt``), bigram keys (EAGLE) and token ids past
uint32 (SGLang's wide encoding) are not sealed: the plugin skips them before any key is made.

**Adoption.** The daemon hands an adopter pages with their key, parent key and tokens, parents
before children. :func:`plan_inserts` checks every page's key against its parent and tokens
(a page that does not hash to its key, or whose parent is neither adopted nor known, cannot be
placed: its prefix is unknown) and returns one token path per leaf, root first: what the radix
tree's ``insert`` takes.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import numpy as np

from kvpool.contract.limits import KEY_BYTES

ZERO_KEY = bytes(KEY_BYTES)
HASH_NAME = "sha256-u32-chain"  # in the layout string: how keys are made
U32_MAX = (1 << 32) - 1


def page_key(parent: bytes | None, tokens: np.ndarray) -> bytes:
    """The key of one page: SHA-256 of the parent's key (none, or 32 zero bytes, for a first
    page) and the page's token ids as little-endian uint32."""
    h = hashlib.sha256()
    if parent is not None and parent != ZERO_KEY:
        h.update(parent)
    h.update(np.ascontiguousarray(tokens, dtype="<u4").tobytes())
    return h.digest()


def chain_keys(tokens: np.ndarray, page_size: int, parent: bytes | None = None) -> list[bytes]:
    """The keys of the whole pages of ``tokens`` (a 1-D array of token ids, whole pages),
    chained from ``parent`` (None: ``tokens`` starts a sequence)."""
    data = np.ascontiguousarray(tokens, dtype="<u4").tobytes()
    step = 4 * page_size
    out = []
    prev = b"" if parent is None or parent == ZERO_KEY else parent
    for start in range(0, len(data) - step + 1, step):
        prev = hashlib.sha256(prev + data[start:start + step]).digest()
        out.append(prev)
    return out


def sealable_tokens(token_ids: Iterable[int] | np.ndarray) -> np.ndarray | None:
    """The token ids as uint32, or None when one does not fit (SGLang hashes those with its
    wide encoding, which these keys do not model)."""
    arr = np.asarray(token_ids)
    if arr.size and (int(arr.min()) < 0 or int(arr.max()) > U32_MAX):
        return None
    return arr.astype(np.uint32)


@dataclass(frozen=True)
class Known:
    """A sealed page the adopter already holds (in its radix tree): its page id, its parent's
    key and its tokens."""

    page: int
    parent: bytes
    tokens: np.ndarray


@dataclass
class InsertPlan:
    """What an adoption puts into the radix tree.

    Attributes:
        paths: one ``(tokens, pages)`` per leaf, root first: int64 token ids of whole pages,
            and the page id of each page.
        placed: the adopted page ids on some path.
        unplaced: the adopted page ids none can be placed for: a key that does not match its
            parent and tokens (``inconsistent``), or a parent that is neither adopted nor known
            (``orphans``).
        inconsistent: pages whose key is not their parent's and tokens' hash.
        orphans: pages whose chain does not reach a first page.
    """

    paths: list[tuple[np.ndarray, np.ndarray]]
    placed: np.ndarray
    unplaced: np.ndarray
    inconsistent: int = 0
    orphans: int = 0


def plan_inserts(ids: np.ndarray, keys: list[bytes], parents: list[bytes],
                 tokens: np.ndarray, page_size: int,
                 known: Callable[[bytes], Known | None] = lambda key: None) -> InsertPlan:
    """The token paths that put adopted pages into a radix tree (see the module docstring).

    Args:
        ids: the adopted page ids.
        keys, parents: each page's key and parent key (32 zero bytes: a first page).
        tokens: ``(pages, page_size)`` token ids.
        page_size: tokens per page.
        known: the adopter's own sealed page of a key, or None (a chain may continue from a
            page adopted or sealed earlier).
    """
    n = int(ids.shape[0])
    index = {keys[i]: i for i in range(n)}
    state = np.zeros(n, dtype=np.int8)  # 0 not yet seen, 1 placeable, 2 not
    known_ok: dict[bytes, bool] = {}
    inconsistent = 0
    for i in range(n):
        path: list[int] = []
        cur = i
        while True:  # up the chain (iterative: chains are long) until its fate is known
            if state[cur]:
                reached = bool(state[cur] == 1)
                break
            if len(path) > n:  # a cycle would be a hash collision: place nothing of it
                reached = False
                break
            path.append(cur)
            if page_key(parents[cur], tokens[cur]) != keys[cur]:
                inconsistent += 1
                reached = False
                break
            parent = parents[cur]
            if parent == ZERO_KEY:
                reached = True
                break
            if parent in index:
                cur = index[parent]
                continue
            if parent not in known_ok:
                known_ok[parent] = _known_reaches(parent, known)
            reached = known_ok[parent]
            break
        state[path] = 1 if reached else 2
    ok = state == 1
    has_child = np.zeros(n, dtype=bool)
    for i in np.flatnonzero(ok):
        j = index.get(parents[i])
        if j is not None:
            has_child[j] = True
    paths = []
    for leaf in np.flatnonzero(ok & ~has_child):
        chain_pages, chain_tokens = [], []
        cur_key = keys[leaf]
        while cur_key != ZERO_KEY:
            j = index.get(cur_key)
            if j is not None:
                chain_pages.append(int(ids[j]))
                chain_tokens.append(tokens[j])
                cur_key = parents[j]
                continue
            k = known(cur_key)
            assert k is not None
            chain_pages.append(k.page)
            chain_tokens.append(k.tokens)
            cur_key = k.parent
        chain_pages.reverse()
        chain_tokens.reverse()
        paths.append((np.concatenate(chain_tokens).astype(np.int64),
                      np.asarray(chain_pages, dtype=np.int64)))
    not_ok = int(n - ok.sum())
    return InsertPlan(paths=paths, placed=ids[ok], unplaced=ids[~ok],
                      inconsistent=inconsistent, orphans=not_ok - inconsistent)


def _known_reaches(key: bytes, known: Callable[[bytes], Known | None]) -> bool:
    """Whether the adopter's own page of ``key`` exists and its chain reaches a first page."""
    for _ in range(1 << 24):  # bounded: a cycle would be a bug
        k = known(key)
        if k is None:
            return False
        if k.parent == ZERO_KEY:
            return True
        key = k.parent
    return False


__all__ = ["HASH_NAME", "ZERO_KEY", "InsertPlan", "Known", "chain_keys", "page_key",
           "plan_inserts", "sealable_tokens"]
