"""job.yaml (version 1): frozen config classes, parsed and validated at the edge.

Everything wrong with a job is found here, before anything starts, and reported as one
line naming the field path and exit code 2 (via :class:`JobSpecError`)::

    job.yaml: parallel.tp: 3 does not divide model.heads (4)

The YAML is parsed into plain data, then into the frozen dataclasses below by a small
type-driven validator (unknown keys, wrong types), then cross-field checks run
(divisibility, and whether any layout fits the smallest world). The result is plain data
again with :meth:`JobSpec.to_dict`, which is what goes into etcd as JSON.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import os
import re
import types
import typing
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import yaml

from elasticd.errors import JobSpecError, LayoutError
from elasticd.layout import ParallelConfig, plan_world

VERSION = 1
NAME_RE = re.compile(r"[a-z0-9][a-z0-9-]*\Z")


@dataclass(frozen=True, kw_only=True, slots=True)
class NodesConfig:
    min: int = 1
    """Fewest nodes the job trains on; fewer and it waits."""
    max: int = 1
    """Most nodes the job uses; more become spares at the agent level."""
    start: int | None = None
    """Nodes the job's first world waits for (null: ``min``). A job given four nodes can
    start on all four and still train on as few as ``min`` after a fault: with ``start:
    4`` it does not begin on the first ``min`` nodes that join ``rendezvous.settle``
    apart. Until that many nodes have room, the job stays queued and says so; once they
    have, a node that never joins (it died meanwhile) delays the start by
    ``rendezvous.start_wait`` (60 s) after the last join, and the job then begins on those
    that did (at least ``min``). Later worlds need only ``min``."""


@dataclass(frozen=True, kw_only=True, slots=True)
class ModelConfig:
    layers: int = 4
    """Transformer blocks."""
    hidden: int = 64
    """Model width."""
    heads: int = 4
    """Attention heads."""
    ffn_hidden: int = 256
    """Width of the MLP (and of each expert)."""
    vocab: int = 256
    """True vocabulary size (padding for tensor parallelism is internal)."""
    seq_len: int = 64
    """Tokens per sample; also the number of learned positions."""
    experts: int = 0
    """MoE experts per MLP; 0 means a dense MLP."""
    top_k: int = 2
    """Experts each token is routed to."""
    tie_embeddings: bool = True
    """Share the output head with the token embedding, as GPT-2 does."""
    dropout: float = 0.0
    """Dropout probability; 0 makes every layout bit-comparable."""
    init_from: str | None = None
    """``hf:DIR``: start from a Hugging Face GPT-2 directory's weights (config.json and
    model.safetensors) when there is no checkpoint to resume; dense models only."""


@dataclass(frozen=True, kw_only=True, slots=True)
class TrainConfig:
    steps: int = 20
    """Optimizer steps to run in total."""
    global_batch: int = 16
    """Samples per optimizer step, constant whatever the world."""
    micro_batch: int = 2
    """Samples per micro-batch on each data-parallel rank."""
    lr: float = 1.0e-3
    """Peak learning rate of AdamW."""
    warmup: int = 0
    """Linear warm-up steps."""
    lr_schedule: Literal["constant", "cosine", "linear"] = "constant"
    """After warm-up: keep lr (constant), or decay it to min_lr by the last step."""
    min_lr: float = 0.0
    """The learning rate a cosine or linear schedule ends at."""
    weight_decay: float = 0.0
    """AdamW decoupled weight decay."""
    grad_clip: float = 1.0
    """Clip the global gradient norm to this; 0 turns clipping off."""
    seed: int = 1234
    """Seed for initialisation and synthetic data."""
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    """Parameter and compute dtype."""
    tf32: bool = True
    """float32 on CUDA: let matmuls use TF32 tensor cores (false: full fp32, bit-comparable
    with a CPU run)."""
    bucket_mb: float = 25.0
    """Size of a data-parallel gradient bucket, in MiB."""
    aux_loss_coeff: float = 0.0
    """Weight of the MoE load-balancing loss; 0 turns it off."""
    recompute: Literal["none", "selective", "full"] = "none"
    """Activation recomputation in backward: none, the attention core (selective), or
    whole transformer blocks (full)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class DataConfig:
    source: Literal["synthetic", "file"] = "synthetic"
    """Where tokens come from: a seeded synthetic pattern, or a prepared token file."""
    path: str | None = None
    """The token file for source: file (made by `elasticd data prepare`)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class CheckpointConfig:
    dir: str | None = None
    """Where checkpoints go; default <output_dir>/ckpt."""
    every: int = 10
    """Save every this many steps (and always after the last step); 0 saves only at the end."""
    keep: int = 3
    """Committed checkpoints kept; older ones are pruned, `latest` never."""
    async_: bool = True
    """Write in the background after a snapshot to CPU (YAML key `async`). The built-in
    trainer overlaps the snapshot's copies with the next step's forward and backward and
    waits for them before its optimizer step (docs/checkpoint-format.md)."""
    resume: bool = True
    """Resume from the latest committed checkpoint when there is one."""
    load_broadcast: bool = False
    """On resume, a region of a tensor that several ranks hold (DP replicas) is read from
    disk by one of them and sent to the others over the checkpoint's gloo group, so the
    checkpoint is read about once instead of once per replica (docs/checkpoint-format.md)."""
    memory_replicas: int = 0
    """restart.mode inprocess: how many ranks on other nodes keep, in their host memory, a
    copy of each rank's parameters and optimizer state (0 or 1 in practice; each copy costs
    the state's size in host memory on the receiver, plus one snapshot on the sender).
    In-process recovery uses them when a shard's every live holder died (docs/inprocess.md)."""
    memory_every: int = 1
    """restart.mode inprocess, ``memory_replicas`` > 0: refresh the copies every this many
    steps; a recovery from them loses at most this many steps (plus the one in flight)."""
    key_file: str | None = None
    """A secret key (made by ``elasticd ckpt keygen PATH``, mode 600, at this path on every
    node) that seals each checkpoint: a resume then loads only steps sealed with it and
    checks every block it reads, so a checkpoint changed or planted by anyone without the
    key is refused (docs/checkpoint-format.md, "Sealed checkpoints")."""


