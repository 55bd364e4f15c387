"""``python -m trainer JOB.yaml [--set key.sub=value]...``: the worker entry point.

Runs under ``elasticd agent`` or plain ``torchrun`` (it reads RANK, WORLD_SIZE, LOCAL_RANK,
MASTER_ADDR and MASTER_PORT), or alone as one process. The layout comes from
``elasticd.layout.plan``, or from the JSON file named by ``ELASTICD_LAYOUT`` when the agent
planned it already. Ranks beyond the layout's active ones are spares: they join the process
groups and idle until the others finish. A bad job or data file is one line on stderr and
exit code 2, before training starts. A checkpoint commit refused by the fence (this worker's
round is no longer the job's current one: its node froze and the world moved on) is one
line and exit code 76, ``EXIT_FENCED``: not the user's error, so not 2.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import sys
import time
from collections.abc import Mapping, Sequence
from datetime import timedelta
from typing import NoReturn

EXIT_USER_ERROR = 2
EXIT_FENCED = 76
"""A stale worker: its checkpoint commit was fenced (sysexits' EX_PROTOCOL, next to the
agent's 75 for a preempted worker)."""
EXIT_SAVE_FAILED = 74
"""A checkpoint save that failed (a full disk, an I/O error), or a step a resume could not
read for a reason outside its content (permissions, I/O): one line, sysexits' EX_IOERR.
Nothing committed is lost; the agent counts it as any failure."""
DONE_KEY = "elasticd/trainer/done"


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        print(f"trainer: error: {message}", file=sys.stderr)
        raise SystemExit(EXIT_USER_ERROR)


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = _Parser(prog="python -m trainer", description="The built-in elasticd GPT trainer.")
    p.add_argument("job", help="the job file (job.yaml)")
    p.add_argument(
        "--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
        help="override a job field by dotted path, e.g. --set train.steps=5 (YAML value)",
    )  # fmt: skip
    p.add_argument(
        "--fresh", action="store_true",
        help="start over from step 0 instead of resuming from the job's checkpoints "
        "(same as --set checkpoint.resume=false; the old steps are pruned as they are replaced)",
    )  # fmt: skip
    return p.parse_args(argv)


def main(argv: Sequence[str] | None = None, env: Mapping[str, str] | None = None) -> int:
    # `kill -USR1` prints every thread's stack into this worker's log: a stuck rank is read
    # without stopping it (the local cluster asks every process for it on a timeout). First,
    # before torch's import: a worker still importing must not die of the signal.
    from elasticd.log import dump_stacks_on_sigusr1

    dump_stacks_on_sigusr1()
    from elasticd.errors import ElasticdError
    from elasticd.limits import raise_open_file_limit

    raise_open_file_limit()  # a resume may open every file of a checkpoint of many ranks
    from elasticd.jobspec import load_job
    from elasticd.layout import Layout, plan
    from trainer.errors import DivergedError, TrainerConfigError
    from trainer.train import check_supported

    args = parse_args(argv)
    from elasticd.inprocess import first_round_env
    from trainer.data import open_source

    env = os.environ if env is None else env
    try:
        overrides = [*world_overrides(env), *args.overrides,
                     *(["checkpoint.resume=false"] if args.fresh else [])]  # fmt: skip
        job = load_job(args.job, overrides).with_paths_resolved(os.getcwd())
        open_source(job.data, model_cfg=job.model, seed=job.train.seed)  # fail early
        # A warm worker (started by its agent before the round formed) waits here for it,
        # with its job and data already checked.
        env = first_round_env(env)
        rank, world = int(env.get("RANK", "0")), int(env.get("WORLD_SIZE", "1"))
        if env.get("ELASTICD_LAYOUT"):
            layout = _read_layout(env["ELASTICD_LAYOUT"], Layout)
        else:
            layout = plan(world, job)
        if layout.world != world:
            raise TrainerConfigError(
                f"ELASTICD_LAYOUT: the layout is for {layout.world} ranks, WORLD_SIZE is {world}"
            )
        check_supported(job, layout)
    except (ElasticdError, TrainerConfigError, ValueError) as exc:
        print(f"trainer: error: {exc}", file=sys.stderr)
        return EXIT_USER_ERROR
    from checkpoint.errors import (
        CheckpointReadError,
        CorruptCheckpointError,
        FencedError,
        FormatError,
        LayoutMismatchError,
        SaveFailedError,
        SaveRefusedError,
    )

    try:
        return _run(job=job, layout=layout, rank=rank, world=world, env=env)
    except FencedError as exc:
        # A newer world owns the checkpoint directory; nothing was committed or lost.
        print(f"trainer: error: {exc}", file=sys.stderr)
        return EXIT_FENCED
    except SaveRefusedError as exc:
        # The layout, not the disk: every later save would be refused too (a manifest or
        # header past a bound of every load), so a restart cannot help.
        print(f"trainer: error: {exc}", file=sys.stderr)
        return EXIT_USER_ERROR
    except (SaveFailedError, CheckpointReadError) as exc:
        # The disk, not the job: the steps committed before stay (a step that could not
        # be read is not fallen back past, nor marked); said in one line.
        print(f"trainer: error: {exc}", file=sys.stderr)
        return EXIT_SAVE_FAILED
    except DivergedError as exc:
        # The model's own doing (lr, data): a restart from the same state diverges again.
        print(f"trainer: error: {exc}", file=sys.stderr)
        return EXIT_USER_ERROR
    except (CorruptCheckpointError, FormatError, LayoutMismatchError, TrainerConfigError) as exc:
        # Nothing in the checkpoint directory loads into this model (every rank agreed):
        # a changed model, or every step corrupted. One line names each step and why.
        print(f"trainer: error: {exc}", file=sys.stderr)
        return EXIT_USER_ERROR


def world_overrides(env: Mapping[str, str]) -> list[str]:
    """Under plain torchrun the world is the environment's: ``WORLD_SIZE`` ranks,
    ``LOCAL_WORLD_SIZE`` of them per node. The job's ``nodes`` and ``nproc_per_node`` (the
    shape elasticd gives a job) are set to match, before the user's ``--set``, so that
    ``torchrun --nproc-per-node 2 -m trainer job.yaml --set parallel.tp=2`` is checked
    against a world of 2. Under an agent (``ELASTICD_LAYOUT``) or in a warm worker (its
    world comes later) the job's own shape stands."""
    if "WORLD_SIZE" not in env or env.get("ELASTICD_LAYOUT") or env.get("ELASTICD_WARM_AFTER"):
        return []
    try:
        world = int(env["WORLD_SIZE"])
        local = int(env.get("LOCAL_WORLD_SIZE") or world)
    except ValueError as exc:
        raise ValueError(f"WORLD_SIZE / LOCAL_WORLD_SIZE: not a number: {exc}") from exc
    if world < 1:
        raise ValueError(f"WORLD_SIZE: {world} must be >= 1")
    if local < 1 or world % local:
        local = world  # an uneven world: checked as one node of all its ranks
    nodes = world // local
    return [f"nproc_per_node={local}", f"nodes.min={nodes}", f"nodes.max={nodes}"]


def _read_layout(path: str, layout_cls):
    from trainer.errors import TrainerConfigError

    try:
        with open(path, encoding="utf-8") as fh:
            return layout_cls.from_dict(json.load(fh))
    except (OSError, json.JSONDecodeError) as exc:
        raise TrainerConfigError(f"ELASTICD_LAYOUT: cannot read {path}: {exc}") from exc


def _run(*, job, layout, rank: int, world: int, env: Mapping[str, str]) -> int:
    """Train, one round at a time (``elasticd.inprocess.run``): under an agent with
    ``restart.mode: inprocess`` a fault is recovered in this process; elsewhere there is
    one round."""
    from elasticd.inprocess import local_device
    from elasticd.inprocess import run as run_rounds

    device = local_device(int(env.get("LOCAL_RANK", "0")))
    first = {"layout": layout}

    def one_round(ctx) -> int:
        return _train_round(ctx, job=job, layout=_layout_for(ctx, job, first), device=device)

    return run_rounds(one_round, env=env, timeout=timedelta(minutes=10))


def _layout_for(ctx, job, first: dict):
    """The layout a round trains on. The first round's was checked in main(); later ones
    come from the agent. A round that ended before it trained (a node lost while a
    newcomer opened its first round) leaves main()'s layout for a world that is gone: it
    is used only for a world of its size (a world's layout is planned from its size), and
    is spent either way."""
    this = first.pop("layout", None)
    if this is None or this.world != ctx.world_size:
        this = _round_layout(ctx, job)
    return this


def _round_layout(ctx, job):
    from elasticd.layout import plan
    from trainer.errors import TrainerConfigError
    from trainer.train import check_supported

    layout = ctx.layout or plan(ctx.world_size, job)
    if layout.world != ctx.world_size:
        raise TrainerConfigError(
            f"ELASTICD_LAYOUT: the layout is for {layout.world} ranks, WORLD_SIZE is "
            f"{ctx.world_size}"
        )
    check_supported(job, layout)
    return layout


def _train_round(ctx, *, job, layout, device) -> int:
    import torch
    import torch.distributed as dist

    from elasticd.inprocess import stepped
    from trainer.checkpointing import round_still_current
    from trainer.parallel import comm
    from trainer.parallel.context import ParallelContext, slot_of
    from trainer.parallel.groups import ProcessGroups
    from trainer.parallel.pipeline import PipelineGroups
    from trainer.train import MetricsWriter, Trainer, step_record

    rank, world, env = ctx.rank, ctx.world_size, ctx.env
    channel = ctx.channel
    channel.install_preemption_handler()  # SIGTERM under an agent: save now, then exit
    groups = ProcessGroups.build(layout, rank=rank)
    channel.mark("pg_ready")
    store = dist.distributed_c10d._get_default_store()
    trainer = None
    preempted = False
    left_early = False  # a spare whose own node is preempted
    agreed = None
    try:
        if ctx.inprocess:
            from trainer.recovery import agree

            # Before the trainer is built: it may then adopt the previous round's memory.
            agreed = agree(ctx)
        if groups.is_spare:
            if ctx.inprocess:  # our memory may hold what the active ranks need
                from trainer.recovery import recover

                recover(ctx, None, None, channel=channel, job=job, agreed=agreed)
            print(f"rank {rank}: spare in a world of {world}; idling until the end", flush=True)
            # Poll the store rather than sit in a collective, which would time out.
            while not store.check([DONE_KEY]):
                if channel.preempt_requested():
                    # Our node is going. A spare takes no part in the active ranks'
                    # agreement and they need nothing of it to go on: leave now, not at
                    # restart.grace_period's SIGKILL. The world re-forms without us.
                    left_early = True
                    break
                time.sleep(0.2)
            preempted = left_early or store.get(DONE_KEY) == b"preempted"
        else:
            torch.manual_seed(job.train.seed + groups.index("dp"))
            pctx = ParallelContext.from_groups(groups)
            model_groups = (slot_of(groups, "tp-dp-cp"),)
            # Not drawn (init=False): a resume or a recovery overwrites every parameter, and
            # the draws grow with the model; Checkpointing.resume draws them when nothing
            # is loaded. In-process, what keeps its box is the previous round's memory.
            adopt = None
            if agreed is not None:
                from trainer.recovery import adoption

                adopt = adoption(ctx, agreed)
            trainer = Trainer(job=job, layout=layout, ctx=pctx, dp_rank=groups.index("dp"),
                              model_groups=model_groups, device=device,
                              pipeline=PipelineGroups.from_groups(groups), init=False,
                              adopt=adopt)  # fmt: skip
            del adopt
            trainer.on_phase = channel.phase  # faults keyed to a phase (elasticd.testing)
            metrics = None
            if rank == 0:
                metrics = MetricsWriter(
                    path=os.path.join(job.out_dir, "metrics.jsonl"), layout=layout,
                    round_=int(env.get("ELASTICD_ROUND", "0") or 0), total_steps=job.train.steps,
                    echo=lambda line: print(line, flush=True), once=ctx.inprocess,
                    current=round_still_current(job.ckpt_dir, env),
                )  # fmt: skip

            def progress(r) -> None:
                ck = trainer.checkpointing
                saved = ck.saver.last if ck is not None else None
                channel.progress(
                    step=r.step, loss=r.loss, tokens_per_s=r.tokens_per_s, step_s=r.step_s,
                    mfu=r.mfu,
                    checkpoint_save=None if saved is None
                    else {"step": saved.step, "seconds": round(saved.total_s, 4)},
                )  # fmt: skip

            restore = None
            if ctx.inprocess:
                from trainer.recovery import recover

                def restore(ckpt) -> None:
                    recover(ctx, trainer, ckpt, channel=channel, job=job, agreed=agreed)
                    records = ctx.state.pop("peer_records", None)
                    if metrics is not None and records:
                        metrics.fill(records, upto=trainer.state.step)

            round_ = int(env.get("ELASTICD_ROUND", "0") or 0)

            if ctx.inprocess:
                from trainer.recovery import keep_record

                # Kept once the update is applied (a fault in the ZeRO-1 all-gather or the
                # save must not lose it), then again with the whole step's time.
                trainer.on_updated = lambda r: keep_record(ctx, step_record(r, layout, round_))

            def after_step(r) -> None:
                if ctx.inprocess:
                    from trainer.recovery import keep_record, replicate

                    keep_record(ctx, step_record(r, layout, round_))
                    replicate(ctx, trainer)
                stepped(ctx)
                if ctx.inprocess:
                    # Leave an ended round here, with this step kept. Its collectives
                    # fail once the round's sockets are shut, but a world of one process
                    # has none: it trained on alone past a scale-up (43 steps in a test,
                    # their records fenced off) until its next save failed its fence.
                    ctx.check()

            preempt = channel.preempt_agreed if channel.supervised else None
            trainer.run(
                metrics=metrics, progress=progress, preempt=preempt,
                checkpoint_group=groups.side("checkpoint"), control_group=groups.side("control"),
                on_resumed=lambda: channel.mark("ckpt_loaded"), restore=restore,
                after_step=after_step,
            )  # fmt: skip
            if channel.last_step != trainer.state.step:
                # Resumed at its last step (a re-run of a finished job): nothing trained,
                # yet the job stands at that step. Said, or its status reads "step 0/N".
                channel.progress(step=trainer.state.step)
            ck = trainer.checkpointing
            if ck is not None and ck.saver.last is not None:
                # The final save commits after the last step's heartbeat: tell the agent.
                saved = ck.saver.last
                channel.progress(
                    step=trainer.state.step,
                    checkpoint_save={"step": saved.step, "seconds": round(saved.total_s, 4)},
                )
            if ctx.inprocess:
                from trainer.recovery import finish_replication

                finish_replication(ctx)
            if rank == 0:
                store.set(DONE_KEY, "preempted" if trainer.preempted else "1")
            preempted = trainer.preempted
        if not left_early:
            comm.barrier()
    finally:
        if trainer is not None:
            trainer.close()
        try:
            groups.destroy()
        except Exception:
            if not ctx.inprocess:
                raise  # in-process, a broken round's groups go with its default group
    if preempted:
        from elasticd.worker import PREEMPTED_EXIT_CODE

        # In-process, a rank whose node stays takes the next round with its state.
        ctx.leave_for_preemption()
        what = "a spare, leaving" if left_early else "the step is saved"
        print(f"rank {ctx.rank}: preempted; {what}, exiting with {PREEMPTED_EXIT_CODE}",
              flush=True)  # fmt: skip
        return PREEMPTED_EXIT_CODE  # the agent re-forms; this is not a failure
    return 0


def exit_now(code: int | None) -> NoReturn:
    """Leave the process at once with ``code``, skipping the interpreter's teardown, once
    what this process wrote is flushed. Nothing that must last is left by then: a save
    ``main`` waited for is committed (fsynced), one abandoned on an error path would be
    refused at its commit anyway, and the heartbeat and metrics files are whole files.
    The teardown collects every module's objects (torch's, its compiler's imported by the
    warm start): 1.2-1.6 s of CPU on the 2-core box, with no Python frame left to run, and
    a node's agent waits for its workers' exit before it leaves the world: a preempted
    node's re-form, and every job's end, waited for it. Nothing here needs the teardown:
    no torch.compile workers, no multiprocessing children."""
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    logging.shutdown()
    os._exit(code if isinstance(code, int) else (0 if code is None else 1))


if __name__ == "__main__":
    try:
        status = main()
    except SystemExit as exc:  # raised past main (elasticd.inprocess: no round will come)
        if not isinstance(exc.code, int | None):
            raise
        status = exc.code
    exit_now(status)
