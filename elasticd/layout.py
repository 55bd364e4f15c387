"""The layout engine: Megatron-style rank groups, re-planned for any world size.

Pure Python; importing it starts nothing distributed. Every node calls :func:`plan` with the
same world size and job and gets the same :class:`Layout`, so no coordination is needed to
agree on the groups (DESIGN.md, invariant 1).

The groups equal Megatron-Core's ``RankGenerator`` output. A rank is a point in a
mixed-radix grid whose axes are the parallel dimensions in ``order`` (the first axis varies
fastest). A group kind is a set of axes (the *mask*); a group holds the ranks that agree on
every axis outside the mask, enumerated with the masked axes in order. Two generators exist:

- the *decoder* generator (ep = 1) gives tp, pp, dp, cp and their combinations;
- the *expert* generator (tp = etp, cp = 1, dp = world / (etp·ep·pp)) gives the expert kinds.

Seed ``000_*`` lists the TP4/PP2/DP2 groups wrongly (see DESIGN.md); this module follows
the algorithm, and the tests pin both worked examples.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from elasticd.errors import LayoutError

DIMS = ("tp", "cp", "ep", "dp", "pp")
DEFAULT_ORDER = "tp-cp-ep-dp-pp"

# (kind, generator, mask tokens), in the order groups are reported and created.
DECODER_KINDS = (
    ("tp", "tp"),
    ("pp", "pp"),
    ("dp", "dp"),
    ("cp", "cp"),
    ("dp-cp", "dp-cp"),
    ("tp-pp", "tp-pp"),
    ("tp-cp", "tp-cp"),
    ("tp-dp-cp", "tp-dp-cp"),
)
EXPERT_KINDS = (
    ("expert-ep", "ep"),
    ("expert-tp", "tp"),
    ("expert-tp-ep", "tp-ep"),
    ("expert-dp", "dp"),
    ("expert-tp-ep-pp", "tp-ep-pp"),
)
GROUP_KINDS = (
    *(k for k, _ in DECODER_KINDS),
    *(k for k, _ in EXPERT_KINDS),
    "embedding",
    "position-embedding",
)

Groups = tuple[tuple[int, ...], ...]

MAX_WORLD = 1 << 17
"""Largest world planned (131,072 ranks, above today's largest jobs). Every group is
enumerated, which takes about 30 µs per rank; a larger number is a typo, not a cluster."""


def _prefix_product(sizes: Sequence[int]) -> list[int]:
    out = [1]
    for size in sizes:
        out.append(out[-1] * size)
    return out


def _decompose(index: int, shape: Sequence[int]) -> list[int]:
    """Mixed-radix digits of ``index`` with the first axis varying fastest."""
    stride = _prefix_product(shape)
    return [(index // d) % s for s, d in zip(shape, stride, strict=False)]


def masked_orthogonal_groups(sizes: Sequence[int], mask: Sequence[bool]) -> Groups:
    """All groups over the masked axes of the grid ``sizes`` (Megatron's algorithm).

    Group ``g`` fixes the unmasked axes to the digits of ``g``; its members run over the
    masked axes, first axis fastest.
    """
    stride = _prefix_product(sizes)
    masked_shape = [s for s, m in zip(sizes, mask, strict=True) if m]
    masked_stride = [d for d, m in zip(stride, mask, strict=False) if m]
    free_shape = [s for s, m in zip(sizes, mask, strict=True) if not m]
    free_stride = [d for d, m in zip(stride, mask, strict=False) if not m]
    group_size = _prefix_product(masked_shape)[-1]
    num_groups = stride[-1] // group_size
    groups = []
    for g in range(num_groups):
        base = sum(i * d for i, d in zip(_decompose(g, free_shape), free_stride, strict=True))
        groups.append(
            tuple(
                base
                + sum(
                    i * d for i, d in zip(_decompose(r, masked_shape), masked_stride, strict=True)
                )
                for r in range(group_size)
            )
        )
    return tuple(groups)


class RankGenerator:
    """Megatron-Core's rank generator for one set of sizes and an order."""

    def __init__(self, *, tp: int, ep: int, dp: int, pp: int, cp: int, order: str) -> None:
        if ep != 1 and cp != 1:
            raise LayoutError("a rank generator cannot have both ep > 1 and cp > 1")
        self.sizes = {"tp": tp, "cp": cp, "ep": ep, "dp": dp, "pp": pp}
        self.order = order.split("-")
        self.world = tp * ep * dp * pp * cp

    def get_ranks(self, token: str) -> Groups:
        wanted = token.split("-")
        mask = [name in wanted for name in self.order]
        return masked_orthogonal_groups([self.sizes[name] for name in self.order], mask)


@dataclass(frozen=True, kw_only=True, slots=True)
class ParallelConfig:
    """The parallel sizes a job fixes; dp is never given, it follows from the world."""

    tp: int = 1
    """Tensor-parallel size: attention heads and MLP columns split across ranks."""
    pp: int = 1
    """Pipeline-parallel size: the number of stages."""
    vpp: int = 1
    """Virtual stages (model chunks) per pipeline stage; > 1 means interleaved 1F1B."""
    cp: int = 1
    """Context-parallel size: the sequence split across ranks."""
    ep: int = 1
    """Expert-parallel size: MoE experts partitioned across ranks."""
    etp: int | None = None
    """Tensor-parallel size inside experts; None means the same as tp."""
    order: str = DEFAULT_ORDER
    """Axis order of the rank grid, fastest-varying first."""
    sp: bool = False
    """Sequence parallelism (needs tp > 1): activations outside the tensor-parallel regions
    are split along the sequence over the tp group. It changes no rank group."""
    zero: int = 0
    """Distributed optimizer: 1 shards the fp32 main parameters and AdamW state over data
    parallelism (ZeRO-1); 0 replicates them. It changes no rank group."""

    def __post_init__(self) -> None:
        for name in ("tp", "pp", "vpp", "cp", "ep"):
            _check_positive(f"parallel.{name}", getattr(self, name))
        if self.etp is not None:
            _check_positive("parallel.etp", self.etp)
            if self.etp == self.tp:
                # etp = tp and etp unset mean the same; one spelling keeps equality honest.
                object.__setattr__(self, "etp", None)
        if not isinstance(self.order, str) or sorted(self.order.split("-")) != sorted(DIMS):
            raise LayoutError(
                f"parallel.order: {self.order!r} must name each of tp, cp, ep, dp, pp once, "
                f"joined by '-' (e.g. {DEFAULT_ORDER})"
            )
        if self.vpp > 1 and self.pp == 1:
            raise LayoutError(f"parallel.vpp: {self.vpp} needs parallel.pp > 1")

    @property
    def expert_tp(self) -> int:
        """The tensor-parallel size used inside experts."""
        return self.tp if self.etp is None else self.etp

    @property
    def model_size(self) -> int:
        """Ranks that hold one copy of the model: tp·pp·cp."""
        return self.tp * self.pp * self.cp


def _check_positive(path: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise LayoutError(f"{path}: {value!r} must be a positive integer")


@dataclass(frozen=True, kw_only=True, slots=True)
class Layout:
    """One world's plan: the active ranks, the spares, and every rank group."""

    world: int
    """Ranks available (nodes × processes per node)."""
    active: int
    """Ranks that train: ranks 0..active-1. The rest are spares."""
    spares: tuple[int, ...]
    """Ranks that idle, ready to replace a failed rank."""
    parallel: ParallelConfig
    """The fixed sizes from the job."""
    dp: int
    """Data-parallel size, derived: active / (tp·pp·cp)."""
    global_batch: int | None = None
    """Samples per optimizer step, constant across worlds (None when not planned with one)."""
    micro_batch: int | None = None
    """Samples per micro-batch per data-parallel rank."""
    grad_accum: int | None = None
    """Micro-batches per step per rank: global_batch / (micro_batch·dp)."""
    groups: Mapping[str, Groups] = field(default_factory=dict)
    """Rank groups by kind (see GROUP_KINDS), each a tuple of global ranks in generator order."""

    @property
    def expert_dp(self) -> int:
        """Data-parallel size of the expert generator: active / (etp·ep·pp)."""
        p = self.parallel
        return self.active // (p.expert_tp * p.ep * p.pp)

    def group_of(self, kind: str, rank: int) -> tuple[int, ...] | None:
        """The group of ``kind`` that holds ``rank``, or None (a spare, or not a member)."""
        if kind not in self.groups:
            raise LayoutError(f"unknown group kind {kind!r}; known: {', '.join(GROUP_KINDS)}")
        for group in self.groups[kind]:
            if rank in group:
                return group
        return None

    def index_in(self, kind: str, rank: int) -> int | None:
        """The position of ``rank`` within its group of ``kind`` (its tp rank, pp rank, ...)."""
        group = self.group_of(kind, rank)
        return None if group is None else group.index(rank)

    def is_spare(self, rank: int) -> bool:
        """Whether ``rank`` idles in this world."""
        return rank >= self.active

    def to_dict(self) -> dict[str, Any]:
        """The JSON form (the one ``elasticd layout --json`` prints)."""
        p = self.parallel
        return {
            "world": self.world,
            "active": self.active,
            "spares": list(self.spares),
            "tp": p.tp,
            "pp": p.pp,
            "vpp": p.vpp,
            "cp": p.cp,
            "dp": self.dp,
            "ep": p.ep,
            "etp": p.expert_tp,
            "order": p.order,
            "global_batch": self.global_batch,
            "micro_batch": self.micro_batch,
            "grad_accum": self.grad_accum,
            "groups": {k: [list(g) for g in self.groups[k]] for k in GROUP_KINDS},
        }

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), separators=(",", ":"))

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Layout:
        """Rebuild a layout written by :meth:`to_dict` (workers read it from a file)."""
        try:
            parallel = ParallelConfig(
                tp=data["tp"],
                pp=data["pp"],
                vpp=data["vpp"],
                cp=data["cp"],
                ep=data["ep"],
                etp=data["etp"],
                order=data.get("order", DEFAULT_ORDER),
            )
            return cls(
                world=data["world"],
                active=data["active"],
                spares=tuple(data["spares"]),
                parallel=parallel,
                dp=data["dp"],
                global_batch=data.get("global_batch"),
                micro_batch=data.get("micro_batch"),
                grad_accum=data.get("grad_accum"),
                groups={k: tuple(tuple(g) for g in data["groups"][k]) for k in GROUP_KINDS},
            )
        except (KeyError, TypeError) as exc:
            raise LayoutError(f"layout JSON is missing or mistypes {exc}") from exc


def build_groups(active: int, parallel: ParallelConfig) -> dict[str, Groups]:
    """Every group kind for ``active`` ranks, which must be a multiple of tp·pp·cp."""
    p = parallel
    dp = active // p.model_size
    decoder = RankGenerator(tp=p.tp, ep=1, dp=dp, pp=p.pp, cp=p.cp, order=p.order)
    expert = RankGenerator(
        tp=p.expert_tp,
        ep=p.ep,
        dp=active // (p.expert_tp * p.ep * p.pp),
        pp=p.pp,
        cp=1,
        order=p.order,
    )
    groups: dict[str, Groups] = {}
    for kind, token in DECODER_KINDS:
        groups[kind] = decoder.get_ranks(token)
    for kind, token in EXPERT_KINDS:
        groups[kind] = expert.get_ranks(token)
    # A pipeline stage runs attention and experts of the same layers, so both grids must
    # agree on who is in which pipeline (Megatron-Core asserts the same).
    if expert.get_ranks("pp") != groups["pp"]:
        raise LayoutError(
            f"parallel.etp: etp={p.expert_tp} with ep={p.ep} and order {p.order} puts experts "
            "on other pipeline groups than attention; use etp = tp or an order with pp last"
        )
    # Tied embeddings live on the first and last pipeline stage; positions only on the first.
    groups["embedding"] = tuple((g[0], g[-1]) if len(g) > 1 else tuple(g) for g in groups["pp"])
    groups["position-embedding"] = tuple((g[0],) for g in groups["pp"])
    return groups


def _fits(
    active: int, p: ParallelConfig, global_batch: int | None, micro_batch: int | None
) -> str | None:
    """None when ``active`` ranks can train; else why not (for the error message)."""
    if active % p.model_size:
        return f"not a multiple of tp·pp·cp = {p.model_size}"
    if active % (p.expert_tp * p.ep * p.pp):
        return f"not a multiple of etp·ep·pp = {p.expert_tp * p.ep * p.pp}"
    if global_batch is None or micro_batch is None:
        return None
    dp = active // p.model_size
    if global_batch % (micro_batch * dp):
        return (
            f"global batch {global_batch} is not divisible by micro_batch·dp = {micro_batch * dp}"
        )
    accum = global_batch // (micro_batch * dp)
    if p.vpp > 1 and accum % p.pp:
        return (
            f"interleaving needs micro-batches per step ({accum}) to be a multiple of pp ({p.pp})"
        )
    return None


def plan_world(
    world: int,
    parallel: ParallelConfig,
    *,
    global_batch: int | None = None,
    micro_batch: int | None = None,
) -> Layout:
    """The layout for ``world`` ranks: the largest active prefix that fits, the rest spares.

    tp, pp, cp, ep and etp are fixed; dp is derived. The largest ``active <= world`` is
    chosen such that ``active`` is a multiple of tp·pp·cp and of etp·ep·pp, and (when a
    batch is given) ``global_batch`` divides evenly into ``micro_batch·dp`` micro-batches
    (a multiple of pp of them when interleaving). Raises :class:`LayoutError` when none fits.
    """
    _check_positive("world", world)
    if world > MAX_WORLD:
        raise LayoutError(f"world: {world} ranks is more than the {MAX_WORLD} elasticd plans for")
    if global_batch is not None:
        _check_positive("train.global_batch", global_batch)
    if micro_batch is not None:
        _check_positive("train.micro_batch", micro_batch)
    if (global_batch is None) != (micro_batch is None):
        raise LayoutError("give both global_batch and micro_batch, or neither")
    if global_batch is not None and global_batch % micro_batch:
        raise LayoutError(
            f"train.global_batch: {global_batch} is not a multiple of train.micro_batch ({micro_batch})"
        )
    p = parallel
    if world < p.model_size:
        raise LayoutError(
            f"a world of {world} ranks is smaller than tp·pp·cp = {p.model_size} "
            f"(tp={p.tp}, pp={p.pp}, cp={p.cp})"
        )
    reason = None
    for active in range(world - world % p.model_size, 0, -p.model_size):
        why = _fits(active, p, global_batch, micro_batch)
        if why is None:
            dp = active // p.model_size
            accum = None if global_batch is None else global_batch // (micro_batch * dp)
            return Layout(
                world=world,
                active=active,
                spares=tuple(range(active, world)),
                parallel=p,
                dp=dp,
                global_batch=global_batch,
                micro_batch=micro_batch,
                grad_accum=accum,
                groups=build_groups(active, p),
            )
        reason = reason or f"{active} ranks: {why}"
    raise LayoutError(f"no layout fits a world of {world} ranks ({reason})")


class _JobLike(Protocol):
    @property
    def parallel(self) -> ParallelConfig: ...

    @property
    def train(self) -> Any: ...


def plan(world_size: int, job: _JobLike) -> Layout:
    """The layout of ``job`` on ``world_size`` ranks; identical on every node."""
    return plan_world(
        world_size,
        job.parallel,
        global_batch=job.train.global_batch,
        micro_batch=job.train.micro_batch,
    )


def rank_coordinates(layout: Layout, rank: int) -> dict[str, int]:
    """This rank's index along each axis (tp, cp, dp, pp, ep), for logs and file names."""
    coords = {}
    for name, kind in (("tp", "tp"), ("cp", "cp"), ("dp", "dp"), ("pp", "pp"), ("ep", "expert-ep")):
        idx = layout.index_in(kind, rank)
        if idx is None:
            raise LayoutError(f"rank {rank} is a spare in a world of {layout.world}")
        coords[name] = idx
    return coords


STATE_KINDS = ("tp", "pp", "expert-ep", "expert-tp")
"""The group kinds whose index decides which regions of the global model a rank holds
(a dense tensor's tp shard and pp stage, an expert's ep and expert-tp shards). Its dp and
cp indexes do not: data- and context-parallel ranks hold replicas."""


def shard_signature(layout: Layout, rank: int) -> tuple[int | None, ...] | None:
    """What ``rank`` holds of the model in ``layout``, as its index in each
    :data:`STATE_KINDS` group (None: a spare, which holds nothing). Two ranks of layouts
    with the same tp, pp, ep and expert-tp sizes hold the same regions exactly when their
    signatures are equal (without ZeRO, whose rows follow the dp index and size too)."""
    if layout.is_spare(rank):
        return None
    return tuple(layout.index_in(kind, rank) for kind in STATE_KINDS)


def keep_shards(
    previous: Sequence[str], order: Sequence[str], *, nproc: int, plan_for: Any
) -> list[str]:
    """``order`` (a re-formed world's nodes, in the rendezvous's node-rank order) rearranged
    so that each surviving node keeps holding what it held: in node-rank order, every
    position of the new world takes the first node (in ``order``) whose ranks held exactly
    what that position's ranks hold in the new layout (with ZeRO-1 preferring one whose
    ranks also keep their dp and cp indexes, which its rows follow); the positions left
    take the nodes left, in ``order``. ``previous``: the last world's nodes in node-rank order;
    ``plan_for(ranks)``: the job's layout for a world of that many ranks.

    In-process recovery then finds each survivor's state in its own memory: nothing moves
    and its new trainer adopts its old one's tensors. tp2 x dp2 losing the node of rank 0
    (tp0 of replica 0) used to renumber the survivors so that all three took another tp
    index; now replica 1's tp0 becomes rank 0 and replica 0's tp1 rank 1. Where every node
    holds the same (data parallelism alone) the order is ``order`` itself."""
    order = list(order)
    if not previous or nproc < 1:
        return order
    old, new = plan_for(len(previous) * nproc), plan_for(len(order) * nproc)
    sizes = [(g.tp, g.pp, g.ep, g.expert_tp) for g in (old.parallel, new.parallel)]
    if sizes[0] != sizes[1]:
        return order  # different shards: nothing is kept by placement

    # With ZeRO-1 a rank's rows follow its dp index and the dp size: where the dp size
    # stays, an exact place (the same shards and the same replica) first. Where it changes
    # no rank keeps its rows, and the plain order keeps the most of them in place (old and
    # new row ranges both rise with the dp index). Without ZeRO-1 replicas are alike.
    zero = bool(getattr(new.parallel, "zero", 0)) and old.dp == new.dp
    kinds = (*STATE_KINDS, "dp", "cp") if zero else STATE_KINDS

    def indexes(layout: Layout) -> list[dict[int, int]]:
        # rank -> its index in its group, per kind: one pass over the groups, so a world of
        # thousands of ranks is placed in linear time (index_in scans every group).
        return [{r: i for g in layout.groups[k] for i, r in enumerate(g)} for k in kinds]

    old_at, new_at = indexes(old), indexes(new)
    shards = len(STATE_KINDS)

    def held(layout: Layout, at: list[dict[int, int]], position: int, n: int) -> tuple:
        ranks = range(position * nproc, (position + 1) * nproc)
        return tuple(None if layout.is_spare(r) else tuple(m.get(r) for m in at[:n]) for r in ranks)

    survivors = set(order)
    rank_in_order = {node: i for i, node in enumerate(order)}
    placed: list[str | None] = [None] * len(order)
    taken: set[str] = set()
    # The exact place first (with ZeRO-1), then the same shards; each position takes the
    # first such node in ``order``.
    for n in dict.fromkeys((len(kinds), shards)):
        by_held: dict[tuple, list[str]] = {}
        for position, node in enumerate(previous):
            if node in survivors and node not in taken:
                by_held.setdefault(held(old, old_at, position, n), []).append(node)
        for nodes in by_held.values():
            nodes.sort(key=rank_in_order.__getitem__, reverse=True)  # pop() takes the first
        for position in range(len(order)):
            if placed[position] is not None:
                continue
            want = held(new, new_at, position, n)
            if all(sig is None for sig in want):
                continue  # spares hold nothing: filled below, with what is left
            if by_held.get(want):
                placed[position] = by_held[want].pop()
                taken.add(placed[position])
    rest = iter(n for n in order if n not in taken)
    return [n if n is not None else next(rest) for n in placed]


def format_table(layout: Layout, kinds: Iterable[str] = GROUP_KINDS) -> str:
    """A readable summary: sizes, spares and each group kind's groups."""
    p = layout.parallel
    lines = [
        f"world {layout.world}: {layout.active} active, "
        f"{len(layout.spares)} spare{'' if len(layout.spares) == 1 else 's'}"
        + (f" {list(layout.spares)}" if layout.spares else ""),
        f"tp={p.tp} pp={p.pp} vpp={p.vpp} cp={p.cp} dp={layout.dp} ep={p.ep} "
        f"etp={p.expert_tp} order={p.order}",
    ]
    if layout.grad_accum is not None:
        lines.append(
            f"global_batch={layout.global_batch} = micro_batch {layout.micro_batch} "
            f"× grad_accum {layout.grad_accum} × dp {layout.dp}"
        )
    kinds = list(kinds)
    width = max(len(k) for k in kinds)
    for kind in kinds:
        groups = layout.groups[kind]
        text = " ".join("[" + ",".join(map(str, g)) + "]" for g in groups)
        lines.append(f"  {kind:<{width}}  {len(groups)}×{len(groups[0])}  {text}")
    return "\n".join(lines)
