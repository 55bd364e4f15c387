"""Hugging Face interchange, checked by the real ``transformers`` package (a test extra):
``elasticd ckpt export --format hf`` loads as GPT-2 with the trainer's logits, and
``model.init_from: hf:DIR`` starts training from a GPT-2 directory ``transformers`` made."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import yaml

transformers = pytest.importorskip("transformers")

from checkpoint import SaveOptions, Saver  # noqa: E402
from elasticd.cli import main  # noqa: E402
from elasticd.jobspec import parse_job  # noqa: E402
from trainer.checkpointing import checkpoint_extra  # noqa: E402
from trainer.model import build_chunks  # noqa: E402
from trainer.parallel.context import ParallelContext  # noqa: E402

MODEL = {"layers": 2, "hidden": 32, "heads": 4, "ffn_hidden": 64, "vocab": 50, "seq_len": 16,
         "experts": 0, "tie_embeddings": True, "dropout": 0.0}  # fmt: skip


def job(**model):
    return parse_job({"name": "hf", "model": {**MODEL, **model}})


def our_model(j, seed: int = 3):
    torch.manual_seed(seed)
    (chunk,) = build_chunks(j.model, [range(j.model.layers)], ctx=ParallelContext.single(),
                            seed=seed)  # fmt: skip
    chunk.eval()
    return chunk


def save(j, chunk, ckpt: str, step: int = 5) -> None:
    model = {name: (p.detach(), p.shard_info) for name, p in chunk.named_parameters()}
    saver = Saver(ckpt, group=None, options=SaveOptions(async_=False, job=j.name))
    saver.save(step=step, consumed_samples=0, model=model, extra=checkpoint_extra(j))
    saver.close()


def hf_logits(path: str, tokens: torch.Tensor) -> torch.Tensor:
    model, info = transformers.AutoModelForCausalLM.from_pretrained(path, output_loading_info=True)
    assert type(model).__name__ == "GPT2LMHeadModel"
    assert not info["missing_keys"], info
    assert not info["unexpected_keys"] and not info["mismatched_keys"], info
    model.eval()
    with torch.no_grad():
        return model(tokens).logits


@pytest.mark.parametrize("tied", [True, False])
def test_export_format_hf_loads_in_transformers_as_gpt2_with_the_trainers_logits(
    tmp_path, capsys, tied
):
    j = job(tie_embeddings=tied)
    chunk = our_model(j)
    ckpt = str(tmp_path / "ckpt")
    save(j, chunk, ckpt)
    out = tmp_path / "hf"
    assert main(["ckpt", "export", ckpt, str(out), "--format", "hf", "--step", "5"]) == 0
    assert "exported step 5" in capsys.readouterr().out
    config = json.loads((out / "config.json").read_text())
    assert config["model_type"] == "gpt2"
    # No special tokens: GPT-2's default ids (50256) would lie outside the vocabulary.
    assert (config["bos_token_id"], config["eos_token_id"]) == (None, None)
    tokens = torch.randint(0, MODEL["vocab"], (2, MODEL["seq_len"]))
    with torch.no_grad():
        ours = chunk(tokens)[..., : MODEL["vocab"]]
    theirs = hf_logits(str(out), tokens)
    assert theirs.shape == ours.shape
    torch.testing.assert_close(theirs, ours, rtol=0, atol=1e-4)


def test_export_format_hf_refuses_a_mixture_of_experts_in_one_line(tmp_path, capsys):
    j = job(experts=4)
    chunk = our_model(j)
    ckpt = str(tmp_path / "ckpt")
    save(j, chunk, ckpt)
    code = main(["ckpt", "export", ckpt, str(tmp_path / "hf"), "--format", "hf"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and "mixture-of-experts" in err[0], err
    assert not (tmp_path / "hf").exists()


def make_hf_dir(path: Path, seed: int = 11) -> transformers.GPT2LMHeadModel:
    """A random GPT-2 made by transformers itself: nothing is downloaded."""
    cfg = transformers.GPT2Config(
        vocab_size=MODEL["vocab"], n_positions=32, n_embd=MODEL["hidden"], n_layer=MODEL["layers"],
        n_head=MODEL["heads"], n_inner=MODEL["ffn_hidden"], activation_function="gelu_new",
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
    )  # fmt: skip
    torch.manual_seed(seed)
    model = transformers.GPT2LMHeadModel(cfg)
    with torch.no_grad():  # LayerNorms and biases random too, so every mapping is seen
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    model.save_pretrained(str(path))
    return model.eval()


def test_init_from_hf_gives_the_same_logits_as_the_transformers_model(tmp_path):
    from trainer.hf import read_hf

    hf = make_hf_dir(tmp_path / "gpt2")
    j = job()
    chunk = our_model(j)
    full = read_hf(str(tmp_path / "gpt2"), j.model)
    with torch.no_grad():
        for _, p in chunk.named_parameters():
            info = p.shard_info
            p[tuple(slice(0, s) for s in info.sizes)].copy_(full[info.name])
    tokens = torch.randint(0, MODEL["vocab"], (2, MODEL["seq_len"]))
    with torch.no_grad():
        ours = chunk(tokens)[..., : MODEL["vocab"]]
        theirs = hf(tokens).logits
    torch.testing.assert_close(ours, theirs, rtol=0, atol=1e-4)


def test_init_from_a_directory_that_does_not_match_the_model_is_one_line(tmp_path):
    from trainer.hf import HFError, read_hf

    make_hf_dir(tmp_path / "gpt2")
    with pytest.raises(HFError, match=r"config\.json n_layer is 2, the job.s model needs 4"):
        read_hf(str(tmp_path / "gpt2"), job(layers=4).model)


@pytest.mark.slow  # a two-rank trainer run: about 20 s on the 2-core machine
def test_a_tp2_job_starts_from_a_hf_directory_and_exports_it_back_unchanged(tmp_path):
    """``model.init_from`` in another layout (tp=2, each rank slicing its own shard): with
    a learning rate far below float32's resolution the first step changes nothing, so
    the committed step exports back to the very tensors transformers saved."""
    from safetensors.torch import load_file

    from trainer.launch import launch_local

    make_hf_dir(tmp_path / "gpt2")
    raw = {"name": "hf", "nproc_per_node": 2, "output_dir": str(tmp_path / "out"),
           "parallel": {"tp": 2}, "model": MODEL,
           "train": {"steps": 1, "global_batch": 4, "micro_batch": 2, "lr": 1.0e-30},
           "data": {"source": "synthetic"}}  # fmt: skip
    (tmp_path / "job.yaml").write_text(yaml.safe_dump(raw))
    outcomes = launch_local(str(tmp_path / "job.yaml"), world=2,
                            overrides=[f"model.init_from=hf:{tmp_path / 'gpt2'}"])  # fmt: skip
    assert all(o.returncode == 0 for o in outcomes), [o.output[-2000:] for o in outcomes]
    assert "initialised from Hugging Face GPT-2" in outcomes[0].output
    ckpt = str(tmp_path / "out" / "ckpt")
    assert main(["ckpt", "export", ckpt, str(tmp_path / "back"), "--format", "hf"]) == 0
    before = load_file(str(tmp_path / "gpt2" / "model.safetensors"))
    after = load_file(str(tmp_path / "back" / "model.safetensors"))
    for name, t in after.items():
        src = before.get(name, before.get(name.removeprefix("transformer.")))
        if name == "transformer.wpe.weight":
            src = src[: MODEL["seq_len"]]
        assert torch.equal(t, src), name


def test_an_export_into_a_directory_holding_another_models_weights_is_refused(tmp_path, capsys):
    """An export into a directory holding a sharded model added model.safetensors beside
    the old index and shards: transformers loaded the new weights, model.init_from the
    old ones (it read the index first), and trained on from them. Now the export refuses
    such a directory, nothing written, and init_from takes model.safetensors first, as
    transformers does."""
    from trainer.hf import read_hf

    j = job()
    ckpt = str(tmp_path / "ckpt")
    save(j, our_model(j), ckpt)
    out = tmp_path / "hf"
    hf = make_hf_dir(out)
    hf.save_pretrained(str(out), max_shard_size="20KB")  # an index and its shards
    listed = sorted(p.name for p in out.iterdir())
    assert "model.safetensors.index.json" in listed
    capsys.readouterr()  # transformers' progress bars
    assert main(["ckpt", "export", ckpt, str(out), "--format", "hf"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "holds other weight files (model-00001-of-" in err[0], err
    assert sorted(p.name for p in out.iterdir()) == listed
    # Both kinds side by side (made by hand): the single file is the model, as for
    # transformers.
    clean = tmp_path / "clean"
    assert main(["ckpt", "export", ckpt, str(clean), "--format", "hf"]) == 0
    for p in out.iterdir():
        if p.name.startswith("model-") or p.name.endswith(".index.json"):
            (clean / p.name).write_bytes(p.read_bytes())
    ours = read_hf(str(clean), j.model)
    theirs = transformers.AutoModelForCausalLM.from_pretrained(str(clean))
    wte = theirs.transformer.wte.weight.detach()
    torch.testing.assert_close(ours["embedding.word_embeddings.weight"][: MODEL["vocab"]], wte)


def test_init_from_refuses_weights_its_config_does_not_describe(tmp_path):
    """Four layers' weights under a config saying two trained on from layers 0 and 1
    without a word."""
    from safetensors.torch import load_file, save_file

    from trainer.hf import HFError, read_hf

    make_hf_dir(tmp_path / "gpt2")
    four = tmp_path / "four"
    big = transformers.GPT2Config.from_pretrained(str(tmp_path / "gpt2"))
    big.n_layer = 4
    transformers.GPT2LMHeadModel(big).save_pretrained(str(four))
    (four / "config.json").write_text((tmp_path / "gpt2" / "config.json").read_text())
    with pytest.raises(HFError, match=r"holds \d+ tensors the job.s model has no place for "
                       r"\((transformer\.)?h\.2\.attn"):  # fmt: skip
        read_hf(str(four), job().model)
    # Old files' causal-mask buffers are no weights: taken as they come.
    path = tmp_path / "gpt2" / "model.safetensors"
    tensors = load_file(str(path))
    tensors["h.0.attn.bias"] = torch.ones(1, 1, 32, 32)
    save_file(tensors, str(path), metadata={"format": "pt"})
    read_hf(str(tmp_path / "gpt2"), job().model)
