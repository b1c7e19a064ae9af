"""The predicted timeline: the executor's rules replayed on the cost model, stream by stream.

    timeline = simulate(costs, bandwidths, home, opt_home, prefetch, staleness=0, shared_cpu=False)
    timeline.step_time   # steady-state seconds per step

Rules (those of execute.py and updater.py):
- Micro-batches run layer-major: a stage access computes for `micro_batches / passes` times the stage's profiled
  time per micro-batch (a micro-batch's share of the call that scans them); its transfers are those of one access.
- With `passes` accumulation passes the step runs the whole forward and backward sequence once per pass, each over
  its share of the micro-batches: a streamed stage is fetched for every access of every pass, its gradients go to
  the host after every pass's backward, and from the second pass on they are added there into the stage's sum
  (`host_add_s`, on the host stream); a stage updated on the device (`update_at`) adds on the device instead, its
  sum so far crossing to the device (h2d) from the start of its backward. A stage's first fetch in a step waits
  for its update; later passes do not. Computations of later passes are labelled with their pass ("forward embed
  (pass 2)"), so the label of the first stage's forward marks the start of a step, as in the measured timeline.
- One compute stream, one h2d and one d2h copy stream, one host stream (optimizer updates on the CPU) and one disk
  stream; work within a stream is serial, in the executor's order.
- A streamed stage's pages stay on the device from one access to the next when that one is within the prefetch
  window (`prefetch` accesses ahead: the executor holds pages while any access in its window needs them), e.g.
  stage 0 between one pass's backward and the next pass's forward; otherwise each access fetches them.
- A streamed stage's fetch for access k may start once access k - prefetch has started computing (the window frees
  its slot) and, for the stage's first access in a step, once its home copy holds the previous update (exact mode;
  lock-free mode skips that wait when the update is not finished: the stage runs one update behind, host- and
  disk-homed alike; a disk-homed one reads the version before from its other set of pages).
- A resident stage's compute waits for its previous update on the device.
- Gradients of streamed stages go to the host after their backward (d2h).
- Updates start once the last backward is done (the global norm is needed for clipping, and the guard's verdict on
  the loss and gradient norm before any update), in the updater's order (`staging.update_order`: forward order;
  lock-free, the exact stages first and the others from the last back): resident stages on the compute stream,
  streamed ones on the host stream after their gradients arrived. (The updater's wait for a release when
  `PENDING_VERSIONS` new versions are kept for stages in use is not modelled.)
- A streamed stage updated on the device (`update_at`, `memory.streamed_updates`): its parameters, gradients and
  optimizer state cross to the device (h2d), the update runs there, and the new parameters and optimizer state
  cross back (d2h); its update is complete when they are home. At most `DEVICE_UPDATES_IN_FLIGHT` stages are on
  the device at a time (a stage's copies in wait for the new pages of the one that many stages before to be home).
  The update kernels (memory-bound: milliseconds a stage, against a step's seconds) run on the device between the
  next step's computations, which do not wait for the ones of later stages; they are drawn on an `update` row of
  their own, not on the compute stream's clock. The updater issues the stages' crossings one stage after the
  other as the in-flight bound lets it, while the next step's fetches are issued: each copy stream runs them in
  the order they were issued (a fetch issued before a later stage's crossings goes first), not every update's
  crossings before the next step's first fetch.
- Disk-homed parameters are read from disk before their fetch to the device (each access); disk-homed gradients
  are written to disk after their d2h copy.
- Saved stage inputs parked in host memory (`parked_bytes`): a forward's input goes to the host (d2h) once the
  forward is done; a backward's comes back (h2d) from when a fetch for that access would start, and the backward
  waits for it.
- Data parallelism (ZeRO-3, `ranks` > 1 with `Bandwidths.link` > 0): the costs are one rank's (its shard of each
  stage's pages, its calls on its local rows), and every rank runs the same timeline, so one rank's is simulated.
  A `collective` stream (serial, in the order the executor issues its work) carries, before every stage access
  (forward and backward, every pass; the head's one), an all-gather of the stage's parameters, and after every
  backward (and the head) a reduce-scatter of its gradients. With the ring algorithm each moves (ranks - 1) x the
  shard's bytes through each rank's link: (ranks - 1) x param_bytes / link seconds (a rank's own experts,
  `StageCost.expert_bytes`, are neither gathered nor scattered; the expert all-to-alls lengthen the stage calls). The gather of access k is
  issued with the fetch of its shard (once access k - prefetch has started computing) and starts once the shard is
  on the device (a streamed stage: after its fetch; a resident one: after its update); access k computes once its
  gather is done. A reduce-scatter is issued when its backward ends, so the gathers issued before that (those of
  the prefetch window) go first. A streamed stage's gradient shard goes to the host (d2h) after its
  reduce-scatter; a resident stage's waits for its update on the device.
- Disk-homed parameters and optimizer state are read `opt_staging` stages ahead of their update (the first ones
  under the previous step's forward pass; disk-homed gradients once the backward is over) and written back after
  it.
- `shared_cpu`: on the CPU backend the "device" is the CPU itself, and copies between memory kinds and host
  updates are work for the same cores as compute: their streams share the compute stream's clock (they appear on
  their own rows in the picture, but never overlap compute). On the 2-core VM this lands within ~10% of measured
  steps either side (XLA's kernels leave part of the second core to the copies and updates at times); treating
  the streams as independent there predicted 15-25% too fast. Disk transfers there also cost the cores CPU time
  (`Bandwidths.disk_read_cpu`/`disk_write_cpu`, measured by `angel-jax bench io`), charged to the compute clock
  (`io_cpu` row) from the transfer's start: without it, a step with every page family on disk was predicted
  30% faster than measured (2 CPU-s per GB written on the 2-vCPU VM).
- `overlap=False` (`memory.overlap: false`): the executor waits for every piece of work before it issues the next,
  so every stream, the disk's included, runs on one clock: the step is the sum of its parts, whatever their order.
  What overlap gains is the difference from the same plan simulated with overlap.

The step time is the distance between the starts of the first forward of the last two simulated steps.
`Timeline.waits` holds the last step's idle compute time by what the compute waited for: 'h2d' (a fetch, its
transfer or the copy stream's queue), 'disk' (a read of parameters, or an update that waited for its disk reads),
'host' (an update on the host: its queue, its gradients, the global norm), 'collective' (an all-gather, past the
moment the stage's shard was ready; before the device updates, the last reduce-scatters); on shared cores (the CPU
backend), where every stream runs on the compute clock, nothing is recorded.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from angel_jax.schedule.staging import DEVICE_UPDATES_IN_FLIGHT, OPT_STAGING, update_order
from angel_jax.schedule.timeline import Timeline
from angel_jax.schedule.trace import compute_sequence


@dataclass(frozen=True)
class StageCost:
    name: str
    param_bytes: int
    """Bytes of the stage's parameter pages (what streams to the device; its gradients are the same size)."""
    opt_bytes: int
    """Bytes of the stage's optimizer-state pages."""
    forward_s: float
    """Seconds per micro-batch (one call; with several micro-batches, a micro-batch's share of the call)."""
    backward_s: float
    """Recompute + vjp (for the head: loss and gradients), per micro-batch as `forward_s`."""
    update_device_s: float
    update_host_s: float
    host_add_s: float = 0.0
    """Seconds of one float32 add of the stage's gradient pages on the host: with several accumulation passes,
    each pass after the first adds its gradients into the stage's sum there (streamed stages)."""
    lender: int | None = None
    """The index of the stage whose parameters this stage's calls also read (`StagedModel.borrows`, a tied head):
    they must be on the device too, fetched again where the lender streams and is not in the window."""
    expert_bytes: int = 0
    """Of `param_bytes`, those of the rank's own experts (expert parallelism): they stay on the rank, neither
    gathered nor reduce-scattered."""
    exchange_bytes: float = 0.0
    """Bytes of the expert all-to-alls of one forward call (a micro-batch) on one rank: the tokens' slots of every
    expert out and their outputs back, of which a rank sends (ranks - 1) / ranks. They wait on the call's own
    routing, so they sit inside the call: (ranks - 1) / ranks x this / link seconds per forward, twice per
    backward (the recomputed forward's, and their transposes)."""

    @property
    def gathered_bytes(self) -> int:
        """Parameter bytes of the stage's shard that the collectives gather and reduce-scatter."""
        return self.param_bytes - self.expert_bytes


