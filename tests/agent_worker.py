"""A small real worker for agent tests: gloo collectives, checkpoints, heartbeats.

It behaves like the trainer where the agent can see it, at a fraction of the start-up
cost: it joins the process group from the torchrun environment, resumes from the latest
"checkpoint" in checkpoint.dir (a JSON state under step-NNNNNNNNN/ with a manifest and a
``latest`` pointer), runs train.steps steps (one all-reduce each, then a sleep of
$AGENT_TEST_STEP_S), appends metrics.jsonl on rank 0, reports a heartbeat per step,
saves every checkpoint.every steps, and on SIGTERM saves at once and exits 75.

The "loss" of step k is a function of k alone (the all-reduced mean of k), so any world
size gives the same sequence: a resumed run matches an uninterrupted one.

For the failure rules: ``AGENT_TEST_USER_ERROR_AT=K`` makes rank 0 print an error line
and exit 2 (a user error) at step K. ``AGENT_TEST_CRASH_AT=K,L,...`` makes rank 0 exit 1
(a crash) the first time it reaches each of those steps (a marker file in output_dir
remembers), ``AGENT_TEST_CRASH_LOOP_AT=K`` every time it reaches step K. Each metrics record carries the worker's
CUDA_VISIBLE_DEVICES (``devices``), so tests see which slots a job got.
"""

from __future__ import annotations

import json
import os
import sys
import time
from datetime import timedelta

import torch
import torch.distributed as dist

from elasticd.worker import PREEMPTED_EXIT_CODE, WorkerChannel


def latest(ckpt: str) -> tuple[int, float]:
    try:
        with open(os.path.join(ckpt, "latest"), encoding="utf-8") as fh:
            name = fh.read().strip()
        with open(os.path.join(ckpt, name, "state.json"), encoding="utf-8") as fh:
            state = json.load(fh)
        return int(state["step"]), float(state["value"])
    except (OSError, ValueError, KeyError):
        return 0, 0.0


def save(ckpt: str, step: int, value: float, rank: int) -> dict:
    """Commit ``step``; returns what the heartbeat reports of it (step, seconds)."""
    t0 = time.time()
    dist.barrier()
    if rank == 0:
        name = f"step-{step:09d}"
        final = os.path.join(ckpt, name)
        if not os.path.exists(final):
            tmp = final + ".tmp"
            os.makedirs(tmp, exist_ok=True)
            with open(os.path.join(tmp, "state.json"), "w", encoding="utf-8") as fh:
                json.dump({"step": step, "value": value}, fh)
            size = os.path.getsize(os.path.join(tmp, "state.json"))
            with open(os.path.join(tmp, "manifest.json"), "w", encoding="utf-8") as fh:
                json.dump({"step": step, "created_unix": time.time(),
                           "files": {"state.json": {"bytes": size}}}, fh)  # fmt: skip
            os.replace(tmp, final)
        with open(os.path.join(ckpt, "latest.tmp"), "w", encoding="utf-8") as fh:
            fh.write(name)
        os.replace(os.path.join(ckpt, "latest.tmp"), os.path.join(ckpt, "latest"))
    dist.barrier()
    return {"step": step, "seconds": time.time() - t0}


def first_crash(out: str, step: int) -> bool:
    """Whether this is the first time a crash at ``step`` is due (and mark it done)."""
    try:
        with open(os.path.join(out, f"crashed-at-{step}"), "x"):
            return True
    except FileExistsError:
        return False


def main() -> int:
    with open(os.environ["ELASTICD_JOB_FILE"], encoding="utf-8") as fh:
        job = json.load(fh)
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    steps, every = job["train"]["steps"], job["checkpoint"]["every"]
    out, ckpt = job["output_dir"], job["checkpoint"]["dir"]
    step_s = float(os.environ.get("AGENT_TEST_STEP_S", "0.2"))
    channel = WorkerChannel.from_env()
    channel.install_preemption_handler()
    dist.init_process_group("gloo", timeout=timedelta(seconds=60))
    channel.mark("pg_ready")
    os.makedirs(ckpt, exist_ok=True)
    start, value = latest(ckpt)
    channel.mark("ckpt_loaded")
    saved = None
    user_error_at = int(os.environ.get("AGENT_TEST_USER_ERROR_AT", "0") or 0)
    crash_at = {int(k) for k in os.environ.get("AGENT_TEST_CRASH_AT", "").split(",") if k}
    crash_loop_at = int(os.environ.get("AGENT_TEST_CRASH_LOOP_AT", "0") or 0)
    for step in range(start + 1, steps + 1):
        if rank == 0 and step == user_error_at:
            print(f"agent_worker: error: bad setting at step {step}", file=sys.stderr, flush=True)
            os._exit(2)
        if rank == 0 and (step == crash_loop_at or (step in crash_at and first_crash(out, step))):
            print(f"agent_worker: crashing at step {step}", file=sys.stderr, flush=True)
            os._exit(1)
        t0 = time.time()
        contribution = torch.tensor([float(step)])
        dist.all_reduce(contribution)
        value += contribution.item() / world
        time.sleep(step_s)
        loss = 10.0 / (1.0 + value)
        if rank == 0:
            with open(os.path.join(out, "metrics.jsonl"), "a", encoding="utf-8") as fh:
                record = {"step": step, "loss": loss, "world": world,
                          "round": int(os.environ["ELASTICD_ROUND"]), "step_s": time.time() - t0,
                          "devices": os.environ.get("CUDA_VISIBLE_DEVICES")}  # fmt: skip
                fh.write(json.dumps(record) + "\n")
        print(f"rank {rank} step {step} loss {loss:.6f}", flush=True)
        channel.progress(step=step, loss=loss, tokens_per_s=100.0, step_s=time.time() - t0,
                         checkpoint_save=saved)  # fmt: skip
        if (every and step % every == 0) or step == steps:
            saved = save(ckpt, step, value, rank)
            channel.progress(step=step, loss=loss, tokens_per_s=100.0, checkpoint_save=saved)
        if channel.preempt_agreed():
            save(ckpt, step, value, rank)
            dist.destroy_process_group()
            return PREEMPTED_EXIT_CODE
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
