"""The agent's pure decisions: what a round's observations mean, how long to back off,
and what environment a worker gets. No processes or etcd here.

The monitor loop gathers an :class:`Observation` every tick and asks :func:`decide` what
to do; the answer is an :class:`Outcome` (keep going is ``None``). The order of the
checks is the priority: our own preemption beats everything, a cancel beats a failure,
a lost peer beats a local crash (the crash is usually its consequence), and a scale-up is
considered only while everything is healthy.
"""

from __future__ import annotations

import enum
import os
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from elasticd.jobs import JobState


class Outcome(enum.StrEnum):
    PREEMPTED = "preempted"
    """This agent was told to stop (SIGTERM): emergency checkpoint, then leave."""
    CANCELLED = "cancelled"
    """The job was cancelled or failed elsewhere: stop the workers, leave."""
    FINISHED = "finished"
    """The job ended elsewhere (succeeded; the run is closed): let workers finish, leave."""
    SUCCEEDED = "succeeded"
    """Every local worker exited 0."""
    PEER_LOST = "peer_lost"
    """A member of our world vanished or re-joined: re-form at once."""
    PEER_PREEMPTED = "peer_preempted"
    """Our workers stopped with the preemption code (another node is being preempted)."""
    WORKER_FAILED = "worker_failed"
    """A local worker exited non-zero."""
    WORKER_HUNG = "worker_hung"
    """A local worker reported no progress for restart.hang_timeout."""
    SCALE_UP = "scale_up"
    """A node waits to join and the scale-up policy says now."""

    @property
    def counts_as_failure(self) -> bool:
        """Whether it uses up one of restart.max_restarts."""
        return self in (Outcome.WORKER_FAILED, Outcome.WORKER_HUNG)

    @property
    def reforms(self) -> bool:
        """Whether the agent goes on to the next round afterwards."""
        return self in (
            Outcome.PEER_LOST,
            Outcome.PEER_PREEMPTED,
            Outcome.WORKER_FAILED,
            Outcome.WORKER_HUNG,
            Outcome.SCALE_UP,
        )


@dataclass(frozen=True, kw_only=True, slots=True)
class Observation:
    """What the monitor loop saw in one tick."""

    preempting: bool = False
    """The agent got SIGTERM."""
    job_state: JobState = JobState.RUNNING
    """The job's state in etcd."""
    run_closed: bool = False
    """The rendezvous run was closed (the job ended)."""
    lost: tuple[str, ...] = ()
    """Members of our world that are gone (or our own lease)."""
    waiting: tuple[str, ...] = ()
    """Nodes outside our world waiting to join."""
    exit_codes: tuple[int | None, ...] = ()
    """Local workers' exit codes, None while running."""
    preempted_code: int = 75
    """The exit code of a worker that stopped for a preemption."""
    stalest_heartbeat: float | None = None
    """Age in seconds of the oldest heartbeat among live workers (None: none yet)."""
    hang_timeout: float = 300.0
    """restart.hang_timeout."""
    scale_up_policy: str = "checkpoint"
    """restart.scale_up: immediate | checkpoint."""
    checkpoint_at_waiting: int | None = None
    """Latest committed checkpoint step when the waiting node was first seen."""
    checkpoint_now: int | None = None
    """Latest committed checkpoint step now."""


def decide(obs: Observation) -> Outcome | None:
    """The outcome of a tick, or None to keep supervising."""
    if obs.preempting:
        return Outcome.PREEMPTED
    if obs.job_state in (JobState.CANCELLED, JobState.FAILED):
        return Outcome.CANCELLED
    codes = obs.exit_codes
    done = bool(codes) and all(c is not None for c in codes)
    if done and all(c == 0 for c in codes):
        return Outcome.SUCCEEDED
    if obs.job_state == JobState.SUCCEEDED or obs.run_closed:
        return Outcome.FINISHED
    if obs.lost:
        return Outcome.PEER_LOST
    failed = [c for c in codes if c is not None and c not in (0, obs.preempted_code)]
    if failed:
        return Outcome.WORKER_FAILED
    if any(c == obs.preempted_code for c in codes):
        return Outcome.PEER_PREEMPTED
    if obs.stalest_heartbeat is not None and obs.stalest_heartbeat > obs.hang_timeout:
        return Outcome.WORKER_HUNG
    if obs.waiting:
        if obs.scale_up_policy == "immediate":
            return Outcome.SCALE_UP
        before, now = obs.checkpoint_at_waiting, obs.checkpoint_now
        if now is not None and (before is None or now > before):
            return Outcome.SCALE_UP
    return None


PEER_LOST_GRACE = 1.0
"""Grace after SIGTERM when the world is already broken: no save can succeed, so be quick."""
CANCEL_GRACE = 3.0
"""Grace after SIGTERM on cancel."""
FINISH_WAIT = 120.0
"""How long workers may take to exit after the job succeeded elsewhere."""


@dataclass(frozen=True, kw_only=True, slots=True)
class StopPlan:
    """How to end a round's workers."""

    wait_first: float = 0.0
    """Seconds to let them exit on their own before signalling."""
    grace: float = 0.0
    """Seconds between SIGTERM and SIGKILL; 0 with ``kill`` means SIGKILL at once."""
    kill: bool = False
    """SIGKILL straight away."""


