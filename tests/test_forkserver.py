"""The fork server (elasticd.agent.forkserver), with real processes: a forked worker must
be what an exec'd ``python -m MODULE ARGS`` would be, except faster; and whatever cannot
be forked is exec'd."""

from __future__ import annotations

import glob
import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from elasticd.agent.forkserver import ForkedProcess, ForkServer, signal_group
from elasticd.agent.workers import _exec, _start

PROBE = textwrap.dedent(
    """
    import json, os, random, sys, time
    info = {"argv": sys.argv, "cwd": os.getcwd(), "path0": sys.path[0],
            "rank": os.environ.get("RANK"), "pid": os.getpid(), "ppid": os.getppid(),
            "sid": os.getsid(0), "pgid": os.getpgid(0), "torch": "torch" in sys.modules,
            "name": __name__, "fds": sorted(int(f) for f in os.listdir("/proc/self/fd")),
            "stdin": os.readlink("/proc/self/fd/0"), "random": random.random(),
            "main": sys.modules["__main__"].__dict__.get("MARK"),
            "file": __file__, "spec": repr(__spec__),
            "np": int(sys.modules["numpy"].random.randint(1 << 30)) if "numpy" in sys.modules else None,
            "authkey": __import__("multiprocessing").current_process().authkey.hex()}
    MARK = 1
    print(json.dumps(info), flush=True)
    print("to stderr", file=sys.stderr, flush=True)
    what = sys.argv[1] if len(sys.argv) > 1 else ""
    if what == "raise":
        raise ValueError("boom")
    if what == "sleep":
        time.sleep(120)
    if what == "usr1":  # a handler of its own, as Lightning's
        import signal
        signal.signal(signal.SIGUSR1, lambda *_: print("usr1", flush=True))
        print("handler", flush=True)
        time.sleep(120)
    if what == "child":  # a process of its own, in its group
        import subprocess
        c = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
        print(json.dumps({"grandchild": c.pid}), flush=True)
        time.sleep(120)
    if what == "cuda":  # the server imported torch; CUDA starts here, in the child
        import torch
        print(json.dumps({"cuda": torch.ones(4, device="cuda").sum().item()}), flush=True)
    sys.exit(int(what) if what.isdigit() else 0)
    """
)


@pytest.fixture
def box(tmp_path, monkeypatch):
    (tmp_path / "fsprobe.py").write_text(PROBE)
    monkeypatch.chdir(tmp_path)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    servers = []

    def server(preload=("torch",)):
        s = ForkServer(python=sys.executable, preload=preload, env=env, cwd=str(tmp_path),
                       log_path=str(tmp_path / "server.log"))  # fmt: skip
        servers.append(s)
        return s

    yield tmp_path, env, server
    for s in servers:
        s.close()


def argv(*args):
    return [sys.executable, "-m", "fsprobe", *args]


def info(path):
    return json.loads(path.read_text().splitlines()[0])


def wait_for(pred, timeout=30.0):
    deadline = time.monotonic() + timeout
    while not pred():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.02)


def alive(pid):
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii") as fh:
            return fh.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def test_a_forked_worker_is_what_python_dash_m_would_be(box):
    tmp, env, server = box
    s = server()
    assert s.wait_ready(120)
    procs = []
    for i in range(2):
        p = _start(argv("3"), {**env, "RANK": str(i)}, str(tmp), str(tmp / f"w{i}.log"), s)
        assert isinstance(p, ForkedProcess) and not p.pending
        procs.append(p)
    assert [p.wait(60) for p in procs] == [3, 3]
    seen = [info(tmp / f"w{i}.log") for i in range(2)]
    exec_ = _exec(argv("3"), env, str(tmp), str(tmp / "exec.log"))
    assert exec_.wait(60) == 3
    ref = info(tmp / "exec.log")
    for i, got in enumerate(seen):
        assert got["ppid"] == s.pid and got["torch"]  # forked from the server
        assert got["rank"] == str(i)
        for key in ("argv", "cwd", "path0", "name", "fds", "stdin", "main"):
            assert got[key] == ref[key], key
        assert got["sid"] == got["pgid"] == got["pid"]  # its own session, as exec'd ones
        assert (tmp / f"w{i}.log").read_text().splitlines()[1] == "to stderr"
    assert not ref["torch"]
    # What a new process draws afresh, each child has of its own: Python's and numpy's
    # random states (numpy's is the server's, imported with torch, unless reseeded) and
    # multiprocessing's key.
    for key in ("random", "np", "authkey"):
        assert seen[0][key] != seen[1][key], key
    assert seen[0]["np"] is not None
    log = (tmp / "server.log").read_text()
    assert f"forked {seen[0]['pid']}" in log and f"exited {seen[1]['pid']}: 3" in log


