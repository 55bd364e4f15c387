"""Ownership of a checkpoint directory (owner.json and the lock), the shared-storage probe,
and what a re-run of a job says: real files, real flock, real processes."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from checkpoint import OwnershipError, SaveOptions, Saver, ShardInfo
from checkpoint.owner import OWNER_FILE, claim, read_owner
from checkpoint.shared import blind_ranks
from checkpoint.store import newest_job

REPO = Path(__file__).resolve().parents[1]
TINY = REPO / "examples" / "tiny.yaml"


def test_a_second_job_is_refused_and_the_owner_record_names_the_job(tmp_path):
    ckpt = str(tmp_path / "ckpt")
    mine = claim(ckpt, job="tiny", run_id="tiny-1")
    assert read_owner(ckpt) == {"job": "tiny", "run_id": "tiny-1"}
    mine.release()
    with pytest.raises(OwnershipError, match=r"belongs to job 'tiny' .*not 'other'"):
        claim(ckpt, job="other", run_id="other-1")
    # The same job again (a new run) takes it, and the record names the new run.
    claim(ckpt, job="tiny", run_id="tiny-2").release()
    assert read_owner(ckpt) == {"job": "tiny", "run_id": "tiny-2"}


def test_a_directory_from_before_owner_records_belongs_to_the_job_its_manifests_name(tmp_path):
    ckpt = str(tmp_path / "ckpt")
    saver = Saver(ckpt, group=None, options=SaveOptions(async_=False, job="tiny"))
    saver.save(step=1, consumed_samples=1, model={"w": (torch.ones(4), ShardInfo.whole("w", (4,)))})
    saver.close()
    assert not os.path.exists(os.path.join(ckpt, OWNER_FILE)) and newest_job(ckpt) == "tiny"
    with pytest.raises(OwnershipError, match="holds checkpoints of job 'tiny', not 'other'"):
        claim(ckpt, job="other", run_id="", newest_job=lambda: newest_job(ckpt))
    claim(ckpt, job="tiny", run_id="", newest_job=lambda: newest_job(ckpt)).release()


def test_the_lock_refuses_another_run_naming_the_holder_but_lets_the_same_run_in(tmp_path):
    ckpt = str(tmp_path / "ckpt")
    held = claim(ckpt, job="tiny", run_id="tiny-1", round_=3)
    try:
        with pytest.raises(
            OwnershipError, match=rf"in use by run tiny-1 of job tiny \(pid {os.getpid()} on "
        ):
            claim(ckpt, job="tiny", run_id="tiny-2", round_=4)
        with pytest.raises(OwnershipError, match="in use by run tiny-1"):
            claim(ckpt, job="tiny", run_id="", round_=4)
        # A process of the same run (an earlier round's, still exiting) is let in.
        same = claim(ckpt, job="tiny", run_id="tiny-1", round_=4)
        assert same.fd is None and same.pending
        # One of an earlier round is not (a frozen process thawed late), nor one of no
        # known place in the run.
        for late in ({"round_": 2}, {}):
            with pytest.raises(OwnershipError, match="in use by run tiny-1"):
                claim(ckpt, job="tiny", run_id="tiny-1", **late)
    finally:
        held.release()
    # A holder of no known place (a build before places held it: an upgrade mid-run)
    # lets the same run id in, as then.
    held = claim(ckpt, job="tiny", run_id="tiny-1")
    try:
        assert claim(ckpt, job="tiny", run_id="tiny-1", round_=4).pending
    finally:
        held.release()
    claim(ckpt, job="tiny", run_id="tiny-2").release()  # free again once released


def _probe_worker(rank: int, store: str, root: str) -> None:
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2,
                            timeout=timedelta(seconds=60))  # fmt: skip
    results = {}
    for case, dirs in (("shared", ["a", "a"]), ("local", ["a", "b"])):
        blind, name = blind_ranks(os.path.join(root, dirs[rank]), None)
        results[case] = {"blind": blind, "name": name}
    Path(root, f"result.{rank}").write_text(json.dumps(results))
    dist.destroy_process_group()


def test_the_storage_probe_names_the_ranks_that_do_not_share_the_directory(tmp_path):
    for d in ("a", "b"):
        (tmp_path / d).mkdir()
    mp.start_processes(_probe_worker, args=(str(tmp_path / "store"), str(tmp_path)), nprocs=2,
                       start_method="spawn")  # fmt: skip
    results = [json.loads((tmp_path / f"result.{r}").read_text()) for r in range(2)]
    assert results[0] == results[1]  # every rank gets the same answer
    assert results[0]["shared"]["blind"] == [] and results[0]["local"]["blind"] == [1]
    assert os.listdir(tmp_path / "a") == [] and os.listdir(tmp_path / "b") == []  # probes gone


def test_param_groups_come_back_and_a_changed_lr_or_betas_is_said_in_one_clause_each():
    from trainer.checkpointing import restore_param_groups

    params = [torch.nn.Parameter(torch.ones(2, 2)), torch.nn.Parameter(torch.ones(2))]
    saved_opt = torch.optim.AdamW(
        [{"params": params[:1], "weight_decay": 0.1}, {"params": params[1:], "weight_decay": 0.0}],
        lr=3e-3, betas=(0.9, 0.99), eps=1e-6,
    )  # fmt: skip
    saved = [
        {k: list(v) if isinstance(v, tuple) else v for k, v in g.items() if k != "params"}
        for g in saved_opt.param_groups
    ]
    json.dumps(saved)  # what the manifest holds
    opt = torch.optim.AdamW(
        [{"params": params[:1], "weight_decay": 0.1}, {"params": params[1:], "weight_decay": 0.0}],
        lr=1e-3, betas=(0.9, 0.95), eps=1e-8, foreach=True,
    )  # fmt: skip
    note = restore_param_groups(opt, saved, job_lr=1e-3, saved_lr=3e-3)
    assert note == (
        "train.lr 0.003 -> 0.001 (the job's is used); "
        "betas (0.9, 0.99) (checkpoint) vs (0.9, 0.95) (this run): the checkpoint's is used; "
        "eps 1e-06 (checkpoint) vs 1e-08 (this run): the checkpoint's is used"
    )
    assert all(g["betas"] == (0.9, 0.99) and g["eps"] == 1e-6 for g in opt.param_groups)
    assert all(g["lr"] == 1e-3 for g in opt.param_groups)  # the schedule's, not restored
    assert all(g["foreach"] is True for g in opt.param_groups)  # this process's choice
    assert restore_param_groups(opt, saved, job_lr=3e-3, saved_lr=3e-3) == ""
    assert "1 parameter groups saved, 2 now" in restore_param_groups(opt, saved[:1], job_lr=3e-3)


def test_an_integer_eps_in_the_checkpoint_is_restored_as_a_float_and_the_optimizer_steps():
    """JSON has integers: a re-sealed ``eps: 10**30`` passed the checks (a finite number
    >= 0) and was restored as a Python int, on which AdamW's step died with a 50-line
    OverflowError at the first step after every resume. It is restored as the float."""
    from trainer.checkpointing import restore_param_groups

    param = torch.nn.Parameter(torch.ones(2, 2))
    opt = torch.optim.AdamW([param], lr=1e-3, eps=1e-8)
    saved = [{k: list(v) if isinstance(v, tuple) else v for k, v in g.items() if k != "params"}
             for g in opt.param_groups]  # fmt: skip
    saved[0]["eps"] = 10**30
    note = restore_param_groups(opt, saved, job_lr=1e-3, saved_lr=1e-3)
    assert note == "eps 1e+30 (checkpoint) vs 1e-08 (this run): the checkpoint's is used", note
    assert type(opt.param_groups[0]["eps"]) is float
    param.grad = torch.ones(2, 2)
    opt.step()  # raised OverflowError: int too big to convert


def trainer(tmp_path: Path, *extra: str, steps: int = 2) -> subprocess.CompletedProcess:
    env = dict(os.environ, OMP_NUM_THREADS="1")
    args = [sys.executable, "-m", "trainer", str(TINY), "--set", f"output_dir={tmp_path / 'out'}",
            "--set", f"train.steps={steps}", *extra]  # fmt: skip
    return subprocess.run(args, env=env, capture_output=True, text=True, timeout=180,
                          cwd=tmp_path)  # fmt: skip


@pytest.mark.slow  # four trainer processes: about a minute on the 2-core machine
def test_a_rerun_resumes_saying_the_step_another_job_is_refused_and_fresh_starts_over(tmp_path):
    assert trainer(tmp_path).returncode == 0
    again = trainer(tmp_path, "--set", "train.lr=0.001")
    assert again.returncode == 0, again.stderr[-2000:]
    lines = again.stdout.strip().splitlines()
    resumed = [line for line in lines if line.startswith("resumed from")]
    assert len(resumed) == 1 and "at step 2 " in resumed[0], again.stdout
    assert "train.steps is 2, so nothing is left to train (--fresh starts over)" in resumed[0]
    changed = [line for line in lines if line.startswith("optimizer changed since step 2: ")]
    assert len(changed) == 1 and "train.lr 0.003 -> 0.001 (the job's is used)" in changed[0]
    other = trainer(tmp_path, "--set", "name=other")
    assert other.returncode == 2 and "Traceback" not in other.stderr
    err = other.stderr.strip().splitlines()
    assert len(err) == 1 and "belongs to job 'tiny' (owner.json), not 'other'" in err[0], err
    fresh = trainer(tmp_path, "--fresh", steps=1)
    assert fresh.returncode == 0 and "resumed from" not in fresh.stdout
    metrics = (tmp_path / "out" / "metrics.jsonl").read_text().splitlines()
    assert json.loads(metrics[-1])["step"] == 1


def test_ckpt_prune_refuses_a_directory_a_run_is_using_in_one_line(tmp_path, capsys):
    from elasticd.cli import main

    ckpt = str(tmp_path / "ckpt")
    saver = Saver(ckpt, group=None, options=SaveOptions(async_=False, job="tiny"))
    saver.save(step=1, consumed_samples=1, model={"w": (torch.ones(4), ShardInfo.whole("w", (4,)))})
    saver.close()
    held = claim(ckpt, job="tiny", run_id="tiny-7")
    try:
        code = main(["ckpt", "prune", ckpt, "--keep", "1"])
        err = capsys.readouterr().err.strip().splitlines()
        assert code == 2 and len(err) == 1 and "in use by run tiny-7 of job tiny" in err[0], err
    finally:
        held.release()
    assert main(["ckpt", "prune", ckpt, "--keep", "1"]) == 0


def test_runs_whose_id_does_not_tell_them_apart_are_never_the_same_run(tmp_path):
    """Plain torchrun gives every run the id ``none`` (its default --rdzv-id): a second run
    of the job must be refused, not let in as "this run's earlier process"."""
    ckpt = str(tmp_path / "ckpt")
    for anonymous in ("none", ""):
        held = claim(ckpt, job="tiny", run_id=anonymous)
        try:
            with pytest.raises(OwnershipError, match=r"in use by (run none of )?job tiny \(pid"):
                claim(ckpt, job="tiny", run_id=anonymous)
        finally:
            held.release()


def test_a_second_torchrun_launch_sharing_the_run_id_is_refused_and_a_restart_let_in(tmp_path):
    """Two plain torchrun launches given one ``--rdzv-id`` both start at restart 0: the
    second was let in as "the same run", and its clean-up deleted the first's save in
    progress. A restarted worker of the first launch (restart 1) is let in."""
    ckpt = str(tmp_path / "ckpt")
    first = claim(ckpt, job="tiny", run_id="myrun", restart=0)
    try:
        with pytest.raises(OwnershipError, match="in use by run myrun"):
            claim(ckpt, job="tiny", run_id="myrun", restart=0)
        again = claim(ckpt, job="tiny", run_id="myrun", restart=1)
        assert again.fd is None and again.pending
    finally:
        first.release()


def test_a_claim_made_while_its_earlier_round_held_the_lock_takes_it_over_later(tmp_path):
    ckpt = str(tmp_path / "ckpt")
    old_round = claim(ckpt, job="tiny", run_id="tiny-1", round_=1)
    new_round = claim(ckpt, job="tiny", run_id="tiny-1", round_=2)
    assert new_round.fd is None and new_round.pending
    assert not new_round.retake()  # the earlier round's process still holds it
    old_round.release()  # it has gone
    assert new_round.retake() and new_round.fd is not None
    try:
        with pytest.raises(OwnershipError, match=rf"in use by run tiny-1 .*pid {os.getpid()}"):
            claim(ckpt, job="tiny", run_id="tiny-2")  # the directory did not stay unlocked
    finally:
        new_round.release()


def test_a_look_at_the_lock_does_not_turn_a_starting_job_away(tmp_path):
    """``held_by`` (ckpt inspect, prune, submit --fresh) takes the lock shared for a moment;
    a claim in that moment waits for it rather than naming a stale holder."""
    import fcntl
    import threading

    ckpt = str(tmp_path / "ckpt")
    claim(ckpt, job="tiny", run_id="tiny-1").release()  # a run that ended: its record stays
    fd = os.open(os.path.join(ckpt, "lock"), os.O_RDONLY)
    fcntl.flock(fd, fcntl.LOCK_SH)
    threading.Timer(0.1, os.close, args=(fd,)).start()  # the look ends (claims retry 0.5 s)
    claim(ckpt, job="tiny", run_id="tiny-2").release()


def test_prune_and_fresh_hold_the_lock_while_they_delete(tmp_path):
    from checkpoint.owner import holding
    from checkpoint.store import start_over

    ckpt = str(tmp_path / "ckpt")
    saver = Saver(ckpt, group=None, options=SaveOptions(async_=False, keep=5, job="tiny"))
    for step in (1, 2):
        saver.save(step=step, consumed_samples=step,
                   model={"w": (torch.ones(4), ShardInfo.whole("w", (4,)))})  # fmt: skip
    saver.close()
    import threading

    with holding(ckpt, what="elasticd ckpt prune") as holder:
        assert holder is None
        with holding(ckpt, what="elasticd submit --fresh") as other:
            assert other is not None and other["run_id"] == "elasticd ckpt prune"
    # A round of a run starting meanwhile (a prune between two rounds) waits for the
    # tool, saying so, rather than fail the job; another run is still refused after.
    said = []
    entered, release = threading.Event(), threading.Event()

    def prune_for_a_while():
        with holding(ckpt, what="elasticd ckpt prune"):
            entered.set()
            release.wait(10)

    tool = threading.Thread(target=prune_for_a_while)
    tool.start()
    entered.wait(10)
    threading.Timer(1.0, release.set).start()
    claim(ckpt, job="tiny", run_id="tiny-3", warn=said.append).release()
    tool.join()
    assert len(said) == 1 and "held by elasticd ckpt prune" in said[0], said
    running = claim(ckpt, job="tiny", run_id="tiny-3")
    try:
        with pytest.raises(OwnershipError, match=r"in use by run tiny-3 .*nothing deleted"):
            start_over(ckpt, job="tiny")
    finally:
        running.release()
    assert start_over(ckpt, job="tiny") == [1, 2]
    claim(ckpt, job="tiny", run_id="tiny-4").release()  # free once start_over is done


def test_prune_of_a_directory_without_checkpoints_leaves_nothing_there(tmp_path, capsys):
    from elasticd.cli import main

    assert main(["ckpt", "prune", str(tmp_path), "--keep", "1"]) == 0
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize(
    "record",
    ['{"job":"tiny","run_id":"evil\\nSECOND LINE","pid":"1\\nTHIRD","host":"h"}',
     "[" * 30000 + "]" * 30000],
    ids=["newlines", "deep"],
)  # fmt: skip
def test_a_hostile_lock_record_is_named_on_one_line_and_never_crashes_a_claim(tmp_path, record):
    """The lock is advisory: anyone can rewrite the record of a live run's lock file. A
    record with newlines made the refusal three lines; one nested 30,000 deep crashed
    the claim (and `ckpt prune`) with a RecursionError (a security review)."""
    from checkpoint.fence import Fence
    from checkpoint.owner import LOCK_FILE

    ckpt = str(tmp_path / "ckpt")
    for step in (1, 2):  # something to prune
        saver = Saver(ckpt, group=None, options=SaveOptions(async_=False, job="tiny"))
        saver.save(step=step, consumed_samples=step,
                   model={"w": (torch.ones(4), ShardInfo.whole("w", (4,)))})  # fmt: skip
        saver.close()
    held = claim(ckpt, job="tiny", run_id="tiny-1")
    try:
        with open(os.path.join(ckpt, LOCK_FILE), "r+b") as fh:  # the lock stays held
            fh.truncate(0)
            fh.write(record.encode())
        with pytest.raises(OwnershipError) as caught:
            claim(ckpt, job="tiny", run_id="tiny-2")
        assert "\n" not in str(caught.value) and "in use by" in str(caught.value)
        code = subprocess.run(
            [sys.executable, "-m", "elasticd", "ckpt", "prune", "--keep", "1", ckpt],
            capture_output=True, text=True, timeout=120,
        )  # fmt: skip
        assert code.returncode == 2 and code.stderr.count("\n") == 1, code.stderr
    finally:
        held.release()
    fence = Fence(run_id="tiny-evil\nSECOND LINE", round=7)
    assert "\n" not in fence.describe() and "SECOND LINE" in fence.describe()
