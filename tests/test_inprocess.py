"""In-process restart under real agents, etcd and gloo workers (restart.mode: inprocess).

Each run trains the built-in GPT with no checkpoint on disk before the faults
(``checkpoint.every: 0``; only the final step is saved), so every recovery must come from
the survivors' memory. Each checks, against an uninterrupted single-process run:

- the losses, within 1e-4 (fp32 round-off of a different data-parallel reduction order);
- every step appears exactly once in metrics.jsonl (no rollback, no step trained twice);
- every recovery says mode inprocess, source peers, 0 lost steps;
- the survivors' worker processes are the same (same pids) before and after.
"""

from __future__ import annotations

import contextlib
import glob
import io
import json
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from test_agent_trainer import reference_losses, run

from checkpoint.manifest import step_dirname
from elasticd.jobspec import parse_job
from elasticd.localcluster import run_cluster


@pytest.fixture(autouse=True)
def one_thread(monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "1")


def make_job(tmp_path, name, *, nproc=1, steps=16, parallel=None, model=None, batch=12, **extra):
    raw = {
        "name": name,
        "output_dir": str(tmp_path / name),
        "nodes": extra.pop("nodes", {"min": 1, "max": 3}),
        "nproc_per_node": nproc,
        "parallel": parallel or {},
        "model": {"layers": 4, "hidden": 64, "heads": 4, "ffn_hidden": 128, "vocab": 256,
                  "seq_len": 32, **(model or {})},
        "train": {"steps": steps, "global_batch": batch, "micro_batch": 2},
        "checkpoint": {"every": 0},
        "restart": {"mode": "inprocess", "scale_up": "immediate"},
        # reform_grace: the window in which a fault's survivors re-join one round. 0.15 s
        # (the default) is measured on a loaded 2-core box; two pytest workers running
        # three or four trainers each starved a survivor past it once (the world then
        # re-formed twice: right, but not the one recovery these tests count).
        "rendezvous": {"ttl": 2, "settle": 2.0, "reform_grace": 0.5},
        **extra,
    }  # fmt: skip
    return parse_job(raw).with_paths_resolved(tmp_path)


FIRST_WORLD_SETTLE = 60.0
"""rendezvous.settle of a test whose first world must hold all of its nodes, where
nodes.min is fewer: the first round closes at nodes.max at once, or waits this long for a
node whose agent is slow to join (a loaded box; re-forms skip settle)."""


def round_pids(job) -> dict[int, set[int]]:
    """Round -> the pids of its workers, from every node's round files."""
    out: dict[int, set[int]] = {}
    pattern = os.path.join(job.out_dir, "cluster", "node-*", "jobs", "*", "round-*", "workers.json")
    for path in glob.glob(pattern):
        r = int(os.path.basename(os.path.dirname(path)).split("-")[1])
        with open(path, encoding="utf-8") as fh:
            out.setdefault(r, set()).update(json.load(fh).values())
    return out


def node_pids(job) -> dict[int, dict[int, int]]:
    """Node index -> round -> the pid of its one worker (jobs of one worker per node)."""
    out: dict[int, dict[int, int]] = {}
    pattern = os.path.join(job.out_dir, "cluster", "node-*", "jobs", "*", "round-*", "workers.json")
    for path in glob.glob(pattern):
        parts = Path(path).parts
        node, r = int(parts[-5].split("-")[1]), int(parts[-2].split("-")[1])
        with open(path, encoding="utf-8") as fh:
            (pid,) = json.load(fh).values()
        out.setdefault(node, {})[r] = pid
    return out


def story(job) -> str:
    """What the agents and workers said about rounds: the lines that explain a failed
    check (a failure on CI leaves nothing else behind)."""
    lines = []
    # The stacks a timed-out run's processes printed (localcluster's dump_stacks).
    stack = ("Thread 0x", "Current thread", '  File "')
    for path in sorted(glob.glob(os.path.join(job.out_dir, "cluster", "agent-*.log"))):
        with open(path, encoding="utf-8", errors="replace") as fh:
            keep = [ln.rstrip()[:300] for ln in fh
                    if any(w in ln for w in ("round ended", "workers started", "recovered", "standby",
                                             "falling back", "level=error", "joined round",
                                             "world formed", *stack))]  # fmt: skip
        lines += [f"== {os.path.basename(path)}", *keep]
    for path in sorted(glob.glob(os.path.join(job.out_dir, "logs", "**", "*.log"), recursive=True)):
        with open(path, encoding="utf-8", errors="replace") as fh:
            mine = [ln.rstrip()[:300] for ln in fh if "step " not in ln]
        dumped = next((i for i, ln in enumerate(mine) if ln.startswith(stack[:2])), None)
        tail = mine[dumped:][-60:] if dumped is not None else mine[-8:]
        lines += [f"== {os.path.relpath(path, job.out_dir)}", *tail]
    return "\n".join(lines)


def kept_mb(job) -> list[float]:
    """MB of the previous round's memory rank 0's new trainer adopted, per recovery from
    memory it printed (``trainer.recovery``: a box kept is not allocated again)."""
    found = []
    for path in glob.glob(os.path.join(job.out_dir, "logs", "**", "*.log"), recursive=True):
        text = Path(path).read_text(encoding="utf-8", errors="replace")
        found += [float(m) for m in re.findall(r"([\d.]+) MB of the previous round's memory kept",
                                               text)]  # fmt: skip
    return found


REPLICA_LOST = 2
"""Steps a recovery from replicas may train again at ``memory_every: 1``: the bound
docs/inprocess.md states, ``2 × memory_every`` (the replication of the step before the
fault may still be in flight, and the one before it is the newest whole). One is the
common case; two came in a CI run on a loaded box."""


def check_inprocess(
    tmp_path, job, result, *, recoveries: int, source: str = "peers", lost: int = 0
) -> list[dict]:
    assert result["state"] == "succeeded", f"{result['reason']}\n{story(job)}"
    records = result["metrics"]
    steps = [r["step"] for r in records]
    assert steps == list(range(1, job.train.steps + 1)), steps
    reference = reference_losses(tmp_path, job)
    for rec in records:
        assert rec["loss"] == pytest.approx(reference[rec["step"]], rel=1e-4), rec["step"]
    history = result["status"]["history"]
    recs = [e for e in history if e["kind"] == "recovery"]
    assert len(recs) == recoveries, f"{history}\n{story(job)}"
    for e in recs:
        assert (e["mode"], e["source"]) == ("inprocess", source), f"{e}\n{story(job)}"
        assert 0 <= e["lost_steps"] <= lost, f"{e}\n{story(job)}"
    return records


def test_dp3_loses_a_node_then_a_newcomer_joins_the_survivors_all_in_process(tmp_path):
    # The newcomer asks for its round once its warm worker has imported torch (the
    # survivors train meanwhile): enough steps that it comes before the end. It came at
    # step 161 and 193 of 200 on a 2-core box with another run or two busy loops beside it.
    # No worker failure allowed: the survivors' collectives fail first, but the lost node
    # uses no restart (the next world, formed without it, says so). The kill is fired by
    # node 1's rank at step 4's end: fired from outside, it lands wherever the workers are
    # when the run's loop sees step 4, which a loaded CI box once made step 8 (the world
    # of step 10 was then still dp3, and the test failed for the timing, not the path).
    job = make_job(tmp_path, "dp", steps=320,
                   restart={"mode": "inprocess", "scale_up": "immediate", "max_restarts": 0})  # fmt: skip
    result = run(job, 3, ["kill-node=1@step=4:phase=step-end", "add-node@step=6"])
    records = check_inprocess(tmp_path, job, result, recoveries=2)
    assert result["status"]["restarts"] == 0
    worlds = [r["world"] for r in records]
    assert worlds[3] == 3 and worlds[4] == 2 and worlds[-1] == 3, worlds
    assert [w for i, w in enumerate(worlds) if i == 0 or w != worlds[i - 1]] == [3, 2, 3]
    pids = round_pids(job)
    first, second, third = (pids[r] for r in sorted(pids))
    assert len(first) == 3 and second < first and len(second) == 2  # dp3 -> dp2: survivors
    assert second < third and len(third) == 3  # dp2 -> dp3: a newcomer joins them
    # Every box of a data-parallel replica stays: rank 0's state is its old memory, twice.
    kept = kept_mb(job)
    assert len(kept) == 2 and all(mb > 0 for mb in kept), f"{kept}\n{story(job)}"
    # The newcomer's worker was started warm, before its round formed: its log is the
    # warm one, and it holds the same process through the round (no second start).
    (newcomer_pid,) = third - second
    warm_logs = glob.glob(os.path.join(job.out_dir, "logs", "*", "warm", "node-3", "local-0.log"))
    assert len(warm_logs) == 1, os.listdir(os.path.join(job.out_dir, "logs"))
    assert newcomer_pid not in first


def run_cli(tmp_path, name: str, steps: int, fault: str, **extra) -> tuple[Any, dict, str]:
    """``elasticd run --json`` of a 2-node in-process job with ``fault``: the job, the
    final status it printed as one object, and its stderr."""
    job = make_job(tmp_path, name, steps=steps, **extra)
    path = tmp_path / f"{name}.json"
    path.write_text(json.dumps(job.to_dict()))
    r = subprocess.run(
        [sys.executable, "-m", "elasticd", "run", str(path), "--nodes", "2", "--json",
         "--fault", fault, "--timeout", "240"],
        capture_output=True, text=True, timeout=300, cwd=tmp_path,
    )  # fmt: skip
    assert r.returncode == 0, r.stderr[-3000:]
    return job, json.loads(r.stdout), r.stderr


