"""Hostile input on the trainer's side of checkpoints: what a resume restores besides tensors
(RNG states, step, optimizer hyperparameters), a Hugging Face directory given to
``model.init_from: hf:DIR``, and a checkpoint's ``extra.model`` given to ``ckpt export
--format hf``. Each is refused in one line (``trainer: error: ...``, exit code 2, or one
``TrainerConfigError``), without a traceback or a hang. One real trainer run (examples/tiny.yaml,
2 steps) makes the checkpoint every case edits; each manifest is re-sealed."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import struct
import subprocess
import time
from pathlib import Path

import pytest
from ckpt_versions import listing
from safetensors.torch import load_file, save_file

from checkpoint import Checkpoint
from checkpoint.manifest import Manifest
from checkpoint.store import step_path
from trainer.__main__ import main as trainer_main
from trainer.errors import TrainerConfigError
from trainer.hf import export_hf

REPO = Path(__file__).resolve().parent.parent
TINY = REPO / "examples" / "tiny.yaml"
ENV = {"RANK": "0", "WORLD_SIZE": "1"}


def run(out: Path, steps: int, *extra: str) -> int:
    args = [str(TINY), "--set", f"output_dir={out}", "--set", f"train.steps={steps}"]
    for o in extra:
        args += ["--set", o]
    return trainer_main(args, env=ENV)


@pytest.fixture(scope="module")
def base(tmp_path_factory) -> Path:
    """The output directory of a 2-step tiny run (its checkpoint at step 2)."""
    out = tmp_path_factory.mktemp("base") / "out"
    assert run(out, 2) == 0
    return out


def manifest_path(ckpt: Path) -> Path:
    return Path(step_path(str(ckpt), 2)) / "manifest.json"


def reseal(ckpt: Path, raw: dict) -> None:
    raw.pop("checksum", None)
    canon = json.dumps(raw, sort_keys=True, separators=(",", ":")).encode()
    raw["checksum"] = hashlib.sha256(canon).hexdigest()
    manifest_path(ckpt).write_text(json.dumps(raw))


def edited(base: Path, tmp_path: Path, edit) -> Path:
    out = tmp_path / "out"
    shutil.copytree(base, out)
    raw = json.loads(manifest_path(out / "ckpt").read_text())
    edit(raw)
    reseal(out / "ckpt", raw)
    return out


def one_error_line(capsys) -> str:
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith("trainer: error: "), err
    assert "Traceback" not in err
    return err


def groups(**kw):
    def edit(raw):
        for g in raw["optimizer"]["param_groups"]:
            g.update(kw)

    return edit


def _rng_missing(raw):
    del raw["tensors"]["rank/0/rng/cpu"]


def _rng_empty(raw):
    raw["tensors"]["rank/0/rng/cpu"] = {"kind": "rank", "dtype": "uint8", "shape": [0],
                                        **listing(raw)}  # fmt: skip


def _step_huge(raw):
    raw["step"] = (1 << 62) + 5  # below the manifest's own 2^63 bound
    raw["layout"] = None  # a changed layout: the step would seed the generator


def _samples_huge(raw):
    raw["consumed_samples"] = (1 << 62) + 5  # below the manifest's own 2^63 bound


def _step_not_its_directory(raw):
    raw["step"] = 1


def _train_lr(raw):
    raw["extra"]["train_lr"] = "fast"


RESUME_ATTACKS = {
    "rng-missing": (_rng_missing, "has no rng/cpu"),
    "rng-empty": (_rng_empty, "torch's generator needs uint8 [5056]"),
    # No step directory names a step past 10^9: refused when the step is opened.
    "step-2^62": (_step_huge, "is not the step of its directory"),
    "samples-2^62": (_samples_huge, "consumed_samples 4611686018427387909 is not an integer"),
    "step-not-its-directory": (_step_not_its_directory, "is not the step of its directory"),
    "betas-strings": (groups(betas=["a", "b"]), "betas ['a', 'b'] is not two numbers"),
    "betas-one": (groups(betas=[0.9]), "betas [0.9] is not two numbers"),
    "betas-one-or-more": (groups(betas=[0.9, 1.0]), "is not two numbers in [0, 1)"),
    "eps-negative": (groups(eps=-1.0), "eps -1.0 is not a finite number >= 0"),
    "weight-decay-string": (groups(weight_decay="x"), "weight_decay 'x' is not a finite"),
    "amsgrad-true": (groups(amsgrad=True), "amsgrad True differs from this run's False"),
    "maximize-true": (groups(maximize=True), "maximize True differs from this run's False"),
    "foreach-string": (groups(foreach="yes"), "foreach 'yes' is not a boolean or null"),
    "groups-not-a-list": (
        lambda raw: raw["optimizer"].update(param_groups={"lr": 1}),
        "is not a list of groups",
    ),
    "train-lr-string": (_train_lr, "extra train_lr 'fast' is not a finite number"),
    # An integer too large for a float (math.isfinite raised OverflowError).
    "lr-of-400-digits": (groups(lr=10**400), "is not a finite number >= 0"),
    "betas-of-400-digits": (groups(betas=[10**400, 0.9]), "is not two numbers in [0, 1)"),
}


@pytest.mark.parametrize("attack", list(RESUME_ATTACKS))
def test_a_resume_refuses_hostile_rng_step_or_hyperparameters_in_one_line(
    base, tmp_path, capsys, attack
):
    edit, message = RESUME_ATTACKS[attack]
    out = edited(base, tmp_path, edit)
    capsys.readouterr()
    assert run(out, 3) == 2
    err = one_error_line(capsys)
    assert message in err and "step-000000002" in err, err
    assert not (Path(step_path(str(out / "ckpt"), 3))).exists()  # nothing trained on


def test_a_resume_refuses_an_rng_state_torch_refuses_on_every_rank_before_training(
    base, tmp_path, capsys
):
    """The right size and dtype, correctly checksummed, but all zeros: torch's generator
    refuses such a state. It is now tried on a generator of its own among the checks
    before the ranks agree (the message says which check refused it); before, it passed
    them and failed later, when the state was set, on its rank alone. One process here:
    that the agreement then stops every rank is not exercised by this test."""
    out = tmp_path / "out"
    shutil.copytree(base, out)
    zero_rng_state(out / "ckpt", rank=0)
    capsys.readouterr()
    assert run(out, 3) == 2
    err = one_error_line(capsys)
    assert "rng/cpu is refused by torch's generator" in err and "step-000000002" in err, err
    assert not (Path(step_path(str(out / "ckpt"), 3))).exists()


def zero_rng_state(ckpt: Path, *, rank: int) -> None:
    """Set ``rank``'s saved CPU RNG state to zeros at step 2, its checksums (in the file's
    header) and the manifest re-sealed: a well-formed state that torch's generator refuses."""
    from checkpoint.stfile import CRC_META, block_crc32c

    raw = json.loads(manifest_path(ckpt).read_text())
    entry = Manifest.from_json(manifest_path(ckpt).read_bytes(), where="m").tensors
    entry = entry[f"rank/{rank}/rng/cpu"]
    (chunk,) = entry.chunks
    path = Path(step_path(str(ckpt), 2)) / chunk.file
    data = bytearray(path.read_bytes())
    (n,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8 : 8 + n])
    begin, end = header[chunk.key]["data_offsets"]
    data[8 + n + begin : 8 + n + end] = bytes(end - begin)
    old = header["__metadata__"][CRC_META + chunk.key]
    new = block_crc32c(bytes(end - begin), entry.rows_per_block(chunk))  # 1 byte a row
    entry = json.dumps({CRC_META + chunk.key: old}, separators=(",", ":"))[1:-1]
    assert data[8 : 8 + n].count(entry.encode()) == 1
    text = data[8 : 8 + n].replace(entry.encode(), entry.replace(old, new).encode())
    assert len(text) == n and json.loads(text)["__metadata__"][CRC_META + chunk.key] == new
    data[8 : 8 + n] = text
    path.write_bytes(bytes(data))
    raw["files"][chunk.file]["header_sha256"] = hashlib.sha256(bytes(data[: 8 + n])).hexdigest()
    reseal(ckpt, raw)


