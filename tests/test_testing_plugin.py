"""The pytest plugin as its users meet it: pytest in a subprocess (``pytester``) on test
files that use ``elasticd_cluster``, with real etcd, agents and workers underneath."""

from __future__ import annotations

import glob
import itertools
import os
import re

import pytest

from elasticd.testing import leftover_processes

pytest_plugins = ["pytester"]

SCRIPT = os.path.join(os.path.dirname(__file__), "..", "examples", "ddp_train.py")


def nothing_left(pytester) -> None:
    assert leftover_processes(str(pytester.path)) == []
    runs = glob.glob(str(pytester.path / "**" / "elasticd" / "run-*"), recursive=True)
    assert runs == [], runs
    refs = glob.glob(str(pytester.path / "**" / "elasticd-references*" / "*"), recursive=True)
    assert refs == [], refs


def test_a_fault_test_passes_and_a_failing_assertion_says_what_differs(pytester):
    pytester.makepyfile(
        test_user=f"""
        import pytest

        SCRIPT = {os.path.abspath(SCRIPT)!r}

        @pytest.mark.elasticd(timeout=240)
        def test_survives_a_killed_worker(elasticd_cluster):
            job = elasticd_cluster.script_job(SCRIPT, steps=10)
            result = elasticd_cluster.run(job, nodes=2, restart="inprocess",
                                          faults=["kill-worker=1@step=4:phase=backward"])
            reference = elasticd_cluster.reference(job, nodes=2)
            result.assert_succeeded().assert_losses_match(reference).assert_no_lost_steps()
            result.assert_worlds([2]).assert_recovered_within(120)
            assert [f["kind"] for f in result.faults] == ["kill-worker"]
            assert "in backward" in result.faults[0]["detail"]

        @pytest.mark.elasticd(timeout=240)
        def test_expects_the_wrong_worlds(elasticd_cluster):
            job = elasticd_cluster.script_job(SCRIPT, steps=10)
            elasticd_cluster.reference(job, nodes=2).assert_worlds([2, 1])
        """
    )
    res = pytester.runpytest_subprocess("-p", "no:cacheprovider", "--elasticd-keep")
    res.assert_outcomes(passed=1, failed=1)
    res.stdout.fnmatch_lines(["*ElasticdAssertionError: worlds [[]2[]], expected [[]2, 1[]]*"])
    res.stdout.fnmatch_lines(["*test_expects_the_wrong_worlds: run directories kept in *"])
    assert "test_survives_a_killed_worker: run directories kept" not in res.stdout.str()
    assert leftover_processes(str(pytester.path)) == []


def test_a_failed_test_says_its_run_directories_are_gone_without_elasticd_keep(pytester):
    # The failure message names the run dir and worker logs; without --elasticd-keep they
    # are deleted at teardown, and the report said nothing of it (a user went looking).
    # worlds counts nodes; each record's world counts ranks.
    pytester.makepyfile(
        test_gone=f"""
        import pytest

        @pytest.mark.elasticd(timeout=120)
        def test_fails_after_a_run(elasticd_cluster):
            job = elasticd_cluster.script_job({os.path.abspath(SCRIPT)!r}, steps=2)
            result = elasticd_cluster.run(job, nodes=1, nproc_per_node=2)
            assert result.worlds == [1], result.describe()
            assert {{r["world"] for r in result.records}} == {{2}}, result.records
            assert False, "on purpose"
        """
    )
    res = pytester.runpytest_subprocess("-p", "no:cacheprovider")
    res.assert_outcomes(failed=1)
    res.stdout.fnmatch_lines(["*AssertionError: on purpose*"])
    res.stdout.fnmatch_lines(
        ["*test_fails_after_a_run: run directories deleted (*--elasticd-keep keeps those*"]
    )
    nothing_left(pytester)


def test_a_test_that_times_out_leaves_no_process_and_no_directory_behind(pytester):
    pytester.makepyfile(
        test_slowpoke=f"""
        import pytest

        @pytest.mark.timeout(15)
        def test_never_ends_in_time(elasticd_cluster):
            job = elasticd_cluster.script_job({os.path.abspath(SCRIPT)!r}, steps=100000)
            elasticd_cluster.run(job, nodes=2)
        """
    )
    res = pytester.runpytest_subprocess("-p", "no:cacheprovider")
    res.assert_outcomes(failed=1)
    res.stdout.fnmatch_lines(["*Timeout*"])
    nothing_left(pytester)


