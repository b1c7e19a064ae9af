"""The reference trainer end to end: angel_jax.train.loop, its checkpoints and metrics.

Every run is the tiny GPT of conftest.tiny_config_dict on a repeated short text. Runs that train are `slow`.
The reference for every resume test is one uninterrupted in-process run of 30 steps (`straight`); resumed runs
must reproduce its per-step numbers and its final state bit for bit.
"""

from __future__ import annotations

import logging
import math
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import jax
import numpy as np
import pytest

from angel_jax.config import dump_yaml, load_config
from angel_jax.errors import AngelError
from angel_jax.train import metrics as M
from angel_jax.checkpoint import CheckpointManager, CheckpointOptions
from angel_jax.train.hooks import TrainHooks
from angel_jax.train.loop import TrainResult, train
from models import gpt

ROOT = Path(__file__).resolve().parent.parent
STEPS = 30
EXACT_KEYS = ("loss", "grad_norm", "update_norm", "lr")
PERF_KEYS = ("perf/step_time", "perf/tokens_per_s", "perf/tflops", "perf/mfu")
PROC_LIMIT = 240  # seconds: `timeout -s KILL` guard of every child process


@dataclass
class Run:
    cfg_path: Path
    result: TrainResult
    exact: dict[int, dict[str, float]]
    """step -> the unrounded values passed to on_step."""
    saves: dict[int, dict] | None = None
    """step -> the info of its checkpoint (stall_s, state, held)."""

    @property
    def run_dir(self) -> Path:
        return self.result.run_dir

    def records(self) -> list[dict]:
        return M.read_jsonl(self.run_dir / "metrics.jsonl")


class _Saves(TrainHooks):
    def __init__(self) -> None:
        self.infos: dict[int, dict] = {}

    def on_checkpoint(self, step: int, info: dict) -> None:
        self.infos[step] = info


def _train(cfg_path: Path, overrides: list[str] = (), saves: _Saves | None = None
           ) -> tuple[TrainResult, dict[int, dict[str, float]]]:
    exact: dict[int, dict[str, float]] = {}
    result = train(load_config(cfg_path, list(overrides)), hooks=[saves] if saves else [],
                   on_step=lambda step, values: exact.__setitem__(step, values))
    return result, exact


def _flat(tree) -> dict[str, np.ndarray]:
    from angel_jax.train.engines import named_leaves

    return {k: np.asarray(v) for k, v in named_leaves(tree).items()}


def _leaves_equal(a, b) -> bool:
    la, lb = jax.tree.leaves(a), jax.tree.leaves(b)
    return len(la) == len(lb) and all(np.asarray(x).dtype == np.asarray(y).dtype and np.array_equal(x, y)
                                      for x, y in zip(la, lb))


def _engine(run_dir: Path) -> CheckpointManager:
    """A checkpoint manager over a run's tiers (the trainer's options: see conftest's memory_dir)."""
    cfg = load_config(run_dir / "config.yaml")  # the resolved config the run wrote
    return CheckpointManager(CheckpointOptions(persistent_dir=(run_dir / "checkpoints").absolute(),
                                              memory_dir=Path(cfg.checkpoint.memory_dir)))


def _restore(run_dir: Path, step: int) -> tuple[dict[str, np.ndarray], dict]:
    """(arrays, data iterator state) of a run's checkpoint of `step`, checksums verified."""
    with _engine(run_dir) as engine:
        restored = engine.restore(step)
    return restored.arrays, restored.meta["data"]


