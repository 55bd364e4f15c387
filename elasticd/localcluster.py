"""A whole cluster on one machine: etcd and N agents as separate processes.

``elasticd run``, the tests and ``bench/chaos.py`` use it. Agents are real ``elasticd agent``
processes with their own state dirs; faults are injected the way the real thing happens:
SIGKILL of an agent and its workers, SIGKILL or SIGSTOP of one worker, SIGTERM of an agent,
a new agent, a whole node frozen (SIGSTOP of the agent and every process under it, SIGCONT
later), etcd stopped altogether, or one member of a 3-member etcd killed.
Everything lives under ``<base_dir>``: ``etcd/``, ``node-<i>/`` and ``agent-<i>.log``.

Faults that end by themselves (a thaw, etcd coming back) end on a timer thread, so whoever
injected them carries on meanwhile; :attr:`LocalCluster.fault_log` records both ends.
"""

from __future__ import annotations

import contextlib
import dataclasses
import heapq
import itertools
import json
import logging
import math
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from elasticd.agent.workers import prints_stacks, with_pdeathsig
from elasticd.errors import ElasticdError, UsageError
from elasticd.jobs import RECOVERY_PARTS, brief, event_lines, shown_restarts
from elasticd.log import kv

log = logging.getLogger("elasticd.localcluster")

FAULT_KINDS = (
    "kill-node", "kill-worker", "hang-worker", "term-node", "add-node", "freeze-node",
    "restart-node", "etcd-outage", "kill-etcd-member", "kill-etcd-leader", "raise-error", "fail-collective",
)  # fmt: skip
NODE_FAULTS = frozenset({"kill-node", "term-node", "freeze-node", "restart-node"})
"""Faults whose target is a node index."""
RANK_FAULTS = frozenset({"kill-worker", "hang-worker", "raise-error", "fail-collective"})
"""Faults whose target is a global rank."""
ETCD_MEMBER_FAULTS = frozenset({"kill-etcd-member", "kill-etcd-leader"})
"""Faults that need an etcd of several members."""
DEFAULT_FOR = {"freeze-node": 10.0, "etcd-outage": 10.0, "kill-etcd-member": 5.0,
               "kill-etcd-leader": 5.0}  # fmt: skip
"""Seconds a timed fault lasts when the spec gives no ``:for=T``."""
_NO_TARGET = frozenset({"add-node", "etcd-outage", "kill-etcd-leader"})
MAX_FOR = 3600.0
FAULT_SYNTAX = (
    "kill-node=I, term-node=I, freeze-node=I[:for=T], restart-node=I, kill-worker=RANK, "
    "hang-worker=RANK, "
    "raise-error=RANK, fail-collective=RANK, kill-etcd-member=I[:for=T] (each @step=S), or "
    "add-node@step=S, etcd-outage@step=S[:for=T], kill-etcd-leader@step=S[:for=T]; any of "
    "them [:phase=forward|backward|optimizer|update|step-end|checkpoint-save|recover]"
)
TESTING_FAULT_SYNTAX = FAULT_SYNTAX.replace(", kill-etcd-member=I[:for=T]", "").replace(
    ", kill-etcd-leader@step=S[:for=T]", ""
)
"""The faults ``elasticd.testing`` takes: its etcd is of one member."""
_FAULT_RE = re.compile(
    r"^(?P<kind>[a-z-]+)(?:=(?P<target>\d+))?@step=(?P<step>\d+)(?P<opts>(?::[a-z]+=[^:@=]+)*)$"
)


@dataclass(frozen=True, kw_only=True, slots=True)
class Fault:
    """One injected fault: ``kind`` of node/rank/member ``target`` once step ``step`` completed."""

    kind: str
    """One of FAULT_KINDS."""
    target: int | None
    """Node index (kill-node, term-node, freeze-node), global rank (kill-worker,
    hang-worker) or etcd member index (kill-etcd-member); None for the others."""
    step: int
    """Fire once a step >= this has completed."""
    duration: float | None = None
    """Seconds until the fault ends by itself (thaw, etcd restarted); timed kinds only."""
    phase: str | None = None
    """With a phase the workers fire it themselves, inside step ``step`` (the step in
    progress; for checkpoint-save the step being saved; for recover, the first in-process
    recovery at this step or a later one, the step the state is recovered at) as that
    phase begins
    (elasticd/faultplan.py); without one the cluster fires it once step ``step``
    completed."""

    def __str__(self) -> str:
        target = "" if self.target is None else f"={self.target}"
        lasts = "" if self.duration is None else f":for={self.duration:g}"
        phase = "" if self.phase is None else f":phase={self.phase}"
        return f"{self.kind}{target}@step={self.step}{lasts}{phase}"


def parse_fault(text: str) -> Fault:
    """``kill-node=1@step=8``, ``freeze-node=1@step=8:for=5``,
    ``kill-worker=1@step=5:phase=checkpoint-save`` → Fault; a malformed spec is a one-line
    UsageError."""
    from elasticd.faultplan import PHASES

    m = _FAULT_RE.match(text.strip())
    if not m or m.group("kind") not in FAULT_KINDS:
        raise UsageError(f"--fault {text!r}: expected one of {FAULT_SYNTAX}")
    kind, target = m.group("kind"), m.group("target")
    opts: dict[str, str] = {}
    for part in m.group("opts").split(":")[1:]:
        key, _, value = part.partition("=")
        if key not in ("for", "phase") or key in opts:
            raise UsageError(f"--fault {text!r}: unknown or repeated option :{key}= "
                             "(options: :for=T, :phase=P)")  # fmt: skip
        opts[key] = value
    phase = opts.get("phase")
    if phase is not None and phase not in PHASES:
        raise UsageError(f"--fault {text!r}: phase={phase} is not one of {', '.join(PHASES)}")
    if kind in _NO_TARGET and target is not None:
        raise UsageError(f"--fault {text!r}: {kind} takes no target ({kind}@step=S)")
    if kind not in _NO_TARGET and target is None:
        raise UsageError(f"--fault {text!r}: {kind} needs a target ({kind}=N@step=S)")
    step = int(m.group("step"))
    if step < 1:
        raise UsageError(f"--fault {text!r}: step must be >= 1")
    duration = DEFAULT_FOR.get(kind)
    if "for" in opts:
        if duration is None:
            raise UsageError(
                f"--fault {text!r}: {kind} takes no :for=T (it does not end by itself)"
            )
        try:
            duration = float(opts["for"])
        except ValueError:
            duration = math.nan
        if not 0 < duration <= MAX_FOR:  # also catches nan
            raise UsageError(
                f"--fault {text!r}: for={opts['for']} must be seconds in (0, {MAX_FOR:g}]"
            )
    return Fault(kind=kind, target=None if target is None else int(target), step=step,
                 duration=duration, phase=phase)  # fmt: skip


