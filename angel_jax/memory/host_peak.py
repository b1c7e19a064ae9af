"""The process's real host peak against the plan's: every host byte the paged engine touches is meant to be in
its plan, and this is where that is checked on a running engine.

Linux keeps a process's peak resident set (VmHWM in /proc/self/status) and resets it to the current RSS when "5"
is written to /proc/self/clear_refs: the engine resets it before it builds anything, and after its first steady
step compares the growth since with what its plan counted.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

from angel_jax.memory import block_cache
from angel_jax.units import human_bytes

log = logging.getLogger(__name__)

TOLERANCE = 0.10
"""Growth over the plan's bytes allowed before a warning: 10%..."""
FIXED_OVERHEAD = 512 << 20
"""...plus this, for what no plan counts and no model size changes: compiled programs, XLA's and the allocator's
own structures, the data pipeline's buffers, thread stacks."""


def _status_bytes(field: str) -> int | None:
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024  # kB
    except (OSError, ValueError, IndexError):
        pass
    return None


def reset_peak() -> int | None:
    """Reset the process's peak RSS to its current RSS and return that; None where the OS cannot (no Linux
    /proc, or a kernel older than 4.0)."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
    except OSError:
        return None
    return _status_bytes("VmHWM")


def peak_rss() -> int | None:
    """The process's peak resident set since the last `reset_peak` (or its start)."""
    return _status_bytes("VmHWM")


@dataclass
class HostPeakCheck:
    """`planned`: the host bytes the plan counts for this process (on the CPU backend, where the "device" tier is
    host RAM too, its device bytes as well); `baseline`: the RSS when the peak was reset."""

    planned: int
    baseline: int | None
    measured: int | None = None
    """The peak's growth over the baseline, once `check` ran (its latest measurement)."""
    warned: bool = False
    """Whether a `check` has found the growth over `allowed`."""

    @classmethod
    def start(cls, planned: int = 0) -> "HostPeakCheck":
        return cls(planned, reset_peak())

    @property
    def allowed(self) -> int:
        return int(self.planned * (1 + TOLERANCE)) + FIXED_OVERHEAD + block_cache.kept_at_most()

    def check(self, after: str = "") -> str | None:
        """Measure the growth of the peak RSS; the one-line warning when it exceeds `allowed`, else None. `after`:
        what the process has done by now, for the warning (the peak counts everything since the reset, so a later
        check covers what an earlier one saw and what came after: evaluations, checkpoints)."""
        peak = peak_rss()
        if self.baseline is None or peak is None:
            return None
        self.measured = max(0, peak - self.baseline)  # (RSS counters lag by a few pages: never below zero)
        if self.measured <= self.allowed:
            return None
        self.warned = True
        by = f" (measured after {after})" if after else ""
        cache = block_cache.kept_at_most()
        kept = f" + {human_bytes(cache)} of freed blocks kept for reuse" if cache else ""
        return (f"host memory: the process's peak grew by {human_bytes(self.measured)} since the engine was "
                f"built{by}, over the plan's {human_bytes(self.planned)} + {TOLERANCE:.0%} + {human_bytes(FIXED_OVERHEAD)} "
                f"for what no plan counts{kept}: some host memory is not in the plan (a budget set from the plan "
                "may not hold)")
