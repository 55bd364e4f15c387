"""In-process restart on NCCL (issue 11): a survivor blocked in an NCCL collective on a
frozen or killed peer leaves its round when the round ends, and trains in the next one,
in the same process.

Two ranks share the one GPU of a single-GPU machine: NCCL refuses two ranks of one host on
one device ("Duplicate GPU detected"), so each rank names a host of its own
(``NCCL_HOSTID``) and they talk through NCCL's socket transport on loopback, as two nodes
would. The kernel of the survivor's all-reduce then waits on the network for its peer, and
only ``ncclCommAbort`` ends it: the control watcher does that when the agent ends the
round (``elasticd.inprocess.abort_nccl_communicators``). Marked ``gpu``: skipped without
CUDA."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch

from elasticd.agent.launch import write_control
from elasticd.etcd import reserve_port

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]

ROOT = Path(__file__).resolve().parents[1]

PAIR_SCRIPT = textwrap.dedent(
    """
    import json, os, sys, time
    import torch, torch.distributed as dist
    import elasticd.inprocess as ei

    progress = sys.argv[1]
    torch.cuda.set_device(0)
    bad = [0]  # sums used that were not the full sum, over every round of the process

    def train(ctx):
        t = torch.empty(1 << 20, device="cuda")
        n = 0
        expected = ctx.world_size * (ctx.world_size + 1) / 2
        while True:
            t.fill_(ctx.rank + 1.0)
            dist.all_reduce(t)
            value = t.min().item()  # blocks here while a peer is frozen or gone
            ei.check_results()  # an aborted all-reduce's value is never used
            n += 1
            bad[0] += value != expected or t.max().item() != expected
            with open(progress + ".tmp", "w") as fh:
                json.dump({"round": ctx.round, "world": ctx.world_size, "n": n, "bad": bad[0],
                           "value": value, "t": time.time()}, fh)
            os.replace(progress + ".tmp", progress)
            if ctx.world_size == 1 and n >= 20:
                return value
            time.sleep(0.005)

    print("result", ei.run(train), "bad", bad[0], "pid", os.getpid(), flush=True)
    """
)


def _progress(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return {}


def _wait(what: str, pred, procs, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not pred():
        for p in procs:
            if p.poll() is not None:
                out, err = p.communicate()
                raise AssertionError(f"a worker exited ({p.returncode}) before {what}:\n"
                                     f"{out[-2000:]}\n{err[-4000:]}")  # fmt: skip
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.01)


@pytest.mark.timeout(240)
@pytest.mark.parametrize("fault", ["frozen", "killed"])
def test_a_survivor_blocked_in_an_nccl_all_reduce_leaves_the_round_and_trains_in_the_next(
    tmp_path, fault
):
    script = tmp_path / "pair.py"
    script.write_text(PAIR_SCRIPT)
    holds = [reserve_port(), reserve_port()]  # rank 0's stores bind them later
    ports = [h.getsockname()[1] for h in holds]
    run_id = f"nccl-{os.getpid()}"
    procs, controls, progress = [], [], []
    for rank in range(2):
        control = tmp_path / f"control-{rank}.json"
        env = {
            **os.environ,
            "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
            "NCCL_HOSTID": f"elasticd-test-node-{rank}",  # two 'hosts': no duplicate-GPU refusal
            "NCCL_SOCKET_IFNAME": "lo",
            "NCCL_IB_DISABLE": "1",
            "NCCL_P2P_DISABLE": "1",
            "NCCL_SHM_DISABLE": "1",
        }
        env.pop("TORCH_NCCL_ASYNC_ERROR_HANDLING", None)  # run() chooses it in-process
        round_env = {"RANK": str(rank), "WORLD_SIZE": "2", "LOCAL_RANK": "0",
                     "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(ports[0]),
                     "ELASTICD_ROUND": "1", "TORCHELASTIC_RUN_ID": run_id,
                     "ELASTICD_RESTART_MODE": "inprocess",
                     "ELASTICD_CONTROL_FILE": str(control)}  # fmt: skip
        write_control(str(control), round_=1, state="run", envs={"0": round_env})
        controls.append(control)
        progress.append(tmp_path / f"progress-{rank}.json")
        procs.append(subprocess.Popen(
            [sys.executable, str(script), str(progress[-1])], env={**env, **round_env},
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        ))  # fmt: skip
    try:
        _wait("both ranks all-reducing", lambda: all(
            _progress(p).get("n", 0) >= 10 for p in progress), procs, timeout=120)  # fmt: skip
        assert _progress(progress[0])["value"] == 3.0  # 1 + 2: a real two-rank all-reduce
        os.kill(procs[1].pid, signal.SIGSTOP if fault == "frozen" else signal.SIGKILL)
        time.sleep(1.0)
        stalled = _progress(progress[0])
        time.sleep(0.5)
        assert _progress(progress[0])["n"] == stalled["n"], "rank 0 went on without its peer"
        # The agent ends round 1 and starts round 2 without the lost node.
        ended = time.time()
        write_control(str(controls[0]), round_=2, state="run", envs={"0": {
            "RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(ports[1]), "ELASTICD_ROUND": "2", "TORCHELASTIC_RUN_ID": run_id,
            "ELASTICD_RESTART_MODE": "inprocess", "ELASTICD_CONTROL_FILE": str(controls[0]),
        }})  # fmt: skip
        _wait("rank 0 in round 2", lambda: _progress(progress[0]).get("round") == 2,
              procs[:1], timeout=60)  # fmt: skip
        first = _progress(progress[0])
        out, err = procs[0].communicate(timeout=60)
    finally:
        for p in procs:
            if p.poll() is None:
                os.kill(p.pid, signal.SIGCONT)
                p.kill()
            p.communicate()
        for h in holds:
            h.close()
    took = first["t"] - ended
    print(
        f"{fault} peer: rank 0 completed its first all-reduce of round 2 {took:.2f} s "
        "after the round ended"
    )
    assert procs[0].returncode == 0, err[-4000:]
    # The same process, in a world of one, and no partial sum of an aborted all-reduce was
    # ever used (without check_results the one read after the abort would be).
    assert f"result 1.0 bad 0 pid {procs[0].pid}" in out, out
    if fault == "frozen":  # only the abort could end the kernel: the peer's sockets are open
        assert "NCCL communicators aborted" in err, err[-4000:]
    # The abort's watchdog (ABORT_WATCHDOG, 10 s) bounds the leave; the rest is a new group.
    assert took < 15, err[-4000:]