def check_plan(
    *,
    nodes_min: int,
    nproc: int,
    nodes: int,
    faults: Sequence[Fault],
    etcd_members: int,
    where: str = "job.yaml",
    steps: int | None = None,
    restart_mode: str | None = None,
    nodes_start: int | None = None,
) -> None:
    """Refuse, before anything starts, a local cluster that can never run the job or
    faults that can never apply (one-line UsageErrors).

    A local cluster has exactly the agents it starts plus one per add-node fault, and a
    fault fires only once a step has completed: so the job needs ``nodes.min`` agents at
    the start (an add-node fault cannot help it start), and a fault that removes a node
    for good (kill-node, term-node) must leave ``nodes.min`` of them, counting the
    add-node faults of the same step (one set for a later step never fires while the job
    stands still). A node fault's target must exist by its step (an add-node of a later
    step, or one fired after the step when the fault fires inside it, has not started it
    yet) and not be killed by then (unless a restart-node brought it back); a
    recover-phase fault fires at a later step than it names and is not checked so. A
    fault the cluster fires (no phase, not one a worker raises) at the job's last step
    would hit a finished job; it is refused.
    """
    if nodes < nodes_min:
        raise UsageError(
            f"{where}: nodes.min: the job needs {nodes_min} nodes to start, but this local "
            f"cluster starts {nodes} (--nodes); it could never start (add-node faults fire only "
            "after a step)"
        )
    if nodes_start is not None and nodes < nodes_start:
        raise UsageError(
            f"{where}: nodes.start: the job's first world waits for {nodes_start} nodes, but "
            f"this local cluster starts {nodes} (--nodes); it could never start"
        )
    from elasticd.faultplan import worker_side

    most = nodes + sum(f.kind == "add-node" for f in faults)
    for f in faults:
        if f.phase == "recover" and restart_mode == "process":  # it would never fire
            raise UsageError(
                f"--fault {f}: the recover phase is inside an in-process recovery, and "
                f"{where} restarts every process (restart.mode: process)"
            )
        if steps is not None and f.step > steps:  # it ran, never fired, and exited 0
            raise UsageError(
                f"--fault {f}: step {f.step} is past the job's last step (train.steps: {steps})"
            )
        if steps is not None and f.step == steps and not worker_side(f):
            # Fired once that step completed: the job is done by then, and a fault that
            # hits a finished job proves nothing.
            raise UsageError(
                f"--fault {f}: step {f.step} is the job's last step (train.steps: {steps}); "
                "the cluster fires a fault once its step completed, when nothing is left "
                "to recover: pick an earlier step, or a phase inside it (:phase=forward)"
            )
        if f.kind in RANK_FAULTS and f.target >= most * nproc:  # type: ignore[operator]
            raise UsageError(
                f"--fault {f}: there is no rank {f.target} (ranks 0..{most * nproc - 1})"
            )
        if f.kind in ETCD_MEMBER_FAULTS and etcd_members < 3:
            raise UsageError(f"--fault {f}: needs an etcd of 3 members (--etcd-members 3)")
        if f.kind == "kill-etcd-member" and f.target >= etcd_members:  # type: ignore[operator]
            raise UsageError(
                f"--fault {f}: there is no etcd member {f.target} (members 0..{etcd_members - 1})"
            )
    alive, started, killed = nodes, nodes, set()

    def when(f: Fault) -> tuple[int, int, bool]:
        # Inside step S (a phase) before after it (the cluster's); an add-node of S, when
        # both come after it, before the rest (the old rule: it may be what they need).
        return (f.step, 0 if f.phase is not None else 1, f.kind != "add-node")

    by_step = itertools.groupby(sorted(faults, key=when), lambda f: f.step)
    for _, group in by_step:
        removal = None
        for f in group:
            # A recover-phase fault fires at a later step than it names: no node check.
            if f.kind in NODE_FAULTS and f.phase != "recover":
                if f.target >= started:  # type: ignore[operator]
                    raise UsageError(
                        f"--fault {f}: there is no node {f.target} by step {f.step} "
                        f"(nodes 0..{started - 1})"
                    )
                if f.kind != "restart-node" and f.target in killed:
                    # (A preempted node may still be draining: a kill then is one.)
                    raise UsageError(f"--fault {f}: node {f.target} is killed by step {f.step}")
            if f.kind == "add-node":
                alive += 1
                started += 1
            elif f.kind in ("kill-node", "term-node"):
                if f.kind == "kill-node":
                    killed.add(f.target)
                alive, removal = alive - 1, f
            elif f.kind == "restart-node" and f.target in killed:
                killed.discard(f.target)  # its agent starts again
                alive += 1
        if removal is not None and alive < nodes_min:
            raise UsageError(
                f"--fault {removal}: leaves {alive} node{'s' * (alive != 1)}, fewer than "
                f"{where}'s nodes.min ({nodes_min}); the job could never go on"
            )


# -- processes --------------------------------------------------------------------------------


def _stat(pid: int) -> list[str] | None:
    """The fields of /proc/PID/stat after the command name (the state first), or None if
    the process is gone."""
    try:
        with open(f"/proc/{pid}/stat", encoding="utf-8") as fh:
            return fh.read().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None


def _start_time(pid: int) -> int | None:
    """The kernel's start time of ``pid`` (field 22 of /proc/PID/stat), or None if gone.
    A (pid, start time) pair names one process even after the pid is reused."""
    fields = _stat(pid)
    try:
        return int(fields[19]) if fields else None
    except (IndexError, ValueError):
        return None


FREEZE_SETTLE = 5.0
"""Seconds at most that :meth:`LocalCluster.freeze_node` waits for every process it sent
SIGSTOP to show as stopped: a signal takes effect when its process next runs, which on a
loaded machine can be a while after ``kill`` returned."""


def _await_stopped(pids: Sequence[int], timeout: float = FREEZE_SETTLE) -> bool:
    """Wait until every one of ``pids`` is stopped (state T) or gone (a zombie counts as
    gone); False on timeout."""
    deadline = time.monotonic() + timeout
    while True:
        states = [_stat(pid) for pid in pids]
        if all(f is None or f[0] in "TtZX" for f in states):  # stopped, or dead
            return True
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.01)


def descendants(root: int) -> list[int]:
    """Every process under ``root`` (children, their children, ...), from /proc."""
    children: dict[int, list[int]] = {}
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat", encoding="utf-8") as fh:
                ppid = int(fh.read().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        children.setdefault(ppid, []).append(int(name))
    out, todo = [], [root]
    while todo:
        for child in children.get(todo.pop(), []):
            out.append(child)
            todo.append(child)
    return out


def _signal(pid: int, sig: int) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, sig)


def _signal_same(pid: int, start: int | None, sig: int) -> bool:
    """Signal ``pid`` only if it is still the process that started at ``start``."""
    if start is None or _start_time(pid) != start:
        return False
    _signal(pid, sig)
    return True


def _stop_tree(root: int) -> list[tuple[int, int | None]]:
    """SIGSTOP ``root`` and every process under it; returns each one's (pid, start time)."""
    stopped = [(root, _start_time(root))]
    _signal(root, signal.SIGSTOP)  # first, so it starts no new worker meanwhile
    # A worker may have been forking while we looked; look again until nothing is new.
    for _ in range(5):
        new = [p for p in descendants(root) if p not in {q for q, _ in stopped}]
        if not new:
            break
        for pid in new:
            stopped.append((pid, _start_time(pid)))
            _signal(pid, signal.SIGSTOP)
    return stopped


