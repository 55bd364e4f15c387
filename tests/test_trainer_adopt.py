"""A new round's trainer adopting the previous round's memory (in-process recovery): where
a region keeps its box, dtype, shape and device, the new trainer's model parameter, main
parameter and AdamW state *are* the old one's tensors, so a recovery holds one copy of the
state, not two (docs/inprocess.md, "What it costs").

One process here: the adopted trainer trains on exactly as the old one would have (bit
for bit, against a twin never interrupted), allocates no state of its own, and a region
whose box changed is not adopted. The paths under real agents (a data-parallel shrink
adopting everything, a fall back to the checkpoint writing into adopted memory) are in
``tests/test_inprocess.py``; ``test_recovery_adopt`` below runs the real ``agree`` /
``adoption`` / ``recover`` of ``trainer.recovery`` over two gloo processes."""

from __future__ import annotations

import json
import os
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from test_trainer_deferred_init import BASE as DEFERRED_BASE

from checkpoint.shards import ShardInfo
from elasticd.jobspec import parse_job
from elasticd.layout import plan
from trainer.init import Adoption
from trainer.parallel.context import ParallelContext
from trainer.train import Trainer

# The small job of the deferred-init tests (a trainer built with init=False is what adopts),
# with room for the steps these take.
BASE = {**DEFERRED_BASE, "name": "adopt", "train": {**DEFERRED_BASE["train"], "steps": 6}}

SETTINGS = [
    {},
    {"train": {"dtype": "bfloat16"}},
    {"train": {"dtype": "bfloat16"}, "parallel": {"zero": 1}},
    {"model": {"experts": 4, "top_k": 2, "tie_embeddings": True}},
]
IDS = ["fp32", "bf16-main-copies", "bf16-zero1", "moe-tied"]


def _raw(**sections) -> dict:
    raw = json.loads(json.dumps(BASE))
    for section, fields in sections.items():
        raw.setdefault(section, {}).update(fields)
    return raw


def _trainer(raw: dict, *, init: bool = True, adopt: Adoption | None = None) -> Trainer:
    job = parse_job(raw)
    torch.manual_seed(job.train.seed)
    return Trainer(job=job, layout=plan(1, job), ctx=ParallelContext.single(), dp_rank=0,
                   init=init, adopt=adopt)  # fmt: skip


def _state_tensors(t: Trainer) -> list[torch.Tensor]:
    """Every tensor of a trainer's state: model parameters, main parameters, AdamW's."""
    out = list(t.params)
    for _, main, _ in t.named_main():
        out.append(main)
        out += [v for v in t.optimizer.state.get(main, {}).values() if isinstance(v, torch.Tensor)]
    return out


def _storages(tensors) -> set[int]:
    return {x.untyped_storage().data_ptr() for x in tensors if x.numel()}


