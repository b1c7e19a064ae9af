"""`angel-jax bench io`: the data-movement bandwidths of this machine, for the scheduling pass's cost model.

Figures (GB/s = 1e9 bytes/s; `GBps` is the median of `--reps` (transfers) or `--rounds` (disk) samples,
`GBps_best` the best sample, `GBps_samples` all of them):

  host_memcpy        np.copyto between two host buffers
  h2d_pageable       DeviceTier.put(numpy page): jax.device_put to device memory (on the CPU backend of a copy:
                     the CPU client would alias the numpy buffer instead of transferring it)
  h2d_pinned         jax.device_put(host-tier page -> device memory): the DMA path the page store uses
  d2h_pinned         jax.device_put(device page -> host-tier memory)
  d2h_pageable       np.asarray(device page) (on the CPU backend, where that is a zero-copy view, np.array)
  device_copy        a jitted copy of a page within device memory (bytes copied; traffic is twice that)
  disk_tier_write    DiskTier.write of --disk-bytes in --page-bytes pages, all in flight, fsync'ed, checksummed
  disk_tier_read     DiskTier.read of the same pages into reused buffers (as the page store's staging buffers)
                     after dropping the page cache, checksums verified
  raw_direct_write   one file, sequential os.write of the same pages with O_DIRECT, then fsync
  raw_direct_read    sequential os.readv with O_DIRECT into preallocated buffers, after dropping the page cache
  raw_buffered_write the same through the page cache (plain os.write + fsync)
  raw_buffered_read  the same through the page cache (plain os.readv), after dropping the page cache

Disk figures are measured in interleaved rounds (tier, raw direct, raw buffered, rotated each round) on the same
directory, so machine noise hits them alike; `disk_tier_vs_raw` gives tier/raw for each raw method (best rounds,
medians, per round), and checks the tier's best round against the raw method of the same path: raw O_DIRECT I/O
for the tier's "unbuffered" mode (target: 80%), raw buffered I/O for its page-cache modes (target: 70%). Before
each read the files this run just wrote are evicted from the page cache with posix_fadvise(DONTNEED) (clean pages after fsync): the reads come from the disk, and nothing else of the
machine's page cache is touched. Only `--drop-caches` also drops the whole system's page cache
(/proc/sys/vm/drop_caches, where permitted: root), which every other process then pays for. The record's
`cache_drop` says which was used; the O_DIRECT figures bypass the page cache either way.

Output: one JSON line per figure on stdout (also appended to `--jsonl` if given, each with the machine), a
readable summary table on stderr at the end (the figures, the disk tier against raw I/O, how the page cache was
evicted, the calibration file), and the calibration file `--out` (default `$ANGEL_JAX_CACHE_DIR/io_calibration.json`,
else `~/.cache/angel_jax/io_calibration.json`), which the cost model reads:

  {"format": "angel_jax.io_calibration/1", "created": ISO-8601, "machine": {...}, "page_bytes": int,
   "bandwidth_Bps": {"h2d_pinned": float, ..., "disk_write": float, "disk_read": float, ...},
   "cpu_s_per_byte": {"disk_write": float, "disk_read": float}, "disk": {...}}

`disk_write`/`disk_read` are the disk tier's figures (what the page store gets), not the raw ones.
`cpu_s_per_byte` is the process CPU time (every thread, user + system: checksums, copies, the file system's work
in the kernel) per byte the tier wrote or read, median over rounds. Measured on a 2-vCPU VM: 1.7-2.1 CPU-s per GB
written (new chunk files each time: temporary file, fsync, rename) and ~0.8 per GB read. Where the model's compute
runs on the same cores (the CPU backend), the cost model charges it to compute.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np

from angel_jax import benchinfo
from angel_jax.memory import direct_io
from angel_jax.memory.disk_tier import IO_MODES, DiskTier, resolve_io_mode
from angel_jax.memory.tiers import DeviceTier, host_memory_kind

TARGET_RATIO = 0.7
"""The tier's buffered modes against raw buffered I/O."""
TARGET_RATIO_DIRECT = 0.8
"""The tier's O_DIRECT mode ("unbuffered") against raw O_DIRECT I/O."""
GB = 1e9