def test_a_killed_worker_is_replaced_and_its_peers_go_on_in_process(tmp_path):
    """Through the CLI: ``elasticd run --json`` prints the final status as one object."""
    job, result, stderr = run_cli(tmp_path, "kw", 16, "kill-worker=1@step=5")
    assert "fault injected" in stderr
    check_inprocess(tmp_path, job, result, recoveries=1)
    pids = round_pids(job)
    first, second = (pids[r] for r in sorted(pids))
    assert len(first & second) == 1 and len(second) == 2  # rank 0's process went on
    # The replacement is the standby its node started while the first round trained
    # (restart.standby, default 1), not a process started after the kill.
    (replacement,) = second - first
    assert replacement in standby_pids(job), story(job)


def test_a_hung_worker_is_killed_and_its_peer_waiting_on_it_goes_on_in_process(tmp_path):
    """Rank 1 hangs (SIGSTOP) after step 5; rank 0 waits for it in the next step's
    collectives, with no progress either. Only the hung worker is killed after
    restart.hang_timeout: rank 0 said it waits on its peers, so its agent gives it longer,
    and the kill fails its collective at once. It keeps its process and its state, and the
    hung rank's replacement receives it: nothing trained twice. (Before, both agents saw no
    progress for hang_timeout and killed both: the state was gone.)"""
    restart = {"mode": "inprocess", "scale_up": "immediate", "hang_timeout": 4}
    job, result, _ = run_cli(tmp_path, "hw", 16, "hang-worker=1@step=5", restart=restart)
    check_inprocess(tmp_path, job, result, recoveries=1)
    pids = round_pids(job)
    first, second = (pids[r] for r in sorted(pids))
    assert len(first & second) == 1 and len(second) == 2, story(job)  # rank 0 went on
    failures = [e for e in result["status"]["history"] if e["kind"] == "failure"]
    assert any("rank 1: no progress" in e.get("detail", "") for e in failures), failures
    assert not any("rank 0: no progress" in e.get("detail", "") for e in failures), failures


def test_a_worker_hung_as_a_peer_node_dies_is_killed_alone_and_the_rest_go_on_in_process(
    tmp_path,
):
    """Node 1 dies and rank 2 hangs (SIGSTOP) at the same step: the survivors re-form, but
    the hung worker never leaves the round before. It was waited for 120 s
    (ROUND_BEGIN_TIMEOUT) and every worker was restarted from the checkpoint; now, past
    hang_timeout and the leave margin, it alone is killed, and its node's replacement takes
    the state from rank 0's memory. Both faults fire in step 5's step-end phase: fired from
    outside after the step, the kill could land first and rank 2 see its collective fail
    and go on in-process before the SIGSTOP (a CI run did), which is not the path here."""
    restart = {"mode": "inprocess", "scale_up": "immediate", "hang_timeout": 4}
    job = make_job(tmp_path, "stuck", steps=40, restart=restart)
    result = run(job, 3, ["hang-worker=2@step=5:phase=step-end",
                          "kill-node=1@step=5:phase=step-end"])  # fmt: skip
    history = result["status"]["history"]
    recs = [e for e in history if e["kind"] == "recovery"]
    assert recs and all(e["mode"] == "inprocess" for e in recs), f"{history}\n{story(job)}"
    failures = [e.get("detail", "") for e in history if e["kind"] == "failure"]
    assert not any("within 120 s" in f for f in failures), failures
    # The path under test: the hung worker was judged stuck in the round before.
    assert any("never took the round (stuck in the one before) within 19 s" in f
               for f in failures), f"{failures}\n{story(job)}"  # fmt: skip
    check_inprocess(tmp_path, job, result, recoveries=len(recs))


def test_rank_0_killed_after_a_steps_collectives_leaves_no_gap_in_the_metrics(tmp_path):
    """Rank 0 dies after step 5's last collective, before it writes step 5's record: its
    peer holds step 5, so the world resumes after it and nobody trains step 5 again. The
    new rank 0 (its node's standby) writes that record from its peer's copy: every step
    appears once in metrics.jsonl (a chaos soak lost one so, before)."""
    job, result, _ = run_cli(tmp_path, "r0", 12, "kill-worker=0@step=5:phase=step-end")
    (fault,) = result["faults"]
    assert "rank 0 SIGKILLed itself at step 5 in step-end" in fault["detail"], fault
    assert result["state"] == "succeeded", f"{result['reason']}\n{story(job)}"
    records = result["metrics"]
    assert [r["step"] for r in records] == list(range(1, 13)), story(job)
    reference = reference_losses(tmp_path, job)
    for rec in records:
        assert rec["loss"] == pytest.approx(reference[rec["step"]], rel=1e-4), rec["step"]
    assert records[4]["round"] == 1 and records[5]["round"] == 2, story(job)
    # Node 0's new worker (its standby) took rank 0; the state came from the peer that
    # kept its process, at step 5: nothing lost, and the recovery is in-process (node 0,
    # which records it, called it a process restart before: its own worker was new).
    (rec,) = [e for e in result["status"]["history"] if e["kind"] == "recovery"]
    assert (rec["mode"], rec["source"], rec["lost_steps"]) == ("inprocess", "peers", 0), rec
    assert "ckpt_load" not in rec["parts"] and "state_transfer" in rec["parts"], rec


def test_rank_0_frozen_after_a_steps_collectives_and_thawed_late_writes_no_stale_record(
    tmp_path,
):
    """Rank 0's node is SIGSTOPped after step 5's last collective, before rank 0 writes
    step 5's record, and thawed after the world moved on without it: the survivor's new
    round writes step 5 from its own copy and trains on. The thawed rank 0 then finishes
    its step: it must not write step 5 again (an in-process chaos soak found such a
    record, round 4's, after round 5's steps). The checkpoint fence names the newer round,
    so it writes nothing and says so."""
    job, result, _ = run_cli(tmp_path, "thawed", 16, "freeze-node=0@step=5:phase=step-end:for=8",
                             rendezvous={"ttl": 2, "settle": 2.0})  # fmt: skip
    assert result["state"] == "succeeded", f"{result['reason']}\n{story(job)}"
    records = result["metrics"]
    assert [r["step"] for r in records] == list(range(1, 17)), story(job)
    assert [r["round"] for r in records][:5] == [1] * 5 and records[5]["round"] > 1
    logs = "".join(
        Path(p).read_text(errors="replace")
        for p in glob.glob(os.path.join(job.out_dir, "logs", "**", "*.log"), recursive=True)
    )
    assert "step 5's record not written: this is round 1 of run " in logs, story(job)
    reference = reference_losses(tmp_path, job)
    for rec in records:
        assert rec["loss"] == pytest.approx(reference[rec["step"]], rel=1e-4), rec["step"]


def standby_pids(job) -> set[int]:
    """Every standby worker's pid, from the agents' "standby workers started" lines."""
    out: set[int] = set()
    for path in glob.glob(os.path.join(job.out_dir, "cluster", "agent-*.log")):
        with open(path, encoding="utf-8", errors="replace") as fh:
            for line in fh:
                if "standby workers started" in line:
                    out.update(int(p) for p in re.findall(r"\d+", line.split("pids=", 1)[1]))
    return out


