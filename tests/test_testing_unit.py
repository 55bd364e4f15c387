"""elasticd.testing's pure parts: the fault language with phases, the worker-side plan
(real files, no cluster), and the assertions' messages."""

from __future__ import annotations

import json
import os

import pytest

from elasticd.errors import JobSpecError, UsageError
from elasticd.faultplan import InjectedFault, PlanSource, WorkerFaults, write_plan
from elasticd.localcluster import AtSteps, LocalCluster, parse_fault
from elasticd.testing import ElasticdAssertionError, Recovery, result_from


@pytest.mark.parametrize(
    ("text", "kind", "target", "step", "phase"),
    [("kill-worker=1@step=5:phase=checkpoint-save", "kill-worker", 1, 5, "checkpoint-save"),
     ("raise-error=0@step=3", "raise-error", 0, 3, None),
     ("raise-error=2@step=3:phase=backward", "raise-error", 2, 3, "backward"),
     ("kill-node=1@step=4:phase=forward", "kill-node", 1, 4, "forward"),
     ("add-node@step=6:phase=optimizer", "add-node", None, 6, "optimizer")],
)  # fmt: skip
def test_faults_keyed_to_a_phase_parse_and_print_back(text, kind, target, step, phase):
    f = parse_fault(text)
    assert (f.kind, f.target, f.step, f.phase) == (kind, target, step, phase)
    assert str(f) == text


def test_a_timed_fault_takes_a_phase_in_either_order():
    a = parse_fault("freeze-node=1@step=4:for=3:phase=backward")
    b = parse_fault("freeze-node=1@step=4:phase=backward:for=3")
    assert a == b and a.duration == 3.0 and a.phase == "backward"


@pytest.mark.parametrize(
    ("text", "says"),
    [("kill-worker=1@step=5:phase=lunch", "phase=lunch is not one of forward"),
     ("kill-worker=1@step=5:phase=forward:phase=backward", "unknown or repeated option"),
     ("kill-worker=1@step=5:when=now", "unknown or repeated option"),
     ("raise-error@step=5", "needs a target"),
     ("kill-worker=1@step=5:for=3", "takes no :for=T")],
)  # fmt: skip
def test_bad_phase_specs_are_one_line_usage_errors(text, says):
    with pytest.raises(UsageError, match=says) as info:
        parse_fault(text)
    assert "\n" not in str(info.value)


def _plan(tmp_path, *texts):
    faults = [parse_fault(t) for t in texts]
    return faults, write_plan(str(tmp_path / "faults"), faults)


def test_a_worker_fires_only_its_own_fault_once_and_raise_error_raises(tmp_path):
    _, path = _plan(tmp_path, "raise-error=1@step=3:phase=backward", "raise-error=0@step=2")
    other = WorkerFaults({"ELASTICD_FAULT_PLAN": path, "RANK": "0"})
    other.at("backward", 3)  # rank 1's fault: nothing happens on rank 0
    target = WorkerFaults({"ELASTICD_FAULT_PLAN": path, "RANK": "1"})
    target.at("forward", 3)  # another phase of the step: nothing
    target.at("backward", 2)  # another step: nothing
    with pytest.raises(InjectedFault, match="raise-error=1@step=3:phase=backward"):
        target.at("backward", 3)
    target.at("backward", 3)  # fired once: a recovery that trains step 3 again goes on
    again = WorkerFaults({"ELASTICD_FAULT_PLAN": path, "RANK": "1"})  # a new process
    again.at("backward", 3)
    with pytest.raises(InjectedFault, match="step 2 done"):
        other.at(None, 2)  # no phase: when the step is reported done
    fired = json.loads((tmp_path / "faults" / "fired" / "fired-0").read_text())
    assert fired["rank"] == 1 and fired["pid"] == os.getpid()


def test_without_a_plan_a_worker_does_nothing():
    faults = WorkerFaults({"RANK": "0"})
    assert faults.entries == []
    faults.at("forward", 1)


def test_the_cluster_side_injects_a_node_fault_when_a_worker_fires_it_and_acks_it(tmp_path):
    faults, _ = _plan(tmp_path, "kill-node=1@step=4:phase=optimizer", "kill-worker=0@step=2")
    source = PlanSource(str(tmp_path / "faults"), faults, AtSteps([]))
    cluster = LocalCluster(base_dir=str(tmp_path / "c"), nproc=1)

    class View:
        pass

    view = View()
    view.cluster, view.step = cluster, 0
    assert source.due(view) == []  # nothing fired yet
    fired_dir = tmp_path / "faults" / "fired"
    (fired_dir / "fired-0").write_text(json.dumps({"rank": 3, "t": 1.0, "pid": 9, "step": 4}))
    (fired_dir / "fired-1").write_text(json.dumps({"rank": 0, "t": 2.0, "pid": 8}))
    due = source.due(view)
    assert due == [faults[0]]  # the node fault is the cluster's to do
    # Its step is the one its rank was in (the records said 3 then: the run said 3 before).
    assert source.step_of(faults[0]) == 4 and source.step_of(faults[1]) is None
    assert [r["fault"] for r in cluster.fault_log] == ["kill-worker=0@step=2"]  # logged only
    assert "SIGKILLed itself at step 2" in cluster.fault_log[0]["detail"]
    assert not (fired_dir / "acked-0").exists()
    source.fault_injected(faults[0], {"detail": "node 1: agent and workers SIGKILLed"})
    assert (fired_dir / "acked-0").exists()  # the waiting worker goes on
    assert source.due(view) == []  # each once


def _result(records, *, history=(), state="succeeded"):
    final = {"state": state, "reason": "r", "metrics": records,
             "status": {"history": list(history)}, "faults": []}  # fmt: skip
    return result_from(final, run_dir="/nowhere", output="")


