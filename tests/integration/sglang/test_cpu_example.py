"""``examples/sglang_cpu/run.sh`` as docs/sglang.md gives it (the CPU quick start): SGLang 0.5.23's
HTTP server with the kvpool plugin, two requests over HTTP, ``kvpool stats`` and ``leases``,
then the pages back after the server stops.

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

from tests.conftest import REPO
from tests.integration.side_venv import VENV, sglang_python_or_skip

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


@pytest.mark.timeout(900)
def test_the_cpu_script_serves_two_requests_and_gives_the_pages_back() -> None:
    sglang_python_or_skip()
    if not (VENV / ".kvpool-sglang-ready").is_file():
        pytest.skip(f"the side venv {VENV} is not finished (no .kvpool-sglang-ready)")
    own_venv = Path(sys.prefix)
    if not (own_venv / "bin" / "kvpoold").exists():
        pytest.skip(f"this test's venv {own_venv} has no kvpoold script")
    env = {k: v for k, v in os.environ.items() if k not in ("KVPOOL_TARGET", "PORT", "KEEP")}
    env.update(KVPOOL_SGLANG_VENV=str(VENV), KVPOOL_VENV=str(own_venv),
               PYTHONPATH=f"{REPO / 'client'}{os.pathsep}{REPO / 'service'}")
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
