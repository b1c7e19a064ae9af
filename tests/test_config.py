"""angel_jax.config: strict YAML loading, dotted overrides, validation messages, describe(), dump/load round trip."""

from __future__ import annotations

import dataclasses
import typing
from pathlib import Path

import pytest
import yaml

from angel_jax import config as C
from angel_jax.config import Config, ConfigError, describe, dump_yaml, load_config, parse_override

ROOT = Path(__file__).resolve().parent.parent
TINY = ROOT / "experiments" / "gpt_tiny.yaml"


def _write(tmp_path: Path, text: str, name: str = "exp.yaml") -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


def _leaf_keys(cls: type = Config, prefix: str = "") -> list[str]:
    """Every dotted leaf key, walked from the dataclasses themselves (not from describe())."""
    keys = []
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        if dataclasses.is_dataclass(hints[f.name]):
            keys += _leaf_keys(hints[f.name], f"{prefix}{f.name}.")
        else:
            keys.append(f"{prefix}{f.name}")
    return keys


# ------------------------------------------------------------------------------------------------ loading


def test_gpt_tiny_yaml_loads_with_its_values():
    raw = yaml.safe_load(TINY.read_text())
    cfg = load_config(TINY)
    assert cfg.name == "gpt_tiny"  # the file's stem
    for section, values in raw.items():
        for key, value in values.items():
            assert getattr(getattr(cfg, section), key) == value, f"{section}.{key}"
    assert isinstance(cfg.optimizer.lr, float) and cfg.optimizer.lr == 3.0e-3
    # keys the file does not set keep their defaults
    assert cfg.train.seed == C.TrainConfig().seed and cfg.memory == C.MemoryConfig()


def test_defaults_without_a_file():
    assert load_config(None) == Config()


def test_overrides_apply_with_types():
    cfg = load_config(TINY, ["optimizer.lr=3e-4", "train.steps=200", "model.remat=true", "data.source=/tmp/x.txt",
                             "optimizer.grad_clip=2", "checkpoint.every=0"])
    assert type(cfg.optimizer.lr) is float and cfg.optimizer.lr == 3e-4  # YAML 1.1 alone would give '3e-4'
    assert type(cfg.train.steps) is int and cfg.train.steps == 200
    assert cfg.model.remat is True
    assert cfg.data.source == "/tmp/x.txt"
    assert type(cfg.optimizer.grad_clip) is float and cfg.optimizer.grad_clip == 2.0  # int -> float, the one coercion
    assert cfg.checkpoint.every == 0
    # the rest of a section the override touches is kept from the file
    assert cfg.model.d_model == 128 and cfg.optimizer.warmup_steps == 20 and cfg.train.batch_size == 16


def test_later_override_wins():
    cfg = load_config(TINY, ["train.steps=5", "train.steps=7"])
    assert cfg.train.steps == 7


def test_parse_override_nested():
    assert parse_override("optimizer.lr=3e-4") == {"optimizer": {"lr": 3e-4}}
    assert parse_override("a.b.c=1") == {"a": {"b": {"c": 1}}}
    assert parse_override("train.run_dir=runs/x=y") == {"train": {"run_dir": "runs/x=y"}}  # split at the first '='
    assert parse_override("name=") == {"name": ""}


def test_dump_load_round_trip(tmp_path):
    cfg = load_config(TINY, ["optimizer.lr=3e-4", "optimizer.eps=1e-12", "model.remat=true", "train.run_dir=r/x",
                             "memory.page_size=8192", "name=round-trip", "optimizer.schedule=linear"])
    path = _write(tmp_path, dump_yaml(cfg), "dumped.yaml")
    again = load_config(path)
    assert again == cfg
    assert dump_yaml(again) == dump_yaml(cfg)


# ------------------------------------------------------------------------------------------------- errors


def _error(path: Path | None, overrides: list[str] = ()) -> str:
    with pytest.raises(ConfigError) as info:
        load_config(path, list(overrides))
    return str(info.value)


@pytest.mark.parametrize("text, key", [
    ("modle:\n  d_model: 64\n", "modle"),
    ("model:\n  d_modle: 64\n", "model.d_modle"),
    ("optimizer:\n  learning_rate: 0.1\n", "optimizer.learning_rate"),
])
def test_unknown_key_in_file_names_key_and_file(tmp_path, text, key):
    path = _write(tmp_path, text)
    msg = _error(path)
    assert repr(key) in msg and str(path) in msg and "unknown" in msg


