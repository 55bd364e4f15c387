"""The `elasticd` command: the user's single front door.

Each subcommand group lives in its own module with a ``register(subparsers)`` function that
adds its parser and sets ``func``. Modules that need `trainer` or `checkpoint` import them
inside the function that runs the subcommand, never at module level, and convert their
errors to :class:`~elasticd.errors.ElasticdError` at that boundary.

User errors become one line on stderr and exit code 2, never a traceback.
"""

from __future__ import annotations

import argparse
import errno
import importlib
import os
import pkgutil
import sys
from collections.abc import Sequence
from typing import NoReturn

from elasticd.errors import ElasticdError, UsageError
from elasticd.limits import raise_open_file_limit
from elasticd.log import setup_logging

EXIT_USER_ERROR = 2


class OneLineParser(argparse.ArgumentParser):
    """An ArgumentParser whose errors are one line and exit code 2."""

    def error(self, message: str) -> NoReturn:
        # main() prints "elasticd: error: ": name the subcommand only, never the program.
        where = self.prog.removeprefix("elasticd").strip()
        raise UsageError(f"{where}: {message}" if where else message)


def version() -> str:
    """The installed package's version (the source tree's, when run from a checkout)."""
    from importlib.metadata import PackageNotFoundError
    from importlib.metadata import version as installed

    try:
        return installed("elasticd")
    except PackageNotFoundError:
        return "unknown"


def build_parser() -> argparse.ArgumentParser:
    parser = OneLineParser(
        prog="elasticd",
        description="Fault-tolerant, elastic training for PyTorch.",
    )
    parser.add_argument("--version", action="version", version=f"elasticd {version()}")
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
    raise_open_file_limit()  # workers inherit it; a checkpoint may have a file per rank
    try:
        args = build_parser().parse_args(argv)
        return int(args.func(args) or 0)
    except ElasticdError as exc:
        if _broken_pipe(exc):
            return _quiet_exit()
        print(f"elasticd: error: {exc}", file=sys.stderr)
        return EXIT_USER_ERROR
    except KeyboardInterrupt:
        print("elasticd: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:
        return _quiet_exit()


def _broken_pipe(exc: BaseException | None) -> bool:
    """Whether ``exc`` is, or was caused by, a write to a closed pipe."""
    seen = 0
    while exc is not None and seen < 10:
        if isinstance(exc, BrokenPipeError) or (
            isinstance(exc, OSError) and exc.errno == errno.EPIPE
        ):
            return True
        exc, seen = exc.__cause__ or exc.__context__, seen + 1
    return False


def _quiet_exit() -> int:
    """The reader of our output went away (``elasticd ... | head``): end quietly. stdout is
    pointed at /dev/null so that the interpreter's final flush does not complain."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
    except (OSError, ValueError):
        pass
    return 0
