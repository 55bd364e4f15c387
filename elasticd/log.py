"""Structured logging: one ``key=value`` line per event.

Lines look like::

    ts=2026-11-21T05:41:33.120Z level=info logger=elasticd.agent msg="round closed" round=3 world=2

so that they grep well and load into Loki or journald without a parser. The level comes
from ``ELASTICD_LOG_LEVEL`` (debug, info, warning, error; default info). Extra fields are
passed with ``log.info("round closed", extra={"kv": {"round": 3}})`` or, shorter, with
:func:`kv`.
"""

from __future__ import annotations

import logging
import os
import sys
import time
from collections.abc import Mapping
from typing import Any

_RESERVED = ("ts", "level", "logger", "msg")


def _quote(value: Any) -> str:
    text = str(value)
    if text == "" or any(c in text for c in ' "=\n\t'):
        text = text.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")
        return f'"{text}"'
    return text


class KeyValueFormatter(logging.Formatter):
    """Formats a record as ``ts=... level=... logger=... msg=... k=v ...``."""

    def format(self, record: logging.LogRecord) -> str:
        ts = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created))
        ts += f".{int(record.msecs):03d}Z"
        parts = [
            f"ts={ts}",
            f"level={record.levelname.lower()}",
            f"logger={record.name}",
            f"msg={_quote(record.getMessage())}",
        ]
        fields: Mapping[str, Any] = getattr(record, "kv", None) or {}
        for key, value in fields.items():
            name = f"{key}_" if key in _RESERVED else key
            parts.append(f"{name}={_quote(value)}")
        if record.exc_info:
            parts.append(f"exc={_quote(self.formatException(record.exc_info))}")
        return " ".join(parts)


def kv(**fields: Any) -> dict[str, dict[str, Any]]:
    """Extra fields for a log call: ``log.info("joined", **kv(round=3))``."""
    return {"extra": {"kv": fields}}


LEVELS = ("debug", "info", "warning", "error")


def level_from_env(env: Mapping[str, str] | None = None) -> int:
    """The level named by ``ELASTICD_LOG_LEVEL``; unknown names fall back to info."""
    name = (env if env is not None else os.environ).get("ELASTICD_LOG_LEVEL", "info")
    level = logging.getLevelName(name.strip().upper())
    return level if isinstance(level, int) else logging.INFO


def _unknown_level(env: Mapping[str, str] | None) -> str | None:
    name = (env if env is not None else os.environ).get("ELASTICD_LOG_LEVEL", "info")
    return None if name.strip().lower() in (*LEVELS, "critical") else name


class _CurrentStderr(logging.StreamHandler):
    """Writes each record to ``sys.stderr`` as it is *then*, never to the one of the call
    that installed it: pytest's capture replaces ``sys.stderr`` for each test and closes
    the old one, and a handler bound to that one printed ``--- Logging error ---
    ValueError: I/O operation on closed file`` into a later test's output instead of the
    line (an etcd started by the plugin, say)."""

    @property
    def stream(self) -> Any:  # a text stream, whatever sys.stderr is
        return sys.stderr

    @stream.setter
    def stream(self, value: object) -> None:  # StreamHandler's own assignment: ignored
        pass


def setup_logging(stream=None, env: Mapping[str, str] | None = None) -> None:
    """Install the key=value handler on the ``elasticd``, ``trainer`` and ``checkpoint`` loggers.
    Without ``stream``, the lines go to ``sys.stderr`` as it is at each line.

    Idempotent: calling it twice does not duplicate lines.
    """
    handler = logging.StreamHandler(stream) if stream is not None else _CurrentStderr()
    handler.setFormatter(KeyValueFormatter())
    handler.set_name("elasticd-kv")
    level = level_from_env(env)
    for name in ("elasticd", "trainer", "checkpoint"):
        logger = logging.getLogger(name)
        logger.handlers = [h for h in logger.handlers if h.get_name() != "elasticd-kv"]
        logger.addHandler(handler)
        logger.setLevel(level)
        logger.propagate = False
    unknown = _unknown_level(env)
    if unknown is not None:  # said, not silently ignored (a newcomer's walk)
        logging.getLogger("elasticd").warning(
            "ELASTICD_LOG_LEVEL=%r is not a level (%s); logging at info", unknown[:40],
            ", ".join(LEVELS),
        )  # fmt: skip


def dump_stacks_on_sigusr1() -> None:
    """``kill -USR1`` prints every thread's stack to this process's stderr (its log): how a
    stuck agent or worker is read without stopping it. Registered on file descriptor 2
    itself, never on whatever ``sys.stderr`` is now: faulthandler keeps only the number,
    and a replaced ``sys.stderr`` (pytest's capture, a notebook) may have none, or one that
    is closed and reused later."""
    import faulthandler
    import signal

    faulthandler.register(signal.SIGUSR1, file=2, all_threads=True)
