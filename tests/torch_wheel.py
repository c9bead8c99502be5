"""Where a side venv gets its CPU torch: a local wheel, else PyTorch's CPU wheel index, else a stop.

Run by ``tests/side_venv_lib.sh`` under the new venv's python (stdlib only)::

    python tests/torch_wheel.py torch==2.13.0

and, with ``--install`` (install the choice into the interpreter running it), by ``.ci/run``
and the README's demo command for the main ``.venv``.

The sources, in order:

1. a local CPU wheel: the file (or folder) ``$KVPOOL_TORCH_WHEEL`` names, else one in the
   local folders of pip's own ``find-links`` (its config files and ``PIP_FIND_LINKS``, as
   ``pip config list`` reports them);
2. PyTorch's CPU wheel index (``$KVPOOL_TORCH_INDEX``, default
   https://download.pytorch.org/whl/cpu), when it answers, with the ``+cpu`` build pinned
   exactly (on macOS, where every build is CPU, the plain version);
3. else a stop: one line on stderr saying what to download and where to point the script.

A CUDA build is never chosen: a local wheel must carry the ``+cpu`` local version (or be a
macOS wheel), and the index request pins it. Prints, on success, one line describing the
source, then the arguments for ``pip install --no-deps``, one per line; exit 1 on a stop.
"""

from __future__ import annotations

import ast
import os
import platform
import re
import subprocess
import sys
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlparse

CPU_INDEX = "https://download.pytorch.org/whl/cpu"
PROBE_TIMEOUT_S = 15.0  # one answer from the index; a machine with no route fails far sooner
# name-version(+local)-pythontag-abitag-platformtag.whl, PEP 427.
WHEEL = re.compile(r"^torch-(?P<version>[^-+]+)(?:\+(?P<local>[^-]+))?-(?P<py>[^-]+)-[^-]+-"
                   r"(?P<plat>[^-]+)\.whl$")


@dataclass(frozen=True)
class Target:
    """The interpreter a wheel must fit: its CPython tag and its platform."""

    python_tag: str  # "cp311"
    system: str  # "linux", "macosx", "win"
    machine: str  # "x86_64", "aarch64", "arm64", "amd64"

    @classmethod
    def this_interpreter(cls) -> Target:
        """The interpreter running this script (the new venv's)."""
        system = {"darwin": "macosx", "win32": "win"}.get(sys.platform, "linux")
        return cls(f"cp{sys.version_info.major}{sys.version_info.minor}", system,
                   platform.machine().lower())

    def describe(self) -> str:
        """As a wheel file name would spell it, e.g. ``cp311 linux_x86_64``."""
        return f"{self.python_tag} {self.system}_{self.machine}"


@dataclass(frozen=True)
class Choice:
    """The source picked: a line for the log, and what ``pip install --no-deps`` takes."""

    description: str
    pip_args: tuple[str, ...]


class NoCPUWheel(Exception):
    """Neither source has a CPU wheel; the message is the one line the user reads."""


def cpu_wheel_problem(name: str, version: str, target: Target) -> str | None:
    """Why the file ``name`` is not a CPU torch ``version`` for ``target``, or None if it is.

    Args:
        name: a file name.
        version: torch's version, e.g. ``2.13.0``.
        target: the interpreter it must install into.

    Returns:
        None for a fitting CPU wheel, else a few words (``a CUDA build``, ``for cp312``, ...).
    """
    m = WHEEL.match(name)
    if m is None or m["version"] != version:
        return f"not a torch {version} wheel"
    if target.python_tag not in m["py"].split("."):
        return f"for {m['py']}, not {target.python_tag}"
    plat = m["plat"]
    if target.system not in plat or not plat.lower().endswith(target.machine):
        return f"for {plat}, not {target.system}_{target.machine}"
    local = m["local"] or ""
    # PyPI's Linux and Windows wheels of torch are CUDA builds; only macOS's plain wheel is CPU.
    if local.startswith("cpu") or (not local and target.system == "macosx"):
        return None
    return f"a CUDA build (+{local})" if local else "a CUDA build (PyPI's, no +cpu)"


