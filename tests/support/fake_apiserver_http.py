"""How the fake API server (:mod:`tests.support.fake_apiserver`) answers over HTTP: routing,
the pod list and watch, evictions, events, node reads and patches, with the faults its tests
injected. The handler works on the server's state under the server's lock."""

from __future__ import annotations

import copy
import json
import socket
import ssl
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler
from typing import TYPE_CHECKING, Any
from urllib.parse import parse_qs, urlsplit

if TYPE_CHECKING:
    from tests.support.fake_apiserver import FakeApiServer


@dataclass
class Recorded:
    """A request as the fake received it, and the status it answered."""

    method: str
    path: str
    query: dict[str, str]
    headers: dict[str, str]
    body: Any = None
    status: int = 0
    peer: str = ""
    """The common name of the client certificate the request came with, over TLS."""


def _peer(connection: Any) -> str:
    getpeercert = getattr(connection, "getpeercert", None)
    subject = (getpeercert() or {}).get("subject", ()) if getpeercert else ()
    return next((value for rdn in subject for key, value in rdn if key == "commonName"), "")


def status_body(code: int, reason: str, message: str, **extra: Any) -> dict[str, Any]:
    return {
        "kind": "Status", "apiVersion": "v1", "metadata": {},
        "status": "Success" if code < 400 else "Failure",
        "message": message, "reason": reason, "code": code, **extra,
    }


def pods_on(pods: Iterator[dict[str, Any]], node: str | None) -> list[dict[str, Any]]:
    return [p for p in pods if node is None or p.get("spec", {}).get("nodeName") == node]


def strategic_merge(target: Any, patch: Any) -> Any:
    """A strategic merge patch for what nri-qos sends: like a merge patch, except that
    ``status.conditions`` entries merge into the list by their ``type``."""
    result = merge_patch(target, {k: v for k, v in patch.items() if k != "status"})
    status = patch.get("status")
    if not isinstance(status, dict):
        return result
    merged_status = merge_patch(result.get("status"),
                                 {k: v for k, v in status.items() if k != "conditions"})
    if "conditions" in status:
        conditions = list(merged_status.get("conditions") or [])
        for entry in status["conditions"]:
            kinds = [c.get("type") for c in conditions]
            if entry.get("type") in kinds:
                i = kinds.index(entry.get("type"))
                conditions[i] = merge_patch(conditions[i], entry)
            else:
                conditions.append(copy.deepcopy(entry))
        merged_status["conditions"] = conditions
    result["status"] = merged_status
    return result


def merge_patch(target: Any, patch: Any) -> Any:
    """RFC 7386 JSON merge patch."""
    if not isinstance(patch, dict):
        return copy.deepcopy(patch)
    result = dict(target) if isinstance(target, dict) else {}
    for key, value in patch.items():
        if value is None:
            result.pop(key, None)
        else:
            result[key] = merge_patch(result.get(key), value)
    return result


BUDGET_REFUSAL = "Cannot evict pod as it would violate the pod's disruption budget."
BUDGET_DETAILS = {"causes": [{
    "reason": "DisruptionBudget",
    "message": "The disruption budget pdb needs 1 healthy pods and has 1",
}]}
"""The Status the API server sends with a 429 from a PodDisruptionBudget."""


