"""Hostile manifests and headers, second round: each attack is refused in one line (exit 2)
by `ckpt verify`, `inspect`, `export` (and `--format hf`) or a load, within bounded time
and memory. The CLI runs in a process of its own under a time and an address-space limit,
so an attack that is not stopped fails its test instead of taking the machine: a forked
child of ``tests/cli_server.py``, which imported torch once for all of them.

As in tests/test_checkpoint_hostile.py, each attack re-seals the manifest's unkeyed
sha256 (and a rewritten file's ``bytes`` and ``header_sha256``): what must stop it is
the validation. Each runs on the checkpoint as this build writes it (format version 4)
and as version 3 listed it.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import resource
import signal
import struct
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from ckpt_versions import listing, move_chunks, rewrite_as
from hypothesis import given, settings
from hypothesis import strategies as st

from checkpoint import CheckpointError, SaveOptions, Saver, ShardInfo
from checkpoint.manifest import Manifest
from checkpoint.store import step_path

REPO = Path(__file__).resolve().parents[1]
STEP = 3
W = torch.arange(64 * 16, dtype=torch.float32).reshape(64, 16)
LIMIT_S = 60
MEMORY = 3 << 30
"""Address space of each CLI run (torch's imports take well under 1 GiB of it)."""


def save(ckpt: str, model=None, extra=None) -> None:
    saver = Saver(ckpt, group=None, options=SaveOptions(async_=False, chunk_min_bytes=1024))
    model = model or {"w": (W.clone(), ShardInfo.whole("w", (64, 16)))}
    saver.save(step=STEP, consumed_samples=12, model=model, extra=extra)
    saver.close()


@pytest.fixture(params=[4, 3], ids=["v4", "v3"])
def ckpt(tmp_path, request) -> str:
    out = str(tmp_path / "ckpt")
    save(out)
    if request.param == 3:
        rewrite_as(step_path(out, STEP), 3)
    return out


def manifest_path(ckpt: str) -> Path:
    return Path(step_path(ckpt, STEP)) / "manifest.json"


def manifest(ckpt: str) -> dict:
    return json.loads(manifest_path(ckpt).read_text())


def reseal(ckpt: str, raw: dict, literal: tuple[str, str] | None = None) -> None:
    """Write ``raw`` with a correct checksum; ``literal`` (placeholder, JSON text) splices in
    JSON that Python cannot round-trip (a 5000-digit integer, deep nesting)."""
    raw.pop("checksum", None)
    canon = json.dumps(raw, sort_keys=True, separators=(",", ":"))
    text = json.dumps(raw)
    if literal:
        canon = canon.replace(json.dumps(literal[0]), literal[1])
        text = text.replace(json.dumps(literal[0]), literal[1])
    digest = hashlib.sha256(canon.encode()).hexdigest()
    manifest_path(ckpt).write_text(text[:-1] + f', "checksum": "{digest}"}}')


def rewrite_header(ckpt: str, raw: dict, text_of) -> None:
    """Rewrite the tensor file's header as ``text_of(header)`` (bytes); re-seal its sums."""
    (name,) = raw["files"]
    path = Path(step_path(ckpt, STEP)) / name
    blob = path.read_bytes()
    (n,) = struct.unpack("<Q", blob[:8])
    text = text_of(json.loads(blob[8 : 8 + n]))
    text += b" " * (-len(text) % 8)
    head = struct.pack("<Q", len(text)) + text
    new = head + blob[8 + n :]
    path.write_bytes(new)
    raw["files"][name].update(bytes=len(new), header_sha256=hashlib.sha256(head).hexdigest())


def _limits() -> None:
    resource.setrlimit(resource.RLIMIT_AS, (MEMORY, MEMORY))


def run(args: list[str], timeout: float = LIMIT_S) -> tuple[int, str, str, float]:
    """``python ARGS`` in a fresh interpreter, under ``timeout`` and the memory limit."""
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(REPO))
    t0 = time.monotonic()
    p = subprocess.run(
        ["timeout", str(int(timeout)), sys.executable, *args],
        capture_output=True,
        text=True,
        env=env,
        cwd=REPO,
        preexec_fn=_limits,
    )
    return p.returncode, p.stdout, p.stderr, time.monotonic() - t0


class CliServer:
    """``tests/cli_server.py``: each CLI run a forked child of one process that imported
    torch once (see there). One per test module; started again after a run that did not
    get its reply (a test timed out in it), so no later run reads an earlier run's reply."""

    def __init__(self, scratch: Path) -> None:
        self.scratch = scratch
        self.sent = 0
        self.proc = self._start()

    @staticmethod
    def _start() -> subprocess.Popen:
        env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=f"{REPO}:{REPO / 'tests'}")
        return subprocess.Popen(
            [sys.executable, str(REPO / "tests" / "cli_server.py")],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env, cwd=REPO,
            start_new_session=True,
        )  # fmt: skip

    def run(self, argv: list[str], timeout: float = LIMIT_S) -> tuple[int, str, str, float]:
        out, err = self.scratch / "stdout", self.scratch / "stderr"
        self.sent += 1
        req = {"id": self.sent, "argv": argv, "cwd": str(REPO), "stdout": str(out),
               "stderr": str(err), "timeout": int(timeout), "memory": MEMORY}  # fmt: skip
        t0 = time.monotonic()
        assert self.proc.stdin is not None and self.proc.stdout is not None
        try:
            self.proc.stdin.write(json.dumps(req) + "\n")
            self.proc.stdin.flush()
            line = self.proc.stdout.readline()
        except BaseException:
            self.close(kill=True)
            self.proc = self._start()
            raise
        assert line, f"the CLI server exited with {self.proc.wait()}"
        reply = json.loads(line)
        assert reply["id"] == req["id"], (reply, req)
        took = time.monotonic() - t0
        return reply["code"], out.read_text(), err.read_text(), took

    def close(self, *, kill: bool = False) -> None:
        if kill:  # the server and the run it is waiting for
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGKILL)
        elif self.proc.stdin is not None:
            self.proc.stdin.close()
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


