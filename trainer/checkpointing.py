"""The trainer's side of the checkpoint store: what a resume needs, by global name.

- Parameters: the fp32 **main** parameters (``Trainer.named_main``: the model's own in an
  fp32 run; the optimizer's fp32 copies in a bf16 run, so a bf16 run resumes exactly; this
  rank's rows with ``parallel.zero: 1``), each under its global name and box (vocabulary
  padding rows excluded), saved as model tensors. After loading, the model is rebuilt
  from them (``Trainer.main_to_model``).
- AdamW: ``exp_avg/<name>`` and ``exp_avg_sq/<name>`` sharded exactly like the main
  parameter, and ``step/<name>`` (AdamW's per-parameter step count, a 0-d tensor), so all
  of it reshards the same way, across any dp and across ``parallel.zero`` 0 and 1.
- Position: ``step`` and ``consumed_samples`` (the global data position).
- RNG: each rank's generator states as rank tensors. They cannot map to another layout, so
  on resume they are restored only when the layout is unchanged; otherwise each rank
  reseeds with :func:`reseed_value` (seed, step, data-parallel index). See
  docs/checkpoint-format.md.

Checkpoints go through a gloo group of the active ranks made for the store alone (its
writer thread runs collectives on it while training uses the other groups).

Commits are fenced by round: under the agent, the worker's run and round
(``TORCHELASTIC_RUN_ID``, ``ELASTICD_ROUND``) go to the store as a ``Fence``, and a save
from a world that is no longer current raises ``FencedError`` instead of committing.
Under plain torchrun (no ``ELASTICD_ROUND``) commits are not fenced.
"""

from __future__ import annotations

import json
import logging
import math
import os
from collections.abc import Callable, Mapping
from typing import Any

import torch
import torch.distributed as dist

from checkpoint import Fence, SaveOptions, Saver, ShardInfo, committed_steps, load_latest
from checkpoint.errors import CorruptCheckpointError
from trainer.errors import TrainerConfigError
from trainer.errors import brief as _brief
from trainer.parallel import comm

log = logging.getLogger("trainer.checkpointing")

RESEED_STRIDE = 1_000_003


def _env_int(env: Mapping[str, str], name: str) -> int | None:
    """``env[name]`` as a number >= 0, or None when unset or not one (the claim then
    treats this process as of no known place in its run: a held lock refuses it)."""
    raw = env.get(name, "")
    return int(raw) if raw.isascii() and raw.isdigit() else None


def fence_from_env(env: Mapping[str, str]) -> Fence | None:
    """The fence of this worker's commits: its run and round, as the agent set them.

    None without ``ELASTICD_ROUND`` (plain torchrun, or a process alone): nobody outside the
    workers advances a fence there, so commits are not fenced. A round without a run id
    gets the empty run id, which a fence file written by an agent never names, so such a
    writer is refused wherever a fence exists rather than let through."""
    raw = env.get("ELASTICD_ROUND", "")
    if not raw:
        return None
    try:
        round_ = int(raw)
        if round_ < 0:
            raise ValueError
    except ValueError:
        raise TrainerConfigError(f"ELASTICD_ROUND: {raw!r} is not a round number") from None
    return Fence(run_id=env.get("TORCHELASTIC_RUN_ID", ""), round=round_)


def round_still_current(ckpt_dir: str, env: Mapping[str, str]) -> Callable[[], str | None] | None:
    """For ``MetricsWriter(current=...)``: a check that returns None while this worker's
    round (:func:`fence_from_env`) is the one the checkpoint fence names, else why not.
    None without a fence (plain torchrun). Unlike a commit, a record is written when the
    fence cannot be read: only a fence that names another round stops it."""
    from checkpoint.fence import fence_path, read_fence

    fence = fence_from_env(env)
    if fence is None:
        return None

    def current() -> str | None:
        try:
            now = read_fence(ckpt_dir)
        except Exception:  # unreadable: metrics are no commit, and are not lost for it
            return None
        if now is None or now == fence:
            return None
        return (f"this is {fence.describe()}, but {fence_path(ckpt_dir)} names "
                f"{now.describe()} (the world moved on without this node)")  # fmt: skip

    return current


