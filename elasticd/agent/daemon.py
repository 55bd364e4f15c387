"""The per-node daemon: register the node, watch the job registry, run the jobs that fit.

One :class:`Agent` per node. It registers ``/elasticd/nodes/<id>`` on a lease, create-if-
absent (a second agent with a live node's id exits at start, exit code 2), serves
Prometheus metrics, and keeps a watch-fed :class:`~elasticd.agent.view.ClusterView` of
the jobs and nodes. Whenever the view changes it reconciles: jobs are taken in submission
order, each on the device slots it needs (``--nproc-per-node`` slots; a job's workers see
only its own devices through ``CUDA_VISIBLE_DEVICES``), one
:class:`~elasticd.agent.runner.JobRunner` thread per job. The node record says what the
node is and offers (its slots, the commands it runs) and is written once per lease:
every agent watches the node records, so a record re-published on every take would cost
N² watch events across N agents. What changes (free slots, jobs held) goes to the node's
usage record, on the same lease, which only the coordinator watches: the agent with the
lowest id, which writes why a job cannot start into the job's state (``queued: needs 3
nodes ...``) and garbage-collects jobs finished longer than ``ttl_after_finished`` ago.
An idle agent makes no periodic etcd request beyond its lease keep-alives.

A runner that ends for reasons of this node only (an error in its round) is restarted
after a back-off; only the job's documented rules end a job (docs/agent.md).

SIGTERM (systemd stop, Kubernetes eviction) is a preemption: every runner tells its
workers to save an emergency checkpoint (SIGTERM to the workers) within
``restart.grace_period``, then leaves its rendezvous by revoking its lease so the
survivors re-form at once. SIGKILL of the agent takes its workers with it (they carry a
parent-death signal), so nothing trains unsupervised.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import signal
import socket
import threading
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from prometheus_client import CollectorRegistry

from elasticd.agent import METRICS_PORT
from elasticd.agent.health import STALE_AFTER, Health, sd_notify, start_watchdog
from elasticd.agent.launch import NodeInfo
from elasticd.agent.policy import (
    command_allowed,
    device_ids,
    queue_reason,
    take_slots,
    visible_ids,
)
from elasticd.agent.runner import JobRunner, Notes, note_trouble_later
from elasticd.agent.view import NODES_PREFIX, ClusterView
from elasticd.errors import ElasticdError, UsageError
from elasticd.etcd.client import EtcdUnavailableError
from elasticd.jobs import USAGE_PREFIX, JobRecord, JobRegistry, JobState
from elasticd.log import dump_stacks_on_sigusr1, kv
from elasticd.metrics import AgentMetrics

log = logging.getLogger("elasticd.agent")

VERSION = "0.1.0"
WEEK = 7 * 24 * 3600.0
RUNNER_BACKOFF_CAP = 30.0
"""At most this many seconds before a crashed runner's job is taken again."""

__all__ = ["NODES_PREFIX", "VERSION", "Agent", "AgentConfig"]


@dataclass(frozen=True, kw_only=True, slots=True)
class AgentConfig:
    """How one agent runs."""

    etcd: object | None
    """An ``EtcdConfig``; None means 127.0.0.1:2379 if it answers, else an embedded etcd."""
    node_id: str
    """Stable id of this node (its rendezvous member name)."""
    addr: str
    """Address peers reach this node's workers at (rank 0's store lives here)."""
    nproc: int | None
    """Device slots this node offers; None: one per GPU, or on a node without GPUs no
    accounting (each job runs its nproc_per_node workers)."""
    state_dir: str
    """Scratch space: layouts, heartbeats, the embedded etcd's data."""
    metrics_port: int = METRICS_PORT
    """Prometheus port; 0 turns the endpoint off."""
    node_ttl: float = 5.0
    """Lease TTL of the node record."""
    embedded_port: int = 2379
    """Client port of the embedded etcd (the default endpoint, so clients find it)."""
    allow_commands: str | tuple[str, ...] = "none"
    """Which job ``command:`` this agent runs: ``none`` (only the built-in trainer),
    ``all``, or a tuple of allowed executables (names or paths)."""
    ttl_after_finished: float = WEEK
    """Seconds a finished job stays in the registry before it is deleted (0: never)."""
    keep_finished_metrics: float = 120.0
    """Seconds a finished job's series stay on /metrics (long enough for a few scrapes to
    see its final values), then they are removed."""
    stale_after: float = STALE_AFTER
    """Seconds without a turn of the main loop after which ``/healthz`` answers 503 and
    the systemd watchdog is no longer fed (:mod:`elasticd.agent.health`)."""
    devices: int | None = None
    """GPUs on this node (None: counted from the driver)."""
    visible_devices: str | None = field(
        default_factory=lambda: os.environ.get("CUDA_VISIBLE_DEVICES")
    )
    """The agent's own CUDA_VISIBLE_DEVICES: slot i maps to its i-th entry."""


