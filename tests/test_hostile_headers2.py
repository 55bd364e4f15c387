"""Hostile headers and manifests, second round: the types of a safetensors header entry's
fields, a Hugging Face weight whose declared shape a sparse file "backs", names that are
not UTF-8 text (a lone surrogate), JSON in another encoding than UTF-8 and numbers that
overflow to infinity.

Each is refused in one line naming what is wrong (exit code 2, no traceback) by every
reader (``ckpt verify``, ``inspect``, ``export``, ``export --format hf``, a load,
``model.init_from: hf:DIR``), and a resume falls back past such a step as past any other
damaged one. Every file is real: manifests are re-sealed and tensor files' ``bytes`` and
``header_sha256`` recomputed, so what stops each attack is the validation, not a checksum.
"""

from __future__ import annotations

import json
import os
import shutil
import struct
from pathlib import Path

import pytest
import torch
from ckpt_versions import reheadered
from safetensors.torch import save_file
from test_checkpoint_hostile import (
    STEP,
    W,
    cli,
    data_name,
    manifest,
    manifest_path,
    reseal,
    rewrite_header,
    save,
)
from test_checkpoint_hostile_trainer import run

from checkpoint import (
    Checkpoint,
    CheckpointError,
    SaveOptions,
    Saver,
    SaveRefusedError,
    ShardInfo,
    committed_steps,
    load_latest,
)
from checkpoint.load import available_memory
from checkpoint.smallfile import parse_json as small_parse_json
from checkpoint.stfile import read_header
from checkpoint.store import step_path
from elasticd.jobspec import ModelConfig
from trainer.hf import HFError, _hf_shape, _pairs, export_hf, gpt2_config, model_record, read_hf

REPO = Path(__file__).resolve().parent.parent


def one_line(err: str, prefix: str = "") -> str:
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in err, err
    assert lines[0].startswith(prefix), err
    return lines[0]


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> Path:
    """The output directory of a tiny run with steps 2 and 3 committed."""
    out = tmp_path_factory.mktemp("trained") / "out"
    assert run(out, 2) == 0
    assert run(out, 3) == 0
    return out


@pytest.fixture
def small(tmp_path) -> str:
    """The one-tensor checkpoint of test_checkpoint_hostile (step 3, format version 4)."""
    out = str(tmp_path / "ckpt")
    save(out)
    return out


def rewrite_step_header(step_dir: Path, edit) -> None:
    """Rewrite the first tensor file of ``step_dir`` through ``edit(header)`` and re-seal
    its ``bytes`` and ``header_sha256`` and the manifest."""
    import hashlib

    raw = json.loads((step_dir / "manifest.json").read_text())
    name = sorted(raw["files"])[0]
    path = step_dir / name
    head, new = reheadered(path.read_bytes(), edit)
    path.write_bytes(new)
    raw["files"][name].update(bytes=len(new), header_sha256=hashlib.sha256(head).hexdigest())
    raw.pop("checksum", None)
    canon = json.dumps(raw, sort_keys=True, separators=(",", ":")).encode()
    raw["checksum"] = hashlib.sha256(canon).hexdigest()
    (step_dir / "manifest.json").write_text(json.dumps(raw))


def first_tensor_key(header: dict) -> str:
    return sorted(k for k in header if k != "__metadata__")[0]


# -- D1: a header entry's dtype, shape or data_offsets of the wrong JSON type ------------


def _entry(field: str, value):
    def edit(header: dict) -> None:
        header[first_tensor_key(header)][field] = value

    return edit


