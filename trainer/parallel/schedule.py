"""Pipeline schedules as pure lists of actions: fill-drain, 1F1B and interleaved 1F1B.

A pipeline of ``pp`` stages, each holding ``vpp`` model chunks, runs ``microbatches``
micro-batches per optimizer step. Model chunk ``c`` of stage ``s`` is *virtual stage*
``v = c·pp + s``: activations flow from virtual stage v to v + 1 and gradients back, so
the last stage's chunk c feeds the first stage's chunk c + 1 (seed 002, "Virtual Pipeline").

:func:`stage_actions` returns what one stage does in one step, in order: compute actions
(``F``/``B`` of a chunk and micro-batch) and the transfers they imply. Transfers are placed
the way Megatron's ``communicate()`` places them: between two compute actions, one batch
that sends the result of the first and receives the input of the second. The executor posts
every maximal run of consecutive transfers as one ``batch_isend_irecv`` and waits for all of
it, so the schedule must be deadlock-free even when a send completes only once its receive
is posted; the simulator in the tests checks that for every small (pp, vpp, m).

Nothing here touches torch or processes; the executor (``pipeline_exec``) is the I/O shell.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum

from trainer.errors import TrainerConfigError


class ScheduleError(TrainerConfigError, ValueError):
    """Pipeline sizes that no schedule can run, or a schedule that cannot progress."""


class Kind(StrEnum):
    """Which schedule to build."""

    GPIPE = "gpipe"  # fill-drain: every forward, then every backward
    ONE_F_ONE_B = "1f1b"  # one forward, one backward in the steady state (interleaved if vpp > 1)


class Op(StrEnum):
    """What an action does."""

    FORWARD = "F"
    BACKWARD = "B"
    SEND_ACT = "send_act"  # send the output activation of (chunk, mb) to the next stage
    RECV_ACT = "recv_act"  # receive the input activation of (chunk, mb) from the prev stage
    SEND_GRAD = "send_grad"  # send the input gradient of (chunk, mb) to the previous stage
    RECV_GRAD = "recv_grad"  # receive the output gradient of (chunk, mb) from the next stage


COMPUTE_OPS = (Op.FORWARD, Op.BACKWARD)


@dataclass(frozen=True, slots=True, kw_only=True)
class Action:
    """One step of a stage: a compute on (chunk, microbatch), or one transfer of it."""

    op: Op  # what to do
    chunk: int  # local model chunk index, 0..vpp-1
    microbatch: int  # micro-batch index, 0..m-1
    peer: int | None = None  # pipeline stage on the other end of a transfer; None for compute

    @property
    def is_compute(self) -> bool:
        return self.op in COMPUTE_OPS

    def to_json(self) -> list:
        return [self.op.value, self.chunk, self.microbatch]


def validate(*, pp: int, vpp: int, microbatches: int, kind: Kind | str = Kind.ONE_F_ONE_B) -> Kind:
    """Raise :class:`ScheduleError` naming the bad argument; returns the parsed kind."""
    for name, value in (("pp", pp), ("vpp", vpp), ("microbatches", microbatches)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ScheduleError(f"{name} must be a positive integer, got {value!r}")
    try:
        kind = Kind(kind)
    except ValueError:
        choices = ", ".join(k.value for k in Kind)
        raise ScheduleError(f"unknown schedule kind {kind!r}; choose one of {choices}") from None
    if vpp > 1 and pp == 1:
        raise ScheduleError(f"vpp {vpp} needs pp > 1 (one stage has nothing to interleave)")
    if vpp > 1 and kind is Kind.GPIPE:
        raise ScheduleError("the gpipe (fill-drain) schedule runs one chunk per stage (vpp 1)")
    if vpp > 1 and microbatches % pp:
        raise ScheduleError(
            f"interleaving needs microbatches ({microbatches}) to be a multiple of pp ({pp})"
        )
    return kind


def layer_range(*, layers: int, pp: int, vpp: int, stage: int, chunk: int) -> range:
    """Global layer indexes held by ``chunk`` of ``stage``: contiguous, in model order."""
    if layers % (pp * vpp):
        raise ScheduleError(f"layers ({layers}) must be divisible by pp·vpp ({pp * vpp})")
    if not 0 <= stage < pp or not 0 <= chunk < vpp:
        raise ScheduleError(f"stage {stage} / chunk {chunk} out of range for pp {pp} vpp {vpp}")
    per = layers // (pp * vpp)
    first = (chunk * pp + stage) * per
    return range(first, first + per)


def compute_order(
    *, pp: int, vpp: int, microbatches: int, stage: int, kind: Kind | str = Kind.ONE_F_ONE_B
) -> list[Action]:
    """The compute actions of ``stage`` in execution order (no transfers)."""
    groups = _compute_groups(pp=pp, vpp=vpp, microbatches=microbatches, stage=stage, kind=kind)
    return [act for group in groups for act in group]


def _compute_groups(
    *, pp: int, vpp: int, microbatches: int, stage: int, kind: Kind | str
) -> list[list[Action]]:
    """Compute actions in groups that run back to back, with no transfer between them."""
    kind = validate(pp=pp, vpp=vpp, microbatches=microbatches, kind=kind)
    if isinstance(stage, bool) or not isinstance(stage, int) or not 0 <= stage < pp:
        raise ScheduleError(f"stage must be in 0..{pp - 1}, got {stage!r}")
    m = microbatches
    if kind is Kind.GPIPE:
        return [[_f(0, i)] for i in range(m)] + [[_b(0, i)] for i in range(m)]
    if vpp == 1:
        # Warm-up forwards fill the pipeline below us; then alternate; then drain. Every
        # action is its own group: the forward's send travels with the backward's receive.
        warmup = min(pp - stage - 1, m)
        order = [[_f(0, i)] for i in range(warmup)]
        for i in range(m - warmup):
            order += [[_f(0, warmup + i)], [_b(0, i)]]
        return order + [[_b(0, i)] for i in range(m - warmup, m)]
    # Interleaved (Megatron): forwards walk groups of pp micro-batches through chunk 0, then
    # chunk 1, ...; backwards walk the same groups through the chunks in reverse. Warm-up is
    # long enough that the first backward's gradient has come round when it is needed.
    # In the steady state a forward and a backward run as one group, and a single batch
    # of transfers follows each pair: with a batch between them, the ring of stages can
    # wait on itself (the wrap from the last stage to the first closes the cycle).
    total = m * vpp
    warmup = warmup_forwards(pp=pp, vpp=vpp, microbatches=m, stage=stage)

    def nth(k: int, *, forward: bool) -> Action:
        group, within = divmod(k, pp * vpp)
        chunk = within // pp
        mb = group * pp + k % pp
        return _f(chunk, mb) if forward else _b(vpp - 1 - chunk, mb)

    order = [[nth(k, forward=True)] for k in range(warmup)]
    for k in range(total - warmup):
        order.append([nth(warmup + k, forward=True), nth(k, forward=False)])
    return order + [[nth(k, forward=False)] for k in range(total - warmup, total)]


def stage_actions(
    *, pp: int, vpp: int, microbatches: int, stage: int, kind: Kind | str = Kind.ONE_F_ONE_B
) -> list[Action]:
    """Every action of ``stage`` in order: computes, with their transfers between them.

    Between two groups of computes sits one run of transfers: first the sends of what the
    earlier group produced, then the receives the later group needs.
    """
    groups = _compute_groups(pp=pp, vpp=vpp, microbatches=microbatches, stage=stage, kind=kind)
    out: list[Action] = []
    prev: list[Action] = []
    for group in [*groups, []]:
        for act in prev:
            out += _sends_of(act, pp=pp, vpp=vpp, stage=stage)
        for act in group:
            out += _recvs_of(act, pp=pp, vpp=vpp, stage=stage)
        out += group
        prev = group
    return out


def all_stages(
    *, pp: int, vpp: int, microbatches: int, kind: Kind | str = Kind.ONE_F_ONE_B
) -> list[list[Action]]:
    """:func:`stage_actions` for every stage, indexed by stage."""
    return [
        stage_actions(pp=pp, vpp=vpp, microbatches=microbatches, stage=s, kind=kind)
        for s in range(pp)
    ]


def comm_batches(actions: list[Action]) -> list[list[Action] | Action]:
    """Group a stage's actions: compute actions alone, consecutive transfers as one batch."""
    out: list[list[Action] | Action] = []
    for act in actions:
        if act.is_compute:
            out.append(act)
        elif out and isinstance(out[-1], list):
            out[-1].append(act)
        else:
            out.append([act])
    return out


