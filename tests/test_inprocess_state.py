"""``elasticd.inprocess.state_tensors`` and ``Context.sync_state`` with the optimizers,
schedulers and modules of real scripts, on three gloo processes: ranks 0 and 1 train three
steps alike, rank 2 is a newcomer built from another seed; after the sync every rank
trains two more steps, and the newcomer must end bit for bit where the holders do.

Found by a review: ``state_tensors`` made up AdamW's state for every optimizer before its
first step, so SGD's momentum never reached a newcomer (which then diverged in silence),
Adam with ``amsgrad`` failed its first step, a learning rate set by a scheduler stayed
behind, a parameter outside the model was named by ``id()`` (different in every process),
a module's non-tensor extra state failed the sync, and Parameters given to ``sync_state``
as they are refused the in-place write.
"""

from __future__ import annotations

import json
import os
from collections import namedtuple
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import elasticd.inprocess as ei

CASES = ["sgd-momentum", "adam-amsgrad", "adamw-scheduler-scaler", "rmsprop-extra-param",
         "int-lr-two-optimizers", "parameters-as-given", "generator", "lazy-state-refused",
         "not-a-tensor-refused", "shape-per-rank-refused", "contents-per-rank-refused",
         "dtensor-refused", "first-round-shapes-refused", "sgd-after-the-refusals",
         "batchnorm-buffers", "generator-snapshot"]  # fmt: skip
REFUSED = ("lazy-state-refused", "not-a-tensor-refused", "shape-per-rank-refused",
           "contents-per-rank-refused", "dtensor-refused", "first-round-shapes-refused")  # fmt: skip
FRESH = ("first-round-shapes-refused",)
"""Cases where no rank holds state (the first round): every rank hands over step None."""
"""Cases that fail the sync on every rank alike (the ranks stay in step for the next)."""
Pos = namedtuple("Pos", "epoch batch")


class Position:
    """A script's own object in ``others``: its state dict holds a namedtuple and a number
    past float64's exact integers (an RNG seed)."""

    def __init__(self) -> None:
        self.pos, self.seed = Pos(0, 0), 2**60 + 1

    def step(self) -> None:
        self.pos = Pos(self.pos.epoch + 1, self.pos.batch + 8)
        self.seed += 2

    def state_dict(self) -> dict:
        return {"pos": self.pos, "seed": self.seed}

    def load_state_dict(self, sd: dict) -> None:
        self.pos, self.seed = sd["pos"], sd["seed"]


class Lazy:
    """State made on first use, that a newcomer lacks and no maker can make."""

    def __init__(self) -> None:
        self.buf: dict = {}

    def step(self) -> None:
        self.buf.setdefault("t", torch.zeros(3)).add_(1)

    def state_dict(self) -> dict:
        return {"buf": self.buf}

    def load_state_dict(self, sd: dict) -> None:
        self.buf = sd["buf"]


HELD_STEP = 3