class _Timer:
    """One long-lived thread that starts delayed actions (thaws, etcd restarts) when due,
    each on a thread of its own, so that an etcd member slow to come back does not hold
    up a thaw."""

    def __init__(self) -> None:
        self._heap: list[tuple[float, int, str, Callable[[], None]]] = []
        self._cv = threading.Condition()
        self._seq = itertools.count()
        self._closed = False
        self._thread: threading.Thread | None = None

    def after(self, delay: float, name: str, action: Callable[[], None]) -> None:
        with self._cv:
            if self._closed:
                return
            heapq.heappush(self._heap, (time.monotonic() + delay, next(self._seq), name, action))
            if self._thread is None:
                self._thread = threading.Thread(target=self._loop, name="fault-timer", daemon=True)
                self._thread.start()
            self._cv.notify()

    def _loop(self) -> None:
        while True:
            with self._cv:
                while not self._closed and (not self._heap or self._heap[0][0] > time.monotonic()):
                    self._cv.wait(self._heap[0][0] - time.monotonic() if self._heap else None)
                if self._closed:
                    return
                _, _, name, action = heapq.heappop(self._heap)
            threading.Thread(target=self._run, args=(name, action), name=name, daemon=True).start()

    @staticmethod
    def _run(name: str, action: Callable[[], None]) -> None:
        try:
            action()
        except Exception:  # a failed thaw or restart is logged; the others still run
            log.exception("timed fault action failed", **kv(action=name))

    def close(self) -> list[str]:
        """Stop the thread; returns the names of the actions that never ran."""
        with self._cv:
            self._closed = True
            dropped = [name for _, _, name, _ in sorted(self._heap)]
            self._heap.clear()
            self._cv.notify()
            thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout=60)
        return dropped


INTERRUPT_GRACE = 10.0
"""Seconds a first Ctrl-C of `elasticd run` gives the agents to stop (their workers told to
save their step and exit, as at a preemption) before everything left is SIGKILLed."""


@dataclass(kw_only=True, slots=True)
class CtrlC:
    """Ctrl-C (SIGINT) of an interactive run (`elasticd run`), while its ``with`` block is
    entered on the main thread. The first raises KeyboardInterrupt: the run unwinds, and its
    cluster stops gracefully within ``grace`` seconds, saying so in one line on ``out``. A
    second sets ``kill``: that stop SIGKILLs every agent and all under it at once.

    The handler only raises or sets the event: writing to ``out`` from a signal handler could
    land inside a write of the main thread's (a reentrant call on the same stream). Left
    with a KeyboardInterrupt, the block keeps ignoring SIGINT: the process is about to exit
    with 130 after saying so, and a late press must not turn that into a traceback."""

    out: Any
    """Where the one line goes (stderr)."""
    grace: float = INTERRUPT_GRACE
    kill: threading.Event = field(default_factory=threading.Event)
    """Set by a second Ctrl-C."""
    pressed: int = 0
    _previous: Any = None

    def _on_sigint(self, signum: int, frame: object) -> None:
        self.pressed += 1
        if self.pressed == 1:
            raise KeyboardInterrupt
        self.kill.set()

    def say_stopping(self) -> None:
        with contextlib.suppress(OSError, ValueError):  # a closed or broken stderr
            self.out.write(f"stopping: the workers save their step, for {self.grace:g} s at "
                           "most; Ctrl-C again to kill\n")  # fmt: skip
            self.out.flush()

    def __enter__(self) -> CtrlC:
        self._previous = signal.signal(signal.SIGINT, self._on_sigint)
        return self

    def __exit__(self, exc_type: object, *exc: object) -> None:
        if exc_type is KeyboardInterrupt:
            signal.signal(signal.SIGINT, signal.SIG_IGN)
        else:
            signal.signal(signal.SIGINT, self._previous)


# -- the cluster ------------------------------------------------------------------------------