def test_a_forked_script_is_what_python_script_would_be(box):
    """``python SCRIPT.py ARGS`` (a job's own command under ``restart.fork: true``)."""
    tmp, env, server = box
    s = server()
    assert s.wait_ready(120)
    (tmp / "sub").mkdir()
    (tmp / "sub" / "probe.py").write_text(PROBE)
    os.symlink(tmp / "sub" / "probe.py", tmp / "link.py")  # python resolves sys.path[0]
    for script in ("sub/probe.py", str(tmp / "link.py")):
        cmd = [sys.executable, script, "4"]
        p = _start(cmd, env, str(tmp), str(tmp / "forked.log"), s)
        assert isinstance(p, ForkedProcess) and p.wait(60) == 4
        assert _exec(cmd, env, str(tmp), str(tmp / "exec.log")).wait(60) == 4
        got, ref = info(tmp / "forked.log"), info(tmp / "exec.log")
        assert got["ppid"] == s.pid and got["torch"] and not ref["torch"]
        for key in ("argv", "cwd", "path0", "name", "fds", "file", "spec", "main"):
            assert got[key] == ref[key], key
        for log in ("forked.log", "exec.log"):
            (tmp / log).unlink()
    # A script that is not there: python's line and exit code 2, as exec'd.
    p = _start([sys.executable, "missing.py"], env, str(tmp), str(tmp / "missing.log"), s)
    assert isinstance(p, ForkedProcess) and p.wait(60) == 2
    assert "can't open file" in (tmp / "missing.log").read_text()


def test_an_exception_and_a_signal_end_a_forked_worker_as_they_end_python(box):
    tmp, env, server = box
    s = server()
    assert s.wait_ready(120)
    p = _start(argv("raise"), env, str(tmp), str(tmp / "raise.log"), s)
    assert p.wait(60) == 1
    assert (tmp / "raise.log").read_text().strip().splitlines()[-1] == "ValueError: boom"
    p = _start(argv("child"), env, str(tmp), str(tmp / "child.log"), s)
    wait_for(lambda: "grandchild" in (tmp / "child.log").read_text())
    grandchild = json.loads((tmp / "child.log").read_text().splitlines()[-1])["grandchild"]
    signal_group(p, signal.SIGKILL)  # as the agent stops a worker: its whole group
    assert p.wait(30) == -signal.SIGKILL
    wait_for(lambda: not alive(grandchild))


def test_a_worker_asked_for_before_the_imports_are_done_waits_or_is_cancelled(box):
    tmp, env, server = box
    s = server()
    early = _start(argv("0"), env, str(tmp), str(tmp / "early.log"), s)
    cancelled = _start(argv("0"), env, str(tmp), str(tmp / "cancelled.log"), s)
    assert early.pending and cancelled.pending and early.poll() is None
    signal_group(cancelled, signal.SIGTERM)
    assert cancelled.poll() == -signal.SIGTERM
    with pytest.raises(ProcessLookupError):
        _ = cancelled.pid  # no pid, never 0 or -1
    assert early.pid > 0  # waits for the server, then forks
    assert early.wait(60) == 0 and info(tmp / "early.log")["torch"]
    assert s.ready and not (tmp / "cancelled.log").exists()


def test_what_a_fork_cannot_keep_the_same_is_execd(box):
    tmp, env, server = box
    s = server()
    assert s.wait_ready(120)
    # OMP_NUM_THREADS is read when torch's OpenMP loads, in the server: a worker that
    # wants another value is exec'd.
    p = _start(argv("0"), {**env, "OMP_NUM_THREADS": "2"}, str(tmp), str(tmp / "omp.log"), s)
    assert isinstance(p, ForkedProcess) and p.wait(60) == 0
    assert not info(tmp / "omp.log")["torch"]
    # Not `python -m MODULE` or `python SCRIPT.py`: exec'd straight away.
    for cmd in ([sys.executable, "-u", "fsprobe.py", "0"], [sys.executable, "-c", "pass"],
                ["/bin/true"]):  # fmt: skip
        plain = _start(cmd, env, str(tmp), str(tmp / "p.log"), s)
        assert isinstance(plain, subprocess.Popen) and plain.wait(60) == 0


