"""Exports for the "an export loads in transformers" check, with the logits angel-jax computes beside each.

Run with the project's Python, then check the directories with transformers (another Python; see
make_fixtures.py):

    .venv/bin/python experiments/hf/export_reference.py --out /tmp/angel-hf-exports
    /work/hfgen/bin/python experiments/hf/make_fixtures.py check /tmp/angel-hf-exports/*

Eight exports, each a directory with config.json + model.safetensors (or shards named by
model.safetensors.index.json; written by `angel-jax export --hf`'s code path), `angel_logits.npz` (`tokens` int32
[B, T], `logits` float32 [B, T, V] of our model, float32 compute) and `angel_meta.json` (what it is, the versions
of jax / flax / numpy):

    gpt2-fixture, llama-fixture,  the committed HF fixtures imported with model.init_from and exported again
    llama3-fixture, llama_tied-fixture, qwen2-fixture   (Llama 3 RoPE scaling, tied embeddings, Qwen2 biases)
    llama-fixture-sharded         the Llama fixture exported in shards of at most 20 KB (--max-shard-size)
    gpt-trained                   a GPT trained 40 steps by the in-memory engine, exported from its checkpoint
    llama-trained                 a Llama (1 key/value head, MLP width 160) trained 40 steps by the paged
                                  engine, exported from its checkpoint
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import shutil
import sys
from pathlib import Path

import jax
import numpy as np

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))  # this checkout's angel_jax and models, wherever the script is run from

from angel_jax.config import ModelConfig, config_from_dict  # noqa: E402
from angel_jax.cli.hf import export_run  # noqa: E402
from angel_jax.train.loop import train  # noqa: E402
from angel_jax.train.weights import load_params  # noqa: E402
import models  # noqa: E402
from models import hf  # noqa: E402

FIXTURES = ROOT / "tests" / "fixtures" / "hf"
TRAINED = {
    "gpt-trained": ({"name": "gpt", "d_model": 64, "n_layers": 2, "n_heads": 4, "seq_len": 32}, {"mode": "in_memory"}),
    "llama-trained": ({"name": "llama", "d_model": 64, "n_layers": 2, "n_heads": 4, "n_kv_heads": 1,
                       "mlp_hidden": 160, "norm_eps": 1e-5, "seq_len": 32},
                      {"mode": "paged", "page_size": 65536, "device_budget": 3_000_000}),
}


def _versions() -> dict:
    import flax

    return {"jax": jax.__version__, "flax": flax.__version__, "numpy": np.__version__}


def _logits(model_cfg, params, tokens: np.ndarray) -> np.ndarray:
    """Through the whole model (a tied head is not a stage of its own: its matrix is the embedding stage's)."""
    from flax import nnx

    graphdef = models.get(dataclasses.replace(model_cfg, init_from="", compute_dtype="float32")).abstract()[0]
    return np.asarray(jax.jit(lambda p, t: nnx.merge(graphdef, p)(t))(params, tokens), np.float32)


def _write_reference(out: Path, model_cfg, params, tokens: np.ndarray, source: str) -> None:
    np.savez(out / "angel_logits.npz", tokens=tokens, logits=_logits(model_cfg, params, tokens))
    (out / "angel_meta.json").write_text(json.dumps({"model": out.name, "source": source,
                                                     "versions": _versions()}, indent=2) + "\n")


def fixture_exports(root: Path) -> None:
    for name in ("gpt2", "llama", "llama3", "llama_tied", "qwen2"):
        src = FIXTURES / name
        model_cfg = ModelConfig(**hf.model_fields(src), compute_dtype="float32", init_from=str(src))
        params = models.get(model_cfg).init(0)[1]
        staged = models.get(dataclasses.replace(model_cfg, init_from=""))
        out = root / f"{name}-fixture"
        hf.export(model_cfg, staged.split(params), out, carry=hf.special_tokens(src))
        tokens = np.load(src / "logits.npz")["tokens"]
        _write_reference(out, model_cfg, params, tokens, f"tests/fixtures/hf/{name} imported and exported")
        if name == "llama":  # the same weights in shards: transformers reads them through the index
            out = root / f"{name}-fixture-sharded"
            hf.export(model_cfg, staged.split(params), out, carry=hf.special_tokens(src), max_shard_size="20KB")
            _write_reference(out, model_cfg, params, tokens, f"tests/fixtures/hf/{name} imported and exported in "
                             f"{len(hf.weight_files(out)) - 1} shards of at most 20 KB")


def trained_exports(root: Path, steps: int) -> None:
    for name, (model, memory) in TRAINED.items():
        run_dir = root / "runs" / name
        raw = {"name": name, "model": {**model, "compute_dtype": "float32"},
               "data": {"source": "stdlib", "max_bytes": 300_000, "dir": str(root / "data")},
               "optimizer": {"lr": 3e-3, "warmup_steps": 5},
               "train": {"steps": steps, "batch_size": 8, "log_every": 10, "progress": False, "run_dir": str(run_dir)},
               "memory": memory, "checkpoint": {"every": 0, "memory_dir": str(root / "memtier" / name)}}
        result = train(config_from_dict(raw, name))
        done = export_run(run_dir, root / name)
        out, step = done.out_dir, done.step
        weights = load_params(run_dir)
        tokens = np.random.default_rng(0).integers(0, 256, (2, 32)).astype(np.int32)
        _write_reference(out, weights.cfg.model, weights.params, tokens,
                         f"{memory['mode']} engine, {steps} steps (loss {result.history[0]['loss']:.3f} -> "
                         f"{result.history[-1]['loss']:.3f}), exported from the checkpoint of step {step}")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, default=Path("/tmp/angel-hf-exports"))
    p.add_argument("--steps", type=int, default=40)
    args = p.parse_args(argv)
    if args.out.exists():
        shutil.rmtree(args.out)
    args.out.mkdir(parents=True)
    fixture_exports(args.out)
    trained_exports(args.out, args.steps)
    print("\n".join(str(d) for d in sorted(args.out.iterdir()) if (d / "angel_logits.npz").is_file()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
