"""The `elasticd` command: the user's single front door.

Each subcommand group lives in its own module with a ``register(subparsers)`` function that
adds its parser and sets ``func``. Modules that need `trainer` or `checkpoint` import them
inside the function that runs the subcommand, never at module level, and convert their
errors to :class:`~elasticd.errors.ElasticdError` at that boundary.

User errors become one line on stderr and exit code 2, never a traceback.
"""

from __future__ import annotations

import argparse
import importlib
import pkgutil
import sys
from collections.abc import Sequence
from typing import NoReturn

from elasticd.errors import ElasticdError, UsageError
from elasticd.log import setup_logging

EXIT_USER_ERROR = 2


class OneLineParser(argparse.ArgumentParser):
    """An ArgumentParser whose errors are one line and exit code 2."""

    def error(self, message: str) -> NoReturn:
        raise UsageError(f"{self.prog}: {message}")


def build_parser() -> argparse.ArgumentParser:
    parser = OneLineParser(
        prog="elasticd",
        description="Fault-tolerant, elastic training for PyTorch.",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=OneLineParser)
    sub.required = True
    # Every module in this package is a subcommand group; adding one needs no edit here.
    for info in sorted(pkgutil.iter_modules(__path__), key=lambda m: m.name):
        if not info.name.startswith("_"):
            importlib.import_module(f"{__name__}.{info.name}").register(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the CLI; returns the exit code (the console script exits with it)."""
    setup_logging()
    try:
        args = build_parser().parse_args(argv)
        return int(args.func(args) or 0)
    except ElasticdError as exc:
        print(f"elasticd: error: {exc}", file=sys.stderr)
        return EXIT_USER_ERROR
    except KeyboardInterrupt:
        print("elasticd: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:
        return 0
