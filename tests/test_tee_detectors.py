"""TEE anomaly detectors (tee/detectors.py): exact firing steps, thresholds, warm-ups, property tests of noise that
must never fire, and the guard bounds the trainer uses.
"""

from __future__ import annotations

import dataclasses
import json
import math
import random
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from angel_jax.tee.detectors import (
    GradSpikeConfig,
    LossSpikeConfig,
    MemoryGrowthConfig,
    MemoryGrowthDetector,
    NanDetector,
    SpikeDetector,
    StepTimeDetector,
    StragglerDetector,
    UpdateSpikeConfig,
    _slope,
)

MiB, GiB = 1 << 20, 1 << 30


def fire_steps(det, seq):
    """Feed (step, *args) tuples; return the final state and {step: anomaly} of what fired."""
    state, fired = det.init(), {}
    for args in seq:
        state, anomaly = det.update(state, *args)
        if anomaly is not None:
            fired[args[0]] = anomaly
    return state, fired


def alternating(n, lo, hi, start=0):
    return [(i, lo if i % 2 == 0 else hi) for i in range(start, start + n)]


# --------------------------------------------------------------------------------------------- NaN


def test_nan_fires_at_once_even_before_any_warmup():
    seq = [(0, {"loss": math.inf}), (1, {"loss": 2.0, "grad_norm": 1.0}), (2, {"loss": 2.0, "grad_norm": math.nan}),
           (3, {"loss": 2.0})]
    state, fired = fire_steps(NanDetector(), seq)
    assert sorted(fired) == [0, 2]
    assert fired[0].metric == "loss" and fired[2].metric == "grad_norm" and fired[2].severity == "critical"
    assert "grad_norm=nan" in fired[2].message and state.count == 2


# --------------------------------------------------------------------------------------------- spikes


def test_loss_spike_threshold_is_exact():
    # Window alternates 2.0 / 2.1: median 2.05, MAD 0.05 -> sigma 0.07413; z 8 -> 2.05 + 0.59304 = 2.64304,
    # min deviation 0.2 * 2.05 = 0.41 -> 2.46; the threshold is the larger, 2.64304.
    det = SpikeDetector("loss_spike", "loss", LossSpikeConfig())
    state, fired = fire_steps(det, alternating(40, 2.0, 2.1))
    assert fired == {}
    assert det.update(state, 40, 2.642)[1] is None
    _, anomaly = det.update(state, 40, 2.644)
    assert anomaly.step == 40 and anomaly.value == 2.644 and anomaly.action is None
    assert anomaly.baseline == pytest.approx(2.05)
    assert anomaly.threshold == pytest.approx(2.05 + 8 * 1.4826 * 0.05)
    assert "2.644" in anomaly.message and "2.64304" in anomaly.message


def test_loss_spike_fires_at_the_exact_step_only():
    seq = alternating(60, 2.0, 2.1)
    seq[25] = (25, 3.0)
    _, fired = fire_steps(SpikeDetector("loss_spike", "loss", LossSpikeConfig()), seq)
    assert sorted(fired) == [25]


def test_spike_warmup_is_respected():
    cfg = LossSpikeConfig()  # warmup 20: the 21st value (step 20) is the first judged
    for step, expect in [(19, []), (20, [20])]:
        seq = alternating(40, 2.0, 2.1)
        seq[step] = (step, 10.0)
        _, fired = fire_steps(SpikeDetector("loss_spike", "loss", cfg), seq)
        assert sorted(fired) == expect


def test_spikes_do_not_poison_the_window():
    clean = alternating(60, 2.0, 2.1)
    spiky = [(i, 50.0) if 30 <= i < 35 else (i, v) for i, v in clean]
    det = SpikeDetector("loss_spike", "loss", LossSpikeConfig())
    s_spiky, fired = fire_steps(det, spiky)
    s_clean, _ = fire_steps(det, [x for x in clean if not 30 <= x[0] < 35])
    assert sorted(fired) == [30, 31, 32, 33, 34]  # a burst shorter than rebaseline_after: every one fires
    assert s_spiky == s_clean  # the baseline never saw them
    assert len(s_spiky.window) == 55 and max(s_spiky.window) == 2.1


