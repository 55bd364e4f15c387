"""Wall time of ``elasticd ckpt ls``, ``inspect`` and ``verify`` as a user runs them.

    python bench/ckpt_cli.py [--mb 1,100] [--repeats 7]

For each checkpoint size, a checkpoint of one step (a GPT-like state of fp32 matrices,
saved by the store's own ``Saver``) is written to a temporary directory, then each command
runs as a fresh ``python -m elasticd ckpt ...`` process, side by side and interleaved
(repeat 1 of every case, then repeat 2, ...) with the same command run by an interpreter
that imports torch first: what every one of these commands paid before they stopped
importing it. Prints the medians and their ratio; each run's exit status must be 0.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

WITH_TORCH = (
    "import runpy, sys, torch; sys.argv = ['elasticd', *sys.argv[1:]]; "
    "runpy.run_module('elasticd', run_name='__main__', alter_sys=True)"
)


def write_checkpoint(path: str, mb: float) -> None:
    import torch

    from checkpoint import SaveOptions, Saver, ShardInfo

    rows = max(1, int(mb * 1e6 / 4 / 1024 / 8))  # 8 matrices of rows x 1024 fp32
    model = {
        f"layer{i}.weight": (
            torch.randn(rows, 1024),
            ShardInfo.whole(f"layer{i}.weight", (rows, 1024)),
        )
        for i in range(8)
    }
    saver = Saver(path, group=None, options=SaveOptions(async_=False))
    saver.save(step=1, consumed_samples=1, model=model)
    saver.close()


def timed(argv: list[str]) -> float:
    t0 = time.perf_counter()
    proc = subprocess.run(argv, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    seconds = time.perf_counter() - t0
    if proc.returncode != 0:
        raise SystemExit(f"{' '.join(argv)}: exit {proc.returncode}: {proc.stderr.strip()}")
    return seconds


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mb", default="1,100", help="checkpoint sizes in MB, comma-separated")
    ap.add_argument("--repeats", type=int, default=7)
    args = ap.parse_args()
    commands = ("ls", "inspect", "verify")
    print(f"python {sys.version.split()[0]}, {os.cpu_count()} cores, load average "
          f"{os.getloadavg()[0]:.2f} at the start")  # fmt: skip
    with tempfile.TemporaryDirectory(prefix="ckpt-cli-") as tmp:
        sizes = [float(x) for x in args.mb.split(",")]
        dirs = {}
        for mb in sizes:
            dirs[mb] = os.path.join(tmp, f"ckpt-{mb:g}")
            write_checkpoint(dirs[mb], mb)
        cases = [(mb, cmd) for mb in sizes for cmd in commands]
        ours: dict = {c: [] for c in cases}
        before: dict = {c: [] for c in cases}
        for _ in range(args.repeats):
            for mb, cmd in cases:
                tail = ["ckpt", cmd, dirs[mb]]
                ours[(mb, cmd)].append(timed([sys.executable, "-m", "elasticd", *tail]))
                before[(mb, cmd)].append(timed([sys.executable, "-c", WITH_TORCH, *tail]))
    print(f"{'MB':>6} {'command':<8} {'ours s':>8} {'torch first s':>14} {'ratio':>6}")
    for mb, cmd in cases:
        a, b = statistics.median(ours[(mb, cmd)]), statistics.median(before[(mb, cmd)])
        print(f"{mb:>6g} {cmd:<8} {a:>8.3f} {b:>14.3f} {b / a:>5.1f}x")
    print(f"load average {os.getloadavg()[0]:.2f} at the end; medians of {args.repeats}")


if __name__ == "__main__":
    main()
