"""`elasticd ckpt ls|inspect|verify|export|prune` on real checkpoint directories."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import torch
from safetensors.torch import load_file

from checkpoint import SaveOptions, Saver, ShardInfo
from checkpoint.store import step_path
from elasticd.cli import main

W = torch.arange(48 * 8, dtype=torch.float32).reshape(48, 8)
B = torch.linspace(0, 1, 8)


def save_steps(ckpt: str, steps) -> None:
    saver = Saver(ckpt, group=None, options=SaveOptions(async_=False, chunk_min_bytes=64))
    for step in steps:
        model = {
            "w": (W + step, ShardInfo.whole("w", (48, 8))),
            "b": (B, ShardInfo.whole("b", (8,))),
        }
        saver.save(
            step=step,
            consumed_samples=step * 4,
            model=model,
            optimizer={"exp_avg/w": (W * 0, ShardInfo.whole("w", (48, 8)))},
            layout={"world": 1, "tp": 1},
        )
    saver.close()


def run(capsys, *argv):
    code = main(["ckpt", *argv])
    out, err = capsys.readouterr()
    return code, out, err


def test_ls_lists_committed_steps_with_sizes_and_marks_latest(tmp_path, capsys):
    save_steps(str(tmp_path), [2, 4])
    code, out, _ = run(capsys, "ls", str(tmp_path))
    lines = out.strip().splitlines()
    assert code == 0 and len(lines) == 3
    assert lines[1].split()[0] == "2" and "latest" not in lines[1]
    assert lines[2].split()[0] == "4" and lines[2].endswith("latest")
    code, out, _ = run(capsys, "ls", str(tmp_path), "--json")
    assert json.loads(out)["latest"] == 4


def test_inspect_shows_tensors_shapes_layout_and_sizes(tmp_path, capsys):
    save_steps(str(tmp_path), [2, 4])
    code, out, _ = run(capsys, "inspect", str(tmp_path), "--step", "2")
    assert code == 0 and "step 2" in out and "layout at save: world 1" in out and " tp1" in out
    assert max(len(line) for line in out.splitlines()) <= 120  # no JSON blobs on one line
    assert any(line.split()[-1] == "w" and "48x8" in line for line in out.splitlines())
    code, out, _ = run(capsys, "inspect", str(tmp_path), "--json")
    info = json.loads(out)
    assert info["step"] == 4 and info["tensors"]["optimizer/exp_avg/w"]["kind"] == "optimizer"
    assert info["commit"] == 2 and info["writer"] is None  # unfenced: no round to name
    assert info["format_version"] == 4
    code, out, _ = run(capsys, "inspect", str(tmp_path))
    assert code == 0 and "files  format version 4" in out


def test_inspect_names_the_round_that_wrote_a_fenced_commit(tmp_path, capsys):
    from checkpoint import Fence

    fence = Fence(run_id="tiny-0a1b2c3d", round=3)
    saver = Saver(str(tmp_path), group=None, options=SaveOptions(async_=False, fence=fence))
    saver.save(step=5, consumed_samples=5, model={"b": (B, ShardInfo.whole("b", (8,)))})
    saver.close()
    code, out, _ = run(capsys, "inspect", str(tmp_path))
    assert code == 0 and "commit 1  written by round 3 of run tiny-0a1b2c3d" in out
    code, out, _ = run(capsys, "inspect", str(tmp_path), "--json")
    assert json.loads(out)["writer"] == {"run_id": "tiny-0a1b2c3d", "round": 3}


def test_verify_passes_a_sound_checkpoint_and_names_a_corrupted_file_with_exit_2(tmp_path, capsys):
    save_steps(str(tmp_path), [2])
    code, out, _ = run(capsys, "verify", str(tmp_path))
    assert code == 0 and "ok" in out
    data = next(Path(step_path(str(tmp_path), 2)).glob("*.safetensors"))
    raw = bytearray(data.read_bytes())
    raw[-5] ^= 0xFF
    data.write_bytes(bytes(raw))
    code, _, err = run(capsys, "verify", str(tmp_path))
    assert code == 2 and str(data) in err and "problem" in err.splitlines()[-1]


NO_TORCH = """
import atexit, runpy, sys
atexit.register(lambda: print("torch imported" if "torch" in sys.modules else "no torch",
                              file=sys.stderr))
