"""The manifest (manifest.json) of a committed checkpoint, and the names of things on disk.

See docs/checkpoint-format.md for the format this module reads and writes.
"""

from __future__ import annotations

import hashlib
import json
import math
import re
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from checkpoint import seal, smallfile
from checkpoint.errors import FormatError, UnsupportedVersionError
from checkpoint.planner import (
    CORNERS_FREE,
    CORNERS_PER_CHUNK,
    Box,
    SavedChunk,
    block_count,
    block_rows,
    chunk_rows,
    coverage_cost,
    coverage_problem,
    intersect,
    strips,
)

FORMAT_NAME = "elasticd-checkpoint"
FORMAT_VERSION = 4
"""The version this build writes. Version 3 checks each chunk with a CRC-32C per block
of whole rows (``block_rows``, ``crc32c`` one 8-digit checksum per block), so a load that
needs part of a chunk reads and checks only its blocks. Version 4 checks the same blocks,
but keeps their checksums in each tensor file's header (``checkpoint.stfile.CRC_META``,
covered by the manifest's ``header_sha256``), not in the manifest, and lists each written
region once (its writer's rank, box and strip count: ``regions``) instead of each chunk
with its file and key, which follow from those: a manifest's size then grows with the
regions, not with the checkpoint's bytes, at about 1/25 of version 3's bytes per chunk.
Versions 3, 2 (one CRC-32C per chunk) and 1 (zlib's CRC-32 per chunk, ``crc32``, and a
whole-file ``sha256``) still load and verify."""
READ_VERSIONS = (1, 2, 3, 4)
MANIFEST = "manifest.json"
LATEST = "latest"
STEP_RE = re.compile(r"step-([0-9]{9})")
"""A committed step's directory name, matched whole (``fullmatch``) and in ASCII digits
only: ``\\d`` takes any Unicode digit and ``$`` a trailing newline, and a name that parses
to a step but is not that step's own name would be listed and never found."""
KINDS = ("model", "optimizer", "rank")

DTYPES = {
    "float64": ("F64", 8),
    "float32": ("F32", 4),
    "float16": ("F16", 2),
    "bfloat16": ("BF16", 2),
    "int64": ("I64", 8),
    "int32": ("I32", 4),
    "int16": ("I16", 2),
    "int8": ("I8", 1),
    "uint8": ("U8", 1),
    "bool": ("BOOL", 1),
}
"""The dtypes a checkpoint stores, by the name a manifest gives them (torch's, without
``torch.``): their safetensors code and item size. Kept as names, so that reading and
checking a checkpoint (``elasticd ckpt ls/inspect/verify``) never imports torch."""


def dtype_name(dtype: Any) -> str:
    """The manifest's name of a torch dtype (or of a name already)."""
    name = str(dtype).removeprefix("torch.")
    if name not in DTYPES:
        raise FormatError(f"dtype {dtype} cannot be stored")
    return name


def dtype_of(name: str) -> Any:
    """The torch dtype a manifest's dtype name stands for (imports torch)."""
    if name not in DTYPES:
        raise FormatError(f"unknown dtype {name!r} in manifest")
    import torch

    return getattr(torch, name)


def st_code(dtype: Any) -> str:
    """The safetensors code of a torch dtype or of a manifest's dtype name."""
    return DTYPES[str(dtype).removeprefix("torch.")][0]


def file_name(rank: int) -> str:
    """The tensor file a rank writes (a format version 4 manifest names files so)."""
    return f"rank-{rank:05d}.safetensors"


def chunk_key(name: str, offsets: Sequence[int]) -> str:
    """The safetensors key of the chunk of tensor ``name`` at ``offsets``."""
    return f"{name}@{'_'.join(map(str, offsets))}"


WrittenRegion = tuple[int, tuple[int, ...], tuple[int, ...], int]
"""A written region in a format version 4 manifest: the writer's rank (its file is
:func:`file_name`), offsets, sizes, and the number of strips it is cut into
(:func:`checkpoint.planner.strips`); each strip is a chunk keyed :func:`chunk_key`. The
manifest lists it as one flat list, ``[rank, *offsets, *sizes, strips]``."""


def step_dirname(step: int) -> str:
    return f"step-{step:09d}"


def parse_step_dirname(name: str) -> int | None:
    m = STEP_RE.fullmatch(name)
    return int(m.group(1)) if m else None


def region_chunks(name: str, region: WrittenRegion) -> list[SavedChunk]:
    """The chunks a version 4 region stands for, exactly as the writer cut them: its
    strips (:func:`checkpoint.planner.strips`), each keyed :func:`chunk_key` in the file of
    the region's rank."""
    rank, offsets, sizes, n = region
    file = file_name(rank)
    return [
        SavedChunk(file=file, key=chunk_key(name, o), offsets=o, sizes=z)
        for o, z in strips((offsets, sizes), n)
    ]