STUBBORN = """
import os, signal, subprocess, sys, time
from elasticd.worker import WorkerChannel

channel = WorkerChannel.from_env()


def asked_to_stop(signum, frame):  # trains on, and says it was asked (a preemption stop)
    with open(sys.argv[1] + ".sigterm", "a") as fh:
        fh.write(f"{os.getpid()}\\n")


signal.signal(signal.SIGTERM, asked_to_stop)
child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
with open(sys.argv[1], "a") as fh:
    fh.write(f"{os.getpid()} {child.pid}\\n")
step = 0
while True:
    step += 1
    time.sleep(0.2)
    channel.record(step=step, loss=1.0)
"""


def test_a_test_that_times_out_is_torn_down_at_once_with_what_its_workers_started(pytester):
    """A test's timeout stopped its cluster as a preemption: each agent gave its workers
    restart.grace_period (30 s) to save, and a script that trains on through its SIGTERM
    held the teardown for LocalCluster.stop's 20 s grace. Now the agents and all under
    them are killed at once, the processes the script started too."""
    script = pytester.path / "stubborn.py"
    script.write_text(STUBBORN)
    started = pytester.path / "started"
    pytester.makepyfile(
        test_stubborn=f"""
        import pytest

        @pytest.mark.timeout(15)
        def test_never_ends_in_time(elasticd_cluster):
            job = elasticd_cluster.script_job({str(script)!r}, {str(started)!r}, steps=100000)
            elasticd_cluster.run(job, nodes=2)
        """
    )
    res = pytester.runpytest_subprocess("-p", "no:cacheprovider")
    res.assert_outcomes(failed=1)  # and no teardown error: nothing was left to kill
    res.stdout.fnmatch_lines(["*Timeout*"])
    pids = [int(p) for line in started.read_text().splitlines() for p in line.split()]
    assert len(pids) == 4, "both workers and their children ran before the timeout"
    # Killed, never asked: a preemption stop SIGTERMs every worker and then waits out its
    # grace (the 20 s this teardown took before), which a script training on holds whole.
    asked = pytester.path / "started.sigterm"
    assert not asked.exists(), f"workers were sent SIGTERM: {asked.read_text()!r}"
    nothing_left(pytester)


def test_a_failure_whose_traceback_has_an_entry_without_a_line_is_reported(pytester):
    # A timeout's signal (pytest-timeout's, which the plugin arms for every cluster test)
    # can land on an instruction with no line number, such as an except clause's cleanup:
    # Python 3.11+ then gives that traceback entry tb_lineno None, and pytest's report of
    # the failure raised an INTERNALERROR that ended the whole session (seen once in a
    # loaded run of the test above). Such an entry is made here as the signal would.
    pytester.makepyfile(
        test_lineless="""
        import sys, types
        import pytest

        def cleanup():
            try:
                raise ValueError("inside")
            except KeyError:
                pass

        def timed_out():
            offset = next(s for s, _, line in cleanup.__code__.co_lines() if line is None)
            try:
                cleanup()
            except ValueError as exc:
                frame = exc.__traceback__.tb_next.tb_frame
            lineless = types.TracebackType(None, frame, offset, -1)
            assert lineless.tb_lineno is None
            raise pytest.fail.Exception("Timeout").with_traceback(lineless)

        @pytest.mark.elasticd(timeout=5)
        def test_a_cluster_test():
            timed_out()

        def test_any_test():  # pytest-timeout's own timeout can land there too
            timed_out()

        def test_after():
            pass
        """
    )
    res = pytester.runpytest_subprocess("-p", "no:cacheprovider")
    res.assert_outcomes(failed=2, passed=1)  # the session went on to the next test
    res.stdout.fnmatch_lines(["*def cleanup():*", "*Failed: Timeout*"])  # the entry is kept
    res.stdout.no_fnmatch_line("*INTERNALERROR*")


def test_a_run_that_passes_its_own_timeout_is_timed_out_and_cancelled(pytester):
    pytester.makepyfile(
        test_short=f"""
        import pytest

        @pytest.mark.elasticd(timeout=12)
        def test_run_times_out(elasticd_cluster):
            job = elasticd_cluster.script_job({os.path.abspath(SCRIPT)!r}, steps=100000)
            result = elasticd_cluster.run(job, nodes=1, faults="kill-worker=0@step=99999",
                                          allow_unfired=True)
            assert result.outcome == "timed_out", result.describe()
            assert result.steps, "it trained before it was stopped"
            # The job did not end: the run gave up on it (it said "the job ended").
            (fault,) = result.unfired
            assert "never fired: the run timed out after " in fault["detail"], fault
            assert fault["detail"].endswith(" s before step 99999 completed"), fault
        """
    )
    res = pytester.runpytest_subprocess("-p", "no:cacheprovider")
    res.assert_outcomes(passed=1)
    nothing_left(pytester)


