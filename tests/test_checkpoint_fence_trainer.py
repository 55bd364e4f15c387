"""Fencing by round under ``python -m trainer``: the worker's run and round come from the
agent's environment, and a save refused by the fence is one line and exit code 76."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from checkpoint import Fence, committed_steps, read_latest, write_fence
from checkpoint.store import leftovers

RUN = "tiny-0a1b2c3d"

REPO = Path(__file__).resolve().parents[1]
TINY = REPO / "examples" / "tiny.yaml"


def run_trainer(tmp_path: Path, fence_round: int) -> subprocess.CompletedProcess:
    out = tmp_path / "out"
    write_fence(str(out / "ckpt"), Fence(run_id=RUN, round=fence_round))
    env = dict(os.environ, OMP_NUM_THREADS="1", ELASTICD_ROUND="3", TORCHELASTIC_RUN_ID=RUN)
    args = [sys.executable, "-m", "trainer", str(TINY), "--set", f"output_dir={out}",
            "--set", "train.steps=2"]  # fmt: skip
    return subprocess.run(args, env=env, capture_output=True, text=True, timeout=120,
                          cwd=tmp_path)  # fmt: skip


def test_a_fenced_trainer_exits_76_with_one_line_and_commits_nothing(tmp_path):
    proc = run_trainer(tmp_path, fence_round=4)
    assert proc.returncode == 76, proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr, proc.stderr[-2000:]
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("trainer: error: checkpoint step 2 was not saved: fenced: "), last
    assert "round 3 of run tiny-0a1b2c3d" in last and "round 4 of run tiny-0a1b2c3d" in last
    ckpt = str(tmp_path / "out" / "ckpt")
    assert committed_steps(ckpt) == [] and read_latest(ckpt) is None and leftovers(ckpt) == []


def test_a_trainer_of_the_current_round_commits(tmp_path):
    proc = run_trainer(tmp_path, fence_round=3)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert read_latest(str(tmp_path / "out" / "ckpt")) == 2


def test_the_fence_comes_from_the_agents_environment_and_plain_torchrun_has_none():
    from trainer.checkpointing import fence_from_env
    from trainer.errors import TrainerConfigError

    env = {"ELASTICD_ROUND": "7", "TORCHELASTIC_RUN_ID": RUN}
    assert fence_from_env(env) == Fence(run_id=RUN, round=7)
    assert fence_from_env({"TORCHELASTIC_RUN_ID": RUN}) is None
    assert fence_from_env({"ELASTICD_ROUND": "7"}) == Fence(run_id="", round=7)
    with pytest.raises(TrainerConfigError, match="ELASTICD_ROUND: 'seven' is not a round"):
        fence_from_env({"ELASTICD_ROUND": "seven"})
