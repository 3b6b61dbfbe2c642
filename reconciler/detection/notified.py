"""The detection paths the kernel wakes: the node's PSI and cgroup v1's memcg pressure events.

* **node PSI** (:class:`NodePsi`): a PSI trigger on ``/proc/pressure/memory`` when the kernel
  accepts the configured (sub-second) window, else the cumulative stall counter polled every
  ``psi_poll_interval_ms``; chosen again, and the trigger armed anew, when a reload changes its
  window or threshold; no trigger stays registered with the kernel while the psi detector is
  switched off;
* **memcg pressure events** (:class:`PressureLevels`, cgroup v1): the kernel's
  ``memory.pressure_level`` notifications of the root memcg (reclaim for the whole node) and of
  kubelet's pods and burstable cgroups (reclaim forced by their limits). The events come
  through their eventfds whatever the loop's period; the loop itself registers cgroups created
  since and gives the quiet samples that let a level go, every ``interval_s`` while a level is
  held or entered and every ``quiet_interval_s`` otherwise (an event wakes it).

Both run on the event loop (:class:`~.service.Detection` starts them).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import structlog

from common.aio import sleep_until
from reconciler.detection import detectors as d
from reconciler.detection.config import PRESSURE_LEVEL, PSI, DetectionConfig
from reconciler.detection.publisher import Publisher
from reconciler.detection.sections import DetectionSections, active, paced, period
from reconciler.detection.signals import NODE, Level, tier_scope
from reconciler.host.cgroups import BURSTABLE, GUARANTEED
from reconciler.host.parse import ParseError
from reconciler.host.pressure import PRESSURE_LEVELS, PressureLevelWatch, PsiWatch
from reconciler.host.probe import PSI_MEMORY, HostInfo
from reconciler.host.sysfs import SysFs

log = structlog.get_logger("nri_qos.detection")


def psi_path(cfg: DetectionConfig, host: HostInfo) -> tuple[str, str]:
    """How the node's PSI is watched here: ``trigger``, ``poll`` or ``off``, and why."""
    psi = host.psi
    if not psi.readable:
        return "off", psi.system.problem
    accepted = psi.system.window_us
    if accepted is not None and accepted <= cfg.psi_trigger_window_ms * 1000:
        return "trigger", (f"a trigger of {cfg.psi_trigger_window_ms} ms on {PSI_MEMORY}: "
                           "the kernel wakes the agent")
    why = (f"the shortest window the kernel accepts is {accepted // 1000} ms (without "
           "CAP_SYS_RESOURCE only multiples of 2 s)" if accepted is not None
           else f"triggers refused ({psi.system.problem})")
    return "poll", (f"the stall counter of {PSI_MEMORY} every {cfg.psi_poll_interval_ms} ms: "
                    f"no trigger of {cfg.psi_trigger_window_ms} ms, {why}")


def trigger_spec(cfg: DetectionConfig) -> tuple[int, int]:
    """The PSI trigger of ``cfg``: ``(stall_us, window_us)``, the low 'some' share of the
    window."""
    window_us = cfg.psi_trigger_window_ms * 1000
    return int(window_us * cfg.psi_some_low_percent / 100), window_us


def pressure_level_problem(host: HostInfo) -> str:
    """"" when this host has memcg pressure notifications, else why not."""
    if host.cgroup.v2:
        return "cgroup v2 has no memory.pressure_level (PSI serves instead)"
    if not host.memcg.pressure_level:
        return host.memcg.pressure_level_problem or (
            "the memory controller has no memory.pressure_level")
    return ""


