"""Trainer benchmark on CPU (gloo): tensor parallelism and data-parallel gradient sync.

    OMP_NUM_THREADS=1 python bench/trainer.py [--steps 6] [--layers 4 --hidden 256 ...]

1. The same model at tp = 1, 2, 4: tokens/s, the model state per rank (parameters,
   gradients and the two AdamW moments), and peak RSS per rank. The model state of the
   sharded parts falls as 1/tp; what does not shrink is the replicated LayerNorms,
   biases and positions.
2. dp = 2: bucketed all-reduce launched from backward hooks (overlapped) against the naive
   baseline, one blocking all-reduce per parameter after backward, side by side.

Each configuration runs as real processes; ratios are printed against the baseline in the
same run. On a 2-core machine, 4 ranks share 2 cores, so tp=4 measures overhead more than
speed-up.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))


def job_dict(args: argparse.Namespace, *, world: int, tp: int) -> dict:
    return {
        "name": "bench",
        "nproc_per_node": world,
        "parallel": {"tp": tp},
        "model": {"layers": args.layers, "hidden": args.hidden, "heads": args.heads,
                  "ffn_hidden": 4 * args.hidden, "vocab": args.vocab, "seq_len": args.seq_len},
        "train": {"steps": args.steps, "global_batch": args.global_batch,
                  "micro_batch": args.micro_batch, "bucket_mb": args.bucket_mb},
    }  # fmt: skip


def _start_rank(cfg: dict, **trainer_kw):
    """This benchmark rank's process group and Trainer for ``cfg["job"]`` (gloo, the world
    from torchrun-style variables); returns (rank, trainer)."""
    import torch.distributed as dist

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    dist.init_process_group("gloo", rank=rank, world_size=world)
    return rank, _build_trainer(cfg, rank, world, **trainer_kw)


def _build_trainer(cfg: dict, rank: int, world: int, **trainer_kw):
    """A Trainer for ``cfg["job"]`` on the initialised default group (its groups too)."""
    from elasticd.jobspec import parse_job
    from elasticd.layout import plan
    from trainer.parallel.context import ParallelContext, slot_of
    from trainer.parallel.groups import ProcessGroups
    from trainer.train import Trainer

    job = parse_job(cfg["job"])
    layout = plan(world, job)
    groups = ProcessGroups.build(layout, rank=rank)
    return Trainer(job=job, layout=layout, ctx=ParallelContext.from_groups(groups),
                   dp_rank=groups.index("dp"), model_groups=(slot_of(groups, "tp-dp-cp"),),
                   **trainer_kw)  # fmt: skip


def worker(cfg: dict) -> None:
    if cfg.get("root"):  # the baseline's tree, ahead of this checkout's
        sys.path.insert(0, cfg["root"])
    import torch.distributed as dist

    rank, trainer = _start_rank(cfg, overlap_grads=cfg["overlap"])
    if cfg.get("root") and not sys.modules["trainer"].__file__.startswith(cfg["root"]):
        raise SystemExit("the baseline run imported this checkout's trainer")
    state_bytes = sum(q.numel() * q.element_size() for q in trainer.params) * 4
    times = []
    for i in range(cfg["warmup"] + cfg["steps"]):
        dist.barrier()
        r = trainer.train_step()
        if i >= cfg["warmup"]:
            times.append(r.step_s)
    peak_kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    print("BENCH " + json.dumps({"rank": rank, "step_s": statistics.median(times),
                                 "state_bytes": state_bytes, "peak_rss": peak_kib * 1024,
                                 "loss": r.loss}), flush=True)  # fmt: skip
    trainer.close()
    dist.destroy_process_group()


def launch(cfg: dict, world: int) -> list[dict]:
    from elasticd.etcd import reserve_port

    hold = reserve_port()  # held while the workers run: rank 0's store binds it later
    port = hold.getsockname()[1]
    procs = []
    for rank in range(world):
        env = dict(
            os.environ,
            RANK=str(rank),
            WORLD_SIZE=str(world),
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=str(port),
            OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"),
        )
        procs.append(subprocess.Popen([sys.executable, __file__, "--worker", json.dumps(cfg)],
                                      env=env, stdout=subprocess.PIPE, text=True))  # fmt: skip
    results = []
    for p in procs:
        out, _ = p.communicate(timeout=900)
        if p.returncode != 0:
            raise SystemExit(f"a benchmark worker failed (exit {p.returncode})")
        results += [json.loads(line[6:]) for line in out.splitlines() if line.startswith("BENCH ")]
    hold.close()
    return sorted(results, key=lambda r: r["rank"])


def _heap_bytes() -> int:
    """Bytes malloc holds for live allocations (glibc's mallinfo2: the main arena's in-use
    chunks plus mmapped ones), which is where torch's CPU tensors live."""
    import ctypes

    names = "arena ordblks smblks hblks hblkhd usmblks fsmblks uordblks fordblks keepcost"

    class MallInfo2(ctypes.Structure):
        _fields_ = [(n, ctypes.c_size_t) for n in names.split()]

    libc = ctypes.CDLL("libc.so.6")
    libc.mallinfo2.restype = MallInfo2
    info = libc.mallinfo2()
    return info.uordblks + info.hblkhd


