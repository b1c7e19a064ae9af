"""Data-parallel plans (ZeRO-3 pages): one rank's plan of its shards, the collectives' stream beside compute, and
`angel-jax plan --estimate --devices N --link-gbps G`."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest

from angel_jax.errors import AngelError
from angel_jax.schedule.plan import Budgets, PlanError, make_plan, minimum_device_bytes
from angel_jax.schedule.simulate import Bandwidths, StageCost, simulate
from angel_jax.schedule.trace import compute_sequence
from conftest import REPO_ROOT

MB = 2**20
BW = Bandwidths(h2d=4e9, d2h=4e9, disk_read=1e9, disk_write=1e9)


def _costs(n: int, param_bytes: int = 4 * MB, opt_bytes: int = 8 * MB) -> list[StageCost]:
    """n stages, 10 ms forward and 25 ms backward per call."""
    return [StageCost(f"s{i}", param_bytes, opt_bytes, 0.010, 0.025, 0.001, 0.004) for i in range(n)]


def _on(tl, stream: str, word: str) -> list:
    return [e for e in tl.events if e.stream == stream and e.label.startswith(word)]


def test_collectives_take_the_ring_time_and_the_next_gather_runs_beside_compute():
    """4 ranks, a 4 MiB shard per stage: every gather and reduce-scatter moves 3 x 4 MiB through the rank's link.
    The gather of an access runs while the access before it computes (prefetch 1), so a 2 GB/s link hides behind
    the compute; a 200 MB/s one bounds the step."""
    n, ranks, link = 4, 4, 2e9
    costs = _costs(n)
    ring = (ranks - 1) * 4 * MB / link  # 6.3 ms: less than a forward (10 ms)
    accesses = len(compute_sequence(n))  # 7: forward 0..2, the head, backward 2..0
    home = ("device",) * n
    tl = simulate(costs, replace(BW, link=link), home, home, 1, ranks=ranks)
    gathers, scatters = _on(tl, "collective", "gather"), _on(tl, "collective", "scatter")
    assert len(gathers) == 3 * accesses and len(scatters) == 3 * n  # 3 simulated steps
    assert all(e.duration == pytest.approx(ring) for e in gathers + scatters)
    compute = [e for e in tl.events if e.stream == "compute" and not e.label.startswith("update")][-accesses:]
    for before, (access, gather) in zip(compute, zip(compute[1:], gathers[-accesses + 1:])):
        assert gather.label.split()[1] == access.label.split()[1]
        assert before.start - 1e-12 <= gather.start < before.end  # issued as `before` starts, done during it
        assert gather.end <= access.start + 1e-12
    # Exact updates: the last reduce-scatter is not hidden (the norm needs it), nor the step's first gather (it
    # waits for stage 0's update); everything else is.
    assert tl.waits == {"collective": pytest.approx(2 * ring)}
    compute_s = sum(c.backward_s for c in costs) + sum(c.forward_s for c in costs[:-1])
    update_s = sum(c.update_device_s for c in costs)
    assert tl.step_time == pytest.approx(compute_s + update_s + 2 * ring)
    # Collective seconds per step: (2n - 1 gathers + n scatters) x the ring time, the planner's count too.
    plan = make_plan(costs, replace(BW, link=link), Budgets(10**12, None, 0, 0), ranks=ranks)
    io = plan.io_per_step(costs, replace(BW, link=link))
    assert io["collective_bytes"] == (accesses + n) * (ranks - 1) * 4 * MB
    assert io["collective_s"] == pytest.approx((accesses + n) * ring)
    assert plan.bound("s0")[0] == "compute"
    slow = make_plan(costs, replace(BW, link=2e8), Budgets(10**12, None, 0, 0), ranks=ranks)
    assert slow.bound("s0")[0] == "collective" and slow.predicted.step_time > 2 * compute_s


def test_streamed_shards_are_fetched_before_their_gather_and_reduced_before_their_copy_home():
    costs, ranks = _costs(4), 4
    home = ("host",) * 4
    tl = simulate(costs, replace(BW, link=2e9), home, home, 1, ranks=ranks)
    fetches, gathers = _on(tl, "h2d", "fetch"), _on(tl, "collective", "gather")
    grads, scatters = _on(tl, "d2h", "grad"), _on(tl, "collective", "scatter")
    fetched = {}
    for e in sorted(fetches + gathers, key=lambda e: (e.start, e.stream != "h2d")):
        if e.stream == "h2d":
            fetched[e.label.split()[1]] = e.end
        else:  # every gather finds its stage's shard on the device
            assert e.start >= fetched[e.label.split()[1]] - 1e-12
    assert len(grads) == len(scatters)
    for scatter, grad in zip(scatters, grads):  # each rank copies only its reduced shard to the host
        assert grad.label.split()[1] == scatter.label.split()[1] and grad.start >= scatter.end - 1e-12
    # Without a link (the CPU backend: collectives inside the profiled calls) nothing is simulated for them.
    assert not _on(simulate(costs, BW, home, home, 1, ranks=ranks), "collective", "")


def test_a_rank_plans_its_shards_with_room_for_whole_stages():
    """The plan of one of 4 ranks, on costs of 1/4 of every stage: per-rank bytes on every tier are 1/4 of the
    one-rank plan's, and the device also holds whole stages gathered: the computing stage, the prefetch window's
    and one stage of gradients before their reduce-scatter."""
    n, ranks, fixed = 8, 4, 10 * MB
    whole = _costs(n)
    shard = [replace(c, param_bytes=c.param_bytes // ranks, opt_bytes=c.opt_bytes // ranks) for c in whole]
    bw = replace(BW, link=2e9)
    minimum = minimum_device_bytes(shard, Budgets(0, None, 0, fixed), ranks=ranks)
    assert minimum == fixed + 3 * MB + (1 + 2) * ranks * MB  # shard window at prefetch 1, three whole stages
    with pytest.raises(PlanError, match=f"whole stages gathered from 4 ranks' shards {12 * MB:,} B"):
        make_plan(shard, bw, Budgets(minimum - 1, None, 0, fixed), ranks=ranks)
    one = make_plan(whole, bw, Budgets(minimum_device_bytes(whole, Budgets(0, None, 0, fixed)), None, 0, fixed))
    many = make_plan(shard, bw, Budgets(minimum, None, 0, fixed), ranks=ranks)
    assert len(one.streamed) == len(many.streamed) == n and many.ranks == ranks and one.ranks == 1
    for a, b in zip(one.table(whole), many.table(shard)):
        assert {k: ranks * v for k, v in b.items() if k != "tier"} == {k: v for k, v in a.items() if k != "tier"}
    assert one.peak_bytes["host"] == ranks * many.peak_bytes["host"] > 0
    assert many.gather_bytes == (many.prefetch + 2) * ranks * MB and one.gather_bytes == 0
    assert many.peak_bytes["device"] == fixed + many.window_bytes + many.gather_bytes <= minimum


def test_one_rank_plans_are_as_they_were():
    """A one-rank plan ignores the link, and a mixed plan (a resident stage, host-homed parameters, optimizer
    state on disk, four micro-batches) predicts what it did before data parallelism was planned."""
    costs = [StageCost(f"s{i}", (4 + i % 3) * MB, 8 * MB, 0.010, 0.025, 0.001, 0.02, 0.002) for i in range(6)]
    bw, budgets = Bandwidths(1e9, 2e9, 3e8, 2e8), Budgets(60 * MB, 70 * MB, None, 10 * MB, 4 * MB)
    plan = make_plan(costs, bw, budgets, micro_batches=4)
    assert plan.home == ("host", "host", "device", "host", "host", "host") and plan.opt_home.count("disk") == 5
    assert plan.predicted.step_time == pytest.approx(0.827150165333334, rel=1e-12)
    # (The host wait includes the resident stage's wait for the norm before its device update, 2.1 ms, counted
    # since one rank's plans count it as the ranks' plans always did.)
    assert plan.predicted.waits == pytest.approx({"host": 0.0252914560000006, "disk": 0.0008587093333332074})
    assert plan.peak_bytes == {"device": 50331648, "host": 67108864, "disk": 41943040}
    linked = make_plan(costs, replace(bw, link=1e9), budgets, micro_batches=4, ranks=1)
    assert linked == plan and linked.predicted.events == plan.predicted.events
    assert "collective_s" not in plan.io_per_step(costs, bw) and "collective" not in plan.bound("s0")[1]


def test_plan_estimate_for_eight_devices_prints_per_rank_bytes(tmp_path, capsys):
    from angel_jax.schedule.blueprint import blueprint
    from angel_jax.cli.plan import _estimated_plan, _parser, main
    from angel_jax.config import load_config
    import models

    base = [str(REPO_ROOT / "experiments" / "gpt_tiny.yaml"), "train.batch_size=16", "memory.page_size=262144",
            "memory.device_budget=40000000", "--estimate", "--peak-tflops", "100"]
    assert main([*base, "--devices", "8", "--link-gbps", "100", "--out", str(tmp_path)]) == 0
    text = capsys.readouterr().out
    assert "data parallel: 8 ranks" in text and "local batch of 2" in text and "(one rank's)" in text
    assert "collectives per step  each rank receives" in text and "x 8 devices" in text
    eight = json.loads((tmp_path / "plan.json").read_text())
    assert eight["ranks"] == 8 and eight["io_per_step"]["collective_s"] > 0
    args = _parser().parse_args([*base, "--link-gbps", "100"])
    cfg = load_config(args.config, list(args.overrides))
    flops = models.get(cfg.model).flops_per_token * 16 * cfg.model.seq_len  # the global batch's, on 8 devices
    assert eight["predicted_mfu"] == pytest.approx(flops / (eight["predicted_step_s"] * 100e12 * 8))
    _, one, costs, *_ = _estimated_plan(cfg, blueprint(cfg), args)
    pages = len(blueprint(cfg).params_layout.pages)
    per_rank = sum(row["params"] for row in eight["table"])
    whole = sum(row["params"] for row in one.table(costs))
    assert whole <= 8 * per_rank <= whole + pages * 7 * 4  # 1/8 each, up to 7 float32 of padding per page
    with pytest.raises(AngelError, match="--link-gbps"):
        _estimated_plan(cfg, blueprint(cfg), _parser().parse_args([*base, "--devices", "8"]))


def test_a_ranks_own_experts_are_neither_gathered_nor_scattered_and_their_all_to_alls_lengthen_the_calls():
    """Expert parallelism: of each 4 MiB shard, 3 MiB are the rank's own experts. The gathers and reduce-scatters
    move only the other 1 MiB; the device holds whole stages of 1 MiB x ranks + 3 MiB; each call's all-to-alls
    ((ranks - 1) / ranks of 8 MiB per forward, twice per backward) sit inside the stage calls."""
    n, ranks, link = 4, 4, 2e9
    dense = _costs(n)
    moe = [replace(c, expert_bytes=3 * MB, exchange_bytes=8 * MB) for c in dense]
    home = ("device",) * n
    tl = simulate(moe, replace(BW, link=link), home, home, 1, ranks=ranks)
    assert all(e.duration == pytest.approx((ranks - 1) * MB / link) for e in _on(tl, "collective", ""))
    exchange = (ranks - 1) / ranks * 8 * MB / link
    forward = [e for e in _on(tl, "compute", "forward")]
    backward = [e for e in _on(tl, "compute", "backward")]
    assert all(e.duration == pytest.approx(0.010 + exchange) for e in forward)
    assert all(e.duration == pytest.approx(0.025 + 2 * exchange) for e in backward)
    plan = make_plan(moe, replace(BW, link=link), Budgets(10**12, None, 0, 0), ranks=ranks)
    accesses = len(compute_sequence(n))
    calls = sum(1 if op == "forward" else 2 for op, _ in compute_sequence(n))  # forward-equivalents of exchange
    assert plan.io_per_step(moe, replace(BW, link=link))["collective_bytes"] == \
        (accesses + n) * (ranks - 1) * MB + calls * (ranks - 1) * 8 * MB // ranks
    two = make_plan(moe, replace(BW, link=link), Budgets(10**12, None, 0, 0), ranks=ranks, micro_batches=2)
    assert two.io_per_step(moe, replace(BW, link=link))["collective_bytes"] == \
        (accesses + n) * (ranks - 1) * MB + 2 * calls * (ranks - 1) * 8 * MB // ranks  # each micro-batch's
    assert plan.gather_bytes == (plan.prefetch + 2) * (ranks * MB + 3 * MB)


def test_a_sharded_plan_refuses_an_optimizer_that_needs_whole_parameters():
    from angel_jax.cli.plan import main

    base = [str(REPO_ROOT / "experiments" / "gpt_tiny.yaml"), "optimizer.name=adafactor", "--estimate",
            "--peak-tflops", "100", "--link-gbps", "100"]
    with pytest.raises(AngelError, match="adafactor"):
        main([*base, "--devices", "2"])


def test_an_estimate_on_a_measured_peak_states_its_mfu_over_that_same_peak(tmp_path, monkeypatch):
    """Without --peak-tflops on a device missing from the peak table the peak is measured (a matmul): the stage
    times and the MFU use one measurement. Two would differ by the machine's noise; here the second measurement
    would be 5x the first, so an MFU over it would be a fifth of the stated one."""
    from angel_jax.train import metrics
    from angel_jax.cli.plan import main

    measured = iter([1e11, 5e11, 5e11])
    monkeypatch.setattr(metrics, "measure_matmul_flops", lambda *a, **k: next(measured))
    monkeypatch.setattr(metrics, "cpu_peak", lambda *a, **k: None)  # a CPU that does not state its spec
    assert main([str(REPO_ROOT / "experiments" / "gpt_tiny.yaml"), "--estimate", "--out", str(tmp_path)]) == 0
    plan = json.loads((tmp_path / "plan.json").read_text())
    assert plan["peak_flops"] == 1e11 and "at 0.1 TFLOP/s (estimate:matmul)" in plan["source"]


def test_a_sharded_plan_refuses_lock_free_updates_as_the_engine_does():
    """`--estimate --devices N` plans what the engine would run: with pages sharded over ranks updates are exact,
    so `memory.staleness=1` (and `--what-if`'s "updates one step behind") is refused by name, not planned."""
    budgets = Budgets(60 * MB, 200 * MB, None, 10 * MB)
    with pytest.raises(PlanError, match="'memory.staleness'"):
        make_plan(_costs(6), replace(BW, link=1e9), budgets, staleness=1, ranks=2)
    assert make_plan(_costs(6), BW, budgets, staleness=1).staleness == 1  # one device: planned
