"""The manifest (manifest.json) of a committed checkpoint, and the names of things on disk.

See docs/checkpoint-format.md for the format this module reads and writes.
"""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass, field
from typing import Any

import torch

from checkpoint.errors import FormatError
from checkpoint.planner import SavedChunk

FORMAT_NAME = "elasticd-checkpoint"
FORMAT_VERSION = 1
MANIFEST = "manifest.json"
LATEST = "latest"
STEP_RE = re.compile(r"^step-(\d{9})$")
KINDS = ("model", "optimizer", "rank")

# safetensors dtype codes for the torch dtypes a trainer keeps.
_ST_CODES = {
    torch.float64: "F64",
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.bool: "BOOL",
}
_BY_NAME = {str(dt).removeprefix("torch."): dt for dt in _ST_CODES}


def dtype_name(dtype: torch.dtype) -> str:
    if dtype not in _ST_CODES:
        raise FormatError(f"dtype {dtype} cannot be stored")
    return str(dtype).removeprefix("torch.")


def dtype_of(name: str) -> torch.dtype:
    if name not in _BY_NAME:
        raise FormatError(f"unknown dtype {name!r} in manifest")
    return _BY_NAME[name]


def st_code(dtype: torch.dtype) -> str:
    return _ST_CODES[dtype]


def step_dirname(step: int) -> str:
    return f"step-{step:09d}"


def parse_step_dirname(name: str) -> int | None:
    m = STEP_RE.match(name)
    return int(m.group(1)) if m else None


@dataclass(frozen=True, slots=True)
class TensorEntry:
    """One global tensor: its dtype, shape, kind and the chunks that tile it."""

    name: str
    kind: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    chunks: tuple[SavedChunk, ...]
    crc32: dict[str, str] = field(default_factory=dict)
    """CRC-32 of each chunk's bytes, by safetensors key (checked by every load)."""

    @property
    def nbytes(self) -> int:
        n = self.dtype.itemsize
        for s in self.shape:
            n *= s
        return n


@dataclass(frozen=True, slots=True)
class FileEntry:
    name: str
    bytes: int
    sha256: str
    header_sha256: str
    rank: int


@dataclass(frozen=True, slots=True)
class Manifest:
    """Everything known about one checkpoint without opening its tensor files."""

    step: int
    consumed_samples: int
    job: str
    world: int
    layout: dict[str, Any] | None
    files: dict[str, FileEntry]
    tensors: dict[str, TensorEntry]
    optimizer: dict[str, Any]
    extra: dict[str, Any]
    created_unix: float

    @property
    def total_bytes(self) -> int:
        return sum(f.bytes for f in self.files.values())

    def to_json(self) -> bytes:
        body = {
            "format": FORMAT_NAME,
            "version": FORMAT_VERSION,
            "step": self.step,
            "consumed_samples": self.consumed_samples,
            "job": self.job,
            "world": self.world,
            "created_unix": self.created_unix,
            "layout": self.layout,
            "files": {
                f.name: {
                    "bytes": f.bytes,
                    "sha256": f.sha256,
                    "header_sha256": f.header_sha256,
                    "rank": f.rank,
                }
                for f in self.files.values()
            },
            "tensors": {
                t.name: {
                    "kind": t.kind,
                    "dtype": dtype_name(t.dtype),
                    "shape": list(t.shape),
                    "shards": [
                        {
                            "file": c.file,
                            "key": c.key,
                            "offsets": list(c.offsets),
                            "sizes": list(c.sizes),
                            "crc32": t.crc32[c.key],
                        }
                        for c in t.chunks
                    ],
                }
                for t in self.tensors.values()
            },
            "optimizer": self.optimizer,
            "extra": self.extra,
        }
        body["checksum"] = _self_checksum(body)
        return json.dumps(body, indent=1, sort_keys=False).encode()

    @classmethod
    def from_json(cls, data: bytes, *, where: str) -> Manifest:
        try:
            raw = json.loads(data)
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise FormatError(f"{where}: not valid JSON ({exc})") from exc
        if not isinstance(raw, dict) or raw.get("format") != FORMAT_NAME:
            raise FormatError(f"{where}: not an {FORMAT_NAME} manifest")
        if raw.get("version") != FORMAT_VERSION:
            raise FormatError(
                f"{where}: format version {raw.get('version')!r} is not supported "
                f"(this build reads version {FORMAT_VERSION})"
            )
        expected = raw.pop("checksum", None)
        if expected != _self_checksum(raw):
            raise FormatError(f"{where}: manifest checksum does not match its content")
        try:
            files = {
                name: FileEntry(
                    name=name,
                    bytes=int(f["bytes"]),
                    sha256=str(f["sha256"]),
                    header_sha256=str(f["header_sha256"]),
                    rank=int(f["rank"]),
                )
                for name, f in raw["files"].items()
            }
            tensors = {}
            for name, t in raw["tensors"].items():
                chunks = tuple(
                    SavedChunk(
                        file=s["file"],
                        key=s["key"],
                        offsets=tuple(int(x) for x in s["offsets"]),
                        sizes=tuple(int(x) for x in s["sizes"]),
                    )
                    for s in t["shards"]
                )
                tensors[name] = TensorEntry(
                    name=name,
                    kind=str(t["kind"]),
                    dtype=dtype_of(t["dtype"]),
                    shape=tuple(int(x) for x in t["shape"]),
                    chunks=chunks,
                    crc32={s["key"]: str(s["crc32"]) for s in t["shards"]},
                )
            return cls(
                step=int(raw["step"]),
                consumed_samples=int(raw["consumed_samples"]),
                job=str(raw["job"]),
                world=int(raw["world"]),
                layout=raw.get("layout"),
                files=files,
                tensors=tensors,
                optimizer=dict(raw.get("optimizer") or {}),
                extra=dict(raw.get("extra") or {}),
                created_unix=float(raw.get("created_unix", 0.0)),
            )
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            raise FormatError(f"{where}: malformed manifest ({exc!r})") from exc


def _self_checksum(body: dict[str, Any]) -> str:
    canon = json.dumps(body, sort_keys=True, separators=(",", ":")).encode()
    return hashlib.sha256(canon).hexdigest()
