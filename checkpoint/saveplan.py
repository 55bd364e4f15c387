"""Who writes what: the deterministic save plan computed from every rank's local metadata.

Pure: every rank computes the same plan from the same gathered metadata, so no second
round of messages is needed to agree on it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from checkpoint import seal, stfile
from checkpoint.errors import CheckpointError
from checkpoint.manifest import (
    MAX_BLOCK_BYTES,
    MAX_STRIPS,
    RegionChunks,
    TensorEntry,
    WrittenRegion,
    dtype_name,
    dtype_of,
    file_name,
    region_chunks,
)
from checkpoint.planner import (
    Box,
    SavedChunk,
    assign_writers,
    block_rows,
    coverage_problem,
    numel,
    strip_count,
)
from checkpoint.stfile import FileSlot


@dataclass(frozen=True, slots=True)
class LocalEntry:
    """What one rank holds of one global tensor (sent to every rank as JSON)."""

    name: str
    kind: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    offsets: tuple[int, ...]
    sizes: tuple[int, ...]

    def to_json(self) -> list:
        return [self.name, self.kind, dtype_name(self.dtype), self.shape, self.offsets, self.sizes]

    @classmethod
    def from_json(cls, raw: Sequence) -> LocalEntry:
        name, kind, dtype, shape, offsets, sizes = raw
        return cls(
            name=name,
            kind=kind,
            dtype=dtype_of(dtype),
            shape=tuple(shape),
            offsets=tuple(offsets),
            sizes=tuple(sizes),
        )


@dataclass(frozen=True, slots=True)
class Region:
    """A region of the local tensor ``name`` this rank writes, and where an async save's
    snapshot keeps it: bytes ``[begin, end)`` of the staging buffer, contiguous."""

    name: str
    box: Box
    dtype: torch.dtype
    begin: int
    end: int


@dataclass(frozen=True, slots=True)
class Copy:
    """Copy the local tensor ``name``'s ``box`` (a strip of ``regions[region]``) into the
    file slot ``slot``."""

    name: str
    box: Box
    slot: FileSlot
    region: int


@dataclass(frozen=True, slots=True)
class FilePlan:
    name: str
    rank: int
    slots: tuple[FileSlot, ...]
    copies: tuple[Copy, ...]
    regions: tuple[Region, ...] = ()

    @property
    def data_bytes(self) -> int:
        return self.slots[-1].end if self.slots else 0


@dataclass(frozen=True, slots=True)
class TensorPlan:
    name: str
    kind: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    chunks: Sequence[SavedChunk]
    """Every chunk, cut from ``regions`` when first walked (:class:`RegionChunks`)."""
    regions: tuple[WrittenRegion, ...] = ()
    """The written regions the chunks are strips of (what a version 4 manifest lists)."""


@dataclass(frozen=True, slots=True)
class SavePlan:
    files: dict[int, FilePlan]
    """The file each rank writes, laid out (ranks assigned nothing write no file); built
    for one rank (``build_save_plan(only=...)``), that rank's only."""
    tensors: dict[str, TensorPlan]
    block_bytes: int = 16 << 10
    """Bytes per verify block aimed at: each chunk's rows per block are ``block_rows`` of
    its sizes with this."""
    writers: tuple[int, ...] = ()
    """Every rank that writes a file, laid out here or not."""

    def tensor_entries(self) -> dict[str, TensorEntry]:
        """The manifest's tensors for this plan (version 4: no checksums, each file's
        header holds its own; rows per block from ``block_bytes``, as a load computes
        them)."""
        return {
            t.name: TensorEntry(
                name=t.name,
                kind=t.kind,
                dtype_name=dtype_name(t.dtype),
                shape=t.shape,
                chunks=t.chunks,
                regions=t.regions,
                block_bytes=self.block_bytes,
            )
            for t in self.tensors.values()
        }


