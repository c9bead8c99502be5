"""Run SGLang 0.5.23's own allocator unit tests (their ``test_allocator_cpu.py``, unchanged) on
the paged allocator SGLang's platform resolves: SGLang's own, or kvpool's through the plugin.

    own_allocator_tests.py --tests PATH --allocator {sglang,kvpool}

Run it with the side venv's python (``tests/sglang/setup_venv.sh``);
``tests/integration/sglang/test_sglang_own_allocator_tests.py`` runs it twice and compares.

Their file imports ``PagedTokenToKVPoolAllocator`` from ``sglang.srt.mem_cache.allocator`` and
builds it itself (with ``MagicMock()`` KV pools). SGLang's engine builds its paged allocator as
``current_platform.get_paged_allocator_cls() or PagedTokenToKVPoolAllocator`` (its KV-cache
configurator and its SWA allocator); this script resolves the platform the same way and binds
that class to the name their file imports, before loading the file, so their tests build what
SGLang's engine would:

- ``kvpool``: ``KVPOOL_POOL`` names a pool in the daemon ``KVPOOL_TARGET`` names, so SGLang's
  platform discovery activates kvpool's plugin (its entry point) and the class is kvpool's
  ``PagedAllocator``; each allocator their tests build opens its own lease (from the
  environment, as with any KV pool that is not kvpool's), and those leases stay open until
  this process ends, so the daemon's Stats at the end show them.
- ``sglang``: the plugin stays inactive (``KVPOOL_POOL`` and ``SGLANG_PLATFORM`` unset) and the
  class is SGLang's own.

Everything else in their file (SGLang's token allocator, ``alloc_extend_naive``, the base
class) is SGLang's code in both runs. It writes one JSON object on stdout: the platform, the
class, each case's outcome (``passed``, ``failed``, ``error``, ``skipped``, ``expected
failure``, ``unexpected success``) with the failure's traceback and its first exception, and
for ``kvpool`` the daemon's view of the leases at the end. unittest's own report (and what
their test base class prints) goes to stderr.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import json
import os
import re
import sys
import time
import unittest
from pathlib import Path
from typing import Any

from stub_probes import hide_stubs  # beside this script

# The module name their file is loaded as (it is not importable from a package here).
MODULE = "sglang_own_test_allocator_cpu"
# An exception line of a traceback: its dotted name at the line start, then ": " or the end.
EXCEPTION_LINE = re.compile(r"^[A-Za-z_][\w.]*(: |$)")


def first_exception(trace: str | None) -> str | None:
    """The first exception line of a traceback (``Name: message`` at the line start): the
    cause, where their test base class re-raises every failure as its retry's exception."""
    if not trace:
        return None
    for line in trace.splitlines():
        if EXCEPTION_LINE.match(line):
            return line
    return trace.strip().splitlines()[-1]


class Outcomes(unittest.TextTestResult):
    """unittest's text result that also keeps each case's outcome by its id."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.cases: dict[str, dict[str, Any]] = {}

    def _set(self, test: unittest.TestCase, outcome: str, detail: str | None = None) -> None:
        self.cases[test.id().removeprefix(MODULE + ".")] = {
            "outcome": outcome, "error": first_exception(detail), "detail": detail}

    def addSuccess(self, test: unittest.TestCase) -> None:
        super().addSuccess(test)
        self._set(test, "passed")

    def addFailure(self, test: unittest.TestCase, err: Any) -> None:
        super().addFailure(test, err)
        self._set(test, "failed", self.failures[-1][1])

    def addError(self, test: unittest.TestCase, err: Any) -> None:
        super().addError(test, err)
        self._set(test, "error", self.errors[-1][1])

    def addSkip(self, test: unittest.TestCase, reason: str) -> None:
        super().addSkip(test, reason)
        self._set(test, "skipped", reason)

    def addExpectedFailure(self, test: unittest.TestCase, err: Any) -> None:
        super().addExpectedFailure(test, err)
        self._set(test, "expected failure")

    def addUnexpectedSuccess(self, test: unittest.TestCase) -> None:
        super().addUnexpectedSuccess(test)
        self._set(test, "unexpected success")


def resolve_allocator(which: str) -> dict[str, Any]:
    """Resolve SGLang's platform for ``which`` and bind the paged allocator class it gives to
    the name their file imports. Returns the platform's and the class's names."""
    if which == "sglang":
        for name in ("KVPOOL_POOL", "SGLANG_PLATFORM"):
            os.environ.pop(name, None)
    elif not os.environ.get("KVPOOL_POOL"):
        raise SystemExit("--allocator kvpool needs KVPOOL_POOL (and KVPOOL_TARGET)")
    import sglang.srt.mem_cache.allocator as allocators
    from sglang.srt.platforms import current_platform

    cls = current_platform.get_paged_allocator_cls() or allocators.PagedTokenToKVPoolAllocator
    allocators.PagedTokenToKVPoolAllocator = cls  # type: ignore[misc]
    return {"platform": f"{type(current_platform).__module__}."
                        f"{type(current_platform).__qualname__}",
            "allocator_class": f"{cls.__module__}.{cls.__qualname__}",
            "supports_triton": bool(current_platform.capabilities.supports_triton)}


def load_tests(path: Path) -> unittest.TestSuite:
    """Their file, loaded as a module from ``path`` (unchanged), as unittest's suite."""
    spec = importlib.util.spec_from_file_location(MODULE, path)
    assert spec is not None and spec.loader is not None, path
    module = importlib.util.module_from_spec(spec)
    sys.modules[MODULE] = module
    spec.loader.exec_module(module)
    return unittest.defaultTestLoader.loadTestsFromModule(module)


def daemon_leases(pool: str) -> dict[str, Any]:
    """The daemon's view of this process's SGLang leases on ``pool`` (still open: the
    allocators their tests built are never closed before exit)."""
    from kvpool.clients.client import KVPoolClient
    from kvpool.integrations.pool_binding import lease_name_for

    name = lease_name_for("sglang")
    with KVPoolClient(os.environ["KVPOOL_TARGET"]) as client:
        stats = client.stats(pool)
    ours = [lease for lease in stats.leases if lease.name == name]
    return {"lease_name": name, "leases": len(ours),
            "held_kv": sum(lease.held.get(pool, {}).get("kv", 0) for lease in ours)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tests", type=Path, required=True,
                        help="SGLang's test/registered/unit/mem_cache/test_allocator_cpu.py")
    parser.add_argument("--allocator", choices=("sglang", "kvpool"), required=True)
    args = parser.parse_args()
    hide_stubs()
    t0 = time.monotonic()
    result: dict[str, Any] = {"allocator": args.allocator, "tests": str(args.tests)}
    # Their test base class prints to stdout; stdout carries only this script's JSON.
    with contextlib.redirect_stdout(sys.stderr):
        result.update(resolve_allocator(args.allocator))
        suite = load_tests(args.tests)
        runner = unittest.TextTestRunner(stream=sys.stderr, verbosity=2, resultclass=Outcomes)
        outcome = runner.run(suite)
    assert isinstance(outcome, Outcomes)
    result["cases"] = outcome.cases
    result["ran"] = outcome.testsRun
    if args.allocator == "kvpool":
        result["daemon"] = daemon_leases(os.environ["KVPOOL_POOL"])
    result["seconds"] = round(time.monotonic() - t0, 2)
    json.dump(result, sys.stdout, indent=1)
    sys.stdout.write("\n")


if __name__ == "__main__":
    main()
