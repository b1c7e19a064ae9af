"""The reference training step: a pure function of (state, batch, controls), jitted once.

This is the arithmetic every other engine in angel_jax is measured against: the paged engine must reproduce its
losses, checkpoints must resume it bit for bit. The in-memory engine runs the same arithmetic in two jitted
phases (`make_step_phases`) so that it never holds a second copy of the training state; the two agree to float
rounding (XLA contracts the fused in-place update's multiply-adds differently; tests/test_step_phases.py).

Gradient accumulation (`train.micro_batch_size`): `make_value_and_grad` takes the loss and gradients of M
micro-batches one after another in a `scan` (float32 sums, scaled by 1/M once): the whole batch's mean loss and its
gradient, with the activations of one micro-batch at a time. The loss is a mean over the batch's scored targets
(instruction data scores only responses, angel_jax/data/marks.py), so a micro-batch divides its cross-entropy by
its share of the whole batch's scored count (`models.common.scored_share`), not by its own: however unevenly the
micro-batches (and the ranks' rows of them) hold scored targets, their average is the whole batch's mean.

`StepControls` are per-step scalars from the host: the update guard's bounds and a learning-rate multiplier
(angel_jax/optim/guard.py, the one guard every engine uses). The loss is the model's (`StagedModel.loss`); a
model's own figures of a step (`StagedModel.figures`, e.g. a mixture of experts' auxiliary loss and drop rate) join
the step's metrics.
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
from models.common import scored_share


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


Figures = Callable[[Any], dict[str, jax.Array]]
"""The model's output -> extra step metrics (`StagedModel.figures`, e.g. an MoE's auxiliary loss and drop rate)."""


def make_loss_fn(graphdef: nnx.GraphDef, loss: Callable[..., jax.Array]) -> Callable[..., jax.Array]:
    """loss_fn(params, batch[int32, B x (T+1)], count=None) -> the mean next-token loss (over the scored targets;
    `count`: see `StagedModel.loss`): what a step differentiates, and what an evaluation computes alone
    (`InMemoryEngine.eval_loss`)."""
    loss_and_figures = make_loss_and_figures(graphdef, loss)
    return lambda params, batch, count=None: loss_and_figures(params, batch, count)[0]


def make_loss_and_figures(graphdef: nnx.GraphDef, loss: Callable[..., jax.Array],
                          figures: Figures | None = None) -> Callable[..., tuple[jax.Array, dict]]:
    """(params, batch, count=None) -> (`make_loss_fn`'s loss, the model's figures of the batch: {} without
    `figures`)."""

    def loss_fn(params: Any, batch: jax.Array, count: jax.Array | None = None) -> tuple[jax.Array, dict]:
        out = nnx.merge(graphdef, params)(batch[:, :-1])
        return loss(out, batch[:, 1:], count), ({} if figures is None else figures(out))

    return loss_fn


def make_micro_loss_fn(graphdef: nnx.GraphDef, loss: Callable[..., jax.Array],
                       micro_batches: int = 1) -> Callable[[Any, jax.Array], jax.Array]:
    """`make_loss_fn`'s loss taken over `micro_batches` equal micro-batches one after another (`split_batch`; a
    `scan`: the activations of one micro-batch at a time), each over its share of the batch's scored count, their
    mean: the whole batch's mean loss."""
    loss_fn = make_loss_fn(graphdef, loss)
    if micro_batches == 1:
        return loss_fn

    def micro_loss(params: Any, batch: jax.Array) -> jax.Array:
        share = scored_share(batch[:, 1:], micro_batches)

        def body(total: jax.Array, micro: jax.Array) -> tuple[jax.Array, None]:
            return total + loss_fn(params, micro, share).astype(jnp.float32), None

        total, _ = jax.lax.scan(body, jnp.zeros((), jnp.float32), split_batch(batch, micro_batches))
        return total * jnp.float32(1 / micro_batches)

    return micro_loss


