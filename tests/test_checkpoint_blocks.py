"""Format versions 3 and 4: regions stored as strips, each checked per block of whole rows,
so a verified resharded load reads and checks only what it needs; version 4 keeps the block
checksums in each file's header, not in the manifest; versions 2 and 3 still load."""

from __future__ import annotations

import hashlib
import json
import os
import struct
import sys
from pathlib import Path

import crc32c
import pytest
import torch
from ckpt_versions import rewrite_as
from hypothesis import given, settings
from hypothesis import strategies as st

from checkpoint import (
    Checkpoint,
    CorruptCheckpointError,
    FormatError,
    SaveOptions,
    Saver,
    ShardInfo,
    load_latest,
    open_step,
    verify,
)
from checkpoint.manifest import MAX_BLOCK_BYTES
from checkpoint.planner import block_rows, blocks_for_rows, coverage_problem, strip_grid
from checkpoint.store import step_path

ROWS, COLS = 256, 64
FULL = torch.arange(ROWS * COLS, dtype=torch.float32).view(ROWS, COLS)
# 16 strips of 4 columns (4 KiB each), rows of 16 bytes, blocks of 64 rows (1 KiB).
OPTIONS = dict(chunk_min_bytes=4096, chunk_max_pieces=16, block_bytes=1024)


def save(ckpt: str) -> None:
    saver = Saver(ckpt, group=None, options=SaveOptions(async_=False, **OPTIONS))
    saver.save(
        step=1, consumed_samples=1, model={"w": (FULL.clone(), ShardInfo.whole("w", (ROWS, COLS)))}
    )
    saver.close()


def part(dim: int, index: int, parts: int) -> tuple[torch.Tensor, ShardInfo]:
    info = ShardInfo.split("w", (ROWS, COLS), dim, index, parts)
    return torch.full(info.sizes, float("nan")), info


def header_bytes(path: Path) -> int:
    with open(path, "rb") as f:
        return 8 + struct.unpack("<Q", f.read(8))[0]


def data_path(ckpt: str) -> Path:
    return Path(step_path(ckpt, 1)) / "rank-00000.safetensors"


def file_header(ckpt: str) -> dict:
    path = data_path(ckpt)
    with open(path, "rb") as f:
        f.seek(8)
        return json.loads(f.read(header_bytes(path) - 8))


def reseal(mpath: Path, raw: dict) -> None:
    raw.pop("checksum", None)
    canon = json.dumps(raw, sort_keys=True, separators=(",", ":")).encode()
    raw["checksum"] = hashlib.sha256(canon).hexdigest()
    mpath.write_text(json.dumps(raw))


def test_the_writer_records_strips_and_a_crc_per_block_in_the_file_header(tmp_path):
    ckpt = str(tmp_path)
    save(ckpt)
    manifest = open_step(ckpt).manifest
    assert manifest.version == 4
    entry = manifest.tensors["w"]
    assert [c.sizes for c in entry.chunks] == [(ROWS, 4)] * 16
    assert all(entry.rows_per_block(c) == 64 for c in entry.chunks)
    assert entry.crc32 == {} and entry.blocks(entry.chunks[0]) == 4
    raw = json.loads((Path(step_path(ckpt, 1)) / "manifest.json").read_text())
    # One region, cut into 16 strips (its keys and file follow), no checksums.
    assert raw["tensors"]["w"] == {
        "kind": "model",
        "dtype": "float32",
        "shape": [ROWS, COLS],
        "block_bytes": 1024,
        "regions": [[0, 0, 0, ROWS, COLS, 16]],  # [rank, *offsets, *sizes, strips]
    }
    strip = FULL[:, :4].contiguous()
    expected = "".join(
        f"{crc32c.crc32c(strip[r : r + 64].numpy().tobytes()):08x}" for r in (0, 64, 128, 192)
    )
    assert file_header(ckpt)["__metadata__"]["crc32c:w@0_0"] == expected
    assert verify(open_step(ckpt)) == []


