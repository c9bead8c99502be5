"""kvpool.contract.codec: every record survives record -> wire bytes -> record, and the wire
carries one form per concept (space strings, the plan as JSON only, no derived counters)."""

from __future__ import annotations

import msgspec
import numpy as np
import pytest

from kvpool.contract import codec
from kvpool.contract.records import (
    AttachInfo,
    ConfigureResult,
    DaemonStats,
    LeaseStats,
    PoolStats,
    Released,
    SpaceStats,
    Stats,
)
from kvpool.contract.shared_handle import SharedHandle
from kvpool.v1 import kvpool_pb2 as pb
from kvpoold.sizing import make_options, plan
from tests.factories import llama_8b


def space(capacity: int, used: int, **extra: object) -> SpaceStats:
    return SpaceStats(capacity=capacity, used=used, high_water=used + 1, frees=5,
                      failed_allocs=2, **extra)  # type: ignore[arg-type]


def sample_stats() -> Stats:
    return Stats(
        daemon=DaemonStats(version="1.0.0", device="cpu", budget_bytes=1 << 30,
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
                         attached=2, age_seconds=0.5, sharing="shm")],
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


def test_derived_counters_do_not_travel_and_the_record_computes_them() -> None:
    """free and allocs follow from capacity, used and frees: the wire has neither, and the
    record's properties give them (16 - 3 = 13 free, 5 + 3 = 8 handed out)."""
    wire_fields = {f.name for f in pb.SpaceStats.DESCRIPTOR.fields}
    assert not wire_fields & {"free", "allocs", "kind"}
    assert wire_fields == {"space", *SpaceStats.__struct_fields__}
    kv = codec.stats_from_pb(codec.stats_to_pb(sample_stats())).pools[0].spaces["kv"]
    assert (kv.free, kv.allocs, kv.allocs - kv.frees) == (13, 8, kv.used)


def test_no_enum_names_a_space_or_a_sharing() -> None:
    """Spaces and sharings are strings everywhere on the wire: the only enum left is the
    transfer state."""
    assert list(pb.DESCRIPTOR.enum_types_by_name) == ["TransferState"]
    assert pb.SharedHandle.DESCRIPTOR.fields_by_name["sharing"].type == 9  # TYPE_STRING
    assert pb.PoolStats.DESCRIPTOR.fields_by_name["sharing"].type == 9


def test_released_round_trips_as_close_and_drop_replies() -> None:
    released = Released({"a": {"kv": 4, "req": 1}, "b": {"kv": 2}}, detached=1)
    assert codec.released_from_pb(codec.close_lease_to_pb(released)) == released
    dropped = Released({"a": {"kv": 4}}, detached=0, released_bytes=1 << 20)
    assert codec.released_from_pb(codec.drop_to_pb(dropped)) == dropped
    assert dropped.total == 4 and released.total == 7


def test_configure_and_attach_round_trip() -> None:
    p = plan(llama_8b(), make_options(budget_bytes=1 << 30, page_size=16))
    text = codec.plan_to_json(p)
    result = ConfigureResult(p, text, p.fingerprint(), True, False, 5 << 20)
    wire = codec.configure_to_pb(result).SerializeToString()
    assert codec.configure_from_pb(pb.ConfigureResponse.FromString(wire)) == result
    handle = SharedHandle(sharing="shm", size=4096, path="/dev/shm/kvpool-x")
    info = AttachInfo(p.fingerprint(), p, text, handle, 7, "cpu")
    wire = codec.attach_to_pb(info).SerializeToString()
    assert codec.attach_from_pb(pb.AttachResponse.FromString(wire)) == info


def test_the_plan_travels_as_json_only_with_every_field() -> None:
    """One form: the replies carry plan_json and no typed plan; the JSON names every field of
    the record (None ones as null), so decoding loses nothing."""
    assert "plan" not in pb.ConfigureResponse.DESCRIPTOR.fields_by_name
    assert "plan" not in pb.AttachResponse.DESCRIPTOR.fields_by_name
    p = plan(llama_8b(), make_options(budget_bytes=1 << 30, page_size=16))
    text = codec.plan_to_json(p)
    assert set(msgspec.json.decode(text)) == set(type(p).__struct_fields__)
    assert codec.plan_from_json(text) == p


def test_a_handle_of_an_unknown_sharing_is_refused() -> None:
    with pytest.raises(ValueError, match="shares by 'rdma'"):
        codec.handle_from_pb(pb.SharedHandle(sharing="rdma", size=1))


def test_ids_cross_as_little_endian_int32_without_a_copy() -> None:
    ids = np.array([1, 2, 70000], dtype=np.int32)
    data = codec.ids_to_bytes(ids)
    assert data == b"\x01\x00\x00\x00\x02\x00\x00\x00\x70\x11\x01\x00"
    back = codec.ids_from_bytes(data)
    assert back.tolist() == [1, 2, 70000] and not back.flags.writeable
