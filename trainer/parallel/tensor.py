"""Megatron tensor parallelism (seed ``002_*``): the f/g conjugates and the layers built on
them.

- ``copy_to`` (f): identity forward, all-reduce backward. It sits where a replicated
  activation enters a column-parallel layer: each rank's shard contributes part of the
  input's gradient, so the parts are summed on the way back.
- ``reduce_from`` (g): all-reduce forward, identity backward. It sits after a row-parallel
  layer, whose ranks each hold a partial sum of the output.

A column-parallel linear splits the output features (attention heads, MLP width); the
row-parallel linear after it splits the input features, so an MLP or attention block needs
one all-reduce forward and one backward. The vocabulary is split the same way: an embedding
whose rows are partitioned, and a cross-entropy that all-reduces the per-token max and
sum-exp (b·s numbers) instead of gathering the logits (b·s·v numbers).

**Sequence parallelism** (``parallel.sp``, Megatron's ``sequence_parallel``): between the
tensor-parallel regions (LayerNorm, dropout, residuals, the MoE router) each rank keeps
only its part of the sequence, ``(b, s/tp, h)``, instead of the whole replicated
activation. The conjugates become an all-gather along the sequence where a replicated input
entered a column-parallel layer (backward: reduce-scatter), and a reduce-scatter along the
sequence where a row-parallel layer's partial sums met (backward: all-gather). The bytes on
the wire equal the all-reduce's (an all-reduce is a reduce-scatter plus an all-gather), and
activations outside the regions shrink by tp. Parameters replicated over tp that act on the
sequence shard (LayerNorms, row-parallel biases, positions, the router) then hold partial
gradients: :func:`sync_sequence_parallel_grads` sums them over tp once per step.

Activations are ``(b, s, h)``, batch first, so a sequence shard is a slice of dim 1: the
collectives run on a ``(tp·b, s/tp, h)`` staging tensor, which costs one copy per collective
unless b = 1 (then the reordering is a view).
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.autograd import Function

from checkpoint.shards import ShardInfo
from trainer.init import annotate, make_param, normal_region, sharded_param
from trainer.parallel import comm
from trainer.parallel.context import GroupSlot


class _CopyTo(Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        grad = grad.contiguous().clone()
        comm.all_reduce(grad, ctx.group)
        return grad, None


class _ReduceFrom(Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
        out = x.contiguous().clone()
        comm.all_reduce(out, group)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad, None


def _gather_seq(x: torch.Tensor, group: dist.ProcessGroup, world: int) -> torch.Tensor:
    """``(b, n, ...)`` on every rank -> ``(b, world·n, ...)``, rank r's part at ``[r·n, (r+1)·n)``."""
    b, n = x.shape[:2]
    out = x.new_empty((world * b, n, *x.shape[2:]))
    comm.all_gather_single(out, x.contiguous(), group)
    return out.view(world, b, n, *x.shape[2:]).movedim(0, 1).reshape(b, world * n, *x.shape[2:])


def _scatter_seq(x: torch.Tensor, group: dist.ProcessGroup, world: int) -> torch.Tensor:
    """``(b, s, ...)`` partial sums -> this rank's ``(b, s/world, ...)`` part of their sum."""
    b, s = x.shape[:2]
    n = s // world
    parts = x.reshape(b, world, n, *x.shape[2:]).movedim(1, 0).reshape(world * b, n, *x.shape[2:])
    out = x.new_empty((b, n, *x.shape[2:]))
    comm.reduce_scatter_single(out, parts.contiguous(), group)
    return out


class _GatherSeq(Function):
    """All-gather along the sequence forward; reduce-scatter of the gradient backward."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: dist.ProcessGroup, world: int) -> torch.Tensor:
        ctx.group, ctx.world = group, world
        return _gather_seq(x, group, world)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return _scatter_seq(grad, ctx.group, ctx.world), None, None


class _ScatterSeq(Function):
    """Reduce-scatter along the sequence forward; all-gather of the gradient backward."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: dist.ProcessGroup, world: int) -> torch.Tensor:
        ctx.group, ctx.world = group, world
        return _scatter_seq(x, group, world)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return _gather_seq(grad, ctx.group, ctx.world), None, None


