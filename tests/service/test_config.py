"""``kvpoold serve`` settings: defaults, the TOML file, flags over it, and every refusal."""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

import pytest

from kvpool.clients.targets import channel_target, default_socket_path, token_from
from kvpool.contract.errors import InvalidArgument
from kvpoold.server import serve_cli
from kvpoold.settings import (
    DEFAULT_BUDGET_BYTES,
    Listener,
    check_host,
    load_config,
    parse_budget,
    parse_listen,
    resolve,
    security_warnings,
)
from tests.conftest import run_daemon, subprocess_env, temp_dir

REPO = Path(__file__).resolve().parents[2]


def serve_args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    serve_cli.add_parser(parser.add_subparsers())
    return parser.parse_args(["serve", *argv])


def test_defaults_work_without_flags() -> None:
    """cpu, 1 GiB, the per-user socket: $XDG_RUNTIME_DIR/kvpool/kvpool.sock when set."""
    s = resolve(vars(serve_args()), None, env={"XDG_RUNTIME_DIR": "/run/user/1000"})
    assert s.listeners == (Listener("unix", "/run/user/1000/kvpool/kvpool.sock"),)
    assert (s.device, s.budget_bytes, s.token, s.log_format) == ("cpu", DEFAULT_BUDGET_BYTES,
                                                                 None, "text")
    assert default_socket_path({}).name == "kvpool.sock"
    assert str(default_socket_path({})).startswith("/tmp/kvpool-")


def test_flags_override_the_config_file(tmp_path: Path) -> None:
    cfg = tmp_path / "kvpoold.toml"
    cfg.write_text('listen = ["tcp://127.0.0.1:50051"]\nbudget = "2GiB"\nlog_format = "json"\n'
                   'grace_seconds = 1.5\n')
    s = serve_cli.settings_from_args(serve_args("--config", str(cfg), "--budget", "512MiB"))
    assert s.listeners == (Listener("tcp", "127.0.0.1:50051"),)
    assert s.budget_bytes == 512 << 20
    assert (s.log_format, s.grace_seconds) == ("json", 1.5)


def test_the_shipped_example_config_loads() -> None:
    """docker/kvpoold.toml uses every key; it must stay decodable."""
    path = REPO / "docker" / "kvpoold.toml"
    if not path.exists():
        pytest.skip("no docker/kvpoold.toml in this checkout")
    cfg = load_config(path)
    assert cfg.budget == "2GiB" and cfg.listen


def test_unknown_config_key_is_named(tmp_path: Path) -> None:
    cfg = tmp_path / "bad.toml"
    cfg.write_text("budjet = 1\n")
    with pytest.raises(InvalidArgument, match="budjet") as info:
        load_config(cfg)
    assert info.value.field == "config"


@pytest.mark.parametrize(("text", "want"), [
    ("unix:///run/kvpool/kvpool.sock", Listener("unix", "/run/kvpool/kvpool.sock")),
    ("tcp://127.0.0.1:0", Listener("tcp", "127.0.0.1:0")),
    ("tcp://[::1]:50051", Listener("tcp", "[::1]:50051")),
])
def test_listen_forms(text: str, want: Listener) -> None:
    assert parse_listen(text) == want


@pytest.mark.parametrize("text", ["unix://relative.sock", "unix:///dir/", "tcp://host",
                                  "tcp://:80", "tcp://h:99999", "http://h:1", "/abs.sock"])
def test_bad_listen_is_refused(text: str) -> None:
    with pytest.raises(InvalidArgument) as info:
        parse_listen(text)
    assert info.value.field == "listen"


def test_budget_forms() -> None:
    """2GiB = 2 * 2**30; on cuda 0.5 of 10 GiB free = 5 GiB; a fraction on cpu is refused."""
    free = {"cuda:0": 10 << 30}.__getitem__
    assert parse_budget("2GiB", "cpu", free) == 2 << 30
    assert parse_budget(12345, "cpu", free) == 12345
    assert parse_budget("0.5", "cuda:0", free) == 5 << 30
    assert parse_budget(0.5, "cuda:0", free) == 5 << 30
    with pytest.raises(InvalidArgument, match="cuda devices only"):
        parse_budget("0.9", "cpu", free)
    with pytest.raises(InvalidArgument):
        parse_budget("lots", "cpu", free)


