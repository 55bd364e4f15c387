"""etcd requests per minute of one agent: idle, and running a job, against the old polling.

Usage::

    python bench/agent_requests.py [--seconds 60] [--step-s 0.2]

It starts a fresh etcd and counts the requests it serves, from etcd's own Prometheus
counters (``grpc_server_handled_total`` for unary calls, ``grpc_server_msg_received_total``
for messages on streams: watch creations and lease keep-alives), over a window of
``--seconds``:

1. **idle**: one real ``elasticd agent``, no job;
2. **running**: the same agent training a one-node job (tests/agent_worker.py workers);
3. **baseline**: what the agent before this change did when idle, replayed with the same
   client: every 0.5 s it listed every node record and the whole job registry, and it
   refreshed its node lease with one keep-alive call every ttl/3.

The agent now answers job and node questions from a watch-fed mirror, so an idle agent's
only periodic traffic is its lease keep-alives. It prints requests per minute and the
ratio to the baseline.
"""

from __future__ import annotations

import argparse
import os
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

from elasticd.etcd import EmbeddedEtcd, connect  # noqa: E402
from elasticd.jobs import JobRegistry  # noqa: E402
from elasticd.jobspec import parse_job  # noqa: E402

WORKER = os.path.join(os.path.dirname(HERE), "tests", "agent_worker.py")
_LINE = re.compile(r"^(grpc_server_handled_total|grpc_server_msg_received_total)\{([^}]*)\} (\S+)$")


def requests(etcd: EmbeddedEtcd) -> dict[str, float]:
    """Requests served so far, by kind: unary calls by method, stream messages by method."""
    with urllib.request.urlopen(f"http://{etcd.endpoint}/metrics", timeout=5) as resp:
        text = resp.read().decode()
    out: dict[str, float] = {}
    for line in text.splitlines():
        m = _LINE.match(line)
        if not m:
            continue
        labels = dict(kv.split("=", 1) for kv in m.group(2).split(","))
        method = labels.get("grpc_method", "").strip('"')
        kind = labels.get("grpc_type", "").strip('"')
        counted = {"grpc_server_handled_total": "unary",
                   "grpc_server_msg_received_total": "bidi_stream"}  # fmt: skip
        if counted[m.group(1)] == kind:
            out[method] = out.get(method, 0.0) + float(m.group(3))
    return out


def per_minute(before: dict[str, float], after: dict[str, float], seconds: float) -> dict:
    diff = {k: after.get(k, 0.0) - before.get(k, 0.0) for k in set(before) | set(after)}
    return {k: round(v * 60.0 / seconds, 1) for k, v in sorted(diff.items()) if v}


def measure(etcd: EmbeddedEtcd, seconds: float) -> dict:
    before = requests(etcd)
    time.sleep(seconds)
    return per_minute(before, requests(etcd), seconds)


def start_agent(etcd: EmbeddedEtcd, base: str, env: dict) -> subprocess.Popen:
    log = open(os.path.join(base, "agent.log"), "ab")  # noqa: SIM115
    with log:
        return subprocess.Popen(
            [sys.executable, "-m", "elasticd", "agent", "--etcd", etcd.endpoint, "--node-id",
             "bench", "--addr", "127.0.0.1", "--nproc-per-node", "1", "--state-dir",
             os.path.join(base, "node"), "--metrics-port", "0", "--allow-commands"],
            stdout=log, stderr=subprocess.STDOUT, env=env,
        )  # fmt: skip


def baseline(etcd: EmbeddedEtcd, seconds: float, *, poll: float = 0.5, ttl: float = 5.0) -> dict:
    """The previous agent's idle loop, replayed: list nodes and jobs every ``poll`` s, and a
    keep-alive call every ttl/3 s."""
    stop = threading.Event()
    with connect(etcd.client_config()) as client:
        lease = client.lease_grant(ttl)
        client.put("/elasticd/nodes/old", "{}", lease=lease)
        registry = JobRegistry(client)

        def keepalive() -> None:
            while not stop.wait(ttl / 3):
                client.lease_keepalive(lease)

        def polls() -> None:
            while not stop.wait(poll):
                client.get_prefix("/elasticd/nodes/")
                registry.list()

        threads = [threading.Thread(target=f, daemon=True) for f in (keepalive, polls)]
        for t in threads:
            t.start()
        time.sleep(1.0)
        result = measure(etcd, seconds)
        stop.set()
        for t in threads:
            t.join()
        client.lease_revoke(lease)
    return result


def total(rates: dict) -> float:
    return round(sum(rates.values()), 1)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seconds", type=float, default=60.0, help="measuring window per case")
    ap.add_argument("--step-s", type=float, default=0.2, help="the running job's step time")
    args = ap.parse_args()
    env = {**os.environ, "OMP_NUM_THREADS": "1", "AGENT_TEST_STEP_S": str(args.step_s)}
    with tempfile.TemporaryDirectory(prefix="agent-requests-") as base:
        etcd = EmbeddedEtcd(data_dir=os.path.join(base, "etcd")).start()
        try:
            old = baseline(etcd, args.seconds)
            agent = start_agent(etcd, base, env)
            try:
                with connect(etcd.client_config()) as client:
                    deadline = time.monotonic() + 30
                    while client.get("/elasticd/nodes/bench") is None:
                        if time.monotonic() > deadline:
                            raise SystemExit("bench: the agent did not register in 30 s")
                        time.sleep(0.1)
                    time.sleep(2.0)  # settle: the start-up reads are not steady state
                    idle = measure(etcd, args.seconds)
                    steps = int(args.seconds / args.step_s * 3) + 50
                    job = parse_job({
                        "name": "bench", "output_dir": os.path.join(base, "out"),
                        "command": [sys.executable, WORKER],
                        "train": {"steps": steps, "global_batch": 2, "micro_batch": 2},
                        "checkpoint": {"every": 25},
                    }).with_paths_resolved(base)  # fmt: skip
                    registry = JobRegistry(client)
                    registry.submit(job)
                    deadline = time.monotonic() + 60
                    while (registry.get("bench").status.get("step") or 0) < 3:
                        if time.monotonic() > deadline:
                            with open(os.path.join(base, "agent.log"), errors="replace") as fh:
                                tail = fh.read().strip().splitlines()[-5:]
                            state = registry.get("bench")
                            raise SystemExit(
                                f"bench: the job did not start in 60 s ({state.state}: "
                                f"{state.reason}); agent log:\n" + "\n".join(tail)
                            )
                        time.sleep(0.2)
                    running = measure(etcd, args.seconds)
                    registry.cancel("bench")
            finally:
                agent.send_signal(signal.SIGTERM)
                agent.wait(timeout=30)
        finally:
            etcd.stop()
    print(f"etcd requests per minute of one agent ({args.seconds:g} s windows)")
    for label, rates in (("baseline: old idle agent (polls)", old), ("idle agent (watches)", idle),
                         ("agent running a job", running)):  # fmt: skip
        detail = ", ".join(f"{k} {v:g}" for k, v in rates.items()) or "none"
        print(f"  {label:<34} {total(rates):>8.1f}/min  ({detail})")
    if total(old):
        print(f"  idle / baseline: {total(idle) / total(old):.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
