"""Hugging Face checkpoints in and out (models/hf/), against transformers itself.

The fixtures in tests/fixtures/hf/ were made by transformers (experiments/hf/make_fixtures.py): a tiny GPT-2,
tiny Llamas (plain, with Llama 3.1's RoPE scaling, with a tied head) and a tiny Qwen2 with every tensor perturbed,
and the float32 logits transformers computed for fixed tokens. Imported with model.init_from, our models must give
those logits; exported, our params must come back bit for bit and in HF's own tensor layout (the fixture's
tensors, name for name). No torch is needed here.
"""

from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from flax import nnx
from safetensors import safe_open
from safetensors.numpy import load_file, save_file

import models
from angel_jax.config import Config, ConfigError, MemoryConfig, ModelConfig, OptimizerConfig, TrainConfig
from angel_jax.train.engines import InMemoryEngine
from models import hf, llama

FIXTURES = Path(__file__).parent / "fixtures" / "hf"
NAMES = ("gpt2", "llama", "llama3", "llama_tied", "qwen2")


def fixture_cfg(fixture: str, **changes) -> ModelConfig:
    """The model config of a fixture, float32 compute, starting from it."""
    src = FIXTURES / fixture
    return dataclasses.replace(ModelConfig(**hf.model_fields(src), compute_dtype="float32", init_from=str(src)),
                               **changes)


def _assert_bit_identical(got, want, where: str = "") -> None:
    assert jax.tree.structure(got) == jax.tree.structure(want), where
    for (path, g), w in zip(jax.tree_util.tree_leaves_with_path(got), jax.tree.leaves(want), strict=True):
        name = where + jax.tree_util.keystr(path)
        assert g.dtype == w.dtype and g.shape == w.shape, (name, g.dtype, w.dtype, g.shape, w.shape)
        assert np.array_equal(np.asarray(g), np.asarray(w)), name


def random_params(staged: models.StagedModel, seed: int) -> dict:
    """Every leaf drawn at random (norm scales and biases too, unlike an init), in the model's structure."""
    rng = np.random.default_rng(seed)
    return jax.tree.map(lambda a: rng.normal(size=a.shape).astype(a.dtype), staged.abstract()[1])


def _copy_with(tmp: Path, name: str, config: dict | None = None, tensors: dict | None = None) -> Path:
    """A copy of a fixture with its config.json updated by `config` and/or its tensors replaced by `tensors`."""
    out = tmp / f"{name}-copy"
    shutil.copytree(FIXTURES / name, out)
    if config is not None:
        raw = json.loads((out / "config.json").read_text())
        (out / "config.json").write_text(json.dumps({**raw, **config}))
    if tensors is not None:
        save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    return out


# --------------------------------------------------------------------------------------------- import parity


@pytest.mark.compares_programs
def test_a_llama_checkpoint_trains_at_a_shorter_context_with_the_same_logits():
    # Rotary embeddings have no position table: a shorter model.seq_len is the same model on a shorter window, so
    # its logits are the checkpoint's on the first positions (causal attention: later tokens change nothing).
    ref = np.load(FIXTURES / "llama" / "logits.npz")
    cfg = fixture_cfg("llama", seq_len=16)
    models.check_init_from(cfg)
    graphdef, params = models.get(cfg).init(0)
    logits = np.asarray(jax.jit(lambda p, t: nnx.merge(graphdef, p)(t))(params, ref["tokens"][:, :16]))
    np.testing.assert_allclose(logits, ref["logits"][:, :16], rtol=0, atol=1e-4)


