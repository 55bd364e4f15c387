"""Sealed checkpoints (``SaveOptions.key``, ``checkpoint.key_file``, ``--key-file``): with the
key, a step changed by anyone without it is refused, even when every unkeyed checksum was
recomputed (the manifest's sha256, a header's, and a block's CRC-32C, which the attacker
keeps by a CRC-preserving change); a step planted without a seal is passed over and never
heads retention; a key file open to others, or too short, is refused in one line."""

from __future__ import annotations

import hashlib
import json
import os
import random
import shutil
import struct
import subprocess
import sys
from pathlib import Path

import crc32c
import pytest
import torch

from checkpoint import CorruptCheckpointError, SaveOptions, Saver, ShardInfo, load_latest, verify
from checkpoint.seal import KeyFileError, SealError, key_id, read_key, write_new_key
from checkpoint.step import CheckpointFiles
from checkpoint.store import commit_numbers, load_order, prune, read_unloadable, step_path

REPO = Path(__file__).resolve().parents[1]
SHAPE = (256, 64)  # 64 KiB of fp32: four 16 KiB verify blocks
W = torch.arange(SHAPE[0] * SHAPE[1], dtype=torch.float32).reshape(SHAPE)


@pytest.fixture
def key(tmp_path) -> bytes:
    path = tmp_path / "key"
    write_new_key(str(path))
    return read_key(str(path))


def save(ckpt: str, step: int, key: bytes | None, w: torch.Tensor = W) -> None:
    saver = Saver(ckpt, group=None, options=SaveOptions(async_=False, key=key, keep=10))
    saver.save(step=step, consumed_samples=4 * step, model={"w": (w.clone(), whole())})
    saver.close()


def whole() -> ShardInfo:
    return ShardInfo.whole("w", SHAPE)


def load(ckpt: str, key: bytes | None, **kw) -> tuple[int, torch.Tensor]:
    out = torch.zeros(SHAPE)
    c = load_latest(ckpt, model={"w": (out, whole())}, key=key, **kw)
    c.close()
    return c.step, out


def manifest_path(ckpt: str, step: int) -> Path:
    return Path(step_path(ckpt, step)) / "manifest.json"


def reseal_unkeyed(ckpt: str, step: int, raw: dict) -> None:
    """What anyone can do: write ``raw`` with its checksum recomputed (no key)."""
    raw.pop("checksum", None)
    canon = json.dumps(raw, sort_keys=True, separators=(",", ":")).encode()
    raw["checksum"] = hashlib.sha256(canon).hexdigest()
    manifest_path(ckpt, step).write_text(json.dumps(raw))


def crc_preserving_delta(n: int) -> bytes:
    """A nonzero ``n``-byte XOR mask that leaves every message's CRC-32C as it was: CRC is
    affine over GF(2), so among 33 random masks some subset's linear parts cancel (found
    by Gaussian elimination)."""
    zero = crc32c.crc32c(bytes(n))
    rng = random.Random(1)
    basis: dict[int, tuple[int, int]] = {}
    masks: list[int] = []
    while True:
        mask = rng.getrandbits(8 * n)
        masks.append(mask)
        v, combo = crc32c.crc32c(mask.to_bytes(n, "little")) ^ zero, 1 << (len(masks) - 1)
        while v:
            top = v.bit_length() - 1
            if top not in basis:
                basis[top] = (v, combo)
                break
            v, combo = v ^ basis[top][0], combo ^ basis[top][1]
        if not v:
            out = 0
            for i, m in enumerate(masks):
                if combo >> i & 1:
                    out ^= m
            if out:
                return out.to_bytes(n, "little")


def tamper_first_block(ckpt: str, step: int) -> None:
    """Change the first 16 KiB block of ``w`` so that its CRC-32C stays: header, manifest
    and every unkeyed checksum are then untouched and still match."""
    (path,) = Path(step_path(ckpt, step)).glob("*.safetensors")
    data = bytearray(path.read_bytes())
    (n,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8 : 8 + n])
    first = min((v["data_offsets"][0], k) for k, v in header.items() if k != "__metadata__")
    assert first[0] == 0 and header["__metadata__"].get("mac:" + first[1])
    begin = 8 + n
    block = bytes(data[begin : begin + (16 << 10)])
    changed = bytes(a ^ b for a, b in zip(block, crc_preserving_delta(len(block)), strict=True))
    assert crc32c.crc32c(changed) == crc32c.crc32c(block) and changed != block
    data[begin : begin + len(block)] = changed
    path.write_bytes(bytes(data))


