"""The agent's pure decisions, the worker channel, the fault specs and the metric names."""

from __future__ import annotations

import json
import os
import signal
import urllib.request
from types import SimpleNamespace

import pytest
from hypothesis import given
from hypothesis import strategies as st
from prometheus_client import CollectorRegistry, generate_latest

from elasticd.agent.policy import (
    ALONE_CRASH_LOOP_CAP,
    CRASH_LOOP_CAP,
    FINISH_WAIT,
    WAITING_FRESH,
    WAITING_PATIENCE,
    Observation,
    Outcome,
    WorkerEnvInputs,
    backoff,
    count_failure,
    crash_loop_pause,
    decide,
    latest_checkpoint_step,
    note_furthest_step,
    restart_limit_reached,
    uncount_failure,
    worker_argv,
    worker_envs,
)
from elasticd.agent.workers import (
    Staleness,
    Worker,
    WorkerGroup,
    finishing,
    recovering,
    waiting_now,
)
from elasticd.errors import UsageError
from elasticd.jobs import JobState
from elasticd.localcluster import parse_fault
from elasticd.metrics import AgentMetrics
from elasticd.worker import PREEMPTED_EXIT_CODE, WorkerChannel, read_heartbeat


def test_healthy_running_workers_keep_the_round_going():
    assert decide(Observation(exit_codes=(None, None), stalest_heartbeat=1.0)) is None


def test_our_own_preemption_beats_everything_else():
    obs = Observation(preempting=True, job_state=JobState.CANCELLED, lost=("b",), exit_codes=(1,))
    assert decide(obs) == Outcome.PREEMPTED


def test_a_cancel_beats_a_worker_failure():
    assert decide(Observation(job_state=JobState.CANCELLED, exit_codes=(1,))) == Outcome.CANCELLED


def test_a_lost_peer_beats_the_local_crash_it_caused():
    assert decide(Observation(lost=("node-1",), exit_codes=(1, None))) == Outcome.PEER_LOST


def test_all_workers_exiting_zero_is_success_even_if_peers_already_left():
    assert decide(Observation(lost=("b",), run_closed=True, exit_codes=(0, 0))) == Outcome.SUCCEEDED


def test_the_preemption_exit_code_re_forms_without_counting_a_failure():
    out = decide(Observation(exit_codes=(PREEMPTED_EXIT_CODE, None)))
    assert out == Outcome.PEER_PREEMPTED and not out.counts_as_failure and out.reforms


def test_workers_that_left_their_round_for_a_peers_preemption_are_kept_for_the_next():
    """restart.mode inprocess: a peer node is preempted, every rank saved the step, and our
    live workers left the round with their state (their heartbeats say so). The world
    re-forms without counting a failure, and the processes go on into the next round."""
    out = decide(Observation(exit_codes=(None, None), peer_preempted=True))
    assert out == Outcome.PEER_PREEMPTED and out.keeps_workers and out.reforms
    assert not out.counts_as_failure and not out.is_evidence
    # Our own preemption and a real failure still come first.
    assert decide(Observation(preempting=True, peer_preempted=True)) == Outcome.PREEMPTED
    assert decide(Observation(exit_codes=(1, None), peer_preempted=True)) == Outcome.WORKER_FAILED


def test_a_worker_channel_says_it_left_for_a_peers_preemption(tmp_path):
    path = tmp_path / "hb.json"
    ch = WorkerChannel(path=str(path), rank=1, clock=lambda: 42.0)
    ch.progress(step=7)
    ch.peer_preempted()
    hb = read_heartbeat(str(path))
    assert hb["peer_preempted"] == {"t": 42.0} and hb["step"] == 7


def test_each_rounds_channel_shares_the_processs_preemption_flag(tmp_path):
    """In-process restart makes a channel per round: a SIGTERM caught by the handler an
    earlier round installed (between two rounds, or before the next one installs its
    own) must still count in the next round."""
    env = {"ELASTICD_HEARTBEAT_FILE": str(tmp_path / "hb.json"), "RANK": "0"}
    first = WorkerChannel.from_env(env)
    second = WorkerChannel.from_env(env, preempt=first.preempt_flag)
    first.request_preemption()  # what the first round's handler does on SIGTERM
    assert second.preempt_requested()
    assert not WorkerChannel.from_env(env).preempt_requested()  # unshared: its own


def test_a_non_zero_exit_is_a_failure_that_counts():
    out = decide(Observation(exit_codes=(0, -9)))
    assert out == Outcome.WORKER_FAILED and out.counts_as_failure


@pytest.mark.parametrize("last", ["terminate called without an active exception", "boom"])
def test_a_worker_aborted_on_its_way_out_is_told_to_destroy_its_process_group(tmp_path, last):
    # torch can abort a process that leaves with its gloo group open (a CI run lost a
    # reference job so, three rounds in a row): the failure names the fix.
    import resource
    import subprocess
    import sys

    log = tmp_path / "rank-1.log"
    code = f"import os, sys; sys.stderr.write({last!r} + '\\n'); sys.stderr.flush(); os.abort()"
    no_core = lambda: resource.setrlimit(resource.RLIMIT_CORE, (0, 0))  # noqa: E731
    with open(log, "wb") as fh:
        proc = subprocess.Popen([sys.executable, "-c", code], stdout=fh, stderr=fh,
                                cwd=tmp_path, preexec_fn=no_core)  # fmt: skip
    proc.wait()
    worker = Worker(local_rank=1, rank=1, proc=proc, log_path=str(log), heartbeat_path="",
                    error_path=str(tmp_path / "none.json"), started=0.0)  # fmt: skip
    text = worker.failure_message()
    assert text.startswith(f"rank 1: signal 6 (SIGABRT), last log line: {last}"), text
    assert text.endswith(f"(log {log})"), text
    assert ("dist.destroy_process_group()" in text) == (last != "boom"), text


def test_a_carried_worker_that_never_took_its_round_is_a_hang():
    assert decide(Observation(exit_codes=(None,), not_begun=True)) == Outcome.WORKER_HUNG
    assert decide(Observation(exit_codes=(None,), not_begun=False)) is None


def test_a_worker_stuck_in_the_round_before_is_judged_before_its_peers_give_up():
    """A carried worker that stepped before and has not taken the round within
    ``hang_timeout`` + LEAVE_MARGIN (the rest of a step, the abort) is stuck, and noted in
    ``rnd.stuck`` for its node to kill alone. A worker that began but has not opened the
    group is judged only past ``max(ROUND_BEGIN_TIMEOUT, hang_timeout + LEAVE_MARGIN + 15)``:
    after the stuck bound, so a stuck worker's own node acts before its peers' nodes give up
    on the round (at the default 300 s they gave up first and restarted every process). A
    carried worker that never stepped (a cold newcomer still importing) is never stuck."""
    from elasticd.agent.runner import LEAVE_MARGIN, ROUND_BEGIN_TIMEOUT, JobRunner

    runner = object.__new__(JobRunner)
    stuck = SimpleNamespace(name="rank 1", stepped=True)
    cold = SimpleNamespace(name="rank 2", stepped=False)
    opening = SimpleNamespace(name="rank 0", stepped=True)
    rnd = SimpleNamespace(carried=1, first_step_seen=False, spawned_at=1000.0, stuck=[],
                          workers=SimpleNamespace(not_begun=lambda: [stuck, cold],
                                                  not_opened=lambda: [opening]))  # fmt: skip
    for hang in (300.0, 30.0, 4.0):
        runner.job = SimpleNamespace(restart=SimpleNamespace(hang_timeout=hang))
        leave = hang + LEAVE_MARGIN
        group = max(ROUND_BEGIN_TIMEOUT, leave + 15.0)
        assert leave < group
        assert runner._not_begun(rnd, 1000.0 + leave) == [] and rnd.stuck == []
        assert runner._not_begun(rnd, 1000.0 + leave + 1) == [stuck] and rnd.stuck == [stuck]
        assert runner._not_begun(rnd, 1000.0 + group) == [stuck]
        assert runner._not_begun(rnd, 1000.0 + group + 1) == [stuck, cold, opening]
        assert rnd.stuck == [stuck]
    assert runner._not_begun(SimpleNamespace(**{**vars(rnd), "first_step_seen": True}), 1e9) == []
    assert runner._not_begun(SimpleNamespace(**{**vars(rnd), "carried": 0}), 1e9) == []


