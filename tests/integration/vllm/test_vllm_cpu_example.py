"""``examples/vllm_cpu/run.sh`` as docs/vllm.md gives it (the CPU quick start): vLLM 0.32's real
engine with kvpool's connector and scheduler on a pool, its tokens, Stats while it runs, and
nothing left behind; once interrupted with Ctrl-C, then run again to the end.

The script runs with ``KVPOOL_VLLM_VENV`` at the side venv CI already built and ``KVPOOL_VENV``
at this test's own venv, so it builds nothing (about a minute per engine start); ``PYTHONPATH``
names this checkout, so the daemon and the CLI are this checkout's code (the script puts this
checkout's ``client/`` on the engine's path itself). Skips without a finished side venv, fails
instead under ``KVPOOL_REQUIRE_VLLM=1`` (as ``.ci/run`` sets). The Ctrl-C test runs first, so
the full run is also the rerun after an interruption.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from kvpool.clients.client import KVPoolClient
from kvpool.contract.records import Stats
from tests.conftest import REPO
from tests.integration.side_venv import interrupted_when
from tests.integration.vllm_venv import VENV, vllm_python_or_skip
from tests.procs import alive, processes_naming

SCRIPT = REPO / "examples" / "vllm_cpu" / "run.sh"
DOC = REPO / "docs" / "vllm.md"
ENGINE_START_S = 600.0  # a ceiling for a hang: about 45 s on a quiet 2-core machine

pytestmark = pytest.mark.timeout(900)


def script_env() -> dict[str, str]:
    """The script's environment: the side venv CI built, this test's venv, this checkout."""
    vllm_python_or_skip()
    own_venv = Path(sys.prefix)
    if not (own_venv / "bin" / "kvpoold").exists():
        pytest.skip(f"this test's venv {own_venv} has no kvpoold script")
    drop = ("KVPOOL_TARGET", "KVPOOL_POOL", "KEEP")
    env = {k: v for k, v in os.environ.items() if k not in drop}
    env.update(KVPOOL_VLLM_VENV=str(VENV), KVPOOL_VENV=str(own_venv),
               PYTHONPATH=f"{REPO / 'client'}{os.pathsep}{REPO / 'service'}")
    return env


def facts(text: str) -> tuple[Path, str, int]:
    """The temporary directory, the daemon's shared-memory instance and its pid, as printed."""
    work = re.search(r"^== 2/6 a tiny random Llama in (\S+)/model$", text, flags=re.M)
    daemon = re.search(r"^kvpoold is serving \(pid (\d+), shared memory /dev/shm/kvpool-"
                       r"([a-z0-9]+)-\*\)$", text, flags=re.M)
    assert work and daemon, text[-4000:]
    return Path(work[1]), daemon[2], int(daemon[1])


def assert_nothing_left(work: Path, instance: str, pids: list[int]) -> None:
    """No process of the run, no temporary directory (socket, FIFO, model), no shm file."""
    assert not [p for p in pids if alive(p)], f"processes left: {[p for p in pids if alive(p)]}"
    assert not processes_naming(str(work)), processes_naming(str(work))
    assert not work.exists(), f"{work} left behind"
    shm = sorted(Path("/dev/shm").glob(f"kvpool-{instance}[.-]*"))
    assert not shm, f"shared-memory files left: {shm}"


def test_the_doc_gives_the_script_as_the_cpu_quick_start() -> None:
    text = DOC.read_text()
    quick = text.split("## Quick start on CPU", 1)[1].split("\n## ", 1)[0]
    assert "```sh\nexamples/vllm_cpu/run.sh\n```" in quick
    for knob in ("KVPOOL_VENV", "KVPOOL_VLLM_VENV", "KEEP"):
        assert f"`{knob}`" in quick and knob in SCRIPT.read_text()
    readme = (REPO / "README.md").read_text().split("## vLLM", 1)[1]
    assert "`examples/vllm_cpu/run.sh`" in readme
    # The engine's script runs under vLLM's spawn only behind the guard.
    driver = (SCRIPT.parent / "llm_on_kvpool.py").read_text()
    assert '\nif __name__ == "__main__":\n' in driver


