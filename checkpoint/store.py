"""The checkpoint directory: committed steps, the `latest` pointer, retention, leftovers.

A step counts as committed only when ``step-<9 digits>/manifest.json`` exists: rank 0
writes the manifest into ``step-N.tmp/`` and renames the directory only after every rank's
files are fsynced, so a directory without ``.tmp`` always holds a complete checkpoint.
"""

from __future__ import annotations

import contextlib
import os
import shutil
from collections.abc import Callable

from checkpoint.fence import FENCE_FILE
from checkpoint.manifest import LATEST, MANIFEST, parse_step_dirname, step_dirname
from checkpoint.stfile import fsync_dir, write_atomic


def step_path(ckpt_dir: str, step: int) -> str:
    return os.path.join(ckpt_dir, step_dirname(step))


def committed_steps(ckpt_dir: str) -> list[int]:
    """Steps with a committed directory, ascending."""
    try:
        names = os.listdir(ckpt_dir)
    except FileNotFoundError:
        return []
    steps = []
    for name in names:
        step = parse_step_dirname(name)
        if step is not None and os.path.isfile(os.path.join(ckpt_dir, name, MANIFEST)):
            steps.append(step)
    return sorted(steps)


def read_latest(ckpt_dir: str) -> int | None:
    """The step the `latest` pointer names, or None when there is no (readable) pointer."""
    try:
        with open(os.path.join(ckpt_dir, LATEST), encoding="utf-8") as f:
            return parse_step_dirname(f.read().strip())
    except (FileNotFoundError, UnicodeDecodeError):
        return None


def write_latest(ckpt_dir: str, step: int) -> None:
    write_atomic(os.path.join(ckpt_dir, LATEST), (step_dirname(step) + "\n").encode())


def commit_step(
    ckpt_dir: str,
    *,
    step: int,
    tmp: str,
    token: str,
    keep: int,
    check: Callable[[str], None],
    log: Callable[[str], None] | None = None,
) -> None:
    """Commit the finished save in ``tmp`` (manifest written and fsynced) as ``step``:
    rename it to ``step-N``, switch `latest` to it, then apply retention.

    ``check(what)`` is the fence (:func:`checkpoint.fence.check_fence`): it raises to refuse,
    ``what`` opening its message. It is asked right before the rename (the commit point),
    again after the rename (before `latest`) and once more before anything is deleted, so
    that a writer frozen between a check and its next step and thawed in a newer world
    stops at the next check. After the rename, a refused writer's own step stays where it
    is, complete (moving it again could move a newer world's commit of the same step), and
    a committed step it displaced is put back: nothing committed is deleted."""
    final = step_path(ckpt_dir, step)
    check(f"checkpoint step {step} was not committed")
    aside = None
    if os.path.exists(final):  # a step saved again after resuming from an older one
        aside = f"{final}.{token}.replaced.tmp"
        os.replace(final, aside)
    os.replace(tmp, final)
    fsync_dir(ckpt_dir)
    undo = (ckpt_dir, final, aside, token)
    _check_after_rename(
        *undo, check, f"checkpoint step {step} was renamed into place, `latest` not switched"
    )
    write_latest(ckpt_dir, step)
    _check_after_rename(*undo, check, f"checkpoint step {step} was committed, nothing pruned")
    if aside is not None:
        shutil.rmtree(aside, ignore_errors=True)
    prune(ckpt_dir, keep=keep, log=log)


def _check_after_rename(
    ckpt_dir: str,
    final: str,
    aside: str | None,
    token: str,
    check: Callable[[str], None],
    what: str,
) -> None:
    if aside is not None:
        what += " (the step it displaced is put back)"
    try:
        check(what)
    except BaseException:
        if aside is not None:
            os.replace(final, f"{final}.{token}.fenced.tmp")  # ours: a leftover now
            os.replace(aside, final)
            fsync_dir(ckpt_dir)
        raise


def load_order(ckpt_dir: str) -> list[int]:
    """Committed steps to try when resuming: `latest` first, then the others, newest first."""
    steps = committed_steps(ckpt_dir)
    latest = read_latest(ckpt_dir)
    order = sorted(steps, reverse=True)
    if latest in steps:
        order.remove(latest)
        order.insert(0, latest)
    return order


def leftovers(ckpt_dir: str) -> list[str]:
    """Paths of unfinished saves (``*.tmp`` directories and files).

    Not the fence's tmp files (``fence.json.*``): the agents write those, and one may be
    on its way to being renamed over ``fence.json`` right now."""
    try:
        names = os.listdir(ckpt_dir)
    except FileNotFoundError:
        return []
    return sorted(
        os.path.join(ckpt_dir, n)
        for n in names
        if n.endswith(".tmp") and not n.startswith(FENCE_FILE + ".")
    )


def remove_leftovers(ckpt_dir: str) -> list[str]:
    """Delete unfinished saves; only call when no save is in flight in this directory."""
    removed = leftovers(ckpt_dir)
    for path in removed:
        if os.path.isdir(path):
            shutil.rmtree(path, ignore_errors=True)
        else:
            _unlink(path)
    return removed


def prune(ckpt_dir: str, *, keep: int, log: Callable[[str], None] | None = None) -> list[int]:
    """Delete all but the newest ``keep`` committed steps; `latest` is never deleted."""
    if keep < 1:
        raise ValueError(f"keep must be at least 1, got {keep}")
    latest = read_latest(ckpt_dir)
    steps = committed_steps(ckpt_dir)
    doomed = [s for s in steps[:-keep] if s != latest]
    for step in doomed:
        path = step_path(ckpt_dir, step)
        # Rename first so a crash mid-delete leaves a `.tmp` leftover, never a half step.
        trash = f"{path}.deleting.tmp"
        os.replace(path, trash)
        shutil.rmtree(trash, ignore_errors=True)
        if log:
            log(f"pruned {step_dirname(step)}")
    if doomed:
        fsync_dir(ckpt_dir)
    return doomed


def _unlink(path: str) -> None:
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)