def test_a_built_in_trainer_node_with_no_step_past_the_startup_timeout_is_judged(
    tmp_path,
):
    """restart.startup_timeout: a node's live active workers, none of which completed a
    step in the round, once the bound (never below hang_timeout) has passed since their
    start; the built-in trainer's only, never a command's (which of its ranks report is
    the script's choice, and a re-form moves them: a node of ranks that never report was
    restarted 1800 s into a healthy job, a fresh-eyes review found); 0 judges none. A
    spare rank, idle without steps until the end, is never judged; one worker that
    stepped (not local rank 0) ends the judging."""
    from elasticd.agent.runner import JobRunner

    def worker(rank, *, step=None, alive=True):
        path = str(tmp_path / f"hb-{rank}.json")
        if step is not None:
            with open(path, "w", encoding="utf-8") as fh:
                json.dump({"step": step}, fh)
        return SimpleNamespace(rank=rank, heartbeat_path=path,
                               proc=SimpleNamespace(poll=lambda: None if alive else 1))  # fmt: skip

    fresh, other, dead, spare = worker(0), worker(1), worker(2, alive=False), worker(3)
    rnd = SimpleNamespace(first_step_seen=False, spawned_at=1000.0, unstarted=[],
                          layout=SimpleNamespace(is_spare=lambda rank: rank >= 3),
                          workers=SimpleNamespace(workers=[fresh, other, dead, spare]))  # fmt: skip
    runner = object.__new__(JobRunner)
    runner._furthest_step = None

    def job(command=None, startup=30.0, hang=10.0):
        return SimpleNamespace(command=command, restart=SimpleNamespace(
            startup_timeout=startup, hang_timeout=hang))  # fmt: skip

    for runner.job, judged in ((job(), [fresh, other]), (job(startup=0.0), []),
                               (job(["python", "x.py"]), [])):  # fmt: skip
        assert runner._unstarted(rnd, 1030.0) == [] and rnd.unstarted == []
        assert runner._unstarted(rnd, 1031.0) == judged and rnd.unstarted == judged
        assert runner._unstarted(SimpleNamespace(**{**vars(rnd), "first_step_seen": True}),
                                 1e9) == []  # fmt: skip
    runner._furthest_step = 3  # ours reported a step in an earlier round: still not judged
    assert runner._unstarted(rnd, 1e9) == []
    runner.job = job(hang=60.0)  # the first step may take as long as any
    assert runner._unstarted(rnd, 1059.0) == [] and runner._unstarted(rnd, 1061.0) == [fresh, other]
    stepped = worker(1, step=4)  # local rank 1 stepped, local rank 0 not yet
    rnd.workers.workers[1] = stepped
    assert runner._unstarted(rnd, 1e9) == [] and rnd.unstarted == []
    runner.job = job()
    detail = runner._unstarted_detail(SimpleNamespace(number=4, spawned_at=1000.0), [fresh], 1031.4)
    assert detail == (
        "round 4: rank 0 completed no step in the 31 s since the start (restart.startup_timeout: "
        "30 s, for the imports, the process group, the checkpoint load and the first step)"
    )
    runner.job = job(hang=60.0)
    assert "(restart.startup_timeout: 30 s, raised to restart.hang_timeout's 60 s, for the " in (
        runner._unstarted_detail(SimpleNamespace(number=4, spawned_at=1000.0), [fresh], 1061.0)
    )


def test_a_stale_heartbeat_past_the_hang_timeout_is_a_hang():
    assert decide(Observation(exit_codes=(None,), stalest_heartbeat=5.1, hang_timeout=5)) == (
        Outcome.WORKER_HUNG
    )
    assert decide(Observation(exit_codes=(None,), stalest_heartbeat=4.9, hang_timeout=5)) is None


def test_a_worker_waiting_on_its_peers_gets_longer_before_it_counts_as_hung():
    """In-process restart: the hung peer is killed first (its sockets close and fail the
    waiting ranks' collectives); the waiting ranks keep their state."""
    waiting = {"exit_codes": (None,), "hang_timeout": 5, "stalest_waiting": True}
    assert decide(Observation(stalest_heartbeat=9.9, **waiting)) is None
    assert decide(Observation(stalest_heartbeat=5 * WAITING_PATIENCE + 0.1, **waiting)) == (
        Outcome.WORKER_HUNG
    )
    # The worker judged is the one nearest its bound: a stopped one 5.5 s stale before a
    # waiting one 7 s stale.
    w = SimpleNamespace(rank=0)
    assert Staleness(w, 5.5, False).share > Staleness(w, 7.0, True).share
    assert Staleness(w, 9.0, False).share == Staleness(w, 9.0 * WAITING_PATIENCE, True).share


def test_the_channel_says_when_a_rank_waits_on_its_peers_and_when_it_no_longer_does(tmp_path):
    path = str(tmp_path / "hb.json")
    ch = WorkerChannel(path=path, rank=1, clock=lambda: 50.0)
    ch.progress(step=3)
    ch.waiting(True)
    assert read_heartbeat(path)["waiting"] == {"t": 50.0}
    ch.waiting(False)
    assert "waiting" not in read_heartbeat(path)
    ch.waiting(True)
    ch.progress(step=4)  # progress ends a wait too
    assert "waiting" not in read_heartbeat(path) and read_heartbeat(path)["step"] == 4
    # The marks are not progress: they keep the file's mtime, the agent's clock of it. The
    # end of a wait that completed is (the rank went on).
    os.utime(path, (1000.0, 1000.0))
    ch.waiting(True)
    ch.waiting(True)  # refreshed while the wait lasts
    assert os.stat(path).st_mtime == 1000.0 and read_heartbeat(path)["waiting"]
    ch.waiting(False)
    assert os.stat(path).st_mtime > 1000.0


def test_two_channels_of_one_heartbeat_file_write_one_record(tmp_path):
    """A script under elasticd.inprocess.run with a channel of its own beside the round's
    (which the control watcher marks waiting, from its own thread): each wrote the file
    whole from its own record, so the watcher's mark, without the script's step, hid the
    rank's progress from the agent. Now the channels of one file share its record."""
    import threading

    path = str(tmp_path / "hb.json")
    env = {"ELASTICD_HEARTBEAT_FILE": path, "RANK": "1"}
    script, round_ = WorkerChannel.from_env(env), WorkerChannel.from_env(env)
    script.progress(step=7, loss=2.5)
    round_.waiting(True)
    hb = read_heartbeat(path)
    assert hb["step"] == 7 and hb["loss"] == 2.5 and hb["waiting"]
    script.progress(step=8)  # a step drops the mark, as it always did
    assert "waiting" not in read_heartbeat(path) and read_heartbeat(path)["step"] == 8
    # Two threads writing at once: every file a whole record, never a torn one.
    stop = threading.Event()
    marker = threading.Thread(
        target=lambda: [round_.waiting(True) for _ in iter(stop.is_set, True)]
    )
    marker.start()
    try:
        for step in range(9, 200):
            script.progress(step=step)
            assert read_heartbeat(path)["step"] >= step - 1
    finally:
        stop.set()
        marker.join()
    other = WorkerChannel.from_env({"ELASTICD_HEARTBEAT_FILE": str(tmp_path / "next.json")})
    other.waiting(True)  # the next round's file starts afresh
    assert "step" not in read_heartbeat(str(tmp_path / "next.json"))


