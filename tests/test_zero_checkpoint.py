"""Checkpoints of the sharded (ZeRO-3) paged engine, in one process with four CPU devices (zero_ckpt_check.py): the
same world size restores bit for bit; another world size reshards the pages from the persistent tier (4 -> 2 -> 4). And over two
processes of one device each (zero_ckpt_mp_check.py): each process checkpoints its own shards and restores them
bit for bit, from its peer copy when its memory tier is lost; one process resumes them assembled."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from conftest import comparing_env

ROOT = Path(__file__).resolve().parent.parent
LIMIT = 240  # seconds: a hung collective must not hang the suite


def _start(script: str, *args: str) -> subprocess.Popen:
    # Full fp32 matmul precision: the checks compare runs over other numbers of ranks and processes.
    return subprocess.Popen(["timeout", "-s", "KILL", str(LIMIT), sys.executable, str(Path(__file__).with_name(script)),
                             *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT,
                            env=comparing_env())


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict:
    """The one-process check (two devices) and the two-process check, started together: mostly compilation, which
    the cores share."""
    port, directory = str(_free_port()), str(tmp_path_factory.mktemp("zero-mp"))
    out: dict = {"dir": Path(directory)}
    procs = {"one": _start("zero_ckpt_check.py", directory),
             **{f"mp{rank}": _start("zero_ckpt_mp_check.py", port, str(rank), directory) for rank in (0, 1)}}
    outputs = {name: p.communicate() for name, p in procs.items()}
    for name, p in procs.items():
        stdout, stderr = outputs[name]
        assert p.returncode == 0, f"{name}: {stderr[-3000:]}"
        out[name] = json.loads(stdout.strip().splitlines()[-1])
        out[name]["log"] = stderr
    return out


@pytest.fixture(scope="module")
def checked(runs) -> dict:
    return runs["one"]


def test_same_world_size_is_bit_exact(checked):
    """Saved at step 3 over 4 ranks, restored (memory tier) over 4 ranks: every page, small leaf and counter equal
    the saved ones, and the remaining steps give the uninterrupted run's losses exactly."""
    same, uninterrupted = checked["same"], checked["losses"]["uninterrupted"]
    assert uninterrupted[-1] < uninterrupted[0]  # it trains
    assert (same["step"], same["tier"], same["ranks"]) == (3, "memory", 4)
    assert same["bit_exact"]
    assert same["losses"] == uninterrupted[3:]


def test_the_weights_of_a_checkpoint_over_four_ranks_read_back_whole(checked):
    """`load_params` (what export and sample read) unpacks pages written over 4 ranks into the whole parameters the
    engine held, bit for bit."""
    assert checked["weights_bit_exact"]


@pytest.mark.compares_programs
def test_another_world_size_reshards(checked):
    """4 -> 2 -> 4 ranks from the persistent tier: each resumed run continues the uninterrupted run's losses (another
    reduction order: to float rounding), the state back on 4 ranks is the saved state bit for bit, and each
    resharding is logged."""
    uninterrupted = checked["losses"]["uninterrupted"]
    assert [(r["from"], r["to"], r["step"], r["tier"]) for r in checked["resumes"]] == \
        [(4, 2, 3, "persistent"), (2, 4, 3, "persistent")]
    for r in checked["resumes"]:
        np.testing.assert_allclose(r["losses"], uninterrupted[3:], rtol=1e-5, atol=0,
                                   err_msg=f"{r['from']} -> {r['to']}")
    assert checked["resumes"][1]["bit_exact_with_saved"]
    assert checked["streamed"]["2"] > 0  # the two-rank run streams: resharded pages went to host as well as device
    for a, b in ((4, 2), (2, 4)):
        assert f"resharding the checkpoint's pages from {a} to {b} ranks" in checked["log"]


def test_another_layout_is_refused(checked):
    """A checkpoint whose pages are not this model's over its own ranks is refused, naming the difference, rather
    than resharded."""
    message = checked["other_layout"]
    assert "page layout differs" in message and "over the checkpoint's 4 ranks" in message and "'embed'" in message