@pytest.mark.compares_programs
@pytest.mark.parametrize("name", NAMES)
def test_imported_model_gives_the_transformers_logits(name):
    ref = np.load(FIXTURES / name / "logits.npz")
    staged = models.get(fixture_cfg(name))
    assert staged.init_reads_files
    graphdef, params = staged.init(0)
    assert all(isinstance(a, np.ndarray) and a.dtype == np.float32 for a in jax.tree.leaves(params))
    logits = np.asarray(jax.jit(lambda p, t: nnx.merge(graphdef, p)(t))(params, ref["tokens"]))
    assert logits.shape == ref["logits"].shape
    np.testing.assert_allclose(logits, ref["logits"], rtol=0, atol=1e-4)
    # Stage by stage (what the paged engine reads): each stage alone, bit-identical to the whole import's split.
    for i, whole in enumerate(staged.split(params)):
        _assert_bit_identical(staged.init_stage(0, i), whole, f"stage {i}")


def test_model_fields_of_the_fixtures():
    assert hf.model_fields(FIXTURES / "gpt2") == {
        "name": "gpt", "vocab_size": 256, "seq_len": 64, "d_model": 48, "n_layers": 2, "n_heads": 4,
        "n_kv_heads": 0, "mlp_hidden": 192, "norm_eps": 1e-5}
    plain = {"rope_scaling": "none", "tie_embeddings": False, "qkv_bias": False, "o_bias": False}
    assert hf.model_fields(FIXTURES / "llama") == {
        "name": "llama", "vocab_size": 256, "seq_len": 64, "d_model": 64, "n_layers": 2, "n_heads": 4,
        "n_kv_heads": 2, "mlp_hidden": 96, "norm_eps": 1e-6, "rope_theta": 50000.0, **plain}
    small = {"name": "llama", "vocab_size": 256, "d_model": 32, "n_layers": 2, "n_heads": 4, "n_kv_heads": 2,
             "mlp_hidden": 64, "norm_eps": 1e-6}
    assert hf.model_fields(FIXTURES / "llama3") == {
        **small, **plain, "seq_len": 512, "rope_theta": 20000.0, "rope_scaling": "llama3", "rope_factor": 4.0,
        "rope_low_freq_factor": 1.0, "rope_high_freq_factor": 4.0, "rope_original_max_positions": 128}
    assert hf.model_fields(FIXTURES / "llama_tied") == {
        **small, **plain, "seq_len": 64, "rope_theta": 10000.0, "tie_embeddings": True}
    assert hf.model_fields(FIXTURES / "qwen2") == {
        **small, **plain, "seq_len": 64, "rope_theta": 1e6, "qkv_bias": True}


def test_the_llama3_fixture_scales_the_frequencies_of_the_positions_tested():
    """Its scaling changes the rotation angles of the tested positions (all three of llama3's cases: a frequency
    kept, one interpolated, two stretched), and the logits: imported without it the model misses transformers'."""
    cfg = fixture_cfg("llama3")
    positions = jnp.arange(np.load(FIXTURES / "llama3" / "logits.npz")["tokens"].shape[1])
    plain = np.asarray(llama.rope_frequencies(8, cfg.rope_theta), np.float64)
    scaled = llama.rope_frequencies(8, cfg.rope_theta, llama.rope_scaling(cfg))
    # Wavelengths 2 pi / f: 6.3 (under 128 / 4: kept), 74.7 (between: interpolated), 889 and 10563 (over 128 / 1:
    # stretched by 4).
    smooth = (128 / (2 * np.pi / plain[1]) - 1) / (4 - 1)
    interpolated = (1 - smooth) * plain[1] / 4 + smooth * plain[1]
    np.testing.assert_allclose(scaled, [plain[0], interpolated, plain[2] / 4, plain[3] / 4], rtol=1e-6)
    plain_cos, scaled_cos = (llama.rope_angles(positions, 8, cfg.rope_theta, s)[0]
                             for s in (None, llama.rope_scaling(cfg)))
    assert np.abs(plain_cos - scaled_cos).max() > 0.5  # the rotations of the positions tested differ
    ref = np.load(FIXTURES / "llama3" / "logits.npz")
    graphdef, params = models.get(cfg).init(0)
    unscaled = models.get(dataclasses.replace(cfg, rope_scaling="none", init_from="")).abstract()[0]
    logits = np.asarray(jax.jit(lambda p, t: nnx.merge(unscaled, p)(t))(params, ref["tokens"]))
    assert np.abs(logits - ref["logits"]).max() > 1e-2


