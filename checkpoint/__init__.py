"""The checkpoint store: sharded safetensors, async and atomic, resharded on load.

A library of torch + safetensors only (it imports neither `elasticd` nor `trainer`); reading
and checking a checkpoint (`checkpoint.step`, `verify`, `store`) needs no torch.
Every tensor is named globally and every stored chunk records its offsets in that global
tensor, so any layout reads exactly the slices it needs. Format: docs/checkpoint-format.md.

Save::

    saver = Saver(ckpt_dir, group=gloo_group, options=SaveOptions(async_=True, keep=3))
    saver.save(step=6, consumed_samples=96, model={name: (tensor, shard_info)},
               optimizer={"exp_avg/" + name: (state, shard_info)}, scalars={...})
    saver.check()   # each step: raises if a background save failed
    saver.close()   # before exit: waits for the save in flight

Fenced by round (a save from a world that is no longer current raises FencedError)::

    SaveOptions(fence=Fence(run_id="tiny-0a1b2c3d", round=4), ...)

Load (any layout)::

    ckpt = load_latest(ckpt_dir, model=..., optimizer=..., group=gloo_group)
"""

from typing import TYPE_CHECKING, Any

from checkpoint.errors import (
    CheckpointError,
    CheckpointReadError,
    CorruptCheckpointError,
    FencedError,
    FormatError,
    LayoutMismatchError,
    NoCheckpointError,
    OwnershipError,
    SaveFailedError,
    SaveRefusedError,
    UnsupportedVersionError,
)
from checkpoint.fence import Fence, check_fence, read_fence, write_fence
from checkpoint.manifest import FORMAT_VERSION, Manifest
from checkpoint.shards import ShardInfo
from checkpoint.step import LoadStats
from checkpoint.store import committed_steps, prune, read_latest
from checkpoint.verify import export, verify

# Saving and loading tensors import torch; they are imported when first named (PEP 562),
# so that reading and checking a checkpoint (``elasticd ckpt ls/inspect/verify``, all of
# the above) runs without it.
_LAZY = {
    "Checkpoint": "checkpoint.load",
    "load_latest": "checkpoint.load",
    "open_step": "checkpoint.load",
    "SaveOptions": "checkpoint.save",
    "Saver": "checkpoint.save",
    "SaveResult": "checkpoint.save",
}

if TYPE_CHECKING:
    from checkpoint.load import Checkpoint, load_latest, open_step
    from checkpoint.save import SaveOptions, Saver, SaveResult


def __getattr__(name: str) -> Any:
    import importlib
    import importlib.util

    module = _LAZY.get(name)
    if module is not None:
        value = getattr(importlib.import_module(module), name)
        globals()[name] = value
        return value
    # A submodule named as an attribute (``checkpoint.load`` after ``import checkpoint``),
    # as when the package imported them all.
    if not name.startswith("_") and importlib.util.find_spec(f"checkpoint.{name}") is not None:
        return importlib.import_module(f"checkpoint.{name}")
    raise AttributeError(f"module 'checkpoint' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))


__all__ = [
    "FORMAT_VERSION",
    "Checkpoint",
    "CheckpointError",
    "CheckpointReadError",
    "CorruptCheckpointError",
    "Fence",
    "FencedError",
    "FormatError",
    "LayoutMismatchError",
    "LoadStats",
    "Manifest",
    "NoCheckpointError",
    "OwnershipError",
    "SaveFailedError",
    "SaveOptions",
    "SaveRefusedError",
    "SaveResult",
    "Saver",
    "ShardInfo",
    "UnsupportedVersionError",
    "check_fence",
    "committed_steps",
    "export",
    "load_latest",
    "open_step",
    "prune",
    "read_fence",
    "read_latest",
    "verify",
    "write_fence",
]
