"""Real agents, real etcd, real workers: the agent keeps a job going through faults.

Each test runs a local cluster (an embedded etcd and agent processes, as `elasticd run`
does) on tests/agent_worker.py, a small gloo worker that checkpoints, resumes and reports
heartbeats like the trainer, at a fraction of the trainer's start-up cost. Its "loss" at
step k depends on k alone, so a correct resume reproduces the uninterrupted sequence.
The trainer itself under faults is tests/test_agent_trainer.py.
"""

from __future__ import annotations

import io
import json
import os
import signal
import sys
import time

import pytest
from polling import wait_for

from elasticd.cli.run import print_summary, run_cluster
from elasticd.jobspec import parse_job
from elasticd.localcluster import LocalCluster, parse_fault

WORKER = os.path.join(os.path.dirname(__file__), "agent_worker.py")


def expected_loss(step: int) -> float:
    return 10.0 / (1.0 + step * (step + 1) / 2)


def make_job(tmp_path, *, name="chaos", steps=12, every=3, nodes=(1, 3), nproc=1, **extra):
    raw = {
        "name": name,
        "output_dir": str(tmp_path / "out"),
        "nodes": {"min": nodes[0], "max": nodes[1]},
        "nproc_per_node": nproc,
        "command": [sys.executable, WORKER],
        "train": {"steps": steps, "global_batch": 12, "micro_batch": 2},
        "checkpoint": {"every": every},
        "rendezvous": {"ttl": 2, "settle": 1.5},
    }
    for section, values in extra.items():
        raw.setdefault(section, {}).update(values)
    return parse_job(raw).with_paths_resolved(tmp_path)


@pytest.fixture
def fast_steps(monkeypatch):
    monkeypatch.setenv("AGENT_TEST_STEP_S", "0.25")
    monkeypatch.setenv("OMP_NUM_THREADS", "1")


def last_by_step(metrics):
    return {r["step"]: r for r in metrics}


def run(job, nodes, faults, timeout=120):
    out = io.StringIO()
    result = run_cluster(job, nodes=nodes, faults=[parse_fault(f) for f in faults],
                         timeout=timeout, out=out)  # fmt: skip
    print_summary(result, out=out)
    print(out.getvalue())
    return result


def assert_resumed_exactly(result, steps):
    by_step = last_by_step(result["metrics"])
    assert sorted(by_step) == list(range(1, steps + 1))
    for step, rec in by_step.items():
        assert rec["loss"] == pytest.approx(expected_loss(step), rel=1e-9)


@pytest.mark.slow  # the trainer version in test_agent_trainer.py runs by default
def test_a_killed_node_is_dropped_and_training_resumes_on_the_survivors(tmp_path, fast_steps):
    job = make_job(tmp_path, steps=12)
    result = run(job, 3, ["kill-node=1@step=5"])
    assert result["state"] == "succeeded", result["reason"]
    worlds = [r["world"] for r in result["metrics"]]
    assert worlds[0] == 3 and worlds[-1] == 2
    assert_resumed_exactly(result, 12)
    history = result["status"]["history"]
    recovery = [e for e in history if e["kind"] == "recovery"]
    assert recovery and recovery[-1]["reason"] == "peer_lost"
    assert result["status"]["restarts"] == 0  # a node death is not a worker restart
    # Nor is it the job's last failure, though the survivors' workers crashed first.
    last = result["status"].get("last_failure")
    assert last is None or ("peer_lost" in last and "worker_failed" not in last), last
    failures = [e for e in history if e["kind"] == "failure"]
    assert [e["reason"] for e in failures] == ["peer_lost"] and failures[0]["counted"]
    assert set(recovery[-1]["parts"]) >= {"rendezvous", "spawn", "pg_init", "first_step"}


def test_a_killed_nodes_lease_is_not_waited_for_when_its_rendezvous_refuses(tmp_path, fast_steps):
    """restart.mode process, a lease TTL of 30 s: the survivors' re-form does not wait for
    the killed node's lease. Its agent is gone, so its rendezvous's probe port refuses,
    and the closer excuses it (docs/rendezvous.md); the re-form took the TTL before."""
    job = make_job(tmp_path, steps=12, rendezvous={"ttl": 30})
    result = run(job, 3, ["kill-node=1@step=5"], timeout=240)
    assert result["state"] == "succeeded", result["reason"]
    worlds = [r["world"] for r in result["metrics"]]
    assert worlds[0] == 3 and worlds[-1] == 2
    assert_resumed_exactly(result, 12)
    (recovery,) = [e for e in result["status"]["history"] if e["kind"] == "recovery"]
    assert recovery["parts"]["rendezvous"] < 15, recovery  # well inside the 30 s lease
    said = "".join(p.read_text() for p in (tmp_path / "out" / "cluster").glob("agent-*.log"))
    assert "member gone: its rendezvous refuses connections" in said


