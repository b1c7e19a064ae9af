"""Plan: where every page family lives, what streams, how far ahead to prefetch, where updates run, and the
predicted timeline of a step.

Policy (Angel-PTM's unified scheduling, simplified to one micro-batch and whole stages as the unit of movement):
1. Device memory first holds what every step needs regardless of placement: saved stage inputs, the largest stage's
   working set, and a streaming window of `prefetch + 1` stages of parameter pages plus one stage of gradients in
   flight to the host.
2. What is left of the device budget keeps whole stages resident (parameters, optimizer state and gradients on the
   device, update on the device), preferring the stages that cost most to stream per byte of FLOPs they carry:
   all of free HBM is used first, which is why a model that fits trains at in-memory speed.
3. The remaining stages stream: their parameters (fp32, the home copy) and gradients live in pinned host memory;
   their optimizer state lives in host memory while the host budget lasts, then on disk (read back before the
   stage's update, written after it, both overlapped with other work). Their updates run on the host.
4. The prefetch distance is the smallest that hides the transfers the cost model predicts (more only costs window
   memory), chosen by simulating the step for each candidate.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path

from angel_jax.schedule.timeline import Timeline


class PlanError(ValueError):
    """The budgets cannot hold even the minimum the step needs; the message says how much is missing."""


@dataclass(frozen=True)
class StageCost:
    name: str
    param_bytes: int
    """Bytes of the stage's parameter pages (what streams to the device)."""
    opt_bytes: int
    """Bytes of the stage's optimizer-state pages."""
    forward_s: float
    backward_s: float
    """Recompute + vjp (for the head: loss and gradients)."""
    update_device_s: float
    update_host_s: float


@dataclass(frozen=True)
class Bandwidths:
    """Bytes per second of each path; from `angel-jax bench io`'s calibration file when there is one."""

    h2d: float = 10e9
    d2h: float = 10e9
    disk_read: float = 1e9
    disk_write: float = 1e9
    source: str = "defaults"

    @staticmethod
    def load(path: Path | None) -> "Bandwidths":
        if path is None or not Path(path).is_file():
            return Bandwidths()
        raw = json.loads(Path(path).read_text())
        figures = raw.get("bandwidths", raw)

        def pick(*keys: str, default: float) -> float:
            for k in keys:
                if isinstance(figures.get(k), (int, float)) and figures[k] > 0:
                    return float(figures[k])
            return default

        return Bandwidths(
            h2d=pick("h2d_pinned", "h2d", default=Bandwidths.h2d),
            d2h=pick("d2h_pinned", "d2h", default=Bandwidths.d2h),
            disk_read=pick("disk_tier_read", "disk_read", default=Bandwidths.disk_read),
            disk_write=pick("disk_tier_write", "disk_write", default=Bandwidths.disk_write),
            source=str(path),
        )


@dataclass(frozen=True)
class Budgets:
    device: int
    host: int | None
    """None: no limit."""
    disk: int | None
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
    """How many stages ahead a streamed stage's pages are fetched."""
    window_bytes: int
    """Device bytes reserved for streamed pages in flight."""
    peak_bytes: dict[str, int]
    """Predicted peak bytes per tier."""
    predicted: Timeline = field(compare=False)

    @property
    def streamed(self) -> tuple[int, ...]:
        return tuple(i for i, h in enumerate(self.home) if h != "device")

    def table(self, costs: list[StageCost]) -> list[dict]:
        """Home bytes per family per tier (the page table `angel-jax plan` prints)."""
        rows = []
        for tier in ("device", "host", "disk"):
            params = sum(c.param_bytes for c, h in zip(costs, self.home) if h == tier)
            opt = sum(c.opt_bytes for c, h in zip(costs, self.opt_home) if h == tier)
            rows.append({"tier": tier, "params": params, "gradients": params, "optimizer": opt})
        return rows


def _window(costs: list[StageCost], streamed: list[int], prefetch: int) -> int:
    if not streamed:
        return 0
    biggest = max(costs[i].param_bytes for i in streamed)
    # prefetch + 1 stages of parameters in flight, plus one stage of gradients on its way to the host.
    return (prefetch + 1) * biggest + biggest


def make_plan(costs: list[StageCost], bw: Bandwidths, budgets: Budgets, *, max_prefetch: int = 3) -> Plan:
    n = len(costs)
    best: Plan | None = None
    for prefetch in range(1, max_prefetch + 1):
        plan = _plan_for(costs, bw, budgets, prefetch, n)
        if plan is None:
            continue
        # A deeper prefetch only pays if it is predicted faster by more than noise.
        if best is None or plan.predicted.step_time < best.predicted.step_time * 0.98:
            best = plan
    if best is None:
        need = budgets.fixed_device + _window(costs, list(range(n)), 1)
        raise PlanError(f"device budget {budgets.device:,} B cannot hold the step's minimum {need:,} B "
                        f"(activations and working set {budgets.fixed_device:,} B + a streaming window); "
                        "raise memory.device_budget or lower train.batch_size / model.seq_len")
    return best


