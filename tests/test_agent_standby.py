"""The back-off of standby workers (``restart.standby``): a standby that keeps exiting on its
own is started again after 6 s, then 12, 24 ... at most STANDBY_BACKOFF_CAP, and the count
starts over once the standbys come up (their ready files exist).

The agent's decision runs on its own: ``JobRunner._ensure_standby`` with a clock the test
moves, and standbys that are real processes (``sleep``) the test kills, started through a
stand-in for ``launch.standby_workers`` (which would start the trainer's warm worker).
"""

from __future__ import annotations

import subprocess
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from elasticd.agent import launch
from elasticd.agent.runner import STANDBY_BACKOFF_CAP, JobRunner
from elasticd.agent.workers import Worker, WorkerGroup


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def runner(monkeypatch, tmp_path: Path):
    clock = Clock()
    started: list[Worker] = []

    def standby_workers(*, count: int, **_kw) -> WorkerGroup:
        group = WorkerGroup()
        for _ in range(count):
            k = len(started)
            w = Worker(local_rank=-1 - k, rank=-1, proc=subprocess.Popen(["sleep", "120"]),
                       log_path=str(tmp_path / f"standby-{k}.log"), heartbeat_path="",
                       error_path="", started=clock.now, warm=True, standby=True,
                       env_ready=str(tmp_path / f"standby-{k}.ready"))  # fmt: skip
            started.append(w)
            group.workers.append(w)
        return group

    monkeypatch.setattr(launch, "standby_workers", standby_workers)
    r = object.__new__(JobRunner)
    r._clock = clock
    r._standby, r._standby_failures, r._standby_next = None, 0, 0.0
    r._forks, r._fork_restarts = None, 0
    r.job = SimpleNamespace(restart=SimpleNamespace(standby=1))
    r.record = SimpleNamespace(run_id="run-1")
    r._node, r.devices, r.name = None, None, "job"
    r._doorbell = None  # made by run(), which this test does not call
    yield r, clock, started
    for w in started:
        w.proc.kill()
        w.proc.wait()


def _kill(w: Worker) -> None:
    w.proc.kill()
    w.proc.wait()


def _wait_exit(w: Worker) -> None:
    deadline = time.monotonic() + 10
    while w.proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.01)


def test_a_standby_that_keeps_exiting_is_restarted_after_a_doubling_pause(runner) -> None:
    r, clock, started = runner
    r._ensure_standby()
    assert len(started) == 1
    pauses = []
    for expected in (6.0, 12.0, 24.0, 48.0):
        _kill(started[-1])
        clock.now += 1
        r._ensure_standby()  # sees the exit, starts nothing yet
        assert len(started) == len(pauses) + 1
        pauses.append(r._standby_next - clock.now)
        assert pauses[-1] == expected
        clock.now = r._standby_next - 0.01
        r._ensure_standby()
        assert len(started) == len(pauses), "started again before its pause ended"
        clock.now = r._standby_next
        r._ensure_standby()
        assert len(started) == len(pauses) + 1 and started[-1].proc.poll() is None
    assert r._standby.alive() == 1


def test_the_pause_is_capped_and_the_count_starts_over_once_a_standby_comes_up(runner) -> None:
    r, clock, started = runner
    r._ensure_standby()
    r._standby_failures = 20  # 3 * 2**21 s uncapped
    _kill(started[-1])
    clock.now += 1
    r._ensure_standby()
    assert r._standby_next - clock.now == STANDBY_BACKOFF_CAP
    clock.now = r._standby_next
    r._ensure_standby()
    assert len(started) == 2
    Path(started[-1].env_ready).write_text("")  # its imports are done: it starts fine
    clock.now += 1
    r._ensure_standby()
    assert r._standby_failures == 0
    _kill(started[-1])
    clock.now += 1
    r._ensure_standby()
    assert r._standby_next - clock.now == 6.0


def test_a_live_standby_is_not_doubled_and_one_that_exits_is_logged(runner, caplog) -> None:
    r, clock, started = runner
    for _ in range(3):
        r._ensure_standby()
        clock.now += 1
    assert len(started) == 1, "a live standby was started again"
    started[0].proc.terminate()
    _wait_exit(started[0])
    with caplog.at_level("WARNING", logger="elasticd.agent"):
        r._ensure_standby()
    assert any("standby worker exited" in rec.getMessage() for rec in caplog.records)
