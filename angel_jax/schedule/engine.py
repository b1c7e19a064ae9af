"""Build the paged engine from a config: layouts -> stage functions -> profiled costs -> plan -> page store.

    built = build_paged_engine(cfg, params, example_batch)      # params: numpy in the model's structure, or None:
                                                                # initialised stage by stage into their homes
    metrics = built.executor.step(batch)

`blueprint(cfg)` makes the page layouts and compiled stage functions from shapes alone (cached per configuration
in the process); `plan_for` profiles them and plans under the config's budgets; `build_paged_engine` then puts
every page in its planned home and wires the executor to the updater. `angel_jax/train/paged.py` wraps
the result in the `TrainEngine` protocol the training loop drives; `angel-jax plan` (train/plan_cli.py) stops after
`plan_for`, without allocating the model.
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import json
import logging
import os
import shutil
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator

import jax
import jax.numpy as jnp
import numpy as np
import optax
import psutil

from angel_jax import config as config_lib
from angel_jax.config import Config, ConfigError
from angel_jax.memory import DeviceTier, DiskTier, HostTier, PageLayout, PageStore, pinned
from angel_jax.memory.layout import StageLayout
from angel_jax.memory.bench_io import default_calibration_path
from angel_jax.memory.malloc import return_large_frees_to_the_os
from angel_jax.memory.serial import SerialStore
from angel_jax.optim import is_elementwise, make_optimizer
from angel_jax.optim.fused import host_optimizer
from angel_jax.optim.paged import OptLayout, abstract_opt_state, paged_paths, split_opt_state
from angel_jax.schedule.updater import PageUpdater, Placement, StageSlot, StageUpdates
from angel_jax.schedule.costs import profile_costs, profile_transfers
from angel_jax.schedule.execute import PagedExecutor, PagedModel
from angel_jax.schedule.plan import (Bandwidths, Budgets, Plan, PlanError, StageCost, load_bandwidths, make_plan,
                                     min_host_bytes, minimum_device_bytes)
from angel_jax.schedule.stagefns import StageFunctions
from angel_jax.schedule.zero import Zero
from angel_jax.memory.sharded_layout import ShardedPageLayout
from angel_jax.units import device_free_bytes
import models
from models.stages import StagedModel

log = logging.getLogger(__name__)


@dataclass
class PagedEngine:
    """Everything the paged engine is made of (what `build_paged_engine` returns)."""

    executor: PagedExecutor
    plan: Plan
    costs: list[StageCost]
    bandwidths: Bandwidths
    budgets: Budgets
    model: PagedModel
    store: PageStore
    updater: PageUpdater

    @property
    def layout(self) -> PageLayout:
        return self.model.params_layout

    def close(self) -> None:
        self.updater.close()
        self.store.close()


@dataclass
class Blueprint:
    """The model's page layouts and compiled stage functions, before any page exists."""

    staged: StagedModel
    params_layout: PageLayout
    opt_layout: PageLayout
    opt_structure: dict[str, OptLayout]
    opt_small: dict[str, list]
    """Per stage, zeros shaped like the optimizer's small leaves (step counts): profiling inputs."""
    fns: StageFunctions
    updates: StageUpdates
    schedule: Any


def device_budget(cfg: Config, device: jax.Device) -> int:
    """memory.device_budget, or what the device has free (80% of available host RAM for the CPU backend, or
    `cpu_split`'s share)."""
    if cfg.memory.device_budget:
        return cfg.memory.device_budget
    split = cpu_split(cfg, device)
    return split[0] if split else device_free_bytes(device)


HOST_MARGIN = 2 << 30
"""Host memory left to everything else (the process's own arrays, the machine) when memory.host_budget is 0:
at least this, or a tenth of the machine's RAM when that is more."""
HOST_WINDOW_SLACK = 1.1
"""`cpu_split` gives the host tier its window's bytes times this."""


