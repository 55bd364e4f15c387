"""Parity: every layout trains the same model as one process (DESIGN.md, invariant 2).

Real worker processes (``python -m trainer``) on gloo, with a torchrun-style environment.
Each layout's metrics.jsonl must match a single-process run of the same job at every step,
in loss and in gradient norm, within relative 1e-5 (fp32, dropout 0; the issue asks 1e-4). The model is small
but exercises everything: gradient accumulation (grad_accum 4, 2 or 1), several gradient
buckets, clipping (the norm is above grad_clip), weight decay, warm-up, a vocabulary that
tp=4 must pad (50 → 52), and MoE with an aux loss.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml
from session_cache import once_per_session

from trainer.launch import launch_local

STEPS = 10
# The issue asks for 1e-4. Observed differences are about 1e-7 (fp32 round-off), and a
# real bug seen during development (the MoE aux loss computed on a tp chunk) moved the
# first steps by about 1e-5, so the bar is set at 1e-5 to catch that class of error.
RTOL = 1e-5

BASE = {
    "name": "parity",
    "nproc_per_node": 1,
    "model": {"layers": 2, "hidden": 32, "heads": 4, "ffn_hidden": 64, "vocab": 50,
              "seq_len": 16, "experts": 0, "top_k": 2, "tie_embeddings": True, "dropout": 0.0},
    "train": {"steps": STEPS, "global_batch": 8, "micro_batch": 2, "lr": 3.0e-3, "warmup": 2,
              "weight_decay": 0.1, "grad_clip": 1.0, "seed": 7, "bucket_mb": 0.002},
    "data": {"source": "synthetic"},
}  # fmt: skip
MOE = {"model.experts": 4, "model.top_k": 2, "train.aux_loss_coeff": 0.01}


def _job(tmp: Path, name: str, world: int, settings: dict) -> tuple[Path, Path]:
    raw = json.loads(json.dumps(BASE))
    raw["nproc_per_node"] = world
    for key, value in settings.items():
        section, field = key.split(".")
        raw.setdefault(section, {})[field] = value
    out = tmp / name
    raw["output_dir"] = str(out)
    path = tmp / f"{name}.yaml"
    path.write_text(yaml.safe_dump(raw))
    return path, out


def _train(tmp: Path, name: str, world: int, settings: dict) -> list[dict]:
    path, out = _job(tmp, name, world, settings)
    outcomes = launch_local(str(path), world=world, timeout=240)
    failed = [o for o in outcomes if o.returncode != 0]
    assert not failed, "\n".join(
        f"rank {o.rank} rc={o.returncode}:\n{o.output[-3000:]}" for o in failed
    )
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == list(range(1, STEPS + 1))
    return records


@pytest.fixture(scope="module")
def references(tmp_path_factory) -> dict[str, list[dict]]:
    def train() -> dict[str, list[dict]]:
        tmp = tmp_path_factory.mktemp("reference")
        return {"dense": _train(tmp, "dense", 1, {}), "moe": _train(tmp, "moe", 1, MOE)}

    return once_per_session(tmp_path_factory.getbasetemp(), "trainer-parity-references", train)


def _max_rel(ref: list[dict], got: list[dict], key: str) -> float:
    return max(abs(g[key] - r[key]) / abs(r[key]) for r, g in zip(ref, got, strict=True))


LAYOUTS = {
    # name: (world, reference, settings)
    "dp2": (2, "dense", {}),
    "tp2_with_a_spare_rank": (3, "dense", {"parallel.tp": 2}),
    "tp4": (4, "dense", {"parallel.tp": 4}),
    "tp2_dp2": (4, "dense", {"parallel.tp": 2}),
    "moe_ep2": (2, "moe", {**MOE, "parallel.ep": 2}),
    "moe_ep2_dp2": (4, "moe", {**MOE, "parallel.ep": 2}),
    "moe_tp2_ep2_etp2": (4, "moe", {**MOE, "parallel.tp": 2, "parallel.ep": 2}),
    "moe_tp2_ep2_etp1": (4, "moe", {**MOE, "parallel.tp": 2, "parallel.ep": 2, "parallel.etp": 1}),
}


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_every_step_matches_a_single_process_in_loss_and_grad_norm(
    layout: str, references, tmp_path: Path
) -> None:
    world, ref_name, settings = LAYOUTS[layout]
    ref = references[ref_name]
    got = _train(tmp_path, layout, world, settings)
    loss_rel, norm_rel = _max_rel(ref, got, "loss"), _max_rel(ref, got, "grad_norm")
    print(f"parity {layout}: max rel diff loss {loss_rel:.2e} grad_norm {norm_rel:.2e}")
    assert loss_rel <= RTOL and norm_rel <= RTOL, (layout, loss_rel, norm_rel)
    # The run really is parallel as asked, and it really learned something.
    assert got[-1]["world"] == world and got[-1]["tp"] == settings.get("parallel.tp", 1)
    assert got[-1]["loss"] < got[0]["loss"]


def test_the_reference_runs_clip_accumulate_and_learn(references) -> None:
    for records in references.values():
        assert records[0]["grad_norm"] > BASE["train"]["grad_clip"]  # clipping is exercised
        assert records[-1]["loss"] < records[0]["loss"] - 0.05
        assert records[1]["lr"] == pytest.approx(BASE["train"]["lr"])
        assert records[0]["lr"] == pytest.approx(BASE["train"]["lr"] / 2)  # warm-up
