"""Hostile small files of a checkpoint directory: a symlink planted at a temporary file's
name, a FIFO, a symlink to /dev/zero or deeply nested JSON as ``owner.json``,
``fence.json`` or ``latest``, and a step directory that is a symlink to another job's step.

Each is refused in one line, ignored where the format says the file is only a hint, and
never written through, followed, hung on or read without bound
(docs/checkpoint-format.md, "Hostile checkpoints"). The attacks that could hang or eat
memory run in a subprocess under a timeout and an address-space limit.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from checkpoint import CheckpointError, SaveOptions, Saver, ShardInfo, load_latest
from checkpoint.owner import claim
from checkpoint.store import (
    UNLOADABLE,
    committed_steps,
    mark_unloadable,
    recover_replaced,
    step_path,
    write_latest,
)
from elasticd.agent import launch
from elasticd.cli import main

REPO = Path(__file__).resolve().parents[1]
W = torch.arange(64 * 16, dtype=torch.float32).reshape(64, 16)
PRECIOUS = "precious user data\n"


def save(ckpt: str, *, step: int = 3, scale: float = 1.0) -> str:
    saver = Saver(ckpt, group=None, options=SaveOptions(async_=False, chunk_min_bytes=1024))
    saver.save(
        step=step,
        consumed_samples=12,
        model={"w": (W * scale, ShardInfo.whole("w", (64, 16)))},
        optimizer={"exp_avg/w": (W * 0, ShardInfo.whole("w", (64, 16)))},
    )
    saver.close()
    return ckpt


def model() -> dict:
    return {"w": (torch.zeros(64, 16), ShardInfo.whole("w", (64, 16)))}


def victim(tmp_path: Path, name: str) -> Path:
    """A file of the user's outside the checkpoint directory."""
    path = tmp_path / name
    path.write_text(PRECIOUS)
    return path


def test_no_writer_follows_a_symlink_planted_at_a_temporary_files_name(tmp_path):
    ckpt = save(str(tmp_path / "ckpt"))
    # The names the writers used to create with O_TRUNC (and follow): unloadable.json.tmp and
    # latest.tmp (the store), owner.json.<pid>.writing (the owner record) and
    # fence.json.agent.<pid>.writing (the agent's fence).
    planted = {
        "unloadable.json.tmp": victim(tmp_path, "a.txt"),
        "latest.tmp": victim(tmp_path, "b.txt"),
        f"owner.json.{os.getpid()}.writing": victim(tmp_path, "c.txt"),
        f"fence.json.agent.{os.getpid()}.writing": victim(tmp_path, "d.txt"),
    }
    for name, target in planted.items():
        os.symlink(target, os.path.join(ckpt, name))
    # A damaged step: the load falls back from it and records it in unloadable.json.
    data = next(Path(step_path(ckpt, 3)).glob("*.safetensors"))
    os.truncate(data, 0)
    with pytest.raises(CheckpointError):
        load_latest(ckpt, model=model())
    write_latest(ckpt, 3)
    claim(ckpt, job="tiny", run_id="tiny-1").release()
    launch.write_fence(ckpt, run_id="tiny-0a1b2c3d", round_=1)
    for target in planted.values():
        assert target.read_text() == PRECIOUS, target
    assert "3" in json.loads(Path(ckpt, UNLOADABLE).read_text())
    assert Path(ckpt, "latest").read_text() == "step-000000003\n"
    assert json.loads(Path(ckpt, "owner.json").read_text())["job"] == "tiny"
    assert json.loads(Path(ckpt, "fence.json").read_text()) == {
        "run_id": "tiny-0a1b2c3d",
        "round": 1,
    }
    for name in ("latest", UNLOADABLE, "owner.json", "fence.json"):
        assert not os.path.islink(os.path.join(ckpt, name))
    # Each writer's own temporary is gone; only the planted links are left.
    extra = {n for n in os.listdir(ckpt) if n.endswith((".tmp", ".writing"))}
    assert extra == set(planted)
    mark_unloadable(ckpt, 3, "again")
    assert all(t.read_text() == PRECIOUS for t in planted.values())


