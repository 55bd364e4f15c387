"""A table of malformed job files: `elasticd submit` rejects each with its one-line message
and exit code 2, before it talks to etcd (the endpoint given here does not exist, so any
attempt to write would have produced an etcd error instead)."""

from __future__ import annotations

import textwrap

import pytest

from elasticd.cli import main

BAD_SPECS = [
    ("empty file", "", "job.yaml: the file is empty"),
    ("not yaml", "name: [tiny\n", "job.yaml: not valid YAML at line 2"),
    ("a list at the top", "- name: tiny\n", "job.yaml: top level: expected a mapping"),
    ("no name", "nodes: {min: 1}\n", "job.yaml: name: required"),
    ("bad name", "name: Tiny_Job\n", "job.yaml: name: 'Tiny_Job' must match [a-z0-9][a-z0-9-]*"),
    ("unknown top key", "name: t\nmodle: {}\n", "job.yaml: modle: unknown key; did you mean 'model'?"),
    ("unknown nested key", "name: t\ntrain: {stepz: 3}\n",
     "job.yaml: train.stepz: unknown key; did you mean 'steps'?"),
    ("wrong type", "name: t\ntrain: {steps: many}\n", "job.yaml: train.steps: 'many' is not an integer"),
    ("bool for int", "name: t\nnproc_per_node: true\n", "job.yaml: nproc_per_node: True is not an integer"),
    ("section not a mapping", "name: t\nmodel: 4\n", "job.yaml: model: expected a mapping, got 4"),
    ("tp does not divide heads", "name: t\nparallel: {tp: 3}\n",
     "job.yaml: parallel.tp: 3 does not divide model.heads (4)"),
    ("heads do not divide hidden", "name: t\nmodel: {hidden: 66, heads: 4}\n",
     "job.yaml: model.heads: 4 does not divide model.hidden (66)"),
    ("pp·vpp does not divide layers", "name: t\nmodel: {layers: 4}\nparallel: {pp: 3}\n",
     "job.yaml: parallel.pp: pp·vpp = 3 does not divide model.layers (4)"),
    ("max below min", "name: t\nnodes: {min: 3, max: 2}\n", "job.yaml: nodes.max: 2 is less than nodes.min (3)"),
    ("start above max", "name: t\nnodes: {min: 1, max: 2, start: 3}\n",
     "job.yaml: nodes.start: 3 is not between nodes.min (1) and nodes.max (2)"),
    ("start below min", "name: t\nnodes: {min: 2, max: 4, start: 1}\n",
     "job.yaml: nodes.start: 1 is not between nodes.min (2) and nodes.max (4)"),
    ("negative start wait", "name: t\nrendezvous: {start_wait: -1}\n",
     "job.yaml: rendezvous.start_wait: -1.0 must be >= 0"),
    ("zero steps", "name: t\ntrain: {steps: 0}\n", "job.yaml: train.steps: 0 must be > 0"),
    ("negative restarts", "name: t\nrestart: {max_restarts: -1}\n",
     "job.yaml: restart.max_restarts: -1 must be >= 0"),
    ("negative startup timeout", "name: t\nrestart: {startup_timeout: -5}\n",
     "job.yaml: restart.startup_timeout: -5.0 must be >= 0"),
    ("bad scale-up policy", "name: t\nrestart: {scale_up: later}\n",
     "job.yaml: restart.scale_up: 'later' is not one of 'immediate', 'checkpoint'"),
    ("fork not a boolean", "name: t\nrestart: {fork: sometimes}\n",
     "job.yaml: restart.fork: 'sometimes' is not true or false or null"),
    ("batch not a multiple of micro", "name: t\ntrain: {global_batch: 10, micro_batch: 4}\n",
     "job.yaml: train.global_batch: 10 is not a multiple of train.micro_batch (4)"),
    ("file source without path", "name: t\ndata: {source: file}\n",
     "job.yaml: data.path: required when data.source is 'file'"),
    ("experts without moe", "name: t\nparallel: {ep: 2}\n", "job.yaml: parallel.ep: 2 needs model.experts > 0"),
    ("dropout out of range", "name: t\nmodel: {dropout: 1.5}\n", "job.yaml: model.dropout: 1.5 must be in [0, 1)"),
    ("metrics is the agent's", "name: t\nmetrics: {port: 9400}\n", "job.yaml: metrics: no longer a job setting: the agent serves every job's Prometheus metrics on its own port (elasticd agent --metrics-port); delete this key"),
    ("empty command", "name: t\ncommand: []\n", "job.yaml: command: [] is not a list of strings or null"),
    ("unsupported version", "version: 2\nname: t\n", "job.yaml: version: 2 is not supported"),
    ("nan learning rate", "name: t\ntrain: {lr: .nan}\n", "job.yaml: train.lr: nan must be a finite number"),
    ("infinite grad clip", "name: t\ntrain: {grad_clip: .inf}\n",
     "job.yaml: train.grad_clip: inf must be a finite number"),
    ("huge integer for a float", "name: t\ntrain: {lr: " + "9" * 400 + "}\n",
     "job.yaml: train.lr: " + "9" * 400 + " is too large"),
    ("ttl under etcd's lease second", "name: t\nrendezvous: {ttl: 0.5}\n",
     "job.yaml: rendezvous.ttl: 0.5 must be at least 1 (leases are granted in whole seconds)"),
    ("float16 in the built-in trainer", "name: t\ntrain: {dtype: float16}\n",
     "job.yaml: train.dtype: float16 needs loss scaling, which the built-in trainer does not do; use bfloat16 or float32 (or a command of your own)"),
    ("NUL in a directory", 'name: t\noutput_dir: "a\\0b"\n', "job.yaml: output_dir: 'a\\x00b' holds a NUL byte"),
    ("nested too deeply", "name: t\nx: " + "[" * 5000 + "]" * 5000 + "\n", "job.yaml: nested too deeply"),
]  # fmt: skip


