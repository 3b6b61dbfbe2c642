"""The node's pods and containers as the reconciler sees them.

Two sources, merged here and nowhere else:

* **NRI** (authoritative for what runs): :class:`StateTracker` is a hook in the NRI chain; it
  subscribes to every pod and container lifecycle event and to Synchronize, which replaces the
  whole NRI view after each (re)connection.
* **The Kubernetes pod watch** (optional): :meth:`NodeState.apply_meta` takes a
  :class:`~reconciler.podmeta.PodMeta` per pod. It adds what NRI does not know (priority, owner
  kind, memory requests) and overrides the annotations and labels NRI saw at creation: the API
  server holds the current ones, so an annotation changed after creation reaches the policies.

Threading: the tracker runs on the event loop (or the stub's worker threads) and the loops'
cycles in their own worker threads, so every mutation holds one :class:`threading.Lock`, briefly.
Readers never see the mutable dicts: :meth:`NodeState.snapshot` returns an immutable
:class:`Snapshot`, built outside the lock from copies and cached until the next change
(``version``), so an idle loop pays nothing to read the state. Wake-up callbacks run after the
lock is released.
"""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from types import MappingProxyType

from hooks.model import ContainerInfo, PodInfo
from hooks.settings import EMPTY_SETTINGS, ContainerSettings
from nri_plugin.chain import ContainerEvent, Hook, PodEvent
from nri_plugin.events import Event
from reconciler.podmeta import PodMeta

POD_LIFECYCLE = frozenset({
    Event.RUN_POD_SANDBOX, Event.STOP_POD_SANDBOX, Event.REMOVE_POD_SANDBOX,
    Event.UPDATE_POD_SANDBOX,
})
CONTAINER_LIFECYCLE = frozenset({
    Event.CREATE_CONTAINER, Event.START_CONTAINER, Event.UPDATE_CONTAINER,
    Event.STOP_CONTAINER, Event.REMOVE_CONTAINER,
})
ALL_LIFECYCLE = POD_LIFECYCLE | CONTAINER_LIFECYCLE

Callback = Callable[[], None]


@dataclass(frozen=True, slots=True)
class PodView:
    """A pod with the API's view merged in (``info`` is what policies get)."""

    info: PodInfo
    meta: PodMeta | None


@dataclass(frozen=True, slots=True)
class ContainerView:
    info: ContainerInfo
    pod: PodView
    running: bool


@dataclass(frozen=True, slots=True)
class Snapshot:
    version: int
    # pod sandbox id -> pod
    pods: Mapping[str, PodView]
    containers: tuple[ContainerView, ...]
    pod_uids: frozenset[str]

    def running(self) -> tuple[ContainerView, ...]:
        return tuple(c for c in self.containers if c.running)


@dataclass(eq=False, slots=True)
class _Subscription:
    callback: Callback
    events: frozenset[Event]
    meta: bool


class NodeState:
    """Pods and containers from NRI, enriched by the pod watch; safe to use from any thread."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._pods: dict[str, PodInfo] = {}
        self._containers: dict[str, ContainerInfo] = {}
        self._stopped: set[str] = set()
        self._meta: dict[str, PodMeta] = {}
        self._version = 0
        # NRI's full view has arrived (Synchronize): only then is a missing pod really gone.
        self._synced = False
        self._snapshot: Snapshot | None = None
        self._subscriptions: list[_Subscription] = []

    # -- subscriptions ---------------------------------------------------------------------------

    def subscribe(self, callback: Callback, *, events: frozenset[Event] = frozenset(),
                  meta: bool = False) -> Callback:
        """Call ``callback`` (from whatever thread made the change) after any of ``events`` or,
        with ``meta``, after the pod watch changed a pod. Synchronize notifies everyone.
        Returns the function that ends the subscription."""
        subscription = _Subscription(callback, events, meta)
        with self._lock:
            self._subscriptions.append(subscription)

        def unsubscribe() -> None:
            with self._lock:
                if subscription in self._subscriptions:
                    self._subscriptions.remove(subscription)

        return unsubscribe

    def _notify(self, event: Event | None, *, meta: bool = False, everyone: bool = False) -> None:
        with self._lock:
            targets = [s.callback for s in self._subscriptions
                       if everyone or (meta and s.meta)
                       or (event is not None and event in s.events)]
        for callback in targets:
            callback()

    # -- NRI side --------------------------------------------------------------------------------

    def replace_all(self, pods: Sequence[PodInfo], containers: Sequence[ContainerInfo]) -> None:
        with self._lock:
            self._pods = {p.id: p for p in pods}
            self._containers = {c.id: c for c in containers if c.pod_sandbox_id in self._pods}
            self._stopped.clear()
            self._synced = True
            self._changed()
        self._notify(None, everyone=True)

    def put_pod(self, pod: PodInfo, event: Event) -> None:
        with self._lock:
            self._pods[pod.id] = pod
            self._changed()
        self._notify(event)

    def remove_pod(self, pod: PodInfo, event: Event) -> None:
        with self._lock:
            self._pods.pop(pod.id, None)
            for cid in [c.id for c in self._containers.values() if c.pod_sandbox_id == pod.id]:
                del self._containers[cid]
                self._stopped.discard(cid)
            self._changed()
        self._notify(event)

    def put_container(self, pod: PodInfo, container: ContainerInfo, event: Event,
                      *, running: bool = True) -> None:
        with self._lock:
            self._pods.setdefault(pod.id, pod)
            self._containers[container.id] = container
            if running:
                self._stopped.discard(container.id)
            else:
                self._stopped.add(container.id)
            self._changed()
        self._notify(event)

    def remove_container(self, container: ContainerInfo, event: Event) -> None:
        with self._lock:
            self._containers.pop(container.id, None)
            self._stopped.discard(container.id)
            self._changed()
        self._notify(event)

    # -- pod watch side --------------------------------------------------------------------------

    def apply_meta(self, meta: PodMeta) -> None:
        """The watch's callback: remember (or, for a deleted pod, forget) the API's view."""
        if not meta.uid:
            return
        with self._lock:
            if meta.deleted:
                changed = self._meta.pop(meta.uid, None) is not None
            else:
                changed = self._meta.get(meta.uid) != meta
                self._meta[meta.uid] = meta
            if changed:
                self._changed()
        if changed:
            self._notify(None, meta=True)

    # -- readers ---------------------------------------------------------------------------------

    @property
    def version(self) -> int:
        return self._version

    @property
    def synced(self) -> bool:
        """True once a Synchronize delivered the runtime's complete view."""
        return self._synced

    def snapshot(self) -> Snapshot:
        # The merge is O(pods + containers): it runs outside the lock, on copies, so NRI events
        # (applied inline on the event loop) never wait for a snapshot of a large node.
        with self._lock:
            cached = self._snapshot
            if cached is not None and cached.version == self._version:
                return cached
            version = self._version
            pods, containers = dict(self._pods), list(self._containers.values())
            stopped, meta = frozenset(self._stopped), dict(self._meta)
        snapshot = _build(version, pods, containers, stopped, meta)
        with self._lock:
            if self._snapshot is None or self._snapshot.version < version:
                self._snapshot = snapshot
        return snapshot

    def _changed(self) -> None:
        self._version += 1


