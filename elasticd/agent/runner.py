"""One job on one node: rendezvous → plan → spawn → supervise → react, round after round.

The loop (docs/agent.md has the user-facing version):

1. join the job's rendezvous (``etcd-v3``) and wait for a world with this node in it;
2. plan the layout for ``nodes × nproc`` ranks (pure, identical on every node), write it
   and the job spec to this round's run dir;
3. spawn the workers with torchrun's environment plus ``ELASTICD_*``;
4. supervise: every tick, gather an Observation and let ``policy.decide`` judge it;
5. stop the workers the way the outcome needs, record the cause once (the failure claim),
   back off after a failure, and go to 1 — or finish.

Node rank 0 of each world is the job's reporter: it writes state, world, layout, step,
loss and checkpoint into the job's status, and the recovery record (with its parts) once
the first step after a re-form completes. Every such write is fenced by the round.

What fails the job, and what does not (docs/agent.md, "Failure rules"):

- the restart limit, a worker's user error (exit code 2) and cancellation fail or end the
  job; nothing else does;
- an error in this node's own round (etcd away at a round boundary, a log dir that cannot
  be made, a bug) is this node's trouble: it is logged, the node leaves the round cleanly
  (workers stopped, membership revoked) and joins again after a back-off;
- a node outside the running world (a spare beyond ``nodes.max``, or one waiting for a
  scale-up) waits for as long as the job runs; ``rendezvous.join_timeout`` fails the job
  only when a world that ran cannot re-form with ``nodes.min`` nodes.

The job's state comes from the agent's watch-fed :class:`~elasticd.agent.view.ClusterView`,
never from polling etcd.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import logging
import os
import queue
import threading
import time
from collections.abc import Callable
from typing import Any

from elasticd.agent.forkserver import pid_now
from elasticd.agent.launch import NodeInfo, Round, control_path, launch, write_control
from elasticd.agent.policy import (
    FINISH_WAIT,
    USER_ERROR_EXIT_CODE,
    Observation,
    Outcome,
    crash_loop_pause,
    decide,
    failed_on_a_peer,
    hang_bound,
    latest_checkpoint_step,
    pending_limit_verdict,
    stop_plan,
)
from elasticd.agent.report import EVENTS_FILE, FAILURE_REASONS, JobReporter
from elasticd.agent.workers import Worker
from elasticd.errors import ElasticdError
from elasticd.jobs import Fence, FencedError, JobRecord, JobRegistry, JobState
from elasticd.jobspec import JobSpec
from elasticd.log import kv
from elasticd.metrics import AgentMetrics
from elasticd.worker import ENV_DOORBELL, PREEMPTED_EXIT_CODE, Doorbell, read_heartbeat, ring

log = logging.getLogger("elasticd.agent")

FORK_SERVER_RESTARTS = 3
"""How many times a run's fork server that stopped after it was ready is started again on
a node; past that its workers are exec'd."""
TICK = 0.05
"""Seconds between supervision ticks: worker exits act this fast; a worker's fault and an
etcd watch's change ring the doorbell and act at once."""
STATUS_EVERY = 3.0
"""Seconds between progress writes into the job's status (only when the step moved)."""
NODE_TROUBLE_BACKOFF_CAP = 10.0
"""At most this many seconds between re-joins after this node's own errors."""
STANDBY_BACKOFF_CAP = 300.0
"""Seconds at most between starts of a standby worker that keeps exiting on its own."""
WARM_WAIT = 120.0
"""Seconds a joining node waits for its warm workers' imports before it asks for a round."""
STACK_DUMP_WAIT = 0.3
"""Seconds the agent gives its workers to print their stacks (SIGUSR1) before it kills a
hung round's."""
ROUND_BEGIN_TIMEOUT = 120.0
"""Seconds at least the workers of an in-process round that kept workers may take to take
it (their ``begun`` heartbeat) and open its process group (``pg_ready``); the bound is
``max(this, restart.hang_timeout)``. A carried worker must first leave the round before,
which takes the rest of a step (a step or a synchronous save may take up to
``hang_timeout`` without a collective that would notice the abort) and the group's
teardown; the group then waits for every peer, a replacement's start included. A worker
that never gets there (seen: a final checkpoint save whose gloo collective never noticed
its sockets shut; a group set-up whose store keys never met its peer's) would hold the
whole new world for the 10-minute group timeout; past the bound it counts as hung, and the
process-restart fallback replaces it."""

LEAVE_MARGIN = 15.0
"""Seconds beyond ``restart.hang_timeout`` a carried worker may take to leave the round
before (the rest of a step, bounded by ``hang_timeout``; the abort, bounded by the
worker's own 10 s watchdog). One still there (a worker that hung as its peer was lost)
is stuck: only it is killed, its peers are kept, and the round recovers in-process.
(Before, it waited for ROUND_BEGIN_TIMEOUT, 120 s, and fell back to a process restart of
every worker.)"""


class Notes:
    """One daemon thread that writes an agent's trouble notes and clears, in order: the
    trouble may be etcd itself, so a node's back-off and re-join never wait for them, and
    a clear never lands before the note it clears. One per agent (a note stuck on one
    agent's etcd holds up no other agent's)."""

    def __init__(self) -> None:
        self._queue: queue.SimpleQueue[Callable[[], None]] = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None

    def put(self, work: Callable[[], None]) -> None:
        with self._lock:
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(target=self._run, name="elasticd-notes",
                                                daemon=True)  # fmt: skip
                self._thread.start()
        self._queue.put(work)

    def _run(self) -> None:
        while True:
            work = self._queue.get()
            try:
                work()
            except Exception as exc:  # only a display
                log.warning("could not update a node's trouble in the job's status",
                            **kv(error=str(exc)))  # fmt: skip


def note_trouble_later(notes: Notes, registry: Any, name: str, run_id: str, node: str,
                       what: str, error: str, *, count: int, retry_in: float) -> None:  # fmt: skip
    """:meth:`JobRegistry.note_trouble`, queued on ``notes``."""
    notes.put(lambda: registry.note_trouble(name, run_id, node, what, error, count=count,
                                            retry_in=retry_in))  # fmt: skip


KEEP_SHARDS_ENV = "ELASTICD_KEEP_SHARDS"
"""``0`` in an agent's environment: its in-process jobs' worlds keep the rendezvous's plain
node order (the baseline of ``bench/recovery.py``'s ``inproc-move-plain``)."""


def placement(job: JobSpec) -> Callable[[tuple[str, ...], tuple[str, ...]], list[str]]:
    """The rendezvous's ``arrange`` for ``job`` (in-process restart): survivors keep the
    shards they hold (``elasticd.layout.keep_shards``). Pure and the same on every agent:
    whichever member closes a round places the nodes alike."""
    from elasticd.layout import keep_shards, plan

    # A layout of a thousand nodes takes a quarter of a second to plan, and a round's
    # closer places inside the rendezvous's lock: the last close's new layout is this
    # one's old (and the world size repeats), so the few last are kept.
    plan_for = functools.lru_cache(maxsize=4)(lambda ranks: plan(ranks, job))

    def arrange(previous: tuple[str, ...], order: tuple[str, ...]) -> list[str]:
        try:
            return keep_shards(previous, order, nproc=job.nproc_per_node, plan_for=plan_for)
        except Exception as exc:
            log.warning("placing the nodes failed; keeping their order",
                        **kv(job=job.name, error=str(exc)))  # fmt: skip
            raise

    return arrange