def plant(path: str, kind: str) -> None:
    if kind == "fifo":
        os.mkfifo(path)  # an open for reading blocks until a writer comes
    elif kind == "dev-zero":
        os.symlink("/dev/zero", path)  # an unbounded read never ends
    else:
        Path(path).write_text("[" * 100_000)  # json's recursion limit


def run_py(code: str, *, timeout: float = 60) -> subprocess.CompletedProcess:
    """``code`` in a fresh interpreter, under ``timeout`` and a 4 GiB address-space limit
    (an endless read fails there instead of eating the machine's memory)."""
    import resource

    def limit() -> None:
        resource.setrlimit(resource.RLIMIT_AS, (4 << 30, 4 << 30))

    env = dict(os.environ, OMP_NUM_THREADS="1")
    try:
        return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                              timeout=timeout, cwd=REPO, env=env, preexec_fn=limit)  # fmt: skip
    except subprocess.TimeoutExpired:
        pytest.fail(f"hung for {timeout} s: {code}")


def one_line(p: subprocess.CompletedProcess) -> str:
    assert "Traceback" not in p.stderr, p.stderr[-3000:]
    lines = p.stdout.strip().splitlines()
    assert len(lines) == 1, p.stdout + p.stderr[-3000:]
    return lines[0]


KINDS = ["fifo", "dev-zero", "deep"]


@pytest.mark.parametrize("kind", KINDS)
def test_a_hostile_owner_record_is_refused_in_one_line_without_hanging(tmp_path, kind):
    ckpt = save(str(tmp_path / "ckpt"))
    plant(os.path.join(ckpt, "owner.json"), kind)
    for call in (
        f"claim({ckpt!r}, job='tiny', run_id='tiny-1')",  # a resume
        f"start_over({ckpt!r}, job='tiny')",  # elasticd submit --fresh
    ):
        p = run_py(
            "from checkpoint.errors import OwnershipError\n"
            "from checkpoint.owner import claim\n"
            "from checkpoint.store import start_over\n"
            f"try:\n    {call}\n    print('accepted')\n"
            "except OwnershipError as exc:\n    print('refused', exc)\n"
        )
        line = one_line(p)
        assert line.startswith("refused ") and "owner.json" in line, (call, line)
    assert committed_steps(ckpt) == [3]  # nothing deleted


@pytest.mark.parametrize("kind", KINDS)
def test_a_hostile_fence_fails_closed_and_the_agent_replaces_it_without_hanging(tmp_path, kind):
    ckpt = save(str(tmp_path / "ckpt"))
    plant(os.path.join(ckpt, "fence.json"), kind)
    p = run_py(
        "from checkpoint.errors import FencedError\n"
        "from checkpoint.fence import Fence, check_fence\n"
        "try:\n"
        f"    check_fence({ckpt!r}, Fence(run_id='tiny-0a1b2c3d', round=1))\n"
        "    print('allowed')\n"
        "except FencedError as exc:\n    print('refused', exc)\n"
    )
    line = one_line(p)
    assert line.startswith("refused ") and "fence.json" in line, line
    # The agent's writer, before it spawns a round's workers: an unreadable fence is replaced.
    p = run_py(
        "from elasticd.agent.launch import write_fence\n"
        f"write_fence({ckpt!r}, run_id='tiny-0a1b2c3d', round_=1)\nprint('written')\n"
    )
    assert one_line(p) == "written"
    fence = Path(ckpt, "fence.json")
    assert not fence.is_symlink() and json.loads(fence.read_text())["round"] == 1


