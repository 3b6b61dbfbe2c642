"""The HTTP endpoint of the agent: Prometheus metrics, liveness and readiness.

Served from the event loop with asyncio, one short-lived connection per request:

* ``GET /metrics``: the registry in Prometheus' text format. Rendering runs in a worker thread of
  its own, because some series are read at scrape time (resctrl monitoring files): a scrape
  never holds up an NRI answer for longer than the interpreter's switch interval.
* ``GET /healthz``: 200 while the event loop answers (it is what answers).
* ``GET /readyz``: 200 once the agent is registered with the runtime and synchronized, else 503;
  a rolling update of the DaemonSet waits for it before moving to the next node.

Anything else is 404 (405 for other methods). A request must arrive within
:data:`READ_TIMEOUT_S` and its head fit in :data:`MAX_HEAD_BYTES`. Connection handlers are owned
by the endpoint and cancelled at stop; the endpoint's task belongs to the agent's TaskGroup.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import structlog
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest

from nri_plugin.local_server import Clients

log = structlog.get_logger("nri_qos.metrics")

READ_TIMEOUT_S = 5.0
MAX_HEAD_BYTES = 8192

_REASONS = {200: "OK", 400: "Bad Request", 404: "Not Found", 405: "Method Not Allowed",
            500: "Internal Server Error", 503: "Service Unavailable"}


class MetricsEndpoint:
    """Serves ``registry`` on ``address:port`` until stopped; ``ready`` answers ``/readyz``."""

    def __init__(self, registry: CollectorRegistry, address: str, port: int, *,
                 ready: Callable[[], bool]) -> None:
        self._registry = registry
        self._address = address
        self._port = port
        self._ready = ready
        self._clients = Clients()
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
            log.error("metrics_unavailable", address=self._address, port=self._port,
                      error=str(exc), hint="another process on this port? see [metrics]")
            executor.shutdown(wait=False)
            await stop.wait()
            return
        host, port = server.sockets[0].getsockname()[:2]
        self.bound = (host, port)
        log.info("metrics_serving", address=host, port=port)
        try:
            await self._clients.serve_until(server, stop)
        finally:
            executor.shutdown(wait=False, cancel_futures=True)
            self.bound = None

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                      executor: ThreadPoolExecutor) -> None:
        async with self._clients.answering(writer):
            try:
                async with asyncio.timeout(READ_TIMEOUT_S):
                    head = await reader.readuntil(b"\r\n\r\n")
                status, content_type, body = await self._answer(head, executor)
                writer.write(_response(status, content_type, body))
                await writer.drain()
            except (TimeoutError, asyncio.IncompleteReadError, asyncio.LimitOverrunError,
                    ConnectionError):
                return

    async def _answer(self, head: bytes,
                      executor: ThreadPoolExecutor) -> tuple[int, str, bytes]:
        request_line = head.split(b"\r\n", 1)[0].decode("latin-1")
        parts = request_line.split(" ")
        if len(parts) != 3 or not parts[2].startswith("HTTP/"):
            return 400, "text/plain", b"bad request\n"
        method, target = parts[0], parts[1].split("?", 1)[0]
        if target not in ("/metrics", "/healthz", "/readyz"):
            return 404, "text/plain", b"not found: try /metrics, /healthz, /readyz\n"
        if method != "GET":
            return 405, "text/plain", b"only GET\n"
        if target == "/healthz":
            return 200, "text/plain", b"ok\n"
        if target == "/readyz":
            if self._ready():
                return 200, "text/plain", b"ready\n"
            return 503, "text/plain", b"not synchronized with the runtime\n"
        loop = asyncio.get_running_loop()
        try:
            body = await loop.run_in_executor(executor, generate_latest, self._registry)
        except Exception:
            log.exception("metrics_render_failed")
            return 500, "text/plain", b"rendering the metrics failed; see the agent's log\n"
        return 200, CONTENT_TYPE_LATEST, body


def _response(status: int, content_type: str, body: bytes) -> bytes:
    head = (f"HTTP/1.1 {status} {_REASONS[status]}\r\nContent-Type: {content_type}\r\n"
            f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n")
    return head.encode("latin-1") + body