def test_records_are_the_last_per_step_and_worlds_and_recoveries_come_from_the_history():
    r = _result(
        [{"step": 1, "loss": 3.0}, {"step": 2, "loss": 2.0}, {"step": 2, "loss": 2.5},
         {"step": 3, "loss": 1.0}],
        history=[{"kind": "world", "world": 3}, {"kind": "world", "world": 2},
                 {"kind": "recovery", "round": 2, "reason": "peer_lost", "mode": "inprocess",
                  "source": "peers", "lost_steps": 0, "seconds": 0.6, "parts": {"abort": 0.1}},
                 {"kind": "world", "world": 2}, {"kind": "world", "world": 3}],
    )  # fmt: skip
    assert r.steps == [1, 2, 3] and r.losses == {1: 3.0, 2: 2.5, 3: 1.0}
    assert r.worlds == [3, 2, 3]
    assert r.recoveries == [Recovery(round=2, reason="peer_lost", mode="inprocess",
                                     source="peers", lost_steps=0, seconds=0.6,
                                     parts={"abort": 0.1})]  # fmt: skip
    r.assert_worlds([3, 2, 3]).assert_recovered_within(1.0)
    # Step 2 was recorded twice: trained again, whatever the recovery said.
    assert r.retrained == [2]
    with pytest.raises(ElasticdAssertionError, match=r"steps trained again \(recorded twice"):
        r.assert_no_lost_steps()


def test_a_recovery_that_could_not_tell_its_lost_steps_is_judged_by_metrics_jsonl():
    """A restarted agent that saw no step records lost_steps None: it was read as 0, and
    assert_no_lost_steps passed a run that trained steps again."""
    unknown = {"kind": "recovery", "round": 2, "reason": "peer_lost", "mode": "process",
               "source": "checkpoint", "lost_steps": None, "seconds": 3.0}  # fmt: skip
    again = _result([{"step": s, "loss": 1.0} for s in (1, 2, 3, 4, 3, 4, 5)], history=[unknown])
    assert again.recoveries[0].lost_steps is None and again.retrained == [3, 4]
    with pytest.raises(ElasticdAssertionError, match=r"(?s)trained again.*3-4.*lost unknown"):
        again.assert_no_lost_steps()
    clean = _result([{"step": s, "loss": 1.0} for s in (1, 2, 3)], history=[unknown])
    clean.assert_no_lost_steps()  # nobody said, and no step was trained twice


def test_a_fault_that_could_not_be_applied_counts_as_unfired():
    final = {"state": "succeeded", "reason": "", "metrics": [], "status": {},
             "faults": [{"fault": "kill-node=1@step=3", "kind": "kill-node", "skipped": True,
                         "detail": "not injected: node 1 is not running (its agent exited)"},
                        {"fault": "kill-node=0@step=2", "kind": "kill-node", "detail": ""}]}  # fmt: skip
    r = result_from(final, run_dir="/nowhere", output="")
    assert [f["fault"] for f in r.unfired] == ["kill-node=1@step=3"]


