"""Budgets, decided in one place: how many bytes each tier may hold and how a batch splits into micro-batches.

The only reader of `memory.device_budget`, `memory.host_budget` and `memory.disk_budget` and of what the machine has
free (device memory, RAM, disk space). The paged engine, `angel-jax plan` and the in-memory engine's fit test ask
here; nothing patches a budget afterwards.

    sizes = blueprint(cfg, zero).sizes                  # the model's bytes, from shapes (schedule/blueprint.py)
    decision = decide(cfg, device, local_batch, sizes)  # once per engine: everything below, together
    decision.cfg                                        # train.micro_batch_size chosen where it was 0
    decision.budgets                                    # Budgets(device, host, disk, fixed_device, saved_device)
    decision.micro_batches, decision.rows               # micro-batches per step, rows per micro-batch

Budgets set in the config win. A 0 (unset) budget is the machine's: the device's free memory, the RAM available
less a margin, the disk tier's free space. On the CPU backend the "device" and the host are the same RAM, so what
one takes the other loses (`cpu_split`).

What the budgets need to know of the model comes in as `ModelBytes` (its stages' bytes and parameter layout, from
shapes alone): this module builds no layout and compiles nothing, so the engine's set-up runs one way, blueprint
-> budgets -> runtime.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
import logging
import shutil
from pathlib import Path

import jax
import jax.numpy as jnp
import psutil

from angel_jax import config as config_lib
from angel_jax.config import Config, ConfigError
from angel_jax.memory import block_cache, pinned
from angel_jax.memory.layout import StageLayout
from angel_jax.multihost import every_process_lists, processes_on_this_host
from angel_jax.schedule.plan import (Bandwidths, Budgets, ModelBytes, PlanError, make_plan, min_host_bytes,
                                     minimum_device_bytes)
from angel_jax.schedule.zero import Zero
from angel_jax.units import device_memory_stats
import models
from models.stages import StagedModel

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Decision:
    """What the paged engine is built under, decided once: the config it runs (train.micro_batch_size chosen), the
    tiers' budgets, and how a step's batch splits."""

    cfg: Config
    budgets: Budgets
    micro_batches: int
    """Micro-batches per step."""
    rows: int
    """Rows per micro-batch."""


def decide(cfg: Config, device: jax.Device, local_batch: int, sizes: ModelBytes, zero: Zero | None = None, *,
           fit: bool = True) -> Decision:
    """The paged engine's budgets and micro-batching for a local batch of `local_batch` rows (with `zero`: the
    ranks' whole batch). With `fit` and one device, train.micro_batch_size 0 is chosen (`fit_micro_batch`) and a
    model the budgets cannot hold is refused from shapes alone (`check_host_room`), before anything is allocated
    or profiled."""
    if fit and zero is None:
        cfg = fit_micro_batch(cfg, device, sizes)
        check_host_room(cfg, device, sizes)
    micro_batches, rows = micro_batching(cfg, local_batch, zero)
    return Decision(cfg, budgets_for(cfg, device, local_batch, sizes, zero), micro_batches, rows)


def device_free_bytes(device: jax.Device) -> int:
    """What the device has free (GPU: bytes_limit - bytes_in_use; CPU: 80% of available host RAM)."""
    stats = device_memory_stats(device)
    if "bytes_limit" in stats:
        return int(stats["bytes_limit"] - stats.get("bytes_in_use", 0))
    return int(psutil.virtual_memory().available * 0.8)


def in_memory_budget(cfg: Config, device: jax.Device) -> int:
    """Device bytes the in-memory engine's state may take: memory.device_budget, or what the device has free."""
    return cfg.memory.device_budget or device_free_bytes(device)


def gather_room() -> int:
    """Host bytes a whole copy of something large (the final parameters gathered from the engine) may take: half
    the RAM available now, the other half left to the process and the machine."""
    return int(psutil.virtual_memory().available) // 2


def params_room(cfg: Config, planned_host: int) -> int:
    """Host bytes a paged engine's whole copy of the parameters may take at the end of a run whose plan peaks at
    `planned_host` host bytes: with memory.host_budget set, what the plan leaves of it (the budget is the user's
    word on this process's host memory, and a copy past it is what a memory cap kills: a 2.4 B GPT's 9.7 GB on
    top of a 4 GiB plan); else `gather_room`."""
    if cfg.memory.host_budget:
        return max(0, cfg.memory.host_budget - planned_host)
    return gather_room()


