"""Which QoS level a pod runs at: the first configured source with a known value decides.

Sources, tried in ``QosConfig.sources`` order:

``annotation``
    The project's own annotation (``QosConfig.annotation``), holding a level name.
``katalyst``
    ``katalyst.kubewharf.io/qos_level`` annotation, holding a level name.
``koordinator``
    ``koordinator.sh/qosClass``, the label first and then the annotation, mapped through
    ``QosConfig.koordinator`` (LSE/LSR/LS/BE/SYSTEM by default).
``volcano``
    ``volcano.sh/qos-level`` annotation, mapped through ``QosConfig.volcano``.
``kubernetes_qos``
    The Kubernetes QoS class, read from the pod's cgroup parent, mapped through
    ``QosConfig.kubernetes_qos``.

Matching: surrounding ASCII whitespace is ignored everywhere (values often come from YAML block
scalars). Level names must match exactly, case included, as Katalyst spells them. Koordinator and
Volcano codes are matched regardless of ASCII case, since both projects use upper-case codes and a
lower-case ``be`` has only one possible meaning. Only ASCII is folded or trimmed: Unicode case
mapping would read ``system`` spelt with a long s (U+017F) as ``SYSTEM``, a spelling no admission
rule written for the ASCII value would catch, so any other character makes the value unknown. A
value that is present but unknown (an empty one included) does not stop the search: it is
reported in :attr:`LevelDecision.rejected` so the caller can audit it, and the next source is
tried. When no source decides, the pod gets ``QosConfig.default_level``.

Claims are bounded. The annotations and labels are the pod author's, who could otherwise name a
level above what Kubernetes gave the pod (never evicted, outside the offline tier's caps, the
level's OCI hooks). A claim (every source but ``kubernetes_qos``) may not be more privileged
(:data:`hooks.levels.PRIVILEGE`) than the pod's Kubernetes QoS class, read from the cgroup parent
kubelet chose: BestEffort may claim ``reclaimed_cores`` only, Burstable ``shared_cores`` at most,
Guaranteed anything but ``system_cores``. A level listed in ``QosConfig.level_namespaces`` may be
claimed only by pods of those namespaces; ``system_cores`` is granted by that list alone (default:
``kube-system``), whatever the class. A caller may pass a ``ceiling`` too: the level the pod
had at creation, so that an annotation changed later through the API cannot raise it. A refused
claim ends the search: the pod gets what it would get without any claim (its class's level,
``QosConfig.kubernetes_qos``, when ``kubernetes_qos`` is a source; else the default level), never
above the ceiling, and :attr:`LevelDecision.refused` says what was refused and why. A pod whose
cgroup parent is not a kubelet's has no class, and only the namespace rule bounds its claims.
Neither the default level nor a class's level may be ``system_cores``: the configuration refuses
them, so that only ``level_namespaces`` grants it.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from hooks.config_fields import setting
from hooks.levels import LEVEL_NAMES, PRIVILEGE, QosLevel
from hooks.model import PodInfo

QOS_SOURCES = ("annotation", "katalyst", "koordinator", "volcano", "kubernetes_qos")


def _levels_only(value: Any) -> str | None:
    bad = sorted({v for v in value.values() if v not in LEVEL_NAMES})
    if bad:
        return f"values must be QoS levels ({', '.join(LEVEL_NAMES)}), got {', '.join(bad)}"
    return None


def _unique(value: Any) -> str | None:
    dupes = sorted({v for v in value if list(value).count(v) > 1})
    return f"duplicate entries: {', '.join(dupes)}" if dupes else None


@dataclass(frozen=True, slots=True)
class QosConfig:
    sources: tuple[str, ...] = setting(
        QOS_SOURCES,
        "Where a pod's QoS level comes from, tried in this order; the first known value wins.",
        choices=QOS_SOURCES, check=_unique,
    )
    default_level: str = setting(
        "shared_cores", "Level of a pod that no source classifies.", choices=LEVEL_NAMES
    )
    annotation: str = setting("qos.nri-qos.io/level", "Annotation holding a level name.")
    koordinator: Mapping[str, str] = setting(
        {
            "LSE": "dedicated_cores",
            "LSR": "dedicated_cores",
            "LS": "shared_cores",
            "BE": "reclaimed_cores",
            "SYSTEM": "system_cores",
        },
        "koordinator.sh/qosClass (label or annotation) value -> level.",
        check=_levels_only,
    )
    volcano: Mapping[str, str] = setting(
        {
            "LC": "dedicated_cores",
            "HLS": "dedicated_cores",
            "LS": "shared_cores",
            "BE": "reclaimed_cores",
        },
        "volcano.sh/qos-level annotation value -> level.",
        check=_levels_only,
    )
    kubernetes_qos: Mapping[str, str] = setting(
        {
            "guaranteed": "shared_cores",
            "burstable": "shared_cores",
            "besteffort": "reclaimed_cores",
        },
        "Kubernetes QoS class (read from the pod's cgroup parent) -> level.",
        keys=("guaranteed", "burstable", "besteffort"),
        check=_levels_only,
    )
    level_namespaces: Mapping[str, tuple[str, ...]] = setting(
        {QosLevel.SYSTEM_CORES.value: ("kube-system",)},
        "Levels a pod may claim only in these namespaces (level -> namespaces; an empty list: "
        "in none). system_cores, which exempts a pod from eviction and from the offline "
        "tier's caps, is granted by this list alone; the other levels are bounded by the pod's "
        "Kubernetes QoS class too.",
        keys=LEVEL_NAMES,
    )

    def validate(self) -> list[tuple[str, str]]:
        # system_cores exempts a pod from eviction and from the offline tier's caps: a default
        # or a class's level would give it to every pod without a claim, or of that class, in
        # every namespace, past the one list that is to grant it.
        only_claimed = ("may not be system_cores: only a claim from a namespace in "
                        "qos.level_namespaces.system_cores gets it")
        problems = [("default_level", only_claimed)] \
            if self.default_level == QosLevel.SYSTEM_CORES else []
        problems += [(f"kubernetes_qos.{qos_class}", only_claimed)
                     for qos_class, level in self.kubernetes_qos.items()
                     if level == QosLevel.SYSTEM_CORES]
        return problems


KATALYST_ANNOTATION = "katalyst.kubewharf.io/qos_level"
KOORDINATOR_KEY = "koordinator.sh/qosClass"
VOLCANO_ANNOTATION = "volcano.sh/qos-level"
DEFAULT_SOURCE = "default"
# What YAML leaves around a value; str.strip() would also take Unicode spaces and separators.
ASCII_WHITESPACE = " \t\n\r\v\f"

GUARANTEED = "guaranteed"
BURSTABLE = "burstable"
BESTEFFORT = "besteffort"

# systemd driver: kubepods-besteffort-pod<uid>.slice, kubepods-burstable-pod<uid>.slice,
# kubepods-pod<uid>.slice (guaranteed). The uid has its dashes turned into underscores.
_SYSTEMD_POD_SLICE = re.compile(r"kubepods(?:-(besteffort|burstable))?-pod[^/]+\.slice")
# cgroupfs driver: the pod directory below kubepods[/besteffort|/burstable].
_CGROUPFS_POD_DIR = re.compile(r"pod[^/]+")


# The most privileged level a claim may name, per Kubernetes QoS class.
CLASS_CEILING: Mapping[str, str] = {
    BESTEFFORT: QosLevel.RECLAIMED_CORES,
    BURSTABLE: QosLevel.SHARED_CORES,
    GUARANTEED: QosLevel.DEDICATED_CORES,
}
CLASS_SOURCE = "kubernetes_qos"


@dataclass(frozen=True, slots=True)
class Refusal:
    """A claim the pod may not make: the level named, the source and the annotation or label
    that named it (``annotation katalyst.kubewharf.io/qos_level``), and why not."""

    claim: str
    source: str
    key: str
    reason: str


@dataclass(frozen=True, slots=True)
class LevelDecision:
    level: str
    # The source that decided, or "default".
    source: str
    # (source, value) pairs that were present but not understood, in the order they were tried.
    rejected: tuple[tuple[str, str], ...] = ()
    # The claim that was refused; the level is then the pod's without any claim.
    refused: Refusal | None = None


def kubernetes_qos_class(cgroup_parent: str) -> str | None:
    """``guaranteed``, ``burstable`` or ``besteffort`` from a pod cgroup path, else None.

    Accepts both drivers, with or without the parent path: ``/kubepods/burstable/pod<uid>``,
    ``/kubepods/pod<uid>``, ``kubepods-besteffort-pod<uid>.slice``,
    ``kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod<uid>.slice``. A container's
    systemd cgroups path (``<pod slice>:cri-containerd:<id>``) is read through its slice part.
    """
    parts = [p.split(":", 1)[0] for p in cgroup_parent.strip().split("/") if p]
    for part in parts:
        m = _SYSTEMD_POD_SLICE.fullmatch(part)
        if m:
            return m.group(1) or GUARANTEED
    for i, part in enumerate(parts):
        if part != "kubepods":
            continue
        rest = parts[i + 1:]
        if len(rest) >= 2 and rest[0] in (BESTEFFORT, BURSTABLE) \
                and _CGROUPFS_POD_DIR.fullmatch(rest[1]):
            return rest[0]
        if rest and _CGROUPFS_POD_DIR.fullmatch(rest[0]):
            return GUARANTEED
        return None
    return None


def _level_name(value: str) -> str | None:
    return value if value in LEVEL_NAMES else None


def _mapped(mapping: Mapping[str, str]) -> Callable[[str], str | None]:
    folded = {code.upper(): level for code, level in mapping.items()}
    return lambda value: folded.get(value.upper()) if value.isascii() else None


def _candidates(source: str, pod: PodInfo, cfg: QosConfig) -> list[tuple[str, str]]:
    """The raw values a source offers for this pod, in the order they are tried, each with the
    annotation or label it came from."""
    if source == "annotation":
        values = [(f"annotation {cfg.annotation}", pod.annotations.get(cfg.annotation))]
    elif source == "katalyst":
        values = [(f"annotation {KATALYST_ANNOTATION}",
                   pod.annotations.get(KATALYST_ANNOTATION))]
    elif source == "koordinator":
        values = [(f"label {KOORDINATOR_KEY}", pod.labels.get(KOORDINATOR_KEY)),
                  (f"annotation {KOORDINATOR_KEY}", pod.annotations.get(KOORDINATOR_KEY))]
    elif source == "volcano":
        values = [(f"annotation {VOLCANO_ANNOTATION}", pod.annotations.get(VOLCANO_ANNOTATION))]
    elif source == CLASS_SOURCE:
        if not pod.cgroup_parent.strip():
            return []
        values = [("cgroup parent", kubernetes_qos_class(pod.cgroup_parent) or pod.cgroup_parent)]
    else:
        raise ValueError(f"unknown QoS level source {source!r}")
    return [(key, v.strip(ASCII_WHITESPACE)) for key, v in values if v is not None]


def _interpreter(source: str, cfg: QosConfig) -> Callable[[str], str | None]:
    if source == "koordinator":
        return _mapped(cfg.koordinator)
    if source == "volcano":
        return _mapped(cfg.volcano)
    if source == "kubernetes_qos":
        return lambda value: cfg.kubernetes_qos.get(value)
    return _level_name


def _why_not(level: str, pod: PodInfo, qos_class: str | None, cfg: QosConfig,
             ceiling: str | None) -> str | None:
    """Why the pod may not claim ``level``, or None."""
    namespaces = cfg.level_namespaces.get(level)
    if namespaces is not None and pod.namespace not in namespaces:
        return f"{level} only for namespaces {', '.join(namespaces) or '(none)'}"
    if level == QosLevel.SYSTEM_CORES:
        # No Kubernetes class grants it: only the namespaces listed for it.
        if namespaces is None:
            return "system_cores only for the namespaces listed for it (none)"
    elif qos_class is not None and PRIVILEGE[level] > PRIVILEGE[CLASS_CEILING[qos_class]]:
        return f"above what the pod's QoS class {qos_class} allows " \
               f"({CLASS_CEILING[qos_class]} at most)"
    if ceiling is not None and PRIVILEGE[level] > PRIVILEGE[ceiling]:
        return f"above the level the pod had at creation ({ceiling})"
    return None


def _unclaimed(qos_class: str | None, cfg: QosConfig, ceiling: str | None) -> tuple[str, str]:
    """A refused claim's level and source: what the pod gets without any claim (its class's
    level when ``kubernetes_qos`` is a source and the class is known, else the default), never
    above ``ceiling``."""
    if qos_class is not None and CLASS_SOURCE in cfg.sources:
        level, source = cfg.kubernetes_qos[qos_class], CLASS_SOURCE
    else:
        level, source = cfg.default_level, DEFAULT_SOURCE
    if ceiling is not None and PRIVILEGE[level] > PRIVILEGE[ceiling]:
        return ceiling, source
    return level, source


def resolve_level(pod: PodInfo, cfg: QosConfig, ceiling: str | None = None) -> LevelDecision:
    """The pod's QoS level, the source that decided it, the values that were not understood,
    and the claim refused if any; ``ceiling``: no claim may go above this level."""
    rejected: list[tuple[str, str]] = []
    qos_class = kubernetes_qos_class(pod.cgroup_parent)
    for source in cfg.sources:
        values = _candidates(source, pod, cfg)
        if not values:
            continue
        interpret = _interpreter(source, cfg)
        for key, value in values:
            level = interpret(value)
            if level is None or level not in LEVEL_NAMES:
                rejected.append((source, value))
                continue
            why = None if source == CLASS_SOURCE else \
                _why_not(level, pod, qos_class, cfg, ceiling)
            if why is None:
                return LevelDecision(level, source, tuple(rejected))
            unclaimed, decided_by = _unclaimed(qos_class, cfg, ceiling)
            return LevelDecision(unclaimed, decided_by, tuple(rejected),
                                 Refusal(level, source, key, why))
    return LevelDecision(cfg.default_level, DEFAULT_SOURCE, tuple(rejected))
