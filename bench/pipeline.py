"""Measured pipeline bubble of real multi-process runs, against theory.

Every layer costs a fixed time (forward ``--layer-ms``, backward twice that), so compute is
uniform and the only idle time is the schedule's bubble plus real transfer and framework
overhead. Four gloo processes run pp = 4 with m = 8 micro-batches under fill-drain (gpipe,
the baseline), 1F1B and interleaved 1F1B (vpp = 2), side by side in one run. Per stage,

    bubble = (step time − time in forward/backward) / time in forward/backward,

Megatron's definition (idle time per unit of useful work); the printed figure is the mean
over stages and measured steps. Theory: (pp − 1)/m, and (pp − 1)/(vpp·m) interleaved.

The layer cost is a sleep by default, not a busy loop: this machine has 2 cores for 4
stages, and busy loops would time-slice each other and measure the scheduler instead of the
pipeline. ``--spin`` switches to busy loops on a machine with a core per stage.

    python bench/pipeline.py [--layers 8] [--layer-ms 20] [--steps 5] [--spin]
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
PP, M, MB, HIDDEN = 4, 8, 2, 16


class _Timed(torch.autograd.Function):
    """Identity that costs ``ms`` forward and ``2·ms`` backward, adding its cost to ``busy``."""

    @staticmethod
    def forward(ctx, x, ms, spin, busy):
        ctx.ms, ctx.spin, ctx.busy = ms, spin, busy
        busy[0] += _wait(ms, spin)
        return x * 1.0

    @staticmethod
    def backward(ctx, grad):
        ctx.busy[0] += _wait(2 * ctx.ms, ctx.spin)
        return grad * 1.0, None, None, None


def _wait(ms: float, spin: bool) -> float:
    start = time.perf_counter()
    if spin:
        while time.perf_counter() < start + ms / 1000:
            pass
    else:
        time.sleep(ms / 1000)
    return time.perf_counter() - start


def worker(cfg: dict) -> None:
    # The script's own folder comes first on sys.path and holds other benchmarks (a
    # bench/trainer.py would shadow the package); the repository must win.
    sys.path.insert(0, str(REPO))
    import torch.distributed as dist

    from trainer.parallel.pipeline import StagePlan, Wire, run_step
    from trainer.parallel.schedule import layer_range

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    dist.init_process_group("gloo", rank=rank, world_size=world)
    vpp, layers, ms, spin = cfg["vpp"], cfg["layers"], cfg["layer_ms"], cfg["spin"]
    per_chunk = len(layer_range(layers=layers, pp=PP, vpp=vpp, stage=rank, chunk=0))
    weight = torch.ones(1, requires_grad=True)
    busy = [0.0]

    def forward(chunk: int, mb: int, x):
        h = weight * torch.ones(MB, HIDDEN) if x is None else x
        for _ in range(per_chunk):
            h = _Timed.apply(h, ms, spin, busy)
        return h.sum() / 1e6 if (chunk == vpp - 1 and rank == PP - 1) else h

    plan = StagePlan(pp=PP, vpp=vpp, microbatches=M, stage=rank, kind=cfg["kind"])
    wire = Wire(ranks=list(range(PP)), group=dist.group.WORLD, shape=(MB, HIDDEN))
    steps = []
    for step in range(cfg["steps"] + 1):  # the first step warms up and is not counted
        busy[0] = 0.0
        dist.barrier()
        t0 = time.perf_counter()
        run_step(plan=plan, wire=wire, forward=forward)
        total = time.perf_counter() - t0
        if step:
            steps.append({"total": total, "busy": busy[0]})
    print(json.dumps({"rank": rank, "steps": steps}), flush=True)
    dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def measure(kind: str, vpp: int, args: argparse.Namespace) -> dict:
    cfg = {"kind": kind, "vpp": vpp, "layers": args.layers, "layer_ms": args.layer_ms,
           "spin": args.spin, "steps": args.steps}  # fmt: skip
    env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(_free_port()),
           "WORLD_SIZE": str(PP), "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}  # fmt: skip
    with tempfile.TemporaryDirectory():
        procs = [
            subprocess.Popen(
                [sys.executable, __file__, "--worker", json.dumps(cfg)],
                env={**env, "RANK": str(r)},
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )
            for r in range(PP)
        ]
        try:
            outs = [p.communicate(timeout=600) for p in procs]
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()
                    p.wait()
    reports = []
    for p, (out, err) in zip(procs, outs, strict=True):
        if p.returncode:
            raise SystemExit(f"a worker failed:\n{err[-2000:]}")
        reports.append(json.loads(out.strip().splitlines()[-1]))
    n = len(reports[0]["steps"])
    step_s = [max(r["steps"][i]["total"] for r in reports) for i in range(n)]
    # The step ends when the last stage finishes; each stage's bubble is measured against
    # that makespan (a stage that finishes early still waits for the optimizer step).
    bubbles = [
        (step_s[i] - r["steps"][i]["busy"]) / r["steps"][i]["busy"]
        for r in reports
        for i in range(n)
    ]
    return {"step_s": sorted(step_s)[n // 2], "bubble": sum(bubbles) / len(bubbles)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layers", type=int, default=8, help="layers in the model (default 8)")
    ap.add_argument("--layer-ms", type=float, default=20.0, help="forward ms per layer")
    ap.add_argument("--steps", type=int, default=5, help="measured steps per schedule")
    ap.add_argument("--spin", action="store_true", help="busy-loop instead of sleeping")
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        worker(json.loads(args.worker))
        return
    rows = [("gpipe", 1), ("1f1b", 1), ("1f1b", 2)]
    print(f"pp={PP} m={M} layers={args.layers} layer forward {args.layer_ms} ms, backward "
          f"{2 * args.layer_ms} ms ({'busy loop' if args.spin else 'sleep'}), "
          f"{args.steps} steps each, gloo on loopback")  # fmt: skip
    print(f"{'schedule':<22}{'step s':>9}{'bubble':>9}{'theory':>9}{'throughput':>12}")
    base = None
    for kind, vpp in rows:
        got = measure(kind, vpp, args)
        theory = (PP - 1) / (vpp * M)
        name = (
            "gpipe (baseline)" if kind == "gpipe" else "1f1b" if vpp == 1 else "interleaved vpp=2"
        )
        base = base or got["step_s"]
        print(f"{name:<22}{got['step_s']:>9.3f}{got['bubble']:>9.3f}{theory:>9.3f}"
              f"{base / got['step_s']:>11.3f}x")  # fmt: skip
        if kind == "1f1b" and vpp == 1:
            one = got["step_s"]
        if vpp == 2:
            want = (1 + (PP - 1) / M) / (1 + (PP - 1) / (2 * M))
            print(f"throughput interleaved vpp=2 / 1f1b vpp=1: {one / got['step_s']:.3f} "
                  f"(theory {want:.3f})")  # fmt: skip


if __name__ == "__main__":
    main()
