"""The run's event log: `<run_dir>/events.jsonl`, one JSON object per line, appended by every writer.

    log = EventLog(run_dir / "events.jsonl", source="rank0")
    log.write("anomaly", step=42, detector="loss_spike", action="rollback", message="...")

Several processes append to the same file (the watchdog coordinator and the workers' in-process detectors): each
event is one `write()` of one line on a file opened with O_APPEND, so lines from different processes never
interleave (POSIX appends of this size are atomic on local file systems). Every event has `time` (Unix seconds),
`kind` and `source`; the rest is the event's own fields. Non-finite floats are written as strings ("nan", "inf")
so the file stays strict JSON.
"""

from __future__ import annotations

import json
import math
import os
import threading
import time
from pathlib import Path
from typing import Any, Callable, Iterator


def _jsonable(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return repr(value)
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    return value


class EventLog:
    """Appends events to a JSONL file; thread-safe, and safe to share between processes."""

    def __init__(self, path: Path, *, source: str, clock: Callable[[], float] = time.time):
        self.path = Path(path)
        self.source = source
        self._clock = clock
        self._lock = threading.Lock()
        self._fd: int | None = None

    def write(self, kind: str, **fields: Any) -> dict[str, Any]:
        event = {"time": round(self._clock(), 6), "kind": kind, "source": self.source, **_jsonable(fields)}
        line = (json.dumps(event, allow_nan=False) + "\n").encode()
        with self._lock:
            if self._fd is None:
                self.path.parent.mkdir(parents=True, exist_ok=True)
                self._fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
            os.write(self._fd, line)
        return event

    def close(self) -> None:
        with self._lock:
            if self._fd is not None:
                os.close(self._fd)
                self._fd = None


def read_events(path: Path, kind: str | None = None) -> Iterator[dict[str, Any]]:
    """The events of a log, oldest first (a last line cut short by a kill is skipped)."""
    try:
        lines = Path(path).read_text().splitlines()
    except FileNotFoundError:
        return
    for line in lines:
        try:
            event = json.loads(line)
        except json.JSONDecodeError:
            continue
        if kind is None or event.get("kind") == kind:
            yield event
