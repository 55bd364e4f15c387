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
import signal
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from elasticd.jobs import JobState
from elasticd.worker import USER_ERROR_EXIT_CODE  # noqa: F401 (the agent's name for it)


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
    """Another node is being preempted and every rank saved the step: our workers stopped
    with the preemption code, or (restart.mode inprocess) left the round with their state
    to take the next one (their heartbeats say ``peer_preempted``)."""
    WORKER_FAILED = "worker_failed"
    """A local worker exited non-zero."""
    WORKER_HUNG = "worker_hung"
    """A local worker reported no progress for restart.hang_timeout."""
    SCALE_UP = "scale_up"
    """A node waits to join and the scale-up policy says now."""
    USER_ERROR = "user_error"
    """A local worker exited with the user-error code (2): the job fails at once, no
    restart spent (a config error fails the same way every time)."""
    FENCED = "fenced"
    """Our round is no longer current (we froze and the world moved on): stop our stale
    workers and join again as a new member."""
    COLLECTIVE_FAILED = "collective_failed"
    """restart.mode inprocess: a local worker's collective failed (a peer died or froze);
    evidence enough to re-form at once, before any lease expires."""

    @property
    def counts_as_failure(self) -> bool:
        """Whether it uses up one of restart.max_restarts."""
        return self in (Outcome.WORKER_FAILED, Outcome.WORKER_HUNG, Outcome.COLLECTIVE_FAILED)

    @property
    def is_evidence(self) -> bool:
        """Whether this node saw the fault itself (the re-form may skip silent members)."""
        return self in (Outcome.WORKER_FAILED, Outcome.WORKER_HUNG, Outcome.COLLECTIVE_FAILED)

    @property
    def keeps_workers(self) -> bool:
        """restart.mode inprocess: whether the live workers go on into the next round."""
        return self in (
            Outcome.PEER_LOST, Outcome.WORKER_FAILED, Outcome.WORKER_HUNG, Outcome.SCALE_UP,
            Outcome.COLLECTIVE_FAILED, Outcome.PEER_PREEMPTED,
        )  # fmt: skip

    @property
    def reforms(self) -> bool:
        """Whether the agent goes on to the next round afterwards."""
        return self in (
            Outcome.PEER_LOST,
            Outcome.PEER_PREEMPTED,
            Outcome.WORKER_FAILED,
            Outcome.WORKER_HUNG,
            Outcome.SCALE_UP,
            Outcome.FENCED,
            Outcome.COLLECTIVE_FAILED,
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
    user_error_code: int = 2
    """The exit code of a worker that met a user error (bad config, unloadable checkpoint)."""
    first_world: bool = False
    """The round is the job's first world: nothing trained yet anywhere."""
    fenced: bool = False
    """A write on behalf of our round was refused: a newer world exists."""
    stalest_heartbeat: float | None = None
    """Age in seconds of the heartbeat of the live worker nearest to being hung (the
    oldest, a waiting one's counted against its longer bound; None: none yet)."""
    stalest_waiting: bool = False
    """That worker said it waits on its peers in a collective (in-process restart)."""
    hang_timeout: float = 300.0
    """restart.hang_timeout."""
    scale_up_policy: str = "checkpoint"
    """restart.scale_up: immediate | checkpoint."""
    checkpoint_at_waiting: int | None = None
    """Latest committed checkpoint step when the waiting node was first seen."""
    checkpoint_now: int | None = None
    """Latest committed checkpoint step now."""
    faulted: bool = False
    """A local in-process worker reported a failed collective in this round."""
    peer_preempted: bool = False
    """Every live local in-process worker left this round for another node's preemption,
    after the step's save (``WorkerChannel.peer_preempted``)."""
    not_begun: bool = False
    """A local worker carried into this in-process round has not taken it within the
    runner's ROUND_BEGIN_TIMEOUT (it is stuck in the round before), or the round's local
    workers completed no step within ``restart.startup_timeout`` of their start."""


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
    if obs.fenced:
        return Outcome.FENCED
    if obs.lost:
        if any(c is not None and c < 0 and -c not in SYMPTOM_SIGNALS for c in codes):
            # A local worker killed by a signal is a cause of its own, seen here; the
            # peer "lost" may only be moving on to the next round because of it (its
            # collective failed on our dead worker's sockets first: an SRE review saw the
            # kill recorded as the peer's collective failure, and ours as peer_lost).
            return Outcome.WORKER_FAILED
        return Outcome.PEER_LOST
    if any(c == obs.user_error_code for c in codes):
        return Outcome.USER_ERROR
    if obs.first_world and any(c in CANNOT_RUN_EXIT_CODES for c in codes):
        return Outcome.USER_ERROR
    failed = [c for c in codes if c is not None and c not in (0, obs.preempted_code)]
    if failed:
        return Outcome.WORKER_FAILED
    if obs.faulted:
        return Outcome.COLLECTIVE_FAILED
    if obs.peer_preempted or any(c == obs.preempted_code for c in codes):
        return Outcome.PEER_PREEMPTED
    if obs.stalest_heartbeat is not None and obs.stalest_heartbeat > hang_bound(
        obs.hang_timeout, waiting=obs.stalest_waiting
    ):
        return Outcome.WORKER_HUNG
    if obs.not_begun:
        return Outcome.WORKER_HUNG
    if obs.waiting:
        if obs.scale_up_policy == "immediate":
            return Outcome.SCALE_UP
        before, now = obs.checkpoint_at_waiting, obs.checkpoint_now
        if now is not None and (before is None or now > before):
            return Outcome.SCALE_UP
    return None


SYMPTOM_SIGNALS = frozenset({signal.SIGABRT, signal.SIGPIPE})
"""Signals a worker can die of *because* a peer went away (NCCL's watchdog aborts the
process on a failed collective; a write to a closed socket), which therefore do not make
its death a cause of its own when a peer is lost too."""


PEER_FAULT_MARKS = ("Connection closed by peer", "Connection reset by peer", "Broken pipe",
                    "Connection was likely closed")  # fmt: skip
"""What a worker's error says when its collective failed because a peer went away (gloo's
words for a connection its peer closed or reset; the TCP store client's for a store, on
a peer node, that shut while the round's group was set up)."""


def failed_on_a_peer(outcome: Outcome, detail: str) -> bool:
    """Whether a round's end, as this agent saw it (``outcome`` and its ``detail``, one
    ``rank N: ...`` part per failed worker), is only its workers' collectives failing on a
    peer: every part names a connection a peer closed, and none a signal (a worker killed
    here is a cause of its own). Such a claim yields the history's cause to the agent that
    saw the cause itself (``JobRegistry.note_cause``)."""
    if outcome not in (Outcome.WORKER_FAILED, Outcome.COLLECTIVE_FAILED):
        return False
    parts = [p for p in detail.split("; ") if p.strip()]
    return bool(parts) and all(
        ": signal " not in p and any(m in p for m in PEER_FAULT_MARKS) for p in parts
    )


WAITING_PATIENCE = 2.0
"""How many restart.hang_timeouts a worker that waits on its peers in a collective of its
round (in-process restart: its heartbeat says ``waiting``) may go without progress before
it counts as hung. The peer that really hangs (stopped, stuck outside a collective) is
killed at one hang_timeout; its closed sockets fail the waiting ranks' collectives at once,
and they recover in-process with their state. Were they killed with it, the state they
held would be gone (a chaos soak lost 16 steps so). A world where every rank waits (a
deadlock) still ends, at twice the bound. The mark is written only where the in-process
waits run in slices, on gloo groups; on NCCL a waiting rank blocks in a device
synchronisation and is not marked, so there both are killed, as before."""


WAITING_FRESH = 5.0
"""Seconds a worker's ``waiting`` mark counts after it was last refreshed (the worker
refreshes it every second while it waits): a process stopped while it waited keeps a mark
that goes stale, and is judged by the plain bound."""


def hang_bound(hang_timeout: float, *, waiting: bool) -> float:
    """Seconds without progress after which a worker counts as hung."""
    return hang_timeout * (WAITING_PATIENCE if waiting else 1.0)


CANNOT_RUN_EXIT_CODES = (126, 127)
"""A worker's command could not be executed (``elasticd.agent.pdeathsig``: 127 not found,
126 not executable, as a shell says). In the job's first world it is the user's error (a
misspelt or missing executable: no retry mends it, and it was retried
``restart.max_restarts`` times over a minute); later it is that node's trouble, a counted
crash (a replacement built from a bad image, a shared filesystem not yet mounted there),
and the world goes on without it."""
PEER_LOST_GRACE = 1.0
"""Grace after SIGTERM when the world is already broken: no save can succeed, so be quick."""
CANCEL_GRACE = 3.0
"""Grace after SIGTERM on cancel."""
FINISH_WAIT = 120.0
"""How long workers may take to exit after the job succeeded elsewhere, and how long a
worker whose training function returned (its heartbeat's ``finished`` mark) may take to
tear down and exit before it counts as hung (restart.hang_timeout does not apply to it)."""


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
    if outcome in (Outcome.WORKER_HUNG, Outcome.FENCED):
        # A fenced round's workers belong to a world that no longer exists: nothing they
        # could save would be accepted.
        return StopPlan(kill=True)
    if outcome == Outcome.USER_ERROR:
        return StopPlan(grace=CANCEL_GRACE)
    return StopPlan(grace=PEER_LOST_GRACE)


CRASH_LOOP_CAP = 10.0
"""The longest pause of a node's crash loop (failures with no step of its workers between)."""
ALONE_CRASH_LOOP_CAP = 300.0
"""The same, when the job trained on elsewhere between the node's last two failures: the
node alone is broken (a bad GPU, a bad image) while the others carry the job. Each of its
re-joins stalls the world for a re-form (at once under ``restart.scale_up: immediate``,
the in-process default), and at the crash loop's 10 s that was a stall about every ten
seconds for as long as the node stayed broken; now one every five minutes once the pause
has doubled that far, and a node that mends is back within them."""


def crash_loop_pause(failures: int, *, trained_elsewhere: bool) -> float:
    """Seconds a node waits before re-joining after its ``failures``-th failure in a row
    (0 for the first: a failure after training resumed re-forms at once); longer when
    the job trained on without the node meanwhile (:data:`ALONE_CRASH_LOOP_CAP`)."""
    cap = ALONE_CRASH_LOOP_CAP if trained_elsewhere else CRASH_LOOP_CAP
    return backoff(failures - 1, cap=cap)


def backoff(failures: int, *, base: float = 0.5, cap: float = 10.0) -> float:
    """Seconds to wait before re-joining after the ``failures``-th failure: doubling from
    ``base``, at most ``cap``. Zero before any failure."""
    if failures <= 0:
        return 0.0
    return min(cap, base * 2 ** (failures - 1))


def note_furthest_step(status: dict, step: object, round_: int | None = None) -> None:
    """Raise the job status's ``furthest_step`` (the highest step any round completed) to
    ``step`` if it is further. Steps trained again after a resume from a checkpoint do not
    move it. ``round_``: the round that completed it, when known. A round that already
    ended in a counted failure completed its steps before that failure, so they also
    raise the failure's mark (``streak_step``): a status write that lagged behind the
    count is not progress after it."""
    if not isinstance(step, int) or isinstance(step, bool):
        return
    status["furthest_step"] = max(step, _int_or(status.get("furthest_step"), -1))
    if round_ is not None and round_ <= _int_or(status.get("streak_round"), -1):
        status["streak_step"] = max(step, _int_or(status.get("streak_step"), -1))


def count_failure(status: dict, step: object = None, round_: int | None = None) -> None:
    """Count one failure that uses up a restart into the job ``status``: ``restarts``
    counts every one, for the record; ``restart_streak`` the failures in a row that
    ``restart.max_restarts`` bounds. ``step``: the furthest step the counting agent saw
    its own workers complete (the status's may lag by a write); ``round_``: the round
    whose end is counted.

    A streak is failures without progress between them: it starts over (at 1) when the
    job has trained past ``streak_step``, the furthest step it had reached at the
    previous failure. So a job that trains on between faults never runs out of restarts
    however long it runs (a worker lost to a GPU error every few hours, for weeks), while
    one that fails again and again before getting further (a crash at the same step on
    every resume, a worker that dies before its first step) fails after
    ``max_restarts + 1`` failures."""
    note_furthest_step(status, step)
    furthest = _int_or(status.get("furthest_step"), -1)
    mark = status.get("streak_step")
    streak = _int_or(status.get("restart_streak"), 0)
    progressed = mark is None or furthest > _int_or(mark, -1)
    status["restart_streak"] = 1 if progressed else streak + 1
    status["streak_step"] = furthest
    if round_ is not None:
        status["streak_round"] = max(round_, _int_or(status.get("streak_round"), -1))
    status["restarts"] = _int_or(status.get("restarts"), 0) + 1


def uncount_failure(status: dict) -> None:
    """Take back one counted failure (its round turned out to have lost a node, which uses
    up no restart)."""
    status["restarts"] = max(0, _int_or(status.get("restarts"), 0) - 1)
    status["restart_streak"] = max(0, _int_or(status.get("restart_streak"), 0) - 1)


def restart_limit_reached(status: Mapping[str, object], max_restarts: int) -> str | None:
    """Why the job is past ``restart.max_restarts`` (failures in a row, see
    :func:`count_failure`), or None."""
    streak = _int_or(status.get("restart_streak"), 0)
    if streak <= max_restarts:
        return None
    furthest = status.get("furthest_step")
    where = (f"without training past step {furthest}" if isinstance(furthest, int)
             else "before any step")  # fmt: skip
    return (
        f"restart limit reached ({max_restarts}): {streak} failures in a row {where}; "
        f"last: {status.get('last_failure')}"
    )


def pending_limit_verdict(status: Mapping[str, object]) -> str | None:
    """The restart limit reached at a counted failure (``limit_reached``, decided by the
    next world's node rank 0): why the job fails, or None when it goes on. It goes on
    when a lost node's failure was since uncounted (the streak back within the limit),
    or when the job has trained past the failure's mark since (a decision left pending
    by an error, met again a world later: the streak is over)."""
    pending = status.get("limit_reached")
    if not isinstance(pending, Mapping):
        return None
    limit = pending.get("max_restarts")
    if not isinstance(limit, int) or isinstance(limit, bool):
        return None
    furthest = _int_or(status.get("furthest_step"), -1)
    if furthest > _int_or(status.get("streak_step"), -1):
        return None
    return restart_limit_reached(status, limit)


def _int_or(value: object, default: int) -> int:
    return value if isinstance(value, int) and not isinstance(value, bool) else default


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
    """More variables (inherited environment; secrets are scrubbed, see SECRET_ENV)."""
    devices: Sequence[str] | None = None
    """The device ids this job holds on this node (CUDA_VISIBLE_DEVICES); None: no
    accounting (a CPU node offering no fixed slots)."""


def worker_envs(inputs: WorkerEnvInputs) -> list[dict[str, str]]:
    """One environment per local rank: torchrun's variables plus ``ELASTICD_*``."""
    i = inputs
    world = i.nodes * i.nproc
    envs = []
    base = scrub_env(i.extra)
    for local in range(i.nproc):
        rank = i.node_rank * i.nproc + local
        env = dict(base)
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
        if i.devices is not None:
            # Only this job's devices: local rank k uses cuda:k, which is its k-th slot.
            env["CUDA_VISIBLE_DEVICES"] = ",".join(i.devices)
        env.setdefault("OMP_NUM_THREADS", "1")
        envs.append(env)
    return envs


SECRET_ENV = frozenset(
    {
        "ELASTICD_ETCD_PASSWORD",
        "ELASTICD_ETCD_PASSWORD_FILE",
        "ELASTICD_ETCD_USER",
        "ELASTICD_ETCD_KEY",
        "ELASTICD_ETCD_CERT",
        "ELASTICD_ETCD_CACERT",
        "ETCDCTL_PASSWORD",
        "ETCDCTL_USER",
        "ETCDCTL_KEY",
        "ETCDCTL_CERT",
        "ETCDCTL_CACERT",
        "ETCDCTL_ENDPOINTS",
        "ELASTICD_ETCD",
    }
)
"""Variables the agent's environment may hold that workers must not see: etcd's
credentials and TLS material, and its endpoints (workers never talk to etcd; a job's own
code reaching the control plane is how a job takes over a cluster)."""


def scrub_env(env: Mapping[str, str]) -> dict[str, str]:
    """``env`` without SECRET_ENV and the inherited torchrun/elasticd per-round variables."""
    return {k: v for k, v in env.items() if k not in SECRET_ENV}


# -- placement: slots, commands, the queue ------------------------------------------------------


def visible_ids(visible: str) -> list[str]:
    """The entries of a CUDA_VISIBLE_DEVICES value (empty: no device is visible)."""
    return [d.strip() for d in visible.split(",") if d.strip()]


def device_ids(slots: int, visible: str | None) -> list[str]:
    """The device id of each slot: the agent's own CUDA_VISIBLE_DEVICES entries when set
    (a container, a cgroup or Slurm's --gpus-per-node gave it those; the agent then
    counts only those, not the driver's), else 0..slots-1."""
    if visible:
        ids = visible_ids(visible)
        if len(ids) >= slots:
            return ids[:slots]
    return [str(i) for i in range(slots)]


def take_slots(free: Sequence[int], need: int) -> list[int] | None:
    """The lowest ``need`` free slots, or None if fewer are free."""
    ordered = sorted(free)
    return ordered[:need] if len(ordered) >= need else None


def command_allowed(command: Sequence[str] | None, allow: str | Sequence[str]) -> bool:
    """Whether an agent with ``allow`` runs a job's ``command``: the built-in trainer
    (None) always; any command with ``"all"``; else argv[0] must be in the allow-list
    (by name or by path)."""
    if not command:
        return True
    if allow == "all":
        return True
    if isinstance(allow, str):
        return False
    exe = command[0]
    return exe in allow or os.path.basename(exe) in allow


def room_for(node: Mapping[str, object], *, job: str, nproc: int, command) -> bool:
    """Whether a node record says the node can host ``job``: it holds it already, or it
    runs its command and has ``nproc`` free slots (no slot accounting: any nproc)."""
    if job in (node.get("jobs") or ()):
        return True
    allow = node.get("allow_commands", "all")
    if not command_allowed(command, allow if isinstance(allow, str | list) else "none"):
        return False
    free = node.get("free")
    return free is None or int(free) >= nproc


def queue_reason(
    *, job: str, nproc: int, min_nodes: int, command, nodes: Mapping[str, Mapping[str, object]]
) -> str | None:
    """Why a job that has not started cannot start now (None: it can).

    ``nodes`` are the registered agents' records (with ``free`` slots, the ``jobs`` they
    hold and what commands they run)."""
    if not nodes:
        return "queued: no agent is registered (start one with `elasticd agent`)"
    fits = sum(1 for n in nodes.values() if room_for(n, job=job, nproc=nproc, command=command))
    if fits >= min_nodes:
        return None
    runs = sum(
        1
        for n in nodes.values()
        if command_allowed(command, _allow(n)) or job in (n.get("jobs") or ())
    )
    if command and runs == 0:
        return (
            f"refused: no agent runs custom commands ({command[0]}); start agents with "
            "--allow-commands, or use the built-in trainer"
        )
    slots = "slot" if nproc == 1 else "slots"
    return (
        f"queued: needs {min_nodes} node{'s' if min_nodes != 1 else ''} with {nproc} free "
        f"{slots}, {fits} of {len(nodes)} registered have room"
    )


def _allow(node: Mapping[str, object]) -> str | Sequence[str]:
    allow = node.get("allow_commands", "all")
    return allow if isinstance(allow, str | list) else "none"


BARE_PYTHON = frozenset({"python", "python3"})
"""A command's first word meaning the agent's own interpreter (:func:`worker_argv`)."""


def worker_argv(command: Sequence[str] | None, job_path: str, python: str) -> list[str]:
    """The built-in trainer on the job file, or the job's own command as given, except a
    bare ``python`` or ``python3`` first word: the interpreter the agent runs under
    (``python``), as torchrun runs a script with its own. Looked up on the agent's PATH
    it could be another one, without torch (a job of examples/ then crashed on import on
    every node). A path (``/opt/venv/bin/python``) is used as given."""
    if command:
        argv = list(command)
        if argv[0] in BARE_PYTHON:
            argv[0] = python
        return argv
    return [python, "-m", "trainer", job_path]


_STEP_DIR = re.compile(r"step-([0-9]{9})")
"""A step directory's name, matched whole (``fullmatch``) in ASCII digits, as the store's."""


def latest_checkpoint_step(ckpt_dir: str) -> int | None:
    """Step of the latest committed checkpoint in ``ckpt_dir``, or None.

    Reads the ``latest`` pointer (a file naming ``step-NNNNNNNNN``, or a link to it); a
    directory without one falls back to the highest ``step-*`` holding a manifest. This
    reads names only, so the agent need not import the checkpoint library.
    """
    latest = os.path.join(ckpt_dir, "latest")
    name = None
    try:
        if os.path.islink(latest):
            name = os.path.basename(os.readlink(latest).rstrip("/"))
        elif os.path.isfile(latest):
            with open(latest, "rb") as fh:  # a hint of one line: its first bytes only
                text = fh.read(256).decode("utf-8")
            name = os.path.basename(text.strip().rstrip("/"))
    except (OSError, ValueError):  # unreadable, or not UTF-8: no hint
        name = None
    if name:
        m = _STEP_DIR.fullmatch(name)
        if m:
            return int(m.group(1))
    try:
        names = os.listdir(ckpt_dir)
    except OSError:
        return None
    steps = [
        int(m.group(1))
        for n in names
        if (m := _STEP_DIR.fullmatch(n))
        and os.path.exists(os.path.join(ckpt_dir, n, "manifest.json"))
    ]
    return max(steps) if steps else None