def test_an_rng_state_torch_refuses_on_one_rank_stops_every_rank_in_one_line(tmp_path):
    """Two ranks (dp2): only rank 1's saved RNG state is refused by torch. The check runs
    before the ranks agree, so rank 0, whose own state is fine, stops too, at once and in
    one line, instead of training on or waiting in a collective for its timeout."""
    import sys

    from elasticd.etcd import reserve_port

    out = tmp_path / "out"

    def ranks(steps: int) -> list[tuple[int, str]]:
        hold = reserve_port()  # held until both ranks ended: rank 0's store binds it later
        port = str(hold.getsockname()[1])
        args = [sys.executable, "-m", "trainer", str(TINY), "--set", f"output_dir={out}",
                "--set", f"train.steps={steps}"]  # fmt: skip
        env = dict(os.environ, OMP_NUM_THREADS="1", WORLD_SIZE="2", MASTER_ADDR="127.0.0.1",
                   MASTER_PORT=port)  # fmt: skip
        procs = [
            subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                             env=dict(env, RANK=str(r), LOCAL_RANK=str(r)), cwd=REPO)
            for r in (0, 1)
        ]  # fmt: skip
        try:
            return [(p.wait(timeout=120), p.communicate()[1]) for p in procs]
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()
                    p.wait()
            hold.close()

    assert [rc for rc, _ in ranks(2)] == [0, 0]
    zero_rng_state(out / "ckpt", rank=1)
    for rank, (rc, err) in enumerate(ranks(3)):
        assert rc == 2, (rank, err[-2000:])
        assert "Traceback" not in err, err[-2000:]
        last = err.strip().splitlines()[-1]
        assert last.startswith("trainer: error: ") and "step-000000002" in last, last
        assert "rank 1" in last and "refused by torch's generator" in last, (rank, last)
    assert not (Path(step_path(str(out / "ckpt"), 3))).exists()


