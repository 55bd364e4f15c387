"""Faults keyed to a step *and* a phase of it, fired from inside the workers.

``elasticd run --fault`` and ``elasticd.testing`` fire a plain ``kind=T@step=S`` fault from
outside, once the job's metrics say step S completed: it lands somewhere in step S+1 or
S+2, wherever the workers happen to be. A fault with a phase
(``kill-worker=1@step=5:phase=checkpoint-save``) lands exactly there, because the workers
fire it themselves: the worker-side API (:meth:`elasticd.worker.WorkerChannel.phase`) is
told when a rank enters a phase of a step, and looks the pair up in the run's **fault
plan** (``ELASTICD_FAULT_PLAN``, a JSON file the local cluster writes before the agents
start; they pass it on to their workers).

- ``step`` in a phase fault is the step *in progress* (1-based, as ``progress`` reports it
  once done); for ``checkpoint-save`` it is the step being saved. For ``recover`` it is
  the first in-process recovery at that step *or a later one*, the step being the one the
  state is recovered at (the newest step any rank of the new world completed): which
  step a recovery agrees on depends on where the fault before it landed (a plain
  ``kill-node=1@step=10`` lands in some later step), so an exact step could miss it. Any
  in-process re-form with state held enters the phase (after a fault, a scale-up, a
  preemption): the first such one at that step or later fires it.
- Phases: ``forward``, ``backward``, ``optimizer``, ``update`` (every collective before
  the step's optimizer update done, the update not applied; under ZeRO-1 the parameters'
  all-gather comes after it), ``step-end``, ``checkpoint-save``, ``recover`` (an
  in-process recovery: the world re-formed, its process groups made, the step agreed,
  the state not yet moved from the survivors' memory; the built-in trainer and
  ``Context.sync_state``). A node fault there is a second fault during a recovery.
- Who fires: the target rank for kill-worker, hang-worker, raise-error and fail-collective
  (it SIGKILLs or SIGSTOPs itself, or raises :class:`InjectedFault` or
  :class:`InjectedCollectiveFault`); for the node faults (kill-node, term-node,
  freeze-node, restart-node), the target node's rank that gets there last: each rank of
  the node marks its arrival (``arrived-<id>-<rank>``), and the node is hit once all
  ``LOCAL_WORLD_SIZE`` have, or NODE_GATHER_WAIT after the first (a rank that never
  enters the phase, a spare, only delays it), so that none of the node's ranks is still
  inside a collective its peers on other nodes need; rank 0 for add-node and the etcd
  faults. The firing rank creates ``fired-<id>`` (exclusively: a fault fires once, even if
  a recovery trains that step again) and, for a fault the cluster carries out, waits in the
  phase until the cluster has done it (``acked-<id>``), so the fault hits that phase and
  not a later one.
- ``raise-error=RANK@step=S`` without a phase raises when rank RANK reports step S done
  (inside its training loop): it tests the script's own error handling.
- ``fail-collective=RANK@step=S`` is what rank RANK sees when a collective fails under it
  (a peer died): an error counted as a communication failure, so in-process restart
  recovers the rank in its process. With a phase, it first waits (up to ACK_WAIT) until
  the node faults planned for the same step and phase have been carried out (without one
  it raises when the step is reported done, and waits for nothing): with
  ``kill-node=1@step=5:phase=update`` beside it, the rank stops where a real fault can
  leave one rank while its peers go on (they applied step 5, it did not).

Everything here is the standard library: the worker imports it on every start.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from collections.abc import Callable, Mapping
from typing import Any

ENV_PLAN = "ELASTICD_FAULT_PLAN"
"""Path of the run's fault plan (set by the local cluster on its agents)."""
ENV_NODE = "ELASTICD_NODE_ID"
"""The node id of the agent that started this worker (set by the local cluster)."""
PHASES = (
    "forward", "backward", "optimizer", "update", "step-end", "checkpoint-save", "recover",
)  # fmt: skip
SELF_KINDS = frozenset({"kill-worker", "hang-worker", "raise-error", "fail-collective"})
"""Faults a worker carries out on itself."""
RAISING_KINDS = frozenset({"raise-error", "fail-collective"})
"""Self faults that raise, and so may fire without a phase (when the step is reported)."""
NODE_KINDS = frozenset({"kill-node", "term-node", "freeze-node", "restart-node"})
ACK_WAIT = 120.0
"""Seconds a firing worker waits in its phase for the cluster to carry the fault out."""
TERM_WAIT = 30.0
"""Seconds a term-node's firing worker then waits for the SIGTERM its agent passes on."""
NODE_GATHER_WAIT = 10.0
"""Seconds a node fault with a phase waits for all the node's ranks to enter the phase."""


