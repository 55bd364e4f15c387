"""In-process restart, the worker's side (``restart.mode: inprocess``; docs/inprocess.md).

Wrap the training function::

    import elasticd.inprocess as ei

    def train(ctx: ei.Context) -> None:
        model = ctx.state.get("model") or build_model()    # kept across rounds
        ctx.state["model"] = model
        step = ctx.sync_state(ei.state_tensors(model, opt), step=ctx.state.get("step"))
        ...                                                # ctx.rank, ctx.world_size,
        for step in range(step or 0, total):               # the default process group
            ...
            ctx.state["step"] = step + 1

    ei.run(train)

``run`` calls ``train`` once per round. When a round ends under it (a peer died or froze,
the world grows), the process is **not** restarted: ``train`` is left through an exception,
the round's process group is torn down, and ``train`` is called again for the next round
with a fresh process group; ``ctx.state`` (a plain dict) is what this process carries over.

The protocol with the agent, through two files in the agent's state dir:

- the **control file** (``ELASTICD_CONTROL_FILE``, one per node and job, written
  atomically by the agent): ``{"round": R, "state": "abort" | "run", "env": {local_rank:
  {...}}}``. ``abort`` ends round R; ``run`` starts round R with each local rank's new
  environment (RANK, WORLD_SIZE, MASTER_ADDR/PORT, ELASTICD_ROUND, ...). A watcher thread
  polls it every 10 ms (one ``stat``);
- the **heartbeat file** (``elasticd.worker``): the worker reports a failed collective
  there (``fault``), which the agent takes as evidence of a lost peer.

Leaving a blocked collective. A collective on a killed peer fails at once (its sockets
closed). One on a *frozen* peer would block until the process group's timeout, and gloo
(torch 2.13) has no abort. So the round's own sockets are shut down: every TCP connection
this process opened since the round began (the store client and the gloo pairs; never a
listening socket, never one from before the round) gets ``shutdown(SHUT_RDWR)``. Gloo's
pending reads then fail with "connection closed", the collective raises in the training
thread within milliseconds, and our peers' pairs with us fail the same way, so one
worker's abort frees every worker of the world. The file descriptors stay open (no
descriptor is reused under gloo's feet) until the process group is destroyed. A round can
end while it is still starting (the agent's abort right after its start): the watcher then
keeps shutting the round's new sockets until the worker has left it, a round already
ended when it would begin is left at once, and a wait for rank 0's store gives up on the
abort (that rank 0 may never open it). On NCCL the watcher first aborts the
communicators (a kernel blocked on a lost peer spins on the GPU until ``ncclCommAbort``),
and a value read back from an NCCL collective is trusted only if :func:`check_results`
finds the round still going (docs/inprocess.md, "In-process on NCCL").

Without a control file (plain torchrun, one process, ``restart.mode: process``) ``run``
calls ``train`` exactly once in a process group made from the torchrun environment.
"""

from __future__ import annotations

import atexit
import contextlib
import functools
import json
import logging
import os
import queue
import socket
import sys
import threading
import time
import weakref
from collections.abc import Callable, Mapping
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

from elasticd.sampler import ElasticBatchSampler, train_call
from elasticd.worker import (
    ENV_HEARTBEAT,
    PREEMPTED_EXIT_CODE,
    USER_ERROR_EXIT_CODE,
    WorkerChannel,
)

log = logging.getLogger("elasticd.inprocess")

ENV_CONTROL = "ELASTICD_CONTROL_FILE"
"""The node's control file for this job (set by the agent in ``inprocess`` mode)."""
ENV_MODE = "ELASTICD_RESTART_MODE"
"""``process`` or ``inprocess`` (the job's restart.mode)."""
ENV_WARM = "ELASTICD_WARM_AFTER"
"""Set by the agent on a *warm* worker, started before its round formed (in-process jobs
of the built-in trainer): the round after which its first round comes. The process
imports what it needs, then waits for the agent to hand it that round's environment
through the control file (:func:`first_round_env`)."""
ENV_WARM_READY = "ELASTICD_WARM_READY"
"""A warm worker creates this file once its imports are done (the agent of a node that is
joining waits for it before it asks the world to re-form)."""
STANDBY_LOCAL_RANK = -1
"""The ``LOCAL_RANK`` of a *standby*: a warm worker the agent keeps ready for no rank in
particular (``restart.standby``). A round that adopts it names it in the control file's
``pids`` (pid -> local rank, every kept process, every round), and it takes that rank."""
POLL = 0.01
"""Seconds between looks at the control file."""
MAX_FAILED_RECOVERIES = 3
"""Failed rounds in a row, counting the one that trained before its fault: after two
recoveries in a row that never reached a step the process exits (non-zero) and the agent
falls back to a process restart. One is not enough: a second event while the survivors
wait for a replacement (a newcomer, a peer lost meanwhile, the agent's re-form racing a
port) ends a recovery that would have worked, and a process restart there loses every
step since the last checkpoint. A round the agent ended for a reason that is no failure
(:data:`NOT_FAILURES`) is not counted."""
NOT_FAILURES = frozenset({"scale_up"})
"""The agent's reasons (its ``Outcome`` values, named in the control file's abort record)
for ending a round in which nothing failed: a node waiting to join. A recovery such a
round cut short is no failed one: a survivor alone in its world, cut short twice by
newcomers that join at their own pace, would otherwise give up its state for a process
restart (every step since the last checkpoint lost)."""
END_REASON_WAIT = 2.0
"""Seconds a worker whose round failed waits for the agent's record of the round's end (its
reason): its collective may fail on a peer's shut socket before its own agent has written
it. The agent writes it before it starts the next round, which the worker waits for
anyway; where it never comes (the agent stops the workers instead: a SIGTERM, or a
SIGKILL) the wait ends with that (:meth:`_Control.end_reason`)."""
ABORT_WATCHDOG = 10.0
"""Seconds an NCCL abort may take before the process gives up and exits."""
NCCL_INPROCESS_ENV = {"TORCH_NCCL_ASYNC_ERROR_HANDLING": "0", "TORCH_NCCL_DUMP_ON_TIMEOUT": "0"}
"""What :func:`run` sets for in-process rounds on NCCL: the dump unless the user set it,
the error handling whatever the user said (:data:`NCCL_FORCED`: a cluster image that
sets it for every job would turn each in-process recovery into a process exit). torch's
default error handling (3) ends the process on an NCCL error its watchdog sees (a killed
peer): the survivor's state would go with it. Handling 2 aborts the communicators
instead, but then a collective can end early, with garbage in its output, before the round
has ended, which :func:`check_results` cannot see. With 0, only the control watcher
aborts, after it has marked the round ended; the kernel waits on the lost peer until then
(the agent ends the round on its lease or its worker's exit). The flight recorder's dump on
an error is off too: a survivor has no use for it, and a dump under way is one more thing a
teardown could wait on. (On an H200, torch 2.11 and NCCL 2.28, the teardown of a killed
peer's round hung with either setting of both; :func:`_abort_nccl` is what fixed it.)"""
NCCL_FORCED = ("TORCH_NCCL_ASYNC_ERROR_HANDLING",)
"""Of :data:`NCCL_INPROCESS_ENV`, those an in-process round cannot leave to the user: any
other value of the error handling ends the survivor on a peer's death (1, 3) or aborts a
communicator before the round is marked ended, whose garbage :func:`check_results` then
passes (2: a corrupted step, handed to every peer by the recovery)."""


def set_nccl_inprocess_env(environ: Any) -> list[str]:
    """Set :data:`NCCL_INPROCESS_ENV` in ``environ`` for in-process rounds on NCCL, before
    the first group is made: a variable the user set stands, but those of
    :data:`NCCL_FORCED` are set whatever the user said; returns a line for each value
    overridden so (the worker's log says it)."""
    said = []
    for name, value in NCCL_INPROCESS_ENV.items():
        given = environ.get(name)
        if given is None:
            environ[name] = value
        elif name in NCCL_FORCED and given.strip() != value:
            environ[name] = value
            said.append(f"{name}={given} overridden to {value}: under in-process restart only "
                        "the round's end may abort an NCCL communicator (torch's own handling "
                        "ends the survivor, or leaves an aborted collective's garbage unseen)")  # fmt: skip
    return said


WAIT_SLICE = 0.1
"""Seconds one look of :func:`wait_collective` lasts before it asks whether its round ended
(a timed-out look costs one exception; a collective done sooner returns at once)."""
ABANDON_AFTER = 0.3
"""Seconds after its round ended that :func:`wait_collective`, :func:`wait_transfer` and
:func:`ddp_comm_hook`'s future give up a collective still pending. The socket abort fails a collective within milliseconds when gloo fails it at
all, so this only lets its own error (which names the cause) come first; a pending
collective is abandoned 0.3-0.4 s after the end. It was 1 s: in `bench/recovery.py --cases
inproc-move`, about one run in 20 abandons one, and those took 1.5-1.8 s instead of
0.6-0.8 s."""
WAITING_MARK = 1.0
"""Seconds a wait of :func:`wait_collective` or :func:`wait_transfer` lasts before the rank
tells its agent that it is waiting on its peers (``WorkerChannel.waiting``), and between
refreshes of that mark: a peer that hangs is then the one its agent kills, not this rank
(elasticd.agent.policy.WAITING_PATIENCE). Long enough that a step's ordinary waits (a
slower peer) write nothing. Only where these waits run: gloo groups of an in-process
round. On NCCL a rank blocks in a device synchronisation (``.item()``), unmarked."""
STUCK_EXIT = 10.0
"""Seconds a worker may stay in an ended round without using the CPU (every thread but
the control watcher) before it prints its stacks and exits (:data:`EXIT_RECOVERY_FAILED`;
its agent then replaces it). Its round's connections are shut by then, so nothing of the
round can complete: it is blocked for good on something gloo never fails (see
:func:`wait_collective`), in a synchronous collective the trainer cannot wait for in
slices. A worker still computing, or writing a checkpoint, uses the CPU and is left alone."""
IDLE_CPU = 0.1
"""CPU seconds (all threads but the watcher) under which a worker counts as not running."""
STILL_IN_ROUND = 5.0
"""Seconds after its round ended that a worker still in it logs every socket it holds
(once): where a worker does not leave an aborted round, that says which connection it
still waits on and whether it was shut."""
BLOCKED_LOOK = 0.25
"""Seconds between the watcher's looks at whether the main thread sits in a collective of
its own making (a script's DDP backward, a plain ``dist.all_reduce``): see
``_Control._mark_blocked``."""
STUCK_LOOK = 0.5
"""Seconds between the watcher's looks at whether a worker in an ended round is stuck."""
EXIT_RECOVERY_FAILED = 1


class RoundAborted(Exception):
    """The round ended under this worker (raised by :meth:`Context.check`)."""


class MisuseError(TypeError):
    """The script used this API in a way no retry fixes (a non-tensor handed over, a shard,
    state it trained on handed over as at no step). Under an agent (either
    ``restart.mode``), :func:`run` ends the process with the user-error exit code 2 and one
    line, so the job fails at once saying
    why; before, it exited 1 with a traceback and the agent restarted it until its
    ``restart.max_restarts`` were spent. A ``TypeError``, as these errors were before."""


class PeerPreempted(RoundAborted):
    """Raised by :meth:`Context.leave_for_preemption`: another node is being preempted,
    the step is saved, and this rank leaves the round with its state for the next one.
    :func:`run` takes it as the end of the round, not as a failure."""


