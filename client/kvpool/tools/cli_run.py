"""Parse and run a CLI subcommand: the one place where errors become exit codes (kvpool,
kvpoold).

Bad input (``InvalidArgument``) exits 2 with one line naming the flag; any other kvpool error
(``Unavailable`` when no daemon answers, ``DeadlineExceeded``, ``NotFound``...) exits 1 with its
status code name; both in the command line's words (:mod:`kvpool.tools.cli_words`). Ctrl-C
exits 130 with one line, after the command's own clean-up. A reader that stops early
(``kvpool stats | head``) ends the output quietly.
"""

from __future__ import annotations

import argparse
import os
import re
import sys
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from kvpool.contract.errors import InvalidArgument, KVPoolError, Unauthenticated, Unavailable
from kvpool.tools.cli_words import CommandWords, user_words

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


def run_command_line(prog: str, parser: argparse.ArgumentParser,
                     argv: Sequence[str] | None = None) -> int:
    """Parse ``argv`` (default ``sys.argv[1:]``) and run the subcommand: what ``kvpool`` and
    ``kvpoold`` run. Errors come back in the words the user typed; Ctrl-C is one line, 130.

    Returns:
        The exit status: 0, 1 (a daemon error), 2 (bad input) or 130 (interrupted).
    """
    tokens = list(sys.argv[1:] if argv is None else argv)
    try:
        args = parse_command_line(parser, tokens)
        sub = subcommand_parser(parser, args.command)
        words = CommandWords(sub, tokens) if sub is not None else None
        return run_subcommand(prog, args, words)
    except KeyboardInterrupt:
        return interrupted(prog, tokens[:1])


def interrupted(prog: str, command: Sequence[str]) -> int:
    """Ctrl-C: one line instead of a traceback, and the shell's status for SIGINT (130). The
    command's ``finally`` blocks and context managers have run by the time it gets here."""
    where = " ".join([prog, *command])
    print(f"\n{where}: interrupted (Ctrl-C); stopped what it started", file=sys.stderr)
    return 130


def parse_command_line(parser: argparse.ArgumentParser,
                       argv: Sequence[str] | None = None) -> argparse.Namespace:
    """``parser.parse_args`` for a parser with subcommands, except that an unknown flag is
    reported with the subcommand's usage (not the top level's), and a negative value after a
    ``--flag`` reaches the flag's own check."""
    joined = join_negative_values(list(sys.argv[1:] if argv is None else argv))
    args, extra = parser.parse_known_args(joined)
    if extra:
        sub = subcommand_parser(parser, getattr(args, "command", None))
        (sub or parser).error(f"unrecognized arguments: {' '.join(extra)}")
    return args


def join_negative_values(tokens: list[str]) -> list[str]:
    """``["--budget", "-5GiB"]`` -> ``["--budget=-5GiB"]`` (see :data:`_NEGATIVE_VALUE`)."""
    joined: list[str] = []
    for token in tokens:
        if (joined and _NEGATIVE_VALUE.match(token) and joined[-1].startswith("--")
                and "=" not in joined[-1]):
            joined[-1] = f"{joined[-1]}={token}"
        else:
            joined.append(token)
    return joined


def subcommand_parser(parser: argparse.ArgumentParser,
                      command: str | None) -> argparse.ArgumentParser | None:
    """The parser of subcommand ``command``, if ``parser`` has one by that name."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction) and command in action.choices:
            return action.choices[command]  # type: ignore[no-any-return]
    return None


def run_subcommand(prog: str, args: argparse.Namespace, words: CommandWords | None = None) -> int:
    """Call ``args.func(args)`` and turn a raised kvpool error into a message and exit code,
    in the command line's ``words`` when given (else the error's own ``field: message``)."""
    try:
        return int(args.func(args) or 0)
    except BrokenPipeError:
        # The reader went away (``| head``): what it read is all it wanted.
        _quiet_stdout()
        return 0
    except InvalidArgument as exc:
        print(f"{prog} {args.command}: error: {_in_words(exc, words)}", file=sys.stderr)
        return 2
    except KVPoolError as exc:
        message = str(exc)
        if isinstance(exc, Unavailable) and UNAVAILABLE_HINT not in message:
            message = f"kvpoold is unavailable ({message}); {UNAVAILABLE_HINT}"
        elif isinstance(exc, Unauthenticated) and "--token-file" not in message:
            message = f"{message}; {UNAUTHENTICATED_HINT}"
        code = getattr(exc, "code_name", exc.code)
        if message == str(exc):
            message = _in_words(exc, words)
        print(f"{prog} {args.command}: error ({code}): {message}", file=sys.stderr)
        return 1


def _in_words(exc: KVPoolError, words: CommandWords | None) -> str:
    return str(exc) if words is None else user_words(exc, words)


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
