"""In-memory replicas (``checkpoint.memory_replicas``): who keeps whose copy, how the live
planner combines snapshots and replicas with live tensors, and the Replicator's double
buffers on real gloo processes. The end-to-end case (a killed node's TP shard restored
from its replica under real agents) is in test_inprocess.py."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from checkpoint.live import DESCRIPTION_VERSION, plan_recovery, recover_from_peers
from checkpoint.shards import ShardInfo
from trainer.replicas import Replicator, targets


def test_each_rank_is_copied_to_its_counterpart_on_the_next_nodes() -> None:
    nodes = ["a", "a", "b", "b", "c", "c"]
    active = [0, 1, 2, 3, 4, 5]
    assert targets(nodes, active, 0, 1) == [2]
    assert targets(nodes, active, 1, 1) == [3]
    assert targets(nodes, active, 5, 1) == [1]
    # two copies: two other nodes, never twice the same one, never its own
    assert targets(nodes, active, 0, 2) == [2, 4]
    assert targets(nodes, active, 3, 2) == [5, 1]
    assert targets(nodes, active, 0, 5) == [2, 4]
    # spares keep nothing and send nothing; one node has nowhere to send
    assert targets(nodes, [0, 2], 0, 1) == [2] and targets(nodes, [0, 2], 4, 1) == []
    assert targets(["a", "a"], [0, 1], 0, 1) == []
    assert targets(nodes, active, 0, 0) == []
    # a node with fewer active ranks: indexes wrap
    assert targets(["a", "a", "b"], [0, 1, 2], 1, 1) == [2]


def test_with_eight_ranks_a_node_every_rank_keeps_one_replica_per_copy() -> None:
    """No rank takes a whole node's copies (which would cost it 8x the memory)."""
    nodes = [f"n{r // 8}" for r in range(32)]
    active = list(range(32))
    for copies in (1, 2):
        kept = [0] * 32
        for r in active:
            for t in targets(nodes, active, r, copies):
                assert nodes[t] != nodes[r]
                kept[t] += 1
        assert kept == [copies] * 32


def _entry(g, o, s):
    return ["float32", list(g), list(o), list(s)]


def test_the_planner_takes_a_dead_ranks_shard_from_a_replica_at_the_replicated_step() -> None:
    """tp2: rank 0 survives (live tp0 at step 6, its snapshot and rank 1's replica at 5);
    rank 1 is a newcomer needing tp1. Step 6 lacks tp1; step 5 has both, from rank 0's
    snapshot (its own part) and replica (the newcomer's part)."""
    g = (4, 2)
    tp0, tp1 = ((0, 0), (2, 2)), ((2, 0), (2, 2))
    survivor = {
        "v": DESCRIPTION_VERSION, "step": 6, "consumed": 60, "have": {"w": _entry(g, *tp0)},
        "more": [
            {"step": 5, "consumed": 50, "have": {"w": _entry(g, *tp0)}},
            {"step": 5, "consumed": 50, "have": {"w": _entry(g, *tp1)}},
        ],
        "need": {"w": _entry(g, *tp0)}, "error": None,
    }  # fmt: skip
    newcomer = {"v": DESCRIPTION_VERSION, "step": None, "consumed": None, "have": {}, "more": [],
                "need": {"w": _entry(g, *tp1)}, "error": None}  # fmt: skip
    plan, why = plan_recovery([survivor, newcomer])
    assert plan is not None, why
    assert (plan.step, plan.consumed_samples, plan.skipped_steps) == (5, 50, (6,))
    by_dst = {(p.dst, p.src, p.src_set, p.box) for p in plan.pieces}
    assert by_dst == {(0, 0, 1, tp0), (1, 0, 2, tp1)}
    # Without the replica, no step covers tp1.
    survivor["more"] = survivor["more"][:1]
    assert plan_recovery([survivor, newcomer])[0] is None


WORLD = 3
SHAPE = (6, 4)


