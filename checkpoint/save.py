"""Saving: snapshot to reused CPU staging, write in the background, commit atomically.

The shell around :mod:`checkpoint.saveplan`. Only the snapshot stalls the caller; the
writer thread writes and fsyncs this rank's file, then the ranks agree over ``group``
(a collective), and group rank 0 writes the manifest and commits the directory.

``group`` must carry CPU tensors (gloo) and, for async saves, must be used by nothing else
while a save is in flight: the writer thread runs its collectives on it.

With ``SaveOptions.fence`` set, group rank 0 checks ``<ckpt_dir>/fence.json``
(:mod:`checkpoint.fence`) before it touches the directory, right before the commit rename,
before switching `latest` and before retention; a save from a round that is no longer the
job's current one raises :class:`FencedError` on every rank and commits nothing.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import logging
import operator
import os
import secrets
import shutil
import time
from collections.abc import Callable, Mapping
from concurrent import futures
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from checkpoint import store
from checkpoint.comm import (
    all_gather_json,
    all_gather_json_small,
    broadcast_json_small,
    gather_json_to_root,
    group_rank,
    group_size,
)
from checkpoint.errors import (
    CheckpointError,
    FencedError,
    FormatError,
    SaveFailedError,
    SaveRefusedError,
)
from checkpoint.fence import Fence, check_fence
from checkpoint.manifest import (
    INT_LIMIT,
    MANIFEST,
    MAX_MANIFEST_BYTES,
    FileEntry,
    Manifest,
    file_name,
    json_bounds,
)
from checkpoint.planner import relative
from checkpoint.saveplan import FilePlan, LocalEntry, SavePlan, build_save_plan
from checkpoint.shards import ShardInfo
from checkpoint.smallfile import create_new
from checkpoint.stfile import fsync_dir, tensor_bytes, write_all, write_file

log = logging.getLogger("checkpoint.save")

Sharded = tuple[torch.Tensor, ShardInfo]


@dataclass(frozen=True, kw_only=True, slots=True)
class SaveOptions:
    async_: bool = True
    """Return after the snapshot and write in the background."""
    overlap_snapshot: bool = False
    """With ``async_``: return before the snapshot's copies are done, too. They run in the
    background (CPU tensors on a thread, CUDA tensors on a side stream of each device, into
    pinned staging), overlapping what the caller does next, such as the next step's forward
    and backward. The caller must call :meth:`Saver.wait_snapshot` before it changes any tensor it
    saved (the trainer: before its optimizer step); :meth:`Saver.wait`, :meth:`Saver.close`
    and the next save do so themselves."""
    keep: int = 3
    """Committed checkpoints to keep (`latest` is never deleted)."""
    job: str = ""
    """Job name recorded in the manifest."""
    chunk_min_bytes: int = 128 << 10
    """Smallest stored chunk (a strip of a region along its second dimension); a load that
    needs some of a region's columns reads the strips holding them."""
    chunk_max_pieces: int = 8
    """Most strips per written region. More, narrower strips make a reshard that cuts
    columns read less beyond what it needs, but make every copy between a strip and a
    tensor (the save's gather, the load's scatter) one of shorter rows, which is slower
    (docs/checkpoint-format.md, Speed). At most 64 (``checkpoint.manifest.MAX_STRIPS``,
    what a load accepts): more is taken as 64."""
    block_bytes: int = 16 << 10
    """About how many bytes (whole rows) each CRC-32C of a chunk covers: the unit a
    verified load reads and checks, so a reshard that cuts rows reads about what it needs.
    A save whose largest file is over about 52 GB takes larger blocks, so that the file's
    checksums fit the header a load reads (``checkpoint.saveplan.header_block_bytes``).
    At most 64 MiB (``checkpoint.manifest.MAX_BLOCK_BYTES``, what a load accepts): more is
    taken as 64 MiB."""
    fence: Fence | None = None
    """The run and round this saver commits for; None: commits are not fenced."""
    key: bytes | None = field(default=None, repr=False)  # never in a log or a traceback
    """Seal each commit with this secret key (:mod:`checkpoint.seal`: a MAC per verify
    block and one over the manifest); retention then counts only steps sealed with it,
    and for :attr:`job` when that is set (a step another job sealed with the same key
    counts as commit 0). None: unsealed, as before."""
    hook: Callable[[str], None] | None = None
    """Called by group rank 0 at each named point of a commit (``manifest-writing``, right
    before it creates the manifest in the save's directory, ``before-rename``,
    ``replaced-moved-aside``, ``renamed``, ``latest-tmp-written``, ``latest-switched``,
    ``pruning``): the crash tests kill the process there."""