@dataclass(kw_only=True)
class Context:
    """One round, as the training function sees it."""

    round: int
    """The rendezvous round (0 outside an agent)."""
    rank: int
    """This process's global rank in the round's world."""
    world_size: int
    """Ranks in the round's world."""
    local_rank: int
    """This process's rank on its node (stable across rounds)."""
    env: dict[str, str]
    """The round's environment (also installed in ``os.environ``)."""
    state: dict[str, Any]
    """What this process carries from round to round (empty in a fresh process)."""
    rounds_lived: int = 0
    """Earlier rounds this process took part in (0: a fresh process, a newcomer)."""
    store: Any = None
    """The round's store (a PrefixStore unique to the run and round)."""
    _control: _Control | None = field(default=None, repr=False)
    _channel: WorkerChannel | None = field(default=None, repr=False)

    @property
    def inprocess(self) -> bool:
        """Whether a failure is recovered in this process (else the process restarts)."""
        return self._control is not None

    @property
    def layout(self) -> Any:
        """The agent's plan for this round (``elasticd.layout.Layout``), or None."""
        path = self.env.get("ELASTICD_LAYOUT")
        if not path:
            return None
        from elasticd.layout import Layout

        with open(path, encoding="utf-8") as fh:
            return Layout.from_dict(json.load(fh))

    @property
    def channel(self) -> WorkerChannel:
        """This round's line to the agent (heartbeat, phases, preemption). Use this one:
        a second channel on the same heartbeat file would overwrite its phases."""
        if self._control is not None:
            return self._control.channel
        if self._channel is None:
            self._channel = WorkerChannel.from_env(self.env)
        return self._channel

    def aborted(self) -> bool:
        """Whether the agent ended this round (cheap; call it as often as you like)."""
        return self._control is not None and self._control.aborted(self.round)

    def check(self) -> None:
        """Raise :class:`RoundAborted` if this round has ended (call once per step)."""
        if self.aborted():
            raise RoundAborted(f"round {self.round} ended")

    def mark(self, phase: str) -> None:
        """Tell the agent a phase of this round ended (``pg_ready``, ``state_loaded``)."""
        self.channel.mark(phase)

    def leave_for_preemption(self) -> None:
        """Every rank agreed to stop for a preemption (``WorkerChannel.preempt_agreed``)
        and saved the step. If the node being preempted is another one (this worker was
        not told to stop), leave this round with this process's state and take the next
        one, without that node: raises :class:`PeerPreempted`. Otherwise (this node is
        going, or no in-process restart) it returns, and the caller exits with
        ``PREEMPTED_EXIT_CODE`` as before."""
        if self._control is None or self.channel.preempt_requested():
            return
        raise PeerPreempted(f"round {self.round}: a peer node is being preempted")

    def sync_state(self, tensors: Mapping[str, Any], *, step: int | None) -> int | None:
        """Make every rank's ``tensors`` (whole, data-parallel-replicated tensors: a DDP
        model's and optimizer's, as :func:`state_tensors` names them) equal to those of a
        rank at the newest step, and return that step. ``step`` is None in a process that
        holds nothing yet (a newcomer, or the first round): it receives. None if no rank
        holds anything (start fresh).

        Given :func:`state_tensors`' result, a rank that lacks optimizer state the holders
        have (a newcomer, before its first step) is given it first, as the holders' dtype
        and shape, and the numbers carried with the tensors (learning rates, a scheduler's
        position, a loss scale) are put back where they live once the tensors arrived.

        Transfers go rank to rank over a gloo group, CRC-checked (``checkpoint.live``).
        Raises ``RuntimeError`` when the holders disagree on shapes or a transfer fails
        its check; the round is then failed and the agent falls back."""
        import torch
        import torch.distributed as dist

        from checkpoint.live import recover_from_peers
        from checkpoint.shards import ShardInfo

        for name, t in tensors.items():  # before any collective: every rank alike
            if not torch.is_tensor(t):
                raise MisuseError(
                    f"sync_state: {name!r} is {type(t).__name__}, not a tensor: hand over "
                    "tensors; a number through StateTensors.carry_number, an object with "
                    "state_dict() as one of state_tensors' others"
                )
            refuse_sharded("sync_state", name, t)
        trained = getattr(self._control, "trained_step", None)
        if self._control is not None and self.channel.reported_step():
            trained = self.channel.last_step
        if step is None and trained is not None:
            # It trained (it reported steps), so it holds state at a step; handed over as
            # at none, nothing would move, and a newcomer would train on from its own.
            raise MisuseError(
                f"sync_state: step=None, but this process trained to step "
                f"{trained} and holds its state: pass the step its tensors "
                "are at (keep it in ctx.state after each step, as examples/ddp_inprocess.py "
                "does); None is for a process that holds nothing yet"
            )
        # The newest step, (as max of it and of its negation) whether every rank hands
        # over the same names, dtypes and shapes, and whether any rank holds state it kept
        # from an earlier round (in its memory): all in the same all-reduce.
        sig = _layout_signature(tensors)
        kept = int(step is not None and self.rounds_lived > 0)
        newest = torch.tensor([-1 if step is None else int(step), sig, -sig, kept],
                              dtype=torch.int64)  # fmt: skip
        group = transfer_group()
        # The transfer's own description gather carries every step too, but its waits are
        # unbounded: this bounded one (wait_collective) leaves a peer frozen before the
        # transfer within the bound, so the round still ends in-process.
        if dist.is_initialized():
            work = dist.all_reduce(newest, op=dist.ReduceOp.MAX, group=group, async_op=True)
            wait_collective(work, group)
        if int(newest[0]) < 0:
            # Nobody holds state (the first round): nothing moves, but ranks that hand
            # over different tensors would fail only at the first recovery, the worst
            # moment; a newcomer's missing optimizer state cannot be the cause here.
            if int(newest[1]) != -int(newest[2]):
                _refuse_unlike(tensors, group)
            return None
        from_memory = int(newest[3]) > 0
        newest = newest[:1]
        # Judged by restart.hang_timeout from here until state_loaded, as a step is
        # (elasticd.agent.workers.recovering): a rank stopped in the transfer is killed.
        self.channel.mark("recovering")
        self.channel.phase("recover", int(newest))  # a fault planned there fires (faultplan)
        held = None
        if isinstance(tensors, StateTensors):
            tensors.complete(step, group)
            held = tensors.held
        # Detached: a Parameter given as it is would refuse the in-place writes.
        boxes = {name: (t.detach(), ShardInfo.whole(name, tuple(t.shape)))
                 for name, t in tensors.items()}  # fmt: skip
        # Offered: what was held before complete() made anything (made ones are zeros).
        have = boxes if held is None else {k: v for k, v in boxes.items() if k in held}
        why: list[str] = []
        unchecked = tensors.unchecked if isinstance(tensors, StateTensors) else set()
        result = recover_from_peers(
            have=have if step is not None else None, have_step=step,
            have_consumed=0 if step is not None else None, need=boxes, group=group,
            refused=why.append,
            # Every rank has arrived and the plan is made: the hang bound counts from here.
            before_write=lambda _step: self.channel.mark("recovering"),
            # Claimed whole and replicated: a key is sent only where its holders agree.
            digests={k: _digest(t) for k, (t, _info) in have.items() if k not in unchecked}
            if step is not None else None,
        )  # fmt: skip
        if result is None:
            raise RuntimeError(
                "in-process recovery: the survivors' state could not be agreed: "
                + ("; ".join(why) or "no reason given")
            )
        if isinstance(tensors, StateTensors):
            tensors.put_back()
        # What the agent records of this recovery (source, lost steps): the step every
        # rank now holds against the newest any survivor held. Only when some rank kept
        # its state from an earlier round: in a world of fresh processes (a process
        # restart) the state held came from what each loaded itself (the script's own
        # checkpoint, which it reports with channel.recovered(source="checkpoint")), and
        # "peers" would make a process restart an in-process recovery in the records.
        if from_memory:
            self.channel.recovered(source="peers", resume_step=result.step,
                                  lost_steps=max(0, int(newest) - result.step))  # fmt: skip
        self.mark("state_loaded")
        return result.step


def _describe_layout(tensors: Mapping[str, Any]) -> list[tuple[str, str, tuple[int, ...]]]:
    return sorted(
        (n, str(t.dtype).removeprefix("torch."), tuple(t.shape)) for n, t in tensors.items()
    )


def _layout_signature(tensors: Mapping[str, Any]) -> int:
    """62 bits of a hash of the names, dtypes and shapes handed over (alike on every rank
    of a script that builds the same state everywhere)."""
    import hashlib

    text = repr(_describe_layout(tensors)).encode()
    return int.from_bytes(hashlib.blake2b(text, digest_size=8).digest(), "little") >> 2


def _refuse_unlike(tensors: Mapping[str, Any], group: Any) -> None:
    """The ranks' tensors differ (their signatures did): gather what each holds and name
    the first difference, on every rank alike. A script's bug no retry fixes."""
    import torch.distributed as dist

    mine = _describe_layout(tensors)
    every: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(every, mine, group=group)
    first = dict((n, (d, s)) for n, d, s in every[0])
    for rank, theirs in enumerate(every[1:], start=1):
        other = dict((n, (d, s)) for n, d, s in theirs)
        for name in sorted(set(first) | set(other)):
            a, b = first.get(name), other.get(name)
            if a != b:
                say = lambda h: "nothing" if h is None else f"{h[0]} {list(h[1])}"  # noqa: E731
                raise MisuseError(
                    f"sync_state: the ranks hand over different tensors: {name}: rank 0 "
                    f"holds {say(a)}, rank {rank} holds {say(b)}; every rank must build "
                    "the same state (a recovery could not agree on it)"
                )


class GeneratorSnapshot:
    """A random generator's state as of the end of the last completed step, to hand over
    as one of :func:`state_tensors`' ``others`` (keep it in ``ctx.state``)::

        rng = ctx.state.setdefault("rng", ei.GeneratorSnapshot())  # torch's default one
        step = ctx.sync_state(ei.state_tensors(model, opt, sched, rng), step=...) or 0
        ...  # each step draws dropout masks, a shuffle, ... from the generator
        rng.take()  # after the optimizer's step

    After the sync every rank's generator is set to the snapshot of a rank at the newest
    step: a survivor's drops what the interrupted step drew, and a newcomer draws as the
    others do, so the next steps' masks equal an uninterrupted run's. A generator given
    as it is (``state_tensors(model, opt, gen)``) is handed over as it stands, mid-step,
    and the run's later draws differ from an uninterrupted one's.

    Without ``generator``: torch's default CPU generator and, in a process that uses CUDA
    (CUDA initialised, or the default process group on NCCL), the current device's default
    CUDA generator too: dropout on a GPU draws from that one, not the CPU's. Make it once
    the device is current (``ei.run`` makes it so before ``train``). A CPU job on a
    machine with GPUs leaves CUDA alone."""

    def __init__(self, generator: Any = None) -> None:
        import torch

        if generator is None:
            self.generators = [torch.default_generator]
            if _uses_cuda():
                self.generators.append(torch.cuda.default_generators[torch.cuda.current_device()])
        else:
            self.generators = [generator]
        self.generator = self.generators[0]
        self._states = [g.get_state() for g in self.generators]  # copies

    def take(self) -> None:
        """Keep the generators' states now: call it at the end of each step."""
        self._states = [g.get_state() for g in self.generators]

    def state_dict(self) -> dict[str, Any]:
        out = {"state": self._states[0]}
        out.update({f"state{i}": s for i, s in enumerate(self._states[1:], 1)})
        return out

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self._states = [state["state"].clone()]
        self._states += [state[f"state{i}"].clone() for i in range(1, len(self.generators))]
        for g, s in zip(self.generators, self._states, strict=True):
            g.set_state(s)


def _uses_cuda() -> bool:
    """Whether this process computes on CUDA: CUDA initialised, or an NCCL default group."""
    import torch

    if not torch.cuda.is_available():
        return False
    if torch.cuda.is_initialized():
        return True
    import torch.distributed as dist

    return dist.is_initialized() and "nccl" in str(dist.get_backend())


class StateTensors(dict):
    """What :func:`state_tensors` returns: name -> tensor, plus what
    :meth:`Context.sync_state` needs beyond the tensors: how to give a rank the optimizer
    state it lacks (:meth:`complete`), and how to put carried numbers back where they
    live (:meth:`put_back`). A plain dict of tensors works too, without either."""

    def __init__(self) -> None:
        super().__init__()
        self._makers: dict[str, Callable[[str, tuple[int, ...], Any, bool], Any]] = {}
        """Name prefix (up to the last ``/``) -> maker(rest of the name, shape, dtype, on
        the device) of a tensor under it that this rank lacks: optimizer state, which the
        optimizer creates lazily."""
        self._put_back: list[Callable[[], None]] = []
        self.unchecked: set[str] = set()
        """Names whose holders may hold them differently, so not compared between holders
        (a module's buffers: BatchNorm's running statistics follow each rank's batches
        between DDP's broadcasts); a rank that lacks one takes any holder's."""
        self.held: frozenset[str] = frozenset()
        """The names this rank held before :meth:`complete` made any: only those are
        offered to the others (a made tensor is zeros until the transfer fills it)."""

    def carry_number(self, name: str, value: int | float, write: Callable[[Any], None]) -> None:
        """Carry a Python number as ``name#n`` (:func:`_encode_number`); ``write`` gets it
        back, as the holder's type (int or float), after the sync. An int outside int64 is
        left as each rank has it."""
        t = _encode_number(value)
        if t is None:
            return
        self[f"{name}#n"] = t
        self._put_back.append(lambda: write(_decode_number(t)))

    def _maker_of(self, name: str) -> str | None:
        prefix = name.rpartition("/")[0] + "/"
        return prefix if prefix in self._makers else None

    def complete(self, step: int | None, group: Any) -> None:
        """Collective: create what the ranks at the newest step hold under a maker's
        prefix and this rank lacks (a newcomer's optimizer state before its first step).
        Raises ``RuntimeError`` on every rank alike when a rank lacks a name the holders
        have that no maker covers (state the sync could not give it: it would train on
        without it)."""
        import torch
        import torch.distributed as dist

        from checkpoint.live import gather_compressed

        self.held = frozenset(self)
        names = {name: [list(t.shape), str(t.dtype).removeprefix("torch."), t.device.type == "cpu"]
                 for name, t in self.items()}  # fmt: skip
        desc = {"step": step, "names": names}
        descs = gather_compressed(desc, group) if dist.is_initialized() else [desc]
        newest = max((d["step"] for d in descs if d["step"] is not None), default=None)
        wanted: dict[str, list[Any]] = {}
        for d in descs:
            if d["step"] is not None and d["step"] == newest:
                wanted.update(d["names"])
        distinct = {id(d): d for d in descs}.values()  # replicas' are one parsed object
        lacking = sorted({n for d in distinct for n in wanted.keys() - d["names"].keys()
                          if self._maker_of(n) is None})  # fmt: skip
        if lacking:  # the same on every rank: decided from the same descriptions
            items = [n for n in lacking if _has_list_item(n)]
            why = (
                "a list in a state_dict() whose length differs between ranks, such as a "
                "history that grows each step? Its items travel one by one: keep it out of "
                "the state handed over, or hand it over as a tensor of a fixed size"
                if items
                else "state created lazily outside the optimizer given to state_tensors?"
            )
            raise RuntimeError(
                f"in-process recovery: {len(lacking)} tensor(s) the ranks at step {newest} hold "
                f"are missing on another rank and cannot be made there ({why}): "
                f"{', '.join(lacking[:5])}"
            )
        for name in sorted(wanted.keys() - self.keys()):
            prefix = self._maker_of(name)
            if prefix is None:
                continue
            shape, dtype, on_cpu = wanted[name]
            made = self._makers[prefix](name[len(prefix) :], tuple(shape),
                                        getattr(torch, dtype), not on_cpu)  # fmt: skip
            if made is not None:
                self[name] = made

    def put_back(self) -> None:
        """Write the carried numbers back (after a sync every rank holds the newest)."""
        for write in self._put_back:
            write()


