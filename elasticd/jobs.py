"""The job registry in etcd: specs, states and status, all JSON.

Keys (``<job>`` is the job name)::

    /elasticd/jobs/<job>/spec     the validated job (JobSpec.to_dict), paths absolute
    /elasticd/jobs/<job>/state    {"state": "running", "since": 1732..., "reason": "..."}
    /elasticd/jobs/<job>/status   world, layout, round, step, loss, checkpoint, restarts,
                                  last failure, and a bounded history of world changes
                                  and recoveries
    /elasticd/jobs/<job>/failures/<round>
                                  why round <round> ended early, written once by whichever
                                  agent saw it first (so a failure is counted once)
    /elasticd/jobs/<job>/failures/<round>/cause
                                  the cause as the agent that saw it first-hand tells it,
                                  when a peer's claim came first (its workers' collectives
                                  failing on the cause); the next world's node rank 0 puts
                                  it in the claim's place in the history
                                  (both deleted, every 16 rounds, for the rounds before
                                  the previous one: ``prune_failures``)

``state`` also holds the ``run_id`` of this submission (``<job>-<8 hex>``): the rendezvous
of a replaced job starts fresh rather than finding the old run closed; and ``submitted``,
the submission time, which orders the queue.

**Fencing.** A write made on behalf of a rendezvous round passes a :class:`Fence`: the
run's world key and the mod revision it had when that round's world was written. The
write is one transaction that also compares the world key, so once a newer world exists
every write of an older round is refused with :class:`FencedError`. That is what stops a
node that froze and thawed after the world moved on from overwriting a newer world's state.

Every read-modify-write is a compare-and-set on the key's ``mod_revision``, retried on
conflict, so several agents may update one job at once and nothing is lost. The legal
state changes are in one table, :data:`TRANSITIONS`; a change outside it is refused, which
is what makes ``cancel`` win against an agent that would mark the job succeeded a moment
later (or the reverse: a finished job cannot be cancelled).
"""

from __future__ import annotations

import enum
import json
import re
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

from elasticd.errors import ElasticdError, EtcdError, UsageError
from elasticd.jobspec import JobSpec, parse_job

PREFIX = "/elasticd/jobs/"
NODES_PREFIX = "/elasticd/nodes/"
"""Where agents register (``<id>``: a JSON record on the agent's lease). Every agent
watches it, so a record is written once per lease and holds only what does not change:
the node's identity, its slots and the commands it runs."""
USAGE_PREFIX = "/elasticd/usage/"
"""What changes about an agent (``<id>``: its free slots and the jobs it holds, on the
same lease). Only the coordinator (the live agent with the lowest id) watches it."""
HISTORY_LIMIT = 100
"""World changes and recoveries kept in a job's status (oldest dropped first)."""
HISTORY_BYTES = 32 * 1024
"""...and at most this many bytes of them as JSON, so a status stays far below etcd's
1.5 MiB request limit whatever the cluster's size (events carry no node lists)."""


class FencedError(ElasticdError):
    """A write on behalf of a round that is no longer the run's current one."""


@dataclass(frozen=True, slots=True)
class Fence:
    """The token of one round: its world key and the mod revision it was written at."""

    key: str
    """The run's rendezvous world key."""
    mod: int
    """Its mod revision when our round's world was written."""
    round: int = 0
    """The round (for messages)."""


class JobState(enum.StrEnum):
    PENDING = "pending"
    """Submitted; no world has formed yet."""
    QUEUED = "queued"
    """Submitted, but the registered agents cannot fit it now; ``reason`` says why."""
    RUNNING = "running"
    """Workers are training in a formed world."""
    RECOVERING = "recovering"
    """A failure or a world change is being handled: stop, re-rendezvous, respawn."""
    SUCCEEDED = "succeeded"
    """Every worker exited 0."""
    FAILED = "failed"
    """Restarts exhausted, or the job could not run at all."""
    CANCELLED = "cancelled"
    """`elasticd cancel` stopped it."""

    @property
    def terminal(self) -> bool:
        return self in (JobState.SUCCEEDED, JobState.FAILED, JobState.CANCELLED)


