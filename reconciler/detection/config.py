"""Configuration of memory interference detection."""

from __future__ import annotations

from dataclasses import dataclass

from hooks.config_fields import setting


@dataclass(frozen=True, slots=True)
class DetectionConfig:
    enabled: bool = setting(False, "Detect memory interference (free vs watermark, PSI).")
    interval_s: float = setting(5.0, "Period of the detectors.", unit="seconds",
                                minimum=0.1, maximum=3600)
    psi_some_avg10: float = setting(
        15.0, "PSI memory some avg10 at or above which the node is under pressure.",
        unit="percent", minimum=0, maximum=100,
    )
