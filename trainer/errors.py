"""The error hierarchy of the `trainer` package.

One root, :class:`TrainerError`. A :class:`TrainerConfigError` is a user error found before
training starts: the entry point prints its one-line message and exits with code 2.
"""

from __future__ import annotations

from typing import Any


class TrainerError(Exception):
    """Root of every error the trainer raises on purpose."""


class TrainerConfigError(TrainerError):
    """A job the built-in trainer cannot run as given (one line, names what is wrong)."""


class DataError(TrainerConfigError):
    """A token file that is missing, malformed or does not fit the model."""


class DivergedError(TrainerError):
    """The gradient norm was not finite for :data:`trainer.train.NONFINITE_LIMIT` steps in a
    row: every update was skipped, and skipping more would only burn the allocation (the
    same data and state give the same overflow after a restart). One line, exit code 2."""


def brief(value: Any) -> str:
    """A value from a file the user gave (a checkpoint, a Hugging Face config), for an
    error message: its ``repr``, on one line and at most 60 characters."""
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."
