"""A PSI trigger armed on this machine's kernel whose pressure file goes away.

A child cgroup of the cgroup2 hierarchy (``/sys/fs/cgroup`` on a v2 host, the hybrid's unified
mount otherwise) has a ``memory.pressure`` of its own that takes triggers; removing the cgroup
kills the trigger (its descriptor reports EPOLLERR from then on). Skipped without root, a
writable cgroup2 mount or PSI, and when the kernel refuses a trigger with a 2 s window.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
from collections.abc import Iterator
from pathlib import Path

import pytest
from structlog.testing import capture_logs

from reconciler.host.pressure import QUIET_TRIGGER_RECHECK_S, PsiWatch
from reconciler.host.sysfs import SysFs
from tests.support.polling import BOUND_S, eventually

pytestmark = pytest.mark.real_kernel


def cgroup2_mount() -> Path | None:
    for line in Path("/proc/self/mounts").read_text().splitlines():
        fields = line.split()
        if len(fields) > 2 and fields[2] == "cgroup2":
            return Path(fields[1])
    return None


@pytest.fixture
def cgroup() -> Iterator[Path]:
    if os.geteuid() != 0:
        pytest.skip("needs root")
    mount = cgroup2_mount()
    if mount is None:
        pytest.skip("no cgroup2 mount")
    path = mount / f"nriqos-psi-{os.getpid()}"
    try:
        path.mkdir()
    except OSError as exc:
        pytest.skip(f"cannot make a cgroup under {mount}: {exc}")
    try:
        if not (path / "memory.pressure").exists():
            pytest.skip("no PSI on this kernel")
        yield path
    finally:
        with contextlib.suppress(FileNotFoundError):
            path.rmdir()


async def test_a_trigger_whose_file_goes_away_falls_back_to_polling(cgroup: Path) -> None:
    watch = PsiWatch(SysFs("/"), f"{cgroup}/memory.pressure", (150_000, 2_000_000))
    texts: list[str | None] = []
    paused = asyncio.Event()
    stop = asyncio.Event()
    with capture_logs() as logs:
        task = asyncio.create_task(watch.run(
            stop, interval=lambda: 0.02, idle=lambda: 0.05, active=lambda: True,
            keep_reading=lambda: False, on_trigger=lambda at: None,
            on_text=lambda text, at: texts.append(text), on_pause=paused.set))
        try:
            await eventually(paused.is_set)
            if watch.mode != "trigger":
                pytest.skip(f"the kernel refused the trigger: {logs}")
            assert texts == []  # armed, and nothing read while no trigger fired
            await asyncio.to_thread(cgroup.rmdir)
            await eventually(lambda: watch.mode == "poll")
            await eventually(lambda: len(texts) >= 2)  # polled from now on
            assert texts[-1] is None  # the file is gone, and each read says so
        finally:
            stop.set()
            await asyncio.wait_for(task, BOUND_S)
    assert [e["reason"] for e in logs if e["event"] == "psi_path"] == [
        "the trigger's file went away"]


async def test_a_quiet_armed_trigger_does_not_wake_every_idle_period(cgroup: Path) -> None:
    """The kernel wakes an armed trigger: a quiet one looks again only after
    QUIET_TRIGGER_RECHECK_S, however short ``idle()`` is (a wake-up a second for nothing)."""
    watch = PsiWatch(SysFs("/"), f"{cgroup}/memory.pressure", (150_000, 2_000_000))
    pauses: list[float] = []
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    task = asyncio.create_task(watch.run(
        stop, interval=lambda: 0.02, idle=lambda: 0.05, active=lambda: True,
        keep_reading=lambda: False, on_trigger=lambda at: None,
        on_text=lambda text, at: None, on_pause=lambda: pauses.append(loop.time())))
    try:
        await eventually(lambda: bool(pauses))
        if watch.mode != "trigger":
            pytest.skip("the kernel refused the trigger")
        await asyncio.sleep(0.5)  # ten idle periods
        assert len(pauses) == 1
        assert QUIET_TRIGGER_RECHECK_S == 10.0
    finally:
        stop.set()
        await asyncio.wait_for(task, BOUND_S)
