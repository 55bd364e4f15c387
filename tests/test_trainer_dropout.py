"""Dropout's random numbers (issue 14, point 5): per TP rank for sharded activations, alike
within a TP group for replicated ones, and a pure function of (seed, step, coordinates), so
a run with dropout > 0 resumes bit-exactly in the same layout."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
import yaml

from trainer.__main__ import main as trainer_main
from trainer.launch import launch_local
from trainer.parallel.rng import DropoutRNG, step_seed

CPU = torch.device("cpu")


def _tracker(tp_rank: int = 0, dp_rank: int = 0, pp_stage: int = 0) -> DropoutRNG:
    return DropoutRNG(seed=7, dp_rank=dp_rank, pp_stage=pp_stage, tp_rank=tp_rank)


def _draw() -> torch.Tensor:
    return torch.rand(64)


def test_tp_ranks_draw_their_own_sharded_masks_and_stay_in_step_on_the_shared_stream():
    after, inside = [], []
    for tp_rank in (0, 1):
        rng = _tracker(tp_rank=tp_rank)
        rng.begin_step(3)
        with rng.sharded(CPU):
            inside.append(_draw())
        after.append(_draw())
    assert not torch.equal(inside[0], inside[1])  # head shards get different masks
    assert torch.equal(after[0], after[1])  # replicated activations still drop alike
    rng = _tracker()
    rng.begin_step(3)
    torch.randint(0, 1 << 62, (1,))  # the fork moved the shared stream by one draw only
    assert torch.equal(_draw(), after[0])


def test_the_step_seed_is_a_pure_function_of_seed_step_and_coordinates():
    def draws(step, **coords):
        rng = _tracker(**coords)
        rng.begin_step(step)
        return _draw()

    assert torch.equal(draws(5), draws(5))
    assert torch.equal(draws(5, tp_rank=0), draws(5, tp_rank=3))  # shared within TP
    assert not torch.equal(draws(5), draws(6))
    assert not torch.equal(draws(5), draws(5, dp_rank=1))
    assert not torch.equal(draws(5), draws(5, pp_stage=1))
    assert step_seed(seed=7, step=5, dp_rank=0, pp_stage=0) != step_seed(
        seed=8, step=5, dp_rank=0, pp_stage=0
    )


def test_attention_on_two_tp_ranks_drops_different_head_shards(tmp_path):
    """Two tp ranks' attention with identical weights: only their dropout masks can make
    their outputs differ, and they must (a gloo world of one stands in for the tp group:
    the reductions sum one rank)."""
    import torch.distributed as dist

    from elasticd.jobspec import ModelConfig
    from trainer.model import Attention
    from trainer.parallel.context import GroupSlot, ParallelContext

    cfg = ModelConfig(layers=2, hidden=32, heads=4, seq_len=16, dropout=0.5)
    x = torch.randn(2, 16, 32, generator=torch.Generator().manual_seed(1))
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        outs = []
        for tp_rank in (0, 1):
            rng = _tracker(tp_rank=tp_rank)
            tp = GroupSlot(group=dist.group.WORLD, size=2, rank=0)  # rank 0's weights both
            attn = Attention("a", cfg, ctx=ParallelContext(tp=tp, rng=rng), seed=3,
                             out_std=0.02, dtype=torch.float32)  # fmt: skip
            attn.train()
            rng.begin_step(0)
            outs.append(attn(x))
            rng.begin_step(0)
            assert torch.equal(attn(x), outs[-1])  # and each rank's draw is reproducible
    finally:
        dist.destroy_process_group()
    assert not torch.equal(outs[0], outs[1])


JOB = {
    "name": "dropout",
    "model": {"layers": 2, "hidden": 32, "heads": 4, "ffn_hidden": 64, "vocab": 50,
              "seq_len": 16, "dropout": 0.1},
    "train": {"steps": 4, "global_batch": 4, "micro_batch": 2, "lr": 3.0e-3, "seed": 7},
    "checkpoint": {"every": 2, "async": False},
}  # fmt: skip


def _losses(tmp: Path, out: str, world: int, settings: list[str]) -> list[tuple[int, float]]:
    raw = json.loads(json.dumps(JOB))
    raw["nproc_per_node"] = world
    raw["output_dir"] = str(tmp / out)
    path = tmp / f"{out}.yaml"
    path.write_text(yaml.safe_dump(raw))
    # On CPU even on a CUDA machine: bit-exactness needs deterministic kernels, and CUDA's
    # attention backward is not.
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="")
    outcomes = launch_local(str(path), world=world, overrides=settings, env=env, timeout=240)
    failed = [o for o in outcomes if o.returncode != 0]
    assert not failed, "\n".join(f"rank {o.rank}:\n{o.output[-3000:]}" for o in failed)
    lines = (tmp / out / "metrics.jsonl").read_text().splitlines()
    return [(r["step"], r["loss"]) for r in map(json.loads, lines)]


def _check_resume(tmp: Path, world: int, settings: list[str], run=None) -> None:
    run = run or _losses
    whole = run(tmp, "whole", world, settings)
    run(tmp, "split", world, [*settings, "train.steps=2"])
    split = run(tmp, "split", world, settings)  # resumes from step 2's checkpoint
    assert [s for s, _ in split] == [1, 2, 3, 4]
    assert split == whole  # bit-exact: the same floats, dropout masks and all
    nodrop = run(tmp, "nodrop", world, [*settings, "model.dropout=0.0"])
    assert nodrop[-1][1] != whole[-1][1]  # dropout really was on


def _losses_in_process(tmp: Path, out: str, world: int, settings: list[str]):
    """One rank in this process (a world of one on gloo): no start-up of its own."""
    assert world == 1
    raw = json.loads(json.dumps(JOB))
    raw["output_dir"] = str(tmp / out)
    path = tmp / f"{out}.yaml"
    path.write_text(yaml.safe_dump(raw))
    args = [str(path)]
    for s in settings:
        args += ["--set", s]
    with torch.random.fork_rng():
        assert trainer_main(args, env={"RANK": "0", "WORLD_SIZE": "1"}) == 0
    lines = (tmp / out / "metrics.jsonl").read_text().splitlines()
    return [(r["step"], r["loss"]) for r in map(json.loads, lines)]


@pytest.mark.timeout(300)
def test_a_run_with_dropout_resumes_bit_exactly(tmp_path):
    # In this process where it can only be CPU (fast); a CUDA machine runs it as a process.
    in_process = not torch.cuda.is_available()
    _check_resume(tmp_path, 1, [], run=_losses_in_process if in_process else None)


@pytest.mark.slow  # about 40 s: four two-rank runs
@pytest.mark.timeout(600)
def test_a_tp2_run_with_dropout_resumes_bit_exactly(tmp_path):
    _check_resume(tmp_path, 2, ["parallel.tp=2"])
