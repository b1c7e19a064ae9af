"""Llama (transformers' `LlamaForCausalLM`) and Qwen2 (`Qwen2ForCausalLM`) <-> our Llama (models/llama.py):
config.json fields and tensor tables.

Our Llama is laid out after HF's module for module (RMSNorm, RoPE in HF's rotate_half convention, grouped-query
attention, SwiGLU), so the tensors map one to one: each torch nn.Linear weight ([out, in]) is our kernel
transposed, nothing is permuted. Qwen2 is the same decoder with biases on q, k and v (none on o); Llama's
`attention_bias` puts one on all four: our model.qkv_bias and model.o_bias. Export writes a model with q/k/v
biases alone as Qwen2ForCausalLM, any other as LlamaForCausalLM.

A checkpoint with tie_word_embeddings stores no lm_head.weight: imported with model.tie_embeddings (what
`model_fields` gives) the head keeps using the embedding, and export writes no lm_head.weight either,
tie_word_embeddings true; with model.tie_embeddings false the embedding is copied into a separate head.

Both spellings of the RoPE settings are read: transformers 5's `rope_parameters` ({rope_type, rope_theta, ...})
and 4.x's top-level `rope_theta` / `rope_scaling` (which transformers 5 also lets win when both are set); export
writes both. Plain RoPE ("default") and Llama 3.1's "llama3" scaling are computed here; any other scaling
(linear, dynamic, yarn, ...) is refused, naming the key.
"""

from __future__ import annotations

from typing import Any

from angel_jax.config import ConfigError, ModelConfig
from models.hf.mapping import HFConfig, Tensor

MODEL_TYPE = "llama"
QWEN2 = "qwen2"
MODEL_TYPES = (MODEL_TYPE, QWEN2)
"""The config.json model_types this module maps."""
FAMILY = "llama"
PREFIX = "model."
"""LlamaForCausalLM stores the base model under this prefix; a bare LlamaModel checkpoint without it."""

DEFAULTS = {"vocab_size": 32000, "hidden_size": 4096, "intermediate_size": 11008, "num_hidden_layers": 32,
            "num_attention_heads": 32, "max_position_embeddings": 2048, "rms_norm_eps": 1e-6, "hidden_act": "silu",
            "attention_bias": False, "mlp_bias": False, "rope_theta": 10000.0, "tie_word_embeddings": False}
"""transformers' LlamaConfig defaults, for keys a config.json leaves out."""
QWEN2_DEFAULTS = {"vocab_size": 151936, "hidden_size": 4096, "intermediate_size": 22016, "num_hidden_layers": 32,
                  "num_attention_heads": 32, "max_position_embeddings": 32768, "rms_norm_eps": 1e-6,
                  "hidden_act": "silu", "rope_theta": 10000.0, "tie_word_embeddings": False,
                  "use_sliding_window": False}
"""transformers' Qwen2Config defaults."""

HF_KEYS = {"vocab_size": "vocab_size", "seq_len": "max_position_embeddings", "d_model": "hidden_size",
           "n_layers": "num_hidden_layers", "n_heads": "num_attention_heads", "n_kv_heads": "num_key_value_heads",
           "mlp_hidden": "intermediate_size", "norm_eps": "rms_norm_eps", "rope_theta": "rope_theta",
           "rope_scaling": "rope_parameters.rope_type", "rope_factor": "rope_parameters.factor",
           "rope_low_freq_factor": "rope_parameters.low_freq_factor",
           "rope_high_freq_factor": "rope_parameters.high_freq_factor",
           "rope_original_max_positions": "rope_parameters.original_max_position_embeddings",
           "tie_embeddings": "tie_word_embeddings", "qkv_bias": "attention_bias", "o_bias": "attention_bias"}
"""Our model.* key -> the config.json key it comes from (Qwen2 always has q/k/v biases and no o bias)."""

AT_MOST = ("seq_len", "tie_embeddings")
"""Keys a config may set below the checkpoint's value: rotary embeddings have no table of positions, so the same
weights train and sample at a shorter context (e.g. Llama-2 7B, 4096 positions, fine-tuned at 1024); a tied head
may be untied (model.tie_embeddings false: the head starts as a copy of the embedding and trains apart)."""

LLAMA3_KEYS = {"rope_factor": "factor", "rope_low_freq_factor": "low_freq_factor",
               "rope_high_freq_factor": "high_freq_factor"}
"""Our llama3 RoPE keys -> the HF rope parameter each is read from (and original_max_position_embeddings)."""