def stated_budgets(cfg: Config, device: jax.Device, local_batch: int, sizes: ModelBytes,
                   target_device: int | None = None) -> Budgets:
    """The budgets of a plan for another machine (`angel-jax plan --estimate`): the ones the config sets; where it
    sets no device budget, the target's device memory (`target_device`, from its calibration) or else this
    device's; no limit on the host or the disk (this machine's RAM and disk say nothing about the target's)."""
    device_bytes = cfg.memory.device_budget or target_device or device_budget(cfg, device, sizes)
    return Budgets(device=device_bytes, host=cfg.memory.host_budget or None,
                   disk=(cfg.memory.disk_budget or None) if cfg.memory.disk_dir else 0,
                   fixed_device=fixed_device_bytes(cfg, local_batch, sizes),
                   saved_device=saved_input_bytes(cfg, local_batch))


def device_budget(cfg: Config, device: jax.Device, sizes: ModelBytes) -> int:
    """memory.device_budget, or what the device has free (80% of available host RAM for the CPU backend, or
    `cpu_split`'s share)."""
    if cfg.memory.device_budget:
        return cfg.memory.device_budget
    split = cpu_split(cfg, device, sizes)
    return split[0] if split else device_free_bytes(device)


HOST_MARGIN = 2 << 30
"""Host memory left to everything else (the process's own arrays, the machine) when memory.host_budget is 0:
at least this, or a tenth of the machine's RAM when that is more."""
HOST_WINDOW_SLACK = 1.1
"""`cpu_split` gives the host tier its window's bytes times this."""


def _host_room() -> int:
    vm = psutil.virtual_memory()  # (and the freed blocks this process may keep: angel_jax/memory/block_cache.py)
    return int(vm.available) - max(HOST_MARGIN, int(vm.total) // 10) - block_cache.kept_at_most()


def host_budget(cfg: Config, device: jax.Device | None = None, sizes: ModelBytes | None = None) -> int:
    """memory.host_budget, or what this machine can give the host tier now: available RAM less a margin
    (`HOST_MARGIN`), so that a plan larger than the machine is refused instead of meeting the OOM killer. On the
    CPU backend (`device` a CPU, with the model's `sizes`) the "device" is that same RAM: the device budget is
    taken out of it too."""
    if cfg.memory.host_budget:
        return cfg.memory.host_budget
    room = _host_room()
    if device is not None and device.platform == "cpu":
        assert sizes is not None, "the CPU backend's host budget depends on the model: give its sizes"
        split = cpu_split(cfg, device, sizes)
        if split:
            return split[1]
        room -= device_budget(cfg, device, sizes)
    return max(0, room)


_splits: dict[str, tuple[int, int]] = {}


def cpu_split(cfg: Config, device: jax.Device | None, sizes: ModelBytes) -> tuple[int, int] | None:
    """(device, host) budgets on the CPU backend when neither is set and a disk tier is: the two tiers are one RAM
    there, and a stage kept on the "device" needs no copies at all, so the host tier gets only what its window
    needs with every streamed page on disk (`min_host_bytes`, times HOST_WINDOW_SLACK) and the device the rest of
    the room. A fixed share (the device 80% of the available RAM, the host the rest less the margin: ~2 GiB on a
    24 GiB machine) refused a 3 B GPT whose window needs 2.4 GiB. None elsewhere (the budgets' own rules)."""
    if (device is None or device.platform != "cpu" or cfg.memory.device_budget or cfg.memory.host_budget
            or not cfg.memory.disk_dir):
        return None
    key = config_lib.dump_yaml(cfg)  # (once per config: the RAM available moves as the engine allocates)
    if key not in _splits:
        room = max(0, _host_room())
        host = min(room, int(HOST_WINDOW_SLACK * min_host_bytes(sizes.stages, cfg.memory.staleness)))
        _splits[key] = (room - host, host)
    return _splits[key]


def check_host_room(cfg: Config, device: jax.Device, sizes: ModelBytes) -> None:
    """Refuse, from shapes alone and before anything large is allocated or profiled, a model the budgets cannot
    hold: the plan is made on the page layouts' bytes (with no compute times), so the refusal is the one the
    profiled plan would give, naming the bytes missing and the key to raise."""
    make_plan(sizes.stages, Bandwidths(), budgets_for(cfg, device, cfg.train.batch_size, sizes),
              shared_cpu=device.platform == "cpu", micro_batches=micro_batching(cfg, cfg.train.batch_size)[0],
              **plan_settings(cfg))


def plan_settings(cfg: Config) -> dict:
    """The memory.* keys a run's plans are made with (`make_plan`'s keyword arguments), the same for every plan
    of it: the refusal from shapes, the host tier's need, the profiled plan and an estimate."""
    m = cfg.memory
    return {"staleness": m.staleness, "passes": m.passes or None, "overlap": m.overlap,
            "streamed_updates": m.streamed_updates, "activations": m.activations}


def fit_micro_batch(cfg: Config, device: jax.Device, sizes: ModelBytes) -> Config:
    """`cfg` with train.micro_batch_size chosen where it is 0: the whole batch when some plan holds its working
    set on the device, else the largest of its halvings that one does (the fewest stage calls), judged from shapes
    alone as `check_host_room` judges. A set size, or a batch no halving fits, is left as it is (the plan then says
    what is missing)."""
    if cfg.train.micro_batch_size:
        return cfg
    size = cfg.train.batch_size
    while True:
        trial = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, micro_batch_size=size))
        budgets = budgets_for(trial, device, cfg.train.batch_size, sizes)
        most_passes = cfg.memory.passes or cfg.train.batch_size // size
        if minimum_device_bytes(sizes.stages, budgets, most_passes) <= budgets.device:
            return cfg if size == cfg.train.batch_size else trial
        if size % 2:
            return cfg
        size //= 2