def test_a_sealed_step_loads_with_its_key_and_a_reshard_reads_what_it_did_unsealed(tmp_path, key):
    sealed, plain = str(tmp_path / "sealed"), str(tmp_path / "plain")
    save(sealed, 3, key)
    save(plain, 3, None)
    raw = json.loads(manifest_path(sealed, 3).read_text())
    assert raw["seal"]["alg"] == "hmac-sha256" and raw["seal"]["key_id"] == key_id(key)
    assert "seal" not in json.loads(manifest_path(plain, 3).read_text())
    step, got = load(sealed, key)
    assert step == 3 and torch.equal(got, W)
    assert torch.equal(load(sealed, None)[1], W)  # without the key: the CRCs, as ever
    # A region of rows (a reshard): the same blocks are read with and without the key.
    reads = []
    for ckpt, k in ((sealed, key), (plain, None)):
        part = torch.zeros(40, 64)
        info = ShardInfo(name="w", global_shape=SHAPE, offsets=(100, 0), sizes=(40, 64))
        c = load_latest(ckpt, model={"w": (part, info)}, key=k)
        assert torch.equal(part, W[100:140])
        reads.append(c.stats.bytes_read - sum(h.data_start for h in c._handles.values()))
        c.close()
    assert reads[0] == reads[1] < W.numel() * 4  # the blocks of rows 100-139, no more
    with CheckpointFiles.open(step_path(sealed, 3), key=key) as f:
        assert list(verify(f)) == []


def test_a_block_changed_with_its_crc_kept_loads_without_the_key_and_is_refused_with_it(
    tmp_path, key
):
    ckpt = str(tmp_path / "ckpt")
    save(ckpt, 3, key)
    save(ckpt, 6, key, W + 1)
    tamper_first_block(ckpt, 6)
    # Without the key, what an unkeyed checkpoint always was: the change goes unseen.
    step, got = load(ckpt, None)
    assert step == 6 and not torch.equal(got, W + 1)
    # With it: refused at the block, and the load falls back to step 3, recorded.
    warned: list[str] = []
    step, got = load(ckpt, key, warn=warned.append)
    assert step == 3 and torch.equal(got, W)
    assert "MAC mismatch (changed after it was sealed)" in warned[0], warned
    assert 6 in read_unloadable(ckpt)
    with CheckpointFiles.open(step_path(ckpt, 6), key=key) as f:
        problems = list(verify(f))
    assert len(problems) == 1 and "MAC mismatch" in problems[0], problems
    with CheckpointFiles.open(step_path(ckpt, 6)) as f:
        assert list(verify(f)) == []  # no key: nothing to see


def test_a_manifest_changed_and_resealed_without_the_key_is_refused(tmp_path, key):
    ckpt = str(tmp_path / "ckpt")
    save(ckpt, 3, key)
    save(ckpt, 6, key)
    raw = json.loads(manifest_path(ckpt, 6).read_text())
    raw["consumed_samples"] = 10**6
    reseal_unkeyed(ckpt, 6, raw)
    with pytest.raises(CorruptCheckpointError, match="seal does not match its content"):
        CheckpointFiles.open(step_path(ckpt, 6), key=key)
    assert load(ckpt, key)[0] == 3
    # Dropping the seal instead makes it an unsealed step: passed over, not recorded.
    raw.pop("seal")
    reseal_unkeyed(ckpt, 6, raw)
    with pytest.raises(SealError, match="not sealed"):
        CheckpointFiles.open(step_path(ckpt, 6), key=key)


def test_a_planted_unsealed_step_is_passed_over_and_never_heads_retention(tmp_path, key):
    ckpt, elsewhere = str(tmp_path / "ckpt"), str(tmp_path / "elsewhere")
    save(ckpt, 3, key)
    save(ckpt, 6, key)
    save(elsewhere, 9, None, W * 0)
    shutil.copytree(step_path(elsewhere, 9), step_path(ckpt, 9))
    raw = json.loads(manifest_path(ckpt, 9).read_text())
    raw["commit"] = 10**15  # claims to be the newest commit
    reseal_unkeyed(ckpt, 9, raw)
    assert load_order(ckpt)[0] == 9  # unkeyed, the plant heads the lineage
    assert load_order(ckpt, key)[:2] == [6, 3] and commit_numbers(ckpt, key)[9] == 0
    warned: list[str] = []
    step, got = load(ckpt, key, warn=warned.append)
    assert step == 6 and torch.equal(got, W) and not warned  # never tried before 6
    assert prune(ckpt, keep=1, key=key) == [9, 3]  # the plant first, as abandoned
    assert os.path.isdir(step_path(ckpt, 6))