@pytest.mark.slow
def test_two_xdist_workers_run_cluster_tests_side_by_side(pytester):
    pytester.makepyfile(
        test_pair=f"""
        import pytest

        @pytest.mark.elasticd(timeout=240)
        @pytest.mark.parametrize("nodes", [1, 2])
        def test_runs(elasticd_cluster, nodes):
            job = elasticd_cluster.script_job({os.path.abspath(SCRIPT)!r}, steps=6)
            elasticd_cluster.run(job, nodes=nodes).assert_succeeded().assert_worlds([nodes])
        """
    )
    res = pytester.runpytest_subprocess("-p", "no:cacheprovider", "-n", "2")
    res.assert_outcomes(passed=2)
    res.stdout.fnmatch_lines(["*2 workers*"])
    nothing_left(pytester)


@pytest.mark.elasticd(timeout=240)
def test_the_built_in_trainer_killed_in_its_checkpoint_save_recovers_in_process(elasticd_cluster):
    job = elasticd_cluster.builtin_job(train={"steps": 10}, checkpoint={"every": 4})
    result = elasticd_cluster.run(
        job, nodes=2, restart="inprocess", faults=["kill-worker=1@step=4:phase=checkpoint-save"]
    )
    reference = elasticd_cluster.reference(job, nodes=2)
    result.assert_succeeded().assert_worlds([2]).assert_no_lost_steps()
    result.assert_losses_match(reference)
    assert result.faults[0]["detail"] == "rank 1 SIGKILLed itself at step 4 in checkpoint-save"
    (recovery,) = result.recoveries
    assert (recovery.mode, recovery.source) == ("inprocess", "peers")


@pytest.mark.elasticd(timeout=240)
def test_a_worker_killed_in_its_checkpoint_save_lost_that_step_too(elasticd_cluster):
    """The heartbeat came after the save: a fault in the save of step 8 was counted from
    step 7 (3 lost from step 4), though steps 5 to 8 were all trained again. (Saves are
    synchronous: step 4 is committed before step 5 starts.)"""
    job = elasticd_cluster.builtin_job(train={"steps": 10}, checkpoint={"every": 4, "async": False})
    result = elasticd_cluster.run(
        job, nodes=1, restart="process", faults=["kill-worker=0@step=8:phase=checkpoint-save"]
    )
    result.assert_succeeded()
    (recovery,) = result.recoveries
    assert (recovery.mode, recovery.source, recovery.lost_steps) == ("process", "checkpoint", 4)


@pytest.mark.elasticd(timeout=240)
def test_an_error_raised_in_a_ranks_step_is_the_scripts_to_handle(elasticd_cluster):
    # Not a communication error: the script's own exception. Its worker exits non-zero,
    # the job restarts it (process mode) from the checkpoint, and the log shows the error.
    job = elasticd_cluster.script_job(SCRIPT, steps=10, checkpoint={"every": 3})
    result = elasticd_cluster.run(
        job, nodes=2, restart="process", faults=["raise-error=1@step=5:phase=optimizer"]
    )
    result.assert_succeeded().assert_worlds([2])
    result.assert_losses_match(elasticd_cluster.reference(job, nodes=2))
    (recovery,) = result.recoveries
    # Rank 1 raised before its optimizer step 5; rank 0 had all it needed and completed
    # step 5; the restart resumes from the step-3 checkpoint: steps 4 and 5 trained again.
    assert recovery.reason == "worker_failed" and recovery.lost_steps == 2
    assert "InjectedFault: injected fault raise-error=1@step=5:phase=optimizer" in result.rank_log(
        1
    )


def test_the_plugin_loads_from_its_entry_point_without_importing_torch(pytester):
    pytester.makepyfile(
        test_plain="""
        import sys

        def test_unrelated(request):
            assert request.config.pluginmanager.hasplugin("elasticd")
            assert "torch" not in sys.modules, "the plugin imported torch at start-up"
        """
    )
    res = pytester.runpytest_subprocess("-p", "no:cacheprovider", "--fixtures")
    res.stdout.fnmatch_lines(["elasticd_cluster*", "*factory of local clusters*"])
    res = pytester.runpytest_subprocess("-p", "no:cacheprovider")
    res.assert_outcomes(passed=1)


