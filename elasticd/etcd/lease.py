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

GAP = 1.5
"""Seconds the keeper's thread may go without running before that counts as a gap in
this process's life (it runs every 0.5 s at most, 2 s while it reconnects, with checks
every 0.25 s). A gap longer than a lease's TTL means the lease lapsed meanwhile."""


@dataclass(slots=True)
class _Kept:
    interval: float
    on_lost: Callable[[int], None]
    due: float
    ttl: float = 0.0
    """What it was granted with (0: unknown, taken as three intervals)."""
    answered: float = 0.0
    """When (monotonic) the refresh etcd last answered for it was sent (or it was added)."""


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
        self._active = time.monotonic()
        """When this keeper's thread last ran (it runs at least every ACTIVE_EVERY)."""
        self._gap: tuple[float, float] = (0.0, 0.0)
        """(when it ended, how long) the last time this keeper did not run for longer
        than GAP seconds: the process was frozen (SIGSTOP, a paused VM) or starved."""
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._requests: queue.Queue | None = None
        self._answered = False
        self._thread = threading.Thread(target=self._run, name="etcd-lease-keeper", daemon=True)
        self._thread.start()

    def add(
        self, lease: int, interval: float, on_lost: Callable[[int], None], ttl: float | None = None
    ) -> None:
        """Refresh ``lease`` every ``interval``; ``ttl``: what it was granted with (just
        now), alive that long before any refresh (else one ``interval``)."""
        now = time.monotonic()
        with self._lock:
            self._leases[lease] = _Kept(interval, on_lost, now + interval,
                                        ttl=ttl or 3 * interval, answered=now)  # fmt: skip
        self._wake.set()

    def remove(self, lease: int) -> None:
        with self._lock:
            self._leases.pop(lease, None)

    def alive(self, lease: int) -> bool:
        """Whether ``lease`` may still be alive, judged here without asking etcd. False
        once etcd said it is gone, and while this keeper has not refreshed it for its
        TTL *because this process did not run*: frozen that long (SIGSTOP; whatever stops
        the process but not the monotonic clock, which a suspended host's does not count),
        its lease lapsed while it slept, though nothing here has noticed yet (a thawed
        agent's metrics must not speak for a world that re-formed without it). An etcd
        outage is not such a gap: the keeper keeps trying, and etcd's new leader renews
        every lease when it is back, so the lease is taken as alive meanwhile."""
        now = time.monotonic()
        with self._lock:
            kept = self._leases.get(lease)
            if kept is None:
                return False
            silent = now - self._active
            ended, length = self._gap
        if silent > max(kept.ttl, GAP):  # frozen now: this thread has not run since
            return False
        return not (length > max(kept.ttl, GAP) and ended > kept.answered)

    def _ran(self) -> None:
        """This keeper's thread runs: note a gap since its last run, if one was long."""
        now = time.monotonic()
        with self._lock:
            if now - self._active > GAP:
                self._gap = (now, now - self._active)
            self._active = now

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
                asked = None
                with contextlib.suppress(IndexError):  # answers come in the order asked
                    asked = sent.popleft()
                if resp.TTL > 0 and asked is not None:
                    with self._lock:
                        kept = self._leases.get(resp.ID)
                        if kept is not None:
                            kept.answered = max(kept.answered, asked)
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
            self._ran()
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
                for _ in range(8):  # up to 2 s, running all the while
                    reader.join(timeout=0.25)
                    self._ran()
                    if not reader.is_alive():
                        break
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
            self._ran()

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
            self._ran()
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