_S = JobState
_REASON_FOLLOWS = frozenset({JobState.QUEUED, JobState.RUNNING})
"""States whose reason is rewritten while the job stays in them."""

TRANSITIONS: dict[JobState, frozenset[JobState]] = {
    _S.PENDING: frozenset({_S.QUEUED, _S.RUNNING, _S.FAILED, _S.CANCELLED}),
    _S.QUEUED: frozenset({_S.PENDING, _S.RUNNING, _S.FAILED, _S.CANCELLED}),
    _S.RUNNING: frozenset({_S.RECOVERING, _S.SUCCEEDED, _S.FAILED, _S.CANCELLED}),
    _S.RECOVERING: frozenset({_S.RUNNING, _S.SUCCEEDED, _S.FAILED, _S.CANCELLED}),
    _S.SUCCEEDED: frozenset(),
    _S.FAILED: frozenset(),
    _S.CANCELLED: frozenset(),
}


def can_move(old: JobState, new: JobState) -> bool:
    """Whether ``old → new`` is legal; staying put is always allowed (idempotent writes)."""
    return old == new or new in TRANSITIONS[old]


class KV(Protocol):
    """What the registry needs from an etcd client (``elasticd.etcd.client.EtcdClient``)."""

    def get(self, key: str) -> Any: ...
    def get_prefix(self, prefix: str, revision: int = 0) -> tuple[list[Any], int]: ...
    def put(self, key: str, value: bytes | str, lease: int = 0) -> int: ...
    def delete(self, key: str, prefix: bool = False) -> int: ...
    def txn(self, compares: Any, success: Any, failure: Any = ()) -> Any: ...


@dataclass(frozen=True, kw_only=True, slots=True)
class JobRecord:
    """One job as stored: its spec, state and status."""

    name: str
    """The job id."""
    spec: dict[str, Any]
    """The job as plain data (JobSpec.to_dict)."""
    state: JobState
    """Where the job is in its life."""
    since: float
    """Unix time the state was entered."""
    reason: str = ""
    """Why it entered that state (a failure message, 'cancelled by user', ...)."""
    status: dict[str, Any] = field(default_factory=dict)
    """World, layout, step, checkpoint, restarts, last failure, history."""
    run_id: str = ""
    """Rendezvous run id of this submission."""
    submitted: float = 0.0
    """Unix time of the submission (the queue's order)."""

    @property
    def started(self) -> bool:
        """Whether a world of this submission ever formed."""
        return self.status.get("round") is not None

    def job(self) -> JobSpec:
        """The spec parsed back into a JobSpec (validated again)."""
        return parse_job(self.spec, where=f"job {self.name}")

    def to_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "state": str(self.state),
            "since": self.since,
            "reason": self.reason,
            "status": self.status,
            "run_id": self.run_id,
            "submitted": self.submitted,
            "spec": self.spec,
        }


FAILURE_REASONS = ("worker_failed", "worker_hung", "collective_failed")
"""Causes of a round's end that use up a restart, unless the next world shows that a node
was lost (then the failure is a lost node's symptom and is given back)."""


def _number(value: Any) -> float | None:
    """A status field written as a number, or None (missing, or written by hand or by
    another version as something else: a line for people never fails on it)."""
    try:
        return float(value)
    except (TypeError, ValueError, OverflowError):
        return None


def _history(status: dict[str, Any]) -> list[Any]:
    history = status.get("history")
    return history if isinstance(history, list) else []


def shown_restarts(status: dict[str, Any]) -> int:
    """The restarts to show for a job ``status``: those decided. A failure is counted into
    ``restarts`` when it happens, and given back when the next world shows a lost node;
    until then it is pending, and a progress line that showed it would go from 1 back to 0."""
    pending = sum(
        1
        for e in _history(status)
        if isinstance(e, dict) and e.get("kind") == "failure" and not e.get("counted")
        and e.get("reason") in FAILURE_REASONS
    )  # fmt: skip
    restarts = _number(status.get("restarts")) or 0.0
    return max(0, int(restarts) - pending) if restarts < 2**62 else 0


