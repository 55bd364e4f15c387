"""elasticd.inprocess without agents: the socket abort, the control file, error classes,
and (on a CUDA machine) the NCCL abort path."""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import textwrap
import threading
import time
from types import SimpleNamespace

import pytest

from elasticd.agent.launch import write_control
from elasticd.inprocess import _Control, _socket_fds, is_comm_error, shutdown_new_sockets


@pytest.fixture(autouse=True)
def close_controls(monkeypatch):
    """Stop every control watcher a test made: one left in an aborted round would go on
    shutting the sockets of the tests after it (a worker has one, for its whole life)."""
    made = []
    init = _Control.__init__

    def tracked(self, *args, **kwargs):
        init(self, *args, **kwargs)
        made.append(self)

    monkeypatch.setattr(_Control, "__init__", tracked)
    yield
    for control in made:
        control.close()


def test_shutting_down_new_sockets_leaves_old_ones_and_listeners_alone():
    old_a, old_b = socket.socketpair()
    before = set(_socket_fds().values())
    listener = socket.create_server(("127.0.0.1", 0))
    client = socket.create_connection(listener.getsockname())
    server, _ = listener.accept()
    try:
        assert shutdown_new_sockets(before) == 2  # client and server, not the listener
        assert client.recv(1) == b"" and server.recv(1) == b""  # both see the end at once
        old_a.sendall(b"x")
        assert old_b.recv(1) == b"x"  # from before the round: untouched
        listener.settimeout(0.1)
        with pytest.raises(TimeoutError):
            listener.accept()  # still listening (a shut listener aborts gloo)
    finally:
        for s in (old_a, old_b, listener, client, server):
            s.close()


def test_a_worker_leaving_an_aborted_round_does_not_read_the_hosts_tcp_table_every_poll(
    monkeypatch,
):
    """The watcher re-checks an aborted round every 10 ms until the worker leaves it. Once
    its sockets are shut and its listener known, a poll lists only this process's fds:
    ``/proc/net/tcp`` is the whole network namespace's (thousands of lines on a busy GPU
    host), read again only when a new socket appears."""
    import elasticd.inprocess as ei

    before = set(_socket_fds().values())
    listener = socket.create_server(("127.0.0.1", 0))
    client = socket.create_connection(listener.getsockname())
    server, _ = listener.accept()
    try:
        shut, listening = ei._shutdown_new(before)
        assert len(shut) == 2 and listening == {_socket_fds()[listener.fileno()]}
        handled = before | shut | listening
        reads = []
        real = ei._tcp_inodes
        monkeypatch.setattr(ei, "_tcp_inodes", lambda: reads.append(1) or real())
        assert ei._shutdown_new(handled) == (set(), set()) and reads == []
        late = socket.create_connection(listener.getsockname())  # a socket opened late
        try:
            assert len(ei._shutdown_new(handled)[0]) == 1 and reads == [1]  # not accepted
        finally:
            late.close()
    finally:
        for s in (listener, client, server):
            s.close()


def test_the_control_file_ends_a_round_and_hands_over_the_next(tmp_path):
    path = str(tmp_path / "control.json")
    env = {"ELASTICD_ROUND": "3", "LOCAL_RANK": "1"}
    control = _Control(path, 1, env)
    control.begin(3)
    assert not control.aborted(3)
    write_control(path, round_=3, state="abort")
    deadline = time.monotonic() + 5
    while not control.aborted(3):
        assert time.monotonic() < deadline
        time.sleep(0.01)
    got = {}
    waiter = threading.Thread(target=lambda: got.update(control.next_round(3)))
    waiter.start()
    write_control(path, round_=4, state="run", envs={"0": {"RANK": "0"}, "1": {"RANK": "5"}})
    waiter.join(5)
    assert got == {"RANK": "5"}  # our local rank's environment
    assert not control.aborted(4)


def test_a_round_ended_before_its_store_opened_is_left_at_once_not_after_the_timeout():
    # Rank 0 may never open a round's store (its agent ended the round right after
    # starting it, and rank 0 read only the abort). The other ranks wait for that store
    # with nothing connected for the socket abort to shut: the abort itself must end it.
    from datetime import timedelta

    from elasticd.inprocess import RoundAborted, _open_round

    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {"RANK": "1", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1",
           "MASTER_PORT": str(port), "ELASTICD_ROUND": "7"}  # fmt: skip
    ended = threading.Event()
    threading.Timer(0.3, ended.set).start()
    t0 = time.monotonic()
    with pytest.raises(RoundAborted, match="before its store"):
        _open_round(env, backend="gloo", timeout=timedelta(seconds=30), aborted=ended.is_set)
    assert time.monotonic() - t0 < 10  # not the group timeout (30 s here, 10 min in run)


def test_sockets_a_round_opens_after_its_abort_are_shut_until_it_is_left(tmp_path):
    # A round still starting when its abort is read opens its store and pairs after the
    # abort: they must be shut too, or they would wait for peers that left.
    path = str(tmp_path / "control.json")
    control = _Control(path, 0, {"ELASTICD_ROUND": "3"})
    control.begin(3)
    write_control(path, round_=3, state="abort")
    deadline = time.monotonic() + 5
    while not control.aborted(3):
        assert time.monotonic() < deadline
        time.sleep(0.01)
    listener = socket.create_server(("127.0.0.1", 0))
    late = socket.create_connection(listener.getsockname())  # opened after the abort
    served, _ = listener.accept()
    late.settimeout(5)
    try:
        assert late.recv(1) == b""  # shut by the watcher, not by us
        control.left(3)
        after = socket.create_connection(listener.getsockname())  # between rounds: ours
        peer, _ = listener.accept()
        with after, peer:
            time.sleep(0.2)  # twenty watcher polls
            after.sendall(b"x")
            assert peer.recv(1) == b"x"
    finally:
        for s in (listener, late, served):
            s.close()


def test_a_round_ended_before_it_began_is_never_trained_and_the_next_one_is(tmp_path, monkeypatch):
    # The agent's abort for round 2 came with (or before) its start: the worker must not
    # open round 2 (its peers may have skipped it) but wait for round 3.
    from elasticd.inprocess import run

    path = str(tmp_path / "control.json")
    write_control(path, round_=2, state="abort")
    env = {"ELASTICD_RESTART_MODE": "inprocess", "ELASTICD_CONTROL_FILE": path,
           "ELASTICD_ROUND": "2", "RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0"}  # fmt: skip
    for key, value in env.items():  # run() installs them: undone after the test
        monkeypatch.setenv(key, value)
    trained, out = [], {}

    def train(ctx):
        trained.append(ctx.round)
        return "done"

    worker = threading.Thread(target=lambda: out.setdefault("r", run(train, env=env)))
    worker.start()
    time.sleep(0.3)  # thirty watcher polls: round 2 would have been opened by now
    assert trained == []
    write_control(path, round_=3, state="run",
                  envs={"0": {**env, "ELASTICD_ROUND": "3"}})  # fmt: skip
    worker.join(30)
    assert trained == [3] and out["r"] == "done"


def test_communication_errors_are_told_from_bugs():
    import torch.distributed as dist

    gloo = RuntimeError("[gloo/transport/tcp/pair.cc:553] Connection closed by peer")
    assert is_comm_error(gloo)
    assert is_comm_error(dist.DistNetworkError("Connection reset by peer"))
    assert not is_comm_error(ValueError("bad shape"))
    assert not is_comm_error(KeyError("step"))
    assert not is_comm_error(RuntimeError("mat1 and mat2 shapes cannot be multiplied"))
    # A script's own connections and timeouts are its own (review: these counted as a
    # lost peer, and three in a row ended the process).
    assert not is_comm_error(ConnectionResetError("Connection reset by peer"))
    assert not is_comm_error(RuntimeError("DataLoader timed out after 60 seconds"))
    assert not is_comm_error(TimeoutError("timed out"))

    class TrainError(Exception):
        pass

    # A script that wraps a failed collective in its own error: the cause is what counts.
    try:
        try:
            raise gloo
        except RuntimeError as exc:
            raise TrainError("step 7 failed") from exc
    except TrainError as exc:
        assert is_comm_error(exc)
    try:
        try:
            raise gloo
        except RuntimeError:
            raise ValueError("in the handler")  # noqa: B904
    except ValueError as exc:
        assert is_comm_error(exc)
    assert is_comm_error(ExceptionGroup("workers", [ValueError("x"), gloo]))


@pytest.mark.gpu
def test_an_nccl_round_is_aborted_and_a_new_one_works_in_the_same_process(tmp_path):
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    code = textwrap.dedent(
        """
        import torch, torch.distributed as dist
        from datetime import timedelta
        from elasticd.inprocess import _open_round, _close_round
        torch.cuda.set_device(0)
        for r in (1, 2):
            _open_round({"RANK": "0", "WORLD_SIZE": "1", "ELASTICD_ROUND": str(r)},
                        backend="nccl", timeout=timedelta(seconds=60))
            t = torch.ones(4, device="cuda")
            dist.all_reduce(t)
            torch.cuda.synchronize()
            _close_round(abort=True)
        print("ok")
        """
    )
    env = {k: v for k, v in os.environ.items() if k not in ("MASTER_ADDR", "RANK")}
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                       timeout=120)  # fmt: skip
    assert r.returncode == 0 and "ok" in r.stdout, r.stderr[-2000:]


