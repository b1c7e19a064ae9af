"""Data-movement bandwidths of this machine: what `angel-jax bench io` runs, with the results committed.

    python experiments/bench/io.py [bench_io options, e.g. --dir /path/on/the/ssd --rounds 3] [--write]

Runs `angel_jax.memory.bench_io` (see its docstring for every figure): host memcpy, H2D and D2H (pinned and
pageable), device copy, and the disk tier's write and read bandwidth beside raw sequential file bandwidth
(O_DIRECT and buffered) measured in the same run, in interleaved rounds. Prints one JSON line per figure, writes
the calibration file the scheduling pass's cost model reads (--out, default ~/.cache/angel_jax/io_calibration.json),
and appends every figure with the machine (host, CPU, device kind, versions, date) to
experiments/results/io_<platform>.jsonl with --write. Runs unchanged on a GPU machine, where the H2D/D2H
figures are the real PCIe/NVLink-C2C transfers between pinned host memory and HBM.
"""

from __future__ import annotations

import sys

from angel_jax.benchinfo import results_path
from angel_jax.memory import bench_io


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if "--write" in argv:  # into the committed results only when asked (or with an explicit --jsonl PATH)
        argv.remove("--write")
        if "--jsonl" not in argv:
            argv += ["--jsonl", str(results_path("io"))]
    return bench_io.main(argv)


if __name__ == "__main__":
    raise SystemExit(main())
