"""What every detector says, and the one board where the latest readings are kept.

A detector turns kernel file text into a :class:`Reading`: a :class:`Level` with the observed
value, the threshold it was compared with and the scope it is about (the node, a NUMA node, a pod,
a tier). The detection loop publishes each round's smoothed readings on the :class:`Board`; the
mitigation ladder, the eviction manager's in-tree plugins, the metrics and ``nri-qos status``
read them from there. Input that does not parse gives :attr:`Level.UNKNOWN` with the reason:
never "no pressure" by silence.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Collection, Iterable, Mapping
from dataclasses import dataclass
from enum import IntEnum

from common.aio import Callbacks


class Level(IntEnum):
    """How bad it is; ordered, so ``max()`` of readings is the worst."""

    UNKNOWN = -1
    NONE = 0
    LOW = 1
    MEDIUM = 2
    HIGH = 3


LEVEL_BY_NAME: Mapping[str, Level] = {"low": Level.LOW, "medium": Level.MEDIUM, "high": Level.HIGH}
"""The levels a setting can name (a rung's level, a plugin's soft and hard level), by name."""
SETTING_LEVEL_NAMES: tuple[str, ...] = tuple(LEVEL_BY_NAME)
"""Their names, mildest first."""

NODE = "node"
"""Scope of a node-wide reading."""


def numa_scope(node: int) -> str:
    return f"numa:{node}"


def pod_scope(uid: str) -> str:
    return f"pod:{uid}"


def tier_scope(tier: str) -> str:
    return f"tier:{tier}"


@dataclass(frozen=True, slots=True)
class Reading:
    """One detector's verdict about one scope."""

    detector: str
    scope: str
    level: Level
    # The observed value and the threshold of the level reached (or of LOW, when NONE), in
    # ``unit``; for UNKNOWN both are 0 and ``reason`` says why.
    value: float
    threshold: float
    unit: str
    reason: str = ""
    # The pod concerned, for pod-scoped readings.
    pod_uid: str | None = None
    # The event loop's time of the sample.
    at: float = 0.0
    # The level of this sample alone, before smoothing (None: not known). Below ``level``
    # while hysteresis holds a level the signal has already left.
    raw: Level | None = None

    @property
    def key(self) -> tuple[str, str]:
        return (self.detector, self.scope)

    @property
    def fresh(self) -> bool:
        """Whether the latest sample itself is at the level reported (not only held by
        hysteresis); readings that do not say count as fresh. An unknown reading is at no
        level: never fresh (the ladder counts it at its last known level, held)."""
        if self.level is Level.UNKNOWN:
            return False
        return self.raw is None or self.raw >= self.level


class Board:
    """The latest reading per (detector, scope); safe from any thread.

    :meth:`publish` replaces a detector's readings as a whole (scopes it no longer reports are
    gone) and calls the subscribers, outside the lock, when any level changed.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._readings: dict[tuple[str, str], Reading] = {}
        self._changed = Callbacks()

    def publish(self, detector: str, readings: Iterable[Reading]) -> None:
        fresh = {r.key: r for r in readings}
        with self._lock:
            old = {k: r for k, r in self._readings.items() if k[0] == detector}
            changed = {k: r.level for k, r in old.items()} != {
                k: r.level for k, r in fresh.items()}
            for key in old:
                del self._readings[key]
            self._readings.update(fresh)
        if changed:
            self._changed.call()

    def current(self) -> tuple[Reading, ...]:
        with self._lock:
            return tuple(self._readings.values())

    def engaged(self, detectors: Collection[str],
                which: Callable[[Reading], bool] | None = None) -> bool:
        """Whether a reading of ``detectors`` (and, given ``which``, one it accepts) is at a
        level, or its latest sample reached one (a level being entered)."""
        return any(r.detector in detectors and max(r.level, r.raw or Level.NONE) >= Level.LOW
                   and (which is None or which(r)) for r in self.current())

    def worst(self) -> Level:
        """The worst level any detector reports now (NONE when none reports)."""
        return max((r.level for r in self.current()), default=Level.NONE)

    def subscribe(self, callback: Callable[[], None]) -> Callable[[], None]:
        """Call ``callback`` (from the publishing thread) when a level changes."""
        return self._changed.subscribe(callback)
