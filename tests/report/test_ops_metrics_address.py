"""The metrics endpoint's hint when it cannot listen: a port in use is not the only cause, and
an address that names nothing (``$(POD_IP)`` left unexpanded) must not be sent looking for
another process."""

from __future__ import annotations

import asyncio
import socket
from collections.abc import MutableMapping
from typing import Any

from structlog.testing import capture_logs

from common.metrics import Metrics
from nri_plugin.report.metrics_server import MetricsEndpoint
from tests.support.metrics_http import until


async def _refusal(address: str, port: int) -> MutableMapping[str, Any]:
    endpoint = MetricsEndpoint(Metrics().registry, address, port, ready=lambda: True)
    stop = asyncio.Event()
    with capture_logs() as logs:
        serving = asyncio.create_task(endpoint.serve(stop))
        await until(lambda: any(e["event"] == "metrics_unavailable" for e in logs))
        stop.set()
        await serving
    (entry,) = [e for e in logs if e["event"] == "metrics_unavailable"]
    return entry


async def test_an_address_that_names_nothing_is_said_to_be_the_address() -> None:
    entry = await _refusal("$(POD_IP)", 0)
    assert "another process" not in str(entry["hint"])
    assert "--metrics-address" in str(entry["hint"])


async def test_a_port_in_use_still_points_at_another_process() -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        entry = await _refusal("127.0.0.1", taken.getsockname()[1])
    assert "another process" in str(entry["hint"])
