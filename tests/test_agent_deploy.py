"""deploy/ stays in step with the code: manifests parse, the example job is valid, and the
dashboard and scrape config use metric names the agent really exports."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from prometheus_client import CollectorRegistry

from elasticd.cli import build_parser
from elasticd.metrics import JOB_LABEL, AgentMetrics

DEPLOY = Path(__file__).resolve().parent.parent / "deploy"


def exported_names() -> set[str]:
    names = set()
    for metric in AgentMetrics(CollectorRegistry()).registry.collect():
        names.add(metric.name)
        for suffix in ("_total", "_bucket", "_count", "_sum", "_created"):
            names.add(metric.name + suffix)
    return names


def test_every_metric_on_the_dashboard_is_one_the_agent_exports():
    dashboard = json.loads((DEPLOY / "grafana-dashboard.json").read_text())
    used = set()
    for panel in dashboard["panels"]:
        for target in panel["targets"]:
            used.update(re.findall(r"\belasticd_[a-z_]+", target["expr"]))
    used.discard(JOB_LABEL)  # the job label, not a metric
    assert used, "the dashboard charts nothing"
    assert used <= exported_names(), used - exported_names()
    # Every series the agent exports is on the dashboard somewhere.
    base = {m.name for m in AgentMetrics(CollectorRegistry()).registry.collect()}
    charted = {n.removesuffix("_bucket").removesuffix("_total") for n in used}
    assert base <= charted | {n.removesuffix("_total") for n in used}, base - charted


def test_the_systemd_unit_lets_the_agent_drive_a_stop_and_names_real_options():
    unit = (DEPLOY / "systemd" / "elasticd-agent.service").read_text()
    assert "KillMode=mixed" in unit and "KillSignal=SIGTERM" in unit
    exec_start = re.search(r"ExecStart=(.*?)\n(?!\s)", unit, re.S).group(1)
    words = exec_start.replace("\\\n", " ").split()
    assert words[1] == "agent"
    # Nothing node-specific is hard-coded: the node id is the host name (or the env file's).
    assert "--node-id" not in words
    options = [w for w in words if w.startswith("--")]
    parsed = build_parser().parse_args(
        ["agent", *[x for o in options for x in (o, "1" if "port" in o or "nproc" in o else "x")]]
    )
    assert parsed.command == "agent"
    env = (DEPLOY / "systemd" / "elasticd-agent.env").read_text()
    for var in re.findall(r"\$\{(\w+)\}", unit):
        assert re.search(rf"^{var}=", env, re.M), var
    assert not re.search(r"^ELASTICD_NODE_ID=", env, re.M)  # every node would copy it


SYSTEMD_ANALYZE = shutil.which("systemd-analyze")


@pytest.mark.skipif(SYSTEMD_ANALYZE is None, reason="systemd-analyze not found")
def test_the_systemd_unit_is_hardened_and_verifies_clean(tmp_path):
    unit = (DEPLOY / "systemd" / "elasticd-agent.service").read_text()
    # verify checks that ExecStart's program exists: point it at this install's.
    elasticd = os.path.join(os.path.dirname(sys.executable), "elasticd")
    copy = tmp_path / "elasticd-agent.service"
    copy.write_text(unit.replace("/opt/elasticd/.venv/bin/elasticd", elasticd))
    verify = subprocess.run([SYSTEMD_ANALYZE, "verify", str(copy)], capture_output=True,
                            text=True, timeout=60)  # fmt: skip
    assert verify.returncode == 0 and verify.stderr.strip() == "", verify.stderr
    security = subprocess.run([SYSTEMD_ANALYZE, "security", "--offline=yes", str(copy)],
                              capture_output=True, text=True, timeout=60)  # fmt: skip
    score = re.search(r"Overall exposure level for \S+: ([\d.]+)", security.stdout)
    assert score, security.stdout[-500:] + security.stderr
    assert float(score.group(1)) <= 5.0, security.stdout


def test_the_scrape_config_parses_and_keeps_the_agent_pods():
    config = yaml.safe_load((DEPLOY / "prometheus" / "prometheus.yml").read_text())
    jobs = {c["job_name"]: c for c in config["scrape_configs"]}
    assert {"elasticd", "elasticd-kubernetes"} <= set(jobs)
    keep = jobs["elasticd-kubernetes"]["relabel_configs"][0]
    assert keep["action"] == "keep" and keep["regex"] == "elasticd-agent"


def test_the_slurm_script_parses_and_asks_slurm_for_what_an_elastic_run_needs():
    script = DEPLOY / "slurm" / "elasticd.sbatch"
    text = script.read_text()
    check = subprocess.run(["bash", "-n", str(script)], capture_output=True, text=True)
    assert check.returncode == 0, check.stderr
    directives = re.findall(r"^#SBATCH (\S+)", text, re.M)
    assert {"--ntasks-per-node=1", "--no-kill"} <= set(directives)
    signal = next(d for d in directives if d.startswith("--signal="))
    assert signal.startswith("--signal=B:TERM@") and int(signal.rsplit("@", 1)[1]) >= 60
    assert "--kill-on-bad-exit=0" in text  # one dead agent does not end the others
    # Every elasticd command it runs parses (its variables stand in as plain words).
    commands = re.findall(r'"\$elasticd" ((?:[^\n\\]|\\\n)+)', text)
    assert {c.split()[0] for c in commands} == {"agent", "nodes", "submit"}
    for command in commands:
        words = re.sub(r"\\\n", " ", command).replace('"', "").split()
        words = [w for w in words if w not in ("&", "2>/dev/null")]
        words = [w.replace("$job_file", "job.yaml").replace("$metrics_port", "9400") for w in words]
        build_parser().parse_args(words[: words.index("|")] if "|" in words else words)


def test_docs_metrics_md_lists_every_series_the_agent_exports_with_its_type_and_labels():
    table = {}
    for line in (DEPLOY.parent / "docs" / "metrics.md").read_text().splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 5 and cells[0].startswith("`elasticd_"):
            table[cells[0].strip("`")] = (cells[1], cells[2])
    exported = {}
    for metric in AgentMetrics(CollectorRegistry()).registry.collect():
        name = metric.name + ("_total" if metric.type == "counter" else "")
        exported[name] = metric.type
    assert set(table) == set(exported), set(table) ^ set(exported)
    for name, kind in exported.items():
        assert table[name][0] == kind, name
    # Labels as documented: each documented label is one the series carries.
    m = AgentMetrics(CollectorRegistry())
    for attr, metric in vars(m).items():
        if hasattr(metric, "_labelnames"):
            name = metric._name + ("_total" if metric._type == "counter" else "")
            documented = set(re.findall(r"`(\w+)`", table[name][1]))
            assert documented == set(metric._labelnames), (attr, documented)
