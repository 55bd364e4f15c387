"""The worker side of the agent: a heartbeat per step, and the preemption signal.

A worker (the built-in trainer, or any script under ``elasticd agent``) talks to its agent
through a small JSON file in the agent's state dir, named by ``ELASTICD_HEARTBEAT_FILE``.
The file is replaced atomically on every call, so the agent always reads a whole record.
Its modification time is the heartbeat: no progress for ``restart.hang_timeout`` seconds
is a hang. Rank 0's record also carries the loss and tokens/s, which the agent exports as
Prometheus metrics and writes into the job's status.

Preemption: **SIGTERM to a worker means "save an emergency checkpoint now, then exit with
PREEMPTED_EXIT_CODE"**. The agent sends it when its node is being stopped (systemd stop,
Kubernetes eviction); systemd's default KillMode sends it straight to every process too.
:meth:`WorkerChannel.install_preemption_handler` turns the signal into a flag, and the
training loop checks it once per step. A checkpoint needs every rank, so the ranks must
agree before saving: :meth:`WorkerChannel.preempt_agreed` all-reduces the flag (MAX).
Outside the agent (no env var) everything here is a cheap no-op, so the trainer runs the
same under plain torchrun.

Usage in a training loop (the flag goes over a gloo group of its own: it stays on the CPU,
costs the GPU nothing, and cannot interleave with collectives another thread, such as an
async checkpoint writer, runs on the default group)::

    channel = WorkerChannel.from_env()
    channel.install_preemption_handler()
    flags = dist.new_group(backend="gloo")  # once per world, on every rank
    for step in ...:
        ...
        channel.progress(step=step, loss=loss, tokens_per_s=tps)
        if channel.preempt_agreed(flags):
            save_checkpoint(step, wait=True)
            sys.exit(PREEMPTED_EXIT_CODE)

``preempt_agreed()`` on the default group works too, on any backend: the flag is put on
the device that group's backend needs (the current CUDA device for NCCL).

Under in-process restart (``elasticd.inprocess.run``), use ``ctx.channel`` (its
preemption flag is shared by every round's channel of the process) and call
``ctx.leave_for_preemption()`` after the save and before the exit: a rank whose own node
is not the one going then leaves the round with its state and takes the next one in the
same process, instead of exiting (the built-in trainer does).
"""

from __future__ import annotations

import contextlib
import json
import os
import select
import signal
import threading
import time
from collections.abc import Callable, Mapping
from typing import Any

ENV_HEARTBEAT = "ELASTICD_HEARTBEAT_FILE"
"""Path of this worker's heartbeat file; set by the agent."""
ENV_DOORBELL = "ELASTICD_DOORBELL"
"""Path of the agent's doorbell (a FIFO): a worker that reports a fault rings it, so its
agent acts at once instead of at its next look (``elasticd.agent.runner.TICK``)."""
PREEMPTED_EXIT_CODE = 75
"""Exit status of a worker that stopped early because its node is preempted (EX_TEMPFAIL).
The agent treats it as "re-form the world", not as a failure."""
USER_ERROR_EXIT_CODE = 2
"""Exit status of a worker for a user error (bad config, unloadable checkpoint, a misused
API): the job fails at once with that worker's last error line, without spending restarts."""


_SHARED: dict[str, tuple[threading.Lock, dict[str, float], dict[str, Any]]] = {}
_SHARED_LOCK = threading.Lock()


def _shared(path: str | None) -> tuple[threading.Lock, dict[str, float], dict[str, Any]]:
    """The write lock, phases and last record of ``path``'s heartbeat, one per path in this
    process: every channel of one heartbeat file writes the same record. A script under
    ``elasticd.inprocess.run`` that makes its own channel (``WorkerChannel.from_env()``)
    beside the round's (``ctx.channel``, which the control watcher marks ``waiting``) had
    each write the file whole from its own record: the watcher's, without the script's
    step, hid the rank's progress from the agent, and two writers shared one temporary
    file. (A path is a round's: the next round's channel starts afresh.)"""
    if path is None:
        return threading.Lock(), {}, {}
    with _SHARED_LOCK:
        if path not in _SHARED:
            if len(_SHARED) >= 64:  # rounds of a long-lived process: keep the latest
                _SHARED.pop(next(iter(_SHARED)))
            _SHARED[path] = (threading.Lock(), {}, {})
        return _SHARED[path]


