"""job.yaml parsing: defaults, overrides, path resolution and one-line errors."""

from __future__ import annotations

import json
import textwrap

import pytest

from elasticd.errors import JobSpecError
from elasticd.jobspec import JobSpec, load_job, parse_job, set_override


def write(tmp_path, text: str):
    path = tmp_path / "job.yaml"
    path.write_text(textwrap.dedent(text))
    return path


def test_a_minimal_job_gets_the_documented_defaults(tmp_path):
    job = load_job(write(tmp_path, "name: tiny\n"))
    assert job.out_dir == "runs/tiny"
    assert job.ckpt_dir == "runs/tiny/ckpt"
    assert (job.model.layers, job.model.hidden, job.model.vocab) == (4, 64, 256)
    assert (job.train.steps, job.train.global_batch, job.train.micro_batch) == (20, 16, 2)
    assert job.parallel.order == "tp-cp-ep-dp-pp" and job.parallel.expert_tp == 1
    assert job.checkpoint.async_ is True and job.rendezvous.ttl == 3.0


def test_the_design_card_example_parses_and_round_trips_through_json(tmp_path):
    # The design card's `metrics: {port: ...}` is no longer a job setting: each agent serves
    # every job's metrics on its own --metrics-port (docs/metrics.md); the rest is the card.
    job = load_job(
        write(
            tmp_path,
            """
            name: tiny
            output_dir: runs/tiny
            nodes: {min: 1, max: 1}
            nproc_per_node: 1
            command: null
            parallel: {tp: 1, pp: 1, vpp: 1, cp: 1, ep: 1, etp: null, order: tp-cp-ep-dp-pp}
            model: {layers: 4, hidden: 64, heads: 4, ffn_hidden: 256, vocab: 256, seq_len: 64,
                    experts: 0, top_k: 2, tie_embeddings: true, dropout: 0.0}
            train: {steps: 20, global_batch: 16, micro_batch: 2, lr: 1.0e-3, warmup: 0,
                    weight_decay: 0.0, grad_clip: 1.0, seed: 1234, dtype: float32}
            data: {source: synthetic}
            checkpoint: {dir: null, every: 10, keep: 3, async: true}
            restart: {max_restarts: 10, mode: process}
            rendezvous: {ttl: 3, settle: 1, join_timeout: 300}
            """,
        )
    )
    plain = json.loads(json.dumps(job.to_dict()))
    assert plain["checkpoint"]["async"] is True
    assert parse_job(plain) == job


def test_set_overrides_take_dotted_paths_and_yaml_typed_values(tmp_path):
    path = write(tmp_path, "name: tiny\n")
    overrides = ["train.steps=5", "output_dir=runs/x", "train.lr=1e-4", "parallel.tp=2"]
    job = load_job(path, [*overrides, "nproc_per_node=2"])
    assert job.train.steps == 5 and job.output_dir == "runs/x"
    assert job.train.lr == pytest.approx(1e-4) and job.parallel.tp == 2
    with pytest.raises(JobSpecError, match=r"not of the form key\.sub=value"):
        set_override({}, "train.steps")


def test_relative_paths_are_resolved_against_the_submitting_directory(tmp_path):
    job = load_job(write(tmp_path, "name: tiny\ndata: {source: file, path: data/tok}\n"))
    resolved = job.with_paths_resolved(tmp_path)
    assert resolved.output_dir == str(tmp_path / "runs" / "tiny")
    assert resolved.checkpoint.dir == str(tmp_path / "runs" / "tiny" / "ckpt")
    assert resolved.data.path == str(tmp_path / "data" / "tok")


@pytest.mark.parametrize(
    ("text", "message"),
    [
        (
            "name: tiny\nparallel: {tp: 3}\n",
            "job.yaml: parallel.tp: 3 does not divide model.heads (4)",
        ),
        (
            "name: tiny\nmodel: {layer: 4}\n",
            "job.yaml: model.layer: unknown key; did you mean 'layers'?",
        ),
        ("name: tiny\ntrain: {steps: ten}\n", "job.yaml: train.steps: 'ten' is not an integer"),
        ("name: Tiny\n", "job.yaml: name: 'Tiny' must match"),
        ("nodes: {min: 1}\n", "job.yaml: name: required"),
        ("name: tiny\nversion: 2\n", "job.yaml: version: 2 is not supported"),
        ("name: tiny\n: [\n", "job.yaml: not valid YAML at line"),
        ("- a\n- b\n", "job.yaml: top level: expected a mapping"),
        (
            "name: tiny\ncheckpoint: {memory_replicas: 1}\n",
            "job.yaml: checkpoint.memory_replicas: 1 needs restart.mode: inprocess",
        ),
        (
            "name: tiny\ncheckpoint: {memory_replicas: 1, memory_every: 0}\n"
            "restart: {mode: inprocess}\n",
            "job.yaml: checkpoint.memory_every: 0",
        ),
        (
            "name: tiny\ncheckpoint: {memory_replicas: 4}\nrestart: {mode: inprocess}\n",
            "job.yaml: checkpoint.memory_replicas: 4 is more than 3",
        ),
    ],
)
def test_bad_jobs_fail_with_one_line_naming_the_field(tmp_path, text, message):
    with pytest.raises(JobSpecError) as err:
        load_job(write(tmp_path, text))
    assert str(err.value).startswith(message)
    assert "\n" not in str(err.value)


def test_job_spec_is_frozen():
    job = parse_job({"name": "tiny"})
    assert isinstance(job, JobSpec)
    with pytest.raises(AttributeError):
        job.name = "other"  # type: ignore[misc]


@pytest.mark.parametrize(
    ("restart", "policy"),
    [
        ({}, "checkpoint"),
        ({"mode": "inprocess"}, "immediate"),
        ({"mode": "inprocess", "scale_up": "checkpoint"}, "checkpoint"),
        ({"mode": "process", "scale_up": "immediate"}, "immediate"),
    ],
)
def test_scale_up_defaults_to_immediate_in_process_and_checkpoint_otherwise(restart, policy):
    # In-process a newcomer takes its state from the survivors' memory: waiting for a
    # checkpoint saved nothing, and with checkpoint.every 0 a thawed node never came back.
    job = parse_job({"name": "t", "restart": restart})
    assert job.restart.scale_up == policy
    assert parse_job(job.to_dict()).restart.scale_up == policy  # what workers and etcd get
