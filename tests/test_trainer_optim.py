"""The optimizer's hot path (issue 14, point 4): the global gradient norm from per-tensor
foreach norms (no fp64 copies of the gradients), foreach clipping, and AdamW foreach on CPU
(fused on CUDA), each against the plain computation it replaces."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from trainer.optim import AdamW, build_optimizer, clip_grads, global_grad_norm

SHAPES = [(64, 32), (32,), (3, 32, 32), (50, 32), (1,), (256, 7)]
REPLICAS = [1, 2, 4, 1, 2, 8]


def _params(dtype: torch.dtype = torch.float32, seed: int = 0) -> list[nn.Parameter]:
    g = torch.Generator().manual_seed(seed)
    params = []
    for i, (shape, replicas) in enumerate(zip(SHAPES, REPLICAS, strict=True)):
        p = nn.Parameter(torch.randn(shape, generator=g).to(dtype))
        # Gradients of very different scales, as a real model's are.
        p.grad = (torch.randn(shape, generator=g) * 10.0 ** (i - 3)).to(dtype)
        p.grad_replicas = replicas
        params.append(p)
    return params


def _fp64_norm(params: list[nn.Parameter]) -> float:
    """What the norm was before: every gradient copied to fp64, squared and summed."""
    total = sum(p.grad.double().pow(2).sum().item() / p.grad_replicas for p in params)
    return math.sqrt(total)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_foreach_norm_equals_the_fp64_norm_within_fp32_round_off(dtype):
    for seed in range(5):
        params = _params(dtype, seed)
        got = global_grad_norm(params, groups=())
        assert got == pytest.approx(_fp64_norm(params), rel=2e-7 * 8)  # a few fp32 ulps


def test_a_parameter_without_a_gradient_is_left_out_of_the_norm():
    params = _params()
    params[2].grad = None
    assert global_grad_norm(params, groups=()) == pytest.approx(
        _fp64_norm([p for p in params if p.grad is not None]), rel=1e-6
    )
    assert global_grad_norm([], groups=()) == 0.0


def test_clipping_scales_every_gradient_by_the_same_factor():
    params = _params()
    before = [p.grad.clone() for p in params]
    norm = global_grad_norm(params, groups=())
    clip_grads(params, norm=norm, max_norm=norm / 4)
    for p, g in zip(params, before, strict=True):
        torch.testing.assert_close(p.grad, g * ((norm / 4) / (norm + 1e-6)), rtol=0, atol=0)
    assert global_grad_norm(params, groups=()) == pytest.approx(norm / 4, rel=1e-5)
    small = [p.grad.clone() for p in params]
    clip_grads(params, norm=norm / 4, max_norm=norm)  # under the bar: untouched
    assert all(torch.equal(p.grad, g) for p, g in zip(params, small, strict=True))


def test_adamw_is_foreach_on_cpu_and_steps_as_the_for_loop_adamw_does():
    ours, ref = _params(seed=1), _params(seed=1)
    opt = build_optimizer(ours, lr=1e-2, weight_decay=0.1)
    assert isinstance(opt, AdamW)
    assert all(g["foreach"] is True and not g["fused"] for g in opt.param_groups)
    plain = torch.optim.AdamW(
        [{"params": [p for p in ref if p.dim() >= 2], "weight_decay": 0.1},
         {"params": [p for p in ref if p.dim() < 2], "weight_decay": 0.0}],
        lr=1e-2, betas=(0.9, 0.95), eps=1e-8, foreach=False,
    )  # fmt: skip
    g = torch.Generator().manual_seed(9)
    for _ in range(5):
        for a, b in zip(ours, ref, strict=True):
            b.grad = torch.randn(a.shape, generator=g)
            a.grad = b.grad.clone()
        opt.step()
        plain.step()
    for a, b in zip(ours, ref, strict=True):
        torch.testing.assert_close(a, b)  # fp32 round-off (rtol 1.3e-6)


def test_a_restored_groups_implementation_flags_give_way_to_this_processs():
    params = _params()
    opt = build_optimizer(params, lr=1e-3, weight_decay=0.0)
    for group in opt.param_groups:  # as a checkpoint saved by a for-loop AdamW restores them
        group["foreach"], group["fused"] = None, None
    opt.step()
    assert all(g["foreach"] is True and not g["fused"] for g in opt.param_groups)


def test_gradients_accumulate_in_place_in_their_bucket_slots():
    from elasticd.jobspec import ModelConfig
    from trainer.model import build_chunks
    from trainer.parallel.context import GroupSlot, ParallelContext
    from trainer.parallel.data import GradSync

    cfg = ModelConfig(layers=2, hidden=32, heads=4, ffn_hidden=64, vocab=50, seq_len=16)
    (chunk,) = build_chunks(cfg, [range(2)], ctx=ParallelContext.single(), seed=2)
    params = list(chunk.parameters())
    sync = GradSync(params, dense=GroupSlot(), expert=GroupSlot(), divisor=1, bucket_bytes=8192)
    gen = torch.Generator().manual_seed(0)
    batches = [torch.randint(0, cfg.vocab, (2, 17), generator=gen) for _ in range(3)]
    sync.zero()
    slots = {id(p): p.grad.data_ptr() for p in params}
    params[3].grad = None  # dropped after zero(): brought back into its slot
    for m, b in enumerate(batches):
        sync.set_sync(m == len(batches) - 1)
        chunk(b[:, :-1], b[:, 1:]).mean().backward()
    assert all(p.grad.data_ptr() == slots[id(p)] for p in params)  # no copies were made
    sync.finish()
    got = [p.grad.clone() for p in params]
    sync.close()
    chunk.zero_grad(set_to_none=True)
    for b in batches:
        chunk(b[:, :-1], b[:, 1:]).mean().backward()
    for p, g in zip(params, got, strict=True):
        assert torch.equal(g, p.grad), p.shard_info.name  # autograd's own sums, bit for bit


def test_a_zero1_gather_takes_this_ranks_own_rows_from_its_memory_not_the_gathered_output(
    monkeypatch,
):
    """ZeRO-1 in fp32: the main shard is a view of the parameter's own rows. An NCCL
    all-gather aborted at its round's end returns, with garbage in its output (no error);
    were the own rows copied back from it, the main shard (the state recovery takes from
    this rank, its only holder) would be garbage. The collective here is a stand-in that
    fills its output with NaN, as such an abort can leave it: the own rows must come
    through intact, the others are the model's and rebuilt from the main shards."""
    from checkpoint.shards import ShardInfo
    from trainer.parallel import comm
    from trainer.parallel.context import GroupSlot
    from trainer.parallel.data import GradSync

    class Done:
        def wait(self, timeout=None):
            return True

        def is_completed(self):
            return True

    def aborted_all_gather(out, send, group=None, async_op=False):
        out.fill_(float("nan"))
        return Done()

    p = torch.nn.Parameter(torch.arange(24, dtype=torch.float32).view(6, 4))
    p.expert, p.grad_replicas = False, 2
    p.shard_info = ShardInfo.whole("w", (6, 4))
    for rank in (0, 1):
        slot = GroupSlot(group=object(), size=2, rank=rank)
        sync = GradSync([p], dense=slot, expert=GroupSlot(), divisor=2, bucket_bytes=1 << 20,
                        shard=True)  # fmt: skip
        start, stop = sync.rows(p)
        mine = p.detach()[start:stop]
        before = mine.clone()
        monkeypatch.setattr(comm, "all_gather_base", aborted_all_gather)
        sync.gather({id(p): mine})
        assert torch.equal(mine, before), (rank, p)
        assert torch.isnan(p.detach()).sum() == 12  # the other rank's rows: from the output
        p.data.copy_(torch.arange(24, dtype=torch.float32).view(6, 4))


