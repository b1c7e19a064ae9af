"""A head tied to the embedding in the paged engine: the head borrows the embedding stage's pages
(`StagedModel.borrows`), its gradient of the matrix is added into the embedding stage's before that stage's one
update, and training matches the whole-model trainer, wherever the pages live."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from test_paged import _cfg, batches, paged, reference

from angel_jax.config import ModelConfig
from angel_jax.schedule.runtime import build_paged_runtime
import models

# A vocabulary large next to the blocks, as in a published Llama: the embedding is the largest stage.
TIED = ModelConfig(name="llama", vocab_size=512, d_model=64, n_layers=4, n_heads=4, n_kv_heads=2, seq_len=16,
                   compute_dtype="float32", tie_embeddings=True)
STEPS = 6


def _data(n: int = STEPS) -> list:
    return batches(n, TIED, batch=4)


def _relative(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.abs(a - b).max() / np.abs(b).max())


@pytest.fixture(scope="module")
def whole() -> tuple[list[float], dict]:
    return reference(_cfg(model=TIED, steps=STEPS), _data())


# The budgets below are sized in pages of test_paged.PAGE, unfitted (memory.page_fit=false): fitted ones are
# smaller, and more would stay resident.
BUDGET_DEVICE_UPDATES = 5_000_000
"""The streaming window, two stages' update pages (the embedding's the largest) and what is left resident."""


@pytest.mark.compares_programs
@pytest.mark.parametrize("memory", [
    dict(),                                                          # every stage resident
    dict(device_budget=2_400_000),                                     # the embedding streams, fetched for the head
    dict(device_budget=2_400_000, host_budget=3_700_000),              # every family on disk
    dict(device_budget=2_400_000, passes=2),                           # fetched once per pass
    # updated on the device (the head's share of its gradient crosses with the embedding's), inputs parked
    dict(device_budget=BUDGET_DEVICE_UPDATES, streamed_updates="device", activations="host"),
], ids=["resident", "streamed", "disk", "passes", "device_updates"])
def test_a_tied_head_trains_as_the_whole_model(memory, whole, tmp_path):
    micro = {"passes": 1} if "passes" in memory else {}
    cfg = _cfg(model=TIED, steps=STEPS, page_fit=False,
               **({"disk_dir": str(tmp_path)} if "host_budget" in memory else {}), **memory)
    if micro:
        cfg = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, micro_batch_size=1))
    losses, params, engine = paged(cfg, _data())
    want_losses, want = whole
    if memory:  # the embedding (stage 0) streams: the head's calls fetch it again
        assert 0 in engine.plan.streamed, engine.plan.home
    if "streamed_updates" in memory:
        assert 0 in engine.plan.streamed_device_updates and engine.plan.parked_bytes, engine.plan.updates
    if "host_budget" in memory:
        assert engine.plan.home[0] == "disk" and engine.plan.opt_home[0] == "disk", engine.plan.home
    np.testing.assert_allclose(losses, want_losses, rtol=2e-5)
    assert set(params["head"]) == {"norm"}  # one matrix, the embedding stage's
    matrix = params["embed"]["tokens"]["embedding"]
    assert _relative(matrix, want["embed"]["tokens"]["embedding"]) < 1e-4
    # The head's share of the gradient is in there: the matrix moved more than the embedding lookups alone move it
    # (rows of tokens never read still change, through the unembedding).
    unread = np.setdiff1d(np.arange(TIED.vocab_size), np.concatenate([np.asarray(b).ravel() for b in _data()]))
    first = models.get(TIED).init(0)[1]["embed"]["tokens"]["embedding"]
    assert len(unread) and np.abs(matrix[unread] - np.asarray(first)[unread]).max() > 1e-4


@pytest.mark.compares_programs
def test_an_evaluation_reads_the_borrowed_pages(whole):
    """An evaluation streams the stages as a step does: the head's call gets the embedding's pages again."""
    cfg = _cfg(model=TIED, steps=STEPS, device_budget=2_400_000, page_fit=False)
    data = _data()
    params = models.get(TIED).init(0)[1]
    engine = build_paged_runtime(cfg, params, data[0])
    try:
        assert 0 in engine.plan.streamed
        got = float(engine.executor.eval_loss(data[0]))
    finally:
        engine.close()
    staged = models.get(TIED)
    want = float(staged.loss(staged.forward(staged.split(params), data[0][:, :-1]), data[0][:, 1:]))
    assert got == pytest.approx(want, rel=1e-6)


def test_the_planner_counts_the_borrowed_pages():
    """The head's access needs the embedding's pages on the device: a streamed embedding is fetched for it (the
    predicted timeline fetches it three times a step: forward, head, backward), and the device's fixed bytes hold
    the head's gradient of it."""
    cfg = _cfg(model=TIED, steps=STEPS, device_budget=2_400_000, page_fit=False)
    engine = build_paged_runtime(cfg, models.get(TIED).init(0)[1], _data(1)[0])
    try:
        fetches = [e for e in engine.plan.predicted.events if e.label == "fetch embed"]
        untied_model = dataclasses.replace(TIED, tie_embeddings=False)
        untied = build_paged_runtime(dataclasses.replace(cfg, model=untied_model),
                                     models.get(untied_model).init(0)[1], _data(1)[0])
        try:
            untied_fetches = [e for e in untied.plan.predicted.events if e.label == "fetch embed"]
            assert engine.budgets.fixed_device > untied.budgets.fixed_device
        finally:
            untied.close()
    finally:
        engine.close()
    assert len(fetches) > len(untied_fetches), (len(fetches), len(untied_fetches))
