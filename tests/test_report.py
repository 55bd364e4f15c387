"""`elasticd report`: a run directory drawn into one HTML page and a PNG. (A real run's
directory is drawn by tests/test_agent_cluster.py; here, the files' rules and errors.)"""

from __future__ import annotations

import json

from elasticd.cli import main
from elasticd.report import load_run, recovery_bars

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def write_run(path, *, with_events=True):
    path.mkdir()
    rows = [{"step": s, "loss": 5.0 - s / 10, "tokens_per_s": 4000.0, "world": 3 if s < 5 else 2}
            for s in range(1, 9)]  # fmt: skip
    rows.insert(4, {"step": 5, "loss": 99.0, "tokens_per_s": 1.0, "world": 3})  # before the fault
    rows.insert(7, "torn line")
    (path / "metrics.jsonl").write_text(
        "\n".join(json.dumps(r) if isinstance(r, dict) else r for r in rows) + "\n"
    )
    if with_events:
        events = [
            {"t": 100.0, "kind": "world", "round": 1, "world": 3, "layout": "tp1 pp1 dp3"},
            {"t": 101.0, "kind": "checkpoint_save", "step": 4, "seconds": 0.25, "bytes": 1000},
            {"t": 110.0, "kind": "world", "round": 2, "world": 2, "layout": "tp1 pp1 dp2"},
            {"t": 112.0, "kind": "recovery", "round": 2, "reason": "peer_lost",
             "detected_at": 105.0, "seconds": 7.0, "first_step": 5, "mode": "process",
             "source": "checkpoint", "lost_steps": 2,
             "parts": {"stop": 0.5, "rendezvous": 1.0, "spawn": 0.5, "pg_init": 2.0,
                       "ckpt_load": 2.5, "first_step": 0.5}},
            {"t": 112.0, "kind": "checkpoint_load", "step": 4, "seconds": 2.5, "bytes": 1000},
        ]  # fmt: skip
        (path / "events.jsonl").write_text("".join(json.dumps(e) + "\n" for e in events))
        final = {"name": "demo", "state": "succeeded",
                 "faults": [{"fault": "kill-node=1@step=6", "step": 6, "t": 103.0}]}  # fmt: skip
        (path / "run.json").write_text(json.dumps(final))


def test_a_run_reads_the_last_record_of_each_step_and_times_recoveries_from_the_fault(tmp_path):
    write_run(tmp_path / "run")
    run = load_run(str(tmp_path / "run"))
    assert run.name == "demo" and run.state == "succeeded" and run.steps == list(range(1, 9))
    assert run.records[5]["loss"] == 4.5  # the re-trained step's last record wins
    ((label, parts),) = recovery_bars(run)
    assert parts[0] == ("detect", 2.0)  # the fault at t=103, known at t=105
    assert sum(sec for _, sec in parts) == 9.0 and "9.00 s" in label


def test_report_writes_a_page_with_the_picture_and_a_png(tmp_path, capsys):
    write_run(tmp_path / "run")
    html, png = tmp_path / "r.html", tmp_path / "r.png"
    assert main(["report", str(tmp_path / "run"), "-o", str(html), "--png", str(png)]) == 0
    assert png.read_bytes()[:8] == PNG_MAGIC
    page = html.read_text()
    assert "data:image/png;base64," in page and "kill-node=1@step=6" in page
    assert "ckpt_load 2.50s" in page and "peer_lost" in page
    assert f"report: {html}" in capsys.readouterr().out


def test_a_run_without_events_is_still_drawn(tmp_path):
    write_run(tmp_path / "run", with_events=False)
    assert main(["report", str(tmp_path / "run")]) == 0
    assert (tmp_path / "run" / "report.html").stat().st_size > 10_000


def test_a_scripts_own_records_without_throughput_or_loss_are_drawn(tmp_path, capsys):
    """A script's own records (its own file, as examples/ddp_inprocess.py's ``DDP_LOG``)
    may hold no world or tokens/s, and not always a loss: gaps in the lines (before, matplotlib raised on the None values, and
    ``elasticd run`` of examples/ddp_inprocess.py ended in a traceback, exit 1, after a
    job that succeeded; found by a newcomer's walk)."""
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    rows = [{"step": s, **({"loss": 1.0 / s} if s % 3 else {})} for s in range(1, 7)]
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    html = tmp_path / "r.html"
    assert main(["report", str(run_dir), "-o", str(html)]) == 0
    assert "data:image/png;base64," in html.read_text()


def test_a_directory_that_is_not_a_run_is_one_line_and_exit_2(tmp_path, capsys):
    assert main(["report", str(tmp_path / "nope")]) == 2
    assert (
        capsys.readouterr().err.strip()
        == f"elasticd: error: report: {tmp_path / 'nope'}: no such directory"
    )
    assert main(["report", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "no metrics.jsonl with steps" in err[0]