_SERVER: list[CliServer] = []


@pytest.fixture(scope="module", autouse=True)
def cli_server(tmp_path_factory) -> Iterator[None]:
    server = CliServer(tmp_path_factory.mktemp("cli"))
    _SERVER.append(server)
    try:
        yield
    finally:
        _SERVER.remove(server)
        server.close()


def cli(*argv: str) -> tuple[int, str, str, float]:
    """``elasticd ckpt ARGV``: exit status, stdout, stderr, seconds."""
    return _SERVER[0].run(["ckpt", *argv])


def refused(result, says: str, *, within: float = 30) -> None:
    code, _, err, took = result
    assert code == 2, err[-2000:]
    assert len(err.strip().splitlines()) == 1, err[-2000:]
    assert says in err, err
    assert took < within, took


def four(ckpt: str, tmp_path: Path, *, hf: bool = True) -> list[tuple[int, str, str, float]]:
    """``verify``, ``inspect``, ``export`` and (with ``hf``) ``export --format hf``."""
    return [
        cli("verify", ckpt),
        cli("inspect", ckpt),
        cli("export", ckpt, str(tmp_path / "raw")),
        *([cli("export", ckpt, str(tmp_path / "hf"), "--format", "hf")] if hf else []),
    ]


def test_many_dimensional_chunks_cannot_make_the_coverage_check_take_memory(ckpt):
    # 4000 unit chunks of 8 dimensions, tiling exactly half of a tensor twice as large
    # would cost 256 corners each: refused before any corner is kept.
    raw = manifest(ckpt)
    (f,) = raw["files"]
    n = 4000
    raw["tensors"]["c"] = {
        "kind": "model",
        "dtype": "uint8",
        "shape": [n] + [1] * 7,
        **listing(raw, [(f, f"k{i}", [i] + [0] * 7, [1] * 8) for i in range(n)]),
    }
    raw["files"][f]["bytes"] += n  # the bytes check is not what stops it
    reseal(ckpt, raw)
    refused(cli("inspect", ckpt), "corners per chunk", within=20)


def test_a_manifest_of_empty_lists_is_refused_before_it_is_parsed(ckpt):
    raw = manifest(ckpt)
    raw["extra"]["x"] = "AMP"
    reseal(ckpt, raw, ("AMP", "[" + ",".join(["[]"] * 400_000) + "]"))
    refused(cli("inspect", ckpt), "JSON lists or objects")


def test_an_integer_of_5000_digits_in_the_manifest_is_one_line(ckpt, tmp_path):
    raw = manifest(ckpt)
    raw["extra"]["x"] = "BIG"
    reseal(ckpt, raw, ("BIG", "9" * 5000))
    for result in four(ckpt, tmp_path):
        refused(result, "not valid JSON")


def test_an_integer_of_5000_digits_in_a_header_is_one_line(ckpt, tmp_path):
    raw = manifest(ckpt)

    def edit(header):
        header["__metadata__"]["big"] = "BIG"
        return json.dumps(header).encode().replace(b'"BIG"', b"9" * 5000)

    rewrite_header(ckpt, raw, edit)
    reseal(ckpt, raw)
    for result in four(ckpt, tmp_path, hf=False):
        refused(result, "header is not valid JSON")


def test_nan_in_a_header_is_refused_by_every_reader(ckpt, tmp_path):
    """A safetensors header is JSON too: NaN (which Python's parser takes) is not."""
    raw = manifest(ckpt)

    def edit(header):
        header["__metadata__"]["x"] = "NAN"
        return json.dumps(header).encode().replace(b'"NAN"', b"NaN")

    rewrite_header(ckpt, raw, edit)
    reseal(ckpt, raw)
    for result in four(ckpt, tmp_path, hf=False):
        refused(result, "header is not valid JSON")


def test_a_dimension_beyond_int64_is_refused_even_in_an_empty_tensor(ckpt, tmp_path):
    raw = manifest(ckpt)
    raw["tensors"]["z"] = {"kind": "model", "dtype": "float32", "shape": [1 << 70, 0],
                           **listing(raw)}  # fmt: skip
    reseal(ckpt, raw)
    refused(cli("export", ckpt, str(tmp_path / "out")), "< 2^63")
    raw = manifest(ckpt)
    raw["tensors"]["z"]["shape"] = [1 << 62, 1 << 62, 1 << 62, 0]  # strides past int64
    reseal(ckpt, raw)
    refused(cli("export", ckpt, str(tmp_path / "out")), "more bytes than an int64")


def test_deep_nesting_is_refused_in_one_line(ckpt, tmp_path):
    raw = manifest(ckpt)
    raw["extra"]["x"] = "NEST"
    reseal(ckpt, raw, ("NEST", "[" * 983 + "]" * 983))
    for result in four(ckpt, tmp_path):
        refused(result, "manifest.json")
    # Nested past the limit, but not dense enough to be refused for that.
    other = str(tmp_path / "other")
    save(other)
    raw = manifest(other)
    raw["extra"]["x"] = "NEST"
    reseal(other, raw, ("NEST", '[{"a": ' * 20 + '"' + "x" * 2000 + '"' + "}]" * 20))
    with pytest.raises(CheckpointError, match=r"nested \d+ deep, more than 32"):
        Manifest.from_json(manifest_path(other).read_bytes(), where="m")


