"""The local worker processes of one round: spawn, watch, signal, stop.

Why not torch's ``start_processes``: its log files live under its own
``<log_dir>/<run_id>/attempt_<n>/<local_rank>/`` tree and it offers no hook to set a
parent-death signal. We need ``<output_dir>/logs/<run_id>/round-<r>/rank-<n>.log`` and
workers that die with their agent, so we spawn with ``subprocess`` and keep torch's
conventions where they matter: the torchrun environment, and ``TORCHELASTIC_ERROR_FILE``
so a worker whose entry point uses torch's ``@record`` leaves its exception as JSON, which
we read back as the failure message.

Each worker gets ``PR_SET_PDEATHSIG = SIGKILL`` (through :mod:`elasticd.agent.pdeathsig`):
if the agent is SIGKILLed, the kernel kills its workers at once, so they never train
unsupervised. Each worker also leads
its own process group, so a stop reaches the processes it started too.
"""

from __future__ import annotations

import contextlib
import enum
import itertools
import json
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from elasticd.agent.forkserver import (
    ForkedProcess,
    ForkServer,
    pid_now,
    signal_group,
    target_of,
)
from elasticd.agent.policy import FINISH_WAIT, WAITING_FRESH, hang_bound
from elasticd.worker import ENV_HEARTBEAT, PREEMPTED_EXIT_CODE, read_heartbeat


def with_pdeathsig(argv: Sequence[str], python: str = sys.executable) -> list[str]:
    """``argv`` wrapped so that the process gets SIGKILL when this process dies."""
    return [python, "-m", "elasticd.agent.pdeathsig", str(os.getpid()), *argv]


class WorkerState(enum.StrEnum):
    STARTING = "starting"
    """Spawned; no heartbeat yet."""
    RUNNING = "running"
    """Has reported progress."""
    STOPPING = "stopping"
    """Signalled to stop; not yet exited."""
    EXITED = "exited"
    """Exited 0 (or with the preemption code)."""
    FAILED = "failed"
    """Exited non-zero or was killed by a signal."""


@dataclass(kw_only=True, slots=True)
class Worker:
    """One local worker process."""

    local_rank: int
    """Index on this node."""
    rank: int
    """Global rank."""
    proc: Any
    """The process: a ``subprocess.Popen``, or a :class:`ForkedProcess` (the same
    interface)."""
    log_path: str
    """Its combined stdout/stderr."""
    heartbeat_path: str
    """Where it reports progress."""
    error_path: str
    """torch's error file (TORCHELASTIC_ERROR_FILE)."""
    started: float
    """Wall-clock spawn time."""
    stopping: bool = False
    """Whether we asked it to stop."""
    warm: bool = False
    """Started before its round formed; it waits for the control file to hand it one
    (rank, heartbeat and error paths are set when a round takes it)."""
    env_ready: str = ""
    """A warm worker's ready file (it exists once the worker's imports are done)."""
    standby: bool = False
    """A warm worker kept for no rank in particular (``restart.standby``) until a round
    adopts it for a local rank whose process died; the control file then names it by pid."""
    carried: bool = False
    """A live process that this round took over rather than started: one that lived a round
    before, or a warm worker or standby (``env_ready`` then says whether its imports are
    done)."""
    stepped: bool = False
    """It reported a completed step in a round before: it is past its imports and its
    state's load, so what keeps it from taking a new round is the rest of a step (bounded
    by ``hang_timeout``) and the abort."""

    @property
    def returncode(self) -> int | None:
        return self.proc.poll()

    def state(self) -> WorkerState:
        code = self.proc.poll()
        if code is None:
            if self.stopping:
                return WorkerState.STOPPING
            running = read_heartbeat(self.heartbeat_path) is not None
            return WorkerState.RUNNING if running else WorkerState.STARTING
        ok = code == 0 or code == PREEMPTED_EXIT_CODE
        return WorkerState.EXITED if ok else WorkerState.FAILED

    def failure_message(self) -> str:
        """What went wrong, from the error file if the worker left one, else the exit code."""
        code = self.proc.poll()
        how = f"exit code {code}" if code is None or code >= 0 else f"signal {-code}"
        try:
            with open(self.error_path, encoding="utf-8") as fh:
                message = json.load(fh).get("message", {})
            text = message.get("message") if isinstance(message, dict) else str(message)
            if text:
                last = str(text).strip().splitlines()[-1]
                return f"rank {self.rank}: {how}: {last}"[:500]
        except (OSError, ValueError, AttributeError):
            pass
        last = last_line(self.log_path)
        if last:
            hint = _abort_hint(code, last)
            if code is not None and code < 0:
                # Killed, its log's last line is only what it did last (a step's line
                # read as the error): named so, with the signal's name.
                how = f"{how} ({_signal_name(-code)}), last log line"
            return f"rank {self.rank}: {how}: {last}{hint} (log {self.log_path})"[:500]
        return f"rank {self.rank}: {how} (log {self.log_path})"


