"""Loop runner (wake-ups, stop, backoff) and the reconciler's TaskGroup."""

from __future__ import annotations

import asyncio
import dataclasses
import threading
import time
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
from structlog.testing import capture_logs

from common.aio import Backoff, sleep_until
from common.audit import AuditLog, MemoryAuditSink
from common.state import NodeState
from hooks.events import Event
from hooks.levels import LEVEL_NAMES
from nri_plugin.agent import build_agent, probe
from nri_plugin.config.schema import Config, StatusConfig
from nri_plugin.config.store import ConfigStore
from nri_plugin.session.stub import PluginIdentity
from reconciler.detection.pods import PodIndex
from reconciler.host.cgroups import CgroupRef, parse_cgroups_path
from reconciler.host.probe import HostInfo, probe_host
from reconciler.host.resctrlfs import ResctrlFs, read_info
from reconciler.host.sysfs import SysFs
from reconciler.loops import common
from reconciler.loops.base import Loop, run_loop
from reconciler.loops.common import ManagedCache
from reconciler.runner import build_loops, run_reconciler
from tests.support.fakesys import GIB, FakeHost, read_ids
from tests.support.guard_config import standing


class Signal:
    """An asyncio.Event that any thread may set; ``until`` waits for a condition on it."""

    def __init__(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._event = asyncio.Event()

    def set(self) -> None:
        self._loop.call_soon_threadsafe(self._event.set)

    async def until(self, condition: Callable[[], bool]) -> None:
        async def wait() -> None:
            while True:
                self._event.clear()
                if condition():
                    return
                await self._event.wait()

        await asyncio.wait_for(wait(), 10)  # a guard against hanging, not a timing assertion


class Counting(Loop):
    name = "counting"

    def __init__(self, signal: Signal, fail: bool = False) -> None:
        self.calls: list[float] = []
        self.fail = fail
        self.signal = signal

    def interval(self) -> float:
        return 3600.0

    def wake_gap(self) -> float:
        return 0.0

    def cycle(self, now: float) -> None:
        self.calls.append(now)
        self.signal.set()
        if self.fail:
            raise RuntimeError("broken")


class SignallingSink(MemoryAuditSink):
    def __init__(self, signal: Signal) -> None:
        super().__init__()
        self.signal = signal

    def __call__(self, event: str, fields: Mapping[str, Any]) -> None:
        super().__call__(event, fields)
        self.signal.set()


async def test_wake_ups_keep_a_gap_between_cycles() -> None:
    signal = Signal()
    loop, stop, wake = Counting(signal), asyncio.Event(), asyncio.Event()
    loop.wake_gap = lambda: 3600.0  # type: ignore[method-assign]
    task = asyncio.create_task(run_loop(loop, stop=stop, wake=wake, backoff_max=lambda: 60))
    await signal.until(lambda: len(loop.calls) == 1)
    wake.set()
    # Without the gap a second cycle would follow at once; give it ample chance to happen.
    await asyncio.sleep(0.2)
    assert len(loop.calls) == 1
    stop.set()  # the gap is interruptible by stop
    await asyncio.wait_for(task, 10)
    assert len(loop.calls) == 1


def test_default_wake_gap() -> None:
    class Fast(Loop):
        def interval(self) -> float:
            return 1.0

    class Slow(Loop):
        def interval(self) -> float:
            return 60.0

    assert Fast().wake_gap() == 0.1
    assert Slow().wake_gap() == 1.0


def test_backoff_grows_and_is_capped() -> None:
    # A failing loop of period 1 s with a cap of 60 s: 2, 4, 8 ... 60 s.
    backoff = Backoff(1.0 * 2, max(60, 1.0))
    assert [backoff.next() for _ in range(7)] == [2, 4, 8, 16, 32, 60, 60]
    # never below the period itself
    assert Backoff(120.0 * 2, max(60, 120.0)).next() == 120.0


async def test_sleep_returns_on_stop_or_wake() -> None:
    stop, wake = asyncio.Event(), asyncio.Event()
    task = asyncio.create_task(sleep_until(3600, stop, wake))
    await asyncio.sleep(0)
    wake.set()
    assert await asyncio.wait_for(task, 5) is True
    wake.clear()
    task = asyncio.create_task(sleep_until(3600, stop, wake))
    await asyncio.sleep(0)
    stop.set()
    assert await asyncio.wait_for(task, 5) is True
    assert await sleep_until(0.001, asyncio.Event()) is False


async def test_a_sleep_on_one_event_ends_on_it_or_on_time_and_leaves_no_task() -> None:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    started = loop.time()
    assert await sleep_until(0.05, stop) is False
    assert loop.time() - started >= 0.05
    assert asyncio.all_tasks() == {asyncio.current_task()}
    task = asyncio.create_task(sleep_until(3600, stop))
    await asyncio.sleep(0)
    stop.set()
    assert await asyncio.wait_for(task, 5) is True
    # set before: no wait at all; cancelled: the cancellation reaches the caller
    assert await sleep_until(3600, stop) is True
    stop.clear()
    task = asyncio.create_task(sleep_until(3600, stop))
    await asyncio.sleep(0)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task


async def test_wake_runs_a_cycle_at_once_and_stop_ends_the_loop() -> None:
    signal = Signal()
    loop, stop, wake = Counting(signal), asyncio.Event(), asyncio.Event()
    task = asyncio.create_task(run_loop(loop, stop=stop, wake=wake, backoff_max=lambda: 60))
    await signal.until(lambda: len(loop.calls) == 1)
    wake.set()
    await signal.until(lambda: len(loop.calls) == 2)
    # Cycles get the event loop's time.
    assert loop.calls[0] <= loop.calls[1] <= asyncio.get_running_loop().time()
    stop.set()
    await asyncio.wait_for(task, 5)


async def test_a_failing_loop_backs_off_without_stopping_the_others() -> None:
    signal = Signal()
    good, bad = Counting(signal), Counting(signal, fail=True)
    stop = asyncio.Event()
    wakes = {good: asyncio.Event(), bad: asyncio.Event()}
    async with asyncio.TaskGroup() as group:
        for loop in (good, bad):
            group.create_task(run_loop(loop, stop=stop, wake=wakes[loop],
                                       backoff_max=lambda: 60))
        await signal.until(lambda: len(bad.calls) == 1 and len(good.calls) == 1)
        # while backing off, wake-ups do not turn into a busy retry of the failing loop
        for n in range(2, 6):
            wakes[bad].set()
            wakes[good].set()
            await signal.until(lambda n=n: len(good.calls) == n)  # type: ignore[misc]
        assert len(bad.calls) == 1
        stop.set()


def make_host(tmp_path: Path, sink: MemoryAuditSink | None = None
              ) -> tuple[FakeHost, NodeState, SysFs, ResctrlFs, MemoryAuditSink]:
    host = FakeHost(tmp_path, version=2, driver="systemd")
    host.set_numa([(20 * GIB, 64 * GIB, 100), (20 * GIB, 64 * GIB, 100)])
    host.set_tier_usage("besteffort", GIB)
    root = host.make_resctrl()
    for level in LEVEL_NAMES:
        host.add_resctrl_group("nriqos-" + level)
    sink = sink or MemoryAuditSink()
    audit = AuditLog(sink)
    sysfs = SysFs(tmp_path, audit)
    mount = "/" + str(root.relative_to(tmp_path))
    resctrl = ResctrlFs(sysfs, mount, read_info(sysfs, mount, 2048), prefix="nriqos-",
                        audit=audit)
    return host, NodeState(), sysfs, resctrl, sink


def host_of(sysfs: SysFs) -> HostInfo:
    return probe_host(sysfs)


class Store:
    def __init__(self, cfg: Config) -> None:
        self.current = cfg

    def get(self) -> Config:
        return self.current


def test_sysfs_from_config(tmp_path: Path) -> None:
    cfg = Config()
    cfg = dataclasses.replace(cfg, reconciler=dataclasses.replace(
        cfg.reconciler, root=str(tmp_path)))
    host, sysfs = probe(cfg, AuditLog(MemoryAuditSink()))
    assert sysfs.real("/proc") == f"{tmp_path}/proc"
    assert host.root == str(tmp_path)


def test_build_loops_without_resctrl(tmp_path: Path) -> None:
    _, state, sysfs, _, sink = make_host(tmp_path)
    names = [loop.name for loop in build_loops(Store(Config()).get, state, sysfs,
                                               host_of(sysfs), None, AuditLog(sink))]
    assert names == ["drift", "memory_guard", "cpu_idle", "numa_binding", "numa_balance",
                     "offload"]


def test_the_memory_guard_of_build_loops_keeps_what_the_node_state_requested(
        tmp_path: Path) -> None:
    """The guard's floor comes from the node state: a burstable pod's 3 GiB request keeps the
    BestEffort tier at allocatable (kubepods' memory.max, 10 GiB) minus 3 GiB."""
    host, state, sysfs, _, sink = make_host(tmp_path)
    host.set_numa([(GIB, 64 * GIB, 100), (GIB, 64 * GIB, 100)])  # full: the free cap is 1 GiB
    (host.tier_dir("guaranteed") / "memory.max").write_text(f"{10 * GIB}\n")
    pod = host.add_pod("66666666-0000-0000-0000-000000000006", tier="burstable")
    pods, containers = host.nri()
    state.replace_all(pods, [dataclasses.replace(c, memory_request=3 * GIB) for c in containers])
    assert pod.containers
    [guard] = [loop for loop in build_loops(Store(standing()).get, state, sysfs, host_of(sysfs),
                                            None, AuditLog(sink)) if loop.name == "memory_guard"]
    guard.cycle(0.0)
    assert int((host.tier_dir("besteffort") / "memory.max").read_text()) == 7 * GIB


def test_the_offloading_loop_is_held_by_the_ladder_handed_to_build_loops(tmp_path: Path) -> None:
    host, state, sysfs, _, sink = make_host(tmp_path)
    (host.tier_dir("guaranteed") / "memory.reclaim").write_text("")
    cfg = Config()
    cfg = dataclasses.replace(cfg, offload=dataclasses.replace(cfg.offload, enabled=True))
    loops = build_loops(Store(cfg).get, state, sysfs, host_of(sysfs), None, AuditLog(sink),
                        ladder_engaged=lambda: True)
    [offload] = [loop for loop in loops if loop.name == "offload"]
    offload.cycle(0.0)
    assert [r["reason"] for r in sink.named("offload_paused")] == [
        "the mitigation ladder is engaged"]


def counted_parses(monkeypatch: pytest.MonkeyPatch, delay: float = 0.0) -> list[str]:
    """The cgroups paths the running containers' cache parses, in order; each parse takes
    ``delay`` seconds more (long enough for other threads to ask meanwhile)."""
    parsed: list[str] = []

    def counting(path: str) -> CgroupRef:
        parsed.append(path)
        time.sleep(delay)
        return parse_cgroups_path(path)

    monkeypatch.setattr(common, "parse_cgroups_path", counting)
    return parsed


def test_loops_and_pod_index_share_one_parse_per_snapshot(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    host, state, sysfs, resctrl, sink = make_host(tmp_path)
    info = host_of(sysfs)
    pod = host.add_pod("55555555-0000-0000-0000-000000000005", tier="besteffort")
    odd = dataclasses.replace(pod.containers[0].info, id="odd", cgroups_path="not-a-path")
    parsed = counted_parses(monkeypatch)
    managed = ManagedCache()
    loops = build_loops(Store(Config()).get, state, sysfs, info, resctrl, AuditLog(sink),
                        managed=managed)
    index = PodIndex(state, info.cgroup, managed)
    with capture_logs() as logs:
        for round_ in range(2):  # a new snapshot each round; the odd container still runs
            state.replace_all([pod.info], [pod.containers[0].info, odd])
            for loop in loops:
                loop.cycle(float(round_))
            [memory] = index.pods()
            # Parsed once, not again for the new snapshot: the paths did not change.
            assert parsed.count("not-a-path") == 1
            assert len(parsed) == 2
    assert [e["container"] for e in logs if e["event"] == "container_skipped"] == ["odd"]
    # Every reader did its work from the shared parse.
    assert memory.uid == pod.info.uid
    tasks = host.root / "sys/fs/resctrl/nriqos-reclaimed_cores/tasks"
    assert set(read_ids(tasks)) == set(pod.containers[0].tids)
    assert [r["container"] for r in sink.named("numa_binding")] == ["c0"]


def test_readers_in_several_threads_parse_a_snapshot_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    host, state, _, _, _ = make_host(tmp_path)
    pod = host.add_pod("66666666-0000-0000-0000-000000000006", tier="besteffort", containers=3)
    odd = dataclasses.replace(pod.containers[0].info, id="odd", cgroups_path="not-a-path")
    pods, containers = host.nri()
    state.replace_all(pods, [*containers, odd])
    snapshot = state.snapshot()
    parsed = counted_parses(monkeypatch, delay=0.01)
    managed = ManagedCache()
    readers = 8
    start = threading.Barrier(readers)

    def read() -> tuple[common.Managed, ...]:
        start.wait()
        return managed.get(snapshot)

    with capture_logs() as logs, ThreadPoolExecutor(readers) as pool:
        seen = list(pool.map(lambda _: read(), range(readers)))
    assert len(parsed) == 4
    assert all(items is seen[0] for items in seen)
    assert len(seen[0]) == 3
    assert [e["container"] for e in logs if e["event"] == "container_skipped"] == ["odd"]


async def test_reconciler_runs_every_loop_and_reacts_to_nri_events(tmp_path: Path) -> None:
    signal = Signal()
    host, state, sysfs, resctrl, sink = make_host(tmp_path, SignallingSink(signal))
    stop = asyncio.Event()
    loops = build_loops(Store(standing()).get, state, sysfs, host_of(sysfs), resctrl,
                        AuditLog(sink))
    task = asyncio.create_task(run_reconciler(loops, state, stop, None,
                                              read_keys=Config().read_keys,
                                              backoff_max=lambda: 60))
    # memory guard and everything else ran once at start
    await signal.until(lambda: bool(sink.named("memory_guard_cap")))
    # a container started through NRI is placed at once, not after the 1 s period
    pod = host.add_pod("44444444-0000-0000-0000-000000000004", tier="besteffort",
                       memory_limit=GIB)
    await asyncio.to_thread(state.replace_all, *host.nri())
    await asyncio.to_thread(state.put_container, pod.info.id, pod.containers[0].info,
                            Event.START_CONTAINER)
    tasks = host.root / "sys/fs/resctrl/nriqos-reclaimed_cores/tasks"
    await signal.until(lambda: set(read_ids(tasks)) == set(pod.containers[0].tids)
                       and bool(sink.named("numa_binding")))
    stop.set()
    await asyncio.wait_for(task, 5)


def test_disabled_reconciler_is_not_started(tmp_path: Path) -> None:
    _, _, sysfs, _, sink = make_host(tmp_path)
    audit = AuditLog(sink)
    cfg = dataclasses.replace(Config(), status=StatusConfig(enabled=False))
    for enabled in (True, False):
        cfg = dataclasses.replace(cfg, reconciler=dataclasses.replace(cfg.reconciler,
                                                                      enabled=enabled))
        agent = build_agent(ConfigStore(audit, config=cfg), audit, host_of(sysfs), sysfs,
                            PluginIdentity("nri-qos", "10"), run_background=True)
        # The config watcher always; the reconciler, detection, the eviction manager and the
        # ladder only when enabled, else the one-shot restore of what an earlier run left.
        assert len(agent.services) == (5 if enabled else 2)
        assert (agent.evictor is not None) is enabled
        assert (agent.mitigation is not None) is enabled
        assert bool(agent.reconciler_fields) is enabled
        agent.executor.shutdown()
