"""Data parallelism (seed ``003_*``): bucketed gradient reduction, overlapped with backward.

Gradients are packed into flat fp32 **buckets** of about ``bucket_mb`` MiB, in reverse
parameter order (roughly the order backward produces them). A post-accumulate-grad hook
on every parameter counts it in; on the last micro-batch of a step, once every parameter
of a bucket has reported, the bucket's reduction is launched asynchronously while backward
carries on with earlier layers. :meth:`finish` waits once, before the optimizer step, and
divides by the data-parallel size. The reduced gradients are the optimizer's **main
gradients** (:meth:`GradSync.main_grad`; :class:`trainer.optim.MainParams` binds them).

How a gradient reaches its bucket depends on the parameter's dtype and on ``shard``:

- **fp32 parameters, no sharding**: every ``param.grad`` is a view into its slot of a bucket
  (set by :meth:`GradSync.zero`), so autograd accumulates straight into the bucket: no copy
  per gradient and no second copy of the gradients in memory.
- **bf16 parameters** (mixed precision): autograd's gradient has the parameter's dtype, so
  it cannot live in an fp32 bucket. The hook adds each micro-batch's bf16 gradient into the
  fp32 slot and drops it (``param.grad = None``), as Megatron's ``main_grad`` hook does:
  gradients are *accumulated* across micro-batches and *reduced* in fp32, and only one
  micro-batch's bf16 gradient is alive at a time.
- **Sharded** (``parallel.zero: 1``): each bucket is laid out rank-major, like FSDP2's
  reduce-scatter input: the part of group rank r holds, for each of the bucket's parameters,
  the rows :func:`dim0_rows` gives rank r (padded to the same count on every rank). The hook
  adds the gradient's rows into their places (one strided add, so gradients are not views
  here: the copy FSDP2 makes too), and the bucket is **reduce-scattered**: each rank
  receives the sum of its own rows only, into a buffer 1/dp of the bucket's size.

- With gradient accumulation the hooks still accumulate into the buckets on every
  micro-batch, but communicate only on the last one (:meth:`GradSync.set_sync`).
- Buckets are launched strictly in index order, so every rank issues the same collectives
  in the same order even if their gradients become ready in a different order.
- Dense gradients reduce over dp-cp. Expert gradients reduce over expert-dp: an expert
  lives on one rank of each expert-parallel group and its gradient already sums the tokens
  that every rank of that group sent it. Both are divided by the dp-cp size, because the
  loss on each data-parallel rank is the mean over that rank's share of the global batch.

``overlap=False`` gives the naive baseline for the benchmark: one blocking all-reduce per
parameter after backward (sharded: every bucket's reduce-scatter, after backward).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn

from elasticd.inprocess import wait_collective
from trainer.parallel import comm
from trainer.parallel.context import GroupSlot


def dim0_rows(rows: int, parts: int, index: int) -> tuple[int, int]:
    """Rows ``[start, stop)`` of a tensor with ``rows`` rows that part ``index`` of
    ``parts`` holds, cut as ``torch.chunk`` (and FSDP2) cut: ``ceil(rows / parts)`` rows
    each, so the last parts may be short or empty."""
    per = -(-rows // parts)
    start = min(rows, index * per)
    return start, min(rows, start + per)


@dataclass(slots=True)
class _Slot:
    """Where one parameter's gradient lives in a sharded (rank-major) bucket."""

    offset: int  # start in every rank's part
    per: int  # rows per rank (the padded count)
    row: int  # elements per row


@dataclass(slots=True)
class _Bucket:
    params: list[nn.Parameter]
    buffer: torch.Tensor
    slot: GroupSlot
    views: dict[int, torch.Tensor] = field(default_factory=dict)
    shards: dict[int, _Slot] = field(default_factory=dict)
    part: int = 0  # elements of one rank's part (sharded buckets)
    recv: torch.Tensor | None = None  # this rank's reduced part (sharded buckets)
    ready: int = 0
    handle: object | None = None
    launched: bool = False


