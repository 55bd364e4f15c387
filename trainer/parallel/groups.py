"""Torch process groups for one world, built from a :class:`~elasticd.layout.Layout`.

One :class:`ProcessGroups` object per world, passed explicitly (keyword-only) to whatever
needs a group; there are no module globals, because a global would go stale after every
re-rendezvous. Build it after ``init_process_group`` and destroy it with the world.

torch requires every rank of the default group to call ``new_group`` for every group, in
the same order, even for groups it is not in. The layout is identical on every rank, so
iterating it in a fixed order satisfies that. Identical rank lists (tp and tp-cp when
cp = 1, say) share one communicator instead of creating a second.

There are no gloo twins of the data-parallel groups: every collective of the step runs on
device tensors over the main backend, and the few CPU collectives (checkpoint agreement,
preemption flags, in-process transfers) run on gloo groups over all active ranks.
A twin per DP group would cost a gloo communicator (sockets, and a rendezvous through the
store at start-up) per group on every rank, for nothing.
"""

from __future__ import annotations

from datetime import timedelta

import torch.distributed as dist

from elasticd.layout import GROUP_KINDS, Layout

# Gloo groups over all active ranks, one communicator per purpose: the checkpoint store's
# writer thread runs collectives on "checkpoint" while the loop runs its own on "control"
# (preemption flags); two threads on one group would interleave and deadlock. Every rank,
# spares included, creates them here: `use_local_synchronization` would skip the spares,
# but it names groups by the count of groups each rank is in, which differs between pipeline
# stages (a pp=4 world hung).
SIDE_PURPOSES = ("checkpoint", "control")


class ProcessGroups:
    """This rank's groups, by kind; ``None`` where the rank is not a member."""

    def __init__(
        self,
        *,
        layout: Layout,
        rank: int,
        backend: str,
        groups: dict[str, dist.ProcessGroup | None],
        side_groups: dict[str, dist.ProcessGroup | None] | None = None,
    ) -> None:
        self.layout = layout
        self.rank = rank
        self.backend = backend
        self._groups = groups
        self._side = dict(side_groups or {})
        self._destroyed = False

    @classmethod
    def build(
        cls,
        layout: Layout,
        *,
        rank: int,
        backend: str | None = None,
        timeout: timedelta | None = None,
    ) -> ProcessGroups:
        """Create every group of ``layout``; every rank of the world must call this."""
        if not dist.is_initialized():
            raise RuntimeError("init_process_group must run before ProcessGroups.build")
        backend = backend or dist.get_backend()
        if dist.get_world_size() != layout.world:
            raise RuntimeError(
                f"the default group has {dist.get_world_size()} ranks but the layout "
                f"was planned for {layout.world}"
            )
        kwargs = {} if timeout is None else {"timeout": timeout}
        made: dict[tuple[tuple[int, ...], str], dist.ProcessGroup] = {}

        def make(ranks: tuple[int, ...], be: str) -> dist.ProcessGroup:
            key = (ranks, be)
            if key not in made:
                made[key] = dist.new_group(list(ranks), backend=be, **kwargs)
            return made[key]

        groups: dict[str, dist.ProcessGroup | None] = {}
        for kind in GROUP_KINDS:
            groups[kind] = None
            for ranks in layout.groups[kind]:
                pg = make(ranks, backend)
                if rank in ranks:
                    groups[kind] = pg
        active = list(range(layout.active))
        side = {}
        for purpose in SIDE_PURPOSES:
            pg = dist.new_group(active, backend="gloo", **kwargs)  # never shared: no cache
            side[purpose] = pg if rank in active else None
        return cls(
            layout=layout, rank=rank, backend=backend, groups=groups, side_groups=side,
        )  # fmt: skip

    @property
    def is_spare(self) -> bool:
        """Whether this rank idles in this world."""
        return self.layout.is_spare(self.rank)

    def get(self, kind: str) -> dist.ProcessGroup | None:
        """The group of ``kind`` this rank belongs to (None when it belongs to none)."""
        self._check_alive()
        if kind not in self._groups:
            raise KeyError(f"unknown group kind {kind!r}")
        return self._groups[kind]

    def side(self, purpose: str) -> dist.ProcessGroup | None:
        """The gloo group over all active ranks for ``purpose`` (see SIDE_PURPOSES); None
        on a spare."""
        self._check_alive()
        if purpose not in self._side:
            raise KeyError(f"no side group {purpose!r}; purposes: {SIDE_PURPOSES}")
        return self._side[purpose]

    def ranks(self, kind: str) -> tuple[int, ...] | None:
        """Global ranks of this rank's group of ``kind``, in generator order."""
        return self.layout.group_of(kind, self.rank)

    def size(self, kind: str) -> int:
        """Size of this rank's group of ``kind``; 0 when not a member."""
        ranks = self.ranks(kind)
        return 0 if ranks is None else len(ranks)

    def index(self, kind: str) -> int:
        """This rank's position in its group of ``kind`` (its tp rank, pp stage, ...)."""
        idx = self.layout.index_in(kind, self.rank)
        if idx is None:
            raise ValueError(f"rank {self.rank} is not in any {kind} group")
        return idx

    def destroy(self) -> None:
        """Drop the references; the default group's teardown releases the communicators."""
        self._groups = {k: None for k in self._groups}
        self._side = {k: None for k in self._side}
        self._destroyed = True

    def _check_alive(self) -> None:
        if self._destroyed:
            raise RuntimeError("these process groups belong to a world that was torn down")
