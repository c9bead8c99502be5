"""The allocator ledgers (``ledger.py``, ``_ledger.c``): the same loops in C and in numpy.

Each ledger is driven directly over real int32 arrays; a differential test runs one random
program on both and compares every array after every step, and CI fails if the C ledger was
not built (``KVPOOL_REQUIRE_NATIVE=1``).
"""

from __future__ import annotations

import os
import random

import numpy as np
import pytest

from kvpool.errors import InvalidArgument
from kvpoold.alloc.ids import IdPool
from kvpoold.alloc.ledger import (
    ENV,
    Backend,
    NativeLedger,
    check_backend,
    default_backend,
    native_available,
    new_ledger,
)

NATIVE = pytest.mark.skipif(not native_available(), reason="kvpoold.alloc._ledger is not built")


def arrays(cap: int) -> tuple[np.ndarray, np.ndarray]:
    stack = np.arange(1, cap + 1, dtype=np.int32)
    owners = np.zeros(cap + 2, dtype=np.int32)
    owners[0] = owners[-1] = -1
    return stack, owners


@pytest.fixture(params=["native", "numpy"])
def backend(request: pytest.FixtureRequest) -> Backend:
    if request.param == "native" and not native_available():
        pytest.skip("kvpoold.alloc._ledger is not built")
    return request.param  # type: ignore[no-any-return]


def test_native_ledger_is_built_where_required() -> None:
    """CI sets KVPOOL_REQUIRE_NATIVE=1: a missing C build must fail the run, not skip tests."""
    if os.environ.get("KVPOOL_REQUIRE_NATIVE") != "1":
        pytest.skip("KVPOOL_REQUIRE_NATIVE is not set")
    assert native_available(), "kvpoold.alloc._ledger did not build or does not import"
    assert default_backend() == "native"


def test_take_hands_out_the_stack_in_order_and_marks_owners(backend: Backend) -> None:
    stack, owners = arrays(6)
    ledger = new_ledger(stack, owners, backend)
    out = np.empty(4, dtype=np.int32)
    ledger.take(3, out)
    assert out.tolist() == [1, 2, 3, 4] and ledger.head == 4
    assert owners.tolist() == [-1, 3, 3, 3, 3, 0, 0, -1]
    with pytest.raises(ValueError, match="only 2 free"):
        ledger.take(3, np.empty(3, dtype=np.int32))
    assert ledger.head == 4 and owners.tolist() == [-1, 3, 3, 3, 3, 0, 0, -1]


@pytest.mark.parametrize("dtype", [np.int32, np.int64])
def test_give_frees_lifo_and_reports_success(backend: Backend, dtype: type) -> None:
    stack, owners = arrays(6)
    ledger = new_ledger(stack, owners, backend)
    ledger.take(5, np.empty(4, dtype=np.int32))
    assert ledger.give(5, np.array([4, 2], dtype=dtype)) == -1
    assert ledger.head == 2
    assert owners.tolist() == [-1, 5, 0, 5, 0, 0, 0, -1]
    out = np.empty(2, dtype=np.int32)
    ledger.take(6, out)
    assert out.tolist() == [4, 2]  # the freed ids come back first, in the order given


@pytest.mark.parametrize(
    ("ids", "first_bad"),
    [
        ([1, 0], 1),  # 0 is reserved
        ([2, 7], 1),  # past N (the sentinel slot N + 1)
        ([3, -1], 1),
        ([1, 2 ** 40], 1),  # int64 past the id space
        ([1, 2, 1], 2),  # repeated
        ([5], 0),  # free
        ([1, 4], 1),  # held by owner 9
    ],
)
def test_give_refuses_and_changes_nothing(backend: Backend, ids: list[int], first_bad: int) -> None:
    stack, owners = arrays(6)
    ledger = new_ledger(stack, owners, backend)
    ledger.take(7, np.empty(3, dtype=np.int32))
    ledger.take(9, np.empty(1, dtype=np.int32))
    before = stack.copy(), owners.copy(), ledger.head
    arr = np.array(ids, dtype=np.int64)
    bad = ledger.give(7, arr)
    assert bad >= 0
    if backend == "native":
        assert bad == first_bad  # the C ledger names the position; numpy only says "refused"
    assert ledger.check(7, arr) == bad
    assert (stack.tolist(), owners.tolist(), ledger.head) == (
        before[0].tolist(), before[1].tolist(), before[2])


def test_check_changes_nothing_on_success(backend: Backend) -> None:
    stack, owners = arrays(4)
    ledger = new_ledger(stack, owners, backend)
    ledger.take(2, np.empty(3, dtype=np.int32))
    before = owners.tolist()
    assert ledger.check(2, np.array([3, 1], dtype=np.int32)) == -1
    assert owners.tolist() == before and ledger.head == 3


@NATIVE
@pytest.mark.parametrize(
    "ids",
    [
        np.array([1, 2], dtype=np.uint32),
        np.array([1, 2], dtype=np.int16),
        np.array([1, 2], dtype=">i4"),
        np.array([1, 0, 2, 0], dtype=np.int32)[::2],  # strided
        np.array([[1, 2]], dtype=np.int32),
        np.array([1.0, 2.0]),
        b"\x01\x00\x00\x00",  # bytes: format "B"
    ],
    ids=["uint32", "int16", "big-endian", "strided", "2-D", "float", "bytes"],
)
def test_native_give_refuses_other_layouts_with_typeerror(ids: object) -> None:
    """TypeError is the "convert and retry" signal IdPool relies on; nothing may change."""
    stack, owners = arrays(4)
    ledger = NativeLedger(stack, owners)
    ledger.take(1, np.empty(2, dtype=np.int32))
    before = owners.tolist()
    with pytest.raises(TypeError):
        ledger.give(1, ids)
    with pytest.raises(TypeError):
        ledger.check(1, ids)
    assert owners.tolist() == before and ledger.head == 2


