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
import math
import os
import re
import resource
import secrets
import stat
from collections.abc import Callable
from typing import Any

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
        raise kind(f"{path}: cannot open: {exc.strerror}{_limit_said(exc)}") from exc
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise error(f"{path}: not a regular file")
    except BaseException:
        os.close(fd)
        raise
    return fd, st


def _limit_said(exc: OSError) -> str:
    """What to do about an open refused for this process's own limit on open files (the
    checkpoint is not at fault: a load stops there rather than fall back past it)."""
    if exc.errno != errno.EMFILE:
        return ""
    with contextlib.suppress(OSError, ValueError):
        soft, hard = (
            "unlimited" if n == resource.RLIM_INFINITY else n
            for n in resource.getrlimit(resource.RLIMIT_NOFILE)
        )
        return (
            f" (this process may hold {soft} open files, its hard limit {hard}: raise the "
            "limit, `ulimit -n`, or LimitNOFILE= in a systemd unit)"
        )
    return ""


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
    """:func:`loads` of ``data``; a file that is not JSON (not UTF-8, malformed, nested too
    deep for the parser, holding ``NaN`` or ``Infinity``, which Python's parser takes, or a
    number or string :func:`loads` refuses) raises ``error``: ``<where>: not <what>
    (<why>)``."""
    try:
        return loads(data)
    except RecursionError as exc:
        raise error(f"{where}: not {what} (nested too deep)") from exc
    except ValueError as exc:  # JSONDecodeError and UnicodeDecodeError both
        raise error(f"{where}: not {what} ({_first_line(exc)})") from exc


def loads(data: bytes, *, utf8_strings: bool = False) -> Any:
    """``json.loads`` of checkpoint input, strictly JSON text in UTF-8, as the format says:

    - the bytes are decoded as UTF-8 first (``json.loads`` of bytes would detect UTF-16
      and UTF-32 and take them, which safetensors and other readers do not), and a byte
      order mark is refused;
    - ``NaN``, ``Infinity`` and ``-Infinity`` are not JSON, and neither is a number out
      of a double's range (``1e400`` parses as ``inf``, which ``json.dumps`` writes back as
      ``Infinity``): refused naming where it is (``extra.lr: 1e400 is not a finite
      number``);
    - with ``utf8_strings``, a string or key with a lone surrogate (``"\\ud800"``, a valid
      JSON escape) is not UTF-8 text, and is refused naming where it is: safetensors
      refuses such a header, and such a name cannot be a file's. (A manifest refuses it
      in a tensor name only, which an export writes: its job may hold one, and is shown
      escaped.)

    Raises ValueError (RecursionError for nesting deeper than the parser goes)."""
    if data[:3] == b"\xef\xbb\xbf":
        raise ValueError("starts with a byte order mark (JSON here is UTF-8 without one)")
    text = data.decode("utf-8")  # UnicodeDecodeError is a ValueError
    infinite: list[str] = []

    def finite(number: str) -> Any:
        value = float(number)
        if math.isfinite(value):
            return value
        infinite.append(number)
        return _Infinite(number)

    obj = json.loads(text, parse_constant=_not_json, parse_float=finite)
    # Found in the text, it may be gone from the value (a duplicate key's later value
    # replaces it): refused all the same, as the text's.
    if infinite:
        where, value = _find(obj, lambda v: isinstance(v, _Infinite), keys=False)
        number = value.text if isinstance(value, _Infinite) else infinite[0]
        raise ValueError(f"{where}: {_cut(number)} is not a finite number")
    if utf8_strings and lone_surrogate(data):
        where, value = _find(obj, _not_utf8, keys=True)
        shown = _cut(ascii(value)) if isinstance(value, str) else "a string"
        raise ValueError(f"{where}: {shown} holds a lone surrogate, which is not UTF-8 text")
    return obj


class _Infinite:
    """A number :func:`loads` found out of a double's range, until it says where."""

    __slots__ = ("text",)

    def __init__(self, text: str) -> None:
        self.text = text


_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F][0-9a-fA-F]{2}")
_SURROGATE_PAIR = re.compile(rb"\\u[dD][89abAB][0-9a-fA-F]{2}\\u[dD][c-fC-F][0-9a-fA-F]{2}")


def lone_surrogate(data: bytes) -> bool:
    """Whether the UTF-8 JSON text ``data`` escapes a surrogate that is not half of a pair
    (UTF-8 itself cannot hold one: the decode refused it). Read from the text at C speed:
    the first search fails on nearly every file (non-ASCII names written by ``json.dumps``
    are escaped, but only those past U+FFFF are pairs). Outside strings valid JSON has no
    backslash, so escapes pair from the left: escaped backslashes go first."""
    if _SURROGATE_ESCAPE.search(data) is None:
        return False
    plain = _SURROGATE_PAIR.sub(b"", data.replace(b"\\\\", b"__"))
    return _SURROGATE_ESCAPE.search(plain) is not None


def _not_utf8(value: object) -> bool:
    return isinstance(value, str) and not utf8_text(value)


def utf8_text(text: str) -> bool:
    """Whether ``text`` is UTF-8 text: it holds no lone surrogate (which JSON's ``\\u``
    escapes can make, and which no file, header or name on disk can hold)."""
    if text.isascii():
        return True
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _find(obj: object, match: Callable[[object], bool], *, keys: bool) -> tuple[str, Any]:
    """The place (``extra.deep.a[1]``; ``key in tensors`` for a key) and the first value
    of the parsed JSON ``obj`` that ``match`` (``keys``: keys too), walked without
    recursion; ``("the text", None)`` if there is none. Only ever walks input already
    refused."""
    stack: list[tuple[str, object]] = [("", obj)]
    while stack:
        where, value = stack.pop()
        if match(value):
            return where or "the top level", value
        if isinstance(value, dict):
            items = list(value.items())
            for key, inner in reversed(items):
                stack.append((_path(where, key), inner))
            if keys:
                for key in value:
                    if match(key):
                        return f"a key in {where or 'the top level'}", key
        elif isinstance(value, list):
            stack.extend((f"{where}[{i}]", inner) for i, inner in reversed(list(enumerate(value))))
    return "the text", None


def _path(where: str, key: str) -> str:
    shown = key if key.isprintable() and key and "." not in key else ascii(key)
    return f"{where}.{shown}" if where else shown


def _cut(text: str, limit: int = 80) -> str:
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _first_line(exc: BaseException) -> str:
    text = str(exc).splitlines()
    return text[0][:300] if text else type(exc).__name__


def _not_json(constant: str) -> object:
    raise ValueError(f"{constant} is not a JSON value")


def create_new(path: str, *, error: type[CheckpointError] = CheckpointError) -> int:
    """``path`` created anew and opened for writing (``O_CREAT | O_EXCL | O_NOFOLLOW``), for
    a file in a directory the writer itself just made (a save's ``step-N.<token>.tmp``,
    where its manifest goes): anything already there under that name (a symlink planted to
    a file elsewhere, a file) was put there by someone else, so the write is refused in
    one line (``error``) and nothing is written through it. The caller closes the fd."""
    try:
        return os.open(path, _CREATE_FLAGS, 0o644)
    except FileExistsError:
        kind = "a symlink" if os.path.islink(path) else "something"
        raise error(
            f"{path}: {kind} is already there, in this writer's own new directory "
            "(planted); not written through"
        ) from None


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
