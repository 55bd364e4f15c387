"""Plain ``torchrun --rdzv-backend etcd-v3`` (and ``etcd-v3-dynamic``), started as two
separate launcher processes like two shells, forms a 2-node world that all-reduces; and a
user's mistake (an unreachable etcd, a reused rendezvous id, a password where torch logs
it) is one line on stderr and a non-zero exit, never a traceback."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest
from conftest import fresh_run_id

from elasticd.etcd import EmbeddedEtcd, EtcdClient, free_port
from elasticd.rendezvous.params import PASSWORD_ENV

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


# -- user errors: one line on stderr, no traceback, a non-zero exit ---------------------------

HELLO = 'print("HELLO", flush=True)\n'


def _torchrun_alone(endpoint, run_id, script, conf=None, env=None, timeout=120):
    """One single-node torchrun launcher run to its end: (returncode, stdout, stderr, s)."""
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--nnodes", "1", "--nproc-per-node", "1",
        "--rdzv-backend", "etcd-v3", "--rdzv-endpoint", endpoint, "--rdzv-id", run_id,
        "--max-restarts", "0", "--monitor-interval", "0.2",
        *(("--rdzv-conf", conf) if conf else ()), str(script),
    ]  # fmt: skip
    full_env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    full_env.pop(PASSWORD_ENV, None)
    full_env.update(env or {})
    t0 = time.monotonic()
    p = subprocess.run(cmd, capture_output=True, text=True, env=full_env, timeout=timeout)
    return p.returncode, p.stdout, p.stderr, time.monotonic() - t0


def _only_line(stderr: str) -> str:
    lines = stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in stderr, stderr[-3000:]
    return lines[0]


def test_torchrun_against_an_unreachable_etcd_exits_within_seconds_with_one_line(tmp_path):
    script = tmp_path / "hello.py"
    script.write_text(HELLO)
    endpoint = f"127.0.0.1:{free_port()}"  # nothing listens there
    # No --rdzv-conf: torch sends its default timeout of 900 s, which is the join timeout,
    # not the budget of each etcd call (5 s).
    rc, out, err, seconds = _torchrun_alone(endpoint, fresh_run_id(), script)
    line = _only_line(err)
    assert rc != 0 and "HELLO" not in out
    assert line.startswith("elasticd: etcd at ") and endpoint in line and "did not answer" in line
    # Python and torch take a few seconds to start on a busy 2-core machine; the etcd
    # budget is 5 s. Before, this was silent for 900 s.
    assert seconds < 40, seconds


def test_reusing_a_finished_runs_rendezvous_id_is_one_line_telling_to_pick_a_new_id(
    etcd_server, tmp_path
):
    script = tmp_path / "hello.py"
    script.write_text(HELLO)
    run = fresh_run_id()
    rc, out, err, _ = _torchrun_alone(etcd_server.endpoint, run, script)
    assert rc == 0 and "HELLO" in out, err[-3000:]
    rc, out, err, _ = _torchrun_alone(etcd_server.endpoint, run, script)
    line = _only_line(err)
    assert rc != 0 and "HELLO" not in out
    assert f"rendezvous id {run!r} is closed" in line and "pick a new --rdzv-id" in line


@pytest.fixture(scope="module")
def auth_etcd(tmp_path_factory):
    """An etcd with auth on: user root, password s3cret."""
    from etcd3 import etcdrpc

    server = EmbeddedEtcd(data_dir=str(tmp_path_factory.mktemp("auth") / "etcd")).start()
    try:
        with EtcdClient(server.client_config()) as admin:

            def setup(m, t, md):
                m.auth.UserAdd(
                    etcdrpc.AuthUserAddRequest(name="root", password="s3cret"), timeout=t
                )
                m.auth.UserGrantRole(
                    etcdrpc.AuthUserGrantRoleRequest(user="root", role="root"), timeout=t
                )
                m.auth.AuthEnable(etcdrpc.AuthEnableRequest(), timeout=t)

            admin.call("auth setup", setup)
        yield server
    finally:
        server.stop()


def test_torchrun_authenticates_with_a_password_file(auth_etcd, tmp_path):
    script = tmp_path / "hello.py"
    script.write_text(HELLO)
    secret = tmp_path / "etcd-password"
    secret.write_text("s3cret\n")
    conf = f"user=root,password_file={secret}"
    rc, out, err, _ = _torchrun_alone(auth_etcd.endpoint, fresh_run_id(), script, conf)
    assert rc == 0 and "HELLO" in out, err[-3000:]
    assert "s3cret" not in out + err


def test_torchrun_authenticates_with_the_password_from_the_environment(auth_etcd, tmp_path):
    script = tmp_path / "hello.py"
    script.write_text(HELLO)
    env = {PASSWORD_ENV: "s3cret"}
    rc, out, err, _ = _torchrun_alone(auth_etcd.endpoint, fresh_run_id(), script, "user=root", env)
    assert rc == 0 and "HELLO" in out, err[-3000:]


def test_a_wrong_password_is_one_line_from_torchrun(auth_etcd, tmp_path):
    script = tmp_path / "hello.py"
    script.write_text(HELLO)
    env = {PASSWORD_ENV: "wrong"}
    rc, _, err, _ = _torchrun_alone(auth_etcd.endpoint, fresh_run_id(), script, "user=root", env)
    assert rc != 0 and "refused" in _only_line(err)


def test_a_password_in_rdzv_conf_stops_torchrun_with_one_line(auth_etcd, tmp_path):
    script = tmp_path / "hello.py"
    script.write_text(HELLO)
    conf = "user=root,password=s3cret"
    rc, out, err, _ = _torchrun_alone(auth_etcd.endpoint, fresh_run_id(), script, conf)
    line = _only_line(err)
    assert rc != 0 and "HELLO" not in out
    assert "--rdzv-conf password=... is refused" in line
    assert "password_file=PATH" in line and PASSWORD_ENV in line
