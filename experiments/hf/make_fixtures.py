"""Hugging Face reference data for the import/export tests, made with transformers itself.

This script is run with a separate Python (3.11) that has torch and transformers; the project and its tests
never need either. Set that environment up once, outside the repository:

    python3.11 -m venv /work/hfgen
    /work/hfgen/bin/pip install torch==2.13.0 transformers safetensors numpy    # torch pinned: the CPU wheel

(The committed fixtures: transformers 5.24.0, torch 2.13.0+cpu, safetensors 0.8.0, numpy 2.4.6 under Python
3.11; made again with these, gpt2 and llama come out byte for byte as committed.)

Two modes:

    /work/hfgen/bin/python experiments/hf/make_fixtures.py make [--out tests/fixtures/hf] [--only NAME ...]

builds tiny, randomly initialised (fixed seed) models (vocabulary 256, so the byte tokenizer fits): a
`GPT2LMHeadModel`, `LlamaForCausalLM`s (plain; with Llama 3.1's "llama3" RoPE scaling; with a tied head) and a
`Qwen2ForCausalLM`, saves each with `save_pretrained` (safetensors: config.json + model.safetensors) into
`<out>/<name>/` and the float32
logits of fixed token ids beside it (`<out>/<name>/logits.npz`: `tokens` int32 [B, T], `logits` float32
[B, T, V]). Every tensor is perturbed after HF's initialisation (norm scales around 1, biases non-zero), so a
mapping that swaps two tensors of the same shape, or drops a bias, cannot go unnoticed. `--only` makes the named
fixtures alone (the others are left as they are).

    /work/hfgen/bin/python experiments/hf/make_fixtures.py check DIR [DIR ...] [--results FILE]

is the "an export loads in transformers" check: each DIR was written by `angel-jax export --hf` (or by
`experiments/hf/export_reference.py`) and holds config.json, model.safetensors and `angel_logits.npz`
(`tokens`, `logits` as angel-jax computed them). The model is loaded with `AutoModelForCausalLM.from_pretrained`
(refusing any missing or unexpected tensor), its float32 logits of the same tokens compared, and one JSON line
per model appended to FILE (default experiments/results/hf_parity.jsonl): the largest absolute logit difference,
the versions of transformers, torch and jax, the date and the machine. Exit status 1 if any difference exceeds
--tol (1e-4).
"""

from __future__ import annotations

import argparse
import datetime
import inspect
import json
import os
import platform
import socket
import sys
from pathlib import Path

import numpy as np
import torch
import transformers

SEED = 1234
TOKENS_SHAPE = (2, 32)

FIXTURES = {
    # GPT-2: layer_norm_epsilon and activation as HF's defaults (1e-5, gelu_new); n_inner unset (= 4 x n_embd).
    "gpt2": ("GPT2LMHeadModel", dict(vocab_size=256, n_positions=64, n_embd=48, n_layer=2, n_head=4,
                                     bos_token_id=0, eos_token_id=0)),
    # Llama: grouped-query attention (4 heads, 2 key/value heads), an intermediate size that is not 4x, a
    # non-default RoPE base and rms_norm_eps as HF's default (1e-6), untied head (HF's default for Llama).
    "llama": ("LlamaForCausalLM", dict(vocab_size=256, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                       num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                       rope_theta=50000.0, bos_token_id=0, eos_token_id=0)),
    # Llama 3.1's RoPE scaling, shrunk to a head dimension of 8 (4 frequencies): with an original context of 128
    # the wavelengths kept are those under 128 / 4 = 32 (frequency 0: 6.3), stretched by 4 those over 128
    # (frequencies 2 and 3: 889 and 10563), interpolated between (frequency 1: 74.7), so all three cases change
    # the logits of the 32 tokens tested. Smaller than the other Llama (hidden 32) to keep the fixture small.
    "llama3": ("LlamaForCausalLM", dict(vocab_size=256, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                                        rope_theta=20000.0, rope_scaling=dict(
                                            rope_type="llama3", factor=4.0, low_freq_factor=1.0,
                                            high_freq_factor=4.0, original_max_position_embeddings=128),
                                        bos_token_id=0, eos_token_id=0)),
    # A Llama whose head is the embedding (tie_word_embeddings: lm_head.weight is not stored).
    "llama_tied": ("LlamaForCausalLM", dict(vocab_size=256, hidden_size=32, intermediate_size=64,
                                            num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                            max_position_embeddings=64, tie_word_embeddings=True,
                                            bos_token_id=0, eos_token_id=0)),
    # Qwen2: biases on q, k and v (perturbed, so each one shows), none on o; grouped-query attention, Qwen's RoPE
    # base, untied head.
    "qwen2": ("Qwen2ForCausalLM", dict(vocab_size=256, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                       num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                       rope_theta=1000000.0, tie_word_embeddings=False, bos_token_id=0,
                                       eos_token_id=0)),
}


