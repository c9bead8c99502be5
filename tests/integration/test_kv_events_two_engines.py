"""Issue 41's acceptance: two engines, SGLang and vLLM, on one daemon; one stream carries both
engines' blocks, told apart.

One ``kvpoold serve --kv-events-config`` (ipc endpoints, topic ``kv@test@{pool}``), one router
on its stream from its start (``tests/vllm/kv_events_router.py``: vLLM's own types decode it).
On it, one after the other, each on its own pool:

- a real SGLang 0.5.23 engine (its side venv, ``tests/sglang/engine_run.py``, the tiny Llama of
  its restart tests, page size 4) serves two batches of prompts sharing two prefixes, its radix
  tree's pages are sealed, and it is SIGKILLed (its pages stay sealed, kept: still stored);
- a real vLLM 0.32 engine (its side venv, ``tests/vllm/restart_run.py``, sha256 block hashes
  published as bytes, vLLM's own publisher on as well) serves its six prompts.

The daemon's stream then holds ``BlockStored`` for both pools, each pool's under its own topic
and ``data_parallel_rank``; the SGLang pool's blocks are SGLang's own page hashes
(``get_hash_str`` chained over each finished request's full pages, computed in its venv), with
their tokens and parents; the vLLM pool's are the blocks vLLM's own publisher reported.
"""

from __future__ import annotations

import json
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from kvpool.clients.client import KVPoolClient
from tests.conftest import REPO, run_daemon, temp_dir
from tests.e2e.test_kv_events import router
from tests.integration.sglang.conftest import sweep_shm_leftovers  # noqa: F401
from tests.integration.sglang.test_engine import PAGE_SIZE, kvpool_env
from tests.integration.sglang.test_restart import (
    lease_gone,
    sequences,
    serve_and_kill,
)
from tests.integration.sglang.test_restart import make_model as make_sglang_model
from tests.integration.side_venv import sglang_env, sglang_python_or_skip
from tests.integration.vllm.test_kv_events_engine import (
    SEALED,
    Daemon,
    blocks,
    daemon_last,
    engine_with_events,
)
from tests.integration.vllm.test_restart import FIRST, SECOND
from tests.integration.vllm.test_restart import make_model as make_vllm_model
from tests.integration.vllm_venv import vllm_python_or_skip

pytest.importorskip("zmq")
pytestmark = pytest.mark.timeout(1800)

SGL_POOL = "two-sglang"
VLLM_POOL = "two-vllm"
TOPIC = "kv@test@{pool}"


