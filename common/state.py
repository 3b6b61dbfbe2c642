"""The node's pods and containers as the NRI plugin and the reconciler see them.

Two sources, merged here and nowhere else:

* **NRI** (authoritative for what runs): the NRI stub feeds every pod and container lifecycle
  event in, and Synchronize replaces the whole NRI view after each (re)connection.
* **The Kubernetes pod watch** (optional): :meth:`NodeState.apply_meta` takes a
  :class:`~common.podmeta.PodMeta` per pod. It adds what NRI does not know (priority, owner
  kind, memory requests) and overrides the annotations and labels NRI saw at creation: the API
  server holds the current ones, so an annotation changed after creation reaches the policies.
  The exception are annotations kubelet itself stamps on the pods it runs
  (:data:`~common.podmeta.KUBELET_STAMPED`): the runtime's copy is kubelet's, the API's is
  the pod author's.

A pod's QoS level is decided here and nowhere else, from the merged view: the CreateContainer
answer (:meth:`NodeState.pod_view`) and the loops (:meth:`NodeState.snapshot`) read the same
:class:`PodView`, so creation and reconciliation never disagree about a pod's level, also after
an annotation changed. A view is worked out once per pod and kept until the pod, its metadata or
the ``[qos]`` section changes. The level the runtime's copy gives a pod is the ceiling of the
merged view's claims: the API's annotations and labels are as much the pod author's as the
runtime's, and a claim raised after creation would otherwise lift a running pod out of the
offline tier. A refused claim is reported once per pod and refusal (``on_refused``).

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
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass
from types import MappingProxyType

from common.audit import AuditLog
from common.metrics import Metrics
from common.podmeta import KUBELET_STAMPED, PodMeta
from hooks.events import Event
from hooks.model import ContainerInfo, PodInfo
from hooks.qos_level import LevelDecision, QosConfig, Refusal, resolve_level
from hooks.untrusted import bounded

Callback = Callable[[], None]
RefusalCallback = Callable[[PodInfo, Refusal], None]
KubeletValues = tuple[int | None, int | None, str | None]
"""A container's memory request, ``oom_score_adj`` and MemoryQoS ``memory.high`` as kubelet
gave them to the runtime (None: kubelet gave none)."""

DEFAULT_POD_LIMIT = 4096
"""Pods remembered at most: far above any node's pod count, so only pods whose removal was never
seen (e.g. while disconnected from the runtime) are ever pushed out, oldest first."""
DEFAULT_CONTAINER_LIMIT = 16384
"""Containers remembered at most: four per pod at the pod limit, where real pods have one to
three; beyond it the oldest container is forgotten (until the next Synchronize lists it)."""

_DEFAULT_QOS = QosConfig()


@dataclass(frozen=True, slots=True)
class PodView:
    """A pod with the API's view merged in (``info`` is what policies get) and its level."""

    info: PodInfo
    meta: PodMeta | None
    decision: LevelDecision
    # Annotations whose value the API's copy changed from the runtime's (set, removed or
    # different): what only the background loops can have read, after creation.
    changed_by_api: frozenset[str] = frozenset()

    @property
    def level(self) -> str:
        return self.decision.level


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
    # The [qos] section the levels were resolved with.
    qos: QosConfig

    def running(self) -> tuple[ContainerView, ...]:
        return tuple(c for c in self.containers if c.running)


@dataclass(eq=False, slots=True)
class _Subscription:
    callback: Callback
    events: frozenset[Event]
    meta: bool


