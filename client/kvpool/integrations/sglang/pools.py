"""SGLang KV pools whose buffers are views of a kvpool daemon pool (SGLang 0.5.23).

SGLang builds these classes (through ``get_kv_pool_cls(kind=...)`` of kvpool's platform) with
the in-tree classes' own arguments. Where the in-tree class would allocate its buffers, the
kvpool class instead (steps 1 to 4 are ``daemon_pool.attach_pool``):

1. makes the scheduler's :class:`PoolBinding` from the environment (``KVPOOL_POOL``, ...);
2. configures the pool in the daemon from the model SGLang serves and the sizes SGLang resolved
   (:func:`plan_request`): the model path's ``config.json``, ``max_total_tokens`` = the pool's
   ``size``, its page size, the KV dtype SGLang passes, TP/PP, context length and
   ``max_running_requests``. An existing pool with the same layout is reused (Configure answers
   ``created=False``); one with another layout is refused by the daemon. With
   ``KVPOOL_ELASTIC=1``, or when the pool already exists as an elastic pool, it is configured
   elastic (:func:`elastic_settings`): the same views over a virtual range of SGLang's token
   count, backed only where the daemon grants groups;
3. checks the plan against what SGLang expects (token count, layers, every buffer's shape and
   dtype) and refuses any difference, naming both values;
4. attaches the pool with the binding's lease (an elastic region needs it: the daemon's unmap
   asks reach it on the lease's KeepAlive stream, and the lease's allocations map their
   groups) and keeps the mapping open for the process
   lifetime (closed by ``binding.close()``, which runs at exit);
5. uses the daemon's views as its buffers (same shapes, dtypes, layer ids and padding page), so
   SGLang's own ``set_kv_buffer``, ``get_key_buffer``, ... read and write daemon memory.

The pool carries its binding as ``kvpool_binding`` (the paged allocator takes its pages from
that lease) and the Configure answer as ``kvpool_configured``.

Supported layouts: the plain per-layer token-major layout (NHD) of unquantized MHA pools, MLA
and DSA latent pools, DSA indexer keys, FP4 MHA pools (``quantized.py``), the full-attention
layers of a hybrid linear pool (the daemon's ``hybrid_linear`` plan: the pool's dense layer
``i`` is the plan's ``i``-th KV layer; the mamba state is ``mamba_state.py``'s), and the two
MHA sides of SGLang's hybrid sliding-window ``SWAKVPool`` (``kvpool.integrations.sglang.swa``).
Refused with an error: other quantized KV methods, post-capture (VMM) backing, HND / vectorized
layouts, and plans of other architectures, whose daemon plans this module does not map.
"""

from __future__ import annotations

from typing import Any

import torch
from sglang.srt.mem_cache.index_key_cache import IndexKeyCache
from sglang.srt.mem_cache.memory_pool import (
    DSATokenToKVPool,
    MHATokenToKVPool,
    MLATokenToKVPool,
)

from kvpool.contract.errors import FailedPrecondition, InvalidArgument
from kvpool.contract.records import ConfigureResult
from kvpool.integrations.sglang import quantized, swa
from kvpool.integrations.sglang.daemon_pool import Attachment, attach_pool
from kvpool.integrations.sglang.scheduler_binding import POOL_ENV, PoolBinding


def _refuse(pool: Any, what: str, knob: str) -> None:
    raise FailedPrecondition(
        f"kvpool's SGLang pool {type(pool).__name__} does not support {what}; {knob}, or unset "
        f"{POOL_ENV} to use SGLang's own pool", field="kv_pool")


