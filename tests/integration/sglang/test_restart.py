"""SGLang 0.5.23's real engine keeps its prefixes across a restart (issue 40, the engine's part):
sealed radix-cache pages, adopted by the next engine on the same pool, zero-copy.

Each engine runs in the side venv (``tests/sglang/engine_run.py``) against a daemon of this
checkout, on the tiny random Llama (page size 4, greedy, ``ignore_eos``). The prompts share two
prefixes, ``A`` (6 pages) and ``B`` (7 pages). "Cold": the same engine on SGLang's own memory,
serving the restart's prompts first (nothing cached).

- ``test_restart_adopts``: an engine serves prompts of both families, its pages are sealed
  (the daemon's directory says so), then its whole process group is SIGKILLed. An engine of
  another model (same geometry: same pool, another layout) on the same pool adopts nothing
  (its log says why: other layout). Then a new engine with the first one's command and pool:
  its first requests report ``cached_tokens`` for every full page the dead engine had computed
  for their prefixes (>= 99 %: here all), and its tokens equal the cold run's.
- ``test_stopped_engine_is_fenced``: the old engine SIGSTOPped, its lease expired: the new
  engine adopts nothing of its pages (its first request's prefix is computed, not cached); the
  old one SIGKILLed, the new engine's next admission adopts them (``KVPOOL_ADOPT_RETRY_S=0``:
  at every admission while some are unfenced) and its next request's prefix is cached.
- ``test_pressure_takes_sealed_pages_first``: a dead engine's sealed pages fill half the pool,
  a plain lease holds live pages; a new engine (``KVPOOL_ADOPT=0``) needs more than the free
  pages: the daemon gives it sealed pages (evicted, oldest first), the live lease keeps every
  page, and every request completes (none aborted).
- ``test_keys_are_sglangs``: the plugin's page keys are SGLang's own page hashes
  (``get_hash_str``, its HiCache / KV-event hash).
"""

from __future__ import annotations

import contextlib
import json
import os
import select
import signal
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from kvpool.clients.client import KVPoolClient
from kvpool.integrations.sglang.page_keys import chain_keys
from tests.conftest import REPO, DaemonProcess, temp_dir
from tests.integration.sglang.test_engine import (
    ENGINE_START_S,
    HARNESS,
    PAGE_SIZE,
    TTL_S,
    harness,
    kvpool_env,
    lease_of,
    without_kvpool_env,
)
from tests.integration.side_venv import sglang_env, wait_until

pytestmark = pytest.mark.timeout(1500)

MAX_TOTAL_TOKENS = 512
MAX_NEW = 8
A = list(range(10, 34))  # 24 tokens: 6 pages
B = list(range(100, 128))  # 28 tokens: 7 pages
FIRST_BATCHES = [[[*A, 200, 201, 202, 203, 204], [*B, 220, 221, 222]],
                 [[*A, 210, 211, 212], [*B, 230, 231, 232, 233, 234, 235]]]
# After the restart: new suffixes (their prefix pages are the dead engine's), and one old prompt.
RESTART = [[*A, 240, 241, 242, 243], [*B, 250, 251], [*A, 200, 201, 202, 203, 204]]


def full_pages_cached(prompt: list[int], dead_tokens: list[list[int]]) -> int:
    """Tokens of ``prompt`` the dead engine had in full pages (the longest page-aligned prefix
    one of its sequences shares with it), capped as SGLang matches (the last token is always
    computed)."""
    best = 0
    for seq in dead_tokens:
        n = 0
        while n < min(len(seq), len(prompt)) and seq[n] == prompt[n]:
            n += 1
        best = max(best, n)
    return min(best, len(prompt) - 1) // PAGE_SIZE * PAGE_SIZE


def sequences(outputs: list[dict[str, Any]]) -> list[list[int]]:
    """What each finished request put into the radix tree: its prompt and output tokens but
    the last (whose KV was never computed)."""
    return [o["input_ids"] + o["output_ids"][:-1] for o in outputs]


def job(model: Path, work: Path, name: str, batches: list[list[list[int]]],
        **extra: Any) -> str:
    return json.dumps({"model": str(model), "page_size": PAGE_SIZE,
                       "max_total_tokens": MAX_TOTAL_TOKENS, "max_new_tokens": MAX_NEW,
                       "batches": batches, "dump": str(work / f"{name}.dump.json"),
                       "log_level": "info", **extra})


@pytest.fixture(scope="module")
def work() -> Iterator[Path]:
    with temp_dir("kvp-sgl-restart-") as d:
        yield d