@pytest.mark.parametrize(("argv", "field"), [
    (("--device", "gpu"), "device"),
    (("--device", "cuda"), "device"),
    (("--tls-cert", "/x.pem"), "tls_cert"),
    (("--token-file", "/nonexistent/token"), "token_file"),
    (("--watch-min-interval", "0.01"), "watch_min_interval"),
    (("--max-watch-streams-per-identity", "0"), "max_watch_streams_per_identity"),
])
def test_bad_flags_name_the_field(argv: tuple[str, ...], field: str) -> None:
    with pytest.raises(InvalidArgument) as info:
        serve_cli.settings_from_args(serve_args(*argv))
    assert info.value.field == field


@pytest.mark.parametrize("grace", ["-1", "600.5", "nan", "inf"])
def test_grace_seconds_flag_is_held_to_the_config_files_range(grace: str) -> None:
    """The file's ``grace_seconds`` is typed 0..600; the flag gets the same check."""
    with pytest.raises(InvalidArgument, match="0 to 600") as info:
        serve_cli.settings_from_args(serve_args("--grace-seconds", grace))
    assert info.value.field == "grace_seconds"
    assert serve_cli.settings_from_args(serve_args("--grace-seconds", "600")).grace_seconds == 600


@pytest.mark.parametrize(("argv", "field", "words"), [
    (("--socket-group", "no-such-group-kvp"), "socket_group", "unknown group"),
    (("--tls-cert", "{d}/none.crt", "--tls-key", "{d}/none.key"), "tls_key", "--tls-key"),
    (("--tls-cert", "{d}/none.crt", "--tls-key", "{d}/key.pem"), "tls_cert", "--tls-cert"),
    (("--shm-dir", "{d}/absent"), "shm_dir", "does not exist"),
])
def test_host_checks_name_the_flag(tmp_path: Path, argv: tuple[str, ...], field: str,
                                   words: str) -> None:
    """What depends on this machine is checked by ``check_host``, before the server starts."""
    (tmp_path / "key.pem").write_text("key")
    settings = serve_cli.settings_from_args(serve_args(*(a.format(d=tmp_path) for a in argv)))
    with pytest.raises(InvalidArgument, match=words) as info:
        check_host(settings)
    assert info.value.field == field


def test_host_checks_pass_on_a_good_machine(tmp_path: Path) -> None:
    """The shm dir is only checked for shared memory on cpu; readable TLS files pass."""
    (tmp_path / "key.pem").write_text("key")
    (tmp_path / "cert.pem").write_text("cert")
    check_host(serve_cli.settings_from_args(serve_args(
        "--shm-dir", str(tmp_path), "--tls-key", str(tmp_path / "key.pem"),
        "--tls-cert", str(tmp_path / "cert.pem"))))
    check_host(serve_cli.settings_from_args(serve_args("--shm-dir", str(tmp_path / "absent"),
                                                       "--sharing", "none")))


def secret_file(tmp_path: Path, name: str, secret: str, mode: int = 0o600) -> Path:
    path = tmp_path / name
    path.write_text(secret + "\n")
    path.chmod(mode)
    return path


