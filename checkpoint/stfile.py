"""Writing safetensors files straight from a staging buffer, hashing as we go; fsync helpers.

We write the (simple, documented) safetensors layout ourselves rather than through
``safetensors.torch.save_file`` so that one pass over the bytes writes them, checksums
each chunk and the whole file, and fsyncs, without another copy. Any safetensors reader
(``safe_open``, ``load_file``) reads the result.
"""

from __future__ import annotations

import array
import ctypes
import ctypes.util
import hashlib
import json
import math
import os
import re
import struct
import sys
import zlib
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING

import crc32c

from checkpoint import seal, smallfile
from checkpoint.errors import CheckpointReadError, CorruptCheckpointError, SaveRefusedError
from checkpoint.manifest import lower_hex, quoted, st_code

if TYPE_CHECKING:  # imported where a tensor is written: reading needs no torch
    import torch


@dataclass(frozen=True, slots=True)
class FileSlot:
    """One tensor of a file: where its bytes sit in the data section (== in the staging)."""

    key: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    begin: int
    end: int
    block_rows: int = 0
    """Rows per verify block (format version 3); 0: one checksum for the whole slot."""

    @property
    def block_bytes(self) -> int:
        """Bytes per verify block (0: the whole slot is one block)."""
        if not self.block_rows:
            return 0
        return self.block_rows * math.prod(self.shape[1:]) * self.dtype.itemsize


@dataclass(frozen=True, slots=True)
class WrittenFile:
    bytes: int
    header_sha256: str
    chunk_crc32: dict[str, str]
    """The CRC-32C of each verify block of each chunk, 8 hex digits each, concatenated,
    by key (format version 3)."""


_U32 = next(code for code in "IL" if array.array(code).itemsize == 4)
"""The array type code of a 32-bit unsigned integer."""


CRC_META = "crc32c:"
"""Format version 4 keeps each tensor's block checksums in its file's header: the
``__metadata__`` entry ``crc32c:<key>`` holds the CRC-32C of each verify block of tensor
``<key>``, 8 hex digits each, concatenated (:func:`block_crc32c`). The manifest's
``header_sha256`` covers them, so they are as trusted as the manifest, and the manifest's
size no longer grows with the checkpoint's bytes (in version 3 it held them: 8 bytes per
16 KiB block, over its 64 MiB bound from about 128 GiB of state on)."""


