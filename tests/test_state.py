"""Node state: NRI events and Synchronize, the pod watch's metadata, snapshots and wake-ups."""

from __future__ import annotations

import asyncio
import threading
from types import MappingProxyType

from hooks.model import ContainerInfo, PodInfo, RuntimeInfo
from nri_plugin.chain import ContainerEvent, PodEvent
from nri_plugin.events import Event
from reconciler.podmeta import PodMeta
from reconciler.state import NodeState, StateTracker

RT = RuntimeInfo()


def pod(n: int, **kw: object) -> PodInfo:
    return PodInfo(id=f"s{n}", uid=f"uid-{n}", name=f"p{n}", namespace="ns", **kw)  # type: ignore[arg-type]


def ctr(n: int, m: int = 0, **kw: object) -> ContainerInfo:
    return ContainerInfo(id=f"c{n}-{m}", pod_sandbox_id=f"s{n}", name=f"c{m}", **kw)  # type: ignore[arg-type]


def meta(n: int, **kw: object) -> PodMeta:
    fields: dict[str, object] = dict(
        uid=f"uid-{n}", namespace="ns", name=f"p{n}", annotations={}, labels={},
        priority=None, owner_kind=None, memory_requests={}, memory_limits={})
    fields.update(kw)
    return PodMeta(**fields)  # type: ignore[arg-type]


def test_synchronize_then_events() -> None:
    state = NodeState()
    tracker = StateTracker(state)
    tracker.synchronize([pod(1), pod(2)], [ctr(1), ctr(2), ctr(9)])  # c9: pod unknown
    snap = state.snapshot()
    assert sorted(c.info.id for c in snap.containers) == ["c1-0", "c2-0"]
    assert snap.pod_uids == {"uid-1", "uid-2"}

    tracker.run_pod_sandbox(PodEvent(pod(3), "shared_cores", RT))
    tracker.create_container(ContainerEvent(pod(3), ctr(3), "shared_cores", RT))
    tracker.observe(Event.START_CONTAINER, pod(3), ctr(3))
    tracker.observe(Event.STOP_CONTAINER, pod(1), ctr(1))
    snap = state.snapshot()
    assert sorted(c.info.id for c in snap.running()) == ["c2-0", "c3-0"]

    tracker.observe(Event.REMOVE_CONTAINER, pod(2), ctr(2))
    tracker.remove_pod_sandbox(PodEvent(pod(1), "shared_cores", RT))
    snap = state.snapshot()
    assert sorted(c.info.id for c in snap.containers) == ["c3-0"]
    assert snap.pod_uids == {"uid-2", "uid-3"}


def test_tracker_subscribes_to_every_lifecycle_event() -> None:
    tracker = StateTracker(NodeState())
    for event in (Event.RUN_POD_SANDBOX, Event.REMOVE_POD_SANDBOX, Event.CREATE_CONTAINER,
                  Event.START_CONTAINER, Event.UPDATE_CONTAINER, Event.STOP_CONTAINER,
                  Event.REMOVE_CONTAINER):
        assert event in tracker.events
    assert tracker.create_container(ContainerEvent(pod(1), ctr(1), "x", RT)).is_empty()


def test_resynchronize_replaces_everything() -> None:
    state = NodeState()
    state.replace_all([pod(1)], [ctr(1)])
    state.replace_all([pod(2)], [ctr(2)])
    assert [c.info.id for c in state.snapshot().containers] == ["c2-0"]


def test_snapshot_is_cached_until_a_change() -> None:
    state = NodeState()
    state.replace_all([pod(1)], [ctr(1)])
    first = state.snapshot()
    assert state.snapshot() is first
    state.apply_meta(meta(1, priority=5))
    assert state.snapshot() is not first
    again = state.snapshot()
    state.apply_meta(meta(1, priority=5))  # same content: no change
    assert state.snapshot() is again


def test_pod_watch_metadata_overrides_nri() -> None:
    state = NodeState()
    state.replace_all([pod(1, annotations=MappingProxyType({"a": "old", "gone": "x"}))],
                      [ctr(1, memory_limit=100)])
    state.apply_meta(meta(1, annotations={"a": "new"}, labels={"l": "1"}, priority=1000,
                          memory_requests={"c0": 50}, memory_limits={"c0": 999}))
    snap = state.snapshot()
    view = snap.containers[0]
    assert dict(view.pod.info.annotations) == {"a": "new"}
    assert dict(view.pod.info.labels) == {"l": "1"}
    assert view.pod.info.priority == 1000
    assert view.info.memory_request == 50
    assert view.info.memory_limit == 100  # the runtime's limit is what is enforced
    assert view.pod.meta is not None
    assert view.pod.meta.priority == 1000

    state.apply_meta(meta(1, deleted=True))
    view = state.snapshot().containers[0]
    assert dict(view.pod.info.annotations) == {"a": "old", "gone": "x"}
    assert view.pod.meta is None


def test_metadata_before_the_pod_arrives_applies_later() -> None:
    state = NodeState()
    state.apply_meta(meta(7, priority=3))
    state.replace_all([pod(7)], [ctr(7)])
    assert state.snapshot().containers[0].pod.info.priority == 3


def test_subscriptions_filter_by_event_and_meta() -> None:
    state = NodeState()
    calls: list[str] = []
    stop_sub = state.subscribe(lambda: calls.append("start"), events=frozenset({
        Event.START_CONTAINER}))
    state.subscribe(lambda: calls.append("meta"), meta=True)
    tracker = StateTracker(state)
    tracker.observe(Event.START_CONTAINER, pod(1), ctr(1))
    tracker.observe(Event.STOP_CONTAINER, pod(1), ctr(1))
    state.apply_meta(meta(1, priority=1))
    assert calls == ["start", "meta"]
    tracker.synchronize([], [])
    assert calls == ["start", "meta", "start", "meta"]
    stop_sub()
    tracker.observe(Event.START_CONTAINER, pod(1), ctr(1))
    assert calls == ["start", "meta", "start", "meta"]


def test_concurrent_writers_from_threads() -> None:
    state = NodeState()
    tracker = StateTracker(state)

    def worker(base: int) -> None:
        for i in range(200):
            n = base + i
            tracker.create_container(ContainerEvent(pod(n), ctr(n), "x", RT))
            state.snapshot()

    threads = [threading.Thread(target=worker, args=(k * 1000,)) for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(state.snapshot().containers) == 800


async def test_event_in_a_worker_thread_wakes_the_event_loop() -> None:
    state = NodeState()
    running = asyncio.get_running_loop()
    wake = asyncio.Event()

    def set_wake() -> None:
        running.call_soon_threadsafe(wake.set)

    state.subscribe(set_wake, events=frozenset({Event.START_CONTAINER}))
    tracker = StateTracker(state)
    await asyncio.to_thread(tracker.observe, Event.START_CONTAINER, pod(1), ctr(1))
    await asyncio.wait_for(wake.wait(), timeout=5)
