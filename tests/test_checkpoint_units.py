"""Pure parts of the checkpoint manager: checksum algebra, retention policy, the snapshot format, options."""

from __future__ import annotations

import json

import os
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest
import xxhash
from hypothesis import given, settings
from hypothesis import strategies as st

from angel_jax.checkpoint import CheckpointManager, CheckpointOptions
from angel_jax.checkpoint.checksum import digest, digest_many
from angel_jax.checkpoint.retention import steps_to_keep
from angel_jax.checkpoint.snapshot import ALIGN, SnapshotIndex, decode_dtype, encode_dtype, plan_layout


@settings(max_examples=30, deadline=None)
@given(st.lists(st.binary(max_size=5000), min_size=1, max_size=5))
def test_checksums_are_plain_xxh3_whatever_the_threads(buffers: list[bytes]) -> None:
    # The stored checksum must be checkable with nothing but xxhash, however it was computed.
    with ThreadPoolExecutor(2) as pool:
        threaded = digest_many([memoryview(b) for b in buffers], pool)
    assert threaded == digest_many([memoryview(b) for b in buffers]) == [xxhash.xxh3_64_intdigest(b) for b in buffers]


def test_a_flipped_bit_changes_the_checksum() -> None:
    data = bytearray(np.random.default_rng(0).integers(0, 256, 1 << 16, dtype=np.uint8).tobytes())
    before = digest(memoryview(bytes(data)))
    data[12345] ^= 0x10
    assert digest(memoryview(bytes(data))) != before


def test_retention_keeps_newest_and_every_kth() -> None:
    assert steps_to_keep([1, 2, 3, 4, 5, 6, 7], keep_last=2) == {6, 7}
    assert steps_to_keep([1, 2, 3, 4, 5, 6, 7], keep_last=2, keep_every=3) == {3, 6, 7}
    assert steps_to_keep([5, 1, 9], keep_last=5) == {1, 5, 9}
    assert steps_to_keep([], keep_last=3, keep_every=2) == set()


@settings(max_examples=50, deadline=None)
@given(st.sets(st.integers(0, 500), max_size=40), st.integers(1, 6), st.none() | st.integers(1, 50))
def test_retention_properties(steps: set[int], keep_last: int, keep_every: int | None) -> None:
    keep = steps_to_keep(steps, keep_last, keep_every)
    assert keep <= steps
    assert set(sorted(steps)[-keep_last:]) <= keep  # the newest are never dropped
    extra = keep - set(sorted(steps)[-keep_last:])
    assert all(keep_every and s % keep_every == 0 for s in extra)


@pytest.mark.parametrize("dtype", [np.float32, np.float64, np.float16, ml_dtypes.bfloat16, np.int8, np.int32,
                                   np.int64, np.uint8, np.uint32, np.bool_, np.complex64, ml_dtypes.float8_e4m3fn])
def test_dtype_names_round_trip(dtype: type) -> None:
    assert decode_dtype(encode_dtype(np.dtype(dtype))) == np.dtype(dtype)


@pytest.mark.parametrize("dtype", [object, "U4", "S3", ">f4", [("a", "f4"), ("b", "i4")], "datetime64[s]"])
def test_unportable_dtypes_are_rejected(dtype: object) -> None:
    with pytest.raises(TypeError):
        encode_dtype(np.dtype(dtype))


def test_layout_is_aligned_and_sized() -> None:
    arrays = {"a": np.zeros(3, np.float32), "b": np.zeros((0, 4), np.int32), "c": np.zeros((), np.float64),
              "d": np.zeros(5000, np.uint8)}
    index = plan_layout(7, arrays, {"lr": 0.5})
    offsets = {a.name: a.offset for a in index.arrays}
    assert all(o % ALIGN == 0 for o in offsets.values())
    assert [a.nbytes for a in index.arrays] == [12, 0, 8, 5000]
    assert index.data_bytes >= offsets["d"] + 5000
    assert SnapshotIndex.from_json(index.to_json()) == index


def test_layout_rejects_bad_input() -> None:
    with pytest.raises(TypeError, match="not JSON serializable"):
        plan_layout(1, {"a": np.zeros(2)}, {"bad": object()})
    with pytest.raises(TypeError, match="non-empty strings"):
        plan_layout(1, {"": np.zeros(2)}, {})


def test_index_rejects_inconsistent_json() -> None:
    good = plan_layout(1, {"a": np.zeros(4, np.float32)}, {}).to_json()
    bad_format = dict(good, format="something/9")
    with pytest.raises(ValueError, match="unknown format"):
        SnapshotIndex.from_json(bad_format)
    bad_size = dict(good, arrays=[dict(good["arrays"][0], nbytes=3)])
    with pytest.raises(ValueError, match="does not match"):
        SnapshotIndex.from_json(bad_size)


def test_index_checksum_covers_the_meta() -> None:
    meta = {"data": {"epoch": 0, "position": 40}, "config": {"model": {"n_heads": 2}}}
    good = plan_layout(7, {"a": np.zeros(4, np.float32)}, meta).with_checksums([123]).to_json()
    assert SnapshotIndex.from_json(json.loads(json.dumps(good))).meta == meta  # a JSON round trip keeps it valid
    for edit in (lambda o: o["meta"]["data"].update(position=41), lambda o: o.update(step=8),
                 lambda o: o["arrays"][0].update(xxh3_64=124)):
        edited = json.loads(json.dumps(good))
        edit(edited)
        with pytest.raises(ValueError, match="index checksum mismatch"):
            SnapshotIndex.from_json(edited)
    legacy = {k: v for k, v in good.items() if k != "index_xxh3_64"} | {"format": "angel_jax.snapshot/2"}
    assert SnapshotIndex.from_json(legacy).step == 7  # written before indexes had a checksum: still read


def test_options_validate_and_coerce(tmp_path: Path) -> None:
    opts = CheckpointOptions(persistent_dir=str(tmp_path / "p"), peer_dir=str(tmp_path / "peer"))
    assert opts.persistent_dir == tmp_path / "p" and isinstance(opts.peer_dir, Path)
    with pytest.raises(ValueError, match="keep_last"):
        CheckpointOptions(persistent_dir=tmp_path, keep_last=0)
    with pytest.raises(ValueError, match="keep_every"):
        CheckpointOptions(persistent_dir=tmp_path, keep_every=0)
    with pytest.raises(TypeError, match="persistent_dir"):
        CheckpointOptions(persistent_dir=3)  # type: ignore[arg-type]


def test_default_memory_dir_is_stable_and_constructor_has_no_side_effects(tmp_path: Path) -> None:
    opts = CheckpointOptions(persistent_dir=tmp_path / "run" / "ckpt")
    mem = opts.resolved_memory_dir()
    # A restarted process must find its predecessor's snapshots: same persistent_dir, same memory dir.
    assert mem == CheckpointOptions(persistent_dir=tmp_path / "run" / "ckpt").resolved_memory_dir()
    assert mem != CheckpointOptions(persistent_dir=tmp_path / "other" / "ckpt").resolved_memory_dir()
    if os.path.isdir("/dev/shm"):
        assert mem.is_relative_to(f"/dev/shm/angel_jax-{os.getuid()}")
    engine = CheckpointManager(opts)
    assert not mem.exists() and not (tmp_path / "run").exists()
    engine.close()
    assert not mem.exists() and not (tmp_path / "run").exists()
