"""A real Prometheus scrapes a real three-agent cluster through faults (a lost node, an
etcd outage, a second lost node), with the scrape job and the alert rules shipped in
deploy/prometheus/. Every dashboard query and every alert expression is evaluated through
Prometheus' HTTP API: the queries return data, the sums are the job's values, and each
alert expression holds only once the fault that should raise it happened.

The alerts' `for:` durations and minute-long thresholds (a 2-minute stall, a 60 s
recovery) are not waited out here; tests/prometheus/alerts_test.yml covers them."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import time
import urllib.parse
import urllib.request
from pathlib import Path

import pytest
import yaml
from polling import wait_for

from elasticd.etcd import connect, reserve_port
from elasticd.jobs import JobRegistry
from elasticd.jobspec import parse_job
from elasticd.localcluster import LocalCluster

ROOT = Path(__file__).resolve().parent.parent
WORKER = os.path.join(os.path.dirname(__file__), "agent_worker.py")
PROMETHEUS = shutil.which("prometheus")
pytestmark = [
    pytest.mark.slow,  # about a minute
    pytest.mark.skipif(
        PROMETHEUS is None,
        reason="prometheus not found (apt-get install prometheus; .ci/run installs it)",
    ),
]
JOB = "live"
# Grafana's variables, as a dashboard viewer would have them.
GRAFANA_VARS = {"$job": JOB, "$__rate_interval": "15s", "$__range": "5m"}


def query(port: int, expr: str) -> list[dict]:
    url = f"http://127.0.0.1:{port}/api/v1/query?" + urllib.parse.urlencode({"query": expr})
    with urllib.request.urlopen(url, timeout=10) as resp:
        body = json.load(resp)
    assert body["status"] == "success", body
    return body["data"]["result"]


def value(port: int, expr: str) -> float | None:
    result = query(port, expr)
    return float(result[0]["value"][1]) if result else None


def dashboard_queries() -> list[tuple[str, str]]:
    dash = json.loads((ROOT / "deploy" / "grafana-dashboard.json").read_text())
    out = []
    for panel in dash["panels"]:
        for target in panel["targets"]:
            expr = target["expr"]
            for var, sub in GRAFANA_VARS.items():
                expr = expr.replace(var, sub)
            out.append((panel["title"], expr))
    return out


def alert_exprs() -> dict[str, str]:
    doc = yaml.safe_load((ROOT / "deploy" / "prometheus" / "alerts.yml").read_text())
    return {r["alert"]: r["expr"] for g in doc["groups"] for r in g["rules"]}


def firing(port: int) -> dict[str, list[dict]]:
    """Each alert expression's result now (whatever its `for:`)."""
    return {name: query(port, expr) for name, expr in alert_exprs().items()}


def start_prometheus(tmp_path: Path, targets: list[str]) -> tuple[subprocess.Popen, int]:
    shipped = yaml.safe_load((ROOT / "deploy" / "prometheus" / "prometheus.yml").read_text())
    job = next(c for c in shipped["scrape_configs"] if c["job_name"] == "elasticd")
    job = {**job, "scrape_interval": "1s", "static_configs": [{"targets": targets}]}
    config = {"global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
              "rule_files": shipped["rule_files"], "scrape_configs": [job]}  # fmt: skip
    (tmp_path / "prometheus.yml").write_text(yaml.safe_dump(config))
    shutil.copy(ROOT / "deploy" / "prometheus" / "alerts.yml", tmp_path / "alerts.yml")
    hold = reserve_port()  # held until Prometheus (Go, SO_REUSEADDR) listens there
    port = hold.getsockname()[1]
    log = open(tmp_path / "prometheus.log", "wb")  # noqa: SIM115
    proc = subprocess.Popen(
        [PROMETHEUS, f"--config.file={tmp_path / 'prometheus.yml'}",
         f"--storage.tsdb.path={tmp_path / 'tsdb'}", f"--web.listen-address=127.0.0.1:{port}"],
        stdout=log, stderr=subprocess.STDOUT,
    )  # fmt: skip
    log.close()

    def ready() -> bool:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/-/ready", timeout=2) as r:
                return r.status == 200
        except OSError:
            return False

    try:
        wait_for(ready, timeout=60)
    finally:
        hold.close()
    return proc, port


