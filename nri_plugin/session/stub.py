"""The plugin side of an NRI session: registration, configuration, synchronization, every event.

:class:`PluginStub` serves one runtime connection at a time (:meth:`PluginStub.serve`); the
daemon decides when to (re)connect. For each event the stub converts the runtime's messages into
plain views, asks the node state for the pod's view and level (the one place that decides them,
for the reconciler too), keeps the node state current, and runs the capabilities subscribed to
the event (:mod:`nri_plugin.session.chain`): inline when they only compute, in a worker thread
under the handler deadline otherwise. Their parts become the CreateContainer answer
(:mod:`nri_plugin.session.adjustment`); :class:`~nri_plugin.session.failure.FailurePolicy`
decides what a failure turns into.

The runtime is not trusted to behave: every step of the handshake has a deadline (the runtime's
own registration timeout), a Configure that does not decode ends the session, no event is served
before Configure, a Synchronize is converted chunk by chunk into the compact views the node state
keeps (never held as raw messages) and refused whole when it lists more than the configured
limits, and every refusal is counted in :attr:`PluginStub.rejections`.
"""

from __future__ import annotations

import asyncio
import contextvars
import dataclasses
import functools
import time
from collections.abc import Awaitable, Callable, Iterable, Sequence
from concurrent.futures import Executor
from dataclasses import dataclass
from typing import Any, TypeVar

import structlog
from google.protobuf.message import DecodeError, Message

from hooks.events import POD_EVENTS, Event, mask_of
from hooks.model import ContainerInfo, PodInfo, ReadKeys, RuntimeInfo
from hooks.untrusted import bounded
from nri_plugin.config.schema import Config, PluginConfig
from nri_plugin.obs.log_context import bound_fields
from nri_plugin.session import adjustment
from nri_plugin.session.capability import Capability, ContainerEvent, PodEvent
from nri_plugin.session.chain import Call, ChainOutcome, bind, run_inline, run_threaded
from nri_plugin.session.failure import FailurePolicy
from nri_plugin.wire.convert import MAX_NAME_CHARS, MessageError, container_info, pod_info
from nri_plugin.wire.envelope import RpcError
from nri_plugin.wire.mux import PLUGIN_SERVICE_CONN, RUNTIME_SERVICE_CONN
from nri_plugin.wire.nri_api import (
    DEFAULT_REGISTRATION_TIMEOUT_MS,
    DEFAULT_REQUEST_TIMEOUT_MS,
    PLUGIN_SERVICE,
    RUNTIME_SERVICE,
)
from nri_plugin.wire.rejections import Rejection, RejectionCounts
from nri_plugin.wire.runtime_support import UNCONFIGURED, RuntimeSupport
from nri_plugin.wire.transport import ConnectionClosed, Handler, TtrpcPeer
from nri_plugin.wire.ttrpc import StatusCode
from protos import nri_api_pb2 as api
from protos import ttrpc_envelope_pb2 as envelope
from reconciler.aio import wait_for_event
from reconciler.audit import AuditLog
from reconciler.metrics import Metrics
from reconciler.state import NodeState, PodView

PLUGIN_NRI_VERSION = "v0.12.2"
"""The NRI schema this plugin is built on, announced in RegisterPlugin."""
MAX_REQUEST_TIMEOUT_MS = 3_600_000
"""Longer request or registration timeouts than an hour are taken for garbage (the runtime
default applies)."""
MIN_DEADLINE_MS = 10.0
SYNC_BATCH = 256
"""Pods or containers of a Synchronize chunk converted between two turns of the event loop, so a
large chunk never holds up the other requests for long."""

STATE_EVENTS = frozenset({
    Event.RUN_POD_SANDBOX, Event.REMOVE_POD_SANDBOX,
    Event.CREATE_CONTAINER, Event.REMOVE_CONTAINER,
})
"""Events followed whatever capabilities are enabled: a pod's view is kept from its sandbox's
first event until its removal."""
LIFECYCLE_EVENTS = STATE_EVENTS | frozenset({
    Event.STOP_POD_SANDBOX, Event.UPDATE_POD_SANDBOX, Event.START_CONTAINER,
    Event.UPDATE_CONTAINER, Event.STOP_CONTAINER,
})
"""Events followed when the reconciler runs: it needs every container's state."""

log = structlog.get_logger("nri_qos.nri")

# The event log's result -> the metrics' result (an "error" answered empty is "fail-open").
_METRIC_RESULT = {"ok": "ok", "partial": "fail-open", "invalid": "fail-open", "error": "error"}

_in_handler: contextvars.ContextVar[bool] = contextvars.ContextVar("_in_handler", default=False)

M = TypeVar("M", bound=Message)


@dataclass(frozen=True, slots=True)
class PluginIdentity:
    name: str
    index: str