# --------------------------------------------------------------------------------------------- export


@pytest.mark.parametrize("cfg", [
    ModelConfig(name="gpt", d_model=32, n_layers=2, n_heads=4, seq_len=16, mlp_hidden=48, norm_eps=1e-6),
    ModelConfig(name="llama", d_model=32, n_layers=2, n_heads=4, n_kv_heads=1, seq_len=16, mlp_hidden=80,
                rope_theta=5e5),
    ModelConfig(name="llama", d_model=32, n_layers=2, n_heads=2, seq_len=16, param_dtype="bfloat16"),
    ModelConfig(name="llama", d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, seq_len=16, mlp_hidden=48,
                tie_embeddings=True, qkv_bias=True, o_bias=True, rope_scaling="llama3", rope_factor=8.0,
                rope_original_max_positions=64),
    ModelConfig(name="llama", d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, seq_len=16, qkv_bias=True),
], ids=["gpt", "llama-gqa", "llama-bf16", "llama-tied-biased-llama3", "qwen2"])
def test_export_then_import_gives_the_params_bit_for_bit(cfg, tmp_path):
    staged = models.get(cfg)
    params = random_params(staged, seed=7)
    hf.export(cfg, staged.split(params), tmp_path)
    raw = json.loads((tmp_path / "config.json").read_text())
    # q/k/v biases alone are Qwen2's; Llama's attention_bias biases o too.
    model_type = "qwen2" if cfg.qkv_bias and not cfg.o_bias else {"gpt": "gpt2", "llama": "llama"}[cfg.name]
    assert raw["model_type"] == model_type and raw["tie_word_embeddings"] is cfg.tie_embeddings
    assert raw["architectures"] == [{"gpt2": "GPT2LMHeadModel", "llama": "LlamaForCausalLM",
                                     "qwen2": "Qwen2ForCausalLM"}[model_type]]
    assert raw["torch_dtype"] == raw["dtype"] == cfg.param_dtype
    # What transformers needs to build the model: every architecture key, as config.json states it.
    fields = hf.model_fields(tmp_path)
    for key, value in fields.items():
        if key == "n_kv_heads":  # 0 (GPT-2: one per query head) or the number
            assert (value or cfg.n_heads) == cfg.kv_heads
        else:
            assert value == {"mlp_hidden": cfg.hidden}.get(key, getattr(cfg, key)), key
    with safe_open(str(tmp_path / "model.safetensors"), framework="numpy") as f:
        assert f.metadata() == {"format": "pt"}
        assert ("lm_head.weight" in f.keys()) is not cfg.tie_embeddings  # tied: the embedding alone
        assert ("model.layers.1.self_attn.v_proj.bias" in f.keys()) is cfg.qkv_bias
        assert ("model.layers.1.self_attn.o_proj.bias" in f.keys()) is cfg.o_bias
        assert {f.get_slice(k).get_dtype() for k in f.keys()} == {"F32" if cfg.param_dtype == "float32" else "BF16"}
    back = models.get(dataclasses.replace(cfg, init_from=str(tmp_path))).init(0)[1]
    _assert_bit_identical(back, params)


@pytest.mark.parametrize("name", NAMES)
def test_an_import_exports_as_the_checkpoint_it_came_from(name, tmp_path):
    """Export writes HF's own layout: every tensor of the fixture, under its name, bit for bit (GPT-2's tied head
    comes out as its own lm_head.weight, equal to wte; the tied Llama's stays the embedding alone), and the
    architecture of its config.json; imported again, the same parameters."""
    cfg = fixture_cfg(name)
    staged = models.get(cfg)
    params = staged.init(0)[1]
    hf.export(cfg, staged.split(params), tmp_path)
    original, exported = load_file(str(FIXTURES / name / "model.safetensors")), load_file(str(tmp_path / "model.safetensors"))
    if name == "gpt2":
        original["lm_head.weight"] = original["transformer.wte.weight"]
    assert sorted(exported) == sorted(original)
    for key in original:
        assert exported[key].dtype == original[key].dtype and np.array_equal(exported[key], original[key]), key
    assert hf.model_fields(tmp_path) == hf.model_fields(FIXTURES / name)
    raw, fixture = (json.loads((d / "config.json").read_text()) for d in (tmp_path, FIXTURES / name))
    same = ("model_type", "architectures") + (("tie_word_embeddings", "rope_parameters", "attention_bias")
                                               if name != "gpt2" else ())  # our GPT's head is untied
    for key in same:
        assert raw.get(key) == fixture.get(key), key
    _assert_bit_identical(models.get(dataclasses.replace(cfg, init_from=str(tmp_path))).init(0)[1], params)


