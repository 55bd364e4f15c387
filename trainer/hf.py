"""Hugging Face GPT-2 interchange: our global tensors <-> ``transformers``' GPT2LMHeadModel.

The trainer's model is GPT-2's architecture, so the mapping is names and layouts only:

- ``embedding.word_embeddings.weight`` -> ``transformer.wte.weight``; positions -> ``wpe``;
- ``decoder.layers.i.ln1`` / ``ln2`` -> ``transformer.h.i.ln_1`` / ``ln_2``; the final
  norm -> ``transformer.ln_f``;
- every linear layer is an ``nn.Linear`` here (weight ``(out, in)``) and a ``Conv1D``
  there (weight ``(in, out)``): a transpose. ``attn.qkv`` is ``(3, hidden, hidden)`` here
  (q, k, v, each head after head) and ``c_attn`` ``(hidden, 3 * hidden)`` there, the same
  order once flattened;
- the head is tied to ``wte`` (``tie_word_embeddings``), or ``lm_head.weight`` when not.

Activation ``gelu_new`` is GPT-2's tanh GeLU, LayerNorm eps 1e-5, and ``n_positions`` is
``model.seq_len``. Dense models only: GPT-2 has no mixture of experts. ``transformers``
itself is not needed to write or read these files (safetensors and JSON); the tests load
them with it.
"""

from __future__ import annotations

import json
import math
import os
import re
import stat
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch

from checkpoint.errors import CheckpointError
from checkpoint.load import check_memory
from checkpoint.manifest import parse_json, quoted
from checkpoint.stfile import pread_into, read_header_fd
from checkpoint.verify import export_dir, write_safetensors
from trainer.errors import TrainerConfigError
from trainer.errors import brief as _brief

MODEL_FIELDS = ("layers", "hidden", "heads", "ffn_hidden", "vocab", "seq_len", "experts",
                "tie_embeddings", "dropout")  # fmt: skip
"""The ``model`` settings a checkpoint records (``extra["model"]``) for export."""


class HFError(TrainerConfigError):
    """A model or directory that cannot be exchanged with Hugging Face GPT-2."""


def model_record(model_cfg) -> dict[str, Any]:
    """What a checkpoint records of the model (``extra["model"]``): MODEL_FIELDS, which
    an export needs, and ``top_k`` (the routing, which a resume must keep; absent from
    checkpoints of earlier trainers)."""
    return {**{k: getattr(model_cfg, k) for k in MODEL_FIELDS}, "top_k": model_cfg.top_k}


MAX_DIM = 1 << 24
"""Largest width, vocabulary, layer count or position count exchanged (GPT-2 XL: 50257)."""


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def check_model_record(cfg: Mapping[str, Any], where: str) -> None:
    """Refuse a recorded model (``extra["model"]``) whose settings are of the wrong type or
    range: sizes integers in ``[1, 2^24]`` (``hidden`` a multiple of ``heads``),
    ``experts`` an integer >= 0 or null, ``tie_embeddings`` a boolean, ``dropout`` a number
    in ``[0, 1)``. Raises HFError."""
    for key in ("layers", "hidden", "heads", "ffn_hidden", "vocab", "seq_len"):
        value = cfg[key]
        if not _is_int(value) or not 1 <= value <= MAX_DIM:
            raise HFError(f"{where}: {key} {_brief(value)} is not an integer in [1, 2^24]")
    if cfg["hidden"] % cfg["heads"]:
        raise HFError(f"{where}: hidden {cfg['hidden']} is not a multiple of heads {cfg['heads']}")
    experts = cfg["experts"]
    if experts is not None and (not _is_int(experts) or not 0 <= experts <= MAX_DIM):
        raise HFError(f"{where}: experts {_brief(experts)} is not an integer >= 0 or null")
    if not isinstance(cfg["tie_embeddings"], bool):
        raise HFError(f"{where}: tie_embeddings {_brief(cfg['tie_embeddings'])} is not a boolean")
    dropout = cfg["dropout"]
    if not isinstance(dropout, (int, float)) or isinstance(dropout, bool) or not 0 <= dropout < 1:
        raise HFError(f"{where}: dropout {_brief(dropout)} is not a number in [0, 1)")


def _dense(cfg: Mapping[str, Any], where: str) -> None:
    if cfg.get("experts"):
        raise HFError(
            f"{where}: a mixture-of-experts model ({cfg['experts']} experts) has no "
            "Hugging Face GPT-2 equivalent; only dense models are exchanged"
        )