class Noted(torch.nn.Module):
    """A module whose extra state is not a tensor (as TransformerEngine's modules have)."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(6, 1)
        self.note = {"made": "here"}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x)

    def get_extra_state(self) -> dict:
        return self.note

    def set_extra_state(self, state: dict) -> None:
        self.note = state


def _build(case: str, seed: int):
    torch.manual_seed(seed)
    middle = torch.nn.BatchNorm1d(6) if case == "batchnorm-buffers" else torch.nn.Tanh()
    model = torch.nn.Sequential(torch.nn.Linear(4, 6), middle, Noted())
    # A parameter the model does not hold (the same on every rank until it is trained).
    extra = torch.nn.Parameter(torch.randn(6, generator=torch.Generator().manual_seed(7)))
    others: list = []
    params = list(model.parameters())
    if case == "sgd-momentum":
        opt = torch.optim.SGD(params, lr=0.1, momentum=0.9, nesterov=True)
    elif case == "adam-amsgrad":
        opt = torch.optim.Adam(params, lr=0.05, amsgrad=True)
    elif case == "adamw-scheduler-scaler":
        opt = torch.optim.AdamW(params, lr=0.05)
        others = [torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5),
                  torch.amp.GradScaler("cpu", init_scale=8.0, growth_interval=2)]  # fmt: skip
    elif case == "rmsprop-extra-param":
        opt = torch.optim.RMSprop([{"params": params}, {"params": [extra], "lr": 0.02}],
                                  lr=0.01, momentum=0.5, centered=True)  # fmt: skip
    elif case == "int-lr-two-optimizers":
        # An int learning rate (a scheduler makes it a float) and a second optimizer.
        opt = torch.optim.SGD(list(model[0].parameters()), lr=1, momentum=0.5)
        others = [torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5),
                  torch.optim.Adam(list(model[2].parameters()), lr=0.01), Position()]  # fmt: skip
    elif case == "lazy-state-refused":
        opt = torch.optim.SGD(params, lr=0.1)
        others = [Lazy()]
    elif case == "generator":  # a sampler's generator, advanced by every step
        opt = torch.optim.SGD(params, lr=0.1)
        others = [torch.Generator().manual_seed(seed)]
    elif case == "generator-snapshot":  # a dropout's generator, kept at each step's end
        opt = torch.optim.SGD(params, lr=0.1)
        others = [ei.GeneratorSnapshot(torch.Generator().manual_seed(seed))]
    else:
        opt = torch.optim.SGD(params, lr=0.1)
    return model, extra, opt, others


def _step(step: int, model, extra, opt, others) -> None:
    gen = torch.Generator().manual_seed(step)
    x, y = torch.randn(8, 4, generator=gen), torch.randn(8, 1, generator=gen)
    hidden = model[1](model[0](x)) + extra
    loss = torch.nn.functional.mse_loss(model[2](hidden), y)
    opt.zero_grad()
    scaler = next((o for o in others if isinstance(o, torch.amp.GradScaler)), None)
    if scaler is not None:
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
    else:
        loss.backward()
        opt.step()
    for o in others:
        if isinstance(o, torch.Generator):
            torch.randperm(16, generator=o)  # a sampler's shuffle
        elif isinstance(o, ei.GeneratorSnapshot):
            torch.randperm(16, generator=o.generator)  # a dropout's masks
            o.take()  # the step is done
        elif not isinstance(o, torch.amp.GradScaler):  # optimizers, schedulers, ours
            o.step()


def _summary(model, extra, opt, others) -> dict:
    state_keys = sorted({k for st in opt.state.values() for k in st})
    return {
        "params": [p.detach().double().tolist() for p in [*model.parameters(), extra]],
        "lrs": [g["lr"] for g in opt.param_groups],
        "state_keys": state_keys,
        "others": [
            {k: v for k, v in o.state_dict().items() if isinstance(v, (int, float, list, tuple))}
            for o in others
            if not isinstance(o, torch.optim.Optimizer | torch.Generator)
        ],
        "rng": [o.get_state().tolist() for o in others if isinstance(o, torch.Generator)]
        + [o.generator.get_state().tolist() for o in others if isinstance(o, ei.GeneratorSnapshot)],
        "other_opt": [
            sorted({k for st in o.state.values() for k in st})
            for o in others
            if isinstance(o, torch.optim.Optimizer)
        ],
        "types": [
            type(v).__name__
            for o in others
            if isinstance(o, Position)
            for v in o.state_dict().values()
        ],
        "note": model[2].note,
    }


def _worker(rank: int, world: int, store: str, out: str) -> None:
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    ctx = ei.Context(round=1, rank=rank, world_size=world, local_rank=0, env={}, state={})
    results = {}
    for case in CASES:
        holder = rank < 2 and case not in FRESH
        model, extra, opt, others = _build(case, 0 if holder else 1 + rank)
        if holder:
            model[2].note = {"made": "by the holder"}
            for s in range(HELD_STEP):
                _step(s, model, extra, opt, others)
        try:
            if case == "parameters-as-given":  # a plain dict of the Parameters themselves
                tensors = {**dict(model.named_parameters()), "extra": extra}
            else:
                tensors = ei.state_tensors(model, opt, *others)
                if case == "rmsprop-extra-param":
                    assert not any(str(id(extra)) in name for name in tensors)
                if case == "not-a-tensor-refused":  # a count kept as a Python int
                    tensors["extra/count"] = 3
                if case in ("shape-per-rank-refused", "first-round-shapes-refused"):
                    tensors["extra/buf"] = torch.zeros(3 if rank == 0 else 4)
                if case == "contents-per-rank-refused":  # a rank's own shard, handed as whole
                    tensors["extra/shard"] = torch.full((4,), float(rank))
                if case == "generator-snapshot" and holder:  # the interrupted step's draw
                    torch.randperm(16, generator=others[0].generator)
                if case == "batchnorm-buffers" and holder:
                    # Each rank's running statistics follow its own batches between DDP's
                    # broadcasts of rank 0's: the holders' differ, and that is no refusal.
                    model[1].running_mean.add_(float(rank))
                if case == "dtensor-refused":  # FSDP2's parameters are DTensors
                    from torch.distributed.device_mesh import init_device_mesh
                    from torch.distributed.tensor import Shard, distribute_tensor

                    mesh = init_device_mesh("cpu", (world,))
                    tensors["model/sharded"] = distribute_tensor(torch.ones(6, 2), mesh, [Shard(0)])
            step = ctx.sync_state(tensors, step=HELD_STEP if holder else None)
            if case == "parameters-as-given":  # its optimizer holds no state: SGD, no momentum
                assert not opt.state
            for s in range(step, step + 2):
                _step(s, model, extra, opt, others)
            results[case] = {"step": step, **_summary(model, extra, opt, others)}
        except Exception as exc:  # every rank reports; the test names the case
            results[case] = {"error": f"{type(exc).__name__}: {exc}"}
            if case not in REFUSED:
                break  # a failed sync leaves the ranks out of step: no later case is valid
    # What sync_state tells the agent (channel.recovered), in a round of fresh processes
    # that each loaded the step from the script's own checkpoint (a process restart), and
    # in one where rank 0 kept its state from the round before.
    for name, lived in (("fresh", (0, 0, 0)), ("kept", (1, 0, 0))):
        c = ei.Context(round=2, rank=rank, world_size=world, local_rank=0, env={}, state={},
                       rounds_lived=lived[rank])  # fmt: skip
        if name == "fresh" and rank < 2:
            c.channel.recovered(source="checkpoint", resume_step=HELD_STEP)  # it loaded it
        model, extra, opt, others = _build("sgd-momentum", 0)
        step = c.sync_state(ei.state_tensors(model, opt), step=HELD_STEP if rank < 2 else None)
        results[f"recorded-{name}"] = {"step": step, "recovery": c.channel._last.get("recovery")}
    dist.destroy_process_group()
    Path(out, f"rank-{rank}.json").write_text(json.dumps(results))
    # Done and written. The interpreter's teardown after these gloo syncs aborted now and
    # then ("terminate called without an active exception": a C++ thread destroyed
    # unjoined, in 2 of 6 runs here and once on CI; not found): it is not what this
    # test checks, and without it no run of 10 failed.
    os._exit(0)


@pytest.fixture(scope="module")
def synced(tmp_path_factory) -> list[dict]:
    tmp = tmp_path_factory.mktemp("sync")
    mp.spawn(_worker, args=(3, str(tmp / "store"), str(tmp)), nprocs=3, join=True)
    return [json.loads((tmp / f"rank-{r}.json").read_text()) for r in range(3)]


@pytest.mark.parametrize("case", [c for c in CASES if c not in REFUSED])
def test_a_newcomer_synced_from_the_holders_trains_on_exactly_as_they_do(synced, case):
    holder, other, newcomer = (r.get(case, {"error": "not run: an earlier case failed"})
                               for r in synced)  # fmt: skip
    assert "error" not in newcomer and "error" not in holder, (holder, newcomer)
    assert holder["step"] == newcomer["step"] == HELD_STEP
    assert holder == other
    # Bit for bit: the same state, the same two steps on the same data and the same CPU.
    assert newcomer["params"] == holder["params"]
    assert newcomer["lrs"] == holder["lrs"]
    assert newcomer["others"] == holder["others"]
    assert newcomer["state_keys"] == holder["state_keys"]
    # Only what the optimizer keeps: no made-up moments beside SGD's momentum.
    if case == "sgd-momentum":
        assert holder["state_keys"] == ["momentum_buffer"]
    if case == "adam-amsgrad":
        assert "max_exp_avg_sq" in holder["state_keys"]
    if case == "adamw-scheduler-scaler":  # the scheduler halved it at each of 5 steps
        assert holder["lrs"] == [0.05 * 0.5**5]
        assert holder["others"][1]["scale"] != 8.0  # the scale moved: it was carried
    if case == "int-lr-two-optimizers":  # 1 -> 0.5 -> ...: carried whatever its type
        assert holder["lrs"] == [0.5**5]
        assert holder["other_opt"] == newcomer["other_opt"] == [["exp_avg", "exp_avg_sq", "step"]]
        # The namedtuple comes back as one, and the int past 2**53 exactly.
        assert newcomer["types"] == ["Pos", "int"]
        assert holder["others"][1]["seed"] == 2**60 + 1 + 2 * 5
    if case == "generator":  # the newcomer's generator (another seed) now draws as theirs
        assert newcomer["rng"] == holder["rng"] and len(holder["rng"]) == 1
    if case == "generator-snapshot":  # as at the held step's end: the half-step's draw gone
        assert newcomer["rng"] == holder["rng"] and len(holder["rng"]) == 1
        gen = torch.Generator().manual_seed(0)
        for _ in range(HELD_STEP + 2):  # an uninterrupted holder: 5 steps, then the 2 after
            torch.randperm(16, generator=gen)
        assert holder["rng"] == [gen.get_state().tolist()]
    # A module's extra state that is not a tensor is left as each rank has it.
    assert newcomer["note"] == {"made": "here"}


def test_state_a_newcomer_lacks_and_nothing_can_make_fails_the_sync_on_every_rank(synced):
    """Made lazily by a script's own object (not an optimizer): the holders have a tensor
    the newcomer cannot be given. Before, it was skipped and the newcomer trained on
    without it; now every rank raises the same error, before any byte moves."""
    errors = [r["lazy-state-refused"].get("error") for r in synced]
    assert errors[0] and len(set(errors)) == 1, errors
    assert "other/0/buf/t" in errors[0] and "cannot be made there" in errors[0]


def test_state_tensors_names_every_rank_alike_and_drops_stale_gradients():
    model, extra, opt, others = _build("rmsprop-extra-param", 0)
    _step(0, model, extra, opt, others)
    (model[0].weight.sum() + extra.sum()).backward()  # a step the fault interrupted
    names = ei.state_tensors(model, opt)
    assert all(p.grad is None for p in [*model.parameters(), extra])
    assert "optim/param_groups/1/params/0/square_avg" in names
    assert names["optim/param_groups/1/params/0"].data_ptr() == extra.data_ptr()
    assert "optim/param_groups/0/lr#n" in names
    assert "model/2._extra_state" not in names
    assert "optim/0.weight/momentum_buffer" in names


def test_a_value_that_is_not_a_tensor_is_refused_on_every_rank_naming_it(synced):
    """Was an AttributeError from deep inside the sync ("'int' object has no attribute
    'shape'"); now a TypeError before any collective, the same on every rank."""
    errors = [r["not-a-tensor-refused"].get("error") for r in synced]
    assert len(set(errors)) == 1, errors
    assert errors[0].startswith("MisuseError: sync_state: 'extra/count' is int, not a tensor")


def test_a_tensor_shaped_differently_per_rank_is_refused_on_every_rank_saying_how(synced):
    """The reason was in rank 0's log only; every rank's error said "could not be agreed"."""
    errors = [r["shape-per-rank-refused"].get("error") for r in synced]
    assert len(set(errors)) == 1, errors
    assert (
        "could not be agreed: extra/buf: rank 0 holds float32 [3], rank 1 holds float32 [4]"
        in (errors[0])
    )


def test_tensors_that_differ_between_ranks_are_refused_in_the_first_round(synced):
    """Nobody holds state (the first round): nothing moves, and before, a rank's buffer of
    another shape was found only at the first recovery, which then fell back. Now the
    same all-reduce that finds the newest step finds the difference, and every rank
    refuses it as the script's error (exit 2 under an agent), naming it."""
    errors = [r["first-round-shapes-refused"].get("error") for r in synced]
    assert len(set(errors)) == 1, errors
    assert errors[0].startswith(
        "MisuseError: sync_state: the ranks hand over different tensors: extra/buf: rank 0 "
        "holds float32 [3], rank 1 holds float32 [4]"
    ), errors[0]


def test_state_each_rank_holds_its_own_of_is_not_given_to_a_newcomer(synced):
    """Each holder's own shard, handed over as a whole tensor (an FSDP script's local
    shards): the newcomer was given rank 0's and trained on with it, the job "succeeded"
    with a lost shard. The holders' digests differ: refused on every rank, saying why."""
    errors = [r["contents-per-rank-refused"].get("error") for r in synced]
    assert len(set(errors)) == 1, errors
    assert "extra/shard differs between rank 0 and rank 1 at step 3" in errors[0], errors[0]
    assert "sharded or per-rank state cannot be synced" in errors[0]


def test_a_dtensor_is_refused_before_any_collective_naming_what_works(synced):
    """A DTensor was taken for a whole tensor: a newcomer's failed deep in the transfer
    ("got mixed torch.Tensor and DTensor"), survivors kept shards of a dead mesh."""
    errors = [r["dtensor-refused"].get("error") for r in synced]
    assert len(set(errors)) == 1, errors
    assert errors[0].startswith("MisuseError: sync_state: 'model/sharded' is a DTensor ("), errors
    assert "on a mesh of 3 ranks), a shard" in errors[0] and "full_state_dict=True" in errors[0]
    # The refusals left the ranks in step: the next sync works (a case after them).
    assert all("error" not in r["sgd-after-the-refusals"] for r in synced), synced


def test_state_tensors_refuses_a_model_of_dtensors(tmp_path):
    """FSDP2's parameters are DTensors: refused where the state is named."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 's'}", rank=0, world_size=1)
    try:
        model = torch.nn.Linear(2, 2)
        mesh = init_device_mesh("cpu", (1,))
        model.weight = torch.nn.Parameter(
            distribute_tensor(model.weight.detach(), mesh, [Shard(0)])
        )
        with pytest.raises(TypeError, match=r"state_tensors: 'model/weight' is a DTensor \("):
            ei.state_tensors(model, None)
    finally:
        dist.destroy_process_group()


def test_an_object_without_a_state_dict_is_refused_in_state_tensors():
    with pytest.raises(TypeError, match="other 0 is object: neither an optimizer"):
        ei.state_tensors(torch.nn.Linear(2, 2), None, object())


def test_the_digest_of_device_tensors_is_computed_in_place_and_tells_contents_apart():
    """On a GPU the holders' digests are computed on the device (integer arithmetic, the
    same everywhere), never from a copy of the state in host memory; checked here on the
    CPU, where the same code runs. Its values never meet a CRC's."""
    from checkpoint.live import digest_on_device

    a = torch.randn(1001, generator=torch.Generator().manual_seed(1))
    b = a.clone()
    b.view(torch.int32)[500] ^= 1  # one bit
    u8 = ei._device_digest
    same = u8(a.view(torch.uint8)), u8(a.clone().view(torch.uint8))
    assert same[0] == same[1] and u8(b.view(torch.uint8)) != same[0]
    assert digest_on_device(same[0]) and not digest_on_device(ei._digest(a))
    assert u8(torch.zeros(0, dtype=torch.uint8)) != u8(torch.zeros(8, dtype=torch.uint8))
    assert ei._digest(a[::2]) == ei._digest(a[::2].contiguous())  # a view, as its values
    # Chunk by chunk (bounded temporaries on a GPU) it is the same digest.
    raw = a.view(torch.uint8)
    assert u8(raw, chunk=16) == u8(raw, chunk=4096) == same[0]
    # A conjugate view is digested as its values.
    c = torch.randn(5, dtype=torch.complex64, generator=torch.Generator().manual_seed(2))
    assert ei._digest(c.conj()) == ei._digest(c.conj().resolve_conj())