def _host_room() -> int:
    vm = psutil.virtual_memory()
    return int(vm.available) - max(HOST_MARGIN, int(vm.total) // 10)


def host_budget(cfg: Config, device: jax.Device | None = None) -> int:
    """memory.host_budget, or what this machine can give the host tier now: available RAM less a margin
    (`HOST_MARGIN`), so that a plan larger than the machine is refused instead of meeting the OOM killer. On the
    CPU backend (`device` a CPU) the "device" is that same RAM: the device budget is taken out of it too."""
    if cfg.memory.host_budget:
        return cfg.memory.host_budget
    split = cpu_split(cfg, device)
    if split:
        return split[1]
    room = _host_room()
    if device is not None and device.platform == "cpu":
        room -= device_budget(cfg, device)
    return max(0, room)


_splits: dict[str, tuple[int, int]] = {}


def cpu_split(cfg: Config, device: jax.Device | None) -> tuple[int, int] | None:
    """(device, host) budgets on the CPU backend when neither is set and a disk tier is: the two tiers are one RAM
    there, and a stage kept on the "device" needs no copies at all, so the host tier gets only what its window
    needs with every streamed page on disk (`min_host_bytes`, times HOST_WINDOW_SLACK) and the device the rest of
    the room. A fixed share (the device 80% of the available RAM, the host the rest less the margin: ~2 GiB on a
    24 GiB machine) refused a 3 B GPT whose window needs 2.4 GiB. None elsewhere (the budgets' own rules)."""
    if (device is None or device.platform != "cpu" or cfg.memory.device_budget or cfg.memory.host_budget
            or not cfg.memory.disk_dir):
        return None
    key = config_lib.dump_yaml(cfg)  # (shape_costs takes ~2 s for a 64-block model: once per config)
    if key not in _splits:
        room = max(0, _host_room())
        host = min(room, int(HOST_WINDOW_SLACK * min_host_bytes(shape_costs(cfg), cfg.memory.staleness)))
        _splits[key] = (room - host, host)
    return _splits[key]


def shape_costs(cfg: Config) -> list[StageCost]:
    """Per stage its bytes and no times: what a plan judged from shapes alone needs (nothing is profiled)."""
    bp = blueprint(cfg)
    return [StageCost(s.name, bp.params_layout.stage(s.name).nbytes, bp.opt_layout.stage(s.name).nbytes,
                      0.0, 0.0, 0.0, 0.0) for s in bp.staged.stages]


def check_host_room(cfg: Config, device: jax.Device) -> None:
    """Refuse, from shapes alone and before anything large is allocated or profiled, a model the budgets cannot
    hold: the plan is made on the page layouts' bytes (with no compute times), so the refusal is the one the
    profiled plan would give, naming the bytes missing and the key to raise."""
    costs = shape_costs(cfg)
    make_plan(costs, Bandwidths(), budgets_for(cfg, device, cfg.train.batch_size), staleness=cfg.memory.staleness,
              micro_batches=micro_batching(cfg, cfg.train.batch_size)[0], passes=cfg.memory.passes or None)


def fit_micro_batch(cfg: Config, device: jax.Device) -> Config:
    """`cfg` with train.micro_batch_size chosen where it is 0: the whole batch when some plan holds its working
    set on the device, else the largest of its halvings that one does (the fewest stage calls), judged from shapes
    alone as `check_host_room` judges. A set size, or a batch no halving fits, is left as it is (the plan then says
    what is missing)."""
    if cfg.train.micro_batch_size:
        return cfg
    costs = shape_costs(cfg)
    size = cfg.train.batch_size
    while True:
        trial = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, micro_batch_size=size))
        budgets = budgets_for(trial, device, cfg.train.batch_size)
        most_passes = cfg.memory.passes or cfg.train.batch_size // size
        if minimum_device_bytes(costs, budgets, most_passes) <= budgets.device:
            return cfg if size == cfg.train.batch_size else trial
        if size % 2:
            return cfg
        size //= 2