@pytest.mark.parametrize("constant", ["NaN", "Infinity", "-Infinity"])
def test_a_small_file_holding_nan_or_infinity_is_not_json(constant):
    """Python's parser takes them; JSON has no such value (a fence's, an owner record's)."""
    from checkpoint.smallfile import parse_json

    data = f'{{"run_id": "tiny-0a1b2c3d", "round": 1, "x": {constant}}}'.encode()
    with pytest.raises(CheckpointError, match=f"fence.json: not a fence .{constant} is not"):
        parse_json(data, where="fence.json", what="a fence")


@pytest.mark.parametrize("kind", KINDS)
def test_a_hostile_latest_pointer_is_ignored_by_ls_and_a_load_without_hanging(tmp_path, kind):
    ckpt = save(str(tmp_path / "ckpt"))
    os.unlink(os.path.join(ckpt, "latest"))
    plant(os.path.join(ckpt, "latest"), kind)
    p = run_py(
        "import sys\nfrom elasticd.cli import main\n"
        f"code = main(['ckpt', 'ls', {ckpt!r}])\n"
        "sys.stdout.flush()\nprint('exit', code, file=sys.stderr)\n"
    )
    assert "Traceback" not in p.stderr and p.stderr.strip().endswith("exit 0"), p.stderr[-3000:]
    rows = [line.split() for line in p.stdout.splitlines()[1:]]
    assert [row[0] for row in rows] == ["3"], p.stdout
    got = model()
    load_latest(ckpt, model=got)  # `latest` is only a hint: the load goes by commit order
    assert torch.equal(got["w"][0], W)


def test_a_step_directory_that_is_a_symlink_is_skipped_by_a_load_and_refused_by_the_cli(
    tmp_path, capsys
):
    ckpt = save(str(tmp_path / "ckpt"))
    theirs = save(str(tmp_path / "another-job"), step=3, scale=-1.0)
    link = step_path(ckpt, 9)
    os.symlink(step_path(theirs, 3), link)
    assert committed_steps(ckpt) == [3]
    got = model()
    ck = load_latest(ckpt, model=got)
    assert ck.step == 3 and torch.equal(got["w"][0], W)  # ours, not the other job's
    for argv in (
        ["verify", link],
        ["inspect", link],
        ["verify", ckpt, "--step", "9"],
        ["export", link, str(tmp_path / "out")],
    ):
        code = main(["ckpt", *argv])
        err = capsys.readouterr().err.strip().splitlines()
        assert code == 2 and len(err) == 1 and "a symlink, not a step directory" in err[0], (
            argv,
            err,
        )
    assert not (tmp_path / "out").exists()
    assert main(["ckpt", "verify", ckpt]) == 0  # the directory's own step is fine
    capsys.readouterr()
    # A symlink planted under the name of a step moved aside is never put back as a step.
    aside = os.path.join(ckpt, "step-000000005.0a1b2c3d.replaced.tmp")
    os.symlink(step_path(theirs, 3), aside)
    assert recover_replaced(ckpt) == []
    assert not os.path.lexists(step_path(ckpt, 5)) and os.path.islink(aside)
    assert os.path.isdir(step_path(theirs, 3))


@pytest.mark.parametrize("swap", ["symlink", "directory"])
def test_a_step_directory_swapped_after_it_was_opened_is_not_what_is_read(tmp_path, swap):
    """The swap race: the step directory passed the checks when it was opened, then its
    name was pointed at another checkpoint before the tensor files were opened. What is
    read and verified is still the directory that was opened."""
    from checkpoint import Checkpoint, verify

    ckpt = save(str(tmp_path / "ckpt"))
    theirs = save(str(tmp_path / "another-job"), step=3, scale=-1.0)
    step = step_path(ckpt, 3)
    opened = Checkpoint.open(step)
    os.rename(step, str(tmp_path / "moved-away"))
    if swap == "symlink":
        os.symlink(step_path(theirs, 3), step)
    else:
        os.rename(step_path(theirs, 3), step)
    assert torch.equal(opened.read("w"), W)  # ours, not what the name now points at
    got = model()
    opened.load_into(got)
    assert torch.equal(got["w"][0], W)
    assert verify(opened) == []
    opened.close()