@pytest.mark.parametrize("sections", SETTINGS, ids=IDS)
def test_an_adopted_trainer_trains_on_bit_for_bit_and_allocates_no_state(sections):
    raw = _raw(**sections)
    twin, old = _trainer(raw), _trainer(raw)
    for _ in range(2):
        a, b = twin.train_step(), old.train_step()
        assert a.loss == b.loss
    old.release_gradients()  # what `trainer.recovery.agree` does to the round that ended
    assert all(s.nbytes == 0 for s in old.grad_syncs)
    new = _trainer(raw, init=False, adopt=old.adoption())
    # Nothing of its state is its own: every tensor is one of the old trainer's.
    assert _storages(_state_tensors(new)) <= _storages(_state_tensors(old))
    expected = sum(x.numel() * x.element_size() for x in {id(x): x for x in _state_tensors(new)
                                                         if x.numel()}.values())  # fmt: skip
    held = {id(x): x for x in _state_tensors(old)}  # an fp32 model's main is its parameter
    assert new.adopted_bytes == sum(x.numel() * x.element_size() for x in held.values()
                                    if x.numel() and x.untyped_storage().data_ptr()
                                    in _storages(_state_tensors(new)))  # fmt: skip
    assert new.adopted_bytes >= expected > 0
    # What recovery does once the state is agreed (here: this rank's own, nothing moves).
    new.state.step, new.state.consumed_samples = old.state.step, old.state.consumed_samples
    new.main_to_model()
    for _ in range(3):
        a, b = twin.train_step(), new.train_step()
        assert (a.loss, a.grad_norm) == (b.loss, b.grad_norm)
    for (name, t, _), (_, u, _) in zip(twin.named_main(), new.named_main(), strict=True):
        assert torch.equal(t, u), name


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_on_a_gpu_the_adopted_state_is_the_old_device_memory_and_the_peak_stays_one_copy():
    """bf16 on the device (fused AdamW, its step counts on the device): the adopted
    trainer's state is the old trainer's device memory, the CUDA allocator's peak during
    the new trainer's build rises by no more than its gradient buckets (which replace the
    old ones, freed first), and it trains on exactly as the old one would have."""
    device = torch.device("cuda", torch.cuda.current_device())
    raw = _raw(train={"dtype": "bfloat16"})

    def build(init: bool = True, adopt: Adoption | None = None) -> Trainer:
        job = parse_job(raw)
        torch.manual_seed(job.train.seed)
        return Trainer(job=job, layout=plan(1, job), ctx=ParallelContext.single(), dp_rank=0,
                       device=device, init=init, adopt=adopt)  # fmt: skip

    twin, old = build(), build()
    for _ in range(2):
        assert twin.train_step().loss == old.train_step().loss
    buckets = sum(s.nbytes for s in old.grad_syncs)
    old.release_gradients()
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    before = torch.cuda.memory_allocated(device)
    new = build(init=False, adopt=old.adoption())
    torch.cuda.synchronize(device)
    assert torch.cuda.max_memory_allocated(device) - before <= buckets + (1 << 20)
    assert all(t.device == device for t in _state_tensors(new))
    assert _storages(_state_tensors(new)) <= _storages(_state_tensors(old))
    new.state.step, new.state.consumed_samples = old.state.step, old.state.consumed_samples
    new.main_to_model()
    for _ in range(2):
        a, b = twin.train_step(), new.train_step()
        assert (a.loss, a.grad_norm) == (b.loss, b.grad_norm)


def test_a_trainer_not_yet_stepped_adopts_its_parameters_and_makes_adamw_state_later():
    raw = _raw(train={"dtype": "bfloat16"})
    old = _trainer(raw)
    new = _trainer(raw, init=False, adopt=old.adoption())
    assert _storages(new.params) == _storages(old.params)
    assert not new.optimizer.state  # nothing to adopt: made at the first step or by recovery
    new.main_to_model()
    assert new.train_step().loss == _trainer(raw).train_step().loss


def test_only_the_same_region_dtype_shape_and_device_is_adopted():
    info = ShardInfo("w", (4, 6), (0, 0), (4, 3))
    pool = Adoption()
    t = torch.ones(4, 3)
    pool.offer("model", info, t)
    other = ShardInfo("w", (4, 6), (0, 3), (4, 3))  # the other half of the same tensor
    assert pool.take("model", other, shape=(4, 3), dtype=torch.float32, device="cpu") is None
    assert pool.take("main", info, shape=(4, 3), dtype=torch.float32, device="cpu") is None
    assert pool.take("model", info, shape=(4, 3), dtype=torch.bfloat16, device="cpu") is None
    assert pool.take("model", info, shape=(3, 4), dtype=torch.float32, device="cpu") is None
    assert pool.take("model", info, shape=(4, 3), dtype=torch.float32, device="meta") is None
    got = pool.take("model", info, shape=(4, 3), dtype=torch.float32, device="cpu")
    assert got is not None and got.data_ptr() == t.data_ptr() and pool.taken_bytes == 48
    assert pool.take("model", info, shape=(4, 3), dtype=torch.float32, device="cpu") is None
    # A region offered twice (two tensors claiming it) is adopted by nobody.
    pool.offer("main", info, torch.ones(4, 3))
    pool.offer("main", info, torch.ones(4, 3))
    assert pool.take("main", info, shape=(4, 3), dtype=torch.float32, device=None) is None
    # Not contiguous: never adopted (a parameter must own plain storage).
    pool.offer("model", other, torch.ones(3, 4).t())
    assert pool.take("model", other, shape=(4, 3), dtype=torch.float32, device=None) is None


def test_adopting_needs_a_trainer_not_drawn():
    raw = _raw()
    with pytest.raises(ValueError, match="init=False"):
        _trainer(raw, init=True, adopt=_trainer(raw).adoption())