def test_a_real_prometheus_scrapes_a_real_cluster_through_faults(tmp_path):
    env = {**os.environ, "AGENT_TEST_STEP_S": "0.1", "OMP_NUM_THREADS": "1"}
    raw = {
        "name": JOB, "output_dir": str(tmp_path / "out"), "nodes": {"min": 2, "max": 3},
        "command": [sys.executable, WORKER], "train": {"steps": 100000, "global_batch": 12,
                                                       "micro_batch": 2},
        "checkpoint": {"every": 5}, "rendezvous": {"ttl": 2, "settle": 1.0},
    }  # fmt: skip
    job = parse_job(raw).with_paths_resolved(tmp_path)
    with LocalCluster(base_dir=str(tmp_path / "cluster"), nproc=1, metrics=True, env=env,
                      agent_args=("--keep-finished-metrics", "60s")) as cluster:  # fmt: skip
        cluster.start(3)
        prom, port = start_prometheus(tmp_path, [f"127.0.0.1:{p}" for p in cluster.metrics_ports])
        try:
            with connect(cluster.etcd.client_config()) as client:
                wait_for(lambda: len(client.get_prefix("/elasticd/nodes/")[0]) == 3, timeout=30)
                JobRegistry(client).submit(job)
            j = f'{{elasticd_job="{JOB}"}}'
            wait_for(lambda: (value(port, f"sum(elasticd_job_step{j})") or 0) >= 10, timeout=90)
            wait_for(lambda: value(port, "sum(elasticd_checkpoint_step)") is not None, timeout=30)
            # Agents are scraped one by one, a second apart: wait until every agent's
            # series are in, then nothing may hold.
            wait_for(lambda: value(port, f"sum(elasticd_job_node_in_world{j})") == 3
                     and value(port, "sum(elasticd_nodes_alive)") == 3, timeout=30)  # fmt: skip
            # Before any fault: no alert expression holds.
            assert {k: v for k, v in firing(port).items() if v} == {}
            # Job gauges: one series, from node rank 0; sum is the job's value.
            assert value(port, f"count(elasticd_world_size{j})") == 1
            assert value(port, f"sum(elasticd_world_size{j})") == 3
            assert value(port, "sum(elasticd_nodes_alive)") == 3
            assert value(port, f"sum(elasticd_job_node_in_world{j})") == 3

            # A node is lost: the world re-forms with two, from the checkpoint.
            cluster.kill_node(2)
            wait_for(lambda: (value(port, f"sum(elasticd_recoveries_total{j})") or 0) >= 1,
                     timeout=90)  # fmt: skip
            wait_for(lambda: value(port, f"sum(elasticd_world_size{j})") == 2, timeout=30)
            # The dead agent's last scrape lingers until Prometheus marks it stale.
            wait_for(lambda: value(port, "sum(elasticd_nodes_alive)") == 2, timeout=60)
            wait_for(lambda: value(port, f"sum(elasticd_checkpoint_load_seconds_count{j})") == 1,
                     timeout=30)  # fmt: skip
            assert (
                value(
                    port, f'sum(elasticd_restarts_total{{elasticd_job="{JOB}",reason="peer_lost"}})'
                )
                == 1
            )
            assert (
                value(
                    port,
                    f'sum(elasticd_restarts_total{{elasticd_job="{JOB}",reason="worker_failed"}})',
                )
                == 0
            )
            assert value(port, f"sum(elasticd_checkpoint_load_seconds_count{j})") == 1
            assert value(port, "sum(elasticd_nodes_alive)") == 2
            # A lost node is no alert of its own; none holds after a quick recovery.
            assert {k: v for k, v in firing(port).items() if v} == {}

            # etcd goes away for a few seconds: the etcd alert's expression holds for the
            # agents, and no other.
            cluster.stop_etcd()
            time.sleep(5)
            cluster.restart_etcd()
            wait_for(lambda: firing(port)["ElasticdEtcdUnreachable"], timeout=30)
            now = firing(port)
            hit = {r["metric"]["instance"] for r in now["ElasticdEtcdUnreachable"]}
            assert hit <= {f"127.0.0.1:{p}" for p in cluster.metrics_ports[:2]} and hit
            assert {k for k, v in now.items() if v} == {"ElasticdEtcdUnreachable"}

            # Every dashboard query returns data (the job's and the cluster's).
            wait_for(lambda: (value(port, f"sum(elasticd_job_step{j})") or 0) > 0, timeout=60)
            # MFU exists only where the trainer knows the devices' peak (not on a CPU):
            # its query must still be valid (query() raises on an error), not non-empty.
            empty = [(title, expr) for title, expr in dashboard_queries()
                     if not query(port, expr) and not title.startswith("MFU")]  # fmt: skip
            assert empty == []

            # A second node is lost: one node left, below nodes.min (2).
            cluster.kill_node(1)
            wait_for(lambda: firing(port)["ElasticdWorldBelowMin"], timeout=60)
            below = firing(port)["ElasticdWorldBelowMin"]
            assert [r["metric"] for r in below] == [{"elasticd_job": JOB}]
            # Once the survivor sees its world is gone, no node trains the job.
            wait_for(lambda: [float(r["value"][1]) for r in firing(port)["ElasticdWorldBelowMin"]]
                     == [0.0], timeout=30)  # fmt: skip
            assert {k for k, v in firing(port).items() if v} <= {
                "ElasticdWorldBelowMin",
                "ElasticdEtcdUnreachable",  # the outage's last minute
            }
        finally:
            prom.terminate()
            prom.wait(timeout=30)
    text = (tmp_path / "prometheus.log").read_text(errors="replace")
    assert not re.search(r"level=error.*rule", text), text[-2000:]
