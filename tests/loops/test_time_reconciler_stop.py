"""A stop (SIGTERM's way out, not a cancellation) while a loop's cycle is blocked in the kernel:
the reconciler ends within its close wait, the other loops are closed meanwhile, and the blocked
loop is closed by its own thread once its cycle returns."""

from __future__ import annotations

import asyncio

from structlog.testing import capture_logs

from common.state import NodeState
from nri_plugin.config.schema import Config
from reconciler.runner import run_reconciler
from tests.support.gated_loop import GatedLoop

GUARD_S = 10.0
"""A bound against hanging, not a timing assertion."""


async def test_a_stop_does_not_wait_past_the_close_wait_for_a_blocked_cycle() -> None:
    events: list[str] = []
    stuck = GatedLoop("guard", events, wait_s=3 * GUARD_S)
    idle = GatedLoop("idle", events, blocks=False)
    stop = asyncio.Event()
    task = asyncio.create_task(run_reconciler(
        [stuck, idle], NodeState(), stop, None, read_keys=Config().read_keys,
        backoff_max=lambda: 60.0, close_wait_s=0.05))
    try:
        assert await asyncio.to_thread(stuck.started.wait, GUARD_S)
        assert await asyncio.to_thread(idle.started.wait, GUARD_S)
        with capture_logs() as logs:
            stop.set()
            await asyncio.wait_for(task, GUARD_S)
        # The idle loop's restore did not wait for the other loop's write.
        assert sorted(events) == ["guard cycle started", "idle closed", "idle cycle started"]
        assert [e["loop"] for e in logs if e["event"] == "reconciler_loop_close_deferred"] \
            == ["guard"]
    finally:
        stuck.go_on.set()
    assert await asyncio.to_thread(stuck.closed.wait, GUARD_S)
    assert events[-2:] == ["guard wrote", "guard closed"]
