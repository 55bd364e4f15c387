"""The checkpoint directory: committed steps, the `latest` pointer, retention, leftovers.

A step counts as committed only when ``step-<9 digits>/manifest.json`` exists: rank 0
writes the manifest into ``step-N.<token>.tmp/`` and renames the directory only after every
rank's files are fsynced, so a directory without ``.tmp`` always holds a complete
checkpoint. The rename is the one commit point. Which committed step is newest is said by
the commit numbers in the manifests, not by the step numbers nor by `latest` (a hint).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import secrets
import shutil
import stat
from collections.abc import Callable

from checkpoint import seal, smallfile
from checkpoint.errors import CheckpointError
from checkpoint.manifest import (
    FILE_NAME_RE,
    INT_LIMIT,
    LATEST,
    MANIFEST,
    MAX_MANIFEST_BYTES,
    Manifest,
    checksum_matches,
    parse_json,
    parse_step_dirname,
    step_dirname,
)
from checkpoint.stfile import fsync_dir, read_regular, write_all, write_atomic


def step_path(ckpt_dir: str, step: int) -> str:
    return os.path.join(ckpt_dir, step_dirname(step))


def committed_steps(ckpt_dir: str) -> list[int]:
    """Steps with a committed directory, ascending: a ``step-N`` directory with an entry
    named ``manifest.json``, whatever that entry is. One that is not a regular file (a
    FIFO, a directory, a symlink) is a commit that is damaged: a load falls back from it and
    ``verify`` names it (it was skipped: a resume trained from step 1 in silence). A
    ``step-N`` that is a symlink (say, to another job's step) is not one: it is skipped
    like any other stranger."""
    try:
        names = os.listdir(ckpt_dir)
    except FileNotFoundError:
        return []
    steps = []
    for name in names:
        step = parse_step_dirname(name)
        path = os.path.join(ckpt_dir, name)
        if step is not None and _real_dir(path) and os.path.lexists(os.path.join(path, MANIFEST)):
            steps.append(step)
    return sorted(steps)


def _real_dir(path: str) -> bool:
    """Whether ``path`` itself (not what a symlink there points to) is a directory."""
    try:
        return stat.S_ISDIR(os.lstat(path).st_mode)
    except OSError:
        return False


def read_latest(ckpt_dir: str) -> int | None:
    """The step the `latest` pointer names, or None when there is no (readable) pointer:
    it is only a hint, so anything but a small regular file naming a step (a symlink, a
    FIFO, a device: opened without following or blocking) is ignored."""
    try:
        raw = smallfile.read_small(os.path.join(ckpt_dir, LATEST))
        return parse_step_dirname(raw.decode("utf-8").strip()) if raw is not None else None
    except (CheckpointError, UnicodeDecodeError):
        return None


def write_latest(ckpt_dir: str, step: int, hook: Callable[[str], None] | None = None) -> None:
    write_atomic(
        os.path.join(ckpt_dir, LATEST),
        (step_dirname(step) + "\n").encode(),
        before_rename=(lambda: hook("latest-tmp-written")) if hook else None,
    )


def _nothing(_what: str) -> None:
    pass


def commit_step(
    ckpt_dir: str,
    *,
    step: int,
    tmp: str,
    token: str,
    keep: int,
    check: Callable[[str], None],
    log: Callable[[str], None] | None = None,
    warn: Callable[[str], None] | None = None,
    hook: Callable[[str], None] | None = None,
    commit: int | None = None,
    defer: Callable[[Callable[[], None]], None] | None = None,
    key: bytes | None = None,
    job: str | None = None,
) -> None:
    """Commit the finished save in ``tmp`` (manifest written and fsynced) as ``step``:
    rename it to ``step-N`` (the commit point), switch `latest` to it, then apply retention.

    The rename is the one commit point. After it the step is committed whatever happens:
    a failure to fsync the directory, to switch `latest` (a hint: loads go by commit order)
    or to prune is a warning (``warn``), not an error. Only the fence still stops a writer
    after it (see below).

    ``check(what)`` is the fence (:func:`checkpoint.fence.check_fence`): it raises to refuse,
    ``what`` opening its message. It is asked right before the rename, again after the
    rename (before `latest`) and once more before anything is deleted, so that a writer
    frozen between a check and its next step and thawed in a newer world stops at the next
    check. Refused by the check after the rename (it may have been stale at the rename),
    a writer's own step stays where it is, complete (moving it again could move a newer
    world's commit of the same step), and a committed step it displaced is put back:
    nothing committed is deleted. A refused step that displaced nothing is recorded as
    unloadable under its ``commit`` number, so it never outranks the current world's
    commits. Refused only by the last check, before the deletes, the writer was current
    after its rename: its step is an ordinary commit, and only retention is skipped.

    An existing ``step-N`` (saved again after resuming from an older step) is first moved
    aside to ``step-N.<token>.replaced.tmp``; should the writer die before its own rename,
    :func:`recover_replaced` puts it back, so a replaced step is never lost. ``hook(point)``
    is called at each named point (tests aim a SIGKILL at them). ``defer(func)``, if
    given, runs the deletes (the step moved aside, retention) later, e.g. on a thread.
    ``key``: the saver's seal key; retention then counts only steps sealed with it (and,
    with ``job``, for that job: :func:`commit_numbers`)."""
    hook = hook or _nothing
    warn = warn or log or _nothing
    final = step_path(ckpt_dir, step)
    check(f"checkpoint step {step} was not committed")
    hook("before-rename")
    aside = None
    if os.path.lexists(final):  # a step saved again after resuming from an older one
        aside = f"{final}.{token}.replaced.tmp"
        os.replace(final, aside)
        hook("replaced-moved-aside")
    try:
        os.replace(tmp, final)  # the commit point
    except BaseException:
        if aside is not None:
            _put_back(ckpt_dir, aside, final)
            # A stale writer whose directory the current world deleted as a leftover
            # fails here: the fence says why, and the step it moved aside is back.
            check(f"checkpoint step {step} was not committed (the step it displaced is put back)")
        raise
    hook("renamed")
    _warn_on_error(warn, f"checkpoint step {step} is committed, but fsync of {ckpt_dir}",
                   lambda: fsync_dir(ckpt_dir))  # fmt: skip
    undo = (ckpt_dir, final, aside, token, commit)
    _check_after_rename(
        *undo, check, f"checkpoint step {step} was renamed into place, `latest` not switched"
    )
    _warn_on_error(warn, f"checkpoint step {step} is committed, but switching `latest`",
                   lambda: write_latest(ckpt_dir, step, hook))  # fmt: skip
    hook("latest-switched")
    # The check after the rename passed: the fence still named our round after the step
    # was in place, so a newer world (which writes its fence before it chooses what to
    # resume from) sees it. It is committed, `latest` and all, even if we are refused now
    # (frozen here, thawed in a newer world): then we only delete nothing of anyone's
    # (no retention), and our own copy moved aside goes, replaced by our commit. (Marking
    # the step unloadable here made retention delete a good commit: an in-process chaos
    # soak lost step 1360 so, its writer frozen at this point.)
    try:
        check(f"checkpoint step {step} was committed, nothing pruned")
    except BaseException:
        if aside is not None:
            shutil.rmtree(aside, ignore_errors=True)
        raise

    def tidy() -> None:
        if aside is not None:
            shutil.rmtree(aside, ignore_errors=True)
        prune(ckpt_dir, keep=keep, log=log, hook=hook, trusted={step}, key=key,
              job=job)  # fmt: skip

    def tidy_warned() -> None:
        _warn_on_error(warn, f"checkpoint step {step} is committed, but retention", tidy)

    if defer is not None:
        defer(tidy_warned)  # the deletes are off the save's critical path
    else:
        tidy_warned()


def _put_back(ckpt_dir: str, aside: str, final: str) -> None:
    """Undo a move aside whose own rename failed: the committed step goes back to ``final``
    (unless something is there now), and is never lost either way (a ``.replaced.tmp``
    with ``final`` missing is put back by :func:`recover_replaced`)."""
    with contextlib.suppress(OSError):
        if not os.path.lexists(final):
            os.replace(aside, final)
            fsync_dir(ckpt_dir)


def _warn_on_error(warn: Callable[[str], None], what: str, func: Callable[[], None]) -> None:
    try:
        func()
    except Exception as exc:
        warn(f"{what} failed: {exc}")


def _check_after_rename(
    ckpt_dir: str,
    final: str,
    aside: str | None,
    token: str,
    commit: int | None,
    check: Callable[[str], None],
    what: str,
) -> None:
    if aside is not None:
        what += " (the step it displaced is put back)"
    try:
        check(what)
    except BaseException as exc:
        if aside is not None:
            os.replace(final, f"{final}.{token}.fenced.tmp")  # ours: a leftover now
            os.replace(aside, final)
            fsync_dir(ckpt_dir)
        elif commit is not None:
            # Our step stays in place (moving it could move a newer world's commit of the
            # same step), but marked by our commit number, so that it does not outrank the
            # current world's commits: loaded last, pruned first.
            with contextlib.suppress(Exception):
                mark_unloadable(ckpt_dir, int(os.path.basename(final)[5:]), str(exc),
                                commit=commit)  # fmt: skip
        raise


# -- commit order, lineage and what failed to load -------------------------------------------

UNLOADABLE = "unloadable.json"
"""``{"<step>": {"commit": <n>, "error": "..."}}``: committed steps a load fell back from."""


def _manifest_json(path: str) -> object:
    """A manifest's JSON, read under the same bounds as a load (size, containers, depth):
    a hostile one costs no more here than there. Raises CheckpointError."""
    data = read_regular(path, max_bytes=MAX_MANIFEST_BYTES)
    return parse_json(data, path, max_bytes=MAX_MANIFEST_BYTES, error=CheckpointError)


def commit_numbers(
    ckpt_dir: str, key: bytes | None = None, job: str | None = None
) -> dict[int, int]:
    """Each committed step's commit number (0 when its manifest has none, is unreadable,
    fails its own checksum or names another step than its directory's: such a step is
    ordered by its step number below every numbered commit, and cannot head the lineage
    with a number no checksum vouches for). With ``key``, also 0 unless the manifest is sealed with
    that key (:mod:`checkpoint.seal`): a planted step claims nothing. With ``key`` and
    ``job`` (the job whose directory it is: a trainer's saves and resumes, ``ckpt prune
    --key-file``), also 0 unless the sealed manifest's ``job`` is ``job``: a step sealed
    by another job with the same key and copied in neither heads the lineage nor makes
    retention delete this job's newer steps. ``job`` is ignored without ``key`` (nothing
    vouches for an unsealed manifest's ``job``). A load checks the whole manifest."""
    job = job or None  # "": not known
    out = {}
    seen: dict[tuple[int, int], int | None] = {}  # (device, inode) -> the step it names
    for step in committed_steps(ckpt_dir):
        out[step] = 0
        path = os.path.join(step_path(ckpt_dir, step), MANIFEST)
        with contextlib.suppress(CheckpointError, OSError):
            st = os.stat(path, follow_symlinks=False)
            ident = (st.st_dev, st.st_ino)
            # Only a file with several links: some file systems (FUSE, SMB noserverino)
            # give distinct files one inode number.
            if st.st_nlink > 1 and ident in seen and seen[ident] != step:
                # A hard link to a manifest read already, of another step: no save writes
                # one, and each link of a large one cost a whole parse (40 links of a 63 MB
                # manifest made every listing of the directory take a minute). Its own
                # step's directory is read all the same: a link planted under a lower
                # step number made the real step count as commit 0, so loads passed over
                # it and retention deleted it (a security review).
                continue
            seen.setdefault(ident, None)
            out[step] = _commit_number(path, step, key, job)
            if seen[ident] is None:
                seen[ident] = _COMMIT_CACHE[path][4]
    return out