def test_tokens_file_names_and_scopes_tokens(tmp_path: Path) -> None:
    """Each [tokens.NAME] reads its secret file; admin or pools; --token-file beside it is the
    admin token; the caps and unix_auth are flags like the rest."""
    ops, a = secret_file(tmp_path, "ops", "s-ops"), secret_file(tmp_path, "a", "s-a")
    tokens = tmp_path / "tokens.toml"
    tokens.write_text(f'''
[tokens.ops]
secret_file = "{ops}"
admin = true

[tokens.engine-a]
secret_file = "{a}"
pools = ["llama", "llama-tp*"]
''')
    single = secret_file(tmp_path, "single", "s-single")
    s = serve_cli.settings_from_args(serve_args(
        "--tokens-file", str(tokens), "--token-file", str(single), "--unix-auth", "token",
        "--max-leases-per-identity", "8", "--max-attachments-per-identity", "2",
        "--max-watch-streams-per-identity", "3", "--watch-min-interval", "1.5"))
    assert [(t.name, t.secret, t.scope.admin, t.scope.pools) for t in s.tokens] == [
        ("ops", "s-ops", True, ()), ("engine-a", "s-a", False, ("llama", "llama-tp*"))]
    assert s.token == "s-single" and s.unix_auth == "token"
    assert (s.max_leases_per_identity, s.max_attachments_per_identity) == (8, 2)
    assert (s.max_watch_streams_per_identity, s.watch_min_interval) == (3, 1.5)
    assert "s-ops" not in repr(s.tokens)
    defaults = resolve(vars(serve_args()), None)
    assert (defaults.tokens, defaults.unix_auth, defaults.max_leases_per_identity,
            defaults.max_attachments_per_identity, defaults.max_watch_streams_per_identity,
            defaults.watch_min_interval) == ((), "trust", 1024, 256, 4, 0.5)


@pytest.mark.parametrize(("body", "match"), [
    ('[tokens.x]\nsecret_file = "{ok}"\n', "one of them"),
    ('[tokens.x]\nsecret_file = "{ok}"\nadmin = true\npools = ["a"]\n', "one of them"),
    ('[tokens.x]\nsecret_file = "{ok}"\nadmin = true\npeer = true\n', "peer = true, one of"),
    ('[tokens.x]\nsecret_file = "{open}"\nadmin = true\n', "chmod 600"),
    ('[tokens.local]\nsecret_file = "{ok}"\nadmin = true\n', "reserved"),
    ('[tokens."a b"]\nsecret_file = "{ok}"\nadmin = true\n', "must match"),
    ('[tokens.x]\nsecret_file = "{ok}"\npools = ["Llama"]\n', "pool pattern"),
    ('[tokens.x]\nsecret_file = "{ok}"\nadmin = true\nscope = 1\n', "invalid tokens file"),
    ('[tokens.admin]\nsecret_file = "{ok}"\nadmin = true\n', "rename it"),
    ("", "invalid tokens file"),
    ('[tokens.x]\nsecret_file = "{single}"\nadmin = true\n', "same secret"),
])
def test_bad_tokens_files(tmp_path: Path, body: str, match: str) -> None:
    ok = secret_file(tmp_path, "ok", "s-ok")
    opened = secret_file(tmp_path, "open", "s-open", 0o644)
    tokens = tmp_path / "tokens.toml"
    single = secret_file(tmp_path, "single", "s-single")
    tokens.write_text(body.format(ok=ok, open=opened, single=single))
    with pytest.raises(InvalidArgument, match=match) as info:
        serve_cli.settings_from_args(serve_args("--tokens-file", str(tokens),
                                                "--token-file", str(single)))
    assert info.value.field == "tokens_file"


def test_unix_auth_token_needs_tokens() -> None:
    with pytest.raises(InvalidArgument, match="needs tokens") as info:
        resolve(vars(serve_args("--unix-auth", "token")), None)
    assert info.value.field == "unix_auth"


def test_token_file_must_be_private(tmp_path: Path) -> None:
    token = tmp_path / "token"
    token.write_text("abc\n")
    token.chmod(0o644)
    with pytest.raises(InvalidArgument, match="chmod 600"):
        serve_cli.settings_from_args(serve_args("--token-file", str(token)))
    token.chmod(0o600)
    assert serve_cli.settings_from_args(serve_args("--token-file", str(token))).token == "abc"


@pytest.mark.parametrize(("target", "want"), [
    ("unix:///a/b.sock", "unix:///a/b.sock"),
    ("/a/b.sock", "unix:///a/b.sock"),
    ("localhost:50051", "localhost:50051"),
    ("tcp://10.0.0.1:7", "10.0.0.1:7"),
])
def test_client_targets(target: str, want: str) -> None:
    assert channel_target(target) == want


