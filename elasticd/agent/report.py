"""What the agents write about a job into its etcd status, and into the metrics.

Node rank 0 of each world is the job's reporter: the world and layout when a round
starts, step/loss/checkpoint as training goes, and the recovery record (with its parts)
when the first step after a re-form completes. Failures are counted by whichever agent
claimed the round's cause (``JobRegistry.claim_failure``), so each counts once.

Every write is fenced by the round it is made for (``fence``, set when a round starts):
once a newer world exists the write is refused, ``fenced`` turns true, and the runner
stops its stale workers and joins again as a new member.
"""

from __future__ import annotations

import json
import logging
import os
import time
from collections.abc import Callable
from typing import Any

from elasticd.agent.policy import (
    count_failure,
    note_furthest_step,
    pending_limit_verdict,
    restart_limit_reached,
    uncount_failure,
)
from elasticd.errors import ElasticdError
from elasticd.jobs import (
    FAILURE_REASONS,
    FAILURES_PRUNE_EVERY,
    Fence,
    FencedError,
    JobRegistry,
    JobState,
)
from elasticd.log import kv
from elasticd.metrics import AgentMetrics

log = logging.getLogger("elasticd.agent")

EVENTS_FILE = "events.jsonl"
"""In the job's output_dir: one JSON object per world, recovery, checkpoint save and load."""
"""Round-ending causes that use up one of restart.max_restarts."""
PART_MARKS = ("stop", "rendezvous", "spawn", "pg_init", "ckpt_load", "first_step")
"""The parts of a process restart's recovery, in order."""
INPROCESS_PART_MARKS = ("abort", "rendezvous", "pg_init", "state_transfer", "first_step")
"""The parts of an in-process recovery, in order (``detect``, from the fault itself to the
first node knowing, is measured by bench/recovery.py: no agent knows when a node died)."""


def checkpoint_facts(ckpt_dir: str, step: int) -> tuple[int, float | None] | None:
    """A committed checkpoint's total bytes (every rank's file) and commit time, from its
    manifest (plain JSON: the agent does not import the checkpoint library); None if
    unreadable."""
    path = os.path.join(ckpt_dir, f"step-{int(step):09d}", "manifest.json")
    try:
        with open(path, "rb") as fh:
            manifest = json.load(fh)
        size = sum(int(f.get("bytes", 0)) for f in manifest.get("files", {}).values())
        created = manifest.get("created_unix")
        return size, float(created) if created is not None else os.path.getmtime(path)
    except (OSError, ValueError, TypeError, AttributeError):
        return None


def _restarted(status: dict[str, Any], world: Any) -> set[str]:
    """Members of ``world`` that were in the previous one as another agent process (killed
    and started again under the node's id within a TTL, so they re-joined before their old
    lease expired): lost all the same, their workers and state with them."""
    before = status.get("incarnations")
    if not isinstance(before, dict):
        return set()
    return {m.node for m in getattr(world, "members", ())
            if m.incarnation and before.get(m.node) not in (None, "", m.incarnation)}  # fmt: skip


def _uncounted(event: dict[str, Any]) -> bool:
    return event.get("kind") == "failure" and not event.get("counted")


def recovery_parts(t0: float, marks: list[tuple[str, float | None]]) -> dict[str, float]:
    """Durations between consecutive known moments from ``t0``; unknown moments are skipped
    (their time falls into the next known part)."""
    parts, prev = {}, t0
    for name, t in marks:
        if t is None:
            continue
        parts[name] = round(max(0.0, float(t) - prev), 3)
        prev = max(prev, float(t))
    return parts


