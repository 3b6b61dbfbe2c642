"""The agent's two small servers (the metrics endpoint, the status socket) against clients that
ask and never read their answer: each connection ends within its time, whatever the client."""

from __future__ import annotations

import asyncio
import contextlib
import socket
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

import nri_plugin.report.local_server
import nri_plugin.report.metrics_server
import nri_plugin.report.status
from common.metrics import Metrics
from nri_plugin.report.metrics_server import MetricsEndpoint
from nri_plugin.report.status import StatusServer
from tests.support.metrics_http import http_get, until

ANSWER_BYTES = 6 << 20
"""More than the kernel's buffers on both ends of a connection hold (a loopback TCP send
buffer grows to 4 MiB at most)."""


class _Large(Collector):
    """A family whose rendering is some ANSWER_BYTES: the answer of a node with many series."""

    def collect(self) -> Iterator[GaugeMetricFamily]:
        family = GaugeMetricFamily("large", "Large.", labels=["filler"])
        for i in range(ANSWER_BYTES >> 16):
            family.add_metric([f"{i}-" + "x" * (1 << 16)], 1)
        yield family


def _not_reading(address: tuple[str, int] | str) -> socket.socket:
    """A client socket that takes in little and reads nothing unless told."""
    family = socket.AF_UNIX if isinstance(address, str) else socket.AF_INET
    client = socket.socket(family, socket.SOCK_STREAM)
    client.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    client.connect(address)
    return client


async def _answer_begins(client: socket.socket) -> None:
    """Until the first byte of the answer arrived (left unread)."""
    client.settimeout(10.0)
    await asyncio.to_thread(client.recv, 1, socket.MSG_PEEK)


async def _read_to_the_end(client: socket.socket) -> int:
    """Read what comes until the end of the connection; the bytes read."""
    client.settimeout(10.0)
    total = 0
    with contextlib.suppress(ConnectionResetError):
        while data := await asyncio.to_thread(client.recv, 1 << 16):
            total += len(data)
    return total


@pytest.fixture
def short_times(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(nri_plugin.report.metrics_server, "REQUEST_TIMEOUT_S", 1.0)
    monkeypatch.setattr(nri_plugin.report.status, "WRITE_TIMEOUT_S", 0.5)
    monkeypatch.setattr(nri_plugin.report.local_server, "CLOSE_TIMEOUT_S", 0.5)


@pytest.mark.usefixtures("short_times")
async def test_scrapers_that_never_read_their_answer_do_not_keep_their_connections(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(nri_plugin.report.metrics_server, "MAX_CONNECTIONS", 2)
    metrics = Metrics()
    metrics.registry.register(_Large())
    endpoint = MetricsEndpoint(metrics.registry, "127.0.0.1", 0, ready=lambda: True)
    stop = asyncio.Event()
    serving = asyncio.create_task(endpoint.serve(stop))
    clients: list[socket.socket] = []
    try:
        await until(lambda: endpoint.bound is not None)
        assert endpoint.bound is not None
        port = endpoint.bound[1]
        for _ in range(2):
            client = _not_reading(("127.0.0.1", port))
            client.sendall(b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n")
            await _answer_begins(client)
            clients.append(client)
        await asyncio.sleep(2.5)  # past the request's time and the close's
        # The kubelet's liveness probe finds a free connection: the agent is not restarted.
        assert (await http_get(port, "/healthz"))[0] == 200
        # And the stalled answers were given up, not kept for the clients.
        assert await _read_to_the_end(clients[0]) < ANSWER_BYTES
    finally:
        for client in clients:
            client.close()
        stop.set()
        await serving


@contextlib.asynccontextmanager
async def _stalled_status_client(
        tmp_path: Path) -> AsyncIterator[tuple[socket.socket, asyncio.Event, asyncio.Task[None]]]:
    """A status socket whose one client asked and reads nothing, its answer begun: the
    client, the server's stop and the server's task."""
    path = str(tmp_path / "s.sock")
    document = {"filler": "x" * ANSWER_BYTES}
    server = StatusServer(path, lambda: document)
    stop = asyncio.Event()
    serving = asyncio.create_task(server.serve(stop))
    await until(lambda: Path(path).exists())
    client = _not_reading(path)
    try:
        await _answer_begins(client)  # the handler now waits for the client to read
        yield client, stop, serving
    finally:
        client.close()
        stop.set()
        await serving


@pytest.mark.usefixtures("short_times")
async def test_a_status_client_that_never_reads_does_not_keep_its_connection(
        tmp_path: Path) -> None:
    async with _stalled_status_client(tmp_path) as (client, _, _):
        await asyncio.sleep(1.5)  # past the write's time and the close's
        # The agent gave the answer up: what the socket's buffers held, then the end.
        assert await _read_to_the_end(client) < ANSWER_BYTES


async def test_a_client_that_never_reads_does_not_hold_up_the_agents_stop(
        tmp_path: Path) -> None:
    async with _stalled_status_client(tmp_path) as (_, stop, serving):
        stop.set()
        async with asyncio.timeout(2.0):
            await serving
