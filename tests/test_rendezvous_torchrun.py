"""Plain ``torchrun --rdzv-backend etcd-v3`` (and ``etcd-v3-dynamic``), started as two
separate launcher processes like two shells, forms a 2-node world that all-reduces."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import pytest
from conftest import fresh_run_id

SCRIPT = """
import os, sys, torch, torch.distributed as dist
dist.init_process_group("gloo")
t = torch.tensor([float(dist.get_rank() + 1)])
dist.all_reduce(t)
print(f"RESULT rank={dist.get_rank()} world={dist.get_world_size()} sum={t.item():g} "
      f"group_rank={os.environ['GROUP_RANK']}", flush=True)
dist.destroy_process_group()
"""


def _torchrun(backend, endpoint, run_id, script, extra=()):
    cmd = [
        sys.executable, "-m", "torch.distributed.run",
        "--nnodes", "2", "--nproc-per-node", "1",
        "--rdzv-backend", backend, "--rdzv-endpoint", endpoint, "--rdzv-id", run_id,
        "--max-restarts", "0", "--monitor-interval", "0.5", *extra, str(script),
    ]  # fmt: skip
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    return subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env
    )


@pytest.mark.parametrize("backend", ["etcd-v3", "etcd-v3-dynamic"])
def test_two_torchrun_launchers_form_a_world_and_all_reduce(backend, etcd_server, tmp_path):
    script = tmp_path / "allreduce.py"
    script.write_text(SCRIPT)
    run = fresh_run_id()
    extra = ("--rdzv-conf", "join_timeout=60,last_call_timeout=1")
    procs = [_torchrun(backend, etcd_server.endpoint, run, script, extra) for _ in range(2)]
    outputs = []
    try:
        for p in procs:
            out, _ = p.communicate(timeout=150)
            outputs.append(out)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    for p, out in zip(procs, outputs, strict=True):
        assert p.returncode == 0, out[-3000:]
    results = sorted(
        line for out in outputs for line in out.splitlines() if line.startswith("RESULT")
    )
    assert len(results) == 2, outputs
    assert all("world=2 sum=3" in r for r in results)
    assert {r.split("group_rank=")[1] for r in results} == {"0", "1"}


LOOP = """
import os, time, torch, torch.distributed as dist
dist.init_process_group("gloo")
world = dist.get_world_size()
print(f"START world={world} restart={os.environ['TORCHELASTIC_RESTART_COUNT']}", flush=True)
for step in range(10_000 if world > 1 else 3):
    t = torch.ones(1)
    dist.all_reduce(t)
    time.sleep(0.05)
print(f"DONE world={world}", flush=True)
dist.destroy_process_group()
"""


def test_a_sigkilled_torchrun_node_makes_the_survivor_re_form_and_finish(etcd_server, tmp_path):
    script = tmp_path / "loop.py"
    script.write_text(LOOP)
    run = fresh_run_id()
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--nnodes", "1:2", "--nproc-per-node", "1",
        "--rdzv-backend", "etcd-v3", "--rdzv-endpoint", etcd_server.endpoint, "--rdzv-id", run,
        "--rdzv-conf", "join_timeout=60,settle=0.5", "--max-restarts", "0",
        "--monitor-interval", "0.2", str(script),
    ]  # fmt: skip
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    procs = [
        subprocess.Popen(
            cmd,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env=env,
            start_new_session=True,
        )
        for _ in range(2)
    ]
    survivor, victim = procs
    lines: list[str] = []
    try:
        assert survivor.stdout is not None
        for line in survivor.stdout:
            lines.append(line)
            if "START world=2" in line:
                break
        os.killpg(victim.pid, signal.SIGKILL)  # the whole node: launcher and worker
        out, _ = survivor.communicate(timeout=90)
        lines.append(out)
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
            p.wait()
    text = "".join(lines)
    # Re-formed without spending a restart: a membership change, not a failure.
    assert survivor.returncode == 0, text[-3000:]
    assert "START world=1 restart=0" in text and "DONE world=1" in text, text[-3000:]
