"""The pure core of the native rendezvous: settings, key layout, the close rule, rank
assignment and the world record. No I/O here; the handler feeds these from its watch.

Key layout under ``<prefix>/<run_id>/`` (all values JSON):

- ``state/world``       the last closed world (round r): members in rank order, master.
- ``state/closed``      present once the run is closed.
- ``state/closer/<r>``  the one node that judges and closes round r, on its lease.
- ``join/<r>/<node>``   a node's membership of round r, on the node's lease.

Every node watches the small ``state/`` directory; only a round's closer and the members
of a running world also watch ``join/`` (see ``core``).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass, field

from elasticd.errors import UsageError
from elasticd.rendezvous.errors import RendezvousState


@dataclass(frozen=True, kw_only=True, slots=True)
class RendezvousSettings:
    """Timing and bounds of one run's rendezvous."""

    run_id: str
    """The run (job) id; rounds of different runs never mix."""
    min_nodes: int = 1
    """A round may close once this many nodes joined and ``settle`` passed."""
    max_nodes: int = 1
    """A round closes at once when this many joined; later joiners wait for the next."""
    start_nodes: int | None = None
    """The run's first round (no world before it) waits for this many (None: ``min_nodes``):
    a job started on N nodes begins on all N, however late one of them joins, within
    ``start_wait``; later worlds still need only ``min_nodes``."""
    start_wait: float = 60.0
    """A first round short of ``start_nodes`` closes at ``min_nodes`` once nobody joined
    for this many seconds: a node that never comes (it died after it was counted) delays
    the job's start by this much, not for good."""
    ttl: float = 3.0
    """Lease TTL of a node's membership in seconds; a dead node is known after about this."""
    keepalive_interval: float | None = None
    """Seconds between lease refreshes; default ``ttl / 3``."""
    settle: float = 1.0
    """A round closes once ``min_nodes`` joined and nobody joined for this many seconds."""
    join_timeout: float = 300.0
    """``next_rendezvous`` gives up with a timeout error after this many seconds."""
    prefix: str = "/elasticd/rdzv"
    """etcd key prefix; the run's keys live under ``<prefix>/<run_id>/``."""
    reform_grace: float | None = None
    """Fast re-forms (in-process restart): None keeps the plain close rule. A number makes a
    re-forming round (1) close as soon as every live member of the previous world re-joined,
    without ``settle``, and (2) once a joiner brought *evidence* of a fault (its collective
    failed on a closed socket, or a local worker died), wait at most this many seconds for
    previous members that have not re-joined, instead of until their leases expire. A
    member wrongly left out can only come back as a newcomer: rounds are fenced."""
    excuse_refused: bool = False
    """Without ``reform_grace`` (process restarts): members still probe each other
    (elasticd/rendezvous/probe.py), and once a joiner brought evidence of a fault, a
    previous member whose rendezvous refuses connections (its agent is gone, and its
    workers with it) is not waited for; every other one is, as before (a live one until it
    re-joins, a frozen one until its lease expires), and ``settle`` still applies. A re-form
    after a killed node waited for its lease: about ``ttl`` of every process restart."""
    arrange: Callable[[Sequence[str], Sequence[str]], Sequence[str]] | None = field(
        default=None, compare=False, repr=False
    )
    """``arrange(previous nodes, order)``: a permutation of a re-forming round's node-rank
    order, chosen by whoever knows what the nodes hold (the agent: ``elasticd.layout.
    keep_shards`` for in-process jobs). It must be a pure function of its arguments, the
    same on every node, since any member may close the round. None, or an answer that is
    not a permutation of ``order`` (or that raises): ``order`` as it is."""

    def __post_init__(self) -> None:
        if not self.run_id or "/" in self.run_id:
            raise UsageError(f"rendezvous run id {self.run_id!r} must be non-empty without '/'")
        if self.min_nodes < 1 or self.max_nodes < self.min_nodes:
            raise UsageError(
                f"rendezvous nodes: need 1 <= min ({self.min_nodes}) <= max ({self.max_nodes})"
            )
        start = self.start_nodes
        if start is not None and not self.min_nodes <= start <= self.max_nodes:
            raise UsageError(
                f"rendezvous start nodes: need min ({self.min_nodes}) <= start ({start}) <= "
                f"max ({self.max_nodes})"
            )
        if self.reform_grace is not None and self.reform_grace < 0:
            raise UsageError(f"rendezvous reform_grace: {self.reform_grace} must be >= 0")
        for name in ("ttl", "settle", "join_timeout"):
            value = getattr(self, name)
            if value < 0 or (name != "settle" and value == 0):
                raise UsageError(f"rendezvous {name}: {value} must be positive")
        if self.ttl < 1:
            raise UsageError(f"rendezvous ttl: {self.ttl} is below etcd's 1 s lease granularity")
        if self.start_wait < 0:
            raise UsageError(f"rendezvous start_wait: {self.start_wait} must be >= 0")

    def close_rule(self, *, first: bool, joined: int) -> tuple[int, float]:
        """``(nodes needed, settle)`` for a round with ``joined`` nodes: it may close once
        that many joined and nobody joined for ``settle`` seconds. The run's ``first``
        round short of ``start_nodes`` takes ``start_wait`` for its settle."""
        if first and self.start_nodes is not None and joined < self.start_nodes:
            return self.min_nodes, max(self.settle, self.start_wait)
        return self.min_nodes, self.settle

    @property
    def probes(self) -> bool:
        """Whether members open a probe port and closers probe them."""
        return self.reform_grace is not None or self.excuse_refused

    @property
    def keepalive(self) -> float:
        return self.keepalive_interval or self.ttl / 3.0

    @property
    def run_prefix(self) -> str:
        return f"{self.prefix.rstrip('/')}/{self.run_id}/"

    @property
    def state_prefix(self) -> str:
        return self.run_prefix + "state/"

    @property
    def joins_prefix(self) -> str:
        return self.run_prefix + "join/"

    def world_key(self) -> str:
        return self.state_prefix + "world"

    def closed_key(self) -> str:
        return self.state_prefix + "closed"

    def closer_key(self, round_: int) -> str:
        return f"{self.state_prefix}closer/{round_}"

    def join_prefix(self, round_: int) -> str:
        return f"{self.run_prefix}join/{round_}/"

    def join_key(self, round_: int, node: str) -> str:
        return self.join_prefix(round_) + node


