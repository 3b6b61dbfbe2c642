"""Configuration of the mitigation ladder (``[mitigation]`` and one table per rung).

The ladder maps the worst level the chosen detectors report to actions, least harmful first;
each rung names the level from which it acts, can be switched off, and can run in dry-run
(decide and audit, write nothing). Reasons for the defaults: ``docs/detection.md``.
"""

from __future__ import annotations

from dataclasses import dataclass

from hooks.config_fields import section, setting
from reconciler.detection.config import (
    DETECTORS,
    KSWAPD,
    NUMA_FREE,
    PRESSURE_LEVEL,
    PSI,
    REFAULT,
    SYSTEM_FREE,
)
from reconciler.detection.signals import SETTING_LEVEL_NAMES

TAINT_EFFECTS = ("NoSchedule", "PreferNoSchedule", "NoExecute")


@dataclass(frozen=True, slots=True)
class TaintRung:
    enabled: bool = setting(True, "Forbid scheduling: taint the node and set its condition.")
    level: str = setting("low", "Level from which the node is tainted: the mildest action, "
                         "so from the first sign.", choices=SETTING_LEVEL_NAMES)
    dry_run: bool = setting(False, "Decide and audit only; no API call.")
    key: str = setting("nri-qos.io/memory-pressure", "Taint key.")
    value: str = setting("", "Taint value (may be empty).")
    effect: str = setting(
        "NoSchedule", "Taint effect. NoSchedule: new pods go elsewhere, running ones stay.",
        choices=TAINT_EFFECTS)
    condition: str = setting(
        "NriQosMemoryPressure", "Node condition kept True while the rung is engaged, False "
        "after (with reason and message).")


@dataclass(frozen=True, slots=True)
class TuneRung:
    enabled: bool = setting(True, "Tune memcg: squeeze the reclaimed tier through the memory "
                            "guard; memory.wmark_ratio of reclaimed pods where the kernel has it.")
    level: str = setting("low", "Level from which memcg is tuned: throttling offline "
                         "allocation costs offline work only.", choices=SETTING_LEVEL_NAMES)
    dry_run: bool = setting(False, "Decide and audit only; write nothing.")
    squeeze_bytes: int = setting(
        64 << 20, "How far below its usage the reclaimed tier is held (v1 limit, v2 "
        "memory.high) when the rung engages, and how much lower each repeat on fresh pressure "
        "takes it; in between the tier is held there (raised only to stay this far above its "
        "anonymous memory). 64 MiB: on a 2-core cgroup v1 VM holding offline 64 MiB below its "
        "usage ended the reclaim that reached online pods (online p99 14-28 ms -> 0.6-0.9 ms).",
        unit="bytes", minimum=1 << 20, maximum=1 << 40)
    repeat_s: float = setting(
        5.0, "While the level holds, squeeze a step further this often, but only when the "
        "latest sample itself still shows the pressure: a level held only by hysteresis (the "
        "signal already quiet) leaves the tier where it is. A squeeze renewed on every period "
        "regardless took an offline job that grew its memory by 40 MiB/s down to its limit "
        "30 s after the pressure had ended, and the kernel killed it (bench/colocation.py).",
        unit="seconds", minimum=0.5, maximum=3600)
    floor_bytes: int = setting(
        256 << 20, "Never squeeze the tier below this.", unit="bytes", minimum=0,
        maximum=1 << 50)
    throttle_anonymous: bool = setting(
        False, "cgroup v2: let the squeeze's memory.high go below the reclaimed tier's "
        "anonymous memory rather than rise with it, so that an offline job still growing while "
        "online pods stall is throttled where it is until the rung is released (the kernel "
        "throttles at memory.high and never OOM-kills there; without swap the squeeze can "
        "otherwise take only page cache). Off because of what it costs: the offline tier makes "
        "next to no progress while any online pod stalls (27-28 % of its unmanaged work in "
        "docs/effectiveness.md, held-anon). Ignored on cgroup v1, where the squeeze is a hard "
        "limit.")
    judge_s: float = setting(
        0.0, "0: the squeeze is not judged. Else, after it has held this long, compare what "
        "the online pod whose reading engaged it felt before (that reading: its PSI stall "
        "share on cgroup v2, its refault rate on cgroup v1) with the same over the squeeze "
        "(from its cumulative counters); not lower by min_relief_percent, the squeeze is "
        "released and not tried again for futile_hold_s while the rung stays engaged. A "
        "squeeze engaged by a reading that names no pod (node-wide, memcg events) is not "
        "judged. Off by default: on held-anon in a cgroup v2 guest, with 15 s (and the squeeze "
        "released as soon as the level fell) against without, in one run, the offline job "
        "did 78 % of its unmanaged work against 83 % and the service's p99 was 346.9 ms "
        "against 107.8, the intervals overlapping (docs/effectiveness.md, --seed 489); and a "
        "verdict compares with before the squeeze, not with no squeeze: a stall that falls by "
        "itself is taken for relief.",
        unit="seconds", minimum=0, maximum=3600)
    min_relief_percent: float = setting(
        25.0, "How much lower the pod's reading must be over the squeeze for it to be kept. "
        "The engaging reading is the one that crossed the threshold, so it errs high: a "
        "doubtful squeeze is kept.", unit="percent", minimum=0, maximum=100)
    futile_hold_s: float = setting(
        300.0, "How long a squeeze judged futile is not tried again while the rung stays "
        "engaged (what presses the pod is then not the tier's page cache, and may change).",
        unit="seconds", minimum=0, maximum=86_400)
    wmark_ratio: int = setting(
        80, "memory.wmark_ratio written on reclaimed pods where the kernel has it (veLinux, "
        "Anolis): background reclaim from 80 % of their limit (Koordinator's normal value is "
        "95); the previous value is restored on release.", unit="percent", minimum=1,
        maximum=100)


