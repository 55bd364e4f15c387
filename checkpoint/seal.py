"""Sealed checkpoints: a secret key that makes a checkpoint's content tamper-evident.

Without a key, every checksum of a checkpoint (the manifest's own sha256, each file's
``header_sha256``, the CRC-32C of each verify block) can be recomputed by anyone who can
write the directory, so they catch accidents, not an attacker: a re-sealed manifest and
rewritten tensors load as if the job had saved them. With a key (``checkpoint.key_file``,
``SaveOptions.key``, ``--key-file``), a save also writes:

- in each tensor file's header, beside each block's CRC-32C, a MAC of the block: the first
  :data:`TAG_BYTES` bytes of HMAC-SHA256 under the key, 16 hex digits per block, in the
  ``__metadata__`` entry ``mac:<key>`` (:data:`MAC_META`), which the header's sha256 in the
  manifest covers;
- in the manifest, ``seal``: ``{"alg": "hmac-sha256", "key_id": ..., "mac": ...}``, the
  HMAC-SHA256 under the key of the sha256 of the manifest's canonical JSON (every field but
  ``checksum``, with ``seal`` less its ``mac``).

A reader with the key checks the manifest's seal before it trusts any field of it, and
every block's MAC as it reads the block, so a changed byte anywhere (a tensor, a header,
the manifest's step, commit number or scalars) is refused, and so is a step with no seal or
another key's. A reader without the key checks what it always did (the CRCs) and ignores
the seal. What a seal does not do: hide anything (nothing is encrypted), or say that a
sealed step is the newest (an attacker who can write the directory can delete steps, or
put back an older sealed one: its step and commit number are sealed with it, so it is
only ever that older step).

Standard library only, like :mod:`checkpoint.step`: checking a checkpoint needs no torch.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os
import secrets
import stat
from collections.abc import Mapping
from typing import Any

from checkpoint.errors import CheckpointError, CorruptCheckpointError

ALG = "hmac-sha256"
"""The seal's algorithm name, as the manifest records it."""
TAG_BYTES = 8
"""Bytes of each verify block's MAC kept (HMAC-SHA256 truncated, as RFC 2104 allows): a
forged block passes with probability 2^-64, and without the key nobody can try offline."""
TAG_HEX = 2 * TAG_BYTES
MAC_META = "mac:"
"""A tensor file header's ``__metadata__`` entry ``mac:<key>``: the block MACs of tensor
``<key>``, :data:`TAG_HEX` hex digits each, concatenated, in the blocks of its CRC-32Cs."""
MIN_KEY_BYTES = 32
MAX_KEY_BYTES = 4096
_KEY_ID_INFO = b"elasticd checkpoint key id"
CHANGED = "its seal does not match its content (changed after it was sealed)"


class KeyFileError(CheckpointError):
    """A key file that cannot be used (missing, readable by others, too short): a user
    error, said in one line."""


class SealError(CorruptCheckpointError):
    """A checkpoint that a reader with a key does not take: it has no seal, or another
    key's. A load falls back past it as past a damaged step, but does not record it as
    unloadable: it may be a good step saved before the job had this key. (A seal or a
    block MAC that does not match is damage: CorruptCheckpointError.)"""


