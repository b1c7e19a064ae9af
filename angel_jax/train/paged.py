"""PagedTrainEngine: the paged engine behind the `TrainEngine` protocol (angel_jax/train/engines.py).

    engine = PagedTrainEngine(cfg, mesh)          # one device, or pages sharded over the mesh's devices
    metrics = engine.step(batch, controls)        # loss, grad_norm, update_norm, lr, skipped (may be computing)
    loss = engine.eval_loss(batch)                # forward only, streamed like a step; nothing changes
    snapshot, meta = engine.state_snapshot(), engine.state_meta()   # not held: pages change in place
    engine.load_state(snapshot.arrays, meta)      # back to that step, bit for bit

The training state is every page family under stable names (the "pages" format, train/state_formats.py: its
arrays and meta), read from wherever the current version lives (device, host or disk), after every update in
flight has landed. `load_state` refuses a checkpoint whose fingerprint differs from this
model's pages laid out over the checkpoint's ranks, naming the first difference, and puts every page back in the
home this run's plan gives it. A checkpoint written over another number of ranks is resharded, stage by stage
(unpacked into whole leaves with its own layout, packed with this run's), with a warning: the losses that follow
equal an uninterrupted run's to float rounding, not bit for bit. With pages split across processes every process
snapshots and loads only its own shards of every page (`state_meta`'s `shards` says which ranks; see
`state_snapshot`, and `TrainCheckpointer` for the per-process checkpoints and their assembly).

Timelines: the predicted timeline is written to the run directory at the first step, the measured one once,
after `WARMUP_STEPS` steps of this engine (recording `RECORDED_STEPS` steps; written when they are complete, at
the latest by `close`), as `timeline_{predicted,measured}.{json,png}`.
"""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path
from typing import Any, Mapping

import jax
import numpy as np

from angel_jax.checkpoint.state import LazyArray, StateSnapshot
from angel_jax.config import Config
from angel_jax.optim.fused import host_update_by
from angel_jax.optim.guard import StepControls
from angel_jax.memory.host_peak import HostPeakCheck
from angel_jax.memory.layout import to_bits, to_values
from angel_jax.memory.sharded_layout import layout_over
from angel_jax.schedule.blueprint import blueprint, page_size_text
from angel_jax.schedule.budgets import decide, params_room
from angel_jax.schedule.runtime import PagedRuntime, assemble_runtime
from angel_jax.schedule.timeline import Timeline, save_pngs
from angel_jax.schedule.zero import Zero
from angel_jax.train.plan_record import plan_summary
from angel_jax.train.protocol import StateMismatch, check_arrays
from angel_jax.train.state_formats import (PAGE_FAMILIES, checked_ranks, first_layout_difference, page_name,
                                           pages_fingerprint, shard_meta_of, small_name)
from angel_jax.memory.shards import ShardMeta
from angel_jax.train.sharding import whole
from angel_jax.units import human_bytes

log = logging.getLogger(__name__)

WARMUP_STEPS = 3
RECORDED_STEPS = 2
HOST_PEAK_AFTER = 2
"""The host peak is compared with the plan's once this step (the first without compilation) is done."""


def layout_fingerprint(built: PagedRuntime, layouts: tuple[Any, Any] | None = None) -> dict[str, Any]:
    """Per stage: [dtype, length] of each parameter and optimizer page, [dtype, shape] of each small leaf.
    `layouts`: (params, optimizer) layouts of the same leaves to describe instead of the engine's own (those of
    a checkpoint written over another number of ranks)."""
    model, small = built.model, built.updater.small_specs
    params_layout, opt_layout = layouts or (model.params_layout, model.opt_layout)
    out = {}
    for i, stage in enumerate(model.staged.stages):
        out[stage.name] = {
            "params": pages_fingerprint(params_layout, stage.name),
            "opt": pages_fingerprint(opt_layout, stage.name),
            "opt_small": [[np.dtype(dtype).name, list(shape)] for shape, dtype in small[i]],
        }
    return out