def test_a_waiting_mark_counts_only_while_it_is_refreshed():
    """A process stopped while it waited keeps its mark: once stale, it is ignored."""
    assert waiting_now({"waiting": {"t": 100.0}}, 100.0 + WAITING_FRESH)
    assert not waiting_now({"waiting": {"t": 100.0}}, 100.1 + WAITING_FRESH)
    assert not waiting_now({}, 100.0) and not waiting_now({"waiting": {"t": "x"}}, 100.0)
    assert not waiting_now({"waiting": True}, 100.0)


def test_a_finished_mark_spares_a_worker_the_hang_timeout_until_finish_wait(tmp_path):
    """A worker whose training function returned only tears down: not judged by
    hang_timeout, until FINISH_WAIT has passed (a teardown stuck for good). The mark is
    written by the channel without moving the heartbeat's mtime (it is no progress)."""
    path = tmp_path / "hb.json"
    channel = WorkerChannel(path=str(path), clock=lambda: 100.0)
    channel.progress(step=7)
    os.utime(path, (50.0, 50.0))
    channel.finished()
    beat = read_heartbeat(str(path))
    assert beat["step"] == 7 and beat["finished"] == {"t": 100.0}
    assert os.stat(path).st_mtime == 50.0
    assert finishing(beat, 100.0) and finishing(beat, 100.0 + FINISH_WAIT)
    assert not finishing(beat, 100.1 + FINISH_WAIT)
    assert not finishing({"step": 7}, 100.0) and not finishing({"finished": {"t": "x"}}, 100.0)


def test_a_worker_inside_an_in_process_recovery_is_judged_by_the_hang_timeout(tmp_path):
    """A worker with no step in its round is not judged (it may be importing, building
    its model or compiling its first step), unless it marked ``recovering``: then the age
    of its heartbeat counts from that mark, as a step's does, until ``state_loaded``,
    ``ckpt_loaded`` or a fall back's ``ckpt_loading``. A stopped worker there was never judged, and its peers waited on it
    for the process group's 10-minute timeout. One waiting on its peers meanwhile gets
    the longer bound (the stopped one is killed first)."""

    def worker(i):
        path = tmp_path / f"hb-{i}.json"
        return Worker(local_rank=i, rank=i, proc=SimpleNamespace(poll=lambda: None),
                      log_path="", heartbeat_path=str(path), error_path="", started=0.0), path  # fmt: skip

    (w0, p0), (w1, p1) = worker(0), worker(1)
    group = WorkerGroup()
    group.workers = [w0, w1]
    c0 = WorkerChannel(path=str(p0), clock=lambda: 100.0)
    c1 = WorkerChannel(path=str(p1), clock=lambda: 100.0)
    c0.mark("pg_ready")
    c1.mark("pg_ready")
    os.utime(p0, (10.0, 10.0))
    os.utime(p1, (10.0, 10.0))
    assert group.stalest_progress(100.0) is None  # set-up, not judged
    c1.mark("recovering")
    os.utime(p1, (40.0, 40.0))
    seen = group.stalest_progress(100.0)
    assert seen.worker is w1 and seen.age == 60.0 and not seen.waiting
    assert recovering(read_heartbeat(str(p1))) and not recovering(read_heartbeat(str(p0)))
    # Its peer in the same recovery, waiting in the transfer: judged, with the longer bound.
    c0.mark("recovering")
    c0.waiting(True)
    os.utime(p0, (30.0, 30.0))
    seen = group.stalest_progress(100.0)
    assert seen.worker is w1 and seen.share == 60.0  # 70 s waiting is a share of 35
    for done in ("state_loaded", "ckpt_loaded", "ckpt_loading"):  # loaded, or a fall back
        assert recovering({"phases": {"recovering": 1.0}})
        assert not recovering({"phases": {"recovering": 1.0, done: 2.0}})
    c1.mark("state_loaded")
    assert not recovering(read_heartbeat(str(p1)))
    assert group.stalest_progress(100.0).worker is w0
    assert not recovering({"phases": {"recovering": 1.0, "state_loaded": 2.0}})
    assert not recovering({"phases": "x"}) and not recovering({})


@pytest.mark.parametrize("code", [126, 127])
def test_a_command_that_cannot_run_is_a_user_error_only_in_the_jobs_first_world(code):
    # At the job's start a misspelt executable: fail now. Later, a replacement node's
    # bad image or unmounted filesystem: that node's crash; the world goes on without it.
    assert decide(Observation(exit_codes=(code,), first_world=True)) == Outcome.USER_ERROR
    assert decide(Observation(exit_codes=(code,))) == Outcome.WORKER_FAILED
    assert decide(Observation(exit_codes=(1,), first_world=True)) == Outcome.WORKER_FAILED


def test_scale_up_is_immediate_or_waits_for_the_next_committed_checkpoint():
    base = {"exit_codes": (None,), "waiting": ("node-9",)}
    assert decide(Observation(**base, scale_up_policy="immediate")) == Outcome.SCALE_UP
    waiting = Observation(**base, checkpoint_at_waiting=10, checkpoint_now=10)
    assert decide(waiting) is None
    committed = Observation(**base, checkpoint_at_waiting=10, checkpoint_now=20)
    assert decide(committed) == Outcome.SCALE_UP
    first_ever = Observation(**base, checkpoint_at_waiting=-1, checkpoint_now=5)
    assert decide(first_ever) == Outcome.SCALE_UP


def test_a_job_that_succeeded_elsewhere_lets_our_workers_finish():
    assert decide(Observation(job_state=JobState.SUCCEEDED, exit_codes=(None,))) == (
        Outcome.FINISHED
    )


def test_a_node_that_alone_keeps_failing_while_the_job_trains_waits_longer():
    """A node whose worker dies at every start (a bad GPU) while the others train on:
    under scale_up immediate each re-join stalls the world for a re-form, so it backs
    off to five minutes, not the crash loop's ten seconds. A loop of the whole job (a
    script that crashes everywhere: nothing trained between) keeps the short cap."""
    alone = [crash_loop_pause(n, trained_elsewhere=True) for n in range(1, 13)]
    together = [crash_loop_pause(n, trained_elsewhere=False) for n in range(1, 13)]
    assert alone[0] == together[0] == 0.0  # the first failure re-forms at once
    assert together[-1] == CRASH_LOOP_CAP == 10.0
    assert alone[-1] == ALONE_CRASH_LOOP_CAP == 300.0
    assert alone == sorted(alone) and alone[:5] == together[:5]  # the same start


