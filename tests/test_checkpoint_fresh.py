"""`elasticd submit --fresh` starts a job over: it deletes only what the checkpoint store
wrote in the job's checkpoint dir, and refuses another job's directory, a directory a run
is using, and a job that is still active. Without it, submit says the job resumes, naming
the step."""

from __future__ import annotations

import json
import os
import uuid
from pathlib import Path

import torch

from checkpoint import SaveOptions, Saver, ShardInfo, committed_steps
from checkpoint.owner import claim
from elasticd.cli import main


def job_file(tmp_path: Path, name: str) -> Path:
    path = tmp_path / "job.yaml"
    path.write_text(f"name: {name}\noutput_dir: out\ntrain: {{steps: 5}}\n")
    return path


def checkpoints(ckpt: Path, job: str, steps) -> None:
    saver = Saver(str(ckpt), group=None, options=SaveOptions(async_=False, job=job, keep=5))
    for step in steps:
        w = torch.full((4, 4), float(step))
        saver.save(step=step, consumed_samples=step, model={"w": (w, ShardInfo.whole("w", (4, 4)))})
    saver.close()


def submit(capsys, where: Path, etcd: str, *extra: str) -> tuple[int, str, str]:
    """``elasticd submit job.yaml`` run in ``where`` (relative paths resolve there)."""
    here = os.getcwd()
    os.chdir(where)
    try:
        code = main(["submit", "job.yaml", "--etcd", etcd, *extra])
    finally:
        os.chdir(here)
    out, err = capsys.readouterr()
    return code, out, err


def test_submit_says_it_resumes_and_fresh_deletes_only_the_stores_files(
    etcd_server, tmp_path, capsys
):
    name = f"fresh-{uuid.uuid4().hex[:8]}"
    job_file(tmp_path, name)
    ckpt = tmp_path / "out" / "ckpt"
    checkpoints(ckpt, name, [2, 4])
    claim(str(ckpt), job=name, run_id=f"{name}-1").release()  # owner.json, lock
    (ckpt / "notes.txt").write_text("mine")
    (ckpt / "step-000000006.0a0b0c0d.tmp").mkdir()  # a save that died
    (ckpt / "fence.json").write_text(json.dumps({"run_id": f"{name}-1", "round": 3}))
    ep = etcd_server.endpoint

    code, out, _ = submit(capsys, tmp_path, ep)
    assert code == 0
    lines = [line for line in out.splitlines() if line.startswith(f"job {name} resumes")]
    assert lines == [
        f"job {name} resumes from {ckpt / 'step-000000004'} at step 4 (--fresh starts over)"
    ]

    # Still pending: --fresh refuses and deletes nothing.
    code, _, err = submit(capsys, tmp_path, ep, "--fresh")
    assert code == 2 and err.count("\n") == 1 and "is pending; cancel it" in err, err
    assert committed_steps(str(ckpt)) == [2, 4]

    assert main(["cancel", name, "--etcd", ep]) == 0
    capsys.readouterr()
    code, out, err = submit(capsys, tmp_path, ep, "--fresh")
    assert code == 0, err
    assert f"--fresh: deleted 2 checkpoint(s) (steps 2, 4) from {ckpt}" in out
    assert f"job {name} resumes" not in out
    assert sorted(p.name for p in ckpt.iterdir()) == [
        "fence.json",
        "lock",
        "notes.txt",
        "owner.json",
    ]
    assert (ckpt / "notes.txt").read_text() == "mine"
    status = json.loads(_status(capsys, name, ep))
    assert status["state"] == "pending"


def _status(capsys, name: str, ep: str) -> str:
    assert main(["status", name, "--json", "--etcd", ep]) == 0
    return capsys.readouterr().out


def test_fresh_refuses_another_jobs_directory_and_one_in_use_deleting_nothing(
    etcd_server, tmp_path, capsys
):
    name = f"fresh-{uuid.uuid4().hex[:8]}"
    job_file(tmp_path, name)
    ckpt = tmp_path / "out" / "ckpt"
    checkpoints(ckpt, "someone-else", [1])
    code, _, err = submit(capsys, tmp_path, etcd_server.endpoint, "--fresh")
    assert code == 2 and err.count("\n") == 1, err
    assert (
        f"belongs to job 'someone-else' (its newest manifest), not '{name}': nothing deleted" in err
    )
    assert committed_steps(str(ckpt)) == [1]

    mine = tmp_path / "mine"
    mine.mkdir()
    job_file(mine, name)
    ckpt = mine / "out" / "ckpt"
    checkpoints(ckpt, name, [3])
    held = claim(str(ckpt), job=name, run_id=f"{name}-9")
    try:
        code, _, err = submit(capsys, mine, etcd_server.endpoint, "--fresh")
    finally:
        held.release()
    assert code == 2 and err.count("\n") == 1 and f"in use by run {name}-9" in err, err
    assert committed_steps(str(ckpt)) == [3]


def test_start_over_does_not_put_back_a_step_moved_aside_to_be_replaced(tmp_path):
    from checkpoint.store import start_over

    ckpt = tmp_path / "ckpt"
    checkpoints(ckpt, "tiny", [2, 4])
    # A writer died between moving step 4 aside and renaming its own save into place.
    (ckpt / "step-000000004").rename(ckpt / "step-000000004.0a0b0c0d.replaced.tmp")
    assert start_over(str(ckpt), job="tiny") == [2]
    # latest and the moved-aside step 4 too; the lock start_over held while deleting stays
    assert [p.name for p in ckpt.iterdir()] == ["lock"]
