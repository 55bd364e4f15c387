"""The per-node daemon: register the node, watch the job registry, run each job.

One :class:`Agent` per node. It registers ``/elasticd/nodes/<id>`` on a lease (id,
hostname, address, nproc, devices, version), serves Prometheus metrics, and starts a
:class:`~elasticd.agent.runner.JobRunner` thread for every job that is not finished.
By default every agent takes every job (a job asking for more workers per node than the
agent offers is skipped, with a warning).

SIGTERM (systemd stop, Kubernetes eviction) is a preemption: every runner tells its
workers to save an emergency checkpoint (SIGTERM to the workers) within
``restart.grace_period``, then leaves its rendezvous by revoking its lease so the
survivors re-form at once. SIGKILL of the agent takes its workers with it (they carry a
parent-death signal), so nothing trains unsupervised.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import signal
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from prometheus_client import CollectorRegistry

from elasticd.agent.launch import NodeInfo
from elasticd.agent.runner import JobRunner
from elasticd.errors import ElasticdError
from elasticd.jobs import JobRegistry, JobState
from elasticd.log import kv
from elasticd.metrics import AgentMetrics

log = logging.getLogger("elasticd.agent")

NODES_PREFIX = "/elasticd/nodes/"
VERSION = "0.1.0"


@dataclass(frozen=True, kw_only=True, slots=True)
class AgentConfig:
    """How one agent runs."""

    etcd: object | None
    """An ``EtcdConfig``; None means 127.0.0.1:2379 if it answers, else an embedded etcd."""
    node_id: str
    """Stable id of this node (its rendezvous member name)."""
    addr: str
    """Address peers reach this node's workers at (rank 0's store lives here)."""
    nproc: int | None
    """Workers this node offers per job; None takes each job's nproc_per_node."""
    state_dir: str
    """Scratch space: layouts, heartbeats, the embedded etcd's data."""
    metrics_port: int = 9400
    """Prometheus port; 0 turns the endpoint off."""
    node_ttl: float = 5.0
    """Lease TTL of the node record."""
    poll: float = 0.5
    """Seconds between looks at the job registry."""
    embedded_port: int = 2379
    """Client port of the embedded etcd (the default endpoint, so clients find it)."""


def default_addr() -> str:
    """This host's address as its name resolves, else loopback."""
    try:
        return socket.gethostbyname(socket.gethostname())
    except OSError:
        return "127.0.0.1"


def count_devices() -> int:
    """NVIDIA GPUs visible to the driver, without importing torch."""
    try:
        return len(os.listdir("/proc/driver/nvidia/gpus"))
    except OSError:
        return 0


