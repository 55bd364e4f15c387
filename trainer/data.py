"""Token sources addressed by a global sample index, and the batch arithmetic on top.

A sample is ``seq_len + 1`` tokens: the inputs are the first ``seq_len``, the targets the
last ``seq_len``. Samples are numbered globally; step k consumes samples
``[k·global_batch, (k+1)·global_batch)``, each data-parallel rank takes its contiguous
slice of that range, and each micro-batch its part of the slice. The position is
``consumed_samples``, a global count, so training resumes at the same sample on any layout.

Two sources:

- :class:`SyntheticSource`: deterministic from the seed. Every sample is an arithmetic
  progression ``(a + j·d) mod vocab`` with ``a`` and ``d`` drawn from the sample's index,
  so after two tokens the rest is predictable and the loss visibly falls.
- :class:`TokenFile`: a memory-mapped file written by ``elasticd data prepare``: an
  8-byte magic, an 8-byte little-endian header length, a JSON header (``dtype``, ``count``,
  ``vocab``, ``tokenizer``), then the tokens from a 64-byte-aligned offset.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import numpy as np
import torch

from trainer.errors import DataError
from trainer.init import name_seed

MAGIC = b"EDTOKv1\0"
ALIGN = 64


class Source(Protocol):
    """Any indexable token source."""

    def sample(self, index: int) -> torch.Tensor:
        """Sample ``index`` as ``seq_len + 1`` int64 tokens."""
        ...


@dataclass(frozen=True, kw_only=True, slots=True)
class SyntheticSource:
    """Arithmetic progressions modulo the vocabulary, one per global sample index."""

    seed: int
    """Job seed; the same seed gives the same samples."""
    vocab: int
    """Token ids are in [0, vocab)."""
    seq_len: int
    """Inputs per sample (a sample holds one more token, for the last target)."""
    max_stride: int = 8
    """Strides are drawn from [1, max_stride]."""

    def sample(self, index: int) -> torch.Tensor:
        h = name_seed(self.seed, f"synthetic/{index}")
        start, stride = h % self.vocab, 1 + (h >> 20) % self.max_stride
        return (start + stride * torch.arange(self.seq_len + 1, dtype=torch.int64)) % self.vocab


class TokenFile:
    """A prepared token file, memory-mapped read-only; samples wrap around its end."""

    def __init__(self, path: str | os.PathLike[str], *, seq_len: int) -> None:
        self.path, self.seq_len = str(path), seq_len
        header, offset = read_header(self.path)
        self.vocab = int(header["vocab"])
        count = int(header["count"])
        try:
            self.tokens = np.memmap(
                self.path, dtype=np.dtype(header["dtype"]), mode="r", offset=offset, shape=(count,)
            )
        except (OSError, ValueError, TypeError) as exc:
            raise DataError(f"{self.path}: cannot map the tokens: {exc}") from exc
        self.num_samples = (count - 1) // seq_len
        if self.num_samples < 1:
            raise DataError(
                f"{self.path}: {count} tokens are too few for one sample of seq_len {seq_len}"
            )

    def sample(self, index: int) -> torch.Tensor:
        start = (index % self.num_samples) * self.seq_len
        chunk = np.asarray(self.tokens[start : start + self.seq_len + 1], dtype=np.int64)
        return torch.from_numpy(chunk.copy())


def read_header(path: str) -> tuple[dict, int]:
    """The JSON header of a token file and the byte offset of its first token."""
    try:
        with open(path, "rb") as fh:
            magic = fh.read(8)
            if magic != MAGIC:
                raise DataError(f"{path}: not a token file (bad magic {magic!r})")
            length = int.from_bytes(fh.read(8), "little")
            if not 0 < length < 1 << 20:
                raise DataError(f"{path}: header length {length} is implausible")
            header = json.loads(fh.read(length).decode("utf-8"))
    except FileNotFoundError as exc:
        raise DataError(
            f"{path}: no such token file (make one with `elasticd data prepare`)"
        ) from exc
    except OSError as exc:
        raise DataError(f"{path}: cannot read: {exc.strerror or exc}") from exc
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise DataError(f"{path}: the header is not valid JSON") from exc
    for key in ("dtype", "count", "vocab"):
        if key not in header:
            raise DataError(f"{path}: the header lacks {key!r}")
    return header, _data_offset(length)


def _data_offset(header_len: int) -> int:
    return -(-(16 + header_len) // ALIGN) * ALIGN


def write_token_file(
    path: str | os.PathLike[str], tokens: np.ndarray, *, vocab: int, tokenizer: str
) -> dict:
    """Write ``tokens`` with its header atomically (temp file, fsync, rename)."""
    dtype = np.uint16 if vocab <= 1 << 16 else np.uint32
    header = {
        "dtype": np.dtype(dtype).name,
        "count": int(tokens.size),
        "vocab": vocab,
        "tokenizer": tokenizer,
        "version": 1,
    }
    blob = json.dumps(header, separators=(",", ":")).encode()
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as fh:
        fh.write(MAGIC + len(blob).to_bytes(8, "little") + blob)
        fh.write(b"\0" * (_data_offset(len(blob)) - 16 - len(blob)))
        fh.write(np.ascontiguousarray(tokens, dtype=dtype).tobytes())
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, path)
    return header


def byte_tokens(texts: Iterable[bytes]) -> np.ndarray:
    """The byte-level tokenizer (vocab 256): a document's UTF-8 bytes; documents are joined
    by a newline byte."""
    out = bytearray()
    for i, text in enumerate(texts):
        if i:
            out += b"\n"
        out += text
    return np.frombuffer(bytes(out), dtype=np.uint8)


@dataclass(frozen=True, kw_only=True, slots=True)
class BatchPlan:
    """Which global samples this rank reads for one step."""

    global_batch: int
    """Samples per optimizer step in the whole world."""
    micro_batch: int
    """Samples per micro-batch on one data-parallel rank."""
    dp: int
    """Data-parallel ranks."""
    dp_rank: int
    """This rank's data-parallel index."""

    @property
    def grad_accum(self) -> int:
        return self.global_batch // (self.micro_batch * self.dp)

    def micro_batch_indices(self, consumed_samples: int) -> list[range]:
        """Global sample indexes of each micro-batch of the step starting at
        ``consumed_samples``."""
        per_rank = self.global_batch // self.dp
        first = consumed_samples + self.dp_rank * per_rank
        mb = self.micro_batch
        return [range(first + m * mb, first + (m + 1) * mb) for m in range(self.grad_accum)]


def micro_batches(
    source: Source, plan: BatchPlan, consumed_samples: int
) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """``(inputs, targets)`` per micro-batch of this rank for one step."""
    for indices in plan.micro_batch_indices(consumed_samples):
        batch = torch.stack([source.sample(i) for i in indices])
        yield batch[:, :-1].contiguous(), batch[:, 1:].contiguous()


def open_source(data_cfg, *, model_cfg, seed: int) -> Source:
    """The job's source, checked against the model before training starts."""
    if data_cfg.source == "synthetic":
        return SyntheticSource(seed=seed, vocab=model_cfg.vocab, seq_len=model_cfg.seq_len)
    source = TokenFile(data_cfg.path, seq_len=model_cfg.seq_len)
    if source.vocab > model_cfg.vocab:
        raise DataError(
            f"data.path: {data_cfg.path} has vocab {source.vocab}, more than model.vocab "
            f"({model_cfg.vocab})"
        )
    return source
