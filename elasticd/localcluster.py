"""A whole cluster on one machine: an embedded etcd and N agents as separate processes.

``elasticd run`` and the tests use it. Agents are real ``elasticd agent`` processes with
their own state dirs; faults are injected the way the real thing happens (SIGKILL of an
agent and its workers, SIGKILL or SIGSTOP of one worker, SIGTERM of an agent, a new agent).
Everything lives under ``<base_dir>``: ``etcd/``, ``node-<i>/`` and ``agent-<i>.log``.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field

from elasticd.agent.workers import with_pdeathsig
from elasticd.errors import UsageError

FAULT_KINDS = ("kill-node", "kill-worker", "hang-worker", "term-node", "add-node")
_FAULT_RE = re.compile(r"^(?P<kind>[a-z-]+)(?:=(?P<target>\d+))?@step=(?P<step>\d+)$")


@dataclass(frozen=True, kw_only=True, slots=True)
class Fault:
    """One injected fault: ``kind`` of node/rank ``target`` once step ``step`` completed."""

    kind: str
    """kill-node, kill-worker, hang-worker, term-node or add-node."""
    target: int | None
    """Node index (kill-node, term-node) or global rank (kill-worker, hang-worker)."""
    step: int
    """Fire once a step >= this has completed."""

    def __str__(self) -> str:
        target = "" if self.target is None else f"={self.target}"
        return f"{self.kind}{target}@step={self.step}"


def parse_fault(text: str) -> Fault:
    """``kill-node=1@step=8`` → Fault; a malformed spec is a one-line UsageError."""
    m = _FAULT_RE.match(text.strip())
    if not m or m.group("kind") not in FAULT_KINDS:
        raise UsageError(
            f"--fault {text!r}: expected KIND=N@step=S (KIND one of kill-node, kill-worker, "
            "hang-worker, term-node) or add-node@step=S"
        )
    kind, target = m.group("kind"), m.group("target")
    if kind == "add-node" and target is not None:
        raise UsageError(f"--fault {text!r}: add-node takes no target (add-node@step=S)")
    if kind != "add-node" and target is None:
        raise UsageError(f"--fault {text!r}: {kind} needs a target ({kind}=N@step=S)")
    step = int(m.group("step"))
    if step < 1:
        raise UsageError(f"--fault {text!r}: step must be >= 1")
    return Fault(kind=kind, target=None if target is None else int(target), step=step)


@dataclass(kw_only=True, slots=True)
class LocalCluster:
    """An embedded etcd and agents on loopback."""

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
    etcd: object | None = None
    """The EmbeddedEtcd, once started."""
    metrics: bool = False
    """Serve each agent's Prometheus metrics on a free port (see ``metrics_ports``)."""
    agents: list[subprocess.Popen] = field(default_factory=list)
    """Agent processes by node index."""
    metrics_ports: list[int] = field(default_factory=list)
    """Each agent's metrics port (0: off)."""

    @property
    def endpoint(self) -> str:
        assert self.etcd is not None
        return self.etcd.endpoint  # type: ignore[attr-defined]

    def start(self, nodes: int) -> LocalCluster:
        from elasticd.etcd import EmbeddedEtcd

        os.makedirs(self.base_dir, exist_ok=True)
        self.etcd = EmbeddedEtcd(data_dir=os.path.join(self.base_dir, "etcd")).start()
        for _ in range(nodes):
            self.add_node()
        return self

    def state_dir(self, index: int) -> str:
        return os.path.join(self.base_dir, f"node-{index}")

    def add_node(self) -> int:
        """Start one more agent; returns its node index."""
        from elasticd.etcd import free_port

        index = len(self.agents)
        port = free_port() if self.metrics else 0
        argv = [
            self.python, "-m", "elasticd", "agent", "--etcd", self.endpoint,
            "--node-id", f"node-{index}", "--addr", "127.0.0.1",
            "--nproc-per-node", str(self.nproc), "--state-dir", self.state_dir(index),
            "--metrics-port", str(port), "--allow-commands",  # a local cluster runs its user's own jobs
        ]  # fmt: skip
        log = open(os.path.join(self.base_dir, f"agent-{index}.log"), "ab")  # noqa: SIM115
        with log:
            proc = subprocess.Popen(
                with_pdeathsig(argv, self.python),  # agents go when `elasticd run` goes
                cwd=self.cwd,
                env={**self.env, "ELASTICD_ETCD": self.endpoint},
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        self.agents.append(proc)
        self.metrics_ports.append(port)
        return index

    def worker_pids(self, index: int) -> dict[int, int]:
        """Global rank → pid of node ``index``'s current workers."""
        try:
            with open(os.path.join(self.state_dir(index), "workers.json"), encoding="utf-8") as fh:
                return {int(r): int(p) for r, p in json.load(fh)["pids"].items()}
        except (OSError, ValueError, KeyError):
            return {}

    def _signal_pid(self, pid: int, sig: int) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, sig)

    def kill_node(self, index: int) -> None:
        """SIGKILL the agent and its workers, as a machine dying would."""
        pids = self.worker_pids(index)
        self._signal_pid(self.agents[index].pid, signal.SIGKILL)
        for pid in pids.values():
            self._signal_pid(pid, signal.SIGKILL)
        self.agents[index].wait(timeout=10)

    def term_node(self, index: int) -> None:
        """SIGTERM the agent: a preemption (systemd stop, Kubernetes eviction)."""
        self._signal_pid(self.agents[index].pid, signal.SIGTERM)

    def _rank_pid(self, rank: int) -> int:
        for index in range(len(self.agents)):
            pid = self.worker_pids(index).get(rank)
            if pid is not None and self.agents[index].poll() is None:
                return pid
        raise UsageError(f"no live worker has global rank {rank}")

    def kill_worker(self, rank: int) -> None:
        self._signal_pid(self._rank_pid(rank), signal.SIGKILL)

    def hang_worker(self, rank: int) -> None:
        """SIGSTOP one worker: it stops reporting progress and its peers block."""
        self._signal_pid(self._rank_pid(rank), signal.SIGSTOP)

    def inject(self, fault: Fault) -> None:
        if fault.kind == "kill-node":
            self.kill_node(self._node(fault))
        elif fault.kind == "term-node":
            self.term_node(self._node(fault))
        elif fault.kind == "kill-worker":
            self.kill_worker(int(fault.target))  # type: ignore[arg-type]
        elif fault.kind == "hang-worker":
            self.hang_worker(int(fault.target))  # type: ignore[arg-type]
        else:
            self.add_node()

    def _node(self, fault: Fault) -> int:
        index = int(fault.target)  # type: ignore[arg-type]
        if not 0 <= index < len(self.agents):
            raise UsageError(f"--fault {fault}: there is no node {index}")
        return index

    def stop(self, grace: float = 20.0) -> None:
        """SIGTERM every agent, wait, SIGKILL stragglers, stop etcd."""
        for proc in self.agents:
            if proc.poll() is None:
                self._signal_pid(proc.pid, signal.SIGTERM)
        deadline = time.monotonic() + grace
        for proc in self.agents:
            try:
                proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                self._signal_pid(proc.pid, signal.SIGKILL)
                proc.wait(timeout=10)
        # Workers need no sweep: each carries a parent-death SIGKILL, which reaches even a
        # SIGSTOPped one. (Killing pids from workers.json here could hit a reused pid.)
        if self.etcd is not None:
            self.etcd.stop()  # type: ignore[attr-defined]
            self.etcd = None

    def __enter__(self) -> LocalCluster:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


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
