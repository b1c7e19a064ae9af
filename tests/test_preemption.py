"""A run stopped by SIGTERM (a preemption: spot machines, Slurm's --signal, Kubernetes' grace period) or SIGINT
(Ctrl-C) finishes the step in flight, saves it, and exits 143 / 130; a resume from that checkpoint trains exactly as
the uninterrupted run. The signals are real: the child process sends one to itself after a chosen step
(`ANGEL_JAX_FAULTS=signal@S:num=N`), or the test sends one from outside."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import jax
import pytest

from angel_jax.config import load_config
from angel_jax.train import metrics as M
from angel_jax.train.loop import train
from angel_jax.train.preemption import StopSignals

ROOT = Path(__file__).resolve().parents[1]
CHILD_LIMIT_S = 180  # `timeout -s KILL` guard of the training child
STEPS, EVERY = 30, 10


def _env(faults: str = "") -> dict[str, str]:
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH")) if p)
    env.pop("ANGEL_JAX_FAULTS", None)
    if faults:
        env["ANGEL_JAX_FAULTS"] = faults
    return env


def _train(cfg_path: Path, faults: str = "", *overrides: str) -> subprocess.CompletedProcess:
    return subprocess.run(["timeout", "-s", "KILL", str(CHILD_LIMIT_S), sys.executable, "-m", "angel_jax.cli",
                           "train", str(cfg_path), *overrides], cwd=cfg_path.parent, env=_env(faults),
                          capture_output=True, text=True)


def _losses(run_dir: Path) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in M.read_jsonl(run_dir / "metrics.jsonl") if "loss" in r}


def _persisted(run_dir: Path) -> list[int]:
    return sorted(int(p.name) for p in (run_dir / "checkpoints").iterdir() if p.name.isdigit())


@pytest.mark.slow
def test_sigterm_saves_the_step_in_flight_and_the_resume_is_exact(tmp_path, write_tiny_config):
    straight_cfg = write_tiny_config(tmp_path, "straight", train={"steps": STEPS}, checkpoint={"every": EVERY})
    # keep_every: step 10 is persisted however slow its copy is (a save that has not started persisting when a
    # newer one arrives is otherwise superseded by it, and on a busy machine step 14 can arrive first).
    cfg = write_tiny_config(tmp_path, "stopped", train={"steps": STEPS},
                            checkpoint={"every": EVERY, "keep_every": EVERY})
    train(load_config(straight_cfg))  # the uninterrupted run, in this process (a child's imports cost ~10 s)

    stopped = _train(cfg, "signal@13:num=15")
    # Step 14 was dispatched when step 13's metrics (and the signal) came: it is finished and saved, not lost.
    assert stopped.returncode == 143, stopped.stderr[-3000:]
    assert "stopped by SIGTERM after step 14: newest persisted checkpoint: step 14" in stopped.stderr
    assert "Traceback" not in stopped.stderr and "terminate called" not in stopped.stderr
    assert _persisted(tmp_path / "stopped") == [10, 14]
    assert max(_losses(tmp_path / "stopped")) == 14

    resumed = _train(cfg)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "resumed from the checkpoint of step 14" in resumed.stdout + resumed.stderr
    assert _losses(tmp_path / "stopped") == _losses(tmp_path / "straight")  # every step's loss, bit for bit


@pytest.mark.slow
def test_sigint_from_outside_saves_and_exits_130_without_an_abort(tmp_path, write_tiny_config):
    """Ctrl-C (SIGINT from another process, while the run is mid-training): no abort (it once ended in `terminate
    called without an active exception`, exit 134, nothing saved)."""
    cfg = write_tiny_config(tmp_path, "run", train={"steps": 100_000, "log_every": 1},
                            checkpoint={"every": 100_000})
    # The trainer itself, not under `timeout` (which would pass the signal on: a second SIGINT); the finally below
    # is the SIGKILL guard.
    child = subprocess.Popen([sys.executable, "-m", "angel_jax.cli", "train", str(cfg)], cwd=tmp_path, env=_env(),
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        metrics = tmp_path / "run" / "metrics.jsonl"
        deadline = time.monotonic() + CHILD_LIMIT_S - 30
        while not (metrics.exists() and len(metrics.read_text().splitlines()) >= 20):
            assert child.poll() is None and time.monotonic() < deadline, "the run never reached step 20"
            time.sleep(0.1)
        child.send_signal(signal.SIGINT)
        out, err = child.communicate(timeout=CHILD_LIMIT_S)
    finally:
        if child.poll() is None:
            child.kill()
            child.communicate()
    assert child.returncode == 130, err[-3000:]
    assert "terminate called" not in err and "Traceback" not in err
    saved = _persisted(tmp_path / "run")
    assert len(saved) == 1 and saved[0] >= 20 and f"stopped by SIGINT after step {saved[0]}" in err


def test_a_second_signal_stops_at_once_and_the_handlers_are_restored():
    before = signal.getsignal(signal.SIGTERM)
    with StopSignals() as stop:
        assert not stop.requested
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(0.01)  # (the handler runs between bytecodes of this thread)
        assert stop.requested and stop.name == "SIGTERM"
        with pytest.raises(SystemExit) as e:
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(0.5)
        assert e.value.code == 143
    assert signal.getsignal(signal.SIGTERM) is before


def test_a_disabled_stop_installs_nothing():
    before = signal.getsignal(signal.SIGINT)
    with StopSignals(enabled=False) as stop:
        assert signal.getsignal(signal.SIGINT) is before and not stop.enabled


def test_one_process_stops_by_its_own_handlers_and_a_job_by_jax_preemption_service():
    """Outside a jax.distributed job the signal handlers stop the run; inside one, only the step every process
    agrees on may (a process that stopped on its own signal would leave its peers waiting in a collective: the
    multi-process behaviour is test_watchdog_recovery's SIGTERM test, with real processes)."""
    from angel_jax.train.preemption import SyncedStop, stop_source

    assert not jax.distributed.is_initialized()
    mine = stop_source(True)
    assert isinstance(mine, StopSignals) and mine.enabled
    assert not stop_source(False).enabled
    assert not mine.should_stop(3)
    synced = SyncedStop()
    assert not synced.should_stop(3)  # no job: jax answers False, as for a job that got no notice
    assert (synced.signum, synced.name, synced.requested) == (signal.SIGTERM, "SIGTERM", False)


def test_a_worker_with_on_signal_off_keeps_jax_preemption_service_away_from_sigterm(tmp_path, write_tiny_config):
    """checkpoint.on_signal false: stop at once, without a save. The preemption service would take SIGTERM over
    (and only record it), so the worker turns it off and its own handler ends it."""
    from angel_jax.tol.worker import WorkerEnv, _configure_jax

    before = (jax.config.jax_enable_preemption_service, jax.config.jax_cpu_collectives_implementation)
    try:
        for on_signal, service in ((True, True), (False, False)):
            jax.config.update("jax_enable_preemption_service", True)
            cfg = load_config(write_tiny_config(tmp_path, f"w{on_signal}", checkpoint={"on_signal": on_signal},
                                                resilience={"compile_cache": False}))
            _configure_jax(cfg, WorkerEnv.from_environ({}))
            assert jax.config.jax_enable_preemption_service is service
    finally:
        jax.config.update("jax_enable_preemption_service", before[0])
        jax.config.update("jax_cpu_collectives_implementation", before[1])
