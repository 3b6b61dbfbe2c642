"""The event handler on its own: decoded requests in, answers, node state, audit records and
metrics out, with no socket and no session (what Configure settled comes as SessionTerms)."""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import threading
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor

import pytest

from common.audit import AuditLog, MemoryAuditSink
from common.metrics import PluginMetrics
from common.podmeta import PodMeta
from common.state import NodeState
from hooks.events import Event
from hooks.levels import LEVEL_NAMES
from hooks.model import RuntimeInfo
from hooks.settings import EMPTY_SETTINGS, ContainerSettings
from nri_plugin.capabilities.memory_qos import MemoryQosCapability
from nri_plugin.config.loader import parse_toml
from nri_plugin.config.schema import Config
from nri_plugin.session.capability import Capability, ContainerEvent
from nri_plugin.session.event_handler import STATE_EVENTS, EventHandler
from nri_plugin.session.terms import SessionTerms
from nri_plugin.wire.errors import RpcError
from nri_plugin.wire.rejections import Rejection
from nri_plugin.wire.runtime_support import RuntimeSupport
from nri_plugin.wire.status import StatusCode
from protos import nri_api_pb2 as api

CONTAINERD = SessionTerms(
    support=RuntimeSupport.detect("v0.12.0", "containerd", "v2.1.0"),
    runtime=RuntimeInfo(name="containerd", version="v2.1.0", nri_version=(0, 12, 0)),
    request_timeout_ms=2000,
)


class Limits(Capability):
    """Answers CreateContainer with a memory limit; remembers the runtime it was shown."""

    name = "limits"
    events = frozenset({Event.CREATE_CONTAINER})

    def __init__(self, settings: ContainerSettings = EMPTY_SETTINGS, *, inline: bool = True,
                 block: threading.Event | None = None) -> None:
        self.settings = settings
        self.inline_events = self.events if inline else frozenset()
        self.block = block
        self.seen: list[RuntimeInfo] = []

    def create_container(self, event: ContainerEvent) -> ContainerSettings:
        self.seen.append(event.runtime)
        if self.block is not None:
            self.block.wait(10)
        return self.settings


@pytest.fixture
def executor() -> Iterator[ThreadPoolExecutor]:
    with ThreadPoolExecutor(max_workers=1) as pool:
        yield pool


class World:
    def __init__(self, executor: ThreadPoolExecutor, capabilities: Sequence[Capability],
                 config: Config | None = None) -> None:
        self.sink = MemoryAuditSink()
        self.state = NodeState()
        self.metrics = PluginMetrics()
        cfg = config or Config()
        self.handler = EventHandler(config=lambda: cfg, capabilities=capabilities,
                                    audit=AuditLog(self.sink), executor=executor,
                                    state=self.state, metrics=self.metrics)

    def requests(self, event: str, result: str) -> float:
        value = self.metrics.registry.get_sample_value(
            "nri_qos_nri_requests_total", {"event": event, "result": result})
        return value or 0.0


def sandbox(uid: str = "uid-1") -> api.PodSandbox:
    return api.PodSandbox(id=f"sb-{uid}", uid=uid, name=f"pod-{uid}", namespace="ns")


def ctr(cid: str = "c1", uid: str = "uid-1") -> api.Container:
    return api.Container(id=cid, pod_sandbox_id=f"sb-{uid}", name=f"name-{cid}")


async def test_inline_capabilities_answer_at_once_with_the_terms_runtime(executor) -> None:
    limits = Limits(ContainerSettings(memory_limit=1 << 30))
    world = World(executor, [limits])
    answer = world.handler.handle(Event.CREATE_CONTAINER, sandbox(), ctr(), CONTAINERD)
    assert isinstance(answer, bytes)
    adjustment = api.CreateContainerResponse.FromString(answer).adjust
    assert adjustment.linux.resources.memory.limit.value == 1 << 30
    assert limits.seen == [CONTAINERD.runtime]
    # The record of what was applied, the event line and its count come after the answer.
    assert world.sink.named("adjustment_applied") == []
    await asyncio.sleep(0)
    (applied,) = world.sink.named("adjustment_applied")
    assert applied["container"] == "name-c1"
    assert world.requests("create_container", "ok") == 1


async def test_a_capability_that_may_block_gets_the_deadline_the_terms_allow(executor) -> None:
    release = threading.Event()
    world = World(executor, [Limits(inline=False, block=release)])
    # 200 ms of request timeout, less the default margin: the floor of 10 ms remains.
    terms = SessionTerms(support=CONTAINERD.support, runtime=CONTAINERD.runtime,
                         request_timeout_ms=200)
    try:
        pending = world.handler.handle(Event.CREATE_CONTAINER, sandbox(), ctr(), terms)
        assert not isinstance(pending, bytes)
        answer = await asyncio.wait_for(pending, 5)
    finally:
        release.set()
    assert answer == b""
    (skipped,) = world.sink.named("adjustment_skipped")
    assert "deadline of 10 ms" in skipped["reason"]
    await asyncio.sleep(0)
    assert world.requests("create_container", "fail-open") == 1


