"""Metrics: sinks (JSONL always, TensorBoard and Weights & Biases when asked), and the throughput figures
(tokens/s, TFLOP/s, MFU).

MFU = achieved model FLOP/s / peak FLOP/s of the devices, where
  achieved model FLOP/s = flops_per_token * tokens per step / step time,
  flops_per_token       = 6 * N_matmul + 12 * n_layers * d_model * seq_len  (PaLM, appendix B; N_matmul is the
                          family's, stated with its `flops_per_token` in models/),
  peak                  = dense bf16 peak per device from `PEAK_FLOPS` * number of devices.
A CPU's peak is stated from its spec (`cpu_peak`): physical cores x clock x float32 FLOPs per cycle per core, the
same figure every run. Other devices missing from the table get a peak measured at start-up with a large float32
matmul, and their MFU is reported with `perf/mfu_is_estimate = 1`.

The step time behind these figures is measured between the steps' completions as the host sees them, averaged
over the last `STEP_WINDOW` completed steps (`StepWindow`): the loop runs one step ahead, and a host that wakes
late to a finished step (on a CPU, the cores are busy computing the next one) sees two completions at once, so a
single interval can be a few milliseconds against a median of tens.
"""

from __future__ import annotations

import json
import math
import os
import re
import secrets
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import jax
import jax.numpy as jnp

from angel_jax.config import Config, ConfigError, LoggingConfig, to_dict
from angel_jax.errors import AngelError

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
    if getattr(device, "platform", kind) == "cpu" and (peak := cpu_peak(_cpu_devices())) is not None:
        return peak
    return Peak(measure_matmul_flops(), "estimate:matmul")


# float32 FLOPs per cycle per core by the widest vector instructions the CPU has (its /proc/cpuinfo flags), taking
# two vector FMA units wherever some models of that family have two: an upper bound, so an MFU over it is never
# overstated (a core with one unit is understated by half). (flags that must all be present, FLOPs, what they are)
CPU_FLOPS_PER_CYCLE: tuple[tuple[tuple[str, ...], int, str], ...] = (
    (("avx512f",), 64, "AVX-512: 2 FMA units x 16 lanes x 2"),
    (("avx2", "fma"), 32, "AVX2: 2 FMA units x 8 lanes x 2"),
    (("avx",), 16, "AVX: 8 lanes x (1 multiply + 1 add)"),
    (("asimd",), 32, "NEON: 4 FMA units x 4 lanes x 2"),  # aarch64 (Neoverse V1, Apple M): the most units
    (("sse2",), 8, "SSE2: 4 lanes x (1 multiply + 1 add)"),
)


def cpu_peak(devices: int = 1, cpuinfo: str | None = None, sys_root: Path = Path("/sys"),
             usable: set[int] | None = None) -> Peak | None:
    """The CPU's float32 peak per device: physical cores this process may use x clock x FLOPs per cycle per core
    (`CPU_FLOPS_PER_CYCLE`), split over `devices` CPU devices sharing the cores (`--cpu-devices`). The clock is
    the cores' maximum (cpufreq), else /proc/cpuinfo's (in a VM often the base clock: a turbo clock can run a
    matmul a little faster than the figure). `usable`: the processors this process may run on (its affinity).
    None when /proc/cpuinfo does not say (not Linux)."""
    if cpuinfo is None:
        try:
            cpuinfo = Path("/proc/cpuinfo").read_text()
        except OSError:
            return None
    blocks = [dict(_cpuinfo_fields(block)) for block in cpuinfo.strip().split("\n\n") if block.strip()]
    if usable is None and hasattr(os, "sched_getaffinity"):
        usable = set(os.sched_getaffinity(0))
    mine = [b for b in blocks if "processor" in b and (usable is None or int(b["processor"]) in usable)] or blocks
    flags = set((mine[0].get("flags") or mine[0].get("features") or "").split()) if mine else set()
    per_cycle = next(((n, what) for need, n, what in CPU_FLOPS_PER_CYCLE if set(need) <= flags), None)
    clock = _cpu_clock(mine, sys_root)
    if not mine or per_cycle is None or clock is None:
        return None
    cores = len({(b.get("physical id"), b.get("core id", b.get("processor"))) for b in mine})
    quota = _cgroup_cores(sys_root)
    if quota is not None and quota < cores:
        cores = quota
    (hz, clock_source), (flops, what) = clock, per_cycle
    split = f" / {devices} CPU devices" if devices > 1 else ""
    return Peak(cores * hz * flops / devices, f"cpu: {cores} cores x {hz / 1e9:.2f} GHz ({clock_source}) x {flops} "
                                              f"float32 FLOP/cycle ({what}){split}")