def sglang_page_hashes(python: Path, seqs: list[list[int]]) -> dict[str, tuple[Any, ...]]:
    """SGLang's own page hashes (``get_hash_str``, its HiCache / KV-event hash, run in its
    venv) of each sequence's full pages: hash -> (parent hash or None, tokens, page size), as
    :func:`blocks` gives a router's log."""
    code = ("import json, sys; sys.path.insert(0, 'tests/sglang');"
            "from stub_probes import hide_stubs; hide_stubs();"
            "from sglang.srt.mem_cache.utils import get_hash_str;"
            "seqs = json.loads(sys.stdin.read());"
            f"print(json.dumps([get_hash_str(s, None, page_size={PAGE_SIZE}) for s in seqs]))")
    full = [s[:len(s) // PAGE_SIZE * PAGE_SIZE] for s in seqs]
    out = subprocess.run([str(python), "-c", code], input=json.dumps(full), env=sglang_env(),
                         cwd=REPO, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-4000:]
    chains: list[list[str]] = json.loads(out.stdout.strip().splitlines()[-1])
    want: dict[str, tuple[Any, ...]] = {}
    for seq, chain in zip(full, chains, strict=True):
        assert len(chain) == len(seq) // PAGE_SIZE
        for i, h in enumerate(chain):
            want[h] = (chain[i - 1] if i else None,
                       seq[i * PAGE_SIZE:(i + 1) * PAGE_SIZE], PAGE_SIZE)
    return want


@pytest.fixture(scope="module")
def two() -> Iterator[Daemon]:
    """The daemon publishing KV events and a router on its stream since its start (as
    :class:`Daemon` of the vLLM events test, with the vLLM venv's python and tiny model)."""
    sglang_python_or_skip()
    python = vllm_python_or_skip()
    with temp_dir("kvp-two-") as work, temp_dir("kvp-twod-") as sock_dir:
        model = make_vllm_model(python, work / "vllm-llama", 7)
        cfg = {"enable_kv_cache_events": True, "endpoint": f"ipc://{sock_dir}/ev.pub",
               "replay_endpoint": f"ipc://{sock_dir}/ev.replay", "topic": TOPIC}
        with run_daemon(sock_dir, "--kv-events-config", json.dumps(cfg),
                        budget="512MiB") as d, \
                KVPoolClient(d.target) as client, \
                router(cfg["endpoint"], cfg["replay_endpoint"], since=0) as ours:
            yield Daemon(d, client, ours, python, model, work)


def test_sglang_and_vllm_on_one_stream(two: Daemon) -> None:
    client = two.client
    sgl_python = sglang_python_or_skip()
    sgl_model = make_sglang_model(sgl_python, two.work / "sglang-llama", 0)

    print("\nSGLang: serves, seals its radix tree's pages, is SIGKILLed")
    outputs, pages, _ = serve_and_kill(sgl_python, kvpool_env(two.daemon, SGL_POOL),
                                       sgl_model, two.work, "sglang", client, SGL_POOL)
    lease_gone(client, SGL_POOL)
    assert client.sealed(SGL_POOL).kept == pages
    sgl_want = sglang_page_hashes(sgl_python, sequences(outputs))
    assert len(sgl_want) == pages  # the tree's pages are the requests' full pages

    print("vLLM: serves its prompts (its own publisher on too)")
    steps = [{"generate": FIRST}, {"generate": SECOND}, {"wait": "kill"}]
    with engine_with_events(two, VLLM_POOL, steps, int_hashes=False) as (engine, theirs):
        engine.wait_for("generated", 300)
        engine.wait_for("generated", 300)
        waiting = engine.wait_for("waiting", 60)
        assert waiting["sealer"]["sealed"] == SEALED, waiting["sealer"]
        theirs.state(waiting["kv_events_last"])
        their_log: list[dict[str, Any]] = theirs.ask("log")

        last = daemon_last(client)
        state = two.ours.state(last)
        log: list[dict[str, Any]] = two.ours.ask("log")

    sgl_rank = client.sealed(SGL_POOL).events_rank
    vllm_rank = client.sealed(VLLM_POOL).events_rank
    assert sgl_rank != vllm_rank
    assert state["gaps"] == 0
    by_rank = {r: [e for e in log if e["rank"] == r] for r in (sgl_rank, vllm_rank)}
    assert sum(map(len, by_rank.values())) == len(log)  # nothing of a third rank
    assert {e["topic"] for e in by_rank[sgl_rank]} == {TOPIC.format(pool=SGL_POOL)}
    assert {e["topic"] for e in by_rank[vllm_rank]} == {TOPIC.format(pool=VLLM_POOL)}

    sgl_got = blocks(by_rank[sgl_rank], "BlockStored")
    vllm_got = blocks(by_rank[vllm_rank], "BlockStored")
    vllm_want = blocks(their_log, "BlockStored")
    print(f"  one stream, {len(log)} events: SGLang's pool {len(sgl_got)} blocks (rank "
          f"{sgl_rank}), vLLM's {len(vllm_got)} (rank {vllm_rank}); vLLM's own publisher "
          f"{len(vllm_want)}")
    assert sgl_got == sgl_want  # SGLang's page hashes, parents, tokens, page size
    assert vllm_got == vllm_want and len(vllm_got) == SEALED
    assert not set(sgl_got) & set(vllm_got)
    assert not any(e["type"] != "BlockStored" for e in log)  # nothing removed or cleared
    # the router's index: each pool's blocks under its rank
    assert set(state["sets"][str(sgl_rank)]) == set(sgl_want)
    assert set(state["sets"][str(vllm_rank)]) == set(vllm_want)
