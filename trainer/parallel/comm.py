"""The trainer's collectives, each issued asynchronously and waited for through
:func:`elasticd.inprocess.wait_collective`.

Why not the plain synchronous calls: under in-process restart on gloo, a collective between
two *survivors* can be left waiting for the whole group timeout when the round ends in the
middle of it. The round's end shuts its connections, and gloo then fails a collective
within milliseconds, but not always: `bench/recovery.py --cases inproc-move` (tp2×dp2, the
node of rank 0 killed) caught a survivor in the tensor-parallel all-reduce of a backward
with its tp peer in 2 of 24 runs, and only the stuck-worker exit (10 s, then a process
restart from the checkpoint) ended it. Waited for in slices, such a collective is
abandoned 0.3 s after its round ended (``RoundAborted``) and the worker recovers in-process
like its peers. Outside an in-process round, and on NCCL, the wait is ``work.wait()``, the
same as the synchronous call.

Point-to-point transfers (the pipeline's sends and receives) are posted by the pipeline
and waited for through :func:`elasticd.inprocess.wait_transfer` (re-exported here): a timed
wait on one makes gloo fail its whole group, so the untimed wait runs on a waiter thread,
and the round's thread waits for that in slices, abandoning it like a collective.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from elasticd.inprocess import wait_collective
from elasticd.inprocess import wait_transfer as wait_transfer  # the pipeline's waits

# torch 2.13 renamed the flat collectives (the old names warn); older torch has only those.
all_gather_base = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
"""All-gather into one tensor (torch's newer name where it has one)."""
reduce_scatter_base = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
"""Reduce-scatter out of one tensor (torch's newer name where it has one)."""


def all_reduce(t: torch.Tensor, group: dist.ProcessGroup | None, op=dist.ReduceOp.SUM) -> None:
    """``dist.all_reduce(t, op, group)``, in place."""
    wait_collective(dist.all_reduce(t, op=op, group=group, async_op=True), group)


def all_gather_single(out: torch.Tensor, x: torch.Tensor, group: dist.ProcessGroup | None) -> None:
    """Every rank's ``x`` into ``out``, rank r's at ``out[r·len(x):(r+1)·len(x)]``."""
    wait_collective(all_gather_base(out, x, group=group, async_op=True), group)


def reduce_scatter_single(out: torch.Tensor, x: torch.Tensor,
                          group: dist.ProcessGroup | None) -> None:  # fmt: skip
    """This rank's part of the sum of every rank's ``x`` into ``out``."""
    wait_collective(reduce_scatter_base(out, x, group=group, async_op=True), group)


def all_to_all_single(out: torch.Tensor, x: torch.Tensor, out_splits: list[int] | None,
                      in_splits: list[int] | None, group: dist.ProcessGroup | None) -> None:  # fmt: skip
    """``dist.all_to_all_single(out, x, out_splits, in_splits, group)``."""
    work = dist.all_to_all_single(out, x, out_splits, in_splits, group=group, async_op=True)
    wait_collective(work, group)


def barrier(group: dist.ProcessGroup | None = None) -> None:
    """``dist.barrier(group)``."""
    wait_collective(dist.barrier(group=group, async_op=True), group)
