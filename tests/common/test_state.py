"""Node state: NRI events and Synchronize, the pod watch's metadata, snapshots and wake-ups."""

from __future__ import annotations

import asyncio
import dataclasses
import gc
import threading
from types import MappingProxyType

import pytest

from common.podmeta import PodMeta
from common.state import NodeState, PodView
from hooks.events import Event
from hooks.model import ContainerInfo, PodInfo
from hooks.qos_level import QosConfig, Refusal


def pod(n: int, **kw: object) -> PodInfo:
    return PodInfo(id=f"s{n}", uid=f"uid-{n}", name=f"p{n}", namespace="ns", **kw)  # type: ignore[arg-type]


def ctr(n: int, m: int = 0, **kw: object) -> ContainerInfo:
    return ContainerInfo(id=f"c{n}-{m}", pod_sandbox_id=f"s{n}", name=f"c{m}", **kw)  # type: ignore[arg-type]


def meta(n: int, **kw: object) -> PodMeta:
    fields: dict[str, object] = dict(
        uid=f"uid-{n}", namespace="ns", name=f"p{n}", annotations={}, labels={},
        priority=None, memory_requests={}, memory_limits={})
    fields.update(kw)
    return PodMeta(**fields)  # type: ignore[arg-type]


def started(state: NodeState, n: int, event: Event = Event.START_CONTAINER) -> None:
    """What the NRI stub does at a container event: the pod's view, then the container."""
    state.pod_view(f"s{n}", lambda: pod(n))
    state.put_container(f"s{n}", ctr(n), event, running=event is not Event.STOP_CONTAINER)


def test_synchronize_then_events() -> None:
    state = NodeState()
    state.replace_all([pod(1), pod(2)], [ctr(1), ctr(2), ctr(9)])  # c9: pod unknown
    snap = state.snapshot()
    assert sorted(c.info.id for c in snap.containers) == ["c1-0", "c2-0"]
    assert snap.pod_uids == {"uid-1", "uid-2"}

    state.pod_view("s3", lambda: pod(3))  # RunPodSandbox
    started(state, 3, Event.CREATE_CONTAINER)
    started(state, 3)
    started(state, 1, Event.STOP_CONTAINER)
    snap = state.snapshot()
    assert sorted(c.info.id for c in snap.running()) == ["c2-0", "c3-0"]

    state.remove_container(ctr(2), Event.REMOVE_CONTAINER)
    state.remove_pod("s1", Event.REMOVE_POD_SANDBOX)
    snap = state.snapshot()
    assert sorted(c.info.id for c in snap.containers) == ["c3-0"]
    assert snap.pod_uids == {"uid-2", "uid-3"}


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


def test_a_name_taken_again_is_the_pod_the_api_has_under_it() -> None:
    """A pod deleted and created again under its name (a StatefulSet's) has a new uid; until
    the runtime removes the old sandbox both are known, and a record naming the pod by
    namespace/name is about the one the API server has under that name now."""
    state = NodeState()
    old = PodInfo(id="s-old", uid="uid-old", name="web-0", namespace="shop")
    new = PodInfo(id="s-new", uid="uid-new", name="web-0", namespace="shop")
    state.pod_view("s-old", lambda: old)
    state.apply_meta(meta(0, uid="uid-old", namespace="shop", name="web-0"))
    assert state.pod_identity(ref="shop/web-0") == ("uid-old", "shop", "web-0")
    state.apply_meta(meta(0, uid="uid-old", namespace="shop", name="web-0", deleted=True))
    state.apply_meta(meta(0, uid="uid-new", namespace="shop", name="web-0"))
    state.pod_view("s-new", lambda: new)
    assert state.pod_identity(ref="shop/web-0") == ("uid-new", "shop", "web-0")
    assert state.pod_identity(uid="uid-old") == ("uid-old", "shop", "web-0")
    state.remove_pod("s-old", Event.REMOVE_POD_SANDBOX)
    assert state.pod_identity(ref="shop/web-0") == ("uid-new", "shop", "web-0")


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
    started(state, 1)
    started(state, 1, Event.STOP_CONTAINER)
    state.apply_meta(meta(1, priority=1))
    assert calls == ["start", "meta"]
    state.replace_all([], [])
    assert calls == ["start", "meta", "start", "meta"]
    stop_sub()
    started(state, 1)
    assert calls == ["start", "meta", "start", "meta"]


