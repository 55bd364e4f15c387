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
the first step after a re-form completes.
"""

from __future__ import annotations

import json
import logging
import os
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from elasticd.agent.policy import (
    Observation,
    Outcome,
    WorkerEnvInputs,
    backoff,
    decide,
    latest_checkpoint_step,
    worker_argv,
    worker_envs,
)
from elasticd.agent.workers import WorkerGroup
from elasticd.errors import ElasticdError
from elasticd.jobs import JobRecord, JobRegistry, JobState
from elasticd.jobspec import JobSpec
from elasticd.layout import plan
from elasticd.log import kv
from elasticd.metrics import AgentMetrics
from elasticd.worker import PREEMPTED_EXIT_CODE

log = logging.getLogger("elasticd.agent")

_FAILURE_REASONS = ("worker_failed", "worker_hung")
TICK = 0.05
"""Seconds between supervision ticks: worker exits and pushed changes act this fast."""
STATE_POLL = 0.5
"""Seconds between reads of the job's state in etcd (cancel is noticed this fast)."""
STATUS_EVERY = 1.0
"""Seconds between progress writes into the job's status."""
PEER_LOST_GRACE = 1.0
"""Grace after SIGTERM when the world is already broken: no save can succeed, so be quick."""
CANCEL_GRACE = 3.0
"""Grace after SIGTERM on cancel."""
FINISH_WAIT = 120.0
"""How long workers may take to exit after the job succeeded elsewhere."""


@dataclass(frozen=True, kw_only=True, slots=True)
class NodeInfo:
    """Who this agent is."""

    node_id: str
    """Stable node id (rendezvous member name)."""
    addr: str
    """Address peers and workers reach this node at."""
    state_dir: str
    """Per-node scratch: layouts, heartbeats, error files."""
    python: str = sys.executable
    """Interpreter for the built-in trainer."""


