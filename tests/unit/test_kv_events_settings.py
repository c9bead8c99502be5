"""``--kv-events-config``: vLLM's KVEventsConfig keys, checked at the edge (kvpoold.settings)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvpool.contract.errors import InvalidArgument
from kvpoold.main import main
from kvpoold.settings import KvEventsConfig, load_config, parse_kv_events, resolve


def events(value: object) -> KvEventsConfig | None:
    return resolve({"kv_events_config": value}, None).kv_events


def test_vllms_keys_and_defaults() -> None:
    cfg = events(json.dumps({"enable_kv_cache_events": True, "replay_endpoint": "tcp://*:5558",
                             "topic": "kv@{pool}", "buffer_steps": 64}))
    assert cfg is not None
    assert (cfg.endpoint, cfg.replay_endpoint, cfg.buffer_steps, cfg.hwm, cfg.max_queue_size,
            cfg.topic) == ("tcp://*:5557", "tcp://*:5558", 64, 100_000, 100_000, "kv@{pool}")
    assert set(KvEventsConfig.__struct_fields__) == {
        "enable_kv_cache_events", "publisher", "endpoint", "replay_endpoint", "buffer_steps",
        "hwm", "max_queue_size", "topic"}


@pytest.mark.parametrize("value", [
    '{"enable_kv_cache_events": false}',
    '{"enable_kv_cache_events": true, "publisher": "null"}',
    "{}",
])
def test_off_unless_enabled_with_the_zmq_publisher(value: str) -> None:
    assert events(value) is None
    assert resolve({}, None).kv_events is None


def test_a_config_file_table(tmp_path: Path) -> None:
    path = tmp_path / "kvpoold.toml"
    path.write_text('kv_events_config = { enable_kv_cache_events = true, endpoint = '
                    '"ipc:///run/kvpool/events" }\n')
    cfg = resolve({}, load_config(path)).kv_events
    assert cfg is not None and cfg.endpoint == "ipc:///run/kvpool/events"


@pytest.mark.parametrize(("value", "words"), [
    ('{"enable_kv_cache_events": true, "buffer_step": 5}', "buffer_step"),
    ('{"enable_kv_cache_events": true, "buffer_steps": 0}', "buffer_steps"),
    ('{"enable_kv_cache_events": true, "publisher": "kafka"}', "publisher"),
    ('{"enable_kv_cache_events": true, "hwm": "lots"}', "hwm"),
    ("enable_kv_cache_events=true", "not a JSON object"),
    ('{"enable_kv_cache_events": true, "endpoint": "inproc://events"}', "inproc"),
    ('{"enable_kv_cache_events": true, "endpoint": "tcp://*"}', "tcp://*:PORT"),
    ('{"enable_kv_cache_events": true, "replay_endpoint": "tcp://*:5557"}', "replay_endpoint"),
])
def test_a_bad_value_names_itself(value: str, words: str) -> None:
    with pytest.raises(InvalidArgument, match="kv_events_config") as err:
        parse_kv_events(value)
    assert words in str(err.value)


def test_kvpoold_serve_exits_2_with_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["serve", "--kv-events-config", '{"enable_kv_cache_events": true, "nope": 2}']) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "kv-events-config" in err[0] and "nope" in err[0]
