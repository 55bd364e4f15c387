"""The etcd client against a real etcd: key/value, transactions, leases, watches,
failover across members, auth, and clear errors (not hangs) when etcd is unreachable."""

from __future__ import annotations

import threading
import time

import pytest
from conftest import fresh_prefix
from polling import until

from elasticd.errors import EtcdError, UsageError
from elasticd.etcd import (
    EmbeddedEtcd,
    EtcdAuthError,
    EtcdClient,
    EtcdConfig,
    EtcdUnavailableError,
    Watch,
    compare,
    config_from_options,
    connect,
    free_port,
    parse_endpoints,
    put_op,
)


def test_endpoints_parse_with_schemes_spaces_and_several_members():
    assert parse_endpoints("http://a:2379, b:1") == ("a:2379", "b:1")
    assert parse_endpoints("etcd-0") == ("etcd-0:2379",)
    assert parse_endpoints(None) == ("127.0.0.1:2379",)


@pytest.mark.parametrize("bad", ["a:b", ":1", "a:70000", "a:"])
def test_a_malformed_endpoint_is_a_one_line_usage_error(bad):
    with pytest.raises(UsageError, match="host:port"):
        parse_endpoints(bad)


def test_options_need_cert_and_key_together():
    with pytest.raises(UsageError, match="cert"):
        config_from_options({"endpoints": "a:1", "cert": "c.pem"})
    cfg = config_from_options({"etcd": "a:1", "timeout": "1.5"}, env={})
    assert cfg.endpoints == ("a:1",) and cfg.timeout == 1.5 and cfg.request_timeout == 1.5


def test_put_get_delete_and_prefix_reads(etcd_client):
    p = fresh_prefix()
    rev = etcd_client.put(p + "a", "1")
    etcd_client.put(p + "b", b"2")
    item = etcd_client.get(p + "a")
    assert item.value == b"1" and item.mod_revision == rev
    items, head = etcd_client.get_prefix(p)
    assert [i.key for i in items] == [p + "a", p + "b"] and head >= rev
    assert etcd_client.delete(p, prefix=True) == 2
    assert etcd_client.get(p + "a") is None


def test_a_transaction_runs_its_success_branch_only_when_the_compare_holds(etcd_client):
    p = fresh_prefix()
    rev = etcd_client.put(p + "k", "v1")
    ok = etcd_client.txn([compare(p + "k", "mod", "==", rev)], [put_op(p + "k", "v2")])
    stale = etcd_client.txn([compare(p + "k", "mod", "==", rev)], [put_op(p + "k", "v3")])
    assert ok.succeeded and not stale.succeeded
    assert etcd_client.get(p + "k").value == b"v2"


def test_a_leased_key_disappears_on_revoke_and_the_watch_sees_it(etcd_client):
    p = fresh_prefix()
    seen: list = []
    got_delete = threading.Event()

    def on_events(events):
        seen.extend(events)
        if any(e.kind == "delete" for e in events):
            got_delete.set()

    _, rev = etcd_client.get_prefix(p)
    watch = Watch(etcd_client, p, start_revision=rev + 1, on_events=on_events)
    try:
        lease = etcd_client.lease_grant(5)
        assert etcd_client.lease_keepalive(lease) == 5
        etcd_client.put(p + "node", "x", lease=lease)
        etcd_client.lease_revoke(lease)
        assert got_delete.wait(5)
        assert [(e.kind, e.kv.key) for e in seen] == [("put", p + "node"), ("delete", p + "node")]
        assert etcd_client.lease_keepalive(lease) == 0
    finally:
        watch.cancel()


def test_an_unreachable_endpoint_fails_with_a_clear_error_within_the_timeout():
    port = free_port()
    t0 = time.monotonic()
    with pytest.raises(EtcdUnavailableError, match=f"127.0.0.1:{port} did not answer"):
        connect(EtcdConfig(endpoints=(f"127.0.0.1:{port}",), timeout=1.5, request_timeout=0.5))
    assert time.monotonic() - t0 < 3.0


def test_a_dead_first_member_fails_over_to_a_live_one(etcd_server):
    config = EtcdConfig(endpoints=(f"127.0.0.1:{free_port()}", etcd_server.endpoint), timeout=5)
    with EtcdClient(config) as client:
        p = fresh_prefix()
        client.put(p + "k", "v")
        assert client.get(p + "k").value == b"v"
        assert client.endpoint == etcd_server.endpoint


def test_an_etcd_that_goes_down_gives_a_clear_error_not_a_hang(tmp_path):
    server = EmbeddedEtcd(data_dir=str(tmp_path / "down")).start()
    client = connect(server.client_config(timeout=1.0, request_timeout=0.5))
    try:
        client.put("/k", "v")
        server.stop()
        t0 = time.monotonic()
        with pytest.raises(EtcdUnavailableError):
            client.get("/k")
        assert time.monotonic() - t0 < 2.5
    finally:
        client.close()
        server.stop()


