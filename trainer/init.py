"""Layout-independent initialisation: every parameter from its global name and the seed.

A parameter's values are a pure function of ``(seed, global name, global shape, rule)``:
the global tensor is the one ``torch.randn`` draws from a CPU generator seeded with a
stable hash of the seed and the name (:func:`global_normal`), and a rank's shard is its
region of it; so every layout (any tp, ep, pp) starts from exactly the same global model
(DESIGN.md, invariant 2).

**Per shard, in bounded memory** (:func:`normal_region`). No rank builds a whole
parameter. CPU ``randn`` turns consecutive uniform draws into normals in independent blocks
of 16 (Box-Muller within each block; a length that is not a multiple of 16 redraws its
last 16), so drawing the stream in pieces whose lengths are multiples of 16, with the
remainder in the last piece, gives the same floats as one call. Pieces before the shard's
first element are skipped with ``uniform_``, which consumes the generator exactly as
``randn``'s own uniforms do and costs less; drawing stops after its last element. Memory is
the shard plus one piece (about 4 MiB); time still grows with the shard's position in the
tensor, since the generator (mt19937) cannot jump ahead. ``tests/test_trainer_hotpath.py``
checks it against the whole tensor, bit for bit, for pieces, tails and every split.

Every parameter also carries its place in the global model:

- ``param.shard_info``: a :class:`checkpoint.shards.ShardInfo` (global name and shape, and
  the region this rank holds; padding rows excluded);
- ``param.tp_split``: whether it is split across its tensor group (tp, or etp for experts);
- ``param.expert``: whether it belongs to an expert (its gradients reduce over expert-dp).
- ``param.draw_init``: a callable giving the parameter's initial values (fp32, its local
  shape), drawn again on demand (:func:`deferred`).

**Deferred** (:func:`deferred`): a trainer whose state is about to be overwritten (a
resume from a checkpoint, an in-process recovery from its peers' memory) need not draw it.
The draws cost CPU time that grows with the model, not the shard: a rank holding the last
part of a tensor draws all of it (about 1.3 s a GB of fp32 on the 2-core dev box), in
every restart and every recovery. Inside :func:`deferred` parameters are made of zeros (never garbage: a
region no load covers, such as vocabulary padding, must read as zeros) and the trainer
draws them with :meth:`trainer.train.Trainer.initialize` only if nothing was loaded.

**Adopted** (:func:`adopting`): a trainer built for a new round of in-process recovery
takes the previous round's tensors where they are the same region of the same global
tensor, in the same dtype, shape and device (a data-parallel shrink keeps every box), so
that a recovery holds one copy of the model and its optimizer state, not two
(docs/inprocess.md, "What it costs"). An adopted parameter is the old one's storage, unchanged:
it already holds the state the recovery agrees on.
"""

from __future__ import annotations

import contextlib
import contextvars
import hashlib
import math
from collections.abc import Callable, Iterator

import torch
from torch import nn

from checkpoint.shards import ShardInfo


