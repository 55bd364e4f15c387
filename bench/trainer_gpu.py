"""``bench/trainer.py --device cuda``: the built-in trainer on one GPU against a plain
PyTorch training loop of the same model, side by side in one run.

The model is GPT-2 small (124M parameters: 12 layers, hidden 768, 12 heads, vocabulary
50257, 1024 positions, tied embeddings), trained on random tokens with the same batch,
AdamW and gradient clipping in both. Each configuration runs in a process of its own (a
clean CUDA context and memory statistics):

- ``elasticd``: ``python -m trainer`` with ``train.dtype: bfloat16`` (and ``float32``
  with TF32 when asked), world 1, no checkpoint until the last step; tokens/s, MFU and
  peak memory are read from its own metrics.jsonl (what a user sees).
- ``reference``: a minimal GPT-2 written the usual way (``nn.Linear``, SDPA attention,
  ``torch.optim.AdamW(fused=True)``, bf16 autocast with fp32 parameters, gradients
  accumulated over micro-batches, norm clipping), eager and under ``torch.compile``.

MFU counts model FLOPs the trainer's way (``trainer.perf``: 6·N + 12·L·h·s per token
against the device's dense bf16 peak) for both, so the ratios are ratios of tokens/s.
"""

from __future__ import annotations

import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, ROOT)

GPT2_SMALL = {"layers": 12, "hidden": 768, "heads": 12, "ffn_hidden": 3072, "vocab": 50257,
              "seq_len": 1024}  # fmt: skip


def model_cfg(args) -> dict:
    cfg = dict(GPT2_SMALL)
    if args.gpu_layers:
        cfg["layers"] = args.gpu_layers
    cfg["seq_len"] = args.gpu_seq_len
    return cfg


# -- elasticd's trainer ----------------------------------------------------------------------


def run_trainer(args, *, dtype: str) -> dict:
    steps = args.gpu_warmup + args.gpu_steps
    with tempfile.TemporaryDirectory(prefix="bench-trainer-gpu-") as tmp:
        job = {
            "name": "bench-gpu",
            "output_dir": os.path.join(tmp, "out"),
            "model": model_cfg(args),
            "train": {"steps": steps, "global_batch": args.gpu_global_batch,
                      "micro_batch": args.gpu_micro_batch, "dtype": dtype, "tf32": True,
                      "lr": 3e-4, "warmup": 0, "grad_clip": 1.0},
            "checkpoint": {"every": 0},
        }  # fmt: skip
        path = os.path.join(tmp, "job.json")
        with open(path, "w", encoding="utf-8") as fh:
            json.dump(job, fh)
        env = {k: v for k, v in os.environ.items()
               if not k.startswith(("ELASTICD_", "TORCHELASTIC", "RANK", "WORLD_SIZE"))}  # fmt: skip
        r = subprocess.run([sys.executable, "-m", "trainer", path], cwd=ROOT, env=env,
                           capture_output=True, text=True, timeout=1800)  # fmt: skip
        if r.returncode != 0:
            return {"error": f"trainer exit {r.returncode}: {r.stderr.strip()[-800:]}"}
        with open(os.path.join(tmp, "out", "metrics.jsonl"), encoding="utf-8") as fh:
            recs = [json.loads(line) for line in fh if line.strip()]
    timed = [x for x in recs if x["step"] > args.gpu_warmup]
    step_s = statistics.median(x["step_s"] for x in timed)
    mfus = [x["mfu"] for x in timed if x.get("mfu") is not None]
    return {
        "tokens_per_s": args.gpu_global_batch * args.gpu_seq_len / step_s,
        "step_s": step_s,
        "mfu": statistics.median(mfus) if mfus else None,
        "mem_gb": max(x["mem_gb"] for x in recs),
        "loss": timed[-1]["loss"],
    }


# -- the plain PyTorch reference -------------------------------------------------------------