def test_a_kept_lease_outlives_an_etcd_outage_longer_than_its_ttl(tmp_path):
    # etcd gives every lease a fresh TTL when a leader is elected after the restart; the
    # keeper's next refresh must get through within that TTL. With gRPC's default
    # reconnect back-off (1 s growing by 1.6x) the channel, after 10 s away, tried again
    # only about 5 s after etcd was back.
    server = EmbeddedEtcd(data_dir=str(tmp_path / "etcd")).start()
    client = connect(server.client_config(timeout=5.0, request_timeout=1.0))
    lost: list[int] = []
    try:
        lease = client.lease_grant(3)
        client.put("/outage/k", "v", lease=lease)
        client.keeper().add(lease, 1.0, lost.append)
        server.stop(keep_ports=True)
        time.sleep(10)
        server.start()
        time.sleep(6)  # two TTLs: a lease not refreshed since etcd came back has expired
        assert lost == []
        assert client.get("/outage/k") is not None
        assert client.lease_keepalive(lease) == 3
    finally:
        client.close()
        server.stop()


def test_user_and_password_auth_is_enforced(tmp_path):
    from etcd3 import etcdrpc

    server = EmbeddedEtcd(data_dir=str(tmp_path / "auth")).start()
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
        with EtcdClient(server.client_config(user="root", password="s3cret")) as good:
            good.put("/secret", "v")
            assert good.get("/secret").value == b"v"
        with (
            pytest.raises(EtcdAuthError),
            EtcdClient(server.client_config(user="root", password="nope")) as bad,
        ):
            bad.get("/secret")
        with pytest.raises(EtcdError), EtcdClient(server.client_config()) as anonymous:
            anonymous.get("/secret")
    finally:
        server.stop()


def test_a_frozen_member_loses_no_kept_lease_and_no_watch_event(tmp_path):
    """A member frozen (SIGSTOP) or cut off keeps its connections open and answers nothing:
    the lease keep-alive stream and the watch on it waited for good, the lease ran out on
    the healthy members, and the agent left the cluster without a word."""
    import os
    import signal

    from elasticd.etcd import EtcdCluster

    cluster = EtcdCluster(base_dir=str(tmp_path / "etcd")).start()
    frozen = cluster.members[0]
    errors: list[tuple[str, str]] = []
    client = connect(cluster.client_config(timeout=5.0, request_timeout=1.0))
    client.on_error = lambda op, code: errors.append((op, code))
    other = connect(EtcdConfig(endpoints=cluster.endpoints[1:], timeout=5.0))
    lost: list[int] = []
    seen = threading.Event()
    p = fresh_prefix()
    try:
        assert client.member().endpoint == frozen.endpoint  # the frozen one is the client's
        lease = client.lease_grant(3)
        client.put(p + "node", "x", lease=lease)
        client.keeper().add(lease, 1.0, lost.append)
        _, rev = client.get_prefix(p)
        watch = Watch(client, p, start_revision=rev + 1,
                      on_events=lambda ev: any(e.kv.key == p + "after" for e in ev) and seen.set())  # fmt: skip
        assert watch.ready.wait(5)
        os.kill(frozen.proc.pid, signal.SIGSTOP)
        try:
            time.sleep(6)  # two TTLs: a lease refreshed through the frozen member only is gone
            assert lost == []
            assert other.get(p + "node") is not None
            other.put(p + "after", "y")
            # The watch resumes on another member once the connection's pings go unanswered.
            assert seen.wait(15)
            assert ("lease_keepalive", "DEADLINE_EXCEEDED") in errors
        finally:
            os.kill(frozen.proc.pid, signal.SIGCONT)
        watch.cancel()
    finally:
        client.close()
        other.close()
        cluster.stop()


def test_a_kept_lease_is_alive_while_refreshed_or_etcd_is_away_and_not_once_we_did_not_run(
    tmp_path,
):
    """``LeaseKeeper.alive``, what a thawed agent's scrape asks before anything else
    here has run (docs/metrics.md). Refreshed, a 2 s lease stays alive past its TTL;
    revoked, it is not. etcd stopped for twice the TTL: still alive (the keeper keeps
    trying, and a new leader renews every lease; the agents' metrics must not drop a
    world that trains on). The keeper stopped (a frozen process: nothing runs, nothing
    notices): not alive once its TTL has passed."""
    from elasticd.etcd.lease import LeaseKeeper

    server = EmbeddedEtcd(data_dir=str(tmp_path / "etcd")).start()
    client = connect(server.client_config(timeout=1.0))
    keeper = LeaseKeeper(client)
    try:
        kept, revoked = client.lease_grant(2), client.lease_grant(2)
        for lease in (kept, revoked):
            keeper.add(lease, 0.5, lambda _lease: None, ttl=2)
        assert keeper.alive(kept) and not keeper.alive(12345)
        time.sleep(3)
        assert keeper.alive(kept)
        client.lease_revoke(revoked)
        assert until(lambda: not keeper.alive(revoked), 5)
        server.stop()
        for _ in range(8):
            time.sleep(0.5)
            assert keeper.alive(kept)
        keeper.close()  # frozen: the keeper's thread runs no more
        assert keeper.alive(kept)
        assert until(lambda: not keeper.alive(kept), 5)
    finally:
        keeper.close()
        client.close()
        server.stop()