def test_a_warm_worker_waits_for_a_round_newer_than_the_control_files_and_takes_its_env(
    tmp_path, monkeypatch
):
    """``first_round_env``: a warm worker writes its ready file, ignores the round the
    control file named when it started, and takes its own local rank's environment of
    the next one (also into os.environ)."""
    import elasticd.inprocess as ei
    from elasticd.agent.launch import control_round

    monkeypatch.setenv("RANK", "0")  # restored (or removed) after the test
    monkeypatch.setenv("WORLD_SIZE", "1")
    control = str(tmp_path / "control.json")
    assert control_round(control) == -1
    write_control(control, round_=3, state="run", envs={"1": {"RANK": "9"}})
    assert control_round(control) == 3
    ready = tmp_path / "ready"
    env = {ei.ENV_CONTROL: control, ei.ENV_WARM: "3", ei.ENV_WARM_READY: str(ready),
           "LOCAL_RANK": "1", "KEEP": "x"}  # fmt: skip
    monkeypatch.setattr(ei, "_warm_control", None)
    monkeypatch.delenv(ei.ENV_WARM, raising=False)
    got: dict = {}
    t = threading.Thread(target=lambda: got.update(ei.first_round_env(env)), daemon=True)
    t.start()
    deadline = time.time() + 60
    while not ready.exists() and time.time() < deadline:
        time.sleep(0.05)
    assert ready.exists()
    time.sleep(0.2)
    assert not got  # round 3 is not newer than what the file named at start
    write_control(control, round_=4, state="run",
                  envs={"0": {"RANK": "7"}, "1": {"RANK": "5", "WORLD_SIZE": "6"}})  # fmt: skip
    t.join(30)
    assert got["RANK"] == "5" and got["WORLD_SIZE"] == "6" and got["KEEP"] == "x"
    assert ei.ENV_WARM not in got and os.environ["RANK"] == "5"
    # An ordinary worker's env passes through untouched.
    assert ei.first_round_env({"RANK": "2"}) == {"RANK": "2"}


def test_a_standby_waits_under_no_rank_and_takes_the_rank_a_round_names_by_its_pid(tmp_path):
    """A standby (LOCAL_RANK -1) ignores rounds that do not name it, even ones handing
    out every local rank; a round that names its pid in ``pids`` gives it that local rank
    (also a later round than the one that adopted it: it may have been importing then),
    and from then on it is that local rank."""
    control = str(tmp_path / "control.json")
    write_control(control, round_=1, state="run", envs={"0": {"RANK": "0"}})
    c = _Control(control, -1, {})
    got: list = []
    t = threading.Thread(target=lambda: got.append(c.next_round(1)), daemon=True)
    t.start()
    write_control(control, round_=2, state="run",
                  envs={"0": {"RANK": "0", "LOCAL_RANK": "0"}, "-1": {"RANK": "8"}},
                  pids={"1": "0"})  # fmt: skip
    time.sleep(0.3)
    assert not got and c.local_rank == -1
    write_control(control, round_=3, state="run",
                  envs={"0": {"RANK": "0", "LOCAL_RANK": "0"}, "1": {"RANK": "3", "LOCAL_RANK": "1"}},
                  pids={str(os.getpid()): "1", "1": "0"})  # fmt: skip
    t.join(10)
    assert got == [{"RANK": "3", "LOCAL_RANK": "1"}] and c.local_rank == 1
    write_control(control, round_=4, state="run", envs={"1": {"RANK": "1", "LOCAL_RANK": "1"}})
    assert c.next_round(3) == {"RANK": "1", "LOCAL_RANK": "1"}


def test_carry_marks_kept_workers_and_names_those_not_begun_or_not_opened(tmp_path):
    """A worker carried into a round writes its ``begun`` heartbeat at once; one that has
    not is stuck in the round before (the agent's ROUND_BEGIN_TIMEOUT judges it). Workers
    started for the round are never judged so (they may still be importing torch)."""
    from elasticd.agent.workers import Worker, WorkerGroup
    from elasticd.worker import WorkerChannel

    procs = [subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
             for _ in range(2)]  # fmt: skip
    try:
        kept = WorkerGroup(workers=[
            Worker(local_rank=i, rank=i, proc=p, log_path="", heartbeat_path="",
                   error_path="", started=0.0)
            for i, p in enumerate(procs)
        ])  # fmt: skip
        envs = [WorkerGroup.round_env({"RANK": str(i), "LOCAL_RANK": str(i)},
                                      str(tmp_path / "round-2"), i)
                for i in range(3)]  # fmt: skip
        group = WorkerGroup.carry(kept, argv=[sys.executable, "-c", "import time; time.sleep(60)"],
                                  envs=envs, log_dir=str(tmp_path / "logs"),
                                  run_dir=str(tmp_path / "round-2"))  # fmt: skip
        procs.append(group.workers[2].proc)
        assert [w.carried for w in group.workers] == [True, True, False]
        assert [w.local_rank for w in group.not_begun()] == [0, 1]  # the fresh one is not
        channel = WorkerChannel(path=group.workers[0].heartbeat_path, rank=0)
        channel.mark("begun")
        assert [w.local_rank for w in group.not_begun()] == [1]
        # Begun but its process group not open yet (waiting for its peers): not_opened.
        assert [w.local_rank for w in group.not_opened()] == [0]
        channel.mark("pg_ready")
        assert group.not_opened() == []
        # A warm worker (or standby) still importing has no round before: not judged so
        # until its ready file exists.
        ready = tmp_path / "ready-1"
        group.workers[1].env_ready = str(ready)
        assert group.not_begun() == []
        ready.write_text("1")
        assert [w.local_rank for w in group.not_begun()] == [1]
        procs[1].kill()
        procs[1].wait()
        assert group.not_begun() == []  # a dead one is a worker failure, not this
    finally:
        for p in procs:
            p.kill()
            p.wait()


def test_a_round_adopts_live_standbys_ready_ones_first_and_names_every_kept_pid(tmp_path):
    """``WorkerGroup.adopt`` hands live standbys (those done importing first) to the dead
    local ranks, as many as there are; the control file's ``pids`` then names every live
    kept worker's local rank, in every round (``carry`` rebuilds the workers, and a
    standby that missed the round that adopted it must find its rank in the next)."""
    from elasticd.agent.launch import kept_pids
    from elasticd.agent.workers import Worker, WorkerGroup

    procs = [subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
             for _ in range(3)]  # fmt: skip
    try:
        procs[0].kill()
        procs[0].wait()
        (tmp_path / "ready-b").write_text("1")
        standby = WorkerGroup(workers=[
            Worker(local_rank=-1, rank=-1, proc=p, log_path="", heartbeat_path="",
                   error_path="", started=0.0, warm=True, standby=True,
                   env_ready=str(tmp_path / f"ready-{n}"))
            for p, n in zip(procs, "dab", strict=True)
        ])  # fmt: skip
        taken = standby.adopt([2, 5])
        # The dead one is left behind; the ready one (b) takes the first dead rank.
        assert [(w.local_rank, w.proc.pid) for w in taken.workers] == [
            (2, procs[2].pid), (5, procs[1].pid)]  # fmt: skip
        assert [w.proc.pid for w in standby.workers] == [procs[0].pid]
        assert standby.alive() == 0 and not standby.adopt([0]).workers
        assert kept_pids(taken, 6) == {str(procs[2].pid): "2", str(procs[1].pid): "5"}
        assert kept_pids(taken, 4) == {str(procs[2].pid): "2"}  # rank 5 is no rank of 4
        # The next round's workers, rebuilt as WorkerGroup.carry does (no standby flag):
        # still named.
        again = WorkerGroup(workers=[
            Worker(local_rank=w.local_rank, rank=w.local_rank, proc=w.proc, log_path="",
                   heartbeat_path="", error_path="", started=0.0) for w in taken.workers
        ])  # fmt: skip
        assert kept_pids(again, 6) == kept_pids(taken, 6)
        assert kept_pids(None, 6) == {}
    finally:
        for p in procs:
            p.kill()
            p.wait()


def test_restart_standby_is_checked():
    from elasticd.jobspec import JobSpecError, parse_job

    assert parse_job({"name": "s"}).restart.standby == 1
    assert parse_job({"name": "s", "restart": {"standby": 0}}).restart.standby == 0
    for bad, why in ((-1, ">= 0"), (2, "more than nproc_per_node (1)")):
        with pytest.raises(JobSpecError, match=rf"restart.standby: {bad} .*{re.escape(why)}"):
            parse_job({"name": "s", "restart": {"standby": bad}})


def test_warm_workers_only_for_in_process_jobs_of_the_built_in_trainer(tmp_path):
    """A job's own ``command`` may read its rank at import time, and a process-mode job
    has no control file to wait on: neither gets warm workers (nothing is started)."""
    from elasticd.agent.launch import NodeInfo, warm_workers
    from elasticd.jobspec import parse_job

    node = NodeInfo(node_id="n0", addr="127.0.0.1", state_dir=str(tmp_path / "state"))
    base = {"name": "w", "output_dir": str(tmp_path / "out")}
    for extra in ({"restart": {"mode": "process"}},
                  {"restart": {"mode": "inprocess"}, "command": ["python3", "train.py"]}):  # fmt: skip
        job = parse_job({**base, **extra}).with_paths_resolved(tmp_path)
        assert warm_workers(job=job, run_id="r", node=node, local_ranks=[0], env={},
                            clock=time.time) is None  # fmt: skip
    job = parse_job({**base, "restart": {"mode": "inprocess"}}).with_paths_resolved(tmp_path)
    assert warm_workers(job=job, run_id="r", node=node, local_ranks=[], env={},
                        clock=time.time) is None  # fmt: skip
    assert not (tmp_path / "state").exists()


