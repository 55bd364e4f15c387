"""`elasticd run`: a one-command local cluster with optional fault injection."""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import time
from typing import Any

from elasticd.errors import UsageError


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "run",
        help="run a job on a local cluster (embedded etcd, N agents), with faults",
        description="Start an embedded etcd and N agents as separate processes, submit the "
        "job, follow it to the end, and print a summary. Exit 0 iff the job succeeded.",
    )
    p.add_argument("job", metavar="JOB.yaml")
    p.add_argument("--nodes", type=int, default=1, metavar="N", help="agents to start")
    p.add_argument("--nproc-per-node", type=int, default=None, metavar="K",
                   help="workers per node (sets the job's nproc_per_node)")  # fmt: skip
    p.add_argument("--fault", action="append", default=[], metavar="SPEC",
                   help="kill-node=I@step=S, kill-worker=RANK@step=S, hang-worker=RANK@step=S, "
                   "term-node=I@step=S or add-node@step=S (repeatable)")  # fmt: skip
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="override a job setting, e.g. train.steps=50")  # fmt: skip
    p.add_argument("--fresh", action="store_true",
                   help="delete the job's output_dir first (else it resumes from its checkpoints)")  # fmt: skip
    p.add_argument("--timeout", type=float, default=1800.0, metavar="S",
                   help="give up after this many seconds (default 1800)")  # fmt: skip
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from elasticd.jobspec import load_job
    from elasticd.localcluster import parse_fault

    if args.nodes < 1:
        raise UsageError(f"--nodes: {args.nodes} must be >= 1")
    faults = [parse_fault(f) for f in args.fault]
    overrides = list(args.overrides)
    if args.nproc_per_node is not None:
        overrides.append(f"nproc_per_node={args.nproc_per_node}")
    job = load_job(args.job, overrides).with_paths_resolved(os.getcwd())
    if args.fresh and os.path.isdir(job.out_dir):
        shutil.rmtree(job.out_dir)
    os.makedirs(job.out_dir, exist_ok=True)
    result = run_cluster(job, nodes=args.nodes, faults=faults, timeout=args.timeout, out=sys.stdout)
    print_summary(result, out=sys.stdout)
    return 0 if result["state"] == "succeeded" else 1


def run_cluster(job: Any, *, nodes: int, faults: list, timeout: float, out) -> dict[str, Any]:
    """Start the cluster, submit ``job``, inject ``faults``, wait for the end; returns the
    final status with the fault times (``faults``) and the metrics records."""
    from elasticd.etcd import connect
    from elasticd.jobs import JobRegistry
    from elasticd.localcluster import LocalCluster, read_metrics

    base = os.path.join(job.out_dir, "cluster")
    metrics_path = os.path.join(job.out_dir, "metrics.jsonl")
    seen = len(read_metrics(metrics_path))  # resumed runs: look only at new records
    cluster = LocalCluster(base_dir=base, nproc=job.nproc_per_node)
    fired: list[dict[str, Any]] = []
    with cluster:
        cluster.start(nodes)
        out.write(f"local cluster: etcd {cluster.endpoint}, {nodes} agents, logs in {base}\n")
        with connect(cluster.etcd.client_config()) as client:  # type: ignore[union-attr]
            registry = JobRegistry(client)
            _wait_for_agents(client, cluster, nodes, timeout=60.0)
            registry.submit(job, replace=True)
            pending = sorted(faults, key=lambda f: f.step)
            deadline = time.monotonic() + timeout
            last_line = ""
            while True:
                records = read_metrics(metrics_path)[seen:]
                step = max((int(r.get("step", 0)) for r in records), default=0)
                while pending and step >= pending[0].step:
                    fault = pending.pop(0)
                    cluster.inject(fault)
                    fired.append({"fault": str(fault), "t": time.time(), "step": step})
                    out.write(f"fault injected: {fault} (at step {step})\n")
                record = registry.get(job.name)
                assert record is not None
                line = _progress(record, step)
                if line != last_line:
                    out.write(line + "\n")
                    out.flush()
                    last_line = line
                if record.state.terminal:
                    break
                if time.monotonic() > deadline:
                    registry.cancel(job.name)
                    out.write(f"timed out after {timeout:g} s; cancelled\n")
                    time.sleep(2)
                    record = registry.get(job.name)
                    break
                time.sleep(0.02)  # faults fire within a step or two of the one asked for
            final = record.to_dict() if record is not None else {"state": "unknown"}
    final["faults"] = fired
    final["metrics"] = read_metrics(metrics_path)[seen:]
    return final