def _rope_spec(raw: dict, where: str) -> tuple[str, dict]:
    """(the config.json key, its dict) that holds the RoPE settings: `rope_scaling` when set (transformers 5 lets
    it win over `rope_parameters`, 4.x reads only it), else `rope_parameters` ({} when neither is)."""
    for key in ("rope_scaling", "rope_parameters"):
        spec = raw.get(key)
        if spec is None or spec == {}:
            continue
        if not isinstance(spec, dict) or any(isinstance(v, dict) for v in spec.values()):
            raise ConfigError(f"{where}: {key}={spec!r} is not supported (supported: a single {{rope_type: "
                              "default or llama3, rope_theta: ...}, not one per layer type)")
        return key, spec
    return "rope_parameters", {}


def _rope(raw: dict, hf: HFConfig, where: str) -> dict[str, Any]:
    """Our rope_* fields: the base and, for llama3, its scaling; other scalings and partial rotary are refused."""
    key, spec = _rope_spec(raw, where)
    rope_type = spec.get("rope_type", spec.get("type", "default"))
    if rope_type not in ("default", "llama3"):
        raise ConfigError(f"{where}: {key}.rope_type={rope_type!r} is not supported (supported: default, llama3)")
    partial = spec.get("partial_rotary_factor", raw.get("partial_rotary_factor", 1.0))
    if partial != 1.0:
        raise ConfigError(f"{where}: partial_rotary_factor={partial!r} is not supported (supported: 1.0)")
    theta = spec.get("rope_theta", raw.get("rope_theta"))
    fields: dict[str, Any] = {"rope_theta": hf.float("rope_theta") if theta is None
                              else HFConfig({"rope_theta": theta}, {}, where).float("rope_theta"),
                              "rope_scaling": "none" if rope_type == "default" else "llama3"}
    if rope_type == "llama3":
        named = HFConfig({f"{key}.{k}": v for k, v in spec.items()}, {}, where)
        fields.update({ours: named.float(f"{key}.{theirs}") for ours, theirs in LLAMA3_KEYS.items()})
        # As transformers: a top-level value first (Phi-3 style), then the rope dict's, then the context length.
        original = raw.get("original_max_position_embeddings", spec.get("original_max_position_embeddings"))
        fields["rope_original_max_positions"] = (hf.int("max_position_embeddings") if original is None else
                                                 HFConfig({f"{key}.original_max_position_embeddings": original}, {},
                                                          where).int(f"{key}.original_max_position_embeddings"))
    return fields


def _qwen2_checks(raw: dict, hf: HFConfig, where: str) -> None:
    """Qwen2's sliding-window attention is not computed here: every layer must attend to the full context."""
    hf.require("use_sliding_window", lambda v: v is False, "false")
    layer_types = raw.get("layer_types")
    if layer_types is not None and any(t != "full_attention" for t in layer_types):
        raise ConfigError(f"{where}: layer_types={layer_types!r} is not supported (supported: full_attention "
                          "for every layer)")


def model_fields(raw: dict, where: str) -> dict[str, Any]:
    """Our ModelConfig's architecture fields from a Llama or Qwen2 config.json; a setting our Llama does not
    compute is refused, naming the HF key."""
    qwen2 = raw.get("model_type") == QWEN2
    hf = HFConfig(raw, QWEN2_DEFAULTS if qwen2 else DEFAULTS, where)
    hf.require("hidden_act", lambda v: v == "silu", "silu")
    if qwen2:
        _qwen2_checks(raw, hf, where)
        qkv_bias, o_bias = True, False
    else:
        hf.require("attention_bias", lambda v: isinstance(v, bool), "true or false")
        hf.require("mlp_bias", lambda v: v is False, "false")
        qkv_bias = o_bias = hf.value("attention_bias")
    hf.require("tie_word_embeddings", lambda v: isinstance(v, bool), "true or false")
    d, heads = hf.int("hidden_size"), hf.int("num_attention_heads")
    if d % heads:
        raise ConfigError(f"{where}: hidden_size={d} is not divisible by num_attention_heads={heads}")
    if raw.get("head_dim") is not None and raw["head_dim"] != d // heads:
        raise ConfigError(f"{where}: head_dim={raw['head_dim']!r} is not supported (supported: hidden_size / "
                          f"num_attention_heads = {d // heads})")
    kv = hf.int("num_key_value_heads") if raw.get("num_key_value_heads") is not None else heads
    if heads % kv:
        raise ConfigError(f"{where}: num_key_value_heads={kv} does not divide num_attention_heads={heads}")
    return {"name": FAMILY, "vocab_size": hf.int("vocab_size"), "seq_len": hf.int("max_position_embeddings"),
            "d_model": d, "n_layers": hf.int("num_hidden_layers"), "n_heads": heads, "n_kv_heads": kv,
            "mlp_hidden": hf.int("intermediate_size"), "norm_eps": hf.float("rms_norm_eps"),
            **_rope(raw, hf, where), "tie_embeddings": hf.value("tie_word_embeddings"), "qkv_bias": qkv_bias,
            "o_bias": o_bias}