def budgets_for(cfg: Config, device: jax.Device, local_batch: int, zero: Zero | None = None) -> Budgets:
    """The plan's budgets. With `zero` (ZeRO-3 over N ranks) the plan is made for the ranks together, as one
    device N times a rank's: the memory.*_budget keys are per rank and count N times, pages are counted whole (N
    times a rank's shard), and the activations are those of the whole batch plus, per rank, the whole parameters
    and gradients of the largest stage while it computes (gathered, not yet reduce-scattered). Budgets taken from
    the machine (0) are the machine's: the device's own memory per rank, the host's RAM once."""
    if zero is None:
        return Budgets(device=device_budget(cfg, device), host=pinned_cap(host_budget(cfg, device), device),
                       disk=disk_budget(cfg) if cfg.memory.disk_dir else 0,
                       fixed_device=fixed_device_bytes(cfg, local_batch),
                       saved_device=saved_input_bytes(cfg, local_batch))
    n = zero.ranks
    shared = device.platform == "cpu"  # the CPU backend's devices are one RAM: its free bytes count once
    dev = cfg.memory.device_budget * n if cfg.memory.device_budget else device_free_bytes(device) * (1 if shared else n)
    host = cfg.memory.host_budget * n if cfg.memory.host_budget else host_budget(cfg, None) - (dev if shared else 0)
    disk = (cfg.memory.disk_budget * n if cfg.memory.disk_budget else disk_budget(cfg)) if cfg.memory.disk_dir else 0
    gathered = n * 2 * max(gathered_bytes(s, n) for s in params_layout(cfg).stages)  # each rank holds its own
    return Budgets(device=dev, host=pinned_cap(max(0, host), device, jax.process_count()), disk=disk,
                   fixed_device=fixed_device_bytes(cfg, local_batch) + gathered,
                   saved_device=saved_input_bytes(cfg, local_batch))


def pinned_cap(host: int, device: jax.Device, processes: int = 1) -> int:
    """On a GPU the host tier is XLA's pinned pool, whose limit (memory/pinned.py, one pool per process) no plan can
    pass: the host budget is at most that, times the `processes` a plan for the ranks together spans."""
    if device.platform != "gpu":
        return host
    cap = pinned.limit_bytes() * processes
    if host > cap:
        log.info("host budget %s B capped at the pinned host memory limit, %s B (%s)", f"{host:,}", f"{cap:,}",
                 pinned.LIMIT_ENV)
    return min(host, cap)


