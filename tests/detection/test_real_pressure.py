"""Memory pressure on this machine's kernel, seen and answered by the agent's own code.

Each test confines itself to a child memcg with a small limit (:mod:`tests.support.realroot`): a
worker in a reclaimed pod's memcg writes a file larger than the limit over and over, so the kernel
reclaims continuously and waits for writeback (page cache only: no OOM kill is possible), for a
second or four.
What fires is the agent's: the memcg ``memory.pressure_level`` events (cgroup v1), the node's
PSI through whichever path the kernel allows (a trigger, or the stall-counter poll), and the
drop-cache write. Skipped without root or the v1 memory controller; PSI tests also without PSI.
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Iterator
from pathlib import Path

import pytest
from structlog.testing import capture_logs

from common.audit import AuditLog, MemoryAuditSink
from common.state import NodeState
from hooks.model import ContainerInfo, PodInfo
from nri_plugin.config.schema import Config
from reconciler.detection.notified import NodePsi, PressureLevels, psi_path
from reconciler.detection.pods import PodIndex
from reconciler.detection.publisher import Publisher
from reconciler.detection.signals import NODE, Board, Level, Reading, tier_scope
from reconciler.host.probe import HostInfo, probe_host
from reconciler.host.sysfs import SysFs
from reconciler.metrics import ReconcilerMetrics
from reconciler.mitigation.actions import Cause
from reconciler.mitigation.drop_cache import DropCacheAction
from tests.support.polling import eventually
from tests.support.pressure_worker import REACH_S
from tests.support.realroot import MIB, RealRoot, Worker, cache_drops, unavailable, usage

pytestmark = [pytest.mark.real_kernel,
              pytest.mark.skipif(bool(unavailable()), reason=unavailable() or "available")]

UID = "66666666-0000-4000-8000-000000000006"
CID = "e" * 64
LIMIT = 128 * MIB
DIRTY_MIB = 256


@pytest.fixture
def data(tmp_path: Path) -> Path:
    return tmp_path / "dirty.bin"


@pytest.fixture
def root(tmp_path: Path) -> Iterator[RealRoot]:
    with RealRoot(tmp_path, "test", LIMIT) as real:
        yield real


class Agent:
    """The detection parts of the agent, on the real root, publishing on a board."""

    def __init__(self, root: RealRoot, cfg: Config | None = None) -> None:
        self.cfg = cfg or Config()
        self.sink = MemoryAuditSink()
        self.audit = AuditLog(self.sink)
        self.sysfs = SysFs(root.root, self.audit)
        self.host: HostInfo = probe_host(self.sysfs)
        self.board = Board()
        self.publisher = Publisher(self.board, self.audit, lambda: self.cfg.detection)
        self.seen: list[Reading] = []
        self.board.subscribe(lambda: self.seen.extend(
            r for r in self.board.current() if r.level > Level.NONE))

    def first(self, detector: str) -> Reading | None:
        return next((r for r in self.seen if r.detector == detector and r.scope == NODE), None)


@pytest.fixture
def worker(root: RealRoot) -> Worker:
    memcg, _ = root.container("besteffort", UID, CID)
    return root.spawn_worker(memcg)


async def pressure(worker: Worker, data: Path, seconds: float) -> dict[str, object]:
    """Dirty page cache written over and over through the limit: reclaim waits for writeback
    (about 20-60 % of 'some' stall measured here; reading clean files makes only 3-5 %)."""
    answer = await asyncio.to_thread(worker.ask, f"dirty {data} {seconds} {DIRTY_MIB}")
    assert answer["onset"] is not None, "the limit was never hit: no pressure was made"
    return answer


async def running(task: asyncio.Task[None], stop: asyncio.Event) -> None:
    stop.set()
    await asyncio.wait_for(task, 5)


async def test_memcg_pressure_level_event(root: RealRoot, worker: Worker, data: Path) -> None:
    agent = Agent(root)
    assert agent.host.memcg.pressure_level
    levels = PressureLevels(lambda: agent.cfg, agent.publisher, agent.sysfs, agent.host)
    stop = asyncio.Event()
    task = asyncio.create_task(levels.run(stop))
    try:
        await eventually(lambda: agent.publisher.level("pressure_level", NODE) is Level.NONE
                         and any(r.detector == "pressure_level" for r in agent.board.current()))
        await pressure(worker, data, 1.0)
        await eventually(lambda: agent.first("pressure_level") is not None, 3.0)
        found = agent.first("pressure_level")
        assert found is not None
        assert found.level >= Level.LOW
        assert "memory.pressure_level" in found.reason
    finally:
        await running(task, stop)


async def test_memcg_pressure_level_watch_of_a_removed_cgroup_ends(root: RealRoot) -> None:
    agent = Agent(root)
    assert agent.host.memcg.pressure_level
    agent.cfg = dataclasses.replace(agent.cfg, detection=dataclasses.replace(
        agent.cfg.detection, interval_s=0.1))
    levels = PressureLevels(lambda: agent.cfg, agent.publisher, agent.sysfs, agent.host)
    burstable = tier_scope("burstable")

    def reading(scope: str) -> Reading | None:
        return next((r for r in agent.board.current()
                     if r.detector == "pressure_level" and r.scope == scope), None)

    stop = asyncio.Event()
    with capture_logs() as logs:
        task = asyncio.create_task(levels.run(stop))
        try:
            await eventually(lambda: reading(burstable) is not None)
            (root.memcg / "kubepods/burstable").rmdir()  # the kernel signals the registrations
            await eventually(lambda: reading(burstable) is None)
            await asyncio.sleep(0.3)  # a few more periods: not registered again
            assert reading(burstable) is None
            assert agent.seen == []  # the removal's signal is not taken for pressure
            node = reading(NODE)
            assert node is not None
            assert node.level is Level.NONE
            assert [e["cgroup"] for e in logs
                    if e["event"] == "pressure_level_watch_ended"] == [
                "/sys/fs/cgroup/memory/kubepods/burstable"]
        finally:
            await running(task, stop)


async def watch_psi(agent: Agent, worker: Worker, data: Path, seconds: float) -> Reading:
    psi = NodePsi(lambda: agent.cfg, agent.publisher, agent.sysfs, agent.host)
    stop = asyncio.Event()
    task = asyncio.create_task(psi.run(stop))
    try:
        await asyncio.sleep(0.3)  # a baseline sample of the counter (poll), or the trigger armed
        made = asyncio.create_task(pressure(worker, data, seconds))
        # The worker reaches the limit first (within its own REACH_S bound), then presses for
        # ``seconds``: in a guest under emulation on a busy machine filling the limit takes
        # tens of seconds.
        await eventually(lambda: agent.first("psi") is not None, REACH_S + seconds + 15.0)
        await made
        found = agent.first("psi")
        assert found is not None
        return found
    finally:
        await running(task, stop)


def needs_psi(host: HostInfo) -> None:
    if not host.psi.readable:
        pytest.skip("no PSI on this kernel")


async def test_node_psi_on_the_path_this_kernel_allows(root: RealRoot, worker: Worker,
                                                       data: Path) -> None:
    agent = Agent(root)
    needs_psi(agent.host)
    path, _ = psi_path(agent.cfg.detection, agent.host)
    found = await watch_psi(agent, worker, data, 3.0)
    assert found.level >= Level.LOW
    if path == "poll":
        assert found.reason.startswith("some ")  # a stall share measured between two reads
    else:
        assert found.reason.startswith("PSI trigger")


async def test_node_psi_stall_counter_poll(root: RealRoot, worker: Worker, data: Path) -> None:
    agent = Agent(root)
    needs_psi(agent.host)
    # as on a kernel that refuses every trigger
    agent.host = dataclasses.replace(agent.host, psi=dataclasses.replace(
        agent.host.psi, system=dataclasses.replace(agent.host.psi.system, window_us=None)))
    found = await watch_psi(agent, worker, data, 3.0)
    assert found.level >= Level.LOW
    assert found.reason.startswith("some ")


async def test_node_psi_trigger(root: RealRoot, worker: Worker, data: Path) -> None:
    agent = Agent(root)
    needs_psi(agent.host)
    window = agent.host.psi.system.window_us
    if window is None or window > 2_000_000:
        pytest.skip(f"no PSI trigger of 2 s or less accepted here ({agent.host.psi.system})")
    agent.cfg = dataclasses.replace(agent.cfg, detection=dataclasses.replace(
        agent.cfg.detection, psi_trigger_window_ms=window // 1000))
    # A trigger with a 2 s window reports once per window: keep the pressure up that long.
    found = await watch_psi(agent, worker, data, 3.0)
    assert found.level is Level.LOW
    assert found.reason.startswith("PSI trigger")


async def test_drop_cache_frees_a_real_pods_page_cache(root: RealRoot, tmp_path: Path) -> None:
    memcg, cgroups_path = root.container("besteffort", UID, CID)
    worker = root.spawn_worker(memcg)
    pod = memcg.parent
    agent = Agent(root)
    assert agent.host.memcg.force_empty
    state = NodeState()
    state.replace_all(
        [PodInfo(id="sandbox", uid=UID, name="batch", namespace="test",
                 annotations={"qos.nri-qos.io/level": "reclaimed_cores"})],
        [ContainerInfo(id=CID, pod_sandbox_id="sandbox", name="c", cgroups_path=cgroups_path)])
    metrics = ReconcilerMetrics()
    action = DropCacheAction(lambda: agent.cfg, agent.sysfs, agent.host,
                             PodIndex(state, agent.host.cgroup), agent.audit, metrics=metrics)
    try:
        for attempt in range(3):  # again only if the machine's page cache was dropped meanwhile
            drops = cache_drops()
            await asyncio.to_thread(worker.ask, f"write {tmp_path / f'cache{attempt}.bin'} 48")
            before = usage(pod)
            assert before >= 40 * MIB
            result = await action.engage(Cause(Level.MEDIUM), dry_run=False)
            if cache_drops() == drops:
                break
    finally:
        action.close()
    assert result.result == "done", result
    after = usage(pod)
    assert before - after >= 32 * MIB
    [finished] = agent.sink.named("drop_cache_finished")
    assert finished["path"] == f"/sys/fs/cgroup/memory/kubepods/besteffort/pod{UID}/" \
                               "memory.force_empty"
    assert finished["freed_bytes"] >= 32 * MIB
    assert metrics.registry.get_sample_value("nri_qos_drop_cache_freed_bytes_total") == (
        finished["freed_bytes"])
    assert finished["usage_before_bytes"] >= 40 * MIB