def checkpoint_extra(job) -> dict[str, Any]:
    """The trainer's ``extra`` in a manifest: the seed, the job's ``train.lr`` (to say a
    changed one on resume) and the model settings (for ``ckpt export --format hf``)."""
    from trainer.hf import model_record

    return {"seed": job.train.seed, "train_lr": job.train.lr, "model": model_record(job.model)}


def reseed_value(seed: int, step: int, dp_rank: int) -> int:
    """The generator seed of a rank resuming at ``step`` in a layout other than the saved one.

    Keyed by the data-parallel index, not the global rank, as the seed at start is
    (``train.seed + dp index``): the ranks of one tensor-parallel group hold the same
    replicated activations, so their dropout masks must be drawn identically, or the
    replicas (LayerNorms, biases, the residual stream) silently drift apart."""
    return seed + RESEED_STRIDE * step + dp_rank


def read_job_key(path: str | None) -> bytes | None:
    """The key of ``checkpoint.key_file`` (None when unset); a file that is missing, open to
    others or too short is the job's error (TrainerConfigError, one line)."""
    if path is None:
        return None
    from checkpoint.seal import KeyFileError, read_key

    try:
        return read_key(path)
    except KeyFileError as exc:
        raise TrainerConfigError(f"checkpoint.key_file: {exc}") from None


