"""Pure parts of the scheduling pass: the plan's policy and its refusals, the simulated timeline, the calibration
file, and the derivative of page unpacking that every stage backward relies on."""

from __future__ import annotations

import dataclasses

import json
from dataclasses import replace

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from angel_jax.memory import PageLayout
from angel_jax.schedule.plan import (Budgets, PlanError, fetches_per_step, load_bandwidths, make_plan, min_host_bytes,
                                     minimum_device_bytes, without_overlap)
from angel_jax.schedule.simulate import Bandwidths, StageCost, simulate

MB = 2**20


def _costs(n: int = 8, update_host_s: float = 0.004) -> list[StageCost]:
    """n stages of 4 MiB of parameters (8 MiB of Adam state), 10 ms forward, 25 ms backward."""
    return [StageCost(f"s{i}", 4 * MB, 8 * MB, 0.010, 0.025, 0.001, update_host_s) for i in range(n)]


BW = Bandwidths(h2d=4e9, d2h=4e9, disk_read=1e9, disk_write=1e9)


def test_a_gradient_with_respect_to_pages_is_refused_not_silently_zero():
    """Pages are held as bits (unsigned integers, memory/layout.py), so a derivative taken through `unpack` with
    respect to the pages themselves is an error, not a silent zero that would give every stage backward zero
    gradients; stage functions take gradients with respect to the unpacked leaves, which are the plain slices'."""
    tree = {"w": np.arange(12, dtype=np.float32).reshape(3, 4) / 7, "b": np.ones(5, np.float32)}
    stage = PageLayout.build([("s", tree)], page_size_bytes=4096 * 4).stage("s")
    pages = tuple(jnp.asarray(p) for p in stage.pack(tree))
    assert all(p.dtype == jnp.uint32 for p in pages)

    def loss(t):
        return jnp.sum(jnp.sin(t["w"]) * 3) + jnp.sum(t["b"] ** 2)

    with pytest.raises(TypeError):
        jax.grad(lambda p: loss(stage.unpack(p)))(pages)
    got = jax.jit(jax.grad(loss))(stage.unpack(pages))
    want = jax.grad(loss)(jax.tree.map(jnp.asarray, tree))
    assert float(jnp.abs(got["w"]).sum()) > 1
    np.testing.assert_array_equal(got["w"], want["w"])
    np.testing.assert_array_equal(got["b"], want["b"])


def test_the_plan_keeps_what_fits_and_streams_the_rest():
    costs = _costs()
    fixed = 10 * MB
    minimum = minimum_device_bytes(costs, Budgets(0, None, 0, fixed))
    assert minimum == fixed + 3 * 4 * MB  # prefetch 1: two stages of parameters and one of gradients in flight
    everything = make_plan(costs, BW, Budgets(10**12, None, 0, fixed))
    assert not everything.streamed and everything.peak_bytes["host"] == 0
    three = make_plan(costs, BW, Budgets(minimum + 3 * 16 * MB, None, 0, fixed))
    assert len(three.resident) == 3 and three.peak_bytes["device"] <= minimum + 3 * 16 * MB
    streamed = make_plan(costs, BW, Budgets(minimum, None, 0, fixed))
    assert len(streamed.streamed) == 8 and streamed.peak_bytes["host"] == 8 * (2 * 4 + 8) * MB
    # Host updates run beside the compute, so streaming is free while the copies hide behind it ...
    compute = sum(c.backward_s for c in costs) + sum(c.forward_s for c in costs[:-1])  # the head's is fused
    assert compute <= streamed.predicted.step_time < 1.05 * everything.predicted.step_time
    # ... and costs what the copies cost when they cannot (a 100 MB/s link: 40 ms per stage and direction).
    slow = Bandwidths(h2d=1e8, d2h=1e8)
    assert make_plan(costs, slow, Budgets(minimum, None, 0, fixed)).predicted.step_time > 2 * compute
    assert make_plan(costs, slow, Budgets(10**12, None, 0, fixed)).predicted.step_time < 1.2 * compute


