"""The client commands and the agent's outward faces against real agents: node records,
`submit --follow`, `logs`, `status`, the Prometheus endpoint, the restart limit, spares."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import urllib.request

import pytest
from polling import wait_for

from elasticd.etcd import connect
from elasticd.jobs import JobRegistry
from elasticd.jobspec import parse_job
from elasticd.localcluster import LocalCluster

WORKER = os.path.join(os.path.dirname(__file__), "agent_worker.py")


KEEP_FINISHED = 5
"""Seconds the agents keep a finished job's series (short, so a test sees them go)."""


def scrape(cluster) -> list[str]:
    return [
        urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
        for port in cluster.metrics_ports
    ]


def sample(body: str, series: str) -> float:
    """The value of one exposition line (``name{labels}``); fails if absent."""
    for line in body.splitlines():
        if line.startswith(series + " "):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"{series} not exported")


def job_dict(tmp_path, name, *, steps=5, nodes=(2, 2), **extra):
    raw = {
        "name": name,
        "output_dir": str(tmp_path / name),
        "nodes": {"min": nodes[0], "max": nodes[1]},
        "command": [sys.executable, WORKER],
        "train": {"steps": steps, "global_batch": 12, "micro_batch": 2},
        "checkpoint": {"every": 100},
        "rendezvous": {"ttl": 2, "settle": 1.5},
    }
    for section, values in extra.items():
        raw.setdefault(section, {}).update(values)
    return raw


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    base = tmp_path_factory.mktemp("cli-cluster")
    env = {**os.environ, "AGENT_TEST_STEP_S": "0.2", "OMP_NUM_THREADS": "1"}
    with LocalCluster(base_dir=str(base), nproc=1, metrics=True, env=env,
                      agent_args=("--keep-finished-metrics", f"{KEEP_FINISHED}s")) as c:  # fmt: skip
        c.start(2)
        with connect(c.etcd.client_config()) as client:
            wait_for(lambda: len(client.get_prefix("/elasticd/nodes/")[0]) == 2, timeout=30)
        yield c


def cli(cluster, *args, cwd=None, timeout=120):
    return subprocess.run(
        [sys.executable, "-m", "elasticd", *args, "--etcd", cluster.endpoint],
        capture_output=True, text=True, cwd=cwd, timeout=timeout,
    )  # fmt: skip