def pinned_host_need(cfg: Config, device_bytes: int, processes: int = 1) -> int | None:
    """The host tier's peak in a plan made from shapes alone (no device or GPU client needed) for a device with
    `device_bytes` free, one of `processes`: the pinned host memory the paged engine will hold; None when no plan
    fits (the engine's own refusal then says why)."""
    local = max(1, cfg.train.batch_size // processes)
    try:
        budgets = Budgets(device=cfg.memory.device_budget or device_bytes, host=host_budget(cfg, None),
                          disk=(disk_budget(cfg) or 0) if cfg.memory.disk_dir else 0,
                          fixed_device=fixed_device_bytes(cfg, local), saved_device=saved_input_bytes(cfg, local))
        plan = make_plan(shape_costs(cfg), Bandwidths(), budgets, staleness=cfg.memory.staleness,
                         micro_batches=micro_batching(cfg, local)[0], passes=cfg.memory.passes or None)
    except (PlanError, ConfigError):
        return None
    return plan.peak_bytes["host"]


def configure_pinned_limit(cfg: Config, processes: int = 1) -> str | None:
    """Before jax starts its GPU client: set XLA's pinned host memory limit to what the paged engine's plan puts in
    the host tier (+10% + 1 GiB), unless the environment sets it, the run is not paged (memory.mode in_memory) or
    there is no NVIDIA GPU. Left at XLA's 64 GiB the pool refused plans that need more; raised to most of the RAM
    (as a benchmark once did) it grew in doubling regions past what the plan needed, into the memory the host
    updates use, and the process was killed. Returns the line that says what was set, or None."""
    if pinned.LIMIT_ENV in os.environ or cfg.memory.mode == "in_memory":
        return None
    hbm = pinned.gpu_memory_bytes()
    if hbm is None:
        return None
    need = pinned_host_need(cfg, hbm, processes)
    if need is None:
        return None
    gib = min(pinned.limit_for(need), max(pinned.LEAST_LIMIT_GIB, host_budget(cfg, None) // pinned.GIB))
    os.environ[pinned.LIMIT_ENV] = str(gib)
    return (f"pinned host memory limited to {gib} GiB ({pinned.LIMIT_ENV}): the plan's host tier needs "
            f"{need / pinned.GIB:.1f} GiB, + {pinned.SLACK - 1:.0%} + {pinned.OVERHEAD // pinned.GIB} GiB")


def gathered_bytes(stage: StageLayout, ranks: int) -> int:
    """Device bytes one rank holds of a stage's parameters while it computes, gathered over `ranks` ranks: the whole
    stage, but only its own experts where the experts split evenly over the ranks (`keeps_apart`)."""
    if not stage.apart_splits(ranks):
        return stage.nbytes
    own = sum(p.nbytes for p in stage.pages if p.apart)
    return stage.nbytes - own + -(-own // ranks)


def micro_batching(cfg: Config, local_batch: int, zero: Zero | None = None) -> tuple[int, int]:
    """(micro-batches per step, rows per micro-batch) of a local batch of `local_batch` rows under
    train.micro_batch_size (0: one micro-batch of the whole batch); a batch that does not split is a ConfigError.
    With `zero` the batch is the ranks' together and train.micro_batch_size is per rank, as in the in-memory
    engine: a micro-batch has N times that many rows."""
    if zero is not None:
        micro = cfg.train.micro_batches(zero.ranks)
        if local_batch % (micro * zero.ranks):
            raise ConfigError(f"'train.batch_size'={local_batch} must be a multiple of the {zero.ranks} ranks "
                              f"(devices) the pages are sharded over")
        return micro, local_batch // micro
    size = cfg.train.micro_batch_size or local_batch
    if local_batch % size:
        raise ConfigError(f"'train.batch_size': the local batch of {local_batch} rows is not a multiple of "
                          f"'train.micro_batch_size'={size}")
    return local_batch // size, size


def saved_input_bytes(cfg: Config, local_batch: int) -> int:
    """Device bytes of every stage's saved input for the whole local batch (a plan of P accumulation passes holds
    1/P of them): the family's `saved_input_values` per row, or a chain of d_model-wide activations."""
    m = cfg.model
    per_row = models.get(m).saved_input_values or (m.n_layers + 1) * m.seq_len * m.d_model
    return local_batch * per_row * jnp.dtype(m.compute_dtype).itemsize


def fixed_device_bytes(cfg: Config, local_batch: int) -> int:
    """Device bytes every step needs whatever the placement: the saved input of every stage (for the whole local
    batch: every micro-batch's), the working set of the largest stage call (logits and their gradient for the
    head; attention and MLP intermediates for a block) for one micro-batch, estimated from shapes (the block's
    intermediates are the family's, `StagedModel.block_activation_width`), and with several micro-batches the
    float32 gradient sums of the largest stage."""
    m = cfg.model
    micro_batches, size = micro_batching(cfg, local_batch)
    itemsize = jnp.dtype(m.compute_dtype).itemsize
    tokens, call_tokens = local_batch * m.seq_len, size * m.seq_len
    saved = saved_input_bytes(cfg, local_batch)
    head = 3 * call_tokens * m.vocab_size * 4
    width = models.get(m).block_activation_width
    assert width > 0, f"model family {m.name!r} does not state its block_activation_width"
    block = call_tokens * width * itemsize * 2 + size * m.n_heads * m.seq_len * m.seq_len * 4
    sums = 0
    if micro_batches > 1:
        sums = max(sum(p.length for p in s.pages) for s in params_layout(cfg).stages) * 4
    return saved + max(head, block) + tokens * 8 + sums


def placements(device: jax.Device, host_sharding: jax.sharding.Sharding,
               zero: Zero | None = None) -> dict[str, Placement]:
    """Where updates run: resident stages on the device; streamed ones on the host. The CPU backend computes on
    its host-memory pages in place; an accelerator's pinned host pages go to the XLA CPU backend and back. With
    `zero`, every rank updates its own shards where they live; scalars are replicated over the ranks."""
    if zero is not None:
        if device.platform != "cpu":
            raise ConfigError("'mesh': the paged engine shards pages over several devices (ZeRO-3) on the CPU "
                              "backend only so far: host updates of an accelerator's sharded pages are not built. "
                              "Use memory.mode=in_memory with mesh.fsdp on accelerators.")
        on_device = zero.pages()
        return {"device": Placement(on_device, on_device, zero.replicated()),
                "host": Placement(host_sharding, host_sharding, zero.replicated(host_sharding.memory_kind))}
    on_device = jax.sharding.SingleDeviceSharding(device)
    if device.platform == "cpu":
        return {"device": Placement(on_device, on_device), "host": Placement(host_sharding, host_sharding)}
    cpu = jax.sharding.SingleDeviceSharding(jax.local_devices(backend="cpu")[0])
    return {"device": Placement(on_device, on_device), "host": Placement(cpu, host_sharding)}


def blueprint(cfg: Config, zero: Zero | None = None) -> Blueprint:
    """Layouts and compiled stage functions for the config's model, optimizer and page size, from shapes alone.
    Cached per process: engines of the same configuration (a benchmark's repeats, a restart in the same
    process) share the compiled functions instead of compiling them again."""
    key = json.dumps([dataclasses.asdict(cfg.model), dataclasses.asdict(cfg.optimizer), cfg.train.steps,
                      cfg.memory.page_size, [d.id for d in zero.mesh.devices.flat] if zero else None],
                     sort_keys=True)
    with _BLUEPRINTS_LOCK:
        bp = _BLUEPRINTS.pop(key, None) or _blueprint(cfg, zero)
        _BLUEPRINTS[key] = bp  # most recently used last
        while len(_BLUEPRINTS) > _BLUEPRINTS_KEEP:
            _BLUEPRINTS.pop(next(iter(_BLUEPRINTS)))
        return bp


_BLUEPRINTS: dict[str, Blueprint] = {}
_BLUEPRINTS_KEEP = 4
_BLUEPRINTS_LOCK = threading.Lock()


def _stage_shapes(staged: StagedModel) -> list[Any]:
    """Each stage's parameters as jax.ShapeDtypeStruct, in stage order."""
    _, abstract = staged.abstract()
    return jax.eval_shape(staged.split, abstract)


def params_layout(cfg: Config) -> PageLayout:
    """The page layout of the model's parameters (the pages `params/<stage>/<k>` of a paged checkpoint), from
    shapes alone: nothing is allocated or compiled, so a checkpoint's pages can be read without building an
    engine."""
    staged = models.get(cfg.model)
    return PageLayout.build(zip([s.name for s in staged.stages], _stage_shapes(staged)), cfg.memory.page_size,
                            params_apart(staged))


def params_apart(staged: StagedModel) -> Callable[[str, str], bool] | None:
    """Which parameter leaves go on pages of their own: a mixture of experts' expert weights."""
    expert = staged.expert_leaf
    return (lambda stage, path: expert(path)) if expert else None


def opt_apart(staged: StagedModel, tx: optax.GradientTransformation, stage_params: list[Any]
              ) -> Callable[[str, str], bool] | None:
    """Which optimizer-state leaves go on pages of their own: those of the expert weights (the paged leaves are a
    list, `[i]`, in the order `paged_paths` names them)."""
    expert = staged.expert_leaf
    if not expert:
        return None
    keys = {(s.name, f"[{i}]") for s, p in zip(staged.stages, stage_params)
            for i, path in enumerate(paged_paths(tx, p)) if expert(path)}
    return lambda stage, path: (stage, path) in keys


def refuse_sharded_optimizer(cfg: Config) -> None:
    """ConfigError for an optimizer the sharded pages cannot run: one that needs each parameter's shape."""
    if cfg.optimizer.name == "adafactor":
        raise ConfigError("'optimizer.name': adafactor factors its moments by each parameter's shape, which a "
                          "rank's flat shard of it does not have: use adamw, adam, lion or sgd with pages sharded "
                          "over several devices")


def _blueprint(cfg: Config, zero: Zero | None = None) -> Blueprint:
    staged = models.get(cfg.model)
    stage_params = _stage_shapes(staged)
    tx, schedule = make_optimizer(cfg.optimizer, cfg.train.steps, clip=False)
    names = [s.name for s in staged.stages]
    if zero is not None and cfg.memory.staleness:
        raise ConfigError("'memory.staleness': lock-free updates (1) need pages on one device; with pages sharded "
                          "over several devices updates are exact (0)")
    if zero is not None:
        refuse_sharded_optimizer(cfg)

    def layout(trees: Any, apart: Callable[[str, str], bool] | None) -> Any:
        if zero is None:
            return PageLayout.build(trees, cfg.memory.page_size, apart)
        return ShardedPageLayout.build(trees, cfg.memory.page_size, zero.ranks, apart)

    params_layout = layout(zip(names, stage_params), params_apart(staged))
    opt_big, opt_small, structure = [], {}, {}
    for name, p in zip(names, stage_params):
        big, small, struct = abstract_opt_state(tx, p)
        opt_big.append(big)
        opt_small[name] = [np.zeros(s.shape, s.dtype) for s in small]
        structure[name] = struct
    opt_layout = layout(zip(names, opt_big), opt_apart(staged, tx, stage_params))
    kernel = host_optimizer(cfg.optimizer, schedule)
    fns = StageFunctions(staged, params_layout, opt_layout, structure, tx, cfg.optimizer.grad_clip, zero,
                         elementwise=is_elementwise(cfg.optimizer), kernel=kernel)
    return Blueprint(staged, params_layout, opt_layout, structure, opt_small, fns,
                     StageUpdates(fns.update, fns.update_norm), schedule)


def disk_budget(cfg: Config) -> int | None:
    """Bytes the disk tier may hold: memory.disk_budget, or else what its file system has free now (a plan that
    needs more is refused before anything is written, instead of failing on a full disk mid-step); None when the
    directory does not exist (the disk tier then says so when it opens)."""
    if cfg.memory.disk_budget:
        return cfg.memory.disk_budget
    try:
        return shutil.disk_usage(cfg.memory.disk_dir).free
    except OSError:
        return None


def make_store(cfg: Config, device: jax.Device, zero: Zero | None = None, host: int | None = None) -> PageStore:
    """`zero`: array tiers hold global pages sharded over its mesh; `host`: the host tier's budget (default
    `host_budget`). With the mesh's devices in several processes each process's disk tier is a subdirectory of
    its own in memory.disk_dir, holding its part of every disk-homed page (the store's `ProcessShards`); its budget
    counts pages whole, as the array tiers' do: memory.disk_budget (or the free space) times the ranks."""
    over = zero.mesh if zero is not None else None
    host = host_budget(cfg, device) if host is None else host
    disk = None
    if cfg.memory.disk_dir:
        budget = disk_budget(cfg)
        if zero is not None and len({d.process_index for d in zero.mesh.devices.flat}) > 1:
            disk = DiskTier(cfg.memory.disk_dir, budget=None if budget is None else budget * zero.ranks,
                            subdir=f"angel_jax_pages.process_{jax.process_index()}")
        else:
            disk = DiskTier(cfg.memory.disk_dir, budget=budget)
    return PageStore(DeviceTier(device, budget=None, over=over), HostTier(device, budget=host, over=over), disk)


def plan_for(cfg: Config, bp: Blueprint, store: PageStore, example_batch: jax.Array,
             device: jax.Device, zero: Zero | None = None) -> tuple[Plan, list[StageCost], Bandwidths, Budgets]:
    """Profile the stage functions (on one micro-batch: the shape every call has) and transfers, then plan under
    the config's budgets for `example_batch`'s rows."""
    device_sharding = store.tiers["device"].sharding
    host_sharding = store.tiers["host"].sharding
    micro_batches, size = micro_batching(cfg, example_batch.shape[0], zero)
    costs = profile_costs(bp.fns, bp.updates, bp.params_layout, bp.opt_layout, bp.opt_small,
                          jax.device_put(example_batch[:size], device_sharding),
                          placements(device, host_sharding, zero), micro_batches)
    bw = profile_transfers(bp.params_layout, device_sharding, host_sharding,
                           load_bandwidths(default_calibration_path()))
    if jax.process_count() > 1:  # every process must make the same plan: the programs they run are collectives
        costs, bw = _agreed(costs, bw)
    budgets = dataclasses.replace(budgets_for(cfg, device, example_batch.shape[0], zero),
                                  host=store.tiers["host"].budget)
    plan = make_plan(costs, bw, budgets, staleness=cfg.memory.staleness, shared_cpu=device.platform == "cpu",
                     micro_batches=micro_batches, passes=cfg.memory.passes or None, overlap=cfg.memory.overlap)
    if "disk" in plan.home + plan.grad_home + plan.opt_home and not Path(default_calibration_path()).is_file():
        # The disk figures are then guesses: the plan's placement and predicted step rest on them.
        log.warning("the plan puts pages on the disk, but this machine's disk is not calibrated (no %s): the plan "
                    "assumes %.1f GB/s each way and no CPU cost per byte. Run `angel-jax bench io` once to measure it.",
                    default_calibration_path(), bw.disk_read / 1e9)
    return plan, costs, bw, budgets


def _agreed(costs: list[StageCost], bw: Bandwidths) -> tuple[list[StageCost], Bandwidths]:
    """Process 0's profiled times and bandwidths, on every process (each process timed its own calls, with
    noise; plans made from different figures could differ, and with them the collectives each process runs)."""
    from jax.experimental import multihost_utils

    times = ("forward_s", "backward_s", "update_device_s", "update_host_s", "host_add_s")
    links = ("h2d", "d2h", "disk_read", "disk_write", "disk_read_cpu", "disk_write_cpu")
    mine = np.array([getattr(c, t) for c in costs for t in times] + [getattr(bw, k) for k in links], np.float64)
    theirs = np.asarray(multihost_utils.broadcast_one_to_all(mine))
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


def build_paged_engine(cfg: Config, params: Any, example_batch: jax.Array, *,
                       device: jax.Device | None = None, zero: Zero | None = None) -> PagedEngine:
    """The paged engine, planned for `example_batch`'s shape. `params`: the whole model's (numpy, in its
    structure), or None to initialise it stage by stage (`StagedModel.init_stage` with train.seed) straight into
    each page's home, so that the whole model never exists in memory. `zero`: every page sharded over its mesh's
    devices (ZeRO-3, schedule/zero.py); `example_batch` is then the ranks' whole batch."""
    device = device or (zero.local_device() if zero else jax.local_devices()[0])
    return_large_frees_to_the_os()  # page buffers stream through the host: freed ones must leave the process
    bp = blueprint(cfg, zero)
    staged = bp.staged
    store = make_store(cfg, device, zero, budgets_for(cfg, device, example_batch.shape[0], zero).host if zero else None)
    try:
        plan, costs, bw, budgets = plan_for(cfg, bp, store, example_batch, device, zero)
    except BaseException:
        store.close()
        raise
    # Pages are what the tier holds; the fixed part (activations, working set) is outside it.
    store.tiers["device"].budget = budgets.device - plan.fixed_device
    model = PagedModel(staged, bp.params_layout, bp.opt_layout, opt_offset=bp.params_layout.num_pages,
                       grad_sets=1 + plan.staleness)
    tx, _ = make_optimizer(cfg.optimizer, cfg.train.steps, clip=False)
    where = placements(device, store.tiers["host"].sharding, zero)
    whole = staged.split(params) if params is not None else None
    slots, small = [], []
    cpu = jax.local_devices(backend="cpu")[0]
    try:
        for i, stage in enumerate(staged.stages):
            update_at = "device" if plan.home[i] == "device" else "host"
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
            small.append([jax.device_put(np.asarray(s), where[update_at].scalar) for s in small_leaves])
            slots.append(StageSlot(stage.name, stage.kind, model.param_ids(i), model.opt_ids(i), update_at,
                                   plan.opt_home[i], param_home=plan.home[i], grad_home=plan.grad_home[i],
                                   grad_ids=model.grad_ids(i) if plan.grad_home[i] == "disk" else ()))
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
                          inline=zero is not None or not cfg.memory.overlap)
    executor = PagedExecutor(model, bp.fns, plan, store, updater,
                             micro_batch_size=micro_batching(cfg, example_batch.shape[0], zero)[1],
                             host_compute=where["host"].compute, overlap=cfg.memory.overlap)
    log.info("paged engine: %d stages, %d resident, prefetch %d, predicted step %.3f s",
             len(staged.stages), len(plan.resident), plan.prefetch, plan.predicted.step_time)
    return PagedEngine(executor, plan, costs, bw, budgets, model, store, updater)
