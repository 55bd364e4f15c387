"""The CLI as a newcomer meets it: a version, one-line errors that name the program once,
and a quiet end when the reader of its output goes away (`elasticd ... | head`)."""

from __future__ import annotations

import io
import subprocess
import sys

import pytest
import torch

from elasticd.cli.jobs import Progress
from elasticd.jobs import JobRecord, JobState

ELASTICD = [sys.executable, "-m", "elasticd"]


def elasticd(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([*ELASTICD, *args], capture_output=True, text=True, timeout=60)


def read_one_line_and_close(*args: str) -> tuple[int, str, str]:
    """Run elasticd, read its first line, close the pipe (as `| head -1` does), and
    return its exit code, that line and everything it wrote to stderr."""
    proc = subprocess.Popen([*ELASTICD, *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    assert proc.stdout is not None and proc.stderr is not None
    first = proc.stdout.readline().decode()
    proc.stdout.close()
    err = proc.stderr.read().decode()
    return proc.wait(timeout=60), first, err


def test_version_prints_the_package_version():
    r = elasticd("--version")
    assert (
        r.returncode == 0 and r.stdout.startswith("elasticd ") and r.stdout.split()[1][0].isdigit()
    )


@pytest.mark.parametrize(
    ("args", "line"),
    [
        (["layout"], "elasticd: error: layout: the following arguments are required: --world"),
        (["layout", "--world", "4", "--bogus"], "elasticd: error: unrecognized arguments: --bogus"),
        (["ckpt", "inspect"], "elasticd: error: ckpt inspect: the following arguments are required: DIR"),
    ],
)  # fmt: skip
def test_errors_are_one_line_naming_the_program_once(args, line):
    r = elasticd(*args)
    assert r.returncode == 2 and r.stderr.strip() == line, r.stderr
    assert r.stderr.count("elasticd") == 1


def test_an_unknown_command_is_one_line_with_the_choices():
    r = elasticd("frobnicate")
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 2 and len(lines) == 1 and lines[0].count("elasticd") == 1
    assert lines[0].startswith("elasticd: error: argument COMMAND: invalid choice: 'frobnicate'")


@pytest.mark.parametrize(
    "args",
    [
        ["layout", "--world", "4096", "--tp", "8", "--pp", "4"],
        ["layout", "--world", "4096", "--tp", "8", "--pp", "4", "--json"],
        ["schedule", "--pp", "8", "--vpp", "2", "--microbatches", "256"],
    ],
)  # fmt: skip
def test_a_closed_pipe_ends_the_command_quietly(args):
    code, first, err = read_one_line_and_close(*args)  # each writes far more than a pipe holds
    assert first and code == 0 and err == ""


def test_ckpt_inspect_into_a_closed_pipe_ends_quietly(tmp_path):
    from checkpoint import SaveOptions, Saver, ShardInfo

    saver = Saver(str(tmp_path), group=None, options=SaveOptions(async_=False))
    model = {f"layer.{i}.w": (torch.zeros(2), ShardInfo.whole(f"layer.{i}.w", (2,)))
             for i in range(3000)}  # fmt: skip
    saver.save(step=1, consumed_samples=1, model=model, optimizer={}, layout={"world": 1})
    saver.close()
    code, first, err = read_one_line_and_close("ckpt", "inspect", str(tmp_path))
    assert first and code == 0 and err == ""


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def job_at(step: int, state: str = "running") -> JobRecord:
    status = {"step": step, "loss": 1.5, "tokens_per_s": 12345.0, "world": 2, "restarts": 0}
    return JobRecord(name="j", spec={"train": {"steps": 10}}, state=JobState(state), since=0.0,
                     status=status)  # fmt: skip


def test_follow_on_a_terminal_draws_one_live_line_with_an_eta():
    out, now = Terminal(), [0.0]
    progress = Progress(out, clock=lambda: now[0])
    for i, step in enumerate([0, 2, 4]):
        now[0] = 10.0 * i
        progress.show(job_at(step))
    progress.close()
    text = out.getvalue()
    assert text.count("\n") == 1 and "\r" in text  # redrawn in place, one line at the end
    last = text.rstrip("\n").split("\r")[-1]
    # 4 steps in 20 s: 6 left take 30 s.
    assert last.startswith("j ") and "4/10" in last and "eta 0:30" in last
    assert "loss 1.5000 tokens/s 12,345 world 2" in last


def test_follow_elsewhere_prints_a_plain_line_per_change():
    out, now = io.StringIO(), [0.0]
    progress = Progress(out, clock=lambda: now[0])
    progress.show(job_at(1))
    now[0] = 5.0
    progress.show(job_at(2))
    progress.show(job_at(2))  # no change, no line
    now[0] = 9.0
    progress.show(job_at(2))  # the ETA alone changed: no line either (a log's line a poll)
    progress.show(job_at(10, "succeeded"))
    lines = out.getvalue().splitlines()
    assert len(lines) == 3 and "\r" not in out.getvalue()
    assert lines[1] == (
        "j [####....................] step 2/10 loss 1.5000 tokens/s 12,345 world 2 restarts 0 "
        "running eta 0:40"
    )
    assert lines[2].endswith("succeeded")  # no ETA once over


@pytest.mark.parametrize("value", ["nan", "inf", "-1"])
def test_an_etcd_timeout_that_is_not_a_finite_positive_number_is_refused(value):
    """NaN passed `seconds <= 0` and every wait on it spun forever (a newcomer's report)."""
    r = elasticd("list", "--etcd", "127.0.0.1:1", "--etcd-timeout", value)
    assert r.returncode == 2, r.stderr
    line = r.stderr.strip()
    assert line.startswith("elasticd: error: etcd timeout: ") and "\n" not in line, line
    assert line.endswith(" must be a positive, finite number"), line


def test_an_agent_state_dir_that_cannot_be_made_is_one_line(tmp_path):
    (tmp_path / "afile").write_text("")
    r = elasticd("agent", "--etcd", "127.0.0.1:1", "--metrics-port", "0",
                 "--state-dir", str(tmp_path / "afile"))  # fmt: skip
    assert r.returncode == 2, r.stderr
    assert r.stderr.strip() == (
        f"elasticd: error: --state-dir: cannot create {tmp_path / 'afile'}: File exists"
    )


def test_report_skips_lines_that_are_not_utf_8(tmp_path):
    from elasticd.report import _jsonl

    path = tmp_path / "metrics.jsonl"
    path.write_bytes(b'{"step": 1}\n{"step": \xff2}\n{"step": 3}\n')
    assert _jsonl(str(path)) == [{"step": 1}, {"step": 3}]


def test_a_tls_file_that_is_not_pem_is_named_in_one_line(tmp_path):
    der = tmp_path / "ca.der"
    der.write_bytes(b"\x30\x82\x01\x0a" + bytes(64))
    r = elasticd("list", "--etcd", "127.0.0.1:1", "--etcd-cacert", str(der))
    assert r.returncode == 2, r.stderr
    assert r.stderr.strip() == (
        f"elasticd: error: etcd ca_cert: {der} is not a PEM file (no -----BEGIN line)"
    )
