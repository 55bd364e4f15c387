"""Hot-path costs of the trainer (issue 14): the vocab-parallel loss without copies of the
logits, experts as one batched matmul, parameters initialised per shard, and pipeline
transfers waited just before use. Each keeps the numbers of the simple version."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from trainer.init import global_normal, normal_region
from trainer.parallel.context import GroupSlot
from trainer.parallel.tensor import vocab_parallel_cross_entropy


def _loss_case(dtype: torch.dtype, *, inplace: bool):
    gen = torch.Generator().manual_seed(1)
    logits = torch.randn(2, 5, 12, generator=gen).to(dtype).requires_grad_()
    target = torch.randint(0, 10, (2, 5), generator=gen)
    work = logits * 1  # a non-leaf, as the head's output is
    saved = []

    def pack(t):
        saved.append(t)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = vocab_parallel_cross_entropy(
            work, target, start=0, vocab=10, slot=GroupSlot(), inplace=inplace
        )
    loss.sum().backward()
    return logits, work, target, loss, saved


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_vocab_loss_holds_one_fp32_buffer_at_most_and_matches_torch(dtype):
    logits, work, target, loss, saved = _loss_case(dtype, inplace=True)
    big = [t for t in saved if t.numel() == work.numel()]
    assert len(big) == 1 and big[0].dtype == torch.float32  # the softmax, nothing else
    if dtype == torch.float32:
        assert big[0].data_ptr() == work.data_ptr()  # the logits themselves, no copy
    ref_logits = logits.detach().float()[..., :10].clone().requires_grad_()
    ref = F.cross_entropy(ref_logits.reshape(-1, 10), target.reshape(-1), reduction="none")
    tol = {} if dtype == torch.float32 else dict(rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(loss.reshape(-1), ref, **tol)
    ref.sum().backward()
    assert torch.all(logits.grad[..., 10:] == 0)  # padding columns get nothing
    torch.testing.assert_close(logits.grad[..., :10].float(), ref_logits.grad, **tol)
    # In place or copied, the same floats.
    c_logits, _, _, c_loss, _ = _loss_case(dtype, inplace=False)
    assert torch.equal(c_loss, loss) and torch.equal(c_logits.grad, logits.grad)


def test_the_vocab_loss_refuses_a_second_backward_through_its_consumed_softmax():
    logits = torch.randn(2, 3, 8, requires_grad=True)
    loss = vocab_parallel_cross_entropy(
        logits * 1, torch.zeros(2, 3, dtype=torch.long), start=0, vocab=8, slot=GroupSlot(),
        inplace=True,
    )  # fmt: skip
    loss.sum().backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="consumed"):
        loss.sum().backward()


# ---------------------------------------------------------------- experts


@pytest.mark.parametrize("counts", [[5, 0, 9, 2], [4, 4, 4, 4], [0, 0, 7, 0]])
def test_experts_as_batched_matmuls_compute_what_one_matmul_per_expert_does(counts):
    from trainer.parallel.context import ParallelContext
    from trainer.parallel.expert import MoE

    moe = MoE("mlp", hidden=16, ffn=32, experts=4, top_k=2, ctx=ParallelContext.single(),
              seed=3, out_std=0.01, dtype=torch.float32)  # fmt: skip
    for p in moe.parameters():  # non-zero biases, so padding rows would show if they leaked
        p.data.add_(torch.randn(p.shape, generator=torch.Generator().manual_seed(p.numel())))
    rows = torch.randn(sum(counts), 16, generator=torch.Generator().manual_seed(2))
    results = []
    for slack in (float("inf"), 0.0):  # batched, then one matmul per expert
        moe.batch_slack = slack
        moe.zero_grad()
        x = rows.clone().requires_grad_()
        out = moe.run_experts(x, torch.tensor(counts), counts)
        out.square().sum().backward()
        results.append((out.detach(), x.grad, [p.grad.clone() for p in moe.experts.parameters()]))
    (out_b, dx_b, g_b), (out_l, dx_l, g_l) = results

    def close(a, b):  # fp32 round-off of differently ordered sums, relative to the tensor
        assert float((a - b).norm()) <= 1e-6 * float(b.norm()) + 1e-12

    close(out_b, out_l)
    close(dx_b, dx_l)
    for a, b in zip(g_b, g_l, strict=True):
        close(a, b)


# ---------------------------------------------------------------- initialisation per shard


@pytest.mark.parametrize(
    "shape", [(7,), (16,), (33,), (50, 7), (64, 32), (3, 32, 12), (3, 24, 40), (1000, 3)]
)
@pytest.mark.parametrize("piece", [16, 48, 1 << 20])
def test_every_shard_of_a_parameter_is_the_global_tensors_region_bit_for_bit(shape, piece):
    whole = global_normal(5, "decoder.layers.0.attn.qkv.weight", shape, 0.02)
    for dim in range(len(shape)):
        for parts in (p for p in (1, 2, 3, 4) if shape[dim] % p == 0):
            step = shape[dim] // parts
            for index in range(parts):
                got = normal_region(5, "decoder.layers.0.attn.qkv.weight", shape, 0.02,
                                    dim=dim, start=index * step, size=step, piece=piece)  # fmt: skip
                assert torch.equal(got, whole.narrow(dim, index * step, step)), (dim, index)
    # Uneven regions too (the vocabulary's real rows on its last rank).
    got = normal_region(5, "x", shape, 1.0, start=1, size=shape[0] - 1, piece=piece)
    assert torch.equal(got, global_normal(5, "x", shape, 1.0)[1:])


# ---------------------------------------------------------------- pipeline transfers

HID, MB, M = 8, 2, 4  # hidden size, micro-batch rows, micro-batches


def _stage_weight(stage: int) -> torch.Tensor:
    return torch.randn(HID, HID, generator=torch.Generator().manual_seed(40 + stage)) * 0.5


def _input(mb: int) -> torch.Tensor:
    return torch.randn(MB, HID, generator=torch.Generator().manual_seed(mb))


def _pipeline_worker(rank: int, store_path: str, out_path: str) -> None:
    import json

    import torch.distributed as dist

    from trainer.parallel.pipeline import StagePlan, Wire, run_step

    dist.init_process_group("gloo", init_method=f"file://{store_path}", rank=rank, world_size=2)
    weight = _stage_weight(rank).requires_grad_()
    sent, report = [], {"freed": []}

    def forward(chunk: int, mb: int, x):
        if rank == 0:
            out = torch.tanh(_input(mb) @ weight.T) * 2  # a base tensor, not a view
            sent.append(out)
            return out
        return torch.tanh(x @ weight.T).square().sum() / M

    def before_backward(chunk: int, last: bool) -> None:
        if rank == 0:  # every output forwarded so far has been posted, so freed
            report["freed"].append([t.untyped_storage().nbytes() for t in sent])

    run_step(plan=StagePlan(pp=2, vpp=1, microbatches=M, stage=rank),
             wire=Wire(ranks=[0, 1], group=dist.group.WORLD, shape=(MB, HID)),
             forward=forward, before_backward=before_backward)  # fmt: skip
    if rank == 0:  # the whole model in this process, for the gradient
        w0 = _stage_weight(0).requires_grad_()
        w1 = _stage_weight(1)
        for mb in range(M):
            h = torch.tanh(_input(mb) @ w0.T) * 2
            (torch.tanh(h @ w1.T).square().sum() / M).backward()
        report["max_diff"] = float((w0.grad - weight.grad).abs().max())
        with open(out_path, "w") as fh:
            json.dump(report, fh)
    dist.destroy_process_group()


def test_a_sent_activation_keeps_only_its_graph_and_the_gradients_stay_right(tmp_path):
    import json

    import torch.multiprocessing as mp

    out = tmp_path / "report.json"
    mp.spawn(_pipeline_worker, args=(str(tmp_path / "store"), str(out)), nprocs=2)
    report = json.loads(out.read_text())
    assert len(report["freed"]) == M
    assert all(size == 0 for sizes in report["freed"] for size in sizes)
    assert report["max_diff"] < 1e-6


def test_a_moe_layer_reads_its_counts_back_once_per_micro_batch_and_never_bincounts(tmp_path):
    """On CUDA every read of a device tensor on the host waits for the device:
    ``torch.bincount`` reads its input's min and max back (twice per call), and the counts
    went back to the host as two ``tolist``s under expert parallelism. What remains is the
    one read the split sizes need. Counted on CPU with a torch function mode."""
    import collections

    from torch.overrides import TorchFunctionMode

    from elasticd.jobspec import parse_job
    from elasticd.layout import plan
    from trainer.parallel.context import ParallelContext
    from trainer.train import Trainer

    class Reads(TorchFunctionMode):
        def __init__(self):
            super().__init__()
            self.calls = collections.Counter()

        def __torch_function__(self, func, types, args=(), kwargs=None):
            name = getattr(func, "__name__", "")
            if name in ("bincount", "tolist", "item", "nonzero", "unique"):
                import traceback

                here = [f for f in traceback.extract_stack()[:-1] if "trainer" + "/" in f.filename]
                if here and here[-1].filename.endswith("expert.py"):
                    self.calls[name] += 1
            return func(*args, **(kwargs or {}))

    layers, micro = 2, 4
    job = parse_job({
        "name": "moe-reads", "nproc_per_node": 1, "output_dir": str(tmp_path),
        "model": {"layers": layers, "hidden": 32, "heads": 4, "ffn_hidden": 64, "vocab": 50,
                  "seq_len": 16, "experts": 4, "top_k": 2},
        "train": {"steps": 3, "global_batch": 2 * micro, "micro_batch": 2, "seed": 7,
                  "dtype": "bfloat16", "aux_loss_coeff": 0.01},
        "data": {"source": "synthetic"}, "checkpoint": {"every": 0},
    })  # fmt: skip
    t = Trainer(job=job, layout=plan(1, job), ctx=ParallelContext.single(), dp_rank=0)
    t.train_step()
    with Reads() as reads:
        t.train_step()
    assert reads.calls == {"tolist": layers * micro}