async def test_followed_events_keep_the_node_state_without_any_capability(executor) -> None:
    world = World(executor, [])
    assert world.handler.followed == STATE_EVENTS
    assert world.handler.handle(Event.RUN_POD_SANDBOX, sandbox(), None, CONTAINERD) == b""
    assert world.state.pod_identity(uid="uid-1") == ("uid-1", "ns", "pod-uid-1")
    assert world.handler.handle(Event.REMOVE_POD_SANDBOX, sandbox(), None, CONTAINERD) == b""
    assert world.state.pod_identity(uid="uid-1") is None


async def test_an_unusable_pod_is_audited_and_answered_empty(executor) -> None:
    world = World(executor, [Limits(ContainerSettings(memory_limit=1 << 30))])
    nameless = api.PodSandbox(uid="uid-1", name="pod", namespace="ns")  # no sandbox id
    assert world.handler.handle(Event.CREATE_CONTAINER, nameless, ctr(), CONTAINERD) == b""
    (skipped,) = world.sink.named("adjustment_skipped")
    assert "no id" in skipped["reason"]


def test_a_payload_that_does_not_decode_is_refused_once(executor) -> None:
    world = World(executor, [])
    refused: list[tuple[Rejection, str]] = []
    message = world.handler.decode("create_container", api.CreateContainerRequest, b"\xff",
                                   lambda kind, detail: refused.append((kind, detail)))
    assert message is None
    assert refused == [(Rejection.BAD_PAYLOAD, "CreateContainerRequest payload does not decode")]
    assert world.requests("create_container", "fail-open") == 1


def test_a_payload_that_does_not_decode_is_an_error_when_strict(executor) -> None:
    cfg = Config()
    world = World(executor, [], dataclasses.replace(cfg, plugin=dataclasses.replace(cfg.plugin,
                                                                                   strict=True)))
    with pytest.raises(RpcError) as error:
        world.handler.decode("create_container", api.CreateContainerRequest, b"\xff",
                             lambda kind, detail: None)
    assert error.value.code == StatusCode.INVALID_ARGUMENT
    assert world.requests("create_container", "error") == 1


class Requests(Capability):
    """Remembers the memory request of each container it was shown at CreateContainer."""

    name = "requests"
    events = inline_events = frozenset({Event.CREATE_CONTAINER})

    def __init__(self) -> None:
        self.seen: list[int | None] = []

    def create_container(self, event: ContainerEvent) -> ContainerSettings:
        self.seen.append(event.container.memory_request)
        return EMPTY_SETTINGS


def pod_meta(uid: str, requests: dict[str, int]) -> PodMeta:
    return PodMeta(uid=uid, namespace="ns", name=f"pod-{uid}", annotations={}, labels={},
                   priority=None, memory_requests=requests, memory_limits={})


async def test_creation_sees_the_requests_the_pod_watch_knows(executor) -> None:
    seen = Requests()
    world = World(executor, [seen])
    world.state.apply_meta(pod_meta("uid-1", {"name-c1": 256 << 20}))
    world.handler.handle(Event.CREATE_CONTAINER, sandbox("uid-1"), ctr("c1", "uid-1"), CONTAINERD)
    # a pod the watch has not seen yet: only what the runtime says (nothing, without MemoryQoS)
    world.handler.handle(Event.CREATE_CONTAINER, sandbox("uid-2"), ctr("c2", "uid-2"), CONTAINERD)
    assert seen.seen == [256 << 20, None]


MIN_FOR_EVERY_LEVEL = "".join(
    f'[memory.levels.{level}]\npolicy = "ratios"\nmin_ratio = 100\nlow_ratio = 0\n'
    'high_ratio = 0\n' for level in LEVEL_NAMES)


@pytest.mark.parametrize(("text", "key"), [
    (MIN_FOR_EVERY_LEVEL, "memory.min"),
    ("", "memory.low"),  # the default: the online levels' memory.low
])
async def test_a_policy_from_requests_protects_at_creation(executor, text: str,
                                                           key: str) -> None:
    cfg = parse_toml(Config, text)
    memory = MemoryQosCapability(cfg.memory, AuditLog(MemoryAuditSink()), strict=False,
                                 cgroup_v2=True, memory_total=8 << 30)
    world = World(executor, [memory], cfg)
    world.state.apply_meta(pod_meta("uid-1", {"name-c1": 256 << 20}))
    answer = world.handler.handle(Event.CREATE_CONTAINER, sandbox(), ctr(), CONTAINERD)
    assert isinstance(answer, bytes)
    unified = api.CreateContainerResponse.FromString(answer).adjust.linux.resources.unified
    assert dict(unified) == {key: str(256 << 20)}


