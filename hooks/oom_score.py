"""oom_score_adj policy: per level, per pod annotation, optional offline-first tier ordering.

* A level with ``set_score`` gets ``score``; other levels keep kubelet's value.
* The pod annotation (``oom.annotation``, default ``qos.nri-qos.io/oom-score-adj``) holds a decimal
  integer. It must lie between the level's ``floor`` (or kubelet's value, when higher) and 1000;
  anything else is rejected (the level's value stays) and reported, so a pod can make itself
  more killable but never less than its level allows or kubelet decided.
* ``priority_ordering``: reclaimed_cores containers always score at least ``offline_min_score``
  and every other level strictly below it, whatever the sources above said; the kernel's OOM
  killer therefore always picks offline pods first.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass

from hooks.config_fields import frozen_map, setting
from hooks.levels import LEVEL_NAMES, QosLevel
from hooks.model import ContainerInfo, PodInfo
from hooks.settings import EMPTY_SETTINGS, ContainerSettings
from hooks.untrusted import bounded_repr


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


OOM_MAX = 1000
_INT_RE = re.compile(r"[+-]?[0-9]{1,5}")


@dataclass(frozen=True, slots=True)
class OomDecision:
    settings: ContainerSettings
    problems: tuple[str, ...] = ()


def oom_score(pod: PodInfo, container: ContainerInfo, level_name: str,
              cfg: OomConfig) -> OomDecision:
    level = cfg.levels.get(level_name)
    if level is None:
        return OomDecision(EMPTY_SETTINGS)
    value: int | None = level.score if level.set_score else None
    problems: list[str] = []
    raw = pod.annotations.get(cfg.annotation)
    if raw is not None:
        text = raw.strip()
        # A pod may make itself more killable, never less than its level's floor or than
        # kubelet made it.
        floor = level.floor
        if container.oom_score_adj is not None:
            floor = max(floor, container.oom_score_adj)
        if not _INT_RE.fullmatch(text):
            problems.append(f"{cfg.annotation}: not an integer: {bounded_repr(raw, 40)}")
        elif not floor <= int(text) <= OOM_MAX:
            problems.append(f"{cfg.annotation}: {int(text)} is outside [{floor}, {OOM_MAX}] "
                            f"allowed for {level_name}")
        else:
            value = int(text)
    if cfg.priority_ordering:
        current = value if value is not None else container.oom_score_adj
        if level_name == QosLevel.RECLAIMED_CORES:
            value = max(OOM_MAX if current is None else current, cfg.offline_min_score)
        elif current is not None and current >= cfg.offline_min_score:
            value = cfg.offline_min_score - 1
    if value is None:
        return OomDecision(EMPTY_SETTINGS, tuple(problems))
    return OomDecision(ContainerSettings(oom_score_adj=value), tuple(problems))
