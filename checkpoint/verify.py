"""Whole-checkpoint checks (``elasticd ckpt verify``) and consolidated export."""

from __future__ import annotations

import hashlib
import json
import math
import os
from collections.abc import Callable
from typing import TYPE_CHECKING

import crc32c

from checkpoint.errors import CheckpointError, CorruptCheckpointError
from checkpoint.manifest import quoted
from checkpoint.planner import row_bytes
from checkpoint.step import CheckpointFiles, read_header_checked
from checkpoint.stfile import block_crc32c, fd_sha256, header_crcs, pread_into

if TYPE_CHECKING:
    from checkpoint.load import Checkpoint


def verify(ckpt: CheckpointFiles) -> list[str]:
    """Every problem found, checking every byte of every file (torch is not imported).

    Versions 2 and 3: each file is a regular file of its recorded size; its header matches
    its sha256, and its entries are exactly the manifest's chunks of that file and tile its
    data section; every chunk matches its CRC-32C (version 3: every block of it). So every
    byte is checked by one checksum or the other. Version 1: the whole-file sha256 of each file, and its header.
    Then, for both, every chunk's header entry against the manifest."""
    problems: list[str] = []
    headers: dict[str, dict] = {}
    by_file: dict[str, dict[str, tuple[int, str | int, int]]] = {}
    in_manifest = ckpt.manifest.version < 4
    for entry in ckpt.manifest.tensors.values():
        for c in entry.chunks:
            # Bytes per verify block (the whole chunk before version 3), and the checksums:
            # from the manifest, or (version 4) how many the file's header holds.
            block = entry.rows_per_block(c) * row_bytes(c.sizes, entry.itemsize)
            crc = entry.crc32[(c.file, c.key)] if in_manifest else entry.blocks(c)
            nbytes = math.prod(c.sizes) * entry.itemsize
            by_file.setdefault(c.file, {})[c.key] = (block, crc, nbytes)
    for name, meta in sorted(ckpt.manifest.files.items()):
        path = os.path.join(ckpt.path, name)
        try:
            # Refused unless a regular file of the manifest's size, before anything is read.
            fd, size = ckpt.open_file(name)
            try:
                if ckpt.manifest.version == 1:
                    _, headers[name] = read_header_checked(fd, size, path)
                    if fd_sha256(fd, size, path) != meta.sha256:
                        problems.append(f"{path}: sha256 mismatch (corrupted)")
                else:
                    headers[name] = _verify_v2_file(
                        fd, size, path, meta, by_file.get(name, {}), problems
                    )
            finally:
                os.close(fd)
        except CheckpointError as exc:
            problems.append(str(exc))
    for tname, entry in sorted(ckpt.manifest.tensors.items()):
        for c in entry.chunks:
            head = headers.get(c.file)
            if head is None:
                continue
            info = head.get(c.key)
            want = {"dtype": entry.st_code, "shape": list(c.sizes)}
            if info is None or {k: info.get(k) for k in want} != want:
                problems.append(
                    f"{quoted(tname)}: {c.file} key {quoted(c.key)} is missing or has the wrong "
                    "dtype/shape"
                )
    return problems


READ_BYTES = 8 << 20
"""Most bytes ``verify`` reads at a time (whole verify blocks of one chunk)."""