_COMMIT_CACHE: dict[
    str, tuple[bytes, int, dict[str, int] | None, tuple[str, str | None], int | None]
] = {}
"""Manifest path -> (sha256 of the bytes read there, their commit number, the tensor
files it lists with their sizes, when its checksum matches, (the id of the key it was checked
with, "" for none; the job it was checked for, None for none), and the step it names, None
for none): every commit
reads the commit numbers of all kept steps, and parsing a manifest under a load's bounds
costs about 1.5 ms per 300 KB on the commit's critical path; hashing it, 0.2 ms. Keyed by
the bytes themselves, so a manifest rewritten in place is parsed again."""


_COMMIT_CACHE_SIZE = 4096
"""Entries of :data:`_COMMIT_CACHE` (about 100 bytes each): more than any directory keeps
steps (it was 64: a directory of more steps was parsed whole at every commit)."""


def _commit_number(path: str, step: int, key: bytes | None = None, job: str | None = None) -> int:
    data = read_regular(path, max_bytes=MAX_MANIFEST_BYTES)
    digest = hashlib.sha256(data).digest()
    hit = _COMMIT_CACHE.get(path)
    scope = (_kid(key), job if key is not None else None)
    if hit is not None and hit[0] == digest and hit[3] == scope:
        return hit[1]
    raw = parse_json(data, path, max_bytes=MAX_MANIFEST_BYTES, error=CheckpointError)
    # type(): a step of 0.0 or true equals 0 or 1 and no load reads it as a step.
    ok = isinstance(raw, dict) and type(raw.get("step")) is int and raw["step"] == step
    ok = ok and checksum_matches(raw)
    ok = ok and (key is None or not seal.seal_problem(raw, key))
    # Sealed with the key, but by another job (the same key shared, the step copied in):
    # counted like an unsealed step.
    ok = ok and (scope[1] is None or raw.get("job") == scope[1])
    n = raw.get("commit", 0) if ok else 0
    n = n if type(n) is int and 0 <= n < INT_LIMIT else 0  # as a load reads it
    if len(_COMMIT_CACHE) >= _COMMIT_CACHE_SIZE:
        _COMMIT_CACHE.clear()
    named = raw.get("step") if isinstance(raw, dict) else None
    named = named if type(named) is int else None
    _COMMIT_CACHE[path] = (digest, n, _listed_files(raw) if ok else None, scope, named)
    return n


