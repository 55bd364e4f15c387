"""Fencing by round: a save from a world that is no longer the job's current one never
commits, and leaves what the current world committed untouched.

Real files throughout; where ranks matter, real gloo processes. The "frozen node" is a
saver whose round is older than the one ``fence.json`` names: its fence moved on while it
was away, which is all the store can see of a SIGSTOP/SIGCONT.
"""

from __future__ import annotations

import glob
import hashlib
import json
import os
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from polling import wait_for

from checkpoint import (
    Fence,
    FencedError,
    SaveOptions,
    Saver,
    ShardInfo,
    committed_steps,
    load_latest,
    read_fence,
    read_latest,
    write_fence,
)
from checkpoint.fence import FENCE_FILE, check_fence
from checkpoint.store import commit_step, leftovers, load_order, remove_leftovers, step_path

RUN = "tiny-0a1b2c3d"
ROWS, COLS = 8, 16


def state(rank: int, world: int, step: int):
    model, optim = {}, {}
    for i in range(3):
        info = ShardInfo.split(f"w{i}", (ROWS, COLS), 0, rank, world)
        model[info.name] = (torch.full(info.sizes, float(step * 100 + i)), info)
        optim[f"exp_avg/{info.name}"] = (torch.full(info.sizes, float(-step)), info)
    return model, optim


def commit(ckpt: str, step: int, fence: Fence | None) -> None:
    """One process commits ``step`` as ``fence`` (the current world, in these tests)."""
    saver = Saver(ckpt, group=None, options=SaveOptions(async_=False, fence=fence))
    model, optim = state(0, 1, step)
    saver.save(step=step, consumed_samples=step, model=model, optimizer=optim)
    saver.close()


def committed_bytes(ckpt: str) -> dict[str, bytes]:
    """Every committed file and `latest`, by relative path: what must stay untouched."""
    out = {}
    for step in committed_steps(ckpt):
        d = Path(step_path(ckpt, step))
        out.update({str(p.relative_to(ckpt)): p.read_bytes() for p in d.iterdir()})
    latest = Path(ckpt, "latest")
    if latest.exists():
        out["latest"] = latest.read_bytes()
    return out


# -- ranks ---------------------------------------------------------------------------------


def _saver_worker(rank, world, store, ckpt, fence, step, async_, move_fence_to, out):
    """Save ``step`` as ``fence``; with ``move_fence_to``, rank 1 first waits until rank 0
    has started the save (its directory exists, so its first fence check passed), then
    writes the newer fence as a newer world's agent would, then joins the save."""
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    group = dist.new_group(backend="gloo")
    result: dict = {"rank": rank}
    try:
        options = SaveOptions(async_=async_, fence=Fence(**fence), chunk_min_bytes=256)
        saver = Saver(ckpt, group=group, options=options)
        if move_fence_to is not None and rank == 1:
            wait_for(lambda: glob.glob(f"{step_path(ckpt, step)}.*.tmp"), timeout=60, interval=0.01)
            write_fence(ckpt, Fence(**move_fence_to))
        model, optim = state(rank, world, step)
        where = "save"
        try:
            saver.save(step=step, consumed_samples=step, model=model, optimizer=optim)
            where = "wait"
            saver.wait()
            result["committed"] = True
        except FencedError as exc:
            result.update(fenced=str(exc), raised_in=where, writer=exc.writer.to_dict(),
                          current=exc.current.to_dict())  # fmt: skip
        saver.close()
    finally:
        dist.destroy_process_group()
    Path(out, f"rank-{rank}.json").write_text(json.dumps(result))


def save_on_ranks(tmp: Path, ckpt: str, *, fence: Fence, step: int, async_: bool = True,
                  move_fence_to: Fence | None = None, world: int = 2) -> list[dict]:  # fmt: skip
    out = tmp / f"out-{os.urandom(4).hex()}"
    out.mkdir()
    store = tmp / f"store-{os.urandom(4).hex()}"
    moved = move_fence_to.to_dict() if move_fence_to is not None else None
    mp.spawn(_saver_worker, args=(world, str(store), ckpt, fence.to_dict(), step, async_, moved,
                                  str(out)), nprocs=world, join=True)  # fmt: skip
    return [json.loads((out / f"rank-{r}.json").read_text()) for r in range(world)]