def _verify_v2_file(
    fd: int,
    size: int,
    path: str,
    meta,
    chunks: dict[str, tuple[int, str | int, int]],
    problems: list[str],
) -> dict:
    """Check one file of format version 2 or later; ``chunks`` maps each key to its block
    bytes, its checksums (or, version 4, how many its header holds) and its bytes."""
    header, parsed = read_header_checked(fd, size, path)
    if hashlib.sha256(header).hexdigest() != meta.header_sha256:
        problems.append(f"{path}: header checksum mismatch")
        return parsed
    entries = {k: v for k, v in parsed.items() if k != "__metadata__"}
    if set(entries) != set(chunks):
        problems.append(f"{path}: its tensors are not the manifest's chunks of this file")
        return parsed
    at = 0
    for begin, end in sorted(v["data_offsets"] for v in entries.values()):
        if begin != at:
            problems.append(f"{path}: bytes {at}..{begin} of its data belong to no tensor")
            return parsed
        at = end
    if at != size - len(header):
        problems.append(f"{path}: bytes after {at} of its data belong to no tensor")
        return parsed
    # Read (pread, never a memory map: a file truncated meanwhile is a problem reported,
    # not a SIGBUS), at most READ_BYTES at a time.
    buf = memoryview(bytearray(min(READ_BYTES, size)))
    for key, (block, crc, nbytes) in sorted(chunks.items()):
        begin, end = entries[key]["data_offsets"]
        if end - begin != nbytes:
            continue  # its header entry is not the manifest's chunk: named by verify()
        if isinstance(crc, int):
            try:
                crc = header_crcs(parsed, key, crc, path)
            except CorruptCheckpointError as exc:
                problems.append(str(exc))
                continue
        if _chunk_sums(fd, len(header) + begin, end - begin, block, buf, path) != crc:
            problems.append(f"{path}: {quoted(key)}: checksum mismatch (corrupted data)")
    return parsed


def _chunk_sums(fd: int, at: int, nbytes: int, block: int, buf: memoryview, path: str) -> str:
    """The block checksums of the ``nbytes`` at ``at`` (see :func:`block_crc32c`), read
    into ``buf``: whole blocks per read when a block fits it, else each block's CRC carried
    across reads (a version 2 chunk is one block, of any size)."""
    if not nbytes:
        return block_crc32c(b"", block)
    if block <= len(buf):
        step, sums = len(buf) // block * block, []
        for lo in range(0, nbytes, step):
            part = buf[: min(step, nbytes - lo)]
            pread_into(fd, part, at + lo, path)
            sums.append(block_crc32c(part, block))
        return "".join(sums)
    sums = []
    for first in range(0, nbytes, block):
        last, value = min(first + block, nbytes), 0
        for lo in range(first, last, len(buf)):
            part = buf[: min(len(buf), last - lo)]
            pread_into(fd, part, at + lo, path)
            value = crc32c.crc32c(part, value)
        sums.append(f"{value & 0xFFFFFFFF:08x}")
    return "".join(sums)


def export(
    ckpt: Checkpoint,
    out: str,
    *,
    max_file_bytes: int = 5 << 30,
    log: Callable[[str], None] | None = None,
) -> list[str]:
    """Write the model tensors, consolidated, as Hugging-Face-style safetensors.

    One ``model.safetensors`` when the total fits ``max_file_bytes``; otherwise
    ``model-0000i-of-0000n.safetensors`` files plus ``model.safetensors.index.json``.
    Returns the files written.
    """
    from safetensors.torch import save_file

    names = sorted(n for n, e in ckpt.manifest.tensors.items() if e.kind == "model")
    if not names:
        raise CorruptCheckpointError(f"{ckpt.path}: holds no model tensors to export")
    ckpt.check_files()  # refuse a bad file before writing anything
    groups: list[list[str]] = [[]]
    size = 0
    for n in names:
        nbytes = ckpt.manifest.tensors[n].nbytes
        if groups[-1] and size + nbytes > max_file_bytes:
            groups.append([])
            size = 0
        groups[-1].append(n)
        size += nbytes
    os.makedirs(out, exist_ok=True)
    meta = {"format": "pt", "step": str(ckpt.step)}
    if len(groups) == 1:
        files = ["model.safetensors"]
    else:
        files = [f"model-{i + 1:05d}-of-{len(groups):05d}.safetensors" for i in range(len(groups))]
    weight_map = {}
    for fname, group in zip(files, groups, strict=True):
        tensors = {n: ckpt.read(n) for n in group}
        save_file(tensors, os.path.join(out, fname), metadata=meta)
        weight_map.update(dict.fromkeys(group, fname))
        if log:
            log(f"wrote {fname} ({len(group)} tensors)")
    if len(files) > 1:
        index = {
            "metadata": {"total_size": sum(ckpt.manifest.tensors[n].nbytes for n in names)},
            "weight_map": weight_map,
        }
        with open(os.path.join(out, "model.safetensors.index.json"), "w") as f:
            json.dump(index, f, indent=2, sort_keys=True)
        files.append("model.safetensors.index.json")
    return files
