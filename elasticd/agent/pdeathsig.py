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
import os
import signal
import sys

_PR_SET_PDEATHSIG = 1
USER_ERROR_EXIT_CODE = 2
"""elasticd.agent.policy's (not imported: this program starts before every exec)."""


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
    try:
        os.execvp(cmd[0], cmd)
    except OSError as exc:  # one line the agent's failure record carries, as a shell would
        print(f"elasticd: cannot run {cmd[0]}: {exc.strerror or exc}", file=sys.stderr)
        # The user's error (a misspelt or missing executable, a script without its x bit),
        # and no restart mends it: exit code 2 fails the job at once with this line. It
        # was a shell's 127/126, which the agent took for a crash and retried
        # restart.max_restarts times (11 failures over a minute by default).
        return USER_ERROR_EXIT_CODE
    return 1  # not reached


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
