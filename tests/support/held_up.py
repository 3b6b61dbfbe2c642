"""Stopping a service while the API server holds up its reads of the node, within a bound well
below the client's request timeouts."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Coroutine
from typing import Any

from tests.support.fake_apiserver import FakeApiServer
from tests.support.polling import eventually


async def stop_while_node_reads_are_held_up(
        service: Callable[[asyncio.Event], Coroutine[Any, Any, object]], fake: FakeApiServer,
        node: str, *, hold_s: float, stop_s: float) -> None:
    """Starts ``service`` with the node's reads held ``hold_s`` each, stops it once it has asked
    for the node, and fails unless it ends within ``stop_s``."""
    fake.delay_next("GET", f"/api/v1/nodes/{node}", hold_s, count=20)
    stop = asyncio.Event()
    task = asyncio.create_task(service(stop))
    try:
        await eventually(lambda: bool(fake.requests("GET", f"/api/v1/nodes/{node}")))
        stop.set()
        await asyncio.wait_for(asyncio.shield(task), stop_s)
    finally:
        stop.set()
        if not task.done():
            task.cancel()
        await asyncio.wait({task})
