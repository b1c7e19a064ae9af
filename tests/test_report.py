"""The memory report's model line names the stages as the family builds them (an encoder-decoder's encoder and
decoder blocks both counted), not model.n_layers alone."""

from __future__ import annotations

from pathlib import Path

import pytest

import models
from angel_jax.config import load_config
from angel_jax.train.report import stage_summary

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("config,summary", [
    ("gpt_tiny.yaml", "embed, 4 x block, head"),
    ("t5_tiny.yaml", "embed, 2 x encoder, encoder_norm, 2 x decoder, head"),
])
def test_the_model_line_counts_every_block_of_every_kind(config, summary):
    cfg = load_config(ROOT / "experiments" / config, [])
    assert stage_summary(models.get(cfg.model).kinds()) == summary
