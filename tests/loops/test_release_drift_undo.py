"""A container's own memcg values that drift set go back once the policy stops asking for them:
to the value from before drift's first write, or, for a value the runtime applied at creation
from the agent's answer, to what kubelet sets; a value someone else wrote since is left."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
from structlog.testing import capture_logs

from common.audit import AuditLog, MemoryAuditSink
from common.state import NodeState
from hooks.config_fields import frozen_map
from hooks.events import Event
from hooks.memory_qos import VOLCANO_ANNOTATION
from nri_plugin.config.schema import Config
from tests.support.builders import api_pod
from tests.support.drift_cycles import Drift
from tests.support.fakesys import GIB, MIB, FakeContainer, FakeHost, FakePod

UID = "55555555-0000-0000-0000-000000000005"
HALF = json.dumps({"memoryQos": {"highRatio": 50}})
LEVEL = "qos.nri-qos.io/level"


class Node:
    """A v2 fake host, its node state and a drift loop whose configuration can be swapped."""

    def __init__(self, tmp_path: Path, *, version: int = 2, observe: bool = False) -> None:
        self.host = FakeHost(tmp_path, version=version, driver="systemd")
        self.host.set_numa([(8 * GIB, 16 * GIB, 100)])
        self.state = NodeState()
        self.sink = MemoryAuditSink()
        self.config = Config()
        self.observe = observe
        self.drift = Drift(tmp_path, self.state, lambda: self.config, AuditLog(self.sink),
                           lambda: self.observe)
        self.loop = self.drift.loop

    def cycle(self) -> None:
        self.drift.cycle()

    def meta(self, pod: FakePod, annotations: dict[str, str], *,
             request: int | None = None) -> None:
        # Every pod here is in namespace default, as api_pod gives it.
        self.state.apply_meta(api_pod(
            pod.info.uid, pod.info.name, annotations,
            memory_requests=None if request is None else {"c0": request},
            memory_limits={"c0": 512 * MIB}))

    def file(self, c: FakeContainer, name: str) -> Path:
        return self.host.cg("memory", c.rel) / name

    def value(self, c: FakeContainer, name: str) -> str:
        return self.file(c, name).read_text().strip()


def with_level(config: Config, level: str, **changes: object) -> Config:
    memory = config.memory
    levels = dict(memory.levels)
    levels[level] = dataclasses.replace(levels[level], **changes)  # type: ignore[arg-type]
    return dataclasses.replace(config, memory=dataclasses.replace(
        memory, levels=frozen_map(levels)))


def burstable(node: Node) -> tuple[FakePod, FakeContainer]:
    pod = node.host.add_pod(UID, tier="burstable", memory_limit=512 * MIB)
    node.state.replace_all(*node.host.nri())
    return pod, pod.containers[0]


@pytest.mark.parametrize(("annotations", "high"), [
    pytest.param({VOLCANO_ANNOTATION: HALF}, str(256 * MIB), id="memory-qos-annotation"),
    pytest.param({LEVEL: "reclaimed_cores"}, str(int(512 * MIB * 0.95) // 4096 * 4096),
                 id="level-lowered-and-restored"),
])
def test_memory_high_an_annotation_asked_for_goes_back_when_the_annotation_is_removed(
        tmp_path: Path, annotations: dict[str, str], high: str) -> None:
    node = Node(tmp_path)
    pod, c = burstable(node)
    node.meta(pod, annotations)
    node.cycle()
    assert node.value(c, "memory.high") == high
    node.meta(pod, {})
    node.cycle()
    assert node.value(c, "memory.high") == "max"


def test_a_reload_to_policy_none_or_memory_qos_off_gives_the_values_back(
        tmp_path: Path) -> None:
    node = Node(tmp_path)
    pod, c = burstable(node)
    node.meta(pod, {}, request=128 * MIB)
    enforcing = with_level(Config(), "shared_cores", high_ratio=50)
    switched_off = [
        with_level(enforcing, "shared_cores", policy="none"),
        dataclasses.replace(enforcing, memory=dataclasses.replace(
            enforcing.memory, enabled=False)),
        dataclasses.replace(enforcing, reconciler=dataclasses.replace(
            enforcing.reconciler, enabled=False)),
    ]
    for config in switched_off:
        node.config = enforcing
        node.cycle()
        assert node.value(c, "memory.low") == str(128 * MIB)
        assert node.value(c, "memory.high") == str(256 * MIB)
        node.config = config
        node.cycle()
        assert (node.value(c, "memory.low"), node.value(c, "memory.high")) == ("0", "max")


def test_the_value_from_before_the_first_write_comes_back(tmp_path: Path) -> None:
    node = Node(tmp_path)
    pod, c = burstable(node)
    node.file(c, "memory.high").write_text(f"{400 * MIB}\n")  # an operator's, before the agent
    node.meta(pod, {VOLCANO_ANNOTATION: HALF})
    node.cycle()
    node.meta(pod, {VOLCANO_ANNOTATION: json.dumps({"memoryQos": {"highRatio": 40}})})
    node.cycle()
    assert node.value(c, "memory.high") == str(int(512 * MIB * 0.4) // 4096 * 4096)
    node.meta(pod, {})
    node.cycle()
    assert node.value(c, "memory.high") == str(400 * MIB)


def test_a_value_someone_else_wrote_since_is_left_alone(tmp_path: Path) -> None:
    node = Node(tmp_path)
    pod, c = burstable(node)
    node.meta(pod, {VOLCANO_ANNOTATION: HALF})
    node.cycle()
    node.meta(pod, {})
    node.file(c, "memory.high").write_text(f"{300 * MIB}\n")  # someone else's, after
    node.cycle()
    assert node.value(c, "memory.high") == str(300 * MIB)
    node.file(c, "memory.high").write_text(f"{256 * MIB}\n")  # theirs too, now
    node.cycle()
    assert node.value(c, "memory.high") == str(256 * MIB)


def applied_at_creation(node: Node, c: FakeContainer) -> None:
    """The files as the CreateContainer answer had the runtime write them (so drift writes
    nothing), then a reload that gives the level no memory policy."""
    node.config = with_level(Config(), "shared_cores", min_ratio=50, low_ratio=100,
                             high_ratio=90)
    node.file(c, "memory.min").write_text(f"{32 * MIB}\n")
    node.file(c, "memory.low").write_text(f"{64 * MIB}\n")
    node.file(c, "memory.high").write_text(f"{CREATION_HIGH}\n")
    node.cycle()
    assert [r for r in node.sink.named("cgroup_write") if c.rel in r["path"]] == []
    node.config = with_level(Config(), "shared_cores", policy="none")
    node.cycle()


CREATION_HIGH = int(512 * MIB * 0.9) // 4096 * 4096


def test_values_the_runtime_applied_at_creation_go_back_to_kubelets(tmp_path: Path) -> None:
    node = Node(tmp_path)
    pod, c = burstable(node)
    node.meta(pod, {}, request=64 * MIB)
    applied_at_creation(node, c)
    assert [node.value(c, name) for name in ("memory.min", "memory.low", "memory.high")] == [
        "0", "0", "max"]


def test_with_kubelets_memory_qos_and_its_memory_high_not_known_the_file_is_left_and_said(
        tmp_path: Path) -> None:
    node = Node(tmp_path)
    pod = node.host.add_pod(UID, tier="burstable", memory_limit=512 * MIB,
                            memory_request=64 * MIB)  # kubelet's MemoryQoS memory.min
    c = pod.containers[0]
    node.state.replace_all(*node.host.nri())
    with capture_logs() as logs:
        applied_at_creation(node, c)
    assert [node.value(c, name) for name in ("memory.min", "memory.low", "memory.high")] == [
        str(64 * MIB), "0", str(CREATION_HIGH)]
    assert [e["path"].rsplit("/", 1)[1] for e in logs
            if e["event"] == "container_value_left"] == ["memory.high"]
    node.cycle()
    assert node.loop.noted_containers() == 0


KUBELETS_HIGH = str(480 * MIB)
"""kubelet's MemoryQoS ``memory.high`` of the container, as the runtime showed it at creation."""


