"""Between NRI protobuf messages and the plain views the policies work on.

Inbound: ``PodSandbox``/``Container`` -> :class:`~hooks.model.PodInfo` /
:class:`~hooks.model.ContainerInfo`. Outbound: merged :class:`~hooks.settings.ContainerSettings`
-> the ``ContainerAdjustment`` of a CreateContainer answer.
"""

from __future__ import annotations

import re
import sys
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, replace
from types import MappingProxyType

from hooks.model import MAX_ANNOTATION_CHARS, ContainerInfo, PodInfo, ReadKeys
from hooks.settings import ContainerSettings, HookStage
from hooks.untrusted import bounded
from nri_plugin.wire.errors import MessageError
from nri_plugin.wire.runtime_support import ClosField
from protos import nri_api_pb2 as api

INT64_MAX = (1 << 63) - 1
OOM_SCORE_ADJ_MIN, OOM_SCORE_ADJ_MAX = -1000, 1000
"""The range /proc/<pid>/oom_score_adj takes."""
_DECIMAL = re.compile(r"[0-9]{1,19}")

MAX_ID_CHARS = 256
"""Sandbox and container ids are 64 hex digits, uids 36 characters."""
MAX_NAME_CHARS = 1024
"""Kubernetes names and namespaces have at most 253 characters, container names 63."""
MAX_PATH_CHARS = 4096
"""A cgroup path longer than PATH_MAX cannot exist."""
MAX_POD_BYTES = MAX_ANNOTATION_CHARS + (8 << 10)
"""Memory the strings of one pod may take in the node state (ids, names, cgroup paths, and the
annotations and labels some policy reads): the longest annotation a policy accepts (the Volcano
colocation config, 16 KiB) and 8 KiB for all the rest, where a real pod keeps well under 1 KiB.
A pod whose annotations and labels would take it over is kept without any of them, as if it
carried none (they are the pod author's, so leaving them out never gives it more than its QoS
class does); a pod whose ids, names and cgroup paths alone are over it is refused like one with
an over-long id. At the node state's pod limit (4096) this bounds the pods to about 100 MiB."""
MAX_CONTAINER_BYTES = 4 << 10
"""Memory the strings of one container may take in the node state (ids, name, cgroups path): a
real container keeps about 500 bytes. A container over it is refused."""


def _text(value: str, what: str, limit: int) -> str:
    if len(value) > limit:
        raise MessageError(f"{what} is {len(value)} characters long, more than {limit}: "
                           f"{bounded(value, 64)}")
    return value


def _strings_size(strings: Iterable[str]) -> int:
    return sum(map(sys.getsizeof, strings))


@dataclass(frozen=True, slots=True)
class ConvertedPod:
    """A pod as the policies see it, and what of the runtime's copy was left out of it."""

    info: PodInfo
    # The read annotations and labels (``label <key>``) left out, with why; empty when kept.
    ignored: tuple[str, ...] = ()
    reason: str = ""


def convert_pod(pod: api.PodSandbox, keys: ReadKeys | None = None) -> ConvertedPod:
    """The pod as the policies see it. ``keys`` keeps only the annotations and labels the agent
    reads (None: all of them, bounded). Identifiers longer than any real one, and pods whose
    ids, names and cgroup paths take more than :data:`MAX_POD_BYTES`, are refused; a pod whose
    annotations and labels would take it over that is kept without them."""
    if not pod.id:
        raise MessageError("pod sandbox has no id")
    if keys is None:
        keys = ReadKeys(frozenset(pod.annotations), frozenset(pod.labels))
    info = PodInfo(
        id=_text(pod.id, "pod sandbox id", MAX_ID_CHARS),
        uid=_text(pod.uid, "pod uid", MAX_ID_CHARS),
        name=_text(pod.name, "pod name", MAX_NAME_CHARS),
        namespace=_text(pod.namespace, "pod namespace", MAX_NAME_CHARS),
        cgroup_parent=_text(pod.linux.cgroup_parent, "pod cgroup parent", MAX_PATH_CHARS),
        cgroups_path=_text(pod.linux.cgroups_path, "pod cgroups path", MAX_PATH_CHARS),
    )
    size = _strings_size((info.id, info.uid, info.name, info.namespace, info.cgroup_parent,
                          info.cgroups_path))
    if size > MAX_POD_BYTES:
        raise MessageError(f"pod {bounded(info.uid, 64)}: its ids, names and cgroup paths "
                           f"would take {size} bytes, more than {MAX_POD_BYTES}")
    labels, annotations = keys.labels_of(pod.labels), keys.annotations_of(pod.annotations)
    size += _strings_size((*labels, *labels.values(), *annotations, *annotations.values()))
    if size > MAX_POD_BYTES:
        ignored = (*sorted(annotations), *(f"label {key}" for key in sorted(labels)))
        return ConvertedPod(info, ignored, (
            f"with its annotations and labels the pod would take {size} bytes, more than "
            f"{MAX_POD_BYTES}: it is treated as if it carried none"))
    return ConvertedPod(replace(info, labels=labels, annotations=annotations))