def _config(arch: str, kwargs: dict) -> transformers.PretrainedConfig:
    # rope_theta and rope_scaling as keywords: transformers 5 moves them into rope_parameters, 4.x keeps them.
    cls = {"GPT2LMHeadModel": transformers.GPT2Config, "LlamaForCausalLM": transformers.LlamaConfig,
           "Qwen2ForCausalLM": transformers.Qwen2Config}[arch]
    return cls(**kwargs)


def _check_rope_scaled(name: str, model: torch.nn.Module, kwargs: dict) -> None:
    """A scaled fixture whose frequencies equal the plain ones would test nothing: refuse it."""
    if "rope_scaling" not in kwargs:
        return
    dim = kwargs["hidden_size"] // kwargs["num_attention_heads"]
    plain = 1.0 / (kwargs["rope_theta"] ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
    scaled = model.model.rotary_emb.inv_freq.float()
    changed = int((~torch.isclose(scaled, plain, rtol=1e-3)).sum())
    print(f"{name}: RoPE frequencies {plain.tolist()} -> {scaled.tolist()} ({changed} of {len(plain)} changed)")
    if changed < 2:
        raise SystemExit(f"{name}: the RoPE scaling leaves the frequencies (almost) unchanged")


def _perturb(model: torch.nn.Module, gen: torch.Generator) -> None:
    """Make every tensor distinct: HF initialises norm scales to 1 and biases to 0."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=gen)
            if name.endswith(("ln_1.weight", "ln_2.weight", "ln_f.weight", "layernorm.weight", "norm.weight")):
                p.copy_(1.0 + 0.1 * noise)
            elif name.endswith("bias"):
                p.copy_(0.05 * noise)
            else:  # matrices: larger than HF's 0.02 so that the logits vary visibly between tokens
                p.copy_(0.1 * noise)


def _logits(model: torch.nn.Module, tokens: np.ndarray) -> np.ndarray:
    with torch.no_grad():
        return model(input_ids=torch.from_numpy(tokens.astype(np.int64))).logits.float().numpy()


def make(out: Path, only: list[str] | None = None) -> None:
    unknown = sorted(set(only or ()) - set(FIXTURES))
    if unknown:
        raise SystemExit(f"no fixture named {', '.join(unknown)} (known: {', '.join(FIXTURES)})")
    for name, (arch, kwargs) in FIXTURES.items():
        if only and name not in only:
            continue
        torch.manual_seed(SEED)
        gen = torch.Generator().manual_seed(SEED)
        model = getattr(transformers, arch)(_config(arch, kwargs)).float().eval()
        _perturb(model, gen)
        model.tie_weights()  # GPT-2 and llama_tied tie lm_head to the embedding: perturbed once, shared
        _check_rope_scaled(name, model, kwargs)
        tokens = np.random.default_rng(SEED).integers(0, kwargs["vocab_size"], TOKENS_SHAPE).astype(np.int32)
        target = out / name
        target.mkdir(parents=True, exist_ok=True)
        # safetensors: the only format transformers 5 writes; 4.x needs safe_serialization=True.
        safe = {"safe_serialization": True} if "safe_serialization" in inspect.signature(
            model.save_pretrained).parameters else {}
        model.save_pretrained(target, **safe)
        if not (target / "model.safetensors").is_file():
            raise SystemExit(f"{target}: save_pretrained wrote no model.safetensors")
        (target / "generation_config.json").unlink(missing_ok=True)  # not needed; keeps the fixture minimal
        np.savez_compressed(target / "logits.npz", tokens=tokens, logits=_logits(model, tokens))
        size = sum(p.stat().st_size for p in target.iterdir())
        print(f"{target}: {arch}, {sum(p.numel() for p in model.parameters()):,} parameters, {size:,} bytes")


def _versions() -> dict:
    out = {"transformers": transformers.__version__, "torch": torch.__version__, "numpy": np.__version__}
    try:
        from importlib.metadata import version
        out["safetensors"] = version("safetensors")
    except Exception:  # noqa: BLE001 - informative only
        pass
    return out


def _cpu() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return f"{line.split(':', 1)[1].strip()} ({os.cpu_count()} cores)"
    except OSError:
        pass
    return platform.machine()


def check(dirs: list[Path], results: Path, tol: float) -> int:
    worst = 0.0
    lines = []
    exports = [d for d in dirs if (d / "config.json").is_file() and (d / "angel_logits.npz").is_file()]
    for d in sorted(set(dirs) - set(exports)):
        print(f"{d}: skipped (no config.json + angel_logits.npz)", file=sys.stderr)
    if not exports:
        print("no export to check", file=sys.stderr)
        return 1
    for d in exports:
        ref = np.load(d / "angel_logits.npz", allow_pickle=False)
        meta = json.loads((d / "angel_meta.json").read_text()) if (d / "angel_meta.json").is_file() else {}
        model, info = transformers.AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32,
                                                                         output_loading_info=True)
        problems = {k: v for k, v in info.items() if v}  # missing, unexpected or mismatched tensors, errors
        if problems:
            print(f"{d}: loading info not clean: {problems}", file=sys.stderr)
            return 1
        logits = _logits(model.eval(), ref["tokens"])
        diff = float(np.abs(logits - ref["logits"]).max())
        worst = max(worst, diff)
        record = {"model": meta.get("model", d.name), "hf_class": type(model).__name__, "max_abs_logit_diff": diff,
                  "logit_scale": float(np.abs(logits).max()), "tokens": list(ref["tokens"].shape),
                  "versions": {**_versions(), **meta.get("versions", {})},
                  "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                  "machine": {"host": socket.gethostname(), "platform": platform.platform(), "cpu": _cpu()},
                  "source": meta.get("source", "")}
        lines.append(json.dumps(record))
        print(lines[-1])
    results.parent.mkdir(parents=True, exist_ok=True)
    with results.open("a") as f:
        f.write("".join(line + "\n" for line in lines))
    if worst > tol:
        print(f"largest logit difference {worst:.3g} exceeds {tol:g}", file=sys.stderr)
        return 1
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="mode", required=True)
    mk = sub.add_parser("make", help="write the tiny HF checkpoints and their logits")
    mk.add_argument("--out", type=Path, default=Path(__file__).resolve().parents[2] / "tests/fixtures/hf")
    mk.add_argument("--only", nargs="+", metavar="NAME", help=f"make only these fixtures ({', '.join(FIXTURES)})")
    ck = sub.add_parser("check", help="load angel-jax exports into transformers and compare logits")
    ck.add_argument("dirs", type=Path, nargs="+")
    ck.add_argument("--results", type=Path,
                    default=Path(__file__).resolve().parents[1] / "results/hf_parity.jsonl")
    ck.add_argument("--tol", type=float, default=1e-4)
    args = p.parse_args(argv)
    if args.mode == "make":
        make(args.out, args.only)
        return 0
    return check(args.dirs, args.results, args.tol)


if __name__ == "__main__":
    sys.exit(main())
