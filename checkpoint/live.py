"""State from the survivors' memory: refill a new layout's tensors rank to rank.

After an in-process restart the surviving processes still hold the old layout's tensors
(parameters, AdamW moments, AdamW's per-parameter step). :func:`recover_from_peers` fills
the new layout's tensors from them over the new world's gloo group, resharded by the same
box arithmetic as a checkpoint load (:mod:`checkpoint.planner`); a rank that held nothing
(a newcomer) passes ``have=None``. It knows nothing of agents or trainers: tensors in,
tensors out, named globally exactly as in a checkpoint.

One call, collective over the group:

1. **Describe.** One all-gather of compressed JSON (never pickle; a fixed-size buffer of
   ``DESCRIPTION_CAP`` bytes, two more collectives only when a description does not fit):
   each rank's step, ``consumed_samples``, and the boxes (key, dtype, global shape,
   offsets, sizes) it holds and needs, in columns (each distinct box once, then keys and
   box indexes), so that a state of thousands of tensors costs list operations, not a
   JSON object per tensor.
2. **Decide** (pure, identical on every rank, from the gathered data only). The step S is
   the highest step whose holders cover every element of every needed box; survivors may
   differ by one step (a fault between ranks' optimizer steps). A rank may hold more than
   its live tensors (``extra``: a snapshot of its own at an earlier step, peers' in-memory
   replicas), each set at its own step; any set held at S counts. No such step, holders of S
   that disagree on ``consumed_samples``, or any dtype or global shape that disagrees
   between ranks: every rank returns None (the caller falls back to a checkpoint).
3. **Plan** (pure): each needed box is cut into pieces, each from one holder at S: the rank
   itself first (a local copy), then the holder that covers most of what is left, ties to
   the fewest bytes assigned so far, then the lower rank. Every needed element is filled
   exactly once. Keys with the same geometry (a parameter and its moments, same-shaped
   layers) are planned as one group; only the choice among equal holders is per key.
4. **Transfer.** For each (source, destination) pair the pieces, in plan order, are cut
   into chunks of about ``CHUNK_BYTES``; each chunk is one ``isend``/``irecv``, and the
   pair's CRC-32Cs of its chunks follow the last as one message. A chunk of one piece that
   is a contiguous region of its CPU tensor goes straight from the source tensor and lands
   straight in the destination tensor (no copy on either side); other chunks are packed
   (16-byte aligned) through a small ring of staging slots on the sender and unpacked from
   one buffer per source on the receiver. All receives are posted first; each sender then
   sends chunk by chunk, round-robin over its destinations, checksumming a chunk while it
   is on its way; local copies run meanwhile (none where a held region is the needed one,
   the same memory); each receiver checksums (and unpacks) chunk by chunk as they arrive
   and compares with the sender's CRCs when they are in. CUDA tensors are staged through
   CPU (gloo carries CPU tensors): packed on the device, one copy per chunk.
5. **Agree.** One all-reduce of an ok flag: a CRC mismatch on any rank makes every rank
   return None. A peer that dies during the transfer makes the wait raise (the caller
   handles it, as for any collective).

On None the ``need`` tensors may be partly written; the caller must refill them from
another source. Padding (the local tensor outside ``ShardInfo.sizes``) is never touched.
"""

from __future__ import annotations

import base64
import functools
import gc
import itertools
import json
import logging
import operator
import time
import zlib
from collections import defaultdict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import crc32c
import torch
import torch.distributed as dist

from checkpoint.comm import all_gather_json_small, group_rank, group_size
from checkpoint.planner import Box, intersect, numel, relative
from checkpoint.shards import ShardInfo

log = logging.getLogger("checkpoint.live")

Holding = Mapping[str, tuple[torch.Tensor, ShardInfo]]
"""Global key -> (local tensor, the global region it holds), as
``Checkpointing._model()`` / ``_optimizer(create=...)`` return (keys are distinct across the
two, so pass ``{**model, **optimizer}``). The key, not ``ShardInfo.name``, names the global
tensor: AdamW's moments carry their parameter's ShardInfo under ``exp_avg/<name>``."""

ALIGN = 16
"""Byte alignment of every piece in a packing buffer (any dtype can be viewed in place)."""
CHUNK_BYTES = 4 << 20
"""Target bytes of data per chunk (one message, one CRC). Pieces larger than this are cut
along their outermost dimensions."""
ALONE_BYTES = 256 << 10
"""Pieces of at least this many bytes travel alone in their chunks (straight from and into
the tensors where those are contiguous CPU regions); smaller ones are packed together."""
SEND_SLOTS = 4
"""Staging slots of one chunk each through which a rank sends (all destinations)."""
PINNED_RECEIVE_MAX = 64 << 20
"""Largest receive buffer (one source's packed chunks, for GPU destinations) made of
pinned host memory; a larger one is pageable. Every receive is posted up front (a rank
sends before it takes what it receives, so a bounded ring of posted receives could wait
on a sender waiting on it), so that buffer holds all a source sends: for a newcomer, its
whole shard. Pinning that much is seconds of ``cudaHostAlloc`` on the recovery's path,
and torch's host allocator keeps the block for the life of the process; the host-to-device
copy from pageable memory is slower than from pinned, still faster than gloo's TCP."""
DESCRIPTION_VERSION = 2
DESCRIPTION_CAP = 64 << 10
"""Bytes of a compressed description that go in the one all-gather of descriptions (a
larger one costs two more collectives, on every rank alike)."""

_received_hook: Callable[[int, int, torch.Tensor], None] | None = None
"""Test hook: called as ``hook(src, dst, chunk_bytes)`` on the receiver with each received
chunk's bytes (where they landed: the destination tensor, or the packing buffer), before
they are verified; a test flips a byte here."""


@dataclass(frozen=True)
class Held:
    """More state a rank holds beside its live tensors, at its own step: a snapshot of its
    own shards, or a peer's in-memory replica (``checkpoint.memory_replicas``)."""

    step: int
    consumed: int
    tensors: Holding