def test_a_tensor_claimed_in_a_huge_missing_file_is_refused_before_it_is_allocated(ckpt):
    raw = manifest(ckpt)
    n = 1 << 46
    evil = "rank-00001.safetensors"  # a name version 4 can list: rank 1's
    raw["files"][evil] = {"bytes": n + 64, "header_sha256": "0" * 64, "rank": 1}
    raw["tensors"]["rank/0/rng"] = {"kind": "rank", "dtype": "uint8", "shape": [n],
                                    **listing(raw, [(evil, "k", [0], [n])], block_rows=n)}  # fmt: skip
    reseal(ckpt, raw)
    code = (
        "import sys\n"
        "from checkpoint import CheckpointError, open_step\n"
        f"c = open_step({ckpt!r})\n"
        "try:\n"
        "    c.rank_state(0)\n"
        "except CheckpointError as exc:\n"
        "    print(exc, file=sys.stderr)\n"
        "    sys.exit(2)\n"
    )
    refused(run(["-c", code]), "rank-00001.safetensors: file is missing")


def test_names_with_newlines_give_one_line_and_a_surrogate_job_prints(ckpt, tmp_path):
    raw = manifest(ckpt)
    raw["tensors"]["w"]["kind"] = "evil"
    raw["tensors"]["w\nforged line"] = raw["tensors"].pop("w")
    reseal(ckpt, raw)
    for result in four(ckpt, tmp_path):
        refused(result, "'w\\nforged line'")

    save(str(tmp_path / "b"))
    raw = manifest(str(tmp_path / "b"))
    (old,) = raw["files"]
    new = "x.safetensors\n"
    raw["files"][new] = raw["files"].pop(old)
    for t in raw["tensors"].values():
        move_chunks(raw, t, new)
    reseal(str(tmp_path / "b"), raw)
    os.rename(Path(step_path(str(tmp_path / "b"), STEP)) / old,
              Path(step_path(str(tmp_path / "b"), STEP)) / new)  # fmt: skip
    refused(cli("verify", str(tmp_path / "b")), "is not a plain")

    save(str(tmp_path / "c"))
    raw = manifest(str(tmp_path / "c"))
    raw["job"] = "\ud800"
    reseal(str(tmp_path / "c"), raw)
    code, out, err, _ = cli("inspect", str(tmp_path / "c"))
    assert code == 0, err
    assert "job '\\ud800'" in out


def test_a_chunk_keyed_metadata_is_refused(tmp_path):
    # Version 3 lists each chunk's key; version 4 makes keys from tensor names and offsets,
    # so `name@offsets`: never `__metadata__` (a tensor of that name is refused below).
    ckpt = str(tmp_path / "ckpt")
    save(ckpt)
    rewrite_as(step_path(ckpt, STEP), 3)
    raw = manifest(ckpt)
    rewrite_header(ckpt, raw, lambda h: json.dumps({**h, "__metadata__": {
        "dtype": "F32", "shape": [64, 4], "data_offsets": "zzz"}}).encode())  # fmt: skip
    raw["tensors"]["w"]["shards"][0]["key"] = "__metadata__"
    reseal(ckpt, raw)
    for result in four(ckpt, tmp_path):
        refused(result, "'__metadata__' is reserved by safetensors")


GPT = {"layers": 1, "hidden": 8, "heads": 2, "ffn_hidden": 16, "vocab": 16, "seq_len": 4,
       "experts": 0, "tie_embeddings": True, "dropout": 0.0}  # fmt: skip


def gpt_ckpt(path: str, **settings) -> None:
    """A checkpoint of the GPT ``GPT`` (with ``settings``) describes, as the trainer saves it."""
    cfg = {**GPT, **settings}
    h, f, v = cfg["hidden"], cfg["ffn_hidden"], cfg["vocab"]
    shapes = {
        "embedding.word_embeddings.weight": (v, h),
        "embedding.position_embeddings.weight": (cfg["seq_len"], h),
        "decoder.final_norm.weight": (h,),
        "decoder.final_norm.bias": (h,),
    }
    for i in range(cfg["layers"]):
        p = f"decoder.layers.{i}"
        shapes.update({
            f"{p}.ln1.weight": (h,), f"{p}.ln1.bias": (h,), f"{p}.ln2.weight": (h,),
            f"{p}.ln2.bias": (h,), f"{p}.attn.qkv.weight": (3, h, h), f"{p}.attn.qkv.bias": (3, h),
            f"{p}.attn.proj.weight": (h, h), f"{p}.attn.proj.bias": (h,),
            f"{p}.mlp.fc1.weight": (f, h), f"{p}.mlp.fc1.bias": (f,),
            f"{p}.mlp.fc2.weight": (h, f), f"{p}.mlp.fc2.bias": (h,),
        })  # fmt: skip
    if not cfg["tie_embeddings"]:
        shapes["output_layer.weight"] = (v, h)
    model = {n: (torch.randn(s), ShardInfo.whole(n, s)) for n, s in shapes.items()}
    save(path, model=model, extra={"model": cfg})


@pytest.mark.parametrize(
    "edit, says",
    [
        (lambda raw: raw["extra"]["model"].update(layers="1"), "layers '1' is not an integer"),
        (lambda raw: raw["extra"]["model"].update(layers=1.0), "layers 1.0 is not an integer"),
        (lambda raw: raw["extra"]["model"].update(layers=-5), "layers -5 is not an integer"),
        (
            lambda raw: raw["extra"]["model"].update(layers=1 << 24),
            "has no tensor decoder.layers.1.",
        ),
        (
            lambda raw: raw["tensors"].__setitem__(
                "decoder.layers.0.attn.qkv.weight",
                {"kind": "model", "dtype": "float32", "shape": [0], **listing(raw)},
            ),
            "needs a floating-point [3, 8, 8]",
        ),
    ],
)
def test_export_hf_checks_the_recorded_model_before_converting(tmp_path, edit, says):
    ck = str(tmp_path / "gpt")
    gpt_ckpt(ck)
    assert cli("export", ck, str(tmp_path / "ok"), "--format", "hf")[0] == 0
    raw = manifest(ck)
    edit(raw)
    reseal(ck, raw)
    refused(cli("export", ck, str(tmp_path / "hf"), "--format", "hf"), says)
    assert not (tmp_path / "hf").exists()


