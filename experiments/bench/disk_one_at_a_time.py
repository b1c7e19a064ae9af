"""The disk tier's bandwidth with every page of a transfer in flight against one page at a time.

    python experiments/bench/disk_one_at_a_time.py [--dir /tmp] [--pages 16] [--page-mib 64] [--rounds 3] [--write]

`angel-jax bench io` calibrates the disk with every page in flight, as the overlapped paged step moves them. With
`memory.overlap: false` the page store waits for each move before the next, so the no-overlap baseline moves
pages one at a time. Each round writes `--pages` pages of random bytes through a fresh `DiskTier` both ways
(all in flight, then one at a time), dropping the page cache before each read. One JSON line per way and
direction (GB/s per round and the median), appended to experiments/results/disk_one_at_a_time_<platform>.jsonl
with --write.
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np

from angel_jax.benchinfo import emit, machine_info, results_path
from angel_jax.memory import DiskTier
from angel_jax.memory.bench_io import _tier_files, drop_page_cache


def one_round(directory: str, pages: list[np.ndarray], into: list[np.ndarray], in_flight: bool) -> tuple[float, float]:
    """(write s, read s) of every page through a fresh disk tier."""
    d = tempfile.mkdtemp(dir=directory)
    tier = DiskTier(d)
    tier.open()
    try:
        t0 = time.perf_counter()
        if in_flight:
            for f in [tier.write(i, p) for i, p in enumerate(pages)]:
                f.result()
        else:
            for i, p in enumerate(pages):
                tier.write(i, p).result()
        written = time.perf_counter() - t0
        drop_page_cache(_tier_files(tier))
        t0 = time.perf_counter()
        if in_flight:
            for f in [tier.read(i, into=b) for i, b in enumerate(into)]:
                f.result()
        else:
            for i, b in enumerate(into):
                tier.read(i, into=b).result()
        return written, time.perf_counter() - t0
    finally:
        tier.close()
        shutil.rmtree(d, ignore_errors=True)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--dir", default=tempfile.gettempdir())
    p.add_argument("--pages", type=int, default=16)
    p.add_argument("--page-mib", type=int, default=64)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--write", action="store_true")
    args = p.parse_args()
    rng = np.random.default_rng(0)
    pages = [rng.integers(0, 255, args.page_mib * 2**20, dtype=np.uint8) for _ in range(args.pages)]
    into = [np.empty_like(x) for x in pages]
    gb = sum(x.nbytes for x in pages) / 1e9
    seconds: dict[tuple[str, str], list[float]] = {}
    for _ in range(args.rounds):  # the two ways alternate, so machine noise hits them alike
        for way in ("all_in_flight", "one_at_a_time"):
            w, r = one_round(args.dir, pages, into, way == "all_in_flight")
            seconds.setdefault((way, "write"), []).append(w)
            seconds.setdefault((way, "read"), []).append(r)
    machine, results = machine_info(), results_path("disk_one_at_a_time") if args.write else None
    for (way, direction), s in seconds.items():
        emit({"bench": "disk_one_at_a_time", "way": way, "direction": direction, "pages": args.pages,
              "page_bytes": args.page_mib * 2**20, "dir": str(Path(args.dir)),
              "GBps_per_round": [round(gb / x, 3) for x in s], "GBps_median": round(gb / statistics.median(s), 3)},
             results, machine)


if __name__ == "__main__":
    main()
