"""Configuration of the eviction manager (``[eviction]``); docs/eviction.md explains each choice."""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass

from hooks.config_fields import setting
from hooks.levels import QosLevel
from reconciler.detection.signals import SETTING_LEVEL_NAMES
from reconciler.eviction.api import PLUGIN_NAME
from reconciler.eviction.selector import check_selectors
from reconciler.kube import MIN_GRACE_S

SYSTEM_CLUSTER_CRITICAL = 2_000_000_000
SYSTEM_NODE_CRITICAL = 2_000_001_000
"""The priorities of Kubernetes' two built-in priority classes."""

IN_TREE_PLUGINS = ("system_pressure", "numa_pressure", "rss_overuse", "reclaimed_pressure")
SORT_KEYS = ("qos_level", "priority", "memory_usage")
EVICTABLE_LEVELS: tuple[str, ...] = (QosLevel.RECLAIMED_CORES, QosLevel.SHARED_CORES,
                                     QosLevel.DEDICATED_CORES)

_NAMESPACE = re.compile(r"[a-z0-9](?:[a-z0-9-]{0,61}[a-z0-9])?")


def _names(pattern: re.Pattern[str], what: str) -> Callable[[object], str | None]:
    def check(value: object) -> str | None:
        items = value if isinstance(value, tuple) else (value,)
        bad = [v for v in items if not (isinstance(v, str) and pattern.fullmatch(v))]
        return f"not a {what}: {bad[0]!r}" if bad else None

    return check


_namespaces = _names(_NAMESPACE, "namespace name")
_plugin_names = _names(PLUGIN_NAME, "plugin name")


def _no_immediate_deletion(value: object) -> str | None:
    if value == 0:
        return (f"0 would delete the pod at once, skipping its graceful shutdown: use "
                f"{MIN_GRACE_S} or more, or -1 for the pod's own")
    return None


def grace_of(seconds: int) -> int | None:
    """A grace-period setting as an eviction asks for it: a negative one (-1) means the pod's
    own terminationGracePeriodSeconds, which is None."""
    return None if seconds < 0 else seconds


def _distinct(value: object) -> str | None:
    items = value if isinstance(value, tuple) else (value,)
    return "each key at most once" if len(set(items)) != len(items) else None


