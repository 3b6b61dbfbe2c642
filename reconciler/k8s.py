"""The one module that talks to the Kubernetes API server.

What is read or written: this node's pods (list, then watch), evictions of pods (``policy/v1``
Eviction) with an Event on the evicted pod, and this node's taints and status conditions. The
official client is synchronous, so every request runs in a worker thread; each has a client-side
timeout, and the pod watch also a server-side one, so that no thread outlives a stop by more than
one request timeout.

Without usable credentials the agent runs degraded: :func:`build_api_client` returns ``None``
after one warning, the pod watch idles until stop, and actions report ``unavailable``.
"""

from __future__ import annotations

import asyncio
import dataclasses
import enum
import json
import os
import socket
import time
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any, TypeVar

import structlog
import urllib3
from kubernetes import client as k8s_client
from kubernetes import config as k8s_config
from kubernetes.client import ApiClient
from kubernetes.client.exceptions import ApiException

from common.aio import Backoff, done_or_stopped, sleep_until
from common.audit import AuditLog
from common.podmeta import OwnerRef, PodMeta, pod_meta_from_object
from hooks.config_fields import setting

_log = structlog.get_logger(__name__)

Api = ApiClient
"""The client handle :func:`build_api_client` returns, for callers that pass it on."""


@dataclass(frozen=True, slots=True)
class KubernetesConfig:
    enabled: bool = setting(True, "Watch this node's pods and use the Eviction and Node APIs.")
    kubeconfig: str = setting(
        "", "Path of a kubeconfig; empty means in-cluster config, then ~/.kube/config."
    )
    node_name: str = setting(
        "", "This node's name; empty means the NODE_NAME variable, then the hostname."
    )
    request_timeout_s: float = setting(
        10.0, "Timeout of one API request.", unit="seconds", minimum=0.1, maximum=300
    )
    watch_timeout_s: int = setting(
        300, "Server-side timeout of one pod watch before it is renewed.", unit="seconds",
        minimum=10, maximum=3600,
    )
    retry_max_s: float = setting(
        30.0, "Cap of the backoff between failed list/watch attempts.", unit="seconds",
        minimum=0.1, maximum=600,
    )


_T = TypeVar("_T")

HTTP_CONFLICT = 409
HTTP_GONE = 410
HTTP_NOT_FOUND = 404
HTTP_TOO_MANY_REQUESTS = 429
TAINT_EFFECTS = ("NoSchedule", "PreferNoSchedule", "NoExecute")
MERGE_PATCH = "application/merge-patch+json"
# Attempts of a read-modify-write of the node (taints, conditions) that keeps losing to other
# writers.
NODE_UPDATE_ATTEMPTS = 5
# Who the Events and conditions the agent writes come from.
COMPONENT = "nri-qos"
# A watch that ends sooner than this without any event counts as a failure (backoff), so a
# server that keeps closing streams at once cannot make the watcher spin.
MIN_HEALTHY_WATCH_S = 1.0
# Errors a list or watch attempt, or a read-modify-write of the node, may end with; everything
# else is a bug and propagates.
_TRANSIENT = (ApiException, urllib3.exceptions.HTTPError, OSError, ValueError)


def node_name(cfg: KubernetesConfig, environ: Mapping[str, str] | None = None) -> str:
    """This node's name: the config, then ``NODE_NAME``, then the hostname as kubelet spells it."""
    env = os.environ if environ is None else environ
    if cfg.node_name:
        return cfg.node_name
    if env.get("NODE_NAME"):
        return env["NODE_NAME"]
    # kubelet registers the node under the lower-cased hostname unless told otherwise.
    return socket.gethostname().strip().lower()


