"""One closer per round: only it watches every join while the round fills; the others
watch the small state/ directory. If the closer dies or gives up, another node takes
over, so a round never hangs on a dead closer."""

from __future__ import annotations

import json
import os
import signal
import threading
import time

from conftest import fresh_run_id
from polling import until

from elasticd.etcd import connect
from elasticd.rendezvous import EtcdRendezvous, RendezvousSettings, RendezvousTimeout


def _closer(etcd_client, settings, round_=1):
    found = etcd_client.get(settings.closer_key(round_))
    return None if found is None else json.loads(found.value)["node"]


def _start(handler, out, errors):
    def form():
        try:
            out[handler.node_id] = handler.next_world()
        except Exception as exc:
            errors[handler.node_id] = exc

    thread = threading.Thread(target=form, daemon=True)
    thread.start()
    return thread


def test_only_the_closer_watches_joins_while_a_round_fills_and_every_member_does_after(
    etcd_config, etcd_client
):
    settings = RendezvousSettings(run_id=fresh_run_id(), min_nodes=3, max_nodes=3)
    nodes = [
        EtcdRendezvous(
            client=connect(etcd_config), settings=settings, node_id=f"n{i}", owns_client=True
        )
        for i in range(3)
    ]
    out, errors = {}, {}
    try:
        threads = [_start(n, out, errors) for n in nodes[:2]]
        assert until(lambda: _closer(etcd_client, settings) is not None, 10)
        assert until(lambda: all(n._joined_round == 1 for n in nodes[:2]), 10)
        closer = _closer(etcd_client, settings)
        follower = next(n for n in nodes[:2] if n.node_id != closer)
        assert until(lambda: not follower._mirror.members_live, 5)
        assert not follower._mirror.joined_nodes(1)  # it never saw the other joins
        threads.append(_start(nodes[2], out, errors))
        for t in threads:
            t.join(20)
        assert not errors, errors
        assert {w.nodes for w in out.values()} == {("n0", "n1", "n2")}
        assert _closer(etcd_client, settings) is None  # the close removed the closer key
        assert all(n._mirror.members_live for n in nodes)  # to learn of losses and waiters
    finally:
        for n in nodes:
            n.close()


def test_when_the_closer_is_sigkilled_mid_round_another_node_takes_over_and_closes_it(
    etcd_server, etcd_config, etcd_client, spawn_node
):
    run, ttl = fresh_run_id(), 4.0
    settings = RendezvousSettings(
        run_id=run, min_nodes=2, max_nodes=3, ttl=ttl, settle=0.3, join_timeout=30
    )
    args = ("--min", "2", "--max", "3", "--ttl", str(ttl), "--settle", "0.3")
    a = spawn_node(["--etcd", etcd_server.endpoint, "--run-id", run, "--node-id", "a", *args])
    nodes = [
        EtcdRendezvous(client=connect(etcd_config), settings=settings, node_id=n, owns_client=True)
        for n in ("b", "c")
    ]
    out, errors = {}, {}
    try:
        for n in nodes:
            n.start()  # connected and watching before the kill: they join well within a TTL
        assert until(lambda: _closer(etcd_client, settings) == "a", 30)
        os.kill(a.proc.pid, signal.SIGKILL)
        killed_at = time.monotonic()
        threads = [_start(n, out, errors) for n in nodes]
        assert until(lambda: all(n._joined_round == 1 for n in nodes), 10)
        # They joined while the dead node's lease still held the closer key: they wait
        # on it, and take over when its lease expires.
        assert _closer(etcd_client, settings) == "a"
        for t in threads:
            t.join(ttl + 10)
        assert not errors, errors
        assert {w.nodes for w in out.values()} == {("b", "c")}
        assert {w.round for w in out.values()} == {1}
        assert time.monotonic() - killed_at < ttl + 5
    finally:
        for n in nodes:
            n.close()


def test_a_closer_that_times_out_hands_the_round_to_the_nodes_still_waiting(
    etcd_config, etcd_client
):
    run = fresh_run_id()

    def node(name, join_timeout):
        settings = RendezvousSettings(
            run_id=run, min_nodes=3, max_nodes=3, join_timeout=join_timeout, ttl=10
        )
        return EtcdRendezvous(
            client=connect(etcd_config), settings=settings, node_id=name, owns_client=True
        )

    impatient, b, c, d = node("a", 1.5), node("b", 30), node("c", 30), node("d", 30)
    out, errors = {}, {}
    try:
        threads = [_start(impatient, out, errors)]
        assert until(lambda: _closer(etcd_client, impatient.settings) == "a", 10)
        threads += [_start(b, out, errors)]
        threads[0].join(10)
        assert isinstance(errors.pop("a"), RendezvousTimeout)
        # Its lease (TTL 10 s) is alive, yet its closer key and join are gone at once.
        assert until(lambda: _closer(etcd_client, impatient.settings) == "b", 5)
        threads += [_start(n, out, errors) for n in (c, d)]
        for t in threads[1:]:
            t.join(20)
        assert not errors, errors
        assert {w.nodes for w in out.values()} == {("b", "c", "d")}
    finally:
        for n in (impatient, b, c, d):
            n.close()


def test_a_world_of_many_nodes_sharing_one_connection_forms_with_every_rank_once(etcd_config):
    n = 24
    settings = RendezvousSettings(run_id=fresh_run_id(), min_nodes=n, max_nodes=n)
    client = connect(etcd_config)
    nodes = [
        EtcdRendezvous(client=client, settings=settings, node_id=f"n{i:02d}") for i in range(n)
    ]
    out, errors = {}, {}
    try:
        threads = [_start(x, out, errors) for x in nodes]
        for t in threads:
            t.join(30)
        assert not errors, errors
        (world,) = {w.nodes for w in out.values()}
        assert world == tuple(sorted(x.node_id for x in nodes))
        assert sorted(w.rank_of(name) for name, w in out.items()) == list(range(n))
    finally:
        for x in nodes:
            x.close()
        client.close()