@dataclass(frozen=True, kw_only=True, slots=True)
class RestartConfig:
    max_restarts: int = 10
    """Failures in a row the job survives: a worker that crashed or hung, a collective that
    failed (a lost node, a preemption or a scale-up is none). The count starts over once
    the job trains past the furthest step it had reached at the failure before, so a job
    that trains on between faults never runs out, and one that keeps failing before it
    gets further fails at failure ``max_restarts + 1``."""
    mode: Literal["process", "inprocess"] = "process"
    """How workers restart after a fault: ``process`` stops every worker and starts new
    ones (state from the last checkpoint); ``inprocess`` keeps the survivors' processes,
    re-forms their process groups and recovers state from the survivors' memory
    (docs/inprocess.md). The worker must support it (the built-in trainer does; scripts
    use ``elasticd.inprocess``)."""
    hang_timeout: float = 300.0
    """Seconds without a step heartbeat before a worker counts as hung; in-process, also
    the bound on each part of a recovery from peers (its set-up, its transfer:
    docs/agent.md)."""
    startup_timeout: float = 1800.0
    """Seconds a round's workers may take from their start to their first completed step
    (imports, the process group, the checkpoint load, the first step itself) before they
    count as hung: their stacks are dumped, they are killed, the job restarts. 0: never.
    ``hang_timeout`` judges only workers that completed a step, so without this a worker
    stuck before its first one (a frozen filesystem under the checkpoint load, an NCCL
    set-up that never returns) held a world of one for good, and a larger world until a
    peer's collective timed out. Never less than ``hang_timeout`` (the first step may take
    as long as any). Judged for the built-in trainer's workers, while none of a node's has
    stepped; a job's own ``command`` is not judged (which of its ranks report steps, if
    any, is the script's choice)."""
    grace_period: float = 30.0
    """Seconds workers get to save an emergency checkpoint when the node is preempted."""
    scale_up: Literal["immediate", "checkpoint"] | None = None
    """When a waiting node joins: re-form at once, or after the next committed checkpoint.
    Unset: ``immediate`` under ``mode: inprocess`` (a newcomer takes the state from the
    survivors' memory, a re-form of about half a second, so waiting for a checkpoint saves
    nothing, and with ``checkpoint.every: 0`` a node that missed a re-form, a thawed one or
    a replacement waited for the end of the job), ``checkpoint`` under ``mode: process``
    (the whole world restarts from a checkpoint; at the next commit nothing is
    recomputed). Never None once parsed."""
    standby: int = 1
    """restart.mode inprocess, built-in trainer: warm worker processes each node keeps
    ready (torch imported, no rank, no device memory) while a round trains; a worker that
    dies is replaced by one at the next round instead of by a cold start. 0 turns them
    off; at most ``nproc_per_node``. Ignored otherwise."""
    fork: bool | None = None
    """Whether each node's workers are forked from one process of the job that imported
    torch once (docs/agent.md, "Workers are forked, not started"). Unset: the built-in
    trainer's are, a job's own ``command`` is exec'd. ``true``: a ``command`` of the form
    ``python -m MODULE ...`` or ``python SCRIPT.py ...`` is forked too (the script then
    finds torch imported before its first line runs: one that sets OMP_NUM_THREADS or
    another variable torch reads as it loads must set it in the agent's environment
    instead). ``false``: every worker is exec'd."""

    def __post_init__(self) -> None:
        if self.scale_up is None:
            policy = "immediate" if self.mode == "inprocess" else "checkpoint"
            object.__setattr__(self, "scale_up", policy)