def budgets_for(cfg: Config, device: jax.Device, local_batch: int, sizes: ModelBytes,
                zero: Zero | None = None) -> Budgets:
    """The plan's budgets. With `zero` (ZeRO-3 over N ranks) the plan is made for the ranks together, as one
    device N times a rank's: the memory.*_budget keys are per rank and count N times, pages are counted whole (N
    times a rank's shard), and the activations are those of the whole batch plus, per rank, the whole parameters
    and gradients of the largest stage while it computes (gathered, not yet reduce-scattered). Budgets taken from
    the machine (0) are the machine's: the device's own memory per rank; of the host's RAM, each rank its host's
    share (`host_share`)."""
    if zero is None:
        return Budgets(device=device_budget(cfg, device, sizes),
                       host=pinned_cap(host_budget(cfg, device, sizes), device),
                       disk=disk_budget(cfg) if cfg.memory.disk_dir else 0,
                       fixed_device=fixed_device_bytes(cfg, local_batch, sizes),
                       saved_device=saved_input_bytes(cfg, local_batch))
    n = zero.ranks
    shared = device.platform == "cpu"  # the CPU backend's devices are one RAM: its free bytes count once
    dev = cfg.memory.device_budget * n if cfg.memory.device_budget else device_free_bytes(device) * (1 if shared else n)
    host = cfg.memory.host_budget * n if cfg.memory.host_budget else n * host_share(cfg) - (dev if shared else 0)
    disk = (cfg.memory.disk_budget * n if cfg.memory.disk_budget else disk_budget(cfg)) if cfg.memory.disk_dir else 0
    gathered = n * 2 * max(gathered_bytes(s, n) for s in sizes.params.stages)  # each rank holds its own
    return Budgets(device=dev, host=pinned_cap(max(0, host), device, jax.process_count()), disk=disk,
                   fixed_device=fixed_device_bytes(cfg, local_batch, sizes) + gathered,
                   saved_device=saved_input_bytes(cfg, local_batch))


_shares: dict[str, int] = {}


def host_share(cfg: Config) -> int:
    """Host bytes each rank may use when memory.host_budget is 0: this machine's room (`host_budget`) split
    between the ranks it runs (its local devices in each of its processes, `processes_on_this_host`); with
    several processes, the smallest share of any (one plan is made for every rank: all must hold it). Decided
    once per config (a collective then: every process asks in the same order)."""
    key = config_lib.dump_yaml(cfg)
    if key not in _shares:
        ranks_here = jax.local_device_count() * processes_on_this_host()
        mine = max(0, host_budget(cfg, None)) // ranks_here
        # (in MiB: the processes' ints cross as int32)
        _shares[key] = mine if jax.process_count() == 1 else \
            min(row[0] for row in every_process_lists([mine >> 20])) << 20
    return _shares[key]


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


