"""A small etcd v3 client over gRPC that retries across members and maps errors.

We speak the v3 gRPC API through the generated stubs shipped with ``python3-etcd3``
(``etcd3.etcdrpc``) rather than its high-level client, because we need three things it
does not give: one deadline per operation that spans retries, failover across members on
leader change or connection loss with backoff, and errors mapped to ``EtcdError``.

Writes are retried too. Every write we issue is either idempotent (a put of a whole
value, a delete) or a transaction fenced by a compare, so a retry after a lost reply at
worst fails its compare, and the caller re-reads.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import grpc
from etcd3 import etcdrpc

from elasticd.errors import EtcdError
from elasticd.etcd.config import EtcdConfig
from elasticd.etcd.ops import (  # re-exported: callers build transactions from here
    compare,
    compare_range,
    delete_op,
    get_op,
    prefix_end,
    put_op,
)
from elasticd.log import kv

log = logging.getLogger("elasticd.etcd")
T = TypeVar("T")
__all__ = [
    "EtcdAuthError",
    "EtcdClient",
    "EtcdLeaseNotFound",
    "EtcdUnavailableError",
    "KeyValue",
    "TxnResult",
    "compare",
    "compare_range",
    "connect",
    "delete_op",
    "get_op",
    "prefix_end",
    "put_op",
]

_RETRYABLE = {
    grpc.StatusCode.UNAVAILABLE,
    grpc.StatusCode.DEADLINE_EXCEEDED,
    grpc.StatusCode.ABORTED,
}
# etcd answers these while it has no leader or its leader moved; another member may be fine.
_AUTH_TEXT = ("authentication failed", "user name is empty", "permission denied", "auth token")
_RETRYABLE_TEXT = ("leader changed", "no leader", "timed out", "too many requests", "stopped")


class EtcdUnavailableError(EtcdError):
    """No member answered within the configured timeout."""


class EtcdLeaseNotFound(EtcdError):
    """The lease named in a request has expired or was revoked."""


class EtcdAuthError(EtcdError):
    """The credentials (user/password or client certificate) were refused."""


@dataclass(frozen=True, slots=True)
class KeyValue:
    """One stored key with its revisions."""

    key: str
    value: bytes
    create_revision: int
    mod_revision: int
    lease: int


@dataclass(frozen=True, slots=True)
class TxnResult:
    """What a transaction did: which branch ran, at which store revision."""

    succeeded: bool
    revision: int
    responses: tuple[Any, ...]


def _kv(msg: Any) -> KeyValue:
    return KeyValue(
        key=msg.key.decode(),
        value=bytes(msg.value),
        create_revision=msg.create_revision,
        mod_revision=msg.mod_revision,
        lease=msg.lease,
    )


# -- the client -----------------------------------------------------------------------------


RECONNECT_BACKOFF_MS = (100, 500)
"""gRPC's reconnect back-off for a member's channel: first pause, longest pause (ms).

