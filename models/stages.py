"""The stage interface: a model seen as a sequence of pure functions over per-stage parameters.

The reference trainer runs a model whole; the scheduling pass needs to run it one stage at a time, moving each
stage's parameters in and out of device memory around the call. A model exposes that view as a `StagedModel`:

    staged = models.get(cfg.model)                # pure description, no arrays
    graphdef, params = staged.init(seed)          # the whole model, for the in-memory engines
    block0 = staged.init_stage(seed, 1)           # one stage alone, for models larger than host RAM
    stage_params = staged.split(params)           # whole-model params -> one pytree per stage
    logits = staged.forward(stage_params, tokens) # embed -> block 0 .. N-1 -> head
    loss = staged.loss(logits, targets)       # mean over the scored targets

Stages of the same `kind` (the N homogeneous blocks) share one apply function, so one jitted forward and one
jitted backward serve every block and compile time does not grow with depth. `schedule/` sees only stage names,
kinds and parameter pytrees, never Flax modules.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Callable

import jax

PyTree = Any


@dataclass(frozen=True)
class Stage:
    name: str
    """Unique and in execution order: 'embed', 'block.0', ..., 'head'."""
    kind: str
    """Key of the shared apply function in `StagedModel.apply`."""


@dataclass(frozen=True)
class PlannerHints:
    """What the scheduling pass estimates a family's device memory and (`angel-jax plan --estimate`) compute and
    expert traffic from: figures the stage functions' shapes alone do not give."""

    block_activation_width: int
    """Values per token that one block call holds at its peak besides attention's T x T scores (its q, k and v,
    its MLP's hidden activations), for the scheduling pass's device-memory estimate (the GPT's: 3 x d_model + 2 x
    hidden)."""
    saved_input_values: int = 0
    """Values one row's stage inputs hold between a step's forward and backward, summed over every stage but the
    first (whose input is the token ids), for the scheduling pass's device-memory estimate; 0: a chain of d_model
    wide activations of seq_len positions, (stages - 1) x seq_len x d_model (the GPT's and Llama's)."""
    forward_flops_per_row: dict[str, float] = dataclasses.field(default_factory=dict)
    """Stage kind -> forward FLOPs of one stage of that kind on one row, for `angel-jax plan --estimate`; empty:
    estimated there from the stage's weights (2 per weight per token, plus attention's for a 'block')."""
    exchange_values_per_row: dict[str, float] = dataclasses.field(default_factory=dict)
    """Stage kind -> values (of the compute dtype) one row sends and receives in the expert all-to-alls of one
    forward of a stage of that kind when its experts are split over devices (`moe.exchange_values` per MoE layer),
    for `angel-jax plan --estimate`; empty: no experts."""


