"""One NRI event, from the decoded request to its answer, audit records, event line and metrics.

For each event the handler asks the node state for the pod's view and level (the one place that
decides them, for the reconciler too), keeps the node state current, and runs the capabilities
subscribed to the event (:mod:`nri_plugin.session.chain`): inline when they only compute, in a
worker thread under the handler deadline otherwise. Their parts become the CreateContainer
answer (:mod:`nri_plugin.session.adjustment`); :class:`~nri_plugin.session.failure.FailurePolicy`
decides what a failure turns into.

It holds no connection: what Configure settled comes with every event as a
:class:`~nri_plugin.session.terms.SessionTerms`, so it runs without a socket.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import time
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Sequence
from concurrent.futures import Executor
from dataclasses import dataclass
from typing import Any

import structlog

from common.audit import AuditLog
from common.metrics import PluginMetrics
from common.state import NodeState, PodView, merge_container
from hooks.events import Event
from hooks.model import ContainerInfo, PodInfo, ReadKeys
from hooks.untrusted import bounded
from nri_plugin.config.schema import Config
from nri_plugin.obs.log_context import bound_fields
from nri_plugin.session import adjustment
from nri_plugin.session.capability import Capability, ContainerEvent, PodEvent
from nri_plugin.session.chain import Call, ChainOutcome, bind, run_inline, run_threaded
from nri_plugin.session.event_log import METRIC_RESULT, EventLog
from nri_plugin.session.failure import FailurePolicy
from nri_plugin.session.terms import SessionTerms
from nri_plugin.session.workload_records import WorkloadRecords
from nri_plugin.wire.convert import container_info, convert_pod
from nri_plugin.wire.errors import MessageError, RpcError
from nri_plugin.wire.messages import M, parse_message
from nri_plugin.wire.rejections import Rejection
from nri_plugin.wire.status import StatusCode
from protos import nri_api_pb2 as api

STATE_EVENTS = frozenset({
    Event.RUN_POD_SANDBOX, Event.REMOVE_POD_SANDBOX,
    Event.CREATE_CONTAINER, Event.REMOVE_CONTAINER,
})
"""Events followed whatever capabilities are enabled: a pod's view is kept from its sandbox's
first event until its removal."""
LIFECYCLE_EVENTS = STATE_EVENTS | frozenset({
    Event.STOP_POD_SANDBOX, Event.UPDATE_POD_SANDBOX, Event.START_CONTAINER,
    Event.UPDATE_CONTAINER, Event.POST_UPDATE_CONTAINER, Event.STOP_CONTAINER,
})
"""Events followed when the reconciler runs: it needs every container's state, resources
changed by an update (an in-place resize) included: UpdateContainer shows the container as it
was, PostUpdateContainer as the update left it."""
_KUBELETS_RESOURCES = frozenset({Event.CREATE_CONTAINER, Event.POST_UPDATE_CONTAINER})
"""Events whose container shows kubelet's resources: at creation, before any plugin adjusted
them, and after an update, the update's. At every other event the runtime shows its spec with
this agent's adjustment in it (its ``memory.min``, v1 reservation, ``oom_score_adj``), which,
read as the request or kubelet's score, would compound at each loop pass."""

# Events at which a pod's unusable QoS values are audited (once per pod and once per container,
# instead of at every event).
_LEVEL_AUDIT_EVENTS = frozenset({Event.RUN_POD_SANDBOX, Event.CREATE_CONTAINER})
REMOVED_PODS_KEPT = 4096
"""Sandbox ids of removed pods remembered, so that an event still coming about one (a stop seen
by containerd's asynchronous task-exit path) does not leave it in the node state, where nothing
would ever remove it again."""

log = structlog.get_logger("nri_qos.nri")


@dataclass(frozen=True, slots=True)
class _Prepared:
    """An event ready to run its capabilities."""

    event: Event
    name: str
    view: PodView
    container: ContainerInfo | None
    calls: list[Call]
    config: Config
    terms: SessionTerms


