"""How a local tensor maps into its global tensor: the contract between trainer and store.

The trainer attaches a :class:`ShardInfo` to every parameter it owns. The checkpoint store
names tensors globally by it and reshards by pure slicing arithmetic (DESIGN.md,
invariant 3).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class ShardInfo:
    """The global region a local tensor holds.

    The local tensor's leading region ``[0:sizes[0], 0:sizes[1], ...]`` equals the global
    tensor's ``[offsets[0]:offsets[0]+sizes[0], ...]``. ``sizes`` may be smaller than the
    local shape: the rest is padding that belongs to no global tensor (for example the
    vocabulary rows added to make the vocabulary divisible by tp). Ranks that hold the same
    (name, offsets, sizes) are replicas of each other.
    """

    name: str
    """Global name, e.g. ``decoder.layers.7.mlp.fc1.weight``; layer indexes are global."""
    global_shape: tuple[int, ...]
    """Shape of the whole tensor, independent of any layout."""
    offsets: tuple[int, ...]
    """Start of this shard in each dimension of the global tensor."""
    sizes: tuple[int, ...]
    """Extent of this shard in each dimension (without padding)."""

    def __post_init__(self) -> None:
        n = len(self.global_shape)
        if len(self.offsets) != n or len(self.sizes) != n:
            raise ValueError(f"{self.name}: offsets and sizes need {n} dimensions")
        for dim, (g, o, s) in enumerate(
            zip(self.global_shape, self.offsets, self.sizes, strict=True)
        ):
            if o < 0 or s < 0 or o + s > g:
                raise ValueError(f"{self.name}: dim {dim}: [{o}, {o + s}) is outside [0, {g})")

    @classmethod
    def whole(cls, name: str, shape: tuple[int, ...]) -> ShardInfo:
        """A tensor held entirely (replicated, or not split at all)."""
        shape = tuple(shape)
        return cls(name, shape, (0,) * len(shape), shape)

    @classmethod
    def split(
        cls, name: str, global_shape: tuple[int, ...], dim: int, index: int, parts: int
    ) -> ShardInfo:
        """Part ``index`` of ``parts`` equal parts along ``dim`` (which ``parts`` must divide)."""
        global_shape = tuple(global_shape)
        if global_shape[dim] % parts:
            raise ValueError(
                f"{name}: dim {dim} of size {global_shape[dim]} does not split into {parts}"
            )
        step = global_shape[dim] // parts
        offsets = [0] * len(global_shape)
        sizes = list(global_shape)
        offsets[dim], sizes[dim] = index * step, step
        return cls(name, global_shape, tuple(offsets), tuple(sizes))

    @property
    def numel(self) -> int:
        """Elements of the global region this shard covers."""
        n = 1
        for s in self.sizes:
            n *= s
        return n
