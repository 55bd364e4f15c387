"""State from the survivors' memory (checkpoint/live.py): the pure planner, then real gloo
processes, then the real trainer continuing after a layout change.

- Planning: box subtraction, cutting and chunk layout tile exactly; random holders and
  needs are filled element by element exactly once, from holders at the chosen step; local
  copies first, remote load spread; the step is the highest that covers everything.
- Synthetic state on three processes: reshard with bfloat16, 0-d tensors, padding rows and
  a newcomer; step skew (the higher step when it covers, else the lower); an uncovered
  region and a corrupted chunk make every rank return None.
- The trainer: train in layout A, rebuild the world and the Trainer for layout B in the
  same processes (a rank dropped, or a newcomer added), fill B's parameters and AdamW
  state from A's with :func:`recover_from_peers`, train on; every step's loss equals an
  uninterrupted single-process run within 1e-5 (fp32, dropout 0).
"""

from __future__ import annotations

import itertools
import json
import os
import random
import zlib
from datetime import timedelta
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from session_cache import once_per_session

import checkpoint.live as live
from checkpoint.live import (
    ALIGN,
    Piece,
    describe,
    pair_chunks,
    plan_recovery,
    recover_from_peers,
    split_box,
    subtract,
)
from checkpoint.planner import coverage_problem, intersect, numel
from checkpoint.shards import ShardInfo

# -- pure planning -------------------------------------------------------------------------


def _random_box(rng: random.Random, shape: tuple[int, ...]):
    offs, sizes = [], []
    for g in shape:
        lo = rng.randrange(g)
        hi = rng.randrange(lo + 1, g + 1)
        offs.append(lo)
        sizes.append(hi - lo)
    return tuple(offs), tuple(sizes)


def test_subtract_leaves_disjoint_boxes_that_tile_the_rest() -> None:
    rng = random.Random(1)
    for _ in range(500):
        shape = tuple(rng.randint(1, 7) for _ in range(rng.randint(1, 4)))
        outer = _random_box(rng, shape)
        inner = _random_box(rng, outer[1])
        inner = (tuple(o + i for o, i in zip(outer[0], inner[0], strict=True)), inner[1])
        parts = subtract(outer, inner)
        assert len(parts) <= 2 * len(shape)
        # Shift to the outer box's origin: the parts and the inner box tile it exactly.
        boxes = [
            (tuple(o - b for o, b in zip(p[0], outer[0], strict=True)), p[1])
            for p in [*parts, inner]
        ]
        assert coverage_problem("t", outer[1], boxes) is None


def test_split_box_tiles_in_pieces_that_fit() -> None:
    rng = random.Random(2)
    for _ in range(300):
        shape = tuple(rng.randint(1, 9) for _ in range(rng.randint(0, 4)))
        box = ((0,) * len(shape), shape)
        itemsize = rng.choice([1, 2, 4, 8])
        limit = rng.randint(1, 200)
        parts = split_box(box, itemsize=itemsize, max_bytes=limit)
        assert coverage_problem("t", shape, parts) is None
        for _offs, sizes in parts:
            assert numel(sizes) * itemsize <= max(limit, itemsize)


