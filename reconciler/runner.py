"""Starting the reconciler: every loop (and the pod watch) in one TaskGroup until stop is set.

Each loop gets its own wake event. :class:`~reconciler.state.NodeState` calls back from the
thread that applied an NRI event or a pod-watch change; the callback hands the ``set()`` to the
event loop with ``call_soon_threadsafe``, so a new container gets its resctrl group and settings
at once rather than at the next period. Cycles run in a thread pool owned by the reconciler (one
thread per loop), so a cgroup write that blocks in the kernel never delays NRI answers.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Protocol

import structlog

from nri_plugin.audit import AuditLog
from nri_plugin.config.schema import Config
from reconciler.cgroups import layout_for
from reconciler.k8s import PodWatcher
from reconciler.loops.base import Loop, run_loop
from reconciler.loops.drift import DriftLoop
from reconciler.loops.memory_guard import MemoryGuardLoop
from reconciler.loops.numa_binding import NumaBindingLoop
from reconciler.loops.resctrl_tasks import ResctrlTasksLoop
from reconciler.resctrlfs import ResctrlFs
from reconciler.state import NodeState
from reconciler.sysfs import SysFs

log = structlog.get_logger("nri_qos.reconciler")


class ConfigSource(Protocol):
    """Anything holding the configuration in force (the daemon's ConfigStore)."""

    @property
    def current(self) -> Config: ...


def sysfs_for(cfg: Config, audit: AuditLog) -> SysFs:
    """The sysfs layer as the configuration asks for it (root directory, write retries)."""
    return SysFs(cfg.reconciler.root, audit, retries=cfg.reconciler.write_retries)


def build_loops(config_store: ConfigSource, state: NodeState, sysfs: SysFs,
                resctrl: ResctrlFs | None, audit: AuditLog) -> list[Loop]:
    """The loops for this host; features switched off in the config idle inside their loop, so a
    reload can switch them on again. The resctrl loop needs a usable resctrl mount."""
    def config() -> Config:
        return config_store.current

    cfg = config()
    layout = layout_for(sysfs, cfg.memory.cgroup_version, cfg.reconciler.cgroup_driver)
    log.info("reconciler_cgroup_layout", version=layout.version, driver=layout.driver,
             root=str(sysfs.root))
    loops: list[Loop] = [
        DriftLoop(config, state, sysfs, layout),
        MemoryGuardLoop(config, sysfs, layout, audit),
        NumaBindingLoop(config, state, sysfs, layout, audit),
    ]
    if resctrl is not None:
        loops.insert(0, ResctrlTasksLoop(config, state, sysfs, layout, resctrl, audit))
    return loops


async def run_reconciler(config_store: ConfigSource, state: NodeState, sysfs: SysFs,
                         resctrl: ResctrlFs | None, audit: AuditLog, stop: asyncio.Event,
                         watcher: PodWatcher | None) -> None:
    """Run every loop, and the pod watch when given, until ``stop`` is set."""
    cfg = config_store.current
    if not cfg.reconciler.enabled:
        log.info("reconciler_disabled", reason="reconciler.enabled is false")
        return
    if watcher is None:
        log.warning("reconciler_degraded", reason="no Kubernetes pod watch: NRI data only "
                    "(no priority, requests or annotation changes)")
    loops = build_loops(config_store, state, sysfs, resctrl, audit)
    running = asyncio.get_running_loop()
    executor = ThreadPoolExecutor(max_workers=len(loops), thread_name_prefix="nri-qos-reconcile")
    unsubscribe: list[Callable[[], None]] = []
    try:
        async with asyncio.TaskGroup() as group:
            if watcher is not None:
                group.create_task(watcher.run(state.apply_meta, stop))
            for loop in loops:
                wake = asyncio.Event()
                unsubscribe.append(state.subscribe(_waker(running, wake),
                                                   events=loop.wake_events,
                                                   meta=loop.wake_on_meta))
                group.create_task(run_loop(
                    loop, stop=stop, wake=wake, executor=executor,
                    backoff_max=lambda: config_store.current.reconciler.backoff_max_s,
                ), name=f"reconciler-{loop.name}")
    finally:
        for cancel in unsubscribe:
            cancel()
        executor.shutdown(wait=False, cancel_futures=True)


def _waker(running: asyncio.AbstractEventLoop, wake: asyncio.Event) -> Callable[[], None]:
    """A callback, safe from any thread, that sets ``wake`` in the event loop."""
    def set_wake() -> None:
        with contextlib.suppress(RuntimeError):  # the event loop is already closed
            running.call_soon_threadsafe(wake.set)

    return set_wake