class Agent:
    """The daemon. ``run()`` blocks until SIGTERM/SIGINT (or ``stop()``)."""

    def __init__(
        self,
        config: AgentConfig,
        *,
        registry: CollectorRegistry | None = None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.config = config
        self.metrics = AgentMetrics(registry or CollectorRegistry())
        self.preempt = threading.Event()
        self._clock = clock
        self._client = None
        self._embedded = None
        self._lease = 0
        self._runners: dict[str, tuple[JobRunner, threading.Thread]] = {}
        self._done: set[str] = set()
        self._skipped: set[str] = set()

    # -- etcd ---------------------------------------------------------------------------------

    def _connect(self):
        from elasticd.etcd import EmbeddedEtcd, EtcdConfig, connect

        if self.config.etcd is not None:
            return connect(self.config.etcd)
        local = EtcdConfig(endpoints=(f"127.0.0.1:{self.config.embedded_port}",), timeout=1.0,
                           request_timeout=1.0)  # fmt: skip
        try:
            return connect(local)
        except ElasticdError:
            pass
        data = os.path.join(self.config.state_dir, "etcd")
        self._embedded = EmbeddedEtcd(data_dir=data, client_port=self.config.embedded_port)
        self._embedded.start()
        log.info(
            "no etcd given and none at the default endpoint: started an embedded etcd",
            **kv(endpoint=self._embedded.endpoint, data_dir=data),
        )
        return connect(self._embedded.client_config())

    def _register(self) -> None:
        c = self.config
        self._lease = self._client.lease_grant(c.node_ttl)
        record = {
            "node": c.node_id,
            "hostname": socket.gethostname(),
            "addr": c.addr,
            "nproc": c.nproc,
            "devices": count_devices(),
            "version": VERSION,
            "pid": os.getpid(),
            "started": round(self._clock(), 3),
        }
        self._client.put(NODES_PREFIX + c.node_id, json.dumps(record), lease=self._lease)

    def _keep_node_alive(self) -> None:
        while not self.preempt.wait(self.config.node_ttl / 3):
            try:
                if self._client.lease_keepalive(self._lease) <= 0:
                    log.warning(
                        "node lease lost; registering again", **kv(node=self.config.node_id)
                    )
                    self._register()
            except ElasticdError as exc:
                log.warning("node keep-alive failed", **kv(error=str(exc)))

    # -- the loop -----------------------------------------------------------------------------

    def stop(self) -> None:
        """Ask the agent to stop as on SIGTERM (preemption)."""
        self.preempt.set()

    def run(self) -> int:
        os.makedirs(self.config.state_dir, exist_ok=True)
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGTERM, signal.SIGINT):
                signal.signal(sig, lambda signum, frame: self.preempt.set())
        self._client = self._connect()
        try:
            self._register()
            threading.Thread(
                target=self._keep_node_alive, name="node-keepalive", daemon=True
            ).start()
            port = self.metrics.serve(self.config.metrics_port) if self.config.metrics_port else 0
            self._write_info(port)
            log.info("agent started", **kv(node=self.config.node_id, addr=self.config.addr,
                                           metrics_port=port, state_dir=self.config.state_dir))  # fmt: skip
            registry = JobRegistry(self._client, clock=self._clock)
            while not self.preempt.is_set():
                try:
                    self._tick(registry)
                except ElasticdError as exc:
                    log.warning("registry poll failed", **kv(error=str(exc)))
                self.preempt.wait(self.config.poll)
            log.info("agent stopping (preempted)", **kv(node=self.config.node_id))
            self._join_runners()
            return 0
        finally:
            self._shutdown()

    def _tick(self, registry: JobRegistry) -> None:
        for run_id, (_runner, thread) in list(self._runners.items()):
            if not thread.is_alive():
                del self._runners[run_id]
                self._done.add(run_id)
        kvs, _ = self._client.get_prefix(NODES_PREFIX)
        self.metrics.nodes_alive.set(len(kvs))
        for record in registry.list():
            run_id = record.run_id
            if record.state.terminal or run_id in self._runners or run_id in self._done:
                continue
            if run_id in self._skipped:
                continue
            try:
                job = record.job()
            except ElasticdError as exc:
                log.error("stored job is invalid; skipped", **kv(job=record.name, error=str(exc)))
                self._skipped.add(run_id)
                continue
            if self.config.nproc is not None and job.nproc_per_node > self.config.nproc:
                log.warning("job needs more workers per node than this node offers; skipped",
                            **kv(job=record.name, needs=job.nproc_per_node, offers=self.config.nproc))  # fmt: skip
                self._skipped.add(run_id)
                continue
            self._start_runner(record, registry)

    def _start_runner(self, record, registry: JobRegistry) -> None:
        node = NodeInfo(node_id=self.config.node_id, addr=self.config.addr,
                        state_dir=self.config.state_dir)  # fmt: skip
        runner = JobRunner(record=record, client=self._client, registry=registry, node=node,
                           metrics=self.metrics, preempt=self.preempt, clock=self._clock)  # fmt: skip

        def body() -> None:
            try:
                outcome = runner.run()
                log.info("job done on this node", **kv(job=record.name, outcome=str(outcome)))
            except Exception as exc:
                log.exception("job runner crashed", **kv(job=record.name))
                with contextlib.suppress(ElasticdError):
                    registry.set_state(record.name, JobState.FAILED, f"agent error: {exc}")

        thread = threading.Thread(target=body, name=f"job {record.name}", daemon=True)
        self._runners[record.run_id] = (runner, thread)
        log.info("job taken", **kv(job=record.name, run_id=record.run_id))
        thread.start()

    def _join_runners(self) -> None:
        """Wait for runners with workers (they save and leave); let waiting ones go."""
        for runner, thread in list(self._runners.values()):
            if runner.in_round:
                thread.join(timeout=runner.job.restart.grace_period + 15)
            else:
                runner.abandon_wait()
                thread.join(timeout=1.0)

    def _write_info(self, metrics_port: int) -> None:
        info = {"node": self.config.node_id, "pid": os.getpid(), "metrics_port": metrics_port}
        path = os.path.join(self.config.state_dir, "agent.json")
        with open(path + ".tmp", "w", encoding="utf-8") as fh:
            json.dump(info, fh)
        os.replace(path + ".tmp", path)

    def _shutdown(self) -> None:
        self.preempt.set()
        if self._client is not None:
            if self._lease:
                with contextlib.suppress(ElasticdError):
                    self._client.lease_revoke(self._lease)
            self._client.close()
        if self._embedded is not None:
            self._embedded.stop()
