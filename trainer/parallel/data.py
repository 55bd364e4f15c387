"""Data parallelism (seed ``003_*``): bucketed gradient all-reduce, overlapped with backward.

Gradients are packed into flat **buckets** of about ``bucket_mb`` MiB, in reverse
parameter order (roughly the order backward produces them). Every parameter's ``grad`` is a
view into its slot of a bucket (set by :meth:`GradSync.zero`), so autograd accumulates
straight into the bucket: no copy per gradient and no second copy of the gradients in
memory. A post-accumulate-grad hook on every parameter counts it in; on the last
micro-batch of a step, once every parameter of a bucket has reported, the bucket's
all-reduce is launched asynchronously while backward carries on with earlier layers. :meth:`finish` waits
once, before the optimizer step, and divides by the data-parallel size.

- With gradient accumulation the hooks still accumulate into the buckets on every
  micro-batch, but communicate only on the last one (:meth:`GradSync.set_sync`).
- Buckets are launched strictly in index order, so every rank issues the same collectives
  in the same order even if their gradients become ready in a different order.
- Dense gradients reduce over dp-cp. Expert gradients reduce over expert-dp: an expert
  lives on one rank of each expert-parallel group and its gradient already sums the tokens
  that every rank of that group sent it. Both are divided by the dp-cp size, because the
  loss on each data-parallel rank is the mean over that rank's share of the global batch.

``overlap=False`` gives the naive baseline for the benchmark: one blocking all-reduce per
parameter after backward.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn

from trainer.parallel.context import GroupSlot


@dataclass(slots=True)
class _Bucket:
    params: list[nn.Parameter]
    buffer: torch.Tensor
    slot: GroupSlot
    views: dict[int, torch.Tensor] = field(default_factory=dict)
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
    ) -> None:
        self.divisor, self.overlap = divisor, overlap
        self._sync = True
        self._lists: list[list[_Bucket]] = []
        self._bucket_of: dict[int, _Bucket] = {}
        for slot, group_params in (
            (dense, [p for p in params if not p.expert]),
            (expert, [p for p in params if p.expert]),
        ):
            buckets = self._make_buckets(list(reversed(group_params)), slot, bucket_bytes)
            self._lists.append(buckets)
        self._hooks = [p.register_post_accumulate_grad_hook(self._on_grad) for p in params]

    @property
    def buckets(self) -> list[_Bucket]:
        return [b for buckets in self._lists for b in buckets]

    def _make_buckets(
        self, params: list[nn.Parameter], slot: GroupSlot, bucket_bytes: int
    ) -> list[_Bucket]:
        groups: list[list[nn.Parameter]] = []
        size = 0
        for p in params:
            if not groups or (size and size + p.numel() * p.element_size() > bucket_bytes):
                groups.append([])
                size = 0
            groups[-1].append(p)
            size += p.numel() * p.element_size()
        buckets = []
        for members in groups:
            numel = sum(p.numel() for p in members)
            buf = torch.zeros(numel, dtype=members[0].dtype, device=members[0].device)
            bucket = _Bucket(params=members, buffer=buf, slot=slot)
            offset = 0
            for p in members:
                bucket.views[id(p)] = buf[offset : offset + p.numel()].view_as(p)
                self._bucket_of[id(p)] = bucket
                offset += p.numel()
            buckets.append(bucket)
        return buckets

    def zero(self) -> None:
        """Start a step: empty every bucket and point every gradient at its bucket slot."""
        for bucket in self.buckets:
            bucket.buffer.zero_()
            bucket.ready, bucket.handle, bucket.launched = 0, None, False
            for p in bucket.params:
                p.grad = bucket.views[id(p)]

    def set_sync(self, sync: bool) -> None:
        """Whether the coming backward is the step's last (the one that communicates)."""
        self._sync = sync

    def _on_grad(self, param: nn.Parameter) -> None:
        bucket = self._bucket_of[id(param)]
        view = bucket.views[id(param)]
        if param.grad.data_ptr() != view.data_ptr():
            # Autograd accumulated elsewhere (the gradient was dropped or replaced since
            # zero()): bring it into the bucket, and accumulate there from now on.
            view.add_(param.grad)
            param.grad = view
        if self._sync and self.overlap:
            bucket.ready += 1
            if bucket.ready == len(bucket.params):
                self._launch_ready()

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
        if bucket.slot.active:
            bucket.handle = dist.all_reduce(bucket.buffer, group=bucket.slot.group, async_op=True)

    def finish(self) -> None:
        """Wait for (or, without overlap, run) the reductions; leave averaged ``p.grad``."""
        if self.overlap:
            for buckets in self._lists:
                for bucket in buckets:
                    if not bucket.launched:  # a parameter that took no part in backward
                        self._launch(bucket)
        for bucket in self.buckets:
            if bucket.handle is not None:
                bucket.handle.wait()
                bucket.handle = None
            elif not self.overlap and bucket.slot.active:
                for p in bucket.params:
                    dist.all_reduce(bucket.views[id(p)], group=bucket.slot.group)
            if self.divisor != 1:
                bucket.buffer.div_(self.divisor)
            for p in bucket.params:
                p.grad = bucket.views[id(p)]

    def close(self) -> None:
        """Remove the hooks (the parameters stay usable without data parallelism)."""
        for h in self._hooks:
            h.remove()
        self._hooks = []
