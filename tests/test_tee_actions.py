"""TEE suites and policy (tee/actions.py): no false positives on noisy healthy runs, each fault reported with the
policy's action, JSON round trips of the suites' states, strict parsing of observations, configs and policies.
"""

from __future__ import annotations

import dataclasses
import json
import math

import numpy as np
import pytest

from angel_jax.tee.actions import Action, ActionPolicy, CrossRankSuite, DetectorSuite, strongest
from angel_jax.tee.detectors import AnomalyConfig, LossSpikeConfig, MemoryState, SpikeState, StepTimeDetector
from test_tee_detectors import GiB, MiB, rank_times


# --------------------------------------------------------------------------------------------- healthy runs


def healthy_run(seed, n=2000):
    """A realistic clean job: decaying loss with 5% multiplicative noise, noisy norms, LR warm-up, jittery
    step times with flagged compiling / checkpointing / restoring steps and unflagged one-off GC pauses, memory that
    fills up then plateaus."""
    rng = np.random.default_rng(seed)
    t = np.arange(n)
    noise = lambda s: np.exp(s * rng.standard_normal(n))  # noqa: E731
    loss = (2.0 + 8.0 * np.exp(-t / 300) + 0.5 * np.exp(-t / 30)) * noise(0.05)
    grad = (0.5 + 5.0 * np.exp(-t / 50) + 2e-4 * t) * noise(0.25)
    lr = np.minimum((t + 1) / 200, 1.0) * (0.1 + 0.9 * 0.5 * (1 + np.cos(np.pi * t / n)))
    update = 3.0 * lr * noise(0.05)
    step_time = 0.4 * (1 + 0.1 * rng.uniform(-1, 1, n))
    phase = np.array(["training"] * n, dtype=object)
    phase[0], step_time[0] = "compiling", 45.0
    for s in range(200, n, 200):
        phase[s], step_time[s] = "checkpointing", 6.0
    for s in range(500, n, 500):
        phase[s], step_time[s] = "restoring", 3.0
    step_time[97::97] *= 3.0  # GC pauses: not flagged, not sustained
    host = 6 * GiB + 2 * GiB * (1 - np.exp(-t / 25)) + 32 * MiB * rng.standard_normal(n)
    device = 30 * GiB + 512 * MiB * (t > 0) + 4 * MiB * rng.standard_normal(n)
    return [{"step": int(i), "loss": float(loss[i]), "grad_norm": float(grad[i]), "update_norm": float(update[i]),
             "step_time": float(step_time[i]), "phase": str(phase[i]), "host_bytes": float(host[i]),
             "device_bytes": float(device[i])} for i in range(n)]


@pytest.mark.parametrize("seed", [0, 1, 2, 3])
def test_no_false_positives_on_a_healthy_run(seed):
    suite = DetectorSuite()
    found = [a for obs in healthy_run(seed) for a in suite.update(obs)]
    assert found == []


def test_no_false_positives_across_ranks():
    rng = np.random.default_rng(7)
    suite, found = CrossRankSuite(), []
    for step in range(1500):
        times = {r: 0.4 * (1 + 0.1 * rng.uniform(-1, 1)) for r in range(16)}
        if step % 37 == 0:
            times[int(rng.integers(16))] *= 4  # one rank's GC pause
        found += suite.update({"step": step, "rank_step_times": times})
    assert found == []


# --------------------------------------------------------------------------------------------- suites


def faulty_run():
    obs = healthy_run(11, n=1400)
    obs[150]["grad_norm"] = math.nan
    obs[400]["loss"] *= 3
    obs[600]["grad_norm"] *= 20
    for o in obs[800:830]:
        o["step_time"] *= 3
    for o in obs[700:]:
        o["host_bytes"] += 4 * MiB * (o["step"] - 700)
    return obs


def test_suite_reports_each_fault_with_the_policy_action():
    suite = DetectorSuite(policy=ActionPolicy.from_dict({"step_time": "restart"}))
    found = {(a.detector, a.step): a.action for obs in faulty_run() for a in suite.update(obs)}
    assert found == {("nan", 150): Action.ROLLBACK, ("loss_spike", 400): Action.ROLLBACK,
                     ("grad_spike", 600): Action.SKIP, ("step_time", 808): Action.RESTART,
                     ("memory_growth", 839): Action.RESTART}


def test_suite_json_round_trip_mid_stream_gives_identical_outputs():
    obs = faulty_run()
    a, outs_a = DetectorSuite(), []
    for o in obs[:500]:
        a.update(o)
    blob = json.dumps(a.to_dict(), allow_nan=False)
    b = DetectorSuite.from_dict(json.loads(blob))
    assert b.state == a.state
    outs_b = []
    for o in obs[500:]:
        outs_a += [x.to_dict() for x in a.update(o)]
        outs_b += [x.to_dict() for x in b.update(o)]
    assert len(outs_a) == 3 and outs_a == outs_b
    assert json.dumps(a.to_dict()) == json.dumps(b.to_dict())