def test_lasting_level_shift_is_rebaselined():
    seq = alternating(30, 2.0, 2.1) + alternating(60, 4.0, 4.1, start=30)
    state, fired = fire_steps(SpikeDetector("loss_spike", "loss", LossSpikeConfig()), seq)
    assert sorted(fired) == list(range(30, 40))  # rebaseline_after = 10
    assert "re-baselined" in fired[39].message and "re-baselined" not in fired[38].message
    assert min(state.window) == 4.0


def test_grad_spike_is_judged_on_log_scale():
    # log window alternates 0 / log 1.1: median = log sqrt(1.1), so the baseline is sqrt(1.1) = 1.0488; the
    # z edge is exp(median + 6 * 1.4826 * MAD) = 1.6025, below the 10x gate 10 * 1.0488 = 10.488, which decides.
    det = SpikeDetector("grad_spike", "grad_norm", GradSpikeConfig())
    state, fired = fire_steps(det, alternating(40, 1.0, 1.1))
    assert fired == {}
    assert det.update(state, 40, 10.48)[1] is None
    _, anomaly = det.update(state, 40, 10.49)
    assert anomaly.baseline == pytest.approx(math.sqrt(1.1))
    assert anomaly.threshold == pytest.approx(10 * math.sqrt(1.1))
    assert "log z" in anomaly.message
    assert det.update(state, 40, 0.0)[1] is None and det.update(state, 40, 0.0)[0] is state  # not judged


def test_update_spike_fires_at_twice_the_median():
    # The same window as above: update norms are steadier than gradient norms, so the 2x gate decides.
    det = SpikeDetector("update_spike", "update_norm", UpdateSpikeConfig())
    state, _ = fire_steps(det, alternating(40, 1.0, 1.1))
    assert det.update(state, 40, 2.09)[1] is None
    assert det.update(state, 40, 2.10)[1].threshold == pytest.approx(2 * math.sqrt(1.1))


def test_a_clean_run_of_the_main_job_fires_nothing():
    """Loss, gradient and update norms of every step of a real clean run of the main job (gpt_tiny.yaml, data
    seed 0, 300 steps): no spike detector fires. Its gradient norm reaches 3.9x the median at step 153, which the
    former 2x gradient gate took for a spike (and dropped the update)."""
    run = json.loads((Path(__file__).parent / "fixtures" / "clean_run_gpt_tiny_seed0.json").read_text())
    for name, metric, cfg in (("loss_spike", "loss", LossSpikeConfig()), ("grad_spike", "grad_norm", GradSpikeConfig()),
                              ("update_spike", "update_norm", UpdateSpikeConfig())):
        _, fired = fire_steps(SpikeDetector(name, metric, cfg), list(zip(run["step"], run[metric])))
        assert fired == {}, (name, sorted(fired))
    old_gate = dataclasses.replace(GradSpikeConfig(), min_rel_dev=1.0)
    _, fired = fire_steps(SpikeDetector("grad_spike", "grad_norm", old_gate), list(zip(run["step"], run["grad_norm"])))
    assert sorted(fired) == [153]  # the run really holds the excursion the former default fired on


def test_flat_plateau_with_zero_mad_needs_the_minimum_deviation():
    det = SpikeDetector("loss_spike", "loss", LossSpikeConfig())
    state, _ = fire_steps(det, [(i, 2.3) for i in range(30)])
    assert det.update(state, 30, 2.3 * 1.19)[1] is None  # z = inf, but under the 20% gate
    assert det.update(state, 30, 2.3 * 1.21)[1] is not None


# --------------------------------------------------------------------------------------------- step time


def step_time_seq(slow_ranges, flagged=()):
    seq = [(0, 60.0, "compiling")]
    for i in range(1, 300):
        if i in flagged or i == 100:
            seq.append((i, 2.0 if i in flagged else 20.0, "checkpointing"))
        elif any(a <= i < b for a, b in slow_ranges):
            seq.append((i, 2.0, "training"))
        else:
            seq.append((i, 1.0 if i % 2 else 1.02, "training"))
    return seq


