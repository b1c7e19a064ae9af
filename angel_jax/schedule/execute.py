"""Execute: run a plan, one training step at a time, with transfers overlapping computation.

The executor holds the model as pages in a `PageStore`: resident stages live on the device (parameters, gradients
and optimizer state); each page family of a streamed stage lives in pinned host memory or on disk, as the plan
says. One step follows the trace (trace.py):

    forward  stage 0..N-2   stage inputs saved on the device
    head     loss and gradients
    backward stage N-2..0   recompute from the saved input, vjp; gradients of streamed stages go to the host, and
                            on to the disk where that is their home (at most `GRAD_SPILL` stages on the way)
    update   by the PageUpdater (angel_jax/schedule/updater.py) on its own thread, after the global norm: on the
             device for resident stages, on the host for streamed ones

With M micro-batches per step (`micro_batch_size`; gradient accumulation) the order is layer-major: each access
runs its stage on every micro-batch before the stage is released, so a streamed stage is fetched once per access as
with one micro-batch, and page traffic per step does not grow with M. The forward saves each micro-batch's stage
input; the head gives each micro-batch's loss and gradients; a backward sums its micro-batches' gradients in
float32, scales them by 1/M once and takes the sum of squares of the result, which goes to the updater as a single
micro-batch's gradients would. An access is one call that scans its micro-batches (`StageFunctions.forward_micro`,
`backward_micro`). The loss is the mean of the micro-batches' losses, each over its share of the step's scored
targets (`scored_share`; instruction data scores responses only): the whole batch's loss and gradient however the
micro-batches hold scored targets.

With P accumulation passes (`plan.passes`, dividing M) the step runs that whole sequence P times, pass p over
micro-batches [p M/P, (p+1) M/P), so the device holds one pass's saved inputs. The step's access sequence is the
pass's repeated P times, and fetching, prefetching and evicting follow it across the passes' boundaries: a streamed
stage is fetched again in every pass. A stage is acquired from the updater at its first access of the first pass
and released at its last of the last pass, so every pass runs the same parameters. Gradients are summed in float32
where the plan keeps them: a resident stage's micro-batches all go into one sum on the device; a streamed stage's
pass sum (or, with one micro-batch per pass, its gradients as they are) goes to the host after the pass's backward
and is added there into the stage's sum (`HostSums`, on the host placement's compute), so none of it stays on the
device between passes. A streamed stage updated on the device (`Plan.update_at`) sums on the device instead: its
sum so far crosses from the host with its backward, the pass's gradients are added to it there, and the new sum
goes back (the host holds it and computes nothing; the device memory is that of the stage's update, free during
the backward). After the last pass the sum's mean over the M micro-batches and its sum of squares are taken
where the sum lives, and the mean goes to the updater as with one pass (a host sum of squares comes to the device
for the global norm). Gradients summed over passes are never homed on disk.

With `plan.parked_bytes` (`memory.activations: host`) a forward's saved input goes to pinned host memory as soon
as the forward is dispatched (at most `ACTIVATIONS_IN_FLIGHT` on their way) and comes back for its backward when
that access's fetch is issued, `plan.prefetch` accesses ahead: the device holds a window of stage inputs instead
of a pass's, so a large batch runs in one pass, each streamed stage fetched once per access.

An evaluation (`eval_loss`) runs the forward stages and the head's loss alone, fetching and evicting streamed stages
the same way, once the updates in flight have landed; it changes nothing of the training state.

A streamed stage's pages are prefetched `plan.prefetch` accesses ahead (`jax.device_put` is asynchronous and runs
on the copy streams, so the fetch overlaps the computation dispatched before it) and evicted once no access in the
window needs them. Access k + prefetch's fetch is issued right after access k is dispatched, once access k - 1's
computation is done (its pages' slot in the window is free): the thread waits with a computation queued, so the
device does not wait for the thread between accesses. Everything is dispatched asynchronously: besides those
window slots, the training thread waits only where the updater says a stage's parameters are not recent enough
yet (`PageUpdater.acquire`: exact mode waits for the previous step's update to be dispatched, lock-free mode only
when a stage would fall two updates behind). `step` returns before its updates ran; the next step's first stages
start while later stages are still being updated.

With `staleness: 0` the arithmetic is the reference trainer's: the same stage functions, the same optax update,
clipping by the same global norm; only where the bytes sit differs. So streamed and resident placements give
bitwise-identical results, and both match the whole-model trainer to float rounding.

With `memory.overlap: false` nothing overlaps: every computation and copy is waited for as it is dispatched, the
store waits for every move it starts (`SerialStore`), and the updates run in turn on the training thread, each
waited for. The step is then the sum of its parts, the baseline against which overlap is measured
(`plan.without_overlap` predicts it).

The executor runs on the training thread and shares no field with the updater's worker: each step it sends the
stage gradients and one immutable `StepOrder` (the step, its global norm, its guard, and the timeline hook when
the step is recorded), and reads the answers from the deferred results.
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np

from angel_jax.memory import PageStore
from angel_jax.memory.layout import PageLayout, to_bits
from angel_jax.memory.shardwise import Shardwise
from angel_jax.optim.guard import StepControls, before_update_ok
from angel_jax.optim.stage_update import global_norm, join_opt_state, sqsum
from angel_jax.schedule.staging import ACTIVATIONS_IN_FLIGHT, GRAD_SPILL
from angel_jax.schedule.updater import Guard, PageUpdater, StepOrder
from angel_jax.schedule.plan import Plan
from angel_jax.schedule.stagefns import HostSums, StageFunctions, page_values, scalar_sharding
from angel_jax.schedule.timeline import Recorder, Timeline
from angel_jax.schedule.trace import compute_sequence, split_batch
from angel_jax.schedule.zero import serial
from models.common import scored_share
from models.stages import StagedModel


@dataclass(frozen=True)
class PagedModel:
    """The static description the executor works from."""

    staged: StagedModel
    params_layout: PageLayout
    opt_layout: PageLayout
    """Optimizer-state pages; their page ids are offset by `opt_offset` in the store."""
    opt_offset: int
    grad_sets: int = 1
    """Sets of disk-homed gradient pages, used by step parity: 2 in lock-free mode (`staleness: 1`), where step
    t+1's backward may write a stage's gradients while step t's update still reads them; 1 otherwise (the update
    reads them before the next backward of the stage can run)."""
    newest: list[int] = dataclasses.field(default_factory=list)
    """Per stage, the set of parameter pages that holds its newest parameters: 0, or in lock-free mode 1 for a
    stage whose parameters live on disk (two sets there: the version a step is using stays readable while the
    updater writes the next into the other set, `PageUpdater`). Empty: every stage's is set 0. Changed by the
    updater's worker alone (under its lock); read for the current state once no update is in flight, while a
    step reads the set each stage acquired (`PageUpdater.version_in_use`)."""

    @property
    def grad_offset(self) -> int:
        """Disk-homed gradient pages: `grad_sets` sets of the parameter pages' shapes, ids from here."""
        return self.opt_offset + self.opt_layout.num_pages

    @property
    def second_set_offset(self) -> int:
        """The second set of parameter pages (lock-free mode, disk-homed parameters): ids from here, after the
        gradient pages."""
        return self.grad_offset + self.grad_sets * self.params_layout.num_pages

    def grad_ids(self, stage: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """The stage's gradient page ids of even and of odd steps (the same ids with one set)."""
        ids = self.param_ids(stage, 0)
        even = tuple(p + self.grad_offset for p in ids)
        odd = tuple(p + self.grad_offset + self.params_layout.num_pages for p in ids) if self.grad_sets == 2 else even
        return even, odd

    def param_ids(self, stage: int, version: int | None = None) -> tuple[int, ...]:
        """The stage's parameter page ids in set `version` (None: the set holding its newest parameters)."""
        ids = self.params_layout.stage(self.staged.stages[stage].name).page_ids
        if version is None:
            version = self.newest[stage] if self.newest else 0
        return ids if version == 0 else tuple(p + self.second_set_offset for p in ids)

    def first_set_id(self, page_id: int) -> int:
        """The id in set 0 of a parameter page of either set (other pages: the id itself)."""
        if self.second_set_offset <= page_id < self.second_set_offset + self.params_layout.num_pages:
            return page_id - self.second_set_offset
        return page_id

    def reads(self, stage: int) -> tuple[int, ...]:
        """The stages whose parameter pages the stage's calls take: itself, then the stage it borrows from
        (`StagedModel.borrows`: a head tied to the embedding reads the embedding stage's pages too)."""
        lender = self.staged.borrows.get(stage)
        return (stage,) if lender is None else (stage, lender)

    def call_ids(self, stage: int, versions: dict[int, int] | None = None) -> tuple[int, ...]:
        """The parameter pages the stage's calls take, in `reads` order: of the sets in `versions` (per stage; a
        step's, those acquired), else the newest."""
        return tuple(pid for s in self.reads(stage)
                     for pid in self.param_ids(s, None if versions is None else versions[s]))

    def opt_ids(self, stage: int) -> tuple[int, ...]:
        return tuple(p + self.opt_offset for p in self.opt_layout.stage(self.staged.stages[stage].name).page_ids)


class PagedExecutor:
    """One training step at a time. Every field is the training thread's: it alone calls the methods; others
    change the executor only through them (`set_step` after a checkpoint is loaded, `record_steps`)."""

    def __init__(self, model: PagedModel, fns: StageFunctions, plan: Plan, store: PageStore, updater: PageUpdater,
                 micro_batch_size: int = 0, host_compute: jax.sharding.Sharding | None = None,
                 overlap: bool = True, host_split: Shardwise | None = None):
        self.model, self.fns, self.plan, self.store, self.updater = model, fns, plan, store, updater
        self._settle: Callable[[Any], Any] = (lambda x: x) if overlap else jax.block_until_ready
        """`memory.overlap: false`: each computation and copy is waited for as it is dispatched (with a store
        that waits for its moves, memory/serial.py, and the updates run in turn: nothing overlaps)."""
        self.micro_batch_size = micro_batch_size
        """Rows per micro-batch (0: the whole batch in one go); a batch is split into batch rows / this many."""
        assert plan.passes == 1 or "disk" not in plan.grad_home, \
            "with several accumulation passes gradients are summed on the host: none is homed on disk"
        self._host_sums = HostSums.on(host_compute or store.tiers["host"].sharding, host_split)
        """Where streamed stages' gradients are summed over passes: the host placement's compute
        (`engine.placements`; `host_split`: its ZeRO-3 pages shard by shard)."""
        self._summed_on_device = set(plan.streamed_device_updates) if plan.passes > 1 else set()
        """Streamed stages whose sums over passes are added on the device (they update there)."""
        self._steps_taken = 0
        self.on_access: Callable[[str, int], None] | None = None
        """Test hook, called after each access is dispatched (e.g. to sample live device memory)."""
        self.last_timeline: Timeline | None = None
        """The measured timeline of the last recording (`record_steps`), once complete."""
        self._n = len(model.staged.stages)
        self._pass_seq = compute_sequence(self._n)
        self._seq = self._pass_seq * plan.passes  # the step's accesses: every pass runs the whole sequence
        self._last_use = {i: max(k for k, (_, j) in enumerate(self._seq) if j == i) for i in range(self._n)}
        self._recording: tuple[Recorder, int, Any] | None = None  # (recorder, steps left, last update norm)
        self._record_steps = 0  # steps the recording in progress was asked for
        self._last_mark: Any = None  # the previous step's last computation (see `issue`)
        self._spilling: list[list] = []  # per stage, the write handles of gradients on their way to disk
        self._parking: list[Any] = []  # saved stage inputs on their way to host memory, oldest first
        self._grad_pages: set[int] = set()  # disk-homed gradient pages already in the store
        figures = model.staged.figures
        self._figures = jax.jit(figures) if figures is not None else None  # the model's step figures, if any

    @property
    def step_count(self) -> int:
        """Optimizer steps taken (dispatched)."""
        return self._steps_taken

    def set_step(self, n: int) -> None:
        """The state was replaced by that of step `n` (a checkpoint loaded, the updater reset to the same step):
        the next step is step n."""
        if n < 0:
            raise ValueError(f"step must be >= 0, got {n}")
        self._steps_taken = n

    # ------------------------------------------------------------------------------------------------ one step
    def step(self, batch: jax.Array, controls: StepControls | None = None) -> dict[str, Any]:
        """One training step; returns loss, grad_norm, update_norm, lr and skipped (the last three deferred:
        they exist once the updater has dispatched the step's updates), and the model's figures
        (`StagedModel.figures`, e.g. moe/aux_loss: their mean over the passes) if it has any. `controls`: the anomaly guard's bounds
        and learning-rate multiplier (train/step.py), None = only finiteness is checked."""
        plan, store, fns, staged, updater = self.plan, self.store, self.fns, self.model.staged, self.updater
        self._poll_recording()
        rec = self._recording[0] if self._recording and self._recording[1] > 0 else None
        step = self._steps_taken
        tokens, targets = self._micro_batches(batch)
        micro, passes = len(tokens), plan.passes
        share = _share(batch, micro)  # each micro-batch's count of the step's scored targets
        if micro % passes:
            raise ValueError(f"{micro} micro-batches do not split into the plan's {passes} accumulation passes "
                             "(memory.passes)")
        per_pass = micro // passes
        if per_pass > 1:  # each pass's micro-batches on a leading axis, for the calls that scan them
            stacked = split_batch(batch, micro)
            tokens = [stacked[p * per_pass:(p + 1) * per_pass, :, :-1] for p in range(passes)]
            targets = [stacked[p * per_pass:(p + 1) * per_pass, :, 1:] for p in range(passes)]
        streamed = set(plan.streamed)
        refs: dict[int, int] = {}
        acquired: dict[int, int] = {}  # per stage acquired in this step, the set of pages of its version
        let_go: set[int] = set()  # the stages acquired and released again in this step
        saved: dict[int, Any] = {}  # per stage, its input of the current pass (parked: in host memory)
        parked: set[int] = set()  # the stages whose saved input is in host memory

        def issue(k: int) -> None:
            """Make access k's parameters current and (streamed stages) start fetching them; a backward's parked
            input starts back too."""
            op, i = self._seq[k]
            reads = self.model.reads(i)
            unpark = op == "backward" and i in parked
            if unpark or any(s in streamed and not refs.get(s) for s in reads):
                # A fetch starts when its window slot frees on the device (the compute `prefetch` accesses back is
                # done), not when the training thread, running ahead of the device, gets there: evicted pages
                # stay allocated until the computations that read them ran, so a thread running ahead would hold
                # as many stages as it got ahead (measured: 12 GB over the plan for 64 streamed 200 MB stages on
                # the CPU). The thread waits here with the next computation already dispatched (see the loop), so
                # the device never waits for the thread. In lock-free mode this is also the moment that decides
                # whether a stage's update is written, which keeps stale uses to the updates that are really late.
                jax.block_until_ready(marks[k - plan.prefetch - 1] if k > plan.prefetch else self._last_mark)
            if unpark:
                saved[i] = self._unpark(i, saved[i], rec)
                parked.discard(i)
            for s in reads:
                if s not in acquired:  # the stage's first access in the step: it keeps this version to the last
                    updater.acquire(s, step)
                    acquired[s] = updater.version_in_use(s)  # (the set of pages holding it)
                if s not in streamed:
                    continue
                refs[s] = refs.get(s, 0) + 1
                if refs[s] == 1:
                    for pid in self.model.param_ids(s, acquired[s]):
                        # A host copy of disk-homed parameters is the updater's (staged for the update): it stays.
                        store.prefetch(pid, "device", keep_source=True)
                    if rec:  # (a fetch starts once its source, the last update's pages, is written; from disk the
                        # fetch includes the read)
                        ids = self.model.param_ids(s, acquired[s])
                        rec.record("h2d", f"fetch {staged.stages[s].name}", [store.get(p, "device") for p in ids],
                                   after=None if plan.home[s] == "disk" else [store.get(p, "host") for p in ids])

        def release(k: int, i: int) -> None:
            for s in self.model.reads(i):
                if s in streamed:
                    refs[s] -= 1
                    if refs[s] == 0:
                        for pid in self.model.param_ids(s, acquired[s]):
                            store.evict(pid, "device")
            if k == self._last_use[i]:
                updater.release(i)
                let_go.add(i)

        marks: list[Any] = []  # per access, a small output that is ready when the access's computation is done
        issue_through = InOrder(issue, len(self._seq)).through
        sums: dict[int, tuple] = {}  # per stage, its gradient pages summed on the device (see `_sum_span`)
        lent: dict[int, tuple] = {}  # per lender, a borrower's gradient of its parameters, until its own backward
        host_sums: dict[int, tuple] = {}  # per stage summed on the host, its passes' gradients so far
        sqsums: list[jax.Array | None] = [None] * self._n
        loss = None
        figure_parts: list[dict] = []  # per pass, the model's figures of its micro-batches
        k = 0  # the access's index in the step's sequence
        try:
            for p in range(passes):
                last_pass = p == passes - 1
                # The pass's activation (forward) or its gradient (backward): one micro-batch, or the pass's stacked.
                x, ts = tokens[p], targets[p]
                for op, i in self._pass_seq:
                    # Access k's fetch was issued `prefetch` accesses back, once the computation before that one was
                    # done; with no prefetch it is issued now, once the previous computation is done.
                    issue_through(k)
                    kind = staged.stages[i].kind
                    pages = tuple(store.get(pid, "device") for pid in self.model.call_ids(i, acquired))
                    if op == "forward":  # one call per access: it scans the pass's micro-batches (`forward_micro`)
                        saved[i] = x
                        x = out = mark = (fns.forward if per_pass == 1 else fns.forward_micro)[kind](pages, x)
                        if plan.parked_bytes:  # its input waits for the backward in host memory
                            saved[i] = self._park(i, saved[i], rec)
                            parked.add(i)
                    else:
                        if i in self._summed_on_device and i in host_sums:  # its sum so far crosses under the backward
                            host_sums[i] = self._settle(jax.device_put(host_sums[i], store.tiers["device"].sharding))
                        if op == "head" and self._figures is not None:
                            # The model's figures, read from the head's input (a pytree activation carries them).
                            figure_parts.append(self._figures(x))
                        if i in parked:  # (not brought back ahead: a prefetch deeper than the forward was)
                            saved[i] = self._unpark(i, saved[i], rec)
                            parked.discard(i)
                        out, sqsums[i], mark, x, loss = self._backward(op, i, pages, saved.pop(i, None), x, (ts, share),
                                                                       sums, lent, loss, micro, last_pass)
                    marks.append(mark)
                    self._settle((out, x, mark))
                    if rec:
                        # (labelled as the planner's timeline labels them: later passes with their number)
                        rec.record("compute", f"{op} {staged.stages[i].name}" + (f" (pass {p + 1})" if p else ""), out)
                    if op != "forward" and i in self._summed_on_device:
                        sqsums[i] = self._add_on_device(step, i, out, host_sums, micro, last_pass, rec)
                    elif op != "forward" and self._sum_span(i, micro) < micro:
                        sqsums[i] = self._add_on_host(step, i, out, host_sums, micro, last_pass, rec)
                    elif op != "forward" and last_pass:
                        updater.make_room_for_grads(i, step)
                        updater.submit(step, i, self._grads_home(step, i, out, streamed, rec))
                    del pages, out, mark
                    release(k, i)
                    if plan.prefetch:  # waits for access k - 1's computation, with access k's queued behind it
                        issue_through(k + plan.prefetch)
                    if k > 0:  # (waited for: a forward's mark is its output, which must not outlive its use)
                        marks[k - 1] = None
                    if self.on_access is not None:
                        self.on_access(op, i)
                    k += 1
        except BaseException:
            # A step that fails part-way still lets go of the stages it holds: the updater keeps only a bounded
            # number of versions for stages in use, and waits for their release before it keeps another.
            for s in acquired:
                if s not in let_go:
                    updater.release(s)
            raise
        self._last_mark = marks[-1]
        if micro > 1:
            loss = loss * np.float32(1 / micro)
        norm = global_norm(sqsums)
        c = controls or StepControls()
        # The guard's verdict on what is known now (the update norm's comes in the updater), on the device.
        ok = before_update_ok(loss, norm, c)
        order = StepOrder(step, norm, Guard(ok, float(c.max_update_norm), float(c.lr_scale)),
                          rec.record if rec else None)
        deferred = updater.finish(order)
        self._steps_taken += 1
        if rec:
            recorder, left, _ = self._recording
            self._recording = (recorder, left - 1, deferred["update_norm"])
        figures = jax.tree.map(lambda *f: sum(f) / len(f), *figure_parts) if figure_parts else {}
        return {"loss": loss, "grad_norm": norm, **deferred, **figures}

    def _micro_batches(self, batch: jax.Array) -> tuple[list[jax.Array], list[jax.Array]]:
        """The inputs and targets of each micro-batch of `batch` (int32[B, T+1]; `split_batch`)."""
        rows = batch.shape[0]
        size = self.micro_batch_size or rows
        if rows % size:
            raise ValueError(f"a batch of {rows} rows does not split into micro-batches of {size} "
                             "(train.micro_batch_size)")
        if size == rows:
            return [batch[:, :-1]], [batch[:, 1:]]
        tokens, targets = _split(batch, rows // size)
        return list(tokens), list(targets)

    @functools.cached_property
    def _grad_dtypes(self) -> list[tuple]:
        """Per stage, the dtypes of its gradient (= parameter) pages."""
        return [tuple(p.dtype for p in self.model.params_layout.stage(s.name).pages) for s in self.model.staged.stages]

    def _backward(self, op: str, i: int, pages: tuple, saved: jax.Array | None, dy: jax.Array, targets: tuple,
                  sums: dict[int, tuple], lent: dict[int, tuple], loss: jax.Array | None, micro: int,
                  last_pass: bool) -> tuple[tuple, jax.Array | None, jax.Array, jax.Array, jax.Array | None]:
        """Stage i's backward (or the head's loss and backward) of a pass's micro-batches, one call (scanning them
        when there are several): `dy` is the gradient at the stage's output (the head: its input), stacked like the
        pass's micro-batches; `targets` is the head's (its targets, each micro-batch's share of the step's scored
        count). Returns the access's gradient pages, their sum of squares (None until the step's gradients are
        complete on the device), a mark ready when the computation is done, the gradient at the stage's input, and
        `loss` plus the pass's summed losses. The gradient pages are the step's mean where one
        call covers the step (one pass); with several passes, a pass's float32 sums (`backward_micro_sums`; a single
        micro-batch's gradients as they are), added into `sums[i]` on the device over `_sum_span` micro-batches
        and meaned there once the last pass is in, or sent on to the host sums (`_add_on_host`).

        Borrowed parameters (`StagedModel.borrows`, a tied head): a borrower's call also gives its gradient of the
        lender's parameters, in the same form as the lender's own (one call's pages, or a pass's float32 sums);
        it waits on the device in `lent` and is added into the lender's gradient as soon as the lender's backward
        gives it, so everything after that sees one gradient of the lender's parameters, counted once in the
        global norm."""
        fns, kind = self.fns, self.model.staged.stages[i].kind
        per_pass = micro // self.plan.passes
        if per_pass == 1:
            backward = fns.backward[kind]
        else:
            backward = (fns.backward_micro if self.plan.passes == 1 else fns.backward_micro_sums)[kind]
        if op == "head":
            out = backward(pages, dy, *targets)
            dpages, dx, loss_m = out[0], out[1], out[-1]
            loss = loss_m if loss is None else loss + loss_m
        else:
            out = backward(pages, saved, dy)
            dpages, dx = out[0], out[1]
        mark = out[2]  # (the sum of squares, or a scalar of the call's own: never a buffer a later add donates)
        if i in self.model.staged.borrows:  # its own gradients, and its share of its lender's
            own = len(self.model.param_ids(i))
            dpages, lent[self.model.staged.borrows[i]] = dpages[:own], dpages[own:]
            if self.plan.passes == 1:  # (the call's sum of squares counted the lender's share too)
                mark = self._waited(_sqsum(dpages, self._grad_dtypes[i]))
        if i in lent:  # a lender: its borrowers' share added in
            dpages, sqsum = self._waited(_add_lent(dpages, lent.pop(i), self._grad_dtypes[i]))
            mark = sqsum if self.plan.passes == 1 else mark
        if self.plan.passes == 1:  # the step's gradients, meaned in the call (or one micro-batch's)
            return dpages, mark, mark, dx, loss
        if self._sum_span(i, micro) < micro:  # the pass's sums, on their way to the stage's sums on the host
            return dpages, None, mark, dx, loss
        sums[i] = fns.accumulate(sums.get(i), dpages, self._grad_dtypes[i])
        if not last_pass:  # the step's sums so far: the next pass adds to them
            return sums[i], None, mark, dx, loss
        grads, sqsum = fns.mean_grads(sums.pop(i), micro, self._grad_dtypes[i])
        return grads, sqsum, sqsum, dx, loss

    def _waited(self, out: Any) -> Any:
        """`out` of a computation over gradient pages, waited for where the pages are sharded over several CPU
        devices: a collective there runs alone (`zero.serial`), as `StageFunctions.mean_grads` waits."""
        return jax.block_until_ready(out) if serial(jax.tree.leaves(out)[0].sharding) else out

    def _sum_span(self, i: int, micro: int) -> int:
        """The micro-batches whose gradients of stage i are summed on the device: the step's for resident stages
        (the sum stays there between passes) and with one pass; a pass's for streamed stages (each pass's sum goes
        to the host, `_add_on_host`)."""
        return micro if self.plan.passes == 1 or i not in self.plan.streamed else micro // self.plan.passes

    def _add_on_host(self, step: int, i: int, dpages: tuple, host_sums: dict[int, tuple], micro: int,
                     last_pass: bool, rec: Recorder | None) -> jax.Array | None:
        """A streamed stage's gradients of one pass (their float32 sum, or one micro-batch's as they are) go to the
        host and are added into the stage's float32 sum there (`host_sums`), so none stays on the device between
        passes. After the last pass the sum's mean over the step's `micro` micro-batches goes to the updater, and
        its sum of squares is returned, on the device (where the global norm is formed)."""
        moved = self._to_host(i, dpages, rec)
        first = i not in host_sums
        host_sums[i] = self._settle(self._host_sums.accumulate(host_sums.get(i), moved, self._grad_dtypes[i]))
        if rec and not first:
            rec.record("host", f"add {self.model.staged.stages[i].name}", host_sums[i], after=moved)
        if not last_pass:
            return None
        grads, sq = self._settle(self._host_sums.mean_grads(host_sums.pop(i), micro, self._grad_dtypes[i]))
        self.updater.submit(step, i, grads)
        return jax.device_put(sq, scalar_sharding(self.store.tiers["device"].sharding))

    def _add_on_device(self, step: int, i: int, dpages: tuple, host_sums: dict[int, tuple], micro: int,
                       last_pass: bool, rec: Recorder | None) -> jax.Array | None:
        """`_add_on_host`'s work for a streamed stage updated on the device: the pass's gradients are added on the
        device into the stage's float32 sum so far (brought over with the backward), and the sum goes back to the
        host between passes. After the last pass its mean goes to the host for the updater, and its sum of squares
        is returned, on the device."""
        summed = self._settle(self.fns.accumulate(host_sums.pop(i, None), dpages, self._grad_dtypes[i]))
        if not last_pass:
            host_sums[i] = self._to_host(i, summed, rec)
            return None
        grads, sq = self._settle(self.fns.mean_grads(summed, micro, self._grad_dtypes[i]))
        self.updater.submit(step, i, self._to_host(i, grads, rec))
        return sq

    def _park(self, i: int, saved: Any, rec: Recorder | None) -> Any:
        """Stage i's saved input to pinned host memory (D2H, asynchronous), at most `ACTIVATIONS_IN_FLIGHT` on
        their way at a time: the device copy is freed once its copy and its forward are done."""
        while len(self._parking) >= ACTIVATIONS_IN_FLIGHT:
            jax.block_until_ready(self._parking.pop(0))
        moved = self._settle(jax.device_put(saved, self.store.tiers["host"].sharding))
        self._parking.append(moved)
        if rec:
            rec.record("d2h", f"park {self.model.staged.stages[i].name}", moved, after=saved)
        return moved

    def _unpark(self, i: int, saved: Any, rec: Recorder | None) -> Any:
        """Stage i's parked input back on the device for its backward (H2D, asynchronous)."""
        back = self._settle(jax.device_put(saved, self.store.tiers["device"].sharding))
        if rec:
            rec.record("h2d", f"unpark {self.model.staged.stages[i].name}", back)
        return back

    def _to_host(self, i: int, dpages: tuple, rec: Recorder | None) -> tuple:
        """Gradient pages copied to the host tier (D2H, asynchronous)."""
        moved = self._settle(tuple(jax.device_put(g, self.store.tiers["host"].sharding) for g in dpages))
        if rec:
            rec.record("d2h", f"grad {self.model.staged.stages[i].name}", moved, after=dpages)
        return moved

    def _grads_home(self, step: int, i: int, dpages: tuple, streamed: set[int],
                    rec: Recorder | None) -> tuple | None:
        """Gradients go where the stage's update reads them: the host tier for streamed stages (D2H,
        asynchronous), and on to their pages on disk where the plan homes them there (None is returned: the
        updater reads them from the store)."""
        if i not in streamed:
            return dpages
        moved = self._to_host(i, dpages, rec)
        name = self.model.staged.stages[i].name
        if self.plan.grad_home[i] != "disk":
            return moved
        while len(self._spilling) >= GRAD_SPILL:  # host memory holds a bounded number of them
            for h in self._spilling.pop(0):
                h.wait()
        handles = []
        for gid, arr in zip(self.model.grad_ids(i)[step % 2], moved):
            if gid in self._grad_pages:
                self.store.put(gid, arr, "host")
            else:  # first use: the page is created on the host; evicting it below moves its home to the disk
                self.store.add(gid, arr, home="host")
                self._grad_pages.add(gid)
            handles.append(self.store.evict(gid, "host"))
        if rec:
            rec.record("disk", f"spill {name}", handles)
        self._spilling.append(handles)
        return None

    # ------------------------------------------------------------------------------------------------ evaluation
    def eval_loss(self, batch: jax.Array) -> jax.Array:
        """The mean next-token loss of `batch` (int32[B, T+1]) under the parameters of every step taken so far, all
        their updates applied: a forward pass that streams the stages through the device as a step does (a streamed
        stage's parameter pages are fetched from where they live, `plan.prefetch` stages ahead within the same
        device window, and evicted after its call), so the model is never gathered. Nothing of the training state
        changes: no gradients, no update, no step count; the page homes and the tiers' bytes are as before."""
        # Waits for the updates in flight, in exact and lock-free mode alike: the loss is that of the parameters
        # after the last step (what the in-memory engine evaluates), not of the one-step-old parameters a stale stage
        # could run with next. In lock-free mode the next step then finds every stage up to date, as it would after
        # any pause: which stages run stale depends on timing there in any case.
        self.updater.drain()
        self._restart_recording()
        plan, store, fns, staged = self.plan, self.store, self.fns, self.model.staged
        streamed = set(plan.streamed)
        # By micro-batches as a step, layer-major: the working set of a call is a micro-batch's, as planned.
        xs, targets = self._micro_batches(batch)
        share = _share(batch, len(xs))
        # Per stage, its (last micro-batch's) output: ready when its computation is done (None once waited for).
        marks: list[jax.Array | None] = []
        refs: dict[int, int] = {}  # per streamed stage, the calls in the window that read its pages
        def fetch(i: int) -> None:
            if not any(s in streamed for s in self.model.reads(i)):
                return
            # As in `step`: a fetch starts when its window slot frees on the device, not when this thread gets here,
            # and the thread waits with the next computation dispatched.
            jax.block_until_ready(marks[i - plan.prefetch - 1] if i > plan.prefetch else self._last_mark)
            for s in self.model.reads(i):
                if s in streamed:
                    refs[s] = refs.get(s, 0) + 1
                    for pid in self.model.param_ids(s) if refs[s] == 1 else ():
                        store.prefetch(pid, "device", keep_source=True)

        fetch_through = InOrder(fetch, self._n).through
        for i, stage in enumerate(staged.stages):
            fetch_through(i)
            pages = tuple(store.get(p, "device") for p in self.model.call_ids(i))
            if i == self._n - 1:
                xs = [fns.head_loss(pages, x, t, share) for x, t in zip(xs, targets)]
            else:
                xs = [fns.forward[stage.kind](pages, x) for x in xs]
            marks.append(xs[-1])
            del pages
            for s in self.model.reads(i):
                if s in streamed:
                    refs[s] -= 1
                    for pid in self.model.param_ids(s) if refs[s] == 0 else ():
                        store.evict(pid, "device")
            if plan.prefetch:
                fetch_through(i + plan.prefetch)
            if i > 0:  # (waited for; an output must not outlive its use)
                marks[i - 1] = None
        self._last_mark = xs[-1]  # the next step's first fetches wait for this pass's pages to be done with
        if len(xs) == 1:
            return xs[0]
        loss = xs[0]
        for x in xs[1:]:  # in micro-batch order, as a step sums them
            loss = loss + x
        return loss * np.float32(1 / len(xs))

    def _restart_recording(self) -> None:
        """A timeline recording that has recorded part of its steps would measure the evaluation as part of the
        step around it (`_poll_recording` takes the step time between consecutive steps' starts): it starts over
        with the next step. Called with no update in flight, so the old recorder gets no more events."""
        self._poll_recording()  # a recording whose steps are all done is complete: it stays
        if self._recording is None or self._recording[1] == self._record_steps:
            return
        self._recording[0].finish()  # its waiter threads end
        self._recording = (Recorder(), self._record_steps, None)

    # ------------------------------------------------------------------------------------------------ timelines
    def record_steps(self, steps: int = 2) -> None:
        """Record the measured timeline of the next `steps` steps, their updates included; `last_timeline` holds
        it once complete (checked at each step, or by `finish_recording`)."""
        self._recording = (Recorder(), steps, None)
        self._record_steps = steps

    def _poll_recording(self, wait: bool = False) -> None:
        if self._recording is None:
            return
        recorder, left, last_norm = self._recording
        if last_norm is None or (left > 0 and not wait):  # on `wait`, fewer steps than asked for will do
            return
        if not wait and not last_norm.done():  # the last recorded step's updates are still dispatching
            return
        last_norm.result()  # the worker has made its last call to the recorder (see PageUpdater._run)
        self._recording = None
        timeline = recorder.finish()
        # The steady-state step, as the planner predicts it: between the starts of consecutive first forwards (of
        # the steps' first passes).
        first = f"forward {self.model.staged.stages[0].name}"
        starts = sorted(e.start for e in timeline.events if e.label == first)  # (first passes only: see `step`)
        timeline.step_time = starts[-1] - starts[-2] if len(starts) > 1 else timeline.span
        timeline.step_starts = starts
        self.last_timeline = timeline

    def finish_recording(self) -> Timeline | None:
        """Wait for a recording's steps to complete (ending it early if it ran fewer steps than asked for);
        returns the measured timeline (None if no step was recorded)."""
        self._poll_recording(wait=True)
        return self.last_timeline

    # ------------------------------------------------------------------------------------------------ state access
    def stage_params(self, i: int) -> Any:
        """Stage i's parameters as numpy arrays (from wherever the current version is)."""
        name = self.model.staged.stages[i].name
        pages = tuple(self.store.read(p) for p in self.model.param_ids(i))
        return self.model.params_layout.stage(name).unpack(pages)

    def params(self) -> Any:
        """The whole model's parameters (numpy), in the reference trainer's structure, after every update."""
        self.updater.drain()
        self.store.wait_all()
        return self.model.staged.merge([self.stage_params(i) for i in range(self._n)])

    def opt_state(self, i: int) -> Any:
        """Stage i's optax state (numpy), after every update."""
        self.updater.drain()
        name = self.model.staged.stages[i].name
        big = list(self.model.opt_layout.stage(name).unpack(tuple(self.store.read(o) for o in self.model.opt_ids(i))))
        small = [np.asarray(s) for s in self.updater.state().opt_small[i]]
        return join_opt_state(big, small, self.fns.opt_structure[self.model.staged.stages[i].kind])


class InOrder:
    """Calls `issue(k)` once for each k in 0, 1, ... `end` - 1, in order: `through(k)` makes the calls up to k
    not made yet (the fetches of a step's accesses, issued a window ahead of the computations)."""

    def __init__(self, issue: Callable[[int], None], end: int):
        self._issue, self._end, self._next = issue, end, 0

    def through(self, k: int) -> None:
        while self._next <= min(k, self._end - 1):
            self._issue(self._next)
            self._next += 1


@functools.partial(jax.jit, static_argnums=1)
def _sqsum(pages: tuple, dtypes: tuple) -> jax.Array:
    """The sum of squares of gradient pages (bits of pages of `dtypes`, or float32 sums)."""
    return sqsum(page_values(pages, dtypes))


@functools.partial(jax.jit, static_argnums=2)
def _add_lent(own: tuple, lent: tuple, dtypes: tuple) -> tuple[tuple, jax.Array]:
    """A lender's gradient pages plus a borrower's gradient of them, in the form both come in (bits of pages of
    `dtypes`, added as values in that dtype; or float32 sums), and the sum of squares of the result."""
    values = tuple(a + b for a, b in zip(page_values(own, dtypes), page_values(lent, dtypes)))
    out = tuple(to_bits(v) if jnp.issubdtype(o.dtype, jnp.unsignedinteger) else v for v, o in zip(values, own))
    return out, sqsum(values)


@functools.partial(jax.jit, static_argnums=1)
def _share(batch: jax.Array, micro_batches: int) -> jax.Array:
    """Each of `micro_batches` micro-batches' share of the batch's scored targets (int32[B, T+1] rows)."""
    return scored_share(batch[:, 1:], micro_batches)


@functools.partial(jax.jit, static_argnums=1)
def _split(batch: jax.Array, micro_batches: int) -> tuple[tuple[jax.Array, ...], tuple[jax.Array, ...]]:
    micro = split_batch(batch, micro_batches)
    return tuple(m[:, :-1] for m in micro), tuple(m[:, 1:] for m in micro)
