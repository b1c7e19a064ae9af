"""Timelines: what ran on which stream and when, predicted by the planner or measured by the executor.

Streams: compute (device kernels), h2d and d2h (copy engines), collective (data-parallel all-gathers and
reduce-scatters, with several ranks), host (optimizer updates on the CPU), disk.
The same structure serves both, so `angel-jax plan` and a training run produce pictures that lie side by side
(`timeline_predicted.*` and `timeline_measured.*` in the run directory).
"""

from __future__ import annotations

import json
import queue
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import jax

STREAMS = ("compute", "update", "h2d", "d2h", "collective", "host", "disk", "io_cpu")
OPTIONAL_STREAMS = ("collective", "update")
"""Rows a Gantt chart has only when some event ran on them (one rank has no collectives)."""
CROWDED = 2000
"""A Gantt row of this many events is drawn without outlines."""


@dataclass(frozen=True)
class Event:
    stream: str
    label: str
    start: float
    end: float

    @property
    def duration(self) -> float:
        return self.end - self.start


@dataclass
class Timeline:
    events: list[Event] = field(default_factory=list)
    step_time: float = 0.0
    """Steady-state time of one training step (seconds)."""
    waits: dict[str, float] = field(default_factory=dict)
    """Predicted timelines: seconds of one step the compute stream sat idle, by what it waited for."""

    def add(self, stream: str, label: str, start: float, end: float) -> None:
        self.events.append(Event(stream, label, start, end))

    def busy(self, stream: str) -> float:
        return sum(e.duration for e in self.events if e.stream == stream)

    @property
    def span(self) -> float:
        return max((e.end for e in self.events), default=0.0) - min((e.start for e in self.events), default=0.0)

    def to_json(self) -> dict:
        return {"step_time": self.step_time, "events": [asdict(e) for e in self.events]}

    def save_json(self, path: Path) -> None:
        Path(path).write_text(json.dumps(self.to_json()))

    @staticmethod
    def from_json(d: dict) -> "Timeline":
        return Timeline([Event(**e) for e in d["events"]], d.get("step_time", 0.0))

    def save_png(self, path: Path, title: str) -> None:
        """A Gantt chart, one row per stream (an optional stream's only when it has events)."""
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        colors = {"forward": "tab:blue", "head": "tab:purple", "backward": "tab:orange", "update": "tab:green",
                  "fetch": "tab:cyan", "grad": "tab:red", "read": "tab:olive", "write": "tab:brown",
                  "gather": "tab:pink", "scatter": "darkred"}
        used = {e.stream for e in self.events}
        streams = [s for s in STREAMS if s not in OPTIONAL_STREAMS or s in used]
        fig, ax = plt.subplots(figsize=(12, 3))
        t0 = min((e.start for e in self.events), default=0.0)
        for row, stream in enumerate(streams):
            events = [e for e in self.events if e.stream == stream]
            if events:
                ax.broken_barh([(e.start - t0, max(e.duration, 1e-9)) for e in events], (row - 0.4, 0.8),
                               facecolors=[colors.get(e.label.split()[0], "tab:gray") for e in events],
                               # (thousands of outlined bars, e.g. a step of many passes, would draw only outline)
                               edgecolor="black", linewidth=0.3 if len(events) < CROWDED else 0.0)
        ax.set_yticks(range(len(streams)), streams)
        ax.set_ylim(len(streams) - 0.5, -0.5)
        ax.set_xlabel("seconds")
        ax.set_title(f"{title} (step {self.step_time * 1e3:.1f} ms)")
        fig.tight_layout()
        fig.savefig(path, dpi=100)
        plt.close(fig)


def _wait(obj: Any) -> None:
    """Wait for a recorded event's outputs: jax arrays (pytrees), page-store handles, deferred values."""
    if isinstance(obj, (list, tuple)) and obj and hasattr(obj[0], "wait") and not isinstance(obj[0], jax.Array):
        for item in obj:
            item.wait()
    elif hasattr(obj, "wait") and not isinstance(obj, jax.Array):
        obj.wait()
    else:
        jax.block_until_ready(obj)


class Recorder:
    """The measured timeline, observed from the host: an event ends when its outputs are ready, seen by one waiter
    thread per stream (events of a stream complete in the order they were issued), and starts at the latest of its
    issue, the previous event's end on the stream and, when given, the moment its inputs were ready. Without
    device-side timestamps that is an upper bound of each event's duration (an event that queued behind work on
    another stream looks longer than it ran)."""

    def __init__(self) -> None:
        self.timeline = Timeline()
        self.t0 = time.perf_counter()
        self._queues: dict[str, queue.Queue] = {}
        self._threads: list[threading.Thread] = []
        self._lock = threading.Lock()

    def record(self, stream: str, label: str, outputs: Any, after: Any = None) -> None:
        """An event on `stream` that is over when `outputs` are ready; `after`: its inputs (waitable), when it
        cannot start before they are ready (a copy of a result still being computed)."""
        issued = time.perf_counter() - self.t0
        with self._lock:
            q = self._queues.get(stream)
            if q is None:
                q = self._queues[stream] = queue.Queue()
                thread = threading.Thread(target=self._waiter, args=(stream, q), daemon=True,
                                          name=f"angel_jax-timeline-{stream}")
                thread.start()
                self._threads.append(thread)
        q.put((label, issued, outputs, after))

    def _waiter(self, stream: str, q: queue.Queue) -> None:
        last_end = 0.0
        while (item := q.get()) is not None:
            label, issued, outputs, after = item
            inputs_ready = 0.0
            if after is not None:
                try:
                    _wait(after)
                except Exception:  # noqa: BLE001 - inputs donated to the event: their readiness is unknown
                    pass
                else:
                    inputs_ready = time.perf_counter() - self.t0
            try:
                _wait(outputs)
            except Exception:  # noqa: BLE001 - a failed move still ends; the error surfaces elsewhere
                pass
            end = time.perf_counter() - self.t0
            start = min(max(issued, last_end, inputs_ready), end)
            last_end = end
            with self._lock:
                self.timeline.add(stream, label, start, end)

    def finish(self) -> Timeline:
        """Wait for every recorded event; the timeline, events sorted by start."""
        with self._lock:
            queues = list(self._queues.values())
        for q in queues:
            q.put(None)
        for thread in self._threads:
            thread.join()
        self.timeline.events.sort(key=lambda e: (e.start, e.stream))
        return self.timeline