def test_a_key_on_a_directory_of_unsealed_steps_stops_with_a_hint_and_records_nothing(
    tmp_path, key
):
    ckpt = str(tmp_path / "ckpt")
    save(ckpt, 3, None)
    save(ckpt, 6, None)
    with pytest.raises(CorruptCheckpointError) as info:
        load(ckpt, key)
    text = str(info.value)
    assert "not sealed (saved without a key)" in text and "none is sealed with the key" in text
    assert read_unloadable(ckpt) == {}  # nothing recorded: they are good steps
    assert load(ckpt, None)[0] == 6


def test_another_keys_step_names_both_key_ids(tmp_path, key):
    ckpt = str(tmp_path / "ckpt")
    other = b"k" * 32
    save(ckpt, 3, other)
    with pytest.raises(SealError) as info:
        CheckpointFiles.open(step_path(ckpt, 3), key=key)
    assert key_id(other) in str(info.value) and key_id(key) in str(info.value)
    # A key rotation: ckpt seal checks it by its CRCs and seals it with the new key.
    from checkpoint.sealstep import seal_step

    assert seal_step(ckpt, 3, key) == "sealed"
    assert load(ckpt, key)[0] == 3
    with pytest.raises(SealError, match="another key"):
        CheckpointFiles.open(step_path(ckpt, 3), key=other)


def test_key_files_open_to_others_short_or_missing_are_refused(tmp_path):
    path = tmp_path / "key"
    kid = write_new_key(str(path))
    assert os.stat(path).st_mode & 0o777 == 0o600
    assert key_id(read_key(str(path))) == kid
    with pytest.raises(KeyFileError, match="File exists"):
        write_new_key(str(path))  # never over an existing key
    os.chmod(path, 0o640)
    with pytest.raises(KeyFileError, match="chmod 600"):
        read_key(str(path))
    short = tmp_path / "short"
    short.write_text("too short\n")
    os.chmod(short, 0o600)
    with pytest.raises(KeyFileError, match="fewer than 32"):
        read_key(str(short))
    with pytest.raises(KeyFileError, match="No such file"):
        read_key(str(tmp_path / "missing"))


def cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "elasticd", "ckpt", *args],
        capture_output=True, text=True, cwd=REPO, timeout=120,
    )  # fmt: skip


def one_line_error(r: subprocess.CompletedProcess) -> str:
    assert r.returncode == 2, (r.stdout, r.stderr)
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in r.stderr, r.stderr
    return lines[0]


def test_the_cli_makes_keys_checks_seals_and_refuses_in_one_line(tmp_path):
    path, ckpt = tmp_path / "key", str(tmp_path / "ckpt")
    r = cli("keygen", str(path))
    assert r.returncode == 0 and "key id" in r.stdout, r.stderr
    assert "File exists" in one_line_error(cli("keygen", str(path)))
    key = read_key(str(path))
    save(ckpt, 3, key)
    r = cli("verify", ckpt, "--key-file", str(path))
    assert r.returncode == 0 and "every MAC checked" in r.stdout, r.stderr
    r = cli("verify", ckpt)
    assert r.returncode == 0 and "not checked (no --key-file)" in r.stdout, r.stderr
    r = cli("ls", ckpt)
    assert f"sealed ({key_id(key)})" in r.stdout, r.stdout
    tamper_first_block(ckpt, 3)
    assert "MAC mismatch" in one_line_error(cli("verify", ckpt, "--key-file", str(path)))
    assert "MAC mismatch" in one_line_error(
        cli("export", ckpt, str(tmp_path / "out"), "--key-file", str(path))
    )
    os.chmod(path, 0o644)
    assert "chmod 600" in one_line_error(cli("verify", ckpt, "--key-file", str(path)))


