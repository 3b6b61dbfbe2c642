"""The periodic detectors look every ``quiet_interval_s`` while memory is not short, every
``interval_s`` while a free-memory, PSI, memcg pressure or kswapd reading is at a level or
entering one, and at once when another path enters a level during their quiet period. cgroup
v1's memcg pressure events tick every ``interval_s`` only while one of them holds a level."""

from __future__ import annotations

import asyncio
import dataclasses
import os
from pathlib import Path

import pytest

from common.audit import AuditLog
from reconciler.detection.detectors import (
    RECLAIMED_TIER,
    pressure_event_sample,
    pressure_quiet_sample,
    psi_trigger_sample,
)
from reconciler.detection.service import PERIODIC, PRESSURE, Detection
from reconciler.detection.signals import NODE, Level, Reading, numa_scope, pod_scope, tier_scope
from tests.support.detection_env import Setup, uid
from tests.support.fakesys import GIB, MIB
from tests.support.polling import BOUND_S, eventually

KIB = 1024
CALM = (40 * GIB, 64 * GIB, 1000)
"""A NUMA node of 64 GiB with 40 free: far above its watermark W (the 1 GiB floor here)."""


def numa_reading(s: Setup, node: int) -> Reading:
    found = s.reading("numa_free", numa_scope(node))
    assert found is not None
    return found


def test_a_calm_node_is_looked_at_every_quiet_interval(tmp_path: Path) -> None:
    s = Setup(tmp_path)
    loop = s.loop()
    loop.cycle(0.0)
    assert loop.interval() == s.cfg.detection.quiet_interval_s == 5.0
    assert set(PRESSURE) - set(PERIODIC) == {"pressure_level"}  # the memcg events count too


def test_the_quiet_period_is_never_shorter_than_the_period(tmp_path: Path) -> None:
    s = Setup(tmp_path, interval_s=3.0, quiet_interval_s=0.5)
    loop = s.loop()
    loop.cycle(0.0)
    assert loop.interval() == 3.0


@pytest.mark.parametrize(("free", "expected"), [(2 * GIB, 5.0), (2 * GIB - KIB, 1.0)])
def test_one_sample_under_twice_the_watermark_brings_the_period_to_interval(
        tmp_path: Path, free: int, expected: float) -> None:
    """numa_free's low threshold is 2 x W: at it the node is calm; one KiB under it (a single
    sample, not yet a level) the next look comes after interval_s, so that the level is
    entered entry_samples - 1 periods later and not a quiet period later."""
    s = Setup(tmp_path)
    s.host.set_numa([CALM, (free, 64 * GIB, 1000)])
    loop = s.loop()
    loop.cycle(0.0)
    assert numa_reading(s, 1).level is Level.NONE
    assert loop.interval() == expected


def test_a_level_held_through_its_cooldown_keeps_the_period(tmp_path: Path) -> None:
    s = Setup(tmp_path)
    loop = s.loop()
    s.host.set_numa([CALM, (GIB - MIB, 64 * GIB, 1000)])
    loop.cycle(0.0)
    loop.cycle(1.0)
    assert numa_reading(s, 1).level is Level.MEDIUM
    s.host.set_numa([CALM, CALM])
    loop.cycle(3.0)  # the signal is gone; the level is held for exit_cooldown_s (10 s)
    assert loop.interval() == 1.0
    loop.cycle(12.999)
    assert numa_reading(s, 1).level is Level.MEDIUM
    assert loop.interval() == 1.0
    loop.cycle(13.0)
    assert numa_reading(s, 1).level is Level.NONE
    assert loop.interval() == 5.0