sys.argv = ["elasticd", *sys.argv[1:]]
runpy.run_module("elasticd", run_name="__main__", alter_sys=True)
"""


def test_ls_inspect_and_verify_run_without_importing_torch(tmp_path, capsys):
    """A health check or a script pays for the command, not for a torch import (a second
    of the 1.6 s an ``inspect`` took): ls, inspect and verify check and show a checkpoint
    with the same output as ever, bad news included, and never import torch; export,
    which reads tensors, does."""
    save_steps(str(tmp_path), [2, 4])
    bf16 = tmp_path / "bf16"
    saver = Saver(str(bf16), group=None, options=SaveOptions(async_=False))
    half = torch.linspace(-1, 1, 12, dtype=torch.bfloat16).reshape(3, 4)
    saver.save(step=1, consumed_samples=1, model={"h": (half, ShardInfo.whole("h", (3, 4)))})
    saver.close()

    def alone(*argv):
        proc = subprocess.run(
            [sys.executable, "-c", NO_TORCH, "ckpt", *argv],
            capture_output=True, text=True, timeout=120, stdin=subprocess.DEVNULL,
        )  # fmt: skip
        *err, imported = proc.stderr.strip().splitlines()
        return proc.returncode, proc.stdout, "\n".join(err), imported

    for argv in (
        ["ls", str(tmp_path)],
        ["ls", str(tmp_path), "--json"],
        ["inspect", str(tmp_path), "--step", "2"],
        ["inspect", str(tmp_path), "--json"],
        ["inspect", str(bf16)],
        ["verify", str(tmp_path)],
        ["verify", str(bf16)],
    ):
        code, out, err, imported = alone(*argv)
        assert (code, err, imported) == (0, "", "no torch"), (argv, err)
        assert (code, out) == run(capsys, *argv)[:2], argv
    assert "bfloat16  3x4" in alone("inspect", str(bf16))[1]
    data = next(Path(step_path(str(tmp_path), 4)).glob("*.safetensors"))
    raw = bytearray(data.read_bytes())
    raw[-5] ^= 0xFF
    data.write_bytes(bytes(raw))
    code, out, err, imported = alone("verify", str(tmp_path))
    assert (code, imported) == (2, "no torch") and len(err.splitlines()) == 1, err
    assert str(data) in err and "checksum mismatch" in err
    code, _, err, imported = alone("export", str(bf16), str(tmp_path / "out"))
    assert (code, imported) == (0, "torch imported"), err
    assert torch.equal(load_file(str(tmp_path / "out" / "model.safetensors"))["h"], half)


def test_export_writes_consolidated_safetensors_that_plain_load_file_reads(tmp_path, capsys):
    save_steps(str(tmp_path / "ckpt"), [3])
    out_dir = tmp_path / "hf"
    code, _, _ = run(capsys, "export", str(tmp_path / "ckpt"), str(out_dir))
    assert code == 0
    weights = load_file(str(out_dir / "model.safetensors"))
    assert set(weights) == {"w", "b"}
    assert torch.equal(weights["w"], W + 3) and torch.equal(weights["b"], B)
    # Above the size limit: several files plus the index Hugging Face loaders follow.
    code, _, _ = run(
        capsys, "export", str(tmp_path / "ckpt"), str(tmp_path / "split"), "--max-file-size", "100B"
    )
    index = json.loads((tmp_path / "split" / "model.safetensors.index.json").read_text())
    assert code == 0 and set(index["weight_map"]) == {"w", "b"}
    for name, fname in index["weight_map"].items():
        assert torch.equal(load_file(str(tmp_path / "split" / fname))[name], weights[name])
    # Onto a file: named in one line, before anything is read (was a bare "[Errno 17]").
    (tmp_path / "a-file").write_text("mine")
    for fmt in ("raw", "hf"):
        code, _, err = run(capsys, "export", str(tmp_path / "ckpt"), str(tmp_path / "a-file"),
                           "--format", fmt)  # fmt: skip
        assert code == 2 and err.strip().endswith("a-file exists and is not a directory"), err
    assert (tmp_path / "a-file").read_text() == "mine"


def test_prune_keeps_the_newest_n(tmp_path, capsys):
    save_steps(str(tmp_path), [1, 2, 3])
    code, out, _ = run(capsys, "prune", str(tmp_path), "--keep", "1")
    assert code == 0 and "1, 2" in out
    assert sorted(n for n in os.listdir(tmp_path) if n.startswith("step-")) == ["step-000000003"]


def test_user_errors_are_one_line_with_exit_2(tmp_path, capsys):
    for argv in (
        ["ls", str(tmp_path / "nope")],
        ["inspect", str(tmp_path)],
        ["prune", str(tmp_path), "--keep", "0"],
        ["export", str(tmp_path), str(tmp_path / "o"), "--max-file-size", "lots"],
    ):
        code, _, err = run(capsys, *argv)
        assert code == 2 and len(err.strip().splitlines()) == 1, (argv, err)


def test_ls_of_a_jobs_output_dir_points_to_its_ckpt_dir(tmp_path, capsys):
    save_steps(str(tmp_path / "ckpt"), [2])
    code, out, _ = run(capsys, "ls", str(tmp_path))
    assert code == 0
    assert out.strip() == (
        f"{tmp_path}: no committed checkpoints (a job's output dir? its checkpoints: "
        f"elasticd ckpt ls {tmp_path / 'ckpt'})"
    )
    # verify, inspect and export say it too, in their one line (a newcomer's walk).
    for argv in (["verify", str(tmp_path)], ["inspect", str(tmp_path)],
                 ["export", str(tmp_path), str(tmp_path / "out")]):  # fmt: skip
        code, _, err = run(capsys, *argv)
        assert code == 2 and len(err.strip().splitlines()) == 1, err
        assert err.strip().endswith(f"(a job's output dir? its checkpoints: {tmp_path / 'ckpt'})")


def test_inspect_shows_the_optimizer_one_line_per_parameter_group():
    from elasticd.cli.ckpt import _optimizer_lines

    lines = _optimizer_lines({"type": "AdamW", "param_groups": [
        {"lr": 0.001, "betas": [0.9, 0.95], "eps": 1e-8, "weight_decay": 0.1, "foreach": True,
         "params": list(range(40))},
        {"lr": 0.001, "weight_decay": 0.0, "params": [40, 41]},
    ]})  # fmt: skip
    assert lines == [
        "optimizer: AdamW",
        "  group 0: lr 0.001  betas [0.9, 0.95]  eps 1e-08  weight_decay 0.1  (40 params)",
        "  group 1: lr 0.001  weight_decay 0.0  (2 params)",
    ]


def test_a_stray_manifest_json_in_a_checkpoint_directory_does_not_make_it_a_step(tmp_path, capsys):
    """Only a directory named as a step (step-NNNNNNNNN) is taken for one: a manifest.json
    copied into the checkpoint directory made `verify DIR` say "not a committed checkpoint
    directory" and `--step 2` say it cannot be used with a step directory."""
    ckpt = tmp_path / "ckpt"
    save_steps(str(ckpt), [2, 4])
    (ckpt / "manifest.json").write_bytes(
        Path(step_path(str(ckpt), 4), "manifest.json").read_bytes()
    )
    code, out, err = run(capsys, "verify", str(ckpt))
    assert code == 0 and out.startswith(f"{step_path(str(ckpt), 4)}: ok"), err
    code, out, err = run(capsys, "verify", str(ckpt), "--step", "2")
    assert code == 0 and out.startswith(f"{step_path(str(ckpt), 2)}: ok"), err
    # A step directory itself still is one, by its name.
    code, out, _ = run(capsys, "inspect", step_path(str(ckpt), 2) + "/")
    assert code == 0 and out.startswith("step 2 "), out
    code, _, err = run(capsys, "verify", step_path(str(ckpt), 2), "--step", "2")
    assert code == 2 and err.strip().endswith("--step cannot be used with a step directory")


