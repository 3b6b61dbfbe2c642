"""What a round knows of each running pod: its level, priority, memory request and the
anonymous memory it uses now (read from its cgroups), with what the API server says of it."""

from __future__ import annotations

from common.podmeta import PodMeta
from common.state import Snapshot
from reconciler.eviction.api import ActivePod
from reconciler.eviction.choice import PodFacts
from reconciler.host.cgroups import BESTEFFORT, CgroupLayout, CgroupPathError, pod_parent_rel
from reconciler.host.memstat import pod_anon_bytes
from reconciler.host.sysfs import SysFs

MAX_SPARED_TERMINATION_S = 600
"""The longest grace period of a deletion that spares a terminating pod outright: such a pod is
gone within it anyway. A longer one is its author's to choose (``terminationGracePeriodSeconds``
has no upper bound) and, with SIGTERM ignored, would keep the pod running and spared for good;
such a pod is spared only from evictions that would not end it sooner (``PodFacts.lingering_s``)."""


def pod_facts(snapshot: Snapshot, sysfs: SysFs, layout: CgroupLayout) -> dict[str, PodFacts]:
    """Every pod with a running container, by uid. Reads cgroup files: run it in a worker
    thread."""
    requests: dict[str, int | None] = {}
    for container in snapshot.running():
        pod_id = container.pod.info.id
        request = container.info.memory_request
        if request is not None:
            requests[pod_id] = (requests.get(pod_id) or 0) + request
        else:
            requests.setdefault(pod_id, None)
    facts: dict[str, PodFacts] = {}
    for pod_id, request in requests.items():
        view = snapshot.pods[pod_id]
        info, meta = view.info, view.meta
        usage = pod_anon_bytes(sysfs, layout, info.cgroup_parent)
        pod = ActivePod(info.uid, info.namespace, info.name, view.level, info.priority,
                        request, usage, outside_tier=not _in_tier(layout, info.cgroup_parent))
        facts[info.uid] = PodFacts(
            pod, info.labels, info.annotations,
            terminating=meta is not None and _going(meta),
            described=meta is not None,
            lingering_s=meta.deletion_grace_s if meta is not None and meta.terminating
            and not _going(meta) else None,
            claimed_daemonset=meta.daemonset if meta is not None else None)
    return facts


def _in_tier(layout: CgroupLayout, cgroup_parent: str) -> bool:
    """Whether the pod's memory cgroup is below the BestEffort tier's (an unusable cgroup
    parent is taken for one inside: nothing then says otherwise)."""
    try:
        pod = layout.dir("memory", pod_parent_rel(cgroup_parent))
    except CgroupPathError:
        return True
    return pod.startswith(layout.tier_dir("memory", BESTEFFORT) + "/")


def _going(meta: PodMeta) -> bool:
    """The pod is being deleted with a grace period that ends it soon."""
    return meta.terminating and (meta.deletion_grace_s is None
                                 or meta.deletion_grace_s <= MAX_SPARED_TERMINATION_S)