class RegionChunks(Sequence[SavedChunk]):
    """A version 4 tensor's chunks, cut from its regions when first asked for.

    A manifest of a large job lists a million chunks, and a rank resuming needs the chunks
    of a few regions of the tensors of its own pipeline stage: parsing the manifest makes
    no chunk (its regions are checked instead, which is the same check), a load cuts only
    the regions its boxes meet (:meth:`within`), walking all of them as a sequence cuts
    them once and keeps them, and :meth:`each` (``check_files``) cuts one region at a time
    and keeps none."""

    __slots__ = ("_all", "_count", "_name", "_regions")

    def __init__(self, name: str, regions: tuple[WrittenRegion, ...]) -> None:
        self._name = name
        self._regions = regions
        self._count = sum(r[3] for r in regions)
        self._all: tuple[SavedChunk, ...] | None = None

    def _chunks(self) -> tuple[SavedChunk, ...]:
        if self._all is None:
            self._all = tuple(c for r in self._regions for c in region_chunks(self._name, r))
        return self._all

    def __len__(self) -> int:
        return self._count

    def __getitem__(self, index):  # type: ignore[override]
        return self._chunks()[index]

    def __iter__(self):
        return iter(self._chunks())

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Sequence):
            return NotImplemented
        return len(self) == len(other) and tuple(self) == tuple(other)

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        return f"RegionChunks({self._name!r}, {len(self._regions)} regions, {self._count} chunks)"

    def each(self) -> Iterator[SavedChunk]:
        """Every chunk, cut one region at a time and not kept (a walk that stops at the
        first bad chunk holds no more than a region's)."""
        if self._all is not None:
            return iter(self._all)
        return (c for r in self._regions for c in region_chunks(self._name, r))

    def within(self, box: Box) -> list[SavedChunk]:
        """The chunks of the regions that meet ``box`` (the others hold none of it); none
        for a box of other dimensions than the tensor's (which ``plan_reads`` refuses)."""
        if self._regions and len(box[0]) != len(self._regions[0][1]):
            return []
        if self._all is not None:
            return [c for c in self._all if intersect(box, (c.offsets, c.sizes)) is not None]
        return [
            c
            for r in self._regions
            if intersect(box, (r[1], r[2])) is not None
            for c in region_chunks(self._name, r)
        ]


@dataclass(frozen=True, slots=True)
class TensorEntry:
    """One global tensor: its dtype, shape, kind and the chunks that tile it."""

    name: str
    kind: str
    dtype_name: str
    """The dtype as the manifest names it (a key of :data:`DTYPES`); :attr:`dtype` is the
    torch dtype."""
    shape: tuple[int, ...]
    chunks: Sequence[SavedChunk]
    """Every chunk (a tuple; parsed from a version 4 manifest, :class:`RegionChunks`, which
    cuts them from the regions when first walked)."""
    crc32: dict[tuple[str, str], str] = field(default_factory=dict)
    """Checksums of each chunk's bytes, by (file, safetensors key): one key may be in two
    files. Checked by every load, in versions 1 to 3: in version 3 the CRC-32C of each
    block of :meth:`rows_per_block` rows, 8 hex digits each, concatenated; in version 2 one
    CRC-32C of the whole chunk, in version 1 zlib's CRC-32. Empty in version 4: the chunk's
    file header holds them."""
    block_rows: dict[tuple[str, str], int] = field(default_factory=dict)
    """Rows per verify block of each chunk, by (file, key), as version 3 lists them; empty
    in version 4, where :meth:`rows_per_block` computes them from ``block_bytes``, as the
    writer did."""
    regions: tuple[WrittenRegion, ...] = ()
    """The written regions the chunks are cut from (version 4: what its manifest lists)."""
    block_bytes: int = 0
    """Bytes per verify block the writer aimed at (version 4): each chunk's rows per block
    are :func:`checkpoint.planner.block_rows` of its sizes with this."""

    @property
    def dtype(self) -> Any:
        """The torch dtype (imports torch: a reader that needs no tensor uses
        :attr:`dtype_name`, :attr:`itemsize` and :attr:`st_code`)."""
        return dtype_of(self.dtype_name)

    @property
    def itemsize(self) -> int:
        return DTYPES[self.dtype_name][1]

    @property
    def st_code(self) -> str:
        """The safetensors code of its dtype."""
        return DTYPES[self.dtype_name][0]

    def rows_per_block(self, chunk: SavedChunk) -> int:
        """Rows per verify block of ``chunk`` (all its rows in versions 1 and 2)."""
        rows = self.block_rows.get((chunk.file, chunk.key))
        if rows is not None:
            return rows
        if self.regions:
            return block_rows(chunk.sizes, itemsize=self.itemsize, block_bytes=self.block_bytes)
        return max(1, chunk_rows(chunk.sizes))

    def blocks(self, chunk: SavedChunk) -> int:
        """How many verify blocks ``chunk`` has (so how many checksums)."""
        return block_count(chunk.sizes, self.rows_per_block(chunk))

    def each_chunk(self) -> Iterator[SavedChunk]:
        """Every chunk, as :attr:`chunks` lists them, without keeping the chunks cut from
        version 4 regions (:meth:`RegionChunks.each`)."""
        if isinstance(self.chunks, RegionChunks):
            return self.chunks.each()
        return iter(self.chunks)

    def chunks_within(self, box: Box) -> Sequence[SavedChunk]:
        """The chunks that may hold part of ``box``: with its regions known, only the
        chunks of those that meet it; else every chunk."""
        if isinstance(self.chunks, RegionChunks):
            return self.chunks.within(box)
        return self.chunks

    @property
    def nbytes(self) -> int:
        n = self.itemsize
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
    """The format version read (1 to 4); what the chunk checksums are, and where they are
    kept, says it."""
    commit: int = 0
    """The commit's number in its checkpoint directory (1 + the highest before it), so that
    commit order, not the step number, says which step is newest; 0 in manifests written
    before it was recorded."""
    writer: dict[str, Any] | None = None
    """The fence the commit was made under, ``{"run_id": ..., "round": ...}``: which run and
    rendezvous round wrote the step (None: an unfenced writer, plain torchrun or a process
    alone, or a manifest from before it was recorded)."""
    seal: dict[str, str] | None = None
    """The manifest's ``seal`` as read (``alg``, ``key_id``, ``mac``: :mod:`checkpoint.seal`),
    or None: saved without a key. Checked only by a reader given the key."""

    @property
    def checksum_key(self) -> str:
        """The shard field of the chunk checksum: ``crc32c`` (v2) or ``crc32`` (v1)."""
        return "crc32" if self.version == 1 else "crc32c"

    @property
    def total_bytes(self) -> int:
        return sum(f.bytes for f in self.files.values())

    def to_json(self, *, key: bytes | None = None) -> bytes:
        """The manifest's bytes; sealed with ``key`` when one is given (a seal read with
        the manifest is not written back: it sealed those bytes, not these)."""
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
                    "dtype": t.dtype_name,
                    "shape": list(t.shape),
                    **(
                        {
                            "block_bytes": t.block_bytes,
                            "regions": [[r, *o, *z, n] for r, o, z, n in t.regions],
                        }
                        if self.version >= 4
                        else {"shards": self._shards_json(t)}
                    ),
                }
                for t in self.tensors.values()
            },
            "optimizer": self.optimizer,
            "extra": self.extra,
            "commit": self.commit,
            **({"writer": self.writer} if self.writer is not None else {}),
        }
        if key is not None:
            seal.seal_body(body, key)
        body["checksum"] = _self_checksum(body)
        return _dumps_lines(body)

    def _shards_json(self, t: TensorEntry) -> list[dict[str, Any]]:
        """A tensor's chunks as versions 1 to 3 list them."""
        return [
            {
                "file": c.file,
                "key": c.key,
                "offsets": list(c.offsets),
                "sizes": list(c.sizes),
                **({"block_rows": t.rows_per_block(c)} if self.version >= 3 else {}),
                self.checksum_key: t.crc32[(c.file, c.key)],
            }
            for c in t.chunks
        ]

    @classmethod
    def from_json(
        cls, data: bytes, *, where: str, density: bool = True, key: bytes | None = None
    ) -> Manifest:
        """Parse and check a manifest: nothing in it is trusted before it is checked.

        The manifest's own sha256 guards against accidents only (anyone can recompute it),
        so every field that later drives a path, an allocation or a read is checked here,
        before any tensor file is opened: file names are plain names inside the step
        directory, every tensor's chunks tile it exactly, and the chunks of each file fit in
        the bytes the manifest says it has (which a load checks against the real file
        before it reads). ``density=False`` (a writer reading back part of what it checked
        whole) skips the containers-per-byte bound, which a part need not meet alone.
        With ``key``, the manifest must be sealed with it (SealError otherwise), checked
        right after its own checksum, before any other field is looked at."""
        raw = parse_json(data, where, max_bytes=MAX_MANIFEST_BYTES, error=FormatError,
                         density=density)  # fmt: skip
        if not isinstance(raw, dict) or raw.get("format") != FORMAT_NAME:
            raise FormatError(f"{where}: not an {FORMAT_NAME} manifest")
        if raw.get("version") not in READ_VERSIONS or type(raw.get("version")) is not int:
            said = (f"{where}: format version {raw.get('version')!r} is not supported "
                    f"(this build reads versions {', '.join(map(str, READ_VERSIONS))})")  # fmt: skip
            if type(raw.get("version")) is int and raw["version"] > max(READ_VERSIONS):
                # Checked before the checksum, which a newer version may compute otherwise.
                raise UnsupportedVersionError(
                    f"{said}: written by a newer build; resume with it, or move the step "
                    "out of the directory to resume from an older one"
                )
            raise FormatError(said)
        expected = raw.pop("checksum", None)
        try:
            actual = _self_checksum(raw)
        except (RecursionError, ValueError) as exc:  # parse_json bounds both; belt and braces
            raise FormatError(f"{where}: cannot re-encode the manifest ({exc})") from None
        if expected != actual:
            raise FormatError(f"{where}: manifest checksum does not match its content")
        if key is not None:
            seal.check_seal(raw, key, where)
        try:
            return _parse(cls, raw, where)
        except _Bad as exc:
            raise FormatError(f"{where}: {exc}") from None
        except (KeyError, TypeError, ValueError, AttributeError, OverflowError) as exc:
            raise FormatError(f"{where}: malformed manifest ({exc!r})") from exc