def _dead(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().rsplit(")", 1)[1].split()[0] == "Z"
    except FileNotFoundError:
        return True


def test_a_dead_nodes_kill_is_not_injected_and_a_kill_takes_every_process_of_the_node(tmp_path):
    """kill -9 of an agent that had exited "succeeded" (ProcessLookupError swallowed) and
    counted as fired; and the kill read its workers from workers.json, whose pids may have
    been reused."""
    import subprocess
    import sys

    from elasticd.localcluster import Fault

    cluster = LocalCluster(base_dir=str(tmp_path), nproc=1)
    # An "agent" with a child of its own, as an agent has its workers.
    agent = subprocess.Popen([sys.executable, "-c",
                              "import subprocess, sys, time; "
                              "subprocess.Popen([sys.executable, '-c', 'import time; "
                              "time.sleep(60)']); print('up', flush=True); time.sleep(60)"],
                             stdout=subprocess.PIPE)  # fmt: skip
    try:
        assert agent.stdout.readline() == b"up\n"
        from elasticd.localcluster import descendants

        (child,) = descendants(agent.pid)
        cluster.agents.append(agent)
        kill = Fault(kind="kill-node", target=0, step=1)
        assert not cluster.inject(kill).get("skipped")
        assert agent.poll() is not None
        from polling import until

        assert until(lambda: _dead(child), 10)
        again = cluster.inject(kill)
        assert again["skipped"] and "node 0 is not running" in again["detail"]
        frozen = cluster.inject(Fault(kind="freeze-node", target=0, step=2))
        assert frozen["skipped"]
    finally:
        agent.kill()
        agent.wait()


def test_a_loss_mismatch_is_a_table_of_the_differing_steps():
    ref = _result([{"step": s, "loss": 1.0 / s} for s in range(1, 9)])
    got = _result([{"step": s, "loss": 1.0 / s * (1.01 if s >= 6 else 1.0)} for s in range(1, 8)])
    got.assert_losses_match(ref, after=8)
    with pytest.raises(ElasticdAssertionError) as info:
        got.assert_losses_match(ref, after=2, rtol=1e-4)
    text = str(info.value)
    assert "3 value(s) differ from the reference after step 2" in text
    rows = [
        line.split()
        for line in text.splitlines()
        if line.startswith("  ") and line.strip()[:1].isdigit()
    ]
    assert [row[0] for row in rows] == ["6", "7", "8"]  # step 8: missing from the run
    assert rows[0][1] == "loss" and float(rows[0][4]) == pytest.approx(0.01, rel=1e-3)
    assert rows[2][2] == "-"


def test_lost_steps_at_most_catches_a_script_that_trains_from_step_0_again():
    # A newcomer's script that never loaded its checkpoint passed docs/testing.md's first
    # test: every step's last record equals the reference's. Its recovery said so.
    from elasticd.testing import assert_lost_steps_at_most

    records = [{"step": s, "loss": 1.0} for s in (*range(1, 7), *range(1, 11))]
    history = [{"kind": "world", "world": 3}, {**_rec(2, "peer_lost", 1.0, None),
               "mode": "process", "source": "none", "lost_steps": 6}]  # fmt: skip
    scratch = _result(records, history=history)
    with pytest.raises(ElasticdAssertionError, match=r"^more than 5 step\(s\) lost:\n  round 2: "
                       r"6 step\(s\) lost \(process from none\)"):  # fmt: skip
        scratch.assert_lost_steps_at_most(5)
    scratch.assert_lost_steps_at_most(6)
    history[1] = {**history[1], "source": "checkpoint", "lost_steps": 1}
    resumed = _result([{"step": s, "loss": 1.0} for s in (*range(1, 7), *range(6, 11))],
                      history=history)  # fmt: skip
    assert_lost_steps_at_most(resumed, 5)
    # A recovery whose count nobody could tell: metrics.jsonl judges it.
    history[1] = {**history[1], "lost_steps": None}
    unknown = _result(records, history=history)
    with pytest.raises(ElasticdAssertionError, match=r"recorded twice in metrics.jsonl\), 6 over "
                       r"1 recovery\(ies\): 1-6"):  # fmt: skip
        unknown.assert_lost_steps_at_most(5)
    _result([{"step": s, "loss": 1.0} for s in (*range(1, 7), *range(6, 11))],
            history=history).assert_lost_steps_at_most(5)  # fmt: skip
    gap = _result([{"step": s, "loss": 1.0} for s in (1, 2, 4)], history=history)
    with pytest.raises(ElasticdAssertionError, match=r"steps missing from metrics.jsonl: 3"):
        gap.assert_lost_steps_at_most(5)
    for bad in (-1, 2.5, True, "5"):
        with pytest.raises(UsageError, match=r"^steps: .* must be a whole number of steps >= 0"):
            resumed.assert_lost_steps_at_most(bad)


def test_a_first_difference_in_a_world_of_another_size_says_what_usually_causes_it():
    # A new user's script recorded rank 0's own loss: equal in a world of 3 as in the
    # reference, not in the world of 2 after a lost node.
    ref = _result([{"step": s, "loss": 1.0 / s, "world": 3} for s in range(1, 7)])
    got = _result([{"step": s, "loss": 1.0 / s * (1.1 if s > 3 else 1.0),
                    "world": 3 if s <= 3 else 2} for s in range(1, 7)])  # fmt: skip
    with pytest.raises(ElasticdAssertionError) as info:
        got.assert_losses_match(ref)
    assert ("The first difference, at step 4, is in a world of 2 ranks (the reference's: 3). "
            "A value of one rank's, not one agreed over the ranks") in str(info.value)  # fmt: skip
    same = _result([{"step": s, "loss": 1.0 / s * (1.1 if s > 3 else 1.0), "world": 3}
                    for s in range(1, 7)])  # fmt: skip
    with pytest.raises(ElasticdAssertionError) as info:
        same.assert_losses_match(ref)  # a difference in the same world: no such line
    assert "The first difference" not in str(info.value)


def _rec(round_: int, reason: str, seconds: float, detected_at: float | None) -> dict:
    e = {"kind": "recovery", "round": round_, "reason": reason, "mode": "inprocess",
         "source": "peers", "lost_steps": 0, "seconds": seconds}  # fmt: skip
    return e if detected_at is None else {**e, "detected_at": detected_at}


def test_a_recovery_is_timed_from_the_fault_that_caused_it_its_detection_included():
    """A frozen node's recovery said 0.19 s, from its detection: the lease's TTL before it
    (about 2.8 s) was left out, and assert_recovered_within could not catch a slow
    detection (a new user's trial). Now it counts from the fault the run fired."""
    faults = [
        {"fault": "freeze-node=2@step=6:for=5", "kind": "freeze-node", "t": 100.0, "end": 105.0},
        {"fault": "kill-worker=0@step=99", "kind": "kill-worker", "t": None, "skipped": True},
        {"fault": "kill-worker=5@step=40", "kind": "kill-worker", "t": 107.0, "skipped": True},
        {"fault": "add-node@step=30", "kind": "add-node", "t": 110.0},
        {"fault": "etcd-outage@step=20:for=1", "kind": "etcd-outage", "t": 104.0},
    ]
    # The freeze's recovery; the thawed node back (the outage before it re-formed nothing:
    # a scale-up is no failure's); the added one.
    history = [{"kind": "world", "world": 3}, _rec(2, "peer_lost", 0.2, 102.6),
               _rec(3, "scale_up", 0.3, 105.9), _rec(4, "scale_up", 0.4, 113.0)]  # fmt: skip
    final = {"state": "succeeded", "reason": "r", "metrics": [{"step": 1}],
             "status": {"history": history}, "faults": faults}  # fmt: skip
    r = result_from(final, run_dir="/nowhere", output="")
    assert [x.since_fault for x in r.recoveries] == [pytest.approx(2.8), None, None]
    r.assert_recovered_within(3.0)
    says = r"longer than 1 s:\n  round 2: 2.80 s from the fault, 0.20 s from its detection \("
    with pytest.raises(ElasticdAssertionError, match=says):
        r.assert_recovered_within(1)
    assert "0.20 s (2.80 s from the fault), lost 0" in r.describe()
    # A history without detection times (an older agent's) is timed as before.
    history[1] = _rec(2, "peer_lost", 0.2, None)
    assert result_from(final, run_dir="/nowhere", output="").recoveries[0].since_fault is None


def test_lost_steps_slow_recoveries_and_wrong_worlds_are_named():
    r = _result(
        [{"step": s, "loss": 1.0} for s in (1, 2, 5, 6)],
        history=[{"kind": "world", "world": 2},
                 {"kind": "recovery", "round": 2, "reason": "worker_failed", "mode": "process",
                  "source": "checkpoint", "lost_steps": 3, "seconds": 14.0,
                  "parts": {"stop": 1.0, "spawn": 9.0}}],
    )  # fmt: skip
    with pytest.raises(ElasticdAssertionError, match=r"(?s)3 step\(s\) lost.*missing.*3-4"):
        r.assert_no_lost_steps()
    with pytest.raises(ElasticdAssertionError, match=r"longer than 5 s:\n  round 2: 14.00 s"):
        r.assert_recovered_within(5)
    with pytest.raises(ElasticdAssertionError, match=r"worlds \[2\], expected \[2, 1\]"):
        r.assert_worlds([2, 1])
    with pytest.raises(ElasticdAssertionError, match="no recovery"):
        _result([{"step": 1}]).assert_recovered_within(5)
    with pytest.raises(ElasticdAssertionError, match="did not succeed"):
        _result([], state="failed").assert_succeeded()


def test_a_job_is_a_dict_a_path_or_the_built_in_one_with_overrides(tmp_path, monkeypatch):
    from elasticd.jobspec import load_job
    from elasticd.testing import BUILTIN_JOB, Cluster, _job_dict

    cluster = Cluster(base=str(tmp_path))
    job = cluster.builtin_job(train={"steps": 8}, **{"parallel.tp": 2, "model.layers": 4})
    assert job["train"] == {**BUILTIN_JOB["train"], "steps": 8}
    assert job["parallel"] == {"tp": 2} and job["model"]["layers"] == 4
    assert BUILTIN_JOB["train"]["steps"] == 20  # the base is not changed
    path = tmp_path / "job.yaml"
    path.write_text("name: j\ntrain: {steps: 3, global_batch: 4, micro_batch: 2}\n")
    assert _job_dict(str(path))["train"]["steps"] == 3
    assert _job_dict(load_job(str(path)))["name"] == "j"
    with pytest.raises(UsageError, match=r"no such file$"):
        cluster.script_job(tmp_path / "missing.py")
    # A relative path is the current directory's, not the test file's: the message says so
    # (pytest run from elsewhere than the script's directory got a bare "no such file").
    monkeypatch.chdir(tmp_path)
    says = r"train\.py: no such file \(a relative path is taken from the current directory, "
    with pytest.raises(UsageError, match=says + r".*, not the test file's"):
        cluster.script_job("train.py")
    (tmp_path / "train.py").write_text("")
    assert cluster.script_job("train.py")["command"][1] == str(tmp_path / "train.py")
    with pytest.raises(UsageError, match="restart: 'sometimes' must be inprocess or process"):
        cluster.run(job, restart="sometimes")
    with pytest.raises(JobSpecError, match=r"nodes\.min: a world of 1 ranks is smaller than tp"):
        cluster.run(job)  # the job spec's own checks, before anything starts
    plain = cluster.builtin_job()
    with pytest.raises(
        UsageError, match=r"^faults: 'kill-worker=0@step=2:phase=lunch': phase=lunch"
    ):
        cluster.run(plain, faults=["kill-worker=0@step=2:phase=lunch"])
    with pytest.raises(UsageError, match=r"^faults: raise-error=5@step=2: there is no rank 5"):
        cluster.run(plain, nodes=2, faults=["raise-error=5@step=2"])  # not the CLI's --fault
    # A misspelt kind lists the kinds this fixture takes: not the etcd member faults, which
    # its etcd of one member refuses.
    with pytest.raises(UsageError, match=r"^faults: 'kil-node=1@step=2': expected one of ") as e:
        cluster.run(plain, nodes=2, faults=["kil-node=1@step=2"])
    assert "etcd-outage@step=S" in str(e.value) and "kill-etcd" not in str(e.value), e.value
    assert cluster.runs == [] and not (tmp_path / "run-0" / "out" / "cluster").exists()


def test_faults_that_never_fire_are_named_with_the_reason(tmp_path):
    faults, _ = _plan(tmp_path, "kill-worker=1@step=5:phase=checkpoint-save",
                      "kill-node=2@step=3:phase=forward", "add-node@step=4:phase=optimizer")  # fmt: skip
    outside = AtSteps([parse_fault("kill-node=1@step=99")])
    source = PlanSource(str(tmp_path / "faults"), faults, outside)
    (tmp_path / "faults" / "fired" / "fired-2").write_text("{}")
    assert [(str(f), why) for f, why in source.unfired()] == [
        ("kill-worker=1@step=5:phase=checkpoint-save",
         "rank 1 never reached the checkpoint-save phase of step 5 (a script marks it with "
         "channel.phase('checkpoint-save', 5))"),
        ("kill-node=2@step=3:phase=forward", "no rank of node 2 reached the forward phase of step 3 "
         "(a script marks it with channel.phase('forward', 3))"),
        ("kill-node=1@step=99", "the job ended before step 99 completed"),
    ]  # fmt: skip


def test_a_term_node_fault_holds_its_phase_until_the_workers_own_sigterm(tmp_path):
    import threading
    import time

    _, path = _plan(tmp_path, "term-node=0@step=2:phase=forward")
    (tmp_path / "faults" / "fired" / "acked-0").write_text("{}")  # the cluster did its part
    faults = WorkerFaults({"ELASTICD_FAULT_PLAN": path, "RANK": "3", "ELASTICD_NODE_ID": "node-0"})
    flag = threading.Event()
    threading.Timer(0.3, flag.set).start()  # the agent passes SIGTERM on a moment later
    t0 = time.monotonic()
    faults.at("forward", 2, preempted=flag.is_set)
    assert flag.is_set() and time.monotonic() - t0 >= 0.25


def test_a_fail_collective_fault_waits_for_the_node_faults_beside_it_then_fails_as_a_collective(
    tmp_path,
):
    import threading
    import time

    from elasticd.faultplan import InjectedCollectiveFault
    from elasticd.inprocess import is_comm_error

    _, path = _plan(tmp_path, "kill-node=1@step=5:phase=update",
                    "fail-collective=0@step=5:phase=update", "kill-node=1@step=6:phase=update")  # fmt: skip
    faults = WorkerFaults({"ELASTICD_FAULT_PLAN": path, "RANK": "0", "ELASTICD_NODE_ID": "node-0"})
    faults.at("optimizer", 5)  # not its phase: nothing happens
    fired = tmp_path / "faults" / "fired"
    # The cluster kills node 1 a moment later; step 6's fault is not waited for.
    threading.Timer(0.3, lambda: (fired / "acked-0").write_text("{}")).start()
    t0 = time.monotonic()
    with pytest.raises(InjectedCollectiveFault, match="a collective failed") as info:
        faults.at("update", 5)
    assert time.monotonic() - t0 >= 0.25 and (fired / "fired-1").exists()
    assert is_comm_error(info.value)  # in-process restart recovers it in its process
    faults.at("update", 5)  # fired once


def test_a_node_fault_in_a_phase_waits_for_every_rank_of_the_node_to_get_there(
    tmp_path, monkeypatch
):
    """The first of node 1's two ranks to reach ``update`` does not fire: its peer may
    still be inside the step's last collective, which the kill would break for the other
    nodes too. The node is hit once both are there; a rank that never comes (a spare)
    only delays it, by NODE_GATHER_WAIT."""
    import threading
    import time

    import elasticd.faultplan as faultplan

    _, path = _plan(tmp_path, "kill-node=1@step=5:phase=update")
    fired = tmp_path / "faults" / "fired"
    env = {"ELASTICD_FAULT_PLAN": path, "ELASTICD_NODE_ID": "node-1", "LOCAL_WORLD_SIZE": "2"}
    first = WorkerFaults({**env, "RANK": "2"})
    second = WorkerFaults({**env, "RANK": "3"})
    (fired / "acked-0").write_text("{}")  # the cluster carries it out at once once asked
    waiter = threading.Thread(target=first.at, args=("update", 5))
    waiter.start()
    time.sleep(0.3)
    assert waiter.is_alive() and not (fired / "fired-0").exists()  # rank 3 is not there
    second.at("update", 5)
    waiter.join(5)
    assert not waiter.is_alive() and (fired / "fired-0").exists()
    assert sorted(p.name for p in fired.glob("arrived-*")) == ["arrived-0-2", "arrived-0-3"]

    # Alone: fired after the bound.
    monkeypatch.setattr(faultplan, "NODE_GATHER_WAIT", 0.3)
    _, path = _plan(tmp_path / "alone", "kill-node=1@step=5:phase=update")
    fired = tmp_path / "alone" / "faults" / "fired"
    (fired / "acked-0").write_text("{}")
    t0 = time.monotonic()
    WorkerFaults({**env, "ELASTICD_FAULT_PLAN": path, "RANK": "2"}).at("update", 5)
    assert time.monotonic() - t0 >= 0.25 and (fired / "fired-0").exists()


def test_the_cluster_cannot_raise_inside_a_worker(tmp_path):
    cluster = LocalCluster(base_dir=str(tmp_path), nproc=1)
    for spec in ("raise-error=0@step=2", "fail-collective=0@step=2"):
        record = cluster.inject(parse_fault(spec))
        assert record["skipped"] and "only the workers can raise" in record["detail"]


def test_rank_logs_come_in_round_order_and_leftovers_are_found_by_their_environment(tmp_path):
    import subprocess
    import sys

    from elasticd.testing import ENV_TEST_BASE, leftover_processes, sweep

    for r in (2, 10, 1):
        d = tmp_path / "out" / "logs" / "job-1234abcd" / f"round-{r}"
        d.mkdir(parents=True)
        (d / "rank-1.log").write_text(f"round {r}\n")
    other = tmp_path / "out" / "logs" / "job-99999999" / "round-1"  # an earlier run's
    other.mkdir(parents=True)
    (other / "rank-1.log").write_text("an earlier run\n")
    r = result_from({"state": "succeeded", "metrics": [], "run_id": "job-1234abcd"},
                    run_dir=str(tmp_path / "out"), output="")  # fmt: skip
    assert r.rank_log(1) == "round 1\nround 2\nround 10\n"
    assert sorted(r.logs()) == ["round-1/rank-1.log", "round-10/rank-1.log", "round-2/rank-1.log"]
    base = tmp_path / "elasticd"
    # A user's worker: nothing of the test's directory on its command line.
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"],
                            env={**os.environ, ENV_TEST_BASE: str(base)})  # fmt: skip
    try:
        assert leftover_processes(str(tmp_path)) == [proc.pid]
        assert sweep(str(tmp_path), remove=True, settle=0.2) == [proc.pid]
        assert proc.wait(timeout=10) == -9 and not tmp_path.exists()
    finally:
        proc.kill()


