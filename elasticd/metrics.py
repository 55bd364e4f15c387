"""Prometheus metrics of the agent, on an injected CollectorRegistry.

Names follow Prometheus conventions: an ``elasticd_`` prefix, base units (seconds, bytes),
``_total`` for counters. Per-job series carry the ``elasticd_job`` label (the elasticd job
name; ``job`` is Prometheus' own target label and would clash with it).

**Right when summed, by construction** (docs/metrics.md lists every series):

- *agent* series describe this agent alone (its workers, its etcd errors); a sum over
  agents is the cluster's total.
- *job* series describe the whole job; only the agent that is node rank 0 of the job's
  current world exports the gauges (every other agent removes them), and each event
  (a step, a save, a recovery, a re-form) is counted by exactly one agent, so ``sum`` over
  agents is the job's total even when node rank 0 moves.
- *cluster* series (nodes alive, each job's ``nodes.min``) come from the coordinator, the
  live agent with the lowest id.

Worker-side numbers (step, loss, tokens/s, checkpoint times) come through the heartbeat
channel of :mod:`elasticd.worker`, so workers need no HTTP server of their own.
"""

from __future__ import annotations

import contextlib
import errno
import time
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    disable_created_metrics,
    start_http_server,
)

from elasticd.errors import UsageError

if TYPE_CHECKING:
    from elasticd.agent.health import Health

JOB_LABEL = "elasticd_job"
TROUBLE_KINDS = ("round_failed", "runner_crashed")
"""The ``kind`` label of ``elasticd_node_troubles_total``."""
WORKER_STATES = ("starting", "running", "stopping", "exited", "failed")
RESTART_REASONS = (
    "worker_failed",
    "worker_hung",
    "collective_failed",
    "peer_lost",
    "scale_up",
    "preempted",
)
RECOVERY_SOURCES = ("peers", "replica", "checkpoint", "none")
# An in-process recovery takes tenths of a second, a process restart seconds, torchrun's
# tens of seconds: the buckets cover all three, so they compare on one dashboard (with
# 0.5 s the lowest, every in-process recovery of 0.27-0.62 s read as p50 0.5).
RECOVERY_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1, 2, 5, 10, 20, 30, 60, 120, 300)
STEP_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2, 5, 10, 30, 60, 120)
CKPT_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1, 2, 5, 10, 30, 60, 120, 300, 600)