def test_the_manifest_does_not_grow_with_the_bytes(tmp_path):
    """Version 3 kept 8 hex digits per 16 KiB block in the manifest: over its 64 MiB bound
    from about 128 GiB of state on, committed and then refused by every load. Version 4's
    manifest is the same size for a tensor 64 times larger (the checksums grow in the
    file's header, which only the ranks reading that file read)."""
    sizes = {}
    for rows in (64, 4096):
        ckpt = str(tmp_path / str(rows))
        options = SaveOptions(async_=False, chunk_max_pieces=1)  # one chunk either way
        saver = Saver(ckpt, group=None, options=options)
        t = torch.ones(rows, 1024)  # 256 KiB and 16 MiB, one row = 4 KiB: 16 and 1024 blocks
        saver.save(step=1, consumed_samples=1, model={"w": (t, ShardInfo.whole("w", t.shape))})
        saver.close()
        sizes[rows] = (Path(step_path(ckpt, 1)) / "manifest.json").stat().st_size
        with Checkpoint.open(step_path(ckpt, 1)) as ck:
            assert torch.equal(ck.read("w"), t)
    assert abs(sizes[4096] - sizes[64]) < 64, sizes


@pytest.mark.parametrize(("dim", "parts"), [(0, 4), (0, 2), (1, 8), (1, 16)])
def test_a_verified_resharded_load_reads_only_the_blocks_it_needs(tmp_path, dim, parts):
    ckpt = str(tmp_path)
    save(ckpt)
    head = header_bytes(data_path(ckpt))
    for index in range(parts):
        local, info = part(dim, index, parts)
        with Checkpoint.open(step_path(ckpt, 1)) as ck:
            stats = ck.load_into({"w": (local, info)})
        region = tuple(slice(o, o + s) for o, s in zip(info.offsets, info.sizes, strict=True))
        assert torch.equal(local, FULL[region])
        # The cuts fall on block and strip boundaries: exactly the needed bytes are read.
        assert stats.bytes_read - head == stats.bytes_needed == local.numel() * 4


def test_a_load_cuts_the_chunks_of_the_regions_it_reads_and_no_other(tmp_path, monkeypatch):
    """At 1024 ranks a manifest lists a million chunks, and a rank resuming reads a few
    regions: parsing the manifest makes no chunk (its regions are checked), and a load
    cuts only the strips of the regions it reads, not those of every tensor."""
    import checkpoint.manifest as manifest_mod

    ckpt = str(tmp_path)
    saver = Saver(ckpt, group=None, options=SaveOptions(async_=False, **OPTIONS))
    model = {n: (FULL.clone(), ShardInfo.whole(n, (ROWS, COLS))) for n in ("w", "v")}
    saver.save(step=1, consumed_samples=1, model=model)
    saver.close()
    made = []
    real = manifest_mod.SavedChunk
    monkeypatch.setattr(manifest_mod, "SavedChunk", lambda **kw: made.append(kw) or real(**kw))
    with Checkpoint.open(step_path(ckpt, 1)) as ck:
        assert made == [] and len(ck.manifest.tensors["w"].chunks) == 16
        local, info = part(0, 1, 4)
        ck.load_into({"w": (local, info)})
        assert torch.equal(local, FULL[64:128])
        assert len(made) == 16 and {kw["key"].split("@")[0] for kw in made} == {"w"}
        # Every chunk of every tensor, cut a region at a time and not kept (a manifest of
        # millions of chunks no file holds stops at the first): cut again by each walk.
        ck.check_files()
        assert len(made) == 16 + 32
        ck.check_files()
        assert len(made) == 16 + 32 + 32


def test_a_cut_inside_a_block_reads_the_whole_block_and_no_more(tmp_path):
    ckpt = str(tmp_path)
    save(ckpt)
    info = ShardInfo("w", (ROWS, COLS), (10, 0), (100, COLS))  # rows 10..109: blocks 0, 1
    local = torch.empty(info.sizes)
    with Checkpoint.open(step_path(ckpt, 1)) as ck:
        stats = ck.load_into({"w": (local, info)})
    assert torch.equal(local, FULL[10:110])
    assert stats.bytes_read - header_bytes(data_path(ckpt)) == 128 * COLS * 4