class Checkpointing:
    """Resume at start, save every ``checkpoint.every`` steps and after the last one."""

    def __init__(
        self,
        trainer,
        *,
        rank: int,
        group: dist.ProcessGroup | None,
        env: Mapping[str, str] | None = None,
    ) -> None:
        """``env``: where the commit fence comes from (:func:`fence_from_env`); the process
        environment by default."""
        self.trainer = trainer
        self.job = trainer.job
        self.rank = rank
        self.group = group
        self.dir = self.job.ckpt_dir
        cfg = self.job.checkpoint
        self.key = read_job_key(cfg.key_file)
        """The seal key (``checkpoint.key_file``), or None: checkpoints unsealed."""
        self.saver = Saver(
            self.dir,
            group=group,
            options=SaveOptions(
                async_=cfg.async_,
                # The snapshot's copies overlap the next step's forward and backward; the
                # trainer waits for them before its optimizer step (wait_snapshot).
                overlap_snapshot=cfg.async_,
                keep=cfg.keep,
                job=self.job.name,
                fence=fence_from_env(os.environ if env is None else env),
                key=self.key,
            ),
        )
        self.last_saved: int | None = None
        self.layout = json.loads(json.dumps(trainer.layout.to_dict()))
        self.claim = None

    @classmethod
    def create(
        cls,
        trainer,
        *,
        group: dist.ProcessGroup | None = None,
        env: Mapping[str, str] | None = None,
    ) -> Checkpointing:
        """``group``: a gloo group over the active ranks used by nothing else
        (``ProcessGroups.side("checkpoint")``). Without one, a world with no spares makes it
        here (every rank must then call this). ``env``: as for the constructor."""
        if group is not None or not dist.is_initialized():
            rank = dist.get_rank() if dist.is_initialized() else 0
            made = cls(trainer, rank=rank, group=group, env=env)
        else:
            layout = trainer.layout
            if layout.active != dist.get_world_size():
                raise RuntimeError(
                    "a world with spare ranks needs the checkpoint group passed in "
                    "(ProcessGroups.side('checkpoint')), built by every rank"
                )
            group = dist.new_group(list(range(layout.active)), backend="gloo")
            made = cls(trainer, rank=dist.get_rank(), group=group, env=env)
        made.start(os.environ if env is None else env)
        return made

    def start(self, env: Mapping[str, str]) -> None:
        """At job start, before anything is loaded or saved (collective over the group):
        rank 0 claims the checkpoint directory for this job (``checkpoint.owner``: another
        job's directory, or one locked by another run, is refused), then every rank looks
        for a probe file rank 0 wrote there, so that a directory that is not shared by all
        nodes stops the job here, in one line, rather than at the first save."""
        from checkpoint import CheckpointError, OwnershipError, store
        from checkpoint.comm import broadcast_json, group_rank
        from checkpoint.owner import claim
        from checkpoint.shared import blind_ranks

        error = ""
        if group_rank(self.group) == 0:
            try:
                self.claim = claim(
                    self.dir,
                    job=self.job.name,
                    run_id=env.get("TORCHELASTIC_RUN_ID", ""),
                    newest_job=lambda: store.newest_job(self.dir, self.key),
                    warn=log.warning,
                    round_=_env_int(env, "ELASTICD_ROUND"),
                    restart=_env_int(env, "TORCHELASTIC_RESTART_COUNT"),
                )
            except (OwnershipError, OSError) as exc:
                error = str(exc)
        if dist.is_initialized():
            error = broadcast_json(error, self.group)
        if error:
            raise TrainerConfigError(f"checkpoint.dir: {error}")
        try:
            blind, probe = blind_ranks(self.dir, self.group)
        except CheckpointError as exc:  # every rank: rank 0 could not write the probe
            raise TrainerConfigError(f"checkpoint.dir: {exc}") from None
        if blind:
            raise TrainerConfigError(
                f"checkpoint.dir: {self.dir} is not one directory shared by every node: "
                f"rank(s) {', '.join(map(str, blind))} do not see the file {probe} that "
                "rank 0 wrote there; it must be storage shared by all nodes"
            )

    def release(self) -> None:
        """Free the claim on the checkpoint directory (process exit frees it too)."""
        if self.claim is not None:
            self.claim.release()
            self.claim = None

    # -- what is saved --------------------------------------------------------------------

    def _model(self) -> dict[str, tuple[torch.Tensor, ShardInfo]]:
        return model_tensors(self.trainer)

    def _optimizer(self, *, create: bool) -> dict[str, tuple[torch.Tensor, ShardInfo]]:
        return optimizer_tensors(self.trainer, create=create)

    def _rank_state(self) -> dict[str, torch.Tensor]:
        out = {"rng/cpu": torch.get_rng_state()}
        if torch.cuda.is_available() and self.trainer.device.type == "cuda":
            out["rng/cuda"] = torch.cuda.get_rng_state(self.trainer.device)
        return out

    # -- resume -----------------------------------------------------------------------------

    def resume(self) -> bool:
        """Load the latest committed checkpoint, resharded to this layout, if there is one.
        Without one (or with ``--fresh``), start from ``model.init_from`` if it is set."""
        if not self.job.checkpoint.resume or not self._everyone_sees_a_checkpoint():
            self.trainer.initialize()  # built with init=False: nothing to load, so drawn now
            init = self.job.model.init_from
            if init is not None:
                from trainer.hf import init_from_hf

                said = (lambda m: print(f"warning: {m}", flush=True)) if self.rank == 0 else None
                init_from_hf(self.trainer, init.removeprefix("hf:"), warn=said)
                self.trainer.main.from_model()
                if self.rank == 0:
                    print(f"initialised from Hugging Face GPT-2 at {init[3:]}", flush=True)
            return False
        ckpt = load_latest(
            self.dir,
            model=self._model(),
            optimizer=self._optimizer(create=True),
            group=self.group,
            broadcast=self.job.checkpoint.load_broadcast,
            # Read (and checked) while the step is chosen: corrupted bytes there fall
            # back to an older step, as a corrupted parameter does.
            rank_tensors=self._rng_to_read,
            key=self.key,
            job=self.job.name,
        )
        try:
            self._resume_from(ckpt)
        finally:
            ckpt.close()
        return True

    def _schedule_lr(self, step: Any) -> float | None:
        """The lr this job's schedule gives the step that made checkpoint ``step`` (its
        0-based ``step - 1``), or None for a step that is not a positive integer (checked
        as such just after)."""
        from trainer.optim import lr_at

        if not _is_int(step) or not 0 < step < MAX_STEP:
            return None
        t = self.job.train
        return lr_at(step - 1, lr=t.lr, warmup=t.warmup, schedule=t.lr_schedule,
                     min_lr=t.min_lr, steps=t.steps)  # fmt: skip

    def _resume_from(self, ckpt) -> None:
        """Restore what a loaded checkpoint holds besides the tensors (checked first)."""
        self.trainer.main_to_model()
        state = self.trainer.state
        same_layout = ckpt.manifest.layout == self.layout
        # Everything below is checked before any of it is used; a bad value stops the
        # resume (no fall back to an older step: docs/checkpoint-format.md, RNG).
        error = ""
        try:
            check_position(ckpt)
            check_same_model(ckpt, self.job.model)
            rng = self._saved_rng(ckpt) if same_layout else {}
            restore = plan_param_groups(
                self.trainer.optimizer,
                ckpt.manifest.optimizer.get("param_groups")
                if isinstance(ckpt.manifest.optimizer, dict)
                else None,
                job_lr=self.job.train.lr,
                saved_lr=ckpt.manifest.extra.get("train_lr", None)
                if isinstance(ckpt.manifest.extra, dict)
                else None,
                schedule_lr=self._schedule_lr(ckpt.manifest.step),
                where=ckpt.path,
            )
        except CorruptCheckpointError as exc:
            error = str(exc)
        self._agree(error, ckpt.path)
        state.step = ckpt.manifest.step
        state.consumed_samples = ckpt.manifest.consumed_samples
        if same_layout:
            try:
                torch.set_rng_state(rng["rng/cpu"])
                if "rng/cuda" in rng:
                    torch.cuda.set_rng_state(rng["rng/cuda"], self.trainer.device)
            except RuntimeError as exc:
                raise CorruptCheckpointError(
                    f"{ckpt.path}: rank {self.rank}'s saved RNG state is refused by torch "
                    f"({_brief(str(exc).splitlines()[0] if str(exc) else '')})"
                ) from None
        else:
            seed = reseed_value(self.job.train.seed, state.step, self.trainer.batches.dp_rank)
            torch.manual_seed(seed)
        self.last_saved = state.step
        changed = restore()
        if self.rank == 0:
            how = "RNG restored" if same_layout else "layout changed, RNG reseeded"
            done = ""
            if state.step >= self.job.train.steps:
                done = (
                    f"; train.steps is {self.job.train.steps}, so nothing is left to train "
                    "(--fresh starts over)"
                )
            received = ""
            if ckpt.stats.bytes_received:
                received = f", received {ckpt.stats.bytes_received / 1e6:.1f} MB from replicas"
            print(
                f"resumed from {ckpt.path} at step {state.step} "
                f"(consumed_samples {state.consumed_samples}; {how}; "
                f"read {ckpt.stats.bytes_read / 1e6:.1f} MB{received} in "
                f"{ckpt.stats.seconds:.2f} s){done}",
                flush=True,
            )
            if changed:
                print(f"optimizer changed since step {state.step}: {changed}", flush=True)

    def _rng_to_read(self, manifest) -> list[str]:
        """The saved generator states this rank restores from a step: its own, when the
        step's layout is this one (else they are reseeded, and not read at all), and only
        entries shaped like one (a 1-D uint8 rank tensor of at most 1 MiB: anything else
        is refused by :meth:`_saved_rng` from the manifest, before a byte is read)."""
        if manifest.layout != self.layout:
            return []
        keys = ["rng/cpu"]
        if torch.cuda.is_available() and self.trainer.device.type == "cuda":
            keys.append("rng/cuda")
        out = []
        for key in keys:
            entry = manifest.tensors.get(f"rank/{self.rank}/{key}")
            if (
                entry is not None
                and entry.kind == "rank"
                and entry.dtype == torch.uint8
                and len(entry.shape) == 1
                and entry.shape[0] <= 1 << 20
            ):
                out.append(f"rank/{self.rank}/{key}")
        return out

    def _saved_rng(self, ckpt) -> dict[str, torch.Tensor]:
        """This rank's saved generator states, checked: ``rng/cpu`` present, a 1-D uint8
        tensor of the size of torch's CPU generator state; ``rng/cuda`` likewise against
        this device's (used only on a CUDA device). Checked on the manifest before any byte
        is read. Raises CorruptCheckpointError."""
        where = f"{ckpt.path}: rank {self.rank}'s RNG state"
        want = {"rng/cpu": torch.get_rng_state().numel()}
        if torch.cuda.is_available() and self.trainer.device.type == "cuda":
            want["rng/cuda"] = torch.cuda.get_rng_state(self.trainer.device).numel()
        out = {}
        for key, numel in want.items():
            entry = ckpt.manifest.tensors.get(f"rank/{self.rank}/{key}")
            if entry is None:
                if key == "rng/cuda":
                    continue  # saved on a CPU device: the CUDA generator keeps its seed
                raise CorruptCheckpointError(f"{where}: has no {key} (the layout is unchanged)")
            if entry.kind != "rank" or entry.dtype != torch.uint8 or tuple(entry.shape) != (numel,):
                raise CorruptCheckpointError(
                    f"{where}: {key} is a {entry.kind} {entry.dtype} tensor of shape "
                    f"{list(entry.shape)}, torch's generator needs uint8 [{numel}]"
                )
            name = f"rank/{self.rank}/{key}"
            t = ckpt.rank_tensors[name] if name in ckpt.rank_tensors else ckpt.read(name)
            if t.dtype != torch.uint8 or tuple(t.shape) != (numel,):
                raise CorruptCheckpointError(
                    f"{where}: {key} read back as {t.dtype} {list(t.shape)}"
                )
            # torch checks more than the size (an all-zero Mersenne Twister state is
            # refused): try it on a generator of our own, before the ranks agree, so that
            # every rank stops together instead of this one alone after the agreement.
            try:
                device = "cpu" if key == "rng/cpu" else self.trainer.device
                torch.Generator(device=device).set_state(t)
            except RuntimeError as exc:
                first = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
                raise CorruptCheckpointError(
                    f"{where}: {key} is refused by torch's generator ({_brief(first)})"
                ) from None
            out[key] = t.contiguous()
        return out

    def _agree(self, error: str, where: str) -> None:
        """Raise on every rank if any rank refused its saved state, so no rank trains on
        while another has stopped: one all-reduce of a flag, and only when it is set an
        all-gather of the messages, so that every rank's one line is the first refusal
        (which names its rank). Both wait through ``wait_collective``."""
        if dist.is_initialized():
            flag = torch.tensor([1 if error else 0], dtype=torch.int64)
            comm.all_reduce(flag, self.group, op=dist.ReduceOp.MAX)
            if int(flag[0]):
                error = _first_error(error, self.group) or (
                    f"{where}: another rank refused its saved state (see its error)"
                )
        if error:
            raise CorruptCheckpointError(error)

    def _everyone_sees_a_checkpoint(self) -> bool:
        """Whether there is a committed checkpoint, agreed by every active rank.

        Each rank looks for itself; if some ranks see one and others do not, the directory is
        not shared storage, and loading on some ranks only would leave them waiting in a
        collective for its whole timeout. That is a configuration error, said at once."""
        mine = 1 if committed_steps(self.dir) else 0
        if not dist.is_initialized():
            return bool(mine)
        seen = torch.tensor([mine, -mine], dtype=torch.int64)
        comm.all_reduce(seen, self.group, op=dist.ReduceOp.MAX)
        anyone, everyone = int(seen[0]), -int(seen[1])
        if anyone != everyone:
            raise TrainerConfigError(
                f"checkpoint.dir: {self.dir} holds committed checkpoints on some ranks but not "
                "on others; it must be storage shared by all nodes"
            )
        return bool(everyone)

    # -- save ---------------------------------------------------------------------------------

    def after_step(self) -> None:
        """Surface a failed background save; save when the cadence or the last step says so."""
        self.saver.check()
        step = self.trainer.state.step
        every = self.job.checkpoint.every
        if (every > 0 and step % every == 0) or step >= self.job.train.steps:
            self.save()

    def save(self) -> None:
        state = self.trainer.state
        if self.last_saved == state.step:
            return
        if not self.trainer.initialized:  # a bug, never a user's error: zeros never commit
            raise RuntimeError("a checkpoint save of a trainer whose state was never loaded, "
                               "received or initialised")  # fmt: skip
        if self.claim is not None:
            # A claim made while this run's previous round still held the lock takes it
            # over once that process has gone: the directory is not left unlocked.
            self.claim.retake()
        opt = self.trainer.optimizer
        scalars: dict[str, Any] = {
            "type": type(opt).__name__,
            "param_groups": [
                {k: v for k, v in g.items() if k != "params" and _jsonable(v)}
                for g in opt.param_groups
            ],
        }
        self.saver.save(
            step=state.step,
            consumed_samples=state.consumed_samples,
            model=self._model(),
            optimizer=self._optimizer(create=False),
            rank_state=self._rank_state(),
            scalars=scalars,
            extra=checkpoint_extra(self.job),
            layout=self.layout,
        )
        self.last_saved = state.step

    def wait_snapshot(self) -> None:
        """Return once the saved tensors may change: the trainer calls it before every
        optimizer step (the last save's background copies, CPU or GPU, are done)."""
        self.saver.wait_snapshot()

    def finish(self) -> None:
        """Save the final step if not saved yet, and wait until it is committed."""
        try:
            if self.trainer.state.step > 0:
                self.save()
            self.saver.close()
        finally:
            self.release()

    def abandon(self) -> None:
        """On an error path: stop without waiting on peers that may be gone."""
        self.saver.abandon()
        self.release()


