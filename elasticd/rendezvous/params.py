"""Turn torch's ``RendezvousParameters`` (``--rdzv-endpoint``, ``--rdzv-conf k=v,...``)
or job.yaml's ``rendezvous:`` section into our settings and etcd config.

``--rdzv-conf`` keys we read: ``ttl``, ``settle``, ``join_timeout``,
``keepalive_interval``, ``prefix``, ``node_id``, and the etcd options ``cacert``,
``cert``, ``key``, ``user``, ``password_file``, ``etcd_timeout`` and
``etcd_request_timeout`` (or ``request_timeout``). torch's own ``last_call_timeout`` is
accepted as a synonym of ``settle``.

torch's ``timeout`` (torchrun always sends it, 900 s unless set) is the *join* timeout,
as it is for torch's own backends; an explicit ``join_timeout`` wins. It is not an etcd
call's budget: that is ``etcd_timeout`` (5 s), so an unreachable etcd is reported within
seconds instead of after 15 minutes of silent retries.

The etcd password never comes from ``--rdzv-conf``, which torch logs at start: it comes
from ``password_file=PATH`` or from ``$ELASTICD_ETCD_PASSWORD``.
"""

from __future__ import annotations

import ipaddress
import os
import socket
import uuid
from collections.abc import Mapping
from typing import TYPE_CHECKING

from elasticd.errors import UsageError
from elasticd.etcd.config import EtcdConfig, config_from_options, parse_endpoints
from elasticd.rendezvous.decisions import RendezvousSettings

if TYPE_CHECKING:
    from torch.distributed.elastic.rendezvous import RendezvousParameters

PASSWORD_ENV = "ELASTICD_ETCD_PASSWORD"
"""Where the etcd password comes from when ``--rdzv-conf`` has ``user`` but no
``password_file``."""
ETCD_TIMEOUT = 5.0
"""Default budget of one etcd call under torchrun, retries across members included."""
DEFAULT_JOIN_TIMEOUT = 300.0
"""Join timeout when neither ``join_timeout`` nor torch's ``timeout`` is given (torchrun
always gives ``timeout``)."""
_REFUSED = ("password", "etcd_password")


def _seconds(params: RendezvousParameters, *names: str, default: float | None) -> float | None:
    for name in names:
        value = params.get(name)
        if value not in (None, ""):
            try:
                return float(value)
            except (TypeError, ValueError) as exc:
                raise UsageError(
                    f"--rdzv-conf {name}={value!r} is not a number of seconds"
                ) from exc
    return default


def settings_from_params(params: RendezvousParameters) -> RendezvousSettings:
    return RendezvousSettings(
        run_id=params.run_id,
        min_nodes=params.min_nodes,
        max_nodes=params.max_nodes,
        ttl=_seconds(params, "ttl", default=3.0),  # type: ignore[arg-type]
        settle=_seconds(params, "settle", "last_call_timeout", default=1.0),  # type: ignore[arg-type]
        # torch's ``timeout`` is the rendezvous timeout of every torch backend; it is ours
        # too. (It used to be each etcd call's retry budget: 900 s of silence when etcd
        # was unreachable.)
        join_timeout=_seconds(  # type: ignore[arg-type]
            params, "join_timeout", "timeout", default=DEFAULT_JOIN_TIMEOUT
        ),
        keepalive_interval=_seconds(params, "keepalive_interval", default=None),
        prefix=str(params.get("prefix") or "/elasticd/rdzv"),
    )


def settings_from_job(
    job: object, *, run_id: str, min_nodes: int, max_nodes: int
) -> RendezvousSettings:
    """Settings from a parsed job spec (``job.rendezvous`` has ttl, settle, join_timeout,
    start_wait; ``job.nodes.start`` the first world's size)."""
    r = job.rendezvous  # type: ignore[attr-defined]
    return RendezvousSettings(
        run_id=run_id,
        min_nodes=min_nodes,
        max_nodes=max_nodes,
        start_nodes=job.nodes.start,  # type: ignore[attr-defined]
        start_wait=r.start_wait,
        ttl=r.ttl,
        settle=r.settle,
        join_timeout=r.join_timeout,
        reform_grace=r.reform_grace if job.restart.mode == "inprocess" else None,  # type: ignore[attr-defined]
        excuse_refused=True,
    )