MAX_NDIM = 8
"""Dimensions a stored tensor may have (coverage checks cost 2^ndim per chunk, bounded
over the whole manifest: :data:`checkpoint.planner.CORNERS_PER_CHUNK`)."""
FILE_NAME_RE = re.compile(r"[A-Za-z0-9_][A-Za-z0-9._-]{0,200}\.safetensors")
"""A tensor file's name (the whole string: ``fullmatch``): a plain name inside the step
directory (no ``/``, no ``..``, no newline)."""
INT_LIMIT = 1 << 63
"""Every integer of a manifest (dims, offsets, sizes, bytes, block_rows) is below this, and
so is every tensor's element count times its item size (what int64 holds)."""
MAX_MANIFEST_BYTES = 64 << 20
"""A manifest larger than this is refused before it is parsed. A real one takes about 300
bytes per chunk (a chunk is one strip of one rank's region of one tensor), so this is
over 200,000 chunks."""
MAX_DEPTH = 32
"""Nesting a manifest (or a safetensors header) may have: a real manifest nests 6 deep."""
CONTAINER_BYTES = 16
"""A manifest has at most one JSON list or object per this many bytes (a real one has one
per ~100), so that parsing it costs memory a small multiple of its size (``[],`` repeated
would cost 20 times its bytes in Python objects), plus :data:`CONTAINER_ALLOWANCE`."""
CONTAINER_ALLOWANCE = 1 << 18
"""Lists and objects a manifest may hold beyond :data:`CONTAINER_BYTES`' share: a large
world's layout is dense (about 11 per rank, one per 9 bytes: ``[[0],[1],...]``), and with a
small model little else dilutes it (a 32-rank dp world's manifest of two tensors was
refused at its first save). Enough for the layout of 23,000 ranks; costs at most about
16 MB of Python objects."""