class NodeState:
    """Pods and containers from NRI, enriched by the pod watch; safe to use from any thread.

    ``qos`` returns the ``[qos]`` section in force (levels are resolved again when it is a new
    object); at most ``pod_limit`` pods and ``container_limit`` containers are remembered.
    """

    def __init__(self, qos: Callable[[], QosConfig] = lambda: _DEFAULT_QOS, *,
                 pod_limit: int = DEFAULT_POD_LIMIT,
                 container_limit: int = DEFAULT_CONTAINER_LIMIT,
                 on_refused: RefusalCallback | None = None,
                 earlier: Mapping[str, KubeletValues] | None = None) -> None:
        if pod_limit < 1 or container_limit < 1:
            raise ValueError("pod_limit and container_limit must be at least 1")
        self._qos = qos
        self._pod_limit = pod_limit
        self._container_limit = container_limit
        self._lock = threading.Lock()
        # Sandbox id -> (NRI pod, its metadata, the [qos] section) the view was made from.
        self._views: dict[str, tuple[PodInfo, PodMeta | None, QosConfig, PodView]] = {}
        self._pods: dict[str, PodInfo] = {}
        self._containers: dict[str, ContainerInfo] = {}
        self._stopped: set[str] = set()
        self._meta: dict[str, PodMeta] = {}
        self._version = 0
        # NRI's full view has arrived (Synchronize): only then is a missing pod really gone.
        self._synced = False
        self._snapshot: Snapshot | None = None
        self._subscriptions: list[_Subscription] = []
        self._runtime_fields: frozenset[str] | None = None
        self._on_refused = on_refused
        # Sandbox id -> the refusal last reported for it, so each is reported once.
        self._refused: dict[str, Refusal] = {}
        # Container id -> kubelet's values as an earlier run of the agent knew them, for the
        # first Synchronize (whose containers show this agent's adjustment instead).
        self._earlier = dict(earlier or {})

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

    def replace_all(self, pods: Sequence[PodInfo], containers: Sequence[ContainerInfo], *,
                    stopped: Collection[str] = ()) -> None:
        """The runtime's whole view (Synchronize); ``stopped``: the ids of the containers it
        lists as stopped (exited, not removed yet), kept but not running. A container known
        already keeps kubelet's request and score (see :func:`_kubelets`), from its events or,
        at the first Synchronize, from what an earlier run noted (``earlier``)."""
        with self._lock:
            self._pods = {p.id: p for p in pods[-self._pod_limit:]}
            # The views of pods the runtime no longer lists go with them.
            self._views = {k: v for k, v in self._views.items() if k in self._pods}
            self._refused = {k: v for k, v in self._refused.items() if k in self._pods}
            kept = [_kubelets(c, self._known(c.id)) for c in containers
                    if c.pod_sandbox_id in self._pods]
            self._earlier.clear()
            self._containers = {c.id: c for c in kept[-self._container_limit:]}
            self._stopped = {cid for cid in stopped if cid in self._containers}
            self._synced = True
            self._changed()
        self._notify(None, everyone=True)

    def pod_view(self, pod_id: str, make: Callable[[], PodInfo]) -> PodView:
        """The pod's view and level for an NRI event; ``make`` converts the runtime's message
        into the pod, called only at the pod's first sight (CRI fixes a sandbox's labels,
        annotations and cgroup parent when it creates it, so the first sight is the record).
        Raises what ``make`` raises; such a pod is not remembered."""
        with self._lock:
            pod = self._pods.get(pod_id)
        if pod is None:
            pod = make()
            with self._lock:
                self._add_pod(pod)
                self._changed()
        return self._view(pod)

    def pod_identity(self, uid: str = "", ref: str = "") -> tuple[str, str, str] | None:
        """(uid, namespace, name) of the known pod with this ``uid``, else with this
        ``namespace/name`` ``ref``; None when there is none. A scan: for audit records, not for
        every event.

        A name can belong to two known pods: one deleted and created again under it (a
        StatefulSet's) gets a new uid, and the runtime removes the old sandbox only later. The
        name then means the pod the API server has under it now (as the pod watch last said),
        else the first seen."""
        with self._lock:
            named: list[PodInfo] = []
            for pod in self._pods.values():
                if uid and pod.uid == uid:
                    return pod.uid, pod.namespace, pod.name
                if ref and f"{pod.namespace}/{pod.name}" == ref:
                    named.append(pod)
            found = next((pod for pod in named if pod.uid in self._meta),
                         named[0] if named else None)
        return None if found is None else (found.uid, found.namespace, found.name)

    def _add_pod(self, pod: PodInfo) -> None:
        """Remember ``pod`` (lock held); beyond the limit the oldest pod goes."""
        if pod.id not in self._pods and len(self._pods) >= self._pod_limit:
            self._drop_pod(next(iter(self._pods)))
        self._pods[pod.id] = pod

    def pod_event(self, event: Event) -> None:
        """An NRI event about a known pod (started, stopped, updated): wakes its subscribers."""
        self._notify(event)

    def remove_pod(self, pod_id: str, event: Event) -> None:
        with self._lock:
            self._drop_pod(pod_id)
            self._changed()
        self._notify(event)

    def _drop_pod(self, pod_id: str) -> None:
        """Forget a pod and its containers (lock held)."""
        self._pods.pop(pod_id, None)
        self._views.pop(pod_id, None)
        self._refused.pop(pod_id, None)
        for cid in [c.id for c in self._containers.values() if c.pod_sandbox_id == pod_id]:
            del self._containers[cid]
            self._stopped.discard(cid)

    def put_container(self, pod_id: str, container: ContainerInfo, event: Event,
                      *, running: bool = True) -> None:
        """A container created, started, updated or stopped. Its pod is known from the pod's
        view (:meth:`pod_view`); a container of an unknown pod is kept but not shown."""
        with self._lock:
            containers = self._containers
            if container.id not in containers and len(containers) >= self._container_limit:
                oldest = next(iter(containers))
                del containers[oldest]
                self._stopped.discard(oldest)
            containers[container.id] = container
            if running:
                self._stopped.discard(container.id)
            else:
                self._stopped.add(container.id)
            self._changed()
        self._notify(event)

    def container(self, container_id: str) -> ContainerInfo | None:
        """The container as last put, None when it is not known."""
        with self._lock:
            return self._containers.get(container_id)

    def _known(self, container_id: str) -> KubeletValues | None:
        """Kubelet's values for the container: its events' (lock held), else an earlier run's."""
        known = self._containers.get(container_id)
        if known is not None:
            return _values(known)
        return self._earlier.get(container_id)

    def kubelets(self) -> dict[str, KubeletValues]:
        """Kubelet's values of every container known, by id."""
        with self._lock:
            return {cid: _values(c) for cid, c in self._containers.items()}

    def remove_container(self, container: ContainerInfo, event: Event) -> None:
        with self._lock:
            self._containers.pop(container.id, None)
            self._stopped.discard(container.id)
            self._changed()
        self._notify(event)

    def set_runtime_fields(self, fields: frozenset[str]) -> None:
        """The adjustment fields the connected runtime applies (its Configure)."""
        self._runtime_fields = fields

    @property
    def runtime_fields(self) -> frozenset[str] | None:
        """What the connected runtime applies; None before any runtime configured the plugin."""
        return self._runtime_fields

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
        # The [qos] section is read once: a reload landing while the views are worked out
        # must not leave a snapshot that is half the old section's and half the new one's.
        qos = self._qos()
        with self._lock:
            cached = self._snapshot
            if cached is not None and cached.version == self._version and cached.qos is qos:
                return cached
            version = self._version
            pods, containers = list(self._pods.values()), list(self._containers.values())
            stopped = frozenset(self._stopped)
        views = {pod.id: self._view(pod, qos) for pod in pods}
        merged = []
        for c in containers:
            pod_view = views.get(c.pod_sandbox_id)
            if pod_view is not None:
                merged.append(ContainerView(merge_container(c, pod_view.meta), pod_view,
                                            c.id not in stopped))
        snapshot = Snapshot(version, MappingProxyType(views), tuple(merged),
                            frozenset(p.info.uid for p in views.values()),
                            qos=qos)
        with self._lock:
            if self._snapshot is None or self._snapshot.version <= version:
                self._snapshot = snapshot
        return snapshot

    def _view(self, pod: PodInfo, qos: QosConfig | None = None) -> PodView:
        """The pod's merged view and level under ``qos`` (the section in force when None),
        worked out again only when the NRI pod, its metadata or the ``[qos]`` section changed.
        Read without the lock (a race computes the same view twice); kept only while the pod is
        still the state's, so a pod that went meanwhile leaves nothing behind."""
        if qos is None:
            qos = self._qos()
        meta = self._meta.get(pod.uid)
        cached = self._views.get(pod.id)
        if cached is not None and cached[0] is pod and cached[1] is meta and cached[2] is qos:
            return cached[3]
        info = _merge_pod(pod, meta)
        changed = frozenset() if meta is None else frozenset(
            key for key in {*pod.annotations, *info.annotations}
            if pod.annotations.get(key) != info.annotations.get(key))
        decision = resolve_level(pod, qos)
        if meta is not None:
            decision = resolve_level(info, qos, ceiling=decision.level)
        view = PodView(info, meta, decision, changed)
        refusal = decision.refused
        report = False
        with self._lock:
            if self._pods.get(pod.id) is pod:
                self._views[pod.id] = (pod, meta, qos, view)
                if refusal is None:
                    self._refused.pop(pod.id, None)
                elif self._refused.get(pod.id) != refusal:
                    self._refused[pod.id] = refusal
                    report = True
        if report and refusal is not None and self._on_refused is not None:
            self._on_refused(info, refusal)
        return view

    def _changed(self) -> None:
        self._version += 1


