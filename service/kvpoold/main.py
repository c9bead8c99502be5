"""``kvpoold``: the daemon's command line (``plan``, ``serve``).

Each subcommand lives in its own module and registers itself with :func:`main`'s parser.
Bad input exits with status 2 and one line naming the field and the accepted values.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from kvpool.tools.cli_run import command_parser, run_command_line


def build_parser() -> argparse.ArgumentParser:
    from kvpoold import plan_cli
    from kvpoold.server import serve_cli

    parser, sub = command_parser(
        "kvpoold", "kvpool daemon: plans and owns the KV-cache pools of one device.")
    plan_cli.add_parser(sub)
    serve_cli.add_parser(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    return run_command_line("kvpoold", parser, argv)


if __name__ == "__main__":
    sys.exit(main())
