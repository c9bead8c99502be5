"""``kvpool top``: one frame (``--once``) against a real daemon with two pools and leases, two
targets with one unreachable, the live view on a pseudo-terminal through a daemon restart and
Ctrl-C, and the rate arithmetic."""

from __future__ import annotations

import fcntl
import os
import pty
import re
import select
import signal
import struct
import subprocess
import sys
import termios
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import msgspec
import pytest

from kvpool.clients.client import KVPoolClient
from kvpool.contract.records import DaemonStats, LeaseStats, PoolStats, SpaceStats, Stats
from kvpool.tools.top import render
from kvpool.tools.top_model import Rate, rates
from tests.conftest import (
    REPO,
    TINY_OPTIONS,
    TINY_SPEC,
    DaemonProcess,
    run_daemon,
    subprocess_env,
    temp_dir,
)

BAR_CHARS = set("█▒░")
_ANSI = re.compile(r"\x1b(\[[0-9;?]*[A-Za-z]|\][^\x07]*\x07|[()][0-9A-B]|[=>78])")


def kvpool_top(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "kvpool.tools.cli", "top", *args], cwd=REPO,
                          env=subprocess_env(), capture_output=True, text=True, timeout=60)


def cells(text: str) -> list[list[str]]:
    """Each line of a frame, panel borders dropped, split on whitespace."""
    return [line.strip().strip("│").split() for line in text.splitlines()]


def pool_rows(text: str) -> dict[tuple[str, str], list[str]]:
    """``{(pool, space): [bar, used, capacity, use%, high, alloc/s, free/s, failed, ...]}``."""
    rows: dict[tuple[str, str], list[str]] = {}
    pool = ""
    for row in cells(text):
        bar_at = next((i for i, c in enumerate(row) if set(c) <= BAR_CHARS), None)
        if bar_at == 2:
            pool = row[0]
        if bar_at in (1, 2):
            rows[(pool, row[bar_at - 1])] = row[bar_at:]
    return rows


def lease_rows(text: str) -> list[list[str]]:
    rows = cells(text)
    start = next(i for i, r in enumerate(rows) if r[:2] == ["LEASE", "NAME"])
    out = []
    for row in rows[start + 1:]:
        if not row or not row[0].isdigit():
            break
        out.append(row)
    return out


@dataclass
class Served:
    daemon: DaemonProcess
    lease_ids: dict[str, int]


@pytest.fixture(scope="module")
def served() -> Iterator[Served]:
    """A daemon (64 MiB budget) with pool ``tiny`` (256 kv pages, 8 req rows) and ``big``
    (4 MiB: 1024 kv pages), lease ``engine-0`` holding tiny kv 20 (after 30, so high water 30)
    + req 2 and big kv 3, and lease ``idle`` holding nothing."""
    with temp_dir() as path, run_daemon(path) as daemon, KVPoolClient(daemon.target) as client:
        client.configure("tiny", spec=TINY_SPEC, **TINY_OPTIONS)
        client.configure("big", spec=TINY_SPEC, **{**TINY_OPTIONS, "budget_bytes": 4 << 20})
        with client.lease("engine-0", ttl_s=30) as engine, client.lease("idle", ttl_s=30) as idle:
            kv, _req = engine.allocate_batch("tiny", [("kv", 30), ("req", 2)])
            engine.free("tiny", "kv", kv[:10])
            engine.allocate("big", "kv", 3)
            yield Served(daemon, {"engine-0": engine.lease_id, "idle": idle.lease_id})


