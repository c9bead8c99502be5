"""The daemon's two log formats: logfmt text and JSON, the same fields and the same time."""

from __future__ import annotations

import io
import json
import logging
import shlex
import shutil
import subprocess

import pytest

from kvpoold.server.logs import configure_logging


@pytest.fixture
def emit() -> object:
    def run(fmt: str) -> str:
        out = io.StringIO()
        configure_logging("info", fmt, stream=out)  # type: ignore[arg-type]
        logging.getLogger("kvpoold.daemon").info(
            "lease opened", extra={"fields": {"event": "lease_opened", "name": 'sg "x" = 1',
                                              "lease_id": 2**62 + 1}})
        configure_logging("info", "text")  # back to stderr for the other tests
        return out.getvalue().strip()
    return run


def test_text_log_is_logfmt(emit: object) -> None:
    line = emit("text")  # type: ignore[operator]
    pairs = dict(token.split("=", 1) for token in shlex.split(line))
    assert list(pairs)[:4] == ["ts", "level", "logger", "msg"]
    assert (pairs["level"], pairs["msg"], pairs["event"]) == ("info", "lease opened",
                                                               "lease_opened")
    assert pairs["name"] == 'sg "x" = 1' and pairs["lease_id"] == str(2**62 + 1)


def test_json_log_has_the_same_fields_and_time(emit: object) -> None:
    entry = json.loads(emit("json"))  # type: ignore[operator]
    text = dict(token.split("=", 1) for token in shlex.split(emit("text")))  # type: ignore[operator]
    assert entry["msg"] == text["msg"] and entry["event"] == text["event"]
    assert entry["ts"][:10] == text["ts"][:10] and entry["ts"].endswith("Z")


def test_json_log_lease_ids_are_exact_strings(emit: object) -> None:
    """A 63-bit lease id is a decimal string in the JSON log: jq (which reads numbers as
    doubles) hands back every digit, as docs/operations.md's recipe needs."""
    line = emit("json")  # type: ignore[operator]
    entry = json.loads(line)
    assert entry["lease_id"] == str(2**62 + 1) and int(entry["lease_id"]) == 2**62 + 1
    jq = shutil.which("jq")
    if jq is None:
        pytest.skip("no jq on PATH")
    out = subprocess.run([jq, "-r", 'select(.event == "lease_opened") | .lease_id'],
                         input=line, capture_output=True, text=True, timeout=30, check=True)
    assert int(out.stdout.strip()) == 2**62 + 1
