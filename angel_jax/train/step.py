"""The reference training step: a pure function of (state, batch, controls), jitted once.

This is the arithmetic every other engine in angel_jax is measured against: the paged engine must reproduce its
losses, checkpoints must resume it bit for bit. The in-memory engine runs the same arithmetic in two jitted
phases (`make_step_phases`) so that it never holds a second copy of the training state; the two agree to float
rounding (XLA contracts the fused in-place update's multiply-adds differently; tests/test_step_phases.py).

Gradient accumulation (`train.micro_batch_size`): `make_value_and_grad` takes the loss and gradients of M
micro-batches one after another in a `scan` (float32 sums, scaled by 1/M once): the whole batch's mean loss and its
gradient, with the activations of one micro-batch at a time.

`StepControls` are per-step scalars from the host: the update guard's bounds and a learning-rate multiplier
(angel_jax/optim/guard.py, the one guard every engine uses). The loss is the model's (`StagedModel.loss`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from angel_jax.optim.factory import SplitOptimizer, clip_with_norm
from angel_jax.optim.guard import StepControls, update_ok
from angel_jax.schedule.trace import split_batch


@jax.tree_util.register_dataclass
@dataclass
class TrainState:
    step: jax.Array
    """Number of optimizer updates applied (int32 scalar; a skipped update does not count)."""
    params: Any
    """Model parameters, a nested dict of arrays."""
    opt_state: Any
    """The optax state."""


def init_state(params: Any, tx: optax.GradientTransformation) -> TrainState:
    return TrainState(step=jnp.zeros((), jnp.int32), params=params, opt_state=tx.init(params))


def make_loss_fn(graphdef: nnx.GraphDef, loss: Callable[[jax.Array, jax.Array], jax.Array]
                 ) -> Callable[[Any, jax.Array], jax.Array]:
    """loss_fn(params, batch[int32, B x (T+1)]) -> the mean next-token loss: what a step differentiates, and what
    an evaluation computes alone (`InMemoryEngine.eval_loss`)."""

    def loss_fn(params: Any, batch: jax.Array) -> jax.Array:
        logits = nnx.merge(graphdef, params)(batch[:, :-1])
        return loss(logits, batch[:, 1:])

    return loss_fn


def make_micro_loss_fn(graphdef: nnx.GraphDef, loss: Callable[[jax.Array, jax.Array], jax.Array],
                       micro_batches: int = 1) -> Callable[[Any, jax.Array], jax.Array]:
    """`make_loss_fn`'s loss taken over `micro_batches` equal micro-batches one after another (`split_batch`; a
    `scan`: the activations of one micro-batch at a time), their mean: the whole batch's mean loss."""
    loss_fn = make_loss_fn(graphdef, loss)
    if micro_batches == 1:
        return loss_fn

    def micro_loss(params: Any, batch: jax.Array) -> jax.Array:
        def body(total: jax.Array, micro: jax.Array) -> tuple[jax.Array, None]:
            return total + loss_fn(params, micro).astype(jnp.float32), None

        total, _ = jax.lax.scan(body, jnp.zeros((), jnp.float32), split_batch(batch, micro_batches))
        return total * jnp.float32(1 / micro_batches)

    return micro_loss