def _carried_outage(rnd: Round) -> dict[str, Any] | None:
    """``{"outage_from", "attempts"}`` when the round that ends was itself a recovery that
    failed before its first step (a second fault during it, a crash loop, a re-form for a
    scale-up): the job has not trained since the failure before it, and the recovery
    that completes counts from that one (docs/inprocess.md). None otherwise, and when this
    node cannot tell: its local rank 0 is a spare (it never reports a step, however long
    the round trained), or it was not in the round just before this one (its recovery
    record is older: it sat rounds out)."""
    prior = rnd.recovery
    if rnd.first_step_seen or not isinstance(prior, dict) or not _lead_trains(rnd):
        return None
    detected, after = prior.get("detected_at"), prior.get("after_round")
    if not isinstance(detected, int | float) or after != rnd.number - 1:
        return None
    first = prior.get("outage_from", detected)
    return {"outage_from": float(first if isinstance(first, int | float) else detected),
            "attempts": int(prior.get("attempts", 1)) + 1}  # fmt: skip


def _outage_of(claim: Any) -> dict[str, Any] | None:
    """The outage a failure claim carries (:func:`_carried_outage` of its claimer)."""
    if not isinstance(claim, dict):
        return None
    first, attempts = claim.get("outage_from"), claim.get("attempts")
    if not isinstance(first, int | float) or type(attempts) is not int or attempts < 2:
        return None
    return {"outage_from": float(first), "attempts": attempts}


def _lead_trains(rnd: Round) -> bool:
    """Whether this node's local rank 0, whose heartbeat says when the round's first step
    completed (``first_step_seen``), is an active rank of the round, not a spare."""
    return any(w.local_rank == 0 and not rnd.layout.is_spare(w.rank) for w in rnd.workers.workers)


