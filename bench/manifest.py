"""Manifest size and parse time of large jobs, format version 3 against version 4.

    python bench/manifest.py [--models 10b,60b] [--layouts tp8xdp2,tp8xpp8xdp4,...]

No tensor is written: for each model and layout, every rank's regions are made as the
trainer shards a GPT (qkv and fc1 split by rows over tp, proj and fc2 by columns, the
embedding by rows, norms and the biases of row-split layers replicated; with ``zero1`` the
fp32 parameters and both AdamW moments cut by rows over dp too; pipeline stages take
contiguous layers), and the saver's own code makes the rest: ``build_save_plan`` (strips,
verify blocks, writers; timed as a saving rank builds it, laying out its own file only,
and laying out every file, as it did before), then the manifest from that plan, as
``Saver._commit`` builds it. Version 3 lists every chunk with its file, key and block
checksums (8 hex digits per 16 KiB block); version 4 lists each written region once
(rank, box, strip count) and keeps the checksums in the tensor files' headers. Both are
printed side by side, with the bound every load enforces (``MAX_MANIFEST_BYTES``), and
version 4 is parsed and checked as a load does (``Manifest.from_json``: the regions
tiling every tensor, the bytes of every file). What a resuming rank then does is timed
after it: rank 0 plans the reads of its own regions (``plan_reads`` of the chunks of the
regions each meets, as ``Checkpoint.load_into`` does), against cutting every chunk of the
manifest (what every load did before the chunks were cut lazily, and what ``verify``
still does), with the MiB of Python objects each holds (traced in a pass of its own).
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import os
import sys
import time
import tracemalloc

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from checkpoint.manifest import MAX_MANIFEST_BYTES, FileEntry, Manifest
from checkpoint.planner import plan_reads
from checkpoint.saveplan import LocalEntry, build_save_plan
from checkpoint.stfile import crc_count

MODELS = {
    # name: (hidden, ffn, layers, vocabulary)
    "1b": (2048, 8192, 16, 32000),
    "10b": (5120, 13824, 40, 32000),
    "60b": (8192, 28672, 80, 128000),
}
LAYOUTS = ("tp8xdp2", "tp8xpp8xdp4", "tp8xpp8xdp4+zero1")


def parameters(hidden: int, ffn: int, layers: int, vocab: int):
    """(name, global shape, the dimension tp splits or None) of a GPT's parameters."""
    h = hidden
    out = [("embedding.weight", (vocab, h), 0)]
    for i in range(layers):
        p = f"decoder.layers.{i}"
        out += [
            (f"{p}.ln1.weight", (h,), None),
            (f"{p}.ln1.bias", (h,), None),
            (f"{p}.attn.qkv.weight", (3 * h, h), 0),
            (f"{p}.attn.qkv.bias", (3 * h,), 0),
            (f"{p}.attn.proj.weight", (h, h), 1),
            (f"{p}.attn.proj.bias", (h,), None),
            (f"{p}.ln2.weight", (h,), None),
            (f"{p}.ln2.bias", (h,), None),
            (f"{p}.mlp.fc1.weight", (ffn, h), 0),
            (f"{p}.mlp.fc1.bias", (ffn,), 0),
            (f"{p}.mlp.fc2.weight", (h, ffn), 1),
            (f"{p}.mlp.fc2.bias", (h,), None),
        ]
    return [*out, ("final_ln.weight", (h,), None), ("final_ln.bias", (h,), None)]


def parse_layout(text: str) -> tuple[int, int, int, bool]:
    body, _, extra = text.partition("+")
    sizes = {"tp": 1, "pp": 1, "dp": 1}
    for part in body.split("x"):
        sizes[part[:2]] = int(part[2:])
    return sizes["tp"], sizes["pp"], sizes["dp"], extra == "zero1"


def _split(n: int, parts: int, index: int) -> tuple[int, int]:
    per = n // parts
    return index * per, per if index < parts - 1 else n - index * per