def run_rounds(tmp_path, script: str, arg: str, *, code: int, rounds: list[int]):
    """Run a worker ``script`` on a control file in ``tmp_path`` (its argv: the file,
    ``arg``); check its exit code and the rounds it entered; a worker that gave up says
    why. The finished process is returned."""
    path = tmp_path / "worker.py"
    path.write_text(script)
    r = subprocess.run(
        [sys.executable, str(path), str(tmp_path / "control.json"), arg],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert r.returncode == code, r.stderr[-2000:]
    seen = [int(line.split()[1]) for line in r.stdout.splitlines() if line.startswith("round ")]
    assert seen == rounds, (r.stdout, r.stderr[-2000:])
    if code == 1:
        assert "2 recoveries in a row failed before a step; exiting" in r.stderr
    return r


RECOVERIES_SCRIPT = """
import sys
from elasticd.agent.launch import write_control
import elasticd.inprocess as ei

path, succeed_at = sys.argv[1], int(sys.argv[2])
base = {"ELASTICD_RESTART_MODE": "inprocess", "ELASTICD_CONTROL_FILE": path, "RANK": "0",
        "WORLD_SIZE": "1", "LOCAL_RANK": "0"}
write_control(path, round_=1, state="run", envs={"0": {**base, "ELASTICD_ROUND": "1"}})
calls = []

def train(ctx):
    calls.append(ctx.round)
    print("round", ctx.round, flush=True)
    if ctx.round == succeed_at:
        return "done"
    if ctx.round == 1:
        ei.stepped(ctx)  # the first round trained; later ones fail before a step
    nxt = ctx.round + 1
    write_control(path, round_=nxt, state="run", envs={"0": {**base, "ELASTICD_ROUND": str(nxt)}})
    raise RuntimeError("[gloo/transport/tcp/pair.cc:553] Connection closed by peer")

print(ei.run(train, env={**base, "ELASTICD_ROUND": "1"}), flush=True)
"""


@pytest.mark.parametrize(("succeed_at", "rounds", "code"), [(3, [1, 2, 3], 0), (0, [1, 2, 3], 1)])
def test_two_failed_recoveries_in_a_row_end_the_process_and_one_does_not(
    tmp_path, succeed_at, rounds, code
):
    """A round that trained fails; its recovery fails before a step (a second event while
    the replacement starts); the next recovery is still tried in-process. Only a second
    failed recovery in a row exits (code 1) for the agent's process restart."""
    r = run_rounds(tmp_path, RECOVERIES_SCRIPT, str(succeed_at), code=code, rounds=rounds)
    if not code:
        assert r.stdout.splitlines()[-1] == "done"


NOT_A_FAILURE_SCRIPT = """
import sys
import threading
import time
from elasticd.agent.launch import write_control
import elasticd.inprocess as ei

path, how = sys.argv[1], sys.argv[2]
base = {"ELASTICD_RESTART_MODE": "inprocess", "ELASTICD_CONTROL_FILE": path, "RANK": "0",
        "WORLD_SIZE": "1", "LOCAL_RANK": "0"}
write_control(path, round_=1, state="run", envs={"0": {**base, "ELASTICD_ROUND": "1"}})

def start(nxt):
    write_control(path, round_=nxt, state="run", envs={"0": {**base, "ELASTICD_ROUND": str(nxt)}})

def train(ctx):
    print("round", ctx.round, flush=True)
    if ctx.round == 4:
        return "done"
    if ctx.round == 1:
        ei.stepped(ctx)
    if how == "trained":  # round 1 trained, then ended for a newcomer; the hand-overs fail
        if ctx.round == 1:
            write_control(path, round_=1, state="abort", reason="scale_up")
            while not ctx.aborted():
                time.sleep(0.01)
            threading.Timer(0.3, start, args=(2,)).start()
            ctx.check()
        start(ctx.round + 1)
        raise RuntimeError("[gloo/transport/tcp/pair.cc:553] Connection closed by peer")
    if ctx.round < 3:  # the fault, then a recovery that fails before a step
        start(ctx.round + 1)
        raise RuntimeError("[gloo/transport/tcp/pair.cc:553] Connection closed by peer")
    reason = "peer_lost" if how == "peer_lost" else "scale_up"
    if how in ("late", "overwritten"):
        # A peer's shut socket fails the collective before our agent writes; "overwritten":
        # the next round's record replaces the abort record before the worker reads it.
        def agent():
            time.sleep(0.3)
            write_control(path, round_=3, state="abort", reason=reason)
            time.sleep(0.3 if how == "late" else 0.0)
            start(4)
        threading.Thread(target=agent).start()
        raise RuntimeError("[gloo/transport/tcp/pair.cc:553] Connection closed by peer")
    write_control(path, round_=3, state="abort", reason=reason)
    while not ctx.aborted():
        time.sleep(0.01)
    threading.Timer(0.3, start, args=(4,)).start()
    ctx.check()

print(ei.run(train, env={**base, "ELASTICD_ROUND": "1"}), flush=True)
"""


@pytest.mark.parametrize(
    ("how", "rounds", "code"),
    [("aborted", [1, 2, 3, 4], 0), ("late", [1, 2, 3, 4], 0), ("overwritten", [1, 2, 3, 4], 0),
     ("peer_lost", [1, 2, 3], 1), ("trained", [1, 2, 3], 1)],
)  # fmt: skip
def test_a_recovery_cut_short_by_a_newcomer_is_no_failed_recovery(tmp_path, how, rounds, code):
    """(CI.) A fault, a recovery that fails before a step (a second fault), then a round
    the agent ends for a node that joins (its abort record names ``scale_up``): the worker
    stays for the next round instead of giving up its state for a process restart. So
    too where a peer's shut socket fails its collective before its own agent's abort
    record comes (it waits for the record), and where the next round's record replaced the
    abort record before the worker read it (it names the reason too). A round ended for a
    lost peer still counts, and a round that trained and was ended for a newcomer starts
    the count like a fault: two failed hand-overs after it still exit."""
    r = run_rounds(tmp_path, NOT_A_FAILURE_SCRIPT, how, code=code, rounds=rounds)
    if not code:
        assert r.stdout.splitlines()[-1] == "done"


def test_every_control_record_names_the_reasons_of_the_last_rounds_ended(tmp_path):
    """The agent's abort record names its round's outcome; each later record carries the
    last ENDS_KEPT of them, whatever its state, so a worker that missed the abort record
    still learns why its round ended. A damaged file starts the map afresh."""
    import json

    from elasticd.agent.launch import ENDS_KEPT

    path = str(tmp_path / "control.json")
    write_control(path, round_=1, state="run")
    write_control(path, round_=1, state="abort", reason="scale_up")
    write_control(path, round_=2, state="run")
    rec = json.loads((tmp_path / "control.json").read_text())
    assert (rec["state"], rec["reason"], rec["ended"]) == ("run", "", {"1": "scale_up"})
    last = 2 + ENDS_KEPT + 2  # rounds 2..last end: more than kept
    for r in range(2, last + 1):
        write_control(path, round_=r, state="abort", reason="peer_lost")
        write_control(path, round_=r + 1, state="run")
    ended = json.loads((tmp_path / "control.json").read_text())["ended"]
    assert sorted(map(int, ended)) == list(range(last - ENDS_KEPT + 1, last + 1))
    assert set(ended.values()) == {"peer_lost"}
    (tmp_path / "control.json").write_text("{not json")
    write_control(path, round_=20, state="abort", reason="collective_failed")
    assert json.loads((tmp_path / "control.json").read_text())["ended"] == {
        "20": "collective_failed"
    }


ROUND_END_SCRIPT = """
import sys
import time
from elasticd.agent.launch import write_control
import elasticd.inprocess as ei

path, how = sys.argv[1], sys.argv[2]
base = {"ELASTICD_RESTART_MODE": "inprocess", "ELASTICD_CONTROL_FILE": path, "RANK": "0",
        "WORLD_SIZE": "1", "LOCAL_RANK": "0"}
write_control(path, round_=1, state="run", envs={"0": {**base, "ELASTICD_ROUND": "1"}})

def train(ctx):
    print("round", ctx.round, flush=True)
    if ctx.round == 5:
        return "done"
    if how == "progress":  # a script that reports its steps but never calls ei.stepped
        ctx.channel.progress(step=ctx.round * 10)
        ctx.channel.progress(step=ctx.round * 10 + 1)
    elif how == "heartbeat-only":  # it reports the step it resumed at on its own, no more
        ctx.channel.progress(step=ctx.round * 10)
    elif how == "resumed-only":  # it reports only the step its round resumed at
        ctx.channel.recovered(source="peers", resume_step=ctx.round * 10, lost_steps=0)
        ctx.channel.progress(step=ctx.round * 10)
    else:
        ei.stepped(ctx)
    nxt = ctx.round + 1
    if how in ("interrupt", "exit") and ctx.round == 2:
        write_control(path, round_=2, state="abort")  # the round has ended under train
        while not ctx.aborted():
            time.sleep(0.01)
        write_control(path, round_=3, state="run", envs={"0": {**base, "ELASTICD_ROUND": "3"}})
        raise KeyboardInterrupt if how == "interrupt" else SystemExit(0)
    write_control(path, round_=nxt, state="run", envs={"0": {**base, "ELASTICD_ROUND": str(nxt)}})
    raise RuntimeError("[gloo/transport/tcp/pair.cc:553] Connection closed by peer")

print(ei.run(train, env={**base, "ELASTICD_ROUND": "1"}), flush=True)
"""


@pytest.mark.parametrize(
    ("how", "rounds", "code"),
    [("progress", [1, 2, 3, 4, 5], 0), ("resumed-only", [1, 2, 3], 1),
     ("heartbeat-only", [1, 2, 3], 1),
     ("interrupt", [1, 2], -signal.SIGINT), ("exit", [1, 2], 0)],
)  # fmt: skip
def test_a_round_that_reported_a_step_trained_and_ctrl_c_or_exit_ends_the_process(
    tmp_path, how, rounds, code
):
    """(Review.) A round whose channel reported a step past the one it resumed at trained,
    even if the script never calls ``ei.stepped`` (before, every fault of such a script
    counted as a failed recovery, and the third of a job's whole life ended the process).
    Ctrl-C and ``sys.exit()`` in a round that has ended end the process, as they would
    without elasticd (before, ``train`` was called again for the next round)."""
    r = run_rounds(tmp_path, ROUND_END_SCRIPT, how, code=code, rounds=rounds)
    if how == "interrupt":
        assert "KeyboardInterrupt" in r.stderr
    assert (code == 1) == (how in ("resumed-only", "heartbeat-only"))


ABORTED_BEFORE_OPEN_SCRIPT = """
import socket
import sys
import threading
import time

from elasticd.agent.launch import write_control
import elasticd.inprocess as ei

path = sys.argv[1]
base = {"ELASTICD_RESTART_MODE": "inprocess", "ELASTICD_CONTROL_FILE": path, "RANK": "0",
        "WORLD_SIZE": "1", "LOCAL_RANK": "0"}
with socket.socket() as s:  # a port where no store will ever listen
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]

def round_env(r, **extra):
    return {"0": {**base, "ELASTICD_ROUND": str(r), **extra}}

main = threading.main_thread().ident

def waiting_for_the_store():
    frame = sys._current_frames().get(main)
    while frame is not None:
        if frame.f_code.co_name == "_wait_listening":
            return True
        frame = frame.f_back
    return False

def end_round_3_then_start_4():
    deadline = time.monotonic() + 30
    while not waiting_for_the_store() and time.monotonic() < deadline:
        time.sleep(0.01)  # round 3 has begun and waits for its rank 0: end it now
    write_control(path, round_=3, state="abort")
    time.sleep(0.3)
    write_control(path, round_=4, state="run", envs=round_env(4))

write_control(path, round_=1, state="run", envs=round_env(1))

def train(ctx):
    print("round", ctx.round, flush=True)
    if ctx.round == 4:
        return "done"
    if ctx.round == 1:
        ei.stepped(ctx)
        write_control(path, round_=2, state="run", envs=round_env(2))
    else:  # round 2 fails before a step; round 3 waits for a rank 0 that never comes
        write_control(path, round_=3, state="run", envs=round_env(
            3, RANK="1", WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port)))
        threading.Thread(target=end_round_3_then_start_4).start()
    raise RuntimeError("[gloo/transport/tcp/pair.cc:553] Connection closed by peer")

print(ei.run(train, env={**base, "ELASTICD_ROUND": "1"}), flush=True)
"""


def test_a_round_ended_before_its_group_opened_is_no_failed_recovery(tmp_path):
    """Round 1 trains and fails, round 2 fails before a step (one failed recovery), round 3
    is ended by the agent while it waits for rank 0's store (the world changed during the
    hand-over): that is not a second failed recovery, so round 4 is still taken
    in-process instead of the process exiting for a restart."""
    script = tmp_path / "aborted.py"
    script.write_text(ABORTED_BEFORE_OPEN_SCRIPT)
    r = subprocess.run([sys.executable, str(script), str(tmp_path / "control.json")],
                       capture_output=True, text=True, timeout=120)  # fmt: skip
    assert r.returncode == 0, r.stderr[-2000:]
    seen = [int(line.split()[1]) for line in r.stdout.splitlines() if line.startswith("round ")]
    assert seen == [1, 2, 4], r.stdout
    assert "round 3 ended (RoundAborted" in r.stderr, r.stderr[-2000:]
    assert r.stdout.splitlines()[-1] == "done"


FAILED_INIT_SCRIPT = """
import sys
import threading
import time
from datetime import timedelta

import torch
import torch.distributed as dist

from elasticd.agent.launch import write_control
import elasticd.inprocess as ei

path, port1, port2 = sys.argv[1], sys.argv[2], sys.argv[3]
base = {"ELASTICD_RESTART_MODE": "inprocess", "ELASTICD_CONTROL_FILE": path,
        "LOCAL_RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1"}
env1 = {**base, "ELASTICD_ROUND": "1", "RANK": "0", "MASTER_PORT": port1}
env2 = {**base, "ELASTICD_ROUND": "2", "RANK": "1", "MASTER_PORT": port2}
write_control(path, round_=1, state="run", envs={"0": env1})

main = threading.main_thread().ident

def in_group_set_up():
    frame = sys._current_frames().get(main)
    while frame is not None:
        if frame.f_code.co_name == "init_process_group":
            return True
        frame = frame.f_back
    return False

def next_round():  # round 1's peer never comes: the agent ends it and starts round 2
    deadline = time.monotonic() + 30
    while not in_group_set_up() and time.monotonic() < deadline:
        time.sleep(0.01)
    time.sleep(0.2)  # inside it: torch has named the group by now
    write_control(path, round_=2, state="run", envs={"0": env2})

threading.Thread(target=next_round).start()

def train(ctx):
    t = torch.ones(1)
    dist.all_reduce(t)
    print("round", ctx.round, "sum", t.item(), flush=True)
    return "done"

print(ei.run(train, env=env1, timeout=timedelta(seconds=20)), flush=True)
"""

FRESH_RANK0_SCRIPT = """
import sys
from datetime import timedelta

import torch
import torch.distributed as dist

from elasticd.agent.launch import write_control
import elasticd.inprocess as ei

path, port = sys.argv[1], sys.argv[2]
env = {"ELASTICD_RESTART_MODE": "inprocess", "ELASTICD_CONTROL_FILE": path,
       "LOCAL_RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "RANK": "0",
       "MASTER_PORT": port, "ELASTICD_ROUND": "2"}
write_control(path, round_=2, state="run", envs={"0": env})

def train(ctx):
    t = torch.ones(1)
    dist.all_reduce(t)
    print("sum", t.item(), flush=True)
    return "done"

print(ei.run(train, env=env, timeout=timedelta(seconds=20)), flush=True)
"""


def test_a_round_whose_group_set_up_failed_does_not_shift_the_next_rounds_group_names(tmp_path):
    """Round 1 ends while its process group is being set up (its peer never came), so
    torch never initialised it; round 2 pairs the process with a fresh one. torch names
    every group from a per-process counter (the default group's store keys start with its
    name) that only a full teardown resets: left shifted, the kept process would look for
    its new peer under other keys than the fresh one, and both would wait out the group
    timeout (seen in an in-process chaos soak: two nodes stuck in round 9 for minutes)."""
    ports = []
    for _ in range(2):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            ports.append(str(s.getsockname()[1]))
    (tmp_path / "worker.py").write_text(FAILED_INIT_SCRIPT)
    (tmp_path / "fresh.py").write_text(FRESH_RANK0_SCRIPT)
    worker = subprocess.Popen(
        [sys.executable, str(tmp_path / "worker.py"), str(tmp_path / "control.json"), *ports],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    fresh = subprocess.Popen(  # a process new in round 2 (a newcomer, a standby)
        [sys.executable, str(tmp_path / "fresh.py"), str(tmp_path / "fresh.json"), ports[1]],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        out, err = worker.communicate(timeout=60)
        fresh_out, fresh_err = fresh.communicate(timeout=30)
    finally:
        for p in (worker, fresh):
            p.kill()
            p.wait()
    assert "round 1 ended" in err, err[-2000:]
    assert worker.returncode == 0 and "round 2 sum 2.0" in out, err[-2000:]
    assert fresh.returncode == 0 and "sum 2.0" in fresh_out, fresh_err[-2000:]


def test_a_hung_rounds_workers_print_their_stacks_and_no_other_process_is_signalled(tmp_path):
    """Before a hung round's workers are killed, each one of ours that catches SIGUSR1 (the
    built-in trainer, ``python -m trainer``, registers faulthandler on it) prints every
    thread's stack into its log. Nothing else is signalled: a script without a handler
    would die of SIGUSR1, and a user's own handler may mean something else by it
    (Lightning requeues a Slurm job)."""
    from elasticd.agent.workers import Worker, WorkerGroup

    (tmp_path / "trainer").mkdir()  # run as `python -m trainer`, as the built-in one is
    # A regular package: the working directory's wins over ours wherever ours is found (a
    # namespace package would lose to ours on PYTHONPATH).
    (tmp_path / "trainer" / "__init__.py").write_text("")
    (tmp_path / "trainer" / "__main__.py").write_text(
        "import time\n"
        "from elasticd.log import dump_stacks_on_sigusr1\n"
        "def stuck_in_here():\n"
        "    print('ready', flush=True)\n"  # from inside: the signal finds it there
        "    time.sleep(60)\n"
        "dump_stacks_on_sigusr1(); stuck_in_here()\n"
    )
    users = (
        "import signal, sys, time\n"
        "signal.signal(signal.SIGUSR1, lambda *a: print('requeued', flush=True))\n"
        "print('ready', flush=True); time.sleep(60)\n"
    )
    log = tmp_path / "dumper.log"
    with open(log, "w") as fh:
        procs = [
            subprocess.Popen([sys.executable, "-m", "trainer"], cwd=tmp_path,
                             stdout=subprocess.PIPE, stderr=fh, text=True),
            subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"]),
            subprocess.Popen([sys.executable, "-c", users], stdout=subprocess.PIPE, text=True),
        ]  # fmt: skip
    try:
        assert procs[0].stdout.readline() == "ready\n"
        assert procs[2].stdout.readline() == "ready\n"
        group = WorkerGroup(workers=[
            Worker(local_rank=i, rank=i, proc=p, log_path="", heartbeat_path="",
                   error_path="", started=0.0)
            for i, p in enumerate(procs)
        ])  # fmt: skip
        assert group.dump_stacks() == 1
        deadline = time.monotonic() + 10
        while "stuck_in_here" not in log.read_text() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert "stuck_in_here" in log.read_text()
        assert [p.poll() for p in procs] == [None, None, None]  # nothing was killed
        procs[2].kill()
        assert procs[2].stdout.read() == ""  # the user's handler never ran
    finally:
        for p in procs:
            p.kill()
            p.wait()


PENDING_SCRIPT = textwrap.dedent(
    """
    import gc, os, sys, time
    from datetime import timedelta
    import torch, torch.distributed as dist
    from elasticd import inprocess

    rank, port, control_path = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
    store = dist.TCPStore("127.0.0.1", port, 2, rank == 0, timeout=timedelta(seconds=30))
    dist.init_process_group("gloo", store=store, rank=rank, world_size=2,
                            timeout=timedelta(seconds=60))
    group = dist.new_group([0, 1])
    t = torch.ones(4)
    inprocess._current = control = inprocess._Control(control_path, 0, {"ELASTICD_ROUND": "3"})
    control.begin(3)
    inprocess.wait_collective(dist.all_reduce(t, async_op=True, group=group), group)
    print("healthy", t.sum().item(), flush=True)
    if rank == 1:  # never joins the next one, and keeps its connections open
        time.sleep(45)
        os._exit(0)
    work = dist.all_reduce(t, async_op=True, group=group)
    print("pending", flush=True)
    start = time.monotonic()
    try:
        inprocess.wait_collective(work, group)
    except inprocess.RoundAborted as exc:
        print(f"abandoned after {time.monotonic() - start:.1f} s: {exc}", flush=True)
    # Leaving the round as a worker does: no reference of ours may keep gloo's stuck
    # thread in the way (the group's destructor joins it).
    start = time.monotonic()
    dist.destroy_process_group()
    del work, group
    gc.collect()
    print(f"torn down in {time.monotonic() - start:.1f} s", flush=True)
    os._exit(0)
    """
)


def _gloo_pair(tmp_path, script_text: str, *args: str) -> list[subprocess.Popen]:
    """Ranks 0 and 1 of ``script_text``, run as ``script RANK PORT *args`` on a free port."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = str(s.getsockname()[1])
    script = tmp_path / "pair.py"
    script.write_text(script_text)
    return [
        subprocess.Popen([sys.executable, str(script), str(rank), port, *args],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        for rank in (0, 1)
    ]  # fmt: skip


def test_a_collective_still_pending_after_its_round_ended_is_abandoned_not_waited_out(tmp_path):
    """gloo can leave a collective waiting for the whole group timeout after every
    connection of its round closed (the chaos soak: a worker in a bucket's all-reduce for
    120 s). Here the peer simply never joins the collective: the socket abort is not what
    ends the wait, the round's end is. Without wait_collective the wait would last the
    group timeout (60 s); a healthy collective goes through it as before; and tearing the
    round's groups down does not wait for the abandoned one either (its group's
    destructor would join gloo's stuck thread)."""
    control = str(tmp_path / "control.json")
    procs = _gloo_pair(tmp_path, PENDING_SCRIPT, control)
    try:
        seen = ""
        while "pending" not in seen:
            line = procs[0].stdout.readline()
            assert line, procs[0].stderr.read()[-2000:]
            seen += line
        assert "healthy 8.0" in seen, seen
        time.sleep(0.5)  # it waits
        assert procs[0].poll() is None
        write_control(control, round_=3, state="abort")
        out, err = procs[0].communicate(timeout=20)  # well inside the 60 s group timeout
    finally:
        for p in procs:
            p.kill()
            p.wait()
    assert procs[0].returncode == 0, err[-2000:]
    assert "abandoned after" in out and "round 3 ended" in out, out + err[-2000:]
    torn = re.search(r"torn down in ([0-9.]+) s", out)
    assert torn and float(torn.group(1)) < 10, out


TRAINER_PENDING_SCRIPT = textwrap.dedent(
    """
    import os, sys, time
    from datetime import timedelta
    import torch, torch.distributed as dist
    from elasticd import inprocess
    from trainer.optim import global_grad_norm
    from trainer.parallel import expert, tensor
    from trainer.parallel.context import GroupSlot

    rank, port, control_path = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
    cases = sys.argv[4].split(",")
    store = dist.TCPStore("127.0.0.1", port, 2, rank == 0, timeout=timedelta(seconds=30))
    dist.init_process_group("gloo", store=store, rank=rank, world_size=2,
                            timeout=timedelta(seconds=60))
    groups = {name: dist.new_group([0, 1]) for name in cases}  # one per case: both ranks
    if rank == 1:  # never joins a collective, and keeps its connections open
        time.sleep(90)
        os._exit(0)

    def run(name, slot):
        if name == "tp-forward":  # a row-parallel layer's all-reduce
            tensor.reduce_from(torch.ones(4), slot)
        elif name == "tp-backward":  # a column-parallel layer's gradient all-reduce
            x = torch.ones(4, requires_grad=True)
            tensor.copy_to(x, slot).sum().backward()
        elif name == "sp-gather":  # sequence parallelism's all-gather
            tensor.gather_seq(torch.ones(2, 3, 4), slot)
        elif name == "cross-entropy":  # the vocabulary-parallel loss's max
            tensor.vocab_parallel_cross_entropy(torch.zeros(2, 3, 4), torch.zeros(2, 3, dtype=torch.long),
                                                start=0, vocab=8, slot=slot)
        elif name == "moe-all-to-all":  # expert parallelism's dispatch
            expert._AllToAll.apply(torch.ones(4, 2), [2, 2], [2, 2], slot.group)
        elif name == "grad-norm":
            p = torch.ones(4)
            p.grad = torch.ones(4)
            global_grad_norm([p], groups=[slot], replicas=[1])
        elif name == "pipeline-recv":  # a stage's receive of activations, posted and waited
            from trainer.parallel.pipeline import _Posted
            works = dist.batch_isend_irecv([dist.P2POp(dist.irecv, torch.empty(4), 1, slot.group)])
            _Posted(works=list(works), sending=[], group=slot.group).wait()
        else:
            raise SystemExit(f"unknown case {name}")

    inprocess._current = control = inprocess._Control(control_path, 0, {"ELASTICD_ROUND": "3"})
    for i, name in enumerate(cases):
        control.begin(3 + i)
        print("pending", name, flush=True)
        start = time.monotonic()
        try:
            run(name, GroupSlot(group=groups[name], size=2, rank=0))
            print("completed", name, flush=True)
        except inprocess.RoundAborted:
            print(f"abandoned {name} after {time.monotonic() - start:.1f} s", flush=True)
    os._exit(0)
    """
)

TRAINER_COLLECTIVES = ["tp-forward", "tp-backward", "sp-gather", "cross-entropy",
                       "moe-all-to-all", "grad-norm", "pipeline-recv"]  # fmt: skip


def test_the_trainers_collectives_are_abandoned_when_their_round_ends(tmp_path):
    """`bench/recovery.py --cases inproc-move` caught a survivor in a tensor-parallel
    all-reduce of its backward, with a peer that also survived, 10 s after the round
    ended, in 2 of 24 runs (gloo left it waiting once the round's connections shut), and the
    stuck-worker exit then restarted it from the checkpoint. Every collective of the
    trainer's step now waits through wait_collective, and the pipeline's receives through
    wait_transfer: here the peer never joins, and each is abandoned about 0.3 s after its
    round ends instead of lasting the 60 s group timeout."""
    control = str(tmp_path / "control.json")
    procs = _gloo_pair(tmp_path, TRAINER_PENDING_SCRIPT, control, ",".join(TRAINER_COLLECTIVES))
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.extend(procs[0].stdout), daemon=True)
    reader.start()

    def wait_for(prefix: str, limit: float) -> str:
        deadline = time.monotonic() + limit
        while time.monotonic() < deadline:
            hit = next((ln for ln in list(lines) if ln.startswith(prefix)), None)
            if hit:
                return hit
            if procs[0].poll() is not None and not reader.is_alive():
                break
            time.sleep(0.05)
        raise AssertionError(f"no {prefix!r} within {limit} s; stdout {lines}; "
                             f"stderr {procs[0].stderr.read()[-2000:] if procs[0].poll() is not None else ''}")  # fmt: skip

    try:
        for i, name in enumerate(TRAINER_COLLECTIVES):
            wait_for(f"pending {name}\n", 60)
            time.sleep(0.3)  # it waits for the peer
            assert not any(ln.startswith(f"completed {name}") for ln in lines), lines
            write_control(control, round_=3 + i, state="abort")
            hit = wait_for(f"abandoned {name} after", 15)  # well inside the 60 s timeout
            seconds = float(re.search(r"after ([0-9.]+) s", hit).group(1))
            assert seconds < 10, hit
    finally:
        for p in procs:
            p.kill()
            p.wait()


STUCK_SCRIPT = textwrap.dedent(
    """
    import os, sys, threading, time
    from datetime import timedelta
    import torch, torch.distributed as dist
    from elasticd import inprocess

    rank, port, control_path, how = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4]
    inprocess.STUCK_EXIT = 1.5
    store = dist.TCPStore("127.0.0.1", port, 2, rank == 0, timeout=timedelta(seconds=30))
    dist.init_process_group("gloo", store=store, rank=rank, world_size=2,
                            timeout=timedelta(seconds=60))
    if how in ("ddp", "ddp-hook"):
        from torch.nn.parallel import DistributedDataParallel
        ddp = DistributedDataParallel(torch.nn.Linear(4, 4))  # a broadcast: both ranks
        if how == "ddp-hook":
            ddp.register_comm_hook(None, inprocess.ddp_comm_hook)
    if rank == 1:  # alive, connected, never in the collective
        time.sleep(45)
        os._exit(0)
    control = inprocess._Control(control_path, 0, {"ELASTICD_ROUND": "3"})
    inprocess._current = control
    control.begin(3)
    print("in round 3", flush=True)
    while not control.aborted(3):
        time.sleep(0.01)
    if how == "collective":  # a synchronous collective gloo never fails: no thread runs
        dist.all_reduce(torch.ones(4))
        print("still here", flush=True)
    elif how == "ddp":  # DDP's reducer waits for its all-reduce inside the autograd engine
        ddp.module.weight.grad = None
        ddp(torch.ones(2, 4)).sum().backward()
        print("still here", flush=True)
    elif how == "ddp-hook":  # the same, its all-reduce through ei.ddp_comm_hook
        ddp.module.weight.grad = None
        start = time.monotonic()
        try:
            ddp(torch.ones(2, 4)).sum().backward()
            print("still here", flush=True)
        except Exception as exc:
            control.left(3)
            print(f"left round 3 after {time.monotonic() - start:.1f} s: "
                  f"{type(exc).__name__}: {exc}", flush=True)
    elif how == "waiting":  # idle as long, but not in a collective (a save's upload, say)
        threading.Event().wait(5)
        control.left(3)
        print("left round 3", flush=True)
    else:  # still computing the step for 4 s after the round ended, then leaving it
        end = time.monotonic() + 4
        x = 0
        while time.monotonic() < end:
            x += 1
        control.left(3)
        print("left round 3", flush=True)
    os._exit(0)
    """
)


@pytest.mark.parametrize("how", ["collective", "ddp", "ddp-hook", "waiting", "computing"])
def test_a_worker_blocked_in_a_collective_of_an_ended_round_exits_and_no_other_does(tmp_path, how):
    """A worker blocked in a synchronous collective of a round that ended, with every
    thread but the watcher idle (gloo never fails it, and no timed wait can leave it),
    prints its stacks and exits for its agent to replace it STUCK_EXIT (here 1.5 s) into
    the idle stretch, instead of holding the world until the agent's 120 s round-begin
    bound. One idle as long outside a collective, or still computing, is left alone. A
    DDP backward whose all-reduce goes through ``ei.ddp_comm_hook`` raises (torch's
    RuntimeError naming ``RoundAborted``) ABANDON_AFTER into the end (the watcher fails
    the future DDP waits for), and the worker leaves the round in its own process: no
    exit."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = str(s.getsockname()[1])
    (tmp_path / "stuck.py").write_text(STUCK_SCRIPT)
    control = str(tmp_path / "control.json")
    script = str(tmp_path / "stuck.py")
    procs = [
        subprocess.Popen([sys.executable, script, str(rank), port, control, how],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        for rank in (0, 1)
    ]  # fmt: skip
    proc = procs[0]
    try:
        line = proc.stdout.readline()
        assert "in round 3" in line, proc.stderr.read()[-2000:]
        write_control(control, round_=3, state="abort")
        out, err = proc.communicate(timeout=25)
    finally:
        for p in procs:
            p.kill()
            p.wait()
    if how in ("collective", "ddp"):
        assert proc.returncode == 1, out + err[-2000:]
        assert "blocked in it for" in err and "exiting for its agent to replace it" in err, err
        assert ("distributed_c10d.py" if how == "collective" else "backward") in err  # stacks
        assert "still here" not in out
    elif how == "ddp-hook":
        assert proc.returncode == 0, out + err[-2000:]
        assert "left round 3 after" in out and "RoundAborted" in out, out + err[-2000:]
        assert "is still pending (gloo left it waiting): abandoned" in out, out
        assert "exiting" not in err and "still here" not in out, out + err[-2000:]
    else:
        assert proc.returncode == 0 and "left round 3" in out, out + err[-2000:]
        assert "exiting" not in err, err[-2000:]


HOOK_PARITY_SCRIPT = textwrap.dedent(
    """
    import sys
    from datetime import timedelta
    import torch, torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP
    from elasticd import inprocess

    rank, port, control_path, device = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4]
    store = dist.TCPStore("127.0.0.1", port, 3, rank == 0, timeout=timedelta(seconds=30))
    dist.init_process_group("gloo", store=store, rank=rank, world_size=3,
                            timeout=timedelta(seconds=30))

    def grads(hook, in_round):
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.Tanh(),
                                    torch.nn.Linear(64, 3)).to(device)
        ddp = DDP(model, bucket_cap_mb=0.001)  # several buckets; gloo, on CUDA tensors too
        if hook:
            ddp.register_comm_hook(None, inprocess.ddp_comm_hook)
        control = None
        if in_round:
            control = inprocess._Control(control_path, 0, {"ELASTICD_ROUND": "3"})
            inprocess._current = control
            control.begin(3)
        x = torch.randn(5, 16, generator=torch.Generator().manual_seed(rank)).to(device)
        ddp(x).square().mean().backward()
        if control is not None:
            assert not control._pending, "every gate settled"
            control.left(3)
            control.close()
            inprocess._current = None
        return [p.grad.clone() for p in model.parameters()]

    plain = grads(False, False)
    for in_round in (False, True):
        hooked = grads(True, in_round)
        same = all(torch.equal(a, b) for a, b in zip(plain, hooked))
        print(f"in_round={in_round} bitwise={same}", flush=True)
    dist.destroy_process_group()
    """
)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_ddp_comm_hook_averages_the_gradients_bit_for_bit_as_ddp_does(tmp_path, device):
    """``ei.ddp_comm_hook`` in a world of three (1/3 is not exact in fp32): the gradients
    equal DDP's own all-reduce's bit for bit, with no in-process round (DDP's future) and
    inside one on gloo (the abandonable gate), over several buckets; every gate is
    settled when backward returns. On CUDA (gloo reduces CUDA tensors, three ranks on one
    device) the gate must name the device, or it refuses the bucket."""
    if device == "cuda":
        import torch

        if not torch.cuda.is_available():
            pytest.skip("needs CUDA")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = str(s.getsockname()[1])
    (tmp_path / "parity.py").write_text(HOOK_PARITY_SCRIPT)
    control = str(tmp_path / "control.json")
    procs = [
        subprocess.Popen([sys.executable, str(tmp_path / "parity.py"), str(rank), port, control, device],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        for rank in range(3)
    ]  # fmt: skip
    try:
        outs = [p.communicate(timeout=60) for p in procs]
    finally:
        for p in procs:
            p.kill()
            p.wait()
    for p, (out, err) in zip(procs, outs, strict=True):
        assert p.returncode == 0, err[-2000:]
        assert out.split("\n")[:2] == [
            "in_round=False bitwise=True",
            "in_round=True bitwise=True",
        ], out + err[-2000:]


HOOK_EXIT_SCRIPT = textwrap.dedent(
    """
    import sys, threading, time
    from datetime import timedelta
    import torch, torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP
    from elasticd.agent.launch import write_control
    from elasticd import inprocess

    rank, port, control_path, early = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], float(sys.argv[4])
    TIMEOUT = 2.0
    store = dist.TCPStore("127.0.0.1", port, 2, rank == 0, timeout=timedelta(seconds=30))
    dist.init_process_group("gloo", store=store, rank=rank, world_size=2,
                            timeout=timedelta(seconds=TIMEOUT))
    ddp = DDP(torch.nn.Sequential(*[torch.nn.Linear(32, 32) for _ in range(6)]),
              bucket_cap_mb=0.001)  # several buckets
    ddp.register_comm_hook(ddp.process_group, inprocess.ddp_comm_hook)
    if rank == 1:  # alive, connected, never in the all-reduce
        time.sleep(TIMEOUT + 6)
        sys.exit(0)
    inprocess._current = control = inprocess._Control(control_path, 0, {"ELASTICD_ROUND": "3"})
    control.begin(3)
    write_control(control_path, round_=3, state="abort")
    start = time.monotonic()
    try:
        ddp(torch.ones(2, 32)).sum().backward()
        print("still here", flush=True)
    except RuntimeError as exc:
        print(f"left: {exc}", flush=True)
    names = [t.name for t in threading.enumerate()]
    print(f"waiters {names.count('elasticd-ddp')} holders {names.count('elasticd-abandoned')}"
          f" pending {len(control._pending)}", flush=True)
    # The process exits as gloo ends the abandoned all-reduces (their timeout): the
    # waiter blocked in one must not be in C++ then.
    time.sleep(max(0.0, start + TIMEOUT - early - time.monotonic()))
    sys.exit(7)
    """
)


def test_an_abandoned_ddp_all_reduce_holds_one_thread_and_never_aborts_the_exit(tmp_path):
    """After ``ei.ddp_comm_hook``'s all-reduces are abandoned (several buckets), one
    waiter thread holds them all (there was one holder thread per bucket), and a process
    that exits as gloo ends them (their group timeout, 2 s here) exits with its own code.
    Its waiter, blocked in gloo's ``wait()``, was aborted by the interpreter's exit as
    it took the GIL back (``terminate``, exit code 134: 5 of 18 such exits 0.08-0.12 s
    before the timeout); now it waits in slices and parks in Python at exit."""
    script = tmp_path / "exit.py"
    script.write_text(HOOK_EXIT_SCRIPT)
    control = str(tmp_path / "control.json")
    for early in (0.12, 0.1, 0.08):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = str(s.getsockname()[1])
        procs = [
            subprocess.Popen([sys.executable, str(script), str(rank), port, control, str(early)],
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
            for rank in (0, 1)
        ]  # fmt: skip
        try:
            out, err = procs[0].communicate(timeout=60)
        finally:
            for p in procs:
                p.kill()
                p.wait()
        assert procs[0].returncode == 7, f"exit {procs[0].returncode}: {out}{err[-2000:]}"
        assert "left: " in out and "RoundAborted" in out, out + err[-2000:]
        assert "waiters 1 holders 0 pending 0" in out, out


WAITER_SCRIPT = textwrap.dedent(
    """
    import sys, threading, time
    import torch.distributed as dist
    from elasticd.agent.launch import write_control
    from elasticd import inprocess

    control_path = sys.argv[1]
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)

    class Work:  # a transfer gloo has not ended: wait() blocks until released
        def __init__(self, error=None):
            self.release, self.error = threading.Event(), error
        def wait(self):
            self.release.wait()
            if self.error:
                raise self.error

    def waiters():
        return sum(t.name == "elasticd-transfer" for t in threading.enumerate())

    inprocess._current = control = inprocess._Control(control_path, 0, {"ELASTICD_ROUND": "3"})
    control.begin(3)
    w = Work()
    threading.Timer(0.3, w.release.set).start()
    inprocess.wait_transfer(w)
    print("healthy", waiters(), flush=True)
    w = Work(RuntimeError("connection closed by peer"))
    w.release.set()
    try:
        inprocess.wait_transfer(w)
    except RuntimeError as exc:
        print("raised", exc, flush=True)
    stuck = []
    for round_ in (3, 4, 5):  # each round ends with a transfer still pending
        if round_ > 3:
            control.begin(round_)
        stuck.append(Work())
        threading.Timer(0.2, write_control, (control_path,),
                        {"round_": round_, "state": "abort"}).start()
        start = time.monotonic()
        try:
            inprocess.wait_transfer(stuck[-1])
        except inprocess.RoundAborted:
            print(f"abandoned after {time.monotonic() - start:.1f} s, waiters {waiters()}",
                  flush=True)
    control.begin(6)
    w = Work()
    w.release.set()
    inprocess.wait_transfer(w)
    print("after", waiters(), flush=True)
    for w in stuck[:2]:  # gloo ends two at last: their waiters end too
        w.release.set()
    time.sleep(0.5)
    print("released", waiters(), flush=True)
    sys.exit(0)  # a normal exit, the third still blocked: its waiter must not hold it up
    """
)


def test_transfers_wait_on_a_daemon_waiter_that_is_retired_when_abandoned(tmp_path):
    """wait_transfer (the pipeline's sends and receives): a healthy transfer completes
    through the waiter thread, a transfer's error reaches the caller, one still pending
    0.3 s after its round ended is abandoned, the next one gets a fresh waiter, and the
    abandoned waiters end once gloo ends their transfers: none piles up over rounds, and a
    waiter still blocked never holds up the process's exit."""
    script = tmp_path / "waiter.py"
    script.write_text(WAITER_SCRIPT)
    control = str(tmp_path / "control.json")
    p = subprocess.run([sys.executable, str(script), control], capture_output=True,
                       text=True, timeout=60)  # fmt: skip
    assert p.returncode == 0, p.stderr[-3000:]
    lines = p.stdout.splitlines()
    assert lines[0] == "healthy 1" and lines[1] == "raised connection closed by peer", lines
    abandoned = [ln for ln in lines if ln.startswith("abandoned after")]
    assert len(abandoned) == 3, lines
    for ln in abandoned:
        assert float(ln.split()[2]) < 2, ln  # within ABANDON_AFTER and a slice, give or take
    # Blocked ones: one per abandoned transfer (each still waiting), and the new one.
    assert lines[-2] == "after 4" and lines[-1] == "released 2", lines


def test_a_wait_marks_after_a_second_refreshes_and_unmarks_only_when_it_completed(monkeypatch):
    """The waiting mark (a rank blocked on its peers is not the one that hangs): set after
    WAITING_MARK, refreshed as often, cleared when the wait completes; a wait that failed
    keeps it until it goes stale (the rank leaves its round before writing its fault, and
    must not look hung meanwhile)."""
    from elasticd import inprocess

    now = [100.0]
    monkeypatch.setattr(inprocess.time, "monotonic", lambda: now[0])
    calls = []
    control = SimpleNamespace(channel=SimpleNamespace(waiting=calls.append))
    with inprocess._Waiting(control) as w:
        for t in (100.5, 101.0, 101.5, 102.0):
            now[0] = t
            w.tick()
    assert calls == [True, True, False]
    calls.clear()
    with pytest.raises(RuntimeError), inprocess._Waiting(control) as w:
        now[0] += inprocess.WAITING_MARK
        w.tick()
        raise RuntimeError("Connection closed by peer")
    assert calls == [True]


def test_the_nccl_teardown_forgets_every_group_and_keeps_no_gloo_one(tmp_path):
    """``_abort_nccl`` (an ended NCCL round's teardown) empties torch's table of groups
    itself and keeps the NCCL groups' objects for the process's life (their destructor
    can block with the GIL held). The round's gloo groups (side groups) are not kept:
    they go with the table's references, threads and sockets with them, as on a gloo
    round. Here on a gloo world (no NCCL group on a CPU machine): nothing is kept, every
    group goes, and the next round's groups start from the same names. That NCCL groups
    are kept is seen on a GPU only (tests/test_inprocess_nccl.py goes through it)."""
    import gc
    import weakref

    import torch
    import torch.distributed as dist

    import elasticd.inprocess as ei

    def open_world():
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
        return dist.new_group(backend="gloo")

    side = open_world()
    first = dist.distributed_c10d._get_default_group().group_name
    gone = weakref.ref(side)
    kept = list(ei._retired_groups)
    del side
    ei._abort_nccl()
    try:
        assert not dist.is_initialized()
        assert ei._retired_groups == kept
        gc.collect()
        assert gone() is None  # the side group went (no cycle held it)
        side = open_world()
        assert dist.distributed_c10d._get_default_group().group_name == first
        t = torch.ones(2)
        dist.all_reduce(t, group=side)
        assert t.tolist() == [1.0, 1.0]
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def test_an_nccl_abort_that_hangs_keeps_no_later_abort_from_running(monkeypatch, capfd):
    """An ended NCCL round's teardown aborts its communicators on a thread it leaves behind
    after ``ABORT_WAIT`` s when the abort hangs (one did, on an H200). That thread used to
    hold the one abort lock for as long as it hung, and the control watcher, finding the
    lock taken, then aborted nothing in any later round: the next fault would have left
    every survivor's NCCL kernels spinning. Now each group's abort is claimed once, by the
    watcher or the teardown, and no lock is held across an abort: the later round's
    communicators are aborted, and the hung one is not aborted a second time. The groups
    and backends here are stand-ins for ProcessGroupNCCL (no GPU on this machine): what is
    tested is the bookkeeping."""
    import elasticd.inprocess as ei

    release = threading.Event()
    calls: list[str] = []

    class Backend:
        def __init__(self, name: str, hang: bool = False) -> None:
            self.name, self.hang = name, hang

        def _group_start(self) -> None:
            pass

        def _group_end(self) -> None:
            pass

        def abort(self) -> None:
            calls.append(self.name)
            if self.hang:
                release.wait(30)

    old, new = (object(), Backend("old", hang=True)), (object(), Backend("new"))
    table = [old]
    monkeypatch.setattr(ei, "_nccl_groups", lambda: ([g for g, _ in table], [b for _, b in table]))
    monkeypatch.setattr(ei, "ABORT_WAIT", 0.2)
    monkeypatch.setattr(ei, "_retired_groups", [])
    monkeypatch.setattr(ei, "_abort_begun", {})
    try:
        t0 = time.monotonic()
        ei._abort_nccl()  # the teardown: its abort hangs, and it goes on without it
        assert time.monotonic() - t0 < 5 and calls == ["old"]
        assert "did not return" in capfd.readouterr().err
        table[:] = [old, new]  # the next round's group, beside the kept old one
        assert ei.abort_nccl_communicators() == 1  # the watcher, at the next round's end
        assert calls == ["old", "new"]
        assert ei.abort_nccl_communicators() == 0  # a later look: nothing aborted twice
        assert calls == ["old", "new"]
    finally:
        release.set()


def test_each_round_and_each_torchrun_attempt_has_its_own_store_prefix():
    """A round's keys never meet another's: under elasticd each round has its number; under
    plain torchrun, whose agent store outlives a restart of the workers, each attempt (the
    restart count). With one prefix for every torchrun attempt, the built-in trainer
    restarted after a lost node read the dead attempt's gloo addresses and never connected
    (`bench/recovery.py --cases torchrun`: no step in 150 s, twice; 43 s with this)."""
    from elasticd.inprocess import store_prefix

    run = {"TORCHELASTIC_RUN_ID": "r1"}
    assert store_prefix({**run, "ELASTICD_ROUND": "3"}) == "elasticd/r1/round-3/"
    first = store_prefix({**run, "TORCHELASTIC_RESTART_COUNT": "0"})
    again = store_prefix({**run, "TORCHELASTIC_RESTART_COUNT": "1"})
    assert first != again and first == store_prefix(run)
    assert store_prefix({"TORCHELASTIC_RUN_ID": "r2", "TORCHELASTIC_RESTART_COUNT": "1"}) != again


def test_a_node_keeps_the_newest_round_directories_of_a_run_only(tmp_path):
    """A long job re-formed thousands of times left a directory per round in every node's
    state dir; a round's start now deletes those older than the newest eight, and nothing
    else (another run's, a file of the user's)."""
    from elasticd.agent.launch import ROUND_DIRS_KEPT, prune_rounds

    for r in (1, 2, 3, 9, 10, 11, 12, 13, 14, 15, 16, 17):
        (tmp_path / f"round-{r}").mkdir()
        (tmp_path / f"round-{r}" / "workers.json").write_text("{}")
    (tmp_path / "round-x").mkdir()
    (tmp_path / "notes.txt").write_text("mine")
    prune_rounds(str(tmp_path), 17)
    assert ROUND_DIRS_KEPT == 8
    assert sorted(os.listdir(tmp_path)) == sorted(
        ["notes.txt", "round-x", *(f"round-{r}" for r in range(10, 18))]
    )
    prune_rounds(str(tmp_path / "missing"), 5)  # nothing there: nothing to do


@pytest.mark.parametrize(
    ("visible", "local_rank", "want"),
    [(8, 3, 3), (1, 3, 0), (1, 0, 0), (2, 3, None)],
    ids=["all-visible", "one-per-process", "one", "too-few"],
)
def test_a_workers_device_is_its_local_rank_or_the_one_it_sees(
    monkeypatch, visible, local_rank, want
):
    """torchrun or Slurm with one device per process: LOCAL_RANK 3 sees only cuda:0, and
    the built-in trainer's cuda:3 was an invalid device ordinal (a GPU review). Pure
    logic: CUDA's presence and count are stood in for."""
    import torch

    from elasticd.inprocess import local_device

    made = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: visible)
    monkeypatch.setattr(torch.cuda, "set_device", made.append)
    if want is None:
        with pytest.raises(ValueError, match="LOCAL_RANK 3 but 2 CUDA devices are visible"):
            local_device(local_rank)
        assert not made
    else:
        assert local_device(local_rank) == torch.device("cuda", want) and made == [want]