def parse_join_key(settings: RendezvousSettings, key: str) -> tuple[int, str] | None:
    """``(round, node)`` of a join key, or None for any other key."""
    head = settings.joins_prefix
    if not key.startswith(head):
        return None
    round_text, _, node = key[len(head) :].partition("/")
    if not round_text.isdigit() or not node:
        return None
    return int(round_text), node


def parse_closer_key(settings: RendezvousSettings, key: str) -> int | None:
    """The round of a closer key, or None for any other key."""
    head = settings.state_prefix + "closer/"
    tail = key[len(head) :] if key.startswith(head) else ""
    return int(tail) if tail.isdigit() else None


# -- the close rule -------------------------------------------------------------------------


def close_delay(
    *,
    joined: int,
    pending_previous: int,
    min_nodes: int,
    max_nodes: int,
    since_last_join: float,
    settle: float,
    reform: bool = False,
    reform_grace: float | None = None,
    since_evidence: float | None = None,
) -> float | None:
    """Seconds until the open round may close: 0 means now, None means not on time alone.

    A round waits for every live member of the previous world to re-join (so a newcomer
    cannot form a world alone while the old one is still running); then it closes at once
    at ``max_nodes``, or at ``min_nodes`` once nobody joined for ``settle`` seconds.

    With ``reform_grace`` (fast re-forms) and a previous world (``reform``): a round with
    evidence of a fault (``since_evidence``: seconds since the first such join) waits for
    pending previous members only until the grace has passed, and a re-forming round skips
    ``settle`` once no previous member is pending.
    """
    fast = reform_grace is not None and reform
    if pending_previous > 0:
        if not fast or since_evidence is None:
            return None
        left = reform_grace - since_evidence
        if left > 0:
            return left
        pending_previous = 0  # excused: no re-join within the grace after the evidence
    if joined < min_nodes:
        return None
    if joined >= max_nodes or fast:
        return 0.0
    return max(0.0, settle - since_last_join)


# -- rank assignment ------------------------------------------------------------------------