ENTRY_ATTACKS = {
    "dtype-list": (_entry("dtype", []), "dtype [] is not a name"),
    "dtype-object": (_entry("dtype", {"F32": 1}), "dtype {'F32': 1} is not a name"),
    "dtype-number": (_entry("dtype", 4), "dtype 4 is not a name"),
    "shape-object": (_entry("shape", {"0": 4}), "shape {'0': 4} is not a list"),
    "shape-of-booleans": (_entry("shape", [True, True]), "is not a list of at most 8"),
    "offsets-of-lists": (_entry("data_offsets", [[0], [4]]), "data_offsets [[0], [4]]"),
    "offsets-of-booleans": (_entry("data_offsets", [False, True]), "data_offsets [False, True]"),
}


@pytest.mark.parametrize("attack", list(ENTRY_ATTACKS))
def test_a_header_entry_field_of_the_wrong_type_is_refused_in_one_line_by_every_reader(
    trained, tmp_path, capsys, attack
):
    edit, says = ENTRY_ATTACKS[attack]
    out = tmp_path / "out"
    shutil.copytree(trained, out)
    ckpt = str(out / "ckpt")
    rewrite_step_header(Path(step_path(ckpt, 3)), edit)
    capsys.readouterr()
    for argv in (
        ["verify", ckpt],
        ["inspect", ckpt],
        ["inspect", "--json", ckpt],
        ["export", ckpt, str(tmp_path / "raw")],
        ["export", "--format", "hf", ckpt, str(tmp_path / "hf")],
    ):
        code, _, err = cli(capsys, *argv)
        assert code == 2, (argv, err)
        line = one_line(err)
        assert says in line and "header entry" in line, (argv, line)
    assert not (tmp_path / "raw").exists() and not (tmp_path / "hf").exists()


def test_a_resume_falls_back_past_a_step_whose_header_has_a_list_as_dtype(
    trained, tmp_path, capsys, caplog
):
    out = tmp_path / "out"
    shutil.copytree(trained, out)
    ckpt = str(out / "ckpt")
    rewrite_step_header(Path(step_path(ckpt, 3)), _entry("dtype", []))
    capsys.readouterr()
    assert run(out, 4) == 0, capsys.readouterr().err[-2000:]
    said = capsys.readouterr().out
    assert "resumed from " + step_path(ckpt, 2) + " at step 2" in said, said
    warned = [r.getMessage() for r in caplog.records if "cannot be loaded" in r.getMessage()]
    assert len(warned) == 1 and "dtype [] is not a name" in warned[0], warned


@pytest.fixture(scope="module")
def hf_dir(trained, tmp_path_factory) -> Path:
    hf = tmp_path_factory.mktemp("hf") / "hf"
    export_hf(Checkpoint.open(step_path(str(trained / "ckpt"), 2)), str(hf))
    return hf


def edit_hf_header(hf: Path, edit) -> None:
    path = hf / "model.safetensors"
    path.write_bytes(reheadered(path.read_bytes(), edit)[1])


@pytest.mark.parametrize(
    ("edit", "says"),
    [
        (lambda h: h["transformer.wte.weight"].update(dtype=[]), "dtype [] is not a name"),
        # A tensor the import does not need, of a dtype it would leave unread.
        (
            lambda h: h.update(zz={"dtype": {}, "shape": [0], "data_offsets": [0, 0]}),
            "dtype {} is not a name",
        ),
    ],
    ids=["needed", "unneeded"],
)
def test_init_from_refuses_a_header_dtype_that_is_not_a_name_in_one_line(
    hf_dir, tmp_path, capsys, edit, says
):
    hf = tmp_path / "hf"
    shutil.copytree(hf_dir, hf)
    edit_hf_header(hf, edit)
    capsys.readouterr()
    assert run(tmp_path / "out", 1, f"model.init_from=hf:{hf}") == 2
    line = one_line(capsys.readouterr().err, "trainer: error: ")
    assert says in line, line


# -- D2: a Hugging Face weight whose declared shape a sparse file "backs" ----------------


