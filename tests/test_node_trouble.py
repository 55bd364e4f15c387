"""A job that does not start says why, live.

A node whose round cannot run (its launch fails), or whose job runner crashes, leaves the
round and tries again after a back-off; the job meanwhile waits, or goes on without it.
Until now that was only in the agent's log: `elasticd run` printed `pending: step 0/30`
until its timeout, and a job whose workers failed printed `restarts 5` with no cause. Now
each node's trouble goes into the job's status (`troubles`, one entry a node, counted in a
row) and every round's failure and every trouble is printed once by `elasticd run`,
`elasticd submit` (following) and `elasticd status`.
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading

import pytest
from conftest import fresh_run_id
from polling import wait_for

from elasticd.agent import daemon as daemon_mod
from elasticd.agent.daemon import Agent, AgentConfig
from elasticd.jobs import (
    TROUBLE_NODES,
    JobRegistry,
    brief,
    event_lines,
    recovery_text,
    shown_restarts,
)
from elasticd.jobspec import parse_job

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_event_lines_say_each_failure_and_trouble_once():
    status = {
        "history": [
            {"kind": "world", "round": 1, "t": 1.0},
            {
                "kind": "failure",
                "round": 1,
                "t": 2.0,
                "node": "node-0",
                "reason": "worker_failed",
                "detail": "rank 0: exit code 127",
                "counted": True,
            },
            {
                "kind": "failure",
                "round": 2,
                "t": 3.0,
                "node": "node-1",
                "reason": "worker_failed",
                "detail": "rank 1: exit code 1",
                "counted": False,
            },
        ],
        "troubles": {
            "node-2": {
                "t": 4.0,
                "what": "its round failed",
                "error": "OSError: x",
                "retry_in": 2.0,
                "count": 3,
            }
        },
    }
    seen: set[tuple] = set()
    lines = event_lines(status, seen)
    assert lines == [
        "  round 1 ended: worker_failed: rank 0: exit code 127 [seen by node-0]",
        "  node-2: its round failed (3 times in a row): OSError: x; trying again in 2 s",
    ]  # round 2's failure is not decided yet: the next world may show it a lost node's
    assert event_lines(status, seen) == []  # each once
    assert event_lines(status, seen, final=True) == [  # the job is over: as it stands
        "  round 2 ended: worker_failed: rank 1: exit code 1 [seen by node-1]"
    ]  # and no trouble: moot once the job is over
    status["troubles"]["node-2"] = {**status["troubles"]["node-2"], "t": 5.0, "count": 4}
    assert event_lines(status, seen) == [
        "  node-2: its round failed (4 times in a row): OSError: x; trying again in 2 s"
    ]
    assert event_lines({}, set()) == []
    gloo = "RuntimeError: [/__w/pytorch/third_party/gloo/tcp/pair.cc:537] Read error " + "x" * 300
    assert brief(gloo) == ("RuntimeError: [...] Read error " + "x" * 300)[:157] + "..."


def test_troubles_count_in_a_row_stay_bounded_and_clear(tmp_path, etcd_client):
    registry, name = JobRegistry(etcd_client), fresh_run_id("trouble")
    run_id = registry.submit(parse_job({"name": name, "output_dir": str(tmp_path / "out")})).run_id
    for count in (1, 2, 3):
        registry.note_trouble(name, run_id, "node-0", "its round failed", "OSError: boom",
                              count=count, retry_in=1.0)  # fmt: skip
    troubles = registry.get(name).status["troubles"]
    assert troubles["node-0"]["count"] == 3
    assert troubles["node-0"]["error"] == "OSError: boom"
    [line] = event_lines(registry.get(name).status, set(), now=troubles["node-0"]["t"] + 12)
    assert line.endswith("OSError: boom; 12 s ago (it tries again 1 s after each)"), line
    for i in range(TROUBLE_NODES + 5):
        registry.note_trouble(name, run_id, f"n{i:03d}", "its job runner crashed", "x" * 2000,
                              count=1, retry_in=2.0)  # fmt: skip
    troubles = registry.get(name).status["troubles"]
    assert len(troubles) == TROUBLE_NODES  # the newest nodes' troubles
    assert "node-0" not in troubles and f"n{TROUBLE_NODES + 4:03d}" in troubles
    assert all(len(t["error"]) == 500 for t in troubles.values())
    for node in list(troubles):
        registry.clear_trouble(name, node)
    assert "troubles" not in registry.get(name).status
    registry.clear_trouble(name, "never-troubled")  # nothing to clear: no write
    # A late note of an earlier submission (replaced since), or of a finished job: dropped.
    registry.note_trouble(name, "old-run", "node-0", "its round failed", "late", count=1,
                          retry_in=1.0)  # fmt: skip
    registry.cancel(name)
    registry.note_trouble(name, run_id, "node-0", "its round failed", "late", count=1,
                          retry_in=1.0)  # fmt: skip
    assert "troubles" not in registry.get(name).status
    # A malformed entry (written by hand, or by another version) is skipped, not a traceback.
    assert event_lines({"troubles": {"a": "junk", "b": {"t": "x"}}}, set()) == [
        "  b: None: None; trying again in 0 s"
    ]
    odd = {"t": [], "count": "x", "retry_in": {}, "what": "w", "error": "e"}
    assert event_lines({"troubles": {"c": odd}, "history": None}, set()) == [
        "  c: w: e; trying again in 0 s"
    ]
    assert shown_restarts({"restarts": "x", "history": {"kind": "failure"}}) == 0
    assert recovery_text({"parts": {"stop": "x", "abort": 0.5}, "seconds": None}).endswith(
        "? s from detection to its first step (abort 0.50)"
    )
    # A recovery after failed attempts: timed from the first failure, and says so.
    two = {"parts": {"failed_attempts": 0.4, "abort": 0.1}, "seconds": 0.9, "attempts": 2}
    assert recovery_text(two).endswith(
        "0.90 s in 2 attempts from the first failure's detection to its first step "
        "(failed_attempts 0.40, abort 0.10)"
    )


def test_notes_and_clears_are_written_in_order_and_never_by_the_caller():
    from elasticd.agent.runner import Notes

    notes, done, gate = Notes(), [], threading.Event()
    notes.put(lambda: (gate.wait(10), done.append("note")))  # etcd slow: the note waits
    notes.put(lambda: done.append("clear"))
    assert done == []  # the caller (a node backing off, a world forming) never waited
    gate.set()
    wait_for(lambda: len(done) == 2, timeout=10)
    assert done == ["note", "clear"]  # a clear never lands before the note it clears
    notes.put(lambda: 1 / 0)  # a failed write is logged; the thread goes on
    notes.put(lambda: done.append("after"))
    wait_for(lambda: "after" in done, timeout=10)


def _runner(record, etcd_client, registry, tmp_path, notes=None):
    """A job runner of node-0 on the real etcd, its rounds not started."""
    from prometheus_client import CollectorRegistry

    from elasticd.agent.launch import NodeInfo
    from elasticd.agent.runner import JobRunner, Notes
    from elasticd.metrics import AgentMetrics

    return JobRunner(record=record, client=etcd_client, registry=registry,
                     node=NodeInfo(node_id="node-0", addr="127.0.0.1",
                                   state_dir=str(tmp_path / "state")),
                     metrics=AgentMetrics(CollectorRegistry()), preempt=threading.Event(),
                     view=None, notes=notes or Notes())  # fmt: skip


def test_a_watched_change_wakes_the_supervision_loop_at_once(tmp_path, etcd_client):
    """(Review.) An etcd watch's change (a node lost, a node waiting) rings the runner's
    doorbell, as a worker's fault does: else the loop took it at its next tick, after a
    worker whose collective failed on the sockets a peer shut for that same change had
    rung, and the round was judged that collective's failure (a scale-up counted as a
    failed recovery). Before the runner's ``run()`` (no doorbell yet) it is only queued."""
    from types import SimpleNamespace

    from elasticd.worker import Doorbell

    registry, name = JobRegistry(etcd_client), fresh_run_id("bell")
    record = registry.submit(parse_job({"name": name, "output_dir": str(tmp_path / "out")}))
    runner = _runner(record, etcd_client, registry, tmp_path)
    change = SimpleNamespace(kind="waiting", nodes=["node-3"], round=4)
    runner._on_change(change)  # no doorbell yet: queued, nothing rung
    bell = runner._doorbell = Doorbell(str(tmp_path / "doorbell"))
    try:
        assert bell.path is not None
        assert not bell.wait(0)
        runner._on_change(change)
        assert bell.wait(0)
        assert runner._take_changes(4) == [change, change]
    finally:
        bell.close()


