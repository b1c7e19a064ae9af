"""The paged engine with every page sharded over the devices (ZeRO-3: memory/sharded_layout.py, schedule/zero.py).

The layout's arithmetic runs here; the engine runs in its own processes (zero_check.py: one process with four
CPU devices; zero_mp_check.py: two processes of two devices each, jax.distributed over gloo, the host updates
shard by shard as on an accelerator), each against the
in-memory engine on one device: the same losses over 20 steps (10 for the two processes), with a device budget of three quarters of a rank's share of the
state (most stages stream), and each device holding 1/N of the pages."""

from __future__ import annotations

import dataclasses
import functools
import json
import socket
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from angel_jax.config import Config, MemoryConfig, ModelConfig, MoEConfig, OptimizerConfig, TrainConfig
from angel_jax.memory.layout import to_bits
from angel_jax.memory.sharded_layout import ShardedPageLayout, chunks
import models

ROOT = Path(__file__).resolve().parents[1]
LIMIT = 300  # seconds before a check's process is killed
RANKS, BATCH, STEPS = 4, 8, 20
DISK_STEPS = 8  # the checks with every page on disk, and in accumulation passes
MP_STEPS = 8  # the two-process check's (each of its collectives a message between processes: slower steps)
MODEL = ModelConfig(d_model=64, n_layers=8, n_heads=2, seq_len=16, compute_dtype="float32")
PAGE = 12_496 * 2  # half a rank's share of a block's parameters (199,936 B / 4): two pages each, padding only in
# the embedding's and head's last pages (under 4% of the state)


MOE_MODEL = ModelConfig(d_model=32, n_layers=2, n_heads=2, seq_len=16, compute_dtype="float32",
                        moe=MoEConfig(experts=8, top_k=2, capacity_factor=1.25, every=1))
MOE_STEPS = 6  # expert parallelism: 8 experts, 2 on each of the 4 ranks


def cfg() -> Config:
    return Config(model=MODEL, optimizer=OptimizerConfig(name="adamw", lr=1e-3, warmup_steps=2),
                  train=TrainConfig(steps=STEPS, batch_size=BATCH))


def moe_cfg(paged: bool = False) -> Config:
    """The MoE model; `paged`: sharded pages, a device budget just above the plan's minimum, which streams every stage."""
    base = Config(model=MOE_MODEL, optimizer=OptimizerConfig(name="adamw", lr=1e-3, warmup_steps=2),
                  train=TrainConfig(steps=MOE_STEPS, batch_size=BATCH))
    if not paged:
        return base
    return dataclasses.replace(base, memory=MemoryConfig(mode="paged", page_size=4096, device_budget=700_000))


def state_bytes() -> int:
    """fp32 parameters and Adam's two moments."""
    return 3 * 4 * models.get(MODEL).param_count["total"]