def test_refusals_say_how_much_is_missing_and_which_key_to_raise():
    costs, fixed = _costs(), 10 * MB
    minimum = minimum_device_bytes(costs, Budgets(0, None, 0, fixed))
    with pytest.raises(PlanError, match=f"{MB:,} B missing; raise memory.device_budget"):
        make_plan(costs, BW, Budgets(minimum - MB, None, 0, fixed))
    # 64 MiB of parameters and gradients, and without a disk tier 64 MiB of optimizer state too: the refusal names
    # the least budget that works (the shortfall alone would be refused again at the optimizer state).
    with pytest.raises(PlanError, match=f"raise memory.host_budget to at least {128 * MB:,} B .*memory.device_budget"):
        make_plan(costs, BW, Budgets(minimum, 32 * MB, 0, fixed))
    make_plan(costs, BW, Budgets(minimum, 128 * MB, 0, fixed))  # and that figure is enough
    # With a disk tier every family may go there; the host keeps a window: 2 stages staged around their update
    # (4 MiB parameters + 4 MiB gradients + 8 MiB optimizer state each) and 2 stages of gradients on their way out.
    with pytest.raises(PlanError, match=f"host window \\({40 * MB:,} B with every streamed page on disk"):
        make_plan(costs, BW, Budgets(minimum, 32 * MB, None, fixed))
    all_disk = make_plan(costs, BW, Budgets(minimum, 40 * MB, None, fixed))
    assert all_disk.home == all_disk.grad_home == all_disk.opt_home == ("disk",) * 8
    assert all_disk.peak_bytes["host"] == 40 * MB and all_disk.peak_bytes["disk"] == 8 * 16 * MB
    assert all_disk.opt_staging == 2  # a third stage staged (16 MiB more) does not fit
    # A little more host room keeps the first stages' parameters there (optimizer state and gradients go first).
    some = make_plan(costs, BW, Budgets(minimum, 48 * MB, None, fixed))
    assert some.opt_home == some.grad_home == ("disk",) * 8 and some.home.count("host") >= 1, some.home
    # Host room for parameters, gradients and staging but not all optimizer state, and no disk tier.
    with pytest.raises(PlanError, match="set memory.disk_dir"):
        make_plan(costs, BW, Budgets(minimum, 100 * MB, 0, fixed))
    with pytest.raises(PlanError, match=r"more than 8,388,608 B \(memory.disk_budget, or free space"):
        make_plan(costs, BW, Budgets(minimum, 100 * MB, 8 * MB, fixed))
    on_disk = make_plan(costs, BW, Budgets(minimum, 100 * MB, None, fixed))
    host_opt = sum(h == "host" for h in on_disk.opt_home)
    # 64 + 2 x 8 staging + 2 x 8 <= 100 MiB, but a third stage staged is worth more than an optimizer stage on the
    # host (read and written once a step, in the chain that deeper staging speeds up): 64 + 3 x 8 + 8 <= 100 MiB
    assert on_disk.opt_home.count("disk") == 8 - host_opt and host_opt == 1 and on_disk.opt_staging == 3
    assert on_disk.peak_bytes["host"] <= 100 * MB and on_disk.peak_bytes["disk"] == (8 - host_opt) * 8 * MB


def test_lock_free_keeps_a_bounded_number_of_second_versions_and_updates_from_the_last_stage_back():
    """Lock-free mode's second versions of host-homed parameters: the updater keeps at most PENDING_VERSIONS for
    stages in use, and computes one more, so the plan counts that many of the largest such stages, not a second
    copy of every stage. The chain goes from the last stage back, after the stages updated exactly."""
    from angel_jax.schedule.plan import host_bytes
    from angel_jax.schedule.staging import PENDING_VERSIONS, update_order

    assert PENDING_VERSIONS == 4
    costs = _costs(8)
    costs[3] = dataclasses.replace(costs[3], param_bytes=6 * MB)  # the largest counts first
    homes = (("host",) * 8, ("host",) * 8, ("host",) * 8)
    params, grads, opt = 34 * MB, 34 * MB, 64 * MB
    assert host_bytes(costs, homes, staleness=0) == params + grads + opt
    assert host_bytes(costs, homes, staleness=1) == params + grads + opt + (6 + 4 * 4) * MB
    # two stages: both have a second version at most
    assert host_bytes(costs[:2], tuple(h[:2] for h in homes), staleness=1) == 2 * (2 * 4 + 4 + 8) * MB
    assert update_order([False] * 4) == (0, 1, 2, 3)
    assert update_order([False, True, True, True, False]) == (0, 4, 3, 2, 1)
    assert update_order([True, True, False]) == (2, 1, 0)


def test_lock_free_hides_slow_host_updates():
    """With host updates slower than the compute they could hide behind, exact mode waits for them at the next
    step's first stages; lock-free mode runs those stages a step behind instead."""
    costs = _costs(update_host_s=0.03)
    home, opt_home = ("host",) * 8, ("host",) * 8
    exact = simulate(costs, BW, home, opt_home, 1, staleness=0)
    lock_free = simulate(costs, BW, home, opt_home, 1, staleness=1)
    assert lock_free.step_time < 0.8 * exact.step_time
    compute_only = sum(c.backward_s for c in costs) + sum(c.forward_s for c in costs[:-1])
    assert lock_free.step_time >= compute_only * 0.99
    shared = simulate(costs, BW, home, opt_home, 1, shared_cpu=True)  # the CPU backend: no overlap with compute
    assert shared.step_time >= compute_only + sum(c.update_host_s for c in costs) * 0.99


