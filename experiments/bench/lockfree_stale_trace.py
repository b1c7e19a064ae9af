"""A paged training run that records, per step, which stages ran one update behind (lock-free mode).

    python experiments/bench/lockfree_stale_trace.py STALE.json CONFIG [key=value ...]

Runs `angel-jax train CONFIG key=value ...` in this process with `PageUpdater.acquire` wrapped (nothing else
changes): each stage's first access of a step asks the updater for its parameters, and the answer says whether
the stage runs without its previous step's update (timing decides which do: see angel_jax/schedule/updater.py).
Writes STALE.json = {"stale": [[0/1 per stage, in stage order] per step, from step 1], "steps": [0-based steps]},
the input of `experiments/bench/delayed_gradient_reference.py --modes replay --replay STALE.json`, and prints
the stale uses per stage. Pass memory.mode=paged memory.staleness=1 (and train.log_every=1, anomaly.enabled=false
to compare losses step by step).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from angel_jax import cli
from angel_jax.schedule.updater import PageUpdater


def main(argv: list[str]) -> int:
    if len(argv) < 2:
        print(__doc__, file=sys.stderr)
        return 2
    out, train_args = Path(argv[0]), argv[1:]
    seen: dict[int, dict[int, bool]] = {}  # 0-based step -> stage -> ran one update behind
    acquire = PageUpdater.acquire

    def recording(self: PageUpdater, i: int, step: int) -> bool:
        stale = acquire(self, i, step)
        seen.setdefault(step, {})[i] = bool(stale)
        return stale

    PageUpdater.acquire = recording  # type: ignore[method-assign]
    try:
        return cli.main(["train", *train_args])
    finally:
        PageUpdater.acquire = acquire  # type: ignore[method-assign]
        if seen:
            steps = sorted(seen)
            n = 1 + max(max(stages) for stages in seen.values())
            stale = [[int(seen[s].get(i, False)) for i in range(n)] for s in steps]
            out.write_text(json.dumps({"stale": stale, "steps": steps}))
            print(json.dumps({"stale_uses_per_stage": [sum(r[i] for r in stale) for i in range(n)],
                              "steps": len(steps), "written": str(out)}), flush=True)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
