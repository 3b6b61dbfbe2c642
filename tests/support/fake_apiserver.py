"""An HTTP server on 127.0.0.1 that answers like the Kubernetes API server for what nri-qos uses.

Served: pod list and watch (``/api/v1/pods`` with ``fieldSelector=spec.nodeName=X``), pod GET,
the pod Eviction subresource, Event creation, node GET and PATCH (of the node and of its status
subresource; a merge patch replaces lists, a strategic merge patch merges the status conditions
by type, as the API server does). Tests change pods through :meth:`add_pod`, :meth:`modify_pod`,
:meth:`delete_pod` (each change gets a resourceVersion and a watch event) and inject trouble:
failing requests, slow answers, dropped or ended watch streams, compacted history (410 Gone),
disruption budgets (429), throttling (429 with ``Retry-After``, as API Priority and Fairness
answers), concurrent node writers (409) and an outage (:meth:`go_down`: the port refuses
connections until :meth:`come_back`, with the state kept, as etcd keeps it). Every request is
recorded.
"""

from __future__ import annotations

import contextlib
import copy
import socket
import ssl
import sys
import threading
import time
import uuid
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import yaml

from reconciler.kube import KubernetesConfig, build_api_client
from tests.support.fake_apiserver_http import Handler, Recorded


@dataclass
class _Failure:
    method: str
    path_prefix: str
    status: int
    remaining: int
    watch_only: bool
    # The Retry-After header the answer carries (a 429 without one: "1")
    retry_after: str | None = None


@dataclass
class _Delay:
    method: str
    path_prefix: str
    seconds: float
    remaining: int


@dataclass
class _State:
    resource_version: int = 1
    # (namespace, name) -> pod object
    pods: dict[tuple[str, str], dict[str, Any]] = field(default_factory=dict)
    nodes: dict[str, dict[str, Any]] = field(default_factory=dict)
    daemonsets: dict[tuple[str, str], dict[str, Any]] = field(default_factory=dict)
    # (resourceVersion, type, object) of every pod change since the last compaction
    history: list[tuple[int, str, dict[str, Any]]] = field(default_factory=list)
    # watches from a resourceVersion below this get 410 Gone
    oldest_rv: int = 1
    failures: list[_Failure] = field(default_factory=list)
    delays: list[_Delay] = field(default_factory=list)
    # Events created, in order
    events: list[dict[str, Any]] = field(default_factory=list)
    # (namespace, name) -> the Retry-After header its 429 carries, if any
    pdb_blocked: dict[tuple[str, str], str | None] = field(default_factory=dict)
    patch_conflicts: int = 0
    # bumped to end (gracefully) or drop (abruptly) the open watch streams
    end_generation: int = 0
    drop_generation: int = 0
    open_watches: int = 0
    requests: list[Recorded] = field(default_factory=list)


def make_pod(
    name: str,
    *,
    namespace: str = "default",
    node: str = "node-a",
    uid: str | None = None,
    annotations: dict[str, str] | None = None,
    labels: dict[str, str] | None = None,
    priority: int | None = None,
    owner_kind: str | None = None,
    memory: dict[str, tuple[str | None, str | None]] | None = None,
) -> dict[str, Any]:
    """A v1 Pod object; ``memory`` maps container name to (request, limit) quantities."""
    containers = []
    for cname, (request, limit) in (memory or {"main": (None, None)}).items():
        resources: dict[str, dict[str, str]] = {}
        if request is not None:
            resources["requests"] = {"memory": request}
        if limit is not None:
            resources["limits"] = {"memory": limit}
        containers.append({"name": cname, "image": "busybox", "resources": resources})
    metadata: dict[str, Any] = {
        "name": name,
        "namespace": namespace,
        "uid": uid or str(uuid.uuid4()),
        "annotations": dict(annotations or {}),
        "labels": dict(labels or {}),
    }
    if owner_kind:
        metadata["ownerReferences"] = [
            {"apiVersion": "apps/v1", "kind": owner_kind, "name": f"{name}-owner",
             "uid": str(uuid.uuid4()), "controller": True}
        ]
    spec: dict[str, Any] = {"nodeName": node, "containers": containers}
    if priority is not None:
        spec["priority"] = priority
    return {"apiVersion": "v1", "kind": "Pod", "metadata": metadata, "spec": spec}


