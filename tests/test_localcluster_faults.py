"""The local cluster's timed faults, on real etcd and real processes.

A frozen node is SIGSTOPped (its agent and every process under it) and SIGCONTed after
``for`` seconds; an etcd outage stops every member and restarts it on its data dir and
ports; a killed etcd member (or the leader) comes back after ``for`` seconds. The first
tests check the faults themselves; the last ones check that a job (on the small worker of
tests/agent_worker.py) lives through them, which is the agent's part.
"""

from __future__ import annotations

import io
import os
import sys

import pytest
from polling import wait_for

from elasticd.etcd import EtcdClient
from elasticd.jobs import JobRegistry
from elasticd.jobspec import parse_job
from elasticd.localcluster import LocalCluster, parse_fault, print_summary, run_cluster

WORKER = os.path.join(os.path.dirname(__file__), "agent_worker.py")


@pytest.fixture(autouse=True)
def fast_steps(monkeypatch):
    monkeypatch.setenv("AGENT_TEST_STEP_S", "0.25")
    monkeypatch.setenv("OMP_NUM_THREADS", "1")


def make_job(tmp_path, *, name="faults", steps=12, every=3, nodes=(1, 3), nproc=1, **extra):
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


def state(pid: int) -> str:
    """The process state letter from /proc (T: stopped), or '-' once it is gone."""
    try:
        with open(f"/proc/{pid}/stat", encoding="utf-8") as fh:
            return fh.read().rsplit(")", 1)[1].split()[0]
    except OSError:
        return "-"


def ended(cluster: LocalCluster, record: dict) -> dict | None:
    with cluster.lock:
        return record["end"]


def test_a_frozen_node_has_its_agent_and_workers_stopped_and_continued_after_the_duration(
    tmp_path,
):
    job = make_job(tmp_path, steps=400, nodes=(1, 1), nproc=2)
    with LocalCluster(base_dir=str(tmp_path / "c"), nproc=2) as cluster:
        cluster.start(1)
        with EtcdClient(cluster.etcd.client_config()) as client:
            registry = JobRegistry(client)
            registry.submit(job)
            workers = wait_for(lambda: cluster.worker_pids(0), timeout=60)
            wait_for(lambda: (registry.get(job.name).status.get("step") or 0) >= 1, timeout=60)
        agent = cluster.agents[0].pid
        record = cluster.inject(parse_fault("freeze-node=0@step=1:for=2"))
        assert not record.get("skipped"), record["detail"]
        assert "node 0 frozen" in record["detail"]
        everyone = [agent, *workers.values()]
        assert {pid: state(pid) for pid in everyone} == {pid: "T" for pid in everyone}
        assert cluster.alive_nodes() == []  # a frozen node does not count as alive
        end = wait_for(lambda: ended(cluster, record), timeout=10)
        assert end["t"] - record["t"] >= 2.0
        assert "node 0 thawed" in end["detail"]
        assert all(state(pid) not in "T-" for pid in everyone)
        assert cluster.alive_nodes() == [0]


def test_stopping_the_cluster_thaws_a_frozen_node_instead_of_waiting_for_its_timer(tmp_path):
    with LocalCluster(base_dir=str(tmp_path / "c"), nproc=1) as cluster:
        cluster.start(1)
        agent = cluster.agents[0]
        wait_for(lambda: os.path.exists(os.path.join(cluster.state_dir(0), "agent.json")),
                 timeout=60)  # fmt: skip
        record = cluster.inject(parse_fault("freeze-node=0@step=1:for=600"))
        assert state(agent.pid) == "T"
    # The agent got SIGCONT, then SIGTERM, and left on its own (exit 0) within the grace
    # period, instead of being SIGKILLed (-9) as a still-frozen agent would have been.
    assert agent.returncode == 0
    assert record["end"] is None  # the timed thaw never ran; stop() thawed it


def test_dump_stacks_has_a_live_agent_print_its_threads_into_its_log_and_go_on(tmp_path):
    # What a timed-out run leaves behind to be read: every thread's stack, not a dead agent.
    with LocalCluster(base_dir=str(tmp_path / "c"), nproc=1) as cluster:
        cluster.start(1)
        agent = cluster.agents[0]
        wait_for(lambda: os.path.exists(os.path.join(cluster.state_dir(0), "agent.json")),
                 timeout=60)  # fmt: skip
        assert cluster.dump_stacks(settle=0.5) == 1
        log = os.path.join(cluster.base_dir, "agent-0.log")

        def dumped() -> bool:
            with open(log, encoding="utf-8", errors="replace") as fh:
                text = fh.read()
            return "Thread 0x" in text and 'File "' in text and "daemon.py" in text

        wait_for(dumped, timeout=10)
        assert agent.poll() is None  # SIGUSR1 printed; it did not kill


