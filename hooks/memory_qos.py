"""Memory QoS policy: cgroup v2 ``memory.min`` / ``memory.low`` / ``memory.high`` per container.

Per level (``memory.levels.<level>.policy``):

``ratios`` (Volcano)
    ``memory.min = request x min_ratio %``, ``memory.low = request x low_ratio %``,
    ``memory.high = limit x high_ratio %``. Each is set only for a ratio above 0, so
    kubelet's own values stay untouched otherwise (a ``memory.high`` of 0 would stop every
    container of the level).
``kubernetes`` (the kubelet MemoryQoS formula)
    ``memory.high = floor((request + factor x (limit - request)) / page) x page``;
    min/low as for ``ratios``.
``none``
    nothing, unless the pod carries the Volcano annotation.

A container without a limit uses node allocatable memory in place of the limit, or gets no
``memory.high`` (``no_limit``); a limit or request of 0 is none, as to Kubernetes. Every value
is rounded down to whole pages, a level never sets a ``memory.high`` of 0, and ``memory.high``
is never set below ``memory.low``.

The ``volcano.sh/colocation-config`` pod annotation holds a ColocationConfiguration spec
(``{"memoryQos": {"highRatio": 80, "lowRatio": 50, "minRatio": 0}}``; missing ratios take
Volcano's defaults 100/0/0). It sets all three values, with ``minRatio``/``lowRatio`` bounded by
the level's ``annotation_max_*_ratio`` (a larger one is rejected and the level's value used), and
``memory.high`` never above what the level's own policy sets (a pod may not lift it). An
annotation that is present but empty resets the values: ``memory.high=max``, ``memory.low=0``,
``memory.min=0``, except keys the level's own policy sets.

On cgroup v1 there are no unified keys; with ``v1_reservation`` the computed ``memory.low``
becomes the container's memory reservation (soft limit).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any

from hooks.annotation_json import json_object
from hooks.config_fields import frozen_map, percent, setting
from hooks.levels import LEVEL_NAMES
from hooks.model import MAX_ANNOTATION_CHARS, ContainerInfo, PodInfo
from hooks.settings import EMPTY_SETTINGS, ContainerSettings
from hooks.untrusted import bounded_repr


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
    high_ratio: int = percent(100, "memory.high = limit x high_ratio % (policy ratios; 0: "
                                   "no memory.high).")
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


# The online levels' default: their requests protected by memory.low, the soft protection (the
# kernel takes it back only when nothing unprotected is left, so it never OOM-kills for it, as an
# over-committed memory.min can), and no memory.high. Without it, reclaim at kubepods' limit or the
# machine's takes online pages as readily as offline ones, wherever kubelet's MemoryQoS is off.
ONLINE_LEVEL = MemoryLevel(policy="ratios", low_ratio=100, high_ratio=0)


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
            "dedicated_cores": ONLINE_LEVEL,
            "shared_cores": ONLINE_LEVEL,
            "reclaimed_cores": MemoryLevel(
                policy="ratios", high_ratio=95,
                annotation_max_min_ratio=0, annotation_max_low_ratio=0,
            ),
            "system_cores": MemoryLevel(),
        }),
        "Memory policy per QoS level.",
        keys=LEVEL_NAMES,
    )


def memory_qos_active(cfg: MemoryConfig) -> bool:
    """Whether memory QoS can set anything: switched on, and either the Volcano annotation is
    honoured or some level has a policy."""
    return cfg.enabled and (cfg.volcano_annotation
                            or any(level.policy != "none" for level in cfg.levels.values()))


VOLCANO_ANNOTATION = "volcano.sh/colocation-config"
_VOLCANO_DEFAULTS = {"highratio": 100, "lowratio": 0, "minratio": 0}
_RATIO_KEYS = {"highratio": "highRatio", "lowratio": "lowRatio", "minratio": "minRatio"}
RESET = MappingProxyType({"memory.high": "max", "memory.low": "0", "memory.min": "0"})


@dataclass(frozen=True, slots=True)
class MemoryDecision:
    settings: ContainerSettings
    problems: tuple[str, ...] = ()


@dataclass(frozen=True, slots=True)
class Ratios:
    high: int
    low: int
    min: int
    # highRatio was written in the annotation (not Volcano's default)
    high_given: bool = False


def _pages(value: float, page: int) -> int:
    return int(value // page) * page


def _share(amount: int, ratio: int, page: int) -> int:
    """``ratio`` % of ``amount`` in whole pages, exact: a float product rounds up past the
    amount itself from about 80 TiB (and past the int64 of the runtime's fields)."""
    return _pages(amount * ratio // 100, page)


def parse_volcano(text: str) -> tuple[Ratios | None, tuple[str, ...]]:
    """Ratios from a ColocationConfiguration spec; (None, ()) when it has no memoryQos."""
    doc, problem = json_object(text, MAX_ANNOTATION_CHARS)
    if doc is None:
        return None, (problem or "unusable annotation",)
    # Other spec sections (selector, other resources) are not ours to judge.
    qos: Any = None
    for key, value in doc.items():
        if key.lower() == "memoryqos":
            qos = value
    if qos is None:
        return None, ()
    if not isinstance(qos, dict):
        return None, (f"memoryQos: must be an object, got {type(qos).__name__}",)
    values = dict(_VOLCANO_DEFAULTS)
    for key, value in qos.items():
        low = key.lower()
        if low not in _VOLCANO_DEFAULTS:
            return None, (f"memoryQos: unknown key {bounded_repr(key)}",)
        if isinstance(value, bool) or not isinstance(value, int):
            return None, (f"memoryQos.{_RATIO_KEYS[low]}: must be an integer, "
                          f"got {type(value).__name__}",)
        if not 0 <= value <= 100:
            return None, (f"memoryQos.{_RATIO_KEYS[low]}: must be 0..100, got {value}",)
        values[low] = value
    given = {key.lower() for key in qos}
    return Ratios(values["highratio"], values["lowratio"], values["minratio"],
                  "highratio" in given), ()


def _level_values(level: MemoryLevel, request: int | None, limit: int | None,
                  page: int) -> dict[str, int]:
    """The level policy's values in bytes (no memory.high when ``limit`` is None)."""
    out: dict[str, int] = {}
    if level.policy == "none":
        return out
    if request is not None:
        if level.min_ratio:
            out["memory.min"] = _share(request, level.min_ratio, page)
        if level.low_ratio:
            out["memory.low"] = _share(request, level.low_ratio, page)
    if limit is not None:
        if level.policy == "ratios":
            if level.high_ratio:
                out["memory.high"] = _share(limit, level.high_ratio, page)
        else:
            req = min(request or 0, limit)
            out["memory.high"] = _pages(req + level.throttling_factor * (limit - req), page)
    # A memory.high of 0 (a limit below a page, or throttling_factor 0 without a request)
    # would stall the container: kubelet's MemoryQoS leaves it out too.
    if out.get("memory.high") == 0:
        del out["memory.high"]
    return out


def memory_settings(pod: PodInfo, container: ContainerInfo, level_name: str, cfg: MemoryConfig,
                    *, cgroup_v2: bool, node_allocatable: int) -> MemoryDecision:
    """The memory part of a container's settings."""
    level = cfg.levels.get(level_name)
    if level is None:
        return MemoryDecision(EMPTY_SETTINGS)
    page = cfg.page_size
    # 0 means none for both, as to Kubernetes and the runtime: a pod spec may say "0", and the
    # pod watch passes it on.
    limit = container.memory_limit or None
    if limit is None and level.no_limit == "allocatable" and node_allocatable > 0:
        limit = node_allocatable
    request = container.memory_request or None
    values: dict[str, int | str] = dict(_level_values(level, request, limit, page))
    problems: list[str] = []
    low_from_annotation = False

    raw = pod.annotations.get(VOLCANO_ANNOTATION) if cfg.volcano_annotation else None
    if raw is not None and not raw.strip():
        for key, reset in RESET.items():
            values.setdefault(key, reset)
    elif raw is not None:
        ratios, problems_ = parse_volcano(raw)
        problems.extend(problems_)
        if ratios is not None:
            if limit is not None:
                asked = _share(limit, ratios.high, page)
                policy_high = values.get("memory.high")
                # The annotation may throttle harder than the level, never lift its throttle.
                if isinstance(policy_high, int) and asked > policy_high:
                    if ratios.high_given:
                        problems.append(f"memoryQos.highRatio {ratios.high} would lift "
                                        f"memory.high above the {level_name} policy's "
                                        f"{policy_high}")
                else:
                    values["memory.high"] = asked
            for key, label, ratio, cap in (
                ("memory.min", "minRatio", ratios.min, level.annotation_max_min_ratio),
                ("memory.low", "lowRatio", ratios.low, level.annotation_max_low_ratio),
            ):
                if ratio > cap:
                    problems.append(f"memoryQos.{label} {ratio} is above the allowed {cap} "
                                    f"for {level_name}")
                elif request is not None:
                    values[key] = _share(request, ratio, page)
                    low_from_annotation = low_from_annotation or key == "memory.low"

    high, low = values.get("memory.high"), values.get("memory.low")
    if isinstance(high, int) and isinstance(low, int) and high < low:
        if low_from_annotation:
            # Protection a pod asks for never lifts the throttle its level sets.
            problems.append(f"memoryQos.lowRatio would put memory.low ({low}) above "
                            f"memory.high ({high}); memory.low kept at memory.high")
            values["memory.low"] = high
            floor = values.get("memory.min")
            if isinstance(floor, int) and floor > high:
                values["memory.min"] = high
        else:
            values["memory.high"] = low

    if not cgroup_v2:
        low_v1 = values.get("memory.low")
        if level.v1_reservation and isinstance(low_v1, int) and low_v1 > 0:
            return MemoryDecision(ContainerSettings(memory_reservation=low_v1), tuple(problems))
        return MemoryDecision(EMPTY_SETTINGS, tuple(problems))
    unified = MappingProxyType({k: str(v) for k, v in sorted(values.items())})
    return MemoryDecision(ContainerSettings(unified=unified), tuple(problems))
