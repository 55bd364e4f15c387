"""State-transfer benchmark: recover_from_peers against a raw gloo send/recv of the same bytes.

    OMP_NUM_THREADS=1 python bench/transfer.py [--procs 2,3,4] [--sizes 12.6,100] [--rounds 5]

For each process count and state size, gloo ranks on this machine hold a GPT-like state
(parameters + AdamW exp_avg + exp_avg_sq, fp32, plus AdamW's 0-d per-parameter steps) and
refill a new layout's tensors with :func:`checkpoint.live.recover_from_peers`: the whole
call (JSON all-gather, planning, packing, CRC-32 on both sides, transfer, unpacking, the
final agreement). Two patterns:

- ``heal``: every rank but the last holds a full replica; the last is a newcomer that
  needs everything (spread over the holders by the planner), like torchft's heal.
- ``reshard``: every rank holds one row block of every tensor and needs its neighbour's
  (a layout change in which no byte is local); every rank sends and receives.

The baseline, in the same run and the same rounds (interleaved), is a raw gloo
``isend``/``irecv`` of the same byte counts between the same pairs, one preallocated
buffer per pair, all posted at once. Each time is the slowest rank's; the table shows
medians, throughput as bytes moved between ranks over that time, and ours / raw.

In ``heal`` the holders also copy their whole state into their (distinct) need tensors,
bytes the raw baseline does not move. So heal is also timed in place, interleaved in the
same rounds: the holders pass their tensors as both ``have`` and ``need``, as
``Context.sync_state`` does (nothing is copied onto itself), and only the moved bytes
remain. The GOAL line is the whole call (heal with its local copies); the line after it
takes heal in place (reshard has no local bytes either way).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from checkpoint.live import recover_from_peers
from checkpoint.shards import ShardInfo

HIDDEN, VOCAB = 256, 1024
"""The default hidden size: small matrices (0.26-1 MB each in fp32), so a state of the
torchft anchor's 12.6 MB has several layers; ``--hidden`` sets another (1024: 4-16 MB
matrices, nearer a real model's, where per-message costs matter less)."""
PATTERNS = ("heal", "reshard")
MOVING = ("post", "send", "local", "receive", "sent")
"""The phases of a call that move the bytes (posting the receives, packing, CRC-32C on both
sides, the sends, local copies, unpacking, waiting for the last send): the whole call less
its description all-gather, planning and the final agreement (one all-reduce)."""


def spec(target_mb: float, hidden: int = HIDDEN) -> list[tuple[str, tuple[int, ...]]]:
    """Global parameter shapes of a GPT-like model whose state (x3 for AdamW) is about
    ``target_mb`` (at least one layer): an embedding, then layers of qkv, proj, fc1, fc2
    and two norms."""
    h = hidden
    per_layer = 12 * h * h + 2 * h
    layers = max(1, round((target_mb * 1e6 / 12 - VOCAB * h) / per_layer))
    out = [("embedding.weight", (VOCAB, h))]
    for i in range(layers):
        p = f"decoder.layers.{i}"
        out += [
            (f"{p}.attn.qkv.weight", (3 * h, h)),
            (f"{p}.attn.proj.weight", (h, h)),
            (f"{p}.mlp.fc1.weight", (4 * h, h)),
            (f"{p}.mlp.fc2.weight", (h, 4 * h)),
            (f"{p}.ln1.weight", (h,)),
            (f"{p}.ln2.weight", (h,)),
        ]
    return out


def holding(tensors, info_of, *, fill: bool) -> dict[str, tuple[torch.Tensor, ShardInfo]]:
    out = {}
    for name, shape in tensors:
        info = info_of(name, shape)
        for key in (name, f"exp_avg/{name}", f"exp_avg_sq/{name}"):
            t = torch.rand(info.sizes) if fill else torch.zeros(info.sizes)
            out[key] = (t, info)
        step = ShardInfo.whole(f"step/{name}", ())
        out[f"step/{name}"] = (torch.tensor(3.0 if fill else 0.0), step)
    return out


def rows(rank: int, world: int):
    """Row block ``rank`` of ``world`` near-equal blocks of every tensor."""

    def info_of(name, shape):
        lo, hi = shape[0] * rank // world, shape[0] * (rank + 1) // world
        return ShardInfo(name, shape, (lo, *[0] * (len(shape) - 1)), (hi - lo, *shape[1:]))

    return info_of


def state_for(pattern: str, rank: int, world: int, tensors):
    """(have, need) of ``rank``."""
    whole = ShardInfo.whole
    if pattern == "heal":
        have = None if rank == world - 1 else holding(tensors, whole, fill=True)
        return have, holding(tensors, whole, fill=False)
    have = holding(tensors, rows(rank, world), fill=True)
    return have, holding(tensors, rows((rank + 1) % world, world), fill=False)


