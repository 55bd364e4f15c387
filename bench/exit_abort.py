"""How often torch aborts a gloo process that leaves with its process group open.

    OMP_NUM_THREADS=1 python bench/exit_abort.py [--runs 20] [--pairs 4] [--steps 8]

Each run starts ``--pairs`` two-rank gloo worlds at once (more processes than cores is
what makes the abort show), each rank all-reducing a small tensor for ``--steps`` steps
and then leaving, in one of two ways, interleaved run by run:

- ``open``: the script ends with its group open (as docs/testing.md's first script did);
- ``destroyed``: ``dist.destroy_process_group()`` first, torch's documented shutdown.

It prints, per way, how many processes exited other than 0 and how many of those printed
"terminate called without an active exception" (C++'s bare ``std::terminate``: signal 6,
which the agent counts as a failed worker). The agent names the fix when it sees that
abort (elasticd/agent/workers.py, ``_abort_hint``).
"""

from __future__ import annotations

import argparse
import os
import random
import resource
import subprocess
import sys

RANK = """
import os, sys, torch, torch.distributed as dist
rank, port, steps, way = int(sys.argv[1]), sys.argv[2], int(sys.argv[3]), sys.argv[4]
os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=port)
dist.init_process_group("gloo", rank=rank, world_size=2)
w = torch.zeros(4)
for step in range(steps):
    g = torch.full((4,), float(step + 1))
    dist.all_reduce(g)
    w -= 0.01 * g / 2
if way == "destroyed":
    dist.destroy_process_group()
"""

ABORT = "terminate called without an active exception"


def _no_core_file() -> None:
    """An aborted rank leaves no core file behind."""
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))


def one_run(way: str, pairs: int, steps: int) -> tuple[int, int, int]:
    """Processes started, exits other than 0, and those that printed the abort."""
    env = dict(os.environ, OMP_NUM_THREADS="1")
    procs = []
    ports = random.sample(range(20000, 40000), pairs)
    for port in ports:
        for rank in (0, 1):
            argv = [sys.executable, "-c", RANK, str(rank), str(port), str(steps), way]
            procs.append(subprocess.Popen(argv, stderr=subprocess.PIPE, env=env,
                                          preexec_fn=_no_core_file))  # fmt: skip
    failed = aborted = 0
    for proc in procs:
        _, err = proc.communicate(timeout=300)
        if proc.returncode != 0:
            failed += 1
            aborted += ABORT in err.decode(errors="replace")
    return len(procs), failed, aborted


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=20)
    parser.add_argument("--pairs", type=int, default=4)
    parser.add_argument("--steps", type=int, default=8)
    args = parser.parse_args()
    ways = ("open", "destroyed")
    totals = {way: [0, 0, 0] for way in ways}
    for _ in range(args.runs):
        for way in ways:
            for i, n in enumerate(one_run(way, args.pairs, args.steps)):
                totals[way][i] += n
    print(f"{'way':<10} {'processes':>9} {'failed':>6} {'aborted':>7}")
    for way in ways:
        n, failed, aborted = totals[way]
        print(f"{way:<10} {n:>9} {failed:>6} {aborted:>7}")
    print(f"cores {os.cpu_count()}, {args.pairs} pairs at a time, {args.steps} steps")


if __name__ == "__main__":
    main()
