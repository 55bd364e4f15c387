"""Crash safety: SIGKILL two saving ranks at random moments; the last commit always loads.

The worker half of this file runs as ``python tests/test_checkpoint_crash.py RANK WORLD
STORE CKPT``: real processes on gloo saving asynchronously in a loop, printing each step
once its commit is durable.
"""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import time

import pytest
import torch

from checkpoint import NoCheckpointError, SaveOptions, Saver, ShardInfo, load_latest, verify
from checkpoint.store import leftovers

TENSORS, ROWS, COLS = 12, 256, 512  # 6 MiB of model per save, plus as much optimizer state


def state(rank: int, world: int, step: int):
    model, optim = {}, {}
    for i in range(TENSORS):
        info = ShardInfo.split(f"w{i}", (ROWS, COLS), 0, rank, world)
        model[info.name] = (torch.full(info.sizes, float(step * 100 + i)), info)
        optim[f"exp_avg/{info.name}"] = (torch.full(info.sizes, float(-step)), info)
    return model, optim


def worker(rank: int, world: int, store: str, ckpt: str, start: int) -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    group = dist.new_group(backend="gloo")
    saver = Saver(ckpt, group=group, options=SaveOptions(async_=True, keep=2))
    for step in range(start, start + 10_000):
        model, optim = state(rank, world, step)
        saver.save(step=step, consumed_samples=step, model=model, optimizer=optim)
        time.sleep(random.uniform(0, 0.05))  # "training" while the writer runs
        result = saver.wait()
        if rank == 0:
            print(f"committed {result.step}", flush=True)


def check_loads(ckpt: str, committed_before_kill: int) -> int:
    model, optim = state(0, 1, 0)
    try:
        loaded = load_latest(ckpt, model=model, optimizer=optim)
    except NoCheckpointError:
        assert committed_before_kill == 0
        return 0
    step = loaded.step
    assert step >= committed_before_kill
    for i in range(TENSORS):
        assert torch.all(model[f"w{i}"][0] == step * 100 + i)
        assert torch.all(optim[f"exp_avg/w{i}"][0] == -step)
    assert verify(loaded) == []
    return step


def kill_during_saves(tmp_path, rounds: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    ckpt = str(tmp_path / "ckpt")
    loaded = []
    resume = 0  # each round restarts from what the previous one left, like a real restart
    for attempt in range(rounds):
        store = str(tmp_path / f"store-{attempt}")
        procs = [
            subprocess.Popen(
                [sys.executable, __file__, str(r), "2", store, ckpt, str(resume + 1)],
                stdout=subprocess.PIPE if r == 0 else subprocess.DEVNULL,
                env={**os.environ, "OMP_NUM_THREADS": "1"},
                text=True,
                start_new_session=True,
            )
            for r in range(2)
        ]
        try:
            # Wait for one commit of this round, then kill at a random moment after it.
            line = procs[0].stdout.readline()
            assert line.startswith("committed"), line
            time.sleep(rng.uniform(0.0, 1.5))
        finally:
            for p in procs:
                os.killpg(p.pid, signal.SIGKILL)
            seen = [line, *procs[0].stdout.read().splitlines()]
            for p in procs:
                p.wait()
        committed = max(int(s.split()[1]) for s in seen if s.startswith("committed"))
        resume = check_loads(ckpt, committed)
        loaded.append(resume)
    return loaded


def test_sigkill_at_random_moments_of_async_saves_always_leaves_a_loadable_latest(tmp_path):
    loaded = kill_during_saves(tmp_path, rounds=3, seed=1)
    assert loaded == sorted(loaded) and loaded[0] > 0
    # A later save cleans up whatever the killed saves left half-written.
    saver = Saver(str(tmp_path / "ckpt"), group=None, options=SaveOptions(async_=False, keep=2))
    model, optim = state(0, 1, 99_999)
    saver.save(step=99_999, consumed_samples=0, model=model, optimizer=optim)
    saver.close()
    assert leftovers(str(tmp_path / "ckpt")) == []


@pytest.mark.slow
def test_many_random_sigkills_during_async_saves_never_lose_the_last_commit(tmp_path):
    kill_during_saves(tmp_path, rounds=25, seed=7)


if __name__ == "__main__":
    worker(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4], int(sys.argv[5]))