class AgentMetrics:
    """Every series the agent exports (``docs/metrics.md`` is the catalogue)."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.registry = registry
        r, j = registry, JOB_LABEL

        # -- agent series: this agent only; sum over agents is the cluster's total --------
        self.agent_start_time = Gauge(
            "elasticd_agent_start_time_seconds", "Unix time this agent started.", registry=r
        )
        self.agent_registrations = Counter(
            "elasticd_agent_registrations_total",
            "Times this agent registered its node in etcd (more than one: its lease was lost).",
            registry=r,
        )
        self.etcd_errors = Counter(
            "elasticd_etcd_request_errors_total",
            "etcd requests of this agent that failed (each failed attempt), by operation and "
            "gRPC code.", ["op", "code"], registry=r,
        )  # fmt: skip
        self.worker_states = Gauge(
            "elasticd_workers", "This agent's worker processes of the job, by state.",
            [j, "state"], registry=r,
        )  # fmt: skip
        self.heartbeat_age = Gauge(
            "elasticd_worker_heartbeat_age_seconds",
            "Seconds since the worker of this agent nearest to being judged hung last "
            "reported progress (one waiting on its peers in a collective has twice the "
            "bound; aggregate with max).", [j], registry=r,
        )  # fmt: skip
        self.node_troubles = Counter(
            "elasticd_node_troubles_total",
            "Times this node could not take part in the job and backs off: its round failed "
            "(kind round_failed) or its job runner crashed (runner_crashed).", [j, "kind"],
            registry=r,
        )  # fmt: skip
        self.in_world = Gauge(
            "elasticd_job_node_in_world",
            "1 while this agent's workers train in the job's world, else 0 (waiting, spare, "
            "re-forming); the sum over agents is the nodes training.", [j], registry=r,
        )  # fmt: skip
        self.rendezvous_rounds = Counter(
            "elasticd_rendezvous_rounds_total",
            "Rendezvous rounds of the job this agent joined (sum: node-memberships).", [j],
            registry=r,
        )  # fmt: skip
        self.rendezvous_seconds = Histogram(
            "elasticd_rendezvous_seconds",
            "Time from this agent joining a round to its world being known.", [j],
            buckets=(0.1, 0.25, 0.5, 1, 2, 3, 5, 10, 30, 60, 300), registry=r,
        )  # fmt: skip

        # -- cluster series: the coordinator (lowest live node id) only --------------------
        self.nodes_alive = Gauge(
            "elasticd_nodes_alive", "Agents registered in etcd (leases alive).", registry=r
        )
        self.nodes_min = Gauge(
            "elasticd_job_nodes_min", "nodes.min of each job not yet finished.", [j], registry=r
        )
        self.checkpoint_every = Gauge(
            "elasticd_job_checkpoint_every_steps",
            "checkpoint.every of each job not yet finished (0: only the final save).", [j],
            registry=r,
        )  # fmt: skip
        self.job_state = Gauge(
            "elasticd_job_state",
            "1 for the state each job not yet finished is in, 0 for its other states "
            "(pending, queued, running, recovering).", [j, "state"], registry=r,
        )  # fmt: skip
        self.job_submitted = Gauge(
            "elasticd_job_submitted_timestamp_seconds",
            "Unix time each job not yet finished was submitted (this run of it: a job "
            "submitted again under its name starts anew).", [j], registry=r,
        )  # fmt: skip

        # -- job gauges: node rank 0 of the job's current world only -----------------------
        self.world_size = Gauge(
            "elasticd_world_size", "Nodes in the job's current world.", [j], registry=r
        )
        self.world_ranks = Gauge(
            "elasticd_world_ranks", "Worker ranks in the job's current world.", [j], registry=r
        )
        self.step = Gauge("elasticd_job_step", "Last completed optimizer step.", [j], registry=r)
        self.last_step_time = Gauge(
            "elasticd_job_last_step_timestamp_seconds",
            "Unix time the last optimizer step was seen complete.", [j], registry=r,
        )  # fmt: skip
        self.loss = Gauge("elasticd_job_loss", "Training loss at the last step.", [j], registry=r)
        self.tokens_per_second = Gauge(
            "elasticd_job_tokens_per_second", "Training throughput of the whole job.", [j],
            registry=r,
        )  # fmt: skip
        self.mfu = Gauge(
            "elasticd_job_mfu_ratio",
            "Model FLOPs utilisation at the last step (0-1), where the trainer knows its "
            "devices' peak.", [j], registry=r,
        )  # fmt: skip
        self.checkpoint_step = Gauge(
            "elasticd_checkpoint_step", "Step of the latest committed checkpoint.", [j],
            registry=r,
        )  # fmt: skip
        self.checkpoint_commit_time = Gauge(
            "elasticd_checkpoint_last_commit_timestamp_seconds",
            "Unix time the latest committed checkpoint was committed.", [j], registry=r,
        )  # fmt: skip

        # -- job events: each counted once, by the agent that saw it as node rank 0 --------
        self.step_seconds = Histogram(
            "elasticd_job_step_seconds",
            "Optimizer step time (each step rank 0 reported, as the agent saw it).", [j],
            buckets=STEP_BUCKETS, registry=r,
        )  # fmt: skip
        self.ckpt_save_seconds = Histogram(
            "elasticd_checkpoint_save_seconds",
            "From a save's start to its commit (rank 0's view; async saves overlap training).",
            [j], buckets=CKPT_BUCKETS, registry=r,
        )  # fmt: skip
        self.ckpt_saved_bytes = Counter(
            "elasticd_checkpoint_saved_bytes_total", "Bytes of committed checkpoints (all ranks).",
            [j], registry=r,
        )  # fmt: skip
        self.ckpt_load_seconds = Histogram(
            "elasticd_checkpoint_load_seconds",
            "Time to load a checkpoint from disk at a world's start (rank 0's view).", [j],
            buckets=CKPT_BUCKETS, registry=r,
        )  # fmt: skip
        self.ckpt_loaded_bytes = Counter(
            "elasticd_checkpoint_loaded_bytes_total",
            "Bytes of the checkpoints loaded at worlds' starts (the checkpoint's size).", [j],
            registry=r,
        )  # fmt: skip
        self.restarts = Counter(
            "elasticd_restarts_total",
            "World re-forms by cause (worker_failed, worker_hung, collective_failed, "
            "peer_lost, scale_up, preempted).", [j, "reason"], registry=r,
        )  # fmt: skip
        self.recoveries = Counter(
            "elasticd_recoveries_total",
            "Completed recoveries by cause, mode (inprocess, process) and state source "
            "(peers, replica, checkpoint, none).", [j, "reason", "mode", "source"], registry=r,
        )  # fmt: skip
        self.recovery_seconds = Histogram(
            "elasticd_recovery_seconds",
            "From a failure being known to the first completed step after it, by mode and "
            "state source (the cause is on elasticd_recoveries_total).",
            [j, "mode", "source"], buckets=RECOVERY_BUCKETS, registry=r,
        )  # fmt: skip
        self.last_recovery_seconds = Gauge(
            "elasticd_job_last_recovery_seconds",
            "How long the job's last recovery took.", [j], registry=r,
        )  # fmt: skip
        self.last_recovery_time = Gauge(
            "elasticd_job_last_recovery_timestamp_seconds",
            "Unix time the job's last recovery completed.", [j], registry=r,
        )  # fmt: skip
        self.lost_steps = Counter(
            "elasticd_lost_steps_total",
            "Completed optimizer steps trained again after recoveries (work lost).", [j],
            registry=r,
        )  # fmt: skip
        self.agent_start_time.set(time.time())
        self._member_checks: dict[str, Callable[[], bool]] = {}
        """Job -> whether this agent's membership of the job's world is still alive
        (its rendezvous lease; :meth:`watch_membership`)."""

    LEAD_GAUGES = (
        "world_size", "world_ranks", "step", "last_step_time", "loss", "tokens_per_second",
        "mfu", "checkpoint_step", "checkpoint_commit_time", "last_recovery_seconds",
        "last_recovery_time",
    )  # fmt: skip
    """The job gauges only node rank 0 of the current world exports."""

    def set_worker_states(self, job: str, counts: dict[str, int]) -> None:
        """Set every state's gauge, zero for states with no worker."""
        for state in WORKER_STATES:
            self.worker_states.labels(job, state).set(counts.get(state, 0))

    def init_job(self, job: str, mode: str) -> None:
        """This agent takes the job: export its counters at 0 now. Prometheus' increase()
        and rate() need a sample before the first event; a series born at 1 loses it
        (the recovery histogram too: its first recovery would never show in a quantile)."""
        for reason in RESTART_REASONS:
            self.restarts.labels(job, reason)
            for source in RECOVERY_SOURCES:
                self.recoveries.labels(job, reason, mode, source)
        for source in RECOVERY_SOURCES:  # by cause too, it was 408 series of zeros a job
            self.recovery_seconds.labels(job, mode, source)
        for kind in TROUBLE_KINDS:
            self.node_troubles.labels(job, kind)
        for metric in (self.lost_steps, self.ckpt_saved_bytes, self.ckpt_loaded_bytes,
                       self.step_seconds, self.ckpt_save_seconds, self.ckpt_load_seconds,
                       self.rendezvous_rounds, self.rendezvous_seconds):  # fmt: skip
            metric.labels(job)
        # Not in a world yet (a spare, a node rejoining after its own trouble): 0, as the
        # docs say, not absent until its first world.
        self.in_world.labels(job).set(0)

    def watch_membership(self, job: str, alive: Callable[[], bool] | None) -> None:
        """While ``alive()`` is False (this agent was frozen past its lease's TTL and has
        not noticed yet), a scrape shows none of the job's gauges of node rank 0 and
        ``elasticd_job_node_in_world`` 0: a thawed node rank 0 exported its old world's
        size and step beside the new node rank 0's, and sums doubled (an SRE review:
        world size 5 of 2). None: no check (not in a world)."""
        if alive is None:
            self._member_checks.pop(job, None)
        else:
            self._member_checks[job] = alive

    def stale_jobs(self) -> set[str]:
        """Jobs whose membership check fails now (scrape time)."""
        out = set()
        for job, alive in list(self._member_checks.items()):
            try:
                if not alive():
                    out.add(job)
            except Exception:  # a check must never break a scrape
                out.add(job)
        return out

    def drop_lead(self, job: str) -> None:
        """This agent is no longer node rank 0 of the job's world: stop exporting the job
        gauges (the new node rank 0 exports them)."""
        for name in self.LEAD_GAUGES:
            _remove(getattr(self, name), job)

    def drop_job(self, job: str) -> None:
        """The job is over: remove every series of it from this agent."""
        self._member_checks.pop(job, None)
        for metric in self._job_metrics():
            for labels in _children(metric):
                if labels and labels[0] == job:
                    _remove(metric, *labels)

    def job_names(self) -> set[str]:
        """Jobs this agent exports any series of."""
        return {labels[0] for m in self._job_metrics() for labels in _children(m) if labels}

    def _job_metrics(self) -> list:
        return [m for m in vars(self).values()
                if hasattr(m, "_labelnames") and m._labelnames[:1] == (JOB_LABEL,)]  # fmt: skip

    def serve(self, port: int, addr: str = "0.0.0.0", health: Health | None = None) -> int:
        """Start the /metrics HTTP endpoint; returns the port (``0`` picks a free one).
        A port in use is the user's to fix: one line naming ``--metrics-port``. With
        ``health``, ``/healthz`` on the same port answers the agent's liveness
        (:mod:`elasticd.agent.health`).

        The counters' and histograms' ``_created`` series are not exported (every counter
        is at 0 from its job's start, so increase() and rate() need no creation time):
        they were 65 of an agent's series per job (prometheus_client, process-wide)."""
        disable_created_metrics()
        try:
            server, _thread = start_http_server(port, addr=addr, registry=_Scrape(self))
        except OSError as exc:
            if exc.errno == errno.EADDRINUSE:
                raise UsageError(
                    f"--metrics-port: port {port} is in use (another agent or exporter on this host?); "
                    "give each agent its own --metrics-port, or 0 to turn metrics off"
                ) from None
            raise UsageError(f"--metrics-port: cannot serve on {addr}:{port}: {exc}") from None
        if health is not None:
            server.set_app(health.wsgi(server.get_app()))
        return server.server_address[1]