@dataclass(frozen=True)
class Bandwidths:
    """Bytes per second of each path."""

    h2d: float = 10e9
    d2h: float = 10e9
    disk_read: float = 1e9
    disk_write: float = 1e9
    disk_read_cpu: float = 0.0
    """Seconds of the compute cores' time each byte read from disk takes from compute where both share the cores
    (the CPU backend): the process CPU time per byte `angel-jax bench io` measured (checksums, copies, the
    kernel's work), over the cores."""
    disk_write_cpu: float = 0.0
    """The same for each byte written (new chunk files: temporary file, fsync, rename)."""
    link: float = 0.0
    """Bytes per second each data-parallel rank sends (and receives) in a collective; 0: collectives are not
    modelled (one rank, or the CPU backend, where they are part of the profiled compute calls)."""
    source: str = "defaults"
    """Where the figures come from: 'defaults', a calibration file (`angel-jax bench io`), 'profiled'."""


class _Clock:
    """Per-stream free times; with `shared`, every stream but the disk runs on the compute stream's clock, and
    each disk transfer also takes its CPU share from it (`io_cpu` events). With `serial`, every stream, the disk
    too, runs on that one clock, and a disk transfer's CPU work lies inside its own time."""

    def __init__(self, shared: bool, timeline: Timeline, serial: bool = False):
        self.shared, self.timeline, self.serial = shared and not serial, timeline, serial
        self.free = {"compute": 0.0, "h2d": 0.0, "d2h": 0.0, "host": 0.0, "disk": 0.0, "collective": 0.0,
                     "update": 0.0}
        self.busy = dict.fromkeys(self.free, 0.0)
        """Per clock, the seconds of work it was given (over every simulated step)."""

    def run(self, stream: str, label: str, earliest: float, duration: float) -> tuple[float, float]:
        key = "compute" if self.serial or (self.shared and stream != "disk") else stream
        start = max(earliest, self.free[key])
        self.free[key] = start + duration
        self.busy[key] += duration
        self.timeline.add(stream, label, start, start + duration)
        return start, start + duration

    def disk(self, label: str, earliest: float, nbytes: int, bandwidth: float, cpu_per_byte: float
             ) -> tuple[float, float]:
        """A disk transfer; on shared cores its CPU work is done on the compute clock once it has begun."""
        start, end = self.run("disk", label, earliest, nbytes / bandwidth)
        if self.shared and cpu_per_byte > 0:
            self.run("io_cpu", label, start, nbytes * cpu_per_byte)
        return start, end


