"""Configuration of the mitigation ladder."""

from __future__ import annotations

from dataclasses import dataclass

from hooks.config_fields import setting


@dataclass(frozen=True, slots=True)
class MitigationConfig:
    enabled: bool = setting(False, "Act on detected interference (taint, drop cache).")
    drop_cache_timeout_s: float = setting(
        30.0, "Deadline of one drop-cache action.", unit="seconds", minimum=1, maximum=600
    )
    taint_key: str = setting(
        "nri-qos.io/memory-pressure", "Taint put on the node to stop scheduling offline pods."
    )
