"""Faults on the Kubernetes API's side, each with the outcome the agent promises.

The API server is down when the agent starts, or goes down while the pod watch is open; an
eviction meets an outage, throttling (429 without a disruption budget), a server error or a
timeout; a taint is asked for while the API is down. The real kubernetes client against the
fake API server on loopback, which refuses connections while it is down and keeps its state
(as etcd does) for when it comes back. The watch stream cut in the middle is
``tests/kube/test_k8s_watch.py::test_reconnect_after_dropped_stream_resumes_without_relist``.
"""

from __future__ import annotations

import asyncio
from collections.abc import MutableMapping
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
from structlog.testing import capture_logs

from common.audit import AuditLog, MemoryAuditSink
from common.podmeta import PodMeta
from reconciler.kube import (
    EvictionOutcome,
    KubeActions,
    KubernetesConfig,
    NodeOutcome,
    PodWatcher,
)
from tests.support.eviction_env import NODE, forced, make_env
from tests.support.fake_apiserver import (
    FakeApiServer,
    client_config,
    make_pod,
)

BOUND_S = 10.0


@pytest.fixture
def cfg(tmp_path: Path, fake: FakeApiServer) -> KubernetesConfig:
    return client_config(tmp_path, fake, request_timeout_s=2.0, retry_max_s=0.05)


async def watch_until(api: Any, cfg: KubernetesConfig, names: set[str],
                      during: Any = None) -> list[PodMeta]:
    """Run the pod watch until every pod in ``names`` was delivered; ``during`` (a coroutine
    function taking the delivered list) runs alongside."""
    delivered: list[PodMeta] = []
    stop = asyncio.Event()
    watcher = PodWatcher(api, cfg, NODE, initial_backoff_s=0.01)
    task = asyncio.create_task(watcher.run(delivered.append, stop))
    try:
        async with asyncio.timeout(BOUND_S):
            if during is not None:
                await during(delivered)
            while not names <= {m.name for m in delivered}:  # noqa: ASYNC110
                await asyncio.sleep(0.01)  # the watcher's thread delivers
    finally:
        stop.set()
        await asyncio.wait_for(task, BOUND_S)
    return delivered


async def test_an_api_server_down_at_start_is_waited_for(
    fake: FakeApiServer, api: Any, cfg: KubernetesConfig,
) -> None:
    fake.add_pod(make_pod("a"))
    fake.go_down()

    async def outage(_: list[PodMeta]) -> None:
        while len(retries(logs)) < 3:  # noqa: ASYNC110 (the retries are what is waited for)
            await asyncio.sleep(0.01)
        fake.come_back()

    with capture_logs() as logs:
        delivered = await watch_until(api, cfg, {"a"}, outage)
    # Connection refused while down: retried with the backoff (capped at retry_max_s), the
    # reason in each line; then one list delivers what is there.
    failed = retries(logs)
    assert all("Connection refused" in e["reason"] for e in failed[:3]), failed
    assert all(e["delay_s"] <= cfg.retry_max_s for e in failed)
    assert [m.name for m in delivered] == ["a"]
    assert len(fake.list_requests()) == 1


def retries(logs: list[MutableMapping[str, Any]]) -> list[MutableMapping[str, Any]]:
    return [e for e in logs if e["event"] == "pod_watch_retry"]


async def test_an_api_server_that_goes_down_under_an_open_watch_is_resumed(
    fake: FakeApiServer, api: Any, cfg: KubernetesConfig,
) -> None:
    fake.add_pod(make_pod("a"))

    async def outage(delivered: list[PodMeta]) -> None:
        while not delivered:  # noqa: ASYNC110
            await asyncio.sleep(0.01)
        await asyncio.to_thread(fake.wait_until, lambda: fake.open_watches == 1, BOUND_S)
        fake.go_down()  # the open watch is cut, and reconnecting is refused
        fake.add_pod(make_pod("b"))  # what changes meanwhile is kept by the server
        while not retries(logs):  # noqa: ASYNC110
            await asyncio.sleep(0.01)
        fake.come_back()

    with capture_logs() as logs:
        delivered = await watch_until(api, cfg, {"a", "b"}, outage)
    assert [m.name for m in delivered] == ["a", "b"]
    # Resumed from where it was: one list in all, no pod delivered twice.
    assert len(fake.list_requests()) == 1


