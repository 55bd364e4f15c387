"""In-process recovery of the built-in trainer: fill a new round's Trainer from the
survivors' memory, else from the latest committed checkpoint (docs/inprocess.md).

Every rank of the new world calls :func:`agree`, then (once its trainer is built)
:func:`recover` at the start of a round, active or spare, survivor or newcomer, in the
same order:

1. :func:`agree`, before the trainer is built: an all-reduce (MAX) of the newest step any
   rank holds in memory; -1 means nobody holds anything (the first round, or only
   newcomers): resume from the checkpoint as a fresh process would. A rank that holds the
   newest step builds its new trainer adopting the previous one's memory where a box
   stays (:func:`adoption`, ``trainer.init.Adoption``): one copy of the state, not two;
2. otherwise ``checkpoint.live.recover_from_peers``: every parameter and AdamW tensor is
   named globally by its ShardInfo, exactly as in checkpoints; the live planner picks, for
   each region the new layout needs, a rank that holds it at one agreed step, and the
   bytes go rank to rank, CRC-checked. Survivors may differ by one step (a fault between
   two ranks' optimizer steps): a rank one behind that stopped after the step's gradient
   norm (in a later collective of the step, or before its update) completes the update
   first (``Trainer.complete_pending``: it holds the reduced gradients and their norm),
   so it holds the newest step too; otherwise the newest step every region is held at
   wins;
   Beside its live tensors a rank offers what ``checkpoint.memory_replicas`` kept
   (:mod:`trainer.replicas`): a snapshot of its own state and the replicas of other nodes'
   ranks, at the last replicated step; a TP or PP shard with no DP replica that died with
   its node comes from there (``source`` replica, the steps since that step lost);
3. when no step covers every region (a shard whose node died, with no replica), or a
   transfer fails its check, every rank falls back to the checkpoint;
4. an all-gather of the metrics records each rank kept of its last steps
   (``ctx.state['records']``): resumed from the survivors' memory at step S, rank 0 writes
   the records up to S its metrics.jsonl lacks (a rank 0 that died after a step's last
   collective, before writing its record, left a step nobody trains again).

The replication of the new round starts once its state is restored.

The outcome (``source``: peers, replica, checkpoint or none; ``resume_step``; ``lost_steps``, the
newest step held anywhere minus the step resumed at) goes to the agent through the
heartbeat, and ``state_loaded`` marks the end of the state transfer.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from trainer.parallel import comm

log = logging.getLogger("trainer.recovery")


def holdings(trainer: Any, *, create: bool) -> dict[str, tuple[torch.Tensor, Any]]:
    """A trainer's fp32 main parameters and AdamW tensors by global name (as checkpoints
    name them). Not the bf16 model: it is rebuilt from the main parameters. With
    ``parallel.zero: 1`` each rank holds only its rows of these, so a dead data-parallel
    rank's rows have no live holder and recovery falls to the replicas or the checkpoint."""
    from trainer.checkpointing import model_tensors, optimizer_tensors

    return {**model_tensors(trainer), **optimizer_tensors(trainer, create=create)}


ADOPT_ENV = "ELASTICD_ADOPT"
"""Set to ``0`` in a worker's environment, a new round's trainer allocates all of its state
instead of adopting the previous round's (the baseline of ``bench/recovery.py``'s memory
figures; a way out should adoption ever be at fault)."""


@dataclass(frozen=True)
class Agreed:
    """What every rank of a new world agreed on before building anything (:func:`agree`)."""

    newest: int
    """The newest step any rank holds in memory; -1 when nobody holds anything."""
    group: Any
    """The group the state moves over (``elasticd.inprocess.transfer_group``)."""


def agree(ctx: Any) -> Agreed:
    """The first collective of an in-process round, on every rank of the new world, active
    or spare, before its trainer is built: an all-reduce (MAX) of the newest step any rank
    holds. A rank one step behind that stopped after the step's gradient norm completes
    the step's update now (``Trainer.complete_pending``). The previous trainer is then only
    the state this rank offers, so its gradient buckets go (unless a pending update still
    needs them), before the new trainer allocates its own."""
    from elasticd.inprocess import transfer_group

    old = ctx.state.get("trainer")
    group = transfer_group()  # on NCCL a new gloo group: made here, in the same order everywhere
    newest_t = torch.tensor([-1 if old is None else old.state.step], dtype=torch.int64)
    if dist.is_initialized():
        comm.all_reduce(newest_t, group, op=dist.ReduceOp.MAX)
    newest = int(newest_t)
    if newest >= 0:
        # A recovery: from here until state_loaded the agent judges this rank by
        # restart.hang_timeout (elasticd.agent.workers.recovering), every rank of the world
        # from this same collective; one stopped in its set-up or the transfer is killed,
        # not waited on for the group's 10-minute timeout.
        ctx.channel.mark("recovering")
    if old is not None and old.complete_pending(newest):
        print(f"rank {ctx.rank}: in-process recovery: completed step {newest}'s update "
              "(the fault stopped this rank after its gradient norm)", flush=True)  # fmt: skip
    if old is not None and old.pending_norm is None:
        old.release_gradients()
    return Agreed(newest=newest, group=group)


