"""AdamW on local shards, the learning-rate schedule, and clipping by the true global norm.

The global gradient norm counts every distinct shard of the global model exactly once.
Each parameter carries ``grad_replicas``: how many active ranks hold an identical copy of
its (already data-parallel-reduced) gradient. Each rank sums ``|g|² / grad_replicas`` over
its parameters, and one all-reduce over the model-and-data groups adds those up, so a
tp-split weight counts once per shard and a replicated LayerNorm once in all.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch import nn

from trainer.parallel.context import GroupSlot

BETAS = (0.9, 0.95)
EPS = 1e-8


def build_optimizer(
    params: Sequence[nn.Parameter], *, lr: float, weight_decay: float
) -> torch.optim.AdamW:
    """AdamW with decay on matrices and embeddings only (not on biases or LayerNorms),
    as GPT-2 recipes do. The parameter groups are ``[decay, no_decay]``."""
    decay = [p for p in params if p.dim() >= 2]
    no_decay = [p for p in params if p.dim() < 2]
    return torch.optim.AdamW(
        [
            {"params": decay, "weight_decay": weight_decay},
            {"params": no_decay, "weight_decay": 0.0},
        ],
        lr=lr,
        betas=BETAS,
        eps=EPS,
    )


def lr_at(
    step: int,
    *,
    lr: float,
    warmup: int,
    schedule: str = "constant",
    min_lr: float = 0.0,
    steps: int = 0,
) -> float:
    """Learning rate of 0-based step ``step`` of ``steps``: a linear warm-up to ``lr`` over
    ``warmup`` steps, then ``schedule``: ``constant`` stays at ``lr``; ``cosine`` and
    ``linear`` decay from ``lr`` at the first step after warm-up to ``min_lr`` at the last
    step (and stay there past it)."""
    if warmup > 0 and step < warmup:
        return lr * (step + 1) / warmup
    if schedule == "constant":
        return lr
    if schedule not in ("cosine", "linear"):
        raise ValueError(f"unknown lr schedule {schedule!r}")
    span = steps - 1 - warmup
    progress = 1.0 if span <= 0 else min(1.0, (step - warmup) / span)
    if schedule == "cosine":
        return min_lr + (lr - min_lr) * 0.5 * (1.0 + math.cos(math.pi * progress))
    return lr - (lr - min_lr) * progress


def set_lr(optimizer: torch.optim.Optimizer, lr: float) -> None:
    for group in optimizer.param_groups:
        group["lr"] = lr


def grad_replicas(param: nn.Parameter, *, tp: int, dp_cp: int, etp: int, expert_dp: int) -> int:
    """Active ranks holding the same gradient shard as this rank (pipeline stages hold
    different layers, so pp does not appear; the pipeline adjusts tied copies itself)."""
    if param.expert:
        return expert_dp * (1 if param.tp_split else etp)
    return dp_cp * (1 if param.tp_split else tp)


def global_grad_norm(params: Sequence[nn.Parameter], *, groups: Sequence[GroupSlot]) -> float:
    """The 2-norm of the whole model's gradient; ``groups`` together span every active
    rank (tp-dp-cp, and pp when there is pipelining)."""
    device = params[0].device if params else torch.device("cpu")
    total = torch.zeros((), dtype=torch.float64, device=device)
    for p in params:
        if p.grad is not None:
            total += p.grad.detach().double().pow(2).sum() / p.grad_replicas
    for slot in groups:
        if slot.active:
            dist.all_reduce(total, group=slot.group)
    return math.sqrt(float(total))


def clip_grads(params: Sequence[nn.Parameter], *, norm: float, max_norm: float) -> None:
    """Scale every gradient so the global norm is at most ``max_norm`` (0 turns it off)."""
    if max_norm <= 0 or not math.isfinite(norm):
        return
    coef = max_norm / (norm + 1e-6)
    if coef < 1.0:
        for p in params:
            if p.grad is not None:
                p.grad.mul_(coef)
