"""Starting one round's workers on this node: layout and job files, environment, spawn.

The files a round leaves in ``<state-dir>/jobs/<run_id>/round-<r>/``: ``layout.json`` (the
plan, read by the workers through ELASTICD_LAYOUT), ``job.json`` (the spec; JSON is YAML,
so the trainer reads it as its job file), ``workers.json`` (global rank → pid), and the
workers' heartbeat and error files. ``<state-dir>/workers.json`` names the current round's
pids for tools (``elasticd run``'s fault injection).
"""

from __future__ import annotations

import contextlib
import itertools
import json
import os
import secrets
import shutil
import stat
import sys
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from elasticd.agent.forkserver import ForkServer, is_pending
from elasticd.agent.policy import WorkerEnvInputs, scrub_env, worker_argv, worker_envs
from elasticd.agent.workers import WorkerGroup
from elasticd.inprocess import (
    ENV_CONTROL,
    ENV_MODE,
    ENV_WARM,
    ENV_WARM_READY,
    STANDBY_LOCAL_RANK,
)
from elasticd.jobspec import JobSpec
from elasticd.layout import Layout, plan


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
    incarnation: str = ""
    """A token drawn at the agent's start: its rendezvous joins carry it, so a node
    restarted under the same id is told from one that stayed (``Member.incarnation``)."""


@dataclass(kw_only=True, slots=True)
class Round:
    """Book-keeping of the round being supervised."""

    number: int
    """Rendezvous round."""
    node_rank: int
    """Our rank in its world."""
    nodes: tuple[str, ...]
    """The world's nodes in rank order."""
    workers: WorkerGroup
    """Our workers."""
    layout: Layout
    """The plan for the world."""
    formed_at: float
    """When the world closed."""
    spawned_at: float
    """When our workers were started."""
    resume_step: int | None
    """Latest committed checkpoint at spawn (where the workers resume)."""
    recovery: dict[str, Any] | None = None
    """The failure this round recovers from: reason, detected_at, stopped_at."""
    first_step_seen: bool = False
    """Whether rank 0 completed a step in this round yet."""
    carried: int = 0
    """Workers that went on from the previous round in their process (in-process)."""
    stuck: list = field(default_factory=list)
    """Carried workers judged stuck in the round before (never took this one): the ones a
    hung outcome kills, the others are kept."""
    unstarted: list = field(default_factory=list)
    """Workers with no step completed past ``restart.startup_timeout`` from their start:
    a hung outcome then stops every worker of ours (a process restart)."""


def write_json(path: str, obj: Any) -> None:
    """Write ``obj`` as JSON atomically (a reader never sees half a file)."""
    _replace_file(path, json.dumps(obj, separators=(",", ":")).encode())


MAX_SMALL_FILE_BYTES = 1 << 20
"""The largest fence or control file read (the same cap as ``checkpoint.smallfile``)."""

_CREATE_FLAGS = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC


def _replace_file(path: str, data: bytes, *, tag: str = "", fsync: bool = False) -> None:
    """Replace ``path`` with ``data`` through a new temporary file next to it, created under
    an unpredictable name with ``O_EXCL | O_NOFOLLOW`` (a symlink planted at a predictable
    name is never written through); removed again if anything fails. ``tag`` goes into the
    name; ``fsync`` syncs the file and then the directory. The same rules as
    ``checkpoint.smallfile.write_atomic``: the agent imports nothing of the checkpoint
    library."""
    while True:
        tmp = f"{path}.{tag + '.' if tag else ''}{secrets.token_hex(8)}.writing"
        try:
            fd = os.open(tmp, _CREATE_FLAGS, 0o644)
            break
        except FileExistsError:
            continue
    try:
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view) :]
            if fsync:
                os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    if fsync:
        dir_fd = os.open(os.path.dirname(os.path.abspath(path)), os.O_RDONLY)
        try:
            os.fsync(dir_fd)
        finally:
            os.close(dir_fd)


def _read_small_json(path: str) -> Any:
    """The JSON in the small regular file ``path``; raises ValueError or OSError for
    anything else: a symlink, a FIFO or a device (opened without following or blocking),
    a file above :data:`MAX_SMALL_FILE_BYTES`, JSON that does not parse or nests too deep."""
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_size > MAX_SMALL_FILE_BYTES:
            raise ValueError(f"{path}: not a small regular file")
        data = os.read(fd, MAX_SMALL_FILE_BYTES + 1)
    finally:
        os.close(fd)
    if len(data) > MAX_SMALL_FILE_BYTES:
        raise ValueError(f"{path}: more than {MAX_SMALL_FILE_BYTES} bytes")
    try:
        return json.loads(data)
    except RecursionError as exc:
        raise ValueError(f"{path}: nested too deep") from exc


