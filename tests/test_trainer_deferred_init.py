"""A trainer built with ``init=False`` (every round of ``python -m trainer``): its
parameters are not drawn, since a resume or a recovery overwrites them; drawn later by
``Trainer.initialize`` when nothing was loaded, they are the same bits as drawn at
construction, and no step trains on the zeros in between.

The paths through it under real processes are the suite's parity tests: a fresh start
(drawn late), a resume (loaded) and an in-process recovery (received) each match one
process that drew its parameters at construction."""

from __future__ import annotations

import json
import os
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from elasticd.jobspec import parse_job
from elasticd.layout import plan
from trainer.parallel.context import ParallelContext
from trainer.train import Trainer

BASE = {
    "name": "deferred",
    "output_dir": "/nonexistent",
    "nproc_per_node": 1,
    "model": {"layers": 2, "hidden": 32, "heads": 4, "ffn_hidden": 64, "vocab": 50,
              "seq_len": 16, "tie_embeddings": False},
    "train": {"steps": 4, "global_batch": 4, "micro_batch": 2, "lr": 3.0e-3, "warmup": 1,
              "seed": 11, "bucket_mb": 0.002},
    "checkpoint": {"every": 0},
}  # fmt: skip


def _trainer(init: bool, **sections) -> Trainer:
    raw = json.loads(json.dumps(BASE))
    for section, fields in sections.items():
        raw[section].update(fields)
    job = parse_job(raw)
    torch.manual_seed(job.train.seed)
    return Trainer(job=job, layout=plan(1, job), ctx=ParallelContext.single(), dp_rank=0,
                   init=init)  # fmt: skip


@pytest.mark.parametrize(
    "sections",
    [{}, {"train": {"dtype": "bfloat16"}}, {"model": {"experts": 4, "top_k": 2, "tie_embeddings": True}}],
    ids=["fp32", "bf16-main-copies", "moe-tied"],
)  # fmt: skip
def test_drawn_late_is_drawn_the_same_and_trains_the_same(sections):
    drawn, late = _trainer(True, **sections), _trainer(False, **sections)
    assert drawn.initialized and not late.initialized
    assert all(not p.any() for p in late.params)  # zeros, never garbage
    with pytest.raises(RuntimeError, match="before its state was loaded"):
        late.train_step()
    late.initialize()
    named = dict(drawn.named_parameters())
    for name, p in late.named_parameters():
        assert torch.equal(p, named[name]), name
    mains = {name: t for name, t, _ in drawn.named_main()}
    for name, t, _ in late.named_main():
        assert t.dtype == torch.float32 and torch.equal(t, mains[name]), name
    for _ in range(2):
        a, b = drawn.train_step(), late.train_step()
        assert a.loss == b.loss and a.grad_norm == b.grad_norm


def test_a_fresh_start_after_a_failed_transfer_starts_adamw_from_zeros_in_place():
    """A transfer that failed its check may have written into the parameters and AdamW's
    state before the fall back found no checkpoint: the start is fresh, so both are
    drawn and zeroed again, AdamW's in place (the same tensors stay named)."""
    from trainer.checkpointing import optimizer_tensors

    late = _trainer(False)
    held = optimizer_tensors(late, create=True)  # as recovery's `need` makes them
    for tensor, _info in held.values():
        tensor.fill_(7.0)  # what a failed transfer left
    for p in late.params:
        p.data.fill_(3.0)
    late.initialize()
    again = optimizer_tensors(late, create=True)
    assert set(again) == set(held)
    for key, (tensor, _info) in held.items():
        assert again[key][0] is tensor and not tensor.any(), key
    assert torch.equal(dict(late.named_parameters())["embedding.word_embeddings.weight"],
                       dict(_trainer(True).named_parameters())["embedding.word_embeddings.weight"])  # fmt: skip


