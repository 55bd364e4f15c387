"""Integrity of committed checkpoints: corruption, missing files, versions, commits, retention."""

from __future__ import annotations

import errno
import hashlib
import json
import os
from pathlib import Path

import pytest
import torch
from ckpt_versions import rewrite_as

from checkpoint import (
    Checkpoint,
    CorruptCheckpointError,
    FormatError,
    NoCheckpointError,
    SaveOptions,
    Saver,
    ShardInfo,
    committed_steps,
    load_latest,
    open_step,
    read_latest,
    verify,
)
from checkpoint.store import step_path


def tensors(step: int):
    model = {
        "a": (torch.full((64, 32), float(step)), ShardInfo.whole("a", (64, 32))),
        "b": (torch.arange(100, dtype=torch.float64) + step, ShardInfo.whole("b", (100,))),
    }
    optim = {"exp_avg/a": (torch.full((64, 32), -float(step)), ShardInfo.whole("a", (64, 32)))}
    return model, optim


def save_steps(ckpt: str, steps, *, keep: int = 10, async_: bool = True) -> Saver:
    saver = Saver(
        ckpt, group=None, options=SaveOptions(async_=async_, keep=keep, chunk_min_bytes=1024)
    )
    for step in steps:
        model, optim = tensors(step)
        saver.save(
            step=step, consumed_samples=step * 8, model=model, optimizer=optim, extra={"s": step}
        )
    saver.close()
    return saver


def blank():
    model, optim = tensors(0)
    for t, _ in [*model.values(), *optim.values()]:
        t.fill_(float("nan"))
    return model, optim


def data_file(ckpt: str, step: int) -> str:
    d = step_path(ckpt, step)
    return os.path.join(d, next(f for f in os.listdir(d) if f.endswith(".safetensors")))


def flip_byte(path: str, offset_from_end: int = 100) -> None:
    with open(path, "r+b") as f:
        f.seek(-offset_from_end, os.SEEK_END)
        b = f.read(1)
        f.seek(-offset_from_end, os.SEEK_END)
        f.write(bytes([b[0] ^ 0x01]))


def test_a_flipped_byte_is_named_by_verify_and_at_load_and_resume_falls_back_with_a_warning(
    tmp_path,
):
    ckpt = str(tmp_path)
    save_steps(ckpt, [1, 2])
    bad = data_file(ckpt, 2)
    flip_byte(bad)
    problems = verify(open_step(ckpt, 2))
    assert len(problems) == 1 and bad in problems[0] and "checksum mismatch" in problems[0]
    assert verify(open_step(ckpt, 1)) == []
    model, optim = blank()
    with pytest.raises(CorruptCheckpointError, match="checksum mismatch") as err:
        Checkpoint.open(step_path(ckpt, 2)).load_into(model, optim)
    assert bad in str(err.value)
    warnings: list[str] = []
    loaded = load_latest(ckpt, model=model, optimizer=optim, warn=warnings.append)
    assert (
        loaded.step == 1
        and torch.all(model["a"][0] == 1)
        and torch.all(optim["exp_avg/a"][0] == -1)
    )
    assert len(warnings) == 1 and "step 2" in warnings[0] and bad in warnings[0]


def test_a_missing_or_truncated_file_is_named_and_the_previous_step_loads(tmp_path):
    ckpt = str(tmp_path)
    save_steps(ckpt, [1, 2, 3])
    os.remove(data_file(ckpt, 3))
    with open(data_file(ckpt, 2), "r+b") as f:
        f.truncate(1000)
    with pytest.raises(CorruptCheckpointError, match="missing"):
        Checkpoint.open(step_path(ckpt, 3)).load_into(*blank())
    assert any("bytes" in p or "truncated" in p for p in verify(open_step(ckpt, 2)))
    warnings: list[str] = []
    model, optim = blank()
    assert load_latest(ckpt, model=model, optimizer=optim, warn=warnings.append).step == 1
    assert [w.split(" ")[2] for w in warnings] == ["3", "2"]


