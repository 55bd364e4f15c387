"""Steps that are not what their manifest says: a planted step claiming the newest commit
with a correctly re-sealed manifest, and a ``manifest.json`` that is not a regular file.
Real files, the real CLI (a security review reproduced both)."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys

import torch

from checkpoint import SaveOptions, Saver, ShardInfo
from checkpoint.store import committed_steps, load_order, step_path

W = torch.arange(64, dtype=torch.float32)


def save(ckpt: str, *steps: int, keep: int = 10) -> None:
    saver = Saver(ckpt, group=None, options=SaveOptions(async_=False, keep=keep))
    for step in steps:
        saver.save(
            step=step, consumed_samples=step, model={"w": (W + step, ShardInfo.whole("w", (64,)))}
        )
    saver.close()


def cli(*argv: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "elasticd", *argv], capture_output=True,
                          text=True, timeout=120)  # fmt: skip


def plant(ckpt: str, step: int, *, like: int, commit: int) -> None:
    """``step-<step>``: the manifest of step ``like`` claiming ``step`` and commit number
    ``commit``, re-sealed as anyone can (its sha256 is unkeyed), and no tensor file."""
    os.makedirs(step_path(ckpt, step))
    with open(os.path.join(step_path(ckpt, like), "manifest.json")) as fh:
        raw = json.load(fh)
    raw.update(step=step, commit=commit)
    raw.pop("checksum")
    canon = json.dumps(raw, sort_keys=True, separators=(",", ":"))
    raw["checksum"] = hashlib.sha256(canon.encode()).hexdigest()
    with open(os.path.join(step_path(ckpt, step), "manifest.json"), "w") as fh:
        json.dump(raw, fh)


def test_a_planted_step_claiming_the_newest_commit_makes_retention_delete_no_good_step(tmp_path):
    """It headed the lineage, so every step that loads was "abandoned": `ckpt prune
    --keep 1` deleted steps 4 and 2 and kept the plant, and a trainer's own retention at
    its next save did the same. A step to keep must open now; the plant is kept for
    nothing and deleted by nobody (a load that fails on it records it)."""
    ckpt = str(tmp_path / "ckpt")
    save(ckpt, 2, 4)
    plant(ckpt, 1, like=2, commit=1000)
    assert load_order(ckpt)[0] == 1  # the plant claims the newest commit
    assert cli("ckpt", "verify", ckpt).returncode == 2  # and does not open
    done = cli("ckpt", "prune", "--keep", "1", ckpt)
    assert done.returncode == 0, done.stderr
    assert committed_steps(ckpt) == [1, 4], (committed_steps(ckpt), done.stdout)
    # A trainer's retention after its next commit: the same rule (the plant would be the
    # second step kept, and step 4 "abandoned").
    save(ckpt, 6, keep=2)
    assert committed_steps(ckpt) == [1, 4, 6]


def test_a_manifest_that_is_not_a_regular_file_is_a_damaged_commit_not_no_commit(tmp_path):
    """A FIFO or a directory named manifest.json hid its step: `verify` passed on the step
    before it, and with no other step a resume trained from step 1 in silence. It is a
    commit that does not open: named by verify, fallen back from by a load."""
    for kind in ("fifo", "dir"):
        ckpt = str(tmp_path / kind)
        save(ckpt, 2, 4)
        where = os.path.join(step_path(ckpt, 4), "manifest.json")
        os.unlink(where)
        os.mkfifo(where) if kind == "fifo" else os.mkdir(where)
        assert committed_steps(ckpt) == [2, 4]
        out = cli("ckpt", "verify", ckpt)
        assert out.returncode == 2 and "step-000000004" in out.stderr, (kind, out.stderr)
        assert out.stderr.count("\n") == 1, out.stderr
        shutil.rmtree(step_path(ckpt, 2))
        out = cli("ckpt", "verify", ckpt)
        assert out.returncode == 2 and "no committed checkpoint" not in out.stderr, out.stderr


def test_an_io_error_while_looking_at_a_step_to_keep_deletes_nothing(tmp_path, monkeypatch):
    """A stat that fails for a passing reason (EIO, ESTALE, EMFILE) is no verdict on the
    step: were it taken for a bad one, the lineage would be judged without it and its
    predecessor deleted (the diff review: steps 10 and 20 deleted for a glitch on 25). The
    error is injected into os.stat for that step's files alone."""
    import errno

    from checkpoint.store import prune

    ckpt = str(tmp_path / "ckpt")
    save(ckpt, 10, 20, 30)
    real_stat = os.stat
    glitch = step_path(ckpt, 30)

    def stat(path, *args, **kwargs):
        if str(path).startswith(glitch + os.sep) and str(path).endswith(".safetensors"):
            raise OSError(errno.EIO, "Input/output error")
        return real_stat(path, *args, **kwargs)

    monkeypatch.setattr(os, "stat", stat)
    assert prune(ckpt, keep=1) == []
    monkeypatch.setattr(os, "stat", real_stat)
    assert sorted(prune(ckpt, keep=1)) == [10, 20]
    assert committed_steps(ckpt) == [30]