def test_a_crash_note_that_lands_after_the_next_runners_first_world_is_still_cleared(
    tmp_path, etcd_client
):
    """etcd slow (often why a runner crashed): the agent's note of the crash is still
    queued when the next runner of the job on the node forms its first world, so the
    watched status shows nothing to clear. The clear that world queues goes behind the
    note all the same, and the job's status ends with no trouble."""
    from elasticd.agent.runner import Notes, note_trouble_later

    registry, name = JobRegistry(etcd_client), fresh_run_id("late-note")
    record = registry.submit(parse_job({"name": name, "output_dir": str(tmp_path / "out")}))
    notes, gate = Notes(), threading.Event()
    notes.put(lambda: gate.wait(30))  # etcd slow: what is queued waits
    note_trouble_later(notes, registry, name, record.run_id, "node-0", "its job runner crashed",
                       "KeyError: 'a bug'", count=1, retry_in=2.0)  # fmt: skip
    runner = _runner(record, etcd_client, registry, tmp_path, notes)
    runner._current = lambda: registry.get(name)  # the watched status: no trouble yet
    assert "troubles" not in registry.get(name).status
    runner._clear_trouble()  # its first world
    gate.set()
    done = threading.Event()
    notes.put(done.set)
    assert done.wait(30)
    assert "troubles" not in registry.get(name).status