def read_key(path: str) -> bytes:
    """The key in ``path``: its bytes, less surrounding whitespace, at least
    :data:`MIN_KEY_BYTES` of them. Refused (KeyFileError, one line) unless it is a regular
    file (a symlink is followed: a key is often mounted as one, a Kubernetes secret) that
    neither its group nor others may read or write, like ssh's private keys."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    except OSError as exc:
        raise KeyFileError(f"checkpoint key file {path}: {exc.strerror}") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise KeyFileError(f"checkpoint key file {path}: not a regular file")
        if st.st_mode & 0o077:
            raise KeyFileError(
                f"checkpoint key file {path}: mode {stat.S_IMODE(st.st_mode):04o} lets its "
                f"group or others at it; chmod 600 {path}"
            )
        data = b""
        while len(data) <= MAX_KEY_BYTES:  # a read may return less than asked
            part = os.read(fd, MAX_KEY_BYTES + 1 - len(data))
            if not part:
                break
            data += part
    except OSError as exc:  # EIO (a failing disk, /proc/self/mem): one line, no traceback
        raise KeyFileError(f"checkpoint key file {path}: {exc.strerror}") from None
    finally:
        os.close(fd)
    if len(data) > MAX_KEY_BYTES:
        raise KeyFileError(f"checkpoint key file {path}: more than {MAX_KEY_BYTES} bytes")
    key = data.strip()
    if len(key) < MIN_KEY_BYTES:
        raise KeyFileError(
            f"checkpoint key file {path}: {len(key)} bytes, fewer than {MIN_KEY_BYTES} "
            "(make one with `elasticd ckpt keygen PATH`)"
        )
    return key


def write_new_key(path: str) -> str:
    """Create ``path`` (never over an existing file or through a symlink), mode 600,
    holding a new random key (32 bytes, as 64 hex digits); returns its id."""
    text = secrets.token_hex(32)
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    except OSError as exc:
        raise KeyFileError(f"checkpoint key file {path}: {exc.strerror}") from None
    try:
        os.fchmod(fd, 0o600)  # whatever the umask
        os.write(fd, (text + "\n").encode())
        os.fsync(fd)
    finally:
        os.close(fd)
    return key_id(text.encode())


def key_id(key: bytes) -> str:
    """A key's public name (16 hex digits), recorded in the seal: which key sealed a step
    can be said without the key."""
    return hmac.digest(key, _KEY_ID_INFO, "sha256")[:8].hex()


def block_macs(buf: memoryview | bytes, block_bytes: int, key: bytes) -> str:
    """The MAC of each ``block_bytes`` of ``buf``, as :func:`checkpoint.stfile.block_crc32c`
    cuts them (the last may be shorter; ``block_bytes`` 0 or ``buf`` no longer than it: one
    for all of it), :data:`TAG_HEX` hex digits each, concatenated. OpenSSL's HMAC releases
    the GIL, so writer and hasher threads overlap it."""
    view = memoryview(buf).cast("B")
    if not block_bytes or len(view) <= block_bytes:
        return hmac.digest(key, view, "sha256")[:TAG_BYTES].hex()
    out = bytearray()
    for i in range(0, len(view), block_bytes):
        out += hmac.digest(key, view[i : i + block_bytes], "sha256")[:TAG_BYTES]
    return out.hex()


def macs_match(buf: memoryview | bytes, block_bytes: int, expected: str, key: bytes) -> bool:
    return hmac.compare_digest(block_macs(buf, block_bytes, key), expected)


def mac_count(text: str) -> int:
    return len(text) // TAG_HEX


def _canonical_digest(body: Mapping[str, Any]) -> bytes:
    """sha256 of ``body``'s canonical JSON less ``checksum`` and the seal's ``mac``."""
    inner = {k: v for k, v in body.items() if k != "checksum"}
    seal = inner.get("seal")
    if isinstance(seal, dict):
        inner["seal"] = {k: v for k, v in seal.items() if k != "mac"}
    canon = json.dumps(inner, sort_keys=True, separators=(",", ":")).encode()
    return hashlib.sha256(canon).digest()


def seal_body(body: dict[str, Any], key: bytes) -> None:
    """Add ``seal`` to a manifest's body (before its ``checksum`` is computed)."""
    body["seal"] = {"alg": ALG, "key_id": key_id(key)}
    body["seal"]["mac"] = hmac.digest(key, _canonical_digest(body), "sha256").hex()


def seal_problem(raw: Mapping[str, Any], key: bytes) -> str:
    """Why a parsed manifest is not sealed with ``key`` ("" when it is)."""
    seal = raw.get("seal")
    if seal is None:
        return "not sealed (saved without a key)"
    if not isinstance(seal, dict) or seal.get("alg") != ALG:
        return "its seal is not one this build reads"
    mine = key_id(key)
    if seal.get("key_id") != mine:
        said = seal.get("key_id")
        # A key id is 16 hex digits; anything else is shown as Python writes it, so a
        # planted "abc\nFAKE: ..." or a terminal escape never reaches the message raw.
        if isinstance(said, str) and len(said) <= 32:
            shown = said if said.isascii() and said.isalnum() else ascii(said)
        else:
            shown = "?"
        return f"sealed with another key (key id {shown}; this key's id is {mine})"
    mac = seal.get("mac")
    want = hmac.digest(key, _canonical_digest(raw), "sha256").hex()
    # compare_digest raises TypeError on a str that is not ASCII (a planted "mac": "é..."
    # crashed every listing of the directory with the key): such a one matches nothing.
    if not isinstance(mac, str) or not mac.isascii() or not hmac.compare_digest(mac, want):
        return CHANGED
    return ""


def check_seal(raw: Mapping[str, Any], key: bytes, where: str) -> None:
    """Raise unless the parsed manifest ``raw`` is sealed with ``key``: SealError for a
    step with no seal or another key's (not damage: perhaps saved before the job had this
    key), CorruptCheckpointError for a seal that does not match (changed since)."""
    problem = seal_problem(raw, key)
    if problem == CHANGED:
        raise CorruptCheckpointError(f"{where}: {problem}")
    if problem:
        raise SealError(f"{where}: {problem}")


def header_macs(header: Mapping[str, Any], tensor_key: str, blocks: int, path: str) -> str:
    """The block MACs of tensor ``tensor_key`` in a parsed header (:data:`MAC_META`), or
    CorruptCheckpointError naming what is missing (the sealed manifest's ``header_sha256``
    covers the header, so a header without them is not the one that was sealed)."""
    meta = header.get("__metadata__")
    text = meta.get(MAC_META + tensor_key) if isinstance(meta, dict) else None
    if not isinstance(text, str) or len(text) != TAG_HEX * blocks:
        raise CorruptCheckpointError(
            f"{path}: {tensor_key[:200]!a}: the header does not hold its {blocks} block MACs "
            f"({TAG_HEX} hex digits each)"
        )
    return text


def placeholder(blocks: int) -> str:
    """What a header holds for ``blocks`` MACs before they are known (same length)."""
    return "0" * TAG_HEX * blocks