@NATIVE
def test_native_give_reads_read_only_wire_buffers() -> None:
    stack, owners = arrays(4)
    ledger = NativeLedger(stack, owners)
    ledger.take(1, np.empty(2, dtype=np.int32))
    wire = np.frombuffer(np.array([2, 1], dtype="<i4").tobytes(), dtype="<i4")
    assert not wire.flags.writeable
    assert ledger.give(1, wire) == -1 and ledger.head == 0


@NATIVE
@pytest.mark.parametrize(
    ("stack", "owners", "match"),
    [
        (np.arange(1, 5, dtype=np.int64), np.zeros(6, dtype=np.int32), "stack must be"),
        (np.arange(1, 5, dtype=np.int32), np.zeros(5, dtype=np.int32), "owners of N \\+ 2"),
        (np.zeros(0, dtype=np.int32), np.zeros(2, dtype=np.int32), "got N=0"),
    ],
)
def test_native_constructor_checks_its_arrays(
    stack: np.ndarray, owners: np.ndarray, match: str
) -> None:
    with pytest.raises((TypeError, ValueError), match=match):
        NativeLedger(stack, owners)


@NATIVE
def test_native_constructor_refuses_read_only_arrays_and_bad_owners() -> None:
    stack, owners = arrays(4)
    stack.flags.writeable = False
    with pytest.raises((TypeError, ValueError, BufferError)):
        NativeLedger(stack, owners)
    stack, owners = arrays(4)
    ledger = NativeLedger(stack, owners)
    for owner in (0, -1, 2 ** 31):
        with pytest.raises(ValueError, match="owner must be in"):
            ledger.take(owner, np.empty(1, dtype=np.int32))
    with pytest.raises(TypeError, match="out must be"):
        ledger.take(1, np.empty(1, dtype=np.int64))
    assert ledger.head == 0 and owners.tolist() == [-1, 0, 0, 0, 0, -1]


@NATIVE
def test_native_ledger_keeps_its_arrays_alive() -> None:
    stack, owners = arrays(3)
    ledger = NativeLedger(stack, owners)
    view = owners
    del stack, owners
    out = np.empty(3, dtype=np.int32)
    ledger.take(4, out)
    assert out.tolist() == [1, 2, 3] and view.tolist() == [-1, 4, 4, 4, -1]


@NATIVE
def test_both_ledgers_run_the_same_program_identically() -> None:
    """2,000 random takes, gives (good and bad) and checks on a 64-id space: after every step
    the C and numpy ledgers have the same stack, owners, head and verdict."""
    rng = random.Random(1234)
    cap = 64
    pairs = {b: arrays(cap) for b in ("native", "numpy")}
    ledgers = {b: new_ledger(*pairs[b], b) for b in pairs}  # type: ignore[arg-type]
    held: dict[int, list[int]] = {1: [], 2: [], 3: []}
    for step in range(2000):
        owner = rng.randint(1, 3)
        op = rng.random()
        if op < 0.4:
            k = rng.randint(0, 8)
            if ledgers["native"].head + k > cap:
                continue
            outs = {b: np.empty(k, dtype=np.int32) for b in ledgers}
            for b, ledger in ledgers.items():
                ledger.take(owner, outs[b])
            assert outs["native"].tolist() == outs["numpy"].tolist(), step
            held[owner] += outs["native"].tolist()
        else:
            mine = held[owner]
            ids = rng.sample(mine, rng.randint(0, min(len(mine), 6)))
            if rng.random() < 0.3:  # spoil it: a repeat, an id of another owner, or garbage
                ids.append(rng.choice([*ids, 0, cap + 1, -5, *range(1, cap + 1)]))
                rng.shuffle(ids)
            arr = np.array(ids, dtype=rng.choice([np.int32, np.int64]))
            verb = "check" if op > 0.9 else "give"
            verdicts = {b: getattr(ledger, verb)(owner, arr) for b, ledger in ledgers.items()}
            assert (verdicts["native"] < 0) == (verdicts["numpy"] < 0), (step, ids)
            if verb == "give" and verdicts["native"] < 0:
                held[owner] = [i for i in mine if i not in set(ids)]
        native, numpy_ = pairs["native"], pairs["numpy"]
        assert ledgers["native"].head == ledgers["numpy"].head, step
        assert native[1].tolist() == numpy_[1].tolist(), step
        head = ledgers["native"].head
        assert native[0][head:].tolist() == numpy_[0][head:].tolist(), step


def test_backend_selection(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(ENV, "numpy")
    assert default_backend() == "numpy" and IdPool(4, "p").backend == "numpy"
    monkeypatch.setenv(ENV, "auto")
    assert default_backend() == ("native" if native_available() else "numpy")
    monkeypatch.setenv(ENV, "fast")
    with pytest.raises(InvalidArgument, match=r"auto, native, numpy .* got 'fast'"):
        default_backend()
    with pytest.raises(InvalidArgument, match="one of auto, native, numpy"):
        IdPool(4, "p", backend="c")  # type: ignore[arg-type]
    if native_available():
        assert check_backend("native") == "native"
    else:
        with pytest.raises(InvalidArgument, match="not built; reinstall with a C compiler"):
            check_backend("native")