def test_a_mistake_in_a_run_call_is_the_tests_line_and_one_line_of_error(pytester):
    """A wrong argument or a fault that can never apply failed with about 100 lines of
    elasticd's own source before its one-line message (no frame of the plugin hidden)."""
    pytester.makepyfile(
        test_mistakes="""
        import pytest

        @pytest.mark.elasticd(timeout=60)
        def test_last_step(elasticd_cluster):
            job = elasticd_cluster.builtin_job(train={"steps": 6})
            elasticd_cluster.run(job, nodes=2, faults=["kill-node=1@step=6"])

        def test_no_node(elasticd_cluster):
            elasticd_cluster.run(elasticd_cluster.builtin_job(), nodes=2, faults="kill-node=3@step=2")

        def test_bad_field(elasticd_cluster):
            elasticd_cluster.run(elasticd_cluster.builtin_job(parallel={"tp": 3}), nodes=1)

        def test_lost_steps(elasticd_cluster):
            from elasticd.testing import result_from
            r = result_from({"state": "succeeded", "metrics": [{"step": 1}, {"step": 1}]},
                            run_dir="/nowhere", output="")
            r.assert_no_lost_steps()

        def test_no_script(elasticd_cluster):
            elasticd_cluster.script_job("missing.py")
        """
    )
    res = pytester.runpytest_subprocess("-p", "no:cacheprovider", "-q")
    res.assert_outcomes(failed=5)
    text = res.stdout.str()
    res.stdout.fnmatch_lines([
        "*elasticd.errors.UsageError: faults: kill-node=1@step=6: step 6 is the job's last step*",
        "*elasticd.errors.UsageError: faults: kill-node=3@step=2: there is no node 3 by step 2*",
        "*elasticd.errors.JobSpecError: job test-0: parallel.tp: 3 does not divide*",
        "*steps trained again (recorded twice in metrics.jsonl): 1*",
        "*elasticd.errors.UsageError: script_job: missing.py: no such file*",
    ])  # fmt: skip
    # The tests' own lines, none of elasticd's source.
    assert "check_plan(" not in text and "def run(" not in text and "def wrapper" not in text
    assert "def script_job(" not in text
    assert text.count("\n") < 150, text


@pytest.mark.elasticd(timeout=200)
def test_a_fault_that_never_fires_fails_the_run_rather_than_passing_unnoticed(elasticd_cluster):
    from elasticd.testing import ElasticdAssertionError

    job = elasticd_cluster.script_job(SCRIPT, steps=6, checkpoint={"every": 4})  # saves 4, 6
    with pytest.raises(ElasticdAssertionError, match="never fired") as info:
        elasticd_cluster.run(job, nodes=2, faults="kill-worker=1@step=5:phase=checkpoint-save")
    # Named once: the message listed each unfired fault's reason, then the run's summary
    # listed every fault with its detail, the same reason a second time.
    text = str(info.value)
    assert text.count("rank 1 never reached the checkpoint-save phase of step 5") == 1, text
    assert text.startswith("1 fault(s) never fired (pass allow_unfired=True if that is what "
                           "the test expects): kill-worker=1@step=5:phase=checkpoint-save\n")  # fmt: skip
    result = info.value.result
    assert result.outcome == "succeeded" and result.steps == list(range(1, 7))
    assert "fault never fired: kill-worker=1@step=5:phase=checkpoint-save" in result.output


PLAIN = """
import json, os, sys
import torch
import torch.distributed as dist
from elasticd.worker import PREEMPTED_EXIT_CODE, WorkerChannel

job = json.load(open(os.environ["ELASTICD_JOB_FILE"]))
steps, ckpt = job["train"]["steps"], os.path.join(job["checkpoint"]["dir"], "w.pt")
dist.init_process_group("gloo")  # the agent's torchrun environment
channel = WorkerChannel.from_env()
channel.install_preemption_handler()
w = torch.zeros(4)
start = 0
if os.path.exists(ckpt):
    state = torch.load(ckpt)
    w, start = state["w"], state["step"]
if start:
    channel.recovered(source="checkpoint", resume_step=start)
for step in range(start, steps):
    channel.phase("forward", step + 1)
    g = torch.full((4,), float(step + 1))
    dist.all_reduce(g)
    w -= 0.01 * g / dist.get_world_size()
    channel.record(step=step + 1, loss=float(w.sum()))
    if channel.preempt_agreed():
        if dist.get_rank() == 0:
            os.makedirs(os.path.dirname(ckpt), exist_ok=True)
            torch.save({"w": w, "step": step + 1}, ckpt)
        dist.barrier()
        dist.destroy_process_group()
        sys.exit(PREEMPTED_EXIT_CODE)
dist.destroy_process_group()
"""