def _sharded_worker(rank: int, world: int, tmp: str, raw: dict) -> None:
    """Drawn at construction and drawn late, in one sharded layout: every parameter and
    main parameter the same bits, and two steps the same."""
    from elasticd.layout import plan
    from trainer.parallel.context import slot_of
    from trainer.parallel.groups import ProcessGroups
    from trainer.parallel.pipeline import PipelineGroups

    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{tmp}/store", rank=rank,
                            world_size=world, timeout=timedelta(seconds=120))  # fmt: skip
    job = parse_job(raw)
    layout = plan(world, job)
    groups = ProcessGroups.build(layout, rank=rank)

    def build(init: bool) -> Trainer:
        torch.manual_seed(job.train.seed + groups.index("dp"))
        return Trainer(job=job, layout=layout, ctx=ParallelContext.from_groups(groups),
                       dp_rank=groups.index("dp"), model_groups=(slot_of(groups, "tp-dp-cp"),),
                       pipeline=PipelineGroups.from_groups(groups), init=init)  # fmt: skip

    drawn, late = build(True), build(False)
    late.initialize()
    wrong = [n for (n, a), (_, b) in zip(drawn.named_parameters(), late.named_parameters(),
                                         strict=True) if a.dtype != b.dtype or not torch.equal(a, b)]  # fmt: skip
    wrong += [f"main {n}" for (n, a, i), (_, b, j) in zip(drawn.named_main(), late.named_main(),
                                                          strict=True)
              if i != j or not torch.equal(a, b)]  # fmt: skip
    steps = [(drawn.train_step(), late.train_step()) for _ in range(2)]
    wrong += [f"step {a.step}" for a, b in steps if (a.loss, a.grad_norm) != (b.loss, b.grad_norm)]
    Path(tmp, f"rank-{rank}.json").write_text(json.dumps(wrong))
    drawn.close()
    late.close()
    groups.destroy()
    dist.destroy_process_group()


@pytest.mark.parametrize(
    ("world", "settings"),
    [(4, {"parallel": {"tp": 2, "zero": 1}, "train": {"dtype": "bfloat16"}}),
     (4, {"parallel": {"tp": 2, "pp": 2}, "model": {"tie_embeddings": True}}),
     (4, {"parallel": {"pp": 2, "ep": 2, "zero": 1}, "model": {"experts": 4, "top_k": 2}})],
    ids=["tp2xdp2-zero1-bf16-padded-vocab", "tp2xpp2-tied", "pp2xep2-moe-zero1"],
)  # fmt: skip
def test_late_draws_match_in_sharded_layouts(tmp_path, world, settings):
    """Vocabulary padding rows (51 rows over tp2), main rows of ZeRO-1 (views or bf16
    copies), the last stage's copy of a tied embedding, experts over ep."""
    raw = json.loads(json.dumps(BASE))
    raw["nproc_per_node"] = world
    raw["model"]["vocab"] = 51
    raw["model"]["layers"] = 4
    raw["train"]["global_batch"] = 8
    for section, fields in settings.items():
        raw.setdefault(section, {}).update(fields)
    mp.spawn(_sharded_worker, args=(world, str(tmp_path), raw), nprocs=world, join=True)
    for rank in range(world):
        assert json.loads((tmp_path / f"rank-{rank}.json").read_text()) == [], rank


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_on_a_gpu_the_parameters_not_drawn_are_made_there_and_drawn_late_into_it():
    """No host copy of the model and no transfer at construction: the zeros are made on
    the device; ``initialize`` draws on the CPU generator and copies into them."""
    device = torch.device("cuda", torch.cuda.current_device())

    def build(init: bool) -> Trainer:
        job = parse_job({**BASE, "train": {**BASE["train"], "dtype": "bfloat16"}})
        return Trainer(job=job, layout=plan(1, job), ctx=ParallelContext.single(), dp_rank=0,
                       device=device, init=init)  # fmt: skip

    drawn, late = build(True), build(False)
    assert all(p.device == device and not p.any() for p in late.params)
    late.initialize()
    named = dict(drawn.named_parameters())
    for name, p in late.named_parameters():
        assert p.device == device and torch.equal(p, named[name]), name
    a, b = drawn.train_step(), late.train_step()
    assert a.loss == b.loss


def test_with_resume_false_a_newer_checkpoint_does_not_displace_the_replicas(tmp_path):
    """``checkpoint.resume: false``: a resume loads nothing, so a newer step on disk must
    not make recovery drop what the replicas hold (the run would start over from step 0,
    with its parameters drawn again)."""
    from checkpoint.manifest import step_dirname
    from trainer.recovery import _checkpoint_is_newer

    ckpt = tmp_path / "ckpt"
    (ckpt / step_dirname(20)).mkdir(parents=True)
    (ckpt / "latest").write_text(step_dirname(20) + "\n")
    for resume, newer in ((True, True), (False, False)):
        job = parse_job({**BASE, "output_dir": str(tmp_path),
                         "checkpoint": {"every": 10, "dir": str(ckpt), "resume": resume}})  # fmt: skip
        assert _checkpoint_is_newer(job, 10, None) is newer, resume
