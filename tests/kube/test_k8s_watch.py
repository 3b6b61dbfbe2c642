"""The pod watch, with the real kubernetes client against a fake API server on loopback: list then
watch, relists, reconnects, bookmarks, backoff, and a prompt stop."""

from __future__ import annotations

import asyncio
import gc
import sys
import threading
from collections.abc import Callable, Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
from structlog.testing import capture_logs

from common.podmeta import PodMeta
from reconciler.kube import KubernetesConfig, PodWatcher, build_api_client
from tests.support.fake_apiserver import FakeApiServer, client_config, make_pod, write_kubeconfig
from tests.support.fake_apiserver_http import Handler, Recorded
from tests.support.k8s import BOUND_S, watching


# An API server that knows no node, unlike the suite's ``fake``: each module of these tests
# declares its own, as one in this folder's conftest would replace the suite's for its neighbours.
@pytest.fixture
def fake() -> Iterator[FakeApiServer]:
    with FakeApiServer() as server:
        yield server


@pytest.fixture
def cfg(tmp_path: Path, fake: FakeApiServer) -> KubernetesConfig:
    return client_config(tmp_path, fake, request_timeout_s=5.0, retry_max_s=0.2)


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


@pytest.mark.parametrize("garbage", [{"0": {}}, "pods", ["not a pod"]])
async def test_a_list_whose_items_are_not_pods_is_retried_and_reports_nothing_deleted(
    fake: FakeApiServer, api: Any, cfg: KubernetesConfig, monkeypatch: pytest.MonkeyPatch,
    garbage: Any,
) -> None:
    fake.add_pod(make_pod("a", uid="uid-a"))
    send = Handler._send_json
    garbled = [garbage]  # the next list answer only

    def sending(handler: Handler, record: Recorded, code: int, doc: Any,
                headers: dict[str, str] | None = None) -> None:
        if garbled and isinstance(doc, dict) and doc.get("kind") == "PodList":
            doc = {**doc, "items": garbled.pop()}
        send(handler, record, code, doc, headers)

    async with watching(api, cfg) as w:
        assert (await w.next()).uid == "uid-a"
        await until(fake, lambda: fake.open_watches == 1)
        monkeypatch.setattr(Handler, "_send_json", sending)
        fake.fail_next("GET", "/api/v1/pods", 410)
        fake.end_watches()
        await until(fake, lambda: len(fake.list_requests()) == 3)
        fake.add_pod(make_pod("c"))
        # a was never reported deleted, nor again: the next pod reported is c
        assert (await w.next()).name == "c"
    assert not garbled


async def test_a_watch_event_nested_too_deeply_is_refused_like_any_malformed_one(
    fake: FakeApiServer, api: Any, cfg: KubernetesConfig, monkeypatch: pytest.MonkeyPatch
) -> None:
    fake.add_pod(make_pod("a"))
    chunk = Handler._chunk
    deep = [b"[" * 10_000 + b"]" * 10_000 + b"\n"]  # the next pod event only

    def chunking(handler: Handler, doc: Any) -> None:
        if deep and isinstance(doc, dict) and doc.get("type") == "ADDED":
            data = deep.pop()
            handler.wfile.write(f"{len(data):x}\r\n".encode() + data + b"\r\n")
            return
        chunk(handler, doc)

    async with watching(api, cfg) as w:
        assert (await w.next()).name == "a"
        await until(fake, lambda: fake.open_watches == 1)
        monkeypatch.setattr(Handler, "_chunk", chunking)
        fake.add_pod(make_pod("b"))
        # The watcher's task lives through it and catches up with what it missed.
        assert (await w.next()).name == "b"
    assert not deep


@pytest.mark.parametrize("bad", [b"{not json", b'{"type": "ADDED", "object": "not a pod"}',
                                 b'{"type": "ERROR", "object": {"code": 500}}'])
async def test_a_malformed_watch_event_is_passed_by_a_relist_not_resumed_into_again(
    fake: FakeApiServer, api: Any, cfg: KubernetesConfig, monkeypatch: pytest.MonkeyPatch,
    bad: bytes,
) -> None:
    """The server sends the event again to every watch resumed from before it: a watch resumed
    from the last event seen would read it again and again."""
    fake.add_pod(make_pod("a"))
    chunk = Handler._chunk
    sent: list[str] = []

    def chunking(handler: Handler, doc: Any) -> None:
        if isinstance(doc, dict) and doc.get("type") == "ADDED" \
                and doc["object"]["metadata"]["name"] == "b":
            sent.append(handler.path)
            data = bad + b"\n"
            handler.wfile.write(f"{len(data):x}\r\n".encode() + data + b"\r\n")
            handler.wfile.flush()
            return
        chunk(handler, doc)

    with capture_logs() as logs:
        async with watching(api, cfg) as w:
            assert (await w.next()).name == "a"
            await until(fake, lambda: fake.open_watches == 1)
            monkeypatch.setattr(Handler, "_chunk", chunking)
            fake.add_pod(make_pod("b"))
            assert (await w.next()).name == "b"  # from the list that follows
            fake.add_pod(make_pod("c"))
            assert (await w.next()).name == "c"
    assert len(sent) == 1
    assert len(fake.list_requests()) == 2
    (retry,) = [e for e in logs if e["event"] == "pod_watch_retry"]
    assert retry["reason"].startswith("malformed watch event, relisting: ")


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


