"""Running the capabilities of one event, in order, inline or in a worker thread under a deadline.

:func:`run_inline` calls every capability right here (they only compute, see
:class:`~nri_plugin.session.capability.Capability`); :func:`run_threaded` runs them in a worker
thread and collects, at the deadline, what finished: a capability stuck in the kernel cannot
make the answer late, it only goes without its part.
"""

from __future__ import annotations

import asyncio
import contextvars
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import Executor
from dataclasses import dataclass

from hooks.settings import ContainerSettings

Call = tuple[str, Callable[[], object]]
"""(capability name, bound capability method)."""


@dataclass(frozen=True, slots=True)
class ChainOutcome:
    """What a run of the capabilities produced by the time it was collected."""

    # (capability name, settings) of the capabilities that finished, in chain order
    parts: tuple[tuple[str, ContainerSettings], ...] = ()
    # (capability name, error text) of the capabilities that raised
    failures: tuple[tuple[str, str], ...] = ()
    # capabilities still running or not started when the deadline passed
    unfinished: tuple[str, ...] = ()
    deadline_ms: float = 0.0

    @property
    def complete(self) -> bool:
        return not self.failures and not self.unfinished

    def problems(self) -> list[str]:
        found = [f"capability {name} failed: {error}" for name, error in self.failures]
        if self.unfinished:
            found.append(
                f"deadline of {self.deadline_ms:g} ms passed before capabilities finished: "
                + ", ".join(self.unfinished)
            )
        return found


def bind(function: Callable[..., object], *args: object) -> Callable[[], object]:
    return lambda: function(*args)


class _Run:
    """One run of calls; what finished can be collected at any time (from another thread)."""

    def __init__(self, calls: Sequence[Call]) -> None:
        self._calls = calls
        self._lock = threading.Lock()
        self._abandoned = False
        self._parts: list[tuple[str, ContainerSettings]] = []
        self._failures: list[tuple[str, str]] = []
        self._done = 0

    def __call__(self) -> None:
        for name, call in self._calls:
            with self._lock:
                if self._abandoned:
                    return
            part, failure = _call(call)
            with self._lock:
                if part is not None:
                    self._parts.append((name, part))
                if failure is not None:
                    self._failures.append((name, failure))
                self._done += 1

    def collect(self, deadline_ms: float) -> ChainOutcome:
        """Stop the run after the current call and return what finished before now."""
        with self._lock:
            self._abandoned = True
            return ChainOutcome(
                parts=tuple(self._parts),
                failures=tuple(self._failures),
                unfinished=tuple(name for name, _ in self._calls[self._done:]),
                deadline_ms=deadline_ms,
            )


def run_inline(calls: Sequence[Call]) -> ChainOutcome:
    """Every call, here and now: each only computes, so there is nothing a deadline could cut.

    No other thread sees this run, so it goes without :class:`_Run`'s lock: this is the path of
    every CreateContainer."""
    parts: list[tuple[str, ContainerSettings]] = []
    failures: list[tuple[str, str]] = []
    for name, call in calls:
        part, failure = _call(call)
        if part is not None:
            parts.append((name, part))
        if failure is not None:
            failures.append((name, failure))
    return ChainOutcome(parts=tuple(parts), failures=tuple(failures), unfinished=(),
                        deadline_ms=0.0)


async def run_threaded(calls: Sequence[Call], executor: Executor,
                       deadline_ms: float) -> ChainOutcome:
    """The calls in a worker thread; what finished within ``deadline_ms``."""
    run = _Run(calls)
    # The worker runs in a copy of this event's context, so capabilities log with its fields.
    context = contextvars.copy_context()
    future = asyncio.get_running_loop().run_in_executor(executor, context.run, run)
    try:
        await asyncio.wait({future}, timeout=deadline_ms / 1000)
    finally:
        outcome = run.collect(deadline_ms)
    return outcome


def _call(call: Callable[[], object]) -> tuple[ContainerSettings | None, str | None]:
    """(settings, None) or (None, None) when the call returned, (None, error text) if it raised."""
    try:
        result = call()
    except (Exception, asyncio.CancelledError) as exc:
        # A CancelledError raised by a capability's own code is the capability failing, not
        # this event being cancelled (that would come at an await, and a call has none).
        return None, f"{type(exc).__name__}: {exc}"
    return (result if isinstance(result, ContainerSettings) else None), None