@given(st.integers(min_value=0, max_value=60))
def test_backoff_doubles_and_is_capped(n):
    value = backoff(n, base=0.5, cap=10.0)
    assert 0 <= value <= 10.0
    if n == 0:
        assert value == 0
    elif n < 5:
        assert value == 0.5 * 2 ** (n - 1)
    if n >= 1:
        assert backoff(n + 1) >= value


def test_workers_get_the_torchrun_environment_and_elasticd_variables():
    envs = worker_envs(
        WorkerEnvInputs(
            job="j",
            run_id="j-1",
            round=4,
            node_rank=1,
            nodes=3,
            nproc=2,
            master_addr="10.0.0.1",
            master_port=29400,
            restart_count=2,
            max_restarts=5,
            layout_path="/s/layout.json",
            job_path="/s/job.json",
            extra={"PATH": "/bin"},
        )
    )
    assert [e["RANK"] for e in envs] == ["2", "3"]
    assert [e["LOCAL_RANK"] for e in envs] == ["0", "1"]
    e = envs[1]
    assert (e["WORLD_SIZE"], e["LOCAL_WORLD_SIZE"], e["GROUP_RANK"]) == ("6", "2", "1")
    assert (e["MASTER_ADDR"], e["MASTER_PORT"]) == ("10.0.0.1", "29400")
    assert (e["TORCHELASTIC_RESTART_COUNT"], e["TORCHELASTIC_RUN_ID"]) == ("2", "j-1")
    assert (e["ELASTICD_JOB"], e["ELASTICD_ROUND"], e["ELASTICD_LAYOUT"]) == (
        "j", "4", "/s/layout.json",
    )  # fmt: skip
    assert e["PATH"] == "/bin"


def test_the_default_command_is_the_built_in_trainer_on_the_job_file():
    assert worker_argv(None, "/s/job.json", "/py") == ["/py", "-m", "trainer", "/s/job.json"]
    assert worker_argv(["bash", "x.sh"], "/s/job.json", "/py") == ["bash", "x.sh"]
    # A bare python is the agent's own interpreter (on PATH it may be one without torch);
    # a path is used as given.
    assert worker_argv(["python", "t.py"], "/s/job.json", "/py") == ["/py", "t.py"]
    assert worker_argv(["python3", "-m", "m"], "/s/job.json", "/py") == ["/py", "-m", "m"]
    assert worker_argv(["/usr/bin/python3", "t.py"], "/s/job.json", "/py")[0] == "/usr/bin/python3"


def test_the_latest_committed_checkpoint_is_read_from_the_pointer_or_the_manifests(tmp_path):
    assert latest_checkpoint_step(str(tmp_path / "none")) is None
    for step in (5, 10):
        (tmp_path / f"step-{step:09d}").mkdir()
        (tmp_path / f"step-{step:09d}" / "manifest.json").write_text("{}")
    (tmp_path / "step-000000015.tmp").mkdir()  # uncommitted: ignored
    (tmp_path / "step-000000020").mkdir()  # no manifest: ignored
    assert latest_checkpoint_step(str(tmp_path)) == 10
    (tmp_path / "latest").write_text("step-000000005\n")
    assert latest_checkpoint_step(str(tmp_path)) == 5
    # Hostile hints are no hints: not UTF-8, Unicode digits, a trailing newline in a name.
    (tmp_path / "latest").write_bytes(b"\xff\xfe" * 1000)
    assert latest_checkpoint_step(str(tmp_path)) == 10
    (tmp_path / "latest").write_text("step-\u0660\u0660\u0660\u0660\u0660\u0660\u0660\u0660\u0669")
    (tmp_path / "step-00000009\u0669").mkdir()
    (tmp_path / "step-00000009\u0669" / "manifest.json").write_text("{}")
    assert latest_checkpoint_step(str(tmp_path)) == 10


def test_the_worker_channel_writes_whole_heartbeats_and_turns_sigterm_into_a_flag(tmp_path):
    path = str(tmp_path / "hb.json")
    ch = WorkerChannel(path=path, rank=3, clock=lambda: 123.0)
    ch.mark("pg_ready")
    ch.progress(step=4, loss=2.5, tokens_per_s=1000.0)
    hb = read_heartbeat(path)
    assert hb["step"] == 4 and hb["loss"] == 2.5 and hb["rank"] == 3
    assert hb["phases"] == {"pg_ready": 123.0}
    previous = signal.getsignal(signal.SIGTERM)
    try:
        ch.install_preemption_handler()
        assert not ch.preempt_requested()
        os.kill(os.getpid(), signal.SIGTERM)
        assert ch.preempt_requested() and ch.preempt_agreed()
    finally:
        signal.signal(signal.SIGTERM, previous)


def test_outside_an_agent_the_channel_is_a_no_op(tmp_path):
    ch = WorkerChannel.from_env({})
    ch.install_preemption_handler()  # must not take over SIGTERM under plain torchrun
    assert signal.getsignal(signal.SIGTERM) == signal.SIG_DFL
    ch.progress(step=1)
    assert not ch.supervised and not ch.preempt_agreed()


@pytest.mark.parametrize(
    ("text", "kind", "target", "step"),
    [("kill-node=1@step=8", "kill-node", 1, 8), ("add-node@step=3", "add-node", None, 3),
     ("hang-worker=0@step=2", "hang-worker", 0, 2)],
)  # fmt: skip
def test_fault_specs_parse(text, kind, target, step):
    f = parse_fault(text)
    assert (f.kind, f.target, f.step) == (kind, target, step) and str(f) == text


@pytest.mark.parametrize("text", ["kill-node@step=3", "add-node=2@step=3", "explode=1@step=2",
                                  "kill-node=1@step=0", "kill-node=1"])  # fmt: skip
def test_bad_fault_specs_are_usage_errors(text):
    with pytest.raises(UsageError, match="--fault"):
        parse_fault(text)


def test_metrics_follow_prometheus_names_and_are_served():
    reg = CollectorRegistry()
    m = AgentMetrics(reg)
    m.world_size.labels("j").set(3)
    m.restarts.labels("j", "worker_failed").inc()
    m.recovery_seconds.labels("j", "process", "checkpoint").observe(4.2)
    m.set_worker_states("j", {"running": 2})
    port = m.serve(0, addr="127.0.0.1")
    body = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    assert 'elasticd_world_size{elasticd_job="j"} 3.0' in body
    assert 'elasticd_restarts_total{elasticd_job="j",reason="worker_failed"} 1.0' in body
    assert (
        'elasticd_recovery_seconds_bucket{elasticd_job="j",le="5.0",mode="process",'
        'source="checkpoint"} 1.0'
    ) in body
    m.lost_steps.labels("j").inc(3)
    body = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    assert 'elasticd_lost_steps_total{elasticd_job="j"} 3.0' in body
    assert 'elasticd_workers{elasticd_job="j",state="running"} 2.0' in body
    assert 'elasticd_workers{elasticd_job="j",state="failed"} 0.0' in body
    names = {metric.name for metric in reg.collect()}
    assert all(n.startswith("elasticd_") for n in names)
    # No series carries Prometheus' own target label.
    assert not any("job" in s.labels for metric in reg.collect() for s in metric.samples)


