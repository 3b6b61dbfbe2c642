"""resctrl groups: their names, which group a container belongs to, which class groups exist.

One policy for both appliers: the CreateContainer answer (the CLOS of a new container) and the
task-id loop (the tasks of running containers) place a container with the same function,
:func:`place_container`, and the daemon at start, a reload and the loop's repair of a removed
group plan the class groups with the same :func:`plan_class_groups`.

Names: a level's class group is ``<prefix><level>``; a pod's own group (from a pod-level resctrl
annotation) is ``<prefix>pod-<uid>``, with a monitor group of the same name inside it.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass
from types import MappingProxyType

from hooks.levels import LEVEL_NAMES
from hooks.resctrl import ResctrlInfo, Schemata, class_schemata
from hooks.resctrl_config import ResctrlConfig

# Kubernetes uids are RFC 4122 strings; anything else never becomes a path component.
_UID_RE = re.compile(r"[A-Za-z0-9-]{1,64}")
_GROUP_RE = re.compile(r"[A-Za-z0-9_.-]{1,200}")
# Names that resctrl uses for its own files and directories inside a group.
_RESERVED = frozenset({"info", "mon_groups", "mon_data", "tasks", "cpus", "cpus_list",
                       "schemata", "mode", "size", "mon_hw_id", "ctrl_hw_id"})
POD_MARK = "pod-"


def valid_group_name(name: str) -> bool:
    """A name that is safe as one directory component below the resctrl root."""
    return (bool(_GROUP_RE.fullmatch(name)) and ".." not in name
            and not name.startswith(".") and name not in _RESERVED)


def class_group_name(prefix: str, level: str) -> str:
    return prefix + level


def pod_group_name(prefix: str, uid: str) -> str | None:
    """``<prefix>pod-<uid>``, or None when the uid is not a plain uid."""
    if not _UID_RE.fullmatch(uid):
        return None
    return f"{prefix}{POD_MARK}{uid}"


@dataclass(frozen=True, slots=True)
class GroupRef:
    """What one of our group names stands for: ``kind`` is "class" (key = level) or "pod"."""

    kind: str
    key: str


def parse_group_name(prefix: str, name: str, levels: tuple[str, ...]) -> GroupRef | None:
    """Inverse of the two name builders; None for groups that are not ours."""
    if not name.startswith(prefix) or not valid_group_name(name):
        return None
    rest = name[len(prefix):]
    if rest in levels:
        return GroupRef("class", rest)
    if rest.startswith(POD_MARK) and _UID_RE.fullmatch(rest[len(POD_MARK):]):
        return GroupRef("pod", rest[len(POD_MARK):])
    return None


@dataclass(frozen=True, slots=True)
class Placement:
    """Where one container's tasks belong."""

    # The control group, or None: the container stays where the kernel put it.
    group: str | None
    # The group is the pod's own (with a monitor group when the hardware monitors).
    pod_group: bool = False
    # The level uses resctrl but its class group does not exist (nothing to join).
    class_group_missing: bool = False


def place_container(planned: str | None, level: str, cfg: ResctrlConfig,
                    exists: Callable[[str], bool]) -> Placement:
    """The pod's own group when its plan gives it one (``planned``: the group of
    :func:`hooks.resctrl_annotation.plan_pod_group` under ``cfg``) and it exists, else the
    level's class group when the level uses resctrl and the group exists.

    Both are needed. The plan, because a reload can take a pod's group away while the pod runs:
    the group then waits for the task-id loop's collection, and no container must join it
    meanwhile. The group on disk, because it is made at RunPodSandbox and may not have been
    (classes exhausted, ``mkdir`` refused): such a pod falls back to its class group the same
    way on both paths, and after a restart of the agent as before it.
    """
    if planned is not None and exists(planned):
        return Placement(planned, pod_group=True)
    return place_in_class_group(level, cfg, exists)


def place_in_class_group(level: str, cfg: ResctrlConfig,
                         exists: Callable[[str], bool]) -> Placement:
    """The level's class group when the level uses resctrl and the group exists."""
    level_cfg = cfg.levels.get(level)
    if level_cfg is None or not level_cfg.enabled:
        return Placement(None)
    group = class_group_name(cfg.group_prefix, level)
    if exists(group):
        return Placement(group)
    return Placement(None, class_group_missing=True)


@dataclass(frozen=True, slots=True)
class ClassGroupPlan:
    """The class groups that should exist (with their schemata) and ours that should not."""

    ensure: Mapping[str, Schemata]
    # group -> the level it served
    remove: Mapping[str, str]


def plan_class_groups(cfg: ResctrlConfig, info: ResctrlInfo,
                      existing: Collection[str]) -> ClassGroupPlan:
    """Every enabled level's class group; our class groups of levels no longer enabled go."""
    enabled = {level for level, lvl in cfg.levels.items() if lvl.enabled}
    ensure = {class_group_name(cfg.group_prefix, level): class_schemata(cfg.levels[level], info)
              for level in cfg.levels if level in enabled}
    remove = {}
    for name in sorted(existing):
        ref = parse_group_name(cfg.group_prefix, name, LEVEL_NAMES)
        if ref is not None and ref.kind == "class" and ref.key not in enabled:
            remove[name] = ref.key
    return ClassGroupPlan(MappingProxyType(ensure), MappingProxyType(remove))
