"""`angel-jax config [CONFIG]`: every config key with its type, default and meaning, or one file's resolved values."""

from __future__ import annotations

import argparse

from angel_jax.config import describe, dump_yaml, load_config


def run(args: argparse.Namespace) -> int:
    if args.config is None:
        print("\n".join(describe()))
    else:
        print(dump_yaml(load_config(args.config, args.overrides)), end="")
    return 0
