"""Each online pod's own PSI trigger (cgroup v2) wakes the quiet periodic detectors; where every
online pod has one, the node-wide readings the ladder does not count stop pacing detection (the
periodic loop's period, the node's PSI reads). Triggers here are eventfds the test signals; the
kernel's are tested in the guest (``tests/real/test_psi.py``)."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import errno
import os
from pathlib import Path
from typing import Any

import pytest
import structlog

from common.audit import AuditLog
from nri_plugin.report.features import evaluate, kubernetes_feature
from reconciler.detection.counting import Counting
from reconciler.detection.notified import NodePsi
from reconciler.detection.service import Detection
from reconciler.detection.signals import Level, numa_scope, pod_scope
from reconciler.detection.triggers import MOST_TRIGGERS, PodTriggers, pod_trigger_problem
from reconciler.host.probe import HostInfo, TriggerSupport
from tests.support.detection_env import Setup, uid
from tests.support.fakesys import GIB, MIB
from tests.support.polling import eventually

WINDOW_US = 500_000


class FakeTrigger:
    """A trigger whose descriptor is readable once the test fires it."""

    def __init__(self, path: str, stall_us: int, window_us: int) -> None:
        self.path, self.spec = path, (stall_us, window_us)
        self.fd = os.eventfd(0, os.EFD_NONBLOCK)
        self.dead = False
        self.closed = False

    def fileno(self) -> int:
        return self.fd

    def fire(self) -> None:
        os.eventfd_write(self.fd, 1)

    def gone(self) -> bool:
        with contextlib.suppress(BlockingIOError):
            os.eventfd_read(self.fd)  # consumed, as the kernel's one-shot POLLPRI is
        return self.dead

    def close(self) -> None:
        os.close(self.fd)
        self.closed = True


class Arms:
    """Arms fake triggers, refusing (EPERM) those whose path holds one of ``refuse``."""

    def __init__(self, *refuse: str) -> None:
        self.made: list[FakeTrigger] = []
        self.refuse = refuse

    def __call__(self, path: str, stall_us: int, window_us: int) -> FakeTrigger:
        if any(part in path for part in self.refuse):
            raise PermissionError(errno.EPERM, "Operation not permitted")
        trigger = FakeTrigger(path, stall_us, window_us)
        self.made.append(trigger)
        return trigger

    def live(self) -> list[FakeTrigger]:
        return [t for t in self.made if not t.closed]


def host(s: Setup, window_us: int | None = WINDOW_US) -> HostInfo:
    """The fake v2 host, whose kernel takes cgroup triggers down to ``window_us``."""
    info = s.host_info()
    assert info.pod_psi
    return dataclasses.replace(info, psi=dataclasses.replace(info.psi, cgroup=TriggerSupport(
        "/sys/fs/cgroup/kubepods/memory.pressure", window_us,
        "" if window_us is not None else "EPERM: Operation not permitted")))


def setup(tmp_path: Path, **detection: Any) -> tuple[Setup, Arms, PodTriggers]:
    s = Setup(tmp_path, version=2, **detection)
    s.pod("web", "shared_cores", request=GIB, anon=0, tier="burstable")
    s.pod("etl", "reclaimed_cores", request=0, anon=0)
    arms = Arms()
    return s, arms, PodTriggers(lambda: s.cfg, s.state, s.sysfs, host(s), arm=arms)


def slice_of(name: str) -> str:
    """What names the pod ``name`` in its cgroup path (kubelet's systemd driver)."""
    return uid(name).replace("-", "_")


def pod_cgroup(s: Setup, name: str, tier: str) -> str:
    return f"/sys/fs/cgroup/{s.host.pod_rel(tier, uid(name))}"


async def test_each_online_pod_gets_a_trigger_of_the_nodes_threshold_and_window(
        tmp_path: Path) -> None:
    s, arms, triggers = setup(tmp_path)
    triggers.sync(asyncio.get_running_loop(), lambda: None)
    assert triggers.armed() == {uid("web")}  # the offline pod has none
    [trigger] = arms.made
    assert trigger.path == f"{pod_cgroup(s, 'web', 'burstable')}/memory.pressure"
    assert trigger.spec == (50_000, 500_000)  # psi_some_low_percent (10 %) of 500 ms
    assert triggers.complete()


async def test_a_trigger_that_fires_says_the_pod_stalled(tmp_path: Path) -> None:
    _s, arms, triggers = setup(tmp_path)
    stalls: list[None] = []
    triggers.sync(asyncio.get_running_loop(), lambda: stalls.append(None))
    arms.made[0].fire()
    await eventually(lambda: len(stalls) == 1)
    await asyncio.sleep(0.05)
    assert len(stalls) == 1  # once per firing, not while the descriptor is looked at
    arms.made[0].fire()
    await eventually(lambda: len(stalls) == 2)


async def test_a_pod_gone_or_no_longer_online_loses_its_trigger(tmp_path: Path) -> None:
    s, arms, triggers = setup(tmp_path)
    loop = asyncio.get_running_loop()
    triggers.sync(loop, lambda: None)
    s.host.remove_pod(next(p for p in s.host.pods if p.info.uid == uid("web")))
    s.state.replace_all(*s.host.nri())
    triggers.sync(loop, lambda: None)
    assert arms.live() == []
    assert triggers.armed() == frozenset()
    assert triggers.complete()  # no online pod is left without one


async def test_a_new_threshold_arms_the_trigger_again(tmp_path: Path) -> None:
    s, arms, triggers = setup(tmp_path)
    loop = asyncio.get_running_loop()
    triggers.sync(loop, lambda: None)
    s.cfg = dataclasses.replace(s.cfg, detection=dataclasses.replace(
        s.cfg.detection, psi_some_low_percent=20.0, psi_trigger_window_ms=1000))
    triggers.sync(loop, lambda: None)
    assert [t.spec for t in arms.live()] == [(200_000, 1_000_000)]
    assert arms.made[0].closed


async def test_a_refused_trigger_leaves_the_node_pacing_and_is_said_once(
        tmp_path: Path) -> None:
    s, _arms, _triggers = setup(tmp_path)
    s.pod("api", "dedicated_cores", request=GIB, anon=0, tier="guaranteed")
    arms = Arms(slice_of("api"))
    triggers = PodTriggers(lambda: s.cfg, s.state, s.sysfs, host(s), arm=arms)
    loop = asyncio.get_running_loop()
    with structlog.testing.capture_logs() as logs:
        triggers.sync(loop, lambda: None)
        triggers.sync(loop, lambda: None)
    assert triggers.armed() == {uid("web")}
    assert not triggers.complete()
    said = [e for e in logs if e["event"] == "pod_triggers_unavailable"]
    assert len(said) == 1, said
    assert "PermissionError" in said[0]["reason"]
    arms.refuse = ()  # the kernel takes it now
    triggers.sync(loop, lambda: None)
    assert triggers.complete()
    for trigger in arms.live():
        trigger.close()


async def test_at_most_the_limit_of_pods_get_a_trigger(tmp_path: Path) -> None:
    s, arms, triggers = setup(tmp_path)
    for i in range(MOST_TRIGGERS - 1):  # with web: exactly the limit
        s.host.add_pod(uid(f"p{i:03d}"), tier="burstable", name=f"p{i}", memory_request=MIB,
                       annotations={"qos.nri-qos.io/level": "shared_cores"})
    s.state.replace_all(*s.host.nri())
    loop = asyncio.get_running_loop()
    triggers.sync(loop, lambda: None)
    assert MOST_TRIGGERS == 256
    assert len(triggers.armed()) == MOST_TRIGGERS
    assert triggers.complete()
    s.host.add_pod(uid("last"), tier="burstable", name="last", memory_request=MIB,
                   annotations={"qos.nri-qos.io/level": "shared_cores"})
    s.state.replace_all(*s.host.nri())
    triggers.sync(loop, lambda: None)
    assert len(triggers.armed()) == MOST_TRIGGERS
    assert not triggers.complete()
    for trigger in arms.live():
        trigger.close()


@pytest.mark.parametrize(("change", "window_us", "problem"), [
    ({"disabled": ["psi"]}, WINDOW_US, "the psi detector is off"),
    ({}, None, "the kernel refuses triggers on cgroups (EPERM: Operation not permitted)"),
    ({}, 501_000, "the shortest window the kernel accepts on a cgroup is 501 ms, more than "
                  "psi_trigger_window_ms"),
])
async def test_where_pods_cannot_have_triggers_none_is_armed(
        tmp_path: Path, change: dict[str, Any], window_us: int | None, problem: str) -> None:
    s = Setup(tmp_path, version=2, **change)
    s.pod("web", "shared_cores", request=GIB, anon=0, tier="burstable")
    arms = Arms()
    triggers = PodTriggers(lambda: s.cfg, s.state, s.sysfs, host(s, window_us), arm=arms)
    assert pod_trigger_problem(s.cfg, host(s, window_us)) == problem
    triggers.sync(asyncio.get_running_loop(), lambda: None)
    assert arms.made == []
    assert not triggers.complete()


def test_cgroup_v1_pods_have_no_trigger(tmp_path: Path) -> None:
    s = Setup(tmp_path, version=1)
    assert pod_trigger_problem(s.cfg, s.host_info()) == (
        "pods have no PSI of their own (cgroup v1, or PSI off)")


async def test_a_cgroup_removed_under_its_trigger_counts_as_without_one(tmp_path: Path) -> None:
    _s, arms, triggers = setup(tmp_path)
    stalls: list[None] = []
    loop = asyncio.get_running_loop()
    triggers.sync(loop, lambda: stalls.append(None))
    arms.made[0].dead = True
    arms.made[0].fire()
    await eventually(lambda: arms.made[0].closed)
    assert stalls == []
    assert not triggers.complete()
    triggers.sync(loop, lambda: None)  # still listed: armed again
    assert triggers.complete()
    assert len(arms.live()) == 1


async def test_a_started_pod_gets_its_trigger_at_once_and_stop_disarms_all(
        tmp_path: Path) -> None:
    """The quiet resync is 5 s away: the state's change brings the new pod's trigger."""
    s, arms, triggers = setup(tmp_path)
    stop = asyncio.Event()
    task = asyncio.create_task(triggers.run(stop, lambda: None))
    await eventually(triggers.complete)
    s.pod("api", "dedicated_cores", request=GIB, anon=0, tier="guaranteed")
    await eventually(lambda: len(triggers.armed()) == 2, 2.0)
    stop.set()
    await asyncio.wait_for(task, 5)
    assert arms.live() == []
    assert not triggers.complete()


# -- what the triggers change: who paces detection --------------------------------------------


def detection(s: Setup, counting: Counting, arms: Arms) -> Detection:
    return Detection(lambda: s.cfg, s.board, s.state, s.sysfs, host(s), AuditLog(s.sink),
                     counting=lambda: counting, arm=arms)


@pytest.mark.parametrize(("counting", "complete", "paces"), [
    (Counting(memcg=False, node=False), True, False),  # cgroup v2, node_signals = "auto"
    (Counting(memcg=False, node=False), False, True),  # some pod without a trigger
    (Counting(memcg=False, node=True), True, True),  # node_signals = "on"
])
async def test_node_wide_readings_pace_detection_where_they_count_or_wake_pods(
        tmp_path: Path, counting: Counting, complete: bool, paces: bool) -> None:
    s = Setup(tmp_path, version=2)
    s.pod("web", "shared_cores", request=GIB, anon=0, tier="burstable")
    arms = Arms() if complete else Arms(slice_of("web"))
    found = detection(s, counting, arms)
    found.triggers.sync(asyncio.get_running_loop(), lambda: None)
    assert found.node_paces() is paces
    # A NUMA node under its watermark: the periodic loop looks every interval_s only where
    # the node-wide readings pace it; the node's PSI, held at a level, is read every 100 ms
    # only then.
    s.host.set_numa([(40 * GIB, 64 * GIB, 1000), (GIB - MIB, 64 * GIB, 1000)])
    found.periodic.cycle(0.0)
    found.periodic.cycle(1.0)
    assert s.level("numa_free", numa_scope(1)) is Level.MEDIUM
    assert found.periodic.interval() == (1.0 if paces else 5.0)
    assert found.node_psi.interval() == (0.1 if paces else 1.0)
    for trigger in arms.live():
        trigger.close()


async def test_an_online_pods_own_level_paces_detection_all_the_same(tmp_path: Path) -> None:
    s = Setup(tmp_path, version=2)
    web = s.pod("web", "shared_cores", request=GIB, anon=0, tier="burstable")
    arms = Arms()
    found = detection(s, Counting(memcg=False, node=False), arms)
    found.triggers.sync(asyncio.get_running_loop(), lambda: None)
    assert not found.node_paces()
    for at, total in ((0.0, 0), (1.0, 500_000), (2.0, 1_000_000)):  # stalled half the time
        (web / "memory.pressure").write_text(
            f"some avg10=0.00 avg60=0.00 avg300=0.00 total={total}\n"
            f"full avg10=0.00 avg60=0.00 avg300=0.00 total={total}\n")
        found.periodic.cycle(at)
    level = s.level("psi", pod_scope(uid("web")))
    assert level is not None
    assert level >= Level.LOW
    assert found.periodic.interval() == 1.0
    for trigger in arms.live():
        trigger.close()


def test_a_stall_wakes_the_loop_only_in_its_quiet_period(tmp_path: Path) -> None:
    s = Setup(tmp_path, version=2)
    loop = s.loop()
    woken: list[None] = []
    loop.cycle(0.0)
    assert loop.interval() == 5.0  # quiet
    loop.stalled(lambda: woken.append(None))
    loop.stalled(lambda: woken.append(None))  # woken already: the cycle to come reads it
    assert len(woken) == 1


def test_the_node_psi_is_read_every_poll_interval_by_default(tmp_path: Path) -> None:
    s = Setup(tmp_path, version=2, psi_poll_interval_ms=250)
    psi = NodePsi(lambda: s.cfg, s.publisher, s.sysfs, s.host_info())
    assert psi.interval() == 0.25


@pytest.mark.parametrize(("window_us", "said"), [
    (WINDOW_US, "each online pod's memory.pressure, with a trigger of its own"),
    (None, "each online pod's memory.pressure, without a trigger of its own (the kernel "
           "refuses triggers on cgroups (EPERM: Operation not permitted)): the node's PSI "
           "wakes the detectors"),
])
def test_the_probe_says_whether_online_pods_have_triggers(
        tmp_path: Path, window_us: int | None, said: str) -> None:
    s = Setup(tmp_path, version=2)
    feature = evaluate(s.cfg, host(s, window_us), kubernetes_feature(s.cfg, None, ""))[
        "detection.psi"]
    assert said in feature.detail
