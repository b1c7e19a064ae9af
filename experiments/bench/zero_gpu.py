"""ZeRO-3 pages on this machine's devices (one GPU on the lent machine) against the unsharded paged engine: the
same small GPT, the same batches, a device budget that streams stages.

    PYTHONPATH=. python experiments/bench/zero_gpu.py [--devices N] [--steps 6] [--write] [key=value ...]
    JAX_PLATFORMS=cpu PYTHONPATH=. python experiments/bench/zero_gpu.py memory.accelerator_path=true

Figures (one JSON line each; appended to experiments/results/zero_gpu_<platform>.jsonl with --write):

  unsharded   the paged engine on one device (`build_engine` over a one-device mesh): the losses and gradient norms
              of --steps steps, the stages resident and streamed, the median step after the first
  zero3       the same with every page family sharded over --devices devices (ZeRO-3: schedule/zero.py's stage
              functions under shard_map, the sharded layouts, each rank's host updates on its own shards). With
              more than one device that is the engine (`build_engine`, mesh.fsdp = N). With one, the engine keeps
              the unsharded path (train/paged.py shards only over a mesh of several devices), so this script
              builds the runtime the engine builds (blueprint, decide, assemble_runtime) with `Zero.over` of that
              one device: the same stage functions, page store, updater and executor, without the engine's shell
              (timelines, the host-peak check, checkpoints)
  compare     the largest relative difference of the two runs' losses and whether it is within --rtol

The model computes in float32 at matmul precision 'highest' (TF32 would make two different programs agree only
to ~1e-3 on a GPU: DESIGN.md, Numerics); the device budget is three quarters of the training state (fp32
parameters and Adam's moments), so the plan streams stages. Extra key=value overrides apply to both runs (on the
CPU, memory.accelerator_path=true makes the host updates cross to the CPU backend shard by shard, as a GPU's do).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import jax
import numpy as np

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from angel_jax.benchinfo import emit, results_path  # noqa: E402
from angel_jax.config import Config, MeshConfig, load_config  # noqa: E402
from angel_jax.schedule.blueprint import blueprint  # noqa: E402
from angel_jax.schedule.budgets import decide  # noqa: E402
from angel_jax.schedule.runtime import assemble_runtime  # noqa: E402
from angel_jax.schedule.zero import Zero  # noqa: E402
from angel_jax.train.engines import build_engine, state_bytes  # noqa: E402
from angel_jax.train.sharding import make_mesh  # noqa: E402

MODEL = ["model.d_model=256", "model.n_heads=4", "model.n_layers=8", "model.seq_len=256",
         "model.compute_dtype=float32", "train.batch_size=8", "train.micro_batch_size=2", "memory.mode=paged",
         "memory.page_size=1048576"]
"""A small GPT (6.3 M block parameters, 10 stages) whose blocks span several 1 MiB pages each; micro-batches of 2
rows in both runs (the one-device engine would otherwise choose its own)."""


def config(steps: int, run_dir: str, overrides: list[str], ranks: int = 1) -> Config:
    """The run's config: `MODEL` with a device budget of three quarters of the training state (per rank)."""
    base = [*MODEL, f"train.steps={steps}", f"train.run_dir={run_dir}", "logging.loss_curve=false", *overrides]
    cfg = load_config(ROOT / "experiments" / "gpt_tiny.yaml", base)
    budget = 3 * state_bytes(cfg, ranks) // 4
    return load_config(ROOT / "experiments" / "gpt_tiny.yaml",
                       [*base, f"memory.device_budget={budget}", *([f"mesh.fsdp={ranks}"] if ranks > 1 else [])])


def batches(cfg: Config, steps: int) -> list[np.ndarray]:
    rng = np.random.default_rng(0)
    shape = (cfg.train.batch_size, cfg.model.seq_len + 1)
    return [rng.integers(0, cfg.model.vocab_size, shape, dtype=np.int32) for _ in range(steps)]


