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

    Safe to share between threads: the snapshot, its items, the ids of the containers skipped
    and the parsed paths are one attribute, swapped whole, so a reader never pairs a snapshot
    with another's items; a rebuild holds a lock, so concurrent readers of a new snapshot parse
    it (and warn) once. A container's cgroups path never changes: a rebuild parses only the
    paths the previous one had not (every change of the node state is a rebuild).
    """

    def __init__(self) -> None:
        self._cached: tuple[Snapshot | None, tuple[Managed, ...], frozenset[str],
                            dict[str, CgroupRef | str]] = (None, (), frozenset(), {})
        self._rebuild = threading.Lock()

    def get(self, snapshot: Snapshot) -> tuple[Managed, ...]:
        key, items, _, _ = self._cached
        if key is snapshot:
            return items
        with self._rebuild:
            key, items, said, known = self._cached
            if key is snapshot:
                return items
            built: list[Managed] = []
            bad: set[str] = set()
            # Only the running containers' paths: those of containers gone are forgotten.
            parsed: dict[str, CgroupRef | str] = {}
            for view in snapshot.running():
                path = view.info.cgroups_path
                ref = parsed[path] = known.get(path) or _parsed(path)
                if isinstance(ref, str):
                    bad.add(view.info.id)
                    if view.info.id not in said:
                        log.warning("container_skipped", reason="unusable cgroups path",
                                    container=view.info.id, error=ref)
                    continue
                built.append(Managed(view, view.pod.level, ref))
            # Said once per container while it runs; forgotten with it.
            items = tuple(built)
            self._cached = (snapshot, items, frozenset(bad), parsed)
            return items


def _parsed(path: str) -> CgroupRef | str:
    """The path's cgroup, or why it is unusable (kept as text: an exception would keep the
    frames of its traceback, and the snapshot in them)."""
    try:
        return parse_cgroups_path(path)
    except CgroupPathError as exc:
        return str(exc)


def requested_outside(items: tuple[Managed, ...], tier: str) -> int:
    """The memory requested by the running containers outside kubelet's ``tier`` cgroup (what
    kubelet's QOSReserved keeps from it); a container without a known request counts 0."""
    return sum(m.view.info.memory_request or 0 for m in items if m.ref.tier != tier)
