"""Configuration of the resctrl capability: class groups per level, pod groups, the monitor hook.

Declared beside the resctrl policy that reads it; the node configuration composes it as
``[resctrl]``. Hook executable paths are checked against the filesystem by the configuration
loader (this package does no I/O).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from hooks.config_fields import frozen_map, percent, section, setting
from hooks.levels import LEVEL_NAMES
from hooks.untrusted import bounded


def _group_prefix(value: Any) -> str | None:
    if not re.fullmatch(r"[A-Za-z0-9_-]{1,32}", value):
        return f"must match [A-Za-z0-9_-]{{1,32}}, got {value!r}"
    return None


CACHE_ID_DIGITS = 10
"""Digits of the longest cache id: the kernel numbers caches with 32-bit ids."""
# The spelling of a cache id in the schemata, and the only one: the class group reads a key with
# int() and a pod's bounds look it up with str(), so "01" (or an Arabic-Indic one, which int()
# also reads) would bound the one and not the other.
_CACHE_ID = re.compile(rf"0|[1-9][0-9]{{0,{CACHE_ID_DIGITS - 1}}}")


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
        # The key bounded in its path: the error line keeps the reason whatever the key's length.
        problems += [(f"per_cache.{bounded(k, 32)}", "cache id must be a decimal number of ASCII "
                      f"digits without leading zeros, at most {CACHE_ID_DIGITS} digits")
                     for k in self.per_cache if not _CACHE_ID.fullmatch(k)]
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
