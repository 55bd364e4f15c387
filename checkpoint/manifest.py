"""The manifest (manifest.json) of a committed checkpoint, and the names of things on disk.

See docs/checkpoint-format.md for the format this module reads and writes.
"""

from __future__ import annotations

import hashlib
import json
import math
import re
from dataclasses import dataclass, field
from typing import Any

import torch

from checkpoint.errors import FormatError
from checkpoint.planner import SavedChunk, block_count, chunk_rows, coverage_problem

FORMAT_NAME = "elasticd-checkpoint"
FORMAT_VERSION = 3
"""The version this build writes. Version 3 checks each chunk with a CRC-32C per block
of whole rows (``block_rows``, ``crc32c`` one 8-digit checksum per block), so a load that
needs part of a chunk reads and checks only its blocks. Version 2 (one CRC-32C per chunk)
and version 1 (zlib's CRC-32 per chunk, ``crc32``, and a whole-file ``sha256``) still load
and verify."""
READ_VERSIONS = (1, 2, 3)
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
    """Checksums of each chunk's bytes, by safetensors key (checked by every load): in
    version 3 the CRC-32C of each block of ``block_rows[key]`` rows, 8 hex digits each,
    concatenated; in version 2 one CRC-32C of the whole chunk, in version 1 zlib's CRC-32."""
    block_rows: dict[str, int] = field(default_factory=dict)
    """Rows per verify block of each chunk, by key (version 3; older versions check each
    chunk whole: :meth:`rows_per_block` says so)."""

    def rows_per_block(self, chunk: SavedChunk) -> int:
        """Rows per verify block of ``chunk`` (all its rows in versions 1 and 2)."""
        return self.block_rows.get(chunk.key) or max(1, chunk_rows(chunk.sizes))

    def block_crcs(self, chunk: SavedChunk) -> list[str]:
        """The checksum of each verify block of ``chunk``, in order."""
        text = self.crc32[chunk.key]
        return [text[i : i + 8] for i in range(0, len(text), 8)]

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
    """Whole-file sha256 (version 1 only; "" in version 2)."""
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
    version: int = FORMAT_VERSION
    """The format version read (1 or 2); what the chunk checksums are says it."""
    commit: int = 0
    """The commit's number in its checkpoint directory (1 + the highest before it), so that
    commit order, not the step number, says which step is newest; 0 in manifests written
    before it was recorded."""

    @property
    def checksum_key(self) -> str:
        """The shard field of the chunk checksum: ``crc32c`` (v2) or ``crc32`` (v1)."""
        return "crc32" if self.version == 1 else "crc32c"

    @property
    def total_bytes(self) -> int:
        return sum(f.bytes for f in self.files.values())

    def to_json(self) -> bytes:
        body = {
            "format": FORMAT_NAME,
            "version": self.version,
            "step": self.step,
            "consumed_samples": self.consumed_samples,
            "job": self.job,
            "world": self.world,
            "created_unix": self.created_unix,
            "layout": self.layout,
            "files": {
                f.name: {
                    "bytes": f.bytes,
                    **({"sha256": f.sha256} if self.version == 1 else {}),
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
                            **({"block_rows": t.block_rows[c.key]} if self.version >= 3 else {}),
                            self.checksum_key: t.crc32[c.key],
                        }
                        for c in t.chunks
                    ],
                }
                for t in self.tensors.values()
            },
            "optimizer": self.optimizer,
            "extra": self.extra,
            "commit": self.commit,
        }
        body["checksum"] = _self_checksum(body)
        return json.dumps(body, indent=1, sort_keys=False).encode()

    @classmethod
    def from_json(cls, data: bytes, *, where: str) -> Manifest:
        """Parse and check a manifest: nothing in it is trusted before it is checked.

        The manifest's own sha256 guards against accidents only (anyone can recompute it),
        so every field that later drives a path, an allocation or a read is checked here,
        before any tensor file is opened: file names are plain names inside the step
        directory, every tensor's chunks tile it exactly, and the chunks of each file fit in
        the bytes the manifest says it has (which a load checks against the real file
        before it reads)."""
        try:
            raw = json.loads(data)
        except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as exc:
            raise FormatError(f"{where}: not valid JSON ({exc})") from exc
        if not isinstance(raw, dict) or raw.get("format") != FORMAT_NAME:
            raise FormatError(f"{where}: not an {FORMAT_NAME} manifest")
        if raw.get("version") not in READ_VERSIONS or type(raw.get("version")) is not int:
            raise FormatError(
                f"{where}: format version {raw.get('version')!r} is not supported "
                f"(this build reads versions {', '.join(map(str, READ_VERSIONS))})"
            )
        expected = raw.pop("checksum", None)
        if expected != _self_checksum(raw):
            raise FormatError(f"{where}: manifest checksum does not match its content")
        try:
            return _parse(cls, raw, where)
        except _Bad as exc:
            raise FormatError(f"{where}: {exc}") from None
        except (KeyError, TypeError, ValueError, AttributeError, OverflowError) as exc:
            raise FormatError(f"{where}: malformed manifest ({exc!r})") from exc


