"""The paged runtime's threads: the training thread and the updater's worker share no mutable field, so ending a
timeline recording from the training thread while the worker is still updating cannot break the run."""

from __future__ import annotations

import gc
import threading
import time

import jax
import numpy as np

from angel_jax.config import Config, MemoryConfig, ModelConfig, OptimizerConfig, TrainConfig
from angel_jax.schedule import execute
from angel_jax.schedule.runtime import build_paged_runtime
from angel_jax.schedule.timeline import Recorder
from models import gpt
from test_paged import PAGE, batches

MODEL = ModelConfig(d_model=64, n_layers=2, n_heads=2, seq_len=16, compute_dtype="float32")
WAIT_S = 20.0
"""Longest a deliberate hold waits (a hold that times out fails the test on its own assertions)."""


def _on_worker() -> bool:
    return threading.current_thread().name == "angel_jax-updater"


def _wait_until(condition, timeout: float = WAIT_S) -> bool:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.002)
    return True


def test_ending_a_recording_while_the_worker_updates_is_safe(monkeypatch):
    """Record step 0 only, and end the recording (at step 2) while the worker is in the middle of step 1's updates,
    between looking whether step 1 is recorded and recording into it: the worst moment. Made deterministic by a
    recorder whose hook holds the worker there. A runtime whose worker reads a recording hook that the training
    thread sets and clears (the old `updater.record`) ends this run with an UpdaterError ("'NoneType' object is
    not callable"); with one immutable order per step, step 1's order says "not recorded" and the recorder is
    never consulted again once step 0's updates are complete."""
    cfg = Config(model=MODEL, optimizer=OptimizerConfig(name="adamw", lr=1e-3, warmup_steps=2),
                 train=TrainConfig(steps=10, batch_size=2), memory=MemoryConfig(mode="paged", page_size=PAGE))
    data = batches(3, MODEL, 2)
    params = jax.tree.map(np.array, gpt.init(cfg.model, 0)[1])
    gc.collect()
    engine = build_paged_runtime(cfg, params, data[0])
    ex, updater = engine.executor, engine.updater
    last_update = f"update {engine.model.staged.stages[-1].name}"
    step1_started = threading.Event()
    worker_held = threading.Event()
    recorded: dict = {}  # step 0's metrics
    late: list[str] = []  # the worker's uses of the hook after step 0's updates were complete

    def recorded_updates_done() -> bool:
        return "metrics" in recorded and recorded["metrics"]["update_norm"].done()

    class Hook:
        """`Recorder.record` with holds for the worker: step 0's last update record waits until step 1 is under
        way (so step 1 starts while step 0's updates are in flight: the recording cannot end at step 1), and
        after step 0's updates, a look at the hook (`if hook:`) is noted and, from the second one on (the first
        is the update's inputs, the next comes right before a call), held until the recording has ended."""

        def __init__(self, recorder: Recorder):
            self.recorder = recorder

        def __bool__(self) -> bool:
            if _on_worker() and recorded_updates_done():
                late.append("look")
                if len(late) >= 2:
                    worker_held.set()
                    _wait_until(lambda: ex.last_timeline is not None)
            return True

        def __call__(self, stream: str, label: str, outputs, after=None) -> None:
            if _on_worker():
                if recorded_updates_done():
                    late.append(label)
                if label == last_update:
                    step1_started.wait(WAIT_S)
            Recorder.record(self.recorder, stream, label, outputs, after)

    class HeldRecorder(Recorder):
        @property
        def record(self) -> Hook:  # type: ignore[override]
            return Hook(self)

    acquire = updater.acquire

    def acquire_and_tell(i: int, step: int) -> bool:
        if step == 1:
            step1_started.set()
        return acquire(i, step)

    monkeypatch.setattr(execute, "Recorder", HeldRecorder)
    monkeypatch.setattr(updater, "acquire", acquire_and_tell)
    try:
        ex.record_steps(1)
        recorded["metrics"] = ex.step(data[0])
        second = ex.step(data[1])  # starts while step 0's updates are in flight: the recording goes on
        assert ex.last_timeline is None
        recorded["metrics"]["update_norm"].result()
        # The worker is now at step 1's updates: held at its second look at a hook (a runtime that still consults
        # one), or through them (one that does not).
        assert _wait_until(lambda: worker_held.is_set() or second["update_norm"].done())
        third = ex.step(data[2])  # ends the recording
        losses = [float(m["loss"]) for m in (recorded["metrics"], second, third)]
        assert all(np.isfinite(losses)) and float(third["update_norm"]) > 0
        updater.drain()
    finally:
        engine.close()
    assert late == [], f"the worker consulted the recording after its step's updates were complete: {late}"
    timeline = ex.last_timeline
    assert timeline is not None
    labels = [e.label for e in timeline.events]
    first_forward = f"forward {engine.model.staged.stages[0].name}"
    assert labels.count(first_forward) == 1 and labels.count(last_update) == 1, labels  # step 0 only