def test_output_is_one_line_on_a_stdout_that_is_not_utf_8(tmp_path):
    """Names from a checkpoint (and the directory's own) printed to an ASCII stdout
    (PYTHONIOENCODING=ascii): `ls` died with UnicodeEncodeError on the message of a step
    whose manifest names a tensor in non-ASCII characters."""
    ckpt = tmp_path / "prüfung"
    save_steps(str(ckpt), [2, 4])
    path = Path(step_path(str(ckpt), 2), "manifest.json")
    raw = json.loads(path.read_text())
    raw["tensors"]["décodeur€"] = {**raw["tensors"].pop("b"), "dtype": "float128"}
    raw.pop("checksum")
    canon = json.dumps(raw, sort_keys=True, separators=(",", ":")).encode()
    path.write_text(json.dumps({**raw, "checksum": hashlib.sha256(canon).hexdigest()}))
    env = dict(os.environ, PYTHONIOENCODING="ascii", OMP_NUM_THREADS="1")
    outs = []
    for argv in (["ls", str(ckpt)], ["verify", str(ckpt), "--step", "4"],
                 ["export", str(ckpt), str(tmp_path / "ausgabe-ü")]):  # fmt: skip
        p = subprocess.run([sys.executable, "-m", "elasticd", "ckpt", *argv], env=env,
                           capture_output=True, text=True, timeout=120)  # fmt: skip
        assert p.returncode == 0 and p.stderr == "", (argv, p.stderr[-2000:])
        assert "\\xfc" in p.stdout, p.stdout  # the directory's name, escaped
        outs.append(p.stdout)
    (row,) = [line for line in outs[0].splitlines() if line.split()[0] == "2"]
    assert "unreadable: " in row and "d\\xe9codeur\\u20ac" in row, row