class WorkerChannel:
    """One worker's line to its agent. Cheap to call every step."""

    def __init__(
        self,
        *,
        path: str | None,
        rank: int = 0,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self._path = path
        self._rank = rank
        self._clock = clock
        self._preempt = threading.Event()
        self._write_lock, self._phases, self._last = _shared(path)
        self._first_step: int | None = None
        """The first step :meth:`progress` reported (``reported_step``)."""
        self._env: Mapping[str, str] = {}
        self._faults: Any = None
        self._metrics_path: str | None = None
        self._doorbell: str | None = None
        self.after_record: Callable[[], None] | None = None
        """Called at the end of :meth:`record`: under ``elasticd.inprocess.run``, the
        round's ``Context.check`` (an ended round raises ``RoundAborted`` there)."""

    @classmethod
    def from_env(
        cls, env: Mapping[str, str] | None = None, *, preempt: threading.Event | None = None
    ) -> WorkerChannel:
        """``preempt``: the flag to share with earlier channels of this process (in-process
        restart: one per round), so that a SIGTERM caught by any of their handlers, also
        between two rounds, is this channel's too."""
        env = os.environ if env is None else env
        channel = cls(path=env.get(ENV_HEARTBEAT) or None, rank=int(env.get("RANK", "0") or 0))
        channel._env = dict(env)
        channel._doorbell = env.get(ENV_DOORBELL) or None
        if preempt is not None:
            channel._preempt = preempt
        return channel

    @property
    def preempt_flag(self) -> threading.Event:
        """The flag :meth:`install_preemption_handler`'s SIGTERM handler sets."""
        return self._preempt

    @property
    def supervised(self) -> bool:
        """Whether an elasticd agent is listening."""
        return self._path is not None

    # -- preemption --------------------------------------------------------------------------

    def install_preemption_handler(self) -> None:
        """Turn SIGTERM into :meth:`preempt_requested`. Call from the main thread.

        Only under an agent: under plain torchrun SIGTERM keeps its default meaning.
        """
        if not self.supervised:
            return

        def on_term(signum: int, frame: object) -> None:
            self._preempt.set()

        signal.signal(signal.SIGTERM, on_term)

    def request_preemption(self) -> None:
        """Set the flag as the signal would (for callers with their own signal handling)."""
        self._preempt.set()

    def preempt_requested(self) -> bool:
        """Whether this worker was told to save and stop (local view only)."""
        return self._preempt.is_set()

    def preempt_agreed(self, group: Any = None) -> bool:
        """Whether any rank was told to stop: an all-reduce MAX of the flag over ``group``
        (default: the world). Every rank must call it at the same step."""
        local = self._preempt.is_set()
        if not self.supervised:
            return local
        import torch
        import torch.distributed as dist

        if not dist.is_available() or not dist.is_initialized():
            return local
        device = flag_device(str(dist.get_backend(group)))
        if device == "cuda":
            device = f"cuda:{torch.cuda.current_device()}"
        from elasticd.inprocess import check_results, wait_collective

        flag = torch.tensor([1 if local else 0], dtype=torch.int32, device=device)
        work = dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=group, async_op=True)
        wait_collective(work, group)  # left when an in-process round ends
        agreed = bool(flag.item())
        # An NCCL all-reduce aborted with its round is not an answer. On gloo the answer
        # stands even if the round has just ended: a rank told to stop saves (the save
        # itself fails if the world moved on, fenced).
        check_results(group, gloo=False)
        return agreed

    # -- phases and metrics (elasticd.testing) -----------------------------------------------

    def phase(self, name: str, step: int) -> None:
        """This rank enters phase ``name`` (forward, backward, optimizer, update: every
        collective before the optimizer update done, the update not applied; step-end: the
        step's math and collectives done, its metrics record not yet written; checkpoint-save;
        recover: an in-process recovery, the world re-formed and the step agreed, no state
        moved yet) of step ``step`` (the step in progress, 1-based; for checkpoint-save the
        step being saved; for recover the step the state is recovered at). A fault planned
        for that phase fires here (elasticd/faultplan.py): the call may SIGKILL or stop this
        process, raise ``InjectedFault`` or ``InjectedCollectiveFault``, or wait while the
        cluster kills, stops or preempts this node. Without a plan it costs one attribute check."""
        self._at(name, step)

    def _at(self, name: str | None, step: int) -> None:
        if self._faults is None:
            from elasticd.faultplan import WorkerFaults

            self._faults = WorkerFaults(self._env)
        if self._faults.entries:
            self._faults.at(name, int(step), preempted=self._preempt.is_set)

    def record(self, *, step: int, loss: float | None = None, **metrics: float) -> None:
        """Report step ``step`` done, as :meth:`progress` does, and on global rank 0 append
        its record (``step``, ``loss``, ``world``, ``round``, ``t`` and ``metrics``) to the
        job's metrics.jsonl, where ``elasticd run`` and ``elasticd.testing`` read a
        script's steps and losses. Outside an agent only the heartbeat part applies (none).

        Under in-process restart (``elasticd.inprocess.run``), in a world of one process,
        it then raises ``RoundAborted`` if the agent ended the round: the step is done and
        recorded, and the process leaves with it. A script alone in its world, whose
        collectives touch no socket that could fail, so leaves a round a newcomer ended,
        checks or not."""
        if self._rank == 0:
            path = self._metrics_file()
            if path:
                rec = {"step": int(step), "world": int(self._env.get("WORLD_SIZE", "1") or 1),
                       "round": int(self._env.get("ELASTICD_ROUND", "0") or 0), "t": self._clock()}  # fmt: skip
                if loss is not None:
                    rec["loss"] = float(loss)
                rec.update({k: float(v) for k, v in metrics.items()})
                with open(path, "a", encoding="utf-8") as fh:
                    fh.write(json.dumps(rec) + "\n")
        self.progress(step=step, loss=loss)
        if self.after_record is not None:
            self.after_record()

    def _metrics_file(self) -> str | None:
        """``<output_dir>/metrics.jsonl`` of the job the agent handed us (its job file)."""
        if self._metrics_path is None:
            self._metrics_path = ""
            job_file = self._env.get("ELASTICD_JOB_FILE")
            if job_file and self.supervised:
                try:
                    with open(job_file, encoding="utf-8") as fh:
                        out = json.load(fh).get("output_dir")
                except (OSError, ValueError, AttributeError):
                    out = None
                if out:
                    self._metrics_path = os.path.join(out, "metrics.jsonl")
        return self._metrics_path or None

    # -- progress ----------------------------------------------------------------------------

    def mark(self, phase: str, at: float | None = None) -> None:
        """Record when a start-up phase ended (``pg_ready``, ``ckpt_loaded``; in-process
        also ``aborted`` and ``state_loaded``); the agent uses these to split a recovery's
        time into its parts. ``at``: when it ended (default now)."""
        self._phases[phase] = self._clock() if at is None else float(at)
        self._write()

    def fault(self, error: str) -> None:
        """In-process restart: a collective of this round failed (a peer died or froze).
        The agent takes it as evidence and re-forms the world at once."""
        self._last["fault"] = {"t": self._clock(), "error": error[:500]}
        self._write()
        ring(self._doorbell)

    def peer_preempted(self) -> None:
        """In-process restart: another node is being preempted. Every rank agreed and saved
        the step (the emergency checkpoint); this rank, whose node stays, leaves the round
        with its state and waits for the next one instead of exiting. Its agent re-forms
        the world without the preempted node and keeps this process
        (``Outcome.PEER_PREEMPTED``, as when a worker exits with PREEMPTED_EXIT_CODE)."""
        self._last["peer_preempted"] = {"t": self._clock()}
        self._write()
        ring(self._doorbell)

    def finished(self) -> None:
        """The training function returned: this worker only tears down and exits now
        (destroying its process group, the interpreter's exit). Its agent does not judge
        it by restart.hang_timeout from here: a teardown slower than that on a loaded
        node (or NCCL's destroy waiting on its peers) is no hang, and killing it restarted a
        job whose every step was done. It is judged hung only after
        ``FINISH_WAIT`` (elasticd.agent.policy). The mark keeps the heartbeat's mtime."""
        with self._write_lock:
            self._last["finished"] = {"t": self._clock()}
        self._write(keep_mtime=True)

    def waiting(self, on: bool) -> None:
        """In-process restart: this rank has been blocked for a while in a collective or a
        transfer of its round, waiting on its peers (``on``; called again about every
        second while the wait lasts, to keep the mark fresh), or its wait ended with the
        work done (off). Its agent counts a waiting worker hung only after
        ``WAITING_PATIENCE`` times restart.hang_timeout (elasticd.agent.policy): a peer
        that hangs is killed first, which fails this rank's wait at once, and this rank
        recovers in-process with its state. A mark not refreshed for ``WAITING_FRESH``
        seconds is ignored (a process stopped while it waited is not waiting). The marks
        keep the heartbeat's mtime, the agent's clock of progress; the end of a wait that
        completed moves it (the rank went on). A wait that failed leaves its mark to go
        stale: the rank is leaving its round, and the fault it reports comes next. A world
        where every rank waits (a deadlock) still ends, later. Thread safe: the control
        watcher marks a script's own collectives (elasticd.inprocess), beside the main
        thread's writes."""
        if on:
            with self._write_lock:  # the watcher's thread: never between a step's updates
                self._last["waiting"] = {"t": self._clock()}
            self._write(keep_mtime=True)
            return
        with self._write_lock:
            had = self._last.pop("waiting", None) is not None
        if had:
            self._write()

    @property
    def last_step(self) -> int | None:
        """The step this channel last reported (:meth:`progress`), None before any."""
        step = self._last.get("step")
        return step if isinstance(step, int) else None

    def reported_step(self) -> bool:
        """Whether this channel reported a completed step past the one its round resumed
        at: :meth:`recovered`'s ``resume_step`` when it said one, else the first step it
        reported (a heartbeat of the step a script resumed at on its own is no step)."""
        step = self._last.get("step")
        if step is None:
            return False
        resumed = (self._last.get("recovery") or {}).get("resume_step")
        if not isinstance(resumed, int):
            resumed = self._first_step
        return resumed is None or step > resumed

    def recovered(self, **info: Any) -> None:
        """How this round's state was recovered (``source``, ``resume_step``,
        ``lost_steps``), in-process or after a process restart (a script that resumed from
        its own checkpoint says so: ``source="checkpoint", resume_step=N``); rank 0's goes
        into the job's recovery record. Without it a recovery counts as from ``none``,
        every step lost."""
        self._last["recovery"] = info
        self._write()

    def progress(
        self,
        *,
        step: int,
        loss: float | None = None,
        tokens_per_s: float | None = None,
        checkpoint_step: int | None = None,
        step_s: float | None = None,
        checkpoint_save: dict[str, Any] | None = None,
        mfu: float | None = None,
    ) -> None:
        """Report a completed optimizer step (1-based); this is the heartbeat. ``step_s``:
        the step's wall time; ``checkpoint_save``: the last committed save of this rank
        (``step``, ``seconds`` from its start to its commit), for the agent's metrics. A
        second call for the same step (the trainer's, after its final save) adds to the
        first: the step's loss stays with it, and never a loss of an older step."""
        given = {"loss": (loss, float), "tokens_per_s": (tokens_per_s, float),
                 "checkpoint_step": (checkpoint_step, int), "step_s": (step_s, float),
                 "checkpoint_save": (checkpoint_save, dict), "mfu": (mfu, float)}  # fmt: skip
        if self._first_step is None:
            self._first_step = int(step)
        with self._write_lock:  # in place: the record is shared (_shared)
            same = self._last.get("step") == int(step)
            keep = {k: v for k, v in self._last.items()
                    if k == "recovery" or (same and k in given)}  # fmt: skip
            self._last.clear()
            self._last.update({**keep, "step": int(step)})
            self._last.update({k: kind(v) for k, (v, kind) in given.items() if v is not None})
        self._write()
        self._at(None, step)  # a raising fault with no phase: "after step S"

    def _write(self, *, keep_mtime: bool = False) -> None:
        """Replace the heartbeat file with the current record; ``keep_mtime``: with the
        mtime of the file it replaces (a write that is not progress)."""
        if self._path is None:
            return
        with self._write_lock:  # one temporary file per process
            self._write_locked(keep_mtime)

    def _write_locked(self, keep_mtime: bool) -> None:
        record = {
            "pid": os.getpid(),
            "rank": self._rank,
            "t": self._clock(),
            "phases": dict(self._phases),
            **dict(self._last),
        }
        tmp = f"{self._path}.{os.getpid()}.tmp"
        try:
            with open(tmp, "w", encoding="utf-8") as fh:
                json.dump(record, fh, separators=(",", ":"))
            if keep_mtime:
                try:
                    old = os.stat(self._path)
                except FileNotFoundError:
                    pass
                else:
                    os.utime(tmp, ns=(old.st_atime_ns, old.st_mtime_ns))
            os.replace(tmp, self._path)
        except OSError:
            # A full or vanished state dir must not kill training; the agent sees a stale
            # heartbeat and judges for itself.
            pass


