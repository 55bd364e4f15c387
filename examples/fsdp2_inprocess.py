"""An FSDP2 script (``fully_shard``, DTensor parameters) that survives faults in-process.

``Context.sync_state`` moves whole tensors that every holder holds alike; an FSDP2
model's parameters are shards of a mesh that dies with the round (DTensors are refused).
So the script keeps a **whole copy** of its state (model and AdamW, on every rank),
refreshed after each step, and hands that over; each round it shards a fresh model on the
round's world and loads the synced copy into it (docs/inprocess.md, "Sharded state"). The
cost: a full all-gather of the state each step, and its memory on every rank.

``elasticd run examples/fsdp2_inprocess.yaml --nodes 3 --fault kill-node=1@step=8
--fresh``; alone (or under torchrun) it trains once.
"""

import json
import os
import time

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_state_dict,
    set_state_dict,
)
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.utils._pytree import tree_map

import elasticd.inprocess as ei

STEPS = int(os.environ.get("FSDP_STEPS", "20"))
STEP_SLEEP = float(os.environ.get("FSDP_STEP_SLEEP", "0"))  # a slower step, to watch it
BATCH = 12  # the global batch, split over the world
FULL = StateDictOptions(full_state_dict=True)


def plain_model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.Tanh(), torch.nn.Linear(64, 1))


def sharded(mesh) -> torch.nn.Module:
    """A fresh model sharded on this round's mesh (a module is sharded once)."""
    model = plain_model()
    for layer in (model[0], model[2], model):
        fully_shard(layer, mesh=mesh)
    return model


def lr_at(step: int) -> float:
    return 1e-2 * min(1.0, (step + 1) / 10)  # warm-up


def train(ctx: ei.Context) -> None:
    if "whole" not in ctx.state:  # the whole copy, kept across rounds
        whole = plain_model()
        ctx.state.update(whole=whole, whole_opt=torch.optim.AdamW(whole.parameters(), lr=1e-2))
    whole, whole_opt = ctx.state["whole"], ctx.state["whole_opt"]
    step = ctx.sync_state(ei.state_tensors(whole, whole_opt), step=ctx.state.get("step")) or 0
    model = sharded(init_device_mesh("cpu", (ctx.world_size,)))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    if step:
        msd, osd = get_state_dict(whole, whole_opt)
        set_state_dict(model, opt, model_state_dict=msd, optim_state_dict=osd, options=FULL)
    rank, world = dist.get_rank(), dist.get_world_size()
    while step < STEPS:
        gen = torch.Generator().manual_seed(step)
        x = torch.randn(BATCH, 32, generator=gen)
        y = torch.sin(x.sum(dim=1, keepdim=True))
        xs, ys = x.tensor_split(world)[rank], y.tensor_split(world)[rank]
        for group in opt.param_groups:
            group["lr"] = lr_at(step)
        loss = torch.nn.functional.mse_loss(model(xs), ys)
        opt.zero_grad()
        loss.backward()
        mean = loss.detach().clone()
        dist.all_reduce(mean)
        mean = float(mean) / world
        ei.check_results()  # leave an ended round (alone, no collective would fail)
        opt.step()
        # The whole copy: gathered (a collective) and *copied*. Loaded as it comes, the
        # copy's AdamW ``step`` tensors would be the sharded optimizer's own (torch's
        # load_state_dict keeps them), and a fault in the next optimizer step would hand
        # over a copy whose step counts ran ahead of its moments.
        msd, osd = get_state_dict(model, opt, options=FULL)
        copy = tree_map(lambda v: v.detach().clone() if torch.is_tensor(v) else v, (msd, osd))
        set_state_dict(whole, whole_opt, model_state_dict=copy[0], optim_state_dict=copy[1])
        time.sleep(STEP_SLEEP)
        step += 1
        ctx.state["step"] = step
        ctx.channel.record(step=step, loss=mean)  # heartbeat and metrics.jsonl
        if rank == 0 and os.environ.get("FSDP_LOG"):  # a run without elasticd's metrics
            with open(os.environ["FSDP_LOG"], "a", encoding="utf-8") as fh:
                fh.write(json.dumps({"step": step, "loss": mean}) + "\n")


if __name__ == "__main__":
    ei.run(train)