@pytest.mark.parametrize(
    "saved, recorded, says",
    [
        ({"layers": 2}, {"layers": 1}, "leaves out model tensors decoder.layers.1.attn.proj.bias"),
        ({"tie_embeddings": False}, {"tie_embeddings": True},
         "leaves out model tensor output_layer.weight, which"),
    ],
)  # fmt: skip
def test_export_hf_refuses_a_model_tensor_the_recorded_model_leaves_out(
    tmp_path, saved, recorded, says
):
    """`extra.model` of 1 layer over tensors of 2 exported a 1-layer model; a head recorded
    as tied dropped the trained `output_layer.weight`. Both without a word."""
    ck = str(tmp_path / "gpt")
    gpt_ckpt(ck, **saved)
    assert cli("export", ck, str(tmp_path / "ok"), "--format", "hf")[0] == 0
    raw = manifest(ck)
    raw["extra"]["model"].update(recorded)
    reseal(ck, raw)
    refused(cli("export", ck, str(tmp_path / "hf"), "--format", "hf"), says)
    assert not (tmp_path / "hf").exists()


@pytest.mark.parametrize(
    "writer", ["round 4", {"run_id": "r"}, {"run_id": 7, "round": 1}, {"run_id": "r", "round": -1}]
)
def test_a_writer_record_that_is_not_a_run_and_a_round_is_refused(ckpt, writer):
    raw = manifest(ckpt)
    raw["writer"] = writer
    reseal(ckpt, raw)
    refused(cli("inspect", ckpt), "writer")


def test_a_header_entry_of_100k_huge_dimensions_is_refused_at_once_in_a_short_line(ckpt, tmp_path):
    """Multiplying the dimensions out took minutes (and the message held all of them)."""
    raw = manifest(ckpt)

    def edit(header):
        header["zz"] = {"dtype": "F32", "shape": [1 << 62] * 100_000, "data_offsets": [0, 0]}
        return json.dumps(header).encode()

    rewrite_header(ckpt, raw, edit)
    reseal(ckpt, raw)
    for result in four(ckpt, tmp_path, hf=False):
        refused(result, "is not a list of at most 8 integers", within=20)
        assert len(result[2]) < 600, result[2][:600]


def test_a_header_of_empty_lists_is_refused_before_it_is_parsed(ckpt, tmp_path):
    raw = manifest(ckpt)

    def edit(header):
        header["__metadata__"]["x"] = "PAD"
        return json.dumps(header).encode().replace(b'"PAD"', b"[" + b"[]," * 300_000 + b"[]]")

    rewrite_header(ckpt, raw, edit)
    reseal(ckpt, raw)
    for result in four(ckpt, tmp_path, hf=False):
        refused(result, "JSON lists or objects")


@pytest.mark.parametrize(
    "pad, says",
    [
        (b"[" + b"7," * 300_000 + b"7]", "JSON values"),
        (b"[" + b'"ab",' * 300_000 + b'"ab"]', "JSON strings"),  # 11x
        (b"{" + b"".join(b'"%d":"",' % i for i in range(200_000)) + b'"x":""}', "JSON strings"),
    ],
    ids=["numbers", "strings", "keys"],
)
def test_a_header_dense_with_small_values_is_refused_before_it_is_parsed(ckpt, tmp_path, pad, says):
    """Within the header's 100 MiB and its one list or object per 16 bytes, a list of
    short numbers or strings cost 8 to 12 times its size in memory once parsed, and each
    open file kept its own: three files of 99 MiB took `ckpt inspect` to 3.3 GB. Now at
    most one value per 3 bytes and one string per 8 (real headers: one per 10 to 17)."""
    raw = manifest(ckpt)

    def edit(header):
        header["__metadata__"]["x"] = "PAD"
        return json.dumps(header).encode().replace(b'"PAD"', pad)

    rewrite_header(ckpt, raw, edit)
    reseal(ckpt, raw)
    for result in four(ckpt, tmp_path, hf=False):
        refused(result, says)


@pytest.mark.parametrize(
    "junk, says",
    [
        (["ab"] * 400_000, "JSON strings in"),  # 12x its size once parsed
        ([1e-3] * 400_000, "JSON numbers with a fraction or an exponent"),  # 8x
    ],
    ids=["strings", "floats"],
)
def test_a_manifest_dense_with_strings_or_floats_is_refused_before_it_is_parsed(
    ckpt, tmp_path, junk, says
):
    """Within the manifest's 64 MiB and its one list or object per 16 bytes, a list of
    short strings or floats in ``extra`` cost 12 or 8 times its size in memory once
    parsed: a 63 MB manifest took `ckpt inspect` to 1.1 GB (strings) or 813 MB and 12 s
    (floats), and every resuming rank parsed it too. Now at most one string per 8 bytes
    and one float per 64, each plus 65,536 (headers have their bounds already)."""
    raw = manifest(ckpt)
    raw["extra"] = {"junk": junk}
    reseal(ckpt, raw)
    for result in four(ckpt, tmp_path, hf=False):
        refused(result, says)
    code, out, err, _ = cli("ls", ckpt)
    assert code == 0 and says in out, out + err


def test_a_script_may_keep_a_long_list_of_floats_in_extra(tmp_path):
    """The allowance: 60,000 floats (a loss history) in a small manifest's ``extra`` save
    and load; the bound is for manifests made of them."""
    ckpt = str(tmp_path / "ckpt")
    history = [0.001 * i for i in range(60_000)]
    save(ckpt, extra={"losses": history})
    assert cli("verify", ckpt)[0] == 0
    assert Manifest.from_json(manifest_path(ckpt).read_bytes(), where="m").extra == {
        "losses": history
    }