def reference_worker(cfg: dict) -> None:
    import torch
    import torch.nn as nn
    import torch.nn.functional as F

    from trainer.perf import flops_per_token, peak_flops

    m = cfg["model"]
    h, heads, layers, vocab, seq = m["hidden"], m["heads"], m["layers"], m["vocab"], m["seq_len"]
    dev = torch.device(cfg.get("device", "cuda"))  # "cpu" only to check this code runs
    cuda = dev.type == "cuda"
    torch.backends.cuda.matmul.allow_tf32 = True
    torch.backends.cudnn.allow_tf32 = True

    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.ln1, self.ln2 = nn.LayerNorm(h), nn.LayerNorm(h)
            self.qkv, self.proj = nn.Linear(h, 3 * h), nn.Linear(h, h)
            self.fc, self.out = nn.Linear(h, m["ffn_hidden"]), nn.Linear(m["ffn_hidden"], h)

        def forward(self, x):
            b, s, _ = x.shape
            q, k, v = self.qkv(self.ln1(x)).view(b, s, 3, heads, h // heads).unbind(2)
            a = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2),
                                               v.transpose(1, 2), is_causal=True)  # fmt: skip
            x = x + self.proj(a.transpose(1, 2).reshape(b, s, h))
            return x + self.out(F.gelu(self.fc(self.ln2(x)), approximate="tanh"))

    class GPT(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.wte, self.wpe = nn.Embedding(vocab, h), nn.Embedding(seq, h)
            self.blocks = nn.ModuleList(Block() for _ in range(layers))
            self.ln_f = nn.LayerNorm(h)
            for p in self.parameters():
                if p.dim() > 1:
                    nn.init.normal_(p, std=0.02)

        def forward(self, ids, targets):
            x = self.wte(ids) + self.wpe(torch.arange(ids.shape[1], device=ids.device))
            for blk in self.blocks:
                x = blk(x)
            logits = F.linear(self.ln_f(x), self.wte.weight)  # tied
            return F.cross_entropy(logits.float().view(-1, vocab), targets.reshape(-1))

    torch.manual_seed(0)
    model = GPT().to(dev)
    step_fn = torch.compile(model) if cfg["compile"] else model
    opt = torch.optim.AdamW(model.parameters(), lr=3e-4, weight_decay=0.0, fused=cuda)
    mb, gb = cfg["micro_batch"], cfg["global_batch"]
    accum = gb // mb
    gen = torch.Generator(device=dev).manual_seed(1)
    times = []
    loss = None
    sync = torch.cuda.synchronize if cuda else (lambda _dev: None)
    if cuda:
        torch.cuda.reset_peak_memory_stats(dev)
    for i in range(cfg["warmup"] + cfg["steps"]):
        sync(dev)
        t0 = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        total = torch.zeros((), device=dev)
        for _ in range(accum):
            ids = torch.randint(0, vocab, (mb, seq + 1), device=dev, generator=gen)
            with torch.autocast(dev.type, dtype=torch.bfloat16):
                part = step_fn(ids[:, :-1], ids[:, 1:]) / accum
            part.backward()
            total += part.detach()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0, foreach=True)
        opt.step()
        loss = total.item()  # a host sync per step, as the trainer's metrics make one
        sync(dev)
        if i >= cfg["warmup"]:
            times.append(time.perf_counter() - t0)
    step_s = statistics.median(times)
    ftok = flops_per_token(_Cfg(m))
    peak = peak_flops(dev, dtype=torch.bfloat16, tf32=True)
    tps = gb * seq / step_s
    print("BENCH " + json.dumps({
        "tokens_per_s": tps, "step_s": step_s, "loss": loss,
        "mfu": tps * ftok / peak if peak else None,
        "mem_gb": torch.cuda.max_memory_allocated(dev) / 2**30 if cuda else 0.0,
        "params": sum(p.numel() for p in model.parameters()),
    }), flush=True)  # fmt: skip


class _Cfg:
    """The job's ``model`` section as ``trainer.perf.flops_per_token`` reads it."""

    def __init__(self, m: dict) -> None:
        self.__dict__.update({"experts": 0, "top_k": 1, "tie_embeddings": True, **m})