# -- two gloo processes: trainer.recovery's agree / adoption / recover --------------------------


class _Ctx:
    """The part of ``elasticd.inprocess.Context`` the recovery reads: rank, state and the
    channel (``agree`` marks ``recovering`` there)."""

    def __init__(self, rank: int) -> None:
        self.rank = rank
        self.state: dict = {}
        self.channel = _Channel()


class _Channel:
    """The worker's channel to its agent, recording what the recovery reports; ``fail``
    makes the report raise, as a fault right after the state is loaded would."""

    def __init__(self, fail: bool = False) -> None:
        self.fail, self.reports = fail, []

    def recovered(self, **kw) -> None:
        if self.fail:
            raise RuntimeError("a second fault")
        self.reports.append(kw)

    def mark(self, name: str) -> None:
        pass

    def phase(self, name: str, step: int) -> None:
        pass


def _ranked_trainer(job, rank: int, *, adopt=None, init: bool = True):
    """``(Trainer, ProcessGroups)`` of ``rank`` in the job's layout for the current world,
    as ``python -m trainer`` builds them (the world already initialised)."""
    from trainer.parallel.groups import ProcessGroups

    layout = plan(dist.get_world_size(), job)
    groups = ProcessGroups.build(layout, rank=rank)
    torch.manual_seed(job.train.seed)
    trainer = Trainer(job=job, layout=layout, ctx=ParallelContext.from_groups(groups),
                      dp_rank=groups.index("dp"), init=init, adopt=adopt)  # fmt: skip
    return trainer, groups


def _recovery_worker(rank: int, world: int, tmp: str, raw: dict, out: str) -> None:
    from trainer.checkpointing import Checkpointing
    from trainer.recovery import adoption, agree, recover

    dist.init_process_group("gloo", init_method=f"file://{tmp}/store", rank=rank,
                            world_size=world, timeout=timedelta(seconds=60))  # fmt: skip
    job = parse_job(raw).with_paths_resolved(tmp)

    def build(adopt=None, init=True):
        return _ranked_trainer(job, rank, adopt=adopt, init=init)

    # Round A: tp2, a checkpoint committed at step 1, then two more steps in memory.
    old, groups = build()
    ckpt = Checkpointing.create(old, group=groups.side("checkpoint"))
    ckpt.resume()
    old.train_step()
    ckpt.after_step()
    ckpt.finish()  # committed, and the directory's claim let go
    old.train_step()
    old.train_step()
    old.close()
    if rank == 1:  # its shard's step is not the newest: no step covers every region
        old.state.step -= 1
    results = {}
    for fail in (True, False):
        ctx = _Ctx(rank)
        ctx.state["trainer"] = old
        agreed = agree(ctx)
        new, groups = build(adoption(ctx, agreed, env={}), init=False)
        kept = new.adopted_bytes
        ckpt = Checkpointing.create(new, group=groups.side("checkpoint"))
        channel = _Channel(fail=fail and rank == 0)
        try:
            source = recover(ctx, new, ckpt, channel=channel, job=job, agreed=agreed)
        except RuntimeError:
            source = "raised"
        ckpt.abandon()  # as a round's end does: the claim on the directory goes
        shared = _storages(_state_tensors(new)) & _storages(_state_tensors(old))
        results["fail" if fail else "ok"] = {
            "newest": agreed.newest, "kept": kept, "source": source, "step": new.state.step,
            "old_offered": ctx.state.get("trainer") is old, "shared": len(shared),
        }  # fmt: skip
        new.close()
        dist.barrier()
    Path(out, f"rank{rank}.json").write_text(json.dumps(results))
    dist.destroy_process_group()


