"""Sealing a committed step after the fact (``elasticd ckpt seal``): how a job that ran
without a key moves to sealed checkpoints without starting over.

The step is first checked whole (:func:`checkpoint.verify.verify`: every byte against its
CRC-32C, every file and chunk against the manifest). Each tensor file is then written
anew beside it (``step-N.<token>.tmp``) by the same writer a save uses
(:func:`checkpoint.stfile.write_file`, with the key: each block's MAC beside its CRC),
from the old file's bytes, and every CRC it computes on the way must equal the old
header's: a byte that changed between the check and the copy stops the seal. The
manifest is the old one with the new files' sizes and header checksums, sealed with the
key; its commit number stays (sealing certifies a commit, it is not a new one: a reader
without the key orders the steps as before). The sealed step then replaces the old one
as a save replaces a step: moved aside to ``step-N.<token>.replaced.tmp`` first, so a
crash in between leaves it to :func:`checkpoint.store.recover_replaced`.

A seal certifies the step as it is when sealed: the CRCs say it is what was saved only
against accidents. Seal a directory that nobody without the key could write meanwhile.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import secrets
import shutil
from concurrent.futures import ThreadPoolExecutor
from typing import Literal

from checkpoint import store
from checkpoint.errors import CheckpointError, CorruptCheckpointError
from checkpoint.manifest import MANIFEST, FileEntry
from checkpoint.seal import SealError, key_id
from checkpoint.smallfile import create_new
from checkpoint.step import CheckpointFiles, read_header_checked
from checkpoint.stfile import FileSlot, fsync_dir, header_crcs, read_exact, write_all, write_file
from checkpoint.verify import verify

Outcome = Literal["sealed", "already"]


def seal_step(ckpt_dir: str, step: int, key: bytes) -> Outcome:
    """Seal committed ``step`` of ``ckpt_dir`` with ``key`` (see the module's docstring):
    ``"already"`` when it is sealed with this key and checks, ``"sealed"`` once done.
    Raises CheckpointError (one line) when the step is not sound, not format version 4, or
    sealed with this key and no longer matching it (changed since: evidence, never
    resealed); the step is then left as it was. A step sealed with another key is checked
    by its CRCs and sealed with this one (a key rotation). The caller holds the directory
    (:func:`checkpoint.owner.holding`): no run may save into it meanwhile."""
    path = store.step_path(ckpt_dir, step)
    try:
        with CheckpointFiles.open(path, key=key) as ck:
            problems = verify(ck)
        if not problems:
            return "already"
        evidence = problems[0]
    except SealError:
        evidence = ""  # no seal, or another key's: checked below without the key
    except CheckpointError as exc:
        evidence = str(exc)  # this key's seal that does not match, or not sound at all
    with CheckpointFiles.open(path) as ck:
        m = ck.manifest
        if evidence and m.seal is not None and m.seal.get("key_id") == key_id(key):
            # Sealed with this very key and not matching it now: a change made since,
            # which the CRCs (anyone can keep those) would let through. Never certified
            # again.
            raise CorruptCheckpointError(
                f"{path}: changed since it was sealed with this key ({evidence}); not resealed"
            )
        if m.version < 4:
            raise CheckpointError(
                f"{path}: format version {m.version}: only version 4 steps can be sealed "
                "(a resume from it saves version 4)"
            )
        problems = verify(ck)
        if problems:
            raise CorruptCheckpointError(
                f"{path}: not sealed: {problems.total} problem(s) found: {problems[0]}"
            )
        token = secrets.token_hex(4)
        tmp = f"{path}.{token}.tmp"
        os.mkdir(tmp)
        try:
            files = _write_sealed_files(ck, tmp, key)
            sealed = dataclasses.replace(m, files=files)
            fd = create_new(os.path.join(tmp, MANIFEST))
            try:
                write_all(fd, sealed.to_json(key=key))
                os.fsync(fd)
            finally:
                os.close(fd)
            fsync_dir(tmp)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
    aside = f"{path}.{token}.replaced.tmp"
    os.replace(path, aside)
    try:
        os.replace(tmp, path)
    except BaseException:
        os.replace(aside, path)
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    fsync_dir(ckpt_dir)
    # Checked in place, as every reader will open it, before the old step goes.
    try:
        with CheckpointFiles.open(path, key=key) as check:
            left = [str(p) for p in verify(check)]
    except CheckpointError as exc:
        left = [str(exc)]
    if left:
        os.replace(path, tmp)
        os.replace(aside, path)
        fsync_dir(ckpt_dir)
        shutil.rmtree(tmp, ignore_errors=True)
        raise CorruptCheckpointError(f"{path}: the sealed copy failed its check ({left[0]}); "
                                     "the step is as it was")  # fmt: skip
    shutil.rmtree(aside, ignore_errors=True)
    store.clear_unloadable(ckpt_dir, step)  # checked whole just now
    return "sealed"


def _write_sealed_files(ck: CheckpointFiles, tmp: str, key: bytes) -> dict[str, FileEntry]:
    """Each tensor file of ``ck`` written anew into ``tmp`` with its block MACs, its CRCs
    recomputed from the bytes copied and matched against the old header's."""
    m = ck.manifest
    by_file: dict[str, dict[str, tuple]] = {}
    for entry in m.tensors.values():
        for c in entry.each_chunk():
            by_file.setdefault(c.file, {})[c.key] = (entry, c)
    out = {}
    with ThreadPoolExecutor(max_workers=2, thread_name_prefix="ckpt-seal") as pool:
        for name, meta in m.files.items():
            fd, size = ck.open_file(name)
            old = os.path.join(ck.path, name)
            try:
                header, parsed = read_header_checked(fd, size, old)
                chunks = by_file.get(name, {})
                slots = sorted(
                    (
                        FileSlot(
                            key=k,
                            dtype=entry.dtype,
                            shape=tuple(c.sizes),
                            begin=parsed[k]["data_offsets"][0],
                            end=parsed[k]["data_offsets"][1],
                            block_rows=entry.rows_per_block(c),
                        )
                        for k, (entry, c) in chunks.items()
                    ),
                    key=lambda s: s.begin,
                )
                part = functools.partial(_read_slot, fd, len(header), slots, old)
                w = write_file(os.path.join(tmp, name), slots, part, hasher_pool=pool, key=key)
                for k, (entry, c) in chunks.items():
                    if w.chunk_crc32[k] != header_crcs(parsed, k, entry.blocks(c), old):
                        raise CorruptCheckpointError(
                            f"{old}: changed while it was being sealed; nothing was replaced"
                        )
            finally:
                os.close(fd)
            out[name] = FileEntry(name=name, bytes=w.bytes, sha256="",
                                  header_sha256=w.header_sha256, rank=meta.rank)  # fmt: skip
    return out


def _read_slot(fd: int, start: int, slots: list[FileSlot], path: str, i: int) -> memoryview:
    """Slot ``i``'s bytes of an open tensor file whose data section begins at ``start``."""
    s = slots[i]
    return memoryview(read_exact(fd, start + s.begin, s.end - s.begin, path))