class InjectedFault(Exception):
    """Raised inside a rank's training step by a ``raise-error`` fault."""


class InjectedCollectiveFault(ConnectionError):
    """Raised inside a rank's training step by a ``fail-collective`` fault: a collective
    failing under the rank, as when a peer dies (``elasticd.inprocess.is_comm_error``
    counts it as one)."""


def worker_side(fault: Any) -> bool:
    """Whether ``fault`` (a localcluster.Fault) is fired by the workers (it has a phase, or
    only a worker can do it) rather than by the cluster once a step completed."""
    return fault.phase is not None or fault.kind in RAISING_KINDS


def write_plan(directory: str, faults: list[Any]) -> str:
    """Write the plan of the worker-fired ``faults`` under ``directory``; returns its path.
    Each fault's id is its index in the list."""
    os.makedirs(os.path.join(directory, "fired"), exist_ok=True)
    entries = [{"id": i, "fault": str(f), "kind": f.kind, "target": f.target, "step": f.step,
                "phase": f.phase} for i, f in enumerate(faults)]  # fmt: skip
    path = os.path.join(directory, "plan.json")
    tmp = path + ".tmp"
    with open(tmp, "w", encoding="utf-8") as fh:
        json.dump({"faults": entries}, fh)
    os.replace(tmp, path)
    return path


