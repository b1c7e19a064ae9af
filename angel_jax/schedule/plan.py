"""Plan: where every page family lives, what streams, how far ahead to prefetch, where updates run, and the
predicted timeline of a step.

Policy (Angel-PTM's unified scheduling, with whole stages as the unit of movement; micro-batches run layer-major,
so each access of a stage costs the compute of every micro-batch and the transfers of one):
1. Device memory first holds what every step needs regardless of placement (`Budgets.fixed_device`: saved stage
   inputs and the largest stage's working set) and a streaming window of `prefetch + 1` stages of parameter pages
   plus one stage of gradients on their way to the host.
2. What is left of the device budget keeps whole stages resident (parameters, gradients and optimizer state on the
   device, update on the device), preferring the stages that cost most to stream per second of compute that could
   hide the transfer: all of free device memory is used first, which is why a model that fits trains at in-memory
   speed.
3. The remaining stages stream, and each of their page families (parameters, gradients, optimizer state) is homed
   in pinned host memory while the host budget lasts, else on disk: the host then holds only a bounded window,
   never the model. Families go to disk cheapest first (per byte, per step): optimizer state (read once and
   written once, around its update), then gradients (written as the backward makes them, read by the update),
   then parameters (read for the forward, again for the backward, and around the update; written after it).
   Updates of streamed stages run on the host; disk-homed pages are staged through it (`OPT_STAGING` stages at a
   time) and gradients on their way to disk are bounded too (`GRAD_SPILL` stages). Lock-free mode
   (`staleness: 1`) keeps one more copy of parameters, the version in use while the next is written: host-homed
   ones in host memory, for at most `PENDING_VERSIONS` stages in use at a time (and the one updating); disk-homed
   ones as a second set of pages on disk (and the staged stages' new version in host memory beside the old one
   until it is written).
   Streamed stages whose every page family lives on the host may update on the device instead
   (`memory.streamed_updates`): their parameters, gradients and optimizer state cross the link to the device and
   the new pages cross back, `DEVICE_UPDATES_IN_FLIGHT` stages at a time, for which device memory is reserved
   (`update_bytes`). A link of ~50 GB/s each way moves a stage's state faster than a host update computes on it
   (~5-50 GB/s); the CPU backend gains nothing (its "device" is the same cores). `auto` plans both and keeps the
   host unless the device is predicted faster by more than noise. Such stages also add their gradient sums over
   accumulation passes on the device (the sum crossing both ways), in the device memory of their update.
4. The prefetch distance is the smallest that hides the transfers the cost model predicts (a deeper one only costs
   window memory), chosen by simulating the step for each candidate (simulate.py).
5. Accumulation passes: a step's micro-batches may run in P passes (P divides them), each layer-major over its
   share, so the device holds one pass's saved stage inputs (`Budgets.fixed_for`) and streamed stages are fetched
   once per access per pass, their gradients summed on the host between passes (never on disk: each pass adds into
   them). Fewer activations leave room for resident stages; more passes cost fetches. Every P is planned with every
   prefetch distance and the predicted fastest wins (more passes or a deeper prefetch only when predicted faster by
   more than 2%); `memory.passes` fixes P.

6. Data parallelism (ZeRO-3, `ranks` > 1): every page family is partitioned over the ranks, and the plan is one
   rank's: the costs are its shard's bytes and its calls' times, the budgets its tiers'. Each stage access gathers
   the whole stage's parameters, so the device also holds a window of whole stages (`gather_bytes`: the prefetch
   window's and the computing stage's gathered parameters, and one whole stage of gradients before their
   reduce-scatter), whatever is resident. The collectives' time (`Bandwidths.link`) is simulated as a stream of its
   own (simulate.py).

Every refusal is a `PlanError` that says how many bytes are missing and which `memory.*` key to raise.
"""

from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from angel_jax.errors import AngelError
from angel_jax.schedule.staging import (ACTIVATIONS_IN_FLIGHT, DEVICE_UPDATES_IN_FLIGHT, GRAD_SPILL, OPT_STAGING,
                                        OPT_STAGING_DEEP, PENDING_VERSIONS)
from angel_jax.schedule.simulate import Bandwidths, StageCost, simulate
from angel_jax.schedule.timeline import Timeline
from angel_jax.schedule.trace import compute_sequence

if TYPE_CHECKING:
    from angel_jax.memory.layout import PageLayout

__all__ = ["Bandwidths", "Budgets", "ModelBytes", "Plan", "PlanError", "StageCost", "load_bandwidths", "make_plan", "place_streamed"]


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

    cpu = raw.get("cpu_s_per_byte", {})
    cores = max(1, int(raw.get("machine", {}).get("cpu_count") or os.cpu_count() or 1))

    def cpu_share(key: str) -> float:  # CPU-seconds per byte over the cores: the compute time it takes
        value = cpu.get(key)
        return float(value) / cores if isinstance(value, (int, float)) and value > 0 else 0.0

    return Bandwidths(h2d=pick("h2d_pinned", Bandwidths.h2d), d2h=pick("d2h_pinned", Bandwidths.d2h),
                      disk_read=pick("disk_read", Bandwidths.disk_read),
                      disk_write=pick("disk_write", Bandwidths.disk_write), disk_read_cpu=cpu_share("disk_read"),
                      disk_write_cpu=cpu_share("disk_write"), source=str(path))


