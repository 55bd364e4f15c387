"""The agent's liveness (``/healthz`` for a Kubernetes probe and systemd's notify/watchdog
protocol) and how it judges another agent's, against a real agent process, a real etcd, a
real HTTP endpoint and a real datagram socket standing where systemd's is."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import urllib.error
import urllib.request

from polling import wait_for
from prometheus_client import CollectorRegistry

from elasticd.agent.health import Health, sd_notify, watchdog_interval
from elasticd.etcd import reserve_port
from elasticd.metrics import AgentMetrics


def get(port: int, path: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=5) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()


def test_healthz_says_ok_until_the_main_loop_stops_turning_and_metrics_stay_served():
    """A wedged loop (here: a clock moved past the limit with no beat) turns /healthz to
    503 with one line; /metrics on the same port is unaffected."""
    now = [1000.0]
    health = Health(stale_after=120.0, clock=lambda: now[0])
    port = AgentMetrics(CollectorRegistry()).serve(0, addr="127.0.0.1", health=health)
    assert get(port, "/healthz") == (200, "starting\n")
    health.beat()
    now[0] += 119.0
    assert get(port, "/healthz") == (200, "ok\n")
    now[0] += 2.0
    status, body = get(port, "/healthz")
    assert status == 503
    assert body == "the agent's main loop has not turned for 121 s (limit 120 s)\n"
    status, body = get(port, "/metrics")
    assert status == 200 and "elasticd_agent_registrations_total" in body
    health.beat()
    assert get(port, "/healthz")[0] == 200


def test_systemd_settings_are_read_as_systemd_writes_them(tmp_path):
    assert watchdog_interval({}) is None
    assert watchdog_interval({"WATCHDOG_USEC": "60000000"}) == 30.0
    assert watchdog_interval({"WATCHDOG_USEC": "60000000", "WATCHDOG_PID": "1"}) is None
    assert watchdog_interval({"WATCHDOG_USEC": "0"}) is None
    assert watchdog_interval({"WATCHDOG_USEC": "soon"}) is None
    mine = {"WATCHDOG_USEC": "2000000", "WATCHDOG_PID": str(os.getpid())}
    assert watchdog_interval(mine) == 1.0
    assert not sd_notify("READY=1", {})
    assert not sd_notify("READY=1", {"NOTIFY_SOCKET": str(tmp_path / "nobody")})
    # An abstract socket ("@name"), as systemd often passes it.
    name = f"elasticd-test-{os.getpid()}"
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as s:
        s.bind("\0" + name)
        assert sd_notify("READY=1", {"NOTIFY_SOCKET": "@" + name})
        assert s.recv(64) == b"READY=1"


def test_a_real_agent_tells_systemd_it_is_ready_feeds_the_watchdog_and_says_when_it_stops(
    tmp_path, etcd_server
):
    where = str(tmp_path / "notify.sock")
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind(where)
    sock.settimeout(30)
    state = tmp_path / "state"
    env = {**os.environ, "NOTIFY_SOCKET": where, "WATCHDOG_USEC": "400000"}
    env.pop("WATCHDOG_PID", None)
    # A symlink planted where the agent wrote its info file's temporary copy: never
    # written through (it was opened with a plain open()).
    state.mkdir()
    outside = tmp_path / "outside.txt"
    outside.write_text("not the agent's")
    os.symlink(outside, state / "agent.json.tmp")
    hold = reserve_port()  # held until the agent listens on it (SO_REUSEADDR on both)
    agent = subprocess.Popen(
        [sys.executable, "-m", "elasticd", "agent", "--etcd", etcd_server.endpoint,
         "--node-id", f"health-{os.getpid()}", "--state-dir", str(state),
         "--metrics-port", str(hold.getsockname()[1]), "--nproc-per-node", "1"],
        env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        assert sock.recv(64) == b"READY=1"  # only once registered: its record is there
        info = json.loads((state / "agent.json").read_text())
        assert info["pid"] == agent.pid
        assert outside.read_text() == "not the agent's"
        assert get(info["metrics_port"], "/healthz") == (200, "ok\n")
        pings = [sock.recv(64) for _ in range(3)]
        assert pings == [b"WATCHDOG=1"] * 3
        agent.send_signal(signal.SIGTERM)
        wait_for(lambda: sock.recv(64) == b"STOPPING=1", timeout=30)
        assert agent.wait(timeout=60) == 0
    finally:
        if agent.poll() is None:
            agent.kill()
            agent.wait()
        sock.close()
        hold.close()
    assert "Traceback" not in agent.stderr.read()


def test_the_watchdog_is_fed_while_healthy_not_while_wedged_and_always_while_stopping(
    tmp_path, monkeypatch
):
    """A stale loop stops the pings (systemd restarts the agent); a stopping agent, which
    beats nothing while it waits out its workers' grace period, is fed until it is done."""
    import threading

    from elasticd.agent.health import start_watchdog

    where = str(tmp_path / "notify.sock")
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind(where)
    monkeypatch.setenv("NOTIFY_SOCKET", where)
    monkeypatch.setenv("WATCHDOG_USEC", "100000")  # a ping every 50 ms
    monkeypatch.delenv("WATCHDOG_PID", raising=False)
    now = [0.0]
    health = Health(stale_after=10.0, clock=lambda: now[0])
    health.beat()
    stopping, done = threading.Event(), threading.Event()
    thread = start_watchdog(health, stopping, done)
    assert thread is not None
    try:
        sock.settimeout(5)
        assert sock.recv(64) == b"WATCHDOG=1"
        now[0] = 11.0  # wedged
        sock.settimeout(0.2)
        for _ in range(3):  # drain a ping sent before the clock moved
            try:
                sock.recv(64)
            except TimeoutError:
                break
        sock.settimeout(0.5)
        try:
            got = sock.recv(64)
        except TimeoutError:
            got = None
        assert got is None
        stopping.set()
        sock.settimeout(5)
        assert sock.recv(64) == b"WATCHDOG=1"
    finally:
        done.set()
        thread.join(timeout=5)
        sock.close()
    assert not thread.is_alive()


def test_a_zombie_agent_is_dead_to_a_restarted_one():
    """An agent SIGKILLed and not yet reaped by its parent stays a zombie: `kill(pid, 0)`
    succeeds on it, and the same node id restarted a second later was refused for good
    ("already registered by a live agent")."""
    import time

    from elasticd.agent.daemon import _pid_alive

    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    try:
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            with open(f"/proc/{proc.pid}/stat", "rb") as fh:
                if fh.read().rsplit(b")", 1)[1].split()[0] == b"Z":
                    break
            time.sleep(0.02)
        assert not _pid_alive(proc.pid)
    finally:
        proc.wait()
    assert _pid_alive(os.getpid())
    assert not _pid_alive(proc.pid) and not _pid_alive("x")
