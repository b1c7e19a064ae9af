"""The persistent tier in the snapshot format (`CheckpointOptions.persistent_format="snapshot"`, filetier.py), which
each process of a multi-process run wrote its own shards to before they were orbax checkpoints: copied from the
memory tier in the background, written directly when the memory tier cannot take a save, read back when the
memory tier is gone, damage found by its checksums; and a process directory written so is still read so."""

from __future__ import annotations

import shutil

import numpy as np

from angel_jax.checkpoint import CheckpointManager, CheckpointOptions


def _state(seed: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {"params/a": rng.standard_normal(1000).astype(np.float32), "step": np.asarray(seed, np.int32)}


def _options(tmp_path, memory) -> CheckpointOptions:
    return CheckpointOptions(persistent_dir=tmp_path / "persistent", memory_dir=memory, keep_last=2,
                             persistent_format="snapshot")


def test_persisted_as_snapshot_directories_and_restored_from_them(tmp_path):
    with CheckpointManager(_options(tmp_path, tmp_path / "mem")) as engine:
        for step in (1, 2, 3):
            engine.save(step, _state(step), {"data": step})
            engine.wait()  # each one persisted (a save queued behind a newer one would be superseded)
        assert [i.step for i in engine.list() if "persistent" in i.tiers] == [2, 3]  # keep_last
        assert {i.tiers["persistent"].state for i in engine.list()} == {"persisted"}
    assert sorted(p.name for p in (tmp_path / "persistent").iterdir()) == ["step_2", "step_3"]
    shutil.rmtree(tmp_path / "mem")  # the host's memory lost: the persistent copy
    with CheckpointManager(_options(tmp_path, tmp_path / "mem")) as engine:
        restored = engine.restore()
    assert (restored.step, restored.source, restored.meta["data"]) == (3, "persistent", 3)
    np.testing.assert_array_equal(restored.arrays["params/a"], _state(3)["params/a"])


def test_without_a_memory_tier_a_save_is_written_straight_to_it_and_damage_is_found(tmp_path):
    no_memory = tmp_path / "not-a-directory"
    no_memory.write_text("a file where the memory tier would be")
    with CheckpointManager(_options(tmp_path, no_memory)) as engine:
        handle = engine.save(7, _state(7), {})
        assert handle.state == "persisted"
        restored = engine.restore()
        assert (restored.step, restored.source) == (7, "persistent")
        np.testing.assert_array_equal(restored.arrays["params/a"], _state(7)["params/a"])
        data = tmp_path / "persistent" / "step_7" / "data.bin"
        raw = bytearray(data.read_bytes())
        raw[100] ^= 0xFF
        data.write_bytes(bytes(raw))
        assert any("params/a" in p for p in engine.verify(7))


def test_a_process_directory_keeps_the_format_its_shards_were_written_in(tmp_path):
    """A process's persistent directory that holds only snapshot directories (shards persisted before they were
    orbax checkpoints) is read and continued in that format; an empty or orbax one is orbax."""
    from angel_jax.train.checkpointing import persistent_format_of, shard_tier

    old, new = tmp_path / "old" / "process_0", tmp_path / "new" / "process_0"
    with CheckpointManager(CheckpointOptions(persistent_dir=old, memory_dir=tmp_path / "m1",
                                            persistent_format="snapshot")) as engine:
        engine.save(4, _state(4), {})
    assert persistent_format_of(new) == "orbax"  # nothing there yet
    with CheckpointManager(CheckpointOptions(persistent_dir=new, memory_dir=tmp_path / "m2")) as engine:
        engine.save(5, _state(5), {})
    assert (persistent_format_of(old), persistent_format_of(new)) == ("snapshot", "orbax")
    for directory, step in ((old, 4), (new, 5)):
        _, arrays = shard_tier(directory).load(step, verify=True, pool=None)
        np.testing.assert_array_equal(arrays["params/a"], _state(step)["params/a"])