@pytest.mark.parametrize(
    ("name", "nodes", "nproc", "parallel", "model", "before", "after"),
    [
        # One rank a node, and the node of rank 0 (tp0 of replica 0) dies. The re-formed
        # world is placed so that each survivor keeps what it holds (elasticd.layout.
        # keep_shards): replica 1's tp0 becomes rank 0, replica 0's tp1 stays tp1, and
        # nothing moves. (In plain node order all three survivors took another tp index
        # and every shard moved.)
        ("tp", 4, 1, {"tp": 2}, {}, (4, 2, 1, 2), (3, 2, 1, 1)),
        # pp is the slowest dimension: with 2 ranks a node, a node would hold a whole
        # stage. One rank a node: the dead node held one stage of one replica; the third
        # survivor is a spare in pp2 x dp1 (and serves what it holds).
        ("pp", 4, 1, {"pp": 2}, {}, (4, 1, 2, 2), (3, 1, 2, 1)),
        # A global batch of 8 so that 4 ranks are dp4 (ep2 x expert-dp2), not dp2 + spares.
        ("ep", 2, 2, {"ep": 2}, {"experts": 4, "top_k": 2}, (4, 1, 1, 4), (2, 1, 1, 2)),
    ],
)
def test_a_sharded_layout_loses_a_node_and_the_survivors_reshard_from_memory(
    tmp_path, name, nodes, nproc, parallel, model, before, after
):
    """tp2xdp2 -> tp2, pp2xdp2 -> pp2, ep2xdp2 -> ep2: the dead node held one whole
    data-parallel replica, so every shard the new layout needs is alive, but ranks move."""
    job = make_job(tmp_path, name, nproc=nproc, steps=10, parallel=parallel, model=model,
                   nodes={"min": 2 // nproc, "max": nodes}, batch=8 if name == "ep" else 12)  # fmt: skip
    result = run(job, nodes, [f"kill-node={0 if name == 'tp' else 1}@step=5"])
    records = check_inprocess(tmp_path, job, result, recoveries=1)
    shape = lambda r: (r["world"], r["tp"], r["pp"], r["dp"])  # noqa: E731
    assert shape(records[0]) == before and shape(records[-1]) == after
    pids = round_pids(job)
    first, second = (pids[r] for r in sorted(pids))
    assert second < first and len(second) == (nodes - 1) * nproc
    # The new rank 0 keeps its shard (pp: its stage), and adopts its old memory.
    assert [mb > 0 for mb in kept_mb(job)] == [True], f"{kept_mb(job)}\n{story(job)}"
    if name == "tp":  # placed: nothing moves
        logs = glob.glob(os.path.join(job.out_dir, "logs", "**", "*.log"), recursive=True)
        said = "".join(Path(p).read_text(encoding="utf-8", errors="replace") for p in logs)
        assert re.search(r"from peers at step \d+ \(0\.0 MB received", said), story(job)


@pytest.mark.parametrize("every", [0, 5], ids=["no-save", "save-step"])
def test_a_fault_that_splits_the_survivors_across_a_step_still_recovers_from_memory(
    tmp_path, every
):
    """ep2xdp2 -> ep2, where a fault parts the survivors at step 5: rank 1 applied its
    update, rank 0 did not (its collective failed under it after the step's last one had
    completed: ``fail-collective``, fired once node 1 is dead). Each survivor holds the only
    live copy of one expert shard, so no step was covered (CI found this, 1 run in 3).
    Rank 0 completes step 5 from its reduced gradients: source peers, 0 lost, the losses
    those of one process, and step 5's record, which rank 0 never wrote, from rank 1's.
    With a save at step 5, rank 1 is stopped in the save's first collective, before it
    reports the step: it kept the record as soon as its update was applied."""
    job = make_job(tmp_path, "split", nproc=2, steps=10, parallel={"ep": 2},
                   model={"experts": 4, "top_k": 2}, nodes={"min": 1, "max": 2}, batch=8,
                   checkpoint={"every": every})  # fmt: skip
    faults = ["kill-node=1@step=5:phase=update", "fail-collective=0@step=5:phase=update"]
    result = run(job, 2, faults)
    records = check_inprocess(tmp_path, job, result, recoveries=1)
    assert records[4]["round"] == 1 and records[5]["round"] == 2, story(job)
    logs = glob.glob(os.path.join(job.out_dir, "logs", "**", "*.log"), recursive=True)
    said = "".join(Path(p).read_text(encoding="utf-8", errors="replace") for p in logs)
    assert "rank 0: in-process recovery: completed step 5's update" in said, story(job)
    assert "rank 1: in-process recovery: completed" not in said, story(job)


def test_a_tp_shard_with_no_live_holder_comes_back_from_its_in_memory_replica(tmp_path):
    """tp2 on three nodes (the third a spare), ``memory_replicas: 1``: the killed node held
    a TP shard that no other rank holds. Its replica, kept in another node's memory, fills
    it: source replica, at most ``2 × memory_every`` (2) steps lost and recomputed, each step
    still once in metrics.jsonl, the losses those of one process."""
    job = make_job(tmp_path, "replica", steps=12, parallel={"tp": 2},
                   nodes={"min": 2, "max": 3},
                   checkpoint={"every": 0, "memory_replicas": 1, "memory_every": 1})  # fmt: skip
    result = run(job, 3, ["kill-node=1@step=5"])
    records = check_inprocess(
        tmp_path, job, result, recoveries=1, source="replica", lost=REPLICA_LOST
    )
    shape = lambda r: (r["world"], r["tp"], r["dp"])  # noqa: E731
    assert shape(records[0]) == (3, 2, 1) and shape(records[-1]) == (2, 2, 1)
    pids = round_pids(job)
    first, second = (pids[r] for r in sorted(pids))
    assert second < first and len(second) == 2


def test_a_newcomer_placed_at_node_rank_0_records_the_recovery(tmp_path):
    """tp2 on two nodes (``nodes.max: 2``) and a third agent added, which waits outside the
    world; the node of tp0 (node rank 0) dies. The survivor keeps tp1, so the newcomer
    takes position 0 and becomes node rank 0 (placement, ``elasticd.layout.keep_shards``),
    which is who records the recovery, though its agent never saw the failure. It reads
    the cause from the failed round's claim: the recovery is in the history (mode
    inprocess), from the replica of tp0 on the survivor."""
    job = make_job(tmp_path, "newrank0", steps=12, parallel={"tp": 2},
                   nodes={"min": 2, "max": 2},
                   checkpoint={"every": 0, "memory_replicas": 1, "memory_every": 1})  # fmt: skip
    result = run(job, 2, ["add-node@step=2", "kill-node=0@step=5"])
    check_inprocess(tmp_path, job, result, recoveries=1, source="replica", lost=REPLICA_LOST)
    assert result["status"]["nodes"][0] not in ("node-0", "node-1"), result["status"]["nodes"]
    history = result["status"]["history"]
    (rec,) = [e for e in history if e["kind"] == "recovery"]
    assert rec["reason"] in ("peer_lost", "worker_failed", "collective_failed"), rec


def test_bf16_zero1_loses_a_node_and_the_dead_ranks_rows_come_from_its_replica(tmp_path):
    """bf16 with ZeRO-1, dp3 -> dp2, ``memory_replicas: 1``: each rank holds only its rows
    of the fp32 main parameters and AdamW state, so the dead rank's rows come from their
    replica, and every survivor's rows change with dp. Rank 0's new trainer adopts what
    keeps its box (the bf16 model, whole on every rank), allocates its new rows, and the
    losses are still those of one process."""
    job = make_job(tmp_path, "zero", steps=12, parallel={"zero": 1},
                   train={"steps": 12, "global_batch": 12, "micro_batch": 2, "dtype": "bfloat16"},
                   checkpoint={"every": 0, "memory_replicas": 1, "memory_every": 1})  # fmt: skip
    result = run(job, 3, ["kill-node=1@step=5"])
    records = check_inprocess(
        tmp_path, job, result, recoveries=1, source="replica", lost=REPLICA_LOST
    )
    assert (records[0]["world"], records[-1]["world"]) == (3, 2)
    assert [mb > 0 for mb in kept_mb(job)] == [True], f"{kept_mb(job)}\n{story(job)}"


@pytest.mark.parametrize("sealed", [False, True], ids=["unsealed", "sealed"])
def test_without_replicas_a_lost_tp_shard_falls_back_to_the_checkpoint(tmp_path, sealed):
    """The same fault with ``memory_replicas: 0`` and a checkpoint every 4 steps: no live
    holder of the lost shard, so every rank resumes in-process from the checkpoint. Sealed
    (``checkpoint.key_file``): every step is saved sealed, and the fall back loads one with
    the key on every rank."""
    ckpt = {"every": 4}
    if sealed:
        from checkpoint.seal import key_id, read_key, write_new_key

        write_new_key(str(tmp_path / "key"))
        ckpt["key_file"] = str(tmp_path / "key")
    job = make_job(tmp_path, "noreplica", steps=12, parallel={"tp": 2},
                   nodes={"min": 2, "max": 3}, checkpoint=ckpt)  # fmt: skip
    result = run(job, 3, ["kill-node=1@step=6"])
    check_inprocess(tmp_path, job, result, recoveries=1, source="checkpoint", lost=3)
    if sealed:
        kid = key_id(read_key(str(tmp_path / "key")))
        manifests = glob.glob(os.path.join(job.ckpt_dir, "step-*", "manifest.json"))
        assert manifests, story(job)
        for m in manifests:
            assert json.loads(Path(m).read_text())["seal"]["key_id"] == kid, m


def flip_a_data_byte(step_dir: str) -> str:
    """Flip one byte in the middle of the tensor data of the step's largest safetensors
    file (its header and size unchanged: only a block's CRC and MAC can tell); returns
    the file's name."""
    files = glob.glob(os.path.join(step_dir, "*.safetensors"))
    path = max(files, key=os.path.getsize)
    with open(path, "r+b") as fh:
        header = int.from_bytes(fh.read(8), "little")
        where = 8 + header + (os.path.getsize(path) - 8 - header) // 2
        fh.seek(where)
        byte = fh.read(1)
        fh.seek(where)
        fh.write(bytes([byte[0] ^ 0xFF]))
    return os.path.basename(path)


class DamageTheNewestStepThenKill:
    """A fault source for ``run_cluster``: once step ``at`` is trained and the newest
    committed step is at least ``at - 4`` (an async save may still be in flight), flip a
    byte of that step's data, then SIGKILL node 1 at once."""

    def __init__(self, ckpt_dir: str, at: int) -> None:
        self.ckpt_dir, self.at = ckpt_dir, at
        self.damaged: int | None = None

    def due(self, view: Any) -> list[Any]:
        from checkpoint.store import committed_steps
        from elasticd.localcluster import parse_fault

        if self.damaged is not None or view.step < self.at:
            return []
        steps = committed_steps(self.ckpt_dir)
        if not steps or max(steps) < self.at - 4:
            return []
        self.damaged = max(steps)
        flip_a_data_byte(os.path.join(self.ckpt_dir, step_dirname(self.damaged)))
        return [parse_fault(f"kill-node=1@step={view.step}")]


def test_a_damaged_sealed_checkpoint_in_an_in_process_fall_back_is_passed_over(tmp_path):
    """The checkpoint fall back of the test above, with the newest sealed step damaged on
    disk (one data byte flipped after its commit) just before node 1 is SIGKILLed: every
    rank finds the block's MAC wrong, all of them fall back together to the step before it,
    in their own processes, and train on to the same losses as one process. The damaged
    step is recorded as unloadable, saved again when the run trains it again, and every
    step left on disk verifies."""
    from checkpoint.seal import read_key, write_new_key
    from checkpoint.store import commit_numbers, committed_steps, read_unloadable

    key = str(tmp_path / "key")
    write_new_key(key)
    job = make_job(tmp_path, "damaged", steps=16, parallel={"tp": 2},
                   nodes={"min": 2, "max": 3}, checkpoint={"every": 4, "key_file": key})  # fmt: skip
    source = DamageTheNewestStepThenKill(job.ckpt_dir, at=9)
    out = io.StringIO()
    result = run_cluster(job, nodes=3, faults=source, timeout=240, out=out)
    print(out.getvalue())
    assert source.damaged is not None and source.damaged >= 8, (source.damaged, story(job))
    resumed = source.damaged - job.checkpoint.every
    # Lost: the steps after the step it resumed from, up to the one the survivors finished.
    check_inprocess(tmp_path, job, result, recoveries=1, source="checkpoint",
                    lost=job.train.steps - resumed)  # fmt: skip
    (rec,) = [e for e in result["status"]["history"] if e["kind"] == "recovery"]
    assert rec["lost_steps"] >= source.damaged - resumed, f"{rec}\n{story(job)}"
    said = "\n".join(Path(p).read_text(encoding="utf-8", errors="replace")
                     for p in glob.glob(os.path.join(job.out_dir, "logs", "**", "*.log"),
                                        recursive=True))  # fmt: skip
    assert re.search(rf"step {source.damaged}\b.*(MAC|CRC|damaged|corrupt)", said), story(job)
    # Saved again on the retrained timeline; every step kept verifies with the key.
    steps = committed_steps(job.ckpt_dir)
    assert source.damaged in steps and job.train.steps in steps, steps
    failed = read_unloadable(job.ckpt_dir)  # the damaged commit, not the one saved again
    commits = commit_numbers(job.ckpt_dir, read_key(key), job.name)
    assert source.damaged in failed and failed[source.damaged] < commits[source.damaged], (
        failed, commits)  # fmt: skip
    for step in steps:
        r = subprocess.run(
            [sys.executable, "-m", "elasticd", "ckpt", "verify", job.ckpt_dir,
             "--step", str(step), "--key-file", key],
            capture_output=True, text=True, timeout=120,
        )  # fmt: skip
        assert r.returncode == 0, (step, r.stdout, r.stderr)


def test_a_second_node_killed_during_the_in_process_recovery_is_survived_in_process(tmp_path):
    """dp3: node 1 SIGKILLed at the end of step 5; node 2 SIGKILLed by its own rank as it
    enters the recovery from it (``phase=recover``: the world re-formed, the step agreed,
    no state moved yet). Node 0's rank is then inside that recovery with a peer gone: it
    leaves it, the world re-forms once more, and it goes on alone in its own process with
    its own state: no worker restarted, every step once, the same losses as one process."""
    job = make_job(tmp_path, "twice", steps=20)
    result = run(job, 3, ["kill-node=1@step=5:phase=step-end", "kill-node=2@step=5:phase=recover"])
    history = result["status"]["history"]
    fired = fired_faults(job, result, 2)
    # One recovery, the one that completed (round 2's failed before its first step).
    records = check_inprocess(tmp_path, job, result, recoveries=1)
    # The second fault landed in round 2's recovery: a third round formed.
    pids = round_pids(job)
    assert len(pids) == 3, f"{pids}\n{history}\n{story(job)}"
    assert result["status"]["restarts"] == 0, f"{history}\n{story(job)}"
    assert records[-1]["world"] == 1, records[-1]
    first, second, third = (pids[r] for r in sorted(pids))
    assert len(third) == 1 and third < second < first, f"{pids}\n{story(job)}"
    check_one_outage(result, fired)


def test_a_worker_killed_during_the_in_process_recovery_is_replaced_and_given_the_state(tmp_path):
    """dp3: node 1 SIGKILLed at the end of step 5; then the worker of node 2 (rank 1 of
    the re-formed world) SIGKILLed alone as it enters the recovery. Its agent replaces it
    with its standby (a new process, torch imported already), which holds nothing: node 0
    gives it the state of step 5 in the next round. One recovery, one outage from the
    first fault, no step lost, one worker restart counted; node 0's worker is the same
    process throughout."""
    job = make_job(tmp_path, "workerrecover", steps=30)
    result = run(job, 3, ["kill-node=1@step=5:phase=step-end",
                          "kill-worker=1@step=5:phase=recover"])  # fmt: skip
    history = result["status"]["history"]
    fired_faults(job, result, 2)
    records = check_inprocess(tmp_path, job, result, recoveries=1)
    assert result["status"]["restarts"] == 1, f"{history}\n{story(job)}"
    assert records[-1]["world"] == 2, records[-1]
    by_node = node_pids(job)
    # Node 0's worker throughout; node 2's replaced after round 2 by a new process. On a
    # loaded box node 2 may sit a round out while it replaces its worker (CI: rounds 1, 2
    # and 4, node 0 alone in round 3): the same outage, one attempt more.
    assert len(set(by_node[0].values())) == 1 and 1 in by_node[0], by_node
    assert by_node[2][1] == by_node[2][2], by_node
    last = by_node[2][max(by_node[2])]
    assert max(by_node[2]) > 2 and last != by_node[2][1], by_node
    assert last not in (by_node[0][1], by_node[1][1]), by_node
    (rec,) = [e for e in result["status"]["history"] if e["kind"] == "recovery"]
    assert rec["attempts"] >= 2 and rec["parts"]["failed_attempts"] > 0, rec


def test_a_worker_stopped_during_the_in_process_recovery_is_killed_at_the_hang_timeout(tmp_path):
    """dp3, restart.hang_timeout 5 s: node 1 SIGKILLed at the end of step 5; then the
    worker of node 2 (rank 1 of the re-formed world) SIGSTOPs itself as it enters the
    recovery, its agent alive. Node 0's rank waits on it in the transfer. Before, a worker
    with no step in its round was never judged, and the job stood still for the process
    group's 10-minute timeout (240 s here, then the test gave up). Now its agent judges it
    from its ``recovering`` mark and kills it at the hang timeout; node 0's rank, marked
    waiting (twice the bound), keeps its state and process, and the replacement is given
    the state of step 5: one outage, no step lost."""
    job = make_job(tmp_path, "stoppedrecover", steps=30,
                   restart={"mode": "inprocess", "scale_up": "immediate", "hang_timeout": 5})  # fmt: skip
    result = run(job, 3, ["kill-node=1@step=5:phase=step-end",
                          "hang-worker=1@step=5:phase=recover"])  # fmt: skip
    history = result["status"]["history"]
    fired = fired_faults(job, result, 2)
    check_inprocess(tmp_path, job, result, recoveries=1)
    (rec,) = [e for e in history if e["kind"] == "recovery"]
    assert rec["reason"] == "worker_hung" and rec["attempts"] == 2, rec
    assert result["status"]["restarts"] == 1, f"{history}\n{story(job)}"
    pids = round_pids(job)
    assert sorted(pids) == [1, 2, 3], f"{pids}\n{story(job)}"
    first, second, third = (pids[r] for r in sorted(pids))
    kept = second & third
    assert len(second) == len(third) == 2 and len(kept) == 1 and kept < first, pids
    check_one_outage(result, fired)


def test_a_node_frozen_during_the_in_process_recovery_is_left_behind_in_process(tmp_path):
    """dp3: node 1 SIGKILLed at the end of step 5; node 2 frozen (SIGSTOP of its agent
    and workers) as its rank enters the recovery from it, thawed 5 s later. Node 0's rank
    is then inside that recovery, waiting on a peer that neither answers nor closes its
    sockets, until node 2's lease expires. It leaves the recovery in its own process (not
    blocked until a stuck worker is killed, which would lose its state), re-forms alone
    with the state it holds and trains on. Node 2, thawed, finds the world moved on and
    joins again as a newcomer, in the same process, and is given the survivor's state.
    Every step once, the same losses as one process.

    A world of one process has no socket whose shutdown could end a step: before the
    trainer checked its round after each step, node 0 trained on alone past the scale-up
    that ended it (43 steps whose records were fenced off) until its final save failed
    its fence."""
    # Node 0 alone trains about 60 steps here between the lease's expiry and the thaw's
    # re-join (45 ms a step): the rest is margin for a faster box.
    job = make_job(tmp_path, "frozenrecover", steps=250)
    result = run(job, 3, ["kill-node=1@step=5:phase=step-end",
                          "freeze-node=2@step=5:phase=recover:for=5"])  # fmt: skip
    history = result["status"]["history"]
    fired_faults(job, result, 2)
    # The recovery into the world of node 0 alone, then node 2's return.
    records = check_inprocess(tmp_path, job, result, recoveries=2)
    assert result["status"]["restarts"] == 0, f"{history}\n{story(job)}"
    assert records[-1]["world"] == 2, f"{records[-1]}\n{story(job)}"
    pids = round_pids(job)
    assert sorted(pids) == [1, 2, 3, 4], f"{pids}\n{story(job)}"
    first, second, third, fourth = (pids[r] for r in sorted(pids))
    # Node 0's worker went through every round; node 2's came back in its own process.
    assert len(third) == 1 and third < second < first, f"{pids}\n{story(job)}"
    assert fourth == second, f"{pids}\n{story(job)}"
    first_rec, newcomer = (e for e in history if e["kind"] == "recovery")
    assert first_rec["attempts"] == 2 and newcomer["reason"] == "scale_up", history


def fired_faults(job, result, count: int) -> list[dict]:
    """The faults of ``result`` that fired (not skipped, a time), asserted ``count``."""
    fired = [f for f in result["faults"] if not f.get("skipped") and f.get("t") is not None]
    assert len(fired) == count, (result["faults"], story(job))
    return fired


def check_one_outage(result, fired) -> None:
    """The recovery that completed counts from the first fault's detection, the failed
    attempt a part of it."""
    (rec,) = [e for e in result["status"]["history"] if e["kind"] == "recovery"]
    assert rec["attempts"] == 2 and rec["parts"]["failed_attempts"] > 0, rec
    assert rec["seconds"] == pytest.approx(sum(rec["parts"].values()), abs=0.01), rec
    first_kill = min(f["t"] for f in fired)
    assert first_kill <= rec["detected_at"] < first_kill + 5, (first_kill, rec)


def test_a_tp_shards_last_holder_killed_during_the_in_process_recovery_falls_back_to_the_checkpoint(
    tmp_path,
):
    """tp2×dp2 on four nodes, a checkpoint every 4 steps: node 1 (tp shard 1 of one
    replica) SIGKILLed at the end of step 6; node 3, the last holder of that shard, SIGKILLed
    as it enters the recovery that was to send it. No live rank holds shard 1 any more:
    every rank falls back to the step-4 checkpoint together, in its own process, and trains
    on to the same losses as one process."""
    job = make_job(tmp_path, "lastholder", steps=12, parallel={"tp": 2},
                   nodes={"min": 2, "max": 4}, checkpoint={"every": 4, "async": False},
                   rendezvous={"ttl": 2, "settle": FIRST_WORLD_SETTLE, "reform_grace": 0.5})  # fmt: skip
    result = run(job, 4, ["kill-node=1@step=6:phase=step-end", "kill-node=3@step=6:phase=recover"])
    history = result["status"]["history"]
    fired = fired_faults(job, result, 2)
    # The recovery that completed took the checkpoint: steps 5 and 6 trained again.
    check_inprocess(tmp_path, job, result, recoveries=1, source="checkpoint", lost=2)
    (rec,) = [e for e in history if e["kind"] == "recovery"]
    assert rec["lost_steps"] == 2, f"{history}\n{story(job)}"
    assert result["status"]["restarts"] == 0, f"{history}\n{story(job)}"
    pids = round_pids(job)
    assert len(pids) == 3, f"{pids}\n{story(job)}"
    first, second, third = (pids[r] for r in sorted(pids))
    assert len(first) == 4 and len(third) == 2 and third < second < first, f"{pids}\n{story(job)}"
    check_one_outage(result, fired)


@pytest.mark.parametrize(
    ("nodes", "nproc", "parallel", "node", "source"),
    [(3, 1, {}, 1, "peers"), (3, 1, {}, 0, "peers"), (2, 2, {}, 1, "peers"),
     (3, 1, {"tp": 2}, 1, "checkpoint")],
    ids=["dp", "dp-rank0", "dp-2-per-node", "tp"],
)  # fmt: skip
def test_a_preempted_node_leaves_and_the_survivors_go_on_in_process(
    tmp_path, nodes, nproc, parallel, node, source
):
    """SIGTERM of node 1's agent (a preemption) at step 5: every rank agrees, the step is
    saved (the emergency checkpoint), node 1's workers exit, and the survivors leave the
    round with their state and take the next one in the same processes (before, they
    exited too and the world restarted every process from the checkpoint). dp3 -> dp2:
    their memory covers the new layout (source peers). tp2 on three nodes, the third a
    spare: node 1 held a TP shard nobody else holds, so they resume from the emergency
    checkpoint, at the step they stopped at. Either way nothing is lost or trained twice.
    Node 0 preempted takes rank 0 (the metrics writer, the round's store) with it; with
    two workers a node, each node's pair leaves together. The preempted node's workers
    exit with 75 on their own (not killed after restart.grace_period), the others wait."""
    # 20 steps: the fault fires when the cluster sees step 5, which a loaded CI run saw
    # only at step 10 of 12 (the ranks then stopped at the end, not before it).
    steps = 20
    # The first world must hold every node: the checks below are of one recovery, from it.
    # nodes.min is below the node count (the survivors must form a world without node 1),
    # so with settle 2 s a node whose agent joined late on a loaded box (0.4 s after round
    # 1 formed, once) missed it and came in by a scale-up: right, but a second recovery.
    # nodes.max is the node count, so the first round closes as soon as all have joined;
    # the long settle only waits for a late one. (A re-form skips settle: reform_grace.)
    job = make_job(tmp_path, "term", nproc=nproc, steps=steps, parallel=parallel,
                   nodes={"min": 1 if nproc > 1 else 2, "max": nodes},
                   batch=8 if nproc > 1 else 12,
                   rendezvous={"ttl": 2, "settle": FIRST_WORLD_SETTLE, "reform_grace": 0.5})  # fmt: skip
    result = run(job, nodes, [f"term-node={node}@step=5"])
    first_world = round_pids(job).get(1, set())
    assert len(first_world) == nodes * nproc, f"round 1: {first_world}\n{story(job)}"
    records = check_inprocess(tmp_path, job, result, recoveries=1, source=source)
    logs = glob.glob(os.path.join(job.out_dir, "logs", "**", "*.log"), recursive=True)
    said = "".join(Path(p).read_text(encoding="utf-8", errors="replace") for p in logs)
    assert said.count("preempted; the step is saved, exiting with 75") == nproc, story(job)
    waited = said.count("(a peer node is preempted; the step is saved); waiting")
    assert waited == (nodes - 1) * nproc, story(job)
    # The ranks stop at the end of the first step after the signal reached node 1's worker.
    stop = sum(1 for r in records if r["round"] == 1)
    assert 5 <= stop < steps and {r["round"] for r in records[stop:]} == {2}, story(job)
    (rec,) = [e for e in result["status"]["history"] if e["kind"] == "recovery"]
    assert rec["reason"] == "preempted" and rec["lost_steps"] == 0, rec
    assert os.path.isdir(os.path.join(job.ckpt_dir, step_dirname(stop))), os.listdir(job.ckpt_dir)
    pids = round_pids(job)
    first, second = (pids[r] for r in sorted(pids))
    assert second < first and len(second) == (nodes - 1) * nproc, story(job)  # the survivors


def test_a_preempted_spare_leaves_at_once_and_the_active_ranks_go_on_in_process(tmp_path):
    """tp2 on three nodes: node 2 holds the spare rank, which takes no part in the active
    ranks' agreement. Preempted, it leaves at once with 75 (it used to wait for
    restart.grace_period's SIGKILL), and the active ranks re-form without it, in their
    processes, with their state."""
    job = make_job(tmp_path, "spare", steps=12, parallel={"tp": 2}, nodes={"min": 2, "max": 3})
    result = run(job, 3, ["term-node=2@step=5"])
    check_inprocess(tmp_path, job, result, recoveries=1)
    logs = glob.glob(os.path.join(job.out_dir, "logs", "**", "*.log"), recursive=True)
    said = "".join(Path(p).read_text(encoding="utf-8", errors="replace") for p in logs)
    assert "rank 2: preempted; a spare, leaving, exiting with 75" in said, story(job)
    pids = round_pids(job)
    first, second = (pids[r] for r in sorted(pids))
    assert second < first and len(second) == 2, story(job)


@pytest.mark.parametrize("mode", ["process", "inprocess"])
def test_a_node_restarted_under_its_id_within_a_ttl_is_a_lost_node_not_a_failure(tmp_path, mode):
    """Node 1's agent and workers SIGKILLed and its agent started again at once, under
    its id: it re-joined before its old lease expired, so the next world had the same
    nodes, nothing was relabelled, and the survivor's failed worker counted as a failure
    (worker_failed, one of restart.max_restarts; in-process, the probe's refusal already
    left it out of one world). Joins now carry the agent process's incarnation: a member
    back as another process was lost."""
    job = make_job(tmp_path, "reboot", steps=16, nodes={"min": 1, "max": 2},
                   restart={"mode": mode, "scale_up": "immediate"},
                   rendezvous={"ttl": 10, "settle": 2.0, "reform_grace": 0.5})  # fmt: skip
    result = run(job, 2, ["restart-node=1@step=5"])
    assert result["state"] == "succeeded", f"{result['reason']}\n{story(job)}"
    status = result["status"]
    failures = [e for e in status["history"] if e["kind"] == "failure"]
    assert failures and {e["reason"] for e in failures} == {"peer_lost"}, failures
    assert status.get("restarts", 0) == 0, status
    steps = [r["step"] for r in result["metrics"]]
    assert steps[-1] == 16 and (mode == "process" or steps == list(range(1, 17))), story(job)
    reference = reference_losses(tmp_path, job)
    for rec in result["metrics"]:
        assert rec["loss"] == pytest.approx(reference[rec["step"]], rel=1e-4), rec["step"]


def test_a_frozen_node_and_a_preempted_one_do_not_hold_the_survivor_for_the_grace_period(
    tmp_path,
):
    """Node 2 frozen and node 1 preempted at the same step: node 1's workers cannot save
    (their agreement waits on the frozen node), so its agent waits for them up to
    restart.grace_period with its join alive, and node 0's re-form (once node 2's lease
    expired) waited for it all that time: 28 s in a chaos run. Its agent now marks its
    join leaving first, and node 0 re-forms alone at once: a world of node 0 only, which
    cannot form once node 2 has thawed (at 15 s) unless it formed before node 1's agent
    left (at the 40 s grace). Then node 2 joins again as a newcomer."""
    job = make_job(tmp_path, "frozenterm", steps=16,
                   restart={"mode": "inprocess", "scale_up": "immediate", "grace_period": 40})  # fmt: skip
    result = run(job, 3, ["freeze-node=2@step=5:phase=step-end:for=15",
                          "term-node=1@step=5:phase=step-end"])  # fmt: skip
    assert result["state"] == "succeeded", f"{result['reason']}\n{story(job)}"
    assert [r["step"] for r in result["metrics"]] == list(range(1, 17)), story(job)
    worlds = [r["world"] for r in result["metrics"]]
    assert 1 in worlds, f"{worlds}\n{story(job)}"
    reference = reference_losses(tmp_path, job)
    for rec in result["metrics"]:
        assert rec["loss"] == pytest.approx(reference[rec["step"]], rel=1e-4), rec["step"]


def test_a_frozen_node_is_left_behind_in_process_and_comes_back_as_a_newcomer(tmp_path):
    """SIGSTOP of a whole node: the survivors' collectives block on it until its lease
    expires (rendezvous.ttl); then their agents end the round, the workers shut the round's
    sockets and leave the blocked collective, and the world re-forms without it. Thawed,
    the node finds the world moved on (fenced) and joins again as a newcomer."""
    job = make_job(tmp_path, "frozen", steps=60)
    result = run(job, 3, ["freeze-node=2@step=5:for=6"])
    assert result["state"] == "succeeded", result["reason"]
    records = result["metrics"]
    assert [r["step"] for r in records] == list(range(1, 61))
    reference = reference_losses(tmp_path, job)
    for rec in records:
        assert rec["loss"] == pytest.approx(reference[rec["step"]], rel=1e-4), rec["step"]
    recs = [e for e in result["status"]["history"] if e["kind"] == "recovery"]
    assert recs and recs[0]["mode"] == "inprocess" and recs[0]["source"] == "peers", recs
    assert recs[0]["lost_steps"] == 0
    pids = round_pids(job)
    first, second = (pids[r] for r in sorted(pids)[:2])
    assert second < first and len(second) == 2


def _ddp_reference(tmp_path, script: str, knobs: dict[str, str]) -> dict[int, float]:
    """The DDP example's losses in one process, without elasticd."""
    ref_log = tmp_path / "ref.jsonl"
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "MASTER_ADDR")}
    r = subprocess.run([sys.executable, script], env={**env, **knobs, "DDP_LOG": str(ref_log)},
                       capture_output=True, text=True, timeout=120)  # fmt: skip
    assert r.returncode == 0, r.stderr[-2000:]
    return {rec["step"]: rec["loss"] for rec in map(json.loads, ref_log.read_text().splitlines())}