def test_an_etcd_outage_stops_etcd_and_restarts_it_with_its_data_on_the_same_port(tmp_path):
    with LocalCluster(base_dir=str(tmp_path / "c"), nproc=1) as cluster:
        cluster.start(0)
        endpoint = cluster.endpoint
        with EtcdClient(cluster.etcd.client_config(timeout=1.0)) as client:
            client.put("/test/outage", "kept")
            record = cluster.inject(parse_fault("etcd-outage@step=1:for=2"))
            assert cluster.etcd.proc is None
            with pytest.raises(Exception, match=r"etcd|unavailable|connect"):
                client.get("/test/outage")
            end = wait_for(lambda: ended(cluster, record), timeout=30)
            assert "etcd restarted" in end["detail"] and end["t"] - record["t"] >= 2.0
            assert cluster.endpoint == endpoint
            assert client.get("/test/outage").value == b"kept"


def test_killing_the_etcd_leader_keeps_a_quorum_and_the_member_rejoins_after_the_duration(
    tmp_path,
):
    with LocalCluster(base_dir=str(tmp_path / "c"), nproc=1, etcd_members=3) as cluster:
        cluster.start(0)
        assert len(cluster.endpoint.split(",")) == 3
        leader = cluster.etcd_leader()
        with EtcdClient(cluster.etcd.client_config(timeout=5.0)) as client:
            record = cluster.inject(parse_fault("kill-etcd-leader@step=1:for=2"))
            assert f"etcd member {leader} (m{leader}) SIGKILLed" == record["detail"]
            assert cluster.etcd.members[leader].proc.poll() is not None
            client.put("/test/during", "written without the old leader")  # two of three answer
            end = wait_for(lambda: ended(cluster, record), timeout=40)
            assert f"etcd member {leader} restarted" in end["detail"]
        member = cluster.etcd.members[leader]
        with EtcdClient(member.client_config(timeout=5.0)) as alone:
            assert alone.get("/test/during").value == b"written without the old leader"


def test_an_outage_of_a_three_member_etcd_stops_every_member_and_brings_back_the_data(tmp_path):
    with LocalCluster(base_dir=str(tmp_path / "c"), nproc=1, etcd_members=3) as cluster:
        cluster.start(0)
        with EtcdClient(cluster.etcd.client_config(timeout=5.0)) as client:
            client.put("/test/outage", "kept")
            record = cluster.inject(parse_fault("etcd-outage@step=1:for=1"))
            assert all(m.proc is None for m in cluster.etcd.members)
            end = wait_for(lambda: ended(cluster, record), timeout=40)
            assert "etcd restarted" in end["detail"]
            assert client.get("/test/outage").value == b"kept"
        cluster.inject(parse_fault("kill-etcd-member=1@step=1:for=1"))
        assert cluster.etcd.members[1].proc.poll() is not None


# -- a job through these faults: the agent's part --------------------------------------------


def run(job, nodes, faults, *, etcd_members=1, timeout=150):
    out = io.StringIO()
    result = run_cluster(job, nodes=nodes, faults=[parse_fault(f) for f in faults],
                         timeout=timeout, out=out, etcd_members=etcd_members)  # fmt: skip
    print_summary(result, out=out)
    print(out.getvalue())
    return result, out.getvalue()


def assert_steps_exact(result, steps):
    by_step = {r["step"]: r for r in result["metrics"]}
    assert sorted(by_step) == list(range(1, steps + 1))
    for step, rec in by_step.items():
        assert rec["loss"] == pytest.approx(10.0 / (1.0 + step * (step + 1) / 2), rel=1e-9)


# The short chaos soak (tests/test_chaos.py) puts a real job through every one of these
# faults in the default suite; these two full-job runs are `slow` to keep `make test` short.
@pytest.mark.slow
def test_a_job_goes_on_without_a_frozen_node_and_takes_it_back_after_the_thaw(tmp_path):
    job = make_job(tmp_path, steps=40, every=3)
    result, text = run(job, 3, ["freeze-node=1@step=4:for=6"])
    assert result["state"] == "succeeded", result["reason"]
    assert "fault injected: freeze-node=1@step=4:for=6" in text
    assert "fault over: freeze-node=1@step=4:for=6: node 1 thawed" in text
    worlds = [r["world"] for r in result["metrics"]]
    assert worlds[0] == 3 and 2 in worlds and worlds[-1] == 3
    assert_steps_exact(result, 40)
    assert result["status"]["restarts"] == 0  # a frozen node is a lost peer, not a worker failure