def test_a_commit_from_the_current_round_succeeds_on_every_rank(tmp_path):
    ckpt = str(tmp_path / "ckpt")
    write_fence(ckpt, Fence(run_id=RUN, round=4))
    results = save_on_ranks(tmp_path, ckpt, fence=Fence(run_id=RUN, round=4), step=6)
    assert all(r.get("committed") for r in results), results
    assert committed_steps(ckpt) == [6] and read_latest(ckpt) == 6
    model, optim = state(0, 1, 0)
    assert load_latest(ckpt, model=model, optimizer=optim).step == 6
    assert torch.all(model["w2"][0] == 602)
    # The commit carries its writer's round, for anyone who reads it afterwards.
    manifest = json.loads(Path(step_path(ckpt, 6), "manifest.json").read_text())
    assert manifest["writer"] == {"run_id": RUN, "round": 4}


def test_a_save_from_an_older_round_is_refused_on_every_rank_and_the_newer_commit_stays(
    tmp_path,
):
    """The newer world (round 5) committed step 10; the thawed one (round 4) saves the same
    step, the worst case: it would replace it."""
    ckpt = str(tmp_path / "ckpt")
    write_fence(ckpt, Fence(run_id=RUN, round=5))
    commit(ckpt, 10, Fence(run_id=RUN, round=5))
    before = committed_bytes(ckpt)
    results = save_on_ranks(tmp_path, ckpt, fence=Fence(run_id=RUN, round=4), step=10)
    for r in results:
        assert r["raised_in"] == "save", r  # refused before it touched the directory
        assert "round 4 of run tiny-0a1b2c3d" in r["fenced"], r
        assert "round 5 of run tiny-0a1b2c3d" in r["fenced"], r
        assert r["writer"]["round"] == 4 and r["current"]["round"] == 5
    assert committed_bytes(ckpt) == before
    assert committed_steps(ckpt) == [10] and read_latest(ckpt) == 10
    assert leftovers(ckpt) == []


@pytest.mark.parametrize("async_", [True, False], ids=["async", "sync"])
def test_a_fence_that_moves_on_during_a_save_refuses_its_commit_on_every_rank(tmp_path, async_):
    """Round 4 starts saving step 12; a newer world's agent writes round 5 before the commit.
    The async save is refused in its background commit, and says so at wait()."""
    ckpt = str(tmp_path / "ckpt")
    write_fence(ckpt, Fence(run_id=RUN, round=4))
    commit(ckpt, 6, Fence(run_id=RUN, round=4))
    before = committed_bytes(ckpt)
    results = save_on_ranks(tmp_path, ckpt, fence=Fence(run_id=RUN, round=4), step=12,
                            async_=async_, move_fence_to=Fence(run_id=RUN, round=5))  # fmt: skip
    for r in results:
        assert r["raised_in"] == ("wait" if async_ else "save"), r
        assert r["fenced"].startswith("checkpoint step 12 was not committed: fenced: "), r
        assert "round 4 of run" in r["fenced"] and "round 5 of run" in r["fenced"], r
    assert committed_bytes(ckpt) == before
    assert committed_steps(ckpt) == [6] and read_latest(ckpt) == 6
    assert leftovers(ckpt) == []  # it removed its own directory


# -- one process ---------------------------------------------------------------------------


def test_a_save_from_another_run_of_the_job_is_refused(tmp_path):
    ckpt = str(tmp_path / "ckpt")
    write_fence(ckpt, Fence(run_id="tiny-ffffffff", round=0))
    with pytest.raises(FencedError) as err:
        commit(ckpt, 3, Fence(run_id=RUN, round=7))
    assert "round 7 of run tiny-0a1b2c3d" in str(err.value)
    assert "round 0 of run tiny-ffffffff" in str(err.value)
    assert committed_steps(ckpt) == [] and read_latest(ckpt) is None and leftovers(ckpt) == []


def test_without_a_fence_file_commits_are_not_fenced(tmp_path):
    ckpt = str(tmp_path / "ckpt")
    commit(ckpt, 3, Fence(run_id=RUN, round=7))
    assert read_latest(ckpt) == 3 and read_fence(ckpt) is None
    commit(ckpt, 4, None)  # an unfenced writer's manifest names none
    assert "writer" not in json.loads(Path(step_path(ckpt, 4), "manifest.json").read_text())


def test_a_saver_without_a_fence_commits_whatever_the_fence_file_says(tmp_path):
    """Plain torchrun: the worker has no round, so its commits are not fenced."""
    ckpt = str(tmp_path / "ckpt")
    write_fence(ckpt, Fence(run_id=RUN, round=9))
    commit(ckpt, 3, None)
    assert read_latest(ckpt) == 3


