"""A DDP script with BatchNorm (DDP broadcasts its buffers at every forward) under
``elasticd.inprocess``: tests/test_inprocess.py preempts one of its nodes again and
again. Such a script deadlocked in about 1 of 4 preemptions when the round's group was
destroyed by DDP's Reducer with the GIL held (docs/inprocess.md, "Which thread destroys a
gloo group")."""

import os
import time

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

import elasticd.inprocess as ei

STEPS = int(os.environ.get("BN_STEPS", "16"))
STEP_SLEEP = float(os.environ.get("BN_STEP_SLEEP", "0.3"))
BATCH = 12


def train(ctx: ei.Context) -> None:
    if "model" not in ctx.state:
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.BatchNorm1d(16),
                                    torch.nn.Tanh(), torch.nn.Linear(16, 1))  # fmt: skip
        ctx.state.update(model=model, opt=torch.optim.SGD(model.parameters(), lr=0.05))
    model, opt = ctx.state["model"], ctx.state["opt"]
    step = ctx.sync_state(ei.state_tensors(model, opt), step=ctx.state.get("step")) or 0
    ddp = DDP(model)  # broadcast_buffers: BatchNorm's statistics, at every forward
    rank, world = dist.get_rank(), dist.get_world_size()
    while step < STEPS:
        gen = torch.Generator().manual_seed(step)
        x = torch.randn(BATCH, 8, generator=gen)
        y = torch.sin(x.sum(dim=1, keepdim=True))
        loss = torch.nn.functional.mse_loss(ddp(x.tensor_split(world)[rank]),
                                            y.tensor_split(world)[rank])  # fmt: skip
        opt.zero_grad()
        loss.backward()
        mean = loss.detach().clone()
        dist.all_reduce(mean)
        ei.check_results()
        opt.step()
        time.sleep(STEP_SLEEP)
        step += 1
        ctx.state["step"] = step
        ctx.channel.record(step=step, loss=float(mean) / world)


if __name__ == "__main__":
    ei.run(train)
