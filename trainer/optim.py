"""AdamW on fp32 main parameters, the learning-rate schedule, and clipping by the true
global norm.

**Main parameters** (:class:`MainParams`, Megatron's mixed precision): the optimizer never
steps the model's parameters themselves unless they are fp32 and whole. With
``train.dtype: bfloat16`` the model computes in bf16 and the optimizer holds an fp32 copy
of every parameter (its *main* parameter), whose gradient is the fp32 bucket slot the
bf16 gradients were accumulated and reduced in (:mod:`trainer.parallel.data`); the norm,
clipping and AdamW (fp32 moments) act on those, and the main parameters are copied back,
rounded, into the bf16 model after each step. With ``parallel.zero: 1`` each data-parallel
rank holds only its rows of every main parameter (dim 0, cut as FSDP2 cuts) with their
AdamW state, so each is a box of the global tensor; the model's parameters are
all-gathered from those rows after the step. Checkpoints and in-process recovery name the
main parameters, so a bf16 run saves and resumes in fp32.

The global gradient norm counts every distinct shard of the global model exactly once.
Each parameter carries ``grad_replicas``: how many active ranks hold an identical copy of
its (already data-parallel-reduced) gradient. Each rank sums ``|g|² / grad_replicas`` over
its parameters, and one all-reduce over the model-and-data groups adds those up, so a
tp-split weight counts once per shard and a replicated LayerNorm once in all.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn

from checkpoint.shards import ShardInfo
from trainer.init import Adoption
from trainer.parallel import comm
from trainer.parallel.context import GroupSlot
from trainer.parallel.data import GradSync

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


def global_grad_norm(
    params: Sequence[torch.Tensor],
    *,
    groups: Sequence[GroupSlot],
    replicas: Sequence[int] | None = None,
) -> float:
    """The 2-norm of the whole model's gradient; ``groups`` together span every active
    rank (tp-dp-cp, and pp when there is pipelining). ``replicas``: each tensor's replica
    count (default: ``p.grad_replicas``, the model parameter's).

    Each gradient's norm comes from one ``_foreach_norm`` per replica count (fp32, without
    copies; bf16 gradients are accumulated in fp32); only those per-tensor norms are
    squared and summed in fp64."""
    device = params[0].device if params else torch.device("cpu")
    by_replicas: dict[int, list[torch.Tensor]] = {}
    if replicas is None:
        replicas = [p.grad_replicas for p in params]
    for p, count in zip(params, replicas, strict=True):
        if p.grad is not None:
            by_replicas.setdefault(count, []).append(p.grad.detach())
    total = torch.zeros((), dtype=torch.float64, device=device)
    for replicas, grads in by_replicas.items():
        norms = torch._foreach_norm(grads, 2, dtype=torch.float32)
        total += torch.stack(norms).double().square().sum() / replicas
    for slot in groups:
        if slot.active:
            comm.all_reduce(total, slot.group)
    return math.sqrt(float(total))


def clip_grads(params: Sequence[torch.Tensor], *, norm: float, max_norm: float) -> None:
    """Scale every gradient so the global norm is at most ``max_norm`` (0 turns it off)."""
    if max_norm <= 0 or not math.isfinite(norm):
        return
    coef = max_norm / (norm + 1e-6)
    if coef < 1.0:
        grads = [p.grad for p in params if p.grad is not None]
        if grads:
            torch._foreach_mul_(grads, coef)


@dataclass(frozen=True, slots=True)
class Main:
    """One model parameter's main parameter (or this rank's rows of it)."""

    param: nn.Parameter
    """The model's parameter (the dtype the model computes in, whole)."""
    tensor: nn.Parameter
    """The optimizer's fp32 values: ``param`` itself when fp32 and not sharded, a view of
    rows ``rows`` of it when fp32 and sharded, else an fp32 copy of those rows."""
    rows: tuple[int, int]
    """The rows of ``param`` that ``tensor`` holds."""
    info: ShardInfo | None
    """The box of the global tensor ``tensor`` holds (padding rows excluded); None when it
    holds no global element (an empty shard, or vocabulary padding only)."""
    replicas: int
    """Active ranks holding the same main gradient (for the global norm)."""