def make_model(python: Path, directory: Path, seed: int) -> Path:
    env = {**sglang_env(), "PYTHONPATH": ""}
    out = subprocess.run([str(python), str(HARNESS), "make-model", str(directory), "--seed",
                          str(seed)], env=env, cwd=REPO, capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr[-4000:]
    return directory


@pytest.fixture(scope="module")
def tiny_model(sglang_python: Path, work: Path) -> Path:
    return make_model(sglang_python, work / "tiny-llama", 0)


@pytest.fixture(scope="module")
def cold(sglang_python: Path, tiny_model: Path, work: Path) -> list[dict[str, Any]]:
    """The restart's prompts first, then the others', on SGLang's own memory."""
    env = {**without_kvpool_env(), "SGLANG_PLATFORM": "kvpool"}
    with harness(sglang_python, ["engine"], env, work / "cold.log",
                 job(tiny_model, work, "cold", [RESTART, *FIRST_BATCHES],
                     baseline=True)) as h:
        h.wait_for("started", ENGINE_START_S)
        outputs = h.wait_for("generated", 300)["outputs"]
        h.wait_for("shutdown", 120)
    assert all(o["cached_tokens"] == 0 for o in outputs[:2])
    return outputs


def sealed_held(client: KVPoolClient, pool: str, pages: int) -> Any:
    """Wait until the engine's lease holds ``pages`` sealed pages (its radix tree's)."""
    return wait_until(f"{pages} pages sealed in pool {pool!r}",
                      lambda: client.sealed(pool).held >= pages or None, 60)


def tree_pages(dump_path: str) -> int:
    dump = json.loads(Path(dump_path).read_text())
    return len({loc // PAGE_SIZE for loc in dump["held_locs"]})


def serve_and_kill(python: Path, env: dict[str, str], model: Path, work: Path, name: str,
                   client: KVPoolClient, pool: str, stop_first: bool = False
                   ) -> tuple[list[dict[str, Any]], int, Any]:
    """Serve the first batches, wait for the tree's pages to be sealed, then kill the engine's
    process group (SIGSTOP first when ``stop_first``: then it stays stopped, and the harness
    is returned for the caller to kill). Returns the outputs, the pages sealed and the harness
    (None once killed)."""
    cm = harness(python, ["engine"], env, work / f"{name}.log",
                 job(model, work, name, FIRST_BATCHES, hold=True))
    h = cm.__enter__()
    try:
        h.wait_for("started", ENGINE_START_S)
        outputs = h.wait_for("generated", 300)["outputs"]
        pages = tree_pages(h.wait_for("dumped", 60)["path"])
        h.wait_for("holding", 30)
        sealed_held(client, pool, pages)
        if stop_first:
            os.killpg(h.proc.pid, signal.SIGSTOP)
            return outputs, pages, (cm, h)
        h.kill_group()
    except BaseException:
        cm.__exit__(None, None, None)
        raise
    cm.__exit__(None, None, None)
    return outputs, pages, None


def kvpool_lines(log: Path) -> list[str]:
    """The sealing module's log lines of an engine."""
    lines = [line for line in log.read_text(errors="replace").splitlines()
             if "kvpool pool" in line and ("adopt" in line or "seal" in line)]
    for line in lines:
        print(f"    {line[-300:]}")
    return lines


def lease_gone(client: KVPoolClient, pool: str) -> None:
    """Wait for the pool to have no lease (the killed or stopped engine's expired)."""
    wait_until(f"no lease on pool {pool!r}",
               lambda: not any(pool in x.held for x in client.stats().leases), TTL_S + 30)


def test_keys_are_sglangs(sglang_python: Path) -> None:
    code = ("import json, sys; sys.path.insert(0, 'tests/sglang');"
            "from stub_probes import hide_stubs; hide_stubs();"
            "from sglang.srt.mem_cache.utils import get_hash_str;"
            f"print(json.dumps(get_hash_str(list(range(3, 27)), None, page_size={PAGE_SIZE})))")
    out = subprocess.run([str(sglang_python), "-c", code], env=sglang_env(), cwd=REPO,
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-4000:]
    theirs = json.loads(out.stdout.strip().splitlines()[-1])
    ours = [k.hex() for k in chain_keys(np.arange(3, 27), PAGE_SIZE)]
    assert ours == theirs


def test_restart_adopts(sglang_python: Path, sglang_daemon: DaemonProcess, tiny_model: Path,
                        cold: list[dict[str, Any]], work: Path) -> None:
    pool = "sgl-seal"
    env = kvpool_env(sglang_daemon, pool)
    with KVPoolClient(sglang_daemon.target) as client:
        print("\nfirst engine: serves, seals, is SIGKILLed")
        first, pages, _ = serve_and_kill(sglang_python, env, tiny_model, work, "first", client,
                                         pool)
        assert [o["output_ids"] for o in first] == [o["output_ids"] for o in cold[3:]]
        lease_gone(client, pool)
        kept = client.sealed(pool)
        print(f"  {pages} tree pages sealed; the directory keeps {kept.kept}")
        assert kept.kept == pages and kept.held == 0

        print("another model (same geometry, same pool): adopts nothing")
        other = make_model(sglang_python, work / "other-llama", 1)
        with harness(sglang_python, ["engine"], env, work / "other.log",
                     job(other, work, "other", [RESTART])) as h:
            h.wait_for("started", ENGINE_START_S)
            outputs = h.wait_for("generated", 300)["outputs"]
            h.wait_for("shutdown", 120)
        assert [o["cached_tokens"] for o in outputs[:2]] == [0, 0]
        log = "\n".join(kvpool_lines(work / "other.log"))
        assert "nothing adopted" in log and "of another layout" in log, log
        lease_gone(client, pool)
        assert client.sealed(pool).adopted_total == 0

        print("restarted engine, same command and pool: adopts")
        with harness(sglang_python, ["engine"], env, work / "restarted.log",
                     job(tiny_model, work, "restarted", [RESTART])) as h:
            h.wait_for("started", ENGINE_START_S)
            outputs = h.wait_for("generated", 300)["outputs"]
            h.wait_for("shutdown", 120)
        assert [o["output_ids"] for o in outputs] == [o["output_ids"] for o in cold[:3]]
        want = [full_pages_cached(o["input_ids"], sequences(first)) for o in outputs]
        got = [o["cached_tokens"] for o in outputs]
        print(f"  cached tokens {got}, the dead engine's full pages {want}")
        assert sum(min(g, w) for g, w in zip(got, want, strict=True)) >= 0.99 * sum(want)
        assert all(w > 0 for w in want)
        assert any("adopted" in line for line in kvpool_lines(work / "restarted.log"))
        assert client.sealed(pool).adopted_total >= pages * 0.99

        print("that engine stopped cleanly (its lease closed, then it exited): a third adopts")
        lease_gone(client, pool)
        before = client.sealed(pool).adopted_total
        with harness(sglang_python, ["engine"], env, work / "third.log",
                     job(tiny_model, work, "third", [RESTART])) as h:
            h.wait_for("started", ENGINE_START_S)
            again = h.wait_for("generated", 300)["outputs"]
            h.wait_for("shutdown", 120)
        assert [o["output_ids"] for o in again] == [o["output_ids"] for o in cold[:3]]
        hits = [o["cached_tokens"] for o in again]
        print(f"  cached tokens {hits}")
        assert sum(min(g, w) for g, w in zip(hits, want, strict=True)) >= 0.99 * sum(want)
        assert client.sealed(pool).adopted_total > before


def group_pidfds(pgid: int) -> list[int]:
    """Pidfds of the processes of group ``pgid`` (opened now: a reused pid is never them)."""
    out = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        with contextlib.suppress(OSError, IndexError, ValueError):
            if int(stat.read_text().rsplit(")", 1)[1].split()[2]) == pgid:
                out.append(os.pidfd_open(int(stat.parent.name)))
    return out


def kill_and_wait_exited(pgid: int, timeout_s: float = 60) -> None:
    """SIGKILL group ``pgid`` and wait until each of its processes has exited as the daemon's
    fence sees it: its pidfd reads (every thread gone; a zombie counts as exited)."""
    fds = group_pidfds(pgid)
    assert fds
    try:
        os.killpg(pgid, signal.SIGKILL)
        wait_until(f"process group {pgid} exited",
                   lambda: all(select.select([fd], [], [], 0)[0] for fd in fds), timeout_s)
    finally:
        for fd in fds:
            os.close(fd)


def test_stopped_engine_is_fenced(sglang_python: Path, sglang_daemon: DaemonProcess,
                                  tiny_model: Path, cold: list[dict[str, Any]],
                                  work: Path) -> None:
    pool = "sgl-seal-stop"
    env = kvpool_env(sglang_daemon, pool)
    with KVPoolClient(sglang_daemon.target) as client:
        print("\nold engine: serves, seals, is SIGSTOPped")
        first, pages, stopped = serve_and_kill(sglang_python, env, tiny_model, work, "stopped",
                                               client, pool, stop_first=True)
        cm, old = stopped
        try:
            lease_gone(client, pool)  # expired: the stopped engine renews nothing
            assert client.sealed(pool).kept == pages
            print("new engine while the old one is stopped: adopts nothing of its pages")
            new_env = {**env, "KVPOOL_ADOPT_RETRY_S": "0"}
            # The first batch: an A prompt. The second (after the old engine is gone): B.
            batches = [[RESTART[0]], [RESTART[1]]]
            with harness(sglang_python, ["engine"], new_env, work / "new.log",
                         job(tiny_model, work, "new", batches, pause=True)) as h:
                h.wait_for("started", ENGINE_START_S)
                h.wait_for("paused", 300)
                assert client.sealed(pool).adopted_total == 0
                print("old engine SIGKILLed: the new one adopts at its next admission")
                kill_and_wait_exited(old.proc.pid)
                h.send("")
                outputs = h.wait_for("generated", 300)["outputs"]
                h.wait_for("shutdown", 120)
        finally:
            old.kill_group()
            cm.__exit__(None, None, None)
        lines = "\n".join(kvpool_lines(work / "new.log"))
        assert "unfenced" in lines
        got = [o["cached_tokens"] for o in outputs]
        want = [full_pages_cached(o["input_ids"], sequences(first)) for o in outputs]
        print(f"  cached tokens {got}; the old engine's full pages {want}")
        assert got[0] == 0  # the old engine's A pages were fenced: computed again
        assert got[1] >= 0.99 * want[1] > 0  # its B pages, adopted after its death
        assert [o["output_ids"] for o in outputs] == [o["output_ids"] for o in cold[:2]]
        assert client.sealed(pool).adopted_total > 0


def distinct_prompt(i: int, n: int) -> list[int]:
    """A prompt of ``n`` tokens sharing no page with the others (ids 3..252)."""
    return [3 + (i * 41 + j) % 250 for j in range(n)]


def test_pressure_takes_sealed_pages_first(sglang_python: Path, sglang_daemon: DaemonProcess,
                                           tiny_model: Path, work: Path) -> None:
    pool = "sgl-seal-press"
    env = kvpool_env(sglang_daemon, pool)
    live_pages = 16
    with KVPoolClient(sglang_daemon.target) as client:
        print("\nan engine fills half the pool with sealed pages, and is SIGKILLed")
        # 6 prompts of 36 tokens + 8 outputs: 10 full pages each in the tree
        batches = [[distinct_prompt(i, 36) for i in range(6)]]
        with harness(sglang_python, ["engine"], env, work / "filler.log",
                     job(tiny_model, work, "filler", batches, hold=True)) as h:
            h.wait_for("started", ENGINE_START_S)
            h.wait_for("generated", 300)
            pages = tree_pages(h.wait_for("dumped", 60)["path"])
            h.wait_for("holding", 30)
            sealed_held(client, pool, pages)
            h.kill_group()
        lease_gone(client, pool)
        capacity = client.stats().pool(pool).spaces["kv"].capacity
        with client.lease("live-pages", ttl_s=30) as live:
            live.allocate(pool, "kv", live_pages)
            free = client.stats().pool(pool).spaces["kv"].free
            kept = client.sealed(pool).kept
            # 10 prompts of 32 tokens + 8 outputs: 10 pages each, all kept by the radix tree
            need = 10 * 10
            print(f"  capacity {capacity} pages: sealed {kept}, live {live_pages}, free {free}; "
                  f"the next engine needs {need}")
            assert kept == pages and free < need <= capacity - live_pages
            print("a new engine (KVPOOL_ADOPT=0) needs more than the free pages")
            batches = [[distinct_prompt(i, 32) for i in range(100, 110)]]
            with harness(sglang_python, ["engine"], {**env, "KVPOOL_ADOPT": "0"},
                         work / "pressed.log", job(tiny_model, work, "pressed", batches)) as h:
                h.wait_for("started", ENGINE_START_S)
                outputs = h.wait_for("generated", 300)["outputs"]
                h.wait_for("shutdown", 120)
            stats = client.stats()
            held = lease_of(stats, live.lease_id).held[pool]["kv"]
            directory = client.sealed(pool)
        reasons = [(o["finish_reason"] or {}).get("type") for o in outputs]
        print(f"  finish reasons {sorted(set(reasons))}; the directory evicted "
              f"{directory.evicted_total} sealed pages; the live lease holds {held}")
        assert all(len(o["output_ids"]) == MAX_NEW for o in outputs)
        assert "abort" not in reasons
        assert held == live_pages  # no live page was taken
        assert 0 < directory.evicted_total <= pages
        assert "ran short" not in (work / "pressed.log").read_text()
