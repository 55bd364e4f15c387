"""In-memory replicas of the trainer's state on other nodes (``checkpoint.memory_replicas``).

A TP or PP shard with no data-parallel replica dies with its node; without a copy
elsewhere, in-process recovery must go back to the last checkpoint on disk. With
``memory_replicas: k`` every active rank, every ``memory_every`` steps (after the
optimizer step), copies its parameters and AdamW tensors into a host *snapshot* and sends
it, asynchronously, to its counterparts (the active rank with its index on that node) on
the next k nodes. With equal ranks per node each rank keeps k replicas, of k other nodes'
ranks. The receivers keep the bytes in host memory; nothing is written to disk.

On a fault, :func:`trainer.recovery.recover` offers the planner, beside each survivor's
live tensors (at step s), its snapshot and every replica whose transfer completed (both at
the last replicated step S ≤ s). The planner takes the highest step at which every region
the new layout needs has a holder: s when the survivors alone cover it (a DP shrink: no
step lost), else S, from snapshots and replicas (s − S steps lost, recomputed), else the
checkpoint on disk.

The snapshot is the send buffer, so a rank never sends tensors that the next optimizer
step is changing. The transfer runs in gloo's background threads while training goes on;
the next replication first waits for the previous one (back-pressure, when a transfer takes
longer than ``memory_every`` steps). A replica whose transfer had not completed when the
fault came is not offered. So that one is always whole, both sides keep two buffers and
alternate: the replica of the previous replication stays until the next one has landed,
and the sender's snapshot of that step with it (the survivors' own regions are needed at
the same step as the dead node's). A recovery from replicas therefore goes back to the
newest replicated step whose transfer completed: at most ``2 × memory_every`` steps,
plus the one in flight. Before the first replication completed, only the checkpoint
covers a lost shard.

Costs, per rank: host memory of two snapshots of its own state plus two per rank it keeps
a replica of (4× its state at k = 1); per replication, one device-to-host copy of its state
and its bytes sent once over the network (in the background).

On CUDA the copy into the (pinned) snapshot does not hold the loop up: it is queued on a
side stream of the device, after the work the current stream had queued (the optimizer
step that made the state), and the next step's forward and backward run while it lands.
Only the send waits for it: a helper thread waits for the copy's event, marks the snapshot
and posts the sends. The state must not change before the copy has read it:
:meth:`Replicator.wait_copied` makes the current stream wait for the copy (on the device;
the host goes on), and the trainer calls it before each optimizer step
(``Trainer._update``); :meth:`Replicator.held` does so too, before recovery writes into
the tensors. The live tensors are ``record_stream``-ed on the side stream, so that memory
freed meanwhile (a load that replaces a tensor) is not reused before the copy is done. On
the CPU the copy is made in the loop, as before, and sent at once.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Mapping
from concurrent import futures
from concurrent.futures import Future
from typing import Any

import torch
import torch.distributed as dist

from checkpoint.comm import all_gather_json, group_rank
from checkpoint.live import Held, Holding
from checkpoint.shards import ShardInfo

log = logging.getLogger("trainer.replicas")

HEADER = 16
"""Bytes before the tensors in every buffer: the step and consumed_samples (int64 each)."""
ALIGN = 16
TAG = 1 << 20
"""Base tag of replica messages (``TAG + sender rank``), apart from recovery's chunk tags."""


