"""Prometheus metrics of the agent, on an injected CollectorRegistry.

Names follow Prometheus conventions: an ``elasticd_`` prefix, base units (seconds),
``_total`` for counters. Every series carries the ``job`` label (the elasticd job name,
not Prometheus' own scrape job). Worker-side numbers (step, loss, tokens/s) come through
the heartbeat channel of :mod:`elasticd.worker`, so workers need no HTTP server of their
own and no multiprocess directory.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server

WORKER_STATES = ("starting", "running", "stopping", "exited", "failed")
RESTART_REASONS = (
    "worker_failed",
    "worker_hung",
    "peer_lost",
    "scale_up",
    "preempted",
)
# Recovery on this design takes seconds; torchrun's takes tens of seconds. The buckets
# cover both so the two can be compared on one dashboard.
RECOVERY_BUCKETS = (0.5, 1, 2, 3, 5, 7.5, 10, 15, 20, 30, 45, 60, 90, 120, 300)


class AgentMetrics:
    """Every series the agent exports."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.registry = registry
        r = registry
        self.world_size = Gauge(
            "elasticd_world_size", "Nodes in the job's current world.", ["job"], registry=r
        )
        self.world_ranks = Gauge(
            "elasticd_world_ranks", "Worker ranks in the job's current world.", ["job"], registry=r
        )
        self.nodes_alive = Gauge(
            "elasticd_nodes_alive", "Agents registered in etcd (leases alive).", registry=r
        )
        self.rendezvous_rounds = Counter(
            "elasticd_rendezvous_rounds_total", "Rendezvous rounds this agent joined.", ["job"],
            registry=r,
        )  # fmt: skip
        self.rendezvous_seconds = Histogram(
            "elasticd_rendezvous_seconds", "Time from joining a round to its world being known.",
            ["job"], buckets=(0.1, 0.25, 0.5, 1, 2, 3, 5, 10, 30, 60, 300), registry=r,
        )  # fmt: skip
        self.restarts = Counter(
            "elasticd_restarts_total", "Worker restarts by reason.", ["job", "reason"], registry=r
        )
        self.recovery_seconds = Histogram(
            "elasticd_recovery_seconds",
            "From a failure being known to the first completed step after it; mode is "
            "inprocess or process, source where the state came from (peers, replica, "
            "checkpoint, none).",
            ["job", "reason", "mode", "source"], buckets=RECOVERY_BUCKETS, registry=r,
        )  # fmt: skip
        self.lost_steps = Counter(
            "elasticd_lost_steps_total",
            "Completed optimizer steps trained again after recoveries (work lost).", ["job"],
            registry=r,
        )  # fmt: skip
        self.worker_states = Gauge(
            "elasticd_workers", "Local worker processes by state.", ["job", "state"], registry=r
        )
        self.step = Gauge(
            "elasticd_job_step", "Last completed optimizer step.", ["job"], registry=r
        )
        self.loss = Gauge(
            "elasticd_job_loss", "Training loss at the last step.", ["job"], registry=r
        )
        self.tokens_per_second = Gauge(
            "elasticd_job_tokens_per_second", "Training throughput at the last step.", ["job"],
            registry=r,
        )  # fmt: skip
        self.checkpoint_step = Gauge(
            "elasticd_checkpoint_step", "Step of the latest committed checkpoint.", ["job"],
            registry=r,
        )  # fmt: skip
        self.heartbeat_age = Gauge(
            "elasticd_worker_heartbeat_age_seconds",
            "Seconds since the stalest local worker last reported progress.", ["job"], registry=r,
        )  # fmt: skip

    def set_worker_states(self, job: str, counts: dict[str, int]) -> None:
        """Set every state's gauge, zero for states with no worker."""
        for state in WORKER_STATES:
            self.worker_states.labels(job=job, state=state).set(counts.get(state, 0))

    def serve(self, port: int, addr: str = "0.0.0.0") -> int:
        """Start the /metrics HTTP endpoint; returns the port (``0`` picks a free one)."""
        server, _thread = start_http_server(port, addr=addr, registry=self.registry)
        return server.server_address[1]