@dataclass(kw_only=True, slots=True)
class LocalCluster:
    """An etcd (one embedded member, or ``etcd_members`` of a loopback cluster) and agents."""

    base_dir: str
    """Where etcd data, agent state dirs and agent logs go."""
    nproc: int
    """--nproc-per-node of every agent."""
    cwd: str = field(default_factory=os.getcwd)
    """Working directory of the agents (and so of their workers)."""
    env: dict[str, str] = field(default_factory=lambda: dict(os.environ))
    """Environment of the agents."""
    python: str = sys.executable
    """Interpreter that runs the agents."""
    etcd_members: int = 1
    """1: one embedded etcd; 3 (or 5): an EtcdCluster, every agent given every member."""
    etcd: Any = None
    """The EmbeddedEtcd or EtcdCluster, once started."""
    metrics: bool = False
    """Serve each agent's Prometheus metrics on a free port (see ``metrics_ports``)."""
    agents: list[subprocess.Popen] = field(default_factory=list)
    """Agent processes by node index."""
    metrics_ports: list[int] = field(default_factory=list)
    """Each agent's metrics port (0: off)."""
    _port_holds: list[socket.socket] = field(init=False, default_factory=list, repr=False)
    """The metrics ports, held (``reserve_port``) while the cluster runs: an agent binds
    its port only after its Python start, and a port merely free now may be gone by then."""
    agent_args: tuple[str, ...] = ()
    """More `elasticd agent` options for every agent (e.g. --keep-finished-metrics 5s)."""
    fault_log: list[dict[str, Any]] = field(default_factory=list)
    """One record per injected fault: ``fault``, ``kind``, ``t``, ``detail``, and ``end``
    (``{"t", "detail"}``) once a timed fault is over. Read it under ``lock``."""
    lock: threading.Lock = field(default_factory=threading.Lock)
    """Guards ``fault_log`` and the frozen-node table against the timer thread."""
    _frozen: dict[int, list[tuple[int, int | None]]] = field(default_factory=dict)
    _timer: _Timer = field(default_factory=_Timer)
    _etcd_lock: threading.Lock = field(default_factory=threading.Lock)
    """Serialises starting and stopping etcd members (the timer's restarts, an outage)."""
    _closing: bool = False
    """Set by stop(): a pending restart must not start an etcd nobody will stop."""
    kill_on_error: bool = False
    """An exception out of the cluster's ``with`` block (a test's timeout, Ctrl-C) ends it
    with ``stop(kill=True)``: nobody waits for that run's workers to save."""
    ctrl_c: CtrlC | None = None
    """Ctrl-C handling of an interactive run: a KeyboardInterrupt out of the ``with`` block
    stops the cluster gracefully within ``ctrl_c.grace`` s, or at once on a second Ctrl-C."""

    @property
    def endpoint(self) -> str:
        """Every etcd member's ``host:port``, comma-separated (what agents get as --etcd)."""
        assert self.etcd is not None
        return ",".join(self.endpoints)

    @property
    def endpoints(self) -> tuple[str, ...]:
        assert self.etcd is not None
        return tuple(self.etcd.endpoints) if self.etcd_members > 1 else (self.etcd.endpoint,)

    def start(self, nodes: int) -> LocalCluster:
        from elasticd.etcd import EmbeddedEtcd, EtcdCluster

        if self.etcd_members < 1 or self.etcd_members % 2 == 0:
            raise UsageError(f"--etcd-members: {self.etcd_members} must be an odd number >= 1")
        os.makedirs(self.base_dir, exist_ok=True)
        data = os.path.join(self.base_dir, "etcd")
        if self.etcd_members == 1:
            self.etcd = EmbeddedEtcd(data_dir=data).start()
        else:
            self.etcd = EtcdCluster(base_dir=data, size=self.etcd_members).start()
        for _ in range(nodes):
            self.add_node()
        return self

    def state_dir(self, index: int) -> str:
        return os.path.join(self.base_dir, f"node-{index}")

    def add_node(self) -> int:
        """Start one more agent; returns its node index."""
        from elasticd.etcd import reserve_port

        index = len(self.agents)
        port = 0
        if self.metrics:
            self._port_holds.append(reserve_port())
            port = self._port_holds[-1].getsockname()[1]
        self.agents.append(self._launch(index, port))
        self.metrics_ports.append(port)
        return index

    def restart_node(self, index: int) -> None:
        """SIGKILL node ``index``'s agent and workers and start its agent again at once,
        under the same node id and state directory: a machine that reboots (or an agent
        a supervisor restarts) faster than its lease expires."""
        self.kill_node(index)
        # Its metrics port is still held (reserve_port): the new agent binds it as the
        # first did.
        self.agents[index] = self._launch(index, self.metrics_ports[index])

    def _launch(self, index: int, port: int) -> subprocess.Popen:
        argv = [
            self.python, "-m", "elasticd", "agent", "--etcd", self.endpoint,
            "--node-id", f"node-{index}", "--addr", "127.0.0.1",
            "--nproc-per-node", str(self.nproc), "--state-dir", self.state_dir(index),
            "--metrics-port", str(port), "--allow-commands",  # a local cluster runs its user's own jobs
            *self.agent_args,
        ]  # fmt: skip
        log_file = open(os.path.join(self.base_dir, f"agent-{index}.log"), "ab")  # noqa: SIM115
        with log_file:
            proc = subprocess.Popen(
                with_pdeathsig(argv, self.python),  # agents go when `elasticd run` goes
                cwd=self.cwd,
                env=self.agent_env(index),
                stdin=subprocess.DEVNULL,
                stdout=log_file,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        return proc

    def agent_env(self, index: int) -> dict[str, str]:
        """Node ``index``'s agent's environment, which its workers inherit. The node id
        reaches the workers (phase-keyed node faults find their node). Each node is an
        NCCL host of its own (``NCCL_HOSTID``): its ranks use ``cuda:LOCAL_RANK``, so the
        nodes of a local cluster share the machine's GPUs, and NCCL refuses two ranks of
        one host on one device; as separate hosts they talk through NCCL's network
        transport, as real nodes do (on a single-GPU machine too)."""
        return {
            **self.env,
            "ELASTICD_ETCD": self.endpoint,
            "ELASTICD_NODE_ID": f"node-{index}",
            "NCCL_HOSTID": f"{self.env.get('NCCL_HOSTID') or socket.gethostname()}-node-{index}",
        }

    def alive_nodes(self) -> list[int]:
        """Indices of agents that run and are not frozen."""
        with self.lock:
            frozen = set(self._frozen)
        return [i for i, p in enumerate(self.agents) if p.poll() is None and i not in frozen]

    def worker_pids(self, index: int) -> dict[int, int]:
        """Global rank → pid of node ``index``'s current workers."""
        try:
            with open(os.path.join(self.state_dir(index), "workers.json"), encoding="utf-8") as fh:
                return {int(r): int(p) for r, p in json.load(fh)["pids"].items()}
        except (OSError, ValueError, KeyError):
            return {}

    def running_workers(self) -> list[dict[str, Any]]:
        """The workers of live agents that have not exited (stopped ones included), in
        rank order: ``rank``, ``node`` (its index), ``pid``, ``log`` (the file its output
        goes to, from /proc: a carried or warm worker logs on in the file it started with)
        and ``size`` (the log's now; 0 and ``log`` None when it cannot be read)."""
        out = []
        for index, agent in enumerate(self.agents):
            if agent.poll() is not None:
                continue
            mine = None
            for rank, pid in self.worker_pids(index).items():
                fields = _stat(pid)
                # Still the agent's (workers.json outlives its round: a pid reused): its
                # child, or its fork server's (docs/agent.md, "Workers are forked").
                if fields is None or fields[0] in ("Z", "X"):
                    continue
                if fields[1] != str(agent.pid):
                    mine = set(descendants(agent.pid)) if mine is None else mine
                    if pid not in mine:
                        continue
                try:
                    path = os.readlink(f"/proc/{pid}/fd/1")
                    size = os.path.getsize(path)
                except OSError:
                    path, size = None, 0
                out.append({"rank": rank, "node": index, "pid": pid, "log": path, "size": size})
        return sorted(out, key=lambda w: w["rank"])

    # -- node and worker faults ---------------------------------------------------------------

    def dump_stacks(self, settle: float = 1.0) -> int:
        """Have every agent and built-in worker print its threads' stacks into its log (how a
        run that timed out is read afterwards); the number asked."""
        pids = []
        for agent in self.agents:
            if agent.poll() is None:
                pids += [agent.pid, *descendants(agent.pid)]
        asked = [pid for pid in pids if prints_stacks(pid)]
        for pid in asked:
            _signal(pid, signal.SIGUSR1)
        if asked:
            time.sleep(settle)
        return len(asked)

    def kill_node(self, index: int) -> None:
        """SIGKILL the agent and every process under it, as a machine dying would: all are
        stopped first, so none forks a child that escapes meanwhile (a script's data
        loader, a subprocess: no parent-death signal), then killed. An agent that exited
        already (and was reaped: its pid may be another process's now) is not signalled."""
        agent = self.agents[index]
        if agent.poll() is None:
            for pid, start in _stop_tree(agent.pid):
                _signal_same(pid, start, signal.SIGKILL)
        agent.wait(timeout=10)

    def term_node(self, index: int) -> None:
        """SIGTERM the agent: a preemption (systemd stop, Kubernetes eviction)."""
        _signal(self.agents[index].pid, signal.SIGTERM)

    def _rank_pid(self, rank: int) -> int:
        for index in range(len(self.agents)):
            pid = self.worker_pids(index).get(rank)
            if pid is not None and self.agents[index].poll() is None:
                return pid
        raise UsageError(f"no live worker has global rank {rank}")

    def kill_worker(self, rank: int) -> None:
        _signal(self._rank_pid(rank), signal.SIGKILL)

    def hang_worker(self, rank: int) -> None:
        """SIGSTOP one worker: it stops reporting progress and its peers block."""
        _signal(self._rank_pid(rank), signal.SIGSTOP)

    def freeze_node(self, index: int) -> list[int]:
        """SIGSTOP the agent and every process under it, as a VM paused or a machine stuck
        in the kernel would be, and wait until they show as stopped; returns the pids
        stopped. :meth:`thaw_node` undoes it."""
        agent = self.agents[index]
        if agent.poll() is not None:
            raise UsageError(f"node {index} is not running (its agent exited)")
        with self.lock:
            if index in self._frozen:
                raise UsageError(f"node {index} is frozen already")
            frozen = _stop_tree(agent.pid)
            self._frozen[index] = frozen
        pids = [pid for pid, _ in frozen]
        if not _await_stopped(pids):
            log.warning("freeze: not every process shows as stopped yet",
                        **kv(node=index, pids=pids, waited_s=FREEZE_SETTLE))  # fmt: skip
        return pids

    def thaw_node(self, index: int) -> int:
        """SIGCONT what :meth:`freeze_node` stopped (those processes still alive); returns
        how many were continued."""
        with self.lock:
            frozen = self._frozen.pop(index, [])
        # Workers first, the agent last: it then finds its workers running, as after a pause.
        return sum(_signal_same(pid, start, signal.SIGCONT) for pid, start in reversed(frozen))

    # -- etcd faults ----------------------------------------------------------------------------

    def _members(self) -> list[Any]:
        return list(self.etcd.members) if self.etcd_members > 1 else [self.etcd]

    def stop_etcd(self) -> None:
        """Stop every etcd member (SIGTERM), keeping data dirs and ports: each port stays
        held until :meth:`restart_etcd` (another test's etcd or TCPStore on a busy machine
        took one during a 2 s outage once)."""
        with self._etcd_lock:
            for m in self._members():
                m.stop(keep_ports=True)

    def restart_etcd(self, index: int | None = None, timeout: float = 30.0) -> None:
        """Start member ``index`` (or every member) again on its data dir and ports, if it
        is not running; wait until it answers.

        Run from a timer thread, the members are not tied to this process's death (the
        kernel's parent-death signal follows the forking thread); :meth:`stop` stops them.
        """
        members = self._members() if index is None else [self.etcd.members[index]]
        with self._etcd_lock:
            if self._closing:
                raise UsageError("the local cluster is stopping")
            for m in members:
                m.spawn()
        for m in members:  # outside the lock: an outage may stop them meanwhile
            m.wait_healthy(timeout)

    def kill_etcd_member(self, index: int) -> str:
        """SIGKILL one member, as a crash would; returns its name."""
        if self.etcd_members < 3:
            raise UsageError("killing an etcd member needs an etcd of 3 members")
        with self._etcd_lock:
            self.etcd.kill(index)
        return self.etcd.members[index].name

    def etcd_leader(self) -> int:
        """Index of the member that leads now."""
        leader = self.etcd.leader()
        return self.etcd.members.index(leader)

    # -- injection ------------------------------------------------------------------------------

    def inject(self, fault: Fault) -> dict[str, Any]:
        """Inject ``fault`` now; timed faults end on the timer thread. Returns its record in
        :attr:`fault_log` (``skipped`` set when it could not apply, e.g. no such rank now)."""
        record: dict[str, Any] = {"fault": str(fault), "kind": fault.kind, "t": time.time(),
                                  "detail": "", "end": None}  # fmt: skip
        try:
            record["detail"] = self._inject(fault, record)
        except ElasticdError as exc:
            record["skipped"] = True
            record["detail"] = f"not injected: {exc}"
        with self.lock:
            self.fault_log.append(record)
        return record

    def _inject(self, fault: Fault, record: dict[str, Any]) -> str:
        kind, target, lasts = fault.kind, fault.target, fault.duration or 0.0
        if kind in ("raise-error", "fail-collective"):
            raise UsageError(f"{fault}: only the workers can raise (run_cluster's fault plan)")
        if kind in NODE_FAULTS:
            index = self._node(fault)
            if kind != "restart-node" and self.agents[index].poll() is not None:
                # kill -9 of a dead agent "succeeds"; it proves nothing.
                raise UsageError(f"node {index} is not running (its agent exited)")
            if kind == "kill-node":
                self.kill_node(index)
                return f"node {index}: agent and workers SIGKILLed"
            if kind == "term-node":
                self.term_node(index)
                return f"node {index}: agent SIGTERMed"
            if kind == "restart-node":
                self.restart_node(index)
                return f"node {index}: agent and workers SIGKILLed, agent started again"
            pids = self.freeze_node(index)
            self._later(lasts, record, f"thaw node {index}",
                        lambda: f"node {index} thawed ({self.thaw_node(index)} processes)")  # fmt: skip
            return f"node {index} frozen ({len(pids)} processes: {' '.join(map(str, pids))})"
        if kind == "kill-worker":
            self.kill_worker(int(target))  # type: ignore[arg-type]
            return f"rank {target} SIGKILLed"
        if kind == "hang-worker":
            self.hang_worker(int(target))  # type: ignore[arg-type]
            return f"rank {target} SIGSTOPped"
        if kind == "add-node":
            return f"node {self.add_node()} started"
        if kind == "etcd-outage":
            self.stop_etcd()
            self._later(lasts, record, "restart etcd", self._etcd_back)
            return f"etcd stopped ({len(self._members())} member(s))"
        index = self.etcd_leader() if kind == "kill-etcd-leader" else int(target)  # type: ignore[arg-type]
        if not 0 <= index < self.etcd_members:
            raise UsageError(f"there is no etcd member {index}")
        name = self.kill_etcd_member(index)
        self._later(lasts, record, f"restart etcd member {name}",
                    lambda: self._member_back(index))  # fmt: skip
        return f"etcd member {index} ({name}) SIGKILLed"

    def _etcd_back(self) -> str:
        t0 = time.time()
        self.restart_etcd()
        return f"etcd restarted, healthy after {time.time() - t0:.2f}s"

    def _member_back(self, index: int) -> str:
        t0 = time.time()
        self.restart_etcd(index)
        return f"etcd member {index} restarted, healthy after {time.time() - t0:.2f}s"

    def _later(
        self, delay: float, record: dict[str, Any], name: str, action: Callable[[], str]
    ) -> None:
        def end() -> None:
            try:
                detail = action()
            except ElasticdError as exc:
                detail = f"{name} failed: {exc}"
            with self.lock:
                record["end"] = {"t": time.time(), "detail": detail}

        self._timer.after(delay, name, end)

    def _node(self, fault: Fault) -> int:
        index = int(fault.target)  # type: ignore[arg-type]
        if not 0 <= index < len(self.agents):
            raise UsageError(f"there is no node {index}")
        return index

    def stop(
        self, grace: float = 20.0, *, kill: bool = False, kill_now: threading.Event | None = None
    ) -> None:
        """Thaw frozen nodes, SIGTERM every agent, wait, SIGKILL stragglers, stop etcd.

        An agent's SIGTERM is a preemption: it gives its workers ``restart.grace_period``
        (30 s) to save, and a script that trains on through it holds the stop for all of
        ``grace``. ``kill``: SIGKILL every agent and every process under it at once
        instead (a run given up on: its saves are of no use to anyone). ``kill_now``: once
        set (a second Ctrl-C), the graceful stop turns into that kill."""
        with self._etcd_lock:
            self._closing = True
        self._timer.close()  # pending thaws run just below; pending etcd restarts are moot
        if kill or (kill_now is not None and kill_now.is_set()):
            self._kill_agents()
        else:
            self._stop_agents(grace, kill_now)
        # Workers need no sweep: each carries a parent-death SIGKILL, which reaches even a
        # SIGSTOPped one. (Killing pids from workers.json here could hit a reused pid.)
        from elasticd.etcd import release_ports

        release_ports(self._port_holds)
        if self.etcd is not None:
            with self._etcd_lock:
                self.etcd.stop()
            self.etcd = None

    def _stop_agents(self, grace: float, kill_now: threading.Event | None = None) -> None:
        """SIGTERM every agent, wait up to ``grace`` (or until ``kill_now`` is set), then
        kill the stragglers' whole trees."""
        with self.lock:
            frozen = list(self._frozen)
        for index in frozen:
            self.thaw_node(index)
        for proc in self.agents:
            if proc.poll() is None:
                _signal(proc.pid, signal.SIGTERM)
        deadline = time.monotonic() + grace
        for proc in self.agents:
            while proc.poll() is None and (kill_now is None or not kill_now.is_set()):
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                with contextlib.suppress(subprocess.TimeoutExpired):
                    proc.wait(timeout=left if kill_now is None else min(left, 0.05))
        if any(proc.poll() is None for proc in self.agents):
            self._kill_agents()

    def _kill_agents(self) -> None:
        """Each live agent's whole tree stopped first (it starts nothing meanwhile), then
        SIGKILLed: its workers, and what they started (which no parent-death signal of
        theirs covers), go with it, frozen or not."""
        for proc in self.agents:
            if proc.poll() is None:
                for pid, start in _stop_tree(proc.pid):
                    _signal_same(pid, start, signal.SIGKILL)
        with self.lock:
            self._frozen.clear()
        for proc in self.agents:
            proc.wait(timeout=10)

    def __enter__(self) -> LocalCluster:
        return self

    def __exit__(self, exc_type: object, *exc: object) -> None:
        if exc_type is KeyboardInterrupt and self.ctrl_c is not None and not self.kill_on_error:
            self.ctrl_c.say_stopping()
            self.stop(self.ctrl_c.grace, kill_now=self.ctrl_c.kill)
            return
        self.stop(kill=self.kill_on_error and exc_type is not None)


# -- metrics.jsonl ------------------------------------------------------------------------------


def read_metrics(path: str) -> list[dict]:
    """All records of a metrics.jsonl (torn last lines skipped)."""
    out = []
    try:
        with open(path, encoding="utf-8") as fh:
            for line in fh:
                try:
                    out.append(json.loads(line))
                except ValueError:
                    continue
    except OSError:
        pass
    return out


@dataclass(kw_only=True, slots=True)
class MetricsTail:
    """Reads the records appended to a metrics.jsonl since the last call (a long job's file
    is not re-read whole on every poll). A line not yet ended by a newline waits."""

    path: str
    """The metrics.jsonl."""
    offset: int = 0
    """Bytes consumed so far."""

    @classmethod
    def at_end(cls, path: str) -> MetricsTail:
        """A tail that skips what the file holds now (a resumed run's old records)."""
        try:
            return cls(path=path, offset=os.path.getsize(path))
        except OSError:
            return cls(path=path)

    def new(self) -> list[dict]:
        try:
            with open(self.path, "rb") as fh:
                fh.seek(self.offset)
                data = fh.read()
        except OSError:
            return []
        end = data.rfind(b"\n") + 1
        self.offset += end
        out = []
        for line in data[:end].splitlines():
            try:
                out.append(json.loads(line))
            except ValueError:
                continue
        return out


# -- following one job on a local cluster (`elasticd run`, bench/chaos.py) ----------------------

OUTPUT_MARKER = ".elasticd-output"
"""The file ``elasticd run`` leaves in an output dir it made; ``--fresh`` deletes only those."""
_OWN_NAMES = frozenset({"metrics.jsonl", "logs", "ckpt", "cluster", OUTPUT_MARKER,
                        "events.jsonl", "run.json", "report.html", "report.png"})  # fmt: skip


def _refuse_precious(path: str, what: str) -> None:
    """Never delete /, the home directory, the current directory or one of its parents."""
    real = os.path.realpath(path)
    cwd = os.path.realpath(os.getcwd())
    if real == os.path.realpath(os.sep) or real == os.path.realpath(os.path.expanduser("~")):
        raise UsageError(f"{what}: refusing to delete {path}")
    if cwd == real or cwd.startswith(real.rstrip(os.sep) + os.sep):
        raise UsageError(f"{what}: refusing to delete {path}: it holds the current directory")


def prepare_output_dir(path: str, *, fresh: bool) -> None:
    """Create ``path`` (after deleting it with ``fresh``) and mark it as elasticd's.

    ``fresh`` deletes only a directory that carries :data:`OUTPUT_MARKER`. The marker is
    written into a directory this call creates, or one that holds nothing but what
    elasticd itself writes there (an older run's output), never into a directory with
    other files in it, so that ``--fresh`` cannot delete someone's own files later.
    """
    path = os.path.abspath(path)
    if fresh and os.path.lexists(path):
        _refuse_precious(path, "--fresh")
        if os.path.islink(path) or not os.path.isdir(path):
            raise UsageError(f"--fresh: {path} is not a directory elasticd made; not deleted")
        if not os.path.isfile(os.path.join(path, OUTPUT_MARKER)):
            raise UsageError(
                f"--fresh: {path} was not made by elasticd (no {OUTPUT_MARKER} in it); "
                "delete it yourself or choose another output_dir"
            )
        import shutil

        shutil.rmtree(path)
    try:
        os.makedirs(path, exist_ok=True)
        if set(os.listdir(path)) <= _OWN_NAMES:
            marker = os.path.join(path, OUTPUT_MARKER)
            if not os.path.exists(marker):
                with open(marker, "w", encoding="utf-8") as fh:
                    fh.write("made by elasticd run; `elasticd run --fresh` may delete this dir\n")
    except OSError as exc:
        raise UsageError(f"output_dir: cannot use {path}: {exc.strerror or exc}") from exc


@dataclass(frozen=True, kw_only=True, slots=True)
class RunView:
    """What a fault source sees on each poll of :func:`run_cluster`."""

    step: int
    """Highest step completed in this run so far."""
    records: list[dict]
    """metrics.jsonl records appended since the last poll, in order."""
    record: Any
    """The job's JobRecord as last read (None before the first read)."""
    etcd_up: bool
    """Whether the last registry read answered."""
    cluster: LocalCluster
    """The cluster (alive nodes, worker pids, fault log)."""
    client: Any
    """The etcd client run_cluster uses."""


class AtSteps:
    """The ``--fault`` list: each fault fires once a step >= its ``step`` has completed."""

    def __init__(self, faults: Sequence[Fault]) -> None:
        self._pending = sorted(faults, key=lambda f: f.step)

    def due(self, view: RunView) -> list[Fault]:
        out = []
        while self._pending and view.step >= self._pending[0].step:
            out.append(self._pending.pop(0))
        return out

    def unfired(self) -> list[tuple[Fault, str]]:
        """(fault, why) for each fault that never fired."""
        return [(f, f"the job ended before step {f.step} completed") for f in self._pending]


def run_cluster(
    job: Any,
    *,
    nodes: int,
    faults: Sequence[Fault] | Any,
    timeout: float,
    out: Any,
    etcd_members: int = 1,
    poll: float = 0.02,
    record_poll: float = 0.1,
    env: Mapping[str, str] | None = None,
    progress: Any = None,
    metrics: bool = False,
    kill_on_error: bool = False,
    ctrl_c: CtrlC | None = None,
) -> dict[str, Any]:
    """Start the cluster, submit ``job``, inject ``faults`` (a list, fired by step or by
    the workers at a phase, or an object with ``due(RunView) -> list[Fault]`` and
    optionally ``fault_injected(fault, record)``), follow the job to its end. The metrics
    are read every ``poll`` seconds (faults fire within a step or two of the one asked for);
    the job's record, an etcd request, every ``record_poll``: at the 50 a second of
    ``poll`` the requests cost this process and etcd about a tenth of a core each, the
    whole run long. ``env``: the
    agents' environment (default ours). ``progress``: shows the job's progress as one live
    line (``show(record)``, ``say(text)`` for the lines above it, ``close()``; the CLI's
    on a terminal); without it, ``out`` gets a plain line per change. ``metrics``: each
    agent serves Prometheus metrics (and /healthz) on a free port, named in ``out``.
    ``kill_on_error``: an exception that ends the run early (a test's timeout) SIGKILLs the
    agents and all under them rather than waiting out their workers' preemption grace.
    ``ctrl_c``: the interactive run's :class:`CtrlC` (its KeyboardInterrupt stops the
    cluster gracefully but bounded, a second Ctrl-C kills it at once); the exception goes on.

    Returns the job's final record as a dict, with ``faults`` (each injected fault's record,
    both ends of the timed ones) and ``metrics`` (the records this run appended); after a
    timeout also ``timed_out`` (the seconds) and ``unfinished`` (the workers still running
    then, :meth:`LocalCluster.running_workers`).
    """
    from elasticd.etcd import connect
    from elasticd.faultplan import ENV_PLAN, PlanSource, worker_side, write_plan
    from elasticd.jobs import JobRegistry, JobState

    job = starting_on(job, nodes)
    base = os.path.join(job.out_dir, "cluster")
    agents_env = dict(os.environ if env is None else env)
    if isinstance(faults, Sequence):
        inside = [f for f in faults if worker_side(f)]
        source = AtSteps([f for f in faults if not worker_side(f)])
        if inside:
            plan_dir = os.path.join(base, "faults")
            agents_env[ENV_PLAN] = write_plan(plan_dir, inside)
            source = PlanSource(plan_dir, inside, source)
    else:
        source = faults
    tail = MetricsTail.at_end(os.path.join(job.out_dir, "metrics.jsonl"))
    records: list[dict] = []
    cluster = LocalCluster(base_dir=base, nproc=job.nproc_per_node, etcd_members=etcd_members,
                           env=agents_env, metrics=metrics,
                           kill_on_error=kill_on_error, ctrl_c=ctrl_c)  # fmt: skip
    record, timed_out, step, announced = None, False, 0, 0
    final_out = out
    if progress is not None:
        out = _Say(progress)
    with cluster, contextlib.ExitStack() as closing:
        if progress is not None:
            closing.callback(progress.close)
        cluster.start(nodes)
        what = "etcd" if etcd_members == 1 else f"etcd cluster ({etcd_members} members)"
        agents = "1 agent" if nodes == 1 else f"{nodes} agents"
        out.write(f"local cluster: {what} {cluster.endpoint}, {agents}, logs in {base}\n")
        if metrics:
            urls = ", ".join(f"http://127.0.0.1:{p}/metrics" for p in cluster.metrics_ports)
            out.write(f"agent metrics: {urls}\n")
        # A short client timeout keeps the loop (and the faults) going while etcd is away.
        config = cluster.etcd.client_config(timeout=1.0, request_timeout=0.5)
        with connect(config) as client:
            registry = JobRegistry(client)
            _wait_for_agents(client, cluster, nodes, timeout=60.0)
            registry.submit(job, replace=True)
            deadline = time.monotonic() + timeout
            last_line, etcd_up, record_due = "", True, 0.0
            seen: set[tuple] = set()
            while True:
                new = tail.new()
                records.extend(new)
                step = max([step, *(int(r.get("step", 0)) for r in new)])
                if time.monotonic() >= record_due:
                    try:
                        record, etcd_up = registry.get(job.name), True
                    except ElasticdError:
                        etcd_up = False
                    record_due = time.monotonic() + record_poll
                view = RunView(step=step, records=new, record=record, etcd_up=etcd_up,
                               cluster=cluster, client=client)  # fmt: skip
                for fault in source.due(view):
                    fired = cluster.inject(fault)
                    # A fault a worker asked for in a phase: the step it was in (the records
                    # say only the one before), as for the faults the workers carry out.
                    at = source.step_of(fault) if hasattr(source, "step_of") else None
                    fired["step"] = step if at is None else at
                    if hasattr(source, "fault_injected"):
                        source.fault_injected(fault, fired)
                    where = f"step {step}" if at is None else f"step {at}, in {fault.phase}"
                    out.write(f"fault {_verb(fired)}: {fault} (at {where}){_detail(fired)}\n")
                announced = _announce_ends(cluster, announced, out)
                if record is not None and etcd_up:
                    for said in event_lines(record.status, seen, final=record.state.terminal):
                        out.write(said + "\n")
                line = _progress(record, step) if etcd_up else f"  etcd unreachable: step {step}"
                if progress is not None and etcd_up and record is not None:
                    progress.show(record)
                    last_line = line
                elif line != last_line:
                    out.write(line + "\n")
                    out.flush()
                    last_line = line
                if record is not None and etcd_up and record.state.terminal:
                    break
                if time.monotonic() > deadline:
                    timed_out = True
                    reason = f"timed out after {timeout:g} s"
                    # Before the stacks: each log's size says what it printed until now.
                    unfinished = cluster.running_workers()
                    ranks = ", ".join(f"{w['rank']} (node-{w['node']})" for w in unfinished)
                    out.write(f"ranks still running at the timeout: {ranks or 'none'}\n")
                    dumped = cluster.dump_stacks()
                    out.write(f"{dumped} agents and workers printed their stacks into their logs\n")
                    with contextlib.suppress(ElasticdError):
                        registry.set_state(job.name, JobState.CANCELLED, reason)
                    out.write(f"{reason}; job cancelled\n")
                    time.sleep(2)
                    with contextlib.suppress(ElasticdError):
                        record = registry.get(job.name)
                    if record is not None:  # the last failure's cause, decided or not
                        for said in event_lines(record.status, seen, final=True):
                            out.write(said + "\n")
                    break
                time.sleep(poll)  # faults fire within a step or two of the one asked for
    _announce_ends(cluster, announced, final_out)
    out = final_out
    final = record.to_dict() if record is not None else {"name": job.name, "state": "unknown"}
    if timed_out:
        final["timed_out"] = timeout
        final["unfinished"] = unfinished
    # A fault that never fired is said, never dropped: a fault test whose fault missed
    # (no step S, no rank reaching the phase) must not pass as if it had survived it.
    for fault, why in getattr(source, "unfired", lambda: [])():
        if timed_out:  # the job did not end: the run gave up on it
            why = why.replace("the job ended", f"the run timed out after {timeout:g} s", 1)
        out.write(f"fault never fired: {fault}: {why}\n")
        with cluster.lock:
            cluster.fault_log.append({"fault": str(fault), "kind": fault.kind, "t": None,
                                      "detail": f"never fired: {why}", "end": None,
                                      "skipped": True, "unfired": True})  # fmt: skip
    with cluster.lock:
        final["faults"] = [dict(f) for f in cluster.fault_log]
    records.extend(tail.new())
    final["metrics"] = records
    return final


class _Say:
    """``out`` for run_cluster's event lines while a live progress line is shown."""

    def __init__(self, progress: Any) -> None:
        self.progress = progress

    def write(self, text: str) -> None:
        self.progress.say(text)

    def flush(self) -> None:
        pass


def _verb(fired: dict[str, Any]) -> str:
    return "skipped" if fired.get("skipped") else "injected"


def _detail(fired: dict[str, Any]) -> str:
    """What a fault did, where its spec does not say it all (whom it froze, which member)."""
    plain = fired["kind"] in ("kill-node", "term-node", "kill-worker", "hang-worker", "add-node")
    return "" if plain and not fired.get("skipped") else f": {fired['detail']}"


def _announce_ends(cluster: LocalCluster, announced: int, out: Any) -> int:
    """Print the end of each timed fault once; returns how many faults are settled."""
    with cluster.lock:
        log_ = list(cluster.fault_log)
    while announced < len(log_):
        f = log_[announced]
        if f.get("skipped") or DEFAULT_FOR.get(f["kind"]) is None:
            announced += 1
            continue
        if f["end"] is None:
            break
        out.write(f"fault over: {f['fault']}: {f['end']['detail']} "
                  f"({f['end']['t'] - f['t']:.2f}s after it began)\n")  # fmt: skip
        announced += 1
    return announced


def starting_on(job: Any, nodes: int) -> Any:
    """``job`` with ``nodes.start`` set to the ``nodes`` agents this cluster starts
    (within ``nodes.min``..``nodes.max``) when the job leaves it unset.

    Without it the first world closed once ``nodes.min`` agents had joined and nobody
    joined for ``rendezvous.settle``: on a loaded machine an agent that took longer to
    see the job was left out of it, and joined as a scale-up a moment later (a flaky
    first world for every test and demo that counts its nodes)."""
    if job.nodes.start is not None:
        return job
    start = min(max(nodes, job.nodes.min), job.nodes.max)
    return dataclasses.replace(job, nodes=dataclasses.replace(job.nodes, start=start))


def _wait_for_agents(client: Any, cluster: LocalCluster, nodes: int, *, timeout: float) -> None:
    """Submit only once every agent registered, so the first world has all of them."""
    from elasticd.agent.daemon import NODES_PREFIX

    deadline = time.monotonic() + timeout
    while True:
        with contextlib.suppress(ElasticdError):
            if len(client.get_prefix(NODES_PREFIX)[0]) >= nodes:
                return
        for index, proc in enumerate(cluster.agents):
            if proc.poll() is not None:
                path = os.path.join(cluster.base_dir, f"agent-{index}.log")
                with open(path, encoding="utf-8", errors="replace") as fh:
                    last = (fh.read().strip().splitlines() or ["(empty log)"])[-1]
                raise UsageError(
                    f"local cluster: agent {index} exited with {proc.returncode}: {last}"
                )
        if time.monotonic() > deadline:
            raise UsageError(f"local cluster: {nodes} agents did not register within {timeout:g} s")
        time.sleep(0.1)


def _progress(record: Any, step: int) -> str:
    if record is None:
        return f"  submitting: step {step}"
    st = record.status
    total = record.spec.get("train", {}).get("steps")
    return (
        f"  {record.state}: step {step}/{total} world {st.get('world', '-')} "
        f"round {st.get('round', '-')} restarts {shown_restarts(st)}"
    )


PART_ORDER = RECOVERY_PARTS


def print_summary(result: dict[str, Any], *, out: Any) -> None:
    """Steps, world changes, restarts, each fault (both ends of timed ones), and each
    recovery's time with its parts."""
    status = result.get("status", {})
    history = status.get("history", [])
    metrics = result.get("metrics", [])
    last_by_step = {int(r["step"]): r for r in metrics if "step" in r}
    out.write(f"\njob {result.get('name')}: {result.get('state')}")
    out.write(f" ({result.get('reason')})\n" if result.get("reason") else "\n")
    if result.get("timed_out") and result.get("state") != "cancelled":
        out.write(f"  timed out after {result['timed_out']:g} s (the job could not be cancelled)\n")
    if last_by_step:
        final_loss = last_by_step[max(last_by_step)].get("loss")
        loss = "" if final_loss is None else f"  final loss: {final_loss}"  # a script's may lack it
        out.write(f"  steps completed: {max(last_by_step)}{loss}\n")
    else:  # a job resumed at its last step trains none: no "None" of Python's
        out.write("  steps completed: none in this run\n")
    worlds = [e for e in history if e.get("kind") == "world"]
    # A world that recorded no step says so (one formed after the last step, by an
    # add-node on a fast job, trained nothing); only when the records name their rounds.
    trained = {r["round"] for r in metrics if isinstance(r.get("round"), int)}
    changes = " -> ".join(
        f"{e['world']} ({e.get('layout', '')}, round {e['round']}"
        f"{', no step recorded' if trained and e['round'] not in trained else ''})"
        for e in worlds
    )
    out.write(f"  worlds: {changes or '-'}\n")
    out.write(
        f"  restarts (worker failures): {status.get('restarts', 0)}  "
        f"re-forms: {status.get('reforms', 0)}\n"
    )
    faults = result.get("faults", [])
    for f in faults:
        line = f"  fault {f['fault']} at step {f.get('step', '?')}{_detail(f)}"
        if f.get("end"):
            line += f"; {f['end']['detail']} {f['end']['t'] - f['t']:.2f}s later"
        out.write(line + "\n")
    injected = [f for f in faults if not f.get("skipped")]
    failures = {e["round"]: e for e in history if e.get("kind") == "failure"}
    for e in history:
        if e.get("kind") != "recovery":
            continue
        cause = failures.get(e["round"] - 1, {})
        got = e.get("parts", {})
        parts = ", ".join(f"{k} {got[k]:.2f}s" for k in PART_ORDER if k in got)
        fault_t = _fault_before(injected, e.get("detected_at", 0))
        if fault_t:  # the injected fault's time is known: count from it
            detection = e["detected_at"] - fault_t
            total = f"{detection + e['seconds']:.2f}s from the fault = detection {detection:.2f}s, "
        else:
            total = f"{e['seconds']:.2f}s from detection = "
        detail = brief(cause.get("detail", ""), 120)
        how = ""
        if e.get("mode"):
            how = f" [{e['mode']}, from {e.get('source')}, lost steps {e.get('lost_steps')}]"
        out.write(
            f"  recovery into round {e['round']} ({e.get('reason')}"
            f"{': ' + detail if detail else ''}){how}: {total}{parts}\n"
        )


def _fault_before(faults: list[dict[str, Any]], t: float) -> float | None:
    times = [f["t"] for f in faults if f["t"] <= t]
    return max(times) if times else None