def test_a_hang_worker_fault_at_a_phase_stops_the_worker_itself(tmp_path):
    import subprocess
    import sys
    import time

    _, path = _plan(tmp_path, "hang-worker=2@step=3:phase=optimizer")
    code = ("from elasticd.faultplan import WorkerFaults; import sys\n"
            f"f = WorkerFaults({{'ELASTICD_FAULT_PLAN': {path!r}, 'RANK': '2'}})\n"
            "f.at('forward', 3); f.at('optimizer', 3); print('went on', flush=True)")  # fmt: skip
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 30
        state = ""
        while time.monotonic() < deadline and state != "T":
            with open(f"/proc/{proc.pid}/stat") as fh:
                state = fh.read().rsplit(")", 1)[1].split()[0]
            time.sleep(0.05)
        assert state == "T", "the worker did not stop itself in its optimizer phase"
        assert (tmp_path / "faults" / "fired" / "fired-0").exists()
    finally:
        proc.kill()
        proc.wait(timeout=10)
    assert proc.stdout.read() == ""  # it never went past the phase


def test_a_failed_run_names_its_last_worker_errors_and_a_script_that_recorded_nothing():
    """A script raising at import said only "outcome failed ...; worlds [2, 1, 2, ...]":
    the cause (in the status history) was nowhere in the failure message."""
    failures = [{"kind": "failure", "round": r, "node": "node-1", "reason": "worker_failed",
                 "detail": f"rank 1: exit code 1: ImportError: no module named 'nope' ({r})"}
                for r in range(1, 6)]  # fmt: skip
    text = _result([], history=failures, state="failed").describe()
    assert "no step was recorded (a script reports each step with channel.record" in text
    assert "(2 earlier failures)" in text
    assert "failure round 5 on node-1: worker_failed: rank 1: exit code 1: ImportError" in text
    assert "(3)" in text and "(2)" not in text  # the last three
    assert "no step was recorded" not in _result([{"step": 1, "loss": 1.0}]).describe()