def test_the_trainer_seals_with_the_jobs_key_and_resumes_only_from_sealed_steps(tmp_path, capsys):
    from trainer.__main__ import main as trainer_main

    keyfile = tmp_path / "key"
    write_new_key(str(keyfile))
    out = tmp_path / "out"

    def run(steps: int, *extra: str) -> int:
        args = [str(REPO / "examples" / "tiny.yaml"), "--set", f"output_dir={out}",
                "--set", f"train.steps={steps}", "--set", "checkpoint.every=2"]  # fmt: skip
        for o in extra:
            args += ["--set", o]
        return trainer_main(args, env={"RANK": "0", "WORLD_SIZE": "1"})

    # Unsealed steps, then the key: the resume stops in one line, nothing recorded.
    assert run(2) == 0
    capsys.readouterr()
    assert run(4, f"checkpoint.key_file={keyfile}") == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "none is sealed with the key" in err, err
    assert read_unloadable(str(out / "ckpt")) == {}
    # Started over with the key: sealed saves, and a resume from them.
    shutil.rmtree(out)
    assert run(2, f"checkpoint.key_file={keyfile}") == 0
    raw = json.loads(manifest_path(str(out / "ckpt"), 2).read_text())
    assert raw["seal"]["key_id"] == key_id(read_key(str(keyfile)))
    capsys.readouterr()
    assert run(4, f"checkpoint.key_file={keyfile}") == 0
    assert "resum" in capsys.readouterr().out
    assert json.loads(manifest_path(str(out / "ckpt"), 4).read_text())["seal"]
    # A key file that others may read is the job's error, one line.
    os.chmod(keyfile, 0o644)
    assert run(6, f"checkpoint.key_file={keyfile}") == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "chmod 600" in err, err


def _save_two_ranks(rank: int, world: int, store: str, ckpt: str, key: bytes) -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    rows = SHAPE[0] // world
    info = ShardInfo(name="w", global_shape=SHAPE, offsets=(rank * rows, 0), sizes=(rows, 64))
    saver = Saver(ckpt, group=dist.group.WORLD, options=SaveOptions(async_=True, key=key))
    saver.save(step=5, consumed_samples=20, model={"w": (W[rank * rows :][:rows].clone(), info)})
    saver.close()
    dist.destroy_process_group()


def test_two_writers_seal_one_step_that_loads_whole_and_verifies_with_the_key(tmp_path, key):
    import torch.multiprocessing as mp

    ckpt = str(tmp_path / "ckpt")
    mp.spawn(_save_two_ranks, args=(2, str(tmp_path / "store"), ckpt, key), nprocs=2, join=True)
    files = sorted(Path(step_path(ckpt, 5)).glob("*.safetensors"))
    assert len(files) == 2  # each rank wrote its rows, each file with its MACs
    step, got = load(ckpt, key)
    assert step == 5 and torch.equal(got, W)
    with CheckpointFiles.open(step_path(ckpt, 5), key=key) as f:
        assert list(verify(f)) == []
    # The second writer's file changed with its CRCs kept: the block names it.
    data = bytearray(files[1].read_bytes())
    (n,) = struct.unpack("<Q", data[:8])
    block = bytes(data[8 + n : 8 + n + (16 << 10)])
    mask = crc_preserving_delta(len(block))
    data[8 + n : 8 + n + len(block)] = bytes(a ^ b for a, b in zip(block, mask, strict=True))
    files[1].write_bytes(bytes(data))
    with CheckpointFiles.open(step_path(ckpt, 5), key=key) as f:
        problems = list(verify(f))
    assert len(problems) == 1 and files[1].name in problems[0] and "MAC" in problems[0], problems


def test_a_jobs_key_file_is_resolved_and_a_bad_one_stops_elasticd_run_in_one_line(tmp_path):
    from elasticd.errors import JobSpecError
    from elasticd.jobspec import load_job

    job = load_job(str(REPO / "examples" / "tiny.yaml"), ["checkpoint.key_file=keys/k"])
    assert job.with_paths_resolved(tmp_path).checkpoint.key_file == str(tmp_path / "keys" / "k")
    with pytest.raises(JobSpecError, match=r"checkpoint\.key_file"):
        load_job(str(REPO / "examples" / "tiny.yaml"), ['checkpoint.key_file=""'])
    keyfile = tmp_path / "key"
    write_new_key(str(keyfile))
    os.chmod(keyfile, 0o604)
    r = subprocess.run(
        [sys.executable, "-m", "elasticd", "run", str(REPO / "examples" / "tiny.yaml"),
         "--set", f"output_dir={tmp_path / 'out'}", "--set", f"checkpoint.key_file={keyfile}"],
        capture_output=True, text=True, cwd=tmp_path, timeout=120,
    )  # fmt: skip
    line = one_line_error(r)
    assert "tiny.yaml: checkpoint.key_file:" in line and "chmod 600" in line, line
    assert not (tmp_path / "out").exists()  # refused before anything started