PRUNE_BATCH = 100
"""Keys deleted per transaction (etcd's default limit is 128 operations)."""
FAILURES_PRUNE_EVERY = 16
"""Every this many rounds, the new world's node rank 0 deletes the failure records of the
rounds before the previous one (:meth:`JobRegistry.prune_failures`)."""

TROUBLE_NODES = 32
"""How many nodes' troubles a job's status keeps (the most recent ones)."""


_SOURCE_PATH = re.compile(r"\[/[^\]\s]*:\d+\]")


def brief(detail: str, limit: int = 160) -> str:
    """``detail`` for a line: a source position (gloo's ``[/.../pair.cc:537]``) as
    ``[...]``, and at most ``limit`` characters."""
    detail = _SOURCE_PATH.sub("[...]", detail)
    return detail if len(detail) <= limit else detail[: limit - 3] + "..."


RECOVERY_PARTS = ("failed_attempts", "stop", "abort", "rendezvous", "spawn", "pg_init",
                  "ckpt_load", "state_transfer", "first_step")  # fmt: skip
"""The parts of a recovery record (``parts``), in the order they happen.
``failed_attempts``: only after a recovery that failed before its first step (a second
fault during it): from the first fault's detection to the last one's."""


def last_recovery(status: dict[str, Any]) -> dict[str, Any] | None:
    """The newest recovery record in a job's ``status`` history, if any."""
    events = [e for e in _history(status) if isinstance(e, dict)
              and e.get("kind") == "recovery"]  # fmt: skip
    return events[-1] if events else None


def recovery_text(event: dict[str, Any]) -> str:
    """One recovery record for people: where to, why, how, what it lost, its parts."""
    parts = event.get("parts")
    parts = parts if isinstance(parts, dict) else {}
    timed = ", ".join(f"{k} {v:.2f}" for k in RECOVERY_PARTS
                      if (v := _number(parts.get(k))) is not None)  # fmt: skip
    how = f"{event.get('mode', '?')} from {event.get('source', '?')}"
    seconds = _number(event.get("seconds"))
    took = f"{seconds:.2f} s" if seconds is not None else "? s"
    attempts = event.get("attempts")
    tries = f" in {attempts} attempts" if type(attempts) is int and attempts > 1 else ""
    since = "the first failure's detection" if tries else "detection"
    return (f"into round {event.get('round')} ({event.get('reason')}), {how}, "
            f"{event.get('lost_steps', '?')} steps lost, {took}{tries} from {since} to its "
            "first step" + (f" ({timed})" if timed else ""))  # fmt: skip


def _trouble_time(entry: Any) -> float:
    t = _number(entry.get("t", 0)) if isinstance(entry, dict) else None
    return t if t is not None else 0.0


def event_lines(
    status: dict[str, Any], seen: set[tuple], *, final: bool = False, now: float | None = None
) -> list[str]:
    """Lines for people about what ``status`` tells that ``seen`` (updated here) has not
    had yet: each round's failure once it is decided (the next world tells whether it
    was a lost node's symptom; ``final``, the job over: every failure), and each node's
    trouble (a round it could not run, its job runner's crash) while the job is not over.
    A progress line says only "restarts 5"; these say why. Live (``now`` None) a trouble
    says when the node tries again; read later (``now`` given), how long ago it was."""
    lines = []
    for e in _history(status):
        if not isinstance(e, dict) or e.get("kind") != "failure":
            continue
        key = ("failure", repr(e.get("round")), repr(e.get("t")))  # hashable, whatever they are
        if key in seen or not (e.get("counted") or final):
            continue
        seen.add(key)
        lines.append(f"  round {e.get('round')} ended: {e.get('reason')}: "
                     f"{brief(str(e.get('detail', '')))} [seen by {e.get('node', '?')}]")  # fmt: skip
    troubles = status.get("troubles")
    if isinstance(troubles, dict) and not final:
        for node, tr in sorted(troubles.items(), key=lambda kv: _trouble_time(kv[1])):
            if not isinstance(tr, dict):
                continue
            key = ("trouble", node, repr(tr.get("t")))
            if key in seen:
                continue
            seen.add(key)
            count = _number(tr.get("count")) or 1.0
            times = f" ({count:.0f} times in a row)" if count > 1 else ""
            retry = _number(tr.get("retry_in")) or 0.0
            when = (f"trying again in {retry:g} s" if now is None else
                    f"{max(0.0, now - _trouble_time(tr)):.0f} s ago (it tries again {retry:g} s "
                    "after each)")  # fmt: skip
            lines.append(f"  {node}: {tr.get('what')}{times}: {brief(str(tr.get('error')))}; "
                         f"{when}")  # fmt: skip
    return lines