HELD_SCRIPT = textwrap.dedent(
    """
    import torch, torch.distributed as dist
    from elasticd import inprocess

    def world():
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
        side = dist.new_group([0])
        return dist.group.WORLD, side

    first = world()
    ddp = torch.nn.parallel.DistributedDataParallel(torch.nn.BatchNorm1d(4))
    inprocess._close_round(abort=True)
    held = inprocess._held_groups
    assert any(g is first[0] for g in held), "the round's group is held past its close"
    del ddp  # DDP lets go: the group is not destroyed on this thread
    second = world()
    inprocess._close_round(abort=True)
    assert not any(g is first[0] for g in held), "the round before's is let go"
    assert all(any(g is s for g in held) for s in second), "both groups of the round held"
    inprocess._release_held_groups(wait=10)
    assert held == [] and not any(t.is_alive() for t in inprocess._releasers)
    print("ok", flush=True)
    """
)


def test_a_rounds_gloo_groups_are_held_until_the_next_round_closes_and_let_go_at_the_end():
    """A DDP script's group was destroyed by whichever thread dropped the Reducer, with
    the GIL held: a deadlock with gloo's thread finishing a failed broadcast of DDP's
    buffers (3 of 13 preemptions of a BatchNorm script). The round's groups are held until
    the next round closes, then let go on a thread of their own; a process that ends
    waits for that, so nothing is left for the interpreter's teardown (which aborted the
    process, "terminate called without an active exception")."""
    env = dict(os.environ, OMP_NUM_THREADS="1")
    p = subprocess.run([sys.executable, "-c", HELD_SCRIPT],
                       capture_output=True, text=True, timeout=120, env=env)  # fmt: skip
    assert p.returncode == 0 and p.stdout.strip() == "ok", p.stderr[-3000:]