@pytest.mark.parametrize("target", ["", "unix://rel.sock", "http://x:1", "justahost"])
def test_bad_client_targets(target: str) -> None:
    with pytest.raises(InvalidArgument):
        channel_target(target)


def test_a_cuda_device_that_is_not_there_is_refused_at_start() -> None:
    from kvpoold.server.backing_select import make_backing_factory

    settings = resolve({"device": "cuda:99"}, None)
    with pytest.raises(InvalidArgument, match="CUDA devices") as info:
        make_backing_factory(settings)
    assert info.value.field == "device"


def test_client_token_file(tmp_path: Path) -> None:
    """``--token`` alone is used as is; ``--token-file`` wins and is stripped; a missing or
    blank file is an InvalidArgument on ``token_file`` (exit 2), not an OSError."""
    token = tmp_path / "token"
    token.write_text("  s3cret\n")
    assert token_from("inline", None) == "inline"
    assert token_from(None, None) is None
    assert token_from(None, token) == "s3cret"
    for bad, words in ((tmp_path / "absent", "cannot read"), (tmp_path / "blank", "empty")):
        if bad.name == "blank":
            bad.write_text(" \n")
        with pytest.raises(InvalidArgument, match=words) as info:
            token_from(None, bad)
        assert info.value.field == "token_file"



@pytest.mark.parametrize("listen", ["tcp://0.0.0.0:50051", "tcp://10.0.0.1:7", "tcp://[::]:9"])
def test_tcp_off_loopback_needs_a_token(listen: str) -> None:
    with pytest.raises(InvalidArgument, match="--allow-insecure-tcp") as e:
        serve_cli.settings_from_args(serve_args("--listen", listen))
    assert e.value.field == "listen"
    with_token = serve_cli.settings_from_args(serve_args("--listen", listen, "--token", "s3"))
    assert with_token.token == "s3"
    opted_out = serve_cli.settings_from_args(serve_args("--listen", listen,
                                                        "--allow-insecure-tcp"))
    assert opted_out.token is None


@pytest.mark.parametrize("listen", ["tcp://127.0.0.1:0", "tcp://localhost:5", "tcp://[::1]:5"])
def test_tcp_on_loopback_needs_no_token(listen: str) -> None:
    settings = serve_cli.settings_from_args(serve_args("--listen", listen))
    assert settings.listeners[0].transport == "tcp"


def test_insecure_token_settings_are_warned(tmp_path: Path) -> None:
    """An inline --token and a token on TCP off loopback without TLS start with warnings."""
    token_file = tmp_path / "token"
    token_file.write_text("s3cret\n")
    token_file.chmod(0o600)
    inline = serve_cli.settings_from_args(serve_args("--listen", "tcp://10.0.0.1:7",
                                                     "--token", "s3"))
    warnings = security_warnings(inline, token_inline=True)
    assert len(warnings) == 2
    assert "/proc/<pid>/cmdline" in warnings[0] and "--token-file" in warnings[0]
    assert warnings[1].startswith("tcp://10.0.0.1:7 has no TLS") and "--tls-cert" in warnings[1]
    from_file = serve_cli.settings_from_args(serve_args("--listen", "tcp://127.0.0.1:7",
                                                        "--token-file", str(token_file)))
    assert security_warnings(from_file, token_inline=False) == []


def test_the_daemon_logs_the_warning_at_start() -> None:
    with temp_dir() as d, run_daemon(d, "--token", "s3") as daemon:
        assert daemon.proc.poll() is None
        log = daemon.log.read_text()
        assert "every local user can read it in /proc/<pid>/cmdline" in log
        out = subprocess.run([sys.executable, "-m", "kvpool.tools.cli", "stats", "--json",
                              "--target", daemon.target, "--token", "s3"], env=subprocess_env(),
                             capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert "kvpool: warning: --token shows the secret" in out.stderr
