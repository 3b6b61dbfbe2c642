"""What an eviction plugin is: three calls, and the plain values they take and give.

In-tree plugins are Python objects with these three coroutine methods; out-of-tree plugins
answer the same calls over gRPC (``protos/eviction.proto``), adapted to this interface by
:mod:`reconciler.eviction.remote`. The manager treats both alike: every call has a deadline, and
an answer is checked before it is used.
"""

from __future__ import annotations

import enum
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

PLUGIN_NAME = re.compile(r"[A-Za-z0-9_.-]{1,64}")
"""What a plugin may be called (an out-of-tree plugin's socket name without ``.sock``)."""


class MetType(enum.IntEnum):
    """How far a plugin's threshold is met; ordered."""

    NOT_MET = 0
    SOFT_MET = 1  # raise the condition, evict nothing
    HARD_MET = 2  # the manager asks the plugin for its top pods


class Operator(enum.StrEnum):
    UNSPECIFIED = ""
    LESS_THAN = "<"
    GREATER_THAN = ">"


@dataclass(frozen=True, slots=True)
class Condition:
    """A node condition a plugin keeps (only node conditions exist here)."""

    name: str
    met: bool


@dataclass(frozen=True, slots=True)
class ThresholdMet:
    met: MetType
    threshold: float = 0.0
    observed: float = 0.0
    operator: Operator = Operator.UNSPECIFIED
    # What the threshold is about: "memory", "numa:1", "tier:reclaimed" ...
    scope: str = ""
    condition: Condition | None = None
    # In-tree plugins only: the detector the values come from, and their unit.
    signal: str = ""
    unit: str = ""

    def describe(self) -> str:
        """``signal scope: observed op threshold``, for reasons and condition messages."""
        op = f" {self.operator.value} " if self.operator.value else " vs "
        unit = f" {self.unit}" if self.unit else ""
        where = " ".join(part for part in (self.signal, self.scope) if part) or "threshold"
        return f"{where}: {_num(self.observed)}{unit}{op}{_num(self.threshold)}{unit}"


NOT_MET = ThresholdMet(MetType.NOT_MET)


@dataclass(frozen=True, slots=True)
class ActivePod:
    """A running pod as offered to plugins: only what they need to choose among pods."""

    uid: str
    namespace: str
    name: str
    qos_level: str
    priority: int | None
    memory_request_bytes: int | None
    # Anonymous memory of the pod cgroup; None when unreadable.
    memory_usage_bytes: int | None
    # The pod's cgroup is not in the BestEffort tier, whose cap the memory guard holds: a pod
    # of another Kubernetes QoS class claiming reclaimed_cores, whose eviction frees nothing
    # of that tier's.
    outside_tier: bool = False

    @property
    def ref(self) -> str:
        return f"{self.namespace}/{self.name}"


@dataclass(frozen=True, slots=True)
class TopPods:
    """A hard-met plugin's choice: uids of active pods, most wanted first."""

    uids: tuple[str, ...]
    # None: the manager's default
    grace_s: int | None = None


@dataclass(frozen=True, slots=True)
class EvictRequest:
    uid: str
    reason: str
    grace_s: int | None = None
    # True: evict now (still rate-limited); False: a candidate the manager may choose among.
    force: bool = False


@dataclass(frozen=True, slots=True)
class EvictPods:
    pods: tuple[EvictRequest, ...] = ()
    condition: Condition | None = None


class EvictionPlugin(Protocol):
    """One source of eviction proposals."""

    @property
    def name(self) -> str: ...

    async def threshold_met(self) -> ThresholdMet: ...

    async def get_top_eviction_pods(self, active: Sequence[ActivePod], top_n: int,
                                    scope: str) -> TopPods: ...

    async def get_evict_pods(self, active: Sequence[ActivePod]) -> EvictPods: ...


def _num(value: float) -> str:
    return str(int(value)) if float(value).is_integer() else f"{value:.4g}"