# -- model.init_from: hf:DIR --------------------------------------------------------------


@pytest.fixture(scope="module")
def hf_base(base, tmp_path_factory) -> Path:
    hf = tmp_path_factory.mktemp("hf") / "hf"
    export_hf(Checkpoint.open(step_path(str(base / "ckpt"), 2)), str(hf))
    return hf


def unblock_later(fifo: str, after: float = 8.0) -> None:
    """Without the fix a reader blocks on the FIFO (safetensors holds the GIL while it
    does): a separate process opens it for writing later, so such a run ends (failing the
    time check) rather than hanging the suite; it gives up by itself after 20 s."""
    subprocess.Popen(
        ["timeout", "20", "sh", "-c", f"sleep {after}; : > '{fifo}'"],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )


def _config(**kw):
    def edit(hf: Path):
        cfg = json.loads((hf / "config.json").read_text())
        cfg.update(kw)
        (hf / "config.json").write_text(json.dumps(cfg))

    return edit


def _config_fifo(hf: Path):
    (hf / "config.json").unlink()
    os.mkfifo(hf / "config.json")
    unblock_later(str(hf / "config.json"))


def _config_symlink_to_a_device(hf: Path):
    (hf / "config.json").unlink()
    (hf / "config.json").symlink_to("/dev/zero")


def _tensor(name, shape):
    def edit(hf: Path):
        import torch

        t = load_file(hf / "model.safetensors")
        t[name] = torch.zeros(shape)
        save_file(t, hf / "model.safetensors", metadata={"format": "pt"})

    return edit