def test_lock_free_updates_longer_than_a_step_bound_it():
    """Updates one step behind hide host work up to a step's compute, not more: with host updates taking twice the
    compute, every step gives the host stream its updates and a stage never falls two updates behind, so the
    steady-state step is the host's work per step, and the plan names the host, however few steps are simulated
    (the first steps run ahead while the queue builds up)."""
    costs = _costs(update_host_s=0.15)  # 8 x 0.15 s of updates against ~0.27 s of compute per step
    home = ("host",) * 8
    host_work = sum(c.update_host_s for c in costs)
    for steps in (3, 6):
        tl = simulate(costs, BW, home, home, 1, staleness=1, steps=steps)
        assert tl.step_time >= host_work * 0.999, (steps, tl.step_time, host_work)
    plan = make_plan(costs, BW, Budgets(minimum_device_bytes(costs, Budgets(0, None, 0, 0)), None, 0, 0), staleness=1)
    assert plan.streamed == tuple(range(8))
    assert plan.bound(costs[0].name)[0] == "host"
    # ... and the compute's idle time per step is the host's: what it waits for, at least the step's difference
    # from the compute's own work.
    compute_work = sum(c.forward_s for c in costs[:-1]) + sum(c.backward_s for c in costs)
    waits = plan.predicted.waits
    assert max(waits, key=waits.get) == "host" and waits["host"] >= plan.predicted.step_time - compute_work - 1e-9


def test_disk_reads_and_writes_appear_in_the_timeline():
    costs = _costs(4)
    tl = simulate(costs, BW, ("host",) * 4, ("disk",) * 4, 1)
    reads = [e for e in tl.events if e.stream == "disk" and e.label.startswith("read")]
    writes = [e for e in tl.events if e.stream == "disk" and e.label.startswith("write")]
    assert len(reads) == len(writes) == 3 * 4  # every stage, every simulated step
    updates = {e.label.split()[1]: e for e in tl.events if e.label.startswith("update")}
    for w in writes[-4:]:
        assert w.start >= updates[w.label.split()[1]].end - 1e-12  # written after its update


def test_bandwidths_come_from_the_bench_io_calibration(tmp_path):
    path = tmp_path / "io_calibration.json"
    path.write_text(json.dumps({"format": "angel_jax.io_calibration/1",
                                "bandwidth_Bps": {"h2d_pinned": 2e10, "d2h_pinned": 1.5e10, "disk_read": 3e9,
                                                  "disk_write": 2e9}}))
    bw = load_bandwidths(path)
    assert (bw.h2d, bw.d2h, bw.disk_read, bw.disk_write) == (2e10, 1.5e10, 3e9, 2e9) and bw.source == str(path)
    assert (bw.disk_read_cpu, bw.disk_write_cpu) == (0.0, 0.0)  # an older calibration: no CPU figures
    assert load_bandwidths(tmp_path / "missing.json") == Bandwidths()
    # CPU seconds per byte over the machine's cores: the share of the compute cores a transfer takes.
    path.write_text(json.dumps({"format": "angel_jax.io_calibration/1", "machine": {"cpu_count": 4},
                                "bandwidth_Bps": {"disk_read": 3e9, "disk_write": 2e9},
                                "cpu_s_per_byte": {"disk_read": 8e-10, "disk_write": 2e-9}}))
    bw = load_bandwidths(path)
    assert (bw.disk_read_cpu, bw.disk_write_cpu) == (2e-10, 5e-10)


def test_disk_cpu_work_takes_compute_time_on_shared_cores_only():
    """On the CPU backend a disk transfer's CPU work (checksums, copies, the kernel's) delays compute by its
    measured share, from the transfer's start; on an accelerator the cores it uses are not the device's."""
    costs = _costs(4)
    home, opt_home, grad_home = ("disk",) * 4, ("disk",) * 4, ("disk",) * 4
    free = replace(BW, disk_read_cpu=0.0, disk_write_cpu=0.0)
    costly = replace(BW, disk_read_cpu=2.0 / BW.disk_read, disk_write_cpu=2.0 / BW.disk_write)
    base = simulate(costs, free, home, opt_home, 1, grad_home=grad_home, shared_cpu=True)
    charged = simulate(costs, costly, home, opt_home, 1, grad_home=grad_home, shared_cpu=True)
    io_cpu = [e for e in charged.events if e.stream == "io_cpu"]
    disk = [e for e in charged.events if e.stream == "disk"]
    assert len(io_cpu) == len(disk) > 0
    for c, d in zip(io_cpu, disk):  # twice the transfer's time, never before it began
        assert c.duration == pytest.approx(2 * d.duration) and c.start >= d.start - 1e-12
    assert charged.step_time > base.step_time * 1.5
    on_gpu = simulate(costs, costly, home, opt_home, 1, grad_home=grad_home, shared_cpu=False)
    assert on_gpu.step_time == simulate(costs, free, home, opt_home, 1, grad_home=grad_home).step_time
    assert not [e for e in on_gpu.events if e.stream == "io_cpu"]


