"""DiskTier and the store's disk failures: bit-exact round trips, checksums that catch a flipped byte, and clear
errors for a missing, read-only or full directory that leave every other tier as it was.

Full and read-only file systems are real: a small tmpfs mounted for the test (we run as root in the CI
container). Where mounting is not permitted those tests skip, and the file-size-limit test still produces a real
failing write() at the file-system call (RLIMIT_FSIZE -> EFBIG, in a subprocess); read-only is then covered with
chmod when not root.
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import textwrap
import time

import jax
import numpy as np
import pytest

from angel_jax.memory import (BudgetExceeded, DeviceTier, DiskTier, DiskTierError, HostTier, PageCorrupted,
                              PageStore)


@contextlib.contextmanager
def tmpfs(path: str, size: str, read_only: bool = False):
    os.makedirs(path, exist_ok=True)
    opts = f"size={size}" + (",ro" if read_only else "")
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", opts, "tmpfs", path], capture_output=True, text=True)
    if r.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {r.stderr.strip()}")
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", path], capture_output=True)


def page(seed: int, n: int = 4096, dtype=np.float32) -> np.ndarray:
    """Arbitrary bit patterns, NaN payloads included."""
    return np.frombuffer(np.random.default_rng(seed).bytes(n * np.dtype(dtype).itemsize), dtype).copy()


def same_bits(a, b) -> bool:
    return np.asarray(a).tobytes() == np.asarray(b).tobytes() and np.asarray(a).dtype == np.asarray(b).dtype


# --- the tier ---------------------------------------------------------------------------------------------------
def test_round_trip_accounting_and_layout_on_disk(tmp_path):
    tier = DiskTier(tmp_path)
    assert not os.path.exists(tier.root)  # construction touches nothing
    pages = {i: page(i, 1000 + 24 * i, dt) for i, dt in enumerate([np.float32, np.int8, np.float32, np.uint16])}
    futures = [tier.write(i, p) for i, p in pages.items()]  # all in flight at once
    for f in futures:
        assert f.result() is None
    assert tier.bytes_used == sum(p.nbytes for p in pages.values()) == tier.file_bytes()
    reads = {i: tier.read(i) for i in pages}
    for i, f in reads.items():
        assert same_bits(f.result(), pages[i])
    buf = np.empty_like(pages[2])
    assert tier.read(2, into=buf).result() is buf and same_bits(buf, pages[2])
    assert tier.chunk_path(2).endswith(os.path.join("float32x1048.zarr", "c.2.0"))
    zarr_json = json.load(open(os.path.join(os.path.dirname(tier.chunk_path(2)), "zarr.json")))
    assert zarr_json["codecs"] == [{"name": "bytes", "configuration": {"endian": "little"}}]
    assert zarr_json["chunk_grid"]["configuration"]["chunk_shape"] == [1, 1048]
    tier.free(1)
    assert not tier.holds(1) and tier.bytes_used == tier.file_bytes()
    tier.close()
    assert not os.path.exists(tier.root) and tier.bytes_used == 0


def test_all_zero_page_is_stored(tmp_path):
    """zarr skips chunks equal to the fill value by default; a page of zeros must still get its file."""
    tier = DiskTier(tmp_path)
    tier.write(0, np.zeros(1024, np.float32)).result()
    assert os.path.getsize(tier.chunk_path(0)) == 4096 == tier.bytes_used
    assert same_bits(tier.read(0).result(), np.zeros(1024, np.float32))
    tier.close()


@pytest.mark.parametrize("where", ["first", "middle", "last"])
def test_flipped_byte_on_disk_is_detected_and_names_the_page(tmp_path, where):
    tier = DiskTier(tmp_path)
    data = page(3)
    tier.write(7, data).result()
    path = tier.chunk_path(7)
    size = os.path.getsize(path)
    offset = {"first": 0, "middle": size // 2, "last": size - 1}[where]
    with open(path, "r+b") as f:
        f.seek(offset)
        byte = f.read(1)
        f.seek(offset)
        f.write(bytes([byte[0] ^ 0x10]))
    with pytest.raises(PageCorrupted, match=rf"page 7 is corrupted on disk: XXH3-64 of {path} is"):
        tier.read(7).result()
    with open(path, "r+b") as f:  # restore it: the page reads back fine again
        f.seek(offset)
        f.write(byte)
    assert same_bits(tier.read(7).result(), data)
    os.unlink(path)
    with pytest.raises(PageCorrupted, match=rf"page 7 is lost: its chunk file {path} is missing"):
        tier.read(7).result()
    tier.close()


def test_budget_refuses_before_writing(tmp_path):
    tier = DiskTier(tmp_path, budget=2 * 16384)
    tier.write(0, page(0)).result()
    tier.write(1, page(1)).result()
    with pytest.raises(BudgetExceeded, match=r"tier 'disk': page 2 \(16384 B\) does not fit"):
        tier.write(2, page(2))
    assert not tier.holds(2) and tier.file_bytes() == 2 * 16384
    tier.close()


def test_missing_directory_and_not_a_directory(tmp_path):
    missing = tmp_path / "nope"
    with pytest.raises(DiskTierError, match=rf"disk tier directory {missing} does not exist"):
        DiskTier(missing).write(0, page(0))
    afile = tmp_path / "file"
    afile.write_text("x")
    with pytest.raises(DiskTierError, match="is not a directory"):
        DiskTier(afile).open()
    assert not missing.exists()  # the tier never creates the directory it was given


def test_read_only_directory(tmp_path):
    if os.geteuid() != 0:
        os.chmod(tmp_path, 0o555)
        with pytest.raises(DiskTierError, match=r"is not writable \(permission denied\)"):
            DiskTier(tmp_path).open()
        return
    with tmpfs(str(tmp_path / "ro"), "1m", read_only=True) as d:
        with pytest.raises(DiskTierError, match=rf"disk tier directory {d} is on a read-only file system"):
            DiskTier(d).open()


def test_full_file_system(tmp_path):
    with tmpfs(str(tmp_path / "small"), "1m") as d:
        tier = DiskTier(d)
        written, error = [], None
        for i in range(8):  # 256 KiB pages: the 4th or 5th cannot fit in 1 MiB
            try:
                tier.write(i, page(i, 65536)).result()
                written.append(i)
            except DiskTierError as e:
                error = (i, e)
                break
        assert error is not None and 2 <= len(written) <= 4
        i, e = error
        assert f"writing page {i} to {d}" in str(e) and "the file system is full (no space left on device)" in str(e)
        assert not tier.holds(i) and tier.bytes_used == tier.file_bytes() == len(written) * 65536 * 4
        for j in written:  # what was written before is intact
            assert same_bits(tier.read(j).result(), page(j, 65536))
        tier.close()


def test_file_size_limit_gives_a_clear_error():
    """Without a mount: RLIMIT_FSIZE makes the kernel refuse the chunk file's write() with EFBIG."""
    script = textwrap.dedent("""
        import json, resource, signal, sys, tempfile
        import numpy as np
        from angel_jax.memory import DiskTier, DiskTierError
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        tier = DiskTier(tempfile.mkdtemp())
        tier.open()
        tier.write(0, np.zeros(1024, np.float32)).result()
        resource.setrlimit(resource.RLIMIT_FSIZE, (256 * 1024, resource.RLIM_INFINITY))
        try:
            tier.write(1, np.zeros(2**20, np.float32)).result()
            out = {"error": None}
        except DiskTierError as e:
            out = {"error": str(e)}
        out.update(held=tier.page_ids(), used=tier.bytes_used, files=tier.file_bytes(),
                   first_ok=bool((tier.read(0).result() == 0).all()))
        tier.close()
        print(json.dumps(out))
    """)
    r = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120,
                       env={**os.environ, "JAX_PLATFORMS": "cpu"})
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert out["error"] and "writing page 1" in out["error"] and "file too large" in out["error"]
    assert out["held"] == [0] and out["used"] == out["files"] == 4096 and out["first_ok"]