def _recover_phase_worker(rank: int, store: str, plan: str, out: str) -> None:
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=0, world_size=1)
    env = {"ELASTICD_FAULT_PLAN": plan, "RANK": "0"}
    ctx = ei.Context(round=2, rank=0, world_size=1, local_rank=0, env=env, state={})
    model = torch.nn.Linear(3, 2)
    said = []
    for step in (None, 4, 7, 9):  # nothing held: no recovery; then three held steps
        try:
            said.append(["returned", ctx.sync_state(ei.state_tensors(model), step=step)])
        except Exception as exc:
            said.append([type(exc).__name__, str(exc)])
    dist.destroy_process_group()
    Path(out).write_text(json.dumps(said))
    os._exit(0)


def test_sync_state_enters_the_recover_fault_phase_at_the_agreed_step(tmp_path):
    """``phase=recover`` faults fire inside ``Context.sync_state`` once the step is agreed,
    before any state moves (a second fault during a recovery, in a user's script): here a
    planned raise-error at step 5 fires in the first sync at step 5 or later (step 7),
    once; a sync of an earlier step does not fire it, and a sync with nothing held
    anywhere (a fresh start) is no recovery and enters no phase."""
    from elasticd.faultplan import write_plan
    from elasticd.localcluster import parse_fault

    plan = write_plan(str(tmp_path / "plan"), [parse_fault("raise-error=0@step=5:phase=recover")])
    out = tmp_path / "said.json"
    mp.spawn(_recover_phase_worker, args=(str(tmp_path / "store"), plan, str(out)),
             nprocs=1, join=True)  # fmt: skip
    said = json.loads(out.read_text())
    assert said[0] == ["returned", None] and said[1] == ["returned", 4], said
    assert said[2][0] == "InjectedFault" and "step 7 recover" in said[2][1], said
    assert said[3] == ["returned", 9], said  # a fault fires once


