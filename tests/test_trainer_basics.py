"""Training basics (issue 14, point 6): the learning-rate schedules, the TF32 switch, MFU and
peak memory in every metrics.jsonl record, and the world taken from torchrun's environment."""

from __future__ import annotations

import itertools
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml

from elasticd.errors import JobSpecError
from elasticd.jobspec import ModelConfig, load_job, parse_job
from trainer.__main__ import main as trainer_main
from trainer.__main__ import world_overrides
from trainer.launch import free_port
from trainer.model import build_chunks
from trainer.optim import lr_at
from trainer.parallel.context import ParallelContext
from trainer.perf import (
    apply_tf32,
    flops_per_token,
    matmul_precision,
    mfu,
    peak_flops,
    peak_flops_for,
    peak_memory_gib,
)

REPO = Path(__file__).resolve().parents[1]
SMALL = {
    "name": "basics",
    "model": {"layers": 2, "hidden": 32, "heads": 4, "ffn_hidden": 64, "vocab": 50,
              "seq_len": 16},
    "train": {"steps": 4, "global_batch": 4, "micro_batch": 2, "lr": 1.0e-3, "warmup": 1},
    "checkpoint": {"resume": False, "every": 0},
}  # fmt: skip


# -- the learning-rate schedule ----------------------------------------------------------------


def test_the_default_schedule_warms_up_then_stays_flat_as_before():
    lrs = [lr_at(s, lr=1.0, warmup=4, steps=20) for s in range(20)]
    assert lrs[:4] == [0.25, 0.5, 0.75, 1.0] and lrs[4:] == [1.0] * 16


@pytest.mark.parametrize("schedule", ["cosine", "linear"])
def test_a_decaying_schedule_goes_from_lr_after_warm_up_to_min_lr_at_the_last_step(schedule):
    kw = dict(lr=1.0, warmup=2, schedule=schedule, min_lr=0.1, steps=12)
    lrs = [lr_at(s, **kw) for s in range(12)]
    assert lrs[:2] == [0.5, 1.0]  # warm-up, unchanged
    assert lrs[2] == pytest.approx(1.0) and lrs[-1] == pytest.approx(0.1)
    assert all(a >= b for a, b in itertools.pairwise(lrs[2:]))  # never rises
    # Half-way through the decay (steps 2..11, so 6.5) both are at the mean of lr and min_lr.
    assert lr_at(2 + 4.5, **kw) == pytest.approx(0.55)
    assert lr_at(40, **kw) == pytest.approx(0.1)  # past the end it stays at min_lr


def test_cosine_and_linear_have_their_shapes():
    kw = dict(lr=1.0, warmup=0, min_lr=0.0, steps=5)  # progress 0, 1/4, 1/2, 3/4, 1
    assert [lr_at(s, schedule="linear", **kw) for s in range(5)] == [1.0, 0.75, 0.5, 0.25, 0.0]
    cos = [lr_at(s, schedule="cosine", **kw) for s in range(5)]
    assert cos == pytest.approx([0.5 * (1 + math.cos(math.pi * s / 4)) for s in range(5)])


def _job(**train) -> dict:
    raw = json.loads(json.dumps(SMALL))
    raw["train"].update(train)
    return raw


@pytest.mark.parametrize(
    ("train", "message"),
    [
        ({"lr_schedule": "cosin"}, "train.lr_schedule: 'cosin' is not one of 'constant', 'cosine', 'linear'"),
        ({"lr_schedule": "cosine", "min_lr": -1e-5}, "train.min_lr: -1e-05 must be >= 0"),
        ({"lr_schedule": "cosine", "min_lr": 0.01}, "train.min_lr: 0.01 is more than train.lr (0.001)"),
        ({"min_lr": 1e-5}, "train.min_lr: only used when train.lr_schedule is cosine or linear"),
        ({"lr_schedule": "linear", "min_lr": float("inf")}, "train.min_lr: inf must be a finite number"),
        ({"tf32": "yes"}, "train.tf32: 'yes' is not true or false"),
    ],
)  # fmt: skip
def test_bad_schedule_and_precision_settings_are_refused_with_one_line(train, message):
    with pytest.raises(JobSpecError) as err:
        parse_job(_job(**train))
    assert str(err.value) == f"job.yaml: {message}"


def test_a_bad_schedule_stops_the_trainer_with_exit_code_2(tmp_path, capsys):
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(_job()))
    assert trainer_main([str(path), "--set", "train.lr_schedule=step"], env={}) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "train.lr_schedule: 'step' is not one of" in err


