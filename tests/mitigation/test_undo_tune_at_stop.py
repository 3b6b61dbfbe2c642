"""The agent stops while the tune rung is engaged: the reclaimed pods get their
``memory.wmark_ratio`` back with the ladder's end, as the tier gets back what the squeeze took
(the memory guard's close): nobody watches the pressure that lowered it any more."""

from __future__ import annotations

import asyncio
from pathlib import Path

from reconciler.detection.signals import NODE, Level, Reading
from reconciler.host.statefile import state_file
from reconciler.mitigation.actions import WMARK_NOTES
from tests.support.polling import eventually
from tests.support.tuned_host import tuned_host


async def test_a_stop_while_tuned_gives_the_reclaimed_pods_their_wmark_ratio_back(
        tmp_path: Path) -> None:
    tuned = tuned_host(tmp_path)
    stop = asyncio.Event()
    task = asyncio.create_task(tuned.mitigation.run(stop))
    try:
        tuned.board.publish("psi", [Reading("psi", NODE, Level.LOW, 20.0, 10.0, "percent", "x")])
        await eventually(lambda: tuned.wmark.read_text() == "80")
        assert "tune" in tuned.mitigation.state().engaged
    finally:
        stop.set()
        await asyncio.wait_for(task, 10.0)
    assert tuned.wmark.read_text() == "95"
    assert state_file(tuned.state_path).entries(WMARK_NOTES) == {}
