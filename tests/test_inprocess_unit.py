"""elasticd.inprocess without agents: the socket abort, the control file, error classes,
and (on a CUDA machine) the NCCL abort path."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import textwrap
import threading
import time

import pytest

from elasticd.agent.launch import write_control
from elasticd.inprocess import _Control, _socket_fds, is_comm_error, shutdown_new_sockets


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


def test_communication_errors_are_told_from_bugs():
    assert is_comm_error(RuntimeError("[gloo/transport/tcp/pair.cc:553] Connection closed by peer"))
    assert is_comm_error(ConnectionResetError("Connection reset by peer"))
    assert not is_comm_error(ValueError("bad shape"))
    assert not is_comm_error(KeyError("step"))
    assert not is_comm_error(RuntimeError("mat1 and mat2 shapes cannot be multiplied"))


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