def test_concurrent_writers_from_threads() -> None:
    state = NodeState()

    def worker(base: int) -> None:
        for i in range(200):
            n = base + i
            started(state, n, Event.CREATE_CONTAINER)
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
    await asyncio.to_thread(started, state, 1)
    await asyncio.wait_for(wake.wait(), timeout=5)


# -- pod views: the one place a pod's level is decided ----------------------------------------

def katalyst(n: int, level: str = "reclaimed_cores") -> PodInfo:
    return pod(n, annotations=MappingProxyType({"katalyst.kubewharf.io/qos_level": level}),
               cgroup_parent=f"/kubepods/burstable/poduid-{n}")


def test_first_sight_converts_and_resolves() -> None:
    state = NodeState()
    view = state.pod_view("s1", lambda: katalyst(1))
    assert (view.info.id, view.info.uid, view.level, view.decision.source) == (
        "s1", "uid-1", "reclaimed_cores", "katalyst")
    assert state.snapshot().pods["s1"] is view


def test_later_events_reuse_the_view() -> None:
    state = NodeState()
    first = state.pod_view("s1", lambda: katalyst(1))
    # The same sandbox: what CRI fixed at creation cannot have changed; nothing is converted.
    assert state.pod_view("s1", lambda: pytest.fail("converted twice")) is first


def test_a_new_qos_section_resolves_again_with_the_same_pod() -> None:
    qos = QosConfig()
    state = NodeState(qos=lambda: qos)
    first = state.pod_view("s1", lambda: katalyst(1))
    assert first.decision.source == "katalyst"
    qos = dataclasses.replace(qos, sources=tuple(s for s in qos.sources if s != "katalyst"))
    second = state.pod_view("s1", lambda: katalyst(1))
    assert second.info is first.info
    assert (second.level, second.decision.source) == ("shared_cores", "kubernetes_qos")
    assert state.pod_view("s1", lambda: katalyst(1)) is second


def test_an_annotation_change_through_the_api_changes_the_level_for_both_appliers() -> None:
    state = NodeState()
    state.pod_view("s1", lambda: katalyst(1, "shared_cores"))
    state.apply_meta(meta(1, annotations={"katalyst.kubewharf.io/qos_level": "reclaimed_cores"}))
    assert state.pod_view("s1", lambda: katalyst(1)).level == "reclaimed_cores"
    assert state.snapshot().pods["s1"].level == "reclaimed_cores"


def guaranteed(n: int, level: str) -> PodInfo:
    return pod(n, annotations=MappingProxyType({"katalyst.kubewharf.io/qos_level": level}),
               cgroup_parent=f"/kubepods/poduid-{n}")


def test_an_api_update_never_raises_a_pod_above_its_level_at_creation() -> None:
    reports: list[tuple[str, Refusal]] = []
    state = NodeState(on_refused=lambda info, refusal: reports.append((info.uid, refusal)))
    # Guaranteed may claim dedicated_cores at creation, but not later through the API.
    assert state.pod_view("s1", lambda: guaranteed(1, "reclaimed_cores")).level == \
        "reclaimed_cores"
    claim = {"katalyst.kubewharf.io/qos_level": "dedicated_cores"}
    state.apply_meta(meta(1, annotations=claim))
    view = state.pod_view("s1", lambda: guaranteed(1, "reclaimed_cores"))
    assert view.level == "reclaimed_cores"
    assert state.snapshot().pods["s1"].level == "reclaimed_cores"
    refusal = Refusal("dedicated_cores", "katalyst",
                      "annotation katalyst.kubewharf.io/qos_level",
                      "above the level the pod had at creation (reclaimed_cores)")
    assert view.decision.refused == refusal
    # Reported once, however often the view is read or the metadata repeated.
    state.apply_meta(meta(1, annotations=claim, labels={"x": "y"}))
    state.snapshot()
    assert reports == [("uid-1", refusal)]
    # At the level of creation (or below) the API's copy is followed.
    state.apply_meta(meta(1, annotations={"katalyst.kubewharf.io/qos_level": "reclaimed_cores"}))
    assert state.snapshot().pods["s1"].decision.refused is None


