"""DiskTier: pages in tensorstore zarr3 arrays on a local directory, one chunk (one file) per page.

Layout on disk: the tier owns `<directory>/<subdir>` (default `angel_jax_pages`), which `open()` recreates empty
(it is scratch space: nothing in it outlives the process; checkpoints are `checkpoint/`'s business). Inside, one
zarr3 array per (dtype, page length), `<dtype>x<length>.zarr`, of shape [MAX_PAGES, length] with chunk shape
[1, length]: row = global page id, chunk file `c.<page id>.0`.

Codecs (explicit): `bytes` only, little-endian, no compression: model state compresses poorly, and every codec
costs CPU time per byte that the disk then waits for. That includes zarr3's own `crc32c` codec: in tensorstore
0.1.86 it streams each chunk through an extra buffer, and measured while building this tier (1 GiB in 64 MiB
pages, 2-vCPU VM) it took ~2.4 CPU-s per GiB read against ~1.0 without it and about halved read bandwidth. So
the checksum is kept beside the chunk instead:

Checksums: every page written gets an XXH3-64 digest of its bytes (xxhash), computed on a worker thread while
tensorstore writes the chunk, and kept in the tier's checksum table (the tier is scratch space recreated by
`open()`, so the table lives exactly as long as the files it describes). Every read recomputes it and raises
`PageCorrupted` naming the page and the chunk file on a mismatch (a flipped byte anywhere in the file). XXH3, not
zlib's CRC-32: the digest is CPU time on every page in and out, which a 2-core machine takes from the step's
compute; measured on the 2-core VM, 0.07 CPU-s per GB against CRC-32's 0.46 (a third of the tier's whole CPU cost
per byte written, two thirds per byte read). A missing chunk file is an error too (`fill_missing_data_reads=False`),
never silently zeros. Chunk files are written atomically (temporary file + rename) and fsync'ed (`file_io_sync`).

I/O is asynchronous: `write` and `read` return `concurrent.futures.Future`s. The I/O runs in tensorstore's thread
pools, sized by `file_io_concurrency` (parallel file reads/writes) and `data_copy_concurrency` (encode/decode
copies); checksums and the futures' completion run on `checksum_workers` threads (xxhash releases the GIL). A
future is never completed on a tensorstore thread: its callbacks (the page store's bookkeeping) take locks, and a
tensorstore thread blocked on a lock whose holder waits for tensorstore (opening the array of a new page shape
under the store's lock) deadlocked the process (`tests/test_memory_disk.py`). The tensorstore cache is disabled (the
store decides what is cached where). `io_mode` says how a page's bytes move:
- "unbuffered": with O_DIRECT, between the page's buffer and the disk, on the tier's own `file_io_concurrency`
  threads (angel_jax/memory/direct_io.py): no copy through the page cache, 0.10 / 0.08 CPU-s per GB written /
  read against 0.97 / 0.60 in "memmap" mode, measured on a 2-core VM, where the disk path's CPU time is taken from
  the step's compute. The chunk files and the arrays' metadata are tensorstore's, as in the other modes.
- "auto" (default): "unbuffered" where the directory takes O_DIRECT (probed when the tier opens), else "memmap".
- tensorstore's own `file_io_mode`s: "memmap" (reads map the chunk file and copy once, straight into the
  destination; 1.5x the read bandwidth of "default", which reads into a fresh buffer and copies again), "default"
  (pread) or "direct" (O_DIRECT reads). Writes are buffered writes + fsync in these modes.

Accounting is in bytes of chunk files: a page costs exactly its bytes, what `os.stat` reports for its file; the
per-array `zarr.json` metadata (< 1 KiB each) is not charged. The budget caps the sum.
"""

from __future__ import annotations

import concurrent.futures as cf
import errno
import itertools
import os
import shutil
import threading
import warnings
from typing import Callable

import numpy as np
import tensorstore as ts
import xxhash

from angel_jax.memory import direct_io
from angel_jax.memory.errors import DiskTierError, PageCorrupted, PageStoreError
from angel_jax.memory.tiers import Tier

MAX_PAGES = 2**31 - 1
IO_MODES = ("auto", "unbuffered", "memmap", "default", "direct")
TENSORSTORE_MODES = ("memmap", "default", "direct")
"""The modes in which tensorstore moves the bytes (its `file_io_mode`)."""


