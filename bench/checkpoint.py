"""Checkpoint benchmark: our store against torch.distributed.checkpoint (DCP), side by side.

    OMP_NUM_THREADS=1 python bench/checkpoint.py [--hidden 1024 --layers 2 --dir DIR]

Four gloo ranks in a tp2 x dp2 layout save a GPT-like state (model + AdamW moments, a few
hundred MB) with: our sync save, our async save (twice: the second reuses the staging
buffers), a raw write of the same bytes with fsync by the same writers (the physical
limit), DCP `save` and DCP `async_save` (twice). In the trainer's pattern, too: an async
save, a fixed stand-in for the next step's forward and backward, then ``wait_snapshot()``
before its optimizer step, with the snapshot inside ``save()`` and overlapped with that
compute (``SaveOptions.overlap_snapshot``, the trainer's default for async saves), each
against the compute alone. Then they load it in the same layout and
resharded to tp4, with ours and with DCP, cold (the files evicted from the page cache
with posix_fadvise DONTNEED first) and warm. Every time is the slowest rank's. Last, the
bytes read per byte needed when every rank of tp8 loads a one-writer (tp1) checkpoint and
every rank of tp3 loads the tp2 x dp2 one. The goals printed are issue 13's.

``--sealed`` adds a sync save with a seal key (``checkpoint.seal``: a MAC per verify block
and one over the manifest) to the same interleaved rounds, and its resharded loads (cold
and warm) beside the unsealed ones, and prints what sealing costs.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from checkpoint import Checkpoint, SaveOptions, Saver, ShardInfo, load_latest

TP, DP = 2, 2
COMPUTE_MATMULS = 400
"""The stand-in for a training step's forward and backward: this many 256 x 256 matmuls
per rank (about 0.2-0.3 s with 4 ranks on 2 cores: a step of a model this size takes
seconds on a CPU, and its forward and backward leave a GPU's copy engine idle)."""
SEAL_KEY = b"bench-key-" + b"0" * 54
"""The key of --sealed's saves and loads (a benchmark's, not a secret)."""


def spec(
    hidden: int, layers: int, vocab: int
) -> list[tuple[str, tuple[int, int] | tuple[int], int | None]]:
    """(name, global shape, split dim under tp or None for replicated)."""
    h = hidden
    out = [("embedding.weight", (vocab, h), 0)]
    for i in range(layers):
        p = f"decoder.layers.{i}"
        out += [
            (f"{p}.attn.qkv.weight", (3 * h, h), 0),
            (f"{p}.attn.proj.weight", (h, h), 1),
            (f"{p}.mlp.fc1.weight", (4 * h, h), 0),
            (f"{p}.mlp.fc2.weight", (h, 4 * h), 1),
            (f"{p}.ln1.weight", (h,), None),
            (f"{p}.ln2.weight", (h,), None),
        ]
    return out


def split_info(name: str, shape, dim: int, index: int, parts: int) -> ShardInfo:
    """Part ``index`` of ``parts`` near-equal parts along ``dim`` (tp3 of 1024 rows, too)."""
    base, extra = divmod(shape[dim], parts)
    start = index * base + min(index, extra)
    offsets, sizes = [0] * len(shape), list(shape)
    offsets[dim], sizes[dim] = start, base + (1 if index < extra else 0)
    return ShardInfo(name, tuple(shape), tuple(offsets), tuple(sizes))


def local_state(tensors, tp: int, tp_rank: int, fill: bool):
    model, optim = {}, {}
    for name, shape, dim in tensors:
        info = (
            ShardInfo.whole(name, shape)
            if dim is None
            else split_info(name, shape, dim, tp_rank, tp)
        )
        for key, target in (
            (name, model),
            (f"exp_avg/{name}", optim),
            (f"exp_avg_sq/{name}", optim),
        ):
            target[key] = (torch.rand(info.sizes) if fill else torch.empty(info.sizes), info)
    return model, optim


def dtensor_state(model, optim, mesh, tp_dim_name: str):
    from torch.distributed.tensor import DTensor, Replicate, Shard

    out = {}
    for key, (t, info) in [*model.items(), *optim.items()]:
        split = next(
            (
                d
                for d, (s, g) in enumerate(zip(info.sizes, info.global_shape, strict=True))
                if s != g
            ),
            None,
        )
        placements = [
            Replicate() if split is None or n != tp_dim_name else Shard(split)
            for n in mesh.mesh_dim_names
        ]
        out[key] = DTensor.from_local(t, mesh, placements, run_check=False)
    return out


def timed(fn, group=None):
    """Run ``fn`` on every rank; return (its result, the slowest rank's seconds)."""
    dist.barrier()
    t0 = time.perf_counter()
    result = fn()
    took = torch.tensor([time.perf_counter() - t0], dtype=torch.float64)
    dist.all_reduce(took, op=dist.ReduceOp.MAX)
    return result, float(took.item())


def slowest(value: float) -> float:
    t = torch.tensor([value], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t.item())


def total(value: int) -> int:
    t = torch.tensor([value], dtype=torch.int64)
    dist.all_reduce(t)
    return int(t.item())


def evict(path: str) -> None:
    """Drop a directory's files from the page cache (they are fsynced, so clean)."""
    for root, _, files in os.walk(path):
        for name in files:
            fd = os.open(os.path.join(root, name), os.O_RDONLY)
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


def rchar() -> int:
    with open("/proc/self/io") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("rchar"))


