"""The daemon's external mode: waiting for the runtime, reconnecting, never two registrations."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path

import pytest

from hooks.events import Event
from nri_plugin.cli import daemon
from nri_plugin.sim.simulator import RuntimeSimulator
from protos import nri_api_pb2 as api

CONFIG = """
[plugin]
reconnect_initial_ms = 20
reconnect_max_ms = 100
[resctrl]
enabled = false
[reconciler]
enabled = false
[status]
enabled = false
"""

Start = Callable[[Path], Awaitable[None]]


@pytest.fixture
async def plugin(tmp_path: Path) -> AsyncIterator[Start]:
    config = tmp_path / "config.toml"
    config.write_text(CONFIG)
    stop = asyncio.Event()
    tasks: list[asyncio.Task[int]] = []

    async def start(socket_path: Path) -> None:
        tasks.append(asyncio.create_task(daemon.serve(
            str(config), str(socket_path), "warning", stop=stop, prelaunched=None)))

    yield start
    stop.set()
    assert await asyncio.gather(*tasks) == [0] * len(tasks)


async def test_waits_for_missing_socket_then_connects(tmp_path: Path, plugin: Start,
                                                      capsys: pytest.CaptureFixture[str]) -> None:
    socket_path = tmp_path / "nri.sock"
    await plugin(socket_path)
    # Let it fail at least once against the missing socket.
    async with asyncio.timeout(15):
        while "runtime_socket_unavailable" not in capsys.readouterr().err:  # noqa: ASYNC110
            await asyncio.sleep(0.02)  # only the log tells; nothing to wait on
    simulator = RuntimeSimulator(socket_path)
    await simulator.start()
    connection = await simulator.wait_ready()
    assert connection.name == "nri-qos"
    await simulator.stop()


async def test_runtime_restart_resynchronizes_with_one_live_registration(
    tmp_path: Path, plugin: Start,
) -> None:
    socket_path = tmp_path / "nri.sock"
    pod = api.PodSandbox(id="sb", uid="u1", name="p", namespace="ns")
    simulator = RuntimeSimulator(socket_path, pods=[pod])
    await simulator.start()
    await plugin(socket_path)
    first = await simulator.wait_ready()
    await simulator.stop()
    await simulator.wait_closed(first)

    await simulator.start()
    second = await simulator.wait_ready(count=2)
    assert second is not first
    assert simulator.live() == [second]
    # The new connection went through the whole handshake again, Synchronize included.
    assert len(second.sync_responses) == 1
    response = await simulator.send(second, Event.CREATE_CONTAINER, pod,
                                    api.Container(id="c", pod_sandbox_id="sb", name="c"))
    assert isinstance(response, api.CreateContainerResponse)
    await simulator.stop()


async def test_garbage_from_runtime_closes_and_plugin_reconnects(tmp_path: Path,
                                                                 plugin: Start) -> None:
    socket_path = tmp_path / "nri.sock"
    closed = asyncio.Event()

    async def garbage_runtime(reader: asyncio.StreamReader,
                              writer: asyncio.StreamWriter) -> None:
        writer.write(b"\x00\x00\x00\x01\xff\xff\xff\xffnot a frame")
        await writer.drain()
        await reader.read()  # until the plugin hangs up
        closed.set()
        writer.close()

    server = await asyncio.start_unix_server(garbage_runtime, path=str(socket_path))
    await plugin(socket_path)
    await closed.wait()
    server.close()
    await server.wait_closed()
    socket_path.unlink()

    simulator = RuntimeSimulator(socket_path)
    await simulator.start()
    connection = await simulator.wait_ready()
    assert connection.alive
    await simulator.stop()
