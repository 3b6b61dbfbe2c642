"""Limits and helpers shared by the hostile-runtime tests."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

from nri_plugin.cli import daemon
from tests.support.raw_runtime import MiB, RawRuntime, Session

Start = Callable[..., Awaitable[Session]]


def named(lines: list[dict[str, Any]], event: str) -> list[dict[str, Any]]:
    return [line for line in lines if line.get("event") == event]


@asynccontextmanager
async def daemon_connecting(directory: Path, config_text: str,
                            level: str) -> AsyncIterator[asyncio.Queue[RawRuntime]]:
    """The daemon (in this process) connecting to a socket the test listens on; the
    connections it makes, as they come."""
    socket_path = directory / "nri.sock"
    config_path = directory / "config.toml"
    config_path.write_text(config_text)
    connections: asyncio.Queue[RawRuntime] = asyncio.Queue()
    seen: list[RawRuntime] = []

    async def accepted(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        seen.append(RawRuntime(reader, writer))
        await connections.put(seen[-1])

    server = await asyncio.start_unix_server(accepted, path=str(socket_path), limit=8 * MiB)
    stop = asyncio.Event()
    agent = asyncio.create_task(daemon.serve(str(config_path), str(socket_path), level,
                                             stop=stop, prelaunched=None))
    try:
        yield connections
    finally:
        stop.set()
        assert await agent == 0
        server.close()
        await server.wait_closed()
        for runtime in seen:
            runtime.close()