def _plan_for(costs: list[StageCost], bw: Bandwidths, budgets: Budgets, prefetch: int, n: int) -> Plan | None:
    resident: list[int] = []
    free = budgets.device - budgets.fixed_device

    def resident_bytes(i: int) -> int:
        return 2 * costs[i].param_bytes + costs[i].opt_bytes  # params, grads, optimizer state

    # Prefer keeping the stages whose streaming costs most per unit of compute that could hide it.
    order = sorted(range(n), key=lambda i: -(costs[i].param_bytes / max(costs[i].forward_s + costs[i].backward_s,
                                                                          1e-12)))
    for i in order:
        streamed = [j for j in range(n) if j not in resident and j != i]
        if resident_bytes(i) + sum(resident_bytes(j) for j in resident) + _window(costs, streamed, prefetch) <= free:
            resident.append(i)
    streamed = [j for j in range(n) if j not in resident]
    window = _window(costs, streamed, prefetch)
    used = sum(resident_bytes(j) for j in resident) + window
    if used > free:
        return None
    home = tuple("device" if i in resident else "host" for i in range(n))
    host_used = sum(2 * costs[i].param_bytes for i in streamed)  # parameters and gradients
    if budgets.host is not None and host_used > budgets.host:
        raise PlanError(f"host budget {budgets.host:,} B cannot hold the streamed stages' parameters and gradients "
                        f"({host_used:,} B); raise memory.host_budget or memory.device_budget")
    opt_home, disk_used = [], 0
    # Room to stage optimizer state read from disk (OPT_STAGING stages, the largest) in host memory.
    staging = 2 * max(costs[i].opt_bytes for i in streamed) if streamed else 0
    for i in range(n):
        if i in resident:
            opt_home.append("device")
        elif budgets.host is None or host_used + costs[i].opt_bytes + staging <= budgets.host:
            opt_home.append("host")
            host_used += costs[i].opt_bytes
        elif budgets.disk is not None and disk_used + costs[i].opt_bytes > budgets.disk:
            raise PlanError(f"host budget {budgets.host:,} B and disk budget {budgets.disk:,} B cannot hold the "
                            f"optimizer state of stage {costs[i].name!r}; raise memory.host_budget or "
                            "memory.disk_budget (and set memory.disk_dir)")
        else:
            opt_home.append("disk")
            disk_used += costs[i].opt_bytes
    if "disk" in opt_home:
        host_used += staging
        if budgets.host is not None and host_used > budgets.host:
            raise PlanError(f"host budget {budgets.host:,} B cannot stage optimizer state read from disk "
                            f"({staging:,} B on top of {host_used - staging:,} B); raise memory.host_budget")
    predicted = simulate(costs, bw, home, tuple(opt_home), prefetch)
    peak = {"device": budgets.fixed_device + used, "host": host_used, "disk": disk_used}
    return Plan(tuple(sorted(resident)), home, tuple(opt_home), prefetch, window, peak, predicted)


def simulate(costs: list[StageCost], bw: Bandwidths, home: tuple[str, ...], opt_home: tuple[str, ...],
             prefetch: int, steps: int = 3) -> Timeline:
    """Predict the timeline of `steps` steps under the executor's rules; step_time is the steady-state gap
    between the last two steps' ends. Rules: one compute, h2d, d2h, host and disk stream each, serial within a
    stream; a streamed stage's fetch for access k is issued when access k - prefetch starts computing and waits for
    its home copy (the previous step's update); gradients go to the host after each backward; updates start when
    the last backward is done (the global norm), in forward order; optimizer state on disk is read once the stage's
    backward is done and written back after its update."""
    n = len(costs)
    tl = Timeline()
    free = {s: 0.0 for s in ("compute", "h2d", "d2h", "host", "disk")}
    ready_param = [0.0] * n  # when each stage's parameters (home copy) are current
    ends = []

    def run(stream: str, label: str, start: float, dur: float) -> float:
        s = max(start, free[stream])
        free[stream] = s + dur
        tl.add(stream, label, s, s + dur)
        return s + dur

    for step in range(steps):
        seq = [("forward", i) for i in range(n - 1)] + [("head", n - 1)] + \
              [("backward", i) for i in range(n - 2, -1, -1)]
        starts: list[float] = []
        grads_at = [0.0] * n
        opt_at = [0.0] * n
        for k, (op, i) in enumerate(seq):
            dur = costs[i].forward_s if op == "forward" else costs[i].backward_s
            need = ready_param[i]
            if home[i] != "device":
                issue = starts[k - prefetch] if k >= prefetch else (starts[0] if starts else free["compute"])
                need = run("h2d", f"fetch {costs[i].name}", max(issue, ready_param[i]),
                           costs[i].param_bytes / bw.h2d)
            end = run("compute", f"{op} {costs[i].name}", need, dur)
            starts.append(end - dur)
            if op != "forward":
                grads_at[i] = end if home[i] == "device" else \
                    run("d2h", f"grad {costs[i].name}", end, costs[i].param_bytes / bw.d2h)
        norm_at = max(grads_at)
        on_disk = [i for i in range(n) if opt_home[i] == "disk"]

        def read(j: int, at: float) -> None:
            opt_at[j] = run("disk", f"read {costs[j].name}", at, costs[j].opt_bytes / bw.disk_read)

        for j in on_disk[:2]:
            read(j, norm_at)
        for i in range(n):
            if home[i] == "device":
                ready_param[i] = run("compute", f"update {costs[i].name}", norm_at, costs[i].update_device_s)
                continue
            ready_param[i] = run("host", f"update {costs[i].name}", max(norm_at, opt_at[i]), costs[i].update_host_s)
            if opt_home[i] == "disk":
                run("disk", f"write {costs[i].name}", ready_param[i], costs[i].opt_bytes / bw.disk_write)
                k = on_disk.index(i) + 2
                if k < len(on_disk):
                    read(on_disk[k], ready_param[i] - costs[i].update_host_s)
        ends.append(max(free["compute"], max(ready_param)))
    tl.step_time = ends[-1] - ends[-2] if steps > 1 else ends[-1]
    if not math.isfinite(tl.step_time):
        tl.step_time = float("inf")
    return tl
