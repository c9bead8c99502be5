"""The allocator ledgers (``ledger.py``, ``_ledger.c``): the same loops in C and in numpy.

Each ledger is driven directly over real int32 arrays; a differential test runs one random
program on both and compares every array after every step, and CI fails if the C ledger was
not built (``KVPOOL_REQUIRE_NATIVE=1``).
"""

from __future__ import annotations

import gc
import os

import numpy as np
import pytest

from kvpool.errors import InvalidArgument
from kvpoold.ids.ledger import (
    ENV,
    MIN_ROOM,
    SHRINK_ABOVE,
    Backend,
    HeldSet,
    Ledger,
    NativeLedger,
    check_backend,
    default_backend,
    native_available,
    new_ledger,
)
from kvpoold.ids.space import IdPool
from tests.unit.ledger_program import arrays, run_program

NATIVE = pytest.mark.skipif(not native_available(), reason="kvpoold.ids._ledger is not built")


class Sets:
    """Held sets per owner, made by the ledger as IdPool makes them."""

    def __init__(self, ledger: Ledger) -> None:
        self.ledger = ledger
        self.sets: dict[int, HeldSet] = {}

    def of(self, owner: int) -> HeldSet:
        if owner not in self.sets:
            self.sets[owner] = self.ledger.new_set(owner)
        return self.sets[owner]

    def take(self, owner: int, count: int) -> np.ndarray:
        out = np.empty(count, dtype=np.int32)
        self.ledger.take(owner, out, self.of(owner))
        return out

    def give(self, owner: int, ids: object) -> int:
        return self.ledger.give(owner, ids, self.of(owner))  # type: ignore[arg-type]

    def ids(self, owner: int) -> list[int]:
        """The owner's set, in its order."""
        return np.frombuffer(self.of(owner).tobytes(), dtype=np.int32).tolist()

    def held(self, owner: int) -> list[int]:
        return sorted(self.ids(owner))


@pytest.fixture(params=["native", "numpy"])
def backend(request: pytest.FixtureRequest) -> Backend:
    if request.param == "native" and not native_available():
        pytest.skip("kvpoold.ids._ledger is not built")
    return request.param  # type: ignore[no-any-return]


def test_native_ledger_is_built_where_required() -> None:
    """CI sets KVPOOL_REQUIRE_NATIVE=1: a missing C build must fail the run, not skip tests."""
    if os.environ.get("KVPOOL_REQUIRE_NATIVE") != "1":
        pytest.skip("KVPOOL_REQUIRE_NATIVE is not set")
    assert native_available(), "kvpoold.ids._ledger did not build or does not import"
    assert default_backend() == "native"


def test_take_hands_out_the_stack_in_order_and_records_the_owner(backend: Backend) -> None:
    stack, owners, slots = arrays(6)
    ledger = new_ledger(stack, owners, slots, backend)
    sets = Sets(ledger)
    assert sets.take(3, 4).tolist() == [1, 2, 3, 4] and ledger.head == 4
    assert owners.tolist() == [-1, 3, 3, 3, 3, 0, 0, -1]
    assert sets.ids(3) == [1, 2, 3, 4] and slots[1:5].tolist() == [0, 1, 2, 3]
    assert len(sets.of(3)) == 4 and sets.of(3).owner == 3
    with pytest.raises(ValueError, match="only 2 free"):
        sets.take(3, 3)
    assert ledger.head == 4 and owners.tolist() == [-1, 3, 3, 3, 3, 0, 0, -1]
    assert len(sets.of(3)) == 4


@pytest.mark.parametrize("dtype", [np.int32, np.int64])
def test_give_frees_lifo_and_keeps_the_held_set_exact(backend: Backend, dtype: type) -> None:
    stack, owners, slots = arrays(6)
    ledger = new_ledger(stack, owners, slots, backend)
    sets = Sets(ledger)
    sets.take(5, 4)
    assert sets.give(5, np.array([4, 1], dtype=dtype)) == -1
    assert ledger.head == 2 and sets.ids(5) == [3, 2]  # 3 filled the hole 1 left
    assert owners.tolist() == [-1, 0, 5, 5, 0, 0, 0, -1]
    assert sets.take(6, 2).tolist() == [4, 1]  # freed ids come back first, as given
    assert sets.give(5, np.array([3, 2], dtype=dtype)) == -1
    assert len(sets.of(5)) == 0 and sets.held(6) == [1, 4]


