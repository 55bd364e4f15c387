"""Mixture of experts with expert parallelism: a top-k softmax router, experts partitioned
over the expert-parallel group, and a dropless dispatch over ``all_to_all_single``.

Dropless: every token goes to all of its top-k experts (no capacity factor), so what a
token computes does not depend on which other tokens share its batch or its rank, and
every layout gives the same result as one process.

Per MoE layer and micro-batch:

1. route: logits = router(x); the top-k logits, softmaxed, weight the chosen experts;
2. sort the (token, expert) assignments by expert and count them per expert;
3. exchange the counts (an all-to-all of E integers), then the token rows themselves with
   variable split sizes, so each rank receives the rows for its own experts;
4. run each local expert on its rows (every expert runs, with zero rows if need be, so all
   parameters take part in backward and the gradient buckets always fill): as one batched
   matmul per linear over a ``(local experts, most rows, hidden)`` grid, zero-padded, when
   that padding is bounded (``batch_slack``: at most 2× the rows), else one matmul per
   expert; with etp > 1 the tp conjugates run once for all local experts, not once each;
5. send the outputs back the same way, undo the sort, and sum the k weighted outputs.

Expert tensor parallelism: etp may be 1 or equal to tp.

- etp = tp: each expert's MLP is column/row split over the expert-tp group, which is the tp
  group; every tp rank routes the same tokens, and ranks with the same tp index exchange
  them, so an expert's shards see identical rows.
- etp = 1 with tp > 1: the tp ranks hold identical tokens, so each takes a contiguous
  chunk of them into the MoE (scatter forward, all-gather backward) and the outputs are
  all-gathered afterwards (all-gather forward, take own chunk backward). Each token is then
  computed exactly once.

Sequence parallelism: the layer's input is this rank's part of the sequence, and the router
(and its top-k) runs on it. The load-balancing loss still sees every token of the
micro-batch: the expert counts and the summed probabilities are summed over tp (the
probabilities through g, so each rank's tokens get their own gradient, and the router's
partial gradients are summed over tp with the other sequence-parallel ones). With etp = 1
each rank's part is already a disjoint chunk of the tokens, so nothing is split or gathered.
With etp = tp the ranks' parts are all-gathered into the MoE (with their weights and
choices; backward: own chunk), every tp rank computes the experts' shards on all of them,
and each keeps its own part of the output (backward: all-gather).

Expert gradients are reduced over expert-dp, not dp (see trainer/parallel/data.py).
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.autograd import Function

from elasticd.inprocess import check_results
from trainer.init import sharded_param
from trainer.parallel import comm
from trainer.parallel.context import GroupSlot, ParallelContext
from trainer.parallel.tensor import (
    ColumnParallelLinear,
    RowParallelLinear,
    copy_to,
    reduce_from,
)

BATCH_SLACK = 2.0
"""Run the local experts as batched matmuls when the padded grid has at most this many
times the real rows (balanced routing pads little; one hot expert would pad a lot)."""


class _AllToAll(Function):
    @staticmethod
    def forward(ctx, x, out_splits: list[int], in_splits: list[int], group):
        ctx.splits, ctx.group = (out_splits, in_splits), group
        out = x.new_empty((sum(out_splits), *x.shape[1:]))
        comm.all_to_all_single(out, x.contiguous(), out_splits, in_splits, group)
        return out

    @staticmethod
    def backward(ctx, grad):
        out_splits, in_splits = ctx.splits
        back = grad.new_empty((sum(in_splits), *grad.shape[1:]))
        comm.all_to_all_single(back, grad.contiguous(), in_splits, out_splits, ctx.group)
        return back, None, None, None


def _chunk_bounds(n: int, slot: GroupSlot) -> tuple[int, int, int]:
    size = math.ceil(n / slot.size)
    start = min(n, slot.rank * size)
    return start, min(n, start + size), size


class _TakeChunk(Function):
    """Forward: this rank's rows of a replicated tensor. Backward: all-gather the row grads."""

    @staticmethod
    def forward(ctx, x, group, rank: int, world: int):
        n = x.shape[0]
        size = math.ceil(n / world)
        start, stop = min(n, rank * size), min(n, (rank + 1) * size)
        ctx.meta = (group, n, size, start, stop)
        return x[start:stop].clone()

    @staticmethod
    def backward(ctx, grad):
        group, n, size, _, _ = ctx.meta
        return _gather_rows(grad, group, n, size), None, None, None


