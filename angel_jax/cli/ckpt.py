"""`angel-jax ckpt ls | verify RUN_DIR`: a run's checkpoints in every tier, and their checksums, without training.
A run whose processes checkpoint their own shards gets a table (and a verification) per process."""

from __future__ import annotations

import argparse
from pathlib import Path

from angel_jax.checkpoint import CheckpointManager, CheckpointError
from angel_jax.config import Config
from angel_jax.train.checkpointing import checkpoint_options, shard_dirs
from angel_jax.units import human_bytes


def manager_for_run(run_dir: Path, process: int | None = None) -> CheckpointManager:
    """A checkpoint manager over a run directory's tiers, as its resolved config (<run_dir>/config.yaml) names
    them (the defaults when the run wrote no config); with `process`, the tiers of that process's shards."""
    from angel_jax.config import load_recorded_config

    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        raise CheckpointError(f"run directory {run_dir} does not exist")
    config_file = run_dir / "config.yaml"
    cfg = load_recorded_config(config_file) if config_file.is_file() else Config()
    return CheckpointManager(checkpoint_options(cfg, run_dir, process))


def _parts(run_dir: Path) -> list[tuple[str, int | None]]:
    """(heading, process) of each set of a run's checkpoints: the whole state's, then each process's shards."""
    processes = sorted(shard_dirs(run_dir)) if Path(run_dir).is_dir() else []
    return [("", None)] + [(f"process {p} (its shards)", p) for p in processes]


def list_table(run_dir: Path) -> list[str]:
    """`angel-jax ckpt ls`: one line per step with its state and size in each tier (no checksum reading); a run
    whose processes checkpoint their own shards gets a table per process."""
    parts = _parts(run_dir)
    lines: list[str] = []
    for heading, process in parts:
        with manager_for_run(run_dir, process) as engine:
            infos = engine.list()
            roots = engine.tier_roots()
            refused = engine.refused()
        if not infos:
            if process is None and len(parts) == 1:
                return [f"no checkpoints ({roots})"]
            continue
        lines += [f"{heading}:"] if heading else []
        # A copy that may not be loaded (another user's, a symlink out of the run directory) says so, and why below.
        rows = [[f"{'NOT LOADED' if (tier, info.step) in refused else t.state} {human_bytes(t.nbytes)}"
                 if (t := info.tiers.get(tier)) else "-" for tier in ("memory", "peer", "persistent")]
                for info in infos]
        width = max(22, *(len(c) + 2 for row in rows for c in row))  # a column never runs into the next
        lines.append(f"{'step':>8}  " + "".join(f"{h:<{width}}" for h in ("memory", "peer", "persistent")).rstrip())
        lines += [f"{info.step:>8}  " + "".join(f"{c:<{width}}" for c in row).rstrip() for info, row in zip(infos, rows)]
        lines.append(f"tiers: {roots}")
        lines += [f"not loaded: {text}" for text in dict.fromkeys(refused.values())]
    return lines or [f"no checkpoints in {run_dir}"]


def verify_report(run_dir: Path, step: int | None = None) -> tuple[bool, list[str]]:
    """`angel-jax ckpt verify`: read every committed copy of `step` (default: every step) and check each array's
    XXH3-64 checksum, of the whole state's checkpoints and of every process's shards. A copy that may not be
    loaded (another user's, a symlink out of the run directory) makes its step NOT LOADED, naming why; not good
    either. Returns (all good, lines)."""
    ok, lines, found = True, [], []
    for heading, process in _parts(run_dir):
        with manager_for_run(run_dir, process) as engine:
            committed = [i.step for i in engine.list() if i.committed]
            found += committed
            steps = [s for s in committed if step is None or s == step]
            lines += [f"{heading}:"] if heading and steps else []
            for s in steps:
                problems, refused = engine.verify(s), engine.refusals(s)
                ok = ok and not problems
                label = "ok" if not problems else "DAMAGED" if len(problems) > len(refused) else "NOT LOADED"
                lines.append(f"step {s}: {label}")
                lines += [f"  {p}" for p in problems]
    if step is not None and step not in found:
        return False, [f"no committed checkpoint of step {step} (committed steps: "
                       f"{', '.join(map(str, sorted(set(found)))) or 'none'})"]
    if not found:
        return False, ["no committed checkpoint to verify"]
    return ok, lines


def run(args: argparse.Namespace) -> int:
    if args.ckpt_command == "ls":
        print("\n".join(list_table(args.run_dir)))
        return 0
    ok, lines = verify_report(args.run_dir, args.step)
    print("\n".join(lines))
    return 0 if ok else 1
