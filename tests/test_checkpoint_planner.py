"""Property tests of the pure checkpoint arithmetic: reshard reads, chunk grids, writers."""

from __future__ import annotations

import itertools

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from checkpoint.errors import CheckpointError, LayoutMismatchError
from checkpoint.planner import (
    SavedChunk,
    assign_writers,
    chunk_grid,
    coverage_problem,
    plan_reads,
)
from checkpoint.saveplan import LocalEntry, build_save_plan


@st.composite
def tilings(draw, shape):
    """A random grid tiling of ``shape`` (each dimension cut at random points)."""
    axes = []
    for n in shape:
        cuts = sorted(draw(st.sets(st.integers(1, max(1, n - 1)), max_size=3)) - {n})
        bounds = [0, *cuts, n]
        axes.append([(a, b - a) for a, b in itertools.pairwise(bounds) if b > a])
    boxes = [((), ())]
    for axis in axes:
        boxes = [((*o, a), (*s, n)) for o, s in boxes for a, n in axis]
    return boxes


@st.composite
def boxes_in(draw, shape):
    offs, sizes = [], []
    for n in shape:
        a = draw(st.integers(0, n - 1))
        b = draw(st.integers(a + 1, n))
        offs.append(a)
        sizes.append(b - a)
    return tuple(offs), tuple(sizes)


shapes = st.lists(st.integers(1, 9), min_size=1, max_size=3).map(tuple)


def slices(box):
    return tuple(slice(o, o + s) for o, s in zip(*box, strict=True))


@settings(max_examples=200, deadline=None)
@given(data=st.data(), shape=shapes)
def test_a_target_assembled_from_any_saved_tiling_equals_the_direct_slice(data, shape):
    full = torch.randn(shape)
    saved = data.draw(tilings(shape))
    # Saved shards are themselves split into chunk grids, as the writer does.
    min_bytes = data.draw(st.sampled_from([1, 8, 64, 1 << 20]))
    chunks = [
        SavedChunk(file=f"f{i}", key=f"k{i}.{j}", offsets=p[0], sizes=p[1])
        for i, box in enumerate(saved)
        for j, p in enumerate(chunk_grid(box, itemsize=4, min_bytes=min_bytes))
    ]
    target = data.draw(boxes_in(shape))
    out = torch.full(target[1], float("nan"))
    for op in plan_reads("t", target, chunks, global_shape=shape):
        stored = full[slices((op.chunk.offsets, op.chunk.sizes))]
        out[op.dst] = stored[op.src]
    assert torch.equal(out, full[slices(target)])


@settings(max_examples=100, deadline=None)
@given(data=st.data(), shape=shapes)
def test_a_target_not_fully_covered_by_the_saved_chunks_is_refused(data, shape):
    saved = data.draw(tilings(shape))
    if len(saved) < 2:
        return
    drop = data.draw(st.integers(0, len(saved) - 1))
    chunks = [SavedChunk("f", str(i), *b) for i, b in enumerate(saved) if i != drop]
    whole = ((0,) * len(shape), shape)
    try:
        plan_reads("t", whole, chunks, global_shape=shape)
    except LayoutMismatchError as exc:
        assert "cover" in str(exc)
    else:
        raise AssertionError("a gap went unnoticed")


@settings(max_examples=150, deadline=None)
@given(data=st.data(), shape=shapes)
def test_coverage_accepts_exact_tilings_and_names_gaps_and_overlaps(data, shape):
    saved = data.draw(tilings(shape))
    assert coverage_problem("t", shape, saved) is None
    if len(saved) > 1:
        assert "cover" in coverage_problem("t", shape, saved[1:])
        assert "overlap" in coverage_problem("t", shape, [*saved, saved[0]])


@settings(max_examples=150, deadline=None)
@given(
    shape=shapes,
    itemsize=st.sampled_from([1, 2, 4]),
    min_bytes=st.integers(1, 400),
)
def test_a_chunk_grid_tiles_its_region_in_cells_of_at_least_the_minimum_size(
    shape, itemsize, min_bytes
):
    box = ((0,) * len(shape), shape)
    grid = chunk_grid(box, itemsize=itemsize, min_bytes=min_bytes)
    assert coverage_problem("t", shape, grid) is None
    if len(grid) > 1:
        assert min(torch.Size(s).numel() * itemsize for _, s in grid) >= min_bytes
    assert len(grid) <= 16


@settings(max_examples=150, deadline=None)
@given(
    sizes=st.lists(st.integers(1, 1000), min_size=1, max_size=40),
    world=st.integers(1, 8),
    data=st.data(),
)
def test_each_region_gets_one_writer_among_its_holders_and_replicas_balance(sizes, world, data):
    ranks = list(range(world))
    holders = {
        f"r{i}": (n, data.draw(st.lists(st.sampled_from(ranks), min_size=1, unique=True)))
        for i, n in enumerate(sizes)
    }
    writers = assign_writers(holders, ranks=ranks)
    assert set(writers) == set(holders)
    assert all(writers[r] in holders[r][1] for r in holders)
    assert assign_writers(dict(reversed(holders.items())), ranks=ranks) == writers
    # Fully replicated regions: the loads differ by at most one region (greedy LPT).
    everywhere = {f"r{i}": (n, ranks) for i, n in enumerate(sizes)}
    load = dict.fromkeys(ranks, 0)
    for rid, rank in assign_writers(everywhere, ranks=ranks).items():
        load[rank] += everywhere[rid][0]
    assert max(load.values()) - min(load.values()) <= max(sizes)


def entry(name, shape, offsets, sizes, dtype=torch.float32):
    return LocalEntry(
        name=name, kind="model", dtype=dtype, shape=shape, offsets=offsets, sizes=sizes
    )


def test_replicated_tensors_are_written_once_and_spread_over_the_replicas():
    # dp=4 replicas of 8 equal tensors: each rank writes two, and each tensor exactly once.
    per_rank = [[entry(f"w{i}", (4, 4), (0, 0), (4, 4)) for i in range(8)] for _ in range(4)]
    plan = build_save_plan(per_rank, chunk_min_bytes=1 << 20)
    assert sorted(len(f.slots) for f in plan.files.values()) == [2, 2, 2, 2]
    for t in plan.tensors.values():
        assert len(t.chunks) == 1


def test_ranks_whose_shards_do_not_tile_a_tensor_cannot_save():
    per_rank = [[entry("w", (4, 4), (0, 0), (2, 4))], [entry("w", (4, 4), (1, 0), (2, 4))]]
    try:
        build_save_plan(per_rank, chunk_min_bytes=1)
    except CheckpointError as exc:
        assert "overlap" in str(exc)
    else:
        raise AssertionError("overlapping shards were accepted")


@settings(max_examples=100, deadline=None)
@given(data=st.data(), shape=shapes)
def test_coverage_names_an_overlap_that_hides_a_gap_of_the_same_size(data, shape):
    saved = data.draw(tilings(shape))
    pairs = [
        (i, j)
        for i in range(len(saved))
        for j in range(len(saved))
        if i != j and saved[i][1] == saved[j][1]
    ]
    if not pairs:
        return
    i, j = data.draw(st.sampled_from(pairs))
    doubled = [saved[i] if k == j else b for k, b in enumerate(saved)]
    assert coverage_problem("t", shape, doubled) == "t: shards overlap and leave a gap"
