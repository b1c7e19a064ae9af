"""Hugging Face checkpoints in and out: a directory with config.json + model.safetensors <-> our models.

    fields = hf.model_fields("ckpt/")                  # ModelConfig's architecture fields from config.json
    hf.check_matches(cfg.model, "ckpt/")               # ConfigError naming the first model.* key that differs
    params = hf.load_stage(cfg.model, "ckpt/", 3, abstract_stage)   # one stage, read from the file alone
    hf.export(cfg.model, staged.split(params), "out/") # config.json + model.safetensors (or shards + index)
    staged = hf.from_pretrained(staged, cfg.model)     # model.init_from: init / init_stage read the checkpoint

Each supported HF architecture has a mapping module here (gpt2.py, llama.py): pure functions from config.json to
our ModelConfig fields and back, and per-stage tensor tables (mapping.py) that convert in both directions. Import
is lazy per stage: `load_stage` reads only that stage's tensors, so the paged engine initialises a model larger
than RAM straight from the file, one stage at a time. Export streams the other way: given a function that reads
stage i, `export` converts and writes that stage's tensors into the current shard (header computed up front from
the shapes) before it reads the next, so a model larger than RAM is exported one stage at a time; everything is
written into a directory beside the target that becomes it once complete (staging.py).
"""

from __future__ import annotations

import dataclasses
import importlib
import json
from pathlib import Path
from types import ModuleType
from typing import Any, Callable, Collection, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from angel_jax.config import ConfigError, ModelConfig
from models.hf.mapping import TensorSource, iter_stage_to_hf, stage_from_hf, stage_hf_shapes
from models.hf.safetensors_io import (DEFAULT_MAX_SHARD_SIZE, INDEX_FILE, SHARD_FILE, SINGLE_FILE,
                                      CheckpointFileError, CheckpointTensors, ShardedWriter, TensorSpec,
                                      existing_weights, parse_size, weight_files)
from models.hf.staging import ExportTargetError, staged
from models.stages import StagedModel

Params = dict

MAPPINGS = {"gpt2": "models.hf.gpt2", "llama": "models.hf.llama", "qwen2": "models.hf.llama"}
"""HF model_type -> the module that maps it (Qwen2 is a Llama with q/k/v biases)."""
BY_FAMILY = {"gpt": "gpt2", "llama": "llama"}
"""Our model.name -> the HF model_type it is exported as."""

ARCHITECTURE_KEYS = ("name", "vocab_size", "seq_len", "d_model", "n_layers", "n_heads", "n_kv_heads",
                     "mlp_hidden", "norm_eps", "rope_theta", "rope_scaling", "rope_factor", "rope_low_freq_factor",
                     "rope_high_freq_factor", "rope_original_max_positions", "tie_embeddings", "qkv_bias", "o_bias")
"""The model.* keys a checkpoint fixes (in the order they are compared); the rest (dtypes, remat, scan) are ours."""

SPECIAL_TOKENS = ("bos_token_id", "eos_token_id", "pad_token_id")
"""config.json keys that describe the tokenizer, not the model: carried from an imported checkpoint to exports."""

EXPORT_DTYPES = ("float32", "bfloat16", "float16")

__all__ = ["ARCHITECTURE_KEYS", "CheckpointFileError", "CheckpointTensors", "DEFAULT_MAX_SHARD_SIZE", "EXPORT_DTYPES",
           "ExportTargetError", "INDEX_FILE",
           "check_matches", "export", "export_specs", "from_pretrained", "load_stage",
           "model_fields", "parse_size", "read_config", "weight_files"]


def read_config(hf_dir: str | Path) -> dict[str, Any]:
    """The checkpoint's config.json as a dict (a missing directory or file, or bad JSON, is a clear error)."""
    hf_dir = Path(hf_dir)
    path = hf_dir / "config.json"
    if not hf_dir.is_dir():
        raise CheckpointFileError(f"{hf_dir}: no such directory (expected a Hugging Face checkpoint: config.json "
                                  f"+ {SINGLE_FILE})")
    if not path.is_file():
        raise CheckpointFileError(f"{hf_dir}: no config.json (a Hugging Face checkpoint directory has config.json "
                                  f"+ {SINGLE_FILE})")
    try:
        raw = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise ConfigError(f"{path}: not a readable JSON file: {e}") from None
    if not isinstance(raw, dict):
        raise ConfigError(f"{path}: expected a JSON object, got {type(raw).__name__}")
    return raw


def mapping_of(raw: dict[str, Any], where: str) -> ModuleType:
    """The mapping module of a config.json's model_type."""
    model_type = raw.get("model_type")
    if model_type not in MAPPINGS:
        raise ConfigError(f"{where}: model_type={model_type!r} is not supported (supported: "
                          f"{', '.join(sorted(MAPPINGS))})")
    return importlib.import_module(MAPPINGS[model_type])


