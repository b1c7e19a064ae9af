"""Bytes as people read them, and what a device has: the one place for each."""

from __future__ import annotations

import jax


def human_bytes(n: float) -> str:
    """1536 -> '1.50 KiB' (binary units; whole bytes below 1 KiB)."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    raise AssertionError


def device_memory_stats(device: jax.Device) -> dict:
    """The backend's memory statistics of `device` ({} where it reports none, e.g. some CPU builds)."""
    stats = device.memory_stats() if hasattr(device, "memory_stats") else None
    return dict(stats or {})


def device_bytes_in_use(device: jax.Device) -> int | None:
    """Bytes the backend has allocated on `device` (None where it does not say)."""
    return int(stats["bytes_in_use"]) if "bytes_in_use" in (stats := device_memory_stats(device)) else None