class JobReporter:
    """Writes one job's status through the registry and observes the metrics."""

    def __init__(
        self,
        *,
        name: str,
        registry: JobRegistry,
        metrics: AgentMetrics,
        clock: Callable[[], float] = time.time,
        events_path: str | None = None,
    ) -> None:
        """``events_path``: the run's ``events.jsonl`` (worlds, recoveries, checkpoint saves
        and loads, appended by node rank 0 for ``elasticd report``); None: not written."""
        self.name = name
        self._events_path = events_path
        self._registry = registry
        self._metrics = metrics
        self._clock = clock
        self.fence: Fence | None = None
        """The round writes are made for (None: unfenced, before the first world)."""
        self.fenced = False
        """Whether a write of the current round was refused (a newer world exists)."""
        self.job_failed = False
        """Whether this reporter marked the job failed."""
        self.noted_reason: str | None = None
        """The cause :meth:`reattribute` put in a claim's place (a noted cause), if any."""
        self._step_seen: int | None = None
        self._save_seen: Any = None
        self._ckpt_seen: int | None = None

    def _event(self, event: dict[str, Any]) -> None:
        """Append one record to the run's events.jsonl (best effort: a full or missing
        disk costs the report a line, never the job)."""
        if self._events_path is None:
            return
        line = json.dumps({"t": round(self._clock(), 3), **event}, separators=(",", ":"))
        try:
            with open(self._events_path, "a", encoding="utf-8") as fh:
                fh.write(line + "\n")
        except OSError as exc:
            log.debug("event not written", **kv(job=self.name, error=str(exc)))

    def for_round(self, fence: Fence | None) -> None:
        """Writes from now on are made on behalf of ``fence``'s round."""
        self.fence, self.fenced, self.job_failed = fence, False, False

    def world_formed(self, world: Any, layout: Any, ckpt_step: int | None) -> None:
        """A round started with us as node rank 0: the job runs in this world."""
        f = self.fence
        self._registry.set_state(self.name, JobState.RUNNING, f"round {world.round}", fence=f)
        p = layout.parallel
        summary = {"world": world.size, "ranks": layout.world, "active": layout.active,
                   "dp": layout.dp, "tp": p.tp, "pp": p.pp, "vpp": p.vpp, "ep": p.ep}  # fmt: skip
        text = "tp{tp} pp{pp} dp{dp}".format(**summary)
        self._event({"kind": "world", "round": world.round, "world": world.size,
                     "nodes": list(world.nodes), "layout": text, "resume_step": ckpt_step})  # fmt: skip
        # The event carries no node list (a thousand nodes would swell every history
        # entry); the status keeps only the current world's nodes.
        self._registry.add_event(
            self.name,
            {"kind": "world", "round": world.round, "world": world.size, "layout": text,
             "resume_step": ckpt_step},
            world=world.size, nodes=list(world.nodes), round=world.round, layout=summary,
            layout_text=text, checkpoint=ckpt_step, fence=f,
            incarnations={m.node: m.incarnation for m in world.members if m.incarnation},
        )  # fmt: skip
        if world.round % FAILURES_PRUNE_EVERY == 0:  # a few ms, once in 16 rounds
            try:
                self._registry.prune_failures(self.name, world.round - 1, fence=f)
            except ElasticdError as exc:  # the next prune takes them
                log.warning("old failure records not pruned", **kv(job=self.name, error=str(exc)))

    def reattribute(self, world: Any) -> list[str]:
        """A node death usually shows up first as our workers crashing (their collectives
        break at once, the dead node's lease expires a TTL later), so the previous round's
        claim may say worker_failed. The new world tells the truth: if members of the
        previous world are missing, the round ended because a node was lost, and that is
        not a worker restart (nor the job's ``last_failure``).

        Likewise, a claim made by an agent whose workers only failed on a peer yields to
        the cause the agent that saw it noted (``JobRegistry.note_cause``: its worker was
        killed, hung or failed on its own): the history, ``last_failure`` and the counted
        reason name that one (:attr:`noted_reason`).

        Node rank 0 of the new world then counts the re-forms not yet counted into
        ``elasticd_restarts_total``, with their corrected cause: once each, by one agent.
        Returns the missing nodes (call before ``world_formed``)."""
        self.noted_reason = None
        record = self._registry.get(self.name)
        status = record.status if record is not None else {}
        previous = status.get("nodes")
        lost = sorted(set(previous or ()) - set(world.nodes) | _restarted(status, world))
        if lost:
            # A node whose own worker ended the round is missing only while it starts a
            # new one (a crash loop backs off first): not lost. Its failure counts, or a
            # script that crashes every time would re-form for ever, each round a
            # "lost node" that uses no restart.
            own = self._failed_on_their_own(world.round - 1)
            lost = [n for n in lost if n not in own]
        if (not lost and "limit_reached" not in status
                and not any(_uncounted(e) for e in status.get("history", []))):  # fmt: skip
            return []
        prev_round = world.round - 1
        counted: list[str] = []
        verdict: list[str] = []
        noted = None
        if not lost and any(_uncounted(e) and e.get("round") == prev_round
                            for e in status.get("history", [])):  # fmt: skip
            noted = self._registry.cause_of(self.name, prev_round)
            if (isinstance(noted, dict) and noted.get("reason") not in FAILURE_REASONS
                    and self._registry.own_failures(self.name, prev_round)):  # fmt: skip
                noted = None  # a worker failed on its own too: the claim's failure stands

        applied: list[str] = []

        def change(st: dict[str, Any]) -> None:
            counted.clear()
            verdict.clear()
            applied.clear()
            for event in st.get("history", []):
                if not _uncounted(event):
                    continue
                if (lost and event.get("round") == prev_round
                        and event.get("reason") in FAILURE_REASONS):  # fmt: skip
                    event["reason"] = "peer_lost"
                    event["detail"] = f"lost {','.join(lost)} ({event.get('detail', '')})"
                    uncount_failure(st)
                    st["last_failure"] = f"round {prev_round}: peer_lost: {event['detail']}"
                elif (noted and event.get("round") == prev_round
                        and event.get("reason") in FAILURE_REASONS
                        and noted.get("reason") in FAILURE_REASONS):  # fmt: skip
                    for k in ("reason", "detail", "node"):
                        event[k] = noted.get(k)
                    applied.append(noted["reason"])
                    if str(st.get("last_failure", "")).startswith(f"round {prev_round}: "):
                        st["last_failure"] = (
                            f"round {prev_round}: {noted['reason']}: {noted.get('detail', '')}"
                        )
                elif (noted and event.get("round") == prev_round
                        and event.get("reason") in FAILURE_REASONS
                        and isinstance(noted.get("reason"), str)):  # fmt: skip
                    # A peer ended the round on purpose (a scale-up: a node was waiting) and
                    # our claim, first by a moment, named its workers' collectives failing
                    # on the connections that end shut: no failure, and no restart used (a
                    # CI run's job with max_restarts 0 failed so when a newcomer joined).
                    for k in ("reason", "detail", "node"):
                        event[k] = noted.get(k)
                    applied.append(noted["reason"])
                    uncount_failure(st)
                    if str(st.get("last_failure", "")).startswith(f"round {prev_round}: "):
                        del st["last_failure"]
                event["counted"] = True
                counted.append(str(event.get("reason")))
            # The restart limit was reached at the failure before: now that this world
            # shows whether it lost a node (no restart used), it is decided. A verdict
            # to fail stays pending until the job is failed (decided again if that
            # write does not land).
            if "limit_reached" in st:
                reason = pending_limit_verdict(st)
                if reason:
                    verdict.append(reason)
                else:
                    del st["limit_reached"]

        self._registry.update_status(self.name, change, fence=self.fence)
        self.noted_reason = applied[0] if applied else None
        for reason in counted:
            self._metrics.restarts.labels(self.name, reason).inc()
        if verdict:
            self.fail(verdict[0])
        return lost

    def _failed_on_their_own(self, round_: int) -> set[str]:
        """The nodes whose own workers ended round ``round_`` (a worker that died, hung or
        failed on its own, as its agent claimed or noted it; not one that failed on a
        peer). Such a node that really died right after (its worker crashed, then the
        node went) is counted as a worker failure, not a lost node: one restart, which
        the next step's progress gives back to the streak."""
        nodes = self._registry.own_failures(self.name, round_)
        for rec in (self._registry.claim_of(self.name, round_),
                    self._registry.cause_of(self.name, round_)):  # fmt: skip
            if (isinstance(rec, dict) and rec.get("reason") in FAILURE_REASONS
                    and not rec.get("by_peer") and isinstance(rec.get("node"), str)):  # fmt: skip
                nodes.add(rec["node"])
        return nodes

    def progress(
        self, lead: dict[str, Any], *, checkpoint: int | None, write: bool, lead_node: bool = True,
        ckpt_dir: str | None = None,
    ) -> None:  # fmt: skip
        """Rank 0's last heartbeat: into the metrics if we are node rank 0 (``lead_node``),
        and into the status if ``write``."""
        if lead_node:
            self._lead_metrics(lead, checkpoint, ckpt_dir)
        if not write:
            return
        # The loss and throughput written are the step's own, or none: a heartbeat without
        # them (a script that reports them now and then) must not leave an older step's.
        fields = {k: lead.get(k) for k in ("step", "loss", "tokens_per_s")}
        fields["checkpoint"] = checkpoint

        def change(st: dict[str, Any]) -> None:
            st.update(fields)
            note_furthest_step(st, fields.get("step"), self.fence.round if self.fence else None)

        try:
            self._registry.update_status(self.name, change, fence=self.fence)
        except FencedError as exc:
            self._fenced(exc)
        except ElasticdError as exc:
            log.warning("status update failed", **kv(job=self.name, error=str(exc)))

    def _lead_metrics(
        self, lead: dict[str, Any], checkpoint: int | None, ckpt_dir: str | None
    ) -> None:
        m, j = self._metrics, self.name
        step = lead["step"]
        if step != self._step_seen:
            # Steps between two looks are not seen: the histogram samples (about every
            # step once a step takes longer than the agent's 50 ms tick).
            if lead.get("step_s") is not None:
                m.step_seconds.labels(j).observe(float(lead["step_s"]))
            self._step_seen = step
            m.last_step_time.labels(j).set(float(lead.get("t") or self._clock()))
        m.step.labels(j).set(step)
        if "loss" in lead:
            m.loss.labels(j).set(lead["loss"])
        if "tokens_per_s" in lead:
            m.tokens_per_second.labels(j).set(lead["tokens_per_s"])
        if isinstance(lead.get("mfu"), int | float):
            m.mfu.labels(j).set(lead["mfu"])
        saved = lead.get("checkpoint_save")
        if isinstance(saved, dict) and saved.get("step") != self._save_seen:
            self._save_seen = saved.get("step")
            m.ckpt_save_seconds.labels(j).observe(float(saved.get("seconds", 0.0)))
            facts = checkpoint_facts(ckpt_dir, int(saved["step"])) if ckpt_dir else None
            if facts is not None:
                m.ckpt_saved_bytes.labels(j).inc(facts[0])
            self._event({"kind": "checkpoint_save", "step": int(saved["step"]),
                         "seconds": float(saved.get("seconds", 0.0)),
                         "bytes": facts[0] if facts else None})  # fmt: skip
            checkpoint = max(checkpoint or 0, int(saved["step"]))
        if checkpoint is not None and checkpoint != self._ckpt_seen and ckpt_dir:
            self._ckpt_seen = checkpoint
            m.checkpoint_step.labels(j).set(checkpoint)
            facts = checkpoint_facts(ckpt_dir, checkpoint)
            if facts is not None and facts[1] is not None:
                m.checkpoint_commit_time.labels(j).set(facts[1])

    def loaded(self, *, seconds: float, ckpt_dir: str, step: int) -> None:
        """Node rank 0's workers loaded checkpoint ``step`` from disk at a world's start."""
        m, j = self._metrics, self.name
        m.ckpt_load_seconds.labels(j).observe(max(0.0, seconds))
        facts = checkpoint_facts(ckpt_dir, step)
        if facts is not None:
            m.ckpt_loaded_bytes.labels(j).inc(facts[0])
        self._event({"kind": "checkpoint_load", "step": step, "seconds": round(max(0.0, seconds), 4),
                     "bytes": facts[0] if facts else None})  # fmt: skip

    def recovered(
        self, *, round_: int, rec: dict[str, Any], marks: list[tuple[str, float | None]],
        now: float, first_step: int | None, write: bool, mode: str = "process",
        source: str = "checkpoint", lost_steps: int | None = None,
    ) -> None:  # fmt: skip
        """The first step after a re-form completed: the recovery is over. ``mode``:
        inprocess or process; ``source``: peers, replica, checkpoint or none (started
        over); ``lost_steps``: completed steps that had to be trained again."""
        t0 = float(rec["detected_at"])
        parts = recovery_parts(t0, marks)
        # After failed attempts (a second fault during the recovery): from the first fault's
        # detection, the time until this attempt's fault first.
        start = min(t0, float(rec.get("outage_from", t0)))
        if start < t0:
            parts = {"failed_attempts": round(t0 - start, 3), **parts}
        total = round(now - start, 3)
        reason = str(rec.get("reason", "unknown"))
        m = self._metrics
        if write:  # node rank 0 only: each recovery is counted once
            m.recovery_seconds.labels(self.name, mode, source).observe(total)
            m.recoveries.labels(self.name, reason, mode, source).inc()
            m.last_recovery_seconds.labels(self.name).set(total)
            m.last_recovery_time.labels(self.name).set(now)
            if lost_steps:
                m.lost_steps.labels(self.name).inc(lost_steps)
        log.info(
            "recovered",
            **kv(job=self.name, round=round_, seconds=total, mode=mode, source=source,
                 lost_steps=lost_steps, **parts),
        )  # fmt: skip
        if not write:
            return
        event = {"kind": "recovery", "round": round_, "reason": reason, "detected_at": start,
                 "seconds": total, "parts": parts, "first_step": first_step, "mode": mode,
                 "source": source, "lost_steps": lost_steps,
                 "attempts": int(rec.get("attempts", 1))}  # fmt: skip
        self._event(event)
        try:
            self._registry.add_event(self.name, event, fence=self.fence)
        except FencedError as exc:
            self._fenced(exc)
        except ElasticdError as exc:
            log.warning("recovery record failed", **kv(job=self.name, error=str(exc)))

    def _fenced(self, exc: FencedError) -> None:
        if not self.fenced:
            log.warning("fenced: our round is over", **kv(job=self.name, error=str(exc)))
        self.fenced = True

    def count(self, *, round_: int, claim: dict[str, Any], limit: int) -> bool:
        """Our claim names the cause of this round's end: count it. Returns whether the
        job is now past its restart limit (failures in a row without progress,
        :func:`~elasticd.agent.policy.count_failure`).

        The job is not failed here but by the next world's node rank 0
        (:meth:`reattribute`): a node's death shows first as its peers' workers failing,
        and only the next world, formed without it, tells that this failure was a lost
        node, which uses no restart. Until then the status holds ``limit_reached``."""
        failure = claim.get("reason") in FAILURE_REASONS
        reached: list[bool] = []

        def change(st: dict[str, Any]) -> None:
            st["reforms"] = int(st.get("reforms", 0)) + 1
            reached.clear()
            if failure:
                count_failure(st, claim.get("step"), round_)
                st["last_failure"] = (
                    f"round {round_}: {claim.get('reason')}: {claim.get('detail', '')}"
                )
                if restart_limit_reached(st, limit):
                    st["limit_reached"] = {"round": round_, "max_restarts": limit}
                    reached.append(True)
            st.setdefault("history", []).append(
                {"t": round(self._clock(), 3), "kind": "failure", "round": round_,
                 "reason": claim.get("reason"), "node": claim.get("node"),
                 "detail": claim.get("detail", "")}
            )  # fmt: skip

        self._registry.update_status(self.name, change, fence=self.fence)
        if reached:
            log.warning("restart limit reached: the job fails unless the next world shows a "
                        "lost node", **kv(job=self.name, round=round_, max_restarts=limit))  # fmt: skip
        return bool(reached)

    def fail(self, reason: str) -> None:
        """Mark the job failed (fenced: a stale round cannot fail a newer world's job)."""
        log.error("job failed", **kv(job=self.name, reason=reason))
        self.job_failed = self._registry.set_state(
            self.name, JobState.FAILED, reason, fence=self.fence
        )