def virtual_stage(*, pp: int, stage: int, chunk: int) -> int:
    """Position of (stage, chunk) in model order."""
    return chunk * pp + stage


def warmup_forwards(*, pp: int, vpp: int, microbatches: int, stage: int) -> int:
    """Forwards run before the first backward by a 1F1B stage (the in-flight bound − 1)."""
    if vpp == 1:
        return min(pp - stage - 1, microbatches)
    return min((pp - stage - 1) * 2 + (vpp - 1) * pp, microbatches * vpp)


def _f(chunk: int, mb: int) -> Action:
    return Action(op=Op.FORWARD, chunk=chunk, microbatch=mb)


def _b(chunk: int, mb: int) -> Action:
    return Action(op=Op.BACKWARD, chunk=chunk, microbatch=mb)


def _recvs_of(act: Action, *, pp: int, vpp: int, stage: int) -> list[Action]:
    v = virtual_stage(pp=pp, stage=stage, chunk=act.chunk)
    if act.op is Op.FORWARD and v > 0:
        return [Action(op=Op.RECV_ACT, chunk=act.chunk, microbatch=act.microbatch,
                       peer=(stage - 1) % pp)]  # fmt: skip
    if act.op is Op.BACKWARD and v < pp * vpp - 1:
        return [Action(op=Op.RECV_GRAD, chunk=act.chunk, microbatch=act.microbatch,
                       peer=(stage + 1) % pp)]  # fmt: skip
    return []


def _sends_of(act: Action, *, pp: int, vpp: int, stage: int) -> list[Action]:
    v = virtual_stage(pp=pp, stage=stage, chunk=act.chunk)
    if act.op is Op.FORWARD and v < pp * vpp - 1:
        return [Action(op=Op.SEND_ACT, chunk=act.chunk, microbatch=act.microbatch,
                       peer=(stage + 1) % pp)]  # fmt: skip
    if act.op is Op.BACKWARD and v > 0:
        return [Action(op=Op.SEND_GRAD, chunk=act.chunk, microbatch=act.microbatch,
                       peer=(stage - 1) % pp)]  # fmt: skip
    return []