def test_step_time_regression_exact_steps_and_flagged_steps_ignored():
    seq = step_time_seq([(150, 180), (230, 250)], flagged={233})
    _, fired = fire_steps(StepTimeDetector(), seq)
    # 8 of the last 10 judged steps slow: 150..157 -> 157; the second episode skips flagged step 233 -> 238.
    assert sorted(fired) == [157, 238]
    a = fired[157]
    assert a.value == 2.0 and a.baseline in (1.0, 1.01, 1.02) and a.threshold == pytest.approx(1.5 * a.baseline)


def test_step_time_intermittent_slowness_is_not_sustained():
    seq = [(i, 2.0 if i % 2 and i > 50 else 1.0, "training") for i in range(300)]
    assert fire_steps(StepTimeDetector(), seq)[1] == {}


# --------------------------------------------------------------------------------------------- stragglers


def rank_times(step, n=8, slow=None):
    times = {r: 1.0 + 0.01 * ((r + step) % 3) for r in range(n)}
    times.update((slow or {}).get(step, {}))
    return times


def test_straggler_exact_step_and_rank():
    slow = {s: {5: 2.0} if s >= 50 else {} for s in range(100)}
    for s in range(100):
        if s % 10 < 7:
            slow[s][2] = 2.0  # rank 2: 7 of every 10 steps -> never sustained
    _, fired = fire_steps(StragglerDetector(), [(s, rank_times(s, slow=slow)) for s in range(100)])
    assert sorted(fired) == [57] and fired[57].rank == 5
    assert fired[57].baseline == pytest.approx(1.01) and "rank 5" in fired[57].message


def test_two_stragglers_are_reported_worst_first_on_consecutive_steps():
    slow = {s: {3: 1.8, 6: 2.4} for s in range(50, 100)}
    _, fired = fire_steps(StragglerDetector(), [(s, rank_times(s, slow=slow)) for s in range(100)])
    assert {s: a.rank for s, a in fired.items()} == {57: 6, 58: 3}


def test_straggler_needs_min_ranks_and_forgets_absent_ranks():
    det = StragglerDetector()
    _, fired = fire_steps(det, [(s, {0: 5.0}) for s in range(50)])
    assert fired == {}
    state, _ = fire_steps(det, [(s, rank_times(s, n=4)) for s in range(20)])
    state, _ = fire_steps_from(det, state, [(s, rank_times(s, n=3)) for s in range(20, 40)])
    assert [r for r, _, _ in state.ranks] == [0, 1, 2]


def fire_steps_from(det, state, seq):
    fired = {}
    for args in seq:
        state, anomaly = det.update(state, *args)
        if anomaly is not None:
            fired[args[0]] = anomaly
    return state, fired


# --------------------------------------------------------------------------------------------- memory


def test_memory_linear_leak_fires_when_the_window_is_full():
    # warmup 100 ignores steps 0..99; the window (200) is full at step 299; slope 2 MiB/step x span 199.
    _, fired = fire_steps(MemoryGrowthDetector(), [(s, GiB + 2 * MiB * s) for s in range(400)])
    assert sorted(fired) == [299]
    assert fired[299].value == pytest.approx(398 * MiB) and fired[299].threshold == 256 * MiB


def test_memory_threshold_boundary():
    det = MemoryGrowthDetector()
    for rate, expect in [(1.28, {}), (1.30, [299])]:  # x 199 steps: 254.7 MiB vs 258.7 MiB > 256 MiB
        _, fired = fire_steps(det, [(s, GiB + rate * MiB * s) for s in range(400)])
        assert (sorted(fired) or {}) == expect