def default_calibration_path() -> str:
    base = os.environ.get("ANGEL_JAX_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".cache", "angel_jax")
    return os.path.join(base, "io_calibration.json")


def machine_info() -> dict[str, Any]:
    """The shared benchmark machine record, plus the memory kind the host tier uses."""
    return {**benchinfo.machine_info(), "host_memory_kind": host_memory_kind(jax.local_devices()[0])}


def _record(figure: str, nbytes: int, seconds: list[float], **extra: Any) -> dict[str, Any]:
    med = statistics.median(seconds)
    return {"figure": figure, "GBps": nbytes / med / GB, "GBps_best": nbytes / min(seconds) / GB, "bytes": nbytes,
            "seconds_median": med, "GBps_samples": [round(nbytes / s / GB, 4) for s in seconds], **extra}


def _timed(fn: Callable[[], Any]) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


# --- memory figures ---------------------------------------------------------------------------------------------
def memory_figures(page_bytes: int, n_pages: int, reps: int) -> list[dict[str, Any]]:
    dev = jax.local_devices()[0]
    dev_s = jax.sharding.SingleDeviceSharding(dev, memory_kind=dev.default_memory().kind)
    host_kind = host_memory_kind(dev)
    host_s = jax.sharding.SingleDeviceSharding(dev, memory_kind=host_kind)
    n = page_bytes // 4
    rng = np.random.default_rng(0)
    src = [rng.integers(0, 2**32, size=n, dtype=np.uint32) for _ in range(n_pages)]
    total = n_pages * page_bytes
    out: list[dict[str, Any]] = []

    def block_delete(arrs: list[jax.Array]) -> None:
        for a in arrs:
            a.block_until_ready()
        for a in arrs:
            a.delete()

    dst = [np.empty_like(s) for s in src]
    for d, s in zip(dst, src):
        np.copyto(d, s)  # touch the destination once: measure the copy, not first-touch page faults
    out.append(_record("host_memcpy", total, [_timed(lambda: [np.copyto(d, s) for d, s in zip(dst, src)])
                                              for _ in range(reps)], method="np.copyto"))
    del dst

    tier = DeviceTier(dev)

    def put_all() -> None:
        jax.block_until_ready([tier.put(i, s) for i, s in enumerate(src)])
        for i in range(len(src)):
            tier.free(i)

    out.append(_record("h2d_pageable", total, [_timed(put_all) for _ in range(reps)],
                       method="DeviceTier.put(numpy): jax.device_put" +
                       (" of a copy (the CPU client would alias the numpy buffer)" if dev.platform == "cpu"
                        else "")))

    pinned = [jax.device_put(np.array(s), host_s) for s in src]
    jax.block_until_ready(pinned)
    out.append(_record("h2d_pinned", total, [
        _timed(lambda: block_delete([jax.device_put(h, dev_s) for h in pinned])) for _ in range(reps)],
        method=f"jax.device_put({host_kind} -> device)"))
    for h in pinned:
        h.delete()

    on_dev = [jax.device_put(np.array(s), dev_s) for s in src]
    jax.block_until_ready(on_dev)
    out.append(_record("d2h_pinned", total, [
        _timed(lambda: block_delete([jax.device_put(d, host_s) for d in on_dev])) for _ in range(reps)],
        method=f"jax.device_put(device -> {host_kind})"))

    copy = jax.jit(lambda x: jnp.copy(x))
    block_delete([copy(d) for d in on_dev])  # compile
    out.append(_record("device_copy", total, [
        _timed(lambda: block_delete([copy(d) for d in on_dev])) for _ in range(reps)],
        method="jit(jnp.copy) within device memory; bytes copied (traffic is 2x)"))

    zero_copy = dev.platform == "cpu"  # np.asarray of a CPU jax.Array is a view, not a transfer
    to_numpy = np.array if zero_copy else np.asarray
    samples = []
    for _ in range(reps):
        fresh = [copy(d) for d in on_dev]  # np.asarray caches its host value: a fresh array per sample
        jax.block_until_ready(fresh)
        samples.append(_timed(lambda: [to_numpy(f) for f in fresh]))
        block_delete(fresh)
    out.append(_record("d2h_pageable", total, samples,
                       method="np.array(jax.Array) (np.asarray is zero-copy on the CPU backend)" if zero_copy
                       else "np.asarray(jax.Array)"))
    block_delete(on_dev)
    return out


# --- disk figures -----------------------------------------------------------------------------------------------
def drop_page_cache(paths: list[str], system: bool = False) -> str:
    """Evict the files from the page cache: posix_fadvise(DONTNEED) on each (clean after fsync), and with
    `system` (asked for: `--drop-caches`) also the whole machine's, /proc/sys/vm/drop_caches where permitted.
    Returns the method used."""
    os.sync()
    method = "fadvise"
    if system:
        try:
            with open("/proc/sys/vm/drop_caches", "w") as f:
                f.write("1")
            method = "drop_caches+fadvise"
        except OSError:
            pass
    for p in paths:
        fd = os.open(p, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)
    return method


def _tier_files(tier: DiskTier) -> list[str]:
    return [os.path.join(d, f) for d, _, fs in os.walk(tier.root) for f in fs if f.startswith("c.")]


def tier_round(directory: str, pages: list[np.ndarray], into: list[np.ndarray], io_mode: str,
               concurrency: int, check: bool, system_drop: bool = False) -> tuple[float, float, str, float, float]:
    """(write s, read s, how the page cache was dropped, write CPU s, read CPU s) of one round through a tier."""
    tier = DiskTier(directory, file_io_concurrency=concurrency, io_mode=io_mode)
    tier.open()
    try:
        c0 = time.process_time()
        tw = _timed(lambda: [f.result() for f in [tier.write(i, p) for i, p in enumerate(pages)]])
        cw = time.process_time() - c0
        how = drop_page_cache(_tier_files(tier), system_drop)
        got: list[np.ndarray] = []
        c0 = time.process_time()
        tr = _timed(lambda: got.extend(f.result() for f in [tier.read(i, into=b) for i, b in enumerate(into)]))
        cr = time.process_time() - c0
        if check and not all(np.array_equal(g, p) for g, p in zip(got, pages)):
            raise AssertionError("disk tier read back different bytes")
        return tw, tr, how, cw, cr
    finally:
        tier.close()


def raw_round(directory: str, pages: list[np.ndarray], into: list[np.ndarray], direct: bool,
              system_drop: bool = False) -> tuple[float, float, str]:
    path = os.path.join(directory, "angel_jax_raw_io.bin")
    flag = os.O_DIRECT if direct else 0

    def write() -> None:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | flag, 0o600)
        try:
            for p in pages:
                os.write(fd, p)
            os.fsync(fd)
        finally:
            os.close(fd)

    def read() -> None:
        fd = os.open(path, os.O_RDONLY | flag)
        try:
            for buf in into:
                if os.readv(fd, [buf]) != buf.nbytes:
                    raise OSError(f"short read from {path}")
        finally:
            os.close(fd)

    try:
        tw = _timed(write)
        how = drop_page_cache([path], system_drop)
        tr = _timed(read)
        return tw, tr, how
    finally:
        os.unlink(path)