def gpt2_config(cfg: Mapping[str, Any]) -> dict[str, Any]:
    """``config.json`` of the GPT-2 equivalent of our ``model`` settings."""
    return {
        "architectures": ["GPT2LMHeadModel"],
        "model_type": "gpt2",
        "vocab_size": cfg["vocab"],
        "n_positions": cfg["seq_len"],
        "n_embd": cfg["hidden"],
        "n_layer": cfg["layers"],
        "n_head": cfg["heads"],
        "n_inner": cfg["ffn_hidden"],
        "activation_function": "gelu_new",
        "layer_norm_epsilon": 1e-5,
        "resid_pdrop": cfg["dropout"],
        "embd_pdrop": cfg["dropout"],
        "attn_pdrop": cfg["dropout"],
        "tie_word_embeddings": bool(cfg["tie_embeddings"]),
        "dtype": "float32",
        # GPT-2's defaults (50256) lie outside a smaller vocabulary, and transformers warns
        # of them at every load; our data has no special tokens, so there are none.
        "bos_token_id": None,
        "eos_token_id": None,
    }


def _pairs(cfg: Mapping[str, Any]) -> Iterator[tuple[str, str, str]]:
    """(our name, HF name, how): ``how`` is ``same``, ``t`` (a Linear/Conv1D transpose) or
    ``qkv`` (flatten the three parts, then transpose)."""
    yield "embedding.word_embeddings.weight", "transformer.wte.weight", "same"
    yield "embedding.position_embeddings.weight", "transformer.wpe.weight", "same"
    for i in range(cfg["layers"]):
        ours, hf = f"decoder.layers.{i}", f"transformer.h.{i}"
        for a, b in (("ln1", "ln_1"), ("ln2", "ln_2")):
            yield f"{ours}.{a}.weight", f"{hf}.{b}.weight", "same"
            yield f"{ours}.{a}.bias", f"{hf}.{b}.bias", "same"
        yield f"{ours}.attn.qkv.weight", f"{hf}.attn.c_attn.weight", "qkv"
        yield f"{ours}.attn.qkv.bias", f"{hf}.attn.c_attn.bias", "flat"
        for a, b in (("attn.proj", "attn.c_proj"), ("mlp.fc1", "mlp.c_fc"),
                     ("mlp.fc2", "mlp.c_proj")):  # fmt: skip
            yield f"{ours}.{a}.weight", f"{hf}.{b}.weight", "t"
            yield f"{ours}.{a}.bias", f"{hf}.{b}.bias", "same"
    yield "decoder.final_norm.weight", "transformer.ln_f.weight", "same"
    yield "decoder.final_norm.bias", "transformer.ln_f.bias", "same"
    if not cfg["tie_embeddings"]:
        yield "output_layer.weight", "lm_head.weight", "same"


def _to_hf(t: torch.Tensor, how: str) -> torch.Tensor:
    if how == "t":
        return t.t().contiguous()
    if how == "qkv":
        return t.reshape(-1, t.shape[-1]).t().contiguous()
    if how == "flat":
        return t.reshape(-1).contiguous()
    return t.contiguous()


def _from_hf(t: torch.Tensor, how: str, shape: tuple[int, ...]) -> torch.Tensor:
    if how in ("t", "qkv"):
        t = t.t()
    return t.reshape(shape)


