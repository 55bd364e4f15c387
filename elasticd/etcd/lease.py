"""Keep many leases alive over one ``LeaseKeepAlive`` stream per client.

One stream per client (rather than one RPC per refresh) keeps refreshes cheap and on
time when a process holds many leases (tests and benchmarks simulate hundreds of nodes
in a few processes) and when the machine is busy: a late refresh is a lost lease.
"""

from __future__ import annotations

import collections
import contextlib
import logging
import queue
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import grpc
from etcd3 import etcdrpc

from elasticd.log import kv

log = logging.getLogger("elasticd.etcd")


@dataclass(slots=True)
class _Kept:
    interval: float
    on_lost: Callable[[int], None]
    due: float


class LeaseKeeper:
    """Refreshes registered leases every ``interval``; calls ``on_lost(lease)`` once when
    etcd answers that a lease no longer exists. Reconnects to another member on error, and
    when a refresh goes unanswered for :meth:`_answer_limit`: a member that is frozen or cut
    off keeps its stream open without a word (the kernel still holds the socket), and the
    stream would wait on it for good while the lease ran out on the healthy members (the
    agent left the cluster, silently)."""

    def __init__(self, client: object) -> None:
        self._client = client
        self._leases: dict[int, _Kept] = {}
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._requests: queue.Queue | None = None
        self._answered = False
        self._thread = threading.Thread(target=self._run, name="etcd-lease-keeper", daemon=True)
        self._thread.start()

    def add(self, lease: int, interval: float, on_lost: Callable[[int], None]) -> None:
        with self._lock:
            self._leases[lease] = _Kept(interval, on_lost, time.monotonic() + interval)
        self._wake.set()

    def remove(self, lease: int) -> None:
        with self._lock:
            self._leases.pop(lease, None)

    def close(self) -> None:
        self._stop.set()
        self._wake.set()
        q = self._requests
        if q is not None:
            q.put(None)
        self._thread.join(timeout=5)

    def _stream_requests(self, q: queue.Queue) -> Iterator[object]:
        while True:
            item = q.get()
            if item is None:
                return
            yield item

    def _read(self, stream: object, q: queue.Queue, sent: collections.deque) -> None:
        try:
            for resp in stream:  # type: ignore[attr-defined]
                self._answered = True
                with contextlib.suppress(IndexError):  # answers come in the order asked
                    sent.popleft()
                if resp.TTL <= 0:
                    with self._lock:
                        kept = self._leases.pop(resp.ID, None)
                    if kept is not None:
                        log.warning("lease lost", **kv(lease=f"{resp.ID:x}"))
                        try:
                            kept.on_lost(resp.ID)
                        except Exception:
                            log.exception("lease-lost callback failed")
        except grpc.RpcError as exc:
            if not self._stop.is_set():
                log.debug(
                    "lease stream broke", **kv(why=exc.code().name if hasattr(exc, "code") else exc)
                )
        finally:
            q.put(None)

    def _run(self) -> None:
        attempt = 0
        while not self._stop.is_set():
            member = self._client.member()  # type: ignore[attr-defined]
            q: queue.Queue = queue.Queue()
            self._requests = q
            self._answered = False
            # This stream's refreshes not answered yet (send times, oldest first): its own,
            # so a late answer read on a stream given up clears nothing of the next.
            sent: collections.deque = collections.deque()
            with self._lock:  # a new stream: refresh at once, whatever the last one sent
                for kept in self._leases.values():
                    kept.due = min(kept.due, time.monotonic())
            try:
                stream = member.lease.LeaseKeepAlive(
                    self._stream_requests(q),
                    metadata=self._client.metadata(),  # type: ignore[attr-defined]
                )
            except grpc.RpcError:
                stream = None
            if stream is not None:
                reader = threading.Thread(target=self._read, args=(stream, q, sent),
                                          daemon=True)  # fmt: skip
                reader.start()
                why = self._pump(q, reader, sent)
                stream.cancel()
                reader.join(timeout=2)
            else:
                why = "UNAVAILABLE"
            if self._stop.is_set():
                return
            if why == "DEADLINE_EXCEEDED":
                log.warning("lease refresh unanswered; trying another member",
                            **kv(member=member.endpoint, waited_s=round(self._answer_limit(), 2)))  # fmt: skip
            on_error = getattr(self._client, "on_error", None)
            if on_error is not None:  # counted like a failed request (agent metrics)
                on_error("lease_keepalive", why)
            self._client.rotate(member)  # type: ignore[attr-defined]
            # A stream that was answered broke now: start the back-off afresh. Short
            # pauses, because a lease waits for nobody: once etcd is back (a new leader
            # renews every lease for one TTL), the next refresh must get through within
            # that TTL, and each try of a member still down costs one pause.
            attempt = 1 if self._answered else attempt + 1
            self._stop.wait(min(0.05 * 2 ** min(attempt, 5), 0.5))

    def _answer_limit(self) -> float:
        """How long a refresh may go unanswered before the member is given up: the client's
        request timeout, and no longer than the shortest refresh interval (a lease's TTL
        is about three intervals: one to notice, one to refresh through another member),
        but at least 0.5 s (a loaded machine answers late, not never)."""
        with self._lock:
            shortest = min((k.interval for k in self._leases.values()), default=None)
        config = getattr(self._client, "config", None)
        limit = float(getattr(config, "request_timeout", 2.0))
        if shortest is not None:
            limit = min(limit, shortest)
        return max(0.5, limit)

    def _pump(self, q: queue.Queue, reader: threading.Thread, sent: collections.deque) -> str:
        """Send refreshes as they fall due, until the stream breaks (``STREAM_BROKEN``), a
        refresh goes unanswered too long (``DEADLINE_EXCEEDED``) or we stop."""
        while not self._stop.is_set() and reader.is_alive():
            now = time.monotonic()
            with contextlib.suppress(IndexError):
                if now - sent[0] > self._answer_limit():
                    return "DEADLINE_EXCEEDED"
            with self._lock:
                due = [lid for lid, k in self._leases.items() if k.due <= now]
                for lid in due:
                    self._leases[lid].due = now + self._leases[lid].interval
                nxt = min((k.due for k in self._leases.values()), default=now + 1.0)
            for lid in due:
                sent.append(now)
                q.put(etcdrpc.LeaseKeepAliveRequest(ID=lid))
            self._wake.wait(max(0.01, min(nxt - time.monotonic(), 0.1 if sent else 0.5)))
            self._wake.clear()
        return "STREAM_BROKEN"