def write_fence(ckpt_dir: str, *, run_id: str, round_: int, node_id: str = "") -> None:
    """Write the checkpoint fence of a new round, before its workers start.

    ``<ckpt_dir>/fence.json`` names the run and the round whose workers may commit; the
    checkpoint store refuses a commit from any other (docs/checkpoint-format.md, "Fencing"),
    so workers of a world that froze and was replaced cannot commit over the new world's
    steps. Written by every agent of the world (the same bytes; on node-local disks each
    node fences its own copy). Never lowered within a run: a stale agent that thaws and
    writes an older round leaves the newer fence in place. The agent imports nothing of
    the checkpoint library, so the tiny format is written here and documented there.
    """
    os.makedirs(ckpt_dir, exist_ok=True)
    path = os.path.join(ckpt_dir, "fence.json")
    try:
        current = _read_small_json(path)
        if current.get("run_id") == run_id and int(current.get("round", 0)) >= round_:
            return
    except (OSError, ValueError, TypeError, AttributeError):
        pass  # absent or unreadable: write ours
    # Unique per writer (shared storage: fence.json.<node>.<16 hex>.writing), never through
    # a planted symlink, and not *.tmp: savers sweep those.
    data = json.dumps({"run_id": run_id, "round": round_}).encode()
    _replace_file(path, data, tag=node_id or "agent", fsync=True)


ROUND_DIRS_KEPT = 8
"""A run's round directories (layout, job, workers, heartbeats) a node keeps in its state
dir: the newest; older ones go as a round starts. (A job re-formed every few minutes for
weeks left thousands: 5 files and about 20 KB each, 200 rounds 4 MB a node.)"""


def prune_rounds(run_root: str, current: int) -> None:
    """Delete ``run_root``'s ``round-N`` directories older than the newest
    :data:`ROUND_DIRS_KEPT` (``current`` is the newest)."""
    try:
        names = os.listdir(run_root)
    except OSError:
        return
    for name in names:
        head, _, number = name.partition("-")
        if head == "round" and number.isdigit() and int(number) <= current - ROUND_DIRS_KEPT:
            shutil.rmtree(os.path.join(run_root, name), ignore_errors=True)


def launch(
    *,
    job: JobSpec,
    run_id: str,
    world: Any,
    node: NodeInfo,
    restarts: int,
    resume_step: int | None,
    env: Mapping[str, str],
    clock: Callable[[], float],
    devices: list[str] | None = None,
    keep: WorkerGroup | None = None,
    forks: ForkServer | None = None,
) -> Round:
    """Plan the layout for ``world``, fence the checkpoint dir for its round, write the
    round's files and start our workers on ``devices`` (None: no device accounting).

    ``keep`` (restart.mode inprocess): the previous round's live workers go on in this
    round: the control file hands each its new environment, and only the missing local
    ranks get new processes."""
    formed_at = clock()
    nproc = job.nproc_per_node
    node_rank = world.rank_of(node.node_id)
    layout = plan(world.size * nproc, job)
    run_dir = os.path.join(node.state_dir, "jobs", run_id, f"round-{world.round}")
    os.makedirs(run_dir, exist_ok=True)
    prune_rounds(os.path.dirname(run_dir), world.round)
    layout_path = os.path.join(run_dir, "layout.json")
    job_path = os.path.join(run_dir, "job.json")
    write_json(layout_path, layout.to_dict())
    write_json(job_path, job.to_dict())
    write_fence(job.ckpt_dir, run_id=run_id, round_=world.round, node_id=node.node_id)
    envs = worker_envs(
        WorkerEnvInputs(
            job=job.name, run_id=run_id, round=world.round, node_rank=node_rank,
            nodes=world.size, nproc=nproc, master_addr=world.master_addr,
            master_port=world.master_port, restart_count=restarts,
            max_restarts=job.restart.max_restarts, layout_path=layout_path,
            job_path=job_path, extra=dict(env), devices=devices,
        )
    )  # fmt: skip
    control = control_path(node.state_dir, run_id)
    for local_rank, e in enumerate(envs):
        e[ENV_MODE] = job.restart.mode
        if job.restart.mode == "inprocess":
            e[ENV_CONTROL] = control
        envs[local_rank] = WorkerGroup.round_env(e, run_dir, local_rank)
    carried = 0 if keep is None else keep.kept()

    def hand_over() -> None:
        if job.restart.mode == "inprocess":
            write_control(control, round_=world.round, state="run",
                          envs={str(i): e for i, e in enumerate(envs)},
                          pids=kept_pids(keep, len(envs)))  # fmt: skip

    workers = WorkerGroup.carry(
        keep,
        argv=worker_argv(job.command, job_path, node.python),
        envs=envs,
        log_dir=os.path.join(job.logs_dir(run_id), f"round-{world.round}"),
        run_dir=run_dir,
        cwd=os.getcwd(),
        clock=clock,
        before_spawn=hand_over,
        forks=forks,
    )
    pids = workers.pids()
    write_json(os.path.join(run_dir, "workers.json"), {str(r): p for r, p in pids.items()})
    write_json(
        os.path.join(node.state_dir, "workers.json"),
        {"job": job.name, "round": world.round, "pids": pids},
    )
    return Round(
        number=world.round,
        node_rank=node_rank,
        nodes=tuple(world.nodes),
        workers=workers,
        layout=layout,
        formed_at=formed_at,
        spawned_at=clock(),
        resume_step=resume_step,
        carried=carried,
    )


