"""An overlapped snapshot (``SaveOptions(overlap_snapshot=True)``): ``save()`` returns
before its copies are done, and the caller waits for them (``wait_snapshot``) before it changes a saved tensor.
Real gloo processes, real files: every committed step holds the values the tensors had
when it was saved, though each was changed in place right after that wait."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from test_checkpoint_multirank import _init, spawn

import checkpoint.save
from checkpoint import SaveFailedError, SaveOptions, Saver, ShardInfo, open_step

ROWS, COLS = 2048, 1024  # 8 MiB of fp32 per tensor: copies that take a while
STEPS = 4


def value(name: str, step: int, rows: slice) -> torch.Tensor:
    base = torch.arange(rows.start * COLS, rows.stop * COLS, dtype=torch.float32)
    return (base + 1e6 * step + (0.25 if name == "b" else 0)).view(-1, COLS)


def _worker(rank, world, store, ckpt, out):
    group = _init(rank, world, store)
    half = ROWS // world
    rows = slice(rank * half, (rank + 1) * half)
    try:
        options = SaveOptions(async_=True, overlap_snapshot=True, keep=STEPS)
        saver = Saver(ckpt, group=group, options=options)
        # The tensors are changed in place, as an optimizer step changes parameters.
        state = {name: value(name, 1, rows) for name in ("a", "b")}
        rng = torch.tensor([rank, 7], dtype=torch.int64)
        for step in range(1, STEPS + 1):
            saver.save(
                step=step,
                consumed_samples=step,
                model={
                    n: (t, ShardInfo(n, (ROWS, COLS), (rows.start, 0), t.shape))
                    for n, t in state.items()
                },
                rank_state={"rng": rng},
            )
            if rank == 1:
                time.sleep(0.01)  # the ranks wait at different times
            saver.wait_snapshot()
            for name, t in state.items():
                t.copy_(value(name, step + 1, rows))  # right after the wait
            rng += 1
        saver.wait()
        stall = saver.last.stall_s
        saver.close()
    finally:
        dist.destroy_process_group()
    Path(out, f"rank-{rank}.json").write_text(json.dumps({"stall": stall}))


def test_tensors_changed_right_after_wait_snapshot_do_not_reach_the_checkpoint(tmp_path):
    ckpt = str(tmp_path / "ckpt")
    results = spawn(_worker, 2, tmp_path, ckpt)
    for step in range(1, STEPS + 1):
        with open_step(ckpt, step) as ck:
            for name in ("a", "b"):
                got = ck.read(name)
                assert torch.equal(got, value(name, step, slice(0, ROWS))), (step, name)
            for rank in (0, 1):
                assert ck.read(f"rank/{rank}/rng").tolist() == [rank + step - 1, 7 + step - 1]
    assert all(r["stall"] >= 0 for r in results)


def _one_rank_saver(tmp_path, **options) -> tuple[Saver, dict]:
    t = torch.arange(1 << 20, dtype=torch.float32)
    model = {"t": (t, ShardInfo.whole("t", tuple(t.shape)))}
    options = SaveOptions(async_=True, overlap_snapshot=True, **options)
    return Saver(str(tmp_path / "ckpt"), group=None, options=options), model


def test_the_writer_waits_for_the_copies_and_wait_waits_for_the_snapshot(tmp_path):
    """Without wait_snapshot(), wait() waits for the snapshot; the stall counts both."""
    saver, model = _one_rank_saver(tmp_path)
    expected = model["t"][0].clone()
    saver.save(step=1, consumed_samples=1, model=model)
    result = saver.wait()
    model["t"][0].zero_()
    saver.close()
    assert result.committed and 0 <= result.stall_s <= result.total_s
    with open_step(str(tmp_path / "ckpt"), 1) as ck:
        assert torch.equal(ck.read("t"), expected)


def test_a_background_copy_that_fails_fails_its_save_not_wait_snapshot(tmp_path, monkeypatch):
    saver, model = _one_rank_saver(tmp_path)

    def broken(pairs):
        raise OSError("copy went wrong")

    monkeypatch.setattr(checkpoint.save, "_copy_pairs", broken)
    saver.save(step=1, consumed_samples=1, model=model)
    saver.wait_snapshot()  # the tensors may change: nothing is copying them any more
    with pytest.raises(SaveFailedError, match="copy went wrong"):
        saver.wait()
    monkeypatch.undo()
    saver.save(step=2, consumed_samples=2, model=model)  # the next save works
    saver.close()
    ckpt = str(tmp_path / "ckpt")
    assert sorted(p.name for p in Path(ckpt).glob("step-*")) == ["step-000000002"]
    with open_step(ckpt) as ck:
        assert ck.step == 2 and torch.equal(ck.read("t"), model["t"][0])


def test_abandon_waits_for_the_snapshot_in_flight(tmp_path):
    saver, model = _one_rank_saver(tmp_path)
    saver.save(step=1, consumed_samples=1, model=model)
    staged = saver._staged
    saver.abandon()
    assert saver._staged is None and staged.copied.done()


def test_the_trainers_overlapped_saves_hold_what_its_sync_saves_hold(tmp_path):
    """The real trainer (2 gloo ranks, tp2) saves every 2 steps with overlapped async saves
    (the default) and, in a twin run, with sync saves: every committed step holds the same
    bytes, so waiting for the snapshot before each optimizer step keeps the next step's
    update out of it."""
    from test_checkpoint_resume import train

    steps = {}
    for mode, async_ in (("overlapped", True), ("sync", False)):
        out = tmp_path / mode
        settings = {"parallel.tp": 2, "checkpoint.every": 2, "checkpoint.keep": 4,
                    "checkpoint.async": async_, "model.hidden": 128, "model.ffn_hidden": 512}  # fmt: skip
        train(tmp_path, out, 2, settings, steps=6)
        steps[mode] = {}
        for step in (2, 4, 6):
            with open_step(str(out / "ckpt"), step) as ck:
                steps[mode][step] = {name: ck.read(name) for name in ck.manifest.tensors}
    for step, tensors in steps["sync"].items():
        got = steps["overlapped"][step]
        assert got.keys() == tensors.keys()
        for name, value in tensors.items():
            if not name.startswith("rank/"):  # RNG states: the same too, but not the point
                assert torch.equal(got[name], value), (step, name)