def _aligned(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


def _entries(holding: Holding) -> dict[str, list[Any]]:
    """JSON of each tensor: dtype, local shape, and its ShardInfo (global shape, offsets,
    sizes); enough for a receiver to lay out the bytes and name them."""
    return {
        key: [
            str(t.dtype).removeprefix("torch."),
            list(t.shape),
            list(info.global_shape),
            list(info.offsets),
            list(info.sizes),
        ]
        for key, (t, info) in sorted(holding.items())
    }


class _Buffer:
    """A flat host buffer: the header, then each tensor at a 16-byte aligned offset."""

    def __init__(self, entries: Mapping[str, list[Any]], *, pinned: bool) -> None:
        layout, at = [], HEADER
        for key, (dtype, shape, gshape, offs, sizes) in entries.items():
            dt = getattr(torch, dtype)
            n = dt.itemsize
            for d in shape:
                n *= d
            layout.append((key, dt, tuple(shape), at, n, ShardInfo(key, tuple(gshape),
                                                                   tuple(offs), tuple(sizes))))  # fmt: skip
            at = _aligned(at + n)
        self.flat = torch.empty(at, dtype=torch.uint8, pin_memory=pinned)
        self.tensors: dict[str, tuple[torch.Tensor, ShardInfo]] = {
            key: (self.flat[a : a + n].view(dt).view(shape), info)
            for key, dt, shape, a, n, info in layout
        }
        self.step: int | None = None
        self.consumed: int | None = None

    def header(self) -> tuple[int, int]:
        step, consumed = self.flat[:HEADER].view(torch.int64).tolist()
        return int(step), int(consumed)

    def held(self) -> Held | None:
        if self.step is None or self.consumed is None:
            return None
        return Held(step=self.step, consumed=self.consumed, tensors=self.tensors)


def targets(nodes: list[Any], active: list[int], rank: int, copies: int) -> list[int]:
    """The ranks that keep ``rank``'s replicas, at most ``copies`` (pure): on each of the
    next nodes (cyclic, in the order of their first active rank), the active rank with
    ``rank``'s index among its own node's active ranks (wrapped when that node has fewer).
    With equal ranks per node every rank keeps ``copies`` replicas, each of a different
    node's rank: no rank takes a whole node's."""
    if rank not in active or copies <= 0:
        return []
    per_node: dict[Any, list[int]] = {}
    for r in active:
        per_node.setdefault(nodes[r], []).append(r)
    order = list(per_node)
    mine = per_node[nodes[rank]]
    i, index = order.index(nodes[rank]), mine.index(rank)
    out = []
    for j in range(1, min(len(order), copies + 1)):
        members = per_node[order[(i + j) % len(order)]]
        out.append(members[index % len(members)])
    return out


class Replicator:
    """One round's replication; built collectively by every rank of ``group`` (spares
    pass ``live=None``: they neither send nor keep replicas). ``live()`` returns the rank's
    parameters and AdamW tensors by global name; it is called at each replication, so a
    checkpoint load that replaces tensors is seen)."""

    def __init__(
        self,
        *,
        live: Callable[[], Holding] | None,
        copies: int,
        every: int,
        node: str,
        group: dist.ProcessGroup | None,
        previous: Replicator | None = None,
    ) -> None:
        """``previous``: the last round's replicator in this process, whose snapshot
        buffers this one shares when this rank's tensors are laid out alike (see
        ``snapshots`` below)."""
        self.every = every
        self.group = group
        self.rank = group_rank(group)
        holding = live() if live is not None else None
        descs = all_gather_json(
            {"node": node, "entries": _entries(holding) if holding is not None else None}, group
        )
        nodes = [d["node"] for d in descs]
        active = [r for r, d in enumerate(descs) if d["entries"] is not None]
        plan = {r: targets(nodes, active, r, copies) for r in active}
        short = [r for r in active if len(plan[r]) < copies]
        if short and self.rank == 0:
            log.warning(
                "checkpoint.memory_replicas: %d: ranks %s have only %s other nodes to keep "
                "their copies", copies, short, sorted({len(plan[r]) for r in short}),
            )  # fmt: skip
        self.live = live
        self.to = plan.get(self.rank, [])
        self._pinned = holding is not None and any(t.is_cuda for t, _ in holding.values())
        self._mine = descs[self.rank]["entries"]
        self._sources = {src: descs[src]["entries"] for src in active if self.rank in plan[src]}
        # Allocated at the first replication, not here: a recovery does not wait for them,
        # and the previous round's copies are still held while this one is being built.
        # The snapshots are the previous round's where this rank's tensors are laid out
        # alike (a data-parallel shrink, a recovery in place): shared, not copied, so a
        # buffer's step and what it holds stay one whichever replicator offers it (the
        # previous one, if a second fault keeps it for the next recovery). So this round
        # offers them at their steps from its start, not only after its first
        # replication (a second fault soon after a recovery still finds them), and makes
        # no new pair (pinned host memory on a GPU, which torch's host allocator keeps
        # cached by size: reused when the size repeats, held beside when it does not).
        same = bool(self.to) and previous is not None and (previous._mine, previous._pinned) == (
            self._mine, self._pinned)  # fmt: skip
        self.snapshots: list[_Buffer] = list(previous.snapshots) if same else []
        self.replicas: dict[int, list[_Buffer]] = {}
        self._sends: list[Any] = []
        self._recvs: dict[int, tuple[Any, _Buffer]] = {}
        # CUDA only: each device's side stream, the last snapshot's copy events, and the
        # helper's future (its send works) while the copy lands and the sends are posted.
        self._streams: dict[torch.device, Any] = {}
        self._copied: dict[torch.device, Any] = {}
        self._posting: Future | None = None
        # The previous round's last copy into the shared snapshots may still be landing.
        self._prior: Future | None = previous._posting if same else None

    def _allocate(self) -> None:
        """Two buffers of each, used in turn: the older is overwritten, the newer stays whole."""
        if self.to and not self.snapshots:
            self.snapshots = [_Buffer(self._mine, pinned=self._pinned) for _ in range(2)]
        for src, entries in self._sources.items():
            if src not in self.replicas:
                self.replicas[src] = [_Buffer(entries, pinned=False) for _ in range(2)]

    @property
    def bytes_held(self) -> int:
        """Host memory of this rank's snapshots and replicas (once allocated)."""
        return sum(b.flat.numel() for b in self._buffers())

    @property
    def enabled(self) -> bool:
        return bool(self.to or self._sources)

    def _buffers(self) -> list[_Buffer]:
        return [*self.snapshots, *(b for pair in self.replicas.values() for b in pair)]

    @staticmethod
    def _older(pair: list[_Buffer]) -> _Buffer:
        """The buffer to overwrite: an empty one, else the one at the lower step."""
        return min(pair, key=lambda b: -1 if b.step is None else b.step)

    def after_step(self, step: int, consumed: int) -> None:
        """After the optimizer step of ``step``: replicate if it is due."""
        if not self.enabled or step % self.every:
            return
        self._allocate()
        if self._prior is not None:  # before a shared snapshot is overwritten: its copy
            # landed (its sends, on the previous round's group, may have failed)
            futures.wait([self._prior])
            self._prior = None
        self._complete(wait=True)
        copying = None
        if self.snapshots and self.live is not None:
            snap = self._older(self.snapshots)
            snap.step = snap.consumed = None  # being overwritten
            if snap.flat.is_pinned():
                copying = snap
                self._copy_on_side_streams(snap)
                snap.flat[:HEADER].view(torch.int64).copy_(torch.tensor([step, consumed]))
            else:
                for key, (t, _info) in self.live().items():
                    snap.tensors[key][0].copy_(t, non_blocking=True)
                snap.flat[:HEADER].view(torch.int64).copy_(torch.tensor([step, consumed]))
                snap.step, snap.consumed = step, consumed
                self._sends = self._send(snap)
        for src, pair in self.replicas.items():
            buf = self._older(pair)
            buf.step = buf.consumed = None  # being overwritten
            work = dist.irecv(buf.flat, group=self.group, group_src=src, tag=TAG + src)
            self._recvs[src] = (work, buf)
        if copying is not None:  # after the receives: the helper's sends are all that
            # touches the group while the loop goes on
            self._posting = self._post_when_copied(copying, step, consumed)

    def _send(self, snap: _Buffer) -> list[Any]:
        return [
            dist.isend(snap.flat, group=self.group, group_dst=dst, tag=TAG + self.rank)
            for dst in self.to
        ]

    def _copy_on_side_streams(self, snap: _Buffer) -> None:
        """Queue the copy of the live tensors into ``snap`` on each device's side stream,
        after what its current stream has queued (the state as the step left it)."""
        live = self.live() if self.live is not None else {}
        devices = {t.device for t, _ in live.values() if t.is_cuda}
        for device in devices:
            if device not in self._streams:
                self._streams[device] = torch.cuda.Stream(device)
            self._streams[device].wait_stream(torch.cuda.current_stream(device))
        events = {}
        try:
            for key, (t, _info) in live.items():
                into = snap.tensors[key][0]
                if not t.is_cuda:  # a host tensor: copied here, at once
                    into.copy_(t)
                    continue
                side = self._streams[t.device]
                with torch.cuda.stream(side):
                    into.copy_(t, non_blocking=True)
                # Memory of a tensor freed meanwhile is not handed out again before the
                # side stream has read it.
                t.record_stream(side)
        finally:  # recorded even when a copy failed to start: the queued ones are waited for
            for device in devices:
                events[device] = torch.cuda.Event(blocking=True)  # a waiter sleeps
                events[device].record(self._streams[device])
            self._copied = events

    def _post_when_copied(self, snap: _Buffer, step: int, consumed: int) -> Future:
        """A daemon thread waits for the snapshot's copies, marks it as holding ``step``
        and posts its sends; the future holds the send works (or the failure)."""
        done: Future = Future()
        events = list(self._copied.values())

        def run() -> None:
            try:
                for event in events:
                    event.synchronize()
                snap.consumed, snap.step = consumed, step
                done.set_result(self._send(snap))
            except BaseException as exc:  # handed to the loop's next wait
                done.set_exception(exc)

        threading.Thread(target=run, name="elasticd-replica-send", daemon=True).start()
        return done

    def _join_posting(self) -> None:
        """Wait for the helper (the copy's landing: short): its sends join ``_sends``."""
        posting, self._posting = self._posting, None
        if posting is not None:
            self._sends.extend(posting.result())

    def wait_copied(self) -> None:
        """Before anything changes the live tensors (the optimizer step): each device's
        current stream waits for the last snapshot's copy from them. On the device only;
        the host goes on. Nothing to do on the CPU (the copy was made in the loop)."""
        for device, event in self._copied.items():
            torch.cuda.current_stream(device).wait_event(event)

    def _complete(self, *, wait: bool) -> None:
        """Mark replicas whose transfer finished (waiting for them if ``wait``)."""
        if wait:
            self._join_posting()
        for work in self._sends if wait else ():
            work.wait()
        if wait:
            self._sends = []
        for src, (work, buf) in list(self._recvs.items()):
            try:
                if not wait and not work.is_completed():
                    continue
                work.wait()
            except Exception:  # the old world broke mid-transfer: that copy is not whole
                del self._recvs[src]
                continue
            del self._recvs[src]
            buf.step, buf.consumed = buf.header()

    def held(self) -> list[Held]:
        """What recovery may use beside the live tensors: the snapshot and every replica
        whose transfer completed (never waits; a snapshot whose copy has not landed is not
        offered). Recovery may write into the live tensors next: the current stream waits
        for the snapshot's copy from them first (on the device)."""
        self.wait_copied()
        self._complete(wait=False)
        return [h for h in (b.held() for b in self._buffers()) if h is not None]

    def close(self) -> None:
        """At the end of a round that finished: let the last transfers complete."""
        try:
            self._complete(wait=True)
        except Exception:  # the round is over; a broken transfer only loses a copy
            log.debug("replica transfer did not complete at close", exc_info=True)
