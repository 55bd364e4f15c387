"""Loading with reshard: each local tensor of the new layout reads only what overlaps it.

The pure planner (:func:`checkpoint.planner.plan_reads`) says which saved chunks feed which
part of a local tensor; this shell reads them and copies (header offsets checked against
the manifest). With ``verify`` (the default) every verify block read is checked against
its CRC-32C: a block is a run of whole rows of a chunk (format version 3; the whole chunk
in versions 1 and 2), so a load that needs some rows of a chunk reads and checks only the
blocks holding them. They are read (``pread``) in pieces of about a MiB into a private
buffer, checked there, and only then copied into the local tensor, the same rows of
strips side by side in one strided copy (a second thread that reads and checks the next
piece while the first copies exists, :data:`THREADED`, off by default: slower with more
ranks than cores). Without ``verify``, the same pieces are read and copied unchecked.
No checkpoint file is memory-mapped: one truncated while it is read (by a concurrent
writer, or on purpose) fails the load with an error, never with a SIGBUS.

Nothing in a checkpoint is trusted before it is checked: the manifest is parsed and
checked whole (:meth:`Manifest.from_json`), and each tensor file is opened only as a
regular file of the manifest's size, its header checked against that size.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import time
import zlib
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import crc32c
import torch
import torch.distributed as dist

from checkpoint import store
from checkpoint.comm import (
    all_gather_json,
    all_gather_json_small,
    broadcast_json,
    group_rank,
    group_size,
)
from checkpoint.errors import (
    CheckpointError,
    CheckpointReadError,
    CorruptCheckpointError,
    FormatError,
    LayoutMismatchError,
    NoCheckpointError,
    UnsupportedVersionError,
)
from checkpoint.manifest import MAX_MANIFEST_BYTES as MAX_MANIFEST_BYTES
from checkpoint.manifest import (
    Manifest,
    TensorEntry,
    dtype_name,
    quoted,
)
from checkpoint.planner import (
    ReadOp,
    assign_writers,
    blocks_for_rows,
    chunk_rows,
    plan_reads,
    row_bytes,
)
from checkpoint.seal import TAG_HEX, SealError, macs_match
from checkpoint.shards import ShardInfo
from checkpoint.step import CheckpointFiles, LoadStats, _OpenFile, step_to_open
from checkpoint.stfile import (
    blocks_match,
    pread_into,
)

log = logging.getLogger("checkpoint.load")

Sharded = tuple[torch.Tensor, ShardInfo]


@dataclass(frozen=True, slots=True)
class _Part:
    """Whole verify blocks of one chunk: ``nbytes`` from ``offset`` of the file, and their
    checksums, concatenated (``block`` bytes each; the last block may be shorter)."""

    f: _OpenFile
    key: str
    offset: int
    nbytes: int
    block: int
    crc: str
    mac: str = ""
    """Their MACs, concatenated (a sealed step opened with its key), or ""."""


@dataclass(frozen=True, slots=True)
class _Read:
    """One piece of a verified load: its parts read one after another into a buffer and
    checked, then ``view(shape)[src]`` of the buffer copied into ``dest`` (one copy, for the
    same rows of several strips too)."""

    parts: tuple[_Part, ...]
    nbytes: int
    dtype: torch.dtype
    shape: tuple[int, ...]
    src: tuple[slice, ...]
    dest: torch.Tensor


PIECE_BYTES = 1 << 20
"""Most bytes of one piece of a verified load (whole verify blocks; at least one block of
each strip): read, checked and copied out of a buffer small enough to stay in the CPU's
cache in between."""


class Checkpoint(CheckpointFiles):
    """One committed checkpoint, opened for reading (:class:`CheckpointFiles`, whose
    checks every read goes through).

    It holds its step directory open (``dir_fd``) and opens every file in that very
    directory: a step directory renamed, or replaced by a symlink to somewhere else, once
    it was opened (a swap race) does not change what is read."""

    def __init__(
        self, path: str, manifest: Manifest, dir_fd: int, key: bytes | None = None
    ) -> None:
        super().__init__(path, manifest, dir_fd, key)
        self.rank_tensors: dict[str, torch.Tensor] = {}
        """The tensors of ``load_latest(rank_tensors=...)`` this step holds, read, checked."""

    # -- reading ------------------------------------------------------------------------------

    def load_into(
        self,
        model: Mapping[str, Sharded],
        optimizer: Mapping[str, Sharded] | None = None,
        *,
        verify: bool = True,
    ) -> LoadStats:
        """Fill each local tensor's region (``ShardInfo``) from the checkpoint, in place."""
        t0 = time.perf_counter()
        wanted = [(name, t, info) for name, (t, info) in model.items()]
        wanted += [(f"optimizer/{name}", t, info) for name, (t, info) in (optimizer or {}).items()]
        self._fill_many(
            [
                (
                    name,
                    dest[tuple(slice(0, s) for s in info.sizes)],
                    (info.offsets, info.sizes),
                    info.global_shape,
                )
                for name, dest, info in wanted
            ],
            verify,
        )
        self.stats.seconds += time.perf_counter() - t0
        return self.stats

    def read(self, name: str, *, verify: bool = True) -> torch.Tensor:
        """A whole global tensor, assembled. Its chunks' files are opened and checked (a
        regular file of the manifest's size, its header, each chunk's entry) before the
        tensor is allocated: the chunks tile it, so it is no larger than they are."""
        entry = self._entry(name)
        for chunk in entry.chunks:
            self._chunk_span(chunk, entry)
        check_memory(entry.nbytes, f"{self.path}: {name}")
        try:
            out = torch.empty(entry.shape, dtype=entry.dtype)
        except RuntimeError as exc:  # torch's "can't allocate memory", one line
            raise CheckpointReadError(
                f"{self.path}: {name}: {entry.nbytes / 1e9:.1f} GB could not be allocated "
                f"({str(exc).splitlines()[0] if str(exc) else type(exc).__name__})"
            ) from None
        box = ((0,) * len(entry.shape), entry.shape)
        self._fill(name, out, box, entry.shape, verify)
        return out

    def rank_state(self, rank: int) -> dict[str, torch.Tensor]:
        """The per-rank tensors (RNG states) saved by ``rank``."""
        prefix = f"rank/{rank}/"
        return {
            n.removeprefix(prefix): self.read(n)
            for n, e in self.manifest.tensors.items()
            if e.kind == "rank" and n.startswith(prefix)
        }

    def _fill(self, name, region, box, global_shape, verify) -> None:
        self._fill_many([(name, region, box, global_shape)], verify)

    def _fill_many(self, wanted, verify: bool) -> None:
        """Fill each ``(name, region, box, global_shape)`` from the checkpoint. Verified, the
        reads of all of them go through one pipeline (:meth:`_copy_verified`)."""
        reads: list[_Read] = []
        for name, region, box, global_shape in wanted:
            entry = self._entry(name)
            if tuple(global_shape) != entry.shape:
                raise LayoutMismatchError(
                    f"{quoted(name)}: the model wants shape {list(global_shape)}, "
                    f"the checkpoint has {list(entry.shape)}"
                )
            if region.dtype != entry.dtype:  # never cast: a bool or fp16 "fp32" loaded silently
                raise LayoutMismatchError(
                    f"{quoted(name)}: the model wants dtype {dtype_name(region.dtype)}, "
                    f"the checkpoint has {entry.dtype_name}"
                )
            self.stats.bytes_needed += region.numel() * entry.dtype.itemsize
            ops = plan_reads(quoted(name), box, entry.chunks_within(box), global_shape=entry.shape)
            for group in _strip_groups(entry, ops):
                reads += self._plan_verified(entry, group, region)
        if reads:
            self._copy_verified(reads, check=verify)

    def _plan_verified(self, entry: TensorEntry, ops: list[ReadOp], region) -> list[_Read]:
        """The reads that fill ``region`` with the parts of ``ops``'s chunks they take: the
        verify blocks holding their rows (the same in each: see :func:`_strip_groups`), in
        pieces of at most :data:`PIECE_BYTES` (whole blocks; a version 1 or 2 chunk is one
        block, so one piece). Several strips of a region are copied in one strided copy."""
        op, dtype, k = ops[0], entry.dtype, len(ops)
        sizes = op.chunk.sizes
        spans = [self._chunk_span(o.chunk, entry) for o in ops]
        if not spans[0][2]:  # empty chunks: nothing to read or copy
            return []
        per = entry.rows_per_block(op.chunk)
        row = row_bytes(sizes, dtype.itemsize)
        rows = op.src[0] if sizes else slice(0, 1)
        wanted = blocks_for_rows(rows, per)
        step = max(1, PIECE_BYTES // (k * per * row))  # blocks per piece (of each chunk)
        crcs = [self._crcs(entry, o.chunk, f) for o, (f, _, _) in zip(ops, spans, strict=True)]
        macs = [self._macs(entry, o.chunk, f) for o, (f, _, _) in zip(ops, spans, strict=True)]
        whole = self.manifest.version < 3
        dest = region[op.dst] if k == 1 else _strips_view(region, ops)
        out = []
        for first in range(wanted.start, wanted.stop, step):
            last = min(first + step, wanted.stop)  # blocks [first, last)
            lo, hi = first * per, min(last * per, chunk_rows(sizes))
            take = slice(max(rows.start, lo), min(rows.stop, hi))
            parts = tuple(
                _Part(
                    f=f,
                    key=o.chunk.key,
                    offset=begin + lo * row,
                    nbytes=(hi - lo) * row,
                    block=per * row,
                    crc=crc if whole else crc[8 * first : 8 * last],
                    mac=mac[TAG_HEX * first : TAG_HEX * last],
                )
                for o, (f, begin, _), crc, mac in zip(ops, spans, crcs, macs, strict=True)
            )
            if not sizes:  # a 0-d chunk
                shape, src, into = (), (), dest
            else:
                shape = (hi - lo, *sizes[1:]) if k == 1 else (k, hi - lo, *sizes[1:])
                src = (slice(take.start - lo, take.stop - lo), *op.src[1:])
                if k > 1:
                    src = (slice(None), *src)
                put = slice(take.start - rows.start, take.stop - rows.start)
                into = dest[put] if k == 1 else dest[:, put]
            out.append(_Read(parts, k * (hi - lo) * row, dtype, shape, src, into))
        return out

    def _copy_verified(self, reads: list[_Read], *, check: bool = True) -> None:
        """Carry out ``reads``: each piece is read into a private buffer and its blocks
        checked against their checksums (unless not ``check``: ``verify=False``) before a
        byte of it is copied out. With
        :data:`THREADED`, a second thread reads and checks the next piece while this one
        copies the last (both release the GIL), through two buffers.

        The pieces are read in file order (by file, then offset; each fills its own part
        of a tensor, so the order is free): a load from disk then goes through each file
        front to back, which the kernel's readahead turns into large reads ahead of the
        loader (docs/checkpoint-format.md, Speed)."""
        crc = zlib.crc32 if self.manifest.version == 1 else crc32c.crc32c
        reads = sorted(reads, key=_file_order)
        size = max(r.nbytes for r in reads)
        threaded = THREADED and len(reads) > 1
        # A piece is whole verify blocks (a block at least one row): counted as the
        # tensors are, and refused in one line rather than with torch's traceback.
        if size > 16 * PIECE_BYTES:  # a piece past the usual: blocks of very long rows
            check_memory(size * (1 + threaded), f"{self.path}: a read buffer")
        try:
            buffers = [torch.empty(size, dtype=torch.uint8) for _ in range(1 + threaded)]
        except RuntimeError as exc:  # torch's "can't allocate memory"
            raise CheckpointReadError(
                f"{self.path}: a read buffer of {size / 1e6:.0f} MB could not be allocated "
                f"({str(exc).splitlines()[0] if str(exc) else type(exc).__name__})"
            ) from None
        views = [memoryview(b.numpy()) for b in buffers]

        def fetch(i: int) -> None:
            view = views[i % len(views)]
            _read_parts(reads[i].parts, view)
            if not check and self.key is None:  # a key is checked whatever ``verify`` says
                return
            at = 0
            for p in reads[i].parts:
                if not blocks_match(view[at : at + p.nbytes], p.block, p.crc, crc):
                    raise CorruptCheckpointError(
                        f"{p.f.path}: {quoted(p.key)}: checksum mismatch (corrupted data)"
                    )
                if self.key is not None and not macs_match(
                    view[at : at + p.nbytes], p.block, p.mac, self.key
                ):
                    raise CorruptCheckpointError(
                        f"{p.f.path}: {quoted(p.key)}: MAC mismatch (changed after it was sealed)"
                    )
                at += p.nbytes

        if not threaded:
            for i, r in enumerate(reads):
                fetch(i)
                self._copy_out(r, buffers[i % len(buffers)])
            return
        with ThreadPoolExecutor(1, thread_name_prefix="ckpt-verify") as pool:
            ahead = pool.submit(fetch, 0)
            try:
                for i, r in enumerate(reads):
                    ahead.result()
                    if i + 1 < len(reads):
                        ahead = pool.submit(fetch, i + 1)
                    self._copy_out(r, buffers[i % 2])
            finally:
                ahead.cancel()

    def _copy_out(self, r: _Read, buffer: torch.Tensor) -> None:
        """Copy a piece, read and checked into ``buffer``, to where it goes."""
        self.stats.bytes_read += r.nbytes
        r.dest.copy_(buffer[: r.nbytes].view(r.dtype).view(r.shape)[r.src])


THREADED = False
"""Whether a verified load reads and checks the next piece on a second thread while the
first copies (else one thread does both in turn)."""


def _strip_groups(entry: TensorEntry, ops: list[ReadOp]) -> list[list[ReadOp]]:
    """``ops`` in runs that one strided copy can serve: strips of one region side by side
    (each next one's columns follow the last's in the local tensor), of the same sizes,
    rows per verify block, and part taken. Others stay alone."""
    out: list[list[ReadOp]] = []
    for op in ops:
        if out and len(op.chunk.sizes) >= 2:
            last, first = out[-1][-1], out[-1][0]
            if (
                op.chunk.sizes == first.chunk.sizes
                and op.src == first.src
                and op.dst[0] == first.dst[0]
                and op.dst[2:] == first.dst[2:]
                and op.dst[1].start == last.dst[1].stop
                and entry.rows_per_block(op.chunk) == entry.rows_per_block(first.chunk)
            ):
                out[-1].append(op)
                continue
        out.append([op])
    return out


def _strips_view(region: torch.Tensor, ops: list[ReadOp]) -> torch.Tensor:
    """Where a run of strips (:func:`_strip_groups`) goes in ``region``, as (strip, row,
    column, ...)."""
    first = ops[0]
    width = first.dst[1].stop - first.dst[1].start
    cols = slice(first.dst[1].start, first.dst[1].start + len(ops) * width)
    where = region[(first.dst[0], cols, *first.dst[2:])]
    return where.unflatten(1, (len(ops), width)).transpose(0, 1)


def _file_order(r: _Read) -> tuple[str, int]:
    """Where a piece starts: its file, then its offset there (a piece's parts, the same
    blocks of strips of one region, lie in one file in increasing order)."""
    return r.parts[0].f.path, r.parts[0].offset


def _read_parts(parts: tuple[_Part, ...], view: memoryview) -> None:
    """Read ``parts`` one after another into ``view``; parts that follow each other in one
    file are read in one call. Plain reads, nothing asked of the kernel ahead: its
    readahead, following each file front to back, reads ahead better than
    ``posix_fadvise(WILLNEED)`` of every range did (see :meth:`Checkpoint._copy_verified`)."""
    at, i = 0, 0
    while i < len(parts):
        p, n, j = parts[i], parts[i].nbytes, i + 1
        while j < len(parts) and parts[j].f is p.f and parts[j].offset == p.offset + n:
            n += parts[j].nbytes
            j += 1
        pread_into(p.f.fd, view[at : at + n], p.offset, p.f.path)
        at += n
        i = j


def _read_int(path: str) -> int | None:
    """The integer in a one-line kernel file, or None (absent, unreadable, ``max``)."""
    with contextlib.suppress(OSError, ValueError), open(path, encoding="ascii") as fh:
        return int(fh.read().split()[0])
    return None


def _stat_field(path: str, name: str) -> int:
    with contextlib.suppress(OSError, ValueError, IndexError), open(path, encoding="ascii") as fh:
        for line in fh:
            key, _, value = line.partition(" ")
            if key == name:
                return int(value)
    return 0


UNLIMITED_V1 = 1 << 62
"""cgroup v1 writes "no limit" as a page-rounded 2^63 - 1: anything this large is none."""


def cgroup_headroom(
    proc_cgroup: str = "/proc/self/cgroup", root: str = "/sys/fs/cgroup"
) -> int | None:
    """Bytes this process's memory cgroups let it allocate before the OOM killer acts, or
    None where no limit applies (or none can be read).

    A container's limit (Kubernetes' ``resources.limits.memory``, a Slurm job's cgroup) is
    far below the host's ``MemAvailable``, so the host alone says a tensor fits that gets
    the process killed. Every level from the process's own cgroup up to the root counts
    (a pod's limit sits above its container's): the smallest headroom wins. The page cache
    is not counted as used, as the kernel reclaims it before it kills (its shared memory,
    /dev/shm and tmpfs, is: it cannot be reclaimed without swap): a checkpoint just
    read leaves gigabytes of it, and counting it would refuse what fits. v2 (``0::/path``,
    ``memory.max``) and v1 (the ``memory`` controller, ``memory.limit_in_bytes``) are both
    read; inside a container's cgroup namespace the path is ``/`` and its own files are at
    the mount's top."""
    try:
        with open(proc_cgroup, encoding="ascii") as fh:
            lines = fh.read().splitlines()
    except OSError:
        return None
    best: int | None = None
    for line in lines:
        hid, _, rest = line.partition(":")
        controllers, _, path = rest.partition(":")
        if hid == "0" and controllers == "":
            base, limit, usage, stat, cache = (
                root,
                "memory.max",
                "memory.current",
                "memory.stat",
                ("file", "shmem"),
            )
        elif "memory" in controllers.split(","):
            base = os.path.join(root, "memory")
            limit, usage, stat, cache = (
                "memory.limit_in_bytes",
                "memory.usage_in_bytes",
                "memory.stat",
                ("total_cache", "total_shmem"),
            )
        else:
            continue
        parts = [p for p in path.split("/") if p and p not in (".", "..")]
        for depth in range(len(parts), -1, -1):
            where = os.path.join(base, *parts[:depth])
            cap = _read_int(os.path.join(where, limit))
            if cap is None or cap >= UNLIMITED_V1:
                continue
            used = _read_int(os.path.join(where, usage)) or 0
            # Page cache is reclaimed before the OOM killer acts; shared memory in it
            # (/dev/shm, tmpfs: NCCL, DataLoader workers) is not, without swap.
            stats = os.path.join(where, stat)
            reclaimable = _stat_field(stats, cache[0]) - _stat_field(stats, cache[1])
            used -= min(used, max(0, reclaimable))
            room = max(0, cap - used)
            best = room if best is None else min(best, room)
    return best


def available_memory() -> int | None:
    """Bytes that may still be allocated without swapping or being OOM-killed: the
    kernel's ``MemAvailable``, capped by the process's memory cgroups
    (:func:`cgroup_headroom`); None where neither says."""
    free: int | None = None
    with (
        contextlib.suppress(OSError, ValueError, IndexError),
        open("/proc/meminfo", encoding="ascii") as fh,
    ):
        for line in fh:
            if line.startswith("MemAvailable:"):
                free = int(line.split()[1]) * 1024
                break
    room = cgroup_headroom()
    if room is None:
        return free
    return room if free is None else min(free, room)


def check_memory(nbytes: int, what: str) -> None:
    """Refuse, in one line, to allocate more than the machine has available for one
    tensor: a manifest's shapes are bounded by its files' sizes, and a sparse file is
    large and costs nothing (a hostile 64 GiB tensor on 4 KiB of disk reached
    ``torch.empty``). Raises :class:`CheckpointReadError` (a load stops; nothing marked)."""
    free = available_memory()
    if free is not None and nbytes > free:
        raise CheckpointReadError(
            f"{what}: needs {nbytes / 1e9:.1f} GB of memory, this process has "
            f"{free / 1e9:.1f} GB available (its memory cgroup's limit counted)"
        )


DAMAGED, MISMATCH, NEWER, UNREADABLE = "damaged", "mismatch", "newer", "unreadable"
UNSEALED, INCONSISTENT = "unsealed", "inconsistent"
"""How a step failed to load, as :func:`load_latest` acts on it: ``damaged`` (its content:
fall back, and record it as unloadable), ``mismatch`` (the model does not fit it),
``unsealed`` (a load with a key: the step has no seal, or another key's) and
``inconsistent`` (the ranks opened different saves of the step: its directory was
replaced during the load): fall back, record nothing; ``newer`` (a format version of a
newer build) and ``unreadable`` (permissions, I/O, memory, anything unforeseen): stop,
record nothing."""


def _failure(exc: BaseException) -> str:
    if isinstance(exc, SealError):
        return UNSEALED
    if isinstance(exc, LayoutMismatchError):
        return MISMATCH
    if isinstance(exc, UnsupportedVersionError):
        return NEWER
    if isinstance(exc, (CorruptCheckpointError, FormatError, NoCheckpointError)):
        return DAMAGED
    if isinstance(exc, (FileNotFoundError, NotADirectoryError)):
        return DAMAGED  # a file of the step is missing
    return UNREADABLE


def _warn_passed_over(
    ckpt_dir: str, loaded: int, *, tried: Sequence[int], warn: Callable[[str], None]
) -> None:
    """Say which steps newer than the one loaded were passed over without being tried: a
    step directory whose manifest is empty, unreadable or fails its own checksum counts
    as commit 0 and is ordered below every committed step, so a resume took the step before
    it without a word (no save leaves such a directory: a commit renames its directory
    into place after its manifest is written). Steps tried and failed were said already."""
    with contextlib.suppress(CheckpointError, OSError):
        if not any(s > loaded for s in store.committed_steps(ckpt_dir)):
            return  # the newest step directory loaded (a listing; no manifest read again)
        numbers = store.commit_numbers(ckpt_dir)
        newer = sorted(s for s, c in numbers.items() if c == 0 and s > loaded and s not in tried)
        if newer:
            warn(
                f"{ckpt_dir}: step {_some(newer)}, newer than the step loaded ({loaded}), has "
                "no valid manifest (empty, unreadable or failing its checksum) and was passed "
                "over; `elasticd ckpt verify` says what is wrong"
            )
        # Recorded as failing to load before (``unloadable.json``), so tried last: said, or
        # a stale or planted record hid the newest sound step without a word (a review).
        failed = sorted(s for s in store.failed_steps(ckpt_dir, numbers)
                        if s > loaded and s not in tried)  # fmt: skip
        if failed:
            warn(
                f"{ckpt_dir}: step {_some(failed)}, newer than the step loaded ({loaded}), was "
                f"passed over: {store.UNLOADABLE} records that it failed to load before; "
                "`elasticd ckpt verify --step N` checks it again"
            )


def _some(steps: Sequence[int]) -> str:
    return ", ".join(str(s) for s in steps[:5]) + (", ..." if len(steps) > 5 else "")


def load_latest(
    ckpt_dir: str,
    *,
    model: Mapping[str, Sharded],
    optimizer: Mapping[str, Sharded] | None = None,
    group: dist.ProcessGroup | None = None,
    verify: bool = True,
    warn: Callable[[str], None] = log.warning,
    broadcast: bool = False,
    rank_tensors: Callable[[Manifest], Sequence[str]] | None = None,
    key: bytes | None = None,
    job: str | None = None,
) -> Checkpoint:
    """Load the newest loadable committed checkpoint into the given tensors.

    ``rank_tensors(manifest)``: names of this rank's own tensors (its RNG states) that it
    will use from that step, read with the step where it holds them, into
    ``Checkpoint.rank_tensors``: a corrupted one fails the step like any tensor, so the
    ranks fall back to an older one rather than stop on it. A step whose layout differs
    (the states are not used then) names none.

    With ``broadcast``, a region that several ranks of ``group`` ask for alike (the same
    tensor, offsets and sizes: DP replicas) is read from disk by one of them only (the
    readers balanced by bytes) and sent to the others over ``group`` once every rank has
    loaded its share (:func:`share_plan`); every rank must pass the same ``broadcast``.

    With ``key`` (:mod:`checkpoint.seal`), only a step sealed with it loads, every block
    read checked against its MAC; a step without a seal, or another key's, is fallen back
    past and not recorded as unloadable. With ``job`` too, so is a step sealed for another
    job (its manifest's ``job``): one key shared by two jobs does not let a step of one,
    copied into the other's directory, load there.

    Tries the steps in :func:`checkpoint.store.load_order` (newest commit of the current
    lineage first; `latest` is only a hint). A step that fails is recorded as unloadable
    (retention then never keeps it in place of one that loads). A checkpoint counts as loaded only
    when every rank of ``group`` loaded it; otherwise all ranks fall back together, with a
    warning naming what was wrong. Raises NoCheckpointError when nothing is committed.
    """
    distributed = dist.is_initialized()
    leader = group_rank(group) == 0
    if leader:
        store.recover_replaced(ckpt_dir)  # a step moved aside by a writer that then died
    # Rank 0's order is every rank's (they must try the same steps), so only it reads the
    # manifests' commit numbers.
    order = store.load_order(ckpt_dir, key, job) if leader else None
    if distributed:
        order = broadcast_json(order, group)
    if not order:
        raise NoCheckpointError(f"{ckpt_dir}: no committed checkpoint")
    sends: list[Transfer] = []
    recvs: list[Transfer] = []
    read_model, read_optimizer = model, optimizer
    if broadcast and distributed and group_size(group) > 1:
        sends, recvs, skip = share_plan(model, optimizer or {}, group)
        read_model = {n: v for n, v in model.items() if n not in skip}
        read_optimizer = {
            n: v for n, v in (optimizer or {}).items() if f"optimizer/{n}" not in skip
        }
    failures = []
    unsealed = 0
    for i, step in enumerate(order):
        path = store.step_path(ckpt_dir, step)
        ckpt, error, kind, opened = None, "", "", ""
        try:
            ckpt = Checkpoint.open(path, key=key)
            opened = ckpt.manifest_sha256
            if key is not None and job is not None and ckpt.manifest.job != job:
                raise SealError(
                    f"{path}: sealed by job {quoted(ckpt.manifest.job)}, not {quoted(job)} "
                    "(the same key sealed another job's step)"
                )
            ckpt.load_into(read_model, read_optimizer, verify=verify)
            for name in rank_tensors(ckpt.manifest) if rank_tensors else ():
                if name in ckpt.manifest.tensors:
                    ckpt.rank_tensors[name] = ckpt.read(name)
        except Exception as exc:
            error = str(exc) if isinstance(exc, (CheckpointError, OSError)) else repr(exc)
            kind = _failure(exc)
        # One collective when every rank's message is short (it is, unless a load failed).
        # Each rank opened the step itself, so each says which save it opened (its
        # manifest's sha256): a step directory replaced during the load by another save of
        # the same step (sealed too, with the key) must not give ranks different states.
        mine = [error, kind, opened]
        gathered = all_gather_json_small(mine, group)() if distributed else [mine]
        saves = sorted({o for e, _, o in gathered if not e})
        if len(saves) > 1:
            gathered = [
                [
                    f"the ranks opened {len(saves)} different saves of step {step} (its "
                    "directory was replaced during the load; manifest sha256 "
                    f"{', '.join(o[:16] for o in saves)})",
                    INCONSISTENT,
                    o,
                ]
                for _e, _k, o in gathered
            ]
        errors = [e for e, _, _ in gathered if e]
        stops = [(e, k) for e, k, _ in gathered if k in (NEWER, UNREADABLE)]
        if stops:
            # Not the step's content: no fall back past it (the step would be abandoned
            # by the next commit and pruned), nothing recorded; every rank stops alike.
            if isinstance(ckpt, Checkpoint):
                ckpt.close()
            e, k = next((x for x in stops if x[1] == NEWER), stops[0])
            raise (UnsupportedVersionError if k == NEWER else CheckpointReadError)(
                e
                if k == NEWER
                else f"checkpoint step {step} could not be read ({e}); not falling back past it"
            )
        if not errors:
            if leader:
                store.clear_unloadable(ckpt_dir, step)
                if key is None:
                    _warn_passed_over(ckpt_dir, step, tried=order[:i], warn=warn)
            if sends or recvs:
                t0 = time.perf_counter()
                ckpt.stats.bytes_received += exchange(model, optimizer or {}, sends, recvs, group)
                ckpt.stats.seconds += time.perf_counter() - t0
            return ckpt  # type: ignore[return-value]
        if isinstance(ckpt, Checkpoint):
            ckpt.close()
        failures.append(f"step {step}: {errors[0]}")
        unsealed += any(k == UNSEALED for _, k, _ in gathered)
        if leader and any(k == DAMAGED for _, k, _ in gathered):
            # Retention must never keep it in place of a step that loads.
            try:
                error = next(e for e, k, _ in gathered if k == DAMAGED)
                store.mark_unloadable(ckpt_dir, step, error, key=key, job=job)
            except OSError as exc:
                warn(f"cannot record that step {step} failed to load: {exc}")
        if i + 1 < len(order):  # else the error below says it, once
            warn(
                f"checkpoint step {step} cannot be loaded ({errors[0]}); "
                "falling back to an older one"
            )
    hint = ""
    if unsealed == len(failures):
        # Every step was saved without this key (or with another): say what to do.
        hint = (
            "; none is sealed with the key: seal them (elasticd ckpt seal DIR --key-file "
            "KEY), resume without the key, or start over"
        )
    raise CorruptCheckpointError(
        f"{ckpt_dir}: no committed checkpoint loads: " + "; ".join(failures) + hint
    )


def open_step(ckpt_dir: str, step: int | None = None, *, key: bytes | None = None) -> Checkpoint:
    """Open ``step`` (default: the newest commit, as a load would) of a checkpoint
    directory; with ``key``, only if it is sealed with it."""
    return Checkpoint.open(step_to_open(ckpt_dir, step, key), key=key)


# -- read once, send to the replicas --------------------------------------------------------------

MESSAGE_BYTES = 64 << 20
"""Most bytes packed into one message between two ranks (a larger region goes alone)."""


@dataclass(frozen=True, slots=True)
class Transfer:
    """Regions (by full name: ``optimizer/`` prefixed for optimizer tensors) that ``peer``
    (a group rank) sends to this rank, or this rank sends to ``peer``: one message."""

    peer: int
    names: tuple[str, ...]


def _regions(model: Mapping[str, Sharded], optimizer: Mapping[str, Sharded]):
    out = {name: (t, info) for name, (t, info) in model.items()}
    out.update({f"optimizer/{name}": v for name, v in optimizer.items()})
    return out


def share_plan(
    model: Mapping[str, Sharded], optimizer: Mapping[str, Sharded], group
) -> tuple[list[Transfer], list[Transfer], set[str]]:
    """Which regions this rank reads and sends, receives, and skips reading (a collective:
    every rank's wanted regions are gathered, and every rank computes the same plan).

    Ranks that ask for the same region (name, offsets, sizes, dtype) are its holders; one
    of them reads it, chosen as a save picks writers (largest regions first, each to the
    holder with the fewest bytes so far), and sends it to the others. Returns (sends,
    receives, names this rank does not read)."""
    regions = _regions(model, optimizer)
    mine = [
        [name, list(info.offsets), list(info.sizes), str(t.dtype), info.numel * t.element_size()]
        for name, (t, info) in sorted(regions.items())
    ]
    gathered = all_gather_json(mine, group)
    holders: dict[str, tuple[int, list[int]]] = {}
    for rank, entries in enumerate(gathered):
        for name, offsets, sizes, dtype, nbytes in entries:
            key = json.dumps([name, offsets, sizes, dtype])
            holders.setdefault(key, (nbytes, []))[1].append(rank)
    shared = {k: v for k, v in holders.items() if len(v[1]) > 1}
    readers = assign_writers(shared, ranks=range(len(gathered)))
    me = group_rank(group)
    out: dict[tuple[int, int], list[tuple[str, int]]] = {}
    for key, (nbytes, ranks) in sorted(shared.items()):
        name = json.loads(key)[0]
        for rank in ranks:
            if rank != readers[key]:
                out.setdefault((readers[key], rank), []).append((name, nbytes))
    sends, recvs, skip = [], [], set()
    for (src, dst), names in sorted(out.items()):
        if me not in (src, dst):
            continue
        batch: list[str] = []
        size = 0
        messages = []
        for name, nbytes in names:
            if batch and size + nbytes > MESSAGE_BYTES:
                messages.append(tuple(batch))
                batch, size = [], 0
            batch.append(name)
            size += nbytes
        if batch:
            messages.append(tuple(batch))
        if me == src:
            sends += [Transfer(peer=dst, names=m) for m in messages]
        else:
            recvs += [Transfer(peer=src, names=m) for m in messages]
            skip.update(name for name, _ in names)
    return sends, recvs, skip


def exchange(
    model: Mapping[str, Sharded],
    optimizer: Mapping[str, Sharded],
    sends: list[Transfer],
    recvs: list[Transfer],
    group,
) -> int:
    """Carry out :func:`share_plan`'s transfers (point to point over ``group``, all posted
    at once, so no order between pairs can deadlock); returns the bytes received."""
    regions = _regions(model, optimizer)

    def views(names):
        out = []
        for name in names:
            t, info = regions[name]
            out.append(t[tuple(slice(0, s) for s in info.sizes)])
        return out

    def packed(vs) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """A message buffer and, in it, a view shaped like each region (8-byte aligned)."""
        spans, at = [], 0
        for v in vs:
            spans.append(at)
            at += -(-v.numel() * v.element_size() // 8) * 8
        buf = torch.empty(at, dtype=torch.uint8)
        return buf, [
            buf[a : a + v.numel() * v.element_size()].view(v.dtype).view(v.shape)
            for a, v in zip(spans, vs, strict=True)
        ]

    def peer(rank: int) -> int:
        return dist.get_global_rank(group, rank) if group is not None else rank

    pending = []
    for tr in sends:
        vs = views(tr.names)
        buf, slots = packed(vs)
        for slot, v in zip(slots, vs, strict=True):
            slot.copy_(v)
        pending.append((dist.isend(buf, dst=peer(tr.peer), group=group), buf))
    incoming = []
    for tr in recvs:
        vs = views(tr.names)
        buf, slots = packed(vs)
        incoming.append((dist.irecv(buf, src=peer(tr.peer), group=group), vs, slots))
    received = 0
    for work, vs, slots in incoming:
        work.wait()
        for slot, v in zip(slots, vs, strict=True):
            v.copy_(slot)
            received += v.numel() * v.element_size()
    for work, _ in pending:
        work.wait()
    return received
