"""A plain PyTorch DDP training script that elasticd keeps alive, and that
``examples/test_ddp_train.py`` proves so with the ``elasticd.testing`` pytest plugin.

It is an ordinary DDP loop (a small MLP on a synthetic regression task) with checkpoints;
the lines marked ``# elasticd`` are what it takes:

- ``ei.run(train)``: under ``restart.mode: inprocess`` a fault does not restart the
  survivors; ``train`` is called again in the same process for the new world, and
  ``ctx.sync_state`` hands the newest model and optimizer to every rank (a replacement
  receives them). Under ``process`` mode, torchrun, or alone, ``train`` runs once.
- ``channel.record(step=, loss=)`` after each step: the heartbeat, and the metrics.jsonl
  record a test compares with a reference run.
- ``channel.phase(...)``: where faults keyed to a phase land.
- ``preempt_agreed()``: on SIGTERM (a preempted node) every rank saves; the ranks of the
  node that is going exit 75. Under in-process restart the others leave the round
  (``ctx.leave_for_preemption()``) and take the next one in their own processes, their
  state in memory; otherwise they exit 75 too and resume from the save.
- ``ei.ddp_comm_hook`` and ``ei.wait_collective``: DDP's gradient all-reduce and the
  loss's, made ones that the end of a round abandons (a rank thawed into an ended round
  leaves it, instead of waiting in ``backward`` until its process is replaced).
- ``ctx.check()`` after each step: leaves a round its agent ended (a node joined). A
  world of one process has no collective that the end could fail.

The data of step s is the same whatever the world size (a global batch of 12 split over
the ranks, each rank's gradient a mean DDP averages), so a run that changes size mid-way
trains the same model as one that does not, within fp32 round-off.

Settings come from the job (``ELASTICD_JOB_FILE``: ``train.steps``, ``checkpoint.every``,
the checkpoint dir); alone: ``python examples/ddp_train.py`` trains 20 steps in ./ckpt.
"""

from __future__ import annotations

import glob
import json
import os
import sys

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

import elasticd.inprocess as ei  # elasticd
from elasticd.worker import PREEMPTED_EXIT_CODE  # elasticd

BATCH = 12


def settings() -> tuple[int, int, str]:
    """train.steps, checkpoint.every and the checkpoint dir of the job (or defaults)."""
    path = os.environ.get("ELASTICD_JOB_FILE")
    if not path:
        return 20, 5, "ckpt"
    with open(path, encoding="utf-8") as fh:
        job = json.load(fh)
    ckpt = (job.get("checkpoint") or {}).get("dir") or os.path.join(job["output_dir"], "ckpt")
    return int(job["train"]["steps"]), int((job.get("checkpoint") or {}).get("every", 5)), ckpt


def save(ckpt: str, step: int, model: torch.nn.Module, opt: torch.optim.Optimizer) -> None:
    """Rank 0 writes step-N.pt atomically (a partial file never has the final name)."""
    dist.barrier()
    if dist.get_rank() == 0:
        os.makedirs(ckpt, exist_ok=True)
        final = os.path.join(ckpt, f"step-{step:06d}.pt")
        torch.save({"step": step, "model": model.state_dict(), "opt": opt.state_dict()},
                   final + ".tmp")  # fmt: skip
        os.replace(final + ".tmp", final)
    dist.barrier()


def resume(ckpt: str, model: torch.nn.Module, opt: torch.optim.Optimizer) -> int:
    files = sorted(glob.glob(os.path.join(ckpt, "step-*.pt")))
    if not files:
        return 0
    state = torch.load(files[-1], weights_only=True)
    model.load_state_dict(state["model"])
    opt.load_state_dict(state["opt"])
    return int(state["step"])


def train(ctx: ei.Context) -> None:  # elasticd: the process group exists
    steps, every, ckpt = settings()
    channel = ctx.channel  # elasticd
    channel.install_preemption_handler()  # elasticd
    if "model" not in ctx.state:  # a fresh process: build (same seed on every rank)
        torch.manual_seed(0)
        model = torch.nn.Sequential(
            torch.nn.Linear(32, 64), torch.nn.Tanh(), torch.nn.Linear(64, 1)
        )
        ctx.state["model"] = model
        ctx.state["opt"] = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model, opt = ctx.state["model"], ctx.state["opt"]
    # elasticd: survivors hand their state over; None when nobody holds any (a fresh start).
    step = ctx.sync_state(ei.state_tensors(model, opt), step=ctx.state.get("step"))
    if step is None:
        step = resume(ckpt, model, opt)
        # elasticd: what the job's recovery record says (the agent counts the lost steps)
        channel.recovered(source="checkpoint" if step else "none", resume_step=step)
    ddp = DDP(model)
    ddp.register_comm_hook(
        ddp.process_group, ei.ddp_comm_hook
    )  # elasticd: an ended round abandons it
    rank, world = dist.get_rank(), dist.get_world_size()
    while step < steps:
        gen = torch.Generator().manual_seed(step)
        x = torch.randn(BATCH, 32, generator=gen)
        y = torch.sin(x.sum(dim=1, keepdim=True))
        xs, ys = x.tensor_split(world)[rank], y.tensor_split(world)[rank]
        channel.phase("forward", step + 1)  # elasticd
        loss = torch.nn.functional.mse_loss(ddp(xs), ys)
        channel.phase("backward", step + 1)  # elasticd
        opt.zero_grad()
        loss.backward()
        mean = loss.detach().clone()
        # before the optimizer step: a step is all or nothing
        ei.wait_collective(dist.all_reduce(mean, async_op=True))  # elasticd: leavable
        channel.phase("optimizer", step + 1)  # elasticd
        opt.step()
        step += 1
        ctx.state["step"] = step  # elasticd
        ei.stepped(ctx)  # elasticd
        channel.record(step=step, loss=float(mean) / world)  # elasticd
        if step % every == 0 or step == steps:
            channel.phase("checkpoint-save", step)  # elasticd
            save(ckpt, step, model, opt)
        if channel.preempt_agreed():  # elasticd: SIGTERM on any rank: save, then leave
            save(ckpt, step, model, opt)
            ctx.leave_for_preemption()  # elasticd: in-process, ranks that stay keep going
            sys.exit(PREEMPTED_EXIT_CODE)
        ctx.check()  # elasticd: leave an ended round (alone, no collective would fail)


if __name__ == "__main__":
    ei.run(train)  # elasticd