_INT64 = (-(2**63), 2**63 - 1)


def _has_list_item(name: str) -> bool:
    """Whether a carried name goes through a list's item (a number in its path, past the
    ``other/<i>``, ``param_groups/<g>`` and ``params/<p>`` that such names have)."""
    parts = name.split("/")
    if parts[:1] == ["other"]:
        parts = parts[2:]
    if parts[:2] == ["optim", "param_groups"] or parts[:1] == ["param_groups"]:
        parts = parts[parts.index("param_groups") + 2 :]
        if parts[:1] == ["params"]:  # a parameter the optimizer trains, by its place
            parts = parts[2:]
    return any(p.split("#")[0].isdigit() for p in parts)


def _encode_number(value: int | float) -> Any:
    """A Python number as an int64 tensor [kind, bits]: kind 1 an int (bits: its value),
    0 a float (bits: its IEEE 754 double's), so both travel exactly, and the name does not
    depend on the type (a learning rate 1 is an int until a scheduler makes it 0.5). None
    for an int outside int64."""
    import struct

    import torch

    if isinstance(value, int):
        if not _INT64[0] <= value <= _INT64[1]:
            return None
        return torch.tensor([1, value], dtype=torch.int64)
    (bits,) = struct.unpack("<q", struct.pack("<d", float(value)))
    return torch.tensor([0, bits], dtype=torch.int64)


def _decode_number(t: Any) -> int | float:
    import struct

    kind, bits = (int(v) for v in t.tolist())
    if kind == 1:
        return bits
    return struct.unpack("<d", struct.pack("<q", bits))[0]


def _is_number(v: Any) -> bool:
    return isinstance(v, int | float) and not isinstance(v, bool)


def _carry_leaves(out: StateTensors, name: str, value: Any, write: Callable[[Any], None]) -> None:
    """Carry ``value``'s tensors and numbers (nested in dicts, lists and tuples) under
    ``name``; ``write`` takes the rebuilt value back after the sync. Anything else (strings,
    callables, None) stays as this rank has it."""
    import torch

    if torch.is_tensor(value):
        out[name] = value.detach()
        return
    if _is_number(value):
        out.carry_number(name, value, write)
        return
    if isinstance(value, dict):
        for k, v in value.items():
            _carry_leaves(out, f"{name}/{k}", v, _setter(value, k))
    elif isinstance(value, list):
        for i, v in enumerate(value):
            _carry_leaves(out, f"{name}/{i}", v, _setter(value, i))
    elif isinstance(value, tuple) and any(_is_number(v) or torch.is_tensor(v) for v in value):
        items = list(value)
        for i, v in enumerate(items):
            _carry_leaves(out, f"{name}/{i}", v, _setter(items, i))
        make = getattr(type(value), "_make", type(value))  # a namedtuple takes an iterable so
        out._put_back.append(lambda: write(make(items)))  # after the items' writes


def _setter(container: Any, key: Any) -> Callable[[Any], None]:
    def write(v: Any) -> None:
        container[key] = v

    return write


def refuse_sharded(where: str, name: str, t: Any) -> None:
    """A ``DTensor`` (FSDP2's parameters and their optimizer state, a tensor-parallel
    module's) is one shard of a tensor on a mesh of the round that made it: synced as a
    whole tensor, the survivors would keep shards of a mesh that is gone and a newcomer
    would get another rank's. Refused in one line, naming what works instead."""
    if not any(c.__name__ == "DTensor" for c in type(t).__mro__):  # a subclass too
        return
    mesh = getattr(t, "device_mesh", None)
    raise MisuseError(
        f"{where}: {name!r} is a DTensor ({getattr(t, 'placements', '?')} on a mesh of "
        f"{getattr(mesh, 'size', lambda: '?')()} ranks), a shard: only whole, replicated "
        "tensors are synced from peers. Hand over full tensors (torch.distributed.checkpoint"
        ".state_dict.get_state_dict(..., options=StateDictOptions(full_state_dict=True))) "
        'or resume from a checkpoint (docs/inprocess.md, "Sharded state")'
    )


_MIX = 0x5851F42D4C957F2D
"""An odd 63-bit multiplier (PCG's): the digest's words are mixed by their place."""


def _digest(t: Any) -> int:
    """A digest of a tensor's bytes, for telling holders apart (not against an adversary).
    On the CPU their CRC-32C (below 2^32). On a device, computed there (no copy of the
    state to the host): the bytes as int64 words, each XORed with a multiple of its place
    and multiplied by an odd constant, summed with wrap-around (integer arithmetic: the
    same on every device), kept in [2^62, 2^63) so the two kinds are never compared
    (``checkpoint.live.digest_on_device``)."""
    import crc32c
    import torch

    raw = t.detach().resolve_conj().resolve_neg().contiguous().reshape(-1).view(torch.uint8)
    if raw.device.type == "cpu":
        return crc32c.crc32c(raw.numpy())
    return _device_digest(raw)


DIGEST_CHUNK = 64 << 20
"""Bytes a device digest works on at a time (a multiple of 8): its temporaries (an aligned
copy, the places, the mixed words) stay a few of these, not several copies of a large
tensor, in a recovery, when memory is tightest."""


