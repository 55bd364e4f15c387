"""Proof that examples/ddp_train.py survives faults and trains the same model: real etcd,
real agents, real gloo workers, through the elasticd.testing pytest plugin.

    pytest examples/

Each test runs the script on a fresh local cluster with a fault and compares its losses
with one uninterrupted run of the same job (made once, shared by the four tests).
"""

import os

import pytest

SCRIPT = os.path.join(os.path.dirname(__file__), "ddp_train.py")
STEPS = 16


@pytest.fixture
def job(elasticd_cluster):
    # Checkpoints every 4 steps; 12 samples a step split over the ranks, so 1, 2 or 3
    # nodes train the same model.
    return elasticd_cluster.script_job(SCRIPT, steps=STEPS, checkpoint={"every": 4})


@pytest.mark.elasticd(timeout=300)
def test_a_dead_node_is_survived_and_training_resumes_from_the_checkpoint(elasticd_cluster, job):
    result = elasticd_cluster.run(job, nodes=3, restart="process", faults=["kill-node=2@step=6"])
    reference = elasticd_cluster.reference(job, nodes=3)
    result.assert_succeeded()
    result.assert_worlds([3, 2])
    result.assert_losses_match(reference)  # every step, the re-trained ones included
    result.assert_recovered_within(120)
    # Back to step 4 or later, not to step 0: at most 4 steps trained again, by metrics.jsonl,
    # and by the recovery's own count where it could tell.
    result.assert_lost_steps_at_most(4)
    (recovery,) = result.recoveries
    assert recovery.mode == "process"


@pytest.mark.elasticd(timeout=300)
def test_a_killed_worker_is_recovered_in_process_from_its_peers(elasticd_cluster, job):
    # The worker dies in the middle of step 7's backward pass; its peers keep their
    # processes and their memory, and hand the state to its replacement.
    result = elasticd_cluster.run(
        job, nodes=3, restart="inprocess", faults=["kill-worker=1@step=7:phase=backward"]
    )
    reference = elasticd_cluster.reference(job, nodes=3)
    result.assert_succeeded().assert_worlds([3]).assert_no_lost_steps()
    result.assert_losses_match(reference)
    (recovery,) = result.recoveries
    assert (recovery.mode, recovery.source) == ("inprocess", "peers")


@pytest.mark.elasticd(timeout=300)
@pytest.mark.parametrize(("restart", "source"), [("process", "checkpoint"), ("inprocess", "peers")])
def test_a_preempted_node_saves_and_the_job_goes_on_without_it(
    elasticd_cluster, job, restart, source
):
    # SIGTERM to node 2's agent as step 6 begins: every rank agrees and saves step 6. The
    # two others carry on: from that emergency checkpoint after a process restart, or
    # in-process in their own processes, from their memory.
    result = elasticd_cluster.run(
        job, nodes=3, restart=restart, faults=["term-node=2@step=6:phase=forward"]
    )
    reference = elasticd_cluster.reference(job, nodes=3)
    result.assert_succeeded().assert_worlds([3, 2]).assert_no_lost_steps()
    result.assert_losses_match(reference)
    (recovery,) = result.recoveries
    assert (recovery.reason, recovery.mode, recovery.source) == ("preempted", restart, source)