def parse_json(
    data: bytes,
    where: str,
    *,
    max_bytes: int,
    error: type[Exception],
    density: bool = True,
    utf8_strings: bool = False,
) -> Any:
    """``json.loads`` of checkpoint input, refused with one ``error`` line (never another
    exception) when it is larger than ``max_bytes``, has more lists and objects than one
    per :data:`CONTAINER_BYTES` bytes, nests deeper than :data:`MAX_DEPTH`, is not JSON in
    UTF-8 (``NaN``, ``Infinity`` and ``-Infinity``, which Python's parser takes, are not
    JSON; nor is a byte order mark), holds an integer Python refuses to parse (over 4300
    digits), a number out of a double's range (``1e400``) or (``utf8_strings``) a string
    with a lone surrogate (:func:`checkpoint.smallfile.loads`)."""
    json_bounds(data, where, max_bytes=max_bytes, error=error, density=density)
    try:
        # UTF-8 only, as the format says: json.loads would also take UTF-16 and UTF-32
        # bytes, which the depth count below does not read.
        raw = smallfile.loads(data, utf8_strings=utf8_strings)
    except (UnicodeDecodeError, ValueError, RecursionError) as exc:
        text = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise error(f"{where}: not valid JSON ({text[:200]})") from None
    depth = _depth(data)  # of valid JSON: what is not is refused above, at the parse's speed
    if depth > MAX_DEPTH:
        raise error(f"{where}: JSON nested {depth} deep, more than {MAX_DEPTH}")
    return raw


def json_bounds(
    data: bytes, where: str, *, max_bytes: int, error: type[Exception], density: bool = True
) -> None:
    """The bounds :func:`parse_json` checks before it parses: at most ``max_bytes``, and
    (``density``) at most one list or object per :data:`CONTAINER_BYTES` bytes. Raises
    ``error``."""
    if len(data) > max_bytes:
        raise error(f"{where}: {len(data)} bytes, more than {max_bytes}")
    if not density:
        return
    containers = data.count(b"[") + data.count(b"{")  # an upper bound: strings count too
    if containers > len(data) // CONTAINER_BYTES + CONTAINER_ALLOWANCE:
        raise error(
            f"{where}: {containers} JSON lists or objects in {len(data)} bytes, more than "
            f"one per {CONTAINER_BYTES} bytes plus {CONTAINER_ALLOWANCE}"
        )
    _strings_and_floats(data, where, error)


STRING_BYTES = 8
"""At most one JSON string per this many bytes of a manifest (plus
:data:`DENSITY_ALLOWANCE`): a real one has one per 20 or more; a list of short strings
costs 12 times its size in memory once parsed (a 63 MB manifest of ``"ab",`` took a
reader 1.1 GB: a security review)."""
FLOAT_BYTES = 64
"""At most one JSON float per this many bytes of a manifest (plus
:data:`DENSITY_ALLOWANCE`): a real one holds a few (learning rates, betas, what a script
puts in ``extra``); ``1e0,`` costs 8 times its size once parsed (a 63 MB manifest of them
took 813 MB and 12 s)."""
DENSITY_ALLOWANCE = 1 << 16
"""Strings and floats a manifest may hold beyond their share (a few MB of Python objects
at most): a small manifest with a script's long list of floats in ``extra`` (a loss
history) is not refused."""


def _strings_and_floats(data: bytes, where: str, error: type[Exception]) -> None:
    """Refuse, before it is parsed, a manifest of more strings or floats per byte than
    :data:`STRING_BYTES` and :data:`FLOAT_BYTES` allow. Counted in C: upper bounds first
    (quotes; dots and e's anywhere), and only when one passes its bound, exactly: escapes
    blanked, then every string emptied, floats counted by their ``.``, ``e`` and ``E``
    (``true`` and ``false`` taken out; a float with both counts twice: still a bound)."""
    n = len(data)
    strings_bound = n // STRING_BYTES + DENSITY_ALLOWANCE
    floats_bound = n // FLOAT_BYTES + DENSITY_ALLOWANCE
    strings = data.count(b'"') // 2
    floats = data.count(b".") + data.count(b"e") + data.count(b"E")
    if strings <= strings_bound and floats <= floats_bound:
        return
    blanked = data.replace(b"\\\\", b"__").replace(b'\\"', b"__")
    strings = blanked.count(b'"') // 2
    if strings > strings_bound:
        raise error(
            f"{where}: {strings} JSON strings in {n} bytes, more than one per "
            f"{STRING_BYTES} bytes plus {DENSITY_ALLOWANCE}"
        )
    plain = _JSON_STRING.sub(b'""', blanked)
    floats = (plain.count(b".") + plain.count(b"e") + plain.count(b"E")
              - plain.count(b"true") - plain.count(b"false"))  # fmt: skip
    if floats > floats_bound:
        raise error(
            f"{where}: {floats} JSON numbers with a fraction or an exponent in {n} bytes, "
            f"more than one per {FLOAT_BYTES} bytes plus {DENSITY_ALLOWANCE}"
        )


def not_json(constant: str) -> Any:
    """``parse_constant`` of a strict parse: Python's ``json`` reads (and writes) ``NaN``
    and ``Infinity``, which are not JSON: a NaN in a manifest's layout never equals the
    run's own (a resume then thinks the layout changed)."""
    raise ValueError(f"{constant} is not a JSON value")