def export_hf(ckpt, out: str, *, log: Callable[[str], None] | None = None) -> list[str]:
    """Write ``config.json`` and ``model.safetensors`` of a checkpoint's model as Hugging
    Face GPT-2 (``ckpt``: a :class:`checkpoint.Checkpoint`). Returns the files written."""
    cfg = ckpt.manifest.extra.get("model")
    where = ckpt.path
    if not isinstance(cfg, dict) or not set(MODEL_FIELDS) <= set(cfg):
        raise HFError(
            f"{where}: the checkpoint does not record its model settings (saved by an older "
            "trainer); export it without --format hf"
        )
    check_model_record(cfg, f"{where}: extra.model")
    _dense(cfg, where)
    ckpt.check_files()  # refuse a bad file before writing anything
    # Every shape before any tensor is read; through the generator, so that a recorded
    # layer count far beyond the manifest's tensors stops at the first missing one.
    for ours, _hf, _how in _pairs(cfg):
        entry = ckpt.manifest.tensors.get(ours)
        if entry is None:
            raise HFError(f"{where}: has no tensor {ours}, which GPT-2 needs")
        want = _our_shape(ours, cfg)
        if tuple(entry.shape) != want or not entry.dtype.is_floating_point:
            raise HFError(
                f"{where}: tensor {ours} is {entry.dtype} {list(entry.shape)}, the model in "
                f"extra.model needs a floating-point {list(want)}"
            )
    # A model tensor the recorded model leaves out (fewer layers, or a head called tied)
    # would be dropped without a word: the GPT-2 written would not be the model trained.
    converted = {ours for ours, _hf, _how in _pairs(cfg)}
    left = sorted(
        n for n, e in ckpt.manifest.tensors.items() if e.kind == "model" and n not in converted
    )
    if left:
        more = f" and {len(left) - 3} more" if len(left) > 3 else ""
        raise HFError(
            f"{where}: extra.model ({cfg['layers']} layers, tie_embeddings "
            f"{cfg['tie_embeddings']}) leaves out model tensor{'s' if len(left) > 1 else ''} "
            f"{', '.join(quoted(n) for n in left[:3])}{more}, which an export would drop: it "
            "does not describe the model saved"
        )
    tensors = {}
    for ours, hf, how in _pairs(cfg):
        tensors[hf] = _to_hf(ckpt.read(ours), how)
    # A failed write (a full disk) is one line, and leaves no partial directory behind.
    with export_dir(out, ("model.safetensors", "config.json")) as written:
        tmp = written.path("model.safetensors")
        write_safetensors(tensors, tmp, metadata={"format": "pt"}, shown=written.final(tmp))
        with open(written.path("config.json"), "w", encoding="utf-8") as f:
            json.dump(gpt2_config(cfg), f, indent=2, sort_keys=True)
            f.write("\n")
    if log:
        log(f"wrote model.safetensors ({len(tensors)} tensors) and config.json")
    return ["config.json", "model.safetensors"]


def read_hf(
    path: str, model_cfg, *, warn: Callable[[str], None] | None = None
) -> dict[str, torch.Tensor]:
    """Our global tensors from a Hugging Face GPT-2 directory (``config.json`` plus
    ``model.safetensors``, or sharded files and ``model.safetensors.index.json``), after
    checking its config against the job's ``model`` settings. GPT-2 weights the model has
    no place for are refused; other tensors are left unread, said through ``warn``."""
    where = f"model.init_from: hf:{path}"
    cfg = model_record(model_cfg)
    _dense(cfg, "model.experts")
    hf_cfg = _read_json(path, "config.json", CONFIG_MAX_BYTES, where)
    if not isinstance(hf_cfg, dict) or hf_cfg.get("model_type") != "gpt2":
        raise HFError(f"{where}: config.json is not a GPT-2 config (model_type gpt2)")
    want = gpt2_config(cfg)
    for key in ("vocab_size", "n_embd", "n_layer", "n_head"):
        if not _is_int(hf_cfg.get(key)) or hf_cfg.get(key) != want[key]:
            raise HFError(f"{where}: config.json {key} is {_brief(hf_cfg.get(key))}, the job's "
                          f"model needs {want[key]}")  # fmt: skip
    inner = hf_cfg.get("n_inner")
    if inner is None:
        inner = 4 * hf_cfg["n_embd"]
    if not _is_int(inner) or inner != want["n_inner"]:
        raise HFError(f"{where}: config.json n_inner is {_brief(inner)}, model.ffn_hidden is "
                      f"{want['n_inner']}")  # fmt: skip
    act = hf_cfg.get("activation_function", "gelu_new")
    if act not in ("gelu_new", "gelu_pytorch_tanh"):
        raise HFError(f"{where}: activation {_brief(act)} is not GPT-2's tanh GeLU")
    positions = hf_cfg.get("n_positions")
    if not _is_int(positions) or not cfg["seq_len"] <= positions <= MAX_DIM:
        raise HFError(f"{where}: config.json n_positions {_brief(positions)} is not an integer "
                      f"from model.seq_len {cfg['seq_len']} to 2^24")  # fmt: skip
    # Settings that change the math of a GPT-2 (transformers' defaults are ours): a model
    # that computes otherwise is refused, not loaded into ours to train on as if the same.
    for key, ours in _SAME_MATH.items():
        value = hf_cfg.get(key, ours)
        if type(value) is not type(ours) or value != ours:
            raise HFError(f"{where}: config.json {key} is {_brief(value)}; this trainer's GPT "
                          f"computes with {ours}")  # fmt: skip
    tied = hf_cfg.get("tie_word_embeddings", True)
    if not isinstance(tied, bool) or tied != bool(cfg["tie_embeddings"]):
        raise HFError(f"{where}: tie_word_embeddings is {_brief(tied)}, model.tie_embeddings is "
                      f"{cfg['tie_embeddings']}")  # fmt: skip
    files = _WeightFiles(path, where)
    try:
        out = {}
        for ours, hf, how in _pairs(cfg):
            # Of the positions (up to 2^24, which a sparse file "backs" at no cost on
            # disk), only the model's seq_len are read.
            rows = cfg["seq_len"] if ours == "embedding.position_embeddings.weight" else None
            t = files.get(hf, _hf_shape(ours, how, cfg, positions), rows=rows)
            out[ours] = _from_hf(t, how, _our_shape(ours, cfg)).clone()
        unused = sorted(k for k in files.files if k not in files.used and not _not_weights(k, cfg))
        left = [k for k in unused if _GPT2_NAME.fullmatch(k.removeprefix("transformer."))]
        others = [k for k in unused if k not in left]
        if others and warn is not None:  # not GPT-2's (a quantizer's scales): as transformers
            warn(
                f"{where}: {len(others)} tensor{'s' if len(others) > 1 else ''} not of "
                f"GPT-2 left unread ({', '.join(quoted(k) for k in others[:3])}"
                f"{', ...' if len(others) > 3 else ''})"
            )
        if left:
            # GPT-2 weights its config does not describe (more layers than n_layer):
            # taking part of them would train on from another model than it holds.
            raise HFError(
                f"{where}: holds {len(left)} tensor{'s' if len(left) > 1 else ''} the job's "
                f"model has no place for ({', '.join(quoted(k) for k in left[:3])}"
                f"{', ...' if len(left) > 3 else ''}): its config.json does not describe its "
                "weights"
            )
        return out
    finally:
        files.close()