def test_a_hung_rank_of_a_ddp_script_is_killed_alone_and_its_peers_go_on_in_process(tmp_path):
    """A plain DDP script's ranks wait for a hung peer inside DDP's backward, which no
    ``wait_collective`` of ours marks: every rank looked hung at once, every agent killed
    its worker at restart.hang_timeout, and the job restarted from nothing (the adoption
    review: "[process, from none, lost steps 8]"). The control watcher now marks a main
    thread idle in a collective as waiting, so only the hung rank is killed, and the
    survivor recovers in-process and hands its replacement the state."""
    script = os.path.join(
        os.path.dirname(os.path.dirname(__file__)), "examples", "ddp_inprocess.py"
    )
    steps = 40
    knobs = {"DDP_STEPS": str(steps), "DDP_STEP_SLEEP": "0.02"}
    reference = _ddp_reference(tmp_path, script, knobs)
    job = make_job(tmp_path, "ddph", steps=steps, command=[sys.executable, script],
                   restart={"mode": "inprocess", "hang_timeout": 4})  # fmt: skip
    os.environ.update(knobs)  # the agents' environment reaches the workers
    try:
        result = run(job, 2, ["hang-worker=1@step=10"])
    finally:
        for k in knobs:
            del os.environ[k]
    assert result["state"] == "succeeded", f"{result['reason']}\n{story(job)}"
    failures = [e for e in result["status"]["history"] if e["kind"] == "failure"]
    assert any("rank 1: no progress" in e.get("detail", "") for e in failures), failures
    assert not any("rank 0: no progress" in e.get("detail", "") for e in failures), failures
    recs = [e for e in result["status"]["history"] if e["kind"] == "recovery"]
    assert [(e["mode"], e["source"], e["lost_steps"]) for e in recs] == [
        ("inprocess", "peers", 0)
    ], recs
    records = [json.loads(line) for line in (tmp_path / "ddph" / "metrics.jsonl").open()]
    assert [rec["step"] for rec in records] == list(range(1, steps + 1))
    for rec in records:
        assert rec["loss"] == pytest.approx(reference[rec["step"]], rel=1e-5, abs=1e-7)
    pids = round_pids(job)
    first, second = (pids[r] for r in sorted(pids))
    assert len(first & second) == 1, story(job)  # rank 0's process went on


