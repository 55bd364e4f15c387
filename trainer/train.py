"""The training loop, factored so that a pipeline executor and the checkpoint store can plug
into it at single, obvious places.

One optimizer step is, in order (each a method of :class:`Trainer`)::

    begin_step()                        zero the gradient buckets, set this step's lr
    for each micro-batch m:             (pp = 1; a pipeline executor drives this instead)
        grad_syncs[c].set_sync(last)    arm the data-parallel all-reduce on the last one
        loss = chunk_forward(c, m, x)   forward of chunk c on micro-batch m: the hidden
                                        state, or on the last chunk the loss already
                                        scaled by 1/grad_accum
        loss.backward()                 the buckets' all-reduces start from backward hooks
    finish_step(lr=, started=)          wait for the buckets, global norm, clip, AdamW,
                                        advance ``state`` -> StepResult

**Pipeline seam.** ``chunk_forward(chunk, microbatch, inputs)`` matches the executor's
``ForwardFn``: with ``inputs`` None the chunk reads micro-batch ``microbatch``'s tokens
(prepared by ``begin_step``); the last chunk returns the scaled scalar loss. Its
``before_backward(chunk, is_last)`` hook is ``lambda c, last: trainer.grad_syncs[c]
.set_sync(last)``. ``layer_ranges`` in :meth:`Trainer.__init__` says which global layers
each chunk holds. With pp > 1, ``pipeline`` (:class:`~trainer.parallel.pipeline.
PipelineGroups`) places the chunks and runs the schedule in :meth:`Trainer.forward_backward`.

**Checkpoint seam.** Every parameter has ``shard_info`` (:mod:`trainer.init`);
``named_parameters()`` yields them by global name; ``optimizer`` is a plain AdamW over the
local shards; ``state`` (:class:`TrainState`: ``step``, ``consumed_samples``) is all the
loop position there is. In :meth:`Trainer.run`, resuming belongs before the first step and
saving right after ``finish_step``; both places are marked.

**Supervision.** :meth:`Trainer.run` calls ``progress(result)`` after every step (the agent's
heartbeat).
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, replace

import torch
import torch.distributed as dist
from torch import nn

from checkpoint.shards import ShardInfo
from elasticd.inprocess import check_results
from elasticd.layout import Layout
from trainer.data import BatchPlan, micro_batches, open_source
from trainer.errors import DivergedError, TrainerConfigError
from trainer.init import Adoption, adopting, deferred, draw_into
from trainer.model import build_chunks
from trainer.optim import MainParams, build_optimizer, grad_replicas, lr_at, set_lr
from trainer.parallel import comm
from trainer.parallel.context import GroupSlot, ParallelContext
from trainer.parallel.data import GradSync
from trainer.parallel.pipeline import PipelineGroups, sync_tied_grads
from trainer.parallel.rng import DropoutRNG
from trainer.parallel.tensor import sequence_parallel_params, sync_sequence_parallel_grads
from trainer.perf import apply_tf32, flops_per_token, mfu, peak_flops, peak_memory_gib

# The tied word embedding: the first stage's embedding and the last stage's head copy.
TIED_EMBEDDING = "embedding.word_embeddings.weight"

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
NONFINITE_LIMIT = 5
"""Steps in a row whose global gradient norm is not finite (an overflow, a NaN from a bad
batch or a flipped bit) that the trainer skips before it stops with :class:`DivergedError`.
Such a step's update is not applied (AdamW would write NaN into every main parameter,
which the next checkpoint and the in-memory replicas would then keep); the step is still
counted and its batch consumed, as Megatron counts a skipped iteration."""

log = logging.getLogger(__name__)


@dataclass(kw_only=True, slots=True)
class TrainState:
    """Where training stands; this and the optimizer are everything a resume needs."""

    step: int = 0
    """Completed optimizer steps."""
    consumed_samples: int = 0
    """Global samples consumed so far (the data position, valid on any layout)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class StepResult:
    """What one optimizer step reports (a metrics.jsonl record, less the layout fields)."""

    step: int
    """1-based count of completed steps."""
    loss: float
    """Mean loss over every token of the global batch (without the aux loss)."""
    grad_norm: float
    """Global gradient norm before clipping."""
    lr: float
    """Learning rate used by this step."""
    step_s: float
    """Wall time of the step."""
    tokens_per_s: float
    """Global batch tokens over step_s."""
    mfu: float | None
    """Model FLOPs utilisation against the devices' peak (trainer/perf.py); None where the
    peak is not known (CPU, unlisted GPUs)."""
    mem_gb: float
    """The largest peak memory of any active rank so far, in GiB (trainer/perf.py)."""
    skipped: bool = False
    """The update was not applied: the gradient norm was not finite (:data:`NONFINITE_LIMIT`)."""