@pytest.mark.compares_programs
def test_a_tied_model_stays_tied_through_training_and_export(tmp_path):
    """Three AdamW steps of the in-memory engine from the tied fixture: the head has no matrix of its own, the
    embedding rows of ids no input holds move (only the head's use reaches them: its gradient goes to the one
    matrix), and the export stores the embedding alone, as a tied checkpoint, which transformers' tie (and our
    import untied) reads as a head equal to the trained embedding."""
    model = fixture_cfg("llama_tied", seq_len=16)
    cfg = Config(model=model, optimizer=OptimizerConfig(lr=1e-2, warmup_steps=0, weight_decay=0.0),
                 train=TrainConfig(steps=3, batch_size=2), memory=MemoryConfig(mode="in_memory"))
    engine = InMemoryEngine(cfg, jax.make_mesh((1,), ("data",), axis_types=(jax.sharding.AxisType.Auto,)))
    batches = np.random.default_rng(0).integers(0, 128, (3, 2, model.seq_len + 1)).astype(np.int32)
    try:
        before = engine.params()
        losses = [float(engine.step(jnp.asarray(b))["loss"]) for b in batches]
        params = engine.params()
    finally:
        engine.close()
    assert np.isfinite(losses).all() and set(params["head"]) == {"norm"}
    start, trained = before["embed"]["tokens"]["embedding"], params["embed"]["tokens"]["embedding"]
    assert (trained[128:] != start[128:]).mean() > 0.99  # ids 128..255 are never inputs, only outputs

    staged = models.get(model)
    hf.export(model, staged.split(params), tmp_path / "out")
    raw = json.loads((tmp_path / "out" / "config.json").read_text())
    assert raw["tie_word_embeddings"] is True
    exported = load_file(str(tmp_path / "out" / "model.safetensors"))
    assert "lm_head.weight" not in exported
    np.testing.assert_array_equal(exported["model.embed_tokens.weight"], trained)
    _assert_bit_identical(models.get(dataclasses.replace(model, init_from=str(tmp_path / "out"))).init(0)[1], params)
    untied = models.get(dataclasses.replace(model, init_from=str(tmp_path / "out"), tie_embeddings=False)).init(0)[1]
    np.testing.assert_array_equal(untied["head"]["unembed"]["kernel"], trained.T)


def test_export_dtype_and_refusals(tmp_path):
    cfg = fixture_cfg("llama")
    stages = models.get(cfg).split(models.get(cfg).init(0)[1])
    hf.export(cfg, stages, tmp_path / "bf16", dtype="bfloat16")
    assert json.loads((tmp_path / "bf16" / "config.json").read_text())["torch_dtype"] == "bfloat16"
    # Read back into float32 parameters: the values rounded to bfloat16, nothing else.
    back = models.get(dataclasses.replace(cfg, init_from=str(tmp_path / "bf16"))).init(0)[1]
    want = models.get(cfg).merge(stages)
    for a, b in zip(jax.tree.leaves(back), jax.tree.leaves(want), strict=True):
        assert a.dtype == np.float32
        np.testing.assert_array_equal(a, np.asarray(b).astype(ml_dtypes.bfloat16).astype(np.float32))
    with pytest.raises(hf.CheckpointFileError, match="already holds config.json and model.safetensors"):
        hf.export(cfg, stages, tmp_path / "bf16")
    hf.export(cfg, stages, tmp_path / "bf16", overwrite=True)
    with pytest.raises(ConfigError, match="export dtype 'int8'"):
        hf.export(cfg, stages, tmp_path / "other", dtype="int8")
    o_only = ModelConfig(name="llama", d_model=32, n_layers=1, n_heads=2, seq_len=16, o_bias=True)
    with pytest.raises(ConfigError, match="'model.o_bias' without 'model.qkv_bias' has no Hugging Face"):
        hf.export(o_only, models.get(o_only).split(random_params(models.get(o_only), 0)), tmp_path / "o")