def test_slow_teardown_after_the_last_step_is_no_hang_and_the_job_is_not_trained_again(
    tmp_path,
):
    """Once ``ei.run`` returned, a rank only tears down and exits. A clean-clone run with
    three pytest workers on 2 cores had both ranks of the DDP example take over
    restart.hang_timeout (4 s) to do so after step 40: rank 0 was killed as hung, and the
    job was trained again from step 0 (``[process, from none, lost steps 40]``). Here each
    rank stays 10 s after ``ei.run`` returned, past twice hang_timeout: the job succeeds
    with no failure, and every step is trained once."""
    script = os.path.join(
        os.path.dirname(os.path.dirname(__file__)), "examples", "ddp_inprocess.py"
    )
    wrapper = tmp_path / "slow_exit.py"
    wrapper.write_text(
        f"import runpy, time\nrunpy.run_path({script!r}, run_name='__main__')\ntime.sleep(10)\n"
    )
    steps = 12
    job = make_job(tmp_path, "slowexit", steps=steps, command=[sys.executable, str(wrapper)],
                   restart={"mode": "inprocess", "hang_timeout": 3})  # fmt: skip
    os.environ["DDP_STEPS"] = str(steps)
    try:
        result = run(job, 2, [])
    finally:
        del os.environ["DDP_STEPS"]
    assert result["state"] == "succeeded", f"{result['reason']}\n{story(job)}"
    history = result["status"]["history"]
    assert [e for e in history if e["kind"] in ("failure", "recovery")] == [], history
    assert result["status"]["restarts"] == 0
    records = [json.loads(line) for line in (tmp_path / "slowexit" / "metrics.jsonl").open()]
    assert [rec["step"] for rec in records] == list(range(1, steps + 1))