def _header_entry(**entry):
    """A header entry added to model.safetensors as raw JSON (no tensor behind it)."""

    def edit(hf: Path):
        path = hf / "model.safetensors"
        blob = path.read_bytes()
        (n,) = struct.unpack("<Q", blob[:8])
        header = json.loads(blob[8 : 8 + n])
        header["zz"] = entry
        text = json.dumps(header).encode()
        text += b" " * (-len(text) % 8)
        path.write_bytes(struct.pack("<Q", len(text)) + text + blob[8 + n :])

    return edit


def _index_of_empty_lists(hf: Path):
    (hf / "model.safetensors").unlink()  # else it is read, as by transformers, not the index
    (hf / "model.safetensors.index.json").write_text("[" + "[]," * 400_000 + "[]]")


def _index(kind: str):
    def edit(hf: Path):
        keys = list(load_file(hf / "model.safetensors"))
        if kind == "fifo":
            os.mkfifo(hf / "pipe.safetensors")
            unblock_later(str(hf / "pipe.safetensors"))
            weight_map = dict.fromkeys(keys, "pipe.safetensors")
        elif kind == "outside":
            shutil.move(hf / "model.safetensors", hf.parent / "elsewhere.safetensors")
            weight_map = dict.fromkeys(keys, "../elsewhere.safetensors")
        else:
            weight_map = dict.fromkeys(keys, 5)
        # Without model.safetensors: where there is one it is read, as by transformers.
        (hf / "model.safetensors").unlink(missing_ok=True)
        (hf / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))

    return edit


HF_ATTACKS = {
    "config-fifo": (_config_fifo, "config.json is not a regular file"),
    "config-symlink-to-dev-zero": (
        _config_symlink_to_a_device,
        "config.json is not a regular file",
    ),
    "n_positions-string": (_config(n_positions="32"), "n_positions '32' is not an integer"),
    "n_positions-null": (_config(n_positions=None), "n_positions None is not an integer"),
    "n_layer-float": (_config(n_layer=2.0), "n_layer is 2.0"),
    "tie-string": (_config(tie_word_embeddings="yes"), "tie_word_embeddings is 'yes'"),
    "wte-wrong-shape": (_tensor("transformer.wte.weight", (3, 3)), "needs a floating-point"),
    "c_attn-3d": (_tensor("transformer.h.0.attn.c_attn.weight", (2, 2, 2)), "[2, 2, 2]"),
    "wpe-short": (_tensor("transformer.wpe.weight", (4, 64)), "wpe.weight is F32 [4, 64]"),
    "index-int": (_index("int"), "to 5, not a file name"),
    "index-fifo": (_index("fifo"), "pipe.safetensors is not a regular file"),
    "index-outside": (_index("outside"), "is not a plain file name inside the directory"),
    # Settings that change the math: a model that computes otherwise is refused.
    "layer-norm-eps": (_config(layer_norm_epsilon=0.5), "layer_norm_epsilon is 0.5"),
    "unscaled-attention": (_config(scale_attn_weights=False), "scale_attn_weights is False"),
    "scaled-by-layer": (
        _config(scale_attn_by_inverse_layer_idx=True),
        "scale_attn_by_inverse_layer_idx is True",
    ),
    # Multiplying out 100,000 huge dimensions took minutes; refused before.
    "header-shape-of-100k-dims": (
        _header_entry(dtype="F32", shape=[1 << 62] * 100_000, data_offsets=[0, 0]),
        "is not a list of at most 8 integers",
    ),
    "index-of-empty-lists": (_index_of_empty_lists, "JSON lists or objects"),
}


