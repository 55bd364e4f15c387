"""A committed checkpoint's manifest and tensor files, opened and checked, without torch.

:class:`CheckpointFiles` is what reading a checkpoint needs before any tensor: the step
directory held open, the manifest parsed and checked whole (:meth:`Manifest.from_json`),
each tensor file opened only as a regular file of the manifest's size, its header checked
against that size and its checksum, and each chunk's header entry against the manifest.
``elasticd ckpt ls``, ``inspect`` and ``verify`` use it alone, so they do not import torch
(a second a command on a small machine); :class:`checkpoint.load.Checkpoint` extends it
with the tensor reads.
"""

from __future__ import annotations

import hashlib
import math
import os
import weakref
from dataclasses import dataclass
from typing import Self

from checkpoint import store
from checkpoint.errors import (
    CheckpointError,
    CorruptCheckpointError,
    LayoutMismatchError,
    NoCheckpointError,
)
from checkpoint.manifest import (
    MANIFEST,
    MAX_MANIFEST_BYTES,
    Manifest,
    TensorEntry,
    parse_step_dirname,
    quoted,
)
from checkpoint.planner import SavedChunk
from checkpoint.seal import header_macs
from checkpoint.stfile import header_crcs, open_regular, read_header_fd, read_regular


@dataclass(slots=True)
class LoadStats:
    bytes_read: int = 0
    """Bytes read from tensor files (headers included)."""
    bytes_needed: int = 0
    """Bytes of the regions read from the checkpoint (not those received from a peer)."""
    bytes_received: int = 0
    """Bytes received from other ranks instead of read (``load_latest(broadcast=True)``)."""
    seconds: float = 0.0


class _OpenFile:
    """A tensor file whose size and header were checked, open for reading (``pread``: never
    memory-mapped, so a file truncated while it is read is an error, not a SIGBUS)."""

    def __init__(self, path: str, header: dict, data_start: int, fd: int) -> None:
        self.path = path
        self.header = header
        self.data_start = data_start
        self.fd = fd
        self._closer = weakref.finalize(self, os.close, fd)

    def close(self) -> None:
        self._closer()


_DIR_FLAGS = (
    getattr(os, "O_PATH", os.O_RDONLY)  # Linux: a handle to open files in, no read right needed
    | os.O_DIRECTORY
    | os.O_NOFOLLOW
    | getattr(os, "O_CLOEXEC", 0)
)