def _device_digest(raw: Any, chunk: int = DIGEST_CHUNK) -> int:
    """:func:`_digest` of the bytes ``raw`` (a uint8 tensor) where they are: chunk by
    chunk, the partial sums added on the device, one read back at the end."""
    import torch

    n = raw.numel()
    total = torch.zeros((), dtype=torch.int64, device=raw.device)
    for at in range(0, n, chunk):
        part = raw[at : at + chunk]
        words = torch.zeros(-(-part.numel() // 8) * 8, dtype=torch.uint8, device=raw.device)
        words[: part.numel()] = part
        w = words.view(torch.int64)
        first = at // 8 + 1
        place = torch.arange(first, first + w.numel(), dtype=torch.int64, device=w.device) * _MIX
        total += (torch.bitwise_xor(w, place) * _MIX).sum()
    value = int(total) ^ n
    return (value & ((1 << 62) - 1)) | (1 << 62)


def state_tensors(model: Any, optimizer: Any = None, *others: Any) -> StateTensors:
    """What a data-parallel script's ranks must hold alike, by name, for
    :meth:`Context.sync_state`:

    - the model's parameters and tensor buffers (``model/<name>``; a module's non-tensor
      extra state stays as each rank has it);
    - the optimizer's per-parameter state, whatever the optimizer keeps (``optim/<param
      name>/<key>``; a parameter not in ``model`` is named by its place in
      ``param_groups``, and carried itself too). A rank without it (a newcomer, before
      its first step) is given it in the sync, as the ranks at the newest step hold it;
    - the numbers of the optimizer's ``param_groups`` (the learning rate a scheduler set,
      betas, weight decay);
    - for each of ``others``: another optimizer, as the first (``other/<i>/...``); a
      ``torch.Generator`` (a sampler's, a dropout's), its state, set back after the sync;
      else (an LR scheduler, a ``GradScaler``, anything with ``state_dict()`` and
      ``load_state_dict()``) the tensors and numbers of its state dict, loaded back after
      the sync. State such an object creates lazily must exist on every rank: a rank
      lacking a tensor the holders have fails the sync on every rank, in one message.
      Anything else is refused with a ``TypeError`` naming it.

    The model's gradients are dropped (set to None): at the start of a round they are
    those of the step the fault interrupted, partly reduced, or absent on a newcomer."""
    import torch

    out = StateTensors()
    for p in model.parameters():
        p.grad = None
    buffers = {id(b) for b in model.buffers()}
    for name, t in model.state_dict(keep_vars=True).items():
        if torch.is_tensor(t):
            refuse_sharded("state_tensors", f"model/{name}", t)
            out[f"model/{name}"] = t.detach()
            if id(t) in buffers:
                out.unchecked.add(f"model/{name}")
    names = {id(p): n for n, p in model.named_parameters()}
    if optimizer is not None:
        _optimizer_state(out, names, optimizer, "optim")
    for i, obj in enumerate(others):
        if isinstance(obj, torch.optim.Optimizer):
            _optimizer_state(out, names, obj, f"other/{i}")
            continue
        if isinstance(obj, torch.Generator):
            rng = out[f"other/{i}/rng_state"] = obj.get_state()  # a copy, filled in place
            out._put_back.append(lambda obj=obj, rng=rng: obj.set_state(rng))
            continue
        if not (callable(getattr(obj, "state_dict", None))
                and callable(getattr(obj, "load_state_dict", None))):  # fmt: skip
            raise MisuseError(
                f"state_tensors: other {i} is {type(obj).__name__}: neither an optimizer, a "
                "torch.Generator, nor an object with state_dict() and load_state_dict()"
            )
        sd = obj.state_dict()
        _carry_leaves(out, f"other/{i}", sd, lambda _v: None)
        out._put_back.append(lambda obj=obj, sd=sd: obj.load_state_dict(sd))  # after its leaves
    return out


def _optimizer_state(out: StateTensors, names: dict[int, str], optimizer: Any, top: str) -> None:
    import torch

    for gi, group in enumerate(optimizer.param_groups):
        for pi, p in enumerate(group["params"]):
            p.grad = None
            pname = names.get(id(p))
            if pname is None:  # trained, yet not the model's: carried itself too
                pname = f"param_groups/{gi}/params/{pi}"
                refuse_sharded("state_tensors", f"{top}/{pname}", p)
                out[f"{top}/{pname}"] = p.detach()
            st = optimizer.state[p]
            for key, value in st.items():
                if torch.is_tensor(value):
                    refuse_sharded("state_tensors", f"{top}/{pname}/{key}", value)
                    out[f"{top}/{pname}/{key}"] = value
                elif _is_number(value):
                    out.carry_number(f"{top}/{pname}/{key}", value, _setter(st, key))
            out._makers[f"{top}/{pname}/"] = functools.partial(_make_state, out, st, p)
        for key, value in group.items():
            if key != "params":
                _carry_leaves(out, f"{top}/param_groups/{gi}/{key}", value, _setter(group, key))


def _make_state(out: StateTensors, st: dict, p: Any, key: str, shape: tuple[int, ...],
                dtype: Any, on_device: bool) -> Any:  # fmt: skip
    """A missing optimizer state entry ``key`` of parameter ``p`` (state ``st``), as the
    holders have it: a tensor on ``p``'s device (or the CPU, as Adam keeps its ``step``),
    or a number (``key`` ends in ``#n``) written back after the sync."""
    import torch

    if key.endswith("#n"):
        key = key[: -len("#n")]
        t = torch.zeros(2, dtype=torch.int64)
        out._put_back.append(lambda: st.__setitem__(key, _decode_number(t)))
        return t
    t = torch.zeros(shape, dtype=dtype, device=p.device if on_device else "cpu")
    st[key] = t
    return t


def transfer_group() -> Any:
    """The group state moves over: the default one on gloo, else a gloo group of all."""
    import torch.distributed as dist

    if not dist.is_initialized():
        return None
    if dist.get_backend() == "gloo":
        return None
    return dist.new_group(backend="gloo")


# -- sockets ----------------------------------------------------------------------------------


def _socket_fds() -> dict[int, int]:
    """This process's socket file descriptors -> inode."""
    out = {}
    try:
        fds = os.listdir("/proc/self/fd")
    except OSError:
        return out
    for fd in fds:
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if target.startswith("socket:["):
            out[int(fd)] = int(target[8:-1])
    return out


def _tcp_inodes() -> tuple[set[int], set[int]]:
    """Inodes of TCP sockets not in LISTEN state, and of listeners (a listener shut down
    makes gloo's accept loop abort the process)."""
    connected, listening = set(), set()
    for inode, (state, _, _) in _tcp_table().items():
        (listening if state == "0A" else connected).add(inode)
    return connected, listening


def _tcp_table() -> dict[int, tuple[str, str, str]]:
    """Inode -> (state, local, remote) of every TCP socket in the namespace (hex as
    /proc has them; ports are the last 4 hex digits)."""
    out = {}
    for path in ("/proc/self/net/tcp", "/proc/self/net/tcp6"):
        try:
            with open(path, encoding="ascii") as fh:
                next(fh, None)
                for line in fh:
                    cols = line.split()
                    if len(cols) > 9:
                        out[int(cols[9])] = (cols[3], cols[1], cols[2])
        except OSError:
            continue
    return out


_WAITS_IN = tuple(os.sep + os.path.join("torch", p) + os.sep for p in ("distributed", "autograd"))
"""Where a main thread blocked in a collective is (its innermost Python frame): in
``torch.distributed``, or in the autograd engine (DDP's reducer waits for its gradient
all-reduces there, in C++; on CPU the engine runs backward on the calling thread, so an
idle one is waiting on a collective)."""
_OURS = tuple(os.sep + p + os.sep for p in ("trainer", "checkpoint", "elasticd"))


def _main_in_collective() -> bool:
    """Whether the main thread's innermost Python frame is in a collective: a call into
    ``torch.distributed`` (a synchronous collective, a store) or the autograd engine (a
    DDP backward), or a line of ours that waits for a work (``.wait(``, such as a
    pipeline's receive). Not in a thread pool's ``result()``, a sleep, or a user's own
    waiting."""
    frame = sys._current_frames().get(threading.main_thread().ident)
    if frame is None:
        return False
    name = frame.f_code.co_filename
    if any(p in name for p in _WAITS_IN):
        return True
    if not any(p in name for p in _OURS):
        return False
    import linecache

    return ".wait(" in linecache.getline(name, frame.f_lineno)


def _waiting_on_io() -> bool:
    """Whether a thread of this process is in uninterruptible sleep (state D: disk I/O,
    such as the fsync of a checkpoint on slow storage), which uses no CPU but returns."""
    try:
        tids = os.listdir("/proc/self/task")
    except OSError:
        return False
    for tid in tids:
        try:
            with open(f"/proc/self/task/{tid}/stat", encoding="ascii", errors="replace") as fh:
                text = fh.read()
        except OSError:
            continue
        if text[text.rfind(")") + 2 : text.rfind(")") + 3] == "D":
            return True
    return False


def describe_sockets(before: set[int], handled: set[int]) -> str:
    """One line naming every socket this process holds: fd, inode, whether it predates the
    round (old), was shut (shut) or is new and not shut (NEW), its TCP state and ports."""
    table = _tcp_table()
    parts = []
    for fd, inode in sorted(_socket_fds().items()):
        tag = "old" if inode in before else "shut" if inode in handled else "NEW"
        st, local, remote = table.get(inode, ("-", ":0", ":0"))
        lport, rport = int(local.rsplit(":", 1)[1], 16), int(remote.rsplit(":", 1)[1], 16)
        parts.append(f"{fd}:{inode}:{tag}:st{st}:{lport}->{rport}")
    return " ".join(parts) or "none"


def shutdown_new_sockets(before: set[int]) -> int:
    """Shut down (not close) every connected TCP socket whose inode is not in ``before``;
    returns how many."""
    return len(_shutdown_new(before)[0])


def _shutdown_new(before: set[int]) -> tuple[set[int], set[int]]:
    """:func:`shutdown_new_sockets`: the inodes it shut, and those of new listeners (left
    alone; a caller passes both back in ``before`` next time). A socket still connecting
    when ``/proc`` was read is not among them (a later call shuts it)."""
    new = {fd: inode for fd, inode in _socket_fds().items() if inode not in before}
    if not new:  # the usual case while a worker leaves an aborted round: nothing to read
        return set(), set()
    tcp, listening = _tcp_inodes()  # the whole network namespace's table: only when needed
    done = set()
    for fd, inode in new.items():
        if inode not in tcp:
            continue
        try:
            if os.fstat(fd).st_ino != inode:
                continue  # closed and its number reused since /proc was read
            s = socket.socket(fileno=fd)
        except OSError:
            continue
        try:
            s.shutdown(socket.SHUT_RDWR)
            done.add(inode)
        except OSError:
            pass
        finally:
            s.detach()
    return done, listening & set(new.values())


# -- the control file --------------------------------------------------------------------------


class _Control:
    """This process's view of its agent's control file, kept fresh by a watcher thread."""

    def __init__(self, path: str, local_rank: int, env: Mapping[str, str]) -> None:
        self.path = path
        self.local_rank = local_rank
        self.cond = threading.Condition()
        self.record: dict[str, Any] = {}
        self.round = int(env.get("ELASTICD_ROUND", "0") or 0)
        self.ended: set[int] = set()
        self._before: set[int] = set()
        self._handled: set[int] = set()
        """This round's sockets already shut, and its listeners (never shut)."""
        self._told: set[int] = set()
        """Rounds whose end this process has logged."""
        self._ended_at: dict[int, float] = {}
        self._end_reasons: dict[int, str] = {}
        """The reason of each round the agent ended with an abort record that named one."""
        self._described: set[int] = set()
        """Rounds this process was still in STILL_IN_ROUND after their end (logged once)."""
        self._nccl_look = 0.0
        self._idle_since: tuple[int, float, float] | None = None
        """(round, when, CPU seconds of the other threads) at the start of an idle stretch."""
        self._last_look = 0.0
        self._blocked: tuple[int, float, float] | None = None
        """(round, when, CPU seconds of the other threads) at the start of a stretch in which
        the main thread sat idle in a collective (``_mark_blocked``)."""
        self._blocked_look = 0.0
        self.waits = 0
        """Waits of :func:`wait_collective` and :func:`wait_transfer` under way: they mark
        their own waiting, and the watcher leaves the mark to them."""
        self._begun = False
        self.aborted_at: float | None = None
        self._sig: tuple[int, int, int] | None = None
        self.channel = WorkerChannel.from_env(env)
        self.trained_step: int | None = None
        """The last step this process trained in an earlier round (its channel reported a
        step past the one the round resumed at); None: it trained none."""
        self._pending: set[_Pending] = set()
        """Works of :meth:`abandonable` not yet settled (under ``_pending_lock``, never
        ``cond``: the waiter's thread settles them)."""
        self._pending_lock = threading.Lock()
        self._waiter: _CollectiveWaiter | None = None
        """The thread that waits for :meth:`abandonable`'s works (a new one after an
        abandonment)."""
        self._stop = threading.Event()
        self._read()
        threading.Thread(target=self._watch, name="elasticd-control", daemon=True).start()

    def _read(self) -> None:
        try:
            st = os.stat(self.path)
        except OSError:
            return
        sig = (st.st_ino, st.st_mtime_ns, st.st_size)  # each write is a new file (rename)
        if sig == self._sig:
            return
        try:
            with open(self.path, encoding="utf-8") as fh:
                record = json.load(fh)
        except (OSError, ValueError):
            return  # mid-replace cannot happen (atomic), but a bad file must not kill us
        self._sig = sig
        if not isinstance(record, dict):
            return
        with self.cond:
            self.record = record
            r = int(record.get("round", 0))
            if record.get("state") == "abort":
                self.ended.add(r)
                if record.get("reason"):
                    self._end_reasons[r] = str(record["reason"])
            try:  # the reasons of the rounds before, for an abort record this one replaced
                for k, v in dict(record.get("ended") or {}).items():
                    self._end_reasons.setdefault(int(k), str(v))
            except (TypeError, ValueError):
                pass
            # A newer round than ours means ours is over, whatever state it names.
            for old in range(self.round, r + (1 if record.get("state") == "abort" else 0)):
                self.ended.add(old)
            now = time.monotonic()
            for old in self.ended:
                self._ended_at.setdefault(old, now)
            self.cond.notify_all()
            current = self.round
        if current in self.ended:
            self.abort_sockets(current)

    def close(self) -> None:
        """Stop watching (within one poll). A worker's watcher lives as long as it does;
        this is for a process that makes several, such as a test's."""
        self._stop.set()
        with self.cond:
            self._begun = False

    def _watch(self) -> None:
        while not self._stop.is_set():
            try:
                self._read()
                # Until we leave an aborted round, keep shutting its new sockets: a store or
                # a pair opened just after the abort was read (the round was still starting)
                # would otherwise wait for peers that left, for the whole group timeout.
                self._abort_late_sockets()
                self._mark_blocked()
            except Exception:  # the watcher must outlive any one bad look (a closed stderr)
                log.debug("control watcher: a look failed", exc_info=True)
            try:  # on its own: a failed look above must not leave DDP waiting
                self._abandon_pending()
            except Exception:
                log.debug("control watcher: abandoning pending works failed", exc_info=True)
            time.sleep(POLL)

    def _mark_blocked(self) -> None:
        """Say ``waiting`` for a main thread that has sat idle for :data:`WAITING_MARK`
        seconds in a collective it called itself, as :func:`wait_collective` says it for
        the built-in trainer's: a script's DDP backward or plain ``dist.all_reduce`` waiting
        on a hung peer. Without it every rank of a script's world looked hung together
        (no progress on any), every agent killed its worker at ``restart.hang_timeout``,
        and the state was lost to a process restart; now the hung one, which is not in a
        collective, is killed first and its peers recover in-process. Idle: the other
        threads used under :data:`IDLE_CPU` seconds meanwhile (a rank busy computing its
        backward is in the autograd engine too), and no thread in uninterruptible I/O (a
        rank stuck on its own filesystem in a distributed checkpoint's write is not
        waiting on its peers). Never cleared, only no longer refreshed: it goes stale
        (``WAITING_FRESH``), and the script's next step report drops it. Clearing it when
        the main thread left the collective could not tell a collective that completed
        from one that failed because the hung peer was just killed, and the cleared
        survivor, its heartbeat as old as the hung one's, could then be killed as hung
        before it reported its fault. gloo: on NCCL a host waits in a device
        synchronisation, not in a collective's call. A world whose every rank waits (a
        script's deadlock) is killed at twice ``restart.hang_timeout``."""
        now = time.monotonic()
        if self.channel is None or now - self._blocked_look < BLOCKED_LOOK:
            return
        self._blocked_look = now
        with self.cond:
            running = self._begun and self.round not in self.ended
            round_ = self.round
        if not running or self.waits:
            self._blocked = None
            return
        times = os.times()
        busy = times.user + times.system - time.thread_time()  # all threads but this one
        if not _main_in_collective():
            self._blocked = None
            return
        mark = self._blocked
        if mark is None or mark[0] != round_ or busy - mark[2] > IDLE_CPU:
            self._blocked = (round_, now, busy)  # a new stretch: busy, or just entered
            return
        if now - mark[1] >= WAITING_MARK and not _waiting_on_io():
            self.channel.waiting(True)
            self._blocked = (round_, now, busy)

    def _abort_late_sockets(self) -> None:
        """The current round has ended but the worker is still in it: shut the sockets
        it opened since. Judged under the lock, so a round that begins meanwhile is
        never taken for the ended one."""
        with self.cond:
            if not (self._begun and self.round in self.ended):
                self._idle_since = None
                return
            self._abort_nccl_once(late=True)
            self._shut_new(late=True)
            since = self.ended_for(self.round) or 0.0
            if since > STILL_IN_ROUND and self.round not in self._described:
                self._described.add(self.round)
                print(f"elasticd.inprocess: round {self.round} ended {STILL_IN_ROUND:.0f} s "
                      f"ago and this worker is still in it; sockets (fd:inode:state:ports): "
                      f"{describe_sockets(self._before, self._handled)}",
                      file=sys.stderr, flush=True)  # fmt: skip
            self._exit_if_stuck()

    def _exit_if_stuck(self) -> None:
        """Called by the watcher while the worker is in an ended round (lock held): exit
        once the other threads have used less than :data:`IDLE_CPU` for :data:`STUCK_EXIT`
        seconds (each look compares with the first of the idle stretch)."""
        now = time.monotonic()
        if now - self._last_look < STUCK_LOOK:
            return
        gap, self._last_look = now - self._last_look, now
        times = os.times()
        busy = times.user + times.system - time.thread_time()  # all threads but this one
        mark = self._idle_since
        if (
            mark is None
            or mark[0] != self.round
            or busy - mark[2] > IDLE_CPU
            or gap > 4 * STUCK_LOOK  # this process was frozen or starved meanwhile
            or not _main_in_collective()  # a save's upload, a data loader: it returns
        ):
            self._idle_since = (self.round, now, busy)
            return
        if now - mark[1] < STUCK_EXIT:
            return
        if _waiting_on_io():  # an fsync of a save, say: it will return
            self._idle_since = (self.round, now, busy)
            return
        print(f"elasticd.inprocess: round {self.round} ended {self.ended_for(self.round):.1f} s "
              f"ago and this worker has been blocked in it for {now - mark[1]:.1f} s without "
              "running (its connections are shut, nothing of the round can complete); "
              "exiting for its agent to replace it. Its threads:", file=sys.stderr, flush=True)  # fmt: skip
        _dump_stacks()
        os._exit(EXIT_RECOVERY_FAILED)

    def abandonable(self, work: Any, group: Any, result: Any) -> Any:
        """A future DDP can wait for in place of ``work``'s (:func:`ddp_comm_hook`): it
        completes with ``result`` when the work completes, with the work's error when it
        fails, and with :class:`RoundAborted` when the watcher abandons the work
        (:meth:`_abandon_pending`), whichever comes first.

        The work is waited for by a thread of ours (a :class:`_Waiter`), never through a
        callback on the work's own future: that would run Python on gloo's thread, which
        aborts the process (``terminate called``) when gloo ends an abandoned work while
        the interpreter exits. The waiter also holds the work and ``group`` and drops
        them on its own thread (a group's destructor joins gloo's threads)."""
        import torch

        # A CUDA result (gloo reduces CUDA tensors too) needs its device named, or the
        # future refuses it.
        gate = torch.futures.Future(
            devices=None if result.device.type == "cpu" else [result.device]
        )
        entry = _Pending(self.round, gate)

        def finished(done: Future) -> None:  # on the waiter's thread (here if done already)
            error = done.exception()
            self._settle(entry, (result, None) if error is None else (None, error))

        with self._pending_lock:  # never submitted to a waiter the watcher has retired
            self._pending.add(entry)
            if self._waiter is None:
                self._waiter = _CollectiveWaiter("elasticd-ddp")
            done = self._waiter.submit(work, group)
        done.add_done_callback(finished)
        return gate.then(_settled)

    def _settle(self, entry: _Pending, outcome: tuple[Any, Any]) -> bool:
        """Complete ``entry``'s gate with ``outcome`` unless it was settled already."""
        with self._pending_lock:
            if entry not in self._pending:
                return False
            self._pending.discard(entry)
        entry.gate.set_result(outcome)
        return True

    def _abandon_pending(self) -> None:
        """Fail the gate of every work still pending :data:`ABANDON_AFTER` after its round
        ended. The waiter, blocked in one of them, is retired: it holds that work and the
        ones queued behind it, with their groups, until gloo ends them (the group
        timeout), then ends; the next work gets a new waiter. One thread per abandonment,
        however many buckets it left."""
        if not self._pending:
            return
        with self._pending_lock:
            ripe = [e for e in self._pending if (self.ended_for(e.round) or 0.0) >= ABANDON_AFTER]
            if ripe and self._waiter is not None:
                self._waiter.retire()
                self._waiter = None
        for e in ripe:
            since = self.ended_for(e.round) or 0.0
            error = RoundAborted(f"round {e.round} ended {since:.1f} s ago and a collective of "
                                 "it is still pending (gloo left it waiting): abandoned")  # fmt: skip
            if self._settle(e, (None, error)):
                log.info("%s", error)

    def aborted(self, round_: int) -> bool:
        return round_ in self.ended

    def ended_for(self, round_: int) -> float | None:
        """Seconds since this process learnt that ``round_`` ended (None: it has not)."""
        at = self._ended_at.get(round_)
        return None if at is None else time.monotonic() - at

    def end_reason(self, round_: int, *, wait: float = 0.0) -> str | None:
        """The agent's reason for ending ``round_`` (an ``Outcome`` value), waiting up to
        ``wait`` seconds for its abort record; None: none known. A newer record names the
        reasons of the rounds before it (``ended``), so a missed abort record loses none.
        The wait ends early where no reason will come: the round's end read without one,
        a SIGTERM (the agent stops this process: a fallback, a preemption), or the agent
        gone."""
        deadline = time.monotonic() + wait
        parent = os.getppid()
        with self.cond:
            while round_ not in self._end_reasons:
                left = deadline - time.monotonic()
                if left <= 0 or round_ in self.ended:  # ``_read`` fills both at once
                    return None
                if self.channel.preempt_requested() or os.getppid() != parent:
                    return None
                self.cond.wait(min(left, 0.05))
            return self._end_reasons[round_]

    def begin(self, round_: int) -> None:
        """A round starts: remember which sockets existed before it."""
        with self.cond:
            self.round = round_
            self._before = set(_socket_fds().values())
            self._handled = set()
            self._begun = True

    def left(self, round_: int) -> None:
        """We left round ``round_`` (its group is destroyed): its sockets are gone, and the
        ones opened until the next round begins are not its to shut."""
        with self.cond:
            if self.round == round_:
                self._begun = False

    def abort_sockets(self, round_: int) -> None:
        """Leave any collective of round ``round_`` (see the module docstring). Nothing if
        another round began meanwhile: its sockets are not ours to shut. Under the lock,
        so that a round cannot begin halfway through.

        On NCCL the round's communicators are aborted first (once per round): a kernel
        blocked on a frozen or dead peer spins on the GPU, and only ``ncclCommAbort`` ends
        it; the round's thread, blocked in a device synchronisation, then goes on. First,
        because NCCL's own sockets (bootstrap, and its socket transport) are among those
        shut next: NCCL would take their end for a network error of a live communicator."""
        with self.cond:
            if not self._begun or self.round != round_:
                return
            self._abort_nccl_once(late=False)
            self._shut_new(late=False)

    def _abort_nccl_once(self, *, late: bool) -> None:
        """Abort the NCCL backends of this process whose abort nobody has begun (the
        watcher's lock held): the first time the round's end is read, then, while the
        worker is still in the round, every :data:`STUCK_LOOK` s, for a group made after
        that (its set-up was under way)."""
        now = time.monotonic()
        if late and now - self._nccl_look < STUCK_LOOK:
            return
        self._nccl_look = now
        aborted = abort_nccl_communicators()
        if aborted:
            what = "more NCCL communicators, made after its end," if late else "NCCL communicators"
            print(f"elasticd.inprocess: round {self.round} ended; {aborted} {what} aborted",
                  file=sys.stderr, flush=True)  # fmt: skip

    def _shut_new(self, *, late: bool) -> None:
        """Shut the current round's new connections (the lock held); say so in the log,
        once per round and for every later batch: where a worker does not leave its
        round, the log then tells whether its sockets were shut at all."""
        shut, listening = _shutdown_new(self._before | self._handled)
        self._handled |= shut | listening
        if shut or (not late and self.round not in self._told):
            self._told.add(self.round)
            what = "more connections opened after its end" if late else "connections"
            print(f"elasticd.inprocess: round {self.round} ended; {len(shut)} {what} shut",
                  file=sys.stderr, flush=True)  # fmt: skip

    def next_round(self, after: int) -> dict[str, str]:
        """Block until the agent starts a round after ``after`` that names this process
        (by its pid in the record's ``pids``, else by its local rank; a standby goes by its
        pid alone); its env for this rank. A standby takes the local rank the round gives
        it."""
        parent = os.getppid()
        mine = str(os.getpid())
        with self.cond:
            while True:
                rec = self.record
                if rec.get("state") == "run" and int(rec.get("round", 0)) > after:
                    envs = rec.get("env") or {}
                    key = (rec.get("pids") or {}).get(mine)
                    if key is None and self.local_rank >= 0:  # a standby goes by its pid alone
                        key = str(self.local_rank)
                    env = envs.get(key) if key is not None else None
                    if env:
                        handed = {str(k): str(v) for k, v in env.items()}
                        self.local_rank = int(handed.get("LOCAL_RANK", self.local_rank))
                        return handed
                if os.getppid() != parent:
                    raise SystemExit(EXIT_RECOVERY_FAILED)  # the agent is gone
                if self.channel.preempt_requested():  # our node is going: no round comes
                    raise SystemExit(PREEMPTED_EXIT_CODE)
                self.cond.wait(0.5)


# -- the loop ------------------------------------------------------------------------------------


def is_comm_error(exc: BaseException) -> bool:
    """Whether ``exc`` comes from a process group or store (a peer died, froze, or our
    round's sockets were shut), rather than from the training code: it, or an exception
    it was raised from or while handling (a script's own error wrapping a failed
    collective), is one of torch.distributed's errors, ours, or an error whose text comes
    from gloo, NCCL or c10d. A script's own connection or timeout error (a data loader's,
    an HTTP client's) is not one."""
    seen: set[int] = set()
    todo = [exc]
    while todo and len(seen) < 32:
        e = todo.pop()
        if e is None or id(e) in seen:
            continue
        seen.add(id(e))
        if _is_comm_error_itself(e):
            return True
        todo += [e.__cause__, e.__context__, *getattr(e, "exceptions", ())]  # and a group's
    return False


_COMM_TEXT = ("gloo", "NCCL", "TCPStore", "c10d", "ProcessGroup", "monitoredBarrier",
              "RoundAborted")  # fmt: skip
"""Words in the text of a communication error raised as a plain RuntimeError: gloo's
carry its source path (``.../gloo/transport/tcp/pair.cc:553] Connection closed by peer``);
a DDP backward whose :func:`ddp_comm_hook` future was abandoned raises torch's wrapper
(``Got the following error when running the callback: RoundAborted: ...``)."""


def _is_comm_error_itself(exc: BaseException) -> bool:
    import torch.distributed as dist

    from elasticd.faultplan import InjectedCollectiveFault

    if isinstance(exc, (RoundAborted, InjectedCollectiveFault)):
        return True
    dist_error = getattr(dist, "DistError", None)
    if dist_error is not None and isinstance(exc, dist_error):
        return True
    if isinstance(exc, (RuntimeError, ConnectionError, TimeoutError)):
        text = str(exc)
        return any(s in text for s in _COMM_TEXT)
    return False


_current: _Control | None = None
"""The control-file watcher of the round this process is in (set by :func:`run`)."""


def wait_collective(work: Any, group: Any = None) -> None:
    """Wait for ``work``, an asynchronous *collective* of the current round over ``group``
    (the work's own group, None for the default one; all-reduce, all-gather,
    reduce-scatter, broadcast; never a send or a receive: a timed wait on one of those
    makes gloo fail its whole group). Its error, if any, is raised. Call it from the
    thread that runs the round.

    Under in-process restart on gloo, the wait is taken in slices of :data:`WAIT_SLICE`;
    once the round has ended :data:`ABANDON_AFTER` ago and the collective is still pending,
    :class:`RoundAborted` is raised and the collective is abandoned (held, with its group,
    by a thread of its own until gloo ends it). The socket abort fails a collective within
    milliseconds, but not always: the in-process chaos soak found a worker in a
    data-parallel bucket's all-reduce for 120 s after every connection of its round had
    closed. The likely way, from gloo's source: a receive leaves the pending
    list that a failed connection signals as soon as its message's header arrives, so a
    connection that closes mid-message leaves it waiting for the whole group timeout.
    Elsewhere (no in-process round, or another backend, where an abort ends the work) this
    is ``work.wait()``."""
    control = _gloo_round(group)
    if control is None:
        work.wait()
        return
    round_ = control.round
    slice_ = timedelta(seconds=WAIT_SLICE)
    with _Waiting(control) as waiting:
        while True:
            try:
                work.wait(timeout=slice_)
                return
            except RuntimeError:
                if work.is_completed():  # done meanwhile, or its own error: wait() says which
                    work.wait()
                    return
            waiting.tick()
            since = control.ended_for(round_)
            if since is not None and since >= ABANDON_AFTER:
                _hold_until_done(work, group)
                raise RoundAborted(
                    f"round {round_} ended {since:.1f} s ago and a collective of it is still "
                    "pending (gloo left it waiting): abandoned"
                )


class _Waiting:
    """Tells the agent, through the heartbeat, that this rank has been waiting on its peers
    in a collective or transfer for :data:`WAITING_MARK` seconds (refreshed every
    :data:`WAITING_MARK` seconds while it lasts), and again when the wait completes
    (``WorkerChannel.waiting``): a waiting rank is not the one that hangs."""

    def __init__(self, control: _Control) -> None:
        self.control = control
        self.channel = getattr(control, "channel", None)
        self.last = time.monotonic()  # the wait's start, then the last mark
        self.marked = False

    def __enter__(self) -> _Waiting:
        if isinstance(self.control, _Control):
            self.control.waits += 1
        return self

    def tick(self) -> None:
        if self.channel is not None and time.monotonic() - self.last >= WAITING_MARK:
            self.channel.waiting(True)
            self.marked, self.last = True, time.monotonic()

    def __exit__(self, exc_type: object, *exc: object) -> None:
        # A wait that failed keeps its mark until it goes stale: the rank leaves its round
        # (shutting its sockets can take a while) before it writes its fault, and must not
        # look hung meanwhile.
        if isinstance(self.control, _Control):
            self.control.waits -= 1
        if self.marked and exc_type is None:
            self.channel.waiting(False)


def _hold_until_done(work: Any, group: Any) -> None:
    """Keep an abandoned collective and its group alive on a thread of their own until
    gloo ends the collective (at its group timeout), then drop them there: the group's
    destructor joins gloo's threads, so whichever thread dropped the last reference would
    otherwise block until then (the next round's, when it replaces the old trainer)."""
    import torch.distributed as dist

    if group is None and dist.is_initialized():
        group = dist.distributed_c10d._get_default_group()
    held = [work, group]

    def hold() -> None:
        while not held[0].is_completed():
            time.sleep(1.0)
        held.clear()

    threading.Thread(target=hold, name="elasticd-abandoned", daemon=True).start()


def _gloo_round(group: Any) -> _Control | None:
    """The in-process round under way, when ``group`` is a gloo group of it (then a
    pending work of it may have to be abandoned); else None."""
    control = _current
    if control is None or not control._begun:
        return None
    import torch.distributed as dist

    return control if dist.get_backend(group) == "gloo" else None


def wait_transfer(work: Any, group: Any = None) -> None:
    """Wait for ``work``, an asynchronous *send or receive* of the current round over
    ``group`` (the pipeline's point-to-point transfers), abandoning it as
    :func:`wait_collective` abandons a collective: :class:`RoundAborted` once the round has
    ended :data:`ABANDON_AFTER` ago and it is still pending. Call it from the thread that
    runs the round, once per work.

    A timed wait on a gloo send or receive fails its whole group, so it is never waited
    for in slices: the untimed ``work.wait()`` runs on a waiter thread of its own, and this
    thread waits for *that* in slices. An abandoned transfer keeps the waiter thread (a
    daemon; and through it the work and its group) until gloo ends it; the next transfer
    gets a new waiter. Not thread-safe: one thread (the round's) calls it. Elsewhere (no
    in-process round, or another backend) this is ``work.wait()``."""
    control = _gloo_round(group)
    if control is None:
        work.wait()
        return
    global _waiter
    round_ = control.round
    if group is None:  # the waiter holds the group itself, so it is dropped there
        import torch.distributed as dist

        group = dist.distributed_c10d._get_default_group()
    if _waiter is None:
        _waiter = _Waiter()
    done = _waiter.submit(work, group)
    with _Waiting(control) as waiting:
        while True:
            try:
                done.result(timeout=WAIT_SLICE)
                return
            except FutureTimeout:
                if done.done():  # its own TimeoutError: raise it
                    done.result()
            waiting.tick()
            since = control.ended_for(round_)
            if since is not None and since >= ABANDON_AFTER:
                # That one stays blocked in gloo, then ends; the next transfer gets another.
                _waiter.retire()
                _waiter = None
                raise RoundAborted(
                    f"round {round_} ended {since:.1f} s ago and a transfer of it is still "
                    "pending (gloo left it waiting): abandoned"
                )


def ddp_comm_hook(group: Any, bucket):  # no annotations: DDP checks them, and ours are strings
    """DDP's gradient all-reduce, as DDP does it by default (each gradient times
    1 / world size, summed over ``group``), but one that an ended round abandons.
    Register it once per DDP object, with the DDP's own group as the hook's state::

        ddp = DDP(model)
        ddp.register_comm_hook(ddp.process_group, ei.ddp_comm_hook)

    (``None`` means the default group; a DDP made with ``process_group=pg`` must pass
    ``pg``, or the buckets are reduced over the whole world.)

    DDP's reducer waits for its buckets' all-reduces in C++, at the end of ``backward``,
    where no timed wait can reach: a rank whose round ended while it was frozen, thawed
    with its connections shut, could sit there until the stuck-worker exit replaced its
    process (a process restart, about 10 s on). With the hook each bucket's all-reduce is
    asynchronous and DDP waits for a future of ours instead, which the worker's watcher
    fails once the round has ended :data:`ABANDON_AFTER` ago and the all-reduce is still
    pending, as :func:`wait_collective` does: ``backward`` raises (a ``RuntimeError`` that
    names :class:`RoundAborted`: torch wraps a hook's error), and :func:`run` takes it for
    the round's end; the worker leaves the round in its own process. The abandoned
    all-reduce is held, with its group, until gloo ends it. Elsewhere (no in-process
    round; NCCL, whose abort ends the work) it is DDP's own all-reduce, future for future.

    The gradients equal DDP's own bit for bit when DDP copies them into its buckets (the
    default; with ``gradient_as_bucket_view=True``, when ``zero_grad()`` set them to None),
    where DDP multiplies by 1 / world size as this does. When the gradients already live
    in the bucket (``gradient_as_bucket_view=True`` with gradients zeroed in place, or
    accumulated under ``no_sync()``) DDP divides instead: the same within fp32 round-off."""
    import torch.distributed as dist

    if group is None and dist.is_initialized():  # held by the waiter, dropped on its thread
        group = dist.distributed_c10d._get_default_group()
    buf = bucket.buffer()
    buf.mul_(1.0 / dist.get_world_size(group))  # DDP's own scaling (see above)
    work = dist.all_reduce(buf, group=group, async_op=True)
    control = _gloo_round(group)
    if control is None:
        return work.get_future().then(lambda fut: fut.value()[0])
    return control.abandonable(work, group, buf)


def _settled(fut: Any) -> Any:
    """The result of an abandonable work's gate, (value, None) or (None, error): raised
    here, so that the future DDP waits for holds a real error."""
    value, error = fut.value()
    if error is not None:
        raise error
    return value


class _Pending:
    """An asynchronous work of a round that the watcher may abandon
    (:meth:`_Control.abandonable`): its gate is settled once, by whichever comes first."""

    __slots__ = ("gate", "round")

    def __init__(self, round_: int, gate: Any) -> None:
        self.round, self.gate = round_, gate


class _Waiter:
    """A daemon thread that waits for the works handed to it, one after another (a daemon:
    one blocked in gloo for good never holds up the interpreter's exit, as a
    ``ThreadPoolExecutor``'s thread would). Each work's group is handed over with it, so
    that it is dropped on this thread, not the round's (its destructor joins gloo's
    threads)."""

    def __init__(self, name: str = "elasticd-transfer") -> None:
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        threading.Thread(target=self._run, name=name, daemon=True).start()

    def submit(self, work: Any, group: Any) -> Future:
        done: Future = Future()
        self._jobs.put((work, group, done))
        return done

    def retire(self) -> None:
        """End the thread once the work it waits for now ends (its transfer abandoned)."""
        self._jobs.put(None)

    def _run(self) -> None:
        while (job := self._jobs.get()) is not None:
            work, group, done = job
            try:
                work.wait()
                done.set_result(None)
            except BaseException as exc:  # handed to the waiting thread
                done.set_exception(exc)
            del job, work, group, done


class _CollectiveWaiter(_Waiter):
    """A :class:`_Waiter` for collectives (:func:`ddp_comm_hook`'s all-reduces), which,
    unlike a send or a receive, may be waited for in slices.

    A daemon thread blocked in C++ (``work.wait()``) while the interpreter exits is
    aborted when it takes the GIL back: its forced unwind meets a C++ destructor
    (``terminate``). When gloo ended an abandoned all-reduce just as the process exited,
    the exit code was 134 instead of the script's. So the wait is taken in slices of
    :data:`WAIT_SLICE`, and at exit (:func:`_park_collective_waiters`, an ``atexit``
    handler) each such thread is asked to park: it stops waiting and sleeps in Python,
    holding its work and group (dropped nowhere: a group's destructor would join gloo's
    threads), until the interpreter stops it there, which is safe. An idle one waits for
    its queue, in C, and needs nothing."""

    def __init__(self, name: str) -> None:
        self._park = threading.Event()
        self._parked = threading.Event()
        self._busy = False
        super().__init__(name)
        global _park_registered
        with _waiters_lock:
            _collective_waiters.add(self)
            if not _park_registered:
                atexit.register(_park_collective_waiters)
                _park_registered = True

    def _run(self) -> None:
        slice_ = timedelta(seconds=WAIT_SLICE)
        while (job := self._jobs.get()) is not None:
            work, group, done = job
            self._busy = True
            try:
                while True:
                    try:
                        work.wait(timeout=slice_)
                        break
                    except RuntimeError:
                        if work.is_completed():  # its own error: wait() raises it
                            work.wait()
                            break
                    if self._park.is_set():
                        self._parked.set()
                        while True:  # job (its work and group) stays in this frame
                            time.sleep(3600)
                done.set_result(None)
            except BaseException as exc:  # handed to the waiting thread
                done.set_exception(exc)
            self._busy = False
            del job, work, group, done

    def park(self, limit: float) -> None:
        """Ask the thread to leave C++ for good; wait up to ``limit`` seconds for it."""
        self._park.set()
        end = time.monotonic() + limit
        while self._busy and not self._parked.is_set() and time.monotonic() < end:
            time.sleep(0.005)


_collective_waiters: weakref.WeakSet = weakref.WeakSet()
_waiters_lock = threading.Lock()
_park_registered = False


def _park_collective_waiters() -> None:
    """At the interpreter's exit: park every :class:`_CollectiveWaiter` still waiting."""
    with _waiters_lock:
        waiters = list(_collective_waiters)
    for w in waiters:
        w.park(limit=3 * WAIT_SLICE)


_waiter: _Waiter | None = None
"""The thread :func:`wait_transfer` waits on (a new one after an abandoned transfer)."""


def _open_round(
    env: Mapping[str, str],
    *,
    backend: str,
    timeout: timedelta,
    aborted: Callable[[], bool] = lambda: False,
) -> Any:
    """A fresh store (prefixed by run and round) and default process group for ``env``.
    ``aborted``: whether the round ended meanwhile (the wait for rank 0's store then
    raises :class:`RoundAborted`)."""
    import torch.distributed as dist

    rank, world = int(env.get("RANK", "0")), int(env.get("WORLD_SIZE", "1"))
    if world == 1 and "MASTER_ADDR" not in env:
        store = dist.HashStore()
    else:
        # Under torchrun the agent hosts the store (TORCHELASTIC_USE_AGENT_STORE); under
        # elasticd rank 0 hosts each round's, on the port the rendezvous reserved.
        host = rank == 0 and env.get("TORCHELASTIC_USE_AGENT_STORE") != "True"
        addr, port = env["MASTER_ADDR"], int(env["MASTER_PORT"])
        if host:
            store = dist.TCPStore(addr, port, world, True, timeout=timeout,
                                  wait_for_workers=False)  # fmt: skip
        else:
            store = _connect_store(addr, port, world, timeout, aborted)
    prefixed = dist.PrefixStore(store_prefix(env), store)
    dist.init_process_group(backend, store=prefixed, rank=rank, world_size=world, timeout=timeout)
    return prefixed


def store_prefix(env: Mapping[str, str]) -> str:
    """The prefix of a round's keys in its store: the run and the round. Under plain
    torchrun (no ``ELASTICD_ROUND``) the agent's store outlives a restart of the workers,
    and the restart count tells the attempts apart, as torch's own ``env://`` prefix does.
    (Before, every attempt used "round-0": the built-in trainer restarted after a lost
    node read the dead attempt's gloo addresses and failed to connect, every restart.)"""
    round_ = env.get("ELASTICD_ROUND")
    part = (f"round-{round_}" if round_ is not None
            else f"attempt-{env.get('TORCHELASTIC_RESTART_COUNT', '0')}")  # fmt: skip
    return f"elasticd/{env.get('TORCHELASTIC_RUN_ID', '')}/{part}/"


CONNECT_TRY = timedelta(seconds=5)
"""How long one attempt to connect to the round's store may take (see _connect_store)."""


def _connect_store(
    addr: str, port: int, world: int, timeout: timedelta, aborted: Callable[[], bool]
) -> Any:
    """A client of the round's store, within ``timeout``, in attempts of CONNECT_TRY with
    ``aborted`` asked between them: TCPStore retries a refused connection for as long as
    its timeout, so a rank 0 gone between our probe and our connect (its node died, its
    round ended) would otherwise hold us for the whole group timeout, with nothing
    connected for the socket abort to shut."""
    import torch.distributed as dist

    deadline = time.monotonic() + timeout.total_seconds()
    while True:
        left = timedelta(seconds=max(0.0, deadline - time.monotonic()))
        _wait_listening(addr, port, left, aborted)
        try:
            store = dist.TCPStore(addr, port, world, False, timeout=min(CONNECT_TRY, left),
                                  wait_for_workers=False)  # fmt: skip
        except (RuntimeError, TimeoutError, ConnectionError) as exc:  # DistError is one too
            if aborted():
                raise RoundAborted(f"the round ended while connecting to its store: {exc}") from exc
            if time.monotonic() >= deadline:
                raise
            continue
        store.set_timeout(timeout)  # the round's operations get the whole group timeout
        return store


def _wait_listening(
    host: str, port: int, timeout: timedelta, aborted: Callable[[], bool] = lambda: False
) -> None:
    """Wait, polling every 5 ms, until the round's store accepts connections. A TCPStore
    client that finds no listener backs off for up to about a second before it tries
    again; the new rank 0 starts its server at about the same moment as the others
    connect, so without this a re-form often loses that second.

    Raises :class:`RoundAborted` once ``aborted()``: a round can end before its rank 0
    ever opens the store (its agent ended the round just after starting it, and rank 0
    read only the abort); nothing is connected yet for the socket abort to shut, so
    without this check the wait would last the whole process-group timeout."""
    deadline = time.monotonic() + timeout.total_seconds()
    while time.monotonic() < deadline:
        if aborted():
            raise RoundAborted(f"the round ended before its store at {host}:{port} opened")
        try:
            socket.create_connection((host, port), timeout=1.0).close()
            return
        except OSError:
            time.sleep(0.005)
    # Past the deadline: TCPStore's own connect says what is wrong.


def warm_imports() -> threading.Thread:
    """Import, in a background thread, what torch imports lazily on first use at a cost
    of seconds: the first ``torch.optim`` optimizer imports ``torch._dynamo`` (about 2 s
    on a loaded CPU). A spare that becomes active, or a newcomer, would otherwise pay it
    inside a recovery; here it overlaps the round's rendezvous and set-up."""

    def work() -> None:
        try:
            import torch._dynamo  # noqa: F401
        except Exception:  # only a warm-up: the real import reports any problem
            log.debug("warm-up import failed", exc_info=True)

    t = threading.Thread(target=work, name="elasticd-warm-imports", daemon=True)
    t.start()
    return t


_warm_control: _Control | None = None
"""The control-file watcher a warm worker started while waiting; ``run`` goes on with it."""


def first_round_env(env: Mapping[str, str] | None = None) -> dict[str, str]:
    """``env`` (default ``os.environ``), or, in a warm worker (``ELASTICD_WARM_AFTER``
    set), the environment of the first round its agent hands it: this blocks until then,
    importing torch's lazily loaded modules meanwhile, and updates ``os.environ``. Call it
    before reading RANK, WORLD_SIZE or the layout (``run`` calls it itself)."""
    global _warm_control
    env = dict(os.environ if env is None else env)
    after = env.get(ENV_WARM)
    if after is None:
        return env
    warm_imports().join()  # nothing else to do until a round comes
    if env.get(ENV_WARM_READY):
        try:
            with open(env[ENV_WARM_READY], "w", encoding="utf-8") as fh:
                fh.write(str(os.getpid()))
        except OSError as exc:  # the agent then waits its bounded time
            log.warning("cannot write the warm-ready file: %s", exc)
    control = _Control(env[ENV_CONTROL], int(env.get("LOCAL_RANK", "0") or 0), env)
    handed = control.next_round(int(after))
    env.pop(ENV_WARM, None)
    os.environ.pop(ENV_WARM, None)
    env.update(handed)
    os.environ.update(handed)
    _warm_control = control
    return env


def _close_round(*, abort: bool) -> None:
    """Tear the default process group (and every group made from it) down."""
    import torch.distributed as dist

    if not dist.is_initialized():
        # The round ended inside init_process_group: torch had already taken a name for
        # the default group from its per-process counter, which only a full teardown
        # resets. The next round's default group would be named "1" here and "0" in a
        # fresh process, and its store keys (prefixed by the name) would never meet.
        _reset_group_names()
        return
    if abort and "nccl" in str(dist.get_backend()):  # also "cpu:gloo,cuda:nccl"
        _abort_nccl()
        return
    # gloo's alone: an NCCL group's destructor belongs on the thread of its device, and
    # torch's destroy_process_group shuts its communicators down first.
    groups = _live_groups() if "nccl" not in str(dist.get_backend()) else []
    try:
        dist.destroy_process_group()
    except Exception as exc:  # a broken group: nothing of it is used again
        log.warning("destroying the old process group failed: %s", exc)
    _release_held_groups()  # the round before's: its works ended long ago
    _held_groups.extend(groups)


_held_groups: list[Any] = []
"""The gloo process groups of the round closed last, kept until the next round closes.

A user's ``DistributedDataParallel`` (its C++ ``Reducer``) holds the round's group, and
let go of it when the round's exception was dropped: the group's destructor then ran on the
round's thread with the GIL held (the Reducer's destructor does not release it), waiting for
gloo's work mutex, while gloo's thread held that mutex destroying a just-failed broadcast
of DDP's buffers, whose tensor's release needs the GIL: a deadlock (3 of 13 preemptions of a
DDP script with BatchNorm; torch issue 56297). Held here, no thread of the user's ever drops
the last reference; :func:`_release_held_groups` drops ours on a thread of its own, where
the group's Python object is the last owner (its destructor releases the GIL) and a work
still pending (a peer that never came) stalls that thread only."""


def _live_groups() -> list[Any]:
    """Every process group of torch's table (the default one and each made from it)."""
    import torch.distributed as dist

    world = getattr(dist.distributed_c10d, "_world", None)
    table = getattr(world, "pg_map", None)
    if isinstance(table, dict):
        return list(table)
    return [dist.group.WORLD] if dist.group.WORLD is not None else []


def _release_held_groups(*, wait: float | None = None) -> None:
    """Drop :data:`_held_groups` on a daemon thread (see there). With ``wait`` (the process
    is ending), wait up to that long for it and for any release still under way: a group
    destroyed by the interpreter's own teardown, or on a daemon thread it stops halfway,
    aborted the process ("terminate called without an active exception", exit 134 in place
    of the script's own code)."""
    if _held_groups:
        held = list(_held_groups)
        _held_groups.clear()
        releaser = threading.Thread(target=held.clear, name="elasticd-old-groups", daemon=True)
        releaser.start()
        _releasers.append(releaser)
    _releasers[:] = [t for t in _releasers if t.is_alive()]
    if wait is not None:
        deadline = time.monotonic() + wait
        for releaser in _releasers:
            releaser.join(max(0.0, deadline - time.monotonic()))


_releasers: list[threading.Thread] = []
"""The threads of :func:`_release_held_groups` that may still be destroying groups."""

RELEASE_WAIT = 10.0
"""How long a process that is ending waits for its old rounds' groups to be destroyed."""


def _reset_group_names() -> None:
    """Start torch's group naming over, as ``destroy_process_group()`` does (private
    state: torch 2.x keeps the counter on ``distributed_c10d._world``)."""
    import torch.distributed as dist

    world = getattr(dist.distributed_c10d, "_world", None)
    if world is None or not hasattr(world, "group_count"):
        log.warning("cannot reset torch's process-group names (torch %s)", _torch_version())
        return
    world.group_count = 0


def _torch_version() -> str:
    import torch

    return str(torch.__version__)


class _Watchdog:
    """Exit the process (:data:`EXIT_RECOVERY_FAILED`; the agent falls back to a process
    restart) if the ``with`` block takes over :data:`ABORT_WATCHDOG` seconds: an
    ``ncclCommAbort`` can itself hang (NCCL issue 829). Every thread's stack is printed
    first: where it hung."""

    def __init__(self, what: str) -> None:
        self.what = what
        self.done = threading.Event()

    def __enter__(self) -> _Watchdog:
        threading.Thread(target=self._watch, name="elasticd-abort-watchdog", daemon=True).start()
        return self

    def _watch(self) -> None:
        if not self.done.wait(ABORT_WATCHDOG):
            print(f"elasticd.inprocess: {self.what} hung for {ABORT_WATCHDOG:.0f} s; exiting "
                  "for a process restart. Its threads:", file=sys.stderr, flush=True)  # fmt: skip
            _dump_stacks()
            os._exit(EXIT_RECOVERY_FAILED)

    def __exit__(self, *exc: object) -> None:
        self.done.set()


def _dump_stacks() -> None:
    """Every thread's stack, to stderr (before the process exits), and where each native
    thread waits in the kernel (:func:`native_threads`): the Python stacks name none of
    gloo's or torch's own threads, which is where a stuck round is stuck."""
    out = sys.__stderr__ or sys.stderr
    try:
        import faulthandler

        faulthandler.dump_traceback(file=out, all_threads=True)
        print("Native threads (tid name state wchan syscall-number first-argument):",
              *native_threads(), sep="\n  ", file=out, flush=True)  # fmt: skip
    except (OSError, ValueError, AttributeError):  # no usable stderr: exit anyway
        pass


def native_threads() -> list[str]:
    """One line per thread of this process from ``/proc/self/task``: its id, name, state,
    the kernel function it sleeps in (``wchan``: ``futex_wait_queue`` for a lock or a
    condition, ``ep_poll`` for an event loop, ``sk_wait_data`` for a blocking read; ``0``
    where the kernel hides it) and
    its system call's number and first argument (a file descriptor for a read, a write
    or an epoll wait; ``running`` when it is not in one). Empty where /proc has none."""
    lines = []
    try:
        tids = sorted(os.listdir("/proc/self/task"), key=int)
    except OSError:
        return lines
    for tid in tids:
        base = f"/proc/self/task/{tid}/"
        stat = _read_proc(base + "stat")
        state = stat.rsplit(")", 1)[-1].split()[0] if ")" in stat else "?"
        call = _read_proc(base + "syscall").split()
        where = " ".join(call[:2]) if call and call[0].lstrip("-").isdigit() else " ".join(call[:1])
        comm, wchan = _read_proc(base + "comm"), _read_proc(base + "wchan")
        lines.append(f"{tid} {comm} {state} {wchan or '-'} {where or '?'}")
    return lines


def _read_proc(path: str) -> str:
    """A /proc file's text, stripped; ``?`` when it cannot be read (the thread ended)."""
    try:
        with open(path, encoding="ascii", errors="replace") as fh:
            return fh.read().strip()
    except OSError:
        return "?"


def _nccl_groups() -> tuple[list[Any], list[Any]]:
    """This process's process groups that have an NCCL backend, newest first, and those
    backends (none when torch.distributed was never imported, or has no NCCL group). Read
    from torch's table of groups as it is at the call (the round's thread may be tearing
    it down meanwhile)."""
    dist = sys.modules.get("torch.distributed")
    if dist is None or not dist.is_available() or not dist.is_initialized():
        return [], []
    import torch

    try:
        nccl = dist.ProcessGroupNCCL if dist.is_nccl_available() else None
        names = dict(dist.distributed_c10d._world.pg_names)
    except Exception as exc:
        log.debug("no process groups to abort: %s", exc)
        return [], []
    groups, backends = [], []
    for pg in sorted(names, key=lambda pg: names[pg], reverse=True) if nccl is not None else ():
        try:
            backend = pg._get_backend(torch.device("cuda"))
        except Exception:  # no CUDA backend in this group (a gloo side group)
            continue
        if isinstance(backend, nccl):
            groups.append(pg)
            backends.append(backend)
    return groups, backends


_abort_lock = threading.Lock()
"""Guards :data:`_abort_begun` (held only to claim, never across an abort)."""

_abort_begun: dict[int, Any] = {}
"""The NCCL process groups whose communicators' abort has begun, by ``id``, each held (so
that its id is never another group's). Whoever claims a group first aborts it, the
control watcher or the thread of the round's teardown (:func:`_abort_nccl`), and nobody
aborts it again: not the teardown after the watcher (a second ``ncclCommAbort`` of a
communicator is one suspect of the teardown hang seen on an H200, see
:func:`_abort_nccl`), nor the watcher's later looks. An abort that hangs holds
nothing another round's abort needs: it used to hold one lock for its whole length, so
that once a teardown's abort hung, the watcher skipped every later round's aborts."""


def _claim_aborts(groups: list[Any], backends: list[Any]) -> list[Any]:
    """The backends of ``groups`` whose abort nobody has begun; claimed for the caller."""
    with _abort_lock:
        fresh = [b for g, b in zip(groups, backends, strict=True) if id(g) not in _abort_begun]
        for g in groups:
            _abort_begun.setdefault(id(g), g)
    return fresh


def _abort_backends(backends: list[Any]) -> None:
    """``ncclCommAbort`` of each backend's communicators, all in one NCCL group call so
    that two aborts cannot wait on each other (pytorch/pytorch#119797), as torch's own
    ``_abort_process_group`` does; one that fails does not keep the others from theirs.
    Call with backends claimed (:func:`_claim_aborts`).

    Not proven on a GPU with several communicators (the ``gpu`` tests have one per
    process): where torch runs a backend's abort on a thread of its own, NCCL's group
    (per thread) wraps nothing, the aborts run one after another, and one that waits on
    another communicator's kernel is ended by the caller's :class:`_Watchdog` (a process
    restart, not a hang). Aborting each backend on a thread of ours would be the fix then."""
    if not backends:
        return
    try:
        backends[0]._group_start()
    except Exception as exc:  # a torch without the hook: abort one by one
        log.warning("NCCL group start: %s", exc)
    try:
        for backend in backends:
            try:
                backend.abort()
            except Exception as exc:  # aborted already, say
                log.warning("NCCL abort: %s", exc)
    finally:
        try:
            backends[0]._group_end()
        except Exception as exc:
            log.warning("NCCL group end: %s", exc)


def abort_nccl_communicators() -> int:
    """Abort the NCCL communicators of every process group of this process whose abort
    nobody has begun (:data:`_abort_begun`), from any thread, under :class:`_Watchdog`;
    returns how many backends this call aborted (none without NCCL). torch's bookkeeping
    of the groups is left alone: the round's own thread forgets them once it has left the
    round (:func:`_close_round`).

    What an aborted collective leaves in its output is undefined (NCCL stops the kernel
    wherever it was); :func:`check_results` is how a reader of such values finds out."""
    backends = _claim_aborts(*_nccl_groups())
    if backends:
        with _Watchdog("NCCL abort"):
            _abort_backends(backends)
    return len(backends)


def check_results(group: Any = None, *, gloo: bool = True) -> None:
    """Raise :class:`RoundAborted` if the in-process round under way has ended. Call it
    at least once per step, after a value of the step's collectives over ``group`` (None:
    the default group) was read back to the host and before the state is changed with it
    (the trainer: after the gradient norm and the loss, before the optimizer step).
    ``gloo=False``: only where the value cannot be trusted (NCCL), for a caller that keeps
    a value gloo gave before it leaves (the trainer's gradient norm, with which a
    recovery can complete the step: ``Trainer.pending_norm``).

    On NCCL, a collective aborted mid-flight (:func:`abort_nccl_communicators`, by the
    control watcher when the round ends) does not fail: it returns whatever its buffers
    held. The watcher marks the round ended before it aborts, and nothing else aborts
    (:data:`NCCL_INPROCESS_ENV`), so a value read back (a host synchronisation) and
    checked here afterwards is one no abort touched.

    On gloo an interrupted collective raises by itself, but a round whose collectives all
    completed goes on until the next one fails, and a world of one process has no peer
    whose socket could fail one: without this check it trains on alone past its round's
    end (a scale-up), its records and saves fenced off, while the newcomer waits."""
    control = _current
    if control is None or not control._begun:
        return
    since = control.ended_for(control.round)
    if since is None:
        return
    import torch.distributed as dist

    if dist.is_initialized() and "nccl" in str(dist.get_backend(group)):
        raise RoundAborted(
            f"round {control.round} ended {since:.1f} s ago, during or before a read of "
            "an NCCL collective's result (an aborted collective's output is not trusted)"
        )
    if gloo:
        raise RoundAborted(f"round {control.round} ended {since:.1f} s ago")


ABORT_WAIT = 3.0
"""Seconds the round's thread waits for the teardown of an ended round's NCCL groups
before it goes on without it (:func:`_abort_nccl`)."""

_retired_groups: list[Any] = []
"""The NCCL process groups of ended rounds: kept, never destroyed (see :func:`_abort_nccl`)."""


def _abort_nccl() -> None:
    """Abort the round's NCCL communicators and forget its process groups.

    On an H200 (torch 2.11, NCCL 2.28), ``_abort_process_group`` of a round whose watchdog
    had seen a killed peer's closed connection hung until :class:`_Watchdog` ended the
    process (which part of it hung was not found). So the aborts run on a thread of their
    own, waited for :data:`ABORT_WAIT` s, and torch's table of groups is emptied here, as
    ``_abort_process_group`` empties it, so that the next round's ``init_process_group``
    starts clean. The NCCL groups' objects are kept (:data:`_retired_groups`): their
    destructor joins torch's watchdog thread while it holds the GIL, and a destructor that
    waited would stop every thread of the process. Their communicators are aborted; what
    stays, per recovery, is each object with its round's store (on rank 0 the store's
    server). The round's gloo groups (the side groups: the checkpoint's, the flags', state
    transfer's) go as the tables let go of them, their sockets already shut by the
    watcher, as on a gloo round."""
    import torch.distributed as dist

    groups, backends = _nccl_groups()
    _retired_groups.extend(groups)
    backends = _claim_aborts(groups, backends)  # those the watcher aborted are done
    aborting = threading.Thread(target=_abort_backends, args=(backends,),
                                name="elasticd-nccl-abort", daemon=True)  # fmt: skip
    aborting.start()
    aborting.join(ABORT_WAIT)
    if aborting.is_alive():
        print(f"elasticd.inprocess: the abort of the ended round's NCCL groups did not return "
              f"in {ABORT_WAIT:.0f} s; going on without it", file=sys.stderr, flush=True)  # fmt: skip
    c10d = dist.distributed_c10d
    world = getattr(c10d, "_world", None)
    tables = [getattr(world, name, None) for name in _GROUP_TABLES]
    update = getattr(c10d, "_update_default_pg", None)
    unregister = getattr(c10d, "_unregister_all_process_groups", None)
    if update is None or unregister is None or any(t is None for t in tables):
        # A torch whose private tables differ: destroy the groups the usual way (checked
        # before anything is changed, so that that way still finds the default group).
        log.warning("torch %s keeps its process groups elsewhere; destroying them",
                    _torch_version())  # fmt: skip
        with _Watchdog("NCCL group teardown"):
            try:
                dist.destroy_process_group()
            except Exception as exc:  # a broken group: nothing of it is used again
                log.warning("destroying the old process group failed: %s", exc)
        return
    update(None)
    for table in tables:
        table.clear()
    unregister()
    _reset_group_names()


_GROUP_TABLES = ("pg_map", "pg_names", "pg_group_ranks", "pg_backend_config", "pg_to_tag",
                 "tags_to_pg", "pg_coalesce_state")  # fmt: skip
"""torch's tables of process groups (``distributed_c10d._world``), emptied as torch's own
``_abort_process_group`` empties them."""


def run(
    train: Callable[[Context], Any],
    *,
    env: Mapping[str, str] | None = None,
    backend: str | None = None,
    timeout: timedelta = timedelta(minutes=10),
) -> Any:
    """Run ``train(ctx)`` once per round until it returns; its return value is returned.

    Under an agent with ``restart.mode: inprocess`` a round that ends under ``train`` (a
    failed collective, or the agent's abort) is followed by the next one in this process;
    an exception that is not about communication (a bug in ``train``) propagates, and so
    does a second failed recovery in a row. Elsewhere ``train`` runs once."""
    import torch

    env = first_round_env(env)
    if backend is None:
        backend = "nccl" if torch.cuda.is_available() else "gloo"
    path = env.get(ENV_CONTROL) if env.get(ENV_MODE) == "inprocess" else None
    if path and "nccl" in backend:
        for line in set_nccl_inprocess_env(os.environ):
            print(f"elasticd.inprocess: {line}", file=sys.stderr, flush=True)
    local_rank = int(env.get("LOCAL_RANK", "0") or 0)
    if "nccl" in backend:
        _set_device(local_rank)
    control = None
    warming = None
    if path:
        warm = _warm_control
        if warm is not None and warm.path == path and warm.local_rank == local_rank:
            control = warm
        else:
            control = _Control(path, local_rank, env)
            warming = warm_imports()
        global _current
        _current = control
    state: dict[str, Any] = {}
    lived = 0
    failed_in_row = 0
    # Under an agent either way (restart.mode process too): a misuse ends the job (exit 2).
    under_agent = control is not None or bool(os.environ.get(ENV_HEARTBEAT))
    while True:
        round_ = int(env.get("ELASTICD_ROUND", "0") or 0)
        if control is not None:
            control.begin(round_)
            os.environ.update(env)
            # The newest step this process trained, over its rounds: each round's channel
            # starts with none (sync_state's check of a step handed over as None). A step
            # past the one the round resumed at, not a heartbeat of the resume step itself.
            if control.channel.reported_step():
                control.trained_step = control.channel.last_step
            # One preemption flag for every round's channel: a SIGTERM caught by an earlier
            # round's handler (the next one is installed by ``train``) is not lost.
            control.channel = WorkerChannel.from_env(env, preempt=control.channel.preempt_flag)
            if control.aborted_at is not None:  # the agent times the recovery's parts
                control.channel.mark("aborted", at=control.aborted_at)
            # This round's first heartbeat: a worker carried into a round that never
            # writes it is still stuck in the round before (the agent's ROUND_BEGIN_TIMEOUT).
            control.channel.mark("begun")
        ctx = Context(
            round=round_, rank=int(env.get("RANK", "0")), world_size=int(env.get("WORLD_SIZE", "1")),
            local_rank=local_rank, env=env, state=state, rounds_lived=lived, _control=control,
        )  # fmt: skip
        if control is not None and ctx.world_size == 1:
            # Alone in its world no collective fails at the round's end: a script that
            # records each step leaves an ended round there, without a ctx.check() of its
            # own. (With peers the shut sockets end it; what the script does after its
            # record, a save, is left as it was.)
            control.channel.after_record = ctx.check
        opened = False
        try:
            ctx.check()  # ended already (the agent's abort came with its start, or before)
            ctx.store = _open_round(env, backend=backend, timeout=timeout, aborted=ctx.aborted)
            opened = True
            ctx.mark("pg_ready")
            if warming is not None:  # never import torch's modules from two threads at once
                warming.join()
                warming = None
            with train_call():
                result = train(ctx)
        except BaseException as exc:
            if control is not None and isinstance(exc, PeerPreempted):
                # Not a failure: every rank completed the step and its save. The preempted
                # node's workers exit; ours wait for the world without it, state in hand.
                # Left first: an abort from the agent meanwhile (the preempted node's
                # lease revoked) must not shut the sockets the group is tearing down.
                # Torn down as an aborted round (the same on gloo): on NCCL the
                # preempted peers' communicators are going, and only the abort is
                # bounded (a watchdog) without them.
                control.left(round_)
                _close_round(abort=True)
                control.aborted_at = time.time()
                print(f"elasticd.inprocess: round {round_} ended (a peer node is preempted; "
                      "the step is saved); waiting for the next one", file=sys.stderr,
                      flush=True)  # fmt: skip
                control.channel.peer_preempted()
                env = control.next_round(round_)
                lived += 1
                continue
            if (
                control is None
                or not isinstance(exc, Exception)  # Ctrl-C, sys.exit(): never a round's end
                or not (control.aborted(round_) or is_comm_error(exc))
            ):
                _close_round(abort=True)
                if control is not None:
                    control.left(round_)
                _release_held_groups(wait=RELEASE_WAIT)
                if isinstance(exc, MisuseError) and under_agent:
                    if control is not None:
                        control.channel.fault(f"MisuseError: {str(exc)[:300]}")
                    print(f"elasticd.inprocess: error: {exc}", file=sys.stderr, flush=True)
                    raise SystemExit(USER_ERROR_EXIT_CODE) from None
                raise
            # A round the agent ended before its group opened (the world changed during the
            # hand-over) is no failed recovery: only the others count toward the fallback.
            counted = opened or not control.aborted(round_)
            trained = state.get("_stepped") or control.channel.reported_step()
            if counted:
                state["_stepped"] = False
            _leave_round(control, round_, exc)
            if counted:
                # Nor is one the agent ended for a world that grows. Its reason is waited
                # for: the agent writes it (or the next round's record, which names it)
                # before it starts the next round, which this process waits for anyway.
                reason = control.end_reason(round_, wait=END_REASON_WAIT)
                if reason in NOT_FAILURES:  # a round that trained starts the count anew:
                    # the hand-over to the grown world is a recovery like any other
                    failed_in_row = 1 if trained else failed_in_row
                else:
                    failed_in_row = failed_in_row + 1 if not trained else 1
            if failed_in_row >= MAX_FAILED_RECOVERIES:
                print(f"elasticd.inprocess: {failed_in_row - 1} recoveries in a row failed "
                      "before a step; exiting for a process restart", file=sys.stderr, flush=True)  # fmt: skip
                _release_held_groups(wait=RELEASE_WAIT)
                raise SystemExit(EXIT_RECOVERY_FAILED) from exc
            env = control.next_round(round_)
            lived += 1
            continue
        # Only the teardown and the process's exit are left: no hang_timeout for them.
        ctx.channel.finished()
        _close_round(abort=False)
        _release_held_groups(wait=RELEASE_WAIT)  # the process ends: none left for its teardown
        if control is not None:
            control.left(round_)  # what the process does after run() is not the round's
        return result


def stepped(ctx: Context) -> None:
    """Note that this round completed a training step (a later failure is a fresh one,
    not a failed recovery). The built-in trainer calls it after every step. A round whose
    channel reported a step (``ctx.channel.progress`` or ``record``) counts as one that
    stepped too."""
    ctx.state["_stepped"] = True


def _set_device(local_rank: int) -> None:
    """Make ``cuda:<local_rank>`` this process's device before its NCCL groups are made
    (the agent shows each worker all of its node's devices for the job: without this every
    local rank's groups would be on ``cuda:0``). With one device visible, that one."""
    import torch

    if torch.cuda.is_available():
        with contextlib.suppress(ValueError):
            local_device(local_rank)


def local_device(local_rank: int) -> Any:
    """This process's device, made current: ``cuda:<local_rank>`` when the node's devices
    are all visible (the agent), the one visible device when each process sees only its
    own (torchrun or Slurm with per-task devices: ``cuda:<local_rank>`` would not exist),
    the CPU without CUDA. ValueError when several are visible but not that many."""
    import torch

    if not torch.cuda.is_available():
        return torch.device("cpu")
    n = torch.cuda.device_count()
    if 0 <= local_rank < n:
        index = local_rank
    elif n == 1:
        index = 0
    else:
        raise ValueError(f"LOCAL_RANK {local_rank} but {n} CUDA devices are visible")
    torch.cuda.set_device(index)
    return torch.device("cuda", index)


def _leave_round(control: _Control, round_: int, exc: BaseException) -> None:
    """A round of ours failed: tell the agent, free our peers, tear the group down."""
    now = time.time()
    if not control.aborted(round_):
        control.channel.fault(f"{type(exc).__name__}: {str(exc)[:300]}")
    control.abort_sockets(round_)  # peers blocked on us fail at once
    control.aborted_at = time.time()
    print(f"elasticd.inprocess: round {round_} ended ({type(exc).__name__}: "
          f"{str(exc)[:200]}); waiting for the next one", file=sys.stderr, flush=True)  # fmt: skip
    _close_round(abort=True)
    control.left(round_)
    log.debug("left round %d in %.3f s", round_, time.time() - now)


__all__ = [
    "ENV_CONTROL",
    "ENV_HEARTBEAT",
    "ENV_WARM",
    "ENV_WARM_READY",
    "STANDBY_LOCAL_RANK",
    "Context",
    "ElasticBatchSampler",
    "GeneratorSnapshot",
    "MisuseError",
    "PeerPreempted",
    "RoundAborted",
    "StateTensors",
    "abort_nccl_communicators",
    "check_results",
    "ddp_comm_hook",
    "first_round_env",
    "is_comm_error",
    "run",
    "state_tensors",
    "stepped",
    "wait_collective",
]