def _signal_name(number: int) -> str:
    try:
        return signal.Signals(number).name
    except ValueError:
        return "an unknown signal"


_EXIT_ABORT = "terminate called without an active exception"


def _abort_hint(code: int | None, last: str) -> str:
    """What a SIGABRT with C++'s bare ``terminate`` as its last words usually means.

    torch 2.13 sometimes aborts so a process that leaves with a gloo group open, its steps
    done: signal 6 where 0 or 75 was due (``bench/exit_abort.py``: 6 of 160 processes of a
    two-rank script under load, none of 160 that destroyed the group first; a CI machine
    lost a reference run so three rounds in a row). torch's documented shutdown,
    ``dist.destroy_process_group()`` before the script leaves, is the fix
    (docs/testing.md)."""
    if code != -signal.SIGABRT or _EXIT_ABORT not in last:
        return ""
    return (" (a process that exits with its process group open: call"
            " dist.destroy_process_group() before the script leaves)")  # fmt: skip


def last_line(path: str, tail: int = 4096) -> str:
    """The last non-empty line of a log (read from its last ``tail`` bytes), or "": the
    error's, not the Python frames pybind11 lists after it (``At:``, then one
    ``file(line): function`` per frame, as an error raised in a future's callback ends)."""
    try:
        with open(path, "rb") as fh:
            fh.seek(0, os.SEEK_END)
            fh.seek(max(0, fh.tell() - tail))
            text = fh.read().decode(errors="replace").strip().splitlines()
    except OSError:
        return ""
    lines = [_RANK_PREFIX.sub("", line.strip()) for line in text]
    lines = [line for line in lines if line]
    end = len(lines)
    while end and _PYBIND_FRAME.match(lines[end - 1]):
        end -= 1
    if end < len(lines) and end >= 2 and lines[end - 1] == "At:":
        lines = lines[: end - 1]  # the error is the line before "At:"
    return lines[-1] if lines else ""


_PYBIND_FRAME = re.compile(r"^\S.*\(\d+\): \S+$")
"""One frame of the ``At:`` list pybind11 adds to an error raised in Python under C++."""


_RANK_PREFIX = re.compile(r"^(?:\[rank\d+\]:\s*)+")
"""The ``[rankN]:`` prefixes torch puts before an uncaught exception's lines on stderr, once
per process group the process made (so twice after an in-process round: ``[rank0]:
[rank0]: RuntimeError: ...``): a failure message names its rank already."""


def _start(
    argv: Sequence[str],
    env: Mapping[str, str],
    cwd: str | None,
    log_path: str,
    forks: ForkServer | None = None,
) -> Any:
    """One worker process: its own session, dying with the agent, output appended to
    ``log_path``, unbuffered unless the job says otherwise (a SIGKILLed worker's last
    lines are the ones that explain it). Forked from ``forks`` when it can run ``argv``
    (:mod:`elasticd.agent.forkserver`), else exec'd."""
    if forks is not None and forks.usable() and target_of(argv, forks.python) is not None:
        return ForkedProcess(forks, argv, env, cwd, log_path, exec_start=_exec)
    return _exec(argv, env, cwd, log_path)