# --- the store with a failing disk tier ---------------------------------------------------------------------------
def store_with_host_pages(disk: DiskTier, n: int, length: int = 65536):
    store = PageStore(DeviceTier(), HostTier(), disk)
    values = {i: page(100 + i, length) for i in range(n)}
    for i, v in values.items():
        store.add(i, v, home="host").wait()
    store.prefetch(0, "device").wait()
    return store, values


def assert_intact(store: PageStore, values: dict, bytes_before: dict) -> None:
    assert store.bytes_used()["device"] == bytes_before["device"]
    assert store.bytes_used()["host"] == bytes_before["host"]
    for i, v in values.items():
        assert "host" in store.where(i)
        assert same_bits(store.read(i), v)
    assert same_bits(np.asarray(store.get(0)), values[0])


def test_store_missing_disk_directory_leaves_other_tiers_intact(tmp_path):
    store, values = store_with_host_pages(DiskTier(tmp_path / "missing"), 3)
    before = store.bytes_used()
    with pytest.raises(DiskTierError, match="does not exist"):
        store.evict(1, "host")
    assert store.where(1) == ("host",) and store.home(1) == "host"
    assert_intact(store, values, before)
    store.close()


def test_store_read_only_disk_leaves_other_tiers_intact(tmp_path):
    with tmpfs(str(tmp_path / "d"), "4m") as d:
        store, values = store_with_host_pages(DiskTier(d), 3)
        store.evict(2, "host").wait()  # page 2 now lives on disk
        assert store.where(2) == ("disk",)
        subprocess.run(["mount", "-o", "remount,ro", d], check=True)
        before = store.bytes_used()
        handle = store.evict(1, "host")  # the directory was fine when opened: the write itself fails
        with pytest.raises(DiskTierError, match="read-only"):
            handle.wait()
        assert store.where(1) == ("host",) and store.home(1) == "host"
        assert store.bytes_used() == before
        store.prefetch(2, "host").wait()  # reading from the read-only disk still works
        assert same_bits(store.read(2), values[2])
        subprocess.run(["mount", "-o", "remount,rw", d], check=True)
        store.close()


