"""A local, watch-fed copy of one run's rendezvous keys.

The handler never polls etcd for the state of a round: it reads the run's prefix once,
then applies every watch event to this mirror and wakes whoever waits on ``cond``.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

from elasticd.etcd.client import KeyValue
from elasticd.etcd.watch import Event
from elasticd.rendezvous.decisions import (
    Member,
    RendezvousSettings,
    World,
    parse_join_key,
    parse_member,
    parse_world,
)
from elasticd.rendezvous.errors import RendezvousState


class Mirror:
    """The run's keys as of ``revision``, with the derived facts the handler needs."""

    def __init__(
        self, settings: RendezvousSettings, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.settings = settings
        self.cond = threading.Condition()
        self.kvs: dict[str, KeyValue] = {}
        self.revision = 0
        self.world: World | None = None
        self.world_mod = 0
        self.world_error: RendezvousState | None = None
        self.seq_seen: dict[int, float] = {}
        self._clock = clock

    def load(self, kvs: list[KeyValue], revision: int) -> None:
        with self.cond:
            for item in kvs:
                self._set(item)
            self.revision = max(self.revision, revision)
            self.cond.notify_all()

    def apply(self, events: list[Event]) -> None:
        with self.cond:
            for ev in events:
                if ev.kind == "delete":
                    self.kvs.pop(ev.kv.key, None)
                    if ev.kv.key == self.settings.world_key():
                        self.world, self.world_mod = None, 0
                else:
                    self._set(ev.kv)
                self.revision = max(self.revision, ev.kv.mod_revision)
            self.cond.notify_all()

    def _set(self, item: KeyValue) -> None:
        s = self.settings
        self.kvs[item.key] = item
        if item.key == s.world_key():
            self.world_mod = item.mod_revision
            try:
                self.world = parse_world(item.value, item.mod_revision)
                self.world_error = None
            except RendezvousState as exc:
                self.world, self.world_error = None, exc
        elif item.key.startswith(s.run_prefix + "seq/"):
            tail = item.key.rsplit("/", 1)[-1]
            if tail.isdigit():
                # When *we* saw the latest join: the settle timer is local, so clocks of
                # different nodes never need to agree.
                self.seq_seen[int(tail)] = self._clock()

    # -- derived facts (call with cond held) ------------------------------------------------

    @property
    def closed(self) -> bool:
        return self.settings.closed_key() in self.kvs

    def open_round(self) -> int:
        return (self.world.round if self.world else 0) + 1

    def joins(self, round_: int) -> dict[str, tuple[int, Member]]:
        """``node -> (join revision, member)`` for the live joins of ``round_``."""
        out: dict[str, tuple[int, Member]] = {}
        prefix = self.settings.join_prefix(round_)
        for key, item in self.kvs.items():
            if key.startswith(prefix):
                parsed = parse_join_key(self.settings, key)
                if parsed is not None:
                    out[parsed[1]] = (item.create_revision, parse_member(parsed[1], item.value))
        return out

    def joined_nodes(self, round_: int) -> set[str]:
        prefix = self.settings.join_prefix(round_)
        return {k[len(prefix) :] for k in self.kvs if k.startswith(prefix)}

    def seq_mod(self, round_: int) -> int:
        item = self.kvs.get(self.settings.seq_key(round_))
        return item.mod_revision if item else 0

    def since_last_join(self, round_: int) -> float:
        seen = self.seq_seen.get(round_)
        return float("inf") if seen is None else self._clock() - seen