def test_an_agent_that_stops_leading_a_job_stops_exporting_its_gauges_and_a_finished_job_leaves():
    m = AgentMetrics(CollectorRegistry())
    m.world_size.labels("j").set(2)
    m.step.labels("j").set(7)
    m.restarts.labels("j", "peer_lost").inc()
    m.set_worker_states("j", {"running": 1})
    m.world_size.labels("other").set(1)
    m.drop_lead("j")
    samples = {(s.name, tuple(sorted(s.labels.items()))) for mf in m.registry.collect()
               for s in mf.samples}  # fmt: skip
    assert ("elasticd_world_size", (("elasticd_job", "j"),)) not in samples
    assert ("elasticd_job_step", (("elasticd_job", "j"),)) not in samples
    assert ("elasticd_restarts_total", (("elasticd_job", "j"), ("reason", "peer_lost"))) in samples
    assert m.job_names() == {"j", "other"}
    m.drop_job("j")
    assert m.job_names() == {"other"}


def test_a_metrics_port_in_use_is_a_one_line_error_naming_the_flag():
    first = AgentMetrics(CollectorRegistry())
    port = first.serve(0, addr="127.0.0.1")
    with pytest.raises(UsageError, match=f"--metrics-port: port {port} is in use"):
        AgentMetrics(CollectorRegistry()).serve(port, addr="127.0.0.1")


@given(
    st.lists(st.one_of(st.none(), st.floats(min_value=0, max_value=100)), min_size=1, max_size=6)
)
def test_recovery_parts_add_up_to_the_time_from_detection_to_the_last_known_moment(moments):
    from elasticd.agent.report import recovery_parts

    names = [f"p{i}" for i in range(len(moments))]
    parts = recovery_parts(10.0, list(zip(names, moments, strict=True)))
    known = [m for m in moments if m is not None]
    assert set(parts) == {n for n, m in zip(names, moments, strict=True) if m is not None}
    assert all(v >= 0 for v in parts.values())
    end = max([10.0, *known])
    assert sum(parts.values()) == pytest.approx(end - 10.0, abs=1e-2)


def test_sigterm_gets_the_full_grace_only_where_a_save_can_succeed():
    from elasticd.agent.policy import stop_plan

    assert stop_plan(Outcome.PREEMPTED, 30).grace == 30
    assert stop_plan(Outcome.SCALE_UP, 30).grace == 30
    assert stop_plan(Outcome.PEER_LOST, 30).grace <= 1.0
    assert stop_plan(Outcome.WORKER_FAILED, 30).grace <= 1.0
    assert stop_plan(Outcome.WORKER_HUNG, 30).kill
    assert stop_plan(Outcome.FINISHED, 30).wait_first > 0


# -- the failure rules, the scrubbed environment, placement ------------------------------------


def test_a_user_error_exit_fails_the_job_and_a_lost_peer_still_comes_first():
    from elasticd.agent.policy import Observation, Outcome, decide

    assert decide(Observation(exit_codes=(2, None))) == Outcome.USER_ERROR
    assert decide(Observation(exit_codes=(2,), lost=("n1",))) == Outcome.PEER_LOST
    assert not Outcome.USER_ERROR.reforms and not Outcome.USER_ERROR.counts_as_failure


def test_a_fenced_round_ends_at_once_and_rejoins_without_counting_a_failure():
    from elasticd.agent.policy import Observation, Outcome, decide, stop_plan

    assert decide(Observation(fenced=True, exit_codes=(None,))) == Outcome.FENCED
    assert Outcome.FENCED.reforms and not Outcome.FENCED.counts_as_failure
    assert stop_plan(Outcome.FENCED, 30.0).kill


def test_workers_never_see_etcd_credentials_and_see_only_their_own_devices():
    from elasticd.agent.policy import WorkerEnvInputs, worker_envs

    inherited = {"PATH": "/bin", "ELASTICD_ETCD_PASSWORD": "s3cret", "ETCDCTL_PASSWORD": "x",
                 "ELASTICD_ETCD": "etcd-0:2379", "CUDA_VISIBLE_DEVICES": "0,1,2,3"}  # fmt: skip
    envs = worker_envs(
        WorkerEnvInputs(job="j", run_id="j-1", round=1, node_rank=0, nodes=1, nproc=2,
                        master_addr="a", master_port=1, restart_count=0, max_restarts=1,
                        layout_path="l", job_path="p", extra=inherited, devices=["2", "3"])
    )  # fmt: skip
    for local, env in enumerate(envs):
        assert env["PATH"] == "/bin" and env["LOCAL_RANK"] == str(local)
        assert env["CUDA_VISIBLE_DEVICES"] == "2,3"
        assert not {"ELASTICD_ETCD_PASSWORD", "ETCDCTL_PASSWORD", "ELASTICD_ETCD"} & set(env)


def test_slots_map_to_the_agents_own_visible_devices():
    from elasticd.agent.policy import device_ids, take_slots

    assert device_ids(2, None) == ["0", "1"]
    assert device_ids(2, "4,5,6") == ["4", "5"]
    assert device_ids(4, "4,5") == ["0", "1", "2", "3"]  # too few named: plain indices
    assert take_slots({3, 1, 2}, 2) == [1, 2]
    assert take_slots({1}, 2) is None


@pytest.mark.parametrize(("visible", "slots", "ids"), [
    ("0,1,2,3", 4, ["0", "1", "2", "3"]),  # Slurm --gpus-per-node=4 on an 8-GPU node
    ("5", 1, ["5"]),
    ("", 0, []),  # set and empty: CUDA sees no device
    (None, 8, [str(i) for i in range(8)]),
])  # fmt: skip
def test_an_agent_counts_only_the_gpus_it_may_see(monkeypatch, tmp_path, visible, slots, ids):
    """The driver lists every GPU of the node (/proc is not filtered); an agent given fewer
    (CUDA_VISIBLE_DEVICES) handed out GPUs 4 to 7 that were not its own."""
    from elasticd.agent import daemon

    monkeypatch.setattr(daemon, "count_devices", lambda: 8)
    config = daemon.AgentConfig(etcd=None, node_id="n", addr="127.0.0.1", nproc=None,
                                state_dir=str(tmp_path), visible_devices=visible)  # fmt: skip
    agent = daemon.Agent(config)
    assert (agent.slots or 0) == slots and agent._ids == ids


def test_the_default_address_is_the_route_to_etcd_when_the_host_name_is_loopback(monkeypatch):
    """Debian maps the host name to 127.0.1.1: advertised as the node's address, every
    remote worker dialled its own loopback for the master."""
    import socket

    from elasticd.agent.daemon import default_addr

    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        try:
            probe.connect(("192.0.2.1", 9))  # TEST-NET: only the route is looked up
        except OSError:
            pytest.skip("no route off this host")
        mine = probe.getsockname()[0]
    real = socket.gethostbyname
    monkeypatch.setattr(socket, "gethostbyname",
                        lambda h: "127.0.1.1" if h == socket.gethostname() else real(h))  # fmt: skip
    # This host's own address stands in for a remote etcd: the route to it starts there.
    assert default_addr(("127.0.0.1:2379", f"{mine}:2379")) == mine
    # etcd on this host (named by its loopback name): the route off the host, which the
    # other nodes reach (the first node of a Slurm allocation runs etcd).
    assert default_addr(("127.0.0.1:2379",)) == mine
    assert default_addr(()) == "127.0.1.1"  # an embedded etcd: one machine


def test_commands_run_only_where_allowed():
    from elasticd.agent.policy import command_allowed

    assert command_allowed(None, "none")
    assert not command_allowed(["python3", "x.py"], "none")
    assert command_allowed(["python3", "x.py"], "all")
    assert command_allowed(["/usr/bin/python3", "x.py"], ["python3"])
    assert command_allowed(["/opt/py/bin/python", "x.py"], ["/opt/py/bin/python"])
    assert not command_allowed(["bash", "-c", "rm -rf /"], ["python3"])


