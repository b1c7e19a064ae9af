"""`angel-jax`: the command line.

parser.py holds every command's arguments (argparse alone, so `--help` never imports JAX); dispatch.py parses,
runs the command's handler and turns user-facing errors into one line; each command is a module of its own
(train, launch, worker, data, plan, bench, ckpt, hf for import and export, sample, config), imported only when it
runs."""

from angel_jax.cli.dispatch import main

__all__ = ["main"]
