"""Memory of an in-process recovery: how far a survivor's peak resident memory rises above
its training peak while it recovers, with the new round's trainer adopting the previous
round's memory (the default) and allocating all of its own (``ELASTICD_ADOPT=0``), side
by side in one run.

    OMP_NUM_THREADS=1 python bench/recovery_memory.py [--cases dp,dp-bf16,move]
        [--repeats 2] [--kill-step 6] [--json out.json]

Each run trains the built-in GPT (4 layers, hidden 512, ffn 2048, vocab 8192, seq 32;
20.9 M parameters) under a real local cluster (etcd, one agent a node, gloo, one worker a
node, ``restart.mode: inprocess``, ``checkpoint.every: 0``) and SIGKILLs one node:

- ``dp``: dp3 -> dp2, fp32 (every survivor keeps every box);
- ``dp-bf16``: the same in bf16 (a bf16 model and fp32 main copies);
- ``move``: tp2 x dp2 -> tp2 x dp1, rank 0's node killed; the re-formed world is placed so
  that the survivors keep their tp shards (``elasticd.layout.keep_shards``);
- ``move-plain``: the same in the rendezvous's plain order (``ELASTICD_KEEP_SHARDS=0``):
  every survivor takes another tp index, so every shard moves.

The time from the kill to the first record of the re-formed world is printed too
(``seconds``), with rank 0's MB received.

Per survivor, from ``/proc/PID/status``: the peak resident memory (``VmHWM``) is reset
(``/proc/PID/clear_refs``, 5) once step ``--kill-step`` is done and read two steps later:
the *training peak* (a step's gradients and activations included); then reset again, the
node killed, and read once the re-formed world has completed two steps: the *recovery
peak*. ``rise`` = recovery peak - training peak, the largest over the survivors; a
process restart's would be its whole state again, and so was in-process recovery's
before adoption. The state (parameters, main copies, AdamW) a rank holds is printed
beside it, and rank 0's "MB of the previous round's memory kept".

Linux only (``clear_refs``). The machine's other work does not enter: each figure is one
process's own pages.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import signal
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from recovery import read_records, wait_until  # bench/recovery.py: the same helpers

JOB = "memory"
MODEL = {"layers": 4, "hidden": 512, "heads": 8, "ffn_hidden": 2048, "vocab": 8192, "seq_len": 32}
# name -> (nodes, parallel, dtype, global rank whose node is killed)
CASES = {
    "dp": (3, {}, "float32", 1),
    "dp-bf16": (3, {}, "bfloat16", 1),
    "move": (4, {"tp": 2}, "float32", 0),
    "move-plain": (4, {"tp": 2}, "float32", 0),
}
KEPT = re.compile(r"([\d.]+) MB of the previous round's memory kept")
RECEIVED = re.compile(r"from (?:peers|replica) at step \d+ \(([\d.]+) MB received")


def job_dict(out: str, *, nodes: int, parallel: dict, dtype: str) -> dict:
    return {
        "name": JOB,
        "output_dir": out,
        "nodes": {"min": max(1, parallel.get("tp", 1)), "max": nodes},
        "nproc_per_node": 1,
        "parallel": parallel,
        "model": MODEL,
        "train": {"steps": 100_000, "global_batch": 12, "micro_batch": 2, "dtype": dtype},
        "checkpoint": {"every": 0, "dir": os.path.join(out, "ckpt")},
        "restart": {"mode": "inprocess", "standby": 0},
        "rendezvous": {"ttl": 3.0, "settle": 1.0},
    }


def status_kb(pid: int, field: str) -> int:
    with open(f"/proc/{pid}/status", encoding="ascii") as fh:
        for line in fh:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise KeyError(field)


def reset_peak(pid: int) -> None:
    with open(f"/proc/{pid}/clear_refs", "w", encoding="ascii") as fh:
        fh.write("5")


def state_mb(dtype: str, tp: int) -> float:
    """Parameters + fp32 main copies (bf16) + AdamW moments a rank holds, MB."""
    from elasticd.jobspec import parse_job
    from elasticd.layout import plan
    from trainer.parallel.context import ParallelContext
    from trainer.train import Trainer

    raw = job_dict("/nonexistent", nodes=1, parallel={}, dtype=dtype)
    job = parse_job(raw)
    trainer = Trainer(job=job, layout=plan(1, job), ctx=ParallelContext.single(), dp_rank=0,
                      init=False)  # fmt: skip
    params = sum(p.numel() * p.element_size() for p in trainer.params)
    main = sum(t.numel() * 4 for _, t, _ in trainer.named_main()) if dtype != "float32" else 0
    return (params + main + 2 * sum(t.numel() * 4 for _, t, _ in trainer.named_main())) / tp / 1e6


def run_case(base: str, case: str, *, adopt: bool, kill_step: int, limit: float) -> dict:
    from elasticd.etcd import connect
    from elasticd.jobs import JobRegistry
    from elasticd.jobspec import parse_job
    from elasticd.localcluster import LocalCluster

    nodes, parallel, dtype, victim_rank = CASES[case]
    out = os.path.join(base, "out")
    env = dict(os.environ, ELASTICD_ADOPT="1" if adopt else "0")
    if case == "move-plain":
        env["ELASTICD_KEEP_SHARDS"] = "0"
    metrics = os.path.join(out, "metrics.jsonl")

    def reached(step: int, world: int) -> bool:
        return any(r["step"] >= step and r["world"] == world for r in read_records(metrics))

    with LocalCluster(base_dir=os.path.join(base, "cluster"), nproc=1, env=env) as cluster:
        cluster.start(nodes)
        with connect(cluster.etcd.client_config()) as client:
            reg = JobRegistry(client)
            if not wait_until(lambda: len(client.get_prefix("/elasticd/nodes/")[0]) == nodes, 60):
                return {"error": "the agents did not register"}
            reg.submit(parse_job(job_dict(out, nodes=nodes, parallel=parallel, dtype=dtype)))
            if not wait_until(lambda: reached(kill_step, nodes), limit):
                return {"error": f"did not reach step {kill_step}"}
            victim = next(i for i in range(nodes) if victim_rank in cluster.worker_pids(i))
            survivors = [p for i in range(nodes) if i != victim
                         for p in cluster.worker_pids(i).values()]  # fmt: skip
            for pid in survivors:
                reset_peak(pid)
            at = max(r["step"] for r in read_records(metrics))
            if not wait_until(lambda: reached(at + 2, nodes), limit):
                return {"error": "training stopped before the kill"}
            training = {pid: status_kb(pid, "VmHWM") for pid in survivors}
            for pid in survivors:
                reset_peak(pid)
            old_round = max(r["round"] for r in read_records(metrics))
            killed = time.time()
            cluster.kill_node(victim)
            first = wait_until(lambda: next((r for r in read_records(metrics)
                                             if r["round"] > old_round), None), limit)  # fmt: skip
            if first is None:
                return {"error": "no step in the re-formed world"}
            seconds = time.time() - killed
            if not wait_until(lambda: reached(first["step"] + 1, nodes - 1), limit):
                return {"error": "the re-formed world stopped"}
            try:
                recovery = {pid: status_kb(pid, "VmHWM") for pid in survivors}
            except (OSError, KeyError):
                return {"error": "a survivor's process is gone: not recovered in-process"}
            with contextlib.suppress(Exception):
                reg.cancel(JOB)
    kept, received = [], []
    for root, _, files in os.walk(os.path.join(out, "logs")):
        for name in files:
            with open(os.path.join(root, name), encoding="utf-8", errors="replace") as fh:
                text = fh.read()
            kept += [float(m) for m in KEPT.findall(text)]
            received += [float(m) for m in RECEIVED.findall(text)]
    rise = {pid: (recovery[pid] - training[pid]) / 1024 for pid in survivors}
    return {
        "rise_mb": max(rise.values()), "rises_mb": sorted(rise.values()),
        "training_peak_mb": max(training.values()) / 1024,
        "recovery_peak_mb": max(recovery.values()) / 1024,
        "kept_mb": kept[-1] if kept else 0.0, "first_step": first["step"],
        "seconds": seconds, "received_mb": received[-1] if received else None,
        "training_mb": {str(p): v / 1024 for p, v in training.items()},
        "recovery_mb": {str(p): v / 1024 for p, v in recovery.items()},
    }  # fmt: skip


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    p.add_argument("--cases", default=",".join(CASES), help=f"any of {','.join(CASES)}")
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--kill-step", type=int, default=6)
    p.add_argument("--limit", type=float, default=180.0)
    p.add_argument("--json", help="also write every run here")
    args = p.parse_args()
    names = [c for c in args.cases.split(",") if c]
    if bad := [c for c in names if c not in CASES]:
        p.error(f"unknown case(s) {bad}; known: {','.join(CASES)}")
    if not os.path.exists("/proc/self/clear_refs"):
        print("recovery_memory: needs Linux's /proc/PID/clear_refs", file=sys.stderr)
        return 2
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    sizes = {c: state_mb(CASES[c][2], CASES[c][1].get("tp", 1)) for c in names}
    print("recovery_memory: a survivor's peak RSS during an in-process recovery, above its "
          "training peak (MB)")  # fmt: skip
    print(f"{'case':<10} {'adopt':<5} {'run':>3} {'state MB':>8} {'train pk':>8} {'recov pk':>8} "
          f"{'rise':>7} {'kept MB':>7} {'recv MB':>7} {'seconds':>7}")  # fmt: skip
    results: dict[str, list[dict]] = {}
    for rep in range(args.repeats):
        for case in names:
            for adopt in (True, False):  # side by side, alternating
                key = f"{case}/{'yes' if adopt else 'no'}"
                with tempfile.TemporaryDirectory(prefix="bench-recmem-") as tmp:
                    res = run_case(tmp, case, adopt=adopt, kill_step=args.kill_step,
                                   limit=args.limit)  # fmt: skip
                res["load"] = os.getloadavg()[0]
                results.setdefault(key, []).append(res)
                if "error" in res:
                    print(f"{case:<8} {key[-3:]:<5} {rep + 1:>3} n/a  {res['error']}", flush=True)
                    continue
                print(f"{case:<10} {key.split('/')[1]:<5} {rep + 1:>3} {sizes[case]:>8.1f} "
                      f"{res['training_peak_mb']:>8.1f} {res['recovery_peak_mb']:>8.1f} "
                      f"{res['rise_mb']:>7.1f} {res['kept_mb']:>7.1f} "
                      f"{res['received_mb'] if res['received_mb'] is not None else '-':>7} "
                      f"{res['seconds']:>7.2f}", flush=True)  # fmt: skip
    print("\nsummary (medians of the largest rise over the survivors)")
    for case in names:
        med = {}
        for adopt in ("yes", "no"):
            ok = [r["rise_mb"] for r in results.get(f"{case}/{adopt}", []) if "rise_mb" in r]
            med[adopt] = statistics.median(ok) if ok else None
        if med["yes"] is None or med["no"] is None:
            print(f"{case:<8} n/a (failed runs)")
            continue
        secs = {a: statistics.median(r["seconds"] for r in results[f"{case}/{a}"] if "seconds" in r)
                for a in ("yes", "no")}  # fmt: skip
        print(f"{case:<10} state {sizes[case]:.1f} MB a rank: rise adopting {med['yes']:.1f} MB "
              f"({med['yes'] / sizes[case]:.2f}x the state), allocating {med['no']:.1f} MB "
              f"({med['no'] / sizes[case]:.2f}x); kill -> first step {secs['yes']:.2f} s "
              f"adopting, {secs['no']:.2f} s allocating")  # fmt: skip
    if args.json:
        with open(args.json, "w", encoding="utf-8") as fh:
            json.dump({"args": vars(args), "state_mb": sizes, "runs": results}, fh, indent=1)
    return 0


if __name__ == "__main__":
    with contextlib.suppress(KeyboardInterrupt):
        signal.signal(signal.SIGTERM, signal.default_int_handler)
        sys.exit(main())
