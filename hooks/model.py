"""What the policies see: plain, immutable views of a pod, a container and the runtime.

The NRI path builds these from protobuf messages (:mod:`nri_plugin.wire.convert`), the
reconciler from its node state; policies never see protobuf or the filesystem.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType

EMPTY_MAP: Mapping[str, str] = MappingProxyType({})


@dataclass(frozen=True, slots=True)
class PodInfo:
    id: str
    uid: str
    name: str
    namespace: str
    labels: Mapping[str, str] = field(default_factory=lambda: EMPTY_MAP)
    annotations: Mapping[str, str] = field(default_factory=lambda: EMPTY_MAP)
    # CRI cgroup parent, e.g. /kubepods/besteffort/pod<uid> or kubepods-besteffort-pod<uid>.slice
    cgroup_parent: str = ""
    cgroups_path: str = ""
    # Known only through the Kubernetes API (None without it).
    priority: int | None = None


@dataclass(frozen=True, slots=True)
class ContainerInfo:
    id: str
    pod_sandbox_id: str
    name: str
    # OCI cgroupsPath: /kubepods/burstable/pod<uid>/<id> or
    # kubepods-burstable-pod<uid>.slice:cri-containerd:<id>
    cgroups_path: str = ""
    pid: int = 0
    # bytes; None means no limit
    memory_limit: int | None = None
    # bytes; known from the Kubernetes API, kubelet's memory.min or the spec's reservation
    memory_request: int | None = None
    # kubelet's value in the OCI spec
    oom_score_adj: int | None = None
    # kubelet's MemoryQoS memory.high in the spec's unified map ("max" or bytes), None without
    memory_high: str | None = None


@dataclass(frozen=True, slots=True)
class RuntimeInfo:
    """The connected runtime, as far as adjustments depend on it."""

    name: str = ""
    version: str = ""
    # (major, minor, patch) of the runtime's NRI, None when unknown
    nri_version: tuple[int, int, int] | None = None
    # cgroup v2 host (unified keys apply) or v1
    cgroup_v2: bool = False
    extra: Mapping[str, str] = field(default_factory=lambda: EMPTY_MAP)


MAX_ANNOTATION_CHARS = 16384
"""The longest annotation value any policy reads (the Volcano colocation config). A longer value
is kept cut to one character more, which every policy rejects as too long: the pod gets its
level's defaults and an audit record, and the agent does not hold megabytes per pod. Annotations
that together would take a pod over what the node state keeps of one are all left out instead
(``nri_plugin.wire.convert.MAX_POD_BYTES``): the same defaults, the same record."""
MAX_LABEL_CHARS = 320
"""Characters kept of a label value the agent reads: the Kubernetes API allows 63, so a longer
value is not from a real pod (kept cut to one character more, which policies reject)."""


@dataclass(frozen=True, slots=True)
class ReadKeys:
    """The pod annotations and labels the agent reads; every other one is dropped at the door."""

    annotations: frozenset[str]
    labels: frozenset[str] = frozenset()

    def annotations_of(self, source: Mapping[str, str]) -> Mapping[str, str]:
        kept = {key: value[:MAX_ANNOTATION_CHARS + 1] for key in self.annotations
                if (value := source.get(key)) is not None}
        return MappingProxyType(kept) if kept else EMPTY_MAP

    def labels_of(self, source: Mapping[str, str]) -> Mapping[str, str]:
        kept = {key: value[:MAX_LABEL_CHARS + 1] for key in self.labels
                if (value := source.get(key)) is not None}
        return MappingProxyType(kept) if kept else EMPTY_MAP
