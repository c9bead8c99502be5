"""Issue 39, listeners that survive exhaustion, against real processes: a daemon (and the
descriptor socket's server) run out of descriptors by 1,000 held connections, report NOT_SERVING
while they cannot accept, and serve a real Attach (a real descriptor fetch) again once the
connections are gone; a connection cap keeps held connections from exhausting anything; and
``--socket-group`` makes every socket ``0660`` for its group, whose members connect and map.

Descriptor limits are lowered in the children (soft and hard: the daemon raises its soft limit
to the hard one) so that exhaustion comes after a few hundred connections. No timed asserts:
each wait polls for the fact, with a generous bound.
"""

from __future__ import annotations

import contextlib
import grp
import json
import os
import pwd
import resource
import shutil
import stat
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from kvpool.clients.client import KVPoolClient
from kvpool.contract.errors import KVPoolError, ResourceExhausted
from kvpool.contract.fd_channel import FdAsk
from kvpool.mapping.fd_client import fetch_fd
from tests.conftest import (
    REPO,
    TINY_OPTIONS,
    TINY_SPEC,
    DaemonProcess,
    run_daemon,
    subprocess_env,
)

NOFILE = 160
HELD = 1000
SECRET = "ab" * 16
WAIT_S = 60.0
SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING
# A child that connects HELD times to a Unix socket (its own limit raised to its hard one),
# prints how many connected, then on each line of stdin how many were closed by the other end,
# and closes them all when stdin closes.
HOLDER = """
import resource, select, socket, sys
resource.setrlimit(resource.RLIMIT_NOFILE, (resource.getrlimit(resource.RLIMIT_NOFILE)[1],) * 2)
held = []
for _ in range(int(sys.argv[2])):
    s = socket.socket(socket.AF_UNIX)
    s.settimeout(5)
    try:
        s.connect(sys.argv[1])
    except OSError:
        break
    held.append(s)
print(len(held), flush=True)
for _line in sys.stdin:
    closed = 0
    for s in held:
        if select.select([s], [], [], 0)[0]:
            try:
                closed += s.recv(1, socket.MSG_PEEK) == b""
            except OSError:
                closed += 1
    print(closed, flush=True)
"""


def lower_nofile(n: int) -> Callable[[], None]:
    def lower() -> None:
        resource.setrlimit(resource.RLIMIT_NOFILE, (n, n))
    return lower