def sparse_hf_dir(
    hf: Path, cfg: ModelConfig, *, positions: int, big: str, dtype: str, others: bool = True
) -> int:
    """A GPT-2 directory for ``cfg`` whose tensor ``big`` is declared in ``dtype`` at its
    full shape (``positions`` rows for ``wpe``) over a sparse hole: the file's size backs
    it, its disk does not. The other tensors are real (``others``), or left out. Returns
    the bytes declared."""
    hf.mkdir()
    record = model_record(cfg)
    config = gpt2_config(record) | {"n_positions": positions}
    (hf / "config.json").write_text(json.dumps(config))
    gen = torch.Generator().manual_seed(5)
    tensors = {}
    for ours, name, how in _pairs(record):
        if name != big and others:
            shape = _hf_shape(ours, how, record, positions)
            tensors[name] = torch.randn(shape, generator=gen) * 0.02
    save_file(tensors, str(hf / "model.safetensors"), metadata={"format": "pt"})
    ours, how = next((o, h) for o, n, h in _pairs(record) if n == big)
    shape = _hf_shape(ours, how, record, positions)
    item = {"F32": 4, "F16": 2}[dtype]
    nbytes = item
    for s in shape:
        nbytes *= s
    path = hf / "model.safetensors"
    blob = path.read_bytes()
    (n,) = struct.unpack("<Q", blob[:8])
    header = json.loads(blob[8 : 8 + n])
    data_len = len(blob) - 8 - n
    header[big] = {"dtype": dtype, "shape": list(shape),
                   "data_offsets": [data_len, data_len + nbytes]}  # fmt: skip
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    head = struct.pack("<Q", len(text)) + text
    path.write_bytes(head + blob[8 + n :])
    os.truncate(path, len(head) + data_len + nbytes)  # a hole: no disk behind it
    return nbytes


@pytest.mark.timeout(120)
def test_init_from_reads_only_the_positions_it_uses_of_a_sparse_wpe_of_2_24_rows(tmp_path, capsys):
    """``n_positions`` 2^24 and ``wpe`` F32 [2^24, 1024] on a sparse file: 64 GiB declared,
    4 KiB on disk. The whole of it was allocated (a traceback, "can't allocate memory";
    below the machine's memory, gigabytes read to keep 32 rows). Only the ``seq_len`` rows
    the model has are read now."""
    model = dict(layers=1, hidden=1024, heads=4, ffn_hidden=256, vocab=256, seq_len=32)
    cfg = ModelConfig(**model)
    hf = tmp_path / "hf"
    declared = sparse_hf_dir(hf, cfg, positions=1 << 24, big="transformer.wpe.weight", dtype="F32")
    assert declared == 64 << 30
    assert os.stat(hf / "model.safetensors").st_blocks * 512 < 64 << 20
    sets = [f"model.{k}={v}" for k, v in model.items()]
    capsys.readouterr()
    rc = run(tmp_path / "out", 1, *sets, f"model.init_from=hf:{hf}")
    assert rc == 0, capsys.readouterr().err[-2000:]
    # The rows read are the file's (a hole reads as zeros), not uninitialized memory.
    got = read_hf(str(hf), cfg)["embedding.position_embeddings.weight"]
    assert got.shape == (32, 1024) and not got.any()


def test_init_from_refuses_a_weight_larger_than_the_memory_available_in_one_line(tmp_path):
    """A job's own shapes may be larger than the machine: ``wte`` F16 [2^24, 2^14] (512 GiB
    declared, its float32 copy 1 TiB more) on a sparse file is refused before any
    allocation, naming the tensor and the memory, not a traceback."""
    cfg = ModelConfig(layers=1, hidden=1 << 14, heads=4, ffn_hidden=256, vocab=1 << 24,
                      seq_len=32)  # fmt: skip
    free = available_memory()
    if free is None or free > 1 << 40:
        pytest.skip("this machine says no memory limit, or more than 1 TiB")
    hf = tmp_path / "hf"
    sparse_hf_dir(hf, cfg, positions=32, big="transformer.wte.weight", dtype="F16", others=False)
    with pytest.raises(HFError) as info:
        read_hf(str(hf), cfg)
    line = one_line(str(info.value))
    assert "transformer.wte.weight" in line and "GB of memory" in line, line