def make_value_and_grad(graphdef: nnx.GraphDef, loss: Callable[[jax.Array, jax.Array], jax.Array],
                        micro_batches: int = 1, ranks: int = 1,
                        on_ranks: Callable[[Any], Any] | None = None
                        ) -> Callable[[Any, jax.Array], tuple[jax.Array, Any]]:
    """(params, batch) -> (mean loss, its gradients). With several micro-batches (gradient accumulation): a `scan`
    over them (`split_batch`) adding each one's loss and gradients into float32 sums, which are scaled by
    1/micro_batches once at the end: the gradient of the whole batch's mean loss (equal-size micro-batches), with
    the activations of one micro-batch at a time.

    `ranks` > 1 (data parallel; the batch's rows sharded over them in order): each rank's rows of a micro-batch are
    differentiated apart (a `vmap` over ranks) into per-rank float32 sums, laid out over the ranks by `on_ranks`
    (a sharding constraint on the leading axis), and summed over the ranks once at the end: one gradient
    reduction per step, not one per micro-batch."""
    loss_fn = make_loss_fn(graphdef, loss)
    if micro_batches == 1:
        return jax.value_and_grad(loss_fn)
    per_rank = ranks > 1
    grad_fn = jax.vmap(jax.value_and_grad(loss_fn), in_axes=(None, 0)) if per_rank else jax.value_and_grad(loss_fn)
    lay_out = on_ranks if per_rank and on_ranks is not None else (lambda tree: tree)

    def value_and_grad(params: Any, batch: jax.Array) -> tuple[jax.Array, Any]:
        def body(carry: tuple, micro: jax.Array) -> tuple[tuple, None]:
            total, acc = carry
            value, grads = grad_fn(params, micro)
            acc = lay_out(jax.tree.map(lambda a, g: a + g.astype(jnp.float32), acc, grads))
            return (total + value.astype(jnp.float32), acc), None

        micro = split_batch(batch, micro_batches)
        lead: tuple[int, ...] = ()
        if per_rank:  # [M, ranks, rows of a rank, T+1]: a micro-batch's rows on each rank (see split_batch)
            micro = micro.reshape(micro_batches, ranks, micro.shape[1] // ranks, *micro.shape[2:])
            lead = (ranks,)
        zeros = lay_out(jax.tree.map(lambda p: jnp.zeros(lead + p.shape, jnp.float32), params))
        (total, acc), _ = jax.lax.scan(body, (jnp.zeros(lead, jnp.float32), zeros), micro)
        if per_rank:  # the one reduction over the ranks
            total, acc = jnp.sum(total), jax.tree.map(lambda a: jnp.sum(a, axis=0), acc)
        scale = jnp.float32(1 / (micro_batches * ranks if per_rank else micro_batches))
        return total * scale, jax.tree.map(lambda a, p: (a * scale).astype(p.dtype), acc, params)

    return value_and_grad


def make_train_step(graphdef: nnx.GraphDef, tx: optax.GradientTransformation, schedule: optax.Schedule,
                    loss: Callable[[jax.Array, jax.Array], jax.Array]) -> Callable[..., tuple[TrainState, dict]]:
    """step(state, batch[int32, B x (T+1)], controls=None) -> (new state, metrics). The gradient norm is the one
    before clipping; metrics["skipped"] is 1.0 when the guard dropped the update (a non-finite loss or norm is
    always dropped; without controls there are no other bounds)."""
    loss_fn = make_loss_fn(graphdef, loss)

    def step(state: TrainState, batch: jax.Array, controls: StepControls | None = None) -> tuple[TrainState, dict]:
        if controls is None:
            controls = StepControls().as_arrays()
        value, grads = jax.value_and_grad(loss_fn)(state.params, batch)
        updates, opt_state = tx.update(grads, state.opt_state, state.params)
        updates = jax.tree.map(lambda u: u * controls.lr_scale.astype(u.dtype), updates)
        params = optax.apply_updates(state.params, updates)
        grad_norm, update_norm = optax.tree.norm(grads), optax.tree.norm(updates)
        ok = update_ok(value, grad_norm, update_norm, controls)
        keep = lambda new, old: jax.tree.map(lambda n, o: jnp.where(ok, n, o), new, old)  # noqa: E731
        new_state = TrainState(state.step + ok.astype(jnp.int32), keep(params, state.params),
                               keep(opt_state, state.opt_state))
        metrics = {
            "loss": value,
            "grad_norm": grad_norm,
            "update_norm": update_norm,
            "lr": schedule(state.step) * controls.lr_scale,
            "skipped": 1.0 - ok.astype(jnp.float32),
        }
        return new_state, metrics

    return step


@dataclass(frozen=True)
class StepPhases:
    """One training step as two pure functions, for an engine to jit apart (see `make_step_phases`):

        clipped, ok, metrics = judge(state, batch, controls)   # reads the state, writes none of it
        new_state = apply(state, clipped, ok, controls)        # in place over the donated state
    """

    judge: Callable[..., tuple[Any, jax.Array, dict]]
    apply: Callable[..., TrainState]


def make_step_phases(graphdef: nnx.GraphDef, opt: SplitOptimizer,
                     loss: Callable[[jax.Array, jax.Array], jax.Array], micro_batches: int = 1, ranks: int = 1,
                     on_ranks: Callable[[Any], Any] | None = None) -> StepPhases:
    """`make_train_step`'s arithmetic (with `opt.tx` as its transformation) in two phases, in the memory of an
    unguarded step.

    Why: whether an update is applied depends on its norm, so a single jitted step computes the whole new state
    (parameters and optimizer state: 12 bytes per parameter with fp32 Adam) next to the old one before it knows
    which to keep. Here `judge` computes the loss, the gradients clipped by their global norm, the update only into
    its norm, and the verdict; `apply`, given the verdict, computes the same update again and writes it over the
    donated state (or leaves the state as it is: a `cond`, not an element-wise select, so nothing forces a copy).
    The update is computed twice: one more pass over the optimizer state, small next to forward and backward.

    `micro_batches` > 1: `judge` accumulates the loss and gradients over that many micro-batches of the batch
    (`make_value_and_grad`, with `ranks` and `on_ranks`); the rest is as with one."""
    value_and_grad = make_value_and_grad(graphdef, loss, micro_batches, ranks, on_ranks)

    def update(clipped: Any, state: TrainState, controls: StepControls) -> tuple[Any, Any]:
        updates, core = opt.core.update(clipped, opt.core_state(state.opt_state), state.params)
        updates = jax.tree.map(lambda u: u * controls.lr_scale.astype(u.dtype), updates)
        return updates, opt.with_core_state(state.opt_state, core)

    def judge(state: TrainState, batch: jax.Array, controls: StepControls) -> tuple[Any, jax.Array, dict]:
        value, grads = value_and_grad(state.params, batch)
        grad_norm = optax.tree.norm(grads)
        clipped = clip_with_norm(grads, grad_norm, opt.max_norm)
        update_norm = optax.tree.norm(update(clipped, state, controls)[0])
        ok = update_ok(value, grad_norm, update_norm, controls)
        metrics = {
            "loss": value,
            "grad_norm": grad_norm,
            "update_norm": update_norm,
            "lr": opt.schedule(state.step) * controls.lr_scale,
            "skipped": 1.0 - ok.astype(jnp.float32),
        }
        return clipped, ok, metrics

    def apply(state: TrainState, clipped: Any, ok: jax.Array, controls: StepControls) -> TrainState:
        def updated(state: TrainState) -> TrainState:
            updates, opt_state = update(clipped, state, controls)
            return TrainState(state.step + 1, optax.apply_updates(state.params, updates), opt_state)

        return jax.lax.cond(ok, updated, lambda state: state, state)

    return StepPhases(judge, apply)