def test_cross_rank_json_round_trip_mid_stream():
    slow = {s: {4: 2.0} for s in range(30, 60)}
    obs = []
    for s in range(80):
        obs.append({"step": s, "rank_step_times": rank_times(s, slow=slow)})
    a = CrossRankSuite()
    for o in obs[:35]:  # up to step 34
        a.update(o)
    b = CrossRankSuite.from_dict(json.loads(json.dumps(a.to_dict(), allow_nan=False)))
    outs_a = [x.to_dict() for o in obs[35:] for x in a.update(o)]
    outs_b = [x.to_dict() for o in obs[35:] for x in b.update(o)]
    # straggler: 30..37 slow -> 37.
    assert [(x["detector"], x["step"], x["rank"]) for x in outs_a] == [("straggler", 37, 4)]
    assert outs_a == outs_b


def test_state_from_dict_is_strict():
    with pytest.raises(ValueError, match="unknown keys"):
        SpikeState.from_dict({"window": [], "pending": [], "extra": 1})
    with pytest.raises(ValueError, match=r"SpikeState.window\[1\]"):
        SpikeState.from_dict({"window": [1.0, "x"], "pending": []})
    with pytest.raises(ValueError, match="MemoryState.seen"):
        MemoryState.from_dict({"seen": 1.5, "steps": [], "values": [], "active": False})
    suite = DetectorSuite()
    with pytest.raises(ValueError, match="format"):
        suite.load_dict({"states": {}})
    raw = suite.to_dict()
    raw["states"]["step_time"]["recent"] = [1]
    with pytest.raises(ValueError, match="'step_time'.*StepTimeState.recent"):
        suite.load_dict(raw)
    # A detector disabled now: its saved state is ignored; one missing from the save starts fresh.
    off = dataclasses.replace(AnomalyConfig(), step_time=dataclasses.replace(AnomalyConfig().step_time, enabled=False))
    fewer = DetectorSuite.from_dict(DetectorSuite().to_dict(), off)
    assert "step_time" not in fewer.state
    assert DetectorSuite.from_dict(fewer.to_dict()).state["step_time"] == StepTimeDetector().init()


def test_suite_observation_checks_and_missing_keys():
    suite = DetectorSuite()
    with pytest.raises(ValueError, match="'grad_nrom'"):
        suite.update({"step": 1, "grad_nrom": 1.0})
    with pytest.raises(ValueError, match="'step'"):
        suite.update({"loss": 1.0})
    with pytest.raises(ValueError, match="'phase'"):
        suite.update({"step": 1, "phase": "warmup"})
    with pytest.raises(ValueError, match="'loss'"):
        suite.update({"step": 1, "loss": "2.0"})
    before = dict(suite.state)
    suite.update({"step": 1, "loss": np.float32(2.0), "phase": None})
    changed = {k for k in before if suite.state[k] != before[k]}
    assert changed == {"loss_spike"}
    suite.state["host_memory"] = MemoryState(5)
    suite.reset()
    assert suite.state["host_memory"] == MemoryState()
    with pytest.raises(ValueError, match="'rank_step_times': rank 'x' is not an int"):
        CrossRankSuite().update({"step": 1, "rank_step_times": {"x": 1.0}})


def test_invalid_config_is_an_error_naming_the_key():
    bad = dataclasses.replace(AnomalyConfig(), loss_spike=LossSpikeConfig(warmup=0))
    with pytest.raises(ValueError, match="'loss_spike.warmup'"):
        DetectorSuite(bad)


def test_every_config_field_has_a_doc():
    sections = [AnomalyConfig, ActionPolicy] + [type(getattr(AnomalyConfig(), f.name))
                                               for f in dataclasses.fields(AnomalyConfig)]
    undocumented = [f"{cls.__name__}.{f.name}" for cls in sections for f in dataclasses.fields(cls)
                    if not f.metadata.get("doc")]
    assert len(sections) == 9 and undocumented == []


# --------------------------------------------------------------------------------------------- policy


def test_policy_defaults_and_strict_parsing():
    p = ActionPolicy()
    assert p.to_dict() == {"nan": "rollback", "loss_spike": "rollback", "grad_spike": "skip",
                           "update_spike": "skip", "step_time": "log", "straggler": "log",
                           "memory_growth": "restart"}
    q = ActionPolicy.from_dict({"straggler": "exclude", "step_time": "restart"})
    assert q.straggler is Action.EXCLUDE and q.action_for("step_time") is Action.RESTART and q.nan is Action.ROLLBACK
    assert ActionPolicy.from_dict(q.to_dict()) == q
    with pytest.raises(ValueError, match="unknown detector 'loss_spikes'"):
        ActionPolicy.from_dict({"loss_spikes": "log"})
    with pytest.raises(ValueError, match="unknown action 'reboot' for detector 'straggler'"):
        ActionPolicy.from_dict({"straggler": "reboot"})
    with pytest.raises(ValueError, match="unknown action 3"):
        ActionPolicy.from_dict({"straggler": 3})
    with pytest.raises(ValueError, match="unknown detector 'disk'"):
        p.action_for("disk")


def test_policy_names_match_the_detectors():
    names = {d.name for s in (DetectorSuite(), CrossRankSuite()) for d in s.detectors.values()}
    assert names == set(ActionPolicy.names())


def test_strongest_action():
    suite = DetectorSuite()
    found = suite.update({"step": 0, "loss": math.nan})
    assert strongest(found) is Action.ROLLBACK and strongest([]) is None
    marked = [dataclasses.replace(found[0], action=a) for a in (Action.SKIP, Action.EXCLUDE, Action.RESTART)]
    assert strongest(marked) is Action.EXCLUDE