MAX_NDIM = 8
"""Dimensions a stored tensor may have (coverage checks cost 2^ndim per chunk)."""
FILE_NAME_RE = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9._-]{0,200}\.safetensors$")
"""A tensor file's name: a plain name inside the step directory (no ``/``, no ``..``)."""


class _Bad(Exception):
    """A manifest field that fails its check (becomes a FormatError naming the manifest)."""


def _int(value: Any, what: str, *, lo: int = 0) -> int:
    if type(value) is not int or value < lo:
        raise _Bad(f"{what}: {value!r} is not an integer >= {lo}")
    return value


def _hex(value: Any, what: str, digits: int) -> str:
    if not isinstance(value, str) or len(value) != digits or not _lower_hex(value):
        shown = repr(value) if len(repr(value)) <= 80 else repr(value)[:77] + "..."
        raise _Bad(f"{what}: {shown} is not {digits} hex digits")
    return value


def _lower_hex(text: str) -> bool:
    """Whether ``text`` is lowercase hex digits and nothing else (``fromhex`` also takes
    upper case and spaces, which the round trip then tells apart)."""
    try:
        return bytes.fromhex(text).hex() == text
    except ValueError:
        return False


def _ints(value: Any, name: str, field: str, ndim: int | None = None) -> tuple[int, ...]:
    """A list of integers >= 0, the ``field`` of tensor ``name`` (its message is made only
    when it fails: this runs for every chunk)."""
    if not isinstance(value, list) or len(value) > MAX_NDIM:
        raise _Bad(
            f"tensor {name}: {field}: {value!r} is not a list of at most {MAX_NDIM} integers"
        )
    if ndim is not None and len(value) != ndim:
        raise _Bad(
            f"tensor {name}: {field}: {value!r} has {len(value)} dimensions, the tensor {ndim}"
        )
    for x in value:
        if type(x) is not int or x < 0:
            _int(x, f"tensor {name}: {field}")
    return tuple(value)


def _dict(value: Any, what: str) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise _Bad(f"{what}: not a JSON object")
    return value