def test_corruption_fails_a_load_that_reads_its_block_and_no_other(tmp_path):
    ckpt = str(tmp_path)
    save(ckpt)
    path = data_path(ckpt)
    head = header_bytes(path)
    with open(path, "rb") as f:
        f.seek(8)
        entries = json.loads(f.read(head - 8))
    begin = entries["w@0_0"]["data_offsets"][0]
    blob = bytearray(path.read_bytes())
    blob[head + begin + 200 * 16] ^= 0x40  # row 200 of the first strip: block 3
    path.write_bytes(bytes(blob))
    local, info = part(0, 0, 4)  # rows 0..63: block 0 only
    with Checkpoint.open(step_path(ckpt, 1)) as ck:
        ck.load_into({"w": (local, info)})
    assert torch.equal(local, FULL[:64])
    local, info = part(0, 3, 4)  # rows 192..255: the damaged block
    with pytest.raises(CorruptCheckpointError, match=r"w@0_0: checksum mismatch"):
        load_latest(ckpt, model={"w": (local, info)}, warn=lambda _m: None)
    problems = verify(open_step(ckpt))
    assert len(problems) == 1 and "w@0_0: checksum mismatch" in problems[0]


@pytest.mark.parametrize("version", [2, 3])
def test_an_older_version_still_loads_resharded_verifies_and_finds_corruption(tmp_path, version):
    ckpt = str(tmp_path)
    save(ckpt)
    rewrite_as(step_path(ckpt, 1), version)
    assert open_step(ckpt).manifest.version == version
    assert verify(open_step(ckpt)) == []
    local, info = part(0, 1, 4)
    with Checkpoint.open(step_path(ckpt, 1)) as ck:
        stats = ck.load_into({"w": (local, info)})
    assert torch.equal(local, FULL[64:128])
    # Version 3 reads the blocks holding the rows needed; version 2 checks each chunk whole,
    # so a quarter of its rows costs every strip whole.
    needed = local.numel() * 4 if version == 3 else FULL.numel() * 4
    assert stats.bytes_read - header_bytes(data_path(ckpt)) == needed
    corrupt(ckpt, "w@0_0", 70)  # block 1 of strip 0: rows 64..127, read above
    mismatch_found(ckpt, "w@0_0", local, info)


@pytest.mark.parametrize("version", [2, 3, 4])
@pytest.mark.parametrize("read_bytes", [512, 1000, 3000, 8 << 20])
def test_verify_reads_in_bounded_pieces_whatever_the_block_size(
    tmp_path, monkeypatch, version, read_bytes
):
    """`ckpt verify` reads at most READ_BYTES at a time: whole blocks when they fit (1 KiB
    blocks here, version 3), else each block's CRC carried across reads (a version 2
    chunk is one 4 KiB block). Every case checks the good file, then finds a flipped byte
    in the middle of a block."""
    import checkpoint.verify  # noqa: F401 - the package's `verify` is the function

    ckpt = str(tmp_path)
    save(ckpt)
    if version < 4:
        rewrite_as(step_path(ckpt, 1), version)
    monkeypatch.setattr(sys.modules["checkpoint.verify"], "READ_BYTES", read_bytes)
    assert verify(open_step(ckpt)) == []
    blob = bytearray(data_path(ckpt).read_bytes())
    blob[header_bytes(data_path(ckpt)) + 5 * 4096 + 700] ^= 1  # strip 5, inside a block
    data_path(ckpt).write_bytes(bytes(blob))
    problems = verify(open_step(ckpt))
    assert len(problems) == 1 and "checksum mismatch" in problems[0], problems


def test_a_crc_string_of_the_wrong_length_is_refused_in_a_version_3_manifest(tmp_path):
    ckpt = str(tmp_path)
    save(ckpt)
    rewrite_as(step_path(ckpt, 1), 3)
    mpath = Path(step_path(ckpt, 1)) / "manifest.json"
    raw = json.loads(mpath.read_text())
    raw["tensors"]["w"]["shards"][0]["block_rows"] = 32  # 8 blocks, 4 checksums
    reseal(mpath, raw)
    with pytest.raises(FormatError, match="is not 64 hex digits"):
        open_step(ckpt)


def mismatch_found(ckpt: str, key: str, local: torch.Tensor, info: ShardInfo) -> None:
    """A load of ``info``'s region fails on chunk ``key``'s checksum, and verify names it
    as the one problem."""
    with (
        Checkpoint.open(step_path(ckpt, 1)) as ck,
        pytest.raises(CorruptCheckpointError, match=rf"{key}: checksum mismatch"),
    ):
        ck.load_into({"w": (local, info)})
    problems = verify(open_step(ckpt))
    assert len(problems) == 1 and f"{key}: checksum mismatch" in problems[0], problems