@pytest.mark.parametrize("attack", list(HF_ATTACKS))
def test_init_from_refuses_a_hostile_hugging_face_directory_in_one_line(
    hf_base, tmp_path, capsys, attack
):
    edit, message = HF_ATTACKS[attack]
    hf = tmp_path / "hf"
    shutil.copytree(hf_base, hf)
    edit(hf)
    capsys.readouterr()
    t0 = time.monotonic()
    rc = run(tmp_path / "out", 1, f"model.init_from=hf:{hf}")
    assert time.monotonic() - t0 < 6, "blocked on a FIFO"
    assert rc == 2
    err = one_error_line(capsys)
    assert message in err, err


def test_init_from_follows_the_symlinks_of_a_hub_cache_snapshot(hf_base, tmp_path, capsys):
    """A Hugging Face hub cache keeps each file once in ``blobs/`` and links it from
    ``snapshots/<revision>/``: such a directory is not hostile, and starts training."""
    cache = tmp_path / "models--tiny"
    (cache / "blobs").mkdir(parents=True)
    snap = cache / "snapshots" / "0123abc"
    snap.mkdir(parents=True)
    for i, f in enumerate(sorted(hf_base.iterdir())):
        shutil.copy(f, cache / "blobs" / f"blob{i}")
        (snap / f.name).symlink_to(Path("..", "..", "blobs", f"blob{i}"))
    rc = run(tmp_path / "out", 1, f"model.init_from=hf:{snap}")
    assert rc == 0, capsys.readouterr().err[-2000:]


def test_init_from_ignores_a_tensor_of_another_dtype_it_does_not_need(hf_base, tmp_path, capsys):
    """A hub file may carry tensors of dtypes a checkpoint never holds (float8 here): one
    the model does not need is skipped, with its offsets still checked; one it needs is
    refused in one line."""
    import torch

    hf = tmp_path / "hf"
    shutil.copytree(hf_base, hf)
    t = load_file(hf / "model.safetensors")
    t["extra.scale"] = torch.ones(4, 4).to(torch.float8_e4m3fn)
    save_file(t, hf / "model.safetensors", metadata={"format": "pt"})
    assert run(tmp_path / "out", 1, f"model.init_from=hf:{hf}") == 0, capsys.readouterr().err
    assert "1 tensor not of GPT-2 left unread (extra.scale)" in capsys.readouterr().out
    t["transformer.ln_f.bias"] = t["transformer.ln_f.bias"].to(torch.float8_e4m3fn)
    save_file(t, hf / "model.safetensors", metadata={"format": "pt"})
    capsys.readouterr()
    assert run(tmp_path / "out2", 1, f"model.init_from=hf:{hf}") == 2
    err = one_error_line(capsys)
    assert "ln_f.bias is F8_E4M3" in err and "needs a floating-point" in err, err


def test_init_from_reads_the_weight_files_it_checked_and_survives_their_truncation(
    hf_base, tmp_path
):
    """A weights file replaced under its name after it was checked is not what is read (it
    is read through the descriptor that was checked), and one truncated after it was
    checked is one error when the tensor is read (it is never memory-mapped, so a
    truncation in the middle of a read cannot be a SIGBUS either)."""
    import torch

    from trainer.hf import HFError, _WeightFiles

    hf = tmp_path / "hf"
    shutil.copytree(hf_base, hf)
    name = "transformer.wte.weight"
    theirs = load_file(hf / "model.safetensors")
    wte = theirs[name]
    files = _WeightFiles(str(hf), "where")
    save_file({k: v * 0 + 7 for k, v in theirs.items()}, hf / "swap.tmp")
    os.replace(hf / "swap.tmp", hf / "model.safetensors")
    assert torch.equal(files.get(name, tuple(wte.shape)), wte)
    files.close()

    files = _WeightFiles(str(hf), "where")  # the new file: 7s
    os.truncate(hf / "model.safetensors", 1024)
    with pytest.raises(HFError, match="truncated"):
        files.get(name, tuple(wte.shape))
    files.close()


# -- ckpt export --format hf ----------------------------------------------------------------


def _model(**kw):
    return lambda raw: raw["extra"]["model"].update(kw)