def test_ckpt_seal_seals_saved_steps_in_place_keeping_their_order_and_leaves_a_bad_one(tmp_path):
    from ckpt_versions import rewrite_as

    keyfile, ckpt = tmp_path / "key", str(tmp_path / "ckpt")
    write_new_key(str(keyfile))
    key = read_key(str(keyfile))
    for step in (3, 6, 9, 12):
        save(ckpt, step, None, W + step)
    before = commit_numbers(ckpt)
    # Step 9 damaged (a flipped byte: its CRC says so); step 3 as version 3 wrote it.
    (path,) = Path(step_path(ckpt, 9)).glob("*.safetensors")
    data = bytearray(path.read_bytes())
    data[-5] ^= 1
    path.write_bytes(bytes(data))
    rewrite_as(step_path(ckpt, 3), 3)
    r = cli("seal", ckpt, "--key-file", str(keyfile))
    line = one_line_error(r)
    assert line.startswith("elasticd: error: ckpt seal: 2 of 4 step(s) not sealed: step 3:")
    assert "version 3" in line, line
    assert "step 6: sealed" in r.stdout and "step 12: sealed" in r.stdout, r.stdout
    assert "step 9: not sealed:" in r.stdout and "checksum mismatch" in r.stdout, r.stdout
    # The commit order is as it was, for readers without the key too.
    assert commit_numbers(ckpt) == before and load_order(ckpt)[0] == 12
    assert {s for s, n in commit_numbers(ckpt, key).items() if n} == {6, 12}
    for step in (6, 12):
        with CheckpointFiles.open(step_path(ckpt, step), key=key) as f:
            assert list(verify(f)) == []
    step, got = load(ckpt, key)
    assert step == 12 and torch.equal(got, W + 12)
    assert not [n for n in os.listdir(ckpt) if n.endswith(".tmp")], os.listdir(ckpt)
    # Again: a step sealed with the key is left alone.
    r = cli("seal", ckpt, "--key-file", str(keyfile), "--step", "12")
    assert r.returncode == 0 and "step 12: already sealed with this key" in r.stdout, r.stderr
    # A step sealed with the key and changed since (its CRCs kept) is evidence, never resealed.
    tamper_first_block(ckpt, 6)
    line = one_line_error(cli("seal", ckpt, "--key-file", str(keyfile), "--step", "6"))
    assert "changed since it was sealed with this key" in line, line
    step, got = load(ckpt, key, warn=lambda _: None)
    assert step == 12


def test_a_seal_mac_that_is_not_ascii_is_a_changed_step_not_a_crash(tmp_path, key):
    # hmac.compare_digest raises TypeError for a str that is not ASCII: a planted mac of
    # "é" crashed every reader with the key (the store's listing, each load, retention).
    ckpt = str(tmp_path / "ckpt")
    save(ckpt, 3, key)
    save(ckpt, 6, key)
    raw = json.loads(manifest_path(ckpt, 6).read_text())
    raw["seal"]["mac"] = "\u00e9" * 64
    reseal_unkeyed(ckpt, 6, raw)
    assert commit_numbers(ckpt, key)[6] == 0 and load_order(ckpt, key)[0] == 3
    with pytest.raises(CorruptCheckpointError, match="seal does not match its content"):
        CheckpointFiles.open(step_path(ckpt, 6), key=key)
    assert load(ckpt, key)[0] == 3
    assert prune(ckpt, keep=1, key=key) == [6]


def test_a_manifest_hard_linked_under_a_lower_step_does_not_demote_its_own_step(tmp_path, key):
    # Manifests with several links are read once (a listing's cost); the link was read
    # first, under step 1, and the real step 9 then counted as commit 0: a load with the
    # key took step 6, and retention with the key deleted step 9, intact and sealed.
    ckpt = str(tmp_path / "ckpt")
    for step in (3, 6, 9):
        save(ckpt, step, key)
    os.mkdir(step_path(ckpt, 1))
    os.link(manifest_path(ckpt, 9), manifest_path(ckpt, 1))
    assert commit_numbers(ckpt, key) == {1: 0, 3: 1, 6: 2, 9: 3}
    assert load_order(ckpt, key)[0] == 9 and load(ckpt, key)[0] == 9
    assert prune(ckpt, keep=2, key=key) == [1, 3]
    assert os.path.isdir(step_path(ckpt, 9))