def _kid(key: bytes | None) -> str:
    return seal.key_id(key) if key is not None else ""


def _listed_files(raw: dict) -> dict[str, int] | None:
    """The manifest's tensor files and their sizes, if every name is a plain file name of
    the step directory and every size an integer (else None: the step does not open)."""
    files = raw.get("files")
    if not isinstance(files, dict) or not files:
        return None
    out = {}
    for name, meta in files.items():
        size = meta.get("bytes") if isinstance(meta, dict) else None
        if (not isinstance(name, str) or not FILE_NAME_RE.fullmatch(name) or ".." in name
                or type(size) is not int):  # fmt: skip
            return None
        out[name] = size
    return out


def next_commit(ckpt_dir: str, key: bytes | None = None, job: str | None = None) -> int:
    """1 + the highest commit number in ``ckpt_dir``. Raises :class:`CheckpointError`
    rather than number a commit past what a manifest may hold (a manifest there claiming
    the largest number: written by hand, or hostile), which no load would read."""
    numbers = commit_numbers(ckpt_dir, key, job)
    n = 1 + max(numbers.values(), default=0)
    if n >= INT_LIMIT:
        step = max(numbers, key=lambda s: numbers[s])
        raise CheckpointError(
            f"{step_path(ckpt_dir, step)} claims commit number {n - 1}, the largest a "
            "manifest may hold: no commit after it can be numbered; move that step away"
        )
    return n