def _cpuinfo_fields(block: str) -> list[tuple[str, str]]:
    return [(k.strip().lower(), v.strip()) for k, _, v in (line.partition(":") for line in block.splitlines()) if _]


def _cpu_clock(blocks: list[dict[str, str]], sys_root: Path) -> tuple[float, str] | None:
    """(Hz, where from): the highest cpufreq maximum of the usable cores, else /proc/cpuinfo's 'cpu MHz' or the
    '@ 2.60GHz' of the model name."""
    khz = []
    for b in blocks:
        try:
            khz.append(int((sys_root / f"devices/system/cpu/cpu{b.get('processor', 0)}/cpufreq/cpuinfo_max_freq")
                           .read_text()))
        except (OSError, ValueError):
            pass
    if khz:
        return max(khz) * 1e3, "cpufreq maximum"
    mhz = [float(b["cpu mhz"]) for b in blocks if re.fullmatch(r"[0-9.]+", b.get("cpu mhz", ""))]
    if mhz and max(mhz) > 0:
        return max(mhz) * 1e6, "/proc/cpuinfo"
    named = re.search(r"@\s*([0-9.]+)\s*GHz", blocks[0].get("model name", "") if blocks else "")
    return (float(named.group(1)) * 1e9, "model name") if named else None


def _cgroup_cores(sys_root: Path) -> int | None:
    """Cores a cgroup v2 CPU quota allows ('200000 100000' in cpu.max: 2), or None when unlimited."""
    try:
        quota, period = (sys_root / "fs/cgroup/cpu.max").read_text().split()[:2]
        return max(1, math.ceil(int(quota) / int(period)))
    except (OSError, ValueError):
        return None


def _cpu_devices() -> int:
    try:
        return jax.local_device_count("cpu")
    except RuntimeError:
        return 1


def peak_line(peak: Peak) -> str:
    """The banner's line: what the MFU is measured against."""
    return (f"mfu: model FLOPs/s over a peak of {peak.flops_per_device / 1e12:.3g} TFLOP/s per device "
            f"({peak.source}{', an estimate: ~' if peak.is_estimate else ''})")


STEP_WINDOW = 10
"""Completed steps the `perf/` figures average over (fewer since the last pause: a compilation, a checkpoint, an
evaluation, a rollback)."""


class StepWindow:
    """The step time of the `perf/` figures: the mean of the last `size` intervals between completed steps since
    `restart` (a pause). The loop runs one step ahead, so a step the host sees late leaves the next one an
    interval of almost nothing; the pair together is right, and so is any window over both. From a restart, where
    no step was in flight, the mean over the window is never shorter than the device took."""

    def __init__(self, size: int = STEP_WINDOW):
        self.size = size
        self._intervals: list[float] = []

    def restart(self) -> None:
        self._intervals = []

    def add(self, interval: float) -> float:
        """One more completed step, `interval` seconds after the previous; returns the window's mean step time."""
        self._intervals = (self._intervals + [interval])[-self.size:]
        return sum(self._intervals) / len(self._intervals)


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


WANDB_RUN_ID_FILE = ".wandb_run_id"
"""In the run directory: the id of its Weights & Biases run, which a resumed run continues."""


