"""Configuration of the background half: reconciler loops, memory guard, NUMA binding and beyond."""

from __future__ import annotations

from dataclasses import dataclass

from nri_plugin.config.fields import setting


@dataclass(frozen=True, slots=True)
class ReconcilerConfig:
    enabled: bool = setting(True, "Run the background reconciler next to the NRI stub.")
    root: str = setting(
        "/", "Directory under which /sys and /proc are found (for running in a container)."
    )
    cgroup_driver: str = setting(
        "auto", "cgroup driver of kubelet/containerd; auto infers it from cgroup paths.",
        choices=("auto", "cgroupfs", "systemd"),
    )
    resctrl_interval_s: float = setting(
        1.0, "Period of the resctrl task-id loop.", unit="seconds", minimum=0.05, maximum=3600
    )
    drift_interval_s: float = setting(
        10.0, "Period of the drift-repair loop.", unit="seconds", minimum=0.1, maximum=3600
    )
    gc_grace_s: float = setting(
        60.0, "Age a resctrl group of a vanished pod must reach before it is removed.",
        unit="seconds", minimum=0, maximum=86_400,
    )
    write_retries: int = setting(
        3, "Attempts for a write that fails with EBUSY/EINVAL before it is audited as failed.",
        minimum=1, maximum=20,
    )
    full_scan_every: int = setting(
        10, "The task-id loop reads every managed container's thread list once per this many "
        "cycles; in between it examines only tasks that newly appeared outside their group.",
        minimum=1, maximum=3600,
    )
    backoff_max_s: float = setting(
        60.0, "Cap of the backoff of a loop that keeps failing.", unit="seconds",
        minimum=0.1, maximum=3600,
    )


@dataclass(frozen=True, slots=True)
class MemoryGuardConfig:
    enabled: bool = setting(True, "Cap the memory of the reclaimed (BestEffort) tier.")
    interval_s: float = setting(5.0, "Period of the guard loop.", unit="seconds",
                                minimum=0.1, maximum=3600)
    watermark_floor_bytes: int = setting(
        4 << 30, "Lowest per-NUMA-node watermark kept free for online pods.", unit="bytes",
        minimum=0, maximum=1 << 50,
    )
    watermark_scale_factor: float = setting(
        1.0, "Multiplier of the kernel low watermark.", minimum=0.0, maximum=100.0
    )
    max_step_bytes: int = setting(
        1 << 30, "Largest decrease of the cap in one cycle (no OOM cliff).", unit="bytes",
        minimum=1 << 20, maximum=1 << 50,
    )
    high_ratio: float = setting(
        0.95, "cgroup v2: memory.high = high_ratio x memory.max.", minimum=0.5, maximum=1.0
    )


@dataclass(frozen=True, slots=True)
class NumaConfig:
    enabled: bool = setting(True, "Bind reclaimed pods to the NUMA nodes with most headroom.")
    interval_s: float = setting(10.0, "Period of the binding loop.", unit="seconds",
                                minimum=0.1, maximum=3600)
    migrate_memory: bool = setting(
        True, "cgroup v1: set cpuset.memory_migrate so pages follow a new binding."
    )
    max_nodes: int = setting(
        0, "Bind reclaimed pods to at most this many NUMA nodes, those with most headroom "
        "(0: every node with free memory above its watermark).", minimum=0, maximum=1024,
    )


@dataclass(frozen=True, slots=True)
class DetectionConfig:
    enabled: bool = setting(False, "Detect memory interference (free vs watermark, PSI).")
    interval_s: float = setting(5.0, "Period of the detectors.", unit="seconds",
                                minimum=0.1, maximum=3600)
    psi_some_avg10: float = setting(
        15.0, "PSI memory some avg10 at or above which the node is under pressure.",
        unit="percent", minimum=0, maximum=100,
    )


@dataclass(frozen=True, slots=True)
class MitigationConfig:
    enabled: bool = setting(False, "Act on detected interference (taint, drop cache).")
    drop_cache_timeout_s: float = setting(
        30.0, "Deadline of one drop-cache action.", unit="seconds", minimum=1, maximum=600
    )
    taint_key: str = setting(
        "nri-qos.io/memory-pressure", "Taint put on the node to stop scheduling offline pods."
    )


@dataclass(frozen=True, slots=True)
class EvictionConfig:
    enabled: bool = setting(False, "Evict reclaimed pods through the Eviction API.")
    dry_run: bool = setting(True, "Decide and audit evictions without calling the API.")
    max_per_minute: int = setting(3, "Rate limit of evictions.", minimum=1, maximum=1000)
