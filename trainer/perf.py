"""What a step costs the machine: the TF32 switch, model FLOPs and MFU, and peak memory.

**Model FLOPs** per token follow the PaLM / Megatron convention (what "MFU" means in the
papers, so figures compare): ``6·N + 12·L·h·s``, where N counts the weights that multiply
each token (per layer 4h² for attention and 2·h·ffn for the MLP, or for MoE the router's
E·h plus top_k experts' 2·h·ffn; the head's vocab·h; not the embedding lookups, biases or
LayerNorms) and ``12·L·h·s`` is attention's scores and weighted sum, forward and backward,
over the full (not causally halved) s×s matrix. Recomputation is not counted: this is
*model* FLOPs utilisation, not hardware FLOPs.

**MFU** = model FLOPs of the step / step time / (active ranks × the device's dense peak for
the step's math: bf16, TF32 when fp32 runs with ``train.tf32``, else fp32). Peaks are known
for A100, H100 (SXM, PCIe, NVL), H200 and GH200; elsewhere (CPU, other GPUs) it is None.

**Peak memory** per rank: ``torch.cuda.max_memory_allocated`` on CUDA (the caching
allocator's peak of live tensors since the process started), the process's peak resident
set (``ru_maxrss``) on CPU; in GiB.
"""

from __future__ import annotations

import resource
import sys

import torch

# Dense (no sparsity) peak FLOP/s by device, from NVIDIA's data sheets: (bf16, tf32, fp32).
# Matched against torch.cuda.get_device_name in order: the specific names first.
PEAK_FLOPS: tuple[tuple[str, tuple[float, float, float]], ...] = (
    ("H100 PCIe", (756e12, 378e12, 51.2e12)),
    ("H100 NVL", (835e12, 417.5e12, 60e12)),
    ("GH200", (989e12, 494.5e12, 67e12)),
    ("H200", (989e12, 494.5e12, 67e12)),
    ("H100", (989e12, 494.5e12, 67e12)),  # SXM5 (HBM3)
    ("A100", (312e12, 156e12, 19.5e12)),
)


def matmul_precision(*, device: torch.device, dtype: torch.dtype, tf32: bool) -> str | None:
    """The fp32 matmul precision a run wants (``"tf32"`` or ``"ieee"``), or None where it
    does not apply (not CUDA, or not float32)."""
    if device.type != "cuda" or dtype != torch.float32:
        return None
    return "tf32" if tf32 else "ieee"


def apply_tf32(*, device: torch.device, dtype: torch.dtype, tf32: bool) -> str | None:
    """Switch TF32 on or off for CUDA matmuls and cuDNN (process-wide); returns what was
    set (see :func:`matmul_precision`)."""
    precision = matmul_precision(device=device, dtype=dtype, tf32=tf32)
    if precision is not None:
        # The allow_tf32 flags keep the legacy and the per-backend views consistent; setting
        # torch.backends.cudnn.fp32_precision alone makes a later read of allow_tf32 raise.
        torch.backends.cuda.matmul.allow_tf32 = tf32
        torch.backends.cudnn.allow_tf32 = tf32
    return precision


def flops_per_token(cfg) -> float:
    """Model FLOPs (forward and backward) per token of ``cfg`` (the job's ``model``)."""
    h, f, layers = cfg.hidden, cfg.ffn_hidden, cfg.layers
    mlp = cfg.experts * h + cfg.top_k * 2 * h * f if cfg.experts else 2 * h * f
    weights = layers * (4 * h * h + mlp) + cfg.vocab * h
    return 6.0 * weights + 12.0 * layers * h * cfg.seq_len


def peak_flops(device: torch.device, *, dtype: torch.dtype, tf32: bool) -> float | None:
    """The device's dense peak FLOP/s for this math, or None when not known."""
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    return peak_flops_for(name, dtype=dtype, tf32=tf32)


def peak_flops_for(name: str, *, dtype: torch.dtype, tf32: bool) -> float | None:
    """:func:`peak_flops` for a device called ``name``."""
    for key, (bf16, tf32_peak, fp32) in PEAK_FLOPS:
        if key in name:
            if dtype == torch.bfloat16:
                return bf16
            return tf32_peak if tf32 else fp32
    return None


def mfu(*, flops: float, seconds: float, ranks: int, peak: float | None) -> float | None:
    """Model FLOPs utilisation of ``flops`` done in ``seconds`` by ``ranks`` devices."""
    if peak is None or seconds <= 0 or ranks <= 0:
        return None
    return flops / seconds / (ranks * peak)


def peak_memory_gib(device: torch.device) -> float:
    """This process's peak memory so far, in GiB (see the module's docstring)."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    # Linux reports KiB, macOS bytes.
    return rss / 2**30 if sys.platform == "darwin" else rss / 2**20
