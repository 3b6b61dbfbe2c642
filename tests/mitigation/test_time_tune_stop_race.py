"""The agent stops while the tune rung is lowering ``memory.wmark_ratio`` and the state file's
fsync is slow (the heavy writeback of the memory pressure that engaged the rung): the pod's
value noted but not written yet when the ladder ends must not be written after the ladder's end
restored it. Either it is restored, or its note stays for the next start."""

from __future__ import annotations

import asyncio
import os
import threading
import time
from pathlib import Path

import pytest

from reconciler.detection.signals import NODE, Level, Reading
from reconciler.host.statefile import state_file
from reconciler.mitigation.actions import WMARK_NOTES
from tests.support.polling import eventually
from tests.support.tuned_host import tuned_host

SLOW_S = 1.0
"""One fsync of the state file, as under heavy writeback."""


class SlowDisk:
    """``os.fsync`` taking :data:`SLOW_S` off the event loop's thread; ``busy`` while one runs
    there."""

    def __init__(self) -> None:
        self._fsync = os.fsync
        self._loop_thread = threading.current_thread()
        self.started = threading.Event()
        self.busy = 0

    def __call__(self, fd: int) -> None:
        if threading.current_thread() is self._loop_thread:
            self._fsync(fd)
            return
        self.busy += 1
        self.started.set()
        try:
            time.sleep(SLOW_S)
            self._fsync(fd)
        finally:
            self.busy -= 1


@pytest.fixture
def slow_disk(monkeypatch: pytest.MonkeyPatch) -> SlowDisk:
    disk = SlowDisk()
    monkeypatch.setattr(os, "fsync", disk)
    return disk


async def test_a_stop_while_the_tune_notes_its_first_write_leaves_no_unnoted_ratio(
        tmp_path: Path, slow_disk: SlowDisk) -> None:
    tuned = tuned_host(tmp_path)
    stop = asyncio.Event()
    task = asyncio.create_task(tuned.mitigation.run(stop))
    try:
        tuned.board.publish("psi", [Reading("psi", NODE, Level.LOW, 20.0, 10.0, "percent", "x")])
        # The tune's thread has noted the pod's value and waits for the disk.
        assert await asyncio.to_thread(slow_disk.started.wait, 10.0)
    finally:
        stop.set()
        await asyncio.wait_for(task, 10.0)
    await eventually(lambda: slow_disk.busy == 0, 10.0)
    await asyncio.sleep(0.2)  # the tune's write, if any, right after its note
    noted = state_file(tuned.state_path).entries(WMARK_NOTES)
    assert tuned.wmark.read_text().strip() == "95" or noted, "lowered with nothing to restore it"
