"""Starting the reconciler: every loop (and the pod watch) in one TaskGroup until stop is set.

Each loop gets its own wake event. :class:`~common.state.NodeState` calls back from the
thread that applied an NRI event or a pod-watch change; the callback hands the ``set()`` to the
event loop with ``call_soon_threadsafe``, so a new container gets its resctrl group and settings
at once rather than at the next period. Cycles run in a thread pool owned by the reconciler (one
thread per loop), so a cgroup write that blocks in the kernel never delays NRI answers.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Protocol

import structlog

from common.aio import waker
from common.audit import AuditLog
from common.state import NodeState
from hooks.model import ReadKeys
from hooks.resctrl_config import ResctrlConfig
from reconciler.host.cgroups import BESTEFFORT
from reconciler.host.probe import HostInfo
from reconciler.host.resctrlfs import ResctrlFs
from reconciler.host.statefile import StateFile
from reconciler.host.sysfs import SysFs
from reconciler.host.watermarks import Watermarks
from reconciler.kube import PodWatcher
from reconciler.loops.base import Loop, LoopTracker, run_loop
from reconciler.loops.common import ManagedCache, requested_outside
from reconciler.loops.cpu_idle import CpuIdleLoop, CpuIdleSections, restore_idle
from reconciler.loops.drift import DriftLoop, DriftSections
from reconciler.loops.memory_guard import MemoryGuardLoop, MemoryGuardSections, restore_tier
from reconciler.loops.memory_squeeze import GuardSqueeze
from reconciler.loops.numa_balance import NumaBalanceConfig, NumaBalanceLoop, NumaBalanceSections
from reconciler.loops.numa_binding import (
    NUMA_BALANCE_NOTES,
    NumaBindingLoop,
    NumaBindingSections,
    restore_bindings,
)
from reconciler.loops.offload import OffloadSections
from reconciler.loops.offload_loop import OffloadLoop
from reconciler.loops.protection import restore_protection
from reconciler.loops.resctrl_tasks import ResctrlTasksLoop
from reconciler.metrics import ReconcilerMetrics
from reconciler.mitigation.actions import restore_wmark

log = structlog.get_logger("nri_qos.reconciler")


class ReconcilerSections(DriftSections, MemoryGuardSections, CpuIdleSections, NumaBindingSections,
                         NumaBalanceSections, OffloadSections, Protocol):
    """Every section some loop reads (the node configuration has them all)."""

    @property
    def numa_balance(self) -> NumaBalanceConfig: ...

    @property
    def resctrl(self) -> ResctrlConfig: ...


def build_loops(config: Callable[[], ReconcilerSections], state: NodeState, sysfs: SysFs,
                host: HostInfo, resctrl: ResctrlFs | None, audit: AuditLog,
                squeeze: GuardSqueeze | None = None,
                metrics: ReconcilerMetrics | None = None, *,
                managed: ManagedCache | None = None,
                notes: StateFile | None = None,
                ladder_engaged: Callable[[], bool] = lambda: False,
                watermarks: Watermarks | None = None) -> list[Loop]:
    """The loops for this host; features switched off in the config idle inside their loop, so a
    reload can switch them on again. The resctrl loop needs a usable resctrl mount. ``squeeze``:
    the mitigation ladder's handle on the memory guard. ``managed``: the running containers'
    cache, one for every loop (and whatever else reads the same node state); a new one when
    None. ``notes``: the agent's state file (what to restore). ``ladder_engaged``: whether the
    mitigation ladder has a rung engaged (offloading holds off meanwhile). ``watermarks``: the
    zones' low watermarks, one aged reading for the loops and detection (a new one when
    None)."""
    layout = host.cgroup
    log.info("reconciler_cgroup_layout", version=layout.version, driver=layout.driver,
             root=host.root)
    if managed is None:
        managed = ManagedCache()
    if watermarks is None:
        watermarks = Watermarks(sysfs)
    loops: list[Loop] = [
        DriftLoop(config, state, sysfs, layout, host.memory_total_bytes, audit=audit,
                  managed=managed, notes=notes),
        MemoryGuardLoop(config, sysfs, layout, audit, squeeze, metrics, notes,
                        requests=lambda: requested_outside(managed.get(state.snapshot()),
                                                           BESTEFFORT),
                        watermarks=watermarks),
        CpuIdleLoop(config, sysfs, layout, notes),
        NumaBindingLoop(config, state, sysfs, layout, audit, managed=managed, notes=notes,
                        watermarks=watermarks),
        NumaBalanceLoop(config, state, sysfs, layout, audit, managed=managed, notes=notes,
                        metrics=metrics, watermarks=watermarks),
        OffloadLoop(config, state, sysfs, host, audit, ladder_engaged=ladder_engaged,
                    managed=managed, metrics=metrics),
    ]
    if resctrl is not None:
        loops.insert(0, ResctrlTasksLoop(config, state, sysfs, layout, resctrl, audit,
                                         managed=managed))
    return loops


async def run_reconciler(loops: list[Loop], state: NodeState, stop: asyncio.Event,
                         watcher: PodWatcher | None, *, read_keys: Callable[[], ReadKeys],
                         backoff_max: Callable[[], float],
                         tracker: LoopTracker | None = None) -> None:
    """Run every loop, and the pod watch when given, until ``stop`` is set. The pod watch keeps
    of each pod only the annotations some policy reads (``read_keys``); ``tracker`` hears of
    every cycle."""
    if watcher is None:
        log.warning("reconciler_degraded", reason="no Kubernetes pod watch: NRI data only "
                    "(no priority, requests or annotation changes)")
    running = asyncio.get_running_loop()
    executor = ThreadPoolExecutor(max_workers=max(len(loops), 1),
                                  thread_name_prefix="nri-qos-reconcile")
    unsubscribe: list[Callable[[], None]] = []
    try:
        async with asyncio.TaskGroup() as group:
            if watcher is not None:
                group.create_task(watcher.run(
                    lambda meta: state.apply_meta(meta.trimmed(read_keys())), stop))
            for loop in loops:
                wake = asyncio.Event()
                unsubscribe.append(state.subscribe(waker(running, wake),
                                                   events=loop.wake_events,
                                                   meta=loop.wake_on_meta))
                unsubscribe.append(loop.subscribe_wake(waker(running, wake)))
                group.create_task(run_loop(loop, stop=stop, wake=wake, executor=executor,
                                           backoff_max=backoff_max, tracker=tracker),
                                  name=f"reconciler-{loop.name}")
    finally:
        for cancel in unsubscribe:
            cancel()
        executor.shutdown(wait=False, cancel_futures=True)
        for loop in loops:
            try:
                loop.close()
            except Exception:  # one loop's failure to undo must not keep the others from it
                log.exception("reconciler_loop_close_failed", loop=loop.name)


def restore_host(sysfs: SysFs, notes: StateFile, reason: str) -> None:
    """Writes back every host file the state file says the agent changed: the memory guard's
    tier files, the tier's cpu.idle, tuned memory.wmark_ratio, NUMA bindings and balancing, the
    protection of the pod and tier cgroups."""
    restore_tier(sysfs, notes, reason)
    restore_idle(sysfs, notes, reason)
    restore_protection(sysfs, notes, reason)
    restore_wmark(sysfs, notes, reason)
    restore_bindings(sysfs, notes, reason, NUMA_BALANCE_NOTES)
    restore_bindings(sysfs, notes, reason)
