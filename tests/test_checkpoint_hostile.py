"""Hostile checkpoints: a manifest or header crafted to escape the step directory, hang a
reader or exhaust memory is refused in one line, before anything is opened or allocated.

The manifest's own sha256 is unkeyed, so every attack here re-seals the manifest exactly as
docs/checkpoint-format.md says (sha256 of the canonical JSON of everything but
``checksum``), and re-seals a rewritten tensor file's ``bytes`` and ``header_sha256``
too: what must stop each attack is the validation, not a checksum. Each attack runs on
the checkpoint as this build writes it (format version 4: each written region listed once)
and as version 3 listed it (every chunk with its file and key), which still loads.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from ckpt_versions import reheadered, rewrite_as

from checkpoint import (
    Checkpoint,
    CheckpointError,
    SaveOptions,
    Saver,
    ShardInfo,
    load_latest,
    open_step,
    verify,
)
from checkpoint.store import step_path
from elasticd.cli import main

REPO = Path(__file__).resolve().parents[1]
STEP = 3
W = torch.arange(64 * 16, dtype=torch.float32).reshape(64, 16)


def save(ckpt: str) -> None:
    saver = Saver(ckpt, group=None, options=SaveOptions(async_=False, chunk_min_bytes=1024))
    saver.save(
        step=STEP,
        consumed_samples=12,
        model={"w": (W.clone(), ShardInfo.whole("w", (64, 16)))},
        optimizer={"exp_avg/w": (W * 0, ShardInfo.whole("w", (64, 16)))},
    )
    saver.close()


def manifest_path(ckpt: str) -> Path:
    return Path(step_path(ckpt, STEP)) / "manifest.json"


def reseal(ckpt: str, raw: dict) -> None:
    """Write ``raw`` as the manifest with a correct checksum, as the format doc defines it."""
    raw.pop("checksum", None)
    canon = json.dumps(raw, sort_keys=True, separators=(",", ":")).encode()
    raw["checksum"] = hashlib.sha256(canon).hexdigest()
    manifest_path(ckpt).write_text(json.dumps(raw))


def manifest(ckpt: str) -> dict:
    return json.loads(manifest_path(ckpt).read_text())


def data_name(raw: dict) -> str:
    (name,) = raw["files"]
    return name


def edit_boxes(t: dict, edit) -> None:
    """Replace the offsets and sizes of each chunk a version 3 manifest lists, or of each
    region a version 4 one does (``[rank, *offsets, *sizes, strips]``), with
    ``edit(i, offsets, sizes)``; the shape stays as it is."""
    if "regions" in t:
        rows = t["regions"]
        for i, row in enumerate(rows):
            nd = (len(row) - 2) // 2
            offsets, sizes = edit(i, row[1 : 1 + nd], row[1 + nd : 1 + 2 * nd])
            rows[i] = [row[0], *offsets, *sizes, row[-1]]
        return
    for i, s in enumerate(t["shards"]):
        s["offsets"], s["sizes"] = edit(i, s["offsets"], s["sizes"])


def rename_file(raw: dict, new: str) -> None:
    old = data_name(raw)
    raw["files"][new] = raw["files"].pop(old)
    for t in raw["tensors"].values():
        for s in t.get("shards", ()):  # version 4 names a file by its writer's rank
            s["file"] = new


def rewrite_header(ckpt: str, raw: dict, edit) -> None:
    """Rewrite the tensor file's header through ``edit(header)`` and re-seal its checksums."""
    path = Path(step_path(ckpt, STEP)) / data_name(raw)
    head, new = reheadered(path.read_bytes(), edit)
    path.write_bytes(new)
    raw["files"][data_name(raw)].update(
        bytes=len(new), header_sha256=hashlib.sha256(head).hexdigest()
    )


def outside_file(ckpt: str, raw: dict) -> None:
    src = Path(step_path(ckpt, STEP)) / data_name(raw)
    shutil.copy(src, Path(ckpt) / "outside.safetensors")
    rename_file(raw, "../outside.safetensors")


