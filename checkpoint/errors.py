"""The error hierarchy of the `checkpoint` package: one root, a subclass per failure domain."""

from __future__ import annotations


class CheckpointError(Exception):
    """Root of every error the checkpoint store raises on purpose."""


class NoCheckpointError(CheckpointError):
    """There is no committed checkpoint where one was asked for."""


class FormatError(CheckpointError):
    """A manifest of an unknown format or version, or one that is malformed."""


class CorruptCheckpointError(CheckpointError):
    """A file is missing, truncated, or does not match its recorded checksum."""


class LayoutMismatchError(CheckpointError):
    """The saved tensors cannot feed what was asked (unknown name, shape or dtype)."""


class SaveFailedError(CheckpointError):
    """A save did not commit (a write failed on some rank, or ranks disagreed)."""
