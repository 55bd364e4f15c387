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
- An epoch loop: :meth:`set_epoch` bounds the next iteration to one epoch's steps, from
  ``step`` on (a ``DistributedSampler``'s ``for epoch ...: set_epoch; for batch in
  loader``). ``len()`` is what the next iteration yields.
- Refused with one :class:`~elasticd.inprocess.MisuseError` line (under an agent the job
  fails at once; no restart fixes it): a sampler made in one call of the training
  function by :func:`elasticd.inprocess.run` (one call per round) and iterated in another
  (its rank, world and first step are that round's), or made outside any and iterated in
  one; a step taken twice (checked as steps are taken: a multi-worker ``DataLoader``
  makes two iterators and reads the second); a world larger than the batch (a rank would have no
  sample), sizes and steps that are not counts, ``len()`` of an endless one.

Pure Python but for the shuffle (``torch.randperm`` on a generator of its own: the
global generator is not touched). The permutation of the epoch in use is kept, one per
process (an int32 per sample below 2**31 samples), so the sampler of the next round takes
it over.
"""

from __future__ import annotations

import contextlib
import operator
import sys
from collections.abc import Iterator, Sized
from typing import Any

_order_cache: dict[tuple[int, int, int], Any] = {}
"""The order of the epoch in use, ``(size, seed, epoch)`` -> a permutation (int32 below
2**31 samples): one per process, so a sampler made anew each round takes it over (100M
samples: 5 s of ``randperm`` and 400 MB, once per epoch, not once per round)."""
_call: int | None = None
"""Which call of a training function by :func:`elasticd.inprocess.run` is running (one per
round; None outside them): a sampler belongs to the call it was made in."""
_calls = 0


@contextlib.contextmanager
def train_call() -> Iterator[None]:
    """Around each call of the training function by :func:`elasticd.inprocess.run`."""
    global _call, _calls
    _calls += 1
    _call, before = _calls, _call
    try:
        yield
    finally:
        _call = before


SEED_STRIDE = 1_000_003
"""Epoch ``e``'s shuffle is seeded with ``seed * SEED_STRIDE + e``: seeds 0 and 1 do not share
epochs shifted by one, as ``seed + e`` would make them."""


def _misuse(message: str) -> Exception:
    """A :class:`~elasticd.inprocess.MisuseError` (imported here: that module imports this
    one)."""
    from elasticd.inprocess import MisuseError

    return MisuseError(message)


def _count(name: str, value: Any, *, least: int) -> int:
    """``value`` as an int (a numpy integer too) of at least ``least``."""
    try:
        if isinstance(value, bool):
            raise TypeError
        value = operator.index(value)
    except TypeError:
        raise _misuse(
            f"ElasticBatchSampler: {name} must be an int, not {type(value).__name__}"
        ) from None
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
        self._call = _call  # the training function's call (round) it was made in
        self._epoch: int | None = None  # set_epoch's: iterate that epoch's steps only
        self._yielded = -1  # the highest step yielded: no step is yielded twice

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

    def _take(self, epoch: int, lo: int, hi: int) -> list[int]:
        """Positions ``lo`` to ``hi`` of ``epoch``'s order."""
        if not self.shuffle:
            return list(range(lo, hi))
        key = (self.size, self.seed, epoch)
        cached = _order_cache.get(key)
        if cached is None:
            import torch

            gen = torch.Generator().manual_seed((self.seed * SEED_STRIDE + epoch) % 2**63)
            dtype = torch.int32 if self.size < 2**31 else torch.int64
            cached = torch.randperm(self.size, generator=gen, dtype=dtype)
            _order_cache.clear()  # one epoch's order in memory: the one in use
            _order_cache[key] = cached
        return cached[lo:hi].tolist()

    def _positions(self, step: int, lo: int, hi: int) -> list[int]:
        """The samples at positions ``lo`` to ``hi`` of ``step``'s global batch."""
        b = self.global_batch
        if self.drop_last:
            epoch, at = divmod(step, self.size // b)
            return self._take(epoch, at * b + lo, at * b + hi)
        out: list[int] = []
        pos, end = step * b + lo, step * b + hi
        while pos < end:
            epoch, at = divmod(pos, self.size)
            take = min(end - pos, self.size - at)
            out += self._take(epoch, at, at + take)
            pos += take
        return out

    def global_indices(self, step: int) -> list[int]:
        """The whole world's samples at ``step``, in rank order."""
        return self._positions(_count("step", step, least=0), 0, self.global_batch)

    def bounds(self, rank: int | None = None) -> tuple[int, int]:
        """``[start, end)`` of ``rank``'s part (default: this rank's) within a step's global
        batch: contiguous, the first ``global_batch % world_size`` parts one longer."""
        r = self.rank if rank is None else rank
        q, extra = divmod(self.global_batch, self.world_size)
        start = r * q + min(r, extra)
        return start, start + q + (1 if r < extra else 0)

    def indices(self, step: int) -> list[int]:
        """This rank's samples at ``step``."""
        return self._positions(_count("step", step, least=0), *self.bounds())

    def share(self) -> float:
        """What to multiply this rank's mean loss by so that DDP's equal-weight average of
        the ranks' gradients is the gradient of the whole batch's mean loss: 1.0 when the
        world divides the batch."""
        start, end = self.bounds()
        return (end - start) * self.world_size / self.global_batch

    # -- a DataLoader's batch_sampler ----------------------------------------------------

    def set_epoch(self, epoch: int) -> None:
        """Iterate only ``epoch``'s steps from now on (a ``DistributedSampler``'s loop:
        ``for epoch in range(sampler.epoch(step), epochs): sampler.set_epoch(epoch); for
        batch in loader: ...``): those at or after ``step`` whose first sample is in
        ``epoch``, below ``steps``. The round's first epoch starts where the round resumes,
        mid-epoch if the fault came there. The order does not depend on it: it only bounds
        what one iteration yields."""
        self._epoch = _count("epoch", epoch, least=0)

    def _span(self) -> range:
        """The steps the next iteration yields."""
        end = self.steps
        if self._epoch is None:
            if end is None:
                return range(self.step, sys.maxsize)
            return range(self.step, end)
        first = self._first_step(self._epoch)
        last = self._first_step(self._epoch + 1)
        if end is not None:
            last = min(last, end)
        return range(max(first, self.step), max(last, max(first, self.step)))

    def _first_step(self, epoch: int) -> int:
        """The first step whose first sample is in ``epoch``."""
        if self.drop_last:
            return epoch * (self.size // self.global_batch)
        return -(-epoch * self.size // self.global_batch)  # ceil(epoch * size / batch)

    def __iter__(self) -> Iterator[list[int]]:
        """This rank's samples, step by step over :meth:`_span`. Checked as each step is
        taken, not when the iterator is made: a multi-worker ``DataLoader`` makes two and
        discards the first unread."""
        for step in self._span():
            if _call != self._call:
                made = "outside any call" if self._call is None else f"in call {self._call}"
                now = "outside any" if _call is None else f"in call {_call}"
                raise _misuse(
                    f"ElasticBatchSampler: made {made} of the training function, iterated "
                    f"{now}: its ranks, world and first step are the round's it was made in; "
                    "make it inside train, anew each round, after sync_state, with step= the "
                    "step the round resumes at"
                )
            if step <= self._yielded:
                raise _misuse(
                    f"ElasticBatchSampler: step {step} taken again (steps up to "
                    f"{self._yielded} were): it would be trained twice; iterate the stream "
                    "once, or call set_epoch(epoch) before each epoch's loop"
                )
            self._yielded = step
            yield self.indices(step)

    def __len__(self) -> int:
        """Steps the next iteration yields: to ``steps`` (from the step this round resumed
        at, not from 0), or to the end of the epoch :meth:`set_epoch` named. A progress
        bar over the whole run: ``tqdm(loader, initial=step, total=sampler.steps)``."""
        if self.steps is None and self._epoch is None:
            raise _misuse(
                "ElasticBatchSampler: without steps= (and no set_epoch) it is endless and has "
                "no len(): pass steps=, the run's last step"
            )
        return len(self._span())

    def __repr__(self) -> str:
        return (
            f"ElasticBatchSampler(size={self.size}, global_batch={self.global_batch}, "
            f"step={self.step}, steps={self.steps}, rank={self.rank}, "
            f"world_size={self.world_size}, shuffle={self.shuffle}, seed={self.seed}, "
            f"drop_last={self.drop_last})"
        )