@dataclass(slots=True)
class _SyncProgress:
    """A Synchronize whose chunks are arriving: what they held, already converted."""

    started: float
    pods: list[PodInfo] = dataclasses.field(default_factory=list)
    containers: list[ContainerInfo] = dataclasses.field(default_factory=list)
    listed_pods: int = 0
    listed_containers: int = 0
    wire_bytes: int = 0
    refused_objects: int = 0
    first_refusal: str = ""
    # Why the Synchronize is over its limits (its content is then no longer converted).
    over: str | None = None


@dataclass(frozen=True, slots=True)
class _Prepared:
    """An event ready to run its capabilities."""

    event: Event
    name: str
    view: PodView
    container: ContainerInfo | None
    calls: list[Call]
    config: Config


class PluginStub:
    """The NRI plugin: serves the ``Plugin`` service and calls the ``Runtime`` service.

    ``config`` returns the configuration in force (read at every event, so reloads apply at
    once); ``capabilities`` is the chain, fixed for the stub's lifetime because the event
    subscription is only negotiated at connection time. Capabilities that may block run in
    ``executor``. ``state`` holds the node's pods and containers and decides levels; with
    ``track_containers`` every container's lifecycle is fed into it (the reconciler needs that).
    ``reconciler_fields`` names the settings fields a background loop applies to running
    containers, which the answer may therefore leave to it when the runtime would drop them.
    ``metrics`` hears of every request (after its answer), of the connection's state and of the
    fields the answers set.
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
        metrics: Metrics | None = None,
    ) -> None:
        self.identity = identity
        self._config = config
        self._capabilities = tuple(capabilities)
        # Per event: the capabilities subscribed to it, and whether they all run inline (then
        # the event is handled, and answered, without ever waiting).
        self._chains = {event: tuple(c for c in self._capabilities if event in c.events)
                        for event in Event}
        self._inline = {event: all(event in c.inline_events for c in chain)
                        for event, chain in self._chains.items()}
        self._audit = audit
        self._executor = executor
        self._state = state
        self._tracking = track_containers
        self._followed = LIFECYCLE_EVENTS if track_containers else STATE_EVENTS
        self._reconciler_fields = reconciler_fields
        self._cgroup_v2 = cgroup_v2
        self._clock = clock
        self._wall_clock = wall_clock
        self._metrics = metrics
        # The runtime connection: its state (see reconciler.metrics.CONNECTION_STATES), when
        # it entered it (``clock``), and how many connections were made.
        self.connection_state = "disconnected"
        self.state_since = clock()
        self.connections = 0
        self._peer: TtrpcPeer | None = None
        self._log_config: object = None
        self._bound_log: Any = log
        self._keys_config: Config | None = None
        self._keys = ReadKeys(frozenset())
        self._policies = {strict: FailurePolicy(audit, strict=strict) for strict in (False, True)}
        self.rejections = RejectionCounts()
        """Refusals on the NRI connection since the stub was made, by kind (for metrics)."""
        self._reset_session()
        self._handlers = self._build_handlers()

    # -- connection --------------------------------------------------------------------------

    def _reset_session(self) -> None:
        self.support = UNCONFIGURED
        self.runtime = RuntimeInfo(cgroup_v2=self._cgroup_v2)
        self.configured = False
        self.request_timeout_ms = DEFAULT_REQUEST_TIMEOUT_MS
        # Until Configure tells the runtime's own, the handshake's steps get the configured one.
        self.registration_timeout_ms = self._config().plugin.register_timeout_ms
        self.event_mask = 0
        # The runtime's NRI version as stated in Configure, or as inferred.
        self.nri_version_text = ""
        self.synchronized = asyncio.Event()
        self._registered = asyncio.Event()
        # Set at every step of the handshake (Configure, each Synchronize chunk).
        self._progress = asyncio.Event()
        # The Synchronize in progress; its chunks share one request timeout on the runtime's
        # side, counted from the first one.
        self._sync: _SyncProgress | None = None

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

    async def serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> str:
        """Register on a fresh connection and serve it until it ends; why it ended."""
        self._reset_session()
        peer = TtrpcPeer(reader, writer, serve_conn=PLUGIN_SERVICE_CONN,
                         call_conn=RUNTIME_SERVICE_CONN, handlers=self._handlers,
                         rejections=self.rejections,
                         stall_timeout_s=self.registration_timeout_ms / 1000)
        self._peer = peer
        self.connections += 1
        if self.connections > 1 and self._metrics is not None:
            self._metrics.nri_reconnected()
        self._set_state("connected")
        try:
            async with asyncio.TaskGroup() as group:
                # Register at once, without waiting for the answer before serving: the runtime
                # may send Configure before its RegisterPlugin response reaches us.
                registering = group.create_task(self._register(peer))
                watchdog = group.create_task(self._watch_handshake(peer))
                running = group.create_task(peer.run())

                def ended(_: object) -> None:
                    registering.cancel()
                    watchdog.cancel()

                running.add_done_callback(ended)
        finally:
            self._peer = None
            self._set_state("disconnected")
        return peer.end_reason

    async def _register(self, peer: TtrpcPeer) -> None:
        request = api.RegisterPluginRequest(
            plugin_name=self.identity.name, plugin_idx=self.identity.index,
            NRI_version=PLUGIN_NRI_VERSION,
        )
        timeout = self._config().plugin.register_timeout_ms / 1000
        try:
            await peer.call(RUNTIME_SERVICE, "RegisterPlugin", request.SerializeToString(),
                            timeout_s=timeout)
        except RpcError as exc:
            # The runtime's words are logged once, here; the reason the connection ended (which
            # is logged too) only points to them.
            log.error("registration_failed", plugin=self._full_name,
                      error=bounded(exc.message, 512), code=exc.code)
            peer.close(f"registration failed with code {exc.code} (see registration_failed)")
        except ConnectionClosed:
            return
        else:
            log.info("registered", plugin=self._full_name)
            self._registered.set()

    async def _watch_handshake(self, peer: TtrpcPeer) -> None:
        """Close the connection when the runtime does not take the next step of the handshake
        within its registration timeout: Configure after RegisterPlugin was answered, then each
        chunk of Synchronize. A runtime that stalls there (restarting, behind a stalled proxy)
        would otherwise leave the plugin connected and never serving; closing goes back to
        connecting, with the usual backoff."""
        await self._registered.wait()
        while not self.synchronized.is_set():
            if not self.configured:
                step = "Configure after RegisterPlugin"
            elif self._sync is None:
                step = "Synchronize after Configure"
            else:
                step = "the next Synchronize chunk"
            timeout_ms = self.registration_timeout_ms
            self._progress.clear()
            if await wait_for_event(self._progress, timeout_ms / 1000) \
                    or self.synchronized.is_set():
                continue
            if peer.closed:
                return  # ended meanwhile, for a reason of its own (already logged)
            self._reject(Rejection.HANDSHAKE_TIMEOUT, f"no {step} within {timeout_ms} ms")
            log.warning("handshake_timeout", waiting_for=step, timeout_ms=timeout_ms)
            peer.close(f"handshake timeout: no {step} within {timeout_ms} ms")
            return

    def _reject(self, kind: Rejection, detail: str) -> None:
        peer = self._peer
        if peer is not None:
            peer.rejections(kind, detail)
        else:
            self.rejections.add(kind)

    def _require_configured(self, method: str) -> None:
        """Refuse a request that needs a configured session (FAILED_PRECONDITION): events and
        Synchronize are never served on a session Configure did not set up."""
        if not self.configured:
            detail = f"{method} before Configure"
            self._reject(Rejection.OUT_OF_ORDER, detail)
            raise RpcError(StatusCode.FAILED_PRECONDITION, f"nri-qos: {detail}")

    @property
    def _full_name(self) -> str:
        return f"{self.identity.index}-{self.identity.name}"

    async def update_containers(
        self, updates: Iterable[api.ContainerUpdate], *, timeout_s: float | None = None
    ) -> list[api.ContainerUpdate]:
        """Ask the runtime to update existing containers; the updates that failed.

        Must not be awaited from inside a request handler: the runtime holds its lock while it
        waits for the handler's answer, so the call could only time out.
        """
        if _in_handler.get():
            raise RuntimeError("update_containers must not be awaited from an NRI request handler")
        peer = self._peer
        if peer is None or peer.closed:
            raise ConnectionClosed("not connected to the runtime")
        request = api.UpdateContainersRequest(update=list(updates))
        seconds = timeout_s if timeout_s is not None else self.request_timeout_ms / 1000
        payload = await peer.call(RUNTIME_SERVICE, "UpdateContainers",
                                  request.SerializeToString(), timeout_s=seconds)
        response = _parse(api.UpdateContainersResponse, payload)
        if response is None:
            raise RpcError(StatusCode.INTERNAL, "UpdateContainers response does not decode")
        return list(response.failed)

    # -- dispatch table ----------------------------------------------------------------------

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
        return {(PLUGIN_SERVICE, method): _guarded(handler) for method, handler in table.items()}

    # -- handshake ---------------------------------------------------------------------------

    def _configure(self, request: envelope.Request) -> bytes:
        req = _parse(api.ConfigureRequest, request.payload)
        if req is None:
            # Half configured is no state to serve from: the answer says why, then the
            # connection ends (after the answer went out) and the plugin connects again.
            self._reject(Rejection.BAD_PAYLOAD, "ConfigureRequest payload does not decode")
            peer = self._peer
            if peer is not None:
                asyncio.get_running_loop().call_soon(
                    peer.close, "Configure payload does not decode")
            raise RpcError(StatusCode.INVALID_ARGUMENT, "Configure payload does not decode")
        support = RuntimeSupport.detect(req.NRI_version, req.runtime_name, req.runtime_version)
        self.support = support
        # Kept for the session and shown to policies: cut to what any real name fits in.
        self.runtime = RuntimeInfo(name=req.runtime_name[:MAX_NAME_CHARS],
                                   version=req.runtime_version[:MAX_NAME_CHARS],
                                   nri_version=support.nri_version, cgroup_v2=self._cgroup_v2)
        self._state.set_runtime_fields(support.fields)
        # 0 means "not sent" (NRI before 0.7); anything absurd is treated the same way.
        timeout = req.request_timeout
        self.request_timeout_ms = (timeout if 0 < timeout <= MAX_REQUEST_TIMEOUT_MS
                                   else DEFAULT_REQUEST_TIMEOUT_MS)
        registration = req.registration_timeout
        self.registration_timeout_ms = (registration
                                        if 0 < registration <= MAX_REQUEST_TIMEOUT_MS
                                        else DEFAULT_REGISTRATION_TIMEOUT_MS)
        if self._peer is not None:
            self._peer.stall_timeout_s = self.registration_timeout_ms / 1000
        self.event_mask = self.subscription_mask(support)
        self.nri_version_text = support_nri_text(support, req.NRI_version)
        if self._metrics is not None:
            self._metrics.nri_runtime(bounded(req.runtime_name), bounded(req.runtime_version),
                                      self.nri_version_text)
        self.configured = True
        self._progress.set()
        log.info("configured", runtime=bounded(req.runtime_name),
                 runtime_version=bounded(req.runtime_version),
                 nri_version=bounded(req.NRI_version) or None, events=hex(self.event_mask),
                 request_timeout_ms=self.request_timeout_ms,
                 registration_timeout_ms=self.registration_timeout_ms,
                 deadline_ms=self.deadline_ms())
        self._log_routes(support)
        return api.ConfigureResponse(events=self.event_mask).SerializeToString()

    def _log_routes(self, support: RuntimeSupport) -> None:
        """Say once per connection which settings reach containers which way."""
        routes = adjustment.routes(support, self._config().resctrl.clos_field,
                                   self._reconciler_fields)
        log.info("runtime_fields", basis=support.basis, via_adjustment=routes["adjustment"],
                 via_reconciler=routes["reconciler"], not_applied=routes["none"])

    def subscription_mask(self, support: RuntimeSupport) -> int:
        """The capabilities' events plus the followed ones, limited to what the runtime knows.

        A bit the runtime does not know gets the plugin rejected; 0 would mean "everything"
        (validation included), so the answer is never 0.
        """
        wanted = set(self._followed)
        for capability in self._capabilities:
            wanted |= capability.events
        # Validation is not served (answered UNIMPLEMENTED), so never subscribed to.
        wanted.discard(Event.VALIDATE_CONTAINER_ADJUSTMENT)
        mask = mask_of(wanted) & support.valid_events
        dropped = mask_of(wanted) & ~support.valid_events
        if dropped:
            log.warning("events_unsupported_by_runtime", dropped=_event_names(dropped),
                        valid=_event_names(support.valid_events))
        return mask or (mask_of(STATE_EVENTS) & support.valid_events)

    async def _synchronize(self, request: envelope.Request) -> bytes:
        self._require_configured("Synchronize")
        sync = self._sync
        if sync is None:
            sync = self._sync = _SyncProgress(self._clock())
        self._progress.set()
        payload = request.payload
        sync.wire_bytes += len(payload)
        req = _parse(api.SynchronizeRequest, payload)
        del payload
        if req is None:
            self._sync = None
            self._reject(Rejection.BAD_PAYLOAD, "SynchronizeRequest payload does not decode")
            raise RpcError(StatusCode.INVALID_ARGUMENT, "Synchronize payload does not decode")
        more = req.more
        sync.listed_pods += len(req.pods)
        sync.listed_containers += len(req.containers)
        cfg = self._config()
        if sync.over is None:
            sync.over = _over_limit(sync, cfg.plugin)
        if sync.over is None:
            # Converted now, chunk by chunk: only the compact views are kept until the last one.
            await self._take_chunk(sync, req, self._read_keys(cfg))
        del req
        if more:
            # Updates wait for the last chunk; every earlier one is answered with more = true.
            return api.SynchronizeResponse(more=True).SerializeToString()
        self._sync = None
        if sync.over is not None:
            self._refuse_sync(sync.over)
        else:
            await self._apply_sync(sync)
        self.synchronized.set()
        self._set_state("synchronized")
        return api.SynchronizeResponse(more=False).SerializeToString()

    async def _take_chunk(self, sync: _SyncProgress, req: api.SynchronizeRequest,
                          keys: ReadKeys) -> None:
        done = 0
        for pod_msg in req.pods:
            try:
                sync.pods.append(pod_info(pod_msg, keys))
            except MessageError as exc:
                _note_refusal(sync, f"pod {bounded(pod_msg.uid)}: {exc}")
            done += 1
            if done % SYNC_BATCH == 0:
                await asyncio.sleep(0)
        for container_msg in req.containers:
            try:
                sync.containers.append(container_info(container_msg))
            except MessageError as exc:
                _note_refusal(sync, f"container {bounded(container_msg.name)}: {exc}")
            done += 1
            if done % SYNC_BATCH == 0:
                await asyncio.sleep(0)

    def _refuse_sync(self, over: str) -> None:
        """Take nothing from a Synchronize over the limits: the node state keeps what it knew,
        events go on being served, and the audit trail says why."""
        self._reject(Rejection.SYNCHRONIZE_OVER_LIMIT, over)
        self._audit.record("event_failed", nri_event="synchronize", pod_uid="", container="",
                           reason=f"Synchronize refused: {over}; the pods and containers known "
                                  "so far stay in use")
        self._event_log().info("nri_event", nri_event="synchronize", result="invalid",
                               refused=over)

    async def _apply_sync(self, sync: _SyncProgress) -> None:
        spent_ms = (self._clock() - sync.started) * 1000
        # Always fail-open here, strict or not: Synchronize vetoes nothing, and an error would
        # only get the plugin dropped, reconnect, and fail the same way again.
        policy = self._policies[False]
        started = self._clock()
        result = "ok"
        pods, containers = sync.pods, sync.containers
        if sync.refused_objects:
            # One record for all of them: a runtime listing thousands of unusable objects must
            # not write thousands of lines.
            result = "invalid"
            policy.invalid_input("synchronize", MessageError(
                f"{sync.refused_objects} pods or containers refused, the first: "
                f"{sync.first_refusal}"))
        self._state.replace_all(pods, containers)
        if self._capabilities:
            calls = [(c.name, bind(c.synchronize, tuple(pods), tuple(containers)))
                     for c in self._capabilities]
            budget_ms = max(MIN_DEADLINE_MS, self.deadline_ms() - spent_ms)
            chain = await run_threaded(calls, self._executor, budget_ms)
            policy.chain("synchronize", chain, pod_uid="", container="")
            if not chain.complete:
                result = "partial"
        seconds = self._clock() - started
        self._event_log().info("nri_event", nri_event="synchronize", pods=len(pods),
                               containers=len(containers), result=result,
                               duration_ms=round(seconds * 1000, 3))
        if self._metrics is not None:
            self._metrics.nri_request("synchronize", _METRIC_RESULT[result], seconds)

    async def _shutdown(self, request: envelope.Request) -> bytes:
        # The runtime never calls it; there is nothing to release early anyway.
        return b""

    # -- events ------------------------------------------------------------------------------

    def _create_container(self, request: envelope.Request) -> bytes | Awaitable[bytes]:
        self._require_configured("CreateContainer")
        req = self._decode("create_container", api.CreateContainerRequest, request.payload)
        if req is None:
            return b""
        return self._handle(Event.CREATE_CONTAINER, req.pod, req.container)

    def _notice(self, request_type: type[Any], response_type: type[Message],
                event: Event) -> Handler:
        """A handler for an event whose answer carries nothing (or is not ours to fill)."""
        answer = response_type().SerializeToString()
        name = event.name.lower()
        # Pod events' requests have no container.
        with_container = event not in POD_EVENTS

        def handle(request: envelope.Request) -> bytes | Awaitable[bytes]:
            self._require_configured(request.method)
            req = self._decode(name, request_type, request.payload)
            if req is None:
                return answer
            handled = self._handle(event, req.pod, req.container if with_container else None)
            return answer if isinstance(handled, bytes) else _replaced(handled, answer)

        return handle

    def _state_change(self, request: envelope.Request) -> bytes | Awaitable[bytes]:
        self._require_configured("StateChange")
        req = self._decode("state_change", api.StateChangeEvent, request.payload)
        if req is None:
            return b""
        try:
            event = Event(req.event)
        except ValueError:
            self._policy().invalid_input(
                "state_change", MessageError(f"unknown event {req.event}"),
                pod_uid=bounded(req.pod.uid))
            return b""
        handled = self._handle(event, req.pod, None if event in POD_EVENTS else req.container)
        return b"" if isinstance(handled, bytes) else _replaced(handled, b"")

    def _decode(self, name: str, message_type: type[M], payload: bytes) -> M | None:
        """The event's message; None (answered empty, or an error status when strict) when it
        does not decode. That is a refusal on the wire, counted and logged once per connection:
        there is no pod or container to write an audit record about."""
        started = self._clock()
        message = _parse(message_type, payload)
        if message is None:
            detail = f"{message_type.__name__} payload does not decode"
            self._reject(Rejection.BAD_PAYLOAD, detail)
            if self._policy().strict:
                self._count(name, "error", started)
                raise RpcError(StatusCode.INVALID_ARGUMENT, f"nri-qos {name}: {detail}")
            self._count(name, "fail-open", started)
        return message

    def _count(self, name: str, result: str, started: float) -> None:
        if self._metrics is not None:
            self._metrics.nri_request(name, result, self._clock() - started)

    def _handle(self, event: Event, pod_msg: api.PodSandbox,
                container_msg: api.Container | None) -> bytes | Awaitable[bytes]:
        """Handle one event: the answer's payload (CreateContainer's adjustment, else empty) at
        once when every capability of the event runs inline, else an awaitable of it. Writes
        the event's one canonical log line."""
        started = self._clock()
        outcome: ChainOutcome | None = None
        try:
            prepared = self._prepare(event, pod_msg, container_msg)
            if prepared is None:
                self._log_event(event, pod_msg, container_msg, started, "ok")
                return b""
            if isinstance(prepared, str):
                self._log_event(event, pod_msg, container_msg, started, prepared)
                return b""
            if self._inline[event]:
                with self._context(prepared):
                    outcome = run_inline(prepared.calls)
        except RpcError as exc:
            self._log_event(event, pod_msg, container_msg, started, "error", exc.message)
            self._forget_removed(event, pod_msg)
            raise
        except Exception as exc:
            return self._failed(event, exc, pod_msg, container_msg, started)
        # Outside the try: _finish logs, counts and forgets the pod itself, also when it raises.
        if outcome is not None:
            return self._finish(prepared, outcome, pod_msg, container_msg, started)
        return self._finish_later(prepared, pod_msg, container_msg, started)

    async def _finish_later(self, prepared: _Prepared, pod_msg: api.PodSandbox,
                            container_msg: api.Container | None, started: float) -> bytes:
        try:
            with self._context(prepared):
                outcome = await run_threaded(prepared.calls, self._executor, self.deadline_ms())
        except Exception as exc:
            return self._failed(prepared.event, exc, pod_msg, container_msg, started)
        return self._finish(prepared, outcome, pod_msg, container_msg, started)

    def _prepare(self, event: Event, pod_msg: api.PodSandbox,
                 container_msg: api.Container | None) -> _Prepared | str | None:
        """The event's pod view, container and capability calls, with the node state fed.

        None when there is nothing to run; a result text when the input is unusable (audited,
        or raised as an error status under strict handling)."""
        chain = self._chains[event]
        followed = event in self._followed
        if not chain and not followed:
            return None
        cfg = self._config()
        name = event.name.lower()
        keys = self._read_keys(cfg)
        try:
            view = self._state.pod_view(pod_msg.id, lambda: pod_info(pod_msg, keys))
            container = None
            if container_msg is not None and (chain or self._tracking):
                container = container_info(container_msg)
        except MessageError as exc:
            self._policy(cfg).invalid_input(
                name, exc, pod_uid=bounded(pod_msg.uid),
                container=bounded(container_msg.name) if container_msg is not None else "")
            self._forget_removed(event, pod_msg)
            return "invalid"
        if followed and event is not Event.REMOVE_POD_SANDBOX:
            self._feed(event, view, container)
        if event in _LEVEL_AUDIT_EVENTS and chain:
            self._audit_level(view, container.name if container is not None else "")
        return _Prepared(event, name, view, container,
                         self._calls(event, chain, view, container), cfg)

    def _feed(self, event: Event, view: PodView, container: ContainerInfo | None) -> None:
        """Keep the node state current (inline: a dict update under a briefly held lock)."""
        if container is None:
            self._state.pod_event(event)
        elif event is Event.REMOVE_CONTAINER:
            self._state.remove_container(container, event)
        elif self._tracking:
            self._state.put_container(view.info.id, container, event,
                                      running=event is not Event.STOP_CONTAINER)

    def _calls(self, event: Event, chain: Sequence[Capability], view: PodView,
               container: ContainerInfo | None) -> list[Call]:
        pod, level = view.info, view.level
        if event is Event.CREATE_CONTAINER and container is not None:
            ctr_event = ContainerEvent(pod, container, level, self.runtime)
            return [(c.name, bind(c.create_container, ctr_event)) for c in chain]
        if event is Event.RUN_POD_SANDBOX:
            pod_event = PodEvent(pod, level, self.runtime)
            return [(c.name, bind(c.run_pod_sandbox, pod_event)) for c in chain]
        if event is Event.REMOVE_POD_SANDBOX:
            pod_event = PodEvent(pod, level, self.runtime)
            return [(c.name, bind(c.remove_pod_sandbox, pod_event)) for c in chain]
        return [(c.name, bind(c.observe, event, pod, container)) for c in chain]

    def _finish(self, prepared: _Prepared, outcome: ChainOutcome, pod_msg: api.PodSandbox,
                container_msg: api.Container | None, started: float) -> bytes:
        """The failure policy's verdict, the answer and the event's log line."""
        event = prepared.event
        try:
            pod, container = prepared.view.info, prepared.container
            container_name = container.name if container is not None else ""
            if not outcome.complete:
                self._policy(prepared.config).chain(prepared.name, outcome,
                                                    pod_uid=bounded(pod.uid),
                                                    container=bounded(container_name))
            payload = b""
            if event is Event.CREATE_CONTAINER and container is not None:
                payload = self._answer(prepared, outcome)
        except RpcError as exc:
            self._log_event(event, pod_msg, container_msg, started, "error", exc.message)
            raise
        except Exception as exc:
            return self._failed(event, exc, pod_msg, container_msg, started)
        finally:
            self._forget_removed(event, pod_msg)
        self._log_event(event, pod_msg, container_msg, started,
                        "ok" if outcome.complete else "partial")
        return payload

    def _answer(self, prepared: _Prepared, outcome: ChainOutcome) -> bytes:
        cfg, pod, container = prepared.config, prepared.view.info, prepared.container
        assert container is not None
        decided = adjustment.decide(outcome.parts, self.support, cfg.resctrl.clos_field,
                                    self._reconciler_fields)
        if decided.conflicts or decided.deferred or decided.dropped:
            self._audit_decided(decided, bounded(pod.uid), bounded(container.name))
        payload = adjustment.encode(decided)
        if payload:
            # Recorded on the next turn of the loop, like the event line: after the answer.
            asyncio.get_running_loop().call_soon(
                self._record_applied, pod, container.name, prepared.view.level, decided)
        return payload

    def _audit_decided(self, decided: adjustment.Adjustment, pod_uid: str, name: str) -> None:
        for conflict in decided.conflicts:
            self._audit.record(
                "adjustment_conflict", pod_uid=pod_uid, container=name,
                field=conflict.field, kept_owner=conflict.owner,
                rejected_owner=conflict.rejected_by,
            )
        for field in decided.deferred:
            self._audit.record("adjustment_deferred", pod_uid=pod_uid, container=name,
                               field=field, applied_by="reconciler after the container starts",
                               runtime=bounded(self.runtime.version))
        for _field, reason in decided.dropped:
            self._audit.record("adjustment_skipped", pod_uid=pod_uid, container=name,
                               reason=reason)

    def _failed(self, event: Event, exc: Exception, pod_msg: api.PodSandbox,
                container_msg: api.Container | None, started: float) -> bytes:
        """Handling failed outside the capabilities (unforeseen input, or a bug): the failure
        policy decides, as for a capability that raised (an empty answer and an audit record, or
        an error status when strict)."""
        name = event.name.lower()
        error = f"{type(exc).__name__}: {bounded(str(exc), 512)}"
        log.exception("event_handler_failed", nri_event=name)
        self._forget_removed(event, pod_msg)
        try:
            self._policy().unexpected(
                name, exc, pod_uid=bounded(pod_msg.uid),
                container=bounded(container_msg.name) if container_msg is not None else "")
        except RpcError as verdict:
            self._log_event(event, pod_msg, container_msg, started, "error", verdict.message)
            raise
        self._log_event(event, pod_msg, container_msg, started, "error", error, failed_open=True)
        return b""

    def _forget_removed(self, event: Event, pod_msg: api.PodSandbox) -> None:
        if event is Event.REMOVE_POD_SANDBOX:
            self._state.remove_pod(pod_msg.id, event)

    def _log_event(self, event: Event, pod_msg: api.PodSandbox,
                   container_msg: api.Container | None, started: float, result: str,
                   error: str | None = None, *, failed_open: bool = False) -> None:
        # Written (and counted) on the next turn of the loop, after the transport has sent the
        # answer in this one: the runtime waits for the answer, not for the log.
        seconds = self._clock() - started
        name = event.name.lower()
        extra = {"error": bounded(error, 512)} if error is not None else {}
        asyncio.get_running_loop().call_soon(functools.partial(
            self._event_done, "fail-open" if failed_open else _METRIC_RESULT[result], seconds,
            nri_event=name, pod=bounded(f"{pod_msg.namespace}/{pod_msg.name}"),
            pod_uid=bounded(pod_msg.uid), pod_namespace=bounded(pod_msg.namespace),
            pod_name=bounded(pod_msg.name),
            container=bounded(container_msg.name) if container_msg is not None else None,
            duration_ms=round(seconds * 1000, 3), result=result, **extra,
        ))

    def _event_done(self, metric_result: str, seconds: float, **fields: Any) -> None:
        self._event_log().info("nri_event", **fields)
        if self._metrics is not None:
            self._metrics.nri_request(fields["nri_event"], metric_result, seconds)

    def _context(self, prepared: _Prepared) -> Any:
        """The event's fields on every log line and audit record written while it runs."""
        pod = prepared.view.info
        fields: dict[str, Any] = {"nri_event": prepared.name,
                                  "pod_namespace": bounded(pod.namespace),
                                  "pod_name": bounded(pod.name),
                                  "pod_uid": bounded(pod.uid),
                                  "qos_level": prepared.view.level}
        if prepared.container is not None:
            fields["container"] = bounded(prepared.container.name)
        return bound_fields(fields)

    def deadline_ms(self) -> float:
        """Budget of one handler: the configured deadline, kept below the runtime's timeout."""
        plugin = self._config().plugin
        budget = self.request_timeout_ms - plugin.deadline_margin_ms
        return max(MIN_DEADLINE_MS, float(min(plugin.deadline_ms, budget)))

    def _audit_level(self, view: PodView, container: str) -> None:
        decision = view.decision
        for source, value in decision.rejected:
            self._audit.record(
                "adjustment_skipped", pod_uid=bounded(view.info.uid), container=bounded(container),
                reason=f"{source}: unknown QoS value '{bounded(value)}'; level "
                       f"{decision.level} from {decision.source}",
            )

    def _record_applied(self, pod: PodInfo, container: str, level: str,
                        decided: adjustment.Adjustment) -> None:
        fields = adjustment.set_fields(decided.settings)
        self._audit.record("adjustment_applied", pod_uid=bounded(pod.uid),
                           pod_namespace=bounded(pod.namespace), pod_name=bounded(pod.name),
                           container=bounded(container), qos_level=level, fields=fields)
        if self._metrics is not None:
            # Annotation keys are the admin's: one label value for all of them.
            self._metrics.nri_adjusted(
                {"annotations" if f.startswith("annotations.") else f for f in fields})

    def _read_keys(self, cfg: Config) -> ReadKeys:
        if cfg is not self._keys_config:
            self._keys_config, self._keys = cfg, cfg.read_keys()
        return self._keys

    def _event_log(self) -> Any:
        """The logger of the canonical event line, bound once per logging configuration.

        structlog's lazy proxy builds a new logger on every call; binding it once saves that,
        and rebinding when the logging section changes picks up a reloaded configuration.
        """
        logging_cfg = self._config().logging
        if logging_cfg != self._log_config:
            self._log_config = logging_cfg
            self._bound_log = log.bind()
        return self._bound_log

    def _policy(self, cfg: Config | None = None) -> FailurePolicy:
        return self._policies[(cfg or self._config()).plugin.strict]


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
# Events at which a pod's unusable QoS values are audited (once per pod and once per container,
# instead of at every event).
_LEVEL_AUDIT_EVENTS = frozenset({Event.RUN_POD_SANDBOX, Event.CREATE_CONTAINER})


