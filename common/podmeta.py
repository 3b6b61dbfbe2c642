"""What the Kubernetes API adds to a pod: priority, owner, memory requests/limits, fresh metadata.

:func:`pod_meta_from_object` turns the JSON dict of a v1 Pod into a :class:`PodMeta`. It never
raises: the API server is trusted to send Pods, but a field of an unexpected type (or a quantity
that does not parse) must cost only that field, never the watch.
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Mapping
from dataclasses import dataclass
from fractions import Fraction
from types import MappingProxyType
from typing import Any

from hooks.model import ReadKeys
from hooks.untrusted import bounded_repr

_EMPTY: Mapping[str, Any] = MappingProxyType({})

CONFIG_SOURCE_ANNOTATION = "kubernetes.io/config.source"
"""Where kubelet got a pod from: ``api``, or ``file``/``http`` for a static pod."""
KUBELET_STAMPED = frozenset({CONFIG_SOURCE_ANNOTATION})
"""Annotations kubelet writes on its own copy of every pod it runs, over whatever the pod said:
the runtime is given that copy, so the runtime's value is kubelet's. The API server's copy holds
what the pod's author wrote, which can be anything (a pod calling itself static would escape
eviction), so these keys are always taken from the runtime."""

_BINARY = {"Ki": 1, "Mi": 2, "Gi": 3, "Ti": 4, "Pi": 5, "Ei": 6}
_DECIMAL = {"m": -3, "": 0, "k": 3, "M": 6, "G": 9, "T": 12, "P": 15, "E": 18}
# Exponent alternatives come before the plain "E" suffix so that "1E3" is 1000, while "1E" is
# one exa: the same reading the API server applies.
_QUANTITY = re.compile(
    r"(?P<number>[+-]?(?:[0-9]+(?:\.[0-9]*)?|\.[0-9]+))"
    r"(?P<suffix>Ki|Mi|Gi|Ti|Pi|Ei|[eE][+-]?[0-9]+|m|k|M|G|T|P|E|)"
)
# A quantity above this cannot be a memory size; refusing it also keeps "1e999999999" from
# building a huge integer.
_MAX_EXPONENT = 30
_INT64_MAX = (1 << 63) - 1


@dataclass(frozen=True, slots=True)
class OwnerRef:
    """A pod's controlling owner reference, as written in the pod (by whoever wrote the pod:
    it proves nothing until the owner is found)."""

    api_version: str
    kind: str
    name: str
    uid: str


DAEMONSET_API_VERSION = "apps/v1"


@dataclass(frozen=True, slots=True)
class PodMeta:
    """One pod as the API server describes it (only the fields the node agent uses)."""

    uid: str
    namespace: str
    name: str
    annotations: Mapping[str, str]
    labels: Mapping[str, str]
    # spec.priority, resolved by the admission controller from the priority class
    priority: int | None
    # container name -> bytes; containers without a memory request are absent
    memory_requests: Mapping[str, int]
    # container name -> bytes; containers without a memory limit are absent
    memory_limits: Mapping[str, int]
    # True when the pod was deleted from the API (a DELETED watch event or gone at a relist)
    deleted: bool = False
    # True once metadata.deletionTimestamp is set: the pod is shutting down (graceful deletion,
    # an accepted eviction)
    terminating: bool = False
    # metadata.deletionGracePeriodSeconds: the grace the deletion gave the pod (None: not given)
    deletion_grace_s: int | None = None
    # The controlling owner when it names an apps/v1 DaemonSet (kubectl drain's test), to be
    # confirmed against the API before the pod counts as a DaemonSet's
    daemonset: OwnerRef | None = None

    def trimmed(self, keys: ReadKeys) -> PodMeta:
        """This pod with only the annotations the agent reads, and bounded labels."""
        return dataclasses.replace(self, annotations=keys.annotations_of(self.annotations),
                                   labels=keys.labels_of(self.labels))


def parse_quantity(text: str | int | float) -> int:
    """A Kubernetes resource quantity as an integer, rounded up like the API's ``Value()``.

    Accepts binary suffixes (Ki..Ei), decimal suffixes (m, k, M, G, T, P, E) and decimal
    exponents (``1e3``, ``2E-2``). Anything else raises :class:`ValueError`.
    """
    if isinstance(text, bool) or not isinstance(text, str | int | float):
        raise ValueError(f"quantity must be a string or a number, got {type(text).__name__}")
    if isinstance(text, float) and not math.isfinite(text):
        raise ValueError(f"quantity must be finite, got {text}")
    raw = text if isinstance(text, str) else repr(text)
    match = _QUANTITY.fullmatch(raw)
    if match is None:
        raise ValueError(f"not a Kubernetes quantity: {bounded_repr(raw)}")
    number = Fraction(match["number"])
    suffix = match["suffix"]
    if suffix in _BINARY:
        value = number * (1 << (10 * _BINARY[suffix]))
    else:
        exponent = _DECIMAL[suffix] if suffix in _DECIMAL else int(suffix[1:])
        if abs(exponent) > _MAX_EXPONENT:
            raise ValueError(f"quantity exponent out of range: {bounded_repr(raw)}")
        value = number * Fraction(10) ** exponent
    result = math.ceil(value)
    if abs(result) > _INT64_MAX:
        raise ValueError(f"quantity out of range: {bounded_repr(raw)}")
    return result


def pod_meta_from_object(obj: Mapping[str, Any], *, deleted: bool = False) -> PodMeta:
    """The :class:`PodMeta` of a v1 Pod JSON object; missing or odd fields become empty/None."""
    metadata = _mapping(obj.get("metadata")) if isinstance(obj, Mapping) else _EMPTY
    spec = _mapping(obj.get("spec")) if isinstance(obj, Mapping) else _EMPTY
    status = _mapping(obj.get("status")) if isinstance(obj, Mapping) else _EMPTY
    requests: dict[str, int] = {}
    limits: dict[str, int] = {}
    for container in _running_containers(spec):
        name = container.get("name")
        if not isinstance(name, str) or not name:
            continue
        resources = _mapping(container.get("resources"))
        _put_memory(requests, name, _mapping(resources.get("requests")))
        _put_memory(limits, name, _mapping(resources.get("limits")))
    _bound_by_status(requests, status)
    priority = spec.get("priority")
    return PodMeta(
        uid=_string(metadata.get("uid")),
        namespace=_string(metadata.get("namespace")),
        name=_string(metadata.get("name")),
        annotations=_string_map(metadata.get("annotations")),
        labels=_string_map(metadata.get("labels")),
        priority=priority if isinstance(priority, int) and not isinstance(priority, bool) else None,
        daemonset=_daemonset(metadata.get("ownerReferences")),
        memory_requests=MappingProxyType(requests),
        memory_limits=MappingProxyType(limits),
        deleted=deleted,
        terminating=metadata.get("deletionTimestamp") is not None,
        deletion_grace_s=_integer(metadata.get("deletionGracePeriodSeconds")),
    )


def _running_containers(spec: Mapping[str, Any]) -> list[Mapping[str, Any]]:
    """Regular containers plus sidecars (init containers with restartPolicy Always), which run
    for the pod's whole life; ordinary init containers are finished by the time pods settle."""
    found = [_mapping(c) for c in _list(spec.get("containers"))]
    found += [
        _mapping(c) for c in _list(spec.get("initContainers"))
        if _mapping(c).get("restartPolicy") == "Always"
    ]
    return found


