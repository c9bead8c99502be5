"""Transfers between daemons that require tokens (docs/security.md): each tenant sees only its
own sends, a grant token is the capability on the decode side, and a peer daemon that does not
present the shared peer token is refused and the send fails with nothing changing hands."""

from __future__ import annotations

import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from kvpool import KVPoolClient, NotFound, PermissionDenied, Unauthenticated
from kvpool.contract.records import TransferState
from kvpool.v1 import kvpool_pb2 as pb
from tests.conftest import TINY_OPTIONS, TINY_SPEC, DaemonProcess, run_daemon, temp_dir

POOL = "tiny"


def secret_file(directory: Path, name: str, secret: str) -> Path:
    path = directory / f"{name}.token"
    path.write_text(secret + "\n")
    os.chmod(path, 0o600)
    return path


@dataclass
class Tenants:
    prefill: DaemonProcess
    decode: DaemonProcess
    secrets: Path


def tokened_daemon_args(directory: Path, peer_secret: str) -> list[str]:
    """``--token-file`` (the admin token, which is also what this daemon presents to peers) and
    a tokens file with two tenants scoped to ``tiny`` and one scoped to another pool."""
    admin = secret_file(directory, "admin", peer_secret)
    tokens = directory / "tokens.toml"
    lines = []
    for name, pools in (("team-a", POOL), ("team-b", POOL), ("team-c", "other")):
        path = secret_file(directory, name, f"{name}-secret-0123456789abcdef")
        lines += [f"[tokens.{name}]", f'secret_file = "{path}"', f'pools = ["{pools}"]', ""]
    tokens.write_text("\n".join(lines))
    os.chmod(tokens, 0o600)
    return ["--token-file", str(admin), "--tokens-file", str(tokens), "--unix-auth", "token"]


@pytest.fixture
def tenants() -> Iterator[Tenants]:
    with temp_dir() as d1, temp_dir() as d2, \
            run_daemon(d1, *tokened_daemon_args(d1, "peer-secret-0123456789abcdef")) as p, \
            run_daemon(d2, *tokened_daemon_args(d2, "peer-secret-0123456789abcdef")) as d:
        yield Tenants(p, d, d1)


def client(daemon: DaemonProcess, token: str) -> KVPoolClient:
    return KVPoolClient(daemon.target, token=token)


def secret(name: str) -> str:
    return f"{name}-secret-0123456789abcdef"


def test_each_tenant_sees_only_its_own_sends(tenants: Tenants) -> None:
    admin_secret = "peer-secret-0123456789abcdef"
    with client(tenants.prefill, admin_secret) as pa, client(tenants.decode, admin_secret) as da:
        pa.configure(POOL, spec=TINY_SPEC, **TINY_OPTIONS)
        da.configure(POOL, spec=TINY_SPEC, **TINY_OPTIONS)
    with client(tenants.prefill, secret("team-a")) as p, \
            client(tenants.decode, secret("team-a")) as d, \
            client(tenants.prefill, secret("team-b")) as pb_, \
            client(tenants.decode, secret("team-b")) as db_, \
            client(tenants.prefill, secret("team-c")) as pc_, \
            p.lease("a-prefill") as pl, d.lease("a-decode") as dl:
        src, dst = pl.allocate(POOL, "kv", 4), dl.allocate(POOL, "kv", 4)
        grant = dl.grant_receive(POOL, dst)
        handle = p.send(POOL, src, peer=tenants.decode.target, token=grant.token, lease=pl)
        assert handle.wait(30).state == TransferState.done

        # Another tenant of the prefill daemon cannot read team-a's send, even knowing its id:
        # the answer is the one for a transfer that never existed.
        with pytest.raises(NotFound, match=f"no transfer {handle.transfer_id}"):
            pb_.call("WaitTransfer", pb.WaitTransferRequest(transfer_id=handle.transfer_id))
        # Its own identity reads it, and so does the admin.
        own = p.call("WaitTransfer", pb.WaitTransferRequest(transfer_id=handle.transfer_id))
        assert own.state == pb.TRANSFER_STATE_DONE
        with client(tenants.prefill, admin_secret) as pa:
            seen = pa.call("WaitTransfer",
                           pb.WaitTransferRequest(transfer_id=handle.transfer_id))
            assert seen.state == pb.TRANSFER_STATE_DONE
        # On the decode side the grant token is the capability: whoever holds it may watch.
        by_token = db_.call("WaitTransfer", pb.WaitTransferRequest(token=grant.token))
        assert by_token.state == pb.TRANSFER_STATE_DONE
        # A tenant scoped to another pool cannot send from this one at all.
        with pc_.lease("c") as cl, pytest.raises(PermissionDenied, match="team-c"):
            pc_.send(POOL, src, peer=tenants.decode.target, token=grant.token, lease=cl)
        # Stats shows a scoped caller no peers (they name other tenants' partners).
        assert p.stats().peers == []


def test_a_peer_without_the_shared_token_is_refused(tmp_path: Path) -> None:
    """The prefill daemon presents a different peer token: the decode daemon refuses its
    PeerReceive, the send fails UNAUTHENTICATED, and every page stays with its lease."""
    with temp_dir() as d1, temp_dir() as d2, \
            run_daemon(d1, *tokened_daemon_args(d1, "prefill-only-secret-0123456789")) as p, \
            run_daemon(d2, *tokened_daemon_args(d2, "decode-only-secret-01234567890")) as d, \
            client(p, "prefill-only-secret-0123456789") as pc, \
            client(d, "decode-only-secret-01234567890") as dc:
        pc.configure(POOL, spec=TINY_SPEC, **TINY_OPTIONS)
        dc.configure(POOL, spec=TINY_SPEC, **TINY_OPTIONS)
        with pc.lease("prefill") as pl, dc.lease("decode") as dl:
            src, dst = pl.allocate(POOL, "kv", 4), dl.allocate(POOL, "kv", 4)
            grant = dl.grant_receive(POOL, dst)
            with pytest.raises(Unauthenticated, match="same --token-file on both"):
                pc.send(POOL, src, peer=d.target, token=grant.token, lease=pl)
            # The grant was never used: the pages can still be sent by a trusted peer later.
            assert grant.status().state == TransferState.pending
            assert dc.stats(POOL).leases[0].held[POOL]["kv"] == 4
            assert pc.stats(POOL).leases[0].held[POOL]["kv"] == 4