class JobRunner:
    """Runs one job (one submission, ``record.run_id``) on this node until it ends here."""

    def __init__(
        self,
        *,
        record: JobRecord,
        client: Any,
        registry: JobRegistry,
        node: NodeInfo,
        metrics: AgentMetrics,
        preempt: threading.Event,
        view: Any,
        devices: list[str] | None = None,
        make_handler: Callable[..., Any] | None = None,
        clock: Callable[[], float] = time.time,
        notes: Notes | None = None,
    ) -> None:
        """``notes``: the agent's queue of trouble notes (default: one of this runner's own)."""
        self.record = record
        self._view = view
        self._notes = notes if notes is not None else Notes()
        self.devices = devices
        self.job: JobSpec = record.job()
        self.name = record.name
        self._client = client
        self._registry = registry
        self._node = node
        self._metrics = metrics
        self._preempt = preempt
        self._clock = clock
        self._make_handler = make_handler or self._default_handler
        self._changes: list[tuple[int, Any]] = []
        self._handler: Any = None
        self._in_round = False
        self._changes_lock = threading.Lock()
        self._pending_recovery: dict[str, Any] | None = None
        self._early_claim: tuple[int, dict, bool, bool] | None = None
        """(round, claim, whether ours, whether counted): this round's cause, claimed before
        the workers were stopped (a hang: :meth:`_claim_early`)."""
        self._failures_here = 0
        self._furthest_at_failure: int | None = None
        """The job's furthest step (its status) at this node's last failure in a row."""
        self._troubles = 0
        self._noted = True
        """Whether a trouble note of ours may be queued or written and not cleared since.
        True at the start: the agent may have queued a note of an earlier runner's crash
        that lands only after our first world (etcd slow, which may be why it crashed), so
        that world always queues a clear, behind the note (``clear_trouble`` reads first
        and writes nothing when there is nothing to clear)."""
        self._doorbell: Doorbell | None = None
        """Rung by our workers' faults (:func:`elasticd.worker.ring`) and our etcd watch's
        changes (:meth:`_on_change`); made by ``run``."""
        self._last_step_written: Any = None
        self._closed_run = False
        self._kept: Any = None
        """restart.mode inprocess: the live workers carried into the next round."""
        self._forks: Any = None
        """This run's fork server on this node (``run`` starts it), or None."""
        self._fork_restarts = 0
        self._standby: Any = None
        """restart.standby: warm workers kept ready for no rank while a round trains."""
        self._standby_failures = 0
        self._standby_next = 0.0
        """Standbys that exited on their own, and when the next may start (back-off)."""
        self._outside = True
        """Not in the job's world: before our first round, and after leaving one for our
        own trouble (a newcomer to a running job waits for its warm workers)."""
        self._evidence = False
        """Whether we re-form because we saw the fault ourselves (rendezvous evidence)."""
        self._last_step_seen: int | None = None
        """Rank 0's last completed step in the previous round (for lost steps)."""
        self._furthest_step: int | None = None
        """The highest step a local worker reported completed, in any round (a claimed
        failure carries it: the restart limit counts failures without progress)."""
        self.crashed = False
        """Set by the agent when ``run`` raised: the job is taken again after a back-off."""
        self.crash_error: str | None = None
        """What ``run`` raised, as the agent notes it in the job's status."""
        self.outcome: Outcome | None = None
        self._limit = self.job.restart.max_restarts
        self._report = JobReporter(name=self.name, registry=registry, metrics=metrics, clock=clock,
                                   events_path=os.path.join(self.job.out_dir, EVENTS_FILE))  # fmt: skip
        metrics.init_job(self.name, self.job.restart.mode)

    # -- rendezvous ---------------------------------------------------------------------------

    def _default_handler(self) -> Any:
        from elasticd.rendezvous import EtcdRendezvous, settings_from_job

        settings = settings_from_job(
            self.job,
            run_id=self.record.run_id,
            min_nodes=self.job.nodes.min,
            max_nodes=self.job.nodes.max,
        )
        if self.job.restart.mode == "inprocess" and os.environ.get(KEEP_SHARDS_ENV) != "0":
            # Survivors keep what they hold (in-process recovery then moves nothing).
            settings = dataclasses.replace(settings, arrange=placement(self.job))
        return EtcdRendezvous(
            client=self._client,
            settings=settings,
            node_id=self._node.node_id,
            addr=self._node.addr,
            on_change=self._on_change,
            incarnation=self._node.incarnation,
        )

    def _on_change(self, change: Any) -> None:
        # Each change names the world it was judged against: a change about the previous
        # world that arrives after we decided to leave it must not break the next one. (Not
        # the handler's current world now: the callback runs after the judgement, and a
        # new world may have formed in between.)
        with self._changes_lock:
            self._changes.append((getattr(change, "round", 0), change))
        # Wake the supervision loop now, as a worker's fault does: else a worker whose
        # collective failed on the sockets a peer shut for this very change (a scale-up,
        # a lost node) rings first, and the round is judged its collective failure.
        doorbell = self._doorbell
        if doorbell is not None:
            ring(doorbell.path)

    def _take_changes(self, round_: int) -> list[Any]:
        """The changes reported about round ``round_`` since the last call (others dropped)."""
        with self._changes_lock:
            out, self._changes = self._changes, []
        return [change for r, change in out if r == round_]

    # -- the loop -----------------------------------------------------------------------------

    def _current(self) -> JobRecord | None:
        """The job as the agent's watches last saw it (no etcd read)."""
        return self._view.job(self.name)

    def _state(self) -> JobState:
        """The job's state from the mirror; a replaced or deleted job reads as cancelled."""
        brief = self._view.state_of(self.name)
        if brief is None or brief[1] != self.record.run_id:
            return JobState.CANCELLED
        return brief[0]

    def _over(self) -> bool:
        return self._state().terminal

    def run(self) -> Outcome | None:
        """Run rounds until the job ends for this node; returns the last outcome."""
        from elasticd.rendezvous import RendezvousClosed, RendezvousConnection, RendezvousTimeout

        handler = self._handler = self._make_handler()
        # A worker that reports a fault rings it: the round ends at once, not at our next
        # look (up to TICK later: a third of a killed node's recovery was waiting for it).
        jobs_dir = os.path.join(self._node.state_dir, "jobs", self.record.run_id)
        with contextlib.suppress(OSError):
            os.makedirs(jobs_dir, exist_ok=True)
        self._doorbell = Doorbell(os.path.join(jobs_dir, "doorbell"))
        self._forks = self._start_fork_server()
        try:
            while not self._preempt.is_set() and not self._over():
                joined_at = self._clock()
                self._prewarm()
                try:
                    if self._evidence:
                        world = handler.next_world(evidence=True)
                    else:
                        world = handler.next_world()
                    self._evidence = False
                    self._clear_trouble()
                except RendezvousClosed:
                    break
                except RendezvousTimeout as exc:
                    if self._rendezvous_timed_out(exc):
                        break
                    continue
                except RendezvousConnection as exc:
                    # etcd away for longer than the client's own retries: not the job's
                    # fault. Try again; the job state check above ends this if it is over.
                    log.warning(
                        "rendezvous unreachable; retrying", **kv(job=self.name, error=str(exc))
                    )
                    self._preempt.wait(1.0)
                    continue
                try:
                    outcome = self._run_round(handler, world, joined_at)
                except Exception as exc:  # this node's trouble, not the job's
                    self._node_trouble(handler, exc)
                    continue
                self._troubles = 0
                self.outcome = outcome
                if not outcome.reforms:
                    break
            if self._preempt.is_set() and self.outcome is None:
                self.outcome = Outcome.PREEMPTED
        finally:
            try:
                self._finish(handler)
            finally:
                forks, self._forks = self._forks, None
                if forks is not None:  # after every worker of ours stopped
                    forks.close()
        return self.outcome

    def _live_forks(self) -> Any:
        """The run's fork server, started again if it stopped after it was ready (killed or
        crashed: its workers died with it, a fault the round handles as any), at most
        :data:`FORK_SERVER_RESTARTS` times a run; None once it cannot serve."""
        forks = self._forks
        if (forks is not None and not forks.usable() and forks.lost
                and self._fork_restarts < FORK_SERVER_RESTARTS):  # fmt: skip
            self._fork_restarts += 1
            forks.close()
            log.warning("fork server stopped; starting it again",
                        **kv(job=self.name, restart=self._fork_restarts))  # fmt: skip
            self._forks = forks = self._start_fork_server()
        return forks

    def _start_fork_server(self) -> Any:
        """This run's workers on this node are forked from one process that imports torch
        (and the built-in trainer) once (:mod:`elasticd.agent.forkserver`), started now so
        that its imports overlap the rendezvous. None (workers exec'd) for a job's own
        ``command`` unless ``restart.fork: true``, with ``restart.fork: false`` or the
        agent's ``ELASTICD_FORK_SERVER=0``, or when it cannot start."""
        from elasticd.agent import forkserver
        from elasticd.agent.policy import scrub_env, worker_argv

        fork = self.job.restart.fork
        if fork is False or not forkserver.enabled() or (self.job.command and not fork):
            return None
        if self.job.command:
            argv = worker_argv(self.job.command, "", self._node.python)
            if forkserver.target_of(argv, self._node.python) is None:
                log.warning("restart.fork: the command is not `python -m MODULE ...` or "
                            "`python SCRIPT.py ...` with the agent's interpreter; its workers "
                            "are exec'd", **kv(job=self.name, command=argv[:2]))  # fmt: skip
                return None
        env = scrub_env(self._worker_env())
        env.setdefault("OMP_NUM_THREADS", "1")  # as every worker's (policy.worker_envs)
        log_path = os.path.join(self.job.logs_dir(self.record.run_id), "forkserver",
                                f"{self._node.node_id}.log")  # fmt: skip
        preload = forkserver.PRELOAD_COMMAND if self.job.command else forkserver.PRELOAD_TRAINER
        try:
            return forkserver.ForkServer(python=self._node.python, preload=preload, env=env,
                                         cwd=os.getcwd(), log_path=log_path)  # fmt: skip
        except OSError as exc:
            log.warning("fork server not started; workers are exec'd",
                        **kv(job=self.name, error=str(exc)))  # fmt: skip
            return None

    def _mark_leaving(self, handler: Any) -> None:
        try:
            handler.mark_leaving()
        except Exception as exc:  # the lease ends it anyway, once we leave
            log.warning("leaving not marked", **kv(job=self.name, error=str(exc)))

    def _rendezvous_timed_out(self, exc: Exception) -> bool:
        """No world took us within join_timeout. Returns whether the job is over for us.

        A spare (the job runs without us) or a job that never started (it waits for
        capacity; its status says why) waits on. Only a job that ran and cannot re-form
        with nodes.min nodes fails."""
        current = self._current()
        if current is None or current.run_id != self.record.run_id or current.state.terminal:
            return True
        if current.state == JobState.RECOVERING:
            # Past its restart limit, waiting for the world that would decide it: that
            # is why it fails.
            past = pending_limit_verdict(current.status)
            self._report.fail(
                past or f"no world of nodes.min={self.job.nodes.min} re-formed: {exc}"
            )
            return True
        why = "spare: the world runs without this node" if current.started else "not started"
        log.info("still waiting for a world", **kv(job=self.name, why=why))
        return False

    def _node_trouble(self, handler: Any, exc: Exception) -> None:
        """An error in this node's round: leave it cleanly, back off, join again."""
        self._troubles += 1
        self._outside = True
        self._drop_kept()
        pause = min(NODE_TROUBLE_BACKOFF_CAP, 0.5 * 2 ** (self._troubles - 1))
        log.exception(
            "this node's round failed; leaving it and joining again",
            **kv(job=self.name, error=f"{type(exc).__name__}: {exc}", retry_in=pause),
        )
        try:
            handler.leave()  # revokes our membership: peers re-form without us at once
        except Exception:
            log.exception("leaving the round failed; our lease lapses on its own")
        self._left_world()
        # Said in the job's status, which `elasticd run`, `submit` and `status` show.
        note_trouble_later(self._notes, self._registry, self.name, self.record.run_id,
                           self._node.node_id, "its round failed",
                           f"{type(exc).__name__}: {exc}", count=self._troubles,
                           retry_in=pause)  # fmt: skip
        self._noted = True
        self._metrics.node_troubles.labels(self.name, "round_failed").inc()
        self._preempt.wait(pause)

    def _clear_trouble(self) -> None:
        """A world took us (active or spare): a trouble of ours that the job's status shows
        is over. Queued behind our notes and the agent's (one queue), so it never lands
        before one of them. Later worlds clear only what we noted since, or what the
        watched status shows of our node."""
        try:
            current = self._current()
        except ElasticdError:  # the mirror unreadable: only what we noted ourselves
            current = None
        troubles = current.status.get("troubles") if current is not None else None
        shown = isinstance(troubles, dict) and self._node.node_id in troubles
        if not (self._noted or shown):
            return
        self._noted = False
        registry, name, node = self._registry, self.name, self._node.node_id
        self._notes.put(lambda: registry.clear_trouble(name, node))

    def _prewarm(self) -> None:
        """In-process jobs of the built-in trainer: before waiting for a round, have a
        live process for every local rank: the kept ones, and warm ones started now for
        the rest (their Python start and ``import torch`` overlap the rendezvous)."""
        from elasticd.agent.launch import warm_workers

        nproc = self.job.nproc_per_node
        missing = self._kept.missing(nproc) if self._kept is not None else list(range(nproc))
        if not missing:
            return
        newcomer = self._kept is None and self._outside
        if self._standby is not None:
            adopted = self._standby.adopt(missing)
            if adopted.workers:
                log.info("standby workers adopted",
                         **kv(job=self.name, local_ranks=[w.local_rank for w in adopted.workers],
                              pids=[pid_now(w.proc) for w in adopted.workers]))  # fmt: skip
                self._keep(adopted)
                missing = missing[len(adopted.workers) :]
        warm = None
        if missing:
            try:
                warm = warm_workers(job=self.job, run_id=self.record.run_id, node=self._node,
                                    local_ranks=missing, env=self._worker_env(), clock=self._clock,
                                    devices=self.devices, forks=self._live_forks())  # fmt: skip
            except OSError as exc:  # the round starts them the usual way
                log.warning("warm workers not started", **kv(job=self.name, error=str(exc)))
            if warm is not None:
                self._keep(warm)
        if newcomer and self._kept is not None and self._job_running():
            self._await_warm(self._kept)

    def _keep(self, group: Any) -> None:
        """Add ``group``'s workers to those the next round takes."""
        if self._kept is None:
            self._kept = group
        else:
            self._kept.merge(group)

    def _ensure_standby(self) -> None:
        """A round trains: start this node's standby workers (``restart.standby``) that are
        not alive, now that the recovery no longer competes with their imports."""
        from elasticd.agent.launch import standby_workers

        now = self._clock()
        if self._standby is not None:
            dead = [w for w in self._standby.workers if w.proc.poll() is not None]
            if dead:  # exited on their own (ours are killed only when the job ends for us)
                self._standby_failures += len(dead)
                pause = min(STANDBY_BACKOFF_CAP, STATUS_EVERY * 2**self._standby_failures)
                self._standby_next = now + pause
                log.warning(
                    "standby worker exited",
                    **kv(job=self.name, codes=[w.proc.returncode for w in dead],
                         logs=[w.log_path for w in dead], retry_in=pause),
                )  # fmt: skip
                self._standby.workers = [w for w in self._standby.workers if w.proc.poll() is None]
            elif self._standby.workers and all(
                os.path.exists(w.env_ready) for w in self._standby.workers if w.env_ready
            ):
                self._standby_failures = 0  # they start fine
        want = self.job.restart.standby
        have = self._standby.alive() if self._standby is not None else 0
        if have >= want or now < self._standby_next:
            return
        try:
            fresh = standby_workers(job=self.job, run_id=self.record.run_id, node=self._node,
                                    count=want - have, env=self._worker_env(), clock=self._clock,
                                    devices=self.devices, forks=self._live_forks())  # fmt: skip
        except OSError as exc:  # a replacement then starts cold, as without standbys
            log.warning("standby worker not started", **kv(job=self.name, error=str(exc)))
            return
        if fresh is None:
            return
        log.info(
            "standby workers started",
            **kv(job=self.name, pids=[pid_now(w.proc) for w in fresh.workers]),
        )
        if self._standby is None:
            self._standby = fresh
        else:
            self._standby.workers = [w for w in self._standby.workers if w.proc.poll() is None]
            self._standby.workers += fresh.workers

    def _job_running(self) -> bool:
        """Whether the job has trained already (a world of it formed). At its start every
        node joins at once, whatever its workers' imports: a node that joined seconds
        later than the others would miss the first world's settle window."""
        try:
            current = self._current()
        except ElasticdError:
            return False
        return current is not None and current.run_id == self.record.run_id and current.started

    def _await_warm(self, warm: Any) -> None:
        """A node joining a running job (a newcomer) asks for a round only once its warm
        workers are ready: the world re-forms for us after our import, not before it (its
        survivors train meanwhile). Bounded; a node already in the world never waits (its
        peers' re-form would leave it out), nor one at the job's start."""
        from elasticd.agent.launch import warm_ready

        deadline = self._clock() + WARM_WAIT
        while not warm_ready(warm) and self._clock() < deadline:
            if self._preempt.wait(0.05) or self._over():
                return

    def _drop_kept(self) -> None:
        """Workers kept for an in-process round that will not come: stop them."""
        kept, self._kept = self._kept, None
        if kept is not None:
            kept.kill()

    def _finish(self, handler: Any) -> None:
        """Leave the rendezvous; close the run when the job is over for everyone."""
        self._drop_kept()
        standby, self._standby = self._standby, None
        if standby is not None:
            standby.kill()
        doorbell, self._doorbell = self._doorbell, None
        if doorbell is not None:
            doorbell.close()
        # The job is over (not only for us): node rank 0 keeps its final values.
        over = self.outcome in (Outcome.SUCCEEDED, Outcome.FINISHED, Outcome.CANCELLED)
        try:
            record = self._current()
            over = over or record is None or record.run_id != self.record.run_id
            over = over or record.state.terminal
            if record is not None and record.state.terminal and record.run_id == self.record.run_id:
                handler.set_closed()  # wakes nodes still waiting for a round
        except ElasticdError as exc:
            log.warning("could not close the rendezvous", **kv(job=self.name, error=str(exc)))
        self._metrics.watch_membership(self.name, None)  # what stays is final
        try:
            handler.close()  # revokes our lease: peers are told at once
        except Exception:  # the lease lapses on its own within a TTL
            log.exception("leaving the rendezvous failed", **kv(job=self.name))
        if over:  # the final values stay until the agent retires the job's series
            self._metrics.in_world.labels(self.name).set(0)
        else:
            self._left_world()
        self._metrics.set_worker_states(self.name, {})

    def _left_world(self) -> None:
        """Not in the job's world any more: the job's gauges go to the next node rank 0."""
        self._metrics.in_world.labels(self.name).set(0)
        self._metrics.drop_lead(self.name)

    # -- one round ----------------------------------------------------------------------------

    def _start_round(self, world: Any, joined_at: float) -> Round:
        status = self._current()
        settings = getattr(self._handler, "settings", None)
        fence = None
        if settings is not None:
            fence = Fence(settings.world_key(), world.revision, world.round)
        self._report.for_round(fence)
        resume_step = latest_checkpoint_step(self.job.ckpt_dir)
        keep, self._kept = self._kept, None
        self._outside = False
        try:
            rnd = launch(
                job=self.job, run_id=self.record.run_id, world=world, node=self._node,
                restarts=int(status.status.get("restarts", 0)) if status else 0,
                resume_step=resume_step, env=self._worker_env(), clock=self._clock,
                devices=self.devices, keep=keep, forks=self._live_forks(),
            )  # fmt: skip
        except BaseException:
            if keep is not None:
                keep.kill()
            raise
        m, nproc = self._metrics, self.job.nproc_per_node
        m.rendezvous_rounds.labels(self.name).inc()
        m.rendezvous_seconds.labels(self.name).observe(rnd.formed_at - joined_at)
        m.in_world.labels(self.name).set(1)
        # Our membership's lease, checked at each scrape: frozen past its TTL, this node
        # speaks for the job no more (its peers re-formed without it), even before this
        # thread runs again to notice.
        m.watch_membership(self.name, getattr(self._handler, "lease_alive", None))
        if rnd.node_rank == 0:  # the job's gauges: exported by node rank 0 alone
            m.world_size.labels(self.name).set(world.size)
            m.world_ranks.labels(self.name).set(world.size * nproc)
        else:
            m.drop_lead(self.name)
        log.info(
            "workers started",
            **kv(job=self.name, round=world.round, node_rank=rnd.node_rank, world=world.size,
                 dp=rnd.layout.dp, tp=rnd.layout.parallel.tp, pids=rnd.workers.pids(),
                 carried=rnd.carried),
        )  # fmt: skip
        rnd.recovery = self._pending_recovery
        if rnd.node_rank == 0:
            try:
                if rnd.recovery is None:
                    rnd.recovery = self._recovery_of_newcomer(world.round - 1)
                lost = self._report.reattribute(world)
                cause = "peer_lost" if lost else self._report.noted_reason
                if cause and rnd.recovery is not None and rnd.recovery["reason"] in FAILURE_REASONS:
                    rnd.recovery = {**rnd.recovery, "reason": cause}
                if not self._report.job_failed:  # past its restart limit: no new world
                    self._report.world_formed(world, rnd.layout, resume_step)
            except FencedError as exc:
                self._report._fenced(exc)  # the supervisor ends the round at its first tick
            except ElasticdError as exc:
                # etcd away right now: the workers train on; the status catches up later.
                log.warning("world status not written", **kv(job=self.name, error=str(exc)))
        return rnd

    def _recovery_of_newcomer(self, previous: int) -> dict[str, Any] | None:
        """Node rank 0 that was not in the world that failed (a spare turned active, a
        newcomer: in-process placement puts one at position 0 when no survivor holds rank
        0's shards) saw no failure itself, yet records the recovery: from the claim in
        force for the round before (its cause and when it was seen; when its own workers
        stopped is not known here)."""
        claim = self._registry.claim_of(self.name, previous) if previous >= 0 else None
        if not isinstance(claim, dict) or "reason" not in claim:
            return None  # none, or not a record this version wrote
        detected = claim.get("detected_at")
        if not isinstance(detected, int | float):
            return None
        return {"reason": str(claim["reason"]), "detected_at": float(detected), "stopped_at": None,
                "newcomer": True, "after_round": previous, **(_outage_of(claim) or {})}  # fmt: skip

    @property
    def in_round(self) -> bool:
        """Whether workers are running (else the runner waits in the rendezvous)."""
        return self._in_round

    def abandon_wait(self) -> None:
        """On agent shutdown while waiting for a world (a spare): stop keeping our
        membership alive; it lapses within a TTL. (A runner in a round stops on its own.)"""
        if not self._in_round and self._handler is not None:
            self._handler.close()

    def end_wait(self) -> None:
        """The job ended while we wait for a world: close its run, which wakes every node
        waiting in the rendezvous (once is enough; idempotent)."""
        if self._in_round or self._handler is None or self._closed_run:
            return
        try:
            self._handler.set_closed()
            self._closed_run = True
        except ElasticdError as exc:
            log.warning("could not close the rendezvous", **kv(job=self.name, error=str(exc)))

    def _run_round(self, handler: Any, world: Any, joined_at: float) -> Outcome:
        self._in_round = True
        try:
            return self._round(handler, world, joined_at)
        finally:
            self._in_round = False
            self._metrics.in_world.labels(self.name).set(0)  # re-forming, or done

    def _round(self, handler: Any, world: Any, joined_at: float) -> Outcome:
        rnd = self._start_round(world, joined_at)
        self._pending_recovery = None
        try:
            outcome, detail = self._supervise(handler, rnd)
        except BaseException:
            rnd.workers.kill()
            raise
        detected_at = self._clock()
        if outcome == Outcome.PREEMPTED:
            # While our workers save and stop (up to restart.grace_period; a frozen peer
            # can hold their save that long) our join lives on, and a re-form the others
            # start meanwhile would wait for us. On a thread: an etcd away (under Slurm it
            # may be stopping too) must not delay the workers' "save now" by its timeout.
            threading.Thread(target=self._mark_leaving, args=(handler,), daemon=True,
                             name="mark-leaving").start()  # fmt: skip
            # Claimed before the workers stop: our peers' workers exit with the
            # preemption code a moment later and must find the cause already named.
            try:
                claim, ours = self._registry.claim_failure(
                    self.name, rnd.number,
                    {"reason": "preempted", "node": self._node.node_id,
                     "detail": "agent got SIGTERM", "detected_at": detected_at},
                    fence=self._report.fence,
                )  # fmt: skip
                if ours:
                    self._report.count(round_=rnd.number, claim=claim, limit=self._limit)
            except ElasticdError as exc:
                log.warning("preemption not recorded", **kv(job=self.name, error=str(exc)))
        if outcome == Outcome.WORKER_HUNG:
            # Claimed before the hung worker is killed: the kill fails its peers'
            # collectives at once, and their agents would otherwise name that as the cause
            # (a race; the peers' agents lost it only because killing took a moment).
            self._claim_early(rnd, outcome, detail, detected_at)
        if outcome == Outcome.WORKER_HUNG and rnd.workers.dump_stacks():
            # Before any is killed: where a hung worker hangs is what its user needs.
            log.warning("hung round: the workers' stacks are in their logs",
                        **kv(job=self.name, round=rnd.number))  # fmt: skip
            time.sleep(STACK_DUMP_WAIT)
        if self._keeps_workers(rnd, outcome):
            self._keep_workers(rnd, outcome)
        else:
            self._stop_workers(rnd, outcome)
        stopped_at = self._clock()
        if outcome == Outcome.SUCCEEDED and rnd.node_rank != 0:
            outcome, detail = self._await_success(rnd)
            detected_at = stopped_at = self._clock()
        self._after(rnd, outcome, detail, detected_at, stopped_at)
        return outcome

    def _await_success(self, rnd: Round) -> tuple[Outcome, str]:
        """Our workers are done; node rank 0 reports the job (its final step, then the
        state). Stay in the world until it has: leaving now would look like a lost node to
        a rank 0 whose workers are still finishing. If rank 0's node dies meanwhile, the
        world re-forms and resumes from the final checkpoint, which ends at once."""
        deadline = self._clock() + FINISH_WAIT
        while self._clock() < deadline:
            if self._state().terminal or self._preempt.is_set():
                return Outcome.FINISHED, "reported by node rank 0"
            for change in self._take_changes(rnd.number):
                if change.kind == "closed":
                    return Outcome.FINISHED, "run closed"
                if change.kind in ("lost", "lease-lost"):
                    return Outcome.PEER_LOST, "lost " + ",".join(change.nodes)
            time.sleep(TICK * 2)
        return Outcome.FINISHED, "node rank 0 never reported"

    def _supervise(self, handler: Any, rnd: Round) -> tuple[Outcome, str]:
        job = self.job
        lost: set[str] = set()
        waiting: set[str] = set()
        closed = False
        next_status = 0.0
        ckpt_at_waiting: int | None = None
        ckpt_now: int | None = None
        next_ckpt_look = 0.0
        standby_at = 0.0
        while True:
            now = self._clock()
            for change in self._take_changes(rnd.number):
                if change.kind in ("lost", "lease-lost"):
                    lost.update(change.nodes)
                elif change.kind == "waiting" and len(rnd.nodes) < job.nodes.max:
                    # A member of our world that re-joins is also reported lost. At
                    # nodes.max a waiting node is a spare: it stays out until one is lost,
                    # then takes its place without a layout change.
                    waiting.update(n for n in change.nodes if n not in rnd.nodes)
                elif change.kind == "closed":
                    closed = True
            state = self._state()  # the watch-fed mirror: no etcd read
            if waiting and now >= next_ckpt_look:
                next_ckpt_look = now + 0.5
                ckpt_now = latest_checkpoint_step(job.ckpt_dir)
                if ckpt_at_waiting is None:
                    ckpt_at_waiting = ckpt_now if ckpt_now is not None else -1
            stalest = rnd.workers.stalest_progress(now)
            beats = rnd.workers.heartbeats()
            not_begun = self._not_begun(rnd, now)
            # A stale heartbeat is a hang of its own (decide() looks at it first): its
            # worker alone is judged then, not the round's start.
            stale = stalest is not None and stalest.age > hang_bound(
                job.restart.hang_timeout, waiting=stalest.waiting
            )
            unstarted = [] if not_begun or stale else self._unstarted(rnd, now)
            if not unstarted:
                rnd.unstarted = []
            obs = Observation(
                preempting=self._preempt.is_set(),
                job_state=state,
                run_closed=closed,
                lost=tuple(sorted(lost)),
                waiting=tuple(sorted(waiting)),
                exit_codes=tuple(w.returncode for w in rnd.workers.workers),
                preempted_code=PREEMPTED_EXIT_CODE,
                stalest_heartbeat=stalest.age if stalest else None,
                stalest_waiting=bool(stalest and stalest.waiting),
                hang_timeout=job.restart.hang_timeout,
                scale_up_policy=job.restart.scale_up,
                checkpoint_at_waiting=ckpt_at_waiting,
                checkpoint_now=ckpt_now,
                user_error_code=USER_ERROR_EXIT_CODE,
                first_world=rnd.number == 1,
                fenced=self._report.fenced,
                faulted=self._faulted(beats),
                peer_preempted=self._peer_preempted(rnd, beats),
                not_begun=bool(not_begun or unstarted),
            )
            self._observe_progress(rnd, now, force=False, due=now >= next_status, beats=beats)
            if now >= next_status:
                next_status = now + STATUS_EVERY
            if rnd.first_step_seen and now >= standby_at:  # not while a recovery needs the CPU
                standby_at = now + STATUS_EVERY
                self._ensure_standby()
            outcome = decide(obs)
            if outcome is not None:
                if obs.not_begun and outcome == Outcome.WORKER_HUNG:
                    if not not_begun:
                        return outcome, self._unstarted_detail(rnd, unstarted, now)
                    return outcome, self._not_begun_detail(rnd, not_begun)
                return outcome, self._detail(outcome, rnd, obs, stalest)
            if self._doorbell is not None:
                self._doorbell.wait(TICK)
            else:
                time.sleep(TICK)

    def _worker_env(self) -> dict[str, str]:
        """What our workers inherit: this process's environment and the doorbell."""
        env = dict(os.environ)
        if self._doorbell is not None and self._doorbell.path is not None:
            env[ENV_DOORBELL] = self._doorbell.path
        return env

    def _round_begin_timeout(self) -> float:
        # Past the stuck bound (and some): a worker stuck in the round before is its own
        # node's to kill alone, before its peers' nodes, whose workers wait for it in the
        # group's set-up, give up on the round and restart every process.
        return max(ROUND_BEGIN_TIMEOUT, self.job.restart.hang_timeout + LEAVE_MARGIN + 15.0)

    def _not_begun(self, rnd: Round, now: float) -> list[Worker]:
        """The workers of this in-process round (one that kept workers) still in the round
        before past ``hang_timeout`` and :data:`LEAVE_MARGIN` (noted in ``rnd.stuck``), or
        still opening this one's process group past the round-begin bound."""
        if not rnd.carried or rnd.first_step_seen:
            return []
        age = now - rnd.spawned_at
        stuck = []
        if age > self.job.restart.hang_timeout + LEAVE_MARGIN:
            # Only a worker that stepped before: one still importing or loading its state
            # (a cold newcomer carried on) is as slow as a new process.
            stuck = [w for w in rnd.workers.not_begun() if w.stepped]
        rnd.stuck = stuck
        if age <= self._round_begin_timeout():
            return stuck
        return stuck + [w for w in rnd.workers.not_begun() + rnd.workers.not_opened()
                        if w not in stuck]  # fmt: skip

    def _unstarted(self, rnd: Round, now: float) -> list[Worker]:
        """Our live active workers (not spares), none of which completed a step in this
        round, once :meth:`startup_bound` has passed since they were started (noted in
        ``rnd.unstarted``), for the built-in trainer, every active rank of which reports
        its steps. A job's own command is not judged: which of its ranks report is the
        script's choice (rank 0 alone, the last pipeline stage), and a re-form can move
        those ranks to other nodes, so a node of ranks that never report would be
        restarted in a healthy job (a fresh-eyes review found it). ``hang_timeout``
        judges only workers that stepped; one stuck before its first step (a frozen
        filesystem under the checkpoint load, a process-group set-up that never returns)
        was never judged: a world of one waited for good, a larger one until a peer's
        collective timed out."""
        rnd.unstarted = []
        bound = self.startup_bound()
        if not bound or rnd.first_step_seen or now - rnd.spawned_at <= bound:
            return []
        if self.job.command is not None:
            return []
        beats = [read_heartbeat(w.heartbeat_path) or {} for w in rnd.workers.workers]
        if any("step" in beat for beat in beats):
            return []  # one stepped (not local rank 0): the others are hang_timeout's
        # A spare rank never steps: it idles until the end (a node of spares alone too).
        rnd.unstarted = [w for w in rnd.workers.workers
                         if not rnd.layout.is_spare(w.rank) and w.proc.poll() is None]  # fmt: skip
        return rnd.unstarted

    def startup_bound(self) -> float:
        """Seconds from a round's start to its first step: ``restart.startup_timeout``,
        never less than ``restart.hang_timeout`` (the first step may take as long as any
        step may); 0: never."""
        r = self.job.restart
        return max(r.startup_timeout, r.hang_timeout) if r.startup_timeout else 0.0

    def _unstarted_detail(self, rnd: Round, workers: list[Worker], now: float) -> str:
        ranks = ", ".join(str(w.rank) for w in workers)
        r = self.job.restart
        bound = f"{r.startup_timeout:g} s"
        if r.hang_timeout > r.startup_timeout:
            bound += f", raised to restart.hang_timeout's {r.hang_timeout:g} s"
        return (f"round {rnd.number}: rank{'s' if len(workers) > 1 else ''} {ranks} completed no "
                f"step in the {now - rnd.spawned_at:.0f} s since the start "
                f"(restart.startup_timeout: {bound}, for the imports, the process group, "
                "the checkpoint load and the first step)")  # fmt: skip

    def _not_begun_detail(self, rnd: Round, workers: list[Worker]) -> str:
        before = {id(w) for w in rnd.stuck}
        leave = self.job.restart.hang_timeout + LEAVE_MARGIN
        parts = [f"rank {w.rank} " + (f"never took the round (stuck in the one before) within "
                                      f"{leave:g} s" if id(w) in before else
                                      "never opened its process group within "
                                      f"{self._round_begin_timeout():g} s")
                 for w in workers]  # fmt: skip
        return f"round {rnd.number}: " + "; ".join(parts)

    def _faulted(self, beats: dict[int, dict]) -> bool:
        """Whether a local in-process worker reported a failed collective this round."""
        if self.job.restart.mode != "inprocess":
            return False
        return any("fault" in beat for beat in beats.values())

    def _peer_preempted(self, rnd: Round, beats: dict[int, dict]) -> bool:
        """Whether every live local in-process worker left this round for another node's
        preemption (each saved the step first)."""
        if self.job.restart.mode != "inprocess":
            return False
        live = [w for w in rnd.workers.workers if w.proc.poll() is None]
        return bool(live) and all("peer_preempted" in beats.get(w.local_rank, {}) for w in live)

    def _detail(self, outcome: Outcome, rnd: Round, obs: Observation, stalest: Any) -> str:
        if outcome in (Outcome.WORKER_FAILED, Outcome.USER_ERROR):
            return "; ".join(w.failure_message() for w in rnd.workers.failed())
        if outcome == Outcome.FENCED:
            return f"round {rnd.number} is no longer current"
        if outcome == Outcome.WORKER_HUNG and stalest:
            waits = " (waiting on its peers in a collective)" if stalest.waiting else ""
            return f"rank {stalest.worker.rank}: no progress for {stalest.age:.1f} s{waits}"
        if outcome == Outcome.COLLECTIVE_FAILED:
            beats = rnd.workers.heartbeats()
            faults = [f"rank {w.rank}: {beats[w.local_rank]['fault'].get('error', '')}"
                      for w in rnd.workers.workers if "fault" in beats.get(w.local_rank, {})]  # fmt: skip
            return "; ".join(faults)[:500]
        if outcome == Outcome.PEER_LOST:
            return "lost " + ",".join(obs.lost)
        if outcome == Outcome.SCALE_UP:
            return "waiting " + ",".join(obs.waiting)
        return str(outcome)

    # -- progress, status and metrics ----------------------------------------------------------

    def _observe_progress(
        self, rnd: Round, now: float, *, force: bool, due: bool, beats: dict | None = None
    ) -> None:
        """``beats``: this tick's heartbeats if already read (each is one file read)."""
        if beats is None:
            beats = rnd.workers.heartbeats()
        m = self._metrics
        m.set_worker_states(self.name, rnd.workers.states())
        stalest = rnd.workers.stalest_progress(now)
        m.heartbeat_age.labels(self.name).set(stalest.age if stalest else 0.0)
        steps = [b["step"] for b in beats.values() if isinstance(b.get("step"), int)]
        if steps and (self._furthest_step is None or max(steps) > self._furthest_step):
            self._furthest_step = max(steps)
        lead = beats.get(0)
        if lead is None or "step" not in lead:
            return
        if not rnd.first_step_seen:
            rnd.first_step_seen = True
            self._failures_here = 0  # training again: the next failure backs off afresh
            self._furthest_at_failure = None
            if rnd.recovery is not None:
                self._recovered(rnd, lead, now)
            if rnd.node_rank == 0:
                self._loaded(rnd, lead)
        write = rnd.node_rank == 0 and (
            force or (due and lead.get("step") != self._last_step_written)
        )
        ckpt = latest_checkpoint_step(self.job.ckpt_dir) if write else None
        if write:
            self._last_step_written = lead.get("step")
        self._last_step_seen = lead.get("step")
        self._report.progress(lead, checkpoint=ckpt, write=write, lead_node=rnd.node_rank == 0,
                              ckpt_dir=self.job.ckpt_dir)  # fmt: skip

    def _loaded(self, rnd: Round, lead: dict[str, Any]) -> None:
        """The world's first step: if its state came from a checkpoint on disk, observe the
        load (from the process group being ready to the state being loaded)."""
        phases = lead.get("phases", {}) or {}
        told = lead.get("recovery") or {}
        source = told.get("source") or ("checkpoint" if rnd.resume_step else "none")
        step = told.get("resume_step", rnd.resume_step)
        start, end = phases.get("pg_ready"), phases.get("ckpt_loaded") or phases.get("state_loaded")
        if source == "checkpoint" and step and start is not None and end is not None:
            self._report.loaded(seconds=float(end) - float(start), ckpt_dir=self.job.ckpt_dir,
                                step=int(step))  # fmt: skip

    def _recovered(self, rnd: Round, lead: dict[str, Any], now: float) -> None:
        """Rank 0's first step after a re-form: record the recovery and its parts."""
        phases = lead.get("phases", {}) or {}
        told = lead.get("recovery") or {}
        rec = rnd.recovery or {}
        resume = told.get("resume_step", rnd.resume_step)
        source = str(told.get("source") or ("checkpoint" if resume else "none"))
        # In-process: this node's workers were kept; or the state came from memory, which
        # only kept processes hold: this node is a newcomer (it had none to keep), or its
        # worker was replaced (rank 0 killed: its standby took the rank) while the other
        # nodes' went on. (A node whose new workers loaded the checkpoint cannot tell
        # whether the others kept their processes: process, as when none did.)
        if rnd.carried or source in ("peers", "replica"):
            mode = "inprocess"
            # A new worker of ours (a newcomer's, or a replaced rank 0's) has no abort, and
            # its start is a part of its own, not pg_init's.
            spawned = None if rnd.carried else rnd.spawned_at
            marks = [("abort", phases.get("aborted")), ("rendezvous", rnd.formed_at),
                     ("spawn", spawned), ("pg_init", phases.get("pg_ready")),
                     ("state_transfer", phases.get("state_loaded")), ("first_step", now)]  # fmt: skip
        else:
            mode = "process"
            marks = [("stop", rec.get("stopped_at")), ("rendezvous", rnd.formed_at),
                     ("spawn", rnd.spawned_at), ("pg_init", phases.get("pg_ready")),
                     ("ckpt_load", phases.get("ckpt_loaded") or phases.get("state_loaded")),
                     ("first_step", now)]  # fmt: skip
        # The workers know what they lost only when some of them held state: a round of
        # fresh processes says 0 (nothing to compare with). What we saw rank 0 complete
        # before the fault bounds it from below either way.
        lost = told.get("lost_steps")
        if self._last_step_seen is not None:
            seen = max(0, int(self._last_step_seen) - int(resume or 0))
            lost = seen if lost is None else max(int(lost), seen)
        self._report.recovered(
            round_=rnd.number, rec=rec, marks=marks, now=now, first_step=lead.get("step"),
            write=rnd.node_rank == 0, mode=mode, source=source, lost_steps=lost,
        )  # fmt: skip

    # -- reacting -------------------------------------------------------------------------------

    def _keeps_workers(self, rnd: Round, outcome: Outcome) -> bool:
        """restart.mode inprocess: whether this round's live workers go on into the next.
        Not when our own workers died or hung in a round that recovered in-process and
        never completed a step (a recovery that cannot work: the worker gives up after
        two failed recoveries in a row): then the process restart is the fallback. Another
        node's event during a recovery (a peer lost, a node waiting) keeps them."""
        if self.job.restart.mode != "inprocess" or not outcome.keeps_workers:
            return False
        if outcome == Outcome.PEER_PREEMPTED and not self._peer_preempted(
            rnd, rnd.workers.heartbeats()
        ):
            # Some exited with the preemption code: the others may be on their way out
            # too (a script that exits with it on a peer's preemption). Stopped as ever.
            return False
        own = outcome in (Outcome.WORKER_FAILED, Outcome.WORKER_HUNG)
        if outcome == Outcome.WORKER_HUNG and rnd.unstarted:
            return False  # stuck before their first step: nothing of theirs is worth keeping
        if outcome == Outcome.WORKER_HUNG and rnd.stuck and not rnd.first_step_seen:
            # Workers stuck in the round before: they alone are killed (_keep_workers);
            # their peers, which took this round, are kept for the next.
            return True
        if own and rnd.carried and not rnd.first_step_seen:
            log.warning(
                "in-process recovery did not reach a step; falling back to a process restart",
                **kv(job=self.name, round=rnd.number),
            )
            return False
        return True

    def _keep_workers(self, rnd: Round, outcome: Outcome) -> None:
        """End the round for our workers without stopping them: the control file tells
        them (they shut their round's sockets, leaving any blocked collective), and the
        live ones are handed to the next round. A hung worker is killed (it may be
        SIGSTOPped and cannot recover)."""
        w = rnd.workers
        if outcome == Outcome.WORKER_HUNG:
            # Stuck in the round before: they cannot take the next. One that SIGKILL does
            # not end within the wait (uninterruptible I/O) ends the round without its
            # usual record, as for a hung worker (its failure is claimed and counted first).
            for stuck in rnd.stuck:
                if stuck.proc.poll() is None:
                    stuck.proc.kill()
                    stuck.proc.wait(timeout=10)
        # Every hung worker: the stalest first, until none is past its bound (a worker
        # waiting on its peers has a longer one: the kill of the hung peer frees it).
        while outcome == Outcome.WORKER_HUNG:
            stalest = w.stalest_progress(self._clock())
            timeout = self.job.restart.hang_timeout
            if stalest is None or stalest.age <= hang_bound(timeout, waiting=stalest.waiting):
                break
            stalest.worker.proc.kill()
            stalest.worker.proc.wait(timeout=10)
        write_control(control_path(self._node.state_dir, self.record.run_id),
                      round_=rnd.number, state="abort", reason=str(outcome))  # fmt: skip
        self._kept = w
        self._metrics.set_worker_states(self.name, w.states())
        self._observe_progress(rnd, self._clock(), force=True, due=True)

    def _stop_workers(self, rnd: Round, outcome: Outcome) -> None:
        w, plan = rnd.workers, stop_plan(outcome, self.job.restart.grace_period)
        if plan.kill:
            w.kill()
        elif not (plan.wait_first and w.wait(plan.wait_first)):
            w.stop(plan.grace)
        self._metrics.set_worker_states(self.name, w.states())
        self._observe_progress(rnd, self._clock(), force=True, due=True)

    def _after(
        self, rnd: Round, outcome: Outcome, detail: str, detected: float, stopped: float
    ) -> None:
        log.info(
            "round ended",
            **kv(job=self.name, round=rnd.number, outcome=str(outcome), detail=detail),
        )
        if outcome == Outcome.SUCCEEDED:
            # Node rank 0 only (the others wait for it in _await_success), after its final
            # status write; refused by the transition table if cancelled meanwhile.
            self._registry.set_state(
                self.name, JobState.SUCCEEDED, "all workers exited 0", fence=self._report.fence
            )
            return
        if outcome in (Outcome.CANCELLED, Outcome.FINISHED):
            return
        if outcome == Outcome.FENCED:
            # A newer world exists: nothing of ours may be written. Join again as new.
            self._handler.leave()
            return
        try:
            self._record_failure(rnd, outcome, detail, detected, stopped)
        except FencedError as exc:
            log.warning(
                "fenced: the world moved on without us", **kv(job=self.name, error=str(exc))
            )
            self._handler.leave()
            return
        self._evidence = outcome.is_evidence
        if outcome.counts_as_failure:
            self._failures_here += 1
            # The first failure after training resumed re-forms at once; a crash loop
            # (failures with no step between them) backs off, doubling, and longer when
            # the job trained on without this node meanwhile (it alone is broken).
            furthest, before = self._job_furthest_step(), self._furthest_at_failure
            self._furthest_at_failure = furthest
            elsewhere = furthest is not None and before is not None and furthest > before
            pause = crash_loop_pause(self._failures_here, trained_elsewhere=elsewhere)
            if pause:
                time.sleep(pause)

    def _claim(
        self, rnd: Round, outcome: Outcome, detail: str, detected: float
    ) -> tuple[dict, bool]:
        """Name ``outcome`` as the cause of this round's end, unless another agent did
        first (``JobRegistry.claim_failure``). One that did while its workers only failed on
        a peer (:func:`failed_on_a_peer`) keeps the claim, and our cause is noted for the
        history (``JobRegistry.note_cause``): our worker died, hung or failed on its own,
        and theirs failed on it. Which agent writes first is a race (the kill of a hung
        worker fails its peers' collectives at once; a killed worker's agent sees the exit
        about when its peers' workers see their sockets close)."""
        info = {"reason": str(outcome), "node": self._node.node_id, "detail": detail,
                "detected_at": detected, "step": self._furthest_step,
                "by_peer": failed_on_a_peer(outcome, detail)}  # fmt: skip
        # Whoever records the recovery (a newcomer at node rank 0 too) learns the outage.
        info.update(_carried_outage(rnd) or {})
        fence = self._report.fence
        claim, ours = self._registry.claim_failure(self.name, rnd.number, info, fence=fence)
        if ours or info["by_peer"]:
            return claim, ours
        # Our worker failed on its own and another agent claimed the round. The next world
        # must know that our node, missing from it while it starts a new worker (a crash
        # loop backs off first), failed on its own and was not lost
        # (``JobReporter.reattribute``): from the cause's note, or else a note of our own.
        noted = False
        try:
            if claim.get("by_peer"):
                noted = self._registry.note_cause(self.name, rnd.number, info, fence=fence)
            if not noted:
                self._registry.note_own_failure(self.name, rnd.number, self._node.node_id,
                                                info, fence=fence)  # fmt: skip
        except ElasticdError as exc:  # the history keeps the claim's words
            log.warning("cause not noted", **kv(job=self.name, error=str(exc)))
        return claim, ours

    def _claim_early(self, rnd: Round, outcome: Outcome, detail: str, detected: float) -> None:
        """Claim the cause before our workers are stopped, for :meth:`_record_failure` to
        use, and count it at once when it is ours (as a preemption is): were stopping the
        workers to raise (a killed worker that cannot be reaped), the round would end
        without :meth:`_record_failure`, and a claim of ours left uncounted would count
        nowhere (every peer finds it taken). A claim that fails here (etcd away: bounded
        by the client's timeout, small beside the hang_timeout already spent; fenced) is
        made again there, where its error is handled."""
        try:
            claim, ours = self._claim(rnd, outcome, detail, detected)
        except ElasticdError as exc:
            log.warning("failure not claimed yet", **kv(job=self.name, error=str(exc)))
            return
        self._early_claim = (rnd.number, claim, ours, False)
        if ours:
            try:
                self._report.count(round_=rnd.number, claim=claim, limit=self._limit)
            except ElasticdError as exc:  # counted there instead
                log.warning("failure not counted yet", **kv(job=self.name, error=str(exc)))
                return
            self._early_claim = (rnd.number, claim, ours, True)

    def _job_furthest_step(self) -> int | None:
        """The job's furthest step as its status says (None: unknown, etcd away)."""
        try:
            record = self._registry.get(self.name)
        except ElasticdError:
            return None
        if record is None or record.run_id != self.record.run_id:
            return None
        step = record.status.get("furthest_step")
        return step if isinstance(step, int) and not isinstance(step, bool) else None

    def _record_failure(
        self, rnd: Round, outcome: Outcome, detail: str, detected: float, stopped: float
    ) -> None:
        if outcome == Outcome.USER_ERROR:
            # A config error fails the same way on every retry: fail now, spend nothing.
            codes = [w.returncode for w in rnd.workers.failed()]
            code = next((c for c in codes if c == USER_ERROR_EXIT_CODE), codes[0] if codes else 2)
            self._report.fail(f"user error (exit code {code}): {detail}")
            return
        # elasticd_restarts_total is counted by the next world's node rank 0, once, with
        # the cause corrected (JobReporter.reattribute).
        if outcome == Outcome.PREEMPTED:
            return
        fence = self._report.fence
        early, self._early_claim = self._early_claim, None
        counted = False
        if early is not None and early[0] == rnd.number:
            claim, ours, counted = early[1], early[2], early[3]
        else:
            claim, ours = self._claim(rnd, outcome, detail, detected)
        self._pending_recovery = {
            "reason": claim.get("reason", str(outcome)),
            "detected_at": min(float(claim.get("detected_at", detected)), detected),
            "stopped_at": stopped,
            "after_round": rnd.number,
        }
        # The same outage as an earlier failure (ours, else the claimer's): from its start.
        carried = _carried_outage(rnd) or _outage_of(claim)
        if carried is not None:
            carried["outage_from"] = min(carried["outage_from"],
                                         self._pending_recovery["detected_at"])  # fmt: skip
            self._pending_recovery.update(carried)
        self._registry.set_state(
            self.name, JobState.RECOVERING, f"{claim.get('reason')}: {claim.get('detail', '')}",
            fence=fence,
        )  # fmt: skip
        if ours and not counted:
            self._report.count(round_=rnd.number, claim=claim, limit=self._limit)
