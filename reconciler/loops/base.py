"""Running one loop: period, interruptible sleep, wake-ups, and backoff on failure.

A loop is an object with a synchronous :meth:`Loop.cycle`. The runner calls it in a worker thread
of its own (a cgroup write can block in the kernel, e.g. a memory limit that forces reclaim, and
must not hold up the event loop that serves NRI), then sleeps until the next period, the stop
event, or the loop's wake event, whichever comes first (a woken cycle still keeps a short gap
after the previous one, :meth:`Loop.wake_gap`). A cycle that raises is logged and retried after
an exponentially growing delay (capped), without affecting the other loops. Time comes from the
``clock`` passed in (the event loop's ``time()`` by default), never from the wall clock.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable
from concurrent.futures import Executor

import structlog

from nri_plugin.events import Event

log = structlog.get_logger("nri_qos.reconciler")


class Loop:
    """Base class of a reconciler loop."""

    name = "loop"
    # NRI events after which the loop should run at once instead of at its next period.
    wake_events: frozenset[Event] = frozenset()
    # Whether a pod-watch change (annotations, requests) wakes the loop.
    wake_on_meta = False

    def interval(self) -> float:
        """Seconds between two cycles (read each time, so a config reload takes effect)."""
        raise NotImplementedError

    def wake_gap(self) -> float:
        """Least time between the starts of two cycles when woken early: under heavy container
        churn wake-ups would otherwise run the loop back to back."""
        return min(self.interval() / 10, 1.0)

    def cycle(self, now: float) -> None:
        """One pass; ``now`` is the runner's clock."""
        raise NotImplementedError


def backoff_delay(interval: float, failures: int, cap: float) -> float:
    """Delay after ``failures`` consecutive failed cycles: interval x 2^failures, capped."""
    if failures <= 0:
        return interval
    return min(interval * float(1 << min(failures, 30)), max(cap, interval))


async def sleep_until(stop: asyncio.Event, wake: asyncio.Event, delay: float) -> None:
    """Sleep ``delay`` seconds or until ``stop`` or ``wake`` is set."""
    if stop.is_set() or wake.is_set():
        return
    waiters = {asyncio.ensure_future(stop.wait()), asyncio.ensure_future(wake.wait())}
    try:
        await asyncio.wait(waiters, timeout=delay, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for waiter in waiters:
            waiter.cancel()
        for waiter in waiters:
            with contextlib.suppress(asyncio.CancelledError):
                await waiter


async def run_loop(
    loop: Loop,
    *,
    stop: asyncio.Event,
    wake: asyncio.Event,
    backoff_max: Callable[[], float],
    executor: Executor | None = None,
    clock: Callable[[], float] | None = None,
) -> None:
    """Run ``loop`` until ``stop`` is set."""
    running = asyncio.get_running_loop()
    now = clock or running.time
    failures = 0
    # While backing off, NRI events must not turn the backoff into a busy retry.
    never = asyncio.Event()
    while not stop.is_set():
        wake.clear()
        started = now()
        try:
            await running.run_in_executor(executor, loop.cycle, started)
        except Exception as exc:  # one loop's failure must not stop the others
            failures += 1
            delay = backoff_delay(loop.interval(), failures, backoff_max())
            log.warning("reconciler_loop_failed", loop=loop.name, failures=failures,
                        retry_in_s=round(delay, 3), error=repr(exc), exc_info=True)
        else:
            if failures:
                log.info("reconciler_loop_recovered", loop=loop.name, after_failures=failures)
            failures = 0
            delay = loop.interval()
        await sleep_until(stop, never if failures else wake, delay)
        early = started + loop.wake_gap() - now()
        if wake.is_set() and early > 0:
            await sleep_until(stop, never, early)