def test_the_queue_says_why_a_job_cannot_start():
    from elasticd.agent.policy import queue_reason

    free = {"free": 1, "allow_commands": "all", "jobs": []}
    busy = {"free": 0, "allow_commands": "all", "jobs": ["other"]}
    plain = {"free": 1, "allow_commands": "none", "jobs": []}

    def why(nodes, *, min_nodes=1, nproc=1, command=None):
        return queue_reason(job="j", nproc=nproc, min_nodes=min_nodes, command=command,
                            nodes=nodes)  # fmt: skip

    assert why({}).startswith("queued: no agent is registered")
    assert why({"a": free}) is None
    assert why({"a": free, "b": busy}, min_nodes=2) == (
        "queued: needs 2 nodes with 1 free slot, 1 of 2 registered have room"
    )
    assert why({"a": free}, nproc=2).endswith(
        "needs 1 node with 2 free slots, 0 of 1 registered have room"
    )
    assert why({"a": {**busy, "jobs": ["j"]}}) is None  # it holds the job already
    assert why({"a": plain}, command=["python3"]).startswith("refused: no agent runs custom")
    assert why({"a": {"free": None, "allow_commands": "all"}}, nproc=64) is None  # no accounting


def test_the_restart_limit_counts_failures_in_a_row_without_progress():
    st: dict = {"restarts": 0}
    count_failure(st, None)  # before any step
    assert (st["restarts"], st["restart_streak"]) == (1, 1)
    count_failure(st, None)
    assert st["restart_streak"] == 2
    assert restart_limit_reached(st, 1).startswith(
        "restart limit reached (1): 2 failures in a row before any step; last: "
    )
    assert restart_limit_reached(st, 2) is None
    note_furthest_step(st, 40)  # trained: the next failure starts a new streak
    count_failure(st, 38)  # the claimer saw less than the status: the status's counts
    assert (st["restarts"], st["restart_streak"], st["furthest_step"]) == (3, 1, 40)
    count_failure(st, 40)  # resumed from a checkpoint, trained up to 40 again: no progress
    assert st["restart_streak"] == 2
    count_failure(st, 41)  # the claimer saw a step the status has not caught up with
    assert (st["restart_streak"], st["furthest_step"], st["streak_step"]) == (1, 41, 41)
    note_furthest_step(st, 30)  # steps trained again never lower it
    note_furthest_step(st, True)  # nor does what is no step
    assert st["furthest_step"] == 41
    count_failure(st, 41)
    count_failure(st, 41)
    assert "3 failures in a row without training past step 41" in restart_limit_reached(st, 2)
    uncount_failure(st)  # that round lost a node: no restart spent
    assert (st["restarts"], st["restart_streak"]) == (6, 2)
    assert restart_limit_reached(st, 2) is None
    # A status written before this rule (no streak yet) starts one.
    old = {"restarts": 7, "step": 90}
    count_failure(old, 95)
    assert (old["restarts"], old["restart_streak"], old["furthest_step"]) == (8, 1, 95)


def test_a_status_write_that_lags_the_count_is_not_progress():
    # The agent that counted round 5's failure saw no step of its own (a node of spare
    # ranks); rank 0's last write of round 5 lands after the count.
    st: dict = {"restarts": 0, "furthest_step": 38}
    count_failure(st, None, 5)
    note_furthest_step(st, 41, 5)  # completed before the failure
    assert (st["furthest_step"], st["streak_step"]) == (41, 41)
    count_failure(st, 41, 6)  # the crash at step 42 again
    assert st["restart_streak"] == 2
    note_furthest_step(st, 45, 7)  # round 7 trained past it: progress
    count_failure(st, 45, 7)
    assert st["restart_streak"] == 1


@pytest.mark.parametrize(
    ("nodes", "furthest", "fails"),
    [(["a", "b"], 5, False), (["a", "b", "c"], 5, True), (["a", "b", "c"], 9, False)],
    ids=["a-node-was-lost", "no-node-lost", "trained-on-since"],
)
def test_the_next_world_decides_a_reached_restart_limit(etcd_client, nodes, furthest, fails):
    """Round 1 of a world of a, b, c ended in a counted failure that reached
    max_restarts 0. Node rank 0 of round 2 decides: a lost node means no restart was used;
    with every node back the job fails; a decision left over from an older world is void
    once the job trained past the failure's mark."""
    from elasticd.agent.report import JobReporter
    from elasticd.jobs import JobRegistry
    from elasticd.jobspec import parse_job
    from elasticd.metrics import AgentMetrics

    name = f"limit-{os.getpid()}-{len(nodes)}-{furthest}"
    reg = JobRegistry(etcd_client)
    reg.submit(parse_job({"name": name}))
    reg.set_state(name, JobState.RUNNING, "round 1")
    reg.set_state(name, JobState.RECOVERING, "worker_failed")
    metrics = CollectorRegistry()
    reporter = JobReporter(name=name, registry=reg, metrics=AgentMetrics(metrics))
    reporter.for_round(None)
    reg.update_status(name, lambda s: s.update(nodes=["a", "b", "c"], furthest_step=5))
    reporter.count(round_=1, claim={"reason": "worker_failed", "step": 5, "detail": "x"},
                   limit=0)  # fmt: skip
    assert "limit_reached" in reg.get(name).status and reg.get(name).state == "recovering"
    reg.update_status(name, lambda s: s.update(furthest_step=furthest))
    reporter.reattribute(SimpleNamespace(round=2, nodes=nodes))
    record = reg.get(name)
    assert reporter.job_failed == fails and (record.state == "failed") == fails
    assert ("limit_reached" in record.status) == fails  # kept until the job is failed
    if fails:
        assert record.reason.startswith("restart limit reached (0): 1 failures in a row")
    else:
        assert record.status["restart_streak"] == (0 if len(nodes) == 2 else 1)
    counted = generate_latest(metrics).decode()
    reason = "worker_failed" if len(nodes) == 3 else "peer_lost"
    assert f'elasticd_restarts_total{{elasticd_job="{name}",reason="{reason}"}} 1.0' in counted


def registered(etcd_client, prefix: str, restart: dict):
    """A job submitted to the registry on the real etcd, running."""
    from elasticd.jobs import JobRegistry
    from elasticd.jobspec import parse_job

    reg = JobRegistry(etcd_client)
    job = parse_job({"name": f"{prefix}-{os.getpid()}", "restart": restart})
    reg.submit(job)
    reg.set_state(job.name, JobState.RUNNING, "round 5")
    return reg, job


def agent_of(reg, job, node: str, metrics: CollectorRegistry | None = None):
    """A node's JobRunner as far as recording a round's end goes (its registry and
    reporter real, on the real etcd)."""
    from elasticd.agent.report import JobReporter
    from elasticd.agent.runner import JobRunner

    r = object.__new__(JobRunner)
    r.name, r.job, r._registry, r._limit = job.name, job, reg, 3
    metrics = metrics if metrics is not None else CollectorRegistry()
    r._report = JobReporter(name=job.name, registry=reg, metrics=AgentMetrics(metrics))
    r._report.for_round(None)
    r._node, r._furthest_step, r._clock = SimpleNamespace(node_id=node), 7, lambda: 100.0
    r._pending_recovery, r._early_claim, r._failures_here = None, None, 0
    return r


