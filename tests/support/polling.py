"""Waiting for a condition that another thread (a loop's worker, the kernel) makes true."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

BOUND_S = 5.0
"""Upper bound for anything to happen; a test only waits that long when something is broken."""


async def eventually(predicate: Callable[[], bool], timeout_s: float = BOUND_S,
                     every_s: float = 0.01) -> None:
    """Return once ``predicate()`` holds; TimeoutError after ``timeout_s``."""
    async with asyncio.timeout(timeout_s):
        # Polling: what is waited for is a file or a reading another thread produces.
        while not predicate():  # noqa: ASYNC110
            await asyncio.sleep(every_s)