def run_example(tmp_path, name: str, script: str, steps: int, knobs: dict, faults: list[str],
                **extra):  # fmt: skip
    """An example script alone (its reference losses, which it logs to the file named by
    ``<PREFIX>_LOG``, the knobs' prefix) and as a 3-node in-process job through
    ``faults`` (``extra``: more of the job's keys); the job's result, once it succeeded with
    every step recorded once, each loss equal to the script alone's within fp32 round-off."""
    script = os.path.join(os.path.dirname(os.path.dirname(__file__)), "examples", script)
    ref_log = tmp_path / "ref.jsonl"
    log_var = next(iter(knobs)).split("_")[0] + "_LOG"
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "MASTER_ADDR")}
    r = subprocess.run([sys.executable, script], env={**env, **knobs, log_var: str(ref_log)},
                       capture_output=True, text=True, timeout=120)  # fmt: skip
    assert r.returncode == 0, r.stderr[-2000:]
    reference = {
        rec["step"]: rec["loss"] for rec in map(json.loads, ref_log.read_text().splitlines())
    }
    assert sorted(reference) == list(range(1, steps + 1))
    job = make_job(tmp_path, name, steps=steps, command=[sys.executable, script], **extra)
    os.environ.update(knobs)  # the agents' environment reaches the workers
    try:
        result = run(job, 3, faults)
    finally:
        for k in knobs:
            del os.environ[k]
    assert result["state"] == "succeeded", f"{result['reason']}\n{story(job)}"
    assert not [f for f in result["faults"] if f.get("skipped")], result["faults"]
    # The script's channel.record wrote them (where elasticd run reads steps and losses).
    records = [json.loads(line) for line in (tmp_path / name / "metrics.jsonl").open()]
    assert [rec["step"] for rec in records] == list(range(1, steps + 1))
    for rec in records:
        assert rec["loss"] == pytest.approx(reference[rec["step"]], rel=1e-5, abs=1e-7)
    return job, result