class KVPoolMHATokenToKVPool(MHATokenToKVPool):
    """SGLang's MHA pool with ``k.<layer>`` / ``v.<layer>`` from the daemon's pool."""

    kvpool_binding: PoolBinding
    kvpool_configured: ConfigureResult
    kvpool_attachment: Attachment

    def _create_buffers(self) -> None:
        if self.is_quantized_kv_cache and (why := quantized.unsupported(self)) is not None:
            _refuse(self, why, "choose another --kv-cache-dtype")
        if self.post_capture_active:
            _refuse(self, "post-capture KV backing", "turn off post-capture KV sizing")
        if self.kv_cache_layout != "nhd":
            _refuse(self, f"the {self.kv_cache_layout!r} KV layout",
                    "unset SGLANG_USE_HND_KVCACHE / SGLANG_AITER_KV_CACHE_LAYOUT")
        super()._create_buffers()

    def _create_buffers_normal(self) -> None:
        if swa.side_of(self) is not None:  # a side of SGLang's hybrid SWAKVPool
            swa.create_side_buffers(self)
            return
        attachment = attach_pool(self, architecture="mha")
        self.kvpool_attachment = attachment
        k_shape, v_shape = self._kv_buffer_shapes()
        layers = attachment.layers
        self.k_buffer = [attachment.view(f"k.{layer}", k_shape, self.store_dtype, self.device)
                         for layer in layers]
        self.v_buffer = [attachment.view(f"v.{layer}", v_shape, self.store_dtype, self.device)
                         for layer in layers]

    def _create_quantized_buffers(self) -> None:
        # FP4: packed K/V and their scales from the daemon's fp4_e2m1 plan (quantized.py).
        self.kvpool_attachment = attach_pool(self, architecture="mha")
        quantized.create_buffers(self, self.kvpool_attachment)


class _DaemonLatentBuffers:
    """The MLA latent buffers ``kv.<layer>`` from the daemon's pool (MLA and DSA pools)."""

    kvpool_architecture = "mla"
    kvpool_binding: PoolBinding
    kvpool_configured: ConfigureResult
    kvpool_attachment: Attachment

    def _create_buffers(self) -> None:
        pool: Any = self
        attachment = attach_pool(pool, architecture=self.kvpool_architecture)
        self.kvpool_attachment = attachment
        shape = (pool.size + pool.page_size, 1, pool.kv_cache_dim)
        pool.kv_buffer = [attachment.view(f"kv.{layer}", shape, pool.store_dtype, pool.device)
                          for layer in attachment.layers]


class KVPoolMLATokenToKVPool(_DaemonLatentBuffers, MLATokenToKVPool):
    """SGLang's MLA pool with ``kv.<layer>`` from the daemon's pool."""


class DaemonIndexKeyCache(IndexKeyCache):
    """SGLang's DSA indexer-key cache over the daemon's ``index_k.<layer>`` buffers.

    Layers SGLang skips (they reuse an earlier layer's top-k) keep SGLang's 0-row placeholder.
    """

    def __init__(self, pool: KVPoolDSATokenToKVPool, index_buf_size: int) -> None:
        # IndexKeyCache's own __init__ allocates the buffers; this one maps them instead.
        self.pool = pool
        num_pages = (index_buf_size + pool.page_size + 1) // pool.page_size
        dtype = pool.index_k_with_scale_buffer_dtype
        buffers = []
        for i in range(pool.layer_num):
            shape = self._buffer_shape(self._layer_num_pages(i, num_pages))
            if shape[0] == 0:
                buffers.append(torch.zeros(shape, dtype=dtype, device=pool.device))
            else:
                buffers.append(pool.kvpool_attachment.view(
                    f"index_k.{pool.start_layer + i}", shape, dtype, pool.device))
        self.buffer = buffers


class KVPoolDSATokenToKVPool(_DaemonLatentBuffers, DSATokenToKVPool):
    """SGLang's DSA pool with ``kv.<layer>`` and ``index_k.<layer>`` from the daemon's pool.

    The k-pool compression tails (per running request, ``index_kpool > 1`` models) stay in
    SGLang's own memory: the daemon's plan has no buffer for them.
    """

    kvpool_architecture = "dsa"

    def _create_index_key_cache(self) -> IndexKeyCache:
        return DaemonIndexKeyCache(self, self.index_buf_size)


POOL_CLASSES: dict[str, type] = {
    "mha": KVPoolMHATokenToKVPool,
    "mla": KVPoolMLATokenToKVPool,
    "dsa": KVPoolDSATokenToKVPool,
}


def pool_class(kind: str) -> type:
    """kvpool's pool class for SGLang's pool kind.

    Raises:
        InvalidArgument: an unknown kind (lists the known ones).
    """
    try:
        return POOL_CLASSES[kind]
    except KeyError:
        raise InvalidArgument(f"SGLang asked for a {kind!r} KV pool; kvpool provides "
                              f"{', '.join(POOL_CLASSES)}", field="kind") from None


__all__ = [
    "POOL_CLASSES", "DaemonIndexKeyCache", "KVPoolDSATokenToKVPool", "KVPoolMHATokenToKVPool",
    "KVPoolMLATokenToKVPool", "pool_class",
]