def name_seed(seed: int, name: str) -> int:
    """A 63-bit seed from the job seed and a global name (stable across processes and runs;
    Python's ``hash()`` is salted per process, so it is not used)."""
    digest = hashlib.sha256(f"{seed}:{name}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


def global_normal(seed: int, name: str, shape: tuple[int, ...], std: float) -> torch.Tensor:
    """The whole global tensor ``name`` drawn from N(0, std²), identical on every rank."""
    gen = torch.Generator().manual_seed(name_seed(seed, name))
    return torch.randn(shape, generator=gen, dtype=torch.float32) * std


PIECE = 1 << 20
"""Elements drawn at a time by :func:`normal_region` (4 MiB of fp32)."""


def normal_region(
    seed: int,
    name: str,
    shape: tuple[int, ...],
    std: float,
    *,
    dim: int = 0,
    start: int = 0,
    size: int | None = None,
    piece: int = PIECE,
) -> torch.Tensor:
    """``global_normal(seed, name, shape, std).narrow(dim, start, size)``, bit for bit,
    without the global tensor: see the module docstring."""
    shape = tuple(shape)
    if not shape:
        return global_normal(seed, name, shape, std)
    size = shape[dim] - start if size is None else size
    outer, rows_per, inner = math.prod(shape[:dim]), shape[dim], math.prod(shape[dim + 1 :])
    local_shape = (*shape[:dim], size, *shape[dim + 1 :])
    local = torch.empty(local_shape, dtype=torch.float32)
    total = math.prod(shape)
    if local.numel() == 0:
        return local
    gen = torch.Generator().manual_seed(name_seed(seed, name))
    unit = math.lcm(inner, 16)  # whole rows of ``inner`` and whole blocks of 16
    step = max(1, piece // unit) * unit
    first = start * inner  # the first element wanted (outer index 0)
    end = ((outer - 1) * rows_per + start + size) * inner  # one past the last one
    rows_out = local.view(-1, inner)
    pos = 0
    while pos < end:
        final = total - pos < step + 16  # the rest in one draw, so its tail is randn's
        n = total - pos if final else step
        if pos + n <= first:
            torch.empty(n).uniform_(generator=gen)  # skipped: the same draws, no normals
        else:
            drawn = torch.randn(n, generator=gen).view(-1, inner)
            row = torch.arange(pos // inner, (pos + n) // inner)
            o, r = row // rows_per, row % rows_per
            keep = (r >= start) & (r < start + size)
            rows_out[(o * size + r - start)[keep]] = drawn[keep]
        pos += n
    return local.mul_(std)


_DEFERRED: contextvars.ContextVar[torch.device | None] = contextvars.ContextVar(
    "deferred_init", default=None
)


@contextlib.contextmanager
def deferred(device: torch.device | str = "cpu") -> Iterator[None]:
    """Parameters made inside are zeros on ``device`` (made there: on a GPU, no host copy
    of the model and no transfer), their draws left to ``param.draw_init``."""
    token = _DEFERRED.set(torch.device(device))
    try:
        yield
    finally:
        _DEFERRED.reset(token)


class Adoption:
    """Tensors of a previous trainer a new one may take instead of allocating its own, by
    ``(kind, ShardInfo)``: ``kind`` is ``model`` (a model parameter, in the dtype the model
    computes in), ``main`` (an fp32 main parameter, or its rows) or an AdamW state's name
    (``exp_avg``, ``exp_avg_sq``, ``step``, under its main parameter's box). Each is taken
    at most once, and only where dtype, shape and device match as well; what is taken is
    counted in :attr:`taken_bytes`."""

    def __init__(self) -> None:
        self._pool: dict[tuple[str, ShardInfo], torch.Tensor] = {}
        self._dup: set[tuple[str, ShardInfo]] = set()
        self.taken_bytes = 0

    def offer(self, kind: str, info: ShardInfo | None, tensor: torch.Tensor) -> None:
        if info is None:
            return
        key = (kind, info)
        if key in self._pool or key in self._dup:  # held twice: neither is taken
            self._pool.pop(key, None)
            self._dup.add(key)
            return
        self._pool[key] = tensor.detach()

    def take(
        self,
        kind: str,
        info: ShardInfo | None,
        *,
        shape: tuple[int, ...],
        dtype: torch.dtype,
        device: torch.device | str | None,
        peek: bool = False,
    ) -> torch.Tensor | None:
        """The tensor offered for ``(kind, info)`` if it has this shape, dtype and device
        (any device with None), taken out of the pool unless ``peek``."""
        if info is None:
            return None
        t = self._pool.get((kind, info))
        if (
            t is None
            or tuple(t.shape) != tuple(shape)
            or t.dtype != dtype
            or (device is not None and t.device != torch.device(device))
            or not t.is_contiguous()
        ):
            return None
        if peek:
            return t
        del self._pool[kind, info]
        self.taken_bytes += t.numel() * t.element_size()
        return t


_ADOPT: contextvars.ContextVar[Adoption | None] = contextvars.ContextVar("adopt_init", default=None)


@contextlib.contextmanager
def adopting(adoption: Adoption | None) -> Iterator[None]:
    """Parameters made inside (with their ShardInfo) take ``adoption``'s tensors where
    they match (see :class:`Adoption`); the others are made as they would be."""
    token = _ADOPT.set(adoption)
    try:
        yield
    finally:
        _ADOPT.reset(token)


def make_param(
    draw: Callable[[], torch.Tensor],
    shape: tuple[int, ...],
    *,
    dtype: torch.dtype,
    info: ShardInfo | None = None,
) -> nn.Parameter:
    """A parameter of ``shape`` holding ``draw()`` (fp32, cast to ``dtype``), or zeros
    inside :func:`deferred`, or a previous trainer's tensor of the same global region
    ``info`` inside :func:`adopting`; ``draw`` is kept as ``param.draw_init`` either way."""
    device = _DEFERRED.get()
    adoption = _ADOPT.get()
    adopted = None
    if adoption is not None:
        adopted = adoption.take("model", info, shape=tuple(shape), dtype=dtype, device=device)
    if adopted is not None:
        param = nn.Parameter(adopted)
    elif device is not None:
        param = nn.Parameter(torch.zeros(shape, dtype=dtype, device=device))
    else:
        param = nn.Parameter(draw().to(dtype).contiguous())
    param.draw_init = draw
    return param


@torch.no_grad()
def draw_into(params: Iterator[nn.Parameter] | list[nn.Parameter]) -> None:
    """Draw every parameter's initial values into it (after :func:`deferred`), on
    whatever device it now lives."""
    for p in params:
        p.copy_(p.draw_init())


def annotate(
    param: nn.Parameter, info: ShardInfo, *, tp_split: bool, expert: bool = False
) -> nn.Parameter:
    """Attach the global identity of ``param`` (see the module docstring)."""
    param.shard_info = info
    param.tp_split = tp_split
    param.expert = expert
    return param


def sharded_param(
    name: str,
    global_shape: tuple[int, ...],
    *,
    seed: int,
    std: float | None,
    dim: int | None = None,
    index: int = 0,
    parts: int = 1,
    expert: bool = False,
    dtype: torch.dtype = torch.float32,
) -> nn.Parameter:
    """Part ``index`` of ``parts`` of global tensor ``name`` along ``dim`` (None: whole),
    generated per shard (:func:`normal_region`)."""
    shape = tuple(global_shape)
    if dim is None or parts == 1:
        info = ShardInfo.whole(name, shape)
    else:
        info = ShardInfo.split(name, shape, dim, index, parts)
    d = 0 if dim is None or parts == 1 else dim

    def draw() -> torch.Tensor:
        if std is None:
            return torch.zeros(info.sizes, dtype=torch.float32)
        return normal_region(seed, name, shape, std, dim=d, start=info.offsets[d] if shape else 0,
                             size=info.sizes[d] if shape else None)  # fmt: skip

    param = make_param(draw, tuple(info.sizes), dtype=dtype, info=info)
    return annotate(param, info, tp_split=dim is not None and parts > 1, expert=expert)


def ones_param(name: str, shape: tuple[int, ...], *, dtype: torch.dtype) -> nn.Parameter:
    """A replicated parameter of ones (LayerNorm gains)."""
    info = ShardInfo.whole(name, tuple(shape))
    param = make_param(lambda: torch.ones(shape, dtype=torch.float32), tuple(shape), dtype=dtype,
                       info=info)  # fmt: skip
    return annotate(param, info, tp_split=False)
