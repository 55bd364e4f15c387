"""The series an agent exports at 0 when it takes a job (``AgentMetrics.init_job``)."""

from __future__ import annotations

import pytest
from prometheus_client import CollectorRegistry

from elasticd.agent.report import JobReporter
from elasticd.metrics import RECOVERY_SOURCES, RESTART_REASONS, AgentMetrics


class _Registry:
    """The job registry's one call a recovery makes (its etcd record)."""

    def add_event(self, name, event, fence=None) -> None:
        pass


def _value(reg, name: str, **labels: str) -> float | None:
    return reg.get_sample_value(name, {"elasticd_job": "j", **labels})


def test_the_recovery_histogram_starts_at_0_for_every_recovery_counter_series():
    # A histogram born with its first observation has no earlier sample, so rate() and
    # increase() never see that recovery and the dashboard's recovery-time panel stays
    # empty: every combination the recoveries counter pre-creates must be there at 0.
    reg = CollectorRegistry()
    m = AgentMetrics(reg)
    m.init_job("j", "inprocess")
    for reason in RESTART_REASONS:
        for source in RECOVERY_SOURCES:
            labels = {"reason": reason, "mode": "inprocess", "source": source}
            assert _value(reg, "elasticd_recoveries_total", **labels) == 0
            del labels["reason"]
            assert _value(reg, "elasticd_recovery_seconds_count", **labels) == 0
            assert _value(reg, "elasticd_recovery_seconds_sum", **labels) == 0
            assert _value(reg, "elasticd_recovery_seconds_bucket", le="+Inf", **labels) == 0
    # The first recovery moves the series that already existed from 0 to 1.
    reporter = JobReporter(name="j", registry=_Registry(), metrics=m)
    reporter.recovered(round_=2, rec={"detected_at": 100.0, "reason": "peer_lost"}, marks=[],
                       now=101.5, first_step=9, write=True, mode="inprocess", source="peers")  # fmt: skip
    done = {"mode": "inprocess", "source": "peers"}
    assert _value(reg, "elasticd_recovery_seconds_count", **done) == 1
    assert _value(reg, "elasticd_recovery_seconds_bucket", le="2.0", **done) == 1
    assert _value(reg, "elasticd_recovery_seconds_bucket", le="1.0", **done) == 0
    assert _value(reg, "elasticd_recoveries_total", reason="peer_lost", **done) == 1
    # A finished job leaves with every one of them.
    m.drop_job("j")
    assert _value(reg, "elasticd_recovery_seconds_count", **done) is None


def test_a_recovery_after_a_failed_attempt_counts_from_the_first_failure():
    """A second fault during a recovery ends that round before its first step; the
    recovery that completes is one outage from the first failure: one observation of its
    whole length, the failed attempt a part of its own, the attempts counted."""
    reg = CollectorRegistry()
    m = AgentMetrics(reg)
    m.init_job("j", "inprocess")
    events = []
    registry = _Registry()
    registry.add_event = lambda name, event, fence=None: events.append(event)
    reporter = JobReporter(name="j", registry=registry, metrics=m)
    rec = {"detected_at": 100.6, "outage_from": 100.0, "attempts": 2, "reason": "peer_lost"}
    marks = [("abort", 100.7), ("rendezvous", 101.0), ("pg_init", 101.1),
             ("state_transfer", 101.2), ("first_step", 101.5)]  # fmt: skip
    reporter.recovered(round_=3, rec=rec, marks=marks, now=101.5, first_step=6, write=True,
                       mode="inprocess", source="peers")  # fmt: skip
    (event,) = events
    assert event["seconds"] == 1.5 and event["detected_at"] == 100.0 and event["attempts"] == 2
    assert list(event["parts"]) == ["failed_attempts", "abort", "rendezvous", "pg_init",
                                    "state_transfer", "first_step"]  # fmt: skip
    assert event["parts"]["failed_attempts"] == 0.6
    assert sum(event["parts"].values()) == pytest.approx(1.5)
    done = {"mode": "inprocess", "source": "peers"}
    assert _value(reg, "elasticd_recovery_seconds_count", **done) == 1
    assert _value(reg, "elasticd_recovery_seconds_sum", **done) == pytest.approx(1.5)
    assert _value(reg, "elasticd_job_last_recovery_seconds") == pytest.approx(1.5)


def test_a_node_that_took_a_job_and_is_in_no_world_yet_exports_0_in_world():
    """A spare, or a node rejoining after its own trouble, waits for a world: its
    elasticd_job_node_in_world is 0, not absent (a sum by job then counts it as waiting)."""
    reg = CollectorRegistry()
    m = AgentMetrics(reg)
    m.init_job("j", "process")
    assert _value(reg, "elasticd_job_node_in_world") == 0


def test_a_scrape_leaves_out_the_job_gauges_of_a_node_whose_membership_lapsed():
    """A node rank 0 frozen past its lease's TTL (its peers re-formed without it) and
    thawed served its old world's size and step beside the new node rank 0's until its
    runner noticed: sums by job doubled (world size 5 of 2, an SRE review). A scrape now
    asks the membership first (the lease's liveness: tests/test_etcd_client.py), through
    the real HTTP endpoint."""
    import urllib.request

    reg = CollectorRegistry()
    m = AgentMetrics(reg)
    m.init_job("j", "inprocess")
    m.world_size.labels("j").set(3)
    m.step.labels("j").set(1284)
    m.in_world.labels("j").set(1)
    alive = [True]
    m.watch_membership("j", lambda: alive[0])
    port = m.serve(0, addr="127.0.0.1")

    def scrape() -> str:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
            return r.read().decode()

    before = scrape()
    assert 'elasticd_world_size{elasticd_job="j"} 3.0' in before
    assert 'elasticd_job_node_in_world{elasticd_job="j"} 1.0' in before
    alive[0] = False
    after = scrape()
    assert 'elasticd_world_size{elasticd_job="j"}' not in after
    assert 'elasticd_job_step{elasticd_job="j"}' not in after
    assert 'elasticd_job_node_in_world{elasticd_job="j"} 0.0' in after
    assert 'elasticd_restarts_total{elasticd_job="j",reason="peer_lost"} 0.0' in after
    # A check that raises counts as lapsed, and never breaks the scrape.
    m.watch_membership("j", lambda: 1 / 0)
    assert 'elasticd_world_size{elasticd_job="j"}' not in scrape()
    m.watch_membership("j", None)  # out of the world for good: its final values stand
    assert 'elasticd_world_size{elasticd_job="j"} 3.0' in scrape()
    filtered = (
        urllib.request.urlopen(
            f"http://127.0.0.1:{port}/metrics?name[]=elasticd_world_size", timeout=10
        )
        .read()
        .decode()
    )
    assert "elasticd_world_size" in filtered and "elasticd_job_step" not in filtered