@dataclass(frozen=True, slots=True)
class SaveResult:
    step: int
    committed: bool
    stall_s: float
    """Time the caller was blocked on the host (snapshot, plus everything for a sync save;
    with ``overlap_snapshot``, ``save()`` and :meth:`Saver.wait_snapshot`, whose wait for
    CUDA copies is the device's, not counted here)."""
    total_s: float
    bytes_written: int
    """Bytes this rank wrote."""


class Saver:
    """Saves checkpoints of one rank into ``ckpt_dir``; one save in flight at a time."""

    def __init__(
        self, ckpt_dir: str, *, group: dist.ProcessGroup | None, options: SaveOptions
    ) -> None:
        self.ckpt_dir = ckpt_dir
        self.group = group
        self.options = options
        self.rank = group_rank(group)
        self.world = group_size(group)
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="ckpt-writer")
        # Block checksums, and in a sync save the copy of the next strip that is not
        # contiguous, overlap the writer's writes.
        self._hasher = ThreadPoolExecutor(max_workers=2, thread_name_prefix="ckpt-hash")
        # Retention's deletes run here, after the commit, off the save's critical path.
        self._janitor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="ckpt-prune")
        # The background snapshot's CPU copies (overlap_snapshot), and each device's side
        # stream for its CUDA copies.
        self._stager = ThreadPoolExecutor(max_workers=1, thread_name_prefix="ckpt-stage")
        self._side_streams: dict[torch.device, Any] = {}
        self._staged: _Staged | None = None
        """The snapshot in flight that the caller has not fenced yet."""
        self._snapshot_wait_s = 0.0
        """Time the caller spent in :meth:`wait_snapshot` for the save in flight."""
        self._tidying: Future[None] | None = None
        self._inflight: Future[SaveResult] | None = None
        self._staging: torch.Tensor | None = None
        self._plan_cache: tuple[str, SavePlan, str] | None = None
        """(every rank's entry digests, the plan, this rank's digest) of the last save."""
        self._checked: SavePlan | None = None
        """The plan whose manifest was last read back as a load reads it (``_commit``)."""
        self.last: SaveResult | None = None
        self.staging_allocations = 0
        """How many times the staging buffer was (re)allocated; stays 1 for a fixed layout."""
        os.makedirs(ckpt_dir, exist_ok=True)

    # -- public ---------------------------------------------------------------------------

    def save(
        self,
        *,
        step: int,
        consumed_samples: int,
        model: Mapping[str, Sharded],
        optimizer: Mapping[str, Sharded] | None = None,
        rank_state: Mapping[str, torch.Tensor] | None = None,
        scalars: Mapping[str, Any] | None = None,
        extra: Mapping[str, Any] | None = None,
        layout: Mapping[str, Any] | None = None,
    ) -> None:
        """Checkpoint ``step``. Model/optimizer tensors are (local tensor, ShardInfo) by
        global name; ``rank_state`` tensors belong to this rank only (RNG states).

        ``step`` is an integer in ``[0, 10^9)`` (its directory's name has 9 digits) and
        ``consumed_samples`` one in ``[0, 2^63)``, as a load reads them: anything else raises
        SaveRefusedError here, before anything is done (it would commit a step that no load
        reads)."""
        step = _position("step", step, STEP_LIMIT, "10^9")
        consumed_samples = _position("consumed_samples", consumed_samples, INT_LIMIT, "2^63")
        self.wait()  # the previous save must finish first; its failure surfaces here
        t0 = time.perf_counter()
        self._snapshot_wait_s = 0.0
        local = self._local_tensors(model, optimizer or {}, rank_state or {})
        start: dict[str, Any] = {}
        if self.rank == 0:
            # A stale writer must not even clean up: the leftovers may be a newer world's
            # save in flight. Checked here, the refusal travels to every rank in the plan's
            # collective, so no rank is left waiting in one.
            try:
                self._check_fence(f"checkpoint step {step} was not saved")
            except FencedError as exc:
                start["fenced"] = self._fenced_json(exc)
            else:
                # A name of this save's own, so a save from another world (a stale one, or
                # the newer one) never writes into or deletes this save's directory.
                start["token"] = secrets.token_hex(4)
                tmp = self._tmp(step, start["token"])
                try:
                    os.makedirs(tmp)
                except OSError as exc:  # no inode left, a read-only file system, ...
                    # Told to every rank in the plan's collective, like a refusal.
                    start["error"] = f"checkpoint step {step} was not saved: {tmp}: {exc.strerror}"
                else:
                    # The previous save's retention and the leftovers' deletes run on the
                    # janitor thread, while this save snapshots and writes; the commit
                    # waits for them (rank 0, _write_and_commit).
                    own = os.path.basename(tmp)
                    self._defer(lambda: self._clean(step, own))
        direct = not self.options.async_ and not any(t.is_cuda for t, _, _ in local.values())
        overlap = self.options.async_ and self.options.overlap_snapshot
        # A sync save on CPU writes straight from the tensors (nothing can change them
        # before it returns); an async one snapshots into staging first, while the plan's
        # collective is in flight when the plan is likely the last one (an overlapped one
        # starts its copies once the plan is known, and returns).
        early = (
            None if direct or overlap else (lambda p: self._snapshot(p.files.get(self.rank), local))
        )
        # A collective: it also orders rank 0's mkdir before every rank's write.
        plan, token, data = self._plan(step, local, start, early)
        tmp = self._tmp(step, token)
        mine = plan.files.get(self.rank)
        staged = None
        if data is None:
            if direct:
                data = self._direct_parts(mine, local)
            else:
                data = self._snapshot(mine, local, background=overlap)
                staged = self._staged
        head = {
            "step": step,
            "consumed_samples": consumed_samples,
            "scalars": dict(scalars or {}),
            "extra": dict(extra or {}),
            "layout": dict(layout) if layout is not None else None,
            "tmp": tmp,
            "token": token,
        }
        stall = time.perf_counter() - t0
        if self.options.async_:
            self._inflight = self._pool.submit(
                self._write_and_commit, plan, mine, data, head, t0, stall, staged
            )
        else:
            self.last = self._write_and_commit(plan, mine, data, head, t0, None)

    def check(self) -> None:
        """Raise now if a background save has failed (cheap; call once per step)."""
        if self._inflight is not None and self._inflight.done():
            self.wait()

    def wait_snapshot(self) -> None:
        """Return once the tensors of the last save may change: with ``overlap_snapshot``,
        its CPU copies are done, and each device's current stream waits for its CUDA copies
        (a wait on the GPU, not here: work queued after this on that stream, such as the
        optimizer step, runs after the copies). Cheap when there is nothing to wait for;
        a failed copy does not raise here (it fails the save: :meth:`wait`)."""
        staged, self._staged = self._staged, None
        if staged is not None:
            t = time.perf_counter()
            staged.wait_caller()
            self._snapshot_wait_s += time.perf_counter() - t

    def wait(self) -> SaveResult | None:
        """Block until the save in flight is committed; raise SaveFailedError if it was not."""
        self.wait_snapshot()
        fut, self._inflight = self._inflight, None
        if fut is None:
            return None
        try:
            result = fut.result()
        except SaveFailedError:
            raise
        except Exception as exc:
            raise SaveFailedError(f"checkpoint save failed in the background: {exc}") from exc
        if self.options.async_ and self.options.overlap_snapshot:
            result = dataclasses.replace(result, stall_s=result.stall_s + self._snapshot_wait_s)
        self.last = result
        return result

    def close(self) -> None:
        """Wait for the save in flight and its retention, then stop the writer threads."""
        try:
            self.wait()
            self._wait_tidy()
        finally:
            self._pool.shutdown(wait=True)
            self._hasher.shutdown(wait=True)
            self._janitor.shutdown(wait=True)
            self._stager.shutdown(wait=True)

    def _wait_tidy(self) -> None:
        fut, self._tidying = self._tidying, None
        if fut is not None:
            fut.result()  # tidy_warned never raises: its failures are warnings

    def _defer(self, func) -> None:
        self._tidying = self._janitor.submit(func)  # FIFO: it runs after the earlier ones

    def _clean(self, step: int, own: str) -> None:
        """Delete the store's leftovers but this save's own directory, the fence checked
        right before (a stale writer must not even clean up)."""
        try:
            self._check_fence(f"checkpoint step {step}: leftovers not deleted")
            store.remove_leftovers(self.ckpt_dir, spare=own)
        except Exception as exc:  # the commit's own fence check refuses a stale save
            log.warning("checkpoint step %d: deleting leftovers failed: %s", step, exc)

    def abandon(self) -> None:
        """Stop without waiting (an error path: peers of an in-flight save may be gone).
        The uncommitted step stays a `.tmp` leftover for the next save to clean. A snapshot
        in flight is waited for first (local copies: they end without any peer), so the caller
        may change the tensors once this returns."""
        try:
            self.wait_snapshot()
        except Exception as exc:  # a broken device: nothing more to wait for
            log.warning("checkpoint: waiting for the abandoned snapshot failed: %s", exc)
        self._inflight = None
        self._pool.shutdown(wait=False, cancel_futures=True)
        self._hasher.shutdown(wait=False, cancel_futures=True)
        self._janitor.shutdown(wait=False, cancel_futures=True)
        self._stager.shutdown(wait=False, cancel_futures=True)

    # -- snapshot ---------------------------------------------------------------------------

    def _local_tensors(
        self, model, optimizer, rank_state
    ) -> dict[str, tuple[torch.Tensor, ShardInfo, str]]:
        out: dict[str, tuple[torch.Tensor, ShardInfo, str]] = {}
        for name, (t, info) in model.items():
            out[name] = (t, info, "model")
        for name, (t, info) in optimizer.items():
            out[f"optimizer/{name}"] = (t, info, "optimizer")
        for name, t in rank_state.items():
            full = f"rank/{self.rank}/{name}"
            out[full] = (t, ShardInfo.whole(full, tuple(t.shape)), "rank")
        return out

    def _plan(self, step: int, local, start: dict[str, Any], early=None):
        """The save plan, this save's token (from rank 0's ``start``, which carries the
        fence's refusal instead when rank 0 was fenced: then every rank raises it), and
        ``early(plan)``'s result or None.

        When this rank holds what it held at the last save, ``early`` (the snapshot) runs
        with the last plan while the collective is in flight; it is kept only if every
        rank's entries are unchanged too (the plan is then the same). Nothing can change
        the tensors before save() returns, so a snapshot redone after is the same."""
        entries = [
            LocalEntry(
                name=name,
                kind=kind,
                dtype=t.dtype,
                shape=info.global_shape,
                offsets=info.offsets,
                sizes=info.sizes,
            )
            for name, (t, info, kind) in local.items()
        ]
        mine = [e.to_json() for e in entries]
        digest = hashlib.sha256(json.dumps(mine).encode()).hexdigest()
        # One small collective when every rank holds what it held at the last save (the
        # plan is then the cached one); the entries themselves travel only otherwise.
        finish = all_gather_json_small({"step": step, "digest": digest, "start": start}, self.group)
        done = None
        try:
            if early is not None and self._plan_cache and self._plan_cache[2] == digest:
                done = early(self._plan_cache[1])
        finally:
            gathered = finish()  # every rank takes part, whatever happened here
        start = gathered[0]["start"]
        if "fenced" in start:
            raise self._fenced_from_json(start["fenced"])
        if "error" in start:
            raise SaveFailedError(start["error"])
        steps = {g["step"] for g in gathered}
        if steps != {step}:
            raise CheckpointError(f"ranks are saving different steps: {sorted(steps)}")
        signature = repr([g["digest"] for g in gathered])
        if self._plan_cache is not None and self._plan_cache[0] == signature:
            return self._plan_cache[1], start["token"], done
        gathered = all_gather_json(mine, self.group)
        per_rank = [[LocalEntry.from_json(e) for e in g] for g in gathered]
        plan = build_save_plan(
            per_rank,
            # At least a byte: a region of no elements (none a column) stays one strip,
            # as a load requires.
            chunk_min_bytes=max(1, self.options.chunk_min_bytes),
            chunk_max_pieces=self.options.chunk_max_pieces,
            block_bytes=self.options.block_bytes,
            only=self.rank,
            sealed=self.options.key is not None,
        )
        self._plan_cache = (signature, plan, digest)
        return plan, start["token"], None

    @staticmethod
    def _direct_parts(mine: FilePlan | None, local):
        """Each slot's bytes straight from its tensor (a copy only of a piece that is not
        contiguous, made when the writer reaches it)."""

        def part(i: int) -> memoryview:
            c = mine.copies[i]
            src, info, _ = local[c.name]
            return tensor_bytes(src[relative(c.box, info.offsets)].detach())

        return part

    def _snapshot(self, mine: FilePlan | None, local, *, background: bool = False):
        """Copy this rank's share into the staging buffer, reused across saves: each region
        whole, as it lies in its tensor (one contiguous copy, device to pinned memory on a
        GPU), so the caller waits for nothing else. The strips of a region that are not
        contiguous there are gathered later, on the writer's side (:func:`write_file`).

        ``background`` (``overlap_snapshot``): the copies are only started: CPU ones on the
        stager thread, CUDA ones on each device's side stream (which first waits for the
        device's current stream, so they copy what the caller's queued work leaves); the
        caller waits for them (:meth:`wait_snapshot`), the writer waits for them (``_Staged.ready``)."""
        need = mine.data_bytes if mine else 0
        gpus = {t.device for t, _, _ in local.values() if t.is_cuda}
        on_gpu = bool(gpus)
        if self._staging is None or self._staging.numel() < need:
            self._staging = torch.empty(need, dtype=torch.uint8, pin_memory=on_gpu)
            self.staging_allocations += 1
        data = self._staging[:need]
        held, on_cpu = [], []
        sides = {d: self._side_stream(d) for d in gpus} if background else {}
        for device, side in sides.items():
            side.wait_stream(torch.cuda.current_stream(device))
        try:
            for r in mine.regions if mine else ():
                src, info, _ = local[r.name]
                src = src[relative(r.box, info.offsets)].detach()
                view = data[r.begin : r.end].view(r.dtype).view(r.box[1])
                held.append(view)
                if not background:
                    view.copy_(src, non_blocking=on_gpu)
                elif not src.is_cuda:
                    on_cpu.append((view, src))
                else:
                    with torch.cuda.stream(sides[src.device]):
                        view.copy_(src, non_blocking=True)
                    # The caching allocator must not hand the source's memory to other
                    # work on the current stream before the side stream's copy is done.
                    src.record_stream(sides[src.device])
        finally:
            if background:
                # Recorded even when a copy failed to start: the ones queued before it
                # are still waited for (wait_snapshot, abandon) before staging is reused.
                events = {}
                for device, side in sides.items():
                    events[device] = torch.cuda.Event(blocking=True)  # a waiter sleeps
                    events[device].record(side)
                self._staged = _Staged(None, events)
        if background:
            if on_cpu:
                self._staged.copied = self._stager.submit(_copy_pairs, on_cpu)
        else:
            # The copies ran on each device's current stream: wait for that stream only (a
            # device-wide synchronize would also wait for other streams' work, such as a
            # collective in flight on its own stream).
            for device in gpus:
                torch.cuda.current_stream(device).synchronize()

        def part(i: int) -> memoryview:
            c = mine.copies[i]
            return tensor_bytes(held[c.region][relative(c.box, mine.regions[c.region].box[0])])

        return part

    def _side_stream(self, device: torch.device):
        side = self._side_streams.get(device)
        if side is None:
            side = self._side_streams[device] = torch.cuda.Stream(device)
        return side

    # -- write and commit (writer thread for async saves) --------------------------------

    def _tmp(self, step: int, token: str) -> str:
        return f"{store.step_path(self.ckpt_dir, step)}.{token}.tmp"

    # -- the fence ------------------------------------------------------------------------------

    def _check_fence(self, what: str) -> None:
        check_fence(self.ckpt_dir, self.options.fence, what=what)

    @staticmethod
    def _fenced_json(exc: FencedError) -> dict[str, Any]:
        return {
            "error": str(exc),
            "writer": exc.writer.to_dict() if exc.writer is not None else None,
            "current": exc.current.to_dict() if exc.current is not None else None,
        }

    @staticmethod
    def _fenced_from_json(obj: dict[str, Any]) -> FencedError:
        """Rank 0's refusal, raised the same on every rank."""
        writer, current = obj["writer"], obj["current"]
        return FencedError(
            obj["error"],
            writer=Fence(**writer) if writer is not None else None,
            current=Fence(**current) if current is not None else None,
        )

    def _write_and_commit(self, plan, mine, data, head, t0, stall, staged=None) -> SaveResult:
        step, tmp = head["step"], head["tmp"]
        report: dict[str, Any] = {"ok": True}
        written = 0
        try:
            if staged is not None:
                staged.ready()  # the background snapshot's copies are done
            if mine is not None:
                w = write_file(
                    os.path.join(tmp, mine.name),
                    mine.slots,
                    data,
                    hasher_pool=self._hasher,
                    key=self.options.key,
                )
                written = w.bytes
                # The chunks' checksums stay in the file's header (format version 4).
                report["file"] = {
                    "name": mine.name,
                    "bytes": w.bytes,
                    "header_sha256": w.header_sha256,
                }
        except Exception as exc:  # reported to every rank, then raised below
            report = {"ok": False, "error": f"rank {self.rank}: {exc}"}
            if isinstance(exc, SaveRefusedError):
                report["refused"] = True
        # Only rank 0 needs the reports (it commits, then tells every rank the outcome),
        # in one gather of buffers sized from the plan.
        cap = self._report_cap(plan)
        reports = gather_json_to_root(_fit_report(report, cap, self.rank), self.group, cap=cap)
        status: dict[str, Any] = {"committed": False, "error": ""}
        if self.rank == 0:
            status["error"] = "; ".join(r["error"] for r in reports if not r["ok"])
            if any(r.get("refused") for r in reports):
                status["refused"] = True
            if not status["error"]:
                try:
                    self._wait_tidy()  # retention and leftovers, before the commit number
                    self._commit(plan, reports, head)
                    status = {"committed": True, "error": ""}
                except FencedError as exc:
                    status = {
                        "committed": False,
                        "error": str(exc),
                        "fenced": self._fenced_json(exc),
                    }
                except SaveRefusedError as exc:
                    status = {"committed": False, "error": f"rank 0: {exc}", "refused": True}
                except Exception as exc:
                    status = {"committed": False, "error": f"rank 0: commit: {exc}"}
            if not status["committed"]:
                shutil.rmtree(tmp, ignore_errors=True)  # this save's own directory only
        status = broadcast_json_small(status, self.group)
        if "fenced" in status:
            raise self._fenced_from_json(status["fenced"])
        if not status["committed"]:
            error = SaveRefusedError if status.get("refused") else SaveFailedError
            raise error(f"checkpoint step {step} was not committed: {status['error']}")
        total = time.perf_counter() - t0
        return SaveResult(
            step=step,
            committed=True,
            stall_s=total if stall is None else stall,
            total_s=total,
            bytes_written=written,
        )

    @staticmethod
    def _report_cap(plan: SavePlan) -> int:
        """The bytes of JSON every rank's report of a save with ``plan`` fits in (the same
        on every rank: it comes from the plan alone): the longest file's report (its name,
        size and header checksum), plus room for an error instead."""
        longest = max((len(file_name(r)) for r in plan.writers), default=0)
        return longest + 4096

    def _commit(self, plan: SavePlan, reports: list[dict[str, Any]], head: dict[str, Any]) -> None:
        step = head["step"]
        files = {}
        for rank, r in enumerate(reports):
            if "file" in r:
                f = r["file"]
                files[f["name"]] = FileEntry(
                    name=f["name"],
                    bytes=f["bytes"],
                    sha256="",
                    header_sha256=f["header_sha256"],
                    rank=rank,
                )
        tensors = plan.tensor_entries()
        manifest = Manifest(
            step=step,
            consumed_samples=head["consumed_samples"],
            job=self.options.job,
            world=self.world,
            layout=head["layout"],
            files=files,
            tensors=tensors,
            optimizer=head["scalars"],
            extra=head["extra"],
            created_unix=time.time(),
            commit=store.next_commit(self.ckpt_dir, key=self.options.key, job=self.options.job),
            writer=(
                {"run_id": self.options.fence.run_id, "round": self.options.fence.round}
                if self.options.fence is not None
                else None
            ),
        )
        where = "the manifest this save would commit"
        body = manifest.to_json(key=self.options.key)
        if len(body) > MAX_MANIFEST_BYTES:
            # Every load would refuse it: never commit a step that cannot be loaded.
            raise SaveRefusedError(
                f"the manifest of {sum(len(t.chunks) for t in tensors.values())} chunks would "
                f"take {len(body)} bytes, more than the {MAX_MANIFEST_BYTES} a load reads"
            )
        json_bounds(body, where, max_bytes=MAX_MANIFEST_BYTES, error=SaveRefusedError)
        try:
            if self._checked is not plan:
                # Read back as every load reads it, once per plan: a step no load would
                # read, for any of the reader's bounds (chunks, corners, keys, strips), is
                # never committed.
                Manifest.from_json(body, where=where)
                self._checked = plan
            else:
                # What it lists is the plan's, read back already; what else a save writes
                # (scalars, extra, layout: nesting, NaN) is read back at every save, alone.
                # Without the density bound, checked on the whole body above: the layout's
                # groups alone ([[0],[1],...] at 32 ranks) are denser than a manifest
                # may be, and were refused at every second save.
                alone = dataclasses.replace(manifest, files={}, tensors={})
                Manifest.from_json(alone.to_json(), where=where, density=False)
        except FormatError as exc:
            raise SaveRefusedError(str(exc)) from None
        tmp, token = head["tmp"], head["token"]
        path = os.path.join(tmp, MANIFEST)
        if self.options.hook:
            self.options.hook("manifest-writing")
        fd = create_new(path)  # never through a symlink planted at its name
        try:
            write_all(fd, body)
            os.fsync(fd)
        finally:
            os.close(fd)
        fsync_dir(tmp)
        store.commit_step(
            self.ckpt_dir,
            step=step,
            tmp=tmp,
            token=token,
            keep=self.options.keep,
            check=self._check_fence,
            log=log.info,
            warn=log.warning,
            hook=self.options.hook,
            commit=manifest.commit,
            defer=self._defer,
            key=self.options.key,
            job=self.options.job,
        )