def lineage(
    ckpt_dir: str,
    numbers: dict[int, int] | None = None,
    failed: frozenset[int] | set[int] = frozenset(),
) -> tuple[list[int], list[int]]:
    """``(current, abandoned)``, each newest commit first. The current lineage is the newest
    commit and, going back in commit order, every step older than the one after it; a
    step not on it (step 100 of a timeline abandoned when training resumed from step 90 and
    committed step 95) is abandoned.

    A step in ``failed`` (:func:`read_unloadable`) is on neither list and shapes neither:
    a step that does not load heads no lineage. (It did: a bad step 5 claiming the newest
    commit made steps 10 to 30 "abandoned", and retention deleted every step that loads.)"""
    numbers = commit_numbers(ckpt_dir) if numbers is None else numbers
    current: list[int] = []
    abandoned: list[int] = []
    for step in sorted(numbers, key=lambda s: (numbers[s], s), reverse=True):
        if step in failed:
            continue
        if not current or step < current[-1]:
            current.append(step)
        else:
            abandoned.append(step)
    return current, abandoned


def read_unloadable(ckpt_dir: str) -> dict[int, int]:
    """Steps a load fell back from: step -> the commit number that failed."""
    path = os.path.join(ckpt_dir, UNLOADABLE)
    try:
        raw = _read_json(path)
    except CheckpointError:
        return {}
    if not isinstance(raw, dict):
        return {}
    out = {}
    for key, value in raw.items():  # anything but a step and a commit number is skipped
        commit = value.get("commit") if isinstance(value, dict) else None
        if _STEP_KEY.fullmatch(key) and type(commit) is int and 0 <= commit < INT_LIMIT:
            out[int(key)] = commit
    return out