def disk_figures(directory: str, page_bytes: int, total_bytes: int, rounds: int, io_mode: str,
                 concurrency: int, system_drop: bool = False) -> list[dict[str, Any]]:
    io_mode = resolve_io_mode(io_mode, directory)  # recorded as the mode the tier uses
    n_pages = max(1, total_bytes // page_bytes)
    total = n_pages * page_bytes
    rng = np.random.default_rng(1)
    pages = []
    for _ in range(n_pages):
        buf = direct_io.aligned_empty(page_bytes, np.uint8)
        buf.view(np.uint64)[:] = rng.integers(0, 2**63, size=page_bytes // 8, dtype=np.uint64)
        pages.append(buf)
    into = [direct_io.aligned_empty(page_bytes, np.uint8) for _ in range(n_pages)]
    Round = Callable[[list[np.ndarray], list[np.ndarray], bool], tuple]
    methods: dict[str, Round] = {
        "disk_tier": lambda p, i, check: tier_round(directory, p, i, io_mode, concurrency, check, system_drop),
        "raw_buffered": lambda p, i, _: raw_round(directory, p, i, False, system_drop),
    }
    if direct_io.supported(directory):
        methods["raw_direct"] = lambda p, i, _: raw_round(directory, p, i, True, system_drop)
    names = list(methods)
    for m in names:  # warm-up, not recorded: thread pools, first-touch of buffers, file-system metadata
        methods[m](pages[:2], into[:2], True)
    samples: dict[str, dict[str, list[float]]] = {m: {"write": [], "read": []} for m in names}
    cpu: dict[str, list[float]] = {"write": [], "read": []}  # the tier's process CPU seconds per round
    drops = set()
    load = [os.getloadavg()[0]]
    for r in range(rounds):
        for m in names[r % len(names):] + names[:r % len(names)]:
            tw, tr, how, *cpu_s = methods[m](pages, into, r == 0)
            if cpu_s:
                cpu["write"].append(cpu_s[0])
                cpu["read"].append(cpu_s[1])
            samples[m]["write"].append(tw)
            samples[m]["read"].append(tr)
            drops.add(how)
    load.append(os.getloadavg()[0])
    common = {"dir": directory, "page_bytes": page_bytes, "rounds": rounds, "cache_drop": "+".join(sorted(drops)),
              "loadavg_1m": load}
    out = []
    for m in names:
        for op in ("write", "read"):
            extra = {"io_mode": io_mode, "file_io_concurrency": concurrency,
                     "cpu_s_per_GB": statistics.median(cpu[op]) / (total / GB)} if m == "disk_tier" else {}
            out.append(_record(f"{m}_{op}", total, samples[m][op], **common, **extra))
    # The target compares like with like: the tier's O_DIRECT mode against raw O_DIRECT I/O, its page-cache
    # modes (buffered write + fsync, mmap'ed reads) against plain os.write/os.read. It is judged on the best round
    # of each method: interference from other tenants only ever slows a round down, so the best round is the
    # least disturbed estimate of what each method can do; ratios of medians and per round are reported too.
    ref = "raw_direct" if io_mode == "unbuffered" and "raw_direct" in names else "raw_buffered"
    target = TARGET_RATIO_DIRECT if ref == "raw_direct" else TARGET_RATIO
    ratio: dict[str, Any] = {"figure": "disk_tier_vs_raw", "target": target, "reference": ref, "io_mode": io_mode,
                             "judged_on": "best round", **common}
    med = {rec["figure"]: rec["GBps"] for rec in out}
    best = {rec["figure"]: rec["GBps_best"] for rec in out}
    ok = ok_median = True
    for op in ("write", "read"):
        for m in names[1:]:
            ratio[f"{op}_vs_{m}_best"] = best[f"disk_tier_{op}"] / best[f"{m}_{op}"]
            ratio[f"{op}_vs_{m}_median"] = med[f"disk_tier_{op}"] / med[f"{m}_{op}"]
            ratio[f"{op}_vs_{m}_per_round"] = [round(a / b, 3) for a, b in
                                                zip(samples[m][op], samples["disk_tier"][op])]
        ok = ok and ratio[f"{op}_vs_{ref}_best"] >= target
        ok_median = ok_median and ratio[f"{op}_vs_{ref}_median"] >= target
    ratio["meets_target"] = ok
    ratio["meets_target_on_medians"] = ok_median
    out.append(ratio)
    return out


# --- entry point ------------------------------------------------------------------------------------------------
def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="angel-jax bench io", description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default=default_calibration_path(), help="calibration JSON to write")
    p.add_argument("--jsonl", default=None, help="also append every record (with the machine) to this file")
    p.add_argument("--dir", default=tempfile.gettempdir(), help="directory on the disk to measure")
    p.add_argument("--page-bytes", type=int, default=64 * 2**20)
    p.add_argument("--pages", type=int, default=4, help="pages per memory-transfer sample")
    p.add_argument("--reps", type=int, default=5, help="samples per memory figure")
    p.add_argument("--disk-bytes", type=int, default=2**30, help="bytes written and read per disk sample")
    p.add_argument("--rounds", type=int, default=7, help="interleaved rounds of disk samples")
    p.add_argument("--io-mode", default="auto", choices=IO_MODES,
                   help="how the disk tier moves bytes (DiskTier's io_mode; auto: O_DIRECT where the directory "
                        "takes it)")
    p.add_argument("--file-io-concurrency", type=int, default=8)
    p.add_argument("--drop-caches", action="store_true",
                   help="also drop the whole system's page cache before each read (/proc/sys/vm/drop_caches, as "
                        "root); without it only the files this run wrote are evicted (posix_fadvise)")
    p.add_argument("--skip-disk", action="store_true")
    p.add_argument("--skip-memory", action="store_true")
    return p.parse_args(argv)


def write_calibration(path: str, records: list[dict[str, Any]], machine: dict[str, Any], args: argparse.Namespace,
                      created: str) -> None:
    by = {r["figure"]: r for r in records if "GBps" in r}
    names = {"h2d_pinned": "h2d_pinned", "h2d_pageable": "h2d_pageable", "d2h_pinned": "d2h_pinned",
             "d2h_pageable": "d2h_pageable", "device_copy": "device_copy", "host_memcpy": "host_memcpy",
             "disk_write": "disk_tier_write", "disk_read": "disk_tier_read",
             "raw_disk_write": "raw_direct_write", "raw_disk_read": "raw_direct_read",
             "raw_buffered_disk_write": "raw_buffered_write", "raw_buffered_disk_read": "raw_buffered_read"}
    cal = {"format": "angel_jax.io_calibration/1", "created": created, "machine": machine,
           "page_bytes": args.page_bytes,
           "bandwidth_Bps": {k: by[v]["GBps"] * GB for k, v in names.items() if v in by},
           "cpu_s_per_byte": {k: by[f"disk_tier_{k[5:]}"]["cpu_s_per_GB"] / GB for k in ("disk_write", "disk_read")
                              if f"disk_tier_{k[5:]}" in by},
           "disk": {"dir": args.dir, "io_mode": args.io_mode, "file_io_concurrency": args.file_io_concurrency,
                    "cache_drop": next((r.get("cache_drop") for r in records if "cache_drop" in r), None)}}
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    tmp = f"{path}.tmp.{os.getpid()}"
    with open(tmp, "w") as f:
        json.dump(cal, f, indent=1)
        f.write("\n")
    os.replace(tmp, path)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.page_bytes % 4096:
        print(f"--page-bytes must be a multiple of 4096 (O_DIRECT), got {args.page_bytes}", file=sys.stderr)
        return 2
    if not os.path.isdir(args.dir):
        print(f"--dir {args.dir} is not a directory", file=sys.stderr)
        return 2
    machine = machine_info()
    created = machine["date"]
    records: list[dict[str, Any]] = []
    free = shutil.disk_usage(args.dir).free
    if not args.skip_memory:
        records += memory_figures(args.page_bytes, args.pages, args.reps)
    if not args.skip_disk:
        if free < 2.5 * args.disk_bytes:
            print(f"--dir {args.dir} has {free} B free; need {int(2.5 * args.disk_bytes)}", file=sys.stderr)
            return 2
        records += disk_figures(args.dir, args.page_bytes, args.disk_bytes, args.rounds, args.io_mode,
                                args.file_io_concurrency, args.drop_caches)
    lines = [json.dumps({"bench": "io", **r}) for r in records]
    print("\n".join(lines), flush=True)
    if args.jsonl:
        os.makedirs(os.path.dirname(os.path.abspath(args.jsonl)), exist_ok=True)
        with open(args.jsonl, "a") as f:
            for r in records:
                f.write(json.dumps({"bench": "io", **r, "machine": machine}) + "\n")
    write_calibration(args.out, records, machine, args, created)
    print(json.dumps({"bench": "io", "calibration": os.path.abspath(args.out)}), flush=True)
    print(summary(records, os.path.abspath(args.out)), file=sys.stderr, flush=True)
    return 0


CACHE_DROPS = {"fadvise": "only the files this run wrote, evicted with posix_fadvise(DONTNEED) after fsync; the "
                          "system's page cache untouched (--drop-caches drops it too)",
               "drop_caches+fadvise": "the whole system's page cache dropped before each read (--drop-caches), "
                                      "and the files evicted with posix_fadvise"}


def summary(records: list[dict[str, Any]], calibration: str) -> str:
    """The readable end of a run: one row per figure (median, best, samples), the disk tier against raw I/O, how
    the page cache was evicted before reads, and where the calibration went."""
    rows = [r for r in records if "GBps" in r]
    width = max([len(r["figure"]) for r in rows] + [6])
    lines = ["", f"{'figure':<{width}}  {'GB/s':>7}  {'best':>7}  samples",
             f"{'-' * width}  {'-' * 7}  {'-' * 7}  -------"]
    lines += [f"{r['figure']:<{width}}  {r['GBps']:>7.2f}  {r['GBps_best']:>7.2f}  {len(r['GBps_samples'])}"
              for r in rows]
    ratio = next((r for r in records if r.get("figure") == "disk_tier_vs_raw"), None)
    if ratio is not None:
        ref = ratio["reference"]
        lines.append(f"disk tier ({ratio.get('io_mode', '?')}) / {ref.replace('_', ' ')} I/O (best rounds): write "
                     f"{ratio[f'write_vs_{ref}_best']:.2f}, read {ratio[f'read_vs_{ref}_best']:.2f}; medians "
                     f"{ratio[f'write_vs_{ref}_median']:.2f}, {ratio[f'read_vs_{ref}_median']:.2f} (target "
                     f"{ratio['target']:.2f}: {'met' if ratio['meets_target'] else 'NOT met'})")
    for how in sorted({r["cache_drop"] for r in rows if r.get("cache_drop")}):
        lines.append(f"page cache before reads: {CACHE_DROPS.get(how, how)}")
    lines.append(f"calibration written to {calibration} (the cost model reads it)")
    return "\n".join(lines)


if __name__ == "__main__":
    raise SystemExit(main())