def support_nri_text(support: RuntimeSupport, stated: str) -> str:
    """The runtime's NRI version as stated, else as inferred from its own version."""
    if stated:
        return bounded(stated)
    if support.nri_version is None:
        return "unknown"
    return "v" + ".".join(map(str, support.nri_version)) + " (inferred)"


def _rpc_types(method: str) -> tuple[type[Any], type[Message]]:
    return getattr(api, f"{method}Request"), getattr(api, f"{method}Response")


def _parse(message_type: type[M], payload: bytes) -> M | None:
    message = message_type()
    try:
        message.ParseFromString(payload)
    except DecodeError:
        return None
    return message


async def _replaced(handled: Awaitable[bytes], answer: bytes) -> bytes:
    await handled
    return answer


def _guarded(handler: Handler) -> Handler:
    def run(request: envelope.Request) -> bytes | Awaitable[bytes]:
        result = handler(request)
        # An answer given at once came from code that cannot wait, so it cannot have awaited
        # update_containers either.
        return result if isinstance(result, bytes) else _marked(result)

    return run


async def _marked(pending: Awaitable[bytes]) -> bytes:
    # Each waiting request runs in its own task, hence its own context: this marks only this one.
    _in_handler.set(True)
    return await pending


def _over_limit(sync: _SyncProgress, limits: PluginConfig) -> str | None:
    """Why the Synchronize received so far is over the configured limits, or None."""
    if sync.listed_pods > limits.max_sync_pods:
        return f"{sync.listed_pods} pods, more than plugin.max_sync_pods = {limits.max_sync_pods}"
    if sync.listed_containers > limits.max_sync_containers:
        return (f"{sync.listed_containers} containers, more than plugin.max_sync_containers = "
                f"{limits.max_sync_containers}")
    if sync.wire_bytes > limits.max_sync_bytes:
        return (f"{sync.wire_bytes} bytes, more than plugin.max_sync_bytes = "
                f"{limits.max_sync_bytes}")
    return None


def _note_refusal(sync: _SyncProgress, error: str) -> None:
    sync.refused_objects += 1
    if not sync.first_refusal:
        sync.first_refusal = error


def _event_names(mask: int) -> list[str]:
    """The events of a mask by name (``update_pod_sandbox``), for a person reading the log."""
    return [e.name.lower() for e in Event if mask & e.bit]
