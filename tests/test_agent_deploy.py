"""deploy/ stays in step with the code: manifests parse, the example job is valid, and the
dashboard and scrape config use metric names the agent really exports."""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml
from polling import wait_for
from prometheus_client import CollectorRegistry

from elasticd.agent import METRICS_PORT
from elasticd.cli import build_parser
from elasticd.jobspec import RestartConfig
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
    for var in re.findall(r"\$\{?(\w+)\}?", exec_start):
        assert re.search(rf"^{var}=", env, re.M), var
    assert not re.search(r"^ELASTICD_NODE_ID=", env, re.M)  # every node would copy it
    # The agent gets the longest stop it can take: a job's grace period, 15 s more for its
    # workers, and its etcd requests.
    stop = int(re.search(r"^TimeoutStopSec=(\d+)$", unit, re.M).group(1))
    assert stop >= RestartConfig().grace_period + 60
    # Jobs may bind CPUs and NUMA memory (numactl, OMP_PROC_BIND, NCCL): @resources.
    denied = re.search(r"^SystemCallFilter=~(.*)$", unit, re.M).group(1).split()
    assert "@resources" not in denied and "@privileged" in denied


def systemd_words(command: str, env: dict[str, str]) -> list[str]:
    """ExecStart's words after systemd's expansion: ``${VAR}`` is one word (empty when
    blank), ``$VAR`` as a word of its own is the value split at whitespace (none when
    blank)."""
    words = []
    for word in command.replace("\\\n", " ").split():
        bare = re.fullmatch(r"\$(\w+)", word)
        if bare:
            words += env.get(bare.group(1), "").split()
        else:
            words.append(re.sub(r"\$\{(\w+)\}", lambda m: env.get(m.group(1), ""), word))
    return words


def test_the_systemd_unit_refuses_a_blank_etcd_instead_of_starting_a_private_one():
    unit = (DEPLOY / "systemd" / "elasticd-agent.service").read_text()
    exec_start = re.search(r"ExecStart=(.*?)\n(?!\s)", unit, re.S).group(1)
    env = dict(re.findall(r"^(\w+)=(.*)$", (DEPLOY / "systemd" / "elasticd-agent.env").read_text(),
                          re.M))  # fmt: skip
    words = systemd_words(exec_start, env)
    assert build_parser().parse_args(words[1:]).etcd == env["ELASTICD_ETCD"]
    # Blank, missing or only spaces: --etcd has no argument, and the agent stops at once
    # with one line, exit 2 (an agent with no etcd would run a private embedded one).
    elasticd = os.path.join(os.path.dirname(sys.executable), "elasticd")
    no_etcd = "argument --etcd: expected one argument"
    for blank in ({**env, "ELASTICD_ETCD": ""}, {**env, "ELASTICD_ETCD": "  "},
                  {k: v for k, v in env.items() if k != "ELASTICD_ETCD"}):  # fmt: skip
        words = systemd_words(exec_start, blank)
        assert "--etcd" in words
        run = subprocess.run([elasticd, *words[1:]], capture_output=True, text=True,
                             timeout=60, env={**os.environ, **blank, "ELASTICD_ETCD": ""})  # fmt: skip
        assert run.returncode == 2 and run.stdout == "", run.stdout + run.stderr
        assert run.stderr.splitlines() == [f"elasticd: error: agent: {no_etcd}"]


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
    # The etcd it starts compacts (a job's status rewritten every 3 s fills the quota).
    assert "--auto-compaction-mode=revision --auto-compaction-retention=" in text
    # Every elasticd command it runs parses (its variables stand in as plain words).
    commands = re.findall(r'"\$elasticd" ((?:[^\n\\]|\\\n)+)', text)
    assert {c.split()[0] for c in commands} == {"agent", "nodes", "submit"}
    for command in commands:
        words = re.sub(r"\\\n", " ", command).replace('"', "").split()
        # The command ends where the shell's syntax starts: a redirection, pipe, &, ), ;.
        end = next((i for i, w in enumerate(words) if re.match(r"\d*[<>]|[|&;)]", w)), None)
        words = [w.replace("$job_file", "job.yaml").replace("$metrics_port", str(METRICS_PORT))
                 for w in words[:end]]  # fmt: skip
        build_parser().parse_args(words)
    # Nothing assumes an activated virtual environment: Python is elasticd's own.
    assert "python3 -c" not in text and '"$python" -c' in text
    # etcd answers before the agents start; a requeued run's etcd is a new one.
    assert text.index("nodes --etcd") < text.index("agent --etcd")
    assert re.search(r"^\s*etcd_data=.*SLURM_RESTART_COUNT", text, re.M)
    # The agents stop before the etcd they report their preemption to.
    cleanup = re.search(r"^cleanup\(\) \{\n(.*?)^\}", text, re.M | re.S).group(1)
    assert cleanup.index('wait "$pid"') < cleanup.index('kill -TERM "$etcd"')
    # Through the agents' step, not srun (srun turns its SIGTERM into SIGKILL).
    assert 'scancel --signal=TERM "$agents_step"' in cleanup
    assert "--job-name=elasticd-agents" in text and '$2 == "elasticd-agents" && !found' in text