def test_a_key_file_that_fails_to_read_is_refused_in_one_line(tmp_path, monkeypatch):
    # An I/O error while reading (a failing disk; /proc/self/mem, a regular file of mode
    # 600, gives EIO) was a bare OSError, a traceback; and a short read kept a short key.
    import errno

    from checkpoint import seal

    path = tmp_path / "key"
    write_new_key(str(path))
    whole = read_key(str(path))
    real = os.read
    monkeypatch.setattr(seal.os, "read", lambda fd, n: real(fd, min(n, 7)))
    assert read_key(str(path)) == whole  # read to the end, 7 bytes at a time

    def fails(fd: int, n: int) -> bytes:
        raise OSError(errno.EIO, os.strerror(errno.EIO))

    monkeypatch.setattr(seal.os, "read", fails)
    with pytest.raises(KeyFileError, match="Input/output error"):
        read_key(str(path))


def test_save_options_never_show_the_key(key):
    # A dataclass's repr shows every field: any log or error quoting the options (a
    # debugging print, a traceback with locals) would have shown the key.
    shown = repr(SaveOptions(key=key, job="j"))
    assert "job='j'" in shown and repr(key) not in shown and key.decode() not in shown


def test_a_step_sealed_by_another_job_with_the_same_key_is_passed_over_by_this_jobs_resume(
    tmp_path, key
):
    mine, theirs = str(tmp_path / "mine"), str(tmp_path / "theirs")
    for ckpt, job, step in ((mine, "a", 6), (theirs, "b", 9)):
        saver = Saver(ckpt, group=None, options=SaveOptions(async_=False, key=key, job=job))
        saver.save(step=step, consumed_samples=1, model={"w": ((W + step).clone(), whole())})
        saver.close()
    shutil.copytree(step_path(theirs, 9), step_path(mine, 9))
    out = torch.zeros(SHAPE)
    warned: list[str] = []
    c = load_latest(mine, model={"w": (out, whole())}, key=key, job="a", warn=warned.append)
    c.close()
    assert c.step == 6 and torch.equal(out, W + 6)
    # With the job, the copy counts as commit 0 (it was tried first, and fallen back from).
    assert not warned and load_order(mine, key, job="a") == [6, 9]
    assert load(mine, key)[0] == 9  # without the job: the key alone vouches for it
    shutil.rmtree(step_path(mine, 6))
    with pytest.raises(CorruptCheckpointError, match="sealed by job b, not a"):
        load_latest(mine, model={"w": (out, whole())}, key=key, job="a")
    assert read_unloadable(mine) == {}


def save_for(ckpt: str, job: str, key: bytes, step: int, *, keep: int = 10) -> None:
    saver = Saver(ckpt, group=None, options=SaveOptions(async_=False, key=key, job=job, keep=keep))
    saver.save(step=step, consumed_samples=4 * step, model={"w": ((W + step).clone(), whole())})
    saver.close()


