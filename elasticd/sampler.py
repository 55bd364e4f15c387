"""Which samples each rank reads at each step, the same whatever the world (docs/inprocess.md).

A ``DistributedSampler`` deals an epoch's samples out to a fixed number of ranks, and a
script keeps its position as "the n-th batch of epoch e". When the world changes under
in-process restart (3 ranks become 2 mid-epoch, a newcomer joins), both are wrong: the new
ranks' deals cover other samples, so the epoch's rest is trained twice or skipped, and the
global batch of a step is no longer the one an uninterrupted run would have taken.

:class:`ElasticBatchSampler` fixes the global batch of every step instead: step ``s`` takes
the samples at positions ``s * global_batch`` to ``(s + 1) * global_batch - 1`` of a
stream of the dataset's epochs, each shuffled by ``(seed, epoch)``, and splits them into
``world_size`` contiguous parts, rank ``r`` taking part ``r``. Training resumes at a step,
not at a sample of a deal; what was consumed is ``step * global_batch``; the losses of a
world that changes stay those of one process taking the whole batch (when each rank's
loss is weighted by its share of the batch, below). Pass it to a ``DataLoader`` as its
``batch_sampler``, made anew in each round with the step the round resumes at::

    step = ctx.sync_state(tensors, step=ctx.state.get("step")) or 0
    sampler = ei.ElasticBatchSampler(len(dataset), 12, step=step, steps=total)
    for x, y in DataLoader(dataset, batch_sampler=sampler):
        ...
        step += 1

- ``drop_last=True`` (the default): an epoch is ``len // global_batch`` steps and its last
  ``len % global_batch`` samples (of its shuffled order) are not used, as a
  ``DataLoader``'s ``drop_last``; each step's batch lies within one epoch.
- ``drop_last=False``: the epochs follow one another in the stream, every sample is used
  once per epoch, and a batch may take the end of one epoch and the start of the next.
- ``shuffle=False``: every epoch in index order.
- A world that does not divide the batch: the first ``global_batch % world_size`` ranks
  take one sample more. DDP averages the ranks' gradients with equal weights, so a
  per-rank mean loss is then not the batch's mean: scale each rank's loss by
  ``len(indices) * world_size / global_batch`` (:meth:`share`), or keep a global batch
  that every world size you run divides.
- A world larger than the batch is refused (a rank would have no sample), as are sizes
  and steps that are not counts: :class:`~elasticd.inprocess.MisuseError`, one line (under
  an agent the job fails at once; no restart fixes it).

Pure Python but for the shuffle (``torch.randperm`` on a generator of its own: the
global generator is not touched). The permutation of the epoch last used is kept (one
int64 per sample).
"""

from __future__ import annotations

from collections.abc import Iterator, Sized
from typing import Any

SEED_STRIDE = 1_000_003
"""Epoch ``e``'s shuffle is seeded with ``seed * SEED_STRIDE + e``: seeds 0 and 1 do not share
epochs shifted by one, as ``seed + e`` would make them."""


def _misuse(message: str) -> Exception:
    """A :class:`~elasticd.inprocess.MisuseError` (imported here: that module imports this
    one)."""
    from elasticd.inprocess import MisuseError

    return MisuseError(message)


