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
    step_starts: list[float] = field(default_factory=list)
    """When each step shown began (its first forward, on the events' clock), oldest first; empty when unknown."""

    def add(self, stream: str, label: str, start: float, end: float) -> None:
        self.events.append(Event(stream, label, start, end))

    def busy(self, stream: str) -> float:
        return sum(e.duration for e in self.events if e.stream == stream)

    @property
    def span(self) -> float:
        return max((e.end for e in self.events), default=0.0) - min((e.start for e in self.events), default=0.0)

    def to_json(self) -> dict:
        return {"step_time": self.step_time, "step_starts": self.step_starts,
                "events": [asdict(e) for e in self.events]}

    def save_json(self, path: Path) -> None:
        Path(path).write_text(json.dumps(self.to_json()))

    @staticmethod
    def from_json(d: dict) -> "Timeline":
        return Timeline([Event(**e) for e in d["events"]], d.get("step_time", 0.0),
                        step_starts=list(d.get("step_starts", [])))

    def save_png(self, path: Path, title: str, *, span: float | None = None, note: str = "") -> float:
        """A Gantt chart, one row per stream (an optional stream's only when it has events), coloured by what each
        event does (the legend), each step's start marked; `span`: the seconds the x axis covers (at least this
        timeline's), so that two charts can share a scale (`save_pngs`); `note`: said after the axis's label. An
        event shorter than 1/800 of the axis is drawn that wide, so that it shows. Returns the seconds the axis
        covers."""
        from matplotlib.figure import Figure  # no pyplot: no global state, no interactive backend (Agg)
        from matplotlib.patches import Patch

        used = {e.stream for e in self.events}
        streams = [s for s in STREAMS if s not in OPTIONAL_STREAMS or s in used]
        fig = Figure(figsize=(12, 3.6), dpi=100)
        ax = fig.add_subplot()
        t0 = min((e.start for e in self.events), default=0.0)
        width = max(span or 0.0, self.span) or 1.0
        unit, scale = ("ms", 1e3) if width < 2.0 else ("s", 1.0)
        kinds: dict[str, str] = {}
        for row, stream in enumerate(streams):
            events = [e for e in self.events if e.stream == stream]
            if events:
                faces = [_kind_color(e.label) for e in events]
                kinds.update({_kind(e.label): c for e, c in zip(events, faces)})
                # Outlined, so that a stream's consecutive events stay apart; a sliver (or thousands of bars, e.g.
                # a step of many passes) would show only its outline: those are outlined in their own colour.
                thin = width / 400
                edges = ["black" if e.duration > thin and len(events) < CROWDED else c for e, c in zip(events, faces)]
                ax.broken_barh([((e.start - t0) * scale, max(e.duration, width / 800) * scale) for e in events],
                               (row - 0.4, 0.8), facecolors=faces, edgecolors=edges, linewidth=0.3)
        for k, start in enumerate(self.step_starts):
            x = (start - t0) * scale
            ax.axvline(x, color="black", linestyle="--", linewidth=0.8)
            ax.text(x, -0.55, f" step {k + 1}", va="bottom", ha="left", fontsize="small")
        ax.set_yticks(range(len(streams)), streams)
        ax.set_ylim(len(streams) - 0.5, -0.9)
        ax.set_xlim(0, width * scale)
        ax.set_xlabel(f"time ({unit}) since the first event{note}")
        ax.set_title(f"{title}: {self._steps_text(scale, unit)}", fontsize="medium")
        handles = [Patch(facecolor=c, edgecolor="black", linewidth=0.3, label=KIND_TEXT.get(k, k))
                   for k, c in sorted(kinds.items(), key=lambda kc: _kind_order(kc[0]))]
        if handles:
            ax.legend(handles=handles, loc="upper left", bbox_to_anchor=(1.005, 1.0), fontsize="small",
                      frameon=False)
        fig.tight_layout()
        fig.savefig(path, format="png")
        return width

    def _steps_text(self, scale: float, unit: str) -> str:
        """What the chart shows, as its title says it: how many steps, and one step's steady-state time."""
        shown = f"{len(self.step_starts)} steps shown" if self.step_starts else "events shown"
        return (f"{shown} ({self.span * scale:.1f} {unit}); one step {self.step_time * scale:.1f} {unit} "
                "in the steady state (start to start)")


KIND_TEXT = {
    "forward": "forward (a stage)", "head": "loss head", "backward": "backward (a stage)",
    "update": "optimizer update", "norm": "gradient norm", "fetch": "fetch: parameters to the device",
    "grad": "gradients to the host", "add": "host: sum of gradients", "sum": "gradients summed on the device",
    "park": "saved inputs to the host", "unpark": "saved inputs back", "read": "disk read", "write": "disk write",
    "spill": "disk spill", "gather": "all-gather", "scatter": "reduce-scatter",
}
"""The legend's words for each kind of event (a label's first word)."""
_COLORS = {"forward": "tab:blue", "head": "tab:purple", "backward": "tab:orange", "update": "tab:green",
           "norm": "yellowgreen", "fetch": "tab:cyan", "grad": "tab:red", "add": "gold", "sum": "khaki",
           "park": "slateblue", "unpark": "lightsteelblue", "read": "tab:olive", "write": "tab:brown",
           "spill": "sienna", "gather": "tab:pink", "scatter": "darkred"}


def _kind(label: str) -> str:
    return label.split()[0] if label else "?"


def _kind_color(label: str) -> str:
    return _COLORS.get(_kind(label), "tab:gray")


def _kind_order(kind: str) -> int:
    order = list(KIND_TEXT)
    return order.index(kind) if kind in order else len(order)


def save_pngs(directory: Path, name: str) -> dict[str, float]:
    """Draw `timeline_predicted.png` and `timeline_measured.png` from the JSON files in `directory` (those that
    exist), on one time scale when both do: the predicted and the measured step side by side. Returns, per chart
    drawn ('predicted', 'measured'), the seconds its time axis covers."""
    directory = Path(directory)
    found = {kind: Timeline.from_json(json.loads(path.read_text()))
             for kind in ("predicted", "measured") if (path := directory / f"timeline_{kind}.json").is_file()}
    span = max((t.span for t in found.values()), default=0.0)
    covered = {}
    for kind, timeline in found.items():
        others = [f"timeline_{k}.png" for k in found if k != kind]
        note = f"; the same scale as {others[0]}" if others else ""
        covered[kind] = timeline.save_png(directory / f"timeline_{kind}.png", f"{name}: {kind} timeline", span=span,
                                          note=note)
    return covered


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