def test_ctrl_c_while_the_engine_starts_stops_everything() -> None:
    """SIGINT to the script's process group (what Ctrl-C in a terminal sends) once the engine's
    worker has the pool attached: one line, exit 130, nothing left."""
    def attached(text: str) -> Stats | None:
        """Stats once step 4 (the engine) has begun and its worker has pool tiny attached."""
        served = re.search(r"^== 3/6 kvpoold serve on (\S+)$", text, flags=re.M)
        if not (served and "\n== 4/6 " in text):
            return None
        with KVPoolClient(served[1]) as client:
            stats = client.stats()
        return stats if any(p.name == "tiny" and p.attached for p in stats.pools) else None

    rc, text, err, stats = interrupted_when(SCRIPT, script_env(),
                                            "the engine's worker attaches pool tiny", attached,
                                            ENGINE_START_S)
    pids = [int(lease.name.rsplit(":", 1)[1]) for lease in stats.leases
            if lease.name.startswith(("vllm@", "vllm-worker@"))]
    assert rc == 130, (text + err)[-4000:]
    assert re.fullmatch(r"vllm_cpu: interrupted at step [4-6]/6; stopping what it started\n",
                        err), err
    work, instance, daemon_pid = facts(text)
    assert pids, stats
    assert_nothing_left(work, instance, [daemon_pid, *pids])


def test_the_cpu_script_generates_on_the_pool_and_leaves_nothing() -> None:
    env = script_env()
    out = subprocess.run([str(SCRIPT)], cwd=REPO, env=env, capture_output=True, text=True,
                         timeout=840)
    text = out.stdout
    assert out.returncode == 0, (out.stdout + out.stderr)[-6000:]
    assert "setup_venv: removing" not in text + out.stderr, "the script rebuilt the side venv"
    steps = [int(n) for n in re.findall(r"^== (\d)/6 ", text, flags=re.M)]
    assert steps == [1, 2, 3, 4, 5, 6]

    outputs = re.findall(r"^prompt (\d) \((\d+) tokens, (\d+) from vLLM's prefix cache\) -> "
                         r"output_ids \[([0-9, ]+)\]$", text, flags=re.M)
    assert [(n, size) for n, size, _, _ in outputs] == [("1", "43"), ("2", "44")], text
    assert [cached for _, _, cached, _ in outputs] == ["0", "32"]  # the shared 40-token prefix
    for *_, ids in outputs:
        assert len(ids.split(",")) == 8  # max_tokens 8, ignore_eos

    serving, stopped = text.split("== 6/6 ", 1)
    serving = serving.split("== 5/6 ", 1)[1]
    (pool_line,) = [line for line in serving.splitlines() if line.startswith("pool tiny:")]
    # attached by the worker's lease (mapped) and the engine core's (unmapped: the fence)
    assert pool_line.startswith("pool tiny: vllm float32 page 32") and "attached 2" in pool_line
    used = re.search(r"^  kv +used +(\d+) / 31 ", serving, flags=re.M)
    assert used and int(used[1]) > 0, serving  # the engine core's lease holds blocks
    core = re.search(r"^\d+ +vllm@\S+:(\d+) .* tiny: kv=(\d+)", serving, flags=re.M)
    worker = re.search(r"^\d+ +vllm-worker@\S+:(\d+) +\S+ +1 ", serving, flags=re.M)
    assert core and worker, serving
    assert int(core[2]) == int(used[1])

    assert "no open leases" in stopped
    (after,) = [line for line in stopped.splitlines() if line.startswith("pool tiny:")]
    assert "attached 0" in after, after
    # the one full block the prompts share is sealed: the pool keeps it for the next engine
    assert "tiny: 1 sealed page kept" in stopped, stopped
    assert re.search(r"^  kv +used +1 / 31 ", stopped, flags=re.M), stopped
    assert "left behind: nothing" in stopped
    assert text.rstrip().endswith("done: vLLM generated from kvpool memory on CPU")
    work, instance, daemon_pid = facts(text)
    assert_nothing_left(work, instance, [daemon_pid, int(core[1]), int(worker[1])])
