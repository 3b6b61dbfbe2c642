"""The metrics endpoint: health, refusals, a failing collector, a port in use, the format
negotiated with the library's exposition, gzip, HEAD, the connection cap and slow clients."""

from __future__ import annotations

import asyncio
import contextlib
import gzip
import logging
import socket
from pathlib import Path

import prometheus_client
import pytest
from structlog.testing import capture_logs

import nri_plugin.report.metrics_server
from common.audit import AuditLog, MemoryAuditSink
from common.metrics import Metrics, PluginMetrics
from nri_plugin.config.store import ConfigStore
from nri_plugin.report.metrics_server import MAX_CONNECTIONS, REQUEST_TIMEOUT_S, MetricsEndpoint
from reconciler.detection.signals import Reading
from reconciler.metrics import ReconcilerMetrics
from tests.support.metrics_http import http_get, parse, until, value


async def test_endpoint_answers_health_and_refuses_the_rest() -> None:
    ready = [False]
    endpoint = MetricsEndpoint(Metrics().registry, "127.0.0.1", 0, ready=lambda: ready[0])
    stop = asyncio.Event()
    async with asyncio.TaskGroup() as group:
        group.create_task(endpoint.serve(stop))
        await until(lambda: endpoint.bound is not None)
        assert endpoint.bound is not None
        port = endpoint.bound[1]
        assert await http_get(port, "/healthz") == (200, "ok\n")
        assert (await http_get(port, "/readyz"))[0] == 503
        ready[0] = True
        assert await http_get(port, "/readyz") == (200, "ready\n")
        assert (await http_get(port, "/metrics?x=1"))[0] == 200
        assert (await http_get(port, "/nope"))[0] == 404
        assert (await http_get(port, "/metrics", method="POST"))[0] == 405
        # Garbage and a client that never finishes its request: neither holds the endpoint.
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(b"\x00\x01 garbage\r\n\r\n")
        assert (await reader.read()).startswith(b"HTTP/1.1 400")
        writer.close()
        idle_reader, idle_writer = await asyncio.open_connection("127.0.0.1", port)
        assert (await http_get(port, "/healthz"))[0] == 200
        stopping = asyncio.get_running_loop().time()
        stop.set()
    # Stopping closed the idle connection too, at once: not when its read timed out.
    assert asyncio.get_running_loop().time() - stopping < REQUEST_TIMEOUT_S
    assert await idle_reader.read() == b""
    idle_writer.close()


async def test_a_collector_that_fails_answers_500() -> None:
    metrics = ReconcilerMetrics()

    class Broken:
        def current(self) -> list[Reading]:
            raise RuntimeError("board on fire")

    metrics.watch_board(Broken())
    endpoint = MetricsEndpoint(metrics.registry, "127.0.0.1", 0, ready=lambda: True)
    stop = asyncio.Event()
    async with asyncio.TaskGroup() as group:
        group.create_task(endpoint.serve(stop))
        await until(lambda: endpoint.bound is not None)
        assert endpoint.bound is not None
        with capture_logs() as logs:
            assert (await http_get(endpoint.bound[1], "/metrics"))[0] == 500
        assert any(entry["event"] == "metrics_render_failed" for entry in logs)
        stop.set()


async def test_port_in_use_is_logged_and_the_agent_goes_on() -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        endpoint = MetricsEndpoint(Metrics().registry, "127.0.0.1", port, ready=lambda: True)
        stop = asyncio.Event()
        with capture_logs() as logs:
            serving = asyncio.create_task(endpoint.serve(stop))
            await until(lambda: any(e["event"] == "metrics_unavailable" for e in logs))
            assert not serving.done()
            stop.set()
            await serving
    assert endpoint.bound is None