def _params(arrays: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    return {k: v for k, v in arrays.items() if k.startswith("params/")}


def _same_arrays(a: dict[str, np.ndarray], b: dict[str, np.ndarray]) -> bool:
    return a.keys() == b.keys() and all(a[k].dtype == b[k].dtype and np.array_equal(a[k], b[k]) for k in a)


def _steps_in(persistent: Path) -> list[int]:
    return [int(p.name) for p in persistent.iterdir() if p.name.isdigit()]


def _committed_steps(run_dir: Path, tier: str = "persistent") -> list[int]:
    """Steps committed in a tier of a run ('memory': snapshotted; 'persistent': orbax commit done)."""
    if not (run_dir / "config.yaml").exists():
        return []
    with _engine(run_dir) as engine:
        return [info.step for info in engine.list()
                if info.tiers.get(tier) is not None and info.tiers[tier].state != "partial"]


@pytest.fixture(scope="module")
def straight(tmp_path_factory, write_tiny_config) -> Run:
    """30 steps, uninterrupted, in this process (checkpoint every 10, keep 2)."""
    directory = tmp_path_factory.mktemp("straight")
    cfg_path = write_tiny_config(directory, "straight")
    saves = _Saves()
    result, exact = _train(cfg_path, saves=saves)
    return Run(cfg_path, result, exact, saves.infos)


# ------------------------------------------------------------------------------------------ end to end


@pytest.mark.slow
def test_run_directory_contents(straight):
    run_dir = straight.run_dir
    cfg = load_config(straight.cfg_path)
    assert straight.result.final_step == STEPS
    # the resolved config, loadable as is
    assert (run_dir / "config.yaml").read_text() == dump_yaml(cfg)
    assert load_config(run_dir / "config.yaml") == cfg
    # checkpoints every 10 steps, the newest 2 kept, each fully committed
    # (a save whose persistence has not started when a newer one arrives is not persisted: its snapshot is kept)
    assert _committed_steps(run_dir, "memory") == [20, 30]
    persisted = _committed_steps(run_dir)
    assert persisted[-1] == STEPS and len(persisted) <= 2 and set(persisted) <= {10, 20, 30}
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir()) == [str(s) for s in persisted]
    # the checkpoint holds the whole train state: parameters, optimizer state, step; and the data position
    arrays, data_state = _restore(run_dir, STEPS)
    assert int(arrays["step"]) == STEPS and any(k.startswith("opt_state/") for k in arrays)
    assert _same_arrays(_params(arrays), {f"params/{k}": v for k, v in _flat(straight.result.params).items()})
    assert (data_state["epoch"], data_state["position"]) == (0, STEPS * 4)  # batch 4: 120 of 261 windows


@pytest.mark.slow
def test_saves_hold_the_state_instead_of_copying_it(straight):
    """Once the non-donating step is compiled (in the background from step 1), a save only hands references to
    the checkpoint manager, which copies them while training goes on; the resume tests check that the steps run
    meanwhile (non-donating) give the same numbers bit for bit."""
    assert sorted(straight.saves) == [10, 20, 30]
    assert all(info["held"] for step, info in straight.saves.items() if step >= 20), straight.saves


def test_a_held_snapshot_keeps_the_state_until_it_is_released(tmp_path, write_tiny_config):
    """The in-memory engine's held state snapshot: the steps after it run without donation, so its arrays stay
    alive while a checkpoint would copy them; once it is released the step donates its input state again."""
    from angel_jax.train.engines import InMemoryEngine

    cfg = load_config(write_tiny_config(tmp_path, "held"))
    mesh = jax.make_mesh((1,), ("data",), devices=jax.devices()[:1], axis_types=(jax.sharding.AxisType.Auto,))
    engine = InMemoryEngine(cfg, mesh)
    tokens = np.random.default_rng(0).integers(0, 256, (4, 33), dtype=np.int32)
    batch = lambda: jax.device_put(tokens, engine.batch_sharding)  # noqa: E731
    try:
        engine.step(batch())
        snapshot = engine.state_snapshot()
        assert snapshot.held
        kept = [a for a in snapshot.arrays.values() if isinstance(a, jax.Array)]
        engine.step(batch())
        engine.step(batch())
        assert not any(a.is_deleted() for a in kept)
        snapshot.release()
        before = [a for a in jax.tree.leaves(engine.state) if isinstance(a, jax.Array)]
        engine.step(batch())
        assert any(a.is_deleted() for a in before)  # donating again
        # A process that writes no checkpoint asks for no held snapshot: the step keeps donating.
        unheld = engine.state_snapshot(may_hold=False)
        assert not unheld.held
        before = [a for a in jax.tree.leaves(engine.state) if isinstance(a, jax.Array)]
        engine.step(batch())
        assert any(a.is_deleted() for a in before)
    finally:
        engine.close()