# -- D3: a name that is not UTF-8 text (a lone surrogate) ---------------------------------


def _surrogate_name(ckpt: str, raw: dict) -> None:
    new = "w\ud800"
    raw["tensors"][new] = raw["tensors"].pop("w")

    def edit(header: dict) -> None:
        for key in [k for k in header if k.startswith("w@")]:
            header[new + key[1:]] = header.pop(key)
        meta = header["__metadata__"]
        for key in [k for k in meta if k.startswith("crc32c:w@")]:
            meta["crc32c:" + new + key[len("crc32c:w") :]] = meta.pop(key)

    rewrite_header(ckpt, raw, edit)


def test_a_tensor_name_with_a_lone_surrogate_is_refused_by_every_reader_in_one_line(
    small, tmp_path, capsys
):
    """``"w\\ud800"`` is valid JSON, but not UTF-8 text: verify and inspect passed it, and
    export stopped in safetensors with a UnicodeEncodeError traceback."""
    raw = manifest(small)
    _surrogate_name(small, raw)
    reseal(small, raw)
    assert "\\ud800" in manifest_path(small).read_text()
    for argv in (["verify", small], ["inspect", small], ["export", small, str(tmp_path / "x")]):
        code, _, err = cli(capsys, *argv)
        line = one_line(err)
        assert code == 2 and "lone surrogate" in line and "'w\\ud800'" in line, (argv, line)
    assert not (tmp_path / "x").exists()
    model = {"w": (torch.zeros(64, 16), ShardInfo.whole("w", (64, 16)))}
    with pytest.raises(CheckpointError, match="lone surrogate"):
        load_latest(small, model=model)


def test_a_header_key_with_a_lone_surrogate_is_refused_and_a_pair_is_not(tmp_path):
    data = torch.zeros(2, dtype=torch.float32)
    for key, bad in (("\U0001f600", False), ("a\udc00", True), ("\ud83d\ud83d\ude00", True)):
        path = tmp_path / "t.safetensors"
        head = json.dumps({key: {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}})
        text = head.encode() + b" " * (-len(head) % 8)
        path.write_bytes(struct.pack("<Q", len(text)) + text + data.numpy().tobytes())
        if bad:
            with pytest.raises(CheckpointError, match="lone surrogate"):
                read_header(str(path))
        else:
            assert key in read_header(str(path))[1]


def test_init_from_refuses_an_index_naming_a_file_with_a_lone_surrogate_in_one_line(
    hf_dir, tmp_path, capsys
):
    """Such a name cannot be opened (a UnicodeEncodeError traceback from os.open)."""
    hf = tmp_path / "hf"
    shutil.copytree(hf_dir, hf)
    (hf / "model.safetensors").rename(hf / "model-1.safetensors")
    index = {"weight_map": {"transformer.wte.weight": "x\ud800.safetensors"}}
    (hf / "model.safetensors.index.json").write_text(json.dumps(index))
    capsys.readouterr()
    assert run(tmp_path / "out", 1, f"model.init_from=hf:{hf}") == 2
    line = one_line(capsys.readouterr().err, "trainer: error: ")
    assert "wte.weight': 'x\\ud800.safetensors' holds a lone surrogate" in line, line


def test_a_save_of_a_tensor_name_with_a_lone_surrogate_is_refused_before_it_commits(tmp_path):
    """Such a step would be committed, then refused by every load."""
    name = "w\ud800"
    saver = Saver(str(tmp_path / "ckpt"), group=None, options=SaveOptions(async_=False))
    try:
        with pytest.raises(SaveRefusedError, match="lone surrogate"):
            saver.save(step=1, consumed_samples=0,
                       model={name: (W.clone(), ShardInfo.whole(name, (64, 16)))})  # fmt: skip
    finally:
        saver.close()
    assert committed_steps(str(tmp_path / "ckpt")) == []


