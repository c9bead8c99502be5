"""The one error table (``kvpool.contract.errors``): a class for every gRPC status code, the
daemon's
status mapping derived from it, the client's conversion of a failed call, and the CLI's exit
codes."""

from __future__ import annotations

import argparse
import ast
import inspect

import grpc
import pytest

import kvpool
from kvpool.contract import errors, wire
from kvpool.contract.errors import ERRORS_BY_CODE, InvalidArgument, KVPoolError, error_from_code
from kvpool.contract.limits import FIELD_METADATA_KEY
from kvpool.tools.cli_run import run_subcommand
from kvpoold.server.status import STATUS_BY_ERROR, status_of

CODES = [code for code in grpc.StatusCode if code is not grpc.StatusCode.OK]

# The names the daemon's callers catch; a rename is an API change.
CLASS_OF_CODE = {
    "CANCELLED": "Cancelled",
    "UNKNOWN": "Unknown",
    "INVALID_ARGUMENT": "InvalidArgument",
    "DEADLINE_EXCEEDED": "DeadlineExceeded",
    "NOT_FOUND": "NotFound",
    "ALREADY_EXISTS": "AlreadyExists",
    "PERMISSION_DENIED": "PermissionDenied",
    "RESOURCE_EXHAUSTED": "ResourceExhausted",
    "FAILED_PRECONDITION": "FailedPrecondition",
    "ABORTED": "Aborted",
    "OUT_OF_RANGE": "OutOfRange",
    "UNIMPLEMENTED": "Unimplemented",
    "INTERNAL": "Internal",
    "UNAVAILABLE": "Unavailable",
    "DATA_LOSS": "DataLoss",
    "UNAUTHENTICATED": "Unauthenticated",
}


def test_every_status_code_but_ok_has_its_class() -> None:
    assert set(ERRORS_BY_CODE) == {code.name for code in CODES}
    assert {code: cls.__name__ for code, cls in ERRORS_BY_CODE.items()} == CLASS_OF_CODE
    assert len(set(ERRORS_BY_CODE.values())) == len(CODES)


@pytest.mark.parametrize("code", CODES, ids=lambda c: c.name)
def test_class_code_class_round_trip(code: grpc.StatusCode) -> None:
    cls = ERRORS_BY_CODE[code.name]
    assert issubclass(cls, KVPoolError)
    assert cls.code == code.name
    assert grpc.StatusCode[cls.code] is code
    err = error_from_code(code.name, "went wrong", "pool")
    assert type(err) is cls
    assert (err.code, err.code_name, err.message, err.field) == (code.name, code.name,
                                                                 "went wrong", "pool")
    assert str(err) == "pool: went wrong"
    assert status_of(cls("x")) is code


@pytest.mark.parametrize("cls", list(ERRORS_BY_CODE.values()), ids=lambda c: c.__name__)
def test_every_class_is_exported_from_kvpool(cls: type[KVPoolError]) -> None:
    assert cls.__name__ in kvpool.__all__
    assert getattr(kvpool, cls.__name__) is cls


def test_every_class_in_the_module_is_in_the_table() -> None:
    defined = {obj for obj in vars(errors).values()
               if inspect.isclass(obj) and issubclass(obj, KVPoolError)}
    assert defined - set(ERRORS_BY_CODE.values()) == {KVPoolError}


def test_an_unknown_code_name_is_unknown_and_kept() -> None:
    err = error_from_code("NOT_A_CODE", "strange", None)
    assert type(err) is errors.Unknown
    assert err.code == "UNKNOWN"
    assert err.code_name == "NOT_A_CODE"
    assert str(err) == "strange"


def test_the_daemons_table_is_derived_from_the_clients() -> None:
    derived = {cls: grpc.StatusCode[cls.code] for cls in ERRORS_BY_CODE.values()}
    assert derived == STATUS_BY_ERROR


def test_status_of_uses_the_nearest_registered_base() -> None:
    class PoolGone(errors.NotFound):
        pass

    assert status_of(PoolGone("x")) is grpc.StatusCode.NOT_FOUND
    assert status_of(KVPoolError("bare")) is grpc.StatusCode.INTERNAL


def test_errors_module_imports_no_grpc() -> None:
    tree = ast.parse(inspect.getsource(errors))
    imported = {alias.name for node in ast.walk(tree) if isinstance(node, ast.Import)
                for alias in node.names}
    imported |= {node.module or "" for node in ast.walk(tree)
                 if isinstance(node, ast.ImportFrom)}
    assert imported <= {"__future__", "typing"}, imported


