"""``examples/sglang_cpu/run.sh`` as docs/sglang.md gives it (the CPU quick start): SGLang 0.5.23's
HTTP server with the kvpool plugin, two requests over HTTP, ``kvpool stats`` and ``leases``,
then the pages back after the server stops; once interrupted with Ctrl-C, then run again to
the end (the full run comes second).

The script is run with ``KVPOOL_SGLANG_VENV`` at the side venv CI already built and
``KVPOOL_VENV`` at this test's own venv, so it builds nothing (about 50 s); ``PYTHONPATH``
names this checkout, so the daemon and the CLI are this checkout's code (the script puts this
checkout's plugin on the SGLang server's path itself). Skips without a finished side venv.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from kvpool.clients.client import KVPoolClient
from tests.conftest import REPO
from tests.integration.side_venv import VENV, interrupted_when, sglang_python_or_skip
from tests.procs import alive, processes_naming

SCRIPT = REPO / "examples" / "sglang_cpu" / "run.sh"
DOC = REPO / "docs" / "sglang.md"


def test_the_doc_gives_the_script_as_the_cpu_quick_start() -> None:
    text = DOC.read_text()
    quick = text.split("## Quick start on CPU", 1)[1].split("\n## ", 1)[0]
    assert "```sh\nexamples/sglang_cpu/run.sh\n```" in quick
    for knob in ("KVPOOL_VENV", "KVPOOL_SGLANG_VENV", "PORT", "KEEP"):
        assert f"`{knob}`" in quick and knob in SCRIPT.read_text()
    gpu = text.split("## Quick start on a GPU", 1)[1].split("\n## ", 1)[0]
    assert 'pip install -e ".[server,sglang]"' in gpu
    assert "kvpoold serve --device cuda:0 --budget 40GiB" in gpu


def script_env() -> dict[str, str]:
    """The script's environment: the side venv CI built, this test's venv, this checkout."""
    sglang_python_or_skip()
    if not (VENV / ".kvpool-sglang-ready").is_file():
        pytest.skip(f"the side venv {VENV} is not finished (no .kvpool-sglang-ready)")
    own_venv = Path(sys.prefix)
    if not (own_venv / "bin" / "kvpoold").exists():
        pytest.skip(f"this test's venv {own_venv} has no kvpoold script")
    env = {k: v for k, v in os.environ.items() if k not in ("KVPOOL_TARGET", "PORT", "KEEP")}
    env.update(KVPOOL_SGLANG_VENV=str(VENV), KVPOOL_VENV=str(own_venv),
               PYTHONPATH=f"{REPO / 'client'}{os.pathsep}{REPO / 'service'}")
    return env


@pytest.mark.timeout(900)
def test_ctrl_c_while_the_server_runs_stops_everything() -> None:
    """SIGINT to the script's process group (Ctrl-C in a terminal) once SGLang's scheduler has
    the pool attached: one line, exit 130, no process, temporary directory or pool left."""
    def attached(text: str) -> str | None:
        served = re.search(r"^== 3/6 kvpoold serve on (\S+)$", text, flags=re.M)
        if not (served and "\n== 4/6 " in text):
            return None
        with KVPoolClient(served[1], timeout_s=5) as client:
            pools = client.stats().pools
        return served[1] if any(p.name == "tiny" and p.attached for p in pools) else None

    rc, text, err, _ = interrupted_when(SCRIPT, script_env(),
                                        "SGLang's scheduler attaches pool tiny", attached, 600.0)
    assert rc == 130, (text + err)[-4000:]
    assert err.endswith("sglang_cpu: interrupted at step 4/6; stopping what it started\n"), err
    work = re.search(r"^== 2/6 a tiny random Llama in (\S+)/model$", text, flags=re.M)
    daemon = re.search(r"^kvpoold is serving \(pid (\d+)\)$", text, flags=re.M)
    assert work and daemon, text[-4000:]
    assert not alive(int(daemon[1])), "kvpoold left running"
    assert not processes_naming(work[1]), processes_naming(work[1])
    assert not Path(work[1]).exists(), f"{work[1]} left behind"


@pytest.mark.timeout(900)
def test_the_cpu_script_serves_two_requests_and_gives_the_pages_back() -> None:
    env = script_env()
    out = subprocess.run([str(SCRIPT)], cwd=REPO, env=env, capture_output=True, text=True,
                         timeout=840)
    text = out.stdout
    assert out.returncode == 0, (out.stdout + out.stderr)[-6000:]
    assert "setup_venv: removing" not in text + out.stderr, "the script rebuilt the side venv"
    steps = [int(n) for n in re.findall(r"^== (\d)/6 ", text, flags=re.M)]
    assert steps == [1, 2, 3, 4, 5, 6]

    outputs = re.findall(r"^prompt (\[[0-9, ]+\]) -> output_ids (\[[0-9, ]+\])$", text,
                         flags=re.M)
    assert [prompt for prompt, _ in outputs] == ["[1, 2, 3, 4, 5]", "[9, 8, 7, 6, 5, 4, 3, 2, 1]"]
    for _, ids in outputs:
        assert len(ids.strip("[]").split(",")) == 8  # max_new_tokens 8, ignore_eos

    serving, stopped = text.split("stopping the SGLang server", 1)
    (pool_line,) = [line for line in serving.splitlines() if line.startswith("pool tiny:")]
    assert "attached 1" in pool_line, pool_line
    assert re.search(r"^\d+ +\S+ .*tiny: ", serving, flags=re.M), "no lease holding pool tiny"
    assert "no open leases" in stopped
    (after,) = [line for line in stopped.splitlines() if line.startswith("pool tiny:")]
    assert "attached 0" in after, after
    assert text.rstrip().endswith("done: SGLang served from kvpool memory on CPU")