@dataclass(kw_only=True, slots=True)
class _Round:
    """Book-keeping of the round being supervised."""

    number: int
    node_rank: int
    nodes: tuple[str, ...]
    workers: WorkerGroup
    joined_at: float
    formed_at: float
    spawned_at: float
    step_at_spawn: int | None
    recovery: dict[str, Any] | None = None
    first_step_seen: bool = False


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
        make_handler: Callable[..., Any] | None = None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.record = record
        self.job: JobSpec = record.job()
        self.name = record.name
        self._client = client
        self._registry = registry
        self._node = node
        self._metrics = metrics
        self._preempt = preempt
        self._clock = clock
        self._make_handler = make_handler or self._default_handler
        self._changes: list[Any] = []
        self._changes_lock = threading.Lock()
        self._pending_recovery: dict[str, Any] | None = None
        self._failures_here = 0
        self.outcome: Outcome | None = None

    # -- rendezvous ---------------------------------------------------------------------------

    def _default_handler(self) -> Any:
        from elasticd.rendezvous import EtcdRendezvous, settings_from_job

        settings = settings_from_job(
            self.job,
            run_id=self.record.run_id,
            min_nodes=self.job.nodes.min,
            max_nodes=self.job.nodes.max,
        )
        return EtcdRendezvous(
            client=self._client,
            settings=settings,
            node_id=self._node.node_id,
            addr=self._node.addr,
            on_change=self._on_change,
        )

    def _on_change(self, change: Any) -> None:
        with self._changes_lock:
            self._changes.append(change)

    def _take_changes(self) -> list[Any]:
        with self._changes_lock:
            out, self._changes = self._changes, []
        return out

    # -- the loop -----------------------------------------------------------------------------

    def run(self) -> Outcome | None:
        """Run rounds until the job ends for this node; returns the last outcome."""
        from elasticd.rendezvous import RendezvousClosed, RendezvousTimeout

        handler = self._make_handler()
        try:
            while not self._preempt.is_set():
                current = self._registry.get(self.name)
                if (
                    current is None
                    or current.run_id != self.record.run_id
                    or current.state.terminal
                ):
                    break
                joined_at = self._clock()
                try:
                    world = handler.next_world()
                except RendezvousClosed:
                    break
                except RendezvousTimeout as exc:
                    self._fail_job(f"no world formed: {exc}")
                    break
                self._take_changes()  # changes of the previous world are handled already
                outcome = self._run_round(handler, world, joined_at)
                self.outcome = outcome
                if not outcome.reforms:
                    break
            if self._preempt.is_set() and self.outcome is None:
                self.outcome = Outcome.PREEMPTED
        finally:
            self._finish(handler)
        return self.outcome

    def _finish(self, handler: Any) -> None:
        """Leave the rendezvous; close the run when the job is over for everyone."""
        record = self._registry.get(self.name)
        try:
            if record is not None and record.state.terminal and record.run_id == self.record.run_id:
                handler.set_closed()  # wakes nodes still waiting for a round
        except ElasticdError as exc:
            log.warning("could not close the rendezvous", **kv(job=self.name, error=str(exc)))
        handler.close()  # revokes our lease: peers are told at once
        self._metrics.world_size.labels(job=self.name).set(0)
        self._metrics.set_worker_states(self.name, {})

    # -- one round ----------------------------------------------------------------------------

    def _round_dir(self, number: int) -> str:
        return os.path.join(self._node.state_dir, "jobs", self.record.run_id, f"round-{number}")

    def _start_round(self, world: Any, joined_at: float) -> _Round:
        job, nproc = self.job, self.job.nproc_per_node
        formed_at = self._clock()
        node_rank = world.rank_of(self._node.node_id)
        layout = plan(world.size * nproc, job)
        run_dir = self._round_dir(world.round)
        os.makedirs(run_dir, exist_ok=True)
        layout_path = os.path.join(run_dir, "layout.json")
        job_path = os.path.join(run_dir, "job.json")  # JSON is YAML: the trainer reads it
        _write_json(layout_path, layout.to_dict())
        _write_json(job_path, job.to_dict())
        status = self._registry.get(self.name)
        restarts = int(status.status.get("restarts", 0)) if status else 0
        envs = worker_envs(
            WorkerEnvInputs(
                job=self.name,
                run_id=self.record.run_id,
                round=world.round,
                node_rank=node_rank,
                nodes=world.size,
                nproc=nproc,
                master_addr=world.master_addr,
                master_port=world.master_port,
                restart_count=restarts,
                max_restarts=job.restart.max_restarts,
                layout_path=layout_path,
                job_path=job_path,
                extra=dict(os.environ),
            )
        )
        ckpt_step = latest_checkpoint_step(job.ckpt_dir)
        log_dir = os.path.join(job.out_dir, "logs", f"round-{world.round}")
        workers = WorkerGroup.spawn(
            argv=worker_argv(job.command, job_path, self._node.python),
            envs=envs,
            log_dir=log_dir,
            run_dir=run_dir,
            cwd=os.getcwd(),
            clock=self._clock,
        )
        spawned_at = self._clock()
        _write_json(
            os.path.join(run_dir, "workers.json"), {str(r): p for r, p in workers.pids().items()}
        )
        _write_json(
            os.path.join(self._node.state_dir, "workers.json"),
            {"job": self.name, "round": world.round, "pids": workers.pids()},
        )
        m = self._metrics
        m.rendezvous_rounds.labels(job=self.name).inc()
        m.rendezvous_seconds.labels(job=self.name).observe(formed_at - joined_at)
        m.world_size.labels(job=self.name).set(world.size)
        m.world_ranks.labels(job=self.name).set(world.size * nproc)
        log.info(
            "workers started",
            **kv(job=self.name, round=world.round, node_rank=node_rank, world=world.size,
                 dp=layout.dp, tp=layout.parallel.tp, pp=layout.parallel.pp, pids=workers.pids()),
        )  # fmt: skip
        recovery = self._pending_recovery
        if node_rank == 0:
            lost = self._reattribute(world)
            if lost and recovery is not None and recovery["reason"] in _FAILURE_REASONS:
                recovery = {**recovery, "reason": "peer_lost"}
            self._report_world(world, layout, ckpt_step)
        return _Round(
            number=world.round,
            node_rank=node_rank,
            nodes=tuple(world.nodes),
            workers=workers,
            joined_at=joined_at,
            formed_at=formed_at,
            spawned_at=spawned_at,
            step_at_spawn=ckpt_step,
            recovery=recovery,
        )

    def _reattribute(self, world: Any) -> list[str]:
        """A node death usually shows up first as our workers crashing (their collectives
        break at once, the dead node's lease expires a TTL later), so the previous round's
        claim may say worker_failed. The new world tells the truth: if members of the
        previous world are missing, the round ended because a node was lost, and that is
        not a worker restart. Returns the missing nodes."""
        record = self._registry.get(self.name)
        previous = record.status.get("nodes") if record is not None else None
        if not previous:
            return []
        lost = sorted(set(previous) - set(world.nodes))
        prev_round = world.round - 1
        if not lost:
            return []

        def change(st: dict[str, Any]) -> None:
            for event in st.get("history", []):
                if (event.get("kind") == "failure" and event.get("round") == prev_round
                        and event.get("reason") in _FAILURE_REASONS):  # fmt: skip
                    event["reason"] = "peer_lost"
                    event["detail"] = f"lost {','.join(lost)} ({event.get('detail', '')})"
                    st["restarts"] = max(0, int(st.get("restarts", 0)) - 1)

        self._registry.update_status(self.name, change)
        return lost

    def _report_world(self, world: Any, layout: Any, ckpt_step: int | None) -> None:
        self._registry.set_state(self.name, JobState.RUNNING, f"round {world.round}")
        summary = {
            "world": world.size,
            "ranks": layout.world,
            "active": layout.active,
            "dp": layout.dp,
            "tp": layout.parallel.tp,
            "pp": layout.parallel.pp,
            "vpp": layout.parallel.vpp,
            "ep": layout.parallel.ep,
        }
        text = "tp{tp} pp{pp} dp{dp}".format(**summary)
        self._registry.add_event(
            self.name,
            {"kind": "world", "round": world.round, "world": world.size, "nodes": list(world.nodes),
             "layout": text, "resume_step": ckpt_step},
            world=world.size, nodes=list(world.nodes), round=world.round, layout=summary,
            layout_text=text, checkpoint=ckpt_step,
        )  # fmt: skip

    def _run_round(self, handler: Any, world: Any, joined_at: float) -> Outcome:
        rnd = self._start_round(world, joined_at)
        self._pending_recovery = None
        try:
            outcome, detail = self._supervise(handler, rnd)
        except BaseException:
            rnd.workers.kill()
            raise
        detected_at = self._clock()
        if outcome == Outcome.PREEMPTED:
            # Claimed before the workers stop: our peers' workers exit with the
            # preemption code a moment later and must find the cause already named.
            claim, ours = self._registry.claim_failure(
                self.name, rnd.number,
                {"reason": "preempted", "node": self._node.node_id, "detail": "agent got SIGTERM",
                 "detected_at": detected_at},
            )  # fmt: skip
            if ours:
                self._count(rnd, claim)
        self._stop_workers(rnd, outcome)
        stopped_at = self._clock()
        if outcome == Outcome.SUCCEEDED and rnd.node_rank != 0:
            outcome, detail = self._await_success(rnd)
            detected_at = stopped_at = self._clock()
        self._after(rnd, outcome, detail, detected_at, stopped_at)
        return outcome

    def _await_success(self, rnd: _Round) -> tuple[Outcome, str]:
        """Our workers are done; node rank 0 reports the job (its final step, then the
        state). Stay in the world until it has: leaving now would look like a lost node to
        a rank 0 whose workers are still finishing. If rank 0's node dies meanwhile, the
        world re-forms and resumes from the final checkpoint, which ends at once."""
        deadline = self._clock() + FINISH_WAIT
        while self._clock() < deadline:
            record = self._registry.get(self.name)
            if record is None or record.state.terminal or self._preempt.is_set():
                return Outcome.FINISHED, "reported by node rank 0"
            for change in self._take_changes():
                if change.kind == "closed":
                    return Outcome.FINISHED, "run closed"
                if change.kind in ("lost", "lease-lost"):
                    return Outcome.PEER_LOST, "lost " + ",".join(change.nodes)
            time.sleep(STATE_POLL / 5)
        return Outcome.FINISHED, "node rank 0 never reported"

    def _supervise(self, handler: Any, rnd: _Round) -> tuple[Outcome, str]:
        job = self.job
        lost: set[str] = set()
        waiting: set[str] = set()
        closed = False
        state = JobState.RUNNING
        next_state_poll = next_status = 0.0
        ckpt_at_waiting: int | None = None
        ckpt_now: int | None = None
        while True:
            now = self._clock()
            for change in self._take_changes():
                if change.kind in ("lost", "lease-lost"):
                    lost.update(change.nodes)
                elif change.kind == "waiting" and len(rnd.nodes) < job.nodes.max:
                    # A member of our world that re-joins is also reported lost. At
                    # nodes.max a waiting node is a spare: it stays out until one is lost,
                    # then takes its place without a layout change.
                    waiting.update(n for n in change.nodes if n not in rnd.nodes)
                elif change.kind == "closed":
                    closed = True
            if now >= next_state_poll:
                record = self._registry.get(self.name)
                state = record.state if record is not None else JobState.CANCELLED
                if record is not None and record.run_id != self.record.run_id:
                    state = JobState.CANCELLED  # replaced under us
                next_state_poll = now + STATE_POLL
                if waiting:
                    ckpt_now = latest_checkpoint_step(job.ckpt_dir)
                    if ckpt_at_waiting is None:
                        ckpt_at_waiting = ckpt_now if ckpt_now is not None else -1
            stalest = rnd.workers.stalest_progress(now)
            obs = Observation(
                preempting=self._preempt.is_set(),
                job_state=state,
                run_closed=closed,
                lost=tuple(sorted(lost)),
                waiting=tuple(sorted(waiting)),
                exit_codes=tuple(w.returncode for w in rnd.workers.workers),
                preempted_code=PREEMPTED_EXIT_CODE,
                stalest_heartbeat=stalest[1] if stalest else None,
                hang_timeout=job.restart.hang_timeout,
                scale_up_policy=job.restart.scale_up,
                checkpoint_at_waiting=ckpt_at_waiting,
                checkpoint_now=ckpt_now,
            )
            self._observe_progress(rnd, now, force=False, due=now >= next_status)
            if now >= next_status:
                next_status = now + STATUS_EVERY
            outcome = decide(obs)
            if outcome is not None:
                return outcome, self._detail(outcome, rnd, obs, stalest)
            time.sleep(TICK)

    def _detail(self, outcome: Outcome, rnd: _Round, obs: Observation, stalest: Any) -> str:
        if outcome == Outcome.WORKER_FAILED:
            return "; ".join(w.failure_message() for w in rnd.workers.failed())
        if outcome == Outcome.WORKER_HUNG and stalest:
            return f"rank {stalest[0].rank}: no progress for {stalest[1]:.1f} s"
        if outcome == Outcome.PEER_LOST:
            return "lost " + ",".join(obs.lost)
        if outcome == Outcome.SCALE_UP:
            return "waiting " + ",".join(obs.waiting)
        return str(outcome)

    # -- progress, status and metrics ----------------------------------------------------------

    def _observe_progress(self, rnd: _Round, now: float, *, force: bool, due: bool) -> None:
        beats = rnd.workers.heartbeats()
        m = self._metrics
        m.set_worker_states(self.name, rnd.workers.states())
        stalest = rnd.workers.stalest_progress(now)
        m.heartbeat_age.labels(job=self.name).set(stalest[1] if stalest else 0.0)
        lead = beats.get(0)
        if lead is None or "step" not in lead:
            return
        m.step.labels(job=self.name).set(lead["step"])
        if "loss" in lead:
            m.loss.labels(job=self.name).set(lead["loss"])
        if "tokens_per_s" in lead:
            m.tokens_per_second.labels(job=self.name).set(lead["tokens_per_s"])
        if not rnd.first_step_seen:
            rnd.first_step_seen = True
            self._record_recovery(rnd, lead, now)
        if rnd.node_rank == 0 and (due or force):
            ckpt = latest_checkpoint_step(self.job.ckpt_dir)
            if ckpt is not None:
                m.checkpoint_step.labels(job=self.name).set(ckpt)
            fields = {k: lead[k] for k in ("step", "loss", "tokens_per_s") if k in lead}
            fields["checkpoint"] = ckpt
            try:
                self._registry.update_status(self.name, lambda st: st.update(fields))
            except ElasticdError as exc:
                log.warning("status update failed", **kv(job=self.name, error=str(exc)))

    def _record_recovery(self, rnd: _Round, lead: dict[str, Any], now: float) -> None:
        """The first step after a re-form: the recovery is over; write its parts."""
        rec = rnd.recovery
        if rec is None:
            return
        t0 = float(rec["detected_at"])
        phases = lead.get("phases", {}) or {}
        marks = [("stop", rec.get("stopped_at")), ("rendezvous", rnd.formed_at),
                 ("spawn", rnd.spawned_at), ("pg_init", phases.get("pg_ready")),
                 ("ckpt_load", phases.get("ckpt_loaded")), ("first_step", now)]  # fmt: skip
        parts, prev = {}, t0
        for name, t in marks:
            if t is None:
                continue
            parts[name] = round(max(0.0, float(t) - prev), 3)
            prev = max(prev, float(t))
        total = round(now - t0, 3)
        reason = str(rec.get("reason", "unknown"))
        self._metrics.recovery_seconds.labels(job=self.name, reason=reason).observe(total)
        log.info("recovered", **kv(job=self.name, round=rnd.number, seconds=total, **parts))
        if rnd.node_rank == 0:
            event = {"kind": "recovery", "round": rnd.number, "reason": reason,
                     "detected_at": t0, "seconds": total, "parts": parts,
                     "first_step": lead.get("step")}  # fmt: skip
            try:
                self._registry.add_event(self.name, event)
            except ElasticdError as exc:
                log.warning("recovery record failed", **kv(job=self.name, error=str(exc)))

    # -- reacting -------------------------------------------------------------------------------

    def _stop_workers(self, rnd: _Round, outcome: Outcome) -> None:
        w = rnd.workers
        grace = self.job.restart.grace_period
        if outcome in (Outcome.SUCCEEDED, Outcome.PEER_PREEMPTED):
            w.stop(grace)  # they are exiting (or exited) on their own
        elif outcome == Outcome.FINISHED:
            if not w.wait(FINISH_WAIT):
                w.stop(CANCEL_GRACE)
        elif outcome == Outcome.PREEMPTED:
            # SIGTERM = "save an emergency checkpoint now" (elasticd.worker).
            w.stop(grace)
        elif outcome == Outcome.SCALE_UP:
            # Everyone is healthy: let the workers agree on an emergency save too.
            w.stop(grace)
        elif outcome == Outcome.CANCELLED:
            w.stop(CANCEL_GRACE)
        elif outcome == Outcome.WORKER_HUNG:
            w.kill()  # a stopped (SIGSTOP) or wedged process ignores SIGTERM anyway
        else:
            w.stop(PEER_LOST_GRACE)
        self._metrics.set_worker_states(self.name, w.states())
        self._observe_progress(rnd, self._clock(), force=True, due=True)

    def _after(
        self, rnd: _Round, outcome: Outcome, detail: str, detected: float, stopped: float
    ) -> None:
        log.info(
            "round ended",
            **kv(job=self.name, round=rnd.number, outcome=str(outcome), detail=detail),
        )
        if outcome == Outcome.SUCCEEDED:
            # Node rank 0 only (the others wait for it in _await_success), after its final
            # status write; refused by the transition table if cancelled meanwhile.
            self._registry.set_state(self.name, JobState.SUCCEEDED, "all workers exited 0")
            return
        if outcome in (Outcome.CANCELLED, Outcome.FINISHED):
            return
        self._metrics.restarts.labels(job=self.name, reason=str(outcome)).inc()
        if outcome == Outcome.PREEMPTED:
            return
        claim, ours = self._registry.claim_failure(
            self.name, rnd.number,
            {"reason": str(outcome), "node": self._node.node_id, "detail": detail,
             "detected_at": detected},
        )  # fmt: skip
        self._pending_recovery = {
            "reason": claim.get("reason", str(outcome)),
            "detected_at": min(float(claim.get("detected_at", detected)), detected),
            "stopped_at": stopped,
        }
        self._registry.set_state(
            self.name, JobState.RECOVERING, f"{claim.get('reason')}: {claim.get('detail', '')}"
        )
        if ours:
            self._count(rnd, claim)
        if outcome.counts_as_failure:
            self._failures_here += 1
            pause = backoff(self._failures_here)
            if pause:
                time.sleep(pause)

    def _count(self, rnd: _Round, claim: dict[str, Any]) -> None:
        """Our claim names the cause of this round's end: count it, maybe fail the job."""
        failure = claim.get("reason") in _FAILURE_REASONS
        limit = self.job.restart.max_restarts

        def change(st: dict[str, Any]) -> None:
            st["reforms"] = int(st.get("reforms", 0)) + 1
            if failure:
                st["restarts"] = int(st.get("restarts", 0)) + 1
                st["last_failure"] = (
                    f"round {rnd.number}: {claim.get('reason')}: {claim.get('detail', '')}"
                )
            st.setdefault("history", []).append(
                {"t": round(self._clock(), 3), "kind": "failure", "round": rnd.number,
                 "reason": claim.get("reason"), "node": claim.get("node"),
                 "detail": claim.get("detail", "")}
            )  # fmt: skip

        status = self._registry.update_status(self.name, change)
        if failure and int(status.get("restarts", 0)) > limit:
            self._fail_job(f"restart limit reached ({limit}): {status.get('last_failure')}")

    def _fail_job(self, reason: str) -> None:
        log.error("job failed", **kv(job=self.name, reason=reason))
        self._registry.set_state(self.name, JobState.FAILED, reason)


def _write_json(path: str, obj: Any) -> None:
    tmp = f"{path}.tmp"
    with open(tmp, "w", encoding="utf-8") as fh:
        json.dump(obj, fh, separators=(",", ":"))
    os.replace(tmp, path)