# -- D8 (a): JSON in another encoding than UTF-8 -------------------------------------------


@pytest.mark.parametrize("encoding", ["utf-32-le", "utf-16-le", "utf-8-sig"])
def test_a_header_in_another_encoding_than_utf8_is_refused(small, capsys, encoding):
    """json.loads of bytes detects UTF-16 and UTF-32 and takes them (safetensors does not)."""

    raw = manifest(small)
    path = Path(step_path(small, STEP)) / data_name(raw)
    blob = path.read_bytes()
    (n,) = struct.unpack("<Q", blob[:8])
    text = blob[8 : 8 + n].decode("utf-8").rstrip(" ").encode(encoding)
    while len(text) % 8:  # padded with spaces of that encoding: all of it decodes
        text += " ".encode(encoding.removesuffix("-sig"))
    head = struct.pack("<Q", len(text)) + text
    path.write_bytes(head + blob[8 + n :])
    import hashlib

    raw["files"][data_name(raw)].update(
        bytes=len(head) + len(blob) - 8 - n, header_sha256=hashlib.sha256(head).hexdigest()
    )
    reseal(small, raw)
    code, _, err = cli(capsys, "verify", small)
    line = one_line(err)
    assert code == 2 and "header is not valid JSON" in line, line


@pytest.mark.parametrize("encoding", ["utf-32", "utf-16-le", "utf-8-sig"])
def test_a_control_file_in_another_encoding_than_utf8_is_refused(encoding):
    with pytest.raises(CheckpointError, match=r"fence\.json: not a fence"):
        small_parse_json(
            json.dumps({"run_id": "r", "round": 1}).encode(encoding),
            where="fence.json",
            what="a fence",
        )


def test_a_manifest_with_a_byte_order_mark_is_refused(small, capsys):
    path = manifest_path(small)
    path.write_bytes(b"\xef\xbb\xbf" + path.read_bytes())
    code, _, err = cli(capsys, "inspect", small)
    assert code == 2 and "not valid JSON" in one_line(err)


# -- D8 (b): numbers out of a double's range ------------------------------------------------


def with_number(ckpt: str, raw: dict, put, literal: str) -> None:
    """Re-seal ``raw`` with ``put(raw, inf)`` done (the checksum a reader computes from
    the parsed ``inf``), then write the manifest with ``literal`` where ``inf`` is."""
    import hashlib

    raw.pop("checksum", None)
    put(raw, float("inf"))
    canon = json.dumps(raw, sort_keys=True, separators=(",", ":")).encode()
    raw["checksum"] = hashlib.sha256(canon).hexdigest()
    text = json.dumps(raw)
    assert text.count("Infinity") == 1
    manifest_path(ckpt).write_text(text.replace("Infinity", literal))


@pytest.mark.parametrize(
    ("put", "says"),
    [
        (lambda raw, v: raw["extra"].update(lr=v), "extra.lr: 1e400"),
        (lambda raw, v: raw.update(created_unix=v), "created_unix: 1e400"),
        (lambda raw, v: raw["extra"].update(deep={"a": [0, v]}), "extra.deep.a[1]: 1e400"),
    ],
    ids=["extra", "created_unix", "nested"],
)
def test_a_manifest_number_that_overflows_to_infinity_is_refused_naming_its_field(
    small, capsys, put, says
):
    """1e400 parses as inf, which the NaN/Infinity rule did not see: ``inspect --json``
    then printed ``Infinity``, which is not JSON."""
    raw = manifest(small)
    with_number(small, raw, put, "1e400")
    for argv in (["inspect", "--json", small], ["verify", small]):
        code, out, err = cli(capsys, *argv)
        line = one_line(err)
        assert code == 2 and says in line and "finite" in line, (argv, line)
        assert "Infinity" not in out
    model = {"w": (torch.zeros(64, 16), ShardInfo.whole("w", (64, 16)))}
    with pytest.raises(CheckpointError, match="1e400"):
        load_latest(small, model=model)