def test_the_ddp_example_survives_a_killed_node_in_process_and_matches_one_process(tmp_path):
    """examples/ddp_inprocess.py: a plain DDP script with the elasticd lines, dp3 -> dp2,
    then a killed worker whose replacement (a new process: a script of its own has no
    standby) receives the model, AdamW's state and the warm-up scheduler's position from
    the survivor (before the review fix, a newcomer's made-up optimizer state and its
    scheduler at step 0 would have trained on differently)."""
    # Steps of 20 ms: step-keyed faults fire when the agents see the step, and a step of
    # this script takes a millisecond (once, loaded CI saw step 10's fault land at step
    # 30, too late for a second fault at step 25 of 40).
    job, result = run_example(tmp_path, "ddp", "ddp_inprocess.py", 100,
                              {"DDP_STEPS": "100", "DDP_STEP_SLEEP": "0.02"},
                              ["kill-node=1@step=10", "kill-worker=1@step=60"])  # fmt: skip
    recs = [e for e in result["status"]["history"] if e["kind"] == "recovery"]
    assert [e["mode"] for e in recs] == ["inprocess", "inprocess"], recs
    pids = round_pids(job)
    first, second, *later = (pids[r] for r in sorted(pids))
    assert second < first and len(second) == 2
    # The killed worker's replacement is a new process beside rank 0's, which went on.
    assert len(later[-1]) == 2 and len(later[-1] & second) == 1, pids


def test_the_ddp_example_on_a_batch_its_worlds_do_not_divide_still_trains_as_one_process(
    tmp_path,
):
    """examples/ddp_inprocess.py with a global batch of 10: dp3 splits it 4/3/3, and after
    the kill dp2 splits it 5/5. ``ElasticBatchSampler`` gives each step the same ten
    samples in both worlds, and ``share()`` weights each rank's mean loss so that DDP's
    average of the gradients is the whole batch's: every loss equals the script alone's
    (one process, all ten) within fp32 round-off (``run_example``). Without the weight the
    dp3 steps would train on a batch mean that over-weights the ranks of three."""
    job, result = run_example(tmp_path, "ddpuneven", "ddp_inprocess.py", 40,
                              {"DDP_STEPS": "40", "DDP_BATCH": "10", "DDP_STEP_SLEEP": "0.02"},
                              ["kill-node=1@step=10"])  # fmt: skip
    records = [json.loads(line) for line in (tmp_path / "ddpuneven" / "metrics.jsonl").open()]
    assert {r["world"] for r in records} == {3, 2}, story(job)
    recs = [e for e in result["status"]["history"] if e["kind"] == "recovery"]
    assert [e["mode"] for e in recs] == ["inprocess"], recs


def test_the_ddp_example_left_alone_leaves_its_round_when_a_thawed_node_joins(tmp_path):
    """examples/ddp_inprocess.py, dp3: node 1 killed, then node 2 frozen for 4 s. Node 0
    trains alone (a world of one process, whose collectives touch no socket) until node 2
    thaws and joins again: the scale-up ends node 0's round, and the script's
    ``ei.check_results()`` leaves it at its next step, where before it trained on alone to
    the end while the newcomer waited, its records fenced off. Node 2 comes back in its own
    process and trains the last steps beside it."""
    job, result = run_example(tmp_path, "ddpalone", "ddp_inprocess.py", 300,
                              {"DDP_STEPS": "300", "DDP_STEP_SLEEP": "0.02"},
                              ["kill-node=1@step=10", "freeze-node=2@step=30:for=4"])  # fmt: skip
    recs = [e for e in result["status"]["history"] if e["kind"] == "recovery"]
    assert [e["mode"] for e in recs] == ["inprocess"] * 3, recs
    assert recs[-1]["reason"] == "scale_up", recs
    pids = round_pids(job)
    rounds = sorted(pids)
    assert len(rounds) == 4, f"{pids}\n{story(job)}"
    records = [json.loads(line) for line in (tmp_path / "ddpalone" / "metrics.jsonl").open()]
    assert 1 in {r["world"] for r in records} and records[-1]["world"] == 2, story(job)
    # Node 2's worker went through rounds 1, 2 and 4 in one process, node 0's through all.
    assert pids[rounds[3]] == pids[rounds[1]] and len(pids[rounds[2]]) == 1, pids


def test_a_script_that_only_records_its_steps_leaves_its_round_when_a_node_joins_it(
    tmp_path, monkeypatch
):
    """A script alone in its world (one node; its collectives touch no socket) that
    neither calls ``ctx.check()`` nor ``check_results()`` but reports each step with
    ``channel.record``: the agent ends its round when a node is added, and ``record``
    raises ``RoundAborted`` there, the step done and recorded. Before, it trained on alone
    to its last step while the newcomer waited (the world never grew to two). Every step
    once, each loss as the closed form says, one in-process recovery, one process."""
    script = os.path.join(os.path.dirname(__file__), "inprocess_records_only.py")
    steps = 300
    monkeypatch.setenv("RECORDS_STEPS", str(steps))
    job = make_job(tmp_path, "recordsonly", steps=steps, command=[sys.executable, script])
    result = run(job, 1, ["add-node@step=5"])
    assert result["state"] == "succeeded", f"{result['reason']}\n{story(job)}"
    records = [json.loads(line) for line in (tmp_path / "recordsonly" / "metrics.jsonl").open()]
    assert [r["step"] for r in records] == list(range(1, steps + 1)), story(job)
    for r in records:
        s = r["step"]
        assert r["loss"] == pytest.approx(-0.08 * s * (s + 1) / 2, rel=1e-6), r
    recs = [e for e in result["status"]["history"] if e["kind"] == "recovery"]
    assert [(e["mode"], e["reason"]) for e in recs] == [("inprocess", "scale_up")], recs
    assert records[-1]["world"] == 2, f"{records[-1]}\n{story(job)}"
    pids = node_pids(job)
    assert len(set(pids[0].values())) == 1, pids  # node 0: one process through both rounds


def test_a_script_that_hands_its_state_over_as_at_no_step_fails_the_job_as_a_user_error(
    tmp_path, monkeypatch
):
    """A script that trained but passes ``step=None`` to ``sync_state`` (it never kept its
    step in ``ctx.state``): nothing moved, the survivors trained on from step 0 with their
    trained weights while a newcomer started fresh, and the job "succeeded" with replicas
    apart. Now ``sync_state`` refuses it (``MisuseError``) and the process exits with the
    user-error code: the job fails at once, in one line (a TypeError before: exit 1, and
    the agent restarted it until its restarts were spent)."""
    script = os.path.join(os.path.dirname(__file__), "inprocess_records_only.py")
    monkeypatch.setenv("RECORDS_STEPS", "300")
    monkeypatch.setenv("RECORDS_FORGET_STEP", "1")
    job = make_job(tmp_path, "forgetstep", steps=300, command=[sys.executable, script])
    result = run(job, 1, ["add-node@step=5"])
    assert result["state"] == "failed", f"{result['reason']}\n{story(job)}"
    reason = result["reason"]
    assert "user error (exit code 2)" in reason, reason
    assert "sync_state: step=None, but this process trained to step " in reason, reason
    assert result["status"]["furthest_step"] < 300, "it stopped there, and did not train on"


@pytest.mark.slow  # eight jobs, about 2 minutes on the 2-core box
def test_a_ddp_script_with_batchnorm_survives_preemption_after_preemption_in_process(
    tmp_path, monkeypatch
):
    """A DDP script with BatchNorm, a node preempted at step 6, eight times over: each
    job succeeds with one in-process recovery from peers and no worker restarted. Before
    the round's groups were held past the round (docs/inprocess.md, "Which thread destroys
    a gloo group"), 3 of 13 such runs deadlocked in the group's destructor, until
    hang_timeout (here 20 s) killed the worker: a process restart, and with no checkpoint
    the job trained again from step 0. And 5 of 5 runs of the first fix aborted at exit
    ("terminate called without an active exception"), a process restart too."""
    script = os.path.join(os.path.dirname(__file__), "inprocess_ddp_batchnorm.py")
    monkeypatch.setenv("BN_STEPS", "16")
    for i in range(8):
        job = make_job(tmp_path, f"bn{i}", steps=16, command=[sys.executable, script],
                       restart={"mode": "inprocess", "hang_timeout": 20})  # fmt: skip
        result = run(job, 3, ["term-node=2@step=6"])
        assert result["state"] == "succeeded", f"{result['reason']}\n{story(job)}"
        recs = [e for e in result["status"]["history"] if e["kind"] == "recovery"]
        assert [(e["mode"], e["source"]) for e in recs] == [("inprocess", "peers")], (
            f"run {i}: {recs}\n{story(job)}"
        )
        assert result["status"]["restarts"] == 0, f"run {i}\n{story(job)}"