def build_api_client(
    cfg: KubernetesConfig, environ: Mapping[str, str] | None = None
) -> ApiClient | None:
    """A client from the configured kubeconfig, else in-cluster config, else the default kubeconfig.

    Returns ``None`` (degraded mode, one warning) when access is disabled or nothing works.
    """
    env = os.environ if environ is None else environ
    if not cfg.enabled:
        _log.info("kubernetes_disabled", detail="kubernetes.enabled is false; NRI data only")
        return None
    if cfg.kubeconfig:
        attempts = [("kubeconfig", cfg.kubeconfig)]
    else:
        default = env.get("KUBECONFIG") or os.path.join(env.get("HOME", "~"), ".kube", "config")
        attempts = [("in-cluster", ""), ("default kubeconfig", default)]
    failures: list[str] = []
    for source, path in attempts:
        # A fresh object per source: a loader that fails halfway must leave nothing behind.
        configuration = k8s_client.Configuration()
        try:
            if path:
                k8s_config.load_kube_config(  # type: ignore[no-untyped-call]
                    config_file=os.path.expanduser(path),
                    client_configuration=configuration,
                    persist_config=False,
                )
            else:
                k8s_config.load_incluster_config(  # type: ignore[no-untyped-call]
                    client_configuration=configuration
                )
        # Loaders fail in many ways (missing file, bad YAML, missing fields, exec plugins);
        # each only means this source is unusable.
        except Exception as exc:
            failures.append(f"{source}{' ' + path if path else ''}: {exc}")
            continue
        _log.info("kubernetes_config", source=source, path=path or None, host=configuration.host)
        return ApiClient(configuration=configuration)
    _log.warning(
        "kubernetes_unavailable",
        detail="no usable API credentials; running degraded on NRI data only",
        tried=failures,
    )
    return None


class _Stopped(Exception):
    """The stop event was set while a request was in flight."""


class _Gone(Exception):
    """The watch's resourceVersion is too old (410); only a fresh list can continue."""


class _LineReader:
    """Splits a streaming (chunked) HTTP response into JSON lines; used from one worker thread."""

    def __init__(self, response: Any) -> None:
        self._response = response
        self._chunks = response.stream(amt=None, decode_content=True)
        self._buffer = b""

    def read_lines(self) -> list[bytes]:
        """The complete lines that arrive next; an empty list means the stream ended."""
        while True:
            lines = self._buffer.split(b"\n")
            self._buffer = lines.pop()
            complete = [line for line in lines if line.strip()]
            if complete:
                return complete
            chunk = next(self._chunks, None)
            if chunk is None:
                if self._buffer.strip():
                    raise ValueError("watch stream ended inside an event")
                return []
            self._buffer += chunk

    def interrupt(self) -> None:
        """Unblocks a read in progress in another thread (urllib3 >= 2.3), else closes."""
        shutdown = getattr(self._response, "shutdown", None)
        try:
            if shutdown is not None:
                shutdown()
            else:
                self._response.close()
        except (ValueError, RuntimeError, OSError):
            pass

    def close(self) -> None:
        self._response.close()
        self._response.release_conn()


