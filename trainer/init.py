"""Layout-independent initialisation: every parameter from its global name and the seed.

A parameter's values are a pure function of ``(seed, global name, global shape, rule)``.
Each rank generates the whole global tensor with a generator seeded from a stable hash of
the seed and the name, then cuts its shard; so every layout (any tp, ep, pp) starts from
exactly the same global model (DESIGN.md, invariant 2). Generating the whole tensor costs
memory for a moment, once, at start-up.

Every parameter also carries its place in the global model:

- ``param.shard_info``: a :class:`checkpoint.shards.ShardInfo` (global name and shape, and
  the region this rank holds; padding rows excluded);
- ``param.tp_split``: whether it is split across its tensor group (tp, or etp for experts);
- ``param.expert``: whether it belongs to an expert (its gradients reduce over expert-dp).
"""

from __future__ import annotations

import hashlib

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


def global_init(seed: int, name: str, shape: tuple[int, ...], std: float | None) -> torch.Tensor:
    """The global tensor for an init rule: normal with ``std``, zeros (None) for biases."""
    if std is None:
        return torch.zeros(shape, dtype=torch.float32)
    return global_normal(seed, name, shape, std)


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
    """Part ``index`` of ``parts`` of global tensor ``name`` along ``dim`` (None: whole)."""
    full = global_init(seed, name, tuple(global_shape), std)
    if dim is None or parts == 1:
        info = ShardInfo.whole(name, tuple(global_shape))
        local = full
    else:
        info = ShardInfo.split(name, tuple(global_shape), dim, index, parts)
        local = full.narrow(dim, info.offsets[dim], info.sizes[dim])
    param = nn.Parameter(local.to(dtype).contiguous())
    return annotate(param, info, tp_split=dim is not None and parts > 1, expert=expert)


def ones_param(name: str, shape: tuple[int, ...], *, dtype: torch.dtype) -> nn.Parameter:
    """A replicated parameter of ones (LayerNorm gains)."""
    param = nn.Parameter(torch.ones(shape, dtype=dtype))
    return annotate(param, ShardInfo.whole(name, tuple(shape)), tp_split=False)
