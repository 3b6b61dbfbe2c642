"""Recorders, pods and a setup shared by the plugin stub's tests."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Sequence

from common.audit import MemoryAuditSink
from common.metrics import PluginMetrics
from hooks.events import Event
from hooks.model import ContainerInfo, PodInfo
from hooks.settings import EMPTY_SETTINGS, ContainerSettings
from nri_plugin.session.capability import Capability, ContainerEvent, PodEvent
from nri_plugin.session.stub import PluginStub
from nri_plugin.sim.scenario import RuntimeSpec
from nri_plugin.sim.simulator import PluginConnection, RuntimeSimulator
from nri_plugin.wire.nri_api import PLUGIN_SERVICE
from protos import nri_api_pb2 as api
from protos import ttrpc_envelope_pb2 as envelope

OLD_RUNTIME = RuntimeSpec(version="v1.7.27", nri_version="", request_timeout_ms=2000)


class Recorder(Capability):
    """A capability that records its calls and answers CreateContainer with fixed settings."""

    def __init__(self, name: str, events: Sequence[Event] = (Event.CREATE_CONTAINER,), *,
                 settings: ContainerSettings = EMPTY_SETTINGS, block: threading.Event | None = None,
                 error: BaseException | None = None, inline: bool = False) -> None:
        self.name = name
        self.events = frozenset(events)
        self.inline_events = self.events if inline else frozenset()
        self.settings = settings
        self.block = block
        self.error = error
        self.calls: list[tuple[str, str, str]] = []
        self.synced: list[tuple[list[str], list[str]]] = []

    def _act(self) -> None:
        if self.block is not None:
            self.block.wait(10)
        if self.error is not None:
            raise self.error

    def run_pod_sandbox(self, event: PodEvent) -> None:
        self.calls.append(("run_pod_sandbox", event.pod.uid, event.level))
        self._act()

    def remove_pod_sandbox(self, event: PodEvent) -> None:
        self.calls.append(("remove_pod_sandbox", event.pod.uid, event.level))

    def create_container(self, event: ContainerEvent) -> ContainerSettings:
        self.calls.append(("create_container", event.container.id, event.level))
        self._act()
        return self.settings

    def observe(self, event: Event, pod: PodInfo, container: ContainerInfo | None) -> None:
        self.calls.append((event.name.lower(), pod.uid, container.id if container else ""))

    def synchronize(self, pods: Sequence[PodInfo], containers: Sequence[ContainerInfo]) -> None:
        self.synced.append(([p.uid for p in pods], [c.id for c in containers]))


def pod(uid: str = "uid-1", **annotations: str) -> api.PodSandbox:
    message = api.PodSandbox(id=f"sb-{uid}", uid=uid, name=f"pod-{uid}", namespace="ns",
                             annotations=annotations)
    message.linux.cgroup_parent = f"/kubepods/besteffort/pod{uid}"
    return message


def container(cid: str = "c1", uid: str = "uid-1", limit: int = 512 << 20) -> api.Container:
    message = api.Container(id=cid, pod_sandbox_id=f"sb-{uid}", name=f"name-{cid}")
    message.linux.resources.memory.limit.value = limit
    return message


class Setup:
    def __init__(self, simulator: RuntimeSimulator, stub: PluginStub, sink: MemoryAuditSink,
                 serving: asyncio.Task[str]) -> None:
        self.simulator = simulator
        self.stub = stub
        self.sink = sink
        self.serving = serving
        self.connection: PluginConnection | None = None

    @property
    def conn(self) -> PluginConnection:
        assert self.connection is not None
        return self.connection


def configure(stub: PluginStub) -> None:
    """Configure ``stub`` as a runtime would, without a connection."""
    configure_request = envelope.Request(
        service=PLUGIN_SERVICE, method="Configure",
        payload=api.ConfigureRequest(runtime_name="containerd", runtime_version="v2.1.0",
                                     NRI_version="v0.12.0").SerializeToString())
    stub.handlers[(PLUGIN_SERVICE, "Configure")](configure_request)


def requests(metrics: PluginMetrics, event: str, result: str) -> float:
    return metrics.registry.get_sample_value(
        "nri_qos_nri_requests_total", {"event": event, "result": result}) or 0.0