def _parse(cls: type[Manifest], raw: dict[str, Any], where: str) -> Manifest:
    version = raw["version"]
    crc_key = "crc32" if version == 1 else "crc32c"
    files: dict[str, FileEntry] = {}
    for name, f in _dict(raw["files"], "files").items():
        if not FILE_NAME_RE.match(name) or ".." in name:
            raise _Bad(
                f"file name {name!r} is not a plain *.safetensors name inside the step directory"
            )
        f = _dict(f, f"files.{name}")
        files[name] = FileEntry(
            name=name,
            bytes=_int(f["bytes"], f"files.{name}.bytes", lo=8),
            sha256=_hex(f["sha256"], f"files.{name}.sha256", 64) if version == 1 else "",
            header_sha256=_hex(f["header_sha256"], f"files.{name}.header_sha256", 64),
            rank=_int(f["rank"], f"files.{name}.rank"),
        )
    held = dict.fromkeys(files, 8)  # the 8-byte header length, at least
    keys: set[tuple[str, str]] = set()
    tensors: dict[str, TensorEntry] = {}
    for name, t in _dict(raw["tensors"], "tensors").items():
        t = _dict(t, f"tensor {name}")
        kind = t["kind"]
        if kind not in KINDS:
            raise _Bad(f"tensor {name}: kind {kind!r} is not one of {', '.join(KINDS)}")
        if not isinstance(t["dtype"], str):
            raise _Bad(f"tensor {name}: dtype {t['dtype']!r} is not a name")
        dtype = dtype_of(t["dtype"])
        shape = _ints(t["shape"], name, "shape")
        if not isinstance(t["shards"], list):
            raise _Bad(f"tensor {name}: shards is not a list")
        chunks, crc, rows = [], {}, {}
        for s in t["shards"]:
            if not isinstance(s, dict):
                raise _Bad(f"tensor {name}: shard: not a JSON object")
            file, key = s["file"], s["key"]
            if file not in files:
                raise _Bad(f"tensor {name}: shard in {file!r}, a file the manifest does not list")
            if not isinstance(key, str) or (file, key) in keys:
                raise _Bad(f"tensor {name}: shard key {key!r} is not a new string in {file}")
            keys.add((file, key))
            chunk = SavedChunk(
                file=file,
                key=key,
                offsets=_ints(s["offsets"], name, "offsets", len(shape)),
                sizes=_ints(s["sizes"], name, "sizes", len(shape)),
            )
            if version >= 3:
                per = s["block_rows"]
                if type(per) is not int or per < 1:
                    _int(per, f"tensor {name}: block_rows", lo=1)
                rows[key] = per
                # Its length (8 digits per block) is checked below, with the bytes.
                crc[key] = s[crc_key]
            else:
                crc[key] = _hex(s[crc_key], f"tensor {name}: {crc_key}", 8)
            held[file] += math.prod(chunk.sizes) * dtype.itemsize
            chunks.append(chunk)
        problem = coverage_problem(name, shape, [(c.offsets, c.sizes) for c in chunks])
        if problem:
            raise _Bad(f"tensor {problem}")
        tensors[name] = TensorEntry(
            name=name,
            kind=kind,
            dtype=dtype,
            shape=shape,
            chunks=tuple(chunks),
            crc32=crc,
            block_rows=rows,
        )
    for name, n in held.items():
        if n > files[name].bytes:
            raise _Bad(
                f"{name}: its shards need {n} bytes, more than the {files[name].bytes} "
                "bytes the manifest gives the file"
            )
    for name, t in tensors.items():
        for c in t.chunks if version >= 3 else ():
            n, text = block_count(c.sizes, t.block_rows[c.key]), t.crc32[c.key]
            if not isinstance(text, str) or len(text) != 8 * n or not _lower_hex(text):
                _hex(text, f"tensor {name}: {crc_key} of {c.key}", 8 * n)
    layout = raw.get("layout")
    if layout is not None:
        _dict(layout, "layout")
    job = raw["job"]
    if not isinstance(job, str):
        raise _Bad(f"job: {job!r} is not a string")
    created = raw.get("created_unix", 0.0)
    if type(created) not in (int, float):
        raise _Bad(f"created_unix: {created!r} is not a number")
    return cls(
        step=_int(raw["step"], "step"),
        consumed_samples=_int(raw["consumed_samples"], "consumed_samples"),
        job=job,
        world=_int(raw["world"], "world", lo=1),
        layout=layout,
        files=files,
        tensors=tensors,
        optimizer=dict(_dict(raw.get("optimizer") or {}, "optimizer")),
        extra=dict(_dict(raw.get("extra") or {}, "extra")),
        created_unix=float(created),
        version=version,
        commit=_int(raw.get("commit", 0), "commit"),
    )


def _self_checksum(body: dict[str, Any]) -> str:
    canon = json.dumps(body, sort_keys=True, separators=(",", ":")).encode()
    return hashlib.sha256(canon).hexdigest()