@pytest.mark.compares_programs
def test_two_processes_round_trip(runs):
    """2 processes x 1 device, pages split across them: each process checkpoints only its own shards (half of
    every page) in its own tiers, and both restore them (memory tier) into a fresh engine: the state bit for bit
    on both, the uninterrupted run's losses exactly, the same losses as over two devices of one process."""
    one = runs["one"]["losses"]["uninterrupted"]
    for rank in (0, 1):
        out = runs[f"mp{rank}"]
        assert out["spans_processes"] and out["per_process"]
        assert (out["step"], out["tier"], out["ranks"]) == (3, "memory", 2)
        assert out["shard_bytes"] * 2 == out["whole_bytes"]
        # Its memory tier holds its shards and little else (index, small leaves), not the whole state.
        assert out["memory_tier"]["dir"] == f"mp-mem/process_{rank}"
        assert out["shard_bytes"] <= out["memory_tier"]["bytes"] < out["shard_bytes"] * 1.2
        assert out["bit_exact"], rank
        assert out["resumed"] == out["uninterrupted"][3:]
        np.testing.assert_allclose(out["uninterrupted"], one, rtol=1e-5, atol=0)
    # Step 6 was saved too, then every copy of process 1's shards of it damaged: both processes went back to step 3.
    assert "step 6 cannot be restored by every process: trying an older one" in runs["mp0"]["log"]
    ok, lines = runs["mp0"]["verify"]  # `angel-jax ckpt verify` reads every process's shards
    assert not ok and lines[:5] == ["process 0 (its shards):", "step 3: ok", "step 6: ok", "process 1 (its shards):",
                                    "step 3: ok"] and lines[5] == "step 6: DAMAGED", lines


def test_each_process_persists_its_shards_as_a_plain_orbax_checkpoint(runs):
    """Each process's persistent copy of step 3 is an ordinary orbax checkpoint that plain orbax (one process, its
    default handlers) reads: half of every page, each array matching the checksum the process recorded. (Orbax's
    own numpy handler writes on process 0 only: process 1's checkpoint would hold no data.)"""
    import orbax.checkpoint as ocp
    import xxhash

    for rank in (0, 1):
        mngr = ocp.CheckpointManager(runs["dir"] / "mp" / "checkpoints" / f"process_{rank}")
        ckpt = mngr.restore(3, args=ocp.args.Composite(state=ocp.args.StandardRestore(),
                                                       meta=ocp.args.JsonRestore()))
        mngr.close()
        recorded = {a["name"]: a["xxh3_64"] for a in ckpt.meta["arrays"] if a["nbytes"]}
        assert recorded and sorted(ckpt.state) == sorted(recorded), rank
        for name, array in ckpt.state.items():
            assert xxhash.xxh3_64_intdigest(np.ascontiguousarray(array).tobytes()) == recorded[name], (rank, name)
        pages = sum(a.nbytes for name, a in ckpt.state.items() if name.startswith(("params/", "opt/")))
        assert pages == runs[f"mp{rank}"]["shard_bytes"], rank


@pytest.mark.compares_programs
def test_two_processes_resume_a_four_rank_checkpoint_resharded_on_their_own_budgets(runs):
    """4 ranks -> 2 processes: the checkpoint one process wrote over four ranks, resumed by the two processes from its
    persistent tier and resharded over them (logged), continues the uninterrupted losses (1e-5). They plan on the
    machine's own budgets (memory.device_budget 0): each process asks its own device for its free memory, not
    process 0's, which refuses another process's question (this failed every `angel-jax launch -n 2 ...
    memory.mode=paged` that left the device budget to the machine)."""
    for rank in (0, 1):
        resumed = runs[f"mp{rank}"]["other_world"]
        assert (resumed["step"], resumed["tier"]) == (3, "persistent"), rank
        np.testing.assert_allclose(resumed["losses"], runs["one"]["losses"]["uninterrupted"][3:], rtol=1e-5, atol=0)
    assert "resharding the checkpoint's pages from 4 to 2 ranks" in runs["mp0"]["log"]


def test_a_host_that_lost_its_memory_restores_its_shards_from_the_peer_copy(runs):
    """Process 0's memory tier deleted: it restores its shards from its peer copy, process 1 from its memory tier,
    both bit for bit the state saved."""
    for rank, tier in ((0, "peer"), (1, "memory")):
        after = runs[f"mp{rank}"]["after_memory_lost"]
        assert (after["step"], after["tier"]) == (3, tier), rank
        assert after["bit_exact"], rank


@pytest.mark.compares_programs
def test_one_process_resumes_the_shards_of_two_assembled(runs):
    """The two processes' checkpoint resumed in one process (two devices): every process's shards read from its
    persistent tier and assembled into whole pages, logged, although an older whole-state checkpoint (step 2) lies
    beside them; the losses continue the two-process run's."""
    assembled = runs["one"]["assembled"]
    # (step 6, whose shards of process 1 are damaged, is skipped: the newest step every process's shards verify)
    assert (assembled["step"], assembled["tier"]) == (3, "persistent (the shards of 2 processes)")
    assert "step 6: the shards of process 1" in runs["one"]["log"]
    # and the weights reader (export, sample) reads the same parameters from the shards
    assert (assembled["weights_step"], assembled["weights_bit_exact"]) == (3, True)
    np.testing.assert_allclose(assembled["losses"], assembled["theirs"][3:], rtol=1e-5, atol=0)
    assert "assembling the checkpoint of step 3 from the shards of the 2 processes" in runs["one"]["log"]