def test_sync_state_refuses_step_none_only_from_a_process_that_trained(tmp_path):
    """``step=None`` is for a process that holds nothing yet. One that trained (its channel
    reported a step past the one its round resumed at, in this round or an earlier one)
    and passes None is a script that never kept its step: refused. A heartbeat of the step
    a script resumed at on its own is no training, and a newcomer reported nothing."""
    import torch

    from elasticd.inprocess import Context, MisuseError
    from elasticd.worker import ENV_HEARTBEAT, WorkerChannel

    def ctx(channel, trained_step=None):
        control = SimpleNamespace(channel=channel, trained_step=trained_step)
        return Context(round=1, rank=0, world_size=1, local_rank=0, env={}, state={},
                       _control=control)  # fmt: skip

    tensors = {"w": torch.zeros(2)}
    channel = WorkerChannel.from_env({ENV_HEARTBEAT: str(tmp_path / "hb")})
    assert ctx(channel).sync_state(tensors, step=None) is None  # a newcomer
    channel.progress(step=100)  # resumed at 100 from its own checkpoint: a heartbeat
    assert ctx(channel).sync_state(tensors, step=None) is None
    channel.progress(step=101)
    with pytest.raises(MisuseError, match=r"step=None, but this process trained to step 101"):
        ctx(channel).sync_state(tensors, step=None)
    fresh = WorkerChannel.from_env({ENV_HEARTBEAT: str(tmp_path / "hb2")})  # a later round's
    with pytest.raises(MisuseError, match="trained to step 7 and holds its state"):
        ctx(fresh, trained_step=7).sync_state(tensors, step=None)