def _worker(rank: int, store: str, out: str, device: str) -> None:
    """Three ranks on three 'nodes', each its own shard of one tensor; replicate at steps
    1 and 2, then recover as if rank 2 had died: ranks 0 and 1 keep their shards and take
    rank 2's from the replica. On ``cuda`` the tensors live on the GPU (one GPU shared by
    the three processes; gloo moves them through pinned host memory)."""
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=WORLD)
    rows = SHAPE[0] // WORLD
    info = ShardInfo("w", SHAPE, (rank * rows, 0), (rows, SHAPE[1]))
    w = torch.zeros(rows, SHAPE[1], device=device)
    rep = Replicator(live=lambda: {"w": (w, info)}, copies=1, every=1, node=f"n{rank}",
                     group=None)  # fmt: skip
    for step in (1, 2):
        rep.wait_copied()  # as the optimizer step does: the snapshot's copy read w first
        w.fill_(10 * step + rank)
        rep.after_step(step, step * 8)
    rep.close()
    dist.barrier()
    rep.wait_copied()
    w.fill_(99)  # step 3 trained on: live state moved past the replicas
    held = rep.held()
    # Recovery over the same group: rank 2 stands for a newcomer that holds nothing; ranks
    # 0 and 1 offer live state (step 3) and what they held (steps 1 and 2).
    need_t = torch.full((rows, SHAPE[1]), -1.0, device=device)
    need = {"w": (need_t, info)}
    if rank == 2:
        result = recover_from_peers(have=None, have_step=None, have_consumed=None, need=need,
                                    group=None)  # fmt: skip
    else:
        result = recover_from_peers(have={"w": (w, info)}, have_step=3, have_consumed=24,
                                    need=need, group=None, extra=held)  # fmt: skip
    # The next round's replicator, this rank's tensors laid out alike: it shares the
    # snapshot buffers (and offers them at their steps before its first replication); one
    # laid out otherwise makes its own.
    again = Replicator(live=lambda: {"w": (w, info)}, copies=1, every=1, node=f"n{rank}",
                       group=None, previous=rep)  # fmt: skip
    half = ShardInfo("w", SHAPE, (rank * rows, 0), (1, SHAPE[1]))
    other = Replicator(live=lambda: {"w": (w[:1], half)}, copies=1, every=1, node=f"n{rank}",
                       group=None, previous=again)  # fmt: skip
    Path(out, f"rank-{rank}.json").write_text(json.dumps({
        "shared": [a is b for a, b in zip(again.snapshots, rep.snapshots, strict=True)],
        "offered_again": sorted(h.step for h in again.held()),
        "other": len(other.snapshots),
        "steps": sorted(h.step for h in held),
        "step": result.step if result else None,
        "values": need_t.unique().tolist(),
        "pinned": [b.flat.is_pinned() for b in rep.snapshots],
        "from_extra": result.sources["from_extra"] if result else None,
    }))  # fmt: skip
    dist.destroy_process_group()


@pytest.mark.timeout(180)
@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_replicas_on_real_gloo_restore_a_lost_shard_at_the_last_replicated_step(tmp_path, device):
    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    out = tmp_path / "out"
    out.mkdir()
    mp.spawn(_worker, args=(str(tmp_path / "store"), str(out), device), nprocs=WORLD, join=True)
    for rank in range(WORLD):
        r = json.loads((out / f"rank-{rank}.json").read_text())
        # Each rank holds two snapshots of its own (steps 1, 2) and two of its source's.
        assert r["steps"] == [1, 1, 2, 2], (rank, r)
        # Step 3 has no holder of rank 2's region: back to step 2, from snapshots/replicas.
        assert r["step"] == 2 and r["from_extra"], (rank, r)
        assert r["values"] == [20 + rank], (rank, r)
        assert r["pinned"] == [device == "cuda"] * 2, r
        assert r["shared"] == [True, True] and r["offered_again"] == [1, 2], r
        assert r["other"] == 0, r


BIG = 16 << 20  # float32 elements: 64 MiB, long enough a copy for a race to show


