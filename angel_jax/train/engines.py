"""Train engines: the one interface the training loop drives, and its in-memory implementation.

    engine = build_engine(cfg, mesh)                  # in_memory or paged, by memory.mode
    metrics = engine.step(batch)                      # device scalars: loss, grad_norm, update_norm, lr
    loss = engine.eval_loss(batch)                    # forward only, the training state unchanged
    snapshot, meta = engine.state_snapshot(), engine.state_meta()   # what a checkpoint holds
    engine.load_state(snapshot.arrays, meta)          # back to that step, bit for bit

Two implementations, no `if paged` branches in the loop:
- `InMemoryEngine` (here): the reference trainer. The whole train state is a pytree of jax arrays, replicated on
  every device or sharded over the mesh's 'fsdp' axis (`mesh.fsdp`, ZeRO-3; train/sharding.py), one jitted step
  over every device (with `train.micro_batch_size`, a scan over the micro-batches inside it: gradient
  accumulation).
- `PagedTrainEngine` (`angel_jax/train/paged.py`): model state in pages across device, host and disk
  under a plan (Angel-PTM).

`memory.mode: auto` picks in-memory when the whole training state fits the device budget (see `fits_in_memory`).
"""

from __future__ import annotations

import functools
import logging
import threading
from typing import Any, Callable, Mapping

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P

from angel_jax.checkpoint.state import StateSnapshot
from angel_jax.config import Config, ConfigError
from angel_jax.errors import AngelError
from angel_jax.optim import split_optimizer, state_buffers
from angel_jax.memory.shards import from_pieces, local_pieces
from angel_jax.schedule.budgets import device_free_bytes, in_memory_budget, reachable_bytes
from angel_jax.train.paged import PagedTrainEngine
from angel_jax.train.protocol import StateMismatch, TrainEngine, check_arrays, named_leaves, path_name  # noqa: F401
from angel_jax.train.sharding import FSDP, batch_sharding, device_bytes, fsdp_size, state_shardings, whole
from angel_jax.train.state_formats import piece_name
from angel_jax.train.step import StepControls, TrainState, init_state, make_micro_loss_fn, make_step_phases
from angel_jax.units import human_bytes
import models
from models.parallel import experts_over

log = logging.getLogger(__name__)


# --------------------------------------------------------------------------------------------- in-memory