def container_info(container: api.Container) -> ContainerInfo:
    """The container as the policies see it; identifiers longer than any real one, and
    containers whose strings take more than :data:`MAX_CONTAINER_BYTES`, are refused."""
    if not container.id:
        raise MessageError("container has no id")
    linux = container.linux
    memory = linux.resources.memory
    limit = memory.limit.value if memory.HasField("limit") else 0
    cid = _text(container.id, "container id", MAX_ID_CHARS)
    pod_sandbox_id = _text(container.pod_sandbox_id, "container's sandbox id", MAX_ID_CHARS)
    name = _text(container.name, "container name", MAX_NAME_CHARS)
    cgroups_path = _text(linux.cgroups_path, "container cgroups path", MAX_PATH_CHARS)
    size = _strings_size((cid, pod_sandbox_id, name, cgroups_path))
    if size > MAX_CONTAINER_BYTES:
        raise MessageError(f"container {bounded(cid, 64)} would take {size} bytes, more than "
                           f"{MAX_CONTAINER_BYTES}")
    return ContainerInfo(
        id=cid,
        pod_sandbox_id=pod_sandbox_id,
        name=name,
        cgroups_path=cgroups_path,
        pid=container.pid,
        # The runtime leaves the limit out, or writes 0, for "no limit".
        memory_limit=limit if limit > 0 else None,
        memory_request=_memory_request(linux.resources),
        oom_score_adj=_oom_score_adj(linux),
        memory_high=_memory_high(linux.resources),
    )


def _oom_score_adj(linux: api.LinuxContainer) -> int | None:
    # A score the kernel would refuse is no score: taken as the container's, the policies
    # would keep or raise it into an answer the runtime then fails the creation with.
    if not linux.HasField("oom_score_adj"):
        return None
    value = linux.oom_score_adj.value
    return value if OOM_SCORE_ADJ_MIN <= value <= OOM_SCORE_ADJ_MAX else None


def _memory_request(resources: api.LinuxResources) -> int | None:
    # kubelet's MemoryQoS writes the request as memory.min (cgroup v2); otherwise the spec may
    # carry it as the v1 soft limit.
    text = resources.unified.get("memory.min")
    if text is not None:
        # ASCII digits only (str.isdigit also takes "²"), and within the int64 of the API.
        text = text.strip()
        if _DECIMAL.fullmatch(text) and 0 < int(text) <= INT64_MAX:
            return int(text)
    memory = resources.memory
    if memory.HasField("reservation") and memory.reservation.value > 0:
        return memory.reservation.value
    return None


def _memory_high(resources: api.LinuxResources) -> str | None:
    # kubelet's MemoryQoS writes it beside memory.min: "max", or bytes.
    text = resources.unified.get("memory.high")
    if text is None:
        return None
    text = text.strip()
    if text == "max" or (_DECIMAL.fullmatch(text) and int(text) <= INT64_MAX):
        return text
    return None


def _fill_resources(resources: api.LinuxResources, settings: ContainerSettings,
                    clos_field: ClosField | None) -> None:
    # Filled in place: a sub-message only becomes present once one of its fields is set.
    if settings.memory_limit is not None:
        resources.memory.limit.value = settings.memory_limit
    if settings.memory_reservation is not None:
        resources.memory.reservation.value = settings.memory_reservation
    for key, value in settings.unified.items():
        resources.unified[key] = value
    if settings.rdt_class is not None and clos_field == "rdt_class":
        resources.rdt_class.value = settings.rdt_class


def fill_adjustment(
    adjust: api.ContainerAdjustment, settings: ContainerSettings, *,
    clos_field: ClosField | None,
) -> None:
    """Write the settings of a container being created into ``adjust`` (in place, e.g. the
    ``adjust`` of a response: building it apart and copying it in costs a copy per event).

    ``clos_field`` picks where the resctrl class goes: ``linux.resources.rdt_class`` or
    ``linux.rdt.clos_id``; None drops it (the runtime would not apply either).
    """
    for key, value in settings.annotations.items():
        adjust.annotations[key] = value
    for hook in settings.hooks:
        entry = getattr(adjust.hooks, _STAGE_FIELDS[hook.stage]).add()
        entry.path = hook.path
        entry.args.extend(hook.args)
        entry.env.extend(hook.env)
        if hook.timeout_s is not None:
            entry.timeout.value = hook.timeout_s
    linux = adjust.linux
    _fill_resources(linux.resources, settings, clos_field)
    if settings.oom_score_adj is not None:
        linux.oom_score_adj.value = settings.oom_score_adj
    if settings.rdt_class is not None and clos_field == "clos_id":
        linux.rdt.clos_id.value = settings.rdt_class


_STAGE_FIELDS: Mapping[HookStage, str] = MappingProxyType({
    HookStage.PRESTART: "prestart",
    HookStage.CREATE_RUNTIME: "create_runtime",
    HookStage.CREATE_CONTAINER: "create_container",
    HookStage.START_CONTAINER: "start_container",
    HookStage.POSTSTART: "poststart",
    HookStage.POSTSTOP: "poststop",
})