def _exec(
    argv: Sequence[str], env: Mapping[str, str], cwd: str | None, log_path: str
) -> subprocess.Popen:
    """:func:`_start` by exec."""
    env = {"PYTHONUNBUFFERED": "1", **env}
    with open(log_path, "ab") as log:
        return subprocess.Popen(
            with_pdeathsig(argv), env=env, cwd=cwd, stdin=subprocess.DEVNULL,
            stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
        )  # fmt: skip


@dataclass(kw_only=True, slots=True)
class WorkerGroup:
    """The nproc workers of this node in one round."""

    workers: list[Worker] = field(default_factory=list)
    """In local-rank order."""

    @classmethod
    def spawn(
        cls,
        *,
        argv: Sequence[str],
        envs: Sequence[Mapping[str, str]],
        log_dir: str,
        run_dir: str,
        cwd: str | None = None,
        clock: Callable[[], float] = time.time,
        forks: ForkServer | None = None,
    ) -> WorkerGroup:
        """Start one process per env (local rank order); ``envs[i]['RANK']`` names its log."""
        return cls.carry(None, argv=argv, envs=envs, log_dir=log_dir, run_dir=run_dir,
                         cwd=cwd, clock=clock, forks=forks)  # fmt: skip

    @staticmethod
    def round_env(base_env: Mapping[str, str], run_dir: str, local_rank: int) -> dict[str, str]:
        """``base_env`` plus this round's heartbeat and error file of ``local_rank`` (stale
        ones removed)."""
        hb = os.path.join(run_dir, f"heartbeat-{local_rank}.json")
        err = os.path.join(run_dir, f"error-{local_rank}.json")
        for stale in (hb, err):
            if os.path.exists(stale):
                os.unlink(stale)
        return {**base_env, ENV_HEARTBEAT: hb, "TORCHELASTIC_ERROR_FILE": err}

    @classmethod
    def carry(
        cls,
        kept: WorkerGroup | None,
        *,
        argv: Sequence[str],
        envs: Sequence[Mapping[str, str]],
        log_dir: str,
        run_dir: str,
        cwd: str | None = None,
        clock: Callable[[], float] = time.time,
        before_spawn: Callable[[], None] | None = None,
        forks: ForkServer | None = None,
    ) -> WorkerGroup:
        """The workers of a new round: ``kept``'s live processes go on under their new
        ranks (in-process restart; ``envs`` must already be :meth:`round_env`'s), and a
        process is started for every other local rank. ``before_spawn()`` runs between
        the two (the agent hands the survivors their new round there, so they set up while
        the newcomers start). ``forks``: the job's fork server, if it has one."""
        os.makedirs(run_dir, exist_ok=True)
        alive = {w.local_rank: w for w in (kept.workers if kept else []) if w.proc.poll() is None}
        group = cls()
        fresh: list[tuple[int, dict[str, str]]] = []
        for local_rank, base_env in enumerate(envs):
            old = alive.get(local_rank)
            if old is None:
                fresh.append((local_rank, dict(base_env)))
                continue
            beat = read_heartbeat(old.heartbeat_path) if old.heartbeat_path else None
            stepped = old.stepped or (beat is not None and "step" in beat)
            group.workers.append(
                Worker(
                    local_rank=local_rank, rank=int(base_env["RANK"]), proc=old.proc,
                    log_path=old.log_path, heartbeat_path=base_env[ENV_HEARTBEAT],
                    error_path=base_env["TORCHELASTIC_ERROR_FILE"], started=old.started,
                    carried=True, env_ready=old.env_ready, stepped=stepped,
                )
            )  # fmt: skip
        if before_spawn is not None:
            before_spawn()
        if fresh:  # a round of carried workers only has no log of its own (they log on)
            os.makedirs(log_dir, exist_ok=True)
        try:
            for local_rank, base_env in fresh:
                rank = int(base_env["RANK"])
                env = base_env if ENV_HEARTBEAT in base_env else cls.round_env(
                    base_env, run_dir, local_rank
                )  # fmt: skip
                log_path = os.path.join(log_dir, f"rank-{rank}.log")
                proc = _start(argv, env, cwd, log_path, forks)
                group.workers.append(
                    Worker(
                        local_rank=local_rank,
                        rank=rank,
                        proc=proc,
                        log_path=log_path,
                        heartbeat_path=env[ENV_HEARTBEAT],
                        error_path=env["TORCHELASTIC_ERROR_FILE"],
                        started=clock(),
                    )
                )
        except OSError:
            group.kill()
            raise
        group.workers.sort(key=lambda w: w.local_rank)
        return group

    @classmethod
    def spawn_warm(
        cls,
        *,
        argv: Sequence[str],
        envs: Mapping[int, Mapping[str, str]],
        log_dir: str,
        names: Mapping[int, str] | None = None,
        cwd: str | None = None,
        clock: Callable[[], float] = time.time,
        standby: bool = False,
        forks: ForkServer | None = None,
    ) -> WorkerGroup:
        """Start a warm worker for each local rank in ``envs``: it imports what it needs,
        then waits for a round through the control file (``ELASTICD_WARM_AFTER``). Its log
        is ``<log_dir>/<names[i]>.log`` (default ``local-<i>``)."""
        os.makedirs(log_dir, exist_ok=True)
        group = cls()
        try:
            for local_rank, env in sorted(envs.items()):
                name = (names or {}).get(local_rank, f"local-{local_rank}")
                log_path = os.path.join(log_dir, f"{name}.log")
                proc = _start(argv, env, cwd, log_path, forks)
                worker = Worker(local_rank=local_rank, rank=-1, proc=proc, log_path=log_path,
                                heartbeat_path="", error_path="", started=clock(), warm=True,
                                env_ready=env.get("ELASTICD_WARM_READY", ""),
                                standby=standby)  # fmt: skip
                group.workers.append(worker)
        except OSError:
            group.kill()
            raise
        return group

    def adopt(self, local_ranks: Sequence[int]) -> WorkerGroup:
        """Standbys of this group taken for ``local_ranks``, in order, as many as are
        alive (the ready ones first); they leave this group. The rest of ``local_ranks``
        get none."""
        ready = sorted((w for w in self.workers if w.proc.poll() is None),
                       key=lambda w: not (w.env_ready and os.path.exists(w.env_ready)))  # fmt: skip
        taken = WorkerGroup()
        for local_rank, w in zip(local_ranks, ready, strict=False):
            w.local_rank = local_rank
            taken.workers.append(w)
        ids = {id(w) for w in taken.workers}
        self.workers = [w for w in self.workers if id(w) not in ids]
        taken.workers.sort(key=lambda w: w.local_rank)
        return taken

    def alive(self) -> int:
        """How many of this group's processes are running."""
        return sum(1 for w in self.workers if w.proc.poll() is None)

    def missing(self, nproc: int) -> list[int]:
        """Local ranks below ``nproc`` with no live process in this group."""
        alive = {w.local_rank for w in self.workers if w.proc.poll() is None}
        return [i for i in range(nproc) if i not in alive]

    def merge(self, other: WorkerGroup) -> None:
        """Take ``other``'s workers in place of this group's dead ones of the same local rank."""
        taken = {w.local_rank for w in other.workers}
        self.workers = [w for w in self.workers if w.local_rank not in taken] + other.workers
        self.workers.sort(key=lambda w: w.local_rank)

    def kept(self) -> int:
        """How many workers that lived a round are still alive (carried into the next
        round in-process); warm ones do not count."""
        return sum(1 for w in self.workers if w.proc.poll() is None and not w.warm)

    def pids(self) -> dict[int, int]:
        """Global rank → pid."""
        return {w.rank: w.proc.pid for w in self.workers}

    def states(self) -> dict[str, int]:
        counts: dict[str, int] = {}
        for w in self.workers:
            s = str(w.state())
            counts[s] = counts.get(s, 0) + 1
        return counts

    def all_exited(self) -> bool:
        return all(w.proc.poll() is not None for w in self.workers)

    def failed(self) -> list[Worker]:
        """Workers that exited with a real failure (not 0, not the preemption code)."""
        return [w for w in self.workers if w.state() == WorkerState.FAILED]

    def preempted(self) -> list[Worker]:
        return [w for w in self.workers if w.proc.poll() == PREEMPTED_EXIT_CODE]

    def send(self, signum: int) -> None:
        """Send ``signum`` to every live worker's process group."""
        for w in self.workers:
            if w.proc.poll() is None:
                w.stopping = True
                signal_group(w.proc, signum)

    def wait(self, timeout: float) -> bool:
        """Wait until all exited or ``timeout`` passed; returns whether all exited."""
        deadline = time.monotonic() + timeout
        while not self.all_exited():
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.02)
        return True

    def stop(self, grace: float, first: int = signal.SIGTERM) -> None:
        """``first`` (SIGTERM), up to ``grace`` seconds, then SIGKILL; reaps everything."""
        if not self.all_exited():
            self.send(first)
            if not self.wait(grace):
                self.kill()

    def dump_stacks(self) -> int:
        """Ask every live worker of ours that already catches SIGUSR1 (the built-in
        trainer: :func:`prints_stacks`) to print every thread's stack into its log, as it
        is now; returns how many were asked."""
        asked = 0
        for w in self.workers:
            pid = pid_now(w.proc)  # one its fork server has not started has no stack
            if pid is not None and w.proc.poll() is None and prints_stacks(pid):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGUSR1)
                    asked += 1
        return asked

    def kill(self) -> None:
        self.send(signal.SIGKILL)
        for w in self.workers:
            with contextlib.suppress(subprocess.TimeoutExpired):
                w.proc.wait(timeout=10)

    def heartbeats(self) -> dict[int, dict]:
        """Local rank → its last heartbeat record (workers that reported)."""
        out = {}
        for w in self.workers:
            hb = read_heartbeat(w.heartbeat_path)
            if hb is not None:
                out[w.local_rank] = hb
        return out

    def not_opened(self) -> list[Worker]:
        """Live workers that took this round (their heartbeat exists) but have not opened
        its process group (no ``pg_ready`` phase yet): still waiting for their peers."""
        out = []
        for w in self.workers:
            if w.proc.poll() is not None:
                continue
            beat = read_heartbeat(w.heartbeat_path)
            if beat is not None and "pg_ready" not in (beat.get("phases") or {}):
                out.append(w)
        return out

    def not_begun(self) -> list[Worker]:
        """Live carried workers with no heartbeat of this round yet: an in-process worker
        writes one (phase ``begun``) as soon as it takes the round, so one that has not is
        still inside the round before. A warm worker or standby still importing (no ready
        file yet) is not: it has no round before, and it is as slow as a new process."""
        return [w for w in self.workers
                if w.carried and w.proc.poll() is None
                and not (w.env_ready and not os.path.exists(w.env_ready))
                and read_heartbeat(w.heartbeat_path) is None]  # fmt: skip

    def stalest_progress(self, now: float) -> Staleness | None:
        """The live worker nearest to being hung, with its heartbeat's age in seconds and
        whether it waits on its peers (a waiting worker's age counts against
        :func:`hang_bound`'s longer bound: compared by age over bound).

        Only workers that reported a completed step are judged, or that are inside an
        in-process recovery (:func:`recovering`): a command that never calls the
        heartbeat, and a spare rank that idles without steps, are not declared hung
        (docs/agent.md)."""
        worst: Staleness | None = None
        for w in self.workers:
            if w.proc.poll() is not None:
                continue
            beat = read_heartbeat(w.heartbeat_path)
            if beat is None or ("step" not in beat and not recovering(beat)):
                continue
            try:
                age = now - os.stat(w.heartbeat_path).st_mtime
            except OSError:
                continue
            if finishing(beat, now):
                continue
            seen = Staleness(w, age, waiting_now(beat, now))
            if worst is None or seen.share > worst.share:
                worst = seen
        return worst