def _reason(msg: str) -> str:
    """A short human reason for a tensorstore/OS error message."""
    low = msg.lower()
    if "no space left" in low or "os_error_code='28'" in low:
        return "the file system is full (no space left on device)"
    if "read-only file system" in low or "os_error_code='30'" in low:
        return "the file system is read-only"
    if "permission denied" in low or "os_error_code='13'" in low:
        return "permission denied"
    if "file too large" in low or "os_error_code='27'" in low:
        return "file too large (file size limit, e.g. RLIMIT_FSIZE)"
    return "I/O error"


def resolve_io_mode(io_mode: str, directory: str) -> str:
    """The mode a tier in `directory` uses for `io_mode`: "auto" is "unbuffered" where the directory takes
    O_DIRECT writes, else "memmap"; any other mode is itself."""
    if io_mode != "auto":
        return io_mode
    return "unbuffered" if direct_io.supported(directory) else "memmap"


PAGES_SUBDIR = "angel_jax_pages"
"""The disk tier's directory inside memory.disk_dir (a process of a multi-process job appends `.process_<p>`)."""
REAP_DIR = ".reap"
"""Where a freed chunk file waits, renamed, for the tier's reaper thread to delete it (`DiskTier._remove_file`)."""


class DiskTier(Tier):
    """Pages on local disk through tensorstore zarr3. Construction touches nothing; `open()` (called by the first
    write) checks the directory and prepares the tier's subdirectory."""

    def __init__(self, directory: str | os.PathLike, budget: int | None = None, *, name: str = "disk",
                 subdir: str = PAGES_SUBDIR, file_io_concurrency: int = 8, data_copy_concurrency: int = 2,
                 checksum_workers: int = 2, io_mode: str = "auto", sync: bool = True):
        if io_mode not in IO_MODES:
            raise ValueError(f"io_mode must be one of {IO_MODES}, got {io_mode!r}")
        super().__init__(name, budget)
        self.directory = os.path.abspath(os.fspath(directory))
        self.root = os.path.join(self.directory, subdir)
        self.context_spec = {
            "data_copy_concurrency": {"limit": data_copy_concurrency},
            "file_io_concurrency": {"limit": file_io_concurrency},
            "file_io_sync": sync,
            "file_io_mode": {"mode": io_mode if io_mode in TENSORSTORE_MODES else "memmap"},
            "cache_pool": {"total_bytes_limit": 0},
        }
        self.requested_io_mode = io_mode
        self.io_mode = io_mode
        """The mode in use: `requested_io_mode`, "auto" resolved when the tier opens."""
        self._file_io_concurrency = file_io_concurrency
        self._sync = sync
        self._io: cf.ThreadPoolExecutor | None = None
        self._context: ts.Context | None = None
        self._arrays: dict[tuple[str, int], ts.TensorStore] = {}
        self._key_of: dict[int, tuple[str, int]] = {}
        self._digests: dict[int, cf.Future] = {}
        self.unremoved_files: list[str] = []
        self._checksum_workers = checksum_workers
        self._pool: cf.ThreadPoolExecutor | None = None
        self._reaper: cf.ThreadPoolExecutor | None = None
        self._reaped = itertools.count()
        self._open_lock = threading.Lock()

    # --- set-up ---------------------------------------------------------------------------------------------------
    def open(self) -> None:
        """Check the directory (exists, writable, not full) and recreate the tier's subdirectory. Idempotent."""
        with self._open_lock:
            if self._context is not None:
                return
            d = self.directory
            if not os.path.exists(d):
                raise DiskTierError(f"disk tier directory {d} does not exist (the tier does not create it, so a "
                                    "mistyped path fails here instead of filling another disk)")
            if not os.path.isdir(d):
                raise DiskTierError(f"disk tier directory {d} is not a directory")
            self._probe(d)
            try:
                if os.path.lexists(self.root):
                    shutil.rmtree(self.root)
                os.mkdir(self.root)
                os.mkdir(os.path.join(self.root, REAP_DIR))
            except OSError as e:
                raise DiskTierError(f"disk tier directory {d}: cannot create {self.root}: "
                                    f"{_reason(str(e))} ({e})") from e
            if self.requested_io_mode == "unbuffered" and not direct_io.supported(self.root):
                raise DiskTierError(f"disk tier directory {d} does not take O_DIRECT writes (io_mode 'unbuffered'; "
                                    "tmpfs and some network file systems refuse them): use io_mode 'auto' or "
                                    "'memmap'")
            self.io_mode = resolve_io_mode(self.requested_io_mode, self.root)
            self._context = ts.Context(self.context_spec)
            self._pool = cf.ThreadPoolExecutor(self._checksum_workers, thread_name_prefix="angel_jax-disk-digest")
            self._reaper = cf.ThreadPoolExecutor(1, thread_name_prefix="angel_jax-disk-reap")
            if self.io_mode == "unbuffered":
                self._io = cf.ThreadPoolExecutor(self._file_io_concurrency, thread_name_prefix="angel_jax-disk-io")

    def _probe(self, d: str) -> None:
        """Write, fsync and remove a 4 KiB file: read-only mounts, missing permissions and full disks show up
        here (os.access would not: it says yes to root on a read-only mount)."""
        probe = os.path.join(d, f".angel_jax_probe.{os.getpid()}.{threading.get_ident()}")
        try:
            fd = os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            try:
                os.write(fd, b"\0" * 4096)
                os.fsync(fd)
            finally:
                os.close(fd)
                os.unlink(probe)
        except OSError as e:
            why = {errno.EROFS: "is on a read-only file system", errno.EACCES: "is not writable (permission denied)",
                   errno.EPERM: "is not writable (operation not permitted)",
                   errno.ENOSPC: "is full (no space left on device)", errno.EDQUOT: "is over its disk quota",
                   errno.EFBIG: "refuses writes (file too large: file size limit)"}.get(e.errno, "is not usable")
            raise DiskTierError(f"disk tier directory {d} {why}: {e}") from e

    def _array(self, dtype: np.dtype, length: int) -> ts.TensorStore:
        key = (dtype.name, length)
        with self._open_lock:
            arr = self._arrays.get(key)
            if arr is not None:
                return arr
        path = os.path.join(self.root, f"{dtype.name}x{length}.zarr")
        spec = {
            "driver": "zarr3",
            "kvstore": {"driver": "file", "path": path},
            "metadata": {
                "shape": [MAX_PAGES, length],
                "chunk_grid": {"name": "regular", "configuration": {"chunk_shape": [1, length]}},
                "chunk_key_encoding": {"name": "default", "configuration": {"separator": "."}},
                "data_type": _zarr_dtype(dtype),
                "fill_value": _fill(dtype),
                "codecs": [{"name": "bytes", "configuration": {"endian": "little"}}],
            },
            "fill_missing_data_reads": False,
            "store_data_equal_to_fill_value": True,  # an all-zero page (fresh optimizer state) is a page too
            "create": True,
            "open": True,
        }
        try:
            arr = ts.open(spec, context=self._context).result()
        except ValueError as e:
            raise DiskTierError(f"disk tier: cannot create array {path}: {_reason(str(e))} ({e})") from e
        with self._open_lock:
            return self._arrays.setdefault(key, arr)

    def chunk_path(self, page_id: int) -> str:
        """The file holding the page."""
        key = self._key_of.get(page_id)
        if key is None:
            raise PageStoreError(f"tier {self.name!r} does not hold page {page_id}")
        return os.path.join(self.root, f"{key[0]}x{key[1]}.zarr", f"c.{page_id}.0")

    # --- data -----------------------------------------------------------------------------------------------------
    def page_bytes(self, nbytes: int) -> int:
        """What a page of `nbytes` costs on this tier (its chunk file size)."""
        return nbytes

    def write(self, page_id: int, data: np.ndarray, reserved: bool = False) -> cf.Future:
        """Start writing a page (a 1-D numpy array the caller leaves untouched until the future completes).
        Refused at once (BudgetExceeded / DiskTierError) if over budget or the directory is unusable; an I/O
        failure completes the future with DiskTierError and leaves the tier as it was. `reserved`: the caller
        already reserved `page_bytes(data.nbytes)` for the page."""
        self.open()
        data = np.ascontiguousarray(data)
        if data.ndim != 1:
            raise PageStoreError(f"page {page_id}: pages are 1-D, got shape {data.shape}")
        arr = self._array(data.dtype, data.shape[0])
        if not reserved:
            self.reserve(page_id, self.page_bytes(data.nbytes))
        with self._lock:
            self._key_of[page_id] = (data.dtype.name, data.shape[0])
        path = self.chunk_path(page_id)
        try:
            if self._io is not None:
                commit = self._io.submit(direct_io.write_file, path, data, self._sync)
            else:  # the source is never modified while referenced: tensorstore may encode straight from it
                commit = arr[page_id].write(data, can_reference_source_data_indefinitely=True).commit
        except Exception as e:
            self._forget(page_id)
            raise DiskTierError(f"disk tier: writing page {page_id} to {path} failed: {e}") from e
        digest = self._pool.submit(_digest, data)
        with self._lock:
            self._digests[page_id] = digest
        out: cf.Future = cf.Future()
        left = [2]
        nbytes = data.nbytes  # `done` must not reference `data`: the checksum future, kept until the page is
        # freed, keeps its callbacks, and through them the page's bytes would stay in memory

        def done(_: object) -> None:
            with self._lock:
                left[0] -= 1
                if left[0]:
                    return
            self._complete(finish)

        def finish() -> None:
            try:
                commit.result()
                digest.result()
            except Exception as e:  # noqa: BLE001 - any failure of the write
                if os.path.lexists(path):  # a failed write leaves no chunk (atomic rename); make sure
                    self._remove_file(path)
                self._forget(page_id)  # before waking the waiter: it sees the tier as it was
                out.set_exception(DiskTierError(
                    f"disk tier: writing page {page_id} to {path} failed: {_reason(str(e))}"
                    f"{self._room(str(e), nbytes)} ({e})"))
            else:
                out.set_result(None)

        commit.add_done_callback(done)
        digest.add_done_callback(done)
        return out

    def _complete(self, fn: Callable[[], None]) -> None:
        """Run `fn` (which completes a future, and so runs its callbacks) on a checksum worker, off the tensorstore
        thread that calls this; on the calling thread only once the tier is closed (no workers left)."""
        pool = self._pool
        if pool is not None:
            try:
                pool.submit(fn)
                return
            except RuntimeError:  # shut down meanwhile
                pass
        fn()

    def _room(self, msg: str, nbytes: int) -> str:
        """For a full file system: how many bytes the page needed and how many its directory had free, so the
        user knows how much room to make (another process may have filled the disk since the plan was made)."""
        if not _reason(msg).startswith("the file system is full"):
            return ""
        try:
            free = shutil.disk_usage(self.root).free
        except OSError:
            return f"; the page needs {nbytes:,} B"
        return f"; the page needs {nbytes:,} B, {free:,} B are free in {self.root}"

    def read(self, page_id: int, into: np.ndarray | None = None) -> cf.Future:
        """Start reading a page; the future gives a 1-D numpy array (`into`, if given: a writable contiguous
        buffer of the page's dtype and length, which spares an allocation per read), or raises PageCorrupted
        (checksum mismatch or missing chunk file, naming both) or DiskTierError."""
        path = self.chunk_path(page_id)
        with self._lock:
            dtype_name, length = self._key_of[page_id]
            expected = self._digests[page_id]
        arr = self._array(np.dtype(dtype_name), length)
        if into is not None and (into.shape != (length,) or into.dtype.name != dtype_name
                                 or not into.flags.c_contiguous or not into.flags.writeable):
            raise PageStoreError(f"page {page_id}: read buffer must be a writable contiguous "
                                 f"{dtype_name}[{length}], got {into.dtype}{list(into.shape)}")
        out: cf.Future = cf.Future()

        def verify(data: np.ndarray) -> None:
            try:
                want, got = expected.result(), _digest(data)
            except Exception as e:  # noqa: BLE001
                out.set_exception(DiskTierError(f"disk tier: checksum of page {page_id} unavailable: {e}"))
                return
            if got != want:
                out.set_exception(PageCorrupted(
                    f"page {page_id} is corrupted on disk: XXH3-64 of {path} is {got:#018x}, "
                    f"{want:#018x} was written"))
            else:
                out.set_result(data)

        def done(f: ts.Future) -> None:
            self._complete(lambda: settle(f))

        def settle(f: ts.Future | cf.Future) -> None:
            try:
                data = f.result() if into is None else (f.result(), into)[1]
            except Exception as e:  # noqa: BLE001
                msg = str(e)
                if isinstance(e, direct_io.WrongSize):
                    out.set_exception(PageCorrupted(f"page {page_id} is corrupted on disk: {e}"))
                elif isinstance(e, FileNotFoundError) or msg.startswith("NOT_FOUND"):
                    out.set_exception(PageCorrupted(f"page {page_id} is lost: its chunk file {path} is missing"))
                else:
                    out.set_exception(DiskTierError(f"disk tier: reading page {page_id} from {path} failed: "
                                                    f"{_reason(msg)} ({e})"))
                return
            verify(data)

        if self._io is not None:
            dst = into if into is not None else direct_io.aligned_empty(length, np.dtype(dtype_name))
            self._io.submit(direct_io.read_file, path, dst).add_done_callback(done)
        elif into is None:
            arr[page_id].read().add_done_callback(done)
        else:
            ts.array(into, copy=False, write=True).write(arr[page_id]).commit.add_done_callback(done)
        return out

    def put(self, page_id: int, src: np.ndarray, reserved: bool = False) -> cf.Future:
        """`Tier` interface: `write`."""
        return self.write(page_id, np.asarray(src), reserved)

    def get(self, page_id: int) -> cf.Future:
        """`Tier` interface: `read`."""
        return self.read(page_id)

    def free(self, page_id: int) -> None:
        """Delete the page's chunk file (or drop a reservation that never got one)."""
        if page_id not in self._key_of:
            self.release(page_id)
            return
        self._remove_file(self.chunk_path(page_id))
        self._forget(page_id)

    def file_bytes(self) -> int:
        """Bytes of chunk files actually on disk (what `bytes_used` must equal once writes have completed)."""
        total = 0
        for dirpath, _, files in os.walk(self.root):
            total += sum(os.path.getsize(os.path.join(dirpath, f)) for f in files if f.startswith("c."))
        return total

    def close(self, remove: bool = True) -> None:
        """Forget every page; with `remove`, delete the tier's subdirectory."""
        with self._open_lock:
            self._arrays.clear()
            self._context = None
            pool, self._pool = self._pool, None
            io, self._io = self._io, None
            reaper, self._reaper = self._reaper, None
        for executor in (io, reaper):
            if executor is not None:
                executor.shutdown(wait=True)
        if pool is not None:
            pool.shutdown(wait=True)
        with self._lock:
            for pid in list(self._key_of):
                self._forget(pid)
        if remove and os.path.isdir(self.root):
            shutil.rmtree(self.root, ignore_errors=True)
        if len(self.unremoved_files) > 1:
            warnings.warn(f"disk tier: {len(self.unremoved_files)} chunk files under {self.root} could not be deleted "
                          f"(the first: {self.unremoved_files[0]}); delete them by hand", RuntimeWarning, stacklevel=2)

    def _forget(self, page_id: int) -> None:
        with self._lock:
            self._key_of.pop(page_id, None)
            self._digests.pop(page_id, None)
            self.release(page_id)

    def _remove_file(self, path: str) -> None:
        """Delete a chunk file. The caller (the page store, under its lock, often on the thread that runs the
        updates) waits only for a rename into the tier's reap directory: unlinking a large file frees its extents
        in the file system's journal, 30-90 ms for a 48 MiB chunk on ext4 while O_DIRECT writes and fsyncs run
        (measured), and that is done by the tier's reaper thread. The page's bytes leave the budget at once; the
        disk's space follows when the reaper gets to it (it deletes one file at a time, in order). A file that
        cannot be deleted (the file system turned read-only) is listed in `unremoved_files` instead of raising:
        its page is gone from the tier either way."""
        if not os.path.lexists(path):  # (unlink of a missing file on a read-only mount says EROFS, not ENOENT)
            return
        reaper = self._reaper
        if reaper is not None:
            doomed = os.path.join(self.root, REAP_DIR, f"r.{next(self._reaped)}")
            try:
                os.rename(path, doomed)  # metadata only: the old name is free for the page's next version at once
            except FileNotFoundError:
                return
            except OSError as e:
                self._unremovable(path, e)
                return
            try:
                reaper.submit(self._unlink, doomed)
                return
            except RuntimeError:  # (closing meanwhile: delete it here)
                path = doomed
        self._unlink(path)

    def _unlink(self, path: str) -> None:
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass
        except OSError as e:
            self._unremovable(path, e)

    def _unremovable(self, path: str, e: OSError) -> None:
        with self._lock:
            self.unremoved_files.append(path)
            first = len(self.unremoved_files) == 1
        if first:  # the cause once, not once per chunk (a tier made immutable mid-run fails every delete)
            warnings.warn(f"disk tier: could not delete {path}: {e}; the chunk files it cannot delete from now "
                          f"on are counted, not warned about one by one (the count when the tier closes)",
                          RuntimeWarning, stacklevel=3)


def _digest(data: np.ndarray) -> int:
    return xxhash.xxh3_64_intdigest(data.reshape(-1).view(np.uint8))


def _zarr_dtype(dtype: np.dtype) -> str:
    name = dtype.name
    return {"bool": "bool"}.get(name, name)


def _fill(dtype: np.dtype):
    if dtype == np.bool_:
        return False
    if np.issubdtype(dtype, np.integer):
        return 0
    return 0.0
