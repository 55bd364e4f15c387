"""`elasticd layout` as a user runs it: a real subprocess, stdout, stderr and exit codes."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from elasticd.layout import GROUP_KINDS


def elasticd(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "elasticd", *args], capture_output=True, text=True, timeout=60
    )


def test_layout_json_prints_one_object_with_every_group_kind():
    out = elasticd(
        "layout",
        "--world",
        "10",
        "--tp",
        "2",
        "--pp",
        "2",
        "--global-batch",
        "16",
        "--micro-batch",
        "2",
        "--json",
    )
    assert out.returncode == 0, out.stderr
    data = json.loads(out.stdout)
    assert (data["world"], data["active"], data["spares"], data["dp"]) == (10, 8, [8, 9], 2)
    assert data["grad_accum"] == 4 and data["etp"] == 2
    assert list(data["groups"]) == list(GROUP_KINDS)
    assert data["groups"]["pp"] == [[0, 4], [1, 5], [2, 6], [3, 7]]


def test_layout_prints_a_readable_table_by_default():
    out = elasticd("layout", "--world", "16", "--tp", "2", "--pp", "4")
    assert out.returncode == 0, out.stderr
    assert "world 16: 16 active, 0 spares" in out.stdout
    assert "pp                  4×4  [0,4,8,12] [1,5,9,13] [2,6,10,14] [3,7,11,15]" in out.stdout


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--world", "3", "--tp", "4"], "a world of 3 ranks is smaller than tp·pp·cp = 4"),
        (["--world", "x"], "argument --world: invalid int value: 'x'"),
        (["--tp", "2"], "the following arguments are required: --world"),
        (["--world", "8", "--tp", "0"], "parallel.tp: 0 must be a positive integer"),
        (["--world", "8", "--order", "tp-dp"], "parallel.order"),
        (["--world", "8", "--pp", "1", "--vpp", "2"], "parallel.vpp: 2 needs parallel.pp > 1"),
        (
            ["--world", "4", "--ep", "2", "--global-batch", "3", "--micro-batch", "1"],
            "no layout fits a world of 4 ranks",
        ),
        (["--world", "4", "--micro-batch", "2"], "give both global_batch and micro_batch"),
    ],
)
def test_bad_layout_input_exits_2_with_one_line_and_no_traceback(args, message):
    out = elasticd("layout", *args)
    assert out.returncode == 2
    assert out.stdout == ""
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1, out.stderr
    assert lines[0].startswith("elasticd: error: ")
    assert message in lines[0]


def test_an_unknown_subcommand_is_a_one_line_usage_error():
    out = elasticd("frobnicate")
    assert out.returncode == 2
    assert len(out.stderr.strip().splitlines()) == 1
    assert "invalid choice: 'frobnicate'" in out.stderr
