"""The in-memory engine with its parameters and optimizer state sharded over the mesh's 'fsdp' axis (ZeRO-3 via
NamedSharding, train/sharding.py): the same losses as one device, a quarter of the bytes on each of four devices,
checkpoints of sharded state, and the same across two processes (jax.distributed, gloo)."""

from __future__ import annotations

import dataclasses
import json
import re
import socket
import subprocess
import sys
from pathlib import Path

import jax
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from angel_jax.config import Config, ConfigError, MeshConfig, ModelConfig, OptimizerConfig, TrainConfig, \
    config_from_dict, dump_yaml
from angel_jax.train.checkpointing import TrainCheckpointer
from angel_jax.train.protocol import path_name
from angel_jax.train.weights import load_params
from angel_jax.train.engines import fits_in_memory, state_bytes
from angel_jax.train.sharding import fsdp_spec
import models

# The tiny GPT the multi-device checks train (fsdp_check.py, fsdp_mp_check.py): Adam, whose normalised step
# would turn a wrongly reduced gradient's error into a visible change of the loss.
MODEL = ModelConfig(vocab_size=256, seq_len=32, d_model=64, n_layers=2, n_heads=2, compute_dtype="float32")
STEPS, BATCH, SAVE_AT = 20, 8, 10
ROOT = Path(__file__).resolve().parents[1]
LIMIT = 240  # seconds before a check's process is killed


def cfg(micro: int = 0) -> Config:
    return Config(model=MODEL, optimizer=OptimizerConfig(name="adamw", lr=3e-3, warmup_steps=2, schedule="constant"),
                  train=TrainConfig(steps=STEPS, batch_size=BATCH, micro_batch_size=micro))


def test_mesh_shape_from_the_config():
    assert MeshConfig().shape(4) == (4, 1)  # replicated: data parallel over every device
    assert MeshConfig(fsdp=4).shape(4) == (1, 4)
    assert MeshConfig(fsdp=2).shape(4) == MeshConfig(data=2, fsdp=0).shape(4) == (2, 2)
    assert MeshConfig(fsdp=0).shape(4) == MeshConfig(data=0, fsdp=0).shape(4) == (1, 4)  # 0: all devices
    for data, fsdp in ((0, 3), (3, 0), (2, 1), (0, 8)):
        with pytest.raises(ConfigError, match=rf"'mesh\.data'={data} x 'mesh\.fsdp'={fsdp} .* 4 devices"):
            MeshConfig(data=data, fsdp=fsdp).shape(4)
    with pytest.raises(ConfigError, match=r"'mesh\.fsdp' .* must be >= 0"):
        config_from_dict({"mesh": {"fsdp": -1}})


def test_the_rule_shards_the_largest_divisible_dimension():
    assert fsdp_spec((256, 64), 4) == P("fsdp", None)
    assert fsdp_spec((2, 64, 192), 4) == P(None, None, "fsdp")  # blocks stacked on a leading layer axis
    assert fsdp_spec((2, 6, 64), 4) == P(None, None, "fsdp")  # the largest divisible one, not the largest
    assert fsdp_spec((64, 64), 4) == P("fsdp", None)  # the first of equal ones
    assert fsdp_spec((), 4) == fsdp_spec((3, 5), 4) == fsdp_spec((2,), 4) == P()  # scalars, indivisible: replicated
    assert fsdp_spec((256, 64), 1) == P()


def test_auto_mode_counts_the_sharded_state():
    """memory.mode=auto judges the bytes each device keeps: parameters and Adam's moments (float32: 12 bytes per
    parameter) divided by mesh.fsdp, the gradients (4 bytes) whole."""
    n = models.get(MODEL).param_count["total"]
    assert state_bytes(cfg()) == 16 * n and state_bytes(cfg(), 4) == 4 * n + 12 * n // 4
    roomy = dataclasses.replace(cfg(), memory=dataclasses.replace(cfg().memory, device_budget=int(8 * n / 0.75)))
    assert fits_in_memory(roomy, jax.devices()[0], 4) and not fits_in_memory(roomy, jax.devices()[0])