_STEP_KEY = re.compile(r"[0-9]{1,18}")
"""A step number as a key of ``unloadable.json`` (ASCII digits: ``"²".isdigit()``)."""


def _read_json(path: str) -> object:
    """A small JSON file of the store (:mod:`checkpoint.smallfile`); None when missing;
    :class:`CheckpointError` for anything unreadable."""
    raw = smallfile.read_small(path)
    return None if raw is None else smallfile.parse_json(raw, where=path)


def mark_unloadable(
    ckpt_dir: str,
    step: int,
    error: str,
    *,
    commit: int | None = None,
    key: bytes | None = None,
    job: str | None = None,
) -> None:
    """Record that ``step`` (its present commit, or commit number ``commit``) failed to
    load, or must not be loaded: retention deletes it before any step that loads, and a
    load tries it last. Saving the step again clears it (a new commit number)."""
    numbers = commit_numbers(ckpt_dir, key, job)
    if step not in numbers:
        return
    if commit is not None:
        numbers[step] = commit
    path = os.path.join(ckpt_dir, UNLOADABLE)
    try:
        raw = _read_json(path)
        if not isinstance(raw, dict):
            raw = {}
    except CheckpointError:
        raw = {}
    raw = {k: v for k, v in raw.items() if _STEP_KEY.fullmatch(k) and int(k) in numbers}
    raw[str(step)] = {"commit": numbers[step], "error": error[:500]}
    write_atomic(path, json.dumps(raw, sort_keys=True).encode())


def clear_unloadable(ckpt_dir: str, step: int) -> None:
    """Forget a failure of ``step`` once it has loaded after all (a passing glitch)."""
    path = os.path.join(ckpt_dir, UNLOADABLE)
    if not os.path.lexists(path):
        return
    with contextlib.suppress(CheckpointError, OSError):
        raw = _read_json(path)
        if isinstance(raw, dict) and str(step) in raw:
            del raw[str(step)]
            write_atomic(path, json.dumps(raw, sort_keys=True).encode())


def failed_steps(ckpt_dir: str, numbers: dict[int, int]) -> set[int]:
    """The steps recorded as unloadable (:func:`read_unloadable`) at their present commit
    number (``numbers``: :func:`commit_numbers`); a step saved again since is not one."""
    return {s for s, n in read_unloadable(ckpt_dir).items() if numbers.get(s) == n}


def load_order(ckpt_dir: str, key: bytes | None = None, job: str | None = None) -> list[int]:
    """Committed steps to try when resuming: the current lineage newest first, then the
    abandoned steps; a step that failed to load before comes after all the others.

    `latest` is not consulted: it is a hint for people and tools, and a writer killed
    after its rename but before switching it leaves it naming an older step. With
    ``key``, steps not sealed with it (with ``job`` too: for that job) count as commit 0
    (:func:`commit_numbers`)."""
    numbers = commit_numbers(ckpt_dir, key, job)
    failed = failed_steps(ckpt_dir, numbers)
    current, abandoned = lineage(ckpt_dir, numbers, failed)
    return current + abandoned + _newest_first(failed, numbers)


def _newest_first(steps: set[int], numbers: dict[int, int]) -> list[int]:
    return sorted(steps, key=lambda s: (numbers[s], s), reverse=True)


def newest_job(ckpt_dir: str, key: bytes | None = None) -> str | None:
    """The job named by the manifest of the newest commit (with ``key``: of those sealed
    with it), if any (read, not checked)."""
    for step in load_order(ckpt_dir, key)[:1]:
        path = os.path.join(step_path(ckpt_dir, step), MANIFEST)
        with contextlib.suppress(CheckpointError):
            raw = _manifest_json(path)
            job = raw.get("job") if isinstance(raw, dict) else None
            return job if isinstance(job, str) and job else None
    return None


