"""The pipeline executor: runs one stage's schedule (:mod:`schedule`) with real tensors.

Each maximal run of transfers in the action list is posted as one ``batch_isend_irecv``,
the way Megatron's ``communicate()`` does, at the point the schedule puts it; the simulator
in the tests proves the schedules cannot deadlock when every batch is waited for as a
whole right after it is posted, and that each pair of stages sends and receives the same
tensors in the same order (so untagged FIFO matching, as NCCL and gloo do it, pairs them
correctly). Receive buffers are allocated from a shape known in advance: every activation
and gradient crossing a stage boundary is the hidden state of one micro-batch.

**Waits are deferred** to where they matter: a received tensor's batch is waited for just
before the compute that reads it, and a batch's sends are waited for when the next batch
is posted (or at the end of the step), so computes run while sends drain. Batches are
posted in the same order and at the same points, and every wait comes no earlier than in
the wait-at-once model the simulator checks, so its deadlock proof still holds (a rank
only ever waits for less, later). On NCCL a wait only orders the compute stream after the
transfer, so the host never blocks on one.

**Sent activations are freed once sent** (Megatron's ``deallocate_output_tensor``): after
a chunk's output is posted, the stashed output keeps only its autograd graph (its data is
swapped for an empty tensor), and the transfer's own reference is the last one, dropped when
the send is waited for. Its backward then runs through the autograd engine directly, since
the output's shape no longer matches its gradient's.

Memory: a micro-batch's stashed input and output are dropped at its backward, so a stage
holds at most what the schedule keeps in flight (pp − s micro-batches for 1F1B; the tests
assert it). The executor knows nothing of the model: the caller passes ``forward``, which
runs one chunk on one micro-batch, and optional hooks for gradient synchronisation.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from torch import nn

from trainer.errors import TrainerError
from trainer.parallel import comm
from trainer.parallel.context import GroupSlot, slot_of
from trainer.parallel.schedule import (
    Action,
    Kind,
    Op,
    comm_batches,
    layer_range,
    stage_actions,
    virtual_stage,
)

if TYPE_CHECKING:
    from trainer.parallel.groups import ProcessGroups


class PipelineError(TrainerError):
    """A chunk that does not fit the pipeline contract (shapes, loss, use of its input)."""


# forward(chunk, microbatch, input) -> output. ``input`` is None on the model's first
# virtual stage (the chunk reads its own micro-batch of tokens); on the last virtual stage
# the output is the scalar loss to back-propagate, already scaled by the caller.
ForwardFn = Callable[[int, int, torch.Tensor | None], torch.Tensor]


@dataclass(frozen=True, slots=True, kw_only=True)
class StagePlan:
    """Where this rank sits in its pipeline and what one step runs."""

    pp: int  # pipeline stages
    vpp: int  # model chunks per stage
    microbatches: int  # micro-batches per optimizer step (per data-parallel rank)
    stage: int  # this rank's stage, 0..pp-1
    kind: Kind = Kind.ONE_F_ONE_B  # schedule kind (interleaved when vpp > 1)

    def actions(self) -> list[Action]:
        return stage_actions(
            pp=self.pp, vpp=self.vpp, microbatches=self.microbatches, stage=self.stage,
            kind=self.kind,
        )  # fmt: skip

    def is_last_virtual(self, chunk: int) -> bool:
        return virtual_stage(pp=self.pp, stage=self.stage, chunk=chunk) == self.pp * self.vpp - 1

    def is_first_virtual(self, chunk: int) -> bool:
        return virtual_stage(pp=self.pp, stage=self.stage, chunk=chunk) == 0


@dataclass(frozen=True, slots=True, kw_only=True)
class Wire:
    """How this stage talks to its neighbours."""

    ranks: Sequence[int]  # global rank of each stage of this rank's pipeline, by stage
    group: dist.ProcessGroup | None  # the pp group (None only when pp = 1)
    shape: tuple[int, ...]  # every activation/gradient crossing a stage boundary
    dtype: torch.dtype = torch.float32  # and its dtype
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))  # and device


@dataclass(slots=True, eq=False)
class _Posted:
    """One posted batch of transfers: its works and the tensors they read or write.

    Each work is waited for once (a gloo receive waited for twice blocks for good)."""

    works: list[dist.Work | None]
    sending: list[torch.Tensor]  # kept alive until the sends are waited for
    group: dist.ProcessGroup | None = None

    def wait_one(self, index: int) -> None:
        work, self.works[index] = self.works[index], None
        if work is not None:
            # Abandoned, not waited out, when an in-process round ends under it.
            comm.wait_transfer(work, self.group)

    def wait(self) -> None:
        for i in range(len(self.works)):
            self.wait_one(i)
        self.sending = []


@dataclass(slots=True, kw_only=True)
class StepResult:
    """What one pipelined step produced on this rank."""

    losses: list[torch.Tensor]  # detached per-micro-batch losses (last stage only), by mb
    peak_stashed: int  # most (chunk, micro-batch) activations held at once


def run_step(
    *,
    plan: StagePlan,
    wire: Wire,
    forward: ForwardFn,
    before_backward: Callable[[int, bool], None] | None = None,
    after_chunk_backward: Callable[[int], None] | None = None,
) -> StepResult:
    """Run every action of ``plan`` on this rank.

    ``before_backward(chunk, is_last)`` runs before each backward (``is_last`` is true for
    the chunk's final micro-batch, so a data-parallel wrapper can arm its gradient sync);
    ``after_chunk_backward(chunk)`` runs right after a chunk's final backward, so the
    chunk's gradient buckets can start their all-reduce while other chunks still compute.
    """
    backwards_left = [plan.microbatches] * plan.vpp
    stash: dict[tuple[int, int], tuple[torch.Tensor | None, torch.Tensor]] = {}
    to_send: dict[tuple[Op, int, int], torch.Tensor] = {}
    received: dict[tuple[Op, int, int], tuple[torch.Tensor, _Posted, int | None]] = {}
    posted: list[_Posted] = []
    losses: dict[int, torch.Tensor] = {}
    peak = 0

    def take(key: tuple[Op, int, int]) -> torch.Tensor:
        buf, batch, index = received.pop(key)
        # Just before its first use: its own transfer where the backend gives one work per
        # transfer (gloo), else the whole batch (NCCL coalesces a batch into one work).
        if index is not None:
            batch.wait_one(index)
        else:
            batch.wait()
        return buf

    for item in comm_batches(plan.actions()):
        if isinstance(item, list):
            for batch in posted:  # the sends of earlier batches have drained meanwhile
                batch.wait()
            posted = [_exchange(item, wire=wire, to_send=to_send, received=received)]
            for act in item:
                if act.op is Op.SEND_ACT:
                    _free_sent(stash[(act.chunk, act.microbatch)][1])
            continue
        key = (item.chunk, item.microbatch)
        if item.op is Op.FORWARD:
            inp = None
            if not plan.is_first_virtual(item.chunk):
                inp = take((Op.RECV_ACT, *key)).requires_grad_()
            out = forward(item.chunk, item.microbatch, inp)
            if plan.is_last_virtual(item.chunk):
                if out.dim() != 0:
                    raise PipelineError("the last virtual stage's forward must return a scalar")
                losses[item.microbatch] = out.detach()
            else:
                _check_shape(out, wire, what=f"output of chunk {item.chunk}")
                to_send[(Op.SEND_ACT, *key)] = out.detach()
            stash[key] = (inp, out)
            peak = max(peak, len(stash))
            continue
        inp, out = stash.pop(key)
        backwards_left[item.chunk] -= 1
        last = backwards_left[item.chunk] == 0
        if before_backward is not None:
            before_backward(item.chunk, last)
        if plan.is_last_virtual(item.chunk):
            torch.autograd.backward(out)
        else:
            _backward(out, take((Op.RECV_GRAD, *key)))
        del out
        if inp is not None:
            if inp.grad is None:
                raise PipelineError(f"chunk {item.chunk} does not use its input activation")
            to_send[(Op.SEND_GRAD, *key)] = inp.grad
        if last and after_chunk_backward is not None:
            after_chunk_backward(item.chunk)
    for batch in posted:
        batch.wait()
    if stash or to_send or received:
        raise PipelineError("pipeline step ended with tensors left over (schedule bug)")
    return StepResult(losses=[losses[i] for i in sorted(losses)], peak_stashed=peak)


def _backward(out: torch.Tensor, grad: torch.Tensor) -> None:
    """``out.backward(grad)`` for an output whose data may have been freed once sent: the
    engine checks the gradient against the shape the graph recorded, not against ``out``."""
    if out.shape == grad.shape:
        torch.autograd.backward(out, grad_tensors=grad)
        return
    torch.autograd.Variable._execution_engine.run_backward(
        (out,), (grad,), False, False, (), True, True
    )  # tensors, grads, keep_graph, create_graph, inputs, allow_unreachable, accumulate_grad


def _free_sent(out: torch.Tensor) -> None:
    """Keep only the graph of a chunk output that has been posted (the send holds the
    data). A view shares its base's storage, so only a base is freed."""
    if out._base is None and out.requires_grad:
        out.data = torch.empty((0,), dtype=out.dtype, device=out.device)


def _exchange(
    batch: list[Action],
    *,
    wire: Wire,
    to_send: dict[tuple[Op, int, int], torch.Tensor],
    received: dict[tuple[Op, int, int], tuple[torch.Tensor, _Posted, int | None]],
) -> _Posted:
    """Post one batch of sends and receives together; the caller waits for it later."""
    ops, sending, recvs = [], [], []  # recvs: (key, buffer, index of its op)
    for act in batch:
        peer = wire.ranks[act.peer]
        key = (act.op, act.chunk, act.microbatch)
        if act.op in (Op.SEND_ACT, Op.SEND_GRAD):
            t = to_send.pop(key).contiguous()
            sending.append(t)
            ops.append(dist.P2POp(dist.isend, t, peer, wire.group))
        else:
            buf = torch.empty(wire.shape, dtype=wire.dtype, device=wire.device)
            recvs.append((key, buf, len(ops)))
            ops.append(dist.P2POp(dist.irecv, buf, peer, wire.group))
    works = list(dist.batch_isend_irecv(ops))
    out = _Posted(works=works, sending=sending, group=wire.group)
    per_op = len(works) == len(ops)
    for key, buf, i in recvs:
        received[key] = (buf, out, i if per_op else None)
    return out


def _check_shape(t: torch.Tensor, wire: Wire, *, what: str) -> None:
    # A wrong shape would make the peer's receive hang or read garbage; fail loudly here.
    if tuple(t.shape) != tuple(wire.shape) or t.dtype != wire.dtype:
        raise PipelineError(
            f"{what} is {tuple(t.shape)} {t.dtype}, but stages exchange "
            f"{tuple(wire.shape)} {wire.dtype}"
        )


def sync_tied_grads(grads: Sequence[torch.Tensor], *, group: dist.ProcessGroup | None) -> None:
    """Sum the gradients of weights tied across stages (the word embedding and the output
    head live on the first and last stage) over the ``embedding`` group, every step."""
    if group is None or dist.get_world_size(group) == 1:
        return
    for g in grads:
        comm.all_reduce(g, group)


@dataclass(frozen=True, slots=True, kw_only=True)
class PipelineGroups:
    """This rank's place in its pipeline, built once per world from the process groups."""

    pp: int  # pipeline stages
    vpp: int  # model chunks per stage
    stage: int  # this rank's stage
    ranks: tuple[int, ...]  # global rank of every stage of this rank's pipeline
    group: dist.ProcessGroup | None  # the pp group; None when pp = 1
    embedding: dist.ProcessGroup | None  # first + last stage (tied embedding); None elsewhere
    slot: GroupSlot  # the pp group as a GroupSlot (the global grad norm sums over it)

    @classmethod
    def from_groups(cls, groups: ProcessGroups) -> PipelineGroups:
        p = groups.layout.parallel
        piped = p.pp > 1
        return cls(
            pp=p.pp,
            vpp=p.vpp,
            stage=groups.index("pp"),
            ranks=tuple(groups.ranks("pp")),
            group=groups.get("pp") if piped else None,
            embedding=groups.get("embedding") if piped else None,
            slot=slot_of(groups, "pp"),
        )

    def layer_ranges(self, layers: int) -> list[range]:
        """The global layers of each of this stage's chunks, chunk 0 first."""
        return [
            layer_range(layers=layers, pp=self.pp, vpp=self.vpp, stage=self.stage, chunk=c)
            for c in range(self.vpp)
        ]

    def run(
        self,
        *,
        microbatches: int,
        shape: tuple[int, ...],
        dtype: torch.dtype,
        device: torch.device,
        forward: ForwardFn,
        before_backward: Callable[[int, bool], None] | None = None,
        after_chunk_backward: Callable[[int], None] | None = None,
    ) -> StepResult:
        """One pipelined forward/backward of every micro-batch (1F1B, or interleaved)."""
        return run_step(
            plan=StagePlan(pp=self.pp, vpp=self.vpp, microbatches=microbatches, stage=self.stage),
            wire=Wire(ranks=self.ranks, group=self.group, shape=shape, dtype=dtype, device=device),
            forward=forward,
            before_backward=before_backward,
            after_chunk_backward=after_chunk_backward,
        )

    def tied_params(
        self, params: Iterable[nn.Parameter], *, name: str | None
    ) -> list[nn.Parameter]:
        """This rank's copies of the weight called ``name`` that another stage also holds
        (the word embedding on the first stage, and the head's copy on the last); none when
        ``name`` is None (embeddings not tied)."""
        if self.pp == 1 or name is None:
            return []
        return [p for p in params if p.shard_info.name == name]

    def mark_tied_replicas(self, params: Iterable[nn.Parameter], *, name: str | None) -> None:
        """Two stages hold the tied weight and, after :meth:`sync_tied`, the same gradient:
        count each copy half, so the global gradient norm counts the weight once."""
        for p in self.tied_params(params, name=name):
            p.grad_replicas *= 2

    def sync_tied(self, params: Iterable[nn.Parameter], *, name: str | None) -> None:
        """Sum the tied weight's gradient over the first and last stage, every step."""
        tied = [p.grad for p in self.tied_params(params, name=name) if p.grad is not None]
        sync_tied_grads(tied, group=self.embedding)

    def share_loss(self, loss: torch.Tensor) -> torch.Tensor:
        """Only the last stage computes the loss; sum it over the pipeline (the other
        stages contribute zero) so that every rank, rank 0 included, reports it."""
        if self.group is not None:
            comm.all_reduce(loss, self.group)
        return loss
