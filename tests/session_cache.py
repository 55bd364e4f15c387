"""Results that many tests share, computed once per test session across xdist workers.

A single-process reference run is the same for every test that trains the same job, and
module-scoped fixtures run once in *each* xdist worker that runs a test of the module. On a
2-core machine those repeats are CPU the suite's other tests wait for. The first worker to
need a result computes it, holding a lock; the others wait for it and read it.
"""

from __future__ import annotations

import fcntl
import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any


def session_dir(tmp: Path) -> Path:
    """The directory every xdist worker of this session shares, from any temporary
    directory of the session (``tmp_path`` or a ``tmp_path_factory`` base): the parent of
    the worker's ``popen-gwN`` directory, or the base itself without xdist."""
    tmp = Path(tmp).resolve()
    for parent in (tmp, *tmp.parents):
        if parent.name.startswith("popen-gw"):
            return parent.parent
    for parent in (tmp, *tmp.parents):
        if parent.name.startswith("pytest-") and parent.parent.name.startswith("pytest-of-"):
            return parent
    return tmp if tmp.is_dir() else tmp.parent


def once_per_session(
    tmp: Path, key: str, compute: Callable[[], Any], enough: Callable[[Any], bool] | None = None
) -> Any:
    """``compute()``'s value, JSON-shaped (what every worker sees: ``json.loads`` of its
    ``json.dumps``), computed by the first caller of the session with this ``key``. A
    failed ``compute()`` leaves nothing behind: the next caller computes again.

    ``enough``: whether the value kept under ``key`` serves this caller (a reference of
    fewer steps than it needs does not); when it does not, this caller computes its own,
    which replaces it for the callers after it."""
    cache = session_dir(tmp) / "session-cache"
    cache.mkdir(exist_ok=True)
    path = cache / f"{key}.json"
    with open(cache / f"{key}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when closed, or when a worker dies
        if path.exists():
            kept = json.loads(path.read_text(encoding="utf-8"))
            if enough is None or enough(kept):
                return kept
        text = json.dumps(compute())
        partial = cache / f"{key}.{os.getpid()}.partial"
        partial.write_text(text, encoding="utf-8")
        os.replace(partial, path)
        return json.loads(text)
