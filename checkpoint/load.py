"""Loading with reshard: each local tensor of the new layout reads only what overlaps it.

The pure planner (:func:`checkpoint.planner.plan_reads`) says which saved chunks feed which
part of a local tensor; this shell reads them and copies. Chunks are viewed in place from
a memory map of the safetensors file (header offsets checked against the manifest). With
``verify`` (the default) every verify block read is checked against its CRC-32C: a block
is a run of whole rows of a chunk (format version 3; the whole chunk in versions 1 and
2), so a load that needs some rows of a chunk reads and checks only the blocks holding
them, then copies its part once into the local tensor. Without ``verify``, only the pages
of the overlap are read.

Nothing in a checkpoint is trusted before it is checked: the manifest is parsed and
checked whole (:meth:`Manifest.from_json`), and each tensor file is opened only as a
regular file of the manifest's size, its header checked against that size.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import mmap
import os
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import torch
import torch.distributed as dist

from checkpoint import store
from checkpoint.comm import all_gather_json, broadcast_json, group_rank, group_size
from checkpoint.errors import (
    CheckpointError,
    CorruptCheckpointError,
    LayoutMismatchError,
    NoCheckpointError,
)
from checkpoint.manifest import MANIFEST, Manifest, TensorEntry, parse_step_dirname, st_code
from checkpoint.planner import (
    ReadOp,
    SavedChunk,
    assign_writers,
    blocks_for_rows,
    plan_reads,
    row_bytes,
)
from checkpoint.shards import ShardInfo
from checkpoint.stfile import (
    block_crc32c,
    chunk_checksum,
    open_regular,
    read_header_fd,
    read_regular,
)

log = logging.getLogger("checkpoint.load")

Sharded = tuple[torch.Tensor, ShardInfo]

MAX_MANIFEST_BYTES = 256 << 20
"""A manifest larger than this is refused before it is read (a real one of a model with
thousands of tensors is a few MB)."""


@dataclass(slots=True)
class LoadStats:
    bytes_read: int = 0
    """Bytes read from tensor files (headers included)."""
    bytes_needed: int = 0
    """Bytes of the regions read from the checkpoint (not those received from a peer)."""
    bytes_received: int = 0
    """Bytes received from other ranks instead of read (``load_latest(broadcast=True)``)."""
    seconds: float = 0.0


@dataclass(slots=True)
class _OpenFile:
    """A tensor file whose size and header were checked, mapped for reading."""

    path: str
    header: dict
    data_start: int
    mm: mmap.mmap


class Checkpoint:
    """One committed checkpoint, opened for reading."""

    def __init__(self, path: str, manifest: Manifest) -> None:
        self.path = path
        self.manifest = manifest
        self.stats = LoadStats()
        self._handles: dict[str, _OpenFile] = {}
        self._checked: dict[tuple[str, str], set[int]] = {}
        """The verify blocks of each chunk (file, key) checked so far (each is read once)."""

    @classmethod
    def open(cls, path: str) -> Checkpoint:
        """Open a committed step directory; an uncommitted one is refused."""
        path = os.path.abspath(path)
        base = os.path.basename(path)
        if parse_step_dirname(base) is None:
            raise NoCheckpointError(
                f"{path}: not a committed checkpoint directory (step-NNNNNNNNN)"
            )
        if not os.path.isdir(path):
            raise NoCheckpointError(f"{path}: no such checkpoint")
        where = os.path.join(path, MANIFEST)
        if not os.path.lexists(where):
            raise NoCheckpointError(f"{path}: has no {MANIFEST}, so it was never committed")
        raw = read_regular(where, max_bytes=MAX_MANIFEST_BYTES)
        return cls(path, Manifest.from_json(raw, where=where))

    @property
    def step(self) -> int:
        return self.manifest.step

    def close(self) -> None:
        self._handles.clear()

    def __enter__(self) -> Checkpoint:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

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
        for name, dest, info in wanted:
            region = dest[tuple(slice(0, s) for s in info.sizes)]
            self._fill(name, region, (info.offsets, info.sizes), info.global_shape, verify)
        self.stats.seconds += time.perf_counter() - t0
        return self.stats

    def read(self, name: str, *, verify: bool = True) -> torch.Tensor:
        """A whole global tensor, assembled."""
        entry = self._entry(name)
        out = torch.empty(entry.shape, dtype=entry.dtype)
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

    def check_files(self) -> None:
        """Open every tensor file as a load would (a regular file of the manifest's size, its
        header checked against that size and its checksum) and match every chunk's header
        entry to the manifest, reading no tensor data. Raises CorruptCheckpointError."""
        for entry in self.manifest.tensors.values():
            for chunk in entry.chunks:
                self._chunk_view(chunk, entry.dtype)

    def _entry(self, name: str):
        entry = self.manifest.tensors.get(name)
        if entry is None:
            raise LayoutMismatchError(f"{self.path}: has no tensor {name!r}")
        return entry

    def _fill(self, name, region, box, global_shape, verify) -> None:
        entry = self._entry(name)
        if tuple(global_shape) != entry.shape:
            raise LayoutMismatchError(
                f"{name}: the model wants shape {list(global_shape)}, "
                f"the checkpoint has {list(entry.shape)}"
            )
        self.stats.bytes_needed += region.numel() * entry.dtype.itemsize
        for op in plan_reads(name, box, entry.chunks, global_shape=entry.shape):
            if verify:
                region[op.dst].copy_(self._read_checked(entry, op))
            elif op.whole_chunk:
                region[op.dst].copy_(self._read_chunk(op.chunk, entry.dtype))
            else:
                region[op.dst].copy_(self._read_slice(op.chunk, op.src, entry.dtype))

    def _handle(self, file: str) -> _OpenFile:
        h = self._handles.get(file)
        if h is not None:
            return h
        path = os.path.join(self.path, file)
        meta = self.manifest.files.get(file)
        if meta is None:
            raise CorruptCheckpointError(f"{path}: not listed in the manifest")
        # The name is a plain one (Manifest checked it); the file must be a regular file
        # of the manifest's size, checked on the descriptor that is then read and mapped.
        fd, size = open_regular(path, expect_bytes=meta.bytes)
        try:
            header, parsed = read_header_fd(fd, size, path)
            self.stats.bytes_read += len(header)
            if hashlib.sha256(header).hexdigest() != meta.header_sha256:
                raise CorruptCheckpointError(f"{path}: header checksum mismatch")
            # A private mapping: tensors viewing it are writable without copying the file.
            mm = mmap.mmap(fd, 0, access=mmap.ACCESS_COPY)
        finally:
            os.close(fd)
        h = _OpenFile(path=path, header=parsed, data_start=len(header), mm=mm)
        self._handles[file] = h
        return h

    def _read_checked(self, entry: TensorEntry, op: ReadOp) -> torch.Tensor:
        """``op``'s part of its chunk, viewed in place from the file's mapping (no copy),
        after every verify block holding its rows matched its checksum (each block is read
        and checked once per checkpoint opened)."""
        chunk, dtype = op.chunk, entry.dtype
        f, view = self._chunk_view(chunk, dtype)
        if not len(view):
            return torch.empty(chunk.sizes, dtype=dtype)[op.src]
        block = entry.rows_per_block(chunk) * row_bytes(chunk.sizes, dtype.itemsize)
        wanted = blocks_for_rows(
            op.src[0] if chunk.sizes else slice(0, 1), entry.rows_per_block(chunk)
        )
        done = self._checked.setdefault((chunk.file, chunk.key), set())
        todo = [b for b in wanted if b not in done]
        # Runs of consecutive blocks, each checked in one call.
        for first, last in _runs(todo):
            part = view[first * block : (last + 1) * block]
            self.stats.bytes_read += len(part)
            if self.manifest.version >= 3:
                ok = block_crc32c(part, block) == entry.crc32[chunk.key][8 * first : 8 * (last + 1)]
            else:  # one block: the whole chunk
                ok = chunk_checksum(self.manifest.version)(part) == entry.crc32[chunk.key]
            if not ok:
                raise CorruptCheckpointError(
                    f"{f.path}: {chunk.key}: checksum mismatch (corrupted data)"
                )
            done.update(range(first, last + 1))
        return torch.frombuffer(view, dtype=dtype).view(chunk.sizes)[op.src]

    def _read_chunk(self, chunk: SavedChunk, dtype: torch.dtype) -> torch.Tensor:
        """A whole chunk, viewed in place from the file's mapping (no copy), unchecked."""
        _, view = self._chunk_view(chunk, dtype)
        self.stats.bytes_read += len(view)
        if not len(view):
            return torch.empty(chunk.sizes, dtype=dtype)
        return torch.frombuffer(view, dtype=dtype).view(chunk.sizes)

    def _chunk_view(self, chunk: SavedChunk, dtype: torch.dtype) -> tuple[_OpenFile, memoryview]:
        """The bytes of a chunk in the file's mapping, after its header entry (whose offsets
        were checked against the file when it was opened) matches the manifest."""
        f = self._handle(chunk.file)
        info = f.header.get(chunk.key)
        nbytes = math.prod(chunk.sizes) * dtype.itemsize
        if (
            not isinstance(info, dict)
            or info.get("dtype") != st_code(dtype)
            or info.get("shape") != list(chunk.sizes)
        ):
            raise CorruptCheckpointError(
                f"{f.path}: {chunk.key}: missing or not as the manifest says"
            )
        begin = f.data_start + info["data_offsets"][0]
        return f, memoryview(f.mm)[begin : begin + nbytes]

    def _read_slice(self, chunk: SavedChunk, src: tuple[slice, ...], dtype: torch.dtype):
        """Only the ``src`` part of a chunk (unverified: ``verify=False``); the pages of the
        mapping that are not touched are not read."""
        _, view = self._chunk_view(chunk, dtype)
        if not len(view):
            return torch.empty(chunk.sizes, dtype=dtype)[src]
        t = torch.frombuffer(view, dtype=dtype).view(chunk.sizes)[src]
        self.stats.bytes_read += t.numel() * dtype.itemsize
        return t