class PodWatcher:
    """Lists this node's pods, then watches them, and reports each change as a :class:`PodMeta`.

    ``on_event`` runs on the event loop, in API order. Deleted pods are reported with
    ``deleted=True``, also those found missing when a relist follows a broken watch.
    """

    def __init__(
        self,
        api: ApiClient | None,
        cfg: KubernetesConfig,
        node: str,
        *,
        initial_backoff_s: float = 0.5,
    ) -> None:
        self._api = api
        self._cfg = cfg
        self._node = node
        self._initial_backoff_s = initial_backoff_s
        self._known: dict[str, PodMeta] = {}
        self._stream: _LineReader | None = None
        # resourceVersion to watch from: set by a list, advanced by every event; None = relist
        self._resume_from: str | None = None

    async def run(self, on_event: Callable[[PodMeta], None], stop: asyncio.Event) -> None:
        if self._api is None:
            _log.warning("pod_watch_off", detail="no Kubernetes API; pod metadata from NRI only")
            await stop.wait()
            return
        core = k8s_client.CoreV1Api(self._api)
        executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"pod-watch-{self._node}")
        backoff = Backoff(self._initial_backoff_s, self._cfg.retry_max_s)
        loop = asyncio.get_running_loop()
        self._resume_from = None
        try:
            while not stop.is_set():
                started = loop.time()
                relisting = self._resume_from is None
                try:
                    if relisting:
                        await self._list(core, on_event, executor, stop)
                    events = await self._watch(core, on_event, executor, stop)
                    if events or loop.time() - started >= MIN_HEALTHY_WATCH_S:
                        backoff.reset()
                        continue
                    reason = "watch ended at once"
                except _Stopped:
                    return
                except _Gone:
                    self._resume_from = None
                    if not relisting:
                        _log.info("pod_watch_expired", node=self._node, detail="relisting")
                        continue
                    # Expired straight after a fresh list: the server is unwell; do not spin.
                    reason = "watch expired right after a list"
                except _TRANSIENT as exc:
                    reason = _describe(exc)
                delay = backoff.next()
                _log.warning("pod_watch_retry", node=self._node, reason=reason, delay_s=delay)
                await sleep_until(delay, stop)
        finally:
            executor.shutdown(wait=False)

    async def _call(
        self,
        fn: Callable[[], _T],
        executor: ThreadPoolExecutor,
        stop: asyncio.Event,
        discard: Callable[[_T], None] | None = None,
    ) -> _T:
        """Runs ``fn`` in the worker thread; on stop, interrupts an open stream and gives up.

        The abandoned call ends on its own (interrupted, or at its request timeout); ``discard``
        then releases what it returns.
        """
        work = asyncio.get_running_loop().run_in_executor(executor, fn)
        try:
            done = await done_or_stopped(work, stop)
        except asyncio.CancelledError:
            self._abandon(work, discard)
            raise
        if done:
            return work.result()
        self._abandon(work, discard)
        raise _Stopped

    def _abandon(
        self, work: asyncio.Future[_T], discard: Callable[[_T], None] | None
    ) -> None:
        stream = self._stream
        if stream is not None:
            stream.interrupt()

        def settle(future: asyncio.Future[_T]) -> None:
            if future.cancelled() or future.exception() is not None:
                return
            if discard is not None:
                discard(future.result())

        work.add_done_callback(settle)

    async def _list(
        self,
        core: Any,
        on_event: Callable[[PodMeta], None],
        executor: ThreadPoolExecutor,
        stop: asyncio.Event,
    ) -> None:
        def fetch() -> Any:
            response = core.list_pod_for_all_namespaces(
                field_selector=f"spec.nodeName={self._node}",
                _preload_content=False,
                _request_timeout=self._cfg.request_timeout_s,
            )
            try:
                return json.loads(response.data)
            finally:
                response.release_conn()

        body = await self._call(fetch, executor, stop)
        if not isinstance(body, dict):
            raise ValueError("pod list is not a JSON object")
        resource_version = _resource_version(body)
        if not resource_version:
            raise ValueError("pod list has no metadata.resourceVersion")
        items = body.get("items")
        if not isinstance(items, list):
            items = []
        listed = [pod_meta_from_object(item) for item in items if isinstance(item, dict)]
        present = {meta.uid for meta in listed}
        for uid in [uid for uid in self._known if uid not in present]:
            _emit(on_event, dataclasses.replace(self._known.pop(uid), deleted=True))
        for meta in listed:
            if self._known.get(meta.uid) != meta:
                self._known[meta.uid] = meta
                _emit(on_event, meta)
        _log.info("pod_list", node=self._node, pods=len(listed), resource_version=resource_version)
        self._resume_from = resource_version

    async def _watch(
        self,
        core: Any,
        on_event: Callable[[PodMeta], None],
        executor: ThreadPoolExecutor,
        stop: asyncio.Event,
    ) -> int:
        """Follows one watch stream from ``_resume_from``; returns the number of events."""

        def open_stream() -> _LineReader:
            response = core.list_pod_for_all_namespaces(
                field_selector=f"spec.nodeName={self._node}",
                watch=True,
                allow_watch_bookmarks=True,
                resource_version=self._resume_from,
                timeout_seconds=self._cfg.watch_timeout_s,
                _preload_content=False,
                # The read timeout catches a silently dead connection: the server writes at
                # least the end of the stream when its own timeout expires.
                _request_timeout=(
                    self._cfg.request_timeout_s,
                    self._cfg.watch_timeout_s + self._cfg.request_timeout_s,
                ),
            )
            return _LineReader(response)

        try:
            stream = await self._call(
                open_stream, executor, stop, discard=lambda late: late.close()
            )
        except ApiException as exc:
            if exc.status == HTTP_GONE:
                raise _Gone from exc
            raise
        self._stream = stream
        events = 0
        try:
            while True:
                lines = await self._call(stream.read_lines, executor, stop)
                if not lines:
                    return events
                for line in lines:
                    self._apply(json.loads(line), on_event)
                    events += 1
        finally:
            self._stream = None
            executor.submit(stream.close)

    def _apply(self, event: Any, on_event: Callable[[PodMeta], None]) -> None:
        """Handles one watch event and moves the resume point past it."""
        if not isinstance(event, dict) or not isinstance(event.get("object"), dict):
            raise ValueError("watch event is not an object with an 'object' field")
        kind, obj = event.get("type"), event["object"]
        if kind == "ERROR":
            if obj.get("code") == HTTP_GONE:
                raise _Gone
            raise ValueError(f"watch error {obj.get('code')}: {obj.get('message', '')}")
        if kind in ("ADDED", "MODIFIED", "DELETED"):
            meta = pod_meta_from_object(obj, deleted=kind == "DELETED")
            if meta.deleted:
                self._known.pop(meta.uid, None)
            else:
                self._known[meta.uid] = meta
            _emit(on_event, meta)
        # BOOKMARK (and any future type) only moves the resume point forward.
        self._resume_from = _resource_version(obj) or self._resume_from


