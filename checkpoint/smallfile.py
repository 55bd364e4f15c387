"""Reading and replacing the small files of a checkpoint directory, safely.

``owner.json``, ``fence.json``, ``latest`` and ``unloadable.json`` sit in a directory that
other jobs, users or a hostile copy may have written to, so none is trusted to be what its
name says (docs/checkpoint-format.md, "Hostile checkpoints"):

- a reader opens with ``O_NOFOLLOW | O_NONBLOCK``, takes the type and size from ``fstat``
  of the descriptor, refuses anything but a regular file of at most
  :data:`MAX_SMALL_FILE_BYTES`, and reads at most one byte more than that: a FIFO does not
  hang it, a symlink to ``/dev/zero`` does not exhaust memory, and a file that grows while
  read is refused;
- JSON that does not parse, is not UTF-8 or nests too deep (``RecursionError``) becomes the
  caller's own error, one line naming the file;
- a writer creates its temporary file under an unpredictable name with ``O_CREAT | O_EXCL
  | O_NOFOLLOW`` (so a planted symlink is never written through), fsyncs it, renames it
  over the target and fsyncs the directory; on failure the temporary is removed.

Standard library only (and :mod:`checkpoint.errors`), like :mod:`checkpoint.owner` and
:mod:`checkpoint.fence`, which use it.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import secrets
import stat
from collections.abc import Callable

from checkpoint.errors import CheckpointError

MAX_SMALL_FILE_BYTES = 1 << 20
"""The largest control file read (owner, fence, `latest`, unloadable record)."""

_READ_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0)
_CREATE_FLAGS = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0)


def open_regular(
    path: str,
    *,
    error: type[CheckpointError],
    missing_ok: bool = False,
    dir_fd: int | None = None,
    unreadable: type[CheckpointError] | None = None,
) -> tuple[int, os.stat_result] | None:
    """``(fd, fstat)`` of ``path`` opened for reading, only if it is a regular file: a
    symlink (``O_NOFOLLOW``), a FIFO (``O_NONBLOCK`` keeps its open from blocking), a device
    or a directory raises ``error``, one line naming the file; the type comes from ``fstat``
    of the very file opened. A missing file is None with ``missing_ok``, else ``error``.
    With ``dir_fd`` (an open directory), the last part of ``path`` is opened in that very
    directory, whatever its name points to by now. The caller closes ``fd``.

    ``unreadable`` (default ``error``): raised instead for an open refused for a reason
    outside the file's content (permissions, I/O): a step's tensor files pass
    :class:`CheckpointReadError`, which a load stops on rather than fall back past. What
    is there instead of a file (a symlink, a socket, a directory) stays ``error``."""
    name = path if dir_fd is None else os.path.basename(path)
    try:
        fd = os.open(name, _READ_FLAGS, dir_fd=dir_fd)
    except FileNotFoundError as exc:
        if missing_ok:
            return None
        raise error(f"{path}: file is missing") from exc
    except OSError as exc:
        with contextlib.suppress(OSError):
            if stat.S_ISLNK(os.lstat(name, dir_fd=dir_fd).st_mode):
                raise error(f"{path}: a symlink, not a regular file") from exc
        # What is there instead of a file, or a refusal outside the content (EACCES, EIO).
        there = exc.errno in (errno.ENXIO, errno.ELOOP, errno.ENOTDIR, errno.EISDIR)
        kind = error if there else (unreadable or error)
        raise kind(f"{path}: cannot open: {exc.strerror}") from exc
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise error(f"{path}: not a regular file")
    except BaseException:
        os.close(fd)
        raise
    return fd, st


def read_small(
    path: str,
    *,
    error: type[CheckpointError] = CheckpointError,
    max_bytes: int = MAX_SMALL_FILE_BYTES,
) -> bytes | None:
    """The bytes of the small regular file ``path``, or None when there is none.

    Anything else there (a symlink, a FIFO, a device, a directory, a file above
    ``max_bytes``, one that cannot be read) raises ``error``, one line naming the file."""
    opened = open_regular(path, error=error, missing_ok=True)
    if opened is None:
        return None
    fd, st = opened
    try:
        if st.st_size > max_bytes:
            raise error(f"{path}: {st.st_size} bytes, more than {max_bytes}")
        out = bytearray()
        while len(out) <= max_bytes:
            got = os.read(fd, max_bytes + 1 - len(out))
            if not got:
                break
            out += got
        if len(out) > max_bytes:
            raise error(f"{path}: more than {max_bytes} bytes")
        return bytes(out)
    except OSError as exc:
        raise error(f"{path}: cannot read: {exc.strerror}") from exc
    finally:
        os.close(fd)


def parse_json(
    data: bytes, *, where: str, what: str = "JSON", error: type[CheckpointError] = CheckpointError
) -> object:
    """``json.loads(data)``; a file that is not JSON (not UTF-8, malformed, nested too deep
    for the parser, or holding ``NaN`` or ``Infinity``, which Python's parser takes) raises
    ``error``: ``<where>: not <what> (<why>)``."""
    try:
        return json.loads(data, parse_constant=_not_json)
    except RecursionError as exc:
        raise error(f"{where}: not {what} (nested too deep)") from exc
    except ValueError as exc:  # JSONDecodeError and UnicodeDecodeError both
        raise error(f"{where}: not {what} ({exc})") from exc


def _not_json(constant: str) -> object:
    raise ValueError(f"{constant} is not a JSON value")


def create_temp(path: str) -> tuple[int, str]:
    """A new, empty file next to ``path`` named ``<name>.<16 hex>.tmp``, opened for writing
    with ``O_EXCL | O_NOFOLLOW``: returns ``(fd, tmp_path)``; the caller closes ``fd``."""
    for _ in range(16):
        tmp = f"{path}.{secrets.token_hex(8)}.tmp"
        try:
            return os.open(tmp, _CREATE_FLAGS, 0o644), tmp
        except FileExistsError:
            continue
    raise FileExistsError(f"{path}: cannot create a temporary file next to it")


def write_atomic(
    path: str, data: bytes, *, before_rename: Callable[[], None] | None = None
) -> None:
    """Replace ``path`` with ``data`` atomically: a new temporary file (:func:`create_temp`),
    fsync, rename over ``path``, fsync the directory. ``before_rename()`` runs between the
    fsync and the rename (tests aim a SIGKILL there)."""
    fd, tmp = create_temp(path)
    try:
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view) :]
            os.fsync(fd)
        finally:
            os.close(fd)
        if before_rename is not None:
            before_rename()
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    dfd = os.open(os.path.dirname(os.path.abspath(path)), os.O_RDONLY)
    try:
        os.fsync(dfd)
    finally:
        os.close(dfd)
