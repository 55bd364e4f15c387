"""What a model shard needs to know about its place in the world, in one frozen object.

Built once per world from :class:`~trainer.parallel.groups.ProcessGroups` (or as a
single-process context for tests and tools) and passed keyword-only into every parallel
module. No module reads a global.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch.distributed as dist

if TYPE_CHECKING:
    from trainer.parallel.groups import ProcessGroups
    from trainer.parallel.rng import DropoutRNG


@dataclass(frozen=True, kw_only=True, slots=True)
class GroupSlot:
    """One communicator as a layer sees it: the group, its size and this rank's index."""

    group: dist.ProcessGroup | None = None
    """The torch group; None when the size is 1 (no communication needed)."""
    size: int = 1
    """Ranks in the group."""
    rank: int = 0
    """This rank's position in the group."""

    @property
    def active(self) -> bool:
        """Whether collectives are needed at all."""
        return self.size > 1


@dataclass(frozen=True, kw_only=True, slots=True)
class ParallelContext:
    """This rank's tensor, expert and data groups."""

    tp: GroupSlot = GroupSlot()
    """Tensor parallelism of the dense layers."""
    ep: GroupSlot = GroupSlot()
    """Expert parallelism: experts are partitioned over this group."""
    etp: GroupSlot = GroupSlot()
    """Tensor parallelism inside each expert (1, or equal to tp)."""
    dp_cp: GroupSlot = GroupSlot()
    """Data (and context) parallelism of the dense parameters."""
    expert_dp: GroupSlot = GroupSlot()
    """Data parallelism of the expert parameters."""
    sp: bool = False
    """Sequence parallelism (tp > 1 only): outside the tensor-parallel regions activations
    are this rank's part of the sequence (trainer/parallel/tensor.py)."""
    rng: DropoutRNG | None = None
    """Dropout's RNG tracker (trainer/parallel/rng.py); None: dropout draws from the
    default generators (one process, or no dropout)."""

    @classmethod
    def single(cls) -> ParallelContext:
        """One process holding the whole model."""
        return cls()

    @classmethod
    def from_groups(cls, groups: ProcessGroups) -> ParallelContext:
        def slot(kind: str) -> GroupSlot:
            return slot_of(groups, kind)

        return cls(
            tp=slot("tp"),
            ep=slot("expert-ep"),
            etp=slot("expert-tp"),
            dp_cp=slot("dp-cp"),
            expert_dp=slot("expert-dp"),
        )


def slot_of(groups: ProcessGroups, kind: str) -> GroupSlot:
    """This rank's group of ``kind`` as a :class:`GroupSlot` (a trivial one for size 1)."""
    size = groups.size(kind)
    if size <= 1:
        return GroupSlot()
    return GroupSlot(group=groups.get(kind), size=size, rank=groups.index(kind))