class EvictionOutcome(enum.StrEnum):
    EVICTED = "evicted"  # the API accepted the eviction (or would have, in a dry run)
    BLOCKED = "blocked"  # 429: a PodDisruptionBudget forbids it now, or the API throttles
    GONE = "gone"  # 404: the pod no longer exists
    FAILED = "failed"  # any other refusal or a transport error
    UNAVAILABLE = "unavailable"  # degraded mode: no API client


@dataclasses.dataclass(frozen=True, slots=True)
class EvictionResult:
    outcome: EvictionOutcome
    dry_run: bool
    status: int | None = None  # HTTP status when the API answered
    message: str = ""


class NodeOutcome(enum.StrEnum):
    """How a change of the node (a taint, a status condition) went."""

    CHANGED = "changed"
    UNCHANGED = "unchanged"  # already as asked: nothing was written
    FAILED = "failed"
    UNAVAILABLE = "unavailable"


@dataclasses.dataclass(frozen=True, slots=True)
class PodRef:
    """The pod an Event is about."""

    namespace: str
    name: str
    uid: str


MIN_GRACE_S = 1
"""The shortest grace period an eviction may ask for. 0 means immediate deletion: the pod gets
no SIGTERM and no graceful shutdown, and the kubelet's record of it goes at once."""


