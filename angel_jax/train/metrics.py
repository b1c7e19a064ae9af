"""Metrics: sinks (JSONL always, TensorBoard when asked), and the throughput figures (tokens/s, TFLOP/s, MFU).

MFU = achieved model FLOP/s / peak FLOP/s of the devices, where
  achieved model FLOP/s = flops_per_token * tokens per step / step time,
  flops_per_token       = 6 * N_matmul + 12 * n_layers * d_model * seq_len  (PaLM, appendix B; N_matmul is the
                          family's, stated with its `flops_per_token` in models/),
  peak                  = dense bf16 peak per device from `PEAK_FLOPS` * number of devices.
Devices missing from the table (CPUs included) get a peak measured at start-up with a large float32 matmul, and
their MFU is reported with `perf/mfu_is_estimate = 1`.
"""

from __future__ import annotations

import json
import math
import re
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import jax
import jax.numpy as jnp

# Dense bf16 peak FLOP/s per device (vendor datasheets, without sparsity). A key matches a device_kind that contains
# it as whole words ("L4" matches "NVIDIA L4" but not "NVIDIA L40"); the longest matching key wins.
PEAK_FLOPS: dict[str, float] = {
    "H200": 989e12,
    "H100 PCIe": 756e12,
    "H100": 989e12,
    "GH200": 989e12,
    "B200": 2250e12,
    "A100": 312e12,
    "L40S": 362e12,
    "L40": 181e12,
    "L4": 121e12,
    "A10G": 70e12,
    "V100": 125e12,
    "TPU v4": 275e12,
    "TPU v5 lite": 197e12,
    "TPU v5e": 197e12,
    "TPU v5p": 459e12,
    "TPU v6": 918e12,
}


@dataclass(frozen=True)
class Peak:
    flops_per_device: float
    """Peak FLOP/s of one device."""
    source: str
    """Where the figure comes from: 'table:<key>' or 'estimate:matmul'."""

    @property
    def is_estimate(self) -> bool:
        return self.source.startswith("estimate")


def measure_matmul_flops(n: int = 1024, repeats: int = 5) -> float:
    """FLOP/s of a float32 n x n matmul on the default device: a stand-in peak for unknown devices."""
    x = jnp.ones((n, n), jnp.float32)
    f = jax.jit(lambda a: a @ a)
    f(x).block_until_ready()
    best = math.inf
    for _ in range(repeats):
        t0 = time.perf_counter()
        f(x).block_until_ready()
        best = min(best, time.perf_counter() - t0)
    return 2.0 * n**3 / best


def device_peak(device: jax.Device | None = None) -> Peak:
    device = device or jax.devices()[0]
    kind = device.device_kind
    for key in sorted(PEAK_FLOPS, key=len, reverse=True):  # longest match first: "H100 PCIe" before "H100"
        if re.search(rf"(?<![A-Za-z0-9]){re.escape(key)}(?![A-Za-z0-9])", kind, re.IGNORECASE):
            return Peak(PEAK_FLOPS[key], f"table:{key}")
    return Peak(measure_matmul_flops(), "estimate:matmul")


def throughput(step_time: float, tokens_per_step: int, flops_per_token: float, peak: Peak, n_devices: int) -> dict:
    """The `perf/` figures of one step."""
    flops = flops_per_token * tokens_per_step / step_time
    return {
        "perf/step_time": step_time,
        "perf/tokens_per_s": tokens_per_step / step_time,
        "perf/tflops": flops / 1e12,
        "perf/mfu": flops / (peak.flops_per_device * n_devices),
    }


class MetricsSink(Protocol):
    def write(self, step: int, metrics: dict[str, float]) -> None:
        """One logged record of `step`."""

    def truncate_after(self, step: int) -> None:
        """The run went back to `step` (a rollback): records of later steps are recomputed and written again. A
        sink drops what it holds of them where it can; where that means nothing, it does nothing."""

    def close(self) -> None: ...


class JsonlSink:
    """One JSON object per line: {"step": k, "time": unix, <metric>: value, ...}. Always on."""

    def __init__(self, path: Path, *, resume_step: int | None = None):
        self.path = path
        if resume_step is not None and path.exists():
            self._truncate_after(resume_step)
        self._file = open(path, "a", buffering=1)

    def truncate_after(self, step: int) -> None:
        """Drop the records of steps after `step` (they are recomputed after a rollback)."""
        self._file.close()
        self._truncate_after(step)
        self._file = open(self.path, "a", buffering=1)

    def _truncate_after(self, step: int) -> None:
        # Steps after the checkpoint we resume from are recomputed; keep the file one line per step.
        kept = []
        for line in self.path.read_text().splitlines():
            try:
                if json.loads(line).get("step", 0) <= step:
                    kept.append(line)
            except json.JSONDecodeError:
                continue  # a line cut short by a kill
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text("".join(line + "\n" for line in kept))
        tmp.replace(self.path)

    def write(self, step: int, metrics: dict[str, float]) -> None:
        self._file.write(json.dumps({"step": step, "time": round(time.time(), 3), **metrics}) + "\n")

    def close(self) -> None:
        self._file.close()


class TensorBoardSink:
    def __init__(self, log_dir: Path):
        from tensorboardX import SummaryWriter  # imported lazily: only runs that ask for TensorBoard need it

        self._writer = SummaryWriter(str(log_dir))

    def write(self, step: int, metrics: dict[str, float]) -> None:
        for key, value in metrics.items():
            if isinstance(value, (int, float)):
                self._writer.add_scalar(key, value, step)

    def truncate_after(self, step: int) -> None:
        """Nothing: event files are append-only; the recomputed steps are written again after the old ones."""

    def close(self) -> None:
        self._writer.close()


def read_jsonl(path: Path) -> list[dict]:
    """The records of a metrics file (for reports and tests)."""
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]
