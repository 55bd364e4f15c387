"""Whole-checkpoint checks (``elasticd ckpt verify``) and consolidated export."""

from __future__ import annotations

import contextlib
import errno
import functools
import hashlib
import hmac
import json
import math
import os
import re
import zlib
from collections.abc import Callable, Iterable, Iterator
from typing import TYPE_CHECKING, Any

import crc32c

from checkpoint.errors import CheckpointError, CorruptCheckpointError
from checkpoint.manifest import TensorEntry, file_name, quoted, region_chunks
from checkpoint.planner import SavedChunk, row_bytes
from checkpoint.seal import TAG_BYTES, block_macs, header_macs
from checkpoint.step import CheckpointFiles, read_header_checked
from checkpoint.stfile import block_checksums, fd_sha256, header_crcs, pread_into

if TYPE_CHECKING:
    from checkpoint.load import Checkpoint


KEPT = 100
"""Problems :func:`verify` keeps the text of; it counts them all (a hostile manifest may
list millions of chunks)."""


class Problems(list):
    """What :func:`verify` found: the first :data:`KEPT` problems (a list of lines), and
    how many there were in all (:attr:`total`)."""

    def __init__(self) -> None:
        super().__init__()
        self.total = 0

    def add(self, text: str) -> None:
        self.total += 1
        if len(self) < KEPT:
            self.append(text)


def verify(ckpt: CheckpointFiles) -> Problems:
    """Every problem found, checking every byte of every file (torch is not imported).
    A step opened with a key (its manifest's seal checked then) has every block's MAC
    checked too.

    Versions 2 and 3: each file is a regular file of its recorded size; its header matches
    its sha256, and its entries are exactly the manifest's chunks of that file and tile its
    data section; every chunk matches its CRC-32C (version 3: every block of it). So every
    byte is checked by one checksum or the other. Version 1: the whole-file sha256 of each file, and its header.
    Then, for both, every chunk's header entry against the manifest.

    One file at a time, its chunks cut only once its header holds at least as many
    tensors as the manifest lists chunks in it: the cost is the files', whatever number
    of chunks a manifest claims (one problem, not one per chunk, when they are not there)."""
    problems = Problems()
    m = ckpt.manifest
    # Each file's share of the manifest: version 4 regions (cut into chunks later), or
    # chunks; and how many chunks that is.
    shares: dict[str, list[tuple[str, TensorEntry, Any]]] = {}
    counts: dict[str, int] = {}
    for tname, entry in sorted(m.tensors.items()):
        for item in entry.regions if m.version >= 4 else entry.chunks:
            file = file_name(item[0]) if m.version >= 4 else item.file
            shares.setdefault(file, []).append((tname, entry, item))
            counts[file] = counts.get(file, 0) + (item[3] if m.version >= 4 else 1)
    for name, meta in sorted(m.files.items()):
        path = os.path.join(ckpt.path, name)
        try:
            # Refused unless a regular file of the manifest's size, before anything is read.
            fd, size = ckpt.open_file(name)
            try:
                _verify_file(
                    ckpt, fd, size, path, meta, shares.get(name, []), counts.get(name, 0), problems
                )
            finally:
                os.close(fd)
        except CheckpointError as exc:
            problems.add(str(exc))
    return problems


def _verify_file(ckpt, fd, size, path, meta, share, count, problems: Problems) -> None:
    """Check one file against its ``share`` of the manifest (``count`` chunks)."""
    version = ckpt.manifest.version
    header, parsed = read_header_checked(fd, size, path)
    sound = True  # version 2 on: its header matches the manifest, so its data is checked
    if version == 1 and fd_sha256(fd, size, path) != meta.sha256:
        problems.add(f"{path}: sha256 mismatch (corrupted)")
    # Every version, as a load checks it (version 1 too: a step whose header checksum or a
    # chunk's CRC-32 was wrong passed verify and failed every load).
    if hashlib.sha256(header).hexdigest() != meta.header_sha256:
        problems.add(f"{path}: header checksum mismatch")
        sound = False
    held = len(parsed) - ("__metadata__" in parsed)
    if count > held:
        problems.add(
            f"{path}: the manifest lists {count} chunks in it, its header holds {held} tensors"
        )
        return
    chunks: dict[str, tuple[str, TensorEntry, SavedChunk]] = {}
    for tname, entry, item in share:
        for c in region_chunks(tname, item) if version >= 4 else (item,):
            chunks[c.key] = (tname, entry, c)
    if sound and version == 1:
        _verify_v1_chunks(fd, size, len(header), parsed, chunks, problems, path)
    elif sound:
        _verify_v2_data(fd, size, path, header, parsed, chunks, problems, in_manifest=version < 4,
                        ckpt_key=ckpt.key)  # fmt: skip
    for key, (tname, entry, c) in sorted(chunks.items()):
        info = parsed.get(key)
        want = {"dtype": entry.st_code, "shape": list(c.sizes)}
        if not isinstance(info, dict) or {k: info.get(k) for k in want} != want:
            problems.add(
                f"{quoted(tname)}: {c.file} key {quoted(c.key)} is missing or has the wrong "
                "dtype/shape"
            )