def test_only_state_kept_from_an_earlier_round_is_recorded_as_from_peers(synced):
    """A script that loads its own checkpoint, says so (channel.recovered(source=
    "checkpoint")) and then hands its state to sync_state: after a process restart every
    process is fresh, and sync_state's "peers" overwrote the script's word, so the agent
    recorded a process restart as an in-process recovery from peers (a new user's trial).
    Now only a rank that kept its state from an earlier round makes it "peers"."""
    fresh = [r["recorded-fresh"] for r in synced]
    assert [r["step"] for r in fresh] == [HELD_STEP] * 3
    want = {"source": "checkpoint", "resume_step": HELD_STEP}
    assert [r["recovery"] for r in fresh] == [want, want, None]  # the script's own word
    kept = [r["recorded-kept"] for r in synced]
    assert [r["step"] for r in kept] == [HELD_STEP] * 3
    want = {"source": "peers", "resume_step": HELD_STEP, "lost_steps": 0}
    assert [r["recovery"] for r in kept] == [want] * 3


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_a_generator_snapshot_puts_back_the_draws_of_the_device_that_computes(device):
    """GeneratorSnapshot() takes torch's default CPU generator and, in a process computing
    on CUDA, the current device's CUDA generator too: dropout on a GPU draws from that one.
    It took the CPU's alone, so a GPU survivor kept the draws of its interrupted step and a
    newcomer its own seed's. On the CPU it takes the CPU's alone (CUDA left untouched)."""
    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    if device == "cuda":
        torch.cuda.init()
    snap = ei.GeneratorSnapshot()
    assert len(snap.generators) == (2 if device == "cuda" else 1)
    taken = snap.state_dict()
    want_cpu, want_dev = torch.rand(4), torch.rand(4, device=device)
    torch.rand(7), torch.rand(7, device=device)  # the interrupted step's draws
    snap.load_state_dict({k: v.clone() for k, v in taken.items()})  # as a peer hands it over
    assert torch.equal(torch.rand(4), want_cpu)
    assert torch.equal(torch.rand(4, device=device), want_dev)