def simulate(costs: list[StageCost], bw: Bandwidths, home: tuple[str, ...], opt_home: tuple[str, ...],
             prefetch: int, *, grad_home: tuple[str, ...] | None = None, staleness: int = 0, shared_cpu: bool = False,
             steps: int = 3, micro_batches: int = 1, passes: int = 1, ranks: int = 1,
             overlap: bool = True, update_at: tuple[str, ...] | None = None, parked_bytes: float = 0,
             opt_staging: int = OPT_STAGING) -> Timeline:
    """`home`: per stage 'device', 'host' or 'disk' (parameters); `grad_home` defaults to 'device' for resident
    stages and 'host' for streamed ones; `update_at` (where each stage's update runs) to 'device' for resident
    stages and 'host' for streamed ones. `parked_bytes`: bytes of each stage's saved input in a pass, parked in
    host memory between its forward and its backward (0: they wait on the device). `ranks`: data-parallel ranks,
    whose collectives are simulated when `bw.link` is set (the costs are then one rank's). `overlap=False`: the
    executor's `memory.overlap: false`, every piece of work alone on one clock, so the step is the sum of its
    parts."""
    n = len(costs)
    if grad_home is None:
        grad_home = tuple("device" if h == "device" else "host" for h in home)
    if update_at is None:
        update_at = tuple("device" if h == "device" else "host" for h in home)
    tl = Timeline()
    clock = _Clock(shared_cpu, tl, serial=not overlap)
    seq = compute_sequence(n) * passes  # one forward-backward sequence per accumulation pass
    per_pass = len(seq) // passes
    calls = micro_batches // passes  # stage calls per access
    # the stages that may run one update behind (`PageUpdater._lock_free`), and the updater's order
    behind = [bool(staleness) and home[i] in ("host", "disk") and update_at[i] == "host" for i in range(n)]
    order = list(update_order(behind))
    collective = ranks > 1 and bw.link > 0
    ring_s = [(ranks - 1) * c.gathered_bytes / bw.link if collective else 0.0 for c in costs]  # gather or scatter
    exchange_s = [(ranks - 1) / ranks * c.exchange_bytes / bw.link if collective else 0.0 for c in costs]
    # Bytes staged from disk around each update: what is read before the backward (state) and after it (grads).
    state_read = [c.param_bytes * (h == "disk") + c.opt_bytes * (o == "disk") for c, h, o in zip(costs, home, opt_home)]
    grad_read = [c.param_bytes * (g == "disk") for c, g in zip(costs, grad_home)]
    written = [c.param_bytes * (h == "disk") + c.opt_bytes * (o == "disk") for c, h, o in zip(costs, home, opt_home)]
    early = [i for i in order[:opt_staging] if state_read[i] or grad_read[i]]  # staged under the forward pass
    updated = [0.0] * n  # when each stage's latest update is complete
    updated_before = [0.0] * n  # ... and the one before it (lock-free bound)
    read_done: dict[int, float] = {}
    first_forward = []
    reads_from = 0.0  # when the first disk reads of the coming step may start

    def read(i: int, at: float, nbytes: int) -> None:
        if nbytes:
            end = clock.disk(f"read {costs[i].name}", at, nbytes, bw.disk_read, bw.disk_read_cpu)[1]
            read_done[i] = max(read_done.get(i, 0.0), end)

    def gradients_out(i: int, k: int, reduced: float, began: float | None = None) -> None:
        """A backward's gradients, reduced (on this rank) at `reduced`, on their way to where they wait for the
        update: `grads_home[i]` is when they are there. `began`: when the backward started computing."""
        if home[i] == "device":
            grads_home[i] = reduced
            return
        out_at = reduced
        issue_updates(reduced if began is None else began)
        if k >= per_pass and update_at[i] == "device":  # the sum so far came over with the backward; added there
            out_at = max(reduced, clock.run("h2d", f"sum in {costs[i].name}", reduced if began is None else began,
                                            costs[i].param_bytes / bw.h2d)[1])
        issue_updates(out_at)
        grads_home[i] = clock.run("d2h", f"grad {costs[i].name}", out_at, costs[i].param_bytes / bw.d2h)[1]
        if k >= per_pass and update_at[i] == "host":  # a later pass: added into the stage's sum on the host
            grads_home[i] = clock.run("host", f"add {costs[i].name}", grads_home[i], costs[i].host_add_s)[1]
        if grad_home[i] == "disk":
            grads_home[i] = clock.disk(f"spill {costs[i].name}", grads_home[i], costs[i].param_bytes,
                                       bw.disk_write, bw.disk_write_cpu)[1]

    scatters: list[tuple[float, int, int]] = []  # reduce-scatters issued, not yet on the stream: (issued, stage, k)

    def issue_scatters(before: float) -> float:
        """Put on the collective stream the reduce-scatters issued by `before`, in issue order; when the stream is
        then free."""
        while scatters and scatters[0][0] <= before:
            issued, i, k = scatters.pop(0)
            gradients_out(i, k, clock.run("collective", f"scatter {costs[i].name}", issued, ring_s[i])[1])
        return clock.free["collective"]

    crossings: list[tuple[int, int, float]] = []  # device updates of streamed stages not yet on the copy streams,
    # in the updater's order: (position in `order`, stage, earliest start)
    crossed = 0.0  # when the updater issued the latest of them

    def issue_updates(before: float, stage: int | None = None) -> None:
        """Put on the copy streams the device updates' crossings the updater issued by `before` (and at least
        every one up to `stage`'s), in its order: each once its gradients and the global norm are in and the stage
        `DEVICE_UPDATES_IN_FLIGHT` before it is home."""
        nonlocal crossed
        while crossings:
            pos, i, earliest = crossings[0]
            if pos >= DEVICE_UPDATES_IN_FLIGHT:  # the device holds that many stages' update pages at a time
                earliest = max(earliest, updated[order[pos - DEVICE_UPDATES_IN_FLIGHT]])
            issued = max(earliest, crossed)
            if issued > before and all(j != stage for _, j, _ in crossings):
                return
            crossings.pop(0)
            crossed = issued
            c = costs[i]
            arrived = clock.run("h2d", f"update in {c.name}", issued, (2 * c.param_bytes + c.opt_bytes) / bw.h2d)[1]
            done = clock.run("update", f"update {c.name}", arrived, c.update_device_s)[1]
            updated[i] = clock.run("d2h", f"update out {c.name}", done, (c.param_bytes + c.opt_bytes) / bw.d2h)[1]
            update_cause[i] = "d2h"

    update_cause = ["host"] * n  # per stage, what its latest update waited for last: 'disk' (its reads) or 'host'

    def issued_at(k: int) -> float:
        """When the executor issues access k's fetches (and gathers, and a parked input's return): once access
        k - prefetch has started computing, the window's slot then being free."""
        return starts[k - prefetch] if k >= prefetch else (starts[0] if starts else clock.free["compute"])

    def pages_at(i: int, k: int) -> tuple[float, str]:
        """When stage i's parameter pages are on the device for access k, and what that waited for last."""
        if home[i] != "device":
            issue_updates(-math.inf, stage=i)  # (its update, if it runs on the device, is on the streams)
        ready = updated[i]
        cause = update_cause[i] if home[i] != "device" else "compute"
        held = last_access.get(i, -prefetch - 2) >= k - prefetch
        last_access[i] = k
        if home[i] != "device" and held:  # its pages are still on the device for an access in the window
            ready, cause = max(fetched.get(i, 0.0), at_hand.get(i, 0.0)), "h2d"
            fetched[i] = ready
        elif home[i] != "device":
            gate = issued_at(k)
            first = i not in fetched and i not in fetched_passes
            if first and behind[i] and updated[i] > gate:
                ready = updated_before[i]  # runs one update behind rather than wait
            at = max(gate, ready if first else 0.0)
            if not (first and ready > gate):
                cause = "h2d"
            if home[i] == "disk" and not (i in early and first):  # (an early-staged stage is on the host)
                at = clock.disk(f"read {costs[i].name}", at, costs[i].param_bytes, bw.disk_read, bw.disk_read_cpu)[1]
                cause = "disk"
            issue_updates(at)
            _, ready = clock.run("h2d", f"fetch {costs[i].name}", at, costs[i].param_bytes / bw.h2d)
            fetched[i] = at_hand[i] = ready
        return ready, cause

    waits: dict[str, float] = {}
    for _ in range(steps):
        waits = {}  # compute idle time of this step (the last one's is kept), by what the compute waited for
        starts: list[float] = []
        fetched: dict[int, float] = {}  # per stage, when its pages of the current pass reached the device
        grads_home = [0.0] * n
        fetched_passes: set[int] = set()
        last_access: dict[int, int] = {}  # per stage, the index of its latest access in this step
        at_hand: dict[int, float] = {}  # per stage, when its latest fetch reached the device
        parked_at: dict[int, float] = {}  # per stage, when its saved input of the current pass is in host memory
        for j in early:
            if j not in read_done:
                read(j, reads_from, state_read[j])
        for k, (op, i) in enumerate(seq):
            dur = calls * (costs[i].forward_s + exchange_s[i] if op == "forward"
                           else costs[i].backward_s + 2 * exchange_s[i])
            if k % per_pass == 0:  # a new pass fetches every streamed stage again
                fetched_passes.update(fetched)
                fetched = {}
            # (a borrowing stage's call reads its lender's parameters too: both must be on the device)
            ready, cause = max(pages_at(j, k) for j in (i,) + ((costs[i].lender,) if costs[i].lender is not None
                                                               else ()))
            if parked_bytes and op == "backward":  # its saved input back from the host, issued as a fetch is
                unpark_at = max(issued_at(k), parked_at.pop(i, 0.0))
                issue_updates(unpark_at)
                back = clock.run("h2d", f"unpark {costs[i].name}", unpark_at, parked_bytes / bw.h2d)[1]
                if back > ready:
                    ready, cause = back, "h2d"
            label = f"{op} {costs[i].name}" + (f" (pass {k // per_pass + 1})" if k >= per_pass else "")
            gathered = ready
            if collective:  # issued with the shard's fetch, behind the reduce-scatters issued before it
                issued = issued_at(k)
                issue_scatters(issued)
                gathered = clock.run("collective", f"gather {costs[i].name}", max(issued, ready), ring_s[i])[1]
            idle = min(ready, gathered) - clock.free["compute"]
            if idle > 0 and not shared_cpu:
                waits[cause] = waits.get(cause, 0.0) + idle
            idle = gathered - max(ready, clock.free["compute"])
            if idle > 0 and not shared_cpu:
                waits["collective"] = waits.get("collective", 0.0) + idle
            start, end = clock.run("compute", label, max(ready, gathered), dur)
            starts.append(start)
            if k == 0:  # the step's first forward (of its first pass)
                first_forward.append(start)
            if parked_bytes and op == "forward":  # its input goes to the host for the backward
                issue_updates(end)
                parked_at[i] = clock.run("d2h", f"park {costs[i].name}", end, parked_bytes / bw.d2h)[1]
            if op != "forward":
                if collective:
                    scatters.append((end, i, k))
                else:
                    gradients_out(i, k, end, start)
        reduced = issue_scatters(math.inf)
        issue_updates(math.inf)  # (the previous step's, all issued by now)
        norm_at = max(grads_home)
        for j in early:
            read(j, norm_at, grad_read[j])
        for pos, i in enumerate(order):
            if pos + opt_staging < len(order) and order[pos + opt_staging] not in early:
                j = order[pos + opt_staging]
                read(j, max(norm_at, grads_home[i]), state_read[j] + grad_read[j])
            staged = read_done.pop(i, 0.0)
            earliest = max(norm_at, grads_home[i], staged)
            update_cause[i] = "disk" if staged and staged >= max(norm_at, grads_home[i], clock.free["host"]) \
                else "host"
            updated_before[i] = updated[i]
            if home[i] == "device" and not shared_cpu:
                # Idle before a device update: the last reduce-scatters (the norm needs every reduced gradient),
                # then the streamed stages' gradients on their way to the host (their copies, the host's sums of
                # accumulation passes behind its queue of updates).
                free = clock.free["compute"]
                reduced_at = reduced if collective else free
                for what, lo, hi in (("collective", free, min(earliest, reduced_at)),
                                     ("host", max(free, reduced_at), earliest)):
                    if hi > lo:
                        waits[what] = waits.get(what, 0.0) + hi - lo
            if home[i] == "device":
                updated[i] = clock.run("compute", f"update {costs[i].name}", earliest, costs[i].update_device_s)[1]
            elif update_at[i] == "device":  # its crossings go on the copy streams as the updater issues them
                crossings.append((pos, i, earliest))
            else:
                updated[i] = clock.run("host", f"update {costs[i].name}", earliest, costs[i].update_host_s)[1]
            if written[i]:
                clock.disk(f"write {costs[i].name}", updated[i], written[i], bw.disk_write, bw.disk_write_cpu)
        if early:  # the next step's first disk reads wait for every update
            issue_updates(math.inf)
        reads_from = max(updated[i] for i in range(n))
    issue_updates(math.inf)  # (the last step's, drawn in full)
    if steps > 1:
        # Every step gives each stream the same work, so none can run steps faster than its share: a stream whose
        # queue grows from step to step (host updates longer than a step, run one update behind) bounds the
        # steady state even where a few simulated steps do not show it yet. The compute then waits for that
        # stream for the difference, every step.
        simulated = first_forward[-1] - first_forward[-2]
        busiest = max(clock.busy, key=clock.busy.get)
        tl.step_time = max(simulated, clock.busy[busiest] / steps)
        if tl.step_time > simulated and busiest != "compute" and not shared_cpu:
            waits[busiest] = waits.get(busiest, 0.0) + tl.step_time - simulated
    else:
        tl.step_time = max(e.end for e in tl.events) - min(e.start for e in tl.events)
    if not math.isfinite(tl.step_time):
        tl.step_time = float("inf")
    tl.waits = waits
    tl.step_starts = first_forward
    return tl