def test_io_per_step_counts_every_copy_of_the_plan():
    """Exact bytes: a streamed stage's parameters go to the device once per access (forward and backward; the
    head once), its gradients come back once; disk-homed optimizer state is read and written once; disk-homed
    parameters are read for every access and for their update and written once; disk-homed gradients are written
    and read once. The disk's reads and writes share it: its time is their sum."""
    from angel_jax.schedule.plan import Bandwidths, Plan, StageCost

    costs = [StageCost(name, p, o, 0.0, 0.0, 0.0, 0.0)
             for name, p, o in (("embed", 100, 10), ("block.0", 200, 20), ("head", 300, 30))]
    bw = Bandwidths(h2d=100.0, d2h=50.0, disk_read=10.0, disk_write=5.0)
    plan = Plan(resident=(0,), home=("device", "host", "host"), grad_home=("device", "host", "host"),
                opt_home=("device", "disk", "host"), prefetch=1, window_bytes=0, peak_bytes={}, staleness=0,
                predicted=None)
    io = plan.io_per_step(costs, bw)
    assert (io["h2d_bytes"], io["d2h_bytes"], io["disk_read_bytes"], io["disk_write_bytes"]) == (700, 500, 20, 20)
    assert (io["h2d_s"], io["d2h_s"], io["disk_read_s"], io["disk_write_s"], io["io_bound_s"]) == (7, 10, 2, 4, 10)
    # block.0 (2 accesses) with every family on disk: parameters read 3 x 200 and written once, gradients written
    # and read once, optimizer state read and written once.
    on_disk = Plan(resident=(0,), home=("device", "disk", "host"), grad_home=("device", "disk", "host"),
                   opt_home=("device", "disk", "host"), prefetch=1, window_bytes=0, peak_bytes={}, staleness=0,
                   predicted=None)
    io = on_disk.io_per_step(costs, bw)
    assert (io["disk_read_bytes"], io["disk_write_bytes"]) == (3 * 200 + 200 + 20, 200 + 200 + 20)
    assert io["io_bound_s"] == (820 / 10 + 420 / 5)


def test_accumulation_passes_trade_saved_activations_for_fetches():
    """A step whose saved stage inputs do not fit the device runs in passes: each pass holds 1/P of them and
    fetches every streamed stage again; the planner takes the fewest passes that fit unless more are faster."""
    costs = _costs()
    saved = 64 * MB
    budgets = Budgets(0, None, 0, fixed_device=saved + 4 * MB, saved_device=saved)
    assert [budgets.fixed_for(p) for p in (1, 2, 4)] == [68 * MB, 36 * MB, 20 * MB]
    tight = replace(budgets, device=minimum_device_bytes(costs, budgets, 4))
    plan = make_plan(costs, BW, tight, micro_batches=8)  # one pass cannot hold the activations: four can
    assert plan.passes == 4 and plan.fixed_device == 20 * MB and plan.peak_bytes["device"] <= tight.device
    one = make_plan(costs, BW, replace(budgets, device=10**12), micro_batches=8)
    assert one.passes == 1  # everything fits: more passes would only cost fetches
    forced = make_plan(costs, BW, tight, micro_batches=8, passes=4)
    assert forced.passes == 4
    io1 = make_plan(costs, BW, replace(tight, device=minimum_device_bytes(costs, budgets, 1)), micro_batches=8,
                    passes=1).io_per_step(costs, BW)
    io4 = forced.io_per_step(costs, BW)
    assert io4["d2h_bytes"] == 4 * io1["d2h_bytes"]
    # Every pass fetches every access again, but stage 0 from one pass's last backward to the next's first forward.
    f1, f4 = fetches_per_step(8, 1, 1), fetches_per_step(8, 4, 1)
    assert f4[0] == 4 * f1[0] - 3 and f4[1:] == [4 * f for f in f1[1:]]
    assert io4["h2d_bytes"] == sum(fetches_per_step(8, 4, forced.prefetch)[i] * costs[i].param_bytes
                                   for i in forced.streamed)
    # Gradients summed over passes stay on the host, whatever the host budget: other families go to disk first.
    on_disk = make_plan(costs, BW, replace(tight, host=80 * MB, disk=None), micro_batches=8, passes=4)
    assert "disk" not in on_disk.grad_home and "disk" in on_disk.opt_home
    with pytest.raises(PlanError, match=r"memory\.passes=3 does not divide the step's 8 micro-batches"):
        make_plan(costs, BW, tight, micro_batches=8, passes=3)
    with pytest.raises(PlanError, match="in 8 accumulation passes"):  # even the most passes do not fit
        make_plan(costs, BW, replace(tight, device=budgets.fixed_for(8)), micro_batches=8)


