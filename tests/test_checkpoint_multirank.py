"""Saving in one layout and loading in another, on real gloo processes and real files.

The state is a synthetic GPT-like model tagged with ShardInfo the way the trainer tags
it: vocabulary rows split over tp with padding, column- and row-parallel weights, layers
over pipeline stages, experts over ep, replicated norms, an embedding tied across the
first and last stage, and AdamW moments sharded like their parameters.
"""

from __future__ import annotations

import json
import os
import resource
import shutil
import signal
import time
import zlib
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from ckpt_versions import rewrite_as

from checkpoint import (
    Checkpoint,
    SaveFailedError,
    SaveOptions,
    Saver,
    ShardInfo,
    load_latest,
    open_step,
    read_latest,
)
from checkpoint.stfile import read_header
from checkpoint.store import step_path

H, V, L, E, F = 16, 50, 4, 4, 32


@dataclass(frozen=True)
class Synth:
    tp: int = 1
    pp: int = 1
    dp: int = 1
    ep: int = 1

    @property
    def world(self) -> int:
        return self.tp * self.pp * self.dp


def global_value(kind: str, name: str, shape, step: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(zlib.crc32(f"{kind}:{name}:{step}".encode()))
    return torch.randn(shape, generator=g)


def local_shards(lay: Synth, rank: int) -> dict[str, tuple[tuple[int, ...], ShardInfo]]:
    """name -> (local shape, ShardInfo) for what ``rank`` holds in layout ``lay``."""
    t, d, p = rank % lay.tp, (rank // lay.tp) % lay.dp, rank // (lay.tp * lay.dp)
    e_rank = d % lay.ep
    out = {}
    per = -(-V // lay.tp)
    vocab = ShardInfo("embedding.weight", (V, H), (t * per, 0), (max(0, min(per, V - t * per)), H))
    if p in (0, lay.pp - 1):  # tied: the first stage's input and the last stage's output
        out["embedding.weight"] = ((per, H), vocab)
    per_stage = L // lay.pp
    for layer in range(p * per_stage, (p + 1) * per_stage):
        pre = f"decoder.layers.{layer}"
        qkv = ShardInfo.split(f"{pre}.qkv.weight", (3 * H, H), 0, t, lay.tp)
        proj = ShardInfo.split(f"{pre}.proj.weight", (H, H), 1, t, lay.tp)
        out[qkv.name] = (qkv.sizes, qkv)
        out[proj.name] = (proj.sizes, proj)
        out[f"{pre}.ln.weight"] = ((H,), ShardInfo.whole(f"{pre}.ln.weight", (H,)))
        for e in range(e_rank * E // lay.ep, (e_rank + 1) * E // lay.ep):
            fc1 = ShardInfo.split(f"{pre}.experts.{e}.fc1.weight", (F, H), 0, t, lay.tp)
            out[fc1.name] = (fc1.sizes, fc1)
    if p == lay.pp - 1:
        out["final_ln.weight"] = ((H,), ShardInfo.whole("final_ln.weight", (H,)))
    return out


def region(info: ShardInfo):
    return tuple(slice(o, o + s) for o, s in zip(info.offsets, info.sizes, strict=True))


def make_state(lay: Synth, rank: int, step: int, fill: float | None = None):
    model, optim = {}, {}
    for name, (shape, info) in local_shards(lay, rank).items():
        for kind, target, key in (
            ("model", model, name),
            ("exp_avg", optim, f"exp_avg/{name}"),
            ("exp_avg_sq", optim, f"exp_avg_sq/{name}"),
        ):
            t = torch.full(shape, 7.0 if fill is None else fill)  # padding holds junk
            if fill is None:
                t[tuple(slice(0, s) for s in info.sizes)] = global_value(
                    kind, name, info.global_shape, step
                )[region(info)]
            target[key] = (t, info)
    return model, optim


def check_state(model, optim, step: int) -> list[str]:
    wrong = []
    for key, (t, info) in [*model.items(), *optim.items()]:
        kind = key.split("/")[0] if "/" in key else "model"
        want = global_value(kind, info.name, info.global_shape, step)[region(info)]
        if not torch.equal(t[tuple(slice(0, s) for s in info.sizes)], want):
            wrong.append(key)
    return wrong


def _init(rank: int, world: int, store: str):
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    return dist.new_group(backend="gloo")


def _save_worker(rank, world, store, ckpt, lay, step, async_, fsize_limit_rank, out):
    group = _init(rank, world, store)
    result = {"rank": rank}
    try:
        saver = Saver(ckpt, group=group, options=SaveOptions(async_=async_, chunk_min_bytes=256))
        model, optim = make_state(lay, rank, step)
        saver.save(step=step, consumed_samples=16 * step, model=model, optimizer=optim)
        saver.wait()
        if fsize_limit_rank == rank:
            # A real write error from the kernel: files may not grow past 4 KiB (EFBIG).
            signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
            resource.setrlimit(resource.RLIMIT_FSIZE, (4096, 4096))
        if fsize_limit_rank is not None:
            model, optim = make_state(lay, rank, step + 1)
            saver.save(step=step + 1, consumed_samples=0, model=model, optimizer=optim)
            # Training goes on; the per-step check raises once the background save failed.
            deadline = time.monotonic() + 60
            while time.monotonic() < deadline:
                try:
                    saver.check()
                except SaveFailedError as exc:
                    result["error"] = str(exc)
                    break
                time.sleep(0.01)
        saver.close()
        result["written"] = saver.last.bytes_written if saver.last else 0
    finally:
        dist.destroy_process_group()
    Path(out, f"rank-{rank}.json").write_text(json.dumps(result))


def _roundtrip_worker(rank, world, store, ckpt, saved, loads, step, async_, out):
    """Save in layout ``saved``, then load into each layout of ``loads`` (on its first ranks)."""
    _init(rank, world, store)
    results = []
    try:
        if rank < saved.world:
            sub = dist.new_group(list(range(saved.world)), backend="gloo")
            saver = Saver(ckpt, group=sub, options=SaveOptions(async_=async_, chunk_min_bytes=256))
            model, optim = make_state(saved, rank, step)
            saver.save(step=step, consumed_samples=16 * step, model=model, optimizer=optim)
            saver.close()
            results.append({"written": saver.last.bytes_written})
        else:
            dist.new_group(list(range(saved.world)), backend="gloo")
        for lay in loads:
            dist.barrier()
            sub = dist.new_group(list(range(lay.world)), backend="gloo")
            if rank >= lay.world:
                continue
            model, optim = make_state(lay, rank, step, fill=float("nan"))
            loaded = load_latest(ckpt, model=model, optimizer=optim, group=sub)
            results.append(
                {
                    "layout": repr(lay),
                    "step": loaded.step,
                    "consumed": loaded.manifest.consumed_samples,
                    "wrong": check_state(model, optim, step),
                    "read": loaded.stats.bytes_read,
                    "needed": loaded.stats.bytes_needed,
                }
            )
    finally:
        dist.destroy_process_group()
    Path(out, f"rank-{rank}.json").write_text(json.dumps(results))


def spawn(fn, world: int, tmp: Path, *args) -> list[dict]:
    out = tmp / f"out-{fn.__name__}-{os.urandom(4).hex()}"
    out.mkdir()
    store = tmp / f"store-{os.urandom(4).hex()}"
    mp.spawn(fn, args=(world, str(store), *args, str(out)), nprocs=world, join=True)
    return [json.loads((out / f"rank-{r}.json").read_text()) for r in range(world)]


def roundtrip(tmp: Path, saved: Synth, loads: list[Synth], *, step: int, async_: bool = True):
    """Save in ``saved`` and load into every layout of ``loads``; return per-rank results."""
    ckpt = str(tmp / "ckpt")
    world = max(lay.world for lay in [saved, *loads])
    results = spawn(_roundtrip_worker, world, tmp, ckpt, saved, loads, step, async_)
    for per_rank in results:
        for r in per_rank:
            if "layout" in r:
                assert r["step"] == step and r["consumed"] == 16 * step, r
                assert r["wrong"] == [], r
    return ckpt, results


@pytest.mark.parametrize(
    ("saved", "loaded_as", "async_"),
    [
        (Synth(tp=2, dp=2, ep=2), [Synth(tp=4), Synth(), Synth(pp=2, dp=2)], True),
        (Synth(tp=2, pp=2), [Synth(dp=2, ep=2), Synth(tp=4), Synth(pp=4)], False),
    ],
    ids=["tp2xdp2xep2-async", "tp2xpp2-sync"],
)
def test_a_checkpoint_saved_in_one_layout_loads_exactly_into_other_layouts(
    tmp_path, saved, loaded_as, async_
):
    ckpt, results = roundtrip(tmp_path, saved, [saved, *loaded_as], step=6, async_=async_)
    loads_done = sum(1 for per_rank in results for r in per_rank if "layout" in r)
    assert loads_done == sum(lay.world for lay in [saved, *loaded_as])
    # Replicas (dp copies, the tied embedding on two stages) are stored once, and the
    # writes are spread so that every rank writes about the same bytes.
    manifest = open_step(ckpt).manifest
    for entry in manifest.tensors.values():
        stored = sum(torch.Size(c.sizes).numel() for c in entry.chunks)
        assert stored == torch.Size(entry.shape).numel(), entry.name
    largest = max(e.nbytes for e in manifest.tensors.values())
    written = [per_rank[0]["written"] for per_rank in results[: saved.world]]
    assert min(written) > 0 and max(written) - min(written) <= largest + 8192  # + headers


def test_a_write_error_on_one_rank_commits_nothing_and_every_rank_learns_it_at_its_next_step(
    tmp_path,
):
    ckpt = str(tmp_path / "ckpt")
    lay = Synth(tp=2)
    results = spawn(_save_worker, 2, tmp_path, ckpt, lay, 3, True, 1)
    for r in results:
        assert "not committed" in r["error"] and "rank 1" in r["error"]
    assert read_latest(ckpt) == 3
    assert sorted(os.listdir(ckpt)) == ["latest", "step-000000003"]
    assert Checkpoint.open(os.path.join(ckpt, "step-000000003")).step == 3


def _fallback_worker(rank, world, store, ckpt, out):
    group = _init(rank, world, store)
    lay = Synth(tp=2)
    try:
        saver = Saver(ckpt, group=group, options=SaveOptions(async_=False, chunk_min_bytes=256))
        for step in (1, 2):
            model, optim = make_state(lay, rank, step)
            saver.save(step=step, consumed_samples=16 * step, model=model, optimizer=optim)
        saver.close()
        if rank == 0:
            # Damage a chunk that only tp rank 1 reads: rows 24.. of a qkv weight.
            manifest = open_step(ckpt, 2).manifest
            chunk = next(
                c
                for c in manifest.tensors["decoder.layers.0.qkv.weight"].chunks
                if c.offsets[0] >= 24
            )
            path = os.path.join(ckpt, "step-000000002", chunk.file)
            _, head = read_header(path)
            raw = bytearray(Path(path).read_bytes())
            prefix = int.from_bytes(raw[:8], "little")
            raw[8 + prefix + head[chunk.key]["data_offsets"][0] + 3] ^= 0x10
            Path(path).write_bytes(bytes(raw))
        dist.barrier()
        warnings: list[str] = []
        model, optim = make_state(lay, rank, 0, fill=float("nan"))
        loaded = load_latest(ckpt, model=model, optimizer=optim, group=group, warn=warnings.append)
        result = {"step": loaded.step, "wrong": check_state(model, optim, 1), "warnings": warnings}
    finally:
        dist.destroy_process_group()
    Path(out, f"rank-{rank}.json").write_text(json.dumps(result))


def test_corruption_seen_by_one_rank_makes_every_rank_fall_back_together(tmp_path):
    results = spawn(_fallback_worker, 2, tmp_path, str(tmp_path / "ckpt"))
    for r in results:
        assert r["step"] == 1 and r["wrong"] == []
        assert len(r["warnings"]) == 1 and "step 2" in r["warnings"][0]
        assert "checksum mismatch" in r["warnings"][0]


W = torch.arange(1024 * 16, dtype=torch.float32).view(1024, 16)


def _empty_beside_worker(rank, world, store, ckpt, out):
    """Rank 0 holds all of w; rank 1 an empty box of it (no columns) at the same offsets,
    so both files hold a chunk keyed ``w@0_0``."""
    group = _init(rank, world, store)
    try:
        info = ShardInfo("w", tuple(W.shape), (0, 0), tuple(W.shape) if rank == 0 else (1024, 0))
        local = W.clone() if rank == 0 else torch.empty(1024, 0)
        # One strip each: 4 blocks of 256 rows in rank 0's chunk, 1 in rank 1's.
        saver = Saver(ckpt, group=group, options=SaveOptions(async_=False))
        saver.save(step=1, consumed_samples=1, model={"w": (local, info)})
        saver.close()
    finally:
        dist.destroy_process_group()
    Path(out, f"rank-{rank}.json").write_text("{}")


def test_an_empty_box_keyed_like_another_ranks_chunk_loads_and_verifies(tmp_path, monkeypatch):
    """One key in two files is valid (each file has its own keys). Each chunk's rows per
    block and checksums are its own, in every format version: before, they were looked up
    by key alone, so the empty chunk's were taken for the full one, and every load and
    verify refused the step. And checking keys where a region is empty cuts no chunk."""
    import checkpoint.manifest as manifest_mod
    from checkpoint import verify
    from checkpoint.errors import LayoutMismatchError
    from checkpoint.planner import plan_reads

    ckpt = str(tmp_path / "ckpt")
    spawn(_empty_beside_worker, 2, tmp_path, ckpt)
    # Each older version as its writer listed it: checksums and rows by chunk, one key in
    # two files alike.
    for version in (3, 2, 1):
        older = str(tmp_path / f"v{version}")
        shutil.copytree(ckpt, older)
        rewrite_as(step_path(older, 1), version)
        ck = open_step(older)
        assert ck.manifest.version == version
        assert verify(ck) == []
        assert torch.equal(ck.read("w"), W)
    ck = open_step(ckpt)
    assert verify(ck) == []
    assert torch.equal(ck.read("w"), W)
    half = ShardInfo("w", tuple(W.shape), (512, 0), (512, 16))
    local = torch.empty(512, 16)
    with Checkpoint.open(ck.path) as again:
        again.load_into({"w": (local, half)})
    assert torch.equal(local, W[512:])
    made = []
    real = manifest_mod.SavedChunk
    monkeypatch.setattr(manifest_mod, "SavedChunk", lambda **kw: made.append(kw) or real(**kw))
    entry = open_step(ckpt).manifest.tensors["w"]
    assert entry.regions == ((0, (0, 0), (1024, 16), 1), (1, (0, 0), (1024, 0), 1))
    assert made == []
    # A box of other dimensions cuts nothing and is refused as a layout mismatch.
    row = ((0,), (4,))
    assert entry.chunks_within(row) == []
    with pytest.raises(LayoutMismatchError, match="asked for 1 dimensions"):
        plan_reads("w", row, entry.chunks_within(row), global_shape=entry.shape)
