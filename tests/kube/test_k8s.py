"""The Kubernetes side, with the real kubernetes client against a fake API server on loopback."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, replace
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
from kubernetes import client as k8s_client
from structlog.testing import capture_logs

from common.audit import AuditLog, MemoryAuditSink
from common.podmeta import PodMeta
from reconciler.kube import (
    NODE_UPDATE_ATTEMPTS,
    EvictionOutcome,
    KubeActions,
    KubernetesConfig,
    NodeOutcome,
    PodRef,
    PodWatcher,
    build_api_client,
    node_name,
)
from tests.support.fake_apiserver import (
    FakeApiServer,
    client_config,
    make_pod,
    write_kubeconfig,
)

# Upper bound for anything to arrive; tests never wait that long unless something is broken.
BOUND_S = 10.0


@pytest.fixture
def fake() -> Iterator[FakeApiServer]:
    with FakeApiServer() as server:
        yield server


@pytest.fixture
def cfg(tmp_path: Path, fake: FakeApiServer) -> KubernetesConfig:
    return client_config(tmp_path, fake, request_timeout_s=5.0, retry_max_s=0.2)


@dataclass
class Watching:
    queue: asyncio.Queue[PodMeta]
    stop: asyncio.Event
    task: asyncio.Task[None]

    async def next(self) -> PodMeta:
        return await asyncio.wait_for(self.queue.get(), BOUND_S)

    async def take(self, count: int) -> list[PodMeta]:
        return [await self.next() for _ in range(count)]


@asynccontextmanager
async def watching(
    api: Any, cfg: KubernetesConfig, node: str = "node-a"
) -> AsyncIterator[Watching]:
    queue: asyncio.Queue[PodMeta] = asyncio.Queue()
    stop = asyncio.Event()
    watcher = PodWatcher(api, cfg, node, initial_backoff_s=0.01)
    task = asyncio.create_task(watcher.run(queue.put_nowait, stop))
    try:
        yield Watching(queue, stop, task)
    finally:
        stop.set()
        await asyncio.wait_for(task, BOUND_S)


async def until(fake: FakeApiServer, predicate: Callable[[], bool]) -> None:
    await asyncio.to_thread(fake.wait_until, predicate, BOUND_S)


async def _until_true(predicate: Callable[[], bool]) -> None:
    """Polls a condition the event loop's side makes true, for at most BOUND_S."""
    for _ in range(int(BOUND_S / 0.01)):
        if predicate():
            return
        await asyncio.sleep(0.01)


def annotate(key: str, value: str) -> Callable[[dict[str, Any]], None]:
    def mutate(pod: dict[str, Any]) -> None:
        pod["metadata"]["annotations"][key] = value

    return mutate


# ---- configuration ------------------------------------------------------------------------------


def test_node_name_precedence() -> None:
    assert node_name(KubernetesConfig(node_name="cfg-node"), {"NODE_NAME": "env"}) == "cfg-node"
    assert node_name(KubernetesConfig(), {"NODE_NAME": "env-node"}) == "env-node"
    fallback = node_name(KubernetesConfig(), {})
    assert fallback
    assert fallback == fallback.lower()


def test_disabled_means_no_client() -> None:
    with capture_logs() as logs:
        assert build_api_client(KubernetesConfig(enabled=False)) is None
    assert [e["event"] for e in logs] == ["kubernetes_disabled"]


