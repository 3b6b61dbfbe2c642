"""Running one loop: period, interruptible sleep, wake-ups, and backoff on failure.

A loop is an object with a synchronous :meth:`Loop.cycle`. The runner calls it in a worker thread
of its own (a cgroup write can block in the kernel, e.g. a memory limit that forces reclaim, and
must not hold up the event loop that serves NRI), then sleeps until the next period, the stop
event, or the loop's wake event, whichever comes first (a woken cycle still keeps a short gap
after the previous one, :meth:`Loop.wake_gap`). A cycle that raises is logged and retried after
an exponentially growing delay (capped), without affecting the other loops. Time comes from the
event loop's clock, never from the wall clock.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Mapping
from concurrent.futures import Executor
from dataclasses import dataclass
from types import MappingProxyType

import structlog

from common.aio import Backoff, done_or_stopped, sleep_until
from hooks.config_fields import setting
from hooks.events import Event
from hooks.untrusted import bounded
from reconciler.metrics import ReconcilerMetrics

log = structlog.get_logger("nri_qos.reconciler")


@dataclass(frozen=True, slots=True)
class ReconcilerConfig:
    enabled: bool = setting(True, "Run the background reconciler next to the NRI stub.")
    root: str = setting(
        "/", "Directory under which /sys and /proc are found (for running in a container)."
    )
    cgroup_driver: str = setting(
        "auto", "cgroup driver of kubelet/containerd; auto: systemd where kubelet made "
        "kubepods.slice, cgroupfs where kubepods (before either, the reconciler waits).",
        choices=("auto", "cgroupfs", "systemd"),
    )
    resctrl_interval_s: float = setting(
        1.0, "Period of the resctrl task-id loop.", unit="seconds", minimum=0.05, maximum=3600
    )
    drift_interval_s: float = setting(
        10.0, "Period of the drift-repair loop.", unit="seconds", minimum=0.1, maximum=3600
    )
    gc_grace_s: float = setting(
        60.0, "Age a resctrl pod group of a vanished pod, or of one the configuration gives no "
        "group of its own, must reach before the task-id loop removes it.",
        unit="seconds", minimum=0, maximum=86_400,
    )
    write_retries: int = setting(
        3, "Attempts for a write that fails with EBUSY/EINVAL before it is audited as failed.",
        minimum=1, maximum=20,
    )
    full_scan_every: int = setting(
        10, "The task-id loop reads every managed container's thread list once per this many "
        "cycles; in between it examines only tasks that newly appeared outside their group.",
        minimum=1, maximum=3600,
    )
    backoff_max_s: float = setting(
        60.0, "Cap of the backoff of a loop that keeps failing.", unit="seconds",
        minimum=0.1, maximum=3600,
    )
    state_dir: str = setting(
        "/var/lib/nri-qos/state", "Directory of the agent's state file: what it changed on "
        "the node and must restore (the memory guard's cap, tuned memory.wmark_ratio, its "
        "taint), kept across restarts for the next run and for nri-qos reset; empty: kept in "
        "memory only. Read at start.")



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

    def subscribe_wake(self, wake: Callable[[], None]) -> Callable[[], None]:
        """Call ``wake`` (from any thread) when something of the loop's own, beyond the node
        state, wants a cycle now; returns the function that ends the subscription."""
        return lambda: None

    def close(self) -> None:
        """The reconciler stops: undo what must not outlive the agent (after the last
        cycle)."""


@dataclass(frozen=True, slots=True)
class CycleRecord:
    """A loop's last cycle and its totals."""

    started: float  # the event loop's time
    duration_s: float
    failed: bool
    error: str  # of the last failed cycle
    cycles: int
    failures: int


class LoopTracker:
    """Every loop's last cycle (for ``nri-qos status``), and the cycle metrics.

    Used from the event loop only (where :func:`run_loop` runs).
    """

    def __init__(self, metrics: ReconcilerMetrics | None = None) -> None:
        self._metrics = metrics
        self._last: dict[str, CycleRecord] = {}

    def cycle_done(self, loop: str, started: float, duration_s: float,
                   error: BaseException | None) -> None:
        previous = self._last.get(loop)
        failed = error is not None
        self._last[loop] = CycleRecord(
            started, duration_s, failed,
            error=bounded(repr(error), 512) if failed else (previous.error if previous else ""),
            cycles=(previous.cycles if previous else 0) + 1,
            failures=(previous.failures if previous else 0) + failed)
        if self._metrics is not None:
            self._metrics.loop_cycle(loop, duration_s, failed=failed)

    def last(self) -> Mapping[str, CycleRecord]:
        return MappingProxyType(dict(self._last))


async def run_loop(
    loop: Loop,
    *,
    stop: asyncio.Event,
    wake: asyncio.Event,
    backoff_max: Callable[[], float],
    executor: Executor | None = None,
    tracker: LoopTracker | None = None,
) -> None:
    """Run ``loop`` until ``stop`` is set; time comes from the event loop's clock."""
    running = asyncio.get_running_loop()
    backoff: Backoff | None = None
    while not stop.is_set():
        wake.clear()
        started = running.time()
        cycle = running.run_in_executor(executor, loop.cycle, started)
        # A cycle blocked in the kernel (a write to a memory limit in reclaim) must not hold up
        # a stop: the thread runs on, and whoever owns it waits for it, bounded, before the
        # loop's close (reconciler.runner).
        try:
            finished = await done_or_stopped(cycle, stop)
        finally:
            # Never awaited once given up: its outcome must not reach the event loop later.
            if not cycle.done():
                cycle.cancel()
        if not finished:
            return
        try:
            cycle.result()
        except Exception as exc:  # one loop's failure must not stop the others
            if tracker is not None:
                tracker.cycle_done(loop.name, started, running.time() - started, exc)
            if backoff is None:
                # interval x 2, x 4 ... after each failure, never below the period itself.
                backoff = Backoff(loop.interval() * 2, max(backoff_max(), loop.interval()))
            delay = backoff.next()
            log.warning("reconciler_loop_failed", loop=loop.name, failures=backoff.failures,
                        retry_in_s=round(delay, 3), error=repr(exc), exc_info=True)
            # While backing off, NRI events must not turn the backoff into a busy retry.
            await sleep_until(delay, stop)
            continue
        if tracker is not None:
            tracker.cycle_done(loop.name, started, running.time() - started, None)
        if backoff is not None:
            log.info("reconciler_loop_recovered", loop=loop.name, after_failures=backoff.failures)
            backoff = None
        await sleep_until(loop.interval(), stop, wake)
        early = started + loop.wake_gap() - running.time()
        if wake.is_set() and early > 0:
            await sleep_until(early, stop)