def test_a_hung_workers_failure_is_claimed_and_counted_before_the_kill_even_if_the_kill_fails(
    etcd_client,
):
    """The agent of a hung worker names the cause (worker_hung) and counts it before it
    kills the worker: the kill fails the peers' collectives at once, and their agents must
    find the cause taken. Were the kill then to fail (a worker SIGKILL cannot reap within
    the wait, stuck in the kernel), the round ends without its usual record, and the
    failure still counts once; the peer's agent adopts the claim and counts nothing."""
    import subprocess

    from elasticd.agent.policy import Outcome

    reg, job = registered(etcd_client, "hung-claim", {"mode": "inprocess", "hang_timeout": 5})
    name = job.name
    events = []

    class Unreapable:  # SIGKILLed, but not gone within the wait
        def kill(self):
            events.append(("kill", reg.get(name).status.get("history", [])))

        def poll(self):
            return None

        def wait(self, timeout=None):
            raise subprocess.TimeoutExpired("worker", timeout)

    hung = SimpleNamespace(proc=Unreapable(), rank=0)
    workers = SimpleNamespace(
        dump_stacks=lambda: 0, kill=lambda: None,
        stalest_progress=lambda now: SimpleNamespace(worker=hung, age=60.0, waiting=False),
    )  # fmt: skip
    rnd = SimpleNamespace(
        number=5,
        carried=0,
        first_step_seen=True,
        workers=workers,
        stuck=[],
        unstarted=[],
        recovery=None,
    )

    a = agent_of(reg, job, "node-a")
    a._start_round = lambda world, joined_at: rnd
    a._supervise = lambda handler, r: (Outcome.WORKER_HUNG, "rank 0: no progress for 60.0 s")
    with pytest.raises(subprocess.TimeoutExpired):
        a._round(None, None, 0.0)
    (kill,) = events
    assert [(e["reason"], e["node"]) for e in kill[1]] == [("worker_hung", "node-a")]
    agent_of(reg, job, "node-b")._record_failure(
        rnd, Outcome.COLLECTIVE_FAILED, "rank 1: Connection reset by peer", 100.0, 100.5
    )
    status = reg.get(name).status
    failures = [e for e in status["history"] if e["kind"] == "failure"]
    assert [(e["reason"], e["detail"]) for e in failures] == [
        ("worker_hung", "rank 0: no progress for 60.0 s")
    ]
    assert status["restart_streak"] == 1 and status["reforms"] == 1


GLOO_CLOSED = (
    "rank 0: exit code 1: RuntimeError: [../gloo/transport/tcp/pair.cc:553] Connection closed "
    "by peer [127.0.0.1]:45730"
)


@pytest.mark.parametrize(
    ("outcome", "detail", "by_peer"),
    [
        ("worker_failed", GLOO_CLOSED, True),
        (
            "collective_failed",
            "rank 2: Read error [127.0.0.1]:21929: Connection reset by peer",
            True,
        ),
        (  # the round's store, on a peer node, shut (its group was being set up)
            "collective_failed",
            "rank 1: DistStoreError: Failed to recv, got 0 bytes. Connection was likely "
            "closed. Did the remote server shutdown or crash?",
            True,
        ),
        ("worker_failed", GLOO_CLOSED + "; rank 1: exit code 1: CUDA out of memory", False),
        ("worker_failed", "rank 1: signal 9: Connection closed by peer (log x)", False),
        ("worker_failed", "rank 1: exit code 1: ValueError: bad batch", False),
        ("collective_failed", "rank 1: InjectedCollectiveFault: fail-collective at step 5", False),
        ("worker_hung", "rank 1: no progress for 4.0 s", False),
        ("worker_failed", "", False),
    ],
)
def test_a_failure_that_is_only_collectives_failing_on_a_peer_is_told_apart(
    outcome, detail, by_peer
):
    from elasticd.agent.policy import Outcome, failed_on_a_peer

    assert failed_on_a_peer(Outcome(outcome), detail) is by_peer


@pytest.mark.parametrize("first", ["peer", "killed"])
def test_the_history_names_the_killed_worker_whichever_agent_claimed_first(etcd_client, first):
    """Node b's worker is killed; node a's worker fails at once on its closed socket.
    Whichever agent writes the claim first, the failure counts once, and once the next
    world forms, the history, last_failure, the counted reason and the recovery record's
    reason name the killed worker (signal 9 on node b), not the socket it closed."""
    from elasticd.agent.policy import Outcome

    reg, job = registered(etcd_client, f"cause-{first}", {})
    metrics = CollectorRegistry()
    a, b = agent_of(reg, job, "node-a", metrics), agent_of(reg, job, "node-b")
    rnd = SimpleNamespace(number=5, first_step_seen=True, recovery=None, workers=None)
    killed = "rank 1: signal 9 (log /x/local-1.log)"
    records = [(a, Outcome.WORKER_FAILED, GLOO_CLOSED), (b, Outcome.WORKER_FAILED, killed)]
    for agent, outcome, detail in records if first == "peer" else records[::-1]:
        agent._record_failure(rnd, outcome, detail, 100.0, 100.2)
    claim = json.loads(etcd_client.get(f"/elasticd/jobs/{job.name}/failures/5").value)
    assert claim["node"] == ("node-a" if first == "peer" else "node-b")
    a._report.reattribute(SimpleNamespace(round=6, nodes=["node-a", "node-b"]))
    status = reg.get(job.name).status
    (failure,) = [e for e in status["history"] if e["kind"] == "failure"]
    assert (failure["reason"], failure["node"], failure["detail"]) == (
        "worker_failed",
        "node-b",
        killed,
    )
    assert failure["counted"] and status["restart_streak"] == 1
    assert status["last_failure"] == f"round 5: worker_failed: {killed}"
    assert a._report.noted_reason == ("worker_failed" if first == "peer" else None)
    counted = generate_latest(metrics).decode()
    assert (
        f'elasticd_restarts_total{{elasticd_job="{job.name}",reason="worker_failed"}} 1.0'
        in counted
    )


@pytest.mark.parametrize("first", ["peer", "scale_up", "peer_and_a_crash"])
def test_a_peers_failure_claim_that_was_a_scale_up_uses_no_restart(etcd_client, first):
    """Node b ends round 5 for a waiting node; node a's worker sees its collective fail on
    the connections that end shut, and node a's claim may come first (a CI run: the job,
    max_restarts 0, failed as a newcomer joined). Once the next world forms, the round's
    end is the scale-up, counting no failure, whichever claim came first; unless a worker
    also failed on its own."""
    from elasticd.agent.policy import Outcome

    reg, job = registered(etcd_client, "scaleup-" + first.replace("_", "-"), {"max_restarts": 0})
    a, b = agent_of(reg, job, "node-a"), agent_of(reg, job, "node-b")
    c = agent_of(reg, job, "node-c")
    a._limit = b._limit = c._limit = 0
    rnd = SimpleNamespace(number=5, first_step_seen=True, recovery=None, workers=None)
    closed = "rank 1: " + GLOO_CLOSED.split(": ", 1)[1].replace("exit code 1: ", "")
    records = [(a, Outcome.COLLECTIVE_FAILED, closed), (b, Outcome.SCALE_UP, "waiting node-d")]
    if first == "peer_and_a_crash":
        records.append((c, Outcome.WORKER_FAILED, "rank 2: exit code 1: ValueError: bad batch"))
    for agent, outcome, detail in records if first != "scale_up" else records[::-1]:
        agent._record_failure(rnd, outcome, detail, 100.0, 100.2)
    b._report.reattribute(SimpleNamespace(round=6, nodes=["node-a", "node-b", "node-d"]))
    status = reg.get(job.name).status
    (event,) = [e for e in status["history"] if e["kind"] == "failure"]
    if first == "peer_and_a_crash":
        # The crash counts (here as the claim's words): the job is past max_restarts 0.
        assert event["reason"] == "collective_failed" and status["restart_streak"] == 1
        assert reg.get(job.name).state == JobState.FAILED
        return
    assert (event["reason"], event["node"], event["detail"]) == (
        "scale_up", "node-b", "waiting node-d"
    )  # fmt: skip
    assert status.get("restart_streak", 0) == 0 and "limit_reached" not in status
    assert "last_failure" not in status and reg.get(job.name).state != JobState.FAILED
    assert b._report.noted_reason == ("scale_up" if first == "peer" else None)


