"""The runtime side of NRI, in Python: enough of containerd to drive the plugin without it.

:class:`RuntimeSimulator` listens on a unix socket the way containerd does. Each plugin that
connects must register; it is then configured (with the checks a real runtime makes: a mask with
bits the impersonated NRI version does not know is rejected) and synchronized, possibly in
``more`` chunks. Events are delivered the way the impersonated version delivers them: dedicated
RPCs from NRI 0.12, ``StateChange`` before (and after an UNIMPLEMENTED answer). Answers are
recorded so they can be printed or checked (``nri-qos simulate``, :mod:`nri_plugin.cli.simulate`).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import structlog
from google.protobuf.json_format import MessageToDict
from google.protobuf.message import Message

from hooks.events import POD_EVENTS, Event
from nri_plugin.sim.scenario import ContainerSpec, PodSpec, RuntimeSpec, Scenario, pairs
from nri_plugin.wire.errors import CallTimedOut, ConnectionClosed, RpcError
from nri_plugin.wire.mux import PLUGIN_SERVICE_CONN, RUNTIME_SERVICE_CONN
from nri_plugin.wire.nri_api import (
    DEFAULT_REGISTRATION_TIMEOUT_MS,
    DEFAULT_REQUEST_TIMEOUT_MS,
    PLUGIN_SERVICE,
    RUNTIME_SERVICE,
)
from nri_plugin.wire.runtime_support import runtime_nri_version, valid_events
from nri_plugin.wire.status import StatusCode
from nri_plugin.wire.transport import Handler, TtrpcPeer
from protos import nri_api_pb2 as api
from protos import ttrpc_envelope_pb2 as envelope

log = structlog.get_logger("nri_qos.simulator")

# Events a runtime before NRI 0.12 (and one that fell back) sends as StateChange.
_NOTIFICATIONS = frozenset({
    Event.RUN_POD_SANDBOX, Event.STOP_POD_SANDBOX, Event.REMOVE_POD_SANDBOX,
    Event.POST_UPDATE_POD_SANDBOX, Event.POST_CREATE_CONTAINER, Event.START_CONTAINER,
    Event.POST_START_CONTAINER, Event.POST_UPDATE_CONTAINER, Event.REMOVE_CONTAINER,
})
_DEDICATED = {
    Event.RUN_POD_SANDBOX: "RunPodSandbox",
    Event.STOP_POD_SANDBOX: "StopPodSandbox",
    Event.REMOVE_POD_SANDBOX: "RemovePodSandbox",
    Event.UPDATE_POD_SANDBOX: "UpdatePodSandbox",
    Event.POST_UPDATE_POD_SANDBOX: "PostUpdatePodSandbox",
    Event.CREATE_CONTAINER: "CreateContainer",
    Event.POST_CREATE_CONTAINER: "PostCreateContainer",
    Event.START_CONTAINER: "StartContainer",
    Event.POST_START_CONTAINER: "PostStartContainer",
    Event.UPDATE_CONTAINER: "UpdateContainer",
    Event.POST_UPDATE_CONTAINER: "PostUpdateContainer",
    Event.STOP_CONTAINER: "StopContainer",
    Event.REMOVE_CONTAINER: "RemoveContainer",
}


@dataclass
class Answer:
    """One event sent to a plugin and what came back (``method`` empty: not sent, because the
    plugin did not subscribe to it)."""

    event: str
    pod: str
    container: str
    method: str
    response: dict[str, Any]

    def as_dict(self) -> dict[str, Any]:
        return {"event": self.event, "pod": self.pod, "container": self.container,
                "method": self.method, "response": self.response}


@dataclass
class PluginConnection:
    """One accepted plugin connection, from the runtime's point of view."""

    peer: TtrpcPeer | None = None
    name: str = ""
    index: str = ""
    nri_version: str = ""
    events: int = 0
    error: str = ""
    registered: asyncio.Event = field(default_factory=asyncio.Event)
    ready: asyncio.Event = field(default_factory=asyncio.Event)
    state_change_only: bool = False
    updates: list[api.ContainerUpdate] = field(default_factory=list)
    answers: list[Answer] = field(default_factory=list)
    sync_responses: list[api.SynchronizeResponse] = field(default_factory=list)

    @property
    def alive(self) -> bool:
        return self.peer is not None and not self.peer.closed

    def subscribed(self, event: Event) -> bool:
        return bool(self.events & event.bit)


