"""A step whose global gradient norm is not finite (an overflow, a NaN from a bad batch or a
flipped bit) skips its update on every rank instead of writing NaN into every main
parameter, and too many in a row stop the trainer with one line (trainer.train)."""

from __future__ import annotations

import pytest
import torch

from elasticd.jobspec import parse_job
from elasticd.layout import plan
from trainer.errors import DivergedError
from trainer.parallel.context import ParallelContext
from trainer.parallel.data import GradSync
from trainer.train import NONFINITE_LIMIT, Trainer


def _trainer(tmp_path, dtype: str) -> Trainer:
    job = parse_job({
        "name": "nonfinite", "nproc_per_node": 1, "output_dir": str(tmp_path),
        "model": {"layers": 2, "hidden": 32, "heads": 4, "ffn_hidden": 64, "vocab": 50,
                  "seq_len": 16, "tie_embeddings": True},
        "train": {"steps": 20, "global_batch": 4, "micro_batch": 2, "lr": 3e-3, "warmup": 0,
                  "grad_clip": 1.0, "seed": 7, "bucket_mb": 0.002, "dtype": dtype},
        "data": {"source": "synthetic"}, "checkpoint": {"every": 0, "async": False},
    })  # fmt: skip
    return Trainer(job=job, layout=plan(1, job), ctx=ParallelContext.single(), dp_rank=0)


@pytest.fixture
def poison(monkeypatch):
    """``poison(value)``: the next steps' reduced gradients get one element ``value`` (as
    an overflow in one bucket would); ``poison(None)`` stops it."""
    value: list[float | None] = [None]
    finish = GradSync.finish

    def poisoned(self):
        finish(self)
        if value[0] is not None:
            self.buckets[0].buffer[0] = value[0]

    monkeypatch.setattr(GradSync, "finish", poisoned)
    return lambda v: value.__setitem__(0, v)


def _state(t: Trainer) -> list[torch.Tensor]:
    out = [m.detach().clone() for m in t.main.tensors]
    for st in t.optimizer.state.values():
        out += [v.detach().clone() for v in st.values() if torch.is_tensor(v)]
    return out


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("bad", [float("inf"), float("nan")])
def test_a_nonfinite_gradient_norm_skips_the_update_and_training_goes_on(
    tmp_path, poison, dtype, bad
):
    t = _trainer(tmp_path, dtype)
    t.train_step()
    before, consumed = _state(t), t.state.consumed_samples
    poison(bad)
    r = t.train_step()
    assert r.skipped and r.step == 2 and t.state.step == 2
    assert not torch.isfinite(torch.tensor(r.grad_norm))
    # Nothing of the update reached the main parameters or AdamW's moments and steps.
    for a, b in zip(before, _state(t), strict=True):
        assert torch.equal(a, b)
    assert t.state.consumed_samples == consumed + 4  # the batch is consumed, as Megatron's skip
    poison(None)
    r = t.train_step()
    assert not r.skipped and torch.isfinite(torch.tensor([r.loss, r.grad_norm])).all()
    assert all(torch.isfinite(m).all() for m in t.main.tensors)
    assert any(not torch.equal(a, b) for a, b in zip(before, _state(t), strict=True))


def test_too_many_nonfinite_steps_in_a_row_stop_the_trainer_in_one_line(tmp_path, poison):
    t = _trainer(tmp_path, "float32")
    t.train_step()
    poison(float("nan"))
    for _ in range(NONFINITE_LIMIT - 1):  # skipped, each said in the log
        assert t.train_step().skipped
    poison(None)
    assert not t.train_step().skipped  # a finite step resets the count
    poison(float("inf"))
    for _ in range(NONFINITE_LIMIT - 1):
        t.train_step()
    with pytest.raises(DivergedError) as err:
        t.train_step()
    text = str(err.value)
    assert "\n" not in text
    first = 2 + NONFINITE_LIMIT
    assert (
        f"{NONFINITE_LIMIT} steps in a row (steps {first} to {first + NONFINITE_LIMIT - 1})" in text
    )
    assert all(torch.isfinite(m).all() for m in t.main.tensors)