def test_no_credentials_degrade_with_one_warning(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    monkeypatch.delenv("KUBERNETES_SERVICE_PORT", raising=False)
    with capture_logs() as logs:
        client = build_api_client(KubernetesConfig(), {"HOME": str(tmp_path)})
    assert client is None
    warnings = [e for e in logs if e["log_level"] == "warning"]
    assert [e["event"] for e in warnings] == ["kubernetes_unavailable"]
    tried = warnings[0]["tried"]
    assert tried[0].startswith("in-cluster")
    assert str(tmp_path / ".kube" / "config") in tried[1]


def test_configured_kubeconfig_that_is_missing(tmp_path: Path) -> None:
    missing = tmp_path / "nope"
    with capture_logs() as logs:
        assert build_api_client(KubernetesConfig(kubeconfig=str(missing))) is None
    (warning,) = [e for e in logs if e["log_level"] == "warning"]
    assert str(missing) in warning["tried"][0]


@pytest.mark.parametrize(
    "content", ["{not yaml: [", "apiVersion: v1\nkind: Config\n", "clusters: 5\n"]
)
def test_broken_kubeconfig_degrades(tmp_path: Path, content: str) -> None:
    path = tmp_path / "kubeconfig"
    path.write_text(content)
    with capture_logs() as logs:
        assert build_api_client(KubernetesConfig(kubeconfig=str(path))) is None
    assert [e["event"] for e in logs if e["log_level"] == "warning"] == ["kubernetes_unavailable"]


@pytest.mark.parametrize("where", ["KUBECONFIG", "HOME"])
def test_default_kubeconfig(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, fake: FakeApiServer, where: str
) -> None:
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    fake.add_pod(make_pod("a"))
    (tmp_path / ".kube").mkdir()
    path = write_kubeconfig(tmp_path / ".kube" / "config", fake.url)
    environ = {"KUBECONFIG": str(path)} if where == "KUBECONFIG" else {"HOME": str(tmp_path)}
    client = build_api_client(KubernetesConfig(), environ)
    assert client is not None
    try:
        pods = k8s_client.CoreV1Api(client).list_pod_for_all_namespaces()
        assert [p.metadata.name for p in pods.items if p.metadata] == ["a"]
    finally:
        client.close()


# ---- pod watch ----------------------------------------------------------------------------------


async def test_list_then_watch_delivers_changes(
    fake: FakeApiServer, api: Any, cfg: KubernetesConfig
) -> None:
    fake.add_pod(make_pod("a", uid="uid-a", priority=10, owner_kind="ReplicaSet",
                          memory={"app": ("1Gi", "2Gi")}))
    fake.add_pod(make_pod("elsewhere", node="node-b"))
    fake.add_pod(make_pod("c", uid="uid-c"))
    async with watching(api, cfg) as w:
        first = await w.take(2)
        assert [m.name for m in first] == ["a", "c"]
        assert first[0] == PodMeta(
            uid="uid-a", namespace="default", name="a", annotations={}, labels={},
            priority=10,
            memory_requests={"app": 1 << 30}, memory_limits={"app": 2 << 30}, deleted=False,
        )
        fake.modify_pod("default", "a", annotate("qos.nri-qos.io/level", "reclaimed_cores"))
        modified = await w.next()
        assert modified.uid == "uid-a"
        assert not modified.deleted
        assert modified.annotations == {"qos.nri-qos.io/level": "reclaimed_cores"}
        fake.add_pod(make_pod("other-node", node="node-b"))
        fake.add_pod(make_pod("d"))
        assert (await w.next()).name == "d"
        fake.delete_pod("default", "c")
        gone = await w.next()
        assert (gone.uid, gone.deleted) == ("uid-c", True)
    (listed,) = fake.list_requests()
    assert listed.query["fieldSelector"] == "spec.nodeName=node-a"
    watch = fake.watch_requests()[0]
    assert watch.query["fieldSelector"] == "spec.nodeName=node-a"
    assert watch.query["resourceVersion"] == "4"  # the list's resourceVersion
    assert watch.query["timeoutSeconds"] == str(cfg.watch_timeout_s)


async def test_relist_after_gone_reports_pods_missed_meanwhile(
    fake: FakeApiServer, api: Any, cfg: KubernetesConfig
) -> None:
    fake.add_pod(make_pod("a"))
    fake.add_pod(make_pod("b", uid="uid-b"))
    async with watching(api, cfg) as w:
        await w.take(2)
        # b vanishes while its event is compacted away, then the stream ends: the watcher's
        # resourceVersion is too old now, so only a relist can tell that b is gone.
        fake.delete_pod("default", "b", silently=True)
        fake.compact()
        fake.end_watches()
        gone = await w.next()
        assert (gone.uid, gone.deleted) == ("uid-b", True)
        fake.add_pod(make_pod("c"))
        assert (await w.next()).name == "c"  # a was unchanged, so it was not reported again
    assert len(fake.list_requests()) == 2


async def test_relist_after_gone_status_of_the_watch_request(
    fake: FakeApiServer, api: Any, cfg: KubernetesConfig
) -> None:
    fake.add_pod(make_pod("a"))
    async with watching(api, cfg) as w:
        await w.next()
        await until(fake, lambda: fake.open_watches == 1)
        fake.fail_next("GET", "/api/v1/pods", 410)
        fake.end_watches()
        await until(fake, lambda: len(fake.list_requests()) == 2)
        fake.modify_pod("default", "a", annotate("k", "v"))
        assert (await w.next()).annotations == {"k": "v"}


async def test_reconnect_after_dropped_stream_resumes_without_relist(
    fake: FakeApiServer, api: Any, cfg: KubernetesConfig
) -> None:
    fake.add_pod(make_pod("a"))
    async with watching(api, cfg) as w:
        await w.next()
        added = fake.add_pod(make_pod("b"))
        assert (await w.next()).name == "b"
        fake.drop_watches()
        fake.add_pod(make_pod("c"))
        assert (await w.next()).name == "c"
        fake.delete_pod("default", "a")
        after = await w.next()  # no replay of b in between
        assert (after.name, after.deleted) == ("a", True)
    assert len(fake.list_requests()) == 1
    resumed = fake.watch_requests()[1]
    assert resumed.query["resourceVersion"] == added["metadata"]["resourceVersion"]


async def test_bookmark_moves_the_resume_point(
    fake: FakeApiServer, api: Any, cfg: KubernetesConfig
) -> None:
    fake.add_pod(make_pod("a"))
    async with watching(api, cfg) as w:
        await w.next()
        await until(fake, lambda: fake.open_watches == 1)
        fake.add_pod(make_pod("elsewhere", node="node-b"))
        mark = fake.bookmark()
        fake.end_watches()  # sends what is pending first, unlike drop_watches
        await until(fake, lambda: len(fake.watch_requests()) == 2)
        fake.add_pod(make_pod("b"))
        assert (await w.next()).name == "b"  # a bookmark is not a pod event
    assert fake.watch_requests()[1].query["resourceVersion"] == mark


async def test_server_timeout_renews_the_watch(
    fake: FakeApiServer, api: Any, cfg: KubernetesConfig
) -> None:
    short = replace(cfg, watch_timeout_s=1)
    async with watching(api, short) as w:
        await until(fake, lambda: len(fake.watch_requests()) >= 3)
        fake.add_pod(make_pod("late"))
        assert (await w.next()).name == "late"
    assert len(fake.list_requests()) == 1
    assert {r.query["timeoutSeconds"] for r in fake.watch_requests()} == {"1"}


async def test_watch_error_event_backs_off_and_resumes(
    fake: FakeApiServer, api: Any, cfg: KubernetesConfig
) -> None:
    fake.add_pod(make_pod("a"))
    async with watching(api, cfg) as w:
        await w.next()
        await until(fake, lambda: fake.open_watches == 1)
        fake.fail_next("GET", "/api/v1/pods", 500, count=2)
        fake.end_watches()
        await until(fake, lambda: len(fake.watch_requests()) >= 4)
        fake.add_pod(make_pod("b"))
        assert (await w.next()).name == "b"
    assert len(fake.list_requests()) == 1


async def test_list_failures_back_off_exponentially_then_recover(
    fake: FakeApiServer, api: Any, cfg: KubernetesConfig
) -> None:
    fake.add_pod(make_pod("a"))
    fake.fail_next("GET", "/api/v1/pods", 500, count=6)
    with capture_logs() as logs:
        async with watching(api, replace(cfg, retry_max_s=0.05)) as w:
            assert (await w.next()).name == "a"
    delays = [e["delay_s"] for e in logs if e["event"] == "pod_watch_retry"]
    assert delays == [0.01, 0.02, 0.04, 0.05, 0.05, 0.05]
    assert all("HTTP 500" in e["reason"] for e in logs if e["event"] == "pod_watch_retry")
    assert len(fake.list_requests()) == 7


async def test_watch_expiring_right_after_a_list_backs_off(
    fake: FakeApiServer, api: Any, cfg: KubernetesConfig
) -> None:
    fake.add_pod(make_pod("a"))
    fake.fail_next("GET", "/api/v1/pods", 410, count=3, watch_only=True)
    with capture_logs() as logs:
        async with watching(api, cfg) as w:
            assert (await w.next()).name == "a"
            await until(fake, lambda: fake.open_watches == 1)
    retries = [e for e in logs if e["event"] == "pod_watch_retry"]
    assert [e["reason"] for e in retries] == ["watch expired right after a list"] * 3
    assert [e["delay_s"] for e in retries] == [0.01, 0.02, 0.04]
    assert len(fake.list_requests()) == 4


async def test_failing_consumer_does_not_stop_the_watch(
    fake: FakeApiServer, api: Any, cfg: KubernetesConfig
) -> None:
    fake.add_pod(make_pod("bad"))
    fake.add_pod(make_pod("good"))
    seen: list[str] = []

    def consume(meta: PodMeta) -> None:
        if meta.name == "bad":
            raise RuntimeError("consumer bug")
        seen.append(meta.name)

    stop = asyncio.Event()
    with capture_logs() as logs:
        task = asyncio.create_task(PodWatcher(api, cfg, "node-a").run(consume, stop))
        await until(fake, lambda: fake.open_watches == 1)
        fake.add_pod(make_pod("later"))
        fake.modify_pod("default", "bad", annotate("k", "v"))
        fake.add_pod(make_pod("last"))
        await _until_true(lambda: "last" in seen)
        stop.set()
        await asyncio.wait_for(task, BOUND_S)
    assert seen == ["good", "later", "last"]
    assert [e["pod"] for e in logs if e["event"] == "pod_event_failed"] == ["default/bad"] * 2
    assert len(fake.list_requests()) == 1


async def test_bad_token_retries_and_delivers_nothing(tmp_path: Path) -> None:
    with FakeApiServer(token="right") as fake:
        fake.add_pod(make_pod("a"))
        path = write_kubeconfig(tmp_path / "kc", fake.url, token="wrong")
        cfg = KubernetesConfig(kubeconfig=str(path), retry_max_s=0.05)
        client = build_api_client(cfg)
        assert client is not None
        try:
            async with watching(client, cfg) as w:
                await until(fake, lambda: len(fake.list_requests()) >= 3)
                assert w.queue.empty()
        finally:
            client.close()
        assert {r.status for r in fake.requests()} == {401}
        assert fake.requests()[0].headers["authorization"] == "Bearer wrong"


async def test_token_is_sent(tmp_path: Path) -> None:
    with FakeApiServer(token="right") as fake:
        fake.add_pod(make_pod("a"))
        path = write_kubeconfig(tmp_path / "kc", fake.url, token="right")
        cfg = KubernetesConfig(kubeconfig=str(path))
        client = build_api_client(cfg)
        assert client is not None
        try:
            async with watching(client, cfg) as w:
                assert (await w.next()).name == "a"
        finally:
            client.close()


async def test_degraded_watcher_logs_once_and_waits_for_stop() -> None:
    stop = asyncio.Event()
    seen: list[PodMeta] = []
    with capture_logs() as logs:
        task = asyncio.create_task(PodWatcher(None, KubernetesConfig(), "n").run(seen.append, stop))
        for _ in range(5):
            await asyncio.sleep(0)
        assert not task.done()
        stop.set()
        await asyncio.wait_for(task, BOUND_S)
    assert [e["event"] for e in logs] == ["pod_watch_off"]
    assert seen == []


def _watch_threads() -> list[str]:
    return [t.name for t in threading.enumerate() if t.name.startswith("pod-watch-")]


async def test_stop_is_prompt_during_an_open_watch(
    fake: FakeApiServer, api: Any, cfg: KubernetesConfig
) -> None:
    long = replace(cfg, watch_timeout_s=3600, request_timeout_s=300)
    stop = asyncio.Event()
    task = asyncio.create_task(PodWatcher(api, long, "node-a").run(lambda _: None, stop))
    await until(fake, lambda: fake.open_watches == 1)
    stop.set()
    # The watch would run for an hour and the read timeout is longer still: only the
    # interruption of the stream can end the worker within the bound.
    await asyncio.wait_for(task, BOUND_S)
    await _until_true(lambda: not _watch_threads())
    assert _watch_threads() == []


async def test_cancelling_the_watcher_ends_its_thread(
    fake: FakeApiServer, api: Any, cfg: KubernetesConfig
) -> None:
    long = replace(cfg, watch_timeout_s=3600, request_timeout_s=300)
    task = asyncio.create_task(
        PodWatcher(api, long, "node-a").run(lambda _: None, asyncio.Event())
    )
    await until(fake, lambda: fake.open_watches == 1)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    await _until_true(lambda: not _watch_threads())
    assert _watch_threads() == []


async def test_stop_is_prompt_during_backoff(
    fake: FakeApiServer, api: Any, cfg: KubernetesConfig
) -> None:
    fake.fail_next("GET", "/api/v1/pods", 500, count=100)
    slow = replace(cfg, retry_max_s=600)
    stop = asyncio.Event()
    task = asyncio.create_task(
        PodWatcher(api, slow, "node-a", initial_backoff_s=600).run(lambda _: None, stop)
    )
    await until(fake, lambda: len(fake.list_requests()) == 1)
    stop.set()
    await asyncio.wait_for(task, BOUND_S)


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