# --------------------------------------------------------------------------------------------- checkpoint forms


def test_checkpoint_variants_import_the_same_params(tmp_path):
    """Checkpoints as they come: a bare GPT2Model (no `transformer.` prefix), a Llama with a tied head (no
    lm_head.weight), bfloat16 tensors, and shards named by model.safetensors.index.json."""
    gpt2 = load_file(str(FIXTURES / "gpt2" / "model.safetensors"))
    llama = load_file(str(FIXTURES / "llama" / "model.safetensors"))
    want_gpt2 = models.get(fixture_cfg("gpt2")).init(0)[1]
    want_llama = models.get(fixture_cfg("llama")).init(0)[1]

    bare = _copy_with(tmp_path / "bare", "gpt2", tensors={k.removeprefix("transformer."): v for k, v in gpt2.items()})
    _assert_bit_identical(models.get(fixture_cfg("gpt2", init_from=str(bare))).init(0)[1], want_gpt2)

    tied = {k: v for k, v in llama.items() if k != "lm_head.weight"}
    tied_dir = _copy_with(tmp_path / "tied", "llama", config={"tie_word_embeddings": True}, tensors=tied)
    got = models.get(fixture_cfg("llama", init_from=str(tied_dir))).init(0)[1]
    np.testing.assert_array_equal(got["head"]["unembed"]["kernel"], llama["model.embed_tokens.weight"].T)
    np.testing.assert_array_equal(got["blocks"]["q"]["kernel"], want_llama["blocks"]["q"]["kernel"])

    bf16_dir = _copy_with(tmp_path / "bf16", "llama",
                          tensors={k: v.astype(ml_dtypes.bfloat16) for k, v in llama.items()})
    got = models.get(fixture_cfg("llama", init_from=str(bf16_dir))).init(0)[1]
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want_llama), strict=True):
        np.testing.assert_array_equal(a, b.astype(ml_dtypes.bfloat16).astype(np.float32))

    sharded = _copy_with(tmp_path / "sharded", "llama")
    (sharded / "model.safetensors").unlink()
    names = sorted(llama)
    halves = {"model-00001-of-00002.safetensors": names[::2], "model-00002-of-00002.safetensors": names[1::2]}
    for file, keys in halves.items():
        save_file({k: llama[k] for k in keys}, str(sharded / file), metadata={"format": "pt"})
    (sharded / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {}, "weight_map": {k: file for file, keys in halves.items() for k in keys}}))
    _assert_bit_identical(models.get(fixture_cfg("llama", init_from=str(sharded))).init(0)[1], want_llama)


# --------------------------------------------------------------------------------------------- errors