def _count(name: str, value: Any, *, least: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise _misuse(f"ElasticBatchSampler: {name} must be an int, not {type(value).__name__}")
    if value < least:
        raise _misuse(f"ElasticBatchSampler: {name} must be at least {least}, not {value}")
    return value


def _world(rank: int | None, world_size: int | None) -> tuple[int, int]:
    """The given rank and world, or the default process group's."""
    if rank is None or world_size is None:
        import torch.distributed as dist

        if not (dist.is_available() and dist.is_initialized()):
            raise _misuse(
                "ElasticBatchSampler: no process group: pass rank= and world_size=, or make "
                "it inside elasticd.inprocess.run's train function"
            )
        rank = dist.get_rank() if rank is None else rank
        world_size = dist.get_world_size() if world_size is None else world_size
    world_size = _count("world_size", world_size, least=1)
    rank = _count("rank", rank, least=0)
    if rank >= world_size:
        raise _misuse(f"ElasticBatchSampler: rank {rank} is not below world_size {world_size}")
    return rank, world_size


class ElasticBatchSampler:
    """This rank's sample indices for each step from ``step`` to ``steps`` (one list per
    step); a ``DataLoader``'s ``batch_sampler``. See the module's docstring."""

    def __init__(
        self,
        size: int | Sized,
        global_batch: int,
        *,
        step: int = 0,
        steps: int | None = None,
        rank: int | None = None,
        world_size: int | None = None,
        shuffle: bool = True,
        seed: int = 0,
        drop_last: bool = True,
    ) -> None:
        if isinstance(size, Sized) and not isinstance(size, int):
            size = len(size)
        self.size = _count("size (the dataset's length)", size, least=1)
        self.global_batch = _count("global_batch", global_batch, least=1)
        self.step = _count("step", step, least=0)
        self.steps = None if steps is None else _count("steps", steps, least=self.step)
        self.rank, self.world_size = _world(rank, world_size)
        if self.world_size > self.global_batch:
            raise _misuse(
                f"ElasticBatchSampler: a world of {self.world_size} ranks is larger than the "
                f"global batch of {self.global_batch} samples: a rank would have none"
            )
        if drop_last and self.size < self.global_batch:
            raise _misuse(
                f"ElasticBatchSampler: the dataset's {self.size} samples make no whole batch "
                f"of {self.global_batch} (drop_last=True): pass drop_last=False"
            )
        self.shuffle = bool(shuffle)
        self.seed = _count("seed", seed, least=0)
        self.drop_last = bool(drop_last)
        self._perm: tuple[int, Any] | None = None  # (epoch, its order)

    # -- where a step's samples are ------------------------------------------------------

    @property
    def steps_per_epoch(self) -> float:
        """Steps that take one epoch (a fraction with ``drop_last=False``)."""
        if self.drop_last:
            return self.size // self.global_batch
        return self.size / self.global_batch

    def consumed_samples(self, step: int) -> int:
        """Samples the whole world took before ``step`` (0-based)."""
        return step * self.global_batch

    def epoch(self, step: int) -> int:
        """The epoch of ``step``'s first sample."""
        if self.drop_last:
            return step // (self.size // self.global_batch)
        return self.consumed_samples(step) // self.size

    def _order(self, epoch: int) -> Any:
        if self._perm is not None and self._perm[0] == epoch:
            return self._perm[1]
        import torch

        if self.shuffle:
            gen = torch.Generator().manual_seed(self.seed * SEED_STRIDE + epoch)
            order = torch.randperm(self.size, generator=gen)
        else:
            order = torch.arange(self.size)
        self._perm = (epoch, order)
        return order

    def global_indices(self, step: int) -> list[int]:
        """The whole world's samples at ``step``, in rank order."""
        step = _count("step", step, least=0)
        b = self.global_batch
        if self.drop_last:
            per = self.size // b
            epoch, at = divmod(step, per)
            return self._order(epoch)[at * b : (at + 1) * b].tolist()
        out: list[int] = []
        pos = step * b
        while len(out) < b:
            epoch, at = divmod(pos, self.size)
            take = min(b - len(out), self.size - at)
            out += self._order(epoch)[at : at + take].tolist()
            pos += take
        return out

    def bounds(self, rank: int | None = None) -> tuple[int, int]:
        """``[start, end)`` of ``rank``'s part (default: this rank's) within a step's global
        batch: contiguous, the first ``global_batch % world_size`` parts one longer."""
        r = self.rank if rank is None else rank
        q, extra = divmod(self.global_batch, self.world_size)
        start = r * q + min(r, extra)
        return start, start + q + (1 if r < extra else 0)

    def indices(self, step: int) -> list[int]:
        """This rank's samples at ``step``."""
        start, end = self.bounds()
        return self.global_indices(step)[start:end]

    def share(self) -> float:
        """What to multiply this rank's mean loss by so that DDP's equal-weight average of
        the ranks' gradients is the gradient of the whole batch's mean loss: 1.0 when the
        world divides the batch."""
        start, end = self.bounds()
        return (end - start) * self.world_size / self.global_batch

    # -- a DataLoader's batch_sampler ----------------------------------------------------

    def __iter__(self) -> Iterator[list[int]]:
        step = self.step
        while self.steps is None or step < self.steps:
            yield self.indices(step)
            step += 1

    def __len__(self) -> int:
        if self.steps is None:
            raise TypeError("ElasticBatchSampler without steps= is endless: it has no len()")
        return self.steps - self.step

    def __repr__(self) -> str:
        return (
            f"ElasticBatchSampler(size={self.size}, global_batch={self.global_batch}, "
            f"step={self.step}, steps={self.steps}, rank={self.rank}, "
            f"world_size={self.world_size}, shuffle={self.shuffle}, seed={self.seed}, "
            f"drop_last={self.drop_last})"
        )