def _shape(name, shape):
    def edit(raw):
        raw["tensors"][name] = {"kind": "model", "dtype": "float32", "shape": shape, **listing(raw)}

    return edit


EXPORT_ATTACKS = {
    "layers-string": (_model(layers="2"), "layers '2' is not an integer"),
    "layers-float": (_model(layers=2.0), "layers 2.0 is not an integer"),
    "layers-negative": (_model(layers=-5), "layers -5 is not an integer in [1, 2^24]"),
    "heads-not-dividing": (_model(heads=3), "hidden 64 is not a multiple of heads 3"),
    "tie-string": (_model(tie_embeddings="no"), "tie_embeddings 'no' is not a boolean"),
    "qkv-empty": (_shape("decoder.layers.0.attn.qkv.weight", [0]), "[0], the model"),
    "fc1-3d": (_shape("decoder.layers.0.mlp.fc1.weight", [2, 0, 2]), "[2, 0, 2], the model"),
}


@pytest.mark.parametrize("attack", list(EXPORT_ATTACKS))
def test_export_hf_refuses_a_hostile_model_record_or_tensor_shape_in_one_line(
    base, tmp_path, attack
):
    edit, message = EXPORT_ATTACKS[attack]
    out = edited(base, tmp_path, edit)
    target = tmp_path / "hf"
    with pytest.raises(TrainerConfigError) as info:
        export_hf(Checkpoint.open(step_path(str(out / "ckpt"), 2)), str(target))
    assert message in str(info.value) and len(str(info.value).splitlines()) == 1, info.value
    assert not target.exists()  # nothing written


def _flip_a_bit_of_the_rng_state(out: Path, step: int) -> None:
    ckpt = Checkpoint.open(step_path(str(out / "ckpt"), step))
    (chunk,) = ckpt.manifest.tensors["rank/0/rng/cpu"].chunks
    ckpt.close()
    path = Path(step_path(str(out / "ckpt"), step)) / chunk.file
    blob = bytearray(path.read_bytes())
    (n,) = struct.unpack("<Q", blob[:8])
    begin = json.loads(blob[8 : 8 + n])[chunk.key]["data_offsets"][0]
    blob[8 + n + begin + 100] ^= 0x10
    path.write_bytes(bytes(blob))


def test_a_corrupted_rng_state_is_not_read_when_the_layout_changed(base, tmp_path, capsys):
    """Reseeded, not restored, after a layout change: its bytes are not read, so they
    cannot fail the step (a resize would have lost the newest step for nothing)."""
    out = tmp_path / "out"
    shutil.copytree(base, out)
    assert run(out, 3) == 0
    _flip_a_bit_of_the_rng_state(out, 3)
    capsys.readouterr()
    assert run(out, 4, "train.micro_batch=1") == 0, capsys.readouterr().err[-2000:]
    said = capsys.readouterr().out
    assert "resumed from " + step_path(str(out / "ckpt"), 3) + " at step 3" in said
    assert "layout changed, RNG reseeded" in said


def test_a_corrupted_rng_state_falls_back_to_the_step_before_like_any_corrupted_tensor(
    base, tmp_path, capsys, caplog
):
    """The RNG state's bytes are checksummed like a parameter's: one flipped bit in the
    newest step's is a damaged step, and the resume falls back to the step before (it
    stopped there before, with every restart)."""
    out = tmp_path / "out"
    shutil.copytree(base, out)
    assert run(out, 3) == 0  # steps 2 and 3 committed
    _flip_a_bit_of_the_rng_state(out, 3)
    capsys.readouterr()
    assert run(out, 4) == 0, capsys.readouterr().err[-2000:]
    said = capsys.readouterr()
    warned = [r.getMessage() for r in caplog.records if "cannot be loaded" in r.getMessage()]
    assert len(warned) == 1 and "checkpoint step 3" in warned[0] and "rng/cpu" in warned[0]
    assert "resumed from " + step_path(str(out / "ckpt"), 2) + " at step 2" in said.out


