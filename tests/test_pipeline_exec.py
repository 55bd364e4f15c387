"""The pipeline executor on real gloo processes, against one process running the same model.

The model is a small deterministic stack: a word embedding, L tanh-linear layers, and an
output head tied to the embedding, with a cross-entropy loss. Each layer is initialised from
its global index, so every layout starts from the same weights. Each worker runs one
pipelined step and writes its losses and gradients; the test compares them with the
single-process reference, and checks the activation peak against the 1F1B bound.

This file is also the worker: ``python tests/test_pipeline_exec.py OUT_DIR CONFIG_JSON``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

REPO = Path(__file__).resolve().parents[1]
VOCAB, HIDDEN, SEQ, MB = 11, 8, 3, 2


def layer_weights(i: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 + i)
    return torch.randn(HIDDEN, HIDDEN, generator=g) * 0.5, torch.randn(HIDDEN, generator=g) * 0.1


def embedding_weight() -> torch.Tensor:
    return torch.randn(VOCAB, HIDDEN, generator=torch.Generator().manual_seed(7))


def batch(step_mb: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Tokens and targets of global micro-batch ``step_mb``."""
    g = torch.Generator().manual_seed(50 + step_mb)
    tokens = torch.randint(0, VOCAB, (MB, SEQ), generator=g)
    return tokens, torch.roll(tokens, 1, dims=1)


class Layer(nn.Module):
    def __init__(self, index: int) -> None:
        super().__init__()
        w, b = layer_weights(index)
        self.weight, self.bias = nn.Parameter(w), nn.Parameter(b)
        self.index = index

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(x @ self.weight.T + self.bias) + x


class Chunk(nn.Module):
    """Layers ``layers`` (global indexes); the embedding on the first, the head on the last."""

    def __init__(self, layers: range, *, first: bool, last: bool) -> None:
        super().__init__()
        self.layers = nn.ModuleList(Layer(i) for i in layers)
        self.embed = nn.Parameter(embedding_weight()) if first else None
        self.head = nn.Parameter(embedding_weight()) if last else None

    def forward(self, x, tokens, targets, scale: float):
        h = self.embed[tokens] if self.embed is not None else x
        for layer in self.layers:
            h = layer(h)
        if self.head is None:
            return h
        logits = h @ self.head.T
        return nn.functional.cross_entropy(logits.reshape(-1, VOCAB), targets.reshape(-1)) * scale


def reference(layers: int, microbatches: int) -> tuple[list[float], dict[str, torch.Tensor]]:
    """One process, one chunk with everything; embed and head share one weight."""
    model = Chunk(range(layers), first=True, last=True)
    model.head = model.embed  # tied
    losses = []
    for mb in range(microbatches):
        tokens, targets = batch(mb)
        loss = model(None, tokens, targets, 1.0 / microbatches)
        loss.backward()
        losses.append(loss.item())
    grads = {f"layer{x.index}.weight": x.weight.grad for x in model.layers}
    grads |= {f"layer{x.index}.bias": x.bias.grad for x in model.layers}
    grads["embed"] = model.embed.grad
    return losses, grads


# ---------------------------------------------------------------- worker side


def worker(out: Path, cfg: dict) -> None:
    import torch.distributed as dist

    from elasticd.layout import ParallelConfig, plan_world
    from trainer.parallel.groups import ProcessGroups
    from trainer.parallel.pipeline import StagePlan, Wire, run_step, sync_tied_grads
    from trainer.parallel.schedule import layer_range

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    dist.init_process_group("gloo", rank=rank, world_size=world)
    pp, vpp, layers, m = cfg["pp"], cfg["vpp"], cfg["layers"], cfg["microbatches"]
    layout = plan_world(world, ParallelConfig(pp=pp, vpp=vpp))
    groups = ProcessGroups.build(layout, rank=rank)
    stage, dp, dp_rank = groups.index("pp"), groups.size("dp"), groups.index("dp")
    chunks = []
    for c in range(vpp):
        rng = layer_range(layers=layers, pp=pp, vpp=vpp, stage=stage, chunk=c)
        first, last = rng.start == 0, rng.stop == layers
        chunks.append(Chunk(rng, first=first, last=last))
    per_rank = m // dp  # micro-batches this data-parallel rank runs

    def forward(chunk: int, mb: int, x):
        tokens, targets = batch(dp_rank * per_rank + mb)
        return chunks[chunk](x, tokens, targets, 1.0 / m)

    events, pending = [], []

    def before_backward(chunk: int, last: bool) -> None:
        events.append(["before", chunk, last])

    def after_chunk_backward(chunk: int) -> None:
        # Bucketed overlap: this chunk's gradients start their data-parallel sum now.
        events.append(["done", chunk])
        if dp > 1:
            for p in chunks[chunk].parameters():
                pending.append(dist.all_reduce(p.grad, group=groups.get("dp"), async_op=True))

    result = run_step(
        plan=StagePlan(pp=pp, vpp=vpp, microbatches=per_rank, stage=stage, kind=cfg["kind"]),
        wire=Wire(ranks=groups.ranks("pp"), group=groups.get("pp"), shape=(MB, SEQ, HIDDEN)),
        forward=forward,
        before_backward=before_backward,
        after_chunk_backward=after_chunk_backward,
    )
    for work in pending:
        work.wait()
    tied = [p.grad for ch in chunks for p in (ch.embed, ch.head) if p is not None]
    sync_tied_grads(tied, group=groups.get("embedding"))
    grads = {}
    for ch in chunks:
        for x in ch.layers:
            grads[f"layer{x.index}.weight"] = x.weight.grad
            grads[f"layer{x.index}.bias"] = x.bias.grad
        for name in ("embed", "head"):
            if getattr(ch, name) is not None:
                grads[name] = getattr(ch, name).grad
    report = {
        "stage": stage,
        "dp_rank": dp_rank,
        "losses": [x.item() for x in result.losses],
        "peak": result.peak_stashed,
        "events": events,
        "grads": {k: v.tolist() for k, v in grads.items()},
    }
    (out / f"rank{rank}.json").write_text(json.dumps(report))
    groups.destroy()
    dist.destroy_process_group()


