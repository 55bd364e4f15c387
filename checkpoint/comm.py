"""Small JSON messages between ranks, carried as uint8 tensors (never pickled objects).

``all_gather_object`` and ``broadcast_object_list`` pickle; these do not. The group must
accept CPU tensors (gloo); with NCCL training, pass a gloo group for the checkpoint.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist


def group_size(group: dist.ProcessGroup | None) -> int:
    return dist.get_world_size(group) if dist.is_initialized() else 1


def group_rank(group: dist.ProcessGroup | None) -> int:
    return dist.get_rank(group) if dist.is_initialized() else 0


def _framed(data: bytes, cap: int) -> torch.Tensor:
    """A fixed-size message of ``8 + cap`` bytes: ``len(data)``, then ``data`` when it
    fits ``cap`` (a longer one travels another way; its length says so)."""
    buf = torch.zeros(8 + cap, dtype=torch.uint8)
    buf[:8] = torch.tensor([len(data)], dtype=torch.int64).view(torch.uint8)
    if data and len(data) <= cap:
        buf[8 : 8 + len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    return buf


def _length(buf: torch.Tensor) -> int:
    return int(buf[:8].view(torch.int64).item())


def _unframed(buf: torch.Tensor) -> Any:
    """The JSON a :func:`_framed` buffer carries (its data fit the cap)."""
    return json.loads(bytes(buf[8 : 8 + _length(buf)].numpy()))


def all_gather_json(obj: Any, group: dist.ProcessGroup | None) -> list[Any]:
    """Every rank's ``obj``, in group-rank order."""
    if group_size(group) == 1:
        return [json.loads(json.dumps(obj))]
    data = json.dumps(obj, separators=(",", ":")).encode()
    n = group_size(group)
    length = torch.tensor([len(data)], dtype=torch.int64)
    lengths = [torch.zeros(1, dtype=torch.int64) for _ in range(n)]
    dist.all_gather(lengths, length, group=group)
    longest = max(int(x.item()) for x in lengths)
    buf = torch.zeros(longest, dtype=torch.uint8)
    if data:
        buf[: len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    bufs = [torch.zeros(longest, dtype=torch.uint8) for _ in range(n)]
    dist.all_gather(bufs, buf, group=group)
    return [
        json.loads(bytes(b[: int(ln.item())].numpy())) for b, ln in zip(bufs, lengths, strict=True)
    ]


def all_gather_json_small(
    obj: Any, group: dist.ProcessGroup | None, *, cap: int = 2040
) -> Callable[[], list[Any]]:
    """:func:`all_gather_json` in one collective when every rank's message fits ``cap``
    bytes (a fixed-size buffer carrying its length); else, on every rank alike (they all
    see the lengths), the two-collective way. The collective is started here and runs in
    the background; the returned function waits for it and gives every rank's ``obj``."""
    if group_size(group) == 1:
        copy = json.loads(json.dumps(obj))
        return lambda: [copy]
    buf = _framed(json.dumps(obj, separators=(",", ":")).encode(), cap)
    bufs = [torch.zeros(8 + cap, dtype=torch.uint8) for _ in range(group_size(group))]
    work = dist.all_gather(bufs, buf, group=group, async_op=True)

    def finish() -> list[Any]:
        work.wait()
        if max(_length(b) for b in bufs) > cap:
            return all_gather_json(obj, group)
        return [_unframed(b) for b in bufs]

    return finish


def broadcast_json(obj: Any, group: dist.ProcessGroup | None) -> Any:
    """Group rank 0's ``obj`` on every rank (``obj`` is ignored elsewhere)."""
    if group_size(group) == 1:
        return json.loads(json.dumps(obj))
    data = json.dumps(obj, separators=(",", ":")).encode() if group_rank(group) == 0 else b""
    length = torch.tensor([len(data)], dtype=torch.int64)
    dist.broadcast(length, src=_root(group), group=group)
    return _broadcast_bytes(data, int(length.item()), group)


def _root(group: dist.ProcessGroup | None) -> int:
    """The global rank of ``group``'s rank 0."""
    return dist.get_global_rank(group, 0) if group is not None else 0


def _broadcast_bytes(data: bytes, n: int, group: dist.ProcessGroup | None) -> Any:
    """Rank 0's ``data`` (``n`` bytes of JSON, known to every rank) on every rank."""
    buf = torch.zeros(n, dtype=torch.uint8)
    if group_rank(group) == 0 and data:
        buf[:] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    dist.broadcast(buf, src=_root(group), group=group)
    return json.loads(bytes(buf.numpy()))


def gather_json_to_root(obj: Any, group: dist.ProcessGroup | None, *, cap: int) -> list[Any] | None:
    """Every rank's ``obj`` on group rank 0, in group-rank order (None elsewhere): one
    ``gather`` of fixed-size buffers, ``cap`` bytes of JSON each, which every rank must
    pass alike. Each rank sends straight to rank 0, where :func:`all_gather_json`'s two
    rings pass every message through every rank (on 4 gloo ranks sharing 2 cores, about
    2 ms instead of 8 for 55 KB each). A message longer than ``cap`` raises ValueError
    before anything is sent; the caller keeps its messages within the cap."""
    data = json.dumps(obj, separators=(",", ":")).encode()
    if len(data) > cap:
        raise ValueError(f"a message of {len(data)} bytes does not fit the cap of {cap}")
    if group_size(group) == 1:
        return [json.loads(data)]
    root = group_rank(group) == 0
    bufs = [torch.zeros(8 + cap, dtype=torch.uint8) for _ in range(group_size(group))]
    dist.gather(_framed(data, cap), bufs if root else None, dst=_root(group), group=group)
    return [_unframed(b) for b in bufs] if root else None


def broadcast_json_small(obj: Any, group: dist.ProcessGroup | None, *, cap: int = 4088) -> Any:
    """:func:`broadcast_json` in one collective when rank 0's message fits ``cap`` bytes
    (a fixed-size buffer carrying its length); a longer one follows in a second broadcast,
    which every rank then makes alike (they all read the length)."""
    if group_size(group) == 1:
        return json.loads(json.dumps(obj))
    data = json.dumps(obj, separators=(",", ":")).encode() if group_rank(group) == 0 else b""
    buf = _framed(data, cap)  # only rank 0's travels
    dist.broadcast(buf, src=_root(group), group=group)
    n = _length(buf)
    return _unframed(buf) if n <= cap else _broadcast_bytes(data, n, group)
