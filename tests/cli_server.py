"""``python -m elasticd ARGV`` run in a forked child of one process that has imported torch
and the CLI's modules once.

The hostile-checkpoint tests run the CLI a few hundred times, each in its own process under
a time and address-space limit; as fresh interpreters each run spent 1.5-2 s of CPU
importing torch (most of those tests' time). Here each run is still a separate process
with its own limits, its own stdout and stderr, and its exit status, running the same
``elasticd`` module as ``python -m`` does, and ending as such a process ends (see
``_child``; less the finalisation of the modules' globals, see ``_finish``). Only the interpreter's start and the imports are shared, so what happens at
import (a warning printed once) is the server's, not each run's: not what these tests
check; the CLI's own tests start real interpreters.

Protocol: one JSON request per line on stdin (id, argv, cwd, stdout and stderr paths,
timeout in seconds, address-space limit in bytes); one JSON reply per line on stdout
(``{"id": id, "code": exit status}``, negative for a signal, as ``subprocess`` reports
it). The server runs one request at a time.
"""

from __future__ import annotations

import atexit
import contextlib
import gc
import json
import os
import resource
import runpy
import signal
import sys
import threading
from typing import NoReturn

import torch  # noqa: F401  (the import every run would pay)

import checkpoint
import checkpoint.verify  # noqa: F401
import elasticd.cli  # noqa: F401
import trainer.hf  # noqa: F401


def _child(req: dict) -> None:
    """Become the run: never returns to the server's loop. The run ends as a ``python -m
    elasticd`` process does (an exception or SystemExit propagates out of the server's
    ``main`` to the interpreter, which prints it, joins non-daemon threads, runs atexit
    handlers and flushes, as for any program); only the imports were made before."""
    os.chdir(req["cwd"])
    for fd, path, flags in ((0, os.devnull, os.O_RDONLY),
                            (1, req["stdout"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC),
                            (2, req["stderr"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC)):  # fmt: skip
        opened = os.open(path, flags, 0o600)
        os.dup2(opened, fd)
        os.close(opened)
    resource.setrlimit(resource.RLIMIT_AS, (req["memory"], req["memory"]))
    signal.alarm(max(1, int(req["timeout"])))  # its default action ends the run
    sys.argv = ["elasticd", *req["argv"]]
    try:
        runpy.run_module("elasticd", run_name="__main__", alter_sys=True)
        code = 0
    except SystemExit as exc:
        code = _exit_status(exc.code)
    except BaseException:  # what the interpreter prints for an uncaught exception
        sys.excepthook(*sys.exc_info())
        code = 1
    _finish(code)


def _exit_status(code: object) -> int:
    """The status the interpreter exits with for ``sys.exit(code)``: 0 for None, an int
    as it is, anything else printed to stderr and 1."""
    if code is None:
        return 0
    if isinstance(code, int):
        return code & 0xFF
    print(code, file=sys.stderr)
    return 1


def _finish(code: int) -> NoReturn:
    """End the run as the interpreter ends a program, less the last step: join the
    non-daemon threads, run the atexit handlers (``weakref.finalize`` among them), collect
    what is unreachable, flush stdout and stderr, exit. The step left out is the
    finalisation of every module's globals, which with torch loaded took 0.6-0.7 s of each
    run (most of each run here; a real ``elasticd ckpt verify`` imports no torch and exits
    in 0.3 s): a file the CLI left open and reachable from a module is not flushed by
    its ``__del__`` here, which the CLI's own tests (real interpreters) would see."""
    threading._shutdown()  # what Py_FinalizeEx does first
    atexit._run_exitfuncs()
    gc.collect()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(OSError, ValueError):  # a closed or broken stream
            stream.flush()
    os._exit(code)


def main() -> None:
    for line in sys.stdin:
        req = json.loads(line)
        pid = os.fork()
        if pid == 0:
            _child(req)
        _, status = os.waitpid(pid, 0)
        reply = {"id": req["id"], "code": os.waitstatus_to_exitcode(status)}
        print(json.dumps(reply), flush=True)


if __name__ == "__main__":
    main()
