"""A fenced ``RendezvousBackend`` on etcd v3 for torch's DynamicRendezvousHandler
(torchrun backend ``etcd-v3-dynamic``), and the c10d ``Store`` that goes with it.

The token is the state key's etcd ``mod_revision``; ``set_state`` is one transaction that
compares it. The state itself is torch's opaque blob (torch pickles its own
``_RendezvousState``); we never decode it, and store it base64 inside a JSON envelope so
that a corrupt value is detected before torch sees it.
"""

from __future__ import annotations

import base64
import binascii
import json
import threading
import time
from datetime import timedelta

import torch.distributed as dist
from torch.distributed.elastic.rendezvous import RendezvousParameters
from torch.distributed.elastic.rendezvous.dynamic_rendezvous import RendezvousBackend

from elasticd.errors import EtcdError
from elasticd.etcd.client import EtcdClient, compare, put_op
from elasticd.etcd.watch import Watch
from elasticd.rendezvous.torch_handler import TorchRendezvousConnection as RendezvousConnection
from elasticd.rendezvous.torch_handler import TorchRendezvousState as RendezvousState

Token = object


def _encode(state: bytes) -> bytes:
    return json.dumps({"version": 1, "state": base64.b64encode(state).decode()}).encode()


def _decode(raw: bytes, key: str) -> bytes:
    try:
        doc = json.loads(raw)
        if not isinstance(doc, dict) or doc.get("version") != 1:
            raise ValueError("not a version 1 envelope")
        return base64.b64decode(doc["state"], validate=True)
    except (ValueError, KeyError, TypeError, binascii.Error) as exc:
        raise RendezvousState(f"rendezvous state at {key} is corrupt: {exc}") from exc


class EtcdRendezvousBackend(RendezvousBackend):
    """Stores the rendezvous state of one run at ``<prefix>/<run_id>/dynamic/state``."""

    def __init__(self, client: EtcdClient, run_id: str, prefix: str = "/elasticd/rdzv") -> None:
        if not run_id or "/" in run_id:
            raise ValueError(f"run id {run_id!r} must be non-empty without '/'")
        self._client = client
        self.key = f"{prefix.rstrip('/')}/{run_id}/dynamic/state"

    @property
    def name(self) -> str:
        return "etcd-v3-dynamic"

    def get_state(self) -> tuple[bytes, Token] | None:
        try:
            item = self._client.get(self.key)
        except EtcdError as exc:
            raise RendezvousConnection(str(exc)) from exc
        if item is None:
            return None
        return _decode(item.value, self.key), item.mod_revision

    def set_state(
        self, state: bytes, token: Token | None = None
    ) -> tuple[bytes, Token, bool] | None:
        if token is None:
            fence = compare(self.key, "create", "==", 0)  # only if absent
        elif isinstance(token, int) and not isinstance(token, bool) and token > 0:
            fence = compare(self.key, "mod", "==", token)
        else:
            return self._current_or_none()
        try:
            result = self._client.txn([fence], [put_op(self.key, _encode(state))])
        except EtcdError as exc:
            raise RendezvousConnection(str(exc)) from exc
        if result.succeeded:
            # A put's mod_revision is the transaction's revision.
            return state, result.revision, True
        return self._current_or_none()

    def _current_or_none(self) -> tuple[bytes, Token, bool] | None:
        current = self.get_state()
        if current is None:
            return None
        return current[0], current[1], False


class EtcdStore(dist.Store):
    """A c10d ``Store`` on etcd: blocking ``get``/``wait`` are woken by a watch."""

    def __init__(
        self, client: EtcdClient, prefix: str, timeout: timedelta = timedelta(seconds=300)
    ) -> None:
        super().__init__()
        self._client = client
        self._prefix = prefix.rstrip("/") + "/"
        self.set_timeout(timeout)

    def _key(self, key: str) -> str:
        return self._prefix + key

    def set(self, key: str, value: bytes | str) -> None:
        data = value.encode() if isinstance(value, str) else bytes(value)
        self._client.put(self._key(key), data)

    def get(self, key: str) -> bytes:
        self.wait([key])
        item = self._client.get(self._key(key))
        if item is None:  # deleted between the wait and the read
            raise LookupError(f"store key {key!r} vanished")
        return item.value

    def add(self, key: str, amount: int) -> int:
        full = self._key(key)
        while True:
            item = self._client.get(full)
            value = (int(item.value) if item else 0) + int(amount)
            fence = (
                compare(full, "mod", "==", item.mod_revision)
                if item
                else compare(full, "create", "==", 0)
            )
            if self._client.txn([fence], [put_op(full, str(value))]).succeeded:
                return value

    def compare_set(self, key: str, expected: bytes | str, desired: bytes | str) -> bytes:
        full = self._key(key)
        exp = expected.encode() if isinstance(expected, str) else bytes(expected)
        want = desired.encode() if isinstance(desired, str) else bytes(desired)
        fence = compare(full, "value", "==", exp) if exp else compare(full, "create", "==", 0)
        result = self._client.txn([fence], [put_op(full, want)])
        if result.succeeded:
            return want
        item = self._client.get(full)
        return item.value if item else exp

    def check(self, keys: list[str]) -> bool:
        return all(self._client.get(self._key(k)) is not None for k in keys)

    def delete_key(self, key: str) -> bool:
        return self._client.delete(self._key(key)) > 0

    def num_keys(self) -> int:
        items, _ = self._client.get_prefix(self._prefix)
        return len(items)

    def wait(self, keys: list[str], timeout: timedelta | None = None) -> None:
        budget = (timeout or self.timeout).total_seconds()
        missing = {self._key(k) for k in keys}
        arrived = threading.Event()
        lock = threading.Lock()

        def on_events(events: list) -> None:
            with lock:
                for ev in events:
                    if ev.kind == "put":
                        missing.discard(ev.kv.key)
                if not missing:
                    arrived.set()

        items, revision = self._client.get_prefix(self._prefix)
        with lock:
            missing.difference_update(i.key for i in items)
            if not missing:
                return
        watch = Watch(self._client, self._prefix, start_revision=revision + 1, on_events=on_events)
        try:
            deadline = time.monotonic() + budget
            if not arrived.wait(max(0.0, deadline - time.monotonic())):
                raise TimeoutError(f"store keys {sorted(missing)} not set within {budget:g} s")
        finally:
            watch.cancel()


def create_backend(params: RendezvousParameters) -> tuple[EtcdRendezvousBackend, dist.Store]:
    """``(backend, store)`` for DynamicRendezvousHandler, like torch's c10d ``create_backend``.

    ``params.endpoint`` names the etcd members (``host:port[,host:port]``); etcd TLS, auth
    and timeout options come from ``--rdzv-conf`` (see ``elasticd.rendezvous.params``).
    """
    from elasticd.rendezvous.params import etcd_config_from_params, settings_from_params

    settings = settings_from_params(params)
    try:
        client = EtcdClient(etcd_config_from_params(params))
        client.status()
    except EtcdError as exc:
        raise RendezvousConnection(str(exc)) from exc
    backend = EtcdRendezvousBackend(client, settings.run_id, settings.prefix)
    store = EtcdStore(
        client,
        f"{settings.run_prefix}dynamic/store",
        timeout=timedelta(seconds=settings.join_timeout),
    )
    return backend, store