def ring(path: str | None) -> None:
    """Ring the agent's doorbell at ``path`` (a FIFO it reads): one byte, never blocking.
    No doorbell, no agent reading it (ENXIO) or a full pipe (it is already rung): nothing
    to do, the agent looks within its tick anyway."""
    if not path:
        return
    try:
        fd = os.open(path, os.O_WRONLY | os.O_NONBLOCK)
    except OSError:
        return
    try:
        os.write(fd, b"!")
    except OSError:
        pass
    finally:
        os.close(fd)


class Doorbell:
    """The agent's end of :func:`ring`: a FIFO at ``path`` that :meth:`wait` sleeps on.
    Where a FIFO cannot be made (a filesystem without them), :meth:`wait` is a plain
    sleep and workers get no doorbell (``path`` None)."""

    def __init__(self, path: str) -> None:
        self.path: str | None = None
        self._fds: tuple[int, int] | None = None
        made: list[int] = []
        try:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)
            os.mkfifo(path, 0o600)
            made.append(os.open(path, os.O_RDONLY | os.O_NONBLOCK))
            # Our own writer: the FIFO never reads as closed (EOF) between two workers' rings.
            made.append(os.open(path, os.O_WRONLY | os.O_NONBLOCK))
        except OSError:
            # Half made (out of descriptors at the second open): nothing of it is kept.
            for fd in made:
                with contextlib.suppress(OSError):
                    os.close(fd)
            with contextlib.suppress(OSError):
                os.unlink(path)
            return
        read, keep = made
        self.path, self._fds = path, (read, keep)
        self._poll = select.poll()  # not select(): no FD_SETSIZE limit on the descriptor
        self._poll.register(read, select.POLLIN)

    def wait(self, timeout: float) -> bool:
        """Sleep up to ``timeout`` seconds, less if rung; returns whether it was rung."""
        if self._fds is None:
            time.sleep(timeout)
            return False
        if not self._poll.poll(max(0.0, timeout) * 1000.0):
            return False
        with contextlib.suppress(OSError):  # drained: rings while we act are one wake-up
            while os.read(self._fds[0], 4096):
                pass
        return True

    def close(self) -> None:
        fds, self._fds = self._fds, None
        if fds is not None:
            for fd in fds:
                with contextlib.suppress(OSError):
                    os.close(fd)
        if self.path is not None:
            with contextlib.suppress(OSError):
                os.unlink(self.path)


def flag_device(backend: str) -> str:
    """Where a small flag tensor must live for a collective on a group of ``backend``
    (``dist.get_backend(group)``): ``"cpu"`` when the backend takes CPU tensors (gloo, or a
    per-device backend such as ``cpu:gloo,cuda:nccl``), ``"cuda"`` for NCCL alone, which
    raises on a CPU tensor."""
    parts = [p.strip() for p in backend.lower().split(",") if p.strip()]
    if any(p.startswith("cpu:") or p in ("gloo", "mpi", "ucc") for p in parts):
        return "cpu"
    return "cuda" if any(p.split(":")[-1] == "nccl" for p in parts) else "cpu"


def read_heartbeat(path: str) -> dict[str, Any] | None:
    """The agent's side: the last record a worker wrote, or None if none yet."""
    try:
        with open(path, encoding="utf-8") as fh:
            data = json.load(fh)
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None
