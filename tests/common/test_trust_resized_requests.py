"""A pod's memory request is what kubelet gave its containers, not more: with in-place resize a
pod's author can write any request into the spec, which kubelet may never grant (an infeasible
resize stays in the spec, and the scheduler then counts what the status reports). Taken from
the spec alone, such a request would buy the pod memory.low protection, a smaller cap on the
offline tier and a higher RSS overuse threshold."""

from __future__ import annotations

from typing import Any

from common.podmeta import pod_meta_from_object
from common.state import NodeState
from hooks.model import ContainerInfo, PodInfo
from tests.support.fake_apiserver import make_pod

GIB = 1 << 30
UID = "5a1e0000-0000-4000-8000-000000000001"


def _resized(spec: str, status: str | None, *, key: str = "containerStatuses",
             name: str = "c0") -> dict[str, Any]:
    obj = make_pod("resized", uid=UID, memory={name: (spec, None)})
    if key == "initContainerStatuses":
        obj["spec"]["initContainers"] = obj["spec"].pop("containers")
        obj["spec"]["initContainers"][0]["restartPolicy"] = "Always"
        obj["spec"]["containers"] = [{"name": "main", "image": "busybox"}]
    if status is not None:
        obj["status"] = {key: [{"name": name, "resources": {"requests": {"memory": status}}}]}
    return obj


def test_an_infeasible_resize_up_does_not_raise_the_request() -> None:
    meta = pod_meta_from_object(_resized("512Gi", "1Gi"))
    assert dict(meta.memory_requests) == {"c0": GIB}


def test_a_resize_down_counts_at_once() -> None:
    meta = pod_meta_from_object(_resized("1Gi", "4Gi"))
    assert dict(meta.memory_requests) == {"c0": GIB}


def test_a_sidecar_is_bounded_by_its_init_container_status() -> None:
    meta = pod_meta_from_object(_resized("512Gi", "1Gi", key="initContainerStatuses",
                                         name="side"))
    assert dict(meta.memory_requests) == {"side": GIB}


def test_without_a_status_the_spec_decides() -> None:
    assert dict(pod_meta_from_object(_resized("2Gi", None)).memory_requests) == {"c0": 2 * GIB}


def test_a_status_of_another_container_or_unreadable_bounds_nothing() -> None:
    obj = _resized("2Gi", None)
    obj["status"] = {"containerStatuses": [
        {"name": "other", "resources": {"requests": {"memory": "1Mi"}}},
        {"name": "c0", "resources": {"requests": {"memory": "lots"}}},
        "not a status",
    ]}
    assert dict(pod_meta_from_object(obj).memory_requests) == {"c0": 2 * GIB}


def test_the_containers_the_loops_see_carry_the_granted_request() -> None:
    state = NodeState()
    pod = PodInfo(id="sandbox-1", uid=UID, name="resized", namespace="default",
                  cgroup_parent=f"/kubepods/burstable/pod{UID}")
    container = ContainerInfo(id="c" * 64, pod_sandbox_id="sandbox-1", name="c0",
                              cgroups_path=f"/kubepods/burstable/pod{UID}/{'c' * 64}")
    state.replace_all([pod], [container])
    state.apply_meta(pod_meta_from_object(_resized("512Gi", "1Gi")))
    [view] = state.snapshot().running()
    assert view.info.memory_request == GIB