def activation_worker(cfg: dict) -> None:
    """One micro-batch's forward after a warm-up step: the heap it leaves live for backward
    (activations and the graph; parameters, gradients and AdamW state already exist)."""
    import gc

    import torch.distributed as dist

    rank, trainer = _start_rank(cfg)
    trainer.train_step()
    trainer.begin_step()
    gc.collect()
    before = _heap_bytes()
    loss = trainer.chunk_forward(0, 0, None)
    held = _heap_bytes() - before
    loss.backward()
    print("BENCH " + json.dumps({"rank": rank, "act_bytes": held}), flush=True)
    trainer.close()
    dist.destroy_process_group()


def activation_memory(args: argparse.Namespace) -> None:
    """Activation memory per rank: sequence parallelism off and on at tp = 2, and
    activation recomputation none / selective / full in one process, without dropout and
    with it (dropout makes CPU attention keep its s×s probabilities, which selective
    recomputation drops) (issue 14)."""
    seq = args.seq_len
    print(f"\n== activation memory per rank, one micro-batch of {args.micro_batch}x{seq} "
          "tokens (heap held from forward to backward)")  # fmt: skip
    cases = [  # (name, world, parallel, recompute, dropout); ratios against the group's first
        ("tp2, sp off", 2, {"tp": 2}, "none", 0.0),
        ("tp2, sp on", 2, {"tp": 2, "sp": True}, "none", 0.0),
        ("recompute none", 1, {}, "none", 0.0),
        ("recompute selective", 1, {}, "selective", 0.0),
        ("recompute full", 1, {}, "full", 0.0),
        ("dropout 0.1, recompute none", 1, {}, "none", 0.1),
        ("dropout 0.1, selective", 1, {}, "selective", 0.1),
        ("dropout 0.1, full", 1, {}, "full", 0.1),
    ]
    base: dict[tuple, float] = {}
    for name, world, parallel, recompute, dropout in cases:
        job = job_dict(args, world=world, tp=parallel.get("tp", 1))
        job["parallel"] = parallel
        job["model"]["dropout"] = dropout
        job["train"].update(recompute=recompute, global_batch=args.micro_batch, steps=2)
        rs = launch({"job": job, "activations": True}, world)
        mib = max(r["act_bytes"] for r in rs) / 2**20
        ref = base.setdefault((world, dropout), mib)
        print(f"{name:>28}: {mib:8.1f} MiB/rank  {mib / ref:5.2f}x")


def init_worker(cfg: dict) -> None:
    """The trainer built as ``python -m trainer`` builds it every round (``init=False``:
    zeros, to be overwritten by a load or a recovery) against built with its parameters
    drawn, alternately, ``repeats`` times each; then ``initialize()`` of a deferred one (a
    start with nothing to load draws them there)."""
    import time

    import torch.distributed as dist

    times: dict[str, list[float]] = {"drawn": [], "deferred": [], "initialize": []}
    rank, trainer = _start_rank(cfg, init=True)  # untimed: imports, first allocations
    world = int(os.environ["WORLD_SIZE"])
    trainer.close()
    for i in range(2 * cfg["repeats"]):
        init = i % 2 == 0
        del trainer
        dist.barrier()
        start = time.perf_counter()
        trainer = _build_trainer(cfg, rank, world, init=init)
        times["drawn" if init else "deferred"].append(time.perf_counter() - start)
        if not init:
            start = time.perf_counter()
            trainer.initialize()
            times["initialize"].append(time.perf_counter() - start)
        trainer.close()
    params = sum(q.numel() for q in trainer.params)
    dist.destroy_process_group()
    print("BENCH " + json.dumps({"rank": rank, "params": params,
                                 **{k: statistics.median(v) for k, v in times.items()}}),
          flush=True)  # fmt: skip