def stop_plan(outcome: Outcome, grace_period: float) -> StopPlan:
    """SIGTERM means "save now" to a worker (elasticd.worker), so it gets the full
    restart.grace_period only where a save can succeed: our preemption, a scale-up (all
    peers alive), or workers already exiting. A broken world gets a short grace; a hung
    worker (possibly SIGSTOPped, which ignores SIGTERM) gets SIGKILL."""
    if outcome in (Outcome.SUCCEEDED, Outcome.PEER_PREEMPTED, Outcome.PREEMPTED, Outcome.SCALE_UP):
        return StopPlan(grace=grace_period)
    if outcome == Outcome.FINISHED:
        return StopPlan(wait_first=FINISH_WAIT, grace=CANCEL_GRACE)
    if outcome == Outcome.CANCELLED:
        return StopPlan(grace=CANCEL_GRACE)
    if outcome == Outcome.WORKER_HUNG:
        return StopPlan(kill=True)
    return StopPlan(grace=PEER_LOST_GRACE)


def backoff(failures: int, *, base: float = 0.5, cap: float = 10.0) -> float:
    """Seconds to wait before re-joining after the ``failures``-th failure: doubling from
    ``base``, at most ``cap``. Zero before any failure."""
    if failures <= 0:
        return 0.0
    return min(cap, base * 2 ** (failures - 1))


@dataclass(frozen=True, kw_only=True, slots=True)
class WorkerEnvInputs:
    """Everything the worker environment is built from."""

    job: str
    """Job name."""
    run_id: str
    """Rendezvous run id (TORCHELASTIC_RUN_ID)."""
    round: int
    """Rendezvous round."""
    node_rank: int
    """This node's rank in the world."""
    nodes: int
    """Nodes in the world."""
    nproc: int
    """Workers per node."""
    master_addr: str
    """Node rank 0's address."""
    master_port: int
    """The port rank 0's TCPStore listens on."""
    restart_count: int
    """Restarts so far (TORCHELASTIC_RESTART_COUNT)."""
    max_restarts: int
    """restart.max_restarts."""
    layout_path: str
    """The layout JSON file."""
    job_path: str
    """The job spec file."""
    extra: Mapping[str, str] = field(default_factory=dict)
    """More variables (inherited environment)."""


def worker_envs(inputs: WorkerEnvInputs) -> list[dict[str, str]]:
    """One environment per local rank: torchrun's variables plus ``ELASTICD_*``."""
    i = inputs
    world = i.nodes * i.nproc
    envs = []
    for local in range(i.nproc):
        rank = i.node_rank * i.nproc + local
        env = dict(i.extra)
        env.update(
            {
                "RANK": str(rank),
                "LOCAL_RANK": str(local),
                "WORLD_SIZE": str(world),
                "LOCAL_WORLD_SIZE": str(i.nproc),
                "GROUP_RANK": str(i.node_rank),
                "GROUP_WORLD_SIZE": str(i.nodes),
                "ROLE_RANK": str(rank),
                "ROLE_WORLD_SIZE": str(world),
                "ROLE_NAME": "default",
                "MASTER_ADDR": i.master_addr,
                "MASTER_PORT": str(i.master_port),
                "TORCHELASTIC_RESTART_COUNT": str(i.restart_count),
                "TORCHELASTIC_MAX_RESTARTS": str(i.max_restarts),
                "TORCHELASTIC_RUN_ID": i.run_id,
                "ELASTICD_JOB": i.job,
                "ELASTICD_ROUND": str(i.round),
                "ELASTICD_LAYOUT": i.layout_path,
                "ELASTICD_JOB_FILE": i.job_path,
                "ELASTICD_NODE_RANK": str(i.node_rank),
            }
        )
        env.setdefault("OMP_NUM_THREADS", "1")
        envs.append(env)
    return envs


def worker_argv(command: Sequence[str] | None, job_path: str, python: str) -> list[str]:
    """The built-in trainer on the job file, or the job's own command as given."""
    if command:
        return list(command)
    return [python, "-m", "trainer", job_path]


_STEP_DIR = re.compile(r"^step-(\d{9})$")


def latest_checkpoint_step(ckpt_dir: str) -> int | None:
    """Step of the latest committed checkpoint in ``ckpt_dir``, or None.

    Reads the ``latest`` pointer (a file naming ``step-NNNNNNNNN``, or a link to it); a
    directory without one falls back to the highest ``step-*`` holding a manifest. This
    reads names only, so the agent need not import the checkpoint library (and torch).
    """
    latest = os.path.join(ckpt_dir, "latest")
    name = None
    try:
        if os.path.islink(latest):
            name = os.path.basename(os.readlink(latest).rstrip("/"))
        elif os.path.isfile(latest):
            with open(latest, encoding="utf-8") as fh:
                name = os.path.basename(fh.read().strip().rstrip("/"))
    except OSError:
        name = None
    if name:
        m = _STEP_DIR.match(name)
        if m:
            return int(m.group(1))
    try:
        names = os.listdir(ckpt_dir)
    except OSError:
        return None
    steps = [
        int(m.group(1))
        for n in names
        if (m := _STEP_DIR.match(n)) and os.path.exists(os.path.join(ckpt_dir, n, "manifest.json"))
    ]
    return max(steps) if steps else None