def test_pair_chunks_lay_out_aligned_pieces_in_order() -> None:
    pieces = [
        Piece("a", 0, 1, (0, 0), (100, 30), 4),  # 12000 bytes: cut to fit 4096
        Piece("b", 0, 1, (), (), 2),  # a 0-d bfloat16
        Piece("c", 0, 1, (5,), (3,), 8),
    ]
    chunks = pair_chunks(pieces, chunk_bytes=4096)
    assert len(chunks) > 1
    pos = 0
    seen: dict[str, list] = {}
    for c in chunks:
        assert c.start == pos and c.length <= 4096 and c.end == c.start + c.length
        assert c.wire == (c.items[0][0].nbytes if len(c.items) == 1 else c.length)
        pos = c.end
        at = c.start
        for piece, offset in c.items:
            assert offset == at and offset % ALIGN == 0
            at += -(-piece.nbytes // ALIGN) * ALIGN
            seen.setdefault(piece.key, []).append(piece.box)
        assert at == c.end
    assert coverage_problem("a", (100, 30), seen["a"]) is None
    assert seen["b"] == [((), ())] and seen["c"] == [((5,), (3,))]


def test_a_large_piece_travels_alone_and_small_ones_are_packed_around_it() -> None:
    """Pieces of at least ``alone_bytes`` get chunks of their own (cut to ``chunk_bytes``),
    so that sender and receiver, each from the plan alone, agree on which messages are
    one piece's bytes (sent and received in place where the tensors allow)."""
    pieces = [
        Piece("s1", 0, 1, (0,), (10,), 4),  # 40 bytes
        Piece("big", 0, 1, (0, 0), (100, 30), 4),  # 12000 bytes: alone, cut to 4096
        Piece("s2", 0, 1, (0,), (5,), 4),
        Piece("s3", 0, 1, (0,), (6,), 4),
    ]
    chunks = pair_chunks(pieces, chunk_bytes=4096, alone_bytes=1000)
    keys = [[p.key for p, _ in c.items] for c in chunks]
    assert keys[0] == ["s1"] and keys[-1] == ["s2", "s3"]
    assert all(k == ["big"] for k in keys[1:-1]) and len(keys) == 2 + 3
    assert [c.wire for c in chunks[1:-1]] == [c.items[0][0].nbytes for c in chunks[1:-1]]
    assert sum(c.wire for c in chunks[1:-1]) == 12000
    assert chunks[-1].wire == chunks[-1].length == 32 + 32  # 20 and 24 bytes, 16-aligned


def _desc(step, have: dict, need: dict, consumed=None, dtype="float32"):
    """A rank's description from {key: (global_shape, offsets, sizes)}."""
    return {
        "v": live.DESCRIPTION_VERSION,
        "step": step,
        "consumed": (step * 10 if consumed is None else consumed) if step is not None else None,
        "have": {k: [dtype, list(g), list(o), list(s)] for k, (g, o, s) in have.items()},
        "need": {k: [dtype, list(g), list(o), list(s)] for k, (g, o, s) in need.items()},
        "error": None,
    }


def _check_exactly_once(descs, plan) -> None:
    """Each needed element is written by exactly one piece, taken from a holder at the
    plan's step whose box contains it; nothing else is written."""
    for r, d in enumerate(descs):
        for key, (_dt, shape, offs, sizes) in d["need"].items():
            count = np.zeros(shape, dtype=np.int64)
            for p in plan.pieces:
                if p.dst != r or p.key != key:
                    continue
                src = descs[p.src]
                assert src["step"] == plan.step
                _, _, ho, hs = src["have"][key]
                assert intersect(p.box, (tuple(ho), tuple(hs))) == p.box
                count[tuple(slice(o, o + s) for o, s in zip(*p.box, strict=True))] += 1
            want = np.zeros(shape, dtype=np.int64)
            want[tuple(slice(o, o + s) for o, s in zip(offs, sizes, strict=True))] = 1
            assert (count == want).all(), (r, key)


def _grid(rng: random.Random, shape):
    """A random partition of ``shape`` into grid boxes."""
    axes = []
    for g in shape:
        cuts = sorted(rng.sample(range(1, g), k=min(g - 1, rng.randint(0, 2)))) if g > 1 else []
        edges = [0, *cuts, g]
        axes.append([(a, b - a) for a, b in itertools.pairwise(edges)])
    boxes = [((), ())]
    for axis in axes:
        boxes = [((*o, a), (*s, n)) for o, s in boxes for a, n in axis]
    return boxes


def test_random_holders_fill_every_needed_element_exactly_once() -> None:
    rng = random.Random(3)
    planned = refused = 0
    for _ in range(300):
        world = rng.randint(1, 5)
        shapes = {
            f"t{i}": tuple(rng.randint(1, 6) for _ in range(rng.randint(0, 3)))
            for i in range(rng.randint(1, 4))
        }
        have: list[dict] = [{} for _ in range(world)]
        need: list[dict] = [{} for _ in range(world)]
        for key, shape in shapes.items():
            cells = _grid(rng, shape)
            if len(cells) > world:
                cells = [((0,) * len(shape), shape)]
            ranks = rng.sample(range(world), k=world)
            for r, box in zip(ranks, cells, strict=False):
                have[r][key] = (shape, *box)
            for r in ranks[len(cells) :]:  # replicas of some cell, or nothing
                if rng.random() < 0.5:
                    have[r][key] = (shape, *rng.choice(cells))
            for r in range(world):
                if rng.random() < 0.7:
                    need[r][key] = (shape, *_random_box(rng, shape))
        newcomer = rng.randrange(world) if world > 1 and rng.random() < 0.3 else None
        descs = [
            _desc(None if r == newcomer else 5, {} if r == newcomer else have[r], need[r])
            for r in range(world)
        ]
        # The oracle: every needed element held by some rank other than the newcomer.
        coverable = any(d["step"] is not None for d in descs)
        for key, shape in shapes.items():
            held = np.zeros(shape, dtype=bool)
            for d in descs:
                if d["step"] is not None and key in d["have"]:
                    held[_slices(d["have"][key][2:])] = True
            for d in descs:
                if key in d["need"] and not held[_slices(d["need"][key][2:])].all():
                    coverable = False
        plan, why = plan_recovery(descs)
        assert (plan is not None) == coverable, why
        if plan is None:
            refused += 1
            continue
        planned += 1
        assert plan.step == 5 and plan.consumed_samples == 50
        _check_exactly_once(descs, plan)
    assert planned > 100 and refused > 10


def _slices(box) -> tuple[slice, ...]:
    offs, sizes = box
    return tuple(slice(o, o + s) for o, s in zip(offs, sizes, strict=True))


def test_a_rank_copies_what_it_holds_and_remote_load_is_spread() -> None:
    shape = (8, 4)
    whole = (shape, (0, 0), shape)
    keys = [f"w{i}" for i in range(10)]
    descs = [
        _desc(3, {k: whole for k in keys}, {k: whole for k in keys}),
        _desc(3, {k: whole for k in keys}, {k: whole for k in keys}),
        _desc(None, {}, {k: whole for k in keys}),  # a newcomer
    ]
    plan, _ = plan_recovery(descs)
    assert plan is not None
    assert all(p.src == p.dst for p in plan.pieces if p.dst in (0, 1))
    sent = {0: 0, 1: 0}
    for p in plan.pieces:
        if p.dst == 2:
            sent[p.src] += p.nbytes
    assert sent[0] == sent[1] == 5 * 8 * 4 * 4


def test_a_resharded_region_comes_from_several_holders() -> None:
    g = (6, 4)
    descs = [
        _desc(2, {"w": (g, (0, 0), (3, 4))}, {"w": (g, (0, 0), (6, 2))}),
        _desc(2, {"w": (g, (3, 0), (3, 4))}, {"w": (g, (0, 2), (6, 2))}),
    ]
    plan, _ = plan_recovery(descs)
    assert plan is not None
    _check_exactly_once(descs, plan)
    assert {(p.src, p.dst) for p in plan.pieces} == {(0, 0), (1, 0), (0, 1), (1, 1)}


def test_the_highest_step_that_covers_everything_is_chosen() -> None:
    g = (4,)
    whole, low, high = (g, (0,), (4,)), (g, (0,), (2,)), (g, (2,), (2,))
    ahead = [_desc(8, {"w": whole}, {"w": whole}), _desc(7, {"w": whole}, {"w": whole})]
    plan, _ = plan_recovery(ahead)
    assert plan is not None and plan.step == 8 and plan.holders == (0,)
    assert plan.consumed_samples == 80 and plan.skipped_steps == ()
    # The rank one step ahead holds only half: the step behind covers all of it.
    partial = [_desc(8, {"w": low}, {"w": whole}), _desc(7, {"w": whole}, {"w": whole})]
    plan, _ = plan_recovery(partial)
    assert plan is not None and plan.step == 7 and plan.skipped_steps == (8,)
    assert all(p.src == 1 for p in plan.pieces)
    # Neither step covers it: None, and the reason names both.
    split = [_desc(8, {"w": low}, {"w": whole}), _desc(7, {"w": low}, {"w": high})]
    plan, why = plan_recovery(split)
    assert plan is None and "step 8" in why and "step 7" in why


def test_disagreement_refuses() -> None:
    g = (4,)
    whole = (g, (0,), g)
    bad_dtype = [_desc(1, {"w": whole}, {}), _desc(1, {}, {"w": whole}, dtype="bfloat16")]
    assert plan_recovery(bad_dtype) == (
        None,
        "w: rank 0 holds float32 [4], rank 1 needs bfloat16 [4]",
    )
    bad_shape = [_desc(1, {"w": whole}, {}), _desc(1, {}, {"w": ((5,), (0,), (4,))})]
    assert plan_recovery(bad_shape) == (
        None,
        "w: rank 0 holds float32 [4], rank 1 needs float32 [5]",
    )
    bad_name = [_desc(1, {"w": whole}, {"w": whole}, dtype="float99")]
    assert plan_recovery(bad_name) == (None, "rank 0: w: unknown dtype 'float99'")
    consumed = [_desc(1, {"w": whole}, {"w": whole}), _desc(1, {"w": whole}, {}, consumed=3)]
    plan, why = plan_recovery(consumed)
    assert plan is None and "consumed_samples" in why
    nothing = [_desc(None, {}, {"w": whole})]
    assert plan_recovery(nothing) == (None, "no rank holds any state")


def test_a_description_of_thousands_of_tensors_goes_in_columns_and_comes_back_equal() -> None:
    """A layer's tensors share a ShardInfo with their moments, and same-shaped layers
    share their geometry: the wire carries each distinct entry once and each key once
    (the need of an in-place recovery names the live state's keys), and decodes to the
    same description, with one shared list per distinct entry."""
    infos = [ShardInfo(f"l{i}.w", (8, 4), (4, 0), (4, 4)) for i in range(3000)]
    have = {}
    for i, info in enumerate(infos):
        t = torch.zeros(4, 4)
        have[f"l{i}.w"] = (t, info)
        have[f"exp_avg/l{i}.w"] = (torch.zeros(4, 4), info)
        have[f"step/l{i}.w"] = (torch.tensor(1.0), ShardInfo.whole(f"step/l{i}.w", ()))
    d = describe(have=have, have_step=4, have_consumed=40, need=have)
    wire = live._encode(d)
    assert len(wire["entries"]) == 2 and wire["need"]["keys"] is None
    back = live._decode(json.loads(json.dumps(wire)))
    assert back == json.loads(json.dumps(d))
    assert back["have"]["l0.w"] is back["have"]["exp_avg/l7.w"] is back["need"]["l9.w"]
    assert live.gather_descriptions(d, None) == [back]  # one process: the same path
    # In place: every piece is its own rank's, and nothing is copied.
    plan, why = plan_recovery([back])
    assert plan is not None and len(plan.pieces) == 9000, why
    assert {(p.src, p.dst) for p in plan.pieces} == {(0, 0)}


def test_many_same_shaped_keys_are_planned_alike_and_spread_over_equal_holders() -> None:
    """A newcomer of three ranks needs 400 keys of two shapes that both others hold
    whole, and one key only rank 0 holds the bottom half of (rank 1 the top): every
    element once, each key's bytes from the holder with the fewest so far, ending within
    one key of even; the split key from both."""
    big, small = ((16, 8), (0, 0), (16, 8)), ((8,), (0,), (8,))
    whole = {**{f"b{i}": big for i in range(200)}, **{f"s{i}": small for i in range(200)}}
    split = ((4, 2), (2, 0), (2, 2)), ((4, 2), (0, 0), (2, 2))
    descs = [
        _desc(3, {**whole, "x": split[0]}, {}),
        _desc(3, {**whole, "x": split[1]}, {}),
        _desc(None, {}, {**whole, "x": ((4, 2), (0, 0), (4, 2))}),
    ]
    plan, why = plan_recovery(descs)
    assert plan is not None, why
    _check_exactly_once(descs, plan)
    sent = {0: 0, 1: 0}
    for p in plan.pieces:
        sent[p.src] += p.nbytes
    assert abs(sent[0] - sent[1]) <= 16 * 8 * 4
    assert {p.src for p in plan.pieces if p.key == "x"} == {0, 1}


def test_the_collector_is_off_during_a_recovery_and_back_after() -> None:
    """(gc collections walked every object of the process per tuple-heavy loop: 0.5 s of
    an 8,000-tensor recovery.) A caller's own setting is kept either way."""
    import gc

    seen = []
    w = torch.ones(3)
    have = {"w": (w, ShardInfo.whole("w", (3,)))}

    def note(step):
        seen.append(gc.isenabled())

    for before in (True, False):
        (gc.enable if before else gc.disable)()
        try:
            rec = recover_from_peers(have=have, have_step=1, have_consumed=8,
                                     need={"w": (torch.zeros(3), have["w"][1])}, group=None,
                                     before_write=note)  # fmt: skip
            assert rec is not None and gc.isenabled() == before
        finally:
            gc.enable()
    assert seen == [False, False]


def test_describe_refuses_a_tensor_smaller_than_its_region() -> None:
    info = ShardInfo.whole("w", (4, 4))
    d = describe(
        have=None, have_step=None, have_consumed=None, need={"w": (torch.zeros(3, 4), info)}
    )
    assert "smaller than its region" in d["error"]
    assert plan_recovery([d])[0] is None


def test_one_process_copies_locally_including_0d_bf16_and_padding() -> None:
    g = torch.Generator().manual_seed(0)
    w = torch.randn(6, 4, generator=g).to(torch.bfloat16)
    s = torch.tensor(7.0)
    have = {"w": (w, ShardInfo.whole("w", (6, 4))), "step/w": (s, ShardInfo.whole("step/w", ()))}
    out = torch.full((4, 4), -1.0, dtype=torch.bfloat16)  # 3 rows + 1 padding row
    out_s = torch.tensor(0.0)
    need = {
        "w": (out, ShardInfo("w", (6, 4), (3, 0), (3, 4))),
        "step/w": (out_s, ShardInfo.whole("step/w", ())),
    }
    rec = recover_from_peers(have=have, have_step=4, have_consumed=40, need=need, group=None)
    assert rec is not None and rec.step == 4 and rec.consumed_samples == 40
    assert rec.bytes_in == 0 and rec.bytes_local == 3 * 4 * 2 + 4
    assert torch.equal(out[:3], w[3:]) and (out[3] == -1).all() and out_s.item() == 7.0


# -- synthetic state on real processes --------------------------------------------------------

G_W, G_B = (10, 6), (6,)


def _value(key: str, shape, step: int, dtype=torch.float32) -> torch.Tensor:
    gen = torch.Generator().manual_seed(zlib.crc32(f"{key}:{step}".encode()))
    return torch.randn(shape, generator=gen).to(dtype)


def _region(info: ShardInfo):
    return tuple(slice(o, o + s) for o, s in zip(info.offsets, info.sizes, strict=True))


def _hold(infos: dict[str, tuple[ShardInfo, torch.dtype, int]], step: int):
    """Tensors holding the global values of ``step`` in their regions, plus a padding row."""
    out = {}
    for key, (info, dtype, pad) in infos.items():
        shape = tuple(s + (pad if d == 0 else 0) for d, s in enumerate(info.sizes))
        t = torch.full(shape, 99.0, dtype=dtype)
        t[tuple(slice(0, s) for s in info.sizes)] = _value(key, info.global_shape, step, dtype)[
            _region(info)
        ]
        out[key] = (t, info)
    return out


def _blank(infos):
    out = {}
    for key, (info, dtype, pad) in infos.items():
        shape = tuple(s + (pad if d == 0 else 0) for d, s in enumerate(info.sizes))
        out[key] = (torch.full(shape, -5.0, dtype=dtype), info)
    return out


def _wrong(need, step: int) -> list[str]:
    bad = []
    for key, (t, info) in need.items():
        want = _value(key, info.global_shape, step, t.dtype)[_region(info)]
        inner = t[tuple(slice(0, s) for s in info.sizes)]
        if not torch.equal(inner, want):
            bad.append(key)
        if t.dim() and t.shape[0] > info.sizes[0] and not (t[info.sizes[0] :] == -5.0).all():
            bad.append(f"{key} padding")
    return bad


def _tp(rank: int, tp: int, *, pad: int = 0, rows=None):
    """A tp-like holding: rows of ``w`` (and its moment) split, columns of ``p`` split,
    ``b`` and a 0-d AdamW step replicated. ``rows``: an uneven (offset, size) row split."""
    if rows is None:
        w = ShardInfo.split("w", G_W, 0, rank, tp)
    else:
        w = ShardInfo("w", G_W, (rows[0], 0), (rows[1], G_W[1]))
    return {
        "w": (w, torch.bfloat16, pad),
        "exp_avg/w": (w, torch.float32, pad),
        "p": (ShardInfo.split("p", (6, 6), 1, rank, tp), torch.float32, 0),
        "b": (ShardInfo.whole("b", G_B), torch.float32, 0),
        "step/w": (ShardInfo.whole("step/w", ()), torch.float32, 0),
    }


def _synthetic_worker(rank: int, world: int, store: str, out: str) -> None:
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"file://{store}", rank=rank, world_size=world,
        timeout=timedelta(seconds=60),
    )  # fmt: skip
    group = dist.new_group(backend="gloo")
    results = {}

    def run(name, have, step, need, *, check_step=None):
        before = {k: t.clone() for k, (t, _) in need.items()}
        told = []

        def before_write(agreed: int) -> None:  # nothing of `need` written yet
            told.append([agreed, all(torch.equal(t, before[k]) for k, (t, _) in need.items())])

        rec = recover_from_peers(
            have=have, have_step=step, have_consumed=None if step is None else 16 * step,
            need=need, group=group, before_write=before_write,
        )  # fmt: skip
        res = {"none": rec is None, "before_write": told}
        if rec is not None:
            res.update(step=rec.step, consumed=rec.consumed_samples, bytes_in=rec.bytes_in,
                       bytes_local=rec.bytes_local, sources=rec.sources,
                       wrong=_wrong(need, rec.step if check_step is None else check_step))  # fmt: skip
        results[name] = res

    # Reshard: ranks 0 and 1 held a tp2 layout at step 4, rank 2 is a newcomer; the new
    # layout is tp3 (w's 10 rows split unevenly, with a padding row; p's columns 2 by 2).
    old = _tp(rank, 2) if rank < 2 else None
    new = _tp(rank, 3, pad=1, rows=[(0, 4), (4, 3), (7, 3)][rank])
    need = _blank(new)
    run("reshard", _hold(old, 4) if old else None, 4 if old else None, need)
    # The same with every piece of 16 bytes or more sent alone: row blocks of w (bfloat16,
    # a padding row) go tensor to tensor, p's column blocks are strided and packed alone.
    live.ALONE_BYTES, alone = 16, live.ALONE_BYTES
    run("reshard-alone", _hold(old, 4) if old else None, 4 if old else None, _blank(new))

    # Step skew: rank 0 is one step ahead. It holds everything: its step wins.
    whole = {"w": (ShardInfo.whole("w", G_W), torch.float32, 0)}
    half = {"w": (ShardInfo.split("w", G_W, 0, 0, 2), torch.float32, 0)}
    step = 5 if rank == 0 else 4
    run("skew-ahead-covers", _hold(whole, step), step, _blank(whole))
    # Rank 0 ahead holds half only; ranks 1, 2 behind hold everything: the lower step.
    run("skew-ahead-partial", _hold(half if rank == 0 else whole, step), step, _blank(whole))
    # Nobody holds row block 1 of w at any step: every rank returns None.
    run("uncovered", _hold(half, 4), 4, _blank(whole))
    # A chunk flipped in flight on rank 2 only: every rank returns None.
    if rank == 2:
        live._received_hook = _flip_first_byte
    run("corrupt", _hold(whole, 4) if rank == 0 else None, 4 if rank == 0 else None, _blank(whole))
    live.ALONE_BYTES = alone
    run("corrupt-packed", _hold(whole, 4) if rank == 0 else None, 4 if rank == 0 else None,
        _blank(whole))  # fmt: skip
    live._received_hook = None
    # In place, as Context.sync_state calls it: the survivors pass their live tensors as
    # both have and need (nothing is copied onto itself); the newcomer receives.
    mine = _hold(whole, 4) if rank < 2 else _blank(whole)
    run("in-place", mine if rank < 2 else None, 4 if rank < 2 else None, mine)
    # Rank 1 one step behind: its own tensors are overwritten with rank 0's step.
    step = [4, 3, None][rank]
    mine = _hold(whole, step) if step else _blank(whole)
    run("in-place-behind", mine if step else None, step, mine, check_step=4)
    # Descriptions over the one all-gather's cap: the two-collective way, on every rank.
    live.DESCRIPTION_CAP, cap = 8, live.DESCRIPTION_CAP
    run("large-descriptions", _hold(old, 4) if old else None, 4 if old else None, _blank(new))
    live.DESCRIPTION_CAP = cap
    dist.destroy_process_group()
    Path(out, f"rank-{rank}.json").write_text(json.dumps(results))