@dataclass(frozen=True, slots=True)
class DropCacheRung:
    enabled: bool = setting(True, "Drop the page cache of reclaimed_cores pods.")
    level: str = setting("medium", "Level from which caches are dropped: offline pods lose "
                         "cached data and re-read it later.", choices=SETTING_LEVEL_NAMES)
    dry_run: bool = setting(False, "Decide and audit only; write nothing.")
    timeout_s: float = setting(
        30.0, "A drop that takes longer is killed (the kernel stops reclaiming). Katalyst's "
        "timeout; measured on v1: 1 GiB of cache in 0.06-0.17 s.", unit="seconds", minimum=1,
        maximum=600)
    workers: int = setting(
        2, "Drops running at once (one per pod at most); read at start.", minimum=1,
        maximum=32)
    min_cache_bytes: int = setting(
        16 << 20, "Pods with less page cache are left alone: too little to matter.",
        unit="bytes", minimum=0, maximum=1 << 50)
    max_pods: int = setting(
        8, "Pods dropped per round, largest cache first.", minimum=1, maximum=1000)
    reclaim_bytes: int = setting(
        1 << 30, "cgroup v2: at most this much asked of memory.reclaim per pod (the pod's "
        "page cache if smaller). v1 memory.force_empty takes no amount: all of it.",
        unit="bytes", minimum=1 << 20, maximum=1 << 50)
    repeat_s: float = setting(
        30.0, "While the level holds, drop again this often (caches refill).",
        unit="seconds", minimum=1, maximum=3600)


@dataclass(frozen=True, slots=True)
class EvictRung:
    enabled: bool = setting(True, "Ask the eviction manager for a round.")
    level: str = setting("high", "Level from which eviction is asked for.",
                         choices=SETTING_LEVEL_NAMES)
    dry_run: bool = setting(
        True, "Decide and audit only. On by default: evicting is the one action that ends "
        "work; turn it on after the audit trail showed what it would do.")
    repeat_s: float = setting(
        5.0, "While the level holds, ask again this often (the manager rate-limits).",
        unit="seconds", minimum=0.5, maximum=3600)


@dataclass(frozen=True, slots=True)
class MitigationConfig:
    enabled: bool = setting(True, "Act on detected interference through the rungs below.")
    detectors: tuple[str, ...] = setting(
        (SYSTEM_FREE, NUMA_FREE, PSI, PRESSURE_LEVEL, KSWAPD, REFAULT),
        "Detectors whose worst level drives the ladder. rss_overuse (one pod's overuse) and "
        "fulfillment (the reclaimed tier's own shortage) are not node pressure: the eviction "
        "manager reads them.", choices=DETECTORS)
    node_signals: str = setting(
        "auto", "Whether readings that do not say which pods feel the pressure drive the "
        "ladder: the node-wide detectors (the node's PSI, system_free, numa_free, kswapd; with "
        "them counting, the eviction manager's system_pressure and numa_pressure plugins are "
        "met on their own, else they take the lower of their level and what online pods "
        "feel) and cgroup v1's memcg pressure events. on: all of them. auto: each only where "
        "nothing finer drives: the memcg pressure events where no online pod's own reading "
        "runs (its PSI on cgroup v2, its working-set refaults on cgroup v1), the node-wide "
        "ones where the memcg events do not run either. off: never the node-wide ones, the "
        "memcg events as with auto. "
        "The coarser readings also count the offline tier's own reclaim at its cap and "
        "squeeze, and free memory that page cache took, as on any busy node. Measured on a "
        "cgroup v1 VM, an offline job reclaiming at its squeezed limit stalled 70-90 ms/s "
        "(node PSI 'some' up to 45 % in 100 ms samples) while the online pods were untouched; "
        "on a cgroup v2 node of 4 GiB, numa_free or the node's PSI engaged the ladder in every "
        "repetition while the online pod never stalled on memory, and its p99 was worse than "
        "with no agent; on the v1 VM, kubepods' memcg pressure events engaged the ladder in "
        "every repetition while its reclaim took the offline job's pages, and the squeeze that "
        "followed cost the key-value service 2.6 times its tail and the offline job 23 % of "
        "its work (bench/colocation.py, docs/effectiveness.md). They are still read, reported "
        "and given to the eviction manager; the memcg events still wake the detectors.",
        choices=("auto", "on", "off"))
    cooldown_s: float = setting(
        60.0, "A rung is undone after the level stayed below it this long, so pressure that "
        "comes back within a minute does not toggle the node. kubelet and Katalyst hold "
        "conditions 5 min; these actions are milder and detection is faster.",
        unit="seconds", minimum=0, maximum=86_400)
    retry_initial_s: float = setting(
        1.0, "A step that failed (the API refused a taint's removal, a write timed out) is "
        "tried again after this long, doubling per failure: releases until they succeed, "
        "engages while the level holds.", unit="seconds", minimum=0.1, maximum=3600)
    retry_max_s: float = setting(
        60.0, "Cap of that wait.", unit="seconds", minimum=0.1, maximum=3600)
    taint: TaintRung = section(TaintRung, "Forbid scheduling (node taint and condition).")
    tune: TuneRung = section(TuneRung, "Tune memcg.")
    drop_cache: DropCacheRung = section(DropCacheRung, "Drop cache of reclaimed pods.")
    evict: EvictRung = section(EvictRung, "Eviction through the eviction manager.")

    def validate(self) -> list[tuple[str, str]]:
        if self.retry_max_s < self.retry_initial_s:
            return [("retry_max_s", "must be >= retry_initial_s")]
        return []