@dataclass(frozen=True)
class Budgets:
    device: int
    host: int | None
    """None: no limit."""
    disk: int | None
    """None: no limit; 0: no disk tier."""
    fixed_device: int
    """Device bytes the step needs whatever the placement: saved activations and the working set."""
    saved_device: int = 0
    """Of `fixed_device`, the saved stage inputs of the whole local batch: a plan of P accumulation passes holds
    one pass's, 1/P of them."""

    def fixed_for(self, passes: int) -> int:
        """`fixed_device` with the step run in `passes` accumulation passes."""
        return self.fixed_device - self.saved_device + -(-self.saved_device // passes)

    def parked_bytes(self, passes: int, saving_stages: int) -> int:
        """Bytes of one stage's saved input in one of `passes` passes, `saving_stages` stages saving theirs (the
        stage inputs of the whole batch shared evenly among them)."""
        return -(-self.saved_device // (passes * max(saving_stages, 1)))

    def fixed_parked(self, passes: int, saving_stages: int, prefetch: int) -> int:
        """`fixed_for(passes)` with the saved stage inputs parked in host memory (`memory.activations: host`):
        the device holds those on their way out (`ACTIVATIONS_IN_FLIGHT`), the one in use, and those the
        prefetch brings back (`prefetch`)."""
        held = ACTIVATIONS_IN_FLIGHT + 1 + prefetch
        return self.fixed_device - self.saved_device + held * self.parked_bytes(passes, saving_stages)


@dataclass(frozen=True)
class ModelBytes:
    """What budgets and plans judged from shapes need to know of a model (`Blueprint.sizes`)."""

    stages: list[StageCost]
    """Per stage its parameter and optimizer-state bytes, with no times."""
    params: PageLayout
    """The parameters' page layout on one device (unsharded)."""


@dataclass(frozen=True)
class Plan:
    resident: tuple[int, ...]
    """Stages whose pages (all families) live on the device; updated there."""
    home: tuple[str, ...]
    """Per stage, where its parameter pages live: 'device', 'host' or 'disk'."""
    grad_home: tuple[str, ...]
    """Per stage, where its gradient pages wait for the update: 'device', 'host' or 'disk'."""
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
    micro_batches: int = 1
    """Micro-batches per step, run layer-major (each stage access runs every one of its pass)."""
    passes: int = 1
    """Accumulation passes per step: each runs the forward and backward of `micro_batches / passes` micro-batches
    layer-major, so the device holds one pass's saved stage inputs, and streamed stages are fetched in every pass
    (their gradients summed on the host between passes)."""
    fixed_device: int = 0
    """Device bytes of activations and working set under this plan's passes."""
    ranks: int = 1
    """Data-parallel ranks the pages are partitioned over (ZeRO-3); bytes and times are one rank's."""
    gather_bytes: int = 0
    """Device bytes of whole stages gathered from the ranks' shards (0 with one rank)."""
    serial_step_time: float = 0.0
    """Predicted seconds of the same step with nothing overlapped (`without_overlap`): what overlap saves is the
    difference from `predicted.step_time`."""
    update_at: tuple[str, ...] = ()
    """Per stage, where its update runs: 'device' (resident stages, and streamed ones whose pages cross the link
    for it) or 'host'. Empty: 'device' for resident stages, 'host' for streamed ones."""
    update_bytes: int = 0
    """Device bytes reserved for the pages of streamed stages updated on the device, in flight."""
    parked_bytes: int = 0
    """Bytes of each stage's saved input in a pass, parked in pinned host memory between its forward and its
    backward (`memory.activations: host`); 0: saved inputs wait on the device."""
    opt_staging: int = OPT_STAGING
    """Stages of disk-homed pages held in host memory around their update (`OPT_STAGING`, or `OPT_STAGING_DEEP`
    where the host budget has room for it with at most more optimizer state on disk: `place_streamed`)."""

    @property
    def updates(self) -> tuple[str, ...]:
        """`update_at`, filled in."""
        return self.update_at or tuple("device" if h == "device" else "host" for h in self.home)

    @property
    def streamed_device_updates(self) -> tuple[int, ...]:
        """Streamed stages updated on the device."""
        return tuple(i for i, (h, u) in enumerate(zip(self.home, self.updates)) if h != "device" and u == "device")

    @property
    def streamed(self) -> tuple[int, ...]:
        return tuple(i for i, h in enumerate(self.home) if h != "device")

    def table(self, costs: list[StageCost]) -> list[dict]:
        """Home bytes per family per tier (the page table `angel-jax plan` prints). Gradients of streamed stages
        wait for their update on the host or the disk; on the device only a window of them exists at a time
        (counted in the window)."""
        rows = []
        for tier in ("device", "host", "disk"):
            params = sum(c.param_bytes for c, h in zip(costs, self.home) if h == tier)
            grads = sum(c.param_bytes for c, h in zip(costs, self.grad_home) if h == tier)
            opt = sum(c.opt_bytes for c, h in zip(costs, self.opt_home) if h == tier)
            rows.append({"tier": tier, "params": params, "gradients": grads, "optimizer": opt})
        return rows

    def io_per_step(self, costs: list[StageCost], bandwidths: Bandwidths) -> dict[str, float]:
        """Bytes each copy path moves per step under this plan, and the seconds that takes at `bandwidths`: a
        streamed stage's parameters go to the device once per access (forward and backward; the head once), its
        gradients come back once. Disk-homed parameters are read for every access and once more for their update,
        and written after it; disk-homed gradients are written once and read once; disk-homed optimizer state is
        read and written once per update. `io_bound_s` is the slowest path's time: no step can be shorter."""
        return io_per_step(costs, bandwidths, self.home, self.grad_home, self.opt_home, self.passes, self.prefetch,
                           self.ranks, self.micro_batches, self.updates, self.parked_bytes)

    def stream_seconds(self, first_stage: str) -> dict[str, float]:
        """Seconds each stream of the predicted timeline works in one steady-state step: the events between the
        starts of the last two simulated steps' first forward (of stage `first_stage`), clipped to that window."""
        starts = sorted(e.start for e in self.predicted.events if e.label == f"forward {first_stage}")
        if len(starts) < 2:
            return {}
        lo, hi = starts[-2], starts[-1]
        busy: dict[str, float] = {}
        for e in self.predicted.events:
            overlap = min(e.end, hi) - max(e.start, lo)
            if overlap > 0:
                busy[e.stream] = busy.get(e.stream, 0.0) + overlap
        return busy

    def bound(self, first_stage: str) -> tuple[str, dict[str, float]]:
        """What bounds the predicted step, and each stream's busy share of it: 'compute' when the compute stream
        works at least 90% of the step, else another stream that works at least 90% of it (the busiest: e.g. a
        disk busy the whole step, or host updates one step behind that take it), else what the compute waited for
        longest ('h2d', 'disk', 'host' or, with several ranks, 'collective': `Timeline.waits`), else (on shared
        cores, where waits are not told apart) 'compute'."""
        busy = self.stream_seconds(first_stage)
        step = self.predicted.step_time or 1.0
        streams = ("compute", "h2d", "d2h", "host", "disk") + (("collective",) if self.ranks > 1 else ())
        shares = {s: busy.get(s, 0.0) / step for s in streams}
        waits = self.predicted.waits
        if shares["compute"] >= 0.9:
            return "compute", shares
        busiest = max(streams, key=shares.get)
        if shares[busiest] >= 0.9:
            return busiest, shares
        if not waits:
            return "compute", shares
        return max(waits, key=waits.get), shares

    def summary(self) -> dict:
        ranks = {"ranks": self.ranks, "gather_bytes": self.gather_bytes} if self.ranks > 1 else {}
        return {**ranks, "resident": len(self.resident), "streamed": len(self.streamed), "prefetch": self.prefetch,
                "params_on_disk": self.home.count("disk"), "grads_on_disk": self.grad_home.count("disk"),
                "opt_on_disk": self.opt_home.count("disk"), "staleness": self.staleness,
                "micro_batches": self.micro_batches, "passes": self.passes,
                "streamed_device_updates": len(self.streamed_device_updates),
                "activations_parked_bytes": self.parked_bytes, "opt_staging": self.opt_staging,
                "predicted_step_s": self.predicted.step_time, "serial_step_s": self.serial_step_time,
                "peak_bytes": dict(self.peak_bytes)}


def io_per_step(costs: list[StageCost], bandwidths: Bandwidths, home: tuple[str, ...], grad_home: tuple[str, ...],
                opt_home: tuple[str, ...], passes: int = 1, prefetch: int = 1, ranks: int = 1,
                micro_batches: int = 1, update_at: tuple[str, ...] = (), parked_bytes: int = 0) -> dict[str, float]:
    """See `Plan.io_per_step`; with several passes, every pass fetches the streamed stages and sends their gradients
    to the host. A streamed stage updated on the device (`update_at`) also sends its parameters, gradients and
    optimizer state to the device for the update, and its new parameters and optimizer state back, and with
    several passes its gradient sum to the device in every pass after the first (added there). Saved stage
    inputs parked in host memory (`parked_bytes` each, every stage but the head in every pass) cross both ways.
    With several ranks, also the bytes each rank receives in collectives (`collective_bytes`) and their seconds at
    `bandwidths.link` (0 when no link is given)."""
    accesses = fetches_per_step(len(costs), passes, prefetch)
    streamed = [i for i, h in enumerate(home) if h != "device"]
    h2d = sum(accesses[i] * costs[i].param_bytes for i in streamed)
    d2h = passes * sum(costs[i].param_bytes for i in streamed)
    on_device = [i for i in streamed if update_at and update_at[i] == "device"]
    # (in: parameters, gradients, optimizer state, and the gradient sum of every pass after the first; out: the
    # new parameters and optimizer state)
    h2d += sum((1 + passes) * costs[i].param_bytes + costs[i].opt_bytes for i in on_device)
    d2h += sum(costs[i].param_bytes + costs[i].opt_bytes for i in on_device)
    parked = passes * (len(costs) - 1) * parked_bytes  # each way
    h2d, d2h = h2d + parked, d2h + parked
    read = sum((accesses[i] + 1) * costs[i].param_bytes for i in streamed if home[i] == "disk") \
        + sum(costs[i].param_bytes for i in streamed if grad_home[i] == "disk") \
        + sum(c.opt_bytes for c, h in zip(costs, opt_home) if h == "disk")
    write = sum(costs[i].param_bytes for i in streamed if home[i] == "disk") \
        + sum(costs[i].param_bytes for i in streamed if grad_home[i] == "disk") \
        + sum(c.opt_bytes for c, h in zip(costs, opt_home) if h == "disk")
    seconds = {"h2d_s": h2d / bandwidths.h2d, "d2h_s": d2h / bandwidths.d2h,
               "disk_read_s": read / bandwidths.disk_read, "disk_write_s": write / bandwidths.disk_write}
    # One disk serves reads and writes: its time is their sum.
    disk_s = seconds["disk_read_s"] + seconds["disk_write_s"]
    collective = {}
    if ranks > 1:
        received = collective_bytes(costs, passes, ranks, micro_batches)
        collective = {"collective_bytes": received,
                      "collective_s": received / bandwidths.link if bandwidths.link > 0 else 0.0}
    return {"h2d_bytes": h2d, "d2h_bytes": d2h, "disk_read_bytes": read, "disk_write_bytes": write, **seconds,
            **collective, "io_bound_s": max(seconds["h2d_s"], seconds["d2h_s"], disk_s,
                                            collective.get("collective_s", 0.0))}


def collective_bytes(costs: list[StageCost], passes: int, ranks: int, micro_batches: int = 1) -> int:
    """Bytes each rank receives in the collectives of a step: per pass, an all-gather of every stage's parameters
    for each of its accesses and a reduce-scatter of its gradients after its backward, each (ranks - 1) x the
    stage's shard bytes (the ring algorithm), a rank's own experts excepted; and with experts split over the ranks,
    (ranks - 1) / ranks of each micro-batch's all-to-alls (`StageCost.exchange_bytes`, twice in a backward)."""
    per_pass = sum(costs[i].gathered_bytes for _, i in compute_sequence(len(costs))) + \
        sum(c.gathered_bytes for c in costs)
    return int(passes * (ranks - 1) * per_pass + (ranks - 1) * exchange_bytes(costs, micro_batches) / ranks)


def exchange_bytes(costs: list[StageCost], micro_batches: int) -> float:
    """Bytes of a step's expert all-to-alls on one rank, its own share included: every micro-batch's forward
    (`StageCost.exchange_bytes`), twice over in its backward."""
    return micro_batches * sum(costs[i].exchange_bytes * (1 if op == "forward" else 2)
                               for op, i in compute_sequence(len(costs)))


def fetches_per_step(n: int, passes: int = 1, prefetch: int = 1) -> list[int]:
    """Per stage, how often a streamed stage's pages go to the device in a step: once per access, but not for an
    access within `prefetch` accesses of the stage's previous one in the step, whose pages are still held
    (simulate.py's rule)."""
    fetches, last = [0] * n, {}
    for k, (_, i) in enumerate(compute_sequence(n) * passes):
        if last.get(i, -prefetch - 2) < k - prefetch:
            fetches[i] += 1
        last[i] = k
    return fetches


def window_bytes(costs: list[StageCost], streamed: list[int], prefetch: int) -> int:
    if not streamed:
        return 0
    biggest = max(costs[i].param_bytes for i in streamed)
    # prefetch + 1 stages of parameters in flight, plus one stage of gradients on its way to the host.
    return (prefetch + 1) * biggest + biggest


def gather_bytes(costs: list[StageCost], prefetch: int, ranks: int) -> int:
    """Device bytes of whole stages gathered from `ranks` shards: the parameters of the stage computing and of the
    `prefetch` accesses ahead whose gathers may run beside it, and one whole stage of gradients before their
    reduce-scatter; each the largest stage's shard x `ranks` (a rank's own experts once: they are not gathered).
    Nothing with one rank."""
    if ranks <= 1 or not costs:
        return 0
    return (prefetch + 2) * max(ranks * c.gathered_bytes + c.expert_bytes for c in costs)


def minimum_device_bytes(costs: list[StageCost], budgets: Budgets, passes: int = 1, ranks: int = 1,
                         device_updates: bool = False, park: bool = False) -> int:
    """The smallest device budget any plan of `passes` passes fits: everything streamed, prefetch 1 (with
    `device_updates`, their updates on the device; with `park`, the saved stage inputs in host memory)."""
    every = list(range(len(costs)))
    return fixed_of(budgets, passes, len(costs), 1, park) + window_bytes(costs, every, 1) \
        + gather_bytes(costs, 1, ranks) + (update_window(costs, every) if device_updates else 0)


def fixed_of(budgets: Budgets, passes: int, n: int, prefetch: int, park: bool) -> int:
    """The device's activations and working set in a plan of `passes` passes over `n` stages: with `park`, the
    saved inputs (of every stage but the head, which computes on the last forward's output) wait in host memory."""
    return budgets.fixed_parked(passes, n - 1, prefetch) if park else budgets.fixed_for(passes)


def activation_options(activations: str, shared_cpu: bool, budgets: Budgets, passes: int,
                       ranks: int = 1) -> list[bool]:
    """Whether to plan the saved stage inputs parked in host memory (`memory.activations`): [False] (on the
    device), [True], or both, the device first. `auto` parks only in one pass (parking is the alternative to
    passes that fetch every stage again), never on shared cores, where host and device memory are one RAM, nor
    with pages sharded over several ranks."""
    auto = not shared_cpu and budgets.saved_device > 0 and passes == 1 and ranks == 1
    return _choice("memory.activations", activations, "device", "host", ranks, auto)


def _choice(key: str, value: str, base: str, other: str, ranks: int, auto: bool, sharded: bool = False
            ) -> list[bool]:
    """The options of a placement key set to `value` (one of 'auto', `base`, `other`): [False] (`base`), [True]
    (`other`; with pages sharded over several ranks only where `sharded` says it is built), or with 'auto' where
    `auto` holds, both."""
    if value not in ("auto", base, other):
        raise PlanError(f"{key} must be auto, {base} or {other}, got {value!r}")
    if value == other:
        if ranks > 1 and not sharded:
            raise PlanError(f"{key}={other} is not built for pages sharded over several ranks (ZeRO-3); use {base} "
                            "or auto")
        return [True]
    return [False, True] if value == "auto" and auto else [False]


def pass_options(micro_batches: int) -> list[int]:
    """The accumulation passes a step of `micro_batches` micro-batches can run in: the divisors, fewest first."""
    return [p for p in range(1, micro_batches + 1) if micro_batches % p == 0]


def make_plan(costs: list[StageCost], bw: Bandwidths, budgets: Budgets, *, staleness: int = 0,
              shared_cpu: bool = False, max_prefetch: int = 3, micro_batches: int = 1,
              passes: int | None = None, ranks: int = 1, overlap: bool = True,
              streamed_updates: str = "host", activations: str = "device") -> Plan:
    """`costs`: per stage, the times of one call (one micro-batch); a step runs `micro_batches` calls per
    access, in `passes` accumulation passes (None: the planner chooses among `pass_options`). The plan predicted
    fastest wins; more passes or a deeper prefetch only when predicted faster by more than noise (2%).
    `ranks` > 1: data-parallel ranks over which every page family is partitioned (ZeRO-3); `costs` and `budgets`
    are then one rank's (its shard's bytes, its calls on its local rows, its tiers), and `bw.link` the bytes per
    second each rank moves in a collective (0: not modelled). Every plan also carries its step with nothing
    overlapped (`serial_step_time`); with `overlap=False` (`memory.overlap: false`) that is its predicted step too,
    the homes being chosen as for the overlapped step. `streamed_updates` (`memory.streamed_updates`): where
    streamed stages whose pages live on the host update, 'host', 'device' or 'auto' (both planned, the device only
    when predicted faster by more than noise; the host on shared cores). `activations`
    (`memory.activations`): where saved stage inputs wait for the backward, 'device', 'host' or 'auto'
    (`activation_options`). The first option of each choice is the base: a refusal of another is passed over."""
    n = len(costs)
    if staleness and ranks > 1:  # (as the engine refuses it: schedule/blueprint.py)
        raise PlanError("'memory.staleness': lock-free updates (1) need pages on one device; with pages sharded "
                        "over several ranks updates are exact (0)")
    if ranks < 1:
        raise PlanError(f"a plan needs at least one data-parallel rank, got ranks={ranks}")
    if passes is not None and (passes < 1 or micro_batches % passes):
        raise PlanError(f"memory.passes={passes} does not divide the step's {micro_batches} micro-batches: use one "
                        f"of {pass_options(micro_batches)}, or 0 to let the planner choose")
    best: Plan | None = None
    options = update_options(streamed_updates, shared_cpu, ranks)
    for p in ([passes] if passes else pass_options(micro_batches)):
        parks = activation_options(activations, shared_cpu, budgets, p, ranks)
        for prefetch in range(1, max_prefetch + 1):
            for on_device in options:
                for park in parks:
                    try:
                        plan = _plan_for(costs, bw, budgets, prefetch, n, staleness, shared_cpu, micro_batches, p,
                                         ranks, on_device, park)
                    except PlanError:
                        if (on_device, park) != (options[0], parks[0]):
                            continue  # (another option may not fit the host where the base one does: it decides)
                        raise
                    if plan is None:
                        continue
                    if best is None or plan.predicted.step_time < best.predicted.step_time * 0.98:
                        best = plan
    if best is None:
        most = passes or micro_batches  # the fewest activations any plan holds
        park = activation_options(activations, shared_cpu, budgets, most, ranks) == [True]
        need = minimum_device_bytes(costs, budgets, most, ranks, device_updates=options[0], park=park)
        if need <= budgets.device and most > 1:
            # The device holds the step: what refused every plan is the host, which keeps the streamed stages'
            # gradient sums between passes. Name that, not the device.
            place_streamed(costs, budgets, list(range(n)), staleness, most)
        gathered = gather_bytes(costs, 1, ranks)
        whole = f" + whole stages gathered from {ranks} ranks' shards {gathered:,} B" if gathered else ""
        updating = update_window(costs, list(range(n))) if options[0] else 0
        updates = f" + {DEVICE_UPDATES_IN_FLIGHT} stages updated on the device {updating:,} B" if updating else ""
        other = " or memory.streamed_updates=host" if updating else ""
        fixed = fixed_of(budgets, most, n, 1, park)
        parked = ", stage inputs parked in host memory" if park else ""
        raise PlanError(f"device budget {budgets.device:,} B cannot hold the step's minimum {need:,} B "
                        f"(activations and working set {fixed:,} B in {most} accumulation "
                        f"pass{'es' if most > 1 else ''}{parked} + a streaming window of "
                        f"{need - fixed - gathered - updating:,} B{whole}{updates}): "
                        f"{need - budgets.device:,} B missing; raise "
                        f"memory.device_budget, or lower train.micro_batch_size / model.seq_len{other}")
    serial = without_overlap(best, costs, bw, shared_cpu)
    return dataclasses.replace(best, serial_step_time=serial.step_time, predicted=best.predicted if overlap else serial)


def update_options(streamed_updates: str, shared_cpu: bool, ranks: int) -> list[bool]:
    """Whether to plan streamed stages' updates on the device: [False] (the host), [True], or both, the host first
    (`memory.streamed_updates`)."""
    return _choice("memory.streamed_updates", streamed_updates, "host", "device", ranks, not shared_cpu,
                   sharded=True)


def update_window(costs: list[StageCost], on_device: list[int]) -> int:
    """Device bytes of `DEVICE_UPDATES_IN_FLIGHT` stages' update pages (parameters, gradients, optimizer state;
    the new pages reuse their buffers), the largest of `on_device`, streamed stages updated on the device."""
    if not on_device:
        return 0
    return DEVICE_UPDATES_IN_FLIGHT * max(2 * costs[i].param_bytes + costs[i].opt_bytes for i in on_device)


def without_overlap(plan: Plan, costs: list[StageCost], bw: Bandwidths, shared_cpu: bool) -> Timeline:
    """The plan's step with every copy, disk transfer, computation and update alone, one after another (what the
    executor runs with `memory.overlap: false`): the sum of the step's parts."""
    return simulate(costs, bw, plan.home, plan.opt_home, plan.prefetch, grad_home=plan.grad_home,
                    staleness=plan.staleness, shared_cpu=shared_cpu, micro_batches=plan.micro_batches,
                    passes=plan.passes, ranks=plan.ranks, overlap=False, update_at=plan.updates,
                    parked_bytes=plan.parked_bytes, opt_staging=plan.opt_staging)


def _resident_bytes(c: StageCost) -> int:
    return 2 * c.param_bytes + c.opt_bytes  # params, grads, optimizer state


def _plan_for(costs: list[StageCost], bw: Bandwidths, budgets: Budgets, prefetch: int, n: int, staleness: int,
              shared_cpu: bool, micro_batches: int, passes: int, ranks: int = 1,
              device_updates: bool = False, park: bool = False) -> Plan | None:
    resident: list[int] = []
    fixed = fixed_of(budgets, passes, n, prefetch, park)
    parked = budgets.parked_bytes(passes, n - 1) if park else 0
    parked_pass = parked * (n - 1)  # a pass's saved inputs, waiting in host memory beside the pages
    if budgets.host is not None and parked_pass:
        if budgets.host < parked_pass:
            return None
        budgets = dataclasses.replace(budgets, host=budgets.host - parked_pass)
    gathered = gather_bytes(costs, prefetch, ranks)  # needed whatever is resident: every access gathers
    free = budgets.device - fixed - gathered
    # Prefer keeping the stages whose streaming costs most per unit of compute that could hide it.
    order = sorted(range(n), key=lambda i: -(costs[i].param_bytes / max(costs[i].forward_s + costs[i].backward_s,
                                                                          1e-12)))
    kept, held = set(), 0  # (a set and a running sum: deep models have hundreds of stages)
    for i in order:
        streamed = [j for j in range(n) if j not in kept and j != i]
        need = held + _resident_bytes(costs[i]) + window_bytes(costs, streamed, prefetch) \
            + (update_window(costs, streamed) if device_updates else 0)
        if need <= free:
            resident.append(i)
            kept.add(i)
            held += _resident_bytes(costs[i])
    streamed = [j for j in range(n) if j not in resident]
    window = window_bytes(costs, streamed, prefetch)
    used = sum(_resident_bytes(costs[j]) for j in resident) + window
    if used + (update_window(costs, streamed) if device_updates else 0) > free:
        return None
    try:
        home, grad_home, opt_home, host_used, disk_used, staging = place_streamed(costs, budgets, streamed,
                                                                                  staleness, passes)
    except PlanError:
        if passes == 1:
            raise
        return None  # (gradients summed over passes stay on the host: more passes may not fit where one does)
    # (a stage with a family on disk is staged through the host for its update: it updates there)
    update_at = tuple("device" if h == "device" or (device_updates and h == g == o == "host") else "host"
                      for h, g, o in zip(home, grad_home, opt_home))
    reserved = update_window(costs, [j for j in streamed if update_at[j] == "device"])
    predicted = simulate(costs, bw, home, opt_home, prefetch, grad_home=grad_home, staleness=staleness,
                         shared_cpu=shared_cpu, micro_batches=micro_batches, passes=passes, ranks=ranks,
                         update_at=update_at, parked_bytes=parked, opt_staging=staging)
    peak = {"device": fixed + gathered + used + reserved, "host": host_used + parked_pass, "disk": disk_used}
    return Plan(tuple(sorted(resident)), home, grad_home, opt_home, prefetch, window, peak, staleness, predicted,
                micro_batches, passes, fixed, ranks, gathered, update_at=update_at, update_bytes=reserved,
                parked_bytes=parked, opt_staging=staging)


Homes = tuple[tuple[str, ...], tuple[str, ...], tuple[str, ...]]


def min_host_bytes(costs: list[StageCost], staleness: int = 0) -> int:
    """The host memory any placement needs at least: its window with every stage streamed and every page family
    on disk (a plan that streams fewer stages stages fewer)."""
    every = tuple("disk" for _ in costs)
    return host_bytes(costs, (every, every, every), staleness)


def host_bytes(costs: list[StageCost], homes: Homes, staleness: int, staging: int = OPT_STAGING,
               passes: int = 1) -> int:
    """Host memory a placement needs at its peak: the host-homed pages (lock-free mode: second versions of
    host-homed parameters, `PENDING_VERSIONS` kept for stages in use and the one being computed, of the largest
    such stages), the disk-homed pages of `staging` stages staged around their update (the largest such
    stages; exact mode updates disk-homed parameters in place, lock-free mode writes the new version beside the
    old, which a step may still be reading), and `GRAD_SPILL` stages of gradients on their way to disk.
    Host-homed gradients are one set (lock-free with one pass, a stage's new ones wait in the backward until the
    update before took the old: `PageUpdater.make_room_for_grads`); two steps' with several `passes`, whose sums
    start in the first pass while the stages are held for the last."""
    home, grad_home, opt_home = homes
    host_params = sorted((c.param_bytes for c, h in zip(costs, home) if h == "host"), reverse=True)
    homed = sum(host_params) + (sum(host_params[:PENDING_VERSIONS + 1]) if staleness else 0) \
        + (1 + (staleness if passes > 1 else 0)) * sum(c.param_bytes for c, h in zip(costs, grad_home) if h == "host") \
        + sum(c.opt_bytes for c, h in zip(costs, opt_home) if h == "host")
    staged = sorted(((1 + staleness) * c.param_bytes * (h == "disk") + c.param_bytes * (g == "disk")
                     + c.opt_bytes * (o == "disk") for c, h, g, o in zip(costs, home, grad_home, opt_home)),
                    reverse=True)
    spill = max((c.param_bytes for c, g in zip(costs, grad_home) if g == "disk"), default=0)
    return homed + sum(staged[:staging]) + GRAD_SPILL * spill


def disk_bytes(costs: list[StageCost], homes: Homes, staleness: int = 0) -> int:
    """Bytes on the disk tier: disk-homed gradients have a second set in lock-free mode (two steps' in flight), and
    so have disk-homed parameters (the version a step is using and the one being written)."""
    home, grad_home, opt_home = homes
    return sum(c.param_bytes * (1 + staleness) * ((h == "disk") + (g == "disk")) + c.opt_bytes * (o == "disk")
               for c, h, g, o in zip(costs, home, grad_home, opt_home))


def place_streamed(costs: list[StageCost], budgets: Budgets, streamed: list[int], staleness: int,
                   passes: int = 1) -> tuple[tuple[str, ...], tuple[str, ...], tuple[str, ...], int, int, int]:
    """Homes of the streamed stages' page families: the host while the host budget lasts, then the disk, cheapest
    family first (optimizer state, gradients, parameters; within a family the last stages first). With several
    accumulation passes gradients stay on the host, where each pass adds into them. The homes are chosen with
    `OPT_STAGING` stages staged; one more (`OPT_STAGING_DEEP`) where the host has room for it with at most more
    optimizer state on disk, never gradients or parameters. Returns (param homes, gradient homes, optimizer
    homes, host bytes, disk bytes, stages staged); resident stages are 'device'."""
    n = len(costs)
    homes = [["device" if i not in streamed else "host" for i in range(n)] for _ in range(3)]  # params, grads, opt

    def frozen() -> Homes:
        return tuple(homes[0]), tuple(homes[1]), tuple(homes[2])

    # The least host memory any placement needs: everything streamed on disk (or, with no disk tier, on the host).
    # A refusal names this figure, not only the first shortfall, which would be refused again further on.
    all_disk = [["disk" if i in streamed else "device" for i in range(n)] for _ in range(3)]
    if passes > 1:
        all_disk[1] = list(homes[1])
    least = host_bytes(costs, frozen(), staleness, passes=passes) if budgets.disk == 0 else \
        host_bytes(costs, (tuple(all_disk[0]), tuple(all_disk[1]), tuple(all_disk[2])), staleness, passes=passes)
    moves = [(family, i) for family in ((2, 0) if passes > 1 else (2, 1, 0)) for i in reversed(streamed)]
    while budgets.host is not None and host_bytes(costs, frozen(), staleness, passes=passes) > budgets.host:
        if budgets.disk == 0:
            raise PlanError(f"host budget {budgets.host:,} B cannot hold the streamed stages' parameters, gradients "
                            f"and optimizer state ({least:,} B) and there is no disk tier: set memory.disk_dir, or "
                            f"raise memory.host_budget to at least {least:,} B or memory.device_budget")
        if not moves:
            grads, device = (f"and {GRAD_SPILL} stages of gradients on their way to disk", "") if passes == 1 else (
                f"and every streamed stage's gradients, summed on the host between the step's {passes} "
                "accumulation passes", " (resident stages sum their gradients on the device)")
            raise PlanError(f"host budget {budgets.host:,} B cannot hold the paged engine's host window ({least:,} B "
                            f"with every streamed page on disk: {OPT_STAGING} stages staged around their update "
                            f"{grads}): raise memory.host_budget to at least {least:,} B or "
                            f"memory.device_budget{device}")
        family, i = moves.pop(0)
        homes[family][i] = "disk"
    # One stage more staged where the host holds it with at most more optimizer state on disk (read and written
    # once a step, in the chain the deeper staging speeds up), never gradients or parameters.
    staging, deep = OPT_STAGING, [list(h) for h in homes]
    more = [i for i in reversed(streamed) if deep[2][i] == "host"] if budgets.disk != 0 else []

    def deep_bytes() -> int:
        return host_bytes(costs, (tuple(deep[0]), tuple(deep[1]), tuple(deep[2])), staleness, OPT_STAGING_DEEP,
                          passes)

    while budgets.host is not None and deep_bytes() > budgets.host and more:
        deep[2][more.pop(0)] = "disk"
    deep_homes: Homes = (tuple(deep[0]), tuple(deep[1]), tuple(deep[2]))
    if (budgets.host is None or deep_bytes() <= budgets.host) and \
            (budgets.disk is None or disk_bytes(costs, deep_homes, staleness) <= budgets.disk):
        homes, staging = deep, OPT_STAGING_DEEP
    placed = frozen()
    disk_used = disk_bytes(costs, placed, staleness)
    if budgets.disk is not None and disk_used > budgets.disk:
        on_disk = [costs[i].name for i in streamed if any(h[i] == "disk" for h in homes)]
        raise PlanError(f"host budget {budgets.host:,} B holds the streamed stages' pages only with {disk_used:,} B "
                        f"of them (stages {on_disk[0]!r}..{on_disk[-1]!r}) on disk, and they need the disk tier: "
                        f"give the disk tier more than "
                        f"{budgets.disk:,} B (memory.disk_budget, or free space in memory.disk_dir) or raise "
                        "memory.host_budget")
    return (*placed, host_bytes(costs, placed, staleness, staging, passes), disk_used, staging)
