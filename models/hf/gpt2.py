"""GPT-2 (transformers' `GPT2LMHeadModel`) <-> our GPT (models/gpt.py): config.json fields and tensor tables.

The two compute the same function: pre-norm blocks with LayerNorm (layer_norm_epsilon = model.norm_eps), the
tanh approximation of GELU (HF's `gelu_new`), attention scaled by 1/sqrt(head_dim), learned positions, a head
without bias. GPT-2's Conv1D weights are stored [in, out] like our Linear kernels, and its fused c_attn is
[d, 3d] with q | k | v column blocks, each split into heads, exactly our `qkv` layout: nothing is transposed but
the head. GPT-2 ties lm_head to wte and stores wte alone; import copies wte.T into `head.unembed`, export writes
`lm_head.weight` separately with tie_word_embeddings false (our head is trained apart from the embedding).
"""

from __future__ import annotations

from typing import Any

from angel_jax.config import ConfigError, ModelConfig
from models.hf.mapping import HFConfig, Tensor

MODEL_TYPE = "gpt2"
FAMILY = "gpt"
PREFIX = "transformer."
"""GPT2LMHeadModel stores the base model under this prefix; a bare GPT2Model checkpoint without it."""

DEFAULTS = {"vocab_size": 50257, "n_positions": 1024, "n_embd": 768, "n_layer": 12, "n_head": 12,
            "layer_norm_epsilon": 1e-5, "activation_function": "gelu_new", "scale_attn_weights": True,
            "scale_attn_by_inverse_layer_idx": False, "add_cross_attention": False}
"""transformers' GPT2Config defaults, for keys a config.json leaves out."""

HF_KEYS = {"vocab_size": "vocab_size", "seq_len": "n_positions", "d_model": "n_embd", "n_layers": "n_layer",
           "n_heads": "n_head", "n_kv_heads": "n_head", "mlp_hidden": "n_inner",
           "norm_eps": "layer_norm_epsilon"}
"""Our model.* key -> the config.json key it comes from (model.n_kv_heads: GPT-2 has one key/value head per
query head)."""

_TANH_GELU = ("gelu_new", "gelu_pytorch_tanh")  # two names of the same function


def model_fields(raw: dict, where: str) -> dict[str, Any]:
    """Our ModelConfig's architecture fields from a GPT-2 config.json; a setting our GPT does not compute is
    refused, naming the HF key."""
    hf = HFConfig(raw, DEFAULTS, where)
    hf.require("activation_function", lambda v: v in _TANH_GELU, " or ".join(_TANH_GELU))
    hf.require("scale_attn_weights", lambda v: v is True, "true")
    hf.require("scale_attn_by_inverse_layer_idx", lambda v: v is False, "false")
    hf.require("add_cross_attention", lambda v: v is False, "false")
    d, heads = hf.int("n_embd"), hf.int("n_head")
    if d % heads:
        raise ConfigError(f"{where}: n_embd={d} is not divisible by n_head={heads}")
    hidden = hf.int("n_inner") if raw.get("n_inner") is not None else 4 * d
    return {"name": FAMILY, "vocab_size": hf.int("vocab_size"), "seq_len": hf.int("n_positions"), "d_model": d,
            "n_layers": hf.int("n_layer"), "n_heads": heads, "n_kv_heads": 0, "mlp_hidden": hidden,
            "norm_eps": hf.float("layer_norm_epsilon")}


def hf_config(cfg: ModelConfig) -> dict[str, Any]:
    """The config.json of our GPT as a GPT2LMHeadModel (untied head)."""
    return {"architectures": ["GPT2LMHeadModel"], "model_type": MODEL_TYPE, "vocab_size": cfg.vocab_size,
            "n_positions": cfg.seq_len, "n_embd": cfg.d_model, "n_layer": cfg.n_layers, "n_head": cfg.n_heads,
            "n_inner": cfg.hidden, "activation_function": "gelu_new", "layer_norm_epsilon": cfg.norm_eps,
            "scale_attn_weights": True, "scale_attn_by_inverse_layer_idx": False, "reorder_and_upcast_attn": False,
            "add_cross_attention": False, "tie_word_embeddings": False}


def tensor_table(cfg: ModelConfig, stage: int) -> list[Tensor]:
    """Stage `stage`'s tensors (0 = embed, 1 + j = block j, n_layers + 1 = head)."""
    if stage == 0:
        return [Tensor(("tokens", "embedding"), (PREFIX + "wte.weight",)),
                Tensor(("positions",), (PREFIX + "wpe.weight",))]
    if stage <= cfg.n_layers:
        h = f"{PREFIX}h.{stage - 1}."
        pairs = [(("ln_attn", "scale"), "ln_1.weight"), (("ln_attn", "bias"), "ln_1.bias"),
                 (("qkv", "kernel"), "attn.c_attn.weight"), (("qkv", "bias"), "attn.c_attn.bias"),
                 (("attn_out", "kernel"), "attn.c_proj.weight"), (("attn_out", "bias"), "attn.c_proj.bias"),
                 (("ln_mlp", "scale"), "ln_2.weight"), (("ln_mlp", "bias"), "ln_2.bias"),
                 (("mlp_in", "kernel"), "mlp.c_fc.weight"), (("mlp_in", "bias"), "mlp.c_fc.bias"),
                 (("mlp_out", "kernel"), "mlp.c_proj.weight"), (("mlp_out", "bias"), "mlp.c_proj.bias")]
        return [Tensor(path, (h + name,)) for path, name in pairs]
    return [Tensor(("ln", "scale"), (PREFIX + "ln_f.weight",)), Tensor(("ln", "bias"), (PREFIX + "ln_f.bias",)),
            # Untied: lm_head.weight; tied (GPT-2 as published): only wte is stored.
            Tensor(("unembed", "kernel"), ("lm_head.weight", PREFIX + "wte.weight"), transposed=True)]