def etcd_config_from_params(
    params: RendezvousParameters, env: Mapping[str, str] | None = None
) -> EtcdConfig:
    """The etcd config from ``--rdzv-endpoint`` and ``--rdzv-conf`` (password from
    ``password_file`` or ``env[ELASTICD_ETCD_PASSWORD]``; ``env`` defaults to os.environ)."""
    env = os.environ if env is None else env
    conf = params.config
    for name in _REFUSED:
        if conf.get(name) not in (None, ""):
            raise UsageError(
                f"--rdzv-conf {name}=... is refused because torch logs --rdzv-conf: pass "
                f"password_file=PATH (a file holding the password), or set ${PASSWORD_ENV}"
            )
    options: dict[str, object] = {
        k: v
        for k, v in conf.items()
        if k not in ("timeout", "request_timeout", "etcd_timeout", "etcd_request_timeout")
    }
    options["endpoints"] = params.endpoint
    for field, names, default in (
        ("timeout", ("etcd_timeout",), ETCD_TIMEOUT),
        ("request_timeout", ("etcd_request_timeout", "request_timeout"), None),
    ):
        seconds = _seconds(params, *names, default=default)
        if seconds is not None and seconds <= 0:
            raise UsageError(f"--rdzv-conf {names[0]}={seconds:g} must be positive")
        options[field] = seconds
    user = options.get("user") or options.get("etcd_user")
    options["password"] = _password(params, bool(user), env)
    return config_from_options(options, env=env)


def _password(params: RendezvousParameters, has_user: bool, env: Mapping[str, str]) -> str | None:
    path = params.get("password_file")
    if path:
        try:
            with open(path, encoding="utf-8") as f:
                password = f.read().rstrip("\r\n")
        except OSError as exc:
            raise UsageError(
                f"--rdzv-conf password_file={path}: cannot read it: {exc.strerror}"
            ) from exc
        if not password:
            raise UsageError(f"--rdzv-conf password_file={path}: the file is empty")
        if not has_user:
            raise UsageError(f"--rdzv-conf password_file={path} needs user=NAME too")
        return password
    password = env.get(PASSWORD_ENV) or None
    if has_user and password is None:
        raise UsageError(
            f"--rdzv-conf user=... needs a password: pass password_file=PATH, or set "
            f"${PASSWORD_ENV}"
        )
    if password is not None and not has_user:
        raise UsageError(f"${PASSWORD_ENV} is set but --rdzv-conf has no user=NAME")
    return password


def local_address(params: RendezvousParameters, endpoints: tuple[str, ...]) -> str:
    """The address peers reach us at: ``--local-addr``, else loopback when etcd itself is
    on loopback (a single-machine run), else this host's fully qualified name."""
    if params.local_addr:
        return params.local_addr
    host = endpoints[0].rpartition(":")[0].strip("[]")
    try:
        loopback = host == "localhost" or ipaddress.ip_address(host).is_loopback
    except ValueError:
        loopback = False
    return "127.0.0.1" if loopback else socket.getfqdn()


def node_id_from_params(params: RendezvousParameters, addr: str) -> str:
    explicit = params.get("node_id")
    if explicit:
        return str(explicit)
    return f"{socket.gethostname()}_{os.getpid()}_{uuid.uuid4().hex[:6]}_{addr}".replace("/", "_")


__all__ = [
    "ETCD_TIMEOUT",
    "PASSWORD_ENV",
    "etcd_config_from_params",
    "local_address",
    "node_id_from_params",
    "parse_endpoints",
    "settings_from_job",
    "settings_from_params",
]