def test_every_deploy_file_serves_and_scrapes_the_agents_default_port_not_dcgm_exporters():
    # 9400 is dcgm-exporter's, on the host network of most GPU nodes: an agent there
    # refused to start.
    assert METRICS_PORT != 9400
    assert build_parser().parse_args(["agent"]).metrics_port == METRICS_PORT
    files = {
        "prometheus/prometheus.yml": 3,  # the static targets
        "slurm/elasticd.sbatch": 1,
        "systemd/elasticd-agent.env": 1,
        "kubernetes/base/agent.yaml": 5,  # annotation, argument, container port, two probes
    }
    for name, count in files.items():
        text = (DEPLOY / name).read_text()
        assert "9400" not in text, name
        assert len(re.findall(rf"\b{METRICS_PORT}\b", text)) == count, name


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


def test_every_test_file_the_deploy_files_cite_exists():
    cited = set()
    for path in [*DEPLOY.rglob("*"), DEPLOY.parent / "Dockerfile"]:
        if path.is_file():
            cited |= set(re.findall(r"\btests/[\w/]+\.(?:py|yml)", path.read_text()))
    assert "tests/test_agent_deploy.py" in cited
    missing = {c for c in cited if not (DEPLOY.parent / c).is_file()}
    assert not missing, missing


def _port_free(port: int) -> bool:
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as etcd binds
        try:
            s.bind(("0.0.0.0", port))
        except OSError:
            return False
    return True


@pytest.mark.slow
def test_the_slurm_script_runs_without_a_venv_and_stops_its_agents_before_its_etcd(tmp_path):
    if not (_port_free(2379) and _port_free(2380)):
        pytest.skip("the script's etcd needs ports 2379 and 2380")
    # Slurm stand-ins: srun runs its one task here, scontrol names this host. PATH has no
    # virtual environment: the script finds elasticd's Python itself.
    fake = tmp_path / "bin"
    fake.mkdir()
    (fake / "srun").write_text(
        '#!/bin/bash\nwhile [[ ${1:-} == --* ]]; do shift; done\nexec "$@"\n'
    )
    (fake / "scontrol").write_text("#!/bin/bash\necho localhost\n")
    # The agents' step, and a SIGTERM to its tasks (the agent itself here: srun is exec).
    (fake / "squeue").write_text('#!/bin/bash\necho "4242.0 etcd"\necho "4242.1 elasticd-agents"\n')
    (fake / "scancel").write_text(
        '#!/bin/bash\necho "scancel $*" >> "$ELASTICD_STATE_ROOT.scancel"\n'
        '[ "$*" = "--signal=TERM 4242.1" ] || exit 1\n'
        'exec pkill -TERM -f -- "agent .*--state-dir $ELASTICD_STATE_ROOT"\n'
    )
    for tool in fake.iterdir():
        tool.chmod(0o755)
    job = tmp_path / "job.yaml"
    job.write_text(yaml.safe_dump({
        "name": "sbatch", "output_dir": str(tmp_path / "run"), "nodes": {"min": 1, "max": 1},
        "nproc_per_node": 1, "parallel": {"tp": 1, "pp": 1},
        "model": {"layers": 1, "hidden": 32, "heads": 2, "ffn_hidden": 64, "vocab": 64,
                  "seq_len": 16},
        "train": {"steps": 100000, "global_batch": 2, "micro_batch": 2, "warmup": 2},
        "data": {"source": "synthetic"}, "checkpoint": {"every": 1000},
        "restart": {"grace_period": 20},
    }))  # fmt: skip
    env = {"HOME": str(tmp_path), "PATH": f"{fake}:/usr/bin:/bin", "OMP_NUM_THREADS": "1",
           "SLURM_JOB_ID": "4242", "SLURM_RESTART_COUNT": "1", "SLURM_NNODES": "1",
           "SLURM_JOB_NODELIST": "localhost", "ELASTICD_METRICS_PORT": "0",
           "ELASTICD_STATE_ROOT": str(tmp_path / "state"),
           "ELASTICD_BIN": os.path.join(os.path.dirname(sys.executable), "elasticd")}  # fmt: skip
    log = tmp_path / "out.log"
    with open(log, "wb") as out:
        script = subprocess.Popen(["bash", str(DEPLOY / "slurm" / "elasticd.sbatch"), str(job)],
                                  stdout=out, stderr=subprocess.STDOUT, env=env,
                                  start_new_session=True)  # fmt: skip
    try:
        wait_for(lambda: "workers started" in log.read_text() or script.poll() is not None,
                 timeout=120)  # fmt: skip
        assert script.poll() is None, log.read_text()[-3000:]
        time.sleep(3)  # a few steps
        script.send_signal(signal.SIGTERM)  # Slurm's --signal=B:TERM before the end
        assert script.wait(timeout=90) == 143
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(script.pid, signal.SIGKILL)
    text = log.read_text()
    # The agents were told through their step (srun would have SIGKILLed them).
    assert (tmp_path / "state.scancel").read_text() == "scancel --signal=TERM 4242.1\n", text
    assert (tmp_path / "state" / "etcd.4242.1").is_dir()  # this run's own etcd
    assert "1 of 1 agents registered" in text
    # The agent left (its preemption recorded in etcd) before etcd was stopped.
    assert "preemption not recorded" not in text
    assert 0 < text.index("job done on this node") < text.index('"received signal; shutting down"')