@dataclass(frozen=True, kw_only=True, slots=True)
class RendezvousConfig:
    ttl: float = 3.0
    """Lease TTL of a node's membership, in seconds; a dead node is known after about this."""
    settle: float = 1.0
    """A round closes once min nodes joined and nobody joined for this long."""
    join_timeout: float = 300.0
    """Give up joining after this many seconds."""
    start_wait: float = 60.0
    """With ``nodes.start``: the job's first world, short of that many nodes, begins on
    those that joined (at least ``nodes.min``) once nobody joined for this many seconds
    (pods scheduled minutes apart: raise it)."""
    reform_grace: float = 0.15
    """restart.mode inprocess: once a node saw a fault, a re-forming round waits at most
    this many seconds for previous members that do not re-join (not a lease TTL). The
    survivors of a fault join within 17-69 ms of each other on a 2-core machine at a load
    average of 17-21 (docs/inprocess.md); one that misses the window re-joins as a
    newcomer (never a wrong world: rounds are fenced), at once under ``scale_up:
    immediate`` (the in-process default), else after the next committed checkpoint."""


@dataclass(frozen=True, kw_only=True, slots=True)
class JobSpec:
    name: str
    """The job id: [a-z0-9][a-z0-9-]*."""
    output_dir: str | None = None
    """metrics.jsonl, logs/ and ckpt/ go here; default runs/<name>."""
    nodes: NodesConfig = field(default_factory=NodesConfig)
    """How many nodes the job may use."""
    nproc_per_node: int = 1
    """Worker processes per node."""
    command: list[str] | None = None
    """The worker argv; default the built-in trainer (python -m trainer JOB.yaml)."""
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    """Fixed parallel sizes; dp is derived from the world."""
    model: ModelConfig = field(default_factory=ModelConfig)
    """The GPT's shape."""
    train: TrainConfig = field(default_factory=TrainConfig)
    """Optimisation settings."""
    data: DataConfig = field(default_factory=DataConfig)
    """The token source."""
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    """Checkpoint cadence and retention."""
    restart: RestartConfig = field(default_factory=RestartConfig)
    """Failure handling."""
    rendezvous: RendezvousConfig = field(default_factory=RendezvousConfig)
    """World formation timing."""

    @property
    def out_dir(self) -> str:
        """The output directory with its default applied."""
        return self.output_dir or os.path.join("runs", self.name)

    @property
    def ckpt_dir(self) -> str:
        """The checkpoint directory with its default applied."""
        return self.checkpoint.dir or os.path.join(self.out_dir, "ckpt")

    def logs_dir(self, run_id: str) -> str:
        """Where run ``run_id`` of this job writes its workers' logs (:func:`run_logs_dir`)."""
        return run_logs_dir(self.out_dir, run_id)

    def to_dict(self) -> dict[str, Any]:
        """Plain data with YAML key names (what etcd stores, as JSON)."""
        return _to_plain(self)

    def with_paths_resolved(self, base: str | os.PathLike[str]) -> JobSpec:
        """Relative output_dir, checkpoint.dir, checkpoint.key_file and data.path made
        absolute against ``base``."""

        def absolute(p: str | None) -> str | None:
            return None if p is None else str((Path(base) / p).resolve())

        return dataclasses.replace(
            self,
            output_dir=absolute(self.out_dir),
            checkpoint=dataclasses.replace(
                self.checkpoint,
                dir=absolute(self.ckpt_dir),
                key_file=absolute(self.checkpoint.key_file),
            ),
            data=dataclasses.replace(self.data, path=absolute(self.data.path)),
        )


