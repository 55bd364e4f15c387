"""Who owns a checkpoint directory: ``owner.json`` names the job, ``lock`` is held by the run.

- ``<ckpt_dir>/owner.json`` is ``{"job": "<name>", "run_id": "<run>"}``: the job whose
  checkpoints these are (``run_id``, the last run that claimed it, is for information). A
  claim by another job is refused: two jobs pointing at one directory would prune, replace
  and resume from each other's steps. A directory without ``owner.json`` (written before
  owners existed) belongs to the job its newest manifest names.
- ``<ckpt_dir>/lock`` is ``flock``-ed (exclusive, non-blocking) by the claimer for as
  long as it trains, and holds ``{"job", "run_id", "host", "pid"}`` of the holder, and its
  place in the run: ``round`` (``ELASTICD_ROUND``) or ``restart`` (torchrun's
  ``TORCHELASTIC_RESTART_COUNT``). A second run of the same job while the first still
  holds it is refused, naming the holder, unless the claimer is a later process of the
  holder's run: of the holder's round or a later one (an earlier round's process still on
  its way out, or an in-process survivor that kept the lock: the commit fence orders
  those), or of a later torchrun restart; such a claim takes the lock over once the
  holder lets go (:meth:`Claim.retake`, before each save). A run id alone does not make
  the same run: two launches given one ``--rdzv-id`` both start at restart 0, and the
  second is refused (it was let in, and its clean-up deleted the first's save in
  progress). A run id that does not tell runs apart (none, or torchrun's default
  ``none``) is never the same run. On a file system without ``flock`` the claim goes on
  without the lock, and says so.

Standard library only, like :mod:`checkpoint.fence`. Format: docs/checkpoint-format.md,
"Ownership".
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import os
import socket
import stat
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from checkpoint import smallfile
from checkpoint.errors import OwnershipError
from checkpoint.manifest import quoted

OWNER_FILE = "owner.json"
LOCK_FILE = "lock"
_NO_LOCKS = {errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL}
ANONYMOUS_RUNS = frozenset({"", "none"})
"""Run ids that do not tell one run from another: none at all, and torchrun's default
``--rdzv-id`` (``none``). Two processes with one of these are never taken for one run."""
CONTENTION_S = 0.5
"""How long a claim retries a held lock before it names the holder: a look by
:func:`held_by` (``ckpt prune``, ``submit --fresh``, ``ckpt inspect``) holds it for a
moment, and must not turn a job away."""
TOOL_PREFIX = "elasticd "
"""The run id a tool's :func:`holding` records (``elasticd ckpt prune``)."""
TOOL_WAIT_S = 300.0
"""How long a claim waits for a tool that holds the lock (its deletes take as long as the
disk needs): a prune that lands between two rounds of a run must not fail the job."""


@dataclass(slots=True)
class Claim:
    """A held claim on a checkpoint directory; :meth:`release` (or process exit) frees it."""

    ckpt_dir: str
    job: str
    run_id: str
    fd: int | None
    """The descriptor holding the flock; None when none is held (no flock there, or the
    same run holds it already)."""
    pending: bool = False
    """The same run's earlier process held the lock at the claim: :meth:`retake` takes it
    over once that one lets go."""
    place: dict | None = None
    """This process's place in its run (:func:`claim`'s ``round_`` / ``restart``), as the
    lock's record holds it."""

    def retake(self) -> bool:
        """Take the lock if the claim is waiting for it (``pending``) and it is free now;
        whether this claim holds it afterwards. Cheap (one non-blocking ``flock``): the
        trainer asks before each save, so a run whose first round found its previous
        round's process still holding the lock does not stay unlocked for good."""
        if self.fd is None and self.pending:
            try:
                fd = _try_lock(self.ckpt_dir)
                if fd is not None:
                    _write_record(fd, job=self.job, run_id=self.run_id,  # closes fd on failure
                                  place=self.place)  # fmt: skip
            except (OSError, OwnershipError):
                return False  # asked again at the next save
            if fd is not None:
                self.fd, self.pending = fd, False
        return self.fd is not None

    def release(self) -> None:
        fd, self.fd = self.fd, None
        self.pending = False
        if fd is not None:
            os.close(fd)  # closing the descriptor releases the flock