_JSON_STRING = re.compile(rb'"[^"]*"')
"""A JSON string once its escaped backslashes and quotes are gone: each quote pairs with
the next, so one scan cuts every string (only a last, unpaired quote is scanned twice)."""
_INNERMOST = re.compile(rb"\[\]|\{\}")
_NOT_QUOTES_OR_BRACKETS = bytes(set(range(256)) - set(b'"[]{}'))


def _depth(data: bytes) -> int:
    """How deep the JSON text ``data`` nests, stopping once past :data:`MAX_DEPTH`; exact
    for valid JSON, which ``data`` must be (the parse checked it: the decoder itself
    refuses nesting past the interpreter's recursion limit).

    Read from the text, not the parsed value, at C speed: the strings and everything but
    brackets are cut out; each pass then removes every innermost ``[]`` and ``{}`` at
    once, one level of every container, so the passes count the depth. Each pass is one
    scan of what is left, which the first pass already shrinks to the containers that
    hold others. A 1024-rank manifest of 6 MB: 0.05 s, against 0.3-0.4 s walking the
    parsed value, itself 2.5 times the parse."""
    # Outside strings valid JSON has no backslash, so escapes pair from the left: drop
    # the escaped backslashes, then no backslash left escapes another, and the escaped
    # quotes can go too (at C speed: a pattern taking escapes one by one is 20 times
    # slower on a string of them).
    unescaped = data.replace(b"\\\\", b"").replace(b'\\"', b"")
    # Quotes and brackets only. A string with no bracket is now "": those go at C speed
    # (a pair found across two strings has no bracket between them either: the two are
    # joined, and go as one). Strings left hold a bracket, so they are no more than the
    # brackets that the caller bounded.
    condensed = unescaped.translate(None, _NOT_QUOTES_OR_BRACKETS).replace(b'""', b"")
    brackets = _JSON_STRING.sub(b"", condensed)
    depth = 0
    while brackets and depth <= MAX_DEPTH:
        inner = _INNERMOST.sub(b"", brackets)
        if len(inner) == len(brackets):
            return depth  # unbalanced: not JSON, which the parse says
        brackets, depth = inner, depth + 1
    return depth


def quoted(name: Any, limit: int = 300) -> str:
    """A name or value from checkpoint input, shown in a message on one line: as it is
    when it is a printable string (no newline, no lone surrogate), else as Python writes
    it (``ascii``); shortened past ``limit`` characters. A long list or object is cut
    before it is written out (a hostile header's shape may have millions of items)."""
    if isinstance(name, str) and name.isprintable() and name.strip() == name and name:
        text = name[: limit + 1]
    elif isinstance(name, str):
        text = ascii(name[: limit + 1])
    elif isinstance(name, list) and len(name) > 8:
        text = repr(name[:8])[:-1] + f", ... ({len(name)} items)]"
    elif isinstance(name, dict) and len(name) > 8:
        text = f"{{... {len(name)} keys}}"
    else:
        text = repr(name)
    return text if len(text) <= limit else text[: limit - 3] + "..."


class _Bad(Exception):
    """A manifest field that fails its check (becomes a FormatError naming the manifest)."""


class _Fields(dict):
    """A JSON object of the manifest whose missing field is a :class:`_Bad` naming the
    object and the field (``tensor w: no 'kind' field``), not a bare ``KeyError('kind')``."""

    __slots__ = ("what",)

    def __init__(self, value: dict[str, Any], what: str) -> None:
        super().__init__(value)
        self.what = what

    def __missing__(self, key: str) -> Any:
        raise _Bad(f"{self.what + ': ' if self.what else ''}no {key!r} field")


def _int(value: Any, what: str, *, lo: int = 0) -> int:
    if type(value) is not int or not lo <= value < INT_LIMIT:
        shown = quoted(ascii(value[:400])) if isinstance(value, str) else quoted(value)
        raise _Bad(f"{what}: {shown} is not an integer >= {lo} and < 2^63")
    return value


def _hex(value: Any, what: str, digits: int) -> str:
    if not isinstance(value, str) or len(value) != digits or not lower_hex(value):
        shown = repr(value) if len(repr(value)) <= 80 else repr(value)[:77] + "..."
        raise _Bad(f"{what}: {shown} is not {digits} hex digits")
    return value


def lower_hex(text: str) -> bool:
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
            f"tensor {quoted(name)}: {field}: {quoted(value)} is not a list of at most "
            f"{MAX_NDIM} integers"
        )
    if ndim is not None and len(value) != ndim:
        raise _Bad(
            f"tensor {quoted(name)}: {field}: {value!r} has {len(value)} dimensions, "
            f"the tensor {ndim}"
        )
    for x in value:
        if type(x) is not int or not 0 <= x < INT_LIMIT:
            _int(x, f"tensor {quoted(name)}: {field}")
    return tuple(value)


def _dict(value: Any, what: str) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise _Bad(f"{what}: not a JSON object")
    return value