def test_max_file_size_must_be_a_finite_size_above_zero(tmp_path, capsys):
    """`inf` (or 1e400GB) was a traceback (OverflowError, which argparse does not catch);
    `-1GB` and `0` exported one tensor per file."""
    save_steps(str(tmp_path / "ckpt"), [3])
    for size in ("inf", "1e400GB", "-1GB", "0", "0.5B", "nan"):
        code, _, err = run(capsys, "export", str(tmp_path / "ckpt"), str(tmp_path / "out"),
                           f"--max-file-size={size}")  # fmt: skip
        assert code == 2 and len(err.strip().splitlines()) == 1, (size, err)
        assert f"argument --max-file-size: not a size: '{size}'" in err, err
        assert not (tmp_path / "out").exists()


def test_verify_fails_when_the_newest_commit_cannot_be_opened(tmp_path, capsys):
    """A load passes over a step whose manifest was overwritten, so the default step to
    verify was the older one and `verify` said ok: a health check missed the damage."""
    save_steps(str(tmp_path), [2, 4])
    Path(step_path(str(tmp_path), 4), "manifest.json").write_text("{garbage")
    code, out, err = run(capsys, "verify", str(tmp_path))
    assert code == 2 and "ok" not in out
    assert len(err.strip().splitlines()) == 1
    assert "step 4, newer than the step a load takes, cannot be opened" in err
    code, out, _ = run(capsys, "verify", str(tmp_path), "--step", "2")  # asked by name
    assert code == 0 and "ok" in out