def _flip_first_byte(src: int, dst: int, chunk: torch.Tensor) -> None:
    chunk[0] ^= 0x40


def _spawn(fn, world: int, tmp: Path, *args) -> list[dict]:
    out = tmp / "out"
    out.mkdir(exist_ok=True)
    store = tmp / f"store-{fn.__name__}"
    mp.spawn(fn, args=(world, str(store), *args, str(out)), nprocs=world, join=True)
    return [json.loads((out / f"rank-{r}.json").read_text()) for r in range(world)]


@pytest.fixture(scope="module")
def synthetic(tmp_path_factory) -> list[dict]:
    return _spawn(_synthetic_worker, 3, tmp_path_factory.mktemp("synthetic"))


def test_reshard_with_a_newcomer_bf16_0d_and_padding(synthetic) -> None:
    for rank, res in enumerate(synthetic):
        for case in ("reshard", "reshard-alone"):
            r = res[case]
            assert not r["none"] and r["step"] == 4 and r["consumed"] == 64, (rank, case, r)
            assert r["wrong"] == [], (rank, case, r["wrong"])
    # Small pieces are packed together; sent alone, they land in place in the newcomer's
    # tensors (p's column blocks are strided in the senders' tp2 shards: packed there).
    assert synthetic[2]["reshard"]["sources"]["chunks_in_direct"] == 0
    alone = synthetic[2]["reshard-alone"]["sources"]
    assert alone["chunks_in_direct"] == alone["chunks_in"] > 1, alone
    newcomer = synthetic[2]["reshard"]
    assert newcomer["bytes_local"] == 0 and newcomer["bytes_in"] > 0
    # The newcomer's replicated tensors came from both survivors (load spread).
    assert set(newcomer["sources"]["received_from"]) == {"0", "1"}


