"""Hugging Face checkpoints in training: `angel-jax import` writes a config that starts from one, a run with
model.init_from trains alike in the in-memory and the paged engine from the checkpoint's parameters (its first
loss is our model's loss with those parameters), and `angel-jax export` writes a run's checkpoint back out."""

from __future__ import annotations

import dataclasses
import re
import shutil
from pathlib import Path

import jax
import numpy as np
import pytest

import models
from angel_jax import cli
from angel_jax.data import shards as data_lib
from angel_jax.config import load_config
from angel_jax.train.weights import load_params
from models import hf

FIXTURES = Path(__file__).parent / "fixtures" / "hf"
ROOT = Path(__file__).resolve().parents[1]


def test_import_writes_a_config_that_starts_from_the_checkpoint(tmp_path, capsys):
    out = tmp_path / "configs" / "gpt2.yaml"
    base = ROOT / "experiments" / "gpt_tiny.yaml"
    assert cli.main(["import", str(FIXTURES / "gpt2"), "--config", str(out), "--base", str(base),
                     "train.steps=5"]) == 0
    assert f"angel-jax train {out}" in capsys.readouterr().out
    cfg = load_config(out)
    assert {k: getattr(cfg.model, k) for k in hf.model_fields(FIXTURES / "gpt2")} == hf.model_fields(FIXTURES / "gpt2")
    assert cfg.model.init_from == str((FIXTURES / "gpt2").resolve())
    base_cfg = load_config(base)
    assert cfg.model.compute_dtype == base_cfg.model.compute_dtype == "float32"  # the base's own model keys stay
    assert cfg.optimizer == base_cfg.optimizer and cfg.train.steps == 5 and cfg.name == "gpt2"
    models.check_init_from(cfg.model)

    # Refused: an override that changes the architecture, an existing file, an unsupported checkpoint.
    assert cli.main(["import", str(FIXTURES / "gpt2"), "--config", str(tmp_path / "x.yaml"), "model.d_model=32"]) == 2
    assert "'model.d_model'=32 differs from n_embd=48" in capsys.readouterr().err
    assert cli.main(["import", str(FIXTURES / "llama"), "--config", str(out)]) == 2
    assert f"{out} exists" in capsys.readouterr().err
    assert cli.main(["import", str(tmp_path), "--config", str(tmp_path / "y.yaml")]) == 1
    assert "no config.json" in capsys.readouterr().err
    assert not (tmp_path / "x.yaml").exists() and not (tmp_path / "y.yaml").exists()


@pytest.mark.parametrize("name", ["llama3", "llama_tied", "qwen2"])
def test_import_carries_rope_scaling_tied_heads_and_biases(name, tmp_path, capsys):
    """The config written for a Llama 3.1-style, a tied or a Qwen2 checkpoint has its rope_*, tie_embeddings and
    bias keys, whatever the base config says, and trains from it."""
    out = tmp_path / f"{name}.yaml"
    base = tmp_path / "base.yaml"
    base.write_text("model: {name: llama, rope_scaling: none, tie_embeddings: false, qkv_bias: false, "
                    "rope_factor: 2.0}\n")
    assert cli.main(["import", str(FIXTURES / name), "--config", str(out), "--base", str(base)]) == 0
    cfg = load_config(out)
    fields = hf.model_fields(FIXTURES / name)
    assert {k: getattr(cfg.model, k) for k in fields} == fields
    assert fields["rope_scaling"] == "llama3" or fields["tie_embeddings"] or fields["qkv_bias"]
    models.check_init_from(cfg.model)


def _assert_equal_trees(got, want) -> None:
    assert jax.tree.structure(got) == jax.tree.structure(want)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        assert a.dtype == b.dtype and a.shape == b.shape
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


@pytest.mark.compares_programs
@pytest.mark.slow
def test_a_run_from_a_checkpoint_trains_alike_in_both_engines_and_exports(tmp_path, write_tiny_config, toy_corpus):
    src = FIXTURES / "llama"
    model = {**hf.model_fields(src), "init_from": str(src)}
    sections = dict(model=model, train={"steps": 3, "batch_size": 4}, checkpoint={"every": 3})
    paged = {"mode": "paged", "page_size": 65536, "device_budget": 3_000_000}
    runs = {"in_memory": write_tiny_config(tmp_path, "in_memory", **sections),
            "paged": write_tiny_config(tmp_path, "paged", memory=paged, **sections)}
    from angel_jax.train.loop import train

    results = {name: train(load_config(path)) for name, path in runs.items()}
    losses = {name: [r["loss"] for r in result.history] for name, result in results.items()}
    assert len(losses["paged"]) == 3
    np.testing.assert_allclose(losses["paged"], losses["in_memory"], rtol=1e-6)

    # Step 1's loss is our model's loss, with the checkpoint's parameters, on the first batch.
    cfg = load_config(runs["in_memory"])
    staged = models.get(cfg.model)
    imported = staged.init(0)[1]
    batch = next(data_lib.TokenIterator(toy_corpus[1], batch_size=4, seq_len=cfg.model.seq_len, seed=cfg.data.seed))
    logits = jax.jit(staged.forward)(staged.split(imported), batch[:, :-1])
    np.testing.assert_allclose(losses["in_memory"][0], float(staged.loss(logits, batch[:, 1:])), rtol=1e-6)

    # Exported from either engine's checkpoint, imported again: the trained parameters bit for bit.
    for name, result in results.items():
        out = tmp_path / f"{name}-hf"
        assert cli.main(["export", str(tmp_path / name), "--hf", str(out)]) == 0
        assert load_params(tmp_path / name).step == 3
        back = models.get(dataclasses.replace(cfg.model, init_from=str(out))).init(0)[1]
        _assert_equal_trees(back, result.params)
        assert not np.array_equal(back["blocks"]["q"]["kernel"], imported["blocks"]["q"]["kernel"])
        assert hf.special_tokens(out) == hf.special_tokens(src)  # carried from the checkpoint the run started from
    assert cli.main(["export", str(tmp_path / "paged"), "--hf", str(tmp_path / "paged-hf")]) == 1  # not over it