PROBE_PREFIX = ".probe-"


def write_probe(ckpt_dir: str) -> str:
    """Create a probe file that every rank then looks for (is this one shared directory?);
    returns its name."""
    name = PROBE_PREFIX + secrets.token_hex(8)
    path = os.path.join(ckpt_dir, name)
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
    fd = os.open(path, flags, 0o644)
    try:
        write_all(fd, b"elasticd storage probe\n")
        os.fsync(fd)
    except BaseException:
        _unlink(path)  # a full disk leaves no empty probe behind
        raise
    finally:
        os.close(fd)
    fsync_dir(ckpt_dir)
    return name


def remove_probe(ckpt_dir: str, name: str) -> None:
    _unlink(os.path.join(ckpt_dir, name))


def recover_replaced(ckpt_dir: str) -> list[int]:
    """Put back a committed step that a writer moved aside to replace it and then died
    before its own rename (``step-N.<token>.replaced.tmp`` holding a manifest, while
    ``step-N`` is missing). Returns the steps put back."""
    try:
        names = sorted(os.listdir(ckpt_dir))
    except FileNotFoundError:
        return []
    back = []
    for name in names:
        m = _REPLACED_RE.match(name)
        if not m:
            continue
        step = int(m.group(1))
        final = step_path(ckpt_dir, step)
        aside = os.path.join(ckpt_dir, name)
        # Only a real directory the store moved aside: a symlink planted under that name
        # (to another job's step) is never renamed into place.
        if os.path.lexists(final) or not _real_dir(aside):
            continue
        if not os.path.isfile(os.path.join(aside, MANIFEST)):
            continue
        os.replace(aside, final)
        back.append(step)
    if back:
        fsync_dir(ckpt_dir)
    return back


# ASCII digits, and \Z (not $, which passes a trailing newline), as for step names.
_REPLACED_RE = re.compile(r"^step-([0-9]{9})\.[0-9a-f]+\.replaced\.tmp\Z")
_LEFTOVER_RE = re.compile(
    r"^(step-[0-9]{9}\..+\.tmp|latest(\.[0-9a-f]{16})?\.tmp|unloadable\.json\.[0-9a-f]{16}\.tmp)\Z"
)


def leftovers(ckpt_dir: str) -> list[str]:
    """Paths of the store's own unfinished work: ``step-N.<...>.tmp`` (a save in progress
    or one that died, a step being deleted) and the temporaries of `latest` and
    ``unloadable.json`` (``latest.<16 hex>.tmp``; ``latest.tmp`` of older writers).
    Nothing else: not the fence's tmp files (the agents write those), not a file of the
    user's that happens to end in ``.tmp``."""
    try:
        names = os.listdir(ckpt_dir)
    except FileNotFoundError:
        return []
    return sorted(os.path.join(ckpt_dir, n) for n in names if _LEFTOVER_RE.match(n))


def remove_leftovers(ckpt_dir: str, *, spare: str = "") -> list[str]:
    """Put back any step moved aside by a writer that died (:func:`recover_replaced`),
    then delete the store's unfinished saves, except the entry named ``spare`` (the
    caller's own save in progress); call only when no other save of this job is in flight
    in this directory (the owner's lock and the fence see to that)."""
    recover_replaced(ckpt_dir)
    removed = []
    for path in leftovers(ckpt_dir):
        name = os.path.basename(path)
        if spare and name == spare:
            continue
        m = _REPLACED_RE.match(name)
        if (
            m
            and not os.path.lexists(step_path(ckpt_dir, int(m.group(1))))
            and _real_dir(path)
            and os.path.isfile(os.path.join(path, MANIFEST))
        ):
            # Moved aside since recover_replaced looked (a stale writer's commit racing
            # this clean-up): a committed step with nothing in its place, never deleted.
            recover_replaced(ckpt_dir)
            continue
        removed.append(path)
        if _real_dir(path):
            shutil.rmtree(path, ignore_errors=True)
        else:
            _unlink(path)
    return removed


