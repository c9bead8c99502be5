"""The daemon's KV events (issue 41): a real ``kvpoold serve --kv-events-config``, real ZMQ, and
a router that decodes with vLLM 0.32's own types (``tests/vllm/kv_events_router.py`` in the vLLM
side venv; these tests skip without it, fail under ``KVPOOL_REQUIRE_VLLM=1``).

What is checked, against the directory's own changes:

- an engine that seals a chain of pages (``Lease.seal``, as tests/e2e/test_sealed.py) shows as
  one ``BlockStored`` with its keys, parent, tokens, block size, medium and rank;
- its death shows nothing (the pages stay stored); corruption found at adoption, eviction
  under pressure, ``kvpool sealed --evict`` each remove exactly their pages' hashes; an
  adoption changes nothing; a Drop clears the pool;
- a router that starts after more than 10,000 events (three pools, one dropped) rebuilds the
  same index as one that listened from the start, from the replay buffer or from a snapshot;
- a subscriber that stops reading does not hold up the daemon, sees a gap, and repairs it;
- ``kvpool events`` prints the stream (text and JSON lines) and Ctrl-C exits 130.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from kvpool.clients.client import KVPoolClient
from tests.conftest import REPO, TINY_OPTIONS, TINY_SPEC, run_daemon, subprocess_env, temp_dir
from tests.e2e.test_daemon import kvpool_cli
from tests.e2e.test_sealed import LAYOUT, start_engine, wait_lease_gone
from tests.integration.vllm_venv import VLLM_DIR, vllm_env, vllm_python_or_skip

pytest.importorskip("zmq")

PAGE = 16
BIG_PAGES = 4096  # a 16 MiB pool of the tiny model


def big_options() -> dict[str, Any]:
    return {**TINY_OPTIONS, "budget_bytes": 16 << 20}


class Router:
    """The vLLM-side router process (JSON lines)."""

    def __init__(self, endpoint: str, replay: str) -> None:
        python = vllm_python_or_skip()
        self.proc = subprocess.Popen(
            [str(python), str(VLLM_DIR / "kv_events_router.py"), endpoint, replay], cwd=REPO,
            env=vllm_env(), stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)

    def ask(self, op: str, **kw: Any) -> Any:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write(json.dumps({"op": op, **kw}) + "\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        assert line, f"the router exited with {self.proc.wait(30)} (its stderr is above)"
        return json.loads(line)

    def state(self, until: int) -> dict[str, Any]:
        """Its index once it has applied batch ``until``."""
        got: dict[str, Any] = self.ask("state", until=until)
        assert got["last"] >= until, got
        return got

    def close(self) -> None:
        if self.proc.poll() is None:
            with contextlib.suppress(Exception):
                self.ask("quit")
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(30)


@contextlib.contextmanager
def router(endpoint: str, replay: str, since: int | None = None,
           rcvhwm: int = 1000) -> Iterator[Router]:
    r = Router(endpoint, replay)
    try:
        assert r.ask("start", since=since, rcvhwm=rcvhwm) == {"started": True}
        yield r
    finally:
        r.close()


@contextlib.contextmanager
def events_daemon(**config: Any) -> Iterator[tuple[Any, KVPoolClient, str, str]]:
    """A daemon publishing KV events on ipc endpoints in its socket directory: ``(daemon,
    client, endpoint, replay_endpoint)``."""
    with temp_dir() as sock_dir, temp_dir("kvp-shm-", "/dev/shm") as shm:
        endpoint, replay = f"ipc://{sock_dir}/ev.pub", f"ipc://{sock_dir}/ev.replay"
        cfg = {"enable_kv_cache_events": True, "endpoint": endpoint, "replay_endpoint": replay,
               **config}
        with run_daemon(sock_dir, "--shm-dir", str(shm), "--kv-events-config", json.dumps(cfg),
                        budget="256MiB") as d, KVPoolClient(d.target) as client:
            daemon = client.stats().daemon
            assert (daemon.kv_events_endpoint, daemon.kv_events_replay_endpoint) == (endpoint,
                                                                                      replay)
            yield d, client, endpoint, replay


def last_seq(client: KVPoolClient) -> int:
    """The last batch's number (none dropped in these tests: each was sent). Numbers start at
    the microseconds since the epoch when the daemon started."""
    d = client.stats().daemon
    assert d.kv_events_dropped == 0
    return d.kv_events_last_seq


def chain(n: int, salt: int = 0) -> tuple[list[bytes], list[bytes], np.ndarray]:
    """``n`` pages of one sequence: keys, parents (zero for the first), tokens."""
    keys, parents, tokens = [], [], []
    parent = bytes(32)
    for i in range(n):
        toks = np.arange(i * PAGE, (i + 1) * PAGE, dtype=np.int32) + salt
        key = hashlib.sha256(parent + toks.tobytes()).digest()
        keys.append(key)
        parents.append(parent)
        tokens.append(toks)
        parent = key
    return keys, parents, np.concatenate(tokens)


def singles(n: int, salt: int) -> tuple[list[bytes], list[bytes], np.ndarray]:
    """``n`` pages each its own sequence (one BlockStored event each)."""
    keys = [hashlib.sha256(f"{salt}:{i}".encode()).digest() for i in range(n)]
    tokens = (np.arange(n * PAGE, dtype=np.int64) % 50_000 + 70_000).astype(np.int32)
    return keys, [bytes(32)] * n, tokens


# -- the stream is the directory ------------------------------------------------------------


def test_each_way_a_sealed_page_leaves_shows_as_exactly_its_removal() -> None:
    with events_daemon() as (d, client, endpoint, replay), router(endpoint, replay) as r:
        client.configure("tiny", spec=TINY_SPEC, **TINY_OPTIONS)
        base = last_seq(client) + 1  # the first batch's number
        assert base > 1_700_000_000 * 10**6  # microseconds since the epoch
        engine, got = start_engine(d.target, 8)
        keys = got["keys"]
        s = r.state(base)
        assert s["sets"] == {"0": sorted(keys)} and s["gaps"] == 0
        (stored,) = r.ask("log")
        assert stored["type"] == "BlockStored" and stored["hashes"] == keys  # chain order
        assert stored["parent"] is None and stored["token_ids"] == list(range(8 * PAGE))
        assert (stored["block_size"], stored["medium"], stored["rank"], stored["lora_id"]) == (
            PAGE, "CPU", 0, None)
        assert client.sealed("tiny").events_rank == 0

        # the engine dies: its pages stay stored (nothing published)
        engine.proc.send_signal(signal.SIGKILL)
        engine.proc.wait(30)
        wait_lease_gone(client, got["lease_id"])
        assert last_seq(client) == base
        page_key = dict(zip(got["pages"], keys, strict=True))

        # a page written after sealing is found at adoption: removed; the rest adopted: nothing
        bad = got["pages"][2]
        with client.lease("stray", ttl_s=30) as lease, \
                client.attach("tiny", lease=lease) as region:
            region.page("v.0", bad)[0, 0, 0] = -1.0
        with client.lease("next", ttl_s=30) as lease:
            a = lease.adopt("tiny", LAYOUT)
            assert a.corrupt == 1 and a.ids.shape[0] == 7
            lease.free("tiny", "kv", a.ids)  # kept by the directory again: nothing
        s = r.state(base + 1)
        assert s["last"] == last_seq(client) == base + 1
        assert s["sets"]["0"] == sorted(set(keys) - {page_key[bad]})
        assert r.ask("log")[1]["hashes"] == [page_key[bad]]

        # pressure: an Allocate 5 pages short takes the 5 oldest kept pages
        with client.lease("big", ttl_s=30) as lease:
            ids = lease.allocate("tiny", "kv", 256 - 2)
            taken = [page_key[u] for u in ids.tolist() if u in page_key and u != bad]
            assert len(taken) == 5
            s = r.state(base + 2)
            assert sorted(r.ask("log")[2]["hashes"]) == sorted(taken)
            assert s["sets"]["0"] == sorted(set(keys) - {page_key[bad], *taken})
        # `kvpool sealed --evict`: the last two
        out = kvpool_cli("sealed", "tiny", "--evict", "--target", d.target)
        assert "evicted 2 pages" in out.stdout, out.stdout + out.stderr
        s = r.state(base + 3)
        assert s["sets"]["0"] == [] and len(r.ask("log")[3]["hashes"]) == 2

        # a Drop: AllBlocksCleared for the pool's rank
        with client.lease("again", ttl_s=30) as lease:
            more = chain(3, salt=1000)
            lease.seal("tiny", LAYOUT, lease.allocate("tiny", "kv", 3), *more)
        assert r.state(base + 4)["sets"]["0"] == sorted(k.hex() for k in more[0])
        client.drop("tiny", force=True)  # the directory holds the 3 pages
        s = r.state(base + 5)
        assert s["sets"]["0"] == [] and r.ask("log")[-1]["type"] == "AllBlocksCleared"
        assert s["last"] == last_seq(client) == base + 5 and s["gaps"] == 0


# -- rebuildable ------------------------------------------------------------------------------


def workload(client: KVPoolClient) -> tuple[dict[str, set[str]], int]:
    """Three pools on one stream: "big" seals 5 rounds of 2,048 single-page sequences (each
    round after the second evicts the oldest round under pressure), "small" a few chains,
    "gone" a chain and is dropped. Returns what each rank must hold, and the events sent."""
    client.configure("big", spec=TINY_SPEC, **big_options())
    client.configure("small", spec=TINY_SPEC, **TINY_OPTIONS)
    client.configure("gone", spec=TINY_SPEC, **TINY_OPTIONS)
    events = 0
    rounds: list[list[bytes]] = []
    with client.lease("engine", ttl_s=60) as lease:
        for i in range(5):
            keys, parents, tokens = singles(BIG_PAGES // 2, salt=i)
            ids = lease.allocate("big", "kv", BIG_PAGES // 2)
            assert lease.seal("big", LAYOUT, ids, keys, parents, tokens) == len(keys)
            lease.free("big", "kv", ids)  # kept: round i-2 is evicted by round i's Allocate
            rounds.append(keys)
            events += len(keys) + (1 if i >= 2 else 0)
        small: set[bytes] = set()
        for j in range(3):
            keys, parents, tokens = chain(4, salt=10_000 * (j + 1))
            lease.seal("small", LAYOUT, lease.allocate("small", "kv", 4), keys, parents, tokens)
            small |= set(keys)
            events += 1
        keys, parents, tokens = chain(2, salt=99)
        lease.seal("gone", LAYOUT, lease.allocate("gone", "kv", 2), keys, parents, tokens)
    client.drop("gone", force=True)
    events += 2
    ranks = {p: client.sealed(p).events_rank for p in ("big", "small")}
    assert ranks == {"big": 0, "small": 1}
    truth = {"0": {k.hex() for k in rounds[3] + rounds[4]}, "1": {k.hex() for k in small},
             "2": set()}
    return truth, events


@pytest.mark.parametrize(("buffer_steps", "since"), [(100_000, "first"), (100_000, "zero"),
                                                     (4, "first")],
                         ids=["history", "snapshot-from-0", "snapshot-buffer-gone"])
def test_a_router_that_starts_after_10k_events_rebuilds_the_same_index(
        buffer_steps: int, since: str) -> None:
    """A late router asks a replay from the stream's first number (the whole history while
    the buffer holds it, else a snapshot) or from 0 (before the stream: a snapshot)."""
    with events_daemon(buffer_steps=buffer_steps) as (_d, client, endpoint, replay), \
            router(endpoint, replay) as early:
        first = last_seq(client) + 1
        truth, events = workload(client)
        assert events > 10_000
        last = last_seq(client)
        seen = early.state(last)
        with router(endpoint, replay, since=first if since == "first" else 0) as late:
            rebuilt = late.state(last)
        for index in (seen, rebuilt):
            assert {r: set(v) for r, v in index["sets"].items()} == truth
        history = since == "first" and buffer_steps > last - first
        assert rebuilt["snapshots"] == (0 if history else 1)
        assert seen["gaps"] == rebuilt["gaps"] == 0
        # the early router saw every event, one by one
        assert len(early.ask("log")) == events


def test_a_subscriber_that_stops_reading_never_slows_the_daemon_and_repairs_its_gap() -> None:
    """It stops reading with a 10-message high-water mark on both sides while the daemon
    publishes ~27 MB: every RPC completes, the daemon drops nothing of its own (the thread
    kept up), the subscriber's messages beyond its pipes are dropped by ZMQ; once it reads
    again, a replay from the daemon's buffer repairs the gap (asked at the gap, or after a
    second without a batch: a loss at the end of a burst shows at no next batch)."""
    with events_daemon(hwm=10) as (_d, client, endpoint, replay), \
            router(endpoint, replay, rcvhwm=10) as r:
        client.configure("big", spec=TINY_SPEC, **big_options())
        first = last_seq(client) + 1
        assert r.ask("pause") == {"paused": True}
        kept: list[bytes] = []
        with client.lease("engine", ttl_s=60) as lease:

            def round_(i: int) -> None:
                nonlocal kept
                keys, parents, tokens = singles(BIG_PAGES // 2, salt=i)
                ids = lease.allocate("big", "kv", BIG_PAGES // 2)
                lease.seal("big", LAYOUT, ids, keys, parents, tokens)
                lease.free("big", "kv", ids)
                kept = (kept + keys)[-BIG_PAGES:]

            for i in range(60):
                round_(i)
            last = last_seq(client)  # asserts nothing was dropped on the daemon's side
            assert last == first + 60 + 58 - 1  # a stored batch a round, a removal from the 3rd on
            assert r.ask("resume") == {"resumed": True}
            round_(60)  # more while it catches up
        s = r.state(last + 2)
        assert s["replayed"] >= 1, s  # at a gap, or on its idle replay
        assert set(s["sets"]["0"]) == {k.hex() for k in kept}


# -- kvpool events ------------------------------------------------------------------------------


def test_kvpool_events_prints_the_stream_and_ctrl_c_exits_130() -> None:
    with events_daemon() as (d, client, _endpoint, _replay):
        client.configure("tiny", spec=TINY_SPEC, **TINY_OPTIONS)
        keys, parents, tokens = chain(3)
        with client.lease("engine", ttl_s=30) as lease:
            ids = lease.allocate("tiny", "kv", 3)
            lease.seal("tiny", LAYOUT + " lora_id=7", ids, keys, parents, tokens)
            lease.free("tiny", "kv", ids)
        client.sealed("tiny", evict=True)
        since = str(last_seq(client) - 1)
        # a late tail: the replay of both batches, as JSON lines
        out = kvpool_cli("events", "--target", d.target, "--since", since, "--count", "2",
                         "--json")
        assert out.returncode == 0, out.stderr
        first, second = (json.loads(x) for x in out.stdout.splitlines())
        assert (first["pool"], first["rank"]) == ("tiny", 0)
        assert second["seq"] == first["seq"] + 1 == last_seq(client)
        (stored,) = first["events"]
        assert stored["type"] == "BlockStored" and stored["lora_id"] == 7
        assert stored["block_hashes"] == [k.hex() for k in keys]
        assert second["events"][0]["type"] == "BlockRemoved"
        text = kvpool_cli("events", "--target", d.target, "--since", since, "--count", "2")
        assert text.returncode == 0, text.stderr
        lines = text.stdout.splitlines()
        assert lines[0].startswith(f"#{first['seq']} ")
        assert "pool tiny (rank 0): stored 3 blocks" in lines[0]
        assert "lora 7" in lines[0] and "removed 3 blocks" in lines[1]
        # from 0 (before the stream): a snapshot of the directory, now empty
        snap = kvpool_cli("events", "--target", d.target, "--since", "0", "--count", "1")
        assert snap.returncode == 0, snap.stderr
        assert snap.stdout.splitlines() == [
            f"#{last_seq(client)} " + snap.stdout.split(" ", 2)[1]
            + " pool tiny (rank 0): all blocks cleared"]

        # following live until Ctrl-C
        proc = subprocess.Popen([sys.executable, "-m", "kvpool.tools.cli", "events",
                                 "--target", d.target], cwd=REPO, env=subprocess_env(),
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                start_new_session=True)
        try:
            assert proc.stdout is not None
            deadline = time.monotonic() + 60  # a ceiling for a hang only
            line = ""
            with client.lease("engine", ttl_s=30) as lease:
                ids = lease.allocate("tiny", "kv", 3)
                lease.seal("tiny", LAYOUT, ids, *chain(3, salt=5))
                while "stored 3 blocks" not in line:  # a subscription takes a moment: reseal
                    assert time.monotonic() < deadline, "kvpool events printed nothing"
                    lease.free("tiny", "kv", ids)
                    client.sealed("tiny", evict=True)
                    ids = lease.allocate("tiny", "kv", 3)
                    lease.seal("tiny", LAYOUT, ids, *chain(3, salt=5))
                    line = _readline_within(proc, 1.0)
            os.killpg(proc.pid, signal.SIGINT)
            _out, err = proc.communicate(timeout=60)
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
        assert proc.returncode == 130, err
        assert "interrupted (Ctrl-C)" in err and "Traceback" not in err


def _readline_within(proc: subprocess.Popen[str], seconds: float) -> str:
    import select

    assert proc.stdout is not None
    ready, _, _ = select.select([proc.stdout], [], [], seconds)
    return proc.stdout.readline() if ready else ""


def test_a_daemon_without_pyzmq_refuses_events_at_start() -> None:
    """kvpoold serve --kv-events-config without pyzmq: exit 1 and one line naming the extra."""
    with temp_dir() as sock_dir:
        code = ("import sys; sys.modules['zmq'] = None; from kvpoold.main import main; "
                "sys.exit(main(sys.argv[1:]))")
        cfg = json.dumps({"enable_kv_cache_events": True})
        out = subprocess.run([sys.executable, "-c", code, "serve", "--listen",
                              f"unix://{sock_dir}/k.sock", "--kv-events-config", cfg],
                             cwd=REPO, env=subprocess_env(), capture_output=True, text=True,
                             timeout=120)
        assert out.returncode == 1, out.stdout + out.stderr
        assert "pyzmq is not installed" in out.stderr and "[server,events]" in out.stderr
        assert not Path(sock_dir, "k.sock").exists()
