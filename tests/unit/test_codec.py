"""kvpool.codec: every record survives record -> proto -> record, and replies of the first API
form (Kind enums, no space strings) still decode."""

from __future__ import annotations

import numpy as np

from kvpool import codec
from kvpool.handles import SharedHandle
from kvpool.records import (
    AttachInfo,
    ConfigureResult,
    DaemonStats,
    LeaseStats,
    PoolStats,
    Released,
    SpaceStats,
    Stats,
)
from kvpool.v1 import kvpool_pb2 as pb
from kvpoold.server.live_pools import plan_json_text
from kvpoold.sizing import make_options, plan
from tests.factories import llama_8b


def space(capacity: int, used: int, **extra: object) -> SpaceStats:
    return SpaceStats(capacity=capacity, used=used, free=capacity - used, high_water=used + 1,
                      allocs=used + 5, frees=5, failed_allocs=2, **extra)  # type: ignore[arg-type]


def sample_stats() -> Stats:
    return Stats(
        daemon=DaemonStats(version="0.1.0", device="cpu", budget_bytes=1 << 30,
                           used_bytes=123, uptime_seconds=1.5, num_pools=1, num_leases=1,
                           leases_opened=3, leases_closed=1, leases_expired=1),
        pools=[PoolStats(name="v4", fingerprint="f" * 32, architecture="dsv4",
                         kv_cache_dtype="fp8_e4m3", page_size=256,
                         max_total_num_tokens=4096, max_running_requests=8,
                         backing_bytes=123,
                         spaces={"kv": space(16, 3, unit="pages", bytes_per_unit=4096),
                                 "swa": space(8, 3, unit="pages", follows="kv"),
                                 "req": space(8, 1, unit="rows"),
                                 "c4_state": space(32, 2, unit="slots")},
                         attached=2, age_seconds=0.5, handle_kind="shm")],
        leases=[LeaseStats(lease_id=(1 << 62) + 5, name="engine-0", ttl_seconds=10.0,
                           expires_in_seconds=7.5,
                           held={"v4": {"kv": 3, "swa": 3, "req": 1, "c4_state": 2}},
                           attached=1, cached={"v4": {"c4_state": 1}})],
    )


def test_stats_round_trip_in_the_plan_order() -> None:
    stats = sample_stats()
    msg = codec.stats_to_pb(stats)
    assert codec.stats_from_pb(pb.StatsResponse.FromString(msg.SerializeToString())) == stats
    assert list(codec.stats_from_pb(msg).pools[0].spaces) == ["kv", "swa", "req", "c4_state"]
    lease = codec.stats_from_pb(msg).leases[0]
    assert lease.cached == {"v4": {"c4_state": 1}} and lease.in_use("v4", "c4_state") == 1
    assert lease.held_text() == "v4: kv=3 swa=3 req=1 c4_state=2 (1 cached)"
    # the first form's enum is filled where one exists, left unset beyond the four
    assert [(s.space, s.kind) for s in msg.pools[0].spaces] == [
        ("kv", pb.KIND_KV), ("swa", pb.KIND_SWA), ("req", pb.KIND_REQ), ("c4_state", 0)]


def test_replies_of_the_first_form_decode_by_kind() -> None:
    """A daemon of the first form sends only Kind enums: they read as the space names."""
    msg = pb.StatsResponse(
        daemon=pb.DaemonStats(version="0.0.9"),
        pools=[pb.PoolStats(name="p", spaces=[pb.SpaceStats(kind=pb.KIND_KV, capacity=4)])],
        leases=[pb.LeaseStats(lease_id=1, held=[pb.Held(pool="p", kind=pb.KIND_STATE,
                                                        count=2)])])
    stats = codec.stats_from_pb(msg)
    assert stats.pools[0].spaces["kv"].capacity == 4
    assert stats.leases[0].held == {"p": {"state": 2}}


def test_released_round_trips_as_close_and_drop_replies() -> None:
    released = Released({"a": {"kv": 4, "req": 1}, "b": {"kv": 2}}, detached=1)
    assert codec.released_from_pb(codec.close_lease_to_pb(released)) == released
    dropped = Released({"a": {"kv": 4}}, detached=0, released_bytes=1 << 20)
    assert codec.released_from_pb(codec.drop_to_pb(dropped)) == dropped
    assert dropped.total == 4 and released.total == 7


def test_configure_and_attach_round_trip() -> None:
    p = plan(llama_8b(), make_options(budget_bytes=1 << 30, page_size=16))
    text = plan_json_text(p)
    result = ConfigureResult(p, text, p.fingerprint(), True, False, 5 << 20)
    assert codec.configure_from_pb(codec.configure_to_pb(result)) == result
    handle = SharedHandle(kind="shm", size=4096, path="/dev/shm/kvpool-x")
    info = AttachInfo(p.fingerprint(), p, text, handle, 7, "cpu")
    assert codec.attach_from_pb(codec.attach_to_pb(info)) == info
    assert codec.plan_to_pb(p).id_spaces[0].name == "kv"


def test_ids_cross_as_little_endian_int32_without_a_copy() -> None:
    ids = np.array([1, 2, 70000], dtype=np.int32)
    data = codec.ids_to_bytes(ids)
    assert data == b"\x01\x00\x00\x00\x02\x00\x00\x00\x70\x11\x01\x00"
    back = codec.ids_from_bytes(data)
    assert back.tolist() == [1, 2, 70000] and not back.flags.writeable