@dataclass(frozen=True)
class StagedModel:
    stages: tuple[Stage, ...]
    """The stages in forward order."""
    apply: dict[str, Callable[[PyTree, PyTree], PyTree]]
    """kind -> pure function (stage params, stage input) -> stage output. The first stage takes token ids,
    the last returns float32 logits. What passes between stages is an array, or a pytree of arrays whose leaves all
    have the batch's rows as their leading axis (an MoE decoder's `moe_decoder.Stream`: the residual stream with
    its per-row auxiliary sums; T5's pairs: the stream a stage transforms and the one it passes on); the last
    stage's output is then a pytree too, which `loss` and `figures` read."""
    loss: Callable[..., jax.Array]
    """(the last stage's output, integer targets, count=None) -> scalar loss: the cross-entropy of the scored
    targets (angel_jax/data/marks.py) divided by `count`, None = their number here (the mean); an engine that
    averages pieces of a batch passes each its share of the batch's count (`common.scored_share`)."""
    split: Callable[[PyTree], list[PyTree]]
    """Whole-model params -> list of per-stage params (same order as `stages`)."""
    merge: Callable[[list[PyTree]], PyTree]
    """Inverse of `split`."""
    init: Callable[[int], tuple[Any, PyTree]]
    """seed -> (graphdef, whole-model params): the model built with real arrays (`nnx.merge(graphdef, params)`
    is the whole model as one module, for the in-memory engines)."""
    init_stage: Callable[[int, int], PyTree]
    """(seed, stage index) -> that stage's params alone, bit-identical to `split(init(seed)[1])[index]`."""
    abstract: Callable[[], tuple[Any, PyTree]]
    """() -> (graphdef, params as jax.ShapeDtypeStruct), allocating nothing."""
    param_count: dict[str, int]
    """'total' parameters, 'matmul': those that enter matrix products, and 'active': of those, the ones one token's
    computation uses (all of them but in a mixture of experts; for FLOP counts)."""
    flops_per_token: float
    """Training FLOPs per token (forward + backward) that MFU is stated against (the formula is the family's)."""
    hints: PlannerHints
    """The scheduling pass's estimates of what the stage functions' shapes do not say."""
    init_reads_files: bool = False
    """True when `init` and `init_stage` read the parameters from files (model.init_from) and return numpy arrays:
    call them outside jit (inside, the arrays would become constants of the compiled program) and place them."""
    figures: Callable[[PyTree], dict[str, jax.Array]] | None = None
    """Extra figures of a training step (scalars under their metric names, e.g. 'moe/aux_loss') from the last
    stage's output or input (both carry them); None: the family has none."""
    init_cache: Callable[[int, int], PyTree] | None = None
    """(batch, max_len) -> an empty key/value cache for `decode`; None: the family cannot sample."""
    decode: Callable[[PyTree, PyTree, jax.Array, jax.Array], tuple[jax.Array, PyTree]] | None = None
    """(whole-model params, cache, tokens int32[B, T], position int32 scalar) -> (float32 logits [B, T, V], cache):
    runs the tokens at positions pos .. pos+T-1, attending to the cache's keys and values of earlier positions and
    adding their own. Prefill is one call with the prompt at position 0; each further token is one call with T = 1,
    so a new token costs one position, not the whole sequence. Jittable, with `pos` traced."""
    expert_leaf: Callable[[str], bool] | None = None
    """Given a leaf's path in a stage's parameters (`jax.tree_util.keystr`), whether it is a mixture of experts'
    stacked expert weight, [E, ...]: such leaves get pages of their own, which a sharded engine keeps on the rank
    that holds those experts (expert parallelism); None: the family has no experts."""
    borrows: dict[int, int] = dataclasses.field(default_factory=dict)
    """Stage index -> the index of an earlier stage whose parameters it also reads (a head tied to the embedding
    unembeds with the embedding stage's matrix). Such a stage's apply takes the pair (its own parameters, the
    lender's); the lender owns the parameters, and their gradient is the sum of both stages' gradients of them
    (the paged engine adds the borrower's into the lender's). Empty: every stage reads its own parameters alone."""

    def stage_inputs(self, stage_params: list[PyTree], i: int) -> PyTree:
        """What stage i's apply takes as its parameters: its own, or (its own, its lender's)."""
        lender = self.borrows.get(i)
        return stage_params[i] if lender is None else (stage_params[i], stage_params[lender])

    def forward(self, stage_params: list[PyTree], tokens: jax.Array) -> PyTree:
        """Run every stage in sequence: the meaning of the stage decomposition."""
        assert len(stage_params) == len(self.stages), (len(stage_params), len(self.stages))
        x = tokens
        for i, stage in enumerate(self.stages):
            x = self.apply[stage.kind](self.stage_inputs(stage_params, i), x)
        return x

    def stage_shapes(self) -> list[PyTree]:
        """Every stage's parameters as jax.ShapeDtypeStruct, in stage order (`split` of `abstract`: nothing is
        allocated or read)."""
        return jax.eval_shape(self.split, self.abstract()[1])

    def kinds(self) -> dict[str, list[int]]:
        """kind -> indices of the stages of that kind."""
        out: dict[str, list[int]] = {}
        for i, stage in enumerate(self.stages):
            out.setdefault(stage.kind, []).append(i)
        return out
