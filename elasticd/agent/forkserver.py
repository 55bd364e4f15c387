"""A per-job fork server: one process per node imports torch and the trainer once, and
every worker of the job on that node is a ``fork()`` of it.

Why: a worker of the built-in trainer spends about 3.5 s of CPU importing torch, the
trainer and ``torch._dynamo`` (which the first optimizer step imports) before it does
anything. A node that runs nproc workers, a warm worker per rank, standbys and every
replacement after a fault paid it for each process. Forked from a process that imported
them already, a worker starts in milliseconds and shares those pages with its siblings.

The protocol (a Unix socket pair; one JSON object per line):

- the server imports ``preload`` and then sends ``{"ready": PID}`` (or ``{"failed":
  WHY}`` and exits);
- the agent sends ``{"id": N, "argv": [...], "env": {...}, "cwd": DIR, "log": PATH}``; the
  server forks and answers ``{"id": N, "pid": PID}`` (or ``{"id": N, "error": WHY}``);
- when a child exits the server reaps it and sends ``{"exit": PID, "code": CODE}``, the
  code as ``subprocess`` gives it (negative: killed by that signal);
- the server exits when the agent's end of the socket closes. Every child has
  ``PR_SET_PDEATHSIG = SIGKILL`` towards the server, and the server towards the agent, so
  workers never outlive their agent, as exec'd workers never did.

Its log (``<output_dir>/logs/<run_id>/forkserver/<node>.log``) has a line per fork
(``forked PID: -m MODULE LOG``) and per exit (``exited PID: CODE``).

The child becomes the worker the way ``python -m MODULE ARGS`` would: its own session,
stdin from /dev/null, stdout and stderr appended to its log, the request's environment
and directory, ``sys.argv`` and ``sys.path[0]`` as the interpreter sets them, then
``runpy`` runs the module as ``__main__``. An exception or ``SystemExit`` ends it as it
ends ``python``. What cannot be the same after a fork is checked, and such a request is
exec'd in the child instead (the worker is then as correct as before, only not faster):
an environment that differs from the server's in a variable read when the interpreter,
torch or its libraries start (``PYTHON*``, ``OMP_*``, ``TORCH*``, ``LD_*``, ...: see
:func:`startup_env`), a command that is not ``<the server's python> -m MODULE ...``, and
a server with a Python thread besides its main one (none is started; the check is a
guard).

Fork safety: the server never runs a tensor operation, so no OpenMP pool exists to be
lost in the child (GNU libgomp hangs a child whose parent used it), never initialises
CUDA, and starts no thread. OpenBLAS's idle threads (numpy, when OMP_NUM_THREADS is
unset) shut down and restart across a fork by their own handlers.

What a user sees: every worker's ``/proc/PID/cmdline`` is the server's (``python -m
elasticd.agent.forkserver ...``). ``ELASTICD_FORK_SERVER=0`` in the agent's environment
turns it off (every worker exec'd, as before).
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import json
import logging
import os
import select
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Mapping, Sequence
from typing import Any

log = logging.getLogger("elasticd.agent")

ENV_SWITCH = "ELASTICD_FORK_SERVER"
"""``0`` in the agent's environment: no fork server; every worker is exec'd."""

READY_WAIT = 60.0
"""Seconds from the server's start that its imports may take. A worker whose pid is needed
before then waits for them, never past this deadline (one for the server, not one per
worker); past it the server is given up (stopped), and every worker still waiting for it
is exec'd. A server that cannot import is told at once."""

REPLY_WAIT = 30.0
"""Seconds the agent waits for the server's answer to one fork."""

PRELOAD_TRAINER = ("torch", "torch.distributed", "torch._dynamo", "trainer.train",
                   "trainer.recovery", "trainer.checkpointing", "trainer.data",
                   "elasticd.inprocess")  # fmt: skip
"""What the server of a built-in trainer job imports before it forks (what ``python -m
trainer`` imports, but not ``trainer.__main__`` itself: ``runpy`` runs that as
``__main__``, and warns when it is imported already)."""

PRELOAD_COMMAND = ("torch", "torch.distributed", "torch._dynamo", "elasticd.inprocess")
"""What the server of a job's own Python command (``restart.fork: true``) imports."""

