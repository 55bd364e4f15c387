"""A GPT with GPT-2's exact architecture, built as pipeline-ready chunks.

GPT-2: token embedding plus learned positions; pre-LayerNorm blocks (causal self-attention,
then an MLP with tanh-approximated GeLU), each with a residual; a final LayerNorm; and an
output head tied to the token embedding. LayerNorms have a bias and eps 1e-5; every linear
layer has a bias. With ``model.experts > 0`` each block's MLP is a mixture of experts.

The model is a list of **chunks** (:func:`build_chunks`). A chunk holds a contiguous run of
global layer indexes, plus the embedding if it starts the model and the final LayerNorm and
the head if it ends it; with one pipeline stage the whole model is one chunk. Module paths
are the global parameter names (``decoder.layers.7.mlp.fc1.weight``), so a layer's name
does not depend on which stage holds it.

Global tensor shapes (what checkpoints record; HF GPT-2 export is a transpose/reshape away):

- ``embedding.word_embeddings.weight`` (vocab, hidden), padded locally to a multiple of tp
- ``embedding.position_embeddings.weight`` (seq_len, hidden)
- ``decoder.layers.i.attn.qkv.weight`` (3, hidden, hidden), bias (3, hidden): q, k, v
- ``decoder.layers.i.attn.proj.weight`` (hidden, hidden); ``mlp.fc1`` (ffn, hidden);
  ``mlp.fc2`` (hidden, ffn); ``ln1``, ``ln2``, ``decoder.final_norm``: weight and bias
- MoE: ``mlp.router.weight`` (experts, hidden); ``mlp.experts.e.fc1`` / ``fc2`` as above
- ``output_layer.weight`` (vocab, hidden) only when the head is not tied
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from checkpoint.shards import ShardInfo
from trainer.init import ones_param, sharded_param
from trainer.parallel.context import ParallelContext
from trainer.parallel.expert import MoE
from trainer.parallel.tensor import (
    ColumnParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
    copy_to,
    gather_seq,
    gather_seq_linear,
    seq_part,
    vocab_parallel_cross_entropy,
    vocab_param,
)

LN_EPS = 1e-5

RECOMPUTE = ("none", "selective", "full")


class Dropout(nn.Module):
    """Dropout on an activation outside the tensor-parallel regions.

    Replicated over tp (no sequence parallelism), every TP rank drops the same elements from
    the shared stream. With sequence parallelism each rank holds another part of the
    sequence, so it draws its own mask from a fork of the stream per TP rank (as attention
    does for its head shards), as Megatron forks its RNG tracker around dropout under
    sequence parallelism.
    """

    def __init__(self, p: float, *, ctx: ParallelContext) -> None:
        super().__init__()
        self.p = p
        self.rng = ctx.rng if ctx.sp else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.training or self.p == 0:
            return x
        if self.rng is None:
            return F.dropout(x, self.p, training=True)
        with self.rng.sharded(x.device):
            return F.dropout(x, self.p, training=True)


class LayerNorm(nn.Module):
    """GPT-2's LayerNorm (with bias, eps 1e-5), replicated on every tp rank."""

    def __init__(self, name: str, hidden: int, *, dtype: torch.dtype) -> None:
        super().__init__()
        self.weight = ones_param(f"{name}.weight", (hidden,), dtype=dtype)
        self.bias = sharded_param(f"{name}.bias", (hidden,), seed=0, std=None, dtype=dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.layer_norm(x, x.shape[-1:], self.weight, self.bias, LN_EPS)


class Attention(nn.Module):
    """Causal self-attention; this rank computes heads/tp of the heads.

    ``recompute``: the attention core (scores, softmax, dropout, the weighted sum) keeps
    nothing for backward but q, k and v, and runs again in backward (Megatron's selective
    recomputation); the RNG state is replayed, so dropout draws the same mask.
    """

    def __init__(
        self,
        name: str,
        cfg,
        *,
        ctx: ParallelContext,
        seed: int,
        out_std: float,
        dtype: torch.dtype,
        recompute: bool = False,
    ) -> None:
        super().__init__()
        h, tp = cfg.hidden, ctx.tp
        self.local_heads = cfg.heads // tp.size
        self.head_dim = h // cfg.heads
        self.dropout = cfg.dropout
        # With tp > 1 each rank holds other heads: its attention dropout must draw its own
        # mask (a fork of the shared stream per TP rank), not the other ranks' mask.
        self.rng = ctx.rng if tp.active else None
        self.recompute = recompute
        self.qkv = ColumnParallelLinear(
            f"{name}.qkv", h, h, slot=tp, seed=seed, std=0.02, parts=3, sp=ctx.sp, dtype=dtype
        )
        self.proj = RowParallelLinear(
            f"{name}.proj", h, h, slot=tp, seed=seed, std=out_std, sp=ctx.sp, dtype=dtype
        )

    def core(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        p = self.dropout if self.training else 0.0
        if p > 0 and self.rng is not None:
            with self.rng.sharded(q.device):
                return F.scaled_dot_product_attention(q, k, v, is_causal=True, dropout_p=p)
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, dropout_p=p)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        qkv = self.qkv(x)  # the whole sequence, also under sequence parallelism
        b, s = qkv.shape[:2]
        qkv = qkv.view(b, s, 3, self.local_heads, self.head_dim)
        q, k, v = (t.transpose(1, 2) for t in qkv.unbind(2))
        if self.recompute and torch.is_grad_enabled():
            y = checkpoint(self.core, q, k, v, use_reentrant=False)
        else:
            y = self.core(q, k, v)
        return self.proj(y.transpose(1, 2).reshape(b, s, self.local_heads * self.head_dim))


class MLP(nn.Module):
    """fc1 (column-parallel), tanh GeLU, fc2 (row-parallel)."""

    def __init__(
        self, name: str, cfg, *, ctx: ParallelContext, seed: int, out_std: float, dtype: torch.dtype
    ) -> None:
        super().__init__()
        common = dict(slot=ctx.tp, seed=seed, sp=ctx.sp, dtype=dtype)
        self.fc1 = ColumnParallelLinear(
            f"{name}.fc1", cfg.hidden, cfg.ffn_hidden, std=0.02, **common
        )
        self.fc2 = RowParallelLinear(
            f"{name}.fc2", cfg.ffn_hidden, cfg.hidden, std=out_std, **common
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.gelu(self.fc1(x), approximate="tanh"))


class Block(nn.Module):
    """One pre-LayerNorm transformer block. Under sequence parallelism its input and
    output are this rank's part of the sequence; LayerNorms, dropout and residuals run on
    it, and the attention and the MLP gather the whole sequence inside."""

    def __init__(
        self,
        name: str,
        cfg,
        *,
        ctx: ParallelContext,
        seed: int,
        dtype: torch.dtype,
        recompute: str = "none",
    ) -> None:
        super().__init__()
        # GPT-2 scales the init of the projections into the residual by 1/sqrt(2·layers).
        out_std = 0.02 / math.sqrt(2 * cfg.layers)
        self.dropout = Dropout(cfg.dropout, ctx=ctx)
        self.ln1 = LayerNorm(f"{name}.ln1", cfg.hidden, dtype=dtype)
        self.attn = Attention(f"{name}.attn", cfg, ctx=ctx, seed=seed, out_std=out_std,
                              dtype=dtype, recompute=recompute == "selective")  # fmt: skip
        self.ln2 = LayerNorm(f"{name}.ln2", cfg.hidden, dtype=dtype)
        if cfg.experts:
            self.mlp = MoE(
                f"{name}.mlp",
                hidden=cfg.hidden,
                ffn=cfg.ffn_hidden,
                experts=cfg.experts,
                top_k=cfg.top_k,
                ctx=ctx,
                seed=seed,
                out_std=out_std,
                dtype=dtype,
            )
        else:
            self.mlp = MLP(f"{name}.mlp", cfg, ctx=ctx, seed=seed, out_std=out_std, dtype=dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.dropout(self.attn(self.ln1(x)))
        return x + self.dropout(self.mlp(self.ln2(x)))


class Embedding(nn.Module):
    """Token embedding (vocabulary-parallel) plus learned positions."""

    def __init__(self, cfg, *, ctx: ParallelContext, seed: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.word_embeddings = VocabParallelEmbedding(
            "embedding.word_embeddings.weight",
            cfg.vocab,
            cfg.hidden,
            slot=ctx.tp,
            seed=seed,
            dtype=dtype,
            sp=ctx.sp,
        )
        self.sp_slot = ctx.tp if ctx.sp else None
        self.position_embeddings = nn.Module()
        # GPT-2 initialises its position table with std 0.01.
        self.position_embeddings.weight = sharded_param(
            "embedding.position_embeddings.weight",
            (cfg.seq_len, cfg.hidden),
            seed=seed,
            std=0.01,
            dtype=dtype,
        )
        self.dropout = Dropout(cfg.dropout, ctx=ctx)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        """Token ids ``(b, s)`` -> hidden states ``(b, s, h)``, or this rank's part of the
        sequence ``(b, s/tp, h)`` under sequence parallelism."""
        pos = self.position_embeddings.weight[: ids.shape[1]]
        if self.sp_slot is not None:
            pos = pos[seq_part(ids.shape[1], self.sp_slot)]
        return self.dropout(self.word_embeddings(ids) + pos)


class OutputLayer(nn.Module):
    """The head: logits from this rank's vocabulary rows, and the vocab-parallel loss.

    ``weight`` is the token embedding's when tied in the same chunk. A last pipeline stage
    without the embedding holds its own copy under the embedding's global name (same init,
    so same values; the pipeline keeps the two in step through the embedding group).
    """

    def __init__(
        self, cfg, *, ctx: ParallelContext, seed: int, dtype: torch.dtype, tied: nn.Parameter | None
    ) -> None:
        super().__init__()
        self.slot, self.vocab, self.sp = ctx.tp, cfg.vocab, ctx.sp
        self.tied = tied is not None
        if tied is None:
            name = (
                "embedding.word_embeddings.weight" if cfg.tie_embeddings else "output_layer.weight"
            )
            self.weight = vocab_param(
                name, cfg.vocab, cfg.hidden, slot=ctx.tp, seed=seed, dtype=dtype
            )
            self.weight.embedding_copy = cfg.tie_embeddings
        else:
            self._tied = [tied]  # a plain list keeps it out of this module's parameters

    @property
    def head_weight(self) -> nn.Parameter:
        return self._tied[0] if self.tied else self.weight

    def _enter(self, x: torch.Tensor) -> torch.Tensor:
        # The head is column-parallel over the vocabulary: the whole sequence goes in.
        return gather_seq(x, self.slot) if self.sp else copy_to(x, self.slot)

    def forward(self, x: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        w = self.head_weight
        if self.sp:
            logits = gather_seq_linear(x, w, None, self.slot)
        else:
            logits = F.linear(copy_to(x, self.slot), w)
        start = self.slot.rank * w.shape[0]
        # The logits are this call's own: the loss may overwrite them rather than copy.
        return vocab_parallel_cross_entropy(
            logits, targets, start=start, vocab=self.vocab, slot=self.slot, inplace=True
        )

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        """This rank's logits columns (padding included) for inference and export checks."""
        return F.linear(self._enter(x), self.head_weight)


class Decoder(nn.Module):
    """The blocks of one chunk, keyed by global layer index, and the final LayerNorm if the
    chunk ends the model."""

    def __init__(
        self,
        cfg,
        layers: Sequence[int],
        *,
        last: bool,
        ctx: ParallelContext,
        seed: int,
        dtype: torch.dtype,
        recompute: str = "none",
    ) -> None:
        super().__init__()
        self.layers = nn.ModuleDict(
            {
                str(i): Block(
                    f"decoder.layers.{i}", cfg, ctx=ctx, seed=seed, dtype=dtype, recompute=recompute
                )
                for i in layers
            }
        )
        self.final_norm = LayerNorm("decoder.final_norm", cfg.hidden, dtype=dtype) if last else None


class ModelChunk(nn.Module):
    """A contiguous run of global layers, with the embedding and/or head at the ends.

    ``forward(inputs, targets)``: ``inputs`` are token ids (first chunk) or the hidden
    states from the previous chunk; the result is the hidden states, or, for the last
    chunk, the per-token loss ``(batch, seq)``. Under sequence parallelism the hidden
    states between chunks are this rank's part of the sequence. MoE load-balancing losses are
    back-propagated through the MoE outputs themselves (see :mod:`trainer.parallel.expert`);
    :meth:`set_aux_scale` switches them on and :meth:`aux_losses` reads the last values.
    """

    def __init__(
        self,
        cfg,
        layers: Sequence[int],
        *,
        first: bool,
        last: bool,
        ctx: ParallelContext,
        seed: int,
        dtype: torch.dtype = torch.float32,
        recompute: str = "none",
    ) -> None:
        super().__init__()
        if recompute not in RECOMPUTE:
            raise ValueError(f"recompute {recompute!r} is not one of {', '.join(RECOMPUTE)}")
        self.layer_ids, self.first, self.last = tuple(layers), first, last
        # Full recomputation keeps only each block's input for backward and runs the
        # block again there (torch.utils.checkpoint, non-reentrant: it replays the CPU and
        # device RNG states, so dropout draws the same masks).
        self.recompute_blocks = recompute == "full"
        self.embedding = Embedding(cfg, ctx=ctx, seed=seed, dtype=dtype) if first else None
        self.decoder = Decoder(cfg, layers, last=last, ctx=ctx, seed=seed, dtype=dtype,
                               recompute=recompute)  # fmt: skip
        self.output_layer = None
        if last:
            tied = self.embedding.word_embeddings.weight if (first and cfg.tie_embeddings) else None
            self.output_layer = OutputLayer(cfg, ctx=ctx, seed=seed, dtype=dtype, tied=tied)
        _check_names(self)

    def moe_layers(self) -> list[MoE]:
        return [b.mlp for b in self.decoder.layers.values() if isinstance(b.mlp, MoE)]

    def set_aux_scale(self, scale: float) -> None:
        """Weight of the aux loss in the loss being back-propagated (0 turns it off)."""
        for moe in self.moe_layers():
            moe.aux_scale = scale

    def aux_losses(self) -> list[torch.Tensor]:
        """The aux losses of the last forward (detached; empty when switched off)."""
        return [m.last_aux for m in self.moe_layers() if m.aux_scale > 0 and m.last_aux is not None]

    def forward(self, inputs: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor:
        x = self.embedding(inputs) if self.first else inputs
        recompute = self.recompute_blocks and torch.is_grad_enabled()
        for block in self.decoder.layers.values():
            x = checkpoint(block, x, use_reentrant=False) if recompute else block(x)
        if not self.last:
            return x
        x = self.decoder.final_norm(x)
        if targets is None:
            return self.output_layer.logits(x)
        return self.output_layer(x, targets)


def build_chunks(
    cfg,
    layer_ranges: Sequence[Sequence[int]],
    *,
    ctx: ParallelContext,
    seed: int,
    aux_loss: bool = False,
    dtype: torch.dtype = torch.float32,
    recompute: str = "none",
) -> list[ModelChunk]:
    """The chunks this rank holds, one per range of global layer indexes.

    With pipeline parallelism a rank holds one range per virtual stage; the chunk holding
    layer 0 gets the embedding and the one holding the last layer the head. ``cfg`` is the
    job's ``model`` section; ``recompute`` is ``train.recompute`` (none, selective, full).
    """
    chunks = []
    for layers in layer_ranges:
        layers = list(layers)
        if not layers or layers != list(range(layers[0], layers[0] + len(layers))):
            raise ValueError(f"chunk layers {layers} are not a non-empty contiguous run")
        first, last = layers[0] == 0, layers[-1] == cfg.layers - 1
        chunks.append(
            ModelChunk(
                cfg,
                layers,
                first=first,
                last=last,
                ctx=ctx,
                seed=seed,
                dtype=dtype,
                recompute=recompute,
            )
        )
    return chunks


def _check_names(chunk: nn.Module) -> None:
    """Module paths must equal global names (a copy of the tied embedding excepted)."""
    for path, param in chunk.named_parameters():
        info: ShardInfo = param.shard_info
        if info.name != path and not getattr(param, "embedding_copy", False):
            raise AssertionError(f"parameter {path} is named {info.name} globally")