class InMemoryEngine:
    """The reference trainer: parameters and optimizer state replicated, or sharded over the mesh's 'fsdp' axis
    (ZeRO-3: each leaf's largest divisible dimension, train/sharding.py; XLA inserts the parameters' all-gathers
    and the gradients' reductions), the batch's rows over every device.

    A step is two jitted phases (train/step.py `make_step_phases`): `judge` (forward, backward, clipped gradients,
    the guard's figures and verdict; reads the state) and `apply` (the update, written over the donated state).
    Nothing holds a second copy of the state: the memory is an unguarded step's (parameters, optimizer state, one
    set of gradients, activations). While a checkpoint holds the state of a step (a held `state_snapshot`, until
    it is released), the next steps run an `apply` that does not donate the state instead, so the held arrays stay
    valid while the checkpoint copies them in the background. That variant is compiled in a background thread once
    the first step is running, so it is ready by the first checkpoint.
    """

    name = "in_memory"
    guards_update_norm = True
    """The update norm is known on the device before the update is applied (`judge`): guarding it costs one more
    pass over the optimizer state, no host round trip."""

    def __init__(self, cfg: Config, mesh: jax.sharding.Mesh):
        self.cfg, self.mesh = cfg, mesh
        self.replicated = NamedSharding(mesh, P())
        self.batch_sharding = batch_sharding(mesh)
        opt = split_optimizer(cfg.optimizer, cfg.train.steps)
        model = models.get(cfg.model, documents=cfg.data.packed)  # rows of packed documents kept apart
        graphdef, abstract = model.abstract()
        self.shardings: TrainState = state_shardings(jax.eval_shape(lambda p: init_state(p, opt.tx), abstract), mesh,
                                                     model.expert_leaf)
        # Created directly with their final shardings: no host copy of the initial parameters, no device holding
        # more than its shard. The parameters first, then the optimizer state from them: one jitted function
        # making both would hold the parameter initialisers' temporaries next to the whole optimizer state.
        if model.init_reads_files:  # read from a checkpoint on the host (inside jit they would be constants)
            params = jax.tree.map(lambda a, s: _place(np.asarray(a), s), model.init(cfg.train.seed)[1],
                                  self.shardings.params)
        else:
            params = jax.jit(lambda: model.init(cfg.train.seed)[1], out_shardings=self.shardings.params)()
        self.state: TrainState = jax.jit(lambda p: init_state(p, opt.tx), out_shardings=self.shardings,
                                         donate_argnums=0)(params)
        del params
        # Gradient accumulation (train.micro_batch_size): micro-batches of the batch one after another inside judge.
        # Per-rank float32 sums laid out over the devices (every device is a rank: its rows of the batch): the
        # gradients are reduced over the ranks once per step.
        micro_batches = cfg.train.micro_batches(mesh.devices.size)
        by_rank = self.batch_sharding
        phases = make_step_phases(graphdef, opt, model.loss, micro_batches, mesh.devices.size,
                                  lambda tree: jax.lax.with_sharding_constraint(tree, by_rank), model.figures)
        # The clipped gradients come out laid out like the parameters, the new state like the old one.
        traced = _experts_split(mesh) if model.expert_leaf and fsdp_size(mesh) > 1 else (lambda fn: fn)
        self._judge = jax.jit(traced(phases.judge),
                              out_shardings=(self.shardings.params, self.replicated, self.replicated))
        self._apply_fn = phases.apply
        self._apply = jax.jit(phases.apply, out_shardings=self.shardings, donate_argnums=0)
        self._keeping: list[StateSnapshot] = []  # held snapshots not yet released: no donation while any is
        # A state sharded across processes is snapshotted into host memory (state_snapshot): never held.
        self._holdable = all(a.is_fully_addressable or a.sharding.is_fully_replicated
                             for a in jax.tree.leaves(self.state))
        self._keep_apply: Any = None  # the apply that does not donate the state, compiled ahead
        self._keep_compile: threading.Thread | None = None
        # Reads the parameters and donates nothing: the state a held snapshot keeps stays valid. By micro-batches
        # as a step: the activations a step holds are those of one micro-batch.
        self._eval = jax.jit(traced(make_micro_loss_fn(graphdef, model.loss, micro_batches)),
                             out_shardings=self.replicated)

    def step(self, batch: jax.Array, controls: StepControls | None = None) -> dict[str, jax.Array]:
        # numpy scalars: jit treats host values as replicated inputs, in multi-process runs too.
        controls = (controls or StepControls()).as_numpy()
        if self._keep_compile is None and self._holdable:
            self._compile_keep_variant(controls)
        self._keeping = [s for s in self._keeping if not s.released]
        apply = self._keep_apply if self._keeping else self._apply
        clipped, ok, metrics = self._judge(self.state, batch, controls)
        self.state = apply(self.state, clipped, ok, controls)
        return metrics

    def eval_loss(self, batch: jax.Array) -> jax.Array:
        return self._eval(self.state.params, batch)

    def _compile_keep_variant(self, controls: StepControls) -> None:
        def abstract(tree: Any) -> Any:
            return jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=getattr(a, "sharding", None)),
                                tree)

        # The clipped gradients have the parameters' shapes, dtypes and shardings.
        args = (abstract(self.state), abstract(self.state.params),
                jax.ShapeDtypeStruct((), jnp.bool_, sharding=self.replicated), abstract(controls))

        def compile_it() -> None:
            try:  # donates the gradients only: the new state may take their buffer, the held one stays valid
                self._keep_apply = jax.jit(self._apply_fn, out_shardings=self.shardings,
                                           donate_argnums=1).lower(*args).compile()
            except Exception as e:  # noqa: BLE001 - without it, checkpoints copy before returning: slower, correct
                log.warning("could not compile the non-donating step (checkpoints will copy in the foreground): "
                            "%s", e)

        self._keep_compile = threading.Thread(target=compile_it, name="compile-keep-step", daemon=True)
        self._keep_compile.start()

    @property
    def checkpoints_per_process(self) -> bool:
        """Leaves sharded across processes (mesh.fsdp over several processes): each process checkpoints its own
        pieces of every leaf. A state replicated on every process is written whole, by process 0."""
        return jax.process_count() > 1 and not self._holdable

    def state_snapshot(self, may_hold: bool = True) -> StateSnapshot:
        # Leaves sharded across processes: this process's distinct pieces of each, `<leaf>#<k>`, in the order
        # `state_meta` lists their indices (every process takes a snapshot at a checkpoint and writes its own:
        # the loop's `_save`); never held. Otherwise every leaf whole (a replicated leaf's local shard is all of it).
        if self.checkpoints_per_process:
            return StateSnapshot({piece_name(name, k): piece for name, a in named_leaves(self.state).items()
                                  for k, (_, piece) in enumerate(local_pieces(a))})
        arrays = {name: whole(a) for name, a in named_leaves(self.state).items()}
        if not (may_hold and self._holdable and self._can_hold()):
            return StateSnapshot(arrays)
        snapshot = StateSnapshot(arrays, held=True)
        self._keeping.append(snapshot)
        return snapshot

    def _can_hold(self) -> bool:
        """Whether the state can stay alive until a checkpoint has copied it: the non-donating step compiled, and
        room on the device for a second copy of the state for a step or two."""
        if self._keep_compile is not None:
            self._keep_compile.join()  # long done on real runs (compiled since step 1); tiny test runs may wait
        if self._keep_apply is None:  # could not compile: the checkpoint copies in the foreground
            return False
        # This process's first device (another process's device has no memory statistics here), and what the
        # state takes on it.
        local, held = next(iter(device_bytes(self.state).items()))
        return device_free_bytes(local) >= 1.25 * held

    def state_meta(self) -> dict[str, Any]:
        if not self.checkpoints_per_process:
            return {"engine": self.name}
        pieces = {name: {"shape": list(a.shape), "index": [[list(d) for d in index] for index, _ in local_pieces(a)]}
                  for name, a in named_leaves(self.state).items()}
        return {"engine": self.name, "pieces": pieces,
                "process": {"index": jax.process_index(), "count": jax.process_count()}}

    def load_state(self, arrays: Mapping[str, np.ndarray], meta: Mapping[str, Any]) -> None:
        if meta.get("engine", self.name) != self.name:
            raise StateMismatch(f"the checkpoint was written by the {meta.get('engine')!r} engine, this run uses "
                                f"{self.name!r} (memory.mode); resume with the same memory.mode")
        if "pieces" in meta:
            self._load_pieces(arrays, meta)
            return
        current = named_leaves(self.state)
        check_arrays({k: (v.shape, v.dtype) for k, v in current.items()}, arrays, "in-memory engine")
        paths, treedef = jax.tree_util.tree_flatten_with_path(self.state)
        shardings = jax.tree.leaves(self.shardings)
        leaves = [_place(np.asarray(arrays[path_name(p)]), s) for (p, _), s in zip(paths, shardings)]
        self.state = jax.tree_util.tree_unflatten(treedef, leaves)

    def _load_pieces(self, arrays: Mapping[str, np.ndarray], meta: Mapping[str, Any]) -> None:
        """This process's pieces of every leaf (a checkpoint written per process) onto its own devices; refused
        unless they are exactly the pieces this process holds: another set of processes resumes every process's
        pieces assembled into whole leaves (`TrainCheckpointer.restore_latest`)."""
        theirs = meta.get("process") or {}
        if not self.checkpoints_per_process or theirs.get("count") != jax.process_count():
            raise StateMismatch(f"in-memory engine: the checkpoint holds process {theirs.get('index')}'s pieces of a "
                                f"state sharded over {theirs.get('count')} processes; this run has "
                                f"{jax.process_count()} process(es) and "
                                f"{'shards' if self.checkpoints_per_process else 'does not shard'} the state across "
                                "them: only every process's pieces together make the state (resume through the "
                                "trainer, which assembles them)")
        mine = self.state_meta()["pieces"]
        if meta["pieces"] != mine:
            differ = next((k for k in sorted(set(mine) | set(meta["pieces"])) if mine.get(k) != meta["pieces"].get(k)),
                          None)
            raise StateMismatch(f"in-memory engine: the checkpoint's pieces of {differ!r} are "
                                f"{meta['pieces'].get(differ)}, this process holds {mine.get(differ)} (another model, "
                                "mesh or device order?)")
        current = named_leaves(self.state)
        check_arrays({piece_name(name, k): (tuple(b - a for a, b in index), current[name].dtype)
                      for name, info in mine.items() for k, index in enumerate(info["index"])},
                     arrays, "in-memory engine")
        paths, treedef = jax.tree_util.tree_flatten_with_path(self.state)
        leaves = []
        for (path, leaf), sharding in zip(paths, jax.tree.leaves(self.shardings)):
            name = path_name(path)
            pieces = {tuple(tuple(d) for d in index): np.asarray(arrays[piece_name(name, k)])
                      for k, index in enumerate(mine[name]["index"])}
            leaves.append(from_pieces(leaf.shape, sharding, pieces))
        self.state = jax.tree_util.tree_unflatten(treedef, leaves)

    def params(self) -> Any:
        return jax.tree.map(lambda a: np.asarray(whole(a)), self.state.params)

    def memory_report(self) -> list[str]:
        fsdp = fsdp_size(self.mesh)
        where = "replicated on every device" if fsdp == 1 else f"sharded over {fsdp} devices (mesh.fsdp)"
        here = max(device_bytes(self.state).values())
        return [f"  placement          in memory: parameters and optimizer state {where}, "
                f"{human_bytes(here)} on each device"]

    def close(self) -> None:
        if self._keep_compile is not None:
            self._keep_compile.join()