_STARTUP_PREFIXES = ("PYTHON", "LD_", "OMP_", "MKL_", "OPENBLAS_", "GOTO", "KMP_", "GOMP_",
                     "MALLOC_", "TORCH", "PYTORCH", "NUMEXPR_")  # fmt: skip
_LAZY = ("TORCHELASTIC_",)
"""``TORCHELASTIC_*`` are per round and read when used (torch's error file, its restart
count), never at import."""

_PR_SET_PDEATHSIG = 1


def enabled(env: Mapping[str, str] | None = None) -> bool:
    """Whether the agent forks its built-in trainer workers (``ELASTICD_FORK_SERVER``)."""
    env = os.environ if env is None else env
    return env.get(ENV_SWITCH, "1").strip().lower() not in ("0", "false", "no", "off")


def startup_env(env: Mapping[str, str]) -> dict[str, str]:
    """The variables of ``env`` that the interpreter, torch or the libraries under it read
    when they start or load (not when first used): a forked child keeps the server's view
    of those, so a request whose values differ is exec'd instead."""
    return {k: v for k, v in env.items()
            if k.startswith(_STARTUP_PREFIXES) and not k.startswith(_LAZY)}  # fmt: skip


def target_of(argv: Sequence[str], python: str) -> tuple[str, str] | None:
    """What ``argv`` runs when it is ``python -m MODULE [ARG]...`` (``("module", MODULE)``)
    or ``python SCRIPT.py [ARG]...`` (``("script", SCRIPT.py)``) with the server's
    interpreter, else None (it is exec'd: another interpreter, interpreter options, a
    directory or a zip file to run, anything not Python)."""
    if len(argv) < 2 or argv[0] != python:
        return None
    if argv[1] == "-m":
        if len(argv) >= 3 and all(p.isidentifier() for p in argv[2].split(".")):
            return ("module", argv[2])
        return None
    if argv[1].endswith(".py") and not argv[1].startswith("-"):
        return ("script", argv[1])
    return None


def pid_now(proc: Any) -> int | None:
    """``proc``'s pid, or None for a forked worker that has not started yet (never waits:
    for log lines)."""
    if isinstance(proc, ForkedProcess):
        return proc.known_pid
    return proc.pid


# -- the agent's side -----------------------------------------------------------------------