READ_BYTES = 8 << 20
"""Most bytes ``verify`` reads at a time (whole verify blocks of one chunk)."""


def _verify_v2_data(
    fd: int,
    size: int,
    path: str,
    header: bytes,
    parsed: dict,
    chunks: dict[str, tuple[str, TensorEntry, SavedChunk]],
    problems: Problems,
    *,
    in_manifest: bool,
    ckpt_key: bytes | None = None,
) -> None:
    """Check the data of one file of format version 2 or later, whose header matches the
    manifest's checksum: its entries are ``chunks`` (by key), tile its data section, and
    match their checksums (from the manifest, ``in_manifest``, or in version 4 from its
    header)."""
    entries = {k: v for k, v in parsed.items() if k != "__metadata__"}
    if set(entries) != set(chunks):
        problems.add(f"{path}: its tensors are not the manifest's chunks of this file")
        return
    at = 0
    for begin, end in sorted(v["data_offsets"] for v in entries.values()):
        if begin != at:
            problems.add(f"{path}: bytes {at}..{begin} of its data belong to no tensor")
            return
        at = end
    if at != size - len(header):
        problems.add(f"{path}: bytes after {at} of its data belong to no tensor")
        return
    # Read (pread, never a memory map: a file truncated meanwhile is a problem reported,
    # not a SIGBUS), at most READ_BYTES at a time.
    buf = memoryview(bytearray(min(READ_BYTES, size)))
    for key, (_, entry, c) in sorted(chunks.items()):
        begin, end = entries[key]["data_offsets"]
        if end - begin != math.prod(c.sizes) * entry.itemsize:
            continue  # its header entry is not the manifest's chunk: named by the caller
        # Bytes per verify block (the whole chunk before version 3), and the checksums:
        # from the manifest, or (version 4) from the file's header.
        block = entry.rows_per_block(c) * row_bytes(c.sizes, entry.itemsize)
        if in_manifest:
            crc = entry.crc32[(c.file, c.key)]
        else:
            try:
                crc = header_crcs(parsed, key, entry.blocks(c), path)
            except CorruptCheckpointError as exc:
                problems.add(str(exc))
                continue
        mac = None
        if ckpt_key is not None:
            try:
                mac = header_macs(parsed, key, entry.blocks(c), path)
            except CorruptCheckpointError as exc:
                problems.add(str(exc))
                continue
        sums, macs = _chunk_sums(fd, len(header) + begin, end - begin, block, buf, path, ckpt_key)
        if sums != crc:
            problems.add(f"{path}: {quoted(key)}: checksum mismatch (corrupted data)")
        elif mac is not None and not hmac.compare_digest(macs, mac):
            problems.add(f"{path}: {quoted(key)}: MAC mismatch (changed after it was sealed)")


def _verify_v1_chunks(fd: int, size: int, start: int, parsed: dict, chunks: dict, problems,
                      path: str) -> None:  # fmt: skip
    """Each chunk of a version 1 file against its zlib CRC-32 in the manifest (one per
    chunk, as a load checks it; the file's whole sha256 covers the rest)."""
    buf = memoryview(bytearray(min(READ_BYTES, size)))
    for key, (_, entry, c) in sorted(chunks.items()):
        info = parsed.get(key)
        if not isinstance(info, dict):
            continue  # named by the caller
        begin, end = info["data_offsets"]
        if end - begin != math.prod(c.sizes) * entry.itemsize:
            continue  # its header entry is not the manifest's chunk: named by the caller
        n = end - begin
        got, _ = _chunk_sums(fd, start + begin, n, n, buf, path, None, crc=zlib.crc32)
        if got != entry.crc32[(c.file, c.key)]:
            problems.add(f"{path}: {quoted(key)}: checksum mismatch (corrupted data)")


def _in_hole(fd: int, at: int, nbytes: int) -> bool:
    """Whether the ``nbytes`` at ``at`` are all a hole of a sparse file (no data there,
    by ``SEEK_DATA``; a file system without it says all is data), inside the file as it
    is now: bytes past its end (a file truncated while it is read) are read, and the read
    names the truncation."""
    try:
        if os.lseek(fd, at, os.SEEK_DATA) < at + nbytes:
            return False
    except OSError as exc:
        if exc.errno != errno.ENXIO:  # ENXIO: no data from ``at`` to the end
            return False
    except AttributeError:  # no SEEK_DATA on this platform
        return False
    return os.fstat(fd).st_size >= at + nbytes