class RuntimeSimulator:
    """Listens on ``socket_path`` and plays the runtime for every plugin that connects."""

    def __init__(
        self,
        socket_path: str | Path,
        runtime: RuntimeSpec | None = None,
        *,
        pods: Sequence[api.PodSandbox] = (),
        containers: Sequence[api.Container] = (),
    ) -> None:
        self.socket_path = str(socket_path)
        self.runtime = runtime or RuntimeSpec()
        self.pods = list(pods)
        self.containers = list(containers)
        nri = runtime_nri_version(self.runtime.nri_version, self.runtime.name,
                                  self.runtime.version)
        self.nri = nri
        self.valid_events = valid_events(nri)
        self.pod_rpcs = nri is not None and nri >= (0, 12, 0)
        self.connections: list[PluginConnection] = []
        self._server: asyncio.Server | None = None
        self._tasks: set[asyncio.Task[None]] = set()
        self._changed = asyncio.Condition()

    @property
    def request_timeout_s(self) -> float:
        return (self.runtime.request_timeout_ms or DEFAULT_REQUEST_TIMEOUT_MS) / 1000

    async def start(self) -> None:
        self._server = await asyncio.start_unix_server(self._accept, path=self.socket_path)

    async def stop(self) -> None:
        """Stop listening and drop every plugin (what a runtime restart looks like)."""
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()
            self._server = None
        for connection in self.connections:
            if connection.peer is not None:
                connection.peer.close("runtime stopped")
        await asyncio.gather(*self._tasks, return_exceptions=True)
        # A stopped runtime leaves no socket behind: plugins then see "no such file".
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.socket_path)

    def live(self) -> list[PluginConnection]:
        return [c for c in self.connections if c.alive]

    async def wait_ready(self, count: int = 1, *, timeout_s: float = 10.0) -> PluginConnection:
        """Wait until ``count`` connections have been synchronized; the latest one.

        Raises :class:`ConnectionClosed` if the latest connection is dropped during its
        handshake.
        """
        def settled() -> bool:
            if sum(c.ready.is_set() for c in self.connections) >= count:
                return True
            last = self.connections[-1] if self.connections else None
            return (last is not None and not last.ready.is_set() and last.peer is not None
                    and not last.alive)

        async with asyncio.timeout(timeout_s), self._changed:
            await self._changed.wait_for(settled)
        ready = [c for c in self.connections if c.ready.is_set()]
        if len(ready) < count:
            raise ConnectionClosed(f"plugin dropped: {self.connections[-1].error}")
        return ready[-1]

    async def wait_closed(self, connection: PluginConnection, *, timeout_s: float = 10.0) -> None:
        async with asyncio.timeout(timeout_s), self._changed:
            await self._changed.wait_for(lambda: not connection.alive)

    async def _notify(self) -> None:
        async with self._changed:
            self._changed.notify_all()

    async def adopt(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        """Play the runtime on an already connected socket (a pre-launched plugin's socketpair)
        until the connection ends."""
        await self._accept(reader, writer)

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        if task is not None:
            self._tasks.add(task)
        connection = PluginConnection()
        self.connections.append(connection)
        peer = TtrpcPeer(reader, writer, serve_conn=RUNTIME_SERVICE_CONN,
                         call_conn=PLUGIN_SERVICE_CONN, handlers=self._handlers(connection))
        connection.peer = peer
        try:
            async with asyncio.TaskGroup() as group:
                handshake = group.create_task(self._handshake_or_drop(connection, peer))
                await peer.run()
                handshake.cancel()
        finally:
            if task is not None:
                self._tasks.discard(task)
            await self._notify()

    async def _handshake_or_drop(self, connection: PluginConnection, peer: TtrpcPeer) -> None:
        try:
            await self._handshake(connection, peer)
        except (RpcError, ConnectionClosed, TimeoutError) as exc:
            connection.error = str(exc) or type(exc).__name__
            log.warning("plugin_dropped", plugin=f"{connection.index}-{connection.name}",
                        error=connection.error)
            peer.close(connection.error)
        await self._notify()

    def _handlers(self, connection: PluginConnection) -> dict[tuple[str, str], Handler]:
        async def register(request: envelope.Request) -> bytes:
            req = api.RegisterPluginRequest.FromString(request.payload)
            if len(req.plugin_idx) != 2 or not req.plugin_idx.isdigit():
                raise RpcError(StatusCode.UNKNOWN, f"invalid plugin index {req.plugin_idx!r}")
            if not req.plugin_name:
                raise RpcError(StatusCode.UNKNOWN, "empty plugin name")
            connection.name, connection.index = req.plugin_name, req.plugin_idx
            connection.nri_version = req.NRI_version
            connection.registered.set()
            return b""

        async def update_containers(request: envelope.Request) -> bytes:
            req = api.UpdateContainersRequest.FromString(request.payload)
            connection.updates.extend(req.update)
            return api.UpdateContainersResponse().SerializeToString()

        return {
            (RUNTIME_SERVICE, "RegisterPlugin"): register,
            (RUNTIME_SERVICE, "UpdateContainers"): update_containers,
        }

    async def _handshake(self, connection: PluginConnection, peer: TtrpcPeer) -> None:
        rt = self.runtime
        async with asyncio.timeout((rt.registration_timeout_ms or DEFAULT_REGISTRATION_TIMEOUT_MS)
                                   / 1000):
            await connection.registered.wait()
        configure = api.ConfigureRequest(
            runtime_name=rt.name, runtime_version=rt.version,
            registration_timeout=rt.registration_timeout_ms,
            request_timeout=rt.request_timeout_ms, NRI_version=rt.nri_version,
        )
        reply = api.ConfigureResponse.FromString(await peer.call(
            PLUGIN_SERVICE, "Configure", configure.SerializeToString(),
            timeout_s=self.request_timeout_s,
        ))
        if reply.events & ~self.valid_events:
            raise RpcError(StatusCode.INVALID_ARGUMENT,
                           f"invalid plugin events: 0x{reply.events & ~self.valid_events:x}")
        connection.events = reply.events or self.valid_events
        connection.state_change_only = not self.pod_rpcs
        async with asyncio.timeout(self.request_timeout_s):
            await self._synchronize(connection, peer)
        connection.ready.set()

    async def _synchronize(self, connection: PluginConnection, peer: TtrpcPeer) -> None:
        chunks = _chunks(self.pods, self.containers, self.runtime.sync_chunk)
        for i, (pods, containers) in enumerate(chunks):
            more = i < len(chunks) - 1
            request = api.SynchronizeRequest(pods=pods, containers=containers, more=more)
            reply = api.SynchronizeResponse.FromString(await peer.call(
                PLUGIN_SERVICE, "Synchronize", request.SerializeToString(),
                timeout_s=self.request_timeout_s,
            ))
            if more and (not reply.more or len(reply.update)):
                raise RpcError(StatusCode.UNKNOWN, "plugin does not handle split sync requests")
            connection.sync_responses.append(reply)
            if reply.update:
                connection.answers.append(Answer(event="synchronize", pod="", container="",
                                                 method="Synchronize",
                                                 response=MessageToDict(reply)))

    async def send(
        self,
        connection: PluginConnection,
        event: Event,
        pod: api.PodSandbox,
        container: api.Container | None = None,
        *,
        resources: api.LinuxResources | None = None,
    ) -> Message | None:
        """Deliver ``event`` as the impersonated runtime would; the plugin's response.

        None when the plugin is not subscribed to the event (the runtime does not send it).
        Raises :class:`RpcError` when the plugin answers with an error status.
        """
        if connection.peer is None:
            return None
        if not connection.subscribed(event):
            connection.answers.append(Answer(
                event=event.name.lower(), pod=f"{pod.namespace}/{pod.name}",
                container=container.name if container is not None else "", method="",
                response={},
            ))
            return None
        peer = connection.peer
        if event in _NOTIFICATIONS and connection.state_change_only:
            method = "StateChange"
            request: Message = api.StateChangeEvent(event=event.name, pod=pod,
                                                    container=container)
        else:
            method = _DEDICATED[event]
            request = _request(method, pod, container, resources)
        try:
            payload = await peer.call(PLUGIN_SERVICE, method, request.SerializeToString(),
                                      timeout_s=self.request_timeout_s)
        except CallTimedOut as exc:
            # As the runtime does: a missed request timeout is fatal, the plugin is closed and
            # the operation goes on without it.
            connection.error = str(exc)
            log.warning("plugin_dropped", plugin=f"{connection.index}-{connection.name}",
                        error=connection.error)
            peer.close(connection.error)
            raise
        except RpcError as exc:
            if exc.code != StatusCode.UNIMPLEMENTED or event not in _NOTIFICATIONS:
                raise
            # As NRI 0.12 does: one UNIMPLEMENTED moves every notification to StateChange.
            connection.state_change_only = True
            return await self.send(connection, event, pod, container, resources=resources)
        response_type = api.Empty if method == "StateChange" else getattr(api, f"{method}Response")
        response: Message = response_type.FromString(payload)
        connection.answers.append(Answer(
            event=event.name.lower(), pod=f"{pod.namespace}/{pod.name}",
            container=container.name if container is not None else "", method=method,
            response=MessageToDict(response),
        ))
        return response


def _request(method: str, pod: api.PodSandbox, container: api.Container | None,
             resources: api.LinuxResources | None) -> Message:
    request: Any = getattr(api, f"{method}Request")()
    request.pod.CopyFrom(pod)
    if container is not None and "container" in request.DESCRIPTOR.fields_by_name:
        request.container.CopyFrom(container)
    if resources is not None and "linux_resources" in request.DESCRIPTOR.fields_by_name:
        request.linux_resources.CopyFrom(resources)
    return request  # type: ignore[no-any-return]


def _chunks(
    pods: Sequence[api.PodSandbox], containers: Sequence[api.Container], size: int
) -> list[tuple[list[api.PodSandbox], list[api.Container]]]:
    if size <= 0:
        return [(list(pods), list(containers))]
    chunks: list[tuple[list[api.PodSandbox], list[api.Container]]] = []
    pod_i = container_i = 0
    while pod_i < len(pods) or container_i < len(containers) or not chunks:
        chunks.append((list(pods[pod_i:pod_i + size]),
                       list(containers[container_i:container_i + size])))
        pod_i += size
        container_i += size
    return chunks


# -- scenario messages -----------------------------------------------------------------------


def pod_message(spec: PodSpec) -> api.PodSandbox:
    pod = api.PodSandbox(id=spec.id, uid=spec.uid, name=spec.name, namespace=spec.namespace,
                         labels=pairs(spec.labels), annotations=pairs(spec.annotations))
    pod.linux.cgroup_parent = spec.cgroup_parent
    pod.linux.cgroups_path = f"{spec.cgroup_parent}/{spec.id}" if spec.cgroup_parent else ""
    return pod


def container_message(spec: ContainerSpec, pod: PodSpec,
                      state: int = api.CONTAINER_CREATED) -> api.Container:
    container = api.Container(
        id=spec.id, pod_sandbox_id=spec.pod, name=spec.name, state=state,  # type: ignore[arg-type]
        env=spec.env, labels=pairs(spec.labels), annotations=pairs(spec.annotations),
    )
    linux = container.linux
    linux.cgroups_path = f"{pod.cgroup_parent}/{spec.id}" if pod.cgroup_parent else ""
    if spec.memory_limit:
        linux.resources.memory.limit.value = spec.memory_limit
    if spec.memory_min:
        linux.resources.unified["memory.min"] = str(spec.memory_min)
    if spec.oom_score_adj is not None:
        linux.oom_score_adj.value = spec.oom_score_adj
    return container


_STATE_AFTER = {
    Event.CREATE_CONTAINER: api.CONTAINER_CREATED,
    Event.START_CONTAINER: api.CONTAINER_RUNNING,
    Event.STOP_CONTAINER: api.CONTAINER_STOPPED,
}


def initial_state(scenario: Scenario) -> tuple[list[api.PodSandbox], list[api.Container]]:
    """The pods and containers marked ``existing``: what Synchronize carries."""
    pods = {spec.id: spec for spec in scenario.pods}
    return (
        [pod_message(spec) for spec in scenario.pods if spec.existing],
        [container_message(spec, pods[spec.pod], api.CONTAINER_RUNNING)
         for spec in scenario.containers if spec.existing],
    )


async def play(simulator: RuntimeSimulator, connection: PluginConnection,
               scenario: Scenario) -> list[Answer]:
    """Send every step of ``scenario``; the answers of this run."""
    first = len(connection.answers)
    pods = {spec.id: spec for spec in scenario.pods}
    containers = {spec.id: spec for spec in scenario.containers}
    states: dict[str, int] = {}
    for step in scenario.steps:
        event = Event[step.event.upper()]
        resources: api.LinuxResources | None = None
        if event in POD_EVENTS:
            await simulator.send(connection, event, pod_message(pods[step.pod]))
            continue
        spec = containers[step.container]
        pod_spec = pods[spec.pod]
        state = _STATE_AFTER.get(event, states.get(spec.id, api.CONTAINER_CREATED))
        states[spec.id] = state
        if event is Event.UPDATE_CONTAINER and step.memory_limit:
            resources = api.LinuxResources()
            resources.memory.limit.value = step.memory_limit
        await simulator.send(connection, event, pod_message(pod_spec),
                             container_message(spec, pod_spec, state), resources=resources)
    return connection.answers[first:]
