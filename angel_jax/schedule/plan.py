"""Plan: where every page family lives, what streams, how far ahead to prefetch, where updates run, and the
predicted timeline of a step.

Policy (Angel-PTM's unified scheduling, simplified to one micro-batch and whole stages as the unit of movement):
1. Device memory first holds what every step needs regardless of placement (`Budgets.fixed_device`: saved stage
   inputs and the largest stage's working set) and a streaming window of `prefetch + 1` stages of parameter pages
   plus one stage of gradients on their way to the host.
2. What is left of the device budget keeps whole stages resident (parameters, gradients and optimizer state on the
   device, update on the device), preferring the stages that cost most to stream per second of compute that could
   hide the transfer: all of free device memory is used first, which is why a model that fits trains at in-memory
   speed.
3. The remaining stages stream: their parameters (the home copy) and gradients live in pinned host memory; their
   optimizer state lives in host memory while the host budget lasts, then on disk (read back before the stage's
   update, written after it, both overlapped with other work). Their updates run on the host. Lock-free mode
   (`staleness: 1`) keeps one more copy of streamed parameters on the host: the version in use while the next is
   written.
4. The prefetch distance is the smallest that hides the transfers the cost model predicts (a deeper one only costs
   window memory), chosen by simulating the step for each candidate (simulate.py).

Every refusal is a `PlanError` that says how many bytes are missing and which `memory.*` key to raise.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from angel_jax.errors import AngelError
from angel_jax.optim.updater import OPT_STAGING
from angel_jax.schedule.simulate import Bandwidths, StageCost, simulate
from angel_jax.schedule.timeline import Timeline
from angel_jax.schedule.trace import compute_sequence

__all__ = ["Bandwidths", "Budgets", "Plan", "PlanError", "StageCost", "load_bandwidths", "make_plan"]


class PlanError(AngelError, ValueError):
    """The budgets cannot hold even the minimum the step needs; the message says how much is missing and which
    key to raise."""


def load_bandwidths(path: str | Path | None) -> Bandwidths:
    """Disk (and default transfer) bandwidths from `angel-jax bench io`'s calibration file; defaults without one."""
    if path is None or not Path(path).is_file():
        return Bandwidths()
    raw = json.loads(Path(path).read_text())
    figures = raw.get("bandwidth_Bps", {})

    def pick(key: str, default: float) -> float:
        value = figures.get(key)
        return float(value) if isinstance(value, (int, float)) and value > 0 else default

    return Bandwidths(h2d=pick("h2d_pinned", Bandwidths.h2d), d2h=pick("d2h_pinned", Bandwidths.d2h),
                      disk_read=pick("disk_read", Bandwidths.disk_read),
                      disk_write=pick("disk_write", Bandwidths.disk_write), source=str(path))


@dataclass(frozen=True)
class Budgets:
    device: int
    host: int | None
    """None: no limit."""
    disk: int | None
    """None: no limit; 0: no disk tier."""
    fixed_device: int
    """Device bytes the step needs whatever the placement: saved activations and the working set."""


