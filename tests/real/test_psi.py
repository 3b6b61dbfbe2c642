"""PSI on a real cgroup v2 kernel that accepts short trigger windows: the node's trigger and a
pod cgroup's trigger (500 ms windows) fire under real pressure, the stall-counter poll takes
over when the kernel refuses a trigger, and an online pod's own stall wakes the periodic
detectors out of their quiet period (through the node's trigger, and through the pod's own
where the ladder does not count the node's PSI, which an offline pod's stall then no longer
does).

Pressure: a worker in an offline pod writes a file through a small ``memory.max`` over and over,
so reclaim waits for writeback of its dirty pages.
"""

from __future__ import annotations

import asyncio
import dataclasses
from pathlib import Path

import pytest

from common.audit import AuditLog, MemoryAuditSink
from common.state import NodeState
from nri_plugin.config.schema import Config
from reconciler.detection.counting import Counting
from reconciler.detection.notified import NodePsi, psi_path
from reconciler.detection.publisher import Publisher
from reconciler.detection.service import Detection
from reconciler.detection.signals import NODE, Board, Level, Reading, pod_scope
from reconciler.host.pressure import PsiWatch
from reconciler.host.probe import probe_host
from reconciler.host.sysfs import SysFs
from tests.support.guest_node import MIB, Node, one_pod, pod_infos
from tests.support.polling import eventually
from tests.support.realroot import Worker

pytestmark = pytest.mark.vm(numa=2, mem_mib=2048)

UID = "5a5a5a5a-0000-4000-8000-000000000001"
ONLINE_UID = "5a5a5a5a-0000-4000-8000-000000000002"
CID = "c" * 64
WINDOW_MS = 500


@pytest.fixture
def pressed(node: Node) -> tuple[Path, Worker]:
    cgroup, _ = node.container("besteffort", UID, CID)
    (cgroup / "memory.max").write_text(str(64 * MIB))
    return cgroup, node.worker(cgroup, cgroup)


def config(window_ms: int = WINDOW_MS) -> Config:
    """A 500 ms trigger whose threshold is 2 % of it (10 ms): how much of the writer's wait is
    memory stall rather than writeback throttling varies from run to run in a small memcg, and
    what is tested is that the kernel's trigger reaches the agent, not the default's level."""
    base = Config()
    return dataclasses.replace(base, detection=dataclasses.replace(
        base.detection, psi_trigger_window_ms=window_ms, psi_some_low_percent=2.0))


async def node_psi(cfg: Config, worker: Worker, data: Path, *, refuse: bool = False
                   ) -> tuple[str, Reading]:
    sysfs = SysFs("/")
    host = probe_host(sysfs)
    if refuse:  # as on a kernel that refuses every trigger
        host = dataclasses.replace(host, psi=dataclasses.replace(
            host.psi, system=dataclasses.replace(host.psi.system, window_us=None)))
    board = Board()
    publisher = Publisher(board, AuditLog(MemoryAuditSink()), lambda: cfg.detection)
    seen: list[Reading] = []
    board.subscribe(lambda: seen.extend(r for r in board.current()
                                        if r.detector == "psi" and r.scope == NODE
                                        and r.level > Level.NONE))
    psi = NodePsi(lambda: cfg, publisher, sysfs, host)
    stop = asyncio.Event()
    task = asyncio.create_task(psi.run(stop))
    try:
        await asyncio.sleep(0.5)  # the trigger armed, or a first sample of the counter
        mode = psi.mode
        made = asyncio.create_task(asyncio.to_thread(worker.ask, f"dirty {data} 6.0 256"))
        await eventually(lambda: bool(seen), 60.0)
        answer = await made
        assert answer["onset"] is not None
        return mode, seen[0]
    finally:
        stop.set()
        await asyncio.wait_for(task, 10)


async def test_the_node_trigger_fires_under_real_pressure(
        pressed: tuple[Path, Worker], tmp_path: Path) -> None:
    cfg = config()
    host = probe_host(SysFs("/"))
    assert psi_path(cfg.detection, host)[0] == "trigger", host.psi
    mode, reading = await node_psi(cfg, pressed[1], tmp_path / "dirty.bin")
    assert mode == "trigger"
    assert reading.reason.startswith("PSI trigger"), reading
    assert reading.level >= Level.LOW


async def test_a_refused_trigger_falls_back_to_the_stall_counter(
        pressed: tuple[Path, Worker], tmp_path: Path) -> None:
    mode, reading = await node_psi(config(), pressed[1], tmp_path / "dirty.bin", refuse=True)
    assert mode == "poll"
    assert reading.reason.startswith("some "), reading