def test_with_kubelets_memory_qos_its_memory_high_comes_back_where_the_runtime_showed_it(
        tmp_path: Path) -> None:
    node = Node(tmp_path)
    pod = node.host.add_pod(UID, tier="burstable", memory_limit=512 * MIB,
                            memory_request=64 * MIB)
    c = pod.containers[0]
    pods, containers = node.host.nri()
    node.state.replace_all(pods, [dataclasses.replace(info, memory_high=KUBELETS_HIGH)
                                  for info in containers])
    with capture_logs() as logs:
        applied_at_creation(node, c)
    assert [node.value(c, name) for name in ("memory.min", "memory.low", "memory.high")] == [
        str(64 * MIB), "0", KUBELETS_HIGH]
    assert [e for e in logs if e["event"] == "container_value_left"] == []
    assert node.loop.noted_containers() == 0


def test_observe_mode_gives_back_what_drift_wrote_and_enforce_writes_it_again(
        tmp_path: Path) -> None:
    node = Node(tmp_path)
    pod, c = burstable(node)
    node.meta(pod, {VOLCANO_ANNOTATION: HALF})
    node.cycle()
    node.observe = True
    node.cycle()
    assert node.value(c, "memory.high") == "max"
    assert [r["value"] for r in node.sink.named("write_observed")] == [str(256 * MIB)]
    node.observe = False
    node.cycle()
    assert node.value(c, "memory.high") == str(256 * MIB)
    node.observe = True
    node.meta(pod, {})
    node.cycle()
    assert node.value(c, "memory.high") == "max"
    node.observe = False
    node.cycle()
    assert node.value(c, "memory.high") == "max"
    assert node.loop.noted_containers() == 0


def test_nothing_is_kept_of_containers_that_went(tmp_path: Path) -> None:
    node = Node(tmp_path)
    pod, _ = burstable(node)
    node.meta(pod, {VOLCANO_ANNOTATION: HALF})
    node.cycle()
    assert node.loop.noted_containers() == 1
    node.host.remove_pod(pod)
    node.state.remove_pod(pod.info.id, Event.REMOVE_POD_SANDBOX)
    node.cycle()
    assert node.loop.noted_containers() == 0
