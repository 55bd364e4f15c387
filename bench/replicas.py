"""Replica benchmark: what ``checkpoint.memory_replicas`` costs in step time and host memory.

    OMP_NUM_THREADS=1 python bench/replicas.py [--repeats 3] [--steps 40] [--warmup 5]
        [--configs base,every1,every10] [--no-probe] [--json out.json]

Each run trains the built-in GPT (4 layers, hidden 256, ffn 1024, seq 64, vocab 256,
fp32, global batch 8; 1.63 M parameters a rank, 19.6 MB of parameters + AdamW state: 12
bytes a parameter, plus a 16-byte slot per 0-d AdamW step) under a real local cluster: etcd,
two agents (2 nodes × 1 worker), gloo, layout tp2 (each rank holds a distinct shard, so
each rank's copy goes to the other node), ``restart.mode: inprocess``,
``checkpoint.every: 0`` (one save after the last step, outside the measured steps).
Configurations, interleaved (repeat 1 of each, then repeat 2, ...), so a load spike from
other work hits them alike:

- ``base``: ``memory_replicas: 0`` (the baseline);
- ``every1``: ``memory_replicas: 1``, ``memory_every: 1``;
- ``every10``: ``memory_replicas: 1``, ``memory_every: 10``.

Per run, from rank 0's metrics.jsonl over the steps after ``--warmup``:

- ``step_s``: the trainer's own time of ``train_step`` (the record's ``step_s``), median.
  The replication runs after it (in the loop's ``after_step``), so this shows what the
  background transfer takes from the next steps' compute, plus rank 1's own replication
  (rank 0's next step waits for it at its first TP collective);
- ``interval``: the time between consecutive records (the file's mtime after each append,
  polled every few ms), which does include the replication; median and mean. With
  ``memory_every: 10`` only one step in ten replicates, so its median hides the cost and
  the mean is the amortised figure;
- ``block``: per replication, the median of (interval − step_s) over the steps that
  follow a replicated step, minus the baseline's median (interval − step_s): the time
  ``Replicator.after_step`` held rank 0's training loop (snapshot copy, posting the
  transfer, and waiting for the previous one).

Every run must end with the job succeeded, no recovery, one round; the last step's loss
is compared across configurations (replication must not change training). The workers'
resident memory (VmRSS) is sampled at 3/4 of the steps.

The probe (before the runs, skip with ``--no-probe``): two gloo processes build the same
trainer (tp2) and the product's ``trainer.replicas.Replicator`` (nodes told apart), take
two training steps, then time ``after_step`` with nothing in flight (snapshot copy into
host memory + posting the isend/irecv) and the transfer's wait separately, ``--probe-rounds``
times. It also reports ``Replicator.bytes_held`` (2 snapshots + 2 copies of the peer's
state per kept replica) and the state's size, exactly as the product lays them out.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from recovery import wait_until  # bench/recovery.py: the same polling helper

JOB = "bench"
NODES = 2
MODEL = {"layers": 4, "hidden": 256, "heads": 4, "ffn_hidden": 1024, "seq_len": 64,
         "vocab": 256}  # fmt: skip
# name -> (memory_replicas, memory_every)
CONFIGS: dict[str, tuple[int, int]] = {"base": (0, 1), "every1": (1, 1), "every10": (1, 10)}
TERMINAL = ("succeeded", "failed", "cancelled")


def job_dict(out: str, steps: int, *, replicas: int, every: int) -> dict:
    return {
        "name": JOB,
        "output_dir": out,
        "nodes": {"min": NODES, "max": NODES},
        "nproc_per_node": 1,
        "parallel": {"tp": 2},
        "model": dict(MODEL),
        "train": {"steps": steps, "global_batch": 8, "micro_batch": 4},
        "checkpoint": {
            "every": 0,
            "dir": os.path.join(out, "ckpt"),
            "memory_replicas": replicas,
            "memory_every": every,
        },
        "restart": {"mode": "inprocess"},
        "rendezvous": {"ttl": 5.0, "settle": 1.0},
    }


def rss_mb(pid: int) -> float | None:
    try:
        with open(f"/proc/{pid}/status", encoding="utf-8") as fh:
            for line in fh:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        return None
    return None


# -- the probe: the product's Replicator on two gloo processes ------------------------------


def _probe_worker(rank: int, store: str, steps: int, rounds: int, out: str) -> None:
    from datetime import timedelta

    import torch
    import torch.distributed as dist

    from elasticd.jobspec import parse_job
    from elasticd.layout import plan
    from trainer.parallel.context import ParallelContext, slot_of
    from trainer.parallel.groups import ProcessGroups
    from trainer.parallel.pipeline import PipelineGroups
    from trainer.recovery import holdings
    from trainer.replicas import Replicator
    from trainer.train import Trainer

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank,
                            world_size=NODES, timeout=timedelta(seconds=300))  # fmt: skip
    job = parse_job(job_dict(os.path.dirname(store), steps, replicas=1, every=1))
    layout = plan(NODES, job)
    groups = ProcessGroups.build(layout, rank=rank)
    torch.manual_seed(job.train.seed + groups.index("dp"))
    trainer = Trainer(
        job=job, layout=layout, ctx=ParallelContext.from_groups(groups),
        dp_rank=groups.index("dp"), model_groups=(slot_of(groups, "tp-dp-cp"),),
        pipeline=PipelineGroups.from_groups(groups),
    )  # fmt: skip
    for _ in range(2):
        trainer.train_step()
    rep = Replicator(live=lambda: holdings(trainer, create=True), copies=1, every=1,
                     node=f"node-{rank}", group=None)  # fmt: skip
    params = sum(p.numel() for _, p in trainer.named_parameters())
    copy_s, wait_s = [], []
    for i in range(rounds):
        dist.barrier()
        t0 = time.perf_counter()
        rep.after_step(trainer.state.step + i, trainer.state.consumed_samples)
        t1 = time.perf_counter()
        rep.close()  # waits for this replication's send and receive
        t2 = time.perf_counter()
        copy_s.append(t1 - t0)
        wait_s.append(t2 - t1)
    held = rep.held()
    result = {
        "rank": rank, "params": params, "bytes_held": rep.bytes_held,
        "snapshot_bytes": rep.snapshots[0].flat.numel() if rep.snapshots else 0,
        "to": rep.to, "keeps": sorted(rep.replicas), "held_steps": sorted(h.step for h in held),
        "after_step_s": copy_s, "transfer_wait_s": wait_s,
    }  # fmt: skip
    with open(f"{out}.{rank}", "w", encoding="utf-8") as fh:
        json.dump(result, fh)
    trainer.close()
    groups.destroy()
    dist.destroy_process_group()


def run_probe(rounds: int) -> dict:
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory(prefix="bench-replicas-probe-") as tmp:
        out = os.path.join(tmp, "probe.json")
        mp.spawn(_probe_worker, args=(os.path.join(tmp, "store"), 4, rounds, out),
                 nprocs=NODES, join=True)  # fmt: skip
        ranks = []
        for r in range(NODES):
            with open(f"{out}.{r}", encoding="utf-8") as fh:
                ranks.append(json.load(fh))
    return {"ranks": ranks}


# -- one cluster run -------------------------------------------------------------------------


def run_once(base: str, config: str, *, steps: int, limit: float) -> dict:
    from elasticd.etcd import connect
    from elasticd.jobs import JobRegistry
    from elasticd.jobspec import parse_job
    from elasticd.localcluster import LocalCluster, MetricsTail

    replicas, every = CONFIGS[config]
    out = os.path.join(base, "out")
    job = parse_job(job_dict(out, steps, replicas=replicas, every=every))
    metrics = os.path.join(out, "metrics.jsonl")
    records: dict[int, dict] = {}
    stamps: dict[int, int] = {}  # step -> mtime_ns of the append that ended with its record
    rss: dict[int, float] = {}
    with LocalCluster(base_dir=os.path.join(base, "cluster"), nproc=1) as cluster:
        cluster.start(NODES)
        with connect(cluster.etcd.client_config()) as client:
            reg = JobRegistry(client)
            if not wait_until(lambda: len(client.get_prefix("/elasticd/nodes/")[0]) == NODES,
                              60):  # fmt: skip
                return {"error": "the agents did not register"}
            reg.submit(job)
            tail, size = MetricsTail(path=metrics), -1
            deadline = time.monotonic() + limit
            checked = time.monotonic()
            while time.monotonic() < deadline:
                try:
                    st = os.stat(metrics)
                except OSError:
                    st = None
                if st is not None and st.st_size != size:
                    size = st.st_size
                    new = tail.new()
                    for rec in new:
                        records.setdefault(rec["step"], rec)
                    # Only the last record of an append batch has its write time: the
                    # file's mtime (fine-grained here) is that of the newest write.
                    if new and tail.offset == size:
                        stamps.setdefault(new[-1]["step"], st.st_mtime_ns)
                top = max(records, default=0)
                if not rss and top >= steps * 3 // 4:
                    for i in range(NODES):
                        for r, pid in cluster.worker_pids(i).items():
                            if (m := rss_mb(pid)) is not None:
                                rss[r] = m
                if top >= steps:
                    break
                if time.monotonic() - checked > 1.0:  # a job that ended early
                    checked = time.monotonic()
                    j = reg.get(JOB)
                    if j is not None and str(j.state) in TERMINAL:
                        break
                time.sleep(0.004)
            got = wait_until(lambda: (j := reg.get(JOB)) is not None
                             and str(j.state) in TERMINAL and j, 60)  # fmt: skip
            final = got or reg.get(JOB)
            state = str(final.state) if final is not None else "unknown"
            history = final.status.get("history", []) if final is not None else []
            recoveries = [e for e in history if e.get("kind") == "recovery"]
            if state not in TERMINAL:
                with contextlib.suppress(Exception):
                    reg.cancel(JOB)
    res = {"state": state, "recoveries": len(recoveries),
           "rounds": sorted({r["round"] for r in records.values()}), "steps": len(records),
           "records": {str(k): {"step_s": v["step_s"], "loss": v["loss"]}
                       for k, v in sorted(records.items())},
           "stamps": {str(k): v for k, v in sorted(stamps.items())}, "rss_mb": rss}  # fmt: skip
    if max(records, default=0) < steps:
        res["error"] = f"reached step {max(records, default=0)} of {steps} (job {state})"
    elif state != "succeeded" or recoveries or len(res["rounds"]) != 1:
        res["error"] = f"job {state}, {len(recoveries)} recoveries, rounds {res['rounds']}"
    if records:
        res["last_loss"] = records[max(records)]["loss"]
    return res


def analyse(res: dict, *, warmup: int, every: int) -> dict:
    """Per-run figures over the steps after ``warmup`` (see the module docstring)."""
    recs = {int(k): v for k, v in res["records"].items()}
    stamps = {int(k): v for k, v in res["stamps"].items()}
    steps = [k for k in sorted(recs) if k > warmup]
    step_s = [recs[k]["step_s"] for k in steps]
    gaps = {k: (stamps[k] - stamps[k - 1]) / 1e9 for k in steps if k in stamps and k - 1 in stamps}
    out = {"step_s": statistics.median(step_s), "timed": len(gaps)}
    if gaps:
        out["interval"] = statistics.median(gaps.values())
        out["interval_mean"] = statistics.mean(gaps.values())
        out["outside"] = statistics.median(gaps[k] - recs[k]["step_s"] for k in gaps)
        after = [gaps[k] - recs[k]["step_s"] for k in gaps if (k - 1) % every == 0]
        if after:
            out["outside_after_rep"] = statistics.median(after)
    if t := [stamps[k] for k in (warmup, max(recs)) if k in stamps]:
        if len(t) == 2:  # the whole window, immune to a missed stamp
            out["window_mean"] = (t[1] - t[0]) / 1e9 / (max(recs) - warmup)
    return out


# -- report ----------------------------------------------------------------------------------


def summarize(results: dict[str, list[dict]], *, warmup: int, held: dict[str, float]) -> list:
    rows = []
    for config, runs in results.items():
        ok = [r for r in runs if "error" not in r]
        row: dict = {"config": config, "runs": len(runs), "ok": len(ok),
                     "held_mb": held.get(config)}  # fmt: skip
        if ok:
            per = [analyse(r, warmup=warmup, every=CONFIGS[config][1]) for r in ok]
            for key in ("step_s", "interval", "interval_mean", "window_mean", "outside",
                        "outside_after_rep"):  # fmt: skip
                vals = [p[key] for p in per if key in p]
                if vals:
                    row[key] = statistics.median(vals)
            rss = [statistics.mean(r["rss_mb"].values()) for r in ok if r["rss_mb"]]
            if rss:
                row["rss_mb"] = statistics.median(rss)
            row["losses"] = sorted({r["last_loss"] for r in ok})
        rows.append(row)
    base = next((r for r in rows if r["config"] == "base"), None)
    for row in rows:
        if base is None or row is base:
            continue
        for key in ("step_s", "interval", "interval_mean", "window_mean"):
            if key in row and key in base:
                row[f"{key}_ratio"] = row[key] / base[key]
        if "outside_after_rep" in row and "outside" in base:
            row["block"] = row["outside_after_rep"] - base["outside"]
        if "rss_mb" in row and "rss_mb" in base:
            row["rss_delta_mb"] = row["rss_mb"] - base["rss_mb"]
    return rows


def _ms(row: dict, key: str) -> str:
    return f"{row[key] * 1000:.1f}" if key in row else "-"


def _ratio(row: dict, key: str) -> str:
    k = f"{key}_ratio"
    return f"{row[k]:.3f} ({(row[k] - 1) * 100:+.1f}%)" if k in row else "1"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--warmup", type=int, default=5, help="steps left out of the figures")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--configs", default=",".join(CONFIGS), help=f"any of {','.join(CONFIGS)}")
    p.add_argument("--limit", type=float, default=300.0, help="give up on a run after this")
    p.add_argument("--no-probe", action="store_true", help="skip the Replicator probe")
    p.add_argument("--probe-rounds", type=int, default=10)
    p.add_argument("--json", help="also write every run and the summary here")
    args = p.parse_args()
    configs = [c for c in args.configs.split(",") if c]
    if bad := [c for c in configs if c not in CONFIGS]:
        p.error(f"unknown config(s) {bad}; known: {','.join(CONFIGS)}")
    if args.steps <= args.warmup + 2:
        p.error("--steps must exceed --warmup by more than 2")
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    print(f"model {MODEL}, tp2 on {NODES} nodes x 1 worker, gloo, {os.cpu_count()} cores; "
          f"{args.steps} steps, the first {args.warmup} left out")  # fmt: skip
    probe: dict = {}
    held: dict[str, float] = {}
    if not args.no_probe:
        probe = run_probe(args.probe_rounds)
        for r in probe["ranks"]:
            print(f"probe rank {r['rank']}: {r['params']:,} local parameters, state (snapshot) "
                  f"{r['snapshot_bytes'] / 1e6:.2f} MB, Replicator.bytes_held "
                  f"{r['bytes_held'] / 1e6:.2f} MB, sends to {r['to']}, keeps {r['keeps']}; "
                  f"after_step (snapshot copy + post) median "
                  f"{statistics.median(r['after_step_s']) * 1000:.1f} ms, transfer wait "
                  f"{statistics.median(r['transfer_wait_s']) * 1000:.1f} ms "
                  f"({len(r['after_step_s'])} rounds)")  # fmt: skip
        mb = statistics.mean(r["bytes_held"] for r in probe["ranks"]) / 1e6
        held = {c: mb if CONFIGS[c][0] else 0.0 for c in CONFIGS}
    print(f"\n{'config':<8} {'run':>3} {'step_s ms':>9} {'interval ms':>11} {'mean ms':>8} "
          f"{'RSS MB':>7} {'loss':>8}  load")  # fmt: skip
    results: dict[str, list[dict]] = {c: [] for c in configs}
    for rep in range(args.repeats):  # configurations interleaved
        for config in configs:
            with tempfile.TemporaryDirectory(prefix="bench-replicas-") as tmp:
                res = run_once(tmp, config, steps=args.steps, limit=args.limit)
            res["load"] = os.getloadavg()[0]
            results[config].append(res)
            if "error" in res:
                print(f"{config:<8} {rep + 1:>3} {res['error']}", flush=True)
                continue
            a = analyse(res, warmup=args.warmup, every=CONFIGS[config][1])
            rss = statistics.mean(res["rss_mb"].values()) if res["rss_mb"] else float("nan")
            print(f"{config:<8} {rep + 1:>3} {a['step_s'] * 1000:>9.1f} {_ms(a, 'interval'):>11} "
                  f"{_ms(a, 'interval_mean'):>8} {rss:>7.0f} {res['last_loss']:>8.5f}  "
                  f"{res['load']:.1f}  ({a['timed']} intervals timed)", flush=True)  # fmt: skip
    rows = summarize(results, warmup=args.warmup, held=held)
    print("\nsummary: medians over runs; ratio = this / base (overhead in %)")
    print(f"{'config':<8} {'step_s ms':>9} {'ratio':>16} {'interval ms':>11} {'ratio':>16} "
          f"{'mean ms':>8} {'ratio':>16} {'block ms':>8} {'held MB':>8} {'RSS +MB':>8}")  # fmt: skip
    for row in rows:
        if "step_s" not in row:
            print(f"{row['config']:<8} n/a ({row['runs']} runs failed)")
            continue
        block = _ms(row, "block")
        delta = f"{row['rss_delta_mb']:+.0f}" if "rss_delta_mb" in row else "-"
        mb = "-" if row["held_mb"] is None else f"{row['held_mb']:.1f}"  # no probe: unknown
        print(f"{row['config']:<8} {_ms(row, 'step_s'):>9} {_ratio(row, 'step_s'):>16} "
              f"{_ms(row, 'interval'):>11} {_ratio(row, 'interval'):>16} "
              f"{_ms(row, 'interval_mean'):>8} {_ratio(row, 'interval_mean'):>16} "
              f"{block:>8} {mb:>8} {delta:>8}"
              + (f"  ({row['ok']}/{row['runs']} ok)" if row["ok"] < row["runs"] else ""))  # fmt: skip
    losses = {x for row in rows for x in row.get("losses", [])}
    print(f"last-step loss: {'identical in every run' if len(losses) == 1 else sorted(losses)}")
    if args.json:
        with open(args.json, "w", encoding="utf-8") as fh:
            json.dump({"args": vars(args), "probe": probe, "runs": results, "summary": rows},
                      fh, indent=1)  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