def test_a_lost_node_still_beats_a_noted_cause(etcd_client):
    """A node that died takes its worker with it: its peers' claim becomes peer_lost in the
    next world, formed without it, whatever cause was noted."""
    from elasticd.agent.policy import Outcome

    reg, job = registered(etcd_client, "cause-lost", {})
    reg.update_status(job.name, lambda s: s.update(nodes=["node-a", "node-b", "node-c"]))
    a, b = agent_of(reg, job, "node-a"), agent_of(reg, job, "node-b")
    rnd = SimpleNamespace(number=5, first_step_seen=True, recovery=None, workers=None)
    a._record_failure(rnd, Outcome.WORKER_FAILED, GLOO_CLOSED, 100.0, 100.2)
    b._record_failure(rnd, Outcome.WORKER_FAILED, "rank 1: signal 9", 100.0, 100.2)
    lost = a._report.reattribute(SimpleNamespace(round=6, nodes=["node-a", "node-b"]))
    assert lost == ["node-c"] and a._report.noted_reason is None
    (failure,) = [e for e in reg.get(job.name).status["history"] if e["kind"] == "failure"]
    assert failure["reason"] == "peer_lost" and failure["detail"].startswith("lost node-c (")


def test_a_failure_line_drops_torchs_rank_prefixes(tmp_path):
    """torch prefixes an uncaught exception's stderr lines with ``[rankN]:`` once per
    process group the process made: after an in-process round the failure read
    ``rank 0: exit code 1: [rank0]: [rank0]: RuntimeError: ...``."""
    from elasticd.agent.workers import last_line

    log = tmp_path / "rank-0.log"
    log.write_text("Traceback ...\n[rank0]: [rank0]: RuntimeError: the state [rank1]: x\n")
    assert last_line(str(log)) == "RuntimeError: the state [rank1]: x"
    log.write_text("plain line\n")
    assert last_line(str(log)) == "plain line"
    # An error raised in a future's callback (DDP's comm hook outside an in-process round:
    # a lost peer) ends with pybind11's frames; the failure read "rank 0: exit code 1:
    # /.../elasticd/inprocess.py(1502): <lambda>".
    log.write_text(
        "[rank0]: RuntimeError: Got the following error when running the callback: "
        "RuntimeError: [pair.cc:537] Read error [127.0.0.1]:10439: Connection reset by peer.\n"
        "[rank0]: At:\n[rank0]:   /work/elasticd/inprocess.py(1502): <lambda>\n"
        "[rank0]:   /x/y.py(7): f\n\n"
    )
    assert last_line(str(log)).endswith("Read error [127.0.0.1]:10439: Connection reset by peer.")
    log.write_text("At:\n  /x/y.py(7): f\n")  # nothing before "At:": the last line stays
    assert last_line(str(log)) == "/x/y.py(7): f"


@pytest.mark.parametrize(
    ("code", "want"),
    [(-signal.SIGKILL, Outcome.WORKER_FAILED), (-signal.SIGSEGV, Outcome.WORKER_FAILED),
     (-signal.SIGABRT, Outcome.PEER_LOST), (1, Outcome.PEER_LOST), (None, Outcome.PEER_LOST)],
)  # fmt: skip
def test_a_local_worker_killed_by_a_signal_is_our_cause_even_when_a_peer_moved_on(code, want):
    """SIGKILL of a worker: its peer's collective fails at once, the peer's agent re-joins
    the next round, and this agent saw both its worker dead and the peer "lost" in one
    tick. It said peer_lost, and the kill went on record as the peer's collective failure
    (an SRE review, one kill in two). A signal that can be the peer's doing (NCCL's abort)
    or a plain error exit stays a symptom of the loss."""
    assert decide(Observation(lost=("n1",), exit_codes=(code, None))) == want


def test_a_round_that_failed_before_its_first_step_carries_its_outage_into_the_next(etcd_client):
    """A recovery that failed before its first step (a second fault during it) is one
    outage with the recovery after it: the next pending recovery keeps the first failure's
    detection and counts the attempts, and the failure's claim carries them to the nodes
    that cannot tell (a newcomer, a spare). A round that trained starts a new outage, as
    does a round of a node whose local rank 0 is a spare (it never sees a step) or that
    sat rounds out (its record is older)."""
    from elasticd.agent.policy import Outcome
    from elasticd.jobspec import parse_job
    from elasticd.layout import plan

    reg, job = registered(etcd_client, "outage", {"mode": "inprocess"})
    a, b = agent_of(reg, job, "node-a"), agent_of(reg, job, "node-b")
    tp2 = parse_job({"name": "tp2", "parallel": {"tp": 2}, "nodes": {"min": 2, "max": 3}})

    def round_(number, *, trained, recovery, rank=0):
        workers = SimpleNamespace(workers=[SimpleNamespace(local_rank=0, rank=rank)])
        return SimpleNamespace(number=number, first_step_seen=trained, recovery=recovery,
                               layout=plan(3, tp2), workers=workers)  # fmt: skip

    def fail(agent, rnd, at):
        agent._record_failure(rnd, Outcome.COLLECTIVE_FAILED, GLOO_CLOSED, at, at + 0.2)
        return agent._pending_recovery

    first = {"reason": "peer_lost", "detected_at": 90.0, "stopped_at": 90.1, "after_round": 4}
    pending = fail(a, round_(5, trained=False, recovery=first), 100.0)
    assert (pending["detected_at"], pending["outage_from"], pending["attempts"]) == (100.0, 90.0, 2)
    # Node b, a spare in round 5 (rank 2 of tp2 on three ranks), cannot tell by itself:
    # the claim node a wrote tells it.
    assert reg.claim_of(job.name, 5)["outage_from"] == 90.0
    told = fail(b, round_(5, trained=False, recovery=None, rank=2), 100.0)
    assert (told["outage_from"], told["attempts"]) == (90.0, 2)
    # A third attempt fails too: still from the first failure.
    pending = fail(a, round_(6, trained=False, recovery=pending), 110.0)
    assert (pending["outage_from"], pending["attempts"]) == (90.0, 3)
    # A round that completed a step: its failure is a new outage.
    pending = fail(a, round_(7, trained=True, recovery=pending), 120.0)
    assert "outage_from" not in pending and "attempts" not in pending
    # Our only worker is a spare: "no step seen" says nothing about the round.
    pending = fail(a, round_(8, trained=False, recovery=first | {"after_round": 7}, rank=2), 130.0)
    assert "outage_from" not in pending
    # We sat rounds 5..8 out (a crash loop's back-off): our record is of round 4's end.
    pending = fail(a, round_(9, trained=False, recovery=first), 140.0)
    assert "outage_from" not in pending