def test_a_key_no_record_of_either_run_has_is_named_not_tabulated():
    """A misspelt `keys=` made a row of "- -" per step that hid the mistake."""
    ref = _result([{"step": s, "loss": 1.0} for s in range(1, 4)])
    got = _result([{"step": s, "loss": 1.0} for s in range(1, 4)])
    got.assert_losses_match(ref, keys=("loss",))
    with pytest.raises(ElasticdAssertionError) as info:
        got.assert_losses_match(ref, keys=("loss", "acc"))
    assert str(info.value) == "keys: 'acc' in no record of either run (recorded: loss, step)"


def test_a_run_is_refused_before_it_starts_when_its_hang_fault_cannot_be_seen_in_time(
    tmp_path, monkeypatch
):
    """The built-in job's hang_timeout is test-sized (the job default, 300 s, equals the
    run's default timeout: a hang-worker fault always timed out); a job that raises it to
    the run's timeout is refused; a dict job gets a few restarts per fault, not 10."""
    from elasticd import localcluster
    from elasticd.testing import Cluster

    cluster = Cluster(base=str(tmp_path), timeout=60)
    job = cluster.builtin_job()
    slow = cluster.builtin_job(restart={"hang_timeout": 60})
    with pytest.raises(UsageError, match=r"^faults: hang-worker=0@step=2: a hung worker is "
                       r"found after restart\.hang_timeout \(60 s\), not within the run's "
                       r"timeout \(60 s\)"):  # fmt: skip
        cluster.run(slow, faults="hang-worker=0@step=2")
    late = cluster.builtin_job(restart={"hang_timeout": 5, "startup_timeout": 90})
    with pytest.raises(UsageError, match=r"^faults: hang-worker=0@step=1:phase=forward: a worker "
                       r"hung before its first step is found by restart\.startup_timeout, after "
                       r"90 s, not within the run's timeout \(60 s\)"):  # fmt: skip
        cluster.run(late, faults="hang-worker=0@step=1:phase=forward")
    (tmp_path / "train.py").write_text("pass\n")
    script = cluster.script_job(str(tmp_path / "train.py"), steps=8)
    with pytest.raises(UsageError, match=r"a script's worker hung inside its first step is never "
                       r"found \(restart\.startup_timeout judges"):  # fmt: skip
        cluster.run(script, faults="hang-worker=0@step=1:phase=forward")
    never = cluster.builtin_job(restart={"hang_timeout": 5, "startup_timeout": 0})
    with pytest.raises(UsageError, match=r"found by restart\.startup_timeout, never \(it is 0\)"):
        cluster.run(never, faults="hang-worker=0@step=1:phase=forward")
    with pytest.raises(UsageError, match=r"^env\['X'\]: 1: names and values must be strings"):
        cluster.run(job, env={"X": 1})
    seen = []

    def fake_run_cluster(spec, **kw):  # what run() would start, captured (pure logic)
        seen.append(spec)
        raise RuntimeError("not started")

    monkeypatch.setattr(localcluster, "run_cluster", fake_run_cluster)
    for faults, given, want, hang, startup in (
        ((), {}, 2, 300, 1800), (["kill-worker=0@step=2"] * 2, {}, 6, 300, 1800),
        ((), {"max_restarts": 7}, 7, 300, 1800), (["hang-worker=0@step=2"], {}, 4, 30, 60),
        (["hang-worker=0@step=2"], {"hang_timeout": 20, "startup_timeout": 9}, 4, 20, 9),
    ):  # fmt: skip
        with pytest.raises(RuntimeError, match="not started"):
            cluster.run(cluster.builtin_job(restart=given), faults=faults)
        assert seen[-1].restart.max_restarts == want
        assert seen[-1].restart.hang_timeout == hang
        assert seen[-1].restart.startup_timeout == startup  # a hang before the first step