@contextlib.contextmanager
def holding(path: Path, count: int) -> Iterator[tuple[subprocess.Popen[str], int]]:
    """``count`` connections to ``path`` held by a child process until the block ends: the
    child, and how many it connected."""
    proc = subprocess.Popen([sys.executable, "-c", HOLDER, str(path), str(count)],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None
        yield proc, int(proc.stdout.readline())
    finally:
        if proc.stdin is not None:
            proc.stdin.close()
        proc.wait(30)


def closed_by_peer(holder: subprocess.Popen[str]) -> int:
    assert holder.stdin is not None and holder.stdout is not None
    holder.stdin.write("\n")
    holder.stdin.flush()
    return int(holder.stdout.readline())


def wait_for(fact: Callable[[], Any], what: str, timeout_s: float = WAIT_S) -> Any:
    """Poll ``fact`` until it returns something true (exceptions count as not yet)."""
    deadline = time.monotonic() + timeout_s
    last: object = None
    while time.monotonic() < deadline:
        try:
            got = fact()
        except Exception as exc:  # not yet: whatever the call raised
            last = exc
        else:
            if got:
                return got
            last = got
        time.sleep(0.05)
    raise AssertionError(f"{what}: not within {timeout_s} s (last: {last!r})")


def health_of(stub: health_pb2_grpc.HealthStub) -> int:
    return stub.Check(health_pb2.HealthCheckRequest(), timeout=2).status


def events(d: DaemonProcess) -> list[dict[str, Any]]:
    return [json.loads(line) for line in d.log_text().splitlines() if line.startswith("{")]


def attach_works(target: str) -> bool:
    """A fresh client: open a lease, Attach the pool and read its first page, close."""
    with KVPoolClient(target, timeout_s=2) as client:
        lease = client.lease("after", ttl_s=30)
        try:
            with client.attach("tiny", lease=lease) as region:
                return region.fingerprint != ""
        finally:
            lease.close()


def test_a_cap_above_the_descriptor_limit_is_lowered_so_held_connections_never_exhaust_it(
        socket_dir: Path) -> None:
    """--max-connections 4,096 under a descriptor limit of 160: the daemon lowers the cap at
    start (and says so), so 1,000 held connections never run it out of descriptors (no
    listener goes down), and a new client is served as soon as they go."""
    with run_daemon(socket_dir, "--log-format", "json", "--max-connections", "4096",
                    preexec_fn=lower_nofile(NOFILE)) as d:
        (low,) = [e for e in events(d) if e.get("event") == "nofile_low"]
        assert low["asked"] == 4096 and 0 < low["cap"] * low["listeners"] < NOFILE, low
        with KVPoolClient(d.target) as client:
            client.configure("tiny", spec=TINY_SPEC, **TINY_OPTIONS)
        assert attach_works(d.target)  # this process's first map (imports) before the clock
        with holding(d.socket, HELD) as (holder, held):
            assert held == HELD
            wait_for(lambda: closed_by_peer(holder) >= HELD - low["cap"],
                     "connections over the lowered cap closed by the daemon")
            assert len(os.listdir(f"/proc/{d.proc.pid}/fd")) < NOFILE
        released = time.monotonic()
        assert wait_for(lambda: attach_works(d.target), "Attach after the connections went")
        print(f"Attach served {time.monotonic() - released:.3f} s after 1,000 held "
              "connections went (waited on the fact, not timed)")
        assert not [e for e in events(d) if e.get("event") == "listener_down"]


def test_the_daemon_serves_again_after_an_emfile_episode(socket_dir: Path) -> None:
    """Out of descriptors for another reason (its limit lowered under it with prlimit):
    health NOT_SERVING, one listener_down line; the limit back: SERVING, Attach works."""
    with run_daemon(socket_dir, "--log-format", "json") as d:
        with KVPoolClient(d.target) as client:
            client.configure("tiny", spec=TINY_SPEC, **TINY_OPTIONS)
        assert attach_works(d.target)  # this process's first map (imports) before the clock
        channel = grpc.insecure_channel(d.target)  # connected before: it can still ask
        stub = health_pb2_grpc.HealthStub(channel)
        limits = resource.prlimit(d.proc.pid, resource.RLIMIT_NOFILE)
        try:
            assert health_of(stub) == SERVING
            # every descriptor number under 8 is taken: each new one fails with EMFILE
            resource.prlimit(d.proc.pid, resource.RLIMIT_NOFILE, (8, limits[1]))
            wait_for(lambda: health_of(stub) == NOT_SERVING,
                     "health NOT_SERVING while out of descriptors")
            with pytest.raises(KVPoolError):  # a new client cannot be accepted meanwhile
                attach_works(d.target)
            resource.prlimit(d.proc.pid, resource.RLIMIT_NOFILE, limits)
            restored = time.monotonic()
            assert wait_for(lambda: attach_works(d.target), "Attach after the limit came back")
            print(f"Attach served {time.monotonic() - restored:.3f} s after the limit came "
                  "back (waited on the fact, not timed)")
            wait_for(lambda: health_of(stub) == SERVING, "health SERVING again")
        finally:
            with contextlib.suppress(ProcessLookupError):
                resource.prlimit(d.proc.pid, resource.RLIMIT_NOFILE, limits)
            channel.close()
        log = events(d)
        down = [e for e in log if e.get("event") == "listener_down"]
        up = [e for e in log if e.get("event") == "listener_up"]
        assert len(down) == 1 and "EMFILE" in down[0]["reason"], down  # once per episode
        assert len(up) == 1 and up[0]["listener"] == down[0]["listener"]


def test_a_connection_cap_keeps_held_connections_from_exhausting_the_daemon(
        socket_dir: Path) -> None:
    """With the cap under the descriptor limit, held connections over it are closed at once:
    the daemon never runs out of descriptors and serves a new client meanwhile."""
    with run_daemon(socket_dir, "--log-format", "json", "--max-connections", "32",
                    preexec_fn=lower_nofile(NOFILE)) as d:
        with KVPoolClient(d.target) as client:
            client.configure("tiny", spec=TINY_SPEC, **TINY_OPTIONS)
        with holding(d.socket, 300) as (holder, held):
            assert held == 300
            wait_for(lambda: closed_by_peer(holder) >= 300 - 32, "connections over the cap "
                     "closed by the daemon")
            assert len(os.listdir(f"/proc/{d.proc.pid}/fd")) < NOFILE
        assert wait_for(lambda: attach_works(d.target), "Attach after")
        assert not [e for e in events(d) if e.get("event") == "listener_down"]


# -- the descriptor socket ----------------------------------------------------------------------

@contextlib.contextmanager
def fd_socket(path: Path, *args: str, user: tuple[int, int] | None = None
              ) -> Iterator[subprocess.Popen[str]]:
    """``tests.e2e.fd_socket_child`` serving ``path``, until the block ends."""
    proc = subprocess.Popen([sys.executable, "-m", "tests.e2e.fd_socket_child", str(path), *args],
                            env=subprocess_env(), cwd=REPO, stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None
        assert "serving" in json.loads(proc.stdout.readline())
        yield proc
    finally:
        if proc.stdin is not None:
            proc.stdin.close()
        proc.wait(30)


def fetch_works(path: Path) -> bool:
    fd, answer = fetch_fd(str(path), FdAsk(pool="tiny", lease_id=7, secret=SECRET), 2.0)
    try:
        return answer.kind == "memfd" and os.pread(fd, 12, 0) == b"kvpool-bytes"
    finally:
        os.close(fd)


def test_the_descriptor_socket_accepts_again_after_an_emfile_episode(socket_dir: Path) -> None:
    path = socket_dir / "k.sock.fd"
    with fd_socket(path, "--nofile", "64") as server:
        assert fetch_works(path)
        assert server.stdout is not None
        with holding(path, HELD):
            state = json.loads(server.stdout.readline())
            assert state["accepting"] is False and "Too many open files" in state["why"]
        # the held connections are closed; their tasks end as their asks come up empty
        assert wait_for(lambda: fetch_works(path), "a descriptor fetched after the episode")
        assert json.loads(server.stdout.readline()) == {"accepting": True, "why": ""}


def test_the_descriptor_socket_refuses_one_connection_over_its_cap(socket_dir: Path) -> None:
    path = socket_dir / "c.sock.fd"
    with fd_socket(path, "--max-connections", "4"), holding(path, 4) as (_holder, held):
        assert held == 4
        with pytest.raises(ResourceExhausted) as info:
            wait_for_refusal(path)
        assert "serves 4 connections, at most 4 (kvpoold serve --max-connections)" in \
            info.value.message


def wait_for_refusal(path: Path) -> None:
    """fetch_fd until it is refused with a KVPoolError (the held connections are accepted
    by then), and raise that error."""
    deadline = time.monotonic() + WAIT_S
    while time.monotonic() < deadline:
        try:
            fetch_works(path)
        except KVPoolError as exc:
            if isinstance(exc, ResourceExhausted):
                raise
        time.sleep(0.05)
    raise AssertionError("never refused")


# -- --socket-group -------------------------------------------------------------------------------

@contextlib.contextmanager
def temp_member() -> Iterator[tuple[int, int]]:
    """A temporary group and a user in it (root only): ``(uid, gid)``; removed after."""
    name = f"kvp{uuid.uuid4().hex[:8]}"
    subprocess.run(["groupadd", name], check=True)
    try:
        subprocess.run(["useradd", "-M", "-N", "-g", name, "-s", "/usr/sbin/nologin", name],
                       check=True)
        try:
            yield pwd.getpwnam(name).pw_uid, grp.getgrnam(name).gr_gid
        finally:
            subprocess.run(["userdel", name], check=False, capture_output=True)
    finally:
        subprocess.run(["groupdel", name], check=False, capture_output=True)


# A member of the group: started as root (its interpreter and the checkout may be root's
# only), it imports what it needs, becomes the member (uid, its group only) and then connects.
MEMBER = """
import ctypes, os, sys
from kvpool.clients.client import KVPoolClient
from kvpool.contract.fd_channel import FdAsk
from kvpool.mapping.fd_client import fetch_fd
from kvpool.mapping.sparse import CHUNK_BYTES, Reservation
uid, gid = int(sys.argv[3]), int(sys.argv[4])
os.setgroups([gid])
os.setgid(gid)
os.setuid(uid)
with KVPoolClient(sys.argv[1], timeout_s=10) as client:
    print("pools", [p.name for p in client.stats().pools])
fd, answer = fetch_fd(sys.argv[2], FdAsk(pool="tiny", lease_id=7, secret="ab" * 16))
r = Reservation(fd, answer.size)
r.map(0, CHUNK_BYTES)
print("mapped", ctypes.string_at(r.address, 12).decode())
"""


@pytest.mark.skipif(os.geteuid() != 0 or shutil.which("groupadd") is None,
                    reason="needs root to create a group and a user")
def test_socket_group_members_connect_to_every_socket_and_map(socket_dir: Path) -> None:
    with temp_member() as (uid, gid):
        os.chmod(socket_dir, 0o755)  # the member must reach the sockets' directory
        fd_path = socket_dir / "kvpool.sock.fd"
        with run_daemon(socket_dir, "--socket-group", str(gid)) as d, \
                fd_socket(fd_path, "--gid", str(gid)):
            with KVPoolClient(d.target) as client:
                client.configure("tiny", spec=TINY_SPEC, **TINY_OPTIONS)
            for path in (d.socket, fd_path):
                st = path.stat()
                assert stat.S_ISSOCK(st.st_mode) and stat.S_IMODE(st.st_mode) == 0o660, path
                assert st.st_gid == gid, path
            out = subprocess.run([sys.executable, "-c", MEMBER, d.target, str(fd_path),
                                  str(uid), str(gid)], env=subprocess_env(), cwd="/",
                                 capture_output=True, text=True, timeout=60)
            assert out.returncode == 0, out.stderr
            assert out.stdout.splitlines() == ["pools ['tiny']", "mapped kvpool-bytes"]
            nobody = pwd.getpwnam("nobody")
            out = subprocess.run([sys.executable, "-c", STRANGER, str(d.socket), str(fd_path),
                                  str(nobody.pw_uid), str(nobody.pw_gid)],
                                 capture_output=True, text=True, timeout=60)
            assert out.stdout.splitlines() == ["PermissionError", "PermissionError"], out.stderr


# Not a member: connecting to either socket is refused by its mode.
STRANGER = """
import os, socket, sys
uid, gid = int(sys.argv[3]), int(sys.argv[4])
os.setgroups([gid])
os.setgid(gid)
os.setuid(uid)
for path in sys.argv[1:3]:
    try:
        socket.socket(socket.AF_UNIX).connect(path)
        print("connected")
    except OSError as exc:
        print(type(exc).__name__)
"""