# ----------------------------------------------------------------------------- parsing


def _yaml_key(name: str) -> str:
    return name[:-1] if name.endswith("_") else name


def _to_plain(obj: Any) -> Any:
    if dataclasses.is_dataclass(obj):
        return {_yaml_key(f.name): _to_plain(getattr(obj, f.name)) for f in dataclasses.fields(obj)}
    if isinstance(obj, list | tuple):
        return [_to_plain(v) for v in obj]
    return obj


def _describe(tp: Any) -> str:
    origin = typing.get_origin(tp)
    if origin is Literal:
        return "one of " + ", ".join(repr(a) for a in typing.get_args(tp))
    if origin in (typing.Union, types.UnionType):
        return " or ".join(_describe(a) for a in typing.get_args(tp))
    if origin is list:
        return "a list of strings"
    if tp is type(None):
        return "null"
    return {int: "an integer", float: "a number", bool: "true or false", str: "a string"}.get(
        tp, getattr(tp, "__name__", str(tp))
    )


def _convert(value: Any, tp: Any, path: str, where: str) -> Any:
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = typing.get_args(tp)
        if value is None and type(None) in args:
            return None
        for arg in args:
            if arg is type(None):
                continue
            try:
                return _convert(value, arg, path, where)
            except JobSpecError:
                pass
        raise JobSpecError(f"{where}: {path}: {value!r} is not {_describe(tp)}")
    if origin is Literal:
        if value in typing.get_args(tp):
            return value
        raise JobSpecError(f"{where}: {path}: {value!r} is not {_describe(tp)}")
    if origin is list:
        if isinstance(value, list) and value and all(isinstance(v, str) for v in value):
            return list(value)
        raise JobSpecError(f"{where}: {path}: {value!r} is not a non-empty list of strings")
    if dataclasses.is_dataclass(tp):
        return _build(tp, value, path, where)
    if tp is bool:
        if isinstance(value, bool):
            return value
    elif tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    elif tp is float:
        if isinstance(value, int | float) and not isinstance(value, bool):
            try:
                return float(value)
            except OverflowError:  # an integer of hundreds of digits
                raise JobSpecError(f"{where}: {path}: {value} is too large") from None
        if isinstance(value, str):  # YAML 1.1 reads `1e-3` as a string
            try:
                return float(value)
            except ValueError:
                pass
    elif tp is str:
        if isinstance(value, str):
            return value
    raise JobSpecError(f"{where}: {path}: {value!r} is not {_describe(tp)}")


