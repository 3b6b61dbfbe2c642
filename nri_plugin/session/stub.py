"""The plugin side of an NRI session: serve the connection, register, configure, dispatch.

:class:`PluginStub` serves one runtime connection at a time (:meth:`PluginStub.serve`); the
daemon decides when to (re)connect. It registers, holds the handshake to its deadlines, answers
Configure with the subscription mask, and dispatches every other request: Synchronize to
:class:`~nri_plugin.session.synchronize.Synchronizer`, the events to
:class:`~nri_plugin.session.event_handler.EventHandler`, each with the
:class:`~nri_plugin.session.terms.SessionTerms` Configure settled. It also calls the runtime
(:meth:`PluginStub.update_containers`).

The runtime is not trusted to behave: every step of the handshake has a deadline (the runtime's
own registration timeout), a Configure that does not decode ends the session, no event is served
before Configure, a Synchronize is refused whole when it lists more than the configured limits,
and every refusal is counted in :attr:`PluginStub.rejections`.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable, Iterable, Sequence
from concurrent.futures import Executor
from dataclasses import dataclass
from typing import Any

import structlog
from google.protobuf.message import Message

from common.audit import AuditLog
from common.metrics import PluginMetrics
from common.state import NodeState
from hooks.events import POD_EVENTS, Event, mask_of
from hooks.model import RuntimeInfo
from hooks.untrusted import bounded
from nri_plugin.config.schema import Config
from nri_plugin.session import adjustment
from nri_plugin.session.capability import Capability
from nri_plugin.session.event_handler import STATE_EVENTS, EventHandler
from nri_plugin.session.handler_context import guarded, in_handler
from nri_plugin.session.handshake import Handshake
from nri_plugin.session.synchronize import Synchronizer
from nri_plugin.session.terms import SessionTerms, registration_timeout_ms
from nri_plugin.wire.errors import ConnectionClosed, MessageError, RpcError
from nri_plugin.wire.messages import parse_message
from nri_plugin.wire.mux import PLUGIN_SERVICE_CONN, RUNTIME_SERVICE_CONN
from nri_plugin.wire.nri_api import PLUGIN_SERVICE, RUNTIME_SERVICE
from nri_plugin.wire.rejections import Rejection, RejectionCounts
from nri_plugin.wire.runtime_support import RuntimeSupport
from nri_plugin.wire.status import StatusCode
from nri_plugin.wire.transport import Handler, TtrpcPeer
from protos import nri_api_pb2 as api
from protos import ttrpc_envelope_pb2 as envelope

log = structlog.get_logger("nri_qos.nri")


@dataclass(frozen=True, slots=True)
class PluginIdentity:
    name: str
    index: str


class PluginStub:
    """The NRI plugin: serves the ``Plugin`` service and calls the ``Runtime`` service.

    ``config`` returns the configuration in force (read at every request, so reloads apply at
    once); ``capabilities`` is the chain, fixed for the stub's lifetime because the event
    subscription is only negotiated at connection time. ``executor``, ``state``,
    ``track_containers`` and ``reconciler_fields`` are the event handler's
    (:class:`~nri_plugin.session.event_handler.EventHandler`). ``metrics`` hears of every
    request (after its answer), of the connection's state and of the fields the answers set.
    """

    def __init__(
        self,
        *,
        identity: PluginIdentity,
        config: Callable[[], Config],
        capabilities: Sequence[Capability],
        audit: AuditLog,
        executor: Executor,
        state: NodeState,
        track_containers: bool = False,
        reconciler_fields: frozenset[str] = frozenset(),
        cgroup_v2: bool = False,
        clock: Callable[[], float] = time.monotonic,
        wall_clock: Callable[[], float] = time.time,
        metrics: PluginMetrics | None = None,
    ) -> None:
        self.identity = identity
        self._config = config
        self._capabilities = tuple(capabilities)
        self._state = state
        self._reconciler_fields = reconciler_fields
        self._cgroup_v2 = cgroup_v2
        self._clock = clock
        self._wall_clock = wall_clock
        self._metrics = metrics
        self.events = EventHandler(
            config=config, capabilities=self._capabilities, audit=audit, executor=executor,
            state=state, metrics=metrics, track_containers=track_containers,
            reconciler_fields=reconciler_fields, clock=clock)
        """Handles every event of every connection."""
        self._synchronizer = Synchronizer(
            config=config, capabilities=self._capabilities, state=state, audit=audit,
            executor=executor, metrics=metrics, clock=clock)
        # The runtime connection: its state (see reconciler.metrics.CONNECTION_STATES), when
        # it entered it (``clock``), and how many connections were made.
        self.connection_state = "disconnected"
        self.state_since = clock()
        self.connections = 0
        self._peer: TtrpcPeer | None = None
        self.rejections = RejectionCounts()
        """Refusals on the NRI connection since the stub was made, by kind (for metrics)."""
        self._reset_session()
        self.handlers = self._build_handlers()
        """The ``Plugin`` service's handlers by (service, method), as the transport calls them."""

    # -- connection --------------------------------------------------------------------------

    def _reset_session(self) -> None:
        self.terms = SessionTerms(runtime=RuntimeInfo(cgroup_v2=self._cgroup_v2))
        """What Configure settled for the current connection (the defaults before it)."""
        # Until Configure tells the runtime's own, the handshake's steps get the configured one.
        self.handshake = Handshake(self._config().plugin.register_timeout_ms)
        """Where the current connection's handshake stands."""
        self.event_mask = 0
        # The runtime's NRI version as stated in Configure, or as inferred.
        self.nri_version_text = ""
        self._synchronizer.reset()

    @property
    def connected(self) -> bool:
        return self._peer is not None and not self._peer.closed

    def state_age_s(self) -> float:
        """Seconds since the connection entered its current state."""
        return self._clock() - self.state_since

    def _set_state(self, state: str) -> None:
        self.connection_state = state
        self.state_since = self._clock()
        if self._metrics is not None:
            self._metrics.nri_connection(state, self._wall_clock())

    def close(self, reason: str = "closed by the plugin") -> None:
        """End the current connection, if any; :meth:`serve` then returns."""
        if self._peer is not None:
            self._peer.close(reason)

    def deadline_ms(self) -> float:
        """Budget of one handler: the configured deadline, kept below the runtime's timeout."""
        return self.terms.deadline_ms(self._config().plugin)

    async def serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> str:
        """Register on a fresh connection and serve it until it ends; why it ended."""
        self._reset_session()
        peer = TtrpcPeer(reader, writer, serve_conn=PLUGIN_SERVICE_CONN,
                         call_conn=RUNTIME_SERVICE_CONN, handlers=self.handlers,
                         rejections=self.rejections,
                         stall_timeout_s=self.handshake.registration_timeout_ms / 1000)
        self._peer = peer
        self.connections += 1
        if self.connections > 1 and self._metrics is not None:
            self._metrics.nri_reconnected()
        self._set_state("connected")
        try:
            async with asyncio.TaskGroup() as group:
                # Register at once, without waiting for the answer before serving: the runtime
                # may send Configure before its RegisterPlugin response reaches us.
                registering = group.create_task(self.handshake.register(
                    peer, self.identity.name, self.identity.index,
                    self._config().plugin.register_timeout_ms / 1000))
                watchdog = group.create_task(self.handshake.watch(
                    peer, lambda: self._synchronizer.in_progress, self._reject))
                running = group.create_task(peer.run())

                def ended(_: object) -> None:
                    registering.cancel()
                    watchdog.cancel()

                running.add_done_callback(ended)
        finally:
            self._peer = None
            self._set_state("disconnected")
        return peer.end_reason

    def _reject(self, kind: Rejection, detail: str) -> None:
        peer = self._peer
        if peer is not None:
            peer.rejections(kind, detail)
        else:
            self.rejections.add(kind)

    def _require_configured(self, method: str) -> None:
        """Refuse a request that needs a configured session (FAILED_PRECONDITION): events and
        Synchronize are never served on a session Configure did not set up."""
        if not self.handshake.configured:
            detail = f"{method} before Configure"
            self._reject(Rejection.OUT_OF_ORDER, detail)
            raise RpcError(StatusCode.FAILED_PRECONDITION, f"nri-qos: {detail}")

    async def update_containers(
        self, updates: Iterable[api.ContainerUpdate], *, timeout_s: float | None = None
    ) -> list[api.ContainerUpdate]:
        """Ask the runtime to update existing containers; the updates that failed.

        Must not be awaited from inside a request handler: the runtime holds its lock while it
        waits for the handler's answer, so the call could only time out.
        """
        if in_handler():
            raise RuntimeError("update_containers must not be awaited from an NRI request handler")
        peer = self._peer
        if peer is None or peer.closed:
            raise ConnectionClosed("not connected to the runtime")
        request = api.UpdateContainersRequest(update=list(updates))
        seconds = timeout_s if timeout_s is not None else self.terms.request_timeout_ms / 1000
        payload = await peer.call(RUNTIME_SERVICE, "UpdateContainers",
                                  request.SerializeToString(), timeout_s=seconds)
        response = parse_message(api.UpdateContainersResponse, payload)
        if response is None:
            raise RpcError(StatusCode.INTERNAL, "UpdateContainers response does not decode")
        return list(response.failed)

    # -- dispatch ----------------------------------------------------------------------------

    def _build_handlers(self) -> dict[tuple[str, str], Handler]:
        table: dict[str, Handler] = {
            "Configure": self._configure,
            "Synchronize": self._synchronize,
            "Shutdown": self._shutdown,
            "CreateContainer": self._create_container,
            "StateChange": self._state_change,
        }
        notices = {"UpdateContainer": Event.UPDATE_CONTAINER, "StopContainer": Event.STOP_CONTAINER,
                   "UpdatePodSandbox": Event.UPDATE_POD_SANDBOX, **_POD_RPCS, **_CONTAINER_RPCS}
        for method, event in notices.items():
            request_type, response_type = _rpc_types(method)
            table[method] = self._notice(request_type, response_type, event)
        return {(PLUGIN_SERVICE, method): guarded(handler) for method, handler in table.items()}

    # -- handshake ---------------------------------------------------------------------------

    def _configure(self, request: envelope.Request) -> bytes:
        req = parse_message(api.ConfigureRequest, request.payload)
        if req is None:
            # Half configured is no state to serve from: the answer says why, then the
            # connection ends (after the answer went out) and the plugin connects again. What
            # is read with it is refused meanwhile, also after an earlier good Configure.
            self.handshake.configured = False
            self._reject(Rejection.BAD_PAYLOAD, "ConfigureRequest payload does not decode")
            peer = self._peer
            if peer is not None:
                asyncio.get_running_loop().call_soon(
                    peer.close, "Configure payload does not decode")
            raise RpcError(StatusCode.INVALID_ARGUMENT, "Configure payload does not decode")
        self.terms = terms = SessionTerms.from_configure(req, cgroup_v2=self._cgroup_v2)
        support = terms.support
        self._state.set_runtime_fields(support.fields)
        handshake = self.handshake
        handshake.registration_timeout_ms = registration_timeout_ms(req)
        if self._peer is not None:
            self._peer.stall_timeout_s = handshake.registration_timeout_ms / 1000
        self.event_mask = subscription_mask(self.events.followed, self._capabilities, support)
        self.nri_version_text = support_nri_text(support, req.NRI_version)
        if self._metrics is not None:
            self._metrics.nri_runtime(bounded(req.runtime_name), bounded(req.runtime_version),
                                      self.nri_version_text)
        handshake.configured = True
        handshake.step()
        log.info("configured", runtime=bounded(req.runtime_name),
                 runtime_version=bounded(req.runtime_version),
                 nri_version=bounded(req.NRI_version) or None, events=hex(self.event_mask),
                 request_timeout_ms=terms.request_timeout_ms,
                 registration_timeout_ms=handshake.registration_timeout_ms,
                 deadline_ms=self.deadline_ms())
        self._log_routes(support)
        return api.ConfigureResponse(events=self.event_mask).SerializeToString()

    def _log_routes(self, support: RuntimeSupport) -> None:
        """Say once per connection which settings reach containers which way."""
        routes = adjustment.routes(support, self._config().resctrl.clos_field,
                                   self._reconciler_fields)
        log.info("runtime_fields", basis=support.basis, via_adjustment=routes["adjustment"],
                 via_reconciler=routes["reconciler"], not_applied=routes["none"])

    async def _synchronize(self, request: envelope.Request) -> bytes:
        self._require_configured("Synchronize")
        with self.handshake.answering():
            more = await self._synchronizer.take(request.payload, self.terms, self._reject)
        if more:
            return api.SynchronizeResponse(more=True).SerializeToString()
        self.handshake.synchronized.set()
        self._set_state("synchronized")
        return api.SynchronizeResponse(more=False).SerializeToString()

    async def _shutdown(self, request: envelope.Request) -> bytes:
        # The runtime never calls it; there is nothing to release early anyway.
        return b""

    # -- events ------------------------------------------------------------------------------

    def _create_container(self, request: envelope.Request) -> bytes | Awaitable[bytes]:
        self._require_configured("CreateContainer")
        req = self.events.decode("create_container", api.CreateContainerRequest,
                                 request.payload, self._reject)
        if req is None:
            return b""
        return self.events.handle(Event.CREATE_CONTAINER, req.pod, req.container, self.terms)

    def _notice(self, request_type: type[Any], response_type: type[Message],
                event: Event) -> Handler:
        """A handler for an event whose answer carries nothing (or is not ours to fill)."""
        answer = response_type().SerializeToString()
        name = event.name.lower()
        # Pod events' requests have no container.
        with_container = event not in POD_EVENTS

        def handle(request: envelope.Request) -> bytes | Awaitable[bytes]:
            self._require_configured(request.method)
            req = self.events.decode(name, request_type, request.payload, self._reject)
            if req is None:
                return answer
            handled = self.events.handle(event, req.pod,
                                         req.container if with_container else None, self.terms)
            return answer if isinstance(handled, bytes) else _replaced(handled, answer)

        return handle

    def _state_change(self, request: envelope.Request) -> bytes | Awaitable[bytes]:
        self._require_configured("StateChange")
        req = self.events.decode("state_change", api.StateChangeEvent, request.payload,
                                 self._reject)
        if req is None:
            return b""
        try:
            event = Event(req.event)
        except ValueError:
            self.events.policy().invalid_input(
                "state_change", MessageError(f"unknown event {req.event}"),
                pod_uid=bounded(req.pod.uid))
            return b""
        handled = self.events.handle(event, req.pod,
                                     None if event in POD_EVENTS else req.container, self.terms)
        return b"" if isinstance(handled, bytes) else _replaced(handled, b"")


