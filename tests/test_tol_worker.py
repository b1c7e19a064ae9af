"""The worker's environment (worker.py): the launcher's variables, cluster detection, kill points."""

from __future__ import annotations

import pytest

from angel_jax.tol.worker import WorkerEnv, ckpt_kill_for_attempt, cluster_detected


def test_worker_env():
    env = {"ANGEL_JAX_COORDINATOR_ADDRESS": "127.0.0.1:5000", "ANGEL_JAX_NUM_PROCESSES": "2",
           "ANGEL_JAX_PROCESS_ID": "1", "ANGEL_JAX_ATTEMPT": "3", "ANGEL_JAX_NODE": "local2"}
    w = WorkerEnv.from_environ(env)
    assert (w.launched, w.num_processes, w.process_id, w.attempt, w.node) == (True, 2, 1, 3, "local2")
    assert not WorkerEnv.from_environ({}).launched
    with pytest.raises(ValueError, match="ANGEL_JAX_NUM_PROCESSES and ANGEL_JAX_PROCESS_ID"):
        WorkerEnv.from_environ({"ANGEL_JAX_COORDINATOR_ADDRESS": "h:1"})
    with pytest.raises(ValueError, match="ANGEL_JAX_ATTEMPT='x' is not an integer"):
        WorkerEnv.from_environ({"ANGEL_JAX_ATTEMPT": "x"})
    assert cluster_detected({"SLURM_JOB_ID": "1", "SLURM_STEP_NODELIST": "n[1-2]", "SLURM_NTASKS": "2",
                             "SLURM_PROCID": "0", "SLURM_LOCALID": "0"}) == "slurm"
    assert cluster_detected({"KUBERNETES_SERVICE_HOST": "10.0.0.1", "JOB_COMPLETION_INDEX": "0"}) == "kubernetes"
    assert cluster_detected({"HOME": "/"}) is None


def test_checkpoint_kill_point_scoped_to_an_attempt():
    assert ckpt_kill_for_attempt("snapshot.copy@8", 3) == "snapshot.copy@8"
    assert ckpt_kill_for_attempt("snapshot.copy@8:attempt=0", 0) == "snapshot.copy@8"
    assert ckpt_kill_for_attempt("snapshot.copy@8:attempt=0", 1) is None
    with pytest.raises(ValueError, match="expected <point>"):
        ckpt_kill_for_attempt("snapshot.copy@8:rank=0", 0)


def test_a_worker_whose_run_cannot_go_on_as_configured_exits_78(tmp_path):
    """A real worker process whose config the run refuses (more validation batches than the split holds) exits
    with EXIT_CONFIG, which the watchdog takes for a failure no restart mends, and says why on one line."""
    import subprocess
    import sys
    from pathlib import Path

    from angel_jax.errors import EXIT_CONFIG

    config = Path(__file__).resolve().parent.parent / "experiments" / "gpt_tiny.yaml"
    done = subprocess.run(["timeout", "-s", "KILL", "120", sys.executable, "-m", "angel_jax.tol.worker", str(config),
                           f"train.run_dir={tmp_path / 'run'}", f"data.dir={tmp_path / 'data'}", "train.steps=2",
                           "train.eval_batches=100000"], cwd=tmp_path, capture_output=True, text=True)
    assert done.returncode == EXIT_CONFIG == 78, done.stderr[-3000:]
    assert "exits with status 78: ConfigError: 'train.eval_batches'=100000" in done.stderr