def init_cost(args: argparse.Namespace) -> None:
    """What not drawing the parameters saves at every start, restart and recovery of
    ``python -m trainer``: the trainer's construction with ``init=False`` against drawn at
    construction, side by side in the same processes, per tp. A rank's draws reach the end
    of its part of each tensor (the generator cannot jump ahead), so the last tp rank draws
    the whole model; the slowest rank is what a world waits for."""
    print(f"\n== building the trainer: parameters drawn vs not drawn (init=False), layers "
          f"{args.layers}, hidden {args.hidden}, vocab {args.vocab}; medians of "
          f"{args.repeats}, slowest rank")  # fmt: skip
    print(f"{'tp':>3} {'params/rank':>12} {'drawn s':>9} {'not drawn s':>12} {'ratio':>7} "
          f"{'initialize() s':>15}")  # fmt: skip
    for tp in (1, 2, 4):
        job = job_dict(args, world=tp, tp=tp)
        rs = launch({"job": job, "init": True, "repeats": args.repeats}, tp)
        drawn = max(r["drawn"] for r in rs)
        deferred = max(r["deferred"] for r in rs)
        print(f"{tp:>3} {max(r['params'] for r in rs) / 1e6:>11.1f}M {drawn:>9.3f} "
              f"{deferred:>12.3f} {deferred / drawn:>6.2f}x "
              f"{max(r['initialize'] for r in rs):>15.3f}")  # fmt: skip


def optimizer_worker(cfg: dict) -> None:
    """One step with ``parallel.zero`` as asked, then the bytes this rank holds for the
    optimizer (AdamW state and main parameters that are copies) and for the gradients."""
    import torch.distributed as dist

    rank, trainer = _start_rank(cfg)
    r = trainer.train_step()
    print("BENCH " + json.dumps({
        "rank": rank, "opt_bytes": trainer.main.optimizer_bytes(trainer.optimizer),
        "grad_bytes": sum(s.nbytes for s in trainer.grad_syncs), "loss": r.loss,
        "params": sum(q.numel() for q in trainer.params),
    }), flush=True)  # fmt: skip
    trainer.close()
    dist.destroy_process_group()


def optimizer_memory(args: argparse.Namespace) -> None:
    """Optimizer memory per rank, ``parallel.zero`` 0 against 1 at dp = 1, 2, 4, in fp32 and
    bf16 (issue 14): AdamW's moments and the fp32 main parameters that are copies (bf16; in
    fp32 they are the model's own storage), and the gradient buffers. ZeRO-1 shards the
    former over dp, not the gradients (ZeRO-2 would)."""
    print("\n== optimizer memory per rank (largest rank), parallel.zero 0 vs 1")
    print(f"{'dtype':>9} {'dp':>3} {'zero':>5} {'optimizer MiB':>14} {'vs zero0 dp1':>13} "
          f"{'grad buffers MiB':>17} {'final loss':>11}")  # fmt: skip
    for dtype in ("float32", "bfloat16"):
        base = None
        for dp in (1, 2, 4):
            for zero in (0, 1):
                job = job_dict(args, world=dp, tp=1)
                job["parallel"] = {"zero": zero}
                job["train"].update(dtype=dtype, steps=1)
                rs = launch({"job": job, "optimizer": True}, dp)
                opt = max(r["opt_bytes"] for r in rs) / 2**20
                grads = max(r["grad_bytes"] for r in rs) / 2**20
                base = base or opt
                print(f"{dtype:>9} {dp:>3} {zero:>5} {opt:>14.2f} {opt / base:>12.2f}x "
                      f"{grads:>17.2f} {rs[0]['loss']:>11.6f}")  # fmt: skip