def test_a_header_number_that_overflows_to_infinity_is_refused(tmp_path):
    path = tmp_path / "t.safetensors"
    head = '{"__metadata__": {"x": "1"}, "t": {"dtype": "F32", "shape": [0], ' \
           '"data_offsets": [0, 0], "scale": -1e999}}'  # fmt: skip
    text = head.encode() + b" " * (-len(head) % 8)
    path.write_bytes(struct.pack("<Q", len(text)) + text)
    with pytest.raises(CheckpointError, match=r"t\.scale: -1e999 is not a finite number"):
        read_header(str(path))


@pytest.mark.parametrize(
    ("text", "says"),
    [
        (b'{"a": 1e400, "a": 1}', "the text: 1e400 is not a finite number"),
        (b'{"t": {"dtype": "F32"}, "x": "\\ud800", "x": ""}', "the text: a string holds a lone"),
    ],
    ids=["number", "surrogate"],
)
def test_what_a_duplicate_key_hides_is_refused_in_one_line_all_the_same(tmp_path, text, says):
    """The parse keeps a duplicate key's last value: what the text holds is refused even
    where the value no longer does (it stopped with an AttributeError)."""
    path = tmp_path / "t.safetensors"
    text += b" " * (-len(text) % 8)
    path.write_bytes(struct.pack("<Q", len(text)) + text)
    with pytest.raises(CheckpointError, match=says):
        read_header(str(path))


# -- Minor: messages that named no field ----------------------------------------------------


def test_a_created_unix_of_400_digits_is_refused_naming_the_field(small, capsys):
    raw = manifest(small)
    raw["created_unix"] = 10**400
    reseal(small, raw)
    code, _, err = cli(capsys, "inspect", small)
    line = one_line(err)
    assert code == 2 and "created_unix" in line and "OverflowError" not in line, line


@pytest.mark.parametrize("field", ["kind", "dtype", "shape", "regions", "block_bytes"])
def test_a_tensor_without_a_field_is_refused_naming_the_tensor_and_the_field(small, capsys, field):
    raw = manifest(small)
    del raw["tensors"]["w"][field]
    reseal(small, raw)
    code, _, err = cli(capsys, "inspect", small)
    line = one_line(err)
    assert code == 2 and f"tensor w: no {field!r} field" in line, line
    assert "KeyError" not in line


def test_a_file_entry_without_a_field_is_refused_naming_the_file_and_the_field(small, capsys):
    raw = manifest(small)
    del raw["files"][data_name(raw)]["header_sha256"]
    reseal(small, raw)
    code, _, err = cli(capsys, "inspect", small)
    line = one_line(err)
    assert code == 2 and f"files.{data_name(raw)}: no 'header_sha256' field" in line, line


def test_a_manifest_without_a_top_level_field_is_refused_naming_it(small, capsys):
    raw = manifest(small)
    del raw["job"]
    reseal(small, raw)
    code, _, err = cli(capsys, "inspect", small)
    line = one_line(err)
    assert code == 2 and "no 'job' field" in line and "KeyError" not in line, line


def test_the_sound_checkpoints_of_these_tests_still_pass(small, trained, tmp_path, capsys):
    raw = manifest(small)
    reseal(small, raw)
    for argv in (["verify", small], ["inspect", "--json", small]):
        assert cli(capsys, *argv)[0] == 0
    ckpt = str(trained / "ckpt")
    assert cli(capsys, "export", "--format", "hf", ckpt, str(tmp_path / "hf"))[0] == 0
    model = {"w": (torch.zeros(64, 16), ShardInfo.whole("w", (64, 16)))}
    load_latest(small, model=model)
    assert torch.equal(model["w"][0], W)