_POD_RPCS = {
    "RunPodSandbox": Event.RUN_POD_SANDBOX,
    "PostUpdatePodSandbox": Event.POST_UPDATE_POD_SANDBOX,
    "StopPodSandbox": Event.STOP_POD_SANDBOX,
    "RemovePodSandbox": Event.REMOVE_POD_SANDBOX,
}
_CONTAINER_RPCS = {
    "PostCreateContainer": Event.POST_CREATE_CONTAINER,
    "StartContainer": Event.START_CONTAINER,
    "PostStartContainer": Event.POST_START_CONTAINER,
    "PostUpdateContainer": Event.POST_UPDATE_CONTAINER,
    "RemoveContainer": Event.REMOVE_CONTAINER,
}


def subscription_mask(followed: Iterable[Event], capabilities: Iterable[Capability],
                      support: RuntimeSupport) -> int:
    """The capabilities' events plus the followed ones, limited to what the runtime knows.

    A bit the runtime does not know gets the plugin rejected; 0 would mean "everything"
    (validation included), so the answer is never 0.
    """
    wanted = set(followed)
    for capability in capabilities:
        wanted |= capability.events
    # Validation is not served (answered UNIMPLEMENTED), so never subscribed to.
    wanted.discard(Event.VALIDATE_CONTAINER_ADJUSTMENT)
    mask = mask_of(wanted) & support.valid_events
    dropped = mask_of(wanted) & ~support.valid_events
    if dropped:
        log.warning("events_unsupported_by_runtime", dropped=_event_names(dropped),
                    valid=_event_names(support.valid_events))
    return mask or (mask_of(STATE_EVENTS) & support.valid_events)


def support_nri_text(support: RuntimeSupport, stated: str) -> str:
    """The runtime's NRI version as stated, else as inferred from its own version."""
    if stated:
        return bounded(stated)
    if support.nri_version is None:
        return "unknown"
    return "v" + ".".join(map(str, support.nri_version)) + " (inferred)"


def _rpc_types(method: str) -> tuple[type[Any], type[Message]]:
    return getattr(api, f"{method}Request"), getattr(api, f"{method}Response")


async def _replaced(handled: Awaitable[bytes], answer: bytes) -> bytes:
    await handled
    return answer


def _event_names(mask: int) -> list[str]:
    """The events of a mask by name (``update_pod_sandbox``), for a person reading the log."""
    return [e.name.lower() for e in Event if mask & e.bit]
