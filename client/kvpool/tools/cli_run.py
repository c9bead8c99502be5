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

from kvpool.contract.errors import InvalidArgument, KVPoolError, Unavailable

UNAVAILABLE_HINT = "is `kvpoold serve` running?"


# ``--budget -5GiB``: argparse takes any token that starts with "-" and is not a plain number for
# an option ("expected one argument"); such a value is joined to its flag so that the flag's own
# check answers (sizes must be >= 0).
_NEGATIVE_VALUE = re.compile(r"^-[0-9.]")


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
        # The reader went away (``| head``): what it read is all it wanted. Point stdout at
        # /dev/null so the interpreter's final flush does not raise again.
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return 0
    except InvalidArgument as exc:
        print(f"{prog} {args.command}: error: {exc}", file=sys.stderr)
        return 2
    except KVPoolError as exc:
        message = str(exc)
        if isinstance(exc, Unavailable) and UNAVAILABLE_HINT not in message:
            message = f"kvpoold is unavailable ({message}); {UNAVAILABLE_HINT}"
        code = getattr(exc, "code_name", exc.code)
        print(f"{prog} {args.command}: error ({code}): {message}", file=sys.stderr)
        return 1