def _run(*args: str) -> dict:
    """A check's process, with fp32 matmuls at full precision: it compares sharded layouts with one device."""
    from conftest import comparing_env  # (here: the check scripts import this module, not the test set-up)

    run = subprocess.run(["timeout", "-s", "KILL", str(LIMIT), sys.executable, *args], capture_output=True,
                         text=True, cwd=ROOT, env=comparing_env())
    assert run.returncode == 0, run.stderr[-3000:]
    return json.loads(run.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def four_devices() -> dict:
    return _run(str(Path(__file__).with_name("fsdp_check.py")))


@pytest.mark.compares_programs
def test_sharded_losses_equal_one_device(four_devices):
    """fsdp 4, and data 2 x fsdp 2 with gradient accumulation, against the whole state on one device."""
    losses = four_devices["losses"]
    assert len(losses["single"]) == STEPS and losses["single"][-1] < 0.5 * losses["single"][0]  # it learns
    for layout in ("fsdp4", "data2xfsdp2-micro1"):
        np.testing.assert_allclose(losses[layout], losses["single"], rtol=1e-5, err_msg=layout)


def test_each_device_holds_a_quarter_of_the_state(four_devices):
    """Measured from the live arrays' shards on each device, before and after training (the applied state keeps
    its layout): a quarter of the whole state (on one device: what every device holds replicated), give or take
    the few replicated scalars."""
    nbytes = four_devices["bytes"]
    (whole,) = nbytes["single"]
    for layout, share in (("fsdp4", 4), ("fsdp4-after", 4), ("data2xfsdp2", 2)):
        assert len(nbytes[layout]) == 4, layout
        for per_device in nbytes[layout]:
            assert whole / share <= per_device <= 1.01 * whole / share, (layout, per_device, whole)


def test_a_checkpoint_of_sharded_state_round_trips(four_devices):
    ckpt = four_devices["checkpoint"]
    assert ckpt["step"] == SAVE_AT and ckpt["bit_exact"], ckpt
    assert ckpt["laid_out"] and ckpt["sharded_leaves"] > 0.9 * ckpt["leaves"], ckpt  # loaded sharded, not whole
    assert ckpt["resumed"] == four_devices["losses"]["fsdp4"][SAVE_AT:]  # the steps after it, bit for bit


def test_the_paged_engine_refuses_a_mesh_that_does_not_shard_over_every_device(four_devices):
    # (the paged engine over several devices: test_zero.py)
    assert re.search(r"shards every page over all 4 devices .*set mesh\.fsdp=0", four_devices["paged_refused"]), \
        four_devices.get("paged_refused")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.compares_programs
@pytest.mark.slow
def test_two_processes_shard_the_state_between_them(four_devices, tmp_path):
    """2 processes x 1 device, fsdp 2: the state split across the processes, the losses of one device. Each process
    checkpoints only its pieces of the state (about half of it), restores them bit for bit, and one process
    resumes both processes' pieces assembled into the whole state, bit for bit the state they held."""
    from conftest import comparing_env

    script, port = str(Path(__file__).with_name("fsdp_mp_check.py")), str(_free_port())
    procs = [subprocess.Popen(["timeout", "-s", "KILL", str(LIMIT), sys.executable, script, port, str(rank),
                               str(tmp_path)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT,
                              env=comparing_env())
             for rank in (0, 1)]
    outputs = [p.communicate() for p in procs]
    for p, (_, err) in zip(procs, outputs):
        assert p.returncode == 0, err[-3000:]
    out = json.loads(outputs[0][0].strip().splitlines()[-1])
    np.testing.assert_allclose(out["losses"], four_devices["losses"]["single"], rtol=1e-5)
    (whole,) = four_devices["bytes"]["single"]
    (mine,) = out["bytes"]
    assert whole / 2 <= mine <= 1.01 * whole / 2, (mine, whole)
    assert out["per_process"] and out["sharded_leaves"] > 0 and out["round_trip"], out
    # Its snapshot: its own pieces, about half the state (leaves no dimension of which 2 divides are whole).
    assert out["state_bytes"] / 2 <= out["snapshot_bytes"] <= 1.01 * out["state_bytes"] / 2, out
    assert (out["step"], out["tier"], out["restored_bit_exact"]) == (STEPS, "memory", True), out
    # This process (one): the two processes' pieces assembled from their persistent tiers.
    c = dataclasses.replace(cfg(), checkpoint=dataclasses.replace(cfg().checkpoint, memory_dir=str(tmp_path / "mem")))
    checkpointer = TrainCheckpointer(c, tmp_path / "run", primary=True)
    step, arrays, _, tier = checkpointer.restore_latest()
    checkpointer.close()
    assert (step, tier) == (STEPS, "persistent (the shards of 2 processes)")
    expected = {k.replace("|", "/"): v for k, v in np.load(tmp_path / "whole.npz").items()}
    assert sorted(arrays) == sorted(expected)
    for name, value in expected.items():
        np.testing.assert_array_equal(np.asarray(arrays[name]), value, err_msg=name)
    # The weights reader (export, sample): the parameters, assembled the same way.
    (tmp_path / "run" / "config.yaml").write_text(dump_yaml(c))
    loaded = load_params(tmp_path / "run")
    flat = {"params/" + path_name(p): a for p, a in jax.tree_util.tree_flatten_with_path(loaded.params)[0]}
    assert loaded.step == STEPS and sorted(flat) == sorted(k for k in expected if k.startswith("params/"))
    for name, value in flat.items():
        np.testing.assert_array_equal(value, expected[name], err_msg=name)
