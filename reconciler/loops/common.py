"""What several loops need per state snapshot: each running container's level and cgroup.

Resolving levels and parsing cgroup paths for thousands of containers every second would dominate
an idle cycle, so the result is cached until the state or the QoS configuration changes.
"""

from __future__ import annotations

from dataclasses import dataclass

import structlog

from hooks.qos_level import resolve_level
from nri_plugin.config.schema import QosConfig
from reconciler.cgroups import CgroupPathError, CgroupRef, parse_cgroups_path
from reconciler.state import ContainerView, Snapshot

log = structlog.get_logger("nri_qos.reconciler")


@dataclass(frozen=True, slots=True)
class Managed:
    """A running container with a usable cgroup, and its pod's current level."""

    view: ContainerView
    level: str
    ref: CgroupRef


class ManagedCache:
    """Running containers with their level and parsed cgroup, rebuilt only on change."""

    def __init__(self) -> None:
        self._key: tuple[int, QosConfig] | None = None
        self._items: tuple[Managed, ...] = ()
        self._bad_paths: set[str] = set()

    def get(self, snapshot: Snapshot, qos: QosConfig) -> tuple[Managed, ...]:
        key = (snapshot.version, qos)
        if self._key is not None and self._key[0] == key[0] and self._key[1] is qos:
            return self._items
        levels: dict[str, str] = {}
        items: list[Managed] = []
        for view in snapshot.running():
            try:
                ref = parse_cgroups_path(view.info.cgroups_path)
            except CgroupPathError as exc:
                if view.info.id not in self._bad_paths:
                    self._bad_paths.add(view.info.id)
                    log.warning("container_skipped", reason="unusable cgroups path",
                                container=view.info.id, error=str(exc))
                continue
            pod = view.pod.info
            level = levels.get(pod.id)
            if level is None:
                level = levels[pod.id] = resolve_level(pod, qos).level
            items.append(Managed(view, level, ref))
        self._key, self._items = key, tuple(items)
        return self._items
