"""A step stopped between its gradient norm and its update is completed exactly
(``Trainer.complete_pending``, used by in-process recovery when a peer applied the step).

One process (a Trainer of a world of one), against a twin that was never stopped: the
main parameters, AdamW state and position must be bit-identical, and so must the steps
after it. The multi-process case is ``tests/test_inprocess.py``'s split-step test.
"""

from __future__ import annotations

import pytest
import torch
from test_trainer_precision import _raw, _trainer

from trainer.recovery import holdings


class Stop(Exception):
    pass


def _stop_at_update(trainer, step: int) -> None:
    def on_phase(name: str, at: int) -> None:
        if (name, at) == ("update", step):
            raise Stop

    trainer.on_phase = on_phase


@pytest.mark.parametrize(
    "settings",
    [{"train.dtype": "float32"}, {"train.dtype": "bfloat16"},
     {"train.dtype": "bfloat16", "parallel.zero": 1}],  # rows of a reduce-scatter's output
    ids=["fp32", "bf16", "bf16-zero1"],
)  # fmt: skip
def test_a_step_stopped_before_its_update_is_completed_bit_exactly(tmp_path, settings):
    # A small clip so that the clipping, which needs the stored norm, really scales.
    raw = _raw(tmp_path, {**settings, "train.grad_clip": 0.05})
    ref, stopped = _trainer(raw), _trainer(raw)
    for _ in range(2):
        assert ref.train_step().loss == stopped.train_step().loss
    assert stopped.pending_norm is None  # cleared by every completed step
    expected = ref.train_step()
    assert expected.grad_norm > 0.05  # clipped
    _stop_at_update(stopped, 3)
    with pytest.raises(Stop):
        stopped.train_step()
    assert stopped.state.step == 2 and stopped.pending_norm == expected.grad_norm
    assert not stopped.complete_pending(4)  # not the step it stopped in
    assert stopped.complete_pending(3)
    assert not stopped.complete_pending(3)  # once
    assert (stopped.state.step, stopped.state.consumed_samples) == (
        ref.state.step, ref.state.consumed_samples,
    )  # fmt: skip
    mine, theirs = holdings(stopped, create=False), holdings(ref, create=False)
    assert mine.keys() == theirs.keys()
    for name, (t, _) in theirs.items():
        assert torch.equal(mine[name][0], t), name
    # Recovery rebuilds the model from the main parameters; training goes on the same.
    stopped.on_phase = None
    stopped.main.to_model()
    for _ in range(2):
        assert stopped.train_step().loss == ref.train_step().loss


def test_a_step_that_failed_before_its_norm_is_not_completed(tmp_path):
    trainer = _trainer(_raw(tmp_path))
    trainer.train_step()

    def fail_before_norm(name: str, at: int) -> None:
        if name == "optimizer":  # the gradients are not reduced yet
            raise Stop

    trainer.on_phase = fail_before_norm
    with pytest.raises(Stop):
        trainer.train_step()
    assert trainer.pending_norm is None and not trainer.complete_pending(2)
    assert trainer.state.step == 1
