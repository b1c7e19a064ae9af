"""`angel-jax import` and `angel-jax export --hf`: Hugging Face checkpoints into a training config, and a run's
weights out to a directory transformers loads.

    angel-jax import HF_DIR --config OUT.yaml [--base experiments/gpt_tiny.yaml] [key=value ...]
    angel-jax export RUN_DIR [--step N] --hf OUT_DIR [--dtype float32|bfloat16|float16]

`import` writes OUT.yaml: the base config (defaults without --base) with its model section's architecture keys
replaced by the checkpoint's (config.json) and model.init_from = HF_DIR, the checkpoint's tokenizer when it has a
tokenizer.json (data.tokenizer: hf, data.tokenizer_path = HF_DIR), then the overrides; no weight is read. `export`
reads the parameters of the run's newest valid checkpoint (or step N) of either engine (`train/weights.py`) and
writes config.json + model.safetensors, and the tokenizer's files when the run used a Hugging Face tokenizer.
"""

from __future__ import annotations

import argparse
import dataclasses
from pathlib import Path
from typing import Any

import yaml

from angel_jax import tokenizers_hf
from angel_jax.config import ConfigError, config_from_dict, parse_override
from angel_jax.train.weights import load_params, run_config
import models
from models import hf


def import_config(hf_dir: Path, out: Path, base: Path | None = None, overrides: list[str] = ()) -> dict[str, Any]:
    """The training config of `hf_dir` as written to `out` (a dict), validated and checked against the
    checkpoint (an override that changes the architecture is refused, naming the key)."""
    if out.exists():
        raise ConfigError(f"{out} exists: choose another path for the new config (or remove that file)")
    raw: dict[str, Any] = {}
    if base is not None:
        if not base.is_file():
            raise ConfigError(f"base config {base} does not exist")
        raw = yaml.safe_load(base.read_text(encoding="utf-8")) or {}
        if not isinstance(raw, dict):
            raise ConfigError(f"{base}: expected a mapping at the top level, got {type(raw).__name__}")
    model = {k: v for k, v in (raw.get("model") or {}).items() if k not in hf.ARCHITECTURE_KEYS + ("mlp_ratio",)}
    raw["model"] = {**hf.model_fields(hf_dir), **model, "init_from": str(hf_dir.resolve())}
    if (hf_dir / tokenizers_hf.TOKENIZER_FILE).is_file():  # the ids the checkpoint was trained on
        raw["data"] = {**(raw.get("data") or {}), "tokenizer": "hf", "tokenizer_path": str(hf_dir.resolve())}
    for text in overrides:
        raw = _merge(raw, parse_override(text))
    origin = f"the config for {hf_dir}" + (f" (base {base})" if base else "")
    cfg = config_from_dict({"name": out.stem, **raw}, origin)
    models.check_init_from(cfg.model)
    if cfg.data.tokenizer == "hf":
        tokenizers_hf.load_for(cfg)  # a tokenizer larger than the model is refused now, not at training
    return raw


def _merge(base: dict, updates: dict) -> dict:
    out = dict(base)
    for key, value in updates.items():
        out[key] = _merge(out[key], value) if isinstance(value, dict) and isinstance(out.get(key), dict) else value
    return out


def import_main(args: argparse.Namespace) -> int:
    raw = import_config(args.hf_dir, args.config, args.base, args.overrides)
    header = (f"# Written by `angel-jax import {args.hf_dir}`: the model section is the Hugging Face checkpoint's\n"
              f"# (model.init_from); its architecture keys must stay as they are.\n")
    args.config.parent.mkdir(parents=True, exist_ok=True)
    args.config.write_text(header + yaml.safe_dump(raw, sort_keys=False))
    m, tokenizer = raw["model"], (raw.get("data") or {}).get("tokenizer", "byte")
    print(f"wrote {args.config}: {m['name']}, {m['n_layers']} x {m['d_model']}, {m['n_heads']} heads, "
          f"vocabulary {m['vocab_size']}, sequence {m['seq_len']}, from {m['init_from']}; data tokenizer {tokenizer}"
          + (f" ({raw['data']['tokenizer_path']})" if tokenizer == "hf" else ""))
    if tokenizer != "hf":
        print(f"note: the data is tokenized with the {tokenizer} tokenizer, not the checkpoint's (data.tokenizer; "
              f"a checkpoint's tokenizer is its {tokenizers_hf.TOKENIZER_FILE}): the model starts from ids it was "
              "not trained on")
    print(f"train it with: angel-jax train {args.config}")
    return 0


def export_run(run_dir: Path, out_dir: Path, *, step: int | None = None, dtype: str | None = None,
               overwrite: bool = False) -> tuple[Path, int]:
    """Export the parameters of a run's checkpoint (newest valid, or `step`); returns (out_dir, step)."""
    weights = load_params(run_dir, step)
    model_cfg = weights.cfg.model
    staged = models.get(dataclasses.replace(model_cfg, init_from=""))
    # The tokenizer's special ids of the checkpoint the run started from, when it is still there.
    carry = hf.special_tokens(model_cfg.init_from) if model_cfg.init_from else {}
    tokenizer = tokenizers_hf.load_for(weights.cfg) if weights.cfg.data.tokenizer == "hf" else None
    if tokenizer is not None:
        carry = special_ids(carry, tokenizer.special_ids())
        _refuse_tokenizer_files(out_dir, overwrite)
    hf.export(model_cfg, staged.split(weights.params), out_dir, dtype=dtype, carry=carry, overwrite=overwrite)
    if tokenizer is not None:
        directory, key = tokenizers_hf.tokenizer_dir(weights.cfg)
        tokenizers_hf.copy_files(directory, out_dir, key)
    return out_dir, weights.step


def special_ids(checkpoint: dict[str, Any], tokenizer: dict[str, int]) -> dict[str, Any]:
    """config.json's special token ids for a run trained with a Hugging Face tokenizer: the tokenizer's, since the
    data was made with them, except where the checkpoint's value agrees with it (the same id, or a list that holds
    it: Llama 3's several end-of-sequence ids stay)."""
    out = dict(checkpoint)
    for key, mine in tokenizer.items():
        theirs = checkpoint.get(key)
        if not (theirs == mine or (isinstance(theirs, list) and mine in theirs)):
            out[key] = mine
    return out


def _refuse_tokenizer_files(out_dir: Path, overwrite: bool) -> None:
    # Checked before anything is written: a refused export leaves the directory as it was.
    existing = [n for n in tokenizers_hf.TOKENIZER_FILES if (out_dir / n).exists()]
    if existing and not overwrite:
        raise hf.CheckpointFileError(f"{out_dir} already holds {' and '.join(existing)}: choose another directory "
                                     "(or replace them: angel-jax export --overwrite)")


def export_main(args: argparse.Namespace) -> int:
    out, step = export_run(args.run_dir, args.hf, step=args.step, dtype=args.dtype, overwrite=args.overwrite)
    print(f"wrote {out}/config.json and {out}/{hf.SINGLE_FILE}: the parameters of step {step} of {args.run_dir}")
    if run_config(args.run_dir).data.tokenizer == "hf":
        written = [n for n in tokenizers_hf.TOKENIZER_FILES if (out / n).is_file()]
        print(f"and the run's tokenizer: {', '.join(written)}")
    print(f"load them with: transformers.AutoModelForCausalLM.from_pretrained({str(out)!r})")
    return 0