def test_descriptions_over_the_gathers_cap_take_the_longer_way(synthetic) -> None:
    for rank, res in enumerate(synthetic):
        r = res["large-descriptions"]
        assert not r["none"] and r["step"] == 4 and r["wrong"] == [], (rank, r)
        assert r["bytes_in"] == res["reshard"]["bytes_in"]


def test_live_tensors_passed_as_have_and_need_are_not_copied_onto_themselves(synthetic) -> None:
    nbytes = G_W[0] * G_W[1] * 4
    for rank, res in enumerate(synthetic):
        r = res["in-place"]
        assert not r["none"] and r["step"] == 4 and r["wrong"] == [], (rank, r)
        assert (r["bytes_local"], r["bytes_in"]) == ((nbytes, 0) if rank < 2 else (0, nbytes))
        r = res["in-place-behind"]
        assert not r["none"] and r["step"] == 4 and r["wrong"] == [], (rank, r)
        assert (r["bytes_local"], r["bytes_in"]) == ((nbytes, 0) if rank == 0 else (0, nbytes))


def test_step_skew_takes_the_higher_step_when_it_covers_everything(synthetic) -> None:
    for res in synthetic:
        r = res["skew-ahead-covers"]
        assert not r["none"] and r["step"] == 5 and r["wrong"] == []
        assert r["sources"]["holders"] == [0]
        r = res["skew-ahead-partial"]
        assert not r["none"] and r["step"] == 4 and r["wrong"] == []
        assert r["sources"]["holders"] == [1, 2] and r["sources"]["skipped_steps"] == [5]