REMOVED_KEYS = {
    "metrics": "no longer a job setting: the agent serves every job's Prometheus metrics on "
    "its own port (elasticd agent --metrics-port); delete this key",
}
"""Keys of earlier job specs that are refused with a message saying what replaced them."""


def _build(cls: type, raw: Any, path: str, where: str) -> Any:
    if raw is None:
        raw = {}
    if not isinstance(raw, Mapping):
        raise JobSpecError(f"{where}: {path or 'top level'}: expected a mapping, got {raw!r}")
    hints = typing.get_type_hints(cls)
    by_key = {_yaml_key(f.name): f for f in dataclasses.fields(cls)}
    for key in raw:
        gone = REMOVED_KEYS.get(f"{path}.{key}" if path else str(key))
        if gone is not None:
            raise JobSpecError(f"{where}: {path + '.' if path else ''}{key}: {gone}")
        if key not in by_key:
            close = difflib.get_close_matches(str(key), list(by_key), n=1)
            hint = f"; did you mean {close[0]!r}?" if close else f" (known: {', '.join(by_key)})"
            raise JobSpecError(f"{where}: {path + '.' if path else ''}{key}: unknown key{hint}")
    kwargs = {}
    for key, f in by_key.items():
        sub = f"{path}.{key}" if path else key
        if key in raw:
            kwargs[f.name] = _convert(raw[key], hints[f.name], sub, where)
        elif f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
            raise JobSpecError(f"{where}: {sub}: required")
    try:
        return cls(**kwargs)
    except LayoutError as exc:  # ParallelConfig validates itself
        raise JobSpecError(f"{where}: {exc}") from exc


def _positive(where: str, path: str, value: float, *, zero_ok: bool = False) -> None:
    # YAML's .nan and .inf parse as floats and pass every comparison below.
    if not math.isfinite(value):
        raise JobSpecError(f"{where}: {path}: {value!r} must be a finite number")
    if value < 0 or (value == 0 and not zero_ok):
        bound = ">= 0" if zero_ok else "> 0"
        raise JobSpecError(f"{where}: {path}: {value!r} must be {bound}")


def _check_dir(where: str, path: str, value: str | None) -> None:
    """A directory elasticd writes into (and `elasticd run --fresh` may delete) must be one
    of its own: not empty, not /, the home directory, or the current directory or a parent
    of it. Relative paths are judged from the current directory, where they resolve."""
    if value is None:
        return
    if not value.strip():
        raise JobSpecError(f"{where}: {path}: must not be empty (leave it out for the default)")
    if value.startswith("~"):
        raise JobSpecError(f"{where}: {path}: {value!r}: '~' is not expanded; write the path out")
    if "\0" in value:
        raise JobSpecError(f"{where}: {path}: {value!r} holds a NUL byte")
    if os.path.exists(value) and not os.path.isdir(value):
        raise JobSpecError(f"{where}: {path}: {value!r} exists and is not a directory")
    try:
        cwd = os.path.realpath(os.getcwd())
    except OSError:  # the current directory was deleted: only absolute paths can be judged
        cwd = None
    if cwd is None and not os.path.isabs(value):
        return
    target = os.path.realpath(os.path.join(cwd or os.sep, value))
    if target == os.path.realpath(os.sep):
        raise JobSpecError(f"{where}: {path}: {value!r} is the filesystem root")
    if target == os.path.realpath(os.path.expanduser("~")):
        raise JobSpecError(f"{where}: {path}: {value!r} is the home directory")
    if cwd is not None and (cwd == target or cwd.startswith(target + os.sep)):
        raise JobSpecError(
            f"{where}: {path}: {value!r} is the current directory or a parent of it; "
            "name a directory of its own"
        )