def order_members(
    previous: Sequence[str], joined: Mapping[str, int], max_nodes: int
) -> tuple[list[str], list[str]]:
    """``(members in rank order, left waiting)`` for a closing round.

    Survivors of the previous world keep their relative order (so their node ranks move
    as little as possible); newcomers follow, sorted by name. If more than ``max_nodes``
    joined, survivors are preferred and the newcomers who arrived last wait.
    """
    survivors = [n for n in previous if n in joined][:max_nodes]
    seen = set(survivors)
    by_arrival = sorted((n for n in joined if n not in seen), key=lambda n: (joined[n], n))
    room = max_nodes - len(survivors)
    admitted, waiting = by_arrival[:room], by_arrival[room:]
    return survivors + sorted(admitted), waiting


def arranged(
    arrange: Callable[[Sequence[str], Sequence[str]], Sequence[str]],
    previous: Sequence[str],
    order: list[str],
) -> list[str]:
    """``arrange(previous, order)`` if it is a permutation of ``order``, else ``order``: a
    placement is an optimisation, never a reason for a round not to close (the arranger
    says why it failed: this module does no I/O)."""
    try:
        out = list(arrange(tuple(previous), tuple(order)))
    except Exception:  # any failure keeps the plain order
        return order
    return out if sorted(out) == sorted(order) else order


# -- the world record -----------------------------------------------------------------------


@dataclass(frozen=True, kw_only=True, slots=True)
class Member:
    """One node of a world, as it announced itself when it joined."""

    node: str
    """Node id."""
    addr: str
    """Address other nodes reach it at."""
    port: int
    """A free port on ``addr``, reserved for the store if this node becomes rank 0."""
    probe: int = 0
    """A port on ``addr`` its rendezvous listens on while it lives (0: none, an older
    agent): a refused connection there excuses it from a re-form at once
    (elasticd/rendezvous/probe.py)."""
    evidence: bool = False
    """It joined because it saw a fault (a collective failed, a local worker died); not
    part of the world record."""
    incarnation: str = ""
    """Which agent process of the node joined (a token it draws at start; "" from an
    older agent): a node killed and started again under its id within a TTL re-joins
    before its old lease expires, and only this tells the survivors it was lost (its
    workers' state with it), not a survivor."""
    leaving: bool = False
    """It is preempted and on its way out (its join is re-written with this mark while
    its workers save and stop): a round waiting for the previous world's members
    excuses it at once. Not part of the world record."""


@dataclass(frozen=True, kw_only=True, slots=True)
class World:
    """A closed round: who is in it, in node-rank order, and where rank 0's store is."""

    run_id: str
    """The run."""
    round: int
    """Round number, 1 for the first world."""
    members: tuple[Member, ...]
    """Members in node-rank order."""
    revision: int = 0
    """etcd revision at which the world was written (0 before it was)."""
    master_addr: str = field(init=False)
    """Address of node rank 0."""
    master_port: int = field(init=False)
    """Port of rank 0's store."""

    def __post_init__(self) -> None:
        if not self.members:
            raise RendezvousState(f"rendezvous {self.run_id}: round {self.round} has no members")
        object.__setattr__(self, "master_addr", self.members[0].addr)
        object.__setattr__(self, "master_port", self.members[0].port)

    @property
    def nodes(self) -> tuple[str, ...]:
        return tuple(m.node for m in self.members)

    @property
    def size(self) -> int:
        return len(self.members)

    def rank_of(self, node: str) -> int | None:
        for rank, member in enumerate(self.members):
            if member.node == node:
                return rank
        return None

    def to_json(self) -> str:
        return json.dumps(
            {
                "version": 1,
                "run_id": self.run_id,
                "round": self.round,
                "members": [_member_doc(m) for m in self.members],
                "master_addr": self.master_addr,
                "master_port": self.master_port,
            },
            separators=(",", ":"),
        )


def _member_doc(member: Member) -> dict[str, object]:
    doc: dict[str, object] = {"node": member.node, "addr": member.addr, "port": member.port}
    if member.probe:
        doc["probe"] = member.probe
    if member.incarnation:
        doc["incarnation"] = member.incarnation
    return doc


def member_json(member: Member) -> str:
    doc = _member_doc(member)
    if member.evidence:
        doc["evidence"] = True
    if member.leaving:
        doc["leaving"] = True
    return json.dumps(doc)


EVIDENCE_MARK = b'"evidence": true'
"""How ``member_json`` marks an evidence join (the mirror looks for it without parsing)."""
LEAVING_MARK = b'"leaving": true'
"""How ``member_json`` marks a leaving member's join (likewise)."""


