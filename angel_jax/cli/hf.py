"""`angel-jax import` and `angel-jax export --hf`: Hugging Face checkpoints into a training config, and a run's
weights out to a directory transformers loads.

    angel-jax import HF_DIR --config OUT.yaml [--base experiments/gpt_tiny.yaml] [key=value ...]
    angel-jax export RUN_DIR [--step N] --hf OUT_DIR [--dtype float32|bfloat16|float16] [--max-shard-size 5GB]

`import` writes OUT.yaml: the base config (defaults without --base) with its model section's architecture keys
replaced by the checkpoint's (config.json) and model.init_from = HF_DIR, the checkpoint's tokenizer when it has a
tokenizer.json (data.tokenizer: hf, data.tokenizer_path = HF_DIR), then the overrides; no weight is read. `export`
reads the parameters of the run's newest valid checkpoint (or step N) of either engine (`train/weights.py`) and
writes config.json + model.safetensors (or shards named by model.safetensors.index.json), and the tokenizer's files
when the run used a Hugging Face tokenizer, all into a directory beside OUT_DIR that becomes OUT_DIR once complete
(an export is whole or absent: `models/hf/staging.py`). A paged run's checkpoint is read and written a stage at a
time, so its export holds one stage, not the model; the export refuses to start when that is more than half the RAM
available (the room the budgets give a large copy, leaving the rest to the machine), and states its peak.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from angel_jax.data import hf_tokenizer as tokenizers_hf
from angel_jax.config import ConfigError, ModelConfig, config_from_dict, parse_override
from angel_jax.errors import AngelError
from angel_jax.memory.host_peak import peak_rss, reset_peak
from angel_jax.schedule.budgets import gather_room
from angel_jax.train.weights import open_stages, run_config
from angel_jax.units import human_bytes
import models
from models import hf


class ExportMemoryError(AngelError):
    """An export would hold more host memory at once than the machine can give it."""


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
    from angel_jax.train.engines import refuse_beyond_reach

    refuse_beyond_reach(cfg)  # a config.json no tier could hold is refused from its numbers, before any tensor
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


@dataclass(frozen=True)
class Exported:
    out_dir: Path
    step: int
    """The training step exported."""
    files: list[str]
    """The weight files written (model.safetensors, or the index and its shards)."""
    held: int
    """The most host bytes the export planned to hold at once: one stage read (the whole parameters for a run read
    whole) and one converted tensor."""
    streamed: bool
    """True when the stages were read one at a time (a paged run)."""
    peak: int | None
    """The process's peak resident memory during the export (None where the OS does not say)."""


def export_run(run_dir: Path, out_dir: Path, *, step: int | None = None, dtype: str | None = None,
               overwrite: bool = False, max_shard_size: str | int = hf.DEFAULT_MAX_SHARD_SIZE,
               room: int | None = None) -> Exported:
    """Export the parameters of a run's checkpoint (newest valid, or `step`), stage by stage for a paged run.
    Refused (ExportMemoryError) before any parameter is read when what it would hold at once exceeds `room`
    bytes (default: what a large copy may take on this machine now, `budgets.gather_room`: half the RAM
    available)."""
    reset_peak()  # the peak reported is the export's
    cfg = run_config(run_dir)
    model_cfg = cfg.model
    try:
        hf.parse_size(max_shard_size)
    except ValueError as e:
        raise ConfigError(f"--max-shard-size: {e}") from None
    abstract = models.get(dataclasses.replace(model_cfg, init_from="")).stage_shapes()  # (no checkpoint read)
    largest = largest_tensor(model_cfg, abstract, dtype)
    # The tokenizer's special ids of the checkpoint the run started from, when it is still there.
    carry = hf.special_tokens(model_cfg.init_from) if model_cfg.init_from else {}
    tokenizer = tokenizers_hf.load_for(cfg) if cfg.data.tokenizer == "hf" else None
    if tokenizer is not None:
        carry = special_ids(carry, tokenizer.special_ids())
        _refuse_tokenizer_files(out_dir, overwrite)
    planned: dict[str, Any] = {}

    def admit(held: tuple[int, ...], streamed: bool) -> None:
        planned.update(held=max(held, default=0) + largest, streamed=streamed)
        check_host_memory(planned["held"], streamed, gather_room() if room is None else room, run_dir)

    # The tokenizer's files are part of the export: they appear with the weights, or nothing does.
    extra = functools.partial(_copy_tokenizer, *tokenizers_hf.tokenizer_dir(cfg)) if tokenizer is not None else None
    with open_stages(run_dir, step, admit) as weights:
        hf.export(model_cfg, weights.read, out_dir, abstract=abstract, dtype=dtype, carry=carry,
                  overwrite=overwrite, max_shard_size=max_shard_size, extra=extra,
                  owned=tokenizers_hf.TOKENIZER_FILES)
    return Exported(out_dir=out_dir, step=weights.step, files=hf.weight_files(out_dir), held=planned["held"],
                    streamed=planned["streamed"], peak=peak_rss())


def _copy_tokenizer(directory: Path, key: str, staging: Path) -> None:
    tokenizers_hf.copy_files(directory, staging, key)


def largest_tensor(model_cfg: ModelConfig, abstract: list, dtype: str | None) -> int:
    """Bytes of the export's largest tensor (one is converted and written at a time), from shapes alone."""
    specs = hf.export_specs(model_cfg, abstract, dtype or model_cfg.param_dtype)
    return max((s.nbytes for s in specs), default=0)


def check_host_memory(held: int, streamed: bool, room: int, run_dir: Path) -> None:
    """Refuse an export that would hold more at once than `room` (one line, naming both and why)."""
    if held > room:
        what = "one stage of" if streamed else "the whole parameters of"
        raise ExportMemoryError(f"exporting {run_dir} would hold {human_bytes(held)} of host memory at once "
                                f"({what} the model, unpacked, and one converted tensor), more than the "
                                f"{human_bytes(room)} it may take (half the RAM available now): free memory, or "
                                "export on a larger machine")


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
    done = export_run(args.run_dir, args.hf, step=args.step, dtype=args.dtype, overwrite=args.overwrite,
                      max_shard_size=args.max_shard_size)
    out = done.out_dir
    weights = (f"{out}/{hf.SINGLE_FILE}" if done.files == [hf.SINGLE_FILE] else
               f"{len(done.files) - 1} shards named by {out}/{hf.INDEX_FILE}")
    reading = "a stage at a time" if done.streamed else "whole"
    peak = human_bytes(done.peak) if done.peak is not None else "not measured"
    print(f"wrote {out}/config.json and {weights}: the parameters of step {done.step} of {args.run_dir}; peak host "
          f"memory {peak} (parameters read {reading}: at most {human_bytes(done.held)} held at once)")
    if run_config(args.run_dir).data.tokenizer == "hf":
        written = [n for n in tokenizers_hf.TOKENIZER_FILES if (out / n).is_file()]
        print(f"and the run's tokenizer: {', '.join(written)}")
    print(f"load them with: transformers.AutoModelForCausalLM.from_pretrained({str(out)!r})")
    return 0