def paged(ranks: int = RANKS) -> Config:
    """Pages sharded over `ranks` devices, each with a device budget of three quarters of its share of the state
    (what is left after the activations holds one or two stages)."""
    return dataclasses.replace(cfg(), memory=MemoryConfig(mode="paged", page_size=PAGE,
                                                          device_budget=3 * state_bytes() // ranks // 4))


@functools.lru_cache(maxsize=1)
def data() -> list:
    from test_paged import batches

    return batches(STEPS, MODEL, BATCH)


def tier_bytes(tier) -> dict[str, int]:
    """Page bytes an array tier holds on each device (by id), from the live shards of its arrays."""
    out: dict[str, int] = {}
    for pid in tier.page_ids():
        for shard in tier.get(pid).addressable_shards:
            out[str(shard.device.id)] = out.get(str(shard.device.id), 0) + shard.data.nbytes
    return out


# --------------------------------------------------------------------------------------------- the layout


def _tree(rng: np.random.Generator) -> dict:
    return {"w": rng.normal(size=(5, 7)).astype(np.float32), "b": rng.normal(size=(3,)).astype(np.float32),
            "n": np.arange(11, dtype=np.int32), "big": rng.normal(size=(40,)).astype(np.float32)}


def test_a_rank_holds_one_chunk_of_every_leaf_and_the_global_pages_give_the_leaves_back():
    tree = _tree(np.random.default_rng(0))
    layout = ShardedPageLayout.build([("s", tree)], 64, ranks=4)  # 16 float32 per rank page: 'big' spans pages
    stage = layout.stage("s")
    pages = stage.pack(tree)
    assert [p.shape[0] for p in pages] == [4 * p.length for p in stage.rank.pages] == [s.length for s in stage.pages]
    for r in range(4):  # rank r's shard of every global page is its own pages
        mine = stage.rank.pack(chunks(tree, 4, r))
        for page, own in zip(pages, mine):
            np.testing.assert_array_equal(page.reshape(4, -1)[r], own)
    # 35 elements over 4 ranks: 9 each, the last padded with 1 zero
    assert chunks(tree, 4, 3)["w"].tolist() == tree["w"].reshape(-1)[27:].tolist() + [0.0]
    back = stage.unpack(pages)
    for key in tree:
        np.testing.assert_array_equal(back[key], tree[key])
    on_device = stage.unpack(tuple(jnp.asarray(p) for p in pages))  # the jnp path the stage functions take
    for key in tree:
        np.testing.assert_array_equal(np.asarray(on_device[key]), tree[key])
    assert layout.num_pages == len(stage.pages) and layout.total_bytes == sum(p.nbytes for p in pages)


def test_scatter_rows_are_what_each_rank_packs():
    tree = _tree(np.random.default_rng(1))
    stage = ShardedPageLayout.build([("s", tree)], 64, ranks=4).stage("s")
    rows = stage.scatter_rows(jax.tree.map(jnp.asarray, tree))
    for got, page in zip(rows, stage.pack(tree)):
        np.testing.assert_array_equal(to_bits(np.asarray(got).reshape(-1)), page)  # rows: values; pages: bits


def test_expert_weights_on_pages_of_their_own_stay_on_the_rank_that_holds_those_experts():
    rng = np.random.default_rng(2)
    tree = {"dense": rng.normal(size=(5, 7)).astype(np.float32),
            "experts": rng.normal(size=(8, 3, 4)).astype(np.float32)}  # 8 experts: 2 per rank
    apart = lambda stage, path: path == "['experts']"  # noqa: E731
    stage = ShardedPageLayout.build([("s", tree)], 64, ranks=4, apart=apart).stage("s")
    assert [p.apart for p in stage.rank.pages] == [False, True, True]  # 9 | 24 elements a rank, 16 to a page
    assert stage.keeps_apart
    pages = stage.pack(tree)
    back = stage.unpack(pages)  # global pages: whole leaves, as without `apart`
    np.testing.assert_array_equal(back["experts"], tree["experts"])
    for r in range(4):  # what rank r's call sees: the whole dense leaf, its own 2 experts
        mine = [jnp.asarray(p) if not spec.apart else jnp.asarray(p.reshape(4, -1)[r])
                for p, spec in zip(pages, stage.rank.pages)]
        local = stage.unpack(mine, local=True)
        np.testing.assert_array_equal(np.asarray(local["dense"]), tree["dense"])
        np.testing.assert_array_equal(np.asarray(local["experts"]), tree["experts"][2 * r:2 * r + 2])
        rows = stage.scatter_rows(local, local=True)  # and back: the dense pages' rows, the rank's own pages
        np.testing.assert_array_equal(to_bits(np.asarray(rows[0])), pages[0].reshape(4, -1))
        for got, page in zip(rows[1:], pages[1:]):
            np.testing.assert_array_equal(to_bits(np.asarray(got)), page.reshape(4, -1)[r])
    # 6 experts do not split over 4 ranks: their pages are apart, but gathered like the others
    odd = {"experts": tree["experts"][:6]}
    assert not ShardedPageLayout.build([("s", odd)], 64, ranks=4, apart=apart).stage("s").keeps_apart


# --------------------------------------------------------------------------------------------- the engine


def _check(script: str, *argv: tuple[str, ...]) -> list[subprocess.Popen]:
    """One process running `script` per argument vector (one without arguments when none is given), with fp32
    matmuls at full precision: the checks compare the sharded engine with the in-memory one on one device."""
    from conftest import comparing_env  # (here: the check scripts import this module, not the test set-up)

    return [subprocess.Popen(["timeout", "-s", "KILL", str(LIMIT), sys.executable, str(ROOT / "tests" / script),
                              *a], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT,
                             env=comparing_env())
            for a in (argv or [()])]


def _result(procs: list[subprocess.Popen]) -> dict:
    outputs = [p.communicate() for p in procs]
    for p, (_, err) in zip(procs, outputs):
        assert p.returncode == 0, err[-3000:]
    return json.loads(outputs[0][0].strip().splitlines()[-1])


@pytest.fixture(scope="module")
def checks() -> dict:
    """Both checks, run at once: the two processes' gloo collectives leave the cores idle between messages."""
    port = str(_free_port())
    two = _check("zero_mp_check.py", (port, "0"), (port, "1"))
    four = _check("zero_check.py")
    return {"four_devices": _result(four), "two_processes": _result(two)}


@pytest.fixture(scope="module")
def four_devices(checks) -> dict:
    return checks["four_devices"]


@pytest.mark.compares_programs
def test_sharded_paged_losses_equal_one_device(four_devices):
    out = four_devices
    assert out["streamed"] >= 0.75 * out["stages"], out["report"]
    ref, got = out["reference"], out["paged"]
    assert ref["loss"][-1] < ref["loss"][0] - 0.3, "the toy stream must be learnable"
    np.testing.assert_allclose(got["loss"], ref["loss"], rtol=1e-5)
    np.testing.assert_allclose(got["grad_norm"], ref["grad_norm"], rtol=1e-4)


@pytest.mark.compares_programs
def test_a_tied_head_sharded_over_the_ranks_trains_as_on_one_device(four_devices):
    out = four_devices["tied"]
    np.testing.assert_allclose(out["paged"]["loss"], out["reference"]["loss"], rtol=1e-5)
    np.testing.assert_allclose(out["paged"]["grad_norm"], out["reference"]["grad_norm"], rtol=1e-4)


def test_each_device_holds_a_quarter_of_the_pages(four_devices):
    out = four_devices
    for tier in ("device", "host"):
        per_device = out[tier]
        assert sorted(per_device) == ["0", "1", "2", "3"], per_device
        assert len(set(per_device.values())) == 1, per_device  # an even split
        assert sum(per_device.values()) == out["tier_bytes"][tier]  # the tier counts the pages' global bytes
    mine = out["device"]["0"] + out["host"]["0"]  # parameters and optimizer state pages (gradients are transient)
    whole = out["state"]  # the reference's measured state: parameters, moments and a step count
    assert whole / RANKS <= mine * 1.0001 and mine <= 1.05 * whole / RANKS, (mine, whole / RANKS)
    assert "bytes below per rank" in out["report"][0]


@pytest.mark.compares_programs
def test_sharded_pages_homed_on_disk_train_as_on_one_device(four_devices):
    out = four_devices["disk"]
    assert out["homes"] == {"params": 9, "gradients": 9, "optimizer": 9} and out["stages"] == 10, out
    assert out["shard_by_shard"] and not out["in_place"]  # the accelerator's path: rank by rank, copies
    np.testing.assert_allclose(out["losses"], four_devices["reference"]["loss"][:DISK_STEPS], rtol=1e-5)


@pytest.mark.compares_programs
def test_sharded_pages_in_accumulation_passes_train_as_on_one_device(four_devices):
    """Two micro-batches of one row per rank, one per pass: streamed stages' gradients summed on each rank's host
    between the passes (their sum of squares a collective), the whole batch's step."""
    out = four_devices["passes"]
    assert (out["passes"], out["micro_batches"]) == (2, 2) and out["streamed"] > 0, out
    assert out["shard_by_shard"]  # (the sums too: rank by rank on the compute device)
    np.testing.assert_allclose(out["losses"], four_devices["reference"]["loss"][:DISK_STEPS], rtol=1e-5)


@pytest.mark.compares_programs
def test_experts_sharded_over_the_ranks_train_as_on_one_device(four_devices):
    out = four_devices["moe"]
    assert out["keeps_apart"] and out["streamed"] >= 3, out  # each rank computes with its own 2 experts
    # in memory: of each [blocks, 8 experts, d_model, hidden] weight a device holds [2, 2, 32, 128]
    assert out["expert_shards"] == [str((2, 8 // RANKS, 32, 128))], out["expert_shards"]
    assert out["in_memory_all_to_alls"] >= 2  # its tokens go to its experts (not the experts to the tokens)
    ref = out["reference"]
    for got in (out["paged"], out["in_memory"]):
        for key in ("loss", "grad_norm", "moe/aux_loss"):
            np.testing.assert_allclose(got[key], ref[key], rtol=1e-5, err_msg=key)
        assert got["moe/drop_rate"] == ref["moe/drop_rate"]  # the same tokens dropped: routing is per row
    assert max(ref["moe/drop_rate"]) > 0  # and some are


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.compares_programs
def test_two_processes_shard_the_pages_between_them(checks, four_devices):
    """Two processes of two devices each, on the accelerator's path: streamed stages updated on their devices (the
    pages crossing there and back), the host updates (the disk run below) shard by shard."""
    out = checks["two_processes"]
    assert len(out["losses"]) == MP_STEPS and out["shard_by_shard"]
    assert out["device_updates"] == out["streamed"] > 0, out
    np.testing.assert_allclose(out["losses"], four_devices["reference"]["loss"][:MP_STEPS], rtol=1e-5)
    assert out["streamed"] > 0
    assert len(out["device"]) == 2, out["device"]  # process 0's two devices
    mine = sum(out["device"].values()) + sum(out["host"].values())
    assert four_devices["state"] / 2 <= mine * 1.0001 and mine <= 1.05 * four_devices["state"] / 2
    # The host-peak check holds per process: its two ranks' share of the plan (a quarter each), not the whole.
    assert out["host_peak_warning"] is None
    peak = out["plan_peak"]  # (the plan's, of the four ranks together; on the CPU its device tier is RAM too)
    assert out["host_planned"] == 2 * (peak["host"] + peak["device"]) // 4 > 0, (out["host_planned"], peak)


@pytest.mark.compares_programs
def test_two_processes_keep_their_parts_of_the_pages_on_their_own_disks(checks, four_devices):
    """Pages sharded over two processes with a disk tier: each process's files hold its half of every disk-homed
    page (its own subdirectory; the tier counts pages whole, as the array tiers do), the losses are the one-device
    run's, and a snapshot loaded back half way (every page written to the disks again) reads back bit for bit."""
    out = checks["two_processes"]["disk"]
    assert out["homes"]["optimizer"] > 0 and out["homes"]["params"] > 0, out["homes"]
    assert out["disk_root"] == "angel_jax_pages.process_0"
    # Page files: half of the counted (whole) bytes, plus the zarr metadata of each page's array.
    assert out["counted_bytes"] / 2 <= out["file_bytes"] <= out["counted_bytes"] / 2 * 1.1, out
    assert out["round_trip_bit_exact"]
    np.testing.assert_allclose(out["losses"], four_devices["reference"]["loss"][:DISK_STEPS], rtol=1e-5)