def mapping_for(cfg: ModelConfig) -> ModuleType:
    """The mapping module our model family is exported with."""
    if cfg.name not in BY_FAMILY:
        raise ConfigError(f"'model.name'={cfg.name!r} has no Hugging Face mapping (mapped: "
                          f"{', '.join(sorted(BY_FAMILY))})")
    return importlib.import_module(MAPPINGS[BY_FAMILY[cfg.name]])


def model_fields(hf_dir: str | Path) -> dict[str, Any]:
    """Our ModelConfig's architecture fields (a subset of ARCHITECTURE_KEYS) from the checkpoint's config.json."""
    where = str(Path(hf_dir) / "config.json")
    raw = read_config(hf_dir)
    return mapping_of(raw, where).model_fields(raw, where)


def _effective(cfg: ModelConfig, key: str) -> Any:
    # What the model computes with: mlp_hidden 0 means mlp_ratio x d_model, n_kv_heads 0 means n_heads.
    return {"mlp_hidden": cfg.hidden, "n_kv_heads": cfg.kv_heads}.get(key, getattr(cfg, key))


def check_matches(cfg: ModelConfig, hf_dir: str | Path) -> None:
    """Refuse a model config whose architecture differs from the checkpoint's, naming the first key that does."""
    where = str(Path(hf_dir) / "config.json")
    raw = read_config(hf_dir)
    mapping = mapping_of(raw, where)
    fields = mapping.model_fields(raw, where)
    for key in ARCHITECTURE_KEYS:
        if key not in fields:
            continue  # not part of this architecture (GPT-2 has no rotary embedding)
        want = fields[key]
        if key == "n_kv_heads":
            want = want or fields["n_heads"]
        shorter_ok = key in getattr(mapping, "AT_MOST", ())  # e.g. a rotary model's context
        if _effective(cfg, key) > want if shorter_ok else _effective(cfg, key) != want:
            hf_key = "model_type" if key == "name" else mapping.HF_KEYS[key]
            shown = f"{raw.get(hf_key)!r} -> {want!r}" if key == "name" else repr(want)
            differs = "exceeds" if shorter_ok and not isinstance(want, bool) else "differs from"
            raise ConfigError(f"'model.{key}'={_effective(cfg, key)!r} {differs} {hf_key}={shown} in {where} "
                              f"(model.init_from): the config's architecture must be the checkpoint's "
                              f"(`angel-jax import {hf_dir} --config OUT.yaml` writes a matching config)")


def load_stage(cfg: ModelConfig, files: CheckpointTensors, stage: int, abstract: Params) -> Params:
    """Stage `stage`'s params (numpy, model.param_dtype) from the checkpoint's tensors; `abstract` gives the
    stage's structure and shapes (e.g. `jax.eval_shape` of the family's init_stage)."""
    mapping = mapping_for(cfg)
    source = TensorSource(files, mapping.PREFIX)
    return stage_from_hf(mapping.tensor_table(cfg, stage), source, abstract, jnp.dtype(cfg.param_dtype))


def from_pretrained(staged: StagedModel, cfg: ModelConfig) -> StagedModel:
    """`staged` with `init` and `init_stage` reading the checkpoint at model.init_from (the seed is unused):
    init_stage reads one stage's tensors alone; init reads them all and stacks the blocks (`staged.merge`).
    Both first check that the config's architecture is the checkpoint's."""
    hf_dir = Path(cfg.init_from)
    family_init_stage = staged.init_stage
    shapes: dict[str, Params] = {}

    def abstract_stage(i: int) -> Params:  # stages of one kind share their shapes
        kind = staged.stages[i].kind
        if kind not in shapes:
            shapes[kind] = jax.eval_shape(lambda: family_init_stage(0, i))
        return shapes[kind]

    def open_checked() -> CheckpointTensors:
        check_matches(cfg, hf_dir)
        return CheckpointTensors(hf_dir)

    def init_stage(seed: int, i: int) -> Params:
        if not 0 <= i < len(staged.stages):
            raise IndexError(f"stage {i} out of range: the model has {len(staged.stages)} stages")
        return load_stage(cfg, open_checked(), i, abstract_stage(i))

    def init(seed: int) -> tuple[Any, Params]:
        files = open_checked()
        stages = [load_stage(cfg, files, i, abstract_stage(i)) for i in range(len(staged.stages))]
        with jax.default_device(jax.devices("cpu")[0]):  # stacked on the host; the engine places them
            params = jax.tree.map(np.asarray, staged.merge(stages))
        return staged.abstract()[0], params

    return dataclasses.replace(staged, init=init, init_stage=init_stage, init_reads_files=True)