def test_a_manifest_of_an_unknown_format_version_is_refused_clearly(tmp_path):
    ckpt = str(tmp_path)
    save_steps(ckpt, [5])
    path = os.path.join(step_path(ckpt, 5), "manifest.json")
    raw = json.loads(Path(path).read_text())
    raw["version"] = 99
    Path(path).write_text(json.dumps(raw))
    with pytest.raises(FormatError, match="format version 99 is not supported"):
        open_step(ckpt, 5)


def test_a_step_of_a_newer_format_stops_the_load_and_is_neither_fallen_back_past_nor_pruned(
    tmp_path,
):
    """Steps 40 and 50 as a newer build writes them (a rollback, an old image in a rolling
    upgrade). The load fell back to 30 and marked both unloadable, and the next commit
    deleted them. Now it stops at 50 in one line, and nothing is recorded or deleted."""
    from checkpoint import UnsupportedVersionError
    from checkpoint.store import prune, read_unloadable

    ckpt = str(tmp_path)
    save_steps(ckpt, [30, 40, 50], keep=3)
    for step in (40, 50):
        _reseal(ckpt, step, version=5)
    model, optim = blank()
    says = r"step-000000050/manifest.json: format version 5 is not supported .*newer build"
    with pytest.raises(UnsupportedVersionError, match=says):
        load_latest(ckpt, model=model, optimizer=optim, warn=pytest.fail)
    assert read_unloadable(ckpt) == {}
    assert prune(ckpt, keep=3) == [] and committed_steps(ckpt) == [30, 40, 50]
    # An older version number than any this build reads is damage, as before.
    _reseal(ckpt, 50, version=0)
    warnings: list[str] = []
    with pytest.raises(UnsupportedVersionError, match="step-000000040"):
        load_latest(ckpt, model=model, optimizer=optim, warn=warnings.append)
    assert "step 50" in warnings[0] and list(read_unloadable(ckpt)) == [50]


def _eio_when_reading(bad: str):
    """``os.preadv`` failing with EIO for the file ``bad`` (a bad sector fails the read)."""
    real = os.preadv

    def failing(fd, buffers, offset, *args):
        if os.readlink(f"/proc/self/fd/{fd}") == bad:
            raise OSError(errno.EIO, "Input/output error")
        return real(fd, buffers, offset, *args)

    return "preadv", failing, "cannot read: Input/output"


def _eio_when_opening(bad: str):
    """``os.open`` failing with EIO for the file ``bad`` (opened in its step directory)."""
    real = os.open

    def failing(path, flags, *args, dir_fd=None, **kwargs):
        where = str(path) if dir_fd is None else os.path.join(
            os.readlink(f"/proc/self/fd/{dir_fd}"), path
        )  # fmt: skip
        if where == bad:
            raise OSError(errno.EIO, "Input/output error")
        return real(path, flags, *args, dir_fd=dir_fd, **kwargs)

    return "open", failing, "cannot open: Input/output"


@pytest.mark.parametrize("fault", [_eio_when_opening, _eio_when_reading], ids=["open", "read"])
def test_a_step_that_cannot_be_read_stops_the_load_and_is_not_marked(tmp_path, monkeypatch, fault):
    """An I/O error from step 20's data, at its open or at a read, is the disk's, not the
    step's: falling back would abandon the step and the next commit would prune it."""
    from checkpoint import CheckpointReadError
    from checkpoint.store import read_unloadable

    ckpt = str(tmp_path)
    save_steps(ckpt, [10, 20])
    name, failing, says = fault(os.path.realpath(data_file(ckpt, 20)))
    monkeypatch.setattr(os, name, failing)
    model, optim = blank()
    with pytest.raises(CheckpointReadError, match=rf"step 20 could not be read \(.*{says}"):
        load_latest(ckpt, model=model, optimizer=optim, warn=pytest.fail)
    monkeypatch.undo()
    assert read_unloadable(ckpt) == {}
    assert load_latest(ckpt, model=model, optimizer=optim).step == 20


