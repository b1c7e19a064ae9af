"""`angel-jax launch -n N CONFIG`: N worker processes under the watchdog (angel_jax/tol/)."""

from __future__ import annotations

import argparse
import sys


def run(args: argparse.Namespace) -> int:
    from angel_jax.tol.launch import launch

    if args.workers < 1 or args.spares < 0:
        print("error: -n must be >= 1 and --spares >= 0", file=sys.stderr)
        return 2
    return launch(args.config, args.overrides, workers=args.workers, spares=args.spares,
                  cpu_devices=args.cpu_devices)