class ForkServer:
    """The agent's handle on one fork server (one per job run on a node)."""

    def __init__(self, *, python: str, preload: Sequence[str], env: Mapping[str, str],
                 cwd: str | None, log_path: str) -> None:  # fmt: skip
        from elasticd.agent.workers import with_pdeathsig

        self.python = python
        self.log_path = log_path
        self._lock = threading.RLock()
        self._buf = b""
        self._ids = 0
        self._replies: dict[int, dict[str, Any]] = {}
        self._exits: dict[int, int] = {}
        self.ready = False
        self.failed: str | None = None
        """Why the server cannot fork (its imports failed, it was given up, or it stopped)."""
        self.lost = False
        """It stopped after it was ready (killed, crashed): its children died with it."""
        self.pid: int | None = None
        self._deadline = time.monotonic() + READY_WAIT
        os.makedirs(os.path.dirname(log_path) or ".", exist_ok=True)
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            argv = [python, "-m", "elasticd.agent.forkserver", str(theirs.fileno()), *preload]
            with open(log_path, "ab") as log:
                self.proc = subprocess.Popen(
                    with_pdeathsig(argv), env={"PYTHONUNBUFFERED": "1", **env}, cwd=cwd,
                    stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                    start_new_session=True, pass_fds=(theirs.fileno(),),
                )  # fmt: skip
        except BaseException:
            ours.close()
            raise
        finally:
            theirs.close()
        ours.setblocking(False)
        self._sock = ours
        self._startup = startup_env({"PYTHONUNBUFFERED": "1", **env})

    # Reading the server's messages.

    def _pump(self, wait: float = 0.0) -> None:
        """Read whatever the server sent (waiting up to ``wait`` s for the first bytes)."""
        with self._lock:
            if self._sock.fileno() < 0:
                return
            if wait > 0:
                select.select([self._sock], [], [], wait)
            while True:
                try:
                    data = self._sock.recv(1 << 16)
                except (BlockingIOError, InterruptedError):
                    break
                except OSError as exc:
                    self._lost(f"socket: {exc}")
                    break
                if not data:
                    self._lost("it exited")
                    break
                self._buf += data
            *lines, self._buf = self._buf.split(b"\n")
            for line in lines:
                if line.strip():
                    self._on(json.loads(line))

    def _on(self, msg: dict[str, Any]) -> None:
        if "ready" in msg:
            self.ready, self.pid = True, int(msg["ready"])
        elif "failed" in msg:
            self.failed = str(msg["failed"])
        elif "exit" in msg:
            self._exits[int(msg["exit"])] = int(msg["code"])
        elif "id" in msg:
            self._replies[int(msg["id"])] = msg
            if "pid" in msg:  # an exit of an earlier process of that pid is stale now
                self._exits.pop(int(msg["pid"]), None)

    def _lost(self, why: str) -> None:
        if self.failed is None:
            self.failed = f"the fork server stopped: {why}"
            if self.ready:
                self.lost = True
                log.warning("the fork server stopped; its workers died with it, and workers "
                            "are exec'd from now on: %s (log %s)", why, self.log_path)  # fmt: skip
        with contextlib.suppress(OSError):
            self._sock.close()

    def usable(self) -> bool:
        """Whether the server runs (ready or still importing)."""
        self._pump()
        if self.failed is None and self.proc.poll() is not None:
            self._pump(wait=0.01)  # its end of the socket closed as it exited
            if self.failed is None:
                self._lost(f"it exited with {self.proc.returncode}")
        return self.failed is None

    def wait_ready(self, timeout: float) -> bool:
        """Wait up to ``timeout`` s, and never past the server's :data:`READY_WAIT`
        deadline, for its imports; returns whether it is ready. At the deadline the server
        is given up."""
        deadline = min(time.monotonic() + timeout, self._deadline)
        while True:
            self._pump()
            if self.ready or not self.usable():
                return self.ready and self.usable()
            left = deadline - time.monotonic()
            if left <= 0 or timeout <= 0:
                if time.monotonic() >= self._deadline:
                    self._give_up(f"its imports took longer than {READY_WAIT:g} s")
                return False
            self._pump(wait=min(left, 0.1))

    def _give_up(self, why: str) -> None:
        with self._lock:
            if self.failed is None:
                self.failed = why
                log.warning("fork server given up; workers are exec'd: %s (log %s)", why,
                            self.log_path)  # fmt: skip
            with contextlib.suppress(OSError):
                self._sock.close()
        with contextlib.suppress(ProcessLookupError):
            self.proc.kill()

    def exit_code(self, pid: int) -> int | None:
        """The exit code the server reported for its child ``pid``, or None (taken: the
        caller keeps it)."""
        self._pump()
        with self._lock:
            return self._exits.pop(pid, None)

    def can_fork(self, argv: Sequence[str], env: Mapping[str, str]) -> bool:
        """Whether a fork of this server runs ``argv`` under ``env`` as an exec would."""
        return (
            target_of(argv, self.python) is not None
            and startup_env({"PYTHONUNBUFFERED": "1", **env}) == self._startup
        )

    def fork(self, argv: Sequence[str], env: Mapping[str, str], cwd: str | None,
             log_path: str) -> int:  # fmt: skip
        """Fork one worker (the server must be ready); returns its pid. Raises OSError."""
        with open(log_path, "ab"):  # there when the pid is, as an exec'd worker's
            pass
        with self._lock:
            self._ids += 1
            rid = self._ids
            req = {"id": rid, "argv": list(argv), "env": dict(env), "cwd": cwd or os.getcwd(),
                   "log": log_path}  # fmt: skip
            data = json.dumps(req).encode() + b"\n"
            try:
                self._sock.setblocking(True)
                self._sock.sendall(data)
            except OSError as exc:
                self._lost(f"socket: {exc}")
                raise OSError(errno.EPIPE, self.failed) from exc
            finally:
                with contextlib.suppress(OSError):
                    self._sock.setblocking(False)
            deadline = time.monotonic() + REPLY_WAIT
            while rid not in self._replies:
                if self.failed is not None or time.monotonic() > deadline:
                    raise OSError(errno.EIO, self.failed or "the fork server did not answer")
                self._pump(wait=0.05)
            reply = self._replies.pop(rid)
        if "pid" not in reply:
            raise OSError(errno.EIO, f"the fork server could not fork: {reply.get('error')}")
        return int(reply["pid"])

    def close(self) -> None:
        """Stop the server (its remaining children get SIGKILL from their parent's death)."""
        with self._lock, contextlib.suppress(OSError):
            self._sock.close()
        if self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                self.proc.kill()
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(timeout=10)


