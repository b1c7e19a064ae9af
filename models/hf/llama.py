"""Llama (transformers' `LlamaForCausalLM`) <-> our Llama (models/llama.py): config.json fields and tensor tables.

Our Llama is laid out after HF's module for module (RMSNorm, RoPE in HF's rotate_half convention, grouped-query
attention, SwiGLU, no biases), so the tensors map one to one: each torch nn.Linear weight ([out, in]) is our
kernel transposed, nothing is permuted. A checkpoint with tie_word_embeddings stores no lm_head.weight: import
copies the embedding into our separate head; export always writes lm_head.weight, tie_word_embeddings false.

Both spellings of the RoPE settings are read: transformers 5's `rope_parameters` ({rope_type, rope_theta}) and
4.x's top-level `rope_theta` / `rope_scaling`; export writes both. Only the plain ("default") RoPE is computed
here: any scaling (linear, dynamic, yarn, llama3, ...) is refused, naming the key.
"""

from __future__ import annotations

from typing import Any

from angel_jax.config import ConfigError, ModelConfig
from models.hf.mapping import HFConfig, Tensor

MODEL_TYPE = "llama"
FAMILY = "llama"
PREFIX = "model."
"""LlamaForCausalLM stores the base model under this prefix; a bare LlamaModel checkpoint without it."""

DEFAULTS = {"vocab_size": 32000, "hidden_size": 4096, "intermediate_size": 11008, "num_hidden_layers": 32,
            "num_attention_heads": 32, "max_position_embeddings": 2048, "rms_norm_eps": 1e-6, "hidden_act": "silu",
            "attention_bias": False, "mlp_bias": False, "rope_theta": 10000.0}
"""transformers' LlamaConfig defaults, for keys a config.json leaves out."""

HF_KEYS = {"vocab_size": "vocab_size", "seq_len": "max_position_embeddings", "d_model": "hidden_size",
           "n_layers": "num_hidden_layers", "n_heads": "num_attention_heads", "n_kv_heads": "num_key_value_heads",
           "mlp_hidden": "intermediate_size", "norm_eps": "rms_norm_eps", "rope_theta": "rope_theta"}
"""Our model.* key -> the config.json key it comes from."""

AT_MOST = ("seq_len",)
"""Keys a config may set below the checkpoint's value: rotary embeddings have no table of positions, so the same
weights train and sample at a shorter context (e.g. Llama-2 7B, 4096 positions, fine-tuned at 1024)."""


def _rope(raw: dict, hf: HFConfig, where: str) -> float:
    """The RoPE base; scaled or partial rotary embeddings are refused."""
    params = raw.get("rope_parameters")
    if params is not None:
        if not isinstance(params, dict) or "rope_type" not in params and "rope_theta" not in params:
            raise ConfigError(f"{where}: rope_parameters={params!r} is not supported (supported: a single "
                              "{rope_type: default, rope_theta: ...}, not one per layer type)")
        if params.get("rope_type", "default") != "default":
            raise ConfigError(f"{where}: rope_parameters.rope_type={params['rope_type']!r} is not supported "
                              "(supported: default; scaled RoPE is not computed here)")
        if params.get("partial_rotary_factor", 1.0) != 1.0:
            raise ConfigError(f"{where}: rope_parameters.partial_rotary_factor={params['partial_rotary_factor']!r} "
                              "is not supported (supported: 1.0)")
    scaling = raw.get("rope_scaling")
    if scaling is not None and not (isinstance(scaling, dict)
                                    and scaling.get("rope_type", scaling.get("type")) == "default"):
        raise ConfigError(f"{where}: rope_scaling={scaling!r} is not supported (supported: null; scaled RoPE is not "
                          "computed here)")
    theta = (params or {}).get("rope_theta", raw.get("rope_theta"))
    if theta is None:
        return hf.float("rope_theta")  # transformers' default
    return HFConfig({"rope_theta": theta}, {}, where).float("rope_theta")


def model_fields(raw: dict, where: str) -> dict[str, Any]:
    """Our ModelConfig's architecture fields from a Llama config.json; a setting our Llama does not compute is
    refused, naming the HF key."""
    hf = HFConfig(raw, DEFAULTS, where)
    hf.require("hidden_act", lambda v: v == "silu", "silu")
    hf.require("attention_bias", lambda v: v is False, "false")
    hf.require("mlp_bias", lambda v: v is False, "false")
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
            "rope_theta": _rope(raw, hf, where)}


def hf_config(cfg: ModelConfig) -> dict[str, Any]:
    """The config.json of our Llama as a LlamaForCausalLM (untied head; RoPE in both spellings)."""
    return {"architectures": ["LlamaForCausalLM"], "model_type": MODEL_TYPE, "vocab_size": cfg.vocab_size,
            "hidden_size": cfg.d_model, "intermediate_size": cfg.hidden, "num_hidden_layers": cfg.n_layers,
            "num_attention_heads": cfg.n_heads, "num_key_value_heads": cfg.kv_heads,
            "head_dim": cfg.d_model // cfg.n_heads, "max_position_embeddings": cfg.seq_len,
            "rms_norm_eps": cfg.norm_eps, "hidden_act": "silu", "attention_bias": False, "mlp_bias": False,
            "rope_theta": cfg.rope_theta, "rope_scaling": None,
            "rope_parameters": {"rope_type": "default", "rope_theta": cfg.rope_theta},
            "tie_word_embeddings": False}


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
        return norms + [Tensor((ours, "kernel"), (layer + theirs + ".weight",), transposed=True)
                        for ours, theirs in linears]
    return [Tensor(("norm", "scale"), (PREFIX + "norm.weight",)),
            # Untied: lm_head.weight; tied (tie_word_embeddings): only the embedding is stored.
            Tensor(("unembed", "kernel"), ("lm_head.weight", PREFIX + "embed_tokens.weight"), transposed=True)]
