"""`angel-jax plot RUN_DIR [RUN_DIR ...] [--out FILE.png]`: several runs' loss curves on one chart."""

from __future__ import annotations

import argparse
from pathlib import Path

from angel_jax.train.curves import draw, read_curve


def run(args: argparse.Namespace) -> int:
    dirs = [Path(d) for d in args.run_dirs]
    curves = [read_curve(d, _label(d, dirs)) for d in dirs]  # a missing metrics file: one line, nothing drawn
    empty = [c.label for c in curves if not c.steps and not c.eval_steps]
    if len(empty) == len(curves):
        print(f"nothing to draw: no logged loss in {', '.join(empty)}")
        return 1
    title = curves[0].label + ": loss" if len(curves) == 1 else f"loss of {len(curves)} runs"
    out = args.out or Path("loss_curves.png")
    draw(curves, out, title)
    for curve in curves:
        last = f"step {int(curve.steps[-1])}, loss {curve.loss[-1]:.4f}" if curve.steps else "no training loss"
        evals = f", eval loss {curve.eval_loss[-1]:.4f}" if curve.eval_steps else ""
        print(f"  {curve.label}: {len(curve.steps)} logged steps, the last {last}{evals}")
    print(f"wrote {out}")
    return 0


def _label(run_dir: Path, all_dirs: list[Path]) -> str:
    """The run directory's name, or its path where two runs share a name."""
    same = [d for d in all_dirs if d.name == run_dir.name]
    return run_dir.name if len(same) == 1 else str(run_dir)