def test_the_marker_takes_only_a_timeout(monkeypatch):
    from elasticd.testing.plugin import _timeout

    class Item:
        nodeid = "t.py::test"

        def __init__(self, marker):
            self.marker = marker

        def get_closest_marker(self, name):
            return self.marker

    assert _timeout(Item(pytest.mark.elasticd(timeout=7).mark)) == 7.0
    with pytest.raises(pytest.UsageError, match=r"takes only timeout= \(got timout\)"):
        _timeout(Item(pytest.mark.elasticd(timout=7).mark))


def test_a_script_jobs_fault_past_the_steps_it_names_is_refused_before_the_run(
    tmp_path, monkeypatch
):
    """A script job's fault past train.steps was only found after the whole run (the
    script trained its steps and exited 0, the fault unfired). Where the job names its
    steps (script_job's steps=, a dict's or job file's train.steps) it is refused up front;
    where it leaves them to the default, that says nothing of what the script trains."""
    from elasticd import localcluster
    from elasticd.jobspec import load_job
    from elasticd.testing import Cluster

    script = tmp_path / "train.py"
    script.write_text("")
    cluster = Cluster(base=str(tmp_path / "base"))
    says = (r"^faults: kill-node=1@step=6: step 6 is past the job's last step \(train\.steps: "
            r"4; a script that trains more steps than that: say how many, "
            r"script_job\(\.\.\., steps=N\)\)$")  # fmt: skip
    named = tmp_path / "named.yaml"
    named.write_text(f"name: s\ncommand: [python, {script}]\ntrain: {{steps: 4}}\n")
    for job in (cluster.script_job(script, steps=4), str(named)):
        with pytest.raises(UsageError, match=says):
            cluster.run(job, nodes=2, faults=["kill-worker=0@step=2", "kill-node=1@step=6"])
    with pytest.raises(UsageError, match=r"^faults: kill-node=1@step=6: step 6 is past the "
                       r"job's last step \(train\.steps: 4\)$"):  # fmt: skip
        cluster.run(cluster.builtin_job(train={"steps": 4}), nodes=2, faults="kill-node=1@step=6")
    assert cluster.runs == [] and not (tmp_path / "base").exists()

    def fake_run_cluster(spec, **kw):  # what run() would start, captured (pure logic)
        raise RuntimeError("not started")

    monkeypatch.setattr(localcluster, "run_cluster", fake_run_cluster)
    unnamed = tmp_path / "unnamed.yaml"
    unnamed.write_text(f"name: s\ncommand: [python, {script}]\n")
    for job, fault in ((str(unnamed), "kill-node=1@step=30"),  # the default's 20: unknown
                       (load_job(str(named)), "kill-node=1@step=30"),  # a JobSpec cannot say
                       (cluster.script_job(script, steps=4), "kill-node=1@step=3")):  # fmt: skip
        with pytest.raises(RuntimeError, match="not started"):
            cluster.run(job, nodes=2, faults=fault)
    with pytest.raises(UsageError, match=r"^faults: kill-node=1@step=4: step 4 is the job's "
                       r"last step \(train\.steps: 4\)"):  # fmt: skip
        cluster.run(cluster.script_job(script, steps=4), nodes=2, faults="kill-node=1@step=4")
    with pytest.raises(RuntimeError, match="not started"):  # a rank raises it: in time
        cluster.run(cluster.script_job(script, steps=4), nodes=2, faults="raise-error=1@step=4")