def write_kubeconfig(path: Path, server: str, token: str | None = None, *,
                     cluster: Mapping[str, Any] | None = None,
                     user: Mapping[str, Any] | None = None) -> Path:
    """A kubeconfig pointing at ``server``, with bearer-token auth when given; ``cluster`` and
    ``user`` add fields to its cluster and user."""
    user = {**({"token": token} if token else {}), **(user or {})}
    doc = {
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [{"name": "fake", "cluster": {"server": server, **(cluster or {})}}],
        "users": [{"name": "tester", "user": user}],
        "contexts": [{"name": "fake", "context": {"cluster": "fake", "user": "tester"}}],
        "current-context": "fake",
    }
    path.write_text(yaml.safe_dump(doc))
    return path


def client_config(directory: Path, server: FakeApiServer, *, request_timeout_s: float,
                  retry_max_s: float) -> KubernetesConfig:
    """The agent's ``[kubernetes]`` settings for ``server``, through a kubeconfig written in
    ``directory``."""
    kubeconfig = write_kubeconfig(directory / "kubeconfig", server.url)
    return KubernetesConfig(kubeconfig=str(kubeconfig), request_timeout_s=request_timeout_s,
                            retry_max_s=retry_max_s)


@contextlib.contextmanager
def api_client(cfg: KubernetesConfig) -> Iterator[Any]:
    """The kubernetes client the agent builds from ``cfg``, closed afterwards."""
    client = build_api_client(cfg)
    assert client is not None
    try:
        yield client
    finally:
        client.close()


