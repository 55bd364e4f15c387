"""One commit point: a SIGKILL aimed at each window of a commit, and what loads after it.

The worker half runs as ``python tests/test_checkpoint_commit.py CKPT POINT KILL_AT STEPS``:
a real process saves ``STEPS`` in order (sync, keep 2) and kills itself with SIGKILL at the
named point of save number ``KILL_AT``, through the store's injected ``SaveOptions.hook``.
Every tensor holds the number of the save that wrote it, so the test knows which save of a
step it loaded.
"""

from __future__ import annotations

import functools
import os
import re
import signal
import subprocess
import sys

import pytest
import torch

from checkpoint import SaveOptions, Saver, ShardInfo, committed_steps, load_latest, read_latest
from checkpoint.store import leftovers, step_path

SHAPE = (64, 32)


def tensors(save_no: int):
    info = ShardInfo.whole("w", SHAPE)
    return {"w": (torch.full(SHAPE, float(save_no)), info)}, {
        "exp_avg/w": (torch.full(SHAPE, -float(save_no)), info)
    }


def saver(ckpt: str, hook=None) -> Saver:
    opts = SaveOptions(async_=False, keep=2, chunk_min_bytes=1024, hook=hook)
    return Saver(ckpt, group=None, options=opts)


def worker(ckpt: str, point: str, kill_at: int, steps: list[int]) -> None:
    now = {"save": -1}

    def hook(where: str) -> None:
        if where == point and now["save"] == kill_at:
            os.kill(os.getpid(), signal.SIGKILL)

    s = saver(ckpt, hook)
    for i, step in enumerate(steps):
        now["save"] = i
        model, optim = tensors(i)
        s.save(step=step, consumed_samples=step, model=model, optimizer=optim)
    s.close()


def loaded(ckpt: str) -> tuple[int, int]:
    """(step, save number) of what a resume loads."""
    model, optim = tensors(-1)
    ckpt_ = load_latest(ckpt, model=model, optimizer=optim)
    value = int(model["w"][0][0, 0])
    assert torch.all(model["w"][0] == value) and torch.all(optim["exp_avg/w"][0] == -value)
    return ckpt_.step, value


# point: (steps saved, save killed, (step, save) loaded, committed after, latest after)
CASES = {
    "before-rename": ([1, 2, 3], 2, (2, 1), [1, 2], 2),
    "replaced-moved-aside": ([1, 2, 3, 2], 3, (3, 2), [2, 3], 3),
    "renamed": ([1, 2, 3], 2, (3, 2), [1, 2, 3], 2),
    "latest-tmp-written": ([1, 2, 3], 2, (3, 2), [1, 2, 3], 2),
    "latest-switched": ([1, 2, 3], 2, (3, 2), [1, 2, 3], 3),
    "pruning": ([1, 2, 3], 2, (3, 2), [2, 3], 3),
}


