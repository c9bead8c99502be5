"""``kvpool top`` of elastic pools: hand-built snapshots (through the real codec) drawn by the
real renderer. An elastic pool gets one line under the pools table, granted of all groups and
the bytes the budget pays of the virtual range, then reclaiming, floor, cap, weight and backed,
the last ones going first in narrow frames; a fixed pool renders as it always did."""

from __future__ import annotations

import os
import time

import msgspec
import pytest

from kvpool.contract.codec import stats_from_pb, stats_to_pb
from kvpool.contract.records import Stats
from kvpool.tools.top import render
from kvpool.tools.top_model import DaemonView
from tests.factories import GiB, MiB, elastic_stats, pool_stats, stats_of

# tests.factories.elastic_stats with no revoked lease: granted 12 of 64 groups, 1.50 GiB + 2 MiB
# of 8.00 GiB + 2 MiB (one decimal: 1.5 of 8.0 GiB), 1.50 GiB backed
CALM = elastic_stats(revoked_leases=0)
FULL_LINE = ("chat: 12/64 groups, 1.5 of 8.0 GiB, reclaiming 2, floor 4, cap 64, weight 2, "
             "backed 1.5 GiB")


def frame(stats: Stats, width: int = 120, height: int | None = None) -> list[str]:
    """The lines of one ``--once`` frame of a daemon whose snapshot is ``stats`` (sent through
    the wire codec first), panel borders stripped."""
    from rich.console import Console

    wired = stats_from_pb(stats_to_pb(stats))
    assert wired == stats
    view = DaemonView("unix:///x.sock")
    view.update(wired, time.monotonic())
    with open(os.devnull, "w") as sink:
        console = Console(width=width, force_terminal=False, color_system=None, record=True,
                          file=sink)
        console.print(render([view], time.monotonic(), width=width, live=False, height=height))
    lines = console.export_text().splitlines()
    assert max(len(line) for line in lines) <= width
    return [line.strip().strip("│").strip() for line in lines]


def elastic_lines(lines: list[str]) -> list[str]:
    return [line for line in lines if " groups" in line]


def test_an_elastic_pool_shows_granted_of_virtual_and_its_knobs() -> None:
    """120 columns: the whole line under the pools table, after the pool's kv and req rows,
    before the leases; 80 columns (an 80 x 24 terminal): all but the backed bytes."""
    stats = stats_of(pool_stats("chat", elastic=CALM))
    wide = frame(stats, 120)
    assert elastic_lines(wide) == [FULL_LINE]
    at = wide.index(FULL_LINE)
    assert wide[at - 1].split()[0] == "req" and wide[at + 1].startswith("LEASE")
    assert elastic_lines(frame(stats, 80)) == [
        "chat: 12/64 groups, 1.5 of 8.0 GiB, reclaiming 2, floor 4, cap 64, weight 2"]


@pytest.mark.parametrize("width", [200, 120, 100, 80, 70, 60, 50, 40])
def test_narrow_frames_drop_the_last_parts_and_never_cut_a_number(width: int) -> None:
    """Whatever the width, the line is the full one up to a part's end: backed goes first, then
    weight, cap, floor, reclaiming, the bytes; the granted/all groups always stay."""
    (line,) = elastic_lines(frame(stats_of(pool_stats("chat", elastic=CALM)), width))
    assert FULL_LINE.startswith(line)
    assert line == FULL_LINE or FULL_LINE[len(line):].startswith(", ")
    assert line.startswith("chat: 12/64 groups")


def test_a_long_name_is_cut_to_keep_the_numbers() -> None:
    """A pool name too long for 80 columns loses its end (an ellipsis), not its bytes or
    reclaiming count; big numbers get thousands separators."""
    big = elastic_stats(revoked_leases=0, groups=4096, granted_groups=1024, reclaiming_groups=0,
                        cap_groups=4096, virtual_bytes=512 * GiB, granted_bytes=128 * GiB)
    name = "a-very-long-elastic-pool-name-indeed"
    (line,) = elastic_lines(frame(stats_of(pool_stats(name, elastic=big)), 80))
    shown, _, rest = line.partition(": ")
    assert shown.endswith("…") and name.startswith(shown[:-1])
    assert rest == "1,024/4,096 groups, 128.0 of 512.0 GiB, reclaiming 0"