def test_held_sets_grow_and_shrink(backend: Backend) -> None:
    cap = 4 * SHRINK_ABOVE
    ledger = new_ledger(*arrays(cap), backend)
    sets = Sets(ledger)
    assert sets.of(1).room == MIN_ROOM
    small = sets.take(1, 10)
    big = sets.take(1, 2 * SHRINK_ABOVE)
    assert sets.of(1).room >= 2 * SHRINK_ABOVE + 10
    assert sets.give(1, big) == -1
    room = sets.of(1).room
    assert MIN_ROOM <= room < 4 * 10 * 2  # halved while three quarters were unused
    assert sets.held(1) == sorted(small.tolist())
    assert sets.give(1, small) == -1 and len(sets.of(1)) == 0


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
    stack, owners, slots = arrays(6)
    ledger = new_ledger(stack, owners, slots, backend)
    sets = Sets(ledger)
    sets.take(7, 3)
    sets.take(9, 1)
    before = [a.tolist() for a in (stack, owners, slots)], sets.ids(7), ledger.head
    arr = np.array(ids, dtype=np.int64)
    bad = sets.give(7, arr)
    assert bad >= 0
    if backend == "native":
        assert bad == first_bad  # the C ledger names the position; numpy only says "refused"
    assert ledger.check(7, arr) == bad
    assert ([a.tolist() for a in (stack, owners, slots)], sets.ids(7), ledger.head) == before


def test_a_held_set_serves_only_its_owner_and_ledger(backend: Backend) -> None:
    ledger = new_ledger(*arrays(4), backend)
    other = new_ledger(*arrays(4), backend)
    mine = ledger.new_set(1)
    one = np.empty(1, dtype=np.int32)
    with pytest.raises(ValueError, match=r"owner 1 \(of this ledger\) used for owner 2"):
        ledger.take(2, one, mine)
    with pytest.raises(ValueError, match="of another ledger"):
        other.take(1, one, mine)
    with pytest.raises(TypeError, match="held must be a HeldSet"):
        ledger.give(1, one, np.zeros(4, dtype=np.int32))  # type: ignore[arg-type]
    assert ledger.head == 0 and other.head == 0


def test_check_changes_nothing_on_success(backend: Backend) -> None:
    stack, owners, slots = arrays(4)
    ledger = new_ledger(stack, owners, slots, backend)
    Sets(ledger).take(2, 3)
    before = owners.tolist()
    assert ledger.check(2, np.array([3, 1], dtype=np.int32)) == -1
    assert owners.tolist() == before and ledger.head == 3


@NATIVE
def test_room_constants_agree() -> None:
    from kvpoold.ids import _ledger

    assert (_ledger.MIN_ROOM, _ledger.SHRINK_ABOVE) == (MIN_ROOM, SHRINK_ABOVE)


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
        [1, 2],
    ],
    ids=["uint32", "int16", "big-endian", "strided", "2-D", "float", "bytes", "list"],
)
def test_native_give_refuses_other_layouts_with_typeerror(ids: object) -> None:
    """TypeError is the "convert and retry" signal IdPool relies on; nothing may change."""
    stack, owners, slots = arrays(4)
    sets = Sets(NativeLedger(stack, owners, slots))
    sets.take(1, 2)
    before = owners.tolist()
    with pytest.raises(TypeError):
        sets.give(1, ids)
    with pytest.raises(TypeError):
        sets.ledger.check(1, ids)  # type: ignore[arg-type]
    assert owners.tolist() == before and sets.ledger.head == 2


@NATIVE
def test_native_give_reads_read_only_wire_buffers() -> None:
    sets = Sets(NativeLedger(*arrays(4)))
    sets.take(1, 2)
    wire = np.frombuffer(np.array([2, 1], dtype="<i4").tobytes(), dtype="<i4")
    assert not wire.flags.writeable
    assert sets.give(1, wire) == -1 and sets.ledger.head == 0


@NATIVE
@pytest.mark.parametrize(
    ("sizes", "match"),
    [
        ((4, 6, 6, np.int64), "stack must be"),
        ((4, 5, 6, np.int32), "owners of N \\+ 2"),
        ((4, 6, 5, np.int32), "slots of N \\+ 2"),
        ((0, 2, 2, np.int32), "got N=0"),
    ],
)
def test_native_constructor_checks_its_arrays(
    sizes: tuple[int, int, int, type], match: str
) -> None:
    n, n_owners, n_slots, stack_dtype = sizes
    with pytest.raises((TypeError, ValueError), match=match):
        NativeLedger(np.zeros(n, dtype=stack_dtype), np.zeros(n_owners, dtype=np.int32),
                     np.zeros(n_slots, dtype=np.int32))


@NATIVE
def test_native_refuses_read_only_arrays_and_bad_owners() -> None:
    stack, owners, slots = arrays(4)
    stack.flags.writeable = False
    with pytest.raises((TypeError, ValueError, BufferError)):
        NativeLedger(stack, owners, slots)
    stack, owners, slots = arrays(4)
    ledger = NativeLedger(stack, owners, slots)
    one = np.empty(1, dtype=np.int32)
    for owner in (0, -1, 2 ** 31):
        with pytest.raises(ValueError, match="owner must be in"):
            ledger.new_set(owner)
    held = ledger.new_set(1)
    with pytest.raises(TypeError, match="out must be"):
        ledger.take(1, np.empty(1, dtype=np.int64), held)
    with pytest.raises(TypeError, match="cannot create"):
        type(held)()
    ledger.take(1, one, held)
    assert ledger.head == 1 and owners.tolist() == [-1, 1, 0, 0, 0, -1]