class Handler(BaseHTTPRequestHandler):
    api: FakeApiServer
    protocol_version = "HTTP/1.1"

    def setup(self) -> None:
        # Over TLS the server leaves the handshake to the connection's own thread.
        if isinstance(self.request, ssl.SSLSocket):
            self.request.do_handshake()
        super().setup()

    def log_message(self, format: str, *args: Any) -> None:
        """Quiet: tests read the recorded requests instead."""

    def do_GET(self) -> None:
        self._serve("GET")

    def do_POST(self) -> None:
        self._serve("POST")

    def do_PATCH(self) -> None:
        self._serve("PATCH")

    # ---- dispatch ---------------------------------------------------------------------------

    def _serve(self, method: str) -> None:
        parts = urlsplit(self.path)
        query = {k: v[-1] for k, v in parse_qs(parts.query).items()}
        length = int(self.headers.get("Content-Length") or 0)
        raw = self.rfile.read(length) if length else b""
        try:
            body = json.loads(raw) if raw else None
        except ValueError:
            body = raw.decode(errors="replace")
        headers = {k.lower(): v for k, v in self.headers.items()}
        record = Recorded(method, parts.path, query, headers, body, peer=_peer(self.connection))
        api = self.api
        with api._lock:
            api._state.requests.append(record)
            api._lock.notify_all()
            if api.token is not None and record.headers.get("authorization") != (
                f"Bearer {api.token}"
            ):
                self._status(record, 401, "Unauthorized", "Unauthorized")
                return
            failure = api._take_failure(method, parts.path, query.get("watch") == "true")
            delay = api._take_delay(method, parts.path)
        if delay:
            deadline = time.monotonic() + delay
            with api._lock:
                while not api._closing and time.monotonic() < deadline:
                    api._lock.wait(deadline - time.monotonic())
        if failure is not None:
            sent = None if failure.retry_after is None else {"Retry-After": failure.retry_after}
            if failure.status == 429:
                # What API Priority and Fairness answers a client it throttles (no disruption
                # budget involved).
                self._status(record, 429, "TooManyRequests",
                             "Too many requests, please try again later.",
                             details={"retryAfterSeconds": 1}, headers=sent or {"Retry-After": "1"})
            else:
                self._status(record, failure.status,
                             "InternalError" if failure.status >= 500 else "Injected",
                             f"injected failure {failure.status}", headers=sent)
            return
        segments = [s for s in parts.path.split("/") if s]
        if method == "GET" and segments == ["api", "v1", "pods"]:
            self._pods(record)
        elif (method == "GET" and len(segments) == 6
              and segments[:3] == ["api", "v1", "namespaces"] and segments[4] == "pods"):
            found = api.pod(segments[3], segments[5])
            if found is None:
                self._status(record, 404, "NotFound", f'pods "{segments[5]}" not found')
            else:
                self._send_json(record, 200, found)
        elif (method == "POST" and len(segments) == 7
              and segments[:3] == ["api", "v1", "namespaces"]
              and segments[4] == "pods" and segments[6] == "eviction"):
            self._evict(record, segments[3], segments[5])
        elif (method == "GET" and len(segments) == 7
              and segments[:4] == ["apis", "apps", "v1", "namespaces"]
              and segments[5] == "daemonsets"):
            with api._lock:
                found = copy.deepcopy(api._state.daemonsets.get((segments[4], segments[6])))
            if found is None:
                self._status(record, 404, "NotFound",
                             f'daemonsets.apps "{segments[6]}" not found')
            else:
                self._send_json(record, 200, found)
        elif (method == "POST" and len(segments) == 5
              and segments[:3] == ["api", "v1", "namespaces"] and segments[4] == "events"):
            self._event(record, segments[3])
        elif len(segments) == 4 and segments[:3] == ["api", "v1", "nodes"] and method in (
            "GET", "PATCH"
        ):
            self._node(record, segments[3])
        elif (len(segments) == 5 and segments[:3] == ["api", "v1", "nodes"]
              and segments[4] == "status" and method in ("GET", "PATCH")):
            self._node(record, segments[3], status=True)
        else:
            self._status(record, 404, "NotFound", f"no route for {method} {parts.path}")

    def _send_json(self, record: Recorded, code: int, doc: Any,
                   headers: dict[str, str] | None = None) -> None:
        payload = json.dumps(doc).encode()
        record.status = code
        self.send_response(code)
        for name, value in (headers or {}).items():
            self.send_header(name, value)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(payload)))
        self.end_headers()
        self.wfile.write(payload)

    def _status(self, record: Recorded, code: int, reason: str, message: str, *,
                headers: dict[str, str] | None = None, **extra: Any) -> None:
        self._send_json(record, code, status_body(code, reason, message, **extra), headers)

    # ---- pods -------------------------------------------------------------------------------

    def _pods(self, record: Recorded) -> None:
        selector = record.query.get("fieldSelector", "")
        node = selector.split("=", 1)[1] if selector.startswith("spec.nodeName=") else None
        if record.query.get("watch") == "true":
            self._watch(record, node)
            return
        with self.api._lock:
            state = self.api._state
            items = copy.deepcopy(pods_on(iter(state.pods.values()), node))
            rv = str(state.resource_version)
        self._send_json(record, 200, {
            "kind": "PodList", "apiVersion": "v1",
            "metadata": {"resourceVersion": rv}, "items": items,
        })

    def _watch(self, record: Recorded, node: str | None) -> None:
        api = self.api
        state = api._state
        timeout = float(record.query.get("timeoutSeconds", "1800"))
        deadline = time.monotonic() + timeout
        record.status = 200
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()
        start = record.query.get("resourceVersion", "")
        pending: list[tuple[str, dict[str, Any]]] | None
        with api._lock:
            state.open_watches += 1
            end_gen, drop_gen = state.end_generation, state.drop_generation
            if start in ("", "0"):
                cursor = state.resource_version
                pending = [
                    ("ADDED", copy.deepcopy(p)) for p in pods_on(iter(state.pods.values()), node)
                ]
            else:
                cursor = int(start)
                pending = []
            gone = cursor < state.oldest_rv
        try:
            if gone:
                self._chunk({"type": "ERROR", "object": status_body(
                    410, "Expired", f"too old resource version: {cursor} ({state.oldest_rv})"
                )})
                self._end_chunks()
                return
            while True:
                for kind, obj in pending:
                    self._chunk({"type": kind, "object": obj})
                with api._lock:
                    while True:
                        if state.drop_generation != drop_gen or api._closing:
                            self.connection.shutdown(socket.SHUT_RDWR)
                            self.close_connection = True
                            return
                        newer = [(rv, k, o) for rv, k, o in state.history if rv > cursor]
                        if newer:
                            cursor = newer[-1][0]
                            pending = [
                                (k, copy.deepcopy(o)) for _, k, o in newer
                                if k == "BOOKMARK" or node is None
                                or o.get("spec", {}).get("nodeName") == node
                            ]
                            break
                        if state.end_generation != end_gen or time.monotonic() >= deadline:
                            pending = None
                            break
                        api._lock.wait(min(0.2, max(deadline - time.monotonic(), 0.001)))
                if pending is None:
                    break
            self._end_chunks()
        except OSError:
            self.close_connection = True
        finally:
            with api._lock:
                state.open_watches -= 1
                api._lock.notify_all()

    def _chunk(self, doc: Any) -> None:
        data = json.dumps(doc).encode() + b"\n"
        self.wfile.write(f"{len(data):x}\r\n".encode() + data + b"\r\n")
        self.wfile.flush()

    def _end_chunks(self) -> None:
        self.wfile.write(b"0\r\n\r\n")
        self.wfile.flush()

    # ---- eviction ---------------------------------------------------------------------------

    def _evict(self, record: Recorded, namespace: str, name: str) -> None:
        api = self.api
        dry_run = record.query.get("dryRun") == "All"
        body = record.body if isinstance(record.body, dict) else {}
        wanted_uid = ((body.get("deleteOptions") or {}).get("preconditions") or {}).get("uid")
        with api._lock:
            key = (namespace, name)
            if key not in api._state.pods:
                code, reason, message = 404, "NotFound", f'pods "{name}" not found'
            elif wanted_uid is not None \
                    and api._state.pods[key]["metadata"].get("uid") != wanted_uid:
                # As the API server answers a precondition that does not hold.
                code, reason = 409, "Conflict"
                message = (f"Operation cannot be fulfilled on Pod \"{name}\": Precondition "
                           f"failed: UID in precondition: {wanted_uid}, UID in object meta: "
                           f"{api._state.pods[key]['metadata'].get('uid')}")
            elif key in api._state.pdb_blocked:
                retry_after = api._state.pdb_blocked[key]
                self._status(record, 429, "TooManyRequests", BUDGET_REFUSAL,
                             details=BUDGET_DETAILS,
                             headers=None if retry_after is None else {"Retry-After": retry_after})
                return
            else:
                if not dry_run:
                    api._change("DELETED", key, None)
                code, reason, message = 201, "", ""
        self._status(record, code, reason, message)

    # ---- events -----------------------------------------------------------------------------

    def _event(self, record: Recorded, namespace: str) -> None:
        api = self.api
        event = record.body if isinstance(record.body, dict) else {}
        metadata = event.get("metadata") or {}
        involved = event.get("involvedObject") or {}
        if not metadata.get("name") or metadata.get("namespace", namespace) != namespace \
                or involved.get("namespace") != namespace:
            self._status(record, 422, "Invalid", "event name or namespace invalid")
            return
        with api._lock:
            api._state.resource_version += 1
            stored = copy.deepcopy(event)
            stored["metadata"] = {**metadata, "namespace": namespace, "uid": str(uuid.uuid4()),
                                  "resourceVersion": str(api._state.resource_version)}
            api._state.events.append(stored)
            api._lock.notify_all()
        self._send_json(record, 201, stored)

    # ---- nodes ------------------------------------------------------------------------------

    def _node(self, record: Recorded, name: str, *, status: bool = False) -> None:
        """The node, or (``status``) its status subresource: as in the real API, a patch of the
        node ignores its status, and a patch of the status only changes the status."""
        api = self.api
        with api._lock:
            state = api._state
            node = state.nodes.get(name)
            if node is None:
                self._status(record, 404, "NotFound", f'nodes "{name}" not found')
                return
            if record.method == "GET":
                self._send_json(record, 200, node)
                return
            kind = record.headers.get("content-type")
            strategic = kind == "application/strategic-merge-patch+json"
            if kind != "application/merge-patch+json" and not strategic:
                self._status(record, 415, "UnsupportedMediaType", "only merge patches here")
                return
            if state.patch_conflicts > 0:
                state.patch_conflicts -= 1
                state.resource_version += 1
                node["metadata"]["resourceVersion"] = str(state.resource_version)
            patch = record.body if isinstance(record.body, dict) else {}
            wanted_rv = patch.get("metadata", {}).get("resourceVersion")
            patch = {k: v for k, v in patch.items() if (k == "status") is status}
            if wanted_rv is not None and wanted_rv != node["metadata"]["resourceVersion"]:
                self._status(record, 409, "Conflict",
                             f'Operation cannot be fulfilled on nodes "{name}": the object has '
                             "been modified; please apply your changes to the latest version "
                             "and try again")
                return
            # The status subresource changes status only, whatever else the patch says.
            merge = strategic_merge if strategic else merge_patch
            updated = merge(node, {"status": patch.get("status", {})} if status else patch)
            state.resource_version += 1
            updated["metadata"]["resourceVersion"] = str(state.resource_version)
            state.nodes[name] = updated
            api._lock.notify_all()
            self._send_json(record, 200, updated)