def _parse(cls: type[Manifest], raw: dict[str, Any], where: str) -> Manifest:
    raw = _Fields(raw, "")
    version = raw["version"]
    crc_key = "crc32" if version == 1 else "crc32c"
    files: dict[str, FileEntry] = {}
    for name, f in _dict(raw["files"], "files").items():
        if not isinstance(name, str) or not FILE_NAME_RE.fullmatch(name) or ".." in name:
            raise _Bad(
                f"file name {quoted(name)} is not a plain *.safetensors name inside the step "
                "directory"
            )
        f = _Fields(_dict(f, f"files.{name}"), f"files.{name}")
        files[name] = FileEntry(
            name=name,
            bytes=_int(f["bytes"], f"files.{name}.bytes", lo=8),
            sha256=_hex(f["sha256"], f"files.{name}.sha256", 64) if version == 1 else "",
            header_sha256=_hex(f["header_sha256"], f"files.{name}.header_sha256", 64),
            rank=_int(f["rank"], f"files.{name}.rank"),
        )
    held = dict.fromkeys(files, 8)  # the 8-byte header length, at least
    rank_files = _rank_files(files) if version >= 4 else {}
    keys: set[tuple[str, str]] = set()
    tensors: dict[str, TensorEntry] = {}
    raw_tensors = _dict(raw["tensors"], "tensors")
    listed = "regions" if version >= 4 else "shards"
    # Chunks, counted before any is made: bounded in all (a version 4 region stands for
    # up to MAX_STRIPS of them), and the coverage checks' corners bounded by them.
    counts = {
        name: _chunk_count(t.get(listed), version)
        for name, t in raw_tensors.items()
        if isinstance(t, dict)
    }
    total = sum(counts.values())
    if total > MAX_CHUNKS:
        raise _Bad(f"{total} chunks, more than {MAX_CHUNKS}")
    # Version 4 makes each chunk's key from its tensor's name: bounded before any is made.
    keyed = sum(len(name) * n for name, n in counts.items() if isinstance(name, str))
    if version >= 4 and keyed > MAX_KEY_CHARS:
        raise _Bad(
            f"its chunks' keys would take {keyed} characters (each tensor's name once per "
            f"chunk), more than {MAX_KEY_CHARS}"
        )
    budget = CORNERS_FREE + CORNERS_PER_CHUNK * total  # planner.coverage_cost
    for name, t in raw_tensors.items():
        shown = quoted(name)
        if name == "__metadata__":  # an export names its tensors so: safetensors' own entry
            raise _Bad(f"tensor {shown}: the name is reserved by safetensors")
        if not smallfile.utf8_text(name):  # an export writes it: safetensors cannot
            raise _Bad(f"tensor {shown}: the name holds a lone surrogate, which is not UTF-8 text")
        t = _Fields(_dict(t, f"tensor {shown}"), f"tensor {shown}")
        kind = t["kind"]
        if kind not in KINDS:
            raise _Bad(f"tensor {shown}: kind {quoted(kind)} is not one of {', '.join(KINDS)}")
        if not isinstance(t["dtype"], str):
            raise _Bad(f"tensor {shown}: dtype {quoted(t['dtype'])} is not a name")
        if t["dtype"] not in DTYPES:
            raise _Bad(f"tensor {shown}: unknown dtype {quoted(t['dtype'])}")
        dtype, itemsize = t["dtype"], DTYPES[t["dtype"]][1]
        shape = _ints(t["shape"], name, "shape")
        # Even a tensor of no elements (a 0 in its shape) is allocated with strides of the
        # other dimensions: all of it must fit an int64 count of bytes.
        if math.prod(max(1, n) for n in shape) * itemsize >= INT_LIMIT:
            raise _Bad(f"tensor {shown}: shape {list(shape)} holds more bytes than an int64")
        if not isinstance(t[listed], list):
            raise _Bad(f"tensor {shown}: {listed} is not a list")
        count = _chunk_count(t[listed], version)
        # The tiling is checked on the boxes listed (version 4: regions, not strips).
        budget -= coverage_cost(len(shape), len(t[listed]))
        if budget < 0:
            raise _Bad(
                f"tensor {shown}: {count} chunks of {len(shape)} dimensions: "
                f"checking that they tile it would cost more than {CORNERS_PER_CHUNK} corners "
                "per chunk of the manifest"
            )
        if version >= 4:
            listed_chunks = _parse_regions(t, name, shape, rank_files)
        else:
            listed_chunks = _parse_shards(t, name, shape, files, version)
        entry = TensorEntry(name=name, kind=kind, dtype_name=dtype, shape=shape, **listed_chunks)
        if version >= 4:
            # No chunk is made here. A region's strips tile it, so its bytes are theirs.
            for rank, _, sizes, _ in entry.regions:
                held[rank_files[rank]] += math.prod(sizes) * itemsize
            _empty_region_keys(shown, name, entry.regions)
        else:
            _unique_keys(shown, entry.chunks, keys)
            for c in entry.chunks:
                held[c.file] += math.prod(c.sizes) * itemsize
        # A version 4 region's strips tile it by construction: its regions tiling the tensor
        # is its chunks tiling it, checked on five times fewer boxes.
        if version >= 4:
            boxes = [(offsets, sizes) for _, offsets, sizes, _ in entry.regions]
        else:
            boxes = [(c.offsets, c.sizes) for c in entry.chunks]
        problem = coverage_problem(shown, shape, boxes)
        if problem:
            raise _Bad(f"tensor {problem}")
        tensors[name] = entry
    for name, n in held.items():
        if n > files[name].bytes:
            raise _Bad(
                f"{name}: its shards need {n} bytes, more than the {files[name].bytes} "
                "bytes the manifest gives the file"
            )
    for name, t in tensors.items():
        for c in t.chunks if version == 3 else ():
            n, text = block_count(c.sizes, t.rows_per_block(c)), t.crc32[(c.file, c.key)]
            if not isinstance(text, str) or len(text) != 8 * n or not lower_hex(text):
                _hex(text, f"tensor {quoted(name)}: {crc_key} of {quoted(c.key)}", 8 * n)
    layout = raw.get("layout")
    if layout is not None:
        _dict(layout, "layout")
    job = raw["job"]
    if not isinstance(job, str):
        raise _Bad(f"job: {quoted(job)} is not a string")
    created = raw.get("created_unix", 0.0)
    if (
        type(created) not in (int, float)
        or (type(created) is int and not -INT_LIMIT < created < INT_LIMIT)
        or not math.isfinite(created)
    ):
        raise _Bad(f"created_unix: {quoted(created, 60)} is not a finite number of seconds")
    writer = raw.get("writer")
    if writer is not None:
        _dict(writer, "writer")
        if set(writer) != {"run_id", "round"} or not isinstance(writer["run_id"], str):
            raise _Bad(f"writer: {quoted(writer)} is not a run id and a round")
        writer = {"run_id": writer["run_id"], "round": _int(writer["round"], "writer.round")}
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
        writer=writer,
        seal=_seal(raw.get("seal")),
    )