class KubeActions:
    """Writes to the API: evictions (with an Event on the pod), node taints and node status
    conditions; evictions and taints are audited here, conditions by their owner."""

    def __init__(self, api: ApiClient | None, cfg: KubernetesConfig, audit: AuditLog) -> None:
        # One API handle for every write; None in degraded mode.
        self._core: Any = None if api is None else k8s_client.CoreV1Api(api)
        self._apps: Any = None if api is None else k8s_client.AppsV1Api(api)
        self._cfg = cfg
        self._audit = audit

    @property
    def available(self) -> bool:
        """False in degraded mode: every write reports ``unavailable``."""
        return self._core is not None

    async def evict(
        self,
        namespace: str,
        name: str,
        grace_seconds: int | None,
        dry_run: bool,
        *,
        uid: str | None = None,
        reason: str = "unspecified",
    ) -> EvictionResult:
        """Asks the Eviction API to evict a pod; ``dry_run`` sends ``dryRun=All``. ``uid``: the
        pod the decision was about, sent as a precondition so that a pod re-created under the
        same name in the meantime is not the one evicted (the API answers 409). A grace period
        below :data:`MIN_GRACE_S` is a programming error."""
        if grace_seconds is not None and grace_seconds < MIN_GRACE_S:
            raise ValueError(f"grace period {grace_seconds} s is below {MIN_GRACE_S} s")
        pod = f"{namespace}/{name}"
        self._audit.record("eviction_requested", pod=pod, reason=reason, dry_run=dry_run)
        if self._core is None:
            self._audit.record("eviction_blocked", pod=pod, reason="no Kubernetes API access")
            return EvictionResult(EvictionOutcome.UNAVAILABLE, dry_run)
        core = self._core
        body = k8s_client.V1Eviction(
            api_version="policy/v1",
            kind="Eviction",
            metadata=k8s_client.V1ObjectMeta(name=name, namespace=namespace),
            delete_options=None if grace_seconds is None and uid is None
            else k8s_client.V1DeleteOptions(
                grace_period_seconds=grace_seconds,
                preconditions=None if uid is None else k8s_client.V1Preconditions(uid=uid),
            ),
        )

        def post() -> int:
            # Raw response: the API answers with a Status, not the Eviction the model expects.
            response: Any = core.create_namespaced_pod_eviction(
                name, namespace, body,
                dry_run="All" if dry_run else None,
                _preload_content=False,
                _request_timeout=self._cfg.request_timeout_s,
            )
            _finish(response)
            return int(response.status)

        try:
            status = await asyncio.to_thread(post)
        except ApiException as exc:
            sent = _status_body(exc)
            message = _status_message(exc, sent)
            if exc.status == HTTP_NOT_FOUND or (exc.status == HTTP_CONFLICT and uid is not None):
                # 409 on a uid precondition: a pod of that name exists, but not the one the
                # decision was about (re-created); that one is gone.
                self._audit.record("eviction_gone", pod=pod, status=exc.status)
                return EvictionResult(EvictionOutcome.GONE, dry_run, exc.status, message)
            blocked = exc.status == HTTP_TOO_MANY_REQUESTS
            if not blocked:
                why = f"API error: {message}"
            elif _budget_refused(sent):
                why = f"disruption budget: {message}"
            else:
                # The API server's own throttling (Priority and Fairness): nothing was decided
                # about the pod, the eviction is tried again after the backoff.
                why = f"throttled by the API server: {message}"
            self._audit.record("eviction_blocked", pod=pod, status=exc.status, reason=why)
            outcome = EvictionOutcome.BLOCKED if blocked else EvictionOutcome.FAILED
            return EvictionResult(outcome, dry_run, exc.status, message)
        except (urllib3.exceptions.HTTPError, OSError) as exc:
            self._audit.record("eviction_blocked", pod=pod, reason=f"transport: {exc}")
            return EvictionResult(EvictionOutcome.FAILED, dry_run, None, str(exc))
        self._audit.record("eviction_done", pod=pod, dry_run=dry_run, status=status)
        return EvictionResult(EvictionOutcome.EVICTED, dry_run, status)

    async def add_taint(
        self, node: str, key: str, value: str, effect: str, *, reason: str = "unspecified"
    ) -> NodeOutcome:
        """Puts ``key=value:effect`` on the node, replacing a taint with the same key and effect."""
        if effect not in TAINT_EFFECTS:
            raise ValueError(f"taint effect must be one of {', '.join(TAINT_EFFECTS)}: {effect!r}")
        wanted = {"key": key, "value": value, "effect": effect} if value else {
            "key": key, "effect": effect
        }

        def change(taints: list[dict[str, Any]]) -> list[dict[str, Any]] | None:
            same = [t for t in taints if t.get("key") == key and t.get("effect") == effect]
            if [_taint_text(t) for t in same] == [_taint_text(wanted)]:
                return None
            return [t for t in taints if t not in same] + [wanted]

        outcome, _ = await self._update_taints(node, change)
        if outcome is NodeOutcome.CHANGED:
            self._audit.record("taint_added", node=node, taint=_taint_text(wanted), reason=reason)
        return outcome

    async def remove_taint(
        self, node: str, key: str, *, reason: str = "unspecified"
    ) -> NodeOutcome:
        """Removes every taint with ``key`` (whatever its value and effect) from the node."""

        def change(taints: list[dict[str, Any]]) -> list[dict[str, Any]] | None:
            kept = [t for t in taints if t.get("key") != key]
            return None if len(kept) == len(taints) else kept

        outcome, removed = await self._update_taints(node, change)
        for taint in removed:
            self._audit.record("taint_removed", node=node, taint=_taint_text(taint), reason=reason)
        return outcome

    async def _update_taints(
        self, node: str, change: Callable[[list[dict[str, Any]]], list[dict[str, Any]] | None]
    ) -> tuple[NodeOutcome, list[dict[str, Any]]]:
        """Read-modify-write of ``spec.taints``; returns the outcome and the taints that were
        dropped."""
        dropped: list[dict[str, Any]] = []

        def patch(current: dict[str, Any]) -> dict[str, Any] | None:
            spec = current.get("spec")
            raw = spec.get("taints") if isinstance(spec, dict) else None
            taints = [t for t in raw if isinstance(t, dict)] if isinstance(raw, list) else []
            updated = change(taints)
            if updated is None:
                return None
            dropped[:] = [t for t in taints if t not in updated]
            return {"spec": {"taints": updated}}

        outcome = await self._update_node(node, patch, status=False, what="taint")
        return outcome, dropped if outcome is NodeOutcome.CHANGED else []

    async def set_node_condition(
        self, node: str, condition: str, status: bool, reason: str, message: str
    ) -> NodeOutcome:
        """Makes the node's ``status.conditions`` hold ``condition`` with ``status``, ``reason``
        and ``message``; nothing is written when it already does. ``lastTransitionTime`` moves
        only when the status changes, ``lastHeartbeatTime`` with every write."""
        text = "True" if status else "False"

        def patch(current: dict[str, Any]) -> dict[str, Any] | None:
            found = current.get("status")
            raw = found.get("conditions") if isinstance(found, dict) else None
            conditions = [c for c in raw if isinstance(c, dict)] if isinstance(raw, list) else []
            mine = next((c for c in conditions if c.get("type") == condition), None)
            # Status and reason, not the message: a message carrying the observed value would
            # otherwise rewrite the node at every change of that value.
            if mine is not None and (mine.get("status"), mine.get("reason")) == (text, reason):
                return None
            now = _rfc3339()
            transition = now if mine is None or mine.get("status") != text else \
                mine.get("lastTransitionTime", now)
            wanted = {"type": condition, "status": text, "reason": reason, "message": message,
                      "lastHeartbeatTime": now, "lastTransitionTime": transition}
            # A merge patch replaces the whole list: every other condition is written back as
            # read, and the resourceVersion precondition makes sure nothing changed meanwhile.
            kept = [c for c in conditions if c.get("type") != condition]
            return {"status": {"conditions": [*kept, wanted]}}

        return await self._update_node(node, patch, status=True, what="condition")

    async def owner_exists(self, namespace: str, owner: OwnerRef) -> bool | None:
        """Whether the DaemonSet ``owner`` names exists with that uid, as ``kubectl drain``
        checks before treating a pod as a DaemonSet's; None when the API could not tell."""
        if self._apps is None:
            return None
        apps = self._apps

        def read() -> bool:
            response: Any = apps.read_namespaced_daemon_set(
                owner.name, namespace, _preload_content=False,
                _request_timeout=self._cfg.request_timeout_s)
            try:
                found = json.loads(response.data)
            finally:
                response.release_conn()
            meta = found.get("metadata") if isinstance(found, dict) else None
            return isinstance(meta, dict) and meta.get("uid") == owner.uid

        try:
            return await asyncio.to_thread(read)
        except ApiException as exc:
            if exc.status == HTTP_NOT_FOUND:
                return False
            _log.warning("owner_check_failed", namespace=namespace, owner=owner.name,
                         reason=_describe(exc))
        except (urllib3.exceptions.HTTPError, OSError, ValueError) as exc:
            _log.warning("owner_check_failed", namespace=namespace, owner=owner.name,
                         reason=_describe(exc))
        return None

    async def remove_node_condition(self, node: str, condition: str) -> NodeOutcome:
        """Takes ``condition`` off the node's ``status.conditions`` (UNCHANGED when it is not
        there): what an uninstall leaves, rather than a condition set False."""

        def patch(current: dict[str, Any]) -> dict[str, Any] | None:
            found = current.get("status")
            raw = found.get("conditions") if isinstance(found, dict) else None
            conditions = [c for c in raw if isinstance(c, dict)] if isinstance(raw, list) else []
            kept = [c for c in conditions if c.get("type") != condition]
            if len(kept) == len(conditions):
                return None
            return {"status": {"conditions": kept}}

        return await self._update_node(node, patch, status=True, what="condition")

    async def create_pod_event(self, pod: PodRef, node: str, reason: str,
                               message: str) -> bool:
        """Records a Warning Event on the pod (``kubectl describe pod`` shows it); False when it
        could not be written (logged, never raised: the Event only tells what happened)."""
        if self._core is None:
            return False
        core = self._core
        now = _rfc3339()
        body: Any = {
            "apiVersion": "v1", "kind": "Event",
            # kubelet's naming: the object's name and a unique hexadecimal suffix
            "metadata": {"name": f"{pod.name}.{time.time_ns():x}", "namespace": pod.namespace},
            "involvedObject": {"apiVersion": "v1", "kind": "Pod", "namespace": pod.namespace,
                               "name": pod.name, "uid": pod.uid},
            "reason": reason, "message": message, "type": "Warning",
            "source": {"component": COMPONENT, "host": node},
            "reportingComponent": COMPONENT, "reportingInstance": node,
            "firstTimestamp": now, "lastTimestamp": now, "count": 1,
        }

        def post() -> None:
            response: Any = core.create_namespaced_event(
                pod.namespace, body, _preload_content=False,
                _request_timeout=self._cfg.request_timeout_s,
            )
            _finish(response)

        try:
            await asyncio.to_thread(post)
        except (ApiException, urllib3.exceptions.HTTPError, OSError) as exc:
            _log.warning("pod_event_failed", pod=f"{pod.namespace}/{pod.name}", reason=reason,
                         error=_describe(exc))
            return False
        return True

    async def _update_node(
        self, node: str, patch_for: Callable[[dict[str, Any]], dict[str, Any] | None], *,
        status: bool, what: str,
    ) -> NodeOutcome:
        """Read-modify-write of the node (``status``: through its status subresource) guarded by
        its resourceVersion. ``patch_for`` gets the node as read and returns the merge patch to
        apply, or None when nothing is to change. A 409 (someone else updated the node in
        between) rereads and retries."""
        if self._core is None:
            _log.warning(f"{what}_skipped", node=node, reason="no Kubernetes API access")
            return NodeOutcome.UNAVAILABLE
        core = self._core
        timeout = self._cfg.request_timeout_s

        def attempt() -> NodeOutcome | None:
            response: Any = core.read_node(node, _preload_content=False, _request_timeout=timeout)
            try:
                current = json.loads(response.data)
            finally:
                response.release_conn()
            if not isinstance(current, dict):
                raise ValueError("node is not a JSON object")
            patch = patch_for(current)
            if patch is None:
                return NodeOutcome.UNCHANGED
            patch["metadata"] = {"resourceVersion": _resource_version(current)}
            options: dict[str, Any] = {"_content_type": MERGE_PATCH, "_preload_content": False,
                                       "_request_timeout": timeout}
            try:
                written: Any = core.patch_node_status(node, patch, **options) if status \
                    else core.patch_node(node, patch, **options)
            except ApiException as exc:
                if exc.status == HTTP_CONFLICT:
                    return None
                raise
            _finish(written)
            return NodeOutcome.CHANGED

        for _ in range(NODE_UPDATE_ATTEMPTS):
            try:
                result = await asyncio.to_thread(attempt)
            except _TRANSIENT as exc:
                _log.warning(f"{what}_failed", node=node, reason=_describe(exc))
                return NodeOutcome.FAILED
            if result is not None:
                return result
            _log.info(f"{what}_conflict", node=node, detail="node changed meanwhile; retrying")
        _log.warning(f"{what}_failed", node=node, reason="resourceVersion conflicts persisted")
        return NodeOutcome.FAILED


