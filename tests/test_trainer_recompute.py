"""Activation recomputation (``train.recompute``) changes memory, never the numbers.

Selective recomputation runs the attention core again in backward, full recomputation
whole blocks (torch.utils.checkpoint, non-reentrant). Both replay the RNG state, so with
dropout > 0 the recomputed forward draws the same masks: on one CPU process the loss and
every gradient equal the run without recomputation bit for bit.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from test_trainer_dropout import _losses_in_process

from elasticd.errors import JobSpecError
from elasticd.jobspec import ModelConfig, parse_job
from trainer.model import build_chunks
from trainer.parallel.context import ParallelContext

CFG = ModelConfig(layers=2, hidden=32, heads=4, ffn_hidden=64, vocab=50, seq_len=16,
                  dropout=0.2)  # fmt: skip
MOE = ModelConfig(layers=2, hidden=32, heads=4, ffn_hidden=64, vocab=50, seq_len=16,
                  dropout=0.2, experts=4, top_k=2)  # fmt: skip


def _loss_and_grads(cfg: ModelConfig, recompute: str) -> tuple[torch.Tensor, dict]:
    (chunk,) = build_chunks(cfg, [range(cfg.layers)], ctx=ParallelContext.single(), seed=5,
                            recompute=recompute)  # fmt: skip
    chunk.train()
    gen = torch.Generator().manual_seed(9)
    ids = torch.randint(0, cfg.vocab, (2, cfg.seq_len), generator=gen)
    targets = torch.randint(0, cfg.vocab, (2, cfg.seq_len), generator=gen)
    if cfg.experts:
        chunk.set_aux_scale(0.01)
    torch.manual_seed(123)  # dropout draws from the default generator in one process
    loss = chunk(ids, targets).mean()
    loss.backward()
    return loss.detach(), {n: p.grad for n, p in chunk.named_parameters()}


@pytest.mark.parametrize("cfg", [CFG, MOE], ids=["dense", "moe"])
@pytest.mark.parametrize("recompute", ["selective", "full"])
def test_recomputation_gives_the_same_loss_and_gradients_bit_for_bit_under_dropout(cfg, recompute):
    with torch.random.fork_rng():
        want_loss, want = _loss_and_grads(cfg, "none")
        got_loss, got = _loss_and_grads(cfg, recompute)
        nodrop_loss, _ = _loss_and_grads(
            ModelConfig(**{**{f: getattr(cfg, f) for f in cfg.__slots__}, "dropout": 0.0}),
            "none",
        )
    assert torch.equal(got_loss, want_loss)
    assert want.keys() == got.keys()
    for name in want:
        assert torch.equal(got[name], want[name]), name
    assert not torch.equal(nodrop_loss, want_loss)  # dropout really drew masks


def test_a_run_with_full_recomputation_trains_exactly_like_one_without(tmp_path: Path):
    """Four steps of the trainer with dropout 0.1 in one process: the same losses, to the
    bit, with recompute none, selective and full."""
    runs = {
        mode: _losses_in_process(tmp_path, mode, 1, [f"train.recompute={mode}"])
        for mode in ("none", "selective", "full")
    }
    assert [s for s, _ in runs["none"]] == [1, 2, 3, 4]
    assert runs["selective"] == runs["none"]
    assert runs["full"] == runs["none"]


def test_an_unknown_recompute_mode_is_refused_in_one_line():
    with pytest.raises(JobSpecError) as err:
        parse_job({"name": "r", "train": {"recompute": "attention"}})
    msg = str(err.value)
    assert (
        msg.startswith("job.yaml: train.recompute: 'attention' is not one of") and "\n" not in msg
    )
