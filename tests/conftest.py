"""Guards every test runs under: no task may outlive its test."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest


@pytest.fixture(autouse=True)
async def no_task_left_behind() -> AsyncIterator[None]:
    """Fail a test that leaves tasks running in its event loop: every task must belong to a
    task group, or be awaited, before the test ends."""
    yield
    current = asyncio.current_task()
    # One turn of the loop lets tasks that were just cancelled or finished settle.
    await asyncio.sleep(0)
    left = [task for task in asyncio.all_tasks() if task is not current and not task.done()]
    if not left:
        return
    names = ", ".join(sorted(repr(task.get_coro()) for task in left))
    for task in left:
        task.cancel()
    await asyncio.gather(*left, return_exceptions=True)
    pytest.fail(f"the test left {len(left)} task(s) running: {names}")