def save_big(ckpt: Path) -> Path:
    """Step 3 of three 4 MiB tensors in one file: several pieces to read, so a file can be
    cut short between two of them."""
    saver = Saver(str(ckpt), group=None, options=SaveOptions(async_=False, chunk_min_bytes=1024))
    big = torch.arange(1 << 20, dtype=torch.float32).reshape(1024, 1024)
    saver.save(step=3, consumed_samples=12, model={
        n: (big + i, ShardInfo.whole(n, (1024, 1024))) for i, n in enumerate("abc")
    })  # fmt: skip
    saver.close()
    return ckpt


def test_verify_of_a_file_truncated_while_it_is_read_reports_it_and_does_not_die(tmp_path):
    """A tensor file truncated by someone else while `verify` reads it: a problem named
    in one line, not a SIGBUS (a memory map of the file would raise one)."""
    ckpt = save_big(tmp_path / "ckpt")
    code = f"""
import os, sys
import checkpoint.verify
from checkpoint import Checkpoint
v = sys.modules["checkpoint.verify"]  # the package's `verify` is the function
real = v.block_checksums
cut = []
def truncating(buf, block, crc):
    if not cut:  # the first piece is read: now the file shrinks under the reader
        for f in sorted(os.listdir(ck.path)):
            if f.endswith(".safetensors"):
                os.truncate(os.path.join(ck.path, f), 4096)
                cut.append(f)
    return real(buf, block, crc)
v.block_checksums = truncating
ck = Checkpoint.open({str(step_path(str(ckpt), 3))!r})
problems = v.verify(ck)
print(len(cut), "|".join(problems))
"""
    p = run_py(code)
    assert p.returncode == 0, (p.returncode, p.stderr[-3000:])  # -7: SIGBUS
    cut, problems = one_line(p).split(" ", 1)
    assert cut == "1" and "truncated" in problems, p.stdout


def test_verify_names_several_problems_in_one_line(tmp_path, capsys):
    ckpt = tmp_path / "ckpt"
    saver = Saver(str(ckpt), group=None, options=SaveOptions(async_=False, chunk_min_bytes=1024))
    saver.save(step=3, consumed_samples=12, model={
        n: (W + i, ShardInfo.whole(n, (64, 16))) for i, n in enumerate("abcde")
    })  # fmt: skip
    saver.close()
    step = step_path(str(ckpt), 3)
    files = sorted(f for f in os.listdir(step) if f.endswith(".safetensors"))
    with open(os.path.join(step, files[0]), "r+b") as f:
        size = f.seek(0, 2)
        for at in range(size - 4 * 1024, size, 1024):  # 4 chunks' last bytes flipped
            f.seek(at)
            f.write(b"\xff")
    code = main(["ckpt", "verify", str(ckpt)])
    out = capsys.readouterr()
    err = out.err.strip().splitlines()
    assert code == 2 and len(err) == 1, out
    assert "4 problems found" in err[0] and "checksum mismatch" in err[0], err
    assert "(and 1 more)" in err[0], err


def test_closing_a_checkpoint_closes_its_directory_and_a_later_read_is_one_error(tmp_path):
    from checkpoint import Checkpoint, CheckpointReadError

    ckpt = save(str(tmp_path / "ckpt"))
    opened = Checkpoint.open(step_path(ckpt, 3))
    fd = opened.dir_fd
    assert torch.equal(opened.read("w"), W)
    opened.close()
    with pytest.raises(OSError):
        os.fstat(fd)  # closed now, not when the object is collected
    # Not the step's content: a load would stop on it, never mark the step unloadable.
    with pytest.raises(CheckpointReadError, match="cannot open: Bad file descriptor"):
        opened.read("w")
    opened.close()  # twice is fine