@pytest.mark.slow
def test_metrics_file_has_the_fixed_names(straight):
    records = straight.records()
    assert [r["step"] for r in records] == list(range(1, STEPS + 1))  # log_every=1: one line per step
    for r in records:
        assert {"step", "time", "loss", "grad_norm", "update_norm", "lr"} <= set(r)
        assert all(math.isfinite(r[k]) for k in EXACT_KEYS)
    assert "perf/first_step_time" in records[0] and not set(PERF_KEYS) & set(records[0])
    cfg = load_config(straight.cfg_path)
    tokens_per_step = cfg.train.batch_size * cfg.model.seq_len
    for r in records[1:]:
        assert set(PERF_KEYS) <= set(r), r
        assert r["perf/mfu_is_estimate"] == 0.0  # a CPU's peak is stated from its spec (metrics.cpu_peak)
        assert all(r[k] > 0 for k in PERF_KEYS)
        # tokens/s and TFLOP/s follow from the step time (values are rounded to 6 decimals in the file)
        exact = straight.exact[r["step"]]
        assert exact["perf/tokens_per_s"] == pytest.approx(tokens_per_step / exact["perf/step_time"], rel=1e-9)
        assert exact["perf/tflops"] == pytest.approx(
            exact["perf/tokens_per_s"] * gpt.flops_per_token(cfg.model) / 1e12, rel=1e-9)
        assert r["perf/step_time"] == round(exact["perf/step_time"], 6)
    # the file holds the on_step values rounded to 6 decimals, and TrainResult.history the same records
    for r in records:
        for k in EXACT_KEYS:
            assert r[k] == round(straight.exact[r["step"]][k], 6)
    assert [{k: v for k, v in r.items() if k != "time"} for r in records] == straight.result.history
    # constant schedule after a 2-step warm-up that starts at lr / 2
    assert [r["lr"] for r in records[:3]] == [0.0015, 0.003, 0.003]


@pytest.mark.slow
def test_loss_decreases_on_a_learnable_corpus(straight):
    losses = [straight.exact[s]["loss"] for s in range(1, STEPS + 1)]
    assert losses[0] == pytest.approx(math.log(256), rel=0.05)  # untrained: near uniform over bytes
    assert np.mean(losses[-5:]) < losses[0] - 1.0, losses


# ------------------------------------------------------------------------------------------------ resume


@pytest.mark.slow
def test_resume_in_process_is_exact(straight, tmp_path, write_tiny_config):
    """6 steps, then the same run dir extended to 30: every step's numbers and the final state equal `straight`."""
    cfg_path = write_tiny_config(tmp_path, "resumed", checkpoint={"every": 4})
    first, exact_1 = _train(cfg_path, ["train.steps=6"])
    assert _committed_steps(first.run_dir, "memory") == [4, 6]  # every 4, and at the end
    # train.steps=30 resumes from the step-6 checkpoint (saving only at the end: checkpoints do not change numbers)
    second, exact_2 = _train(cfg_path, ["checkpoint.every=0"])
    assert sorted(exact_1) == list(range(1, 7)) and sorted(exact_2) == list(range(7, STEPS + 1))
    assert second.history[0]["step"] == 7 and "perf/first_step_time" in second.history[0]
    for step, values in {**exact_1, **exact_2}.items():
        for k in EXACT_KEYS:
            assert values[k] == straight.exact[step][k], (step, k)
    assert _leaves_equal(second.params, straight.result.params)
    # the metrics file reads like one run: one line per step, the same numbers as the straight run's file
    records = M.read_jsonl(second.run_dir / "metrics.jsonl")
    assert [r["step"] for r in records] == list(range(1, STEPS + 1))
    assert [[r[k] for k in EXACT_KEYS] for r in records] == [[r[k] for k in EXACT_KEYS] for r in straight.records()]
    # and the saved state of step 30 is the straight run's, bit for bit
    arrays, data_state = _restore(second.run_dir, STEPS)
    straight_arrays, straight_data = _restore(straight.run_dir, STEPS)
    assert _same_arrays(arrays, straight_arrays)  # parameters, optimizer state and step, bit for bit
    assert data_state == straight_data