def test_a_save_refused_for_good_stops_the_trainer_with_exit_2_not_74(
    tmp_path, capsys, monkeypatch
):
    """A save past a bound every load enforces (here the reader's chunk bound, made 3)
    would be refused at every step: exit 2 in one line, which fails the job, rather than
    74, which restarts it into the same refusal. Nothing is committed."""
    import checkpoint.manifest as manifest_mod
    from checkpoint import committed_steps

    monkeypatch.setattr(manifest_mod, "MAX_CHUNKS", 3)
    out = tmp_path / "out"
    assert run(out, 2) == 2
    err = one_error_line(capsys)
    assert "was not committed" in err and "chunks, more than 3" in err, err
    assert committed_steps(str(out / "ckpt")) == []


@pytest.mark.parametrize(
    ("change", "says"),
    [
        # Fewer layers: only the tensors the model asks for were read, and the next
        # saves left layer 1 out of every checkpoint.
        ("model.layers=1", "layers 2 -> 1"),
        # The same shapes, another computation.
        ("model.heads=2", "heads 4 -> 2"),
    ],
)
def test_a_resume_into_another_model_is_refused_in_one_line_and_nothing_is_lost(
    base, tmp_path, capsys, change, says
):
    out = tmp_path / "out"
    shutil.copytree(base, out)
    before = sorted(os.listdir(out / "ckpt"))
    capsys.readouterr()
    assert run(out, 4, change) == 2
    err = one_error_line(capsys)
    assert "the checkpoint's model is not the job's (" + says + ")" in err, err
    assert sorted(os.listdir(out / "ckpt")) == before
    # Settings that may change resume: dropout, and top_k of a dense model.
    assert run(out, 3, "model.dropout=0.1", "model.top_k=1") == 0, capsys.readouterr().err[-2000:]


def test_tied_embeddings_resumed_over_a_trained_output_layer_are_refused(tmp_path, capsys):
    """The checkpoint's output layer (untied) was dropped without a word: the loss jumped
    from 3.91 to 5.11 at the first step after the resume."""
    out = tmp_path / "out"
    assert run(out, 2, "model.tie_embeddings=false") == 0
    capsys.readouterr()
    assert run(out, 3, "model.tie_embeddings=true") == 2
    assert "tie_embeddings False -> True" in one_error_line(capsys)


def test_a_schedule_that_gives_the_step_saved_another_lr_is_said_on_resume(tmp_path, capsys):
    """A cosine schedule ended at step 8 (lr 0 there); the same job resumed with 16 steps
    trains step 9 at a far higher lr, and nothing said so (train.lr is unchanged, and the
    schedule's settings are not recorded). The lr the step saved ran at is compared with
    the one this job's schedule gives that step."""
    out = tmp_path / "out"
    assert run(out, 8, "train.lr_schedule=cosine", "checkpoint.every=4") == 0
    capsys.readouterr()
    assert run(out, 16, "train.lr_schedule=cosine") == 0, capsys.readouterr().err[-2000:]
    said = capsys.readouterr().out
    assert "lr of the step saved 0 (checkpoint) vs " in said, said
    assert "by this job's schedule (train.lr_schedule, warmup, min_lr or steps changed)" in said
    # Unchanged, nothing is said.
    assert run(out, 16, "train.lr_schedule=cosine") == 0
    assert "lr of the step saved" not in capsys.readouterr().out


def test_another_routing_of_a_mixture_of_experts_is_refused_on_resume(tmp_path, capsys):
    """top_k was not recorded, so the check that names it compared nothing."""
    out = tmp_path / "out"
    assert run(out, 2, "model.experts=2", "model.top_k=2") == 0
    capsys.readouterr()
    assert run(out, 3, "model.experts=2", "model.top_k=1") == 2
    assert "top_k 2 -> 1" in one_error_line(capsys)
