"""A discrete-event simulation of all stages of a pipeline schedule running together.

Pure Python over :mod:`schedule`'s action lists. Compute costs are unit costs (forward 1,
backward 2 per chunk by default) and communication is free, but synchronisation is not: a
run of transfers is posted as one batch and completes only when every transfer in it has
its partner *posted* by the peer (a send waits for its receive, as NCCL does). Transfers
between a pair of stages are matched first-in first-out, the way both NCCL and gloo match
untagged point-to-point messages, and each match must carry the tensor the receiver
expects. A schedule that cannot progress raises :class:`~schedule.ScheduleError`.

Bubble fraction, as Megatron defines it: with ``T`` the makespan (first start to last end
over all stages) and ``T_ideal`` the compute time of one stage (``m·vpp·(F + B)``, equal
on every stage), the bubble fraction is ``(T − T_ideal) / T_ideal``: time a stage spends
idle per unit of useful work. Theory: ``(pp − 1)/m`` for fill-drain and 1F1B,
``(pp − 1)/(vpp·m)`` for interleaved 1F1B.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from fractions import Fraction

from trainer.parallel.schedule import (
    Action,
    Kind,
    Op,
    ScheduleError,
    all_stages,
    comm_batches,
    validate,
    virtual_stage,
)


@dataclass(frozen=True, slots=True, kw_only=True)
class Slot:
    """One compute action placed in time."""

    start: int  # simulated start time
    end: int  # simulated end time
    action: Action  # the compute action


@dataclass(frozen=True, slots=True, kw_only=True)
class SimResult:
    """What running every stage together gave."""

    pp: int  # pipeline stages
    vpp: int  # chunks per stage
    microbatches: int  # micro-batches per step
    kind: Kind  # schedule kind
    timeline: tuple[tuple[Slot, ...], ...]  # per stage, compute slots in execution order
    makespan: int  # first start to last end over all stages
    ideal: int  # compute time of one stage
    peak_in_flight: tuple[int, ...]  # per stage, most chunk-activations stored at once

    @property
    def bubble_fraction(self) -> Fraction:
        return Fraction(self.makespan - self.ideal, self.ideal)


def theory_bubble(*, pp: int, vpp: int, microbatches: int) -> Fraction:
    """Megatron's bubble fraction: (pp − 1)/(vpp·m); vpp = 1 for 1F1B and fill-drain."""
    return Fraction(pp - 1, vpp * microbatches)


def _message(act: Action, *, pp: int, stage: int) -> tuple[str, int, int]:
    """The tensor a transfer carries: (kind, producing virtual stage, micro-batch)."""
    v = virtual_stage(pp=pp, stage=stage, chunk=act.chunk)
    if act.op is Op.SEND_ACT:
        return ("act", v, act.microbatch)
    if act.op is Op.RECV_ACT:
        return ("act", v - 1, act.microbatch)
    if act.op is Op.SEND_GRAD:
        return ("grad", v, act.microbatch)
    return ("grad", v + 1, act.microbatch)


def simulate(
    *,
    pp: int,
    vpp: int,
    microbatches: int,
    kind: Kind | str = Kind.ONE_F_ONE_B,
    forward_cost: int = 1,
    backward_cost: int = 2,
) -> SimResult:
    """Run every stage's actions together; raise ScheduleError on deadlock or mismatch."""
    kind = validate(pp=pp, vpp=vpp, microbatches=microbatches, kind=kind)
    stages = all_stages(pp=pp, vpp=vpp, microbatches=microbatches, kind=kind)
    return run_stages(
        [comm_batches(acts) for acts in stages],
        vpp=vpp,
        microbatches=microbatches,
        kind=kind,
        forward_cost=forward_cost,
        backward_cost=backward_cost,
    )