class CheckpointFiles:
    """One committed checkpoint, opened for checking: its manifest, parsed and checked
    whole, and its tensor files, each opened only as a regular file of the manifest's size
    with its header checked. Nothing here reads tensor data or imports torch
    (``elasticd ckpt ls``, ``inspect`` and ``verify`` need no more); :class:`checkpoint.load.Checkpoint`
    adds the reading.

    It holds its step directory open (``dir_fd``) and opens every file in that very
    directory: a step directory renamed, or replaced by a symlink to somewhere else, once
    it was opened (a swap race) does not change what is read."""

    def __init__(
        self, path: str, manifest: Manifest, dir_fd: int, key: bytes | None = None
    ) -> None:
        self.path = path
        self.manifest = manifest
        self.key = key
        """The seal key it was opened with (its manifest's seal checked): every block read
        is then checked against its MAC too. None: the seal is not checked."""
        self.dir_fd = dir_fd
        self._dir_closer = weakref.finalize(self, os.close, dir_fd)
        self.stats = LoadStats()
        self._handles: dict[str, _OpenFile] = {}
        self._files: dict[tuple[int, int], str] = {}
        """(device, inode) -> the name it was opened as: each name is a file of its own."""
        self.manifest_sha256 = ""
        """sha256 (hex) of the manifest's bytes as read (:meth:`open`): which save of its
        step this is. Two saves of one step differ at least in commit number and time, so
        the ranks of a load compare it to be sure they all opened the same one."""

    @classmethod
    def open(cls, path: str, *, key: bytes | None = None) -> Self:
        """Open a committed step directory; an uncommitted one is refused, and so is one
        whose manifest names another step than its directory's name. With ``key``, one
        whose manifest is not sealed with it (SealError)."""
        path = os.path.abspath(path)
        base = os.path.basename(path)
        step = parse_step_dirname(base)
        if step is None:
            raise NoCheckpointError(
                f"{path}: not a committed checkpoint directory (step-NNNNNNNNN)"
            )
        try:
            dir_fd = os.open(path, _DIR_FLAGS)
        except OSError as exc:
            if os.path.islink(path):
                # Another job's step (or anything) linked in under a step's name: never
                # followed.
                raise CorruptCheckpointError(
                    f"{path}: a symlink, not a step directory: refused (only a real "
                    "directory inside the checkpoint directory is a checkpoint)"
                ) from exc
            if isinstance(exc, (FileNotFoundError, NotADirectoryError)):
                raise NoCheckpointError(f"{path}: no such checkpoint") from exc
            raise CheckpointError(f"{path}: cannot open: {exc.strerror}") from exc
        try:
            where = os.path.join(path, MANIFEST)
            try:
                os.stat(MANIFEST, dir_fd=dir_fd, follow_symlinks=False)
            except FileNotFoundError:
                raise NoCheckpointError(
                    f"{path}: has no {MANIFEST}, so it was never committed"
                ) from None
            except OSError as exc:
                raise CheckpointError(f"{where}: cannot open: {exc.strerror}") from None
            raw = read_regular(where, max_bytes=MAX_MANIFEST_BYTES, dir_fd=dir_fd)
            manifest = Manifest.from_json(raw, where=where, key=key)
            if manifest.step != step:
                # A step copied or renamed in under another step's name: no reader takes
                # it for that step (a load falls back to an older one).
                raise CorruptCheckpointError(
                    f"{path}: manifest step {manifest.step} is not the step of its directory {base}"
                )
        except BaseException:
            os.close(dir_fd)
            raise
        opened = cls(path, manifest, dir_fd, key)
        opened.manifest_sha256 = hashlib.sha256(raw).hexdigest()
        return opened

    def open_file(self, name: str) -> tuple[int, int]:
        """``(fd, size)`` of the tensor file ``name`` of the manifest, opened in the step
        directory, only if it is a regular file of the manifest's size (the caller closes
        ``fd``)."""
        path = os.path.join(self.path, name)
        meta = self.manifest.files.get(name)
        if meta is None:
            raise CorruptCheckpointError(f"{path}: not listed in the manifest")
        # The name is a plain one (Manifest checked it), so it names a file of this directory.
        fd, size = open_regular(path, expect_bytes=meta.bytes, dir_fd=self.dir_fd)
        st = os.fstat(fd)
        seen = self._files.setdefault((st.st_dev, st.st_ino), name)
        if seen != name:  # a save writes every file anew: one listed twice is hostile
            os.close(fd)
            raise CorruptCheckpointError(f"{path}: the same file as {seen} (a hard link)")
        return fd, size

    @property
    def step(self) -> int:
        return self.manifest.step

    def close(self) -> None:
        """Close every file, the step directory's handle too: a read after this is one
        CorruptCheckpointError ("cannot open")."""
        for h in self._handles.values():
            h.close()
        self._handles.clear()
        self._dir_closer()
        self.dir_fd = -1  # never a number the process may reuse for another file

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def check_files(self) -> None:
        """Open every tensor file as a load would (a regular file of the manifest's size, its
        header checked against that size and its checksum) and match every chunk's header
        entry (and, in format version 4, its block checksums) to the manifest, reading no
        tensor data. Raises CorruptCheckpointError. A listed file no chunk uses is opened
        and checked too (a FIFO or a device there passed ``inspect`` and ``export``)."""
        for entry in self.manifest.tensors.values():
            # Cut a region at a time, not kept: it stops at the first chunk no file holds.
            for chunk in entry.each_chunk():
                f = self._chunk_span(chunk, entry)[0]
                self._crcs(entry, chunk, f)
                self._macs(entry, chunk, f)
        for file in self.manifest.files:
            self._handle(file)

    def _entry(self, name: str):
        entry = self.manifest.tensors.get(name)
        if entry is None:
            raise LayoutMismatchError(f"{self.path}: has no tensor {quoted(name)}")
        return entry

    def _handle(self, file: str) -> _OpenFile:
        h = self._handles.get(file)
        if h is not None:
            return h
        path = os.path.join(self.path, file)
        fd, size = self.open_file(file)
        meta = self.manifest.files[file]
        try:
            header, parsed = read_header_checked(fd, size, path)
            self.stats.bytes_read += len(header)
            if hashlib.sha256(header).hexdigest() != meta.header_sha256:
                raise CorruptCheckpointError(f"{path}: header checksum mismatch")
        except BaseException:
            os.close(fd)
            raise
        h = _OpenFile(path=path, header=parsed, data_start=len(header), fd=fd)
        self._handles[file] = h
        return h

    def _crcs(self, entry: TensorEntry, chunk: SavedChunk, f: _OpenFile) -> str:
        """The checksums of ``chunk``'s blocks: from the manifest up to format version 3,
        from its file's header (checked against the manifest's ``header_sha256`` when the
        file was opened) in version 4."""
        if self.manifest.version < 4:
            return entry.crc32[(chunk.file, chunk.key)]
        return header_crcs(f.header, chunk.key, entry.blocks(chunk), f.path)

    def _macs(self, entry: TensorEntry, chunk: SavedChunk, f: _OpenFile) -> str:
        """The MACs of ``chunk``'s blocks from its file's header (a sealed step opened
        with its key: :mod:`checkpoint.seal`), or "" when the step was opened without a
        key."""
        if self.key is None:
            return ""
        return header_macs(f.header, chunk.key, entry.blocks(chunk), f.path)

    def _chunk_span(self, chunk: SavedChunk, entry: TensorEntry) -> tuple[_OpenFile, int, int]:
        """Where a chunk lies in its file (offset, bytes), after its header entry (whose
        offsets were checked against the file when it was opened) matches the manifest."""
        f = self._handle(chunk.file)
        info = f.header.get(chunk.key)
        nbytes = math.prod(chunk.sizes) * entry.itemsize
        if (
            not isinstance(info, dict)
            or info.get("dtype") != entry.st_code
            or info.get("shape") != list(chunk.sizes)
        ):
            raise CorruptCheckpointError(
                f"{f.path}: {quoted(chunk.key)}: missing or not as the manifest says"
            )
        return f, f.data_start + info["data_offsets"][0], nbytes


def read_header_checked(fd: int, size: int, path: str) -> tuple[bytes, dict]:
    """:func:`checkpoint.stfile.read_header_fd`, whose JSON parse may also raise a plain
    ValueError (an integer of over 4300 digits): refused in one line like any bad header."""
    try:
        return read_header_fd(fd, size, path)
    except ValueError as exc:
        text = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise CorruptCheckpointError(f"{path}: header is not valid JSON ({text[:200]})") from None


def step_to_open(ckpt_dir: str, step: int | None = None, key: bytes | None = None) -> str:
    """The directory of ``step`` of a checkpoint directory (default: the newest commit, as
    a load with ``key`` would take it)."""
    if step is None:
        order = store.load_order(ckpt_dir, key)
        if not order:
            raise NoCheckpointError(f"{ckpt_dir}: no committed checkpoint")
        step = order[0]
    return store.step_path(ckpt_dir, step)
