"""What a job's status says about its progress is true of one step: its loss is that
step's, and its restarts are the decided ones.

A newcomer walking the README saw ``elasticd status`` give step 392 with step 284's loss
(a heartbeat without a loss left the older one in place), a finished job with no loss at
all (the trainer's last heartbeat, after its final save, carried none), and the live line
of ``elasticd run`` go ``restarts 1`` then ``restarts 0`` (a node's death counted as a
worker failure until the next world showed the node lost).
"""

from __future__ import annotations

import json
from types import SimpleNamespace

from conftest import fresh_run_id
from prometheus_client import CollectorRegistry

from elasticd.agent.report import JobReporter
from elasticd.cli.jobs import progress_line
from elasticd.jobs import JobRegistry, shown_restarts
from elasticd.jobspec import parse_job
from elasticd.metrics import AgentMetrics
from elasticd.worker import WorkerChannel


def test_the_status_loss_is_the_steps_own_or_none(tmp_path, etcd_client):
    registry, name = JobRegistry(etcd_client), fresh_run_id("status")
    raw = {"name": name, "output_dir": str(tmp_path / "out"), "train": {"steps": 10}}
    registry.submit(parse_job(raw).with_paths_resolved(tmp_path))
    reporter = JobReporter(name=name, registry=registry, metrics=AgentMetrics(CollectorRegistry()))
    beat = tmp_path / "hb.json"
    channel = WorkerChannel(path=str(beat), rank=0)

    def report() -> dict:
        reporter.progress(json.loads(beat.read_text()), checkpoint=None, write=True)
        return registry.get(name).status

    channel.progress(step=5, loss=2.0, tokens_per_s=100.0)
    assert (report()["step"], report()["loss"]) == (5, 2.0)
    # The trainer's last heartbeat, after its final save: the same step, no loss given.
    channel.progress(step=5, checkpoint_save={"step": 5, "seconds": 0.1})
    hb = json.loads(beat.read_text())
    assert (hb["loss"], hb["checkpoint_save"]["step"]) == (2.0, 5)
    st = report()
    assert (st["step"], st["loss"], st["tokens_per_s"]) == (5, 2.0, 100.0)
    # A later step without a loss: none, never step 5's.
    channel.progress(step=6)
    assert "loss" not in json.loads(beat.read_text())
    st = report()
    assert (st["step"], st["loss"], st["tokens_per_s"]) == (6, None, None)


def test_a_failure_not_yet_decided_is_not_shown_as_a_restart():
    def failure(**kw) -> dict:
        return {"kind": "failure", "round": 1, "reason": "worker_failed", **kw}

    pending = {"restarts": 1, "history": [failure()]}
    assert shown_restarts(pending) == 0  # maybe a lost node's symptom: the next world says
    decided = {"restarts": 1, "history": [failure(counted=True)]}  # the worker's own failure
    assert shown_restarts(decided) == 1
    lost = {"restarts": 0, "history": [failure(reason="peer_lost", counted=True)]}
    assert shown_restarts(lost) == 0
    assert shown_restarts({}) == 0
    both = {"restarts": 2, "history": [failure(counted=True), failure(round=2)]}
    assert shown_restarts(both) == 1
    record = SimpleNamespace(name="j", state="running", reason="",
                             spec={"train": {"steps": 10}}, status={**pending, "step": 3})  # fmt: skip
    assert "restarts 0 " in progress_line(record)


def test_status_shows_the_last_recovery_and_a_waiting_nodes_trouble(etcd_client, etcd_server,
                                                                    capsys):  # fmt: skip
    from elasticd.cli import main

    registry, name = JobRegistry(etcd_client), fresh_run_id("recovered")
    run_id = registry.submit(parse_job({"name": name})).run_id
    recovery = {"kind": "recovery", "round": 2, "reason": "peer_lost", "seconds": 0.3412,
                "mode": "inprocess", "source": "peers", "lost_steps": 0,
                "parts": {"abort": 0.0, "rendezvous": 0.03, "state_transfer": 0.09}}  # fmt: skip
    registry.add_event(name, {"kind": "world", "round": 1})
    registry.add_event(name, {**recovery, "round": 1, "seconds": 9.0})
    registry.add_event(name, recovery)
    registry.note_trouble(name, run_id, "node-3", "its round failed", "OSError: disk", count=2,
                          retry_in=1.0)  # fmt: skip
    assert main(["status", name, "--etcd", etcd_server.endpoint]) == 0
    out = capsys.readouterr().out
    assert ("  last recovery into round 2 (peer_lost), inprocess from peers, 0 steps lost, "
            "0.34 s from detection to its first step (abort 0.00, rendezvous 0.03, "
            "state_transfer 0.09)\n") in out  # fmt: skip
    assert "  node-3: its round failed (2 times in a row): OSError: disk; " in out
    assert main(["status", name, "--json", "--etcd", etcd_server.endpoint]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["last_recovery"]["seconds"] == 0.3412 and doc["troubles"]["node-3"]["count"] == 2
    registry.cancel(name)
    assert main(["status", name, "--etcd", etcd_server.endpoint]) == 0
    assert "node-3" not in capsys.readouterr().out  # moot once the job is over