def header_block_bytes(block_bytes: int, file_bytes: int, digits: int = 8) -> int:
    """Bytes per verify block for a save whose largest file holds ``file_bytes``: at least
    ``block_bytes``, and enough that the file's block checksums (8 hex digits each, in its
    header: format version 4) take at most half of the header a load reads
    (``stfile.MAX_HEADER_BYTES``). Every full block of whole rows holds over half of
    ``block_bytes``, so a file has at most ``2 * file_bytes / block_bytes`` of them (plus
    one per chunk). With the default 16 KiB this grows only for files over 52 GB (over
    17 GB for a sealed save, whose ``digits`` per block are 24: each block's MAC too)."""
    budget = stfile.MAX_HEADER_BYTES // 2 // digits  # checksums a header may hold
    # At most what a load accepts: a file too large even for that (over 200 TB) has a
    # header too large to write, and its save is refused (stfile.write_file).
    return min(max(block_bytes, -(-2 * file_bytes // budget)), MAX_BLOCK_BYTES)


def build_save_plan(
    per_rank: Sequence[Sequence[LocalEntry]],
    *,
    chunk_min_bytes: int,
    chunk_max_pieces: int = 8,
    block_bytes: int = 16 << 10,
    only: int | None = None,
    sealed: bool = False,
) -> SavePlan:
    """Deduplicate replicas, balance the writers, and lay out each rank's file: each
    written region cut into strips along its second dimension (:func:`strip_grid`), each
    strip checked by a CRC-32C per block of whole rows of about ``block_bytes``.

    ``only``: lay out that rank's file alone (what a saving rank needs: the rest of the
    plan, every region and its strip count, is the same). Laying out every file costs a
    few objects per chunk, over a million at 1024 ranks."""
    meta: dict[str, LocalEntry] = {}
    holders: dict[tuple[str, Box], list[int]] = {}
    for rank, entries in enumerate(per_rank):
        for e in entries:
            first = meta.setdefault(e.name, e)
            if (first.kind, first.dtype, first.shape) != (e.kind, e.dtype, e.shape):
                raise CheckpointError(
                    f"{e.name}: ranks disagree on kind/dtype/shape: "
                    f"{first.kind} {first.dtype} {list(first.shape)} vs "
                    f"{e.kind} {e.dtype} {list(e.shape)} (rank {rank})"
                )
            holders.setdefault((e.name, (e.offsets, e.sizes)), []).append(rank)
    boxes: dict[str, list[Box]] = {}
    for name, box in holders:
        boxes.setdefault(name, []).append(box)
    for name, bs in boxes.items():
        problem = coverage_problem(name, meta[name].shape, bs)
        if problem:
            raise CheckpointError(f"the ranks' shards do not tile the tensor: {problem}")
    rid = {key: f"{key[0]}|{key[1]}" for key in holders}
    writers = assign_writers(
        {
            rid[key]: (numel(key[1][1]) * meta[key[0]].dtype.itemsize, ranks)
            for key, ranks in holders.items()
        },
        ranks=range(len(per_rank)),
    )
    mine: dict[int, list[tuple[str, Box]]] = {}
    for key in holders:
        mine.setdefault(writers[rid[key]], []).append(key)
    largest = max(
        (sum(numel(box[1]) * meta[name].dtype.itemsize for name, box in keys)
         for keys in mine.values()),
        default=0,
    )  # fmt: skip
    block_bytes = header_block_bytes(block_bytes, largest, 8 + (seal.TAG_HEX if sealed else 0))
    chunk_max_pieces = min(chunk_max_pieces, MAX_STRIPS)
    written: dict[str, list[WrittenRegion]] = {name: [] for name in meta}
    files: dict[int, FilePlan] = {}
    for rank in sorted(mine):
        laid_out = only is None or rank == only
        # Widest dtypes first keeps every tensor aligned to its itemsize in the file.
        regions = sorted(mine[rank], key=lambda k: (-meta[k[0]].dtype.itemsize, k[0], k[1]))
        slots, copies, spans, at = [], [], [], 0
        for name, box in regions:
            entry = meta[name]
            size = entry.dtype.itemsize
            n = strip_count(
                box, itemsize=size, min_bytes=chunk_min_bytes, max_pieces=chunk_max_pieces
            )
            region = (rank, *box, n)
            written[name].append(region)
            if not laid_out:
                continue
            spans.append(
                Region(
                    name=name, box=box, dtype=entry.dtype, begin=at, end=at + numel(box[1]) * size
                )
            )
            # The very strips and keys a load cuts from the manifest's listing of the region.
            for c in region_chunks(name, region):
                slot = FileSlot(
                    key=c.key,
                    dtype=entry.dtype,
                    shape=c.sizes,
                    begin=at,
                    end=at + numel(c.sizes) * size,
                    block_rows=block_rows(c.sizes, itemsize=size, block_bytes=block_bytes),
                )
                at = slot.end
                slots.append(slot)
                copies.append(
                    Copy(name=name, box=(c.offsets, c.sizes), slot=slot, region=len(spans) - 1)
                )
        if laid_out:
            files[rank] = FilePlan(
                name=file_name(rank),
                rank=rank,
                slots=tuple(slots),
                copies=tuple(copies),
                regions=tuple(spans),
            )
    tensors = {
        name: TensorPlan(
            name=name,
            kind=e.kind,
            dtype=e.dtype,
            shape=e.shape,
            chunks=RegionChunks(name, tuple(written[name])),
            regions=tuple(written[name]),
        )
        for name, e in sorted(meta.items())
    }
    return SavePlan(
        files=files, tensors=tensors, block_bytes=block_bytes, writers=tuple(sorted(mine))
    )