@dataclass(frozen=True)
class Plan:
    resident: tuple[int, ...]
    """Stages whose pages (all families) live on the device; updated there."""
    home: tuple[str, ...]
    """Per stage, where its parameter (and gradient) pages live: 'device' or 'host'."""
    opt_home: tuple[str, ...]
    """Per stage, where its optimizer-state pages live: 'device', 'host' or 'disk'."""
    prefetch: int
    """How many accesses ahead a streamed stage's pages are fetched."""
    window_bytes: int
    """Device bytes reserved for streamed pages in flight."""
    peak_bytes: dict[str, int]
    """Predicted peak bytes per tier."""
    staleness: int
    predicted: Timeline = field(compare=False)

    @property
    def streamed(self) -> tuple[int, ...]:
        return tuple(i for i, h in enumerate(self.home) if h != "device")

    def table(self, costs: list[StageCost]) -> list[dict]:
        """Home bytes per family per tier (the page table `angel-jax plan` prints). Gradients of streamed stages
        land in host memory; on the device only a window of them exists at a time (counted in the window)."""
        rows = []
        for tier in ("device", "host", "disk"):
            params = sum(c.param_bytes for c, h in zip(costs, self.home) if h == tier)
            opt = sum(c.opt_bytes for c, h in zip(costs, self.opt_home) if h == tier)
            rows.append({"tier": tier, "params": params, "gradients": params, "optimizer": opt})
        return rows

    def io_per_step(self, costs: list[StageCost], bandwidths: Bandwidths) -> dict[str, float]:
        """Bytes each copy path moves per step under this plan, and the seconds that takes at `bandwidths`: a
        streamed stage's parameters go to the device once per access (forward and backward; the head once), its
        gradients come back once; disk-homed optimizer state is read and written once per update. `io_bound_s`
        is the slowest path's time: no step can be shorter."""
        accesses = [0] * len(costs)
        for _, i in compute_sequence(len(costs)):
            accesses[i] += 1
        streamed = self.streamed
        h2d = sum(accesses[i] * costs[i].param_bytes for i in streamed)
        d2h = sum(costs[i].param_bytes for i in streamed)
        disk = sum(c.opt_bytes for c, h in zip(costs, self.opt_home) if h == "disk")
        seconds = {"h2d_s": h2d / bandwidths.h2d, "d2h_s": d2h / bandwidths.d2h,
                   "disk_read_s": disk / bandwidths.disk_read, "disk_write_s": disk / bandwidths.disk_write}
        return {"h2d_bytes": h2d, "d2h_bytes": d2h, "disk_read_bytes": disk, "disk_write_bytes": disk, **seconds,
                "io_bound_s": max(seconds.values())}

    def summary(self) -> dict:
        return {"resident": len(self.resident), "streamed": len(self.streamed), "prefetch": self.prefetch,
                "opt_on_disk": sum(1 for h in self.opt_home if h == "disk"), "staleness": self.staleness,
                "predicted_step_s": self.predicted.step_time, "peak_bytes": dict(self.peak_bytes)}


def window_bytes(costs: list[StageCost], streamed: list[int], prefetch: int) -> int:
    if not streamed:
        return 0
    biggest = max(costs[i].param_bytes for i in streamed)
    # prefetch + 1 stages of parameters in flight, plus one stage of gradients on its way to the host.
    return (prefetch + 1) * biggest + biggest


def minimum_device_bytes(costs: list[StageCost], budgets: Budgets) -> int:
    """The smallest device budget any plan fits: everything streamed, prefetch 1."""
    return budgets.fixed_device + window_bytes(costs, list(range(len(costs))), 1)


def make_plan(costs: list[StageCost], bw: Bandwidths, budgets: Budgets, *, staleness: int = 0,
              shared_cpu: bool = False, max_prefetch: int = 3) -> Plan:
    n = len(costs)
    best: Plan | None = None
    for prefetch in range(1, max_prefetch + 1):
        plan = _plan_for(costs, bw, budgets, prefetch, n, staleness, shared_cpu)
        if plan is None:
            continue
        # A deeper prefetch only pays if it is predicted faster by more than noise.
        if best is None or plan.predicted.step_time < best.predicted.step_time * 0.98:
            best = plan
    if best is None:
        need = minimum_device_bytes(costs, budgets)
        raise PlanError(f"device budget {budgets.device:,} B cannot hold the step's minimum {need:,} B "
                        f"(activations and working set {budgets.fixed_device:,} B + a streaming window of "
                        f"{need - budgets.fixed_device:,} B): {need - budgets.device:,} B missing; raise "
                        "memory.device_budget, or lower train.batch_size / model.seq_len")
    return best


def _resident_bytes(c: StageCost) -> int:
    return 2 * c.param_bytes + c.opt_bytes  # params, grads, optimizer state