def check_supported(job, layout: Layout) -> None:
    """Reject what the built-in trainer cannot run, before any process group exists."""
    p = layout.parallel
    if job.train.dtype not in DTYPES:
        raise TrainerConfigError(
            f"train.dtype: {job.train.dtype} needs loss scaling, which the built-in trainer "
            "does not do; use bfloat16 or float32"
        )
    if job.model.experts and p.expert_tp not in (1, p.tp):
        raise TrainerConfigError(
            f"parallel.etp: {p.expert_tp}: the built-in trainer supports etp = 1 or etp = tp ({p.tp})"
        )


class Trainer:
    """One rank's model shard, optimizer, data position and step."""

    def __init__(
        self,
        *,
        job,
        layout: Layout,
        ctx: ParallelContext,
        dp_rank: int,
        model_groups: tuple[GroupSlot, ...] = (),
        device: torch.device | None = None,
        overlap_grads: bool = True,
        pipeline: PipelineGroups | None = None,
        init: bool = True,
        adopt: Adoption | None = None,
    ) -> None:
        """``init`` False: the parameters are zeros, not drawn (``trainer.init.deferred``),
        for a state about to be loaded or received; :meth:`initialize` draws them if
        nothing was, and no step trains before one of the two. ``adopt`` (with ``init``
        False): a previous trainer's tensors to take where this one holds the same region
        (in-process recovery, :meth:`adoption`); they are this trainer's state from then
        on, so whoever passes them must not offer the previous trainer's state once this
        one's is written."""
        if adopt is not None and init:
            raise ValueError("adopt needs init=False: adopted tensors are never drawn")
        check_supported(job, layout)
        if layout.parallel.pp > 1 and pipeline is None:
            raise TrainerConfigError(f"parallel.pp: {layout.parallel.pp} needs the pipeline groups")
        self.pipeline = pipeline if layout.parallel.pp > 1 else None
        self._tied_name = TIED_EMBEDDING if job.model.tie_embeddings else None
        self.job, self.layout, self.ctx = job, layout, ctx
        self.preempted = False
        self.on_phase: Callable[[str, int], None] | None = None
        """Told ``(phase, step)`` as each phase of a step begins (forward, backward,
        optimizer, update, step-end, checkpoint-save): ``WorkerChannel.phase``, where
        faults keyed to a phase fire (elasticd.testing). The ``recover`` phase is entered
        by ``trainer.recovery.recover``, not here."""
        self.on_updated: Callable[[StepResult], None] | None = None
        """Told each step's result as soon as its update is applied, before the ZeRO-1
        all-gather and the checkpoint save, which a fault can stop (``step_s`` then does not
        count the all-gather): in-process restart keeps the metrics record there, so that a
        step a peer completes in recovery (:meth:`complete_pending`) has a record somewhere
        even if this rank never gets further."""
        self._backward_seen = False
        self.checkpointing = None
        """The run's Checkpointing once ``run`` started (its saver's last result is
        reported to the agent)."""
        self.replicator: Callable[[], object] | None = None
        """A weak reference to the :class:`trainer.replicas.Replicator` of this trainer's
        state (in-process rounds with ``checkpoint.memory_replicas``): its snapshot copy,
        on a CUDA side stream, is waited for before each optimizer step changes the state.
        Weak: the replicator's ``live`` refers to this trainer, and a cycle would keep a
        past round's trainer (its device memory) until a full garbage collection."""
        self.device = device or torch.device("cpu")
        m, t, p = job.model, job.train, layout.parallel
        apply_tf32(device=self.device, dtype=DTYPES[t.dtype], tf32=t.tf32)
        self._flops_per_step = flops_per_token(m) * t.global_batch * m.seq_len
        self._peak_flops = peak_flops(self.device, dtype=DTYPES[t.dtype], tf32=t.tf32)
        self.source = open_source(job.data, model_cfg=m, seed=t.seed)
        self.batches = BatchPlan(
            global_batch=t.global_batch, micro_batch=t.micro_batch, dp=layout.dp, dp_rank=dp_rank
        )
        self.layer_ranges = (
            [range(m.layers)] if self.pipeline is None else self.pipeline.layer_ranges(m.layers)
        )
        self.rng = None
        """Dropout's RNG tracker (with dropout > 0): reseeded every step from (seed, step,
        dp rank, pp stage), so a resume in the same layout draws the same masks."""
        if m.dropout > 0:
            stage = self.pipeline.stage if self.pipeline is not None else 0
            self.rng = DropoutRNG(seed=t.seed, dp_rank=dp_rank, pp_stage=stage,
                                  tp_rank=ctx.tp.rank)  # fmt: skip
            ctx = self.ctx = replace(ctx, rng=self.rng)
        if job.parallel.sp:
            ctx = self.ctx = replace(ctx, sp=True)
        with contextlib.nullcontext() if init else deferred(self.device), adopting(adopt):
            self.chunks = build_chunks(
                m, self.layer_ranges, ctx=ctx, seed=t.seed, dtype=DTYPES[t.dtype],
                recompute=t.recompute,
            )  # fmt: skip
        self.initialized = init
        """Whether the state holds something: drawn at construction, loaded from a
        checkpoint, received from peers, or drawn by :meth:`initialize`."""
        accum = self.batches.grad_accum
        for chunk in self.chunks:
            chunk.to(self.device)
            chunk.train()
            chunk.set_aux_scale(t.aux_loss_coeff / accum)
        self.params = [q for c in self.chunks for q in c.parameters()]
        self._sp_params = sequence_parallel_params(self.params) if ctx.sp else []
        sizes = dict(tp=p.tp, dp_cp=layout.dp * p.cp, etp=p.expert_tp, expert_dp=layout.expert_dp)
        for q in self.params:
            q.grad_replicas = grad_replicas(q, **sizes)
        self.model_groups = model_groups
        if self.pipeline is not None:
            self.pipeline.mark_tied_replicas(self.params, name=self._tied_name)
            self.model_groups = (*model_groups, self.pipeline.slot)
        bucket_bytes = max(1, int(t.bucket_mb * (1 << 20)))
        zero = job.parallel.zero == 1
        # Gradients accumulate and reduce in fp32 whatever the model computes in.
        self.grad_syncs = [
            GradSync(list(c.parameters()), dense=ctx.dp_cp, expert=ctx.expert_dp,
                     divisor=layout.dp * p.cp, bucket_bytes=bucket_bytes, overlap=overlap_grads,
                     grad_dtype=torch.float32, shard=zero)
            for c in self.chunks
        ]  # fmt: skip
        self.main = MainParams(
            [(s, list(c.parameters())) for s, c in zip(self.grad_syncs, self.chunks, strict=True)],
            adopt=adopt,
        )  # fmt: skip
        """The optimizer's fp32 main parameters (trainer/optim.py): the model's own in an
        fp32 run without ``parallel.zero``."""
        self.optimizer = build_optimizer(self.main.tensors, lr=t.lr, weight_decay=t.weight_decay)
        if adopt is not None:
            self._adopt_optimizer_state(adopt)
        self.adopted_bytes = adopt.taken_bytes if adopt is not None else 0
        """Bytes of state taken from a previous trainer rather than allocated."""
        self.state = TrainState()
        self.pending_norm: float | None = None
        """Set from the global norm of step ``state.step + 1`` until its update: the
        gradients are reduced and this is their norm. A fault in the collectives after the
        norm (the peak memory, the loss), which a peer may have completed and so applied the
        step, leaves it set; in-process recovery then completes the step with
        :meth:`complete_pending` (trainer/recovery.py)."""
        self.nonfinite_steps = 0
        """Steps in a row whose gradient norm was not finite (their updates skipped)."""
        self._batch: list[tuple[torch.Tensor, torch.Tensor]] = []
        self._losses: list[torch.Tensor] = []

    # -- identity, for checkpoints -------------------------------------------------------

    def named_parameters(self) -> Iterator[tuple[str, nn.Parameter]]:
        """``(global name, local shard)`` for every model parameter this rank holds."""
        for q in self.params:
            yield q.shard_info.name, q

    def adoption(self) -> Adoption:
        """What a next round's trainer may take of this one (``Trainer(adopt=...)``): every
        model parameter, fp32 main parameter and AdamW state tensor, by global region. Call
        it on a trainer that will not train again."""
        pool = Adoption()
        for q in self.params:
            pool.offer("model", q.shard_info, q)
        for _, t, info in self.named_main():
            pool.offer("main", info, t)
            for kind, value in self.optimizer.state.get(t, {}).items():
                if isinstance(value, torch.Tensor):
                    pool.offer(kind, info, value)
        return pool

    def _adopt_optimizer_state(self, adopt: Adoption) -> None:
        """AdamW's state of each main parameter from ``adopt``, where all of it is there
        for the same box (else it is made at the first step, or by the recovery)."""
        for _, t, info in self.named_main():
            wanted = {"step": ((), None), "exp_avg": (tuple(t.shape), t.device),
                      "exp_avg_sq": (tuple(t.shape), t.device)}  # fmt: skip
            if all(adopt.take(kind, info, shape=shape, dtype=torch.float32, device=device,
                              peek=True) is not None
                   for kind, (shape, device) in wanted.items()):  # fmt: skip
                self.optimizer.state[t] = {
                    kind: adopt.take(kind, info, shape=shape, dtype=torch.float32, device=device)
                    for kind, (shape, device) in wanted.items()
                }

    def release_gradients(self) -> None:
        """Let go of the gradient buckets (a trainer kept only as the state a recovery
        offers: its next step, if any, is a new round's trainer's)."""
        for sync in self.grad_syncs:
            sync.release()
        for q in self.params:
            q.grad = None
        for t in self.main.all_tensors():  # empty shards too: their grad views a bucket
            t.grad = None

    def named_main(self) -> Iterator[tuple[str, nn.Parameter, ShardInfo]]:
        """``(global name, main tensor, its box)`` for every fp32 main parameter (or rows of
        one, with ``parallel.zero``) this rank holds: what checkpoints save and in-process
        recovery hands over. After writing into them, call :meth:`main_to_model`."""
        yield from self.main.named()

    def main_to_model(self) -> None:
        """Copy the main parameters into the model (after a load or a recovery wrote
        them; collective over the data-parallel groups with ``parallel.zero``)."""
        self.main.to_model()
        self.initialized = True

    def initialize(self) -> None:
        """Draw the initial parameters a trainer built with ``init=False`` left out (a
        start with nothing to load); a no-op once the state holds something."""
        if self.initialized:
            return
        draw_into(self.params)
        self.main.from_model()
        # A fresh start: AdamW's state too, which a failed transfer may have written into;
        # in place, as the same tensors are what recovery and checkpoints name.
        with torch.no_grad():
            for state in self.optimizer.state.values():
                for value in state.values():
                    if isinstance(value, torch.Tensor):
                        value.zero_()
        self.initialized = True

    # -- one step, in pieces -----------------------------------------------------------------

    def begin_step(self) -> float:
        """Zero the gradients, set and return this step's lr, and read its micro-batches."""
        if not self.initialized:  # a bug, never a user's error: it would train on zeros
            raise RuntimeError("a trainer built with init=False trained before its state was "
                               "loaded, received or initialised")  # fmt: skip
        self._losses = []
        for sync in self.grad_syncs:
            sync.zero()
        t = self.job.train
        lr = lr_at(self.state.step, lr=t.lr, warmup=t.warmup, schedule=t.lr_schedule,
                   min_lr=t.min_lr, steps=t.steps)  # fmt: skip
        set_lr(self.optimizer, lr)
        if self.rng is not None:
            self.rng.begin_step(self.state.step)
        self._batch = [
            (self._to_device(x), self._to_device(y))
            for x, y in micro_batches(self.source, self.batches, self.state.consumed_samples)
        ]
        return lr

    def _to_device(self, t: torch.Tensor) -> torch.Tensor:
        """A micro-batch's tokens on the device. On CUDA through pinned memory and without
        waiting: a copy from pageable memory synchronises the stream, so the host would
        wait for the previous step's optimizer kernels before it could queue this step's
        forward (torch's pinned allocator keeps the block until the copy is done)."""
        if self.device.type != "cuda":
            return t.to(self.device)
        return t.pin_memory().to(self.device, non_blocking=True)

    def chunk_forward(
        self, chunk: int, microbatch: int, inputs: torch.Tensor | None
    ) -> torch.Tensor:
        """Forward of one chunk on one micro-batch. The last chunk returns the scalar loss
        to back-propagate, the micro-batch's mean token loss over grad_accum, and records it
        for the step's report. (MoE aux losses flow back through the MoE outputs.)"""
        c = self.chunks[chunk]
        x, y = self._batch[microbatch]
        out = c(x if inputs is None else inputs, y if c.last else None)
        if not c.last:
            return out
        loss = out.float().mean() / self.batches.grad_accum
        self._losses.append(loss.detach())
        return loss

    def forward_backward(self) -> None:
        """All micro-batches of the step (pp = 1), or this stage's part of the pipeline."""
        if self.pipeline is not None:
            m, t, p = self.job.model, self.job.train, self.layout.parallel
            self.pipeline.run(
                microbatches=len(self._batch),
                shape=(t.micro_batch, m.seq_len // (p.tp if self.ctx.sp else 1), m.hidden),
                dtype=DTYPES[t.dtype],
                device=self.device,
                forward=self.chunk_forward,
                before_backward=self._before_backward,
            )
            return
        sync = self.grad_syncs[0]
        for m in range(len(self._batch)):
            sync.set_sync(m == len(self._batch) - 1)
            loss = self.chunk_forward(0, m, None)
            if m == 0:
                self._phase("backward")
            loss.backward()

    def _before_backward(self, chunk: int, last: bool) -> None:
        if not self._backward_seen:
            self._backward_seen = True
            self._phase("backward")
        self.grad_syncs[chunk].set_sync(last)

    def _phase(self, name: str, step: int | None = None) -> None:
        """``on_phase`` for phase ``name`` of the step in progress (or ``step``)."""
        if self.on_phase is not None:
            self.on_phase(name, self.state.step + 1 if step is None else step)

    def local_loss(self) -> torch.Tensor:
        """This rank's mean loss over its share of the step (meaningful on the last chunk's
        ranks; a pipeline must bring it to rank 0)."""
        if not self._losses:
            return torch.zeros((), device=self.device)
        return torch.stack(self._losses).sum()

    def finish_step(self, *, lr: float, started: float) -> StepResult:
        """Wait for the gradient reductions, clip by the global norm, step AdamW, and
        advance the state."""
        for sync in self.grad_syncs:
            sync.finish()
        self.main.bind_grads()
        sync_sequence_parallel_grads([self.main.grad_of(q) for q in self._sp_params], self.ctx.tp)
        if self.pipeline is not None:
            tied = self.pipeline.tied_params(self.params, name=self._tied_name)
            sync_tied_grads([self.main.grad_of(q) for q in tied], group=self.pipeline.embedding)
        norm = self.main.grad_norm(groups=self.model_groups)
        # An NCCL collective aborted by the round's end returns garbage, not an error: the
        # norm (read back from the device) is trusted only if the round had not ended. On
        # gloo it is: kept (pending_norm) before this rank leaves at the check below, so
        # that a recovery can still complete this step with it.
        check_results(gloo=False)
        # From here this rank holds all its update needs: a fault in the collectives below
        # (a peer that completed them applies the step) leaves it for recovery to complete.
        self.pending_norm = norm
        mem = self._peak_memory()  # read with the loss below: one host synchronisation
        # Every collective of the step but the ZeRO-1 all-gather comes before the optimizer
        # step: a rank that applied it has nothing left to wait for, so a fault leaves each
        # rank's main parameters wholly at step s or s+1 (in-process recovery picks a step
        # every region is held at, and rebuilds the model from the main parameters).
        loss = self.local_loss()
        if self.ctx.dp_cp.active:
            comm.all_reduce(loss, self.ctx.dp_cp.group)
            loss /= self.ctx.dp_cp.size
        if self.pipeline is not None:
            loss = self.pipeline.share_loss(loss)
        loss_value = float(loss)
        mem_gb = float(mem)  # its all-reduce ran before the loss's: no second wait
        check_results()  # the loss and the peak memory, as the norm above
        # Every collective before the update is done (the ZeRO-1 all-gather comes after).
        self._phase("update")
        self._update(norm)
        done = {"loss": loss_value, "norm": norm, "lr": lr, "started": started, "mem_gb": mem_gb,
                "skipped": not math.isfinite(norm)}  # fmt: skip
        if self.on_updated is not None:
            self.on_updated(self._result(**done))
        self.main.to_model()  # the step is counted first: recovery reads the main params
        return self._result(**done)

    def _result(
        self,
        *,
        loss: float,
        norm: float,
        lr: float,
        started: float,
        mem_gb: float,
        skipped: bool = False,
    ) -> StepResult:
        step_s = time.perf_counter() - started
        tokens = self.job.train.global_batch * self.job.model.seq_len
        used = mfu(flops=self._flops_per_step, seconds=step_s, ranks=self.layout.active,
                   peak=self._peak_flops)  # fmt: skip
        return StepResult(step=self.state.step, loss=loss, grad_norm=norm, lr=lr,
                          step_s=step_s, tokens_per_s=tokens / step_s, mfu=used,
                          mem_gb=mem_gb, skipped=skipped)  # fmt: skip

    def _update(self, norm: float) -> None:
        """Clip, step AdamW and count the step (no collective). A norm that is not finite
        (the same on every rank: it is all-reduced) skips the update on every rank alike;
        :data:`NONFINITE_LIMIT` such steps in a row raise :class:`DivergedError`."""
        if self.checkpointing is not None:  # the last save's snapshot may still be copying
            self.checkpointing.wait_snapshot()
        replicator = self.replicator() if self.replicator is not None else None
        if replicator is not None:  # so may the last in-memory replica's (CUDA)
            replicator.wait_copied()
        step = self.state.step + 1
        if math.isfinite(norm):
            self.main.clip(norm=norm, max_norm=self.job.train.grad_clip)
            self.optimizer.step()
            self.nonfinite_steps = 0
        else:
            self.nonfinite_steps += 1
            if self.nonfinite_steps >= NONFINITE_LIMIT:
                first = step - self.nonfinite_steps + 1
                raise DivergedError(
                    f"training diverged: the gradient norm was {norm} at {self.nonfinite_steps} "
                    f"steps in a row (steps {first} to {step}); their updates were skipped and "
                    "the parameters are those of the last finite step (lower train.lr, or "
                    "resume from an earlier checkpoint)"
                )
            log.warning(
                "step %d: the gradient norm is %s; its update is skipped (%d of %d in a row "
                "allowed)", step, norm, self.nonfinite_steps, NONFINITE_LIMIT - 1,
            )  # fmt: skip
        self.state.step += 1
        self.state.consumed_samples += self.job.train.global_batch
        self.pending_norm = None

    def complete_pending(self, step: int) -> bool:
        """Apply step ``step``'s update if this rank stopped between that step's
        gradient norm and its update (``pending_norm`` set, ``state.step`` one behind): its
        reduced gradients and their norm are all the update needs, so the main parameters
        and AdamW state become exactly those of a rank that applied it. Returns whether it
        did. The model (bf16, or rows all-gathered under ZeRO-1) is not refreshed: recovery
        rebuilds a new round's model from the main parameters."""
        norm = self.pending_norm
        if norm is None or self.state.step != step - 1:
            return False
        self._update(norm)
        return True

    def _peak_memory(self) -> torch.Tensor:
        """The largest peak memory of any active rank so far, in GiB (a MAX over the model
        groups, which together span every active rank, as the gradient norm's sum does),
        as a one-element tensor on the device. The caller reads it after the loss: on
        NCCL a read here would be one more host synchronisation per step, while the loss's
        read, which follows, waits for this all-reduce anyway (queued before the loss's).
        Not moved to a gloo group: the value is read on the host in the step either way,
        and a CPU all-reduce over every active rank costs TCP round trips where this one
        costs a small NCCL collective between kernels already queued."""
        mem = torch.tensor([peak_memory_gib(self.device)], device=self.device)
        for slot in self.model_groups:
            if slot.active:
                comm.all_reduce(mem, slot.group, op=dist.ReduceOp.MAX)
        return mem

    def train_step(self) -> StepResult:
        started = time.perf_counter()
        lr = self.begin_step()
        self._backward_seen = False
        self._phase("forward")
        self.forward_backward()
        self._phase("optimizer")
        return self.finish_step(lr=lr, started=started)

    # -- the loop ------------------------------------------------------------------------------

    def run(
        self,
        *,
        metrics: MetricsWriter | None = None,
        progress: Callable[[StepResult], None] | None = None,
        preempt: Callable[[object], bool] | None = None,
        checkpoint_group: dist.ProcessGroup | None = None,
        control_group: dist.ProcessGroup | None = None,
        on_resumed: Callable[[], None] | None = None,
        restore: Callable[[object], None] | None = None,
        after_step: Callable[[StepResult], None] | None = None,
    ) -> list[StepResult]:
        """Train until ``train.steps`` steps are complete, resuming from the latest committed
        checkpoint when there is one (unless ``checkpoint.resume`` is false) and saving every
        ``checkpoint.every`` steps and after the last.

        ``preempt(group)`` (``elasticd.worker.WorkerChannel.preempt_agreed``) is asked after
        every step; when any active rank was told to stop, the step just done is saved and
        committed and the loop ends early with ``self.preempted`` set.

        ``checkpoint_group`` and ``control_group`` (``ProcessGroups.side(...)``): gloo groups
        over the active ranks for the checkpoint store and for the flags. ``on_resumed()`` is
        called once the checkpoint is loaded (the agent times recovery parts with it).
        ``restore(ckpt)`` replaces the resume (in-process recovery: from the survivors'
        memory, falling back to ``ckpt.resume()``). ``after_step(result)`` runs after
        each step's checkpoint and metrics."""
        from trainer.checkpointing import Checkpointing

        ckpt = Checkpointing.create(self, group=checkpoint_group)
        self.checkpointing = ckpt
        try:
            if restore is not None:
                restore(ckpt)
            else:
                ckpt.resume()
        except BaseException:
            # A refused resume frees the directory too (a process running another job
            # or round after it, a test, an in-process round, found it still claimed by
            # itself).
            ckpt.abandon()
            raise
        if on_resumed is not None:
            on_resumed()
        flag_group = control_group
        if preempt is not None and flag_group is None and dist.is_initialized():
            # A group of its own: the async saver's thread talks on ckpt.group, and two
            # threads on one gloo group interleave their collectives and deadlock.
            active = list(range(self.layout.active))
            flag_group = dist.new_group(active, backend="gloo", use_local_synchronization=True)
        results = []
        try:
            while self.state.step < self.job.train.steps:
                result = self.train_step()
                self._phase("step-end", self.state.step)
                if metrics is not None:  # before the save: a fault in it keeps the record
                    metrics.write(result)
                if progress is not None:
                    # The heartbeat too: the agent counts the steps a fault lost from the
                    # last one it saw, and a fault in the save lost this step as well.
                    progress(result)
                every, step = self.job.checkpoint.every, self.state.step
                if (every and step % every == 0) or step == self.job.train.steps:
                    self._phase("checkpoint-save", step)
                ckpt.after_step()
                if progress is not None:
                    # Again, with what after_step committed: this step's synchronous save,
                    # or an earlier asynchronous one it finalised.
                    progress(result)
                if after_step is not None:
                    after_step(result)
                results.append(result)
                if preempt is not None and preempt(flag_group):
                    self.preempted = True  # an emergency checkpoint: finish() commits it
                    break
            ckpt.finish()
        except BaseException:
            ckpt.abandon()
            raise
        return results

    def close(self) -> None:
        for sync in self.grad_syncs:
            sync.close()
        # The checkpointing refers back to the trainer: without this cycle, the round's
        # model, optimizer and process groups (gloo's threads and sockets) go as soon as
        # the round lets go of the trainer, not at a later full collection (in-process
        # restart keeps the process for the next round).
        self.checkpointing = None


class MetricsWriter:
    """Appends one record per step to ``metrics.jsonl`` and prints a readable line (rank 0)."""

    def __init__(
        self,
        *,
        path: str,
        layout: Layout,
        round_: int,
        total_steps: int,
        echo: Callable[[str], None] | None = print,
        once: bool = False,
        current: Callable[[], str | None] | None = None,
    ) -> None:
        """``once``: write each step at most once (in-process restart: a step trained again
        after a fault, when some ranks had not completed it, keeps its first record).
        ``current``: asked before each write whether this round is still the job's; it
        returns None if so, else why not (the checkpoint fence names a newer round). A
        rank 0 frozen in a step and thawed after the world moved on (a SIGSTOPped node)
        then writes nothing: its record would follow the newer round's, and a step the
        newer round trained again would appear twice."""
        self.path, self.layout, self.round, self.total = path, layout, round_, total_steps
        self.echo = echo
        self.current = current
        self.stale: str | None = None
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        self.written = last_step_in(path) if once else None

    def record(self, r: StepResult) -> dict:
        return step_record(r, self.layout, self.round)

    def write(self, r: StepResult) -> None:
        self._append(self.record(r))

    def fill(self, records: list[dict], *, upto: int) -> list[int]:
        """In-process restart: write the records of steps up to ``upto`` (the step the
        world resumed after) that this file lacks, from ``records`` (other ranks' copies;
        every active rank computes the same loss, norm and lr). A rank 0 that died after a
        step's last collective but before writing its record leaves such a step: its peers
        hold the step, so it is not trained again. Returns the steps written."""
        if self.written is None:
            return []
        done = []
        for rec in sorted(records, key=lambda r: int(r["step"])):
            if self.written < int(rec["step"]) <= upto:
                self._append(dict(rec), note="  (the record of a peer)")
                done.append(int(rec["step"]))
        return done

    def _append(self, rec: dict, note: str = "") -> None:
        step = int(rec["step"])
        if self.written is not None and step <= self.written:
            return
        if self.stale is None and self.current is not None:
            self.stale = self.current()
            if self.stale is not None and self.echo is not None:
                self.echo(f"step {step}'s record not written: {self.stale}")
        if self.stale is not None:
            return
        if self.written is not None:
            self.written = step
        with open(self.path, "a", encoding="utf-8") as fh:
            fh.write(json.dumps(rec, separators=(",", ":")) + "\n")
        if self.echo is not None:
            mfu_ = rec.get("mfu")
            self.echo(
                f"step {step}/{self.total}  loss {rec['loss']:.4f}  "
                f"grad_norm {rec['grad_norm']:.4f}  lr {rec['lr']:.2e}  "
                f"{rec['step_s'] * 1000:.0f} ms  {rec['tokens_per_s']:,.0f} tokens/s  "
                f"{rec['mem_gb']:.2f} GiB"
                + ("" if mfu_ is None else f"  MFU {mfu_:.1%}")
                + ("  (update skipped: gradient norm not finite)" if rec.get("skipped") else "")
                + note
            )


def step_record(r: StepResult, layout: Layout, round_: int) -> dict:
    """A metrics.jsonl record: the step's result and the layout and round it ran in."""
    p = layout.parallel
    rec = asdict(r)
    rec.update(world=layout.world, dp=layout.dp, tp=p.tp, pp=p.pp, vpp=p.vpp, ep=p.ep,
               round=round_)  # fmt: skip
    return rec


def last_step_in(path: str, tail: int = 65536) -> int:
    """The highest ``step`` among the last records of a metrics.jsonl (0 if none)."""
    try:
        with open(path, "rb") as fh:
            fh.seek(0, os.SEEK_END)
            fh.seek(max(0, fh.tell() - tail))
            lines = fh.read().decode(errors="replace").splitlines()
    except OSError:
        return 0
    best = 0
    for line in lines[-64:]:
        try:
            best = max(best, int(json.loads(line)["step"]))
        except (ValueError, KeyError, TypeError):
            continue  # the first line of the tail may be cut
    return best
