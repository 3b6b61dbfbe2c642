"""The in-tree plugins: the detectors' readings (on the :class:`Board`) turned into proposals.

* ``system_pressure``: the node-wide detectors (free memory vs watermark, PSI, kswapd by default)
  at their worst; condition ``NriQosSystemMemoryPressure``.
* ``numa_pressure``: free memory vs watermark of the worst NUMA node; condition
  ``NriQosNumaMemoryPressure``.
* ``reclaimed_pressure``: the reclaimed tier's fulfillment (what the memory guard lets it have vs
  what its pods request); condition ``NriQosReclaimedTierPressure``.
* ``rss_overuse``: pods whose anonymous memory is over request x factor; proposes them as soft
  candidates (no threshold, no condition).

A pressure plugin's threshold is soft-met at the configured soft level and hard-met at the hard
level (default medium and high); when hard-met, its top pods are the pods of the configured QoS
levels (default reclaimed_cores only), largest anonymous memory first. The detectors smooth
their own levels; UNKNOWN readings never count as pressure (nor as its absence: they are skipped).

The node-wide readings count on their own only where ``mitigation.node_signals`` lets them drive
the ladder (the caller says so through ``counted``,
:class:`~reconciler.detection.counting.Counting`). Elsewhere ``system_pressure`` and
``numa_pressure`` take the lower of their level and what the online pods feel (their own PSI or
refaults, and the memcg pressure events where those count): free memory that page cache took,
or the offline tier's reclaim at its own cap, fills the node-wide readings on any busy node
while no online pod feels it, and must not evict offline pods for nothing.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from hooks.levels import QosLevel
from reconciler.detection.counting import Counting
from reconciler.detection.detectors import RECLAIMED_TIER
from reconciler.detection.signals import LEVEL_BY_NAME, NODE, Board, Level, Reading
from reconciler.eviction.api import (
    NOT_MET,
    ActivePod,
    Condition,
    EvictionPlugin,
    EvictPods,
    EvictRequest,
    MetType,
    Operator,
    ThresholdMet,
    TopPods,
)
from reconciler.eviction.config import EvictionConfig, grace_of

# Detectors whose value falls as things get worse (free memory, fulfillment); the others rise.
_FALLING = frozenset({"system_free", "numa_free", "fulfillment"})


def largest_first(active: Sequence[ActivePod], levels: Sequence[str],
                  top_n: int) -> list[ActivePod]:
    """Pods of ``levels``, largest anonymous memory first (unknown last), at most ``top_n``."""
    eligible = [pod for pod in active if pod.qos_level in levels]
    eligible.sort(key=lambda pod: -(pod.memory_usage_bytes or 0))
    return eligible[:top_n]


class PressurePlugin:
    """A plugin over the worst of some readings; see the module doc."""

    def __init__(self, name: str, condition: str, board: Board,
                 config: Callable[[], EvictionConfig],
                 wants: Callable[[Reading, EvictionConfig], bool],
                 levels: Callable[[EvictionConfig], Sequence[str]],
                 counted: Callable[[], Counting] | None = None, *,
                 tier_only: bool = False) -> None:
        # None: the plugin's readings are not node-wide and always count on their own.
        self._counted = counted
        # Only the pods in the BestEffort tier are chosen (ActivePod.outside_tier).
        self._tier_only = tier_only
        self._name = name
        self._condition = condition
        self._board = board
        self._config = config
        self._wants = wants
        self._levels = levels

    @property
    def name(self) -> str:
        return self._name

    async def threshold_met(self) -> ThresholdMet:
        cfg = self._config()
        current = self._board.current()
        readings = [r for r in current if r.level is not Level.UNKNOWN and self._wants(r, cfg)]
        worst = max(readings, key=lambda r: r.level, default=None)
        if worst is None:
            return ThresholdMet(MetType.NOT_MET, condition=Condition(self._condition, False))
        level = worst.level
        if self._counted is not None:
            counted = self._counted()
            if not counted.node:
                level = min(level, counted.online_level(current))
        soft, hard = LEVEL_BY_NAME[cfg.soft_level], LEVEL_BY_NAME[cfg.hard_level]
        met = MetType.HARD_MET if level >= hard else \
            MetType.SOFT_MET if level >= soft else MetType.NOT_MET
        operator = Operator.LESS_THAN if worst.detector in _FALLING else Operator.GREATER_THAN
        return ThresholdMet(met, worst.threshold, worst.value, operator, worst.scope,
                            Condition(self._condition, met is not MetType.NOT_MET),
                            signal=worst.detector, unit=worst.unit)

    async def get_top_eviction_pods(self, active: Sequence[ActivePod], top_n: int,
                                    scope: str) -> TopPods:
        cfg = self._config()
        if self._tier_only:
            active = [pod for pod in active if not pod.outside_tier]
        chosen = largest_first(active, self._levels(cfg), top_n)
        every_reclaimed = bool(chosen) and all(
            p.qos_level == QosLevel.RECLAIMED_CORES for p in chosen)
        grace = grace_of(cfg.reclaimed_grace_period_s) if every_reclaimed else None
        return TopPods(tuple(p.uid for p in chosen), grace)

    async def get_evict_pods(self, active: Sequence[ActivePod]) -> EvictPods:
        return EvictPods()


class RssOverusePlugin:
    """Pods over request x factor, as the rss_overuse detector reports them: soft candidates."""

    name = "rss_overuse"

    def __init__(self, board: Board, config: Callable[[], EvictionConfig]) -> None:
        self._board = board
        self._config = config

    async def threshold_met(self) -> ThresholdMet:
        return NOT_MET

    async def get_top_eviction_pods(self, active: Sequence[ActivePod], top_n: int,
                                    scope: str) -> TopPods:
        return TopPods(())

    async def get_evict_pods(self, active: Sequence[ActivePod]) -> EvictPods:
        cfg = self._config()
        by_uid = {pod.uid: pod for pod in active}
        found = []
        for reading in self._board.current():
            if reading.detector != "rss_overuse" or reading.pod_uid is None:
                continue
            pod = by_uid.get(reading.pod_uid)
            # Level high is request x factor (low is the request itself: a pod within its
            # factor is not overusing); the values are checked too, so that a reading that
            # contradicts itself, or a level held by hysteresis, never evicts.
            if pod is None or reading.level < Level.HIGH or reading.value <= reading.threshold \
                    or pod.qos_level not in cfg.rss_overuse_levels:
                continue
            grace = cfg.reclaimed_grace_period_s if pod.qos_level == QosLevel.RECLAIMED_CORES \
                else cfg.grace_period_s
            found.append(EvictRequest(
                pod.uid, f"anonymous memory {int(reading.value)} B over {int(reading.threshold)} "
                f"B (request x factor)", grace_of(grace), force=False))
        return EvictPods(tuple(found))


def _system(reading: Reading, cfg: EvictionConfig) -> bool:
    return reading.scope == NODE and reading.detector in cfg.system_detectors


def _numa(reading: Reading, cfg: EvictionConfig) -> bool:
    return reading.detector == "numa_free" and reading.scope.startswith("numa:")


def _reclaimed(reading: Reading, cfg: EvictionConfig) -> bool:
    return reading.detector == "fulfillment" and reading.scope == RECLAIMED_TIER


SYSTEM_CONDITION = "NriQosSystemMemoryPressure"
NUMA_CONDITION = "NriQosNumaMemoryPressure"
RECLAIMED_CONDITION = "NriQosReclaimedTierPressure"
IN_TREE_CONDITIONS = (SYSTEM_CONDITION, NUMA_CONDITION, RECLAIMED_CONDITION)
"""The node conditions the in-tree plugins keep (nri-qos reset takes them off)."""


def in_tree_plugins(board: Board, config: Callable[[], EvictionConfig],
                    counted: Callable[[], Counting]) -> dict[str, EvictionPlugin]:
    """Every in-tree plugin by name; ``[eviction] plugins`` says which of them run.
    ``counted``: which kinds of reading count now (see the module doc)."""

    def pressure_levels(cfg: EvictionConfig) -> Sequence[str]:
        return cfg.pressure_levels

    plugins: list[EvictionPlugin] = [
        PressurePlugin("system_pressure", SYSTEM_CONDITION, board, config, _system,
                       pressure_levels, counted),
        PressurePlugin("numa_pressure", NUMA_CONDITION, board, config, _numa,
                       pressure_levels, counted),
        RssOverusePlugin(board, config),
        # The reclaimed tier's own shortage is only ever solved by its own pods: those in the
        # tier's cgroup, not a pod of another QoS class claiming the level.
        PressurePlugin("reclaimed_pressure", RECLAIMED_CONDITION, board, config,
                       _reclaimed, lambda cfg: (QosLevel.RECLAIMED_CORES,), tier_only=True),
    ]
    return {plugin.name: plugin for plugin in plugins}
