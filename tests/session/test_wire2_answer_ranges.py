"""The CreateContainer answer carries only values the kernel takes, whatever the runtime's
request said about the container."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import pytest

from common.audit import AuditLog, MemoryAuditSink
from common.state import NodeState
from hooks.events import Event
from hooks.model import RuntimeInfo
from hooks.oom_score import OomLevel
from nri_plugin.capabilities.oom_score import OomScoreCapability
from nri_plugin.config.schema import Config
from nri_plugin.session.event_handler import EventHandler
from nri_plugin.session.terms import SessionTerms
from nri_plugin.wire.convert import container_info
from nri_plugin.wire.runtime_support import RuntimeSupport
from protos import nri_api_pb2 as api

CONTAINERD = SessionTerms(
    support=RuntimeSupport.detect("v0.12.0", "containerd", "v2.1.0"),
    runtime=RuntimeInfo(name="containerd", version="v2.1.0", nri_version=(0, 12, 0)),
    request_timeout_ms=2000,
)


@pytest.fixture
def executor() -> Iterator[ThreadPoolExecutor]:
    with ThreadPoolExecutor(max_workers=1) as pool:
        yield pool


def scored(oom_score_adj: int) -> api.Container:
    container = api.Container(id="c1", pod_sandbox_id="sb-1", name="app")
    container.linux.oom_score_adj.value = oom_score_adj
    return container


@pytest.mark.parametrize("score", [-1001, 1001, 1 << 40, -(1 << 62)])
def test_a_score_the_kernel_would_refuse_is_not_taken_as_the_containers(score: int) -> None:
    assert container_info(scored(score)).oom_score_adj is None


@pytest.mark.parametrize("score", [-1000, 0, 1000])
def test_every_score_the_kernel_takes_is_the_containers(score: int) -> None:
    assert container_info(scored(score)).oom_score_adj == score


async def test_an_out_of_range_score_in_the_request_never_reaches_the_answer(
        executor: ThreadPoolExecutor) -> None:
    base = Config()
    levels = dict(base.oom.levels)
    # Kubelet's score is kept for the offline level, which tier ordering only ever raises.
    levels["reclaimed_cores"] = OomLevel(set_score=False, floor=-1000)
    cfg = dataclasses.replace(base, oom=dataclasses.replace(
        base.oom, priority_ordering=True, levels=levels))
    audit = AuditLog(MemoryAuditSink())
    handler = EventHandler(config=lambda: cfg,
                           capabilities=[OomScoreCapability(cfg.oom, audit, strict=False)],
                           audit=audit, executor=executor, state=NodeState())
    pod = api.PodSandbox(id="sb-1", uid="uid-1", name="pod", namespace="ns",
                         annotations={"qos.nri-qos.io/level": "reclaimed_cores"})
    answer = handler.handle(Event.CREATE_CONTAINER, pod, scored(5000), CONTAINERD)
    assert isinstance(answer, bytes)
    linux = api.CreateContainerResponse.FromString(answer).adjust.linux
    assert linux.HasField("oom_score_adj")
    assert -1000 <= linux.oom_score_adj.value <= 1000
