"""Fault injection: training hooks that break a run on purpose, for the fault tests and the anomaly benchmark.

    hooks = FaultHooks.parse("corrupt_batch@40,slow@20:factor=3:rank=1", rank=0, attempt=0)
    train(cfg, hooks=[hooks])

A spec is a comma-separated list of `kind@at[:key=value]...`. Batch faults are keyed on the global batch index
(so a rollback that skips the batch also skips the fault, as it would skip bad data); the others on the step.
Every fault may carry `rank=R` (only on process R), `attempt=A` (only in the A-th start of the job, 0 = the
first; the watchdog sets ANGEL_JAX_ATTEMPT), which is how a fault that a restart cures is modelled, and
`node=NAME` (only on that node: a bad machine, whichever rank runs there).

    nan_batch@B                the rows of global batch B get token ids outside the vocabulary: NaN activations
    corrupt_batch@B            the rows of global batch B become uniform random bytes: a loss spike
    lr_blowup@S:steps=N:scale=F  steps S..S+N-1 multiply their update (the learning rate) by F
    raise@S                    an exception inside step S
    slow@S:factor=F            from step S on, each step sleeps so that it takes F times as long
    hang@S                     step S never finishes (the process sleeps forever)
    leak@S:mib=M               from step S on, every step keeps M MiB more host memory (touched, so resident)
    signal@S:num=N             after step S the process sends itself signal N (15: a preemption's SIGTERM)

The process-wide switch is the environment variable ANGEL_JAX_FAULTS (read by `from_env`); nothing is injected
when it is unset.
"""

from __future__ import annotations

import dataclasses
import os
import signal
import time
from dataclasses import dataclass
from typing import Any

import numpy as np

from angel_jax.optim.guard import StepControls
from angel_jax.train.hooks import TrainHooks

ENV = "ANGEL_JAX_FAULTS"
ATTEMPT_ENV = "ANGEL_JAX_ATTEMPT"
KINDS = ("nan_batch", "corrupt_batch", "lr_blowup", "raise", "slow", "hang", "leak", "signal")
_PARAMS = {"lr_blowup": {"steps": 1, "scale": 100.0}, "slow": {"factor": 3.0}, "leak": {"mib": 4.0},
           "signal": {"num": float(signal.SIGTERM)}}


class InjectedFault(RuntimeError):
    """The exception a `raise@S` fault raises."""


@dataclass(frozen=True)
class Fault:
    kind: str
    at: int
    """Global batch index (batch faults) or step."""
    params: dict[str, float]
    rank: int | None = None
    attempt: int | None = None
    node: str | None = None
    """Only on this node (the scheduler's name for it, or the launcher's: a fault of a machine, not of a rank)."""


def parse(spec: str) -> list[Fault]:
    """'corrupt_batch@40,slow@20:factor=3:rank=1' -> faults; ValueError naming the bad part."""
    faults = []
    for part in filter(None, (p.strip() for p in spec.split(","))):
        head, *options = part.split(":")
        kind, sep, at = head.partition("@")
        if kind not in KINDS or not sep or not at.isdigit():
            raise ValueError(f"fault {part!r}: expected kind@N[:key=value...] with kind one of {', '.join(KINDS)}")
        params = dict(_PARAMS.get(kind, {}))
        rank = attempt = node = None
        for opt in options:
            key, eq, value = opt.partition("=")
            try:
                if key == "rank":
                    rank = int(value)
                elif key == "attempt":
                    attempt = int(value)
                elif key == "node" and value:
                    node = value
                elif key in params and eq:
                    params[key] = float(value)
                else:
                    raise ValueError
            except ValueError:
                raise ValueError(f"fault {part!r}: bad option {opt!r} (options of {kind}: "
                                 f"{', '.join([*params, 'rank', 'attempt', 'node'])})") from None
        faults.append(Fault(kind, int(at), params, rank, attempt, node))
    return faults


class FaultHooks(TrainHooks):
    """The faults of one process, as training hooks."""

    def __init__(self, faults: list[Fault], *, rank: int = 0, attempt: int = 0, vocab_size: int = 256,
                 node: str = ""):
        self.faults = [f for f in faults if (f.rank is None or f.rank == rank)
                       and (f.attempt is None or f.attempt == attempt) and (f.node is None or f.node == node)]
        self.vocab_size = vocab_size
        self._leaked: list[np.ndarray] = []
        self._healthy: list[float] = []

    @classmethod
    def parse(cls, spec: str, **kw: Any) -> "FaultHooks":
        return cls(parse(spec), **kw)

    @classmethod
    def from_env(cls, *, rank: int, vocab_size: int = 256) -> "FaultHooks | None":
        spec = os.environ.get(ENV, "")
        if not spec:
            return None
        node = os.environ.get("ANGEL_JAX_NODE") or os.environ.get("SLURMD_NODENAME", "")
        return cls(parse(spec), rank=rank, attempt=int(os.environ.get(ATTEMPT_ENV, "0")), vocab_size=vocab_size,
                   node=node)

    def _active(self, kind: str) -> list[Fault]:
        return [f for f in self.faults if f.kind == kind]

    def on_batch(self, step: int, index: int, rows: Any) -> Any:
        for f in self._active("nan_batch"):
            if f.at == index:
                rows = np.full_like(rows, 2**16 - 1)  # beyond any vocabulary: the embedding gather yields NaN
        for f in self._active("corrupt_batch"):
            if f.at == index:
                rng = np.random.default_rng(index)
                rows = rng.integers(0, min(self.vocab_size, 256), rows.shape).astype(rows.dtype)
        return rows

    def on_controls(self, step: int, controls: StepControls) -> StepControls:
        for f in self._active("lr_blowup"):
            if f.at <= step < f.at + int(f.params["steps"]):
                controls = dataclasses.replace(controls, lr_scale=float(controls.lr_scale) * f.params["scale"])
        return controls

    def on_step(self, step: int, values: dict[str, float]) -> None:
        for f in self._active("raise"):
            if f.at == step:
                raise InjectedFault(f"injected fault: raise@{step}")
        for f in self._active("hang"):
            if f.at == step:
                while True:  # a hang: alive, silent, no progress
                    time.sleep(3600)
        for f in self._active("signal"):
            if f.at == step:
                os.kill(os.getpid(), int(f.params["num"]))
        for f in self._active("leak"):
            if step >= f.at:
                self._leaked.append(np.ones(int(f.params["mib"] * 2**20), np.uint8))  # ones: pages touched
        for f in self._active("slow"):
            if step < f.at:
                if "perf/step_time" in values:  # healthy step times, before the slowdown starts
                    self._healthy = (self._healthy + [values["perf/step_time"]])[-20:]
            elif self._healthy:
                time.sleep((f.params["factor"] - 1.0) * float(np.median(self._healthy)))
