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
