"""Events containerd can still send about a pod it already removed: a container's stop seen
by the asynchronous task-exit path, or a RemoveContainer retried, after RemovePodSandbox."""

from __future__ import annotations

from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import pytest

from common.audit import AuditLog, MemoryAuditSink
from common.state import NodeState
from hooks.events import Event
from hooks.model import RuntimeInfo
from nri_plugin.config.schema import Config
from nri_plugin.session.event_handler import EventHandler
from nri_plugin.session.terms import SessionTerms
from nri_plugin.wire.runtime_support import RuntimeSupport
from protos import nri_api_pb2 as api

CONTAINERD = SessionTerms(
    support=RuntimeSupport.detect("v0.12.0", "containerd", "v2.1.0"),
    runtime=RuntimeInfo(name="containerd", version="v2.1.0", nri_version=(0, 12, 0)),
    request_timeout_ms=2000,
)
POD = api.PodSandbox(id="sb-1", uid="uid-1", name="pod-1", namespace="ns")
CONTAINER = api.Container(id="c1", pod_sandbox_id="sb-1", name="app")


@pytest.fixture
def executor() -> Iterator[ThreadPoolExecutor]:
    with ThreadPoolExecutor(max_workers=1) as pool:
        yield pool


def handler(executor: ThreadPoolExecutor, state: NodeState, *, tracking: bool) -> EventHandler:
    cfg = Config()
    return EventHandler(config=lambda: cfg, capabilities=[], audit=AuditLog(MemoryAuditSink()),
                        executor=executor, state=state, track_containers=tracking)


@pytest.mark.parametrize(("tracking", "late"), [
    (True, Event.STOP_CONTAINER),
    (True, Event.REMOVE_CONTAINER),
    (False, Event.REMOVE_CONTAINER),
    (True, Event.STOP_POD_SANDBOX),
])
async def test_an_event_after_its_pods_removal_does_not_bring_the_pod_back(
        executor: ThreadPoolExecutor, tracking: bool, late: Event) -> None:
    state = NodeState()
    events = handler(executor, state, tracking=tracking)
    for event, container in ((Event.RUN_POD_SANDBOX, None), (Event.CREATE_CONTAINER, CONTAINER),
                             (Event.REMOVE_POD_SANDBOX, None)):
        assert events.handle(event, POD, container, CONTAINERD) == b""
    assert state.pod_identity(uid="uid-1") is None

    container = None if late is Event.STOP_POD_SANDBOX else CONTAINER
    assert events.handle(late, POD, container, CONTAINERD) == b""
    # Nothing would ever remove it again: the runtime sends no second RemovePodSandbox.
    assert state.pod_identity(uid="uid-1") is None
    assert state.container("c1") is None


async def test_a_pod_run_again_under_a_removed_sandbox_id_is_known(
        executor: ThreadPoolExecutor) -> None:
    state = NodeState()
    events = handler(executor, state, tracking=True)
    for event, container in ((Event.RUN_POD_SANDBOX, None), (Event.REMOVE_POD_SANDBOX, None),
                             (Event.RUN_POD_SANDBOX, None), (Event.CREATE_CONTAINER, CONTAINER)):
        assert events.handle(event, POD, container, CONTAINERD) == b""
    assert state.pod_identity(uid="uid-1") == ("uid-1", "ns", "pod-1")
    assert state.container("c1") is not None
