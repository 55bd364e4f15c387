"""A disk that refuses the checkpoint's writes: every rank says why in one line, no rank is
left waiting in a collective, and nothing committed is lost.

Real failures, no patched calls: a file-size limit (``RLIMIT_FSIZE``: writes past it fail
with EFBIG, as with a full disk; Python ignores the SIGXFSZ that comes with it) and a
checkpoint directory that has become a file.
"""

from __future__ import annotations

import json
import os
import resource
import shutil
import subprocess
import sys
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from checkpoint import CheckpointError, SaveFailedError, SaveOptions, Saver, ShardInfo
from checkpoint.store import PROBE_PREFIX, committed_steps

REPO = Path(__file__).resolve().parents[1]
TINY = REPO / "examples" / "tiny.yaml"


def _limited(max_bytes: int):
    def apply() -> None:
        resource.setrlimit(resource.RLIMIT_FSIZE, (max_bytes, max_bytes))

    return apply


def trainer(tmp_path: Path, steps: int, max_bytes: int | None = None):
    env = dict(os.environ, OMP_NUM_THREADS="1")
    args = [sys.executable, "-m", "trainer", str(TINY), "--set", f"output_dir={tmp_path / 'out'}",
            "--set", f"train.steps={steps}"]  # fmt: skip
    return subprocess.run(args, env=env, capture_output=True, text=True, timeout=180, cwd=tmp_path,
                          preexec_fn=_limited(max_bytes) if max_bytes else None)  # fmt: skip


def test_a_save_the_disk_refuses_is_one_line_and_the_committed_step_stays(tmp_path):
    first = trainer(tmp_path, steps=10)
    assert first.returncode == 0, first.stderr[-2000:]
    ckpt = tmp_path / "out" / "ckpt"
    assert committed_steps(str(ckpt)) == [10]
    # The tiny model's checkpoint file is about 1.4 MB: a 256 KiB limit refuses the next.
    full = trainer(tmp_path, steps=20, max_bytes=256 * 1024)
    assert full.returncode == 74, full.stderr[-2000:]
    assert "Traceback" not in full.stderr
    err = full.stderr.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("trainer: error: checkpoint step 20 was not "), err
    assert "File too large" in err[0]
    assert committed_steps(str(ckpt)) == [10]
    assert [n for n in os.listdir(ckpt) if n.endswith(".tmp")] == []  # its own leftovers gone
    again = trainer(tmp_path, steps=20)  # room again: it resumes from the step committed
    assert again.returncode == 0, again.stderr[-2000:]
    assert "resumed from" in again.stdout and "at step 10" in again.stdout


def test_a_probe_the_disk_refuses_leaves_no_file_behind(tmp_path):
    code = (
        "import resource; resource.setrlimit(resource.RLIMIT_FSIZE, (0, 0))\n"
        "from checkpoint.store import write_probe\n"
        f"write_probe({str(tmp_path)!r})\n"
    )
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=60, cwd=REPO)  # fmt: skip
    assert run.returncode != 0 and "File too large" in run.stderr
    assert [n for n in os.listdir(tmp_path) if n.startswith(PROBE_PREFIX)] == []


def _worker(rank: int, store: str, root: str) -> None:
    from checkpoint.shared import blind_ranks

    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2,
                            timeout=timedelta(seconds=60))  # fmt: skip
    ckpt = os.path.join(root, "ckpt")
    saver = Saver(ckpt, group=None, options=SaveOptions(async_=False, job="tiny"))
    info = ShardInfo.split("w", (8, 4), 0, rank, 2)
    model = {"w": (torch.full(info.sizes, float(rank)), info)}
    saver.save(step=1, consumed_samples=1, model=model)
    dist.barrier()
    if rank == 0:  # the directory is gone from under the job: a file stands there now
        shutil.rmtree(ckpt)
        Path(ckpt).write_text("not a directory")
    dist.barrier()
    said = {}
    try:
        saver.save(step=2, consumed_samples=2, model=model)
    except SaveFailedError as exc:
        said["save"] = str(exc)
    try:
        blind_ranks(ckpt, None)
    except CheckpointError as exc:
        said["probe"] = str(exc)
    Path(root, f"said.{rank}").write_text(json.dumps(said))
    saver.abandon()
    dist.destroy_process_group()


def test_when_rank_0_cannot_write_every_rank_says_why_rather_than_wait(tmp_path):
    mp.start_processes(_worker, args=(str(tmp_path / "store"), str(tmp_path)), nprocs=2,
                       start_method="spawn")  # fmt: skip
    said = [json.loads((tmp_path / f"said.{r}").read_text()) for r in range(2)]
    assert said[0] == said[1], said  # the same words on every rank, from rank 0
    assert said[0]["save"].startswith("checkpoint step 2 was not saved: "), said
    assert said[0]["probe"].startswith("cannot write a probe file into "), said