async def test_a_pod_cgroups_trigger_fires(pressed: tuple[Path, Worker], tmp_path: Path) -> None:
    cgroup, worker = pressed
    window_us = WINDOW_MS * 1000
    watch = PsiWatch(SysFs("/"), f"{cgroup.parent}/memory.pressure",
                     (window_us // 50, window_us))  # 2 %, as config() says
    fired: list[float] = []
    stop = asyncio.Event()
    task = asyncio.create_task(watch.run(
        stop, interval=lambda: 0.1, idle=lambda: 0.5, active=lambda: True,
        keep_reading=lambda: False, on_trigger=fired.append, on_text=lambda text, at: None,
        on_pause=lambda: None))
    try:
        await asyncio.sleep(0.3)
        assert watch.mode == "trigger"  # armed: the kernel took a 500 ms window on a pod
        made = asyncio.create_task(asyncio.to_thread(
            worker.ask, f"dirty {tmp_path / 'pod.bin'} 6.0 256"))
        await eventually(lambda: bool(fired), 60.0)
        await made
        assert watch.mode == "trigger"
    finally:
        stop.set()
        await asyncio.wait_for(task, 10)


async def test_an_online_pods_stall_wakes_the_quiet_periodic_detectors(
        node: Node, tmp_path: Path) -> None:
    """An online pod's own memory.pressure is read by the periodic detectors only. With a quiet
    period of ten minutes they look again only when woken: the pod's stall is part of the
    node's, whose trigger enters a level, and the pod's reading follows at ``interval_s``."""
    base = config()
    cfg = dataclasses.replace(base, detection=dataclasses.replace(
        base.detection, quiet_interval_s=600.0))
    cgroup, cgroups_path = node.container("burstable", ONLINE_UID, CID)
    (cgroup / "memory.max").write_text(str(64 * MIB))
    worker = node.worker(cgroup, cgroup)
    state = one_pod(ONLINE_UID, "shared_cores", CID, cgroups_path, 32 * MIB)
    sysfs = SysFs("/")
    board = Board()
    detection = Detection(lambda: cfg, board, state, sysfs, probe_host(sysfs),
                          AuditLog(MemoryAuditSink()))

    def pod_level() -> Level | None:
        found = [r.level for r in board.current() if r.scope == pod_scope(ONLINE_UID)
                 and r.detector == "psi"]
        return found[0] if found else None

    stop = asyncio.Event()
    task = asyncio.create_task(detection.run(stop))
    try:
        # The first cycle (the pod's first counter reading), then the trigger armed.
        await eventually(lambda: any(r.detector == "system_free" for r in board.current()),
                         60.0)
        await asyncio.sleep(1.0)
        assert detection.node_psi.mode == "trigger"
        assert pod_level() is None  # one reading of the pod's counters is no rate yet
        made = asyncio.create_task(asyncio.to_thread(
            worker.ask, f"dirty {tmp_path / 'online.bin'} 6.0 256"))
        await eventually(lambda: (pod_level() or Level.NONE) >= Level.LOW, 60.0)
        answer = await made
        assert answer["onset"] is not None
    finally:
        stop.set()
        await asyncio.wait_for(task, 10)


async def test_an_offline_stall_leaves_the_detectors_quiet_and_an_online_stall_wakes_them(
        node: Node, tmp_path: Path) -> None:
    """cgroup v2 with ``node_signals = "auto"``: the ladder counts the online pods' own PSI,
    not the node's. Once the online pod has its own trigger, an offline pod's stall puts the
    node's PSI at a level without waking the periodic detectors (a quiet period of ten minutes)
    or having the node's PSI read every 100 ms; the online pod's stall wakes them through its
    trigger."""
    base = config()
    cfg = dataclasses.replace(base, detection=dataclasses.replace(
        base.detection, quiet_interval_s=600.0))
    offline, offline_path = node.container("besteffort", UID, CID)
    online, online_path = node.container("burstable", ONLINE_UID, "d" * 64)
    for cgroup in (offline, online):
        (cgroup / "memory.max").write_text(str(64 * MIB))
    pods, containers = pod_infos(ONLINE_UID, "shared_cores", "d" * 64, online_path, 32 * MIB)
    more_pods, more_containers = pod_infos(UID, "reclaimed_cores", CID, offline_path)
    state = NodeState()
    state.replace_all(
        [*pods, dataclasses.replace(more_pods[0], id="offline")],
        [*containers, dataclasses.replace(more_containers[0], pod_sandbox_id="offline")])
    sysfs = SysFs("/")
    board = Board()
    detection = Detection(lambda: cfg, board, state, sysfs, probe_host(sysfs),
                          AuditLog(MemoryAuditSink()),
                          counting=lambda: Counting(memcg=False, node=False))

    def reading(detector: str, scope: str) -> Reading | None:
        return next((r for r in board.current() if r.key == (detector, scope)), None)

    stop = asyncio.Event()
    task = asyncio.create_task(detection.run(stop))
    try:
        await eventually(lambda: reading("system_free", NODE) is not None, 60.0)
        await eventually(detection.triggers.complete, 10.0)
        assert detection.triggers.armed() == {ONLINE_UID}
        assert detection.node_psi.mode == "trigger"
        first = reading("system_free", NODE)
        assert first is not None
        made = asyncio.create_task(asyncio.to_thread(
            node.worker(offline, offline).ask, f"dirty {tmp_path / 'offline.bin'} 6.0 256"))
        await eventually(lambda: (r := reading("psi", NODE)) is not None
                         and r.level >= Level.LOW, 60.0)
        assert detection.node_psi.interval() == cfg.detection.interval_s
        await made
        assert reading("system_free", NODE) == first  # no periodic cycle since the first
        assert reading("psi", pod_scope(ONLINE_UID)) is None
        made = asyncio.create_task(asyncio.to_thread(
            node.worker(online, online).ask, f"dirty {tmp_path / 'online.bin'} 6.0 256"))
        await eventually(lambda: (r := reading("psi", pod_scope(ONLINE_UID))) is not None
                         and r.level >= Level.LOW, 60.0)
        answer = await made
        assert answer["onset"] is not None
    finally:
        stop.set()
        await asyncio.wait_for(task, 10)
