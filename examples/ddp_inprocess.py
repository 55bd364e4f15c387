"""A plain PyTorch DDP script, made to survive faults in-process with elasticd.

The lines marked ``# elasticd`` are the whole change. Run it under agents with
``restart: {mode: inprocess}`` (``elasticd run examples/ddp_inprocess.yaml --nodes 3
--fault kill-node=1@step=8``; docs/inprocess.md); alone, or under torchrun, it trains
once as any DDP script.

On a fault the process is not restarted: ``train`` is called again for the new world,
with the same ``ctx.state`` (model, optimizer, scheduler, step); ``ctx.sync_state`` makes
every rank's model, optimizer state, learning rates and scheduler equal to those of a rank
at the newest step (a newcomer receives them), rank to rank, CRC-checked. The data comes
through ``ei.ElasticBatchSampler`` where a DDP script has a ``DistributedSampler``: each
step takes the same 12 samples of a shuffled epoch whatever the world, so a round resumed
at a step in a new world reads on from exactly there, and the losses stay those of one
process.
"""

import json
import os
import time

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, TensorDataset

import elasticd.inprocess as ei  # elasticd

STEPS = int(os.environ.get("DDP_STEPS", "40"))
STEP_SLEEP = float(os.environ.get("DDP_STEP_SLEEP", "0"))  # a slower step, to watch it
BATCH = int(os.environ.get("DDP_BATCH", "12"))  # the global batch, split over the ranks
SAMPLES = 1000  # the dataset: 83 steps an epoch of 12, its shuffled remainder left out


def dataset() -> TensorDataset:
    gen = torch.Generator().manual_seed(1234)
    x = torch.randn(SAMPLES, 32, generator=gen)
    return TensorDataset(x, torch.sin(x.sum(dim=1, keepdim=True)))


def build(device: torch.device) -> dict:
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(32, 64), torch.nn.Tanh(), torch.nn.Linear(64, 1)).to(device)  # fmt: skip
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 10))  # warm-up
    return {"model": model, "opt": opt, "sched": sched}


def train(ctx: ei.Context) -> None:  # elasticd: was main(); the process group exists
    # The device ei.run made current: cuda:<local rank>, or the one a process sees when
    # each sees only its own (torchrun, Slurm), or the CPU without CUDA (gloo then).
    device = (
        torch.device("cuda", torch.cuda.current_device())
        if torch.cuda.is_available()
        else torch.device("cpu")
    )
    cuda = device.type == "cuda"
    if "model" not in ctx.state:  # elasticd: built once, kept across rounds
        ctx.state.update(build(device))  # elasticd
    model, opt, sched = ctx.state["model"], ctx.state["opt"], ctx.state["sched"]  # elasticd
    tensors = ei.state_tensors(model, opt, sched)  # elasticd
    step = ctx.sync_state(tensors, step=ctx.state.get("step")) or 0  # elasticd
    ddp = DDP(model, device_ids=[device.index] if cuda else None)
    # DDP's all-reduce, but one that a round's end abandons (else a rank thawed into an
    # ended round can sit in backward until its process is replaced).
    ddp.register_comm_hook(ddp.process_group, ei.ddp_comm_hook)  # elasticd
    rank, world = dist.get_rank(), dist.get_world_size()
    data = dataset()
    # Was a DistributedSampler: this one takes each step's samples alike in any world.
    sampler = ei.ElasticBatchSampler(data, BATCH, step=step, steps=STEPS)  # elasticd
    loader = DataLoader(data, batch_sampler=sampler, generator=torch.Generator())
    for xs, ys in loader:
        xs, ys = xs.to(device), ys.to(device)
        # share(): 1.0 when the world divides the batch; else the weight that makes DDP's
        # average of the ranks' gradients that of the whole batch's mean loss.
        loss = torch.nn.functional.mse_loss(ddp(xs), ys) * sampler.share()
        opt.zero_grad()
        loss.backward()
        mean = loss.detach().clone()
        # before the optimizer step: a step is all or nothing
        ei.wait_collective(dist.all_reduce(mean, async_op=True))  # elasticd: was all_reduce(mean)
        mean = float(mean) / world
        ei.check_results()  # elasticd: leave an ended round (on NCCL: garbage, not an error)
        opt.step()
        sched.step()
        time.sleep(STEP_SLEEP)
        step += 1
        ctx.state["step"] = step  # elasticd
        ctx.channel.record(step=step, loss=mean)  # elasticd: heartbeat and metrics.jsonl
        if rank == 0 and os.environ.get("DDP_LOG"):  # a run without elasticd's metrics
            with open(os.environ["DDP_LOG"], "a", encoding="utf-8") as fh:
                fh.write(json.dumps({"step": step, "loss": mean}) + "\n")


if __name__ == "__main__":
    ei.run(train)  # elasticd