@pytest.mark.parametrize("name, change, named", [
    ("gpt2", {"activation_function": "relu"}, "activation_function='relu' is not supported"),
    ("gpt2", {"scale_attn_by_inverse_layer_idx": True}, "scale_attn_by_inverse_layer_idx=True is not supported"),
    ("gpt2", {"add_cross_attention": True}, "add_cross_attention=True is not supported"),
    ("gpt2", {"n_head": 5}, "n_embd=48 is not divisible by n_head=5"),
    ("llama", {"rope_scaling": {"rope_type": "linear", "factor": 2.0}},
     "rope_scaling.rope_type='linear' is not supported"),
    ("llama", {"rope_scaling": {"type": "dynamic", "factor": 2.0}}, "rope_scaling.rope_type='dynamic'"),
    ("llama", {"rope_parameters": {"rope_type": "yarn", "rope_theta": 5e5, "factor": 8.0}},
     "rope_parameters.rope_type='yarn' is not supported"),
    ("llama", {"rope_parameters": {"rope_type": "llama3", "rope_theta": 5e5, "factor": 8.0}},
     "'rope_parameters.low_freq_factor' must be a finite number > 0, got None"),
    ("llama3", {"rope_parameters": {"full_attention": {"rope_type": "default"}}}, "not one per layer type"),
    ("llama", {"partial_rotary_factor": 0.5}, "partial_rotary_factor=0.5 is not supported"),
    ("llama", {"attention_bias": "yes"}, "attention_bias='yes' is not supported"),
    ("llama", {"mlp_bias": True}, "mlp_bias=True is not supported"),
    ("qwen2", {"use_sliding_window": True}, "use_sliding_window=True is not supported"),
    ("qwen2", {"layer_types": ["full_attention", "sliding_attention"]}, "layer_types=.* is not supported"),
    ("llama", {"hidden_act": "gelu"}, "hidden_act='gelu' is not supported"),
    ("llama", {"head_dim": 32}, "head_dim=32 is not supported"),
    ("llama", {"num_hidden_layers": "2"}, "'num_hidden_layers' must be an integer"),
    ("llama", {"model_type": "mistral"}, "model_type='mistral' is not supported"),
])
def test_unsupported_hf_settings_are_refused_by_key(name, change, named, tmp_path):
    src = _copy_with(tmp_path, name, config=change)
    with pytest.raises(ConfigError, match=named) as err:
        hf.model_fields(src)
    assert str(src / "config.json") in str(err.value)
    with pytest.raises(ConfigError, match=named):  # and training from it is refused before anything is read
        models.check_init_from(fixture_cfg(name, init_from=str(src)))


@pytest.mark.parametrize("name, change, named", [
    ("gpt2", {"d_model": 64, "n_heads": 4}, "'model.d_model'=64 differs from n_embd=48"),
    ("gpt2", {"seq_len": 32}, "'model.seq_len'=32 differs from n_positions=64"),
    ("gpt2", {"mlp_hidden": 0, "mlp_ratio": 2.0}, "'model.mlp_hidden'=96 differs from n_inner=192"),
    ("llama", {"n_kv_heads": 4}, "'model.n_kv_heads'=4 differs from num_key_value_heads=2"),
    ("llama", {"norm_eps": 1e-5}, "'model.norm_eps'=1e-05 differs from rms_norm_eps=1e-06"),
    ("llama", {"rope_theta": 10000.0}, "'model.rope_theta'=10000.0 differs from rope_theta=50000.0"),
    ("llama", {"name": "gpt"}, "'model.name'='gpt' differs from model_type='llama' -> 'llama'"),
    ("llama", {"seq_len": 128}, "'model.seq_len'=128 exceeds max_position_embeddings=64"),
    ("llama", {"rope_scaling": "llama3"}, "'model.rope_scaling'='llama3' differs from rope_parameters.rope_type"),
    ("llama3", {"rope_factor": 8.0}, "'model.rope_factor'=8.0 differs from rope_parameters.factor=4.0"),
    ("llama3", {"rope_original_max_positions": 8192},
     "'model.rope_original_max_positions'=8192 differs from rope_parameters.original_max_position_embeddings=128"),
    ("llama", {"tie_embeddings": True}, "'model.tie_embeddings'=True differs from tie_word_embeddings=False"),
    ("qwen2", {"qkv_bias": False}, "'model.qkv_bias'=False differs from attention_bias=True"),
    ("llama", {"qkv_bias": True, "o_bias": True}, "'model.qkv_bias'=True differs from attention_bias=False"),
])
def test_an_architecture_that_differs_from_the_checkpoint_is_refused_naming_the_key(name, change, named):
    cfg = fixture_cfg(name, **change)
    with pytest.raises(ConfigError, match=named):
        models.check_init_from(cfg)
    with pytest.raises(ConfigError, match=named):  # init and init_stage check too (the engines call them)
        models.get(cfg).init_stage(0, 1)