def test_recovery_adopt_falls_back_to_the_checkpoint_and_offers_no_overwritten_memory(tmp_path):
    """tp2, no step at which the two ranks' memory covers every region (rank 1 is a step
    behind, with nothing pending): both fall back to the checkpoint of step 1. Rank 0 held
    the newest step, so its new trainer adopted its memory, and the load writes step 1
    into it: the old trainer must be gone from the state the next round offers *before*
    the load. With a fault right after the load (the report raising) rank 0 still offers
    nothing; without, the round goes on from the checkpoint."""
    raw = _raw(parallel={"tp": 2}, checkpoint={"every": 1})
    raw["nproc_per_node"] = 2
    raw["output_dir"] = str(tmp_path / "job")
    out = tmp_path / "results"
    out.mkdir()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    mp.spawn(_recovery_worker, args=(2, str(tmp_path), raw, str(out)), nprocs=2, join=True)
    r0 = json.loads((out / "rank0.json").read_text())
    r1 = json.loads((out / "rank1.json").read_text())
    for run in ("fail", "ok"):
        assert r0[run]["newest"] == r1[run]["newest"] == 3
        assert r0[run]["kept"] > 0 and r1[run]["kept"] == 0  # only the newest adopts
        assert r0[run]["shared"] > 0 and r1[run]["shared"] == 0
        assert not r0[run]["old_offered"], run  # its memory now holds step 1
        assert not r1[run]["old_offered"], run  # replaced by the round's trainer
    assert r0["fail"]["source"] == "raised" and r1["fail"]["source"] == "checkpoint"
    assert r0["ok"]["source"] == r1["ok"]["source"] == "checkpoint"
    assert r0["ok"]["step"] == r1["ok"]["step"] == 1


class _NoCheckpoint:
    """Stands where the round's Checkpointing would: these recoveries never fall back."""

    last_saved = None

    def resume(self) -> bool:
        raise AssertionError("no fall back to the checkpoint expected")


class _Replicas:
    """What ``ctx.state['replicator']`` offers: ``held()``, the kept snapshots; ``live``,
    as a real one's, reaches the trainer it replicates."""

    def __init__(self, held, live=None) -> None:
        self._held = held
        self.live = live

    def held(self):
        return self._held


def _another_step_worker(rank: int, world: int, tmp: str, raw: dict, out: str) -> None:
    from checkpoint.live import Held
    from trainer.recovery import adoption, agree, holdings, recover

    dist.init_process_group("gloo", init_method=f"file://{tmp}/store", rank=rank,
                            world_size=world, timeout=timedelta(seconds=60))  # fmt: skip
    job = parse_job(raw)

    def build(adopt=None, init=True) -> Trainer:
        return _ranked_trainer(job, rank, adopt=adopt, init=init)[0]

    results = {}
    for fail in (True, False):
        old = build()
        for _ in range(2):
            old.train_step()
        snap = {k: (t.clone(), i) for k, (t, i) in holdings(old, create=True).items()}
        at = (old.state.step, old.state.consumed_samples)
        old.train_step()
        old.close()
        ctx = _Ctx(rank)
        if rank == 1:  # its shard is held at step 2 only: step 3 covers nothing of it
            for key, (t, _) in holdings(old, create=True).items():
                t.copy_(snap[key][0])
            old.state.step, old.state.consumed_samples = at
        else:  # rank 0 holds step 3, and a snapshot of step 2 (a memory replica)
            ctx.state["replicator"] = _Replicas([Held(step=at[0], consumed=at[1], tensors=snap)],
                                                live=lambda t=old: holdings(t, create=True))  # fmt: skip
        ctx.state["trainer"] = old
        agreed = agree(ctx)
        new = build(adoption(ctx, agreed, env={}), init=False)
        kept = new.adopted_bytes
        try:
            source = recover(ctx, new, _NoCheckpoint(), channel=_Channel(fail=fail and rank == 0),
                             job=job, agreed=agreed)  # fmt: skip
        except RuntimeError:
            source = "raised"
        results["fail" if fail else "ok"] = {
            "newest": agreed.newest, "kept": kept, "source": source, "step": new.state.step,
            "old_offered": ctx.state.get("trainer") is old,
            # the previous replicator, kept for the next round's copies, no longer reaches
            # the old trainer either: its memory goes with it
            "old_reached": getattr(ctx.state.get("replicator"), "live", None) is not None,
            "snapshot": all(torch.equal(t, snap[k][0])
                            for k, (t, _) in holdings(new, create=True).items()),
        }  # fmt: skip
        new.close()
        dist.barrier()
    Path(out, f"rank{rank}.json").write_text(json.dumps(results))
    dist.destroy_process_group()


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_adopted_memory_written_at_another_step_is_never_offered_again(tmp_path, dtype):
    """tp2: rank 0 holds step 3 (and a replica snapshot of step 2), rank 1 only step 2, so
    the survivors agree on step 2 from rank 0's snapshot. Rank 0 held the newest step and
    adopted its memory, which the transfer then overwrites with step 2: the old trainer
    must be gone from what the next round offers before that write (``before_write``),
    even when a fault follows the transfer (the report raising). Without the fault the
    round goes on at step 2, every tensor the snapshot's."""
    raw = _raw(parallel={"tp": 2}, train={"dtype": dtype})
    raw["nproc_per_node"] = 2
    out = tmp_path / "results"
    out.mkdir()
    mp.spawn(_another_step_worker, args=(2, str(tmp_path), raw, str(out)), nprocs=2, join=True)
    r0 = json.loads((out / "rank0.json").read_text())
    r1 = json.loads((out / "rank1.json").read_text())
    for run in ("fail", "ok"):
        assert r0[run]["newest"] == r1[run]["newest"] == 3
        assert r0[run]["kept"] > 0 and r1[run]["kept"] == 0
        assert not r0[run]["old_offered"] and not r1[run]["old_offered"], run
        assert not r0[run]["old_reached"], run
        assert r0[run]["step"] == r1[run]["step"] == 2
        assert r0[run]["snapshot"] and r1[run]["snapshot"], run
    assert r0["fail"]["source"] == "raised" and r1["fail"]["source"] == "replica"
    assert r0["ok"]["source"] == r1["ok"]["source"] == "replica"