class TrackerError(AngelError):
    """An experiment tracker (Weights & Biases) could not start; the message says why and what to change."""


def import_wandb(logging_cfg: LoggingConfig) -> Any:
    """The wandb module when `logging.wandb` asks for it (else None); a clear error when it is not installed.

    Imported here, not at the top: runs without W&B do not pay its import time."""
    if not logging_cfg.wandb:
        return None
    try:
        import wandb
    except ImportError as e:
        raise ConfigError(f"'logging.wandb' is true but the wandb package is not installed ({e}): "
                          "pip install 'angel-jax[wandb]'") from None
    return wandb


def wandb_run_id(run_dir: Path, *, resume: bool) -> str:
    """The run directory's W&B run id: the stored one when resuming, else a new one, stored for later resumes."""
    path = Path(run_dir) / WANDB_RUN_ID_FILE
    stored = path.read_text().strip() if resume and path.is_file() else ""
    if re.fullmatch(r"[0-9a-z]{1,64}", stored):
        return stored
    new = secrets.token_hex(8)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(new + "\n")
    tmp.replace(path)
    return new


class WandbSink:
    """Weights & Biases: every record the JSONL gets, run name = the run directory's name, the resolved config as
    the W&B config, files under <run_dir>/wandb. A resumed run continues the W&B run whose id the run directory
    keeps (a run started over with train.resume=false gets a new one).

    W&B's own step (`_step`) may only grow, while the trainer's step goes back after a rollback or a resume from
    an earlier checkpoint; so the trainer's step is logged as the metric `step`, the x axis of every other metric,
    and recomputed steps are logged again after the old ones (as in TensorBoard)."""

    def __init__(self, run_dir: Path, cfg: Config):
        wandb = import_wandb(cfg.logging)
        run_dir = Path(run_dir).absolute()
        mode = cfg.logging.wandb_mode
        try:
            self._run = wandb.init(project=cfg.logging.wandb_project, name=run_dir.name, dir=str(run_dir),
                                   id=wandb_run_id(run_dir, resume=cfg.train.resume), resume="allow", mode=mode,
                                   config=to_dict(cfg), settings=wandb.Settings(console="off"))
        except Exception as e:  # noqa: BLE001 - wandb raises its own types (no login, no network, timeouts)
            hint = "; logging.wandb_mode=offline needs neither a network nor a login" if mode == "online" else ""
            raise TrackerError(f"Weights & Biases could not start (logging.wandb_mode={mode!r}): "
                               f"{type(e).__name__}: {str(e).rstrip('.')}{hint}") from e
        self._run.define_metric("step")
        self._run.define_metric("*", step_metric="step")

    def write(self, step: int, metrics: dict[str, float]) -> None:
        self._run.log({"step": step, **{k: v for k, v in metrics.items() if isinstance(v, (int, float))}})

    def truncate_after(self, step: int) -> None:
        """Nothing: W&B history is append-only; the recomputed steps are logged again after the old ones."""

    def close(self) -> None:
        # Closed from the trainer's `finally`: a run that ends by an exception is marked failed, not finished.
        self._run.finish(exit_code=1 if sys.exc_info()[0] is not None else 0)


def open_sinks(cfg: Config, run_dir: Path, *, start_step: int) -> list[MetricsSink]:
    """Process 0's metric sinks: the JSONL file always (records after start_step dropped), TensorBoard and W&B
    when the config asks for them."""
    sinks: list[MetricsSink] = [JsonlSink(run_dir / cfg.logging.jsonl, resume_step=start_step)]
    try:
        if cfg.logging.tensorboard:
            sinks.append(TensorBoardSink(run_dir / "tb"))
        if cfg.logging.wandb:
            sinks.append(WandbSink(run_dir, cfg))
    except BaseException:
        for sink in sinks:
            sink.close()
        raise
    return sinks


def read_jsonl(path: Path) -> list[dict]:
    """The records of a metrics file (for reports and tests)."""
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]
