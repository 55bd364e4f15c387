"""The commit fence: ``<ckpt_dir>/fence.json`` names the one round allowed to commit.

The file is ``{"run_id": "<job>-<8 hex>", "round": <int>}``. Every agent of a new world
writes it before it spawns that round's workers, and a save commits only while the file
names the saver's own run and round (or while there is no file at all). So a node that
froze and thawed after the world moved on cannot commit. Format and rules:
docs/checkpoint-format.md, "Fencing".

This module needs only the standard library (and :mod:`checkpoint.errors`), so it reads
the same with or without torch. The agent does not import it (it imports nothing of
``checkpoint``); it writes the same small JSON itself, as the format document says.
"""

from __future__ import annotations

import contextlib
import json
import os
from dataclasses import dataclass

from checkpoint import smallfile
from checkpoint.errors import FencedError, FormatError
from checkpoint.manifest import quoted

FENCE_FILE = "fence.json"


@dataclass(frozen=True, kw_only=True, slots=True)
class Fence:
    """Whom a commit is made for: one round of one run of the job."""

    run_id: str
    """The rendezvous run (``TORCHELASTIC_RUN_ID``); a resubmitted job gets a new one."""
    round: int
    """The rendezvous round (``ELASTICD_ROUND``); counts up within a run."""

    def __post_init__(self) -> None:
        if not isinstance(self.run_id, str):
            raise TypeError(f"fence run_id must be a string, got {self.run_id!r}")
        if isinstance(self.round, bool) or not isinstance(self.round, int) or self.round < 0:
            raise ValueError(f"fence round must be an integer >= 0, got {self.round!r}")

    def describe(self) -> str:
        # The run id may come from a fence file (anyone's to write): one line, quoted.
        return f"round {self.round} of run {quoted(self.run_id) if self.run_id else '(none)'}"

    def to_dict(self) -> dict[str, str | int]:
        return {"run_id": self.run_id, "round": self.round}

    def to_json(self) -> bytes:
        return json.dumps(self.to_dict()).encode() + b"\n"

    @classmethod
    def from_json(cls, data: bytes, *, where: str = FENCE_FILE) -> Fence:
        obj = smallfile.parse_json(data, where=where, what="a fence", error=FormatError)
        try:
            if not isinstance(obj, dict) or not {"run_id", "round"} <= set(obj):
                raise ValueError('expected an object with "run_id" and "round"')
            return cls(run_id=obj["run_id"], round=obj["round"])
        except (ValueError, TypeError) as exc:
            raise FormatError(f"{where}: not a fence: {exc}") from exc


def fence_path(ckpt_dir: str) -> str:
    return os.path.join(ckpt_dir, FENCE_FILE)


def read_fence(ckpt_dir: str) -> Fence | None:
    """The fence in ``ckpt_dir``, or None when there is no fence file.

    A file that exists but does not parse, or is not a small regular file (a symlink, a
    FIFO, a device: opened without following or blocking), raises :class:`FormatError`: a
    fence that cannot be read is never taken for no fence."""
    path = fence_path(ckpt_dir)
    data = smallfile.read_small(path, error=FormatError)
    if data is None:
        return None
    return Fence.from_json(data, where=path)


def write_fence(ckpt_dir: str, fence: Fence) -> bool:
    """Make ``fence`` the fence of ``ckpt_dir``: a uniquely named tmp file, fsync, rename over
    ``fence.json``, fsync the directory. Returns False (and writes nothing) when the file
    already names a later round of the same run: a fence never moves back within a run.

    The read and the rename are two steps, not a compare-and-set; the agents of one world
    all write the same content, so only a writer of an older round racing a newer one could
    lower it, and that is what the round check in front of it is for."""
    with contextlib.suppress(FormatError):  # an unreadable fence is simply replaced
        current = read_fence(ckpt_dir)
        if current is not None and current.run_id == fence.run_id and current.round > fence.round:
            return False
    os.makedirs(ckpt_dir, exist_ok=True)
    # Unique per writer (several agents write it at once on shared storage), created with
    # O_EXCL | O_NOFOLLOW. The name starts with "fence.json." so the store's clean-up of
    # unfinished saves leaves it alone.
    smallfile.write_atomic(fence_path(ckpt_dir), fence.to_json())
    return True


def check_fence(ckpt_dir: str, fence: Fence | None, *, what: str = "commit refused") -> None:
    """Raise :class:`FencedError` unless a commit by ``fence`` may go ahead now.

    It may when the writer has no fence (plain torchrun), when ``ckpt_dir`` has no fence
    file, or when the file names exactly the writer's run and round. An unreadable fence
    file refuses the commit: a safety check fails closed. ``what`` starts the message
    (e.g. "checkpoint step 12 was not committed")."""
    if fence is None:
        return
    try:
        current = read_fence(ckpt_dir)
    except (FormatError, OSError) as exc:
        raise FencedError(
            f"{what}: cannot read the fence: {exc}",
            writer=fence,
            current=None,
        ) from exc
    if current is None or current == fence:
        return
    raise FencedError(
        f"{what}: fenced: this writer is "
        f"{fence.describe()}, but {fence_path(ckpt_dir)} names {current.describe()} "
        "(the world moved on without this node)",
        writer=fence,
        current=current,
    )
