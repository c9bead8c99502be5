"""Attach, Detach and the descriptors of an elastic pool's memory: what a client needs to map a
pool, counted as attachments (``kvpoold.server.attachments``)."""

from __future__ import annotations

import logging
from collections.abc import Callable

from kvpool.contract.errors import (
    FailedPrecondition,
    InvalidArgument,
    NotFound,
    ResourceExhausted,
    echo,
)
from kvpool.contract.fd_channel import FdAsk
from kvpool.contract.records import AttachInfo
from kvpoold.access import Caller
from kvpoold.elastic.fd_server import REGISTERED, FdGrant
from kvpoold.elastic.manager import ElasticPools
from kvpoold.pools.pool import Pool
from kvpoold.server.args import LeaseRef
from kvpoold.server.attachments import AttachmentTable
from kvpoold.server.leases import Lease, LeaseTable

log = logging.getLogger("kvpoold.daemon")


def check_id(value: int, field: str) -> int:
    """A lease or attachment id as sent: 0 means the caller did not set it.

    Raises:
        InvalidArgument: 0.
    """
    if value == 0:
        raise InvalidArgument(f"{field} is not set (0); pass the id OpenLease/Attach returned",
                              field=field)
    return value


class AttachService:
    """The daemon's Attach, Detach and descriptor grants.

    Args:
        device: the daemon's device (told to attaching clients).
        pool: the pool lookup (None as caller: the daemon's own lookup).
        prove: the lease proof of a caller.
        leases: the lease table (the descriptor socket proves a lease by its secret alone).
        attachments: the attachment table.
        elastic: the elastic pools (which groups an attaching process maps).
        max_per_identity: attachments one caller identity may hold at once.
    """

    def __init__(self, device: str, pool: Callable[[str, Caller | None], Pool],
                 prove: Callable[[Caller, LeaseRef], Lease], leases: LeaseTable,
                 attachments: AttachmentTable, elastic: ElasticPools,
                 max_per_identity: int) -> None:
        self._device = device
        self._pool = pool
        self._prove = prove
        self._leases = leases
        self.attachments = attachments
        self._elastic = elastic
        self.max_per_identity = max_per_identity

    def attach(self, caller: Caller, pool: str, expected_fingerprint: str = "",
               ref: LeaseRef | None = None) -> AttachInfo:
        """Hand out what a client needs to map a pool, and count it as attached (under the
        lease ``ref`` if given, so it ends with the lease).

        Every call exports a fresh handle (``backing.handle()``): a CUDA IPC export serves
        one importer. The backing stays open while the attachment lasts (Drop refuses it).

        Raises:
            NotFound: unknown pool, or unknown (or unproven) lease when one is given.
            PermissionDenied: the caller's scope does not cover the pool.
            ResourceExhausted: the caller's identity holds its cap of attachments.
            FailedPrecondition: the pool's fingerprint is not ``expected_fingerprint``, or
                the memory cannot be exported (an expandable CUDA segment).
        """
        entry = self._pool(pool, caller)
        if expected_fingerprint and expected_fingerprint != entry.fingerprint:
            raise FailedPrecondition(
                f"pool {pool!r} has layout {entry.fingerprint}, the client expects "
                f"{echo(expected_fingerprint, 40)}; Configure the client with the pool's plan or "
                "attach to the pool that matches",
                field="expected_fingerprint",
            )
        lease_id = 0 if ref is None else self._prove(caller, ref).lease_id
        if entry.plan.elastic is not None and not lease_id:
            raise FailedPrecondition(
                f"pool {pool!r} is elastic: attach to it under a lease (its groups are taken "
                "back over the lease's KeepAlive stream, and a process that does not unmap "
                "them in time loses its lease)", field="lease_id")
        mine = self.attachments.count_identity(caller.identity)
        if mine >= self.max_per_identity:
            raise ResourceExhausted(
                f"identity {caller.identity!r} has {mine} attachments, the cap per identity is "
                f"{self.max_per_identity} (max_attachments_per_identity, "
                "--max-attachments-per-identity); Detach the ones no longer mapped")
        handle = entry.backing.handle()  # last: nothing after it can fail and strand an export
        att = self.attachments.add(pool, lease_id, caller.identity)
        log.info("attached", extra={"fields": {
            "event": "attach", "pool": pool, "attach_id": att.attach_id, "lease_id": lease_id,
            "sharing": handle.sharing, "attached": self.attachments.count_pool(pool),
        }})
        groups = self._elastic.open_groups(pool) if entry.plan.elastic is not None else ()
        return AttachInfo(entry.fingerprint, entry.plan, entry.plan_json, handle,
                          att.attach_id, self._device, groups)

    def fd_grant(self, ask: FdAsk, uid: int, pid: int) -> FdGrant:
        """The descriptors of an elastic pool's memory a client asks for on the side socket
        (``kvpoold.elastic.fd_server``; the socket already checked the peer's uid): the lease
        is proven by its secret and must hold an attachment of the pool; only groups granted
        and not being taken back are handed out (CUDA VMM), or the pool's one file (CPU).
        Process ``pid`` (the kernel's) is recorded as holding the pool under the lease: the
        CPU backing audit blames that lease for what that process writes outside the groups.

        Raises:
            NotFound: no such pool, or the lease is not proven.
            FailedPrecondition: the lease has no attachment of the pool, the pool's memory is
                not handed out as descriptors, or a group asked for is not granted now.
        """
        entry = self._pool(ask.pool, None)
        try:
            secret = bytes.fromhex(ask.secret)
        except ValueError:
            secret = b""
        # The socket's peer is a uid, not a gRPC caller: the lease is proven by its secret, as
        # of the identity that opened it (LeaseTable.prove: the same NotFound for any failure).
        opened = self._leases.find(ask.lease_id)
        self._leases.prove(ask.lease_id, secret, opened.identity if opened else "")
        if ask.lease_id not in self.attachments.leases_of_pool(ask.pool):
            raise FailedPrecondition(
                f"lease {ask.lease_id} has no attachment of pool {ask.pool!r}: Attach under "
                "the lease first", field="pool")
        if ask.register:  # no descriptor: the process maps the pool from its handle
            self.attachments.add_holder(ask.pool, ask.lease_id, pid)
            return FdGrant((), (), 0, REGISTERED, owned=True)
        export = getattr(entry.backing, "export", None)
        if export is None or entry.plan.elastic is None:
            raise FailedPrecondition(
                f"pool {ask.pool!r} is not handed out as descriptors (sharing "
                f"{entry.sharing}): map it from its Attach handle", field="pool")
        granted = set(self._elastic.open_groups(ask.pool))
        missing = [g for g in ask.groups if g not in granted]
        if missing:
            raise FailedPrecondition(
                f"groups {missing} of pool {ask.pool!r} are not granted now (granted: "
                f"{sorted(granted)}); map only the groups Attach or an Allocate gave",
                field="groups")
        grant: FdGrant = export(ask.groups, ask.fixed)
        self.attachments.add_holder(ask.pool, ask.lease_id, pid)
        return grant

    def detach(self, caller: Caller, attach_id: int) -> None:
        """End an attachment of the caller's identity.

        Raises:
            NotFound: unknown, already ended, or another identity's (the same answer).
        """
        att = self.attachments.get(check_id(attach_id, "attach_id"))
        if att is not None and att.identity == caller.identity:
            self.attachments.remove(attach_id)
            if att.lease_id and att.lease_id not in self.attachments.leases_of_pool(att.pool):
                self._elastic.lease_gone(att.lease_id, att.pool)  # it maps nothing of it now
        else:
            raise NotFound(
                f"no attachment {attach_id} (never made, detached, or ended with its lease or "
                "a forced Drop)",
                field="attach_id",
            )
        log.info("detached", extra={"fields": {
            "event": "detach", "pool": att.pool, "attach_id": attach_id,
            "attached": self.attachments.count_pool(att.pool),
        }})
