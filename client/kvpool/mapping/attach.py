"""Attach as a context manager: Attach, map the region, yield the views; unmap and Detach on exit.

    with client.attach("llama", expected_fingerprint=fp, lease=lease) as region:
        k0 = region["k.0"]                     # zero-copy view, on the pool's device
        region.page("k.0", page_id)[:] = keys  # rows of one KV page

Used by ``KVPoolClient.attach`` and ``AsyncKVPoolClient.attach`` (one :class:`Attachment`: a
``with`` block for the first, ``async with`` for the second). On exit the region is closed
first, then the attachment ended. A Detach that fails never hides the body's own exception: it is
logged and added to that exception as a note; an attachment that is already gone (a forced Drop,
its lease ended, the daemon restarted) is not an error at exit.

An elastic pool (sharing ``shm_sparse``) is attached under a lease only (a ``Lease`` or
``AsyncLease`` of this process: the daemon takes its groups back over that lease's KeepAlive
stream); its region registers with the lease, which maps the groups of the pages it allocates
and unmaps the groups the daemon takes back, until the region closes.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Awaitable, Callable
from types import TracebackType

from kvpool.contract.errors import FailedPrecondition, NotFound, Unavailable
from kvpool.contract.fd_channel import FdAsk
from kvpool.contract.records import AttachInfo
from kvpool.contract.wire import LeaseLike
from kvpool.mapping.elastic_map import NO_LEASE, ElasticRegion
from kvpool.mapping.fd_client import register as register_process
from kvpool.mapping.regions import MappedRegion, map_region

log = logging.getLogger("kvpool.mapping.attach")


# A Lease, AsyncLease or kvpool.contract.wire.LeaseKey (the attachment ends with it), or None.
LeaseArg = LeaseLike | None


def region_of(info: AttachInfo, pool: str = "",
              lease: tuple[int, bytes] | None = None) -> MappedRegion:
    """Map what Attach returned: the handle, carved by the plan's buffers (and of an elastic
    pool, the groups granted now; ``pool`` names it on the region).

    Raises:
        FailedPrecondition, InvalidArgument, NotFound, PermissionDenied: see
            ``kvpool.mapping.regions.map_region``.
    """
    return map_region(info.handle, info.plan.buffers, plan=info.plan,
                      fingerprint=info.fingerprint, attach_id=info.attach_id,
                      groups=info.elastic_groups, pool=pool, lease=lease)


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


class Attachment(contextlib.AbstractContextManager[MappedRegion],
                 contextlib.AbstractAsyncContextManager[MappedRegion]):
    """One ``with`` (sync client) or ``async with`` (asyncio client) block over an attached
    region: Attach and map on entry; on exit unmap, then Detach.

    The two protocols share every step but the two calls, which the sync one makes and the
    asyncio one awaits.
    """

    def __init__(self, attach: Callable[[], AttachInfo | Awaitable[AttachInfo]],
                 detach: Callable[[int], Awaitable[None] | None], *, pool: str = "",
                 lease: LeaseArg = None) -> None:
        self._attach = attach
        self._detach = detach
        self._pool = pool
        self._lease = lease
        self._info: AttachInfo | None = None
        self._region: MappedRegion | None = None

    def _map(self, info: AttachInfo) -> MappedRegion:
        self._info = info
        # An elastic region registers with its lease: it maps what the lease allocates and
        # unmaps what the daemon takes back (a LeaseKey has no stream here to hear that).
        register = getattr(self._lease, "_register_region", None)
        if info.plan.elastic is not None and register is None:
            raise FailedPrecondition(NO_LEASE, field="lease")
        # A Lease / AsyncLease of this process proves itself to the descriptor socket (CUDA).
        lease_id, secret = (getattr(self._lease, "lease_id", None),
                            getattr(self._lease, "secret", None))
        proof = None if lease_id is None or secret is None else (int(lease_id), bytes(secret))
        region = region_of(info, self._pool, proof)
        fd_socket = str(getattr(info.handle, "fd_socket", "") or "")
        if proof is not None and fd_socket and self._pool:
            # the daemon learns (from the kernel) that this process maps the pool under the
            # lease: the fence of the lease's sealed pages waits for this process to end
            try:
                register_process(fd_socket, FdAsk(pool=self._pool, lease_id=proof[0],
                                                  secret=proof[1].hex()))
            except Unavailable as exc:  # mapped all the same; its sealed pages never adopted
                log.warning("kvpool: could not register this process with the daemon's "
                            "descriptor socket (%s): pages its lease seals cannot be adopted "
                            "by a later engine", exc)
            except BaseException:
                region.close()
                raise
        if isinstance(region, ElasticRegion):
            try:
                register(region)  # type: ignore[misc]
            except BaseException:
                region.close()
                raise
        self._region = region
        return region

    def _unmap(self, exc: BaseException | None) -> tuple[int, BaseException | None]:
        """Close the region (if it was mapped): the attachment to end, and the exception the
        block ends with (its own, or the unmap's)."""
        assert self._info is not None
        try:
            if self._region is not None:
                self._region.close()
        except BaseException as err:  # raised after the Detach
            exc = err
        return self._info.attach_id, exc

    @staticmethod
    def _reraise(body: BaseException | None, exc: BaseException | None) -> None:
        if body is not None and body is not exc:
            raise body

    def __enter__(self) -> MappedRegion:
        info = self._attach()
        try:
            return self._map(info)  # type: ignore[arg-type]
        except BaseException as exc:  # not mapped: still attached, so detach
            self.__exit__(type(exc), exc, exc.__traceback__)
            raise

    def __exit__(self, et: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        attach_id, body = self._unmap(exc)
        try:
            self._detach(attach_id)
        except Exception as err:
            _detach_failed(err, attach_id, body)
        self._reraise(body, exc)

    async def __aenter__(self) -> MappedRegion:
        info = await self._attach()  # type: ignore[misc]
        try:
            return self._map(info)
        except BaseException as exc:  # see __enter__
            await self.__aexit__(type(exc), exc, exc.__traceback__)
            raise

    async def __aexit__(self, et: type[BaseException] | None, exc: BaseException | None,
                        tb: TracebackType | None) -> None:
        attach_id, body = self._unmap(exc)
        try:
            await self._detach(attach_id)  # type: ignore[misc]
        except Exception as err:
            _detach_failed(err, attach_id, body)
        self._reraise(body, exc)


def attachment(attach_raw: Callable[[str, str, LeaseArg], AttachInfo | Awaitable[AttachInfo]],
               detach: Callable[[int], Awaitable[None] | None], pool: str,
               expected_fingerprint: str | None, lease: LeaseArg) -> Attachment:
    """The body of ``KVPoolClient.attach`` and ``AsyncKVPoolClient.attach`` (see the first):
    a ``with`` block over the sync client's calls, an ``async with`` over the asyncio one's."""
    return Attachment(lambda: attach_raw(pool, expected_fingerprint or "", lease), detach,
                      pool=pool, lease=lease)


__all__ = ["Attachment", "LeaseArg", "attachment", "region_of"]
