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

import pytest
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


@pytest.mark.parametrize("defect", ["float-step", "version-0", "complex-dtype"])
def test_a_plant_with_its_files_and_one_defect_a_load_refuses_is_never_kept(tmp_path, defect):
    """A plant with copies of step 4's files, claiming the newest commit, whose
    re-checksummed manifest has one defect every load refuses (a step of ``1.0``, format
    version 0, a dtype of ``complex64``): its files were there, so `ckpt prune --keep 1`
    kept it and deleted steps 4 and 2, and a save's retention did the same. A step to
    keep must open as a load opens it (``Manifest.from_json``)."""
    ckpt = str(tmp_path / "ckpt")
    save(ckpt, 2, 4)
    plant(ckpt, 1, like=4, commit=1000)
    for name in os.listdir(step_path(ckpt, 4)):
        if name.endswith(".safetensors"):
            shutil.copy(os.path.join(step_path(ckpt, 4), name), step_path(ckpt, 1))
    path = os.path.join(step_path(ckpt, 1), "manifest.json")
    with open(path) as fh:
        raw = json.load(fh)
    if defect == "float-step":
        raw["step"] = 1.0
    elif defect == "version-0":
        raw["version"] = 0
    else:
        raw["tensors"]["w"]["dtype"] = "complex64"
    raw.pop("checksum")
    canon = json.dumps(raw, sort_keys=True, separators=(",", ":"))
    raw["checksum"] = hashlib.sha256(canon.encode()).hexdigest()
    with open(path, "w") as fh:
        json.dump(raw, fh)
    assert cli("ckpt", "verify", "--step", "1", ckpt).returncode == 2  # it does not open
    done = cli("ckpt", "prune", "--keep", "1", ckpt)
    assert done.returncode == 0, done.stderr
    assert 4 in committed_steps(ckpt), (committed_steps(ckpt), done.stdout)
    save(ckpt, 6, keep=2)
    assert {4, 6} <= set(committed_steps(ckpt)), committed_steps(ckpt)


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


def test_a_step_recorded_unloadable_that_a_load_passes_over_is_named(tmp_path):
    """A stale or planted ``unloadable.json`` naming the newest, sound step: a resume took
    the step before it without a word about the newer one it never tried. It is named now
    (the record's steps are tried last, after every other)."""
    from checkpoint import load_latest

    ckpt = str(tmp_path / "ckpt")
    save(ckpt, 2, 4)
    with open(os.path.join(ckpt, "unloadable.json"), "w") as fh:
        json.dump({"4": {"commit": 2, "error": "planted"}}, fh)
    out = torch.zeros(64)
    said: list[str] = []
    loaded = load_latest(ckpt, model={"w": (out, ShardInfo.whole("w", (64,)))}, warn=said.append)
    loaded.close()
    assert loaded.step == 2 and torch.equal(out, W + 2)
    assert len(said) == 1 and "step 4, newer than the step loaded (2), was passed over" in said[0]
    assert "unloadable.json records that it failed to load before" in said[0], said


def test_hard_links_of_one_manifest_are_parsed_once_by_ls_and_verify(tmp_path, monkeypatch, capsys):
    """Ten zero-cost hard links of step 4's manifest under steps 5 to 14: `ckpt ls` and
    `ckpt verify` parsed the manifest once per link (30 links of a 63 MB one took each
    past a minute). Now once per file, and each link names the step it belongs to."""
    from checkpoint.manifest import Manifest
    from elasticd.cli import main

    ckpt = str(tmp_path / "ckpt")
    save(ckpt, 2, 4)
    real = os.path.join(step_path(ckpt, 4), "manifest.json")
    for step in range(5, 15):
        os.makedirs(step_path(ckpt, step))
        os.link(real, os.path.join(step_path(ckpt, step), "manifest.json"))
    parses: list[str] = []
    original = Manifest.from_json.__func__

    def counted(cls, data, **kw):
        parses.append(kw.get("where", ""))
        return original(cls, data, **kw)

    monkeypatch.setattr(Manifest, "from_json", classmethod(counted))
    assert main(["ckpt", "ls", ckpt]) == 0
    out = capsys.readouterr().out
    assert out.count("is a hard link to the manifest of step 4") == 10, out
    assert len(parses) <= 4, parses  # step 2, the links' file once, step 4 opened
    parses.clear()
    assert main(["ckpt", "verify", ckpt]) == 2
    err = capsys.readouterr().err
    assert "10 problems found" in err and "is a hard link to the manifest of step 4" in err, err
    assert len(parses) <= 4, parses