class FakeApiServer:
    """Start with ``with FakeApiServer() as api:``; ``api.url`` is the server address."""

    def __init__(self, *, token: str | None = None, poll_interval_s: float = 0.02,
                 tls: ssl.SSLContext | None = None) -> None:
        # How often the serving thread looks for a shutdown: short for the tests, which start
        # and stop many servers; a benchmark passes a long one, as the thread's wake-ups take
        # CPU on the machine measured, where a real API server runs elsewhere.
        self.token = token
        self._tls = tls
        self._poll_interval_s = poll_interval_s
        self._lock = threading.Condition()
        self._state = _State()
        self._closing = False
        self._handler = type("Handler", (Handler,), {"api": self})
        self._server = _Server(("127.0.0.1", 0), self._handler, tls)
        self._thread = self._serving_thread()
        self._up = False

    def _serving_thread(self) -> threading.Thread:
        return threading.Thread(
            target=self._server.serve_forever, kwargs={"poll_interval": self._poll_interval_s},
            daemon=True,
        )

    @property
    def url(self) -> str:
        host, port = self._server.server_address[:2]
        return f"{'https' if self._tls else 'http'}://{host!s}:{port}"

    def __enter__(self) -> FakeApiServer:
        self._thread.start()
        self._up = True
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop_serving()

    def _stop_serving(self) -> None:
        if not self._up:
            return
        self._up = False
        with self._lock:
            self._closing = True
            self._lock.notify_all()
        self._server.shutdown()
        self._server.server_close()
        self._server.close_connections()
        self._thread.join(timeout=5)

    # ---- outage -----------------------------------------------------------------------------

    def go_down(self) -> None:
        """The API server stops: open connections (watches too) are cut and the port refuses
        new ones. Pods and history are kept for :meth:`come_back`."""
        self._stop_serving()

    def come_back(self) -> None:
        """Serve again on the same address, with the state from before :meth:`go_down`."""
        address = self._server.server_address[:2]
        with self._lock:
            self._closing = False
        self._server = _Server((str(address[0]), int(address[1])), self._handler, self._tls)
        self._thread = self._serving_thread()
        self._thread.start()
        self._up = True

    # ---- pods -------------------------------------------------------------------------------

    def add_pod(self, pod: dict[str, Any]) -> dict[str, Any]:
        with self._lock:
            meta = pod["metadata"]
            key = (meta["namespace"], meta["name"])
            if key in self._state.pods:
                raise ValueError(f"pod {key} exists")
            return self._change("ADDED", key, copy.deepcopy(pod))

    def modify_pod(
        self, namespace: str, name: str, mutate: Callable[[dict[str, Any]], None]
    ) -> dict[str, Any]:
        with self._lock:
            pod = copy.deepcopy(self._state.pods[(namespace, name)])
            mutate(pod)
            return self._change("MODIFIED", (namespace, name), pod)

    def delete_pod(self, namespace: str, name: str, *, silently: bool = False) -> None:
        """Deletes a pod; ``silently`` skips the watch event, as if it was lost in compaction."""
        with self._lock:
            if silently:
                self._state.pods.pop((namespace, name))
                self._state.resource_version += 1
                return
            self._change("DELETED", (namespace, name), None)

    def bookmark(self) -> str:
        """Sends a BOOKMARK event to the open watches; returns its resourceVersion."""
        with self._lock:
            self._state.resource_version += 1
            rv = self._state.resource_version
            obj = {"kind": "Pod", "apiVersion": "v1", "metadata": {"resourceVersion": str(rv)}}
            self._state.history.append((rv, "BOOKMARK", obj))
            self._lock.notify_all()
            return str(rv)

    def pod(self, namespace: str, name: str) -> dict[str, Any] | None:
        with self._lock:
            found = self._state.pods.get((namespace, name))
            return copy.deepcopy(found)

    def _change(
        self, kind: str, key: tuple[str, str], pod: dict[str, Any] | None
    ) -> dict[str, Any]:
        state = self._state
        state.resource_version += 1
        if pod is None:
            pod = state.pods.pop(key)
        else:
            state.pods[key] = pod
        pod["metadata"]["resourceVersion"] = str(state.resource_version)
        state.history.append((state.resource_version, kind, copy.deepcopy(pod)))
        self._lock.notify_all()
        return copy.deepcopy(pod)

    # ---- nodes ------------------------------------------------------------------------------

    def add_node(self, name: str, taints: list[dict[str, str]] | None = None,
                 conditions: list[dict[str, str]] | None = None) -> None:
        with self._lock:
            self._state.resource_version += 1
            self._state.nodes[name] = {
                "apiVersion": "v1", "kind": "Node",
                "metadata": {"name": name, "resourceVersion": str(self._state.resource_version)},
                "spec": {"taints": list(taints or [])} if taints else {},
                "status": {"conditions": copy.deepcopy(conditions or [])},
            }

    def add_daemonset(self, namespace: str, name: str, uid: str) -> None:
        with self._lock:
            self._state.resource_version += 1
            self._state.daemonsets[(namespace, name)] = {
                "apiVersion": "apps/v1", "kind": "DaemonSet",
                "metadata": {"name": name, "namespace": namespace, "uid": uid,
                             "resourceVersion": str(self._state.resource_version)}}

    def node(self, name: str) -> dict[str, Any]:
        with self._lock:
            return copy.deepcopy(self._state.nodes[name])

    def taints(self, name: str) -> list[dict[str, Any]]:
        return list(self.node(name).get("spec", {}).get("taints") or [])

    def conditions(self, name: str) -> dict[str, dict[str, Any]]:
        """The node's status conditions by type."""
        found = self.node(name).get("status", {}).get("conditions") or []
        return {c["type"]: c for c in found}

    def condition_types(self, name: str) -> list[str]:
        """The types of the node's status conditions, in the order the node holds them."""
        return [c["type"] for c in self.node(name).get("status", {}).get("conditions") or []]

    def set_conditions(self, name: str, conditions: list[dict[str, Any]]) -> None:
        """Another writer (kubelet) sets the node's conditions."""
        with self._lock:
            node = self._state.nodes[name]
            self._state.resource_version += 1
            node["metadata"]["resourceVersion"] = str(self._state.resource_version)
            node.setdefault("status", {})["conditions"] = copy.deepcopy(conditions)

    def events(self) -> list[dict[str, Any]]:
        with self._lock:
            return copy.deepcopy(self._state.events)

    # ---- trouble ----------------------------------------------------------------------------

    def fail_next(
        self, method: str, path_prefix: str, status: int, count: int = 1, *,
        watch_only: bool = False, retry_after: str | None = None,
    ) -> None:
        """The next ``count`` matching requests (only watches, if asked) answer ``status``, with
        ``Retry-After: retry_after`` when given; a 429 as Priority and Fairness does, with
        ``Retry-After: 1`` unless told otherwise."""
        with self._lock:
            self._state.failures.append(
                _Failure(method, path_prefix, status, count, watch_only, retry_after)
            )

    def compact(self) -> None:
        """Forgets the event history: watches from any earlier resourceVersion get 410."""
        with self._lock:
            self._state.history.clear()
            self._state.oldest_rv = self._state.resource_version

    def end_watches(self) -> None:
        """Ends the open watch streams cleanly, as the server does at timeoutSeconds."""
        with self._lock:
            self._state.end_generation += 1
            self._lock.notify_all()

    def drop_watches(self) -> None:
        """Cuts the open watch connections in the middle of the chunked stream."""
        with self._lock:
            self._state.drop_generation += 1
            self._lock.notify_all()

    def delay_next(self, method: str, path_prefix: str, seconds: float, count: int = 1) -> None:
        """The next ``count`` matching requests are answered only after ``seconds`` (a client
        with a shorter timeout gives up first)."""
        with self._lock:
            self._state.delays.append(_Delay(method, path_prefix, seconds, count))

    def block_eviction(self, namespace: str, name: str, *,
                       retry_after: str | None = None) -> None:
        """Evictions of this pod answer 429, as with an exhausted PodDisruptionBudget, with
        ``Retry-After: retry_after`` when given."""
        with self._lock:
            self._state.pdb_blocked[(namespace, name)] = retry_after

    def unblock_eviction(self, namespace: str, name: str) -> None:
        with self._lock:
            self._state.pdb_blocked.pop((namespace, name), None)

    def conflict_next_patches(self, count: int) -> None:
        """Another writer updates the node before each of the next ``count`` patches (409)."""
        with self._lock:
            self._state.patch_conflicts += count

    # ---- observation ------------------------------------------------------------------------

    def requests(self, method: str | None = None, path: str | None = None) -> list[Recorded]:
        with self._lock:
            return [
                r for r in self._state.requests
                if (method is None or r.method == method) and (path is None or r.path == path)
            ]

    def watch_requests(self) -> list[Recorded]:
        return [r for r in self.requests("GET", "/api/v1/pods") if r.query.get("watch") == "true"]

    def list_requests(self) -> list[Recorded]:
        return [r for r in self.requests("GET", "/api/v1/pods") if r.query.get("watch") != "true"]

    @property
    def open_watches(self) -> int:
        with self._lock:
            return self._state.open_watches

    def wait_until(self, predicate: Callable[[], bool], timeout: float = 10.0) -> None:
        """Blocks until ``predicate`` holds (checked on every state change)."""
        deadline = time.monotonic() + timeout
        with self._lock:
            while not predicate():
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError("fake API server: condition not reached")
                self._lock.wait(min(left, 0.05))

    # ---- used by the handler (lock held by the caller where noted) -------------------------

    def _take_delay(self, method: str, path: str) -> float:
        for delay in self._state.delays:
            if delay.method == method and path.startswith(delay.path_prefix):
                delay.remaining -= 1
                if delay.remaining <= 0:
                    self._state.delays.remove(delay)
                return delay.seconds
        return 0.0

    def _take_failure(self, method: str, path: str, watch: bool) -> _Failure | None:
        for failure in self._state.failures:
            if failure.watch_only and not watch:
                continue
            if failure.method == method and path.startswith(failure.path_prefix):
                failure.remaining -= 1
                if failure.remaining <= 0:
                    self._state.failures.remove(failure)
                return failure
        return None