def adoption(ctx: Any, agreed: Agreed, env: Any = None) -> Any:
    """What the new round's trainer may take of the previous one's memory
    (``Trainer(adopt=...)``), or None: only when the previous trainer holds the newest
    step, whose state the recovery will keep where the boxes stay (a data-parallel
    shrink, a spare turned active elsewhere). A rank behind, or one whose boxes all
    change, allocates as before."""
    import os

    old = ctx.state.get("trainer")
    env = os.environ if env is None else env
    if old is None or old.state.step != agreed.newest or env.get(ADOPT_ENV, "1") == "0":
        return None
    return old.adoption()


def recover(ctx: Any, trainer: Any, ckpt: Any, *, channel: Any, job: Any, agreed: Agreed) -> str:
    """Restore ``trainer`` (None on a spare rank, which only serves what it holds) for
    this round; returns the source. ``agreed``: this round's :func:`agree`.
    ``ctx.state['trainer']`` is the previous round's trainer of this process, if any; it
    is replaced by ``trainer`` once restored, and ``ctx.state['replicator']`` by this
    round's (``job.checkpoint.memory_replicas``). If this round fails before that, both
    stay for the next one, except a previous trainer whose memory ``trainer`` adopted and
    that is about to be written (a step other than its own, or a fall back to the
    checkpoint): it goes first, so that no later round offers its tensors under a step
    they no longer hold."""
    from checkpoint.live import recover_from_peers
    from trainer.checkpointing import reseed_value

    old = ctx.state.get("trainer")
    group, newest = agreed.group, agreed.newest
    adopted = trainer is not None and trainer.adopted_bytes > 0
    have_step = old.state.step if old is not None else None

    def before_write(step: int) -> None:
        # Every rank has arrived and the plan is made: the hang bound counts from here.
        channel.mark("recovering")
        # Adopted tensors are written only at a step other than the old trainer's own (a
        # region held at its step is the same memory, never copied): it is not offered again.
        if adopted and step != have_step:
            _drop_previous(ctx)

    old_replicas = ctx.state.get("replicator")
    extra = old_replicas.held() if old_replicas is not None else []
    have = holdings(old, create=True) if old is not None else None
    need = holdings(trainer, create=True) if trainer is not None else {}
    # This rank's state size before and after, for the pinned-cache release (CUDA only).
    sizes = (
        (state_bytes(have) if have is not None else None, state_bytes(need))
        if torch.cuda.is_available()
        else (None, 0)
    )
    source = "none"
    result = None
    if newest >= 0:
        channel.mark("recovering")  # the set-up done (agree marked it first)
        # A fault planned for the recovery fires here (elasticd/faultplan.py): a second
        # fault while the state is about to move.
        channel.phase("recover", newest)
        result = recover_from_peers(
            have=have, have_step=have_step,
            have_consumed=old.state.consumed_samples if old is not None else None,
            need=need, group=group, extra=extra, before_write=before_write,
        )  # fmt: skip
    del old_replicas, extra
    if newest >= 0 and dist.is_initialized():  # the same on every rank (all-reduced)
        ctx.state["peer_records"] = _gather_records(ctx, group)
    if (
        result is not None
        and result.sources.get("from_extra")
        and _checkpoint_is_newer(job, result.step, group, key=getattr(ckpt, "key", None))
    ):
        if ctx.rank == 0:
            print(f"in-process recovery: the replicas hold step {result.step}, the latest "
                  "checkpoint a newer one; resuming from the checkpoint", flush=True)  # fmt: skip
        result = None
    # Its snapshots carry over only on the timeline they were taken on: state from memory.
    # After a fall back to the checkpoint they hold steps this round trains again.
    replicator = _start_replication(ctx, trainer, job=job, group=group,
                                    carry=result is not None)  # fmt: skip
    if trainer is None:  # a spare: it served its part
        ctx.state.pop("trainer", None)
        ctx.state.pop("peer_records", None)
        ctx.state["replicator"] = replicator  # the old copies go now
        release_stale_pinned(*sizes)
        if newest >= 0:
            channel.mark("state_loaded")  # no longer recovering: a spare idles now
        return "peers" if result is not None else "none"
    if result is not None:
        source = "replica" if result.sources.get("from_extra") else "peers"
        trainer.state.step = result.step
        trainer.state.consumed_samples = result.consumed_samples
        trainer.main_to_model()  # the fp32 main parameters came; the model follows
        torch.manual_seed(
            reseed_value(trainer.job.train.seed, result.step, trainer.batches.dp_rank)
        )
        ckpt.last_saved = None
        if ctx.rank == 0:
            print(f"recovered in-process from {source} at step {result.step} "
                  f"({result.bytes_in / 1e6:.1f} MB received, {result.bytes_local / 1e6:.1f} MB "
                  f"local, {result.seconds:.3f} s; {trainer.adopted_bytes / 1e6:.1f} MB of the "
                  "previous round's memory kept)", flush=True)  # fmt: skip
    else:
        if newest >= 0 and ctx.rank == 0:
            print("in-process recovery: the survivors' memory does not cover the new layout "
                  "(or a transfer failed its check); resuming from the latest checkpoint",
                  flush=True)  # fmt: skip
        if adopted:  # the load (or the draws) writes into the previous trainer's memory
            _drop_previous(ctx)
        # A checkpoint load is not judged by hang_timeout (nor is a process restart's):
        # it may take longer, and it waits on the filesystem, not on a peer.
        channel.mark("ckpt_loading")
        if ckpt.resume():
            source = "checkpoint"
    if source not in ("peers", "replica"):  # steps after a checkpoint are trained again
        ctx.state.pop("peer_records", None)
    step = trainer.state.step
    lost = max(0, newest - step) if newest >= 0 else 0
    channel.recovered(source=source, resume_step=step, lost_steps=lost)
    channel.mark("state_loaded")
    ctx.state["trainer"] = trainer  # the old one (and its memory) goes
    ctx.state["replicator"] = replicator  # and the old copies
    release_stale_pinned(*sizes)
    return source