_GPT2_NAME = re.compile(r"(h\.\d+|wte|wpe|ln_f)\..+|lm_head\.weight")
"""A GPT-2 weight's name (without ``transformer.``)."""


def _not_weights(key: str, cfg: Mapping[str, Any]) -> bool:
    """Tensors a GPT-2 file may hold that are not weights of the model: older files'
    causal-mask buffers, and a tied output layer saved beside the embedding it repeats."""
    base = key.removeprefix("transformer.")
    if base.endswith((".attn.bias", ".attn.masked_bias")):
        return True
    return key == "lm_head.weight" and bool(cfg["tie_embeddings"])


_SAME_MATH = {
    "layer_norm_epsilon": 1e-5,  # trainer.model.LayerNorm's
    "scale_attn_weights": True,  # scores divided by sqrt(head size)
    "scale_attn_by_inverse_layer_idx": False,  # and not, in addition, by the layer's number
}
"""``config.json`` settings a GPT-2 must have as they are here, and their values."""

CONFIG_MAX_BYTES = 1 << 20
"""``config.json`` above this is refused unread."""
INDEX_MAX_BYTES = 64 << 20
"""``model.safetensors.index.json`` above this is refused unread."""


def _open_regular(path: str, name: str, where: str) -> int:
    """A descriptor of ``name`` in ``path``: a plain name (no ``/``, not ``.`` or ``..``),
    opened with ``O_NONBLOCK`` (a FIFO does not block) and a regular file (``fstat`` of the
    descriptor): a FIFO or a device is refused, also behind a symlink. Symlinks are
    followed: the user names this directory, and a Hugging Face hub cache's ``snapshots/``
    directory is made of symlinks into ``blobs/``. Raises HFError."""
    if (
        not isinstance(name, str)
        or not name
        or "/" in name
        or "\x00" in name
        or name in (".", "..")
    ):
        raise HFError(f"{where}: {_brief(name)} is not a plain file name inside the directory")
    flags = os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0)
    try:
        fd = os.open(os.path.join(path, name), flags)
    except OSError as exc:
        raise HFError(f"{where}: cannot open {name} ({exc.strerror})") from None
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise HFError(f"{where}: {name} is not a regular file")
    except BaseException:
        os.close(fd)
        raise
    return fd