class NodePsi:
    """The node's memory PSI: a trigger where the kernel accepts a short window, else a poll of
    the cumulative stall counter (never the 10-second average)."""

    def __init__(self, config: Callable[[], DetectionSections], publisher: Publisher,
                 sysfs: SysFs, host: HostInfo, *,
                 node_paces: Callable[[], bool] = lambda: True) -> None:
        """``node_paces``: whether the node's reading must be fast now (where the ladder counts
        it, or it wakes the online pods' readings); while not, a level held is read every
        ``interval_s`` instead of every ``psi_poll_interval_ms``."""
        self._config = config
        self._publisher = publisher
        self._sysfs = sysfs
        self._host = host
        self._node_paces = node_paces
        self.mode = "off"

    def choose(self, cfg: DetectionConfig) -> str:
        """``trigger``, ``poll`` or ``off``, with the reason logged once."""
        path, reason = psi_path(cfg, self._host)
        if path == "off":
            log.info("detector_unavailable", detector=PSI, reason=reason)
        else:
            log.info("psi_path", path=path, reason=reason)
        return path

    async def run(self, stop: asyncio.Event) -> None:
        """Watch until ``stop``; a reload that changes the trigger's window or threshold arms
        it anew (noticed at the watch's next look, within ``QUIET_TRIGGER_RECHECK_S``), as the
        online pods' triggers are. A reload that switches the psi detector off ends the watch,
        its trigger with it, as the online pods' triggers are disarmed: the kernel would keep
        one registered for nobody, and wake its PSI thread for it at every stall."""
        while not stop.is_set():
            cfg = self._config()
            if not active(cfg, PSI):
                self._publisher.withdraw(PSI, NODE)
                await sleep_until(period(cfg, PSI), stop)
                continue
            await self._watch(stop)

    async def _watch(self, stop: asyncio.Event) -> None:
        """One watch of the file, with the trigger of the configuration read at its start;
        returns at ``stop`` or when that trigger is no longer the configured one."""
        cfg = self._config().detection
        self.mode = self.choose(cfg)
        if self.mode == "off":
            await stop.wait()
            return
        armed = trigger_spec(cfg)
        watch = PsiWatch(self._sysfs, PSI_MEMORY, armed if self.mode == "trigger" else None)
        before: list[d.Stall | None] = [None]
        # The watch's own stop: the agent's, or a trigger no longer configured.
        done = asyncio.Event()
        relay = asyncio.create_task(stop.wait())
        relay.add_done_callback(lambda _task: done.set())

        def running() -> bool:
            now = self._config()
            if trigger_spec(now.detection) != armed or not active(now, PSI):
                done.set()
                return False
            return True

        def pause() -> None:
            before[0] = None
            if not active(self._config(), PSI):
                self._publisher.withdraw(PSI, NODE)

        def on_trigger(at: float) -> None:
            now = self._config().detection
            self._publisher.offer(PSI, [d.psi_trigger_sample(
                NODE, now.psi_trigger_window_ms, now, at)], covers=None, triggered=True)

        def on_text(text: str | None, at: float) -> None:
            before[0] = self._sample(self._config().detection, before[0], text, at)
            self.mode = watch.mode

        try:
            await watch.run(
                done, interval=self.interval,
                idle=lambda: period(self._config(), PSI),
                active=running,
                keep_reading=lambda: self._publisher.level(PSI, NODE) > Level.NONE,
                on_trigger=on_trigger, on_text=on_text, on_pause=pause)
        finally:
            relay.cancel()

    def interval(self) -> float:
        """Seconds between two reads of the counters while they are read."""
        cfg = self._config().detection
        return cfg.psi_poll_interval_ms / 1000 if self._node_paces() else cfg.interval_s

    def _sample(self, cfg: DetectionConfig, before: d.Stall | None, text: str | None,
                now: float) -> d.Stall | None:
        """One read of the counters: the stall share since the previous read, published."""
        try:
            if text is None:
                raise ParseError(f"{PSI_MEMORY} is missing")
            stall = d.read_stall(text, now)
        except ParseError as exc:
            self._publisher.offer(PSI, [d.unknown(PSI, NODE, str(exc), now)], covers=None)
            return None
        if before is not None:
            sample = d.psi_sample(NODE, before, stall, cfg)
            if sample is not None:
                self._publisher.offer(PSI, [sample], covers=None)
        return stall


