"""The node's pods as the memory detectors and actions need them: level, memory cgroup, request.

Built from a :class:`~common.state.NodeState` snapshot: a pod's memory cgroup is the parent
of its containers' cgroups (the runtime reports the containers' paths), its request the sum of
its running containers' memory requests (from the pod watch, else from the runtime). Cached per
snapshot, so an idle detector pays nothing to ask again; the parsed containers come from a
:class:`~reconciler.loops.common.ManagedCache`, which the loops may share.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from common.state import NodeState, Snapshot
from hooks.levels import QosLevel
from hooks.untrusted import bounded
from reconciler.host.cgroups import CgroupLayout, pod_rel
from reconciler.loops.common import ManagedCache

ONLINE_LEVELS = frozenset({QosLevel.DEDICATED_CORES, QosLevel.SHARED_CORES,
                           QosLevel.SYSTEM_CORES})
"""The levels whose pods' own pressure the detectors read (and the ladder protects)."""


@dataclass(frozen=True, slots=True)
class PodMemory:
    uid: str
    name: str  # namespace/name, bounded for logs and audit records (it comes from the runtime)
    level: str
    # The pod's memory cgroup, a system path.
    cgroup: str
    # Sum of the running containers' memory requests (0 when none has one).
    request_bytes: int
    annotations: Mapping[str, str]


class PodIndex:
    """Running pods with their memory cgroup, rebuilt only when the node state changed.

    ``managed``: the running containers' cache to read (a new one when None). Callers in
    several threads may share an index: the snapshot and its pods are one attribute.
    """

    def __init__(self, state: NodeState, layout: CgroupLayout,
                 managed: ManagedCache | None = None) -> None:
        self._state = state
        self._layout = layout
        self._managed = ManagedCache() if managed is None else managed
        self._cached: tuple[Snapshot | None, tuple[PodMemory, ...]] = (None, ())

    def pods(self) -> tuple[PodMemory, ...]:
        snapshot = self._state.snapshot()
        key, cached = self._cached
        if snapshot is key:
            return cached
        found: dict[str, PodMemory] = {}
        requests: dict[str, int] = {}
        for managed in self._managed.get(snapshot):
            info = managed.view.pod.info
            requests[info.uid] = requests.get(info.uid, 0) + (
                managed.view.info.memory_request or 0)
            if info.uid not in found:
                found[info.uid] = PodMemory(
                    info.uid, bounded(f"{info.namespace}/{info.name}"), managed.level,
                    self._layout.dir("memory", pod_rel(managed.ref)), 0, info.annotations)
        pods = tuple(PodMemory(p.uid, p.name, p.level, p.cgroup, requests[p.uid], p.annotations)
                     for p in found.values())
        self._cached = (snapshot, pods)
        return pods
