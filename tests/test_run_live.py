"""`elasticd run` on a terminal: one live progress line under the fault lines."""

from __future__ import annotations

import os
import select
import subprocess
import sys
import time

from elasticd.jobspec import parse_job


def test_elasticd_run_on_a_terminal_shows_one_live_line_under_the_fault_lines(tmp_path):
    job = parse_job({
        "name": "live", "output_dir": str(tmp_path / "live"), "nodes": {"min": 1, "max": 2},
        "model": {"layers": 2, "hidden": 32, "heads": 4, "ffn_hidden": 64, "vocab": 128,
                  "seq_len": 16},
        "train": {"steps": 12, "global_batch": 4, "micro_batch": 2},
        "checkpoint": {"every": 0}, "restart": {"mode": "inprocess"},
        "rendezvous": {"ttl": 2, "settle": 1.0},
    })  # fmt: skip
    path = tmp_path / "live.yaml"
    import yaml

    path.write_text(yaml.safe_dump(job.to_dict()))
    primary, secondary = os.openpty()
    proc = subprocess.Popen(
        [sys.executable, "-m", "elasticd", "run", str(path), "--nodes", "2",
         "--fault", "kill-worker=1@step=4", "--timeout", "200"],
        stdin=subprocess.DEVNULL, stdout=secondary, stderr=secondary, cwd=tmp_path,
        env={**os.environ, "OMP_NUM_THREADS": "1", "COLUMNS": "120"},
    )  # fmt: skip
    os.close(secondary)
    chunks = []
    deadline = time.monotonic() + 280
    while time.monotonic() < deadline:
        ready, _, _ = select.select([primary], [], [], 1.0)
        if ready:
            try:
                data = os.read(primary, 65536)
            except OSError:  # the child closed the terminal
                break
            if not data:
                break
            chunks.append(data)
        elif proc.poll() is not None:
            break
    os.close(primary)
    assert proc.wait(timeout=30) == 0
    text = b"".join(chunks).decode(errors="replace")
    assert "fault injected: kill-worker=1@step=4" in text
    assert "\r" in text  # the bar redraws in place
    assert "12/12" in text and "loss" in text and "world 2" in text
    # No plain per-change progress lines on a terminal.
    assert "  running: step" not in text