def crc_count(nbytes: int, block_bytes: int) -> int:
    """How many checksums :func:`block_crc32c` gives ``nbytes`` in blocks of ``block_bytes``."""
    return 1 if not block_bytes or nbytes <= block_bytes else -(-nbytes // block_bytes)


def header_bytes(
    slots: Sequence[FileSlot],
    crcs: Mapping[str, str] | None = None,
    *,
    sealed: bool = False,
    macs: Mapping[str, str] | None = None,
) -> bytes:
    """The 8-byte length and the JSON header, padded with spaces to a multiple of 8, with
    each slot's block checksums from ``crcs`` (format version 4, :data:`CRC_META`) and,
    ``sealed``, its block MACs from ``macs`` (:data:`checkpoint.seal.MAC_META`); without
    them, zeros in their place: a header of the very same length, written before the data
    and overwritten once the checksums are known."""
    meta = {"format": "pt", "writer": "elasticd"}
    for s in slots:
        n = crc_count(s.end - s.begin, s.block_bytes)
        meta[CRC_META + s.key] = crcs[s.key] if crcs is not None else "0" * 8 * n
        if sealed:
            meta[seal.MAC_META + s.key] = macs[s.key] if macs is not None else seal.placeholder(n)
    head: dict[str, object] = {"__metadata__": meta}
    for s in slots:
        head[s.key] = {
            "dtype": st_code(s.dtype),
            "shape": list(s.shape),
            "data_offsets": [s.begin, s.end],
        }
    text = json.dumps(head, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    return struct.pack("<Q", len(text)) + text


def write_file(
    path: str,
    slots: Sequence[FileSlot],
    data: torch.Tensor | Callable[[int], memoryview],
    *,
    hasher_pool: ThreadPoolExecutor,
    key: bytes | None = None,
) -> WrittenFile:
    """Write the data section under a header for ``slots``; fsync the file. ``data`` is the
    whole data section (uint8, a staging buffer), or a function giving slot ``i``'s bytes
    (which may copy a piece that is not contiguous).

    Each chunk's block CRC-32Cs run on ``hasher_pool`` while this thread writes it, and
    with a function the next slot's bytes are made there too (all of it releases the GIL),
    so checksums and copies overlap the writes; there is no whole-file hash to wait for.
    With ``key`` (a sealed save: :mod:`checkpoint.seal`), each block's MAC is computed
    there too, and kept in the header beside its CRC.
    """
    header = header_bytes(slots, sealed=key is not None)
    if len(header) - 8 > MAX_HEADER_BYTES:  # every load would refuse the file
        raise SaveRefusedError(
            f"{path}: a header of {len(header) - 8} bytes ({len(slots)} tensors), more than "
            f"the {MAX_HEADER_BYTES} a load reads"
        )
    if smallfile.lone_surrogate(header):  # json.dumps escapes it; every load refuses it
        bad = next(s.key for s in slots if not smallfile.utf8_text(s.key))
        raise SaveRefusedError(
            f"{path}: tensor key {quoted(bad)} holds a lone surrogate, which is not UTF-8 "
            "text (every load would refuse the file)"
        )
    if callable(data):
        part_of = data
    else:
        view = memoryview(data.numpy()) if data.numel() else memoryview(b"")

        def part_of(i: int) -> memoryview:
            return view[slots[i].begin : slots[i].end]

    pending = {}
    pending_macs = {}
    ahead = None
    # The save's own new directory; O_NOFOLLOW all the same: never write through a link.
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o644)
    try:
        write_all(fd, header)
        early = EarlyWriteback(fd, len(header))
        if slots and callable(data):
            ahead = hasher_pool.submit(part_of, 0)
        for i, s in enumerate(slots):
            if ahead is not None:
                part = ahead.result()
                ahead = hasher_pool.submit(part_of, i + 1) if i + 1 < len(slots) else None
            else:
                part = part_of(i)
            if len(part) != s.end - s.begin:
                raise ValueError(f"{s.key}: {len(part)} bytes for a slot of {s.end - s.begin}")
            pending[s.key] = hasher_pool.submit(block_crc32c, part, s.block_bytes)
            if key is not None:
                pending_macs[s.key] = hasher_pool.submit(seal.block_macs, part, s.block_bytes, key)
            write_all(fd, part)
            early.wrote(len(part))
        chunk_crc = {k: p.result() for k, p in pending.items()}
        macs = {k: p.result() for k, p in pending_macs.items()}
        final = header_bytes(slots, chunk_crc, sealed=key is not None, macs=macs)
        if len(final) != len(header):  # the checksums' lengths come from the slots alone
            raise ValueError(f"{path}: the header grew from {len(header)} to {len(final)} bytes")
        pwrite_all(fd, final, 0)
        header = final
        os.fsync(fd)
    finally:
        for p in [*pending.values(), *pending_macs.values()]:
            p.cancel()
        if ahead is not None:
            ahead.cancel()
        os.close(fd)
    return WrittenFile(
        bytes=len(header) + (slots[-1].end if slots else 0),
        header_sha256=hashlib.sha256(header).hexdigest(),
        chunk_crc32=chunk_crc,
    )


def crc32_hex(buf: memoryview | bytes) -> str:
    """The CRC-32 (zlib's polynomial) of ``buf`` as 8 hex digits (format version 1)."""
    return f"{zlib.crc32(buf) & 0xFFFFFFFF:08x}"


def crc32c_hex(buf: memoryview | bytes) -> str:
    """The CRC-32C (Castagnoli; hardware SSE4.2 / ARMv8 through the ``crc32c`` package) of
    ``buf`` as 8 hex digits (format version 2)."""
    return f"{crc32c.crc32c(buf) & 0xFFFFFFFF:08x}"


def block_crc32c(buf: memoryview | bytes, block_bytes: int) -> str:
    """The CRC-32C of each ``block_bytes`` of ``buf`` (the last one may be shorter), 8 hex
    digits each, concatenated; ``block_bytes`` 0 (or an empty ``buf``): one for all of it."""
    return block_checksums(buf, block_bytes, crc32c.crc32c)


def block_checksums(buf: memoryview | bytes, block_bytes: int, crc: Callable) -> str:
    """:func:`block_crc32c` with another CRC function (``zlib.crc32``, or ``crc32c.crc32c``)."""
    view = memoryview(buf)
    if not block_bytes or len(view) <= block_bytes:
        return f"{crc(view) & 0xFFFFFFFF:08x}"
    # One C call per block, the checksums packed as big-endian words, then hex in one go.
    sums = array.array(
        _U32, map(crc, [view[i : i + block_bytes] for i in range(0, len(view), block_bytes)])
    )
    if sys.byteorder == "little":
        sums.byteswap()
    return sums.tobytes().hex()


def blocks_match(buf: memoryview, block_bytes: int, expected: str, crc: Callable) -> bool:
    """Whether the blocks of ``buf`` have the ``expected`` checksums (see :func:`block_crc32c`)."""
    return block_checksums(buf, block_bytes, crc) == expected


def pread_into(fd: int, view: memoryview, offset: int, path: str) -> None:
    """Fill ``view`` with the file's bytes from ``offset`` (a file shorter than that is
    truncated: CorruptCheckpointError)."""
    got = 0
    while got < len(view):
        try:
            n = os.preadv(fd, [view[got:]], offset + got)
        except OSError as exc:  # EIO: the disk's, not the step's (a load stops on it)
            raise CheckpointReadError(f"{path}: cannot read: {exc.strerror}") from exc
        if not n:
            raise CorruptCheckpointError(f"{path}: truncated (shorter than it was)")
        got += n


def chunk_checksum(version: int):
    """The chunk checksum function of a format version."""
    return crc32_hex if version == 1 else crc32c_hex


WRITEBACK_BYTES = 8 << 20
"""How many bytes written :class:`EarlyWriteback` lets pile up before it starts their
writeback (2, 8 and 32 MiB measured alike on the benchmark's disk)."""


def _libc_sync_file_range():
    """libc's ``sync_file_range`` (Linux), or None where there is none."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        func = ctypes.CDLL(ctypes.util.find_library("c") or None, use_errno=True).sync_file_range
    except (OSError, AttributeError):
        return None
    func.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint]
    func.restype = ctypes.c_int
    return func


_SYNC_FILE_RANGE = _libc_sync_file_range()
_SYNC_FILE_RANGE_WRITE = 2  # <linux/fs.h>: start writeback of the range's dirty pages, no wait


class EarlyWriteback:
    """Start the writeback of a file being written sequentially every
    :data:`WRITEBACK_BYTES`, so that the disk works while the writer is still copying and
    checksumming, and the final fsync waits for little more than the last piece.

    ``sync_file_range(SYNC_FILE_RANGE_WRITE)`` only starts writing pages out: it makes
    nothing durable (the fsync after the last write does) and waits for no I/O. Where it is
    missing (not Linux) or fails (a file system without it), this does nothing."""

    __slots__ = ("end", "fd", "started")

    def __init__(self, fd: int, end: int = 0) -> None:
        self.fd = fd
        self.started = 0
        """Bytes from 0 whose writeback has been started."""
        self.end = end
        """Bytes written so far."""

    def wrote(self, n: int) -> None:
        """``n`` more bytes were written at the end."""
        self.end += n
        if self.fd < 0 or _SYNC_FILE_RANGE is None or self.end - self.started < WRITEBACK_BYTES:
            return
        if _SYNC_FILE_RANGE(self.fd, self.started, self.end - self.started, _SYNC_FILE_RANGE_WRITE):
            self.fd = -1  # unsupported here (EINVAL, ENOSYS, ESPIPE): the fsync does it all
            return
        self.started = self.end


def pwrite_all(fd: int, buf: memoryview | bytes, offset: int) -> None:
    view = memoryview(buf)
    while view:
        n = os.pwrite(fd, view[: 1 << 30], offset)
        view, offset = view[n:], offset + n


def header_crcs(header: dict, key: str, blocks: int, path: str) -> str:
    """The block checksums of tensor ``key`` in a parsed format-version-4 header
    (:data:`CRC_META`): ``blocks`` checksums of 8 lowercase hex digits, concatenated, or
    CorruptCheckpointError naming what is wrong."""
    meta = header.get("__metadata__")
    text = meta.get(CRC_META + key) if isinstance(meta, dict) else None
    if not isinstance(text, str) or len(text) != 8 * blocks or not lower_hex(text):
        raise CorruptCheckpointError(
            f"{path}: {quoted(key)}: the header does not hold its {blocks} block checksums "
            "(8 hex digits each)"
        )
    return text


def write_all(fd: int, buf: memoryview | bytes) -> None:
    view = memoryview(buf)
    while view:
        n = os.write(fd, view[: 1 << 30])
        view = view[n:]


def open_regular(
    path: str,
    *,
    expect_bytes: int | None = None,
    max_bytes: int | None = None,
    dir_fd: int | None = None,
):
    """Open ``path`` for reading only if it is a regular file (not a symlink, a device or a
    FIFO) of the expected size; returns ``(fd, size)``; the caller closes ``fd``.

    ``O_NOFOLLOW`` refuses a symlink (say, to /dev/zero or out of the step directory) and
    ``O_NONBLOCK`` keeps the open of a FIFO from blocking; the file type and size then come
    from ``fstat`` of the very file opened, so nothing is read before they are checked.
    With ``dir_fd``, the file is opened in that open directory (the step directory a
    :class:`checkpoint.load.Checkpoint` holds), not through the path's directories."""
    fd, st = smallfile.open_regular(path, error=CorruptCheckpointError, dir_fd=dir_fd,
                                    unreadable=CheckpointReadError)  # fmt: skip
    try:
        if expect_bytes is not None and st.st_size != expect_bytes:
            raise CorruptCheckpointError(
                f"{path}: {st.st_size} bytes, the manifest says {expect_bytes}"
            )
        if max_bytes is not None and st.st_size > max_bytes:
            raise CorruptCheckpointError(f"{path}: {st.st_size} bytes, more than {max_bytes}")
    except BaseException:
        os.close(fd)
        raise
    return fd, st.st_size


def read_regular(path: str, *, max_bytes: int, dir_fd: int | None = None) -> bytes:
    """The whole of a small regular file (see :func:`open_regular`)."""
    fd, size = open_regular(path, max_bytes=max_bytes, dir_fd=dir_fd)
    try:
        return read_exact(fd, 0, size, path)
    finally:
        os.close(fd)


def read_exact(fd: int, offset: int, n: int, path: str) -> bytes:
    out = bytearray()
    while len(out) < n:
        try:
            got = os.pread(fd, n - len(out), offset + len(out))
        except OSError as exc:  # as pread_into
            raise CheckpointReadError(f"{path}: cannot read: {exc.strerror}") from exc
        if not got:
            raise CorruptCheckpointError(f"{path}: truncated (shorter than it was)")
        out += got
    return bytes(out)


# safetensors dtype codes and their item sizes (the codes this store writes).
ITEMSIZE = {
    "F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2, "I8": 1,
    "U8": 1, "BOOL": 1,
}  # fmt: skip
MAX_HEADER_BYTES = 100 << 20
MAX_SHAPE_DIMS = 8
"""Dimensions a tensor in a header may have (as in a manifest): a shape of thousands of
huge dimensions would make even multiplying them out take minutes."""
HEADER_CONTAINER_BYTES = 16
"""At most one JSON list or object per this many bytes of a header (an entry has three in
about 50 bytes): a header of nothing but ``[]`` would cost 30 times its size in memory."""
HEADER_VALUE_BYTES = 3
"""At most one JSON value (counted by the commas and colons outside strings) per this many
bytes of a header: real ones have one per 10 to 17 (this store's, Hugging Face's), a 0-d
tensor of a one-letter name one per 6.5, a shape of eight 1s one per 4.5. What passes the
count costs at most 8 times its text once parsed (``1.5,``, a float in 4 bytes; a header
holds none, and one is refused once parsed, below); before any bound a 100 MiB header of
them took a reader over 1 GB, and every open file kept its own."""
HEADER_STRING_BYTES = 8
"""At most one JSON string per this many bytes of a header (the shortest entry has one per
10 bytes): a list of short strings costs 12 times its size in memory once parsed."""


def read_header_fd(
    fd: int, size: int, path: str, *, unknown_dtypes: bool = False
) -> tuple[bytes, dict]:
    """The raw header bytes (length prefix included) and the parsed, checked header of an
    open safetensors file of ``size`` bytes.

    Every entry is checked against the file before anything trusts it: a known dtype, a
    shape, and ``data_offsets`` with ``0 <= begin <= end <= data length`` and
    ``end - begin`` the bytes of that dtype and shape. With ``unknown_dtypes`` (a Hugging
    Face file may hold a tensor of a dtype this store never writes, say ``F8_E4M3``), an
    entry of another dtype passes with its offsets in range, for the caller to refuse if
    it needs that tensor."""
    if size < 8:
        raise CorruptCheckpointError(f"{path}: truncated safetensors header")
    (n,) = struct.unpack("<Q", read_exact(fd, 0, 8, path))
    if n > MAX_HEADER_BYTES or 8 + n > size:
        raise CorruptCheckpointError(
            f"{path}: header length {n} does not fit a file of {size} bytes"
        )
    text = read_exact(fd, 8, n, path)
    _check_density(text, path)
    try:
        # UTF-8 text only, as safetensors reads it (json.loads of bytes takes UTF-16 and
        # UTF-32 too); no NaN or Infinity, no number beyond a double, no lone surrogate.
        parsed = smallfile.loads(text, utf8_strings=True)
    except RecursionError as exc:
        raise CorruptCheckpointError(f"{path}: header is not valid JSON (nested too deep)") from exc
    except ValueError as exc:  # JSONDecodeError, UnicodeDecodeError, 5000 digits
        why = str(exc).splitlines()[0][:300] if str(exc) else type(exc).__name__
        raise CorruptCheckpointError(f"{path}: header is not valid JSON ({why})") from exc
    if not isinstance(parsed, dict):
        raise CorruptCheckpointError(f"{path}: header is not a JSON object")
    meta = parsed.get("__metadata__")
    meta = {} if meta is None else meta  # safetensors reads null as no metadata
    # safetensors' own reader takes only a map of strings (or null) here; anything else
    # is not a file it wrote, and a reader would keep it for as long as the file is open.
    if not isinstance(meta, dict) or not all(type(v) is str for v in meta.values()):
        raise CorruptCheckpointError(f"{path}: header's __metadata__ is not an object of strings")
    data_len = size - 8 - n
    for key, info in parsed.items():
        if key == "__metadata__":
            continue
        problem = _entry_problem(info, data_len, unknown_dtypes)
        if problem is None and not unknown_dtypes and len(info) != len(ENTRY_FIELDS):
            # This store writes these three fields and no more: anything beside them is
            # not its file's (and, parsed, may be a long list of numbers kept in memory).
            problem = f"has fields other than {', '.join(ENTRY_FIELDS)}"
        if problem:
            raise CorruptCheckpointError(f"{path}: header entry {quoted(key)}: {problem}")
    return struct.pack("<Q", n) + text, parsed


def _check_density(text: bytes, path: str) -> None:
    """Refuse, before it is parsed, a header of more JSON lists, objects, values or strings
    per byte than any real header has (:data:`HEADER_CONTAINER_BYTES`,
    :data:`HEADER_VALUE_BYTES`, :data:`HEADER_STRING_BYTES`): parsed, such a header costs
    10 to 30 times its size in memory. The brackets and separators are counted outside the
    strings (a ``__metadata__`` value may be JSON in a string) once counting them
    anywhere passes the bound. Linear, in C: escapes blanked, then every string emptied."""
    n = len(text)
    bounds = {
        "lists or objects": (b"[{", n // HEADER_CONTAINER_BYTES + 64, HEADER_CONTAINER_BYTES),
        "values": (b",:", n // HEADER_VALUE_BYTES + 64, HEADER_VALUE_BYTES),
    }
    blanked = plain = None  # escapes blanked; then every string emptied too
    for what, (chars, bound, per) in bounds.items():
        count = sum(text.count(bytes([c])) for c in chars)
        if count > bound:
            if plain is None:
                blanked = text.replace(b"\\\\", b"__").replace(b'\\"', b"__")
                plain = _STRING.sub(b'""', blanked)
            count = sum(plain.count(bytes([c])) for c in chars)
        if count > bound:
            raise CorruptCheckpointError(
                f"{path}: header has {count} JSON {what} in {n} bytes, more than one per "
                f"{per} bytes"
            )
    # An escaped quote is no string's end: an upper bound on the strings, then exact.
    strings = text.count(b'"') // 2
    if strings > n // HEADER_STRING_BYTES + 64:
        if blanked is None:
            blanked = text.replace(b"\\\\", b"__").replace(b'\\"', b"__")
        strings = blanked.count(b'"') // 2
        if strings > n // HEADER_STRING_BYTES + 64:
            raise CorruptCheckpointError(
                f"{path}: header has {strings} JSON strings in {n} bytes, more than one per "
                f"{HEADER_STRING_BYTES} bytes"
            )


_STRING = re.compile(rb'"[^"]*"')


ENTRY_FIELDS = ("dtype", "shape", "data_offsets")


def _entry_problem(info: object, data_len: int, unknown_dtypes: bool = False) -> str | None:
    """What is wrong with a header entry, or None. Each field's JSON type is checked
    before it is looked up or compared: a dtype of ``[]`` is unhashable, and every reader
    (verify, export, a load, a Hugging Face import) stopped on its TypeError."""
    if not isinstance(info, dict):
        return "not a JSON object"
    dtype, shape, offs = info.get("dtype"), info.get("shape"), info.get("data_offsets")
    if not isinstance(dtype, str):
        return f"dtype {quoted(dtype)} is not a name"
    if dtype not in ITEMSIZE and not unknown_dtypes:
        return f"unknown dtype {quoted(dtype)}"
    if (
        not isinstance(shape, list)
        or len(shape) > MAX_SHAPE_DIMS
        or not all(type(x) is int and 0 <= x < 1 << 63 for x in shape)
    ):
        return (
            f"shape {quoted(shape)} is not a list of at most {MAX_SHAPE_DIMS} integers >= 0 "
            "and < 2^63"
        )
    if (
        not isinstance(offs, list)
        or len(offs) != 2
        or not all(type(x) is int for x in offs)
        or not 0 <= offs[0] <= offs[1] <= data_len
    ):
        return f"data_offsets {quoted(offs)} are not within the {data_len} bytes of data"
    if dtype in ITEMSIZE and offs[1] - offs[0] != math.prod(shape) * ITEMSIZE[dtype]:
        return f"data_offsets {offs} do not hold a {dtype} tensor of shape {shape}"
    return None


def read_header(path: str) -> tuple[bytes, dict]:
    """The raw header bytes and the parsed, checked header of a regular file at ``path``."""
    fd, size = open_regular(path)
    try:
        return read_header_fd(fd, size, path)
    finally:
        os.close(fd)


def fd_sha256(fd: int, size: int, path: str, *, block: int = 8 << 20) -> str:
    """sha256 of the ``size`` bytes of the open file ``fd`` (``pread``: a file truncated
    meanwhile is CorruptCheckpointError, never a SIGBUS)."""
    h = hashlib.sha256()
    buf = bytearray(min(block, size))
    view = memoryview(buf)
    for at in range(0, size, block):
        part = view[: min(block, size - at)]
        pread_into(fd, part, at, path)
        h.update(part)
    return h.hexdigest()


def fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_atomic(path: str, data: bytes, *, before_rename=None) -> None:
    """Replace ``path`` with ``data`` atomically (:func:`checkpoint.smallfile.write_atomic`:
    a new temporary file under an unpredictable name, never through a planted symlink)."""
    smallfile.write_atomic(path, data, before_rename=before_rename)


def tensor_bytes(t: torch.Tensor) -> memoryview:
    """The bytes of a contiguous CPU tensor, without a copy."""
    import torch

    t = t.contiguous().reshape(-1)
    return memoryview(t.view(torch.uint8).numpy()) if t.numel() else memoryview(b"")
