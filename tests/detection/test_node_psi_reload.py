"""Settings the kernel takes when a watch is registered follow a reload: the node's PSI trigger
its window and threshold (as the online pods' triggers do), cgroup v1's memcg pressure events
their mode; a reload of anything else leaves them registered."""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Callable, MutableMapping
from pathlib import Path
from typing import Any

import pytest
from structlog.testing import capture_logs

from common.aio import sleep_until
from reconciler.detection import notified
from reconciler.detection.notified import NodePsi
from tests.support.detection_env import Setup
from tests.support.polling import BOUND_S, eventually


class Watches:
    """Stands in for :class:`~reconciler.host.pressure.PsiWatch` (a fake tree's pressure file
    takes no trigger): records the trigger of each watch and looks as often as it would."""

    def __init__(self) -> None:
        self.armed: list[tuple[int, int] | None] = []
        self.ended = 0

    def __call__(self, sysfs: Any, path: str, trigger: tuple[int, int] | None) -> Any:
        return _Watch(self, trigger)


class _Watch:
    def __init__(self, watches: Watches, trigger: tuple[int, int] | None) -> None:
        self._watches = watches
        self._trigger = trigger
        self.mode = "trigger" if trigger is not None else "poll"

    async def run(self, stop: asyncio.Event, *, active: Callable[[], bool],
                  on_pause: Callable[[], None], **_callbacks: Any) -> None:
        self._watches.armed.append(self._trigger)
        while not stop.is_set():
            if not active():
                on_pause()
            await sleep_until(0.01, stop)
        self._watches.ended += 1


async def test_a_reload_arms_the_nodes_trigger_anew(tmp_path: Path,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    s = Setup(tmp_path, version=2)
    watches = Watches()
    monkeypatch.setattr(notified, "PsiWatch", watches)
    info = s.host_info()
    assert info.psi.system.window_us == 500_000
    psi = NodePsi(lambda: s.cfg, s.publisher, s.sysfs, info)
    stop = asyncio.Event()
    task = asyncio.create_task(psi.run(stop))
    await eventually(lambda: watches.armed == [(50_000, 500_000)])
    # another setting: the trigger stays
    s.cfg = dataclasses.replace(s.cfg, detection=dataclasses.replace(
        s.cfg.detection, interval_s=2.0))
    await asyncio.sleep(0.1)
    assert (watches.armed, watches.ended) == ([(50_000, 500_000)], 0)
    # its threshold: armed anew, the old one ended
    s.cfg = dataclasses.replace(s.cfg, detection=dataclasses.replace(
        s.cfg.detection, psi_some_low_percent=20.0))
    await eventually(lambda: watches.armed == [(50_000, 500_000), (100_000, 500_000)])
    assert watches.ended == 1
    # its window
    s.cfg = dataclasses.replace(s.cfg, detection=dataclasses.replace(
        s.cfg.detection, psi_trigger_window_ms=1000))
    await eventually(lambda: watches.armed[-1] == (200_000, 1_000_000))
    assert psi.mode == "trigger"
    stop.set()
    await asyncio.wait_for(task, BOUND_S)
    assert watches.ended == len(watches.armed) == 3


async def test_a_reload_of_the_mode_registers_the_memcg_events_anew(tmp_path: Path) -> None:
    s = Setup(tmp_path, interval_s=0.02, quiet_interval_s=0.02)
    levels = s.memcg_events()
    control = s.host.cg("memory", "kubepods/burstable") / "cgroup.event_control"
    stop = asyncio.Event()

    def registered(logs: list[MutableMapping[str, Any]]) -> list[str]:
        return [e["mode"] for e in logs if e["event"] == "pressure_level_watch"]

    with capture_logs() as logs:
        task = asyncio.create_task(levels.run(stop))
        try:
            await eventually(lambda: registered(logs) == ["local"] * 3)
            first = dict(levels._watches)
            s.cfg = dataclasses.replace(s.cfg, detection=dataclasses.replace(
                s.cfg.detection, interval_s=0.03))
            await asyncio.sleep(0.1)
            assert registered(logs) == ["local"] * 3
            s.cfg = dataclasses.replace(s.cfg, detection=dataclasses.replace(
                s.cfg.detection, pressure_level_mode="hierarchy"))
            await eventually(lambda: registered(logs) == ["local"] * 3 + ["hierarchy"] * 3)
            assert "critical,hierarchy" in control.read_text()
            assert all(levels._watches[scope] is not watch for scope, watch in first.items())
        finally:
            stop.set()
            await asyncio.wait_for(task, BOUND_S)
