"""``KVPoolConnector``: vLLM 0.32's KV cache in kvpool daemon memory, through vLLM's KV
connector API.

Selected with ``kv_transfer_config={"kv_connector": "KVPoolConnector", "kv_role": "kv_both"}``
(registered by the ``vllm.general_plugins`` entry point ``kvpool.integrations.vllm.plugin``)
and ``KVPOOL_POOL`` / ``KVPOOL_TARGET`` (``kvpool.integrations.vllm.engine_core_binding``).

It moves no bytes: nothing is sent or loaded (``kv_both`` with no external cache: no matched
tokens, no loads, no saves, nothing finishing late). What it does is on the worker side:
``get_mem_pool_context()``, which vLLM's ``Worker.initialize_from_config`` runs vLLM's KV-cache
allocation in, returns a :class:`~kvpool.integrations.vllm.memory.PoolAllocation`, under which
vLLM's one int8 KV-cache backing is the attached pool's memory. Before that it

1. plans the pool from vLLM's own config (``memory.vllm_options_of``:
   the model's ``config.json``, ``kv_cache_memory_bytes`` or ``num_gpu_blocks_override``, block
   size, KV dtype, ``max_model_len``, ...) and Configures it (engine ``vllm``): created if
   absent, reused if present with the same layout (or planned with other knobs into the same
   KV cache); any pool that is not vLLM's ``KVCacheConfig`` (``memory.check_kv_cache``) is
   refused naming vLLM's value and the pool's, so the engine stops at startup;
2. attaches the pool under the worker's own lease (``vllm-worker@host:pid``, which ties the
   attachment to this process: a killed worker's attachment ends with its TTL) and keeps the
   mapping for the process lifetime (closed at :meth:`shutdown` and at exit).

Which blocks a request uses is the scheduler's (``KVPoolScheduler`` takes them from the engine
core's lease); the connector needs none of it.

Sealed blocks (``kvpool.integrations.vllm.sealing``): when ``KVPoolScheduler`` seals the
engine's blocks, its connector (the scheduler side) carries the engine core's lease in each
step's metadata (:class:`Writers`) until every worker registered under it; each worker
registers its process on the daemon's descriptor socket under that lease in
``bind_connector_metadata`` (before the step's forward writes a block) and reports it back
(:class:`KVPoolWorkerMetadata`, summed over the workers by vLLM). The daemon then counts the
workers among the processes that must have exited before the blocks are adopted.

HMA: declared (:class:`SupportsHMA`). The connector transfers nothing, so it has nothing to do
per KV-cache group, and the pool is vLLM's whole backing region whatever the groups: the pool is
planned with vLLM's own ``disable_hybrid_kv_cache_manager``, so sliding-window models keep
vLLM's hybrid manager (without the declaration vLLM turns it off for any connector, sizing
sliding layers as full attention).
"""

from __future__ import annotations

import contextlib
import logging
from pathlib import Path
from typing import TYPE_CHECKING, Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorWorkerMetadata,
    SupportsHMA,
)

from kvpool.contract.errors import AlreadyExists, FailedPrecondition
from kvpool.contract.plan import PoolPlan
from kvpool.contract.records import ConfigureResult
from kvpool.integrations.hf_config import hf_config_path
from kvpool.integrations.pool_binding import lease_name_for
from kvpool.integrations.vllm.engine_core_binding import VLLMBinding, binding_from_env
from kvpool.integrations.vllm.memory import (
    PoolAllocation,
    PoolMismatch,
    check_kv_cache,
    vllm_options_of,
)
from kvpool.integrations.vllm.sealing import Writers
from kvpool.mapping.fd_client import register as register_process

if TYPE_CHECKING:
    import torch
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.attention.backend import AttentionMetadata
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

log = logging.getLogger("kvpool.integrations.vllm")


class KVPoolConnectorMetadata(KVConnectorMetadata):
    """What the scheduler side sends the workers each step: no transfers; until every worker
    registered under the engine core's lease, that lease (:class:`Writers`)."""

    def __init__(self, writers: Writers | None = None) -> None:
        self.writers = writers


class KVPoolWorkerMetadata(KVConnectorWorkerMetadata):
    """What workers send back: how many registered under lease ``lease_id`` in this step
    (summed over the workers by vLLM's output aggregator), and how many failed to."""

    def __init__(self, lease_id: int, registered: int = 0, failed: int = 0) -> None:
        self.lease_id = lease_id
        self.registered = registered
        self.failed = failed

    def aggregate(self, other: KVConnectorWorkerMetadata) -> KVConnectorWorkerMetadata:
        if isinstance(other, KVPoolWorkerMetadata) and other.lease_id == self.lease_id:
            return KVPoolWorkerMetadata(self.lease_id, self.registered + other.registered,
                                        self.failed + other.failed)
        return self


