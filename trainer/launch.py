"""Run ``python -m trainer`` on N local processes with a torchrun-style environment.

For tests and benchmarks on one machine (no agent, no etcd): every rank gets RANK,
WORLD_SIZE, LOCAL_RANK, MASTER_ADDR and MASTER_PORT, as torchrun would give it.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from elasticd.etcd.server import reserve_port


@dataclass(frozen=True, kw_only=True, slots=True)
class RankOutcome:
    """How one rank ended."""

    rank: int
    """Global rank."""
    returncode: int
    """Exit status (negative: killed by that signal)."""
    output: str
    """Its stdout and stderr together."""


def free_port() -> int:
    """A TCP port that was free a moment ago on the loopback interface. Another process
    may take it before ours binds it: to hand a port to a process that binds it later, hold
    it with :func:`elasticd.etcd.reserve_port` instead."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch_local(
    job_path: str,
    *,
    world: int,
    overrides: Sequence[str] = (),
    env: Mapping[str, str] | None = None,
    timeout: float = 240.0,
    cwd: str | None = None,
    module: str = "trainer",
) -> list[RankOutcome]:
    """Start ``world`` ranks, wait for all of them, and return how each ended.

    On a timeout every rank still running is killed (so nothing leaks) and the outcomes
    say so with a negative return code.
    """
    # Held until every rank ended: rank 0's TCPStore binds it seconds from now, after
    # importing torch, and a port merely free now may be taken by then (EADDRINUSE).
    hold = reserve_port()
    port = hold.getsockname()[1]
    base = dict(os.environ if env is None else env)
    base.setdefault("OMP_NUM_THREADS", "1")
    procs = []
    args = [sys.executable, "-m", module, job_path]
    for o in overrides:
        args += ["--set", o]
    for rank in range(world):
        rank_env = dict(base)
        rank_env.update(
            RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank),
            LOCAL_WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
        )  # fmt: skip
        procs.append(
            subprocess.Popen(
                args,
                env=rank_env,
                cwd=cwd,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
            )
        )
    deadline = time.monotonic() + timeout
    outcomes = []
    try:
        for rank, proc in enumerate(procs):
            try:
                out, _ = proc.communicate(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.kill()
                out, _ = proc.communicate()
                out += f"\n[killed after {timeout:.0f} s]"
            outcomes.append(RankOutcome(rank=rank, returncode=proc.returncode, output=out))
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        hold.close()
    return outcomes