def warm_workers(
    *,
    job: JobSpec,
    run_id: str,
    node: NodeInfo,
    local_ranks: list[int],
    env: Mapping[str, str],
    clock: Callable[[], float],
    devices: list[str] | None = None,
    forks: ForkServer | None = None,
) -> WorkerGroup | None:
    """Start warm workers for ``local_ranks`` before the next round forms (in-process jobs
    of the built-in trainer): each imports torch and the trainer, then waits for the
    control file to hand it a round newer than any the file names now, so that a round
    that takes it (the job's first, a newcomer's, a killed worker's replacement) does not
    wait for a Python start and ``import torch``. None when the job cannot use them: a
    ``command`` of its own may read its rank at import time, before it could wait."""
    if not local_ranks:
        return None
    names = {i: f"local-{i}" for i in local_ranks}
    return _spawn_warm(job=job, run_id=run_id, node=node, names=names, env=env, clock=clock,
                       devices=devices, forks=forks)  # fmt: skip


_standbys = itertools.count()


def standby_workers(
    *,
    job: JobSpec,
    run_id: str,
    node: NodeInfo,
    count: int,
    env: Mapping[str, str],
    clock: Callable[[], float],
    devices: list[str] | None = None,
    forks: ForkServer | None = None,
) -> WorkerGroup | None:
    """Start ``count`` standby workers (``restart.standby``): warm workers for no rank in
    particular, kept ready while a round trains so that when one of this node's workers
    dies (killed, crashed, hung) its replacement has imported torch already. A round
    adopts one (:meth:`WorkerGroup.adopt`) and names it by its pid in the control file
    (:func:`kept_pids`). None for jobs that cannot use warm workers."""
    if count <= 0:
        return None
    names = {-1 - k: f"standby-{next(_standbys)}" for k in range(count)}
    return _spawn_warm(job=job, run_id=run_id, node=node, names=names, env=env, clock=clock,
                       devices=devices, standby=True, forks=forks)  # fmt: skip


