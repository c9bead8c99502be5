"""Handles for transfers between daemons (disaggregated prefill/decode; docs/pd-transfer.md).

Decode side::

    grant = lease.grant_receive("llama", pages)       # a ReceiveGrant
    send_to_prefill(grant.token, decode_address)      # your own channel between engines
    grant.wait(timeout_s=30)                          # the pages hold the prefill's KV
    grant.cancel()                                    # or give up on it (CancelGrant)

Prefill side::

    handle = client.send("llama", pages, peer=decode_address, token=token, lease=lease)
    handle.wait(timeout_s=30)

    # or: accept ahead (while the KV is computed), then one call on the hot path
    handle = client.send("llama", pages, peer=decode_address, token=token, lease=lease,
                         hold=True)
    ...                                               # compute the KV into the pages
    handle.post(timeout_s=30)                         # post the write, wait for its end

``wait`` returns the :class:`kvpool.contract.records.TransferStatus` once the transfer is done,
raises
``Aborted`` (with the daemon's reason) when it failed, and ``DeadlineExceeded`` when it has not
ended within ``timeout_s``. ``status()`` answers at once without raising. The asyncio forms
(``AsyncReceiveGrant``, ``AsyncSendHandle``) have the same methods as coroutines.
"""

from __future__ import annotations

import time
from collections.abc import Generator
from typing import Any, Protocol, TypeVar

import numpy as np

from kvpool.contract import codec, rpcs
from kvpool.contract.errors import Aborted, DeadlineExceeded
from kvpool.contract.records import CancelledGrant, TransferState, TransferStatus
from kvpool.v1 import kvpool_pb2 as pb


class Caller(Protocol):
    """What a handle needs of the client that made it (``KVPoolClient``): to run a call of
    the RPC table."""

    def run(self, call: rpcs.Call[R], *, timeout_s: float | None = ...) -> R: ...


class AsyncCaller(Protocol):
    """What an asyncio handle needs of its client (``AsyncKVPoolClient``)."""

    async def run(self, call: rpcs.Call[R], *, timeout_s: float | None = ...) -> R: ...


R = TypeVar("R")

# One WaitTransfer call waits at most this long; wait() makes as many as its timeout needs.
WAIT_SLICE_S = 10.0
_CALL_MARGIN_S = 5.0


def _checked(status: TransferStatus, what: str, timeout_s: float | None) -> TransferStatus:
    if status.state == TransferState.done:
        return status
    if status.state == TransferState.failed:
        raise Aborted(f"{what} failed: {status.message}")
    raise DeadlineExceeded(f"{what} has not ended after {timeout_s} s (still pending)")


class _Waitable:
    """What every handle shares: the WaitTransfer request that names it."""

    what = "transfer"

    def _request(self, timeout_s: float) -> rpcs.Call[TransferStatus]:
        raise NotImplementedError


class _Grant(_Waitable):
    """The fields of a receive grant (sync and asyncio handles alike).

    Attributes:
        token: the opaque grant token (bytes): whoever holds it may write the pages once.
        pages: the granted kv page ids (int32).
        swa_pages: for a hybrid SWA pool, the SWA page paired with each (0: none), else None.
        expires_in_s: seconds the grant had left when made.
    """

    what = "the transfer into the granted pages"

    def __init__(self, client: Any, pages: np.ndarray, resp: pb.GrantReceiveResponse,
                 lease: Any = None) -> None:
        self._client = client
        self._lease = lease  # the lease that made it (CancelGrant proves it)
        self.token = resp.token
        self.pages = pages
        self.swa_pages = codec.ids_from_bytes(resp.swa_pages) if resp.swa_pages else None
        self.expires_in_s = resp.expires_in_seconds

    def _request(self, timeout_s: float) -> rpcs.Call[TransferStatus]:
        return rpcs.wait_transfer(token=self.token, timeout_s=timeout_s)