async def request(port: int, head: str) -> tuple[int, dict[str, str], bytes]:
    """One raw request; the status, the header fields (lower-case names) and the body."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(head.encode())
    await writer.drain()
    data = await reader.read()
    writer.close()
    await writer.wait_closed()
    top, _, body = data.partition(b"\r\n\r\n")
    lines = top.decode("latin-1").split("\r\n")
    fields = {}
    for line in lines[1:]:
        name, _, text = line.partition(":")
        fields[name.strip().lower()] = text.strip()
    return int(lines[0].split()[1]), fields, body


class Serving:
    """A metrics endpoint of its own on a free port, for one test."""

    def __init__(self, metrics: Metrics) -> None:
        self.endpoint = MetricsEndpoint(metrics.registry, "127.0.0.1", 0, ready=lambda: True)
        self.stop = asyncio.Event()
        self.task: asyncio.Task[None] | None = None

    async def __aenter__(self) -> int:
        self.task = asyncio.create_task(self.endpoint.serve(self.stop))
        await until(lambda: self.endpoint.bound is not None)
        assert self.endpoint.bound is not None
        return self.endpoint.bound[1]

    async def __aexit__(self, *_: object) -> None:
        self.stop.set()
        assert self.task is not None
        await self.task


def counted_metrics() -> Metrics:
    metrics = Metrics("9.9.9")
    PluginMetrics(metrics.registry).nri_request("create_container", "ok", 0.001)
    return metrics


async def test_scrapes_negotiate_the_format_with_the_librarys_exposition() -> None:
    async with Serving(counted_metrics()) as port:
        status, fields, body = await request(port, "GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n")
        assert status == 200
        assert fields["content-type"].startswith("text/plain; version=0.0.4")
        text = body.decode()
        assert 'nri_qos_nri_requests_total{event="create_container",result="ok"} 1.0' in text
        assert "_created" not in text
        status, fields, body = await request(
            port, "GET /metrics HTTP/1.1\r\nHost: x\r\n"
                  "Accept: application/openmetrics-text; version=1.0.0\r\n\r\n")
        assert status == 200
        assert fields["content-type"].startswith("application/openmetrics-text")
        open_text = body.decode()
        assert open_text.endswith("# EOF\n")
        assert 'nri_qos_nri_requests_total{event="create_container",result="ok"} 1.0' in open_text
        assert "_created" not in open_text


async def test_gzip_when_the_scraper_accepts_it() -> None:
    async with Serving(counted_metrics()) as port:
        status, fields, body = await request(
            port, "GET /metrics HTTP/1.1\r\nHost: x\r\nAccept-Encoding: gzip\r\n\r\n")
        assert status == 200
        assert fields["content-encoding"] == "gzip"
        assert b"nri_qos_nri_requests_total" in gzip.decompress(body)
        assert int(fields["content-length"]) == len(body)


async def test_head_is_answered_without_a_body() -> None:
    async with Serving(counted_metrics()) as port:
        _, got, body = await request(port, "GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n")
        status, fields, empty = await request(port, "HEAD /metrics HTTP/1.1\r\nHost: x\r\n\r\n")
        assert status == 200
        assert empty == b""
        assert fields["content-type"] == got["content-type"]
        # Within a few bytes of the GET's: the process series move between the two scrapes.
        assert abs(int(fields["content-length"]) - len(body)) < 64
        for path in ("/healthz", "/readyz"):
            status, fields, empty = await request(port, f"HEAD {path} HTTP/1.1\r\nHost: x\r\n\r\n")
            assert (status, empty) == (200, b"")
            assert int(fields["content-length"]) > 0


def test_the_guard_cap_is_absent_until_one_is_set() -> None:
    metrics = ReconcilerMetrics()
    assert "nri_qos_memory_guard_cap_bytes" not in prometheus_client.generate_latest(
        metrics.registry).decode()
    metrics.memory_guard(1 << 30, 1 << 29)
    assert value(parse(prometheus_client.generate_latest(metrics.registry).decode()),
                 "nri_qos_memory_guard_cap_bytes") == 1 << 30


def reloading(tmp_path: Path, metrics: Metrics) -> tuple[ConfigStore, Path]:
    """A configuration store on an empty file, its loads counted in ``metrics``."""
    path = tmp_path / "config.toml"
    path.write_text("")
    store = ConfigStore(AuditLog(MemoryAuditSink()))
    store.load_initial(str(path))
    store.on_load(lambda ok: metrics.config_reload(ok, 1234.0))
    return store, path


def test_config_reloads_are_counted(tmp_path: Path) -> None:
    metrics = Metrics()
    store, path = reloading(tmp_path, metrics)
    path.write_text("[plugin]\nstrict = 1\n")
    store.reload()
    path.write_text("[plugin]\nstrict = true\n")
    store.reload()
    samples = parse(prometheus_client.generate_latest(metrics.registry).decode())
    assert value(samples, "nri_qos_config_reloads_total", result="failure") == 1
    assert value(samples, "nri_qos_config_reloads_total", result="success") == 1
    assert value(samples, "nri_qos_config_last_reload_success_timestamp_seconds") == 1234.0


def test_a_refused_configuration_is_shown_until_a_load_takes_effect(tmp_path: Path) -> None:
    """The agent tries a changed file once: a refused one stays refused with no further count,
    so only a level tells an alert that the node runs an older configuration than its files."""
    metrics = Metrics()
    store, path = reloading(tmp_path, metrics)

    def refused() -> float:
        return value(parse(prometheus_client.generate_latest(metrics.registry).decode()),
                     "nri_qos_config_refused")

    assert refused() == 0
    path.write_text("[plugin]\nstrict = 1\n")
    store.reload()
    assert refused() == 1
    store.reload()  # the same refused files again
    assert refused() == 1
    path.write_text("[plugin]\nstrict = true\n")
    store.reload()
    assert refused() == 0


async def test_connections_over_the_cap_are_closed_unanswered(
        caplog: pytest.LogCaptureFixture) -> None:
    async with Serving(Metrics()) as port:
        idle = [await asyncio.open_connection("127.0.0.1", port) for _ in range(MAX_CONNECTIONS)]
        await asyncio.sleep(0.1)
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(b"GET /healthz HTTP/1.1\r\n\r\n")
        # Closed unanswered: an end of file, or a reset since the request was not read.
        with contextlib.suppress(ConnectionResetError):
            assert await reader.read() == b""
        writer.close()
        for _, idle_writer in idle:
            idle_writer.close()
        await asyncio.sleep(0.1)
        assert (await http_get(port, "/healthz"))[0] == 200
        still_open = [await asyncio.open_connection("127.0.0.1", port) for _ in range(4)]
        await asyncio.sleep(0.1)
    # Stopped with handlers waiting on their clients: they end without a traceback.
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR], caplog.text
    for _, writer in still_open:
        writer.close()


async def test_a_slow_client_is_cut_off_after_the_request_timeout(
        monkeypatch: pytest.MonkeyPatch) -> None:
    # Each byte in time for any per-read timeout, the whole request far too slow.
    monkeypatch.setattr(nri_plugin.report.metrics_server, "REQUEST_TIMEOUT_S", 0.5)
    async with Serving(Metrics()) as port:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        started = asyncio.get_running_loop().time()
        with pytest.raises(ConnectionError):  # noqa: PT012 - the write that finds it closed
            for byte in b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n":
                writer.write(bytes([byte]))
                await writer.drain()
                await asyncio.sleep(0.1)
                if reader.at_eof():
                    raise ConnectionResetError
        assert asyncio.get_running_loop().time() - started < 2.0
        writer.close()