RECOVERY_ENDS = ("state_loaded", "ckpt_loaded", "ckpt_loading")
"""Heartbeat phases that end a worker's judged recovery: its state is loaded, or it
falls back to a checkpoint load (not judged, as a process restart's is not)."""


def recovering(beat: Mapping) -> bool:
    """Whether a heartbeat says its worker is inside an in-process recovery from its
    peers: it marked ``recovering`` and none of :data:`RECOVERY_ENDS` yet. Every rank of
    the world marks it as the step to recover at is agreed (the built-in trainer's
    ``agree``, a script's ``Context.sync_state``), the trainer again once its set-up is
    done, and both again when every rank has arrived at the transfer's plan; each mark
    moves the heartbeat's mtime, from which restart.hang_timeout counts, as for a step.
    Before, a worker with no step in its round was never judged: one stopped there
    (SIGSTOP, a paused container) held the world for the process group's 10-minute
    timeout. Its peers, idle in a collective waiting on it, are marked ``waiting``
    meanwhile (the control watcher), so the stopped one is killed first and they recover
    in-process."""
    phases = beat.get("phases")
    if not isinstance(phases, dict) or "recovering" not in phases:
        return False
    return not any(p in phases for p in RECOVERY_ENDS)


def finishing(beat: Mapping, now: float) -> bool:
    """Whether a heartbeat says its worker's training function returned (``finished``:
    it only tears down and exits now) less than ``FINISH_WAIT`` seconds ago. Such a worker
    is not judged by restart.hang_timeout: a job whose every step was done was restarted
    from nothing when a loaded node's teardown took longer. Past ``FINISH_WAIT`` it is
    judged as any other (a teardown stuck for good)."""
    return _marked_within(beat, "finished", now, FINISH_WAIT)