class ForkedProcess:
    """A worker started through a :class:`ForkServer`, with the part of
    ``subprocess.Popen``'s interface the agent uses (``pid``, ``poll``, ``wait``,
    ``kill``, ``send_signal``, ``returncode``).

    Until the server is ready the process is *pending*: it counts as running, a signal
    cancels it (it then never starts, and reads as killed by that signal), and ``pid``
    waits for the server (at most :data:`READY_WAIT`). A server that fails, or cannot fork
    this request, is replaced by an exec of the same command (``subprocess.Popen``), so a
    worker always starts."""

    def __init__(self, server: ForkServer, argv: Sequence[str], env: Mapping[str, str],
                 cwd: str | None, log_path: str, exec_start: Any) -> None:  # fmt: skip
        self._server = server
        self._request = (list(argv), dict(env), cwd, log_path)
        self._exec_start = exec_start
        self._pid: int | None = None
        self._popen: subprocess.Popen | None = None
        self.returncode: int | None = None
        self.args = list(argv)
        self._pidfd: int | None = None
        self._start(wait=0.0)

    @property
    def pending(self) -> bool:
        """Not started yet: the server is still importing."""
        return self._pid is None and self._popen is None and self.returncode is None

    def _start(self, wait: float) -> None:
        """Start the process if it is pending and the server is ready (waiting up to
        ``wait`` s), or by exec if the server cannot."""
        if not self.pending:
            return
        server = self._server
        argv, env, cwd, log_path = self._request
        if not server.can_fork(argv, env):  # never forkable: no reason to wait
            self._popen = self._exec_start(argv, env, cwd, log_path)
            return
        ready = server.wait_ready(wait)  # wait 0: a look (past the deadline, it gives up)
        if not ready and server.usable():
            return  # still importing: stays pending
        if ready:
            try:
                self._pid = server.fork(argv, env, cwd, log_path)
            except OSError:
                pass  # exec'd below
            else:
                with contextlib.suppress(OSError, AttributeError):
                    self._pidfd = os.pidfd_open(self._pid)
                return
        self._popen = self._exec_start(argv, env, cwd, log_path)

    @property
    def known_pid(self) -> int | None:
        """The pid if the process started, else None (never waits)."""
        return self._popen.pid if self._popen is not None else self._pid

    @property
    def pid(self) -> int:
        """The pid; a pending process is started first (waiting for its server at most
        :data:`READY_WAIT`, then by exec). Raises ProcessLookupError for one cancelled
        before it started: it has no pid, and no number may stand for one (0 and -1 name
        the agent's own group, or every process, to ``kill``)."""
        self._start(wait=READY_WAIT)
        if self.pending:  # the server still imports after READY_WAIT: exec it
            self._popen = self._exec_start(*self._request)
        pid = self.known_pid
        if pid is None:
            raise ProcessLookupError("a worker cancelled before it started has no pid")
        return pid

    def poll(self) -> int | None:
        if self.returncode is not None:
            return self.returncode
        self._start(wait=0.0)
        if self._popen is not None:
            self.returncode = self._popen.poll()
        elif self._pid is not None:
            code = self._server.exit_code(self._pid)
            if code is None and self._gone() and not self._server.usable():
                code = -signal.SIGKILL  # its server died; its parent-death signal killed it
            self.returncode = code
        return self.returncode

    def _gone(self) -> bool:
        """Whether the started process has exited (its server no longer reports it)."""
        if self._pidfd is not None:
            return bool(select.select([self._pidfd], [], [], 0)[0])
        try:
            os.kill(self._pid or 0, 0)
        except ProcessLookupError:
            return True
        except PermissionError:
            return False
        return False

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            if deadline is not None and time.monotonic() >= deadline:
                raise subprocess.TimeoutExpired(self.args, timeout or 0.0)
            time.sleep(0.02)
        return self.returncode  # type: ignore[return-value]

    def send_signal(self, sig: int, *, group: bool = False) -> None:
        """Send ``sig`` (to the process group it leads, with ``group``); a pending process
        is cancelled instead."""
        if self.pending:  # before poll(), which would start it now the server is ready
            self.returncode = -sig
            return
        if self.poll() is not None:
            return
        pid = self.known_pid
        if group:
            try:
                os.killpg(pid, sig)  # type: ignore[arg-type]
                return
            except ProcessLookupError:
                pass  # not its own group (yet): the process itself
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, sig)  # type: ignore[arg-type]

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def __del__(self) -> None:
        if self._pidfd is not None:
            with contextlib.suppress(OSError):
                os.close(self._pidfd)