def test_a_lacking_name_is_told_from_a_list_item_past_the_prefixes_every_name_has():
    from elasticd.inprocess import _has_list_item

    assert _has_list_item("other/1/history/3#n")  # a loss history that grew
    assert not _has_list_item("other/1/shadow/w")  # an EMA's lazily made state
    assert not _has_list_item("optim/param_groups/1/params/0/square_avg")
    assert _has_list_item("optim/param_groups/0/extra/2#n")


def test_the_stuck_dump_names_every_native_thread_and_where_it_waits():
    """A worker that exits stuck says where its threads wait in the kernel, gloo's and
    torch's included, which the Python stacks do not show: one line per thread, a
    sleeping one named with its state and its system call."""
    import threading
    import time

    from elasticd.inprocess import native_threads

    ready = threading.Event()

    def nap() -> None:
        ready.set()
        time.sleep(5)

    t = threading.Thread(target=nap, daemon=True)
    t.start()
    ready.wait()
    time.sleep(0.2)
    lines = native_threads()
    assert str(threading.main_thread().native_id) in {line.split()[0] for line in lines}
    tid = str(t.native_id)
    (mine,) = [line for line in lines if line.split()[0] == tid]
    _, _, state, wchan, number, *_ = mine.split()
    assert state == "S" and wchan != "?" and number.isdigit(), mine
