"""`python -m trainer`: metrics.jsonl as DESIGN.md specifies, the per-step line, the
agent's layout file, and bad jobs failing before training with one line and exit code 2."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from elasticd.jobspec import load_job
from elasticd.layout import plan
from trainer.__main__ import main as trainer_main

REPO = Path(__file__).resolve().parents[1]
TINY = REPO / "examples" / "tiny.yaml"
FIELDS = {"step", "loss", "grad_norm", "lr", "world", "dp", "tp", "pp", "vpp", "ep", "step_s",
          "tokens_per_s", "mfu", "mem_gb", "skipped", "round"}  # fmt: skip


def test_a_run_appends_the_designed_metrics_and_prints_a_line_per_step(tmp_path: Path) -> None:
    out = tmp_path / "out"
    # No resume: both runs start from step 0 (resuming is the checkpoint tests' business).
    sets = [
        "--set",
        f"output_dir={out}",
        "--set",
        "train.steps=3",
        "--set",
        "checkpoint.resume=false",
    ]
    layout_file = tmp_path / "layout.json"
    layout_file.write_text(json.dumps(plan(1, load_job(TINY, [])).to_dict()))
    env = dict(os.environ, OMP_NUM_THREADS="1", ELASTICD_ROUND="5",
               ELASTICD_LAYOUT=str(layout_file))  # fmt: skip
    for _ in range(2):  # a second run appends (as after a restart), it never truncates
        proc = subprocess.run([sys.executable, "-m", "trainer", str(TINY), *sets], env=env,
                              capture_output=True, text=True, timeout=120, cwd=tmp_path)  # fmt: skip
        assert proc.returncode == 0, proc.stderr[-2000:]
        lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("step ")]
        assert len(lines) == 3 and "loss" in lines[0] and "tokens/s" in lines[0]
    records = [json.loads(ln) for ln in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2, 3, 1, 2, 3]
    for r in records:
        assert set(r) == FIELDS
        assert r["round"] == 5 and r["world"] == 1 and r["dp"] == 1 and r["tp"] == 1
        assert r["step_s"] > 0 and r["tokens_per_s"] > 0 and r["grad_norm"] > 0
    assert records[0] == {**records[3], "step_s": records[0]["step_s"],
                          "tokens_per_s": records[0]["tokens_per_s"],
                          "mem_gb": records[0]["mem_gb"]}  # fmt: skip


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["parallel.tp=3"], "parallel.tp: 3 does not divide model.heads (4)"),
        (["train.dtype=float16"], "train.dtype: float16 needs loss scaling"),
        (["model.layrs=3"], "model.layrs: unknown key"),
        (["data.source=file", "data.path=/nonexistent/tokens.bin"], "no such token file"),
        (["model.experts=4", "parallel.tp=4", "parallel.etp=2", "nproc_per_node=4"],
         "parallel.etp: 2: the built-in trainer supports etp = 1 or etp = tp (4)"),
    ],
)  # fmt: skip
def test_a_bad_job_fails_before_training_with_one_line_and_exit_code_2(
    overrides, message, capsys, tmp_path
) -> None:
    args = [str(TINY), "--set", f"output_dir={tmp_path}"]
    for o in overrides:
        args += ["--set", o]
    env = {"RANK": "0", "WORLD_SIZE": str(4 if "parallel.tp=4" in overrides else 1)}
    assert trainer_main(args, env=env) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and message in err, err
    assert not (tmp_path / "metrics.jsonl").exists()


def test_a_layout_file_for_another_world_size_is_refused(tmp_path, capsys) -> None:
    layout_file = tmp_path / "layout.json"
    layout_file.write_text(json.dumps(plan(2, load_job(TINY, [])).to_dict()))
    rc = trainer_main([str(TINY)], env={"RANK": "0", "WORLD_SIZE": "1",
                                        "ELASTICD_LAYOUT": str(layout_file)})  # fmt: skip
    assert rc == 2
    assert "the layout is for 2 ranks, WORLD_SIZE is 1" in capsys.readouterr().err


def test_a_resume_that_cannot_load_any_checkpoint_is_one_line_and_exit_code_2(
    tmp_path: Path,
) -> None:
    """A model changed under an existing checkpoint directory is a user error, not a crash."""
    out = tmp_path / "out"
    env = dict(os.environ, OMP_NUM_THREADS="1")
    base = [sys.executable, "-m", "trainer", str(TINY), "--set", f"output_dir={out}"]
    first = subprocess.run([*base, "--set", "train.steps=2"], env=env, capture_output=True,
                           text=True, timeout=120, cwd=tmp_path)  # fmt: skip
    assert first.returncode == 0, first.stderr[-2000:]
    again = subprocess.run([*base, "--set", "train.steps=4", "--set", "model.hidden=32"],
                           env=env, capture_output=True, text=True, timeout=120,
                           cwd=tmp_path)  # fmt: skip
    assert again.returncode == 2, again.stderr[-2000:]
    assert "Traceback" not in again.stderr
    # Before the error, load_latest warns once per step it could not load.
    last = again.stderr.strip().splitlines()[-1]
    assert last.startswith("trainer: error: "), again.stderr[-2000:]
    assert "no committed checkpoint loads" in last and "shape" in last


def test_a_checkpoint_dir_that_only_some_ranks_see_is_one_line_and_exit_code_2(
    tmp_path: Path,
) -> None:
    """Not shared storage: rank 0 sees a checkpoint, rank 1 none. Both say so at once,
    instead of rank 0 loading alone and waiting in a collective for its whole timeout."""
    from elasticd.etcd import reserve_port

    seen, unseen = tmp_path / "seen", tmp_path / "unseen"
    seen.mkdir()
    unseen.mkdir()
    env = dict(os.environ, OMP_NUM_THREADS="1")
    # output_dir is relative, so each rank resolves it against its own working directory.
    first = subprocess.run([sys.executable, "-m", "trainer", str(TINY), "--set", "output_dir=out",
                            "--set", "train.steps=2"], env=env, capture_output=True, text=True,
                           timeout=120, cwd=seen)  # fmt: skip
    assert first.returncode == 0, first.stderr[-2000:]
    hold = reserve_port()  # held until both ranks ended: rank 0's store binds it later
    port = str(hold.getsockname()[1])
    args = [sys.executable, "-m", "trainer", str(TINY), "--set", "output_dir=out",
            "--set", "train.steps=4", "--set", "nproc_per_node=2"]  # fmt: skip
    procs = [
        subprocess.Popen(args, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                         env=dict(env, RANK=str(r), LOCAL_RANK=str(r), WORLD_SIZE="2",
                                  MASTER_ADDR="127.0.0.1", MASTER_PORT=port))
        for r, cwd in enumerate((seen, unseen))
    ]  # fmt: skip
    try:
        results = [p.communicate(timeout=120) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
        hold.close()
    for p, (_, err) in zip(procs, results, strict=True):
        assert p.returncode == 2, err[-2000:]
        last = err.strip().splitlines()[-1]
        assert last.startswith("trainer: error: checkpoint.dir: "), err[-2000:]
        assert "must be storage shared by all nodes" in last