def rewrite_header(ckpt: str, change) -> None:
    """Apply ``change`` to the file's parsed header, write it back (the data unchanged) and
    re-seal the manifest's ``header_sha256`` and ``bytes``: what a hostile writer can do."""
    path = data_path(ckpt)
    blob = path.read_bytes()
    head = header_bytes(path)
    parsed = file_header(ckpt)
    change(parsed)
    text = json.dumps(parsed, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    new = struct.pack("<Q", len(text)) + text
    path.write_bytes(new + blob[head:])
    mpath = Path(step_path(ckpt, 1)) / "manifest.json"
    raw = json.loads(mpath.read_text())
    raw["files"][path.name].update(
        bytes=len(new) + len(blob) - head, header_sha256=hashlib.sha256(new).hexdigest()
    )
    reseal(mpath, raw)


@pytest.mark.parametrize(
    "change",
    [
        pytest.param(lambda h: h["__metadata__"].pop("crc32c:w@0_4"), id="missing"),
        pytest.param(
            lambda h: h["__metadata__"].update({"crc32c:w@0_4": "0" * 24}), id="too-short"
        ),
        pytest.param(lambda h: h["__metadata__"].update({"crc32c:w@0_4": "G" * 32}), id="not-hex"),
    ],
)
def test_a_header_without_valid_checksums_is_refused_in_one_line(tmp_path, change):
    """Version 4: a chunk's file header (re-sealed in the manifest) whose checksums for it
    are missing or malformed is refused by a load, by `check_files` (inspect, export) and
    by `verify`, each naming the file and the chunk."""
    ckpt = str(tmp_path)
    save(ckpt)
    rewrite_header(ckpt, change)
    local, info = part(1, 1, 16)  # strip 1: w@0_4
    with (
        Checkpoint.open(step_path(ckpt, 1)) as ck,
        pytest.raises(CorruptCheckpointError, match=r"'?w@0_4'?: the header does not hold"),
    ):
        ck.load_into({"w": (local, info)})
    with (
        Checkpoint.open(step_path(ckpt, 1)) as ck,
        pytest.raises(CorruptCheckpointError, match=r"the header does not hold its 4 block"),
    ):
        ck.check_files()
    problems = verify(open_step(ckpt))
    assert any("w@0_4" in p and "does not hold" in p for p in problems), problems
    local, info = part(1, 0, 16)  # strip 0: its checksums are intact
    with Checkpoint.open(step_path(ckpt, 1)) as ck:
        ck.load_into({"w": (local, info)})
    assert torch.equal(local, FULL[:, :4])


@pytest.mark.parametrize(
    "change",
    [
        pytest.param(
            lambda h: h["__metadata__"].update({"crc32c:w@0_4": ["0" * 32]}), id="not-a-string"
        ),
        pytest.param(lambda h: h["__metadata__"].update({"n": 1.5}), id="a-number"),
        pytest.param(lambda h: h.update({"__metadata__": "x"}), id="no-metadata-object"),
    ],
)
def test_a_header_whose_metadata_is_not_an_object_of_strings_is_refused_whole(tmp_path, change):
    """safetensors' own reader takes only strings in ``__metadata__``; no writer makes
    anything else, so the file is refused at its header by every reader, each strip of it
    (before, a list of numbers there was parsed and kept for as long as the file was open:
    a 100 MB header of them took a reader over 1 GB)."""
    ckpt = str(tmp_path)
    save(ckpt)
    rewrite_header(ckpt, change)
    said = "header's __metadata__ is not an object of strings"
    for strip in (0, 1):
        local, info = part(1, strip, 16)
        with (
            Checkpoint.open(step_path(ckpt, 1)) as ck,
            pytest.raises(CorruptCheckpointError, match=said),
        ):
            ck.load_into({"w": (local, info)})
    with (
        Checkpoint.open(step_path(ckpt, 1)) as ck,
        pytest.raises(CorruptCheckpointError, match=said),
    ):
        ck.check_files()
    problems = verify(open_step(ckpt))
    assert any(said in p for p in problems), problems


def test_a_checksum_changed_in_the_header_and_resealed_fails_the_block(tmp_path):
    """The header's checksums are data like any other: one re-sealed to a wrong value fails
    the load of that block (and verify), never lets the block through unchecked."""
    ckpt = str(tmp_path)
    save(ckpt)

    def change(h):
        text = h["__metadata__"]["crc32c:w@0_8"]
        h["__metadata__"]["crc32c:w@0_8"] = text[:8] + f"{int(text[8:16], 16) ^ 1:08x}" + text[16:]

    rewrite_header(ckpt, change)
    local, info = part(0, 1, 4)  # rows 64..127: block 1
    mismatch_found(ckpt, "w@0_8", local, info)


@settings(max_examples=150, deadline=None)
@given(
    shape=st.lists(st.integers(0, 40), min_size=0, max_size=3).map(tuple),
    itemsize=st.sampled_from([1, 2, 4]),
    min_bytes=st.integers(1, 400),
    max_pieces=st.sampled_from([1, 4, 16]),
)
def test_strips_tile_their_region_and_blocks_cover_the_rows(shape, itemsize, min_bytes, max_pieces):
    box = ((0,) * len(shape), shape)
    strips = strip_grid(box, itemsize=itemsize, min_bytes=min_bytes, max_pieces=max_pieces)
    assert coverage_problem("t", shape, strips) is None
    assert len(strips) <= max_pieces
    if len(strips) > 1:
        assert min(torch.Size(s).numel() * itemsize for _, s in strips) >= min_bytes
        assert all(s[0] == shape[0] and s[2:] == shape[2:] for _, s in strips)
    for _, sizes in strips:
        per = block_rows(sizes, itemsize=itemsize, block_bytes=min_bytes)
        rows = sizes[0] if sizes else 1
        got = blocks_for_rows(slice(0, rows), per)
        assert rows == 0 or (got.start == 0 and (got.stop - 1) * per < rows <= got.stop * per)


def corrupt(ckpt: str, key: str, row: int) -> None:
    """Flip a bit in ``row`` of chunk ``key`` (rows of 4 float32 columns: 16 bytes)."""
    path = data_path(ckpt)
    head = header_bytes(path)
    with open(path, "rb") as f:
        f.seek(8)
        entries = json.loads(f.read(head - 8))
    blob = bytearray(path.read_bytes())
    blob[head + entries[key]["data_offsets"][0] + row * 16 + 5] ^= 0x10
    path.write_bytes(bytes(blob))


def test_strips_side_by_side_are_copied_in_one_strided_copy_per_piece(tmp_path, monkeypatch):
    """A region that cuts strips and blocks: the partial strips alone, the whole ones in
    between as one run (one copy per piece), pieces smaller than the run's rows."""
    import checkpoint.load as load

    monkeypatch.setattr(load, "PIECE_BYTES", 4 * 1024)  # 64 rows of a run of 4 strips
    ckpt = str(tmp_path)
    save(ckpt)
    copies = []
    real = load.Checkpoint._copy_out
    monkeypatch.setattr(
        load.Checkpoint, "_copy_out", lambda self, r, b: (copies.append(r.shape), real(self, r, b))
    )
    info = ShardInfo("w", (ROWS, COLS), (10, 6), (200, 50))  # columns 6..55: strips 1..13
    local = torch.full(info.sizes, float("nan"))
    with Checkpoint.open(step_path(ckpt, 1)) as ck:
        stats = ck.load_into({"w": (local, info)})
    assert torch.equal(local, FULL[10:210, 6:56])
    # Strip 1 (columns 6 and 7 of it) alone, in one piece of its 4 blocks; strips 2..13
    # (whole) together, a piece per block: (strip, row, column).
    assert copies == [(256, 4)] + [(12, 64, 4)] * 4
    # Blocks 0..3 (rows 0..255) of the 13 strips, and the header.
    assert stats.bytes_read - header_bytes(data_path(ckpt)) == 13 * ROWS * 16


@pytest.mark.parametrize("threaded", [True, False])
def test_a_corrupted_block_in_a_later_piece_fails_the_load_on_either_thread(
    tmp_path, monkeypatch, threaded
):
    """Checked on the second thread (``THREADED``) or on the loading one, a damaged block
    of the third of four pieces fails the load, and none of that piece is copied."""
    import threading

    import checkpoint.load as load

    monkeypatch.setattr(load, "PIECE_BYTES", 1024)  # a block of each strip per piece: 4
    monkeypatch.setattr(load, "THREADED", threaded)
    ckpt = str(tmp_path)
    save(ckpt)
    corrupt(ckpt, "w@0_36", 130)  # strip 9, block 2
    where = []
    real = load.blocks_match

    def spy(view, block, expected, crc):
        ok = real(view, block, expected, crc)
        if not ok:
            where.append(threading.current_thread().name)
        return ok

    monkeypatch.setattr(load, "blocks_match", spy)
    local, info = part(1, 0, 1)
    with (
        Checkpoint.open(step_path(ckpt, 1)) as ck,
        pytest.raises(CorruptCheckpointError, match=r"w@0_36: checksum mismatch"),
    ):
        ck.load_into({"w": (local, info)})
    assert where == ["ckpt-verify_0" if threaded else threading.current_thread().name]
    # The blocks before it were copied; nothing of the damaged block was.
    assert not torch.isnan(local[:128, 36:40]).any()
    assert torch.isnan(local[128:192, 36:40]).all()


def test_a_corrupted_strip_of_a_run_is_named_and_none_of_its_piece_is_copied(tmp_path):
    ckpt = str(tmp_path)
    save(ckpt)
    corrupt(ckpt, "w@0_20", 3)  # strip 5, block 0
    local, info = part(0, 0, 4)  # rows 0..63 of all 16 strips: one run, one piece
    with (
        Checkpoint.open(step_path(ckpt, 1)) as ck,
        pytest.raises(CorruptCheckpointError, match=r"w@0_20: checksum mismatch"),
    ):
        ck.load_into({"w": (local, info)})
    assert torch.isnan(local).all()


def test_a_verified_load_reads_each_file_front_to_back(tmp_path, monkeypatch):
    """Pieces are read in file order whatever order the tensors are asked in (the kernel's
    readahead then reads ahead of a load from disk), with nothing asked of the kernel
    ahead (posix_fadvise)."""
    import checkpoint.load as load

    monkeypatch.setattr(load, "PIECE_BYTES", 1024)
    ckpt = str(tmp_path)
    other = FULL.flip(0).contiguous()
    saver = Saver(ckpt, group=None, options=SaveOptions(async_=False, **OPTIONS))
    saver.save(
        step=1,
        consumed_samples=1,
        model={
            "a": (FULL.clone(), ShardInfo.whole("a", (ROWS, COLS))),
            "b": (other.clone(), ShardInfo.whole("b", (ROWS, COLS))),
        },
    )
    saver.close()
    real_preadv = os.preadv

    def fadvise(*args):
        raise AssertionError("posix_fadvise called")

    monkeypatch.setattr(os, "posix_fadvise", fadvise)
    head = header_bytes(data_path(ckpt))
    seen = []
    for names in (("a", "b"), ("b", "a")):
        offsets = []

        def preadv(fd, buffers, offset, flags=0, offsets=offsets):
            offsets.append(offset)
            return real_preadv(fd, buffers, offset, flags)

        monkeypatch.setattr(os, "preadv", preadv)
        wanted = {}
        for name in names:
            info = ShardInfo.split(name, (ROWS, COLS), 0, 1, 2)  # the second half of each strip
            wanted[name] = (torch.full(info.sizes, float("nan")), info)
        with Checkpoint.open(step_path(ckpt, 1)) as ck:
            ck.load_into(wanted)
        assert torch.equal(wanted["a"][0], FULL[128:])
        assert torch.equal(wanted["b"][0], other[128:])
        data = [o for o in offsets if o >= head]
        # 2 tensors x 2 pieces (1 KiB: one block of each of the 16 strips) x 16 strips
        assert len(data) == 2 * 2 * 16
        starts = data[::16]
        assert starts == sorted(starts)
        seen.append(data)
    assert seen[0] == seen[1]


@settings(max_examples=120, deadline=None)
@given(
    rows=st.integers(1, 40),
    cols=st.integers(1, 40),
    split=st.sampled_from(["rows", "cols", "both", "none"]),
    ranks=st.integers(1, 4),
    min_bytes=st.integers(1, 600),
    max_pieces=st.sampled_from([1, 2, 8, 16]),
    block_bytes=st.integers(0, 300),
    vector=st.booleans(),
    corners=st.lists(st.integers(0, 40), min_size=4, max_size=4),
)
def test_a_version_4_manifest_lists_regions_that_expand_to_the_writers_chunks(
    rows, cols, split, ranks, min_bytes, max_pieces, block_bytes, vector, corners
):
    """What a load rebuilds from a version 4 manifest (each region's strips, keys, file
    and rows per block) is exactly what the writer cut and wrote, for any layout, strip
    and block settings; the listing holds one flat list per region; and the chunks a load
    cuts for one box (only those of the regions it meets) are every chunk that holds part
    of it, before and after all of them are cut."""
    from checkpoint.manifest import FileEntry, Manifest
    from checkpoint.planner import _split, intersect
    from checkpoint.saveplan import LocalEntry, build_save_plan

    shapes = {"m": (rows, cols), "v": (rows,)} if vector else {"m": (rows, cols)}
    # The ranks' grid over (rows, columns); "none": every rank a replica.
    grid = {"rows": (ranks, 1), "cols": (1, ranks), "none": (1, 1),
            "both": (2, 2) if ranks == 4 else (ranks, 1)}[split]  # fmt: skip
    per_rank = []
    for r in range(ranks):
        mine = []
        at = (r // grid[1] % grid[0], r % grid[1])
        for name, shape in shapes.items():
            offsets, sizes = [0] * len(shape), list(shape)
            for d in range(len(shape)):
                offsets[d], sizes[d] = _split(shape[d], grid[d])[at[d]]
            mine.append(LocalEntry(name, "model", torch.float32, shape, tuple(offsets),
                                   tuple(sizes)))  # fmt: skip
        per_rank.append(mine)
    plan = build_save_plan(per_rank, chunk_min_bytes=min_bytes, chunk_max_pieces=max_pieces,
                           block_bytes=block_bytes)  # fmt: skip
    # What a saving rank builds: its own file laid out, and the same plan otherwise.
    for r in range(ranks):
        own = build_save_plan(per_rank, chunk_min_bytes=min_bytes, chunk_max_pieces=max_pieces,
                              block_bytes=block_bytes, only=r)  # fmt: skip
        assert own.files == {k: f for k, f in plan.files.items() if k == r}
        assert (own.tensors, own.writers, own.block_bytes) == (
            plan.tensors, plan.writers, plan.block_bytes)  # fmt: skip
    assert plan.writers == tuple(sorted(plan.files))
    files = {f.name: FileEntry(name=f.name, bytes=8 + f.data_bytes, sha256="",
                               header_sha256="0" * 64, rank=f.rank)
             for f in plan.files.values()}  # fmt: skip
    written = Manifest(step=1, consumed_samples=0, job="j", world=ranks, layout=None,
                       files=files, tensors=plan.tensor_entries(), optimizer={}, extra={},
                       created_unix=0.0)  # fmt: skip
    body = written.to_json()
    raw = json.loads(body)
    for name, t in raw["tensors"].items():
        assert all(len(row) == 2 * len(shapes[name]) + 2 for row in t["regions"])
        assert all(not isinstance(x, list) for row in t["regions"] for x in row)
    read = Manifest.from_json(body, where="m")
    for name, t in plan.tensors.items():
        entry = read.tensors[name]
        assert entry.chunks == t.chunks
        slots = {(f.name, s.key): s.block_rows for f in plan.files.values() for s in f.slots}
        # A box inside the tensor (a vector's: its rows only), from the drawn corners.
        r0, r1 = sorted(min(x, rows) for x in corners[:2])
        c0, c1 = sorted(min(x, cols) for x in corners[2:])
        box = ((r0, c0), (r1 - r0, c1 - c0)) if name == "m" else ((r0,), (r1 - r0,))
        met = [c for c in t.chunks if intersect(box, (c.offsets, c.sizes)) is not None]
        fresh = Manifest.from_json(body, where="m").tensors[name]
        assert [c for c in fresh.chunks_within(box) if c in met] == met  # none cut before
        assert [entry.rows_per_block(c) for c in entry.chunks] == [
            slots[(c.file, c.key)] for c in t.chunks
        ]
        assert [c for c in entry.chunks_within(box) if c in met] == met  # all cut and kept


def test_a_file_too_large_for_its_checksums_in_the_header_gets_larger_blocks(tmp_path, monkeypatch):
    """Each file's block checksums live in its header, which a load reads only up to
    MAX_HEADER_BYTES (100 MiB: 16 KiB blocks fill half of it at 52 GB). A save with larger
    files takes larger blocks. Here the bound is made 512 bytes: one 64 KiB chunk in 1 KiB
    blocks would need 64 checksums (512 hex digits, over the bound with its entry); it gets
    4 KiB blocks instead (16 checksums), and saves, loads and verifies."""
    import checkpoint.stfile as stfile

    monkeypatch.setattr(stfile, "MAX_HEADER_BYTES", 512)
    ckpt = str(tmp_path)
    options = SaveOptions(async_=False, chunk_max_pieces=1, block_bytes=1024)
    saver = Saver(ckpt, group=None, options=options)
    saver.save(
        step=1, consumed_samples=1, model={"w": (FULL.clone(), ShardInfo.whole("w", (ROWS, COLS)))}
    )
    saver.close()
    entry = open_step(ckpt).manifest.tensors["w"]
    assert entry.block_bytes == 4096  # 2 * 64 KiB / (512 // 2 // 8) blocks
    assert [entry.rows_per_block(c) for c in entry.chunks] == [16]  # rows of 256 bytes
    assert header_bytes(data_path(ckpt)) - 8 <= 512
    local, info = part(0, 1, 4)
    with Checkpoint.open(step_path(ckpt, 1)) as ck:
        ck.load_into({"w": (local, info)})
    assert torch.equal(local, FULL[64:128])
    assert verify(open_step(ckpt)) == []


def test_a_header_no_load_would_read_is_never_committed(tmp_path, monkeypatch):
    """Too many tensors in one file for the header a load reads: the save fails on every
    rank in one line, nothing is committed."""
    import checkpoint.stfile as stfile
    from checkpoint import SaveRefusedError, committed_steps

    monkeypatch.setattr(stfile, "MAX_HEADER_BYTES", 600)  # 16 strips' entries take more
    with pytest.raises(SaveRefusedError, match=r"a header of \d+ bytes \(16 tensors\), more than"):
        save(str(tmp_path))
    assert committed_steps(str(tmp_path)) == []


def test_more_strips_asked_for_than_a_load_accepts_are_cut_at_its_limit(tmp_path):
    """`chunk_max_pieces` above 64 (what a version 4 load accepts per region) cuts 64."""
    ckpt = str(tmp_path)
    wide = torch.arange(4 * 256, dtype=torch.float32).view(4, 256)
    options = SaveOptions(async_=False, chunk_min_bytes=1, chunk_max_pieces=128)
    saver = Saver(ckpt, group=None, options=options)
    saver.save(step=1, consumed_samples=1, model={"w": (wide, ShardInfo.whole("w", (4, 256)))})
    saver.close()
    with Checkpoint.open(step_path(ckpt, 1)) as ck:
        assert len(ck.manifest.tensors["w"].chunks) == 64
        assert torch.equal(ck.read("w"), wide)


def test_a_save_writes_blocks_of_64_mib_at_most_and_a_load_takes_larger_ones(tmp_path):
    """A save asked for larger verify blocks clamps them to 64 MiB (a verified load reads a
    block into memory whole). A checkpoint an earlier build saved with larger ones (here
    one block a chunk, as ``block_bytes`` of 2^40 gives, its header's checksums made so)
    still loads: nothing committed becomes unloadable."""
    from checkpoint.stfile import CRC_META, block_crc32c

    big = str(tmp_path / "b")
    saver = Saver(big, group=None, options=SaveOptions(async_=False, block_bytes=1 << 40))
    model = {"w": (FULL.clone(), ShardInfo.whole("w", FULL.shape))}
    saver.save(step=1, consumed_samples=0, model=model)
    saver.close()
    assert open_step(big).manifest.tensors["w"].block_bytes == MAX_BLOCK_BYTES

    ckpt = str(tmp_path / "a")
    save(ckpt)
    path = data_path(ckpt)
    blob, head = path.read_bytes(), header_bytes(path)
    header = file_header(ckpt)

    def one_block_a_chunk(h):
        for key, info in header.items():
            if key != "__metadata__":
                begin, end = info["data_offsets"]
                h["__metadata__"][CRC_META + key] = block_crc32c(blob[head + begin : head + end], 0)

    rewrite_header(ckpt, one_block_a_chunk)
    mpath = Path(step_path(ckpt, 1)) / "manifest.json"
    raw = json.loads(mpath.read_text())
    raw["tensors"]["w"]["block_bytes"] = 1 << 40
    reseal(mpath, raw)
    local, info = part(0, 1, 2)
    with Checkpoint.open(step_path(ckpt, 1)) as ck:
        ck.load_into({"w": (local, info)})
    assert torch.equal(local, FULL[ROWS // 2 :])
    assert verify(open_step(ckpt)) == []