@pytest.mark.parametrize("verified", [True, False])
def test_a_load_of_a_file_truncated_while_it_is_read_is_one_error_not_a_sigbus(tmp_path, verified):
    """A load (verified or not) reads with pread, never through a memory map: a tensor
    file truncated between two of its reads fails the load with a 'truncated' error."""
    ckpt = save_big(tmp_path / "ckpt")
    code = f"""
import os, sys, torch
import checkpoint.load as load
from checkpoint import Checkpoint, CorruptCheckpointError, ShardInfo
real = load._read_parts
cut = []
def truncating(parts, view):
    real(parts, view)
    if not cut:  # the first piece is in: now the file shrinks under the reader
        path = parts[0].f.path
        os.truncate(path, 4096)
        cut.append(path)
load._read_parts = truncating
ck = Checkpoint.open({str(step_path(str(ckpt), 3))!r})
want = {{n: (torch.zeros(1024, 1024), ShardInfo.whole(n, (1024, 1024))) for n in "abc"}}
try:
    ck.load_into(want, verify={verified})
    print(len(cut), "loaded")
except CorruptCheckpointError as exc:
    print(len(cut), exc)
"""
    p = run_py(code)
    assert p.returncode == 0, (p.returncode, p.stderr[-3000:])  # -7: SIGBUS
    cut, message = one_line(p).split(" ", 1)
    assert cut == "1" and "truncated" in message, p.stdout


@pytest.mark.parametrize(
    "manifest", [b"", b'{"step": 6', b"{}"], ids=["empty", "torn", "no-checksum"]
)
def test_a_newer_step_without_a_valid_manifest_is_named_when_an_older_one_loads(tmp_path, manifest):
    """A step directory whose manifest is empty, torn or fails its checksum counts as
    commit 0 and is ordered below every committed step, so a resume took step 3 and never
    said that step 6 was there (its work lost without a word; only `ckpt verify` named
    it). The load now says so, once, and still loads step 3."""
    from checkpoint import load_latest
    from checkpoint.store import step_path

    ckpt = str(tmp_path / "ckpt")
    save(ckpt, step=3)
    save(ckpt, step=6, scale=2.0)
    Path(step_path(ckpt, 6), "manifest.json").write_bytes(manifest)
    said: list[str] = []
    out = model()
    with load_latest(ckpt, model=out, warn=said.append) as ck:
        assert ck.manifest.step == 3
    assert torch.equal(out["w"][0], W)
    (line,) = said
    assert "step 6, newer than the step loaded (3), has no valid manifest" in line, said
    said.clear()
    save(ckpt, step=9, scale=3.0)  # a newer commit: step 6 is no longer newer than the load
    with load_latest(ckpt, model=model(), warn=said.append) as ck:
        assert ck.manifest.step == 9
    assert said == [], said


@pytest.mark.parametrize("stored", [torch.float16, torch.bool, torch.float64])
def test_a_tensor_stored_in_another_dtype_is_refused_not_cast(tmp_path, stored):
    """A manifest and header that store ``w`` (float32 in the model) as float16 or bool,
    as a hostile re-sealed step can: the load cast it into the model without a word (bool:
    every weight 1.0; float16: rounded, and the trainer's loss moved). Now it is refused,
    naming both dtypes."""
    ckpt = str(tmp_path / "ckpt")
    saver = Saver(ckpt, group=None, options=SaveOptions(async_=False, chunk_min_bytes=1024))
    saver.save(step=3, consumed_samples=12,
               model={"w": ((W * 1.7).to(stored), ShardInfo.whole("w", (64, 16)))})  # fmt: skip
    saver.close()
    out = torch.full((64, 16), -7.0)
    with pytest.raises(CheckpointError) as info:
        load_latest(ckpt, model={"w": (out, ShardInfo.whole("w", (64, 16)))})
    name = str(stored).removeprefix("torch.")
    assert f"w: the model wants dtype float32, the checkpoint has {name}" in str(info.value)
    assert bool((out == -7.0).all()), "nothing written into the model"


