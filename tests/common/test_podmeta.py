"""Kubernetes quantities and the PodMeta view of a v1 Pod."""

from __future__ import annotations

from typing import Any

import pytest

from common.podmeta import OwnerRef, PodMeta, parse_quantity, pod_meta_from_object
from tests.support.fake_apiserver import make_pod


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("0", 0),
        ("128", 128),
        ("+5", 5),
        ("-5", -5),
        ("1Ki", 1024),
        ("1Mi", 1 << 20),
        ("1.5Gi", 3 << 29),
        ("2Ti", 2 << 40),
        ("1Pi", 1 << 50),
        ("1Ei", 1 << 60),
        ("1k", 1000),
        ("1M", 10**6),
        ("1G", 10**9),
        ("1T", 10**12),
        ("1P", 10**15),
        ("1E", 10**18),
        ("500m", 1),  # rounded up, like the API's Value()
        ("1500m", 2),
        ("1e3", 1000),
        ("1E3", 1000),
        ("1e+3", 1000),
        ("12e-1", 2),
        (".5Ki", 512),
        ("5.", 5),
        ("0.1", 1),
        (1024, 1024),
        (1.5, 2),
        (1e9, 10**9),
    ],
)
def test_parse_quantity(text: str | int | float, expected: int) -> None:
    assert parse_quantity(text) == expected


@pytest.mark.parametrize(
    "text",
    ["", " 1Gi", "1Gi ", "1 Gi", "1GB", "1gi", "1KI", "Gi", "abc", "1..2", ".", "1e", "1e3Gi",
     "--1", "0x10", "1e999999999", "1e31", "1Ei" * 2, "10000000000Ei", "nan", "inf"],
)
def test_parse_quantity_rejects_garbage(text: str) -> None:
    with pytest.raises(ValueError, match="quantity"):
        parse_quantity(text)


@pytest.mark.parametrize("value", [None, True, [1], {"a": 1}, float("nan"), float("inf")])
def test_parse_quantity_rejects_non_quantities(value: Any) -> None:
    with pytest.raises(ValueError, match="quantity"):
        parse_quantity(value)


def test_pod_meta_from_full_object() -> None:
    pod = make_pod(
        "web", namespace="shop", uid="u-1", annotations={"qos.nri-qos.io/level": "reclaimed_cores"},
        labels={"app": "web"}, priority=1000, owner_kind="ReplicaSet",
        memory={"app": ("256Mi", "1Gi"), "log": (None, "64Mi"), "idle": (None, None)},
    )
    pod["spec"]["initContainers"] = [
        {"name": "setup", "resources": {"requests": {"memory": "1Gi"}}},
        {"name": "proxy", "restartPolicy": "Always",
         "resources": {"requests": {"memory": "32Mi"}, "limits": {"memory": "32Mi"}}},
    ]
    meta = pod_meta_from_object(pod)
    assert meta == PodMeta(
        uid="u-1", namespace="shop", name="web",
        annotations={"qos.nri-qos.io/level": "reclaimed_cores"}, labels={"app": "web"},
        priority=1000,
        memory_requests={"app": 256 << 20, "proxy": 32 << 20},
        memory_limits={"app": 1 << 30, "log": 64 << 20, "proxy": 32 << 20},
        deleted=False,
    )
    assert pod_meta_from_object(pod, deleted=True).deleted
    assert not meta.terminating


def test_pod_with_a_deletion_timestamp_is_terminating() -> None:
    pod = make_pod("going")
    pod["metadata"]["deletionTimestamp"] = "2026-01-01T00:00:00Z"
    assert pod_meta_from_object(pod).terminating


def test_pod_meta_is_immutable() -> None:
    meta = pod_meta_from_object(make_pod("a", annotations={"k": "v"}))
    with pytest.raises(TypeError):
        meta.annotations["k"] = "w"  # type: ignore[index]
    with pytest.raises(AttributeError):
        meta.name = "b"  # type: ignore[misc]


@pytest.mark.parametrize(
    "obj",
    [
        {},
        {"metadata": None, "spec": None},
        {"metadata": [], "spec": "x"},
        {"metadata": {"uid": 5, "name": None, "annotations": ["a"], "labels": "x"}},
        {"spec": {"containers": "nope", "priority": "high"}},
        {"spec": {"containers": [None, 3, {"name": 7},
                                 {"resources": {"limits": {"memory": "1"}}}]}},
        {"spec": {"priority": True}},
        {"metadata": {"ownerReferences": "x"}},
    ],
)
def test_odd_objects_become_empty_fields(obj: dict[str, Any]) -> None:
    meta = pod_meta_from_object(obj)
    assert (meta.uid, meta.namespace, meta.name) == ("", "", "")
    assert dict(meta.annotations) == {}
    assert dict(meta.labels) == {}
    assert meta.priority is None
    assert meta.daemonset is None
    assert dict(meta.memory_requests) == {}
    assert dict(meta.memory_limits) == {}


def test_non_mapping_object() -> None:
    meta = pod_meta_from_object([])  # type: ignore[arg-type]
    assert meta.uid == ""
    assert not meta.deleted


def test_bad_values_cost_only_themselves() -> None:
    pod = make_pod("p", memory={"a": ("lots", "1Gi"), "b": ("-1Mi", "2Gi"), "c": ("1Mi", "1e99")})
    pod["metadata"]["annotations"] = {"good": "yes", "bad": 5}
    pod["metadata"]["labels"] = {"x": None, "y": "z"}
    meta = pod_meta_from_object(pod)
    assert dict(meta.memory_requests) == {"c": 1 << 20}
    assert dict(meta.memory_limits) == {"a": 1 << 30, "b": 2 << 30}
    assert dict(meta.annotations) == {"good": "yes"}
    assert dict(meta.labels) == {"y": "z"}


def test_a_memory_quantity_of_0_is_none() -> None:
    """Kubernetes reads a request or limit of 0 as none (its QoS class, kubelet's cgroups): a
    limit of 0 taken as one would throttle the container to nothing."""
    pod = make_pod("p", memory={"a": ("0", "0"), "b": ("0Mi", "1Gi"), "c": ("1Mi", "0Gi")})
    meta = pod_meta_from_object(pod)
    assert dict(meta.memory_requests) == {"c": 1 << 20}
    assert dict(meta.memory_limits) == {"b": 1 << 30}


DS = {"apiVersion": "apps/v1", "kind": "DaemonSet", "name": "agent", "uid": "uid-ds",
      "controller": True}


@pytest.mark.parametrize(("ref", "named"), [
    (DS, OwnerRef("apps/v1", "DaemonSet", "agent", "uid-ds")),
    ({**DS, "controller": False}, None),
    ({k: v for k, v in DS.items() if k != "controller"}, None),
    ({**DS, "controller": "true"}, None),
    ({**DS, "apiVersion": "extensions/v1beta1"}, None),
    ({**DS, "apiVersion": "example.com/v1"}, None),
    ({**DS, "kind": "daemonset"}, None),
    ({**DS, "name": ""}, None),
    ({**DS, "uid": ""}, None),
    # The controller is the one reference that says so, whatever comes before it.
    ({"kind": "ConfigMap", "name": "x"}, None),
])
def test_a_daemonset_owner_is_an_apps_v1_controller(ref: dict[str, object],
                                                    named: OwnerRef | None) -> None:
    pod = make_pod("p")
    pod["metadata"]["ownerReferences"] = [ref]
    assert pod_meta_from_object(pod).daemonset == named