def _read_json(path: str, name: str, cap: int, where: str) -> Any:
    """``name`` in ``path`` as JSON, read through :func:`_open_regular`, at most ``cap``
    bytes (a larger file is refused unread)."""
    fd = _open_regular(path, name, where)
    try:
        size = os.fstat(fd).st_size
        if size > cap:
            raise HFError(f"{where}: {name} is {size} bytes, above the {cap} allowed")
        chunks, got = [], 0
        while got <= cap:
            chunk = os.read(fd, min(1 << 20, cap + 1 - got))
            if not chunk:
                break
            chunks.append(chunk)
            got += len(chunk)
        if got > cap:
            raise HFError(f"{where}: {name} grew above the {cap} bytes allowed")
    except OSError as exc:
        raise HFError(f"{where}: cannot read {name} ({exc.strerror})") from None
    finally:
        os.close(fd)
    # Bounded as a manifest is (lists and objects per byte, depth): an index of nothing
    # but [] would cost 30 times its size in memory.
    # No lone surrogate (a file name with one cannot be opened: a UnicodeEncodeError).
    return parse_json(b"".join(chunks), f"{where}: {name}", max_bytes=cap, error=HFError,
                      utf8_strings=True)  # fmt: skip


def _hf_shape(ours: str, how: str, cfg: Mapping[str, Any], positions: int) -> tuple[int, ...]:
    """The shape GPT-2's file must give the tensor read into ``ours``."""
    shape = _our_shape(ours, cfg)
    if ours == "embedding.position_embeddings.weight":
        return (positions, shape[1])
    if how == "qkv":
        return (shape[2], shape[0] * shape[1])
    if how == "flat":
        return (shape[0] * shape[1],)
    if how == "t":
        return (shape[1], shape[0])
    return shape


def _our_shape(name: str, cfg: Mapping[str, Any]) -> tuple[int, ...]:
    h, f = cfg["hidden"], cfg["ffn_hidden"]
    if name.endswith("qkv.weight"):
        return (3, h, h)
    if name.endswith("qkv.bias"):
        return (3, h)
    if name.endswith("fc1.weight"):
        return (f, h)
    if name.endswith("fc1.bias"):
        return (f,)
    if name.endswith("fc2.weight") or name.endswith("proj.weight"):
        return (h, f) if "fc2" in name else (h, h)
    if name in ("embedding.word_embeddings.weight", "output_layer.weight"):
        return (cfg["vocab"], h)
    if name == "embedding.position_embeddings.weight":
        return (cfg["seq_len"], h)
    return (h,)


_TORCH_DTYPES = {"F16": torch.float16, "BF16": torch.bfloat16, "F32": torch.float32,
                 "F64": torch.float64}  # fmt: skip


