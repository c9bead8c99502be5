"""Parse and run a CLI subcommand: the one place where errors become exit codes (kvpool,
kvpoold).

Bad input (``InvalidArgument``) exits 2 with one line naming the field; any other kvpool error
(``Unavailable`` when no daemon answers, ``DeadlineExceeded``, ``NotFound``...) exits 1 with its
status code name. A reader that stops early (``kvpool stats | head``) ends the output quietly.
"""

from __future__ import annotations

import argparse
import os
import re
import sys
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from kvpool.contract.errors import InvalidArgument, KVPoolError, Unauthenticated, Unavailable

if TYPE_CHECKING:
    from rich.console import Console

UNAVAILABLE_HINT = "is `kvpoold serve` running?"
UNAUTHENTICATED_HINT = ("give the daemon's token with --token-file PATH (or set "
                        "KVPOOL_TOKEN_FILE)")


# ``--budget -5GiB``: argparse takes any token that starts with "-" and is not a plain number for
# an option ("expected one argument"); such a value is joined to its flag so that the flag's own
# check answers (sizes must be >= 0).
_NEGATIVE_VALUE = re.compile(r"^-[0-9.]")


def command_parser(prog: str, description: str) -> tuple[argparse.ArgumentParser, Any]:
    """The top-level parser of ``prog`` (with ``--version``) and its subcommand group."""
    from kvpool import WIRE_CONTRACT, __version__

    parser = argparse.ArgumentParser(prog=prog, description=description)
    parser.add_argument("--version", action="version",
                        version=f"{prog} {__version__} (wire contract {WIRE_CONTRACT})")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    return parser, sub


def parse_command_line(parser: argparse.ArgumentParser,
                       argv: Sequence[str] | None = None) -> argparse.Namespace:
    """``parser.parse_args`` for a parser with subcommands, except that an unknown flag is
    reported with the subcommand's usage (not the top level's), and a negative value after a
    ``--flag`` reaches the flag's own check."""
    args_in = list(sys.argv[1:] if argv is None else argv)
    joined: list[str] = []
    for token in args_in:
        if (joined and _NEGATIVE_VALUE.match(token) and joined[-1].startswith("--")
                and "=" not in joined[-1]):
            joined[-1] = f"{joined[-1]}={token}"
        else:
            joined.append(token)
    args, extra = parser.parse_known_args(joined)
    if extra:
        sub = subcommand_parser(parser, getattr(args, "command", None))
        (sub or parser).error(f"unrecognized arguments: {' '.join(extra)}")
    return args


def subcommand_parser(parser: argparse.ArgumentParser,
                      command: str | None) -> argparse.ArgumentParser | None:
    """The parser of subcommand ``command``, if ``parser`` has one by that name."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction) and command in action.choices:
            return action.choices[command]  # type: ignore[no-any-return]
    return None


def run_subcommand(prog: str, args: argparse.Namespace) -> int:
    """Call ``args.func(args)`` and turn a raised kvpool error into a message and exit code."""
    try:
        return int(args.func(args) or 0)
    except BrokenPipeError:
        # The reader went away (``| head``): what it read is all it wanted.
        _quiet_stdout()
        return 0
    except InvalidArgument as exc:
        print(f"{prog} {args.command}: error: {_as_flags(exc, args)}", file=sys.stderr)
        return 2
    except KVPoolError as exc:
        message = str(exc)
        if isinstance(exc, Unavailable) and UNAVAILABLE_HINT not in message:
            message = f"kvpoold is unavailable ({message}); {UNAVAILABLE_HINT}"
        elif isinstance(exc, Unauthenticated) and "--token-file" not in message:
            message = f"{message}; {UNAUTHENTICATED_HINT}"
        code = getattr(exc, "code_name", exc.code)
        if message == str(exc):
            message = _as_flags(exc, args)
        print(f"{prog} {args.command}: error ({code}): {message}", file=sys.stderr)
        return 1


def _as_flags(exc: KVPoolError, args: argparse.Namespace) -> str:
    """The error as the command line knows it: its input field named by the flag that set it
    (``budget_bytes`` -> ``--budget``), where the command has that flag."""
    flag = _flag_of(exc.field)
    if flag is None:
        return str(exc)
    known = vars(args)
    if exc.field not in known and flag.lstrip("-").replace("-", "_") not in known:
        return str(exc)  # not a flag of this command (an RPC field, a spec field)
    return f"{flag}: {exc.message}"


def _flag_of(field: str) -> str | None:
    """``budget_bytes`` -> ``--budget``, ``page_size`` -> ``--page-size``; None for a field
    with a position in it (``items[2].ids``)."""
    from kvpool.contract.option_flags import flag_of

    if not field or not field.replace("_", "").isalnum():
        return None
    return flag_of(field)


def _quiet_stdout() -> None:
    """Point stdout at /dev/null so the interpreter's final flush does not raise again."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())


def console(**options: Any) -> Console:
    """A rich ``Console`` for a command's output whose reader may stop early: a closed pipe
    (``kvpoold plan | head -1``) ends the command with status 0, as it does for the plain
    output of the other commands (rich itself exits 1)."""
    from rich.console import Console

    class _PipeConsole(Console):
        def on_broken_pipe(self) -> None:
            _quiet_stdout()
            raise SystemExit(0)

    return _PipeConsole(**options)
