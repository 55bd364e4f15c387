"""Sequence parallelism (``parallel.sp``) trains the same model as one process.

Real worker processes on gloo, the jobs and the bar of tests/test_trainer_parity.py (fp32,
dropout 0, relative 1e-5 in loss and gradient norm at every step): tp2, tp2 × dp2, a
pipeline (pp2 × tp2, where each stage sends its part of the sequence), and MoE with the
experts tp-split (etp = tp) and not (etp = 1), the router running on the sequence part.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from test_trainer_parity import MOE, RTOL, _max_rel, _train, references  # noqa: F401

from elasticd.errors import JobSpecError
from elasticd.jobspec import parse_job

SP = {"parallel.tp": 2, "parallel.sp": True}

LAYOUTS = {
    # name: (world, reference, settings)
    "tp2_sp": (2, "dense", SP),
    "pp2_tp2_sp": (4, "dense", {**SP, "parallel.pp": 2}),
    "moe_tp2_sp_etp2": (2, "moe", {**MOE, **SP}),
    "moe_tp2_sp_etp1": (2, "moe", {**MOE, **SP, "parallel.etp": 1}),
    # Full recomputation runs each block's all-gathers and reduce-scatters again in backward.
    "tp2_sp_recompute_full": (2, "dense", {**SP, "train.recompute": "full"}),
    "tp2_dp2_sp": (4, "dense", SP),
    # The tp sum of the partial gradients runs on each rank's ZeRO-1 rows of them.
    "tp2_dp2_sp_zero1": (4, "dense", {**SP, "parallel.zero": 1}),
}
# Four ranks on two cores; tp2_sp and pp2_tp2_sp cover the same paths.
SLOW = {"tp2_dp2_sp", "tp2_dp2_sp_zero1"}


@pytest.mark.parametrize(
    "layout", [pytest.param(k, marks=pytest.mark.slow) if k in SLOW else k for k in LAYOUTS]
)
def test_sequence_parallel_layouts_match_a_single_process_at_every_step(
    layout: str,
    references,  # noqa: F811 - the reference runs, a fixture of test_trainer_parity
    tmp_path: Path,
) -> None:
    world, ref_name, settings = LAYOUTS[layout]
    ref = references[ref_name]
    got = _train(tmp_path, layout, world, settings)
    loss_rel, norm_rel = _max_rel(ref, got, "loss"), _max_rel(ref, got, "grad_norm")
    print(f"parity {layout}: max rel diff loss {loss_rel:.2e} grad_norm {norm_rel:.2e}")
    assert loss_rel <= RTOL and norm_rel <= RTOL, (layout, loss_rel, norm_rel)
    assert got[-1]["world"] == world and got[-1]["tp"] == 2
    assert got[-1]["loss"] < got[0]["loss"]


def _raw(**parallel) -> dict:
    return {"name": "sp", "parallel": parallel,
            "model": {"layers": 2, "hidden": 32, "heads": 4, "ffn_hidden": 64, "seq_len": 15}}  # fmt: skip


@pytest.mark.parametrize(
    ("parallel", "message"),
    [
        ({"sp": True}, "job.yaml: parallel.sp: true needs parallel.tp > 1"),
        (
            {"sp": True, "tp": 2},
            "job.yaml: parallel.sp: model.seq_len (15) is not a multiple of parallel.tp (2)",
        ),
        ({"sp": "yes", "tp": 2}, "job.yaml: parallel.sp: 'yes' is not"),
    ],
)
def test_a_sequence_parallel_job_that_cannot_run_is_refused_in_one_line(parallel, message):
    raw = _raw(**parallel)
    raw["nproc_per_node"] = parallel.get("tp", 1)
    with pytest.raises(JobSpecError) as err:
        parse_job(raw)
    assert str(err.value).startswith(message) and "\n" not in str(err.value)