def model_config_source(model_config: Any) -> Path | dict[str, Any]:
    """The model's HF ``config.json`` as vLLM loaded it: the file in a local model directory,
    else the one in the local Hugging Face cache, else vLLM's parsed config as a mapping.

    Raises:
        FailedPrecondition: a local directory without config.json.
    """
    path = hf_config_path(str(model_config.model), model_config.revision, field="model",
                          missing_ok=True)
    # a model vLLM found some other way: its own parsed config
    return dict(model_config.hf_config.to_dict()) if path is None else path


def _pp_rank() -> int:
    """This worker's pipeline stage (0 outside a pipeline-parallel group)."""
    try:
        from vllm.distributed.parallel_state import get_pp_group

        return int(get_pp_group().rank_in_group)
    except (AssertionError, ImportError):
        return 0


class KVPoolConnector(KVConnectorBase_V1, SupportsHMA):
    """vLLM's KV connector whose worker side puts vLLM's KV cache in a kvpool pool (see the
    module docstring); a no-op for transfers."""

    # What the sealer asks of a scheduler's connector (``sealing.seal_refusal``): the KV cache
    # is the pool's memory. An attribute, not an isinstance check: the sealer is below the
    # connector and may not import it.
    kvpool_memory = True

    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole,
                 kv_cache_config: KVCacheConfig | None = None) -> None:
        super().__init__(vllm_config, role, kv_cache_config)  # type: ignore[arg-type]
        kv_role = self._kv_transfer_config.kv_role
        if kv_role != "kv_both":
            raise FailedPrecondition(
                f"KVPoolConnector moves no KV between engines, so it has no {kv_role} side: "
                "set kv_transfer_config's kv_role to \"kv_both\"", field="kv_role")
        self._binding: VLLMBinding | None = None
        self.configured: ConfigureResult | None = None
        self.allocation: PoolAllocation | None = None
        # scheduler side: the engine core's lease for the workers (set by kvpool's scheduler
        # when it seals), and how many workers reported their registration
        self.kvpool_writers: Writers | None = None
        self.kvpool_registered = 0
        self._writers_failed = False
        # worker side: the leases this process registered under, and the report to send
        self._registered: set[int] = set()
        self._report: KVPoolWorkerMetadata | None = None

    # -- worker side: the memory --------------------------------------------------------------

    def get_mem_pool_context(self) -> PoolAllocation:
        """Configure (or reuse) and attach the pool, check it is vLLM's KV cache, and return
        the context vLLM allocates its KV cache in (the pool's memory, zero copy).

        Raises:
            PoolMismatch: the pool differs from vLLM's KV cache (both values named).
            FailedPrecondition: ``KVPOOL_POOL`` unset, or vLLM sizing its KV cache by
                profiling (no ``kv_cache_memory_bytes`` / ``num_gpu_blocks_override``).
            KVPoolError: the daemon's refusal (its budget, an unplannable model, ...).
        """
        if self.allocation is not None:
            return self.allocation
        if self._kv_cache_config is None:
            raise FailedPrecondition("vLLM built the KV connector without its KVCacheConfig; "
                                     "kvpool needs vLLM 0.32's connector API")
        binding = binding_from_env()
        binding = VLLMBinding(client=binding.client, pool=binding.pool, ttl_s=binding.ttl_s,
                              lease_name=lease_name_for("vllm-worker"))
        self._binding = binding
        binding.close_at_exit()
        try:
            self.allocation = self._attach(binding)
        except BaseException:
            self._close()
            raise
        return self.allocation

    def _attach(self, binding: VLLMBinding) -> PoolAllocation:
        config = self._vllm_config
        options = vllm_options_of(config, pp_rank=_pp_rank())
        source = model_config_source(config.model_config)
        kv_cache = self._kv_cache_config
        layout = getattr(kv_cache, "kv_cache_layout", None)
        stack = contextlib.ExitStack()
        binding.on_close(stack.close)
        try:
            configured = binding.client.configure(binding.pool, hf_config=source, vllm=options)
        except AlreadyExists as exc:
            return self._attach_existing(binding, stack, exc)
        plan = configured.plan
        if plan.vllm is None:
            raise PoolMismatch(f"kvpool pool {binding.pool!r} is not a vLLM-layout pool "
                               f"({plan.architecture})", field="pool")
        try:
            check_kv_cache(plan.vllm, kv_cache, pool=binding.pool, layout=layout)
        except PoolMismatch:
            if configured.created:  # planned from vLLM's own knobs, yet not vLLM's: unmade
                with contextlib.suppress(Exception):
                    binding.client.drop(binding.pool)
            raise
        region = stack.enter_context(binding.client.attach(
            binding.pool, configured.fingerprint, lease=binding.lease))
        self.configured = configured
        log.info("kvpool pool %r %s for vLLM: %d blocks of %d tokens (%d B each), fingerprint "
                 "%s", binding.pool, "created" if configured.created else "reused",
                 plan.vllm.num_blocks, plan.vllm.block_size, plan.vllm.bytes_per_block,
                 configured.fingerprint)
        backing: torch.Tensor = region[plan.buffers[0].name]
        return PoolAllocation([backing], pool=binding.pool)

    def _attach_existing(self, binding: VLLMBinding, stack: contextlib.ExitStack,
                         refusal: AlreadyExists) -> PoolAllocation:
        """The pool exists planned with other knobs (another fingerprint): use it if its
        memory is vLLM's KV cache all the same (block count, tensors, layout), else say how
        it differs, with both values.

        Raises:
            PoolMismatch: an SGLang-layout pool, or the first difference.
        """
        region = stack.enter_context(binding.client.attach(binding.pool, lease=binding.lease))
        plan: PoolPlan = region.plan
        if plan.vllm is None:
            raise PoolMismatch(
                f"kvpool pool {binding.pool!r} exists with an SGLang layout "
                f"({plan.architecture}), not vLLM's; Drop it or name another (KVPOOL_POOL)",
                field="pool") from refusal
        check_kv_cache(plan.vllm, self._kv_cache_config, pool=binding.pool,
                       layout=getattr(self._kv_cache_config, "kv_cache_layout", None))
        self.configured = ConfigureResult(plan, "", region.fingerprint, created=False,
                                          dry_run=False, budget_available_bytes=0)
        log.info("kvpool pool %r reused for vLLM: planned with other knobs, the same KV "
                 "cache (%d blocks of %d B), fingerprint %s", binding.pool,
                 plan.vllm.num_blocks, plan.vllm.bytes_per_block, region.fingerprint)
        return PoolAllocation([region[plan.buffers[0].name]], pool=binding.pool)

    def _close(self) -> None:
        binding, self._binding = self._binding, None
        if binding is not None:
            binding.close()

    def shutdown(self) -> None:
        """End the worker's attachment and lease (vLLM no longer uses the memory)."""
        self._close()

    # -- worker side: the fence of sealed blocks ----------------------------------------------

    def bind_connector_metadata(self, connector_metadata: KVConnectorMetadata) -> None:
        """vLLM's, and once per lease the scheduler names: register this process under the
        engine core's lease on the daemon's descriptor socket (before this step's forward
        writes any block), and report it back."""
        super().bind_connector_metadata(connector_metadata)
        writers = getattr(connector_metadata, "writers", None)
        if writers is None or writers.lease_id in self._registered:
            return
        self._registered.add(writers.lease_id)
        try:
            register_process(writers.fd_socket, writers.ask())
        except Exception as err:  # the forward goes on; the engine just seals nothing
            log.warning("kvpool: this worker could not register under the engine's lease "
                        "%d on %s (%s): the engine seals no blocks", writers.lease_id,
                        writers.fd_socket or "(no descriptor socket)", err)
            self._report = KVPoolWorkerMetadata(writers.lease_id, failed=1)
            return
        self._report = KVPoolWorkerMetadata(writers.lease_id, registered=1)

    def build_connector_worker_meta(self) -> KVConnectorWorkerMetadata | None:
        """This worker's registration, once."""
        report, self._report = self._report, None
        return report

    # -- worker side: no transfers ------------------------------------------------------------

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        """Nothing to load: the KV cache already is the pool's memory."""

    def wait_for_layer_load(self, layer_name: str) -> None:
        """Nothing is loading."""

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor,
                      attn_metadata: AttentionMetadata, **kwargs: Any) -> None:
        """Nothing to save: vLLM's writes land in the pool's memory directly."""

    def wait_for_save(self) -> None:
        """No save is in flight."""

    # -- scheduler side: no external cache ----------------------------------------------------

    def get_num_new_matched_tokens(self, request: Request,
                                   num_computed_tokens: int) -> tuple[int | None, bool]:
        """No tokens beyond vLLM's own prefix cache: (0, not async)."""
        return 0, False

    def update_state_after_alloc(self, request: Request, blocks: Any,
                                 num_external_tokens: int) -> None:
        """Nothing to track: no external tokens are ever loaded."""

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        """Nothing for the workers to move; until every worker registered under the engine
        core's lease, that lease."""
        writers = self.kvpool_writers
        if writers is not None and (self.kvpool_writers_ready or self._writers_failed):
            writers = None
        return KVPoolConnectorMetadata(writers)

    @property
    def kvpool_writers_ready(self) -> bool:
        """Every worker registered under the engine core's lease (scheduler side)."""
        w = self.kvpool_writers
        return w is not None and bool(w.fd_socket) and self.kvpool_registered >= w.workers

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        """Count the workers' registrations (scheduler side)."""
        super().update_connector_output(connector_output)
        report = connector_output.kv_connector_worker_meta
        w = self.kvpool_writers
        if not isinstance(report, KVPoolWorkerMetadata) or w is None \
                or report.lease_id != w.lease_id:
            return
        self.kvpool_registered += report.registered
        if report.failed and not self._writers_failed:
            self._writers_failed = True
            log.warning("kvpool: %d worker(s) could not register under lease %d: the engine "
                        "seals no blocks", report.failed, w.lease_id)

    def request_finished_all_groups(self, request: Request, block_ids: tuple[list[int], ...]
                                    ) -> tuple[bool, dict[str, Any] | None]:
        """Nothing holds the blocks past the request: vLLM frees them now."""
        return False, None
