"""Writing safetensors files straight from a staging buffer, hashing as we go; fsync helpers.

We write the (simple, documented) safetensors layout ourselves rather than through
``safetensors.torch.save_file`` so that one pass over the bytes writes them, checksums
each chunk and the whole file, and fsyncs, without another copy. Any safetensors reader
(``safe_open``, ``load_file``) reads the result.
"""

from __future__ import annotations

import hashlib
import json
import os
import struct
import zlib
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import torch

from checkpoint.errors import CorruptCheckpointError
from checkpoint.manifest import st_code


@dataclass(frozen=True, slots=True)
class FileSlot:
    """One tensor of a file: where its bytes sit in the data section (== in the staging)."""

    key: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    begin: int
    end: int


@dataclass(frozen=True, slots=True)
class WrittenFile:
    bytes: int
    sha256: str
    header_sha256: str
    chunk_crc32: dict[str, str]


def header_bytes(slots: Sequence[FileSlot]) -> bytes:
    """The 8-byte length and the JSON header, padded with spaces to a multiple of 8."""
    head: dict[str, object] = {"__metadata__": {"format": "pt", "writer": "elasticd"}}
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
    path: str, slots: Sequence[FileSlot], data: torch.Tensor, *, hasher_pool: ThreadPoolExecutor
) -> WrittenFile:
    """Write ``data`` (uint8, the data section) under a header for ``slots``; fsync the file.

    The whole-file sha256 runs on ``hasher_pool`` while this thread writes and checksums
    the chunks (crc32; both release the GIL), so the checksums overlap with the writes.
    """
    header = header_bytes(slots)
    view = memoryview(data.numpy()) if data.numel() else memoryview(b"")
    whole = hashlib.sha256(header)
    pending = []
    chunk_crc: dict[str, str] = {}
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        write_all(fd, header)
        for s in slots:
            part = view[s.begin : s.end]
            pending.append(hasher_pool.submit(whole.update, part))
            chunk_crc[s.key] = crc32_hex(part)
            write_all(fd, part)
        for p in pending:
            p.result()
        os.fsync(fd)
    finally:
        for p in pending:
            p.cancel()
        os.close(fd)
    return WrittenFile(
        bytes=len(header) + len(view),
        sha256=whole.hexdigest(),
        header_sha256=hashlib.sha256(header).hexdigest(),
        chunk_crc32=chunk_crc,
    )


def crc32_hex(buf: memoryview | bytes) -> str:
    """The CRC-32 (zlib's polynomial) of ``buf`` as 8 hex digits."""
    return f"{zlib.crc32(buf) & 0xFFFFFFFF:08x}"


def write_all(fd: int, buf: memoryview | bytes) -> None:
    view = memoryview(buf)
    while view:
        n = os.write(fd, view[: 1 << 30])
        view = view[n:]


def read_header(path: str) -> tuple[bytes, dict]:
    """The raw header bytes (length prefix included) and the parsed header of a file."""
    try:
        with open(path, "rb") as f:
            prefix = f.read(8)
            if len(prefix) != 8:
                raise CorruptCheckpointError(f"{path}: truncated safetensors header")
            (n,) = struct.unpack("<Q", prefix)
            if n > 100 << 20:
                raise CorruptCheckpointError(f"{path}: implausible header length {n}")
            text = f.read(n)
    except FileNotFoundError as exc:
        raise CorruptCheckpointError(f"{path}: file is missing") from exc
    if len(text) != n:
        raise CorruptCheckpointError(f"{path}: truncated safetensors header")
    try:
        parsed = json.loads(text)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise CorruptCheckpointError(f"{path}: header is not valid JSON") from exc
    return prefix + text, parsed


def file_sha256(path: str, *, block: int = 8 << 20) -> tuple[str, int]:
    """sha256 and size of a whole file."""
    h = hashlib.sha256()
    size = 0
    try:
        with open(path, "rb", buffering=0) as f:
            buf = bytearray(block)
            mv = memoryview(buf)
            while n := f.readinto(buf):
                h.update(mv[:n])
                size += n
    except FileNotFoundError as exc:
        raise CorruptCheckpointError(f"{path}: file is missing") from exc
    return h.hexdigest(), size


def fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_atomic(path: str, data: bytes) -> None:
    """Replace ``path`` with ``data`` atomically: write a tmp file, fsync, rename, fsync dir."""
    tmp = f"{path}.tmp"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        write_all(fd, data)
        os.fsync(fd)
    finally:
        os.close(fd)
    os.replace(tmp, path)
    fsync_dir(os.path.dirname(os.path.abspath(path)))


def tensor_bytes(t: torch.Tensor) -> memoryview:
    """The bytes of a contiguous CPU tensor, without a copy."""
    t = t.contiguous().reshape(-1)
    return memoryview(t.view(torch.uint8).numpy()) if t.numel() else memoryview(b"")