def _key(name: str, part: str) -> str:
    return f"{PREFIX}{name}/{part}"


def _load(raw: bytes, what: str) -> Any:
    try:
        return json.loads(raw)
    except (ValueError, UnicodeDecodeError) as exc:
        raise EtcdError(f"{what}: stored value is not JSON") from exc


def _dump(obj: Any) -> str:
    return json.dumps(obj, separators=(",", ":"), sort_keys=True)


def bound_history(history: list[Any]) -> list[Any]:
    """The newest events within HISTORY_LIMIT entries and HISTORY_BYTES of JSON."""
    kept = history[-HISTORY_LIMIT:]
    size = 0
    for i in range(len(kept) - 1, -1, -1):
        size += len(_dump(kept[i])) + 1
        if size > HISTORY_BYTES:
            return kept[i + 1 :]
    return kept


def record_from_parts(name: str, parts: dict[str, bytes]) -> JobRecord | None:
    """A job from its stored keys (``spec``, ``state``, ``status``), or None without a spec."""
    if "spec" not in parts:
        return None
    state = _load(parts.get("state", b"{}"), f"job {name} state")
    status = _load(parts["status"], f"job {name} status") if "status" in parts else {}
    try:
        job_state = JobState(state.get("state", "pending"))
    except ValueError as exc:
        raise EtcdError(f"job {name}: unknown state {state.get('state')!r}") from exc
    return JobRecord(
        name=name,
        spec=_load(parts["spec"], f"job {name} spec"),
        state=job_state,
        since=float(state.get("since", 0.0)),
        reason=str(state.get("reason", "")),
        status=status,
        run_id=str(state.get("run_id", name)),
        submitted=float(state.get("submitted", state.get("since", 0.0))),
    )


def split_key(key: str) -> tuple[str, str] | None:
    """``(job, part)`` of a key under PREFIX (part may contain '/'), or None."""
    if not key.startswith(PREFIX):
        return None
    name, _, part = key[len(PREFIX) :].partition("/")
    return (name, part) if name and part else None


