"""Train engines: the one interface the training loop drives, and its in-memory implementation.

    engine = build_engine(cfg, mesh)                  # in_memory or paged, by memory.mode
    metrics = engine.step(batch)                      # device scalars: loss, grad_norm, update_norm, lr
    arrays, meta = engine.state_arrays(), engine.state_meta()   # what a checkpoint holds
    engine.load_state(arrays, meta)                   # back to that step, bit for bit

Two implementations, no `if paged` branches in the loop:
- `InMemoryEngine` (here): the reference trainer. The whole train state is a replicated pytree of jax arrays on
  every device, one jitted step over the mesh's data axis.
- `PagedTrainEngine` (`angel_jax/schedule/paged_engine.py`): model state in pages across device, host and disk
  under a plan (Angel-PTM).

`memory.mode: auto` picks in-memory when the whole training state fits the device budget (see `fits_in_memory`).
"""

from __future__ import annotations

import logging
import threading
from typing import Any, Mapping, Protocol, runtime_checkable

import jax
import jax.numpy as jnp
import numpy as np
import psutil
from jax.sharding import NamedSharding, PartitionSpec as P

from angel_jax.config import Config
from angel_jax.errors import AngelError
from angel_jax.optim import make_optimizer
from angel_jax.train.step import StepControls, TrainState, init_state, make_train_step
from models import gpt

log = logging.getLogger(__name__)


class StateMismatch(AngelError, ValueError):
    """A checkpoint's arrays do not fit this engine (another model, optimizer or engine); the message names what
    differs."""


@runtime_checkable
class TrainEngine(Protocol):
    name: str
    """'in_memory' or 'paged' (recorded in every checkpoint)."""

    batch_sharding: jax.sharding.Sharding
    """Where `step` expects the global batch."""

    def step(self, batch: jax.Array, controls: StepControls | None = None) -> dict[str, jax.Array]:
        """One optimizer step on a global batch int32[B, T+1]; returns loss, grad_norm (before clipping),
        update_norm, lr and skipped (1.0 when the guard dropped the update) as scalars that may still be
        computing (the loop reads them one step late). `controls`: the guard's bounds and the lr multiplier
        (train/step.py); None = no bounds beyond finiteness."""

    def state_arrays(self) -> dict[str, Any]:
        """Every array of the training state after the last step, by stable name (numpy or jax arrays). They
        stay unchanged until the next `step` call; the checkpoint engine copies them before it returns."""

    def state_meta(self) -> dict[str, Any]:
        """JSON: the engine name and whatever `load_state` needs to check that arrays fit (layout, shapes)."""

    def load_state(self, arrays: Mapping[str, np.ndarray], meta: Mapping[str, Any]) -> None:
        """Replace the training state with a checkpoint's; raises StateMismatch naming what does not fit."""

    def params(self) -> Any:
        """The whole model's parameters as numpy arrays, in `models.gpt`'s structure."""

    # Optional (the loop uses getattr): an engine whose state_arrays() are immutable jax arrays can let a
    # checkpoint hold them and copy them in the background instead of stalling training for the copy.
    #   def keep_until(self, released: threading.Event) -> bool:
    #       """Keep the arrays that state_arrays() returns next alive and unchanged (no donation) until
    #       `released` is set; False if the engine cannot do it now (the checkpoint then copies before it
    #       returns)."""

    def memory_report(self) -> list[str]:
        """Lines for the start-up memory report: where the state lives."""

    def close(self) -> None:
        """Release threads, files and device memory."""


# --------------------------------------------------------------------------------------------- naming


def path_name(path: tuple) -> str:
    """A pytree key path as 'params/blocks/qkv/kernel' (stable across runs: the checkpoint's array names)."""
    parts = []
    for key in path:
        for attr in ("key", "name", "idx"):
            if hasattr(key, attr):
                parts.append(str(getattr(key, attr)))
                break
        else:
            parts.append(str(key))
    return "/".join(parts)


def named_leaves(tree: Any) -> dict[str, Any]:
    leaves = jax.tree_util.tree_flatten_with_path(tree)[0]
    out = {path_name(p): leaf for p, leaf in leaves}
    if len(out) != len(leaves):
        raise ValueError("two leaves of the training state map to the same name")
    return out


