"""output_dir and checkpoint.dir are validated like every other field: a directory that
elasticd writes into, and that `elasticd run --fresh` may delete, must be one of its own.
Each refusal is one line naming the field path."""

from __future__ import annotations

import pytest

from elasticd.cli import main
from elasticd.errors import JobSpecError
from elasticd.jobspec import parse_job

REFUSED = [
    ("the current directory", ".", "is the current directory or a parent of it"),
    ("the current directory with a slash", "./", "is the current directory or a parent of it"),
    ("the parent", "..", "is the current directory or a parent of it"),
    ("a parent reached through a subdir", "runs/../..", "is the current directory or a parent"),
    ("the root", "/", "is the filesystem root"),
    ("empty", "", "must not be empty"),
    ("blank", "  ", "must not be empty"),
    ("a tilde", "~/runs", "'~' is not expanded"),
]


@pytest.fixture
def cwd(tmp_path, monkeypatch):
    here = tmp_path / "home" / "me" / "work" / "project"
    here.mkdir(parents=True)
    monkeypatch.chdir(here)
    monkeypatch.setenv("HOME", str(tmp_path / "home" / "me"))
    return here


@pytest.mark.parametrize("field", ["output_dir", "checkpoint.dir"])
@pytest.mark.parametrize(("case", "value", "message"), REFUSED, ids=[c[0] for c in REFUSED])
def test_a_directory_that_is_not_its_own_is_refused_naming_the_field(
    cwd, field, case, value, message
):
    raw = {"name": "t", **({"output_dir": value} if field == "output_dir" else {"checkpoint": {"dir": value}})}  # fmt: skip
    with pytest.raises(JobSpecError) as err:
        parse_job(raw)
    assert str(err.value).startswith(f"job.yaml: {field}: ") and message in str(err.value)
    assert "\n" not in str(err.value)


def test_the_home_directory_is_refused(cwd, tmp_path):
    with pytest.raises(JobSpecError, match=r"job.yaml: output_dir: .* is the home directory"):
        parse_job({"name": "t", "output_dir": str(tmp_path / "home" / "me")})


def test_an_absolute_parent_of_the_current_directory_is_refused(cwd, tmp_path):
    with pytest.raises(JobSpecError, match="is the current directory or a parent of it"):
        parse_job({"name": "t", "output_dir": str(tmp_path / "home")})


@pytest.mark.parametrize("value", ["runs/x", "out", "../sibling", "/tmp/elasticd-runs/x"])
def test_a_directory_of_its_own_is_accepted(cwd, value):
    assert parse_job({"name": "t", "output_dir": value}).output_dir == value


def test_submit_refuses_a_dot_output_dir_with_one_line_and_exit_2(cwd, capsys):
    (cwd / "job.yaml").write_text("name: t\noutput_dir: .\n")
    code = main(["submit", "job.yaml", "--etcd", "127.0.0.1:1", "--etcd-timeout", "1"])
    err = capsys.readouterr().err
    assert code == 2
    assert err == "elasticd: error: job.yaml: output_dir: '.' is the current directory or a parent of it; name a directory of its own\n"  # fmt: skip