def test_a_server_that_cannot_import_has_its_workers_execd(box):
    tmp, env, server = box
    s = server(preload=("no_such_module_here",))
    p = _start(argv("5"), env, str(tmp), str(tmp / "w.log"), s)
    assert p.wait(60) == 5
    assert not info(tmp / "w.log")["torch"]
    assert "no_such_module_here" in (s.failed or "")
    assert "failed: import no_such_module_here" in (tmp / "server.log").read_text()


def test_workers_die_with_their_server_and_the_server_with_its_agent(box):
    tmp, env, server = box
    s = server()
    assert s.wait_ready(120)
    p = _start(argv("sleep"), env, str(tmp), str(tmp / "w.log"), s)
    wait_for(lambda: (tmp / "w.log").exists() and (tmp / "w.log").read_text())
    s.close()
    assert p.wait(30) == -signal.SIGKILL
    # An agent SIGKILLed: its server goes, and the worker with it.
    agent = textwrap.dedent(
        f"""
        import sys, time
        sys.path[:0] = {sys.path!r}
        from elasticd.agent.forkserver import ForkServer
        from elasticd.agent.workers import _start
        s = ForkServer(python=sys.executable, preload=("json",), env={env!r}, cwd={str(tmp)!r},
                       log_path={str(tmp / "agent-server.log")!r})
        assert s.wait_ready(60)
        p = _start({argv("sleep")!r}, {env!r}, {str(tmp)!r}, {str(tmp / "w2.log")!r}, s)
        print(s.pid, p.pid, flush=True)
        time.sleep(120)
        """
    )
    proc = subprocess.Popen([sys.executable, "-c", agent], stdout=subprocess.PIPE, text=True)
    server_pid, worker_pid = map(int, proc.stdout.readline().split())
    assert alive(server_pid) and alive(worker_pid)
    proc.kill()
    proc.wait()
    wait_for(lambda: not alive(server_pid) and not alive(worker_pid))


def forked_pids(job) -> set[int]:
    """Every worker pid the job's fork servers forked, from their logs."""
    import glob
    import re

    out: set[int] = set()
    for path in glob.glob(os.path.join(job.out_dir, "logs", "*", "forkserver", "*.log")):
        with open(path, encoding="utf-8") as fh:
            out.update(int(m) for m in re.findall(r"^forked (\d+):", fh.read(), re.M))
    return out


@pytest.mark.parametrize("switch", ["on", "off"])
def test_every_worker_of_a_restarted_job_is_forked_and_the_switch_turns_it_off(
    tmp_path, monkeypatch, switch
):
    """A killed worker restarts every process (restart.mode process): the workers of both
    rounds come from the nodes' fork servers, and the resumed losses equal one process's.
    ``ELASTICD_FORK_SERVER=0``: no server, every worker exec'd, the same result."""
    from test_agent_trainer import make_job, reference_losses, run
    from test_inprocess import round_pids

    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    if switch == "off":
        monkeypatch.setenv("ELASTICD_FORK_SERVER", "0")
    job = make_job(tmp_path, "forked", nproc=2, steps=10)
    result = run(job, 1, ["kill-worker=1@step=5"])
    assert result["state"] == "succeeded", result["reason"]
    reference = reference_losses(tmp_path, job)
    for rec in result["metrics"]:
        assert rec["loss"] == pytest.approx(reference[rec["step"]], rel=1e-4), rec["step"]
    rounds = round_pids(job)
    assert len(rounds) == 2, rounds
    workers = set().union(*rounds.values())
    assert len(workers) == 4  # every process restarted
    if switch == "on":
        assert workers <= forked_pids(job)
        # runpy warned in every worker when the server had imported trainer.__main__.
        logs = glob.glob(os.path.join(job.out_dir, "logs", "*", "round-*", "*.log"))
        assert logs and not [p for p in logs if "RuntimeWarning" in Path(p).read_text()]
    else:
        assert not forked_pids(job)


@pytest.mark.gpu
def test_a_forked_worker_of_the_trainers_server_uses_cuda(box):
    """The server imports what the built-in trainer's does and never starts CUDA (its
    driver loaded by the imports would make it refuse to fork): the child starts it."""
    import torch

    from elasticd.agent.forkserver import PRELOAD_TRAINER

    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    tmp, env, server = box
    s = server(preload=PRELOAD_TRAINER)
    assert s.wait_ready(300), s.failed
    p = _start(argv("cuda"), env, str(tmp), str(tmp / "cuda.log"), s)
    assert isinstance(p, ForkedProcess)
    assert p.wait(120) == 0, (tmp / "cuda.log").read_text()
    lines = (tmp / "cuda.log").read_text().splitlines()
    assert info(tmp / "cuda.log")["ppid"] == s.pid
    assert json.loads(lines[-1]) == {"cuda": 4.0}