# Set by the job each step or at start, not state to bring back: lr follows the schedule
# of train.lr; weight_decay is train.weight_decay (group 0) or 0 (group 1).
_JOB_OWNED = ("lr", "initial_lr", "weight_decay")
# How this process computes (trainer.optim.AdamW sets them for its device), not state.
_PROCESS_OWNED = ("foreach", "fused", "capturable", "differentiable")
# What changes the math and has no state saved for it (amsgrad's max_exp_avg_sq) or would
# train the wrong way (maximize): must equal this run's, else the resume is refused.
_MUST_MATCH = ("amsgrad", "maximize", "decoupled_weight_decay")
# Restored from the checkpoint (after the checks of _check_value).
_RESTORED = ("betas", "eps")
MAX_STEP = 1 << 62
"""Steps and consumed samples at or above this are refused (no real run gets near it)."""


MODEL_KEPT = ("layers", "hidden", "heads", "ffn_hidden", "vocab", "seq_len", "experts",
              "top_k", "tie_embeddings")  # fmt: skip
"""Model settings a resume must keep: the parameters, or what they compute, depend on
them. (``dropout`` may change between runs; ``init_from`` matters only without a
checkpoint.)"""


def check_same_model(ckpt, model_cfg) -> None:
    """Refuse a resume into another model than the checkpoint's (``extra["model"]``, where
    it is recorded): one line naming each setting that differs. Fewer layers, or tied
    embeddings where the checkpoint has an output layer, loaded without a word before
    (only the tensors the model asks for are read), and the next saves left the rest out
    for good; other heads trained on the same tensors, computing something else. Raises
    CorruptCheckpointError (exit 2, as any resume that cannot go on)."""
    saved = ckpt.manifest.extra.get("model") if isinstance(ckpt.manifest.extra, dict) else None
    if not isinstance(saved, dict):
        return  # an older trainer's checkpoint: the tensors' own checks stand
    changed = [
        f"{k} {_brief(saved[k])} -> {_brief(getattr(model_cfg, k))}"
        for k in MODEL_KEPT
        if k in saved and saved[k] != getattr(model_cfg, k)
        and not (k in ("experts", "top_k") and not saved.get("experts") and not model_cfg.experts)
    ]  # fmt: skip
    if changed:
        raise CorruptCheckpointError(
            f"{ckpt.path}: the checkpoint's model is not the job's ({', '.join(changed)}); "
            "resume with the model it was trained with, or start over (--fresh, or "
            "another output_dir)"
        )