def test_a_killed_worker_is_restarted_and_counted(tmp_path, fast_steps):
    job = make_job(tmp_path, steps=10, nodes=(2, 2))
    result = run(job, 2, ["kill-worker=1@step=4"])
    assert result["state"] == "succeeded", result["reason"]
    assert result["status"]["restarts"] == 1
    assert "signal 9" in result["status"]["last_failure"]
    assert_resumed_exactly(result, 10)
    # Node rank 0's agent kept the run's events for `elasticd report`.
    from elasticd.report import load_run, recovery_bars

    (tmp_path / "out" / "run.json").write_text(json.dumps(result))
    report = load_run(job.out_dir)
    assert [w["world"] for w in report.worlds] == [2, 2]
    assert [(r["reason"], r["mode"], r["source"]) for r in report.recoveries] == [
        ("worker_failed", "process", "checkpoint")
    ]
    assert {s["step"] for s in report.saves} >= {3, 6, 9, 10}  # checkpoint.every 3, and the end
    assert [ld["step"] for ld in report.loads] == [3] and report.loads[0]["seconds"] > 0
    ((_label, parts),) = recovery_bars(report)
    assert [p for p, _ in parts][:2] == ["detect", "stop"] and parts[-1][0] == "first_step"


def test_a_hung_worker_is_detected_within_the_hang_timeout(tmp_path, fast_steps):
    job = make_job(tmp_path, steps=8, nodes=(1, 1), nproc=2, restart={"hang_timeout": 3.0})
    started = time.time()
    result = run(job, 1, ["hang-worker=1@step=3"])
    assert result["state"] == "succeeded", result["reason"]
    failure = next(e for e in result["status"]["history"] if e["kind"] == "failure")
    # The stopped rank and its blocked local peer go quiet together; either may be named.
    assert failure["reason"] == "worker_hung" and ": no progress for" in failure["detail"]
    fault_t = result["faults"][0]["t"]
    assert failure["t"] - fault_t < 3.0 + 3.0  # hang_timeout plus a step and some slack
    assert failure["t"] > started
    assert_resumed_exactly(result, 8)


@pytest.mark.slow  # the trainer version in test_agent_trainer.py runs by default
def test_a_preempted_node_saves_an_emergency_checkpoint_and_loses_no_step(tmp_path, fast_steps):
    job = make_job(tmp_path, steps=12, every=100)  # no periodic save: only the emergency one
    result = run(job, 2, ["term-node=1@step=5"])
    assert result["state"] == "succeeded", result["reason"]
    steps = [r["step"] for r in result["metrics"]]
    assert steps == sorted(set(steps)), "a step was repeated: the emergency save lost steps"
    assert_resumed_exactly(result, 12)
    reasons = [e["reason"] for e in result["status"]["history"] if e["kind"] == "failure"]
    assert reasons == ["preempted"]
    assert [r["world"] for r in result["metrics"]][-1] == 1


@pytest.mark.slow  # the trainer version in test_agent_trainer.py runs by default
def test_a_node_added_while_running_scales_the_job_up(tmp_path, fast_steps):
    job = make_job(tmp_path, steps=32, every=4, restart={"scale_up": "checkpoint"})
    result = run(job, 2, ["add-node@step=3"])
    assert result["state"] == "succeeded", result["reason"]
    worlds = [r["world"] for r in result["metrics"]]
    assert worlds[0] == 2 and worlds[-1] == 3
    assert_resumed_exactly(result, 32)
    assert result["status"]["restarts"] == 0