def _check(job: JobSpec, where: str) -> None:
    """Cross-field checks: everything that makes a job impossible to run."""
    if not NAME_RE.match(job.name) or len(job.name) > 63:
        raise JobSpecError(
            f"{where}: name: {job.name!r} must match [a-z0-9][a-z0-9-]* (at most 63 characters)"
        )
    n, m, t, p = job.nodes, job.model, job.train, job.parallel
    for path, value in (
        ("nodes.min", n.min),
        ("nodes.max", n.max),
        ("nproc_per_node", job.nproc_per_node),
        ("model.layers", m.layers),
        ("model.hidden", m.hidden),
        ("model.heads", m.heads),
        ("model.ffn_hidden", m.ffn_hidden),
        ("model.vocab", m.vocab),
        ("model.seq_len", m.seq_len),
        ("model.top_k", m.top_k),
        ("train.steps", t.steps),
        ("train.global_batch", t.global_batch),
        ("train.micro_batch", t.micro_batch),
        ("train.lr", t.lr),
        ("train.bucket_mb", t.bucket_mb),
        ("checkpoint.keep", job.checkpoint.keep),
        ("checkpoint.memory_every", job.checkpoint.memory_every),
        ("rendezvous.ttl", job.rendezvous.ttl),
        ("rendezvous.join_timeout", job.rendezvous.join_timeout),
        ("restart.hang_timeout", job.restart.hang_timeout),
    ):
        _positive(where, path, value)
    for path, value in (
        ("model.experts", m.experts),
        ("train.warmup", t.warmup),
        ("train.min_lr", t.min_lr),
        ("train.weight_decay", t.weight_decay),
        ("train.grad_clip", t.grad_clip),
        ("train.aux_loss_coeff", t.aux_loss_coeff),
        ("checkpoint.every", job.checkpoint.every),
        ("checkpoint.memory_replicas", job.checkpoint.memory_replicas),
        ("restart.max_restarts", job.restart.max_restarts),
        ("restart.grace_period", job.restart.grace_period),
        ("restart.startup_timeout", job.restart.startup_timeout),
        ("restart.standby", job.restart.standby),
        ("rendezvous.settle", job.rendezvous.settle),
        ("rendezvous.start_wait", job.rendezvous.start_wait),
        ("rendezvous.reform_grace", job.rendezvous.reform_grace),
    ):
        _positive(where, path, value, zero_ok=True)
    if n.max < n.min:
        raise JobSpecError(f"{where}: nodes.max: {n.max} is less than nodes.min ({n.min})")
    if n.start is not None and not n.min <= n.start <= n.max:
        raise JobSpecError(
            f"{where}: nodes.start: {n.start} is not between nodes.min ({n.min}) and "
            f"nodes.max ({n.max})"
        )
    if job.checkpoint.memory_replicas and job.restart.mode != "inprocess":
        raise JobSpecError(
            f"{where}: checkpoint.memory_replicas: {job.checkpoint.memory_replicas} needs "
            "restart.mode: inprocess (a process restart loses every process's memory)"
        )
    if job.restart.standby > job.nproc_per_node:
        raise JobSpecError(
            f"{where}: restart.standby: {job.restart.standby} is more than nproc_per_node "
            f"({job.nproc_per_node})"
        )
    if job.checkpoint.memory_replicas > 3:
        raise JobSpecError(
            f"{where}: checkpoint.memory_replicas: {job.checkpoint.memory_replicas} is more "
            "than 3 (each copy costs the whole state's size in host memory)"
        )
    if not 0.0 <= m.dropout < 1.0:
        raise JobSpecError(f"{where}: model.dropout: {m.dropout} must be in [0, 1)")
    if m.hidden % m.heads:
        raise JobSpecError(
            f"{where}: model.heads: {m.heads} does not divide model.hidden ({m.hidden})"
        )
    if m.heads % p.tp:
        raise JobSpecError(f"{where}: parallel.tp: {p.tp} does not divide model.heads ({m.heads})")
    if m.ffn_hidden % p.tp:
        raise JobSpecError(
            f"{where}: parallel.tp: {p.tp} does not divide model.ffn_hidden ({m.ffn_hidden})"
        )
    if m.layers % (p.pp * p.vpp):
        raise JobSpecError(
            f"{where}: parallel.pp: pp·vpp = {p.pp * p.vpp} does not divide model.layers ({m.layers})"
        )
    if m.experts:
        if m.experts % p.ep:
            raise JobSpecError(
                f"{where}: parallel.ep: {p.ep} does not divide model.experts ({m.experts})"
            )
        if m.top_k > m.experts:
            raise JobSpecError(
                f"{where}: model.top_k: {m.top_k} is more than model.experts ({m.experts})"
            )
        if m.ffn_hidden % p.expert_tp:
            raise JobSpecError(
                f"{where}: parallel.etp: {p.expert_tp} does not divide model.ffn_hidden ({m.ffn_hidden})"
            )
    elif p.ep > 1:
        raise JobSpecError(f"{where}: parallel.ep: {p.ep} needs model.experts > 0")
    elif p.etp is not None and p.etp != p.tp:
        raise JobSpecError(f"{where}: parallel.etp: {p.etp} needs model.experts > 0")
    if p.sp and p.tp == 1:
        raise JobSpecError(f"{where}: parallel.sp: true needs parallel.tp > 1")
    if p.sp and m.seq_len % p.tp:
        raise JobSpecError(
            f"{where}: parallel.sp: model.seq_len ({m.seq_len}) is not a multiple of "
            f"parallel.tp ({p.tp})"
        )
    if p.zero not in (0, 1):
        raise JobSpecError(f"{where}: parallel.zero: {p.zero} must be 0 or 1")
    if job.command is None and p.cp > 1:
        raise JobSpecError(
            f"{where}: parallel.cp: {p.cp}: the built-in trainer has no context parallelism "
            "(use cp: 1, or a command of your own)"
        )
    if t.min_lr > t.lr:
        raise JobSpecError(f"{where}: train.min_lr: {t.min_lr} is more than train.lr ({t.lr})")
    if t.min_lr and t.lr_schedule == "constant":
        raise JobSpecError(
            f"{where}: train.min_lr: only used when train.lr_schedule is cosine or linear"
        )
    if t.global_batch % t.micro_batch:
        raise JobSpecError(
            f"{where}: train.global_batch: {t.global_batch} is not a multiple of "
            f"train.micro_batch ({t.micro_batch})"
        )
    init = job.model.init_from
    if init is not None and (not init.startswith("hf:") or not init[3:].strip()):
        raise JobSpecError(f"{where}: model.init_from: {init!r} must be hf:DIR")
    if init is not None and job.model.experts:
        raise JobSpecError(
            f"{where}: model.init_from: a Hugging Face GPT-2 model is dense; model.experts "
            f"is {job.model.experts}"
        )
    _check_dir(where, "output_dir", job.output_dir)
    _check_dir(where, "checkpoint.dir", job.checkpoint.dir)
    key_file = job.checkpoint.key_file
    if key_file is not None and (not isinstance(key_file, str) or not key_file.strip()):
        raise JobSpecError(f"{where}: checkpoint.key_file: {key_file!r} is not a path")
    if job.command is None and t.dtype == "float16":
        # The trainer refused it only once running: every round failed, on every node.
        raise JobSpecError(
            f"{where}: train.dtype: float16 needs loss scaling, which the built-in trainer "
            "does not do; use bfloat16 or float32 (or a command of your own)"
        )
    if job.rendezvous.ttl < 1:
        # Checked by the rendezvous only once running: every agent's runner crash-looped.
        raise JobSpecError(
            f"{where}: rendezvous.ttl: {job.rendezvous.ttl:g} must be at least 1 (leases "
            "are granted in whole seconds)"
        )
    if job.data.source == "file" and not job.data.path:
        raise JobSpecError(f"{where}: data.path: required when data.source is 'file'")
    if job.data.source == "synthetic" and job.data.path:
        raise JobSpecError(f"{where}: data.path: only used when data.source is 'file'")
    smallest = n.min * job.nproc_per_node
    try:
        plan_world(smallest, p, global_batch=t.global_batch, micro_batch=t.micro_batch)
    except LayoutError as exc:
        raise JobSpecError(f"{where}: nodes.min: {exc}") from exc