class _GatherChunks(Function):
    """Forward: all-gather every rank's rows. Backward: keep this rank's rows' gradient."""

    @staticmethod
    def forward(ctx, x, group, n: int, size: int, start: int, stop: int):
        ctx.bounds = (start, stop)
        return _gather_rows(x, group, n, size)

    @staticmethod
    def backward(ctx, grad):
        start, stop = ctx.bounds
        return grad[start:stop].contiguous(), None, None, None, None, None


def _gather_rows(x: torch.Tensor, group, n: int, size: int) -> torch.Tensor:
    world = dist.get_world_size(group)
    padded = x.new_zeros((size, *x.shape[1:]))
    padded[: x.shape[0]] = x
    out = x.new_empty((size * world, *x.shape[1:]))
    comm.all_gather_single(out, padded.contiguous(), group)
    return out[:n]


def expert_counts(flat: torch.Tensor, experts: int) -> torch.Tensor:
    """How many entries of ``flat`` (expert indices, int64) name each of ``experts``, on
    ``flat``'s device. ``torch.bincount`` gives the same integers, but on CUDA it reads the
    input's min and max back to the host first: two device synchronisations per call, two
    calls per MoE layer and micro-batch."""
    return torch.zeros(experts, dtype=torch.long, device=flat.device).scatter_add_(
        0, flat, torch.ones_like(flat)
    )


def regroup_by_expert(
    recv_counts: torch.Tensor, *, local: int, ep: int, total: int | None = None
) -> torch.Tensor:
    """The permutation that sorts received rows by local expert.

    ``recv_counts[r·local + e]`` rows came from ep rank ``r`` for local expert ``e``, and
    they arrive grouped by source rank, then by expert. Everything is built on the counts'
    device: a CPU ``arange`` against CUDA repeats raises on NCCL (gloo tests cannot see it).
    ``total``: the rows received, when the caller knows it on the host (on CUDA,
    ``repeat_interleave`` otherwise reads the counts back: a device synchronisation).
    """
    experts = torch.arange(local, device=recv_counts.device).repeat(ep)
    expert_of_row = torch.repeat_interleave(experts, recv_counts, output_size=total)
    return torch.argsort(expert_of_row, stable=True)


class Expert(nn.Module):
    """One expert: GPT-2's MLP (fc1, tanh GeLU, fc2), tensor-split over expert-tp."""

    def __init__(
        self,
        name: str,
        hidden: int,
        ffn: int,
        *,
        slot: GroupSlot,
        seed: int,
        out_std: float,
        dtype: torch.dtype,
    ) -> None:
        super().__init__()
        common = dict(slot=slot, seed=seed, expert=True, dtype=dtype)
        self.fc1 = ColumnParallelLinear(f"{name}.fc1", hidden, ffn, std=0.02, **common)
        self.fc2 = RowParallelLinear(f"{name}.fc2", ffn, hidden, std=out_std, **common)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.gelu(self.fc1(x), approximate="tanh"))


class _AttachAux(Function):
    """Identity on the output whose backward also feeds ``scale`` into the aux loss, so the
    aux loss is back-propagated with the chunk that computed it (any pipeline stage)."""

    @staticmethod
    def forward(ctx, out, aux, scale: float):
        ctx.scale = scale
        return out.view_as(out)

    @staticmethod
    def backward(ctx, grad):
        return grad, grad.new_full((), ctx.scale), None