def test_the_caller_is_told_the_agreed_step_before_anything_is_written(synthetic) -> None:
    """``before_write(step)``: once, with the step every rank agreed on, while ``need`` is
    untouched (in-process recovery drops a trainer whose adopted memory is about to be
    written at another step); never when nothing will be written."""
    for res in synthetic:
        for name, r in res.items():
            if r["none"] and name == "uncovered":
                assert r["before_write"] == [], name
            elif not r["none"]:
                assert r["before_write"] == [[r["step"], True]], name
            else:  # a corrupted chunk: told before the transfer that then failed
                assert len(r["before_write"]) == 1 and r["before_write"][0][1], name


def test_an_uncovered_region_gives_none_on_every_rank(synthetic) -> None:
    assert [res["uncovered"]["none"] for res in synthetic] == [True, True, True]


def test_a_corrupted_chunk_gives_none_on_every_rank(synthetic) -> None:
    """Flipped in the destination tensor itself (a piece sent alone) and in the packing
    buffer (the same state packed): both fail their CRC on every rank."""
    assert [res["corrupt"]["none"] for res in synthetic] == [True, True, True]
    assert [res["corrupt-packed"]["none"] for res in synthetic] == [True, True, True]


# -- the real trainer across a layout change --------------------------------------------------

STEPS_A, STEPS = 3, 6
RTOL = 1e-5
JOB = {
    "name": "live",
    "model": {"layers": 2, "hidden": 32, "heads": 4, "ffn_hidden": 64, "vocab": 50,
              "seq_len": 16, "experts": 0, "top_k": 2, "tie_embeddings": True, "dropout": 0.0},
    "train": {"steps": STEPS, "global_batch": 24, "micro_batch": 2, "lr": 3.0e-3, "warmup": 2,
              "weight_decay": 0.1, "grad_clip": 1.0, "seed": 7, "bucket_mb": 0.002},
    "data": {"source": "synthetic"},
}  # fmt: skip
MOE = {"experts": 4, "top_k": 2}

