"""The vLLM profile's batch defaults (``BATCH_DEFAULTS``) against vLLM 0.32's own
``EngineArgs.get_batch_defaults``, for each ``--platform`` and ``--entrypoint``.

The side venv is vLLM's CPU build: a GPU platform cannot be run there, so
``tests/vllm/batch_defaults.py`` describes each device to vLLM (memory, name, CPU or not:
the only facts the function reads) and the table must equal what vLLM answers. How the
default then sizes a plan on the CPU platform is in ``test_vllm_parity.py`` (the ``serve``
and ``llm`` cases); on a GPU platform it is computed by hand in
``tests/unit/test_vllm_batch_defaults.py``. Skipped without the side venv.
"""

from __future__ import annotations

import json
import subprocess

from kvpool.contract.vllm_plan import VllmEntrypoint, VllmPlatform, make_vllm_options
from kvpoold.sizing.vllm_profile import batched_tokens
from tests.conftest import REPO
from tests.integration.vllm_venv import VLLM_DIR, vllm_env, vllm_python_or_skip


def test_table_is_what_vllm_answers_per_device() -> None:
    python = vllm_python_or_skip()
    done = subprocess.run([str(python), str(VLLM_DIR / "batch_defaults.py")],
                          capture_output=True, text=True, env=vllm_env(), cwd=REPO,
                          timeout=600, check=False)
    assert done.returncode == 0, done.stderr[-4000:]
    theirs = json.loads(done.stdout)
    assert set(theirs) == {p.value for p in VllmPlatform}
    for platform, rows in theirs.items():
        for row in rows:
            for entrypoint in VllmEntrypoint:
                tokens, seqs = row[entrypoint.value]
                world = row["world_size"]
                options = make_vllm_options(
                    kv_cache_memory_bytes=1 << 30, platform=platform, entrypoint=entrypoint,
                    tp_size=world)
                # a long model: the max_num_seqs cap does not bind
                assert batched_tokens(options, 1 << 20) == tokens, (platform, row)
                # a tiny one: max_num_seqs x max_model_len does
                assert batched_tokens(options, 1) == min(seqs, tokens), (platform, row)
