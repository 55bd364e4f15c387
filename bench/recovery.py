"""Recovery benchmark: SIGKILL of one node → the first completed step in the re-formed world.

Both sides run the same built-in trainer on the same job (2 nodes × 1 worker on this
machine, gloo, a checkpoint every few steps) and lose a node the same way: SIGKILL of the
node's launcher and its workers once step S has completed. The time runs from the kill to
the first metrics.jsonl record written by the smaller world.

- elasticd: `elasticd agent` × 2 on an embedded etcd (job TTL 3 s, the default), and the
  parts of the recovery as the agent recorded them (detection, stop, rendezvous, spawn,
  process-group init, first step: model build, checkpoint load and one step).
- torchrun: two `torchrun --nnodes 1:2 --rdzv-backend c10d --max-restarts 3` launchers with
  torch's defaults. The first to start hosts the c10d store.

Two cases: the node that is killed does not host rank 0 / the store, and it does.

    python bench/recovery.py [--steps 40] [--kill-step 10] [--limit 150] [--repeats 1]
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import contextlib

from elasticd.etcd import free_port
from elasticd.localcluster import descendants


def job_dict(out: str, steps: int, ttl: float) -> dict:
    return {
        "name": "bench",
        "output_dir": out,
        "nodes": {"min": 1, "max": 2},
        "nproc_per_node": 1,
        "model": {"layers": 4, "hidden": 64, "heads": 4, "ffn_hidden": 256, "seq_len": 64},
        "train": {"steps": steps, "global_batch": 12, "micro_batch": 2},
        "checkpoint": {"every": 5, "dir": os.path.join(out, "ckpt")},
        "rendezvous": {"ttl": ttl, "settle": 1.0},
    }


def read_records(path: str) -> list[dict]:
    try:
        with open(path, encoding="utf-8") as fh:
            return [json.loads(line) for line in fh if line.strip().endswith("}")]
    except OSError:
        return []


def wait_until(predicate, limit: float, interval: float = 0.02):
    deadline = time.monotonic() + limit
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(interval)
    return None


def first_step_after(metrics: str, world: int, limit: float) -> float | None:
    """Wall time when a record of a world of ``world`` ranks first appears, or None."""

    def seen() -> float | None:
        return time.time() if any(r["world"] == world for r in read_records(metrics)) else None

    return wait_until(seen, limit)


# -- elasticd ------------------------------------------------------------------------------


def run_elasticd(base: str, *, steps: int, kill_step: int, kill_host: bool, limit: float) -> dict:
    from elasticd.etcd import connect
    from elasticd.jobs import JobRegistry
    from elasticd.jobspec import parse_job
    from elasticd.localcluster import LocalCluster

    out = os.path.join(base, "out")
    job = parse_job(job_dict(out, steps, ttl=3.0))
    metrics = os.path.join(out, "metrics.jsonl")
    with LocalCluster(base_dir=os.path.join(base, "cluster"), nproc=1) as cluster:
        cluster.start(2)
        with connect(cluster.etcd.client_config()) as client:
            reg = JobRegistry(client)
            wait_until(lambda: len(client.get_prefix("/elasticd/nodes/")[0]) == 2, 60)
            reg.submit(job)
            if not wait_until(
                lambda: any(r["step"] >= kill_step for r in read_records(metrics)), limit
            ):
                return {"error": "did not reach the kill step"}
            victim = next(
                i for i in range(2)
                if (0 in cluster.worker_pids(i)) == kill_host and cluster.worker_pids(i)
            )  # fmt: skip
            killed = time.time()
            cluster.kill_node(victim)
            done = first_step_after(metrics, 1, limit)
            if done is None:
                return {"error": f"no step in the new world within {limit:g} s"}
            record = wait_until(lambda: _recovery(reg.get("bench")), 10) or {}
            reg.cancel("bench")
    parts = {"detection": record.get("detected_at", killed) - killed, **record.get("parts", {})}
    return {"seconds": done - killed, "parts": parts}


def _recovery(record) -> dict | None:
    events = [e for e in record.status.get("history", []) if e.get("kind") == "recovery"]
    return events[-1] if events else None


# -- torchrun ------------------------------------------------------------------------------


def run_torchrun(base: str, *, steps: int, kill_step: int, kill_host: bool, limit: float) -> dict:
    out = os.path.join(base, "out")
    os.makedirs(out, exist_ok=True)
    job_path = os.path.join(base, "job.json")
    with open(job_path, "w", encoding="utf-8") as fh:
        json.dump(job_dict(out, steps, ttl=3.0), fh)
    metrics = os.path.join(out, "metrics.jsonl")
    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith(("ELASTICD_", "TORCHELASTIC"))}
    env["OMP_NUM_THREADS"] = "1"
    procs = []
    try:
        for i in range(2):
            argv = [
                sys.executable, "-m", "torch.distributed.run", "--nnodes", "1:2",
                "--nproc-per-node", "1", "--rdzv-backend", "c10d",
                "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", "bench",
                "--max-restarts", "3", "--monitor-interval", "0.5",
                "-m", "trainer", job_path,
            ]  # fmt: skip
            log = open(os.path.join(base, f"torchrun-{i}.log"), "wb")  # noqa: SIM115
            procs.append(subprocess.Popen(argv, env=env, stdout=log, stderr=subprocess.STDOUT,
                                          start_new_session=True, cwd=base))  # fmt: skip
            log.close()
            if i == 0:
                time.sleep(2.0)  # the first launcher hosts the c10d store
        if not wait_until(lambda: any(r["world"] == 2 and r["step"] >= kill_step
                                      for r in read_records(metrics)), limit):  # fmt: skip
            return {"error": "did not reach the kill step in a world of 2"}
        victim = procs[0] if kill_host else procs[1]
        # torchrun's workers live in sessions of their own: a node dying takes them too.
        tree = descendants(victim.pid)
        killed = time.time()
        os.killpg(victim.pid, signal.SIGKILL)
        for pid in tree:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        done = first_step_after_kill(metrics, killed, limit)
        if done is None:
            survivor = procs[1] if kill_host else procs[0]
            state = "exited" if survivor.poll() is not None else "still waiting"
            return {"error": f"no step in a new world within {limit:g} s (survivor {state})"}
        return {"seconds": done - killed, "parts": {}}
    finally:
        for p in procs:
            for pid in [*descendants(p.pid), p.pid]:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            p.wait()


def first_step_after_kill(metrics: str, killed: float, limit: float) -> float | None:
    count = len(read_records(metrics))

    def seen() -> float | None:
        fresh = read_records(metrics)[count:]
        return time.time() if any(r["world"] == 1 for r in fresh) else None

    return wait_until(seen, limit)


# -- report --------------------------------------------------------------------------------


def fmt(result: dict) -> str:
    return f"{result['seconds']:.2f}" if "seconds" in result else "n/a"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--kill-step", type=int, default=10)
    p.add_argument("--limit", type=float, default=150.0, help="give up on a recovery after this")
    p.add_argument("--repeats", type=int, default=1)
    p.add_argument("--cases", default="non-host,host")
    args = p.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    print("recovery: SIGKILL of one of 2 nodes -> first step of the re-formed world, seconds")
    print(f"{'case':<10} {'run':>3} {'elasticd':>9} {'torchrun':>9} {'ratio':>7}  elasticd parts")
    for case in args.cases.split(","):
        for rep in range(args.repeats):
            kw = {"steps": args.steps, "kill_step": args.kill_step,
                  "kill_host": case == "host", "limit": args.limit}  # fmt: skip
            with tempfile.TemporaryDirectory(prefix="bench-recovery-") as tmp:
                ours = run_elasticd(os.path.join(tmp, "e"), **kw)
                base = run_torchrun(os.path.join(tmp, "t"), **kw)
            ratio = (f"{base['seconds'] / ours['seconds']:.1f}x"
                     if "seconds" in ours and "seconds" in base else "-")  # fmt: skip
            got = ours.get("parts", {})
            order = ("detection", "stop", "rendezvous", "spawn", "pg_init", "ckpt_load",
                     "first_step")  # fmt: skip
            parts = " ".join(f"{k} {got[k]:.2f}" for k in order if k in got)
            print(f"{case:<10} {rep + 1:>3} {fmt(ours):>9} {fmt(base):>9} {ratio:>7}  {parts}",
                  flush=True)  # fmt: skip
            for side, res in (("elasticd", ours), ("torchrun", base)):
                if "error" in res:
                    print(f"{'':<14}{side}: {res['error']}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
