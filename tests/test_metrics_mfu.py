"""MFU from rank 0's heartbeat into ``elasticd_job_mfu_ratio`` (node rank 0 only)."""

from __future__ import annotations

import json

from prometheus_client import CollectorRegistry, generate_latest

from elasticd.agent.report import JobReporter
from elasticd.metrics import AgentMetrics
from elasticd.worker import WorkerChannel


def _metrics_text(reg) -> str:
    return generate_latest(reg).decode()


def test_rank_zeros_mfu_reaches_the_job_gauge_and_a_cpu_run_has_none(tmp_path):
    path = tmp_path / "hb.json"
    channel = WorkerChannel(path=str(path), rank=0)
    channel.progress(step=3, loss=2.5, tokens_per_s=1000.0, mfu=0.41)
    lead = json.loads(path.read_text())
    assert lead["mfu"] == 0.41
    reg = CollectorRegistry()
    reporter = JobReporter(name="j", registry=None, metrics=AgentMetrics(reg))
    reporter.progress(lead, checkpoint=None, write=False)
    assert 'elasticd_job_mfu_ratio{elasticd_job="j"} 0.41' in _metrics_text(reg)
    channel.progress(step=4, loss=2.4)  # a trainer that knows no peak reports none
    reg2 = CollectorRegistry()
    JobReporter(name="k", registry=None, metrics=AgentMetrics(reg2)).progress(
        json.loads(path.read_text()), checkpoint=None, write=False
    )
    assert 'elasticd_job_mfu_ratio{elasticd_job="k"}' not in _metrics_text(reg2)