def _model_type(cfg: ModelConfig) -> str:
    """The HF architecture our Llama is exported as: Qwen2 has q/k/v biases without o's, Llama all or none."""
    if cfg.qkv_bias and not cfg.o_bias:
        return QWEN2
    if cfg.o_bias and not cfg.qkv_bias:
        raise ConfigError("'model.o_bias' without 'model.qkv_bias' has no Hugging Face architecture (Llama's "
                          "attention_bias biases q, k, v and o; Qwen2 biases q, k and v): it cannot be exported")
    return MODEL_TYPE


def _rope_config(cfg: ModelConfig) -> dict[str, Any]:
    """The RoPE keys of config.json in both spellings (4.x: rope_theta + rope_scaling; 5: rope_parameters)."""
    scaling = None
    if cfg.rope_scaling == "llama3":
        scaling = {"rope_type": "llama3", "factor": cfg.rope_factor, "low_freq_factor": cfg.rope_low_freq_factor,
                   "high_freq_factor": cfg.rope_high_freq_factor,
                   "original_max_position_embeddings": cfg.rope_original_max_positions}
    return {"rope_theta": cfg.rope_theta, "rope_scaling": scaling,
            "rope_parameters": {**(scaling or {"rope_type": "default"}), "rope_theta": cfg.rope_theta}}


def hf_config(cfg: ModelConfig) -> dict[str, Any]:
    """The config.json of our Llama as a LlamaForCausalLM, or a Qwen2ForCausalLM with q/k/v biases alone."""
    model_type = _model_type(cfg)
    common = {"vocab_size": cfg.vocab_size, "hidden_size": cfg.d_model, "intermediate_size": cfg.hidden,
              "num_hidden_layers": cfg.n_layers, "num_attention_heads": cfg.n_heads,
              "num_key_value_heads": cfg.kv_heads, "head_dim": cfg.d_model // cfg.n_heads,
              "max_position_embeddings": cfg.seq_len, "rms_norm_eps": cfg.norm_eps, "hidden_act": "silu",
              **_rope_config(cfg), "tie_word_embeddings": cfg.tie_embeddings}
    if model_type == QWEN2:
        return {"architectures": ["Qwen2ForCausalLM"], "model_type": QWEN2, **common, "use_sliding_window": False}
    return {"architectures": ["LlamaForCausalLM"], "model_type": MODEL_TYPE, **common,
            "attention_bias": cfg.qkv_bias, "mlp_bias": False}


def tensor_table(cfg: ModelConfig, stage: int) -> list[Tensor]:
    """Stage `stage`'s tensors (0 = embed, 1 + j = block j, n_layers + 1 = head)."""
    if stage == 0:
        return [Tensor(("tokens", "embedding"), (PREFIX + "embed_tokens.weight",))]
    if stage <= cfg.n_layers:
        layer = f"{PREFIX}layers.{stage - 1}."
        norms = [Tensor(("attn_norm", "scale"), (layer + "input_layernorm.weight",)),
                 Tensor(("mlp_norm", "scale"), (layer + "post_attention_layernorm.weight",))]
        linears = [("q", "self_attn.q_proj"), ("k", "self_attn.k_proj"), ("v", "self_attn.v_proj"),
                   ("o", "self_attn.o_proj"), ("gate", "mlp.gate_proj"), ("up", "mlp.up_proj"),
                   ("down", "mlp.down_proj")]
        biased = {"q", "k", "v"} if cfg.qkv_bias else set()
        biased |= {"o"} if cfg.o_bias else set()
        return (norms + [Tensor((ours, "kernel"), (layer + theirs + ".weight",), transposed=True)
                         for ours, theirs in linears]
                + [Tensor((ours, "bias"), (layer + theirs + ".bias",)) for ours, theirs in linears if ours in biased])
    if cfg.tie_embeddings:  # the head unembeds with the embedding stage's matrix: nothing of its own to store
        return [Tensor(("norm", "scale"), (PREFIX + "norm.weight",))]
    return [Tensor(("norm", "scale"), (PREFIX + "norm.weight",)),
            # Untied: lm_head.weight; a tied checkpoint imported untied: only the embedding is stored.
            Tensor(("unembed", "kernel"), ("lm_head.weight", PREFIX + "embed_tokens.weight"), transposed=True)]
