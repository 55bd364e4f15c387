"""Ports handed to a process that binds them later are held, not merely free.

CI failed once on EADDRINUSE: ``launch_local`` picked a free port, closed it, and by the
time rank 0 (seconds later, after importing torch) bound its TCPStore there, another test's
connection had taken it. Every port we pick for someone else's listener is now held by a
socket bound with SO_REUSEADDR and never listening: no ``bind(0)`` or outgoing connection
on the machine gets it, and the real listener (TCPStore, etcd) still binds it.
"""

from __future__ import annotations

import errno
import logging
import socket
import threading
import time
from datetime import timedelta

import pytest
import torch.distributed as dist
from conftest import fresh_run_id
from test_rendezvous_handler import _form_all, _handlers

from elasticd.etcd import EmbeddedEtcd, reserve_port


def _bind(port: int, reuse: bool) -> None:
    with socket.socket() as s:
        if reuse:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind(("127.0.0.1", port))


def test_a_held_port_is_never_picked_by_the_kernel_and_a_tcpstore_still_listens_on_it():
    hold = reserve_port()
    port = hold.getsockname()[1]
    with pytest.raises(OSError) as exc:
        _bind(port, reuse=False)  # free_port's kind of socket, e.g. another test's
    assert exc.value.errno == errno.EADDRINUSE
    picked = []
    for _ in range(2000):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            picked.append(s.getsockname()[1])
    assert port not in picked
    store = dist.TCPStore("127.0.0.1", port, 1, True, timeout=timedelta(seconds=10),
                          wait_for_workers=False)  # fmt: skip
    client = dist.TCPStore("127.0.0.1", port, 1, False, timeout=timedelta(seconds=10))
    store.set("k", "v")
    assert client.get("k") == b"v"
    del client, store
    hold.close()


def test_the_rendezvous_holds_the_store_port_it_advertises_until_two_joins_later(etcd_config):
    handlers = _handlers(etcd_config, fresh_run_id(), 1)
    (h,) = handlers
    try:
        world = _form_all(handlers)[h.node_id]
        assert world.members[0].probe == 0  # no reform_grace: no probe port opened
        with pytest.raises(OSError):  # held: nobody else binds it before rank 0's store
            _bind(world.master_port, reuse=False)
        _bind(world.master_port, reuse=True)  # ...and rank 0's store, with SO_REUSEADDR, can
    finally:
        h.close()
    _bind(world.master_port, reuse=False)  # released on close


def test_embedded_etcd_holds_the_ports_it_picked_until_it_is_healthy(tmp_path):
    etcd = EmbeddedEtcd(data_dir=str(tmp_path / "etcd"))
    etcd.pick_ports()
    for port in (etcd.client_port, etcd.peer_port):
        with pytest.raises(OSError):
            _bind(port, reuse=False)
    with etcd:  # etcd (Go, SO_REUSEADDR) listens on the held ports; the holds go
        assert not etcd._held
        with pytest.raises(OSError):
            _bind(etcd.client_port, reuse=True)  # etcd itself listens there now


@pytest.mark.parametrize("case", ["gone", "gone-later", "answers", "never-reached"])
def test_a_member_whose_rendezvous_refuses_connections_is_excused_from_a_reform_at_once(
    etcd_config, caplog, case
):
    """A node that died whole never re-joins, and its lease outlives the grace: a refused
    probe excuses it at once. A member that answers (alive, or frozen: the kernel
    accepts for a stopped process) is still waited for the whole grace, and so is one
    whose probe port the closer never reached (a firewall that rejects it would make
    every probe of it a refusal): its world record carries no probe. ``gone-later``: the
    node's agent outlives the evidence (its workers' closed sockets) for a while, and
    the member is probed again until it refuses."""
    caplog.set_level(logging.INFO, logger="elasticd.rendezvous")
    grace = 8.0  # far from both outcomes, on a loaded machine too
    # max 3: the first world closes as the last node joins, its probe check still in
    # flight (the close waits for it); settle 5 s only keeps a lagging join in it.
    handlers = _handlers(etcd_config, fresh_run_id(), 3, ttl=30, reform_grace=grace,
                         min_nodes=2, settle=5.0)  # fmt: skip
    dead, survivors = handlers[2], handlers[:2]
    try:
        if case == "never-reached":
            dead._probe_port()  # its listener, then gone before anyone connects to it
            dead._probe.close()
        first = _form_all(handlers)
        assert {w.size for w in first.values()} == {3}
        probes = {m.node: m.probe for m in first["n0"].members}
        assert probes["n0"] and probes["n1"]
        assert bool(probes["n2"]) is (case != "never-reached")
        if case == "gone":
            dead._probe.close()  # its process died: nothing listens there any more
        elif case == "gone-later":
            threading.Timer(1.0, dead._probe.close).start()
        t0 = time.monotonic()
        second = _form_all(survivors, evidence=True)
        took = time.monotonic() - t0
        assert {tuple(w.nodes) for w in second.values()} == {("n0", "n1")}
        excused = "member gone: its rendezvous refuses connections" in caplog.text
        assert excused is case.startswith("gone")
        if case.startswith("gone"):
            assert took < grace / 2, took  # not the grace: the refusal
        else:
            assert took >= grace * 0.9, took  # the grace decides, as before
    finally:
        for h in handlers:
            h.close()
