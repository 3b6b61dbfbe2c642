"""Quantities written for people: byte counts in KiB/MiB/GiB, other units as short as exact."""

from __future__ import annotations

_BINARY = (("TiB", 1 << 40), ("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10))


def human_bytes(value: float) -> str:
    """``19658117120`` -> ``18.3 GiB``; below 1 KiB, ``512 B``."""
    for suffix, factor in _BINARY:
        if abs(value) >= factor:
            return f"{value / factor:.1f} {suffix}"
    return f"{value:.0f} B"


def quantity(value: float, unit: str) -> str:
    """A value with its unit: bytes as :func:`human_bytes`, anything else as ``50 percent``."""
    if unit == "bytes":
        return human_bytes(value)
    return f"{value:g} {unit}".rstrip()