@functools.lru_cache(maxsize=64)
def _zero_sums(nbytes: int, crc: Callable) -> str:
    """The checksum (8 hex digits) of ``nbytes`` zeros."""
    return block_checksums(bytes(nbytes), nbytes, crc)


@functools.lru_cache(maxsize=64)
def _zero_macs(nbytes: int, key: bytes) -> str:
    """The MAC of ``nbytes`` zeros (:func:`checkpoint.seal.block_macs`)."""
    return block_macs(bytes(nbytes), nbytes, key)


def _chunk_sums(
    fd: int,
    at: int,
    nbytes: int,
    block: int,
    buf: memoryview,
    path: str,
    key: bytes | None,
    crc: Callable = crc32c.crc32c,
) -> tuple[str, str]:
    """The block checksums (``crc``: CRC-32C, or version 1's zlib CRC-32) of the
    ``nbytes`` at ``at`` (see :func:`checkpoint.stfile.block_crc32c`) and, with
    ``key``, their MACs (:func:`checkpoint.seal.block_macs`; else ""), read into ``buf``:
    whole blocks per read when a block fits it, else each block's CRC and MAC carried
    across reads (a version 2 chunk is one block, of any size)."""
    if not nbytes:
        return block_checksums(b"", block, crc), block_macs(b"", block, key) if key else ""
    sums, macs = [], []
    if block <= len(buf):
        step = len(buf) // block * block
        for lo in range(0, nbytes, step):
            n = min(step, nbytes - lo)
            if _in_hole(fd, at + lo, n):
                # Reads as zeros: their sums without reading (a 64 GiB sparse file of 33 MB
                # on disk kept `ckpt verify` reading zeros for hours).
                whole, rest = divmod(n, block)
                sums.append(
                    _zero_sums(block, crc) * whole + (_zero_sums(rest, crc) if rest else "")
                )
                if key is not None:
                    macs.append(_zero_macs(block, key) * whole
                                + (_zero_macs(rest, key) if rest else ""))  # fmt: skip
                continue
            part = buf[:n]
            pread_into(fd, part, at + lo, path)
            sums.append(block_checksums(part, block, crc))
            if key is not None:
                macs.append(block_macs(part, block, key))
        return "".join(sums), "".join(macs)
    for first in range(0, nbytes, block):
        last, value = min(first + block, nbytes), 0
        mac = hmac.new(key, digestmod="sha256") if key is not None else None
        for lo in range(first, last, len(buf)):
            part = buf[: min(len(buf), last - lo)]
            pread_into(fd, part, at + lo, path)
            value = crc(part, value)
            if mac is not None:
                mac.update(part)
        sums.append(f"{value & 0xFFFFFFFF:08x}")
        if mac is not None:
            macs.append(mac.digest()[:TAG_BYTES].hex())
    return "".join(sums), "".join(macs)


def export(
    ckpt: Checkpoint,
    out: str,
    *,
    max_file_bytes: int = 5 << 30,
    log: Callable[[str], None] | None = None,
) -> list[str]:
    """Write the model tensors, consolidated, as Hugging-Face-style safetensors.

    One ``model.safetensors`` when the total fits ``max_file_bytes``; otherwise
    ``model-0000i-of-0000n.safetensors`` files plus ``model.safetensors.index.json``.
    Returns the files written.
    """
    names = sorted(n for n, e in ckpt.manifest.tensors.items() if e.kind == "model")
    if not names:
        raise CorruptCheckpointError(f"{ckpt.path}: holds no model tensors to export")
    ckpt.check_files()  # refuse a bad file before writing anything
    groups: list[list[str]] = [[]]
    size = 0
    for n in names:
        nbytes = ckpt.manifest.tensors[n].nbytes
        if groups[-1] and size + nbytes > max_file_bytes:
            groups.append([])
            size = 0
        groups[-1].append(n)
        size += nbytes
    meta = {"format": "pt", "step": str(ckpt.step)}
    if len(groups) == 1:
        files = ["model.safetensors"]
    else:
        files = [f"model-{i + 1:05d}-of-{len(groups):05d}.safetensors" for i in range(len(groups))]
    weight_map = {}
    names_out = [*files, *(["model.safetensors.index.json"] if len(files) > 1 else [])]
    with export_dir(out, names_out) as written:
        for fname, group in zip(files, groups, strict=True):
            tensors = {n: ckpt.read(n) for n in group}
            tmp = written.path(fname)
            write_safetensors(tensors, tmp, metadata=meta, shown=written.final(tmp))
            weight_map.update(dict.fromkeys(group, fname))
            if log:
                log(f"wrote {fname} ({len(group)} tensors)")
        if len(files) > 1:
            index = {
                "metadata": {"total_size": sum(ckpt.manifest.tensors[n].nbytes for n in names)},
                "weight_map": weight_map,
            }
            with open(written.path("model.safetensors.index.json"), "w") as f:
                json.dump(index, f, indent=2, sort_keys=True)
            files.append("model.safetensors.index.json")
    return files