def parse_job(raw: Any, where: str = "job.yaml") -> JobSpec:
    """Validate plain data (from YAML or JSON) into a :class:`JobSpec`."""
    if not isinstance(raw, Mapping):
        raise JobSpecError(f"{where}: top level: expected a mapping of job settings")
    raw = dict(raw)
    version = raw.pop("version", VERSION)
    if version != VERSION:
        raise JobSpecError(
            f"{where}: version: {version!r} is not supported (this is version {VERSION})"
        )
    job = _build(JobSpec, raw, "", where)
    _check(job, where)
    return job


def set_override(raw: dict[str, Any], assignment: str, where: str = "--set") -> None:
    """Apply one ``key.sub=value`` to plain job data in place; the value is read as YAML."""
    key, sep, text = assignment.partition("=")
    if not sep or not key or any(not part for part in key.split(".")):
        raise JobSpecError(f"{where}: {assignment!r} is not of the form key.sub=value")
    try:
        value = yaml.safe_load(text) if text else None
    except yaml.YAMLError as exc:
        raise JobSpecError(f"{where}: {key}: value {text!r} is not valid YAML") from exc
    *parents, leaf = key.split(".")
    node = raw
    for part in parents:
        child = node.setdefault(part, {})
        if not isinstance(child, dict):
            raise JobSpecError(f"{where}: {key}: {part} is not a section")
        node = child
    node[leaf] = value


