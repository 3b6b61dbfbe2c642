"""Loop runner (wake-ups, stop, backoff) and the reconciler's TaskGroup."""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from hooks.levels import LEVEL_NAMES
from nri_plugin.audit import AuditLog, MemoryAuditSink
from nri_plugin.config.schema import Config
from nri_plugin.events import Event
from reconciler.loops.base import Loop, backoff_delay, run_loop, sleep_until
from reconciler.resctrlfs import ResctrlFs, read_info
from reconciler.runner import build_loops, run_reconciler, sysfs_for
from reconciler.state import NodeState, StateTracker
from reconciler.sysfs import SysFs
from tests.fakesys import GIB, FakeHost, read_ids


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
    assert backoff_delay(1.0, 0, 60) == 1.0
    assert [backoff_delay(1.0, f, 60) for f in (1, 2, 3, 6, 7, 100)] == [2, 4, 8, 60, 60, 60]
    assert backoff_delay(120.0, 3, 60) == 120.0  # never below the period itself


async def test_sleep_returns_on_stop_or_wake() -> None:
    stop, wake = asyncio.Event(), asyncio.Event()
    task = asyncio.create_task(sleep_until(stop, wake, 3600))
    await asyncio.sleep(0)
    wake.set()
    await asyncio.wait_for(task, 5)
    wake.clear()
    task = asyncio.create_task(sleep_until(stop, wake, 3600))
    await asyncio.sleep(0)
    stop.set()
    await asyncio.wait_for(task, 5)


async def test_wake_runs_a_cycle_at_once_and_stop_ends_the_loop() -> None:
    signal = Signal()
    loop, stop, wake = Counting(signal), asyncio.Event(), asyncio.Event()
    task = asyncio.create_task(run_loop(loop, stop=stop, wake=wake, backoff_max=lambda: 60,
                                        clock=lambda: 42.0))
    await signal.until(lambda: len(loop.calls) == 1)
    wake.set()
    await signal.until(lambda: len(loop.calls) == 2)
    assert loop.calls == [42.0, 42.0]
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
    resctrl = ResctrlFs(root, read_info(root, 2048), prefix="nriqos-", audit=audit)
    return host, NodeState(), sysfs, resctrl, sink


class Store:
    def __init__(self, cfg: Config) -> None:
        self.current = cfg


def test_sysfs_from_config(tmp_path: Path) -> None:
    cfg = Config()
    cfg = dataclasses.replace(cfg, reconciler=dataclasses.replace(
        cfg.reconciler, root=str(tmp_path)))
    assert sysfs_for(cfg, AuditLog(MemoryAuditSink())).real("/proc") == f"{tmp_path}/proc"


def test_build_loops_without_resctrl(tmp_path: Path) -> None:
    _, state, sysfs, _, sink = make_host(tmp_path)
    names = [loop.name for loop in build_loops(Store(Config()), state, sysfs, None,
                                               AuditLog(sink))]
    assert names == ["drift", "memory_guard", "numa_binding"]


async def test_reconciler_runs_every_loop_and_reacts_to_nri_events(tmp_path: Path) -> None:
    signal = Signal()
    host, state, sysfs, resctrl, sink = make_host(tmp_path, SignallingSink(signal))
    stop = asyncio.Event()
    task = asyncio.create_task(run_reconciler(Store(Config()), state, sysfs, resctrl,
                                              AuditLog(sink), stop, watcher=None))
    # memory guard and everything else ran once at start
    await signal.until(lambda: bool(sink.named("memory_guard_cap")))
    # a container started through NRI is placed at once, not after the 1 s period
    pod = host.add_pod("44444444-0000-0000-0000-000000000004", tier="besteffort",
                       memory_limit=GIB)
    tracker = StateTracker(state)
    await asyncio.to_thread(tracker.synchronize, *host.nri())
    await asyncio.to_thread(tracker.observe, Event.START_CONTAINER, pod.info,
                            pod.containers[0].info)
    tasks = host.root / "sys/fs/resctrl/nriqos-reclaimed_cores/tasks"
    await signal.until(lambda: set(read_ids(tasks)) == set(pod.containers[0].tids)
                       and bool(sink.named("numa_binding")))
    stop.set()
    await asyncio.wait_for(task, 5)


async def test_disabled_reconciler_returns_at_once(tmp_path: Path) -> None:
    _, state, sysfs, resctrl, sink = make_host(tmp_path)
    cfg = Config()
    cfg = dataclasses.replace(cfg, reconciler=dataclasses.replace(cfg.reconciler,
                                                                  enabled=False))
    await asyncio.wait_for(run_reconciler(Store(cfg), state, sysfs, resctrl, AuditLog(sink),
                                          asyncio.Event(), watcher=None), 5)
