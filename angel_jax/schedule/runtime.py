"""The paged runtime: profiled costs -> plan -> page store -> pages, from a blueprint and the budgets decided for it.

    bp = blueprint(cfg)                                       # layouts and stage functions (schedule/blueprint.py)
    decision = decide(cfg, device, batch, bp.sizes)           # budgets, micro-batching (schedule/budgets.py)
    built = assemble_runtime(decision, bp, params, example_batch, device)
    metrics = built.executor.step(batch)

    built = build_paged_runtime(cfg, params, example_batch)   # the three in one, micro-batching as configured

`params`: numpy in the model's structure, or None: initialised stage by stage into their homes. `plan_for`
profiles the blueprint's stage functions and plans under the decided budgets; `assemble_runtime` then puts every
page in its planned home and wires the executor to the updater. `angel_jax/train/paged.py` wraps
the result in the `TrainEngine` protocol the training loop drives; `angel-jax plan` (cli/plan.py) stops after
`plan_for`, without allocating the model.
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

import jax
import numpy as np

from angel_jax.config import Config, ConfigError
from angel_jax.memory import DeviceTier, DiskTier, HostTier, PageLayout, PageStore, host_memory_kind
from angel_jax.memory.bench_io import default_calibration_path
from angel_jax.memory.disk_tier import PAGES_SUBDIR
from angel_jax.memory.malloc import return_large_frees_to_the_os
from angel_jax.memory.serial import SerialStore
from angel_jax.memory.shardwise import Shardwise
from angel_jax.memory.tiers import page_sharding
from angel_jax.multihost import primary_floats
from angel_jax.optim import make_optimizer
from angel_jax.optim.stage_update import split_opt_state
from angel_jax.schedule.blueprint import Blueprint, blueprint
from angel_jax.schedule.budgets import Decision, decide, plan_settings
from angel_jax.schedule.costs import profile_costs, profile_transfers
from angel_jax.schedule.execute import PagedExecutor, PagedModel
from angel_jax.schedule.plan import Bandwidths, Budgets, Plan, StageCost, load_bandwidths, make_plan
from angel_jax.schedule.updater import PageUpdater, Placement, StageSlot
from angel_jax.schedule.zero import Zero

log = logging.getLogger(__name__)


@dataclass
class PagedRuntime:
    """Everything the paged engine is made of (what `build_paged_runtime` returns)."""

    executor: PagedExecutor
    plan: Plan
    costs: list[StageCost]
    bandwidths: Bandwidths
    budgets: Budgets
    model: PagedModel
    store: PageStore
    updater: PageUpdater
    build_seconds: dict[str, float] = dataclasses.field(default_factory=dict)
    """Where building took its time: 'layouts' (page layouts and stage functions traced from shapes), 'profile'
    (compiling and timing the stage programs, then planning), 'pages' (every stage initialised, or split from the
    given params, and its pages put in their homes)."""

    @property
    def layout(self) -> PageLayout:
        return self.model.params_layout

    def close(self) -> None:
        self.updater.close()
        self.store.close()


def placements(device: jax.Device, host_sharding: jax.sharding.Sharding, zero: Zero | None = None, *,
               accelerator_path: bool = False) -> dict[str, Placement]:
    """Where updates run: resident stages on the device; streamed ones on the host, or on the device
    ('device_for_host': host pages cross to the device for the update and back, `memory.streamed_updates`). The
    CPU backend computes on its host-memory pages in place; an accelerator's pinned host pages go to the XLA CPU
    backend and back (with `zero`, shard by shard: memory/shardwise.py). `accelerator_path` runs the CPU backend's
    host updates that accelerator way too (`memory.accelerator_path`). With `zero`, every rank updates its own
    shards where they live, or those of a streamed stage on its device ('device_for_host'); scalars are replicated
    over the ranks."""
    cpu = jax.local_devices(backend="cpu")[0]
    crosses = accelerator_path or device.platform != "cpu"
    if zero is not None:
        on_device = zero.pages()
        host_scalars = zero.replicated(host_sharding.memory_kind)
        split = Shardwise(host_sharding, host_scalars, cpu) if crosses else None
        return {"device": Placement(on_device, on_device, zero.replicated()),
                "host": Placement(host_sharding, host_sharding, host_scalars, crosses=crosses, shardwise=split),
                "device_for_host": Placement(on_device, host_sharding, zero.replicated())}
    on_device = jax.sharding.SingleDeviceSharding(device)
    crossing = Placement(on_device, host_sharding)
    if not crosses:
        return {"device": Placement(on_device, on_device), "host": Placement(host_sharding, host_sharding),
                "device_for_host": crossing}
    return {"device": Placement(on_device, on_device),
            "host": Placement(jax.sharding.SingleDeviceSharding(cpu), host_sharding, crosses=True),
            "device_for_host": crossing}


def make_store(cfg: Config, device: jax.Device, budgets: Budgets, plan: Plan, zero: Zero | None = None) -> PageStore:
    """The page store under the plan's budgets: the device tier holds what the budget leaves beside the plan's
    fixed bytes (activations and working set are outside it), the host and disk tiers their budgets. `zero`:
    array tiers hold global pages sharded over its mesh; with the mesh's devices in several processes each
    process's disk tier is a subdirectory of its own in memory.disk_dir, holding its part of every disk-homed
    page (the store's `ProcessShards`), its budget counting pages whole as the array tiers' do."""
    over = zero.mesh if zero is not None else None
    disk = None
    if cfg.memory.disk_dir:
        per_process = zero is not None and len({d.process_index for d in zero.mesh.devices.flat}) > 1
        subdir = f"{PAGES_SUBDIR}.process_{jax.process_index()}" if per_process else PAGES_SUBDIR
        disk = DiskTier(cfg.memory.disk_dir, budget=budgets.disk, subdir=subdir, io_mode=cfg.memory.disk_io)
    # (the device also holds activations and working set, and the pages of streamed stages updated there)
    return PageStore(DeviceTier(device, budget=budgets.device - plan.fixed_device - plan.update_bytes, over=over),
                     HostTier(device, budget=budgets.host, over=over), disk)


def tier_shardings(device: jax.Device, zero: Zero | None = None) -> tuple[jax.sharding.Sharding,
                                                                        jax.sharding.Sharding]:
    """(device tier, host tier) shardings of the store `make_store` builds: what profiling places its inputs on."""
    over = zero.mesh if zero is not None else None
    if over is not None:
        device = over.devices.flat[0]
    return (page_sharding(device, device.default_memory().kind, over),
            page_sharding(device, host_memory_kind(device), over))


def plan_for(decision: Decision, bp: Blueprint, example_batch: jax.Array, device: jax.Device,
             zero: Zero | None = None) -> tuple[Plan, list[StageCost], Bandwidths]:
    """Profile the stage functions (on one micro-batch: the shape every call has) and transfers, then plan under
    the decided budgets (schedule/budgets.py) for `example_batch`'s rows."""
    cfg, budgets, micro_batches = decision.cfg, decision.budgets, decision.micro_batches
    device_sharding, host_sharding = tier_shardings(device, zero)
    # Phase by phase as they happen: on a small CPU, compiling the stage functions alone takes a minute.
    start = time.perf_counter()
    log.info("paged engine: compiling and profiling the functions of %d stages (one micro-batch of %d rows) ...",
             len(bp.staged.stages), decision.rows)
    costs = profile_costs(bp.fns, bp.updates, bp.params_layout, bp.opt_layout, bp.opt_small,
                          jax.device_put(example_batch[:decision.rows], device_sharding),
                          placements(device, host_sharding, zero, accelerator_path=cfg.memory.accelerator_path),
                          micro_batches)
    log.info("paged engine: stage functions compiled and profiled in %.1f s", time.perf_counter() - start)
    start = time.perf_counter()
    bw = profile_transfers(bp.params_layout, device_sharding, host_sharding,
                           load_bandwidths(default_calibration_path()))
    if jax.process_count() > 1:  # every process must make the same plan: the programs they run are collectives
        costs, bw = _agreed(costs, bw)
    plan = make_plan(costs, bw, budgets, shared_cpu=device.platform == "cpu", micro_batches=micro_batches,
                     **plan_settings(cfg))
    log.info("paged engine: transfers profiled and the plan made in %.1f s: %d of %d stages resident, %d "
             "streamed, predicted step %.3f s", time.perf_counter() - start, len(plan.resident), len(plan.home),
             len(plan.streamed), plan.predicted.step_time)
    if "disk" in plan.home + plan.grad_home + plan.opt_home and not Path(default_calibration_path()).is_file():
        # The disk figures are then guesses: the plan's placement and predicted step rest on them.
        log.warning("the plan puts pages on the disk, but this machine's disk is not calibrated (no %s): the plan "
                    "assumes %.1f GB/s each way and no CPU cost per byte. Run `angel-jax bench io` once to measure it.",
                    default_calibration_path(), bw.disk_read / 1e9)
    return plan, costs, bw


def _agreed(costs: list[StageCost], bw: Bandwidths) -> tuple[list[StageCost], Bandwidths]:
    """Process 0's profiled times and bandwidths, on every process (each process timed its own calls, with
    noise; plans made from different figures could differ, and with them the collectives each process runs)."""
    times = ("forward_s", "backward_s", "update_device_s", "update_host_s", "host_add_s")
    links = ("h2d", "d2h", "disk_read", "disk_write", "disk_read_cpu", "disk_write_cpu")
    mine = np.array([getattr(c, t) for c in costs for t in times] + [getattr(bw, k) for k in links], np.float64)
    theirs = primary_floats(mine)
    per = iter(theirs[:len(costs) * len(times)].reshape(len(costs), len(times)))
    costs = [dataclasses.replace(c, **dict(zip(times, map(float, next(per))))) for c in costs]
    return costs, dataclasses.replace(bw, **dict(zip(links, map(float, theirs[len(costs) * len(times):]))))


@contextlib.contextmanager
def _young_garbage_collected() -> Iterator[None]:
    """Collect the reference cycles the block leaves (a stage's Flax NNX module graph holds its arrays in cycles,
    so they would wait for Python's collector) at the cost of the block's own objects. A full gc.collect() walks
    every object of the process: a fraction of a second per stage in a large one. With automatic collection
    paused in the block, everything the block allocated is still in the youngest generation at its end, and
    collecting that generation alone frees the cycles among those objects."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()
    gc.collect(0)


def two_sets(plan: Plan, i: int) -> bool:
    """Whether stage i has two sets of parameter pages: lock-free mode, parameters homed on disk, updated on the
    host (its versions alternate between the sets, `StageSlot.second_set`; the plan counts both on disk)."""
    return bool(plan.staleness) and plan.home[i] == "disk" and plan.updates[i] == "host"


def build_paged_runtime(cfg: Config, params: Any, example_batch: jax.Array, *, device: jax.Device | None = None,
                        zero: Zero | None = None) -> PagedRuntime:
    """The paged runtime for `cfg`, planned for `example_batch`'s shape, with train.micro_batch_size as the config
    sets it: `blueprint`, `decide` and `assemble_runtime` in turn."""
    device = device or (zero.local_device() if zero else jax.local_devices()[0])
    start = time.perf_counter()
    bp = blueprint(cfg, zero)
    decision = decide(cfg, device, example_batch.shape[0], bp.sizes, zero, fit=False)
    return assemble_runtime(decision, bp, params, example_batch, device, zero,
                            layouts_seconds=time.perf_counter() - start)


def assemble_runtime(decision: Decision, bp: Blueprint, params: Any, example_batch: jax.Array, device: jax.Device,
                     zero: Zero | None = None, *, layouts_seconds: float = 0.0) -> PagedRuntime:
    """The paged engine of blueprint `bp` under `decision` (`budgets.decide`: its config is the one run), planned
    for `example_batch`'s shape. `params`: the whole model's (numpy, in its structure), or None to initialise it
    stage by stage (`StagedModel.init_stage` with train.seed) straight into each page's home, so that the whole
    model never exists in memory. `zero`: every page sharded over its mesh's devices (ZeRO-3, schedule/zero.py);
    `example_batch` is then the ranks' whole batch. `layouts_seconds`: what making `bp` took, for the report."""
    return_large_frees_to_the_os()  # page buffers stream through the host: freed ones must leave the process
    clock = [time.perf_counter()]

    def lap() -> float:
        clock.append(time.perf_counter())
        return clock[-1] - clock[-2]

    cfg, budgets = decision.cfg, decision.budgets
    staged = bp.staged
    seconds = {"layouts": layouts_seconds}
    plan, costs, bw = plan_for(decision, bp, example_batch, device, zero)
    seconds["profile"] = lap()
    store = make_store(cfg, device, budgets, plan, zero)
    model = PagedModel(staged, bp.params_layout, bp.opt_layout, opt_offset=bp.params_layout.num_pages,
                       grad_sets=1 + plan.staleness, newest=[0] * len(staged.stages))
    tx, _ = make_optimizer(cfg.optimizer, cfg.train.steps, clip=False)
    where = placements(device, store.tiers["host"].sharding, zero, accelerator_path=cfg.memory.accelerator_path)
    whole = staged.split(params) if params is not None else None
    slots, small = [], []
    cpu = jax.local_devices(backend="cpu")[0]
    homes = sorted(set(plan.home) | set(plan.opt_home))
    log.info("paged engine: %s the pages of %d stages in their homes (%s) ...",
             "initialising" if whole is None else "placing", len(staged.stages), ", ".join(homes))
    try:
        for i, stage in enumerate(staged.stages):
            where_home = "device" if plan.home[i] == "device" else "host"  # the tier its update reads pages from
            with jax.default_device(cpu), _young_garbage_collected():  # built on the host, whatever its home
                stage_params = jax.tree.map(np.asarray, whole[i] if whole is not None
                                            else staged.init_stage(cfg.train.seed, i))
                big, small_leaves, _ = split_opt_state(tx.init(stage_params))
            for pid, page in zip(model.param_ids(i), bp.params_layout.stage(stage.name).pack(stage_params)):
                store.add(pid, page, home=plan.home[i])
            del stage_params
            big = [np.asarray(b) for b in big]
            for oid, page in zip(model.opt_ids(i), bp.opt_layout.stage(stage.name).pack(big)):
                store.add(oid, page, home=plan.opt_home[i])
            del big
            slot = StageSlot(stage.name, stage.kind, model.param_ids(i), model.opt_ids(i), where_home,
                             plan.opt_home[i], param_home=plan.home[i], grad_home=plan.grad_home[i],
                             grad_ids=model.grad_ids(i) if plan.grad_home[i] == "disk" else (),
                             update_on=plan.updates[i], second_set=model.param_ids(i, 1) if two_sets(plan, i) else ())
            small.append([jax.device_put(np.asarray(s), where[slot.placement].scalar) for s in small_leaves])
            slots.append(slot)
            errors = store.wait_all()  # one stage at a time: host memory holds at most one stage's staging copies
            if errors:
                raise errors[0]
    except BaseException:
        store.close()
        raise
    del whole
    if not cfg.memory.overlap:  # every move waited for; the updates run in turn on the training thread (inline)
        store = SerialStore(store)
    updater = PageUpdater(store, slots, bp.updates, small, where, bp.schedule, staleness=cfg.memory.staleness,
                          inline=zero is not None or not cfg.memory.overlap, newest=model.newest,
                          opt_staging=plan.opt_staging, lock_free_from=cfg.memory.lock_free_from)
    executor = PagedExecutor(model, bp.fns, plan, store, updater,
                             micro_batch_size=decision.rows,
                             host_compute=where["host"].compute, overlap=cfg.memory.overlap,
                             host_split=where["host"].shardwise)
    seconds["pages"] = lap()
    log.info("paged engine: pages allocated and initialised in %.1f s", seconds["pages"])
    log.info("paged engine: %d stages, %d resident, prefetch %d, predicted step %.3f s; built in %.1f s (layouts "
             "%.1f s, compile and profile %.1f s, pages %.1f s)", len(staged.stages), len(plan.resident),
             plan.prefetch, plan.predicted.step_time, sum(seconds.values()), seconds["layouts"], seconds["profile"],
             seconds["pages"])
    return PagedRuntime(executor, plan, costs, bw, budgets, model, store, updater, seconds)
