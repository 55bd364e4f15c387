"""The chaos soak (bench/chaos.py), as the command a user runs: one job on a local cluster
of 3 agents over a 3-member etcd, through random faults of every kind, its losses checked
against one-process runs of the same job.

The short soak (each of the ten kinds once; 4 to 7 minutes through pytest on 2 cores, the
references included) and the 20-minute one (30 faults) are `slow`: each kind of fault has
its own test in the default suite (tests/test_localcluster_faults.py,
tests/test_agent_reliability.py, tests/test_inprocess.py), and `make test` stays near its
15-minute budget. Both check what the soak is for:
the job succeeds, every fault is recovered from, no committed checkpoint is lost or fails
`elasticd ckpt verify`, every record's loss equals, within 1e-4, a one-process run resumed
from the checkpoint its round resumed from, and every step computed twice agrees with its
first computation. The uninterrupted one-process run gates only where the report says so
(a job short enough for fp32 round-off between layouts not to grow). How long things took
is the report's business, not the test's.
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
import threading
from types import SimpleNamespace

import pytest

BENCH = os.path.join(
    os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "bench", "chaos.py"
)
sys.path.insert(0, os.path.dirname(BENCH))

from chaos_reference import ResumedReferences  # noqa: E402


def commit(ckpt_dir, *steps: int) -> None:
    for step in steps:
        os.makedirs(ckpt_dir / f"step-{step:09d}")
        (ckpt_dir / f"step-{step:09d}" / "manifest.json").write_text("{}")


def test_each_round_is_referenced_from_its_checkpoint_in_segments_of_its_own_checkpoints(
    tmp_path,
):
    ckpt, logs = tmp_path / "ckpt", tmp_path / "logs"
    commit(ckpt, *range(20, 241, 20))
    refs = ResumedReferences({}, ckpt_dir=str(ckpt), logs_dir=str(logs), out_dir=str(tmp_path),
                             segment_steps=100)  # fmt: skip
    rec = [{"step": s, "round": 1, "loss": 1.0} for s in range(1, 251)]
    refs.observe(rec)
    refs.poll()  # round 1 is still training: only segments it trained past
    assert [(s.start, s.stop) for s in refs.rounds[1].segments] == [(0, 100), (100, 200)]
    # The soak's one run: logs/<run_id>/round-<r>/. The log names step 220 (loaded: a
    # fallback from 240), which its first record (241) would not tell.
    (logs / "soak-1234abcd" / "round-2").mkdir(parents=True)
    (logs / "soak-1234abcd" / "round-2" / "rank-0.log").write_text(
        "resumed from x/step-000000220 at step 220\n"
    )
    refs.observe([{"step": s, "round": 2, "loss": 1.0} for s in range(241, 261)])
    refs.poll()  # a newer round began: round 1 is over, its last segment ends at its last step
    r1, r2 = refs.rounds[1], refs.rounds[2]
    assert [(s.start, s.stop) for s in r1.segments][2:] == [(200, 250)]
    assert (r1.source, r2.source, r2.resumed_from) == ("scratch", "checkpoint", 220)
    assert r2.note == "its log says it resumed at step 220, its first record is 241"
    refs.observe([{"step": 251, "round": 1, "loss": 1.0}])  # a late write of round 1
    refs.poll(final=True)
    assert [(s.start, s.stop) for s in r1.segments][3:] == [(200, 251)]
    assert [(s.start, s.stop) for s in r2.segments] == [(220, 260)]  # from what it loaded


def test_a_round_that_resumed_from_no_checkpoint_on_disk_is_chained_and_says_so(tmp_path):
    ckpt = tmp_path / "ckpt"
    commit(ckpt, 20, 40)
    refs = ResumedReferences({}, ckpt_dir=str(ckpt), logs_dir=str(tmp_path / "logs"),
                             out_dir=str(tmp_path))  # fmt: skip
    refs.observe([{"step": s, "round": 3, "loss": 1.0} for s in range(46, 50)])
    refs.poll(final=True)
    r = refs.rounds[3]
    assert (r.source, r.resumed_from, [(s.start, s.stop) for s in r.segments]) == (
        "chained", 45, [(40, 49)])  # fmt: skip
    assert "not a checkpoint on disk" in r.note


def soak(tmp_path, *, seed: int, minutes: float, restart_mode: str = "process") -> dict:
    out = tmp_path / "chaos"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    r = subprocess.run(
        # A generous recovery limit: other work on the machine slows start-ups, not outcomes.
        [sys.executable, BENCH, "--seed", str(seed), "--minutes", str(minutes), "--out", str(out),
         "--recovery-limit", "600", "--restart-mode", restart_mode],
        capture_output=True, text=True, env=env, timeout=minutes * 60 * 6 + 900,
    )  # fmt: skip
    print(r.stdout[-8000:], r.stderr[-4000:])
    assert (out / "chaos-report.json").exists(), r.stderr[-2000:]
    return json.loads((out / "chaos-report.json").read_text())


def assert_soak_held(report: dict, *, faults: int) -> None:
    job = report["job"]
    assert job["state"] == "succeeded", job["reason"]
    assert job["steps_completed"] == report["steps"]
    problems = [f"{f['fault']}: {f['problem']}" for f in report["faults"] if not f["recovered"]]
    assert not problems, problems
    assert len(report["faults"]) >= faults, report["injection_stopped"]
    from chaos import KINDS

    assert {f["kind"] for f in report["faults"]} == set(KINDS)
    ckpt = report["checkpoints"]
    assert ckpt["on_disk"] > 0 and ckpt["verified_ok"] == ckpt["on_disk"], ckpt["corrupted"]
    assert ckpt["lost"] == [], "a step once committed is gone"
    per_round = report["per_round"]
    assert not per_round["error"] and per_round["failed_segment_count"] == 0, (
        per_round["error"],
        per_round["failed_segments"],
    )
    assert per_round["compared"] == per_round["records"] > 0, per_round["without_reference"]
    assert per_round["mismatch_count"] == 0, per_round["mismatches"]
    assert report["recomputed"]["mismatch_count"] == 0, report["recomputed"]["mismatches"]
    uninterrupted = report["uninterrupted"]
    if uninterrupted["gating"]:
        assert uninterrupted["compared"] == uninterrupted["records"] > 0
        assert uninterrupted["mismatch_count"] == 0, uninterrupted["mismatches"]


def test_the_bag_of_faults_is_drawn_so_that_every_kind_still_fits():
    """Seed 7's in-process soak drew kill-node with only freeze-node left after it, at 3
    nodes up: the freeze then never fit (it needs a node to spare) and a tenth kind was
    drawn instead. The draw takes the kind after which most node faults still fit."""
    from chaos import KINDS, NODES_START, ChaosPlan, _injectable

    assert _injectable(NODES_START, ["kill-node", "term-node", "freeze-node", "add-node"]) == 4
    assert _injectable(2, ["freeze-node"]) == 0 and _injectable(3, ["freeze-node"]) == 1
    assert _injectable(2, ["kill-node", "freeze-node"]) == 0
    assert _injectable(2, ["add-node", "kill-node", "freeze-node"]) == 3
    # A bag leaves one node fewer than it found, so the second bag does not fit whole.
    assert _injectable(2, list(KINDS)) == 3

    view = SimpleNamespace(step=9, cluster=SimpleNamespace(alive_nodes=lambda: [0, 1, 2]))
    plan = object.__new__(ChaosPlan)  # the draw's state alone
    plan.alive, plan.world, plan.rng = 3, 3, random.Random(0)
    plan.bag = ["kill-node", "freeze-node"]
    assert plan._draw(view).kind == "freeze-node"  # the kill after it still fits
    plan.bag = ["kill-node", "etcd-outage"]
    assert plan._draw(view).kind == "kill-node"
    plan.bag = ["kill-node", "term-node", "freeze-node"]  # the kill and the term cannot both
    assert plan._draw(view).kind == "freeze-node"


def test_a_restarted_node_is_neither_a_removal_nor_an_addition():
    """restart-node kills a node and starts its agent again at once under its id: the
    count of nodes up does not change, so it fits at NODES_MIN and NODES_MAX alike, aims
    at a node that is up, and leaves the rest of the bag as it found it. It has recovered
    once a new round trains with the world as large as before."""
    from chaos import KINDS, NODES_MAX, NODES_MIN, ChaosPlan, Injected, _injectable

    from elasticd.localcluster import Fault

    assert "restart-node" in KINDS and len(set(KINDS)) == len(KINDS)
    # Not a node fault for the count: the bag's node faults fit as they did without it.
    assert _injectable(2, ["restart-node", "add-node", "kill-node", "freeze-node"]) == 3
    plan = object.__new__(ChaosPlan)
    plan.rng = random.Random(0)
    for alive in (NODES_MIN, NODES_MAX):
        up = list(range(alive))
        view = SimpleNamespace(step=9, cluster=SimpleNamespace(alive_nodes=lambda up=up: up))
        plan.alive, plan.world, plan.bag = alive, alive, ["restart-node"]
        fault = plan._draw(view)
        assert (fault.kind, fault.target in up) == ("restart-node", True)
        assert plan._alive_after("restart-node") == alive
    # With a node not up yet (the agents disagree with the count), it waits, as removals do.
    view = SimpleNamespace(step=9, cluster=SimpleNamespace(alive_nodes=lambda: [0]))
    plan.alive, plan.bag = 2, ["restart-node", "kill-worker"]
    assert plan._draw(view).kind == "kill-worker" and plan.bag == ["restart-node"]

    def checked(rounds, world):
        inj = Injected(n=1, fault=Fault(kind="restart-node", target=1, step=9), t=0.0,
                       step=9, round=1, world=3, alive_before=3, alive_after=3)  # fmt: skip
        inj.rounds = rounds
        plan.world, plan.current, plan.limit, plan.top_step, plan.round = world, inj, 1e9, 9, 3
        plan.out = SimpleNamespace(write=lambda s: None, flush=lambda: None)
        with_log = SimpleNamespace(lock=threading.Lock(), fault_log=[])
        plan._check_recovery(inj, SimpleNamespace(cluster=with_log), 1.0)
        return inj.recovered_at is not None

    assert not checked([], 3)  # no new round yet
    assert not checked([2], 2)  # a round without the node: not back yet
    assert checked([2, 3], 3)  # the node back in a new round


@pytest.mark.slow
@pytest.mark.timeout(2400)
def test_a_short_chaos_soak_keeps_every_checkpoint_and_the_one_process_losses(tmp_path):
    report = soak(tmp_path, seed=1, minutes=3)
    assert report["uninterrupted"]["gating"]  # 2,160 steps: short enough
    assert_soak_held(report, faults=10)


@pytest.mark.slow
@pytest.mark.timeout(3 * 3600)
def test_a_twenty_minute_chaos_soak_with_thirty_faults_keeps_the_job_whole(tmp_path):
    report = soak(tmp_path, seed=7, minutes=20)
    assert_soak_held(report, faults=30)


@pytest.mark.slow
@pytest.mark.timeout(2400)
def test_a_short_in_process_chaos_soak_keeps_the_job_whole(tmp_path):
    """The same faults with restart.mode inprocess: survivors keep their processes, a round
    that resumed from its peers is checked against references chained from the checkpoint
    before it (docs/inprocess.md, Tests)."""
    report = soak(tmp_path, seed=1, minutes=3, restart_mode="inprocess")
    assert_soak_held(report, faults=10)