def test_another_jobs_sealed_step_copied_in_never_heads_this_jobs_lineage_or_retention(
    tmp_path, key
):
    # The same key sealed job b's steps; b's step 9 (commit 5, above any of a's) copied
    # into a's directory headed a's lineage with the key: a's next save, numbered after
    # it, kept it and deleted a's own step 6, and `ckpt prune --key-file` did the same.
    mine, theirs, again = (str(tmp_path / n) for n in ("mine", "theirs", "again"))
    for ckpt in (mine, again):
        for step in (3, 6):
            save_for(ckpt, "a", key, step)
    for step in (1, 2, 7, 8, 9):
        save_for(theirs, "b", key, step)
    for ckpt in (mine, again):
        shutil.copytree(step_path(theirs, 9), step_path(ckpt, 9))
    # a's next save is numbered after a's own commits, and its retention prunes the
    # copied step first, as abandoned: a's steps 6 and 12 stay.
    save_for(mine, "a", key, 12, keep=2)
    assert sorted(commit_numbers(mine)) == [6, 12]
    assert json.loads(manifest_path(mine, 12).read_text())["commit"] == 3
    out = torch.zeros(SHAPE)
    c = load_latest(mine, model={"w": (out, whole())}, key=key, job="a")
    c.close()
    assert c.step == 12 and torch.equal(out, W + 12)
    # The store's ordering: the key alone vouches for the copy; with the job it is commit 0.
    assert commit_numbers(again, key)[9] == 5
    assert commit_numbers(again, key, job="a") == {3: 1, 6: 2, 9: 0}
    assert load_order(again, key, job="a")[:2] == [6, 3]
    # The CLI: --job names the job; without it, the owner record's job.
    backup, keyfile = str(tmp_path / "backup"), tmp_path / "key"  # the fixture's key file
    shutil.copytree(again, backup)
    r = cli("prune", again, "--keep", "1", "--key-file", str(keyfile), "--job", "a")
    assert r.returncode == 0 and "removed 2 step(s): 9, 3" in r.stdout, (r.stdout, r.stderr)
    shutil.rmtree(again)
    shutil.copytree(backup, again)
    Path(again, "owner.json").write_text(json.dumps({"job": "a", "run_id": "a-0a1b2c3d"}))
    r = cli("prune", again, "--keep", "1", "--key-file", str(keyfile))
    assert r.returncode == 0 and "removed 2 step(s): 9, 3" in r.stdout, (r.stdout, r.stderr)
    assert os.path.isdir(step_path(again, 6))
    assert "--job takes effect only with --key-file" in one_line_error(
        cli("prune", again, "--keep", "1", "--job", "a")
    )


def _load_two_ranks(rank: int, world: int, store: str, dirs: list[str], key: bytes, out: str):
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    got = torch.zeros(SHAPE)
    warned: list[str] = []
    c = load_latest(dirs[rank], model={"w": (got, whole())}, group=dist.group.WORLD, key=key,
                    job="a", warn=warned.append)  # fmt: skip
    c.close()
    steps = {str(s): torch.equal(got, W + s) for s in (3, 6, 60)}
    Path(out, f"rank{rank}.json").write_text(json.dumps({"step": c.step, "equal": steps,
                                                         "warned": warned}))  # fmt: skip
    dist.destroy_process_group()


def test_ranks_that_open_different_sealed_saves_of_a_step_fall_back_together(tmp_path, key):
    # Each rank of a load opens the step itself. Rank 1 here sees step 6 as it is after its
    # directory was swapped for another sealed save of step 6 by the same job and key (a
    # copy of the directory where step 6 was saved again): deterministic, no timing. Both
    # opens pass every check, and the ranks loaded different states (6 and 60).
    import torch.multiprocessing as mp

    before, after = str(tmp_path / "before"), str(tmp_path / "after")
    save_for(before, "a", key, 3)
    save_for(before, "a", key, 6)
    shutil.copytree(before, after)
    saver = Saver(after, group=None, options=SaveOptions(async_=False, key=key, job="a"))
    saver.save(step=6, consumed_samples=24, model={"w": ((W + 60).clone(), whole())})
    saver.close()
    assert manifest_path(before, 6).read_bytes() != manifest_path(after, 6).read_bytes()
    args = (2, str(tmp_path / "store"), [before, after], key, str(tmp_path))
    mp.spawn(_load_two_ranks, args=args, nprocs=2, join=True)
    results = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
    for r in results:
        assert r["step"] == 3 and r["equal"]["3"], results  # step 3: the same save on both
    assert "ranks opened 2 different saves of step 6" in results[0]["warned"][0], results
    assert read_unloadable(before) == {}  # step 6 is not damaged: nothing recorded