def test_the_defaults_keep_a_constant_schedule_and_tf32_on():
    t = parse_job(_job()).train
    assert (t.lr_schedule, t.min_lr, t.tf32) == ("constant", 0.0, True)


# -- TF32, FLOPs, MFU, memory ------------------------------------------------------------------


def test_tf32_applies_to_float32_on_cuda_only():
    cuda, cpu = torch.device("cuda", 0), torch.device("cpu")
    assert matmul_precision(device=cuda, dtype=torch.float32, tf32=True) == "tf32"
    assert matmul_precision(device=cuda, dtype=torch.float32, tf32=False) == "ieee"
    assert matmul_precision(device=cuda, dtype=torch.bfloat16, tf32=True) is None
    assert matmul_precision(device=cpu, dtype=torch.float32, tf32=True) is None
    before = torch.backends.cuda.matmul.allow_tf32
    assert apply_tf32(device=cpu, dtype=torch.float32, tf32=not before) is None
    assert torch.backends.cuda.matmul.allow_tf32 == before  # a CPU run changes nothing


def _matmul_weights(cfg: ModelConfig) -> float:
    """Weights that multiply each token, counted from a real model: every matrix but the
    position table (the tied word embedding counts once, as the head); for MoE, the
    router and top_k of the experts."""
    (chunk,) = build_chunks(cfg, [range(cfg.layers)], ctx=ParallelContext.single(), seed=1)
    total = 0.0
    for name, p in chunk.named_parameters():
        if not name.endswith(".weight") or p.dim() < 2 or "position_embeddings" in name:
            continue
        share = cfg.top_k / cfg.experts if ".experts." in name else 1.0
        total += share * math.prod(p.shard_info.global_shape)
    return total


@pytest.mark.parametrize("experts", [0, 4])
def test_model_flops_per_token_are_six_per_weight_plus_attention(experts):
    cfg = ModelConfig(layers=2, hidden=32, heads=4, ffn_hidden=64, vocab=50, seq_len=16,
                      experts=experts, top_k=2)  # fmt: skip
    attention = 12 * cfg.layers * cfg.hidden * cfg.seq_len
    assert flops_per_token(cfg) == pytest.approx(6 * _matmul_weights(cfg) + attention)


def test_gpt2_small_costs_the_published_flops_per_token():
    gpt2 = ModelConfig(layers=12, hidden=768, heads=12, ffn_hidden=3072, vocab=50257,
                       seq_len=1024)  # fmt: skip
    # 6 × 123.5M weights (124M less the position table and the small vectors), plus attention.
    assert flops_per_token(gpt2) == 6 * 123_532_032 + 12 * 12 * 768 * 1024


def test_mfu_uses_the_devices_dense_peak_and_is_none_where_unknown():
    assert peak_flops_for("NVIDIA H100 80GB HBM3", dtype=torch.bfloat16, tf32=True) == 989e12
    assert peak_flops_for("NVIDIA H100 PCIe", dtype=torch.bfloat16, tf32=True) == 756e12
    assert peak_flops_for("NVIDIA H200", dtype=torch.float32, tf32=True) == 494.5e12
    assert peak_flops_for("NVIDIA A100-SXM4-80GB", dtype=torch.float32, tf32=False) == 19.5e12
    assert peak_flops_for("Tesla T4", dtype=torch.bfloat16, tf32=True) is None
    assert peak_flops(torch.device("cpu"), dtype=torch.float32, tf32=True) is None
    assert mfu(flops=989e12, seconds=2.0, ranks=2, peak=989e12) == pytest.approx(0.25)
    assert mfu(flops=1.0, seconds=1.0, ranks=1, peak=None) is None


def test_peak_memory_on_cpu_is_the_processs_peak_resident_set():
    before = peak_memory_gib(torch.device("cpu"))
    block = torch.ones(64 << 20, dtype=torch.uint8)  # 64 MiB, touched
    after = peak_memory_gib(torch.device("cpu"))
    assert 0.01 < before <= after < 64 and after - before <= 0.07
    del block