def test_once_shows_header_pools_and_leases(served: Served) -> None:
    """By hand: tiny kv 20 used of 256 = 7.8%, bar 16 x 20/256 = 1.25 -> 1 block, high water
    16 x 30/256 = 1.9 -> 2 (one ▒); req 2 of 8 = 25.0%, 4 blocks; big kv 3 of 1024 = 0.3%, no
    block. Bytes (the padding page on top): tiny 257 x 4 KiB + 9 x 260 int32 request rows =
    1,062,032 B = 1.01 MiB; big 1,025 x 4 KiB + 9,360 B = 4,207,760 B = 4.01 MiB; together
    5,269,792 B = 5.03 MiB, 7.9% of 64 MiB.
    ``--once`` takes one snapshot, so no rates ("-")."""
    out = kvpool_top("--once", "--target", served.daemon.target)
    assert out.returncode == 0, out.stderr
    text = out.stdout
    assert max(len(line) for line in text.splitlines()) <= 120
    assert served.daemon.target in text.splitlines()[0]
    header = [" ".join(r) for r in cells(text)[1:3]]
    assert re.fullmatch(r"kvpoold \S+ on cpu up \S+ budget █?░+ 5\.03 MiB / 64\.00 MiB "
                        r"\(7\.9%\)", header[0]), header
    assert header[1] == "pools 2 leases 2 open: 2 opened, 0 closed, 0 expired"

    rows = pool_rows(text)
    assert list(rows) == [("tiny", "kv"), ("tiny", "req"), ("big", "kv"), ("big", "req")]
    assert rows[("tiny", "kv")] == ["█▒" + "░" * 14, "20", "256", "7.8%", "30", "-", "-", "0",
                                    "1.01", "MiB", "0"]
    assert rows[("tiny", "req")] == ["████" + "░" * 12, "2", "8", "25.0%", "2", "-", "-", "0"]
    assert rows[("big", "kv")] == ["░" * 16, "3", "1,024", "0.3%", "3", "-", "-", "0",
                                   "4.01", "MiB", "0"]
    assert rows[("big", "req")][1:4] == ["0", "8", "0.0%"]

    engine, idle = lease_rows(text)  # most ids held first
    assert engine[:2] == [str(served.lease_ids["engine-0"]), "engine-0"]
    assert 0 < float(engine[2].rstrip("s")) <= 30 and engine[3:5] == ["30s", "0"]
    assert engine[5:] == ["tiny:", "kv=20", "req=2", "big:", "kv=3"]
    assert idle[:2] == [str(served.lease_ids["idle"]), "idle"] and idle[5:] == ["-"]


def test_once_with_an_unreachable_target_shows_both_and_exits_1(served: Served) -> None:
    absent = f"unix:///tmp/kvp-absent-{os.getpid()}.sock"
    out = kvpool_top("--once", "--target", absent, "--target", served.daemon.target,
                     "--width", "100")
    assert out.returncode == 1, out.stderr
    assert "Traceback" not in out.stderr
    text = out.stdout
    first, second = text.index(absent), text.index(served.daemon.target)
    assert first < second, "panels in --target order"
    assert re.search(r"unreachable: UNAVAILABLE: cannot reach kvpoold", text)
    assert pool_rows(text[second:])[("tiny", "kv")][1:3] == ["20", "256"]
    assert max(len(line) for line in text.splitlines()) <= 100


def test_bad_options_exit_2() -> None:
    for args, field in ((["--interval", "0.01"], "interval"), (["--target", "nohost"], "target"),
                        (["--width", "20"], "width")):
        out = kvpool_top("--once", *args)
        assert out.returncode == 2, (args, out.stderr)
        assert field in out.stderr


# -- the live view ------------------------------------------------------------------------------


# How long a wait for a fact (a line on screen, the child's exit) may take before the test
# fails: only a ceiling for a hang, so generous (a 2-core machine at load 8 was seen to take
# over 10 s for what takes 1 s quiet).
CEILING_S = 90.0


class Terminal:
    """A child process on a pseudo-terminal (40 x 120 unless told) whose output is collected as
    it comes."""

    def __init__(self, argv: list[str], rows: int = 40, cols: int = 120) -> None:
        master, slave = pty.openpty()
        fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", rows, cols, 0, 0))
        env = subprocess_env(TERM="xterm-256color")
        env.pop("COLUMNS", None)
        env.pop("LINES", None)
        self.proc = subprocess.Popen(argv, stdin=slave, stdout=slave, stderr=slave, cwd=REPO,
                                     env=env)
        os.close(slave)
        self.master = master
        self.raw = b""

    def read(self, wait_s: float) -> bool:
        """Take what the child wrote within ``wait_s``; False once it closed the terminal."""
        ready, _, _ = select.select([self.master], [], [], wait_s)
        if not ready:
            return True
        try:
            data = os.read(self.master, 1 << 16)
        except OSError:  # EIO: the child exited and closed the terminal
            return False
        self.raw += data
        return bool(data)

    def wait_exit(self, timeout_s: float = CEILING_S) -> int:
        """The child's exit status, reading its output meanwhile (a terminal nobody reads
        blocks the writer) and after, until it closed the terminal."""
        deadline = time.monotonic() + timeout_s
        while self.proc.poll() is None:
            assert time.monotonic() < deadline, "top did not exit"
            self.read(0.05)
        while self.read(0.2) and select.select([self.master], [], [], 0.2)[0]:
            pass
        return self.proc.returncode

    def text(self, since: int = 0) -> str:
        return _ANSI.sub("", self.raw[since:].decode(errors="replace"))

    def wait_for(self, what: str, check: Callable[[str], bool], since: int = 0,
                 timeout_s: float = CEILING_S) -> None:
        deadline = time.monotonic() + timeout_s
        while not check(self.text(since)):
            assert self.proc.poll() is None, f"top exited ({self.proc.returncode}):\n" + \
                self.text()[-3000:]
            assert time.monotonic() < deadline, f"no {what} on screen:\n" + self.text()[-3000:]
            self.read(0.1)

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        os.close(self.master)


