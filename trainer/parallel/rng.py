"""Dropout's random numbers under every layout: a model-parallel RNG tracker.

Two kinds of activation take dropout, and they need different streams:

- **Replicated** activations (the embedding's output, the residual branches after a
  row-parallel layer's reduction): every rank of a TP group holds the same tensor, so they
  must drop the same elements. They draw from the default generators, which are seeded
  alike on every rank of a TP group.
- **TP-sharded** activations (attention probabilities, one shard of heads per TP rank):
  each rank holds different heads, so each must draw its own mask. Drawing them from the
  shared stream would give every head shard the same mask. :meth:`DropoutRNG.sharded`
  forks the default generator for the call: it takes one number from the shared stream (so
  the TP ranks' shared streams stay in step), seeds a fork from it and the TP rank, runs
  the call on the fork, and puts the shared stream back.

**Resume.** The default generators are reseeded at the start of every step from the seed,
the step and this rank's data-parallel and pipeline coordinates (:func:`step_seed`), not
from its global rank. The streams are therefore a pure function of (seed, step,
coordinates): a resume in the same layout continues them exactly, another layout reseeds
deterministically, and there is no RNG state to save in a checkpoint.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterator
from contextlib import contextmanager

import torch


def _seed_of(*parts: object) -> int:
    digest = hashlib.sha256(":".join(str(p) for p in parts).encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


def step_seed(*, seed: int, step: int, dp_rank: int, pp_stage: int) -> int:
    """The default generators' seed for 0-based ``step`` on a rank at these coordinates
    (the same on every rank of a TP group)."""
    return _seed_of("dropout", seed, step, dp_rank, pp_stage)


class DropoutRNG:
    """The tracker: reseeds the shared stream per step, forks it per TP rank for sharded
    activations. One per trainer, passed to the layers that need it."""

    def __init__(self, *, seed: int, dp_rank: int, pp_stage: int, tp_rank: int) -> None:
        self.seed, self.dp_rank, self.pp_stage, self.tp_rank = seed, dp_rank, pp_stage, tp_rank

    def begin_step(self, step: int) -> None:
        """Seed the default generators (CPU and CUDA) for 0-based ``step``."""
        torch.manual_seed(
            step_seed(seed=self.seed, step=step, dp_rank=self.dp_rank, pp_stage=self.pp_stage)
        )

    @contextmanager
    def sharded(self, device: torch.device) -> Iterator[None]:
        """Run the body on a fork of ``device``'s default generator that differs per TP rank;
        the shared stream moves on by one draw, alike on every TP rank."""
        # One draw from the shared CPU stream: host only, no device sync.
        base = int(torch.randint(0, 1 << 62, (1,)).item())
        fork_seed = _seed_of("tp", base, self.tp_rank)
        if device.type == "cuda":
            index = torch.cuda.current_device() if device.index is None else device.index
            gen = torch.cuda.default_generators[index]
        else:
            gen = torch.default_generator
        saved = gen.get_state()
        gen.manual_seed(fork_seed)
        try:
            yield
        finally:
            gen.set_state(saved)