class MainParams:
    """Every model parameter's fp32 main parameter, gradients bound to the reduced fp32
    buckets of its :class:`~trainer.parallel.data.GradSync` (see the module docstring)."""

    def __init__(
        self,
        chunks: Sequence[tuple[GradSync, Sequence[nn.Parameter]]],
        *,
        adopt: Adoption | None = None,
    ) -> None:
        """``chunks``: each chunk's GradSync with the parameters it reduces. ``adopt``: a
        previous trainer's main parameters to take where the box is the same (in-process
        recovery, ``trainer.init.Adoption``) instead of copying the model's."""
        self.entries: list[Main] = []
        self._sync_of: dict[int, GradSync] = {}
        with torch.no_grad():
            for sync, params in chunks:
                for p in params:
                    self._sync_of[id(p)] = sync
                    self.entries.append(self._make(sync, p, adopt))

    @staticmethod
    def _make(sync: GradSync, p: nn.Parameter, adopt: Adoption | None = None) -> Main:
        start, stop = sync.rows(p)
        info = _rows_box(p.shard_info, start, stop)
        if p.dtype == torch.float32 and not sync.shard:
            tensor = p
        elif p.dtype == torch.float32:
            # Rows of dim 0 are contiguous: the main shard is a view of the model's own
            # storage, so AdamW updates those rows in place and fp32 costs no second copy.
            tensor = nn.Parameter(p.detach()[start:stop])
        else:
            rows = p.detach()[start:stop]
            kept = None
            if adopt is not None:
                kept = adopt.take("main", info, shape=tuple(rows.shape), dtype=torch.float32,
                                  device=rows.device)  # fmt: skip
            tensor = nn.Parameter(kept if kept is not None
                                  else rows.to(torch.float32, copy=True))  # fmt: skip
        return Main(param=p, tensor=tensor, rows=(start, stop), info=info,
                    replicas=p.grad_replicas // sync.shards(p))  # fmt: skip

    @property
    def tensors(self) -> list[nn.Parameter]:
        """What the optimizer steps: every main parameter that holds something."""
        return [m.tensor for m in self.entries if m.tensor.numel()]

    def all_tensors(self) -> list[nn.Parameter]:
        """Every main parameter, empty ones (no rows here, or only padding) included."""
        return [m.tensor for m in self.entries]

    def named(self):
        """``(global name, main tensor, ShardInfo)`` for every main parameter that holds a
        part of the global tensor (what checkpoints and recovery save and restore)."""
        for m in self.entries:
            if m.info is not None:
                yield m.info.name, m.tensor, m.info

    def bind_grads(self) -> None:
        """After the reductions: every main parameter's ``grad`` is its reduced fp32
        gradient (a view into the buckets, or into this rank's reduce-scatter output)."""
        for m in self.entries:
            m.tensor.grad = self._sync_of[id(m.param)].main_grad(m.param)

    def grad_of(self, param: nn.Parameter) -> torch.Tensor:
        """The main gradient bound to model parameter ``param``."""
        return self._sync_of[id(param)].main_grad(param)

    def grad_norm(self, *, groups: Sequence[GroupSlot]) -> float:
        """The global norm of the main gradients (each distinct region counted once)."""
        live = [m for m in self.entries if m.tensor.numel()]
        return global_grad_norm([m.tensor for m in live], groups=groups,
                                replicas=[m.replicas for m in live])  # fmt: skip

    def clip(self, *, norm: float, max_norm: float) -> None:
        clip_grads(self.tensors, norm=norm, max_norm=max_norm)

    @torch.no_grad()
    def to_model(self) -> None:
        """Copy the main parameters into the model (cast to its dtype; all-gathered from
        every rank's rows when sharded). Collective when sharded."""
        gathers: dict[GradSync, dict[int, torch.Tensor]] = {}
        for m in self.entries:
            sync = self._sync_of[id(m.param)]
            if sync.shard:
                gathers.setdefault(sync, {})[id(m.param)] = m.tensor
            elif not _shares(m):
                m.param.copy_(m.tensor)
        for sync, shards in gathers.items():
            sync.gather(shards)

    @torch.no_grad()
    def from_model(self) -> None:
        """Copy the model's parameters into the main ones (after something wrote the
        model directly, e.g. ``model.init_from``)."""
        for m in self.entries:
            if not _shares(m):
                m.tensor.copy_(m.param[m.rows[0] : m.rows[1]])

    def optimizer_bytes(self, optimizer: torch.optim.Optimizer) -> int:
        """Bytes this rank holds for the optimizer: AdamW's state, and the main parameters
        that are copies rather than the model's own storage."""
        total = 0
        for m in self.entries:
            if not _shares(m):
                total += m.tensor.numel() * m.tensor.element_size()
            for value in optimizer.state.get(m.tensor, {}).values():
                if isinstance(value, torch.Tensor) and value.dim():
                    total += value.numel() * value.element_size()
        return total


def _shares(m: Main) -> bool:
    """Whether a main parameter is (a view of) its model parameter's storage."""
    return m.tensor.untyped_storage().data_ptr() == m.param.untyped_storage().data_ptr()


def _rows_box(info: ShardInfo, start: int, stop: int) -> ShardInfo | None:
    """The global box of rows ``[start, stop)`` of a local tensor described by ``info``
    (only its first ``info.sizes[0]`` rows are global; the rest is padding)."""
    if (start, stop) == (0, info.sizes[0]) or not info.global_shape:
        return info
    rows = max(0, min(stop, info.sizes[0]) - start)
    if rows == 0:
        return None
    offsets = (info.offsets[0] + start, *info.offsets[1:])
    return ShardInfo(info.name, info.global_shape, offsets, (rows, *info.sizes[1:]))