def _has_rates(text: str) -> bool:
    """A tiny/kv row whose ALLOC/S and FREE/S are numbers above 0."""
    for line in text.split("tiny")[1:]:
        row = line.split()
        bar_at = next((i for i, c in enumerate(row[:3]) if set(c) <= BAR_CHARS), None)
        if bar_at is None or len(row) < bar_at + 8:
            continue
        try:
            if float(row[bar_at + 5].replace(",", "")) > 0 < float(row[bar_at + 6].replace(
                    ",", "")):
                return True
        except ValueError:
            continue
    return False


def test_live_view_retries_shows_rates_survives_the_daemon_and_ctrl_c(
        socket_dir: Path) -> None:
    """``kvpool top`` on a terminal, started before its daemon: "unreachable", retried every
    1 s. The daemon starts and a client allocates and frees 10 pages in a loop: top picks the
    daemon up and the tiny/kv row shows allocation and free rates above 0. The daemon stops:
    "unreachable" again, and top keeps running. Ctrl-C: exit 0, the alternate screen left and
    the cursor shown again."""
    target = f"unix://{socket_dir / 'kvpool.sock'}"
    term = Terminal([sys.executable, "-m", "kvpool.tools.cli", "top", "--target", target,
                     "--interval", "0.2"])
    try:
        term.wait_for("unreachable", lambda t: "unreachable" in t and "retrying every 1 s" in t)
        with run_daemon(socket_dir) as daemon, KVPoolClient(daemon.target) as client:
            assert daemon.target == target
            client.configure("tiny", spec=TINY_SPEC, **TINY_OPTIONS)
            stop = threading.Event()
            with client.lease("churn", ttl_s=30) as lease:
                def churn() -> None:
                    while not stop.is_set():
                        lease.free("tiny", "kv", lease.allocate("tiny", "kv", 10))
                        time.sleep(0.005)

                worker = threading.Thread(target=churn)
                worker.start()
                try:
                    term.wait_for("rates", _has_rates)
                finally:
                    stop.set()
                    worker.join()
        mark = len(term.raw)
        term.wait_for("unreachable after the daemon stopped", lambda t: "unreachable" in t,
                      since=mark)
        term.proc.send_signal(signal.SIGINT)
        assert term.wait_exit() == 0
        assert b"\x1b[?1049l" in term.raw, "the alternate screen was not left"
        assert term.raw.rfind(b"\x1b[?25h") > term.raw.rfind(b"\x1b[?25l"), "cursor hidden"
        assert "Traceback" not in term.text()
    finally:
        term.close()


# -- pieces -------------------------------------------------------------------------------------


def space(allocs: int, frees: int, capacity: int = 100) -> SpaceStats:
    used = allocs - frees
    return SpaceStats(capacity=capacity, used=used, high_water=used, frees=frees,
                      failed_allocs=0)


def snapshot(uptime: float, pools: dict[str, tuple[float, dict[str, SpaceStats]]]) -> Stats:
    """Stats with ``pools = {name: (age_s, {space: SpaceStats})}``."""
    return Stats(
        daemon=DaemonStats(version="0", device="cpu", budget_bytes=1 << 20, used_bytes=0,
                           uptime_seconds=uptime, num_pools=len(pools), num_leases=0,
                           leases_opened=0, leases_closed=0, leases_expired=0),
        pools=[PoolStats(name=name, fingerprint="f", architecture="mha", kv_cache_dtype="bf16",
                         page_size=16, max_total_num_tokens=0, max_running_requests=8,
                         backing_bytes=1 << 20, spaces=spaces_, attached=0, age_seconds=age,
                         sharing="none")
               for name, (age, spaces_) in pools.items()],
        leases=[LeaseStats(lease_id=1, name="x", ttl_seconds=10.0, expires_in_seconds=5.0,
                           held={}, attached=0)],
    )