def _spawn_warm(
    *,
    job: JobSpec,
    run_id: str,
    node: NodeInfo,
    names: Mapping[int, str],
    env: Mapping[str, str],
    clock: Callable[[], float],
    devices: list[str] | None,
    standby: bool = False,
    forks: ForkServer | None = None,
) -> WorkerGroup | None:
    """Warm workers keyed by local rank (negative for standbys), named ``names[i]`` in
    their log and ready files."""
    if job.restart.mode != "inprocess" or job.command:
        return None
    control = control_path(node.state_dir, run_id)
    warm_dir = os.path.join(node.state_dir, "jobs", run_id, "warm")
    os.makedirs(warm_dir, exist_ok=True)
    job_path = os.path.join(warm_dir, "job.json")
    write_json(job_path, job.to_dict())
    base = scrub_env(env)
    base.setdefault("OMP_NUM_THREADS", "1")
    if devices is not None:
        base["CUDA_VISIBLE_DEVICES"] = ",".join(devices)
    after = str(control_round(control))
    own = {ENV_MODE: "inprocess", ENV_CONTROL: control, ENV_WARM: after}
    envs = {}
    for i, name in names.items():
        ready = os.path.join(warm_dir, f"ready-{node.node_id}-{name}")
        with contextlib.suppress(FileNotFoundError):
            os.unlink(ready)
        local = str(STANDBY_LOCAL_RANK if standby else i)
        envs[i] = {**base, "LOCAL_RANK": local, **own, ENV_WARM_READY: ready}
    return WorkerGroup.spawn_warm(
        argv=worker_argv(job.command, job_path, node.python), envs=envs, names=names,
        log_dir=os.path.join(job.logs_dir(run_id), "warm", node.node_id), cwd=os.getcwd(),
        clock=clock, standby=standby, forks=forks,
    )  # fmt: skip


def kept_pids(keep: WorkerGroup | None, nproc: int) -> dict[str, str]:
    """The control file's ``pids`` of a round: pid -> local rank of every live worker the
    round keeps. A standby waits under local rank -1 and learns its rank from this; it is
    written in every round, not only the one that adopted it, so a standby still importing
    when that round ended finds its rank in the next. A warm worker for a local rank that
    its fork server has not started yet is left out (it goes by its local rank), so the
    round is not held for the server's imports; a standby is waited for (its pid is how
    it learns its rank)."""
    return {
        str(w.proc.pid): str(w.local_rank)
        for w in (keep.workers if keep is not None else [])
        if 0 <= w.local_rank < nproc and w.proc.poll() is None
        and (w.standby or not is_pending(w.proc))
    }  # fmt: skip


def warm_ready(group: WorkerGroup) -> bool:
    """Whether every live warm worker of ``group`` has finished its imports (a dead one
    counts as done: the round starts its replacement the usual way)."""
    for w in group.workers:
        if w.warm and w.proc.poll() is None:
            ready = w.env_ready
            if ready and not os.path.exists(ready):
                return False
    return True


def control_round(path: str) -> int:
    """The round the control file names, or -1 (no file yet, or unreadable)."""
    try:
        return int(_read_small_json(path).get("round", -1))
    except (OSError, ValueError, AttributeError, TypeError):
        return -1


def control_path(state_dir: str, run_id: str) -> str:
    """The node's control file of one run (``elasticd.inprocess``)."""
    return os.path.join(state_dir, "jobs", run_id, "control.json")


ENDS_KEPT = 8
"""Rounds whose end reason every control record carries (:func:`write_control`)."""


def _recent_ends(path: str) -> dict[str, str]:
    """The ``ended`` map of the control file now: {} if none, or anything unexpected."""
    try:
        ended = _read_small_json(path).get("ended") or {}
        return {str(int(k)): str(v) for k, v in dict(ended).items()}
    except (OSError, ValueError, AttributeError, TypeError):
        return {}


def write_control(
    path: str,
    *,
    round_: int,
    state: str,
    envs: Mapping[str, Mapping[str, str]] | None = None,
    pids: Mapping[str, str] | None = None,
    reason: str = "",
) -> None:
    """Tell this node's in-process workers that round ``round_`` ends (``abort``, with the
    round's outcome as ``reason``: a round ended for a newcomer is no failed recovery) or
    starts (``run``, with each local rank's environment, and ``pids``: the local rank of
    each kept process). Every record also carries ``ended``, the reasons of the last
    :data:`ENDS_KEPT` rounds ended with one: a worker that missed an abort record (the next
    round's overwrote it between two of its looks) still learns why its round ended.
    Atomic: a reader sees a whole record. The agent is the file's one writer."""
    os.makedirs(os.path.dirname(path), exist_ok=True)
    ended = _recent_ends(path)
    if state == "abort" and reason:
        ended[str(round_)] = reason
    ended = dict(sorted(ended.items(), key=lambda kv: int(kv[0]))[-ENDS_KEPT:])
    record = {"round": round_, "state": state, "t": time.time(), "env": dict(envs or {}),
              "pids": dict(pids or {}), "reason": reason, "ended": ended}  # fmt: skip
    _replace_file(path, json.dumps(record, separators=(",", ":")).encode())