def test_a_stack_dump_after_the_timeout_is_quoted_as_its_main_threads_innermost_frames(tmp_path):
    """faulthandler lists the newest thread first, so the main thread is the dump's last
    part; what the rank printed after the dump (and a second dump) is not quoted."""
    from elasticd.testing import STACK_FRAMES, _main_stack

    before = "step 1/9\nstep 2/9\n"
    saver = ["Thread 0x00007f01 (most recent call first):", '  File "saver.py", line 3 in run', ""]
    main = ["Current thread 0x00007f02 (most recent call first):"]
    main += [f'  File "m{i}.py", line {i} in f{i}' for i in range(STACK_FRAMES + 5)]
    log = tmp_path / "rank-0.log"
    log.write_text(before + "step 3/9\n" + "\n".join([*saver, *main, ""]) + "cancelled\n"
                   + "\n".join(main[:2]) + "\n")  # fmt: skip
    quoted = _main_stack(str(log), len(before))
    assert quoted == [main[0], *main[1 : STACK_FRAMES + 1], "  (5 outer frames more)",
                      "  (1 other thread in the dump, in the log)"]  # fmt: skip
    assert _main_stack(str(log), log.stat().st_size) is None
    assert _main_stack(str(tmp_path / "gone.log"), 0) is None


def test_faults_that_could_only_hit_a_finished_job_or_no_node_are_refused(tmp_path):
    """The cluster fires a phase-less fault once its step completed: at the last step the
    job is over and the fault "fires" on nothing. A node fault's target must exist by its
    step and not be gone by then."""
    from elasticd.localcluster import check_plan

    def check(*faults, nodes=2, steps=10):
        check_plan(nodes_min=1, nproc=1, nodes=nodes, faults=[parse_fault(f) for f in faults],
                   etcd_members=1, steps=steps)  # fmt: skip

    with pytest.raises(UsageError, match=r"step 10 is the job's last step"):
        check("kill-node=1@step=10")
    check("kill-node=1@step=10:phase=forward")
    check("kill-node=1@step=9")
    with pytest.raises(UsageError, match=r"there is no node 2 by step 3 \(nodes 0\.\.1\)"):
        check("kill-node=2@step=3", "add-node@step=8")
    check("kill-node=2@step=3", "add-node@step=3")  # after the same step: the add comes first
    with pytest.raises(UsageError, match=r"there is no node 2 by step 3"):
        check("add-node@step=3", "kill-node=2@step=3:phase=forward")  # inside it: not yet
    with pytest.raises(UsageError, match=r"node 1 is killed by step 5"):
        check("kill-node=1@step=3", "freeze-node=1@step=5", nodes=3)
    check("term-node=1@step=3", "kill-node=1@step=5", nodes=3)  # a kill while it drains
    check("kill-node=1@step=3", "restart-node=1@step=4", "kill-node=1@step=6", nodes=3)
    # Inside step 5 comes before after it: the node is back before it is killed again.
    check("kill-node=1@step=3", "kill-node=1@step=5", "restart-node=1@step=5:phase=forward",
          nodes=3)  # fmt: skip
    # A recover-phase fault fires at a later step than it names.
    check("kill-node=1@step=3", "add-node@step=4", "kill-node=3@step=3:phase=recover", nodes=3)
    # A rank raises at the last step itself, before the job ends.
    check("raise-error=0@step=10", "fail-collective=1@step=10")