def test_an_edited_manifest_fails_its_own_checksum(tmp_path):
    ckpt = str(tmp_path)
    save_steps(ckpt, [5])
    path = os.path.join(step_path(ckpt, 5), "manifest.json")
    text = Path(path).read_text().replace('"consumed_samples": 40', '"consumed_samples": 41')
    Path(path).write_text(text)
    with pytest.raises(FormatError, match="checksum"):
        open_step(ckpt, 5)


def test_a_directory_without_a_commit_is_never_loaded(tmp_path):
    ckpt = str(tmp_path)
    save_steps(ckpt, [1, 2])
    # A save that died after writing everything but before the rename stays `.tmp`.
    os.rename(step_path(ckpt, 2), step_path(ckpt, 2) + ".tmp")
    assert committed_steps(ckpt) == [1]
    model, optim = blank()
    assert load_latest(ckpt, model=model, optimizer=optim).step == 1
    with pytest.raises(NoCheckpointError):
        Checkpoint.open(step_path(ckpt, 2) + ".tmp")
    os.remove(os.path.join(step_path(ckpt, 1), "manifest.json"))
    with pytest.raises(NoCheckpointError, match="never committed"):
        Checkpoint.open(step_path(ckpt, 1))
    with pytest.raises(NoCheckpointError):
        load_latest(ckpt, model=model, optimizer=optim)


def test_retention_keeps_the_newest_commits_and_prunes_an_abandoned_timeline_first(tmp_path):
    ckpt = str(tmp_path)
    save_steps(ckpt, [1, 2, 3, 4], keep=2)
    assert committed_steps(ckpt) == [3, 4] and read_latest(ckpt) == 4
    # Resumed from step 2 of an older timeline: 9 was committed before 6, so 9 belongs to
    # the timeline that was abandoned; 6 is the newest commit, whatever the step numbers.
    save_steps(ckpt, [9, 6], keep=2)
    assert read_latest(ckpt) == 6 and committed_steps(ckpt) == [4, 6]
    model, optim = blank()
    assert load_latest(ckpt, model=model, optimizer=optim).step == 6


def test_after_falling_back_from_a_corrupt_step_retention_keeps_the_step_that_loads(tmp_path):
    ckpt = str(tmp_path)
    save_steps(ckpt, [80, 90, 100], keep=3)
    flip_byte(data_file(ckpt, 100))
    warnings: list[str] = []
    model, optim = blank()
    assert load_latest(ckpt, model=model, optimizer=optim, warn=warnings.append).step == 90
    assert len(warnings) == 1 and "step 100" in warnings[0]
    # Training goes on from 90: the next commit (95) makes 100 an abandoned step, pruned
    # first; keeping by step number would have kept 100 and deleted 90.
    save_steps(ckpt, [95], keep=2)
    assert committed_steps(ckpt) == [90, 95]


def test_a_step_that_failed_to_load_is_never_kept_in_place_of_one_that_loads(tmp_path):
    ckpt = str(tmp_path)
    save_steps(ckpt, [70, 80, 90, 100], keep=4)
    for step in (90, 100):
        flip_byte(data_file(ckpt, step))
    model, optim = blank()
    assert load_latest(ckpt, model=model, optimizer=optim, warn=lambda _m: None).step == 80
    # 90 is older than the next commit (95), so it is on the current lineage; it failed to
    # load, so it does not count among the two kept, and goes before the good 70 and 80.
    save_steps(ckpt, [95], keep=2)
    assert committed_steps(ckpt) == [80, 95]
    assert load_latest(ckpt, model=model, optimizer=optim).step == 95


