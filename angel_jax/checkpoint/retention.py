"""Which steps a tier keeps: a pure function, so the policy is tested without files."""

from __future__ import annotations

from typing import Iterable


def steps_to_keep(steps: Iterable[int], keep_last: int, keep_every: int | None = None) -> set[int]:
    """The newest `keep_last` steps, plus every step divisible by `keep_every` (long-term history)."""
    ordered = sorted(set(steps))
    keep = set(ordered[-keep_last:]) if keep_last > 0 else set()
    if keep_every:
        keep.update(s for s in ordered if s % keep_every == 0)
    return keep
