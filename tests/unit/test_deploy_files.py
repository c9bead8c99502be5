"""Deployment files (docker/, docs/operations.md): they parse and agree with the daemon and each
other.

No container engine runs on the development machines, so these checks are what keeps the
Dockerfiles, Compose file, Prometheus/Grafana provisioning and the Kubernetes DaemonSet honest:
flags against the real ``kvpoold serve --help``, the health probe against a real gRPC health
server, metric names and labels against the exporter's list, and the cross-references between
the files (service names, ports, paths, uid).
"""

from __future__ import annotations

import grp
import json
import os
import re
import shlex
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import time
import tomllib
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import grpc
import pytest
import yaml
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

ROOT = Path(__file__).resolve().parents[2]
DOCKER = ROOT / "docker"
DOCKERFILES = ("Dockerfile", "Dockerfile.cuda")
COMPOSE = DOCKER / "compose.yaml"
DAEMONSET = DOCKER / "k8s" / "daemonset.yaml"
DASHBOARD = DOCKER / "grafana" / "kvpool.json"
DATASOURCES = DOCKER / "grafana" / "provisioning" / "datasources" / "prometheus.yaml"
DASHBOARD_PROVIDER = DOCKER / "grafana" / "provisioning" / "dashboards" / "kvpool.yaml"
OPERATIONS = ROOT / "docs" / "operations.md"
ENV = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "client"), str(ROOT / "service")])}


def exported_metrics() -> dict[str, frozenset[str]]:
    """What the exporter serves: metric -> its labels (Prometheus adds instance and job), read
    from the metrics table of docs/operations.md, which tests/e2e/test_metrics.py checks against
    a real daemon's /metrics (names, types, labels). A histogram is its three series, a summary
    its two (``_sum``, ``_count``)."""
    rows = re.findall(r"^\| `(kvpool_[a-z0-9_]+)` \| (\w+) \| ([a-z, ]+) \|",
                      OPERATIONS.read_text(), flags=re.M)
    out: dict[str, frozenset[str]] = {}
    for name, kind, labels in rows:
        names = frozenset(x.strip() for x in labels.split(","))
        if kind == "histogram":
            out[f"{name}_bucket"] = names | {"le"}
            out[f"{name}_sum"] = out[f"{name}_count"] = names
        elif kind == "summary":
            out[f"{name}_sum"] = out[f"{name}_count"] = names
        else:
            out[name] = names
    return out


METRICS = exported_metrics()
TARGET_LABELS = frozenset({"instance", "job"})

_METRIC = re.compile(r"\bkvpool_[a-z0-9_]+")
_SELECTOR = re.compile(r"\b(kvpool_[a-z0-9_]+)\{([^}]*)\}")
_MATCHER = re.compile(r"([a-zA-Z_][a-zA-Z0-9_]*)\s*(?:=~|!~|!=|=)")
_BY = re.compile(r"\bby\s*\(([^)]*)\)")
_LEGEND = re.compile(r"\{\{\s*([a-zA-Z_][a-zA-Z0-9_]*)\s*\}\}")
_FLAG = re.compile(r"--[a-z][a-z0-9-]*")


# -- helpers ----------------------------------------------------------------------------------


def dockerfile_instructions(path: Path) -> list[tuple[str, str]]:
    """``(INSTRUCTION, arguments)`` pairs, continuation lines joined and comment lines dropped."""
    out: list[tuple[str, str]] = []
    pending = ""
    for raw in path.read_text().splitlines():
        line = raw.strip()
        if not line or line.startswith("#"):
            continue  # Docker drops comment lines, also inside a continuation
        if line.endswith("\\"):
            pending += line[:-1] + " "
            continue
        full = pending + line
        pending = ""
        instr, _, rest = full.partition(" ")
        out.append((instr.upper(), rest.strip()))
    assert not pending, f"{path.name}: dangling line continuation"
    return out


def instruction(path: Path, name: str) -> list[str]:
    return [rest for instr, rest in dockerfile_instructions(path) if instr == name]


def exec_form(path: Path, name: str) -> list[str]:
    """The single exec-form (JSON array) ``name`` instruction of a Dockerfile."""
    found = instruction(path, name)
    assert len(found) == 1, f"{path.name}: expected one {name}, found {len(found)}"
    value = json.loads(found[0])
    assert isinstance(value, list) and all(isinstance(x, str) for x in value)
    return value


def healthcheck_command(path: Path) -> list[str]:
    found = instruction(path, "HEALTHCHECK")
    assert len(found) == 1, f"{path.name}: expected one HEALTHCHECK"
    _options, sep, command = found[0].partition(" CMD ")
    assert sep, f"{path.name}: HEALTHCHECK without CMD"
    return json.loads(command)


def env_of(path: Path) -> dict[str, str]:
    """The ``ENV key=value`` settings of a Dockerfile (values without spaces, as ours are)."""
    env: dict[str, str] = {}
    for rest in instruction(path, "ENV"):
        for item in shlex.split(rest):
            key, _, value = item.partition("=")
            env[key] = value
    return env


def flag_values(args: list[str]) -> dict[str, list[str]]:
    """``["--listen", "a", "--listen", "b", "--device", "c"]`` -> ``{"--listen": ["a", "b"], ...}``.

    Every flag we pass takes a value (``--x=v`` is accepted too); a value without a flag before
    it fails the test, since argparse would reject it as well.
    """
    out: dict[str, list[str]] = {}
    it = iter(args)
    for token in it:
        assert token.startswith("--"), f"argument {token!r} is not a flag"
        name, eq, value = token.partition("=")
        if not eq:
            value = next(it, None)
            assert value is not None and not value.startswith("--"), f"{name} has no value"
        out.setdefault(name, []).append(value)
    return out