class _GatherSeqLinear(Function):
    """``gather_seq(x) Wᵀ + b`` that keeps only this rank's part of ``x`` for backward and
    all-gathers it again there (Megatron's sequence-parallel linear): the whole-sequence
    input of every column-parallel layer is never held between forward and backward."""

    @staticmethod
    def forward(ctx, x, weight, bias, group: dist.ProcessGroup, world: int):
        ctx.group, ctx.world, ctx.has_bias = group, world, bias is not None
        ctx.save_for_backward(x, weight)
        return F.linear(_gather_seq(x, group, world), weight, bias)

    @staticmethod
    def backward(ctx, grad):
        x, weight = ctx.saved_tensors
        whole = _gather_seq(x, ctx.group, ctx.world)
        grad_in = _scatter_seq(grad.matmul(weight), ctx.group, ctx.world)
        g2 = grad.reshape(-1, grad.shape[-1])
        grad_w = g2.t().matmul(whole.reshape(-1, whole.shape[-1]))
        return grad_in, grad_w, g2.sum(0) if ctx.has_bias else None, None, None


def gather_seq_linear(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, slot: GroupSlot
) -> torch.Tensor:
    """A column-parallel linear on this rank's part of the sequence (sequence parallelism)."""
    return _GatherSeqLinear.apply(x, weight, bias, slot.group, slot.size)


def gather_seq(x: torch.Tensor, slot: GroupSlot) -> torch.Tensor:
    """Sequence parallelism's f: the whole sequence from every rank's part."""
    return _GatherSeq.apply(x, slot.group, slot.size) if slot.active else x


def scatter_seq(x: torch.Tensor, slot: GroupSlot) -> torch.Tensor:
    """Sequence parallelism's g: sum the ranks' partial results, keep this rank's part."""
    return _ScatterSeq.apply(x, slot.group, slot.size) if slot.active else x


def seq_part(length: int, slot: GroupSlot) -> slice:
    """This rank's positions of a sequence of ``length`` under sequence parallelism."""
    n = length // slot.size
    return slice(slot.rank * n, (slot.rank + 1) * n)


def sequence_parallel_params(params) -> list[nn.Parameter]:
    """The parameters whose gradients are partial under sequence parallelism: everything
    replicated over tp outside the experts (experts see whole rows, or reduce over
    expert-dp)."""
    return [p for p in params if not p.tp_split and not p.expert]


def sync_sequence_parallel_grads(grads: list[torch.Tensor], slot: GroupSlot) -> None:
    """Sum the partial gradients of :func:`sequence_parallel_params` over tp, as one
    flat all-reduce (Megatron's all-reduce of the layernorm grads). Once summed they are
    identical on every tp rank, so the gradient norm's replica count (tp·dp) holds."""
    if not slot.active or not grads:
        return
    flat = torch._utils._flatten_dense_tensors(grads)
    comm.all_reduce(flat, slot.group)
    for g, summed in zip(grads, torch._utils._unflatten_dense_tensors(flat, grads), strict=True):
        g.copy_(summed)


def copy_to(x: torch.Tensor, slot: GroupSlot) -> torch.Tensor:
    """f: identity forward, all-reduce of the gradient backward."""
    return _CopyTo.apply(x, slot.group) if slot.active else x


def reduce_from(x: torch.Tensor, slot: GroupSlot) -> torch.Tensor:
    """g: all-reduce forward, identity backward."""
    return _ReduceFrom.apply(x, slot.group) if slot.active else x