def test_claim_memory_tier_keeps_only_its_runs_snapshots(tmp_path):
    from angel_jax.train.tier_ownership import OWNER_FILE, RUN_TOKEN_FILE, claim_memory_tier

    run, mem = tmp_path / "run", tmp_path / "mem"
    run.mkdir()
    (mem / "step_5").mkdir(parents=True)  # no owner, and a run directory without a token: not this run's
    assert claim_memory_tier(run, mem) is True and not (mem / "step_5").exists()
    assert (mem / OWNER_FILE).read_text() == (run / RUN_TOKEN_FILE).read_text()
    (mem / "step_6").mkdir()
    assert claim_memory_tier(run, mem) is False and (mem / "step_6").exists()  # its own: kept
    (run / RUN_TOKEN_FILE).unlink()  # the run directory was deleted and made again
    assert claim_memory_tier(run, mem) is True and not (mem / "step_6").exists()
    assert claim_memory_tier(run, tmp_path / "none") is False  # no tier yet: nothing to remove


def test_a_memory_tier_in_use_by_another_run_is_refused_and_nothing_of_it_deleted(tmp_path):
    """Run B names the memory_dir of run A, alive in another process: refused with A's pid before anything is
    deleted (B once logged "holds snapshots of another run ... removed step_30, step_40", A's live snapshots, and
    later resumed A's step as its own). Free again once A's process ends."""
    from angel_jax.checkpoint import CheckpointError
    from angel_jax.train.tier_ownership import claim_memory_tier, release_memory_tier

    run_a, run_b, mem = tmp_path / "a", tmp_path / "b", tmp_path / "mem"
    run_a.mkdir(), run_b.mkdir()
    claim_memory_tier(run_a, mem)  # A's tier: its owner token, and a snapshot
    release_memory_tier(mem)
    (mem / "step_30").mkdir()
    holder = subprocess.Popen([sys.executable, "-c", "import sys, time; from angel_jax.train.tier_ownership import "
                               "claim_memory_tier as c; c(sys.argv[1], sys.argv[2]); print('held', flush=True); "
                               "time.sleep(120)", str(run_a), str(mem)], stdout=subprocess.PIPE, text=True,
                              cwd=Path(__file__).resolve().parents[1])
    try:
        assert holder.stdout.readline().strip() == "held"
        with pytest.raises(CheckpointError, match=rf"memory_dir {mem} is in use by another run \(pid {holder.pid} "):
            claim_memory_tier(run_b, mem)
        assert (mem / "step_30").is_dir()  # A's snapshot: untouched
    finally:
        holder.kill()
        holder.wait(timeout=30)
    assert claim_memory_tier(run_b, mem) is True and not (mem / "step_30").exists()  # A is gone: a stale tier
    release_memory_tier(mem)


def test_a_new_run_at_a_deleted_runs_path_does_not_resume_it(tmp_path, write_tiny_config, caplog):
    """The memory tier outlives its run directory (/dev/shm survives `rm -rf runs/x`): a new run at the path of a
    deleted one starts at step 1, with the old snapshots removed and a warning, instead of resuming them."""
    cfg_path = write_tiny_config(tmp_path, "deleted", checkpoint={"every": 3})
    first, _ = _train(cfg_path, ["train.steps=3"])
    assert _committed_steps(first.run_dir, "memory") == [3]
    shutil.rmtree(first.run_dir)
    with caplog.at_level(logging.WARNING, logger="angel_jax.train.checkpointing"):
        second, exact = _train(cfg_path, ["train.steps=3"])
    assert sorted(exact) == [1, 2, 3]
    assert "holds snapshots of another run" in caplog.text
    # the new run's own snapshots are its own: extending it resumes them
    third, exact = _train(cfg_path, ["train.steps=4"])
    assert sorted(exact) == [4]