def test_cancel_stops_the_workers_and_marks_the_job_cancelled(tmp_path, fast_steps):
    from elasticd.etcd import connect
    from elasticd.jobs import JobRegistry

    job = make_job(tmp_path, steps=200, nodes=(1, 1))
    with LocalCluster(base_dir=str(tmp_path / "cluster"), nproc=1) as cluster:
        cluster.start(1)
        with connect(cluster.etcd.client_config()) as client:
            reg = JobRegistry(client)
            reg.submit(job)
            pids = wait_for(lambda: cluster.worker_pids(0), timeout=60)
            wait_for(lambda: (reg.get(job.name).status.get("step") or 0) >= 2, timeout=60)
            reg.cancel(job.name)
            wait_for(lambda: not any(alive(p) for p in pids.values()), timeout=15)
            assert reg.get(job.name).state == "cancelled"
            assert cluster.agents[0].poll() is None  # the agent lives on for other jobs


def test_an_agent_killed_alone_takes_its_workers_with_it(tmp_path, fast_steps):
    job = make_job(tmp_path, steps=200, nodes=(1, 1), nproc=2)
    from elasticd.etcd import connect
    from elasticd.jobs import JobRegistry

    with LocalCluster(base_dir=str(tmp_path / "cluster"), nproc=2) as cluster:
        cluster.start(1)
        with connect(cluster.etcd.client_config()) as client:
            JobRegistry(client).submit(job)
            pids = wait_for(lambda: cluster.worker_pids(0), timeout=60)
            assert all(alive(p) for p in pids.values())
            os.kill(cluster.agents[0].pid, signal.SIGKILL)  # the agent only, not its workers
            cluster.agents[0].wait(timeout=10)
            wait_for(lambda: not any(alive(p) for p in pids.values()), timeout=5)


def alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat", encoding="utf-8") as fh:
            return fh.read().split(") ", 1)[1][0] != "Z"
    except (OSError, IndexError):
        return False


def test_the_run_command_prints_a_summary_and_exits_zero_on_success(tmp_path, fast_steps):
    import subprocess

    (tmp_path / "job.yaml").write_text(
        json.dumps(
            {
                "name": "cli",
                "command": [sys.executable, WORKER],
                "train": {"steps": 4},
                "nodes": {"min": 1, "max": 1},
                "rendezvous": {"settle": 0.2},
            }
        )
    )
    r = subprocess.run(
        [sys.executable, "-m", "elasticd", "run", "job.yaml", "--nodes", "1",
         "--nproc-per-node", "1", "--fresh"],
        cwd=tmp_path, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert r.returncode == 0, r.stdout + r.stderr
    assert "job cli: succeeded" in r.stdout and "steps completed: 4" in r.stdout
    assert len(list((tmp_path / "runs" / "cli" / "logs").glob("cli-*/round-1/rank-0.log"))) == 1
    # It leaves the run's record and its report in the output dir.
    out = tmp_path / "runs" / "cli"
    assert "report: " in r.stdout and (out / "report.html").stat().st_size > 10_000
    assert (out / "report.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert json.loads((out / "run.json").read_text())["state"] == "succeeded"


def test_an_etcd_outage_mid_run_does_not_stop_training(tmp_path, fast_steps):
    from elasticd.etcd import connect
    from elasticd.jobs import JobRegistry
    from elasticd.localcluster import read_metrics

    job = make_job(tmp_path, steps=24, every=100, nodes=(2, 2))
    metrics = os.path.join(job.out_dir, "metrics.jsonl")
    with LocalCluster(base_dir=str(tmp_path / "cluster"), nproc=1) as cluster:
        cluster.start(2)
        with connect(cluster.etcd.client_config()) as client:
            wait_for(lambda: len(client.get_prefix("/elasticd/nodes/")[0]) == 2, timeout=30)
            JobRegistry(client).submit(job)
        wait_for(lambda: max((r["step"] for r in read_metrics(metrics)), default=0) >= 4,
                 timeout=60)  # fmt: skip
        cluster.etcd.stop()  # every agent loses etcd for a few seconds, mid-training
        time.sleep(4)
        cluster.etcd.start()
        with connect(cluster.etcd.client_config()) as client:
            reg = JobRegistry(client)
            final = wait_for(lambda: (r := reg.get(job.name)).state.terminal and r, timeout=90)
    assert final.state == "succeeded", final.reason
    assert final.status["restarts"] == 0
    assert [e["kind"] for e in final.status["history"]] == ["world"]  # no re-form
    assert [r["step"] for r in read_metrics(metrics)] == list(range(1, 25))