def state_bytes(holding: Any) -> int:
    """Bytes of a rank's state (:func:`holdings`)."""
    return sum(t.numel() * t.element_size() for t, _info in holding.values())


def pinned_cache_is_stale(before: int | None, after: int) -> bool:
    """Whether the pinned host buffers sized by this rank's state in the previous round
    (``before`` bytes; None: no previous state) are of no use to this round (``after``
    bytes): the state's size changed (a new layout, ZeRO-1 rows over another data-parallel
    size, a spare now). At the same size the next round asks for the same buffers again
    (its save staging, and its snapshots when not carried over), which torch's host
    allocator hands back from its cache."""
    return before is not None and before != after


def release_stale_pinned(before: int | None, after: int) -> bool:
    """After a recovery on CUDA whose state changed size (:func:`pinned_cache_is_stale`):
    return the pinned host memory torch's caching host allocator keeps for freed blocks to
    the system. That allocator rounds every pinned request up to a power of two and never
    frees a block by itself (``ATen/core/CachingHostAllocator.h``: ``allocate`` rounds with
    ``PowerOf2Ceil``, ``free`` puts the block back on its size's free list; only
    ``empty_cache`` frees them), so the previous world's snapshots, save staging and
    transfer buffers would stay pinned beside this world's for the life of the process.
    Blocks still in use, or with copies pending, are kept. Returns whether it released."""
    if not pinned_cache_is_stale(before, after) or not torch.cuda.is_available():
        return False
    # An older torch (TORCH_VERSION may pick one) may lack torch.accelerator's
    # empty_host_cache: its cache then stays as it is.
    empty = getattr(getattr(torch, "accelerator", None), "empty_host_cache", None)
    if empty is None:
        return False
    empty()
    return True


def _drop_previous(ctx: Any) -> None:
    """The previous trainer is never offered again: out of ``ctx.state``, and out of the
    previous replicator's reach (whose ``live`` held it; that replicator now only serves
    the copies it holds, and a second fault before this round's replaces it must not keep
    the old trainer's memory beside a new trainer's)."""
    ctx.state.pop("trainer", None)
    rep = ctx.state.get("replicator")
    if rep is not None:
        rep.live = None


RECORDS_KEPT = 16
"""Metrics records of its last steps each rank keeps for a rank 0 that missed one."""


def keep_record(ctx: Any, record: dict) -> None:
    """Keep ``record`` (a metrics.jsonl record of a step this rank completed) among the
    last RECORDS_KEPT (in-process restart); it replaces one kept of the same step."""
    kept = ctx.state.setdefault("records", [])
    if kept and kept[-1]["step"] == record["step"]:
        kept.pop()
    kept.append(record)
    del kept[:-RECORDS_KEPT]


def _gather_records(ctx: Any, group: Any) -> list[dict]:
    """Every rank's kept records (one small all-gather), one per step."""
    from checkpoint.comm import all_gather_json_small

    mine = ctx.state.get("records", [])
    by_step: dict[int, dict] = {}
    for records in all_gather_json_small(mine, group, cap=RECORDS_KEPT * 1024)():
        for rec in records or []:
            by_step.setdefault(int(rec["step"]), rec)
    return [by_step[s] for s in sorted(by_step)]