@dataclass(frozen=True)
class LiveRecovery:
    """What :func:`recover_from_peers` did on this rank."""

    step: int
    """The step the recovered state is at (the caller sets its loop position to it)."""
    consumed_samples: int
    """The global data position at that step."""
    bytes_in: int
    """Bytes this rank received from other ranks (data only, without CRC slots)."""
    bytes_local: int
    """Bytes this rank copied from what it already held."""
    seconds: float
    """Wall time of the whole call on this rank."""
    sources: dict = field(default_factory=dict)
    """``holders`` (group ranks holding state at ``step``), ``skipped_steps`` (higher steps
    that did not cover everything), ``received_from`` / ``sent_to`` (group rank -> bytes),
    ``bytes_out``, ``pieces`` (in the whole plan), ``from_extra`` (whether any piece of the
    plan comes from an ``extra`` holding), ``chunks_in``, ``plan_seconds``."""


# -- pure planning ---------------------------------------------------------------------------


class Piece(NamedTuple):
    """Copy the global box ``(offsets, sizes)`` of tensor ``key`` from ``src`` to ``dst``.
    (A named tuple: a plan has one per tensor and rank pair, and builds in a quarter of a
    frozen dataclass's time.)"""

    key: str
    src: int
    dst: int
    offsets: tuple[int, ...]
    sizes: tuple[int, ...]
    itemsize: int
    src_set: int = 0
    """Which of the source's holdings: 0 its live tensors, k its ``extra[k - 1]``."""

    @property
    def box(self) -> Box:
        return self.offsets, self.sizes

    @property
    def nbytes(self) -> int:
        return numel(self.sizes) * self.itemsize


@dataclass(frozen=True, slots=True)
class RecoveryPlan:
    """The agreed step and every piece to copy, in plan order."""

    step: int
    consumed_samples: int
    pieces: tuple[Piece, ...]
    holders: tuple[int, ...]
    """Ranks holding state at ``step``."""
    skipped_steps: tuple[int, ...] = ()
    """Higher steps held by some rank whose holders did not cover every needed region."""

    def between(self, src: int, dst: int) -> list[Piece]:
        return [p for p in self.pieces if p.src == src and p.dst == dst]


@dataclass(frozen=True, slots=True)
class Chunk:
    """One message of a pair's transfer: its pieces, laid out at ``start`` in the pair's
    packing buffer (``length`` bytes, pieces 16-byte aligned). A chunk of one piece goes on
    the wire as that piece's bytes alone (``wire`` bytes), straight from the source tensor
    and into the destination tensor where each is a contiguous CPU region; a chunk of
    several is packed."""

    start: int
    length: int
    items: tuple[tuple[Piece, int], ...]
    """(piece, byte offset of its data in the pair buffer), in plan order."""

    @property
    def end(self) -> int:
        return self.start + self.length

    @property
    def wire(self) -> int:
        """Bytes of its message (and of its CRC): the piece alone, or the packed chunk."""
        return self.items[0][0].nbytes if len(self.items) == 1 else self.length


