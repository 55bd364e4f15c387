"""Exec a command that dies with its parent: ``python -m elasticd.agent.pdeathsig PPID CMD...``.

The agent could set the parent-death signal in a ``preexec_fn``, but that forces a plain
``fork()`` of a process full of gRPC threads, and gRPC's fork handlers then abort the
child now and then (seen: ``epoll_wait error: Bad file descriptor``, SIGABRT). Without a
preexec_fn, ``subprocess`` uses vfork/posix_spawn and runs no fork handlers; this tiny
program sets ``PR_SET_PDEATHSIG = SIGKILL`` in its own process and then execs the real
command, which keeps the setting (it is only cleared for set-uid programs).
"""

from __future__ import annotations

import ctypes
import errno
import os
import signal
import sys

_PR_SET_PDEATHSIG = 1


def main(argv: list[str]) -> int:
    if len(argv) < 2 or not argv[0].isdigit():
        print("usage: python -m elasticd.agent.pdeathsig PPID CMD [ARG]...", file=sys.stderr)
        return 2
    parent, cmd = int(argv[0]), argv[1:]
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) != 0:
        print(f"pdeathsig: prctl failed: errno {ctypes.get_errno()}", file=sys.stderr)
        return 1
    # The parent may have died before prctl took effect; then no signal would ever come.
    if os.getppid() != parent:
        return 1
    return exec_or_exit(cmd)


def exec_or_exit(cmd: list[str]) -> int:
    """Exec ``cmd`` (looked up on PATH) in this process; if that fails, say so in one line
    and return the exit code a shell would give (the caller exits with it; a forked worker
    that cannot be run by a fork is exec'd the same way)."""
    try:
        os.execvp(cmd[0], cmd)
    except OSError as exc:  # one line the agent's failure record carries, as a shell would
        print(f"elasticd: cannot run {cmd[0]}: {exc.strerror or exc}", file=sys.stderr,
              flush=True)  # fmt: skip
        # A shell's codes for what no retry mends (not found, not executable): in the
        # job's first world the agent fails the job on them at once, later it counts
        # them as this node's crash (elasticd.agent.policy.CANNOT_RUN_EXIT_CODES). What
        # may pass (a busy text file mid-deploy, memory, I/O) is a plain crash.
        if exc.errno in (errno.ENOENT, errno.ENOTDIR):
            return 127
        if exc.errno in (errno.EACCES, errno.ENOEXEC, errno.ELOOP, errno.ENAMETOOLONG, errno.EPERM):
            return 126
        return 1
    return 1  # not reached


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