def test_a_scripts_job_with_fork_true_has_its_workers_forked_and_trains_the_same(tmp_path):
    """examples/ddp_inprocess.py under ``restart.fork: true``: a killed node and then a
    killed worker, whose replacement is forked too; every step once, each loss equal to
    the script alone's (tests/test_inprocess.py's run_example)."""
    from test_inprocess import round_pids, run_example

    job, result = run_example(tmp_path, "ddpfork", "ddp_inprocess.py", 60,
                              {"DDP_STEPS": "60", "DDP_STEP_SLEEP": "0.02"},
                              ["kill-node=1@step=10", "kill-worker=1@step=35"],
                              restart={"mode": "inprocess", "scale_up": "immediate",
                                       "fork": True})  # fmt: skip
    recs = [e for e in result["status"]["history"] if e["kind"] == "recovery"]
    assert [e["mode"] for e in recs] == ["inprocess", "inprocess"], recs
    pids = round_pids(job)
    workers = set().union(*pids.values())
    assert len(pids) >= 3 and workers <= forked_pids(job), (pids, forked_pids(job))


def test_which_jobs_get_a_fork_server(tmp_path, monkeypatch):
    """The built-in trainer's unless ``restart.fork: false`` or the agent's
    ``ELASTICD_FORK_SERVER=0``; a job's own command only with ``fork: true`` and only a
    ``python -m``/``python SCRIPT.py`` one."""
    from types import SimpleNamespace

    from elasticd.agent.launch import NodeInfo
    from elasticd.agent.runner import JobRunner
    from elasticd.jobspec import parse_job

    def server_for(monkeypatch, command=None, fork=None):
        raw = {"name": "j", "output_dir": str(tmp_path / "out"), "restart": {"fork": fork}}
        if command:
            raw["command"] = command
        r = object.__new__(JobRunner)
        r.job = parse_job(raw).with_paths_resolved(tmp_path)
        r.name, r._doorbell = "j", None
        r.record = SimpleNamespace(run_id="j-1")
        r._node = NodeInfo(node_id="n0", addr="127.0.0.1", state_dir=str(tmp_path / "s"))
        s = r._start_fork_server()
        if s is not None:
            s.close()
        return s

    monkeypatch.delenv("ELASTICD_FORK_SERVER", raising=False)
    assert server_for(monkeypatch) is not None
    assert server_for(monkeypatch, fork=False) is None
    assert server_for(monkeypatch, ["python", "train.py"]) is None
    assert server_for(monkeypatch, ["python", "train.py"], fork=True) is not None
    assert server_for(monkeypatch, ["python", "-m", "mytrain"], fork=True) is not None
    assert server_for(monkeypatch, ["bash", "run.sh"], fork=True) is None
    monkeypatch.setenv("ELASTICD_FORK_SERVER", "0")
    assert server_for(monkeypatch) is None


def test_a_signal_right_after_the_fork_reaches_the_worker(box):
    """The pid comes back once the child leads its group: a stop sent at once is not lost
    (it was in 29 of 40 tries, sent before the child's setsid)."""
    tmp, env, server = box
    s = server(preload=("json",))
    assert s.wait_ready(60)
    for i in range(20):
        p = _start(argv("sleep"), env, str(tmp), str(tmp / f"w{i}.log"), s)
        signal_group(p, signal.SIGKILL)
        assert p.wait(30) == -signal.SIGKILL, i


def test_a_stop_cancels_a_pending_worker_even_once_the_server_is_ready(box):
    tmp, env, server = box
    s = server(preload=("json",))
    p = _start(argv("sleep"), env, str(tmp), str(tmp / "w.log"), s)
    assert p.pending
    assert s.wait_ready(60)  # ready now; the worker was not asked for since
    signal_group(p, signal.SIGTERM)
    assert p.poll() == -signal.SIGTERM and not (tmp / "w.log").exists()
    assert "forked" not in (tmp / "server.log").read_text()


