"""The agent's writes to Kubernetes, with the real kubernetes client against a fake API server on
loopback: evictions, taints, pod events and node conditions."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator, Mapping
from dataclasses import replace
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
from structlog.testing import capture_logs

from common.audit import AuditLog, MemoryAuditSink
from common.state import NodeState
from hooks.model import PodInfo
from reconciler.kube import (
    NODE_UPDATE_ATTEMPTS,
    EvictionOutcome,
    KubeActions,
    KubernetesConfig,
    NodeOutcome,
    PodRef,
)
from tests.support.fake_apiserver import FakeApiServer, client_config, make_pod
from tests.support.fake_apiserver_http import Handler, Recorded
from tests.support.k8s import watching


# An API server that knows no node, unlike the suite's ``fake``: each module of these tests
# declares its own, as one in this folder's conftest would replace the suite's for its neighbours.
@pytest.fixture
def fake() -> Iterator[FakeApiServer]:
    with FakeApiServer() as server:
        yield server


@pytest.fixture
def cfg(tmp_path: Path, fake: FakeApiServer) -> KubernetesConfig:
    return client_config(tmp_path, fake, request_timeout_s=5.0, retry_max_s=0.2)


# ---- eviction -----------------------------------------------------------------------------------


@pytest.fixture
def audit() -> MemoryAuditSink:
    return MemoryAuditSink()


@pytest.fixture
def actions(api: Any, cfg: KubernetesConfig, audit: MemoryAuditSink) -> KubeActions:
    return KubeActions(api, cfg, AuditLog(audit))


async def test_evict(fake: FakeApiServer, actions: KubeActions, audit: MemoryAuditSink) -> None:
    fake.add_pod(make_pod("batch", namespace="jobs"))
    result = await actions.evict("jobs", "batch", 30, False, reason="memory pressure")
    assert (result.outcome, result.status, result.dry_run) == (EvictionOutcome.EVICTED, 201, False)
    assert fake.pod("jobs", "batch") is None
    (post,) = fake.requests("POST")
    assert post.path == "/api/v1/namespaces/jobs/pods/batch/eviction"
    assert "dryRun" not in post.query
    assert post.body["metadata"] == {"name": "batch", "namespace": "jobs"}
    assert post.body["deleteOptions"]["gracePeriodSeconds"] == 30
    assert audit.named("eviction_requested") == [
        {"pod": "jobs/batch", "reason": "memory pressure", "dry_run": False}
    ]
    assert [r["pod"] for r in audit.named("eviction_done")] == ["jobs/batch"]


async def test_evict_dry_run(
    fake: FakeApiServer, actions: KubeActions, audit: MemoryAuditSink
) -> None:
    fake.add_pod(make_pod("batch"))
    result = await actions.evict("default", "batch", None, True)
    assert (result.outcome, result.dry_run) == (EvictionOutcome.EVICTED, True)
    assert fake.pod("default", "batch") is not None
    (post,) = fake.requests("POST")
    assert post.query["dryRun"] == "All"
    assert "deleteOptions" not in post.body
    assert audit.named("eviction_done")[0]["dry_run"] is True


async def test_evict_blocked_by_disruption_budget(
    fake: FakeApiServer, actions: KubeActions, audit: MemoryAuditSink
) -> None:
    fake.add_pod(make_pod("db"))
    fake.block_eviction("default", "db")
    result = await actions.evict("default", "db", None, False)
    assert (result.outcome, result.status) == (EvictionOutcome.BLOCKED, 429)
    assert "disruption budget" in result.message
    assert fake.pod("default", "db") is not None
    (blocked,) = audit.named("eviction_blocked")
    assert blocked["pod"] == "default/db"
    assert "disruption budget" in blocked["reason"]
    assert audit.named("eviction_done") == []


async def test_evict_unknown_pod_is_gone(actions: KubeActions, audit: MemoryAuditSink) -> None:
    result = await actions.evict("default", "ghost", None, False)
    assert (result.outcome, result.status) == (EvictionOutcome.GONE, 404)
    assert audit.named("eviction_gone") == [{"pod": "default/ghost", "status": 404}]
    assert audit.named("eviction_blocked") == []
    assert audit.named("eviction_done") == []


async def test_evict_timeout_fails_without_waiting_for_the_server(
    fake: FakeApiServer, api: Any, cfg: KubernetesConfig, audit: MemoryAuditSink
) -> None:
    fake.add_pod(make_pod("slow"))
    fake.delay_next("POST", "/api/v1/namespaces/default/pods/slow/eviction", 3.0)
    actions = KubeActions(api, replace(cfg, request_timeout_s=0.2), AuditLog(audit))
    started = asyncio.get_running_loop().time()
    result = await actions.evict("default", "slow", None, False)
    assert asyncio.get_running_loop().time() - started < 2.0
    assert (result.outcome, result.status) == (EvictionOutcome.FAILED, None)
    (blocked,) = audit.named("eviction_blocked")
    assert blocked["reason"].startswith("transport:")
    assert "timed out" in blocked["reason"].lower()


async def test_evict_server_error_fails(
    fake: FakeApiServer, actions: KubeActions, audit: MemoryAuditSink
) -> None:
    fake.add_pod(make_pod("p"))
    fake.fail_next("POST", "/api/v1/namespaces/", 500)
    result = await actions.evict("default", "p", None, False)
    assert (result.outcome, result.status) == (EvictionOutcome.FAILED, 500)
    assert "500" in audit.named("eviction_blocked")[0]["reason"]


async def test_actions_without_api(cfg: KubernetesConfig, audit: MemoryAuditSink) -> None:
    actions = KubeActions(None, cfg, AuditLog(audit))
    result = await actions.evict("default", "p", None, False)
    assert result.outcome is EvictionOutcome.UNAVAILABLE
    assert audit.named("eviction_blocked")[0]["reason"] == "no Kubernetes API access"
    assert await actions.add_taint("n", "k", "v", "NoSchedule") is NodeOutcome.UNAVAILABLE
    assert await actions.remove_taint("n", "k") is NodeOutcome.UNAVAILABLE


async def test_eviction_shows_in_the_watch(
    fake: FakeApiServer, api: Any, cfg: KubernetesConfig, actions: KubeActions
) -> None:
    fake.add_pod(make_pod("batch"))
    async with watching(api, cfg) as w:
        await w.next()
        await actions.evict("default", "batch", 1, False)
        gone = await w.next()
        assert (gone.name, gone.deleted) == ("batch", True)


async def test_an_eviction_names_the_pod_decided_upon_by_uid(
    fake: FakeApiServer, actions: KubeActions, audit: MemoryAuditSink
) -> None:
    fake.add_pod(make_pod("batch", uid="uid-new"))
    # The pod decided upon (uid-old) went and another came under its name: it stays.
    result = await actions.evict("default", "batch", None, False, uid="uid-old")
    assert (result.outcome, result.status) == (EvictionOutcome.GONE, 409)
    assert fake.pod("default", "batch") is not None
    (post,) = fake.requests("POST")
    assert post.body["deleteOptions"]["preconditions"] == {"uid": "uid-old"}
    assert "gracePeriodSeconds" not in post.body["deleteOptions"]
    assert [r["pod"] for r in audit.named("eviction_gone")] == ["default/batch"]
    result = await actions.evict("default", "batch", 5, False, uid="uid-new")
    assert result.outcome is EvictionOutcome.EVICTED
    assert fake.requests("POST")[-1].body["deleteOptions"] == {
        "gracePeriodSeconds": 5, "preconditions": {"uid": "uid-new"}}


async def test_the_records_of_an_eviction_name_the_pod_decided_upon_by_uid(
    fake: FakeApiServer, api: Any, cfg: KubernetesConfig, audit: MemoryAuditSink
) -> None:
    """The pod is evicted by uid; its records say that uid, not the one of another pod the node
    knows under its name (deleted and created again, the old sandbox not yet removed)."""
    state = NodeState()
    for sandbox, uid in (("s-old", "uid-old"), ("s-new", "uid-new")):
        state.pod_view(sandbox, lambda sandbox=sandbox, uid=uid: PodInfo(  # type: ignore[misc]
            id=sandbox, uid=uid, name="web-0", namespace="shop"))
    log = AuditLog(audit)

    def identity(fields: Mapping[str, Any]) -> Mapping[str, str]:
        found = state.pod_identity(uid=str(fields.get("pod_uid", "")),
                                   ref=str(fields.get("pod", "")))
        return {} if found is None else dict(zip(("pod_uid", "pod_namespace", "pod_name"),
                                                 found, strict=True))

    log.identify(identity)
    fake.add_pod(make_pod("web-0", namespace="shop", uid="uid-new"))
    actions = KubeActions(api, cfg, log)
    assert (await actions.evict("shop", "web-0", None, False, uid="uid-new")).outcome is \
        EvictionOutcome.EVICTED
    assert (await actions.evict("shop", "web-0", None, False, uid="uid-new")).outcome is \
        EvictionOutcome.GONE
    records = [(name, fields) for name, fields in audit.records if name.startswith("eviction_")]
    assert [name for name, _ in records] == ["eviction_requested", "eviction_done",
                                             "eviction_requested", "eviction_gone"]
    assert {(f["pod_uid"], f["pod_namespace"], f["pod_name"]) for _, f in records} == {
        ("uid-new", "shop", "web-0")}


@pytest.mark.parametrize("grace", [0, -1])
async def test_an_eviction_never_deletes_at_once(
    fake: FakeApiServer, actions: KubeActions, grace: int
) -> None:
    fake.add_pod(make_pod("batch"))
    with pytest.raises(ValueError, match=f"grace period {grace} s is below 1 s"):
        await actions.evict("default", "batch", grace, False)
    assert fake.requests("POST") == []
    assert (await actions.evict("default", "batch", 1, False)).outcome is \
        EvictionOutcome.EVICTED


# ---- taints -------------------------------------------------------------------------------------

KEY = "nri-qos.io/memory-pressure"
OTHER = {"key": "dedicated", "value": "db", "effect": "NoSchedule"}


async def test_taints_add_and_remove_idempotently(
    fake: FakeApiServer, actions: KubeActions, audit: MemoryAuditSink
) -> None:
    fake.add_node("node-a", taints=[OTHER])
    assert await actions.add_taint("node-a", KEY, "true", "NoSchedule", reason="pressure") is (
        NodeOutcome.CHANGED
    )
    assert fake.taints("node-a") == [OTHER, {"key": KEY, "value": "true", "effect": "NoSchedule"}]
    assert audit.named("taint_added") == [
        {"node": "node-a", "taint": f"{KEY}=true:NoSchedule", "reason": "pressure"}
    ]
    (patch,) = fake.requests("PATCH")
    assert patch.headers["content-type"] == "application/merge-patch+json"
    assert patch.body["metadata"]["resourceVersion"]

    assert await actions.add_taint("node-a", KEY, "true", "NoSchedule") is NodeOutcome.UNCHANGED
    assert len(fake.requests("PATCH")) == 1
    assert len(audit.named("taint_added")) == 1

    # Same key and effect, new value: replaced, not duplicated.
    assert await actions.add_taint("node-a", KEY, "high", "NoSchedule") is NodeOutcome.CHANGED
    assert fake.taints("node-a") == [OTHER, {"key": KEY, "value": "high", "effect": "NoSchedule"}]

    assert await actions.remove_taint("node-a", KEY, reason="calm") is NodeOutcome.CHANGED
    assert fake.taints("node-a") == [OTHER]
    assert audit.named("taint_removed") == [
        {"node": "node-a", "taint": f"{KEY}=high:NoSchedule", "reason": "calm"}
    ]
    assert await actions.remove_taint("node-a", KEY) is NodeOutcome.UNCHANGED
    assert len(fake.requests("PATCH")) == 3


async def test_taint_without_value(fake: FakeApiServer, actions: KubeActions) -> None:
    fake.add_node("node-a")
    assert await actions.add_taint("node-a", KEY, "", "NoExecute") is NodeOutcome.CHANGED
    assert fake.taints("node-a") == [{"key": KEY, "effect": "NoExecute"}]
    assert await actions.add_taint("node-a", KEY, "", "NoExecute") is NodeOutcome.UNCHANGED


async def test_taint_retries_on_conflict(
    fake: FakeApiServer, actions: KubeActions, audit: MemoryAuditSink
) -> None:
    fake.add_node("node-a")
    fake.conflict_next_patches(2)
    assert await actions.add_taint("node-a", KEY, "true", "NoSchedule") is NodeOutcome.CHANGED
    assert [r.status for r in fake.requests("PATCH")] == [409, 409, 200]
    assert len(fake.requests("GET", "/api/v1/nodes/node-a")) == 3
    assert len(audit.named("taint_added")) == 1


async def test_taint_gives_up_after_persistent_conflicts(
    fake: FakeApiServer, actions: KubeActions, audit: MemoryAuditSink
) -> None:
    fake.add_node("node-a")
    fake.conflict_next_patches(NODE_UPDATE_ATTEMPTS)
    assert await actions.add_taint("node-a", KEY, "true", "NoSchedule") is NodeOutcome.FAILED
    assert fake.taints("node-a") == []
    assert audit.named("taint_added") == []


async def test_taint_on_unknown_node_fails(actions: KubeActions) -> None:
    assert await actions.add_taint("nowhere", KEY, "x", "NoSchedule") is NodeOutcome.FAILED
    assert await actions.remove_taint("nowhere", KEY) is NodeOutcome.FAILED


async def test_taint_effect_is_checked(actions: KubeActions) -> None:
    with pytest.raises(ValueError, match="effect"):
        await actions.add_taint("node-a", KEY, "x", "Sometimes")


# ---- Events -------------------------------------------------------------------------------------


async def test_pod_event(fake: FakeApiServer, actions: KubeActions) -> None:
    pod = PodRef("jobs", "batch", "uid-1")
    assert await actions.create_pod_event(pod, "node-a", "NriQosEvicted", "plugin x: signal y")
    (event,) = fake.events()
    assert event["involvedObject"] == {"apiVersion": "v1", "kind": "Pod", "namespace": "jobs",
                                       "name": "batch", "uid": "uid-1"}
    assert (event["reason"], event["message"], event["type"]) == (
        "NriQosEvicted", "plugin x: signal y", "Warning")
    assert event["source"] == {"component": "nri-qos", "host": "node-a"}
    assert event["metadata"]["name"].startswith("batch.")
    assert event["metadata"]["namespace"] == "jobs"
    assert event["count"] == 1
    assert event["firstTimestamp"] == event["lastTimestamp"]
    stamp = datetime.fromisoformat(event["firstTimestamp"].replace("Z", "+00:00"))
    assert stamp.utcoffset() == timedelta(0)
    assert abs((datetime.now(UTC) - stamp).total_seconds()) < 60
    (post,) = fake.requests("POST")
    assert post.path == "/api/v1/namespaces/jobs/events"


async def test_pod_event_failure_is_logged_not_raised(
    fake: FakeApiServer, actions: KubeActions, cfg: KubernetesConfig
) -> None:
    fake.fail_next("POST", "/api/v1/namespaces/jobs/events", 500)
    with capture_logs() as logs:
        assert not await actions.create_pod_event(PodRef("jobs", "b", "u"), "n", "R", "m")
    assert [e["event"] for e in logs] == ["pod_event_failed"]
    assert fake.events() == []
    offline = KubeActions(None, cfg, AuditLog(MemoryAuditSink()))
    assert not await offline.create_pod_event(PodRef("jobs", "b", "u"), "n", "R", "m")


# ---- node conditions ----------------------------------------------------------------------------

KUBELET_READY = {"type": "Ready", "status": "True", "reason": "KubeletReady",
                 "message": "kubelet is posting ready status"}


async def test_node_condition_set_once_then_flipped(
    fake: FakeApiServer, actions: KubeActions
) -> None:
    fake.add_node("node-a", conditions=[KUBELET_READY])
    assert await actions.set_node_condition(
        "node-a", "NriQosSystemMemoryPressure", True, "NriQosThresholdMet", "free 1 < 2"
    ) is NodeOutcome.CHANGED
    conditions = fake.conditions("node-a")
    assert conditions["Ready"] == KUBELET_READY  # the other writers' conditions are kept
    mine = conditions["NriQosSystemMemoryPressure"]
    assert (mine["status"], mine["reason"], mine["message"]) == (
        "True", "NriQosThresholdMet", "free 1 < 2")
    assert mine["lastTransitionTime"] == mine["lastHeartbeatTime"]
    (patch,) = fake.requests("PATCH")
    assert patch.path == "/api/v1/nodes/node-a/status"
    assert patch.headers["content-type"] == "application/merge-patch+json"
    assert patch.body["metadata"]["resourceVersion"]

    # Unchanged: no write.
    assert await actions.set_node_condition(
        "node-a", "NriQosSystemMemoryPressure", True, "NriQosThresholdMet", "free 1 < 2"
    ) is NodeOutcome.UNCHANGED
    assert len(fake.requests("PATCH")) == 1

    # A new message alone is no reason to rewrite the node (it carries the observed value).
    assert await actions.set_node_condition(
        "node-a", "NriQosSystemMemoryPressure", True, "NriQosThresholdMet", "free 0 < 2"
    ) is NodeOutcome.UNCHANGED
    assert len(fake.requests("PATCH")) == 1

    # A new reason with the same status is written and keeps the transition time.
    fake_old = "2020-01-01T00:00:00Z"
    node = fake.node("node-a")
    with fake._lock:
        fake._state.nodes["node-a"]["status"]["conditions"][1]["lastTransitionTime"] = fake_old
    assert node["status"]["conditions"][1]["type"] == "NriQosSystemMemoryPressure"
    assert await actions.set_node_condition(
        "node-a", "NriQosSystemMemoryPressure", True, "NriQosKswapdActive", "free 0 < 2"
    ) is NodeOutcome.CHANGED
    assert fake.conditions("node-a")["NriQosSystemMemoryPressure"]["message"] == "free 0 < 2"
    assert fake.conditions("node-a")["NriQosSystemMemoryPressure"]["lastTransitionTime"] == (
        fake_old)

    assert await actions.set_node_condition(
        "node-a", "NriQosSystemMemoryPressure", False, "NriQosThresholdNotMet", "calm"
    ) is NodeOutcome.CHANGED
    flipped = fake.conditions("node-a")["NriQosSystemMemoryPressure"]
    assert flipped["status"] == "False"
    assert flipped["lastTransitionTime"] != fake_old
    assert fake.conditions("node-a")["Ready"] == KUBELET_READY


async def test_node_condition_retries_on_conflict(
    fake: FakeApiServer, actions: KubeActions
) -> None:
    fake.add_node("node-a")
    fake.conflict_next_patches(2)
    assert await actions.set_node_condition("node-a", "C", True, "R", "m") is NodeOutcome.CHANGED
    assert [r.status for r in fake.requests("PATCH")] == [409, 409, 200]
    fake.conflict_next_patches(NODE_UPDATE_ATTEMPTS)
    assert await actions.set_node_condition("node-a", "C", False, "R", "m") is NodeOutcome.FAILED
    assert fake.conditions("node-a")["C"]["status"] == "True"


async def test_node_condition_failures(
    fake: FakeApiServer, actions: KubeActions, cfg: KubernetesConfig
) -> None:
    assert await actions.set_node_condition("nowhere", "C", True, "R", "m") is NodeOutcome.FAILED
    fake.add_node("node-a")
    fake.fail_next("PATCH", "/api/v1/nodes/node-a/status", 500)
    assert await actions.set_node_condition("node-a", "C", True, "R", "m") is NodeOutcome.FAILED
    offline = KubeActions(None, cfg, AuditLog(MemoryAuditSink()))
    assert not offline.available
    assert await offline.set_node_condition("node-a", "C", True, "R", "m") is (
        NodeOutcome.UNAVAILABLE)


async def test_a_node_read_without_resource_version_is_never_written(
    fake: FakeApiServer, actions: KubeActions, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Without a resourceVersion the write would carry no precondition and could replace what
    another writer put on the node in between."""
    fake.add_node("node-a", conditions=[{"type": "Ready", "status": "True"}])
    send = Handler._send_json

    def sending(handler: Handler, record: Recorded, code: int, doc: Any,
                headers: dict[str, str] | None = None) -> None:
        if isinstance(doc, dict) and doc.get("kind") == "Node":
            doc = {**doc, "metadata": {"name": "node-a"}}
        send(handler, record, code, doc, headers)

    monkeypatch.setattr(Handler, "_send_json", sending)
    with capture_logs() as logs:
        assert await actions.set_node_condition("node-a", "C", True, "R", "m") is (
            NodeOutcome.FAILED)
        assert await actions.add_taint("node-a", "k", "v", "NoSchedule") is NodeOutcome.FAILED
    assert fake.requests("PATCH") == []
    assert [e["reason"] for e in logs if e["event"] in ("condition_failed", "taint_failed")] == [
        "ValueError: node has no metadata.resourceVersion"] * 2