def test_simulated_passes_fetch_per_pass_and_step_once():
    """Each pass computes its share of the micro-batches and fetches every streamed stage; the step time spans
    all passes (it is measured between first forwards of pass 1), and later passes' gradients are added on the
    host."""
    costs = [replace(c, host_add_s=0.002) for c in _costs(4)]
    home = ("host",) * 4
    one = simulate(costs, BW, home, home, 1, micro_batches=4, passes=1)
    two = simulate(costs, BW, home, home, 1, micro_batches=4, passes=2)
    per_step = lambda tl, label: sum(1 for e in tl.events if e.label.startswith(label)) / 3  # 3 simulated steps
    # Every access fetches, but stage 0 between pass 1's backward and pass 2's forward: its pages stay on the device.
    assert per_step(two, "fetch") == 2 * per_step(one, "fetch") - 1
    assert per_step(two, "add") == 4 and per_step(one, "add") == 0
    compute = lambda tl: sum(e.duration for e in tl.events if e.stream == "compute" and "update" not in e.label)
    assert compute(two) == pytest.approx(compute(one))  # the same stage calls, split over passes
    assert two.step_time >= compute(two) / 3 and one.step_time >= compute(one) / 3
    assert any(e.label == "forward s0 (pass 2)" for e in two.events)


def test_without_overlap_the_step_is_the_sum_of_its_parts():
    """`memory.overlap: false` waits for every piece of work before the next: the predicted step is every
    computation, copy, host update and disk transfer of one step, end to end; the plan's own step is shorter by
    what overlap hides."""
    costs = _costs(4)
    home, opt_home = ("host",) * 4, ("disk",) * 4
    serial = simulate(costs, BW, home, opt_home, 1, overlap=False)
    compute = 3 * 0.010 + 4 * 0.025  # forward of 3 stages, the head's loss and backward, 3 backwards
    fetches = 7 * 4 * MB / BW.h2d  # every access but none held in the window: f0 f1 f2 h3 b2 b1 b0
    grads = 4 * 4 * MB / BW.d2h
    updates = 4 * 0.004
    disk = 4 * 8 * MB / BW.disk_read + 4 * 8 * MB / BW.disk_write  # Adam state read and written once
    assert serial.step_time == pytest.approx(compute + fetches + grads + updates + disk, rel=1e-9)
    assert not any(e.stream == "io_cpu" for e in simulate(  # a transfer's CPU work is inside its own time
        costs, replace(BW, disk_read_cpu=1e-9), home, opt_home, 1, shared_cpu=True, overlap=False).events)
    overlapped = simulate(costs, BW, home, opt_home, 1)
    assert overlapped.step_time < 0.8 * serial.step_time
    budgets = Budgets(device=6 * 4 * MB, host=None, disk=None, fixed_device=0)
    plan = make_plan(costs, BW, budgets)
    assert plan.serial_step_time == without_overlap(plan, costs, BW, False).step_time > plan.predicted.step_time


def test_a_disk_busy_all_step_bounds_it_on_shared_cores():
    """On shared cores (the CPU backend) the simulation tells no waits apart; a disk busy the whole step is still
    what bounds it, not the compute that waits for it."""
    costs = _costs()
    slow_disk = Bandwidths(h2d=4e9, d2h=4e9, disk_read=2e7, disk_write=2e7)
    budgets = Budgets(minimum_device_bytes(costs, Budgets(0, None, 0, 0)), min_host_bytes(costs), None, 0)
    plan = make_plan(costs, slow_disk, budgets, shared_cpu=True)
    assert set(plan.opt_home) == {"disk"} and not plan.predicted.waits
    bound, shares = plan.bound(costs[0].name)
    assert shares["disk"] >= 0.9 and bound == "disk"