def _runs(blocks: list[int]) -> list[tuple[int, int]]:
    """Runs of consecutive numbers in an ascending list, as (first, last)."""
    out: list[tuple[int, int]] = []
    for b in blocks:
        if out and out[-1][1] == b - 1:
            out[-1] = (out[-1][0], b)
        else:
            out.append((b, b))
    return out


def load_latest(
    ckpt_dir: str,
    *,
    model: Mapping[str, Sharded],
    optimizer: Mapping[str, Sharded] | None = None,
    group: dist.ProcessGroup | None = None,
    verify: bool = True,
    warn: Callable[[str], None] = log.warning,
    broadcast: bool = False,
) -> Checkpoint:
    """Load the newest loadable committed checkpoint into the given tensors.

    With ``broadcast``, a region that several ranks of ``group`` ask for alike (the same
    tensor, offsets and sizes: DP replicas) is read from disk by one of them only (the
    readers balanced by bytes) and sent to the others over ``group`` once every rank has
    loaded its share (:func:`share_plan`); every rank must pass the same ``broadcast``.

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
    order = store.load_order(ckpt_dir)
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
    for i, step in enumerate(order):
        path = store.step_path(ckpt_dir, step)
        ckpt, error, damaged = None, "", False
        try:
            ckpt = Checkpoint.open(path)
            ckpt.load_into(read_model, read_optimizer, verify=verify)
        except Exception as exc:
            error = str(exc) if isinstance(exc, (CheckpointError, OSError)) else repr(exc)
            # A model that does not fit the step (changed shapes or names) is not the
            # step's fault: it is not recorded as unloadable.
            damaged = not isinstance(exc, LayoutMismatchError)
        gathered = all_gather_json([error, damaged], group) if distributed else [[error, damaged]]
        errors = [e for e, _ in gathered if e]
        if not errors:
            if leader:
                store.clear_unloadable(ckpt_dir, step)
            if sends or recvs:
                t0 = time.perf_counter()
                ckpt.stats.bytes_received += exchange(model, optimizer or {}, sends, recvs, group)
                ckpt.stats.seconds += time.perf_counter() - t0
            return ckpt  # type: ignore[return-value]
        if isinstance(ckpt, Checkpoint):
            ckpt.close()
        failures.append(f"step {step}: {errors[0]}")
        if leader and any(d for _, d in gathered):
            # Retention must never keep it in place of a step that loads.
            try:
                store.mark_unloadable(ckpt_dir, step, next(e for e, d in gathered if d))
            except OSError as exc:
                warn(f"cannot record that step {step} failed to load: {exc}")
        if i + 1 < len(order):  # else the error below says it, once
            warn(
                f"checkpoint step {step} cannot be loaded ({errors[0]}); "
                "falling back to an older one"
            )
    raise CorruptCheckpointError(
        f"{ckpt_dir}: no committed checkpoint loads: " + "; ".join(failures)
    )


def open_step(ckpt_dir: str, step: int | None = None) -> Checkpoint:
    """Open ``step`` (default: the newest commit, as a load would) of a checkpoint directory."""
    if step is None:
        order = store.load_order(ckpt_dir)
        if not order:
            raise NoCheckpointError(f"{ckpt_dir}: no committed checkpoint")
        step = order[0]
    return Checkpoint.open(store.step_path(ckpt_dir, step))


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