def test_rates_are_counter_deltas_over_the_daemons_uptime() -> None:
    """Uptime 10 s -> 12 s: kv allocs 100 -> 160 and frees 90 -> 150 are 30/s each; req
    unchanged is 0/s. Pool ``new`` is 1 s old, younger than the 2 s between: configured again
    in between, no rate. Pool ``gone`` is not in the newer snapshot."""
    before = snapshot(10.0, {"a": (10.0, {"kv": space(100, 90), "req": space(4, 4)}),
                             "new": (9.0, {"kv": space(50, 0)}),
                             "gone": (5.0, {"kv": space(1, 0)})})
    after = snapshot(12.0, {"a": (12.0, {"kv": space(160, 150), "req": space(4, 4)}),
                            "new": (1.0, {"kv": space(60, 0)})})
    assert rates(before, after) == {("a", "kv"): Rate(30.0, 30.0), ("a", "req"): Rate(0.0, 0.0)}
    assert rates(None, after) == {}
    restarted = snapshot(3.0, {"a": (3.0, {"kv": space(5, 0)})})
    assert rates(after, restarted) == {}, "uptime went down: a new daemon"


def frame(stats: Stats, width: int = 200) -> str:
    """One ``--once`` frame of a daemon whose snapshot is ``stats``, as plain text."""
    from rich.console import Console

    from kvpool.tools.top_model import DaemonView

    view = DaemonView("unix:///x.sock")
    view.update(stats, time.monotonic())
    with open(os.devnull, "w") as sink:
        console = Console(width=width, force_terminal=False, color_system=None, record=True,
                          file=sink)
        console.print(render([view], time.monotonic(), width=width, live=False))
    return console.export_text()


def test_narrow_frames_never_cut_numbers() -> None:
    """Narrower frames lose the usage bar, then ATT, BYTES and FAILED; the numbers that stay
    are never cut, and no line is wider than asked. A 40,000-page pool in 200 columns shows
    everything; in 60, no bar, no ATT/BYTES/FAILED."""
    from kvpool.tools.top import POOL_COLUMNS

    stats = snapshot(5.0, {"tiny": (5.0, {"kv": space(20_000, 0, 40_000)})})
    seen = {}
    for width in (200, 120, 100, 80, 70, 60):
        text = frame(stats, width)
        assert max(len(line) for line in text.splitlines()) <= width
        header = next(r for r in cells(text) if r[:2] == ["POOL", "SPACE"])
        assert [c for c in header if c != "USAGE"] == list(POOL_COLUMNS[:len(header) - (
            "USAGE" in header)]), (width, header)
        row = next(r for r in cells(text) if r[:2] == ["tiny", "kv"])
        assert "…" not in " ".join(row)
        numbers = [c for c in row[2:] if not set(c) <= BAR_CHARS]
        assert numbers[:4] == ["20,000", "40,000", "50.0%", "20,000"], (width, row)
        seen[width] = header
    assert "USAGE" in seen[200] and len(seen[200]) == len(POOL_COLUMNS) + 1
    assert seen[60] == ["POOL", "SPACE", "USED", "CAPACITY", "USE%", "HIGH", "ALLOC/S", "FREE/S"]


def test_header_shows_event_loop_stalls_only_when_there_were_some() -> None:
    """A daemon whose loop stalled (DaemonStats.loop_stalls) says so in the header; one that
    never stalled shows nothing about it."""
    calm = snapshot(5.0, {"tiny": (5.0, {"kv": space(2, 0)})})
    assert "stall" not in frame(calm)
    stalled = msgspec.structs.replace(calm, daemon=msgspec.structs.replace(
        calm.daemon, loop_stalls=2, loop_stalled_seconds=1.75, loop_longest_stall_seconds=1.5))
    assert "loop stalls 2 (longest 1.50 s)" in frame(stalled)


