"""Configuration of memory interference detection (``[detection]``).

Every threshold, window and factor, with the reason for its default; ``docs/detection.md`` has
the formulas and where each default comes from.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

from hooks.config_fields import setting

SYSTEM_FREE = "system_free"
NUMA_FREE = "numa_free"
PSI = "psi"
PRESSURE_LEVEL = "pressure_level"
KSWAPD = "kswapd"
RSS_OVERUSE = "rss_overuse"
FULFILLMENT = "fulfillment"
REFAULT = "refault"
DETECTORS = (SYSTEM_FREE, NUMA_FREE, PSI, PRESSURE_LEVEL, KSWAPD, REFAULT, RSS_OVERUSE,
             FULFILLMENT)
"""Every detector's name, as it appears on the readings board and in the audit trail."""
MIN_RSS_OVERUSE_FACTOR = 0.1
"""The smallest RSS overuse factor, the node's or a pod's own (a pod flagged at a tenth of its
request could only mean a mistake)."""


def _ordered(values: tuple[tuple[str, float], ...], *, rising: bool) -> list[tuple[str, str]]:
    """Problems of thresholds that must grow (``rising``) or fall from level low to high; 0 means
    a level is unused (rising thresholds only)."""
    used = [(name, v) for name, v in values if v > 0 or not rising]
    word = "above" if rising else "below"
    return [(later, f"must be {word} {earlier} ({a:g}), got {b:g}")
            for (earlier, a), (later, b) in itertools.pairwise(used)
            if (b <= a if rising else b >= a)]


