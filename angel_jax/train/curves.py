"""Loss curves: `loss.png` beside a run's metrics.jsonl, and several runs' curves on one chart (`angel-jax plot`).

`LossCurves` is a hook (hooks.py) on process 0: it keeps each step's training loss and each evaluation's loss as
the loop reports them (`on_step`: every step, not only the logged ones), and redraws the run's picture after each
evaluation and checkpoint (at most every `REDRAW_EVERY` seconds: a chart costs ~0.2 s of CPU) and when the run
ends, however it ends. A resumed run's earlier steps come from metrics.jsonl, read once. A failure to draw is one
warning and the run goes on: a picture is never worth stopping training for.

`read_curve(run_dir)` reads a run's curves from its metrics.jsonl (the logged records: every train.log_every steps,
each evaluation); `draw(curves, out, title)` draws any number of them, one colour per run, with a legend.
"""

from __future__ import annotations

import json
import logging
import math
import time
from array import array
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Sequence

from angel_jax.errors import AngelError
from angel_jax.phases import Phase
from angel_jax.train.hooks import TrainHooks

log = logging.getLogger(__name__)

PNG_NAME = "loss.png"
"""The loss curve's file name in the run directory (beside metrics.jsonl)."""
REDRAW_EVERY = 10.0
"""Seconds: an evaluation or checkpoint sooner than this after the last drawing does not redraw (the end always does)."""
MAX_POINTS = 4000
"""More steps than this are drawn as that many bins' means (a chart of 10^6 points draws slowly and no better)."""


class PlotError(AngelError):
    """A run directory without metrics to draw."""


@dataclass
class Curve:
    """One run's losses: the training loss per step and the evaluation loss per evaluated step."""

    label: str
    steps: array = field(default_factory=lambda: array("d"))
    loss: array = field(default_factory=lambda: array("d"))
    eval_steps: array = field(default_factory=lambda: array("d"))
    eval_loss: array = field(default_factory=lambda: array("d"))

    def add(self, step: int, values: dict[str, Any]) -> None:
        """One step's figures; a step at or before the last one (a rollback recomputing them) drops those after it."""
        if self.steps and step <= self.steps[-1]:
            self.truncate_before(step)
        if _finite(values.get("loss")):
            self.steps.append(step)
            self.loss.append(float(values["loss"]))
        if _finite(values.get("eval/loss")):
            self.eval_steps.append(step)
            self.eval_loss.append(float(values["eval/loss"]))

    def truncate_before(self, step: int) -> None:
        for xs, ys in ((self.steps, self.loss), (self.eval_steps, self.eval_loss)):
            keep = sum(1 for x in xs if x < step)
            del xs[keep:], ys[keep:]


def _finite(value: Any) -> bool:
    return isinstance(value, (int, float)) and math.isfinite(value)


def read_curve(run_dir: Path, label: str | None = None, *, before: int | None = None,
               metrics_name: str | None = None) -> Curve:
    """A run's curves from its metrics file (`metrics_name`, else the one its config.yaml names, else
    metrics.jsonl); with `before`, only the records of earlier steps. PlotError when there is no metrics file."""
    run_dir = Path(run_dir)
    path = run_dir / (metrics_name or _metrics_name(run_dir))
    if not path.is_file():
        what = "does not exist" if not run_dir.exists() else f"has no {path.name}"
        raise PlotError(f"{run_dir} {what}: not a run directory (`angel-jax train` writes {path.name} there)")
    curve = Curve(label or str(run_dir))
    for line in path.read_text().splitlines():
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            continue  # a line cut short by a kill
        step = record.get("step") if isinstance(record, dict) else None
        if isinstance(step, int) and (before is None or step < before):
            curve.add(step, record)
    return curve


def _metrics_name(run_dir: Path) -> str:
    """logging.jsonl of the run's recorded config, when it has one and names another file."""
    try:
        import yaml

        recorded = yaml.safe_load((run_dir / "config.yaml").read_text()) or {}
        name = (recorded.get("logging") or {}).get("jsonl")
    except (OSError, ValueError, AttributeError, ImportError):
        name = None
    return name if isinstance(name, str) and name and "/" not in name else "metrics.jsonl"


def _binned(xs: array, ys: array) -> tuple[list[float], list[float]]:
    """At most MAX_POINTS points: consecutive steps averaged in bins."""
    n = len(xs)
    if n <= MAX_POINTS:
        return list(xs), list(ys)
    k = math.ceil(n / MAX_POINTS)
    bx = [sum(xs[i:i + k]) / len(xs[i:i + k]) for i in range(0, n, k)]
    by = [sum(ys[i:i + k]) / len(ys[i:i + k]) for i in range(0, n, k)]
    return bx, by


def _moving_average(ys: list[float], window: int) -> list[float]:
    """The mean over `window` points centred on each (fewer at the ends): no lag behind the raw curve."""
    prefix = [0.0]
    for y in ys:
        prefix.append(prefix[-1] + y)
    half = window // 2
    out = []
    for i in range(len(ys)):
        lo, hi = max(0, i - half), min(len(ys), i + half + 1)
        out.append((prefix[hi] - prefix[lo]) / (hi - lo))
    return out