def test_a_second_agent_on_a_taken_metrics_port_exits_with_one_line_naming_the_flag(
    cluster, tmp_path
):
    taken = cluster.metrics_ports[0]
    r = subprocess.run(
        [sys.executable, "-m", "elasticd", "agent", "--etcd", cluster.endpoint, "--node-id",
         "node-x", "--state-dir", str(tmp_path / "x"), "--metrics-port", str(taken)],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert r.returncode == 2, r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and "--metrics-port" in lines[0] and str(taken) in lines[0], r.stderr
    with connect(cluster.etcd.client_config()) as client:  # it never registered
        kvs, _ = client.get_prefix("/elasticd/nodes/node-x")
    assert not kvs


def test_an_agent_without_node_id_takes_it_from_the_environment(cluster, tmp_path):
    env = {**os.environ, "ELASTICD_NODE_ID": "node-env"}
    agent = subprocess.Popen(
        [sys.executable, "-m", "elasticd", "agent", "--etcd", cluster.endpoint, "--state-dir",
         str(tmp_path / "env"), "--metrics-port", "0", "--nproc-per-node", "1"],
        env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    try:
        with connect(cluster.etcd.client_config()) as client:
            wait_for(lambda: client.get_prefix("/elasticd/nodes/node-env")[0], timeout=30)
    finally:
        agent.terminate()
        assert agent.wait(timeout=30) == 0


def test_each_agent_registers_its_node_on_a_lease(cluster):
    with connect(cluster.etcd.client_config()) as client:
        kvs, _ = client.get_prefix("/elasticd/nodes/")
    records = {json.loads(kv.value)["node"]: (json.loads(kv.value), kv.lease) for kv in kvs}
    assert set(records) == {"node-0", "node-1"}
    record, lease = records["node-0"]
    assert lease != 0
    assert {"hostname", "addr", "nproc", "devices", "version", "pid"} <= set(record)
    assert record["nproc"] == 1 and record["addr"] == "127.0.0.1"
    listing = cli(cluster, "nodes")
    assert listing.returncode == 0 and "node-0" in listing.stdout and "node-1" in listing.stdout


def test_submit_follow_status_logs_and_metrics_of_a_finished_job(cluster, tmp_path):
    (tmp_path / "job.yaml").write_text(json.dumps(job_dict(tmp_path, "follow")))
    r = cli(cluster, "submit", "job.yaml", "--follow", cwd=tmp_path)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "[########################] step 5/5" in r.stdout and "succeeded" in r.stdout
    bodies = scrape(cluster)  # at once: the series of a finished job go after KEEP_FINISHED
    status = json.loads(cli(cluster, "status", "follow", "--json").stdout)
    assert status["state"] == "succeeded" and status["step"] == 5 and status["world"] == 2
    assert status["checkpoint"] == 5 and status["layout"]["dp"] == 2
    logs = cli(cluster, "logs", "follow", "--rank", "1")
    assert logs.returncode == 0 and "round-1/rank-1.log <==" in logs.stdout
    assert "rank 1 step 5 loss" in logs.stdout and "rank 0 step" not in logs.stdout
    assert "follow" in cli(cluster, "list").stdout
    # Cluster series from the coordinator alone; job gauges from node rank 0 alone; each
    # agent its own memberships: every sum over the agents is right.
    assert sorted(sample(b, "elasticd_nodes_alive") for b in bodies) == [0.0, 2.0]
    assert all(sample(b, 'elasticd_rendezvous_rounds_total{elasticd_job="follow"}') == 1.0
               for b in bodies)  # fmt: skip
    leads = [b for b in bodies if 'elasticd_job_step{elasticd_job="follow"}' in b]
    assert len(leads) == 1
    lead = leads[0]
    assert sample(lead, 'elasticd_job_step{elasticd_job="follow"}') == 5.0
    assert sample(lead, 'elasticd_checkpoint_step{elasticd_job="follow"}') == 5.0
    assert sample(lead, 'elasticd_world_size{elasticd_job="follow"}') == 2.0
    assert sample(lead, 'elasticd_job_step_seconds_count{elasticd_job="follow"}') >= 1
    assert sample(lead, 'elasticd_checkpoint_save_seconds_count{elasticd_job="follow"}') >= 1
    assert sample(lead, 'elasticd_checkpoint_saved_bytes_total{elasticd_job="follow"}') > 0
    committed = sample(
        lead, 'elasticd_checkpoint_last_commit_timestamp_seconds{elasticd_job="follow"}'
    )
    assert abs(committed - time.time()) < 120
    assert all("elasticd_world_size{" not in b for b in bodies if b is not lead)
    # A finished job's series go once they could be scraped; the agents' own stay.
    wait_for(lambda: all('elasticd_job="follow"' not in b for b in scrape(cluster)),
             timeout=KEEP_FINISHED + 10)  # fmt: skip
    assert all("elasticd_agent_registrations_total 1.0" in b for b in scrape(cluster))
    # Run again, it resumes at its last step and ends; its logs are its own, not appended
    # to the first run's round 1, and `logs` shows them, not the first run's.
    again = cli(cluster, "submit", "job.yaml", "--replace", "--follow", cwd=tmp_path)
    assert again.returncode == 0 and "succeeded" in again.stdout, again.stdout + again.stderr
    relogs = cli(cluster, "logs", "follow", "--rank", "1")
    assert relogs.returncode == 0, relogs.stdout + relogs.stderr
    first_path = logs.stdout.splitlines()[0]
    assert relogs.stdout.splitlines()[0] != first_path and "round-1/rank-1.log <==" in relogs.stdout
    assert "rank 1 step 5 loss" not in relogs.stdout


def test_a_job_past_its_restart_limit_fails_and_says_why(cluster, tmp_path):
    raw = job_dict(tmp_path, "limit", steps=400, restart={"max_restarts": 0})
    job = parse_job(raw).with_paths_resolved(tmp_path)
    with connect(cluster.etcd.client_config()) as client:
        reg = JobRegistry(client)
        reg.submit(job)
        wait_for(lambda: (reg.get("limit").status.get("step") or 0) >= 2, timeout=60)
        # Its state, from the coordinator alone: 1 for running, 0 for the other states.
        running = 'elasticd_job_state{elasticd_job="limit",state="running"}'
        wait_for(lambda: sum(running in b for b in scrape(cluster)) == 1, timeout=30)
        (lead,) = [b for b in scrape(cluster) if running in b]
        assert sample(lead, running) == 1.0
        assert sample(lead, running.replace("running", "queued")) == 0.0
        # When this run of it was submitted (the stall alert's start), from the same agent.
        submitted = 'elasticd_job_submitted_timestamp_seconds{elasticd_job="limit"}'
        assert sample(lead, submitted) == pytest.approx(reg.get("limit").submitted)
        assert sum(submitted in b for b in scrape(cluster)) == 1
        pid = next(p for i in range(2) for r, p in cluster.worker_pids(i).items() if r == 0)
        os.kill(pid, 9)
        final = wait_for(lambda: (rec := reg.get("limit")).state.terminal and rec, timeout=60)
    assert final.state == "failed"
    assert "restart limit reached (0)" in final.reason and "worker_failed" in final.reason
    # Counted once: by node rank 0 of the world after it, which found no node lost and
    # failed the job.
    restarts = [sample(b, 'elasticd_restarts_total{elasticd_job="limit",reason="worker_failed"}')
                for b in scrape(cluster)]  # fmt: skip
    assert sum(restarts) == 1.0


def test_status_of_a_job_that_never_ran_shows_dashes_not_python_none(cluster, tmp_path):
    (tmp_path / "job.yaml").write_text(json.dumps(job_dict(tmp_path, "waits", nodes=(3, 3))))
    assert cli(cluster, "submit", "job.yaml", cwd=tmp_path).returncode == 0
    try:
        status = cli(cluster, "status", "waits")
        listing = cli(cluster, "list")
        nodes = cli(cluster, "nodes")
    finally:
        cli(cluster, "cancel", "waits")
    assert status.returncode == 0 and "job waits: " in status.stdout
    assert "world -  round -  layout -" in status.stdout and "last failure -" in status.stdout
    for out in (status.stdout, listing.stdout, nodes.stdout):
        assert "None" not in out, out


def test_a_spare_node_replaces_a_lost_one_without_a_layout_change(tmp_path):
    env = {**os.environ, "AGENT_TEST_STEP_S": "0.2", "OMP_NUM_THREADS": "1"}
    # Enough steps that the job is still running when the kill lands: the status's step
    # is written at most every few seconds, so "step >= 4" may be read many steps late.
    job = parse_job(job_dict(tmp_path, "spare", steps=60, nodes=(2, 2), checkpoint={"every": 3}))
    job = job.with_paths_resolved(tmp_path)
    with LocalCluster(base_dir=str(tmp_path / "c"), nproc=1, env=env) as c:
        c.start(3)
        with connect(c.etcd.client_config()) as client:
            wait_for(lambda: len(client.get_prefix("/elasticd/nodes/")[0]) == 3, timeout=30)
            reg = JobRegistry(client)
            reg.submit(job)
            wait_for(lambda: (reg.get("spare").status.get("step") or 0) >= 4, timeout=60)
            members = [i for i in range(3) if c.worker_pids(i)]
            assert len(members) == 2  # nodes.max is 2: the third agent is a spare
            assert not reg.get("spare").state.terminal
            c.kill_node(members[0])
            final = wait_for(lambda: (r := reg.get("spare")).state.terminal and r, timeout=90)
    assert final.state == "succeeded", final.reason
    worlds = [e for e in final.status["history"] if e["kind"] == "world"]
    assert [w["world"] for w in worlds] == [2, 2]
    assert worlds[0]["layout"] == worlds[1]["layout"] == "tp1 pp1 dp2"
    # History events carry no node lists; the status keeps the last world's nodes.
    spare = ({0, 1, 2} - set(members)).pop()
    assert f"node-{spare}" in final.status["nodes"]
    assert f"node-{members[0]}" not in final.status["nodes"]


def test_status_of_a_pending_job_says_when_no_agent_is_registered(tmp_path):
    """`submit --follow` said why a job waits with no agent anywhere; `status` said only
    "pending" (a newcomer's walk)."""
    from elasticd.etcd import EmbeddedEtcd

    server = EmbeddedEtcd(data_dir=str(tmp_path / "etcd")).start()
    try:
        (tmp_path / "job.yaml").write_text(json.dumps(job_dict(tmp_path, "alone")))
        run = [sys.executable, "-m", "elasticd"]
        etcd = ["--etcd", server.endpoint]
        assert subprocess.run([*run, "submit", "job.yaml", *etcd], cwd=tmp_path,
                              capture_output=True, timeout=120).returncode == 0  # fmt: skip
        out = subprocess.run([*run, "status", "alone", *etcd], capture_output=True, text=True,
                             timeout=120).stdout  # fmt: skip
        assert out.startswith(
            "job alone: pending (submitted; no agent is registered: start one "
        ), out
    finally:
        server.stop()