@dataclass(frozen=True, slots=True)
class DetectionConfig:
    enabled: bool = setting(
        True, "Detect memory interference. On by default: detection only reads kernel files.")
    disabled: tuple[str, ...] = setting(
        (), "Detectors that do not run (all run by default).", choices=DETECTORS)
    interval_s: float = setting(
        1.0, "Period of the detectors that read files (free memory, NUMA, kswapd, RSS, "
        "fulfillment, per-pod PSI or refaults) while memory is short (else "
        "quiet_interval_s). 1 s: with entry_samples = 2 a level is entered within 2 s (PSI "
        "and pressure events have their own faster paths).",
        unit="seconds", minimum=0.1, maximum=3600)
    quiet_interval_s: float = setting(
        5.0, "Period of the same detectors while no free-memory, PSI, memcg pressure, kswapd or "
        "refault reading is at a level or entering one (never shorter than interval_s): a "
        "calm node's files, every pod's among them, are not read every second. The node-wide "
        "ones (free memory, kswapd, the node's PSI) count here only where the ladder counts "
        "them (mitigation.node_signals) or some online pod has no PSI trigger of its own "
        "(cgroup v1; a kernel refusing one): a node whose page cache fills it keeps them at a "
        "level for hours. An online pod's trigger, a level entered on the node's PSI or a "
        "memcg pressure event wakes them at once; free memory "
        "that falls under its watermark without a stall is seen within this plus interval_s "
        "x (entry_samples - 1). Also the period of cgroup v1's memcg pressure events' quiet "
        "samples and registrations while none of them holds a level (an event comes at once "
        "all the same). 5 s: Katalyst's memory advisor and eviction manager look every 5 s.",
        unit="seconds", minimum=0.1, maximum=3600)
    entry_samples: int = setting(
        2, "Consecutive samples at or above a level before the level is entered (a PSI trigger "
        "or a kernel pressure event enters at once). 2: one odd sample never acts.",
        minimum=1, maximum=100)
    exit_cooldown_s: float = setting(
        10.0, "A level is left only after the signal stayed below it this long, so a flapping "
        "signal holds its level instead of flapping.", unit="seconds", minimum=0, maximum=3600)

    # -- free memory against the watermark (system_free, numa_free) ---------------------------
    free_floor_bytes: int = setting(
        1 << 30, "Lowest watermark W per NUMA node (the system's is this times the node "
        "count). Katalyst's advisor uses 4 GiB; 1 GiB because the memory guard already keeps "
        "its 4 GiB reserve free of offline memory, and small nodes would sit under 4 GiB. "
        "At most free_floor_percent of the node's memory.",
        unit="bytes", minimum=0, maximum=1 << 50)
    free_floor_percent: float = setting(
        10.0, "The floor is at most this share of the memory it is compared with (the NUMA "
        "node's, or the machine's for system_free): on a node of 4 GiB, 1 GiB per NUMA node "
        "put the idle node under 2 x W and kept the ladder engaged. The 1 GiB applies from "
        "10 GiB per NUMA node up.", unit="percent", minimum=0, maximum=100)
    free_wsf_factor: float = setting(
        2.0, "W is at least total x vm.watermark_scale_factor / 10000 x this (Katalyst's "
        "critical watermark uses 2).", minimum=0, maximum=1000)
    free_zone_low_factor: float = setting(
        1.0, "W is at least the sum of the zones' low watermarks (/proc/zoneinfo) x this: "
        "below the low watermark kswapd is already reclaiming.", minimum=0, maximum=1000)
    free_low_margin: float = setting(
        2.0, "Level low when free < W x this (Katalyst tunes memcg below 2 x critical).",
        minimum=1, maximum=100)
    free_high_fraction: float = setting(
        0.5, "Level high when free < W x this (Katalyst evicts at half its critical "
        "watermark); medium is free < W (Katalyst drops cache there).",
        minimum=0, maximum=1)

    # -- PSI ---------------------------------------------------------------------------------------
    psi_poll_interval_ms: int = setting(
        100, "Period of the stall-counter poll of /proc/pressure/memory when no fast trigger "
        "can be armed, and of its reads while it holds a level (the rate comes from the "
        "cumulative total= counter, never avg10). Where the node's PSI paces detection only: "
        "where the ladder counts it or some online pod has no trigger of its own (else "
        "interval_s, see quiet_interval_s). "
        "100 ms: one 100-byte read, and a level entered within entry_samples x 100 ms.",
        unit="milliseconds", minimum=10, maximum=10_000)
    psi_some_low_percent: float = setting(
        10.0, "Level low when some task stalled on memory for this share of the time. "
        "Katalyst uses 15 on avg10 (a 10 s average); a 100 ms rate is noisier, hence lower "
        "with two samples required.", unit="percent", minimum=0.1, maximum=100)
    psi_some_medium_percent: float = setting(
        30.0, "Level medium at this 'some' stall share.", unit="percent", minimum=0.1,
        maximum=100)
    psi_full_high_percent: float = setting(
        50.0, "Level high when all non-idle tasks stalled together for this share of the "
        "time ('full'), as systemd-oomd's 60 % that kills.", unit="percent", minimum=0.1,
        maximum=100)
    psi_trigger_window_ms: int = setting(
        500, "Window of the PSI trigger armed on /proc/pressure/memory (threshold: the low "
        "share of it). Used only when the kernel accepts a window this short (500 ms: the "
        "shortest it takes); else the stall counter is polled. Without CAP_SYS_RESOURCE "
        "kernels accept only multiples of 2 s, averaged every 2 s: too slow.",
        unit="milliseconds", minimum=500, maximum=10_000)

    # -- cgroup v1 memory.pressure_level --------------------------------------------------------
    pressure_level_mode: str = setting(
        "local", "Which reclaim a cgroup's notification counts: local (reclaim aimed at that "
        "cgroup: the node for the root memcg, a tier's own limit) or hierarchy (also its "
        "children's own limits, which are theirs to bear).", choices=("local", "hierarchy"))

    # -- kswapd ------------------------------------------------------------------------------------
    kswapd_window_s: float = setting(
        10.0, "Window of the kswapd reclaim rate (pgsteal_kswapd per second).",
        unit="seconds", minimum=1, maximum=3600)
    kswapd_low_pages_per_s: float = setting(
        2000.0, "Level low at this kswapd reclaim rate (Katalyst's threshold).",
        unit="pages/s", minimum=0, maximum=1e9)
    kswapd_medium_pages_per_s: float = setting(
        20000.0, "Level medium at this rate (about 80 MB/s with 4 KiB pages).",
        unit="pages/s", minimum=0, maximum=1e9)
    kswapd_high_pages_per_s: float = setting(
        0.0, "Level high at this rate; 0: never (background reclaim alone does not justify "
        "eviction).", unit="pages/s", minimum=0, maximum=1e9)

    # -- online pods' working-set refaults (cgroup v1) ---------------------------------------------
    refault_window_s: float = setting(
        10.0, "Window of an online pod's refault rate: a pod that reads a file again in a burst "
        "is not taken for one losing its working set steadily.",
        unit="seconds", minimum=1, maximum=3600)
    refault_low_pages_per_s: float = setting(
        512.0, "Level low when an online pod reads this many pages of its working set again "
        "per second after reclaim took them (2 MiB/s with 4 KiB pages). Read only where a pod "
        "has no PSI of its own (cgroup v1). Measured on a cgroup v1 VM (bench/colocation.py, "
        "docs/detection.md): 6-26 pages/s with no agent; 104-112 beside an agent that pressed "
        "the online pod a little (its probe's p99 1.2-1.3 times unmanaged's), where squeezing "
        "the offline tier cost more than it spared; 723-1,260 where the probe's p99 was 2.6-4 "
        "times unmanaged's.",
        unit="pages/s", minimum=0, maximum=1e9)
    refault_medium_pages_per_s: float = setting(
        5120.0, "Level medium at this rate (20 MiB/s).", unit="pages/s", minimum=0,
        maximum=1e9)
    refault_high_pages_per_s: float = setting(
        51200.0, "Level high at this rate (200 MiB/s: the pod's working set no longer stays "
        "in memory); 0: never.", unit="pages/s", minimum=0, maximum=1e9)

    # -- RSS overuse -----------------------------------------------------------------------------
    rss_overuse_factor: float = setting(
        1.05, "A shared_cores or reclaimed_cores pod whose anonymous memory exceeds its "
        "memory request x this is high (Katalyst's factor); above its request, low.",
        minimum=MIN_RSS_OVERUSE_FACTOR, maximum=100)
    rss_overuse_annotation: str = setting(
        "nri-qos.io/rss-overuse-factor", "Pod annotation with a factor of its own; it may "
        "only be stricter (lower) than rss_overuse_factor.")

    # -- reclaimed-tier fulfillment ----------------------------------------------------------------
    fulfillment_low_ratio: float = setting(
        1.0, "Level low when the memory guard's cap on the reclaimed tier is below this share "
        "of the reclaimed pods' requests: they no longer get what they asked for.",
        minimum=0, maximum=10)
    fulfillment_medium_ratio: float = setting(
        0.8, "Level medium below this share.", minimum=0, maximum=10)
    fulfillment_high_ratio: float = setting(
        0.5, "Level high below this share: half the requests cannot be met.",
        minimum=0, maximum=10)

    def validate(self) -> list[tuple[str, str]]:
        return (
            _ordered((("psi_some_low_percent", self.psi_some_low_percent),
                      ("psi_some_medium_percent", self.psi_some_medium_percent)), rising=True)
            + _ordered((("kswapd_low_pages_per_s", self.kswapd_low_pages_per_s),
                        ("kswapd_medium_pages_per_s", self.kswapd_medium_pages_per_s),
                        ("kswapd_high_pages_per_s", self.kswapd_high_pages_per_s)), rising=True)
            + _ordered((("refault_low_pages_per_s", self.refault_low_pages_per_s),
                        ("refault_medium_pages_per_s", self.refault_medium_pages_per_s),
                        ("refault_high_pages_per_s", self.refault_high_pages_per_s)),
                       rising=True)
            + _ordered((("fulfillment_low_ratio", self.fulfillment_low_ratio),
                        ("fulfillment_medium_ratio", self.fulfillment_medium_ratio),
                        ("fulfillment_high_ratio", self.fulfillment_high_ratio)), rising=False)
        )