@pytest.mark.parametrize(
    ("kw", "says"),
    [(dict(faults=None), r"^faults: None must be a fault spec or a list of them$"),
     (dict(faults=[1]), r"^faults: 1 is not a fault spec"),
     (dict(nodes="3"), r"^nodes: '3' must be a whole number of agents >= 1$"),
     (dict(nodes=0), r"^nodes: 0 must be"),
     (dict(timeout=0), r"^timeout: 0 must be a number of seconds > 0$"),
     (dict(timeout=float("nan")), r"^timeout: nan must be"),
     (dict(timeout=float("inf")), r"^timeout: inf must be"),
     (dict(timeout="60"), r"^timeout: '60' must be"),
     (dict(nodes=2, faults="kill-etcd-leader@step=2"),
      r"^faults: kill-etcd-leader@step=2:for=5: needs an etcd of 3 members; elasticd\.testing"),
     (dict(nodes=2, faults="kill-node=2@step=2"), r"^faults: kill-node=2@step=2: there is no node 2"),
     (dict(nodes=1, faults="kill-node=0@step=2", **{"job": {"nodes": {"min": 2, "max": 2}}}),
      r"starts 1 \(nodes=\)")],
)  # fmt: skip
def test_bad_run_arguments_are_one_line_usage_errors_before_anything_starts(tmp_path, kw, says):
    from elasticd.testing import Cluster

    cluster = Cluster(base=str(tmp_path / "base"))
    job = cluster.builtin_job(**kw.pop("job", {}))
    with pytest.raises(UsageError, match=says):
        cluster.run(job, **kw)
    assert cluster.runs == []


def test_a_reference_takes_no_faults_and_a_spent_test_runs_nothing(tmp_path):
    import time

    from elasticd.testing import Cluster

    cluster = Cluster(base=str(tmp_path / "base"))
    with pytest.raises(UsageError, match=r"^reference: faults: not an argument"):
        cluster.reference(cluster.builtin_job(), faults=["kill-node=0@step=2"])
    spent = Cluster(base=str(tmp_path / "spent"), deadline=time.monotonic() + 5)
    with pytest.raises(UsageError, match=r"this test's timeout leaves \d+ s to its next run"):
        spent.run(spent.builtin_job())
    with pytest.raises(UsageError, match=r"this test's timeout leaves"):
        spent.reference(spent.builtin_job())
    assert spent.runs == [] and spent.references == {}


def test_a_runs_timeout_is_cut_to_what_the_test_has_left(tmp_path, monkeypatch):
    import time

    from elasticd import localcluster
    from elasticd.testing import Cluster

    limits = []

    def fake_run_cluster(spec, **kw):  # what run() would start, captured (pure logic)
        limits.append(kw["timeout"])
        raise RuntimeError("not started")

    monkeypatch.setattr(localcluster, "run_cluster", fake_run_cluster)
    cluster = Cluster(base=str(tmp_path), timeout=300, deadline=time.monotonic() + 120)
    with pytest.raises(RuntimeError, match="not started"):
        cluster.run(cluster.builtin_job())
    assert 100 < limits[0] <= 120
    with pytest.raises(RuntimeError, match="not started"):
        Cluster(base=str(tmp_path), timeout=30, deadline=time.monotonic() + 120).run(
            cluster.builtin_job()
        )
    assert limits[1] == 30


def test_the_plugin_gives_a_tests_runs_its_pytest_timeout_less_their_overhead():
    import time

    from elasticd.testing import RUN_OVERHEAD
    from elasticd.testing.plugin import _GIVEN, _deadline

    class Config:
        def __init__(self, ini):
            self.ini = ini
            self.pluginmanager = self

        def hasplugin(self, name):
            return name == "timeout"

        def getoption(self, name, default=None):
            return None

        def getini(self, name):
            return self.ini

    class Node:
        def __init__(self, marker, given):
            self.marker, self.stash = marker, {}
            if given is not None:
                self.stash[_GIVEN] = given

        def get_closest_marker(self, name):
            return self.marker

    class Request:
        def __init__(self, marker=None, given=None, ini="300"):
            self.node, self.config = Node(marker, given), Config(ini)

    now = time.monotonic()
    given = Request(pytest.mark.timeout(420).mark, given=420.0)  # the plugin's own marker
    assert _deadline(given) == pytest.approx(now + 420 - RUN_OVERHEAD, abs=5)
    assert _deadline(Request(pytest.mark.timeout(25).mark)) is None  # the author's own
    assert _deadline(Request()) == pytest.approx(now + 300 - 75, abs=5)  # the ini's
    assert _deadline(Request(ini="0")) is None  # no timeout at all