def worker(rank: int, world: int, store: str, args: argparse.Namespace, out: str) -> None:
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    from torch.distributed import checkpoint as dcp
    from torch.distributed.device_mesh import init_device_mesh

    group = dist.new_group(backend="gloo")
    tensors = spec(args.hidden, args.layers, args.vocab)
    tp_rank = rank % TP
    model, optim = local_state(tensors, TP, tp_rank, fill=True)
    runs: dict[str, list[float]] = {}
    base = args.dir
    ours = os.path.join(base, "ours")

    def rec(key: str, value: float) -> None:
        runs.setdefault(key, []).append(value)

    saver = Saver(ours, group=group, options=SaveOptions(async_=True, keep=2))
    sync = Saver(ours, group=group, options=SaveOptions(async_=False, keep=2))
    # --sealed: the same sync save with a seal key (checkpoint.seal), into a directory of
    # its own, in the same interleaved rounds; and its loads beside the unsealed ones.
    seal_key = SEAL_KEY if args.sealed else None
    sealed_dir = os.path.join(base, "ours-sealed")
    sealed = (
        Saver(sealed_dir, group=group, options=SaveOptions(async_=False, keep=2, key=seal_key))
        if seal_key
        else None
    )
    # The trainer's pattern, for an async save with the snapshot inside save() and one
    # overlapped with the next step's compute (each into a directory of its own).
    stepped = {
        mode: Saver(
            os.path.join(base, f"ours-{mode}"),
            group=group,
            options=SaveOptions(async_=True, overlap_snapshot=mode == "overlap", keep=2),
        )
        for mode in ("async", "overlap")
    }
    work = torch.randn(256, 256)

    def compute() -> None:
        """A stand-in for the next step's forward and backward: fixed CPU work."""
        for _ in range(COMPUTE_MATMULS):
            torch.mm(work, work)

    def step_with_save(sv: Saver, s: int) -> tuple[float, float]:
        """A save, the next step's compute, then the wait for the snapshot before its
        optimizer step, as the trainer does; returns the time blocked in each call."""
        t0 = time.perf_counter()
        sv.save(step=s, consumed_samples=s, model=model, optimizer=optim)
        t1 = time.perf_counter()
        compute()
        t2 = time.perf_counter()
        sv.wait_snapshot()
        return t1 - t0, time.perf_counter() - t2

    mesh = init_device_mesh("cpu", (DP, TP), mesh_dim_names=("dp", "tp"))
    state = dtensor_state(model, optim, mesh, "tp")
    raw_dir = os.path.join(base, "raw")
    os.makedirs(raw_dir, exist_ok=True)
    payload = None

    def raw_write():
        fd = os.open(os.path.join(raw_dir, f"{rank}.bin"), os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
        mv = memoryview(payload)
        while mv:
            mv = mv[os.write(fd, mv[: 1 << 30]) :]
        os.fsync(fd)
        os.close(fd)

    # Interleaved rounds, so that a busy disk or CPU hurts every contender alike; the
    # report takes each one's median. Round 0's async saves are the first ones (fresh
    # staging memory); later rounds show steady state.
    for rnd in range(args.rounds):
        step = 2 * rnd + 1
        _, stall = timed(
            lambda s=step: saver.save(step=s, consumed_samples=s, model=model, optimizer=optim)
        )
        _, rest = timed(saver.wait)
        rec("async_stall", stall)
        rec("async_total", stall + rest)
        _, took = timed(
            lambda s=step: sync.save(step=s + 1, consumed_samples=s, model=model, optimizer=optim)
        )
        rec("sync", took)
        if sealed is not None:
            _, took = timed(
                lambda s=step: sealed.save(step=s, consumed_samples=s, model=model, optimizer=optim)
            )
            rec("sealed_sync", took)
        if payload is None:
            written = sync.last.bytes_written
            payload = torch.rand(written // 4 + 1).view(torch.uint8)[:written].numpy()
        _, took = timed(raw_write)
        rec("raw", took)
        dcp_dir = os.path.join(base, f"dcp-sync-{rnd}")
        _, took = timed(lambda d=dcp_dir: dcp.save(state, checkpoint_id=d, process_group=group))
        rec("dcp_sync", took)
        fut, stall = timed(
            lambda r_=rnd: dcp.async_save(
                state, checkpoint_id=os.path.join(base, f"dcp-async-{r_}"), process_group=group
            )
        )
        _, rest = timed(fut.result)
        rec("dcp_async_stall", stall)
        rec("dcp_async_total", stall + rest)
    # The trainer's pattern, in rounds of its own after the others (its writes would
    # otherwise leave the disk busy for the sync save and the raw write): the step's
    # compute alone, then with each kind of save.
    for rnd in range(args.rounds):
        step = 2 * rnd + 1
        _, took = timed(compute)
        rec("compute", took)
        for mode, sv in stepped.items():
            (in_save, in_wait), took = timed(lambda sv=sv, s=step: step_with_save(sv, s))
            rec(f"{mode}_step", took)
            rec(f"{mode}_blocked", slowest(in_save + in_wait))
            rec(f"{mode}_in_wait", slowest(in_wait))
            timed(sv.wait)  # the write, outside the timing
    saver.close()
    sync.close()
    if sealed is not None:
        sealed.close()
    for sv in stepped.values():
        sv.close()
    r: dict[str, float] = {k: statistics.median(v) for k, v in runs.items()}
    r["async_first_stall"] = runs["async_stall"][0]
    r["dcp_async_first_stall"] = runs["dcp_async_stall"][0]
    later = range(1, args.rounds) if args.rounds > 1 else range(args.rounds)
    for mode in ("async", "overlap"):
        added = [runs[f"{mode}_step"][i] - runs["compute"][i] for i in range(args.rounds)]
        r[f"{mode}_first_added"] = added[0]
        r[f"{mode}_first_blocked"] = runs[f"{mode}_blocked"][0]
        r[f"{mode}_added"] = statistics.median(added[i] for i in later)
        r[f"{mode}_blocked"] = statistics.median(runs[f"{mode}_blocked"][i] for i in later)
        r[f"{mode}_first_in_wait"] = runs[f"{mode}_in_wait"][0]
        r[f"{mode}_in_wait"] = statistics.median(runs[f"{mode}_in_wait"][i] for i in later)
    if args.rounds > 1:
        r["async_stall"] = statistics.median(runs["async_stall"][1:])
        r["dcp_async_stall"] = statistics.median(runs["dcp_async_stall"][1:])
    r["bytes_written"] = total(len(payload))
    r["staging_allocations"] = saver.staging_allocations
    r["rounds"] = args.rounds

    # Loads: same layout (tp2 x dp2) and resharded (tp4), each the median of a few; "cold"
    # evicts both checkpoints from the page cache first (a resume on a fresh node), "warm"
    # reads them from memory.
    dcp_dir = os.path.join(base, "dcp-sync-0")
    targets = {}
    for label, tp in (("same", TP), ("reshard", 4)):
        tgt_model, tgt_optim = local_state(tensors, tp, rank % tp, fill=False)
        tgt_mesh = mesh if tp == TP else init_device_mesh("cpu", (4,), mesh_dim_names=("tp",))
        targets[label] = (tgt_model, tgt_optim, dtensor_state(tgt_model, tgt_optim, tgt_mesh, "tp"))
    times: dict[str, list[float]] = {}
    for _ in range(args.rounds):  # interleaved, like the saves
        for label, (tgt_model, tgt_optim, tgt) in targets.items():
            for cache in ("cold", "warm"):
                for verify in (True, False):
                    if cache == "cold" and rank == 0:
                        evict(ours)
                    ck, took = timed(
                        lambda m=tgt_model, o=tgt_optim, v=verify: load_latest(
                            ours, model=m, optimizer=o, group=group, verify=v
                        )
                    )
                    key = f"{cache}_load_{label}" + ("" if verify else "_noverify")
                    times.setdefault(key, []).append(took)
                    r[f"{key}_read"] = total(ck.stats.bytes_read)
                    r[f"{key}_needed"] = total(ck.stats.bytes_needed)
                    # Closed before the next eviction: pages a process still maps stay
                    # in the page cache, so an open load would make the next "cold" warm.
                    ck.close()
                if seal_key is not None and label == "reshard":
                    if cache == "cold" and rank == 0:
                        evict(sealed_dir)
                    ck, took = timed(
                        lambda m=tgt_model, o=tgt_optim: load_latest(
                            sealed_dir, model=m, optimizer=o, group=group, key=seal_key
                        )
                    )
                    times.setdefault(f"{cache}_sealed_load_reshard", []).append(took)
                    ck.close()
                if cache == "cold" and rank == 0:
                    evict(dcp_dir)
                before = rchar()
                _, took = timed(
                    lambda t=tgt: dcp.load(t, checkpoint_id=dcp_dir, process_group=group)
                )
                times.setdefault(f"{cache}_dcp_load_{label}", []).append(took)
                r[f"{cache}_dcp_load_{label}_read"] = total(rchar() - before)
    r.update({k: statistics.median(v) for k, v in times.items()})
    dist.barrier()
    if rank == 0:
        with open(out, "w") as f:
            json.dump(r, f)
    dist.destroy_process_group()


def amplification(ckpt: str, tensors, tp: int) -> tuple[int, int]:
    """Bytes read and bytes needed (verified loads) when every rank of a tp layout loads
    its shards from ``ckpt``, one after another in this process (a rank reads the same
    bytes alone as among others: the planner is per rank)."""
    read = needed = 0
    for rank in range(tp):
        model, optim = local_state(tensors, tp, rank, fill=False)
        with Checkpoint.open(os.path.join(ckpt, sorted(os.listdir(ckpt))[-1])) as ck:
            stats = ck.load_into(model, optim)
            read += stats.bytes_read
            needed += stats.bytes_needed
    return read, needed


def amplifications(base: str, args) -> dict[str, float]:
    """tp1 -> tp8 from a one-writer checkpoint of the whole state; tp2 -> tp3 from the
    benchmark's tp2 x dp2 checkpoint."""
    tensors = spec(args.hidden, args.layers, args.vocab)
    one = os.path.join(base, "tp1")
    saver = Saver(one, group=None, options=SaveOptions(async_=False, keep=1))
    model, optim = local_state(tensors, 1, 0, fill=True)
    saver.save(step=1, consumed_samples=1, model=model, optimizer=optim)
    saver.close()
    del model, optim
    out = {}
    for key, ckpt, tp in (("tp1_to_tp8", one, 8), ("tp2_to_tp3", os.path.join(base, "ours"), 3)):
        steps = [n for n in os.listdir(ckpt) if n.startswith("step-") and "." not in n]
        assert steps, ckpt
        read, needed = amplification(ckpt, tensors, tp)
        out[key] = read / needed
    return out


def report(r: dict[str, float], state_bytes: int) -> None:
    mb = 1e6
    written = r["bytes_written"]

    def rate(nbytes, secs):
        return f"{nbytes / mb / secs:8.0f} MB/s"

    print(
        f"state: {state_bytes / mb:.0f} MB global (model + exp_avg + exp_avg_sq), layout tp2 x dp2, 4 gloo ranks, 2 cores"
    )
    print(
        f"bytes written per save: ours {written / mb:.0f} MB (each region once); "
        f"medians of {r['rounds']:.0f} interleaved rounds; staging allocations over "
        f"all our async saves: {r['staging_allocations']:.0f}\n"
    )
    print("SAVE                                  seconds   throughput")
    rows = [
        ("raw write + fsync (same bytes, 4 writers)", r["raw"]),
        ("ours sync save", r["sync"]),
        ("DCP save", r["dcp_sync"]),
        ("ours async save, total", r["async_total"]),
        ("DCP async_save, total", r["dcp_async_total"]),
    ]
    for label, s in rows:
        print(f"  {label:<42} {s:7.3f}  {rate(written, s)}")
    print("\nASYNC STALL (caller blocked)          seconds")
    for label, key in (
        ("ours, first save (allocates staging)", "async_first_stall"),
        ("ours, later saves (staging reused)", "async_stall"),
        ("DCP async_save, first", "dcp_async_first_stall"),
        ("DCP async_save, later", "dcp_async_stall"),
    ):
        print(f"  {label:<42} {r[key]:7.3f}")
    print(
        f"\nIN A TRAINING STEP: save, the next step's compute ({r['compute']:.3f} s alone), "
        "then wait_snapshot()\nbefore its optimizer step        blocked  (in the wait)  step time added"
    )
    for label, mode in (
        ("ours async, snapshot in save()", "async"),
        ("ours async, snapshot overlapped", "overlap"),
    ):
        for when, pre in (("first", "_first"), ("later", "")):
            blocked, added = r[f"{mode}{pre}_blocked"], r[f"{mode}{pre}_added"]
            waited = r[f"{mode}{pre}_in_wait"]
            print(f"  {label + ', ' + when:<42} {blocked:7.3f}  ({waited:6.3f})   {added:7.3f}")
    print("  (step time added: with the save less the compute alone; it counts the")
    print("  background writer's use of the CPU too)")
    for cache, what in (("cold", "page cache evicted first"), ("warm", "from the page cache")):
        print(f"\nLOAD, {what:<29} seconds   throughput   read/needed")
        for label, key in (
            ("ours same layout (tp2 x dp2)", "load_same"),
            ("ours same layout, no verify", "load_same_noverify"),
            ("DCP same layout", "dcp_load_same"),
            ("ours resharded tp2 x dp2 -> tp4", "load_reshard"),
            ("ours resharded, no verify", "load_reshard_noverify"),
            ("DCP resharded -> tp4", "dcp_load_reshard"),
        ):
            k = f"{cache}_{key}"
            needed = r[f"{cache}_load_{'same' if 'same' in key else 'reshard'}_needed"]
            print(
                f"  {label:<42} {r[k]:7.3f}  {rate(needed, r[k])}   {r[f'{k}_read'] / needed:5.2f}x"
            )
    print("  (DCP bytes read = rchar of its read() calls; ours = bytes our loader asked for)")

    def goal(text, value, target, ok):
        print(f"  {text:<58} {value:6.2f}x   goal {target:<8} {'met' if ok else 'NOT met'}")

    print("\nGOALS (issue 13)")
    v = r["raw"] / r["sync"]
    goal("sync save speed vs raw write (raw_s / ours_s)", v, ">= 0.9", v >= 0.9)
    v = r["async_stall"] / r["sync"]
    goal("async stall vs our sync save (stall_s / sync_s)", v, "<= 0.1", v <= 0.1)
    v = r["overlap_blocked"] / r["sync"]
    goal("async stall, overlapped, in a training step / sync_s", v, "<= 0.1", v <= 0.1)
    for cache in ("cold", "warm"):
        v = r[f"{cache}_dcp_load_reshard"] / r[f"{cache}_load_reshard"]
        goal(f"resharded load speed vs DCP resharded ({cache}; dcp_s / ours_s)", v, ">= 2", v >= 2)
    v = r["cold_load_reshard_read"] / r["cold_load_reshard_needed"]
    goal("bytes read / needed, tp2 x dp2 -> tp4", v, "<= 1.05", v <= 1.05)
    for key, text in (("tp1_to_tp8", "tp1 -> tp8"), ("tp2_to_tp3", "tp2 -> tp3")):
        v = r[key]
        goal(f"bytes read / needed, {text} (verified loads, every rank)", v, "<= 1.05", v <= 1.05)
    if "sealed_sync" in r:
        print("\nSEALED (checkpoint.key_file: a MAC per verify block and one over the manifest)")
        for text, ours_key, sealed_key in (
            ("sync save, sealed / unsealed (seconds)", "sync", "sealed_sync"),
            ("resharded load cold, sealed / unsealed", "cold_load_reshard", "cold_sealed_load_reshard"),
            ("resharded load warm, sealed / unsealed", "warm_load_reshard", "warm_sealed_load_reshard"),
        ):  # fmt: skip
            print(f"  {text:<58} {r[sealed_key] / r[ours_key]:6.2f}x   "
                  f"({r[sealed_key]:.3f} s against {r[ours_key]:.3f} s)")  # fmt: skip
        v = r["raw"] / r["sealed_sync"]
        goal("sealed sync save speed vs raw write (raw_s / sealed_s)", v, ">= 0.9", v >= 0.9)
    print("\nALSO")
    v = r["dcp_sync"] / r["sync"]
    goal("sync save speed vs DCP save (dcp_s / ours_s)", v, "> 1", v > 1)
    v = r["async_stall"] / r["dcp_async_stall"]
    goal("async stall vs DCP async_save blocked time", v, "<= 0.5", v <= 0.5)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--vocab", type=int, default=8192)
    p.add_argument("--rounds", type=int, default=3, help="repetitions (medians are reported)")
    p.add_argument(
        "--dir", default=None, help="scratch directory (default: a temp dir under the cwd)"
    )
    p.add_argument(
        "--sealed",
        action="store_true",
        help="also time a sealed sync save and sealed resharded loads (checkpoint.seal)",
    )
    args = p.parse_args()
    base = args.dir or tempfile.mkdtemp(prefix="bench-ckpt-", dir=os.getcwd())
    args.dir = base
    os.makedirs(base, exist_ok=True)
    try:
        out = os.path.join(base, "result.json")
        store = os.path.join(base, "store")
        mp.spawn(worker, args=(TP * DP, store, args, out), nprocs=TP * DP, join=True)
        with open(out) as f:
            r = json.load(f)
        r.update(amplifications(base, args))
        numel = sum(
            torch.Size(shape).numel() for _, shape, _ in spec(args.hidden, args.layers, args.vocab)
        )
        report(r, 3 * 4 * numel)
    finally:
        if args.dir == base:
            shutil.rmtree(base, ignore_errors=True)


if __name__ == "__main__":
    main()
