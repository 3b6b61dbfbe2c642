"""The plugin side of NRI: registration, configuration, synchronization and every event.

:class:`PluginStub` serves one runtime connection at a time (:meth:`PluginStub.serve`); the
daemon decides when to (re)connect. Each event is converted into plain views, its pod's QoS level
resolved, and the hooks subscribed to it run in a worker thread under the handler deadline. Their
answers merge into one adjustment; :class:`~nri_plugin.failure.FailurePolicy` decides what a
failure turns into.
"""

from __future__ import annotations

import asyncio
import contextvars
import functools
import threading
import time
from collections.abc import Awaitable, Callable, Coroutine, Iterable, Sequence
from concurrent.futures import Executor
from dataclasses import dataclass, replace
from typing import Any, TypeVar

import structlog
from google.protobuf.message import DecodeError, Message

from hooks.model import ContainerInfo, PodInfo, RuntimeInfo
from hooks.settings import ContainerSettings, merge
from nri_plugin.audit import AuditLog
from nri_plugin.chain import ContainerEvent, Hook, PodEvent
from nri_plugin.config.schema import Config
from nri_plugin.convert import InvalidInput, container_info, fill_adjustment, pod_info
from nri_plugin.envelope import RpcError
from nri_plugin.events import POD_EVENTS, Event, mask_of
from nri_plugin.failure import ChainOutcome, FailurePolicy
from nri_plugin.logs import event_context, timed_event
from nri_plugin.mux import PLUGIN_SERVICE_CONN, RUNTIME_SERVICE_CONN
from nri_plugin.pod_views import PodView, PodViews
from nri_plugin.transport import ConnectionClosed, Handler, TtrpcPeer
from nri_plugin.ttrpc import StatusCode
from nri_plugin.versions import RuntimeCapabilities
from protos import nri_api_pb2 as api
from protos import ttrpc_envelope_pb2 as envelope

PLUGIN_SERVICE = "nri.pkg.api.v1alpha1.Plugin"
RUNTIME_SERVICE = "nri.pkg.api.v1alpha1.Runtime"
PLUGIN_NRI_VERSION = "v0.12.2"
"""The NRI schema this plugin is built on, announced in RegisterPlugin."""
DEFAULT_REQUEST_TIMEOUT_MS = 2000
"""The runtime's request timeout when Configure does not say (NRI before 0.7)."""
MAX_REQUEST_TIMEOUT_MS = 3_600_000
"""Longer request timeouts than an hour are taken for garbage (the runtime default applies)."""
MIN_DEADLINE_MS = 10.0

STATE_EVENTS = frozenset({
    Event.RUN_POD_SANDBOX, Event.REMOVE_POD_SANDBOX,
    Event.CREATE_CONTAINER, Event.REMOVE_CONTAINER,
})
"""Events the daemon follows whatever hooks are enabled, to keep its view of the node current."""

log = structlog.get_logger("nri_qos.nri")

_in_handler: contextvars.ContextVar[bool] = contextvars.ContextVar("_in_handler", default=False)

M = TypeVar("M", bound=Message)
_Call = tuple[str, Callable[[], object]]
"""(hook name, bound hook method) as run by the worker thread."""


@dataclass(frozen=True, slots=True)
class PluginIdentity:
    name: str
    index: str


class _ChainRun:
    """One run of hook calls in a worker thread; what finished can be collected at any time."""

    def __init__(self, calls: Sequence[_Call]) -> None:
        self._calls = calls
        self._lock = threading.Lock()
        self._abandoned = False
        self._parts: list[tuple[str, ContainerSettings]] = []
        self._failures: list[tuple[str, str]] = []
        self._done = 0

    def __call__(self) -> None:
        for name, call in self._calls:
            with self._lock:
                if self._abandoned:
                    return
            part, failure = _call_hook(call)
            with self._lock:
                if part is not None:
                    self._parts.append((name, part))
                if failure is not None:
                    self._failures.append((name, failure))
                self._done += 1

    def collect(self, deadline_ms: float) -> ChainOutcome:
        """Stop the run after the current hook and return what finished before now."""
        with self._lock:
            self._abandoned = True
            return ChainOutcome(
                parts=tuple(self._parts),
                failures=tuple(self._failures),
                unfinished=tuple(name for name, _ in self._calls[self._done:]),
                deadline_ms=deadline_ms,
            )


