"""Waiting on real processes in tests: poll a condition until it holds or time runs out."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")


def wait_for(predicate: Callable[[], T], *, timeout: float, interval: float = 0.1) -> T:
    """The first truthy value of ``predicate()``; an AssertionError after ``timeout`` s."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"condition not met within {timeout} s")
        time.sleep(interval)


def until(predicate: Callable[[], object], timeout: float, interval: float = 0.02) -> bool:
    """Whether ``predicate()`` became truthy within ``timeout`` s (for ``assert until(...)``)."""
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            return False
        time.sleep(interval)
    return True