def _experts_split(mesh: jax.sharding.Mesh) -> Callable[[Callable], Callable]:
    """A model function traced with its MoE layers' experts split over the mesh's 'fsdp' axis (expert parallelism:
    models/parallel.py), as `state_shardings` lays the expert weights out."""
    def wrap(fn: Callable) -> Callable:
        @functools.wraps(fn)
        def traced(*args: Any) -> Any:
            with experts_over(FSDP, mesh):
                return fn(*args)

        return traced

    return wrap


def _place(host: np.ndarray, sharding: NamedSharding) -> jax.Array:
    return jax.make_array_from_callback(host.shape, sharding, lambda index: host[index])


# --------------------------------------------------------------------------------------------- choosing


def state_bytes(cfg: Config, fsdp: int = 1) -> int:
    """Bytes of the training state the in-memory engine keeps on each device: parameters and the optimizer's
    per-parameter state (2 buffers for Adam-like optimizers, 1 for SGD with momentum / Lion, each of
    optimizer.state_dtype), 1/`fsdp` of them when sharded over that many devices (mesh.fsdp), and one set of
    gradients, whole (a step builds them in full before reducing them); with optimizer.master_weights, the
    float32 master copy too."""
    n = models.param_count(cfg.model)["total"]
    itemsize = jnp.dtype(cfg.model.param_dtype).itemsize
    per_param = state_buffers(cfg.optimizer)
    master = 4 if cfg.optimizer.master_weights else 0  # a float32 copy of the parameters
    return n * itemsize + n * (itemsize + jnp.dtype(cfg.optimizer.state_dtype).itemsize * per_param + master) // fsdp


