"""Recovery benchmark: SIGKILL of one node → the first completed step in the re-formed world.

Every case runs the built-in trainer (gloo, the same small GPT, a checkpoint every 5 steps)
on this machine and loses a node the same way: SIGKILL of the node's launcher and its
workers once step S has completed (``--kill-step``). The time runs from the kill to the
first metrics.jsonl record written by the re-formed world (a record of a later round, or
under torchrun of the smaller world). One run measures, side by side:

- ``inproc-dp``: ``restart.mode: inprocess``, 3 nodes × 1 worker, dp3 → dp2. The state is
  already local on every survivor (whole replicas): recovery from peers moves no bytes.
- ``inproc-move``: in-process, 4 nodes × 1 worker, tp2 × dp2 → tp2 × dp1 + 1 spare, the
  node of rank 0 killed. The re-formed world is placed so that survivors keep their
  shards (``elasticd.layout.keep_shards``): old rank 2 (tp0) becomes rank 0, old rank 1
  (tp1) stays tp1, old rank 3 is the spare. Nothing moves.
- ``inproc-move-plain``: the same with the rendezvous's plain order (the agents'
  ``ELASTICD_KEEP_SHARDS=0``): survivors keep their relative order, so new rank 0 (old
  rank 1, a tp1 shard) needs the tp0 shard and new rank 1 (old rank 2, tp0) needs tp1:
  both receive their shard's parameters and AdamW state from a peer (the spare, old rank
  3, serves what it holds). Bytes really move: the case for the goal "≤ 2 s when state
  must move".
- ``inproc-ckpt``: in-process, 3 nodes × 1 worker, tp2 × dp1 + 1 spare; the tp1 rank's
  node is killed. No live rank holds the tp1 shard (no DP replica; the spare holds
  nothing), so the survivors keep their processes but load the latest checkpoint.
- ``inproc-replica``: the job and the fault of ``inproc-ckpt`` with
  ``checkpoint.memory_replicas: 1`` (every step): the tp1 shard comes back from its copy in
  the surviving tp0 rank's memory (source replica, at most a step or two trained again).
- ``process``: ``restart.mode: process`` (every worker stopped and started again, state
  from the checkpoint), the dp3 → dp2 job of ``inproc-dp``.
- ``torchrun``: three ``torchrun --nnodes 2:3 --rdzv-backend c10d --max-restarts 3``
  launchers with torch's defaults (the first hosts the c10d store; a non-host is killed),
  dp3 → dp2.
- ``newcomer``: an in-process dp2 job (2 nodes × 1 worker, ``scale_up: immediate``) gets a
  third node at step S: the time from starting the newcomer's agent to the first record
  of the dp3 world (the newcomer's worker receives the whole state from the survivors).
  The newcomer's worker starts warm and the node asks for its round once the worker's
  imports are done, the survivors training on meanwhile: ``detect`` is that wait, and
  the parts after it are the survivors' stall.
- ``newcomer-alone``: the same from a world of one process (1 node × 1 worker, dp1 →
  dp2). Such a worker has no peer whose socket the round's end could shut: before the
  trainer checked its round after every step, it trained on to its next checkpoint save,
  which its fence refused, before it left.
- ``replace-standby``: in-process, 2 nodes × 1 worker (dp2); one *worker* (not its node)
  is SIGKILLed once its node's standby worker (``restart.standby: 1``, the default) has
  imported torch: the agent adopts the standby for the dead rank, which receives the
  whole state from its peer. The time runs from the kill to the first step of the new
  round, as for a node; the standby's own start was long before.
- ``replace-cold``: the same with ``restart.standby: 0``: the replacement is started
  after the kill (a warm worker whose imports overlap the rendezvous).
- ``inproc-pp``: in-process, 4 nodes × 1 worker, pp2 × dp2 → pp2 × dp1 + 1 spare, the node
  of rank 0 (stage 0) killed: the surviving stage-0 and stage-1 ranks send activations and
  gradients to each other point to point, which no timed wait can abandon.
- ``process-exec`` and ``replace-cold-exec``: ``process`` and ``replace-cold`` with the
  agents' ``ELASTICD_FORK_SERVER=0``: every worker is exec'd and imports torch itself,
  instead of being forked from the node's fork server (docs/agent.md, "Workers are
  forked, not started").
- ``inproc-term`` and ``process-term``: the dp3 → dp2 job of ``inproc-dp`` and ``process``,
  its node *preempted* instead of killed: SIGTERM of its agent once step S completed. Every
  rank stops at the same step and commits it (the emergency checkpoint); in-process the
  survivors keep their processes and recover from memory, in process mode every worker
  exits and the new world loads that checkpoint. The time runs from the SIGTERM; each is
  compared with the other (``process/x`` of ``inproc-term`` is against ``process-term``).

For elasticd the parts come from the recovery record in the job's status history (what
the agent of rank 0 recorded: abort, rendezvous, pg_init, state_transfer, first_step in
process; stop, rendezvous, spawn, pg_init, ckpt_load, first_step for a process restart),
with ``detect`` = kill (or newcomer start) → the record's ``detected_at``, and ``rest`` =
what is left to the metrics record (the agent sees a step through a heartbeat). The
record's source and lost steps are shown, and rank 0's "recovered in-process" line (MB
received and local, seconds of ``recover_from_peers``) when it printed one.

    OMP_NUM_THREADS=1 python bench/recovery.py [--cases inproc-dp,...] [--repeats 1]
        [--steps 40] [--kill-step 12] [--limit 150] [--json out.json] [--keep DIR]
"""