def absolute_dev_zero(ckpt: str, raw: dict) -> None:
    rename_file(raw, "/dev/zero")


def huge_shape(ckpt: str, raw: dict) -> None:
    # 2^40 rows, the chunks stretched to tile it: only the byte count can stop it.
    t = raw["tensors"]["w"]
    grow = (1 << 40) - t["shape"][0]
    t["shape"][0] = 1 << 40

    def edit(i, offsets, sizes):
        if offsets[0] == 0:
            return offsets, [sizes[0] + grow, *sizes[1:]]  # the first band of rows takes them
        return [offsets[0] + grow, *offsets[1:]], sizes

    edit_boxes(t, edit)


def overlap_and_gap(ckpt: str, raw: dict) -> None:
    # Two chunks made to cover the same region (equal element count, so only an exact
    # tiling check sees the gap the second one leaves).
    t = raw["tensors"]["w"]
    if "regions" in t:  # its one region made two halves, the second a quarter too high
        ((rank, o0, o1, s0, s1, n),) = t["regions"]
        t["regions"] = [[rank, o0, o1, s0 // 2, s1, n], [rank, o0 + s0 // 4, o1, s0 // 2, s1, n]]
        return
    shards = t["shards"]
    shards[1]["offsets"] = list(shards[0]["offsets"])
    shards[1]["sizes"] = list(shards[0]["sizes"])


def w_keys(header: dict) -> list[str]:
    return sorted(k for k in header if k.startswith("w@"))


def offset_below_zero(ckpt: str, raw: dict) -> None:
    def edit(header):
        key = w_keys(header)[1]
        b, e = header[key]["data_offsets"]
        header[key]["data_offsets"] = [-8, e - b - 8]

    rewrite_header(ckpt, raw, edit)


def offset_past_the_end(ckpt: str, raw: dict) -> None:
    def edit(header):
        key = w_keys(header)[0]
        b, e = header[key]["data_offsets"]
        header[key]["data_offsets"] = [b + (1 << 30), e + (1 << 30)]

    rewrite_header(ckpt, raw, edit)


def too_many_dimensions(ckpt: str, raw: dict) -> None:
    t = raw["tensors"]["w"]
    edit_boxes(t, lambda i, offsets, sizes: ([0] * 30 + offsets, [1] * 30 + sizes))
    t["shape"] = [1] * 30 + t["shape"]


def bool_as_int(ckpt: str, raw: dict) -> None:
    edit_boxes(raw["tensors"]["w"], lambda i, o, z: ([o[0], False, *o[2:]] if i == 0 else o, z))


ATTACKS = {
    "a ../ file name": (outside_file, "not a plain"),
    "an absolute /dev/zero file name": (absolute_dev_zero, "not a plain"),
    "a 2^40-row shape": (huge_shape, "more than the"),
    "overlapping chunks with a gap": (overlap_and_gap, "overlap and leave a gap"),
    "a data offset below zero": (offset_below_zero, "data_offsets"),
    "a data offset past the end": (offset_past_the_end, "data_offsets"),
    "thirty-two dimensions": (too_many_dimensions, "at most 8"),
    "a boolean offset": (bool_as_int, "not an integer"),
}


@pytest.fixture(params=[4, 3], ids=["v4", "v3"])
def ckpt(tmp_path, request) -> str:
    out = str(tmp_path / "ckpt")
    save(out)
    if request.param == 3:
        rewrite_as(step_path(out, STEP), 3)
    return out


def attacked(ckpt: str, attack) -> None:
    raw = manifest(ckpt)
    attack(ckpt, raw)
    reseal(ckpt, raw)


def cli(capsys, *argv):
    code = main(["ckpt", *argv])
    out, err = capsys.readouterr()
    return code, out, err


@pytest.mark.parametrize("name", list(ATTACKS))
def test_each_attack_is_refused_in_one_line_by_verify_inspect_export_and_a_load(
    name, ckpt, tmp_path, capsys
):
    attack, says = ATTACKS[name]
    attacked(ckpt, attack)
    refused_everywhere(ckpt, says, tmp_path, capsys)


def region(raw: dict) -> list:
    """The one region of tensor w: ``[rank, row, column, rows, columns, strips]``."""
    (row,) = raw["tensors"]["w"]["regions"]
    return row


# Version 4 lists regions, not chunks: attacks on what a region row says.
V4_ATTACKS = {
    "a region in an unlisted rank's file": (
        lambda raw: region(raw).__setitem__(0, 7),
        "rank-00007.safetensors, a file the manifest does not list",
    ),
    "no strips": (lambda raw: region(raw).__setitem__(-1, 0), "strips, not an integer from 1"),
    "more strips than columns": (
        lambda raw: region(raw).__setitem__(-1, 17),
        "17 strips, not an integer from 1 to 16",
    ),
    "a boolean strip count": (
        lambda raw: region(raw).__setitem__(-1, True),
        "strips, not an integer from 1",
    ),
    "a region row one too long": (
        lambda raw: region(raw).append(0),
        "is not [rank, 2 offsets, 2 sizes, strips]",
    ),
    "a list for an offset": (lambda raw: region(raw).__setitem__(1, [0]), "not an integer"),
    "negative block bytes": (
        lambda raw: raw["tensors"]["w"].update(block_bytes=-1),
        "block_bytes: -1 is not an integer",
    ),
    "the same region twice": (
        lambda raw: raw["tensors"]["w"]["regions"].append(list(region(raw))),
        "shards overlap",
    ),
    # It holds no element, so the tiling check cannot see it; its key is the first strip's.
    "an empty region at the offsets of a strip in the same file": (
        lambda raw: raw["tensors"]["w"]["regions"].append([region(raw)[0], 0, 0, 0, 16, 1]),
        "is not a new string",
    ),
}


@pytest.mark.parametrize("name", list(V4_ATTACKS))
def test_each_attack_on_a_region_row_is_refused_in_one_line(name, tmp_path, capsys):
    ckpt = str(tmp_path / "ckpt")
    save(ckpt)
    attack, says = V4_ATTACKS[name]
    attacked(ckpt, lambda _ckpt, raw: attack(raw))
    refused_everywhere(ckpt, says, tmp_path, capsys)


def test_more_chunks_than_a_manifest_may_hold_are_refused_before_any_is_made(tmp_path, monkeypatch):
    """A region stands for up to 64 strips: the chunks are counted (and bounded) from the
    rows before a single one is made, so a manifest cannot make a load build millions."""
    import checkpoint.manifest as manifest_mod

    ckpt = str(tmp_path / "ckpt")
    save(ckpt)
    raw = manifest(ckpt)
    rank = region(raw)[0]
    raw["tensors"]["w"]["regions"] = [[rank, 0, 0, 32, 16, 16], [rank, 32, 0, 32, 16, 16]]
    reseal(ckpt, raw)
    assert len(Checkpoint.open(step_path(ckpt, STEP)).manifest.tensors["w"].chunks) == 32
    monkeypatch.setattr(manifest_mod, "MAX_CHUNKS", 31 + 4)  # + exp_avg/w's 4 strips
    made = []
    real = manifest_mod.SavedChunk
    monkeypatch.setattr(manifest_mod, "SavedChunk", lambda **kw: made.append(1) or real(**kw))
    with pytest.raises(CheckpointError, match="36 chunks, more than 35"):
        Checkpoint.open(step_path(ckpt, STEP))
    assert made == []


def refused_everywhere(ckpt: str, says: str, tmp_path: Path, capsys) -> None:
    """`ckpt verify`, `inspect` and `export` each refuse ``ckpt`` in one line saying
    ``says`` (exit 2), and a load raises it with nothing read into the model."""
    for argv in (
        ["verify", ckpt],
        ["inspect", ckpt],
        ["export", ckpt, str(tmp_path / "hf")],
    ):
        code, _, err = cli(capsys, *argv)
        lines = err.strip().splitlines()
        assert code == 2 and len(lines) == 1 and says in lines[0], (argv, err)
    assert not (tmp_path / "hf" / "model.safetensors").exists()
    model = {"w": (torch.full((64, 16), float("nan")), ShardInfo.whole("w", (64, 16)))}
    with pytest.raises(CheckpointError, match=re.escape(says)):
        load_latest(ckpt, model=model)
    assert torch.isnan(model["w"][0]).all()  # nothing was read from anywhere


def test_the_sound_checkpoint_of_these_tests_passes_everything(ckpt, tmp_path, capsys):
    # The attacks above start from this checkpoint, and re-sealing alone changes nothing.
    attacked(ckpt, lambda c, raw: None)
    assert verify(open_step(ckpt)) == []
    for argv in (["verify", ckpt], ["inspect", ckpt], ["export", ckpt, str(tmp_path / "hf")]):
        assert cli(capsys, *argv)[0] == 0
    model = {"w": (torch.zeros(64, 16), ShardInfo.whole("w", (64, 16)))}
    load_latest(ckpt, model=model)
    assert torch.equal(model["w"][0], W)


@pytest.mark.timeout(60)  # a blocking open or an endless read would fail here, not hang
def test_a_symlink_or_fifo_in_place_of_a_file_or_the_manifest_is_refused_without_hanging(
    ckpt, capsys
):
    step = Path(step_path(ckpt, STEP))
    data = next(step.glob("*.safetensors"))
    data.unlink()
    data.symlink_to("/dev/zero")
    for argv in (("verify", ckpt), ("inspect", ckpt)):
        code, _, err = cli(capsys, *argv)
        assert code == 2 and "symlink" in err and len(err.strip().splitlines()) == 1, err
    data.unlink()
    os.mkfifo(data)  # an open for reading would block until a writer came
    for argv in (("verify", ckpt), ("export", ckpt, str(Path(ckpt) / "hf"))):
        code, _, err = cli(capsys, *argv)
        assert code == 2 and "not a regular file" in err and len(err.strip().splitlines()) == 1
    with pytest.raises(CheckpointError, match="not a regular file"):
        load_latest(ckpt, model={"w": (torch.zeros(64, 16), ShardInfo.whole("w", (64, 16)))})
    (step / "manifest.json").unlink()
    (step / "manifest.json").symlink_to("/dev/zero")
    code, _, err = cli(capsys, "inspect", ckpt)
    assert code == 2 and "symlink" in err and len(err.strip().splitlines()) == 1, err


def test_a_manifest_of_65536_chunks_is_checked_in_linear_time(ckpt):
    # A pairwise overlap check would make 2^31 comparisons; this is refused in a second.
    raw = manifest(ckpt)
    t = raw["tensors"]["w"]
    n = 1 << 16
    t["shape"] = [n]
    if "regions" in t:
        t["regions"] = [[0, i, 1, 1] for i in range(n)]
        # An overlap at 0 and a gap at the end; the key w@0 is new in another rank's file.
        t["regions"][-1] = [1, 0, 1, 1]
        raw["files"]["rank-00001.safetensors"] = dict(raw["files"][data_name(raw)], rank=1)
    else:
        t["shards"] = [
            {"file": data_name(raw), "key": f"w@{i}", "offsets": [i], "sizes": [1],
             "block_rows": 1, "crc32c": "00000000"}
            for i in range(n)
        ]  # fmt: skip
        t["shards"][-1]["offsets"] = [0]  # an overlap at 0 and a gap at the end
    raw["tensors"].pop("optimizer/exp_avg/w")
    for f in raw["files"].values():
        f["bytes"] = 8 + 4 * n
    reseal(ckpt, raw)
    # CPU seconds, not wall: a loaded CI box stretches the wall clock (27 s seen), never
    # the work. Linear is well under a second; pairwise would be hours, not a near miss.
    t0 = time.process_time()
    with pytest.raises(CheckpointError, match="overlap and leave a gap"):
        Checkpoint.open(step_path(ckpt, STEP))
    assert time.process_time() - t0 < 10


def resume(tmp_path: Path, steps: int) -> subprocess.CompletedProcess:
    env = dict(os.environ, OMP_NUM_THREADS="1")
    args = [sys.executable, "-m", "trainer", str(REPO / "examples" / "tiny.yaml"),
            "--set", f"output_dir={tmp_path / 'out'}", "--set", f"train.steps={steps}"]  # fmt: skip
    return subprocess.run(args, env=env, capture_output=True, text=True, timeout=180,
                          cwd=tmp_path)  # fmt: skip


@pytest.mark.slow  # two trainer processes: about 30 s on the 2-core machine
def test_a_trainer_refuses_to_resume_from_a_manifest_naming_a_file_outside_its_step(tmp_path):
    first = resume(tmp_path, 2)
    assert first.returncode == 0, first.stderr[-2000:]
    ckpt = str(tmp_path / "out" / "ckpt")
    raw = json.loads((Path(step_path(ckpt, 2)) / "manifest.json").read_text())
    name = data_name(raw)
    shutil.copy(Path(step_path(ckpt, 2)) / name, Path(ckpt) / "outside.safetensors")
    rename_file(raw, "../outside.safetensors")
    raw.pop("checksum")
    canon = json.dumps(raw, sort_keys=True, separators=(",", ":")).encode()
    raw["checksum"] = hashlib.sha256(canon).hexdigest()
    (Path(step_path(ckpt, 2)) / "manifest.json").write_text(json.dumps(raw))
    proc = resume(tmp_path, 4)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("trainer: error: "), lines
    assert "file name ../outside.safetensors is not a plain" in lines[0]


def test_empty_rows_of_many_rows_save_load_and_verify(tmp_path):
    """A tensor whose rows hold no bytes ((20000, 0), (40000, 3, 0)) is one empty block per
    chunk, on the writer's side and the reader's (verify, inspect and export counted more
    blocks than the writer checksummed)."""
    ckpt = str(tmp_path / "ckpt")
    saver = Saver(ckpt, group=None, options=SaveOptions(async_=False))
    model = {
        "a": (torch.empty(20000, 0), ShardInfo.whole("a", (20000, 0))),
        "b": (torch.empty(40000, 3, 0), ShardInfo.whole("b", (40000, 3, 0))),
        "w": (W.clone(), ShardInfo.whole("w", (64, 16))),
    }
    saver.save(step=STEP, consumed_samples=1, model=model)
    saver.close()
    assert verify(open_step(ckpt)) == []
    with Checkpoint.open(step_path(ckpt, STEP)) as ck:
        ck.check_files()
        assert ck.read("b").shape == (40000, 3, 0) and torch.equal(ck.read("w"), W)


def test_verify_names_a_header_entry_unlike_the_manifests_chunk_without_a_traceback(
    tmp_path, capsys
):
    """The manifest gives a chunk no bytes (sizes [4, 0]); the re-sealed header gives that
    key 16 real bytes: verify says so in one line (it divided by its zero block size)."""
    ckpt = str(tmp_path / "ckpt")
    saver = Saver(ckpt, group=None, options=SaveOptions(async_=False))
    saver.save(step=STEP, consumed_samples=1,
               model={"e": (torch.ones(4, 1), ShardInfo.whole("e", (4, 1)))})  # fmt: skip
    saver.close()
    raw = manifest(ckpt)
    raw["tensors"]["e"]["shape"] = [4, 0]
    raw["tensors"]["e"]["regions"] = [[0, 0, 0, 4, 0, 1]]
    rewrite_header(ckpt, raw, lambda h: h["e@0_0"].update(shape=[4]))
    reseal(ckpt, raw)
    code, _, err = cli(capsys, "verify", ckpt)
    assert code == 2 and len(err.strip().splitlines()) == 1, err
    assert "missing or has the wrong dtype/shape" in err and "Traceback" not in err, err