@pytest.mark.parametrize(("case", "text", "message"), BAD_SPECS, ids=[c[0] for c in BAD_SPECS])
def test_submit_rejects_a_malformed_job_with_one_line_naming_the_field(
    tmp_path, capsys, case, text, message
):
    path = tmp_path / "job.yaml"
    path.write_text(textwrap.dedent(text))
    code = main(["submit", str(path), "--etcd", "127.0.0.1:1", "--etcd-timeout", "1"])
    err = capsys.readouterr().err
    assert code == 2
    assert err.count("\n") == 1, err
    assert err.startswith(f"elasticd: error: {message}"), err
    assert "Traceback" not in err and "etcd" not in err.removeprefix("elasticd: error: ")


def test_the_table_covers_at_least_fifteen_distinct_mistakes():
    assert len({message for _, _, message in BAD_SPECS}) >= 15


def test_a_missing_job_file_is_one_line_too(tmp_path, capsys):
    code = main(["submit", str(tmp_path / "nope.yaml"), "--etcd", "127.0.0.1:1"])
    err = capsys.readouterr().err
    assert code == 2 and "nope.yaml: cannot read" in err and err.count("\n") == 1


def test_a_bad_set_override_is_rejected_before_etcd(tmp_path, capsys):
    path = tmp_path / "job.yaml"
    path.write_text("name: t\n")
    code = main(["submit", str(path), "--set", "train.steps=-3", "--etcd", "127.0.0.1:1"])
    err = capsys.readouterr().err
    assert code == 2 and "train.steps: -3 must be > 0" in err


def test_a_job_file_that_is_not_utf_8_or_a_checkpoint_dir_that_is_a_file_is_one_line(
    tmp_path, capsys
):
    path = tmp_path / "job.yaml"
    path.write_bytes(b"name: t\n# caf\xe9\n")
    assert main(["submit", str(path), "--etcd", "127.0.0.1:1"]) == 2
    assert capsys.readouterr().err.strip().endswith("job.yaml: not UTF-8 text (byte 13)")
    (tmp_path / "afile").write_text("")
    path.write_text(f"name: t\ncheckpoint: {{dir: {tmp_path / 'afile'}}}\n")
    assert main(["submit", str(path), "--etcd", "127.0.0.1:1"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.endswith("exists and is not a directory"), err
