"""What makes the sync save fast, and that none of it changes what is written or read:
early writeback (sync_file_range), the commit-number cache, the manifest's line layout,
and the save's two small collectives (a gather to rank 0, a fixed-size broadcast)."""

from __future__ import annotations

import hashlib
import json
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch
from test_checkpoint_multirank import _init, spawn

from checkpoint import SaveOptions, Saver, ShardInfo, open_step, stfile
from checkpoint.comm import broadcast_json_small, gather_json_to_root
from checkpoint.manifest import MANIFEST
from checkpoint.stfile import FileSlot, block_crc32c, write_file
from checkpoint.store import commit_numbers, step_path


def _slots(sizes: list[int]) -> tuple[list[FileSlot], torch.Tensor]:
    slots, at = [], 0
    for i, n in enumerate(sizes):
        slots.append(FileSlot(f"t{i}", torch.uint8, (n,), at, at + n, block_rows=4096))
        at += n
    return slots, torch.randint(0, 256, (at,), dtype=torch.uint8)


def _write(path: Path, sizes: list[int]):
    slots, data = _slots(sizes)
    with ThreadPoolExecutor(2) as pool:
        w = write_file(str(path), slots, data, hasher_pool=pool)
    raw = path.read_bytes()
    body = raw[len(stfile.header_bytes(slots)) :]
    assert body == data.numpy().tobytes() and len(raw) == w.bytes
    for s in slots:
        assert w.chunk_crc32[s.key] == block_crc32c(memoryview(body)[s.begin : s.end], 4096)
    return len(raw)


def test_writeback_is_started_for_each_range_once_as_the_file_grows(tmp_path, monkeypatch):
    calls = []
    monkeypatch.setattr(stfile, "WRITEBACK_BYTES", 64 << 10)
    monkeypatch.setattr(stfile, "_SYNC_FILE_RANGE", lambda *a: calls.append(a[1:]) or 0)
    size = _write(tmp_path / "f", [40 << 10] * 20)
    assert calls and all(flags == 2 for _, _, flags in calls)
    at = 0
    for offset, nbytes, _ in calls:  # from the start, in order, no gap, no overlap
        assert offset == at and nbytes >= 64 << 10
        at += nbytes
    assert size - at < 64 << 10  # the rest is left to the fsync


def test_a_file_system_without_sync_file_range_is_written_all_the_same(tmp_path, monkeypatch):
    calls = []
    monkeypatch.setattr(stfile, "WRITEBACK_BYTES", 64 << 10)
    monkeypatch.setattr(stfile, "_SYNC_FILE_RANGE", lambda *a: calls.append(a) or -1)
    _write(tmp_path / "f", [40 << 10] * 20)
    assert len(calls) == 1  # it failed once: not asked again


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="sync_file_range is Linux's")
def test_linux_has_sync_file_range_and_a_real_one_writes_the_same_bytes(tmp_path, monkeypatch):
    assert stfile._SYNC_FILE_RANGE is not None
    monkeypatch.setattr(stfile, "WRITEBACK_BYTES", 64 << 10)
    _write(tmp_path / "f", [100 << 10] * 8 + [1, 0, 3])


def _save(ckpt: str, step: int) -> None:
    saver = Saver(ckpt, group=None, options=SaveOptions(async_=False, keep=10))
    t = torch.arange(64, dtype=torch.float32).reshape(8, 8) + step
    saver.save(step=step, consumed_samples=step, model={"w": (t, ShardInfo.whole("w", (8, 8)))})
    saver.close()


def test_a_manifest_rewritten_in_place_is_read_again_for_its_commit_number(tmp_path):
    ckpt = str(tmp_path)
    _save(ckpt, 1)
    _save(ckpt, 2)
    assert commit_numbers(ckpt) == {1: 1, 2: 2}
    path = Path(step_path(ckpt, 2), MANIFEST)
    text = path.read_text()
    assert '"commit": 2' in text
    path.write_text(text.replace('"commit": 2', '"commit": 9'))  # same size, same path
    assert commit_numbers(ckpt) == {1: 1, 2: 0}  # read again; not sealed, so not trusted
    raw = json.loads(text)
    raw["commit"] = 9
    del raw["checksum"]
    canon = json.dumps(raw, sort_keys=True, separators=(",", ":")).encode()
    path.write_text(json.dumps({**raw, "checksum": hashlib.sha256(canon).hexdigest()}))
    assert commit_numbers(ckpt) == {1: 1, 2: 9}


def test_the_manifest_has_a_line_per_tensor_and_loads(tmp_path):
    ckpt = str(tmp_path)
    _save(ckpt, 3)
    text = Path(step_path(ckpt, 3), MANIFEST).read_text()
    assert '\n "w": {"kind": "model"' in text and '\n"step": 3,\n' in text
    assert json.loads(text)["step"] == 3
    with open_step(ckpt, 3) as ck:
        assert ck.manifest.commit == 1


def _collectives_worker(rank, world, store, out):
    import torch.distributed as dist

    group = _init(rank, world, store)
    try:
        msg = {"rank": rank, "pad": "x" * (100 * rank)}
        gathered = gather_json_to_root(msg, group, cap=512)
        with pytest.raises(ValueError):
            gather_json_to_root({"pad": "x" * 600}, group, cap=512)  # raises before sending
        short = broadcast_json_small({"from": rank}, group, cap=64)
        long = broadcast_json_small({"from": rank, "pad": "é" * 300}, group, cap=64)
        dist.barrier()  # no rank leaves while another still reads from it
    finally:
        dist.destroy_process_group()
    Path(out, f"rank-{rank}.json").write_text(
        json.dumps({"gathered": gathered, "short": short, "long": long})
    )


def test_the_gather_to_rank_0_and_the_fixed_size_broadcast(tmp_path):
    results = spawn(_collectives_worker, 3, tmp_path)
    assert results[0]["gathered"] == [{"rank": r, "pad": "x" * (100 * r)} for r in range(3)]
    assert results[1]["gathered"] is None and results[2]["gathered"] is None
    for r in results:
        assert r["short"] == {"from": 0}  # rank 0's, one collective
        assert r["long"] == {"from": 0, "pad": "é" * 300}  # rank 0's, past the cap