ACTIVE_STATES = tuple(str(s) for s in JobState if not s.terminal)
"""The states ``elasticd_job_state`` exports, for each job not yet finished."""


def default_addr(etcd_endpoints: Sequence[str] = ()) -> str:
    """The address this node's peers reach it on: its host name's, unless that is a
    loopback address (Debian's /etc/hosts maps the host name to 127.0.1.1, which every
    remote worker would dial as its own), then the source address of this host's route to
    the first etcd member that is not on loopback, else (etcd on this very host: the first
    node of a Slurm allocation, whose own name is loopback there) of its route off the
    host. Loopback with no etcd given (an embedded one: one machine) or no route out."""
    try:
        addr = socket.gethostbyname(socket.gethostname())
    except OSError:
        addr = "127.0.0.1"
    if not addr.startswith("127.") or not etcd_endpoints:
        return addr
    targets = []
    for endpoint in etcd_endpoints:
        host, _, port = endpoint.rpartition(":")
        try:
            target = socket.gethostbyname(host.strip("[]"))
        except OSError:
            continue
        if not target.startswith("127."):
            targets.append((target, int(port) if port.isdigit() else 2379))
    targets.append(("192.0.2.1", 9))  # TEST-NET-1: only the route is looked up
    for target in targets:
        try:
            with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
                probe.connect(target)  # no packet: picks the route and its source
                source = probe.getsockname()[0]
        except OSError:
            continue
        if not source.startswith("127."):
            return source
    return addr


def count_devices() -> int:
    """NVIDIA GPUs visible to the driver, without importing torch."""
    try:
        return len(os.listdir("/proc/driver/nvidia/gpus"))
    except OSError:
        return 0


@dataclass(slots=True)
class _Held:
    """A job this node holds: its runner thread and the slots it took."""

    runner: JobRunner
    thread: threading.Thread
    slots: list[int]