from __future__ import annotations

import argparse
import contextlib
import glob
import json
import os
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from elasticd.etcd import free_port
from elasticd.localcluster import descendants

JOB = "bench"
CASES = ("inproc-dp", "inproc-move", "inproc-move-plain", "inproc-ckpt", "inproc-replica", "process", "torchrun",
         "newcomer", "newcomer-alone", "replace-standby", "replace-cold", "inproc-pp", "inproc-term",
         "process-term", "process-exec", "replace-cold-exec")  # fmt: skip
WORKER_CASES = {"replace-standby", "replace-cold", "replace-cold-exec"}
"""Cases that kill one worker process, not its node."""
NEWCOMER_CASES = {"newcomer", "newcomer-alone"}
"""Cases that add a node instead of killing one."""
REPLICA_CASES = {"inproc-replica"}
"""Cases run with ``checkpoint.memory_replicas: 1`` (``memory_every: 1``)."""

# name -> (nodes, nproc, parallel, restart mode, global rank whose node is killed)
SETUPS: dict[str, tuple[int, int, dict, str, int]] = {
    "inproc-dp": (3, 1, {}, "inprocess", 1),
    "inproc-move": (4, 1, {"tp": 2}, "inprocess", 0),
    "inproc-move-plain": (4, 1, {"tp": 2}, "inprocess", 0),
    "inproc-ckpt": (3, 1, {"tp": 2}, "inprocess", 1),
    "inproc-replica": (3, 1, {"tp": 2}, "inprocess", 1),
    "process": (3, 1, {}, "process", 1),
    "torchrun": (3, 1, {}, "process", 1),
    "newcomer": (2, 1, {}, "inprocess", -1),
    "newcomer-alone": (1, 1, {}, "inprocess", -1),
    "replace-standby": (2, 1, {}, "inprocess", 1),
    "replace-cold": (2, 1, {}, "inprocess", 1),
    "inproc-pp": (4, 1, {"pp": 2}, "inprocess", 0),
    "inproc-term": (3, 1, {}, "inprocess", 1),
    "process-term": (3, 1, {}, "process", 1),
    "process-exec": (3, 1, {}, "process", 1),
    "replace-cold-exec": (2, 1, {}, "inprocess", 1),
}
EXEC_CASES = {"process-exec", "replace-cold-exec"}
"""Cases whose agents run with ``ELASTICD_FORK_SERVER=0``: every worker exec'd."""
TERM_CASES = {"inproc-term", "process-term"}
"""Cases that preempt a node (SIGTERM of its agent) instead of killing it."""
PARTS = ("detect", "failed_attempts", "abort", "stop", "rendezvous", "spawn", "pg_init",
         "state_transfer", "ckpt_load", "first_step", "rest")  # fmt: skip


