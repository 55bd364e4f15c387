"""The closer's side of a round: run for closer, judge the joins, write the world.

Exactly one node judges each round: the one that created ``state/closer/<r>`` (on its
lease). It alone needs every join of the round, so only it watches ``join/`` while the
round fills. The world is still written by one transaction fenced on the world key and
on the round's joins, so even two nodes that both believed they were the closer (they
cannot, but the fence does not rely on it) would produce one world.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from elasticd.etcd.client import (
    EtcdClient,
    EtcdLeaseNotFound,
    compare,
    compare_range,
    delete_op,
    get_op,
    put_op,
)
from elasticd.log import kv
from elasticd.rendezvous.decisions import (
    Member,
    RendezvousSettings,
    World,
    build_world,
    close_delay,
    closer_json,
    pending_previous,
)
from elasticd.rendezvous.mirror import Mirror
from elasticd.rendezvous.probe import reachable, refused

log = logging.getLogger("elasticd.rendezvous")

VERIFY_TIMEOUT = 2.0
"""Seconds a closer's check that a joined member's probe port answers may take."""
REPROBE = 0.03
"""Seconds between probes of a member that answered, while a re-form waits for it."""
PROBE_TIMEOUT = 0.5
"""Seconds a probe may take without ``reform_grace`` (process restarts): a refusal comes
back within a round trip; a probe that takes longer reads as an answer (wait on)."""
VERIFY_WAIT = 0.5
"""Seconds a round ready to close waits for checks still in flight (a loopback or LAN
connect takes a millisecond or so; the last joiner's check starts as the round becomes
ready): past it, an unchecked member carries no probe in this world. A check that
completes ends the wait at once, so this costs a round only when the connect hangs (a
firewall dropping the probe port). It was 0.1 s: on a 2-core box at a load of 9 the check's
thread was not run within it, and a node that then died whole was waited for the whole
reform_grace instead of being excused at its refused probe (tests/test_ports.py, a
clean-clone run with three pytest workers)."""

# ``wait(deadline, predicate, cap=0.0)``: wait on the mirror until ``predicate`` holds.
Wait = Callable[..., None]


@dataclass(frozen=True, kw_only=True, slots=True)
class ClosePlan:
    """A world ready to be written, with the mirror facts its transaction is fenced on."""

    round: int
    """The round it closes."""
    world: World
    """The world to write."""
    waiting: tuple[str, ...]
    """Joined nodes left for the next round (past ``max_nodes``)."""
    world_mod: int
    """The world key's mod_revision we judged from."""
    join_mod: int
    """The newest mod_revision of the round's joins we judged from."""