def test_a_pod_created_at_a_level_keeps_it_when_the_api_repeats_it() -> None:
    state = NodeState()
    state.pod_view("s1", lambda: guaranteed(1, "dedicated_cores"))
    state.apply_meta(meta(1, annotations={"katalyst.kubewharf.io/qos_level": "dedicated_cores"}))
    assert state.snapshot().pods["s1"].level == "dedicated_cores"


def test_removed_pods_are_forgotten() -> None:
    state = NodeState()
    first = state.pod_view("s1", lambda: katalyst(1))
    state.pod_view("s2", lambda: katalyst(2))
    state.remove_pod("s1", Event.REMOVE_POD_SANDBOX)
    state.remove_pod("never-seen", Event.REMOVE_POD_SANDBOX)
    assert set(state.snapshot().pods) == {"s2"}
    assert state.pod_view("s1", lambda: katalyst(1)) is not first


def views_alive() -> set[str]:
    """Sandbox ids of every pod view still in memory."""
    gc.collect()
    return {o.info.id for o in gc.get_objects() if isinstance(o, PodView)}


def test_a_resync_forgets_the_pods_it_no_longer_lists() -> None:
    state = NodeState()
    for n in range(3):
        state.pod_view(f"s{n}", lambda n=n: pod(n))  # type: ignore[misc]
    state.snapshot()
    # The runtime comes back listing one of them (the others went while it was away).
    state.replace_all([pod(1)], [])
    state.snapshot()
    assert views_alive() == {"s1"}
    state.replace_all([], [])
    state.snapshot()  # (the last snapshot holds its views until the next one)
    assert views_alive() == set()


def test_a_view_worked_out_while_its_pod_goes_is_not_kept() -> None:
    state = NodeState()
    state.replace_all([pod(1)], [])
    # A snapshot taken from the pods as they were, worked out after a resync dropped them.
    gone = pod(2)
    state.replace_all([gone], [])
    state.replace_all([], [])
    state._view(gone)
    assert views_alive() == set()


def test_oldest_pushed_out_beyond_the_limit() -> None:
    state = NodeState(pod_limit=2)
    first = state.pod_view("s1", lambda: katalyst(1))
    state.pod_view("s2", lambda: katalyst(2))
    state.pod_view("s3", lambda: katalyst(3))
    assert set(state.snapshot().pods) == {"s2", "s3"}
    assert state.pod_view("s1", lambda: katalyst(1)) is not first  # "s1" had been pushed out


def test_oldest_container_pushed_out_at_the_container_limit() -> None:
    state = NodeState(container_limit=2)
    state.replace_all([pod(1)], [ctr(1, 0), ctr(1, 1), ctr(1, 2)])
    # A Synchronize over the limit keeps its last containers.
    assert [c.info.id for c in state.snapshot().containers] == ["c1-1", "c1-2"]
    state.put_container("s1", ctr(1, 3), Event.CREATE_CONTAINER, running=False)
    assert [c.info.id for c in state.snapshot().containers] == ["c1-2", "c1-3"]
    # At the limit exactly, an update of a known container pushes nothing out.
    state.put_container("s1", ctr(1, 2), Event.START_CONTAINER)
    assert [c.info.id for c in state.snapshot().containers] == ["c1-2", "c1-3"]


def test_a_pod_that_does_not_convert_is_not_remembered() -> None:
    state = NodeState()

    def broken() -> PodInfo:
        raise ValueError("no id")

    with pytest.raises(ValueError, match="no id"):
        state.pod_view("s1", broken)
    assert not state.snapshot().pods


def test_limit_must_be_positive() -> None:
    with pytest.raises(ValueError, match="at least 1"):
        NodeState(pod_limit=0)
    with pytest.raises(ValueError, match="at least 1"):
        NodeState(container_limit=0)