WEIGHT_FILES = re.compile(
    r"(model|pytorch_model|tf_model|flax_model)([-.].*)?\.(safetensors|bin|h5|msgpack)(\.index\.json)?"
)
"""Names of a model's weight files (Hugging Face's and ours): an export refuses a directory
holding one that it would not replace (two models' weights side by side, one read by
transformers and the other by an index, are no model)."""


class ExportFiles:
    """The files of one export (:func:`export_dir`): :meth:`path` gives where to write
    each (a temporary name in the output directory); they take their names only once all
    are written."""

    def __init__(self, out: str) -> None:
        self.out = out
        self.pending: list[tuple[str, str]] = []  # (temporary, final)

    def path(self, name: str) -> str:
        final = os.path.join(self.out, name)
        tmp = os.path.join(self.out, f".{name}.partial-{os.getpid()}")
        self.pending.append((tmp, final))
        return tmp

    def final(self, tmp: str) -> str:
        """The name a file written at ``tmp`` will have (what an error names)."""
        return next(f for t, f in self.pending if t == tmp)


@contextlib.contextmanager
def export_dir(out: str, names: Iterable[str]) -> Iterator[ExportFiles]:
    """The output directory of an export of the files ``names``, made if missing. Each
    file is written under a temporary name (:meth:`ExportFiles.path`) and renamed into
    place once every one is written, readable as the umask allows: a failed export (a
    full disk) removes only its temporary files (and the directory, when it was made
    here), so an earlier export there stays whole. A directory holding weight files the
    export would not replace is refused first (one line), nothing written."""
    names = set(names)
    if os.path.isdir(out):
        stale = sorted(n for n in os.listdir(out) if WEIGHT_FILES.fullmatch(n) and n not in names)
        if stale:
            raise CheckpointError(
                f"{out}: holds other weight files ({', '.join(stale[:3])}"
                f"{', ...' if len(stale) > 3 else ''}) that this export would not replace, "
                "and that a reader could take for its model: export into an empty directory, "
                "or remove them"
            )
    made = not os.path.isdir(out)
    os.makedirs(out, exist_ok=True)
    _remove_dead_partials(out, names)
    files = ExportFiles(out)
    try:
        yield files
        mode = 0o666 & ~_umask()
        for tmp, _final in files.pending:
            os.chmod(tmp, mode)  # safetensors creates its files 0600
        for tmp, final in files.pending:
            os.replace(tmp, final)
    except BaseException:
        for tmp, _final in files.pending:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
        if made:
            with contextlib.suppress(OSError):
                os.rmdir(out)  # only if empty: nothing but what this export wrote
        raise


def _remove_dead_partials(out: str, names: set[str]) -> None:
    """Delete the temporary files of ``names`` that an export killed before its renames
    left in ``out`` (their process is gone)."""
    for entry in os.listdir(out):
        base, sep, pid = entry.rpartition(".partial-")
        if not sep or not pid.isdigit() or base[1:] not in names or not base.startswith("."):
            continue
        try:
            os.kill(int(pid), 0)
            continue  # its export is still running
        except ProcessLookupError:
            pass
        except OSError:
            continue
        with contextlib.suppress(OSError):
            os.unlink(os.path.join(out, entry))


def _umask() -> int:
    """The process's umask, read without changing it (os.umask would, for a moment, for
    every thread) where Linux says it; else through os.umask."""
    with (
        contextlib.suppress(OSError, ValueError, StopIteration),
        open("/proc/self/status", encoding="ascii") as fh,
    ):
        return int(next(ln for ln in fh if ln.startswith("Umask:")).split()[1], 8)
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def write_safetensors(
    tensors: dict, path: str, *, metadata: dict[str, str], shown: str | None = None
) -> None:
    """``safetensors.torch.save_file``, whose write errors (a full disk) raise its own
    ``SafetensorError``, not OSError: one CheckpointError line instead, naming ``shown``
    (the file's final name) or ``path``."""
    from safetensors import SafetensorError
    from safetensors.torch import save_file

    try:
        save_file(tensors, path, metadata=metadata)
    except SafetensorError as exc:
        text = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise CheckpointError(f"{shown or path}: cannot write: {text}") from None