gRPC's defaults (1 s, growing by 1.6x up to 120 s) are made for servers that stay away.
After an etcd outage of 10 s a channel waits up to 7 s more before it tries again, while
etcd gives every lease only its TTL (plus an election timeout) from the moment a leader
is elected: a keep-alive that waits out that back-off finds its lease gone, and every
rendezvous member is lost at once. Capped at 0.5 s, a channel is back within about half
a second of its member. The price is a connection attempt (one refused SYN on loopback,
a TCP timeout elsewhere) every 0.5 s per member while a member is down."""


KEEPALIVE_MS = (5000, 3000)
"""gRPC keepalive of a member's channel: ping interval, and how long a ping may go
unanswered before the connection is closed (ms)."""


class _Member:
    """One endpoint's channel and stubs, made lazily."""

    def __init__(self, endpoint: str, credentials: grpc.ChannelCredentials | None) -> None:
        self.endpoint = endpoint
        first, longest = RECONNECT_BACKOFF_MS
        options = [
            ("grpc.max_receive_message_length", 64 << 20),
            ("grpc.initial_reconnect_backoff_ms", first),
            ("grpc.max_reconnect_backoff_ms", longest),
            # HTTP/2 pings on a connection with streams open (watches): a member frozen or
            # cut off answers none, so the connection is closed and the streams resume on
            # another member (without them, a watch waited on it for good). Not more often
            # than etcd's --grpc-keepalive-min-time (5 s), which would answer GOAWAY.
            ("grpc.keepalive_time_ms", KEEPALIVE_MS[0]),
            ("grpc.keepalive_timeout_ms", KEEPALIVE_MS[1]),
            ("grpc.http2.max_pings_without_data", 0),
            # Any ping, the flow-control (BDP) ones too: a keepalive ping that finds one of
            # those in flight waits on it, for 60 s by default.
            ("grpc.http2.ping_timeout_ms", KEEPALIVE_MS[1]),
        ]
        if credentials is None:
            self.channel = grpc.insecure_channel(endpoint, options=options)
        else:
            self.channel = grpc.secure_channel(endpoint, credentials, options=options)
        self.kv = etcdrpc.KVStub(self.channel)
        self.lease = etcdrpc.LeaseStub(self.channel)
        self.watch = etcdrpc.WatchStub(self.channel)
        self.auth = etcdrpc.AuthStub(self.channel)
        self.maintenance = etcdrpc.MaintenanceStub(self.channel)
        self.cluster = etcdrpc.ClusterStub(self.channel)


def _read(path: str | None) -> bytes | None:
    if not path:
        return None
    try:
        with open(path, "rb") as fh:
            return fh.read()
    except OSError as exc:
        raise EtcdError(f"etcd TLS: cannot read {path}: {exc.strerror}") from exc