def claim(
    ckpt_dir: str,
    *,
    job: str,
    run_id: str,
    newest_job: Callable[[], str | None] = lambda: None,
    warn: Callable[[str], None] = lambda _msg: None,
    round_: int | None = None,
    restart: int | None = None,
) -> Claim:
    """Take ``ckpt_dir`` for ``job`` (run ``run_id``), or raise :class:`OwnershipError`.

    ``round_``: this process's rendezvous round under an elasticd agent; else ``restart``:
    its torchrun restart count. They tell a later process of the holder's run (let in,
    pending) from a second launch that shares its run id (refused); with neither, a held
    lock is always refused.

    ``newest_job()`` names the job of the newest committed manifest, asked only when there
    is no ``owner.json`` yet."""
    os.makedirs(ckpt_dir, exist_ok=True)
    place: dict = {}
    if round_ is not None:
        place["round"] = round_
    elif restart is not None:
        place["restart"] = restart
    fd, pending = _lock(ckpt_dir, job=job, run_id=run_id, warn=warn, place=place)
    try:
        owner = read_owner(ckpt_dir)
        if owner is None:
            found = newest_job()
            if found and found != job:
                raise OwnershipError(
                    f"checkpoint directory {ckpt_dir} holds checkpoints of job {found!r}, "
                    f"not {job!r}: give this job its own checkpoint.dir"
                )
        elif owner.get("job") != job:
            raise OwnershipError(
                f"checkpoint directory {ckpt_dir} belongs to job {owner.get('job')!r} "
                f"({OWNER_FILE}), not {job!r}: give this job its own checkpoint.dir"
            )
        if owner != {"job": job, "run_id": run_id}:
            _write_atomic(os.path.join(ckpt_dir, OWNER_FILE), {"job": job, "run_id": run_id})
    except BaseException:
        if fd is not None:
            os.close(fd)
        raise
    return Claim(ckpt_dir=ckpt_dir, job=job, run_id=run_id, fd=fd, pending=pending, place=place)


def held_by(ckpt_dir: str) -> dict | None:
    """Who holds the directory's lock right now (its record), or None when nobody does (or
    the file system has no flock). Takes and drops the lock to find out."""
    path = os.path.join(ckpt_dir, LOCK_FILE)
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return None  # not a lock file anybody holds
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        return _holder(fd)
    except OSError:
        return None
    finally:
        os.close(fd)
    return None


@contextlib.contextmanager
def holding(ckpt_dir: str, *, what: str, job: str = "") -> Iterator[dict | None]:
    """Hold the directory's lock for the work inside (``ckpt prune``, ``submit --fresh``'s
    deletes), so that no run claims the directory between the look and the deletes.
    Yields None when the work may go on (the lock is held, or cannot be: no flock there, or
    a lock file this process may not write, where only a look is possible), else the
    holder's record: the caller refuses and does nothing. While held, the lock's record
    names ``what`` (``elasticd ckpt prune``) as the run, so a claim turned away names it."""
    deadline = time.monotonic() + CONTENTION_S
    fd = None
    while True:
        try:
            fd = _try_lock(ckpt_dir)
        except OSError as exc:
            if exc.errno not in _NO_LOCKS:
                holder = held_by(ckpt_dir)  # read-only here: look, and let the work fail
                if holder is not None:
                    yield holder
                    return
            break
        if fd is not None:
            try:
                _write_record(fd, job=job, run_id=what)
            except OSError:
                fd = None  # closed: no record can be written (a full disk); go on unlocked
            break
        holder = held_by(ckpt_dir)
        if holder is not None or time.monotonic() >= deadline:
            yield holder or {}
            return
        time.sleep(0.02)  # held for a moment by a look
    try:
        yield None
    finally:
        if fd is not None:
            os.close(fd)


def read_owner(ckpt_dir: str) -> dict | None:
    """The parsed ``owner.json``, or None when there is none. An unreadable one refuses:
    anything but a small regular file (a symlink, a FIFO, a device: opened without
    following or blocking), or one that is not an owner record."""
    path = os.path.join(ckpt_dir, OWNER_FILE)
    raw = smallfile.read_small(path, error=OwnershipError)
    if raw is None:
        return None
    obj = smallfile.parse_json(raw, where=path, what="an owner record", error=OwnershipError)
    if not isinstance(obj, dict) or not isinstance(obj.get("job"), str):
        raise OwnershipError(f"{path}: not an owner record (no job name)")
    return obj


