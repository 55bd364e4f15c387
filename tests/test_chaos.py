"""The chaos soak (bench/chaos.py), as the command a user runs: one job on a local cluster
of 3 agents over a 3-member etcd, through random faults of every kind, checked against an
uninterrupted run of the same job.

The short soak (about 3 minutes on 2 cores, each of the nine kinds once) is in the default
suite; the 20-minute one (30 faults) is `slow`. Both check what the soak is for: the job
succeeds, every fault is recovered from, no committed checkpoint is lost or fails
`elasticd ckpt verify`, and every step's loss equals the uninterrupted run's within 1e-4.
How long things took is the report's business, not the test's.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

BENCH = os.path.join(
    os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "bench", "chaos.py"
)


def soak(tmp_path, *, seed: int, minutes: float) -> dict:
    out = tmp_path / "chaos"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    r = subprocess.run(
        # A generous recovery limit: other work on the machine slows start-ups, not outcomes.
        [sys.executable, BENCH, "--seed", str(seed), "--minutes", str(minutes), "--out", str(out),
         "--recovery-limit", "600"],
        capture_output=True, text=True, env=env, timeout=minutes * 60 * 6 + 900,
    )  # fmt: skip
    print(r.stdout[-8000:], r.stderr[-4000:])
    assert (out / "chaos-report.json").exists(), r.stderr[-2000:]
    return json.loads((out / "chaos-report.json").read_text())


def assert_soak_held(report: dict, *, faults: int) -> None:
    job = report["job"]
    assert job["state"] == "succeeded", job["reason"]
    assert job["steps_completed"] == report["steps"]
    problems = [f"{f['fault']}: {f['problem']}" for f in report["faults"] if not f["recovered"]]
    assert not problems, problems
    assert len(report["faults"]) >= faults, report["injection_stopped"]
    assert {f["kind"] for f in report["faults"]} == {
        "kill-node", "term-node", "freeze-node", "kill-worker", "hang-worker", "add-node",
        "kill-etcd-member", "kill-etcd-leader", "etcd-outage",
    }  # fmt: skip
    ckpt = report["checkpoints"]
    assert ckpt["on_disk"] > 0 and ckpt["verified_ok"] == ckpt["on_disk"], ckpt["corrupted"]
    assert ckpt["lost"] == [], "a step once committed is gone"
    losses = report["losses"]
    assert losses["compared"] == losses["records"] > 0
    assert losses["mismatch_count"] == 0, losses["mismatches"]


@pytest.mark.slow  # not yet verified through pytest in the default suite (5-6 min); see the issue note
@pytest.mark.timeout(2400)
def test_a_short_chaos_soak_keeps_every_checkpoint_and_the_uninterrupted_losses(tmp_path):
    report = soak(tmp_path, seed=1, minutes=3)
    assert_soak_held(report, faults=9)


@pytest.mark.slow
@pytest.mark.timeout(3 * 3600)
def test_a_twenty_minute_chaos_soak_with_thirty_faults_keeps_the_job_whole(tmp_path):
    report = soak(tmp_path, seed=7, minutes=20)
    assert_soak_held(report, faults=30)