class _Server(ThreadingHTTPServer):
    """Keeps its connections, so that closing the fake also ends idle keep-alive handlers, and
    keeps handler errors (a client that went away) off stderr: tests check state, not logs."""

    daemon_threads = True

    def __init__(self, address: tuple[str, int], handler: type[BaseHTTPRequestHandler],
                 tls: ssl.SSLContext | None) -> None:
        super().__init__(address, handler)
        if tls is not None:
            # The handshake runs in the handler's thread, not in accept(): a client that
            # fails it must not stall the serving thread.
            self.socket = tls.wrap_socket(self.socket, server_side=True,
                                          do_handshake_on_connect=False)
        self._connections: set[socket.socket] = set()
        self._connections_lock = threading.Lock()
        self.errors: list[str] = []

    def process_request(self, request: Any, client_address: Any) -> None:
        with self._connections_lock:
            self._connections.add(request)
        super().process_request(request, client_address)

    def shutdown_request(self, request: Any) -> None:
        with self._connections_lock:
            self._connections.discard(request)
        super().shutdown_request(request)

    def handle_error(self, request: Any, client_address: Any) -> None:
        self.errors.append(f"{client_address}: {sys.exc_info()[1]!r}")

    def close_connections(self) -> None:
        with self._connections_lock:
            connections = list(self._connections)
        for connection in connections:
            with contextlib.suppress(OSError):
                connection.shutdown(socket.SHUT_RDWR)
