"""Who owns a checkpoint directory: ``owner.json`` names the job, ``lock`` is held by the run.

- ``<ckpt_dir>/owner.json`` is ``{"job": "<name>", "run_id": "<run>"}``: the job whose
  checkpoints these are (``run_id``, the last run that claimed it, is for information). A
  claim by another job is refused: two jobs pointing at one directory would prune, replace
  and resume from each other's steps. A directory without ``owner.json`` (written before
  owners existed) belongs to the job its newest manifest names.
- ``<ckpt_dir>/lock`` is ``flock``-ed (exclusive, non-blocking) by the claimer for as
  long as it trains, and holds ``{"job", "run_id", "host", "pid"}`` of the holder. A second
  run of the same job while the first still holds it is refused, naming the holder, unless
  both are the same run (a previous round's process of this run, still on its way out: the
  commit fence orders those). On a file system without ``flock`` the claim goes on without
  the lock, and says so.

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
from collections.abc import Callable
from dataclasses import dataclass

from checkpoint import smallfile
from checkpoint.errors import OwnershipError

OWNER_FILE = "owner.json"
LOCK_FILE = "lock"
_NO_LOCKS = {errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL}


@dataclass(slots=True)
class Claim:
    """A held claim on a checkpoint directory; :meth:`release` (or process exit) frees it."""

    ckpt_dir: str
    job: str
    run_id: str
    fd: int | None
    """The descriptor holding the flock; None when none is held (no flock there, or the
    same run holds it already)."""

    def release(self) -> None:
        fd, self.fd = self.fd, None
        if fd is not None:
            os.close(fd)  # closing the descriptor releases the flock


def claim(
    ckpt_dir: str,
    *,
    job: str,
    run_id: str,
    newest_job: Callable[[], str | None] = lambda: None,
    warn: Callable[[str], None] = lambda _msg: None,
) -> Claim:
    """Take ``ckpt_dir`` for ``job`` (run ``run_id``), or raise :class:`OwnershipError`.

    ``newest_job()`` names the job of the newest committed manifest, asked only when there
    is no ``owner.json`` yet."""
    os.makedirs(ckpt_dir, exist_ok=True)
    fd = _lock(ckpt_dir, job=job, run_id=run_id, warn=warn)
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
    return Claim(ckpt_dir=ckpt_dir, job=job, run_id=run_id, fd=fd)


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


def _lock(ckpt_dir: str, *, job: str, run_id: str, warn: Callable[[str], None]) -> int | None:
    path = os.path.join(ckpt_dir, LOCK_FILE)
    flags = os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
    fd = os.open(path, flags, 0o644)
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise OwnershipError(f"{path}: not a regular file, so it cannot be the lock")
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = _holder(fd)
        os.close(fd)
        if run_id and holder.get("run_id") == run_id and holder.get("job") == job:
            return None  # this run's own earlier process; the commit fence orders us
        raise OwnershipError(
            f"checkpoint directory {ckpt_dir} is in use by run {holder.get('run_id') or '?'} "
            f"of job {holder.get('job') or '?'} (pid {holder.get('pid', '?')} on "
            f"{holder.get('host', '?')}); wait for it to end or give this job another "
            "checkpoint.dir"
        ) from None
    except OSError as exc:
        os.close(fd)
        if exc.errno in _NO_LOCKS:
            warn(f"{path}: this file system has no flock ({exc.strerror}); not locked")
            return None
        raise
    record = {"job": job, "run_id": run_id, "host": socket.gethostname(), "pid": os.getpid()}
    data = json.dumps(record).encode()
    os.ftruncate(fd, 0)
    os.pwrite(fd, data, 0)
    return fd


def _holder(fd: int) -> dict:
    with contextlib.suppress(OSError, ValueError, UnicodeDecodeError):
        obj = json.loads(os.pread(fd, 1 << 16, 0))
        if isinstance(obj, dict):
            return obj
    return {}


def _write_atomic(path: str, obj: dict) -> None:
    smallfile.write_atomic(path, json.dumps(obj).encode() + b"\n")