def test_store_full_disk_leaves_other_tiers_intact(tmp_path):
    with tmpfs(str(tmp_path / "d"), "1m") as d:
        store, values = store_with_host_pages(DiskTier(d), 6)  # 6 x 256 KiB pages, 1 MiB of disk
        before = store.bytes_used()
        handles = [store.evict(i, "host") for i in range(1, 6)]
        failed = [h for h in handles if h.exception() is not None]
        assert failed, "a 1 MiB tmpfs cannot hold 5 pages of 256 KiB"
        for h in failed:
            assert isinstance(h.exception(), DiskTierError) and "no space left on device" in str(h.exception())
            assert f"page {h.page_id}" in str(h.exception())
            assert store.where(h.page_id) == ("host",) and store.home(h.page_id) == "host"
            assert same_bits(store.read(h.page_id), values[h.page_id])
        moved = [h.page_id for h in handles if h.exception() is None]
        for i in moved:
            assert store.where(i) == ("disk",) and same_bits(store.read(i), values[i])
        assert store.bytes_used()["host"] == before["host"] - len(moved) * 65536 * 4
        assert store.bytes_used()["device"] == before["device"]
        assert store.bytes_used()["disk"] == store.tiers["disk"].file_bytes() == len(moved) * 65536 * 4
        assert len(store.wait_all()) == len(failed)
        store.close()
    jax.clear_caches()


def test_a_written_page_is_not_kept_in_memory(tmp_path):
    """Once a write completed, the disk tier keeps nothing of the page's bytes (it once kept every page written,
    through a callback its checksum future held, until the page was freed: a disk tier as large as RAM)."""
    import gc
    import weakref

    tier = DiskTier(tmp_path)
    alive = []
    futures = []
    for i in range(8):
        data = np.full(1 << 16, i, np.float32)
        alive.append(weakref.ref(data))
        futures.append(tier.write(i, data))
        del data
    for f in futures:
        f.result()
    del futures
    gc.collect()
    assert [r() is None for r in alive] == [True] * 8, "written pages are still referenced"
    out = np.empty(1 << 16, np.float32)
    assert tier.read(3, into=out).result() is out and (out == 3).all()
    tier.close()