@NATIVE
def test_native_set_keeps_its_ledger_and_the_ledger_its_arrays_alive() -> None:
    stack, owners, slots = arrays(3)
    view = owners
    held = NativeLedger(stack, owners, slots).new_set(4)  # the set holds the only reference
    del stack, owners, slots
    gc.collect()
    out = np.empty(3, dtype=np.int32)
    held.ledger.take(4, out, held)
    assert out.tolist() == [1, 2, 3] and view.tolist() == [-1, 4, 4, 4, -1]


@NATIVE
@pytest.mark.parametrize("seed", [1, 2, 3, 4])
def test_both_ledgers_run_the_same_program_identically(seed: int) -> None:
    """Random programs (takes, gives good and spoiled, checks, misuse) on the C and numpy
    ledgers: after every step the verdicts and every array and held set agree
    (``ledger_program.py``; ``test_ledger_sanitized.py`` runs it under ASan and UBSan)."""
    run_program(NativeLedger, seed, steps=2500)


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


# -- misuse: what a Python caller could do wrong must not corrupt memory or state -------------


def snapshot(stack: np.ndarray, owners: np.ndarray, slots: np.ndarray) -> list[list[int]]:
    return [stack.tolist(), owners.tolist(), slots.tolist()]


def test_a_second_set_of_the_same_owner_cannot_free_the_first_sets_ids(backend: Backend) -> None:
    arrs = arrays(8)
    ledger = new_ledger(*arrs, backend)
    first, second = ledger.new_set(1), ledger.new_set(1)
    out = np.empty(4, dtype=np.int32)
    ledger.take(1, out, first)
    before = snapshot(*arrs), ledger.head
    assert ledger.give(1, out, second) == 4  # refused: the ids are not in that set
    assert (snapshot(*arrs), ledger.head) == before and len(second) == 0 and len(first) == 4
    assert ledger.give(1, out, first) == -1 and ledger.head == 0


def test_an_owner_array_written_from_python_is_refused_not_trusted(backend: Backend) -> None:
    stack, owners, slots = arrays(8)
    ledger = new_ledger(stack, owners, slots, backend)
    Sets(ledger).take(1, 3)
    owners[2] = 5  # corruption from outside the ledger
    before = snapshot(stack, owners, slots), ledger.head
    assert ledger.give(5, np.array([2], dtype=np.int32), ledger.new_set(5)) == 1
    assert (snapshot(stack, owners, slots), ledger.head) == before


@pytest.mark.parametrize("which", [0, 1, 2])
def test_buffers_sharing_the_ledgers_memory_are_refused(backend: Backend, which: int) -> None:
    arrs = arrays(8)
    ledger = new_ledger(*arrs, backend)
    sets = Sets(ledger)
    sets.take(1, 2)
    view = arrs[which][1:3]  # an int32 window on stack, owners or slots
    before = snapshot(*arrs), ledger.head
    with pytest.raises(ValueError, match="shares memory with the ledger"):
        ledger.take(1, view, sets.of(1))
    with pytest.raises(ValueError, match="shares memory with the ledger"):
        ledger.give(1, view, sets.of(1))
    with pytest.raises(ValueError, match="shares memory with the ledger"):
        ledger.check(1, view)
    assert (snapshot(*arrs), ledger.head) == before


@pytest.mark.parametrize("bad", [1000, -3, 0, 2])
def test_a_corrupted_free_stack_is_refused_at_take(backend: Backend, bad: int) -> None:
    """An entry out of range, or an id that is already held (2), is never handed out."""
    stack, owners, slots = arrays(8)
    ledger = new_ledger(stack, owners, slots, backend)
    sets = Sets(ledger)
    sets.take(1, 2)
    stack[3] = bad
    before = [stack.tolist(), owners.tolist(), slots[[1, 2]].tolist()], ledger.head
    with pytest.raises(RuntimeError, match=f"entry 3 holds {bad}, not a free id"):
        sets.take(2, 3)
    # Nothing handed out; only the slots of free ids (never read) may have been written.
    assert ([stack.tolist(), owners.tolist(), slots[[1, 2]].tolist()], ledger.head) == before
    assert len(sets.of(2)) == 0


@pytest.mark.parametrize(("spoil", "match"), [
    (lambda s, o, sl: o.__setitem__(0, 0), "sentinel"),
    (lambda s, o, sl: o.__setitem__(3, 7), "must be 0"),
    (lambda s, o, sl: s.__setitem__(2, 1), "each id 1..N once"),
    (lambda s, o, sl: s.__setitem__(2, 9), "each id 1..N once"),
])
def test_ledgers_start_only_from_an_all_free_space(backend: Backend, spoil, match: str) -> None:
    stack, owners, slots = arrays(8)
    spoil(stack, owners, slots)
    with pytest.raises(ValueError, match=match):
        new_ledger(stack, owners, slots, backend)


def test_ledger_arrays_must_not_overlap(backend: Backend) -> None:
    big = np.zeros(30, dtype=np.int32)
    stack = big[:8]
    stack[:] = np.arange(1, 9)
    owners = big[7:17]  # overlaps the stack's last entry
    slots = np.full(10, -1, dtype=np.int32)
    with pytest.raises(ValueError, match="share memory"):
        new_ledger(stack, owners, slots, backend)
