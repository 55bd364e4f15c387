"""An async save snapshots with the last plan while the plan's collective is in flight;
when another rank's tensors changed (so the plan changed) that snapshot is redone, on real
gloo processes and real files."""

from __future__ import annotations

import json
from pathlib import Path

import torch
import torch.distributed as dist
from test_checkpoint_multirank import _init, spawn

from checkpoint import SaveOptions, Saver, ShardInfo, open_step


def value(name: str, step: int, n: int) -> torch.Tensor:
    return torch.arange(n, dtype=torch.float32) + 1000 * step + (0.5 if name == "c" else 0)


def _worker(rank, world, store, ckpt, out):
    group = _init(rank, world, store)
    try:
        saver = Saver(ckpt, group=group, options=SaveOptions(async_=True, chunk_min_bytes=256))
        for step in (1, 2, 3):
            model = {
                name: (value(name, step, n), ShardInfo.whole(name, (n,)))
                for name, n in (("a", 300), ("c", 300))
            }
            if rank == 1 and step >= 2:
                # Rank 1 alone holds a new, large tensor from step 2: the writers change
                # (rank 0 now writes a and c) though rank 0 holds what it held.
                model["d"] = (value("d", step, 2000), ShardInfo.whole("d", (2000,)))
            saver.save(step=step, consumed_samples=step, model=model)
            saver.wait()
        saver.close()
    finally:
        dist.destroy_process_group()
    Path(out, f"rank-{rank}.json").write_text(json.dumps({}))


def test_a_changed_plan_redoes_the_early_snapshot(tmp_path):
    ckpt = str(tmp_path / "ckpt")
    spawn(_worker, 2, tmp_path, ckpt)
    writers = {}
    for step in (1, 2, 3):
        with open_step(ckpt, step) as ck:
            for name, n in (("a", 300), ("c", 300), ("d", 2000)):
                if name == "d" and step == 1:
                    continue
                assert torch.equal(ck.read(name), value(name, step, n)), (step, name)
                writers[(step, name)] = ck.manifest.tensors[name].chunks[0].file
    # The plan did change: c moved from rank 1's file to rank 0's.
    assert writers[(1, "c")] == "rank-00001.safetensors"
    assert writers[(2, "c")] == writers[(3, "c")] == "rank-00000.safetensors"
