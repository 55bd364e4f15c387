"""torchrun's ``--rdzv-endpoint``/``--rdzv-conf`` and job.yaml's ``rendezvous:`` become
our settings; bad values and an unreachable etcd give clear errors, never a hang."""

from __future__ import annotations

import time

import pytest
from torch.distributed.elastic.rendezvous import RendezvousParameters
from torch.distributed.elastic.rendezvous.api import (
    RendezvousConnectionError,
    RendezvousTimeoutError,
)

from elasticd.errors import UsageError
from elasticd.etcd import free_port
from elasticd.jobspec import parse_job
from elasticd.rendezvous import create_handler, settings_from_job, settings_from_params
from elasticd.rendezvous.params import etcd_config_from_params, local_address


def _params(endpoint="127.0.0.1:2379", **conf):
    return RendezvousParameters(
        backend="etcd-v3", endpoint=endpoint, run_id="job", min_nodes=1, max_nodes=4, **conf
    )


def test_rdzv_conf_sets_ttl_settle_join_timeout_and_etcd_options():
    p = _params("a:1,b:2", ttl="5", last_call_timeout="2", join_timeout="60", cacert="/ca.pem",
                cert="/c.pem", key="/k.pem", timeout="3")  # fmt: skip
    s = settings_from_params(p)
    assert (s.ttl, s.settle, s.join_timeout, s.keepalive) == (5.0, 2.0, 60.0, pytest.approx(5 / 3))
    assert (s.min_nodes, s.max_nodes, s.run_id) == (1, 4, "job")
    c = etcd_config_from_params(p)
    assert c.endpoints == ("a:1", "b:2") and c.tls and c.timeout == 3.0


def test_a_non_numeric_rdzv_conf_value_is_a_usage_error():
    with pytest.raises(UsageError, match="ttl"):
        settings_from_params(_params(ttl="soon"))


def test_job_yaml_rendezvous_section_gives_the_settings():
    job = parse_job({"name": "tiny", "rendezvous": {"ttl": 4, "settle": 0.5, "join_timeout": 30}})
    s = settings_from_job(job, run_id="tiny-1", min_nodes=1, max_nodes=2)
    assert (s.ttl, s.settle, s.join_timeout, s.run_id) == (4, 0.5, 30, "tiny-1")


def test_the_advertised_address_is_loopback_for_a_loopback_etcd_and_local_addr_wins():
    assert local_address(_params(), ("127.0.0.1:2379",)) == "127.0.0.1"
    p = RendezvousParameters(backend="etcd-v3", endpoint="e:1", run_id="j", min_nodes=1,
                             max_nodes=1, local_addr="10.1.2.3")  # fmt: skip
    assert local_address(p, ("e:1",)) == "10.1.2.3"


def test_the_torchrun_handler_on_a_dead_endpoint_fails_within_its_timeout():
    t0 = time.monotonic()
    with pytest.raises(RendezvousConnectionError, match="did not answer"):
        create_handler(_params(f"127.0.0.1:{free_port()}", timeout="1"))
    assert time.monotonic() - t0 < 3.0


def test_the_torchrun_handler_raises_torchs_timeout_error(etcd_server):
    from conftest import fresh_run_id

    p = RendezvousParameters(backend="etcd-v3", endpoint=etcd_server.endpoint, run_id=fresh_run_id(),
                             min_nodes=2, max_nodes=2, join_timeout="1")  # fmt: skip
    handler = create_handler(p)
    try:
        with pytest.raises(RendezvousTimeoutError):
            handler.next_rendezvous()
        assert handler.get_backend() == "etcd-v3" and handler.use_agent_store
    finally:
        handler.shutdown()