# ---------------------------------------------------------------- test side


def launch(tmp_path: Path, world: int, cfg: dict) -> list[dict]:
    from elasticd.etcd import reserve_port

    hold = reserve_port()  # held until every rank ended: rank 0's store binds it later
    env = {
        **os.environ,
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(hold.getsockname()[1]),
        "WORLD_SIZE": str(world),
        "OMP_NUM_THREADS": "1",
        "PYTHONPATH": str(REPO),
    }
    procs = [
        subprocess.Popen(
            [sys.executable, __file__, str(tmp_path), json.dumps(cfg)],
            env={**env, "RANK": str(r)},
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
        )
        for r in range(world)
    ]
    try:
        outs = [p.communicate(timeout=120)[0].decode() for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
        hold.close()
    for r, (p, text) in enumerate(zip(procs, outs, strict=True)):
        assert p.returncode == 0, f"rank {r} failed:\n{text[-3000:]}"
    return [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(world)]


def _compare(reports: list[dict], layers: int, microbatches: int) -> float:
    ref_losses, ref_grads = reference(layers, microbatches)
    pp = max(r["stage"] for r in reports) + 1
    last = sorted(
        (r for r in reports if r["stage"] == pp - 1 and r["losses"]), key=lambda r: r["dp_rank"]
    )
    losses = [x for r in last for x in r["losses"]]
    assert losses == pytest.approx(ref_losses, rel=1e-5)
    worst = 0.0
    for r in reports:
        for name, got in r["grads"].items():
            want = ref_grads["embed" if name == "head" else name]
            got = torch.tensor(got)
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6, msg=name)
            worst = max(worst, ((got - want).abs().max() / want.abs().max()).item())
    seen = {name for r in reports for name in r["grads"]}
    assert {f"layer{i}.weight" for i in range(layers)} <= seen
    return worst


@pytest.mark.parametrize(
    ("pp", "vpp", "layers", "microbatches", "kind"),
    [
        (2, 1, 4, 4, "1f1b"),
        (2, 2, 8, 4, "1f1b"),
        (4, 1, 4, 6, "1f1b"),
        (4, 2, 8, 8, "1f1b"),
        (2, 1, 2, 3, "gpipe"),
    ],
)
def test_a_pipelined_step_gives_the_single_process_losses_and_gradients(
    tmp_path, pp, vpp, layers, microbatches, kind
):
    cfg = {"pp": pp, "vpp": vpp, "layers": layers, "microbatches": microbatches, "kind": kind}
    reports = launch(tmp_path, pp, cfg)
    _compare(reports, layers, microbatches)
    for r in reports:
        if kind == "gpipe":
            assert r["peak"] == microbatches
        elif vpp == 1:
            # The 1F1B bound: stage s holds at most pp − s micro-batches.
            assert r["peak"] == min(pp - r["stage"], microbatches)
        else:
            # Interleaved: the warm-up forwards plus the first steady-state forward.
            warmup = 2 * (pp - r["stage"] - 1) + (vpp - 1) * pp
            assert r["peak"] == min(warmup + 1, microbatches * vpp)


def test_with_data_parallel_each_chunk_syncs_once_after_its_last_backward(tmp_path):
    cfg = {"pp": 2, "vpp": 2, "layers": 4, "microbatches": 8, "kind": "1f1b"}
    reports = launch(tmp_path, 4, cfg)  # dp = 2: four micro-batches per data-parallel rank
    _compare(reports, 4, 8)
    for r in reports:
        done = [e for e in r["events"] if e[0] == "done"]
        assert sorted(e[1] for e in done) == [0, 1]
        for chunk in (0, 1):
            mine = [e for e in r["events"] if e[0] == "before" and e[1] == chunk]
            assert [e[2] for e in mine] == [False, False, False, True]
            # The sync of a chunk starts right after its last backward, not at the end.
            i = r["events"].index(["before", chunk, True])
            assert r["events"][i + 1] == ["done", chunk]


if __name__ == "__main__":
    worker(Path(sys.argv[1]), json.loads(sys.argv[2]))