def test_an_unreadable_fence_file_refuses_the_commit_rather_than_pass_it(tmp_path):
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    (ckpt / FENCE_FILE).write_text('{"run_id": "tiny-0a1b2c3d"}')
    with pytest.raises(FencedError, match="cannot read the fence"):
        commit(str(ckpt), 3, Fence(run_id=RUN, round=1))
    assert committed_steps(str(ckpt)) == []


# -- the commit sequence, with the fence check injected -------------------------------------


def fake_step(path: str, who: str) -> None:
    os.makedirs(path)
    Path(path, "manifest.json").write_text(who)


def sealed(step: int, commit: int) -> str:
    """A manifest the store reads a commit number from: its step, and sealed (a number in
    one that is not counts for nothing)."""
    raw = {"step": step, "commit": commit}
    canon = json.dumps(raw, sort_keys=True, separators=(",", ":")).encode()
    return json.dumps({**raw, "checksum": hashlib.sha256(canon).hexdigest()})


def refuse_at(call: int):
    """A fence check that passes ``call - 1`` times, then refuses (the writer froze there
    and thawed in a newer world)."""
    calls = []

    def check(what: str) -> None:
        calls.append(what)
        if len(calls) >= call:
            raise FencedError(f"{what}: fenced")

    return check, calls


def test_a_writer_fenced_after_its_rename_keeps_its_step_and_never_switches_latest(tmp_path):
    ckpt = str(tmp_path)
    for step in (2, 4, 6):
        fake_step(step_path(ckpt, step), "current world")
    Path(ckpt, "latest").write_text("step-000000006\n")
    fake_step(step_path(ckpt, 12) + ".t.tmp", "stale")
    check, calls = refuse_at(2)
    with pytest.raises(FencedError, match="renamed into place, `latest` not switched"):
        commit_step(ckpt, step=12, tmp=step_path(ckpt, 12) + ".t.tmp", token="t", keep=1,
                    check=check)  # fmt: skip
    assert len(calls) == 2
    assert read_latest(ckpt) == 6
    # Its step stays, complete, for the current world's retention; nothing was pruned.
    assert committed_steps(ckpt) == [2, 4, 6, 12]


def test_a_stale_step_left_in_place_after_its_rename_never_outranks_the_current_worlds(
    tmp_path,
):
    ckpt = str(tmp_path)
    for n, step in enumerate((2, 4, 6), start=1):
        fake_step(step_path(ckpt, step), sealed(step, n))
    fake_step(step_path(ckpt, 12) + ".t.tmp", sealed(12, 4))
    check, _ = refuse_at(2)
    with pytest.raises(FencedError):
        commit_step(ckpt, step=12, tmp=step_path(ckpt, 12) + ".t.tmp", token="t", keep=1,
                    check=check, commit=4)  # fmt: skip
    # Its commit number is the highest, but it is recorded as not to be loaded first.
    assert committed_steps(ckpt) == [2, 4, 6, 12]
    assert load_order(ckpt) == [6, 4, 2, 12]


def test_a_writer_fenced_after_its_rename_puts_back_the_committed_step_it_displaced(tmp_path):
    ckpt = str(tmp_path)
    fake_step(step_path(ckpt, 4), "current world")
    fake_step(step_path(ckpt, 12), "current world")
    Path(ckpt, "latest").write_text("step-000000012\n")
    fake_step(step_path(ckpt, 12) + ".t.tmp", "stale")
    check, _ = refuse_at(2)
    with pytest.raises(FencedError, match="the step it displaced is put back"):
        commit_step(ckpt, step=12, tmp=step_path(ckpt, 12) + ".t.tmp", token="t", keep=1,
                    check=check)  # fmt: skip
    assert Path(step_path(ckpt, 12), "manifest.json").read_text() == "current world"
    assert committed_steps(ckpt) == [4, 12] and read_latest(ckpt) == 12
    assert leftovers(ckpt) == [step_path(ckpt, 12) + ".t.fenced.tmp"]


