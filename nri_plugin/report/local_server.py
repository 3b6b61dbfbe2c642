"""What the agent's two small servers (the metrics endpoint, the status socket) share: every
client answered in a task of its own, all of them cancelled when the server stops, so a client
that never reads cannot keep the agent from stopping."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

CLOSE_TIMEOUT_S = 5.0
"""Time an answer's unsent end has to reach a client once its handler is done: closing waits
for it, and a client that stopped reading would hold its connection (and a server's slot) for
good."""


class Clients:
    """The clients a server is answering."""

    def __init__(self) -> None:
        self._tasks: set[asyncio.Task[None]] = set()

    @contextlib.asynccontextmanager
    async def answering(self, writer: asyncio.StreamWriter) -> AsyncIterator[None]:
        """Around one client's handler: known to :meth:`serve_until`; its connection closed
        at the end, whatever happened: what is left of the answer after
        :data:`CLOSE_TIMEOUT_S` is dropped. A handler cancelled because the server stops ends
        normally: asyncio's stream server (3.11) logs a traceback for a handler task that ends
        cancelled."""
        task = asyncio.current_task()
        assert task is not None
        self._tasks.add(task)
        linger_s = CLOSE_TIMEOUT_S
        try:
            yield
        except asyncio.CancelledError:
            linger_s = 0.0  # the server stops: no client holds it up
        finally:
            writer.close()
            try:
                async with asyncio.timeout(linger_s):
                    await writer.wait_closed()
            except (ConnectionError, TimeoutError, asyncio.CancelledError):
                # Not read in time, or the server stops: the socket goes now, unsent data too.
                writer.transport.abort()
            finally:
                self._tasks.discard(task)

    async def serve_until(self, server: asyncio.Server, stop: asyncio.Event) -> None:
        """Serve until ``stop`` is set; then no new client, and the ones being answered are
        cancelled."""
        try:
            await stop.wait()
        finally:
            server.close()
            for task in list(self._tasks):
                task.cancel()
            await asyncio.gather(*self._tasks, return_exceptions=True)
            await server.wait_closed()