@pytest.mark.parametrize(
    "edit, says",
    [
        (lambda h: h["__metadata__"].update(x=[1.5] * 1000), "not an object of strings"),
        (
            lambda h: h[next(k for k in h if k != "__metadata__")].update(junk=[1.5] * 1000),
            "has fields other than dtype, shape, data_offsets",
        ),
    ],
    ids=["metadata-floats", "entry-field"],
)
def test_numbers_where_a_header_holds_none_refuse_the_file(ckpt, tmp_path, edit, says):
    """A float takes 4 bytes of text and passes the value count; a header holds none:
    ``__metadata__`` is strings only, and this store's entries hold their three fields
    only. Refused once parsed, so no file's header is kept with them."""
    raw = manifest(ckpt)

    def rewrite(header):
        edit(header)
        return json.dumps(header).encode()

    rewrite_header(ckpt, raw, rewrite)
    reseal(ckpt, raw)
    for result in four(ckpt, tmp_path, hf=False):
        refused(result, says)


def test_a_header_with_null_metadata_is_read_as_safetensors_reads_it(tmp_path):
    """safetensors reads ``"__metadata__": null`` as no metadata; so does this reader."""
    from safetensors.torch import load_file

    from checkpoint.stfile import read_header

    path = tmp_path / "null.safetensors"
    text = json.dumps({"__metadata__": None, "w": {"dtype": "F32", "shape": [2],
                                                   "data_offsets": [0, 8]}}).encode()  # fmt: skip
    text += b" " * (-len(text) % 8)
    path.write_bytes(struct.pack("<Q", len(text)) + text + bytes(8))
    assert load_file(str(path))["w"].tolist() == [0.0, 0.0]
    assert read_header(str(path))[1]["w"]["shape"] == [2]


def test_real_headers_are_well_inside_the_density_bounds(tmp_path):
    """The bounds above against what real writers write: this store's header and a
    Hugging Face file with metadata, with a 0-d tensor of a one-letter name and one of
    eight dimensions of 1, the densest entries there are."""
    from safetensors.torch import save_file

    from checkpoint.stfile import HEADER_STRING_BYTES, HEADER_VALUE_BYTES, read_header

    save_file({"a": torch.ones(()), "b": torch.ones(2, 3), "c": torch.ones([1] * 8)},
              str(tmp_path / "hf.safetensors"), metadata={"format": "pt", "note": "x"})  # fmt: skip
    ckpt = str(tmp_path / "ckpt")
    save(ckpt)
    (name,) = manifest(ckpt)["files"]
    for path in (tmp_path / "hf.safetensors", Path(step_path(ckpt, STEP)) / name):
        text = read_header(str(path))[0][8:]
        values = text.count(b",") + text.count(b":")  # none inside a string here
        assert len(text) / values > HEADER_VALUE_BYTES + 1, (path, len(text), values)
        assert len(text) / (text.count(b'"') // 2) > HEADER_STRING_BYTES + 1, path


def test_a_listed_file_no_chunk_uses_is_checked_too(ckpt, tmp_path):
    """``inspect`` says it checks every file's size and header, but opened only the files
    holding chunks: a FIFO listed beside them passed it and ``export``."""
    raw = manifest(ckpt)
    (name,) = raw["files"]
    step = Path(step_path(ckpt, STEP))
    os.mkfifo(step / "rank-00001.safetensors")
    raw["files"]["rank-00001.safetensors"] = dict(raw["files"][name], rank=1)
    reseal(ckpt, raw)
    for result in four(ckpt, tmp_path, hf=False):
        refused(result, "rank-00001.safetensors: not a regular file", within=20)


def test_one_file_listed_under_two_names_is_refused(ckpt, tmp_path):
    """A save writes every file anew: two names of one file (a hard link) are hostile,
    and each would be read (and its header parsed) again."""
    raw = manifest(ckpt)
    (name,) = raw["files"]
    step = Path(step_path(ckpt, STEP))
    again = "rank-00001.safetensors"
    os.link(step / name, step / again)
    raw["files"][again] = dict(raw["files"][name], rank=1)
    (tname,) = raw["tensors"]
    raw["tensors"]["v"] = json.loads(json.dumps(raw["tensors"][tname]))
    move_chunks(raw, raw["tensors"]["v"], again)
    reseal(ckpt, raw)
    for result in four(ckpt, tmp_path, hf=False):
        refused(result, "(a hard link)")


def test_a_tensor_named_like_the_safetensors_metadata_is_refused(ckpt, tmp_path):
    raw = manifest(ckpt)
    raw["tensors"]["__metadata__"] = raw["tensors"].pop("w")
    reseal(ckpt, raw)
    for result in four(ckpt, tmp_path, hf=False):
        refused(result, "the name is reserved by safetensors")


def test_a_commit_number_at_the_limit_fails_the_next_save_in_one_line_losing_nothing(ckpt):
    """A manifest claiming the largest commit number: the next save would have written a
    number no load reads (and later resumes silently went back past every newer step)."""
    from checkpoint import SaveFailedError, committed_steps, load_latest

    raw = manifest(ckpt)
    raw["commit"] = (1 << 63) - 1
    reseal(ckpt, raw)
    saver = Saver(ckpt, group=None, options=SaveOptions(async_=False))
    with pytest.raises(SaveFailedError, match="claims commit number 9223372036854775807"):
        saver.save(step=STEP + 1, consumed_samples=16,
                   model={"w": (W.clone(), ShardInfo.whole("w", (64, 16)))})  # fmt: skip
    saver.abandon()
    assert committed_steps(ckpt) == [STEP]
    out = {"w": (torch.zeros(64, 16), ShardInfo.whole("w", (64, 16)))}
    assert load_latest(ckpt, model=out).step == STEP
    # Past what a manifest may hold (or 4300 digits): not a commit number at all.
    for junk in ("9" * 4300, str(1 << 63)):
        raw = manifest(ckpt)
        raw["commit"] = "JUNK"
        reseal(ckpt, raw, ("JUNK", junk))
        from checkpoint.store import next_commit

        assert next_commit(ckpt) == 1


def test_hostile_step_names_and_unloadable_records_are_skipped(ckpt):
    from checkpoint import committed_steps, load_latest
    from checkpoint.store import read_unloadable

    ckpt_dir = Path(ckpt)
    for stray in (
        "step-\u0660\u0660\u0660\u0660\u0660\u0660\u0660\u0660\u0669",
        "step-000000009\n",
    ):
        (ckpt_dir / stray).mkdir()
        (ckpt_dir / stray / "manifest.json").write_text("{}")
    assert committed_steps(ckpt) == [STEP]
    (ckpt_dir / "unloadable.json").write_text(
        '{"3": {"commit": 1e999}, "\u00b2": {"commit": 1}, "3x": {"commit": 1}}'
    )
    assert read_unloadable(ckpt) == {}
    out = {"w": (torch.zeros(64, 16), ShardInfo.whole("w", (64, 16)))}
    assert load_latest(ckpt, model=out).step == STEP


def test_inspect_shows_a_layout_or_optimizer_of_odd_values_as_read(ckpt):
    raw = manifest(ckpt)
    raw["layout"] = {"world": 1, "spares": 5}
    raw["optimizer"] = {"type": "AdamW", "param_groups": 1.5}
    reseal(ckpt, raw)
    code, out, err, _ = cli("inspect", ckpt)
    assert code == 0 and "spares -" in out, err[-2000:]


def test_a_header_whose_metadata_holds_json_in_a_string_is_not_taken_for_a_dense_one(tmp_path):
    """Brackets inside strings are no lists: a real file may keep its config, JSON, as a
    metadata string (3,000 small lists in 15 KB, far past one per 16 bytes)."""
    from safetensors.torch import save_file

    from checkpoint.stfile import read_header

    path = str(tmp_path / "model.safetensors")
    config = json.dumps({"layers": [[1]] * 3000, "quote": 'a "quoted" \\ word'})
    save_file({"w": torch.ones(4)}, path, metadata={"config": config})
    _, header = read_header(path)
    assert json.loads(header["__metadata__"]["config"]) == json.loads(config)


def test_a_long_name_over_many_chunks_is_refused_before_a_key_is_made(tmp_path):
    """Version 4 makes each chunk's key from its tensor's name: a 16 MiB name over 64,000
    empty strips (a 16 MB manifest) would ask for 1 TiB of keys. Counted and refused in one
    line first (the CLI runs under the address-space limit: it died of MemoryError)."""
    ckpt = str(tmp_path / "ckpt")
    save(ckpt)
    raw = manifest(ckpt)
    (rank,) = {row[0] for row in raw["tensors"]["w"]["regions"]}
    raw["tensors"]["n" * (16 << 20)] = {
        "kind": "model", "dtype": "float32", "shape": [0, 64 * 1000], "block_bytes": 16384,
        "regions": [[rank, 0, 64 * i, 0, 64, 64] for i in range(1000)],
    }  # fmt: skip
    reseal(ckpt, raw)
    refused(cli("inspect", ckpt), "keys would take 10737418240")


def _walked_depth(value, limit: int = 32) -> int:
    """The nesting of a parsed value, walked (what parse_json computed before it read the
    text instead), capped one past ``limit`` as parse_json's is."""
    if isinstance(value, dict):
        value = list(value.values())
    if not isinstance(value, list):
        return 0
    return min(limit + 1, 1 + max((_walked_depth(v, limit) for v in value), default=0))


_TRICKY_TEXT = st.text(alphabet=st.sampled_from('[]{}"\\/,:ab \n\t\u00e9\u2028\U0001f600'),
                       max_size=8)  # fmt: skip
_JSON_VALUES = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | _TRICKY_TEXT,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(_TRICKY_TEXT, inner, max_size=4),
    max_leaves=60,
)