async def test_an_eviction_during_an_outage_fails_and_is_made_once_when_the_api_is_back(
    tmp_path: Path, fake: FakeApiServer,
) -> None:
    env = make_env(tmp_path, fake, rate_burst=10)
    env.add_pod("batch", fake=fake)
    forced(env, "batch")
    fake.go_down()
    assert await env.round() == [("batch/batch", "failed")]
    (blocked,) = env.sink.named("eviction_blocked")
    assert blocked["reason"].startswith("transport:")
    fake.come_back()
    env.clock.now += 4.9  # within the 5 s backoff: not asked again
    assert await env.round() == []
    env.clock.now += 0.1
    assert await env.round() == [("batch/batch", "evicted")]
    env.clock.now += 60
    assert await env.round() == []
    assert env.audited("eviction_done") == ["batch/batch"]
    posts = [r for r in fake.requests("POST") if r.path.endswith("/eviction")]
    assert [r.status for r in posts] == [201]


async def test_a_throttled_eviction_is_blocked_not_a_budget_and_retried(
    tmp_path: Path, fake: FakeApiServer,
) -> None:
    env = make_env(tmp_path, fake, rate_burst=1)
    env.add_pod("first", fake=fake)
    env.add_pod("second", fake=fake)
    fake.fail_next("POST", "/api/v1/namespaces/batch/pods/first/eviction", 429)
    forced(env, "first")
    assert await env.round() == [("batch/first", "blocked")]
    (blocked,) = env.sink.named("eviction_blocked")
    assert blocked["status"] == 429
    assert blocked["reason"] == ("throttled by the API server: Too many requests, please try "
                                 "again later.")
    # Nothing was evicted: the only token is still there for the next pod, once the
    # throttling's Retry-After (1 s) is over.
    forced(env, "second")
    assert await env.round() == [("batch/second", "throttled")]
    env.clock.now += 1
    assert await env.round() == [("batch/second", "evicted")]
    forced(env, "first")
    env.clock.now += 5 + 10  # past the backoff, and a token is back
    assert await env.round() == [("batch/first", "evicted")]


async def test_a_budget_refusal_still_says_so(tmp_path: Path, fake: FakeApiServer) -> None:
    env = make_env(tmp_path, fake, rate_burst=1)
    env.add_pod("db", fake=fake)
    fake.block_eviction("batch", "db")
    forced(env, "db")
    assert await env.round() == [("batch/db", "blocked")]
    (blocked,) = env.sink.named("eviction_blocked")
    assert blocked["reason"].startswith("disruption budget: Cannot evict pod")


@pytest.mark.parametrize(("trouble", "detail"), [
    ("500", "API error: injected failure 500"),
    ("timeout", "transport:"),
])
async def test_a_server_error_or_timeout_fails_the_eviction(
    fake: FakeApiServer, api: Any, cfg: KubernetesConfig, trouble: str, detail: str,
) -> None:
    fake.add_pod(make_pod("p"))
    path = "/api/v1/namespaces/default/pods/p/eviction"
    if trouble == "500":
        fake.fail_next("POST", path, 500)
    else:
        fake.delay_next("POST", path, 3.0)
    sink = MemoryAuditSink()
    actions = KubeActions(api, replace(cfg, request_timeout_s=0.3), AuditLog(sink))
    result = await actions.evict("default", "p", None, False)
    assert result.outcome is EvictionOutcome.FAILED
    (blocked,) = sink.named("eviction_blocked")
    assert blocked["reason"].startswith(detail)


async def test_a_taint_asked_for_during_an_outage_fails_and_can_be_asked_again(
    fake: FakeApiServer, api: Any, cfg: KubernetesConfig,
) -> None:
    sink = MemoryAuditSink()
    actions = KubeActions(api, cfg, AuditLog(sink))
    fake.go_down()
    with capture_logs() as logs:
        outcome = await actions.add_taint(NODE, "nri-qos.io/pressure", "", "NoSchedule")
    assert outcome is NodeOutcome.FAILED
    (failed,) = [e for e in logs if e["event"] == "taint_failed"]
    assert "Connection refused" in failed["reason"]
    assert sink.named("taint_added") == []
    fake.come_back()
    assert await actions.add_taint(NODE, "nri-qos.io/pressure", "",
                                   "NoSchedule") is NodeOutcome.CHANGED
    assert fake.taints(NODE) == [{"key": "nri-qos.io/pressure", "effect": "NoSchedule"}]