def test_missing_or_broken_files_are_named(tmp_path):
    with pytest.raises(hf.CheckpointFileError, match="no such directory"):
        models.check_init_from(fixture_cfg("gpt2", init_from=str(tmp_path / "nowhere")))
    no_config = _copy_with(tmp_path / "a", "gpt2")
    (no_config / "config.json").unlink()
    with pytest.raises(hf.CheckpointFileError, match="no config.json"):
        models.check_init_from(fixture_cfg("gpt2", init_from=str(no_config)))
    no_weights = _copy_with(tmp_path / "b", "gpt2")
    (no_weights / "model.safetensors").unlink()
    with pytest.raises(hf.CheckpointFileError, match="no model.safetensors"):
        models.check_init_from(fixture_cfg("gpt2", init_from=str(no_weights)))
    garbled = _copy_with(tmp_path / "c", "gpt2")
    (garbled / "model.safetensors").write_bytes(b"not a safetensors file")
    with pytest.raises(hf.CheckpointFileError, match="not a readable safetensors file"):
        models.check_init_from(fixture_cfg("gpt2", init_from=str(garbled)))
    bad_json = _copy_with(tmp_path / "d", "gpt2")
    (bad_json / "config.json").write_text("{model_type: gpt2")
    with pytest.raises(ConfigError, match="not a readable JSON file"):
        hf.model_fields(bad_json)

    gpt2 = load_file(str(FIXTURES / "gpt2" / "model.safetensors"))
    lacking = _copy_with(tmp_path / "e", "gpt2", tensors={k: v for k, v in gpt2.items() if "h.1.mlp.c_fc.bias" not in k})
    staged = models.get(fixture_cfg("gpt2", init_from=str(lacking)))
    staged.init_stage(0, 1)  # block 0 is all there: the stage reads only its own tensors
    with pytest.raises(hf.CheckpointFileError, match=r"no tensor 'transformer.h.1.mlp.c_fc.bias' .*\[192\]"):
        staged.init_stage(0, 2)
    misshapen = _copy_with(tmp_path / "f", "gpt2", tensors={**gpt2, "transformer.wpe.weight": np.zeros((32, 48), np.float32)})
    with pytest.raises(hf.CheckpointFileError, match=r"'transformer.wpe.weight' has shape \[32, 48\].*\[64, 48\]"):
        models.get(fixture_cfg("gpt2", init_from=str(misshapen))).init(0)


def test_a_tensor_is_read_only_as_finite_floats(tmp_path):
    """Each tensor as it is read: a bool or integer dtype is refused from the header, before its bytes are read;
    an infinity is found in float16; float64 values whose sum overflows but are all finite pass."""
    directory = tmp_path / "ckpt"
    directory.mkdir()
    huge = np.full((4,), 1e308)
    half = np.ones((2, 3), np.float16)
    half[1, 2] = -np.inf
    save_file({"mask": np.ones((2, 2), bool), "huge": huge, "half": half, "fine": np.ones(3, np.float32)},
              str(directory / "model.safetensors"))
    files = hf.CheckpointTensors(directory)
    with pytest.raises(hf.CheckpointFileError, match=r"model.safetensors: tensor 'mask' is stored as BOOL, not a "
                                                     r"floating-point type"):
        files.get("mask", (2, 2))
    assert np.array_equal(files.get("huge", (4,)), huge)  # 4e308: its sum is infinite, its values are not
    with pytest.raises(hf.CheckpointFileError, match=r"tensor 'half' holds 1 non-finite values \(0 NaN, 1 infinite; "
                                                     r"the first at index \[1, 2\]\)"):
        files.get("half", (2, 3))
    assert files.get("fine", (3,)).dtype == np.float32
