"""The four QoS levels every feature keys on (named as in Katalyst)."""

from __future__ import annotations

from enum import StrEnum


class QosLevel(StrEnum):
    DEDICATED_CORES = "dedicated_cores"
    SHARED_CORES = "shared_cores"
    RECLAIMED_CORES = "reclaimed_cores"
    SYSTEM_CORES = "system_cores"


LEVEL_NAMES: tuple[str, ...] = tuple(level.value for level in QosLevel)

PRIVILEGE: dict[str, int] = {
    QosLevel.RECLAIMED_CORES: 0,
    QosLevel.SHARED_CORES: 1,
    QosLevel.DEDICATED_CORES: 2,
    QosLevel.SYSTEM_CORES: 3,
}
"""How much a level is given, lowest first: reclaimed_cores is capped and evicted first,
system_cores is never evicted and outside every cap. A pod's claim is bounded by this order."""
