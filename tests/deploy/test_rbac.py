"""The ClusterRole grants exactly what the code asks of the API server, seen from the server.

Every public function and method of ``reconciler.kube`` (the only package that talks to the API
server) is driven against the fake API server; each request it received is turned into the
(API group, resource, verb) the API server's authorizer would check, and the set is compared
with the rules of ``deploy/kustomize/base/rbac.yaml`` in both directions. A public method added
to what the package exports without a driver here fails the test.
"""

from __future__ import annotations

import asyncio
import inspect
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from common.audit import AuditLog, MemoryAuditSink
from common.podmeta import OwnerRef, PodMeta
from reconciler import kube
from reconciler.kube import (
    KubeActions,
    KubernetesConfig,
    PodRef,
    PodWatcher,
    build_api_client,
    node_name,
)
from tests.support.fake_apiserver import FakeApiServer, make_pod, write_kubeconfig
from tests.support.fake_apiserver_http import Recorded
from tests.support.paths import REPO

RBAC = REPO / "deploy" / "kustomize" / "base" / "rbac.yaml"
NODE = "node-a"
Permission = tuple[str, str, str]  # (API group, resource[/subresource], verb)


@dataclass
class Drive:
    fake: FakeApiServer
    cfg: KubernetesConfig
    api: Any = None
    node: str = ""
    seen: list[PodMeta] = field(default_factory=list)

    def actions(self) -> KubeActions:
        return KubeActions(self.api, self.cfg, AuditLog(MemoryAuditSink()))


async def _build_api_client(d: Drive) -> None:
    d.api = build_api_client(d.cfg)


async def _send(d: Drive) -> None:
    # The raw request under every other one; here what reading this node's taints sends.
    d.api.send("GET", f"/api/v1/nodes/{NODE}", headers={}, body=None, timeout=5.0).read()


async def _close(d: Drive) -> None:
    d.api.close()


async def _node_name(d: Drive) -> None:
    d.node = node_name(d.cfg)


async def _watch(d: Drive) -> None:
    stop = asyncio.Event()
    task = asyncio.create_task(PodWatcher(d.api, d.cfg, d.node).run(d.seen.append, stop))
    async with asyncio.timeout(10):
        while d.fake.open_watches < 1:  # noqa: ASYNC110 - the server's threads open it
            await asyncio.sleep(0.01)
    stop.set()
    await task


async def _known(d: Drive) -> None:
    assert PodWatcher(d.api, d.cfg, d.node).known() == ()  # no call of its own


async def _evict(d: Drive) -> None:
    await d.actions().evict("default", "p1", None, dry_run=True)
    # A uid precondition that does not hold: the 409 has the pod read back.
    await d.actions().evict("default", "p1", None, dry_run=True, uid="not-p1")
    await d.actions().evict("default", "p1", 30, dry_run=False)


async def _add_taint(d: Drive) -> None:
    await d.actions().add_taint(d.node, "nri-qos.io/memory-pressure", "", "NoSchedule")


async def _remove_taint(d: Drive) -> None:
    await d.actions().remove_taint(d.node, "nri-qos.io/memory-pressure")


async def _set_node_condition(d: Drive) -> None:
    await d.actions().set_node_condition(d.node, "NriQosSystemMemoryPressure", True,
                                         "NriQosThresholdMet", "free below the watermark")


async def _create_pod_event(d: Drive) -> None:
    await d.actions().create_pod_event(PodRef("default", "p1", "uid-p1"), d.node, "Evicted",
                                       "memory pressure")


async def _remove_node_condition(d: Drive) -> None:
    await d.actions().set_node_condition(d.node, "NriQosSystemMemoryPressure", False,
                                         "NriQosThresholdNotMet", "")
    await d.actions().remove_node_condition(d.node, "NriQosSystemMemoryPressure")


async def _owner_exists(d: Drive) -> None:
    await d.actions().owner_exists("default", OwnerRef("apps/v1", "DaemonSet", "ds", "uid-ds"))


DRIVERS: dict[str, Callable[[Drive], Awaitable[None]]] = {
    "build_api_client": _build_api_client,
    "node_name": _node_name,
    "PodWatcher.run": _watch,
    "PodWatcher.known": _known,
    "KubeActions.evict": _evict,
    "KubeActions.add_taint": _add_taint,
    "KubeActions.remove_taint": _remove_taint,
    "KubeActions.set_node_condition": _set_node_condition,
    "KubeActions.create_pod_event": _create_pod_event,
    "KubeActions.owner_exists": _owner_exists,
    "KubeActions.remove_node_condition": _remove_node_condition,
    "Api.send": _send,
    "Api.close": _close,
}
"""Every public function and method of reconciler.kube, in an order that works (the client
first, closing it last)."""


def public_api() -> set[str]:
    found: set[str] = set()
    for name in kube.__all__:
        obj = getattr(kube, name)
        if not getattr(obj, "__module__", "").startswith(f"{kube.__name__}."):
            continue
        if inspect.isfunction(obj):
            found.add(name)
        elif inspect.isclass(obj):
            found.update(f"{name}.{member}" for member, value in vars(obj).items()
                         if not member.startswith("_") and inspect.isfunction(value))
    return found


def permission(request: Recorded) -> Permission:
    """What the API server's authorizer checks for a request (``/api/v1`` or
    ``/apis/<group>/<version>``)."""
    parts = [p for p in request.path.split("/") if p]
    if parts[:1] == ["apis"]:
        group, rest = parts[1], parts[3:]
    else:
        assert parts[:2] == ["api", "v1"], f"not an API request: {request.path}"
        group, rest = "", parts[2:]
    if rest[:1] == ["namespaces"] and len(rest) > 2:
        rest = rest[2:]
    resource, name, sub = [*rest, None, None][:3]
    assert resource is not None
    verb = {"POST": "create", "PATCH": "patch", "PUT": "update"}.get(request.method)
    if request.method == "GET":
        verb = "get" if name else "watch" if request.query.get("watch") == "true" else "list"
    elif request.method == "DELETE":
        verb = "delete" if name else "deletecollection"
    assert verb is not None, request.method
    return (group, f"{resource}/{sub}" if sub else resource, verb)


def granted() -> set[Permission]:
    (role,) = [d for d in yaml.safe_load_all(RBAC.read_text()) if d["kind"] == "ClusterRole"]
    return {(group, resource, verb) for rule in role["rules"] for group in rule["apiGroups"]
            for resource in rule["resources"] for verb in rule["verbs"]}


def test_every_public_call_has_a_driver() -> None:
    assert public_api() == set(DRIVERS), (
        "drive each public function/method of reconciler.kube in DRIVERS, so its API calls "
        "are checked against the ClusterRole")


async def test_cluster_role_grants_exactly_what_the_code_uses(tmp_path: Path) -> None:
    with FakeApiServer() as fake:
        fake.add_node(NODE)
        fake.add_pod(make_pod("p1", node=NODE))
        cfg = KubernetesConfig(kubeconfig=str(write_kubeconfig(tmp_path / "kubeconfig", fake.url)),
                               node_name=NODE, request_timeout_s=5.0, retry_max_s=0.2)
        drive = Drive(fake, cfg)
        try:
            for run in DRIVERS.values():
                await run(drive)
        finally:
            if drive.api is not None:
                drive.api.close()
        used = {permission(r) for r in fake.requests()}
        assert drive.seen, "the watcher listed no pod"
        assert fake.taints(NODE) == []
    assert used == granted(), (f"used but not granted: {sorted(used - granted())}; "
                               f"granted but not used: {sorted(granted() - used)}")
