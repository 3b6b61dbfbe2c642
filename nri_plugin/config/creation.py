"""Configuration of the creation-time capabilities: resctrl, memory QoS, oom score, OCI hooks."""

from __future__ import annotations

import os
import re
import stat
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from hooks.levels import LEVEL_NAMES
from nri_plugin.config.fields import frozen_map, percent, section, setting


def _group_prefix(value: Any) -> str | None:
    if not re.fullmatch(r"[A-Za-z0-9_-]{1,32}", value):
        return f"must match [A-Za-z0-9_-]{{1,32}}, got {value!r}"
    return None


@dataclass(frozen=True, slots=True)
class CacheOverride:
    l3_start_percent: int = percent(0, "First way of the L3 range.")
    l3_end_percent: int = percent(100, "End of the L3 range.")
    mb_percent: int = percent(100, "Memory bandwidth.")

    def validate(self) -> list[tuple[str, str]]:
        if self.l3_end_percent <= self.l3_start_percent:
            return [("l3_end_percent", "must be greater than l3_start_percent")]
        return []


@dataclass(frozen=True, slots=True)
class ResctrlLevel:
    enabled: bool = setting(True, "Create this level's class group and put its containers in it.")
    l3_start_percent: int = percent(0, "Start of the L3 way range.")
    l3_end_percent: int = percent(100, "End of the L3 way range.")
    mb_percent: int = percent(100, "Memory bandwidth limit.")
    per_cache: Mapping[str, CacheOverride] = setting(
        {}, "Overrides per L3/MB cache id (table keys are cache ids)."
    )

    def validate(self) -> list[tuple[str, str]]:
        problems: list[tuple[str, str]] = []
        if self.l3_end_percent <= self.l3_start_percent:
            problems.append(("l3_end_percent", "must be greater than l3_start_percent"))
        problems += [(f"per_cache.{k}", "cache id must be a decimal number")
                     for k in self.per_cache if not k.isdigit()]
        return problems


@dataclass(frozen=True, slots=True)
class MonitorHookConfig:
    enabled: bool = setting(
        False,
        "Inject a prestart OCI hook that puts each container's pid into its pod's monitor group.",
    )
    path: str = setting("/usr/local/bin/nri-qos-hook", "Absolute path of the hook executable.")
    timeout_s: int = setting(5, "OCI hook timeout.", unit="seconds", minimum=1, maximum=60)
    strict: bool = setting(False, "Make the hook fail (and so the container) on any error.")

    def validate(self) -> list[tuple[str, str]]:
        if not self.enabled:
            return []
        problem = check_hook_path(self.path)
        return [("path", problem)] if problem else []


@dataclass(frozen=True, slots=True)
class ResctrlConfig:
    enabled: bool = setting(True, "Use resctrl when it is mounted; off silently when it is not.")
    root: str = setting("/sys/fs/resctrl", "Mount point of the resctrl filesystem.")
    group_prefix: str = setting(
        "nriqos-", "Prefix of every resctrl group this plugin creates.", check=_group_prefix
    )
    clos_field: str = setting(
        "auto",
        "Adjustment field carrying the CLOS: rdt_class (containerd 1.7+), clos_id (NRI 0.11+), "
        "or auto (chosen from the runtime's NRI version).",
        choices=("auto", "rdt_class", "clos_id"),
    )
    pod_groups: bool = setting(
        True, "Honour pod-level resctrl annotations by creating a group per pod."
    )
    annotation: str = setting(
        "qos.nri-qos.io/resctrl",
        "Pod annotation with a pod-level L3/MB request (JSON, same shape as Koordinator's).",
    )
    koordinator_annotation: bool = setting(
        True, "Also honour Koordinator's node.koordinator.sh/resctrl pod annotation."
    )
    pod_l3_max_percent: int = percent(100, "Largest L3 share a pod annotation may ask for.")
    pod_mb_max_percent: int = percent(100, "Largest memory bandwidth a pod annotation may ask for.")
    amd_mb_max: int = setting(
        2048, "AMD memory bandwidth value meaning 100 % (AMD MB is absolute, in 1/8 GB/s units).",
        minimum=1, maximum=1 << 20,
    )
    levels: Mapping[str, ResctrlLevel] = setting(
        frozen_map({
            "dedicated_cores": ResctrlLevel(),
            "shared_cores": ResctrlLevel(),
            "reclaimed_cores": ResctrlLevel(l3_start_percent=0, l3_end_percent=30),
            "system_cores": ResctrlLevel(),
        }),
        "Class group per QoS level.",
        keys=LEVEL_NAMES,
    )
    monitor_hook: MonitorHookConfig = section(MonitorHookConfig, "Monitoring prestart hook.")


@dataclass(frozen=True, slots=True)
class MemoryLevel:
    policy: str = setting(
        "none",
        "none; ratios (Volcano: min/low from the request, high from the limit); "
        "kubernetes (the MemoryQoS formula with throttling_factor).",
        choices=("none", "ratios", "kubernetes"),
    )
    min_ratio: int = percent(0, "memory.min = request x min_ratio %.")
    low_ratio: int = percent(0, "memory.low = request x low_ratio %.")
    high_ratio: int = percent(100, "memory.high = limit x high_ratio % (policy ratios).")
    throttling_factor: float = setting(
        0.9, "Factor of the Kubernetes MemoryQoS formula (policy kubernetes).",
        minimum=0.0, maximum=1.0,
    )
    no_limit: str = setting(
        "allocatable",
        "For containers without a memory limit: use node allocatable memory, or skip memory.high.",
        choices=("allocatable", "skip"),
    )
    annotation_max_min_ratio: int = percent(
        100, "Largest minRatio a volcano.sh/colocation-config annotation may ask for."
    )
    annotation_max_low_ratio: int = percent(
        100, "Largest lowRatio a volcano.sh/colocation-config annotation may ask for."
    )
    v1_reservation: bool = setting(
        False,
        "On cgroup v1, set the memory reservation (soft limit) to the computed memory.low.",
    )