def test_init_from_may_change_on_resume():
    """init_from only chooses step 0's parameters: a resume may drop it (the directory moved) or come from a
    checkpoint written before the key existed; another architecture is still refused."""
    from angel_jax.checkpoint import CheckpointError
    from angel_jax.config import to_dict
    from angel_jax.train.checkpointing import check_same_model

    cfg = load_config(None, ["model.init_from=/moved/away"])
    saved = to_dict(load_config(None))
    check_same_model(saved, cfg, 3)
    del saved["model"]["init_from"]
    check_same_model(saved, cfg, 3)
    saved["model"]["d_model"] = 64
    with pytest.raises(CheckpointError, match="model.d_model=128"):
        check_same_model(saved, cfg, 3)


def test_a_checkpoint_from_before_a_model_key_existed_resumes_as_its_default():
    """A model key added to the config since a checkpoint was written (rope scaling, tied embeddings, biases)
    stands for its default, the model that checkpoint computed; set to something else, it is another model."""
    from angel_jax.checkpoint import CheckpointError
    from angel_jax.config import to_dict
    from angel_jax.train.checkpointing import check_same_model

    saved = to_dict(load_config(None))
    for key in ("rope_scaling", "tie_embeddings", "qkv_bias", "o_bias", "rope_factor"):
        del saved["model"][key]
    check_same_model(saved, load_config(None), 3)
    with pytest.raises(CheckpointError, match=r"model.qkv_bias=True \(the checkpoint's: False\)"):
        check_same_model(saved, load_config(None, ["model.name=llama", "model.qkv_bias=true"]), 3)


def _damaged_gpt2(directory: Path, damage: str) -> tuple[Path, str]:
    """A copy of the GPT-2 fixture with one tensor damaged, and that tensor's name: the embedding's float bytes
    declared I32 (the same bytes, read as integers), or one NaN in block 1's MLP."""
    from safetensors.numpy import load_file, save_file

    directory.mkdir()
    shutil.copy(FIXTURES / "gpt2" / "config.json", directory)
    tensors = load_file(str(FIXTURES / "gpt2" / "model.safetensors"))
    if damage == "I32":
        name = "transformer.wte.weight"
        tensors[name] = tensors[name].view(np.int32)
    else:
        name = "transformer.h.1.mlp.c_fc.weight"
        tensors[name] = tensors[name].copy()
        tensors[name][3, 5] = np.nan
    save_file(tensors, str(directory / "model.safetensors"), metadata={"format": "pt"})
    return directory, name


@pytest.mark.parametrize("mode", ["in_memory", "paged"])
@pytest.mark.parametrize("damage", ["I32", "NaN"])
def test_weights_that_are_not_finite_floats_are_refused_naming_the_tensor(damage, mode, tmp_path, capsys,
                                                                          write_tiny_config):
    """`angel-jax import` reads headers only (it goes through); `train` reads the weights, in the in-memory
    engine whole, in the paged one stage by stage, and refuses the damaged tensor on one line naming it and its
    file, before a step is trained."""
    src, name = _damaged_gpt2(tmp_path / "ckpt", damage)
    memory = {"mode": mode, **({"page_size": 65536, "device_budget": 3_000_000} if mode == "paged" else {})}
    base = write_tiny_config(tmp_path, "base", memory=memory, train={"steps": 2})
    config = tmp_path / "run.yaml"
    assert cli.main(["import", str(src), "--config", str(config), "--base", str(base),
                     f"train.run_dir={tmp_path / 'run'}"]) == 0
    capsys.readouterr()
    assert cli.main(["train", str(config)]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: "), err[-5:]
    says = (rf"tensor '{name}' is stored as I32, not a floating-point type" if damage == "I32" else
            rf"tensor '{name}' holds 1 non-finite values \(1 NaN, 0 infinite; the first at index \[3, 5\]\)")
    assert re.search(rf"{src / 'model.safetensors'}: {says}", err[0]), err[0]
    assert not list((tmp_path / "run").glob("checkpoints/*"))