def check_position(ckpt) -> None:
    """The manifest's ``step`` and ``consumed_samples``: integers (not booleans) in
    ``[0, 2^62)``. (That ``step`` is the one its directory is named for, every open of a
    step checks: ``checkpoint.step.CheckpointFiles.open``.) Raises CorruptCheckpointError."""
    m = ckpt.manifest
    for key in ("step", "consumed_samples"):
        value = getattr(m, key)
        if not _is_int(value) or not 0 <= value < MAX_STEP:
            raise CorruptCheckpointError(
                f"{ckpt.path}: manifest {key} {_brief(value)} is not an integer in [0, 2^62)"
            )


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_real(value: Any) -> bool:
    """A finite number that converts to a float (an integer of 400 digits does not)."""
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        return False
    try:
        return math.isfinite(float(value))
    except OverflowError:
        return False


ERROR_BYTES = 1024
"""The most bytes of a rank's refusal that :func:`_first_error` passes to the others."""


def _first_error(error: str, group) -> str:
    """The first non-empty ``error`` of the ranks of ``group`` (a collective)."""
    mine = torch.zeros(ERROR_BYTES, dtype=torch.uint8)
    data = error.encode("utf-8", "replace")[:ERROR_BYTES]
    if data:
        mine[: len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    out = torch.empty(ERROR_BYTES * dist.get_world_size(group), dtype=torch.uint8)
    comm.all_gather_single(out, mine, group)
    for row in out.view(-1, ERROR_BYTES):
        text = bytes(row.numpy()).rstrip(b"\0").decode("utf-8", "replace")
        if text:
            return text
    return ""


def _check_value(key: str, value: Any, now: Any, where: str) -> None:
    """Refuse a saved hyperparameter of the wrong type or range (CorruptCheckpointError)."""
    bad = ""
    if key in ("lr", "initial_lr", "weight_decay", "eps"):
        if not _is_real(value) or value < 0:
            bad = "is not a finite number >= 0"
    elif key == "betas":
        if (
            not isinstance(value, (list, tuple))
            or len(value) != 2
            or not all(_is_real(b) and 0 <= b < 1 for b in value)
        ):
            bad = "is not two numbers in [0, 1)"
    elif key in _PROCESS_OWNED:
        if value is not None and not isinstance(value, bool):
            bad = "is not a boolean or null"
    elif key in _MUST_MATCH or isinstance(now, bool):
        if value != now or not isinstance(value, bool):
            bad = f"differs from this run's {now!r}; a resume cannot change it"
    elif key not in _RESTORED:
        if value != (list(now) if isinstance(now, tuple) else now):
            bad = f"differs from this run's {_brief(now)}; a resume cannot change it"
    if bad:
        raise CorruptCheckpointError(f"{where}: optimizer param_groups {key} {_brief(value)} {bad}")


def restore_param_groups(
    optimizer: torch.optim.Optimizer,
    saved: Any,
    *,
    job_lr: float,
    saved_lr: Any = None,
    where: str = "checkpoint",
) -> str:
    """Check and put back the saved hyperparameters: :func:`plan_param_groups`, applied."""
    return plan_param_groups(optimizer, saved, job_lr=job_lr, saved_lr=saved_lr, where=where)()


def plan_param_groups(
    optimizer: torch.optim.Optimizer,
    saved: Any,
    *,
    job_lr: float,
    saved_lr: Any = None,
    schedule_lr: float | None = None,
    where: str = "checkpoint",
) -> Callable[[], str]:
    """Check the saved optimizer hyperparameters (``param_groups`` without ``params``)
    against ``optimizer`` and return what puts them back into it and says what changed, in
    one clause per change ("" when nothing). Nothing is changed before it is called; a bad
    value raises CorruptCheckpointError (one line) here.

    The job's own settings win over the checkpoint's: ``train.lr`` (compared with the
    ``train_lr`` the checkpoint was saved under) and ``train.weight_decay``. ``betas`` and
    ``eps`` come back from the checkpoint; a value that differs from this run's is named.
    ``amsgrad``, ``maximize`` (any boolean) and any other key this run's groups hold must
    equal this run's. How this process computes (``foreach``, ``fused``, ...) is neither
    restored nor named. Keys this run's groups do not hold are ignored (another torch)."""
    if saved is None:
        return lambda: ""  # saved by a trainer that did not record them
    if saved_lr is not None and (not _is_real(saved_lr) or saved_lr < 0):
        raise CorruptCheckpointError(
            f"{where}: extra train_lr {_brief(saved_lr)} is not a finite number >= 0"
        )
    if not isinstance(saved, list) or not all(isinstance(g, dict) for g in saved):
        raise CorruptCheckpointError(
            f"{where}: optimizer param_groups {_brief(saved)} is not a list of groups"
        )
    groups = optimizer.param_groups
    for old in saved:
        for key, value in old.items():
            if key == "params":
                continue
            if key not in groups[0]:
                continue
            now = groups[0][key]
            known = (*_JOB_OWNED, *_RESTORED, *_PROCESS_OWNED, *_MUST_MATCH)
            if key in known or isinstance(now, bool):
                _check_value(key, value, now, where)
    notes = []
    if saved_lr is not None and float(saved_lr) != float(job_lr):
        notes.append(f"train.lr {saved_lr:g} -> {job_lr:g} (the job's is used)")
    elif schedule_lr is not None and saved and _is_real(saved[0].get("lr")):
        # The step saved ran at the saved lr; the job's schedule (lr_schedule, warmup,
        # min_lr, steps: none recorded) gives that same step another one.
        was = float(saved[0]["lr"])
        if abs(was - schedule_lr) > 1e-9 * max(abs(was), abs(schedule_lr), 1e-12):
            notes.append(
                f"lr of the step saved {was:g} (checkpoint) vs {schedule_lr:g} by this job's "
                "schedule (train.lr_schedule, warmup, min_lr or steps changed): the job's "
                "schedule is used"
            )
    if len(saved) != len(groups):
        notes.append(
            f"{len(saved)} parameter groups saved, {len(groups)} now (hyperparameters not restored)"
        )
        text = "; ".join(notes)
        return lambda: text
    for group, old in zip(groups, saved, strict=True):
        for key, value in old.items():
            if key in _MUST_MATCH or key in _PROCESS_OWNED or key == "params" or key not in group:
                continue
            if key not in _RESTORED and key not in _JOB_OWNED:
                _check_value(key, value, group[key], where)  # against this group's own

    def restore() -> str:
        differ: dict[str, tuple[Any, Any]] = {}
        for group, old in zip(groups, saved, strict=True):
            for key, value in old.items():
                if key not in group or key not in (*_RESTORED, "weight_decay"):
                    continue
                now = group[key]
                if isinstance(now, tuple):
                    value = tuple(float(v) for v in value)
                elif isinstance(value, int):  # JSON's 10**30 is an int: torch's step takes a float
                    value = float(value)
                if value == now:
                    continue
                differ.setdefault(key, (value, now))
                if key in _RESTORED:
                    group[key] = value
        out = list(notes)
        for key, (old, now) in differ.items():
            used = "the job's is used" if key in _JOB_OWNED else "the checkpoint's is used"
            out.append(f"{key} {_show(old)} (checkpoint) vs {_show(now)} (this run): {used}")
        return "; ".join(out)

    return restore


def _show(value: Any) -> str:
    if isinstance(value, (list, tuple)):
        return "(" + ", ".join(_show(v) for v in value) + ")"
    return f"{value:g}" if isinstance(value, float) else str(value)


def _jsonable(value: Any) -> bool:
    try:
        json.dumps(value)
    except (TypeError, ValueError):
        return False
    return True


def model_tensors(trainer) -> dict[str, tuple[torch.Tensor, ShardInfo]]:
    """A trainer's fp32 main parameters by global name, as checkpoints (and in-process
    recovery) name them: the model's parameters in an fp32 run, the optimizer's fp32
    copies (or this rank's rows of them) otherwise."""
    return {name: (t.detach(), info) for name, t, info in trainer.named_main()}


def optimizer_tensors(trainer, *, create: bool) -> dict[str, tuple[torch.Tensor, ShardInfo]]:
    """A trainer's AdamW tensors by global name; ``create`` makes the state AdamW's first
    step would (zeros) where it does not exist yet."""
    opt = trainer.optimizer
    out = {}
    for name, t, info in trainer.named_main():
        state = opt.state[t]
        if create and not state:
            # What AdamW's first step would create; the load then overwrites it.
            state["step"] = torch.tensor(0.0)
            state["exp_avg"] = torch.zeros_like(t, memory_format=torch.preserve_format)
            state["exp_avg_sq"] = torch.zeros_like(t, memory_format=torch.preserve_format)
        if not state:
            continue
        out[f"exp_avg/{name}"] = (state["exp_avg"], info)
        out[f"exp_avg_sq/{name}"] = (state["exp_avg_sq"], info)
        out[f"step/{name}"] = (state["step"], ShardInfo.whole(f"step/{name}", ()))
    return out
