"""A random program run on the C ledger and the numpy ledger side by side, compared every step.

Used in-process by ``test_ledger.py`` (the installed C build) and, as a script, by
``test_ledger_sanitized.py`` (a build with ASan and UBSan, loaded from a path):

    python tests/unit/ledger_program.py --module /tmp/x/_ledger.so --seeds 1 2 3

Each step is a take, a give (good ids, ids spoiled with repeats, other owners' ids and junk
from 0 to 2**63 - 1, int32 or int64, sometimes read-only), a check, or a misuse that must be
refused without changing anything: a held set of another owner or ledger, an id buffer that
aliases the ledger's own arrays. After every step both ledgers must agree on the verdict, the
free stack, the owner array, the slots of held ids and every held set, in order.
"""

from __future__ import annotations

import argparse
import importlib.util
import random
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import numpy as np

JUNK = (0, -1, -2, 2**31 - 1, -(2**31), 2**31, 2**32 + 1, 2**40, -(2**63), 2**63 - 1)


def arrays(cap: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``stack``, ``owners`` and ``slots`` of an all-free space of ``cap`` ids."""
    stack = np.arange(1, cap + 1, dtype=np.int32)
    owners = np.zeros(cap + 2, dtype=np.int32)
    owners[0] = owners[-1] = -1
    return stack, owners, np.full(cap + 2, -1, dtype=np.int32)


def load_native(path: str) -> Any:
    """The ``Ledger`` class of a ``_ledger`` extension built at ``path``."""
    spec = importlib.util.spec_from_file_location("kvpool_probe._ledger", path)
    assert spec is not None and spec.loader is not None, path
    module: ModuleType = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.Ledger


def _refused(call: Any, *args: object) -> bool:
    """Whether ``call(*args)`` raised ValueError (a misuse refused)."""
    try:
        call(*args)
    except ValueError:
        return True
    return False


def run_program(native_ledger: Any, seed: int, steps: int = 3000) -> None:
    """Run one random program on ``native_ledger`` and ``NumpyLedger``; AssertionError at the
    first step where they differ."""
    from kvpoold.alloc.ledger import NumpyLedger

    rng = random.Random(seed)
    cap = rng.choice([1, 2, 5, 64, 300])
    spaces = {"c": arrays(cap), "n": arrays(cap)}
    ledgers = {"c": native_ledger(*spaces["c"]), "n": NumpyLedger(*spaces["n"])}
    strangers = {"c": native_ledger(*arrays(cap)), "n": NumpyLedger(*arrays(cap))}
    sets: dict[str, dict[int, Any]] = {"c": {}, "n": {}}

    def held_set(b: str, owner: int) -> Any:
        if owner not in sets[b]:
            sets[b][owner] = ledgers[b].new_set(owner)
        return sets[b][owner]

    held: dict[int, list[int]] = {1: [], 2: [], 3: []}
    for step in range(steps):
        owner = rng.randint(1, 3)
        op = rng.random()
        where = f"seed {seed} step {step}"
        if op < 0.35:
            k = rng.choice([0, 1, 2, 5, 17, cap])
            got: dict[str, object] = {}
            for b, ledger in ledgers.items():
                out = np.empty(k, dtype=np.int32)
                try:
                    ledger.take(owner, out, held_set(b, owner))
                    got[b] = out.tolist()
                except ValueError:
                    got[b] = "refused"
            assert got["c"] == got["n"], (where, got)
            if isinstance(got["c"], list):
                held[owner] += got["c"]
        elif op < 0.42:
            for b, ledger in ledgers.items():
                one = np.array([1], dtype=np.int32)
                for bad in (held_set(b, owner % 3 + 1), strangers[b].new_set(owner)):
                    assert _refused(ledger.take, owner, one.copy(), bad), (where, b, "take")
                    assert _refused(ledger.give, owner, one, bad), (where, b, "give")
                alias = spaces[b][rng.randrange(3)][:2]
                assert _refused(ledger.check, owner, alias), (where, b, "aliasing ids")
        else:
            mine = held[owner]
            ids = rng.sample(mine, rng.randint(0, min(len(mine), 7)))
            if rng.random() < 0.4:
                ids.append(rng.choice([*ids, *JUNK, cap + 1, *range(1, cap + 1)]))
                rng.shuffle(ids)
            small = all(-(2**31) <= i < 2**31 for i in ids)
            arr = np.array(ids, dtype=rng.choice([np.int32, np.int64]) if small else np.int64)
            if rng.random() < 0.3:
                arr.flags.writeable = False
            if op > 0.9:
                verdict = {b: ledger.check(owner, arr) for b, ledger in ledgers.items()}
            else:
                verdict = {b: ledger.give(owner, arr, held_set(b, owner))
                           for b, ledger in ledgers.items()}
                if verdict["c"] < 0:
                    gone = set(ids)
                    held[owner] = [i for i in mine if i not in gone]
            assert (verdict["c"] < 0) == (verdict["n"] < 0), (where, ids, verdict)
        c, n = spaces["c"], spaces["n"]
        head = ledgers["c"].head
        assert head == ledgers["n"].head, where
        assert c[1].tolist() == n[1].tolist(), where
        assert c[0][head:].tolist() == n[0][head:].tolist(), where
        for o in held:
            sc, sn = held_set("c", o), held_set("n", o)
            assert sc.tobytes() == sn.tobytes() and sc.room == sn.room, (where, o)
            assert sorted(np.frombuffer(sc.tobytes(), dtype=np.int32).tolist()) == sorted(held[o])
        live = [i for o in held for i in held[o]]
        assert c[2][live].tolist() == n[2][live].tolist(), where


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--module", required=True, help="path of a built _ledger extension")
    parser.add_argument("--seeds", type=int, nargs="+", default=[1, 2, 3])
    parser.add_argument("--steps", type=int, default=3000)
    args = parser.parse_args()
    native = load_native(args.module)
    for seed in args.seeds:
        run_program(native, seed, args.steps)
        print(f"seed {seed}: C and numpy agree", flush=True)
    return 0


if __name__ == "__main__":
    sys.path[:0] = [str(Path(__file__).resolve().parents[2] / p) for p in ("client", "service")]
    sys.exit(main())
