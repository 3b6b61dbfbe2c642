"""The four QoS levels every feature keys on (named as in Katalyst)."""

from __future__ import annotations

from enum import StrEnum


class QosLevel(StrEnum):
    DEDICATED_CORES = "dedicated_cores"
    SHARED_CORES = "shared_cores"
    RECLAIMED_CORES = "reclaimed_cores"
    SYSTEM_CORES = "system_cores"


LEVEL_NAMES: tuple[str, ...] = tuple(level.value for level in QosLevel)