def _plan_for(costs: list[StageCost], bw: Bandwidths, budgets: Budgets, prefetch: int, n: int, staleness: int,
              shared_cpu: bool) -> Plan | None:
    resident: list[int] = []
    free = budgets.device - budgets.fixed_device
    # Prefer keeping the stages whose streaming costs most per unit of compute that could hide it.
    order = sorted(range(n), key=lambda i: -(costs[i].param_bytes / max(costs[i].forward_s + costs[i].backward_s,
                                                                          1e-12)))
    for i in order:
        streamed = [j for j in range(n) if j not in resident and j != i]
        need = sum(_resident_bytes(costs[j]) for j in resident + [i]) + window_bytes(costs, streamed, prefetch)
        if need <= free:
            resident.append(i)
    streamed = [j for j in range(n) if j not in resident]
    window = window_bytes(costs, streamed, prefetch)
    used = sum(_resident_bytes(costs[j]) for j in resident) + window
    if used > free:
        return None
    home = tuple("device" if i in resident else "host" for i in range(n))
    opt_home, host_used, disk_used = _place_optimizer_state(costs, budgets, streamed, staleness)
    predicted = simulate(costs, bw, home, opt_home, prefetch, staleness=staleness, shared_cpu=shared_cpu)
    peak = {"device": budgets.fixed_device + used, "host": host_used, "disk": disk_used}
    return Plan(tuple(sorted(resident)), home, opt_home, prefetch, window, peak, staleness, predicted)


def _place_optimizer_state(costs: list[StageCost], budgets: Budgets, streamed: list[int],
                           staleness: int) -> tuple[tuple[str, ...], int, int]:
    """Optimizer state of streamed stages: host while the host budget lasts, then disk. Returns (homes, host
    bytes, disk bytes)."""
    # Parameters and gradients of the streamed stages; lock-free mode keeps a second version of the parameters.
    host_used = sum((2 + staleness) * costs[i].param_bytes for i in streamed)
    # Room to stage optimizer state read from disk (OPT_STAGING stages, the largest) in host memory.
    staging = OPT_STAGING * max((costs[i].opt_bytes for i in streamed), default=0)
    # The least host memory this placement can run with: all optimizer state on disk (then only its staging is on
    # the host), or, without a disk tier, all of it on the host. A refusal names this figure, not only the first
    # shortfall: raising the budget by that alone would be refused again at the optimizer state.
    least = host_used + (staging if budgets.disk != 0 else sum(costs[i].opt_bytes for i in streamed))
    if budgets.host is not None and host_used > budgets.host:
        raise PlanError(f"host budget {budgets.host:,} B cannot hold the streamed stages' parameters and gradients "
                        f"({host_used:,} B): raise memory.host_budget to at least {least:,} B (with their optimizer "
                        "state), or memory.device_budget")
    opt_home, disk_used = [], 0
    for i in range(len(costs)):
        if i not in streamed:
            opt_home.append("device")
        elif budgets.host is None or host_used + costs[i].opt_bytes + (staging if budgets.disk != 0 else 0) \
                <= budgets.host:  # room left for staging, unless there is no disk to stage from
            opt_home.append("host")
            host_used += costs[i].opt_bytes
        elif budgets.disk is not None and disk_used + costs[i].opt_bytes > budgets.disk:
            rest = sum(costs[j].opt_bytes for j in streamed if j >= i)
            where = "set memory.disk_dir (there is no disk tier)" if budgets.disk == 0 else \
                f"give the disk tier more than {budgets.disk:,} B (memory.disk_budget, or free space in " \
                "memory.disk_dir)"
            raise PlanError(f"host budget {budgets.host:,} B holds the optimizer state of the streamed stages only up "
                            f"to stage {costs[i].name!r}; the remaining {rest:,} B need the disk tier: {where} or "
                            "raise memory.host_budget")
        else:
            opt_home.append("disk")
            disk_used += costs[i].opt_bytes
    if "disk" in opt_home:
        host_used += staging
        if budgets.host is not None and host_used > budgets.host:
            raise PlanError(f"host budget {budgets.host:,} B cannot stage optimizer state read from disk "
                            f"({staging:,} B on top of {host_used - staging:,} B): {host_used - budgets.host:,} B "
                            f"missing; raise memory.host_budget to at least {least:,} B")
    return tuple(opt_home), host_used, disk_used