def _zero_swap_worker(rank: int, world: int, tmp: str, raw: dict, out: str) -> None:
    from trainer.recovery import adoption, agree, recover

    job = parse_job(raw)

    def build(r: int, adopt=None, init=True) -> Trainer:
        return _ranked_trainer(job, r, adopt=adopt, init=init)[0]

    results = {}
    for adopt in (True, False):
        dist.init_process_group("gloo", init_method=f"file://{tmp}/a-{adopt}", rank=rank,
                                world_size=world, timeout=timedelta(seconds=60))  # fmt: skip
        old = build(rank)
        for _ in range(2):
            old.train_step()
        old.close()
        dist.destroy_process_group()
        swapped = world - 1 - rank  # a new round in which every rank takes the other's dp index
        dist.init_process_group("gloo", init_method=f"file://{tmp}/b-{adopt}", rank=swapped,
                                world_size=world, timeout=timedelta(seconds=60))  # fmt: skip
        ctx = _Ctx(swapped)
        ctx.state["trainer"] = old
        agreed = agree(ctx)
        env = {} if adopt else {"ELASTICD_ADOPT": "0"}
        new = build(swapped, adoption(ctx, agreed, env=env), init=False)
        kept = new.adopted_bytes
        source = recover(ctx, new, _NoCheckpoint(), channel=_Channel(), job=job, agreed=agreed)
        losses = [new.train_step().loss for _ in range(3)]
        results[str(adopt)] = {"kept": kept, "source": source, "losses": losses}
        new.close()
        dist.destroy_process_group()
    Path(out, f"rank{rank}.json").write_text(json.dumps(results))


def test_fp32_zero1_ranks_that_swap_rows_adopt_and_train_as_if_they_had_allocated(tmp_path):
    """fp32 with ZeRO-1: each rank's main parameter is a view of its rows of the model
    parameter, and AdamW's state is those rows'. Two ranks swap dp indexes in the new
    round, so each adopts the whole model parameter (the same box) but needs the other's
    rows of main and AdamW state, received into rows of the very storage it adopted while
    it sends its own old rows from it. The steps after are exactly those of the same
    recovery allocating everything (``ELASTICD_ADOPT=0``)."""
    raw = _raw(parallel={"zero": 1}, train={"micro_batch": 1})
    raw["nproc_per_node"] = 2
    out = tmp_path / "results"
    out.mkdir()
    mp.spawn(_zero_swap_worker, args=(2, str(tmp_path), raw, str(out)), nprocs=2, join=True)
    for rank in (0, 1):
        res = json.loads((out / f"rank{rank}.json").read_text())
        assert res["True"]["kept"] > 0 and res["False"]["kept"] == 0
        assert res["True"]["source"] == res["False"]["source"] == "peers"
        assert res["True"]["losses"] == res["False"]["losses"]
