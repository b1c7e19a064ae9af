"""`angel-jax worker CONFIG`: one process of a multi-process job (started by `launch`, or by srun / Kubernetes)."""

from __future__ import annotations

import argparse


def run(args: argparse.Namespace) -> int:
    from angel_jax.tol.worker import run as run_worker

    return run_worker(str(args.config), args.overrides)
