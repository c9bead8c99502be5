"""Attach as a context manager: Attach, map the region, yield the views; unmap and Detach on exit.

    with client.attach("llama", expected_fingerprint=fp, lease=lease) as region:
        k0 = region["k.0"]                     # zero-copy view, on the pool's device
        region.page("k.0", page_id)[:] = keys  # rows of one KV page

Used by ``KVPoolClient.attach`` and ``AsyncKVPoolClient.attach``. On exit the region is closed
first, then the attachment ended. A Detach that fails never hides the body's own exception: it is
logged and added to that exception as a note; an attachment that is already gone (a forced Drop,
its lease ended, the daemon restarted) is not an error at exit.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator

from kvpool.contract.errors import NotFound
from kvpool.contract.records import AttachInfo
from kvpool.contract.wire import LeaseLike
from kvpool.mapping.regions import MappedRegion, map_region

log = logging.getLogger("kvpool.mapping.attach")


# A Lease, AsyncLease or kvpool.contract.wire.LeaseKey (the attachment ends with it), or None.
LeaseArg = LeaseLike | None


def region_of(info: AttachInfo) -> MappedRegion:
    """Map what Attach returned: the handle, carved by the plan's buffers.

    Raises:
        FailedPrecondition, InvalidArgument, NotFound, PermissionDenied: see
            ``kvpool.mapping.regions.map_region``.
    """
    return map_region(info.handle, info.plan.buffers, plan=info.plan,
                      fingerprint=info.fingerprint, attach_id=info.attach_id)


def _detach_failed(exc: Exception, attach_id: int, body: BaseException | None) -> None:
    """Decide what a failed Detach at exit does: raise it, or only report it.

    After an error in the block any failure (a closed channel too) is only reported: the
    block's exception is the one the caller must see.
    """
    if isinstance(exc, NotFound):
        log.debug("attachment %d already ended: %s", attach_id, exc)
        return
    if body is None:
        raise exc
    log.warning("detach of attachment %d failed after an error in the block: %s",
                attach_id, exc)
    body.add_note(f"kvpool: detach of attachment {attach_id} also failed: {exc}")


@contextlib.contextmanager
def attach_sync(attach_raw: Callable[[str, str, LeaseArg], AttachInfo],
                detach: Callable[[int], None], pool: str, expected_fingerprint: str | None,
                lease: LeaseArg) -> Iterator[MappedRegion]:
    """The body of ``KVPoolClient.attach`` (see there)."""
    info = attach_raw(pool, expected_fingerprint or "", lease)
    body: BaseException | None = None
    try:
        with region_of(info) as region:
            yield region
    except BaseException as exc:
        body = exc
        raise
    finally:
        try:
            detach(info.attach_id)
        except Exception as exc:
            _detach_failed(exc, info.attach_id, body)


@contextlib.asynccontextmanager
async def attach_async(attach_raw: Callable[[str, str, LeaseArg], Awaitable[AttachInfo]],
                       detach: Callable[[int], Awaitable[None]], pool: str,
                       expected_fingerprint: str | None,
                       lease: LeaseArg) -> AsyncIterator[MappedRegion]:
    """The body of ``AsyncKVPoolClient.attach`` (see ``KVPoolClient.attach``)."""
    info = await attach_raw(pool, expected_fingerprint or "", lease)
    body: BaseException | None = None
    try:
        with region_of(info) as region:
            yield region
    except BaseException as exc:
        body = exc
        raise
    finally:
        try:
            await detach(info.attach_id)
        except Exception as exc:
            _detach_failed(exc, info.attach_id, body)


__all__ = ["LeaseArg", "attach_async", "attach_sync", "region_of"]
