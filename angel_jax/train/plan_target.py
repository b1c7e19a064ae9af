"""The machine an estimated plan (`angel-jax plan --estimate`) is for, and where each of its figures comes from.

A plan estimated for another machine takes nothing from the machine it runs on: its compute rate, links, disk and
host update speed come from a calibration file of the target (`--calibration FILE`, built from a real machine's
measurements by experiments/bench/calibration.py), from the command line's flags (which win over the file), or
from built-in figures labelled as assumed. Only a plan with no target named at all (no peak, link, or calibration)
is for this machine, with this machine's peak and its `angel-jax bench io` calibration.

    target = plan_target(args)
    target.compute_flops     # FLOP/s a stage's forward and backward reach on the target (the stage times)
    target.peak              # the matmul peak the predicted MFU is stated against
    target.bandwidths, target.device_bw, target.host_bw
    target.sources           # figure -> where it came from, for the report
"""

from __future__ import annotations

import argparse
import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import jax

from angel_jax.errors import AngelError
from angel_jax.memory.bench_io import default_calibration_path
from angel_jax.schedule.plan import Bandwidths, load_bandwidths
from angel_jax.train.metrics import Peak, device_peak

LINK_FLAGS = ("h2d", "d2h", "disk_read", "disk_write", "link", "host")
"""The `--<name>-gbps` flags that name a target's links."""
LINK_FIGURES = ("h2d", "d2h", "disk read", "disk write", "host update")
"""The figures besides compute whose source the report names."""
ASSUMED = "assumed (built-in)"
"""The source of a figure nothing states for the target (the report says how to state it)."""
ASSUMED_DEVICE_BW = 1e12
"""Device memory bytes/s an estimate assumes when nothing states the target's (the device's own updates)."""
ASSUMED_HOST_BW = 10e9
"""Host update bytes/s (the host optimizer and gradient sums) an estimate assumes when nothing states the target's."""


@dataclass(frozen=True)
class PlanTarget:
    peak: Peak
    """The matmul peak per device the predicted MFU is stated against."""
    compute_flops: float
    """FLOP/s per device that stage times are estimated at: the peak, or what the target's measured runs reached."""
    bandwidths: Bandwidths
    device_bw: float
    """Device memory bytes/s (updates of resident stages)."""
    host_bw: float
    """Host update bytes/s (the host optimizer and gradient sums of streamed stages)."""
    sources: dict[str, str]
    """Figure -> where it comes from."""
    other_machine: bool
    """A target was named (a peak, a link or a calibration file): not this machine, so not its shared CPU."""
    device_memory: int | None = None
    """The target device's memory, bytes (from its calibration), the device budget where the config sets none."""



def read_calibration(path: Path) -> dict[str, Any]:
    """A target calibration file (experiments/bench/calibration.py), checked for the figures a plan needs."""
    try:
        raw = json.loads(Path(path).read_text())
    except (OSError, ValueError) as e:
        raise AngelError(f"--calibration {path}: cannot read it as JSON ({e})") from None
    need = ("peak_flops", "compute_flops", "bandwidth_Bps")
    missing = [k for k in need if k not in raw]
    links = ("h2d_pinned", "d2h_pinned", "disk_read", "disk_write", "host_update")
    missing += [f"bandwidth_Bps.{k}" for k in links if k not in raw.get("bandwidth_Bps", {})]
    if missing:
        raise AngelError(f"--calibration {path}: not a target calibration (missing {', '.join(missing)}); build "
                         "one with experiments/bench/calibration.py")
    return raw


def plan_target(args: argparse.Namespace) -> PlanTarget:
    """The target of an estimated plan, from --calibration, the flags and the built-in figures (see the module's
    doc); this machine's own figures only when no target is named."""
    given = {k: getattr(args, f"{k}_gbps", None) for k in LINK_FLAGS}
    flag = {k: f"--{k.replace('_', '-')}-gbps" for k in LINK_FLAGS}
    if given["h2d"] and not given["d2h"]:
        given["d2h"], flag["d2h"] = given["h2d"], "--h2d-gbps"
    calibration = getattr(args, "calibration", None)
    other = bool(args.peak_tflops or calibration or any(given.values()))
    sources: dict[str, str] = {}
    if calibration is not None:
        cal = read_calibration(calibration)
        figures = cal["bandwidth_Bps"]
        label = f"measured on {cal.get('device', 'the target')} ({Path(calibration).name})"
        peak = Peak(float(cal["peak_flops"]), f"{cal.get('device', 'target')} datasheet ({Path(calibration).name})")
        compute = float(cal["compute_flops"])
        sources["compute"] = f"{label}: {cal.get('compute_from', '')}".rstrip(": ")
        bw = Bandwidths(h2d=figures["h2d_pinned"], d2h=figures["d2h_pinned"], disk_read=figures["disk_read"],
                        disk_write=figures["disk_write"], source=label)
        device_bw = float(figures.get("device_copy", ASSUMED_DEVICE_BW))
        host_bw = float(figures["host_update"])
        sources.update(dict.fromkeys(LINK_FIGURES, label))
        device_memory = cal.get("device_memory_bytes")
    elif other:
        label = ASSUMED
        peak = Peak(args.peak_tflops * 1e12, "--peak-tflops") if args.peak_tflops else device_peak(jax.devices()[0])
        compute = peak.flops_per_device
        sources["compute"] = peak.source
        bw = Bandwidths(source=label)
        device_bw, host_bw, device_memory = ASSUMED_DEVICE_BW, ASSUMED_HOST_BW, None
        sources.update(dict.fromkeys(LINK_FIGURES, label))
    else:  # this machine
        path = default_calibration_path()
        bw = load_bandwidths(path)
        figures = json.loads(Path(path).read_text()).get("bandwidth_Bps", {}) if Path(path).is_file() else {}
        peak = device_peak(jax.devices()[0])
        compute = peak.flops_per_device
        sources["compute"] = peak.source
        device_bw = figures.get("device_copy", ASSUMED_DEVICE_BW)
        host_bw = figures.get("host_memcpy", ASSUMED_HOST_BW)
        sources.update(dict.fromkeys(LINK_FIGURES, f"this machine ({bw.source})"))
        device_memory = None
    if args.peak_tflops and calibration is not None:
        peak = Peak(args.peak_tflops * 1e12, "--peak-tflops")  # the MFU's reference; stage times stay measured
    changes = {k: v * 1e9 for k, v in given.items() if v and k != "host"}
    if changes:
        bw = dataclasses.replace(bw, **changes)
        for key in changes:
            sources[key.replace("_", " ")] = f"{given[key]:g} GB/s ({flag[key]})"
    if given["host"]:
        host_bw = given["host"] * 1e9
        sources["host update"] = f"{given['host']:g} GB/s (--host-gbps)"
    if other:  # the target's copies cost its host cores, not its device's compute
        bw = dataclasses.replace(bw, disk_read_cpu=0.0, disk_write_cpu=0.0)
    bw = dataclasses.replace(bw, source=grouped({k: v for k, v in sources.items() if k != "compute"}))
    return PlanTarget(peak, compute, bw, device_bw, host_bw, sources, other, device_memory)


def grouped(sources: dict[str, str]) -> str:
    """'h2d, d2h, host update: measured on ...; disk read: --disk-read-gbps': figures that share a source together."""
    by: dict[str, list[str]] = {}
    for figure, source in sources.items():
        by.setdefault(source, []).append(figure)
    return "; ".join(f"{', '.join(figures)}: {source}" for source, figures in by.items())