def test_the_ddp_example_survives_a_second_node_killed_during_its_recovery(tmp_path):
    """examples/ddp_inprocess.py, dp3: node 1 killed once step 10 is done (it lands in some
    later step, wherever the workers are), then node 2 killed as its rank enters the
    recovery that follows, inside
    ``ctx.sync_state`` (``phase=recover`` fires at the first recovery at step 10 or later:
    the step the survivors agree on depends on where the first kill landed). Node 0 leaves
    that recovery and goes on alone in its own process: one outage, no step lost."""
    job, result = run_example(tmp_path, "ddprecover", "ddp_inprocess.py", 100,
                              {"DDP_STEPS": "100", "DDP_STEP_SLEEP": "0.02"},
                              ["kill-node=1@step=10", "kill-node=2@step=10:phase=recover"])  # fmt: skip
    fired = fired_faults(job, result, 2)
    (rec,) = [e for e in result["status"]["history"] if e["kind"] == "recovery"]
    assert (rec["mode"], rec["source"], rec["lost_steps"]) == ("inprocess", "peers", 0), rec
    check_one_outage(result, fired)
    pids = round_pids(job)
    assert sorted(pids) == [1, 2, 3], f"{pids}\n{story(job)}"
    first, second, third = (pids[r] for r in sorted(pids))
    assert len(third) == 1 and third < second < first, f"{pids}\n{story(job)}"


def test_the_fsdp2_example_survives_a_killed_node_and_worker_in_process_and_matches_one_process(
    tmp_path,
):
    """examples/fsdp2_inprocess.py: fully_shard's DTensors cannot be synced (refused), so
    the script hands over a whole copy of its state and shards a fresh model each round:
    dp3 -> dp2 (the survivors' copies), then a killed worker whose new process receives
    the copy; every step once, each loss equal to the script alone within fp32 round-off."""
    job, result = run_example(tmp_path, "fsdp", "fsdp2_inprocess.py", 30,
                              {"FSDP_STEPS": "30", "FSDP_STEP_SLEEP": "0.05"},
                              ["kill-node=1@step=8", "kill-worker=1@step=18"])  # fmt: skip
    recs = [e for e in result["status"]["history"] if e["kind"] == "recovery"]
    assert [(e["mode"], e["source"], e["lost_steps"]) for e in recs] == [
        ("inprocess", "peers", 0),
        ("inprocess", "peers", 0),
    ], f"{recs}\n{story(job)}"


def test_a_script_that_crashes_every_time_fails_the_job_in_process_too(tmp_path):
    """A worker that exits 1 at once, on every node, every round (an import error). Its
    agent backs off before its node re-joins (a crash loop), so the others re-form without
    it; that node was taken for a lost one, which uses no restart, so the job re-formed for
    ever (98 rounds in 5 minutes before the fix, found by a newcomer's walk through the
    README with a job whose ``python`` had no torch). A node whose own worker ended the
    round is not lost: the failure counts, and the restart limit ends the job."""
    job = make_job(tmp_path, "crash", command=[sys.executable, "-c", "raise SystemExit(1)"],
                   restart={"mode": "inprocess", "max_restarts": 2})  # fmt: skip
    result = run(job, 3, [])
    assert result["state"] == "failed", result["reason"]
    assert "restart limit reached (2)" in result["reason"], result["reason"]
    history = result["status"]["history"]
    failures = [e for e in history if e.get("reason") in ("worker_failed", "peer_lost")]
    assert all(e["reason"] == "worker_failed" for e in failures), failures


def _threads_and_sockets(pid: int) -> tuple[int, int]:
    with open(f"/proc/{pid}/status", encoding="utf-8") as fh:
        threads = next(int(ln.split()[1]) for ln in fh if ln.startswith("Threads:"))
    fds = os.listdir(f"/proc/{pid}/fd")
    sockets = 0
    for fd in fds:
        with contextlib.suppress(OSError):  # closed meanwhile
            sockets += os.readlink(f"/proc/{pid}/fd/{fd}").startswith("socket:")
    return threads, sockets


def test_a_survivor_keeps_no_thread_or_socket_of_the_rounds_it_left(tmp_path):
    """Rank 0's process lives through one recovery after another (another rank's worker
    is killed each time, its standby adopted). Each round's groups hold gloo's threads and sockets: a
    round that ended must let go of them by the end of the round after it (``run`` holds
    them that long: docs/inprocess.md, "Which thread destroys a gloo group"), not at the
    next full garbage collection (the trainer and its checkpointing referred to each other, so every old
    round's model and groups stayed until one: 7 threads and 4 sockets more per round)."""
    from polling import wait_for

    from elasticd.etcd import connect
    from elasticd.jobs import JobRegistry
    from elasticd.localcluster import LocalCluster, read_metrics

    job = make_job(tmp_path, "survivor", steps=100_000)
    metrics = os.path.join(job.out_dir, "metrics.jsonl")

    def newest_round() -> int:
        return max((r["round"] for r in read_metrics(metrics)), default=0)

    seen = []
    with LocalCluster(base_dir=str(tmp_path / "c"), nproc=1) as c:
        c.start(3)
        with connect(c.etcd.client_config()) as client:
            wait_for(lambda: len(client.get_prefix("/elasticd/nodes/")[0]) == 3, timeout=60)
            reg = JobRegistry(client)
            reg.submit(job)
            wait_for(lambda: newest_round() == 1 and len(read_metrics(metrics)) >= 3, timeout=120)
            survivor = c.worker_pids(0)[0]
            for _ in range(4):
                before = newest_round()
                # Another rank's worker (ranks are re-labelled if a node re-joins late).
                ranks = {r: p for i in c.alive_nodes() for r, p in c.worker_pids(i).items()}
                c.kill_worker(max(r for r, p in ranks.items() if p != survivor))
                wait_for(lambda b=before: newest_round() > b, timeout=90)
                # Some steps into the new round: its groups are up, the old ones let go.
                wait_for(lambda: sum(r["round"] == newest_round() for r in read_metrics(metrics))
                         >= 5, timeout=60)  # fmt: skip
                held = {p for i in c.alive_nodes() for p in c.worker_pids(i).values()}
                assert survivor in held, story(job)  # the same process went on
                seen.append(_threads_and_sockets(survivor))
            reg.cancel(job.name)
    (t1, s1), (t4, s4) = seen[0], seen[-1]
    assert t4 <= t1 + 2 and s4 <= s1 + 2, f"threads, sockets after each recovery: {seen}"


def test_two_in_process_jobs_on_the_same_agents_recover_apart(tmp_path):
    """Two jobs share two agents (two slots each), each with its own control files, warm
    and standby workers, rendezvous, store and probe ports. One of job a's workers is
    killed: a recovers in-process from its peers, b never notices (no re-form), and a's
    losses equal b's step for step (the same job, the same seed, dp2 in every round)."""
    import signal

    from polling import wait_for

    from elasticd.etcd import connect
    from elasticd.jobs import JobRegistry
    from elasticd.localcluster import LocalCluster, read_metrics

    jobs = {n: make_job(tmp_path, n, steps=120, nodes={"min": 1, "max": 2}) for n in "ab"}
    metrics = {n: os.path.join(j.out_dir, "metrics.jsonl") for n, j in jobs.items()}
    with LocalCluster(base_dir=str(tmp_path / "c"), nproc=2) as c:
        c.start(2)
        with connect(c.etcd.client_config()) as client:
            wait_for(lambda: len(client.get_prefix("/elasticd/nodes/")[0]) == 2, timeout=60)
            reg = JobRegistry(client)
            for j in jobs.values():
                reg.submit(j)
            wait_for(lambda: all(len(read_metrics(m)) >= 10 for m in metrics.values()),
                     timeout=180)  # fmt: skip
            # Job a's worker on node 1, from its round's record (each job has its own).
            pattern = os.path.join(c.state_dir(1), "jobs", "a-*", "round-1", "workers.json")
            (path,) = glob.glob(pattern)
            with open(path, encoding="utf-8") as fh:
                (victim,) = json.load(fh).values()
            os.kill(victim, signal.SIGKILL)
            finals = {n: wait_for(lambda n=n: (r := reg.get(n)) and r.state.terminal and r,
                                  timeout=240) for n in jobs}  # fmt: skip
    assert all(f.state == "succeeded" for f in finals.values()), {
        n: f.reason for n, f in finals.items()
    }
    recoveries = {n: [e for e in f.status["history"] if e.get("kind") == "recovery"]
                  for n, f in finals.items()}  # fmt: skip
    assert [(e["mode"], e["source"], e["lost_steps"]) for e in recoveries["a"]] == [
        ("inprocess", "peers", 0)
    ], story(jobs["a"])
    assert recoveries["b"] == [] and finals["b"].status["round"] == 1
    records = {n: read_metrics(m) for n, m in metrics.items()}
    for n in jobs:  # every step once: no rollback in a, nothing trained twice
        assert sorted(r["step"] for r in records[n]) == list(range(1, 121)), n
    losses = {n: {r["step"]: r["loss"] for r in rs} for n, rs in records.items()}
    for step, loss in losses["b"].items():
        assert abs(losses["a"][step] - loss) <= 1e-4, (step, losses["a"][step], loss)
