"""One GPT block's forward and backward on the CPU backend: float32 against bfloat16 compute, with and without the
families' CPU matmul rule (models/common.py `dot_general`: a bfloat16 model's matmuls computed in float32).

    python experiments/bench/bf16_cpu.py [--d-model 2048] [--seq 128] [--batch 1] [--repeats 3] [--write]

The block is the paged engine's: `models.get(cfg).apply["block"]` of the scale benchmark's GPT (d_model 2048,
16 heads, seq 128, batch 1, remat, parameters in each case's model.param_dtype), differentiated with respect to its parameters and its
input (`jax.vjp`, a fixed cotangent), jitted, on fresh parameters. Five cases in one process,
alternating (one call of each per round, `--repeats` rounds after one untimed call each):

  float32        model.compute_dtype=float32
  bf16_before    model.compute_dtype=bfloat16 model.cpu_matmul_fp32=false: XLA:CPU's bfloat16 dots
  bf16_after     model.compute_dtype=bfloat16 (model.cpu_matmul_fp32=true, the default): operands upcast at the
                 dot, results back in bfloat16
  bf16_params_upcast  and model.param_dtype=bfloat16, the 16-bit weights upcast at the dot too (as before
                 models/cpu_dot.py)
  bf16_params    model.param_dtype=bfloat16 with the rule's 16-bit weight path: bfloat16 dots with float32
                 sums, forward and backward (models/cpu_dot.py)

One JSON line per case (median and every wall time, the ratio of its median to float32's; the median CPU time of
the process per call and its ratio, steadier than wall time on a shared machine; the dot operand dtypes of the
compiled program), appended to experiments/results/bf16_cpu_<platform>.jsonl only with --write.
"""

from __future__ import annotations

import argparse
import re
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Callable

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

import models  # noqa: E402
from models import cpu_dot  # noqa: E402
from angel_jax import benchinfo  # noqa: E402
from angel_jax.config import ModelConfig  # noqa: E402

CASES = {"float32": dict(compute_dtype="float32"),
         "bf16_before": dict(compute_dtype="bfloat16", cpu_matmul_fp32=False),
         "bf16_after": dict(compute_dtype="bfloat16", cpu_matmul_fp32=True),
         "bf16_params_upcast": dict(compute_dtype="bfloat16", param_dtype="bfloat16", cpu_matmul_fp32=True,
                                    cpu_dot=False),
         "bf16_params": dict(compute_dtype="bfloat16", param_dtype="bfloat16", cpu_matmul_fp32=True)}


def block_step(case: dict[str, Any], args: argparse.Namespace) -> tuple[Callable[[], Any], list[str]]:
    """A call running the block's forward and backward once, and the dot operand dtypes of its program."""
    case = dict(case)
    use_cpu_dot = case.pop("cpu_dot", True)
    cfg = ModelConfig(d_model=args.d_model, n_heads=args.heads, n_layers=1, seq_len=args.seq, remat=True, **case)
    staged = models.get(cfg)
    params = staged.split(staged.init(0)[1])[1]  # block 0, in model.param_dtype
    x = jax.random.normal(jax.random.key(1), (args.batch, args.seq, args.d_model), jnp.float32)
    x = x.astype(cfg.compute_dtype)
    apply = staged.apply["block"]

    def fwd_bwd(p, x):
        y, back = jax.vjp(apply, p, x)
        return back(jnp.ones_like(y))

    applies = cpu_dot.applies
    if not use_cpu_dot:  # traced as before models/cpu_dot.py: a 16-bit weight upcast at the dot
        cpu_dot.applies = lambda *_: False
    jax.clear_caches()  # the block's function is jitted: a case of the same config must trace it again
    try:  # the compiled program is what runs: a later call of the jitted function could trace it again
        step = jax.jit(fwd_bwd).lower(params, x).compile()
    finally:
        cpu_dot.applies = applies
        jax.clear_caches()
    return (lambda: jax.block_until_ready(step(params, x))), dot_operand_dtypes(step.as_text())


def dot_operand_dtypes(hlo: str) -> list[str]:
    """'lhs x rhs -> out' of every dot in an HLO module's text (operands looked up by name)."""
    types = dict(re.findall(r"%([\w.\-]+) = (\w+)\[", hlo))
    found = set()
    for out, lhs, rhs in re.findall(r"= (\w+)\[[^=]*? dot\(%([\w.\-]+), %([\w.\-]+)\)", hlo):
        found.add(f"{types.get(lhs, '?')} x {types.get(rhs, '?')} -> {out}")
    return sorted(found)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--d-model", type=int, default=2048)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--write", action="store_true", help="append the figures to experiments/results/")
    args = ap.parse_args()
    calls, dots = {}, {}
    for name, case in CASES.items():
        calls[name], dots[name] = block_step(case, args)
        calls[name]()  # untimed: first touch
    times: dict[str, list[float]] = {name: [] for name in CASES}
    cpu: dict[str, list[float]] = {name: [] for name in CASES}
    for _ in range(args.repeats):
        for name in CASES:  # alternating: every case sees the same stretch of a shared machine's load
            t0, c0 = time.perf_counter(), time.process_time()
            calls[name]()
            times[name].append(time.perf_counter() - t0)
            cpu[name].append(time.process_time() - c0)
    base, base_cpu = statistics.median(times["float32"]), statistics.median(cpu["float32"])
    results = benchinfo.results_path("bf16_cpu") if args.write else None
    machine = benchinfo.machine_info()
    for name, case in CASES.items():
        med = statistics.median(times[name])
        benchinfo.emit({"bench": "bf16_cpu", "case": name, "config": case, "d_model": args.d_model,
                        "heads": args.heads, "seq": args.seq, "batch": args.batch, "remat": True,
                        "median_s": round(med, 4), "times_s": [round(t, 4) for t in times[name]],
                        "vs_float32": round(med / base, 3), "cpu_s": round(statistics.median(cpu[name]), 4),
                        "cpu_vs_float32": round(statistics.median(cpu[name]) / base_cpu, 3), "dots": dots[name]},
                       results, machine)


if __name__ == "__main__":
    main()