class PluginStub:
    """The NRI plugin: serves the ``Plugin`` service and calls the ``Runtime`` service.

    ``config`` returns the configuration in force (read at every event, so reloads apply at
    once); ``hooks`` is the chain, fixed for the stub's lifetime because the event subscription
    is only negotiated at connection time. Hooks run in ``executor``.
    """

    def __init__(
        self,
        *,
        identity: PluginIdentity,
        config: Callable[[], Config],
        hooks: Sequence[Hook],
        audit: AuditLog,
        executor: Executor,
        required_events: frozenset[Event] = STATE_EVENTS,
        cgroup_v2: bool = False,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.identity = identity
        self._config = config
        self._hooks = tuple(hooks)
        # Per event: the hooks subscribed to it, and whether they all run inline (then the
        # event is handled, and answered, without ever waiting).
        self._chains = {event: tuple(h for h in self._hooks if event in h.events)
                        for event in Event}
        self._inline = {event: all(event in h.inline_events for h in chain)
                        for event, chain in self._chains.items()}
        self._audit = audit
        self._executor = executor
        self._required_events = required_events
        self._cgroup_v2 = cgroup_v2
        self._clock = clock
        self._peer: TtrpcPeer | None = None
        self._log_config: object = None
        self._bound_log: Any = log
        self._policies = {strict: FailurePolicy(audit, strict=strict) for strict in (False, True)}
        self._pod_views = PodViews()
        self._reset_session()
        self._handlers = self._build_handlers()

    # -- connection --------------------------------------------------------------------------

    def _reset_session(self) -> None:
        self.capabilities = RuntimeCapabilities.detect("", "", "")
        self.runtime = RuntimeInfo(cgroup_v2=self._cgroup_v2)
        self.request_timeout_ms = DEFAULT_REQUEST_TIMEOUT_MS
        self.event_mask = 0
        self.synchronized = asyncio.Event()
        # A new connection starts with a Synchronize; sandboxes removed meanwhile are not
        # announced, so nothing remembered from the last one is kept.
        self._pod_views.clear()
        self._sync_pods: list[api.PodSandbox] = []
        self._sync_containers: list[api.Container] = []
        # When the first chunk of the Synchronize in progress arrived: all chunks share one
        # request timeout on the runtime's side.
        self._sync_started: float | None = None

    @property
    def connected(self) -> bool:
        return self._peer is not None and not self._peer.closed

    def close(self, reason: str = "closed by the plugin") -> None:
        """End the current connection, if any; :meth:`serve` then returns."""
        if self._peer is not None:
            self._peer.close(reason)

    async def serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> str:
        """Register on a fresh connection and serve it until it ends; why it ended."""
        self._reset_session()
        peer = TtrpcPeer(reader, writer, serve_conn=PLUGIN_SERVICE_CONN,
                         call_conn=RUNTIME_SERVICE_CONN, handlers=self._handlers)
        self._peer = peer
        # Register at once, without waiting for the answer before serving: the runtime may send
        # Configure before its RegisterPlugin response reaches us.
        register = asyncio.create_task(self._register(peer))
        try:
            await peer.run()
        finally:
            register.cancel()
            await asyncio.gather(register, return_exceptions=True)
            self._peer = None
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
            log.error("registration_failed", plugin=self._full_name, error=str(exc))
            peer.close(f"registration failed: {exc}")
        except ConnectionClosed:
            return
        else:
            log.info("registered", plugin=self._full_name)

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

    async def _configure(self, request: envelope.Request) -> bytes:
        req = _parse(api.ConfigureRequest, request.payload)
        if req is None:
            raise RpcError(StatusCode.INVALID_ARGUMENT, "Configure payload does not decode")
        caps = RuntimeCapabilities.detect(req.NRI_version, req.runtime_name, req.runtime_version)
        self.capabilities = caps
        self.runtime = RuntimeInfo(name=req.runtime_name, version=req.runtime_version,
                                   nri_version=caps.nri_version, cgroup_v2=self._cgroup_v2)
        # 0 means "not sent" (NRI before 0.7); anything absurd is treated the same way.
        timeout = req.request_timeout
        self.request_timeout_ms = (timeout if 0 < timeout <= MAX_REQUEST_TIMEOUT_MS
                                   else DEFAULT_REQUEST_TIMEOUT_MS)
        self.event_mask = self.subscription_mask(caps)
        log.info("configured", runtime=req.runtime_name, runtime_version=req.runtime_version,
                 nri_version=req.NRI_version or None, events=hex(self.event_mask),
                 request_timeout_ms=self.request_timeout_ms, deadline_ms=self.deadline_ms())
        return api.ConfigureResponse(events=self.event_mask).SerializeToString()

    def subscription_mask(self, caps: RuntimeCapabilities) -> int:
        """The hooks' events plus the daemon's own, limited to what the runtime knows.

        A bit the runtime does not know gets the plugin rejected; 0 would mean "everything"
        (validation included), so the answer is never 0.
        """
        wanted = set(self._required_events)
        for hook in self._hooks:
            wanted |= hook.events
        # Validation is not served (answered UNIMPLEMENTED), so never subscribed to.
        wanted.discard(Event.VALIDATE_CONTAINER_ADJUSTMENT)
        mask = mask_of(wanted) & caps.valid_events
        dropped = mask_of(wanted) & ~caps.valid_events
        if dropped:
            log.warning("events_unsupported_by_runtime", dropped=hex(dropped),
                        valid=hex(caps.valid_events))
        return mask or (mask_of(STATE_EVENTS) & caps.valid_events)

    async def _synchronize(self, request: envelope.Request) -> bytes:
        req = _parse(api.SynchronizeRequest, request.payload)
        if req is None:
            raise RpcError(StatusCode.INVALID_ARGUMENT, "Synchronize payload does not decode")
        if self._sync_started is None:
            self._sync_started = self._clock()
        self._sync_pods.extend(req.pods)
        self._sync_containers.extend(req.containers)
        if req.more:
            # Updates wait for the last chunk; every earlier one is answered with more = true.
            return api.SynchronizeResponse(more=True).SerializeToString()
        pod_msgs, container_msgs = self._sync_pods, self._sync_containers
        self._sync_pods, self._sync_containers = [], []
        spent_ms = (self._clock() - self._sync_started) * 1000
        self._sync_started = None
        # Always fail-open here, strict or not: Synchronize vetoes nothing, and an error would
        # only get the plugin dropped, reconnect, and fail the same way again.
        policy = FailurePolicy(self._audit, strict=False)
        with timed_event(log, "synchronize", clock=self._clock) as outcome:
            outcome.fields.update(pods=len(pod_msgs), containers=len(container_msgs))
            pods: list[PodInfo] = []
            containers: list[ContainerInfo] = []
            for pod_msg in pod_msgs:
                try:
                    pods.append(pod_info(pod_msg))
                except InvalidInput as exc:
                    outcome.result = "invalid"
                    policy.invalid_input("synchronize", exc, pod_uid=pod_msg.uid)
            for container_msg in container_msgs:
                try:
                    containers.append(container_info(container_msg))
                except InvalidInput as exc:
                    outcome.result = "invalid"
                    policy.invalid_input("synchronize", exc, container=container_msg.name)
            if self._hooks:
                calls = [(hook.name, _bind(hook.synchronize, tuple(pods), tuple(containers)))
                         for hook in self._hooks]
                budget_ms = max(MIN_DEADLINE_MS, self.deadline_ms() - spent_ms)
                chain = await self._run_chain(calls, deadline_ms=budget_ms)
                policy.chain("synchronize", chain, pod_uid="", container="")
                if not chain.complete:
                    outcome.result = "partial"
        self.synchronized.set()
        return api.SynchronizeResponse(more=False).SerializeToString()

    async def _shutdown(self, request: envelope.Request) -> bytes:
        # The runtime never calls it; there is nothing to release early anyway.
        return b""

    # -- events ------------------------------------------------------------------------------

    def _create_container(self, request: envelope.Request) -> bytes | Awaitable[bytes]:
        req = self._decode("create_container", api.CreateContainerRequest, request.payload)
        if req is None:
            return b""
        response = api.CreateContainerResponse()
        handling = self._event(Event.CREATE_CONTAINER, req.pod, req.container, response.adjust)
        # An adjustment that sets nothing is answered as an empty payload (as a failure's,
        # cleared, one would otherwise still be present).
        return self._answer(Event.CREATE_CONTAINER, handling,
                            lambda: response.SerializeToString() if response.adjust.ByteSize()
                            else b"")

    def _answer(self, event: Event, handling: Coroutine[Any, Any, None],
                answer: Callable[[], bytes]) -> bytes | Awaitable[bytes]:
        """The answer now when every hook of ``event`` runs inline, else once ``handling`` is
        done (in a task of its own, see :mod:`nri_plugin.transport`)."""
        if self._inline[event]:
            try:
                _run_to_end(handling)
            except InlineWaited as exc:
                # A bug, not bad input: the same verdict as any failure outside the hooks (an
                # empty answer and an audit record, or an error status when strict).
                log.exception("event_handler_failed", nri_event=event.name.lower())
                self._policy().unexpected(event.name.lower(), exc)
                return b""
            return answer()
        return _answer_after(handling, answer)

    def _notice(self, request_type: type[Any], response_type: type[Message],
                event: Event) -> Handler:
        """A handler for an event whose answer carries nothing (or is not ours to fill)."""
        answer = response_type().SerializeToString()
        name = event.name.lower()
        # Pod events' requests have no container.
        with_container = event not in POD_EVENTS

        def handle(request: envelope.Request) -> bytes | Awaitable[bytes]:
            req = self._decode(name, request_type, request.payload)
            if req is None:
                return answer
            handling = self._event(event, req.pod, req.container if with_container else None)
            return self._answer(event, handling, lambda: answer)

        return handle

    async def _state_change(self, request: envelope.Request) -> bytes:
        req = self._decode("state_change", api.StateChangeEvent, request.payload)
        if req is None:
            return b""
        try:
            event = Event(req.event)
        except ValueError:
            self._policy().invalid_input("state_change", InvalidInput(f"unknown event {req.event}"),
                                         pod_uid=req.pod.uid)
            return b""
        if event in POD_EVENTS:
            await self._event(event, req.pod, None)
        else:
            await self._event(event, req.pod, req.container)
        return b""

    def _decode(self, name: str, message_type: type[M], payload: bytes) -> M | None:
        message = _parse(message_type, payload)
        if message is None:
            error = InvalidInput(f"{message_type.__name__} payload does not decode")
            self._policy().invalid_input(name, error)
        return message

    async def _event(self, event: Event, pod_msg: api.PodSandbox,
                     container_msg: api.Container | None,
                     adjust: api.ContainerAdjustment | None = None) -> None:
        """Run the chain for one event; for CreateContainer, fill in ``adjust``.

        Logs the one canonical line of the event.
        """
        started = self._clock()
        name = event.name.lower()
        result, extra = "error", {}
        try:
            result = await self._process(event, name, pod_msg, container_msg, adjust)
        except RpcError as exc:
            # The failure policy's own answer (strict mode).
            extra = {"error": exc.message}
            raise
        except Exception as exc:
            # Input no check anticipated, or a bug: the failure policy decides, as for a hook
            # that raised (fail open with an audit record, or an error status when strict).
            extra = {"error": f"{type(exc).__name__}: {exc}"}
            log.exception("event_handler_failed", nri_event=name)
            if adjust is not None:
                # Whatever was filled in before the failure is not answered.
                adjust.Clear()
            self._policy().unexpected(
                name, exc, pod_uid=pod_msg.uid,
                container=container_msg.name if container_msg is not None else "")
        finally:
            if event is Event.REMOVE_POD_SANDBOX:
                self._pod_views.forget(pod_msg.id)
            # Logged directly rather than through a bound context: this line is the only
            # per-event cost on the fast path (no hook subscribed). It is written on the next
            # turn of the loop, after the transport has sent the answer in this one: the
            # runtime waits for the answer, not for the log.
            asyncio.get_running_loop().call_soon(functools.partial(
                self._event_log().info,
                "nri_event", nri_event=name, pod=f"{pod_msg.namespace}/{pod_msg.name}",
                container=container_msg.name if container_msg is not None else None,
                duration_ms=round((self._clock() - started) * 1000, 3), result=result,
                **extra,
            ))

    async def _process(
        self, event: Event, name: str, pod_msg: api.PodSandbox,
        container_msg: api.Container | None, adjust: api.ContainerAdjustment | None,
    ) -> str:
        hooks = self._chains[event]
        if not hooks:
            return "ok"
        cfg = self._config()
        policy = self._policies[cfg.plugin.strict]
        try:
            view = self._pod_views.view(pod_msg, cfg.qos)
            container = container_info(container_msg) if container_msg is not None else None
        except InvalidInput as exc:
            policy.invalid_input(name, exc, pod_uid=pod_msg.uid,
                                 container=container_msg.name if container_msg else "")
            return "invalid"
        pod, level = view.pod, view.decision.level
        container_name = container.name if container is not None else ""
        if event in _LEVEL_AUDIT_EVENTS:
            self._audit_level(view, container_name)
        with event_context(name, pod=pod, container=container, qos_level=level):
            outcome = await self._run_chain(self._calls(event, hooks, pod, container, level),
                                            inline=self._inline[event])
        policy.chain(name, outcome, pod_uid=pod.uid, container=container_name)
        if adjust is not None and container is not None:
            self._fill(adjust, cfg, pod, container, level, outcome.parts)
        return "ok" if outcome.complete else "partial"

    def _calls(self, event: Event, hooks: Sequence[Hook], pod: PodInfo,
               container: ContainerInfo | None, level: str) -> list[_Call]:
        if event is Event.CREATE_CONTAINER and container is not None:
            ctr_event = ContainerEvent(pod, container, level, self.runtime)
            return [(hook.name, _bind(hook.create_container, ctr_event)) for hook in hooks]
        if event is Event.RUN_POD_SANDBOX:
            pod_event = PodEvent(pod, level, self.runtime)
            return [(hook.name, _bind(hook.run_pod_sandbox, pod_event)) for hook in hooks]
        if event is Event.REMOVE_POD_SANDBOX:
            pod_event = PodEvent(pod, level, self.runtime)
            return [(hook.name, _bind(hook.remove_pod_sandbox, pod_event)) for hook in hooks]
        return [(hook.name, _bind(hook.observe, event, pod, container)) for hook in hooks]

    async def _run_chain(self, calls: Sequence[_Call], *, inline: bool = False,
                         deadline_ms: float | None = None) -> ChainOutcome:
        """Run ``calls`` in order in a worker thread; collect what finished by the deadline
        (the handler deadline unless given).

        ``inline``: every call only computes (see :class:`~nri_plugin.chain.Hook`), so run them
        here and spare the thread hop; there is nothing a deadline could interrupt.
        """
        run = _ChainRun(calls)
        if inline:
            run()
            # Every call has returned: nothing is left for a deadline to name.
            return run.collect(0.0)
        if deadline_ms is None:
            deadline_ms = self.deadline_ms()
        # The worker runs in a copy of this event's context, so hooks log with its fields.
        context = contextvars.copy_context()
        future = asyncio.get_running_loop().run_in_executor(self._executor, context.run, run)
        try:
            await asyncio.wait({future}, timeout=deadline_ms / 1000)
        finally:
            outcome = run.collect(deadline_ms)
        return outcome

    def deadline_ms(self) -> float:
        """Budget of one handler: the configured deadline, kept below the runtime's timeout."""
        plugin = self._config().plugin
        budget = self.request_timeout_ms - plugin.deadline_margin_ms
        return max(MIN_DEADLINE_MS, float(min(plugin.deadline_ms, budget)))

    def _audit_level(self, view: PodView, container: str) -> None:
        decision = view.decision
        for source, value in decision.rejected:
            self._audit.record(
                "adjustment_skipped", pod_uid=view.pod.uid, container=container,
                reason=f"{source}: unknown QoS value {value!r}; level {decision.level} "
                       f"from {decision.source}",
            )

    def _fill(self, adjust: api.ContainerAdjustment, cfg: Config, pod: PodInfo,
              container: ContainerInfo, level: str,
              parts: Sequence[tuple[str, ContainerSettings]]) -> None:
        merged = merge(parts)
        for conflict in merged.conflicts:
            self._audit.record(
                "adjustment_conflict", pod_uid=pod.uid, container=container.name,
                field=conflict.field, kept_owner=conflict.owner,
                rejected_owner=conflict.rejected_by,
            )
        settings = merged.settings
        clos_field = self.capabilities.clos_field(cfg.resctrl.clos_field)
        if settings.rdt_class is not None and clos_field is None:
            self._skip(pod, container, f"runtime applies no CLOS field "
                                       f"(resctrl.clos_field = {cfg.resctrl.clos_field})")
            settings = replace(settings, rdt_class=None)
        if settings.oom_score_adj is not None and not self.capabilities.oom_score_adj:
            self._skip(pod, container, "runtime does not apply oom_score_adj adjustments")
            settings = replace(settings, oom_score_adj=None)
        if settings.is_empty():
            return
        fill_adjustment(adjust, settings, clos_field=clos_field)
        # Recorded on the next turn of the loop, like the event line: after the answer.
        asyncio.get_running_loop().call_soon(
            self._record_applied, pod.uid, container.name, level, settings)

    def _record_applied(self, pod_uid: str, container: str, level: str,
                        settings: ContainerSettings) -> None:
        self._audit.record("adjustment_applied", pod_uid=pod_uid, container=container,
                           qos_level=level, fields=_set_fields(settings))

    def _skip(self, pod: PodInfo, container: ContainerInfo, reason: str) -> None:
        self._audit.record("adjustment_skipped", pod_uid=pod.uid, container=container.name,
                           reason=reason)

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

    def _policy(self) -> FailurePolicy:
        return self._policies[self._config().plugin.strict]


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


def _rpc_types(method: str) -> tuple[type[Any], type[Message]]:
    return getattr(api, f"{method}Request"), getattr(api, f"{method}Response")


def _parse(message_type: type[M], payload: bytes) -> M | None:
    message = message_type()
    try:
        message.ParseFromString(payload)
    except DecodeError:
        return None
    return message


def _call_hook(call: Callable[[], object]) -> tuple[ContainerSettings | None, str | None]:
    """(settings, None) or (None, None) when the hook returned, (None, error text) if it raised."""
    try:
        result = call()
    except (Exception, asyncio.CancelledError) as exc:
        # A CancelledError raised by a hook's own code is the hook failing, not this event
        # being cancelled (that would come at an await, and a hook call has none).
        return None, f"{type(exc).__name__}: {exc}"
    return (result if isinstance(result, ContainerSettings) else None), None


def _bind(function: Callable[..., object], *args: object) -> Callable[[], object]:
    return lambda: function(*args)


class InlineWaited(RuntimeError):
    """An event handled inline tried to wait (a hook wrongly declared inline, or a bug)."""


def _run_to_end(handling: Coroutine[Any, Any, None]) -> None:
    """Run, here and now, an event's handling whose hooks all run inline: it never waits."""
    try:
        handling.send(None)
    except StopIteration:
        return
    handling.close()
    raise InlineWaited("an event handled inline waited")


async def _answer_after(handling: Awaitable[None], answer: Callable[[], bytes]) -> bytes:
    await handling
    return answer()


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


def _set_fields(settings: ContainerSettings) -> list[str]:
    fields = [name for name in ("rdt_class", "memory_limit", "memory_reservation",
                                "oom_score_adj") if getattr(settings, name) is not None]
    fields += [f"unified.{key}" for key in settings.unified]
    fields += [f"annotations.{key}" for key in settings.annotations]
    if settings.hooks:
        fields.append("hooks")
    return fields
