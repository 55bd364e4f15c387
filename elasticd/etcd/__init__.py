"""etcd v3 access: a retrying client, a resumable watch, and an embedded server manager.

- :func:`connect` / :class:`EtcdClient` — endpoints, TLS, user/password, timeouts, retries
  across members with backoff; every failure is an ``EtcdError``.
- :class:`Watch` — a prefix watch that resumes on another member without losing events.
- :class:`EmbeddedEtcd` / :class:`EtcdCluster` — etcd as child processes on loopback.
"""

from elasticd.etcd.client import (
    EtcdAuthError,
    EtcdClient,
    EtcdLeaseNotFound,
    EtcdUnavailableError,
    KeyValue,
    TxnResult,
    compare,
    connect,
    delete_op,
    get_op,
    put_op,
)
from elasticd.etcd.config import EtcdConfig, config_from_options, parse_endpoints
from elasticd.etcd.server import (
    EmbeddedEtcd,
    EtcdCluster,
    ServerTLS,
    find_etcd_binary,
    free_port,
    release_ports,
    reserve_port,
)
from elasticd.etcd.watch import Event, Watch

__all__ = [
    "EmbeddedEtcd",
    "EtcdAuthError",
    "EtcdClient",
    "EtcdCluster",
    "EtcdConfig",
    "EtcdLeaseNotFound",
    "EtcdUnavailableError",
    "Event",
    "KeyValue",
    "ServerTLS",
    "TxnResult",
    "Watch",
    "compare",
    "config_from_options",
    "connect",
    "delete_op",
    "find_etcd_binary",
    "free_port",
    "get_op",
    "parse_endpoints",
    "put_op",
    "release_ports",
    "reserve_port",
]