def test_a_step_whose_manifest_names_another_step_is_not_loaded_and_the_load_falls_back(
    tmp_path,
):
    """Step 2 copied in as step-000000004. With no commit numbers (an older writer's
    manifests: the steps go by number) it is tried first; it loaded as "step 2" from
    step-000000004. Now opening it is refused, as any damaged step, and the load falls
    back to the real step 2 with a warning."""
    import shutil

    ckpt = str(tmp_path)
    save_steps(ckpt, [2])
    path = Path(step_path(ckpt, 2), "manifest.json")
    raw = json.loads(path.read_text())
    del raw["checksum"], raw["commit"]
    canon = json.dumps(raw, sort_keys=True, separators=(",", ":")).encode()
    path.write_text(json.dumps({**raw, "checksum": hashlib.sha256(canon).hexdigest()}))
    shutil.copytree(step_path(ckpt, 2), step_path(ckpt, 4))
    says = "manifest step 2 is not the step of its directory step-000000004"
    with pytest.raises(CorruptCheckpointError, match=says):
        open_step(ckpt, 4)
    model, optim = blank()
    warnings: list[str] = []
    loaded = load_latest(ckpt, model=model, optimizer=optim, warn=warnings.append)
    assert loaded.path == step_path(ckpt, 2) and torch.all(model["a"][0] == 2)
    assert len(warnings) == 1 and "step 4" in warnings[0] and says in warnings[0], warnings


def _reseal(ckpt: str, at: int, **changes) -> None:
    """Rewrite step ``at``'s manifest with ``changes``, sealed as the format doc defines it."""
    path = Path(step_path(ckpt, at), "manifest.json")
    raw = {**json.loads(path.read_text()), **changes}
    raw.pop("checksum")
    canon = json.dumps(raw, sort_keys=True, separators=(",", ":")).encode()
    path.write_text(json.dumps({**raw, "checksum": hashlib.sha256(canon).hexdigest()}))


def test_a_step_that_fails_to_load_heads_no_lineage_whatever_commit_it_claims(tmp_path):
    """Step 5 claims the newest commit (sealed: written by hand, or a stale writer's) and
    does not load. It made 10 to 30 an "abandoned" timeline, and retention deleted every
    step that loads, keeping 5 alone."""
    from checkpoint.store import load_order, prune

    ckpt = str(tmp_path)
    save_steps(ckpt, [5, 10, 20, 30], keep=4)
    _reseal(ckpt, 5, commit=1000)
    flip_byte(data_file(ckpt, 5))
    model, optim = blank()
    assert load_latest(ckpt, model=model, optimizer=optim, warn=lambda _m: None).step == 30
    assert load_order(ckpt) == [30, 20, 10, 5]
    assert prune(ckpt, keep=3) == [5]
    assert committed_steps(ckpt) == [10, 20, 30]
    # The next run's saves go on from 30, and keep what loads.
    save_steps(ckpt, [40], keep=3)
    assert committed_steps(ckpt) == [20, 30, 40]
    assert load_latest(ckpt, model=model, optimizer=optim).step == 40


def test_a_commit_number_nobody_sealed_counts_for_nothing(tmp_path):
    from checkpoint.store import commit_numbers, load_order

    ckpt = str(tmp_path)
    save_steps(ckpt, [5, 10, 20], keep=3)
    path = Path(step_path(ckpt, 5), "manifest.json")
    raw = json.loads(path.read_text())
    path.write_text(json.dumps({**raw, "commit": 1000}))  # the old checksum: not sealed
    _reseal(ckpt, 10, step=11)  # sealed, but for another step than its directory's
    assert commit_numbers(ckpt) == {5: 0, 10: 0, 20: 3}
    assert load_order(ckpt) == [20, 10, 5]


def test_a_manifest_hard_linked_into_other_steps_is_read_once(tmp_path, monkeypatch):
    """No save links manifests; a directory of links to one large manifest cost a whole
    parse per link at every listing, commit and resume."""
    from checkpoint import store

    ckpt = str(tmp_path)
    save_steps(ckpt, [1, 2, 3], keep=3)
    first = Path(step_path(ckpt, 1), "manifest.json")
    for step in (2, 3):
        linked = Path(step_path(ckpt, step), "manifest.json")
        linked.unlink()
        os.link(first, linked)
    store._COMMIT_CACHE.clear()
    parsed: list[str] = []
    real = store.parse_json
    monkeypatch.setattr(store, "parse_json", lambda data, where, **kw: (parsed.append(where), real(data, where, **kw))[1])  # fmt: skip
    assert store.commit_numbers(ckpt) == {1: 1, 2: 0, 3: 0}
    assert parsed == [str(first)]