class MoE(nn.Module):
    """A dropless MoE MLP.

    ``aux_scale`` > 0 switches the load-balancing loss on: the trainer sets it to
    ``aux_loss_coeff / grad_accum``; the last value is kept (detached) in ``last_aux``.
    """

    def __init__(
        self,
        name: str,
        *,
        hidden: int,
        ffn: int,
        experts: int,
        top_k: int,
        ctx: ParallelContext,
        seed: int,
        out_std: float,
        dtype: torch.dtype,
    ) -> None:
        super().__init__()
        if ctx.etp.size not in (1, ctx.tp.size):
            raise ValueError(f"expert tensor parallelism {ctx.etp.size} must be 1 or tp")
        self.num_experts, self.top_k = experts, top_k
        self.aux_scale = 0.0
        self.last_aux: torch.Tensor | None = None
        self.batch_slack = BATCH_SLACK
        self.ctx = ctx
        # Tokens are split over tp inside the layer only when the experts are not tp-split;
        # under sequence parallelism they arrive split, and tp-split experts gather them.
        self.sp = ctx.sp and ctx.tp.active
        self.split_tokens = ctx.tp.active and not ctx.etp.active and not self.sp
        self.gather_tokens = self.sp and ctx.etp.active
        self.local = experts // ctx.ep.size
        first = ctx.ep.rank * self.local
        # The router is small and replicated everywhere (GPT-2 has none; it has no bias).
        self.router = nn.Module()
        self.router.weight = sharded_param(
            f"{name}.router.weight", (experts, hidden), seed=seed, std=0.02, dtype=dtype
        )
        self.experts = nn.ModuleDict(
            {
                str(e): Expert(
                    f"{name}.experts.{e}",
                    hidden,
                    ffn,
                    slot=ctx.etp,
                    seed=seed,
                    out_std=out_std,
                    dtype=dtype,
                )
                for e in range(first, first + self.local)
            }
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        xf = x.reshape(-1, shape[-1])
        # The router runs in fp32 (as Megatron's moe_router_dtype fp32): in bf16, close
        # logits tie or swap and the expert choice flips.
        logits = F.linear(xf.float(), self.router.weight.float())
        top_logits, top_idx = logits.topk(self.top_k, dim=-1)
        weights = F.softmax(top_logits, dim=-1, dtype=torch.float32).to(x.dtype)
        # The aux loss sees every token of the micro-batch, before any split over tp.
        aux = self._aux_loss(logits, top_idx) if self.aux_scale > 0 else None
        tp = self.ctx.tp
        if self.split_tokens:
            n = xf.shape[0]
            start, stop, size = _chunk_bounds(n, tp)
            xf = _TakeChunk.apply(xf, tp.group, tp.rank, tp.size)
            weights = _TakeChunk.apply(weights, tp.group, tp.rank, tp.size)
            top_idx = top_idx[start:stop]
        elif self.gather_tokens:
            size = xf.shape[0]  # every rank's part of the sequence is the same size
            n, start = size * tp.size, size * tp.rank
            xf = _GatherChunks.apply(xf, tp.group, n, size, start, start + size)
            weights = _GatherChunks.apply(weights, tp.group, n, size, start, start + size)
            # Clamped: a gather aborted when its in-process round ended returns whatever
            # its buffer held, and an index out of range in expert_counts' scatter is a
            # device-side assert on CUDA, fatal to the process (its state with it), where
            # check_results would have ended the round cleanly. A no-op otherwise.
            top_idx = _gather_rows(top_idx, tp.group, n, size).clamp_(0, self.num_experts - 1)
        out = self._dispatch_compute_combine(xf, weights, top_idx)
        if self.split_tokens:
            out = _GatherChunks.apply(out, tp.group, n, size, start, stop)
        elif self.gather_tokens:
            out = _TakeChunk.apply(out, tp.group, tp.rank, tp.size)
        out = out.reshape(shape)
        if aux is not None:
            self.last_aux = aux.detach()
            out = _AttachAux.apply(out, aux, self.aux_scale)
        return out

    def _dispatch_compute_combine(self, xf, weights, top_idx) -> torch.Tensor:
        n_tokens, k, ep = xf.shape[0], self.top_k, self.ctx.ep
        flat = top_idx.reshape(-1)
        order = torch.argsort(flat, stable=True)
        token_of = order // k
        rows = xf[token_of]
        counts = expert_counts(flat, self.num_experts)
        if ep.active:
            recv_counts = torch.empty_like(counts)
            comm.all_to_all_single(recv_counts, counts, None, None, ep.group)
            # The counts on the host, both in one read (one device synchronisation). An
            # all-to-all aborted when its in-process round ended returns whatever its
            # buffer held: not sizes to allocate or index with (check_results raises).
            sent_h, got_h = torch.stack((counts, recv_counts)).tolist()
            check_results(ep.group, gloo=False)  # gloo's counts are right: the step goes on
            per_rank = range(ep.size)
            send = [sum(sent_h[r * self.local : (r + 1) * self.local]) for r in per_rank]
            recv = [sum(got_h[r * self.local : (r + 1) * self.local]) for r in per_rank]
            rows = _AllToAll.apply(rows, recv, send, ep.group)
            regroup = regroup_by_expert(recv_counts, local=self.local, ep=ep.size,
                                        total=sum(recv))  # fmt: skip
            rows = rows[regroup]
            local_counts = recv_counts.view(ep.size, self.local).sum(0)
            per_expert = [sum(got_h[r * self.local + e] for r in per_rank)
                          for e in range(self.local)]  # fmt: skip
        else:
            local_counts, per_expert = counts, counts.tolist()
        out_rows = self.run_experts(rows, local_counts, per_expert)
        if ep.active:
            out_rows = out_rows[torch.argsort(regroup)]
            out_rows = _AllToAll.apply(out_rows, send, recv, ep.group)
        w = weights.reshape(-1)[order].unsqueeze(-1)
        out = xf.new_zeros(n_tokens, xf.shape[-1])
        return out.index_add(0, token_of, out_rows * w)

    def run_experts(
        self, rows: torch.Tensor, counts: torch.Tensor, per_expert: list[int]
    ) -> torch.Tensor:
        """Every local expert on its run of ``rows`` (sorted by local expert; ``counts`` on
        the rows' device, ``per_expert`` the same on the host)."""
        experts = list(self.experts.values())
        n, most = rows.shape[0], max(per_expert, default=0)
        if len(experts) > 1 and n and len(experts) * most <= self.batch_slack * n:
            return self._batched(experts, rows, counts, most)
        outs = [e(chunk) for e, chunk in zip(experts, rows.split(per_expert), strict=True)]
        return torch.cat(outs) if outs else rows

    def _batched(
        self, experts: list[Expert], rows: torch.Tensor, counts: torch.Tensor, most: int
    ) -> torch.Tensor:
        """The experts' MLPs as batched matmuls over a zero-padded ``(E, most, h)`` grid.
        Padding rows are computed and dropped (no gradient reaches them); indexes are built
        on the rows' device from device counts, so nothing waits on the host."""
        e, (n, h) = len(experts), rows.shape
        etp = self.ctx.etp
        dev = rows.device
        expert_of = torch.repeat_interleave(torch.arange(e, device=dev), counts, output_size=n)
        first = torch.cumsum(counts, 0) - counts
        slot = expert_of * most + torch.arange(n, device=dev) - first[expert_of]
        x = copy_to(rows, etp)  # once for every expert's column-parallel fc1
        grid = x.new_zeros(e * most, h).index_copy(0, slot, x).view(e, most, h)
        w1 = torch.stack([m.fc1.weight.reshape(-1, h) for m in experts])  # (E, ffn/etp, h)
        b1 = torch.stack([m.fc1.bias.reshape(-1) for m in experts])
        y = F.gelu(torch.baddbmm(b1.unsqueeze(1), grid, w1.transpose(1, 2)), approximate="tanh")
        w2 = torch.stack([m.fc2.weight for m in experts])  # (E, h, ffn/etp)
        z = torch.bmm(y, w2.transpose(1, 2)).view(e * most, h)[slot]
        z = reduce_from(z, etp)  # once for every expert's row-parallel fc2
        return z + torch.stack([m.fc2.bias for m in experts])[expert_of]

    def _aux_loss(self, logits: torch.Tensor, top_idx: torch.Tensor) -> torch.Tensor:
        """Switch-style load balance: E · Σ_e (share of assignments to e) · (mean prob of e)."""
        probs = F.softmax(logits, dim=-1, dtype=torch.float32)
        share = expert_counts(top_idx.reshape(-1), self.num_experts).float()
        if not self.sp:
            share = share / top_idx.numel()
            return self.num_experts * (share * probs.mean(0)).sum()
        # This rank routed its part of the sequence only: sum the counts and probabilities
        # over tp (every part has the same number of tokens).
        tp = self.ctx.tp
        comm.all_reduce(share, tp.group)
        share = share / (top_idx.numel() * tp.size)
        mean = reduce_from(probs.sum(0), tp) / (probs.shape[0] * tp.size)
        return self.num_experts * (share * mean).sum()