def _seal(value: Any) -> dict[str, str] | None:
    """A manifest's ``seal`` as read (checked against a key only by a reader given one)."""
    if value is None:
        return None
    if (
        not isinstance(value, dict)
        or set(value) != {"alg", "key_id", "mac"}
        or not all(isinstance(v, str) and len(v) <= 128 for v in value.values())
    ):
        raise _Bad("seal: not an object of alg, key_id and mac (strings)")
    return dict(value)


MAX_CHUNKS = 1 << 21
"""Chunks a manifest may hold in all. Parsing a version 4 manifest makes none of them (a
load cuts those of the regions it reads), but whatever walks them all (``verify``,
``check_files``, an export, and every load of versions 1 to 3) holds about 340 bytes of
objects for each (bench/manifest.py; more in versions 1 to 3, which list checksums too):
2 Mi of them about 0.7 GB. The largest layout measured, a 60B model on
tp8 x pp8 x dp16 with the optimizer cut over dp, has 1.07 Mi; a save over this is refused
(its manifest would be), never committed."""
MAX_KEY_CHARS = 1 << 28
"""Characters a version 4 manifest's chunk keys may take in all: each is its tensor's
name and offsets, so a long name times many chunks is counted before any key is made (a
real one: 1.07 Mi chunks of names under 60 characters, about 64 Mi)."""
MAX_STRIPS = 64
"""Strips a version 4 region may be cut into (the writer cuts at most
``SaveOptions.chunk_max_pieces``, 8 by default); a region of no elements is one."""
MAX_BLOCK_BYTES = 64 << 20
"""The largest ``block_bytes`` a save writes (it clamps ``SaveOptions.block_bytes`` and the
size ``checkpoint.saveplan.header_block_bytes`` picks to it). A load takes any: a block is
at most its chunk, and checkpoints saved with larger blocks before (and version 2's, one
block a chunk) must still load; a verified load's buffer for large blocks is counted
against the memory available instead (``checkpoint.load``)."""


def _chunk_count(listed: Any, version: int) -> int:
    """The chunks a tensor's ``shards`` (versions 1-3) or ``regions`` (version 4) stand
    for, counting anything malformed as one (the full check comes later)."""
    if not isinstance(listed, list):
        return 0
    if version < 4:
        return len(listed)
    n = 0
    for row in listed:
        k = row[-1] if isinstance(row, list) and row else 1
        n += k if type(k) is int and 1 <= k <= MAX_STRIPS else 1
    return n


def _parse_shards(t, name, shape, files, version) -> dict[str, Any]:
    """A tensor's chunks as versions 1 to 3 list them (each with its file, key, box and
    checksums), as :class:`TensorEntry` fields."""
    shown = quoted(name)
    crc_key = "crc32" if version == 1 else "crc32c"
    chunks, crc, rows = [], {}, {}
    for s in t["shards"]:
        if not isinstance(s, dict):
            raise _Bad(f"tensor {shown}: shard: not a JSON object")
        if not {"file", "key", "offsets", "sizes", crc_key} <= s.keys() or (
            version >= 3 and "block_rows" not in s
        ):
            s = _Fields(s, f"tensor {shown}: shard")  # its missing field named below
        file, key = s["file"], s["key"]
        if not isinstance(file, str) or file not in files:
            raise _Bad(
                f"tensor {shown}: shard in {quoted(file)}, a file the manifest does not list"
            )
        if not isinstance(key, str):
            raise _Bad(f"tensor {shown}: shard key {quoted(key)} is not a new string in {file}")
        if key == "__metadata__":  # a safetensors header's own entry, never a tensor
            raise _Bad(f"tensor {shown}: shard key {key!r} is reserved by safetensors")
        chunks.append(
            SavedChunk(
                file=file,
                key=key,
                offsets=_ints(s["offsets"], name, "offsets", len(shape)),
                sizes=_ints(s["sizes"], name, "sizes", len(shape)),
            )
        )
        if version >= 3:
            per = s["block_rows"]
            if type(per) is not int or not 1 <= per < INT_LIMIT:
                _int(per, f"tensor {shown}: block_rows", lo=1)
            rows[(file, key)] = per
            # Its length (8 digits per block) is checked once the bytes are.
            crc[(file, key)] = s[crc_key]
        else:
            crc[(file, key)] = _hex(s[crc_key], f"tensor {shown}: {crc_key}", 8)
    return {"chunks": tuple(chunks), "crc32": crc, "block_rows": rows}


