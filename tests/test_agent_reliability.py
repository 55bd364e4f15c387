"""What a real cluster does to the agent, with real etcd, real agents and real workers:
spares past join_timeout, a node's own errors, a worker's user error, duplicate node ids,
device slots and the queue, an etcd outage, a frozen node thawing after the world moved
on, commands agents refuse, and deleting or collecting finished jobs."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time

import pytest
from polling import wait_for

from elasticd.etcd import EmbeddedEtcd, Watch, connect
from elasticd.jobs import JobRegistry
from elasticd.jobspec import parse_job
from elasticd.localcluster import LocalCluster, read_metrics

WORKER = os.path.join(os.path.dirname(__file__), "agent_worker.py")


def make_job(tmp_path, name, *, steps=10, nodes=(1, 1), nproc=1, command=True, **extra):
    raw = {
        "name": name,
        "output_dir": str(tmp_path / name),
        "nodes": {"min": nodes[0], "max": nodes[1]},
        "nproc_per_node": nproc,
        "train": {"steps": steps, "global_batch": 12, "micro_batch": 2},
        "checkpoint": {"every": 3},
        "rendezvous": {"ttl": 2, "settle": 1.0},
    }
    if command:
        raw["command"] = [sys.executable, WORKER]
    for section, values in extra.items():
        raw.setdefault(section, {}).update(values)
    return parse_job(raw).with_paths_resolved(tmp_path)


def env_with(**extra):
    return {**os.environ, "AGENT_TEST_STEP_S": "0.2", "OMP_NUM_THREADS": "1", **extra}


def agent_log(cluster, index):
    with open(os.path.join(cluster.base_dir, f"agent-{index}.log"), errors="replace") as fh:
        return fh.read()


def registered(client, n):
    return lambda: len(client.get_prefix("/elasticd/nodes/")[0]) == n


def finished(reg, name):
    return lambda: (r := reg.get(name)) is not None and r.state.terminal and r


def run_alone(tmp_path, job, env, *, timeout=120):
    """Run ``job`` on one node until it ends; its final record."""
    with LocalCluster(base_dir=str(tmp_path / "c"), nproc=1, env=env) as c:
        c.start(1)
        with connect(c.etcd.client_config()) as client:
            wait_for(registered(client, 1), timeout=30)
            reg = JobRegistry(client)
            reg.submit(job)
            return wait_for(finished(reg, job.name), timeout=timeout)


def test_a_spare_waits_past_join_timeout_and_the_job_succeeds(tmp_path):
    job = make_job(tmp_path, "spare", steps=40, nodes=(2, 2), rendezvous={"join_timeout": 3})
    with LocalCluster(base_dir=str(tmp_path / "c"), nproc=1, env=env_with()) as c:
        c.start(3)
        with connect(c.etcd.client_config()) as client:
            wait_for(registered(client, 3), timeout=30)
            reg = JobRegistry(client)
            reg.submit(job)
            final = wait_for(finished(reg, "spare"), timeout=120)
        logs = [agent_log(c, i) for i in range(3)]
    # 40 steps of 0.2 s outlast join_timeout (3 s) several times over: the spare waited.
    assert final.state == "succeeded", final.reason
    assert final.status.get("restarts", 0) == 0
    assert any("still waiting for a world" in log for log in logs)


def test_a_nodes_own_error_makes_it_leave_and_rejoin_without_failing_the_job(tmp_path):
    job = make_job(tmp_path, "trouble", steps=80, nodes=(1, 2), restart={"scale_up": "immediate"})
    with LocalCluster(base_dir=str(tmp_path / "c"), nproc=1, env=env_with()) as c:
        c.start(2)
        # Node 1 cannot make its round directories: every round of its own fails.
        os.makedirs(c.state_dir(1), exist_ok=True)
        blocker = os.path.join(c.state_dir(1), "jobs")
        with open(blocker, "w") as fh:
            fh.write("not a directory")
        with connect(c.etcd.client_config()) as client:
            wait_for(registered(client, 2), timeout=30)
            reg = JobRegistry(client)
            reg.submit(job)
            wait_for(lambda: "this node's round failed" in agent_log(c, 1), timeout=60)
            wait_for(lambda: (reg.get("trouble").status.get("step") or 0) >= 3, timeout=60)
            os.unlink(blocker)  # the trouble passes: node 1 joins again
            final = wait_for(finished(reg, "trouble"), timeout=120)
    assert final.state == "succeeded", final.reason
    assert final.status.get("restarts", 0) == 0
    worlds = [r["world"] for r in read_metrics(os.path.join(job.out_dir, "metrics.jsonl"))]
    assert 1 in worlds and 2 in worlds  # it trained alone, then with node 1 back


def test_a_workers_user_error_fails_the_job_at_once_without_spending_restarts(tmp_path):
    job = make_job(tmp_path, "usererr", steps=10)
    final = run_alone(tmp_path, job, env_with(AGENT_TEST_USER_ERROR_AT="3"), timeout=60)
    assert final.state == "failed"
    assert "user error" in final.reason and "bad setting at step 3" in final.reason
    assert final.status.get("restarts", 0) == 0
    assert [e["round"] for e in final.status["history"] if e["kind"] == "world"] == [1]


def test_a_job_that_trains_on_between_crashes_outlasts_its_restart_limit(tmp_path):
    # Three crashes, each after the job trained past the furthest step it had reached at
    # the one before: with max_restarts 1, a lifetime count would fail it at the second.
    job = make_job(tmp_path, "flaky", steps=12, restart={"max_restarts": 1})
    final = run_alone(tmp_path, job, env_with(AGENT_TEST_CRASH_AT="2,5,9"))
    assert final.state == "succeeded", final.reason
    st = final.status
    assert st["restarts"] == 3 and st["restart_streak"] == 1 and st["furthest_step"] == 12
    assert [e["reason"] for e in st["history"] if e["kind"] == "failure"] == ["worker_failed"] * 3
    steps = {r["step"] for r in read_metrics(os.path.join(job.out_dir, "metrics.jsonl"))}
    assert steps == set(range(1, 13))


def test_a_crash_at_the_same_step_on_every_resume_fails_after_max_restarts_plus_one(tmp_path):
    # Checkpoints every 3 steps: each resume trains step 4 again and crashes at 5. The
    # steps trained again are no progress.
    job = make_job(tmp_path, "loop", steps=12, restart={"max_restarts": 1})
    final = run_alone(tmp_path, job, env_with(AGENT_TEST_CRASH_LOOP_AT="5"))
    assert final.state == "failed"
    assert final.reason.startswith(
        "restart limit reached (1): 2 failures in a row without training past step 4; last: "
    ), final.reason
    assert "worker_failed" in final.reason and "crashing at step 5" in final.reason
    assert final.status["restarts"] == 2 and final.status["furthest_step"] == 4
    assert [e["round"] for e in final.status["history"] if e["kind"] == "world"] == [1, 2]


def test_a_second_agent_with_a_live_nodes_id_exits_with_one_line(tmp_path):
    with LocalCluster(base_dir=str(tmp_path / "c"), nproc=1, env=env_with()) as c:
        c.start(1)
        with connect(c.etcd.client_config()) as client:
            wait_for(registered(client, 1), timeout=30)
        r = subprocess.run(
            [sys.executable, "-m", "elasticd", "agent", "--etcd", c.endpoint, "--node-id",
             "node-0", "--state-dir", str(tmp_path / "dup"), "--metrics-port", "0"],
            capture_output=True, text=True, timeout=60,
        )  # fmt: skip
    assert r.returncode == 2
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and "node-0" in lines[0] and "already registered" in lines[0], r.stderr
    assert "Traceback" not in r.stderr


def test_two_one_worker_jobs_share_a_two_slot_node_and_a_third_queues_until_one_ends(tmp_path):
    jobs = {
        "short": make_job(tmp_path, "short", steps=12),
        "long": make_job(tmp_path, "long", steps=30),
        "third": make_job(tmp_path, "third", steps=3),
    }
    with LocalCluster(base_dir=str(tmp_path / "c"), nproc=2, env=env_with()) as c:
        c.start(1)
        with connect(c.etcd.client_config()) as client:
            wait_for(registered(client, 1), timeout=30)
            reg = JobRegistry(client)
            reg.submit(jobs["short"])
            reg.submit(jobs["long"])
            wait_for(lambda: all(reg.get(n).state == "running" for n in ("short", "long")),
                     timeout=60)  # fmt: skip
            reg.submit(jobs["third"])
            queued = wait_for(lambda: (r := reg.get("third")).state == "queued" and r, timeout=30)
            assert "needs 1 node with 1 free slot" in queued.reason
            assert reg.get("long").state == "running"  # never oversubscribed
            finals = {n: wait_for(finished(reg, n), timeout=120) for n in jobs}
    assert all(f.state == "succeeded" for f in finals.values()), {
        n: f.reason for n, f in finals.items()
    }
    devices = {
        n: {r["devices"] for r in read_metrics(os.path.join(j.out_dir, "metrics.jsonl"))}
        for n, j in jobs.items()
    }
    assert devices["short"] | devices["long"] == {"0", "1"}
    assert len(devices["short"]) == len(devices["long"]) == 1
    assert devices["third"] == devices["short"]  # it took the slot the short job freed
    third_start = min(r["t"] for r in finals["third"].status["history"] if r["kind"] == "world")
    short_end = finals["short"].since
    assert third_start >= short_end - 1.0


def test_an_etcd_outage_never_crashes_a_runner_and_the_job_goes_on(tmp_path):
    job = make_job(tmp_path, "outage", steps=45, nodes=(2, 2))
    with LocalCluster(base_dir=str(tmp_path / "c"), nproc=1, env=env_with()) as c:
        c.start(2)
        with connect(c.etcd.client_config()) as client:
            wait_for(registered(client, 2), timeout=30)
            JobRegistry(client).submit(job)
        metrics = os.path.join(job.out_dir, "metrics.jsonl")
        wait_for(lambda: len(read_metrics(metrics)) >= 4, timeout=60)
        c.etcd.stop()  # type: ignore[union-attr]
        time.sleep(6.0)  # longer than the rendezvous TTL (2 s) and the client's retries
        during = len(read_metrics(metrics))
        c.etcd.start()  # type: ignore[union-attr]
        with connect(c.etcd.client_config()) as client:
            final = wait_for(finished(JobRegistry(client), "outage"), timeout=120)
        logs = agent_log(c, 0) + agent_log(c, 1)
    assert final.state == "succeeded", final.reason
    assert during > 4  # training went on while etcd was away
    assert "job runner crashed" not in logs and "Traceback" not in logs
    steps = {r["step"] for r in read_metrics(metrics)}
    assert steps == set(range(1, 46))


def test_a_frozen_node_thawed_after_the_world_moved_on_is_fenced_and_rejoins(tmp_path):
    job = make_job(tmp_path, "frozen", steps=60, nodes=(2, 3), restart={"scale_up": "immediate"})
    with LocalCluster(base_dir=str(tmp_path / "c"), nproc=1, env=env_with()) as c:
        c.start(3)
        with connect(c.etcd.client_config()) as client:
            wait_for(registered(client, 3), timeout=30)
            reg = JobRegistry(client)
            reg.submit(job)
            wait_for(lambda: (reg.get("frozen").status.get("step") or 0) >= 4, timeout=60)
            # Freeze node 0 whole (agent and workers): it is node rank 0, the reporter.
            pids = [c.agents[0].pid, *c.worker_pids(0).values()]
            for pid in pids:
                os.kill(pid, signal.SIGSTOP)
            try:
                wait_for(lambda: reg.get("frozen").status.get("world") == 2, timeout=60)
                moved_on = reg.get("frozen").status["round"]
                wait_for(lambda: (reg.get("frozen").status.get("step") or 0) >= 12, timeout=60)
            finally:
                for pid in pids:
                    os.kill(pid, signal.SIGCONT)
            final = wait_for(finished(reg, "frozen"), timeout=150)
        thawed = agent_log(c, 0)
    assert final.state == "succeeded", final.reason
    assert "fenced" in thawed  # its stale round's writes were refused
    assert final.status["round"] > moved_on  # it came back as a new member: a new world
    by_step = {r["step"]: r for r in read_metrics(os.path.join(job.out_dir, "metrics.jsonl"))}
    assert sorted(by_step) == list(range(1, 61))
    for step, rec in by_step.items():
        assert rec["loss"] == pytest.approx(10.0 / (1.0 + step * (step + 1) / 2), rel=1e-9)


# -- agents started by hand: commands, the queue's reasons, delete and collection ---------------


@pytest.fixture
def etcd(tmp_path):
    server = EmbeddedEtcd(data_dir=str(tmp_path / "etcd")).start()
    try:
        yield server
    finally:
        server.stop()


def start_agent(etcd, tmp_path, node, *extra):
    log = open(tmp_path / f"{node}.log", "ab")  # noqa: SIM115
    with log:
        return subprocess.Popen(
            [sys.executable, "-m", "elasticd", "agent", "--etcd", etcd.endpoint, "--node-id",
             node, "--addr", "127.0.0.1", "--nproc-per-node", "1", "--state-dir",
             str(tmp_path / node), "--metrics-port", "0", *extra],
            stdout=log, stderr=subprocess.STDOUT, env=env_with(),
        )  # fmt: skip


def stop_agents(procs):
    for p in procs:
        p.send_signal(signal.SIGTERM)
    for p in procs:
        try:
            p.wait(timeout=20)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


def _pid_1_agent(etcd, tmp_path, node):
    """An agent as a container runs it: PID 1 in its own PID namespace. ``--kill-child``:
    the agent dies with the ``unshare`` the test stops (a signal to ``unshare`` alone left
    the agent running after the test, as an orphan)."""
    log = open(tmp_path / f"{node}.log", "ab")  # noqa: SIM115
    with log:
        return subprocess.Popen(
            ["unshare", "--pid", "--kill-child=SIGKILL", "--mount-proc", sys.executable, "-m", "elasticd",
             "agent", "--etcd", etcd.endpoint, "--node-id", node, "--addr", "127.0.0.1",
             "--state-dir", str(tmp_path / node), "--metrics-port", "0"],
            stdout=log, stderr=subprocess.STDOUT, env=env_with(),
        )  # fmt: skip


def stop_pid_1_agents(procs):
    """Stop agents started by :func:`_pid_1_agent` as a container runtime does: SIGTERM
    to the agent, PID 1 of its namespace. ``unshare`` itself does not die of a SIGTERM
    while it waits for its child: :func:`stop_agents` waited out its 20 s for each."""
    for p in procs:
        path = f"/proc/{p.pid}/task/{p.pid}/children"
        with contextlib.suppress(OSError), open(path, encoding="utf-8") as fh:
            for child in fh.read().split():
                os.kill(int(child), signal.SIGTERM)
    stop_agents(procs)


def test_an_agent_restarted_as_pid_1_in_a_container_takes_over_its_own_record(etcd, tmp_path):
    """In a container every agent is PID 1: the record of the agent just killed names pid 1
    on this host, and "pid 1 is alive" (the new agent itself) refused the restart as a
    duplicate until the old lease ran out (a CrashLoopBackOff meanwhile). Now it waits for
    that lease; and a live agent of the same id, PID 1 in another container with the same
    host name, keeps its lease and the second is refused (not a war of revokes)."""
    import socket

    if subprocess.run(["unshare", "--pid", "--kill-child=SIGKILL", "--mount-proc", "true"],
                      capture_output=True).returncode != 0:  # fmt: skip
        pytest.skip("no unshare (a PID namespace) here")
    with connect(etcd.client_config()) as client:
        old = json.dumps({"hostname": socket.gethostname(), "pid": 1})
        # The killed agent's record: nobody refreshes its lease.
        dead = client.lease_grant(3)
        client.put("/elasticd/nodes/ctr", old, lease=dead)
        # A live one's: refreshed for as long as the test runs.
        live = client.lease_grant(3)
        client.keeper().add(live, 1.0, lambda _lease: None)
        client.put("/elasticd/nodes/dup", old, lease=live)
        procs = [_pid_1_agent(etcd, tmp_path, "ctr"), _pid_1_agent(etcd, tmp_path, "dup")]
        try:
            wait_for(lambda: ((kv := client.get("/elasticd/nodes/ctr")) is not None
                              and kv.lease != dead) or procs[0].poll() is not None,
                     timeout=30)  # fmt: skip
            assert procs[0].poll() is None, (tmp_path / "ctr.log").read_text()
            assert procs[1].wait(timeout=30) == 2
            text = (tmp_path / "dup.log").read_text()
            assert "node id 'dup' is already registered by a live agent (pid 1 on " in text
            assert client.get("/elasticd/nodes/dup").lease == live  # untouched
        finally:
            stop_pid_1_agents(procs)


def test_a_job_with_its_own_command_is_refused_by_agents_that_run_only_the_trainer(etcd, tmp_path):
    procs = [start_agent(etcd, tmp_path, "plain")]
    try:
        with connect(etcd.client_config()) as client:
            wait_for(registered(client, 1), timeout=30)
            reg = JobRegistry(client)
            reg.submit(make_job(tmp_path, "custom"))
            final = wait_for(finished(reg, "custom"), timeout=30)
    finally:
        stop_agents(procs)
    assert final.state == "failed"
    assert final.reason.startswith("refused: no agent runs custom commands")
    assert "--allow-commands" in final.reason and "\n" not in final.reason


def test_an_allow_list_names_the_executables_an_agent_runs(etcd, tmp_path):
    procs = [start_agent(etcd, tmp_path, "listed", "--allow-command", sys.executable)]
    try:
        with connect(etcd.client_config()) as client:
            wait_for(registered(client, 1), timeout=30)
            reg = JobRegistry(client)
            reg.submit(make_job(tmp_path, "listed", steps=3))
            final = wait_for(finished(reg, "listed"), timeout=60)
    finally:
        stop_agents(procs)
    assert final.state == "succeeded", final.reason


def test_a_job_that_cannot_fit_says_why_it_waits(etcd, tmp_path):
    procs = [start_agent(etcd, tmp_path, f"n{i}", "--allow-commands") for i in range(2)]
    try:
        with connect(etcd.client_config()) as client:
            wait_for(registered(client, 2), timeout=30)
            reg = JobRegistry(client)
            reg.submit(make_job(tmp_path, "big", nodes=(3, 3)))
            queued = wait_for(lambda: (r := reg.get("big")).state == "queued" and r, timeout=30)
            assert (
                queued.reason
                == "queued: needs 3 nodes with 1 free slot, 2 of 2 registered have room"
            )
            status = subprocess.run(
                [sys.executable, "-m", "elasticd", "status", "big", "--etcd", etcd.endpoint],
                capture_output=True, text=True, timeout=30,
            )  # fmt: skip
            assert "queued (queued: needs 3 nodes" in status.stdout
            procs.append(start_agent(etcd, tmp_path, "n2", "--allow-commands"))
            final = wait_for(finished(reg, "big"), timeout=90)
    finally:
        stop_agents(procs)
    assert final.state == "succeeded", final.reason


def test_delete_refuses_a_live_job_and_finished_jobs_are_collected_after_their_ttl(etcd, tmp_path):
    def cli(*args):
        return subprocess.run(
            [sys.executable, "-m", "elasticd", *args, "--etcd", etcd.endpoint],
            capture_output=True, text=True, timeout=30,
        )  # fmt: skip

    procs = [start_agent(etcd, tmp_path, "gc", "--allow-commands", "--ttl-after-finished", "4s")]
    try:
        with connect(etcd.client_config()) as client:
            wait_for(registered(client, 1), timeout=30)
            reg = JobRegistry(client)
            reg.submit(make_job(tmp_path, "kept", steps=20))
            wait_for(lambda: reg.get("kept").state == "running", timeout=60)
            r = cli("delete", "kept")
            assert r.returncode == 2 and "cancel it before deleting it" in r.stderr
            assert len(r.stderr.strip().splitlines()) == 1
            reg.cancel("kept")
            r = cli("delete", "kept")
            assert r.returncode == 0, r.stderr
            assert reg.get("kept") is None
            run_keys = client.get_prefix("/elasticd/rdzv/")[0]
            assert not [kv for kv in run_keys if "/kept-" in kv.key]
            reg.submit(make_job(tmp_path, "collected", steps=2))
            wait_for(lambda: (r := reg.get("collected")) is None or r.state.terminal, timeout=60)
            wait_for(lambda: reg.get("collected") is None, timeout=30)  # gone after 4 s
    finally:
        stop_agents(procs)


def test_the_node_record_says_what_the_agent_offers(etcd, tmp_path):
    procs = [start_agent(etcd, tmp_path, "offer", "--allow-command", "python3")]
    try:
        with connect(etcd.client_config()) as client:
            wait_for(registered(client, 1), timeout=30)
            kv = client.get("/elasticd/nodes/offer")
            usage = client.get("/elasticd/usage/offer")
    finally:
        stop_agents(procs)
    record = json.loads(kv.value)
    assert record["slots"] == 1 and record["allow_commands"] == ["python3"]
    assert kv.lease != 0
    # What changes lives beside it, on the same lease: only the coordinator watches it.
    assert json.loads(usage.value) == {"free": 1, "jobs": []}
    assert usage.lease == kv.lease


def test_node_records_stay_as_registered_while_usage_records_follow_the_jobs(etcd, tmp_path):
    # Every agent watches nodes/: a record re-put on every take or release would send each
    # change to every agent (N^2 events for N agents taking one job).
    procs = [start_agent(etcd, tmp_path, f"u{i}", "--allow-commands") for i in range(2)]
    try:
        with connect(etcd.client_config()) as client:
            wait_for(registered(client, 2), timeout=30)
            _, rev = client.get_prefix("/elasticd/nodes/")
            events: list = []
            watch = Watch(client, "/elasticd/nodes/", start_revision=rev + 1,
                          on_events=events.extend)  # fmt: skip
            reg = JobRegistry(client)
            reg.submit(make_job(tmp_path, "busy", steps=25, nodes=(2, 2)))

            def usage(node):
                kv = client.get(f"/elasticd/usage/{node}")
                return json.loads(kv.value) if kv is not None else None

            wait_for(lambda: all(usage(n) == {"free": 0, "jobs": ["busy"]} for n in ("u0", "u1")),
                     timeout=60)  # fmt: skip
            final = wait_for(finished(reg, "busy"), timeout=90)
            wait_for(lambda: all(usage(n) == {"free": 1, "jobs": []} for n in ("u0", "u1")),
                     timeout=30)  # fmt: skip
            listing = subprocess.run(
                [sys.executable, "-m", "elasticd", "nodes", "--json", "--etcd", etcd.endpoint],
                capture_output=True, text=True, timeout=30,
            )  # fmt: skip
            watch.cancel()
    finally:
        stop_agents(procs)
    assert final.state == "succeeded", final.reason
    assert events == []  # not one node record written after registration
    nodes = json.loads(listing.stdout)
    assert [(n["node"], n["slots"], n["free"], n["jobs"]) for n in nodes] == [
        ("u0", 1, 1, []),
        ("u1", 1, 1, []),
    ]
