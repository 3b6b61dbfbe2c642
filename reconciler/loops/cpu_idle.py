"""The reclaimed tier at idle CPU priority: ``cpu.idle = 1`` on kubelet's BestEffort tier cgroup.

kubelet gives the BestEffort tier the lowest CPU weight, but a weight only divides CPU time
between tasks that all want it: an offline task still holds a CPU for its slice when an online
task wakes. A cgroup with ``cpu.idle`` set is scheduled as SCHED_IDLE against its siblings (Linux
5.15+, both cgroup versions): a waking task of any other cgroup preempts its tasks at once, and
they run on the CPU time nothing else wants. Set on the tier, not on each pod: idleness counts
against siblings, and an offline pod's siblings are the other offline pods.

The value the tier had goes into the state file before the first write and back when the
feature is switched off, in observe mode, when the agent stops and on ``nri-qos reset``.
kubelet does not write ``cpu.idle``; a tier cgroup it made again (a kubelet restart) is set on
the next cycle. But the kernel refuses a CPU weight to an idle cgroup (EINVAL), so kubelet's
periodic update of its QoS cgroups fails on the tier, and may skip the Burstable tier's weight
(docs/reconciler.md, *Idle CPU for the reclaimed tier*): one more reason the feature is off by
default.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import structlog

from hooks.config_fields import setting
from reconciler.host.cgroups import BESTEFFORT, CgroupLayout
from reconciler.host.statefile import StateFile, restore_noted
from reconciler.host.sysfs import SysFs
from reconciler.loops.base import Loop, ReconcilerConfig

log = structlog.get_logger("nri_qos.reconciler")

IDLE_FILE = "cpu.idle"
NOTES = "cpu_idle"
"""The state file's section: the tier's cpu.idle file -> its value before the first write."""


@dataclass(frozen=True, slots=True)
class CpuIdleConfig:
    enabled: bool = setting(
        False, "Set cpu.idle = 1 on the reclaimed (BestEffort) tier's cgroup: its tasks run "
        "only on CPU time no other task wants, and a waking online task preempts them at once "
        "(Linux 5.15+). Off: in docs/effectiveness.md (main) it halved the online pod's CPU "
        "stall but its tail stayed inside the other modes' intervals, and on a node whose CPUs "
        "are busy the offline tier gets only what online pods leave (43 % of its unmanaged work "
        "with the tier set idle by hand); an idle-priority task holding something an online "
        "task waits for (a lock in a shared file system, a pipe) is preempted too; and "
        "BestEffort pods' exec probes run at the same priority and may time out on a saturated "
        "node.")
    interval_s: float = setting(
        10.0, "How often the tier's cpu.idle is checked and set again (a kubelet restart "
        "makes the tier cgroup anew).", unit="seconds", minimum=1, maximum=3600)


class CpuIdleSections(Protocol):
    """The sections this loop reads."""

    @property
    def reconciler(self) -> ReconcilerConfig: ...

    @property
    def cpu_idle(self) -> CpuIdleConfig: ...


def restore_idle(sysfs: SysFs, notes: StateFile, reason: str) -> int:
    """Writes back the tier's cpu.idle as it was before the agent; how many files were written."""
    return restore_noted(sysfs, notes, NOTES, reason)


class CpuIdleLoop(Loop):
    name = "cpu_idle"

    def __init__(self, config: Callable[[], CpuIdleSections], sysfs: SysFs,
                 layout: CgroupLayout, notes: StateFile | None = None) -> None:
        self._config = config
        self._sysfs = sysfs
        self._path = f"{layout.tier_dir('cpu', BESTEFFORT)}/{IDLE_FILE}"
        self._notes = notes if notes is not None else StateFile(None)
        self._was_held = False
        self._warned = False

    def interval(self) -> float:
        return self._config().cpu_idle.interval_s

    def cycle(self, now: float) -> None:
        cfg = self._config()
        if not (cfg.reconciler.enabled and cfg.cpu_idle.enabled):
            self._restore("cpu idle switched off")
            return
        held = self._sysfs.held()
        if held and not self._was_held:
            self._restore("observe mode: the node is watched, not acted on")
        self._was_held = held
        current = self._sysfs.read(self._path)
        if current is None:
            if not self._warned:
                self._warned = True
                log.warning("cpu_idle_unavailable", path=self._path,
                            reason="no cpu.idle on the reclaimed tier: a kernel before 5.15, "
                                   "the cpu controller not enabled there, or no tier cgroup")
            return
        self._warned = False
        if not self._notes.remember(NOTES, self._path, current.strip()):
            return  # nothing is written that could not be undone
        self._sysfs.write_if_changed(self._path, "1", "cpu idle: the reclaimed tier runs on "
                                                      "CPU time online pods leave")

    def _restore(self, reason: str) -> None:
        if self._notes.entries(NOTES) and restore_idle(self._sysfs, self._notes, reason):
            log.info("cpu_idle_restored", reason=reason, path=self._path)

    def close(self) -> None:
        """The agent stops: the tier gets back its CPU priority."""
        self._restore("agent stopping")
