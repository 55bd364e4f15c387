"""Ctrl-C during `elasticd run`: a real run in its own session gets SIGINT on its process
group, as a terminal sends it. The first Ctrl-C stops the cluster gracefully (the workers
save their step, as at a preemption) within a bound and says so in one line; a second kills
everything at once. Either way the exit code is 130, with no traceback and no process left.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from elasticd.localcluster import descendants

# A rank that ignores SIGTERM (a preemption it never acts on) and starts a process of its
# own, out of reach of any parent-death signal: only a kill of the whole tree ends both.
STUBBORN = """
import os, signal, subprocess, sys
signal.signal(signal.SIGTERM, signal.SIG_IGN)
child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
print(f"rank {os.environ['RANK']} ready; child {child.pid}", flush=True)
signal.pause()
"""


def start_run(tmp_path: Path, job: dict, *args: str) -> subprocess.Popen:
    (tmp_path / "job.yaml").write_text(json.dumps(job))
    argv = [sys.executable, "-m", "elasticd", "run", "job.yaml", "--nodes", "2",
            "--timeout", "600", *args]  # fmt: skip
    with open(tmp_path / "run.out", "wb") as out, open(tmp_path / "run.err", "wb") as err:
        return subprocess.Popen(
            argv, cwd=tmp_path, stdin=subprocess.DEVNULL, stdout=out, stderr=err,
            env={**os.environ, "OMP_NUM_THREADS": "1"}, start_new_session=True,
        )  # fmt: skip


def wait_for(what, proc: subprocess.Popen, tmp_path: Path, limit: float = 240.0) -> None:
    """Poll ``what()`` until true; the run ending first, or ``limit`` (generous) passing,
    fails with what it printed."""
    deadline = time.monotonic() + limit
    while not what():
        assert proc.poll() is None, said(tmp_path)
        assert time.monotonic() < deadline, said(tmp_path)
        time.sleep(0.1)


def said(tmp_path: Path) -> str:
    return "".join(
        (tmp_path / n).read_text(errors="replace")
        for n in ("run.out", "run.err")
        if (tmp_path / n).exists()
    )


def logs(tmp_path: Path) -> str:
    return "".join(
        p.read_text(errors="replace") for p in sorted((tmp_path / "out" / "logs").rglob("*.log"))
    )


def alive(pids: list[int]) -> list[int]:
    """Those of ``pids`` still running (a zombie has ended)."""
    out = []
    for pid in pids:
        try:
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except (OSError, IndexError):
            continue
        if state not in ("Z", "X"):
            out.append(pid)
    return out


def interrupt(proc: subprocess.Popen) -> None:
    os.killpg(proc.pid, signal.SIGINT)  # what a terminal's Ctrl-C does


def finish(proc: subprocess.Popen, tmp_path: Path, pids: list[int], grace: str = "10") -> str:
    """The run's end: exit 130, the one line, nothing left of ``pids``. The overall wait is
    generous (a stop that waited out a long grace would pass it, not the run's 600 s)."""
    code = proc.wait(timeout=150)
    err = (tmp_path / "run.err").read_text(errors="replace")
    assert code == 130, said(tmp_path)
    assert "Traceback" not in said(tmp_path), said(tmp_path)
    stopping = [ln for ln in err.splitlines() if "Ctrl-C again to kill" in ln]
    assert stopping == [f"stopping: the workers save their step, for {grace} s at most; Ctrl-C "
                        "again to kill"], err  # fmt: skip
    assert err.splitlines()[-1] == "elasticd: interrupted", err
    # The etcd, agents, workers and what the workers started: their parents are gone and
    # reaped, so none can be a zombie of ours; each is simply gone (or reaped by init).
    deadline = time.monotonic() + 30  # init reaps an orphan at its own pace
    while alive(pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert alive(pids) == [], (pids, said(tmp_path))
    return err


def test_a_ctrl_c_of_elasticd_run_has_the_workers_save_their_step_and_exits_130(tmp_path):
    job = {
        "name": "ctrlc", "output_dir": "out", "nodes": {"min": 1, "max": 2},
        "model": {"layers": 2, "hidden": 32, "heads": 4, "ffn_hidden": 64, "vocab": 128,
                  "seq_len": 16},
        "train": {"steps": 100_000, "global_batch": 4, "micro_batch": 2},
        "checkpoint": {"every": 0}, "rendezvous": {"ttl": 2, "settle": 1.0},
    }  # fmt: skip
    proc = start_run(tmp_path, job)
    try:
        metrics = tmp_path / "out" / "metrics.jsonl"
        wait_for(lambda: metrics.exists() and metrics.stat().st_size > 0, proc, tmp_path)
        pids = descendants(proc.pid)
        assert len(pids) >= 5, pids  # etcd, two agents, a worker each
        interrupt(proc)
        finish(proc, tmp_path, pids)
    finally:
        if proc.poll() is None:
            proc.kill()
    # Graceful: every rank saved the step it was at and left, as at a preemption.
    assert logs(tmp_path).count("preempted; the step is saved, exiting with 75") == 2, logs(
        tmp_path
    )


@pytest.mark.parametrize(("presses", "grace"), [(1, "2"), (2, "3600")], ids=["once", "twice"])
def test_a_run_whose_workers_ignore_the_stop_is_killed_whole_after_the_grace_or_a_second_ctrl_c(
    tmp_path, presses, grace
):
    """Workers that ignore the stop (their agents would wait restart.grace_period, 300 s,
    for them) and each started a process of its own: once, everything is killed when
    --stop-grace has passed; twice, at once, though the grace is an hour. Before, the run
    gave the agents 20 s, then SIGKILLed the agents alone: what the workers started lived on."""
    (tmp_path / "stubborn.py").write_text(STUBBORN)
    job = {
        "name": "stubborn", "output_dir": "out", "nodes": {"min": 2, "max": 2},
        "command": [sys.executable, str(tmp_path / "stubborn.py")], "train": {"steps": 10},
        "restart": {"grace_period": 300}, "rendezvous": {"ttl": 2, "settle": 1.0},
    }  # fmt: skip
    proc = start_run(tmp_path, job, "--stop-grace", grace)
    try:
        wait_for(lambda: logs(tmp_path).count("ready; child") == 2, proc, tmp_path)
        pids = descendants(proc.pid)
        children = [int(ln.rsplit(" ", 1)[1]) for ln in logs(tmp_path).splitlines()
                    if "ready; child" in ln]  # fmt: skip
        assert len(children) == 2 and set(children) <= set(pids), (children, pids)
        interrupt(proc)
        if presses == 2:
            err = tmp_path / "run.err"
            wait_for(lambda: "Ctrl-C again to kill" in err.read_text(), proc, tmp_path)
            interrupt(proc)
        finish(proc, tmp_path, pids, grace)
    finally:
        if proc.poll() is None:
            proc.kill()