def prune(
    ckpt_dir: str,
    *,
    keep: int,
    log: Callable[[str], None] | None = None,
    hook: Callable[[str], None] | None = None,
    trusted: frozenset[int] | set[int] = frozenset(),
    key: bytes | None = None,
    job: str | None = None,
) -> list[int]:
    """Keep the newest ``keep`` steps of the current lineage (of the steps that load:
    :func:`lineage`); delete the rest: abandoned steps first, then steps that failed to
    load, then the oldest. The newest loadable commit is never deleted, a step that failed
    to load is never kept in place of one that loads, and where no step loads nothing is
    deleted. Returns the steps deleted, in order.

    A step to be kept must have its manifest's checksum match and its files there as the manifest
    lists them (regular files of its sizes; stat only, nothing read; ``trusted``: steps
    the caller just wrote, not looked at): a step planted with a re-checksummed manifest
    claiming the newest commit and no files made every step that loads "abandoned" (``ckpt
    prune --keep 1`` deleted them all and kept the plant: a security review). One that
    fails counts for nothing kept, and is not deleted here either (only a load's failure,
    recorded, makes it deletable); an I/O error while looking deletes nothing this time.
    Without ``key``, commit numbers are what a manifest with a matching checksum says
    (anyone can recompute that): a plant with copies of a real step's files still heads
    the lineage. With ``key`` (a sealed job), only a manifest sealed with it has a commit
    number; any other step is ordered as commit 0, below every sealed one, so pruned as
    abandoned or oldest once ``keep`` sealed steps are newer. With ``key`` and ``job``, a
    step sealed with the key by another job counts so too."""
    if keep < 1:
        raise ValueError(f"keep must be at least 1, got {keep}")
    numbers = commit_numbers(ckpt_dir, key, job)
    failed = failed_steps(ckpt_dir, numbers)
    spared: set[int] = set()
    while True:
        current, abandoned = lineage(ckpt_dir, numbers, failed | spared)
        if not current:
            return []
        looks = {s: s in trusted or _keepable(ckpt_dir, s, key) for s in current[:keep]}
        if None in looks.values():
            return []  # an I/O error (EMFILE, ESTALE): judge nothing now, delete nothing
        bad = [s for s, ok in looks.items() if not ok]
        if not bad:
            break
        spared.update(bad)
        if log:
            log(f"{', '.join(step_dirname(s) for s in bad)}: its files are not as its manifest "
                "says; neither kept nor pruned")  # fmt: skip
    doomed = abandoned + _newest_first(failed, numbers) + list(reversed(current[keep:]))
    for step in doomed:
        path = step_path(ckpt_dir, step)
        # Rename first so a crash mid-delete leaves a `.tmp` leftover, never a half step.
        trash = f"{path}.deleting.tmp"
        os.replace(path, trash)
        if hook:
            hook("pruning")
        shutil.rmtree(trash, ignore_errors=True)
        if log:
            log(f"pruned {step_dirname(step)}")
    if doomed:
        fsync_dir(ckpt_dir)
    return doomed


def _keepable(ckpt_dir: str, step: int, key: bytes | None) -> bool | None:
    """Whether a step may be kept by :func:`prune`: its files are there
    (:func:`_files_there`) and its manifest opens as a load opens it
    (:meth:`Manifest.from_json`: a supported version, known dtypes, chunks that tile,
    ...). A plant with a re-checksummed manifest claiming the newest commit, a copy of a
    real step's files and one defect a load refuses (a step of ``0.0``, version 0, a dtype
    of ``complex64``) was kept by ``ckpt prune --keep 1`` and by a save's retention, and
    every step that loads deleted (a security review). None: an I/O error, judge nothing."""
    there = _files_there(ckpt_dir, step)
    return there if not there else _manifest_opens(ckpt_dir, step, key)


_OPENS_CACHE: dict[tuple[str, bytes, str], bool] = {}
"""(manifest path, sha256 of its bytes, key id) -> whether it opens: each kept step is
judged at every save's retention, and a manifest is parsed whole once per content."""