def sized(limit: int, request: int | None = None, oom: int | None = None,
          cid: str = "c1", high: int | None = None) -> api.Container:
    """A container as the runtime shows it: its limit, kubelet's memory.min and memory.high,
    its score."""
    made = ctr(cid)
    made.linux.resources.memory.limit.value = limit
    if request is not None:
        made.linux.resources.unified["memory.min"] = str(request)
    if high is not None:
        made.linux.resources.unified["memory.high"] = str(high)
    if oom is not None:
        made.linux.oom_score_adj.value = oom
    return made


async def test_an_update_is_followed_and_the_agents_own_values_never_read_back(
        executor) -> None:
    """A resize shows its new limit at PostUpdateContainer only (containerd's recordings: 512
    MiB at UpdateContainer, 384 after). The events between show the spec with the agent's
    adjustment in it: read as kubelet's request or score, it would compound."""
    world = World(executor, [])
    world.handler = EventHandler(config=Config, capabilities=[], audit=AuditLog(world.sink),
                                 executor=executor, state=world.state, track_containers=True)
    assert Event.POST_UPDATE_CONTAINER in world.handler.followed
    mib = 1 << 20

    def held() -> tuple[int | None, int | None, int | None]:
        known = world.state.container("c1")
        assert known is not None
        return known.memory_limit, known.memory_request, known.oom_score_adj

    handle = functools.partial(world.handler.handle, pod_msg=sandbox(), terms=CONTAINERD)
    handle(Event.RUN_POD_SANDBOX, container_msg=None)
    handle(Event.CREATE_CONTAINER, container_msg=sized(512 * mib, 256 * mib, oom=900))
    assert held() == (512 * mib, 256 * mib, 900)
    # started with the agent's memory.min (half the request) and score in its spec
    handle(Event.START_CONTAINER, container_msg=sized(512 * mib, 128 * mib, oom=950))
    assert held() == (512 * mib, 256 * mib, 900)
    handle(Event.UPDATE_CONTAINER, container_msg=sized(512 * mib, 128 * mib, oom=950))
    assert held() == (512 * mib, 256 * mib, 900)
    handle(Event.POST_UPDATE_CONTAINER, container_msg=sized(384 * mib, 192 * mib, oom=950))
    assert held() == (384 * mib, 192 * mib, 900)
    # an update whose resources say no request keeps the one known
    handle(Event.POST_UPDATE_CONTAINER, container_msg=sized(640 * mib, oom=950))
    assert held() == (640 * mib, 192 * mib, 900)
    handle(Event.STOP_CONTAINER, container_msg=sized(640 * mib, 96 * mib, oom=950))
    assert held() == (640 * mib, 192 * mib, 900)


async def test_kubelets_memory_high_is_kept_from_the_events_that_show_it(executor) -> None:
    """kubelet's MemoryQoS memory.high shows at CreateContainer and PostUpdateContainer; the
    events between show the agent's own."""
    world = World(executor, [])
    world.handler = EventHandler(config=Config, capabilities=[], audit=AuditLog(world.sink),
                                 executor=executor, state=world.state, track_containers=True)
    mib = 1 << 20

    def high() -> str | None:
        known = world.state.container("c1")
        assert known is not None
        return known.memory_high

    handle = functools.partial(world.handler.handle, pod_msg=sandbox(), terms=CONTAINERD)
    handle(Event.RUN_POD_SANDBOX, container_msg=None)
    handle(Event.CREATE_CONTAINER, container_msg=sized(512 * mib, 256 * mib, high=460 * mib))
    assert high() == str(460 * mib)
    handle(Event.START_CONTAINER, container_msg=sized(512 * mib, 128 * mib, high=300 * mib))
    assert high() == str(460 * mib)
    handle(Event.POST_UPDATE_CONTAINER, container_msg=sized(384 * mib, 192 * mib,
                                                            high=345 * mib))
    assert high() == str(345 * mib)
    # an update whose resources say no memory.high keeps the one known
    handle(Event.POST_UPDATE_CONTAINER, container_msg=sized(640 * mib))
    assert high() == str(345 * mib)
    handle(Event.STOP_CONTAINER, container_msg=sized(640 * mib, high=100 * mib))
    assert high() == str(345 * mib)