def _parse_regions(t, name, shape, rank_files: dict[int, str]) -> dict[str, Any]:
    """A tensor's chunks as version 4 lists them: per written region one flat list
    ``[rank, *offsets, *sizes, strips]`` (one JSON list a region, so a manifest stays
    within :data:`CONTAINER_BYTES`), cut into that many strips
    (:func:`checkpoint.planner.strips`) in the file of that rank, each keyed
    :func:`chunk_key`, with rows per verify block from the tensor's ``block_bytes``
    (:func:`checkpoint.planner.block_rows`), as the writer did; as :class:`TensorEntry`
    fields. ``rank_files``: :func:`_rank_files` of the manifest's files."""
    shown = quoted(name)
    per_block = _int(t["block_bytes"], f"tensor {shown}: block_bytes")
    regions = []
    nd = len(shape)
    for row in t["regions"]:
        if not isinstance(row, list) or len(row) != 2 * nd + 2:
            raise _Bad(
                f"tensor {shown}: region {quoted(row)} is not [rank, {nd} offsets, {nd} sizes, "
                "strips]"
            )
        rank, offsets, sizes, n = row[0], row[1 : 1 + nd], row[1 + nd : 1 + 2 * nd], row[-1]
        if type(rank) is not int or not 0 <= rank < INT_LIMIT:  # its message made if not
            _int(rank, f"tensor {shown}: region rank")
        if rank not in rank_files:
            raise _Bad(
                f"tensor {shown}: a region in {file_name(rank)}, a file the manifest does not list"
            )
        offsets = _ints(offsets, name, "offsets", len(shape))
        sizes = _ints(sizes, name, "sizes", len(shape))
        # An empty region is one strip (the writer cuts none): its strips would be chunks
        # of no bytes that every walk of the chunks pays for. Up to 8 are read: what a
        # writer given chunk_min_bytes=0 cut before (its default chunk_max_pieces), so such
        # a step still loads rather than being pruned as unloadable.
        if len(sizes) < 2:
            most = 1
        elif 0 in sizes:
            most = min(EMPTY_REGION_STRIPS, max(1, sizes[1]))
        else:
            most = min(MAX_STRIPS, sizes[1])
        if type(n) is not int or not 1 <= n <= most:
            raise _Bad(
                f"tensor {shown}: region at {list(offsets)}: {quoted(n)} strips, not an "
                f"integer from 1 to {most}"
            )
        regions.append((rank, offsets, sizes, n))
    regions = tuple(regions)
    return {"chunks": RegionChunks(name, regions), "regions": regions, "block_bytes": per_block}


EMPTY_REGION_STRIPS = 8
"""Strips a region of no elements may list: the writer cuts one; older writers, given
``chunk_min_bytes=0``, up to ``chunk_max_pieces`` (8 by default)."""

_RANK_FILE = re.compile(r"rank-([0-9]+)\.safetensors")


def _rank_files(files: Mapping[str, Any]) -> dict[int, str]:
    """Rank -> the name of its file, for each listed file named as that rank writes it
    (:func:`file_name`; read once per manifest, not once per region)."""
    out = {}
    for f in files:
        m = _RANK_FILE.fullmatch(f)
        if m is not None and file_name(int(m[1])) == f:
            out[int(m[1])] = f
    return out


def _empty_region_keys(shown: str, name: str, regions: Sequence[WrittenRegion]) -> None:
    """Refuse two chunks of a version 4 tensor with one key in one file, making no chunk.

    A key is the tensor's name and the chunk's offsets (split at the last ``@``, so no
    two tensors share one), and a tensor's regions tile it, so non-empty strips start at
    different elements: two chunks can share a key only if one of them is empty. So only
    the files (ranks) holding an empty region are looked at, strip starts only."""
    ranks = {rank for rank, _, sizes, _ in regions if 0 in sizes}
    seen: set[tuple[int, tuple[int, ...]]] = set()
    for rank, offsets, sizes, n in regions:
        if rank not in ranks:
            continue
        for start, _ in strips((offsets, sizes), n):
            if (rank, start) in seen:
                raise _Bad(
                    f"tensor {shown}: shard key {quoted(chunk_key(name, start))} is not a new "
                    f"string in {file_name(rank)}"
                )
            seen.add((rank, start))


def _unique_keys(shown: str, chunks: Sequence[SavedChunk], seen: set[tuple[str, str]]) -> None:
    """Refuse a chunk whose key its file already has (``seen``: the (file, key) pairs so
    far, added to)."""
    for c in chunks:
        if (c.file, c.key) in seen:
            raise _Bad(f"tensor {shown}: shard key {quoted(c.key)} is not a new string in {c.file}")
        seen.add((c.file, c.key))


def _dumps_lines(body: dict[str, Any]) -> bytes:
    """``body`` as JSON with one line per top-level field and per file and tensor entry.

    Readable enough in a pager, and every line is made by the C encoder (``json.dumps``
    with ``indent`` runs the pure-Python one: about 3.5 ms instead of 0.8 for the
    benchmark's 315 KB manifest, on the commit's critical path)."""

    enc = json.dumps  # ", " and ": " between items, as indented output had
    lines = []
    for key, value in body.items():
        if key in ("files", "tensors") and isinstance(value, dict) and value:
            inner = ",\n".join(f" {enc(k)}: {enc(v)}" for k, v in value.items())
            lines.append(f"{enc(key)}: {{\n{inner}\n}}")
        else:
            lines.append(f"{enc(key)}: {enc(value)}")
    return ("{\n" + ",\n".join(lines) + "\n}\n").encode()


def _self_checksum(body: dict[str, Any]) -> str:
    canon = json.dumps(body, sort_keys=True, separators=(",", ":")).encode()
    return hashlib.sha256(canon).hexdigest()


def checksum_matches(raw: dict[str, Any]) -> bool:
    """Whether a parsed manifest's ``checksum`` is that of the rest of it (what
    :meth:`Manifest.from_bytes` checks first): the store trusts no field of one that is not,
    its commit number included."""
    body = {k: v for k, v in raw.items() if k != "checksum"}
    try:
        return raw.get("checksum") == _self_checksum(body)
    except (RecursionError, ValueError):
        return False