def _manifest_opens(ckpt_dir: str, step: int, key: bytes | None) -> bool | None:
    path = os.path.join(step_path(ckpt_dir, step), MANIFEST)
    hit = _COMMIT_CACHE.get(path)
    index = (path, hit[0], _kid(key)) if hit is not None else None
    if index is not None and index in _OPENS_CACHE:
        return _OPENS_CACHE[index]
    try:
        data = read_regular(path, max_bytes=MAX_MANIFEST_BYTES)
    except (FileNotFoundError, NotADirectoryError, CheckpointError):
        return False
    except OSError:
        return None
    try:
        Manifest.from_json(data, where=path, key=key)
        opens = True
    except CheckpointError:
        opens = False
    if len(_OPENS_CACHE) >= _COMMIT_CACHE_SIZE:
        _OPENS_CACHE.clear()
    _OPENS_CACHE[(path, hashlib.sha256(data).digest(), _kid(key))] = opens
    return opens


def _files_there(ckpt_dir: str, step: int) -> bool | None:
    """Whether the committed ``step``'s manifest's checksum matches (and, with a key, its
    seal) and it lists files that are there, regular files of the sizes it says (from :func:`commit_numbers`' cache: call that
    first; stat only, nothing read). None when a stat failed for another reason than a
    missing file (the answer may change: too many open files, a stale NFS handle)."""
    directory = step_path(ckpt_dir, step)
    hit = _COMMIT_CACHE.get(os.path.join(directory, MANIFEST))
    if hit is None or not hit[2]:
        return False
    for name, size in hit[2].items():
        try:
            st = os.stat(os.path.join(directory, name), follow_symlinks=False)
        except (FileNotFoundError, NotADirectoryError):
            return False
        except OSError:
            return None
        if not stat.S_ISREG(st.st_mode) or st.st_size != size:
            return False
    return True


def _unlink(path: str) -> None:
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)


def start_over(ckpt_dir: str, *, job: str) -> list[int]:
    """Delete a job's checkpoints so that its next run starts from step 0 (``elasticd
    submit --fresh``): the committed steps, the store's leftovers, `latest`,
    ``unloadable.json`` and probe files; nothing else (the owner record, the lock file,
    the fence and any file of the user's stay). Returns the committed steps deleted.

    Refused (:class:`OwnershipError`, nothing deleted) when the directory belongs to
    another job (``owner.json``, or the newest manifest where there is none) or a run
    holds its lock (it is training there)."""
    from checkpoint.errors import OwnershipError
    from checkpoint.owner import OWNER_FILE, describe_holder, holding, read_owner

    if not os.path.isdir(ckpt_dir):
        return []
    owner = read_owner(ckpt_dir)
    theirs = owner["job"] if owner is not None else newest_job(ckpt_dir)
    if theirs is not None and theirs != job:
        where = OWNER_FILE if owner is not None else "its newest manifest"
        raise OwnershipError(
            f"checkpoint directory {ckpt_dir} belongs to job {theirs!r} ({where}), "
            f"not {job!r}: nothing deleted"
        )
    # Held while deleting: no run claims the directory meanwhile.
    with holding(ckpt_dir, what="elasticd submit --fresh", job=job) as holder:
        if holder is not None:
            raise OwnershipError(
                f"checkpoint directory {ckpt_dir} is in use by {describe_holder(holder)}: "
                "nothing deleted"
            )
        steps = _delete_all(ckpt_dir)
    return steps


def _delete_all(ckpt_dir: str) -> list[int]:
    """:func:`start_over`'s deletes, its checks passed and the lock held."""
    steps = committed_steps(ckpt_dir)
    names = [n for n in os.listdir(ckpt_dir) if parse_step_dirname(n) is not None]
    for name in names:
        # Renamed first, so that a crash mid-delete leaves a leftover, never a half step.
        os.replace(os.path.join(ckpt_dir, name), os.path.join(ckpt_dir, f"{name}.deleting.tmp"))
    fsync_dir(ckpt_dir)
    for path in leftovers(ckpt_dir):  # a step moved aside to be replaced, too: not put back
        if os.path.isdir(path) and not os.path.islink(path):
            shutil.rmtree(path, ignore_errors=True)
        else:
            _unlink(path)
    for name in os.listdir(ckpt_dir):
        if name in (LATEST, UNLOADABLE) or name.startswith(PROBE_PREFIX):
            _unlink(os.path.join(ckpt_dir, name))
    fsync_dir(ckpt_dir)
    return steps
