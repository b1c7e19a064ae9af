"""Goodput: how much of a job's wall time trained the model, and where the rest went. Pure: events in, report out.

    report = goodput([e for e in read_events(run_dir / "events.jsonl") if e["source"] == "watchdog"])
    report["goodput"]                 # productive training time / wall time
    report["badput_s"]["restore"]     # seconds per category

Every instant between `job_start` and `job_end` gets exactly one label, so productive time plus the badput
categories add up to the wall time. Where labels overlap, the one listed first wins:

    detection_recovery  from a fault (a crash's exit, a hang's last progress, a fatal anomaly) to the next
                        attempt's spawn: noticing it, stopping the group (SIGTERM, grace, SIGKILL)
    lost_progress       training done after the checkpoint the next attempt resumed from, up to the fault
                        (it is recomputed); when the job gives up, after the last checkpoint of the attempt
    restore             process 0 in phase 'restoring' (resume at start-up, and rollbacks)
    checkpoint_stall    process 0 in phase 'checkpointing' (the blocking part of saves)
    startup_compile     from job start or a spawn to the attempt's first completed step: processes starting,
                        jax.distributed, set-up and compilation; the first step's compute is counted here too,
                        as its time is dominated by compilation
    shutdown            after the last step: the final checkpoint's commit, processes exiting

Times are the watchdog's (heartbeats are sent as they happen, so its clock sees phases within milliseconds).
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any, Iterable

from angel_jax.phases import Phase

CATEGORIES = ("detection_recovery", "lost_progress", "restore", "checkpoint_stall", "startup_compile", "shutdown")
"""Badput categories, highest priority first."""
_PRIORITY = {c: len(CATEGORIES) - i for i, c in enumerate(CATEGORIES)}


def _fault_time(event: dict[str, Any]) -> float:
    # A hang started at the last progress, not when it was noticed.
    return event["time"] - float(event.get("silent_s") or 0.0) if event["kind"] == "hang" else event["time"]


def _attempts(events: list[dict[str, Any]]) -> dict[int, dict[str, Any]]:
    out: dict[int, dict[str, Any]] = defaultdict(lambda: {"phases": [], "ckpts": {}})
    for e in events:
        kind, a = e["kind"], e.get("attempt")
        if a is None:
            continue
        rec = out[a]
        if kind == "start":
            rec["spawn"] = e["time"]
        elif kind == "first_step":
            rec.setdefault("first", e["time"])
        elif kind == "last_step":
            rec.setdefault("last", e["time"])
        elif kind == "phase":
            rec["phases"].append((e["time"], e["phase"]))
        elif kind == "checkpoint":
            rec["ckpts"][e["step"]] = e["time"]
        elif kind == "resumed":
            rec["resumed"] = e["step"]
            rec["lost_steps"] = e.get("lost_steps")
        elif e.get("fatal") and "fault" not in rec:
            rec["fault"] = _fault_time(e)
    return dict(out)


def _labels(events: list[dict[str, Any]], t0: float, t1: float) -> list[tuple[float, float, str]]:
    attempts = _attempts(events)
    order = sorted(a for a in attempts if "spawn" in attempts[a])
    labels: list[tuple[float, float, str]] = []
    if order:
        labels.append((t0, attempts[order[0]]["spawn"], "startup_compile"))
    for i, a in enumerate(order):
        rec = attempts[a]
        nxt = attempts[order[i + 1]] if i + 1 < len(order) else None
        fault = rec.get("fault")
        end = fault if fault is not None else t1
        labels.append((rec["spawn"], rec.get("first", end), "startup_compile"))
        phases = rec["phases"] + [(end, None)]
        for (start, phase), (stop, _) in zip(phases, phases[1:]):
            if phase == Phase.RESTORING:
                labels.append((start, min(stop, end), "restore"))
            elif phase == Phase.CHECKPOINTING:
                labels.append((start, min(stop, end), "checkpoint_stall"))
        if fault is not None:
            resumed = nxt.get("resumed") if nxt is not None else max(rec["ckpts"], default=None)
            since = rec["ckpts"].get(resumed) if resumed is not None else None
            since = since if since is not None else rec.get("first")
            if since is not None:
                labels.append((since, fault, "lost_progress"))
            labels.append((fault, nxt["spawn"] if nxt is not None else t1, "detection_recovery"))
        elif "last" in rec:
            labels.append((rec["last"], t1, "shutdown"))
    return [(max(s, t0), min(e, t1), c) for s, e, c in labels if min(e, t1) > max(s, t0)]


def paint(labels: Iterable[tuple[float, float, str]], t0: float, t1: float) -> dict[str, float]:
    """Seconds of [t0, t1] under each category (highest priority wins), and 'productive' for the unlabelled."""
    points: list[tuple[float, int, str]] = []
    for s, e, c in labels:
        points += [(s, 1, c), (e, -1, c)]
    points.sort(key=lambda p: p[0])
    active: dict[str, int] = defaultdict(int)
    totals = {c: 0.0 for c in (*CATEGORIES, "productive")}
    prev = t0
    for t, delta, c in points + [(t1, 0, "")]:
        if t > prev:
            live = [k for k, n in active.items() if n > 0]
            totals[max(live, key=_PRIORITY.__getitem__) if live else "productive"] += t - prev
            prev = t
        if delta:
            active[c] += delta
    return totals


def goodput(events: list[dict[str, Any]]) -> dict[str, Any]:
    """The report of one job from its watchdog events (oldest first)."""
    if not events:
        return {"wall_s": 0.0, "productive_s": 0.0, "goodput": None, "badput_s": {c: 0.0 for c in CATEGORIES},
                "badput": {c: None for c in CATEGORIES}, "attempts": 0, "restarts": 0, "lost_steps": 0}
    start = next((e["time"] for e in events if e["kind"] == "job_start"), events[0]["time"])
    end = next((e["time"] for e in reversed(events) if e["kind"] == "job_end"), events[-1]["time"])
    wall = max(end - start, 0.0)
    totals = paint(_labels(events, start, end), start, end)
    attempts = _attempts(events)
    lost = sum(int(r.get("lost_steps") or 0) for r in attempts.values())
    def frac(x: float) -> float | None:
        return round(x / wall, 4) if wall > 0 else None

    return {"wall_s": round(wall, 3), "productive_s": round(totals["productive"], 3),
            "goodput": frac(totals["productive"]),
            "badput_s": {c: round(totals[c], 3) for c in CATEGORIES},
            "badput": {c: frac(totals[c]) for c in CATEGORIES},
            "attempts": len([a for a in attempts.values() if "spawn" in a]),
            "restarts": sum(1 for e in events if e["kind"] == "restart"), "lost_steps": lost}


def format_report(report: dict[str, Any]) -> str:
    """The report as a small table for the terminal."""
    wall = report["wall_s"]
    lines = [f"goodput {report['goodput']:.1%} of {wall:.1f} s wall time "
             f"({report['attempts']} attempt(s), {report['restarts']} restart(s), "
             f"{report['lost_steps']} step(s) recomputed)" if report["goodput"] is not None else "goodput: no data",
             f"  {'productive':<20}{report['productive_s']:>10.2f} s"]
    for c in CATEGORIES:
        lines.append(f"  {c:<20}{report['badput_s'][c]:>10.2f} s")
    return "\n".join(lines)