def check_arrays(expected: Mapping[str, tuple[tuple[int, ...], np.dtype]], arrays: Mapping[str, Any],
                 what: str) -> None:
    """Raise StateMismatch naming the first missing, unexpected or differently shaped array."""
    missing = sorted(set(expected) - set(arrays))
    extra = sorted(set(arrays) - set(expected))
    if missing or extra:
        raise StateMismatch(f"{what}: the checkpoint's arrays differ from this run's state: "
                            f"missing {missing[:5]}{'...' if len(missing) > 5 else ''}, "
                            f"unexpected {extra[:5]}{'...' if len(extra) > 5 else ''} "
                            "(another model or optimizer config?)")
    for name, (shape, dtype) in expected.items():
        got = arrays[name]
        if tuple(got.shape) != tuple(shape) or np.dtype(got.dtype) != np.dtype(dtype):
            raise StateMismatch(f"{what}: array {name!r} is {np.dtype(got.dtype)}{list(got.shape)} in the "
                                f"checkpoint, {np.dtype(dtype)}{list(shape)} in this run (another model config?)")


# --------------------------------------------------------------------------------------------- in-memory


class InMemoryEngine:
    """The reference trainer: replicated parameters and optimizer state, the batch sharded over 'data'.

    The step donates the old state (no second copy of it in device memory). While a checkpoint holds the state of
    a step (`keep_until`), the next steps run a non-donating compilation of the same step instead, so the held
    arrays stay valid while the checkpoint copies them in the background. That variant is compiled in a
    background thread once the first step is running, so it is ready by the first checkpoint.
    """

    name = "in_memory"

    def __init__(self, cfg: Config, mesh: jax.sharding.Mesh):
        self.cfg, self.mesh = cfg, mesh
        self.replicated = NamedSharding(mesh, P())
        self.batch_sharding = NamedSharding(mesh, P("data"))
        tx, schedule = make_optimizer(cfg.optimizer, cfg.train.steps)
        graphdef, _ = gpt.abstract_params(cfg.model)

        def make_state() -> TrainState:
            return init_state(gpt.init(cfg.model, cfg.train.seed)[1], tx)

        # Created directly with its final (replicated) sharding: no host copy of the initial parameters.
        self.state: TrainState = jax.jit(make_state, out_shardings=self.replicated)()
        self._step_fn = make_train_step(graphdef, tx, schedule)
        self._step = jax.jit(self._step_fn, donate_argnums=0)
        self._keeping: threading.Event | None = None
        self._keep_step: Any = None  # the non-donating step, compiled ahead
        self._keep_compile: threading.Thread | None = None

    def step(self, batch: jax.Array, controls: StepControls | None = None) -> dict[str, jax.Array]:
        # numpy scalars: jit treats host values as replicated inputs, in multi-process runs too.
        controls = (controls or StepControls()).as_numpy()
        if self._keep_compile is None:
            self._compile_keep_variant(batch, controls)
        if self._keeping is not None and self._keeping.is_set():
            self._keeping = None
        step = self._step if self._keeping is None else self._keep_step
        self.state, metrics = step(self.state, batch, controls)
        return metrics

    def _compile_keep_variant(self, batch: jax.Array, controls: StepControls) -> None:
        abstract = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=getattr(a, "sharding", None)),
                                (self.state, batch, controls))

        def compile_it() -> None:
            try:
                self._keep_step = jax.jit(self._step_fn).lower(*abstract).compile()
            except Exception as e:  # noqa: BLE001 - without it, checkpoints copy before returning: slower, correct
                log.warning("could not compile the non-donating step (checkpoints will copy in the foreground): "
                            "%s", e)

        self._keep_compile = threading.Thread(target=compile_it, name="compile-keep-step", daemon=True)
        self._keep_compile.start()

    def keep_until(self, released: threading.Event) -> bool:
        if self._keep_compile is not None:
            self._keep_compile.join()  # long done on real runs (compiled since step 1); tiny test runs may wait
        if self._keep_step is None:  # could not compile: the checkpoint copies in the foreground
            return False
        # Holding keeps a second copy of the state alive for one step or two: only where the device has room.
        held = sum(_local(a).nbytes for a in jax.tree.leaves(self.state))
        if device_free_bytes(self.mesh.devices.flat[0]) < 1.25 * held:
            return False
        self._keeping = released
        return True

    def state_arrays(self) -> dict[str, Any]:
        # A replicated global array is not fully addressable in a multi-process run; its local shard is all of it.
        return {name: _local(a) for name, a in named_leaves(self.state).items()}

    def state_meta(self) -> dict[str, Any]:
        return {"engine": self.name}

    def load_state(self, arrays: Mapping[str, np.ndarray], meta: Mapping[str, Any]) -> None:
        if meta.get("engine", self.name) != self.name:
            raise StateMismatch(f"the checkpoint was written by the {meta.get('engine')!r} engine, this run uses "
                                f"{self.name!r} (memory.mode); resume with the same memory.mode")
        current = named_leaves(self.state)
        check_arrays({k: (v.shape, v.dtype) for k, v in current.items()}, arrays, "in-memory engine")
        paths, treedef = jax.tree_util.tree_flatten_with_path(self.state)
        leaves = [_replicate(np.asarray(arrays[path_name(p)]), self.replicated) for p, _ in paths]
        self.state = jax.tree_util.tree_unflatten(treedef, leaves)

    def params(self) -> Any:
        return jax.tree.map(lambda a: np.asarray(_local(a)), self.state.params)

    def memory_report(self) -> list[str]:
        return ["  placement          in memory: parameters and optimizer state replicated on every device"]

    def close(self) -> None:
        if self._keep_compile is not None:
            self._keep_compile.join()