class EventHandler:
    """Handles the events of every connection, one call of :meth:`handle` per request.

    ``config`` returns the configuration in force (read at every event, so reloads apply at
    once); ``capabilities`` is the chain, fixed for the handler's lifetime because the event
    subscription is only negotiated at connection time. Capabilities that may block run in
    ``executor``. ``state`` holds the node's pods and containers and decides levels; with
    ``track_containers`` every container's lifecycle is fed into it (the reconciler needs that).
    ``reconciler_fields`` names the settings fields a background loop applies to running
    containers, which the answer may therefore leave to it when the runtime would drop them.
    ``metrics`` hears of every event (after its answer) and of the fields the answers set.
    """

    def __init__(
        self,
        *,
        config: Callable[[], Config],
        capabilities: Sequence[Capability],
        audit: AuditLog,
        executor: Executor,
        state: NodeState,
        metrics: PluginMetrics | None = None,
        track_containers: bool = False,
        reconciler_fields: frozenset[str] = frozenset(),
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._config = config
        # Per event: the capabilities subscribed to it, and whether they all run inline (then
        # the event is handled, and answered, without ever waiting).
        self._chains = {event: tuple(c for c in capabilities if event in c.events)
                        for event in Event}
        self._inline = {event: all(event in c.inline_events for c in chain)
                        for event, chain in self._chains.items()}
        self._executor = executor
        self._state = state
        self._event_log = EventLog(config, metrics, clock)
        self._records = WorkloadRecords(audit, metrics)
        self._tracking = track_containers
        self.followed = LIFECYCLE_EVENTS if track_containers else STATE_EVENTS
        """The events that feed the node state, whether or not a capability subscribes."""
        self._reconciler_fields = reconciler_fields
        self._clock = clock
        self._keys_config: Config | None = None
        self._keys = ReadKeys(frozenset())
        self._policies = {strict: FailurePolicy(audit, strict=strict) for strict in (False, True)}
        self._removed: OrderedDict[str, None] = OrderedDict()

    def policy(self, cfg: Config | None = None) -> FailurePolicy:
        """The failure policy of ``cfg`` (by default the configuration in force)."""
        return self._policies[(cfg or self._config()).plugin.strict]

    def decode(self, name: str, message_type: type[M], payload: bytes,
               reject: Callable[[Rejection, str], None]) -> M | None:
        """The event's message; None (answered empty, or an error status when strict) when it
        does not decode. That is a refusal on the wire, counted (``reject``) and logged once per
        connection: there is no pod or container to write an audit record about."""
        started = self._clock()
        message = parse_message(message_type, payload)
        if message is None:
            detail = f"{message_type.__name__} payload does not decode"
            reject(Rejection.BAD_PAYLOAD, detail)
            if self.policy().strict:
                self._event_log.count_since(name, "error", started)
                raise RpcError(StatusCode.INVALID_ARGUMENT, f"nri-qos {name}: {detail}")
            self._event_log.count_since(name, "fail-open", started)
        return message

    def handle(self, event: Event, pod_msg: api.PodSandbox, container_msg: api.Container | None,
               terms: SessionTerms) -> bytes | Awaitable[bytes]:
        """Handle one event: the answer's payload (CreateContainer's adjustment, else empty) at
        once when every capability of the event runs inline, else an awaitable of it. Writes
        the event's one canonical log line."""
        started = self._clock()
        outcome: ChainOutcome | None = None
        try:
            prepared = self._prepare(event, pod_msg, container_msg, terms)
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
                deadline_ms = prepared.terms.deadline_ms(self._config().plugin)
                outcome = await run_threaded(prepared.calls, self._executor, deadline_ms)
        except Exception as exc:
            return self._failed(prepared.event, exc, pod_msg, container_msg, started)
        return self._finish(prepared, outcome, pod_msg, container_msg, started)

    def _prepare(self, event: Event, pod_msg: api.PodSandbox, container_msg: api.Container | None,
                 terms: SessionTerms) -> _Prepared | str | None:
        """The event's pod view, container and capability calls, with the node state fed.

        None when there is nothing to run; a result text when the input is unusable (audited,
        or raised as an error status under strict handling)."""
        chain = self._chains[event]
        followed = event in self.followed
        if not chain and not followed:
            return None
        removed = pod_msg.id in self._removed
        if removed and event is Event.RUN_POD_SANDBOX:
            del self._removed[pod_msg.id]
            removed = False
        cfg = self._config()
        name = event.name.lower()
        keys = self._read_keys(cfg)
        try:
            view = self._state.pod_view(
                pod_msg.id, lambda: self._first_sight(pod_msg, container_msg, keys))
            container = None
            if container_msg is not None and (chain or self._tracking):
                container = container_info(container_msg)
        except MessageError as exc:
            self.policy(cfg).invalid_input(
                name, exc, pod_uid=bounded(pod_msg.uid),
                container=bounded(container_msg.name) if container_msg is not None else "")
            self._forget_removed(event, pod_msg)
            return "invalid"
        # The capabilities still hear of a removed pod's late event; the node state does not
        # take it back (it goes again once the event is handled).
        if followed and event is not Event.REMOVE_POD_SANDBOX and not removed:
            self._feed(event, view, container)
        if event in _LEVEL_AUDIT_EVENTS and chain:
            self._records.level(view, container.name if container is not None else "")
        calls = _calls(event, chain, view, container, terms)
        return _Prepared(event, name, view, container, calls, cfg, terms)

    def _first_sight(self, pod_msg: api.PodSandbox, container_msg: api.Container | None,
                     keys: ReadKeys) -> PodInfo:
        """The pod as the node state keeps it; annotations and labels left out whole (as too
        large) are audited here, once per pod."""
        converted = convert_pod(pod_msg, keys)
        if converted.ignored:
            self._records.ignored(
                converted, bounded(container_msg.name) if container_msg is not None else "")
        return converted.info

    def _feed(self, event: Event, view: PodView, container: ContainerInfo | None) -> None:
        """Keep the node state current (inline: a dict update under a briefly held lock)."""
        if container is None:
            self._state.pod_event(event)
        elif event is Event.REMOVE_CONTAINER:
            self._state.remove_container(container, event)
        elif self._tracking:
            if event is not Event.CREATE_CONTAINER:  # new at creation: nothing known to keep
                container = _kubelets(container, self._state.container(container.id), event)
            self._state.put_container(view.info.id, container, event,
                                      running=event is not Event.STOP_CONTAINER)

    def _finish(self, prepared: _Prepared, outcome: ChainOutcome, pod_msg: api.PodSandbox,
                container_msg: api.Container | None, started: float) -> bytes:
        """The failure policy's verdict, the answer and the event's log line."""
        event = prepared.event
        try:
            pod, container = prepared.view.info, prepared.container
            container_name = container.name if container is not None else ""
            if not outcome.complete:
                self.policy(prepared.config).chain(prepared.name, outcome,
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
        terms = prepared.terms
        decided = adjustment.decide(outcome.parts, terms.support, cfg.resctrl.clos_field,
                                    self._reconciler_fields)
        if decided.conflicts or decided.deferred or decided.dropped:
            self._records.decided(decided, bounded(pod.uid), bounded(container.name),
                                  terms.runtime)
        payload = adjustment.encode(decided)
        if payload:
            # Recorded on the next turn of the loop, like the event line: after the answer.
            asyncio.get_running_loop().call_soon(
                self._records.applied, pod, container.name, prepared.view.level, decided)
        return payload

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
            self.policy().unexpected(
                name, exc, pod_uid=bounded(pod_msg.uid),
                container=bounded(container_msg.name) if container_msg is not None else "")
        except RpcError as verdict:
            self._log_event(event, pod_msg, container_msg, started, "error", verdict.message)
            raise
        self._log_event(event, pod_msg, container_msg, started, "error", error, failed_open=True)
        return b""

    def _forget_removed(self, event: Event, pod_msg: api.PodSandbox) -> None:
        if event is Event.REMOVE_POD_SANDBOX or pod_msg.id in self._removed:
            self._state.remove_pod(pod_msg.id, event)
            self._removed[pod_msg.id] = None
            if len(self._removed) > REMOVED_PODS_KEPT:
                self._removed.popitem(last=False)

    def _log_event(self, event: Event, pod_msg: api.PodSandbox,
                   container_msg: api.Container | None, started: float, result: str,
                   error: str | None = None, *, failed_open: bool = False) -> None:
        # Written (and counted) on the next turn of the loop, after the transport has sent the
        # answer in this one: the runtime waits for the answer, not for the log.
        seconds = self._clock() - started
        name = event.name.lower()
        extra = {"error": bounded(error, 512)} if error is not None else {}
        asyncio.get_running_loop().call_soon(functools.partial(
            self._event_log.done, "fail-open" if failed_open else METRIC_RESULT[result], seconds,
            nri_event=name, pod=bounded(f"{pod_msg.namespace}/{pod_msg.name}"),
            pod_uid=bounded(pod_msg.uid), pod_namespace=bounded(pod_msg.namespace),
            pod_name=bounded(pod_msg.name),
            container=bounded(container_msg.name) if container_msg is not None else None,
            duration_ms=round(seconds * 1000, 3), result=result, **extra,
        ))

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

    def _read_keys(self, cfg: Config) -> ReadKeys:
        if cfg is not self._keys_config:
            self._keys_config, self._keys = cfg, cfg.read_keys()
        return self._keys


def _calls(event: Event, chain: Sequence[Capability], view: PodView,
           container: ContainerInfo | None, terms: SessionTerms) -> list[Call]:
    """The capabilities' calls for the event, each bound to what it is to see."""
    pod, level, runtime = view.info, view.level, terms.runtime
    if event is Event.CREATE_CONTAINER and container is not None:
        # The pod's requests from the API, as its annotations (``view.info``): the answer then
        # protects what the policies give from requests at creation, not from the first
        # drift cycle after the container started.
        ctr_event = ContainerEvent(pod, merge_container(container, view.meta), level, runtime)
        return [(c.name, bind(c.create_container, ctr_event)) for c in chain]
    if event is Event.RUN_POD_SANDBOX:
        pod_event = PodEvent(pod, level, runtime)
        return [(c.name, bind(c.run_pod_sandbox, pod_event)) for c in chain]
    if event is Event.REMOVE_POD_SANDBOX:
        pod_event = PodEvent(pod, level, runtime)
        return [(c.name, bind(c.remove_pod_sandbox, pod_event)) for c in chain]
    return [(c.name, bind(c.observe, event, pod, container)) for c in chain]


def _kubelets(container: ContainerInfo, known: ContainerInfo | None,
              event: Event) -> ContainerInfo:
    """``container`` with the resources kubelet gave it where ``known`` has them: from the
    events of :data:`_KUBELETS_RESOURCES` the limit, request and MemoryQoS ``memory.high`` they
    show (an update's request and ``memory.high`` only when it says one), never the score,
    which no update changes."""
    if known is None:
        return container
    if event in _KUBELETS_RESOURCES:
        return dataclasses.replace(
            container, oom_score_adj=known.oom_score_adj,
            memory_request=container.memory_request if container.memory_request is not None
            else known.memory_request,
            memory_high=container.memory_high if container.memory_high is not None
            else known.memory_high)
    return dataclasses.replace(container, memory_limit=known.memory_limit,
                               memory_request=known.memory_request,
                               oom_score_adj=known.oom_score_adj,
                               memory_high=known.memory_high)