def local_entries(params, layers: int, tp: int, pp: int, dp: int, zero: bool):
    per_rank = []
    for rank in range(tp * pp * dp):
        t, d, stage = rank % tp, (rank // tp) % dp, rank // (tp * dp)
        mine = []
        for name, shape, dim in params:
            if name.startswith("decoder.layers."):
                here = int(name.split(".")[2]) * pp // layers == stage
            else:  # the embedding on the first stage, the final norm on the last
                here = stage == (0 if name.startswith("embedding") else pp - 1)
            if not here:
                continue
            offsets, sizes = [0] * len(shape), list(shape)
            if dim is not None:
                offsets[dim], sizes[dim] = _split(shape[dim], tp, t)
            if zero:
                lo, n = _split(sizes[0], dp, d)
                offsets[0], sizes[0] = offsets[0] + lo, n
            for kind, prefix in (
                ("model", ""),
                ("optimizer", "exp_avg/"),
                ("optimizer", "exp_avg_sq/"),
            ):
                mine.append(
                    LocalEntry(
                        prefix + name,
                        kind,
                        torch.float32,
                        tuple(shape),
                        tuple(offsets),
                        tuple(sizes),
                    )
                )
        per_rank.append(mine)
    return per_rank


def manifest(plan, world: int, version: int) -> Manifest:
    """The manifest the saver writes for ``plan`` (version 4), or version 3's listing of it
    (the same chunks, each with its file, key and checksums: zeros of the real length)."""
    tensors = plan.tensor_entries()
    if version == 3:
        slots = {(f.name, s.key): s for f in plan.files.values() for s in f.slots}
        for name, t in tensors.items():
            crc = {}
            for c in t.chunks:
                s = slots[(c.file, c.key)]
                crc[(c.file, c.key)] = "0" * 8 * crc_count(s.end - s.begin, s.block_bytes)
            tensors[name] = dataclasses.replace(t, crc32=crc)
    files = {
        f.name: FileEntry(
            name=f.name, bytes=8 + f.data_bytes, sha256="", header_sha256="0" * 64, rank=f.rank
        )
        for f in plan.files.values()
    }
    return Manifest(
        step=1,
        consumed_samples=0,
        job="bench",
        world=world,
        layout=None,
        files=files,
        tensors=tensors,
        optimizer={},
        extra={},
        created_unix=0.0,
        version=version,
        commit=1,
    )


def held(body: bytes) -> tuple[float, float]:
    """MiB of Python objects a parsed manifest holds, and what cutting every chunk adds
    (traced in a pass of their own: tracing slows both)."""
    tracemalloc.start()
    try:
        read = Manifest.from_json(body, where="bench")
        parsed = tracemalloc.get_traced_memory()[0]
        for t in read.tensors.values():
            tuple(t.chunks)
        return parsed / 2**20, (tracemalloc.get_traced_memory()[0] - parsed) / 2**20
    finally:
        tracemalloc.stop()


def rank_reads(read: Manifest, mine) -> tuple[float, int]:
    """Seconds to plan the reads of one rank's regions from a parsed manifest, as a load
    does, and the chunks it cut for them."""
    t0 = time.perf_counter()
    cut = 0
    for e in mine:
        t = read.tensors[e.name]
        box = (e.offsets, e.sizes)
        chunks = t.chunks_within(box)
        cut += len(chunks)
        plan_reads(e.name, box, chunks, global_shape=t.shape)
    return time.perf_counter() - t0, cut


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="10b,60b")
    ap.add_argument("--layouts", default=",".join(LAYOUTS))
    args = ap.parse_args()
    mib = 1 << 20
    print(f"load bound (MAX_MANIFEST_BYTES): {MAX_MANIFEST_BYTES / mib:.0f} MiB")
    print(
        f"{'model':>5} {'layout':>18} {'params':>7} {'state GB':>9} {'chunks':>8} "
        f"{'v3 MiB':>8} {'v3 loads':>8} {'v4 MiB':>8} {'v4 loads':>8} {'v4/v3':>6} "
        f"{'v4 B/chunk':>10} {'plan s':>7} {'all files s':>11} {'parse s':>7} {'MiB':>5} "
        f"{'rank 0 reads s':>14} {'its chunks':>10} {'cut all s':>9} {'MiB':>5}"
    )
    for model in args.models.split(","):
        hidden, ffn, layers, vocab = MODELS[model]
        params = parameters(hidden, ffn, layers, vocab)
        count = sum(math.prod(s) for _, s, _ in params)
        for layout in args.layouts.split(","):
            tp, pp, dp, zero = parse_layout(layout)
            entries = local_entries(params, layers, tp, pp, dp, zero)
            t0 = time.perf_counter()
            build_save_plan(entries, chunk_min_bytes=128 << 10, only=0)
            plan_s = time.perf_counter() - t0  # what a saving rank builds: its own file
            t0 = time.perf_counter()
            plan = build_save_plan(entries, chunk_min_bytes=128 << 10)  # every file
            every_s = time.perf_counter() - t0
            chunks = sum(len(t.chunks) for t in plan.tensors.values())
            state = sum(f.data_bytes for f in plan.files.values())
            v3 = len(manifest(plan, len(entries), 3).to_json())
            body = manifest(plan, len(entries), 4).to_json()
            parse_s = reads_s = cut_s = parse_mib = cut_mib = float("nan")  # refused unread
            cut = 0
            if len(body) <= MAX_MANIFEST_BYTES:
                t0 = time.perf_counter()
                read = Manifest.from_json(body, where="bench")
                parse_s = time.perf_counter() - t0
                reads_s, cut = rank_reads(read, entries[0])
                t0 = time.perf_counter()
                assert sum(len(tuple(t.chunks)) for t in read.tensors.values()) == chunks
                cut_s = time.perf_counter() - t0
                del read
                parse_mib, cut_mib = held(body)
            fits = {True: "yes", False: "REFUSED"}
            print(
                f"{model:>5} {layout:>18} {count / 1e9:>6.1f}B {state / 1e9:>9.1f} "
                f"{chunks:>8} {v3 / mib:>8.1f} {fits[v3 <= MAX_MANIFEST_BYTES]:>8} "
                f"{len(body) / mib:>8.1f} {fits[len(body) <= MAX_MANIFEST_BYTES]:>8} "
                f"{len(body) / v3:>6.3f} {len(body) / chunks:>10.0f} {plan_s:>7.1f} "
                f"{every_s:>11.1f} {parse_s:>7.1f} {parse_mib:>5.0f} {reads_s:>14.3f} {cut:>10} "
                f"{cut_s:>9.1f} {cut_mib:>5.0f}",
                flush=True,
            )


if __name__ == "__main__":
    main()
