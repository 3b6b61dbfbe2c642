"""The state file on a slow disk: reading the notes never waits for another thread's write, writes
from several threads all end on disk, and a write the event loop handed to the writer is waited
for, a bounded time, when its caller is cancelled (the agent stops)."""

from __future__ import annotations

import asyncio
import os
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from reconciler.host import statefile
from reconciler.host.statefile import StateFile

BOUND_S = 5.0
LATE_S = 0.3
"""Far above a lock taken and a dict copied on a busy machine, far below a held write."""


class HeldDisk:
    """``os.fsync`` held until :attr:`release` is set; :attr:`entered` once a write waits."""

    def __init__(self) -> None:
        self._fsync = os.fsync
        self.entered = threading.Event()
        self.release = threading.Event()

    def __call__(self, fd: int) -> None:
        self.entered.set()
        self.release.wait(BOUND_S)
        self._fsync(fd)


def until(predicate: Callable[[], bool]) -> None:
    deadline = time.monotonic() + BOUND_S
    while not predicate():
        assert time.monotonic() < deadline
        time.sleep(0.01)


def held_write(tmp_path: Path, disk: HeldDisk) -> tuple[StateFile, threading.Thread]:
    """A state file in ``tmp_path`` and the thread whose write of guard's ``/a`` is now held at
    the disk."""
    notes = StateFile(str(tmp_path / "state.json"))
    writing = threading.Thread(target=notes.put, args=("guard", "/a", "1"))
    writing.start()
    assert disk.entered.wait(BOUND_S)
    return notes, writing


@pytest.fixture
def disk(monkeypatch: pytest.MonkeyPatch) -> Iterator[HeldDisk]:
    held = HeldDisk()
    monkeypatch.setattr(os, "fsync", held)  # what the state file calls
    yield held
    held.release.set()


@pytest.fixture
def writer() -> Iterator[ThreadPoolExecutor]:
    pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="nri-qos-state")
    yield pool
    pool.shutdown()


def test_reading_the_notes_does_not_wait_for_a_write_in_another_thread(
        tmp_path: Path, disk: HeldDisk) -> None:
    notes, writing = held_write(tmp_path, disk)
    threading.Timer(1.0, disk.release.set).start()  # what a slow disk would take
    start = time.monotonic()
    seen = notes.entries("guard")
    took = time.monotonic() - start
    writing.join(BOUND_S)
    assert took < LATE_S
    assert seen == {"/a": "1"}


def test_notes_written_meanwhile_by_other_threads_all_end_on_disk(
        tmp_path: Path, disk: HeldDisk) -> None:
    notes, first = held_write(tmp_path, disk)
    # Noted in memory while the first write waits for the disk; each waits for its own write.
    later = [threading.Thread(target=notes.put, args=("guard", f"/{n}", "2")) for n in "bcd"]
    for thread in later:
        thread.start()
    until(lambda: len(notes.entries("guard")) == 4)
    gone = threading.Thread(target=notes.forget, args=("guard", "/c"))
    gone.start()
    until(lambda: "/c" not in notes.entries("guard"))
    disk.release.set()
    for thread in [first, *later, gone]:
        thread.join(BOUND_S)
    assert StateFile(str(tmp_path / "state.json")).entries("guard") == {
        "/a": "1", "/b": "2", "/d": "2"}


async def test_a_cancelled_caller_waits_for_its_write_to_end(
        tmp_path: Path, disk: HeldDisk, writer: ThreadPoolExecutor) -> None:
    notes = StateFile(str(tmp_path / "state.json"), writer=writer)
    task = asyncio.create_task(notes.put_in_thread("taint", "key", "NoSchedule"))
    assert await asyncio.to_thread(disk.entered.wait, BOUND_S)
    task.cancel()
    await asyncio.sleep(0.05)
    assert not task.done()  # the write is still on the disk
    disk.release.set()
    with pytest.raises(asyncio.CancelledError):
        await asyncio.wait_for(task, BOUND_S)
    assert StateFile(str(tmp_path / "state.json")).entries("taint") == {"key": "NoSchedule"}


async def test_a_cancelled_caller_waits_for_a_hung_write_a_bounded_time(
        tmp_path: Path, disk: HeldDisk, writer: ThreadPoolExecutor,
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(statefile, "STOP_WAIT_S", 0.2)
    notes = StateFile(str(tmp_path / "state.json"), writer=writer)
    task = asyncio.create_task(notes.put_in_thread("taint", "key", "NoSchedule"))
    assert await asyncio.to_thread(disk.entered.wait, BOUND_S)
    start = time.monotonic()
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await asyncio.wait_for(task, BOUND_S)
    assert time.monotonic() - start < 1.0