def _run(args: list[str], tmp_path, timeout: float = 180) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.run([sys.executable, "-m", "elasticd", "run", *args], cwd=str(tmp_path),
                          env=env, capture_output=True, text=True, timeout=timeout)  # fmt: skip


def test_a_command_that_cannot_run_fails_the_job_at_once_naming_it(tmp_path):
    job = tmp_path / "job.yaml"
    job.write_text(
        "name: badcmd\n"
        f"output_dir: {tmp_path / 'out'}\n"
        "nodes: {min: 1, max: 1}\n"
        "command: [/nonexistent/bin/python, train.py]\n"
        "restart: {max_restarts: 5}\n"
    )
    done = _run([str(job), "--nodes", "1", "--timeout", "120"], tmp_path)
    out = done.stdout + done.stderr
    assert done.returncode != 0, out
    # In the job's first world a user's error: no restart is spent on it (it was retried
    # as a crash, max_restarts times).
    line = ("job badcmd: failed (user error (exit code 127): rank 0: exit code 127: elasticd: "
            "cannot run /nonexistent/bin/python: No such file or directory")  # fmt: skip
    assert line in out, out
    assert "restarts (worker failures): 0" in out, out
    assert "Traceback" not in out, out


def test_a_node_whose_round_cannot_start_says_so_while_the_job_waits(tmp_path):
    out_dir = tmp_path / "out"
    out_dir.mkdir()
    (out_dir / "logs").write_text("a file where the round's log directory goes\n")
    done = _run([os.path.join(ROOT, "examples", "tiny.yaml"), "--nodes", "1",
                 "--set", f"output_dir={out_dir}", "--timeout", "6"], tmp_path)  # fmt: skip
    out = done.stdout + done.stderr
    assert "timed out after 6 s" in out, out
    said = [ln for ln in out.splitlines() if ln.startswith("  node-0: its round failed")]
    assert said and "NotADirectoryError" in said[0] and "trying again in 0.5 s" in said[0], out
    assert any("2 times in a row" in ln for ln in said), out  # counted until it runs


