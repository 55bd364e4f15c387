"""Process groups from a layout, on real gloo processes."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from elasticd.layout import GROUP_KINDS, ParallelConfig, plan_world
from trainer.parallel.groups import ProcessGroups


def _worker(rank: int, world: int, parallel: ParallelConfig, store: str, out: str) -> None:
    os.environ["OMP_NUM_THREADS"] = "1"
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    try:
        layout = plan_world(world, parallel)
        pgs = ProcessGroups.build(layout, rank=rank)
        sums = {}
        for kind in GROUP_KINDS:
            group = pgs.get(kind)
            if group is None:
                sums[kind] = None
                continue
            value = torch.tensor([float(rank)])
            dist.all_reduce(value, group=group)
            sums[kind] = [value.item(), list(pgs.ranks(kind)), pgs.index(kind)]
        dist.barrier()
        Path(out, f"rank-{rank}.json").write_text(json.dumps(sums))
    finally:
        dist.destroy_process_group()


def _run(tmp_path: Path, world: int, parallel: ParallelConfig) -> dict[int, dict]:
    mp.start_processes(
        _worker,
        args=(world, parallel, str(tmp_path / "store"), str(tmp_path)),
        nprocs=world,
        start_method="spawn",
    )
    return {r: json.loads((tmp_path / f"rank-{r}.json").read_text()) for r in range(world)}


@pytest.mark.timeout(240)
def test_an_all_reduce_inside_each_group_kind_sums_exactly_that_groups_members(tmp_path):
    parallel = ParallelConfig(tp=2, pp=2, ep=2)
    layout = plan_world(8, parallel)
    results = _run(tmp_path, 8, parallel)
    for rank, sums in results.items():
        for kind in GROUP_KINDS:
            group = layout.group_of(kind, rank)
            if group is None:
                assert sums[kind] is None, (rank, kind)
                continue
            total, ranks, index = sums[kind]
            assert ranks == list(group)
            assert index == group.index(rank)
            assert total == float(sum(group)), (rank, kind)


@pytest.mark.timeout(120)
def test_a_spare_rank_joins_group_creation_but_belongs_to_no_group(tmp_path):
    parallel = ParallelConfig(tp=2)
    results = _run(tmp_path, 3, parallel)
    assert all(v is None for k, v in results[2].items() if k in GROUP_KINDS)
    assert results[0]["tp"][0] == 1.0 and results[1]["tp"][0] == 1.0
