"""`elasticd run` refuses what can never work before it starts anything, and `--fresh`
deletes only an output dir that elasticd made.

Refusals run the real command line in-process (they happen before any process starts);
the runs that need a cluster start a real one on tests/agent_worker.py.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from elasticd.cli import main
from elasticd.localcluster import OUTPUT_MARKER, prepare_output_dir

WORKER = os.path.join(os.path.dirname(__file__), "agent_worker.py")
EXAMPLES = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples")


def write_job(path, **fields) -> str:
    raw = {
        "name": "cli",
        "command": [sys.executable, WORKER],
        "train": {"steps": 4},
        "nodes": {"min": 1, "max": 3},
        "rendezvous": {"settle": 0.2},
        **fields,
    }
    path.write_text(json.dumps(raw))
    return str(path)


def run_cli(capsys, *argv) -> tuple[int, str, str]:
    code = main(["run", *argv])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


@pytest.fixture
def in_tmp(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    monkeypatch.setenv("AGENT_TEST_STEP_S", "0.1")
    return tmp_path


BAD_FAULTS = [
    ("unknown kind", "explode=1@step=2", "expected one of kill-node=I"),
    ("no step", "freeze-node=1", "expected one of"),
    ("duration not a number", "freeze-node=1@step=2:for=soon", "for=soon must be seconds"),
    ("zero duration", "etcd-outage@step=2:for=0", "for=0 must be seconds"),
    ("duration on a kill", "kill-node=1@step=2:for=3", "kill-node takes no :for=T"),
    ("target on an outage", "etcd-outage=1@step=2", "etcd-outage takes no target"),
    ("member without index", "kill-etcd-member@step=2", "kill-etcd-member needs a target"),
    ("leader with index", "kill-etcd-leader=0@step=2", "kill-etcd-leader takes no target"),
    ("step zero", "freeze-node=0@step=0", "step must be >= 1"),
    ("no such node", "freeze-node=5@step=2", "there is no node 5"),
    ("no such rank", "kill-worker=7@step=2", "there is no rank 7"),
    ("member kill on one etcd", "kill-etcd-member=0@step=2", "needs an etcd of 3 members"),
    ("leader kill on one etcd", "kill-etcd-leader@step=2", "needs an etcd of 3 members"),
]


@pytest.mark.parametrize(("case", "spec", "message"), BAD_FAULTS, ids=[c[0] for c in BAD_FAULTS])
def test_a_malformed_or_impossible_fault_is_one_line_and_exit_2(
    in_tmp, capsys, case, spec, message
):
    job = write_job(in_tmp / "job.yaml")
    code, _, err = run_cli(capsys, job, "--nodes", "2", "--fault", spec)
    assert code == 2
    assert err.count("\n") == 1 and err.startswith("elasticd: error: ") and message in err, err
    assert not (in_tmp / "runs").exists()  # refused before anything was created


def test_a_fault_past_the_built_in_trainers_last_step_is_refused(in_tmp, capsys):
    """It ran, never fired, and exited 0. A `command:` job's steps are only advice to its
    script, so its faults are not checked against them."""
    job = write_job(in_tmp / "job.yaml", command=None)
    code, _, err = run_cli(capsys, job, "--nodes", "2", "--fault", "kill-node=1@step=5")
    assert code == 2 and err.count("\n") == 1, err
    assert "kill-node=1@step=5: step 5 is past the job's last step (train.steps: 4)" in err
    assert not (in_tmp / "runs").exists()


def test_a_recover_phase_fault_under_process_restarts_is_refused(in_tmp, capsys):
    """The recover phase is inside an in-process recovery: a job that restarts every
    process never enters it, and the fault would be reported as never fired at the end."""
    argv = (os.path.join(EXAMPLES, "elastic.yaml"), "--nodes", "3", "--set",
            "restart.mode=process", "--fault", "kill-node=2@step=5:phase=recover")  # fmt: skip
    code, _, err = run_cli(capsys, *argv)
    assert code == 2 and err.count("\n") == 1, err
    assert "kill-node=2@step=5:phase=recover: the recover phase is inside an in-process" in err
    assert "(restart.mode: process)" in err
    assert not (in_tmp / "runs").exists()


def test_a_member_index_beyond_the_etcd_cluster_is_refused(in_tmp, capsys):
    job = write_job(in_tmp / "job.yaml")
    argv = (job, "--etcd-members", "3", "--fault", "kill-etcd-member=3@step=2")
    code, _, err = run_cli(capsys, *argv)
    assert code == 2 and "there is no etcd member 3 (members 0..2)" in err


def test_an_even_etcd_cluster_is_refused(in_tmp, capsys):
    code, _, err = run_cli(capsys, write_job(in_tmp / "job.yaml"), "--etcd-members", "2")
    assert code == 2 and "--etcd-members: 2 must be 1, 3 or 5" in err


def test_a_job_needing_more_nodes_than_the_cluster_starts_fails_fast_naming_nodes_min(
    in_tmp, capsys
):
    argv = (os.path.join(EXAMPLES, "elastic.yaml"), "--nodes", "2", "--set", "nodes.min=3")
    code, _, err = run_cli(capsys, *argv)
    assert code == 2 and err.count("\n") == 1
    assert "elastic.yaml: nodes.min: the job needs 3 nodes to start" in err
    assert "starts 2" in err
    assert not (in_tmp / "runs").exists()


def test_a_first_world_larger_than_the_cluster_is_refused_naming_nodes_start(in_tmp, capsys):
    argv = (os.path.join(EXAMPLES, "elastic.yaml"), "--nodes", "2", "--set", "nodes.start=3")
    code, _, err = run_cli(capsys, *argv)
    assert code == 2 and err.count("\n") == 1
    assert "elastic.yaml: nodes.start: the job's first world waits for 3 nodes" in err
    assert "starts 2" in err


def test_a_local_cluster_starts_the_job_on_every_agent_it_starts():
    from elasticd.jobspec import parse_job
    from elasticd.localcluster import starting_on

    job = parse_job({"name": "t", "nodes": {"min": 1, "max": 4}})
    assert starting_on(job, 3).nodes.start == 3
    assert starting_on(job, 6).nodes.start == 4  # the rest are spares
    pinned = parse_job({"name": "t", "nodes": {"min": 1, "max": 4, "start": 2}})
    assert starting_on(pinned, 3).nodes.start == 2  # the job's own word stands
    assert starting_on(job, 3).nodes.min == 1  # later worlds still need only nodes.min


def test_an_add_node_fault_does_not_make_a_job_startable(in_tmp, capsys):
    # Faults fire after a step; a job that cannot start never gets one.
    argv = (write_job(in_tmp / "job.yaml", nodes={"min": 3, "max": 3}), "--nodes", "2",
            "--fault", "add-node@step=1")  # fmt: skip
    code, _, err = run_cli(capsys, *argv)
    assert code == 2 and "nodes.min: the job needs 3 nodes to start" in err


def test_a_kill_that_leaves_fewer_than_nodes_min_is_refused_unless_a_node_is_added_with_it(
    in_tmp, capsys
):
    job = write_job(in_tmp / "job.yaml", nodes={"min": 2, "max": 3})
    code, _, err = run_cli(capsys, job, "--nodes", "2", "--fault", "kill-node=1@step=2")
    assert code == 2
    assert "--fault kill-node=1@step=2: leaves 1 node, fewer than job.yaml's nodes.min (2)" in err
    (in_tmp / "mine").mkdir()
    (in_tmp / "mine" / "notes.txt").write_text("")
    job = write_job(in_tmp / "job.yaml", nodes={"min": 2, "max": 3}, output_dir="mine")
    code, _, err = run_cli(capsys, job, "--nodes", "2", "--fault", "term-node=0@step=2",
                           "--fault", "add-node@step=2", "--fresh")  # fmt: skip
    assert code == 2 and "--fresh: " in err  # past the node count, stopped at the next check


@pytest.mark.parametrize("where", [".", "..", "/", "~", ""])
def test_an_output_dir_that_is_not_a_directory_of_its_own_is_refused(in_tmp, capsys, where):
    job = write_job(in_tmp / "job.yaml", output_dir=where)
    code, _, err = run_cli(capsys, job, "--fresh")
    assert code == 2 and err.count("\n") == 1
    assert err.startswith("elasticd: error: job.yaml: output_dir: ")
    assert (in_tmp / "job.yaml").exists()  # nothing was deleted


def test_a_checkpoint_dir_that_is_a_parent_of_the_current_directory_is_refused(in_tmp, capsys):
    job = write_job(in_tmp / "job.yaml", checkpoint={"dir": str(in_tmp.parent)})
    code, _, err = run_cli(capsys, job)
    assert code == 2 and "job.yaml: checkpoint.dir: " in err and "a parent of it" in err


def test_fresh_refuses_a_directory_elasticd_did_not_make_and_keeps_its_files(in_tmp, capsys):
    mine = in_tmp / "mine"
    mine.mkdir()
    (mine / "notes.txt").write_text("precious")
    job = write_job(in_tmp / "job.yaml", output_dir="mine")
    code, _, err = run_cli(capsys, job, "--fresh")
    assert code == 2 and err.count("\n") == 1
    assert f"--fresh: {mine} was not made by elasticd (no {OUTPUT_MARKER} in it)" in err
    assert (mine / "notes.txt").read_text() == "precious"


def test_the_marker_goes_only_into_a_directory_holding_nothing_but_elasticd_output(tmp_path):
    made = tmp_path / "new"
    prepare_output_dir(str(made), fresh=False)
    assert (made / OUTPUT_MARKER).exists()
    older = tmp_path / "older-run"  # an output dir from before the marker existed
    (older / "logs").mkdir(parents=True)
    (older / "metrics.jsonl").write_text("")
    prepare_output_dir(str(older), fresh=False)
    assert (older / OUTPUT_MARKER).exists()
    shared = tmp_path / "shared"
    shared.mkdir()
    (shared / "thesis.tex").write_text("")
    prepare_output_dir(str(shared), fresh=False)
    assert not (shared / OUTPUT_MARKER).exists()


def test_fresh_deletes_the_output_of_an_earlier_run(in_tmp):
    write_job(in_tmp / "job.yaml", nodes={"min": 1, "max": 1})
    command = [sys.executable, "-m", "elasticd", "run", "job.yaml", "--nodes", "1"]
    first = subprocess.run([*command, "--metrics"], cwd=in_tmp, capture_output=True, text=True,
                           timeout=120)  # fmt: skip
    assert first.returncode == 0, first.stdout + first.stderr
    # --metrics: the agents serve /metrics, named at the start (they served none: an SRE
    # review could not scrape the documented local cluster).
    (line,) = [x for x in first.stdout.splitlines() if x.startswith("agent metrics: ")]
    assert line.startswith("agent metrics: http://127.0.0.1:") and line.endswith("/metrics")
    assert int(line.rsplit(":", 1)[1].split("/")[0]) > 0
    out = in_tmp / "runs" / "cli"
    assert (out / OUTPUT_MARKER).exists() and (out / "metrics.jsonl").exists()
    (out / "stale.txt").write_text("from the first run")
    second = subprocess.run([*command, "--fresh"], cwd=in_tmp, capture_output=True, text=True,
                            timeout=120)  # fmt: skip
    assert second.returncode == 0, second.stdout + second.stderr
    assert not (out / "stale.txt").exists() and (out / OUTPUT_MARKER).exists()
    assert "steps completed: 4" in second.stdout


def test_a_finished_built_in_trainer_job_run_again_says_nothing_is_left_to_train(in_tmp):
    """(Newcomer walk.) Run again without --fresh, a finished job resumes at its last step
    and trains nothing: its summary read "steps completed: 0  final loss: None" and its
    fault "never fired", as if training were lost. One line now says so at the start, and
    the summary names no step and no Python None."""
    write_job(in_tmp / "job.yaml", command=None, nodes={"min": 1, "max": 1})
    command = [sys.executable, "-m", "elasticd", "run", "job.yaml", "--nodes", "1"]
    first = subprocess.run(command, cwd=in_tmp, capture_output=True, text=True, timeout=180)
    assert first.returncode == 0, first.stdout + first.stderr
    assert "steps completed: 4  final loss: " in first.stdout
    assert ", 1 agent, logs in " in first.stdout  # not "1 agents"
    assert "nothing is left to train" not in first.stdout
    again = subprocess.run([*command, "--fault", "kill-worker=0@step=2"], cwd=in_tmp,
                           capture_output=True, text=True, timeout=180)  # fmt: skip
    assert again.returncode == 0, again.stdout + again.stderr
    ckpt = in_tmp / "runs" / "cli" / "ckpt"
    assert (f"job.yaml: its checkpoint in {ckpt} is at step 4 and train.steps is 4: nothing "
            "is left to train, and no --fault can fire (--fresh starts over)"
            in again.stdout), again.stdout  # fmt: skip
    assert "steps completed: none in this run" in again.stdout and "None" not in again.stdout


def test_a_run_past_its_timeout_says_timed_out_not_cancelled_by_user(in_tmp):
    write_job(in_tmp / "job.yaml", train={"steps": 10000}, nodes={"min": 1, "max": 1})
    r = subprocess.run(
        [sys.executable, "-m", "elasticd", "run", "job.yaml", "--nodes", "1", "--timeout", "5"],
        cwd=in_tmp, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert r.returncode == 1, r.stdout + r.stderr
    assert "timed out after 5 s; job cancelled" in r.stdout
    assert "job cli: cancelled (timed out after 5 s)" in r.stdout
    assert "cancelled by user" not in r.stdout
