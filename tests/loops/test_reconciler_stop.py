"""The reconciler's way out: each loop is closed after its last cycle, however it stops."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable
from typing import Any, cast

import pytest
from structlog.testing import capture_logs

from common.state import NodeState
from nri_plugin.config.schema import Config
from reconciler.kube import PodWatcher
from reconciler.loops.base import Loop
from reconciler.runner import CLOSE_WAIT_S, run_reconciler
from tests.support.gated_loop import GatedLoop

GUARD_S = 10.0
"""A bound against hanging, not a timing assertion."""


class BrokenWatch:
    """A pod watch that fails once ``started`` is set."""

    def __init__(self, started: threading.Event) -> None:
        self._started = started

    async def run(self, apply: Callable[[Any], None], stop: asyncio.Event) -> None:
        assert await asyncio.to_thread(self._started.wait, GUARD_S)
        raise RuntimeError("the pod watch broke")


def reconcile(loops: list[Loop], watcher: BrokenWatch | None = None,
              close_wait_s: float = CLOSE_WAIT_S) -> asyncio.Task[None]:
    return asyncio.create_task(run_reconciler(
        loops, NodeState(), asyncio.Event(), cast(PodWatcher | None, watcher),
        read_keys=Config().read_keys, backoff_max=lambda: 60.0, close_wait_s=close_wait_s))


async def still_running(task: asyncio.Task[None]) -> bool:
    """Whether ``task`` goes on past a moment given to it to end."""
    await asyncio.wait({task}, timeout=0.2)
    return not task.done()


async def test_a_cancelled_reconciler_closes_a_loop_only_after_its_cycle_returned() -> None:
    events: list[str] = []
    loop = GatedLoop("guard", events)
    task = reconcile([loop])
    assert await asyncio.to_thread(loop.started.wait, GUARD_S)
    task.cancel()
    # The cycle still runs in its thread: the restore must not come before its write.
    assert await still_running(task)
    assert events == ["guard cycle started"]
    loop.go_on.set()
    with pytest.raises(asyncio.CancelledError):
        await asyncio.wait_for(task, GUARD_S)
    assert events == ["guard cycle started", "guard wrote", "guard closed"]


async def test_a_failing_pod_watch_closes_the_loops_after_their_cycles() -> None:
    events: list[str] = []
    loop = GatedLoop("guard", events)
    task = reconcile([loop], BrokenWatch(loop.started))
    assert await still_running(task)
    assert events == ["guard cycle started"]
    loop.go_on.set()
    with pytest.raises(ExceptionGroup) as raised:
        await asyncio.wait_for(task, GUARD_S)
    assert [str(e) for e in raised.value.exceptions] == ["the pod watch broke"]
    assert events == ["guard cycle started", "guard wrote", "guard closed"]


async def test_a_cycle_outlasting_the_wait_has_its_loop_closed_when_it_returns() -> None:
    events: list[str] = []
    slow = GatedLoop("guard", events)
    idle = GatedLoop("idle", events, blocks=False)
    task = reconcile([slow, idle], close_wait_s=0.05)
    assert await asyncio.to_thread(slow.started.wait, GUARD_S)
    assert await asyncio.to_thread(idle.started.wait, GUARD_S)
    with capture_logs() as logs:
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await asyncio.wait_for(task, GUARD_S)
    # The reconciler is gone; the loop whose cycle ran on is not closed yet, the other is.
    assert sorted(events) == ["guard cycle started", "idle closed", "idle cycle started"]
    [deferred] = [e for e in logs if e["event"] == "reconciler_loop_close_deferred"]
    assert deferred["loop"] == "guard"
    slow.go_on.set()
    assert await asyncio.to_thread(slow.closed.wait, GUARD_S)
    assert events[-2:] == ["guard wrote", "guard closed"]


async def test_a_second_cancel_ends_the_wait_and_is_raised_after_the_closes() -> None:
    events: list[str] = []
    slow = GatedLoop("guard", events)
    idle = GatedLoop("idle", events, blocks=False)
    task = reconcile([slow, idle])
    assert await asyncio.to_thread(slow.started.wait, GUARD_S)
    assert await asyncio.to_thread(idle.started.wait, GUARD_S)
    task.cancel()
    assert await still_running(task)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await asyncio.wait_for(task, GUARD_S)
    assert sorted(events) == ["guard cycle started", "idle closed", "idle cycle started"]
    slow.go_on.set()
    assert await asyncio.to_thread(slow.closed.wait, GUARD_S)
    assert events[-2:] == ["guard wrote", "guard closed"]