# name: (moe, parallel, world A, parallel B, world B, new rank of each process (None:
# dropped; processes at or past world A are newcomers))
CASES = {
    "dp3-to-dp2": (False, {}, 3, {}, 2, [1, None, 0]),
    "tp2xdp2-to-tp2": (False, {"tp": 2}, 4, {"tp": 2}, 2, [None, 0, 1, None]),
    "pp2xdp2-to-pp2": (False, {"pp": 2}, 4, {"pp": 2}, 2, [None, 1, 0, None]),
    "ep2xdp2-to-ep2-moe": (True, {"ep": 2}, 4, {"ep": 2}, 2, [None, None, 1, 0]),
    "dp2-to-dp3-newcomer": (False, {}, 2, {}, 3, [0, 2, 1]),
}


def _job(tmp: str, moe: bool, parallel: dict, world: int):
    from elasticd.jobspec import parse_job

    raw = json.loads(json.dumps(JOB))
    raw["nproc_per_node"] = world
    raw["output_dir"] = os.path.join(tmp, "run")
    raw["parallel"] = dict(parallel)
    if moe:
        raw["model"].update(MOE)
        raw["train"]["aux_loss_coeff"] = 0.01
    return parse_job(raw)


def _build(job, world: int, rank: int):
    from elasticd.layout import plan
    from trainer.parallel.context import ParallelContext, slot_of
    from trainer.parallel.groups import ProcessGroups
    from trainer.parallel.pipeline import PipelineGroups
    from trainer.train import Trainer

    layout = plan(world, job)
    groups = ProcessGroups.build(layout, rank=rank)
    torch.manual_seed(job.train.seed + groups.index("dp"))
    trainer = Trainer(
        job=job, layout=layout, ctx=ParallelContext.from_groups(groups),
        dp_rank=groups.index("dp"), model_groups=(slot_of(groups, "tp-dp-cp"),),
        pipeline=PipelineGroups.from_groups(groups),
    )  # fmt: skip
    return trainer, groups