def make_value_and_grad(graphdef: nnx.GraphDef, loss: Callable[..., jax.Array],
                        micro_batches: int = 1, ranks: int = 1,
                        on_ranks: Callable[[Any], Any] | None = None, figures: Figures | None = None
                        ) -> Callable[[Any, jax.Array], tuple[jax.Array, Any, dict]]:
    """(params, batch) -> (mean loss, its gradients, the model's figures: their mean over the micro-batches, {}
    without `figures`). With several micro-batches (gradient accumulation): a `scan` over them (`split_batch`)
    adding each one's loss and gradients into float32 sums, which are scaled by
    1/micro_batches once at the end: the gradient of the whole batch's mean loss (equal-size micro-batches; each
    micro-batch's loss over its share of the batch's scored count, `scored_share`), with the activations of one
    micro-batch at a time.

    `ranks` > 1 (data parallel; the batch's rows sharded over them in order): each rank's rows of a micro-batch are
    differentiated apart (a `vmap` over ranks) into per-rank float32 sums, laid out over the ranks by `on_ranks`
    (a sharding constraint on the leading axis), and summed over the ranks once at the end: one gradient
    reduction per step, not one per micro-batch."""
    one_grad = jax.value_and_grad(make_loss_and_figures(graphdef, loss, figures), has_aux=True)
    if micro_batches == 1:
        def whole(params: Any, batch: jax.Array) -> tuple[jax.Array, Any, dict]:
            (value, figs), grads = one_grad(params, batch)
            return value, grads, figs

        return whole
    per_rank = ranks > 1
    grad_fn = jax.vmap(one_grad, in_axes=(None, 0, None)) if per_rank else one_grad
    lay_out = on_ranks if per_rank and on_ranks is not None else (lambda tree: tree)

    def value_and_grad(params: Any, batch: jax.Array) -> tuple[jax.Array, Any, dict]:
        # Every piece (a micro-batch, or a rank's rows of one) is averaged with the others: each divides by its
        # share of the whole batch's scored targets.
        share = scored_share(batch[:, 1:], micro_batches * ranks if per_rank else micro_batches)

        def body(carry: tuple, micro: jax.Array) -> tuple[tuple, None]:
            total, acc, fig_sums = carry
            (value, figs), grads = grad_fn(params, micro, share)
            acc = lay_out(jax.tree.map(lambda a, g: a + g.astype(jnp.float32), acc, grads))
            fig_sums = jax.tree.map(lambda a, f: a + f.astype(jnp.float32), fig_sums, figs)
            return (total + value.astype(jnp.float32), acc, fig_sums), None

        micro = split_batch(batch, micro_batches)
        lead: tuple[int, ...] = ()
        if per_rank:  # [M, ranks, rows of a rank, T+1]: a micro-batch's rows on each rank (see split_batch)
            micro = micro.reshape(micro_batches, ranks, micro.shape[1] // ranks, *micro.shape[2:])
            lead = (ranks,)
        zeros = lay_out(jax.tree.map(lambda p: jnp.zeros(lead + p.shape, jnp.float32), params))
        fig_zeros = {} if figures is None else jax.tree.map(  # (shapes only: nothing is computed twice)
            lambda f: jnp.zeros(f.shape, jnp.float32), jax.eval_shape(grad_fn, params, micro[0], share)[0][1])
        (total, acc, fig_sums), _ = jax.lax.scan(body, (jnp.zeros(lead, jnp.float32), zeros, fig_zeros), micro)
        if per_rank:  # the one reduction over the ranks
            total, acc = jnp.sum(total), jax.tree.map(lambda a: jnp.sum(a, axis=0), acc)
            fig_sums = jax.tree.map(jnp.sum, fig_sums)
        scale = jnp.float32(1 / (micro_batches * ranks if per_rank else micro_batches))
        return (total * scale, jax.tree.map(lambda a, p: (a * scale).astype(p.dtype), acc, params),
                jax.tree.map(lambda f: f * scale, fig_sums))

    return value_and_grad


def make_train_step(graphdef: nnx.GraphDef, tx: optax.GradientTransformation, schedule: optax.Schedule,
                    loss: Callable[..., jax.Array],
                    figures: Figures | None = None) -> Callable[..., tuple[TrainState, dict]]:
    """step(state, batch[int32, B x (T+1)], controls=None) -> (new state, metrics). The gradient norm is the one
    before clipping; metrics["skipped"] is 1.0 when the guard dropped the update (a non-finite loss or norm is
    always dropped; without controls there are no other bounds). The model's `figures` join the metrics."""
    value_and_grad = make_value_and_grad(graphdef, loss, figures=figures)

    def step(state: TrainState, batch: jax.Array, controls: StepControls | None = None) -> tuple[TrainState, dict]:
        if controls is None:
            controls = StepControls().as_arrays()
        value, grads, figs = value_and_grad(state.params, batch)
        updates, opt_state = tx.update(grads, state.opt_state, state.params, lr_scale=controls.lr_scale)
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
            **figs,
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
                     loss: Callable[..., jax.Array], micro_batches: int = 1, ranks: int = 1,
                     on_ranks: Callable[[Any], Any] | None = None, figures: Figures | None = None) -> StepPhases:
    """`make_train_step`'s arithmetic (with `opt.tx` as its transformation) in two phases, in the memory of an
    unguarded step.

    Why: whether an update is applied depends on its norm, so a single jitted step computes the whole new state
    (parameters and optimizer state: 12 bytes per parameter with fp32 Adam) next to the old one before it knows
    which to keep. Here `judge` computes the loss, the gradients clipped by their global norm, the update only into
    its norm, and the verdict; `apply`, given the verdict, computes the same update again and writes it over the
    donated state (or leaves the state as it is: a `cond`, not an element-wise select, so nothing forces a copy).
    The update is computed twice: one more pass over the optimizer state, small next to forward and backward.

    `micro_batches` > 1: `judge` accumulates the loss and gradients over that many micro-batches of the batch
    (`make_value_and_grad`, with `ranks` and `on_ranks`); the rest is as with one. The model's `figures` (their
    mean over the micro-batches) join `judge`'s metrics."""
    value_and_grad = make_value_and_grad(graphdef, loss, micro_batches, ranks, on_ranks, figures)

    def update(clipped: Any, state: TrainState, controls: StepControls) -> tuple[Any, Any]:
        updates, core = opt.core.update(clipped, opt.core_state(state.opt_state), state.params,
                                        lr_scale=controls.lr_scale)
        return updates, opt.with_core_state(state.opt_state, core)

    def judge(state: TrainState, batch: jax.Array, controls: StepControls) -> tuple[Any, jax.Array, dict]:
        value, grads, figs = value_and_grad(state.params, batch)
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
            **figs,
        }
        return clipped, ok, metrics

    def apply(state: TrainState, clipped: Any, ok: jax.Array, controls: StepControls) -> TrainState:
        def updated(state: TrainState) -> TrainState:
            updates, opt_state = update(clipped, state, controls)
            return TrainState(state.step + 1, optax.apply_updates(state.params, updates), opt_state)

        return jax.lax.cond(ok, updated, lambda state: state, state)

    return StepPhases(judge, apply)