def _overlap_worker(rank: int, store: str, out: str) -> None:
    """Two ranks on two 'nodes', each a 64 MiB tensor on the GPU, replicated every step;
    the tensor is overwritten right after each replication (after ``wait_copied``, as the
    trainer's optimizer step is), while the side stream's copy may still be reading it."""
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2)
    info = ShardInfo("w", (2 * BIG,), (rank * BIG,), (BIG,))
    w = torch.zeros(BIG, device="cuda")
    rep = Replicator(live=lambda: {"w": (w, info)}, copies=1, every=1, node=f"n{rank}",
                     group=None)  # fmt: skip
    for step in (1, 2, 3):
        rep.wait_copied()
        w.fill_(10 * step + rank)
        rep.after_step(step, step)
        # The next step's "update", queued at once: with the wait, it runs after the copy.
        rep.wait_copied()
        w.fill_(-1.0)
    rep.close()
    held = {}
    for h in rep.held():
        t = h.tensors["w"][0]
        held.setdefault(h.step, []).append(sorted(t.unique().tolist()))
    Path(out, f"rank-{rank}.json").write_text(json.dumps({
        "held": {str(k): sorted(v) for k, v in held.items()},
        "pinned": [b.flat.is_pinned() for b in rep.snapshots],
    }))  # fmt: skip
    dist.destroy_process_group()


@pytest.mark.gpu
@pytest.mark.timeout(180)
def test_a_snapshot_copied_on_a_side_stream_is_the_state_of_its_step(tmp_path):
    """On CUDA the snapshot is copied on a side stream and sent once the copy landed; a
    state overwritten right after the replication (behind ``wait_copied``) is not in it,
    neither in the sender's snapshot nor in the replica its peer received."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    out = tmp_path / "out"
    out.mkdir()
    mp.spawn(_overlap_worker, args=(str(tmp_path / "store"), str(out)), nprocs=2, join=True)
    for rank in range(2):
        r = json.loads((out / f"rank-{rank}.json").read_text())
        peer = 1 - rank
        assert r["pinned"] == [True, True], r
        # Steps 2 and 3: this rank's snapshot and its peer's replica, each one value.
        assert r["held"] == {
            "2": sorted([[20.0 + rank], [20.0 + peer]]),
            "3": sorted([[30.0 + rank], [30.0 + peer]]),
        }, r


def test_pinned_buffers_are_released_only_when_the_state_changed_size() -> None:
    """After a recovery, the previous world's pinned buffers (snapshots, save staging) are
    of use again only at the same state size; a newcomer had none."""
    from trainer.recovery import pinned_cache_is_stale, release_stale_pinned

    assert pinned_cache_is_stale(100, 60)  # ZeRO-1 rows over another dp size, a new layout
    assert pinned_cache_is_stale(100, 0)  # active before, a spare now
    assert not pinned_cache_is_stale(100, 100)  # a DP shrink: the same buffers again
    assert not pinned_cache_is_stale(None, 100)  # a newcomer: nothing of its own before
    if not torch.cuda.is_available():  # nothing pinned to release
        assert release_stale_pinned(100, 60) is False


@pytest.mark.gpu
def test_torch_keeps_freed_pinned_blocks_rounded_up_until_the_release() -> None:
    """The facts ``release_stale_pinned`` rests on, measured: a pinned block is rounded up
    to a power of two, stays with torch's host allocator once freed, and is returned by the
    release after a change of state size (not after none)."""
    from trainer.recovery import release_stale_pinned

    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")

    def owned() -> int:
        return torch.cuda.host_memory_stats()["allocated_bytes.current"]

    release_stale_pinned(1, 2)  # start from an empty cache
    base = owned()
    t = torch.empty((5 << 20) + 1, dtype=torch.uint8, pin_memory=True)
    assert owned() - base == 8 << 20  # 5 MiB + 1 byte: an 8 MiB block
    del t
    assert owned() - base == 8 << 20  # freed, still pinned
    assert release_stale_pinned(7, 7) is False
    assert owned() - base == 8 << 20
    assert release_stale_pinned(7, 9) is True
    assert owned() == base