@pytest.mark.slow
def test_resume_false_run_owns_its_checkpoints(straight, tmp_path):
    run_dir = tmp_path / "restart"
    shutil.copytree(straight.run_dir, run_dir)  # an earlier 30-step run's checkpoints
    shutil.copytree(f"{straight.run_dir}.memtier", f"{run_dir}.memtier")
    earlier = _steps_in(run_dir / "checkpoints")
    try:
        result, exact = _train(straight.cfg_path, [f"train.run_dir={run_dir}", "train.resume=false",
                                                   "train.steps=3", "checkpoint.every=0",
                                                   f"checkpoint.memory_dir={run_dir}.memtier"])
    except AngelError as e:  # refusing to start over in a directory with checkpoints is an acceptable fix too
        assert "checkpoint" in str(e)
        return
    latest = max(_committed_steps(run_dir))
    archived = [p.name for p in run_dir.iterdir() if p.name.startswith("checkpoints.replaced-")]
    assert len(archived) == 1 and sorted(_steps_in(run_dir / archived[0] / "persistent")) == sorted(earlier)
    assert (run_dir / archived[0] / "memory").is_dir()  # the memory tier's snapshots were moved aside too
    # nothing was restored: the run computed straight's first 3 steps again
    assert sorted(exact) == [1, 2, 3] and all(exact[s][k] == straight.exact[s][k] for s in exact for k in EXACT_KEYS)
    assert latest == 3, f"the next resume would restore step {latest} of the earlier run"
    arrays, _ = _restore(run_dir, 3)
    assert _same_arrays(_params(arrays), {f"params/{k}": v for k, v in _flat(result.params).items()})


# ------------------------------------------------------------------------------------- real processes


def _env() -> dict[str, str]:
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH")) if p)
    return env


class Procs:
    """Children started with `timeout -s KILL` in their own session; any still alive at teardown are killed."""

    def __init__(self, directory: Path):
        self.directory = directory
        self.started: list[subprocess.Popen] = []

    def start(self, name: str, *args: str, faults: str = "") -> subprocess.Popen:
        """`faults`: ANGEL_JAX_FAULTS for this process (angel_jax/tol/faults.py)."""
        cmd = ["timeout", "-s", "KILL", str(PROC_LIMIT), sys.executable, "-m", "angel_jax.cli", *args]
        env = dict(_env(), **({"ANGEL_JAX_FAULTS": faults} if faults else {}))
        with open(self.directory / f"{name}.out", "w") as out, open(self.directory / f"{name}.err", "w") as err:
            proc = subprocess.Popen(cmd, cwd=self.directory, env=env, stdout=out, stderr=err,
                                    start_new_session=True)
        self.started.append(proc)
        return proc

    def wait(self, proc: subprocess.Popen, timeout: float = PROC_LIMIT) -> int:
        try:
            return proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.kill(proc)
            raise

    def run(self, name: str, *args: str) -> tuple[int, str, str]:
        rc = self.wait(self.start(name, *args))
        return rc, *self.output(name)

    def output(self, name: str) -> tuple[str, str]:
        return (self.directory / f"{name}.out").read_text(), (self.directory / f"{name}.err").read_text()

    @staticmethod
    def kill(proc: subprocess.Popen) -> None:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait(timeout=60)

    def close(self) -> None:
        for proc in self.started:
            if proc.poll() is None:
                self.kill(proc)


@pytest.fixture
def procs(tmp_path):
    p = Procs(tmp_path)
    yield p
    p.close()