def test_peers_table_shows_transfers_each_way() -> None:
    """A daemon that moved pages to and from peers (Stats.peers) gets a PEER table: completed
    transfers, bytes and failures each way, one row per peer; none without peers."""
    from kvpool.contract.records import PeerStats

    calm = snapshot(5.0, {"tiny": (5.0, {"kv": space(2, 0)})})
    assert "PEER" not in frame(calm)
    busy = msgspec.structs.replace(calm, peers=[
        PeerStats(peer="decode-0:7070", sent=3, sent_bytes=3 << 20, send_failures=1),
        PeerStats(peer="agent-7", received=12_345, received_bytes=5 << 30, receive_failures=2)])
    rows = {r[0]: r for r in cells(frame(busy)) if r and r[0] in ("decode-0:7070", "agent-7")}
    assert rows["decode-0:7070"][1:] == ["3", "3.00", "MiB", "1", "0", "0", "B", "0"], rows
    assert rows["agent-7"][1:] == ["0", "0", "B", "0", "12,345", "5.00", "GiB", "2"], rows


# -- small terminals, several daemons -------------------------------------------------------------

CROWD = 30  # leases on the busy daemon


@dataclass
class Crowd:
    busy: DaemonProcess
    quiet: DaemonProcess
    absent: str
    busy_ids: list[int]
    quiet_ids: list[int]


@pytest.fixture(scope="module")
def crowd() -> Iterator[Crowd]:
    """Three targets: ``busy`` (pools ``tiny`` and ``big``, 30 leases with long names, each
    holding kv pages of both pools and a req row), ``quiet`` (pool ``tiny``, 2 leases), and an
    address where nothing listens."""
    import contextlib

    with temp_dir() as a, temp_dir() as b, run_daemon(a) as busy, run_daemon(b) as quiet, \
            KVPoolClient(busy.target) as bc, KVPoolClient(quiet.target) as qc, \
            contextlib.ExitStack() as stack:
        bc.configure("tiny", spec=TINY_SPEC, **TINY_OPTIONS)
        bc.configure("big", spec=TINY_SPEC, **{**TINY_OPTIONS, "budget_bytes": 4 << 20})
        qc.configure("tiny", spec=TINY_SPEC, **TINY_OPTIONS)
        busy_ids = []
        for i in range(CROWD):
            lease = stack.enter_context(bc.lease(f"sglang-scheduler-tp{i:02d}-of-a-long-name",
                                                 ttl_s=60))
            lease.allocate_batch("tiny", [("kv", 1 + i % 5), ("req", 1 if i < 8 else 0)][
                :1 if i >= 8 else 2])
            lease.allocate("big", "kv", 2 + i)
            busy_ids.append(lease.lease_id)
        quiet_ids = []
        for i in range(2):
            lease = stack.enter_context(qc.lease(f"quiet-{i}", ttl_s=60))
            lease.allocate("tiny", "kv", 4 - i)
            quiet_ids.append(lease.lease_id)
        yield Crowd(busy, quiet, f"unix:///tmp/kvp-absent-{os.getpid()}.sock", busy_ids,
                    quiet_ids)


def crowd_frame(crowd: Crowd, *flags: str) -> str:
    out = kvpool_top("--once", "--target", crowd.busy.target, "--target", crowd.quiet.target,
                     "--target", crowd.absent, *flags)
    assert out.returncode == 1, out.stderr  # the absent one did not answer
    assert "Traceback" not in out.stderr
    return out.stdout


def test_80x24_with_three_targets_shows_every_daemon_and_one_line_per_lease(
        crowd: Crowd) -> None:
    """``--width 80 --height 24`` (the live view's fit to an 80 x 24 terminal): all three
    panels are on screen in --target order, the unreachable one too; the busy daemon's 30
    leases do not push the others off: it lists what its share of the lines holds and says
    ``+N more leases``; the quiet one lists both of its leases. Every lease is one line (its
    full id, its HELD text cut with an ellipsis, never wrapped); nothing is wider than 80."""
    text = crowd_frame(crowd, "--width", "80", "--height", "24")
    lines = text.rstrip("\n").splitlines()
    assert len(lines) <= 24, text
    assert max(len(line) for line in lines) <= 80
    at = [next(i for i, line in enumerate(lines) if t in line)
          for t in (crowd.busy.target, crowd.quiet.target, crowd.absent)]
    assert at == sorted(at), text
    assert "unreachable: UNAVAILABLE" in text

    busy = "\n".join(lines[at[0]:at[1]])
    listed = [r for r in cells(busy) if r and r[0].isdigit() and len(r[0]) > 8]
    assert len(listed) < CROWD, busy
    for row in listed:
        assert int(row[0]) in crowd.busy_ids, row  # the whole id
    (more,) = re.findall(r"\+(\d+) more leases \(kvpool leases lists all\)", busy)
    assert int(more) == CROWD - len(listed)
    assert re.search(r"^│ tiny +kv ", busy, flags=re.M) and "pools 2   leases 30 open" in busy

    # the daemon with fewer leases is listed whole first
    quiet = "\n".join(lines[at[1]:at[2]])
    assert [int(r[0]) for r in cells(quiet) if r and r[0].isdigit() and len(r[0]) > 8] \
        == crowd.quiet_ids, text
    assert "more lease" not in quiet


