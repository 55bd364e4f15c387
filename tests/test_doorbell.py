"""The agent's doorbell: a worker that reports a fault rings it, and the agent's
supervision wakes then, not at its next look (``TICK``)."""

from __future__ import annotations

import os
import threading

from elasticd.worker import ENV_DOORBELL, Doorbell, WorkerChannel, ring


def test_a_ring_wakes_the_wait_and_many_rings_are_one_wake_up(tmp_path):
    bell = Doorbell(str(tmp_path / "doorbell"))
    assert bell.path == str(tmp_path / "doorbell")
    try:
        assert bell.wait(0.01) is False  # nobody rang: the whole timeout
        woke = []
        waiter = threading.Thread(target=lambda: woke.append(bell.wait(60)))
        waiter.start()
        ring(bell.path)
        waiter.join(timeout=30)
        assert woke == [True]  # well before the 60 s timeout (the join would have failed)
        for _ in range(3):
            ring(bell.path)
        assert bell.wait(0) is True
        assert bell.wait(0) is False  # drained
        for _ in range(70_000):  # more than a pipe holds: a full pipe never blocks a worker
            ring(bell.path)
        assert bell.wait(0) is True
    finally:
        bell.close()
    assert not os.path.exists(tmp_path / "doorbell")
    ring(str(tmp_path / "doorbell"))  # the agent gone: nothing, no error
    ring(None)


def test_a_fault_rings_the_doorbell_its_environment_names(tmp_path):
    bell = Doorbell(str(tmp_path / "doorbell"))
    try:
        env = {"ELASTICD_HEARTBEAT_FILE": str(tmp_path / "hb.json"), "RANK": "0",
               ENV_DOORBELL: bell.path}  # fmt: skip
        channel = WorkerChannel.from_env(env)
        assert bell.wait(0) is False
        channel.fault("RuntimeError: Connection closed by peer")
        assert bell.wait(0) is True
        channel.peer_preempted()
        assert bell.wait(0) is True
        channel.progress(step=3)  # progress is read at the agent's pace: no ring
        assert bell.wait(0) is False
    finally:
        bell.close()


def test_without_a_fifo_the_wait_is_a_plain_sleep(tmp_path):
    bell = Doorbell(str(tmp_path / "missing-dir" / "doorbell"))
    assert bell.path is None
    assert bell.wait(0.01) is False
    bell.close()


def test_a_doorbell_half_made_keeps_no_descriptor_and_no_fifo(tmp_path, monkeypatch):
    """Out of descriptors at the writer's open: the reader's descriptor is closed again,
    the FIFO is gone, and the wait is a plain sleep."""
    real_open, opened = os.open, []

    def open_then_emfile(path, flags, *args):
        if flags & os.O_WRONLY:
            raise OSError(24, "Too many open files")
        fd = real_open(path, flags, *args)
        opened.append(fd)
        return fd

    monkeypatch.setattr(os, "open", open_then_emfile)
    bell = Doorbell(str(tmp_path / "doorbell"))
    monkeypatch.undo()
    assert bell.path is None and len(opened) == 1
    assert not os.path.exists(tmp_path / "doorbell")
    try:
        os.fstat(opened[0])
    except OSError:
        pass
    else:
        raise AssertionError("the reader's descriptor was left open")
    assert bell.wait(0.01) is False
    bell.close()