def test_in_process_rounds_on_nccl_override_the_users_error_handling_and_say_so():
    """TORCH_NCCL_ASYNC_ERROR_HANDLING was set only where the user had not: a cluster
    image's 3 (or 1) ended each survivor on its peer's death, and 2 let torch abort a
    communicator before the round was marked ended (garbage check_results passes). It is
    now 0 whatever was given, with a line saying so; the flight recorder's switch stays
    the user's."""
    env = {"TORCH_NCCL_ASYNC_ERROR_HANDLING": "3", "TORCH_NCCL_DUMP_ON_TIMEOUT": "1"}
    (said,) = ei.set_nccl_inprocess_env(env)
    assert env == {"TORCH_NCCL_ASYNC_ERROR_HANDLING": "0", "TORCH_NCCL_DUMP_ON_TIMEOUT": "1"}
    assert said.startswith("TORCH_NCCL_ASYNC_ERROR_HANDLING=3 overridden to 0: "), said
    empty: dict[str, str] = {}
    assert ei.set_nccl_inprocess_env(empty) == [] and empty == ei.NCCL_INPROCESS_ENV
    given = {"TORCH_NCCL_ASYNC_ERROR_HANDLING": " 0"}
    assert ei.set_nccl_inprocess_env(given) == []  # already what it must be
