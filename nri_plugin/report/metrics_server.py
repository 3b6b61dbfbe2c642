"""The HTTP endpoint of the agent: Prometheus metrics, liveness and readiness.

Served from the event loop with asyncio, one short-lived connection per request:

* ``GET /metrics``: the registry as ``prometheus_client``'s own WSGI application renders it:
  content negotiation (OpenMetrics for ``Accept: application/openmetrics-text``, else the text
  format), gzip when the client accepts it, ``name[]`` filters. It runs in a worker thread of its
  own, because some series are read at scrape time (resctrl monitoring files): a scrape never
  holds up an NRI answer for longer than the interpreter's switch interval.
* ``GET /healthz``: 200 while the event loop answers (it is what answers).
* ``GET /readyz``: 200 once the agent is registered with the runtime and synchronized, else 503;
  a rolling update of the DaemonSet waits for it before moving to the next node.

``HEAD`` is answered like ``GET`` without the body. Anything else is 404 (405 for other methods).
The endpoint is reachable by whatever can reach the pod, so it bounds what a client can take:
at most :data:`MAX_CONNECTIONS` connections at once (more are closed unanswered), the head of a
request in :data:`MAX_HEAD_BYTES`, and the whole request (reading it, rendering, writing the
answer) within :data:`REQUEST_TIMEOUT_S`. Connection handlers are owned by the endpoint and
cancelled at stop; the endpoint's task belongs to the agent's TaskGroup.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import structlog
from prometheus_client import CollectorRegistry, make_wsgi_app

from nri_plugin.report.local_server import Clients

log = structlog.get_logger("nri_qos.metrics")

REQUEST_TIMEOUT_S = 5.0
"""Reading the request, rendering and writing the answer, all together."""
MAX_HEAD_BYTES = 8192
MAX_CONNECTIONS = 16
"""Connections served at once: a scraper, the kubelet's probes and a person, with room to
spare; past it a connection is closed at once rather than queued."""

_REASONS = {200: "OK", 400: "Bad Request", 404: "Not Found", 405: "Method Not Allowed",
            500: "Internal Server Error", 503: "Service Unavailable"}

Headers = list[tuple[str, str]]


class MetricsEndpoint:
    """Serves ``registry`` on ``address:port`` until stopped; ``ready`` answers ``/readyz``."""

    def __init__(self, registry: CollectorRegistry, address: str, port: int, *,
                 ready: Callable[[], bool]) -> None:
        self._app = make_wsgi_app(registry)
        self._address = address
        self._port = port
        self._ready = ready
        self._clients = Clients()
        self._open = 0
        # The address actually bound (port 0 picks one), once serving.
        self.bound: tuple[str, int] | None = None

    async def serve(self, stop: asyncio.Event) -> None:
        executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="nri-qos-metrics")
        try:
            server = await asyncio.start_server(
                lambda r, w: self._handle(r, w, executor), self._address, self._port,
                limit=MAX_HEAD_BYTES, reuse_address=True)
        except OSError as exc:
            # The agent's job is NRI: it goes on without its endpoint, loudly.
            hint = ("another process on this port? see [metrics] port"
                    if exc.errno == errno.EADDRINUSE else
                    "is the address one of this host's? see [metrics] address and "
                    "--metrics-address")
            log.error("metrics_unavailable", address=self._address, port=self._port,
                      error=str(exc), hint=hint)
            executor.shutdown(wait=False)
            await stop.wait()
            return
        host, port = server.sockets[0].getsockname()[:2]
        self.bound = (host, port)
        log.info("metrics_serving", address=host, port=port)
        try:
            await self._clients.serve_until(server, stop)
        finally:
            # A render still running finishes in its thread; its answer is dropped.
            executor.shutdown(wait=False, cancel_futures=True)
            self.bound = None

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                      executor: ThreadPoolExecutor) -> None:
        if self._open >= MAX_CONNECTIONS:
            writer.close()
            return
        self._open += 1
        try:
            async with self._clients.answering(writer):
                with contextlib.suppress(TimeoutError, asyncio.IncompleteReadError,
                                         asyncio.LimitOverrunError, ConnectionError):
                    async with asyncio.timeout(REQUEST_TIMEOUT_S):
                        head = await reader.readuntil(b"\r\n\r\n")
                        writer.write(await self._answer(head, executor))
                        await writer.drain()
        finally:
            self._open -= 1

    async def _answer(self, head: bytes, executor: ThreadPoolExecutor) -> bytes:
        lines = head.decode("latin-1").split("\r\n")
        parts = lines[0].split(" ")
        if len(parts) != 3 or not parts[2].startswith("HTTP/"):
            return _response(*_text(400, "bad request\n"))
        method, (path, _, query) = parts[0], parts[1].partition("?")
        if path not in ("/metrics", "/healthz", "/readyz"):
            return _response(*_text(404, "not found: try /metrics, /healthz, /readyz\n"))
        if method not in ("GET", "HEAD"):
            return _response(*_text(405, "only GET and HEAD\n"))
        answer = await self._get(path, query, _fields(lines[1:]), executor)
        return _response(*answer, with_body=method == "GET")

    async def _get(self, path: str, query: str, fields: dict[str, str],
                   executor: ThreadPoolExecutor) -> tuple[int, Headers, bytes]:
        if path == "/healthz":
            return _text(200, "ok\n")
        if path == "/readyz":
            return _text(200, "ready\n") if self._ready() else _text(
                503, "not synchronized with the runtime\n")
        environ = {"REQUEST_METHOD": "GET", "PATH_INFO": path, "QUERY_STRING": query}
        for name in ("accept", "accept-encoding"):
            if name in fields:
                environ["HTTP_" + name.upper().replace("-", "_")] = fields[name]
        loop = asyncio.get_running_loop()
        try:
            return await loop.run_in_executor(executor, self._render, environ)
        except Exception:
            log.exception("metrics_render_failed")
            return _text(500, "rendering the metrics failed; see the agent's log\n")

    def _render(self, environ: dict[str, str]) -> tuple[int, Headers, bytes]:
        """The library's WSGI application, called as a WSGI server would call it."""
        answer: dict[str, Any] = {}

        def start_response(status: str, headers: Headers) -> None:
            answer["status"], answer["headers"] = int(status.split(" ", 1)[0]), headers

        body: Iterable[bytes] = self._app(environ, start_response)
        return answer["status"], answer["headers"], b"".join(body)


def _fields(lines: list[str]) -> dict[str, str]:
    """Header fields by lower-case name (the last one wins)."""
    fields = {}
    for line in lines:
        name, sep, value = line.partition(":")
        if sep:
            fields[name.strip().lower()] = value.strip()
    return fields


def _text(status: int, text: str) -> tuple[int, Headers, bytes]:
    return status, [("Content-Type", "text/plain; charset=utf-8")], text.encode()


def _response(status: int, headers: Headers, body: bytes, *, with_body: bool = True) -> bytes:
    """The answer; without its body for HEAD, whose ``Content-Length`` is the GET's."""
    lines = [f"HTTP/1.1 {status} {_REASONS.get(status, 'OK')}",
             *(f"{name}: {value}" for name, value in headers if name.lower() != "content-length"),
             f"Content-Length: {len(body)}", "Connection: close", "", ""]
    return "\r\n".join(lines).encode("latin-1") + (body if with_body else b"")