class RoundCloser:
    """Closing rounds for one node (``node_id``) from its ``mirror``."""

    def __init__(
        self,
        *,
        client: EtcdClient,
        settings: RendezvousSettings,
        mirror: Mirror,
        node_id: str,
        wait: Wait,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._client = client
        self._settings = settings
        self._mirror = mirror
        self._node = node_id
        self._wait = wait
        self._clock = clock
        self._gone: dict[int, set[str]] = {}
        """By world round: its members whose probe was refused (gone, lease or not)."""
        self._probed: dict[tuple[int, str], float | None] = {}
        """(world round, node) -> when its last probe answered (None: one in flight). A
        member that answered is probed again every REPROBE seconds while we wait for it:
        a killed node's agent may outlive its workers (whose closed sockets were the
        evidence) by a few milliseconds."""
        self._reachable: set[tuple[str, int]] = set()
        """(node, probe port) we connected to: only these go into a world record with
        their probe, so only a port once reached can later count as refused."""
        self._verifying: dict[tuple[str, int], float] = {}
        """Being checked now: when the check began."""
        self._unreachable: set[tuple[str, int]] = set()
        """Checked and not reached (never again: one listener serves a node's rendezvous
        for its whole life)."""

    def run_for(self, round_: int, lease: int, seen_world_mod: int, deadline: float) -> bool:
        """Try to become ``round_``'s closer; either way, wait until the mirror shows who
        is. The key lives on our (non-zero) ``lease``, so it goes away when we do. False
        if that lease is gone."""
        s, m = self._settings, self._mirror
        key = s.closer_key(round_)
        fences = [
            compare(key, "create", "==", 0),
            compare(s.world_key(), "mod", "==", seen_world_mod),
        ]
        try:
            result = self._client.txn(
                fences, [put_op(key, closer_json(self._node), lease)], [get_op(key)]
            )
        except EtcdLeaseNotFound:
            return False
        if result.succeeded:
            log.info("closing round", **kv(node=self._node, round=round_))
            self._wait(deadline, lambda: m.revision["state"] >= result.revision)
            return True
        found = result.responses[0].response_range.kvs
        if found:  # someone else's: its put reaches our state/ watch at its mod_revision
            self._wait(deadline, lambda r=found[0].mod_revision: m.revision["state"] >= r)
        else:  # the world changed under us
            self._wait(deadline, lambda: m.world_mod != seen_world_mod, cap=1.0)
        return True

    def plan(self, round_: int, deadline: float) -> ClosePlan | None:
        """With the mirror lock held: None after sleeping until the close rule may have
        changed its mind, else the world to write now."""
        s, m = self._settings, self._mirror
        previous = m.world
        live_old = m.joined_nodes(previous.round) if previous else ()
        gone = self._gone.get(previous.round, set()) if previous else set()
        if previous is not None:
            # A preempted member keeps its join (and lease) while its workers save and
            # stop, up to restart.grace_period; it will not re-join, so nobody waits.
            gone = gone | m.leaving(previous.round)
        pend = pending_previous(previous, live_old, gone)
        # The grace runs from evidence of the previous world's members only (a node left
        # out of it carries evidence of an older world); any evidence starts the probes,
        # whose refusal proves a member dead whoever brought it.
        since_evidence = m.since_evidence(round_, previous.nodes if previous else ())
        probing = False
        if pend and previous is not None and s.probes:
            if m.since_evidence(round_, None) is not None:
                probing = self._probe(previous, [n for n in previous.nodes if n in live_old])
        joins = m.joins(round_)
        if s.probes:
            self._verify(joins)
        count = len(m.joined_nodes(round_))
        needed, settle = s.close_rule(first=previous is None, joined=count)
        delay = close_delay(
            joined=count,
            pending_previous=pend,
            min_nodes=needed,
            max_nodes=s.max_nodes,
            since_last_join=m.since_last_join(round_),
            settle=settle,
            reform=previous is not None,
            reform_grace=s.reform_grace,
            since_evidence=since_evidence,
        )
        if delay is None or delay > 0:
            left = deadline - self._clock()
            left = min(left, delay if delay is not None else left)
            self._sleep(round_, count, pend, min(left, REPROBE) if probing else left)
            return None
        checking = [t for (n, _), t in self._verifying.items() if n in joins]
        if checking:
            wait = min(checking) + VERIFY_WAIT - self._clock()
            if wait > 0:
                m.cond.wait(wait)  # _verify_one notifies
                return None
        world, waiting = build_world(
            run_id=s.run_id,
            round_=round_,
            previous=previous,
            joined={
                n: (rev, mem if (n, mem.probe) in self._reachable
                    else dataclasses.replace(mem, probe=0))
                for n, (rev, mem) in joins.items()
            },
            max_nodes=s.max_nodes,
            arrange=s.arrange,
        )  # fmt: skip
        return ClosePlan(
            round=round_,
            world=world,
            waiting=tuple(waiting),
            world_mod=m.world_mod,
            join_mod=m.last_join_mod(round_),
        )

    def _verify(self, joins: dict[str, tuple[int, Member]]) -> None:
        """Connect once (a thread each; the mirror lock is held) to the probe port of each
        joined member not reached yet. A round ready to close waits up to VERIFY_WAIT for
        checks in flight (the last joiner's); a member still unreached then carries no
        probe in that world: the grace decides for it there."""
        for node, (_, member) in joins.items():
            key = (node, member.probe)
            if (not member.probe or key in self._reachable or key in self._verifying
                    or key in self._unreachable):  # fmt: skip
                continue
            self._verifying[key] = self._clock()
            threading.Thread(
                target=self._verify_one, args=(member,), name="rdzv-probe-check", daemon=True
            ).start()

    def _verify_one(self, member: Member) -> None:
        ok = reachable(member.addr, member.probe, VERIFY_TIMEOUT)
        with self._mirror.cond:
            key = (member.node, member.probe)
            self._verifying.pop(key, None)
            (self._reachable if ok else self._unreachable).add(key)
            self._mirror.cond.notify_all()  # a round may wait for this check to close
            if not ok:
                log.warning("probe port not reachable: the member is left to the grace",
                            **kv(node=member.node, addr=member.addr, port=member.probe))  # fmt: skip

    def _probe(self, previous: World, waited: list[str]) -> bool:
        """Probe each member of ``previous`` we wait for that has a probe port, each on a
        thread of its own (the mirror lock is held), again REPROBE seconds after its last
        answer: a refusal marks it gone and wakes the planner. Whether any has a port."""
        timeout = max(0.05, float(self._settings.reform_grace or PROBE_TIMEOUT))
        now = self._clock()
        self._probed = {k: t for k, t in self._probed.items() if k[0] >= previous.round}
        any_port = False
        for member in previous.members:
            key = (previous.round, member.node)
            if member.node not in waited or not member.probe:
                continue
            any_port = True
            last = self._probed.get(key, -1.0)
            if last is None or (last >= 0 and now - last < REPROBE):
                continue
            self._probed[key] = None
            threading.Thread(
                target=self._probe_one, args=(previous.round, member, timeout),
                name="rdzv-probe-out", daemon=True,
            ).start()  # fmt: skip
        return any_port

    def _probe_one(self, round_: int, member: Member, timeout: float) -> None:
        if not refused(member.addr, member.probe, timeout):
            with self._mirror.cond:
                self._probed[(round_, member.node)] = self._clock()
            return
        log.info("member gone: its rendezvous refuses connections",
                 **kv(node=member.node, round=round_, by=self._node))  # fmt: skip
        m = self._mirror
        with m.cond:
            self._gone.setdefault(round_, set()).add(member.node)
            for old in [r for r in self._gone if r < round_]:
                del self._gone[old]
            m.cond.notify_all()

    def write(self, plan: ClosePlan, deadline: float) -> None:
        """The one transaction that closes the round (and drops its closer key); fenced so
        that a world or a join we have not seen yet makes it fail harmlessly — we then
        wait until the mirror has it and judge again."""
        s, m, r = self._settings, self._mirror, plan.round
        fences = [
            compare(s.world_key(), "mod", "==", plan.world_mod),
            compare_range(s.join_prefix(r), "mod", "<", plan.join_mod + 1),
        ]
        ops = [put_op(s.world_key(), plan.world.to_json()), delete_op(s.closer_key(r))]
        result = self._client.txn(fences, ops)
        if result.succeeded:
            log.info(
                "round closed",
                **kv(round=r, world=plan.world.size, by=self._node, waiting=len(plan.waiting)),
            )
            self._wait(deadline, lambda: m.revision["state"] >= result.revision)
            return
        self._wait(
            deadline,
            lambda: m.world_mod != plan.world_mod or m.last_join_mod(r) != plan.join_mod,
            cap=1.0,
        )

    def _sleep(self, round_: int, count: int, pending: int, timeout: float) -> None:
        """Sleep (mirror lock held) until ``timeout`` or an event that can change the
        decision: a deletion, a state/ change (these always wake), or — when nothing
        else blocks — the join count reaching the next threshold. Joins that cannot change
        the decision do not wake us: with hundreds of nodes that is most of them."""
        s, m = self._settings, self._mirror
        if pending:
            m.wake_when = lambda: False
        else:
            # The next count that can change the decision (start_nodes ends a first
            # round's longer settle).
            marks = (s.min_nodes, s.start_nodes or 0, s.max_nodes)
            threshold = min((n for n in marks if n > count), default=s.max_nodes)
            m.wake_when = lambda: len(m.joined_nodes(round_)) >= threshold
        try:
            m.cond.wait(max(0.0, min(timeout, 1.0)))
        finally:
            m.wake_when = None
