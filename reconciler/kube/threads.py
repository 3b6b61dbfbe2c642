"""Where the synchronous client's calls run: worker threads of the caller's own.

The watch and the writes both run their requests through an :class:`ApiThreads`, not the event
loop's default executor (``asyncio.to_thread``):

* a watch read blocks for up to a whole watch; a stop abandons it (after interrupting the
  stream) and returns without waiting for the abandoned thread, whereas ``asyncio.run`` waits
  for every thread of the default executor before it returns;
* under pressure the default executor also carries the host reads of the eviction manager and
  the mitigation ladder (pod facts, drop-cache candidates, watermarks): an API write queued
  behind them would act late, when it matters;
* the threads are named for what they do, so a thread dump (and a test) tells them apart.
"""

from __future__ import annotations

import asyncio
import contextvars
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

_T = TypeVar("_T")


class ApiThreads:
    """A named pool for blocking API calls; threads start on first use."""

    def __init__(self, name: str, workers: int) -> None:
        self._pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix=name)

    def run(self, fn: Callable[[], _T]) -> asyncio.Future[_T]:
        """Runs ``fn`` in the pool; the future resolves on the running loop. The caller's
        context variables (log context) go along, as with ``asyncio.to_thread``."""
        context = contextvars.copy_context()
        return asyncio.get_running_loop().run_in_executor(self._pool, context.run, fn)

    def submit(self, fn: Callable[[], object]) -> None:
        """Runs ``fn`` in the pool without waiting for it (releasing a stream's connection)."""
        self._pool.submit(fn)

    def close(self) -> None:
        """Takes no more work; a call still running ends on its own (interrupted, or at its
        request timeout) without anyone waiting for it."""
        self._pool.shutdown(wait=False)