def _local(a: Any) -> Any:
    if isinstance(a, jax.Array) and not a.is_fully_addressable:
        return a.addressable_data(0)
    return a


def _replicate(host: np.ndarray, sharding: NamedSharding) -> jax.Array:
    return jax.make_array_from_callback(host.shape, sharding, lambda index: host[index])


# --------------------------------------------------------------------------------------------- choosing


def state_bytes(cfg: Config) -> int:
    """Bytes of the training state the in-memory engine keeps on each device: parameters, gradients and the
    optimizer's per-parameter state (2 buffers for Adam-like optimizers, 1 for SGD with momentum / Lion)."""
    n = gpt.param_count(cfg.model)["total"]
    itemsize = jnp.dtype(cfg.model.param_dtype).itemsize
    per_param = {"adamw": 2, "adam": 2, "lion": 1, "sgd": 1, "adafactor": 1}[cfg.optimizer.name]
    return n * itemsize * (2 + per_param)


def device_free_bytes(device: jax.Device) -> int:
    """What the device has free (GPU: bytes_limit - bytes_in_use; CPU: 80% of available host RAM)."""
    stats = device.memory_stats() if hasattr(device, "memory_stats") else None
    if stats and "bytes_limit" in stats:
        return int(stats["bytes_limit"] - stats.get("bytes_in_use", 0))
    return int(psutil.virtual_memory().available * 0.8)


def fits_in_memory(cfg: Config, device: jax.Device) -> bool:
    budget = cfg.memory.device_budget or device_free_bytes(device)
    # Activations need room too: keep a quarter of the budget for them (a conservative rule of thumb; the paged
    # engine uses every byte it is given, so erring towards it costs little).
    return state_bytes(cfg) <= 0.75 * budget


def build_engine(cfg: Config, mesh: jax.sharding.Mesh) -> TrainEngine:
    """The engine `memory.mode` asks for (auto: in-memory when the state fits the device budget)."""
    mode = cfg.memory.mode
    if mode == "auto":
        mode = "in_memory" if fits_in_memory(cfg, mesh.devices.flat[0]) else "paged"
        log.info("memory.mode=auto: the training state (%.2f GB) %s -> %s engine", state_bytes(cfg) / 1e9,
                 "fits the device" if mode == "in_memory" else "does not fit the device", mode)
    if mode == "in_memory":
        return InMemoryEngine(cfg, mesh)
    if jax.process_count() > 1 or mesh.devices.size > 1:
        raise AngelError(f"memory.mode={cfg.memory.mode!r} chose the paged engine, which runs on one device of one "
                         f"process; this run has {mesh.devices.size} devices in {jax.process_count()} processes. "
                         "Use memory.mode=in_memory for data-parallel runs.")
    from angel_jax.schedule.paged_engine import PagedTrainEngine  # imported only when used

    return PagedTrainEngine(cfg, mesh)
