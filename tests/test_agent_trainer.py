"""The built-in trainer under real agents: a node dies, the world re-forms, training resumes
from the resharded checkpoint and reproduces an uninterrupted run."""

from __future__ import annotations

import glob
import hashlib
import io
import json
import os
import subprocess
import sys
import time

import pytest
from session_cache import once_per_session

from elasticd.cli.run import print_summary, run_cluster
from elasticd.jobspec import parse_job
from elasticd.localcluster import parse_fault


def make_job(tmp_path, name: str, *, nproc: int = 1, tp: int = 1, steps: int = 14, restart=None):
    raw = {
        "name": name,
        "output_dir": str(tmp_path / name),
        "nodes": {"min": 1, "max": 3},
        "nproc_per_node": nproc,
        "parallel": {"tp": tp},
        # Divisible by the micro-batch times 3 and times 2: every world keeps the batch.
        "train": {"steps": steps, "global_batch": 12, "micro_batch": 2},
        "checkpoint": {"every": 4},
        # A loaded machine can start an agent late; a longer settle keeps the first world
        # whole (a late agent would join as a scale-up instead).
        "rendezvous": {"ttl": 2, "settle": 2.0},
        "restart": restart or {},
    }
    return parse_job(raw).with_paths_resolved(tmp_path)


# What a one-process run's losses cannot depend on: where it writes, what it is called,
# and how a cluster would run it (the reference forces one process, tp1, no saves).
NOT_IN_THE_MATH = ("name", "output_dir", "nodes", "nproc_per_node", "parallel", "checkpoint",
                   "restart", "rendezvous")  # fmt: skip


REFERENCE_STEPS = 64
"""Steps a reference of fewer steps trains anyway, where a step's loss does not depend on
``train.steps`` (a constant learning rate after the warm-up): it then serves every test
of the same math with up to this many steps, from one run per session."""


def reference_losses(tmp_path, job) -> dict[int, float]:
    """The same job, uninterrupted, as one process: trained once per session for every
    test that trains the same job (``session_cache``). With a constant learning rate, step
    N's loss is the same whatever ``train.steps`` is (the trainer's batches and updates
    never read it), so jobs that differ only there share one run of the most steps any of
    them needs (at least REFERENCE_STEPS)."""
    steps = job.train.steps
    spec = {**job.to_dict(), "output_dir": str(tmp_path / "ref"), "checkpoint": {"every": 0},
            "parallel": {"tp": 1}, "nproc_per_node": 1}  # fmt: skip
    math = {k: v for k, v in spec.items() if k not in NOT_IN_THE_MATH}
    prefix = job.train.lr_schedule == "constant"
    if prefix:
        spec["train"] = {**spec["train"], "steps": max(steps, REFERENCE_STEPS)}
        math["train"] = {k: v for k, v in math["train"].items() if k != "steps"}
    key = "losses-" + hashlib.sha256(json.dumps(math, sort_keys=True).encode()).hexdigest()[:24]

    def train() -> dict[int, float]:
        path = tmp_path / "ref.json"
        path.write_text(json.dumps(spec))
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        for var in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "ELASTICD_LAYOUT"):
            env.pop(var, None)
        r = subprocess.run([sys.executable, "-m", "trainer", str(path)], env=env,
                           capture_output=True, text=True, timeout=180)  # fmt: skip
        assert r.returncode == 0, r.stderr[-2000:]
        with open(tmp_path / "ref" / "metrics.jsonl", encoding="utf-8") as fh:
            return {rec["step"]: rec["loss"] for rec in map(json.loads, fh)}

    def enough(kept: dict[str, float]) -> bool:
        return str(steps) in kept

    losses = once_per_session(tmp_path, key, train, enough if prefix else None)
    return {int(k): v for k, v in losses.items() if int(k) <= steps}


def run(job, nodes, faults):
    out = io.StringIO()
    result = run_cluster(job, nodes=nodes, faults=[parse_fault(f) for f in faults],
                         timeout=240, out=out)  # fmt: skip
    print_summary(result, out=out)
    print(out.getvalue())
    return result


@pytest.fixture(autouse=True)
def one_thread(monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "1")