def _emit(on_event: Callable[[PodMeta], None], meta: PodMeta) -> None:
    """Hands one pod to the consumer; a failing consumer must not end or rewind the watch."""
    try:
        on_event(meta)
    except Exception:
        _log.exception("pod_event_failed", pod=f"{meta.namespace}/{meta.name}", uid=meta.uid)


def _finish(response: Any) -> None:
    """Reads the rest of a raw response, then hands its connection back to the pool. A
    connection released with its body unread would give that body to the next request on it as
    the start of its answer."""
    try:
        response.read()
    finally:
        response.release_conn()


def _rfc3339() -> str:
    """Now, as the API writes times (RFC 3339, UTC, whole seconds)."""
    return datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def _taint_text(taint: Mapping[str, Any]) -> str:
    value = taint.get("value")
    return f"{taint.get('key')}{'=' + str(value) if value else ''}:{taint.get('effect')}"


def _resource_version(obj: Mapping[str, Any]) -> str:
    metadata = obj.get("metadata")
    value = metadata.get("resourceVersion") if isinstance(metadata, dict) else None
    return value if isinstance(value, str) else ""


def _status_body(exc: ApiException) -> dict[str, Any] | None:
    """The Status object the API sent with an error; None when the body is not one."""
    try:
        body = json.loads(exc.body or "")
    except (ValueError, TypeError):
        return None
    return body if isinstance(body, dict) else None


def _budget_refused(body: Mapping[str, Any] | None) -> bool:
    """A 429 from a PodDisruptionBudget: its Status (``body``) names the cause
    ``DisruptionBudget``."""
    details = body.get("details") if body is not None else None
    causes = details.get("causes") if isinstance(details, dict) else None
    return isinstance(causes, list) and any(
        isinstance(cause, dict) and cause.get("reason") == "DisruptionBudget" for cause in causes)


def _status_message(exc: ApiException, body: Mapping[str, Any] | None) -> str:
    """The ``message`` of the Status the API sent (``body``), else the HTTP reason."""
    if body is not None and isinstance(body.get("message"), str):
        return str(body["message"])
    return str(exc.reason or exc.status)


def _describe(exc: BaseException) -> str:
    if isinstance(exc, ApiException):
        return f"HTTP {exc.status}: {_status_message(exc, _status_body(exc))}"
    return f"{type(exc).__name__}: {exc}"