class OneDeviceZero:
    """The paged runtime with every page sharded over `devices` (`Zero.over`), built as the engine builds it, and
    stepped as the engine steps it (`PagedExecutor.step`)."""

    def __init__(self, cfg: Config, devices: list):
        self.zero = Zero.over(devices)
        device = self.zero.local_device()
        self.batch_sharding = self.zero.rows()
        bp = blueprint(cfg, self.zero)
        decision = decide(cfg, device, cfg.train.batch_size, bp.sizes, self.zero)
        shape = (cfg.train.batch_size, cfg.model.seq_len + 1)
        example = jax.make_array_from_callback(shape, self.batch_sharding,
                                               lambda index: np.zeros(shape, np.int32)[index])
        self.built = assemble_runtime(decision, bp, None, example, device, self.zero)

    def step(self, batch: jax.Array) -> dict:
        return self.built.executor.step(batch, None)

    def close(self) -> None:
        self.built.close()


def train(engine, data: list[np.ndarray]) -> dict:
    """Losses, gradient norms and step seconds (each step waited for: its metrics fetched)."""
    losses, norms, seconds = [], [], []
    for b in data:
        t0 = time.perf_counter()
        metrics = engine.step(jax.device_put(b, engine.batch_sharding))
        losses.append(float(metrics["loss"]))
        norms.append(float(metrics["grad_norm"]))
        seconds.append(time.perf_counter() - t0)
    return {"losses": losses, "grad_norms": norms, "first_step_s": round(seconds[0], 3),
            "step_s": round(statistics.median(seconds[1:]), 4) if len(seconds) > 1 else None}


def describe(built) -> dict:
    """The plan's stages and where the streamed stages' host updates run."""
    plan = built.plan
    host = built.updater.placements["host"]
    return {"stages": len(plan.home), "resident": len(plan.resident), "streamed": len(plan.streamed),
            "host_updates_cross": host.crosses, "shard_by_shard": host.shardwise is not None}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("overrides", nargs="*", help="dotted key=value overrides for both runs")
    p.add_argument("--devices", type=int, default=1, help="devices the ZeRO-3 run shards over (default 1)")
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--rtol", type=float, default=1e-4, help="the losses' largest relative difference to match")
    p.add_argument("--write", action="store_true", help="append the figures to experiments/results/")
    args = p.parse_args()
    jax.config.update("jax_default_matmul_precision", "highest")
    results = results_path("zero_gpu") if args.write else None
    devices = jax.devices()[:args.devices]
    if len(devices) < args.devices:
        raise SystemExit(f"--devices {args.devices}: this machine has {len(devices)}")
    runs = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name in ("unsharded", "zero3"):
            ranks = args.devices if name == "zero3" else 1
            cfg = config(args.steps, f"{tmp}/{name}", args.overrides, ranks)
            data = batches(cfg, args.steps)
            start = time.perf_counter()
            if name == "unsharded":
                engine = build_engine(cfg, make_mesh(MeshConfig(), devices[:1]))
            elif ranks == 1:
                engine = OneDeviceZero(cfg, devices)
            else:
                engine = build_engine(cfg, make_mesh(MeshConfig(fsdp=ranks), devices))
            try:
                built_s = time.perf_counter() - start
                sharded = getattr(engine, "zero", None) is not None
                runs[name] = {"bench": "zero_gpu", "figure": name, "ranks": ranks, "sharded_pages": sharded,
                              "device": devices[0].device_kind, "device_budget": cfg.memory.device_budget,
                              **describe(engine.built), "build_s": round(built_s, 2), **train(engine, data),
                              "overrides": args.overrides}
            finally:
                engine.close()
            emit(runs[name], results)
    a, b = runs["unsharded"]["losses"], runs["zero3"]["losses"]
    worst = max(abs(x - y) / max(abs(x), 1e-12) for x, y in zip(a, b))
    emit({"bench": "zero_gpu", "figure": "compare", "ranks": args.devices, "steps": args.steps,
          "max_rel_loss_diff": worst, "rtol": args.rtol, "match": worst <= args.rtol,
          "streamed": runs["zero3"]["streamed"], "matmul_precision": "highest"}, results)
    return 0 if worst <= args.rtol else 1


if __name__ == "__main__":
    sys.exit(main())