def test_async_saves_reuse_one_staging_buffer_and_a_step_saved_again_replaces_the_old(tmp_path):
    ckpt = str(tmp_path)
    saver = save_steps(ckpt, [1, 2, 3, 2])
    assert saver.staging_allocations == 1
    assert read_latest(ckpt) == 2
    model, optim = blank()
    assert load_latest(ckpt, model=model, optimizer=optim).manifest.extra == {"s": 2}
    assert not [n for n in os.listdir(ckpt) if n.endswith(".tmp")]


def as_version_1(ckpt: str, step: int) -> None:
    rewrite_as(step_path(ckpt, step), 1)


def test_a_version_1_checkpoint_still_loads_verifies_and_names_corruption(tmp_path):
    ckpt = str(tmp_path)
    save_steps(ckpt, [1, 2])
    for step in (1, 2):
        as_version_1(ckpt, step)
    assert open_step(ckpt, 2).manifest.version == 1
    assert verify(open_step(ckpt, 2)) == []
    model, optim = blank()
    loaded = load_latest(ckpt, model=model, optimizer=optim)
    assert (
        loaded.step == 2
        and torch.all(model["a"][0] == 2)
        and torch.all(model["b"][0] == 2 + torch.arange(100))
    )
    flip_byte(data_file(ckpt, 2))
    problems = verify(open_step(ckpt, 2))
    # The whole file's sha256, and the chunk's CRC-32 a load checks.
    assert len(problems) == 2 and "sha256 mismatch" in problems[0], problems
    assert "checksum mismatch (corrupted data)" in problems[1], problems
    warnings: list[str] = []
    assert load_latest(ckpt, model=model, optimizer=optim, warn=warnings.append).step == 1
    assert "checksum mismatch" in warnings[0]


@pytest.mark.parametrize("lie", ["chunk-crc", "header-sha256"])
def test_verify_of_a_version_1_step_checks_what_a_load_checks(tmp_path, lie):
    """A version 1 manifest with one chunk's CRC-32 or one file's ``header_sha256`` wrong
    (re-checksummed, as anyone can): every load refused the step, and ``ckpt verify``,
    which checked only the whole-file sha256 and the header's entries, said it was fine."""
    from checkpoint.manifest import _self_checksum

    ckpt = str(tmp_path)
    save_steps(ckpt, [1])
    as_version_1(ckpt, 1)
    path = Path(step_path(ckpt, 1)) / "manifest.json"
    raw = json.loads(path.read_text())
    if lie == "chunk-crc":
        shard = raw["tensors"]["a"]["shards"][0]
        shard["crc32"] = f"{int(shard['crc32'], 16) ^ 1:08x}"
    else:
        meta = next(iter(raw["files"].values()))
        meta["header_sha256"] = "0" * 64
    raw.pop("checksum")
    raw["checksum"] = _self_checksum(raw)
    path.write_text(json.dumps(raw))
    problems = verify(open_step(ckpt, 1))
    want = (
        "checksum mismatch (corrupted data)" if lie == "chunk-crc" else "header checksum mismatch"
    )
    assert len(problems) == 1 and want in problems[0], problems
    model, optim = blank()
    with pytest.raises(CorruptCheckpointError, match="no committed checkpoint loads"):
        load_latest(ckpt, model=model, optimizer=optim, warn=lambda _m: None)


def test_a_model_that_does_not_fit_any_step_marks_none_of_them_unloadable(tmp_path):
    from checkpoint.store import read_unloadable

    ckpt = str(tmp_path)
    save_steps(ckpt, [1, 2, 3], keep=3)
    wrong = {"a": (torch.zeros(32, 32), ShardInfo.whole("a", (32, 32)))}
    with pytest.raises(CorruptCheckpointError, match="no committed checkpoint loads"):
        load_latest(ckpt, model=wrong, warn=lambda _m: None)
    # The steps are sound; the model changed. Retention goes on keeping the newest.
    assert read_unloadable(ckpt) == {}
    save_steps(ckpt, [4], keep=2)
    assert committed_steps(ckpt) == [3, 4]
