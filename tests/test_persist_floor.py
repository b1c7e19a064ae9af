"""The persistent tier works on the orbax-checkpoint installed, whichever version pyproject.toml allows: the main job
persists its checkpoints and resumes from them alone, and orbax writes the caller's arrays without copying them.

scripts/test_lowest_versions.sh runs this file again with the lowest versions allowed (constraints-lowest.txt). A
save that orbax refuses is logged and training goes on (orbax-checkpoint 0.12.4 refused every one): only a test
that looks at what the run left sees it.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import orbax.checkpoint as ocp
import pytest
import xxhash

from angel_jax.checkpoint.orbax_local import ProcessLocalNumpyHandler, state_handler

REPO_ROOT = Path(__file__).resolve().parent.parent


def train_main_job(tmp_path: Path, *overrides: str) -> subprocess.CompletedProcess:
    """`angel-jax train experiments/gpt_tiny.yaml` in a fresh process, its data, run directory and memory tier
    under `tmp_path` (the working directory, so its stdlib token shards are prepared there)."""
    run = tmp_path / "run"
    cmd = ["timeout", "-s", "KILL", "240", sys.executable, "-m", "angel_jax.cli", "train",
           str(REPO_ROOT / "experiments" / "gpt_tiny.yaml"), f"train.run_dir={run}",
           f"checkpoint.memory_dir={tmp_path / 'memtier'}", "train.eval_every=0", *overrides]
    return subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True)


def events(run: Path) -> list[dict]:
    path = run / "events.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def assert_no_failed_save(proc: subprocess.CompletedProcess, run: Path) -> None:
    """A failed save lets training go on, with an error logged and an event: exit 0 proves nothing on its own."""
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert not re.search(r"checkpoint step \d+: .*failed", proc.stderr), proc.stderr[-3000:]
    assert [e["message"] for e in events(run) if e["kind"] == "checkpoint_failed"] == []


def assert_plain_orbax_reads(persistent: Path, step: int) -> None:
    """Orbax alone restores the step, and every array's bytes are the ones the checkpoint's meta records."""
    mngr = ocp.CheckpointManager(persistent)
    try:
        ckpt = mngr.restore(step, args=ocp.args.Composite(state=ocp.args.StandardRestore(),
                                                          meta=ocp.args.JsonRestore()))
    finally:
        mngr.close()
    digests = {a["name"]: a["xxh3_64"] for a in ckpt.meta["arrays"] if a["nbytes"] > 0}
    assert digests and set(ckpt.state) == set(digests)
    for name, digest in digests.items():
        assert xxhash.xxh3_64_intdigest(np.asarray(ckpt.state[name]).tobytes()) == digest, name


@pytest.mark.slow
def test_the_main_job_persists_its_checkpoints_and_resumes_from_them(tmp_path: Path) -> None:
    run, persistent = tmp_path / "run", tmp_path / "run" / "checkpoints"
    # keep_every: step 2 is persisted even when step 4's save arrives before its persistence starts (superseded).
    first = train_main_job(tmp_path, "train.steps=4", "checkpoint.every=2", "checkpoint.keep_every=2")
    assert_no_failed_save(first, run)
    assert sorted(p.name for p in persistent.iterdir()) == ["2", "4"]
    assert_plain_orbax_reads(persistent, 4)
    # Without the memory tier (a new machine) the run goes on from the persistent tier alone.
    shutil.rmtree(tmp_path / "memtier")
    second = train_main_job(tmp_path, "train.steps=6", "checkpoint.every=2")
    assert_no_failed_save(second, run)
    assert [(e["step"], e["tier"]) for e in events(run) if e["kind"] == "resumed"] == [(4, "persistent")]
    assert sorted(p.name for p in persistent.iterdir()) == ["4", "6"]  # checkpoint.keep: 2


def test_orbax_writes_the_callers_arrays_not_a_copy(tmp_path: Path, monkeypatch) -> None:
    """A defensive copy would double the memory of a state persisted from the memory tier's views."""
    written: list[np.ndarray] = []
    write = ProcessLocalNumpyHandler._open_and_write

    async def recording_write(self, value, tspec, ts_context):  # noqa: ANN001, ANN202 - orbax's signature
        written.append(value)
        return await write(self, value, tspec, ts_context)

    monkeypatch.setattr(ProcessLocalNumpyHandler, "_open_and_write", recording_write)
    state = {"w": np.arange(4096, dtype=np.float32).reshape(64, 64), "b": np.ones(7, np.int32)}
    with ocp.Checkpointer(state_handler(ocp.options.MultiprocessingOptions())) as checkpointer:
        checkpointer.save(tmp_path / "ckpt", args=ocp.args.PyTreeSave(state))
        restored = checkpointer.restore(tmp_path / "ckpt")
    assert len(written) == len(state)
    assert all(any(value is array for array in state.values()) for value in written)
    for name, array in state.items():
        assert np.asarray(restored[name]).tobytes() == array.tobytes(), name