def _state(trainer, rank: int, *, create: bool):
    from trainer.checkpointing import Checkpointing

    ck = Checkpointing(trainer, rank=rank, group=None)
    return {**ck._model(), **ck._optimizer(create=create)}


def _trainer_worker(idx: int, case: str, tmp: str, out: str) -> None:
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
    moe, par_a, world_a, par_b, world_b, new_ranks = CASES[case]
    result: dict = {"losses": {}}
    have = step = consumed = None
    if idx < world_a:
        dist.init_process_group(
            "gloo", init_method=f"file://{tmp}/store-a", rank=idx, world_size=world_a,
            timeout=timedelta(seconds=120),
        )  # fmt: skip
        trainer, groups = _build(_job(tmp, moe, par_a, world_a), world_a, idx)
        for _ in range(STEPS_A):
            r = trainer.train_step()
            if idx == 0:
                result["losses"][r.step] = r.loss
        have = _state(trainer, idx, create=False)
        step, consumed = trainer.state.step, trainer.state.consumed_samples
        trainer.close()
        groups.destroy()
        dist.destroy_process_group()  # the old world is gone; its tensors stay
    new_rank = new_ranks[idx]
    if new_rank is not None:
        dist.init_process_group(
            "gloo", init_method=f"file://{tmp}/store-b", rank=new_rank, world_size=world_b,
            timeout=timedelta(seconds=120),
        )  # fmt: skip
        trainer, groups = _build(_job(tmp, moe, par_b, world_b), world_b, new_rank)
        need = _state(trainer, new_rank, create=True)
        rec = recover_from_peers(
            have=have, have_step=step, have_consumed=consumed, need=need,
            group=groups.side("checkpoint"),
        )  # fmt: skip
        result["recovered"] = rec is not None
        if rec is not None:
            result.update(step=rec.step, bytes_in=rec.bytes_in, bytes_local=rec.bytes_local)
            trainer.state.step, trainer.state.consumed_samples = rec.step, rec.consumed_samples
            while trainer.state.step < STEPS:
                r = trainer.train_step()
                if new_rank == 0:
                    result["losses"][r.step] = r.loss
        trainer.close()
        groups.destroy()
        dist.destroy_process_group()
    result["new_rank"] = new_rank
    Path(out, f"proc-{idx}.json").write_text(json.dumps(result))