def test_a_server_whose_imports_hang_is_given_up_once_for_all_its_workers(box, monkeypatch):
    """READY_WAIT is the server's deadline, not each worker's: four workers asked for
    while it hangs in its imports wait for it once, then are exec'd."""
    from elasticd.agent import forkserver

    tmp, env, server = box
    (tmp / "hangs_on_import.py").write_text("import time\ntime.sleep(300)\n")
    monkeypatch.setattr(forkserver, "READY_WAIT", 2.0)
    s = server(preload=("hangs_on_import",))
    procs = [_start(argv("0"), env, str(tmp), str(tmp / f"w{i}.log"), s) for i in range(4)]
    assert all(p.pending for p in procs)
    began = time.monotonic()
    pids = [p.pid for p in procs]
    waited = time.monotonic() - began
    assert waited < 6.0, waited  # one deadline (2 s), not one per worker (8 s)
    assert "longer than 2 s" in (s.failed or "") and s.proc.wait(10) is not None
    assert all(p.wait(60) == 0 for p in procs) and len(set(pids)) == 4
    assert not any(info(tmp / f"w{i}.log")["torch"] for i in range(4))  # exec'd


def test_a_server_killed_under_its_workers_is_lost_and_they_die_with_it(box):
    tmp, env, server = box
    s = server(preload=("json",))
    assert s.wait_ready(60)
    p = _start(argv("sleep"), env, str(tmp), str(tmp / "w.log"), s)
    assert p.pid > 0
    s.proc.kill()
    assert p.wait(30) == -signal.SIGKILL
    assert not s.usable() and s.lost
    later = _start(argv("0"), env, str(tmp), str(tmp / "later.log"), s)
    assert isinstance(later, subprocess.Popen) and later.wait(60) == 0


def test_only_the_trainers_forked_workers_are_sent_sigusr1_for_their_stacks(box):
    """A forked worker's command line is its server's: the built-in trainer's server
    (it preloads trainer.train) marks its workers as ours; a job's own script forked
    under restart.fork: true may mean something else by SIGUSR1 (Lightning requeues a
    Slurm job) and never gets it."""
    from elasticd.agent.workers import prints_stacks

    tmp, env, server = box
    for preload, ours in ((("json",), False), (("trainer.train",), True)):
        s = server(preload=preload)
        assert s.wait_ready(120)
        p = _start(argv("usr1"), env, str(tmp), str(tmp / f"{ours}.log"), s)
        wait_for(lambda o=ours: "handler" in (tmp / f"{o}.log").read_text())
        assert prints_stacks(p.pid) is ours
        p.kill()
        s.close()


def test_a_runs_server_that_died_is_started_again_a_bounded_number_of_times(tmp_path, monkeypatch):
    """A server killed after it was ready (its workers died with it) is replaced for the
    next round, FORK_SERVER_RESTARTS times a run; past that the run's workers are exec'd.
    One that never became ready (a failed import) is not retried."""
    from types import SimpleNamespace

    from elasticd.agent import forkserver
    from elasticd.agent.launch import NodeInfo
    from elasticd.agent.runner import FORK_SERVER_RESTARTS, JobRunner
    from elasticd.jobspec import parse_job

    monkeypatch.delenv("ELASTICD_FORK_SERVER", raising=False)
    monkeypatch.setattr(forkserver, "PRELOAD_TRAINER", ("json",))
    r = object.__new__(JobRunner)
    r.job = parse_job({"name": "j", "output_dir": str(tmp_path / "out")})
    r.job = r.job.with_paths_resolved(tmp_path)
    r.name, r._doorbell, r._fork_restarts = "j", None, 0
    r.record = SimpleNamespace(run_id="j-1")
    r._node = NodeInfo(node_id="n0", addr="127.0.0.1", state_dir=str(tmp_path / "s"))
    r._forks = first = r._start_fork_server()
    try:
        assert r._live_forks() is first  # alive: kept
        seen = [first]
        for _ in range(FORK_SERVER_RESTARTS):
            assert seen[-1].wait_ready(60)
            seen[-1].proc.kill()
            seen[-1].proc.wait()
            seen.append(r._live_forks())
            assert seen[-1] is not seen[-2] and seen[-1].usable()
        assert seen[-1].wait_ready(60)
        seen[-1].proc.kill()
        seen[-1].proc.wait()
        assert r._live_forks() is seen[-1] and not seen[-1].usable()  # no more
        p = _start(argv("0"), {**os.environ, "OMP_NUM_THREADS": "1"}, str(tmp_path),
                   str(tmp_path / "w.log"), r._live_forks())  # fmt: skip
        assert isinstance(p, subprocess.Popen)  # exec'd
        p.wait(60)
    finally:
        r._forks.close()