def waiting_now(beat: Mapping, now: float) -> bool:
    """Whether a heartbeat's ``waiting`` mark (the worker waits on its peers in a
    collective) was refreshed within WAITING_FRESH seconds."""
    return _marked_within(beat, "waiting", now, WAITING_FRESH)


def _marked_within(beat: Mapping, name: str, now: float, seconds: float) -> bool:
    """Whether the heartbeat's mark ``name`` (``{"t": when}``) is at most ``seconds`` old."""
    mark = beat.get(name)
    if not isinstance(mark, dict):
        return False
    try:
        return now - float(mark.get("t", 0.0)) <= seconds
    except (TypeError, ValueError):
        return False


class Staleness(NamedTuple):
    worker: Worker
    age: float
    """Seconds since its heartbeat was last written."""
    waiting: bool
    """Its heartbeat says it waits on its peers in a collective of its round, a mark
    refreshed within WAITING_FRESH seconds (:func:`waiting_now`)."""

    @property
    def share(self) -> float:
        """Its age over its hang bound (per second of restart.hang_timeout)."""
        return self.age / hang_bound(1.0, waiting=self.waiting)


_OURS = (b"elasticd", b"trainer")
"""What follows ``-m`` in the command line of a process of ours."""
_TRAINERS_SERVER = b"elasticd.agent.forkserver"
"""A forked worker keeps its fork server's command line: ours when the server is the
built-in trainer's (it preloads ``trainer.train``). A job's own command forked under
``restart.fork: true`` has a server without it, and is not sent SIGUSR1."""


def prints_stacks(pid: int) -> bool:
    """Whether ``pid`` runs ``-m elasticd`` or ``-m trainer`` and already catches SIGUSR1:
    they print their stacks on it (``elasticd.log.dump_stacks_on_sigusr1``). Nothing else
    gets the signal: it kills a process that does not catch it, and a user's handler may
    mean something else by it (Lightning requeues a Slurm job on SIGUSR1)."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as fh:
            argv = fh.read().split(b"\0")
    except OSError:
        return False
    ours = any(a == b"-m" and (b in _OURS or (b == _TRAINERS_SERVER and b"trainer.train" in argv))
               for a, b in itertools.pairwise(argv))  # fmt: skip
    return ours and catches(pid, signal.SIGUSR1)


def catches(pid: int, sig: int) -> bool:
    """Whether process ``pid`` has a handler for ``sig`` (its ``SigCgt`` in /proc): a
    signal whose default action kills must go only to one that catches it."""
    try:
        with open(f"/proc/{pid}/status", encoding="ascii") as fh:
            caught = next((int(ln.split()[1], 16) for ln in fh if ln.startswith("SigCgt:")), 0)
    except (OSError, ValueError):
        return False
    return bool(caught >> (sig - 1) & 1)