class PagedTrainEngine:
    """Called on the training thread only. It reads and changes the executor's and updater's state through their
    methods (`PageUpdater.state` and `reset`, `PagedExecutor.set_step`), never by writing their fields."""

    name = "paged"
    guards_update_norm = False
    """The anomaly monitor leaves max_update_norm unbounded for this engine: the update norm is known only once
    every stage's update is computed, so guarding it costs a second pass over all stages (see optim/stage_update.py)."""

    def __init__(self, cfg: Config, mesh: jax.sharding.Mesh):
        self.host_peak = HostPeakCheck.start()  # before anything is built: the growth from here is the engine's
        # Several devices: every page sharded over all of them, each rank computing on its rows (ZeRO-3).
        self.zero = Zero.over(mesh.devices) if mesh.devices.size > 1 else None
        self.device = self.zero.local_device() if self.zero else mesh.devices.flat[0]
        self.batch_sharding: jax.sharding.Sharding = self.zero.rows() if self.zero else \
            jax.sharding.SingleDeviceSharding(self.device)
        # Built one way: the blueprint (page layouts and stage functions, from shapes), then the budgets and
        # micro-batching decided once from its sizes (train.micro_batch_size 0 becomes the whole batch or the
        # largest halving whose working set the device holds; a model the budgets cannot hold is refused before
        # anything is profiled or allocated), then the runtime under that decision.
        start = time.perf_counter()
        bp = blueprint(cfg, self.zero)
        layouts_seconds = time.perf_counter() - start
        log.info("paged engine: page layouts and stage functions of %d stages in %.1f s", len(bp.staged.stages),
                 layouts_seconds)
        decision = decide(cfg, self.device, cfg.train.batch_size, bp.sizes, self.zero)
        self.cfg = cfg = decision.cfg
        example = jax.make_array_from_callback((cfg.train.batch_size, cfg.model.seq_len + 1), self.batch_sharding,
                                               lambda index: np.zeros((cfg.train.batch_size, cfg.model.seq_len + 1),
                                                                      np.int32)[index])
        # The model is initialised stage by stage straight into its pages' homes: never whole in memory.
        self.built: PagedRuntime = assemble_runtime(decision, bp, None, example, self.device, self.zero,
                                                    layouts_seconds=layouts_seconds)
        self.executor = self.built.executor
        self._timelines_due = {"predicted": True, "measured": True}
        self._steps_here = 0  # steps run by this engine (a resumed run warms up again before recording)
        # The plan's peaks are its ranks' together (ZeRO-3: N ranks, each holding 1/N): this process holds its
        # local ranks' shares. On the CPU backend the "device" tier is host RAM too.
        peak, local = self.built.plan.peak_bytes, len(mesh.local_devices)
        ranks = self.zero.ranks if self.zero else 1
        self.host_peak.planned = local * (peak["host"] + (peak["device"] if self.device.platform == "cpu" else 0)) \
            // ranks

    # ------------------------------------------------------------------------------------------------ training
    def step(self, batch: jax.Array, controls: StepControls | None = None) -> dict[str, Any]:
        ex = self.executor
        if self._timelines_due["predicted"]:
            self._write_timeline("predicted", self.built.plan.predicted)
            self._write_plan()
        if self._steps_here == HOST_PEAK_AFTER + 1:  # (the loop has finished step HOST_PEAK_AFTER by now)
            self._check_host_peak()
        if self._steps_here == WARMUP_STEPS and self._timelines_due["measured"]:
            ex.record_steps(RECORDED_STEPS)
        metrics = ex.step(batch, controls)
        self._steps_here += 1
        if ex.last_timeline is not None and self._timelines_due["measured"]:
            self._write_timeline("measured", ex.last_timeline)
        return metrics

    def eval_loss(self, batch: jax.Array) -> jax.Array:
        """Forward only, stage by stage through the device (`PagedExecutor.eval_loss`): never the whole model.
        The host-peak check runs again once its loss is computed: the kernel's peak since the engine was built
        covers the evaluation, which the check after the first steady steps had not seen."""
        loss = jax.block_until_ready(self.executor.eval_loss(batch))
        if self._steps_here >= HOST_PEAK_AFTER:  # (before that, the first steady step's check covers it)
            self._check_host_peak("an evaluation")
        return loss

    @property
    def stale_uses(self) -> int:
        """Stage uses that ran one update behind (lock-free mode; always 0 with staleness 0)."""
        return self.built.updater.stale_uses

    def _write_plan(self) -> None:
        """plan.json in the run directory, as `angel-jax plan` writes it (homes per family, bytes, I/O)."""
        if jax.process_index() != 0:
            return
        b = self.built
        summary = plan_summary(b.plan, b.costs, b.budgets, b.bandwidths, f"profiled; bandwidths: {b.bandwidths.source}",
                               b.model.staged.param_count)
        try:
            Path(self.cfg.run_dir).mkdir(parents=True, exist_ok=True)
            (Path(self.cfg.run_dir) / "plan.json").write_text(json.dumps(summary, indent=1))
        except OSError as e:
            log.warning("could not write plan.json to %s: %s", self.cfg.run_dir, e)

    def _write_timeline(self, kind: str, timeline: Timeline) -> None:
        self._timelines_due[kind] = False
        if jax.process_index() != 0:
            return
        run_dir = Path(self.cfg.run_dir)
        try:
            run_dir.mkdir(parents=True, exist_ok=True)
            timeline.save_json(run_dir / f"timeline_{kind}.json")
            save_pngs(run_dir, self.cfg.name)  # both charts, on one time scale once both exist
        except Exception as e:  # noqa: BLE001 - a picture is not worth stopping training for (matplotlib's errors)
            log.warning("could not write the %s timeline to %s: %s: %s", kind, run_dir, type(e).__name__, e)

    # ------------------------------------------------------------------------------------------------ state
    def _names(self) -> tuple[list, list, list]:
        model = self.built.model
        params, opt, small = [], [], []
        for i, stage in enumerate(model.staged.stages):
            params += [(page_name("params", stage.name, k), pid) for k, pid in enumerate(model.param_ids(i))]
            opt += [(page_name("opt", stage.name, k), oid) for k, oid in enumerate(model.opt_ids(i))]
            small += [(small_name(stage.name, j), i, j) for j in range(len(self.built.updater.small_specs[i]))]
        return params, opt, small

    @property
    def checkpoints_per_process(self) -> bool:
        """Pages sharded over the devices of several processes: each process checkpoints its own shards."""
        return self._spans_processes()

    def state_snapshot(self, may_hold: bool = True) -> StateSnapshot:
        """Never held: host and disk pages are updated in place by the next step, so a checkpoint copies them
        before its save returns. Pages are `LazyArray`s, read one at a time as the checkpoint copies them: a state
        larger than RAM (pages on disk) never has to be in memory whole.

        With pages sharded over the devices of several processes (`checkpoints_per_process`), a page's array is
        this process's shards of it only (its ranks' shards end to end, `ProcessShards.local`; `state_meta` says
        which ranks): every process writes its own part of the checkpoint, and nothing is gathered."""
        updater_state = self.built.updater.state()  # lock-free mode: the last step's updates land first
        self.built.store.wait_all()
        store = self.built.store
        params, opt, small_names = self._names()
        out: dict[str, Any] = {}
        split = store.process_shards
        for name, pid in params + opt:
            (length,), dtype = self._page_spec(pid)
            # Saved typed as their values (a numpy view of the bits the store holds: exact), as before pages
            # were held as bits, so checkpoints of either kind read back alike.
            out[name] = LazyArray((length,), dtype, lambda pid=pid, dtype=dtype: to_values(store.read(pid), dtype)) \
                if split is None else LazyArray((split.length(length),), dtype,
                                                lambda pid=pid, dtype=dtype: to_values(self._local(pid), dtype))
        out.update({name: np.asarray(updater_state.opt_small[i][j]) for name, i, j in small_names})
        out["step"] = np.asarray(self.executor.step_count, np.int32)
        out["applied"] = np.asarray(updater_state.applied, np.int32)
        return StateSnapshot(out)

    def _spans_processes(self) -> bool:
        return self.zero is not None and len({d.process_index for d in self.zero.mesh.devices.flat}) > 1

    def _shard_meta(self) -> ShardMeta | None:
        """This process's shards of every page (the page store's `ProcessShards`), when pages are sharded across
        processes; else None."""
        split = self.built.store.process_shards
        return None if split is None else ShardMeta(jax.process_index(), jax.process_count(), split.ranks, split.total)

    def _local(self, page_id: int) -> np.ndarray:
        """This process's shards of a page, from the device or host tier, else from its disk files (which hold
        this process's part of the page only)."""
        store = self.built.store
        tiers = [t for t in store.where(page_id) if t != "disk"]
        if not tiers:
            return store.read(page_id)
        return store.process_shards.local(store.get(page_id, tiers[0]))

    def _gathered(self, page_id: int) -> np.ndarray:
        """A page whole in this process, gathered from every process holding a shard of it (a collective)."""
        store = self.built.store
        tiers = [t for t in store.where(page_id) if t != "disk"]
        if not tiers:  # each process's disk holds its part: made a global page again, then gathered
            return np.array(whole(store.process_shards.page(store.read(page_id), store.tiers["host"].sharding)))
        return np.array(whole(store.get(page_id, tiers[0])))

    @property
    def ranks(self) -> int:
        """Devices every page is sharded over (1: pages whole on one device)."""
        return self.zero.ranks if self.zero else 1

    def state_meta(self) -> dict[str, Any]:
        mine = self._shard_meta()
        return {"engine": self.name, "page_size": self.cfg.memory.page_size,
                "page_fit": self.cfg.memory.page_fit, "ranks": self.ranks,
                "layout": layout_fingerprint(self.built), **({"shards": mine.to_dict()} if mine else {})}

    def load_state(self, arrays: Mapping[str, np.ndarray], meta: Mapping[str, Any]) -> None:
        if meta.get("engine") != self.name:
            raise StateMismatch(f"the checkpoint was written by the {meta.get('engine')!r} engine, this run uses "
                                f"{self.name!r} (memory.mode); resume with the same memory.mode")
        theirs = checked_ranks(meta, self.cfg.memory.page_size, "paged engine", self.cfg.memory.page_fit)
        model = self.built.model
        # The checkpoint's pages as the run that wrote them laid them out: the same leaves over its ranks.
        layouts = (model.params_layout, model.opt_layout) if theirs == self.ranks else \
            (layout_over(model.params_layout, theirs), layout_over(model.opt_layout, theirs))
        problem = first_layout_difference(layout_fingerprint(self.built, layouts), meta.get("layout"))
        if problem:
            raise StateMismatch(f"paged engine: the checkpoint's page layout differs from this run's model laid out "
                                f"over the checkpoint's {theirs} rank{'s' if theirs > 1 else ''}: {problem} (another "
                                "model or optimizer config?)")
        shards = self._checkpoint_shards(meta)
        params, opt, small_names = self._names()
        store, updater = self.built.store, self.built.updater
        expected: dict[str, Any] = {}
        part = (lambda n: n) if shards is None else (lambda n: n // shards.total_ranks * len(shards.ranks))
        for stage in model.staged.stages:
            for family, layout in zip(PAGE_FAMILIES, layouts):
                expected.update({page_name(family, stage.name, k): ((part(p.length),), p.dtype)
                                 for k, p in enumerate(layout.stage(stage.name).pages)})
        expected.update({name: updater.small_specs[i][j] for name, i, j in small_names})
        expected["step"] = expected["applied"] = ((), np.dtype(np.int32))
        check_arrays(expected, arrays, "paged engine")
        updater.drain()
        store.wait_all()
        if shards is not None:  # this process's own shards, back on its own ranks
            homes = self._homes()
            for name, pid in params + opt:
                sharding = store.tiers["host" if homes[pid] == "disk" else homes[pid]].sharding
                self._put(pid, store.process_shards.page(to_bits(np.asarray(arrays[name])), sharding), homes)
        elif theirs == self.ranks:
            homes = self._homes()
            for name, pid in params + opt:  # one page at a time: never two copies of the model in flight
                self._put(pid, to_bits(np.asarray(arrays[name])), homes)
        else:
            # Resharding reorders the gradient reductions: the losses that follow match an uninterrupted run's to
            # float rounding, not bit for bit, hence a warning rather than a note.
            log.warning("paged engine: resharding the checkpoint's pages from %d to %d ranks (a run over %d "
                        "device%s resumes a checkpoint written over %d)", theirs, self.ranks, self.ranks,
                        "s" if self.ranks > 1 else "", theirs)
            self._reshard(arrays, layouts)
        small: list[list[np.ndarray]] = [[] for _ in updater.small_specs]
        for name, i, _ in small_names:  # in leaf order
            small[i].append(np.asarray(arrays[name]))
        step = int(arrays["step"])
        updater.reset(step, int(arrays["applied"]), small)
        self.executor.set_step(step)

    def _checkpoint_shards(self, meta: Mapping[str, Any]) -> ShardMeta | None:
        """The shards a checkpoint of one process holds (None: whole pages), refused unless they are exactly
        this process's: another set of processes resumes from every process's shards assembled into whole pages
        (`TrainCheckpointer.restore_latest` does that)."""
        theirs = shard_meta_of(meta, "paged engine")
        if theirs is None:
            return None
        mine = self._shard_meta()
        if mine is None or (theirs.processes, theirs.ranks, theirs.total_ranks) != \
                (mine.processes, mine.ranks, mine.total_ranks):
            here = "pages whole in one process" if mine is None else \
                f"ranks {list(mine.ranks)} of {mine.total_ranks} over {mine.processes} processes"
            raise StateMismatch(f"paged engine: the checkpoint holds process {theirs.process}'s shards (ranks "
                                f"{list(theirs.ranks)} of {theirs.total_ranks}, over {theirs.processes} processes), "
                                f"this process holds {here}: only every process's shards together make the state "
                                "(resume through the trainer, which assembles them)")
        return theirs

    def _homes(self) -> dict[int, str]:
        plan, model = self.built.plan, self.built.model
        homes = {}
        for i in range(len(plan.home)):
            homes.update({pid: plan.home[i] for pid in model.param_ids(i)})
            homes.update({oid: plan.opt_home[i] for oid in model.opt_ids(i)})
        return homes

    def _put(self, page_id: int, page: np.ndarray, homes: dict[int, str]) -> None:
        """Replace a page by `page`, in the home this run's plan gives it (`homes`, from `_homes`)."""
        store = self.built.store
        store.remove(page_id)
        store.add(page_id, page, home=homes[page_id]).wait()

    def _reshard(self, arrays: Mapping[str, np.ndarray], layouts: tuple[Any, Any]) -> None:
        """The checkpoint's pages, laid out by `layouts`, into this run's: per stage and family, the pages unpacked
        into whole leaves and packed again. One stage at a time: never the whole model in memory."""
        model, homes = self.built.model, self._homes()
        for i, stage in enumerate(model.staged.stages):
            for family, theirs, mine, ids in (("params", layouts[0], model.params_layout, model.param_ids(i)),
                                              ("opt", layouts[1], model.opt_layout, model.opt_ids(i))):
                old = theirs.stage(stage.name)
                leaves = old.unpack([np.asarray(arrays[f"{family}/{stage.name}/{k}"])
                                     for k in range(len(old.pages))])
                pages = mine.stage(stage.name).pack(leaves)
                del leaves
                for pid, page in zip(ids, pages):
                    self._put(pid, page, homes)
                del pages

    def _page_spec(self, page_id: int) -> tuple[tuple[int], np.dtype]:
        model = self.built.model
        page_id = model.first_set_id(page_id)  # (a second set's parameter page: the first's shape)
        layout, pid = (model.opt_layout, page_id - model.opt_offset) if page_id >= model.opt_offset else \
            (model.params_layout, page_id)
        spec = layout.page(pid)
        return (spec.length,), spec.dtype

    def params_room(self) -> int:
        """Host bytes a whole copy of the parameters may take at the end of the run (budgets.params_room)."""
        return params_room(self.cfg, self.built.plan.peak_bytes["host"])

    def params(self) -> Any:
        if not self._spans_processes():
            return self.executor.params()
        # Pages split across processes: every process gathers every page (a collective, in the same order).
        self.built.updater.drain()
        self.built.store.wait_all()
        model = self.built.model
        return model.staged.merge([model.params_layout.stage(stage.name).unpack(
            tuple(self._gathered(pid) for pid in model.param_ids(i))) for i, stage in enumerate(model.staged.stages)])

    # ------------------------------------------------------------------------------------------------ reports
    def memory_report(self) -> list[str]:
        built, plan = self.built, self.built.plan
        n = self.zero.ranks if self.zero else 1
        where = f"{self.device}" if n == 1 else f"each of {n} devices (every page sharded over them: ZeRO-3; bytes " \
                                                 "below per rank)"
        lines = [f"  placement          paged: {len(plan.resident)} of {len(plan.home)} stages resident on "
                 f"{where}, {len(plan.streamed)} streamed (prefetch {plan.prefetch}), "
                 f"{page_size_text(self.cfg)}, staleness {plan.staleness}"
                 + (f", {plan.micro_batches} micro-batches per step (layer-major"
                    + (f", in {plan.passes} accumulation passes)" if plan.passes > 1 else ")")
                    if plan.micro_batches > 1 else "")]
        for row in plan.table(built.costs):
            lines.append(f"  {row['tier']:<7} pages    params {human_bytes(row['params'] // n)}, gradients "
                         f"{human_bytes(row['gradients'] // n)}, optimizer {human_bytes(row['optimizer'] // n)}")
        disk = built.store.tiers.get("disk")
        if disk is not None and disk.bytes_used:
            how = {"unbuffered": "O_DIRECT, no page-cache copy", "memmap": "tensorstore, memory-mapped reads",
                   "default": "tensorstore, pread", "direct": "tensorstore, O_DIRECT reads"}.get(disk.io_mode, "")
            lines.append(f"  disk tier          {disk.root}, {disk.io_mode}: {how} "
                         f"(memory.disk_io={self.cfg.memory.disk_io})")
        peak = plan.peak_bytes
        lines.append(f"  predicted peak     device {human_bytes(peak['device'] // n)} of "
                     f"{human_bytes(built.budgets.device // n)} budget (activations and working set "
                     f"{human_bytes(built.plan.fixed_device // n)}), host {human_bytes(peak['host'] // n)}, "
                     f"disk {human_bytes(peak['disk'] // n)}")
        if plan.parked_bytes:
            lines.append(f"  parked activations stage inputs wait for their backward in host memory, "
                         f"{human_bytes(plan.parked_bytes // n)} a stage")
        on_device = plan.streamed_device_updates
        if on_device:
            lines.append(f"  device updates     {len(on_device)} streamed stages update on the device, their pages "
                         f"crossing the link and back ({human_bytes(plan.update_bytes // n)} of device memory)")
        if len(plan.streamed) > len(on_device):  # the other streamed stages update on the host
            lines.append(f"  host updates       {host_update_by(self.cfg.optimizer)}")
        layout = getattr(built.model.params_layout, "rank_layout", built.model.params_layout)  # (a rank's pages)
        if layout.waste_fraction > 0.5 and layout.fitted_page_size() < layout.page_size_bytes:
            lines.append(f"  page padding       {layout.waste_fraction:.0%} of the pages' bytes are padding (a model "
                         f"small for pages of {human_bytes(layout.page_size_bytes)}; memory, checkpoints and copies "
                         f"carry it): memory.page_size={layout.fitted_page_size()} fits each stage on a page")
        lines.append(f"  predicted step     {plan.predicted.step_time:.3f} s (bandwidths: {built.bandwidths.source})")
        took = built.build_seconds
        if took:
            lines.append(f"  built in           {sum(took.values()):.1f} s: page layouts {took['layouts']:.1f} s, "
                         f"compile and profile {took['profile']:.1f} s, pages into their homes {took['pages']:.1f} s")
        return lines

    def _check_host_peak(self, after: str = "the first steady steps") -> None:
        """Measure the peak again (after the first steady steps, every evaluation and at close); one warning line
        the first time it is over the plan."""
        warned = self.host_peak.warned
        if (warning := self.host_peak.check(after)) and not warned:
            log.warning("%s", warning)

    def close(self) -> None:
        if self._steps_here >= HOST_PEAK_AFTER:  # the whole run's peak, evaluations and checkpoints included
            self._check_host_peak("the run")
        if self._timelines_due["measured"] and self.executor.finish_recording() is not None:
            self._write_timeline("measured", self.executor.last_timeline)
        self.built.close()
