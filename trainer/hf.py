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
import os
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from trainer.errors import TrainerConfigError

MODEL_FIELDS = ("layers", "hidden", "heads", "ffn_hidden", "vocab", "seq_len", "experts",
                "tie_embeddings", "dropout")  # fmt: skip
"""The ``model`` settings a checkpoint records (``extra["model"]``) for export."""


class HFError(TrainerConfigError):
    """A model or directory that cannot be exchanged with Hugging Face GPT-2."""


def model_record(model_cfg) -> dict[str, Any]:
    """What a checkpoint records of the model (``extra["model"]``)."""
    return {k: getattr(model_cfg, k) for k in MODEL_FIELDS}


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
    _dense(cfg, where)
    ckpt.check_files()  # refuse a bad file before writing anything
    tensors = {}
    for ours, hf, how in _pairs(cfg):
        if ours not in ckpt.manifest.tensors:
            raise HFError(f"{where}: has no tensor {ours}, which GPT-2 needs")
        tensors[hf] = _to_hf(ckpt.read(ours), how)
    os.makedirs(out, exist_ok=True)
    save_file(tensors, os.path.join(out, "model.safetensors"), metadata={"format": "pt"})
    with open(os.path.join(out, "config.json"), "w", encoding="utf-8") as f:
        json.dump(gpt2_config(cfg), f, indent=2, sort_keys=True)
        f.write("\n")
    if log:
        log(f"wrote model.safetensors ({len(tensors)} tensors) and config.json")
    return ["config.json", "model.safetensors"]


def read_hf(path: str, model_cfg) -> dict[str, torch.Tensor]:
    """Our global tensors from a Hugging Face GPT-2 directory (``config.json`` plus
    ``model.safetensors``, or sharded files and ``model.safetensors.index.json``), after
    checking its config against the job's ``model`` settings."""
    where = f"model.init_from: hf:{path}"
    cfg = model_record(model_cfg)
    _dense(cfg, "model.experts")
    try:
        with open(os.path.join(path, "config.json"), encoding="utf-8") as f:
            hf_cfg = json.load(f)
    except (OSError, ValueError) as exc:
        raise HFError(f"{where}: cannot read config.json ({exc})") from exc
    if not isinstance(hf_cfg, dict) or hf_cfg.get("model_type") != "gpt2":
        raise HFError(f"{where}: config.json is not a GPT-2 config (model_type gpt2)")
    want = gpt2_config(cfg)
    for key in ("vocab_size", "n_embd", "n_layer", "n_head"):
        if hf_cfg.get(key) != want[key]:
            raise HFError(f"{where}: config.json {key} is {hf_cfg.get(key)}, the job's model "
                          f"needs {want[key]}")  # fmt: skip
    inner = hf_cfg.get("n_inner") or 4 * hf_cfg["n_embd"]
    if inner != want["n_inner"]:
        raise HFError(f"{where}: config.json n_inner is {inner}, model.ffn_hidden is "
                      f"{want['n_inner']}")  # fmt: skip
    if hf_cfg.get("activation_function", "gelu_new") not in ("gelu_new", "gelu_pytorch_tanh"):
        raise HFError(f"{where}: activation {hf_cfg.get('activation_function')} is not "
                      "GPT-2's tanh GeLU")  # fmt: skip
    if hf_cfg.get("n_positions", 0) < cfg["seq_len"]:
        raise HFError(f"{where}: config.json n_positions {hf_cfg.get('n_positions')} is "
                      f"below model.seq_len {cfg['seq_len']}")  # fmt: skip
    tied = hf_cfg.get("tie_word_embeddings", True)
    if bool(tied) != bool(cfg["tie_embeddings"]):
        raise HFError(f"{where}: tie_word_embeddings is {tied}, model.tie_embeddings is "
                      f"{cfg['tie_embeddings']}")  # fmt: skip
    files = _weight_files(path, where)
    out = {}
    for ours, hf, how in _pairs(cfg):
        t = _get(files, hf, where)
        if ours == "embedding.position_embeddings.weight":
            t = t[: cfg["seq_len"]]
        out[ours] = _from_hf(t, how, _our_shape(ours, cfg)).clone()
    return out


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


def _weight_files(path: str, where: str) -> dict[str, str]:
    """HF tensor name -> file holding it."""
    index = os.path.join(path, "model.safetensors.index.json")
    if os.path.isfile(index):
        try:
            with open(index, encoding="utf-8") as f:
                weight_map = json.load(f)["weight_map"]
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise HFError(f"{where}: cannot read model.safetensors.index.json ({exc})") from exc
        return {k: os.path.join(path, os.path.basename(v)) for k, v in weight_map.items()}
    single = os.path.join(path, "model.safetensors")
    if not os.path.isfile(single):
        raise HFError(f"{where}: has no model.safetensors (only safetensors weights are read)")
    try:
        with safe_open(single, framework="pt") as f:
            return dict.fromkeys(f.keys(), single)
    except (SafetensorError, OSError) as exc:
        raise HFError(f"{where}: model.safetensors: {exc}") from exc


def _get(files: dict[str, str], hf: str, where: str) -> torch.Tensor:
    # Hub GPT-2 files name the base model's tensors without the ``transformer.`` prefix.
    for key in (hf, hf.removeprefix("transformer.")):
        if key in files:
            try:
                with safe_open(files[key], framework="pt") as f:
                    return f.get_tensor(key).float()
            except (SafetensorError, OSError) as exc:
                raise HFError(f"{where}: {files[key]}: {exc}") from exc
    raise HFError(f"{where}: has no tensor {hf}")


def init_from_hf(trainer, path: str) -> None:
    """Set every parameter this rank holds to its region of the Hugging Face weights (any
    layout: each rank slices its own shard by its ``ShardInfo``; padding rows stay)."""
    full = read_hf(path, trainer.job.model)
    with torch.no_grad():
        for name, p in trainer.named_parameters():
            info = p.shard_info
            src = full[info.name]
            region = tuple(slice(o, o + s) for o, s in zip(info.offsets, info.sizes, strict=True))
            dst = p[tuple(slice(0, s) for s in info.sizes)]
            dst.copy_(src[region].to(dtype=p.dtype, device=p.device))
            del name