def slowest(seconds: float, group) -> float:
    t = torch.tensor([seconds], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    return float(t.item())


def in_place(pattern: str, have, need):
    """Heal as ``Context.sync_state`` calls it: a holder's need tensors are its own."""
    return (have, have if have is not None else need) if pattern == "heal" else None


def recover(have, need, group):
    rec = recover_from_peers(
        have=have, have_step=3 if have else None, have_consumed=96 if have else None,
        need=need, group=group,
    )  # fmt: skip
    assert rec is not None
    return rec


def measure(
    pattern: str, size: float, rank: int, world: int, group, rounds: int, hidden: int = HIDDEN
) -> dict:
    tensors = spec(size, hidden)
    have, need = state_for(pattern, rank, world, tensors)
    # The raw baseline moves what our plan moves, pair by pair (learned from a first,
    # untimed call of ours, which also warms both up).
    rec = recover(have, need, group)
    sent = {int(k): v for k, v in rec.sources["sent_to"].items()}
    got = {int(k): v for k, v in rec.sources["received_from"].items()}
    send_bufs = {d: torch.ones(n, dtype=torch.uint8) for d, n in sent.items()}
    recv_bufs = {s: torch.empty(n, dtype=torch.uint8) for s, n in got.items()}
    moved = torch.tensor([rec.bytes_in], dtype=torch.int64)
    dist.all_reduce(moved, group=group)
    state_bytes = sum(t.numel() * t.element_size() for t, _ in need.values())
    state_bytes = state_bytes if pattern == "heal" else state_bytes * world

    def raw() -> None:
        works = [dist.irecv(b, group=group, group_src=s) for s, b in recv_bufs.items()]
        works += [dist.isend(b, group=group, group_dst=d) for d, b in send_bufs.items()]
        for w in works:
            w.wait()

    cases = {"ours": lambda: recover(have, need, group), "raw": raw}
    inplace = in_place(pattern, have, need)
    if inplace is not None:
        recover(*inplace, group)  # warm
        cases["in place"] = lambda: recover(*inplace, group)
    times: dict[str, list[float]] = {label: [] for label in cases}
    plan: list[float] = []
    moving: list[float] = []
    for rnd in range(rounds):
        order = list(cases)
        for label in order[rnd % len(order) :] + order[: rnd % len(order)]:
            dist.barrier(group=group)
            t0 = time.perf_counter()
            r = cases[label]()
            times[label].append(slowest(time.perf_counter() - t0, group))
            if label == "ours":
                plan.append(slowest(r.sources["plan_seconds"], group))
                phases = r.sources["phases"]
                moving.append(slowest(sum(phases[k] for k in MOVING), group))
    return {
        "size_mb": size,
        "state_bytes": state_bytes,
        "pattern": pattern,
        "moved": int(moved.item()),
        **{label: statistics.median(t) for label, t in times.items()},
        "plan": statistics.median(plan),
        "moving": statistics.median(moving),
    }


def worker(rank: int, world: int, store: str, args: argparse.Namespace, out: str) -> None:
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    group = dist.new_group(backend="gloo")
    results = [
        measure(pattern, size, rank, world, group, args.rounds, args.hidden)
        for size in args.sizes
        for pattern in PATTERNS
    ]
    dist.destroy_process_group()
    if rank == 0:
        with open(out, "w") as f:
            json.dump(results, f)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--procs", default="2,3,4", help="process counts, comma-separated")
    p.add_argument("--sizes", default="12.6,100", help="state sizes in MB, comma-separated")
    p.add_argument("--rounds", type=int, default=5, help="repetitions (medians are reported)")
    p.add_argument("--hidden", type=int, default=HIDDEN,
                   help="the model's hidden size (the state has at least one layer)")  # fmt: skip
    args = p.parse_args()
    args.sizes = [float(s) for s in args.sizes.split(",")]
    procs = [int(n) for n in args.procs.split(",")]
    print(
        f"gloo on this machine ({os.cpu_count()} cores); state = params + exp_avg + exp_avg_sq "
        f"fp32 (+ 0-d steps), hidden {args.hidden}; medians of {args.rounds} interleaved rounds, "
        "slowest rank\n"
    )
    print(
        f"{'procs':>5} {'pattern':<8} {'state MB':>8} {'moved MB':>8}   "
        f"{'ours s':>7} {'MB/s':>6}   {'raw s':>7} {'MB/s':>6}   {'ours/raw':>8}  plan s"
        f"   {'in place s':>10} {'/raw':>5}"
    )
    ratios, moved_only, moving = [], [], []
    with tempfile.TemporaryDirectory(prefix="bench-transfer-") as tmp:
        for n in procs:
            out = os.path.join(tmp, f"result-{n}.json")
            store = os.path.join(tmp, f"store-{n}")
            mp.spawn(worker, args=(n, store, args, out), nprocs=n, join=True)
            with open(out) as f:
                for r in json.load(f):
                    moved = r["moved"] / 1e6
                    ratio = r["raw"] / r["ours"]
                    ratios.append(ratio)
                    moving.append(r["raw"] / r["moving"])
                    inplace = r.get("in place")
                    moved_only.append(ratio if inplace is None else r["raw"] / inplace)
                    extra = "" if inplace is None else f"   {inplace:10.3f} {moved_only[-1]:5.2f}"
                    print(
                        f"{n:>5} {r['pattern']:<8} {r['state_bytes'] / 1e6:8.1f} {moved:8.1f}   "
                        f"{r['ours']:7.3f} {moved / r['ours']:6.0f}   "
                        f"{r['raw']:7.3f} {moved / r['raw']:6.0f}   {ratio:8.2f}  {r['plan']:.3f}"
                        f"{extra}"
                    )
    worst = min(ratios)
    print(
        f"\nGOAL  state-transfer throughput vs raw gloo send/recv: worst {worst:.2f}x, "
        f"median {statistics.median(ratios):.2f}x   goal >= 0.8   "
        f"{'met' if worst >= 0.8 else 'NOT met'}"
    )
    print(
        f"      moved bytes only (heal in place, no local copies): worst {min(moved_only):.2f}x, "
        f"median {statistics.median(moved_only):.2f}x"
    )
    print(
        f"      the data movement alone (the call less its all-gather, planning and final "
        f"agreement; CRC-32C included): worst {min(moving):.2f}x, "
        f"median {statistics.median(moving):.2f}x"
    )


if __name__ == "__main__":
    main()