def test_an_export_the_disk_refuses_is_one_line_and_leaves_no_partial_model(tmp_path):
    """safetensors raises its own SafetensorError for a write that fails ("No space left
    on device"; here "File too large"), not OSError: `ckpt export` ended in a traceback and
    left a partial model.safetensors behind. A directory of the user's keeps its files."""
    first = trainer(tmp_path, steps=2)
    assert first.returncode == 0, first.stderr[-2000:]
    ckpt = tmp_path / "out" / "ckpt"
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "notes").write_text("the user's")
    env = dict(os.environ, OMP_NUM_THREADS="1")
    for fmt in ("raw", "hf"):
        for out in (tmp_path / f"new-{fmt}", mine):
            # The tiny model's weights are about 0.5 MB: a 256 KiB limit refuses them.
            p = subprocess.run(
                [sys.executable, "-m", "elasticd", "ckpt", "export", str(ckpt), str(out),
                 "--format", fmt],
                env=env, capture_output=True, text=True, timeout=180, cwd=REPO,
                preexec_fn=_limited(256 * 1024),
            )  # fmt: skip
            err = p.stderr.strip().splitlines()
            assert p.returncode == 2 and len(err) == 1, (fmt, p.stderr[-2000:])
            assert "Traceback" not in p.stderr
            assert f"{out / 'model.safetensors'}: cannot write: " in err[0], err
            assert "File too large" in err[0], err
    assert not (tmp_path / "new-raw").exists() and not (tmp_path / "new-hf").exists()
    assert os.listdir(mine) == ["notes"]


def test_a_failed_export_over_an_earlier_one_leaves_the_earlier_one_whole(tmp_path):
    """The clean-up of a failed export deleted what it was about to overwrite: an earlier
    export's model.safetensors (which safetensors' own failed write had left intact) was
    gone, and the directory held a config.json and no weights. Files are now written
    under temporary names and renamed into place once all are written, readable by
    others as the umask allows (safetensors makes them 0600)."""
    first = trainer(tmp_path, steps=2)
    assert first.returncode == 0, first.stderr[-2000:]
    ckpt = tmp_path / "out" / "ckpt"
    env = dict(os.environ, OMP_NUM_THREADS="1")
    for fmt in ("raw", "hf"):
        out = tmp_path / f"export-{fmt}"

        def export(limit=None, out=out, fmt=fmt):
            return subprocess.run(
                [sys.executable, "-m", "elasticd", "ckpt", "export", str(ckpt), str(out),
                 "--format", fmt],
                env=env, capture_output=True, text=True, timeout=180, cwd=REPO,
                preexec_fn=_limited(limit) if limit else lambda: os.umask(0o022),
            )  # fmt: skip

        assert export().returncode == 0
        before = {n: (out / n).read_bytes() for n in os.listdir(out)}
        assert "model.safetensors" in before
        assert oct((out / "model.safetensors").stat().st_mode & 0o777) == oct(0o644)
        failed = export(256 * 1024)
        assert failed.returncode == 2 and "cannot write" in failed.stderr, failed.stderr[-2000:]
        assert {n: (out / n).read_bytes() for n in os.listdir(out)} == before


def test_an_export_killed_before_its_renames_leaves_nothing_the_next_one_keeps(tmp_path):
    """Its temporary files are hidden (.NAME.partial-PID); the next export into the
    directory removes those of a process that is gone, and no others."""
    from checkpoint.verify import export_dir

    out = tmp_path / "out"
    out.mkdir()
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True, check=True).stdout.strip()  # fmt: skip
    live = subprocess.Popen(["sleep", "60"])  # an export still running elsewhere
    try:
        (out / f".model.safetensors.partial-{dead}").write_bytes(b"half")
        (out / f".model.safetensors.partial-{live.pid}").write_bytes(b"writing")
        (out / f".notes.partial-{dead}").write_text("not an export's")
        with export_dir(str(out), ["model.safetensors"]) as files:
            Path(files.path("model.safetensors")).write_bytes(b"whole")
        assert sorted(os.listdir(out)) == sorted([
            f".model.safetensors.partial-{live.pid}", f".notes.partial-{dead}",
            "model.safetensors",
        ])  # fmt: skip
        assert (out / "model.safetensors").read_bytes() == b"whole"
    finally:
        live.kill()
        live.wait()
