"""Shards of pages split across processes (angel_jax/memory/shards.py): a process's shards put back where they came
from, whole pages assembled from every process's, refusals naming what is missing; and a memory tier holding
per-process directories is a memory tier of shard checkpoints, not someone else's files. The multi-process
round trips are in test_zero_checkpoint.py."""

from __future__ import annotations

import numpy as np
import pytest

from angel_jax.train.tier_ownership import claim_memory_tier
from angel_jax.memory.shards import ShardMeta, assemble, assemble_pieces


def _page(ranks: int, shard: int) -> np.ndarray:
    return np.arange(ranks * shard, dtype=np.float32) * 1.5


def test_every_process_shards_assemble_into_the_whole_page_in_rank_order():
    whole = _page(4, 3)
    # Process 0 holds ranks 1 and 3, process 1 ranks 0 and 2 (any devices may be any process's).
    parts = [(np.concatenate([whole[3:6], whole[9:12]]), (1, 3)), (np.concatenate([whole[0:3], whole[6:9]]), (0, 2))]
    np.testing.assert_array_equal(assemble(parts, 4), whole)


def test_a_missing_or_repeated_shard_is_refused_by_rank():
    whole = _page(2, 5)
    with pytest.raises(ValueError, match=r"ranks \[1\] are missing"):
        assemble([(whole[:5], (0,))], 2)
    with pytest.raises(ValueError, match="rank 0's shard is in two processes' checkpoints"):
        assemble([(whole[:5], (0,)), (whole[:5], (0,))], 2)
    with pytest.raises(ValueError, match="do not split into the shards of ranks"):
        assemble([(whole[:7], (0, 1))], 2)


def test_pieces_of_a_leaf_assemble_wherever_they_lie_and_gaps_are_refused():
    """The in-memory engine's pieces: a [4, 6] leaf split over its rows and replicated over two processes' halves
    of its columns (a piece held by both processes counts once)."""
    whole = np.arange(24, dtype=np.float32).reshape(4, 6)
    pieces = {((0, 2), (0, 6)): whole[:2], ((2, 4), (0, 3)): whole[2:, :3], ((2, 4), (3, 6)): whole[2:, 3:]}
    both = [*pieces.items(), (((0, 2), (0, 6)), whole[:2])]
    np.testing.assert_array_equal(assemble_pieces((4, 6), np.float32, both), whole)
    with pytest.raises(ValueError, match="cover 18 of the 24 elements"):
        assemble_pieces((4, 6), np.float32, [p for p in pieces.items() if p[0] != ((2, 4), (3, 6))])


def test_shard_meta_round_trips_and_refuses_nonsense():
    meta = ShardMeta(process=1, processes=2, ranks=(2, 3), total_ranks=4)
    assert ShardMeta.from_dict(meta.to_dict()) == meta
    for bad in ({"process": 0}, {**meta.to_dict(), "ranks": [3, 2]}, {**meta.to_dict(), "ranks": [4]}):
        with pytest.raises(ValueError):
            ShardMeta.from_dict(bad)


def test_a_memory_tier_of_per_process_directories_is_claimed_not_refused(tmp_path):
    """A memory tier written by a run whose processes checkpointed their own shards holds `process_<p>`
    directories: a later run of the same run directory (over one process) claims it rather than refusing it as
    foreign files, and another run's is cleared like any stale snapshot."""
    run_dir, memory = tmp_path / "run", tmp_path / "mem"
    run_dir.mkdir()
    claim_memory_tier(run_dir, memory)  # as TrainCheckpointer does: the whole-state tier first
    claim_memory_tier(run_dir, memory / "process_0")
    claim_memory_tier(run_dir, memory)  # a later run of the same run directory: the process directory is kept
    assert (memory / "process_0" / "run_token").is_file()
    other = tmp_path / "other-run"
    other.mkdir()
    assert claim_memory_tier(other, memory)  # another run's snapshots, process directories included, removed
    assert not (memory / "process_0").exists()


def test_resume_false_moves_aside_every_checkpoint_of_a_per_process_run(tmp_path):
    """train.resume=false in a run whose processes checkpoint their own shards: each process moves its own aside,
    and process 0 also the whole-state checkpoints an earlier run over another set of processes left; a later
    resume finds nothing of the old runs (one process here, as process 0 of such a run)."""
    import dataclasses

    from angel_jax.checkpoint import StateSnapshot
    from angel_jax.config import Config
    from angel_jax.train.checkpointing import TrainCheckpointer

    base = Config()
    cfg = dataclasses.replace(base, checkpoint=dataclasses.replace(base.checkpoint, memory_dir=str(tmp_path / "mem")))
    run_dir = tmp_path / "run"
    run_dir.mkdir()

    def save(per_process: bool, step: int) -> None:
        c = TrainCheckpointer(cfg, run_dir, primary=True, per_process=per_process)
        c.save(step, StateSnapshot({"a": np.arange(4.0) + step}), {})
        c.close()

    save(False, 1)  # a whole-state checkpoint, as a run over one process writes
    save(True, 2)  # this process's shards
    c = TrainCheckpointer(cfg, run_dir, primary=True, per_process=True)
    assert c.restore_latest()[0] == 2
    assert c.archive_existing() is not None
    c.close()
    c = TrainCheckpointer(cfg, run_dir, primary=True, per_process=True)
    assert c.restore_latest() is None  # neither the shards nor the whole state of the earlier runs
    c.close()
    moved = sorted(p.name for p in (run_dir / "checkpoints").parent.iterdir() if ".replaced-" in p.name)
    assert len(moved) == 1 and sorted(p.name for p in (run_dir / moved[0]).iterdir()) == ["memory", "persistent"]
    assert any(".replaced-" in p.name for p in (run_dir / "checkpoints").iterdir())  # process_0's own, beside it
