"""Which proposed pods may go, and in which order: the filter and the ranking, as pure functions.

The filter is the manager's, not the plugins': whatever a plugin proposes, a pod that must never
be evicted by this agent is refused here, with the reason audited.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol, TypeVar

from common.podmeta import CONFIG_SOURCE_ANNOTATION, OwnerRef
from hooks.levels import QosLevel
from reconciler.eviction.api import ActivePod
from reconciler.eviction.selector import Selector, parse_selector

MIRROR_ANNOTATION = "kubernetes.io/config.mirror"
"""Set by kubelet on the API's copy (mirror pod) of a static pod. The API server lets nobody add
it to a pod or change it, and kubelet does not run a pod that has it as a pod of its own."""
STATIC_SOURCES = frozenset({"file", "http"})
READ_ANNOTATIONS = frozenset({MIRROR_ANNOTATION, CONFIG_SOURCE_ANNOTATION})
"""The annotations the filter reads; they must be kept with the pod."""

# Lower ranks go first: offline pods before online ones.
LEVEL_RANK: Mapping[str, int] = {QosLevel.RECLAIMED_CORES: 0, QosLevel.SHARED_CORES: 1,
                                  QosLevel.DEDICATED_CORES: 2, QosLevel.SYSTEM_CORES: 3}


@dataclass(frozen=True, slots=True)
class PodFacts:
    """A pod as the manager sees it: what plugins get, and what only the filter needs."""

    pod: ActivePod
    labels: Mapping[str, str]
    annotations: Mapping[str, str]
    terminating: bool
    # Whether the pod watch has described the pod (owner and priority are known).
    described: bool
    # Being deleted with a grace period too long to spare it for (s); None otherwise. Such a
    # pod goes only where an eviction would end it sooner than its deletion does.
    lingering_s: int | None = None
    # The apps/v1 DaemonSet the pod names as its controller (its author's word).
    claimed_daemonset: OwnerRef | None = None
    # That DaemonSet exists, with the uid the pod names: True once the API showed it, False
    # when it does not (or none is named), None while unknown.
    daemonset: bool | None = False

    @property
    def static(self) -> bool:
        return MIRROR_ANNOTATION in self.annotations or \
            self.annotations.get(CONFIG_SOURCE_ANNOTATION) in STATIC_SOURCES


class FilterRules(Protocol):
    """What the filter applies of the eviction section (``EvictionConfig`` has it)."""

    @property
    def priority_threshold(self) -> int: ...

    @property
    def exclude_namespaces(self) -> tuple[str, ...]: ...

    @property
    def exclude_selectors(self) -> tuple[str, ...]: ...

    @property
    def exclude_selector_namespaces(self) -> tuple[str, ...]: ...


class PodFilter:
    """The refusals, in the order they are checked; the first that applies is the reason."""

    def __init__(self, cfg: FilterRules) -> None:
        self.cfg = cfg
        self._selectors: tuple[Selector, ...] = tuple(
            parse_selector(text) for text in cfg.exclude_selectors)

    def why_not(self, facts: PodFacts, *, need_description: bool) -> str | None:
        """Why the pod may not be evicted, or None. ``need_description``: with API access, a
        pod the watch has not described yet is refused (its owner and priority are unknown)."""
        pod = facts.pod
        if pod.qos_level == QosLevel.SYSTEM_CORES:
            return "system_cores pod"
        if facts.static:
            return "static or mirror pod"
        if facts.terminating:
            return "terminating"
        if need_description and not facts.described:
            return "not described by the API yet (owner and priority unknown)"
        if facts.claimed_daemonset is not None:
            if facts.daemonset is None:
                return "DaemonSet owner not confirmed by the API yet"
            if facts.daemonset:
                return "owned by a DaemonSet"
        if pod.priority is not None and pod.priority >= self.cfg.priority_threshold:
            return f"priority {pod.priority} >= {self.cfg.priority_threshold}"
        if pod.namespace in self.cfg.exclude_namespaces:
            return f"namespace {pod.namespace} excluded"
        # Labels are the pod author's: a selector spares only pods of the namespaces trusted
        # with it, or any pod could label itself out of eviction.
        if pod.namespace in self.cfg.exclude_selector_namespaces:
            for selector in self._selectors:
                if selector.matches(facts.labels):
                    return f"labels match excluded selector {selector.text!r}"
        return None


T = TypeVar("T")

_KEYS: Mapping[str, Callable[[ActivePod], int]] = {
    "qos_level": lambda pod: LEVEL_RANK.get(pod.qos_level, len(LEVEL_RANK)),
    # No priority class means priority 0, as the API server's default.
    "priority": lambda pod: pod.priority or 0,
    # Largest first; unknown usage ranks as none.
    "memory_usage": lambda pod: -(pod.memory_usage_bytes or 0),
}


def rank(items: Sequence[T], pod_of: Callable[[T], ActivePod], keys: Sequence[str]) -> list[T]:
    """``items`` ordered by ``keys`` (names of :data:`_KEYS`) in turn; ties keep their order."""
    fns = [_KEYS[key] for key in keys]
    return sorted(items, key=lambda item: tuple(fn(pod_of(item)) for fn in fns))