@pytest.mark.parametrize("text, key", [
    ('train:\n  steps: "ten"\n', "train.steps"),
    ("train:\n  steps: true\n", "train.steps"),  # bool is not an int here
    ("optimizer:\n  lr: true\n", "optimizer.lr"),
    ("train:\n  progress: 1\n", "train.progress"),  # nor an int a bool
    ("model:\n  d_model: 64.0\n", "model.d_model"),  # no float -> int
    ("model:\n  compute_dtype: float16\n", "model.compute_dtype"),
    ("name: 5\n", "name"),
    ("model: 5\n", "model"),
])
def test_wrong_type_in_file_names_key_and_file(tmp_path, text, key):
    path = _write(tmp_path, text)
    msg = _error(path)
    assert repr(key) in msg and str(path) in msg


@pytest.mark.parametrize("text, key", [
    ("optimizer:\n  lr: -0.001\n", "optimizer.lr"),
    ("optimizer:\n  lr: 0\n", "optimizer.lr"),
    ("model:\n  d_model: 30\n  n_heads: 4\n", "model.n_heads"),
    ("memory:\n  staleness: 2\n", "memory.staleness"),
    ("model:\n  vocab_size: 100\n", "model.vocab_size"),  # the byte tokenizer needs 256
    ("data:\n  tokenizer: bpe\n  bpe_vocab_size: 1024\nmodel:\n  vocab_size: 512\n", "model.vocab_size"),
    ("train:\n  steps: 0\n", "train.steps"),
    ("checkpoint:\n  keep: 0\n", "checkpoint.keep"),
    ("optimizer:\n  b1: 1.0\n", "optimizer.b1"),
    ("memory:\n  page_size: 100\n", "memory.page_size"),
])
def test_impossible_value_in_file_names_key_and_file(tmp_path, text, key):
    path = _write(tmp_path, text)
    msg = _error(path)
    assert repr(key) in msg and str(path) in msg


@pytest.mark.parametrize("override, key", [
    ("train.steps=abc", "train.steps"),
    ("model.d_modle=64", "model.d_modle"),
    ("trian.steps=5", "trian"),
    ("optimizer.lr=-1", "optimizer.lr"),
    ("model.n_heads=3", "model.n_heads"),
    ("memory.staleness=2", "memory.staleness"),
    ("model.vocab_size=255", "model.vocab_size"),
])
def test_bad_override_names_key_and_override(override, key):
    msg = _error(TINY, ["train.steps=5", override])
    assert repr(key) in msg and override in msg and str(TINY) in msg


@pytest.mark.parametrize("text, override, key, instead", [
    ("optimizer:\n  lr: 0.001\n  staleness: 1\n", "optimizer.staleness=1", "optimizer.staleness",
     "'optimizer.staleness' moved to 'memory.staleness'"),
    ("anomaly:\n  thresholds:\n    hang:\n      factor: 5.0\n", "anomaly.thresholds.hang.factor=5",
     "anomaly.thresholds.hang", "resilience.hang_timeout_min, resilience.hang_factor"),
    ("anomaly:\n  actions:\n    hang: log\n", "anomaly.actions.hang=log",
     "anomaly.actions.hang", "resilience.hang_timeout_min, resilience.hang_factor"),
])
def test_retired_key_is_refused_by_name_with_what_to_use_instead(tmp_path, text, override, key, instead):
    path = _write(tmp_path, text)
    for msg, where in ((_error(path), str(path)), (_error(TINY, [override]), override)):
        assert repr(key) in msg and instead in msg and where in msg and "unknown" not in msg


@pytest.mark.parametrize("override", ["train.steps", "train.steps:5", "=5", "train..steps=5", ".steps=5"])
def test_malformed_override(override):
    with pytest.raises(ConfigError) as info:
        parse_override(override)
    assert override in str(info.value)
    assert override in _error(TINY, [override])


def test_missing_file(tmp_path):
    path = tmp_path / "nope.yaml"
    msg = _error(path)
    assert str(path) in msg and "does not exist" in msg


@pytest.mark.parametrize("text", ["- a\n- b\n", "just a string\n", "42\n"])
def test_non_mapping_yaml(tmp_path, text):
    path = _write(tmp_path, text)
    msg = _error(path)
    assert str(path) in msg and "mapping" in msg


def test_invalid_yaml_syntax(tmp_path):
    path = _write(tmp_path, "model: {d_model: 64\n")
    assert str(path) in _error(path)