class _WeightFiles:
    """A directory's safetensors weights, each file opened once (:func:`_open_regular`)
    and read only through that descriptor: its header checked against the file's size
    (:func:`checkpoint.stfile.read_header_fd`: offsets in range, bytes matching dtype and
    shape), then each tensor asked for read with ``pread``. A file is never opened again
    by name after its checks (a file swapped in meanwhile is not what is read), nor
    memory-mapped (one truncated while read is an error, not a SIGBUS)."""

    def __init__(self, path: str, where: str) -> None:
        self.path, self.where = path, where
        self._open: dict[str, tuple[int, int, dict]] = {}  # name -> (fd, data start, header)
        self._inodes: dict[tuple[int, int], str] = {}  # (device, inode) -> the name opened
        self.files: dict[str, str] = {}  # tensor -> file name
        self.used: set[str] = set()  # the tensors read (:meth:`get`)
        try:
            self._list()
        except BaseException:
            self.close()
            raise

    def _list(self) -> None:
        # transformers' order: model.safetensors where there is one, else the index (a
        # directory with both, an export over a sharded model, loads the single file).
        single = "model.safetensors"
        if os.path.lexists(os.path.join(self.path, single)):
            header = self._file(single, self.where)[2]
            self.files = dict.fromkeys((k for k in header if k != "__metadata__"), single)
            return
        index = "model.safetensors.index.json"
        if os.path.lexists(os.path.join(self.path, index)):
            raw = _read_json(self.path, index, INDEX_MAX_BYTES, self.where)
            weight_map = raw.get("weight_map") if isinstance(raw, dict) else None
            if not isinstance(weight_map, dict):
                raise HFError(f"{self.where}: {index} has no weight_map object")
            for key, name in weight_map.items():
                if not isinstance(name, str):
                    raise HFError(f"{self.where}: {index} maps {_brief(key)} to "
                                  f"{_brief(name)}, not a file name")  # fmt: skip
            for name in sorted(set(weight_map.values())):
                self._file(name, f"{self.where}: {index}")
            self.files = dict(weight_map)
            return
        raise HFError(f"{self.where}: has no model.safetensors (only safetensors weights are read)")

    def _file(self, name: str, where: str) -> tuple[int, int, dict]:
        got = self._open.get(name)
        if got is None:
            fd = _open_regular(self.path, name, where)
            st = os.fstat(fd)
            same = self._inodes.setdefault((st.st_dev, st.st_ino), name)
            if same != name:  # names linked to one file (a cache's blobs): parsed once
                os.close(fd)
                got = self._open[name] = self._open[same]
                return got
            try:
                size = st.st_size
                raw, header = read_header_fd(fd, size, name, unknown_dtypes=True)
            except BaseException as exc:
                os.close(fd)
                if isinstance(exc, (CheckpointError, ValueError, OSError)):
                    raise HFError(f"{where}: {_one_line(exc)}") from None
                raise
            got = self._open[name] = (fd, len(raw), header)
        return got

    def get(self, hf: str, shape: tuple[int, ...], *, rows: int | None = None) -> torch.Tensor:
        """Tensor ``hf`` as float32 (checked to be a floating-point ``shape`` before it is
        read); with ``rows``, only its first ``rows`` rows are read.

        The memory it takes is checked before it is allocated, as a checkpoint load does
        (:func:`checkpoint.load.check_memory`): a file's size says nothing of what it
        holds (a sparse file declares gigabytes over a hole), and the shapes asked for
        may be larger than the machine."""
        # Hub GPT-2 files name the base model's tensors without the ``transformer.`` prefix.
        for key in (hf, hf.removeprefix("transformer.")):
            if key not in self.files:
                continue
            name = self.files[key]
            self.used.add(key)
            fd, start, header = self._file(name, self.where)
            info = header.get(key)
            if info is None:
                raise HFError(f"{self.where}: {name} has no tensor {key}")
            got, dtype = tuple(info["shape"]), _TORCH_DTYPES.get(info["dtype"])
            if got != shape or dtype is None:
                raise HFError(
                    f"{self.where}: {name}: {key} is {info['dtype']} {list(got)}, the job's "
                    f"model needs a floating-point {list(shape)}"
                )
            if rows is not None and shape:
                shape = (min(rows, shape[0]), *shape[1:])  # the rows lead: a prefix
            numel, item = math.prod(shape), dtype.itemsize
            # The bytes read, then their float32 copy, or the clone read_hf makes of it.
            what = f"{self.where}: {name}: {key}"
            try:
                check_memory(numel * max(item + 4, 8), what)
                t = torch.empty(shape, dtype=dtype)
            except CheckpointError as exc:
                raise HFError(_one_line(exc)) from None
            except RuntimeError as exc:  # torch's "can't allocate memory", one line
                raise HFError(f"{what}: {numel * item / 1e9:.1f} GB could not be allocated "
                              f"({_one_line(exc)})") from None  # fmt: skip
            if t.numel():
                view = memoryview(t.view(-1).view(torch.uint8).numpy())
                try:
                    pread_into(fd, view, start + info["data_offsets"][0], name)
                except CheckpointError as exc:
                    raise HFError(f"{self.where}: {_one_line(exc)}") from None
            try:
                return t.float()
            except RuntimeError as exc:
                raise HFError(f"{what}: its float32 copy could not be allocated "
                              f"({_one_line(exc)})") from None  # fmt: skip
        raise HFError(f"{self.where}: has no tensor {hf}")

    def close(self) -> None:
        for fd in {fd for fd, _, _ in self._open.values()}:  # names may share one
            os.close(fd)
        self._open.clear()
        self._inodes.clear()


def _one_line(exc: BaseException) -> str:
    text = str(exc).splitlines()
    return text[0] if text else type(exc).__name__


def init_from_hf(trainer, path: str, *, warn: Callable[[str], None] | None = None) -> None:
    """Set every parameter this rank holds to its region of the Hugging Face weights (any
    layout: each rank slices its own shard by its ``ShardInfo``; padding rows stay)."""
    full = read_hf(path, trainer.job.model, warn=warn)
    with torch.no_grad():
        for name, p in trainer.named_parameters():
            info = p.shard_info
            src = full[info.name]
            region = tuple(slice(o, o + s) for o, s in zip(info.offsets, info.sizes, strict=True))
            dst = p[tuple(slice(0, s) for s in info.sizes)]
            dst.copy_(src[region].to(dtype=p.dtype, device=p.device))
            del name