class PressureLevels:
    """cgroup v1 ``memory.pressure_level`` of the root memcg and kubelet's tier cgroups."""

    def __init__(self, config: Callable[[], DetectionSections], publisher: Publisher,
                 sysfs: SysFs, host: HostInfo) -> None:
        self._config = config
        self._publisher = publisher
        self._sysfs = sysfs
        self._host = host
        layout = host.cgroup
        # Reclaim for the whole node lands on the root memcg; a tier's own limit on the tier.
        # The BestEffort tier is not watched: reclaim at the memory guard's cap is the guard
        # doing its work, not interference.
        self.targets = {NODE: layout.dir("memory", ""),
                        tier_scope("kubepods"): layout.tier_dir("memory", GUARANTEED),
                        tier_scope(BURSTABLE): layout.tier_dir("memory", BURSTABLE)}
        self._watches: dict[str, PressureLevelWatch] = {}
        # The mode the watches were registered with (the kernel takes it at registration).
        self._mode = ""
        self._events: dict[str, tuple[str, int]] = {}
        self._failed: dict[str, str] = {}
        # Set by an event that arrives while the loop waits out its quiet period.
        self._wake = asyncio.Event()
        self._quiet = False

    async def run(self, stop: asyncio.Event) -> None:
        problem = pressure_level_problem(self._host)
        if problem:
            log.info("detector_unavailable", detector=PRESSURE_LEVEL, reason=problem)
            await stop.wait()
            return
        loop = asyncio.get_running_loop()
        try:
            while not stop.is_set():
                cfg = self._config()
                if active(cfg, PRESSURE_LEVEL):
                    self._register(loop, cfg.detection.pressure_level_mode)
                    self._tick(loop.time())
                else:
                    self._close_all(loop)
                    self._publisher.withdraw(PRESSURE_LEVEL)
                self._wake.clear()
                await sleep_until(self.interval(cfg), stop, self._wake)
        finally:
            self._close_all(loop)

    def interval(self, cfg: DetectionSections) -> float:
        """``interval_s`` while a memcg pressure level is held or being entered, so that it is
        left on time after its cooldown; ``quiet_interval_s`` otherwise, when a tick would only
        give quiet samples to readings that are quiet already."""
        seconds, self._quiet = paced(cfg, (PRESSURE_LEVEL,),
                                     calm=not self._publisher.engaged((PRESSURE_LEVEL,)))
        return seconds

    def _register(self, loop: asyncio.AbstractEventLoop, mode: str) -> None:
        """Register on each target that exists and is not registered yet (kubelet may create
        its cgroups after the agent started); a reload of ``pressure_level_mode`` registers
        them all anew."""
        if mode != self._mode:
            self._close_all(loop)
            self._mode = mode
        for scope, cgroup in self.targets.items():
            if scope in self._watches or not self._sysfs.is_dir(cgroup):
                continue
            try:
                watch = PressureLevelWatch(self._sysfs, cgroup, mode)
            except OSError as exc:
                reason = f"{type(exc).__name__}: {exc.strerror or exc}"
                if self._failed.get(scope) != reason:
                    self._failed[scope] = reason
                    log.warning("pressure_level_unavailable", cgroup=cgroup, reason=reason)
                continue
            self._failed.pop(scope, None)
            self._watches[scope] = watch
            for level, fd in watch.fds.items():
                loop.add_reader(fd, self._on_event, loop, scope, level)
            log.info("pressure_level_watch", cgroup=cgroup, mode=mode)

    def _on_event(self, loop: asyncio.AbstractEventLoop, scope: str, level: str) -> None:
        watch = self._watches.get(scope)
        if watch is None:
            return
        counts = {name: watch.consume(name) for name in PRESSURE_LEVELS}
        if not watch.alive():
            # The kernel signals every registration once when the cgroup is removed.
            self._close(loop, scope)
            self._publisher.withdraw(PRESSURE_LEVEL, scope)
            log.info("pressure_level_watch_ended", cgroup=watch.cgroup, reason="cgroup removed")
            return
        # A level's eventfd also counts the events above it: the highest one with a count wins.
        worst = next((name for name in reversed(PRESSURE_LEVELS) if counts[name]), None)
        if worst is None:
            return
        now = loop.time()
        self._events[scope] = (worst, counts[worst])
        self._publisher.offer(PRESSURE_LEVEL, [d.pressure_event_sample(
            scope, worst, counts[worst], now)], covers=None, triggered=True)
        if self._quiet:  # the level's quiet samples are due from now on
            self._quiet = False
            self._wake.set()

    def _tick(self, now: float) -> None:
        """A quiet sample for each watched cgroup without events since the last tick, so a
        level is left after the cooldown."""
        quiet = [d.pressure_quiet_sample(scope, now) for scope in self._watches
                 if scope not in self._events]
        self._events.clear()
        if quiet:
            self._publisher.offer(PRESSURE_LEVEL, quiet, covers=None)

    def _close(self, loop: asyncio.AbstractEventLoop, scope: str) -> None:
        watch = self._watches.pop(scope)
        for fd in watch.fds.values():
            loop.remove_reader(fd)
        watch.close()

    def _close_all(self, loop: asyncio.AbstractEventLoop) -> None:
        for scope in list(self._watches):
            self._close(loop, scope)