def _aligned(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


def subtract(box: Box, inner: Box) -> list[Box]:
    """``box`` minus ``inner`` (which lies inside it), as at most 2·ndim disjoint boxes."""
    offs, sizes = list(box[0]), list(box[1])
    out: list[Box] = []
    for d in range(len(offs)):
        lo, hi = offs[d], offs[d] + sizes[d]
        ilo, ihi = inner[0][d], inner[0][d] + inner[1][d]
        if ilo > lo:
            out.append(((*offs[:d], lo, *offs[d + 1 :]), (*sizes[:d], ilo - lo, *sizes[d + 1 :])))
        if ihi < hi:
            out.append(((*offs[:d], ihi, *offs[d + 1 :]), (*sizes[:d], hi - ihi, *sizes[d + 1 :])))
        offs[d], sizes[d] = ilo, ihi - ilo
    return out


def split_box(box: Box, *, itemsize: int, max_bytes: int) -> list[Box]:
    """Cut ``box`` into boxes of at most ``max_bytes`` each (one element may exceed it),
    along its outermost dimensions, in row-major order. Each result is a contiguous run of
    whole inner slabs, so it packs as a strided copy of few large rows."""
    offs, sizes = box
    max_bytes = max(max_bytes, itemsize)
    if not sizes or numel(sizes) * itemsize <= max_bytes:
        return [box]
    d = next(i for i in range(len(sizes)) if numel(sizes[i + 1 :]) * itemsize <= max_bytes)
    per = max(1, max_bytes // (numel(sizes[d + 1 :]) * itemsize))
    out: list[Box] = []
    outer = [range(offs[i], offs[i] + sizes[i]) for i in range(d)]
    for prefix in itertools.product(*outer):
        for start in range(offs[d], offs[d] + sizes[d], per):
            n = min(per, offs[d] + sizes[d] - start)
            out.append(((*prefix, start, *offs[d + 1 :]), ((1,) * d + (n,) + sizes[d + 1 :])))
    return out


def pair_chunks(
    pieces: Sequence[Piece], *, chunk_bytes: int = CHUNK_BYTES, alone_bytes: int | None = None
) -> list[Chunk]:
    """The messages of one (source, destination) pair: pieces in order (cut to fit). A
    piece of at least ``alone_bytes`` goes alone, in chunks of at most ``chunk_bytes`` (a
    chunk of one piece can go tensor to tensor without a copy); smaller ones are grouped
    into chunks of at most ``chunk_bytes`` data each. (A single element larger than that
    gets a chunk of its own.)"""
    alone_bytes = ALONE_BYTES if alone_bytes is None else alone_bytes
    chunks: list[Chunk] = []
    start, length, items = 0, 0, []

    def close() -> None:
        nonlocal start, length, items
        if items:
            chunks.append(Chunk(start, length, tuple(items)))
            start, length, items = start + length, 0, []

    for p in pieces:
        nbytes = p.nbytes
        alone = nbytes >= alone_bytes
        if alone:
            close()
        if nbytes <= chunk_bytes:
            subs: Sequence[Piece] = (p,)
        else:
            boxes = split_box(p.box, itemsize=p.itemsize, max_bytes=chunk_bytes)
            subs = [p._replace(offsets=offs, sizes=sizes) for offs, sizes in boxes]
        for sub in subs:
            size = _aligned(sub.nbytes)
            if items and (alone or length + size > chunk_bytes):
                close()
            items.append((sub, start + length))
            length += size
        if alone:
            close()
    close()
    return chunks


def _entry(t: torch.Tensor, info: ShardInfo) -> list[Any]:
    return [
        str(t.dtype).removeprefix("torch."),
        list(info.global_shape),
        list(info.offsets),
        list(info.sizes),
    ]


def _check_tensor(key: str, t: torch.Tensor, info: ShardInfo) -> str | None:
    if t.dim() != len(info.sizes):
        return f"{key}: a {t.dim()}-d tensor for a {len(info.sizes)}-d region"
    if any(n < s for n, s in zip(t.shape, info.sizes, strict=True)):
        return f"{key}: local shape {list(t.shape)} is smaller than its region {list(info.sizes)}"
    return None


class _Entries:
    """Entries of one description, one list per distinct (dtype, local shape, region):
    the tensors of a layer share their ShardInfo with their AdamW moments, and same-shaped
    layers share their geometry, so a state of thousands of tensors has a handful of
    distinct entries, each checked once. (The lists are shared: nobody mutates them.)"""

    def __init__(self) -> None:
        self._seen: dict[tuple, tuple[list[Any], bool]] = {}
        self.errors: list[str] = []

    def of(self, key: str, t: torch.Tensor, info: ShardInfo) -> list[Any]:
        memo = (t.dtype, t.shape, info.global_shape, info.offsets, info.sizes)
        got = self._seen.get(memo)
        if got is None:
            got = self._seen[memo] = (_entry(t, info), _check_tensor(key, t, info) is None)
        if not got[1]:
            self.errors.append(_check_tensor(key, t, info) or "")
        return got[0]

    def side(self, holding: Holding) -> dict[str, list[Any]]:
        return {key: self.of(key, t, info) for key, (t, info) in holding.items()}


def describe(
    *,
    have: Holding | None,
    have_step: int | None,
    have_consumed: int | None,
    need: Holding,
    extra: Sequence[Held] = (),
    digests: Mapping[str, int] | None = None,
) -> dict[str, Any]:
    """This rank's description for the all-gather. Local problems (a tensor smaller
    than its region, state without a step) go in ``error`` so every rank refuses together.
    ``extra`` holdings go in ``more``, in order (set k of the plan is ``more[k - 1]``).
    Each side maps a key to ``[dtype, global shape, offsets, sizes]``. ``digests``: a
    checksum of each held tensor's content (``digests``, key -> int), for state that is
    claimed replicated (:func:`plan_recovery` refuses to send a key whose holders differ)."""
    entries = _Entries()
    if have is not None and (have_step is None or have_consumed is None):
        entries.errors.append("state held without a step and consumed_samples")
        have = None
    held = entries.side(have or {})
    more = [
        {"step": h.step, "consumed": h.consumed, "have": entries.side(h.tensors)} for h in extra
    ]
    needed = entries.side(need)
    out = {
        "v": DESCRIPTION_VERSION,
        "step": have_step if have is not None else None,
        "consumed": have_consumed if have is not None else None,
        "have": held,
        "more": more,
        "need": needed,
        "error": "; ".join(entries.errors) or None,
    }
    if digests is not None and have is not None:
        out["digests"] = {k: int(digests[k]) for k in held if k in digests}
    return out


def _encode(desc: Mapping[str, Any]) -> dict[str, Any]:
    """A description in columns, for the wire: each distinct entry once (``entries``),
    each side as its keys and their entries' indexes; a side whose keys are those of the
    side before it (the live state and the need of an in-place recovery) sends no keys.
    Decoding and encoding thousands of keys is then a few list operations, not a JSON
    object per tensor."""
    table: list[Any] = []
    index: dict[int, int] = {}
    kept: list[Any] = []  # the entries indexed by id(), alive while ``index`` is used

    def side(entries: Mapping[str, list[Any]], prev: list[str] | None) -> dict[str, Any]:
        keys = list(entries)
        idx = []
        for e in entries.values():
            i = index.get(id(e))
            if i is None:
                i = index[id(e)] = len(table)
                table.append(e)
                kept.append(e)
            idx.append(i)
        return {"keys": None if keys == prev else keys, "entries": idx}, keys

    have, keys = side(desc["have"], None)
    more = []
    for m in desc.get("more") or ():
        held, keys = side(m["have"], keys)
        more.append({"step": m["step"], "consumed": m["consumed"], "have": held})
    need, _ = side(desc["need"], keys)
    out = {**{k: desc[k] for k in ("v", "step", "consumed", "error")},
           "entries": table, "have": have, "more": more, "need": need}  # fmt: skip
    if desc.get("digests") is not None:  # in the live keys' order, null where none
        out["digests"] = [desc["digests"].get(k) for k in desc["have"]]
    return out


def _decode(wire: Mapping[str, Any]) -> dict[str, Any]:
    """:func:`_encode`'s inverse (identical entries come back as one shared list)."""
    table = wire["entries"]
    keys: list[str] = []

    def side(s: Mapping[str, Any]) -> dict[str, list[Any]]:
        nonlocal keys
        keys = keys if s["keys"] is None else s["keys"]
        return dict(zip(keys, map(table.__getitem__, s["entries"]), strict=True))

    have = side(wire["have"])
    held_keys = keys
    more = [{"step": m["step"], "consumed": m["consumed"], "have": side(m["have"])}
            for m in wire["more"]]  # fmt: skip
    out = {**{k: wire[k] for k in ("v", "step", "consumed", "error")},
           "have": have, "more": more, "need": side(wire["need"])}  # fmt: skip
    if wire.get("digests") is not None:
        out["digests"] = {k: v for k, v in zip(held_keys, wire["digests"], strict=True)
                          if v is not None}  # fmt: skip
    return out


def gather_compressed(obj: Any, group: dist.ProcessGroup | None) -> list[Any]:
    """Every rank's JSON-shaped ``obj``, in group-rank order: compressed JSON in one
    fixed-size all-gather while every rank's fits :data:`DESCRIPTION_CAP` (two more
    collectives, on every rank alike, when one does not). Identical ones (replicas') are
    parsed once: they come back as one object."""
    data = zlib.compress(json.dumps(obj, separators=(",", ":")).encode(), 1)
    got = all_gather_json_small(base64.b64encode(data).decode(), group, cap=DESCRIPTION_CAP)()
    parsed: dict[str, Any] = {}
    for text in got:
        if text not in parsed:
            parsed[text] = json.loads(zlib.decompress(base64.b64decode(text)))
    return [parsed[text] for text in got]


def gather_descriptions(desc: Mapping[str, Any], group: dist.ProcessGroup | None) -> list[Any]:
    """Every rank's description (:func:`describe`), in group-rank order, sent in columns
    (:func:`_encode`). A description of another version comes back as it was sent (the
    planner refuses it by its version)."""
    decoded: dict[int, Any] = {}
    out = []
    for w in gather_compressed(_encode(desc), group):  # replicas' are one object
        if id(w) not in decoded:
            decoded[id(w)] = _decode(w) if w.get("v") == DESCRIPTION_VERSION else w
        out.append(decoded[id(w)])
    return out


def _sets(d: Mapping[str, Any]) -> list[tuple[int, Mapping[str, Any]]]:
    """A description's holdings as (set index, {step, consumed, have}): 0 the live ones,
    then ``more`` (absent in a description without extra holdings)."""
    out: list[tuple[int, Mapping[str, Any]]] = []
    if d["step"] is not None:
        out.append((0, d))
    out += [(k + 1, m) for k, m in enumerate(d.get("more") or ())]
    return out


@functools.lru_cache(maxsize=64)
def _itemsize(dtype: str) -> int:
    dt = getattr(torch, dtype, None)
    if not isinstance(dt, torch.dtype):
        raise ValueError(f"unknown dtype {dtype!r}")
    return dt.itemsize


class _Geometry:
    """Entries interned by content: each distinct ``[dtype, shape, offsets, sizes]`` gets
    a small int (its box, bytes and itemsize are looked up by it). A decoded description
    shares one list per distinct entry, so a side of thousands of keys is interned by
    identity in a few C-level passes (:meth:`side`), each distinct entry converted once."""

    def __init__(self) -> None:
        self._by_id: dict[int, int] = {}
        self._by_content: dict[tuple, int] = {}
        self._alive: list[Any] = []  # the entries whose id() is a key of ``_by_id``
        self.boxes: list[Box] = []
        self.nbytes: list[int] = []
        self.itemsize: list[int] = []

    def _add(self, entry: Sequence[Any]) -> None:
        dtype, _shape, offs, sizes = entry
        box = (tuple(offs), tuple(sizes))
        g = self._by_content.get((dtype, box))
        if g is None:
            g = self._by_content[dtype, box] = len(self.boxes)
            self.boxes.append(box)
            self.itemsize.append(_itemsize(dtype))
            self.nbytes.append(numel(box[1]) * self.itemsize[-1])
        self._by_id[id(entry)] = g
        self._alive.append(entry)

    def side(self, entries: Mapping[str, Sequence[Any]]) -> dict[str, int]:
        """Key -> interned entry, for one side of a description."""
        values = list(entries.values())
        by_id = dict(zip(map(id, values), values, strict=True))
        for i in by_id.keys() - self._by_id.keys():
            self._add(by_id[i])
        return dict(zip(entries, map(self._by_id.__getitem__, map(id, values)), strict=True))


def plan_step(
    descs: Sequence[Mapping[str, Any]], step: int, geo: _Geometry | None = None
) -> tuple[list[Piece] | None, str]:
    """The pieces that fill every rank's ``need`` from the holders at ``step``, or None and
    why (the first region no holder at ``step`` covers). Assumes consistent dtypes and
    shapes (:func:`plan_recovery` checks them).

    Keys are planned in groups: the keys a rank needs with the same box and the same
    holders' boxes (a parameter and its moments, every layer's same-shaped weights) share
    what the rank holds itself of it, what is left, and who could send each part; only
    the choice among equal senders (the one with the fewest bytes so far) and the pieces
    themselves are per key. Remote parts go largest first, so the balance by bytes ends
    within one piece of even."""
    geo = geo or _Geometry()
    boxes, nbytes, itemsizes = geo.boxes, geo.nbytes, geo.itemsize
    sets = [(r, k, geo.side(held["have"]))
            for r, d in enumerate(descs) for k, held in _sets(d) if held["step"] == step]  # fmt: skip
    pieces: list[Piece] = []
    remote: list[tuple[int, int, int, list[tuple], list[str]]] = []
    # (-bytes left per key, rank, itemsize, each left box's candidates, keys)
    holders_memo: dict[tuple[int, ...], list[tuple[int, int, Box]]] = {}
    for r, d in enumerate(descs):
        need = geo.side(d["need"])
        keys = list(need)
        # Per key, the interned box each holding set holds of it (-1: none), in set order.
        columns = [map(m.get, keys, itertools.repeat(-1)) for _, _, m in sets]
        held = zip(*columns, strict=True) if sets else itertools.repeat(())
        groups: dict[tuple[tuple[int, ...], int], list[str]] = defaultdict(list)
        for key, sig, g in zip(keys, held, need.values(), strict=False):
            groups[sig, g].append(key)
        for (sig, g), members in groups.items():
            if not nbytes[g]:
                continue
            hs = holders_memo.get(sig)
            if hs is None:
                hs = holders_memo[sig] = [
                    (hr, k, boxes[hg])
                    for (hr, k, _), hg in zip(sets, sig, strict=True)
                    if hg >= 0 and nbytes[hg]
                ]
            parts, left = _own_part(boxes[g], hs, r)
            itemsize = itemsizes[g]
            for k, (offs, sizes) in parts:
                pieces += [Piece(key, r, r, offs, sizes, itemsize, k) for key in members]
            if left:
                left_bytes = sum(numel(b[1]) for b in left) * itemsize
                remote.append((-left_bytes, r, itemsize, [(b, hs) for b in left], members))
    load: dict[int, int] = defaultdict(int)
    candidates: dict[tuple[Box, int], list] = {}
    remote.sort(key=lambda x: x[:2])
    for _, r, itemsize, left, members in remote:
        alone = []  # (src, set, region) of each left box that only one holder has
        for box, hs in left:
            memo = (box, id(hs))
            cands = candidates.get(memo)
            if cands is None:
                cands = candidates[memo] = _candidates(box, hs)
            if len(cands) == 1 and not cands[0][-1]:
                alone.append(cands[0][2:5])
        if len(alone) == len(left):  # no choice to make: every key of the group alike
            for src, k, (offs, sizes) in alone:
                pieces += [Piece(key, src, r, offs, sizes, itemsize, k) for key in members]
                load[src] += numel(sizes) * itemsize * len(members)
            continue
        for key in members:
            todo = list(left)
            while todo:
                box, hs = todo.pop()
                memo = (box, id(hs))
                cands = candidates.get(memo)
                if cands is None:
                    cands = candidates[memo] = _candidates(box, hs)
                best: tuple[tuple[int, bool, int, int, int], tuple] | None = None
                for neg, extra, hr, k, common, rest in cands:
                    # Live tensors before snapshots and replicas at the same step.
                    rank_key = (neg, extra, load[hr], hr, k)
                    if best is None or rank_key < best[0]:
                        best = (rank_key, (hr, k, common, rest))
                if best is None:
                    return None, (
                        f"{key} [{', '.join(f'{o}:{o + s}' for o, s in zip(*box, strict=True))}] "
                        f"needed by rank {r} has no holder at step {step}"
                    )
                src, k, common, rest = best[1]
                pieces.append(Piece(key, src, r, *common, itemsize, k))
                load[src] -= best[0][0] * itemsize
                todo.extend((b, hs) for b in rest)
    return pieces, ""


def _own_part(
    box: Box, holders: Sequence[tuple[int, int, Box]], rank: int
) -> tuple[list[tuple[int, Box]], list[Box]]:
    """What ``rank`` holds itself of ``box`` ((set, region) in holding order) and what is
    left of it for others (disjoint boxes)."""
    parts: list[tuple[int, Box]] = []
    left = [box]
    for hr, k, hb in holders:
        if hr != rank:
            continue
        rest = []
        for b in left:
            common = intersect(b, hb)
            if common is None:
                rest.append(b)
                continue
            parts.append((k, common))
            rest += subtract(b, common)
        left = rest
    return parts, left


def _candidates(box: Box, holders: Sequence[tuple[int, int, Box]]) -> list[tuple]:
    """Each holder's part of ``box``: (minus its elements, from a snapshot or replica,
    rank, set, region, what is left of ``box`` without it)."""
    out = []
    for hr, k, hb in holders:
        common = intersect(box, hb)
        if common is not None:
            out.append((-numel(common[1]), k > 0, hr, k, common, subtract(box, common)))
    return out


def _check_consistent(descs: Sequence[Mapping[str, Any]]) -> str | None:
    """Why the ranks' entries disagree on a key's dtype or global shape, or None. Each
    distinct entry's (dtype, shape) is worked out once (decoded entries are shared lists)
    and numbered; each side is compared with what the sides before it said, in C-level
    passes over its keys."""
    kinds: dict[tuple[str, tuple[int, ...]], int] = {}  # (dtype, shape) -> its number
    of_id: dict[int, int] = {}
    alive: list[Any] = []
    meta: dict[str, int] = {}  # key -> its kind, as the first side naming it said
    said: list[tuple[int, str, Mapping[str, Any]]] = []
    for r, d in enumerate(descs):
        sides = [("holds", d["have"]), ("needs", d["need"])]
        sides += [("holds", m["have"]) for m in d.get("more") or ()]
        for side, entries in sides:
            values = list(entries.values())
            for e in dict(zip(map(id, values), values, strict=True)).values():
                if id(e) in of_id:
                    continue
                try:
                    _itemsize(e[0])
                except ValueError as exc:
                    key = next(k for k, v in entries.items() if v is e)
                    return f"rank {r}: {key}: {exc}"
                of_id[id(e)] = kinds.setdefault((e[0], tuple(e[1])), len(kinds))
                alive.append(e)
            keys = list(entries)
            mine = list(map(of_id.__getitem__, map(id, values)))
            # Each key's kind against the one said before (itself where none was).
            differs = map(operator.ne, map(meta.get, keys, mine), mine)
            for key, kind in itertools.compress(zip(keys, mine, strict=True), differs):
                r0, side0, first = next(x for x in said if key in x[2])
                named = {n: k for k, n in kinds.items()}
                (dt0, shape0), (dt1, shape1) = named[of_id[id(first[key])]], named[kind]
                return (f"{key}: rank {r0} {side0} {dt0} {list(shape0)}, "
                        f"rank {r} {side} {dt1} {list(shape1)}")  # fmt: skip
            meta.update(zip(keys, mine, strict=True))
            said.append((r, side, entries))
    return None


def plan_recovery(descs: Sequence[Mapping[str, Any]]) -> tuple[RecoveryPlan | None, str]:
    """Decide the step and plan every transfer from all ranks' descriptions (pure; every
    rank computes the same). None and the reason when nothing consistent covers the need."""
    problems = [f"rank {r}: {d['error']}" for r, d in enumerate(descs) if d.get("error")]
    problems += [
        f"rank {r}: description version {d.get('v')}"
        for r, d in enumerate(descs)
        if d.get("v") != DESCRIPTION_VERSION
    ]
    if problems:
        return None, "; ".join(problems)
    inconsistent = _check_consistent(descs)
    if inconsistent is not None:
        return None, inconsistent
    steps = sorted({h["step"] for d in descs for _, h in _sets(d)}, reverse=True)
    if not steps:
        return None, "no rank holds any state"
    reasons, skipped = [], []
    geo = _Geometry()
    for step in steps:
        pieces, why = plan_step(descs, step, geo)
        if pieces is None:
            reasons.append(f"step {step}: {why}")
            skipped.append(step)
            continue
        at_step = [(r, h) for r, d in enumerate(descs) for _, h in _sets(d) if h["step"] == step]
        holders = tuple(sorted({r for r, _ in at_step}))
        consumed = {h["consumed"] for _, h in at_step}
        if len(consumed) != 1:
            reasons.append(f"step {step}: holders disagree on consumed_samples {sorted(consumed)}")
            skipped.append(step)
            continue
        differs = _not_replicated(descs, step, pieces)
        if differs:
            return None, differs
        return RecoveryPlan(
            step=step,
            consumed_samples=consumed.pop(),
            pieces=tuple(pieces),
            holders=holders,
            skipped_steps=tuple(skipped),
        ), ""
    return None, "; ".join(reasons)


def digest_on_device(digest: int) -> bool:
    """Which kind a digest is (``elasticd.inprocess._digest``): a device's (at or above
    2^62) or a CRC-32C of host bytes; only digests of one kind are compared (a tensor one
    rank holds on the CPU and another on a GPU is not)."""
    return digest >= 1 << 62


def _not_replicated(descs: Sequence[Mapping[str, Any]], step: int, pieces: list[Piece]) -> str:
    """Why a key the plan sends is not one tensor: its holders at ``step`` with the same
    box gave different digests (``describe(digests=...)``), or "". Sharded or rank-local
    state handed over as whole tensors: a newcomer was given whichever rank's shard the
    plan chose, and trained on as if it were its own (a review's FSDP script)."""
    sent = {p.key for p in pieces if p.src != p.dst}
    if not sent:
        return ""
    for key in sorted(sent):
        seen: dict[tuple, tuple[int, int]] = {}
        for r, d in enumerate(descs):
            digests = d.get("digests")
            if d["step"] != step or not digests or key not in digests or key not in d["have"]:
                continue
            _dtype, _shape, offs, sizes = d["have"][key]
            box = (tuple(offs), tuple(sizes), digest_on_device(digests[key]))
            first = seen.setdefault(box, (digests[key], r))
            if first[0] != digests[key]:
                return (f"{key} differs between rank {first[1]} and rank {r} at step {step}: "
                        "state handed over whole must be the same on every rank that holds "
                        "it (sharded or per-rank state cannot be synced; docs/inprocess.md, "
                        "\"Sharded state\")")  # fmt: skip
    return ""


# -- transfer --------------------------------------------------------------------------------


def _stage_device(chunk: Chunk, tensors: Holding) -> torch.device:
    key = chunk.items[0][0].key
    return tensors[key][0].device


def _region(t: torch.Tensor, info: ShardInfo, piece: Piece) -> torch.Tensor:
    """The piece's elements in ``t`` (which holds ``info``'s region): ``t`` itself when the
    piece is all of it (most are: a parameter or moment moved whole), else a view."""
    if piece.offsets == info.offsets and piece.sizes == t.shape:
        return t
    return t[relative(piece.box, info.offsets)]


def _direct(chunk: Chunk, tensors: Holding) -> torch.Tensor | None:
    """The bytes of a one-piece chunk in place in ``tensors`` (a uint8 view of a contiguous
    CPU region), or None when it must be packed or unpacked."""
    if len(chunk.items) != 1:
        return None
    piece = chunk.items[0][0]
    t, info = tensors[piece.key]
    if t.device.type != "cpu":
        return None
    region = _region(t, info, piece)
    if not region.is_contiguous():
        return None
    return region.reshape(-1).view(torch.uint8)


def _packed(chunk: Chunk, stage: torch.Tensor, dtypes: Sequence[torch.dtype]) -> list[torch.Tensor]:
    """Each piece's place in ``stage`` (the chunk's packed bytes), as a tensor of its dtype
    (``dtypes``, in item order) and shape: one split for the chunk, not a slice per piece."""
    cuts, pos = [], chunk.start
    for piece, at in chunk.items:
        nbytes = piece.nbytes
        cuts += (at - pos, nbytes)
        pos = at + nbytes
    cuts.append(stage.numel() - (pos - chunk.start))
    parts = torch.split(stage, cuts)[1::2]
    return [
        b.view(dt).view(piece.sizes)
        for b, dt, (piece, _) in zip(parts, dtypes, chunk.items, strict=True)
    ]


def _pack(chunk: Chunk, sets: Sequence[Holding], out: torch.Tensor) -> None:
    """Copy the chunk's pieces from their holdings (``sets[piece.src_set]``) into ``out``
    (the chunk's packed data, CPU)."""
    held = [sets[p.src_set][p.key] for p, _ in chunk.items]
    dev = held[0][0].device
    if any(t.device != dev for t, _ in held):
        dev = torch.device("cpu")  # mixed holdings (a host replica beside GPU tensors)
    stage = out if dev.type == "cpu" else torch.empty(out.numel(), dtype=torch.uint8, device=dev)
    places = _packed(chunk, stage, [t.dtype for t, _ in held])
    regions = [_region(t, info, p) for (t, info), (p, _) in zip(held, chunk.items, strict=True)]
    torch._foreach_copy_(places, regions)
    if stage is not out:
        out.copy_(stage)


def _unpack(chunk: Chunk, data: torch.Tensor, tensors: Holding) -> None:
    """Copy the chunk's pieces from ``data`` (its message, CPU) into ``tensors``."""
    dev = _stage_device(chunk, tensors)
    stage = data if dev.type == "cpu" else data.to(dev, non_blocking=data.is_pinned())
    held = [tensors[p.key] for p, _ in chunk.items]
    places = _packed(chunk, stage, [t.dtype for t, _ in held])
    regions = [_region(t, info, p) for (t, info), (p, _) in zip(held, chunk.items, strict=True)]
    torch._foreach_copy_(regions, places)


def _crc(data: torch.Tensor) -> int:
    """CRC-32C of a contiguous CPU uint8 tensor (hardware-accelerated; the GIL is
    released for large buffers)."""
    return crc32c.crc32c(data.numpy())


def _same_memory(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether two views are the very same elements (a copy between them changes nothing)."""
    return (
        a.data_ptr() == b.data_ptr()
        and a.device == b.device
        and a.dtype == b.dtype
        and a.shape == b.shape
        and a.stride() == b.stride()
    )


def _copy_local(pieces: Sequence[Piece], sets: Sequence[Holding], need: Holding) -> int:
    """Copy the pieces a rank holds itself; none where the held and the needed region are
    the same memory (a caller passing its live tensors as both ``have`` and ``need``).
    Returns their bytes."""
    nbytes = 0
    for p in pieces:
        src_t, src_info = sets[p.src_set][p.key]
        dst_t, dst_info = need[p.key]
        nbytes += p.nbytes
        if src_t is dst_t and src_info.offsets == dst_info.offsets:
            continue  # the same elements of the same tensor
        src, dst = _region(src_t, src_info, p), _region(dst_t, dst_info, p)
        if not _same_memory(src, dst):
            dst.copy_(src)
    return nbytes


class _Inbound:
    """The receiving side of one transfer: every message posted up front (:meth:`post`),
    then taken in the order the senders send (:meth:`take`)."""

    def __init__(self, me: int, group: dist.ProcessGroup | None, need: Holding, pinned: bool):
        self.me, self.group, self.need, self.pinned = me, group, need, pinned
        self.chunks: list[tuple[int, int, Chunk, torch.Tensor, Any, bool]] = []
        """(index, source, chunk, where its bytes land, its receive, landed in place)."""
        self.tables: dict[int, tuple[torch.Tensor, Any]] = {}
        """Source -> (its CRCs of the pair's chunks, their receive)."""

    def post(self, src: int, chunks: Sequence[Chunk]) -> None:
        """One receive per chunk (tag: its index), then one of the pair's CRCs (tag: the
        chunk count). A one-piece chunk whose region is contiguous in its CPU destination
        lands there (no buffer, no unpack); the others in one buffer for the source."""
        places = [_direct(c, self.need) for c in chunks]
        size = sum(c.length for c, d in zip(chunks, places, strict=True) if d is None)
        buf = _new_buffer(size, self.pinned and size <= PINNED_RECEIVE_MAX)
        at = 0
        for i, (c, place) in enumerate(zip(chunks, places, strict=True)):
            direct = place is not None
            if place is None:
                place, at = buf[at : at + c.wire], at + c.length
            self.chunks.append((i, src, c, place, _irecv(place, src, i, self.group), direct))
        table = torch.empty(len(chunks), dtype=torch.int64)
        self.tables[src] = (table, _irecv(table, src, len(chunks), self.group))

    def take(self) -> tuple[dict[int, int], list[str]]:
        """Wait for each chunk, checksum it and unpack it as it arrives, then check every
        CRC against its sender's. Returns the bytes from each source and the chunks that
        failed (a failure fails the whole transfer; the need tensors may be partly written,
        as documented)."""
        self.chunks.sort(key=lambda x: (x[0], x[1]))  # chunk by chunk, round-robin
        received: dict[int, int] = {}
        crcs: dict[int, dict[int, int]] = defaultdict(dict)
        for i, src, c, data, work, direct in self.chunks:
            work.wait()
            if _received_hook is not None:
                _received_hook(src, self.me, data)
            crcs[src][i] = _crc(data)
            if not direct:
                _unpack(c, data, self.need)
            received[src] = received.get(src, 0) + sum(p.nbytes for p, _ in c.items)
        bad = []
        for src, (table, work) in self.tables.items():
            work.wait()
            want = table.tolist()
            bad += [f"chunk {i} from rank {src}" for i, crc in crcs[src].items() if want[i] != crc]
        return received, bad


def _send(
    outbound: Mapping[int, Sequence[Chunk]],
    sets: Sequence[Holding],
    group: dist.ProcessGroup | None,
    pinned: bool,
) -> tuple[dict[int, int], list]:
    """Send every chunk to its destination: chunk by chunk, round-robin over the
    destinations, so every receiver starts early. A one-piece chunk contiguous in its CPU
    source goes out as a view of it; the others are packed through a small ring of staging
    slots (no state-sized allocation: page faults cost as much as the copy, and the slots
    stay warm). Each chunk is checksummed while it is on its way (it is not written
    meanwhile); a pair's CRCs follow its last chunk, one message. Returns the bytes sent
    to each destination and the sends to wait for."""
    outgoing = {d: [_direct(c, sets[c.items[0][0].src_set]) for c in ch]
                for d, ch in outbound.items()}  # fmt: skip
    slot_bytes = max((c.length for d, ch in outbound.items()
                      for c, v in zip(ch, outgoing[d], strict=True) if v is None), default=0)  # fmt: skip
    ring = _new_buffer(SEND_SLOTS * slot_bytes, pinned) if slot_bytes else None
    in_slot: list = [None] * SEND_SLOTS
    in_flight = []
    crcs: dict[int, list[int]] = {d: [] for d in outbound}
    sent_to: dict[int, int] = {}
    packed = 0
    for i in range(max((len(ch) for ch in outbound.values()), default=0)):
        for dst, chunks in outbound.items():
            if i >= len(chunks):
                continue
            c, msg = chunks[i], outgoing[dst][i]
            if msg is None:
                k = packed % SEND_SLOTS
                if in_slot[k] is not None:
                    in_slot[k].wait()  # a gloo send's wait must not be repeated
                msg = ring[k * slot_bytes : k * slot_bytes + c.wire]
                _pack(c, sets, ring[k * slot_bytes : k * slot_bytes + c.length])
                in_slot[k] = _isend(msg, dst, i, group)
                packed += 1
            else:
                in_flight.append(_isend(msg, dst, i, group))
            crcs[dst].append(_crc(msg))
            if i == len(chunks) - 1:
                table = torch.tensor(crcs[dst], dtype=torch.int64)
                in_flight.append(_isend(table, dst, len(chunks), group))
            sent_to[dst] = sent_to.get(dst, 0) + sum(p.nbytes for p, _ in c.items)
    return sent_to, [w for w in (*in_slot, *in_flight) if w is not None]


def _new_buffer(nbytes: int, pinned: bool) -> torch.Tensor:
    return torch.empty(nbytes, dtype=torch.uint8, pin_memory=pinned)


def recover_from_peers(
    *,
    have: Holding | None,
    have_step: int | None,
    have_consumed: int | None,
    need: Holding,
    group: dist.ProcessGroup | None,
    extra: Sequence[Held] = (),
    before_write: Callable[[int], None] | None = None,
    refused: Callable[[str], None] | None = None,
    digests: Mapping[str, int] | None = None,
) -> LiveRecovery | None:
    """Fill ``need`` in place from what the ranks of ``group`` still hold; collective.

    ``have``: what this rank holds from before the fault (None for a newcomer), at step
    ``have_step`` with the data position ``have_consumed``. ``extra``: more holdings, each
    at its own step (snapshots, peers' in-memory replicas); a region may come from any of
    them held at the agreed step. ``need``: the new layout's tensors, which may be (or
    share memory with) ``have``'s where the region is the same. ``before_write(step)``:
    called once the step is agreed, before anything is written into ``need`` (not called
    when nothing will be). ``group``: a gloo group over the new world (every rank calls
    this); None or torch.distributed not initialised means one process. Returns None on
    every rank when the live state cannot fill every needed region at one step, or a chunk
    failed its CRC on any rank (``need`` may then be partly written); ``refused(why)`` is
    then called on every rank with the reason (the same on every rank: it comes from the
    gathered descriptions or the agreement). Raises when a peer dies mid-transfer.
    ``digests`` (key -> a checksum of the held tensor's bytes): for state claimed
    replicated, a key is sent only if every holder at the step gave the same digest.
    """
    # The cyclic garbage collector is off for the call: it allocates a tuple or two per
    # tensor, and in a trainer's process (a model, its optimizer, torch's own modules)
    # each collection that triggers walks every object: measured here, 8,000 tensors
    # took 0.5 s in collections against 0.01 s of the work itself. Nothing here makes
    # cycles; the collector's state is restored after.
    enabled = gc.isenabled()
    gc.disable()
    try:
        return _recover_from_peers(
            have=have, have_step=have_step, have_consumed=have_consumed, need=need,
            group=group, extra=extra, before_write=before_write, refused=refused,
            digests=digests,
        )  # fmt: skip
    finally:
        if enabled:
            gc.enable()


def _recover_from_peers(
    *,
    have: Holding | None,
    have_step: int | None,
    have_consumed: int | None,
    need: Holding,
    group: dist.ProcessGroup | None,
    extra: Sequence[Held],
    before_write: Callable[[int], None] | None,
    refused: Callable[[str], None] | None,
    digests: Mapping[str, int] | None,
) -> LiveRecovery | None:
    started = time.perf_counter()
    marks: dict[str, float] = {}

    last = [started]

    def mark(name: str) -> None:
        now = time.perf_counter()
        marks[name], last[0] = now - last[0], now

    me, world = group_rank(group), group_size(group)
    mine = describe(have=have, have_step=have_step, have_consumed=have_consumed, need=need,
                    extra=extra, digests=digests)  # fmt: skip
    descs = gather_descriptions(mine, group)
    plan, why = plan_recovery(descs)
    mark("plan")
    planned = time.perf_counter()
    if plan is None:
        if me == 0:
            log.warning("state from peers is not possible: %s", why)
        if refused is not None:
            refused(why)
        return None
    if before_write is not None:
        before_write(plan.step)
    held: Holding = have or {}
    sets: list[Holding] = [held, *(h.tensors for h in extra)]
    pairs: dict[tuple[int, int], list[Piece]] = defaultdict(list)
    for p in plan.pieces:
        if p.src == me or p.dst == me:
            pairs[p.src, p.dst].append(p)
    pinned = torch.cuda.is_available() and any(
        t.is_cuda for h in (*sets, need) for t, _ in h.values()
    )
    inbound = _Inbound(me, group, need, pinned)
    for src in range(world):
        if src != me and pairs.get((src, me)):
            inbound.post(src, pair_chunks(pairs[src, me]))
    mark("post")
    outbound = {
        d: pair_chunks(pairs[me, d]) for d in range(world) if d != me and pairs.get((me, d))
    }
    sent_to, sends = _send(outbound, sets, group, pinned)
    mark("send")
    bytes_local = _copy_local(pairs.get((me, me), []), sets, need)  # while data is in flight
    mark("local")
    received_from, bad = inbound.take()
    mark("receive")
    for work in sends:
        work.wait()
    if bad:
        log.warning("state from peers: CRC mismatch on rank %d: %s", me, ", ".join(bad))
    mark("sent")
    ok = not bad
    if world > 1:
        flag = torch.tensor([1 if ok else 0], dtype=torch.int32)
        dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=group)
        ok = bool(flag.item())
    if not ok:
        if me == 0:
            log.warning("state from peers failed its checksums; falling back")
        if refused is not None:
            refused("a transfer failed its CRC-32C check")
        return None
    return LiveRecovery(
        step=plan.step,
        consumed_samples=plan.consumed_samples,
        bytes_in=sum(received_from.values()),
        bytes_local=bytes_local,
        seconds=time.perf_counter() - started,
        sources={
            "holders": list(plan.holders),
            "skipped_steps": list(plan.skipped_steps),
            "received_from": {str(k): v for k, v in sorted(received_from.items())},
            "sent_to": {str(k): v for k, v in sorted(sent_to.items())},
            "bytes_out": sum(sent_to.values()),
            "pieces": len(plan.pieces),
            "from_extra": any(p.src_set > 0 for p in plan.pieces),
            "chunks_in": len(inbound.chunks),
            "chunks_in_direct": sum(direct for *_, direct in inbound.chunks),
            "plan_seconds": planned - started,
            "phases": marks,
        },
    )


def _isend(t: torch.Tensor, dst: int, tag: int, group: dist.ProcessGroup | None):
    return dist.isend(t, group=group, group_dst=dst, tag=tag)


def _irecv(t: torch.Tensor, src: int, tag: int, group: dist.ProcessGroup | None):
    return dist.irecv(t, group=group, group_src=src, tag=tag)


__all__ = [
    "CHUNK_BYTES",
    "Chunk",
    "Held",
    "Holding",
    "LiveRecovery",
    "Piece",
    "RecoveryPlan",
    "describe",
    "pair_chunks",
    "plan_recovery",
    "plan_step",
    "recover_from_peers",
    "split_box",
    "subtract",
]
