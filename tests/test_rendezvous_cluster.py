"""A rendezvous on a 3-member etcd cluster completes although the leader is SIGKILLed
while the round is open: clients fail over, watches resume, leases survive."""

from __future__ import annotations

import threading
import time

from conftest import fresh_run_id

from elasticd.etcd import EtcdClient
from elasticd.rendezvous import EtcdRendezvous, RendezvousSettings


def test_a_rendezvous_completes_when_the_etcd_leader_is_killed_mid_round(etcd_cluster):
    settings = RendezvousSettings(run_id=fresh_run_id(), min_nodes=3, max_nodes=3, ttl=3)
    endpoints = etcd_cluster.endpoints
    nodes = []
    for i in range(3):
        # Each node prefers a different member, so one of them certainly loses its member.
        rotated = endpoints[i:] + endpoints[:i]
        client = EtcdClient(etcd_cluster.client_config(timeout=10).with_(endpoints=rotated))
        nodes.append(
            EtcdRendezvous(client=client, settings=settings, node_id=f"n{i}", owns_client=True)
        )
    worlds, errors = {}, []

    def form(node):
        try:
            worlds[node.node_id] = node.next_world()
        except Exception as exc:
            errors.append(exc)

    threads = [threading.Thread(target=form, args=(n,), daemon=True) for n in nodes]
    try:
        for t in threads[:2]:
            t.start()
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and not all(n._joined_round for n in nodes[:2]):
            time.sleep(0.02)
        assert all(n._joined_round == 1 for n in nodes[:2])  # round 1 is open with two nodes
        etcd_cluster.leader().kill()
        threads[2].start()
        for t in threads:
            t.join(30)
        assert not errors, errors
        assert {w.nodes for w in worlds.values()} == {("n0", "n1", "n2")}
        # The two early nodes kept their leases through the election: nobody was lost.
        time.sleep(settings.ttl + 0.5)
        assert all(n.num_nodes_waiting() == 0 for n in nodes)
    finally:
        for n in nodes:
            n.close()
