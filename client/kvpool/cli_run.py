"""Run a parsed CLI subcommand: the one place where errors become exit codes (kvpool, kvpoold).

Bad input (``InvalidArgument``) exits 2 with one line naming the field; any other kvpool error
(``Unavailable`` when no daemon answers, ``DeadlineExceeded``, ``NotFound``...) exits 1 with its
status code name.
"""

from __future__ import annotations

import argparse
import sys

from kvpool.errors import InvalidArgument, KVPoolError, Unavailable

UNAVAILABLE_HINT = "is `kvpoold serve` running?"


def run_subcommand(prog: str, args: argparse.Namespace) -> int:
    """Call ``args.func(args)`` and turn a raised kvpool error into a message and exit code."""
    try:
        return int(args.func(args) or 0)
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
