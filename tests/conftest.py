"""Shared fixtures: a real etcd on free loopback ports, fresh key prefixes, a 3-member
cluster, and a helper to run ``python -m elasticd.rendezvous`` nodes as processes.

Other areas reuse ``etcd_server`` / ``etcd_config`` / ``etcd_client`` / ``fresh_prefix``:
one session-wide server, isolated by key prefix per test.
"""

from __future__ import annotations

import json
import os
import queue
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Iterator

import pytest

from elasticd.etcd import EmbeddedEtcd, EtcdClient, EtcdCluster, EtcdConfig, connect


def fresh_prefix(label: str = "t") -> str:
    """A key prefix no other test uses: ``/test/<label>-<random>/``."""
    return f"/test/{label}-{uuid.uuid4().hex[:10]}/"


def fresh_run_id(label: str = "run") -> str:
    """A rendezvous run id no other test uses."""
    return f"{label}-{uuid.uuid4().hex[:10]}"


@pytest.fixture(scope="session")
def etcd_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EmbeddedEtcd]:
    """One etcd member for the whole session, stopped at the end."""
    server = EmbeddedEtcd(data_dir=str(tmp_path_factory.mktemp("etcd")), name="test")
    server.start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
def etcd_config(etcd_server: EmbeddedEtcd) -> EtcdConfig:
    return etcd_server.client_config(timeout=5.0)


@pytest.fixture
def etcd_client(etcd_config: EtcdConfig) -> Iterator[EtcdClient]:
    client = connect(etcd_config)
    try:
        yield client
    finally:
        client.close()


@pytest.fixture
def etcd_cluster(tmp_path) -> Iterator[EtcdCluster]:
    """A fresh 3-member etcd cluster on loopback (a few seconds to start)."""
    cluster = EtcdCluster(base_dir=str(tmp_path / "cluster"), size=3)
    try:
        cluster.start()
        yield cluster
    finally:
        cluster.stop()


class NodeProcess:
    """``python -m elasticd.rendezvous`` as a child; its JSON lines land in ``events``."""

    def __init__(self, args: list[str]) -> None:
        env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "elasticd.rendezvous", *args],
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            text=True,
            env=env,
        )
        self.events: queue.Queue[dict] = queue.Queue()
        self.seen: list[dict] = []
        threading.Thread(target=self._pump, daemon=True).start()

    def _pump(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            try:
                self.events.put(json.loads(line))
            except ValueError:
                continue

    def next_event(self, kind: str, timeout: float) -> dict:
        """The next event of ``kind`` (others are kept in ``seen``); fails after timeout."""
        deadline = time.monotonic() + timeout
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise AssertionError(f"no {kind!r} event within {timeout} s; saw {self.seen}")
            try:
                ev = self.events.get(timeout=left)
            except queue.Empty:
                continue
            self.seen.append(ev)
            if ev["event"] == kind:
                return ev
            if ev["event"] == "error" and kind != "error":
                raise AssertionError(f"node failed: {ev}")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


@pytest.fixture
def spawn_node() -> Iterator:
    """``spawn_node(args)`` starts a rendezvous node process; all are stopped afterwards."""
    nodes: list[NodeProcess] = []

    def spawn(args: list[str]) -> NodeProcess:
        node = NodeProcess(args)
        nodes.append(node)
        return node

    try:
        yield spawn
    finally:
        for node in nodes:
            node.stop()