class Agent:
    """The daemon. ``run()`` blocks until SIGTERM/SIGINT (or ``stop()``)."""

    def __init__(
        self,
        config: AgentConfig,
        *,
        registry: CollectorRegistry | None = None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.config = config
        self.metrics = AgentMetrics(registry or CollectorRegistry())
        self.preempt = threading.Event()
        self.incarnation = uuid.uuid4().hex[:12]
        """This agent process, told from the node's earlier ones (``NodeInfo.incarnation``)."""
        self._wake = threading.Event()
        self.health = Health(config.stale_after)
        self._exited = threading.Event()
        """Set when run() is done: the systemd watchdog pings stop."""
        self._clock = clock
        self._client = None
        self._embedded = None
        self._lease = 0
        self._published: dict[str, object] | None = None
        """The usage last written under ``_lease`` (None: nothing yet)."""
        self._record_lock = threading.Lock()
        self._held: dict[str, _Held] = {}
        self._done: set[str] = set()
        self._retiring: dict[str, float] = {}
        """Jobs finished here -> when their series are removed from /metrics."""
        self._job_settings: dict[str, tuple[int, int]] = {}
        """run_id -> (nodes.min, checkpoint.every): the coordinator exports them; each spec
        is parsed once."""
        self._retry_at: dict[str, tuple[float, int]] = {}
        self._notes = Notes()
        """Trouble notes and clears of this agent's runners and its own, written in order."""
        self._view: ClusterView | None = None
        self._registry: JobRegistry | None = None
        devices = config.devices
        if devices is None:  # counted: the driver's GPUs, of which this agent may see fewer
            devices = count_devices()
            if config.visible_devices is not None:
                devices = min(devices, len(visible_ids(config.visible_devices)))
        self.slots: int | None = config.nproc if config.nproc is not None else (devices or None)
        self._devices = devices
        self._free: set[int] = set(range(self.slots or 0))
        self._ids = device_ids(self.slots or 0, config.visible_devices)

    # -- etcd ---------------------------------------------------------------------------------

    def _connect(self):
        from elasticd.etcd import EmbeddedEtcd, EtcdConfig, connect

        if self.config.etcd is not None:
            return connect(self.config.etcd)
        local = EtcdConfig(endpoints=(f"127.0.0.1:{self.config.embedded_port}",), timeout=1.0,
                           request_timeout=1.0)  # fmt: skip
        try:
            return connect(local)
        except ElasticdError:
            pass
        data = os.path.join(self.config.state_dir, "etcd")
        self._embedded = EmbeddedEtcd(data_dir=data, client_port=self.config.embedded_port)
        self._embedded.start()
        log.warning(
            "no etcd given and none at the default endpoint: started an embedded etcd. It "
            "lives and dies with this agent: use it for one machine only; run a 3-member etcd "
            "cluster for anything more (docs/agent.md)",
            **kv(endpoint=self._embedded.endpoint, data_dir=data),
        )
        return connect(self._embedded.client_config())

    def _record(self) -> dict[str, object]:
        """The node record: what does not change while the agent runs."""
        c = self.config
        allow = c.allow_commands if isinstance(c.allow_commands, str) else list(c.allow_commands)
        return {
            "node": c.node_id,
            "hostname": socket.gethostname(),
            "addr": c.addr,
            "nproc": c.nproc,
            "slots": self.slots,
            "allow_commands": allow,
            "devices": self._devices,
            "version": VERSION,
            "pid": os.getpid(),
            "started": round(self._clock(), 3),
        }

    def _usage(self) -> dict[str, object]:
        """The usage record: free slots (None: no accounting) and the jobs held."""
        return {
            "free": None if self.slots is None else len(self._free),
            "jobs": sorted({h.runner.name for h in self._held.values()}),
        }

    def _register(self) -> None:
        """Create our node record on a fresh lease, refusing an id a live agent holds.

        A record left by a dead agent of this same host (same host name, pid gone) is
        taken over at once rather than waited out: a restarted agent keeps its id."""
        from elasticd.etcd import compare, put_op

        c, key = self.config, NODES_PREFIX + self.config.node_id
        lease = self._client.lease_grant(c.node_ttl)
        for _ in range(3):
            with self._record_lock:
                body, usage = json.dumps(self._record()), self._usage()
            # The usage record goes with it, on the same lease, in the same transaction.
            result = self._client.txn(
                [compare(key, "version", "==", 0)],
                [
                    put_op(key, body, lease),
                    put_op(USAGE_PREFIX + c.node_id, json.dumps(usage), lease),
                ],
            )
            if result.succeeded:
                self._registered(lease, usage)
                return
            holder = self._client.get(key)
            if holder is None:
                continue  # it just expired: try again
            if holder.lease == lease:
                # A retried create whose first reply was lost: the record is ours already.
                self._registered(lease, usage)
                return
            try:
                other = json.loads(holder.value)
            except ValueError:
                other = {}
            same_host = other.get("hostname") == socket.gethostname()
            if same_host and _is_own_pid(other.get("pid")):
                # Our own pid: an earlier incarnation (in a container every agent is PID 1),
                # or another container's PID 1 under the same host name and node id (host
                # networking). Neither can be told from here: wait for the record's lease
                # to run out, as a dead agent's does; a live one keeps it, and is refused.
                if self._outlived(key, holder.lease):
                    with contextlib.suppress(ElasticdError):  # ran out meanwhile too
                        self._client.lease_revoke(lease)
                    lease = self._client.lease_grant(c.node_ttl)
                    continue
            elif same_host and not _pid_alive(other.get("pid")):
                log.warning("taking over the node record of a dead agent on this host",
                            **kv(node=c.node_id, old_pid=other.get("pid")))  # fmt: skip
                with contextlib.suppress(ElasticdError):
                    self._client.lease_revoke(holder.lease)
                continue
            with contextlib.suppress(ElasticdError):
                self._client.lease_revoke(lease)
            raise UsageError(
                f"node id {c.node_id!r} is already registered by a live agent "
                f"(pid {other.get('pid', '?')} on {other.get('hostname', '?')}); give this "
                "agent another --node-id"
            )
        raise UsageError(f"node id {c.node_id!r}: could not register (the record keeps changing)")

    def _outlived(self, key: str, lease: int) -> bool:
        """Wait up to a node TTL (and 2 s) for the record at ``key`` on ``lease`` to go;
        whether it went (its agent is dead: nobody refreshes the lease)."""
        log.info("node record names our own pid; waiting for its lease to run out",
                 **kv(node=self.config.node_id, ttl_s=self.config.node_ttl))  # fmt: skip
        deadline = time.monotonic() + self.config.node_ttl + 2.0
        while time.monotonic() < deadline and not self.preempt.is_set():
            held = self._client.get(key)
            if held is None or held.lease != lease:
                return True
            time.sleep(0.2)
        return False

    def _registered(self, lease: int, usage: dict[str, object]) -> None:
        self._published = usage
        self._lease = lease
        self.metrics.agent_registrations.inc()
        self._client.keeper().add(
            lease, self.config.node_ttl / 3, self._on_node_lease_lost, ttl=self.config.node_ttl
        )

    def _on_node_lease_lost(self, lease: int) -> None:
        """etcd forgot our lease (an outage longer than its TTL): register again."""
        if lease != self._lease or self.preempt.is_set():
            return
        log.warning("node lease lost; registering again", **kv(node=self.config.node_id))
        threading.Thread(target=self._reregister, name="node-register", daemon=True).start()

    def _reregister(self) -> None:
        while not self.preempt.is_set():
            try:
                self._register()
                return
            except UsageError as exc:
                log.error("cannot register again; stopping", **kv(error=str(exc)))
                self.preempt.set()
                self._wake.set()
                return
            except ElasticdError as exc:
                log.warning("registering again failed; retrying", **kv(error=str(exc)))
                self.preempt.wait(1.0)

    def _publish(self) -> None:
        """Put our usage record (free slots, jobs held) under our lease when it changed,
        if the node record is still ours. Only the coordinator watches these records; the
        node record itself stays as registered."""
        from elasticd.etcd import compare, put_op

        lease = self._lease
        with self._record_lock:
            usage = self._usage()
        if not lease or usage == self._published:
            return
        key = NODES_PREFIX + self.config.node_id
        try:
            result = self._client.txn(
                [compare(key, "lease", "==", lease)],
                [put_op(USAGE_PREFIX + self.config.node_id, json.dumps(usage), lease)],
            )
        except ElasticdError as exc:  # the next pass of the loop tries again
            log.warning("usage record not updated", **kv(error=str(exc)))
            return
        if result.succeeded and lease == self._lease:
            self._published = usage

    # -- the loop -----------------------------------------------------------------------------

    def stop(self) -> None:
        """Ask the agent to stop as on SIGTERM (preemption)."""
        self.preempt.set()
        self._wake.set()
        sd_notify("STOPPING=1")

    def run(self) -> int:
        try:
            os.makedirs(self.config.state_dir, exist_ok=True)
        except OSError as exc:  # a file in the way, a read-only or absent parent
            raise UsageError(
                f"--state-dir: cannot create {self.config.state_dir}: {exc.strerror or exc}"
            ) from None
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGTERM, signal.SIGINT):
                signal.signal(sig, lambda signum, frame: self.stop())
            # `kill -USR1` prints every thread's stack into the agent's log (stderr): how a
            # stuck agent is read without stopping it (the local cluster does it on timeout).
            dump_stacks_on_sigusr1()
        # Before anything is registered: a port in use is a one-line user error.
        port = (
            self.metrics.serve(self.config.metrics_port, health=self.health)
            if self.config.metrics_port
            else 0
        )
        self._client = self._connect()
        self._client.on_error = self._etcd_error
        try:
            self._register()
            self._write_info(port)
            log.info("agent started", **kv(node=self.config.node_id, addr=self.config.addr,
                                           slots=self.slots, metrics_port=port,
                                           state_dir=self.config.state_dir))  # fmt: skip
            self._registry = JobRegistry(self._client, clock=self._clock)
            self._view = ClusterView(self._client, on_change=self._wake.set)
            self._start_view()
            self.health.beat()
            sd_notify("READY=1")
            start_watchdog(self.health, self.preempt, self._exited)
            while not self.preempt.is_set():
                self.health.beat()
                self._wake.clear()
                try:
                    timeout = self._reconcile()
                except ElasticdError as exc:
                    log.warning("reconcile failed; retrying", **kv(error=str(exc)))
                    timeout = 1.0
                # Bounded: a signal delivered to another thread must not leave the main
                # thread parked forever (the loop reads no etcd, only the local mirror).
                self._wake.wait(1.0 if timeout is None else min(timeout, 1.0))
            log.info("agent stopping (preempted)", **kv(node=self.config.node_id))
            self._join_runners()
            return 0
        finally:
            self._shutdown()

    def _start_view(self) -> None:
        while not self.preempt.is_set():
            try:
                self._view.start()  # type: ignore[union-attr]
                return
            except ElasticdError as exc:
                log.warning("job registry unreadable; retrying", **kv(error=str(exc)))
                self.preempt.wait(1.0)

    def _reconcile(self) -> float | None:
        """Act on the view: reap runners, take jobs that fit, say why others wait, and
        collect old finished jobs. Returns the seconds until it must look again unprompted
        (None: only when something changes)."""
        view, now = self._view, self._clock()
        assert view is not None
        nodes = view.nodes()
        wake_in: list[float] = []
        self._reap(now)
        wake_in.extend(self._retire_series(now))
        for record in view.jobs():
            if record.state.terminal:
                self._done.discard(record.run_id)
                held = self._held.get(record.run_id)
                if held is not None and not held.runner.in_round:
                    held.runner.end_wait()  # close the run: nodes waiting for a round go
                continue
            if record.run_id in self._held or record.run_id in self._done:
                continue
            retry = self._retry_at.get(record.run_id)
            if retry is not None and retry[0] > now:
                wake_in.append(retry[0] - now)
                continue
            self._maybe_take(record)
        self._publish()  # a no-op unless free slots or jobs held changed since the last
        coordinator = self._is_coordinator(nodes)
        self._export_cluster(coordinator, nodes)
        try:
            view.follow_usage(coordinator)
        except ElasticdError as exc:
            log.warning("usage records unreadable; retrying", **kv(error=str(exc)))
            return 1.0
        if coordinator:
            wake_in.extend(self._coordinate(view.jobs(), view.nodes(), now))
        return min(wake_in) if wake_in else None

    # -- metrics ---------------------------------------------------------------------------------

    def _etcd_error(self, what: str, code: str) -> None:
        self.metrics.etcd_errors.labels(what, code).inc()

    def _export_cluster(self, coordinator: bool, nodes: dict[str, dict]) -> None:
        """Cluster series: the coordinator exports them, every other agent exports 0 nodes
        and no job's settings (so sum and max are both right)."""
        m = self.metrics
        m.nodes_alive.set(len(nodes) if coordinator else 0)
        wanted: dict[str, tuple[int, int]] = {}
        states: dict[str, str] = {}
        submitted: dict[str, float] = {}
        if coordinator:
            for record in self._view.jobs():  # type: ignore[union-attr]
                if record.state.terminal:
                    continue
                if record.run_id not in self._job_settings:
                    try:
                        job = record.job()
                    except ElasticdError:
                        continue
                    self._job_settings[record.run_id] = (job.nodes.min, job.checkpoint.every)
                wanted[record.name] = self._job_settings[record.run_id]
                states[record.name] = str(record.state)
                submitted[record.name] = record.submitted
        for gauge in (m.nodes_min, m.checkpoint_every, m.job_state, m.job_submitted):
            for labels in list(gauge._metrics):
                if labels[0] not in wanted:
                    gauge.remove(*labels)
        for name, (nodes_min, every) in wanted.items():
            m.nodes_min.labels(name).set(nodes_min)
            m.checkpoint_every.labels(name).set(every)
            m.job_submitted.labels(name).set(submitted[name])
            # Every active state, 1 for the current one: an alert or a panel selects by
            # state without a series appearing and vanishing as the job moves.
            for state in ACTIVE_STATES:
                m.job_state.labels(name, state).set(1 if states[name] == state else 0)

    def _retire_series(self, now: float) -> list[float]:
        """Remove the series of jobs this agent finished, once they were kept long enough
        to be scraped; returns the seconds until the next is due."""
        running = {h.runner.name for h in self._held.values()}
        wake = []
        for name, due in list(self._retiring.items()):
            if name in running:
                del self._retiring[name]  # submitted again: its series are live
            elif due <= now:
                del self._retiring[name]
                self.metrics.drop_job(name)
            else:
                wake.append(due - now)
        return wake

    def _reap(self, now: float) -> bool:
        changed = False
        for run_id, held in list(self._held.items()):
            if held.thread.is_alive():
                continue
            del self._held[run_id]
            self._free.update(held.slots)
            changed = True
            if held.runner.crashed:
                tries = self._retry_at.get(run_id, (0.0, 0))[1] + 1
                pause = min(RUNNER_BACKOFF_CAP, 2.0**tries)
                self._retry_at[run_id] = (now + pause, tries)
                log.warning("job runner crashed; taking the job again later",
                            **kv(job=held.runner.name, retry_in=pause))  # fmt: skip
                self.metrics.node_troubles.labels(held.runner.name, "runner_crashed").inc()
                # Said in the job's status, or the job just looks stuck.
                note_trouble_later(self._notes, self._registry, held.runner.name, run_id,
                                   self.config.node_id,
                                   "its job runner crashed",
                                   held.runner.crash_error or "unknown error", count=tries,
                                   retry_in=pause)  # fmt: skip
            else:
                self._done.add(run_id)
                self._retiring[held.runner.name] = now + self.config.keep_finished_metrics
        return changed

    def _maybe_take(self, record: JobRecord) -> bool:
        try:
            job = record.job()
        except ElasticdError as exc:
            log.error("stored job is invalid; skipped", **kv(job=record.name, error=str(exc)))
            self._done.add(record.run_id)
            return False
        if not command_allowed(job.command, self.config.allow_commands):
            return False  # the coordinator says so in the job's state if nobody runs it
        slots: list[int] | None = []
        if self.slots is not None:
            slots = take_slots(self._free, job.nproc_per_node)
            if slots is None:
                return False  # queued: no room here now
        self._free.difference_update(slots)
        devices = [self._ids[i] for i in slots] if self.slots is not None else None
        self._start_runner(record, slots, devices)
        return True

    def _start_runner(self, record: JobRecord, slots: list[int], devices: list[str] | None) -> None:
        node = NodeInfo(node_id=self.config.node_id, addr=self.config.addr,
                        state_dir=self.config.state_dir, incarnation=self.incarnation)  # fmt: skip
        runner = JobRunner(record=record, client=self._client, registry=self._registry,
                           node=node, metrics=self.metrics, preempt=self.preempt,
                           view=self._view, devices=devices, clock=self._clock,
                           notes=self._notes)  # fmt: skip

        def body() -> None:
            try:
                outcome = runner.run()
                log.info("job done on this node", **kv(job=record.name, outcome=str(outcome)))
            except Exception as exc:
                # This node's trouble: never the job's. The job is taken again later.
                log.exception("job runner crashed", **kv(job=record.name))
                runner.crash_error = f"{type(exc).__name__}: {exc}"
                runner.crashed = True
            finally:
                self._wake.set()

        thread = threading.Thread(target=body, name=f"job {record.name}", daemon=True)
        self._held[record.run_id] = _Held(runner=runner, thread=thread, slots=slots)
        log.info("job taken", **kv(job=record.name, run_id=record.run_id, devices=devices))
        thread.start()

    # -- the coordinator's chores ---------------------------------------------------------------

    def _is_coordinator(self, nodes: dict[str, dict]) -> bool:
        """The live agent with the lowest id writes queue reasons and collects old jobs
        (any agent could; one keeps the writes few)."""
        return bool(nodes) and min(nodes) == self.config.node_id

    def _coordinate(
        self, records: list[JobRecord], nodes: dict[str, dict], now: float
    ) -> list[float]:
        wake: list[float] = []
        registry = self._registry
        assert registry is not None
        for record in records:
            try:
                if record.state.terminal:
                    wake.extend(self._collect(record, now))
                elif record.state in (JobState.PENDING, JobState.QUEUED) and not record.started:
                    self._explain(record, nodes)
            except ElasticdError as exc:
                log.warning("queue bookkeeping failed", **kv(job=record.name, error=str(exc)))
                if isinstance(exc, EtcdUnavailableError):
                    # etcd away: the rest would each wait out a request timeout too (two
                    # dozen finished jobs made one turn of the loop minutes long, and
                    # /healthz 503); they are done at the next turn.
                    wake.append(1.0)
                    break
            self.health.beat()  # each record is a turn of the loop's work
        return wake

    def _explain(self, record: JobRecord, nodes: dict[str, dict]) -> None:
        job = record.job()
        first = job.nodes.min if job.nodes.start is None else job.nodes.start
        reason = queue_reason(job=record.name, nproc=job.nproc_per_node, min_nodes=first,
                              command=job.command, nodes=nodes)  # fmt: skip
        registry = self._registry
        assert registry is not None
        if reason is None:
            if record.state == JobState.QUEUED:
                registry.set_state(record.name, JobState.PENDING, "room found; forming a world")
        elif reason.startswith("refused"):
            registry.set_state(record.name, JobState.FAILED, reason)
        elif record.state != JobState.QUEUED or record.reason != reason:
            registry.set_state(record.name, JobState.QUEUED, reason)

    def _collect(self, record: JobRecord, now: float) -> list[float]:
        ttl = self.config.ttl_after_finished
        if ttl <= 0:
            return []
        age = now - record.since
        if age < ttl:
            return [ttl - age]
        try:
            self._registry.delete(record.name)  # type: ignore[union-attr]
            log.info("finished job collected", **kv(job=record.name, age_s=round(age)))
        except UsageError as exc:
            log.info("finished job not collected", **kv(job=record.name, why=str(exc)))
        return []

    # -- stopping -------------------------------------------------------------------------------

    def _join_runners(self) -> None:
        """Wait for runners with workers (they save and leave); let waiting ones go."""
        for held in list(self._held.values()):
            runner, thread = held.runner, held.thread
            if runner.in_round:
                thread.join(timeout=runner.job.restart.grace_period + 15)
            else:
                runner.abandon_wait()
                thread.join(timeout=1.0)

    def _write_info(self, metrics_port: int) -> None:
        info = {"node": self.config.node_id, "pid": os.getpid(), "metrics_port": metrics_port}
        from elasticd.agent.launch import write_json

        # Through a new file of an unpredictable name, never through a symlink planted at a
        # fixed one (agent.json.tmp was opened with a plain open()).
        write_json(os.path.join(self.config.state_dir, "agent.json"), info)

    def _shutdown(self) -> None:
        self.preempt.set()
        if self._view is not None:
            self._view.close()
        if self._client is not None:
            if self._lease:
                lease, self._lease = self._lease, 0
                self._client.keeper().remove(lease)
                with contextlib.suppress(ElasticdError):
                    self._client.lease_revoke(lease)
            self._client.close()
        if self._embedded is not None:
            self._embedded.stop()
        self._exited.set()


def _is_own_pid(pid: object) -> bool:
    """Whether a node record names this process's pid (a record of ours is found by its
    lease, before this is asked)."""
    try:
        return int(pid) == os.getpid()  # type: ignore[arg-type]
    except (TypeError, ValueError):
        return False


def _pid_alive(pid: object) -> bool:
    """Whether ``pid`` names a live process: a zombie (killed, not yet reaped by a parent
    that does not wait, such as a wrapper or `elasticd run` busy elsewhere) is dead, and
    a restarted agent takes its record over instead of being refused for good."""
    try:
        os.kill(int(pid), 0)  # type: ignore[arg-type]
    except (TypeError, ValueError, ProcessLookupError):
        return False
    except PermissionError:
        return True
    try:
        with open(f"/proc/{int(pid)}/stat", "rb") as fh:  # type: ignore[arg-type]
            state = fh.read().rsplit(b")", 1)[1].split()[0]
    except (OSError, IndexError):
        return True
    return state not in (b"Z", b"X")
