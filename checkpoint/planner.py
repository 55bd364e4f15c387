"""Pure arithmetic of sharded tensors: regions, chunk grids, coverage, reshard and writers.

Nothing here touches files or processes, so all of it is property-tested. A *region* is a
box in a global tensor given by per-dimension ``offsets`` and ``sizes``.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

from checkpoint.errors import LayoutMismatchError

Box = tuple[tuple[int, ...], tuple[int, ...]]
"""A region as (offsets, sizes)."""


@dataclass(frozen=True, slots=True)
class SavedChunk:
    """One stored piece of a global tensor: a safetensors key in a file, and its region."""

    file: str
    """File name inside the step directory."""
    key: str
    """The safetensors key of the piece."""
    offsets: tuple[int, ...]
    """Start of the piece in the global tensor."""
    sizes: tuple[int, ...]
    """Extent of the piece in each dimension."""


@dataclass(frozen=True, slots=True)
class ReadOp:
    """Copy ``chunk[src]`` into ``local[dst]``; slices are relative to chunk and local region."""

    chunk: SavedChunk
    src: tuple[slice, ...]
    dst: tuple[slice, ...]

    @property
    def whole_chunk(self) -> bool:
        """Whether the copy takes the entire chunk (so its checksum can be checked exactly)."""
        return all(
            s.start == 0 and s.stop == n for s, n in zip(self.src, self.chunk.sizes, strict=True)
        )

    @property
    def numel(self) -> int:
        return math.prod(s.stop - s.start for s in self.src)


def numel(sizes: Sequence[int]) -> int:
    return math.prod(sizes)


def intersect(a: Box, b: Box) -> Box | None:
    """The common region of two boxes, or None when they do not overlap (empty boxes never do)."""
    offs, sizes = [], []
    for ao, asz, bo, bsz in zip(a[0], a[1], b[0], b[1], strict=True):
        lo, hi = max(ao, bo), min(ao + asz, bo + bsz)
        if hi <= lo:
            return None
        offs.append(lo)
        sizes.append(hi - lo)
    return tuple(offs), tuple(sizes)


def relative(inner: Box, outer_offsets: Sequence[int]) -> tuple[slice, ...]:
    """Slices selecting ``inner`` inside a tensor that holds the region starting at outer."""
    return tuple(
        slice(o - base, o - base + s)
        for o, s, base in zip(inner[0], inner[1], outer_offsets, strict=True)
    )


def plan_reads(
    name: str, target: Box, chunks: Iterable[SavedChunk], *, global_shape: Sequence[int]
) -> list[ReadOp]:
    """Which pieces of which saved chunks fill the ``target`` region of tensor ``name``.

    Raises :class:`LayoutMismatchError` when the target lies outside the tensor or the
    saved chunks do not cover it exactly once.
    """
    if len(target[0]) != len(global_shape):
        raise LayoutMismatchError(
            f"{name}: asked for {len(target[0])} dimensions, saved tensor has {len(global_shape)}"
        )
    for dim, (o, s, g) in enumerate(zip(target[0], target[1], global_shape, strict=True)):
        if o < 0 or s < 0 or o + s > g:
            raise LayoutMismatchError(
                f"{name}: dim {dim}: asked for [{o}, {o + s}) of a saved size {g}"
            )
    ops = []
    covered = 0
    for chunk in chunks:
        common = intersect(target, (chunk.offsets, chunk.sizes))
        if common is None:
            continue
        ops.append(
            ReadOp(
                chunk=chunk, src=relative(common, chunk.offsets), dst=relative(common, target[0])
            )
        )
        covered += numel(common[1])
    if covered != numel(target[1]):
        raise LayoutMismatchError(
            f"{name}: saved shards cover {covered} of the {numel(target[1])} elements asked for"
        )
    return ops


CORNERS_PER_CHUNK = 16
"""Corners the coverage check may spend per chunk, on average over a manifest: a chunk of
``ndim`` dimensions costs 2^ndim (a real checkpoint's tensors have 1 to 3 dimensions, 2 to
8 corners a chunk; 4 dimensions cost 16)."""
CORNERS_FREE = 1 << 16
"""Corners any manifest may spend beyond :data:`CORNERS_PER_CHUNK` per chunk (a few
many-dimensional tensors with a few chunks each)."""


def coverage_cost(ndim: int, chunks: int) -> int:
    """Corners :func:`coverage_problem` keeps, at most, for ``chunks`` chunks of a tensor of
    ``ndim`` dimensions (the tensor's own included)."""
    return (chunks + 1) << ndim


def coverage_problem(name: str, shape: Sequence[int], boxes: Sequence[Box]) -> str | None:
    """Why ``boxes`` do not tile a tensor of ``shape`` exactly (None when they do).

    Linear in the boxes (times 2^ndim), so a hostile manifest with a million chunks costs
    a million steps, not a million squared. The indicator function of a half-open box is
    the signed sum of orthant indicators at its 2^d corners (+ at corners with an even
    number of upper bounds, - at odd), and that representation is unique; so the boxes'
    indicators sum to the tensor's (every element covered exactly once, none outside)
    iff their signed corner counts, summed, equal the tensor's own corners.

    Memory and time are :func:`coverage_cost` corners: a caller that reads boxes from
    outside bounds that first (``Manifest.from_json`` allows :data:`CORNERS_PER_CHUNK`
    per chunk of the manifest, plus :data:`CORNERS_FREE`). The element counts are checked
    before any corner is kept, so a tiling with a gap or too much is refused at no cost.
    """
    ndim = len(shape)
    total = 0
    for offs, sizes in boxes:
        if len(offs) != ndim or len(sizes) != ndim:
            return f"{name}: shard {list(offs)} has the wrong number of dimensions"
        for o, s, g in zip(offs, sizes, shape, strict=True):
            if o < 0 or s < 0 or o + s > g:
                return (
                    f"{name}: shard at {list(offs)} size {list(sizes)} lies outside {list(shape)}"
                )
        total += numel(sizes)
    if total > numel(shape):
        return f"{name}: shards overlap (they hold {total} elements, the tensor {numel(shape)})"
    if total < numel(shape):
        return f"{name}: shards cover {total} of {numel(shape)} elements"
    corners: dict[tuple[int, ...], int] = {}
    for offs, sizes in boxes:
        _add_corners(corners, offs, sizes, +1)
    _add_corners(corners, (0,) * ndim, tuple(shape), -1)
    if any(corners.values()):
        return f"{name}: shards overlap and leave a gap"
    return None


def _add_corners(
    corners: dict[tuple[int, ...], int], offs: Sequence[int], sizes: Sequence[int], sign: int
) -> None:
    if 0 in sizes:
        return  # an empty box: its corners cancel
    # Each corner with its weight: + at an even number of upper bounds, - at odd.
    points: Sequence[tuple[tuple[int, ...], int]]
    if len(offs) == 2:  # most tensors: the four corners written out (half the time)
        (a, b), (h, w_) = offs, sizes
        points = (((a, b), sign), ((a, b + w_), -sign), ((a + h, b), -sign),
                  ((a + h, b + w_), sign))  # fmt: skip
    else:
        points = [((), sign)]
        for o, s in zip(offs, sizes, strict=True):
            points = [((*p, o), w) for p, w in points] + [((*p, o + s), -w) for p, w in points]
    for corner, w in points:
        n = corners.get(corner, 0) + w
        if n:
            corners[corner] = n
        else:
            del corners[corner]  # it was there (with -w)


def _split(extent: int, parts: int) -> list[tuple[int, int]]:
    base, extra = divmod(extent, parts)
    out, start = [], 0
    for i in range(parts):
        size = base + (1 if i < extra else 0)
        out.append((start, size))
        start += size
    return out


def chunk_grid(box: Box, *, itemsize: int, min_bytes: int, max_pieces: int = 4) -> list[Box]:
    """Split a region into a grid over its first two dimensions, each piece >= ``min_bytes``:
    the chunks format version 2 wrote (each checked whole). Version 3 writes
    :func:`strip_grid`; this stays for arithmetic on older checkpoints' layouts.
    """
    offsets, sizes = box
    pieces = [1] * len(sizes)

    def smallest_cell(p: list[int]) -> int:
        return math.prod(n // k for n, k in zip(sizes, p, strict=True)) * itemsize

    grown = True
    while grown:
        grown = False
        for d in range(min(2, len(sizes))):
            trial = list(pieces)
            trial[d] *= 2
            if (
                trial[d] <= max_pieces
                and trial[d] <= sizes[d]
                and smallest_cell(trial) >= min_bytes
            ):
                pieces = trial
                grown = True
    axes = [
        [(offsets[d] + start, size) for start, size in _split(sizes[d], pieces[d])]
        for d in range(len(sizes))
    ]
    grid: list[Box] = [((), ())]
    for axis in axes:
        grid = [((*o, start), (*s, size)) for o, s in grid for start, size in axis]
    return grid


def strip_grid(box: Box, *, itemsize: int, min_bytes: int, max_pieces: int = 8) -> list[Box]:
    """Split a region into strips along its second dimension (format versions 3 and 4),
    each of at least ``min_bytes`` and at most ``max_pieces`` of them; a region of fewer
    than two dimensions is one piece.

    A strip is stored contiguously, so a load that needs some of a region's columns
    reads only the strips holding them; a load that needs some of its rows reads only
    the verify blocks (:func:`block_rows`, runs of whole rows inside a strip) holding them.
    """
    n = strip_count(box, itemsize=itemsize, min_bytes=min_bytes, max_pieces=max_pieces)
    return strips(box, n)


def strip_count(box: Box, *, itemsize: int, min_bytes: int, max_pieces: int = 8) -> int:
    """How many strips :func:`strip_grid` cuts ``box`` into."""
    sizes = box[1]
    if len(sizes) < 2:
        return 1
    column = numel(sizes) // sizes[1] * itemsize if sizes[1] else 0
    pieces = 1
    # The narrowest strip of an even split has sizes[1] // pieces columns.
    while (
        pieces * 2 <= min(max_pieces, sizes[1]) and sizes[1] // (pieces * 2) * column >= min_bytes
    ):
        pieces *= 2
    return pieces


def strips(box: Box, pieces: int) -> list[Box]:
    """``box`` cut into ``pieces`` strips along its second dimension, as even as can be
    (the first ``sizes[1] % pieces`` one column wider); one piece: the box itself. A format
    version 4 manifest records the count, and a load cuts the same strips with this."""
    offsets, sizes = box
    if pieces == 1 or len(sizes) < 2:
        return [(tuple(offsets), tuple(sizes))]
    return [
        ((offsets[0], offsets[1] + start, *offsets[2:]), (sizes[0], size, *sizes[2:]))
        for start, size in _split(sizes[1], pieces)
    ]


def chunk_rows(sizes: Sequence[int]) -> int:
    """Rows of a stored chunk: its first dimension (a 0-d chunk is one row)."""
    return sizes[0] if sizes else 1


def row_bytes(sizes: Sequence[int], itemsize: int) -> int:
    """Bytes of one row of a chunk (one element of a 0-d or 1-d chunk)."""
    return math.prod(sizes[1:]) * itemsize


def block_rows(sizes: Sequence[int], *, itemsize: int, block_bytes: int) -> int:
    """Rows per verify block of a chunk (format version 3): as many whole rows as fit in
    ``block_bytes``, at least one. A block is a contiguous run of rows, so a load that
    needs a range of rows reads and checks only the blocks holding it."""
    return max(1, block_bytes // max(1, row_bytes(sizes, itemsize)))


def block_count(sizes: Sequence[int], rows_per_block: int) -> int:
    """Verify blocks of a chunk. An empty chunk (any size 0, rows of no bytes included) has
    one, of no bytes: the writer checksums its no bytes once."""
    if not numel(sizes) and sizes:
        return 1
    return max(1, -(-chunk_rows(sizes) // rows_per_block))


def blocks_for_rows(rows: slice, rows_per_block: int) -> range:
    """The blocks holding rows ``[rows.start, rows.stop)`` of a chunk."""
    if rows.stop <= rows.start:
        return range(0)
    return range(rows.start // rows_per_block, -(-rows.stop // rows_per_block))


def assign_writers(
    regions: Mapping[str, tuple[int, Sequence[int]]], *, ranks: Sequence[int]
) -> dict[str, int]:
    """Pick one writer per region among its holders so that all ranks write about equal bytes.

    ``regions`` maps a region id to (bytes, holders). Largest regions go first, each to the
    holder with the fewest bytes so far (ties: lower rank), which is deterministic on every
    rank and within one region's size of the best balance.
    """
    load = {r: 0 for r in ranks}
    out: dict[str, int] = {}
    for rid, (nbytes, holders) in sorted(regions.items(), key=lambda kv: (-kv[1][0], kv[0])):
        writer = min(holders, key=lambda r: (load[r], r))
        load[writer] += nbytes
        out[rid] = writer
    return out
