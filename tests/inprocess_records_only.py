"""An in-process script that reports each step with ``channel.record`` and never checks
its round itself (no ``ctx.check()``, no ``check_results()``): tests/test_inprocess.py.
Its loss after step s is -0.08 * s (s + 1) / 2 in any world (the gradient's mean over the
ranks is s + 1 on each of 8 weights)."""

import os
import time

import torch
import torch.distributed as dist

import elasticd.inprocess as ei

STEPS = int(os.environ.get("RECORDS_STEPS", "40"))
STEP_SLEEP = float(os.environ.get("RECORDS_STEP_SLEEP", "0.03"))
FORGET_STEP = os.environ.get("RECORDS_FORGET_STEP") == "1"
"""A script's mistake: never keep the step in ctx.state, so it hands its state over as at
no step (``sync_state`` refuses that, ending the job as a user error)."""


def train(ctx: ei.Context) -> None:
    if "w" not in ctx.state:
        ctx.state["w"] = torch.zeros(8)
    w = ctx.state["w"]
    step = ctx.sync_state({"w": w}, step=ctx.state.get("step")) or 0
    world = dist.get_world_size()
    while step < STEPS:
        grad = torch.full((8,), float(step + 1))
        dist.all_reduce(grad)
        w -= 0.01 * grad / world
        step += 1
        if not FORGET_STEP:
            ctx.state["step"] = step
        time.sleep(STEP_SLEEP)
        ctx.channel.record(step=step, loss=float(w.sum()))


if __name__ == "__main__":
    ei.run(train)