def pip_find_links(python: str) -> list[str]:
    """The find-links locations ``python``'s pip is configured with (files and environment).

    Args:
        python: an interpreter with pip.

    Returns:
        The locations in pip's order; none when pip cannot say.
    """
    out = subprocess.run([python, "-m", "pip", "config", "list"], capture_output=True,
                         text=True, check=False).stdout
    found: list[str] = []
    for line in out.splitlines():
        key, sep, value = line.partition("=")
        if not sep or not key.endswith(".find-links"):
            continue
        try:
            text = ast.literal_eval(value)
        except (ValueError, SyntaxError):
            continue
        found.extend(str(text).split())
    return found


def local_folder(location: str) -> Path | None:
    """``location`` (a find-links entry) as a folder on this machine, or None (a URL)."""
    parsed = urlparse(location)
    if parsed.scheme == "file":
        return Path(parsed.path)
    if len(parsed.scheme) <= 1:  # a path (or a Windows drive letter)
        return Path(location)
    return None


def local_choice(version: str, target: Target, explicit: str | None,
                 find_links: list[str], skipped: list[str]) -> Choice | None:
    """The local CPU wheel: ``explicit`` (a file or folder) when given, else pip's find-links.

    Args:
        version: torch's version.
        target: the interpreter it must install into.
        explicit: ``$KVPOOL_TORCH_WHEEL``; when set, only it is looked at.
        find_links: pip's configured find-links.
        skipped: gets one entry per torch wheel looked at and refused, with why.

    Returns:
        The wheel to install, or None.

    Raises:
        NoCPUWheel: ``explicit`` names something that is not a fitting CPU wheel.
    """
    if explicit:
        path = Path(explicit)
        files = sorted(path.glob("torch-*.whl")) if path.is_dir() else [path]
        for f in files:
            problem = cpu_wheel_problem(f.name, version, target)
            if problem is None and f.is_file():
                return Choice(f"the CPU wheel KVPOOL_TORCH_WHEEL names: {f}", ("--no-deps", str(f)))
            skipped.append(f"{f} ({problem or 'no such file'})")
        raise NoCPUWheel(
            f"KVPOOL_TORCH_WHEEL={explicit} holds no CPU wheel of torch {version} for "
            f"{target.describe()}: " + ("; ".join(skipped) or "no torch-*.whl there")
            + f"; point it at torch-{version}+cpu-{target.python_tag}-*.whl from "
            f"{CPU_INDEX}/torch/")
    for location in find_links:
        folder = local_folder(location)
        if folder is None or not folder.is_dir():
            continue
        for f in sorted(folder.glob(f"torch-{version}*.whl")):
            problem = cpu_wheel_problem(f.name, version, target)
            if problem is None:
                return Choice(f"the CPU wheel in pip's find-links {folder}: {f.name}",
                              ("--no-deps", str(f)))
            skipped.append(f"{f} ({problem})")
    return None


def index_choice(version: str, target: Target, index: str,
                 timeout_s: float = PROBE_TIMEOUT_S) -> tuple[Choice | None, str]:
    """PyTorch's CPU wheel index, when it answers.

    Args:
        version: torch's version.
        target: the interpreter it must install into.
        index: the index's URL (PEP 503 simple layout: ``<index>/torch/``).
        timeout_s: how long to wait for its answer.

    Returns:
        (the choice, "") when the index answers, else (None, why it did not).
    """
    url = index.rstrip("/") + "/torch/"
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as reply:
            reply.read(1)
    except (urllib.error.URLError, OSError, ValueError) as e:
        return None, str(getattr(e, "reason", e))
    # The exact local version: nothing else on any index pip is configured with can satisfy
    # it, so pip cannot fall back to a CUDA build. macOS's CPU wheels carry no local version.
    requirement = f"torch=={version}" if target.system == "macosx" else f"torch=={version}+cpu"
    return Choice(f"{requirement} from PyTorch's CPU wheel index {index}",
                  ("--no-deps", "--index-url", index, requirement)), ""


