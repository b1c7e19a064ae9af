"""What every benchmark figure carries: the machine, the versions and the date, and one way to emit it; and how
far a benchmark's training run has got (`logged_step`), which the fault benchmarks wait on before they strike.

Benchmarks print one JSON line per figure and append the same line to a results file under
experiments/results/, so committed figures always say where and when they were measured.
"""

from __future__ import annotations

import datetime
import json
import os
import platform
import socket
from importlib import metadata
from pathlib import Path
from typing import Any


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def _version(pkg: str) -> str | None:
    try:
        return metadata.version(pkg)
    except metadata.PackageNotFoundError:
        return None


def machine_info() -> dict[str, Any]:
    import jax

    devices = jax.devices()
    return {
        "host": socket.gethostname(),
        "cpu": _cpu_model(),
        "cpu_count": os.cpu_count(),
        "device": devices[0].device_kind,
        "device_count": len(devices),
        "platform": devices[0].platform,
        "versions": {p: _version(p) for p in ("jax", "jaxlib", "flax", "optax", "orbax-checkpoint", "tensorstore")},
        "python": platform.python_version(),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        # The 1-minute load average when the figure was written: on a shared machine, a figure taken under load
        # says so.
        "loadavg_1m": round(os.getloadavg()[0], 2) if hasattr(os, "getloadavg") else None,
    }


def results_path(name: str) -> Path:
    """experiments/results/<name>_<platform>.jsonl in the repository."""
    import jax

    root = Path(__file__).resolve().parent.parent
    return root / "experiments" / "results" / f"{name}_{jax.devices()[0].platform}.jsonl"


def emit(record: dict[str, Any], results: Path | None, machine: dict[str, Any] | None = None) -> None:
    """Print one figure as a JSON line and append it (with machine info) to `results` when given."""
    line = json.dumps({**record, "machine": machine or machine_info()})
    print(line, flush=True)
    if results is not None:
        results.parent.mkdir(parents=True, exist_ok=True)
        with open(results, "a") as f:
            f.write(line + "\n")


def logged_step(run_dir: Path) -> int:
    """The newest step in a run directory's metrics.jsonl (0 while there is none); a line still being written is
    skipped."""
    try:
        lines = (Path(run_dir) / "metrics.jsonl").read_text().splitlines()
    except OSError:
        return 0
    return max((json.loads(line)["step"] for line in lines if line.endswith("}")), default=0)