def _checkpoint_is_newer(job: Any, step: int, group: Any, key: bytes | None = None) -> bool:
    """Whether every rank sees a committed checkpoint newer than ``step`` (collective: all
    ranks agree, or none moves): with ``memory_every`` above ``checkpoint.every`` the last
    replicated step can be older than the last checkpoint. Never with ``checkpoint.resume:
    false``: the resume would load nothing, and the run would start over (the same on every
    rank: it is the job's). With the job's seal ``key``, the step a resume would load
    (:func:`_sealed_step_to_resume`: a planted step, another job's, one that failed to
    load or whose files do not match its sealed manifest, or a `latest` hint, does not
    turn the replicas' step down for an older one)."""
    from elasticd.agent.policy import latest_checkpoint_step

    if not job.checkpoint.resume:
        return False
    if key is not None:
        on_disk = _sealed_step_to_resume(job.ckpt_dir, key, job.name)
    else:
        on_disk = latest_checkpoint_step(job.ckpt_dir)
    newer = torch.tensor([1 if on_disk is not None and on_disk > step else 0], dtype=torch.int32)
    if dist.is_initialized():
        comm.all_reduce(newer, group, op=dist.ReduceOp.MIN)
    return bool(newer.item())


def _sealed_step_to_resume(ckpt_dir: str, key: bytes, job_name: str) -> int | None:
    """The newest step a sealed job's resume would load, as far as can be told without
    reading tensor data: the first in the load order (:func:`checkpoint.store.load_order`
    with the key and the job) that is sealed with the key for this job, is not recorded
    as unloadable (a load fell back from it: its blocks or files are damaged), and whose
    manifest, seal and tensor files' headers check out (``CheckpointFiles.check_files``:
    the headers hold every block's CRC and MAC, and their sha256 is in the sealed
    manifest). None when there is none.

    The blocks themselves are not read. A full verify reads every byte of the step, on
    the recovery's critical path, only to choose between two sources: as much as the load
    it would precede, and the cost the in-memory replicas exist to avoid (the headers are
    about 0.15% of the data). A step whose blocks alone were changed in place is found by
    the load that reads them, which falls back and records it as unloadable, so from the
    next recovery on it no longer outranks the replicas (that one recovery may resume
    from an older step than the replicas held)."""
    from checkpoint.errors import CheckpointError
    from checkpoint.step import CheckpointFiles
    from checkpoint.store import commit_numbers, failed_steps, lineage, step_path

    # A resume's order (load_order) less the steps recorded as failed, which it tries last.
    numbers = commit_numbers(ckpt_dir, key, job_name)
    current, abandoned = lineage(ckpt_dir, numbers, failed_steps(ckpt_dir, numbers))
    for step in current + abandoned:
        if numbers.get(step, 0) == 0:
            continue  # not sealed for this job: a resume falls back past it
        try:
            with CheckpointFiles.open(step_path(ckpt_dir, step), key=key) as files:
                if files.manifest.job != job_name:
                    continue
                files.check_files()
        except (CheckpointError, OSError) as exc:
            log.info("checkpoint step %d does not count for recovery: %s", step, exc)
            continue
        return step
    return None


def _start_replication(ctx: Any, trainer: Any, *, job: Any, group: Any, carry: bool = False) -> Any:
    """This round's :class:`trainer.replicas.Replicator` (collective over ``group``), or
    None when the job keeps no replicas. ``carry``: it may share the previous round's
    snapshot buffers (``Replicator(previous=...)``)."""
    import socket
    import weakref

    from trainer.replicas import Replicator

    copies = job.checkpoint.memory_replicas
    if not copies or not ctx.inprocess:
        return None
    rep = Replicator(
        live=(lambda: holdings(trainer, create=True)) if trainer is not None else None,
        copies=copies,
        every=job.checkpoint.memory_every,
        node=ctx.env.get("GROUP_RANK") or socket.gethostname(),
        group=group,
        previous=ctx.state.get("replicator") if carry else None,
    )
    if trainer is not None:  # its optimizer step waits for the snapshot's copy (CUDA)
        trainer.replicator = weakref.ref(rep)
    return rep


def replicate(ctx: Any, trainer: Any) -> None:
    """After each optimizer step: refresh the in-memory replicas when due."""
    rep = ctx.state.get("replicator")
    if rep is not None:
        rep.after_step(trainer.state.step, trainer.state.consumed_samples)


def finish_replication(ctx: Any) -> None:
    """At the end of a round that finished: let the last transfers complete."""
    rep = ctx.state.get("replicator")
    if rep is not None:
        rep.close()
