"""What several loops need per state snapshot: each running container's level and cgroup.

Parsing cgroup paths for thousands of containers every second would dominate an idle cycle, so
the result is cached until the state changes. Levels come from the node state, the one place
that decides them (for the NRI answers too). One cache is shared by the loops and the mitigation
actions, so a snapshot is parsed once and an unusable path said once, whoever asks first.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

import structlog

from common.state import ContainerView, Snapshot
from reconciler.host.cgroups import CgroupPathError, CgroupRef, parse_cgroups_path

log = structlog.get_logger("nri_qos.reconciler")


@dataclass(frozen=True, slots=True)
class Managed:
    """A running container with a usable cgroup, and its pod's current level."""

    view: ContainerView
    level: str
    ref: CgroupRef


class ManagedCache:
    """Running containers with their level and parsed cgroup, rebuilt only on change.

    Safe to share between threads: the snapshot, its items and the ids of the containers skipped
    are one attribute, swapped whole, so a reader never pairs a snapshot with another's items;
    a rebuild holds a lock, so concurrent readers of a new snapshot parse it (and warn) once.
    """

    def __init__(self) -> None:
        self._cached: tuple[Snapshot | None, tuple[Managed, ...], frozenset[str]] = (
            None, (), frozenset())
        self._rebuild = threading.Lock()

    def get(self, snapshot: Snapshot) -> tuple[Managed, ...]:
        key, items, _ = self._cached
        if key is snapshot:
            return items
        with self._rebuild:
            key, items, said = self._cached
            if key is snapshot:
                return items
            built: list[Managed] = []
            bad: set[str] = set()
            for view in snapshot.running():
                try:
                    ref = parse_cgroups_path(view.info.cgroups_path)
                except CgroupPathError as exc:
                    bad.add(view.info.id)
                    if view.info.id not in said:
                        log.warning("container_skipped", reason="unusable cgroups path",
                                    container=view.info.id, error=str(exc))
                    continue
                built.append(Managed(view, view.pod.level, ref))
            # Said once per container while it runs; forgotten with it.
            items = tuple(built)
            self._cached = (snapshot, items, frozenset(bad))
            return items


def requested_outside(items: tuple[Managed, ...], tier: str) -> int:
    """The memory requested by the running containers outside kubelet's ``tier`` cgroup (what
    kubelet's QOSReserved keeps from it); a container without a known request counts 0."""
    return sum(m.view.info.memory_request or 0 for m in items if m.ref.tier != tier)