def test_revoked_leases_are_shown_only_when_there_were_some() -> None:
    """A pool whose clients did not unmap in time says how many leases the daemon ended, right
    after reclaiming (before the knobs); with none, nothing about it."""
    assert "revoked" not in " ".join(frame(stats_of(pool_stats("chat", elastic=CALM))))
    (line,) = elastic_lines(frame(stats_of(pool_stats("chat", elastic=elastic_stats(
        revoked_leases=3))), 120))
    assert "reclaiming 2, revoked 3 leases, floor 4" in line
    (one,) = elastic_lines(frame(stats_of(pool_stats("chat", elastic=elastic_stats())), 120))
    assert "revoked 1 lease," in one


def test_sizes_take_the_unit_of_the_virtual_range() -> None:
    """Small pools: granted and virtual in MiB (the virtual range's unit), backed in its own."""
    small = elastic_stats(revoked_leases=0, group_bytes=2 * MiB, groups=8, granted_groups=1,
                          reclaiming_groups=0, cap_groups=8, virtual_bytes=16 * MiB,
                          granted_bytes=2 * MiB, backed_bytes=1536 << 10)
    (line,) = elastic_lines(frame(stats_of(pool_stats("s", elastic=small)), 120))
    assert line == ("s: 1/8 groups, 2.0 of 16.0 MiB, reclaiming 0, floor 4, cap 8, weight 2, "
                    "backed 1.5 MiB")


def test_fixed_pools_render_as_before() -> None:
    """A fixed pool has no elastic line, and a frame with an elastic pool next to it is the
    fixed-only frame plus that pool's rows and its one line: the fixed pool's rows, the header
    and the leases are unchanged, at every width."""
    fixed = pool_stats("fixed")
    for width in (120, 80, 40):
        alone = frame(stats_of(fixed), width)
        assert not elastic_lines(alone)
        both = frame(stats_of(fixed, pool_stats("chat", elastic=CALM)), width)
        (line,) = elastic_lines(both)
        chat = next(i for i, x in enumerate(both) if x.startswith("chat "))
        assert both[chat + 1].startswith("req") and both[chat + 2] == line
        kept = both[:chat] + both[chat + 3:]  # without chat's kv and req rows and its line
        # the header counts the pools and sums their bytes: the one line that differs there
        differs = [(a, b) for a, b in zip(alone, kept, strict=True) if a != b]
        assert all("budget" in a or "pools" in a for a, _ in differs), differs
        assert len(both) == len(alone) + 3


def test_an_80x24_frame_with_elastic_pools_fits() -> None:
    """Two elastic pools and 30 leases in 80 x 24: every line fits, both elastic lines are on
    screen (they are part of the pools section, shown before any lease)."""
    leases = [msgspec.structs.replace(stats_of().leases[0], lease_id=100 + i, name=f"engine-{i}",
                                      held={"a": {"kv": i + 1}}) for i in range(30)]
    stats = msgspec.structs.replace(
        stats_of(pool_stats("a", elastic=CALM), pool_stats("b", elastic=CALM)), leases=leases)
    lines = frame(stats, 80, height=24)
    assert len(lines) <= 24
    assert [x.split(":")[0] for x in elastic_lines(lines)] == ["a", "b"]
    assert any("more leases" in x for x in lines)


def test_the_bytes_column_of_an_elastic_pool_is_what_the_budget_pays() -> None:
    """The pool row's BYTES: a fixed pool's backing, an elastic pool's granted bytes (groups
    plus the fixed part: 1.50 GiB here), never its virtual range (8.0 GiB)."""
    lines = frame(stats_of(pool_stats("chat", elastic=CALM), pool_stats("fixed")), 200)
    rows = {line.split()[0]: line.split() for line in lines
            if line.split()[:2] in (["chat", "kv"], ["fixed", "kv"])}
    assert rows["chat"][-3:-1] == ["1.50", "GiB"]
    assert rows["fixed"][-3:-1] == ["1.00", "MiB"]
