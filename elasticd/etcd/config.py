"""How to reach etcd: endpoints, TLS, auth and timeouts, parsed at the edge."""

from __future__ import annotations

import math
import os
from collections.abc import Mapping
from dataclasses import dataclass, replace

from elasticd.errors import UsageError

DEFAULT_ENDPOINT = "127.0.0.1:2379"


@dataclass(frozen=True, kw_only=True, slots=True)
class EtcdConfig:
    """Connection settings of one etcd cluster."""

    endpoints: tuple[str, ...] = (DEFAULT_ENDPOINT,)
    """Client URLs as ``host:port``; several members of one cluster are tried in turn."""
    ca_cert: str | None = None
    """PEM file of the CA that signed the server certificates; set it to speak TLS."""
    cert: str | None = None
    """PEM client certificate, for servers started with ``--client-cert-auth``."""
    key: str | None = None
    """PEM private key of ``cert``."""
    user: str | None = None
    """User name, for clusters with auth enabled."""
    password: str | None = None
    """Password of ``user``."""
    timeout: float = 5.0
    """Budget of one operation in seconds, retries across members included."""
    request_timeout: float = 2.0
    """Deadline of one attempt against one member, in seconds."""

    @property
    def tls(self) -> bool:
        """Whether the channel is TLS (a CA or client certificate was given)."""
        return bool(self.ca_cert or self.cert)

    def with_(self, **changes) -> EtcdConfig:
        """A copy with some fields changed."""
        return replace(self, **changes)


def parse_endpoints(text: str | None) -> tuple[str, ...]:
    """``"http://a:2379, b"`` → ``("a:2379", "b:2379")``; a bad entry is a UsageError."""
    if not text or not text.strip():
        return (DEFAULT_ENDPOINT,)
    out = []
    for raw in text.split(","):
        item = raw.strip()
        for scheme in ("http://", "https://", "unix://"):
            if item.startswith(scheme):
                item = item[len(scheme) :]
        item = item.rstrip("/")
        if not item:
            continue
        host, sep, port = item.rpartition(":")
        if not sep and item and "]" not in item:
            host, port = item, "2379"  # etcd's client port when none is given
        if not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise UsageError(f"etcd endpoint {raw.strip()!r} is not host:port")
        out.append(f"{host}:{int(port)}")
    if not out:
        raise UsageError(f"etcd endpoints {text!r} name no host:port")
    return tuple(out)


def _check_pem(field: str, path: object) -> None:
    """A TLS file that is readable but not PEM (a DER certificate, the wrong file) is
    named here in one line: gRPC printed its own C-level error lines, then a misleading
    "did not answer within 5 s". An unreadable one is left to the connect's own error."""
    if not isinstance(path, str):
        return
    try:
        with open(path, "rb") as fh:
            head = fh.read(1 << 20)
    except OSError:
        return
    if b"-----BEGIN " not in head:
        raise UsageError(f"etcd {field}: {path} is not a PEM file (no -----BEGIN line)")


def config_from_options(
    options: Mapping[str, object], env: Mapping[str, str] | None = None
) -> EtcdConfig:
    """Build a config from flat option names (CLI flags, ``--rdzv-conf`` keys, env).

    Recognised keys: ``endpoints``/``etcd``, ``ca_cert``/``cacert``, ``cert``, ``key``,
    ``user``, ``password``, ``timeout``, ``request_timeout``. ``ELASTICD_ETCD`` is the
    endpoint fallback.
    """
    env = os.environ if env is None else env

    def pick(*names: str) -> str | None:
        for name in names:
            value = options.get(name)
            if value not in (None, ""):
                return str(value)
        return None

    endpoints = parse_endpoints(pick("endpoints", "etcd") or env.get("ELASTICD_ETCD"))
    fields: dict[str, object] = {"endpoints": endpoints}
    for field, names in (
        ("ca_cert", ("ca_cert", "cacert", "etcd_cacert")),
        ("cert", ("cert", "etcd_cert")),
        ("key", ("key", "etcd_key")),
        ("user", ("user", "etcd_user")),
        ("password", ("password", "etcd_password")),
    ):
        value = pick(*names)
        if value is not None:
            fields[field] = value
    for field in ("timeout", "request_timeout"):
        value = pick(field, f"etcd_{field}")
        if value is not None:
            try:
                seconds = float(value)
            except ValueError as exc:
                raise UsageError(f"etcd {field}: {value!r} is not a number of seconds") from exc
            if not 0 < seconds < math.inf:  # NaN and inf too: a deadline that never comes
                raise UsageError(f"etcd {field}: {value!r} must be a positive, finite number")
            fields[field] = seconds
    if bool(fields.get("cert")) != bool(fields.get("key")):
        raise UsageError("etcd TLS: a client cert needs its key, and a key needs its cert")
    if bool(fields.get("user")) != bool(fields.get("password")):
        raise UsageError("etcd auth: user and password go together")
    for field in ("ca_cert", "cert", "key"):
        _check_pem(field, fields.get(field))
    config = EtcdConfig(**fields)  # type: ignore[arg-type]
    if config.request_timeout > config.timeout:
        config = config.with_(request_timeout=config.timeout)
    return config