def load_raw(path: str | os.PathLike[str]) -> dict[str, Any]:
    """Read a job file as plain data, with one-line errors for unreadable or bad YAML."""
    where = os.path.basename(str(path))
    try:
        text = Path(path).read_text(encoding="utf-8")
    except OSError as exc:
        raise JobSpecError(f"{path}: cannot read: {exc.strerror or exc}") from exc
    except UnicodeDecodeError as exc:
        raise JobSpecError(f"{where}: not UTF-8 text (byte {exc.start})") from None
    try:
        raw = yaml.safe_load(text)
    except RecursionError:
        raise JobSpecError(f"{where}: nested too deeply") from None
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        at = f" at line {mark.line + 1}" if mark is not None else ""
        problem = getattr(exc, "problem", None) or "invalid YAML"
        raise JobSpecError(f"{where}: not valid YAML{at}: {problem}") from exc
    if raw is None:
        raise JobSpecError(f"{where}: the file is empty")
    if not isinstance(raw, dict):
        raise JobSpecError(f"{where}: top level: expected a mapping of job settings")
    return raw


def load_job(path: str | os.PathLike[str], overrides: Sequence[str] = ()) -> JobSpec:
    """Read, override (``--set``) and validate a job file."""
    raw = load_raw(path)
    for assignment in overrides:
        set_override(raw, assignment)
    return parse_job(raw, where=os.path.basename(str(path)))


def run_logs_dir(out_dir: str, run_id: str) -> str:
    """``<out_dir>/logs/<run_id>``: each run (submission) of a job logs apart, so a re-run's
    round 1 is not appended to an earlier run's, nor an earlier run's last round taken for
    the latest. Under it: ``round-<r>/rank-<n>.log`` and ``warm/<node>/<name>.log``."""
    return os.path.join(out_dir, "logs", run_id)