def pinned_host_need(cfg: Config, sizes: ModelBytes, device_bytes: int, processes: int = 1) -> int | None:
    """The host tier's peak in a plan made from shapes alone (no device or GPU client needed) for a device with
    `device_bytes` free, one of `processes`: the pinned host memory the paged engine will hold; None when no plan
    fits (the engine's own refusal then says why)."""
    local = max(1, cfg.train.batch_size // processes)
    try:
        budgets = Budgets(device=cfg.memory.device_budget or device_bytes, host=host_budget(cfg, None),
                          disk=(disk_budget(cfg) or 0) if cfg.memory.disk_dir else 0,
                          fixed_device=fixed_device_bytes(cfg, local, sizes),
                          saved_device=saved_input_bytes(cfg, local))
        plan = make_plan(sizes.stages, Bandwidths(), budgets, micro_batches=micro_batching(cfg, local)[0],
                         **plan_settings(cfg))
    except (PlanError, ConfigError):
        return None
    return plan.peak_bytes["host"]


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


def local_batch(cfg: Config, ranks: int) -> int:
    """Rows of the global batch (train.batch_size) each of `ranks` data-parallel ranks computes."""
    if cfg.train.batch_size % ranks:
        raise ConfigError(f"'train.batch_size'={cfg.train.batch_size} does not split over {ranks} data-parallel "
                          f"ranks (--devices): make it a multiple of {ranks}")
    return cfg.train.batch_size // ranks


def micro_sizes(cfg: Config, ranks: int = 1) -> list[int]:
    """The micro-batch sizes a plan is estimated for: train.micro_batch_size, or with 0 (the planner chooses)
    the local batch (of one of `ranks` ranks) and its exact halvings, largest first."""
    if cfg.train.micro_batch_size:
        return [cfg.train.micro_batch_size]
    sizes = [local_batch(cfg, ranks)]
    while sizes[-1] % 2 == 0:
        sizes.append(sizes[-1] // 2)
    return sizes


def saved_input_bytes(cfg: Config, local_batch: int) -> int:
    """Device bytes of every stage's saved input for the whole local batch (a plan of P accumulation passes holds
    1/P of them): the family's `saved_input_values` per row, or a chain of d_model-wide activations."""
    m = cfg.model
    per_row = models.get(m).hints.saved_input_values or (m.n_layers + 1) * m.seq_len * m.d_model
    return local_batch * per_row * jnp.dtype(m.compute_dtype).itemsize


def fixed_device_bytes(cfg: Config, local_batch: int, sizes: ModelBytes) -> int:
    """Device bytes every step needs whatever the placement: the saved input of every stage (for the whole local
    batch: every micro-batch's), the working set of the largest stage call (logits and their gradient for the
    head; attention and MLP intermediates for a block) for one micro-batch, estimated from shapes (the block's
    intermediates are the family's, `PlannerHints.block_activation_width`), and with several micro-batches the
    float32 gradient sums of the largest stage."""
    m = cfg.model
    micro_batches, size = micro_batching(cfg, local_batch)
    itemsize = jnp.dtype(m.compute_dtype).itemsize
    tokens, call_tokens = local_batch * m.seq_len, size * m.seq_len
    saved = saved_input_bytes(cfg, local_batch)
    head = 3 * call_tokens * m.vocab_size * 4
    width = models.get(m).hints.block_activation_width
    assert width > 0, f"model family {m.name!r} does not state its block_activation_width"
    block = call_tokens * width * itemsize * 2 + size * m.n_heads * m.seq_len * m.seq_len * 4
    sums = 0
    if micro_batches > 1:
        sums = max(sum(p.length for p in s.pages) for s in sizes.params.stages) * 4
    return saved + max(head, block) + tokens * 8 + sums + lent_bytes(models.get(m), sizes)


def lent_bytes(staged: StagedModel, sizes: ModelBytes) -> int:
    """Device bytes of borrowed parameters (`StagedModel.borrows`, a tied head) whatever the placement: a
    lender's parameter pages fetched for its borrower's call (counted as if the lender streamed), and the
    borrower's gradient of them (float32 at most), which waits on the device for the lender's backward."""
    total = 0
    for lender in set(staged.borrows.values()):
        pages = sizes.params.stages[lender].pages
        total += sum(p.nbytes for p in pages) + sum(p.length for p in pages) * 4
    return total


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


def reachable_bytes(cfg: Config) -> dict[str, int]:
    """The most memory of each tier a run on this host could put its training state in, whatever memory.mode: every
    local device's free bytes, all of the host's RAM, and the disk tier's budget or free space (none without one)."""
    devices = sum(device_free_bytes(d) for d in jax.local_devices())
    disk = 0
    if cfg.memory.disk_dir:
        where = Path(cfg.memory.disk_dir).absolute()
        while not where.exists() and where != where.parent:  # the tier's directory may not be made yet
            where = where.parent
        disk = cfg.memory.disk_budget or shutil.disk_usage(where).free
    return {"device": devices, "host RAM": int(psutil.virtual_memory().total), "disk": disk}
