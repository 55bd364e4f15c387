"""Older checkpoint format versions in tests: a step this build wrote (version 4), its
manifest rewritten as versions 1 to 3 wrote theirs, over the same tensor files.

Every version still loads, so tests run the same checks (and attacks) on each. The
rewrite goes through ``Manifest.to_json``, which writes versions 1 to 3 as their writers
did: every chunk listed with its file, key and checksums (version 3: the block checksums
this build keeps in each file's header; version 2: one CRC-32C per chunk, no
``block_rows``; version 1: zlib's CRC-32 per chunk and each file's whole sha256).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import struct
import zlib
from pathlib import Path

import crc32c

from checkpoint.manifest import MANIFEST, Manifest
from checkpoint.stfile import CRC_META


def rewrite_as(step_dir: str | Path, version: int) -> None:
    """Rewrite ``step_dir``'s version 4 manifest as format ``version`` (1, 2 or 3) wrote
    it, re-sealed."""
    step_dir = Path(step_dir)
    path = step_dir / MANIFEST
    m = Manifest.from_json(path.read_bytes(), where=str(path))
    assert m.version == 4 and version in (1, 2, 3)
    files, data, meta = {}, {}, {}
    for name, f in m.files.items():
        blob = (step_dir / name).read_bytes()
        (n,) = struct.unpack("<Q", blob[:8])
        header = json.loads(blob[8 : 8 + n])
        meta[name] = header["__metadata__"]
        for key, e in header.items():
            if key != "__metadata__":
                b, end = e["data_offsets"]
                data[(name, key)] = blob[8 + n + b : 8 + n + end]
        sha = hashlib.sha256(blob).hexdigest() if version == 1 else ""
        files[name] = dataclasses.replace(f, sha256=sha)
    tensors = {}
    for name, t in m.tensors.items():
        if version == 3:
            crc = {(c.file, c.key): meta[c.file][CRC_META + c.key] for c in t.chunks}
        elif version == 2:
            crc = {(c.file, c.key): f"{crc32c.crc32c(data[(c.file, c.key)]):08x}" for c in t.chunks}
        else:
            crc = {
                (c.file, c.key): f"{zlib.crc32(data[(c.file, c.key)]) & 0xFFFFFFFF:08x}"
                for c in t.chunks
            }
        rows = {(c.file, c.key): t.rows_per_block(c) for c in t.chunks} if version == 3 else {}
        tensors[name] = dataclasses.replace(
            t, crc32=crc, block_rows=rows, regions=(), block_bytes=0
        )
    old = dataclasses.replace(m, version=version, files=files, tensors=tensors)
    path.write_bytes(old.to_json())


def listing(raw: dict, chunks=(), *, block_rows: int = 1) -> dict:
    """The fields that list a tensor's chunks, ``(file, key, offsets, sizes)`` each, as the
    raw manifest ``raw``'s version lists them: version 4 one region a chunk, in the file of
    its writer's rank (``raw["files"][file]["rank"]``; the key follows from the offsets),
    versions 3 and below each chunk with its file, key, rows per block and checksums (zeros
    of the right length). For a hostile manifest's made-up tensors."""
    if raw["version"] >= 4:
        return {
            "block_bytes": 0,
            "regions": [[raw["files"][f]["rank"], *o, *z, 1] for f, _, o, z in chunks],
        }
    shards = []
    for f, key, offsets, sizes in chunks:
        blocks = max(1, -(-sizes[0] // block_rows)) if sizes else 1
        shards.append({"file": f, "key": key, "offsets": list(offsets), "sizes": list(sizes),
                       "block_rows": block_rows, "crc32c": "0" * 8 * blocks})  # fmt: skip
    return {"shards": shards}


def move_chunks(raw: dict, tensor: dict, file: str) -> None:
    """List every chunk of ``tensor`` (a raw manifest's entry) in ``file`` instead."""
    if "regions" in tensor:
        for row in tensor["regions"]:
            row[0] = raw["files"][file]["rank"]
    for s in tensor.get("shards", ()):
        s["file"] = file


def reheadered(blob: bytes, edit) -> tuple[bytes, bytes]:
    """A safetensors file's bytes with its header rewritten through ``edit(header)`` (in
    place) and padded to 8: ``(the new 8-byte length and header, the whole new file)``.
    The caller re-seals what names the file (its size, its header's sha256)."""
    (n,) = struct.unpack("<Q", blob[:8])
    header = json.loads(blob[8 : 8 + n])
    edit(header)
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    head = struct.pack("<Q", len(text)) + text
    return head, head + blob[8 + n :]
