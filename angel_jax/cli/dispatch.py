"""`angel-jax`'s entry point: parse the command line, run the command's handler, one line per user-facing error."""

from __future__ import annotations

import importlib
import logging
import sys

from angel_jax.cli.parser import build_parser
from angel_jax.config import ConfigError
from angel_jax.errors import AngelError

HANDLERS: dict[str, tuple[str, str]] = {
    "train": ("train", "run"), "launch": ("launch", "run"), "worker": ("worker", "run"), "data": ("data", "run"),
    "plan": ("plan", "main"), "bench": ("bench", "run"), "ckpt": ("ckpt", "run"), "import": ("hf", "import_main"),
    "export": ("hf", "export_main"), "sample": ("sample", "main"), "config": ("config", "run"),
    "plot": ("plot", "run"),
}
"""command -> (module of angel_jax.cli, its handler): imported only when the command runs."""


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    # `train CONFIG --print-config key=value`: argparse stops filling a nargs='*' positional at the first
    # optional, so overrides after one come back as extras; take them, refuse anything else.
    args, extra = parser.parse_known_args(argv)
    if argv is None and args.command in ("train", "worker"):
        from angel_jax.memory.malloc import restart_tuned

        restart_tuned(["-m", "angel_jax.cli", *sys.argv[1:]])  # huge pages, large blocks reused; same pid
    if extra:
        if not hasattr(args, "overrides") or any(x.startswith("-") or "=" not in x for x in extra):
            parser.error(f"unrecognized arguments: {' '.join(extra)}")
        args.overrides = list(args.overrides) + extra
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s",
                        datefmt="%H:%M:%S")
    for noisy in ("absl", "jax._src", "orbax"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    module, function = HANDLERS[args.command]
    try:
        handler = getattr(importlib.import_module(f"angel_jax.cli.{module}"), function)
        return handler(args)
    except ConfigError as e:
        print(f"config error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    except AngelError as e:  # user-facing errors get one clean line; anything else keeps its traceback
        code = getattr(e, "exit_code", 1)  # a restart request carries the status the watchdog reads
        print(f"error: {e}", file=sys.stderr)
        return code