# `slow` (make test stays short): the short chaos soak checks every round resumed from a
# checkpoint against one process, and test_agent_cluster kills a node in the default suite.
@pytest.mark.slow
def test_three_nodes_lose_one_at_step_8_and_the_resumed_steps_match_an_uninterrupted_run(
    tmp_path,
):
    job = make_job(tmp_path, "kill3")
    result = run(job, 3, ["kill-node=1@step=8"])
    assert result["state"] == "succeeded", result["reason"]
    records = result["metrics"]
    worlds = [r["world"] for r in records]
    assert worlds[0] == 3 and worlds[-1] == 2 and set(worlds) == {3, 2}
    resumed = [r for r in records if r["world"] == 2]
    assert resumed and resumed[-1]["step"] == 14
    reference = reference_losses(tmp_path, job)
    for rec in resumed:
        assert rec["loss"] == pytest.approx(reference[rec["step"]], rel=1e-4), rec["step"]
    # And the steps before the failure, on three ranks, matched it too.
    for rec in records:
        assert rec["loss"] == pytest.approx(reference[rec["step"]], rel=1e-4)


def test_a_rerun_of_a_finished_job_stands_at_its_last_step(tmp_path):
    """A job run again after it finished resumes at its last step and trains nothing; its
    status still says that step (it read ``step None``, shown as 0/4: a newcomer's walk)."""
    job = make_job(tmp_path, "again", steps=4)
    assert run(job, 1, [])["state"] == "succeeded"
    again = run(job, 1, [])
    assert again["state"] == "succeeded", again["reason"]
    assert again["status"]["step"] == 4, again["status"]


def test_a_tp2_job_on_two_nodes_goes_on_from_the_resharded_checkpoint_on_the_last_node(tmp_path):
    # No worker failure allowed: a lost node uses no restart, though node 0's workers
    # fail first (their collectives break before node 1's lease expires).
    job = make_job(tmp_path, "tp2", nproc=2, tp=2, steps=10, restart={"max_restarts": 0})
    result = run(job, 2, ["kill-node=1@step=5"])
    assert result["state"] == "succeeded", result["reason"]
    assert result["status"]["restarts"] == 0
    records = result["metrics"]
    first, last = records[0], records[-1]
    assert (first["world"], first["tp"], first["dp"]) == (4, 2, 2)
    assert (last["world"], last["tp"], last["dp"]) == (2, 2, 1)
    assert last["step"] == 10
    reference = reference_losses(tmp_path, job)
    for rec in records:
        assert rec["loss"] == pytest.approx(reference[rec["step"]], rel=1e-4), rec["step"]
    # The trainer told the agent of its saves (the final one, committed after the last
    # step, too) and of its load: the run's events have them for `elasticd report`.
    from elasticd.report import load_run

    report = load_run(job.out_dir)
    assert {e["step"] for e in report.saves} >= {4, 10} and report.saves[-1]["bytes"] > 0
    assert [e["step"] for e in report.loads] == [4]


def test_a_preempted_node_makes_the_trainer_commit_an_emergency_checkpoint_and_lose_no_step(
    tmp_path,
):
    job = make_job(tmp_path, "term", steps=12)
    job = parse_job({**job.to_dict(), "checkpoint": {**job.to_dict()["checkpoint"], "every": 100}})
    result = run(job, 2, ["term-node=1@step=5"])
    assert result["state"] == "succeeded", result["reason"]
    steps = [r["step"] for r in result["metrics"]]
    assert steps == list(range(1, 13)), "a step was repeated or skipped across the preemption"
    assert [r["world"] for r in result["metrics"]][-1] == 1
    reference = reference_losses(tmp_path, job)
    for rec in result["metrics"]:
        assert rec["loss"] == pytest.approx(reference[rec["step"]], rel=1e-4), rec["step"]


