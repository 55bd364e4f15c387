"""``python -m elasticd ARGV`` run in a forked child of one process that has imported torch
and the CLI's modules once.

The hostile-checkpoint tests run the CLI a few hundred times, each in its own process under
a time and address-space limit; as fresh interpreters each run spent 1.5-2 s of CPU
importing torch (most of those tests' time). Here each run is still a separate process
with its own limits, its own stdout and stderr, and its exit status, running the same
``elasticd`` module as ``python -m`` does; only the interpreter's start and the imports
are shared. (A run that imports differently is not what these tests check; the CLI's own
tests start real interpreters.)

Protocol: one JSON request per line on stdin (argv, cwd, stdout and stderr paths, timeout
in seconds, address-space limit in bytes); one JSON reply per line on stdout
(``{"code": exit status}``, negative for a signal, as ``subprocess`` reports it). The
server runs one request at a time.
"""

from __future__ import annotations

import json
import os
import resource
import runpy
import signal
import sys
import traceback

import torch  # noqa: F401  (the import every run would pay)

import checkpoint
import checkpoint.verify  # noqa: F401
import elasticd.cli  # noqa: F401
import trainer.hf  # noqa: F401


def _child(req: dict) -> None:
    code = 1
    try:
        os.chdir(req["cwd"])
        for fd, path in ((1, req["stdout"]), (2, req["stderr"])):
            out = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            os.dup2(out, fd)
            os.close(out)
        os.close(0)
        resource.setrlimit(resource.RLIMIT_AS, (req["memory"], req["memory"]))
        signal.alarm(int(req["timeout"]))  # its default action ends the run
        sys.argv = ["elasticd", *req["argv"]]
        try:
            runpy.run_module("elasticd", run_name="__main__", alter_sys=True)
            code = 0
        except SystemExit as exc:  # as the interpreter ends on it
            if exc.code is None:
                code = 0
            elif isinstance(exc.code, int):
                code = exc.code
            else:
                print(exc.code, file=sys.stderr)
        except BaseException:  # uncaught: a traceback, exit 1
            traceback.print_exc()
    finally:
        try:
            sys.stdout.flush()
            sys.stderr.flush()
        finally:
            os._exit(code)


def main() -> None:
    for line in sys.stdin:
        req = json.loads(line)
        pid = os.fork()
        if pid == 0:
            _child(req)
        _, status = os.waitpid(pid, 0)
        print(json.dumps({"code": os.waitstatus_to_exitcode(status)}), flush=True)


if __name__ == "__main__":
    main()