def fits_in_memory(cfg: Config, device: jax.Device, fsdp: int = 1) -> bool:
    budget = in_memory_budget(cfg, device)
    # Activations need room too: keep a quarter of the budget for them (a conservative rule of thumb; the paged
    # engine uses every byte it is given, so erring towards it costs little).
    return state_bytes(cfg, fsdp) <= 0.75 * budget


def refuse_what_cannot_fit(cfg: Config, device: jax.Device, fsdp: int = 1) -> None:
    """ConfigError, before anything is allocated, when the in-memory engine's state alone (activations aside) is
    larger than the device has free: allocating it would end in an out-of-memory traceback mid-build."""
    need, free = state_bytes(cfg, fsdp), device_free_bytes(device)
    if need > free:
        where = "of host RAM it may use" if device.platform == "cpu" else f"free on the {device.device_kind}"
        n = models.param_count(cfg.model)["total"]
        raise ConfigError(f"memory.mode=in_memory: the training state needs {human_bytes(need)} on each device "
                          f"(parameters, gradients and optimizer state of {n:,} parameters), more than the "
                          f"{human_bytes(free)} {where}: set memory.mode=paged (or auto) to page it across device, "
                          "host and disk, or shrink the model")


def refuse_beyond_reach(cfg: Config) -> None:
    """ConfigError, before anything is built or allocated (computed from the config: models.param_count), when the
    training state is larger than every tier this host could put it in together: a model too deep, too wide, of too
    large a vocabulary or too many experts fails in one line, naming the bytes it needs, instead of building
    a billion stages first. The state is split over the run's processes, each holding its share."""
    need = state_bytes(cfg) // jax.process_count()
    room = reachable_bytes(cfg)
    if need > sum(room.values()):
        m = cfg.model
        n = models.param_count(m)["total"]
        tiers = ", ".join(f"{human_bytes(v)} {k}" for k, v in room.items() if v or k != "disk")
        raise ConfigError(f"the model (model.name={m.name}: d_model={m.d_model}, n_layers={m.n_layers}"
                          + (f", n_decoder_layers={m.n_decoder_layers}" if m.n_decoder_layers else "")
                          + f", vocab_size={m.vocab_size}, moe.experts={m.moe.experts}) has {n:,} parameters; "
                          f"their training state needs {human_bytes(need)} on this host, more than all it has "
                          f"({tiers}) in any memory.mode: shrink the model, spread it over more hosts, or give it "
                          f"a disk tier with room for {human_bytes(need - room['device'] - room['host RAM'])} "
                          "(memory.disk_dir on a larger disk, memory.disk_budget)")