def job_dict(out: str, steps: int, *, nodes: int, nproc: int, parallel: dict, mode: str,
             spare_room: bool = False, ttl: float = 3.0, replicas: bool = False,
             standby: int = 1, reform_grace: float | None = None) -> dict:  # fmt: skip
    raw = {
        "name": JOB,
        "output_dir": out,
        "nodes": {"min": 1, "max": nodes + 1 if spare_room else nodes},
        "nproc_per_node": nproc,
        "parallel": parallel,
        "model": {"layers": 4, "hidden": 64, "heads": 4, "ffn_hidden": 256, "seq_len": 64},
        "train": {"steps": steps, "global_batch": 12, "micro_batch": 2},
        "checkpoint": {"every": 5, "dir": os.path.join(out, "ckpt")},
        "restart": {"mode": mode},
        "rendezvous": {"ttl": ttl, "settle": 1.0},
    }
    if (model_parallel := parallel.get("tp", 1) * parallel.get("pp", 1)) > 1:
        raw["nodes"]["min"] = max(1, model_parallel // nproc)
    if mode == "inprocess":
        raw["restart"]["scale_up"] = "immediate"  # the newcomer joins at once
        raw["restart"]["standby"] = standby
        if reform_grace is not None:
            raw["rendezvous"]["reform_grace"] = reform_grace
    if replicas:
        raw["checkpoint"].update(memory_replicas=1, memory_every=1)
    return raw


def read_records(path: str) -> list[dict]:
    out = []
    try:
        with open(path, encoding="utf-8") as fh:
            for line in fh:
                with contextlib.suppress(ValueError):
                    out.append(json.loads(line))
    except OSError:
        pass
    return out


def wait_until(predicate, limit: float, interval: float = 0.02):
    deadline = time.monotonic() + limit
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(interval)
    return None


def first_record(metrics: str, match, limit: float) -> tuple[float, dict] | None:
    """(wall time, record) when a record matching ``match`` first appears, or None."""

    def seen():
        hit = next((r for r in read_records(metrics) if match(r)), None)
        return (time.time(), hit) if hit else None

    return wait_until(seen, limit)


# -- elasticd ------------------------------------------------------------------------------


def _recovery(record) -> dict | None:
    from elasticd.jobs import last_recovery

    return None if record is None else last_recovery(record.status)


def _transfer_line(out: str) -> str | None:
    """The newest "recovered in-process from peers" line any rank printed (only rank 0
    prints one; a kept process goes on writing to the log of the round it started in)."""
    best: tuple[int, str] | None = None
    pattern = re.compile(
        r"from (?:peers|replica) at step (\d+) \(([\d.]+) MB received, ([\d.]+) MB local, "
        r"([\d.]+) s(?:; ([\d.]+) MB of the previous round's memory kept)?\)"
    )
    for path in glob.glob(os.path.join(out, "logs", "**", "*.log"), recursive=True):
        with open(path, encoding="utf-8", errors="replace") as fh:
            for line in fh:
                m = pattern.search(line)
                if m and (best is None or int(m[1]) >= best[0]):
                    kept = f", {m[5]} MB kept" if m[5] else ""
                    best = (int(m[1]), f"{m[2]} MB in, {m[3]} MB local, {m[4]} s{kept}")
    return best[1] if best else None


def run_elasticd(base: str, case: str, *, steps: int, kill_step: int, limit: float,
                 reform_grace: float | None = None) -> dict:  # fmt: skip
    from elasticd.etcd import connect
    from elasticd.jobs import JobRegistry
    from elasticd.jobspec import parse_job
    from elasticd.localcluster import LocalCluster

    nodes, nproc, parallel, mode, victim_rank = SETUPS[case]
    out = os.path.join(base, "out")
    if case in NEWCOMER_CASES:
        # A newcomer asks for its round once its warm worker has imported torch, while the
        # survivors train on: the job must outlast that (it is cancelled once measured).
        steps = max(steps, 100_000)
    if case in WORKER_CASES:
        steps = max(steps, 100_000)  # outlasts the standby's start; cancelled once measured
    job = parse_job(job_dict(out, steps, nodes=nodes, nproc=nproc, parallel=parallel, mode=mode,
                             spare_room=case in NEWCOMER_CASES, replicas=case in REPLICA_CASES,
                             standby=0 if case.startswith("replace-cold") else 1,
                             reform_grace=reform_grace))  # fmt: skip
    metrics = os.path.join(out, "metrics.jsonl")
    world = nodes * nproc
    ready_at = None  # the newcomer's warm worker: torch imported, ready for a round
    env = dict(os.environ)
    if case == "inproc-move-plain":
        env["ELASTICD_KEEP_SHARDS"] = "0"  # the rendezvous's plain order: every shard moves
    if case in EXEC_CASES:
        env["ELASTICD_FORK_SERVER"] = "0"  # no fork server: every worker exec'd
    with LocalCluster(base_dir=os.path.join(base, "cluster"), nproc=nproc, env=env) as cluster:
        cluster.start(nodes)
        with connect(cluster.etcd.client_config()) as client:
            reg = JobRegistry(client)
            if not wait_until(lambda: len(client.get_prefix("/elasticd/nodes/")[0]) == nodes,
                              60):  # fmt: skip
                return {"error": "the agents did not register"}
            reg.submit(job)
            if not wait_until(lambda: any(r["step"] >= kill_step and r["world"] == world
                                          for r in read_records(metrics)), limit):  # fmt: skip
                return {"error": f"did not reach step {kill_step} in a world of {world}"}
            old_round = max(r["round"] for r in read_records(metrics))
            if case in NEWCOMER_CASES:
                started = time.time()
                newcomer = cluster.add_node()
                hit = first_record(metrics, lambda r: r["world"] == world + 1, limit)
                ready_files = glob.glob(os.path.join(cluster.state_dir(newcomer), "jobs", "*",
                                                     "warm", "ready-*"))  # fmt: skip
                ready_at = min((os.path.getmtime(f) for f in ready_files), default=None)
            elif case in WORKER_CASES:
                victim = next(i for i in range(nodes) if victim_rank in cluster.worker_pids(i))
                if case == "replace-standby":
                    ready = os.path.join(cluster.state_dir(victim), "jobs", "*", "warm",
                                         "ready-*-standby-*")  # fmt: skip
                    if not wait_until(lambda: glob.glob(ready), limit):
                        return {"error": "the standby worker never became ready"}
                old_round = max(r["round"] for r in read_records(metrics))
                started = time.time()
                os.kill(cluster.worker_pids(victim)[victim_rank], signal.SIGKILL)
                hit = first_record(metrics, lambda r: r["round"] > old_round, limit)
            else:
                victim = next((i for i in range(nodes) if victim_rank in cluster.worker_pids(i)),
                              None)  # fmt: skip
                if victim is None:
                    return {"error": f"no node holds rank {victim_rank}"}
                started = time.time()
                if case in TERM_CASES:
                    cluster.term_node(victim)
                else:
                    cluster.kill_node(victim)
                hit = first_record(metrics, lambda r: r["round"] > old_round, limit)
            if hit is None:
                return {"error": f"no step in a new world within {limit:g} s"}
            done, first = hit
            record = wait_until(lambda: _recovery(reg.get(JOB)), 10) or {}
            with contextlib.suppress(Exception):
                reg.cancel(JOB)
    # The first completed step: the agent's (rank 0's heartbeat) or the first new metrics
    # record, whichever came first. In-process, a step trained again after a rollback
    # writes no second record, so the record alone would be late by the steps lost.
    if "detected_at" in record and "seconds" in record:
        done = min(done, float(record["detected_at"]) + float(record["seconds"]))
    seconds = done - started
    from_ready = done - ready_at if ready_at is not None else None
    parts = {"detect": record.get("detected_at", started) - started, **record.get("parts", {})}
    parts["rest"] = max(0.0, seconds - sum(parts.values()))
    return {
        "seconds": seconds, "parts": parts, "mode": record.get("mode"),
        "source": record.get("source"), "lost_steps": record.get("lost_steps"),
        "reason": record.get("reason"), "step": first.get("step"),
        "world": f"{first.get('world')} (tp{first.get('tp')} dp{first.get('dp')})",
        "record_first_step": record.get("first_step"), "transfer": _transfer_line(out),
        "from_ready": from_ready,
    }  # fmt: skip


# -- torchrun ------------------------------------------------------------------------------


def run_torchrun(base: str, *, steps: int, kill_step: int, limit: float) -> dict:
    nodes, nproc, parallel, mode, _ = SETUPS["torchrun"]
    out = os.path.join(base, "out")
    os.makedirs(out, exist_ok=True)
    job_path = os.path.join(base, "job.json")
    with open(job_path, "w", encoding="utf-8") as fh:
        json.dump(job_dict(out, steps, nodes=nodes, nproc=nproc, parallel=parallel, mode=mode), fh)
    metrics = os.path.join(out, "metrics.jsonl")
    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith(("ELASTICD_", "TORCHELASTIC"))}
    env["OMP_NUM_THREADS"] = "1"
    procs = []
    try:
        for i in range(nodes):
            argv = [
                sys.executable, "-m", "torch.distributed.run", "--nnodes", f"{nodes - 1}:{nodes}",
                "--nproc-per-node", str(nproc), "--rdzv-backend", "c10d",
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
        world = nodes * nproc
        if not wait_until(lambda: any(r["world"] == world and r["step"] >= kill_step
                                      for r in read_records(metrics)), limit):  # fmt: skip
            return {"error": f"did not reach the kill step in a world of {world}"}
        victim = procs[1]  # not the store's host
        # torchrun's workers live in sessions of their own: a node dying takes them too.
        tree = descendants(victim.pid)
        count = len(read_records(metrics))
        killed = time.time()
        os.killpg(victim.pid, signal.SIGKILL)
        for pid in tree:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)

        def seen():
            fresh = read_records(metrics)[count:]
            hit = next((r for r in fresh if r["world"] == world - nproc), None)
            return (time.time(), hit) if hit else None

        hit = wait_until(seen, limit)
        if hit is None:
            alive = sum(p.poll() is None for p in procs if p is not victim)
            why = ""
            for i, p in enumerate(procs):  # the last words of a launcher that gave up
                if p is not victim and p.poll() is not None:
                    why += f"; launcher {i} exited {p.returncode}: {_last_error(base, i)}"
            return {"error": f"no step in a new world within {limit:g} s "
                             f"({alive} of {nodes - 1} surviving launchers running{why})"}  # fmt: skip
        done, first = hit
        resumed = first["step"] - 1
        before = max(r["step"] for r in read_records(metrics)[:count])
        return {"seconds": done - killed, "parts": {}, "mode": "torchrun",
                "source": "checkpoint", "lost_steps": max(0, before - resumed),
                "step": first["step"], "world": str(first["world"])}  # fmt: skip
    finally:
        for p in procs:
            for pid in [*descendants(p.pid), p.pid]:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            p.wait()