def test_a_crashed_job_runner_is_noted_in_the_jobs_status_and_cleared_once_it_runs(
    tmp_path, monkeypatch
):
    """The agent's own crash guard (a bug outside any round): the job is taken again
    later, and its status says which node crashed and why meanwhile; once the node's
    runner forms a world, the note goes (a new runner has no trouble count of its own:
    it reads the note in the watched status). An etcd of its own: the agent takes every
    pending job it sees, and the session's etcd holds other tests' (so on CI this agent
    crashed their runners, not this job's)."""
    from elasticd.etcd import EmbeddedEtcd

    server = EmbeddedEtcd(data_dir=str(tmp_path / "etcd"), name="crash")
    server.start()
    try:
        _crash_twice_then_run(tmp_path, server.client_config(timeout=5.0), monkeypatch)
    finally:
        server.stop()


def _crash_twice_then_run(tmp_path, etcd_config, monkeypatch) -> None:
    name = fresh_run_id("crash")
    real_run = daemon_mod.JobRunner.run
    calls = []

    def crash_twice(self):  # a real agent; only its runner's first two runs are replaced
        if self.name != name:
            return real_run(self)
        calls.append(1)
        if len(calls) <= 2:
            raise KeyError("a bug in the runner")
        return real_run(self)

    monkeypatch.setattr(daemon_mod.JobRunner, "run", crash_twice)
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    config = AgentConfig(etcd=etcd_config, node_id=f"{name}-node", addr="127.0.0.1", nproc=None,
                         state_dir=str(tmp_path / "state"), metrics_port=0)  # fmt: skip
    agent = Agent(config)
    thread = threading.Thread(target=agent.run, daemon=True)
    thread.start()
    try:
        from elasticd.etcd import connect

        with connect(etcd_config) as client:
            registry = JobRegistry(client)
            raw = {"name": name, "output_dir": str(tmp_path / "out"), "nodes": {"min": 1},
                   "model": {"layers": 1, "hidden": 32, "heads": 2, "ffn_hidden": 64,
                             "seq_len": 16},
                   "train": {"steps": 3, "global_batch": 2, "micro_batch": 2},
                   "checkpoint": {"every": 0}}  # fmt: skip
            registry.submit(parse_job(raw))

            def noted():
                record = registry.get(name)
                return (record.status.get("troubles") or {}).get(config.node_id)

            trouble = wait_for(noted, timeout=30)
            assert trouble["what"] == "its job runner crashed"
            assert trouble["error"] == "KeyError: 'a bug in the runner'"
            assert (trouble["count"], trouble["retry_in"]) == (1, pytest.approx(2.0))
            trouble = wait_for(lambda: (noted() or {}).get("count", 0) >= 2 and noted(),
                               timeout=30)  # fmt: skip
            assert trouble["retry_in"] == pytest.approx(4.0)  # backing off, taken again
            final = wait_for(lambda: (r := registry.get(name)).state.terminal and r, timeout=120)
            assert final.state == "succeeded", final.reason
            assert "troubles" not in final.status  # cleared once its world formed
            counted = {kind: agent.metrics.registry.get_sample_value(
                "elasticd_node_troubles_total", {"elasticd_job": name, "kind": kind})
                for kind in ("runner_crashed", "round_failed")}  # fmt: skip
            assert counted == {"runner_crashed": 2.0, "round_failed": 0.0}
    finally:
        agent.stop()
        thread.join(timeout=30)
    assert len(calls) == 3
