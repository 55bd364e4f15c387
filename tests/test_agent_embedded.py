"""`elasticd agent` with no --etcd and nothing at 127.0.0.1:2379 starts an embedded etcd
in its state dir, says so, serves the default endpoint, and stops it on SIGTERM."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time

import pytest

WORKER = os.path.join(os.path.dirname(__file__), "agent_worker.py")


def port_open(port: int) -> bool:
    with socket.socket() as s:
        s.settimeout(0.2)
        return s.connect_ex(("127.0.0.1", port)) == 0


def test_an_agent_without_etcd_starts_an_embedded_one_and_runs_a_job(tmp_path):
    if port_open(2379):
        pytest.skip("127.0.0.1:2379 is already taken on this machine")
    env = {k: v for k, v in os.environ.items() if k != "ELASTICD_ETCD"}
    env.update(OMP_NUM_THREADS="1", AGENT_TEST_STEP_S="0.1")
    log_path = tmp_path / "agent.log"
    with open(log_path, "wb") as log:
        agent = subprocess.Popen(
            [sys.executable, "-m", "elasticd", "agent", "--node-id", "solo", "--addr", "127.0.0.1",
             "--state-dir", str(tmp_path / "state"), "--metrics-port", "0", "--allow-commands"],
            env=env, stdout=log, stderr=subprocess.STDOUT,
        )  # fmt: skip
    try:
        deadline = time.monotonic() + 30
        while "started an embedded etcd" not in log_path.read_text():
            assert agent.poll() is None, log_path.read_text()
            assert time.monotonic() < deadline, log_path.read_text()
            time.sleep(0.1)
        assert (tmp_path / "state" / "etcd").is_dir()
        (tmp_path / "job.yaml").write_text(
            json.dumps(
                {
                    "name": "solo",
                    "command": [sys.executable, WORKER],
                    "train": {"steps": 3},
                    "rendezvous": {"settle": 0.2},
                }
            )
        )
        r = subprocess.run(
            [sys.executable, "-m", "elasticd", "submit", "job.yaml", "--follow"],
            cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120,
        )  # fmt: skip
        assert r.returncode == 0, r.stdout + r.stderr
        assert "step 3/3" in r.stdout
    finally:
        agent.send_signal(signal.SIGTERM)
        code = agent.wait(timeout=30)
    assert code == 0, log_path.read_text()[-2000:]
    time.sleep(0.5)
    assert not port_open(2379), "the embedded etcd outlived its agent"