def _build(version: int, pods: Mapping[str, PodInfo], containers: Sequence[ContainerInfo],
           stopped: frozenset[str], meta: Mapping[str, PodMeta]) -> Snapshot:
    views = {pid: _merge_pod(pod, meta.get(pod.uid)) for pid, pod in pods.items()}
    merged = []
    for c in containers:
        pod = views.get(c.pod_sandbox_id)
        if pod is None:
            continue
        merged.append(ContainerView(_merge_container(c, pod.meta), pod, c.id not in stopped))
    return Snapshot(version, MappingProxyType(views), tuple(merged),
                    frozenset(p.info.uid for p in views.values()))


def _merge_pod(pod: PodInfo, meta: PodMeta | None) -> PodView:
    if meta is None:
        return PodView(pod, None)
    merged = dataclasses.replace(
        pod,
        annotations=MappingProxyType(dict(meta.annotations)),
        labels=MappingProxyType(dict(meta.labels)),
        priority=meta.priority if meta.priority is not None else pod.priority,
    )
    return PodView(merged, meta)


def _merge_container(container: ContainerInfo, meta: PodMeta | None) -> ContainerInfo:
    if meta is None:
        return container
    request = meta.memory_requests.get(container.name, container.memory_request)
    limit = container.memory_limit
    if limit is None:
        limit = meta.memory_limits.get(container.name)
    if request == container.memory_request and limit == container.memory_limit:
        return container
    return dataclasses.replace(container, memory_request=request, memory_limit=limit)


class StateTracker(Hook):
    """Feeds :class:`NodeState` from the NRI chain; never changes an adjustment."""

    name = "state"
    # Every handler only updates dicts under a briefly held lock: no thread hop needed.
    events = inline_events = ALL_LIFECYCLE

    def __init__(self, state: NodeState) -> None:
        self.state = state

    def run_pod_sandbox(self, event: PodEvent) -> None:
        self.state.put_pod(event.pod, Event.RUN_POD_SANDBOX)

    def remove_pod_sandbox(self, event: PodEvent) -> None:
        self.state.remove_pod(event.pod, Event.REMOVE_POD_SANDBOX)

    def create_container(self, event: ContainerEvent) -> ContainerSettings:
        self.state.put_container(event.pod, event.container, Event.CREATE_CONTAINER)
        return EMPTY_SETTINGS

    def observe(self, event: Event, pod: PodInfo, container: ContainerInfo | None) -> None:
        if container is None:
            if event == Event.REMOVE_POD_SANDBOX:
                self.state.remove_pod(pod, event)
            elif event in POD_LIFECYCLE:
                self.state.put_pod(pod, event)
            return
        if event == Event.REMOVE_CONTAINER:
            self.state.remove_container(container, event)
        elif event in CONTAINER_LIFECYCLE:
            self.state.put_container(pod, container, event,
                                     running=event != Event.STOP_CONTAINER)

    def synchronize(self, pods: Sequence[PodInfo], containers: Sequence[ContainerInfo]) -> None:
        self.state.replace_all(pods, containers)
