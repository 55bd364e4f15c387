"""The native etcd v3 rendezvous, torch-free (``torch_handler`` adapts it to torchrun).

The agent's API is documented in ``elasticd.rendezvous`` and docs/rendezvous.md.

How a round works: a node joins the open round r (= last world's round + 1) by putting
``join/<r>/<node>`` on its lease, fenced by a compare on the world key, so it cannot join
a round that just closed. Then it runs for round r's *closer*: a create-if-absent of
``state/closer/<r>`` on its lease. The one winner mirrors every join (a watch on
``join/``), evaluates the pure close rule (``decisions.close_delay``) and writes the world
in one transaction fenced on the world key and on "no join key of round r changed since I
looked" (a range compare). Everyone else watches only the small ``state/`` directory: the
world appears there, and so does the closer key's deletion if the closer dies (its lease
expires within a TTL) or gives up — then they run for closer again and the winner takes
over. So forming a world of N nodes costs O(N) watch events, not N per node.
Members of a running world watch ``join/`` too and keep their join key (and lease): its
deletion — lease expiry after a crash, a revoke on leave, or a move to the next round —
is pushed to every survivor; a put under ``join/<r+1>/`` is a node waiting.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import socket
import threading
import time
import uuid
from collections.abc import Callable

from elasticd.errors import EtcdError
from elasticd.etcd.client import (
    EtcdClient,
    EtcdLeaseNotFound,
    compare,
    delete_op,
    put_op,
)
from elasticd.etcd.server import release_ports, reserve_port
from elasticd.log import kv
from elasticd.rendezvous.closing import RoundCloser
from elasticd.rendezvous.decisions import (
    Change,
    Member,
    RendezvousSettings,
    World,
    closer_json,
    member_json,
    world_changes,
)
from elasticd.rendezvous.errors import RendezvousClosed, RendezvousConnection, RendezvousTimeout
from elasticd.rendezvous.feeds import Feeds
from elasticd.rendezvous.mirror import Mirror
from elasticd.rendezvous.probe import ProbeListener

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
        incarnation: str = "",
    ) -> None:
        self.settings = settings
        self.incarnation = incarnation
        """This agent process's token, in every join (``Member.incarnation``)."""
        self.node_id = node_id or f"{addr}_{uuid.uuid4().hex[:8]}"
        self.addr = addr
        self.on_change = on_change
        self.changed = threading.Event()
        self._client = client
        self._owns_client = owns_client
        self._clock = clock
        self._mirror = Mirror(settings, clock)
        self._feeds = Feeds(
            client=client,
            mirror=self._mirror,
            on_events=self._on_events,
            on_resynced=self._check_change,
        )
        self._last_changes: list[Change] = []
        self._closer = RoundCloser(
            client=client,
            settings=settings,
            mirror=self._mirror,
            node_id=self.node_id,
            wait=self._wait,
            clock=clock,
        )
        self._lease = 0
        self._joined_round = 0
        self._joined_as: tuple[Member, int] | None = None
        """Our join record of ``_joined_round`` and the revision that created it."""
        self._evidence = False
        self._current: World | None = None
        self._current_nodes: frozenset[str] = frozenset()
        self._reported: set[tuple[str, str]] = set()
        self._start_lock = threading.Lock()
        self._ports: list[socket.socket] = []
        """Reserved store ports of our last joins (see :meth:`_reserve_port`)."""
        self._closed = False
        """Set by close(), which another thread may call while we join (the sockets a
        join makes after it are closed at once); with the sockets, under this lock:"""
        self._sockets_lock = threading.Lock()
        self._probe: ProbeListener | None = None
        """Answers while we live: a closer waiting for us in a re-form learns at once that
        we are gone when it is refused (elasticd/rendezvous/probe.py)."""

    # -- lifecycle ----------------------------------------------------------------------------

    def start(self) -> None:
        """Read the run's ``state/`` keys once and start watching them (idempotent)."""
        self._feeds.start()

    def _ensure_lease(self) -> int:
        if self._lease:
            return self._lease
        lease = self._client.lease_grant(self.settings.ttl)
        self._client.keeper().add(
            lease, self.settings.keepalive, self._on_lease_lost, ttl=self.settings.ttl
        )
        self._lease = lease
        return lease

    def _on_lease_lost(self, lease: int) -> None:
        with self._mirror.cond:
            if lease != self._lease:
                return
            self._lease = 0
            self._mirror.cond.notify_all()
        self._check_change()

    def _on_events(self, feed: str) -> None:
        if self._current is not None or self._mirror.closed:  # nothing to report otherwise
            self._check_change()

    # -- change detection -----------------------------------------------------------------------

    def _pending_changes(self) -> list[Change]:
        """What changed relative to our current world (call with the mirror lock held).
        Without the ``join/`` feed (while we wait for another node to close a round) the
        last answer stands: we are re-forming anyway."""
        m, world = self._mirror, self._current
        if not m.members_live and not m.closed:
            return self._last_changes
        live: set[str] = set()
        if world is not None:  # live joins, and members whose join we may not see yet
            live = set(m.joined_nodes(world.round)) | (set(world.nodes) - m.absent(world))
        self._last_changes = world_changes(
            world=world,
            members=self._current_nodes,
            me=self.node_id,
            live=live,
            next_round=m.joined_nodes(world.round + 1) if world else (),
            still_joined=world is not None and self._joined_round == world.round,
            closed=m.closed,
        )
        return self._last_changes

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
            # Judged and flagged under the lock: once we are a member of the next world
            # (``_become_member`` clears the flag under it), a check of the one before
            # neither flags the new world stale nor passes for a change of it.
            r = self._current.round if self._current is not None else 0
            fresh = [dataclasses.replace(c, round=r) for c in fresh]
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

    def next_world(self, *, evidence: bool = False) -> World:
        """Join the open round and block until a world including this node closes.

        ``evidence``: we re-form because we saw a fault ourselves (a collective failed on a
        closed socket, a local worker died). With ``settings.reform_grace`` the round then
        waits only that long for previous members that do not re-join."""
        self.start()
        self._evidence = evidence
        deadline = self._clock() + self.settings.join_timeout
        try:
            return self._form(deadline)
        except EtcdError as exc:
            raise RendezvousConnection(str(exc)) from exc

    def _form(self, deadline: float) -> World:
        s, m = self.settings, self._mirror
        while True:
            formed = None
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
                    and (self._current is None or world.round > self._current.round)
                ):
                    formed = world
                seen_world_mod = m.world_mod
                need_join = (
                    self._lease == 0
                    or self._joined_round != open_round
                    or (m.members_live and self.node_id not in m.joined_nodes(open_round))
                )
                closing = m.closers.get(open_round) == (self.node_id, self._lease)
            if formed is not None:
                return self._become_member(formed)
            if need_join:
                if not closing:
                    # Re-forming: the other members' joins and moves would flood our join/
                    # watch; the round's closer (maybe us, then we read join/ afresh) judges.
                    self._feeds.members_off()
                if not self._join(open_round, seen_world_mod, deadline):
                    self._wait(deadline, lambda w=seen_world_mod: m.world_mod != w)
                    continue
            self._await_round(open_round, deadline)

    def _join(self, round_: int, seen_world_mod: int, deadline: float) -> bool:
        s = self.settings
        lease = self._ensure_lease()
        me = Member(
            node=self.node_id,
            addr=self.addr,
            port=self._reserve_port(),
            # Probes serve fast re-forms (reform_grace: in-process jobs) and excuse a dead
            # member (excuse_refused: every job's); with neither no port is opened and no
            # closer connects (elasticd/rendezvous/probe.py).
            probe=self._probe_port() if s.probes else 0,
            evidence=self._evidence,
            incarnation=self.incarnation,
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
        self._joined_as = (me, result.revision)
        log.info("joined round", **kv(node=self.node_id, round=round_))
        if self._mirror.members_live:
            # Our own join must be in the mirror before we judge the round from it.
            self._wait(deadline, lambda: self._mirror.revision["join"] >= result.revision)
        return True

    def _probe_port(self) -> int:
        with self._sockets_lock:
            if self._probe is None:
                self._probe = ProbeListener()
            port = self._probe.port
            if self._closed:  # close() ran meanwhile (an abandoned wait): keep nothing
                self._close_sockets_locked()
        return port

    def _reserve_port(self) -> int:
        """A port for the round's store (rank 0 on our node hosts it when we are the first
        member), held until two joins later: the worker binds it seconds after the join,
        once the round formed and torch imported, and nothing else on this machine may
        take it meanwhile (see :func:`reserve_port`)."""
        sock = reserve_port()
        with self._sockets_lock:
            self._ports.append(sock)
            while len(self._ports) > 2:
                self._ports.pop(0).close()
            if self._closed:  # close() ran meanwhile (an abandoned wait): keep nothing
                self._close_sockets_locked()
        return sock.getsockname()[1]

    def _close_sockets_locked(self) -> None:
        release_ports(self._ports)
        if self._probe is not None:
            self._probe.close()
            self._probe = None

    def _wait(self, deadline: float, predicate: Callable[[], bool], cap: float = 0.0) -> None:
        """Wait (on the mirror) until ``predicate``, or ``cap`` seconds if given."""
        m = self._mirror
        until = self._clock() + cap if cap else deadline
        with m.cond:
            try:
                m.wake_when = predicate
                while not predicate():
                    now = self._clock()
                    if deadline - now <= 0:
                        self._timeout()
                    if until - now <= 0:
                        return
                    m.cond.wait(min(deadline - now, until - now, 0.5))
            finally:
                m.wake_when = None

    def _timeout(self) -> None:
        raise RendezvousTimeout(
            f"rendezvous {self.settings.run_id}: no world with node {self.node_id} formed within "
            f"{self.settings.join_timeout:g} s"
        )

    def _await_round(self, round_: int, deadline: float) -> None:
        """Wait until ``round_`` closes: as its closer (judging the joins and writing the
        world), or watching ``state/`` only, ready to take over if the closer goes away."""
        m = self._mirror
        while True:
            plan = None
            with m.cond:
                if m.closed or m.world_error is not None or (m.world and m.world.round >= round_):
                    return
                if self._lease == 0:
                    return  # our membership expired: join again
                if deadline - self._clock() <= 0:
                    break
                seen_world_mod, lease = m.world_mod, self._lease
                closer = m.closers.get(round_)
                mine = closer == (self.node_id, lease)
                if closer is not None and not mine and not m.members_live:
                    m.cond.wait(min(deadline - self._clock(), 1.0))
                    continue
                if mine and m.members_live:
                    if self.node_id not in m.joined_nodes(round_):
                        return  # our join went away: join again
                    plan = self._closer.plan(round_, deadline)
                    if plan is None:
                        continue
            # Outside the lock: these talk to etcd.
            if plan is not None:
                self._closer.write(plan, deadline)
            elif closer is None:
                if not self._closer.run_for(round_, lease, seen_world_mod, deadline):
                    with m.cond:  # our lease is gone: join again with a fresh one
                        if self._lease == lease:
                            self._lease = 0
            elif mine:
                self._feeds.members_on()
            else:
                self._feeds.members_off()  # another node judges the joins
        self._abandon(round_)

    def _abandon(self, round_: int) -> None:
        """Give up: drop our join (and closer key) so the others do not count us, then time
        out."""
        s = self.settings
        # If etcd is unreachable the lease drops the keys within a TTL anyway.
        with contextlib.suppress(EtcdError):
            mine = compare(s.closer_key(round_), "value", "==", closer_json(self.node_id))
            join = delete_op(s.join_key(round_, self.node_id))
            self._client.txn([mine], [join, delete_op(s.closer_key(round_))], [join])
        self._joined_round = 0
        self._timeout()

    def _become_member(self, world: World) -> World:
        # Members watch join/ for lost peers and waiting nodes; read it before we answer,
        # so a member that died between the close and now shows as missing at once.
        self._feeds.members_on()
        with self._mirror.cond:
            self._current, self._current_nodes = world, frozenset(world.nodes)
            self._reported.clear()
            self._last_changes = []
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
        threading.Thread(target=self._check_change, daemon=True).start()
        return world

    # -- agent API ----------------------------------------------------------------------------

    @property
    def current_world(self) -> World | None:
        return self._current

    def lease_alive(self) -> bool:
        """Whether our membership's lease is alive as far as etcd's answers tell: False
        at once when we were frozen past its TTL, before anything else here noticed (the
        agent's metrics then stop speaking for the job: docs/metrics.md)."""
        lease = self._lease
        return bool(lease) and self._client.keeper().alive(lease)

    def mark_leaving(self) -> bool:
        """Re-write our join of the current round as leaving (we are preempted; our
        workers still save and stop, and our lease lives until :meth:`leave`): a round
        that waits for the previous world's members then excuses us at once, instead of
        waiting until we leave. Fenced on our join being the one we made (a join that
        went away is never re-created). Whether the mark was written."""
        lease, round_, joined = self._lease, self._joined_round, self._joined_as
        if not lease or not round_ or joined is None:
            return False
        me, created = joined
        key = self.settings.join_key(round_, self.node_id)
        mark = dataclasses.replace(me, leaving=True)
        try:
            result = self._client.txn(
                [compare(key, "create", "==", created)], [put_op(key, member_json(mark), lease)]
            )
        except EtcdLeaseNotFound:
            return False
        if result.succeeded:
            log.info("marked leaving", **kv(node=self.node_id, round=round_))
        return result.succeeded

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
        with self._sockets_lock:
            self._closed = True
            self._close_sockets_locked()
        self.leave()
        self._feeds.close()
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