def test_dense_and_expert_buckets_on_one_communicator_launch_in_one_order_on_every_rank(
    monkeypatch,
):
    """ep 1: the dense and the expert data-parallel groups are the same ranks, and
    ProcessGroups makes them one group. Launched list by list as each became ready, the
    order across the two lists followed each rank's backward (an expert no token reached
    on one rank takes no part in it): on NCCL, two ranks issuing one communicator's
    all-reduces in different orders hang (a GPU review). Now both lists are one, in
    backward order, whatever order the gradients arrive in. Pure logic: the all-reduce
    records what it was given."""
    import torch.distributed as dist

    from checkpoint.shards import ShardInfo
    from trainer.parallel.context import GroupSlot
    from trainer.parallel.data import GradSync

    params = []
    for i, expert in enumerate([False, True, False, True]):
        p = torch.nn.Parameter(torch.zeros(4))
        p.expert, p.grad_replicas = expert, 2
        p.shard_info = ShardInfo.whole(f"p{i}", (4,))
        params.append(p)
    launched = []

    def record(buffer, group=None, async_op=False):
        launched.append(next(i for i, b in enumerate(sync.buckets) if b.buffer is buffer))

    monkeypatch.setattr(dist, "all_reduce", record)
    slot = GroupSlot(group=object(), size=2, rank=0)
    # Distinct groups (ep > 1: two communicators) are launched in that one order too. They
    # kept a list each, launched as each became ready: two ranks could then issue the two
    # communicators' collectives crosswise, which NCCL does not allow (a hang wherever the
    # kernels cannot run side by side).
    other = GroupSlot(group=object(), size=2, rank=0)
    orders = []
    for expert, arrival in (
        (slot, [3, 2, 1, 0]),
        (slot, [3, 1, 2, 0]),
        (slot, [1, 3, 0, 2]),
        (other, [3, 2, 1, 0]),
        (other, [2, 0, 3, 1]),
    ):  # ranks' backwards
        sync = GradSync(params, dense=slot, expert=expert, divisor=1, bucket_bytes=16)
        assert [[b.params[0].shard_info.name for b in bs] for bs in sync._lists] == [
            ["p3", "p2", "p1", "p0"]
        ]
        sync.zero()
        launched.clear()
        for i in arrival:
            params[i].grad = torch.ones(4)
            sync._on_grad(params[i])
        sync.finish()
        orders.append([sync.buckets[i].params[0].shard_info.name for i in launched])
        sync.close()
    assert orders == [["p3", "p2", "p1", "p0"]] * 5, orders