def run_reference(args, *, compile: bool) -> dict:
    cfg = {"model": model_cfg(args), "compile": compile, "micro_batch": args.gpu_micro_batch,
           "global_batch": args.gpu_global_batch, "warmup": args.gpu_warmup,
           "steps": args.gpu_steps}  # fmt: skip
    r = subprocess.run([sys.executable, os.path.join(HERE, "trainer_gpu.py"), json.dumps(cfg)],
                       cwd=ROOT, capture_output=True, text=True, timeout=1800)  # fmt: skip
    if r.returncode != 0:
        return {"error": f"reference exit {r.returncode}: {r.stderr.strip()[-800:]}"}
    return next(json.loads(x[6:]) for x in r.stdout.splitlines() if x.startswith("BENCH "))


def main_cuda(args) -> int:
    import torch

    if not torch.cuda.is_available():
        print("bench/trainer.py: error: --device cuda needs a CUDA device", file=sys.stderr)
        return 2
    m = model_cfg(args)
    tokens = args.gpu_global_batch * args.gpu_seq_len
    print(f"GPU: {torch.cuda.get_device_name(0)}; torch {torch.__version__}; model: layers "
          f"{m['layers']}, hidden {m['hidden']}, heads {m['heads']}, vocab {m['vocab']}, seq "
          f"{m['seq_len']}; micro-batch {args.gpu_micro_batch}, {tokens} tokens per step; "
          f"{args.gpu_warmup} warm-up + {args.gpu_steps} timed steps (median)")  # fmt: skip
    rows: list[tuple[str, dict]] = []
    for name, fn in (
        ("reference eager (bf16 autocast)", lambda: run_reference(args, compile=False)),
        ("reference torch.compile", lambda: run_reference(args, compile=True)),
        ("elasticd trainer bfloat16", lambda: run_trainer(args, dtype="bfloat16")),
        *([("elasticd trainer float32+tf32", lambda: run_trainer(args, dtype="float32"))]
          if args.gpu_fp32 else []),
    ):  # fmt: skip
        res = fn()
        rows.append((name, res))
        if "error" in res:
            print(f"{name}: {res['error']}", flush=True)
    print(f"\n{'configuration':<34} {'tokens/s':>10} {'step ms':>8} {'MFU':>6} {'peak GiB':>9} "
          f"{'loss':>7} {'vs eager':>9} {'vs compile':>11}")  # fmt: skip
    base = {n: r.get("tokens_per_s") for n, r in rows}
    eager = base.get("reference eager (bf16 autocast)")
    compiled = base.get("reference torch.compile")
    for name, r in rows:
        if "error" in r:
            print(f"{name:<34} failed")
            continue
        mfu = f"{100 * r['mfu']:.1f}%" if r.get("mfu") is not None else "-"
        ve = f"{r['tokens_per_s'] / eager:.2f}x" if eager else "-"
        vc = f"{r['tokens_per_s'] / compiled:.2f}x" if compiled else "-"
        loss = r.get("loss")
        loss_s = f"{loss:.3f}" if isinstance(loss, float) and math.isfinite(loss) else "-"
        print(f"{name:<34} {r['tokens_per_s']:>10,.0f} {1000 * r['step_s']:>8.1f} {mfu:>6} "
              f"{r['mem_gb']:>9.2f} {loss_s:>7} {ve:>9} {vc:>11}")  # fmt: skip
    ours = base.get("elasticd trainer bfloat16")
    if ours and eager and compiled:
        best = max(eager, compiled)
        verdict = "met" if ours >= 0.9 * best else "NOT met"
        print(f"\nGOAL  elasticd bf16 tokens/s vs the faster reference: {ours / best:.2f}x   "
              f"goal >= 0.9   {verdict}")  # fmt: skip
    return 0


if __name__ == "__main__":
    reference_worker(json.loads(sys.argv[1]))