class _Scrape:
    """The registry as a scrape sees it: the series of jobs whose membership lapsed
    (:meth:`AgentMetrics.watch_membership`) left out, and their in-world gauge 0."""

    def __init__(self, metrics: AgentMetrics, registry: object | None = None) -> None:
        self._metrics = metrics
        self._registry = registry if registry is not None else metrics.registry

    def restricted_registry(self, names: Iterable[str]) -> _Scrape:
        return _Scrape(self._metrics, self._registry.restricted_registry(names))  # type: ignore[attr-defined]

    def collect(self):
        stale = self._metrics.stale_jobs()
        if not stale:
            yield from self._registry.collect()  # type: ignore[attr-defined]
            return
        m = self._metrics
        hidden = {getattr(m, name)._name for name in m.LEAD_GAUGES}
        zeroed = m.in_world._name
        for family in self._registry.collect():  # type: ignore[attr-defined]
            if family.name in hidden:
                family.samples = [x for x in family.samples if x.labels.get(JOB_LABEL) not in stale]
            elif family.name == zeroed:
                family.samples = [x._replace(value=0.0) if x.labels.get(JOB_LABEL) in stale else x
                                  for x in family.samples]  # fmt: skip
            yield family


def _children(metric) -> list[tuple[str, ...]]:
    with metric._lock:
        return list(metric._metrics)


def _remove(metric, *labels: str) -> None:
    with contextlib.suppress(KeyError):  # never exported here
        metric.remove(*labels)