def test_every_record_has_mfu_and_peak_memory_and_follows_the_schedule(tmp_path):
    raw = _job(steps=4, warmup=1, lr_schedule="cosine", min_lr=1e-4)
    raw["output_dir"] = str(tmp_path / "out")
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(raw))
    env = dict(os.environ, OMP_NUM_THREADS="1", CUDA_VISIBLE_DEVICES="")
    proc = subprocess.run([sys.executable, "-m", "trainer", str(path)], env=env, cwd=REPO,
                          capture_output=True, text=True, timeout=120)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-2000:]
    records = [json.loads(x) for x in (tmp_path / "out" / "metrics.jsonl").read_text().split()]
    t = load_job(path).train
    want = [lr_at(s, lr=t.lr, warmup=1, schedule="cosine", min_lr=1e-4, steps=4) for s in range(4)]
    assert [r["lr"] for r in records] == pytest.approx(want)
    assert records[-1]["lr"] == pytest.approx(1e-4)
    for r in records:
        assert "mfu" in r and r["mfu"] is None  # CPU: no known peak
        assert 0.01 < r["mem_gb"] < 64
    assert all(a["mem_gb"] <= b["mem_gb"] for a, b in itertools.pairwise(records))


# -- the world from torchrun's environment ----------------------------------------------------


def test_the_world_comes_from_torchruns_environment_unless_an_agent_planned_it():
    assert world_overrides({"WORLD_SIZE": "8", "LOCAL_WORLD_SIZE": "4"}) == [
        "nproc_per_node=4", "nodes.min=2", "nodes.max=2"]  # fmt: skip
    assert world_overrides({"WORLD_SIZE": "2"}) == [
        "nproc_per_node=2",
        "nodes.min=1",
        "nodes.max=1",
    ]
    assert world_overrides({"WORLD_SIZE": "5", "LOCAL_WORLD_SIZE": "2"})[0] == "nproc_per_node=5"
    assert world_overrides({}) == []
    assert world_overrides({"WORLD_SIZE": "8", "ELASTICD_LAYOUT": "/x/layout.json"}) == []
    assert world_overrides({"WORLD_SIZE": "8", "ELASTICD_WARM_AFTER": "0"}) == []
    with pytest.raises(ValueError, match="WORLD_SIZE"):
        world_overrides({"WORLD_SIZE": "two"})


def test_a_job_is_checked_against_the_world_in_the_environment(tmp_path, capsys):
    path = tmp_path / "job.yaml"  # nproc_per_node and nodes left at their defaults (1)
    path.write_text(yaml.safe_dump(_job()))
    env = {"RANK": "0", "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2"}
    assert trainer_main([str(path), "--set", "parallel.tp=4"], env=env) == 2
    err = capsys.readouterr().err.strip()
    assert "nodes.min: a world of 2 ranks is smaller than tp·pp·cp" in err, err


@pytest.mark.slow  # about 18 s: torchrun and two trainer processes
@pytest.mark.timeout(180)
def test_plain_torchrun_with_two_processes_runs_tp2_without_repeating_nproc_per_node(tmp_path):
    raw = _job(steps=2)
    raw["output_dir"] = str(tmp_path / "out")
    path = tmp_path / "job.yaml"  # nproc_per_node and nodes left at their defaults (1)
    path.write_text(yaml.safe_dump(raw))
    torchrun = Path(sys.executable).with_name("torchrun")
    env = dict(os.environ, OMP_NUM_THREADS="1", CUDA_VISIBLE_DEVICES="")
    cmd = [str(torchrun), "--nproc-per-node", "2", f"--master-port={free_port()}",
           "-m", "trainer", str(path), "--set", "parallel.tp=2"]  # fmt: skip
    proc = subprocess.run(cmd, env=env, cwd=REPO, capture_output=True, text=True, timeout=170)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]
    records = [json.loads(x) for x in (tmp_path / "out" / "metrics.jsonl").read_text().split()]
    assert [(r["step"], r["world"], r["tp"], r["dp"]) for r in records] == [
        (1, 2, 2, 1),
        (2, 2, 2, 1),
    ]


def test_a_newcomers_first_layout_is_not_used_for_a_world_of_another_size():
    """A newcomer planned its layout for round 2 (3 ranks); round 2 ended before it trained
    (a node lost meanwhile), and round 3 (2 ranks) was handed the 3-rank layout: "the
    default group has 2 ranks but the layout was planned for 3", and a process restart."""
    from types import SimpleNamespace

    from elasticd.layout import plan
    from trainer.__main__ import _layout_for

    job = parse_job({"name": "t", "train": {"global_batch": 12, "micro_batch": 2}})
    first = {"layout": plan(3, job)}
    ctx = SimpleNamespace(world_size=2, layout=None)
    assert _layout_for(ctx, job, first).world == 2 and first == {}
    first = {"layout": plan(3, job)}
    planned = first["layout"]
    assert _layout_for(SimpleNamespace(world_size=3, layout=None), job, first) is planned
    assert _layout_for(SimpleNamespace(world_size=3, layout=None), job, first).world == 3