class _Send(_Waitable):
    """The fields of a send (sync and asyncio handles alike).

    Attributes:
        transfer_id: the id on the sending daemon.
        bytes: bytes the write moves. descriptors: NIXL descriptors posted.
        peer_agent: the receiving daemon's NIXL agent.
    """

    def __init__(self, client: Any, resp: pb.SendResponse, lease: Any = None) -> None:
        self._client = client
        self._lease = lease  # the lease that made it (posting a held send proves it)
        self.transfer_id = resp.transfer_id
        self.bytes = resp.bytes
        self.descriptors = resp.descriptors
        self.peer_agent = resp.peer_agent
        self.what = f"transfer {resp.transfer_id} to {resp.peer_agent}"
        # Where a held send can be posted without gRPC (kvpool.pd.post_connections); "": by Send.
        self._post_socket = resp.post_socket
        # How it ended, when the daemon's answer said so (a Send that waited): wait() then
        # makes no call.
        self._ended: TransferStatus | None = None
        self._answered(resp)

    def _answered(self, resp: pb.SendResponse) -> TransferStatus | None:
        if not resp.HasField("status"):  # a daemon that does not say
            return None
        status = codec.transfer_status_from_pb(resp.status)
        if status.ended:
            self._ended = status
        return status

    def _request(self, timeout_s: float) -> rpcs.Call[TransferStatus]:
        return rpcs.wait_transfer(transfer_id=self.transfer_id, timeout_s=timeout_s)

    def _post(self, timeout_s: float) -> rpcs.Call[pb.SendResponse]:
        return rpcs.post_send(self._lease, self.transfer_id, timeout_s)


def send_timeout(default_s: float | None, wait_s: float) -> float | None:
    """The deadline of a Send call that waits ``wait_s`` on the daemon (its peer call, then
    the wait)."""
    return default_s if not wait_s or default_s is None else default_s + wait_s


class _Waits(_Waitable):
    """``status`` and ``wait`` of the sync handles."""

    _client: Caller

    def status(self) -> TransferStatus:
        """Where the transfer stands now (no waiting, no raising)."""
        return _wait_once(self._client, self._request(0.0))

    def wait(self, timeout_s: float | None = 60.0) -> TransferStatus:
        """Wait for the transfer to end (None: as long as it takes); raise if it failed or
        did not end in time."""
        return _checked(_wait(self._client, self, timeout_s), self.what, timeout_s)


class _AsyncWaits(_Waitable):
    """``status`` and ``wait`` of the asyncio handles."""

    _client: AsyncCaller

    async def status(self) -> TransferStatus:
        """Where the transfer stands now (no waiting, no raising)."""
        return await _await_once(self._client, self._request(0.0))

    async def wait(self, timeout_s: float | None = 60.0) -> TransferStatus:
        """As the sync ``wait``."""
        return _checked(await _await(self._client, self, timeout_s), self.what, timeout_s)


class ReceiveGrant(_Grant, _Waits):
    """A receive grant of the decode side: hand ``token`` (and this daemon's address) to the
    prefill side; ``wait`` until its write into the granted pages completed."""

    def cancel(self) -> CancelledGrant:
        """End the grant now (CancelGrant). Its pages are unpinned at once when no sender was
        accepted; else they stay pinned (fenced) until the sender's write has ended.

        Returns:
            The grant as it ended, the pages unpinned, the pages still fenced.

        Raises:
            NotFound: the grant is unknown to the daemon (long ended) or not this lease's.
        """
        return self._client.run(rpcs.cancel_grant(self._lease, self.token))


