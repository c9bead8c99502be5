"""What kvpool's SGLang plugin seals under, and whether it seals and adopts at all: the
environment (``KVPOOL_SEAL``, ``KVPOOL_ADOPT``, ``KVPOOL_ADOPT_RETRY_S``), the layout string
(docs/restart.md, "SGLang") and why an engine does neither (TP/PP, speculative decoding,
HiCache, no radix cache), and SGLang's forward stream (for the CUDA path of ``sealer.py``).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from kvpool.contract.errors import InvalidArgument, KVPoolError

log = logging.getLogger("kvpool.integrations.sglang.sealer")

SEAL_ENV = "KVPOOL_SEAL"
ADOPT_ENV = "KVPOOL_ADOPT"
RETRY_ENV = "KVPOOL_ADOPT_RETRY_S"
DEFAULT_RETRY_S = 5.0
RETRY_GROWTH = 64  # the retry interval grows to at most this many times the base

def _flag(env: Mapping[str, str], name: str) -> bool:
    value = env.get(name, "1").strip().lower()
    if value not in ("1", "true", "0", "false", ""):
        raise InvalidArgument(f"{name}={value!r}: expected 1 or 0", field=name)
    return value in ("1", "true", "")


@dataclass(frozen=True)
class SealSettings:
    """Whether the engine seals and adopts, and how often it adopts again."""

    seal: bool = True
    adopt: bool = True
    retry_s: float = DEFAULT_RETRY_S

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> SealSettings:
        """``KVPOOL_SEAL``, ``KVPOOL_ADOPT`` (1 or 0, default 1), ``KVPOOL_ADOPT_RETRY_S``.

        Raises:
            InvalidArgument: a malformed value (the variable is named).
        """
        env = os.environ if env is None else env
        raw = env.get(RETRY_ENV, "").strip()
        try:
            retry = float(raw) if raw else DEFAULT_RETRY_S
        except ValueError:
            raise InvalidArgument(f"{RETRY_ENV}={raw!r}: expected seconds", field=RETRY_ENV
                                  ) from None
        if retry < 0:
            raise InvalidArgument(f"{RETRY_ENV}={raw!r}: must be >= 0", field=RETRY_ENV)
        return cls(seal=_flag(env, SEAL_ENV), adopt=_flag(env, ADOPT_ENV), retry_s=retry)


def forward_stream_of_caller(depth: int = 8) -> Any:
    """SGLang's forward stream (``Scheduler.forward_stream``), from the scheduler frame that
    called the allocator's hook (``create_prefill_budget``, ``check_decode_capacity`` or
    ``verify_byte_accounting``: within a few frames); None if not found (logged: pages are
    then sealed after an event on the scheduler's stream only)."""
    import sys

    frame = sys._getframe(1)
    for _ in range(depth):
        frame = frame.f_back  # type: ignore[assignment]
        if frame is None:
            break
        owner = frame.f_locals.get("self")
        stream = getattr(owner, "forward_stream", None)
        if stream is not None and hasattr(owner, "tree_cache"):
            return stream
    log.warning("kvpool: SGLang's forward stream was not found from the allocator's hook: "
                "sealed pages wait for the scheduler's stream only")
    return None


def sealing_layout(page_size: int) -> tuple[str, str | None]:
    """The layout string this engine seals and adopts under, and why it must not (None: it
    may): the engine and version, the key hash, the model (path, revision, a digest of its
    config.json), its dtype and quantization, KV dtype, page size, TP and PP ranks. (The pool's
    fingerprint covers the buffers: geometry, KV dtype, page size.)"""
    import hashlib

    import sglang
    from sglang.srt.runtime_context import get_parallel, get_server_args

    from kvpool.integrations.sglang.daemon_pool import model_config_path
    from kvpool.integrations.sglang.page_keys import HASH_NAME

    args = get_server_args()
    parallel = get_parallel()
    tp, pp = int(getattr(parallel, "tp_size", 1)), int(getattr(parallel, "pp_size", 1))
    tp_rank = int(getattr(parallel, "tp_rank", 0))
    pp_rank = int(getattr(parallel, "pp_rank", 0))
    why = None
    if getattr(args, "disable_radix_cache", False):
        why = "SGLang's radix cache is off (--disable-radix-cache): no prefix to keep"
    elif tp * pp > 1:
        why = (f"TP {tp} x PP {pp}: the ranks would have to adopt the same prefixes (not "
               "built)")
    elif getattr(args, "speculative_algorithm", None):
        why = f"speculative decoding ({args.speculative_algorithm}: bigram radix keys)"
    elif getattr(args, "enable_hierarchical_cache", False):
        why = "HiCache (--enable-hierarchical-cache) moves tree pages to and from the host"
    model = str(args.model_path)
    try:
        config = hashlib.sha256(
            model_config_path(model, args.revision).read_bytes()).hexdigest()[:16]
    except (KVPoolError, OSError):
        config = "none"
    if len(model) > 160:
        model = "sha256:" + hashlib.sha256(model.encode()).hexdigest()[:32]
    layout = (f"sglang {sglang.__version__}; keys {HASH_NAME}; model {model}"
              f"@{args.revision or 'default'} config {config}; dtype {args.dtype}; "
              f"quantization {args.quantization}; kv {args.kv_cache_dtype}; page {page_size}; "
              f"tp {tp_rank}/{tp}; pp {pp_rank}/{pp}")
    return layout, why


__all__ = ["ADOPT_ENV", "RETRY_ENV", "SEAL_ENV", "SealSettings", "forward_stream_of_caller",
           "sealing_layout"]