@dataclass(frozen=True, slots=True)
class EvictionConfig:
    enabled: bool = setting(
        True, "Run the eviction manager (it only decides and audits while dry_run is true).")
    dry_run: bool = setting(
        True, "Decide and audit, but write nothing to the API: no eviction, no Event, no node "
        "condition. On by default so that a new node shows what it would do first.")
    dry_run_plugins: tuple[str, ...] = setting(
        (), "Plugins (in-tree or out-of-tree, by name) kept in dry-run when dry_run is false.",
        check=_plugin_names)
    interval_s: float = setting(
        1.0, "Period of an eviction round; the ladder's evict rung also asks for one at once.",
        unit="seconds", minimum=0.1, maximum=60)
    quiet_interval_s: float = setting(
        10.0, "Period of rounds while the last one was quiet: only in-tree plugins, none met "
        "or proposing a pod, no node condition true, no refused eviction waiting to be tried "
        "again. A change of a detector's level, or the ladder's evict rung, still runs a "
        "round at once.", unit="seconds", minimum=0.1, maximum=600)
    call_timeout_s: float = setting(
        0.5, "Deadline of one call to a plugin; a plugin that misses it is skipped that round.",
        unit="seconds", minimum=0.01, maximum=30)
    plugin_dir: str = setting(
        "/var/lib/nri-qos/eviction-plugins",
        "Directory of out-of-tree plugins' unix sockets (<name>.sock), rescanned every round.")
    plugins: tuple[str, ...] = setting(
        IN_TREE_PLUGINS, "In-tree plugins that run.", choices=IN_TREE_PLUGINS)
    met_rounds: int = setting(
        2, "Consecutive rounds a plugin must report its threshold hard-met before the manager "
        "asks it for pods (one spike does not evict).", minimum=1, maximum=600)
    condition_transition_s: float = setting(
        300.0, "A node condition that was met stays true until it has not been met for this "
        "long (kubelet's eviction-pressure-transition-period and Katalyst's default).",
        unit="seconds", minimum=0, maximum=86_400)
    top_n: int = setting(
        1, "Pods asked from a hard-met plugin per round.", minimum=1, maximum=100)
    soft_per_round: int = setting(
        1, "Soft candidates (not forced) evicted per round at most, best ranked first.",
        minimum=0, maximum=100)
    rate_burst: int = setting(
        3, "Token bucket shared by all plugins: evictions possible at once (Katalyst's "
        "EvictionBurst).", minimum=1, maximum=100)
    rate_interval_s: float = setting(
        10.0, "Token bucket refill: one eviction token per this interval.", unit="seconds",
        minimum=0.1, maximum=86_400)
    priority_threshold: int = setting(
        SYSTEM_CLUSTER_CRITICAL, "Pods at or above this priority are never evicted "
        "(default: system-cluster-critical, 2000000000, and so system-node-critical, "
        "2000001000).", minimum=-2_147_483_648, maximum=2_147_483_647)
    exclude_namespaces: tuple[str, ...] = setting(
        ("kube-system",), "Namespaces whose pods are never evicted.", check=_namespaces)
    exclude_selectors: tuple[str, ...] = setting(
        (), "Label selectors (kubectl -l syntax); a pod of exclude_selector_namespaces matching "
        "any of them is never evicted.", check=check_selectors)
    exclude_selector_namespaces: tuple[str, ...] = setting(
        (), "Namespaces whose pods exclude_selectors spare (needed when selectors are set): a "
        "pod's labels are its author's, so a selector spares only pods of namespaces whose "
        "authors are trusted to choose that.", check=_namespaces)
    sort_keys: tuple[str, ...] = setting(
        SORT_KEYS, "Order of the ranking keys: qos_level (reclaimed_cores first), priority "
        "(lowest first), memory_usage (largest first); ties keep the plugins' order.",
        choices=SORT_KEYS, check=_distinct)
    grace_period_s: int = setting(
        -1, "Grace period of an eviction whose plugin names none; -1: the pod's own "
        "terminationGracePeriodSeconds; 0 (immediate deletion) is refused.", unit="seconds",
        minimum=-1, maximum=86_400, check=_no_immediate_deletion)
    reclaimed_grace_period_s: int = setting(
        1, "Grace period the in-tree plugins ask for reclaimed_cores pods (Katalyst's "
        "default); -1: the pod's own; 0 is refused.", unit="seconds", minimum=-1,
        maximum=86_400, check=_no_immediate_deletion)
    retry_initial_s: float = setting(
        5.0, "First wait before a pod whose eviction was refused (429 from a disruption "
        "budget) or failed is tried again; doubles per failure.", unit="seconds",
        minimum=0.1, maximum=3600)
    retry_max_s: float = setting(
        120.0, "Cap of that wait.", unit="seconds", minimum=0.1, maximum=86_400)
    reevict_after_s: float = setting(
        300.0, "A pod whose eviction was accepted (or dry-run) is not asked again for this "
        "long while it is still on the node.", unit="seconds", minimum=1, maximum=86_400)
    hard_level: str = setting(
        "high", "Detector level at which an in-tree pressure plugin's threshold is hard-met.",
        choices=SETTING_LEVEL_NAMES)
    soft_level: str = setting(
        "medium", "Detector level at which it is soft-met (condition only).",
        choices=SETTING_LEVEL_NAMES)
    system_detectors: tuple[str, ...] = setting(
        ("system_free", "psi", "kswapd"), "Node-wide detectors the system_pressure plugin "
        "reads.", check=_plugin_names)
    pressure_levels: tuple[str, ...] = setting(
        ("reclaimed_cores",), "QoS levels the pressure plugins (system, NUMA, reclaimed tier) "
        "pick their top pods from.", choices=EVICTABLE_LEVELS)
    rss_overuse_levels: tuple[str, ...] = setting(
        ("reclaimed_cores",), "QoS levels the rss_overuse plugin proposes (Katalyst also "
        "includes shared_cores).", choices=EVICTABLE_LEVELS)

    def validate(self) -> list[tuple[str, str]]:
        problems = []
        if self.retry_max_s < self.retry_initial_s:
            problems.append(("retry_max_s", "must be >= retry_initial_s"))
        if self.exclude_selectors and not self.exclude_selector_namespaces:
            problems.append(("exclude_selectors", "needs exclude_selector_namespaces: labels "
                             "are the pod author's, so name the namespaces whose pods a "
                             "selector may spare"))
        if SETTING_LEVEL_NAMES.index(self.soft_level) > SETTING_LEVEL_NAMES.index(self.hard_level):
            problems.append(("soft_level", "must not be above hard_level"))
        return problems