class ColumnParallelLinear(nn.Module):
    """``y = x Wᵀ + b`` with W's output features split over the group.

    ``parts > 1`` fuses several same-shaped projections (q, k and v) into one global tensor
    of shape ``(parts, out, in)``, split along ``out`` so every rank keeps its slice of each
    part: this keeps a rank's heads together and its shard a contiguous global region.
    """

    def __init__(
        self,
        name: str,
        in_features: int,
        out_features: int,
        *,
        slot: GroupSlot,
        seed: int,
        std: float,
        parts: int = 1,
        expert: bool = False,
        sp: bool = False,
        dtype: torch.dtype = torch.float32,
    ) -> None:
        super().__init__()
        self.sp = sp and slot.active
        lead = (parts,) if parts > 1 else ()
        dim = len(lead)
        common = dict(index=slot.rank, parts=slot.size, expert=expert, dtype=dtype, seed=seed)
        self.in_features = in_features
        self.slot = slot
        self.weight = sharded_param(
            f"{name}.weight", (*lead, out_features, in_features), std=std, dim=dim, **common
        )
        self.bias = sharded_param(
            f"{name}.bias", (*lead, out_features), std=None, dim=dim, **common
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w, b = self.weight.reshape(-1, self.in_features), self.bias.reshape(-1)
        if self.sp:
            return gather_seq_linear(x, w, b, self.slot)
        return F.linear(copy_to(x, self.slot), w, b)


class RowParallelLinear(nn.Module):
    """``y = x Wᵀ + b`` with W's input features split; the partial sums meet in g."""

    def __init__(
        self,
        name: str,
        in_features: int,
        out_features: int,
        *,
        slot: GroupSlot,
        seed: int,
        std: float,
        expert: bool = False,
        sp: bool = False,
        dtype: torch.dtype = torch.float32,
    ) -> None:
        super().__init__()
        self.slot, self.sp = slot, sp and slot.active
        self.weight = sharded_param(
            f"{name}.weight",
            (out_features, in_features),
            seed=seed,
            std=std,
            dim=1,
            index=slot.rank,
            parts=slot.size,
            expert=expert,
            dtype=dtype,
        )
        # The bias is added once, after the reduction, so it is replicated (and, with
        # sequence parallelism, added to this rank's part of the sequence only).
        self.bias = sharded_param(
            f"{name}.bias", (out_features,), seed=seed, std=None, expert=expert, dtype=dtype
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.linear(x, self.weight)
        return (scatter_seq(y, self.slot) if self.sp else reduce_from(y, self.slot)) + self.bias


def padded_vocab(vocab: int, tp: int) -> int:
    """The vocabulary rounded up to a multiple of tp (the extra rows are padding)."""
    return math.ceil(vocab / tp) * tp


def vocab_param(
    name: str, vocab: int, hidden: int, *, slot: GroupSlot, seed: int, dtype: torch.dtype
) -> nn.Parameter:
    """This rank's rows of a ``(vocab, hidden)`` table padded to a multiple of tp.

    Padding rows are zero and stay zero (they are masked out of the loss, so their gradient
    is zero); the shard info covers only the real rows this rank holds.
    """
    per = padded_vocab(vocab, slot.size) // slot.size
    start = slot.rank * per
    real = max(0, min(start + per, vocab) - start)

    def draw() -> torch.Tensor:
        local = torch.zeros(per, hidden, dtype=torch.float32)
        if real:
            local[:real] = normal_region(seed, name, (vocab, hidden), 0.02, start=start, size=real)
        return local

    info = ShardInfo(name, (vocab, hidden), (min(start, vocab), 0), (real, hidden))
    param = make_param(draw, (per, hidden), dtype=dtype, info=info)
    return annotate(param, info, tp_split=slot.active)


class VocabParallelEmbedding(nn.Module):
    """Token embedding with the vocabulary rows split over tp; lookups outside this rank's
    rows give zeros, and g sums the ranks' partial results."""

    def __init__(
        self,
        name: str,
        vocab: int,
        hidden: int,
        *,
        slot: GroupSlot,
        seed: int,
        dtype: torch.dtype,
        sp: bool = False,
    ) -> None:
        super().__init__()
        self.slot, self.sp = slot, sp and slot.active
        self.weight = vocab_param(name, vocab, hidden, slot=slot, seed=seed, dtype=dtype)
        self.start = slot.rank * self.weight.shape[0]

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if not self.slot.active:
            return F.embedding(ids, self.weight)
        rows = self.weight.shape[0]
        outside = (ids < self.start) | (ids >= self.start + rows)
        local = (ids - self.start).masked_fill(outside, 0)
        out = F.embedding(local, self.weight).masked_fill(outside.unsqueeze(-1), 0.0)
        return scatter_seq(out, self.slot) if self.sp else reduce_from(out, self.slot)


class _VocabParallelCrossEntropy(Function):
    """The loss from this rank's logits columns, holding at most one fp32 copy of them.

    One fp32 working tensor (the fp32 cast of bf16 logits; a clone of fp32 ones, or, with
    ``inplace``, the fp32 input itself, which the head's output may give up since nothing
    else keeps it) is shifted, exponentiated and normalised in place into the softmax that
    backward needs, and backward turns that softmax into the gradient in place (so it runs
    once; a second backward through the same graph is refused). No step waits on the host:
    the padding columns are known from shapes.
    """

    @staticmethod
    def forward(ctx, logits, target, start: int, vocab: int, group, inplace: bool):
        work = logits.float()
        if work.data_ptr() == logits.data_ptr() and not inplace:
            work = work.clone()
        n = work.shape[-1]
        if start + n > vocab:  # padding columns here (decided on the host: no device sync)
            work[..., max(0, vocab - start) :] = float("-inf")
        # The max only shifts for stability; it is a constant, so no gradient flows through it.
        lmax = work.amax(dim=-1)
        if group is not None:
            comm.all_reduce(lmax, group, op=dist.ReduceOp.MAX)
        work.sub_(lmax.unsqueeze(-1))
        mine = (target >= start) & (target < start + n)
        local_t = (target - start).clamp(0, n - 1)
        picked = work.gather(-1, local_t.unsqueeze(-1)).squeeze(-1)
        picked = torch.where(mine, picked, torch.zeros_like(picked))
        sumexp = work.exp_().sum(dim=-1)
        if group is not None:
            both = torch.stack([picked, sumexp])
            comm.all_reduce(both, group)
            picked, sumexp = both[0], both[1]
        ctx.save_for_backward(work.div_(sumexp.unsqueeze(-1)), mine, local_t)
        ctx.consumed = False
        return sumexp.log() - picked

    @staticmethod
    def backward(ctx, grad):
        if ctx.consumed:
            raise RuntimeError("vocab-parallel cross-entropy: its softmax was consumed by an "
                               "earlier backward (retain_graph is not supported)")  # fmt: skip
        ctx.consumed = True
        g, mine, local_t = ctx.saved_tensors
        g.scatter_add_(-1, local_t.unsqueeze(-1), -mine.to(g.dtype).unsqueeze(-1))
        return g.mul_(grad.unsqueeze(-1)), None, None, None, None, None


def vocab_parallel_cross_entropy(
    logits: torch.Tensor,
    target: torch.Tensor,
    *,
    start: int,
    vocab: int,
    slot: GroupSlot,
    inplace: bool = False,
) -> torch.Tensor:
    """Per-token loss from this rank's logits columns ``[start, start + n)``.

    Columns at or beyond the true ``vocab`` are padding and are masked to -inf.
    ``inplace``: fp32 ``logits`` are overwritten (with the softmax) instead of copied; only
    for a tensor nothing else reads afterwards, such as the head's fresh output.
    """
    return _VocabParallelCrossEntropy.apply(
        logits, target, start, vocab, slot.group if slot.active else None, inplace
    )