def test_killing_the_node_with_rank_zero_and_the_store_leaves_the_trainer_going(tmp_path):
    from elasticd.etcd import connect
    from elasticd.jobs import JobRegistry
    from elasticd.localcluster import LocalCluster, read_metrics

    job = make_job(tmp_path, "host", steps=16)
    metrics = os.path.join(job.out_dir, "metrics.jsonl")
    with LocalCluster(base_dir=str(tmp_path / "cluster"), nproc=1) as cluster:
        cluster.start(2)
        with connect(cluster.etcd.client_config()) as client:
            reg = JobRegistry(client)
            deadline = time.monotonic() + 30
            while len(client.get_prefix("/elasticd/nodes/")[0]) < 2:
                assert time.monotonic() < deadline
                time.sleep(0.1)
            reg.submit(job)
            deadline = time.monotonic() + 120
            while max((r["step"] for r in read_metrics(metrics)), default=0) < 6:
                assert time.monotonic() < deadline
                time.sleep(0.02)
            # The node whose worker is global rank 0 hosts the TCPStore (MASTER_PORT).
            host = next(i for i in range(2) if 0 in cluster.worker_pids(i))
            cluster.kill_node(host)
            deadline = time.monotonic() + 120
            while not (final := reg.get(job.name)).state.terminal:
                assert time.monotonic() < deadline
                time.sleep(0.2)
    assert final.state == "succeeded", final.reason
    records = read_metrics(metrics)
    assert records[0]["world"] == 2 and records[-1]["world"] == 1
    assert sorted({r["step"] for r in records}) == list(range(1, 17))
    assert final.status["nodes"] == [f"node-{1 - host}"]


def test_workers_stuck_before_their_first_step_are_restarted_at_the_startup_timeout(tmp_path):
    """Rank 0 stops (SIGSTOP) in step 1's forward pass, before any step completed, and rank
    1 waits on it in its first collective. hang_timeout judges only workers that completed
    a step, so nothing judged them: the job sat there until the process group's 10-minute
    timeout (a world of one, for good). Now restart.startup_timeout stops both once it
    passes, their stacks dumped, and the restarted workers train the job through."""
    job = make_job(tmp_path, "stuckstart", nproc=2, steps=6,
                   restart={"startup_timeout": 8, "hang_timeout": 5, "max_restarts": 3})  # fmt: skip
    result = run(job, 1, ["hang-worker=0@step=1:phase=forward"])
    assert result["state"] == "succeeded", result["reason"]
    history = result["status"]["history"]
    hung = [e for e in history if e["kind"] == "failure" and e.get("reason") == "worker_hung"]
    assert hung, history
    detail = hung[0]["detail"]
    assert "ranks 0, 1 completed no step in the " in detail, detail
    assert "(restart.startup_timeout: 8 s, for the imports, the process group, " in detail
    records = result["metrics"]
    assert [r["step"] for r in records] == list(range(1, 7))
    reference = reference_losses(tmp_path, job)
    for rec in records:
        assert rec["loss"] == pytest.approx(reference[rec["step"]], rel=1e-4), rec["step"]
    # The agent asked the built-in trainer's ranks for their stacks before the kill: rank
    # 1's says where it waited (the stopped rank 0 could not print until killed).
    (log,) = glob.glob(os.path.join(job.out_dir, "logs", "*", "round-1", "rank-1.log"))
    with open(log, encoding="utf-8") as fh:
        assert " in finish_step" in fh.read(), log


# `slow`: scale-ups run in the default suite in test_agent_cluster, test_inprocess (a
# newcomer in-process) and the short chaos soak (add-node).
@pytest.mark.slow
def test_a_node_added_mid_run_scales_the_trainer_up_without_harm(tmp_path):
    job = make_job(tmp_path, "grow", steps=40)
    result = run(job, 2, ["add-node@step=4"])
    assert result["state"] == "succeeded", result["reason"]
    records = result["metrics"]
    assert records[0]["world"] == 2 and records[-1]["world"] == 3
    by_step = {r["step"]: r for r in records}
    assert sorted(by_step) == list(range(1, 41))
    reference = reference_losses(tmp_path, job)
    for step, rec in by_step.items():
        assert rec["loss"] == pytest.approx(reference[step], rel=1e-4), step
    assert result["status"]["restarts"] == 0


@pytest.mark.slow
def test_a_run_through_several_faults_still_matches_an_uninterrupted_run(tmp_path):
    job = make_job(tmp_path, "soak", steps=36)
    faults = ["kill-worker=0@step=5", "kill-node=2@step=12", "add-node@step=18",
              "term-node=1@step=26"]  # fmt: skip
    result = run(job, 3, faults)
    assert result["state"] == "succeeded", result["reason"]
    assert len(result["faults"]) == len(faults)
    by_step = {r["step"]: r for r in result["metrics"]}
    assert sorted(by_step) == list(range(1, 37))
    reference = reference_losses(tmp_path, job)
    for step, rec in by_step.items():
        assert rec["loss"] == pytest.approx(reference[step], rel=1e-4), step
    assert result["status"]["restarts"] == 1  # only the killed worker counts
