"""The two watches that feed a node's ``Mirror``: ``state/`` always, ``join/`` on demand.

Why two: with one watch on the whole run every node sees every join, so forming a world
of N nodes pushes N x N events through the nodes. The ``state/`` directory holds only the
world, the closed flag and the closer keys, so it stays quiet while a round fills; only
the round's closer and the members of a running world need ``join/``.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

from elasticd.errors import EtcdError
from elasticd.etcd.client import EtcdClient
from elasticd.etcd.watch import Event, Watch
from elasticd.log import kv
from elasticd.rendezvous.errors import RendezvousConnection
from elasticd.rendezvous.mirror import Mirror

log = logging.getLogger("elasticd.rendezvous")


class Feeds:
    """Starts, stops and resyncs the watches behind ``mirror``; ``on_events(feed)`` is
    called (from the watch thread) after each batch a live watch applied."""

    def __init__(
        self,
        *,
        client: EtcdClient,
        mirror: Mirror,
        on_events: Callable[[str], None],
        on_resynced: Callable[[], None],
    ) -> None:
        self._client = client
        self._mirror = mirror
        self._on_events = on_events
        self._on_resynced = on_resynced
        self._lock = threading.Lock()
        self._watches: dict[str, Watch | None] = {"state": None, "join": None}

    def _prefix(self, feed: str) -> str:
        s = self._mirror.settings
        return s.state_prefix if feed == "state" else s.joins_prefix

    def _open(self, feed: str) -> None:
        """Read ``feed``'s directory once and watch it from just after that read."""
        prefix = self._prefix(feed)
        try:
            kvs, revision = self._client.get_prefix(prefix)
        except EtcdError as exc:
            raise RendezvousConnection(str(exc)) from exc
        generation = self._mirror.load(feed, kvs, revision)

        def on_events(events: list[Event]) -> None:
            if self._mirror.apply(feed, generation, events):
                self._on_events(feed)

        watch = Watch(
            self._client,
            prefix,
            start_revision=revision + 1,
            on_events=on_events,
            on_error=self._on_watch_lost,
        )
        self._watches[feed] = watch
        if not watch.ready.wait(self._client.config.timeout):
            raise RendezvousConnection(f"etcd watch on {prefix} did not start")

    def start(self) -> None:
        """Watch ``state/`` (idempotent)."""
        with self._lock:
            if self._watches["state"] is None:
                self._open("state")

    def members_on(self) -> None:
        """Watch ``join/`` too (idempotent)."""
        with self._lock:
            if self._watches["join"] is None:
                self._open("join")

    def members_off(self) -> None:
        """Stop watching ``join/`` (idempotent); the mirror forgets the joins at once."""
        with self._lock:
            watch, self._watches["join"] = self._watches["join"], None
            if watch is None:
                return
            self._mirror.drop("join")
        # Cancelling waits for the stream to end: do it aside, its events are stale now.
        threading.Thread(target=watch.cancel, name="rdzv-unwatch", daemon=True).start()

    def close(self) -> None:
        with self._lock:
            watches = [w for w in self._watches.values() if w is not None]
            self._watches = {"state": None, "join": None}
        for watch in watches:
            watch.cancel()

    def _on_watch_lost(self, exc: Exception) -> None:
        """The history we needed was compacted (a long disconnection): read afresh."""
        log.warning("rendezvous watch lost its history; resyncing", **kv(error=str(exc)))

        def resync() -> None:
            with self._lock:
                old = {f: w for f, w in self._watches.items() if w is not None}
                self._watches = {"state": None, "join": None}
                for feed in old:
                    self._mirror.drop(feed)
            for watch in old.values():
                watch.cancel()
            try:
                with self._lock:
                    for feed in old:
                        self._open(feed)
                self._on_resynced()
            except Exception:
                log.exception("rendezvous resync failed")

        threading.Thread(target=resync, name="rdzv-resync", daemon=True).start()