def export_specs(cfg: ModelConfig, abstract: list[Params], dtype: str) -> list[TensorSpec]:
    """Every HF tensor of the export, in the order it is written (stage by stage), from shapes alone."""
    mapping = mapping_for(cfg)
    return [TensorSpec(name, shape, np.dtype(jnp.dtype(dtype))) for i, stage in enumerate(abstract)
            for name, shape in stage_hf_shapes(mapping.tensor_table(cfg, i), stage)]


def export(cfg: ModelConfig, stage_params: Sequence[Params] | Callable[[int], Params], out_dir: str | Path, *,
           abstract: list[Params] | None = None, dtype: str | None = None, carry: dict[str, Any] | None = None,
           overwrite: bool = False, max_shard_size: str | int = DEFAULT_MAX_SHARD_SIZE,
           extra: Callable[[Path], Any] | None = None, owned: Collection[str] = ()) -> Path:
    """Write our model's params as a Hugging Face checkpoint: the weights (tensors in `dtype`, default the params'
    own) in model.safetensors, or in shards of at most `max_shard_size` bytes ("5GB", "500MB", or a number of
    bytes) named by model.safetensors.index.json, and config.json (our architecture as the HF model_type; a head
    tied by model.tie_embeddings writes no lm_head.weight). `carry`: extra config.json keys (the special token ids
    of the checkpoint a run started from).

    `stage_params`: one pytree per stage (`StagedModel.split`), or a function that reads stage i when called,
    with `abstract`, every stage's shapes (`StagedModel.stage_shapes`): the stages are then read one at a time, each
    converted and written tensor by tensor before the next is read, so an export holds one stage's params and one
    converted tensor, never the model (the files' headers come from the shapes). Existing weights or a
    config.json in `out_dir` are refused unless `overwrite`.

    `extra(directory)` writes further files of the export (the tokenizer's) beside the weights; `owned` names the
    files of that kind an earlier export in `out_dir` may hold (replaced, or dropped when this one has none). The
    export is written into a new directory beside `out_dir` and becomes `out_dir` only when all of it is complete
    (`staging.staged`): a full disk, an interrupt or a kill leaves `out_dir` as it was; the user's other files in
    it stay."""
    out_dir = Path(out_dir)
    mapping = mapping_for(cfg)
    if abstract is None:
        if callable(stage_params):
            raise TypeError("export: stages read on demand need `abstract`, their shapes (StagedModel.stage_shapes)")
        abstract = [jax.tree.map(lambda x: jax.ShapeDtypeStruct(np.shape(x), x.dtype), p) for p in stage_params]
    dtype = dtype or np.dtype(jax.tree.leaves(abstract[0])[0].dtype).name
    if dtype not in EXPORT_DTYPES:
        raise ConfigError(f"export dtype {dtype!r}: one of {', '.join(EXPORT_DTYPES)}")
    try:
        max_bytes = parse_size(max_shard_size)
    except ValueError as e:
        raise ConfigError(f"export --max-shard-size: {e}") from None
    existing = [name for name in ["config.json"] + existing_weights(out_dir) if (out_dir / name).exists()]
    if existing and not overwrite:
        shown = existing if len(existing) <= 3 else existing[:2] + [f"{len(existing) - 2} more weight files"]
        raise CheckpointFileError(f"{out_dir} already holds {' and '.join(shown)}: choose another directory "
                                  "(or replace that checkpoint: angel-jax export --overwrite)")
    read = stage_params if callable(stage_params) else stage_params.__getitem__
    config = {**mapping.hf_config(cfg), **{k: None for k in SPECIAL_TOKENS}, **(carry or {}),
              "torch_dtype": dtype, "dtype": dtype}
    with staged(out_dir, lambda name: name in owned or _weights_or_config(name)) as staging:
        with ShardedWriter(staging, export_specs(cfg, abstract, dtype), max_bytes) as writer:
            for i in range(len(abstract)):
                _write_stage(writer, mapping.tensor_table(cfg, i), read(i), jnp.dtype(dtype))
            writer.commit()
        (staging / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
        if extra is not None:
            extra(staging)
    return out_dir


def _weights_or_config(name: str) -> bool:
    # What an earlier export (or a killed one, before exports were staged: its .tmp files) left in a directory.
    name = name.removesuffix(".tmp")
    return name in ("config.json", SINGLE_FILE, INDEX_FILE) or bool(SHARD_FILE.match(name))


def _write_stage(writer: ShardedWriter, table: list, params: Params, dtype: Any) -> None:
    # A function of its own so that the stage's params and its last tensor are let go before the next is read.
    for name, tensor in iter_stage_to_hf(table, params, dtype):
        writer.add(name, tensor)


def special_tokens(hf_dir: str | Path) -> dict[str, Any]:
    """The special token ids of a checkpoint's config.json ({} when it cannot be read: they are optional)."""
    try:
        raw = read_config(hf_dir)
    except (CheckpointFileError, ConfigError):
        return {}
    return {k: raw[k] for k in SPECIAL_TOKENS if k in raw}