@pytest.mark.parametrize("replacing", [False, True])
def test_a_writer_fenced_only_before_its_deletes_keeps_an_ordinary_commit(tmp_path, replacing):
    """The check after the rename passed, so the step was committed by the current round;
    the writer froze before its deletes and thawed in a newer world. Its step stays an
    ordinary commit (an in-process chaos soak lost one: it was marked unloadable, and
    retention deleted it first), `latest` names it, and nothing is pruned."""
    ckpt = str(tmp_path)
    for n, step in enumerate((2, 4, 6), start=1):
        fake_step(step_path(ckpt, step), sealed(step, n))
    if replacing:
        fake_step(step_path(ckpt, 12), sealed(12, 3))
    fake_step(step_path(ckpt, 12) + ".t.tmp", sealed(12, 5))
    check, calls = refuse_at(3)
    with pytest.raises(FencedError, match="was committed, nothing pruned"):
        commit_step(ckpt, step=12, tmp=step_path(ckpt, 12) + ".t.tmp", token="t", keep=1,
                    check=check, commit=5)  # fmt: skip
    assert len(calls) == 3
    assert Path(step_path(ckpt, 12), "manifest.json").read_text() == sealed(12, 5)
    assert committed_steps(ckpt) == [2, 4, 6, 12] and read_latest(ckpt) == 12
    assert load_order(ckpt)[0] == 12
    assert leftovers(ckpt) == []  # our own copy moved aside is gone, replaced by our commit


def test_a_writer_refused_at_the_commit_point_touches_nothing(tmp_path):
    ckpt = str(tmp_path)
    fake_step(step_path(ckpt, 12), "current world")
    Path(ckpt, "latest").write_text("step-000000012\n")
    fake_step(step_path(ckpt, 12) + ".t.tmp", "stale")
    before = committed_bytes(ckpt)
    check, _ = refuse_at(1)
    with pytest.raises(FencedError, match="checkpoint step 12 was not committed"):
        commit_step(ckpt, step=12, tmp=step_path(ckpt, 12) + ".t.tmp", token="t", keep=1,
                    check=check)  # fmt: skip
    assert committed_bytes(ckpt) == before


def test_a_stale_writer_whose_save_was_cleaned_away_puts_back_the_step_it_moved_aside(tmp_path):
    """A writer frozen after its check at the commit point, whose ``.tmp`` the current
    world's clean-up deleted meanwhile, thaws: it moves the current world's step aside,
    then its own rename fails. The step goes back, and the fence says why it stopped."""
    ckpt = str(tmp_path)
    fake_step(step_path(ckpt, 4), "current world")
    fake_step(step_path(ckpt, 6), "current world")
    Path(ckpt, "latest").write_text("step-000000006\n")
    check, _ = refuse_at(2)  # the first check passed before the freeze
    with pytest.raises(FencedError, match=r"not committed \(the step it displaced is put back"):
        commit_step(ckpt, step=6, tmp=step_path(ckpt, 6) + ".gone.tmp", token="t", keep=3,
                    check=check)  # fmt: skip
    assert Path(step_path(ckpt, 6), "manifest.json").read_text() == "current world"
    assert committed_steps(ckpt) == [4, 6] and load_order(ckpt) == [6, 4]
    assert leftovers(ckpt) == []
    # Not fenced (an I/O error on its own rename): the original error, the step back too.
    with pytest.raises(FileNotFoundError):
        commit_step(ckpt, step=6, tmp=step_path(ckpt, 6) + ".gone.tmp", token="t", keep=3,
                    check=lambda what: None)  # fmt: skip
    assert Path(step_path(ckpt, 6), "manifest.json").read_text() == "current world"


def test_a_clean_up_never_deletes_a_step_moved_aside_after_it_looked(tmp_path, monkeypatch):
    """``remove_leftovers`` puts back what was moved aside, then deletes leftovers; a step
    moved aside in between (a stale writer's commit racing it) is put back, not deleted."""
    from checkpoint import store

    ckpt = str(tmp_path)
    fake_step(step_path(ckpt, 6), "current world")
    fake_step(step_path(ckpt, 8) + ".dead.tmp", "a save that died")
    first = store.recover_replaced

    def racing(d):  # the first look finds nothing; the move aside happens right after
        monkeypatch.setattr(store, "recover_replaced", first)
        os.replace(step_path(d, 6), step_path(d, 6) + ".beef.replaced.tmp")
        return []

    monkeypatch.setattr(store, "recover_replaced", racing)
    assert remove_leftovers(ckpt) == [step_path(ckpt, 8) + ".dead.tmp"]
    assert Path(step_path(ckpt, 6), "manifest.json").read_text() == "current world"
    assert committed_steps(ckpt) == [6] and leftovers(ckpt) == []
    # What cannot be put back (a symlink planted under such a name, a directory without
    # a manifest) is a leftover like any other, not kept for ever.
    os.symlink(ckpt, step_path(ckpt, 9) + ".beef.replaced.tmp")
    os.makedirs(step_path(ckpt, 10) + ".beef.replaced.tmp")
    assert len(remove_leftovers(ckpt)) == 2 and leftovers(ckpt) == []