@dataclass(frozen=True, slots=True)
class MemoryConfig:
    enabled: bool = setting(True, "Set memcg QoS values at container creation.")
    cgroup_version: str = setting(
        "auto", "cgroup version of the host; auto detects it.", choices=("auto", "v1", "v2")
    )
    page_size: int = setting(4096, "Page size used to round memory.high.", unit="bytes",
                             minimum=4096, maximum=1 << 30)
    node_allocatable_bytes: int = setting(
        0, "Node allocatable memory; 0 means MemTotal from /proc/meminfo.", unit="bytes",
        minimum=0, maximum=1 << 60,
    )
    volcano_annotation: bool = setting(
        True, "Honour the volcano.sh/colocation-config pod annotation."
    )
    levels: Mapping[str, MemoryLevel] = setting(
        frozen_map({
            "dedicated_cores": MemoryLevel(),
            "shared_cores": MemoryLevel(),
            "reclaimed_cores": MemoryLevel(
                policy="ratios", high_ratio=95,
                annotation_max_min_ratio=0, annotation_max_low_ratio=0,
            ),
            "system_cores": MemoryLevel(),
        }),
        "Memory policy per QoS level.",
        keys=LEVEL_NAMES,
    )


@dataclass(frozen=True, slots=True)
class OomLevel:
    set_score: bool = setting(False, "Set oom_score_adj to score (false keeps kubelet's value).")
    score: int = setting(0, "oom_score_adj for this level.", minimum=-1000, maximum=1000)
    floor: int = setting(
        0, "Lowest oom_score_adj a pod annotation may ask for.", minimum=-1000, maximum=1000
    )


@dataclass(frozen=True, slots=True)
class OomConfig:
    enabled: bool = setting(True, "Adjust oom_score_adj at container creation.")
    annotation: str = setting("qos.nri-qos.io/oom-score-adj", "Per-pod oom_score_adj annotation.")
    priority_ordering: bool = setting(
        False,
        "Tier ordering for tidal colocation: reclaimed_cores containers always score at least "
        "offline_min_score, every other level strictly below it, so offline pods are "
        "always OOM-killed first.",
    )
    offline_min_score: int = setting(
        500, "Boundary between the offline and online tiers (priority_ordering).",
        minimum=-999, maximum=1000,
    )
    levels: Mapping[str, OomLevel] = setting(
        frozen_map({
            "dedicated_cores": OomLevel(floor=-998),
            "shared_cores": OomLevel(floor=2),
            "reclaimed_cores": OomLevel(set_score=True, score=1000, floor=1000),
            "system_cores": OomLevel(floor=-998),
        }),
        "oom_score_adj per QoS level.",
        keys=LEVEL_NAMES,
    )


def check_hook_path(path: str) -> str | None:
    """An injected hook runs as root inside every matching container: only trusted files qualify."""
    if not os.path.isabs(path):
        return f"must be an absolute path, got {path!r}"
    try:
        st = os.stat(path)
    except OSError as exc:
        return f"{path}: {exc.strerror}"
    if not stat.S_ISREG(st.st_mode):
        return f"{path}: not a regular file"
    if not st.st_mode & 0o111:
        return f"{path}: not executable"
    if st.st_uid != 0:
        return f"{path}: must be owned by root (uid 0), owner is uid {st.st_uid}"
    if st.st_mode & 0o022:
        return f"{path}: must not be group- or world-writable (mode {stat.filemode(st.st_mode)})"
    return None


@dataclass(frozen=True, slots=True)
class OciHook:
    path: str = setting("", "Absolute path of the hook executable.", check=check_hook_path)
    args: tuple[str, ...] = setting((), "argv of the hook (argv[0] included, as in OCI).")
    env: tuple[str, ...] = setting((), "Environment, KEY=VALUE.")
    timeout_s: int = setting(0, "Timeout; 0 means none.", unit="seconds", minimum=0, maximum=3600)


@dataclass(frozen=True, slots=True)
class OciLevelHooks:
    prestart: tuple[OciHook, ...] = setting((), "prestart hooks.")
    create_runtime: tuple[OciHook, ...] = setting((), "createRuntime hooks.")
    create_container: tuple[OciHook, ...] = setting((), "createContainer hooks.")
    start_container: tuple[OciHook, ...] = setting((), "startContainer hooks.")
    poststart: tuple[OciHook, ...] = setting((), "poststart hooks.")
    poststop: tuple[OciHook, ...] = setting((), "poststop hooks.")


@dataclass(frozen=True, slots=True)
class OciHooksConfig:
    levels: Mapping[str, OciLevelHooks] = setting(
        {}, "Hooks per QoS level, e.g. [[oci_hooks.levels.reclaimed_cores.prestart]].",
        keys=LEVEL_NAMES,
    )