@settings(max_examples=400, deadline=None)
@given(value=_JSON_VALUES, ascii_only=st.booleans(), indent=st.sampled_from([None, 0, 2]),
       wrap=st.integers(0, 40))  # fmt: skip
def test_the_depth_read_from_the_text_is_the_depth_of_the_value(value, ascii_only, indent, wrap):
    from checkpoint.manifest import _depth

    for _ in range(wrap):  # past MAX_DEPTH too: both stop one past it
        value = [value] if wrap % 2 else {'[{\\"': value}
    text = json.dumps(value, ensure_ascii=ascii_only, indent=indent)
    assert _depth(text.encode("utf-8", "surrogatepass")) == _walked_depth(json.loads(text))


def test_the_depth_of_large_text_of_strings_and_brackets_is_exact():
    from checkpoint.manifest import MAX_DEPTH, _depth

    # Text the parse accepts: many strings full of brackets and escapes (cut out in one
    # scan), and a comb of containers nested to the limit (each pass of the count
    # removes one level of all of them).
    strings = json.dumps(['[{\\"' * 8] * 200_000).encode()
    comb = b"[" + b",".join([b"[" * 31 + b"]" * 31] * 20_000) + b"]"
    assert _depth(strings) == 1 and _depth(comb) == MAX_DEPTH


@pytest.mark.parametrize("encoding", ["utf-16-le", "utf-16", "utf-32"])
def test_json_that_is_not_utf_8_is_refused(encoding):
    # json.loads takes UTF-16 and UTF-32 bytes too; the depth read from the text does
    # not. Here the UTF-16 of "\u2200" holds a quote byte: it was accepted 41 deep.
    from checkpoint.errors import FormatError
    from checkpoint.manifest import parse_json

    text = json.dumps(["\u2200", json.loads("[" * 40 + "]" * 40), "\u2200"])
    with pytest.raises(FormatError, match="not valid JSON"):
        parse_json(text.encode(encoding), "m", max_bytes=1 << 20, error=FormatError)
    with pytest.raises(FormatError, match="nested 33 deep, more than 32"):
        parse_json(text.encode(), "m", max_bytes=1 << 20, error=FormatError)


