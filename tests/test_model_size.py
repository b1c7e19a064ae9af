"""A model too large in any dimension (depth, width, vocabulary, experts, T5's encoder and decoder depths), from a
YAML or an imported config.json, is refused in one line naming the bytes its training state needs, before anything
is built: its size is computed from the config (models.param_count), never from a billion stages."""

from __future__ import annotations

import dataclasses
import json
import shutil
import subprocess
import sys

import pytest
from conftest import REPO_ROOT

import models
from angel_jax import cli
from angel_jax.config import Config, ConfigError, ModelConfig, MoEConfig
from angel_jax.train.engines import refuse_beyond_reach, state_bytes

HUGE = 10**9


@pytest.mark.parametrize("model", [
    ModelConfig(n_layers=HUGE),
    ModelConfig(vocab_size=HUGE * 1000),
    ModelConfig(name="llama", n_layers=HUGE, n_kv_heads=2),
    ModelConfig(moe=MoEConfig(experts=HUGE, top_k=1)),
    ModelConfig(name="t5", n_layers=HUGE),
    ModelConfig(name="t5", n_layers=2, n_decoder_layers=HUGE, moe=MoEConfig(experts=4, top_k=1, every=2)),
], ids=["depth", "vocabulary", "llama-depth", "experts", "t5-encoder", "t5-decoder-moe"])
def test_a_model_too_large_in_any_dimension_is_refused_from_its_numbers(model):
    cfg = Config(model=model)
    need = state_bytes(cfg)  # arithmetic: instant at a billion layers
    assert need > 2**48
    with pytest.raises(ConfigError, match=r"training state needs [\d.]+ [KMGT]iB on this host, more than all it "
                                          r"has \(.* host RAM\) in any memory.mode: shrink the model"):
        refuse_beyond_reach(cfg)


def test_the_arithmetic_counts_are_the_built_models():
    """models.param_count is what the built model counts, MoE every-th blocks included."""
    for model in (ModelConfig(n_layers=3, d_model=16, n_heads=2, moe=MoEConfig(experts=4, top_k=2, every=3)),
                  ModelConfig(name="t5", n_layers=3, n_decoder_layers=2, d_model=16, n_heads=2,
                              moe=MoEConfig(experts=2, top_k=1, every=1))):
        assert models.param_count(model) == models.get(model).param_count
    refuse_beyond_reach(Config(model=ModelConfig()))  # a model that fits is not refused


def test_train_refuses_a_billion_layers_in_one_line_at_once(tmp_path):
    """`model.n_layers=1000000000` on gpt_tiny: one line, before the data is prepared (it built a billion stages
    first, for minutes, silent)."""
    run = subprocess.run([sys.executable, "-m", "angel_jax.cli", "train", str(REPO_ROOT / "experiments" /
                          "gpt_tiny.yaml"), "model.n_layers=1000000000", f"train.run_dir={tmp_path / 'run'}"],
                         capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert run.returncode != 0
    lines = run.stderr.strip().splitlines()
    assert len(lines) == 1 and "n_layers=1000000000" in lines[0] and "TiB on this host" in lines[0], run.stderr
    assert not (tmp_path / "data").exists()


def test_import_refuses_a_config_json_too_large_to_train(tmp_path, capsys):
    hf_dir = tmp_path / "huge"
    shutil.copytree(REPO_ROOT / "tests" / "fixtures" / "hf" / "llama", hf_dir)
    config = json.loads((hf_dir / "config.json").read_text())
    (hf_dir / "config.json").write_text(json.dumps({**config, "num_hidden_layers": HUGE}))
    assert cli.main(["import", str(hf_dir), "--config", str(tmp_path / "huge.yaml")]) != 0
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and f"n_layers={HUGE}" in err[0] and "training state needs" in err[0], err
    assert not (tmp_path / "huge.yaml").exists()