class EtcdClient:
    """Thread-safe etcd v3 client. Every call either succeeds or raises ``EtcdError``.

    ``clock`` and ``sleep`` are injected so that retry timing can be tested without waits.
    """

    def __init__(
        self,
        config: EtcdConfig,
        *,
        clock: Callable[[], float] = time.monotonic,
        sleep: Callable[[float], None] = time.sleep,
    ) -> None:
        self.config = config
        self._clock = clock
        self._sleep = sleep
        creds = None
        if config.tls:
            creds = grpc.ssl_channel_credentials(
                root_certificates=_read(config.ca_cert),
                private_key=_read(config.key),
                certificate_chain=_read(config.cert),
            )
        self._members = [_Member(ep, creds) for ep in config.endpoints]
        self._current = 0
        self._lock = threading.Lock()
        self._token: str | None = None
        self._closed = False
        self._keeper: Any = None
        self.on_error: Callable[[str, str], None] | None = None
        """Told ``(operation, gRPC code name)`` of every failed attempt (the agent counts
        them in ``elasticd_etcd_request_errors_total``)."""

    # -- plumbing ---------------------------------------------------------------------------

    @property
    def endpoint(self) -> str:
        """The member currently preferred."""
        return self._members[self._current].endpoint

    def member(self) -> _Member:
        with self._lock:
            return self._members[self._current]

    def rotate(self, failed: _Member) -> None:
        """Prefer the next member after ``failed`` did not answer."""
        with self._lock:
            if self._members[self._current] is failed:
                self._current = (self._current + 1) % len(self._members)

    def metadata(self) -> tuple[tuple[str, str], ...]:
        return (("token", self._token),) if self._token else ()

    def _authenticate(self, member: _Member, timeout: float) -> None:
        req = etcdrpc.AuthenticateRequest(name=self.config.user, password=self.config.password)
        self._token = member.auth.Authenticate(req, timeout=timeout).token

    def call(self, what: str, fn: Callable[[_Member, float, tuple], T]) -> T:
        """Run ``fn(member, attempt_timeout, metadata)`` until it succeeds or time runs out."""
        if self._closed:
            raise EtcdError("etcd client is closed")
        deadline = self._clock() + self.config.timeout
        attempt = 0
        last: grpc.RpcError | None = None
        while True:
            member = self.member()
            remaining = deadline - self._clock()
            if remaining <= 0:
                break
            per_try = min(self.config.request_timeout, remaining)
            try:
                if self.config.user and self._token is None:
                    self._authenticate(member, per_try)
                return fn(member, per_try, self.metadata())
            except grpc.RpcError as exc:
                last = exc
                code, detail = exc.code(), (exc.details() or "")
                if self.on_error is not None:
                    # The metric's op label: one word (``lease_keepalive``, as the
                    # keep-alive stream counts its own breaks).
                    self.on_error(what.replace(" ", "_"), getattr(code, "name", str(code)))
                if (
                    code == grpc.StatusCode.INVALID_ARGUMENT
                    and "auth token" in detail
                    and self.config.user
                ):
                    self._token = None  # expired simple token: log in again
                elif code in (
                    grpc.StatusCode.UNAUTHENTICATED,
                    grpc.StatusCode.PERMISSION_DENIED,
                ) or any(t in detail for t in _AUTH_TEXT):
                    raise EtcdAuthError(f"etcd refused {what}: {detail}") from exc
                elif code == grpc.StatusCode.NOT_FOUND and "lease not found" in detail:
                    raise EtcdLeaseNotFound(f"etcd {what}: {detail}") from exc
                elif "database space exceeded" in detail:
                    # etcd's NOSPACE alarm: every write fails until a person acts.
                    raise EtcdError(
                        f"etcd {what} failed: its database is full ({detail}): compact its "
                        "history, defragment it and disarm the NOSPACE alarm (docs/agent.md, "
                        '"etcd out of space")'
                    ) from exc
                elif code in _RETRYABLE or any(t in detail.lower() for t in _RETRYABLE_TEXT):
                    self.rotate(member)
                else:
                    raise EtcdError(f"etcd {what} failed: {code.name}: {detail}") from exc
            attempt += 1
            pause = min(0.05 * 2 ** min(attempt, 5), 1.0, max(0.0, deadline - self._clock()))
            log.debug("etcd retry", **kv(what=what, attempt=attempt, pause=round(pause, 3)))
            self._sleep(pause)
        detail = f"{last.code().name}: {last.details()}" if last is not None else "no attempt"
        raise EtcdUnavailableError(
            f"etcd at {','.join(self.config.endpoints)} did not answer {what} within "
            f"{self.config.timeout:g} s ({detail})"
        ) from last

    # -- key/value --------------------------------------------------------------------------

    def get(self, key: str) -> KeyValue | None:
        req = etcdrpc.RangeRequest(key=key.encode())
        resp = self.call("get", lambda m, t, md: m.kv.Range(req, timeout=t, metadata=md))
        return _kv(resp.kvs[0]) if resp.kvs else None

    def get_prefix(self, prefix: str, revision: int = 0) -> tuple[list[KeyValue], int]:
        """Every key under ``prefix`` (at ``revision`` if given) and the store revision."""
        req = etcdrpc.RangeRequest(key=prefix.encode(), range_end=prefix_end(prefix))
        if revision:
            req.revision = revision
        resp = self.call("range", lambda m, t, md: m.kv.Range(req, timeout=t, metadata=md))
        return [_kv(x) for x in resp.kvs], resp.header.revision

    def put(self, key: str, value: bytes | str, lease: int = 0) -> int:
        data = value.encode() if isinstance(value, str) else value
        req = etcdrpc.PutRequest(key=key.encode(), value=data, lease=lease)
        resp = self.call("put", lambda m, t, md: m.kv.Put(req, timeout=t, metadata=md))
        return resp.header.revision

    def delete(self, key: str, prefix: bool = False) -> int:
        """Delete ``key`` (or every key under it); returns how many were deleted."""
        req = etcdrpc.DeleteRangeRequest(key=key.encode())
        if prefix:
            req.range_end = prefix_end(key)
        resp = self.call("delete", lambda m, t, md: m.kv.DeleteRange(req, timeout=t, metadata=md))
        return resp.deleted

    def txn(
        self, compares: Sequence[Any], success: Sequence[Any], failure: Sequence[Any] = ()
    ) -> TxnResult:
        req = etcdrpc.TxnRequest(
            compare=list(compares), success=list(success), failure=list(failure)
        )
        resp = self.call("txn", lambda m, t, md: m.kv.Txn(req, timeout=t, metadata=md))
        return TxnResult(resp.succeeded, resp.header.revision, tuple(resp.responses))

    # -- leases -----------------------------------------------------------------------------

    def lease_grant(self, ttl: float) -> int:
        req = etcdrpc.LeaseGrantRequest(TTL=max(1, round(ttl)))
        resp = self.call(
            "lease grant", lambda m, t, md: m.lease.LeaseGrant(req, timeout=t, metadata=md)
        )
        if resp.error:
            raise EtcdError(f"etcd lease grant failed: {resp.error}")
        return resp.ID

    def lease_revoke(self, lease: int) -> None:
        req = etcdrpc.LeaseRevokeRequest(ID=lease)

        def revoke(m: _Member, t: float, md: tuple) -> None:
            try:
                m.lease.LeaseRevoke(req, timeout=t, metadata=md)
            except grpc.RpcError as exc:
                if exc.code() != grpc.StatusCode.NOT_FOUND:  # already expired: fine
                    raise

        self.call("lease revoke", revoke)

    def lease_keepalive(self, lease: int) -> int:
        """Refresh ``lease`` once; returns its new TTL, 0 when it no longer exists."""
        req = etcdrpc.LeaseKeepAliveRequest(ID=lease)

        def once(m: _Member, t: float, md: tuple) -> int:
            stream = m.lease.LeaseKeepAlive(iter([req]), timeout=t, metadata=md)
            try:
                for resp in stream:
                    return resp.TTL
                return 0
            finally:
                stream.cancel()

        return self.call("lease keepalive", once)

    # -- cluster ----------------------------------------------------------------------------

    def status(self, endpoint: str | None = None) -> Any:
        """``Maintenance.Status`` of one member (default: the preferred one)."""
        member = next((m for m in self._members if m.endpoint == endpoint), None)
        if endpoint is not None and member is None:
            member = _Member(endpoint, None)
        req = etcdrpc.StatusRequest()
        if member is None:
            return self.call(
                "status", lambda m, t, md: m.maintenance.Status(req, timeout=t, metadata=md)
            )
        try:
            return member.maintenance.Status(
                req, timeout=self.config.request_timeout, metadata=self.metadata()
            )
        except grpc.RpcError as exc:
            raise EtcdUnavailableError(f"etcd member {endpoint} did not answer status") from exc

    def keeper(self) -> Any:
        """The client's ``LeaseKeeper``: one keep-alive stream for all its leases."""
        from elasticd.etcd.lease import LeaseKeeper

        with self._lock:
            if self._keeper is None:
                self._keeper = LeaseKeeper(self)
            return self._keeper

    def close(self) -> None:
        self._closed = True
        if self._keeper is not None:
            self._keeper.close()
        # grpc's channel.close() can block on a stream whose request iterator is still
        # parked; closing must never hang a shutdown, so give each close a bounded wait.
        closers = [
            threading.Thread(target=m.channel.close, name="etcd-close", daemon=True)
            for m in self._members
        ]
        for t in closers:
            t.start()
        for t in closers:
            t.join(timeout=2.0)

    def __enter__(self) -> EtcdClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def connect(config: EtcdConfig, *, check: bool = True) -> EtcdClient:
    """The client factory: a client for ``config``, checked to answer unless ``check=False``.

    Raises ``EtcdUnavailableError`` within ``config.timeout`` when no member answers.
    """
    client = EtcdClient(config)
    if check:
        try:
            client.call(
                "status",
                lambda m, t, md: m.maintenance.Status(
                    etcdrpc.StatusRequest(), timeout=t, metadata=md
                ),
            )
        except BaseException:
            client.close()
            raise
    return client