def test_a_lock_file_hard_linked_to_another_file_is_refused_and_the_file_left_alone(tmp_path):
    """``<ckpt>/lock`` is written in place (the holder's record): a hard link planted there
    to a file the user can write had that file truncated and overwritten by a claim, a
    prune or ``submit --fresh``. A lock with more than one link is refused in one line."""
    ckpt = save(str(tmp_path / "ckpt"))
    victim = tmp_path / "victim.txt"
    victim.write_text("important\n" * 100)
    os.link(victim, os.path.join(ckpt, "lock"))
    p = run_py(
        "from checkpoint.errors import OwnershipError\n"
        "from checkpoint.owner import claim\n"
        f"try:\n    claim({ckpt!r}, job='tiny', run_id='tiny-1')\n    print('accepted')\n"
        "except OwnershipError as exc:\n    print('refused', exc)\n"
    )
    line = one_line(p)
    assert line.startswith("refused ") and "has 2 links" in line, line
    assert victim.read_text() == "important\n" * 100


@pytest.mark.parametrize("sealed", [False, True], ids=["plain", "sealed"])
def test_verify_of_a_sparse_file_reads_its_data_not_its_holes(tmp_path, monkeypatch, sealed):
    """A tensor file whose data is a hole (a sparse file: apparent size far beyond what is
    on disk, valid block checksums of zeros) had `ckpt verify` read every hole: a 64 GiB
    file of 33 MB on disk was still being read after a minute (hours at 16 TiB). A piece
    that is all hole (``SEEK_DATA``) is summed as the zeros it reads as, without reading;
    a byte of data written into the hole is still read and named."""
    import importlib
    import struct

    from checkpoint.seal import read_key, write_new_key
    from checkpoint.step import CheckpointFiles

    verify_mod = importlib.import_module(
        "checkpoint.verify"
    )  # the package's `verify` is the function
    key = None
    if sealed:
        write_new_key(str(tmp_path / "key"))
        key = read_key(str(tmp_path / "key"))
    ckpt = str(tmp_path / "ckpt")
    zeros = torch.zeros(2048, 4096)  # 32 MiB of fp32 zeros
    saver = Saver(ckpt, group=None, options=SaveOptions(async_=False, key=key))
    saver.save(
        step=3, consumed_samples=12, model={"w": (zeros, ShardInfo.whole("w", (2048, 4096)))}
    )
    saver.close()
    (path,) = Path(step_path(ckpt, 3)).glob("*.safetensors")
    blob = path.read_bytes()
    (n,) = struct.unpack("<Q", blob[:8])
    with open(path, "r+b") as fh:  # the same bytes, the zeros a hole now
        fh.truncate(8 + n)
        fh.truncate(len(blob))
    if os.stat(path).st_blocks * 512 >= len(blob) // 2:
        pytest.skip("this file system does not keep holes")
    read: list[int] = []
    real = verify_mod.pread_into

    def counted(fd, view, offset, where):
        read.append(len(view))
        return real(fd, view, offset, where)

    monkeypatch.setattr(verify_mod, "pread_into", counted)
    with CheckpointFiles.open(step_path(ckpt, 3), key=key) as f:
        assert verify_mod.verify(f) == []
    # The first piece shares a file-system block with the header (data): read. None of the
    # rest of the 32 MiB hole.
    assert sum(read) <= (8 << 20), sum(read)
    with open(path, "r+b") as fh:  # one byte of data in the middle of the hole
        fh.seek(8 + n + (16 << 20))
        fh.write(b"\x01")
    read.clear()
    with CheckpointFiles.open(step_path(ckpt, 3), key=key) as f:
        problems = verify_mod.verify(f)
    assert len(problems) == 1 and "checksum mismatch (corrupted data)" in problems[0], problems
    assert 0 < sum(read) <= (16 << 20), sum(read)  # the first piece and the data's