class WorkerFaults:
    """One worker's view of the plan: cheap when there is none (one dict lookup)."""

    def __init__(self, env: Mapping[str, str]) -> None:
        self.entries: list[dict[str, Any]] = []
        path = env.get(ENV_PLAN)
        if path:
            try:
                with open(path, encoding="utf-8") as fh:
                    self.entries = list(json.load(fh)["faults"])
            except (OSError, ValueError, KeyError):
                self.entries = []
            self.dir = os.path.join(os.path.dirname(path), "fired")
        self.rank = int(env.get("RANK", "0") or 0)
        try:
            self.local_world = max(1, int(env.get("LOCAL_WORLD_SIZE", "1") or 1))
        except ValueError:
            self.local_world = 1
        self.node = env.get(ENV_NODE, "")
        self.round = env.get("ELASTICD_ROUND", "")

    def at(self, phase: str | None, step: int, preempted: Callable[[], bool] | None = None) -> None:
        """This rank is entering ``phase`` of step ``step`` (None: it reported the step
        done). Fires any planned fault of this rank there; may not return.
        ``preempted``: whether this worker's SIGTERM arrived (a term-node fault waits for
        it, so the preemption lands in this phase, not a step later)."""
        for entry in self.entries:
            if entry["phase"] != phase or not self._mine(entry):
                continue
            if entry["step"] == step or (phase == "recover" and step > entry["step"]):
                self._fire(entry, preempted, step)

    def _mine(self, entry: Mapping[str, Any]) -> bool:
        kind = entry["kind"]
        if kind in SELF_KINDS:
            return entry["target"] == self.rank
        if kind in NODE_KINDS:
            return self.node == f"node-{entry['target']}"
        return self.rank == 0

    def _wait_node_faults(self, entry: Mapping[str, Any]) -> None:
        """Wait until every node fault planned for ``entry``'s step and phase has been
        carried out (up to ACK_WAIT)."""
        others = [e for e in self.entries if e["kind"] in NODE_KINDS
                  and (e["step"], e["phase"]) == (entry["step"], entry["phase"])]  # fmt: skip
        deadline = time.monotonic() + ACK_WAIT
        while not all(_acked(self.dir, e) for e in others):
            if time.monotonic() > deadline:
                print(f"elasticd: fault {entry['fault']}: the node faults beside it were not "
                      f"carried out within {ACK_WAIT:g} s; going on", file=sys.stderr, flush=True)  # fmt: skip
                return
            time.sleep(0.005)

    def _gather_node(self, entry: Mapping[str, Any], fired: str) -> None:
        """A node fault with a phase: mark this rank's arrival, then wait until every rank
        of the node has arrived (up to NODE_GATHER_WAIT), or one of them fired it."""
        if self.local_world <= 1 or entry["phase"] is None:
            return
        prefix = f"arrived-{entry['id']}-"
        try:
            with open(os.path.join(self.dir, f"{prefix}{self.rank}"), "w", encoding="utf-8"):
                pass
        except OSError:
            return  # the run's directory is gone
        deadline = time.monotonic() + NODE_GATHER_WAIT
        while not os.path.exists(fired):
            try:
                arrived = sum(n.startswith(prefix) for n in os.listdir(self.dir))
            except OSError:
                return
            if arrived >= self.local_world:
                return
            if time.monotonic() > deadline:
                print(f"elasticd: fault {entry['fault']}: {arrived} of the node's "
                      f"{self.local_world} ranks entered the phase within "
                      f"{NODE_GATHER_WAIT:g} s; firing", file=sys.stderr, flush=True)  # fmt: skip
                return
            time.sleep(0.005)

    def _fire(
        self, entry: Mapping[str, Any], preempted: Callable[[], bool] | None, step: int
    ) -> None:
        name = os.path.join(self.dir, f"fired-{entry['id']}")
        if entry["kind"] in NODE_KINDS:
            self._gather_node(entry, name)
        try:
            fd = os.open(name, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        except FileExistsError:
            return  # fired already (by a peer on the node, or before a recovery)
        except OSError:
            return  # the run's directory is gone: nobody is listening
        record = {"rank": self.rank, "pid": os.getpid(), "node": self.node, "t": time.time(),
                  "round": self.round, "step": step}  # fmt: skip
        with os.fdopen(fd, "w", encoding="utf-8") as fh:
            json.dump(record, fh)
        kind, where = (
            entry["kind"],
            f"step {step}" + (f" {entry['phase']}" if entry["phase"] else " done"),
        )
        if kind == "kill-worker":
            os.kill(os.getpid(), signal.SIGKILL)
        if kind == "hang-worker":
            os.kill(os.getpid(), signal.SIGSTOP)
            return
        if kind == "raise-error":
            raise InjectedFault(f"injected fault {entry['fault']} (rank {self.rank}, {where})")
        if kind == "fail-collective":
            self._wait_node_faults(entry)
            raise InjectedCollectiveFault(
                f"injected fault {entry['fault']}: a collective failed (rank {self.rank}, {where})"
            )
        deadline = time.monotonic() + ACK_WAIT
        while not _acked(self.dir, entry):
            if time.monotonic() > deadline:
                print(f"elasticd: fault {entry['fault']}: the cluster did not carry it out "
                      f"within {ACK_WAIT:g} s; going on", file=sys.stderr, flush=True)  # fmt: skip
                return
            time.sleep(0.005)
        if kind == "term-node" and preempted is not None:
            # The agent passes SIGTERM on to its workers a moment later: wait for ours.
            deadline = time.monotonic() + TERM_WAIT
            while not preempted() and time.monotonic() < deadline:
                time.sleep(0.005)


def _acked(directory: str, entry: Mapping[str, Any]) -> bool:
    return os.path.exists(os.path.join(directory, f"acked-{entry['id']}"))


class PlanSource:
    """The cluster's side, a fault source for ``run_cluster``: the step-keyed faults fire
    as before (``outside``); a worker-fired one is returned for injection once its
    ``fired-<id>`` appears, and acknowledged once injected (:meth:`fault_injected`); one the
    worker carried out itself is only entered into the cluster's fault log."""

    def __init__(self, directory: str, planned: list[Any], outside: Any) -> None:
        self.dir = os.path.join(directory, "fired")
        self.planned = planned
        self.outside = outside
        self.seen: set[int] = set()
        self.ids: dict[int, int] = {}  # id(fault object) -> plan id
        self.steps: dict[int, int] = {}  # id(fault object) -> the step its rank was in

    def unfired(self) -> list[tuple[Any, str]]:
        """(fault, why) for each fault that never fired: no rank reached its step and
        phase (the script never calls ``phase`` there, the step is not a save step, the
        job ended first), or, for the cluster's own, the job ended before its step."""
        out = []
        for i, fault in enumerate(self.planned):
            if i in self.seen or os.path.exists(os.path.join(self.dir, f"fired-{i}")):
                continue
            where = f"the {fault.phase} phase" if fault.phase else "the end"
            if fault.kind in SELF_KINDS:
                who = f"rank {fault.target} never reached"
            elif fault.kind in NODE_KINDS:
                who = f"no rank of node {fault.target} reached"
            else:
                who = "rank 0 never reached"
            which = f"step {fault.step}" + (" or later" if fault.phase == "recover" else "")
            # A script's phases are its own calls: the likeliest miss is one it never makes.
            hint = (f" (a script marks it with channel.phase({fault.phase!r}, {fault.step}))"
                    if fault.phase and fault.phase != "recover" else "")  # fmt: skip
            out.append((fault, f"{who} {where} of {which}{hint}"))
        return out + self.outside.unfired()

    def due(self, view: Any) -> list[Any]:
        out = list(self.outside.due(view))
        for i, fault in enumerate(self.planned):
            if i in self.seen:
                continue
            try:
                with open(os.path.join(self.dir, f"fired-{i}"), encoding="utf-8") as fh:
                    fired = json.load(fh)
            except (OSError, ValueError):
                continue  # not fired yet (or half written: next poll)
            self.seen.add(i)
            if fault.kind in SELF_KINDS:
                verb = {"kill-worker": "SIGKILLed itself", "hang-worker": "SIGSTOPped itself",
                        "raise-error": "raised InjectedFault",
                        "fail-collective": "raised InjectedCollectiveFault"}[fault.kind]  # fmt: skip
                phase = f" in {fault.phase}" if fault.phase else " after it"
                at = fired.get("step", fault.step)  # a recover fault's: the step it hit
                record = {"fault": str(fault), "kind": fault.kind, "t": fired.get("t"),
                          "end": None, "step": at, "pid": fired.get("pid"),
                          "detail": f"rank {fired.get('rank')} {verb} at step {at}{phase}"}  # fmt: skip
                with view.cluster.lock:
                    view.cluster.fault_log.append(record)
                continue
            self.ids[id(fault)] = i
            self.steps[id(fault)] = int(fired.get("step", fault.step))
            out.append(fault)
        return out

    def step_of(self, fault: Any) -> int | None:
        """The step in progress where a worker asked for ``fault`` (its phase's step; for
        ``recover``, the step it hit); None for a fault fired from outside."""
        return self.steps.get(id(fault))

    def fault_injected(self, fault: Any, record: dict[str, Any]) -> None:
        i = self.ids.pop(id(fault), None)
        if i is None:
            return
        path = os.path.join(self.dir, f"acked-{i}")
        with open(path, "w", encoding="utf-8") as fh:
            json.dump({"t": time.time(), "detail": record.get("detail", "")}, fh)
