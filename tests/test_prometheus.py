"""The alert rules and the scrape config, checked by Prometheus' own promtool.

`.ci/run` installs the Debian `prometheus` package (which ships promtool) when it is
missing; elsewhere these tests skip and say so."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml
from prometheus_client import CollectorRegistry

from elasticd.metrics import JOB_LABEL, AgentMetrics

ROOT = Path(__file__).resolve().parent.parent
PROM = ROOT / "deploy" / "prometheus"
PROMTOOL = shutil.which("promtool")
needs_promtool = pytest.mark.skipif(
    PROMTOOL is None,
    reason="promtool not found (apt-get install prometheus; .ci/run installs it)",
)
ALERTS = ("ElasticdJobStalled", "ElasticdRestartStorm", "ElasticdCheckpointStale",
          "ElasticdWorldBelowMin", "ElasticdJobWaiting", "ElasticdEtcdUnreachable",
          "ElasticdNodeFlapping", "ElasticdSlowRecovery")  # fmt: skip


def promtool(*args: str, cwd: Path = ROOT) -> subprocess.CompletedProcess:
    assert PROMTOOL is not None
    return subprocess.run([PROMTOOL, *args], capture_output=True, text=True, cwd=cwd, timeout=60)


def rules() -> list[dict]:
    doc = yaml.safe_load((PROM / "alerts.yml").read_text())
    return [rule for group in doc["groups"] for rule in group["rules"]]


def test_every_alert_is_there_and_names_only_series_the_agent_exports():
    assert [r["alert"] for r in rules()] == list(ALERTS)
    exported = set()
    for metric in AgentMetrics(CollectorRegistry()).registry.collect():
        exported |= {metric.name + s for s in ("", "_total", "_bucket", "_count", "_sum")}
    for rule in rules():
        used = set(re.findall(r"\belasticd_[a-z_]+", rule["expr"])) - {JOB_LABEL}
        assert used and used <= exported, (rule["alert"], used - exported)


def test_every_alert_has_a_unit_test_that_expects_it_to_fire():
    tests = yaml.safe_load((ROOT / "tests" / "prometheus" / "alerts_test.yml").read_text())
    fired = {case["alertname"] for t in tests["tests"] for case in t["alert_rule_test"]
             if case["exp_alerts"]}  # fmt: skip
    quiet = {case["alertname"] for t in tests["tests"] for case in t["alert_rule_test"]
             if not case["exp_alerts"]}  # fmt: skip
    assert fired == quiet == set(ALERTS)


@needs_promtool
def test_the_alert_rules_pass_promtool_check_and_their_unit_tests():
    check = promtool("check", "rules", str(PROM / "alerts.yml"))
    assert check.returncode == 0, check.stdout + check.stderr
    assert f"SUCCESS: {len(ALERTS)} rules found" in check.stdout
    result = promtool("test", "rules", "tests/prometheus/alerts_test.yml")
    assert result.returncode == 0, result.stdout + result.stderr


@needs_promtool
def test_the_scrape_config_passes_promtool_check(tmp_path):
    result = promtool("check", "config", "prometheus.yml", cwd=PROM)
    if "kubernetes_sd_configs not found" in result.stdout + result.stderr:
        # Debian's Prometheus is built without Kubernetes discovery: check the rest.
        config = yaml.safe_load((PROM / "prometheus.yml").read_text())
        config["scrape_configs"] = [
            c for c in config["scrape_configs"] if "kubernetes_sd_configs" not in c
        ]
        (tmp_path / "prometheus.yml").write_text(yaml.safe_dump(config))
        shutil.copy(PROM / "alerts.yml", tmp_path / "alerts.yml")
        result = promtool("check", "config", "prometheus.yml", cwd=tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "SUCCESS: 8 rules found" in result.stdout + result.stderr