def compose() -> dict[str, Any]:
    return yaml.safe_load(COMPOSE.read_text())


def daemonset_docs(text: str | None = None) -> list[dict[str, Any]]:
    return [d for d in yaml.safe_load_all(DAEMONSET.read_text() if text is None else text) if d]


def the_daemonset(docs: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    found = [d for d in (docs or daemonset_docs()) if d["kind"] == "DaemonSet"]
    assert len(found) == 1
    return found[0]


def kvpoold_container(ds: dict[str, Any]) -> dict[str, Any]:
    containers = ds["spec"]["template"]["spec"]["containers"]
    found = [c for c in containers if c["name"] == "kvpoold"]
    assert len(found) == 1, "the DaemonSet needs one container named kvpoold"
    return found[0]


def unix_listen_paths(args: list[str]) -> list[str]:
    return [v[len("unix://"):] for v in flag_values(args).get("--listen", [])
            if v.startswith("unix://")]


def serve_sources() -> dict[str, list[str]]:
    """Every ``kvpoold serve`` argument list in the deployment files, by where it comes from."""
    compose_cmd = compose()["services"]["kvpoold"]["command"]
    return {
        **{f"docker/{name} CMD": exec_form(DOCKER / name, "CMD") for name in DOCKERFILES},
        "docker/compose.yaml kvpoold.command": [str(x) for x in compose_cmd],
        "docker/k8s/daemonset.yaml kvpoold.args": [str(x) for x in
                                                   kvpoold_container(the_daemonset())["args"]],
    }


def compose_bytes(text: str) -> int:
    """Compose byte values (``shm_size: 3gb``): b, k, m, g suffixes, powers of 1024."""
    match = re.fullmatch(r"([0-9]+)\s*([bkmg]?)b?", str(text).strip().lower())
    assert match, f"cannot read compose size {text!r}"
    return int(match[1]) * 1024 ** "bkmg".index(match[2] or "b")


def compose_seconds(text: str) -> float:
    match = re.fullmatch(r"([0-9.]+)(ms|s|m)", str(text).strip())
    assert match, f"cannot read compose duration {text!r}"
    return float(match[1]) * {"ms": 0.001, "s": 1.0, "m": 60.0}[match[2]]


def promql_exprs_in_dashboard(dash: dict[str, Any]) -> list[str]:
    return [t["expr"] for p in dash["panels"] for t in p.get("targets", [])]


def check_promql(expr: str) -> list[str]:
    """Problems with one PromQL expression against METRICS; empty when it is fine."""
    problems: list[str] = []
    names = set(_METRIC.findall(expr))
    unknown = names - METRICS.keys()
    if unknown:
        problems.append(f"unknown metrics {sorted(unknown)} in {expr!r}")
    for name, matchers in _SELECTOR.findall(expr):
        labels = set(_MATCHER.findall(matchers))
        extra = labels - METRICS.get(name, frozenset()) - TARGET_LABELS
        if extra:
            problems.append(f"{name} has no labels {sorted(extra)} (in {expr!r})")
    available = set().union(*(METRICS.get(n, frozenset()) for n in names)) | TARGET_LABELS
    for group in _BY.findall(expr):
        labels = {x.strip() for x in group.split(",") if x.strip()}
        if labels - available:
            problems.append(f"by ({group}) names labels none of {sorted(names)} has")
    if "unit" in available:  # ids of several units: a sum must keep them apart
        for group in _BY.findall(expr):
            kept = {x.strip() for x in group.split(",")}
            if not kept & {"unit", "space"}:
                problems.append(f"by ({group}) adds ids of different units: keep unit")
    if "histogram_quantile" in expr:
        if not any("le" in {x.strip() for x in g.split(",")} for g in _BY.findall(expr)):
            problems.append(f"histogram_quantile without `by (le, ...)`: {expr!r}")
        if not any(n.endswith("_bucket") for n in names):
            problems.append(f"histogram_quantile over a non-histogram: {expr!r}")
    return problems


def result_labels(expr: str) -> set[str]:
    """Labels of the series an expression returns: its outer ``by (...)``, else its metrics'."""
    groups = _BY.findall(expr)
    if groups:
        return {x.strip() for x in groups[0].split(",") if x.strip()} - {"le"}
    names = set(_METRIC.findall(expr))
    return set().union(*(METRICS.get(n, frozenset()) for n in names)) | TARGET_LABELS


def yaml_blocks(markdown: str) -> list[str]:
    return re.findall(r"```yaml\n(.*?)```", markdown, flags=re.S)


def shell_commands(markdown: str, prefix: str) -> list[list[str]]:
    """Commands starting with ``prefix`` in the ``sh`` blocks of ``markdown`` (lines joined)."""
    commands: list[list[str]] = []
    for block in re.findall(r"```sh\n(.*?)```", markdown, flags=re.S):
        joined = block.replace("\\\n", " ")
        for line in joined.splitlines():
            line = line.split(" #", 1)[0].strip()
            if line.startswith(prefix):
                commands.append(shlex.split(line)[len(shlex.split(prefix)):])
    return commands


def kvpoold_help(*argv: str) -> str:
    """``kvpoold <argv> --help`` from a separate process (the real parser, nothing mocked)."""
    proc = subprocess.run([sys.executable, "-m", "kvpoold.main", *argv, "--help"], cwd=ROOT,
                          env=ENV, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    return proc.stdout


@pytest.fixture(scope="module")
def serve_help() -> str:
    """``kvpoold serve --help`` from a separate process (the real parser, nothing mocked)."""
    return kvpoold_help("serve")


def help_flags(text: str) -> set[str]:
    return set(_FLAG.findall(text))


def help_choices(text: str) -> dict[str, set[str]]:
    """``--log-format {text,json}`` in the help text -> ``{"--log-format": {"text", "json"}}``."""
    return {flag: set(choices.split(","))
            for flag, choices in re.findall(r"(--[a-z0-9-]+)[ =]\{([^}]+)\}", text)}


# -- files parse ------------------------------------------------------------------------------


def test_every_yaml_and_json_file_parses() -> None:
    yamls = sorted([*DOCKER.rglob("*.yaml"), *DOCKER.rglob("*.yml")])
    jsons = sorted(DOCKER.rglob("*.json"))
    names = {p.relative_to(DOCKER).as_posix() for p in [*yamls, *jsons]}
    assert {"compose.yaml", "prometheus.yml", "k8s/daemonset.yaml", "grafana/kvpool.json",
            "grafana/provisioning/datasources/prometheus.yaml",
            "grafana/provisioning/dashboards/kvpool.yaml"} <= names
    for path in yamls:
        docs = [d for d in yaml.safe_load_all(path.read_text()) if d is not None]
        assert docs and all(isinstance(d, dict) for d in docs), path
    for path in jsons:
        assert isinstance(json.loads(path.read_text()), dict), path


def test_example_config_loads_with_the_daemons_loader() -> None:
    """docker/kvpoold.toml goes through kvpoold.settings (msgspec, unknown keys refused)."""
    from kvpoold.settings import ServeConfig, load_config, resolve

    raw = tomllib.loads((DOCKER / "kvpoold.toml").read_text())
    assert set(raw) <= set(ServeConfig.__struct_fields__)
    settings = resolve({}, load_config(DOCKER / "kvpoold.toml"))
    assert [x.grpc_address for x in settings.listeners] == ["unix:///run/kvpool/kvpool.sock"]
    assert settings.device == "cpu"
    assert settings.budget_bytes == 2 * 1024**3  # "2GiB"
    assert settings.socket_group == "kvpool"
    assert settings.log_format == "json"


# -- Dockerfiles ------------------------------------------------------------------------------


@pytest.mark.parametrize("name", DOCKERFILES)
def test_dockerfile_runs_kvpoold_serve_as_numeric_non_root_user(name: str) -> None:
    path = DOCKER / name
    assert exec_form(path, "ENTRYPOINT") == ["kvpoold", "serve"]
    users = instruction(path, "USER")
    assert users == ["10001:10001"], "a numeric uid, so Kubernetes' runAsNonRoot can check it"
    run = " ".join(instruction(path, "RUN"))
    assert "--uid 10001" in run and "--gid 10001" in run
    assert "chown kvpool:kvpool /run/kvpool" in run
    cmd = exec_form(path, "CMD")
    sockets = unix_listen_paths(cmd)
    assert sockets == [env_of(path)["KVPOOL_SOCKET"]], "the health check probes the served socket"
    assert all(Path(s).parent == Path("/run/kvpool") for s in sockets)


@pytest.mark.parametrize("name", DOCKERFILES)
def test_dockerfile_copies_what_pip_install_needs(name: str) -> None:
    """COPY sources exist and the context's .dockerignore lets each one through."""
    path = DOCKER / name
    copies = [shlex.split(x) for x in instruction(path, "COPY")]
    sources = [src for parts in copies for src in parts[:-1] if not src.startswith("--")]
    assert {"pyproject.toml", "client", "service"} <= set(sources)
    readme = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"].get("readme")
    if readme:
        assert readme in sources, "setuptools reads the readme named in pyproject.toml"
    for src in sources:
        assert (ROOT / src).exists(), f"{name}: COPY {src}: no such path in the repository"
    ignore = (DOCKER / f"{name}.dockerignore").read_text().splitlines()
    allowed = {line[1:].rstrip("/") for line in ignore if line.startswith("!")}
    assert "*" in ignore and set(sources) <= allowed
    install = [x for x in instruction(path, "RUN") if "pip install" in x]
    # the daemon's extra: torch, prometheus-client and reflection come with it
    assert any('pip install ".[server]"' in x for x in install)
    # pure Python: no compiler in the image
    assert not any(re.search(r"\bgcc\b", x) for x in instruction(path, "RUN"))
    # torch first, from an explicit index: a bare `pip install .` would pick the CUDA build
    torch_step = next(i for i, x in enumerate(install) if "torch==" in x)
    assert re.search(r'--index-url "?https://download\.pytorch\.org/whl/', install[torch_step])
    assert torch_step < next(i for i, x in enumerate(install) if 'pip install ".[server]"' in x)


def test_cpu_image_uses_slim_python_and_the_cpu_torch_wheel() -> None:
    path = DOCKER / "Dockerfile"
    assert instruction(path, "FROM") == ["python:3.11-slim"]
    text = " ".join(instruction(path, "RUN"))
    assert "https://download.pytorch.org/whl/cpu" in text
    assert env_of(path)["KVPOOL_SOCKET"] == "/run/kvpool/kvpool.sock"
    assert flag_values(exec_form(path, "CMD"))["--device"] == ["cpu"]


def test_cuda_image_base_and_no_expandable_segments() -> None:
    path = DOCKER / "Dockerfile.cuda"
    (base,) = instruction(path, "FROM")
    assert base.startswith("nvidia/cuda:12.")
    args = {k: v for k, _, v in (a.partition("=") for a in instruction(path, "ARG"))}
    cuda_version = re.match(r"nvidia/cuda:12\.(\d+)", base)
    assert cuda_version and args["CUDA_TAG"] == f"cu12{cuda_version[1]}", \
        "the torch wheel's CUDA version follows the base image's"
    env = env_of(path)
    assert "expandable_segments:True" not in env.get("PYTORCH_CUDA_ALLOC_CONF", "")
    assert not [rest for _, rest in dockerfile_instructions(path) if "expandable_segments" in rest]
    assert env["CUDA_DEVICE_ORDER"] == "PCI_BUS_ID"
    assert flag_values(exec_form(path, "CMD"))["--device"] == ["cuda:0"]


# -- flags against the real `kvpoold serve --help` ----------------------------------------------


def test_every_serve_flag_in_the_deployment_files_exists(serve_help: str) -> None:
    known = help_flags(serve_help)
    choices = help_choices(serve_help)
    assert "--listen" in known and "--device" in known, "unexpected help text:\n" + serve_help
    for where, args in serve_sources().items():
        for flag, values in flag_values(args).items():
            assert flag in known, f"{where}: {flag} is not a `kvpoold serve` flag"
            if flag in choices:
                assert set(values) <= choices[flag], f"{where}: {flag} {values} not in {choices}"


def test_metrics_flags_exist_and_scraped_deployments_bind_every_interface(
        serve_help: str) -> None:
    """Compose and the DaemonSet are scraped from outside the container, so they bind metrics
    on 0.0.0.0 (the daemon's default is 127.0.0.1); the images' CMD serves no metrics."""
    assert {"--metrics-port", "--metrics-host"} <= help_flags(serve_help)
    for where, args in serve_sources().items():
        values = flag_values(args)
        if where.endswith(" CMD"):
            assert "--metrics-port" not in values, where
        else:
            assert values["--metrics-port"] == ["9490"], where
            assert values["--metrics-host"] == ["0.0.0.0"], where


def test_serve_arguments_resolve_to_valid_settings() -> None:
    """Values, not just names: each argument list goes through kvpoold.settings.resolve.

    A cuda fraction is resolved against a fake 80 GiB free: ``0.5`` -> 42,949,672,960 B.
    """
    from kvpoold.settings import resolve

    expected_budget = {"docker/Dockerfile CMD": 2 * 1024**3,
                       "docker/Dockerfile.cuda CMD": 40 * 1024**3,  # 0.5 of 80 GiB
                       "docker/compose.yaml kvpoold.command": 2 * 1024**3,
                       "docker/k8s/daemonset.yaml kvpoold.args": 40 * 1024**3}
    for where, args in serve_sources().items():
        values = flag_values(args)
        flags = {k[2:].replace("-", "_"): (v if k == "--listen" else v[-1])
                 for k, v in values.items()}
        settings = resolve(flags, None, free_bytes=lambda _device: 80 * 1024**3)
        assert settings.budget_bytes == expected_budget[where], where
        if "--metrics-port" in values:
            assert (settings.metrics_host, settings.metrics_port) == ("0.0.0.0", 9490), where
        assert settings.socket_group == "kvpool", where
        assert [x.transport for x in settings.listeners] == ["unix"], where


def test_operations_doc_commands_use_real_flags(serve_help: str) -> None:
    ops = OPERATIONS.read_text()
    known = help_flags(serve_help)
    serve_cmds = shell_commands(ops, "kvpoold serve")
    assert serve_cmds
    table_flags = set(re.findall(r"^\| `(--[a-z0-9-]+)", ops, flags=re.M))
    table_flags |= set(re.findall(r"^\| `--[a-z0-9-]+[^|]*`, `(--[a-z0-9-]+)`", ops, flags=re.M))
    assert {"--listen", "--device", "--budget", "--token-file"} <= table_flags
    used = {f for cmd in serve_cmds for f in flag_values(cmd)} | table_flags
    for flag in sorted(used):
        assert flag in known, f"docs/operations.md: {flag} is not a `kvpoold serve` flag"
    plan_known = help_flags(kvpoold_help("plan"))
    for cmd in shell_commands(ops, "kvpoold plan"):
        for flag in flag_values(cmd):
            assert flag in plan_known, f"docs/operations.md: {flag} is not a `kvpoold plan` flag"


def test_every_serve_flag_is_documented(serve_help: str) -> None:
    """The other direction: each ``kvpoold serve`` flag is in the operations guide's flag table
    and in docs/api.md's daemon section, and each config key is in docker/kvpoold.toml
    (commented out counts: the example shows it)."""
    from kvpoold.settings import ServeConfig

    flags = help_flags(serve_help) - {"--help"}
    assert {"--sharing", "--shm-preallocate", "--metrics-port"} <= flags
    ops = OPERATIONS.read_text()
    api = (ROOT / "docs" / "api.md").read_text().split("## The daemon", 1)[1]

    def mentions(text: str, flag: str) -> bool:
        return re.search(re.escape(flag) + r"(?![a-z-])", text) is not None

    assert not [f for f in sorted(flags) if not mentions(ops, f)], "docs/operations.md"
    assert not [f for f in sorted(flags) if not mentions(api, f)], "docs/api.md"
    toml = (DOCKER / "kvpoold.toml").read_text()
    keys = set(re.findall(r"^#? ?([a-z_]+) = ", toml, flags=re.M))
    assert set(ServeConfig.__struct_fields__) <= keys, "docker/kvpoold.toml"
    assert {k.replace("_", "-") for k in ServeConfig.__struct_fields__} | {"token", "config"} == {
        f[2:] for f in flags}, "a config key for every flag but --token and --config"


# -- the health check ----------------------------------------------------------------------------


@pytest.fixture
def health_server() -> Iterator[tuple[str, health.HealthServicer]]:
    """A real grpc.health.v1 server on a temporary Unix socket (short path: sun_path is 108 B)."""
    workdir = tempfile.mkdtemp(prefix="kvph", dir="/tmp")
    socket_path = os.path.join(workdir, "h.sock")
    server = grpc.server(ThreadPoolExecutor(max_workers=2))
    servicer = health.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
    server.add_insecure_port(f"unix:{socket_path}")
    server.start()
    try:
        yield socket_path, servicer
    finally:
        server.stop(None).wait()
        if os.path.exists(socket_path):
            os.unlink(socket_path)
        os.rmdir(workdir)


def run_probe(command: list[str], socket_path: str) -> int:
    assert command[0] == "python"
    proc = subprocess.run([sys.executable, *command[1:]], env={**ENV, "KVPOOL_SOCKET": socket_path},
                          capture_output=True, timeout=30)
    return proc.returncode


def test_healthcheck_probe_follows_the_health_service(
        health_server: tuple[str, health.HealthServicer]) -> None:
    """The Dockerfiles' HEALTHCHECK command, run as is: 0 when SERVING, 1 otherwise."""
    socket_path, servicer = health_server
    commands = [healthcheck_command(DOCKER / name) for name in DOCKERFILES]
    assert commands[0] == commands[1]
    probe = commands[0]
    servicer.set("", health_pb2.HealthCheckResponse.SERVING)
    assert run_probe(probe, socket_path) == 0
    servicer.set("", health_pb2.HealthCheckResponse.NOT_SERVING)
    assert run_probe(probe, socket_path) == 1
    missing = socket_path + ".absent"
    assert run_probe(probe, missing) != 0



def test_healthcheck_probe_against_a_real_kvpoold() -> None:
    """The CPU image's CMD, run as ``kvpoold serve`` with the socket and shm dir moved to a temp
    dir and the socket group swapped for one this machine has: the HEALTHCHECK reports it healthy
    once it serves, and SIGTERM stops it with exit 0 and removes the socket."""
    path = DOCKER / "Dockerfile"
    probe = healthcheck_command(path)
    workdir = tempfile.mkdtemp(prefix="kvpd", dir="/tmp")
    socket_path = os.path.join(workdir, "kvpool.sock")
    args = exec_form(path, "CMD")
    values = flag_values(args)
    args = [a.replace(values["--listen"][0], f"unix://{socket_path}") for a in args]
    args[args.index("--socket-group") + 1] = grp.getgrgid(os.getgid()).gr_name
    proc = subprocess.Popen([sys.executable, "-m", "kvpoold.main", "serve", *args,
                             "--shm-dir", workdir], cwd=ROOT, env=ENV,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        deadline = time.monotonic() + 30
        while not os.path.exists(socket_path) and proc.poll() is None:  # importing torch
            assert time.monotonic() < deadline, "kvpoold never created its socket"
            time.sleep(0.05)
        while run_probe(probe, socket_path) != 0:
            assert proc.poll() is None, proc.stderr.read().decode() if proc.stderr else ""
            assert time.monotonic() < deadline, "kvpoold never became healthy"
            time.sleep(0.2)
        assert stat.S_IMODE(os.stat(socket_path).st_mode) == 0o660  # --socket-group
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 0
        assert not os.path.exists(socket_path)
        assert run_probe(probe, socket_path) != 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        shutil.rmtree(workdir, ignore_errors=True)

def test_daemonset_probes_are_the_image_healthcheck() -> None:
    container = kvpoold_container(the_daemonset())
    probe = healthcheck_command(DOCKER / "Dockerfile.cuda")
    for kind in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert container[kind]["exec"]["command"] == probe, kind
        assert container[kind]["timeoutSeconds"] >= 4, "the probe's own RPC timeout is 3 s"


# -- Compose, Prometheus, Grafana --------------------------------------------------------------


def test_compose_prometheus_and_grafana_agree() -> None:
    services = compose()["services"]
    assert {"kvpoold", "prometheus", "grafana"} <= services.keys()
    kvpoold = services["kvpoold"]
    assert (DOCKER / kvpoold["build"]["context"] / kvpoold["build"]["dockerfile"]).resolve() == \
        (DOCKER / "Dockerfile").resolve()
    metrics_port = flag_values([str(x) for x in kvpoold["command"]])["--metrics-port"]
    scrape = yaml.safe_load((DOCKER / "prometheus.yml").read_text())["scrape_configs"]
    targets = [t for job in scrape for sc in job["static_configs"] for t in sc["targets"]]
    assert targets == [f"kvpoold:{metrics_port[0]}"]
    assert all(job.get("metrics_path", "/metrics") == "/metrics" for job in scrape)

    prom_mounts = dict(v.split(":")[:2] for v in services["prometheus"]["volumes"])
    config_target = next(a.split("=", 1)[1] for a in services["prometheus"]["command"]
                         if a.startswith("--config.file="))
    assert prom_mounts["./prometheus.yml"] == config_target

    (source,) = yaml.safe_load(DATASOURCES.read_text())["datasources"]
    assert source["type"] == "prometheus"
    assert re.fullmatch(r"http://prometheus:9090/?", source["url"])
    dash = json.loads(DASHBOARD.read_text())
    refs = [p["datasource"] for p in dash["panels"] if p["type"] != "row"]
    refs += [t["datasource"] for p in dash["panels"] for t in p.get("targets", [])]
    refs += [v["datasource"] for v in dash["templating"]["list"]]
    assert refs and all(r == {"type": "prometheus", "uid": source["uid"]} for r in refs)

    grafana_mounts = dict(v.split(":")[:2] for v in services["grafana"]["volumes"])
    (provider,) = yaml.safe_load(DASHBOARD_PROVIDER.read_text())["providers"]
    dashboard_target = grafana_mounts["./grafana/kvpool.json"]
    assert Path(dashboard_target).parent == Path(provider["options"]["path"])
    assert grafana_mounts["./grafana/provisioning"] == "/etc/grafana/provisioning"


def test_compose_bind_mounts_exist_and_socket_is_shared() -> None:
    services = compose()["services"]
    volumes = compose()["volumes"]
    for name, service in services.items():
        for spec in service.get("volumes", []):
            source = spec.split(":")[0]
            if source.startswith((".", "/")):
                assert (DOCKER / source).exists(), f"{name}: bind mount {source} does not exist"
            else:
                assert source in volumes, f"{name}: named volume {source} is not declared"
    kvpoold = services["kvpoold"]
    command = [str(x) for x in kvpoold["command"]]
    (socket_path,) = unix_listen_paths(command)
    assert kvpoold["environment"]["KVPOOL_SOCKET"] == socket_path
    socket_volume = next(v.split(":")[0] for v in kvpoold["volumes"]
                         if v.split(":")[1] == str(Path(socket_path).parent))
    assert socket_volume in volumes, "a named volume, seeded with the image's 10001-owned dir"
    cli = services["kvpool"]
    assert f"{socket_volume}:{Path(socket_path).parent}" in cli["volumes"]
    assert f"unix://{socket_path}" in cli["command"]
    assert cli["ipc"] == "service:kvpoold" and kvpoold["ipc"] == "shareable"


def test_compose_shm_holds_the_budget_and_grace_covers_the_drain() -> None:
    """CPU pools are /dev/shm files: shm_size must exceed the budget (3 GiB > 2 GiB)."""
    from kvpool.contract.sizes import parse_size
    from kvpoold.settings import resolve

    kvpoold = compose()["services"]["kvpoold"]
    values = flag_values([str(x) for x in kvpoold["command"]])
    assert values["--device"] == ["cpu"]
    assert compose_bytes(kvpoold["shm_size"]) > parse_size(values["--budget"][-1])
    grace = compose_seconds(kvpoold["stop_grace_period"])
    ds = the_daemonset()
    ds_grace = ds["spec"]["template"]["spec"]["terminationGracePeriodSeconds"]
    assert grace == ds_grace
    for args in (kvpoold["command"], kvpoold_container(ds)["args"]):
        flags = {k[2:].replace("-", "_"): v[-1] for k, v in flag_values(
            [str(x) for x in args]).items() if k != "--listen"}
        drain = resolve(flags, None, free_bytes=lambda _device: 1 << 40).grace_seconds
        assert grace >= drain + 10, "room to release pools after the drain"


def test_compose_cli_flags_exist() -> None:
    """The `kvpool` tools service runs `kvpool stats --target ...`; check against its help."""
    proc = subprocess.run([sys.executable, "-m", "kvpool.tools.cli", "stats", "--help"], cwd=ROOT,
                          env=ENV, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    service = compose()["services"]["kvpool"]
    assert service["entrypoint"] == ["kvpool"]
    command = service["command"]
    assert command[0] == "stats"
    for flag in _FLAG.findall(" ".join(command[1:])):
        assert flag in proc.stdout, f"compose kvpool service: {flag} not in `kvpool stats --help`"


# -- the dashboard ------------------------------------------------------------------------------


def test_dashboard_metrics_and_labels_are_the_exporters() -> None:
    dash = json.loads(DASHBOARD.read_text())
    exprs = promql_exprs_in_dashboard(dash)
    problems = [p for e in exprs for p in check_promql(e)]
    assert not problems, "\n".join(problems)
    used = {m for e in exprs for m in _METRIC.findall(e)}
    assert used <= METRICS.keys()
    # usage per pool, leases, RPC latency and failures, budget vs used (the panels)
    assert {"kvpool_pool_used", "kvpool_pool_capacity", "kvpool_leases_open",
            "kvpool_lease_expiries_total", "kvpool_rpc_duration_seconds_bucket",
            "kvpool_rpc_failures_total", "kvpool_device_budget_bytes",
            "kvpool_device_used_bytes"} <= used
    # elastic pools: granted vs backed vs virtual, groups by state, grants and reclaims, reclaim
    # latency from the summary's sum and count, revoked leases
    assert {"kvpool_elastic_granted_bytes", "kvpool_elastic_backed_bytes",
            "kvpool_elastic_virtual_bytes", "kvpool_elastic_groups",
            "kvpool_elastic_grants_total", "kvpool_elastic_reclaims_total",
            "kvpool_elastic_reclaim_seconds_sum", "kvpool_elastic_reclaim_seconds_count",
            "kvpool_elastic_revoked_leases_total"} <= used
    quantiles = {q for e in exprs for q in re.findall(r"histogram_quantile\(([0-9.]+)", e)}
    assert {"0.5", "0.99"} <= quantiles


def test_dashboard_legends_and_variables_name_real_labels() -> None:
    dash = json.loads(DASHBOARD.read_text())
    for panel in dash["panels"]:
        for target in panel.get("targets", []):
            legend = set(_LEGEND.findall(target.get("legendFormat", "")))
            missing = legend - result_labels(target["expr"])
            assert not missing, f"{panel['title']!r}: legend uses {missing} the query drops"
    variables = {v["name"] for v in dash["templating"]["list"]}
    for var in dash["templating"]["list"]:
        query = var["query"]["query"] if isinstance(var["query"], dict) else var["query"]
        match = re.fullmatch(r"label_values\((kvpool_[a-z0-9_]+)(\{[^}]*\})?,\s*(\w+)\)", query)
        assert match, query
        assert match[3] in METRICS[match[1]] | TARGET_LABELS, query
        assert not check_promql(f"{match[1]}{match[2] or ''}"), query
    for expr in promql_exprs_in_dashboard(dash):
        for var in re.findall(r"\$([a-z_]+)", expr):
            assert var in variables or var.startswith("__"), f"${var} is not a dashboard variable"


def test_dashboard_layout_is_well_formed() -> None:
    dash = json.loads(DASHBOARD.read_text())
    assert dash["uid"] == "kvpool"
    assert "dashboard" not in dash, "file provisioning wants the bare dashboard model"
    ids = [p["id"] for p in dash["panels"]]
    assert len(ids) == len(set(ids))
    for panel in dash["panels"]:
        pos = panel["gridPos"]
        assert pos["x"] >= 0 and pos["x"] + pos["w"] <= 24, panel["title"]
        if panel["type"] != "row":
            assert panel["targets"], panel["title"]
            ref_ids = [t["refId"] for t in panel["targets"]]
            assert len(ref_ids) == len(set(ref_ids)), panel["title"]


def test_check_promql_catches_mistakes() -> None:
    """The checker itself: each of these is a real dashboard bug it must report."""
    assert check_promql("kvpool_pool_used / kvpool_pool_capacity") == []
    assert check_promql("kvpool_pool_usage")  # no such metric
    assert check_promql('kvpool_pool_bytes{kind="kv"}')  # pool_bytes has no kind
    assert check_promql("sum by (pool) (rate(kvpool_rpc_failures_total[5m]))")  # no pool label
    assert check_promql("sum by (pool) (kvpool_pool_used)")  # pages + rows
    assert check_promql("sum by (pool, unit) (kvpool_pool_used)") == []
    assert check_promql(  # quantile without le: one bucket set per method collapses
        "histogram_quantile(0.99, sum by (method) (rate(kvpool_rpc_duration_seconds_bucket[5m])))")


# -- Kubernetes ---------------------------------------------------------------------------------


def test_daemonset_shares_ipc_pid_and_the_socket_directory() -> None:
    ds = the_daemonset()
    pod = ds["spec"]["template"]["spec"]
    container = kvpoold_container(ds)
    assert pod["hostIPC"] is True and pod["hostPID"] is True
    assert pod.get("hostNetwork") is not True, "each GPU's pod serves metrics on its own IP"
    security = container["securityContext"]
    assert security["runAsNonRoot"] is True
    assert security["allowPrivilegeEscalation"] is False
    assert security["capabilities"]["drop"] == ["ALL"]
    user = instruction(DOCKER / "Dockerfile.cuda", "USER")[0]
    assert f"{security['runAsUser']}:{security['runAsGroup']}" == user

    args = [str(x) for x in container["args"]]
    (socket_path,) = unix_listen_paths(args)
    env = {e["name"]: e["value"] for e in container["env"]}
    assert env["KVPOOL_SOCKET"] == socket_path
    host_paths = {v["name"]: v["hostPath"]["path"] for v in pod["volumes"] if "hostPath" in v}
    mounts = {m["mountPath"]: m["name"] for m in container["volumeMounts"]}
    socket_dir = str(Path(socket_path).parent)
    assert host_paths[mounts[socket_dir]] == "/run/kvpool"
    # the init container that hands the hostPath dir to uid 10001 mounts the same volume
    (init,) = pod["initContainers"]
    assert any(m["name"] == mounts[socket_dir] for m in init["volumeMounts"])
    assert f"chown {security['runAsUser']}:{security['runAsGroup']}" in " ".join(init["command"])

    assert "nvidia.com/gpu" not in json.dumps(container.get("resources", {})), \
        "a GPU request would make the GPU exclusive to kvpoold (docker/k8s/README.md)"
    assert env["NVIDIA_VISIBLE_DEVICES"] == "all" and env["CUDA_DEVICE_ORDER"] == "PCI_BUS_ID"
    assert "expandable_segments" not in env.get("PYTORCH_CUDA_ALLOC_CONF", "")


def test_daemonset_scrape_annotations_match_the_metrics_port() -> None:
    ds = the_daemonset()
    annotations = ds["spec"]["template"]["metadata"]["annotations"]
    container = kvpoold_container(ds)
    (port,) = flag_values([str(x) for x in container["args"]])["--metrics-port"]
    assert annotations["prometheus.io/scrape"] == "true"
    assert annotations["prometheus.io/port"] == port
    assert annotations.get("prometheus.io/path", "/metrics") == "/metrics"
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert ports["metrics"] == int(port)


def test_daemonset_schedules_on_gpu_nodes_only() -> None:
    ds = the_daemonset()
    terms = ds["spec"]["template"]["spec"]["affinity"]["nodeAffinity"][
        "requiredDuringSchedulingIgnoredDuringExecution"]["nodeSelectorTerms"]
    (term,) = terms
    exprs = {e["key"]: e for e in term["matchExpressions"]}
    assert exprs["nvidia.com/gpu.present"]["operator"] == "In"
    assert exprs["nvidia.com/gpu.present"]["values"] == ["true"]
    assert exprs["nvidia.com/gpu.count"]["operator"] == "Gt"


def generated_daemonsets() -> list[dict[str, Any]]:
    """Run the per-GPU generator loop from daemonset.yaml's header (without kubectl)."""
    header = re.search(r"^#   (for i in .*?)^#   done", DAEMONSET.read_text(), flags=re.S | re.M)
    assert header, "the generator loop is missing from the header"
    script = re.sub(r"^#   ", "", header[1], flags=re.M) + "done\n"
    proc = subprocess.run(["bash", "-c", script], cwd=ROOT, capture_output=True, text=True,
                          timeout=30)
    assert proc.returncode == 0, proc.stderr
    return [d for d in daemonset_docs(proc.stdout) if d["kind"] == "DaemonSet"]


def test_daemonset_generator_makes_one_consistent_daemonset_per_gpu() -> None:
    """GPU i: name kvpoold-gpu<i>, --device cuda:i, socket cuda<i>.sock, nodes with count > i."""
    sets = generated_daemonsets()
    assert len(sets) == 8
    sockets = set()
    for i, ds in enumerate(sets):
        assert ds["metadata"]["name"] == f"kvpoold-gpu{i}"
        template = ds["spec"]["template"]
        labels = template["metadata"]["labels"]
        assert ds["spec"]["selector"]["matchLabels"].items() <= labels.items()
        assert template["metadata"]["labels"]["kvpool.io/gpu-index"] == str(i)
        container = kvpoold_container(ds)
        values = flag_values([str(x) for x in container["args"]])
        assert values["--device"] == [f"cuda:{i}"]
        (socket_path,) = unix_listen_paths([str(x) for x in container["args"]])
        assert socket_path == f"/run/kvpool/cuda{i}.sock"
        env = {e["name"]: e["value"] for e in container["env"]}
        assert env["KVPOOL_SOCKET"] == socket_path
        count = next(e for t in template["spec"]["affinity"]["nodeAffinity"][
            "requiredDuringSchedulingIgnoredDuringExecution"]["nodeSelectorTerms"]
            for e in t["matchExpressions"] if e["key"] == "nvidia.com/gpu.count")
        assert count["values"] == [str(i)], "GPU i exists only where count > i"
        sockets.add(socket_path)
    assert len(sockets) == 8
    # the file itself is the i = 0 output
    assert sets[0] == the_daemonset()


# -- docs/operations.md -------------------------------------------------------------------------


def test_operations_alert_rules_parse_and_use_real_metrics() -> None:
    (rules_text,) = [b for b in yaml_blocks(OPERATIONS.read_text()) if "groups:" in b]
    groups = yaml.safe_load(rules_text)["groups"]
    rules = [r for g in groups for r in g["rules"]]
    alerts = {r["alert"] for r in rules}
    assert {"KVPoolAlmostFull", "KVPoolLeaseExpiries", "KVPoolSlowRPCs"} <= alerts
    assert {"KVPoolElasticBackedOverGranted", "KVPoolElasticSlowReclaims",
            "KVPoolElasticLeasesRevoked"} <= alerts
    for rule in rules:
        problems = check_promql(rule["expr"])
        assert not problems, f"{rule['alert']}: {problems}"
        assert _METRIC.search(rule["expr"]), rule["alert"]
        for text in rule.get("annotations", {}).values():
            for label in re.findall(r"\$labels\.([a-z_]+)", text):
                assert label in result_labels(rule["expr"]), f"{rule['alert']}: {label}"


def test_the_metrics_table_parses() -> None:
    """METRICS comes from docs/operations.md's table: a table the regex stopped matching would
    make every PromQL check here pass vacuously."""
    assert len(METRICS) >= 20
    assert METRICS["kvpool_pool_used"] == {"device", "pool", "space", "unit"}
    assert METRICS["kvpool_allocation_refusals_total"] == {"device", "pool", "space"}
    assert METRICS["kvpool_rpc_duration_seconds_bucket"] == {"device", "method", "le"}
    assert METRICS["kvpool_loop_stalls_total"] == {"device"}
    # a summary is its _sum and _count
    assert METRICS["kvpool_elastic_reclaim_seconds_count"] == {"device", "pool"}
    assert "kvpool_elastic_reclaim_seconds" not in METRICS
    assert METRICS["kvpool_elastic_groups"] == {"device", "pool", "state", "unit"}

