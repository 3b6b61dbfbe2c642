"""What one case of the hostile-runtime benchmark ended with."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class Outcome:
    kept: bool
    """The case leaves the connection usable (the agent must answer on it)."""
    note: str = ""


@dataclass
class Result:
    name: str
    alive: bool = False
    hang: bool = False
    growth_mb: float = 0.0
    retained_mb: float = 0.0
    note: str = ""
    error: str = ""