def test_callbacks_that_wait_for_a_lock_never_stall_tensorstore(tmp_path):
    """The page store's callbacks on a disk future take its lock, and its caller holds that lock while a new page
    shape's array is opened (which waits for tensorstore). Completed on tensorstore's own threads, those callbacks
    blocked the threads the open needed: the process hung for good (once in a CI run of the suite). The tier
    completes its futures on its own workers, so the open finishes while every callback still waits."""
    import threading

    tier = DiskTier(tmp_path)
    tier.write(0, np.zeros(16, np.uint32)).result()
    held = threading.Lock()
    held.acquire()
    waiting = []
    for i in range(1, 9):
        f = tier.write(i, np.arange(16, dtype=np.uint32) + i)
        f.add_done_callback(lambda f: (held.acquire(), held.release()))
        waiting.append(f)
    time.sleep(0.5)  # the writes complete meanwhile, and their callbacks wait for `held`
    opened = threading.Event()
    result: list = []

    def open_a_new_shape() -> None:
        result.append(tier.write(100, np.zeros(8, np.uint16)))
        opened.set()

    threading.Thread(target=open_a_new_shape, daemon=True).start()
    try:
        assert opened.wait(30), "opening a new page shape waited for callbacks that wait for its caller's lock"
    finally:
        held.release()
    result[0].result(timeout=30)
    for f in waiting:
        f.result(timeout=30)
    assert np.array_equal(tier.read(5).result(timeout=30), np.arange(16, dtype=np.uint32) + 5)
    tier.close()


def test_a_tier_that_cannot_delete_warns_once_with_the_cause_then_counts(tmp_path, monkeypatch, recwarn):
    """A tier whose directory turned immutable mid-run (`chattr +i`: every unlink says EPERM) warned once per chunk
    file (574 lines before the run's last one); now once with the cause, and once with the count at close."""
    import errno

    import angel_jax.memory.disk_tier as disk_tier

    tier = DiskTier(tmp_path)
    for i in range(20):
        tier.write(i, page(i)).result()

    def unlink(path, *a, **k):
        raise PermissionError(errno.EPERM, "Operation not permitted", path)

    monkeypatch.setattr(disk_tier.os, "unlink", unlink)
    for i in range(20):
        tier.free(i)
    tier.close()
    messages = [str(w.message) for w in recwarn.list if issubclass(w.category, RuntimeWarning)]
    assert len(messages) == 2, messages
    assert "Operation not permitted" in messages[0] and "counted, not warned about one by one" in messages[0]
    assert messages[1].startswith(f"disk tier: {len(tier.unremoved_files)} chunk files") and \
        len(tier.unremoved_files) >= 20


def test_free_does_not_wait_for_the_unlink(tmp_path, monkeypatch):
    """Unlinking a large chunk file frees its extents in the file system's journal (30-90 ms for 48 MiB on ext4
    while other writes run, measured), and `free` runs under the page store's lock on the updating thread: the
    tier renames the file out of the way and its reaper thread deletes it. Here every unlink blocks until the
    test lets it go: `free` must return anyway, the page's name must be free for its next version at once, and
    closing the tier waits for the deletes."""
    import threading

    import angel_jax.memory.disk_tier as disk_tier

    tier = DiskTier(tmp_path)
    tier.write(7, page(1)).result()
    old_path = tier.chunk_path(7)
    go, unlinked, real_unlink = threading.Event(), [], os.unlink

    def slow_unlink(path, *a, **k):
        if os.path.basename(path).startswith("r."):
            assert go.wait(60)
            unlinked.append(path)
        return real_unlink(path, *a, **k)

    monkeypatch.setattr(disk_tier.os, "unlink", slow_unlink)
    freeing = threading.Thread(target=tier.free, args=(7,))
    freeing.start()
    freeing.join(10)
    assert not freeing.is_alive(), "free waited for the unlink"
    assert not os.path.exists(old_path) and not tier.holds(7) and tier.bytes_used == 0
    tier.write(7, page(2)).result()  # the same page again, while the old file still waits for its delete
    assert tier.chunk_path(7) == old_path and same_bits(tier.read(7).result(), page(2))
    assert tier.file_bytes() == tier.bytes_used == page(2).nbytes  # (the file waiting to go is not counted)
    assert unlinked == []
    go.set()
    tier.close()
    assert len(unlinked) == 1 and not os.path.exists(tier.root)
