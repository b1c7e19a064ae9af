"""Timelines: what ran on which stream and when, predicted by the planner or measured by the executor.

Streams: compute (device kernels), h2d and d2h (copy engines), host (optimizer updates on the CPU), disk.
The same structure serves both, so `angel-jax plan` and a training run produce pictures that lie side by side.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path

STREAMS = ("compute", "h2d", "d2h", "host", "disk")


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

    def add(self, stream: str, label: str, start: float, end: float) -> None:
        self.events.append(Event(stream, label, start, end))

    def busy(self, stream: str) -> float:
        return sum(e.duration for e in self.events if e.stream == stream)

    def to_json(self) -> dict:
        return {"step_time": self.step_time, "events": [asdict(e) for e in self.events]}

    def save_json(self, path: Path) -> None:
        Path(path).write_text(json.dumps(self.to_json()))

    @staticmethod
    def from_json(d: dict) -> "Timeline":
        return Timeline([Event(**e) for e in d["events"]], d.get("step_time", 0.0))

    def save_png(self, path: Path, title: str) -> None:
        """A Gantt chart, one row per stream."""
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        colors = {"forward": "tab:blue", "head": "tab:purple", "backward": "tab:orange", "update": "tab:green",
                  "fetch": "tab:cyan", "grad": "tab:red", "read": "tab:olive", "write": "tab:brown"}
        fig, ax = plt.subplots(figsize=(12, 3))
        t0 = min((e.start for e in self.events), default=0.0)
        for row, stream in enumerate(STREAMS):
            for e in (e for e in self.events if e.stream == stream):
                color = colors.get(e.label.split()[0], "tab:gray")
                ax.barh(row, max(e.duration, 1e-9), left=e.start - t0, color=color, edgecolor="black", linewidth=0.3)
        ax.set_yticks(range(len(STREAMS)), STREAMS)
        ax.invert_yaxis()
        ax.set_xlabel("seconds")
        ax.set_title(f"{title} (step {self.step_time * 1e3:.1f} ms)")
        fig.tight_layout()
        fig.savefig(path, dpi=100)
        plt.close(fig)
