"""kvpool's SGLang 0.5.23 platform plugin: KV pools in kvpool daemon memory (``kvpool[sglang]``).

- ``platform``: the entry point (``sglang.srt.platforms`` group, name ``kvpool``) and the
  platform classes: SGLang's own CUDA platform, or a CPU platform, plus kvpool's pools.
- ``pools``: ``MHATokenToKVPool`` / ``MLATokenToKVPool`` / ``DSATokenToKVPool`` subclasses whose
  buffers are views of the daemon's pool.
- ``scheduler_binding``: the scheduler's daemon, pool and lease (``KVPOOL_POOL``,
  ``KVPOOL_TARGET``, ...).

Nothing here imports SGLang or torch at package import; ``platform`` and ``pools`` do, and are
loaded by SGLang itself.
"""
