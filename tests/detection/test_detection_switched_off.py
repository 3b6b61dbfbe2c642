"""A detection path that is switched off wakes every SWITCHED_OFF_RECHECK_S, not every
``interval_s``: nothing to do until a reload switches it on, and the wake-ups cost the node."""

from __future__ import annotations

import asyncio
import dataclasses
from pathlib import Path
from typing import Any

import pytest

from common.aio import sleep_until
from reconciler.detection import notified
from reconciler.detection.config import PRESSURE_LEVEL
from reconciler.detection.notified import NodePsi
from reconciler.detection.sections import SWITCHED_OFF_RECHECK_S
from reconciler.detection.service import PERIODIC
from reconciler.host import pressure
from tests.support.detection_env import Setup


@pytest.mark.parametrize(("detection", "expected"), [
    ({}, 5.0),  # on: a calm node's quiet period (test_detection_quiet)
    ({"enabled": False}, SWITCHED_OFF_RECHECK_S),
    ({"disabled": PERIODIC}, SWITCHED_OFF_RECHECK_S),  # the memcg events are not this loop's
    ({"disabled": tuple(d for d in PERIODIC if d != "kswapd")}, 5.0),  # one left is enough
    ({"enabled": False, "interval_s": 30.0}, 30.0),  # never shorter than the period
    ({"interval_s": 30.0}, 30.0),
    ({"enabled": False, "quiet_interval_s": 60.0}, SWITCHED_OFF_RECHECK_S),  # off: not quiet
])
def test_the_periodic_detectors_wait_longer_while_switched_off(
        tmp_path: Path, detection: dict[str, Any], expected: float) -> None:
    assert SWITCHED_OFF_RECHECK_S == 10.0
    assert Setup(tmp_path, **detection).loop().interval() == expected


def test_a_reload_that_switches_detection_off_takes_the_longer_period(tmp_path: Path) -> None:
    s = Setup(tmp_path)
    loop = s.loop()
    assert loop.interval() == 5.0
    s.cfg = dataclasses.replace(s.cfg, detection=dataclasses.replace(s.cfg.detection,
                                                                     enabled=False))
    assert loop.interval() == SWITCHED_OFF_RECHECK_S
    assert PRESSURE_LEVEL not in PERIODIC


async def test_the_node_psi_switched_off_looks_again_after_the_recheck(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Started on (a poll on the fake tree), then switched off by a reload: its next sleeps
    are the recheck's."""
    s = Setup(tmp_path, interval_s=0.05, psi_poll_interval_ms=20)
    psi = NodePsi(lambda: s.cfg, s.publisher, s.sysfs, s.host_info())
    stop = asyncio.Event()
    sleeps: list[float] = []

    async def record(seconds: float, *events: asyncio.Event) -> bool:
        sleeps.append(seconds)
        if len(sleeps) == 3:
            s.cfg = dataclasses.replace(s.cfg, detection=dataclasses.replace(
                s.cfg.detection, enabled=False))
        if len(sleeps) == 5:
            stop.set()
        return await sleep_until(min(seconds, 0.01), *events)

    monkeypatch.setattr(pressure, "sleep_until", record)
    monkeypatch.setattr(notified, "sleep_until", record)  # the wait while switched off
    await asyncio.wait_for(psi.run(stop), 10)
    assert psi.mode == "poll"
    assert sleeps[:3] == [0.02] * 3  # polling while on
    assert sleeps[3:] == [SWITCHED_OFF_RECHECK_S] * 2  # then the recheck, never 0.05