def test_error_in_file_is_reported_before_overrides_fix_it(tmp_path):
    # The file itself is checked first, so the message points at the file, not at an override.
    path = _write(tmp_path, "model:\n  d_modle: 64\n")
    msg = _error(path, ["model.d_model=64"])
    assert "'model.d_modle'" in msg and str(path) in msg and "override" not in msg


def test_config_error_is_a_value_error():
    assert issubclass(ConfigError, ValueError)


@pytest.mark.parametrize("override", ["optimizer.lr=.nan", "optimizer.lr=.inf", "optimizer.eps=.nan",
                                      "optimizer.weight_decay=.nan", "optimizer.grad_clip=.nan",
                                      "model.mlp_ratio=.nan", "model.mlp_ratio=-.inf",
                                      "anomaly.thresholds.loss_spike.z_threshold=.nan"])
def test_non_finite_floats_are_rejected_everywhere(override):
    key = override.split("=")[0]
    msg = _error(TINY, [override])
    assert f"'{key}'" in msg and "must be a finite number" in msg


@pytest.mark.parametrize("ratio", ["1e300", "1e-9"])
def test_absurd_mlp_ratio_is_rejected_naming_the_width(ratio):
    msg = _error(TINY, [f"model.mlp_ratio={ratio}"])
    assert "'model.mlp_ratio'" in msg and "MLP hidden width" in msg


def test_binary_config_file_is_a_config_error(tmp_path):
    path = tmp_path / "binary.yaml"
    path.write_bytes(b"model:\n  d_model: \xff\xfe\x00\x01\n")
    msg = _error(path)
    assert str(path) in msg and "not a text file" in msg


# ----------------------------------------------------------------------------------------------- describe


def test_describe_lists_every_key_with_a_doc():
    lines = describe()
    keys = _leaf_keys()
    assert len(lines) == len(keys) and len(keys) > 40
    for key, line in zip(keys, lines):
        assert line.startswith(f"{key} ("), line
        head, sep, text = line.partition("): ")
        assert sep and text.strip(), f"{key} has no doc: {line!r}"
    assert "model.d_model (int, default 128): Residual stream width." in lines


def test_every_section_has_a_doc():
    for f in dataclasses.fields(Config):
        assert f.metadata.get("doc"), f.name


# --------------------------------------------------------------------------------------------- resilience


@pytest.mark.parametrize("override, message", [
    ("resilience.hang_factor=0.5", "'resilience.hang_factor'.*must be >= 1"),
    ("resilience.stop_grace=-1", "'resilience.stop_grace'.*must be >= 0"),
    ("resilience.no_progress_limit=-1", "'resilience.no_progress_limit'.*must be >= 0"),
    ("resilience.heartbeat_lost_after=0.5", "'resilience.heartbeat_lost_after'.*longer than heartbeat_interval"),
    ("resilience.slow_phase_timeout=.inf", "'resilience.slow_phase_timeout'.*must be a finite number"),
    ("resilience.exclude_after=two", "'resilience.exclude_after'.*expected int"),
])
def test_resilience_config_validation(override, message):
    with pytest.raises(ConfigError, match=message):
        load_config(None, [override])


def test_a_config_recorded_by_an_earlier_version_is_upgraded(tmp_path):
    """A run directory's config.yaml lists every key as the version that wrote it knew them: a moved key is read
    from its old place, a removed one dropped (so `angel-jax ckpt ls` works on old runs), while the same keys
    in a user's config are refused by name."""
    from angel_jax.config import dump_yaml, load_recorded_config

    raw = yaml.safe_load(dump_yaml(Config()))
    raw["memory"].pop("staleness")
    raw["optimizer"]["staleness"] = 1
    raw["anomaly"]["thresholds"]["hang"] = {"enabled": True, "min_timeout_s": 60.0}
    raw["anomaly"]["actions"] = {"hang": "restart", "loss_spike": "log"}
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(raw))
    cfg = load_recorded_config(path)
    assert cfg.memory.staleness == 1 and cfg.anomaly.actions == {"loss_spike": "log"}
    with pytest.raises(ConfigError, match="was removed|moved to"):
        load_config(path)


@pytest.mark.parametrize("override,suggestion", [
    ("model.d_modle=64", "did you mean 'model.d_model'?"),
    ("traim.steps=3", "did you mean 'train'?"),
    ("optimizer.lr_warmup=5", None),
])
def test_a_misspelt_key_is_answered_with_the_nearest_known_key(override, suggestion):
    with pytest.raises(ConfigError) as e:
        load_config(TINY, [override])
    msg = str(e.value)
    assert ("did you mean" in msg) == (suggestion is not None)
    assert suggestion is None or suggestion in msg