# -- the fence file ---------------------------------------------------------------------------


def test_the_fence_file_is_the_documented_json(tmp_path):
    ckpt = str(tmp_path)
    assert write_fence(ckpt, Fence(run_id=RUN, round=3))
    assert json.loads(Path(ckpt, FENCE_FILE).read_text()) == {"run_id": RUN, "round": 3}
    assert read_fence(ckpt) == Fence(run_id=RUN, round=3)
    check_fence(ckpt, Fence(run_id=RUN, round=3))
    with pytest.raises(FencedError):
        check_fence(ckpt, Fence(run_id=RUN, round=4))  # a newer writer than the file, too


def test_a_fence_never_moves_back_within_a_run_but_a_new_run_replaces_it(tmp_path):
    ckpt = str(tmp_path)
    write_fence(ckpt, Fence(run_id=RUN, round=5))
    assert not write_fence(ckpt, Fence(run_id=RUN, round=4))
    assert read_fence(ckpt) == Fence(run_id=RUN, round=5)
    assert write_fence(ckpt, Fence(run_id="tiny-99999999", round=0))
    assert read_fence(ckpt) == Fence(run_id="tiny-99999999", round=0)


def test_cleaning_up_unfinished_saves_leaves_a_fence_being_written_alone(tmp_path):
    ckpt = str(tmp_path)
    agent_tmp = Path(ckpt, f"{FENCE_FILE}.node-b.4242.tmp")
    agent_tmp.write_text("{}")
    fake_step(step_path(ckpt, 3) + ".t.tmp", "unfinished")
    assert remove_leftovers(ckpt) == [step_path(ckpt, 3) + ".t.tmp"]
    assert agent_tmp.exists()


def test_a_metrics_writer_of_a_round_the_fence_left_behind_writes_nothing(tmp_path):
    """A rank 0 frozen in a step and thawed after the world moved on: its record would
    follow the newer round's (a step trained again appearing twice). Once the checkpoint
    fence names another round it writes nothing, from then on, and says so once; an
    unreadable fence stops no record (metrics are no commit)."""
    from checkpoint import Fence
    from checkpoint.fence import write_fence
    from elasticd.jobspec import parse_job
    from elasticd.layout import plan
    from trainer.checkpointing import round_still_current
    from trainer.train import MetricsWriter, StepResult

    ckpt = str(tmp_path / "ckpt")
    os.makedirs(ckpt)
    env = {"ELASTICD_ROUND": "4", "TORCHELASTIC_RUN_ID": "job-1a2b3c4d"}
    assert round_still_current(ckpt, {}) is None  # plain torchrun: nothing to check
    current = round_still_current(ckpt, env)
    assert current() is None  # no fence file yet
    write_fence(ckpt, Fence(run_id="job-1a2b3c4d", round=4))
    assert current() is None
    said: list[str] = []
    path = str(tmp_path / "metrics.jsonl")
    layout = plan(1, parse_job({"name": "m"}))
    writer = MetricsWriter(path=path, layout=layout, round_=4, total_steps=9, echo=said.append,
                           once=True, current=current)  # fmt: skip

    def result(step: int) -> StepResult:
        return StepResult(step=step, loss=1.0, grad_norm=1.0, lr=1e-3, step_s=0.1,
                          tokens_per_s=1.0, mfu=None, mem_gb=0.1)  # fmt: skip

    writer.write(result(1))
    with open(os.path.join(ckpt, "fence.json"), "w") as fh:
        fh.write("not json")  # unreadable: written anyway
    writer.write(result(2))
    write_fence(ckpt, Fence(run_id="job-1a2b3c4d", round=5))  # the world moved on
    writer.write(result(3))
    write_fence(ckpt, Fence(run_id="job-1a2b3c4d", round=4))  # (never happens) still stale
    writer.write(result(4))
    steps = [json.loads(line)["step"] for line in Path(path).read_text().splitlines()]
    assert steps == [1, 2]
    stale = [s for s in said if "record not written" in s]
    assert stale == [
        "step 3's record not written: this is round 4 of run job-1a2b3c4d, but "
        f"{os.path.join(ckpt, 'fence.json')} names round 5 of run job-1a2b3c4d "
        "(the world moved on without this node)"
    ]
