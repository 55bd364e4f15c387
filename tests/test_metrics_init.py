"""The series an agent exports at 0 when it takes a job (``AgentMetrics.init_job``)."""

from __future__ import annotations

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
            assert _value(reg, "elasticd_recovery_seconds_count", **labels) == 0
            assert _value(reg, "elasticd_recovery_seconds_sum", **labels) == 0
            assert _value(reg, "elasticd_recovery_seconds_bucket", le="+Inf", **labels) == 0
    # The first recovery moves the series that already existed from 0 to 1.
    reporter = JobReporter(name="j", registry=_Registry(), metrics=m)
    reporter.recovered(round_=2, rec={"detected_at": 100.0, "reason": "peer_lost"}, marks=[],
                       now=101.5, first_step=9, write=True, mode="inprocess", source="peers")  # fmt: skip
    done = {"reason": "peer_lost", "mode": "inprocess", "source": "peers"}
    assert _value(reg, "elasticd_recovery_seconds_count", **done) == 1
    assert _value(reg, "elasticd_recovery_seconds_bucket", le="2.0", **done) == 1
    assert _value(reg, "elasticd_recovery_seconds_bucket", le="1.0", **done) == 0
    assert _value(reg, "elasticd_recoveries_total", **done) == 1
    # A finished job leaves with every one of them.
    m.drop_job("j")
    assert _value(reg, "elasticd_recovery_seconds_count", **done) is None


def test_a_node_that_took_a_job_and_is_in_no_world_yet_exports_0_in_world():
    """A spare, or a node rejoining after its own trouble, waits for a world: its
    elasticd_job_node_in_world is 0, not absent (a sum by job then counts it as waiting)."""
    reg = CollectorRegistry()
    m = AgentMetrics(reg)
    m.init_job("j", "process")
    assert _value(reg, "elasticd_job_node_in_world") == 0
