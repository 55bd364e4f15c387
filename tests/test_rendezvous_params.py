"""torchrun's ``--rdzv-endpoint``/``--rdzv-conf`` and job.yaml's ``rendezvous:`` become
our settings; bad values and an unreachable etcd give clear errors, never a hang; the etcd
password comes from a file or the environment, never from ``--rdzv-conf``."""

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
from elasticd.rendezvous.params import (
    ETCD_TIMEOUT,
    PASSWORD_ENV,
    etcd_config_from_params,
    local_address,
)


def _params(endpoint="127.0.0.1:2379", **conf):
    return RendezvousParameters(
        backend="etcd-v3", endpoint=endpoint, run_id="job", min_nodes=1, max_nodes=4, **conf
    )


def test_rdzv_conf_sets_ttl_settle_join_timeout_and_etcd_options():
    p = _params("a:1,b:2", ttl="5", last_call_timeout="2", join_timeout="60", cacert="/ca.pem",
                cert="/c.pem", key="/k.pem", etcd_timeout="3", etcd_request_timeout="1")  # fmt: skip
    s = settings_from_params(p)
    assert (s.ttl, s.settle, s.join_timeout, s.keepalive) == (5.0, 2.0, 60.0, pytest.approx(5 / 3))
    assert (s.min_nodes, s.max_nodes, s.run_id) == (1, 4, "job")
    c = etcd_config_from_params(p, env={})
    assert c.endpoints == ("a:1", "b:2") and c.tls
    assert (c.timeout, c.request_timeout) == (3.0, 1.0)


def test_torchs_timeout_is_the_join_timeout_not_each_etcd_calls_budget():
    # torchrun always sends timeout (900 by default).
    p = _params(timeout=900)
    assert settings_from_params(p).join_timeout == 900.0
    c = etcd_config_from_params(p, env={})
    assert (c.timeout, c.request_timeout) == (ETCD_TIMEOUT, 2.0)
    assert ETCD_TIMEOUT <= 5.0


def test_an_explicit_join_timeout_wins_over_torchs_timeout():
    assert settings_from_params(_params(timeout=900, join_timeout="60")).join_timeout == 60.0


def test_request_timeout_still_sets_one_attempts_deadline():
    assert etcd_config_from_params(_params(request_timeout="0.5"), env={}).request_timeout == 0.5


def test_a_non_positive_etcd_timeout_is_a_usage_error():
    with pytest.raises(UsageError, match="etcd_timeout=0 must be positive"):
        etcd_config_from_params(_params(etcd_timeout="0"), env={})


@pytest.mark.parametrize("key", ["password", "etcd_password"])
def test_a_password_in_rdzv_conf_is_refused_pointing_to_password_file_and_the_environment(key):
    with pytest.raises(UsageError) as info:
        etcd_config_from_params(_params(user="root", **{key: "hunter2"}), env={})
    message = str(info.value)
    assert "\n" not in message and "hunter2" not in message
    assert f"--rdzv-conf {key}=" in message
    assert "password_file=PATH" in message and PASSWORD_ENV in message


def test_the_etcd_password_is_read_from_password_file(tmp_path):
    secret = tmp_path / "etcd-password"
    secret.write_text("s3cret\n")
    c = etcd_config_from_params(_params(user="root", password_file=str(secret)), env={})
    assert (c.user, c.password) == ("root", "s3cret")


def test_the_etcd_password_is_read_from_the_environment():
    c = etcd_config_from_params(_params(user="root"), env={PASSWORD_ENV: "s3cret"})
    assert (c.user, c.password) == ("root", "s3cret")


def test_a_password_file_wins_over_the_environment(tmp_path):
    secret = tmp_path / "etcd-password"
    secret.write_text("from-file")
    p = _params(user="root", password_file=str(secret))
    assert etcd_config_from_params(p, env={PASSWORD_ENV: "from-env"}).password == "from-file"


def test_a_user_without_a_password_file_or_environment_variable_is_a_usage_error():
    with pytest.raises(UsageError, match=f"password_file=PATH, or set \\${PASSWORD_ENV}"):
        etcd_config_from_params(_params(user="root"), env={})


def test_an_unreadable_password_file_is_a_usage_error_naming_it(tmp_path):
    missing = tmp_path / "nope"
    with pytest.raises(UsageError, match=f"password_file={missing}: cannot read it"):
        etcd_config_from_params(_params(user="root", password_file=str(missing)), env={})


def test_a_password_without_a_user_is_a_usage_error(tmp_path):
    secret = tmp_path / "etcd-password"
    secret.write_text("s3cret")
    with pytest.raises(UsageError, match="needs user=NAME"):
        etcd_config_from_params(_params(password_file=str(secret)), env={})
    with pytest.raises(UsageError, match="no user=NAME"):
        etcd_config_from_params(_params(), env={PASSWORD_ENV: "s3cret"})


def test_a_non_numeric_rdzv_conf_value_is_a_usage_error():
    with pytest.raises(UsageError, match="ttl"):
        settings_from_params(_params(ttl="soon"))


def test_job_yaml_rendezvous_section_gives_the_settings():
    job = parse_job({"name": "tiny", "nodes": {"min": 1, "max": 2, "start": 2},
                     "rendezvous": {"ttl": 4, "settle": 0.5, "join_timeout": 30,
                                    "start_wait": 120}})  # fmt: skip
    s = settings_from_job(job, run_id="tiny-1", min_nodes=1, max_nodes=2)
    assert (s.ttl, s.settle, s.join_timeout, s.run_id) == (4, 0.5, 30, "tiny-1")
    assert (s.start_nodes, s.start_wait) == (2, 120)


def test_the_advertised_address_is_loopback_for_a_loopback_etcd_and_local_addr_wins():
    assert local_address(_params(), ("127.0.0.1:2379",)) == "127.0.0.1"
    p = RendezvousParameters(backend="etcd-v3", endpoint="e:1", run_id="j", min_nodes=1,
                             max_nodes=1, local_addr="10.1.2.3")  # fmt: skip
    assert local_address(p, ("e:1",)) == "10.1.2.3"


def test_the_torchrun_handler_on_a_dead_endpoint_fails_within_its_timeout():
    t0 = time.monotonic()
    with pytest.raises(RendezvousConnectionError, match="did not answer"):
        create_handler(_params(f"127.0.0.1:{free_port()}", etcd_timeout="1"))
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
