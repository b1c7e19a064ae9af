"""`angel-jax launch [-n N] CONFIG`: N worker processes under the watchdog (angel_jax/tol/), on this machine or as
job steps of the Slurm allocation it runs in."""

from __future__ import annotations

import argparse
import sys


def run(args: argparse.Namespace) -> int:
    from angel_jax.tol.launch import launch

    if (args.workers is not None and args.workers < 1) or args.spares < 0 or (args.ranks_per_node or 1) < 1:
        print("error: -n and --ranks-per-node must be >= 1 and --spares >= 0", file=sys.stderr)
        return 2
    return launch(args.config, args.overrides, workers=args.workers, spares=args.spares,
                  cpu_devices=args.cpu_devices, slurm=args.slurm, ranks_per_node=args.ranks_per_node)