def test_a_step_whose_manifest_names_another_step_is_refused_by_every_reader(tmp_path):
    """A copy of step 3 named step-000000009: `verify`, `inspect` and `export` (also
    `--format hf`) took it for step 9 (only a resume refused it)."""
    import shutil

    ck = str(tmp_path / "gpt")
    gpt_ckpt(ck)
    shutil.copytree(step_path(ck, STEP), step_path(ck, 9))
    for result in four(step_path(ck, 9), tmp_path):
        refused(result, "step-000000009: manifest step 3 is not the step of its directory")
    refused(cli("verify", ck, "--step", "9"), "manifest step 3 is not the step of its directory")
    assert not (tmp_path / "raw").exists() and not (tmp_path / "hf").exists()


@pytest.mark.parametrize("constant", [float("nan"), float("inf"), float("-inf")])
@pytest.mark.parametrize("field", ["layout", "extra"])
def test_nan_or_infinity_in_a_manifest_is_refused(ckpt, tmp_path, constant, field):
    """Not JSON, though Python's parser takes it: a NaN in `layout` never equals the
    run's own, so a resume took the layout for changed (and reseeded its generators)."""
    raw = manifest(ckpt)
    raw[field] = {"tp": constant}
    reseal(ckpt, raw)  # json.dumps writes NaN, Infinity, -Infinity
    word = json.dumps(constant)
    for result in four(ckpt, tmp_path):
        refused(result, f"not valid JSON ({word} is not a JSON value)")


def test_an_empty_region_is_one_strip_and_verify_counts_chunks_no_file_holds(tmp_path):
    """An empty [0, n] tensor listed as n/64 empty regions of 64 strips each (a 0.9 MB
    manifest for 2 Mi chunks) took `ckpt verify` 1.2 GB and a minute: now an empty region
    of more than 8 strips (what older writers cut) is refused, and the chunks that no file
    holds cost verify a count, one problem for the file, not one each."""
    ck = str(tmp_path / "ckpt")
    save(ck)
    raw = manifest(ck)
    n = 64 * 20000
    rows = [[0, 0, c, 0, 64, 64] for c in range(0, n, 64)]
    raw["tensors"]["z"] = {"kind": "model", "dtype": "float32", "shape": [0, n],
                           "block_bytes": 16384, "regions": rows}  # fmt: skip
    reseal(ck, raw)
    for result in four(ck, tmp_path, hf=False):
        refused(result, "tensor z: region at [0, 0]: 64 strips, not an integer from 1 to 8")
    for row in rows:
        row[-1] = 1
    reseal(ck, raw)
    # w is cut into 4 strips: its file holds 4 tensors, the manifest lists 20004 in it.
    refused(cli("verify", ck), "1 problem found: ")
    refused(cli("verify", ck), "the manifest lists 20004 chunks in it, its header holds 4 tensors")
    refused(cli("inspect", ck), "z@0_0: missing or not as the manifest says")


def test_the_writer_cuts_an_empty_region_into_one_strip(tmp_path):
    """With no bytes a column, an empty region would be cut into as many strips as
    ``chunk_max_pieces`` allows when ``chunk_min_bytes`` is 0: a manifest a load refuses."""
    from checkpoint import open_step, verify

    ck = str(tmp_path / "ckpt")
    saver = Saver(ck, group=None, options=SaveOptions(async_=False, chunk_min_bytes=0))
    e = torch.zeros(0, 64)
    saver.save(step=STEP, consumed_samples=1, model={"e": (e, ShardInfo.whole("e", (0, 64)))})
    saver.close()
    assert manifest(ck)["tensors"]["e"]["regions"] == [[0, 0, 0, 0, 64, 1]]
    assert verify(open_step(ck)) == []


def test_an_empty_region_an_older_writer_cut_into_8_strips_still_loads(tmp_path, monkeypatch):
    """Writers before the one-strip rule, given ``chunk_min_bytes=0``, cut an empty region
    into ``chunk_max_pieces`` (8) strips: such a step must still verify and load, not be
    marked unloadable and pruned."""
    import checkpoint.save as save_mod
    from checkpoint import load_latest, open_step, verify

    real = save_mod.build_save_plan
    monkeypatch.setattr(save_mod, "build_save_plan",
                        lambda *a, **kw: real(*a, **{**kw, "chunk_min_bytes": 0}))  # fmt: skip
    ck = str(tmp_path / "ckpt")
    saver = Saver(ck, group=None, options=SaveOptions(async_=False))
    w = torch.arange(8.0).reshape(2, 4)
    model = {"e": (torch.zeros(0, 64), ShardInfo.whole("e", (0, 64))),
             "w": (w, ShardInfo.whole("w", (2, 4)))}  # fmt: skip
    saver.save(step=STEP, consumed_samples=1, model=model)
    saver.close()
    assert manifest(ck)["tensors"]["e"]["regions"] == [[0, 0, 0, 0, 64, 8]]
    assert verify(open_step(ck)) == []
    into = {"e": (torch.ones(0, 64), ShardInfo.whole("e", (0, 64))),
            "w": (torch.zeros(2, 4), ShardInfo.whole("w", (2, 4)))}  # fmt: skip
    assert load_latest(ck, model=into).step == STEP
    assert torch.equal(into["w"][0], w)