def build_engine(cfg: Config, mesh: jax.sharding.Mesh) -> TrainEngine:
    """The engine `memory.mode` asks for (auto: in-memory when the state fits the device budget)."""
    mode = cfg.memory.mode
    # This process's first device: another process's cannot be asked what it has free.
    here = next(d for d in mesh.devices.flat if d.process_index == jax.process_index())
    if mode == "auto":
        mode = "in_memory" if fits_in_memory(cfg, here, fsdp_size(mesh)) else "paged"
        log.info("memory.mode=auto: the training state (%.2f GB per device) %s -> %s engine",
                 state_bytes(cfg, fsdp_size(mesh)) / 1e9,
                 "fits the device" if mode == "in_memory" else "does not fit the device", mode)
    if mode == "in_memory":
        refuse_what_cannot_fit(cfg, here, fsdp_size(mesh))
        return InMemoryEngine(cfg, mesh)
    if mesh.devices.size > 1 and mesh.devices.size not in (fsdp_size(mesh), dict(mesh.shape).get("data", 1)):
        raise AngelError(f"memory.mode={cfg.memory.mode!r} chose the paged engine, which shards every page over all "
                         f"{mesh.devices.size} devices (ZeRO-3); the mesh splits them {dict(mesh.shape)}: set "
                         "mesh.fsdp=0 (all devices)")
    return PagedTrainEngine(cfg, mesh)
