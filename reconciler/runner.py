"""Starting the reconciler: every loop (and the pod watch) in one TaskGroup until stop is set.

Each loop gets its own wake event. :class:`~common.state.NodeState` calls back from the
thread that applied an NRI event or a pod-watch change; the callback hands the ``set()`` to the
event loop with ``call_soon_threadsafe``, so a new container gets its resctrl group and settings
at once rather than at the next period. Cycles run in a thread pool owned by the reconciler (one
thread per loop), so a cgroup write that blocks in the kernel never delays NRI answers.

A loop's :meth:`~reconciler.loops.base.Loop.close` (the restore of what it changed, and the end
of its notes) comes after its last cycle, on every way out: a cancelled reconciler stops waiting
for a cycle at once, but the cycle's thread runs on and would write after the restore, an effect
then left with no note (the next run would take it for the original value). So the way out waits
for the cycles in flight, at most :data:`CLOSE_WAIT_S` (a write to a memory limit can block in
reclaim for long, and the agent must stop within its grace period); a loop whose cycle is still
running then is closed by its own thread as soon as the cycle returns (its notes stay in the
state file meanwhile, for the next start or ``nri-qos reset`` should the agent be killed first).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from concurrent.futures import Executor, Future, ThreadPoolExecutor
from typing import Any, ParamSpec, Protocol, TypeVar

import structlog

from common.aio import waker
from common.audit import AuditLog
from common.podmeta import PodMeta
from common.state import NodeState
from hooks.model import ReadKeys
from hooks.resctrl_config import ResctrlConfig
from reconciler.host.cgroups import BESTEFFORT, CgroupLayout
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
from reconciler.loops.kubelet_notes import give_back_noted
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

Subscribe = Callable[[Callable[[], None]], Callable[[], None]]
"""Subscribes a callback to changes; returns the unsubscribe function."""

CLOSE_WAIT_S = 10.0
"""How long a reconciler on its way out waits for the cycles in flight before it closes the
loops (the DaemonSet gives the agent 45 s to stop)."""

_P = ParamSpec("_P")
_T = TypeVar("_T")


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


class _CycleThread(Executor):
    """One loop's view of the reconciler's pool: its cycles run there, and the last one is kept
    to be waited for before the loop is closed (a loop runs one cycle at a time)."""

    def __init__(self, pool: ThreadPoolExecutor) -> None:
        self._pool = pool
        self.last: Future[Any] | None = None

    def submit(self, fn: Callable[_P, _T], /, *args: _P.args,
               **kwargs: _P.kwargs) -> Future[_T]:
        future = self._pool.submit(fn, *args, **kwargs)
        self.last = future
        return future

    def running(self) -> Future[Any] | None:
        """The cycle not finished yet, if any."""
        return self.last if self.last is not None and not self.last.done() else None


class _PodFeed:
    """The pod watch's pods into the node state, each with only the annotations some policy
    reads. A reload that changes those keys puts every pod the watch knows in again, trimmed
    anew: the watch reports a pod again only when the API changes it, so a pod would keep the
    old key's value and never show the new key's."""

    def __init__(self, state: NodeState, watcher: PodWatcher,
                 read_keys: Callable[[], ReadKeys]) -> None:
        self._state = state
        self._watcher = watcher
        self._read_keys = read_keys
        self._keys = read_keys()

    def __call__(self, meta: PodMeta) -> None:
        self.refresh()
        self._state.apply_meta(meta.trimmed(self._keys))

    def refresh(self) -> None:
        keys = self._read_keys()
        if keys == self._keys:
            return
        self._keys = keys
        for meta in self._watcher.known():
            self._state.apply_meta(meta.trimmed(keys))


async def run_reconciler(loops: list[Loop], state: NodeState, stop: asyncio.Event,
                         watcher: PodWatcher | None, *, read_keys: Callable[[], ReadKeys],
                         backoff_max: Callable[[], float],
                         tracker: LoopTracker | None = None,
                         close_wait_s: float = CLOSE_WAIT_S,
                         config_changes: Subscribe | None = None) -> None:
    """Run every loop, and the pod watch when given, until ``stop`` is set. The pod watch keeps
    of each pod only the annotations some policy reads (``read_keys``), trimmed anew at a
    configuration change (``config_changes`` subscribes a callback, called on the event loop,
    to them); ``tracker`` hears of every cycle. Each loop is closed after its last cycle, also
    when the reconciler is cancelled (see the module doc; ``close_wait_s``:
    :data:`CLOSE_WAIT_S`)."""
    if watcher is None:
        log.warning("reconciler_degraded", reason="no Kubernetes pod watch: NRI data only "
                    "(no priority, requests or annotation changes)")
    running = asyncio.get_running_loop()
    pool = ThreadPoolExecutor(max_workers=max(len(loops), 1),
                              thread_name_prefix="nri-qos-reconcile")
    threads = [_CycleThread(pool) for _ in loops]
    unsubscribe: list[Callable[[], None]] = []
    try:
        async with asyncio.TaskGroup() as group:
            if watcher is not None:
                feed = _PodFeed(state, watcher, read_keys)
                if config_changes is not None:
                    unsubscribe.append(config_changes(feed.refresh))
                group.create_task(watcher.run(feed, stop))
            for loop, thread in zip(loops, threads, strict=True):
                wake = asyncio.Event()
                unsubscribe.append(state.subscribe(waker(running, wake),
                                                   events=loop.wake_events,
                                                   meta=loop.wake_on_meta))
                unsubscribe.append(loop.subscribe_wake(waker(running, wake)))
                group.create_task(run_loop(loop, stop=stop, wake=wake, executor=thread,
                                           backoff_max=backoff_max, tracker=tracker),
                                  name=f"reconciler-{loop.name}")
    finally:
        for cancel in unsubscribe:
            cancel()
        # A cycle not started yet never starts; one running is waited for.
        pool.shutdown(wait=False, cancel_futures=True)
        await _close_after_cycles(loops, threads, close_wait_s)


async def _close_after_cycles(loops: list[Loop], threads: list[_CycleThread],
                              wait_s: float) -> None:
    """Close every loop after its cycle in flight, waiting at most ``wait_s`` for them; a loop
    whose cycle runs longer is closed by its thread once the cycle returns. A cancellation
    during the wait ends the wait only: the loops are closed likewise and it is raised after."""
    in_flight = [f for t in threads if (f := t.running()) is not None]
    interrupted: asyncio.CancelledError | None = None
    if in_flight:
        waiting = [asyncio.wrap_future(f) for f in in_flight]
        try:
            await asyncio.wait(waiting, timeout=wait_s)
        except asyncio.CancelledError as exc:
            interrupted = exc
        for future in waiting:
            if future.done() and not future.cancelled():
                # Taken, or asyncio would report a failed cycle as an error never retrieved.
                future.exception()
            else:
                future.cancel()  # a wait given up must not reach the event loop later
    for loop, thread in zip(loops, threads, strict=True):
        cycle = thread.running()
        if cycle is None:
            _close(loop)
            continue
        log.warning("reconciler_loop_close_deferred", loop=loop.name,
                    reason="its cycle is still running: the loop is closed when it returns")
        cycle.add_done_callback(_closer(loop))
    if interrupted is not None:
        raise interrupted


def _closer(loop: Loop) -> Callable[[Future[Any]], None]:
    """``loop``'s close as a cycle's done callback (run in the cycle's thread)."""
    return lambda _cycle: _close(loop)


def _close(loop: Loop) -> None:
    try:
        loop.close()
    except Exception:  # one loop's failure to undo must not keep the others from it
        log.exception("reconciler_loop_close_failed", loop=loop.name)


def restore_host(sysfs: SysFs, notes: StateFile, reason: str,
                 layout: CgroupLayout | None = None) -> None:
    """Writes back every host file the state file says the agent changed: the memory guard's
    tier files, the tier's cpu.idle, tuned memory.wmark_ratio, NUMA bindings and balancing, the
    protection of the pod and tier cgroups, and, given the cgroup ``layout``, the containers'
    values drift noted."""
    if layout is not None:
        give_back_noted(sysfs, layout, notes, reason)
    restore_tier(sysfs, notes, reason)
    restore_idle(sysfs, notes, reason)
    restore_protection(sysfs, notes, reason)
    restore_wmark(sysfs, notes, reason)
    restore_bindings(sysfs, notes, reason, NUMA_BALANCE_NOTES)
    restore_bindings(sysfs, notes, reason)