class FakeRpcError(grpc.RpcError):
    """What a failed call raises: a code, details and trailing metadata."""

    def __init__(self, code: grpc.StatusCode, details: str,
                 metadata: tuple[tuple[str, str | bytes], ...] = ()) -> None:
        super().__init__(details)
        self._code, self._details, self._metadata = code, details, metadata

    def code(self) -> grpc.StatusCode:
        return self._code

    def details(self) -> str:
        return self._details

    def trailing_metadata(self) -> tuple[tuple[str, str | bytes], ...]:
        return self._metadata


@pytest.mark.parametrize("code", CODES, ids=lambda c: c.name)
def test_error_from_rpc_gives_the_class_of_every_code(code: grpc.StatusCode) -> None:
    exc = FakeRpcError(code, "details", ((FIELD_METADATA_KEY, b"items[0].count"),))
    err = wire.error_from_rpc(exc)
    assert type(err) is ERRORS_BY_CODE[code.name]
    assert (err.code_name, err.field, err.message) == (code.name, "items[0].count", "details")


def test_error_from_rpc_says_the_daemon_is_not_running() -> None:
    err = wire.error_from_rpc(FakeRpcError(grpc.StatusCode.UNAVAILABLE, "connect failed"),
                              "unix:///run/kvpool/kvpool.sock")
    assert isinstance(err, errors.Unavailable)
    assert str(err) == ("cannot reach kvpoold at unix:///run/kvpool/kvpool.sock (connect "
                        "failed); is `kvpoold serve` running?")


def test_error_from_rpc_without_a_status_is_unknown() -> None:
    err = wire.error_from_rpc(grpc.RpcError("no status"))
    assert type(err) is errors.Unknown
    assert err.message == "no status"


def run_raising(exc: BaseException, capsys: pytest.CaptureFixture[str]) -> tuple[int, str]:
    def func(args: argparse.Namespace) -> int:
        raise exc

    rc = run_subcommand("kvpool", argparse.Namespace(func=func, command="stats"))
    return rc, capsys.readouterr().err


@pytest.mark.parametrize("code", CODES, ids=lambda c: c.name)
def test_cli_exit_codes(code: grpc.StatusCode, capsys: pytest.CaptureFixture[str]) -> None:
    rc, err = run_raising(error_from_code(code.name, "boom", "pool"), capsys)
    if code is grpc.StatusCode.INVALID_ARGUMENT:
        assert (rc, err) == (2, "kvpool stats: error: pool: boom\n")
    elif code is grpc.StatusCode.UNAVAILABLE:
        assert rc == 1
        assert err.startswith("kvpool stats: error (UNAVAILABLE): kvpoold is unavailable")
        assert "is `kvpoold serve` running?" in err
    elif code is grpc.StatusCode.UNAUTHENTICATED:
        assert (rc, err) == (1, "kvpool stats: error (UNAUTHENTICATED): pool: boom; give the "
                                "daemon's token with --token-file PATH (or set "
                                "KVPOOL_TOKEN_FILE)\n")
    else:
        assert (rc, err) == (1, f"kvpool stats: error ({code.name}): pool: boom\n")


def test_cli_unavailable_message_is_not_repeated(capsys: pytest.CaptureFixture[str]) -> None:
    exc = wire.error_from_rpc(FakeRpcError(grpc.StatusCode.UNAVAILABLE, "connect failed"),
                              "unix:///x.sock")
    rc, err = run_raising(exc, capsys)
    assert rc == 1
    assert err == ("kvpool stats: error (UNAVAILABLE): cannot reach kvpoold at unix:///x.sock "
                   "(connect failed); is `kvpoold serve` running?\n")


def test_cli_keeps_an_unknown_code_name(capsys: pytest.CaptureFixture[str]) -> None:
    rc, err = run_raising(error_from_code("NOT_A_CODE", "strange"), capsys)
    assert (rc, err) == (1, "kvpool stats: error (NOT_A_CODE): strange\n")


@pytest.mark.parametrize(("spec", "needles"), [
    ({"attention": {"type": "gqa", "num_kv_heads": 2, "head_dim": 16}},
     ("Invalid value 'gqa'", "values accepted here: mha, mla")),
    ({"attention": {"type": "mha", "num_kv_heads": 2, "head_dims": 16}},
     ("unknown field `head_dims`", "did you mean 'head_dim'?")),
    ({"dtype": "bf16"}, ("'bf16'", "did you mean 'bfloat16'?", "float16, float32")),
])
def test_spec_errors_say_what_is_accepted(spec: dict[str, object],
                                          needles: tuple[str, ...]) -> None:
    """A refused hand-written spec names the accepted fields or values there, and the nearest."""
    from kvpool.contract.spec import decode_spec

    fields = {"num_layers": 2, "context_length": 1024,
              "attention": {"type": "mha", "num_kv_heads": 2, "head_dim": 16}, **spec}
    with pytest.raises(InvalidArgument) as info:
        decode_spec(fields)
    for needle in needles:
        assert needle in info.value.message