def choose(version: str, target: Target, explicit: str | None, find_links: list[str],
           index: str, timeout_s: float = PROBE_TIMEOUT_S) -> Choice:
    """The first source that has a CPU torch ``version`` for ``target``.

    Args:
        version: torch's version, e.g. ``2.13.0``.
        target: the interpreter it must install into.
        explicit: ``$KVPOOL_TORCH_WHEEL`` (a wheel or a folder), or None.
        find_links: pip's configured find-links.
        index: PyTorch's CPU wheel index (``$KVPOOL_TORCH_INDEX``).
        timeout_s: how long the index gets to answer.

    Returns:
        The choice.

    Raises:
        NoCPUWheel: no source has one; the message says what to download and how to use it.
    """
    skipped: list[str] = []
    choice = local_choice(version, target, explicit, find_links, skipped)
    if choice is not None:
        return choice
    choice, why = index_choice(version, target, index, timeout_s)
    if choice is not None:
        return choice
    local = [loc for loc in find_links if local_folder(loc) is not None]
    where = f"none in pip's find-links ({', '.join(local)})" if local else \
        "pip has no local find-links folder"
    if skipped:
        where += f"; skipped {', '.join(skipped)}"
    raise NoCPUWheel(
        f"no CPU wheel of torch {version} for {target.describe()}: {where}, and {index} did "
        f"not answer ({why}); download torch-{version}+cpu-{target.python_tag}-*.whl from "
        f"{CPU_INDEX}/torch/ onto this machine and run again with KVPOOL_TORCH_WHEEL=<its path>")


def installed_cpu(version: str) -> bool:
    """Whether this interpreter already has torch ``version`` as a CPU build."""
    probe = ("import sys, torch; sys.exit(not (torch.__version__.split('+')[0] == sys.argv[1] "
             "and torch.version.cuda is None))")
    return subprocess.run([sys.executable, "-W", "ignore", "-c", probe, version],
                          capture_output=True).returncode == 0


def main(argv: list[str]) -> int:
    """``torch_wheel.py [--install] torch==VERSION``: print the choice (or, with
    ``--install``, install it into this interpreter with its own dependencies from the usual
    index; nothing when a CPU build of that version is there), or the one-line stop on
    stderr."""
    install = "--install" in argv
    argv = [a for a in argv if a != "--install"]
    if len(argv) != 1 or not argv[0].startswith("torch=="):
        print("usage: torch_wheel.py [--install] torch==VERSION", file=sys.stderr)
        return 2
    version = argv[0].removeprefix("torch==")
    if install and installed_cpu(version):
        print(f"torch {version} (CPU) is installed", file=sys.stderr)
        return 0
    try:
        choice = choose(version, Target.this_interpreter(), os.environ.get("KVPOOL_TORCH_WHEEL"),
                        pip_find_links(sys.executable),
                        os.environ.get("KVPOOL_TORCH_INDEX", CPU_INDEX))
    except NoCPUWheel as e:
        print(e, file=sys.stderr)
        return 1
    if not install:
        print(choice.description)
        print("\n".join(choice.pip_args))
        return 0
    print(f"torch: {choice.description}", file=sys.stderr)  # stdout stays the caller's
    pip = [sys.executable, "-m", "pip", "install", "-q"]
    subprocess.run([*pip, "--no-deps", *choice.pip_args], check=True)
    subprocess.run([*pip, argv[0]], check=True)  # its dependencies; the +cpu build satisfies it
    if not installed_cpu(version):
        print(f"torch {version} here is not the CPU build after installing it", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
