"""torch's RendezvousBackend contract, run against our etcd backend with a real etcd and,
as a reference that the suite encodes torch's contract, against torch's own c10d backend."""

from __future__ import annotations

import base64
import json
import threading
from datetime import timedelta

import pytest
import torch.distributed as dist
from conftest import fresh_run_id
from torch.distributed.elastic.rendezvous import RendezvousParameters
from torch.distributed.elastic.rendezvous.api import RendezvousConnectionError, RendezvousStateError
from torch.distributed.elastic.rendezvous.c10d_rendezvous_backend import C10dRendezvousBackend

from elasticd.etcd import free_port
from elasticd.rendezvous import EtcdRendezvousBackend, EtcdStore, create_backend


@pytest.fixture(params=["etcd-v3", "c10d-reference"])
def backend(request, etcd_client):
    if request.param == "etcd-v3":
        return EtcdRendezvousBackend(etcd_client, fresh_run_id())
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    return C10dRendezvousBackend(store, fresh_run_id())


def test_get_state_is_none_when_nothing_is_stored(backend):
    assert backend.get_state() is None


def test_set_state_without_token_creates_and_returns_a_token(backend):
    state, token, ok = backend.set_state(b"first")
    assert ok and state == b"first" and token is not None
    assert backend.get_state() == (b"first", token)


def test_set_state_without_token_does_not_overwrite_an_existing_state(backend):
    _, token, _ = backend.set_state(b"first")
    state, current, ok = backend.set_state(b"second")
    assert not ok and state == b"first" and current == token


def test_set_state_with_the_current_token_succeeds_and_moves_the_token(backend):
    _, token, _ = backend.set_state(b"first")
    state, new_token, ok = backend.set_state(b"second", token)
    assert ok and state == b"second" and new_token != token
    assert backend.get_state() == (b"second", new_token)


def test_a_stale_token_returns_the_current_state_and_token_and_false(backend):
    _, old, _ = backend.set_state(b"first")
    _, current, _ = backend.set_state(b"second", old)
    state, token, ok = backend.set_state(b"third", old)
    assert (state, token, ok) == (b"second", current, False)


def test_an_invalid_token_is_treated_as_stale(backend):
    backend.set_state(b"first")
    state, _, ok = backend.set_state(b"x", "not-a-token")
    assert not ok and state == b"first"


def test_concurrent_writers_with_one_token_have_exactly_one_winner(backend):
    _, token, _ = backend.set_state(b"base")
    results = []
    threads = [
        threading.Thread(target=lambda i=i: results.append(backend.set_state(b"w%d" % i, token)))
        for i in range(8)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    winners = [r for r in results if r[2]]
    assert len(winners) == 1
    assert backend.get_state() == (winners[0][0], winners[0][1])


# -- etcd-specific --------------------------------------------------------------------------


def test_the_token_is_the_state_keys_etcd_mod_revision(etcd_client):
    backend = EtcdRendezvousBackend(etcd_client, fresh_run_id())
    _, token, _ = backend.set_state(b"s")
    assert token == etcd_client.get(backend.key).mod_revision


def test_corrupt_stored_state_raises_a_state_error(etcd_client):
    backend = EtcdRendezvousBackend(etcd_client, fresh_run_id())
    etcd_client.put(backend.key, b"\x80\x04not json")
    with pytest.raises(RendezvousStateError):
        backend.get_state()


def test_an_unreachable_etcd_raises_a_connection_error_within_the_timeout():
    params = RendezvousParameters(
        backend="etcd-v3-dynamic",
        endpoint=f"127.0.0.1:{free_port()}",
        run_id="r",
        min_nodes=1,
        max_nodes=1,
        timeout="1",
    )
    with pytest.raises(RendezvousConnectionError, match="did not answer"):
        create_backend(params)


def test_create_backend_returns_a_backend_and_a_working_store(etcd_server):
    params = RendezvousParameters(
        backend="etcd-v3-dynamic",
        endpoint=etcd_server.endpoint,
        run_id=fresh_run_id(),
        min_nodes=1,
        max_nodes=2,
    )
    backend, store = create_backend(params)
    assert backend.name == "etcd-v3-dynamic" and isinstance(store, EtcdStore)
    prefixed = dist.PrefixStore("x", store)
    threading.Timer(0.2, lambda: prefixed.set("late", b"v")).start()
    assert prefixed.get("late") == b"v"  # get blocks until the key is set
    assert prefixed.add("n", 2) == 2 and prefixed.add("n", 3) == 5
    assert prefixed.multi_get(["late", "n"]) == [b"v", b"5"]
    assert prefixed.compare_set("cas", "", "one") == b"one"
    assert prefixed.compare_set("cas", "nope", "two") == b"one"
    with pytest.raises(Exception, match="not set within"):
        store.wait(["never"], timedelta(seconds=0.3))


def test_the_dynamic_handler_forms_a_world_on_the_etcd_backend(etcd_server):
    from elasticd.rendezvous import create_dynamic_handler

    run = fresh_run_id()
    handlers = [
        create_dynamic_handler(
            RendezvousParameters(
                backend="etcd-v3-dynamic",
                endpoint=etcd_server.endpoint,
                run_id=run,
                min_nodes=2,
                max_nodes=2,
                local_addr="127.0.0.1",
            )
        )
        for _ in range(2)
    ]
    infos = {}
    threads = [
        threading.Thread(target=lambda h=h: infos.__setitem__(id(h), h.next_rendezvous()))
        for h in handlers
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert sorted(i.rank for i in infos.values()) == [0, 1]
    assert {i.world_size for i in infos.values()} == {2}
    for h in handlers:
        h.shutdown()


def test_stored_state_is_a_json_envelope(etcd_client):
    backend = EtcdRendezvousBackend(etcd_client, fresh_run_id())
    backend.set_state(b"\x00opaque")
    doc = json.loads(etcd_client.get(backend.key).value)
    assert doc["version"] == 1 and base64.b64decode(doc["state"]) == b"\x00opaque"
