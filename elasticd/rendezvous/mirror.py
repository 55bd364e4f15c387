"""A local, watch-fed copy of one run's rendezvous keys.

The handler never polls etcd for the state of a round: it reads a directory once, then
applies every watch event to this mirror and wakes whoever waits on ``cond``. Two
directories feed it, each through its own watch: ``state/`` (always) and ``join/`` (only
while this node closes a round or is a member of a running world; ``members_live``).
Each feed has a generation, so events from a watch that was switched off are ignored.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Collection, KeysView

from elasticd.etcd.client import KeyValue
from elasticd.etcd.watch import Event
from elasticd.log import kv
from elasticd.rendezvous.decisions import (
    EVIDENCE_MARK,
    LEAVING_MARK,
    Member,
    RendezvousSettings,
    World,
    parse_closer,
    parse_closer_key,
    parse_join_key,
    parse_member,
    parse_world,
)
from elasticd.rendezvous.errors import RendezvousState

log = logging.getLogger("elasticd.rendezvous")


class Mirror:
    """The run's keys as of ``revision``, with the derived facts the handler needs."""

    def __init__(
        self, settings: RendezvousSettings, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.settings = settings
        self.cond = threading.Condition()
        self.kvs: dict[str, KeyValue] = {}
        self.revision = {"state": 0, "join": 0}
        """The revision each feed is known up to."""
        self.generation = {"state": 0, "join": 0}
        self.members_live = False
        """Whether the ``join/`` feed is on (else ``rounds`` is empty and means nothing)."""
        self.closers: dict[int, tuple[str, int]] = {}
        """``round -> (node, lease)`` of each round's closer."""
        self.world: World | None = None
        self.world_mod = 0
        self.world_error: RendezvousState | None = None
        self.join_seen: dict[int, float] = {}
        self.evidence_seen: dict[int, dict[str, float]] = {}
        """``round -> node -> when we saw its first evidence join`` (local clock)."""
        self.join_mod: dict[int, int] = {}
        self.rounds: dict[int, dict[str, tuple[int, bytes]]] = {}
        self.gone: dict[int, set[str]] = {}
        """``round -> nodes whose join of it this mirror saw deleted``: a member missing
        from ``rounds`` is known gone only if it is here, or once the join feed has caught
        up with the world (the feeds are separate watches; see :meth:`absent`)."""
        self.wake_when: Callable[[], bool] | None = None
        self._clock = clock

    def drop(self, feed: str) -> None:
        """Forget one feed's keys (its watch is being switched off or restarted)."""
        with self.cond:
            self.generation[feed] += 1
            self.revision[feed] = 0
            head = self.settings.joins_prefix if feed == "join" else self.settings.state_prefix
            for key in [k for k in self.kvs if k.startswith(head)]:
                del self.kvs[key]
            if feed == "join":
                self.members_live = False
                self.rounds.clear()
                self.gone.clear()
                self.join_mod.clear()
                self.join_seen.clear()
                self.evidence_seen.clear()
            else:
                self.closers.clear()
                self.world, self.world_mod, self.world_error = None, 0, None
            self.cond.notify_all()

    def load(self, feed: str, kvs: list[KeyValue], revision: int) -> int:
        """Install a fresh read of one feed's directory; returns the generation its watch
        must pass to ``apply``."""
        with self.cond:
            self.generation[feed] += 1
            for item in kvs:
                self._set(item)
            self.revision[feed] = max(self.revision[feed], revision)
            if feed == "join":
                self.members_live = True
            self.cond.notify_all()
            return self.generation[feed]

    def apply(self, feed: str, generation: int, events: list[Event]) -> bool:
        """Apply one watch batch; False (and nothing applied) if that watch is stale."""
        with self.cond:
            if generation != self.generation[feed]:
                return False
            important = feed == "state"
            for ev in events:
                if ev.kind == "delete":
                    self._delete(ev.kv.key)
                    important = True
                else:
                    self._set(ev.kv)
                    # A member marked leaving is excused at once: a closer waiting for it
                    # must look again now (else up to its 1 s wait later).
                    important = important or LEAVING_MARK in ev.kv.value
                self.revision[feed] = max(self.revision[feed], ev.kv.mod_revision)
            # Waking a waiter costs a thread switch; a plain join wakes it only when its
            # predicate says the join can matter.
            if important or self.wake_when is None or self.wake_when():
                self.cond.notify_all()
            return True

    def _delete(self, key: str) -> None:
        self.kvs.pop(key, None)
        if key == self.settings.world_key():
            self.world, self.world_mod = None, 0
            return
        closer_round = parse_closer_key(self.settings, key)
        if closer_round is not None:
            self.closers.pop(closer_round, None)
            return
        parsed = parse_join_key(self.settings, key)
        if parsed is not None:
            members = self.rounds.get(parsed[0], {})
            members.pop(parsed[1], None)
            if not members:
                self.rounds.pop(parsed[0], None)
            self.gone.setdefault(parsed[0], set()).add(parsed[1])

    def _set(self, item: KeyValue) -> None:
        s = self.settings
        self.kvs[item.key] = item
        parsed = parse_join_key(s, item.key)
        if parsed is not None:
            # Indexed per round as events arrive, so that judging a round of N nodes costs
            # O(1) per wake-up rather than a scan and N JSON parses.
            # The record is parsed only when a round is closed from it (``joins``).
            self.rounds.setdefault(parsed[0], {})[parsed[1]] = (item.create_revision, item.value)
            self.gone.get(parsed[0], set()).discard(parsed[1])
            self.join_mod[parsed[0]] = max(self.join_mod.get(parsed[0], 0), item.mod_revision)
            # When *we* saw the latest join: the settle timer is local, so clocks of
            # different nodes never need to agree.
            self.join_seen[parsed[0]] = self._clock()
            if EVIDENCE_MARK in item.value:
                self.evidence_seen.setdefault(parsed[0], {}).setdefault(
                    parsed[1], self.join_seen[parsed[0]]
                )
        elif (closer_round := parse_closer_key(s, item.key)) is not None:
            self.closers[closer_round] = (parse_closer(item.value), item.lease)
        elif item.key == s.world_key():
            self.world_mod = item.mod_revision
            try:
                self.world = parse_world(item.value, item.mod_revision)
                self.world_error = None
            except RendezvousState as exc:
                self.world, self.world_error = None, exc
            if self.world is not None:  # older rounds are never judged again
                for r in [r for r in self.gone if r < self.world.round]:
                    del self.gone[r]

    # -- derived facts (call with cond held) ------------------------------------------------

    @property
    def closed(self) -> bool:
        return self.settings.closed_key() in self.kvs

    def open_round(self) -> int:
        return (self.world.round if self.world else 0) + 1

    def joins(self, round_: int) -> dict[str, tuple[int, Member]]:
        """``node -> (join revision, member)`` for the live joins of ``round_``; a
        malformed record is left out (and logged), never fatal."""
        out: dict[str, tuple[int, Member]] = {}
        for node, (revision, raw) in self.rounds.get(round_, {}).items():
            try:
                out[node] = (revision, parse_member(node, raw))
            except RendezvousState as exc:
                log.warning("ignoring a malformed join record", **kv(node=node, error=str(exc)))
        return out

    def joined_nodes(self, round_: int) -> KeysView[str]:
        """The nodes with a live join in ``round_`` (a live view: do not keep it)."""
        return self.rounds.get(round_, {}).keys()

    def leaving(self, round_: int) -> set[str]:
        """The nodes whose live join of ``round_`` says they are leaving (preempted)."""
        return {n for n, (_, raw) in self.rounds.get(round_, {}).items() if LEAVING_MARK in raw}

    def absent(self, world: World) -> set[str]:
        """Members of ``world`` known to have no live join of its round: their join was
        seen deleted, or the join feed has caught up with the world's revision and shows
        none. The world comes from the state feed, a separate watch, and may arrive before
        the joins it was closed from: a member whose join is merely not seen yet is not
        absent (reporting it lost would end a healthy world at once)."""
        live = self.rounds.get(world.round, {})
        missing = {n for n in world.nodes if n not in live}
        if self.revision["join"] >= world.revision:
            return missing
        return missing & self.gone.get(world.round, set())

    def last_join_mod(self, round_: int) -> int:
        """The highest mod_revision of any join of ``round_`` seen (the close fence)."""
        return self.join_mod.get(round_, 0)

    def since_evidence(self, round_: int, of: Collection[str] | None) -> float | None:
        """Seconds since the first evidence join of ``round_`` by one of the nodes ``of``
        was seen (None: none yet; ``of`` None: by any node). The closer passes the previous
        world's members for the grace: only
        they can have seen that world fail. A node's evidence is of the round it failed
        in; one left out of the world since (its back-off outlasted the grace, and the
        others re-formed without it) still carries it, and counted, it let that node close
        a world of its own while the one that left it out trained on."""
        seen = self.evidence_seen.get(round_, {})
        times = [t for node, t in seen.items() if of is None or node in of]
        return self._clock() - min(times) if times else None

    def since_last_join(self, round_: int) -> float:
        seen = self.join_seen.get(round_)
        return float("inf") if seen is None else self._clock() - seen
