"""A run with many in-process recoveries leaks nothing (``-m slow``: about 2 minutes).

In-process restart keeps the survivors' processes across rounds, so whatever a round
leaves behind (a socket of an old process group, a transfer's waiter thread, a store, a
trainer) adds up over a long job's recoveries, unseen by any one-fault test. Here a dp2
job loses node 1's worker twenty times (each replaced by its node's standby, the survivor
recovering in-process from its own memory each time), and after each recovery the
survivor worker and its agent are sampled from /proc: open descriptors, sockets,
threads, resident memory; and etcd's keys of the job. Measured on the 2-core machine:
the survivor 40-42 descriptors and 23 threads throughout, RSS 334 -> 345 MB (the
allocator settling, flat after round 12), the agent 11 descriptors, 23 threads and
51 MB; the job's etcd keys one more a round (a failure record each) until the first
prune at round 16 took them back to the few of the current rounds.
"""

from __future__ import annotations

import contextlib
import glob
import os
import signal
import time

import pytest
from polling import wait_for

from elasticd.etcd import connect
from elasticd.jobs import FAILURES_PRUNE_EVERY, JobRegistry
from elasticd.jobspec import parse_job
from elasticd.localcluster import LocalCluster, read_metrics

pytestmark = pytest.mark.slow

RECOVERIES = 20


def sample(pid: int) -> dict[str, int]:
    fds = os.listdir(f"/proc/{pid}/fd")
    socks = 0
    for fd in fds:
        with contextlib.suppress(OSError):  # closed meanwhile
            socks += os.readlink(f"/proc/{pid}/fd/{fd}").startswith("socket:")
    with open(f"/proc/{pid}/status", encoding="ascii") as fh:
        fields = dict(line.split(":", 1) for line in fh if ":" in line)
    return {"fds": len(fds), "sockets": socks, "threads": int(fields["Threads"]),
            "rss_mb": int(fields["VmRSS"].split()[0]) // 1024}  # fmt: skip


def test_twenty_in_process_recoveries_leave_no_descriptor_thread_memory_or_key(
    tmp_path, monkeypatch
):
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    name = "longrun"
    raw = {
        "name": name,
        "output_dir": str(tmp_path / "out"),
        "nodes": {"min": 1, "max": 2},
        "model": {"layers": 2, "hidden": 64, "heads": 4, "ffn_hidden": 128, "seq_len": 32},
        "train": {"steps": 1_000_000, "global_batch": 8, "micro_batch": 2},
        "checkpoint": {"every": 0},
        "restart": {"mode": "inprocess", "standby": 1, "max_restarts": RECOVERIES + 5},
        "rendezvous": {"ttl": 3, "settle": 1.0},
    }
    job = parse_job(raw).with_paths_resolved(tmp_path)
    metrics = os.path.join(job.out_dir, "metrics.jsonl")

    def rounds() -> int:
        return max((int(r["round"]) for r in read_metrics(metrics)), default=0)

    samples = []
    with LocalCluster(base_dir=str(tmp_path / "cluster"), nproc=1) as cluster:
        cluster.start(2)
        with connect(cluster.etcd.client_config()) as client:
            registry = JobRegistry(client)
            wait_for(lambda: len(client.get_prefix("/elasticd/nodes/")[0]) == 2, timeout=60)
            registry.submit(job)
            wait_for(lambda: len(read_metrics(metrics)) >= 3, timeout=120)
            survivor = next(iter(cluster.worker_pids(0).values()))
            agent = cluster.agents[0].pid
            standby = os.path.join(cluster.state_dir(1), "jobs", "*", "warm", "ready-*-standby-*")
            for _ in range(RECOVERIES):
                before = rounds()
                wait_for(lambda: glob.glob(standby), timeout=120)  # the replacement is warm
                os.kill(next(iter(cluster.worker_pids(1).values())), signal.SIGKILL)
                wait_for(lambda b=before: rounds() > b, timeout=120)
                time.sleep(0.5)  # a few steps of the new round
                assert survivor in cluster.worker_pids(0).values()  # recovered in-process
                keys = len(client.get_prefix(f"/elasticd/jobs/{name}/")[0])
                samples.append({"worker": sample(survivor), "agent": sample(agent), "keys": keys})
            record = registry.get(name)
            registry.cancel(name)
    recoveries = [e for e in record.status["history"] if e.get("kind") == "recovery"]
    assert len(recoveries) >= RECOVERIES - 1  # the history is bounded; each one in-process:
    assert all(e.get("mode") == "inprocess" for e in recoveries), recoveries
    settled = samples[2]  # the first rounds import and allocate what every later one reuses
    for proc in ("worker", "agent"):
        for k, slack in (("fds", 2), ("sockets", 1), ("threads", 1)):
            seen = [s[proc][k] for s in samples[2:]]
            assert max(seen) <= settled[proc][k] + slack, (proc, k, seen)
        rss = [s[proc]["rss_mb"] for s in samples[2:]]
        assert max(rss) - settled[proc]["rss_mb"] < 32, (proc, "rss_mb", rss)
    keys = [s["keys"] for s in samples]
    assert max(keys) <= min(keys) + 2 * (FAILURES_PRUNE_EVERY + 2), keys  # pruned
    assert keys[-1] < max(keys), keys
