"""Which readings count as pressure: the online pods' own, and coarser ones only in their stead.

Readings of memory pressure come in three kinds, finest first:

* **the online pods' own**: each online pod's PSI (cgroup v2), or its working-set refaults
  where it has no PSI of its own (cgroup v1). They say that an online pod loses time or memory.
* **memcg pressure events** (cgroup v1 ``memory.pressure_level`` of the root memcg, kubelet's
  pods and burstable cgroups): reclaim in a cgroup that holds online pods, not whose pages it
  took. On a node whose pods cgroup is full of the offline tier's page cache they fire
  thousands of times a minute while the online pods keep their memory.
* **node-wide**: free memory of the machine and of each NUMA node, kswapd's rate, the node's
  PSI. They also count the offline tier's reclaim at its own cap and page cache filling free
  memory, as on any busy node.

The ladder and the eviction manager's node-wide plugins read a :class:`Counting`, which the
mitigation settings decide (``mitigation.node_signals``).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from reconciler.detection.config import KSWAPD, NUMA_FREE, PRESSURE_LEVEL, PSI, REFAULT, SYSTEM_FREE
from reconciler.detection.signals import NODE, Level, Reading

NODE_WIDE = frozenset({SYSTEM_FREE, NUMA_FREE, KSWAPD})
"""Detectors whose readings are all node-wide (the PSI detector's are when scoped to the node)."""


def node_wide(reading: Reading) -> bool:
    """A reading of the whole node or of a NUMA node, not of an online pod or a cgroup."""
    return reading.detector in NODE_WIDE or (reading.detector == PSI and reading.scope == NODE)


def pod_or_memcg(reading: Reading) -> bool:
    """Not a node-wide reading: an online pod's own, or a memcg pressure event."""
    return not node_wide(reading)


def memcg_event(reading: Reading) -> bool:
    return reading.detector == PRESSURE_LEVEL


def pods_own(reading: Reading) -> bool:
    """An online pod's own reading: its PSI or its refaults."""
    return reading.detector == REFAULT or (reading.detector == PSI and reading.scope != NODE)


@dataclass(frozen=True, slots=True)
class Counting:
    """Whether the coarser kinds count now; the online pods' own readings always do."""

    memcg: bool = True
    node: bool = True

    def counts(self, reading: Reading) -> bool:
        if node_wide(reading):
            return self.node
        if memcg_event(reading):
            return self.memcg
        return True

    def online_level(self, readings: Iterable[Reading]) -> Level:
        """The worst level of what online pods feel: their own readings, and the memcg
        pressure events where those count."""
        return max((r.level for r in readings if r.level is not Level.UNKNOWN and (
            pods_own(r) or (self.memcg and memcg_event(r)))), default=Level.NONE)
