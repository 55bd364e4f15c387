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


class AdamW(torch.optim.AdamW):
    """torch's AdamW, fused on CUDA (one kernel over every parameter) and foreach elsewhere
    (a few kernels per parameter group rather than several per parameter).

    How it computes is this process's choice, not the checkpoint's: ``step`` puts the
    ``foreach``/``fused`` flags back on every group (a resume restores saved groups, saved
    perhaps on another device). Fused needs each parameter's ``step`` count on the
    parameter's device; state made outside the optimizer (a checkpoint load or a recovery
    creates it on the CPU, as the for-loop AdamW does) is moved there first.
    """

    def __init__(self, groups: list[dict], *, lr: float, fused: bool) -> None:
        self._impl = {"fused": fused or None, "foreach": None if fused else True}
        super().__init__(groups, lr=lr, betas=BETAS, eps=EPS, **self._impl)

    @torch.no_grad()
    def step(self, closure=None):
        fused = bool(self._impl["fused"])
        for group in self.param_groups:
            group.update(self._impl)
            if not fused:
                continue
            for p in group["params"]:
                state = self.state.get(p)
                if state and state["step"].device != p.device:
                    state["step"] = state["step"].to(p.device, torch.float32)
        return super().step(closure)


def build_optimizer(
    params: Sequence[nn.Parameter], *, lr: float, weight_decay: float
) -> torch.optim.AdamW:
    """AdamW with decay on matrices and embeddings only (not on biases or LayerNorms),
    as GPT-2 recipes do. The parameter groups are ``[decay, no_decay]``. Fused when every
    parameter is on CUDA, else foreach."""
    decay = [p for p in params if p.dim() >= 2]
    no_decay = [p for p in params if p.dim() < 2]
    fused = bool(params) and all(p.device.type == "cuda" for p in params)
    return AdamW(
        [
            {"params": decay, "weight_decay": weight_decay},
            {"params": no_decay, "weight_decay": 0.0},
        ],
        lr=lr,
        fused=fused,
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
    rank (tp-dp-cp, and pp when there is pipelining).

    Each gradient's norm comes from one ``_foreach_norm`` per replica count (fp32, without
    copies; bf16 gradients are accumulated in fp32); only those per-tensor norms are
    squared and summed in fp64."""
    device = params[0].device if params else torch.device("cpu")
    by_replicas: dict[int, list[torch.Tensor]] = {}
    for p in params:
        if p.grad is not None:
            by_replicas.setdefault(p.grad_replicas, []).append(p.grad.detach())
    total = torch.zeros((), dtype=torch.float64, device=device)
    for replicas, grads in by_replicas.items():
        norms = torch._foreach_norm(grads, 2, dtype=torch.float32)
        total += torch.stack(norms).double().square().sum() / replicas
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
        grads = [p.grad for p in params if p.grad is not None]
        if grads:
            torch._foreach_mul_(grads, coef)