def draw(curves: Sequence[Curve], out: Path, title: str) -> list[str]:
    """Draw `curves` on one chart (loss against step) into the PNG `out` (written whole, then renamed); returns
    the legend's labels. One curve: its training loss per step, faint, with a moving average, and its evaluation
    loss; several: one colour per run, training loss solid (averaged when noisy), evaluation loss dashed."""
    from matplotlib.figure import Figure  # no pyplot: no global state, no interactive backend (Agg)

    fig = Figure(figsize=(8, 4.5), dpi=100)
    ax = fig.add_subplot()
    single = len(curves) == 1
    for i, curve in enumerate(curves):
        color = f"C{i}"
        xs, ys = _binned(curve.steps, curve.loss)
        window = max(3, len(xs) // 20) | 1 if len(xs) >= 40 else 1  # odd: centred
        name = "" if single else f"{curve.label}: "
        if xs and window > 1:
            if single:
                ax.plot(xs, ys, color=color, alpha=0.3, linewidth=0.8, label="train loss (each step)")
            ax.plot(xs, _moving_average(ys, window), color=color, linewidth=1.8,
                    label=f"{name}train loss (mean of {window} steps)")
        elif xs:
            ax.plot(xs, ys, color=color, linewidth=1.5, marker="." if len(xs) < 40 else None,
                    label=f"{name}train loss")
        if curve.eval_steps:
            ax.plot(list(curve.eval_steps), list(curve.eval_loss), color="C1" if single else color,
                    linestyle="--", marker="o", markersize=4, linewidth=1.5, label=f"{name}eval loss")
    ax.set_xlabel("step")
    ax.set_ylabel("loss (cross-entropy, nats per token)")
    ax.set_title(title)
    ax.grid(True, alpha=0.3)
    handles, labels = ax.get_legend_handles_labels()
    if handles:
        ax.legend(loc="upper right", fontsize="small")
    fig.tight_layout()
    out = Path(out)
    tmp = out.with_name(f".{out.name}.tmp")
    fig.savefig(tmp, format="png")
    tmp.replace(out)
    return labels


class LossCurves(TrainHooks):
    """Process 0's hook that keeps `<run_dir>/loss.png` current (see the module's docstring)."""

    def __init__(self, run_dir: Path, *, name: str, total_steps: int, metrics_name: str = "metrics.jsonl",
                 clock: Callable[[], float] = time.monotonic):
        self.run_dir, self.name, self.total_steps = Path(run_dir), name, total_steps
        self.metrics_name, self.clock = metrics_name, clock
        self.curve = Curve(name)
        self._drawn_at: float | None = None
        self._new = False  # figures since the last drawing
        self._read_past = False
        self._failed = False

    def on_step(self, step: int, values: dict[str, float]) -> None:
        if not self._read_past:  # a resumed run: the steps before this process's first come from its metrics
            self._read_past = True
            if step > 1 and (self.run_dir / self.metrics_name).is_file():
                try:
                    self.curve = read_curve(self.run_dir, self.name, before=step, metrics_name=self.metrics_name)
                except (OSError, PlotError) as e:
                    log.warning("the loss curve starts at step %d: %s", step, e)
        self.curve.add(step, values)
        self._new = True
        if "eval/loss" in values:
            self.redraw()

    def on_checkpoint(self, step: int, info: dict[str, Any]) -> None:
        self.redraw()

    def on_phase(self, phase: Phase, step: int) -> None:
        if phase == Phase.DONE:
            self.redraw(force=True)

    def close(self) -> None:  # also when the run stopped early: a diverged run's curve is the one to look at
        self.redraw(force=True)

    def redraw(self, force: bool = False) -> None:
        now = self.clock()
        if not self._new or self._failed or (not force and self._drawn_at is not None
                                             and now - self._drawn_at < REDRAW_EVERY):
            return
        self._new, self._drawn_at = False, now
        last = int(self.curve.steps[-1]) if self.curve.steps else 0
        try:
            draw([self.curve], self.run_dir / PNG_NAME, f"{self.name}: loss, step {last} of {self.total_steps}")
        except Exception as e:  # noqa: BLE001 - matplotlib's errors are many; one warning, and no more attempts
            self._failed = True
            log.warning("could not draw the loss curve %s (%s: %s); training goes on without it",
                        self.run_dir / PNG_NAME, type(e).__name__, e)


def loss_curve_hooks(cfg: Any, primary: bool) -> list[TrainHooks]:
    """The loss-curve hook of a run (process 0 only: the others write no metrics)."""
    if not primary or not cfg.logging.loss_curve:
        return []
    return [LossCurves(cfg.run_dir, name=cfg.name, total_steps=cfg.train.steps, metrics_name=cfg.logging.jsonl)]
