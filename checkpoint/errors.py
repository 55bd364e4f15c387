"""The error hierarchy of the `checkpoint` package: one root, a subclass per failure domain."""

from __future__ import annotations

from typing import Any


class CheckpointError(Exception):
    """Root of every error the checkpoint store raises on purpose."""


class NoCheckpointError(CheckpointError):
    """There is no committed checkpoint where one was asked for."""


class FormatError(CheckpointError):
    """A manifest of an unknown format or version, or one that is malformed."""


class UnsupportedVersionError(FormatError):
    """A manifest of a format version this build does not read: written by a newer build
    (a rollback, an old image in a rolling upgrade). Not damage: a load stops at it rather
    than fall back past it (the step would then be abandoned, and pruned by the next
    save)."""


class CheckpointReadError(CheckpointError):
    """A step could not be read for a reason outside its content (permissions, an I/O
    error, the machine's memory): a load stops rather than fall back past a step that may
    well be good, and record it as unloadable (retention deletes those first)."""


class CorruptCheckpointError(CheckpointError):
    """A file is missing, truncated, or does not match its recorded checksum."""


class LayoutMismatchError(CheckpointError):
    """The saved tensors cannot feed what was asked (unknown name, shape or dtype)."""


class SaveFailedError(CheckpointError):
    """A save did not commit (a write failed on some rank, or ranks disagreed)."""


class SaveRefusedError(SaveFailedError):
    """A save that cannot commit with this layout, at this or any later step: its manifest,
    or a file's header, would pass a bound every load enforces (so it would be a committed
    step that no load reads). Saving again does not help; a layout or model does."""


class OwnershipError(CheckpointError):
    """The checkpoint directory belongs to another job, or another run is using it."""


class FencedError(SaveFailedError):
    """A save refused because ``fence.json`` names another round or run than the saver's:
    the world moved on without this node. ``writer`` and ``current`` are the two fences
    (``current`` is None when the fence file could not be read)."""

    def __init__(self, message: str, *, writer: Any = None, current: Any = None) -> None:
        super().__init__(message)
        self.writer = writer
        self.current = current
