"""Helpers shared by the tests of the kubernetes client."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any

from common.podmeta import PodMeta
from reconciler.kube import KubernetesConfig, PodWatcher

# Upper bound for anything to arrive; tests never wait that long unless something is broken.
BOUND_S = 10.0


@dataclass
class Watching:
    queue: asyncio.Queue[PodMeta]
    stop: asyncio.Event
    task: asyncio.Task[None]

    async def next(self) -> PodMeta:
        return await asyncio.wait_for(self.queue.get(), BOUND_S)

    async def take(self, count: int) -> list[PodMeta]:
        return [await self.next() for _ in range(count)]


@asynccontextmanager
async def watching(
    api: Any, cfg: KubernetesConfig, node: str = "node-a"
) -> AsyncIterator[Watching]:
    queue: asyncio.Queue[PodMeta] = asyncio.Queue()
    stop = asyncio.Event()
    watcher = PodWatcher(api, cfg, node, initial_backoff_s=0.01)
    task = asyncio.create_task(watcher.run(queue.put_nowait, stop))
    try:
        yield Watching(queue, stop, task)
    finally:
        stop.set()
        await asyncio.wait_for(task, BOUND_S)