# The trainer as issue 14 found it: the parent of its first commit (CUDA/NCCL correctness).
BASELINE_REV = "4657392^"


def baseline_tree(rev: str, into: str) -> str:
    """Extract the packages the benchmark imports (trainer, elasticd, checkpoint) at ``rev``
    of this checkout's git history into ``into``; returns ``into``."""
    repo = os.path.dirname(HERE)
    try:
        commit = subprocess.run(["git", "-C", repo, "rev-parse", "--verify", f"{rev}^{{commit}}"],
                                check=True, capture_output=True, text=True).stdout.strip()  # fmt: skip
    except (OSError, subprocess.CalledProcessError):
        raise SystemExit(f"--baseline-rev: {rev!r} is not a commit of this checkout "
                         "(a shallow clone has no history)") from None  # fmt: skip
    archive = subprocess.run(["git", "-C", repo, "archive", commit, "trainer", "elasticd",
                              "checkpoint"], check=True, capture_output=True).stdout  # fmt: skip
    subprocess.run(["tar", "-x", "-C", into], input=archive, check=True)
    return into


def against_baseline(args: argparse.Namespace) -> None:
    """Tokens/s of this trainer against the one at ``--baseline-rev``, the same jobs (fp32,
    zero 0, sp off: what both can run), interleaved repeat by repeat; the final losses must
    agree, or the comparison is of different work."""
    import tempfile

    tokens = args.global_batch * args.seq_len
    print(f"\n== tokens/s against the trainer at {args.baseline_rev} (fp32; median of "
          f"{args.repeats} interleaved repeats, slowest rank)")  # fmt: skip
    print(f"{'layout':>7} {'before':>10} {'now':>10} {'now/before':>11} {'final loss (both)':>18}")
    with tempfile.TemporaryDirectory(prefix="elasticd-bench-") as tmp:
        root = baseline_tree(args.baseline_rev, tmp)
        for name, world, tp in (("tp1", 1, 1), ("tp2", 2, 2), ("dp2", 2, 1)):
            got: dict[str, list[float]] = {"before": [], "now": []}
            losses = {}
            for _ in range(args.repeats):
                for side, where in (("before", root), ("now", None)):
                    cfg = {"job": job_dict(args, world=world, tp=tp), "overlap": True,
                           "steps": args.steps, "warmup": args.warmup, "root": where}  # fmt: skip
                    rs = launch(cfg, world)
                    got[side].append(tokens / max(r["step_s"] for r in rs))
                    losses[side] = rs[0]["loss"]
            before, now = statistics.median(got["before"]), statistics.median(got["now"])
            pairs = [n / b for b, n in zip(got["before"], got["now"], strict=True)]
            a, b = losses["before"], losses["now"]
            if abs(a - b) > 1e-5 * abs(a):
                raise SystemExit(f"{name}: the two trainers disagree: final loss {b} vs {a}")
            print(f"{name:>7} {before:>10,.0f} {now:>10,.0f} {now / before:>10.2f}x {b:>18.6f}"
                  f"   repeat by repeat {min(pairs):.2f}-{max(pairs):.2f}x")  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    ap.add_argument("--steps", type=int, default=6, help="timed steps per configuration")
    ap.add_argument("--warmup", type=int, default=2, help="untimed steps first")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--vocab", type=int, default=8192)
    ap.add_argument("--seq-len", type=int, default=128)
    ap.add_argument("--global-batch", type=int, default=8)
    ap.add_argument("--micro-batch", type=int, default=2)
    ap.add_argument("--bucket-mb", type=float, default=1.0)
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                    help="cuda: one GPU, GPT-2 small against a plain PyTorch loop "
                         "(bench/trainer_gpu.py); the --gpu-* options apply")  # fmt: skip
    ap.add_argument("--gpu-steps", type=int, default=20)
    ap.add_argument("--gpu-warmup", type=int, default=5)
    ap.add_argument("--gpu-micro-batch", type=int, default=8)
    ap.add_argument("--gpu-global-batch", type=int, default=32)
    ap.add_argument("--gpu-seq-len", type=int, default=1024)
    ap.add_argument("--gpu-layers", type=int, default=0, help="0: GPT-2 small's 12")
    ap.add_argument("--gpu-fp32", action="store_true", help="also the trainer in fp32+TF32")
    ap.add_argument("--optimizer-only", action="store_true",
                    help="only the optimizer memory per rank (parallel.zero 0 vs 1)")  # fmt: skip
    ap.add_argument("--baseline-rev", default=BASELINE_REV,
                    help="the trainer to compare tokens/s against (a git revision)")  # fmt: skip
    ap.add_argument("--repeats", type=int, default=3, help="repeats of the baseline comparison")
    ap.add_argument("--baseline-only", action="store_true",
                    help="only the tokens/s comparison against --baseline-rev")  # fmt: skip
    ap.add_argument("--init-only", action="store_true",
                    help="only the trainer's construction, parameters drawn vs not (init=False)")  # fmt: skip
    ap.add_argument("--activations-only", action="store_true",
                    help="only the activation memory per rank (sp, recompute)")  # fmt: skip
    args = ap.parse_args()
    if args.worker:
        cfg = json.loads(args.worker)
        if cfg.get("optimizer"):
            optimizer_worker(cfg)
            return
        if cfg.get("init"):
            init_worker(cfg)
            return
        (activation_worker if cfg.get("activations") else worker)(cfg)
        return
    if args.device == "cuda":
        from trainer_gpu import main_cuda

        raise SystemExit(main_cuda(args))
    if args.optimizer_only:
        optimizer_memory(args)
        return
    if args.activations_only:
        activation_memory(args)
        return
    if args.init_only:
        init_cost(args)
        return
    if args.baseline_only:
        against_baseline(args)
        return
    tokens = args.global_batch * args.seq_len
    print(f"model: layers {args.layers}, hidden {args.hidden}, vocab {args.vocab}, seq "
          f"{args.seq_len}; {tokens} tokens per step; {os.cpu_count()} CPU cores; gloo")  # fmt: skip
    print("\n== tensor parallelism (same model, same global batch)")
    print(
        f"{'tp':>3} {'tokens/s':>10} {'vs tp1':>7} {'state MiB/rank':>15} {'vs tp1':>7} "
        f"{'peak RSS MiB/rank':>18}"
    )
    base = None
    for tp in (1, 2, 4):
        cfg = {"job": job_dict(args, world=tp, tp=tp), "overlap": True, "steps": args.steps,
               "warmup": args.warmup}  # fmt: skip
        rs = launch(cfg, tp)
        tps = tokens / max(r["step_s"] for r in rs)
        state = max(r["state_bytes"] for r in rs) / 2**20
        rss = max(r["peak_rss"] for r in rs) / 2**20
        base = base or (tps, state)
        print(f"{tp:>3} {tps:>10,.0f} {tps / base[0]:>6.2f}x {state:>15.1f} "
              f"{state / base[1]:>6.2f}x {rss:>18.0f}")  # fmt: skip
    print("\n== data parallelism, dp=2: overlapped bucketed all-reduce vs naive after backward")
    rows = {}
    for name, overlap in (("naive", False), ("bucketed", True)):
        cfg = {"job": job_dict(args, world=2, tp=1), "overlap": overlap, "steps": args.steps,
               "warmup": args.warmup}  # fmt: skip
        rs = launch(cfg, 2)
        rows[name] = (tokens / max(r["step_s"] for r in rs), rs[0]["loss"])
        print(f"{name:>9}: {rows[name][0]:>10,.0f} tokens/s  (final loss {rows[name][1]:.6f})")
    print(f"ratio bucketed/naive: {rows['bucketed'][0] / rows['naive'][0]:.2f}x "
          f"(bucket_mb {args.bucket_mb})")  # fmt: skip
    # Both must train the same model; a faster sync that changes the numbers is no win.
    a, b = rows["naive"][1], rows["bucketed"][1]
    if abs(a - b) > 1e-5 * abs(a):
        raise SystemExit(f"bucketed and naive runs disagree: final loss {b} vs {a}")
    activation_memory(args)
    optimizer_memory(args)
    against_baseline(args)


if __name__ == "__main__":
    main()