def _lock(
    ckpt_dir: str, *, job: str, run_id: str, warn: Callable[[str], None], place: dict
) -> tuple[int | None, bool]:
    """``(descriptor holding the lock, pending)``; pending when the same run holds it."""
    path = os.path.join(ckpt_dir, LOCK_FILE)
    start = time.monotonic()
    deadline = start + CONTENTION_S
    waited = False
    while True:
        try:
            fd = _try_lock(ckpt_dir)
        except OSError as exc:
            if exc.errno in _NO_LOCKS:
                warn(f"{path}: this file system has no flock ({exc.strerror}); not locked")
                return None, False
            raise
        if fd is not None:
            _write_record(fd, job=job, run_id=run_id, place=place)
            return fd, False
        # None: let go meanwhile, or held for a moment by a look (held_by, shared).
        holder = held_by(ckpt_dir) or {}
        same_run = run_id not in ANONYMOUS_RUNS and holder.get("run_id") == run_id
        if same_run and holder.get("job") == job and _follows(place, holder):
            return None, True  # this run's own earlier process; the commit fence orders us
        tool = str(holder.get("run_id", "")).startswith(TOOL_PREFIX)
        if tool and time.monotonic() < start + TOOL_WAIT_S:
            if not waited:
                warn(f"{path}: held by {quoted(holder['run_id'])} "
                     f"(pid {quoted(holder.get('pid', '?'))}); waiting for it to finish")  # fmt: skip
                waited = True
            time.sleep(0.1)
            continue
        if time.monotonic() < deadline:
            time.sleep(0.02)
            continue
        raise OwnershipError(
            f"checkpoint directory {ckpt_dir} is in use by {describe_holder(holder)}; wait "
            "for it to end or give this job another checkpoint.dir"
        )


def describe_holder(holder: dict) -> str:
    """``run R of job J (pid P on H)`` from a lock's record, each field quoted (a record
    is anyone's to write: a newline in it must not make a message two lines)."""
    run = f"run {quoted(holder['run_id'])} of " if holder.get("run_id") else ""  # a plain run
    return (f"{run}job {quoted(holder.get('job') or '?')} (pid {quoted(holder.get('pid', '?'))} "
            f"on {quoted(holder.get('host', '?'))})")  # fmt: skip


def _follows(place: dict, holder: dict) -> bool:
    """Whether a claimer at ``place`` is a later process of the holder's run: of the same
    or a later round (an agent's rounds; the fence orders their commits), or of a later
    torchrun restart (after a failure; the earlier one is on its way out. After a
    membership change torchrun stops every worker before it starts the new ones, which
    keep the restart count: the old ones hold no lock by then). A holder's record with no
    place (written by a build before places, e.g. during an upgrade mid-run) is taken as
    before: the same run id follows."""
    if "round" not in holder and "restart" not in holder:
        return True
    mine, theirs = place.get("round"), holder.get("round")
    if mine is not None:
        return type(theirs) is int and theirs <= mine
    mine, theirs = place.get("restart"), holder.get("restart")
    return mine is not None and type(theirs) is int and theirs < mine


def _try_lock(ckpt_dir: str) -> int | None:
    """The lock file's descriptor with the exclusive flock taken, or None when somebody
    holds it. Raises OSError (``_NO_LOCKS``: no flock on this file system) and
    :class:`OwnershipError` (the lock file is not a regular file)."""
    path = os.path.join(ckpt_dir, LOCK_FILE)
    flags = os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
    fd = os.open(path, flags, 0o644)
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise OwnershipError(f"{path}: not a regular file, so it cannot be the lock")
        if st.st_nlink > 1:  # a hard link to another file, which the record would overwrite
            raise OwnershipError(
                f"{path}: has {st.st_nlink} links (a hard link to another file), so it "
                "cannot be the lock; remove it"
            )
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        return None
    except BaseException:
        os.close(fd)
        raise
    return fd


def _write_record(fd: int, *, job: str, run_id: str, place: dict | None = None) -> None:
    """Write the holder's record into the lock file ``fd`` holds; on failure (a full disk)
    close ``fd``, so the lock is not left held by a descriptor nobody owns, and raise."""
    record = {"job": job, "run_id": run_id, "host": socket.gethostname(), "pid": os.getpid(),
              **(place or {})}  # fmt: skip
    try:
        os.ftruncate(fd, 0)
        os.pwrite(fd, json.dumps(record).encode(), 0)
    except BaseException:
        os.close(fd)
        raise


def _holder(fd: int) -> dict:
    """The holder's record, or {} for one that is not a JSON object: the content of a lock
    file is anyone's to write (its lock is advisory), so it only ever names, quoted."""
    with contextlib.suppress(OSError, ValueError, UnicodeDecodeError, RecursionError):
        obj = smallfile.loads(os.pread(fd, 1 << 16, 0))
        if isinstance(obj, dict):
            return obj
    return {}


def _write_atomic(path: str, obj: dict) -> None:
    smallfile.write_atomic(path, json.dumps(obj).encode() + b"\n")
