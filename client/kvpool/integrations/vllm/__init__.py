"""kvpool's vLLM 0.32 integration: the engine's KV-cache blocks in kvpool daemon memory
(``kvpool[vllm]``).

- ``engine_core_binding``: the engine core's daemon, pool and lease (``KVPOOL_POOL``,
  ``KVPOOL_TARGET``, ...); imports no vLLM.
- ``block_pool``: ``KVPoolFreeBlockQueue``, the free-block queue through which vLLM's own
  ``BlockPool`` takes its free blocks from the lease's page cache (block id == page id of the
  pool's ``kv`` space).
- ``scheduler``: ``KVPoolScheduler``, vLLM's ``Scheduler`` with that queue; selected with
  ``scheduler_cls="kvpool.integrations.vllm.scheduler.KVPoolScheduler"``.

Nothing here imports vLLM or torch at package import; ``block_pool`` and ``scheduler`` do, and
are loaded by vLLM itself (or by whoever imports them).
"""