@pytest.mark.elasticd(timeout=200)
def test_the_docs_plain_script_leaves_at_a_preemption_and_loses_no_step(elasticd_cluster, tmp_path):
    # docs/testing.md's first script, as written there: a plain process group from the
    # agent's environment, preempt_agreed(), a save, and PREEMPTED_EXIT_CODE.
    script = tmp_path / "plain.py"
    script.write_text(PLAIN)
    job = elasticd_cluster.script_job(str(script), steps=8)
    result = elasticd_cluster.run(
        job, nodes=2, restart="process", faults=["term-node=1@step=4:phase=forward"]
    )
    result.assert_succeeded().assert_worlds([2, 1]).assert_no_lost_steps()
    result.assert_losses_match(elasticd_cluster.reference(job, nodes=2))
    (recovery,) = result.recoveries
    assert (recovery.reason, recovery.source) == ("preempted", "checkpoint"), recovery


STUCK = """
import os, sys, time

rank = int(os.environ["RANK"])
for i in range(1, 9):
    print(f"rank {rank} line {i}", flush=True)
if rank == 0:
    sys.exit(0)  # finished: not a rank to name
print("x" * 500, flush=True)
print("rank 1 waits for a lock that never comes", flush=True)
time.sleep(600)
"""


@pytest.mark.elasticd(timeout=200)
def test_a_run_that_times_out_names_the_ranks_still_running_and_quotes_their_logs(
    elasticd_cluster, tmp_path
):
    """A run that timed out said only "outcome timed_out": where it hung was in some
    rank's log, somewhere in a run dir the teardown then deleted."""
    from elasticd.testing import ElasticdAssertionError

    script = tmp_path / "stuck.py"
    script.write_text(STUCK)
    job = elasticd_cluster.script_job(str(script), steps=5)
    result = elasticd_cluster.run(job, nodes=1, nproc_per_node=2, timeout=15)
    assert result.outcome == "timed_out", result.describe()
    assert [w["rank"] for w in result.unfinished] == [1], result.unfinished
    with pytest.raises(ElasticdAssertionError) as info:
        result.assert_succeeded()
    lines = str(info.value).splitlines()
    head = "  rank 1 (node-0) had not finished; the last lines of its log (logs/"
    (at,) = [i for i, line in enumerate(lines) if line.startswith(head)]
    assert lines[at].endswith("/round-1/rank-1.log) before the timeout:"), lines[at]
    assert lines[at + 1 : at + 6] == [  # the last five, a long one cut short
        "    | rank 1 line 6",
        "    | rank 1 line 7",
        "    | rank 1 line 8",
        "    | " + "x" * 157 + "...",
        "    | rank 1 waits for a lock that never comes",
    ], lines[at:]
    assert "rank 0 (node-0)" not in str(info.value)


@pytest.mark.elasticd(timeout=200)
def test_a_timed_out_built_in_trainer_rank_has_its_main_threads_stack_quoted(elasticd_cluster):
    """The built-in trainer prints its stacks into its log at a timeout, but the failure
    message said only how many bytes the log grew by: where each rank was stuck was still
    in a run dir the teardown deleted. Now the main thread's frames are quoted, innermost
    first, a bounded few."""
    from elasticd.testing import STACK_FRAMES, ElasticdAssertionError

    job = elasticd_cluster.builtin_job(train={"steps": 1_000_000}, checkpoint={"every": 0})
    result = elasticd_cluster.run(job, nodes=1, nproc_per_node=2, timeout=25)
    assert result.outcome == "timed_out", result.describe()
    assert [w["rank"] for w in result.unfinished] == [0, 1], result.unfinished
    with pytest.raises(ElasticdAssertionError) as info:
        result.assert_succeeded()
    lines = str(info.value).splitlines()
    said = "    its main thread's stack, printed after the timeout (innermost call first):"
    starts = [i for i, line in enumerate(lines) if line == said]
    assert len(starts) == 2, "\n".join(lines)  # one per rank still running
    for at in starts:
        head, *rest = lines[at + 1 :]
        # faulthandler's header of a thread, then its frames, innermost first.
        assert re.fullmatch(r"    \| (Current thread|Thread) 0x[0-9a-f]+ \(most recent call first\):",
                            head), head  # fmt: skip
        frames = list(itertools.takewhile(lambda ln: ln.startswith('    |   File "'), rest))
        assert 1 <= len(frames) <= STACK_FRAMES, "\n".join(lines[at:])
        more = (rest[len(frames) :] or [""])[0]
        assert len(frames) < STACK_FRAMES or re.fullmatch(
            r"    \|   \(\d+ outer frames more\)", more
        ), more
    assert "with no stack dump in them" not in str(info.value)