def _reference_worker(idx: int, moe: bool, tmp: str, out: str) -> None:
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    trainer, groups = _build(_job(tmp, moe, {}, 1), 1, 0)
    losses = {}
    while trainer.state.step < STEPS:
        r = trainer.train_step()
        losses[r.step] = r.loss
    trainer.close()
    groups.destroy()
    dist.destroy_process_group()
    Path(out, "reference.json").write_text(json.dumps(losses))


@pytest.fixture(scope="module")
def references(tmp_path_factory) -> dict[bool, dict[str, float]]:
    def train(moe: bool) -> dict[str, float]:
        tmp = tmp_path_factory.mktemp(f"ref-{int(moe)}")
        mp.spawn(_reference_worker, args=(moe, str(tmp), str(tmp)), nprocs=1, join=True)
        return json.loads((tmp / "reference.json").read_text())

    base = tmp_path_factory.getbasetemp()
    return {moe: once_per_session(base, f"live-reference-{int(moe)}", lambda m=moe: train(m))
            for moe in (False, True)}  # fmt: skip


@pytest.mark.parametrize("case", list(CASES))
def test_training_continues_on_the_new_layout_as_if_uninterrupted(
    case: str, references, tmp_path: Path
) -> None:
    moe, _pa, _wa, _pb, world_b, new_ranks = CASES[case]
    nprocs = len(new_ranks)
    out = tmp_path / "out"
    out.mkdir()
    mp.spawn(_trainer_worker, args=(case, str(tmp_path), str(out)), nprocs=nprocs, join=True)
    procs = [json.loads((out / f"proc-{i}.json").read_text()) for i in range(nprocs)]
    members = [p for p in procs if p["new_rank"] is not None]
    assert len(members) == world_b
    assert all(p["recovered"] and p["step"] == STEPS_A for p in members), members
    losses = {**procs[0]["losses"], **next(p for p in members if p["new_rank"] == 0)["losses"]}
    ref = references[moe]
    assert sorted(losses, key=int) == [str(s) for s in range(1, STEPS + 1)]
    worst = max(abs(losses[s] - ref[s]) / abs(ref[s]) for s in ref)
    print(f"{case}: max rel loss diff {worst:.2e}; bytes in/local per rank: "
          f"{[(p['new_rank'], p['bytes_in'], p['bytes_local']) for p in members]}")  # fmt: skip
    assert worst <= RTOL, (case, losses, ref)
    moved = sum(p["bytes_in"] for p in members)
    if case == "dp3-to-dp2":
        assert moved == 0  # every survivor already held a full replica
    else:
        assert moved > 0