def closer_json(node: str) -> str:
    return json.dumps({"node": node})


def parse_closer(raw: bytes) -> str:
    """The node named by a closer record ("" if malformed: then nobody is the closer, and
    the round's closer key is re-elected once it goes away with its lease)."""
    try:
        return str(json.loads(raw)["node"])
    except (ValueError, KeyError, TypeError):
        return ""


def parse_member(node: str, raw: bytes) -> Member:
    try:
        doc = json.loads(raw)
        return Member(
            node=node, addr=str(doc["addr"]), port=int(doc["port"]),
            probe=int(doc.get("probe", 0)), evidence=doc.get("evidence") is True,
            incarnation=str(doc.get("incarnation", "")),
            leaving=doc.get("leaving") is True,
        )  # fmt: skip
    except (ValueError, KeyError, TypeError) as exc:
        raise RendezvousState(
            f"rendezvous join record of {node!r} is not valid JSON: {exc}"
        ) from exc


def parse_world(raw: bytes, revision: int = 0) -> World:
    """The world stored in etcd; anything malformed is a ``RendezvousState`` error."""
    try:
        doc = json.loads(raw)
        if doc.get("version") != 1:
            raise ValueError(f"unknown version {doc.get('version')!r}")
        members = tuple(
            Member(
                node=str(m["node"]),
                addr=str(m["addr"]),
                port=int(m["port"]),
                probe=int(m.get("probe", 0)),
                incarnation=str(m.get("incarnation", "")),
            )
            for m in doc["members"]
        )
        return World(
            run_id=str(doc["run_id"]), round=int(doc["round"]), members=members, revision=revision
        )
    except (ValueError, KeyError, TypeError, AttributeError) as exc:
        raise RendezvousState(f"rendezvous world record is not valid: {exc}") from exc


def build_world(
    *,
    run_id: str,
    round_: int,
    previous: World | None,
    joined: Mapping[str, tuple[int, Member]],
    max_nodes: int,
    arrange: Callable[[Sequence[str], Sequence[str]], Sequence[str]] | None = None,
) -> tuple[World, list[str]]:
    """The world to write for ``round_`` from the joins ``node -> (join revision, member)``,
    its order rearranged by ``arrange`` (see ``RendezvousSettings.arrange``)."""
    order, waiting = order_members(
        previous.nodes if previous else (), {n: rev for n, (rev, _) in joined.items()}, max_nodes
    )
    if arrange is not None and previous is not None:
        order = arranged(arrange, previous.nodes, order)
    members = tuple(joined[n][1] for n in order)
    return World(run_id=run_id, round=round_, members=members), waiting


def pending_previous(
    previous: World | None, live_old_joins: Collection[str], gone: Collection[str] = ()
) -> int:
    """How many members of the previous world are alive but have not re-joined yet;
    ``gone``: members known dead although their lease lives on (a refused probe), or
    leaving (preempted: they will not re-join, whatever their lease says)."""
    if previous is None or not live_old_joins:
        return 0
    return sum(1 for n in previous.nodes if n in live_old_joins and n not in gone)


# -- what makes a running world stale -------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Change:
    """Why the current world is no longer current: ``kind`` is ``lost`` (members whose key
    vanished: crash, leave, or re-join), ``waiting`` (nodes joined the next round),
    ``lease-lost`` (our own membership expired) or ``closed``. ``round``: the round of
    the world it was judged against (0: none), which a callback must check: a change
    judged just before this node became a member of the next world reaches the
    callback after it, and is about the world before."""

    kind: str
    nodes: tuple[str, ...] = ()
    round: int = 0


def world_changes(
    *,
    world: World | None,
    members: Collection[str],
    me: str,
    live: Collection[str],
    next_round: Collection[str],
    still_joined: bool,
    closed: bool,
) -> list[Change]:
    """The changes to report for our current ``world`` (``members`` = its node set) given
    the live joins of its round and of the next one."""
    if closed:
        return [Change("closed")]
    if world is None:
        return []
    out = []
    lost = tuple(n for n in world.nodes if n != me and n not in live)
    if lost:
        out.append(Change("lost", lost))
    waiting = tuple(sorted(n for n in next_round if n != me))
    waiting += tuple(sorted(n for n in live if n not in members))
    if waiting:
        out.append(Change("waiting", waiting))
    if me not in live and still_joined:
        out.append(Change("lease-lost", (me,)))
    return out