@pytest.mark.parametrize("damage", ["blocks-found-by-a-load", "header"])
def test_in_process_recovery_does_not_count_a_damaged_sealed_step_as_newer_than_the_replicas(
    tmp_path, key, damage
):
    # The replicas hold step 6; sealed steps 4 and 8 are on disk, step 8 damaged. Counted
    # newer, the recovery dropped the replicas for the checkpoint, whose load then fell
    # back from 8 to 4: two steps older than what the replicas held.
    from elasticd.jobspec import parse_job
    from trainer.recovery import _checkpoint_is_newer

    ckpt = str(tmp_path / "ckpt")
    job = parse_job({"name": "sealedjob", "output_dir": str(tmp_path),
                     "checkpoint": {"every": 4, "dir": ckpt, "key_file": str(tmp_path / "key")}})  # fmt: skip
    for step in (4, 8):
        save_for(ckpt, job.name, key, step)
    assert _checkpoint_is_newer(job, 6, None, key=key)  # intact: step 8 is newer
    if damage == "header":
        # Not recorded anywhere yet: the file's header no longer matches the sealed
        # manifest's header_sha256: one hex digit of a block's CRC in it changed.
        (path,) = Path(step_path(ckpt, 8)).glob("*.safetensors")
        data = bytearray(path.read_bytes())
        (n,) = struct.unpack("<Q", data[:8])
        at = data.index(b'"', data.index(b'"crc32c:', 8, 8 + n) + 1) + 3  # its value's 1st digit
        assert at < 8 + n and chr(data[at]) in "0123456789abcdef"
        data[at] = ord("1") if data[at] != ord("1") else ord("2")
        path.write_bytes(bytes(data))
    else:
        # Blocks changed with their CRCs kept: only reading them (with the key) tells, and
        # a load that does so falls back to step 4 and records step 8.
        tamper_first_block(ckpt, 8)
        assert load(ckpt, key, job=job.name, warn=lambda _: None)[0] == 4
        assert 8 in read_unloadable(ckpt)
    assert not _checkpoint_is_newer(job, 6, None, key=key)
    assert _checkpoint_is_newer(job, 2, None, key=key)  # step 4 is newer than step 2


def test_a_symlink_planted_where_the_saver_writes_its_manifest_is_never_written_through(
    tmp_path, key
):
    # The manifest was opened with O_CREAT | O_TRUNC and no O_NOFOLLOW (the tensor files
    # had it): a symlink at step-N.<token>.tmp/manifest.json made the save write the
    # manifest into the file it points to, anywhere the trainer may write.
    from checkpoint import SaveFailedError
    from checkpoint.store import mark_unloadable

    ckpt, outside = str(tmp_path / "ckpt"), tmp_path / "outside"
    outside.write_text("precious\n")
    # `latest` and unloadable.json planted as symlinks: replaced by a rename, never written
    # through (their temporaries are new files under unpredictable names).
    os.makedirs(ckpt)
    os.symlink(outside, os.path.join(ckpt, "latest"))
    os.symlink(outside, os.path.join(ckpt, "unloadable.json"))
    save_for(ckpt, "a", key, 3)
    save_for(ckpt, "a", key, 4)
    mark_unloadable(ckpt, 4, "a test")
    assert not os.path.islink(os.path.join(ckpt, "latest"))
    assert not os.path.islink(os.path.join(ckpt, "unloadable.json"))
    planted: list[str] = []

    def plant(point: str) -> None:
        if point == "manifest-writing":
            (tmp,) = [n for n in os.listdir(ckpt) if n.startswith("step-000000006.")]
            planted.append(os.path.join(ckpt, tmp, "manifest.json"))
            os.symlink(outside, planted[-1])

    opts = SaveOptions(async_=False, key=key, job="a", hook=plant)
    saver = Saver(ckpt, group=None, options=opts)
    with pytest.raises(SaveFailedError) as info:
        saver.save(step=6, consumed_samples=24, model={"w": ((W + 6).clone(), whole())})
    saver.close()
    assert planted and outside.read_text() == "precious\n"
    text = str(info.value)
    assert len(text.splitlines()) == 1 and "a symlink is already there" in text, text
    assert "checkpoint step 6 was not committed" in text, text
    assert not os.path.lexists(step_path(ckpt, 6))  # nothing committed; its directory gone
    assert not [n for n in os.listdir(ckpt) if n.endswith(".tmp")], os.listdir(ckpt)
    assert load(ckpt, key)[0] == 3


def test_a_planted_key_id_is_never_printed_raw(tmp_path, key):
    """A seal's ``key_id`` (at most 32 characters) went into the message as it was: a
    planted ``"abc\\nFAKE: step 2 is fine\\n\\x1b[1m"`` printed three lines and a terminal
    escape where a refusal is one line. It is shown as Python writes it now."""
    ckpt = str(tmp_path / "ckpt")
    save(ckpt, 3, key)
    raw = json.loads(manifest_path(ckpt, 3).read_text())
    raw["seal"]["key_id"] = "abc\nFAKE: step 2 is fine\n\x1b[1m"
    reseal_unkeyed(ckpt, 3, raw)
    with pytest.raises(SealError) as info:
        CheckpointFiles.open(step_path(ckpt, 3), key=key)
    said = str(info.value)
    assert "\n" not in said and "\x1b" not in said, repr(said)
    assert "sealed with another key (key id 'abc\\nFAKE" in said, said