def run_stages(
    items: list[list[list[Action] | Action]],
    *,
    vpp: int,
    microbatches: int,
    kind: Kind,
    forward_cost: int = 1,
    backward_cost: int = 2,
) -> SimResult:
    """Simulate explicit per-stage items: compute actions, and lists posted as one batch."""
    pp = len(items)
    partners = _match_transfers(items, pp=pp)
    n_virtual = pp * vpp
    posted: list[dict[int, int]] = [{} for _ in range(pp)]
    clock = [0] * pp
    ptr = [0] * pp
    slots: list[list[Slot]] = [[] for _ in range(pp)]
    received: list[set[tuple[str, int, int]]] = [set() for _ in range(pp)]
    stored: list[set[tuple[int, int]]] = [set() for _ in range(pp)]
    peak = [0] * pp
    progress = True
    while progress:
        progress = False
        for s in range(pp):
            while ptr[s] < len(items[s]):
                item = items[s][ptr[s]]
                if isinstance(item, Action):
                    v = virtual_stage(pp=pp, stage=s, chunk=item.chunk)
                    key = (item.chunk, item.microbatch)
                    if item.op is Op.FORWARD:
                        need = ("act", v - 1, item.microbatch) if v > 0 else None
                        cost = forward_cost
                        if key in stored[s]:
                            raise ScheduleError(f"stage {s} runs forward {key} twice")
                        stored[s].add(key)
                        peak[s] = max(peak[s], len(stored[s]))
                    else:
                        need = ("grad", v + 1, item.microbatch) if v < n_virtual - 1 else None
                        cost = backward_cost
                        if key not in stored[s]:
                            raise ScheduleError(f"stage {s} runs backward {key} before forward")
                        stored[s].discard(key)
                    if need is not None and need not in received[s]:
                        raise ScheduleError(f"stage {s} computes {item} before receiving {need}")
                    received[s].discard(need)
                    slots[s].append(Slot(start=clock[s], end=clock[s] + cost, action=item))
                    clock[s] += cost
                else:
                    posted[s].setdefault(ptr[s], clock[s])
                    peers = partners[(s, ptr[s])]
                    if any(i not in posted[p] for p, i in peers):
                        break  # a partner is not posted yet: this stage waits
                    clock[s] = max([clock[s], *(posted[p][i] for p, i in peers)])
                    for act in item:
                        if act.op in (Op.RECV_ACT, Op.RECV_GRAD):
                            received[s].add(_message(act, pp=pp, stage=s))
                ptr[s] += 1
                progress = True
    stuck = [s for s in range(pp) if ptr[s] < len(items[s])]
    if stuck:
        where = ", ".join(f"stage {s} at {items[s][ptr[s]]}" for s in stuck)
        raise ScheduleError(f"deadlock: {where}")
    ideal = microbatches * vpp * (forward_cost + backward_cost)
    return SimResult(
        pp=pp,
        vpp=vpp,
        microbatches=microbatches,
        kind=kind,
        timeline=tuple(tuple(x) for x in slots),
        makespan=max(clock),
        ideal=ideal,
        peak_in_flight=tuple(peak),
    )


def _match_transfers(
    items: list[list[list[Action] | Action]], *, pp: int
) -> dict[tuple[int, int], list[tuple[int, int]]]:
    """For every batch (stage, index), the peer batches its transfers are matched with."""
    sends: dict[tuple[int, int], list[tuple[int, tuple, tuple]]] = defaultdict(list)
    recvs: dict[tuple[int, int], list[tuple[int, tuple, tuple]]] = defaultdict(list)
    for s, stage_items in enumerate(items):
        for i, item in enumerate(stage_items):
            if isinstance(item, Action):
                continue
            for act in item:
                msg = _message(act, pp=pp, stage=s)
                if act.op in (Op.SEND_ACT, Op.SEND_GRAD):
                    sends[(s, act.peer)].append((i, msg, (s, i)))
                else:
                    recvs[(act.peer, s)].append((i, msg, (s, i)))
    partners: dict[tuple[int, int], list[tuple[int, int]]] = defaultdict(list)
    for pair in set(sends) | set(recvs):
        out, into = sends.get(pair, []), recvs.get(pair, [])
        if len(out) != len(into):
            raise ScheduleError(
                f"stage {pair[0]} sends {len(out)} tensors to stage {pair[1]}, "
                f"which receives {len(into)}"
            )
        for (_, sent, at_send), (_, wanted, at_recv) in zip(out, into, strict=True):
            if sent != wanted:
                raise ScheduleError(
                    f"stage {pair[1]} expects {wanted} from stage {pair[0]} "
                    f"but the next tensor sent is {sent}"
                )
            partners[at_send].append(at_recv)
            partners[at_recv].append(at_send)
    return partners


def format_timeline(result: SimResult) -> str:
    """The timeline as text: one row per stage, one cell per unit of time.

    A forward shows as ``F<mb>`` for one cell and a backward as ``B<mb>`` over its cells;
    with vpp > 1 the chunk follows after a dot (``F3.1``). Idle cells are ``.``.
    """
    label = {}
    for row in result.timeline:
        for slot in row:
            act = slot.action
            text = f"{act.op.value}{act.microbatch}"
            label[id(slot)] = text + (f".{act.chunk}" if result.vpp > 1 else "")
    width = max((len(t) for t in label.values()), default=1)
    lines = []
    for stage, row in enumerate(result.timeline):
        cells = ["." * width] * result.makespan
        for slot in row:
            for t in range(slot.start, slot.end):
                cells[t] = label[id(slot)].ljust(width)
        lines.append(f"stage {stage}: " + " ".join(cells).rstrip())
    return "\n".join(lines)


def summary(result: SimResult) -> str:
    """Bubble fraction against theory, and the activations each stage stores at its peak."""
    theory = theory_bubble(
        pp=result.pp, vpp=1 if result.kind is Kind.GPIPE else result.vpp,
        microbatches=result.microbatches,
    )  # fmt: skip
    name = "gpipe" if result.kind is Kind.GPIPE else "1f1b" if result.vpp == 1 else "interleaved"
    frac = result.bubble_fraction
    return "\n".join(
        [
            f"schedule: {name} pp={result.pp} vpp={result.vpp} "
            f"microbatches={result.microbatches} (F=1, B=2 per chunk, transfers free)",
            f"bubble fraction: {float(frac):.4f} = {frac} (theory {theory}); "
            f"makespan {result.makespan}, ideal {result.ideal}",
            "peak stored activations per stage (chunk-micro-batches): "
            + " ".join(str(p) for p in result.peak_in_flight),
        ]
    )
