"""A prefix watch that survives member loss: it resumes on another member from the
revision after the last event it delivered, so no event is lost or repeated."""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable
from dataclasses import dataclass

import grpc
from etcd3 import etcdrpc

from elasticd.etcd.client import EtcdClient, KeyValue, _kv, prefix_end
from elasticd.log import kv

log = logging.getLogger("elasticd.etcd")


@dataclass(frozen=True, slots=True)
class Event:
    """One change: ``kind`` is ``put`` or ``delete``; ``kv.value`` is empty for deletes."""

    kind: str
    kv: KeyValue


class Watch:
    """Calls ``on_events(events)`` from a background thread for every change under a prefix.

    ``start_revision`` is the first revision delivered (use the revision of a read plus
    one, so nothing between the read and the watch is missed). ``on_error(exc)`` is called
    if the history was compacted away, which cannot be resumed. Stop with ``cancel()``.
    """

    def __init__(
        self,
        client: EtcdClient,
        prefix: str,
        *,
        start_revision: int,
        on_events: Callable[[list[Event]], None],
        on_error: Callable[[Exception], None] | None = None,
    ) -> None:
        self._client = client
        self._prefix = prefix
        self._next = start_revision
        self._on_events = on_events
        self._on_error = on_error
        self._stop = threading.Event()
        self._stream: grpc.RpcContext | None = None
        self._lock = threading.Lock()
        self.ready = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"etcd-watch {prefix}", daemon=True)
        self._thread.start()

    def _requests(self, create: object, q: queue.Queue) -> object:
        yield create
        # Hold the stream open until cancelled; the server pushes events meanwhile.
        while q.get() is not None:
            pass

    def _run(self) -> None:
        attempt = 0
        while not self._stop.is_set():
            member = self._client.member()
            create = etcdrpc.WatchRequest(
                create_request=etcdrpc.WatchCreateRequest(
                    key=self._prefix.encode(),
                    range_end=prefix_end(self._prefix),
                    start_revision=self._next,
                )
            )
            q: queue.Queue = queue.Queue()
            # "hasleader" makes a member that lost its leader cancel the stream instead of
            # going silent, so a partitioned member cannot hide a lost lease from us.
            metadata = (*self._client.metadata(), ("hasleader", "true"))
            try:
                stream = member.watch.Watch(self._requests(create, q), metadata=metadata)
                with self._lock:
                    if self._stop.is_set():
                        stream.cancel()
                        q.put(None)
                        return
                    self._stream = stream
                for resp in stream:
                    if resp.created:
                        self.ready.set()
                        attempt = 0
                    if resp.compact_revision:
                        raise _Compacted(resp.compact_revision)
                    if resp.canceled:
                        raise grpc.RpcError(f"watch cancelled: {resp.cancel_reason}")
                    if resp.events:
                        events = [
                            Event("delete" if e.type == 1 else "put", _kv(e.kv))
                            for e in resp.events
                        ]
                        self._next = resp.events[-1].kv.mod_revision + 1
                        try:
                            self._on_events(events)
                        except Exception:
                            log.exception("watch callback failed")
                raise grpc.RpcError("watch stream ended")
            except _Compacted as exc:
                q.put(None)
                if self._on_error is not None:
                    self._on_error(exc)
                return
            except grpc.RpcError as exc:
                q.put(None)
                if self._stop.is_set():
                    return
                code = exc.code().name if hasattr(exc, "code") else str(exc)
                log.debug("watch reconnecting", **kv(endpoint=member.endpoint, why=code))
                self._client.rotate(member)
                attempt += 1
                self._stop.wait(min(0.05 * 2 ** min(attempt, 5), 1.0))

    def cancel(self) -> None:
        self._stop.set()
        with self._lock:
            if self._stream is not None:
                self._stream.cancel()
        self._thread.join(timeout=5)


class _Compacted(Exception):
    def __init__(self, revision: int) -> None:
        super().__init__(f"watch history compacted at revision {revision}")
        self.revision = revision