def test_rss_overuse_and_fulfillment_do_not_keep_the_detectors_busy(tmp_path: Path) -> None:
    """A pod above its request and an over-requested reclaimed tier say how memory is shared
    out, not that it is short: they can last for hours on a node with plenty free."""
    s = Setup(tmp_path)
    s.pod("fat", "shared_cores", request=100 * MIB, anon=300 * MIB, tier="burstable")
    s.pod("batch", "reclaimed_cores", request=2 * GIB, anon=MIB)
    (s.host.tier_dir("besteffort") / "memory.limit_in_bytes").write_text(f"{GIB}\n")
    loop = s.loop()
    loop.cycle(0.0)
    loop.cycle(5.0)
    fat = s.reading("rss_overuse", pod_scope(uid("fat")))
    tier = s.reading("fulfillment", RECLAIMED_TIER)
    assert fat is not None
    assert tier is not None
    assert (fat.level, tier.level) == (Level.HIGH, Level.MEDIUM)
    assert loop.interval() == 5.0


def test_a_level_entered_elsewhere_wakes_the_quiet_loop_once(tmp_path: Path) -> None:
    s = Setup(tmp_path)
    loop = s.loop()
    woken: list[float] = []
    unsubscribe = loop.subscribe_wake(lambda: woken.append(1.0))
    loop.cycle(0.0)
    assert loop.interval() == 5.0
    trigger = psi_trigger_sample(NODE, 500, s.cfg.detection, 0.5)
    s.publisher.offer("psi", [trigger], covers=None, triggered=True)  # the node's PSI trigger
    assert woken == [1.0]
    assert loop.interval() == 1.0
    worse = dataclasses.replace(trigger, level=Level.HIGH, at=0.6)
    s.publisher.offer("psi", [worse], covers=None, triggered=True)
    assert s.level("psi", NODE) is Level.HIGH
    assert woken == [1.0]  # woken already: the next cycle comes at once
    unsubscribe()


def test_the_loops_own_level_does_not_wake_it(tmp_path: Path) -> None:
    """Its own cycle entering a level is no reason for another cycle at once: the period after
    it is interval_s anyway."""
    s = Setup(tmp_path)
    loop = s.loop()
    woken: list[float] = []
    loop.subscribe_wake(lambda: woken.append(1.0))
    loop.cycle(0.0)
    assert loop.interval() == 5.0
    s.host.set_numa([CALM, (GIB - MIB, 64 * GIB, 1000)])
    loop.cycle(5.0)
    loop.cycle(10.0)  # no interval() between: a cycle woken by something else
    assert numa_reading(s, 1).level is Level.MEDIUM
    assert woken == []


def test_after_unsubscribing_nothing_wakes(tmp_path: Path) -> None:
    s = Setup(tmp_path)
    loop = s.loop()
    woken: list[float] = []
    loop.subscribe_wake(lambda: woken.append(1.0))()
    loop.cycle(0.0)
    assert loop.interval() == 5.0
    s.publisher.offer("psi", [psi_trigger_sample(NODE, 500, s.cfg.detection, 0.5)],
                      covers=None, triggered=True)
    assert woken == []


async def test_the_nodes_psi_wakes_the_quiet_detectors_in_the_service(tmp_path: Path) -> None:
    """With a quiet period of 10 minutes: a node under its watermark is not looked at until
    the node's PSI (the stall-counter poll on this fake tree) enters a level; then at once."""
    s = Setup(tmp_path, interval_s=0.05, quiet_interval_s=600.0, psi_poll_interval_ms=20)
    detection = Detection(lambda: s.cfg, s.board, s.state, s.sysfs, s.host_info(),
                          AuditLog(s.sink))
    stop = asyncio.Event()
    task = asyncio.create_task(detection.run(stop))
    stalled = asyncio.Event()
    try:
        await eventually(lambda: s.reading("numa_free", numa_scope(1)) is not None
                         and s.level("psi", NODE) is Level.NONE)
        s.host.set_numa([CALM, (GIB - MIB, 64 * GIB, 1000)])
        await asyncio.sleep(0.5)  # ten periods of interval_s
        assert numa_reading(s, 1).raw is Level.NONE  # not read again
        staller = asyncio.create_task(s.stall(stalled))
        try:
            await eventually(lambda: numa_reading(s, 1).level is Level.MEDIUM)
        finally:
            stalled.set()
            await staller
    finally:
        stop.set()
        await asyncio.wait_for(task, BOUND_S)


