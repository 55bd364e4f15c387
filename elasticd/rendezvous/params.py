"""Turn torch's ``RendezvousParameters`` (``--rdzv-endpoint``, ``--rdzv-conf k=v,...``)
or job.yaml's ``rendezvous:`` section into our settings and etcd config.

``--rdzv-conf`` keys we read: ``ttl``, ``settle``, ``join_timeout``,
``keepalive_interval``, ``prefix``, ``node_id``, and the etcd options ``cacert``,
``cert``, ``key``, ``user``, ``password``, ``timeout``, ``request_timeout``. torch's own
``last_call_timeout`` is accepted as a synonym of ``settle``.
"""

from __future__ import annotations

import ipaddress
import os
import socket
import uuid
from typing import TYPE_CHECKING

from elasticd.errors import UsageError
from elasticd.etcd.config import EtcdConfig, config_from_options, parse_endpoints
from elasticd.rendezvous.decisions import RendezvousSettings

if TYPE_CHECKING:
    from torch.distributed.elastic.rendezvous import RendezvousParameters


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
        join_timeout=_seconds(params, "join_timeout", default=300.0),  # type: ignore[arg-type]
        keepalive_interval=_seconds(params, "keepalive_interval", default=None),
        prefix=str(params.get("prefix") or "/elasticd/rdzv"),
    )


def settings_from_job(
    job: object, *, run_id: str, min_nodes: int, max_nodes: int
) -> RendezvousSettings:
    """Settings from a parsed job spec (``job.rendezvous`` has ttl, settle, join_timeout)."""
    r = job.rendezvous  # type: ignore[attr-defined]
    return RendezvousSettings(
        run_id=run_id,
        min_nodes=min_nodes,
        max_nodes=max_nodes,
        ttl=r.ttl,
        settle=r.settle,
        join_timeout=r.join_timeout,
    )


def etcd_config_from_params(params: RendezvousParameters) -> EtcdConfig:
    options = dict(params.config)
    options["endpoints"] = params.endpoint
    return config_from_options(options)


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
    "etcd_config_from_params",
    "local_address",
    "node_id_from_params",
    "parse_endpoints",
    "settings_from_job",
    "settings_from_params",
]