def test_a_huge_tensor_in_a_sparse_file_is_refused_in_one_line_not_allocated(tmp_path):
    """A re-sealed manifest adds a 64 GiB float32 model tensor whose file is sparse: its
    size, header, header sha256 and block checksums all hold, on 4 KiB of disk. `ckpt
    export` handed its shape to torch.empty and died in a traceback; now a tensor larger
    than the machine's available memory, or one torch cannot allocate, is one line."""
    import crc32c

    ckpt = str(tmp_path / "ckpt")
    save(ckpt)
    raw = manifest(ckpt)
    step = Path(step_path(ckpt, STEP))
    rows, cols = 1 << 16, 1 << 18
    nbytes, block = rows * cols * 4, 1 << 30
    c = 0
    zeros = bytes(1 << 24)
    for _ in range(block // len(zeros)):
        c = crc32c.crc32c(zeros, c)
    key = "evil.weight@0_0"
    header = {key: {"dtype": "F32", "shape": [rows, cols], "data_offsets": [0, nbytes]},
              "__metadata__": {"format": "pt", "writer": "elasticd",
                               f"crc32c:{key}": f"{c:08x}" * (nbytes // block)}}  # fmt: skip
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    head = struct.pack("<Q", len(text)) + text
    evil = step / "rank-00001.safetensors"
    with open(evil, "wb") as f:
        f.write(head)
        f.truncate(len(head) + nbytes)  # sparse: no disk used
    raw["files"][evil.name] = {"bytes": len(head) + nbytes, "rank": 1,
                               "header_sha256": hashlib.sha256(head).hexdigest()}  # fmt: skip
    raw["tensors"]["evil.weight"] = {"kind": "model", "dtype": "float32", "shape": [rows, cols],
                                     "block_bytes": block, "regions": [[1, 0, 0, rows, cols, 1]]}  # fmt: skip
    raw["world"] = max(raw["world"], 2)
    reseal(ckpt, raw)
    assert os.stat(evil).st_blocks * 512 < 1 << 20
    refused(cli("export", ckpt, str(tmp_path / "out")), "evil.weight: ")


def _cgroup_tree(root, files):
    for rel, text in files.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)


def test_a_memory_cgroup_limit_caps_what_a_load_may_allocate(tmp_path):
    """MemAvailable is the host's: in a container limited to 2 GiB on a 1 TB host a
    hostile or oversized tensor passed the check and the process was OOM-killed instead of
    refused. The cgroup files are laid out as the kernel does (v2 unified; v1 memory
    controller), so this reads them as it would on a node: the smallest headroom of the
    process's cgroup and its ancestors wins, and page cache is not counted as used."""
    from checkpoint.load import cgroup_headroom

    gib = 1 << 30
    v2 = tmp_path / "v2"
    _cgroup_tree(v2, {
        "proc": "0::/kubepods/pod1/ctr\n",
        "fs/kubepods/pod1/ctr/memory.max": "max\n",
        "fs/kubepods/pod1/memory.max": f"{2 * gib}\n",
        "fs/kubepods/pod1/memory.current": f"{gib}\n",
        "fs/kubepods/pod1/memory.stat": f"anon 123\nfile {gib // 2}\nkernel 7\nshmem 0\n",
        "fs/kubepods/memory.max": f"{64 * gib}\n",
        "fs/memory.max": "max\n",
    })  # fmt: skip
    # 2 GiB limit, 1 GiB used of which half is page cache: 1.5 GiB of room.
    assert cgroup_headroom(str(v2 / "proc"), str(v2 / "fs")) == 3 * gib // 2
    # Inside a cgroup namespace the path is "/" and the container's own files are at the top.
    _cgroup_tree(v2, {"ns": "0::/\n", "top/memory.max": f"{gib}\n", "top/memory.current": "0\n"})
    assert cgroup_headroom(str(v2 / "ns"), str(v2 / "top")) == gib
    v1 = tmp_path / "v1"
    _cgroup_tree(v1, {
        "proc": "12:pids:/x\n4:memory:/slurm/uid_0/job_7\n1:name=systemd:/x\n0::/\n",
        "fs/memory/slurm/uid_0/job_7/memory.limit_in_bytes": f"{4 * gib}\n",
        "fs/memory/slurm/uid_0/job_7/memory.usage_in_bytes": f"{5 * gib}\n",
        "fs/memory/slurm/uid_0/job_7/memory.stat": f"cache 1\ntotal_cache {2 * gib}\n",
        "fs/memory/memory.limit_in_bytes": "9223372036854771712\n",
    })  # fmt: skip
    assert cgroup_headroom(str(v1 / "proc"), str(v1 / "fs")) == gib
    # Over the limit in anonymous memory: no room (never negative); no limit anywhere: None.
    _cgroup_tree(v1, {"fs/memory/slurm/uid_0/job_7/memory.stat": "total_cache 0\n"})
    assert cgroup_headroom(str(v1 / "proc"), str(v1 / "fs")) == 0
    # /dev/shm is in the cache but cannot be reclaimed: 2 GiB cache of which 1 GiB shmem.
    _cgroup_tree(v1, {"fs/memory/slurm/uid_0/job_7/memory.stat":
                      f"total_cache {2 * gib}\ntotal_shmem {gib}\n"})  # fmt: skip
    assert cgroup_headroom(str(v1 / "proc"), str(v1 / "fs")) == 0  # 4 - (5 - 1)
    _cgroup_tree(v1, {"fs/memory/slurm/uid_0/job_7/memory.usage_in_bytes": f"{3 * gib}\n"})
    assert cgroup_headroom(str(v1 / "proc"), str(v1 / "fs")) == 2 * gib  # 4 - (3 - 1)
    _cgroup_tree(v1, {"free": "4:memory:/nowhere\n0::/\n"})
    assert cgroup_headroom(str(v1 / "free"), str(v1 / "fs")) is None
    assert cgroup_headroom(str(tmp_path / "absent"), str(v1 / "fs")) is None


def test_a_tensor_over_the_cgroup_limit_is_refused_in_one_line(tmp_path, monkeypatch):
    """The refusal through the real read path (what `ckpt export` assembles a tensor with)
    when the cgroup is what is short."""
    from checkpoint import load as load_module
    from checkpoint import open_step
    from checkpoint.errors import CheckpointReadError

    ckpt = str(tmp_path / "ckpt")
    save(ckpt)
    monkeypatch.setattr(load_module, "cgroup_headroom", lambda: 8)
    with pytest.raises(
        CheckpointReadError, match=r": w: needs 0\.0 GB of memory, this process has"
    ):
        open_step(ckpt).read("w")
    monkeypatch.setattr(load_module, "cgroup_headroom", lambda: W.nbytes)
    assert torch.equal(open_step(ckpt).read("w"), W)