class GradSync:
    """Owns every parameter's gradient storage and its data-parallel reduction."""

    def __init__(
        self,
        params: list[nn.Parameter],
        *,
        dense: GroupSlot,
        expert: GroupSlot,
        divisor: int,
        bucket_bytes: int,
        overlap: bool = True,
        grad_dtype: torch.dtype | None = None,
        shard: bool = False,
    ) -> None:
        """``grad_dtype``: the buckets' dtype (default: the parameters'; the trainer
        passes fp32). ``shard``: reduce-scatter rank-major buckets (ZeRO-1) instead of
        all-reducing them."""
        self.divisor, self.overlap, self.shard = divisor, overlap, shard
        self.grad_dtype = grad_dtype
        self._sync = True
        self._lists: list[list[_Bucket]] = []
        self._bucket_of: dict[int, _Bucket] = {}
        for slot, group_params in (
            (dense, [p for p in params if not p.expert]),
            (expert, [p for p in params if p.expert]),
        ):
            buckets = self._make_buckets(list(reversed(group_params)), slot, bucket_bytes)
            self._lists.append(buckets)
        if all(self._lists):
            # One list, in backward order, the same on every rank. Which list's bucket is
            # ready first depends on each rank's backward (an expert no token reached
            # takes no part in it). On one communicator for both (ep 1: the same ranks;
            # ProcessGroups shares the group) its collectives must be issued in one order
            # on every rank. On two (ep > 1) so must they: NCCL needs the same order
            # across communicators too, or two ranks that issued them crosswise wait on
            # each other wherever their kernels cannot run side by side
            # (CUDA_DEVICE_MAX_CONNECTIONS=1, as Megatron sets it, serialises them).
            where = {id(p): i for i, p in enumerate(reversed(params))}
            merged = sorted((b for bs in self._lists for b in bs),
                            key=lambda b: where[id(b.params[0])])  # fmt: skip
            self._lists = [merged]
        self._hooks = [p.register_post_accumulate_grad_hook(self._on_grad) for p in params]

    @property
    def buckets(self) -> list[_Bucket]:
        return [b for buckets in self._lists for b in buckets]

    def _dtype(self, p: nn.Parameter) -> torch.dtype:
        return self.grad_dtype or p.dtype

    def _make_buckets(
        self, params: list[nn.Parameter], slot: GroupSlot, bucket_bytes: int
    ) -> list[_Bucket]:
        groups: list[list[nn.Parameter]] = []
        size = 0
        for p in params:
            nbytes = p.numel() * self._dtype(p).itemsize
            if not groups or (size and size + nbytes > bucket_bytes):
                groups.append([])
                size = 0
            groups[-1].append(p)
            size += nbytes
        buckets = []
        for members in groups:
            make = self._make_sharded if self.shard else self._make_flat
            buckets.append(make(members, slot))
        return buckets

    def _make_flat(self, members: list[nn.Parameter], slot: GroupSlot) -> _Bucket:
        numel = sum(p.numel() for p in members)
        p0 = members[0]
        buf = torch.zeros(numel, dtype=self._dtype(p0), device=p0.device)
        bucket = _Bucket(params=members, buffer=buf, slot=slot)
        offset = 0
        for p in members:
            bucket.views[id(p)] = buf[offset : offset + p.numel()].view_as(p)
            self._bucket_of[id(p)] = bucket
            offset += p.numel()
        return bucket

    def _make_sharded(self, members: list[nn.Parameter], slot: GroupSlot) -> _Bucket:
        part = 0
        shards = {}
        for p in members:
            rows = p.shape[0]
            per = -(-rows // slot.size)
            shards[id(p)] = _Slot(offset=part, per=per, row=p.numel() // rows)
            part += per * (p.numel() // rows)
        p0 = members[0]
        # Padding rows are never written, so they stay zero and add nothing.
        buf = torch.zeros(slot.size * part, dtype=self._dtype(p0), device=p0.device)
        recv = torch.zeros(part, dtype=buf.dtype, device=buf.device) if slot.active else buf
        bucket = _Bucket(params=members, buffer=buf, slot=slot, shards=shards, part=part,
                         recv=recv)  # fmt: skip
        for p in members:
            self._bucket_of[id(p)] = bucket
        return bucket

    # -- where the reduced gradients are -------------------------------------------------

    @property
    def nbytes(self) -> int:
        """Bytes of gradient storage this rank holds (buckets and reduce-scatter outputs)."""
        total = 0
        for b in self.buckets:
            total += b.buffer.numel() * b.buffer.element_size()
            if b.recv is not None and b.recv is not b.buffer:
                total += b.recv.numel() * b.recv.element_size()
        return total

    def rows(self, param: nn.Parameter) -> tuple[int, int]:
        """The rows of ``param`` whose reduced gradient this rank holds (all of them
        unless sharded)."""
        bucket = self._bucket_of[id(param)]
        if not self.shard:
            return 0, param.shape[0]
        return dim0_rows(param.shape[0], bucket.slot.size, bucket.slot.rank)

    def shards(self, param: nn.Parameter) -> int:
        """Into how many parts ``param``'s reduced gradient is cut (1 unless sharded)."""
        return self._bucket_of[id(param)].slot.size if self.shard else 1

    def main_grad(self, param: nn.Parameter) -> torch.Tensor:
        """``param``'s reduced gradient (after :meth:`finish`), in the buckets' dtype: the
        whole of it, or this rank's rows when sharded."""
        bucket = self._bucket_of[id(param)]
        if not self.shard:
            return bucket.views[id(param)]
        s = bucket.shards[id(param)]
        start, stop = self.rows(param)
        return bucket.recv[s.offset : s.offset + (stop - start) * s.row].view(
            stop - start, *param.shape[1:]
        )

    # -- one step --------------------------------------------------------------------------

    def zero(self) -> None:
        """Start a step: empty every bucket and point every gradient that can live in its
        bucket at its slot (the others start as None)."""
        for bucket in self.buckets:
            bucket.buffer.zero_()
            bucket.ready, bucket.handle, bucket.launched = 0, None, False
            for p in bucket.params:
                p.grad = self._view_for(bucket, p)

    def _view_for(self, bucket: _Bucket, p: nn.Parameter) -> torch.Tensor | None:
        if self.shard or bucket.buffer.dtype != p.dtype:
            return None
        return bucket.views[id(p)]

    def set_sync(self, sync: bool) -> None:
        """Whether the coming backward is the step's last (the one that communicates)."""
        self._sync = sync

    def _on_grad(self, param: nn.Parameter) -> None:
        bucket = self._bucket_of[id(param)]
        if self.shard:
            self._add_rows(bucket, param)
            param.grad = None
        else:
            view = bucket.views[id(param)]
            if param.grad.data_ptr() != view.data_ptr():
                # A gradient of another dtype (bf16), or one dropped or replaced since
                # zero(): add it into the slot (fp32), and accumulate there from now on.
                view.add_(param.grad)
                param.grad = self._view_for(bucket, param)
        if self._sync and self.overlap:
            bucket.ready += 1
            if bucket.ready == len(bucket.params):
                self._launch_ready()

    @staticmethod
    def _add_rows(bucket: _Bucket, param: nn.Parameter) -> None:
        """Add ``param.grad`` into the rank-major bucket: rank r's rows to rank r's part."""
        s = bucket.shards[id(param)]
        size = bucket.slot.size
        grid = bucket.buffer.view(size, bucket.part)[:, s.offset : s.offset + s.per * s.row]
        grad = param.grad.reshape(-1)
        rows = param.shape[0]
        full = rows // s.per
        if full:
            grid[:full].add_(grad[: full * s.per * s.row].view(full, s.per * s.row))
        rest = (rows - full * s.per) * s.row
        if rest:
            grid[full, :rest].add_(grad[full * s.per * s.row :])

    def _launch_ready(self) -> None:
        for buckets in self._lists:
            for bucket in buckets:
                if bucket.launched:
                    continue
                if bucket.ready < len(bucket.params):
                    break  # keep the launch order identical on every rank
                self._launch(bucket)

    def _launch(self, bucket: _Bucket) -> None:
        bucket.launched = True
        if not bucket.slot.active:
            return
        group = bucket.slot.group
        if self.shard:
            bucket.handle = comm.reduce_scatter_base(
                bucket.recv, bucket.buffer, group=group, async_op=True
            )
        else:
            bucket.handle = dist.all_reduce(bucket.buffer, group=group, async_op=True)

    def finish(self) -> None:
        """Wait for (or, without overlap, run) the reductions; leave averaged main
        gradients (and ``p.grad`` where it is a view into its bucket)."""
        if self.overlap or self.shard:
            for buckets in self._lists:
                for bucket in buckets:
                    if not bucket.launched:  # a parameter that took no part in backward
                        self._launch(bucket)
        for bucket in self.buckets:
            if bucket.handle is not None:
                # Left when its in-process round ends (gloo can leave it waiting).
                wait_collective(bucket.handle, bucket.slot.group)
                bucket.handle = None
            elif not self.overlap and bucket.slot.active and not self.shard:
                for p in bucket.params:
                    comm.all_reduce(bucket.views[id(p)], bucket.slot.group)
            if self.divisor != 1:
                (bucket.recv if self.shard else bucket.buffer).div_(self.divisor)
            for p in bucket.params:
                p.grad = self._view_for(bucket, p)

    def gather(self, shards: dict[int, torch.Tensor]) -> None:
        """After the optimizer step (sharded): all-gather every parameter from the ranks'
        updated rows. ``shards`` maps ``id(param)`` to this rank's rows of it (any dtype;
        cast to the parameter's); a parameter with no rows here may be left out."""
        work = []
        for bucket in self.buckets:
            p0 = bucket.params[0]
            size = bucket.slot.size
            send = torch.zeros(bucket.part, dtype=p0.dtype, device=p0.device)
            for p in bucket.params:
                mine = shards.get(id(p))
                if mine is not None and mine.numel():
                    s = bucket.shards[id(p)]
                    send[s.offset : s.offset + mine.numel()].copy_(mine.reshape(-1))
            if not bucket.slot.active:
                work.append((bucket, send, None, send))
                continue
            out = torch.empty(size * bucket.part, dtype=p0.dtype, device=p0.device)
            handle = comm.all_gather_base(out, send, group=bucket.slot.group, async_op=True)
            work.append((bucket, out, handle, send))
        with torch.no_grad():
            for bucket, out, handle, send in work:
                grid = out.view(bucket.slot.size, bucket.part)
                if handle is not None:
                    wait_collective(handle, bucket.slot.group)
                    # This rank's own rows come from its own memory, not from the gathered
                    # output: an NCCL all-gather aborted at its round's end leaves garbage
                    # there, and in fp32 those rows are the main shard itself (a view of
                    # the parameter), the state recovery takes from this rank, its only
                    # holder.
                    grid[bucket.slot.rank].copy_(send)
                for p in bucket.params:
                    s = bucket.shards[id(p)]
                    cols = grid[:, s.offset : s.offset + s.per * s.row]
                    flat = p.view(-1)
                    full = p.shape[0] // s.per
                    if full:
                        flat[: full * s.per * s.row].view(full, -1).copy_(cols[:full])
                    rest = p.numel() - full * s.per * s.row
                    if rest:
                        flat[full * s.per * s.row :].copy_(cols[full, :rest])

    def close(self) -> None:
        """Remove the hooks (the parameters stay usable without data parallelism)."""
        for h in self._hooks:
            h.remove()
        self._hooks = []

    def release(self) -> None:
        """Remove the hooks and let go of every bucket's storage: for a trainer that will
        not step again (kept only as the state an in-process recovery offers)."""
        self.close()
        for b in self.buckets:
            b.buffer = torch.empty(0, dtype=b.buffer.dtype, device=b.buffer.device)
            b.recv = None if b.recv is None else b.buffer
            b.views.clear()
            b.handle = None