def _last_error(base: str, i: int) -> str:
    try:
        with open(
            os.path.join(base, f"torchrun-{i}.log"), encoding="utf-8", errors="replace"
        ) as fh:
            lines = [ln.strip() for ln in fh if ln.strip()]
    except OSError:
        return "(no log)"
    hits = [ln for ln in lines if "Error" in ln or "error" in ln]
    return (hits or lines or ["(empty log)"])[-1][:300]


# -- report --------------------------------------------------------------------------------


def parts_text(parts: dict[str, float]) -> str:
    return " ".join(f"{k} {parts[k]:.2f}" for k in PARTS if k in parts)


def summarize(results: dict[str, list[dict]]) -> list[dict]:
    medians = {}
    rows = []
    for case, runs in results.items():
        ok = [r for r in runs if "seconds" in r]
        row: dict = {"case": case, "runs": len(runs), "ok": len(ok)}
        if ok:
            secs = [r["seconds"] for r in ok]
            row.update(median=statistics.median(secs), min=min(secs), max=max(secs))
            medians[case] = row["median"]
            keys = [k for k in PARTS if any(k in r["parts"] for r in ok)]
            row["parts"] = {k: statistics.median(r["parts"].get(k, 0.0) for r in ok) for k in keys}
            row["source"] = "/".join(sorted({str(r.get("source")) for r in ok}))
            row["mode"] = "/".join(sorted({str(r.get("mode")) for r in ok}))
            row["lost_steps"] = sorted({r.get("lost_steps") for r in ok}, key=str)
        rows.append(row)
    for row in rows:
        for base in ("torchrun", "process"):
            # The newcomer's time measures a join, and a worker's kill is not a node's: no
            # ratio. A preemption is compared with a preemption.
            kind = row["case"].split("@")[0]
            against = base
            if kind in TERM_CASES:
                against = "process-term" if base == "process" else ""
            if ("median" in row and against in medians and kind != against
                    and kind not in NEWCOMER_CASES and kind not in WORKER_CASES):  # fmt: skip
                row[f"vs_{base}"] = medians[against] / row["median"]
    return rows