@pytest.mark.slow
def test_a_job_lives_through_a_killed_etcd_leader_and_a_whole_etcd_outage(tmp_path):
    # The leader is back (3 s, then its restart) well before the outage begins at step 45.
    # The job trains on for about 10 s after etcd is back (6 s away, about 3 s to stop its
    # members): the rendezvous leases (TTL 2 s) must be refreshed once a leader is
    # elected, so the world never re-forms.
    job = make_job(tmp_path, steps=120, every=100, nodes=(2, 2))
    result, text = run(job, 2, ["kill-etcd-leader@step=5:for=3", "etcd-outage@step=45:for=6"],
                       etcd_members=3)  # fmt: skip
    assert result["state"] == "succeeded", result["reason"]
    assert "fault over: kill-etcd-leader@step=5:for=3: etcd member" in text
    assert "fault over: etcd-outage@step=45:for=6: etcd restarted" in text
    assert result["status"]["restarts"] == 0
    history = result["status"]["history"]
    assert [e["kind"] for e in history] == ["world"], history  # never re-formed
    assert [r["step"] for r in result["metrics"]] == list(range(1, 121))


def test_each_local_node_is_an_nccl_host_of_its_own(tmp_path):
    """Simulated nodes share the machine's GPUs (each rank uses cuda:LOCAL_RANK): NCCL
    refuses two ranks of one host on one device, so each node names a host of its own
    (tests/test_inprocess_nccl.py runs two such ranks on one GPU); a user's NCCL_HOSTID
    is kept as their prefix."""
    cluster = LocalCluster(base_dir=str(tmp_path), nproc=1, env={"PATH": "/bin"})
    cluster.etcd = type("Etcd", (), {"endpoint": "127.0.0.1:1"})()
    envs = [cluster.agent_env(i) for i in range(3)]
    assert len({e["NCCL_HOSTID"] for e in envs}) == 3
    assert [e["ELASTICD_NODE_ID"] for e in envs] == ["node-0", "node-1", "node-2"]
    assert all(e["ELASTICD_ETCD"] == "127.0.0.1:1" and e["PATH"] == "/bin" for e in envs)
    cluster.env["NCCL_HOSTID"] = "rack7"
    assert cluster.agent_env(1)["NCCL_HOSTID"] == "rack7-node-1"


def test_the_summary_says_which_worlds_recorded_no_step():
    """A world formed after the job's last step (an add-node on a fast job) trained
    nothing: the summary's worlds line says so, where before it listed it as any other."""
    world = lambda n, r: {"kind": "world", "world": n, "layout": f"dp{n}", "round": r}  # noqa: E731
    result = {
        "name": "fast", "state": "succeeded",
        "status": {"history": [world(2, 1), world(1, 2), world(2, 3)]},
        "metrics": [{"step": 1, "round": 1, "loss": 1.0}, {"step": 2, "round": 2, "loss": 0.5}],
    }  # fmt: skip
    out = io.StringIO()
    print_summary(result, out=out)
    assert ("  worlds: 2 (dp2, round 1) -> 1 (dp1, round 2) -> "
            "2 (dp2, round 3, no step recorded)\n") in out.getvalue()  # fmt: skip
    for rec in result["metrics"]:
        del rec["round"]  # records that do not name their round: nothing is said
    out = io.StringIO()
    print_summary(result, out=out)
    assert "no step recorded" not in out.getvalue()


def test_the_summary_says_no_python_none_for_a_loss_or_a_step_it_does_not_have():
    """(Newcomer walk.) A run that trained no step (a finished job run again) and a
    script whose records carry no loss: the summary said ``final loss: None``."""
    result = {"name": "j", "state": "succeeded", "status": {"history": []}, "metrics": []}
    out = io.StringIO()
    print_summary(result, out=out)
    assert "  steps completed: none in this run\n" in out.getvalue()
    result["metrics"] = [{"step": 1}, {"step": 2}]
    out = io.StringIO()
    print_summary(result, out=out)
    assert "  steps completed: 2\n" in out.getvalue() and "None" not in out.getvalue()
    result["metrics"][-1]["loss"] = 0.5
    out = io.StringIO()
    print_summary(result, out=out)
    assert "  steps completed: 2  final loss: 0.5\n" in out.getvalue()
