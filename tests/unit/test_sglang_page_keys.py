"""The SGLang plugin's page keys and the adopter's plan (``kvpool.integrations.sglang
.page_keys``): keys chain SHA-256 over the parent key and the page's uint32 tokens (SGLang's
own page hash; the engine test compares them with SGLang's ``get_hash_str``), and an adoption
places exactly the pages whose chain it can check back to a first page."""

from __future__ import annotations

import hashlib

import numpy as np

from kvpool.integrations.sglang.page_keys import (
    ZERO_KEY,
    Known,
    chain_keys,
    page_key,
    plan_inserts,
    sealable_tokens,
)

PS = 4


def test_keys_chain_sha256_over_parent_and_uint32_tokens() -> None:
    tokens = np.arange(5, 17)
    keys = chain_keys(tokens, PS)
    first = hashlib.sha256(np.arange(5, 9, dtype="<u4").tobytes()).digest()
    second = hashlib.sha256(first + np.arange(9, 13, dtype="<u4").tobytes()).digest()
    assert keys[:2] == [first, second] and len(keys) == 3
    assert page_key(ZERO_KEY, tokens[:4]) == page_key(None, tokens[:4]) == first
    assert chain_keys(tokens[4:], PS, first) == keys[1:]
    assert chain_keys(np.arange(7), PS) == chain_keys(np.arange(4), PS)  # whole pages only
    assert sealable_tokens([1, 2**32]) is None and sealable_tokens([1, 2]).dtype == np.uint32


def chain(tokens: np.ndarray, first_id: int) -> tuple[np.ndarray, list[bytes], list[bytes],
                                                     np.ndarray]:
    keys = chain_keys(tokens, PS)
    n = len(keys)
    return (np.arange(first_id, first_id + n), keys, [ZERO_KEY, *keys[:-1]],
            tokens[:n * PS].reshape(n, PS))


def test_a_tree_is_one_path_per_leaf() -> None:
    trunk = np.arange(20, 28)
    a, b = np.concatenate([trunk, np.arange(40, 44)]), np.concatenate([trunk, [50, 51, 52, 53]])
    ids_a, keys_a, par_a, tok_a = chain(a, 1)
    _, keys_b, par_b, tok_b = chain(b, 10)
    # b's trunk pages are a's (the same keys): the daemon holds each key once
    ids = np.concatenate([ids_a, [12]])
    plan = plan_inserts(ids, keys_a + keys_b[2:], par_a + par_b[2:],
                        np.concatenate([tok_a, tok_b[2:]]), PS)
    assert plan.unplaced.size == 0 and sorted(plan.placed.tolist()) == [1, 2, 3, 12]
    paths = sorted((t.tolist(), p.tolist()) for t, p in plan.paths)
    assert paths == sorted([(a.tolist(), [1, 2, 3]), (b.tolist(), [1, 2, 12])])


def test_what_cannot_be_checked_back_to_a_first_page_is_not_placed() -> None:
    tokens = np.arange(30, 46)
    ids, keys, parents, toks = chain(tokens, 1)
    # the first page gone (evicted): the others are orphans
    plan = plan_inserts(ids[1:], keys[1:], parents[1:], toks[1:], PS)
    assert plan.placed.size == 0 and plan.orphans == 3 and plan.inconsistent == 0
    # a page whose tokens do not hash to its key: it and its descendants are not placed
    bad = toks.copy()
    bad[1, 0] += 1
    plan = plan_inserts(ids, keys, parents, bad, PS)
    assert plan.placed.tolist() == [1] and plan.inconsistent == 1 and plan.orphans == 2
    assert [p.tolist() for _, p in plan.paths] == [[1]]


def test_a_chain_continues_from_the_adopters_own_pages() -> None:
    tokens = np.arange(60, 72)
    ids, keys, parents, toks = chain(tokens, 5)
    own = {keys[0]: Known(99, ZERO_KEY, toks[0].astype(np.int64))}
    plan = plan_inserts(ids[1:], keys[1:], parents[1:], toks[1:], PS, own.get)
    assert plan.placed.tolist() == [6, 7]
    (path_tokens, path_pages), = plan.paths
    assert path_tokens.tolist() == tokens.tolist() and path_pages.tolist() == [99, 6, 7]