@pytest.mark.parametrize("point", list(CASES))
def test_a_sigkill_at_each_window_of_a_commit_leaves_the_newest_commit_loadable(point, tmp_path):
    steps, kill_at, want, committed, latest = CASES[point]
    ckpt = str(tmp_path / "ckpt")
    args = [sys.executable, __file__, ckpt, point, str(kill_at), *map(str, steps)]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.run(args, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == -signal.SIGKILL, proc.stderr[-2000:]
    # After the rename the step is committed, whether or not `latest` was switched.
    assert loaded(ckpt) == want
    assert committed_steps(ckpt) == committed and read_latest(ckpt) == latest
    if point == "replaced-moved-aside":
        # The step being replaced was moved aside and the writer died before its own
        # rename: the load put it back, whole, with the content of its own save.
        model, optim = tensors(-1)
        from checkpoint import Checkpoint

        Checkpoint.open(step_path(ckpt, 2)).load_into(model, optim)
        assert torch.all(model["w"][0] == 1)
    # The next save of the job cleans the leftovers of the killed one and commits.
    s = saver(ckpt)
    model, optim = tensors(9)
    s.save(step=4, consumed_samples=4, model=model, optimizer=optim)
    s.close()
    assert loaded(ckpt) == (4, 9) and read_latest(ckpt) == 4
    assert committed_steps(ckpt) == [want[0], 4] and leftovers(ckpt) == []


def test_after_the_rename_a_failure_is_a_warning_and_the_step_stays_committed(tmp_path):
    ckpt = str(tmp_path / "ckpt")
    s = saver(ckpt)
    model, optim = tensors(0)
    s.save(step=1, consumed_samples=1, model=model, optimizer=optim)
    # `latest` cannot be replaced (a directory in its way): the commit stands regardless.
    os.remove(os.path.join(ckpt, "latest"))
    os.mkdir(os.path.join(ckpt, "latest"))
    os.mkdir(os.path.join(ckpt, "latest", "x"))
    model, optim = tensors(1)
    s.save(step=2, consumed_samples=2, model=model, optimizer=optim)
    result = s.wait() or s.last
    s.close()
    assert result is not None and result.committed and result.step == 2
    assert loaded(ckpt) == (2, 1)


def test_a_save_deletes_only_its_own_leftovers(tmp_path):
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    (ckpt / "notes.tmp").write_text("the user's")
    (ckpt / "fence.json.node1.42.writing.tmp").write_text("an agent's")
    (ckpt / "step-000000007.deadbeef.tmp").mkdir()  # a save of this job that died
    s = saver(str(ckpt))
    model, optim = tensors(0)
    s.save(step=1, consumed_samples=1, model=model, optimizer=optim)
    s.close()
    assert sorted(os.listdir(ckpt)) == [
        "fence.json.node1.42.writing.tmp",
        "latest",
        "notes.tmp",
        "step-000000001",
    ]


if __name__ == "__main__":
    torch.set_num_threads(1)
    worker(sys.argv[1], sys.argv[2], int(sys.argv[3]), [int(x) for x in sys.argv[4:]])


def test_a_manifest_no_load_would_read_is_never_committed(tmp_path, monkeypatch):
    """A save whose manifest would pass the bound every load enforces is refused before
    the commit, on every rank, leaving nothing behind: never a committed step that no load
    can read. The step before it still loads."""
    import checkpoint.save as save_mod
    from checkpoint import SaveRefusedError
    from checkpoint.manifest import MANIFEST

    ckpt = str(tmp_path)
    s = saver(ckpt)
    model, optim = tensors(0)
    s.save(step=1, consumed_samples=1, model=model, optimizer=optim)
    size = os.path.getsize(os.path.join(step_path(ckpt, 1), MANIFEST))
    # Half of it: the next manifest's length moves by a few bytes (its time, its numbers).
    monkeypatch.setattr(save_mod, "MAX_MANIFEST_BYTES", size // 2)
    model, optim = tensors(1)
    with pytest.raises(SaveRefusedError, match=r"the manifest of \d+ chunks would take \d+ bytes"):
        s.save(step=2, consumed_samples=2, model=model, optimizer=optim)
    s.close()
    assert committed_steps(ckpt) == [1] and leftovers(ckpt) == []
    assert loaded(ckpt) == (1, 0)


def test_a_save_past_any_bound_of_the_reader_is_never_committed(tmp_path, monkeypatch):
    """The saver reads its manifest back as a load does (once per plan) before the commit:
    a step over the reader's chunk bound (2 Mi; here made 3) fails on every rank, and
    nothing is committed. (Its manifest was small enough: only the read-back sees it.)"""
    import checkpoint.manifest as manifest_mod
    from checkpoint import SaveRefusedError

    monkeypatch.setattr(manifest_mod, "MAX_CHUNKS", 3)  # w and exp_avg/w: 8 strips each
    ckpt = str(tmp_path)
    s = saver(ckpt)
    model, optim = tensors(0)
    with pytest.raises(SaveRefusedError, match="would commit: 16 chunks, more than 3"):
        s.save(step=1, consumed_samples=1, model=model, optimizer=optim)
    s.close()
    assert committed_steps(ckpt) == [] and leftovers(ckpt) == []


def test_many_five_dimensional_weights_cut_in_strips_commit_and_load(tmp_path):
    """600 conv3d-like weights, each cut into 8 strips: the tiling check's corner budget is
    charged per listed region (32 corners each), not per strip, so the step that commits
    is one that loads (charged per strip it was over the budget, and refused)."""
    ckpt = str(tmp_path)
    opts = SaveOptions(async_=False, chunk_min_bytes=1)
    s = Saver(ckpt, group=None, options=opts)
    model = {f"conv{i}": (torch.full((2, 8, 1, 1, 1), float(i)),
                          ShardInfo.whole(f"conv{i}", (2, 8, 1, 1, 1))) for i in range(600)}  # fmt: skip
    s.save(step=1, consumed_samples=1, model=model)
    s.close()
    blank = {n: (torch.zeros(2, 8, 1, 1, 1), info) for n, (_, info) in model.items()}
    assert load_latest(ckpt, model=blank).step == 1
    assert all(torch.all(blank[f"conv{i}"][0] == i) for i in range(600))


@pytest.mark.parametrize(
    "step, samples, says",
    [
        (-1, 1, "step -1 is not an integer in [0, 10^9)"),
        (10**9, 1, "step 1000000000 is not an integer in [0, 10^9)"),  # step-NNNNNNNNN: 9 digits
        (True, 1, "step True is not an integer"),
        (2.0, 1, "step 2.0 is not an integer"),
        (2, -5, "consumed_samples -5 is not an integer in [0, 2^63)"),
        (2, 1 << 63, "consumed_samples 9223372036854775808 is not an integer in [0, 2^63)"),
        (2, 7.5, "consumed_samples 7.5 is not an integer"),
    ],
)
def test_a_save_of_a_step_or_position_no_load_reads_is_refused_at_once(
    tmp_path, step, samples, says
):
    """Each was committed (``committed=True``) as a step that no load reads: a negative or
    2^63 position fails the manifest's check; step 10^9 makes ``step-1000000000``, which no
    listing takes for a step (and `latest` then named it)."""
    from checkpoint import SaveRefusedError

    ckpt = str(tmp_path)
    s = saver(ckpt)
    model, optim = tensors(0)
    s.save(step=1, consumed_samples=1, model=model, optimizer=optim)
    model, optim = tensors(1)
    with pytest.raises(SaveRefusedError, match=re.escape(says)):
        s.save(step=step, consumed_samples=samples, model=model, optimizer=optim)
    s.save(step=999_999_999, consumed_samples=(1 << 63) - 1, model=model, optimizer=optim)
    s.close()
    assert committed_steps(ckpt) == [1, 999_999_999] and leftovers(ckpt) == []
    assert read_latest(ckpt) == 999_999_999 and loaded(ckpt) == (999_999_999, 1)


@pytest.mark.parametrize("ranks", [32, 1024])
def test_a_large_worlds_layout_is_saved_at_every_save_not_only_the_first(tmp_path, ranks):
    """A large world's layout ([[0],[1],...]: 11 lists per rank) is denser than a manifest
    was allowed to be: with a small model a 32-rank world's save was refused, and with a
    larger one every save after the first (its read-back of what is not the plan's held
    the layout alone to that density; the trainer exits 2 at such a save)."""
    from elasticd.layout import ParallelConfig, plan_world

    ckpt = str(tmp_path)
    s = saver(ckpt)
    layout = plan_world(ranks, ParallelConfig()).to_dict()
    for step in (1, 2, 3):
        model, optim = tensors(step)
        s.save(step=step, consumed_samples=step, model=model, optimizer=optim, layout=layout)
    s.close()
    assert committed_steps(ckpt) == [2, 3] and loaded(ckpt) == (3, 3)


@pytest.mark.parametrize(
    "field, value, says",
    [
        ("extra", {"deep": functools.reduce(lambda x, _: [x], range(40), 0)}, "deep, more than 32"),
        ("scalars", {"lr": float("nan")}, "NaN is not a JSON value"),
        ("extra", {"x": float("inf")}, "Infinity is not a JSON value"),
        ("layout", {"tp": [[]] * 400_000}, "JSON lists or objects in"),
    ],
)
def test_what_a_later_save_of_the_same_plan_writes_is_read_back_too(tmp_path, field, value, says):
    """The manifest was read back as a load reads it once per plan: a later save of the
    same tensors with `extra` nested 40 deep (or a NaN, or a list of 400,000 empty lists)
    committed a step every load refuses."""
    from checkpoint import SaveRefusedError

    ckpt = str(tmp_path)
    s = saver(ckpt)
    model, optim = tensors(0)
    s.save(step=1, consumed_samples=1, model=model, optimizer=optim, extra={"a": 1})
    model, optim = tensors(1)
    with pytest.raises(SaveRefusedError, match=re.escape(says)):
        s.save(step=2, consumed_samples=2, model=model, optimizer=optim, **{field: value})
    s.save(step=3, consumed_samples=3, model=model, optimizer=optim, extra={"a": 1})
    s.close()
    assert committed_steps(ckpt) == [1, 3] and leftovers(ckpt) == []
    assert loaded(ckpt) == (3, 1)