def signal_group(proc: Any, sig: int) -> None:
    """Send ``sig`` to the process group ``proc`` leads (a pending forked one is
    cancelled)."""
    if isinstance(proc, ForkedProcess):
        proc.send_signal(sig, group=True)
        return
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, sig)


def is_pending(proc: Any) -> bool:
    """Whether ``proc`` is a forked worker that has not started yet."""
    return isinstance(proc, ForkedProcess) and proc.pending


# -- the server -------------------------------------------------------------------------------


def _send(sock: socket.socket, msg: Mapping[str, Any]) -> None:
    sock.sendall(json.dumps(msg).encode() + b"\n")


def _serve(sock: socket.socket, preload: Sequence[str]) -> dict[str, Any] | None:
    """Import ``preload``, then fork on request until the agent goes; returns the request
    in a forked child (which then becomes its worker), None in the server when it ends."""
    import importlib

    try:
        for name in preload:
            importlib.import_module(name)
    except BaseException as exc:  # told to the agent, which execs instead
        why = f"import {name}: {type(exc).__name__}: {exc}"
        print(f"failed: {why}; the agent execs its workers", flush=True)
        _send(sock, {"failed": why})
        return None
    cuda = _cuda_driver_loaded()
    if cuda:
        why = f"the imports loaded the CUDA driver ({cuda}): a forked worker could not use CUDA"
        print(f"failed: {why}; the agent execs its workers", flush=True)
        _send(sock, {"failed": why})
        return None
    import gc

    gc.collect()
    gc.freeze()  # the imports' objects: never touched by a collection, so pages stay shared
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_w, False)
    signal.set_wakeup_fd(wake_w)
    signal.signal(signal.SIGCHLD, lambda *_: None)
    print(f"ready: pid {os.getpid()}, imported {' '.join(preload)}", flush=True)
    _send(sock, {"ready": os.getpid()})
    buf = b""
    me = os.getpid()
    try:
        while True:
            _reap(sock)
            try:
                readable, _, _ = select.select([sock, wake_r], [], [], 5.0)
            except InterruptedError:
                continue
            if wake_r in readable:
                with contextlib.suppress(BlockingIOError):
                    os.read(wake_r, 4096)
            if sock not in readable:
                continue
            data = sock.recv(1 << 20)
            if not data:
                return None  # the agent closed its end
            buf += data
            *lines, buf = buf.split(b"\n")
            for line in lines:
                if not line.strip():
                    continue
                req = json.loads(line)
                if threading.active_count() != 1:
                    _send(sock, {"id": req["id"], "error": "the server runs a thread"})
                    continue
                try:
                    set_r, set_w = os.pipe()
                    pid = os.fork()
                except OSError as exc:
                    _send(sock, {"id": req["id"], "error": str(exc)})
                    continue
                if pid == 0:  # nothing here raises: a child must never go on serving
                    signal.set_wakeup_fd(-1)
                    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
                    for fd in (wake_r, wake_w, set_r, sock.detach()):
                        with contextlib.suppress(OSError):
                            os.close(fd)
                    return {**req, "server": me, "set_up": set_w}
                os.close(set_w)
                # The pid goes out once the child leads its own group and has its parent-
                # death signal (or died): a signal to its group then reaches it, as a
                # Popen'd process's does (its pid comes back after the exec).
                with contextlib.suppress(OSError):
                    os.read(set_r, 1)
                os.close(set_r)
                print(f"forked {pid}: {' '.join(req['argv'][1:3])} {req.get('log')}", flush=True)
                _send(sock, {"id": req["id"], "pid": pid})
    except OSError:  # the agent is gone (its end reset): so are we, and our children
        return None