async def test_a_watch_that_expires_after_delivering_events_relists_at_once(
    fake: FakeApiServer, api: Any, cfg: KubernetesConfig, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The first watch after a list delivers events, then the server says 410: the watch went
    somewhere, so it is not one that expired right after its list (the server unwell): the
    relist follows at once, not after the backoff grown by failures before the list."""
    fake.add_pod(make_pod("a"))
    fake.fail_next("GET", "/api/v1/pods", 500, count=2)  # the backoff grows before the list
    chunk = Handler._chunk

    def chunking(handler: Handler, doc: Any) -> None:
        if isinstance(doc, dict) and doc.get("type") == "ADDED" \
                and doc["object"]["metadata"]["name"] == "c":
            doc = {"type": "ERROR", "object": {"kind": "Status", "code": 410,
                                               "reason": "Expired", "message": "too old"}}
        chunk(handler, doc)

    monkeypatch.setattr(Handler, "_chunk", chunking)
    seen: asyncio.Queue[PodMeta] = asyncio.Queue()
    stop = asyncio.Event()
    watcher = PodWatcher(api, replace(cfg, retry_max_s=60), "node-a", initial_backoff_s=0.5)
    with capture_logs() as logs:
        task = asyncio.create_task(watcher.run(seen.put_nowait, stop))
        try:
            assert (await asyncio.wait_for(seen.get(), BOUND_S)).name == "a"
            await until(fake, lambda: fake.open_watches == 1)
            fake.add_pod(make_pod("b"))
            assert (await asyncio.wait_for(seen.get(), BOUND_S)).name == "b"
            fake.add_pod(make_pod("c"))
            # The backoff stands at 2 s after the failed lists; the relist comes before.
            assert (await asyncio.wait_for(seen.get(), 1.5)).name == "c"
        finally:
            stop.set()
            await asyncio.wait_for(task, BOUND_S)
    assert len(fake.list_requests()) == 4
    assert [e["event"] for e in logs if e["event"].startswith("pod_watch")] == [
        "pod_watch_retry", "pod_watch_retry", "pod_watch_expired"]


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
    problems: list[str] = []
    asyncio.get_running_loop().set_exception_handler(
        lambda loop, context: problems.append(context["message"]))
    stop.set()
    # The watch would run for an hour and the read timeout is longer still: only the
    # interruption of the stream can end the worker within the bound.
    await asyncio.wait_for(task, BOUND_S)
    await _until_true(lambda: not _watch_threads())
    assert _watch_threads() == []
    # The interrupted read's error is the stop's doing: consumed, never "never retrieved".
    await asyncio.sleep(0)
    gc.collect()
    assert problems == []


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


def test_a_watch_answered_after_the_loop_ended_is_closed(
    fake: FakeApiServer, api: Any, cfg: KubernetesConfig
) -> None:
    # The agent's loop can end while a watch request is still unanswered: the answer arriving
    # afterwards has nobody left on the loop to close it, so the worker thread must.
    fake.delay_next("GET", "/api/v1/pods", 0.5, count=2)
    long = replace(cfg, watch_timeout_s=3600, request_timeout_s=300)

    async def stop_while_the_watch_is_unanswered() -> None:
        stop = asyncio.Event()
        task = asyncio.create_task(PodWatcher(api, long, "node-a").run(lambda _: None, stop))
        await until(fake, lambda: len(fake.watch_requests()) == 1)
        stop.set()
        await asyncio.wait_for(task, BOUND_S)

    unraisable: list[Any] = []
    hook = sys.unraisablehook
    sys.unraisablehook = unraisable.append
    try:
        asyncio.run(stop_while_the_watch_is_unanswered())
        fake.wait_until(lambda: not _watch_threads(), BOUND_S)
        gc.collect()
    finally:
        sys.unraisablehook = hook
    assert [u.exc_value for u in unraisable] == []