class SendHandle(_Send, _Waits):
    """A send of the prefill side: ``wait`` until its write ended on this side; ``post`` a
    held one (``send(..., hold=True)``)."""

    def wait(self, timeout_s: float | None = 60.0) -> TransferStatus:
        if self._ended is not None:
            return _checked(self._ended, self.what, timeout_s)
        return super().wait(timeout_s)

    def post(self, timeout_s: float | None = 60.0) -> TransferStatus:
        """Post the held write and wait for its end in the same call (0: answer once
        posted, pending); raise as ``wait`` when it failed or did not end in time.

        Raises:
            FailedPrecondition: not a held send, posted already, or ended (its write
                deadline passed, its lease or pool went). Aborted, DeadlineExceeded: as
                ``wait``.
        """
        wait_s = WAIT_SLICE_S if timeout_s is None else timeout_s
        call = self._post(wait_s)
        call_timeout = send_timeout(getattr(self._client, "timeout_s", None), wait_s)
        channels = getattr(self._client, "post_channels", None)
        resp = None
        if self._post_socket and channels is not None:
            resp = channels.post(self._post_socket, call.request, call_timeout)
        if resp is None:
            resp = self._client.run(call, timeout_s=call_timeout)
        status = self._answered(resp)
        if status is None or not wait_s:
            return status or self.status()
        if not status.ended and timeout_s is None:
            return self.wait(None)
        return _checked(status, self.what, timeout_s)


# Waiting is one sans-IO loop (:func:`_waits`) driven by a sync and an asyncio shell, so the
# two cannot drift: the loop yields each WaitTransfer request and is sent its status.
Waits = Generator[rpcs.Call[TransferStatus], TransferStatus, TransferStatus]


def _waits(handle: _Waitable, timeout_s: float | None) -> Waits:
    """WaitTransfer requests of at most WAIT_SLICE_S each until the transfer ends or
    ``timeout_s`` passes (None: no limit); returns the last status."""
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    while True:
        left = WAIT_SLICE_S if deadline is None else max(0.0, deadline - time.monotonic())
        status = yield handle._request(min(WAIT_SLICE_S, left))
        if status.ended or (deadline is not None and time.monotonic() >= deadline):
            return status


def _wait_once(client: Caller, call: rpcs.Call[TransferStatus]) -> TransferStatus:
    return client.run(call, timeout_s=call.request.timeout_seconds + _CALL_MARGIN_S)


def _wait(client: Caller, handle: _Waitable, timeout_s: float | None) -> TransferStatus:
    steps = _waits(handle, timeout_s)
    req = next(steps)
    while True:
        try:
            req = steps.send(_wait_once(client, req))
        except StopIteration as end:
            return end.value


class AsyncReceiveGrant(_Grant, _AsyncWaits):
    """:class:`ReceiveGrant` for asyncio code."""

    async def cancel(self) -> CancelledGrant:
        """As the sync ``cancel``."""
        return await self._client.run(rpcs.cancel_grant(self._lease, self.token))


class AsyncSendHandle(_Send, _AsyncWaits):
    """:class:`SendHandle` for asyncio code."""

    async def wait(self, timeout_s: float | None = 60.0) -> TransferStatus:
        if self._ended is not None:
            return _checked(self._ended, self.what, timeout_s)
        return await super().wait(timeout_s)

    async def post(self, timeout_s: float | None = 60.0) -> TransferStatus:
        """As the sync ``post``."""
        wait_s = WAIT_SLICE_S if timeout_s is None else timeout_s
        call = self._post(wait_s)
        call_timeout = send_timeout(getattr(self._client, "timeout_s", None), wait_s)
        channels = getattr(self._client, "post_channels", None)
        resp = None
        if self._post_socket and channels is not None:
            resp = await channels.post(self._post_socket, call.request, call_timeout)
        if resp is None:
            resp = await self._client.run(call, timeout_s=call_timeout)
        status = self._answered(resp)
        if status is None or not wait_s:
            return status or await self.status()
        if not status.ended and timeout_s is None:
            return await self.wait(None)
        return _checked(status, self.what, timeout_s)


async def _await_once(client: AsyncCaller, call: rpcs.Call[TransferStatus]) -> TransferStatus:
    return await client.run(call, timeout_s=call.request.timeout_seconds + _CALL_MARGIN_S)


async def _await(client: AsyncCaller, handle: _Waitable, timeout_s: float | None
                 ) -> TransferStatus:
    steps = _waits(handle, timeout_s)
    req = next(steps)
    while True:
        try:
            req = steps.send(await _await_once(client, req))
        except StopIteration as end:
            return end.value
