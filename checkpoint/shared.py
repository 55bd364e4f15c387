"""Is the checkpoint directory one directory shared by every rank? A probe file says.

A multi-node job needs a checkpoint directory on storage every node sees: each commit is
one rename by group rank 0 of files every rank wrote, and a resume on any layout reads
files other ranks wrote. On node-local disks every save would fail with a bare ENOENT, so
the trainer asks :func:`blind_ranks` once at job start and stops there, in one line.
"""

from __future__ import annotations

import os

import torch.distributed as dist

from checkpoint import store
from checkpoint.comm import all_gather_json, broadcast_json, group_rank
from checkpoint.errors import CheckpointError


def blind_ranks(ckpt_dir: str, group: dist.ProcessGroup | None) -> tuple[list[int], str]:
    """Group ranks that do not see a probe file group rank 0 writes into ``ckpt_dir``, and
    the probe's name (a collective over ``group``; every rank gets the same answer). When
    rank 0 cannot write it, every rank raises the same :class:`CheckpointError`."""
    leader = group_rank(group) == 0
    said: dict[str, str] = {}
    if leader:
        try:
            said["name"] = store.write_probe(ckpt_dir)
        except OSError as exc:  # a full disk, a read-only directory: every rank says it
            said["error"] = f"cannot write a probe file into {ckpt_dir}: {exc.strerror}"
    distributed = dist.is_initialized()
    if distributed:
        said = broadcast_json(said, group)  # after rank 0's write
    if "error" in said:
        raise CheckpointError(said["error"])
    name = said["name"]
    seen = os.path.isfile(os.path.join(ckpt_dir, name))
    everyone = all_gather_json(seen, group) if distributed else [seen]
    if leader:  # every rank has looked
        store.remove_probe(ckpt_dir, name)
    return [r for r, ok in enumerate(everyone) if not ok], name