def _bound_by_status(requests: dict[str, int], status: Mapping[str, Any]) -> None:
    """Each request at most what the status says kubelet gave the container. With in-place
    resize the spec holds what the pod's author asked for, which kubelet may not grant (an
    infeasible resize stays in the spec; the scheduler then counts the status's), while the
    status holds what kubelet allocated; a resize down counts from the spec at once."""
    for key in ("containerStatuses", "initContainerStatuses"):
        for container in (_mapping(c) for c in _list(status.get(key))):
            name = container.get("name")
            if not isinstance(name, str) or name not in requests:
                continue
            granted: dict[str, int] = {}
            _put_memory(granted, name, _mapping(
                _mapping(container.get("resources")).get("requests")))
            if name in granted:
                requests[name] = min(requests[name], granted[name])


def _put_memory(into: dict[str, int], name: str, resources: Mapping[str, Any]) -> None:
    quantity = resources.get("memory")
    if quantity is None:
        return
    try:
        value = parse_quantity(quantity)
    except ValueError:
        return
    # 0 is no request or limit, as to Kubernetes (its QoS class and kubelet's cgroups alike).
    if value > 0:
        into[name] = value


def _controller(refs: Any) -> Mapping[str, Any] | None:
    """The owner reference with ``controller: true`` (the API allows one at most)."""
    for ref in (_mapping(r) for r in _list(refs)):
        if ref.get("controller") is True:
            return ref
    return None


def _daemonset(refs: Any) -> OwnerRef | None:
    ref = _controller(refs)
    if ref is None or ref.get("kind") != "DaemonSet" \
            or ref.get("apiVersion") != DAEMONSET_API_VERSION:
        return None
    name, uid = _string(ref.get("name")), _string(ref.get("uid"))
    return OwnerRef(DAEMONSET_API_VERSION, "DaemonSet", name, uid) if name and uid else None


def _mapping(value: Any) -> Mapping[str, Any]:
    return value if isinstance(value, Mapping) else _EMPTY


def _list(value: Any) -> list[Any]:
    return value if isinstance(value, list) else []


def _integer(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def _string(value: Any) -> str:
    return value if isinstance(value, str) else ""


def _string_map(value: Any) -> Mapping[str, str]:
    entries = {
        k: v for k, v in _mapping(value).items() if isinstance(k, str) and isinstance(v, str)
    }
    return MappingProxyType(entries)