# -- cgroup v1's memcg pressure events -------------------------------------------------------------

def test_memcg_events_tick_at_interval_only_while_a_level_is_held(tmp_path: Path) -> None:
    """The events come through their eventfds whatever the period; the tick gives the quiet
    samples that let a level go after its cooldown, so it runs every interval_s while one is
    held or entered and every quiet_interval_s otherwise."""
    s = Setup(tmp_path)
    levels = s.memcg_events()
    cfg = s.cfg
    s.publisher.offer("pressure_level", [pressure_quiet_sample(NODE, 0.0)], covers=None)
    assert levels.interval(cfg) == 5.0
    s.publisher.offer("pressure_level", [pressure_event_sample(NODE, "low", 1, 1.0)],
                      covers=None, triggered=True)
    assert levels.interval(cfg) == 1.0
    s.publisher.offer("pressure_level", [pressure_quiet_sample(NODE, 2.0)], covers=None)
    s.publisher.offer("pressure_level", [pressure_quiet_sample(NODE, 11.999)], covers=None)
    assert s.level("pressure_level", NODE) is Level.LOW  # held through the 10 s cooldown
    assert levels.interval(cfg) == 1.0
    s.publisher.offer("pressure_level", [pressure_quiet_sample(NODE, 12.0)], covers=None)
    assert s.level("pressure_level", NODE) is Level.NONE
    assert levels.interval(cfg) == 5.0


@pytest.mark.parametrize(("interval_s", "quiet_interval_s", "disabled", "expected"), [
    (3.0, 0.5, (), 3.0),  # never shorter than interval_s
    (1.0, 5.0, ("pressure_level",), 10.0),  # switched off: the recheck, whatever the quiet
    (1.0, 30.0, ("pressure_level",), 10.0),
])
def test_memcg_events_period_bounds(tmp_path: Path, interval_s: float, quiet_interval_s: float,
                                    disabled: tuple[str, ...], expected: float) -> None:
    s = Setup(tmp_path, interval_s=interval_s, quiet_interval_s=quiet_interval_s,
              disabled=disabled)
    assert s.memcg_events().interval(s.cfg) == expected


async def test_a_memcg_event_wakes_the_quiet_tick(tmp_path: Path) -> None:
    """With a quiet period of 10 minutes: no tick while calm; an event enters its level at once
    and brings the ticks (the other cgroups' quiet samples) to interval_s; once the level is
    left after its cooldown, the ticks stop again."""
    s = Setup(tmp_path, interval_s=0.02, quiet_interval_s=600.0, exit_cooldown_s=0.2)
    levels = s.memcg_events()
    burstable = tier_scope("burstable")
    stop = asyncio.Event()

    def node_sampled_at() -> float:
        found = s.reading("pressure_level", NODE)
        assert found is not None
        return found.at

    task = asyncio.create_task(levels.run(stop))
    try:
        await eventually(lambda: s.reading("pressure_level", NODE) is not None)
        first = node_sampled_at()
        await asyncio.sleep(0.2)  # ten periods of interval_s
        assert node_sampled_at() == first
        os.eventfd_write(levels._watches[burstable].fds["low"], 1)
        await eventually(lambda: s.level("pressure_level", burstable) is Level.LOW)
        await eventually(lambda: node_sampled_at() > first)
        await eventually(lambda: s.level("pressure_level", burstable) is Level.NONE)
        await asyncio.sleep(0.05)  # the tick that saw the level go set the quiet period
        last = node_sampled_at()
        await asyncio.sleep(0.2)
        assert node_sampled_at() == last
    finally:
        stop.set()
        await asyncio.wait_for(task, BOUND_S)
