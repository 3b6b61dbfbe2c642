"""The concurrency toolkit every long-running part uses: one stop-aware sleep, one backoff, one
list of change callbacks, one thread-safe way to set an event.

Waits never leave tasks behind: :func:`sleep_until` waits on one event in the caller's task, and
on several in a task group of its own, which is gone when it returns (whether the time ran out,
an event was set, or the caller was cancelled).
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

_T = TypeVar("_T")


class Callbacks:
    """Who wants to hear of a change; subscribed to and called from any thread. Callbacks run
    in the caller's thread, outside the lock, so one may subscribe or unsubscribe another."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._callbacks: list[Callable[[], None]] = []

    def subscribe(self, callback: Callable[[], None]) -> Callable[[], None]:
        """Add ``callback``; the function returned removes it (more than once is harmless)."""
        with self._lock:
            self._callbacks.append(callback)

        def unsubscribe() -> None:
            with self._lock:
                if callback in self._callbacks:
                    self._callbacks.remove(callback)

        return unsubscribe

    def call(self) -> None:
        with self._lock:
            callbacks = list(self._callbacks)
        for callback in callbacks:
            callback()


async def sleep_until(seconds: float, *events: asyncio.Event) -> bool:
    """Sleep ``seconds``, cut short as soon as any of ``events`` is set; True when one was."""
    if any(event.is_set() for event in events):
        return True
    if seconds <= 0:
        return False
    if not events:
        await asyncio.sleep(seconds)
        return False
    if len(events) == 1:
        # Most sleeps wait on the stop event alone, some ten times a second (the node's PSI
        # polled under pressure): awaited in this task under a timeout, with no task group and
        # no waiter task, a wake costs a fifth less CPU (bench/wakeups.py).
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(seconds):
                await events[0].wait()
        return events[0].is_set()
    async with asyncio.TaskGroup() as group:
        waiters = [group.create_task(event.wait()) for event in events]
        try:
            await asyncio.wait(waiters, timeout=seconds, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for waiter in waiters:
                waiter.cancel()
    return any(event.is_set() for event in events)


def waker(running: asyncio.AbstractEventLoop, event: asyncio.Event) -> Callable[[], None]:
    """A callback, safe from any thread, that sets ``event`` in the event loop ``running``."""
    def set_event() -> None:
        with contextlib.suppress(RuntimeError):  # the event loop is already closed
            running.call_soon_threadsafe(event.set)

    return set_event


async def wait_for_event(event: asyncio.Event, seconds: float) -> bool:
    """Wait up to ``seconds`` for ``event``; True when it was set."""
    with contextlib.suppress(TimeoutError):
        async with asyncio.timeout(seconds):
            await event.wait()
    return event.is_set()


async def done_or_stopped(future: asyncio.Future[Any], stop: asyncio.Event) -> bool:
    """Wait until ``future`` is done or ``stop`` is set; True when the future is done."""
    if not stop.is_set() and not future.done():
        async with asyncio.TaskGroup() as group:
            stopper = group.create_task(stop.wait())
            try:
                await asyncio.wait({future, stopper}, return_when=asyncio.FIRST_COMPLETED)
            finally:
                stopper.cancel()
    return future.done()


async def unless_stopped(work: Awaitable[_T], stop: asyncio.Event,
                         grace_s: float = 0.0) -> _T | None:
    """``work``'s result; None when it is not done ``grace_s`` after ``stop`` is set, ``work``
    then cancelled and waited for (nothing of it runs on the event loop after the caller)."""
    task = asyncio.ensure_future(work)
    try:
        if not await done_or_stopped(task, stop) and grace_s > 0:
            await asyncio.wait({task}, timeout=grace_s)
        if task.done():
            return task.result()
    finally:
        if not task.done():
            task.cancel()
            await asyncio.wait({task})
    return None


class Backoff:
    """Capped exponential delays: ``initial``, 2 x ``initial``, ... up to ``maximum`` (seconds)."""

    def __init__(self, initial: float, maximum: float) -> None:
        if initial <= 0 or maximum <= 0:
            raise ValueError("backoff delays must be positive")
        self._initial = min(initial, maximum)
        self._maximum = maximum
        self._next = self._initial
        self.failures = 0

    def next(self) -> float:
        """The delay after one more failure."""
        delay = self._next
        self._next = min(self._next * 2, self._maximum)
        self.failures += 1
        return delay

    def reset(self) -> None:
        self._next = self._initial
        self.failures = 0