def _cuda_driver_loaded() -> str:
    """The CUDA driver library mapped into this process, or "". ``import torch`` never
    loads it (CUDA starts lazily); anything that asked for a device count did, and after
    that a forked child's first CUDA call fails ("initialization error"), so the server
    refuses to fork and its workers are exec'd."""
    try:
        with open("/proc/self/maps", encoding="utf-8", errors="replace") as fh:
            for line in fh:
                name = line.rsplit("/", 1)[-1].strip()
                if name.startswith("libcuda.so"):
                    return name
    except OSError:
        return ""
    return ""


def _reap(sock: socket.socket) -> None:
    """Tell the agent of every child that exited."""
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        code = os.waitstatus_to_exitcode(status)
        print(f"exited {pid}: {code}", flush=True)
        _send(sock, {"exit": pid, "code": code})


def _become(req: Mapping[str, Any]) -> None:
    """In the forked child: become ``req``'s worker, as ``python -m MODULE ARGS`` would."""
    os.setsid()
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    if os.getppid() != req["server"]:
        os._exit(1)  # the server died before the parent-death signal was set
    with contextlib.suppress(OSError):
        os.write(req["set_up"], b"1")
        os.close(req["set_up"])
    log_fd = os.open(req["log"], os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC, 0o644)
    null_fd = os.open(os.devnull, os.O_RDONLY | os.O_CLOEXEC)
    sys.stdout.flush()
    sys.stderr.flush()
    os.dup2(null_fd, 0)
    os.dup2(log_fd, 1)
    os.dup2(log_fd, 2)
    os.close(log_fd)
    os.close(null_fd)
    argv, env = list(req["argv"]), dict(req["env"])
    env.setdefault("PYTHONUNBUFFERED", "1")
    os.chdir(req["cwd"])
    os.environ.clear()
    os.environ.update(env)
    target = target_of(argv, argv[0])  # the agent checked the interpreter is the server's
    if target is None or startup_env(env) != _server_startup:
        from elasticd.agent.pdeathsig import exec_or_exit

        os._exit(exec_or_exit(argv))  # the agent checks first; this is the guard
    _fresh_process_state()
    import builtins
    import importlib.machinery
    import io
    import runpy
    import tempfile
    import types

    tempfile.tempdir = None  # TMPDIR is the request's
    kind, name = target
    if kind == "module":
        sys.argv = ["-m", *argv[3:]]  # run_module puts the module's file first
        if not sys.flags.safe_path:  # PYTHONSAFEPATH: python puts no directory first
            sys.path[0] = os.getcwd()
        runpy.run_module(name, run_name="__main__", alter_sys=True)
        return
    if not os.path.isfile(name):  # as python says it (exit code 2)
        print(f"{argv[0]}: can't open file {os.path.abspath(name)!r}: [Errno 2] No such file "
              "or directory", file=sys.stderr, flush=True)  # fmt: skip
        raise SystemExit(2)
    sys.argv = [name, *argv[2:]]  # as given; __file__ absolute, sys.path[0] resolved
    if not sys.flags.safe_path:
        sys.path[0] = os.path.dirname(os.path.realpath(name))
    path = os.path.abspath(name)
    with io.open_code(path) as fh:
        code = compile(fh.read(), path, "exec", dont_inherit=True)
    main = types.ModuleType("__main__")
    main.__dict__.update(__file__=path, __spec__=None, __package__=None, __builtins__=builtins,
                         __loader__=importlib.machinery.SourceFileLoader("__main__", path))  # fmt: skip
    sys.modules["__main__"] = main
    exec(code, main.__dict__)


def _fresh_process_state() -> None:
    """What a new process draws afresh and a fork would share with its siblings: numpy's
    global random state (seeded from the OS at its import, in the server; Python's
    ``random`` reseeds itself in a forked child) and multiprocessing's authentication key."""
    np = sys.modules.get("numpy")
    if np is not None:
        with contextlib.suppress(Exception):
            np.random.seed()
    mp = sys.modules.get("multiprocessing")
    if mp is not None:
        with contextlib.suppress(Exception):
            mp.current_process().authkey = os.urandom(32)


_server_startup: dict[str, str] = {}


def main(argv: list[str]) -> int:
    global _server_startup
    if not argv or not argv[0].isdigit():
        print("usage: python -m elasticd.agent.forkserver FD [MODULE]...", file=sys.stderr)
        return 2
    _server_startup = startup_env(os.environ)
    sock = socket.socket(fileno=int(argv[0]))
    req = _serve(sock, argv[1:])
    if req is None:
        return 0
    _become(req)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
