"""Packed instruction rows (data.pack) on decoders with mixture-of-experts blocks: each document of a row gets the
logits and loss it gets alone in a row, whole model and stage by stage, and the in-memory and paged engines train
such rows alike."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from angel_jax.data import marks as token_marks
from angel_jax.config import Config, MoEConfig, OptimizerConfig
from angel_jax.train.engines import InMemoryEngine
from angel_jax.train.paged import PagedTrainEngine
from models.common import cross_entropy
import models
from test_instruction_data import GPT, LLAMA, PAGE, ROW, _cfg, _mesh, _rows

# capacity_factor 2 with 4 experts and top_k 2: capacity = min(T, 2 x T x 2 / 4) = T slots per expert and row, so
# no routing is ever dropped. With drops, the documents of a row compete for the same slots (routing is per row)
# and a document's outputs could differ from its outputs alone; without them, only the attention mask and the
# positions decide, which is what these tests check. every 2 (GPT): a dense block and an MoE block; every 1
# (Llama): MoE blocks only, so both ways of stacking the blocks run packed rows.
NO_DROPS = MoEConfig(experts=4, top_k=2, capacity_factor=2.0)
MOE_GPT = dataclasses.replace(GPT, moe=dataclasses.replace(NO_DROPS, every=2))
MOE_LLAMA = dataclasses.replace(LLAMA, moe=NO_DROPS)
# The engines route alike whatever the capacity (per row, and micro-batches are whole rows): their comparison runs
# with routings dropped, so the drop rate they report is compared too.
DROPPING = dataclasses.replace(MOE_GPT, moe=dataclasses.replace(MOE_GPT.moe, capacity_factor=1.0))
SECOND = 11
"""Where the second document of the test rows starts."""


def _whole(graphdef: nnx.GraphDef, params: dict, tokens: np.ndarray):
    """The whole model's output (a moe_decoder.Stream), jitted: op by op an MoE layer compiles for seconds."""
    return jax.jit(lambda p, t: nnx.merge(graphdef, p)(t))(params, jnp.asarray(tokens))


def _loss(logits: jax.Array, targets: np.ndarray) -> float:
    return float(cross_entropy(logits, jnp.asarray(targets)))


@pytest.mark.compares_programs
@pytest.mark.parametrize("cfg", [MOE_GPT, MOE_LLAMA], ids=["gpt-moe", "llama-moe"])
def test_each_packed_document_gets_its_logits_and_loss_alone(cfg):
    """Two documents in a row: the first's logits and loss are those of the first alone (the rest of its row
    padding), the second's those of the second alone at the start of a row (positions restart), in the whole model
    and stage by stage; the model built without documents lets the second see the first."""
    packed, plain = models.get(cfg, documents=True), models.get(cfg)
    graphdef, params = packed.init(0)
    plain_def = plain.abstract()[0]
    rng = np.random.default_rng(5)
    ids = rng.integers(0, 256, (2, ROW))
    starts = np.isin(np.arange(ROW), [0, SECOND])
    row = token_marks.mark(ids, ~starts, starts)
    targets = row[:, 1:]

    out = _whole(graphdef, params, row[:, :-1])
    assert float(jnp.max(out.drop_rate)) == 0.0, "a dropped routing would make the comparison below unfair"
    logits = out.x
    staged_out = jax.jit(lambda p, t: packed.forward(packed.split(p), t))(params, jnp.asarray(row[:, :-1]))
    np.testing.assert_allclose(np.asarray(staged_out.x), np.asarray(logits), rtol=1e-5, atol=1e-6)

    pad = token_marks.mark(np.zeros((2, ROW), ids.dtype), np.zeros((2, ROW), bool), np.zeros((2, ROW), bool))
    first_alone = np.where(np.arange(ROW) < SECOND, row, pad)
    second_alone = np.concatenate([row[:, SECOND:], pad[:, :SECOND]], axis=1)
    n = ROW - 1 - SECOND  # the second document's predictions
    for alone, here, there in ((first_alone, slice(0, SECOND), slice(0, SECOND)),
                               (second_alone, slice(SECOND, None), slice(0, n))):
        alone_logits = _whole(plain_def, params, alone[:, :-1]).x
        np.testing.assert_allclose(np.asarray(alone_logits[:, there]), np.asarray(logits[:, here]),
                                   rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(_loss(alone_logits[:, there], alone[:, 1:][:, there]),
                                   _loss(logits[:, here], targets[:, here]), rtol=1e-5)
    # Without documents the second document attends to the first: what the mask prevents.
    crossing = _whole(plain_def, params, row[:, :-1]).x
    assert float(jnp.max(jnp.abs(crossing[:, SECOND:] - logits[:, SECOND:]))) > 1e-3


def _sgd(cfg: Config) -> Config:
    """SGD: its update compiles in a fraction of Adam's time, and the engines' agreement does not depend on it."""
    return dataclasses.replace(cfg, optimizer=OptimizerConfig(name="sgd", lr=0.5, warmup_steps=1))


@pytest.mark.compares_programs
def test_the_paged_engine_trains_packed_moe_rows_as_the_in_memory_engine(tmp_path):
    """Steps and evaluations of the same packed batches: the in-memory engine on whole batches, the paged one in two
    micro-batches holding different numbers of scored targets, agree on the loss and the MoE figures (the stages
    pass the documents on inside the MoE decoder's Stream, through micro-batches and saved inputs alike)."""
    reference = InMemoryEngine(_sgd(_cfg(tmp_path, DROPPING, True)), _mesh())
    cfg = _sgd(_cfg(tmp_path, DROPPING, True, mode="paged", page_size=PAGE))
    paged = PagedTrainEngine(dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, micro_batch_size=2)),
                             _mesh())
    try:
        assert paged.built.plan.micro_batches == 2
        batches = [jnp.asarray(b) for b in _rows(8, True, seed=2).reshape(2, 4, ROW)]
        assert all(int(np.sum(token_marks.doc_starts(np.asarray(b)))) > 4 for b in batches), "rows must be packed"
        first = [float(e.eval_loss(batches[0])) for e in (reference, paged)]
        for b in batches:
            counts = [int(np.sum(np.asarray(b)[m::2, 1:] >= 0)) for m in range(2)]
            assert counts[0] != counts[1]
            evals = [float(e.eval_loss(b)) for e in (reference, paged)]
            steps = [e.step(b) for e in (reference, paged)]
            np.testing.assert_allclose(evals, evals[0], rtol=1e-5)
            np.testing.assert_allclose([float(m["loss"]) for m in steps], evals[0], rtol=1e-5)  # before the update
            assert float(steps[0]["moe/drop_rate"]) > 0
            for key in ("moe/aux_loss", "moe/drop_rate"):
                np.testing.assert_allclose([float(m[key]) for m in steps], float(steps[0][key]), rtol=1e-5,
                                           atol=1e-7, err_msg=key)
        last = [float(e.eval_loss(batches[0])) for e in (reference, paged)]
        np.testing.assert_allclose(last, last[0], rtol=1e-5)
        assert last[0] < first[0] - 0.05, "the steps must have changed the parameters"
    finally:
        for engine in (reference, paged):
            engine.close()
