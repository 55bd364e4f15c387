"""The job registry on a real etcd, and the client commands on top of it."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
import uuid

import pytest

from elasticd.cli import main
from elasticd.errors import UsageError
from elasticd.jobs import TRANSITIONS, JobRegistry, JobState, can_move
from elasticd.jobspec import parse_job


def unique(label: str = "job") -> str:
    return f"{label}-{uuid.uuid4().hex[:8]}"


def test_every_state_has_a_row_and_terminal_states_lead_nowhere():
    assert set(TRANSITIONS) == set(JobState)
    for state in JobState:
        assert can_move(state, state)
        if state.terminal:
            assert not TRANSITIONS[state]
    assert not can_move(JobState.SUCCEEDED, JobState.CANCELLED)
    assert can_move(JobState.RUNNING, JobState.RECOVERING)


def test_a_submitted_job_is_stored_as_json_and_read_back_pending(etcd_client):
    reg = JobRegistry(etcd_client)
    job = parse_job({"name": unique(), "train": {"steps": 7}})
    record = reg.submit(job)
    assert record.state == JobState.PENDING and record.spec["train"]["steps"] == 7
    raw = etcd_client.get(f"/elasticd/jobs/{job.name}/spec").value
    assert json.loads(raw)["name"] == job.name
    assert record.run_id.startswith(job.name + "-")
    assert record.job() == job
    assert job.name in [r.name for r in reg.list()]


def test_a_second_submit_is_refused_and_replace_needs_a_finished_job(etcd_client):
    reg = JobRegistry(etcd_client)
    job = parse_job({"name": unique()})
    first = reg.submit(job)
    with pytest.raises(UsageError, match="already exists"):
        reg.submit(job)
    with pytest.raises(UsageError, match="cancel it before replacing"):
        reg.submit(job, replace=True)
    reg.cancel(job.name)
    reg.claim_failure(job.name, 1, {"reason": "worker_failed"})
    second = reg.submit(job, replace=True)
    assert second.state == JobState.PENDING and second.run_id != first.run_id
    assert etcd_client.get(f"/elasticd/jobs/{job.name}/failures/1") is None


def test_illegal_transitions_are_refused_and_write_nothing(etcd_client):
    reg = JobRegistry(etcd_client)
    job = parse_job({"name": unique()})
    reg.submit(job)
    assert reg.set_state(job.name, JobState.RUNNING, "round 1")
    assert reg.set_state(job.name, JobState.SUCCEEDED, "done")
    assert not reg.set_state(job.name, JobState.CANCELLED, "too late")
    assert reg.get(job.name).state == JobState.SUCCEEDED
    with pytest.raises(UsageError, match="already succeeded"):
        reg.cancel(job.name)


def test_concurrent_status_updates_lose_nothing(etcd_client):
    reg = JobRegistry(etcd_client)
    job = parse_job({"name": unique()})
    reg.submit(job)

    def bump() -> None:
        for _ in range(10):
            reg.update_status(job.name, lambda st: st.update(n=st.get("n", 0) + 1))

    threads = [threading.Thread(target=bump) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert reg.get(job.name).status["n"] == 40


def test_a_round_failure_is_claimed_once_and_the_rest_adopt_it(etcd_client):
    reg = JobRegistry(etcd_client)
    job = parse_job({"name": unique()})
    reg.submit(job)
    _claim, ours = reg.claim_failure(job.name, 3, {"reason": "worker_failed", "node": "a"})
    again, ours_again = reg.claim_failure(job.name, 3, {"reason": "peer_lost", "node": "b"})
    assert ours and not ours_again
    assert again["reason"] == "worker_failed" and again["node"] == "a"
    # Every node whose own worker failed is named, whoever claimed; a node called like a
    # record's part ("state") does not pass for it.
    for node in ("b", "state"):
        reg.note_own_failure(job.name, 3, node, {"reason": "worker_failed", "node": node})
    assert (
        reg.own_failures(job.name, 3) == {"b", "state"} and reg.own_failures(job.name, 4) == set()
    )
    assert reg.get(job.name).state.value == "pending"
    assert reg.prune_failures(job.name, 4) == 3  # the claim and both notes
    assert reg.own_failures(job.name, 3) == set()


def run_cli(*args, etcd=None, cwd=None, timeout=30):
    cmd = [sys.executable, "-m", "elasticd", *args]
    if etcd:
        cmd += ["--etcd", etcd]
    return subprocess.run(cmd, capture_output=True, text=True, cwd=cwd, timeout=timeout)


def test_submit_status_list_cancel_through_the_cli(etcd_server, tmp_path):
    name = unique("cli")
    (tmp_path / "job.yaml").write_text(f"name: {name}\noutput_dir: out\ntrain: {{steps: 5}}\n")
    ep = etcd_server.endpoint
    r = run_cli("submit", "job.yaml", etcd=ep, cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    r = run_cli("status", name, "--json", etcd=ep)
    doc = json.loads(r.stdout)
    assert doc["state"] == "pending" and doc["steps"] == 5
    # Relative paths were resolved where submit ran, and stored absolute.
    assert doc["output_dir"] == str((tmp_path / "out").resolve())
    assert name in run_cli("list", etcd=ep).stdout
    r = run_cli("cancel", name, etcd=ep)
    assert r.returncode == 0 and "cancelled" in r.stdout
    assert json.loads(run_cli("status", name, "--json", etcd=ep).stdout)["state"] == "cancelled"
    r = run_cli("status", unique("nope"), etcd=ep)
    assert r.returncode == 2 and "no such job" in r.stderr and r.stderr.count("\n") == 1


def test_a_malformed_job_writes_nothing_to_etcd(etcd_client, etcd_server, tmp_path, capsys):
    name = unique("bad")
    (tmp_path / "job.yaml").write_text(f"name: {name}\nparallel: {{tp: 3}}\n")
    code = main(["submit", str(tmp_path / "job.yaml"), "--etcd", etcd_server.endpoint])
    assert code == 2 and "parallel.tp: 3 does not divide" in capsys.readouterr().err
    assert etcd_client.get_prefix(f"/elasticd/jobs/{name}/")[0] == []


def test_attach_takes_an_active_job_of_the_same_settings_as_submitted(
    etcd_server, tmp_path, capsys
):
    """A requeued batch script submits its job again while it is still running (an etcd
    outside the allocation: the agents left, the job waits for nodes): it attaches."""
    name = unique("attach")
    job = tmp_path / "job.yaml"
    job.write_text(f"name: {name}\ntrain: {{steps: 5}}\n")
    ep = ["--etcd", etcd_server.endpoint]
    assert main(["submit", str(job), *ep]) == 0
    capsys.readouterr()
    assert main(["submit", str(job), *ep]) == 2  # as before: refused, naming --attach
    assert "--attach follows it" in capsys.readouterr().err
    assert main(["submit", str(job), "--attach", *ep]) == 0
    assert f"job {name} is pending already; attached to it" in capsys.readouterr().out
    assert main(["submit", str(job), "--attach", "--set", "train.steps=7", *ep]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "with other settings" in err
    assert main(["cancel", name, *ep]) == 0
    capsys.readouterr()
    # A finished one is not attached to: --attach then submits (here refused as usual).
    assert main(["submit", str(job), "--attach", *ep]) == 2
    assert "use --replace to overwrite it" in capsys.readouterr().err


@pytest.mark.parametrize("command", [["list"], ["status"], ["cancel", "x"], ["logs", "x"]])
def test_an_unreachable_etcd_is_one_line_within_the_timeout(command, capsys):
    started = time.monotonic()
    code = main([*command, "--etcd", "127.0.0.1:1", "--etcd-timeout", "1.5"])
    took = time.monotonic() - started
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1
    assert "etcd at 127.0.0.1:1 did not answer" in err
    assert took < 10  # bounded by the timeout, not a hang (generous for a loaded machine)


def test_a_stopped_etcd_is_one_line_too(tmp_path, capsys):
    from elasticd.etcd import EmbeddedEtcd

    server = EmbeddedEtcd(data_dir=str(tmp_path / "etcd")).start()
    endpoint = server.endpoint
    server.stop()
    code = main(["list", "--etcd", endpoint, "--etcd-timeout", "1"])
    err = capsys.readouterr().err
    assert code == 2 and f"etcd at {endpoint} did not answer" in err


def test_a_write_fenced_by_an_older_round_is_refused_once_a_newer_world_exists(etcd_client):
    from elasticd.jobs import Fence, FencedError

    reg = JobRegistry(etcd_client)
    name = unique("fenced")
    reg.submit(parse_job({"name": name}))
    world_key = f"/test/rdzv-{name}/state/world"
    old = Fence(world_key, etcd_client.put(world_key, '{"round":1}'), 1)
    reg.update_status(name, lambda st: st.update(step=5), fence=old)  # current: accepted
    assert reg.set_state(name, JobState.RUNNING, "round 1", fence=old)
    new = Fence(world_key, etcd_client.put(world_key, '{"round":2}'), 2)
    with pytest.raises(FencedError, match="round 1 is no longer current"):
        reg.update_status(name, lambda st: st.update(step=3), fence=old)
    with pytest.raises(FencedError):
        reg.set_state(name, JobState.FAILED, "stale", fence=old)
    with pytest.raises(FencedError):
        reg.claim_failure(name, 1, {"reason": "worker_failed"}, fence=old)
    reg.update_status(name, lambda st: st.update(step=6), fence=new)
    record = reg.get(name)
    assert record.status["step"] == 6 and record.state == JobState.RUNNING


def test_history_is_bounded_in_bytes_as_well_as_in_entries():
    from elasticd.jobs import HISTORY_BYTES, bound_history

    big = [{"kind": "world", "i": i, "pad": "x" * 1000} for i in range(60)]
    kept = bound_history(big)
    assert len(json.dumps(kept)) <= HISTORY_BYTES and kept[-1]["i"] == 59
    assert [e["i"] for e in kept] == list(range(60 - len(kept), 60))
    assert len(bound_history([{"i": i} for i in range(500)])) == 100


def test_queued_jobs_move_back_to_pending_and_only_then_run(etcd_client):
    reg = JobRegistry(etcd_client)
    name = unique("queue")
    reg.submit(parse_job({"name": name}))
    assert reg.set_state(name, JobState.QUEUED, "queued: needs 2 nodes")
    assert reg.set_state(name, JobState.QUEUED, "queued: needs 3 nodes")  # the reason follows
    assert reg.get(name).reason == "queued: needs 3 nodes"
    assert reg.set_state(name, JobState.RUNNING, "round 1")
    since = reg.get(name).since
    # A world re-formed with no recovering state between: the reason names the round
    # (`status` said "running (round 1)" over the status's round 2), since stays.
    assert reg.set_state(name, JobState.RUNNING, "round 2")
    assert (reg.get(name).reason, reg.get(name).since) == ("round 2", since)


def test_failure_records_of_decided_rounds_are_pruned_and_a_stale_round_cannot_prune(
    etcd_client,
):
    from elasticd.jobs import PRUNE_BATCH, Fence, FencedError

    reg = JobRegistry(etcd_client)
    name = unique("prune")
    reg.submit(parse_job({"name": name}))
    rounds = PRUNE_BATCH + 42  # more keys than one transaction deletes; rounds - 1 = 3k
    for r in range(1, rounds + 1):
        reg.claim_failure(name, r, {"reason": "worker_failed"})
        if r % 3 == 0:
            reg.note_cause(name, r, {"reason": "worker_hung"})
    prefix = f"/elasticd/jobs/{name}/failures/"
    world_key = f"/test/rdzv-{name}/state/world"
    fence = Fence(world_key, etcd_client.put(world_key, '{"round":1}'), rounds)
    gone = reg.prune_failures(name, rounds - 1, fence=fence)
    left = sorted(kv.key[len(prefix) :] for kv in etcd_client.get_prefix(prefix)[0])
    assert left == [str(rounds - 1), f"{rounds - 1}/cause", str(rounds)]
    assert gone == rounds - 2 + len([r for r in range(1, rounds - 1) if r % 3 == 0])
    assert reg.cause_of(name, rounds - 1)["reason"] == "worker_hung"  # kept: still read
    assert reg.get(name).state == JobState.PENDING  # the job's own keys stay
    etcd_client.put(world_key, '{"round":2}')  # a newer world: the old round is fenced
    reg.claim_failure(name, rounds + 1, {"reason": "worker_failed"})
    with pytest.raises(FencedError):
        reg.prune_failures(name, rounds + 5, fence=fence)
    assert len(etcd_client.get_prefix(prefix)[0]) == 4
    assert reg.prune_failures(name, 0) == 0  # nothing below round 0


def test_logs_of_an_in_process_job_are_its_warm_workers_per_node(
    etcd_server, etcd_client, tmp_path
):
    """An in-process job's workers log per node and local rank (`warm/`), not in
    `round-*/rank-*.log`: `elasticd logs` said "no logs" for the demo's own job."""
    from elasticd.jobspec import run_logs_dir

    name = unique("warm")
    (tmp_path / "job.yaml").write_text(
        f"name: {name}\noutput_dir: out\nrestart: {{mode: inprocess}}\n"
    )
    ep = etcd_server.endpoint
    assert run_cli("submit", "job.yaml", etcd=ep, cwd=tmp_path).returncode == 0
    run_id = JobRegistry(etcd_client).get(name).run_id
    assert run_id
    warm = tmp_path / run_logs_dir("out", run_id) / "warm"
    for node, text in (("node-0", "step 1 loss 5.0\n"), ("node-1", "step 1 loss 5.0 (rank 1)\n")):
        (warm / node).mkdir(parents=True)
        (warm / node / "local-0.log").write_text(text)
    r = run_cli("logs", name, etcd=ep)
    assert r.returncode == 0, r.stderr
    assert r.stdout.splitlines() == [
        f"==> {(warm / 'node-0' / 'local-0.log').resolve()} <==", "step 1 loss 5.0",
        f"==> {(warm / 'node-1' / 'local-0.log').resolve()} <==", "step 1 loss 5.0 (rank 1)",
    ]  # fmt: skip
    r = run_cli("logs", name, "--rank", "0", etcd=ep)
    assert r.returncode == 2 and r.stderr.count("\n") == 1
    assert "restarts in-process: its workers log per node and local rank" in r.stderr
    # A round that started a replacement process: its rank log, then the kept workers'.
    rank_log = tmp_path / run_logs_dir("out", run_id) / "round-2" / "rank-1.log"
    rank_log.parent.mkdir()
    rank_log.write_text("replacement\n")
    r = run_cli("logs", name, etcd=ep)
    assert r.stdout.splitlines()[:2] == [f"==> {rank_log.resolve()} <==", "replacement"]
    assert len(r.stdout.splitlines()) == 6, r.stdout
    r = run_cli("logs", name, "--rank", "1", etcd=ep)
    assert r.returncode == 0 and r.stdout.splitlines()[1:] == ["replacement"], r.stdout
    run_cli("cancel", name, etcd=ep)