def test_a_frame_too_short_for_every_daemon_names_the_rest(crowd: Crowd) -> None:
    """In 12 lines the busy daemon's panel (header, 4 pool rows, '+30 more leases') fits and
    the others do not: the last line says so and names them, the unreachable one as such."""
    text = crowd_frame(crowd, "--width", "80", "--height", "12")
    lines = text.rstrip("\n").splitlines()
    assert len(lines) <= 12, text
    assert crowd.busy.target in lines[0]
    assert "+30 more leases" in text
    assert lines[-1].startswith("+2 more daemons below, not shown in 12 lines: "), lines[-1]
    assert crowd.quiet.target in lines[-1] or lines[-1].endswith("…")


def test_width_40_never_cuts_a_lease_id_or_a_number(crowd: Crowd) -> None:
    """At 40 columns the lease table drops TTL, ATT and EXPIRES IN and cuts NAME and HELD, but
    every lease id is whole; the pool table keeps USED, CAPACITY and USE% whole."""
    text = crowd_frame(crowd, "--width", "40")
    lines = text.splitlines()
    assert max(len(line) for line in lines) <= 40
    ids = [int(r[0]) for r in cells(text) if r and r[0].isdigit() and len(r[0]) > 8]
    assert set(ids) <= set(crowd.busy_ids) | set(crowd.quiet_ids)  # whole ids, nothing cut
    busy_shown = [i for i in ids if i in crowd.busy_ids]
    assert len(busy_shown) == min(CROWD, 20) and len(set(busy_shown)) == len(busy_shown)
    assert [i for i in ids if i in crowd.quiet_ids] == crowd.quiet_ids
    lease_lines = [line for line in lines if re.match(r"│ \d{9,} ", line)]
    assert len(lease_lines) == len(ids) == 22, "a lease took more than one line"
    assert sum("…" in line for line in lease_lines) >= 20, "HELD is cut, not wrapped"
    assert "+10 more leases" in text  # --max-leases 20 by default
    header = next(r for r in cells(text) if r[:2] == ["LEASE", "NAME"])
    assert header == ["LEASE", "NAME", "HELD"], header
    pools = next(r for r in cells(text) if r[:2] == ["POOL", "SPACE"])
    assert pools[:5] == ["POOL", "SPACE", "USED", "CAPACITY", "USE%"], pools
    tiny = next(r for r in cells(text) if r[:2] == ["tiny", "kv"])
    assert "…" not in " ".join(tiny)


def test_live_view_on_an_80x24_terminal_keeps_every_daemon_on_screen(crowd: Crowd) -> None:
    """The live view on a 24 x 80 pseudo-terminal with the three targets: one frame shows all
    three panels (the unreachable one too) and the busy daemon's ``+N more leases``."""
    term = Terminal([sys.executable, "-m", "kvpool.tools.cli", "top", "--target",
                     crowd.busy.target, "--target", crowd.quiet.target, "--target", crowd.absent,
                     "--interval", "0.5"], rows=24, cols=80)
    try:
        def whole(text: str) -> bool:  # what one fitted frame holds (a 24-line screen)
            return all(part in text for part in (
                crowd.busy.target, crowd.quiet.target, crowd.absent, "unreachable",
                "+30 more leases", "quiet-0", "quiet-1"))

        term.wait_for("all three daemons", whole)
        term.proc.send_signal(signal.SIGINT)
        assert term.wait_exit() == 0
        assert "Traceback" not in term.text()
    finally:
        term.close()
