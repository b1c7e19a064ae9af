"""`angel-jax bench io`: this machine's bandwidths for the cost model (angel_jax/memory/bench_io.py)."""

from __future__ import annotations

import argparse


def run(args: argparse.Namespace) -> int:
    from angel_jax.memory import bench_io

    return bench_io.main(args.rest)