def _wait_for_agents(client: Any, cluster: Any, nodes: int, *, timeout: float) -> None:
    """Submit only once every agent registered, so the first world has all of them."""
    from elasticd.agent.daemon import NODES_PREFIX

    deadline = time.monotonic() + timeout
    while len(client.get_prefix(NODES_PREFIX)[0]) < nodes:
        for index, proc in enumerate(cluster.agents):
            if proc.poll() is not None:
                log = os.path.join(cluster.base_dir, f"agent-{index}.log")
                with open(log, encoding="utf-8", errors="replace") as fh:
                    last = (fh.read().strip().splitlines() or ["(empty log)"])[-1]
                raise UsageError(
                    f"local cluster: agent {index} exited with {proc.returncode}: {last}"
                )
        if time.monotonic() > deadline:
            raise UsageError(f"local cluster: {nodes} agents did not register within {timeout:g} s")
        time.sleep(0.1)


def _progress(record: Any, step: int) -> str:
    st = record.status
    total = record.spec.get("train", {}).get("steps")
    return (
        f"  {record.state}: step {step}/{total} world {st.get('world', '-')} "
        f"round {st.get('round', '-')} restarts {st.get('restarts', 0)}"
    )


def print_summary(result: dict[str, Any], *, out) -> None:
    """Steps, world changes, restarts, and each recovery's time with its parts."""
    status = result.get("status", {})
    history = status.get("history", [])
    metrics = result.get("metrics", [])
    last_by_step = {int(r["step"]): r for r in metrics if "step" in r}
    out.write(f"\njob {result.get('name')}: {result.get('state')}")
    out.write(f" ({result.get('reason')})\n" if result.get("reason") else "\n")
    final_loss = last_by_step[max(last_by_step)].get("loss") if last_by_step else None
    out.write(f"  steps completed: {max(last_by_step, default=0)}  final loss: {final_loss}\n")
    worlds = [e for e in history if e.get("kind") == "world"]
    changes = " -> ".join(
        f"{e['world']} ({e.get('layout', '')}, round {e['round']})" for e in worlds
    )
    out.write(f"  worlds: {changes or '-'}\n")
    out.write(
        f"  restarts (worker failures): {status.get('restarts', 0)}  "
        f"re-forms: {status.get('reforms', 0)}\n"
    )
    for f in result.get("faults", []):
        out.write(f"  fault {f['fault']} at step {f['step']}\n")
    failures = {e["round"]: e for e in history if e.get("kind") == "failure"}
    for e in history:
        if e.get("kind") != "recovery":
            continue
        cause = failures.get(e["round"] - 1, {})
        got = e.get("parts", {})
        parts = ", ".join(f"{k} {got[k]:.2f}s" for k in PART_ORDER if k in got)
        fault_t = _fault_before(result.get("faults", []), e.get("detected_at", 0))
        if fault_t:  # the injected fault's time is known: count from it
            detection = e["detected_at"] - fault_t
            total = f"{detection + e['seconds']:.2f}s from the fault = detection {detection:.2f}s, "
        else:
            total = f"{e['seconds']:.2f}s from detection = "
        out.write(
            f"  recovery into round {e['round']} ({e.get('reason')}"
            f"{': ' + cause.get('detail', '') if cause.get('detail') else ''}): "
            f"{total}{parts}\n"
        )


PART_ORDER = ("stop", "rendezvous", "spawn", "pg_init", "ckpt_load", "first_step")


def _fault_before(faults: list[dict[str, Any]], t: float) -> float | None:
    times = [f["t"] for f in faults if f["t"] <= t]
    return max(times) if times else None
