"""The native etcd v3 rendezvous, torch-free (``torch_handler`` adapts it to torchrun).

The agent's API is documented in ``elasticd.rendezvous`` and docs/rendezvous.md.

How a round works: a node joins the open round r (= last world's round + 1) by putting
``join/<r>/<node>`` on its lease, fenced by a compare on the world key, so it cannot join
a round that just closed. Every participant mirrors the run's keys through one watch and
evaluates the pure close rule (``decisions.close_delay``); the first whose timer fires
writes the world in one transaction fenced on the world key and on "no join key of round
r changed since I looked" (a range compare); the others'
transactions fail harmlessly and everyone learns the world from the watch. Members keep
their join key (and lease) while the world runs: its deletion — lease expiry after a
crash, a revoke on leave, or a move to the next round — is pushed to every survivor.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
import uuid
from collections.abc import Callable

from elasticd.errors import EtcdError
from elasticd.etcd.client import (
    EtcdClient,
    EtcdLeaseNotFound,
    compare,
    compare_range,
    delete_op,
    put_op,
)
from elasticd.etcd.server import free_port
from elasticd.etcd.watch import Watch
from elasticd.log import kv
from elasticd.rendezvous.decisions import (
    Change,
    Member,
    RendezvousSettings,
    World,
    build_world,
    close_delay,
    member_json,
    pending_previous,
    world_changes,
)
from elasticd.rendezvous.errors import RendezvousClosed, RendezvousConnection, RendezvousTimeout
from elasticd.rendezvous.mirror import Mirror

log = logging.getLogger("elasticd.rendezvous")


class EtcdRendezvous:
    """Event-driven world formation on etcd leases, watches and transactions."""

    def __init__(
        self,
        *,
        client: EtcdClient,
        settings: RendezvousSettings,
        node_id: str | None = None,
        addr: str = "127.0.0.1",
        on_change: Callable[[Change], None] | None = None,
        clock: Callable[[], float] = time.monotonic,
        owns_client: bool = False,
    ) -> None:
        self.settings = settings
        self.node_id = node_id or f"{addr}_{uuid.uuid4().hex[:8]}"
        self.addr = addr
        self.on_change = on_change
        self.changed = threading.Event()
        self._client = client
        self._owns_client = owns_client
        self._clock = clock
        self._mirror = Mirror(settings, clock)
        self._watch: Watch | None = None
        self._lease = 0
        self._joined_round = 0
        self._current: World | None = None
        self._current_nodes: frozenset[str] = frozenset()
        self._reported: set[tuple[str, str]] = set()
        self._start_lock = threading.Lock()

    # -- lifecycle ----------------------------------------------------------------------------

    def start(self) -> None:
        """Read the run's keys once and start watching them (idempotent)."""
        with self._start_lock:
            if self._watch is not None:
                return
            try:
                kvs, revision = self._client.get_prefix(self.settings.run_prefix)
            except EtcdError as exc:
                raise RendezvousConnection(str(exc)) from exc
            self._mirror.load(kvs, revision)
            self._watch = Watch(
                self._client,
                self.settings.run_prefix,
                start_revision=revision + 1,
                on_events=self._on_events,
                on_error=self._on_watch_lost,
            )
            if not self._watch.ready.wait(self._client.config.timeout):
                raise RendezvousConnection(
                    f"etcd watch on {self.settings.run_prefix} did not start"
                )

    def _ensure_lease(self) -> int:
        if self._lease:
            return self._lease
        lease = self._client.lease_grant(self.settings.ttl)
        self._client.keeper().add(lease, self.settings.keepalive, self._on_lease_lost)
        self._lease = lease
        return lease

    def _on_lease_lost(self, lease: int) -> None:
        with self._mirror.cond:
            if lease != self._lease:
                return
            self._lease = 0
            self._mirror.cond.notify_all()
        self._check_change()

    def _on_watch_lost(self, exc: Exception) -> None:
        """The history we needed was compacted (a long disconnection): read afresh."""
        log.warning("rendezvous watch lost its history; resyncing", **kv(error=str(exc)))

        def resync() -> None:
            with self._start_lock:
                self._watch = None
            try:
                self._mirror.reset()
                self.start()
                self._check_change()
            except Exception:
                log.exception("rendezvous resync failed")

        threading.Thread(target=resync, name="rdzv-resync", daemon=True).start()

    def _on_events(self, events: list) -> None:
        self._mirror.apply(events)
        if self._current is not None or self._mirror.closed:  # nothing to report otherwise
            self._check_change()

    # -- change detection -----------------------------------------------------------------------

    def _pending_changes(self) -> list[Change]:
        """What changed relative to our current world (call with the mirror lock held)."""
        m, world = self._mirror, self._current
        return world_changes(
            world=world,
            members=self._current_nodes,
            me=self.node_id,
            live=m.joined_nodes(world.round) if world else (),
            next_round=m.joined_nodes(world.round + 1) if world else (),
            still_joined=world is not None and self._joined_round == world.round,
            closed=m.closed,
        )

    def _check_change(self) -> None:
        with self._mirror.cond:
            changes = self._pending_changes()
            fresh = [
                c
                for c in changes
                if any((c.kind, n) not in self._reported for n in c.nodes or ("",))
            ]
            for c in fresh:
                self._reported.update((c.kind, n) for n in c.nodes or ("",))
        if changes:
            self.changed.set()
        for c in fresh:
            log.info("world changed", **kv(node=self.node_id, kind=c.kind, nodes=",".join(c.nodes)))
            if self.on_change is not None:
                try:
                    self.on_change(c)
                except Exception:
                    log.exception("on_change callback failed")

    # -- forming a world ------------------------------------------------------------------------

    def next_world(self) -> World:
        """Join the open round and block until a world including this node closes."""
        self.start()
        deadline = self._clock() + self.settings.join_timeout
        try:
            return self._form(deadline)
        except EtcdError as exc:
            raise RendezvousConnection(str(exc)) from exc

    def _form(self, deadline: float) -> World:
        s, m = self.settings, self._mirror
        while True:
            with m.cond:
                if m.closed:
                    raise RendezvousClosed(f"rendezvous {s.run_id} is closed")
                if m.world_error is not None:
                    raise m.world_error
                world, open_round = m.world, m.open_round()
                if (
                    world is not None
                    and world.round == self._joined_round
                    and world.rank_of(self.node_id) is not None
                ):
                    if self._current is None or world.round > self._current.round:
                        return self._become_member(world)
                seen_world_mod = m.world_mod
                need_join = (
                    self._lease == 0
                    or self._joined_round != open_round
                    or self.node_id not in m.joined_nodes(open_round)
                )
            if need_join:
                if not self._join(open_round, seen_world_mod, deadline):
                    self._wait(deadline, lambda w=seen_world_mod: m.world_mod != w)
                    continue
            self._wait_or_close(open_round, deadline)

    def _join(self, round_: int, seen_world_mod: int, deadline: float) -> bool:
        s = self.settings
        lease = self._ensure_lease()
        me = Member(
            node=self.node_id,
            addr=self.addr,
            port=free_port(self.addr if self.addr else "127.0.0.1"),
        )
        fence = compare(s.world_key(), "mod", "==", seen_world_mod)
        ops = [put_op(s.join_key(round_, self.node_id), member_json(me), lease)]
        if self._joined_round and self._joined_round != round_:
            ops.append(delete_op(s.join_key(self._joined_round, self.node_id)))
        try:
            result = self._client.txn([fence], ops)
        except EtcdLeaseNotFound:
            # Our lease expired (or was revoked) before the keep-alive noticed: take a new one.
            self._lease = 0
            return self._join(round_, seen_world_mod, deadline)
        if not result.succeeded:
            return False
        self._joined_round = round_
        log.info("joined round", **kv(node=self.node_id, round=round_))
        # Our own join must be in the mirror before we judge the round from it.
        self._wait(deadline, lambda: self._mirror.revision >= result.revision)
        return True

    def _wait(self, deadline: float, predicate: Callable[[], bool]) -> None:
        m = self._mirror
        with m.cond:
            try:
                m.wake_when = predicate
                while not predicate():
                    left = deadline - self._clock()
                    if left <= 0:
                        self._timeout()
                    m.cond.wait(min(left, 0.5))
            finally:
                m.wake_when = None

    def _timeout(self) -> None:
        raise RendezvousTimeout(
            f"rendezvous {self.settings.run_id}: no world with node {self.node_id} formed within "
            f"{self.settings.join_timeout:g} s"
        )

    def _wait_or_close(self, round_: int, deadline: float) -> None:
        """Wait until ``round_`` closes (closing it ourselves when the rule says so)."""
        s, m = self.settings, self._mirror
        defer_until: float | None = None
        while True:
            with m.cond:
                if m.closed or m.world_error is not None or (m.world and m.world.round >= round_):
                    return
                if self._lease == 0 or self.node_id not in m.joined_nodes(round_):
                    return  # our membership expired: join again
                previous = m.world
                pend = pending_previous(
                    previous, m.joined_nodes(previous.round) if previous else ()
                )
                count = len(m.joined_nodes(round_))
                delay = close_delay(
                    joined=count,
                    pending_previous=pend,
                    min_nodes=s.min_nodes,
                    max_nodes=s.max_nodes,
                    since_last_join=m.since_last_join(round_),
                    settle=s.settle,
                )
                now = self._clock()
                if deadline - now <= 0:
                    self._abandon(round_)
                if delay is None or delay > 0:
                    self._sleep(round_, count, pend, min(deadline - now, delay or deadline - now))
                    continue
                world, waiting = build_world(
                    run_id=s.run_id,
                    round_=round_,
                    previous=previous,
                    joined=m.joins(round_),
                    max_nodes=s.max_nodes,
                )
                # Every participant reaches this point together; let the would-be rank 0
                # write the world, and step in only if it has not within a moment.
                if world.members[0].node != self.node_id:
                    defer_until = defer_until or now + min(0.5, s.ttl / 3)
                    if now < defer_until:
                        self._sleep(round_, count, 1, defer_until - now)
                        continue
                fences = [
                    compare(s.world_key(), "mod", "==", m.world_mod),
                    compare_range(s.join_prefix(round_), "mod", "<", m.last_join_mod(round_) + 1),
                ]
            result = self._client.txn(fences, [put_op(s.world_key(), world.to_json())])
            if result.succeeded:
                log.info(
                    "round closed",
                    **kv(round=round_, world=world.size, by=self.node_id, waiting=len(waiting)),
                )
            self._wait(deadline, lambda r=result.revision: m.revision >= r)

    def _sleep(self, round_: int, count: int, pending: int, timeout: float) -> None:
        """Sleep (mirror lock held) until ``timeout`` or an event that can change the
        decision: a deletion, the world, closing (these always wake), or — when nothing
        else blocks — the join count reaching the next threshold. Joins that cannot change
        the decision do not wake us: with hundreds of nodes that is most of them."""
        s, m = self.settings, self._mirror
        if pending:
            m.wake_when = lambda: False
        else:
            threshold = s.max_nodes if count >= s.min_nodes else s.min_nodes
            m.wake_when = lambda: len(m.joined_nodes(round_)) >= threshold
        try:
            m.cond.wait(max(0.0, min(timeout, 1.0)))
        finally:
            m.wake_when = None

    def _abandon(self, round_: int) -> None:
        """Give up: drop our join so the others do not count us, then time out."""
        # If etcd is unreachable the lease drops the key within a TTL anyway.
        with contextlib.suppress(EtcdError):
            self._client.delete(self.settings.join_key(round_, self.node_id))
        self._joined_round = 0
        self._timeout()

    def _become_member(self, world: World) -> World:
        self._current, self._current_nodes = world, frozenset(world.nodes)
        self._reported.clear()
        self.changed.clear()
        log.info(
            "world formed",
            **kv(
                node=self.node_id,
                round=world.round,
                rank=world.rank_of(self.node_id),
                world=world.size,
            ),
        )
        # A member that died between the close and now is already missing from the
        # mirror: report it at once rather than never.
        threading.Thread(target=self._check_change, daemon=True).start()
        return world

    # -- agent API ----------------------------------------------------------------------------

    @property
    def current_world(self) -> World | None:
        return self._current

    def leave(self) -> None:
        """Leave gracefully: revoke our lease so every peer is told at once."""
        lease, self._lease = self._lease, 0
        self._current, self._joined_round = None, 0
        if lease:
            self._client.keeper().remove(lease)
            try:
                self._client.lease_revoke(lease)
            except EtcdError as exc:
                log.warning("lease revoke failed", **kv(node=self.node_id, error=str(exc)))

    def close(self) -> None:
        """Leave and release threads and connections (does not close the run)."""
        self.leave()
        if self._watch is not None:
            self._watch.cancel()
        if self._owns_client:
            self._client.close()

    # -- run state ------------------------------------------------------------------------------

    def is_closed(self) -> bool:
        self.start()
        with self._mirror.cond:
            return self._mirror.closed

    def set_closed(self) -> None:
        try:
            self._client.put(self.settings.closed_key(), '{"closed":true}')
        except EtcdError as exc:
            raise RendezvousConnection(str(exc)) from exc

    def num_nodes_waiting(self) -> int:
        """Nodes waiting for the next round, plus members lost from ours (so that torch's
        agent, which re-forms when this is positive, re-forms on a loss too)."""
        self.start()
        with self._mirror.cond:
            changes = self._pending_changes()
        return sum(max(1, len(c.nodes)) for c in changes if c.kind != "closed")

    @property
    def run_id(self) -> str:
        return self.settings.run_id
