"""What several loops need per state snapshot: each running container's level and cgroup.

Parsing cgroup paths for thousands of containers every second would dominate an idle cycle, so
the result is cached until the state changes. Levels come from the node state, the one place
that decides them (for the NRI answers too).
"""

from __future__ import annotations

from dataclasses import dataclass

import structlog

from reconciler.host.cgroups import CgroupPathError, CgroupRef, parse_cgroups_path
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
        self._key: Snapshot | None = None
        self._items: tuple[Managed, ...] = ()
        self._bad_paths: set[str] = set()

    def get(self, snapshot: Snapshot) -> tuple[Managed, ...]:
        if self._key is snapshot:
            return self._items
        items: list[Managed] = []
        bad: set[str] = set()
        for view in snapshot.running():
            try:
                ref = parse_cgroups_path(view.info.cgroups_path)
            except CgroupPathError as exc:
                bad.add(view.info.id)
                if view.info.id not in self._bad_paths:
                    log.warning("container_skipped", reason="unusable cgroups path",
                                container=view.info.id, error=str(exc))
                continue
            items.append(Managed(view, view.pod.level, ref))
        # Said once per container while it runs; forgotten with it.
        self._key, self._items, self._bad_paths = snapshot, tuple(items), bad
        return self._items
