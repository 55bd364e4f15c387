"""Hostile checkpoints: a manifest or header crafted to escape the step directory, hang a
reader or exhaust memory is refused in one line, before anything is opened or allocated.

The manifest's own sha256 is unkeyed, so every attack here re-seals the manifest exactly as
docs/checkpoint-format.md says (sha256 of the canonical JSON of everything but
``checksum``), and re-seals a rewritten tensor file's ``bytes`` and ``header_sha256``
too: what must stop each attack is the validation, not a checksum.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import struct
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

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


def rename_file(raw: dict, new: str) -> None:
    old = data_name(raw)
    raw["files"][new] = raw["files"].pop(old)
    for t in raw["tensors"].values():
        for s in t["shards"]:
            s["file"] = new


def rewrite_header(ckpt: str, raw: dict, edit) -> None:
    """Rewrite the tensor file's header through ``edit(header)`` and re-seal its checksums."""
    path = Path(step_path(ckpt, STEP)) / data_name(raw)
    blob = path.read_bytes()
    (n,) = struct.unpack("<Q", blob[:8])
    header = json.loads(blob[8 : 8 + n])
    edit(header)
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    head = struct.pack("<Q", len(text)) + text
    new = head + blob[8 + n :]
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
    for s in t["shards"]:
        if s["offsets"][0] == 0:
            s["sizes"][0] += grow  # the first band of rows takes the new ones
        else:
            s["offsets"][0] += grow


def overlap_and_gap(ckpt: str, raw: dict) -> None:
    # Two chunks made to cover the same region (equal element count, so only an exact
    # tiling check sees the gap the second one leaves).
    shards = raw["tensors"]["w"]["shards"]
    shards[1]["offsets"] = list(shards[0]["offsets"])
    shards[1]["sizes"] = list(shards[0]["sizes"])


def offset_below_zero(ckpt: str, raw: dict) -> None:
    def edit(header):
        key = raw["tensors"]["w"]["shards"][1]["key"]
        b, e = header[key]["data_offsets"]
        header[key]["data_offsets"] = [-8, e - b - 8]

    rewrite_header(ckpt, raw, edit)


def offset_past_the_end(ckpt: str, raw: dict) -> None:
    def edit(header):
        key = raw["tensors"]["w"]["shards"][0]["key"]
        b, e = header[key]["data_offsets"]
        header[key]["data_offsets"] = [b + (1 << 30), e + (1 << 30)]

    rewrite_header(ckpt, raw, edit)


def too_many_dimensions(ckpt: str, raw: dict) -> None:
    t = raw["tensors"]["w"]
    t["shape"] = [1] * 30 + t["shape"]
    for s in t["shards"]:
        s["offsets"] = [0] * 30 + s["offsets"]
        s["sizes"] = [1] * 30 + s["sizes"]


def bool_as_int(ckpt: str, raw: dict) -> None:
    raw["tensors"]["w"]["shards"][0]["offsets"][1] = False


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


@pytest.fixture
def ckpt(tmp_path) -> str:
    out = str(tmp_path / "ckpt")
    save(out)
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
    with pytest.raises(CheckpointError, match=says):
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
    t["shards"] = [
        {
            "file": data_name(raw),
            "key": f"w@{i}",
            "offsets": [i],
            "sizes": [1],
            "block_rows": 1,
        }
        for i in range(n)
    ]
    t["shards"][-1]["offsets"] = [0]  # an overlap at 0 and a gap at the end
    raw["tensors"].pop("optimizer/exp_avg/w")
    raw["files"][data_name(raw)]["bytes"] = 8 + 4 * n
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
    assert "'../outside.safetensors' is not a plain" in lines[0]