class JobRegistry:
    """Reads and writes jobs in etcd through an injected client and clock."""

    def __init__(self, client: KV, *, clock: Callable[[], float] = time.time) -> None:
        self._client = client
        self._clock = clock

    # -- submit, read ------------------------------------------------------------------------

    def submit(self, job: JobSpec, *, replace: bool = False) -> JobRecord:
        """Store a new job as pending; an existing name is refused unless ``replace``.

        With ``replace`` a running job must be cancelled first (agents would otherwise
        keep training the old spec); a finished one is overwritten, status and all.
        """
        from elasticd.etcd import compare, delete_op, put_op

        now = self._clock()
        state = {
            "state": str(JobState.PENDING),
            "since": now,
            "reason": "submitted",
            "run_id": f"{job.name}-{uuid.uuid4().hex[:8]}",
            "submitted": now,
        }
        writes = [
            put_op(_key(job.name, "spec"), _dump(job.to_dict())),
            put_op(_key(job.name, "state"), _dump(state)),
            put_op(_key(job.name, "status"), _dump({"restarts": 0, "history": []})),
        ]
        spec_key = _key(job.name, "spec")
        result = self._client.txn([compare(spec_key, "version", "==", 0)], writes)
        if not result.succeeded:
            old = self.get(job.name)
            if not replace:
                active = old is not None and not old.state.terminal
                raise UsageError(
                    f"job {job.name!r} already exists ({old.state if old else 'unknown'}); "
                    + ("--attach follows it, or cancel it first" if active
                       else "use --replace to overwrite it")
                )  # fmt: skip
            if old is not None and not old.state.terminal:
                raise UsageError(f"job {job.name!r} is {old.state}; cancel it before replacing it")
            # Overwriting spec, state and status and dropping the failure records replaces
            # the job whole.
            self._client.txn([], [delete_op(_key(job.name, "failures/"), prefix=True), *writes])
        record = self.get(job.name)
        assert record is not None
        return record

    def get(self, name: str) -> JobRecord | None:
        """The job named ``name``, or None."""
        kvs, _ = self._client.get_prefix(_key(name, ""))
        parts = {kv.key.rsplit("/", 1)[-1]: kv.value for kv in kvs}
        return record_from_parts(name, parts)

    def list(self) -> list[JobRecord]:
        """Every job, sorted by name."""
        kvs, _ = self._client.get_prefix(PREFIX)
        by_job: dict[str, dict[str, bytes]] = {}
        for kv in kvs:
            name, _, part = kv.key[len(PREFIX) :].partition("/")
            by_job.setdefault(name, {})[part] = kv.value
        records = (record_from_parts(name, parts) for name, parts in sorted(by_job.items()))
        return [r for r in records if r is not None]

    def node_count(self) -> int:
        """Agents registered now (their leases alive)."""
        return len(self._client.get_prefix(NODES_PREFIX)[0])

    def delete(self, name: str, *, rendezvous_prefix: str = "/elasticd/rdzv/") -> JobRecord:
        """Remove a finished job: its keys and its run's rendezvous keys. A job that is
        still pending or running is refused (cancel it first); the delete compares the
        state key, so a job resubmitted meanwhile is left alone."""
        from elasticd.etcd import compare, delete_op

        state_kv = self._client.get(_key(name, "state"))
        record = self.get(name)
        if record is None or state_kv is None:
            raise UsageError(f"job {name!r}: no such job")
        if not record.state.terminal:
            raise UsageError(f"job {name!r} is {record.state}; cancel it before deleting it")
        ops = [delete_op(_key(name, ""), prefix=True)]
        if record.run_id and "/" not in record.run_id:
            ops.append(delete_op(f"{rendezvous_prefix.rstrip('/')}/{record.run_id}/", prefix=True))
        state_key = _key(name, "state")
        done = self._client.txn([compare(state_key, "mod", "==", state_kv.mod_revision)], ops)
        if not done.succeeded:
            raise UsageError(f"job {name!r} changed while deleting it; try again")
        return record

    # -- changes -----------------------------------------------------------------------------

    def _check_fence(self, fence: Fence | None) -> None:
        if fence is None:
            return
        current = self._client.get(fence.key)
        mod = current.mod_revision if current is not None else 0
        if mod != fence.mod:
            raise FencedError(
                f"round {fence.round} is no longer current (a newer world was formed); "
                "write refused"
            )

    def _update(
        self, key: str, change: Callable[[Any], Any | None], what: str, fence: Fence | None = None
    ) -> Any:
        """Compare-and-set read-modify-write of one JSON value; ``change`` returns the new
        value, or None to leave it as it is. Returns the value in force afterwards. With a
        ``fence`` the write also requires that round to be current (else FencedError)."""
        from elasticd.etcd import compare, put_op

        fences = [] if fence is None else [compare(fence.key, "mod", "==", fence.mod)]
        for _ in range(100):
            current = self._client.get(key)
            if current is None:
                raise UsageError(f"{what}: no such job")
            old = _load(current.value, what)
            new = change(old)
            if new is None:
                self._check_fence(fence)
                return old
            ok = self._client.txn(
                [compare(key, "mod", "==", current.mod_revision), *fences],
                [put_op(key, _dump(new))],
            ).succeeded
            if ok:
                return new
            self._check_fence(fence)
        raise EtcdError(f"{what}: too many concurrent updates")

    def set_state(
        self, name: str, new: JobState, reason: str = "", *, fence: Fence | None = None
    ) -> bool:
        """Move the job to ``new`` if the transition table allows it; returns whether the
        job is in ``new`` afterwards (a refused change returns False and writes nothing)."""
        now = self._clock()

        def change(old: dict[str, Any]) -> dict[str, Any] | None:
            cur = JobState(old.get("state", "pending"))
            if cur == new and old.get("reason") != reason and new in _REASON_FOLLOWS:
                # A queued job's reason follows the cluster; a running one's names its
                # round (a world re-formed with no recovering state between: `status`
                # said "running (round 4)" over "round 5").
                return {**old, "reason": reason}
            if cur == new or not can_move(cur, new):
                return None
            return {**old, "state": str(new), "since": now, "reason": reason}

        after = self._update(_key(name, "state"), change, f"job {name!r}", fence)
        return after.get("state") == str(new)

    def cancel(self, name: str) -> JobRecord:
        """Mark the job cancelled; the agents see it and stop their workers."""
        record = self.get(name)
        if record is None:
            raise UsageError(f"job {name!r}: no such job")
        if record.state == JobState.CANCELLED:
            return record
        if record.state.terminal:
            raise UsageError(f"job {name!r} already {record.state}; nothing to cancel")
        if not self.set_state(name, JobState.CANCELLED, "cancelled by user"):
            latest = self.get(name)
            raise UsageError(f"job {name!r} is {latest.state if latest else 'gone'}; not cancelled")
        latest = self.get(name)
        assert latest is not None
        return latest

    def update_status(
        self,
        name: str,
        change: Callable[[dict[str, Any]], None],
        *,
        fence: Fence | None = None,
    ) -> dict[str, Any]:
        """Apply ``change`` (which edits the dict in place) to the job's status, atomically."""

        def apply(old: dict[str, Any]) -> dict[str, Any]:
            new = json.loads(json.dumps(old))
            change(new)
            history = new.get("history")
            if isinstance(history, list):
                new["history"] = bound_history(history)
            return new

        return self._update(_key(name, "status"), apply, f"job {name!r} status", fence)

    def add_event(
        self, name: str, event: dict[str, Any], *, fence: Fence | None = None, **fields: Any
    ) -> None:
        """Append ``event`` (with a timestamp) to the history and set ``fields`` too."""
        stamped = {"t": round(self._clock(), 3), **event}

        def change(status: dict[str, Any]) -> None:
            status.setdefault("history", []).append(stamped)
            status.update(fields)

        self.update_status(name, change, fence=fence)

    def note_trouble(self, name: str, run_id: str, node: str, what: str, error: str, *,
                     count: int, retry_in: float) -> None:  # fmt: skip
        """Record that ``node`` could not take part in run ``run_id`` of job ``name``
        (``what`` went wrong: its round failed, or its job runner crashed; ``count`` times in
        a row) and when it tries again: the status's ``troubles``, one entry a node, until
        :meth:`clear_trouble`. The job goes on without that node meanwhile (or waits for
        it), and without this a person sees only a job that does not start. A note of an
        earlier submission of the job (replaced since) is dropped."""
        record = self.get(name)
        if record is None or record.run_id != run_id or record.state.terminal:
            return
        entry = {"t": round(self._clock(), 3), "run_id": run_id, "what": what,
                 "error": error[:500], "retry_in": round(retry_in, 3), "count": count}  # fmt: skip

        def change(status: dict[str, Any]) -> None:
            troubles = status.get("troubles")
            if not isinstance(troubles, dict):
                troubles = status["troubles"] = {}
            troubles[node] = entry
            oldest_first = sorted(troubles, key=lambda n: _trouble_time(troubles[n]))
            for stale in oldest_first[:-TROUBLE_NODES]:
                del troubles[stale]

        self.update_status(name, change)

    def clear_trouble(self, name: str, node: str) -> None:
        """``node`` took part in a world of job ``name`` again: its troubles are over."""
        record = self.get(name)
        if record is None or node not in (record.status.get("troubles") or {}):
            return

        def change(status: dict[str, Any]) -> None:
            troubles = status.get("troubles")
            if isinstance(troubles, dict):
                troubles.pop(node, None)
                if not troubles:
                    del status["troubles"]

        self.update_status(name, change)

    def claim_failure(
        self, name: str, round_: int, info: dict[str, Any], *, fence: Fence | None = None
    ) -> tuple[dict, bool]:
        """Record why round ``round_`` ended, once: ``(the record in force, whether ours)``.

        Every agent of a broken round sees the break in its own way (its worker died, a
        peer vanished); the first to write names the cause and the rest adopt it, so a
        failure counts once against ``restart.max_restarts``.
        """
        return self._put_once(_key(name, f"failures/{round_}"), round_, info, fence)

    def note_cause(
        self, name: str, round_: int, info: dict[str, Any], *, fence: Fence | None = None
    ) -> bool:
        """Record the cause of round ``round_``'s end as the agent that saw it first-hand
        tells it (its worker was killed, hung, or failed on its own), when the claim in
        force came from an agent whose workers only failed on it (``by_peer``). Kept once;
        :meth:`cause_of` reads it. Returns whether this note is the one kept."""
        return self._put_once(_key(name, f"failures/{round_}/cause"), round_, info, fence)[1]

    def note_own_failure(
        self, name: str, round_: int, node: str, info: dict[str, Any], *, fence: Fence | None = None
    ) -> None:
        """Record that ``node``'s own worker ended round ``round_`` (died, hung or failed on
        its own), when neither the claim nor the one note of the cause names it: every
        such node is known (:meth:`own_failures`), not only those two."""
        # "own-<node>": a key's last part names a job record's part in get() ("state",
        # "spec", ...); a node of any name must not pass for one.
        self._put_once(_key(name, f"failures/{round_}/own-{node}"), round_, info, fence)

    def own_failures(self, name: str, round_: int) -> set[str]:
        """The nodes :meth:`note_own_failure` named for round ``round_``."""
        prefix = _key(name, f"failures/{round_}/own-")
        kvs, _ = self._client.get_prefix(prefix)
        return {kv.key[len(prefix) :] for kv in kvs}

    def prune_failures(self, name: str, before: int, *, fence: Fence | None = None) -> int:
        """Delete the failure records (claims and causes) of rounds below ``before``:
        once a later world formed, its node rank 0 has decided them into the history, and
        a stale round's late claim is refused by its fence. Without this a job kept a key
        for every failed round, and every :meth:`get` of it (each agent's, each progress
        poll) read them all. Returns how many keys went."""
        from elasticd.etcd import compare, delete_op

        prefix = _key(name, "failures/")
        kvs, _ = self._client.get_prefix(prefix)
        old = []
        for kv in kvs:
            number = kv.key[len(prefix) :].partition("/")[0]
            if number.isdigit() and int(number) < before:
                old.append(kv.key)
        fences = [] if fence is None else [compare(fence.key, "mod", "==", fence.mod)]
        gone = 0
        for i in range(0, len(old), PRUNE_BATCH):  # etcd caps a transaction's operations
            batch = old[i : i + PRUNE_BATCH]
            if not self._client.txn(fences, [delete_op(k) for k in batch]).succeeded:
                self._check_fence(fence)
                break
            gone += len(batch)
        return gone

    def cause_of(self, name: str, round_: int) -> dict[str, Any] | None:
        """The note of :meth:`note_cause` for round ``round_``, if any."""
        return self._failure_record(name, f"failures/{round_}/cause")

    def claim_of(self, name: str, round_: int) -> dict[str, Any] | None:
        """The claim in force for round ``round_`` (:meth:`claim_failure`), if any."""
        return self._failure_record(name, f"failures/{round_}")

    def _failure_record(self, name: str, part: str) -> dict[str, Any] | None:
        key = _key(name, part)
        kv = self._client.get(key)
        return _load(kv.value, key) if kv else None

    def _put_once(
        self, key: str, round_: int, info: dict[str, Any], fence: Fence | None
    ) -> tuple[dict, bool]:
        from elasticd.etcd import compare, put_op

        record = {"t": round(self._clock(), 3), "round": round_, **info}
        fences = [] if fence is None else [compare(fence.key, "mod", "==", fence.mod)]
        result = self._client.txn(
            [compare(key, "version", "==", 0), *fences], [put_op(key, _dump(record))]
        )
        if result.succeeded:
            return record, True
        self._check_fence(fence)
        current = self._client.get(key)
        return (_load(current.value, key) if current else record), False