def test_memory_one_off_jump_does_not_fire_but_a_staircase_leak_does():
    cfg = MemoryGrowthConfig()
    jump = [(s, 4 * GiB + (GiB if s >= 400 else 0)) for s in range(1000)]
    assert fire_steps(MemoryGrowthDetector("device_bytes", cfg), jump)[1] == {}
    # A single least-squares fit over the window would have fired on the jump: the half-window rule matters.
    xs, ys = [s for s, _ in jump[300:500]], [v for _, v in jump[300:500]]
    assert _slope(xs, ys) * 199 > 256 * MiB
    stairs = [(s, 4 * GiB + 64 * MiB * (s // 20)) for s in range(600)]
    assert sorted(fire_steps(MemoryGrowthDetector("device_bytes", cfg), stairs)[1]) == [299]


def test_memory_plateau_after_warmup_is_quiet():
    rng = np.random.default_rng(3)
    t = np.arange(3000)
    host = 8 * GiB + 2 * GiB * (1 - np.exp(-t / 30)) + 16 * MiB * rng.standard_normal(t.size)
    assert fire_steps(MemoryGrowthDetector(), list(zip(t.tolist(), host.tolist())))[1] == {}


# --------------------------------------------------------------------------------------------- properties


@settings(max_examples=60, deadline=None)
@given(st.floats(1e-3, 1e3), st.lists(st.floats(-0.09, 0.09), min_size=30, max_size=150))
def test_loss_noise_inside_the_gate_never_fires(level, rel):
    # Every value within +-9% of `level`: value - median <= 0.18 level < 0.2 x median (>= 0.91 level).
    _, fired = fire_steps(SpikeDetector("loss_spike", "loss", LossSpikeConfig()),
                          [(i, level * (1 + r)) for i, r in enumerate(rel)])
    assert fired == {}


@settings(max_examples=60, deadline=None)
@given(st.floats(1e-6, 1e3), st.lists(st.floats(-0.33, 0.33), min_size=30, max_size=150))
def test_norm_noise_inside_the_gate_never_fires(level, rel):
    _, fired = fire_steps(SpikeDetector("grad_spike", "grad_norm", GradSpikeConfig()),
                          [(i, level * (1 + r)) for i, r in enumerate(rel)])
    assert fired == {}


@settings(max_examples=60, deadline=None)
@given(st.floats(1e-3, 1e3), st.lists(st.floats(0.0, 0.49), min_size=30, max_size=150))
def test_step_time_and_stragglers_below_the_factor_never_fire(base, rel):
    seq = [(i, base * (1 + r), "training") for i, r in enumerate(rel)]
    assert fire_steps(StepTimeDetector(), seq)[1] == {}
    ranks = [(i, {k: base * (1 + rel[(i + k) % len(rel)]) for k in range(6)}) for i in range(len(rel))]
    assert fire_steps(StragglerDetector(), ranks)[1] == {}


@settings(max_examples=40, deadline=None)
@given(st.lists(st.floats(0.0, 85.0), min_size=40, max_size=120))
def test_bounded_memory_noise_never_fires(noise_mib):
    # With a 20-step window, the half-window slope x span is at most 2.88 x the noise amplitude (85 MiB).
    cfg = MemoryGrowthConfig(window=20, warmup=0)
    seq = [(i, GiB + n * MiB) for i, n in enumerate(noise_mib)]
    assert fire_steps(MemoryGrowthDetector("host_bytes", cfg), seq)[1] == {}


# ------------------------------------------------------------------------------------- guard bounds


@pytest.mark.parametrize("log_scale", [False, True])
def test_spike_bound_is_exactly_where_update_fires(log_scale):
    """The trainer's on-device guard uses bound(state): a value above it fires, one at or below it does not."""
    from angel_jax.tee.detectors import SpikeConfig, SpikeDetector

    cfg = SpikeConfig(window=50, warmup=10, log_scale=log_scale)
    det = SpikeDetector("x", "x", cfg)
    rng = random.Random(3)
    state = det.init()
    assert det.bound(state) == math.inf
    for step in range(40):
        state, fired = det.update(state, step, 2.0 + 0.1 * rng.random())
        assert fired is None
        if step < 9:
            assert det.bound(state) == math.inf
    bound = det.bound(state)
    assert 2.0 < bound < math.inf
    assert det.update(state, 40, bound * (1 + 1e-9))[1] is not None
    assert det.update(state, 40, bound * (1 - 1e-9))[1] is None