def report_refusals(audit: AuditLog, metrics: Metrics | None) -> RefusalCallback:
    """The ``on_refused`` of the agent: an audit record and a count per refused claim."""
    def refused(pod: PodInfo, refusal: Refusal) -> None:
        audit.record("qos_level_refused", pod_uid=bounded(pod.uid),
                     pod=bounded(f"{pod.namespace}/{pod.name}"), claim=refusal.claim,
                     source=refusal.key, reason=refusal.reason)
        if metrics is not None:
            metrics.qos_level_refused(refusal.source)
    return refused


def _merge_pod(pod: PodInfo, meta: PodMeta | None) -> PodInfo:
    if meta is None:
        return pod
    annotations = {key: value for key, value in meta.annotations.items()
                   if key not in KUBELET_STAMPED}
    annotations.update((key, value) for key, value in pod.annotations.items()
                       if key in KUBELET_STAMPED)
    return dataclasses.replace(
        pod,
        annotations=MappingProxyType(annotations),
        labels=MappingProxyType(dict(meta.labels)),
        priority=meta.priority if meta.priority is not None else pod.priority,
    )


def _kubelets(listed: ContainerInfo, known: KubeletValues | None) -> ContainerInfo:
    """A container as Synchronize lists it, with kubelet's request, score and ``memory.high``
    where its events told them (``known``): the runtime lists its spec with this agent's
    adjustment in it (its ``memory.min``, v1 reservation, ``oom_score_adj``, ``memory.high``),
    which, read as kubelet's, would compound at every reconnect, and after a restart would be
    given back as kubelet's."""
    if known is None or known == _values(listed):
        return listed
    request, score, high = known
    return dataclasses.replace(listed, memory_request=request, oom_score_adj=score,
                               memory_high=high)


def _values(container: ContainerInfo) -> KubeletValues:
    return container.memory_request, container.oom_score_adj, container.memory_high


def merge_container(container: ContainerInfo, meta: PodMeta | None) -> ContainerInfo:
    """The container with its memory request from its pod's spec (``meta``: the pod watch's,
    None while the watch has not seen the pod), and its limit from there where the runtime gave
    none. The runtime knows a request only where kubelet wrote one (its MemoryQoS)."""
    if meta is None:
        return container
    request = meta.memory_requests.get(container.name, container.memory_request)
    limit = container.memory_limit
    if limit is None:
        limit = meta.memory_limits.get(container.name)
    if request == container.memory_request and limit == container.memory_limit:
        return container
    return dataclasses.replace(container, memory_request=request, memory_limit=limit)