@pytest.mark.slow
def test_resume_after_sigkill_is_exact(straight, tmp_path, procs, write_tiny_config):
    """`angel-jax train` SIGKILLed after a checkpoint committed, then run again: the same numbers as `straight`."""
    cfg_path = write_tiny_config(tmp_path, "killed", checkpoint={"every": 4, "keep": 2})
    run_dir = tmp_path / "killed"
    # Step 9 never finishes in the victim: the kill comes after a checkpoint and before the run's end, however fast
    # the machine (idle, the tiny run once finished all 30 steps between the check and the kill).
    victim = procs.start("victim", "train", str(cfg_path), faults="hang@9")
    deadline = time.monotonic() + PROC_LIMIT
    while not [s for s in _committed_steps(run_dir, "memory") if s >= 4]:
        assert victim.poll() is None, f"the run ended before a checkpoint was committed: {procs.output('victim')}"
        assert time.monotonic() < deadline, "no checkpoint committed in time"
        time.sleep(0.01)
    committed = max(_committed_steps(run_dir, "memory"))
    killed_at = time.time()
    procs.kill(victim)
    assert victim.returncode == -signal.SIGKILL, procs.output("victim")
    assert committed < STEPS
    out, _ = procs.output("victim")
    assert f"{jax.device_count()} x cpu over 1 process(es), platform cpu" in out  # the devices this process sees

    rc, out, err = procs.run("resume", "train", str(cfg_path))
    assert rc == 0, err[-3000:]
    m = re.search(r"resumed from the checkpoint of step (\d+)", err)
    assert m, err[-3000:]
    resumed_from = int(m.group(1))
    assert committed <= resumed_from < STEPS and resumed_from % 4 == 0
    assert f"done: step {STEPS}" in out

    records = M.read_jsonl(run_dir / "metrics.jsonl")
    assert [r["step"] for r in records] == list(range(1, STEPS + 1)), "one line per step after truncation"
    for r, ref in zip(records, straight.records()):
        assert [r[k] for k in EXACT_KEYS] == [ref[k] for k in EXACT_KEYS], r["step"]
    # steps up to the checkpoint come from the killed process, the rest were computed (only) by the second one
    assert all(r["time"] <= killed_at + 0.01 for r in records[:resumed_from])
    assert all(r["time"] > killed_at for r in records[resumed_from:])
    assert [r["step"] for r in records if "perf/first_step_time" in r] == [1, resumed_from + 1]
    # the final checkpoint holds the straight run's state, bit for bit
    assert _committed_steps(run_dir)[-1] == STEPS
    assert _same_arrays(_restore(run_dir, STEPS)[0], _restore(straight.run_dir, STEPS)[0])


@pytest.mark.parametrize("huge", [{"d_model": 1_048_576, "n_heads": 8}, {"n_layers": 100_000},
                                  {"vocab_size": 1_000_000_000}])
def test_an_in_memory_model_that_cannot_fit_is_refused_before_anything_is_written(tmp_path, write_tiny_config, huge):
    """memory.mode=in_memory with a state larger than the device (here: the host RAM the CPU device may use) is one
    line naming the bytes and the way out, raised before the run directory gets its config or a checkpoint; it
    once printed "576.01 TiB on each device", started, and ended in a 47-line out-of-memory traceback."""
    from angel_jax.config import ConfigError

    cfg = load_config(write_tiny_config(tmp_path, "huge", model=huge, memory={"mode": "in_memory"}))
    # A state past the device but within the host's reach is sent to the paged engine; one past every tier of
    # the host (huge d_model, huge vocabulary) is refused as such, before any engine is chosen.
    with pytest.raises(ConfigError, match=r"memory\.mode=in_memory: the training state needs .* on each device "
                                          r".* set memory\.mode=paged|training state needs .* on this host, more "
                                          r"than all it has .* in any memory\.mode: shrink the model"):
        train(cfg)
    assert not (cfg.run_dir / "config.yaml").exists() and not (cfg.run_dir / "checkpoints").exists()
