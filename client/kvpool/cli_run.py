"""Run a parsed CLI subcommand: the one place where errors become exit codes (kvpool, kvpoold).

Bad input (``InvalidArgument``) exits 2 with one line naming the field; any other kvpool error
exits 1 with its status code name.
"""

from __future__ import annotations

import argparse
import sys

from kvpool.errors import InvalidArgument, KVPoolError


def run_subcommand(prog: str, args: argparse.Namespace) -> int:
    """Call ``args.func(args)`` and turn a raised kvpool error into a message and exit code."""
    try:
        return int(args.func(args) or 0)
    except InvalidArgument as exc:
        print(f"{prog} {args.command}: error: {exc}", file=sys.stderr)
        return 2
    except KVPoolError as exc:
        code = getattr(exc, "code_name", exc.code)
        print(f"{prog} {args.command}: error ({code}): {exc}", file=sys.stderr)
        return 1
