"""The disk tier's O_DIRECT path (angel_jax/memory/direct_io.py, DiskTier io_mode "unbuffered"): exact bytes for
aligned and unaligned buffers and lengths, files tensorstore reads as its own chunks, damaged and missing files
named, failed writes leaving nothing, and the fallback where a directory refuses O_DIRECT."""

from __future__ import annotations

import os

import numpy as np
import pytest

from angel_jax.memory import direct_io
from angel_jax.memory.direct_io import ALIGN, BOUNCE, WrongSize, aligned_empty, read_file, write_file
from angel_jax.memory.disk_tier import DiskTier
from angel_jax.memory.errors import DiskTierError, PageCorrupted

pytestmark = pytest.mark.skipif(not hasattr(os, "O_DIRECT"), reason="no O_DIRECT on this platform")


@pytest.fixture
def direct_dir(tmp_path):
    if not direct_io.supported(str(tmp_path)):
        pytest.skip(f"{tmp_path} does not take O_DIRECT writes")
    return tmp_path


def unaligned(n_bytes: int, seed: int) -> np.ndarray:
    """A uint8 array of `n_bytes` random bytes whose data does not start on an ALIGN boundary."""
    raw = aligned_empty(n_bytes + 64, np.uint8)
    out = raw[16: 16 + n_bytes]
    out[:] = np.random.default_rng(seed).integers(0, 256, n_bytes, dtype=np.uint8)
    assert not direct_io.is_aligned(out)
    return out


# Lengths: under one block, exactly one, a bounce buffer and a bit (several bounce rounds and a tail), a tail of 1.
SIZES = [1, 100, ALIGN, ALIGN + 1, 3 * ALIGN - 1, BOUNCE + ALIGN + 7, 2 * BOUNCE + 1]


@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("src_aligned", [True, False])
@pytest.mark.parametrize("dst_aligned", [True, False])
def test_round_trip_is_exact(direct_dir, n, src_aligned, dst_aligned):
    src = unaligned(n, n)
    if src_aligned:
        a = aligned_empty(n, np.uint8)
        a[:] = src
        src = a
    path = str(direct_dir / "c.0.0")
    write_file(path, src)
    assert os.path.getsize(path) == n  # exactly the page: no padding to the block size
    dst = aligned_empty(n, np.uint8) if dst_aligned else unaligned(n, n + 1)
    assert read_file(path, dst) is dst
    np.testing.assert_array_equal(dst, src)
    assert not [f for f in os.listdir(direct_dir) if f.endswith(".tmp")]


def test_write_replaces_a_file_whole(direct_dir):
    path = str(direct_dir / "c.1.0")
    write_file(path, np.arange(3 * ALIGN, dtype=np.uint8))
    small = np.full(ALIGN // 2, 7, np.uint8)
    write_file(path, small)
    assert os.path.getsize(path) == small.nbytes
    np.testing.assert_array_equal(np.fromfile(path, np.uint8), small)


def test_wrong_size_and_missing_file_are_named(direct_dir):
    path = direct_dir / "c.2.0"
    write_file(str(path), np.ones(2 * ALIGN, np.uint8))
    os.truncate(path, ALIGN + 3)
    with pytest.raises(WrongSize, match=rf"{path} holds 4,099 B, 8,192 B were written"):
        read_file(str(path), aligned_empty(2 * ALIGN, np.uint8))
    with pytest.raises(FileNotFoundError):
        read_file(str(direct_dir / "c.3.0"), aligned_empty(ALIGN, np.uint8))
    with pytest.raises(ValueError, match="contiguous"):
        read_file(str(path), aligned_empty(4 * ALIGN, np.uint8)[::2])


def test_failed_write_leaves_no_file(direct_dir, monkeypatch):
    """A write that fails half-way (here: the disk fills after the first block) leaves neither the chunk file
    nor its temporary file; the chunk written before is intact."""
    path = str(direct_dir / "c.4.0")
    before = np.arange(2 * ALIGN, dtype=np.uint8)
    write_file(path, before)
    real = os.pwrite
    calls = []

    def fill_up(fd, data, offset):
        calls.append(offset)
        if len(calls) > 1:
            raise OSError(28, "No space left on device")
        return real(fd, data[:ALIGN], offset)

    monkeypatch.setattr(direct_io.os, "pwrite", fill_up)
    with pytest.raises(OSError, match="No space left"):
        write_file(path, np.zeros(4 * ALIGN, np.uint8))
    monkeypatch.undo()
    assert sorted(os.listdir(direct_dir)) == ["c.4.0"]
    np.testing.assert_array_equal(np.fromfile(path, np.uint8), before)


def pages(n: int) -> list[np.ndarray]:
    rng = np.random.default_rng(3)
    return [rng.standard_normal(ALIGN // 4 * k + k, dtype=np.float32) for k in range(1, n + 1)]


def test_tier_unbuffered_pages_are_tensorstore_chunks(direct_dir):
    tier = DiskTier(direct_dir, io_mode="auto")
    tier.open()
    assert tier.io_mode == "unbuffered"
    data = pages(4)
    for i, page in enumerate(data):
        tier.write(i, page).result()
    for i, page in enumerate(data):
        np.testing.assert_array_equal(tier.read(i).result(), page)
        into = aligned_empty(page.shape[0], np.float32)
        assert tier.read(i, into=into).result() is into
        np.testing.assert_array_equal(into, page)
        # tensorstore reads the same file as a chunk of the tier's zarr3 array
        np.testing.assert_array_equal(tier._array(page.dtype, page.shape[0])[i].read().result(), page)
    assert tier.file_bytes() == sum(p.nbytes for p in data) == tier.bytes_used
    tier.close()


def test_tier_unbuffered_damage_is_named(direct_dir):
    tier = DiskTier(direct_dir, io_mode="unbuffered")
    page = pages(1)[0]
    tier.write(0, page).result()
    tier.write(1, page).result()
    path0, path1 = tier.chunk_path(0), tier.chunk_path(1)
    with open(path0, "r+b") as f:  # one bit flipped
        f.seek(100)
        b = f.read(1)
        f.seek(100)
        f.write(bytes([b[0] ^ 1]))
    with pytest.raises(PageCorrupted, match=rf"page 0 is corrupted on disk: XXH3-64 of {path0}"):
        tier.read(0).result()
    os.truncate(path1, 10)
    with pytest.raises(PageCorrupted, match=rf"page 1 is corrupted on disk: {path1} holds 10 B"):
        tier.read(1).result()
    os.unlink(path1)
    with pytest.raises(PageCorrupted, match=rf"page 1 is lost: its chunk file {path1} is missing"):
        tier.read(1).result()
    tier.close()


def test_tier_falls_back_where_o_direct_is_refused(tmp_path, monkeypatch):
    """A directory that refuses O_DIRECT (tmpfs on older kernels, some network file systems): "auto" moves the
    bytes through tensorstore instead; "unbuffered" asked for explicitly is refused in one line."""
    monkeypatch.setattr(direct_io, "supported", lambda directory: False)
    tier = DiskTier(tmp_path, io_mode="auto")
    page = pages(1)[0]
    tier.write(0, page).result()
    assert tier.io_mode == "memmap"
    np.testing.assert_array_equal(tier.read(0).result(), page)
    tier.close()
    other = tmp_path / "other"
    other.mkdir()
    with pytest.raises(DiskTierError, match="does not take O_DIRECT writes .*use io_mode 'auto' or 'memmap'"):
        DiskTier(other, io_mode="unbuffered").open()