@contextlib.contextmanager
def _run_dir(keep: str | None, name: str):
    """A run's directory: temporary, or DIR/NAME kept for reading the logs of an outlier."""
    if not keep:
        with tempfile.TemporaryDirectory(prefix="bench-recovery-") as tmp:
            yield tmp
        return
    path = os.path.join(keep, name)
    if os.path.exists(path):
        raise SystemExit(f"recovery: {path} already exists; --keep needs a fresh directory")
    os.makedirs(path)
    yield path


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--kill-step", type=int, default=12,
                   help="kill (or add the newcomer) once this step completed")  # fmt: skip
    p.add_argument("--limit", type=float, default=150.0, help="give up on a recovery after this")
    p.add_argument("--repeats", type=int, default=1)
    p.add_argument("--cases", default=",".join(CASES), help=f"any of {','.join(CASES)}")
    p.add_argument("--json", help="also write every run and the summary here")
    p.add_argument("--keep", metavar="DIR",
                   help="keep each run's files (cluster logs, metrics, job output) in "
                        "DIR/CASE-RUN instead of a temporary directory")  # fmt: skip
    p.add_argument("--reform-grace", default="",
                   help="comma-separated rendezvous.reform_grace values: each in-process "
                        "case runs once per value, as CASE@VALUE (default: the job's default)")  # fmt: skip
    args = p.parse_args()
    names = [c for c in args.cases.split(",") if c]
    if bad := [c for c in names if c not in CASES]:
        p.error(f"unknown case(s) {bad}; known: {','.join(CASES)}")
    graces = [float(g) for g in args.reform_grace.split(",") if g]
    variants: dict[str, tuple[str, float | None]] = {}
    for c in names:
        inproc = SETUPS[c][3] == "inprocess" and c != "torchrun"
        for g in graces if graces and inproc else [None]:
            variants[c if g is None else f"{c}@{g:g}"] = (c, g)
    cases = list(variants)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    print(f"recovery: SIGKILL of a node at step {args.kill_step} -> first step of the re-formed "
          "world, seconds (newcomer: its agent started -> first step of the larger world; "
          "-term: SIGTERM of the node's agent)")  # fmt: skip
    print(f"{'case':<12} {'run':>3} {'seconds':>8}  {'mode':<9} {'source':<10} {'lost':>4}  parts")
    results: dict[str, list[dict]] = {c: [] for c in cases}
    for rep in range(args.repeats):  # cases interleaved: a load spike hits them alike
        for case in cases:
            kw = {"steps": args.steps, "kill_step": args.kill_step, "limit": args.limit}
            with _run_dir(args.keep, f"{case}-{rep + 1}") as tmp:
                base, grace = variants[case]
                if base == "torchrun":
                    res = run_torchrun(os.path.join(tmp, "t"), **kw)
                else:
                    res = run_elasticd(os.path.join(tmp, "e"), base, reform_grace=grace, **kw)
            res["load"] = os.getloadavg()[0]
            results[case].append(res)
            if "error" in res:
                print(f"{case:<12} {rep + 1:>3} {'n/a':>8}  {res['error']}", flush=True)
                continue
            print(f"{case:<12} {rep + 1:>3} {res['seconds']:>8.2f}  {res.get('mode')!s:<9} "
                  f"{res.get('source')!s:<10} {res.get('lost_steps')!s:>4}  "
                  f"{parts_text(res['parts'])}", flush=True)  # fmt: skip
            extra = [f"first record: step {res.get('step')} in world {res.get('world')}"]
            if res.get("record_first_step") is not None:
                extra.append(f"agent's first step {res['record_first_step']}")
            if res.get("transfer"):
                extra.append(f"rank 0 recover_from_peers: {res['transfer']}")
            if res.get("from_ready") is not None:
                extra.append(f"its warm worker ready -> first step {res['from_ready']:.2f} s")
            print(f"{'':<18}{'; '.join(extra)}; load {res['load']:.1f}", flush=True)
    rows = summarize(results)
    print("\nsummary (medians; ratio = baseline median / this median)")
    print(f"{'case':<12} {'median':>7} {'range':>13} {'source':<10} {'lost':<6} "
          f"{'torchrun/x':>10} {'process/x':>9}  parts")  # fmt: skip
    for row in rows:
        if "median" not in row:
            print(f"{row['case']:<12} {'n/a':>7}  ({row['runs']} runs failed)")
            continue
        rng = f"{row['min']:.2f}-{row['max']:.2f}"
        tr = f"{row['vs_torchrun']:.1f}x" if "vs_torchrun" in row else "-"
        pr = f"{row['vs_process']:.1f}x" if "vs_process" in row else "-"
        lost = ",".join(str(x) for x in row["lost_steps"])
        print(f"{row['case']:<12} {row['median']:>7.2f} {rng:>13} {row['source']:<10} "
              f"{lost:<6} {tr:>10} {pr:>9}  {parts_text(row['parts'])}"
              + (f"  ({row['ok']}/{row['runs']} ok)" if row["ok"] < row["runs"] else ""))  # fmt: skip
    med = {row["case"]: row.get("median") for row in rows}
    for kind in sorted(NEWCOMER_CASES):
        ready = sorted(r["from_ready"] for r in results.get(kind, [])
                       if r.get("from_ready") is not None)  # fmt: skip
        if ready:
            print(f"\n{kind}: its warm worker ready (torch imported) -> first step of the "
                  f"larger world: median {statistics.median(ready):.2f} s "
                  f"({ready[0]:.2f}-{ready[-1]:.2f}); goal <= 1.5 s "
                  f"{'met' if statistics.median(ready) <= 1.5 else 'NOT met'}")  # fmt: skip
    if med.get("replace-standby") and med.get("replace-cold"):
        print(f"\nkilled worker replaced: standby {med['replace-standby']:.2f} s vs cold start "
              f"{med['replace-cold']:.2f} s = {med['replace-cold'] / med['replace-standby']:.1f}x")  # fmt: skip
    for forked, execd in (("process", "process-exec"), ("replace-cold", "replace-cold-exec")):
        if med.get(forked) and med.get(execd):
            print(f"{forked}: workers forked {med[forked]:.2f} s vs exec'd {med[execd]:.2f} s "
                  f"= {med[execd] / med[forked]:.2f}x")  # fmt: skip
    if args.json:
        with open(args.json, "w", encoding="utf-8") as fh:
            json.dump({"args": vars(args), "runs": results, "summary": rows}, fh, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