STEP_LIMIT = 10**9
"""Steps a checkpoint can hold: ``step-NNNNNNNNN`` names 9 digits."""


def _position(what: str, value: Any, limit: int, shown_limit: str) -> int:
    """``value`` (``step`` or ``consumed_samples``) as an int in ``[0, limit)``, as a load
    reads it; else SaveRefusedError (never a committed step that no load reads)."""
    n = None
    if not isinstance(value, bool):
        with contextlib.suppress(TypeError):
            n = operator.index(value)  # an integer of any kind, never a float cut short
    if n is None or not 0 <= n < limit:
        shown = repr(value) if len(repr(value)) <= 80 else repr(value)[:77] + "..."
        raise SaveRefusedError(
            f"checkpoint {what} {shown} is not an integer in [0, {shown_limit}): not saved "
            "(no load would read it)"
        )
    return n


class _Staged:
    """A background snapshot's copies in flight (``overlap_snapshot``): the CPU ones as one
    task of the stager thread, the CUDA ones as an event recorded on each device's side
    stream after them."""

    __slots__ = ("copied", "events")

    def __init__(self, copied: Future[None] | None, events: dict[torch.device, Any]) -> None:
        self.copied, self.events = copied, events

    def wait_caller(self) -> None:
        """The caller's side: return once the CPU copies are done, with each device's
        current stream made to wait for that device's copies."""
        if self.copied is not None:
            futures.wait([self.copied])
        for device, event in self.events.items():
            torch.cuda.current_stream(device).wait_event(event)

    def ready(self) -> None:
        """The writer's side: block until every copy is done; a failed one raises (after
        the device copies are done too: the staging may be reused once this returns)."""
        try:
            if self.copied is not None:
                self.copied.result()
        finally:
            for event in self.events.values():
                event.synchronize()


def _copy_pairs(pairs: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
    for into, src in pairs:
        into.copy_(src)


def _fit_report(report: dict[str, Any], cap: int, rank: int) -> dict[str, Any]:
    """``report``, or an error report that fits ``cap`` bytes of JSON when it does not (a
    long error message is cut; a file's report never outgrows its plan's cap)."""
    size = len(json.dumps(report, separators=(",", ":")))
    if size <= cap:
        return report
    if report.get("ok"):
        return {"ok": False, "error": f"rank {rank}: a report of {size} bytes, over {cap}"}
    # At most 6 bytes of JSON per character (\uXXXX), and the cap is at least 4096.
    cut = {"ok": False, "error": report["error"][: cap // 8] + " ..."}
    return {**cut, "refused": True} if report.get("refused") else cut
